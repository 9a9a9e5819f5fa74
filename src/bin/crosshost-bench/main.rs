//! crosshost-bench: the project's main job. Drives the plugin only through
//! its C API (dlopen + GetPjrtApi), like a real runtime, and measures
//! cross-process transfers on this host against memcpy measured in the same
//! run, with the targets of docs/DESIGN.md §10 beside the figures.
//!
//! With no flags: the parent (node 0, sender) owns the KV store and serves
//! the child (node 1, receiver) over a Unix socket; both hand it to the
//! plugin through the PJRT KV callbacks plus the delete extension.
//!
//! `--kv etcd [--etcd etcd://HOST:PORT]`: the same transfers with every key
//! in the parent's memory store through the callbacks (`kv_store=callbacks`)
//! and in etcd (`kv_store=etcd://...`), side by side (kv_compare.rs).
mod child_link;
mod common;
mod ffi_client;
mod kv;
mod kv_compare;
mod staggered;
mod stats;
mod wake;

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};

use child_link::ChildLink;
use std::sync::Arc;

use common::{library_path, pattern, receive_and_check, Case, WAIT};
use ffi_client::{monotonic_ns, OptionValue, Plugin, Result};
use kv::{CallbackTarget, LocalStore, RemoteStore};
use pjrt_crosshost::transfer::keys::is_transfer_key;

fn cases(quick: bool) -> Vec<Case> {
    if quick {
        return Case::list(&[(4 << 10, 1, 3), (1 << 20, 8, 2), (16 << 20, 1, 2)]);
    }
    Case::list(&[
        (4 << 10, 1, 31),
        (4 << 10, 64, 7),
        (64 << 10, 1, 15),
        (64 << 10, 64, 5),
        (1 << 20, 1, 15),
        (1 << 20, 64, 5),
        (16 << 20, 1, 5),
        (16 << 20, 16, 3),
        (64 << 20, 1, 3),
        (256 << 20, 1, 3),
    ])
}

/// The create options of one process of a pair; `kv_store` only when asked
/// for (the default mode passes none and gets the plugin's default store).
fn job_options(
    node: i64,
    session: &str,
    pool_bytes: i64,
    kv_store: Option<&str>,
) -> Vec<(&'static str, OptionValue)> {
    let mut options = vec![
        ("shm_pool_bytes", OptionValue::Int(pool_bytes)),
        ("num_devices", OptionValue::Int(1)),
        ("node_id", OptionValue::Int(node)),
        ("num_nodes", OptionValue::Int(2)),
        ("session", OptionValue::Str(session.to_string())),
        ("receive_timeout_ms", OptionValue::Int(60_000)),
        ("send_timeout_ms", OptionValue::Int(60_000)),
        ("session_timeout_ms", OptionValue::Int(60_000)),
    ];
    if let Some(store) = kv_store {
        options.push(("kv_store", OptionValue::Str(store.to_string())));
    }
    options
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let result = if let Some(socket) = flag("--child") {
        let pool = flag("--pool-bytes")
            .and_then(|p| p.parse().ok())
            .unwrap_or(1 << 30);
        run_child(
            &library_path(flag("--lib")),
            &socket,
            flag("--session").unwrap_or_default(),
            pool,
            flag("--kv-store"),
        )
    } else if args.iter().any(|a| a == "--help" || a == "-h") {
        println!(
            "usage: crosshost-bench [--quick] [--case BYTES,BATCH,REPEATS ...] [--lib PATH]\n  two-process transfer benchmark (see docs/benchmarks.md); --case runs only the cases named\n\n\
             usage: crosshost-bench --kv etcd [--etcd etcd://HOST:PORT[,HOST:PORT...]] [--quick] [--lib PATH]\n  \
             the same transfers with every key in the parent's memory store through the KV callbacks\n  \
             (kv_store=callbacks) and in etcd (kv_store=etcd://...), side by side; without --etcd it\n  \
             starts its own etcd server (/usr/bin/etcd, data on /dev/shm) and removes it afterwards"
        );
        Ok(())
    } else if let Some(kv) = flag("--kv") {
        match kv.as_str() {
            "etcd" => kv_compare::run(
                &library_path(flag("--lib")),
                args.iter().any(|a| a == "--quick"),
                flag("--etcd"),
            ),
            other => Err(format!(
                "--kv {other:?}: the only store to compare with is etcd (--kv etcd)"
            )),
        }
    } else if args.iter().any(|a| a == "--kv") {
        Err("--kv needs a value: --kv etcd".to_string())
    } else {
        chosen_cases(&args).and_then(|chosen| {
            run_parent(
                &library_path(flag("--lib")),
                args.iter().any(|a| a == "--quick"),
                chosen,
            )
        })
    };
    if let Err(e) = result {
        eprintln!("crosshost-bench: {e}");
        std::process::exit(1);
    }
}

