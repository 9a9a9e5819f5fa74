//! `--kv etcd`: the same cross-process transfers over two key-value stores
//! in one run, case by case: the parent's memory store through the PJRT KV
//! callbacks for every key (`kv_store=callbacks`; the child reaches it over
//! the Unix socket), and etcd for every key (`kv_store=etcd://...`, each
//! process its own connection and lease). Without `--etcd` the benchmark
//! runs its own etcd server (the library's `kv::etcd::local_server`).
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::ffi_client::{Plugin, Result};
use crate::kv::{self, CallbackTarget, LocalStore};
use crate::{stats, Case, Pair};
use pjrt_crosshost::kv::etcd::endpoints;
use pjrt_crosshost::kv::etcd::local_server::{self, LocalEtcd};
use pjrt_crosshost::transfer::keys::is_transfer_key;

/// How long in-flight key deletes may take to land before the count.
const SETTLE: Duration = Duration::from_secs(2);

fn cases(quick: bool) -> Vec<Case> {
    if quick {
        return Case::list(&[(4 << 10, 1, 5), (4 << 10, 64, 2), (1 << 20, 1, 3)]);
    }
    Case::list(&[
        (4 << 10, 1, 31),
        (4 << 10, 64, 7),
        (64 << 10, 1, 15),
        (1 << 20, 1, 15),
        (1 << 20, 64, 5),
        (16 << 20, 1, 5),
    ])
}

/// `--etcd` as the plugin's `kv_store` value (the scheme may be left off).
fn kv_store_of(etcd: &str) -> String {
    if etcd.starts_with(endpoints::SCHEME) {
        etcd.to_string()
    } else {
        format!("{}{etcd}", endpoints::SCHEME)
    }
}

/// The `etcdctl --endpoints` list for a `kv_store=etcd://a,b` value, parsed
/// as the plugin parses it.
fn endpoints_of(kv_store: &str) -> Result<String> {
    endpoints::parse(kv_store)
        .map(|list| list.join(","))
        .map_err(|e| format!("--etcd: {}", e.message))
}

/// Transfer keys in etcd now, and every other `crosshost/` key.
fn etcd_keys(endpoints: &str) -> Result<(usize, usize)> {
    let keys = local_server::keys(endpoints, "crosshost/")?;
    let transfer = keys.iter().filter(|k| is_transfer_key(k)).count();
    Ok((transfer, keys.len() - transfer))
}

/// Counts transfer keys until none is left or `SETTLE` has passed (the
/// receiver's deletes after its buffers are ready may still be in flight).
/// The first count, the last, and how long it took to reach the last.
fn settled_count(count: impl Fn() -> Result<usize>) -> Result<(usize, usize, Duration)> {
    let start = Instant::now();
    let first = count()?;
    let mut last = first;
    while last > 0 && start.elapsed() < SETTLE {
        // Polling a remote count: the store has no "empty" notification.
        std::thread::sleep(Duration::from_millis(50));
        last = count()?;
    }
    Ok((first, last, start.elapsed()))
}

pub fn run(lib: &str, quick: bool, etcd: Option<String>) -> Result<()> {
    // Declared before the pairs, so dropped after them: their clients revoke
    // their leases at destroy, which needs the server still up.
    let server = match etcd {
        Some(_) => None,
        None => Some(LocalEtcd::start("bench").map_err(|e| {
            format!("--kv etcd without --etcd starts its own etcd server: {e} (or pass --etcd etcd://HOST:PORT)")
        })?),
    };
    let (kv_store, owned) = match (&etcd, &server) {
        (Some(e), _) => (kv_store_of(e), false),
        (None, Some(s)) => (s.kv_store(), true),
        (None, None) => unreachable!("started above"),
    };
    let endpoints = endpoints_of(&kv_store)?;
    if !local_server::healthy(&endpoints) {
        return Err(format!(
            "etcd at {endpoints} does not answer `etcdctl endpoint health` (is it running, and is etcdctl installed?)"
        ));
    }

    let plugin = Plugin::load(lib)?;
    let store = Arc::new(LocalStore::default());
    let dir = std::env::temp_dir().join(format!("crosshost-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let socket = dir.join("kv.sock");
    let _ = std::fs::remove_file(&socket);
    let result = (|| -> Result<()> {
        kv::serve(store.clone(), &socket).map_err(|e| format!("KV server: {e}"))?;
        let target = Box::new(CallbackTarget(store.clone()));
        println!(
            "pjrt-crosshost benchmark, KV stores compared: two processes on this host, v2 CrossHostSend/ReceiveBuffers, host backend;"
        );
        println!(
            "every key (session and transfer) in the parent's memory store through the KV callbacks (kv_store=callbacks),\nand in etcd ({kv_store}{}, each process its own connection and lease).\n",
            if owned {
                ", started by the benchmark, data on /dev/shm"
            } else {
                ""
            }
        );
        let pid = std::process::id();
        let mut memory = Pair::start(
            &plugin,
            lib,
            &socket,
            &target,
            &format!("bench-{pid}-kv-memory"),
            1 << 30,
            Some("callbacks"),
        )?;
        let mut over_etcd = Pair::start(
            &plugin,
            lib,
            &socket,
            &target,
            &format!("bench-{pid}-kv-etcd"),
            1 << 30,
            Some(&kv_store),
        )?;
        // Case by case, one store then the other, so both see the same
        // machine (this host is shared and noisy).
        let mut rows = Vec::new();
        for (n, case) in cases(quick).iter().enumerate() {
            let m = memory.run(n, case)?;
            let e = over_etcd.run(n, case)?;
            rows.push((m, e));
        }

        // Transfer keys while the clients are alive: the plugin's own
        // deletes. (Closing a client revokes its lease, which removes its
        // keys regardless, so the count after closing proves less.)
        let memory_keys =
            settled_count(|| Ok(store.keys().iter().filter(|k| is_transfer_key(k)).count()))?;
        let etcd_live = settled_count(|| etcd_keys(&endpoints).map(|(t, _)| t))?;
        let (memory_receiver, memory_sender) = memory.finish()?;
        let (etcd_receiver, etcd_sender) = over_etcd.finish()?;
        let (etcd_transfer_after, etcd_other_after) = etcd_keys(&endpoints)?;
        let memory_left = store.keys();
        let memory_transfer_after = memory_left.iter().filter(|k| is_transfer_key(k)).count();

        stats::print_kv_comparison(&stats::KvComparison {
            rows: &rows,
            kv_store: &kv_store,
            memory_transfer_keys: memory_keys,
            memory_transfer_keys_after_close: memory_transfer_after,
            memory_other_keys_after_close: memory_left.len() - memory_transfer_after,
            etcd_transfer_keys_live: etcd_live,
            etcd_transfer_keys_after_close: etcd_transfer_after,
            etcd_other_keys_after_close: etcd_other_after,
            memory_metrics: (memory_receiver, memory_sender),
            etcd_metrics: (etcd_receiver, etcd_sender),
        });
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}