// ---------------------------------- child -----------------------------------

fn run_child(
    lib: &str,
    socket: &str,
    session: String,
    pool_bytes: i64,
    kv_store: Option<String>,
) -> Result<()> {
    let plugin = Plugin::load(lib)?;
    let target = Box::new(CallbackTarget(Arc::new(RemoteStore::new(
        std::path::Path::new(socket),
    ))));
    let client = plugin.create_client(
        &job_options(1, &session, pool_bytes, kv_store.as_deref()),
        Some(&kv::callbacks(&target)),
    )?;
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    for line in stdin.lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["recv", bytes, batch, key_base, seed] => {
                let parse = |s: &str| s.parse::<usize>().map_err(|e| e.to_string());
                let (bytes, batch, key_base, seed) =
                    (parse(bytes)?, parse(batch)?, parse(key_base)?, parse(seed)?);
                receive_and_check(&client, &mut out, (bytes, batch, key_base, seed), 0)?;
            }
            ["metrics"] => {
                writeln!(out, "metrics {}", client.metrics_json()).map_err(|e| e.to_string())?;
                out.flush().map_err(|e| e.to_string())?;
            }
            ["quit"] => break,
            _ => return Err(format!("child: unknown command {line:?}")),
        }
    }
    Ok(())
}

// --------------------------------- parent -----------------------------------

/// One sender/receiver pair: this process and a child, in their own session.
struct Pair {
    link: ChildLink,
    client: ffi_client::Client,
    peer_device: i32,
    key_base: usize,
}

impl Pair {
    fn start(
        plugin: &Arc<Plugin>,
        lib: &str,
        socket: &std::path::Path,
        target: &CallbackTarget,
        session: &str,
        pool_bytes: i64,
        kv_store: Option<&str>,
    ) -> Result<Pair> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut command = Command::new(exe);
        command.args([
            "--child",
            socket.to_str().unwrap(),
            "--lib",
            lib,
            "--session",
            session,
            "--pool-bytes",
            &pool_bytes.to_string(),
        ]);
        if let Some(store) = kv_store {
            command.args(["--kv-store", store]);
        }
        let child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawning the receiver process: {e}"))?;
        let link = ChildLink::new(child)?;
        let client = plugin.create_client(
            &job_options(0, session, pool_bytes, kv_store),
            Some(&kv::callbacks(target)),
        )?;
        let peer_device = client.addressable_device_ids()?[0] + 1;
        Ok(Pair {
            link,
            client,
            peer_device,
            key_base: 0,
        })
    }

    fn run(&mut self, n: usize, case: &Case) -> Result<stats::Row> {
        let data = pattern(case.bytes, n);
        let sources = (0..case.batch)
            .map(|_| self.client.buffer_from_host(&data, 0))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&ffi_client::Buffer> = sources.iter().collect();
        let mut totals = Vec::new();
        let mut notify = Vec::new();
        for _ in 0..case.repeats {
            self.link.send(&format!(
                "recv {} {} {} {}",
                case.bytes, case.batch, self.key_base, n
            ))?;
            self.link.expect("armed")?;
            let keys: Vec<i64> = (0..case.batch)
                .map(|i| (self.key_base + i) as i64)
                .collect();
            self.key_base += case.batch;
            let t0 = monotonic_ns();
            let events = self.client.send(&refs, self.peer_device, &keys)?;
            let sent = self.client.watch(events)?.wait(WAIT)?;
            let ready: Vec<u64> = self
                .link
                .expect("ready")?
                .split_whitespace()
                .map(|w| w.parse::<u64>().map_err(|e| e.to_string()))
                .collect::<Result<_>>()?;
            let last = *ready.iter().max().unwrap();
            totals.push(last.saturating_sub(t0));
            for (r, s) in ready.iter().zip(&sent) {
                notify.push(*r as i64 - *s as i64);
            }
        }
        Ok(stats::Row::new(case.bytes, case.batch, &totals, &notify))
    }

    /// Receiver's and sender's plugin metrics; ends the child.
    fn finish(mut self) -> Result<(String, String)> {
        self.link.send("metrics")?;
        let child_metrics = self.link.expect("metrics")?;
        drop(self.link);
        Ok((child_metrics, self.client.metrics_json()))
    }
}

/// The cases named by `--case BYTES,BATCH,REPEATS` (repeatable), if any: to
/// look at one case (under strace or perf) without the whole list.
fn chosen_cases(args: &[String]) -> Result<Option<Vec<Case>>> {
    let mut chosen = Vec::new();
    for (i, arg) in args.iter().enumerate() {
        if arg != "--case" {
            continue;
        }
        let value = args.get(i + 1).map(String::as_str).unwrap_or_default();
        let parts: Vec<usize> = value
            .split(',')
            .map(|p| p.trim().parse::<usize>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| format!("--case {value:?}: {e} (expected BYTES,BATCH,REPEATS)"))?;
        match parts.as_slice() {
            &[bytes, batch, repeats] if bytes > 0 && batch > 0 && repeats > 0 => {
                chosen.push(Case {
                    bytes,
                    batch,
                    repeats,
                })
            }
            _ => {
                return Err(format!(
                    "--case {value:?}: expected three positive numbers BYTES,BATCH,REPEATS"
                ))
            }
        }
    }
    Ok((!chosen.is_empty()).then_some(chosen))
}

fn run_parent(lib: &str, quick: bool, chosen: Option<Vec<Case>>) -> Result<()> {
    let plugin = Plugin::load(lib)?;
    let store = Arc::new(LocalStore::default());
    let dir = std::env::temp_dir().join(format!("crosshost-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let socket = dir.join("kv.sock");
    kv::serve(store.clone(), &socket).map_err(|e| format!("KV server: {e}"))?;
    let target = Box::new(CallbackTarget(store.clone()));

    println!(
        "pjrt-crosshost benchmark: two processes on this host, v2 CrossHostSend/ReceiveBuffers,"
    );
    println!(
        "KV store owned by the parent (served to the child over a Unix socket), host backend.\n"
    );
    let memcpy = stats::measure_memcpy(if quick { 16 << 20 } else { 256 << 20 });

    // Receiver with its pool of pre-faulted segments (the default).
    let mut pooled = Pair::start(
        &plugin,
        lib,
        &socket,
        &target,
        &format!("bench-{}-pool", std::process::id()),
        1 << 30,
        None,
    )?;
    let mut rows = Vec::new();
    for (n, case) in chosen.unwrap_or_else(|| cases(quick)).iter().enumerate() {
        rows.push(pooled.run(n, case)?);
    }
    let (receiver_metrics, sender_metrics) = pooled.finish()?;

    // Receiver without the pool: every destination is a fresh region.
    let mut fresh = Pair::start(
        &plugin,
        lib,
        &socket,
        &target,
        &format!("bench-{}-fresh", std::process::id()),
        0,
        None,
    )?;
    let largest = if quick {
        Case {
            bytes: 16 << 20,
            batch: 1,
            repeats: 2,
        }
    } else {
        Case {
            bytes: 256 << 20,
            batch: 1,
            repeats: 3,
        }
    };
    let unpooled = fresh.run(1000, &largest)?;
    fresh.finish()?;

    let keys = store.keys();
    let transfer_keys = keys.iter().filter(|k| is_transfer_key(k)).count();
    let in_process = stats::in_process_latency(&plugin, quick)?;
    let staggered = staggered::measure(if quick { 5 } else { 21 });
    let wake = wake::measure(quick);
    stats::print_report(
        &rows,
        &unpooled,
        &memcpy,
        &in_process,
        &staggered,
        &wake,
        &stats::KvReport {
            transfer_keys_left: transfer_keys,
            other_keys_left: keys.len() - transfer_keys,
            served: store.served.load(std::sync::atomic::Ordering::Relaxed),
            serving_ns: store.serving_ns.load(std::sync::atomic::Ordering::Relaxed),
            receiver_metrics,
            sender_metrics,
        },
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
