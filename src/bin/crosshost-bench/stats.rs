//! Measurements beside the transfers (memcpy, in-process latency) and the
//! report table with the targets of docs/DESIGN.md §10.
use std::sync::Arc;
use std::time::Instant;

use crate::ffi_client::{monotonic_ns, OptionValue, Plugin, Result};

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap());
    values[values.len() / 2]
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let i = ((values.len() as f64 - 1.0) * p).round() as usize;
    values[i]
}

pub struct Row {
    pub bytes: usize,
    pub batch: usize,
    /// Median GB/s (decimal) of the whole batch, send call to last ready.
    pub gbps: f64,
    pub total_us: f64,
    /// Receiver ready minus sender's send-event ready, per buffer.
    pub notify_p50_us: f64,
    pub notify_p99_us: f64,
}

impl Row {
    pub fn new(bytes: usize, batch: usize, totals_ns: &[u64], notify_ns: &[i64]) -> Row {
        let mut total_us: Vec<f64> = totals_ns.iter().map(|&t| t as f64 / 1e3).collect();
        let total = median(&mut total_us);
        let mut notify: Vec<f64> = notify_ns.iter().map(|&t| t as f64 / 1e3).collect();
        Row {
            bytes,
            batch,
            gbps: (bytes * batch) as f64 / (total * 1e3),
            total_us: total,
            notify_p50_us: percentile(&mut notify, 0.5),
            notify_p99_us: percentile(&mut notify, 0.99),
        }
    }
}

pub struct Memcpy {
    pub bytes: usize,
    pub warm_gbps: f64,
    pub fresh_gbps: f64,
}

/// Single-thread memcpy of `bytes`: into warm (already faulted) memory and
/// into freshly allocated pages. Medians of 5 and 3 runs.
pub fn measure_memcpy(bytes: usize) -> Memcpy {
    let src: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let mut warm = vec![1u8; bytes];
    let mut w = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        warm.copy_from_slice(&src);
        w.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    std::hint::black_box(&warm);
    let mut f = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let mut fresh = Vec::<u8>::with_capacity(bytes);
        // SAFETY-free: extend_from_slice writes every byte once into new pages.
        fresh.extend_from_slice(&src);
        f.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        std::hint::black_box(&fresh);
    }
    Memcpy {
        bytes,
        warm_gbps: median(&mut w),
        fresh_gbps: median(&mut f),
    }
}

pub struct InProcess {
    pub total_p50_us: f64,
    pub notify_p50_us: f64,
    pub runs: usize,
}

/// 4 KiB one-buffer transfers between two clients of this process sharing
/// the in-memory store: send call → ready, and key set → ready.
pub fn in_process_latency(plugin: &Arc<Plugin>, quick: bool) -> Result<InProcess> {
    let store = format!("memory:bench-local-{}", std::process::id());
    let options = |node: i64| {
        vec![
            ("num_devices", OptionValue::Int(1)),
            ("node_id", OptionValue::Int(node)),
            ("num_nodes", OptionValue::Int(2)),
            ("kv_store", OptionValue::Str(store.clone())),
            ("session", OptionValue::Str("local".into())),
        ]
    };
    let other = {
        let plugin = plugin.clone();
        let o = options(1);
        std::thread::spawn(move || plugin.create_client(&o, None))
    };
    let sender = plugin.create_client(&options(0), None)?;
    let receiver = other.join().map_err(|_| "receiver thread panicked")??;
    let data = vec![7u8; 4096];
    let source = sender.buffer_from_host(&data, 0)?;
    let runs = if quick { 20 } else { 500 };
    let (mut totals, mut notify) = (Vec::new(), Vec::new());
    for i in 0..runs {
        let key = [i as i64];
        let buffers = receiver.receive(0, &[4096], 0, &key)?;
        let ready = receiver.watch(vec![receiver.ready_event(&buffers[0])?])?;
        let t0 = monotonic_ns();
        let sent = sender
            .watch(sender.send(&[&source], 1, &key)?)?
            .wait(crate::WAIT)?;
        let r = ready.wait(crate::WAIT)?;
        totals.push((r[0] - t0) as f64 / 1e3);
        notify.push((r[0] as i64 - sent[0] as i64) as f64 / 1e3);
    }
    Ok(InProcess {
        total_p50_us: median(&mut totals),
        notify_p50_us: median(&mut notify),
        runs,
    })
}

pub struct KvReport {
    pub transfer_keys_left: usize,
    pub other_keys_left: usize,
    pub served: u64,
    pub serving_ns: u64,
    pub receiver_metrics: String,
    pub sender_metrics: String,
}

fn size_name(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

/// JAX 0.10.2's socket transfer path on this kind of machine (docs/DESIGN.md §10).
fn jax_reference_gbps(bytes: usize, batch: usize) -> Option<f64> {
    match (bytes, batch) {
        (b, 1) if b == 256 << 20 => Some(0.64),
        (b, 64) if b == 1 << 20 => Some(1.91),
        (b, 1) if b == 4 << 10 => Some(4096.0 / 450.0 / 1e3),
        _ => None,
    }
}

pub fn print_report(
    rows: &[Row],
    unpooled: &Row,
    memcpy: &Memcpy,
    local: &InProcess,
    staggered: &crate::staggered::Staggered,
    wake: &crate::wake::Wake,
    kv: &KvReport,
) {
    println!(
        "memcpy (single thread, {}): warm {:.2} GB/s, into fresh pages {:.2} GB/s\n",
        size_name(memcpy.bytes),
        memcpy.warm_gbps,
        memcpy.fresh_gbps
    );
    println!(
        "{:>9} {:>5} {:>10} {:>11} {:>10} {:>10} {:>8} {:>8} {:>9}",
        "size", "batch", "GB/s", "total µs", "rdy p50µs", "rdy p99µs", "/fresh", "/warm", "/JAX"
    );
    for r in rows {
        let jax = jax_reference_gbps(r.bytes, r.batch)
            .map(|j| format!("{:.1}x", r.gbps / j))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:>9} {:>5} {:>10.3} {:>11.1} {:>10.1} {:>10.1} {:>7.2}x {:>7.2}x {:>9}",
            size_name(r.bytes),
            r.batch,
            r.gbps,
            r.total_us,
            r.notify_p50_us,
            r.notify_p99_us,
            r.gbps / memcpy.fresh_gbps,
            r.gbps / memcpy.warm_gbps,
            jax
        );
    }
    println!(
        "{:>9} {:>5} {:>10.3} {:>11.1} {:>10.1} {:>10.1} {:>7.2}x {:>7.2}x   (receiver pool off: fresh region per buffer)",
        size_name(unpooled.bytes), unpooled.batch, unpooled.gbps, unpooled.total_us, unpooled.notify_p50_us,
        unpooled.notify_p99_us, unpooled.gbps / memcpy.fresh_gbps, unpooled.gbps / memcpy.warm_gbps
    );
    println!("\nrdy = receiver's buffer ready minus the sender's send event for the same buffer, across processes. The sender's event fires just after it sets the completion key, so a fast receiver can come out slightly negative.");
    println!("\nin-process (two clients, shared memory store), 4 KiB x1 over {} runs: send → ready p50 {:.1} µs; sender's event → receiver ready p50 {:.1} µs", local.runs, local.total_p50_us, local.notify_p50_us);
    println!(
        "\nthread wake-up on this machine (park/unpark, {} wakes): p50 {:.1} µs back to back, {:.1} µs after {} ms idle. \
         A small transfer across processes waits for three (the sender's control reader, the receiver's, the lifecycle runner).",
        wake.wakes,
        wake.back_to_back_p50_us,
        wake.after_idle_p50_us,
        wake.idle.as_millis()
    );
    println!(
        "\nstaggered senders (8 buffers completing last-to-first, 1 ms apart, {} rounds): worst buffer ready after its own completion: per-buffer lifecycle {:.1} µs, old sequential waits {:.1} µs",
        staggered.rounds, staggered.lifecycle_worst_us, staggered.sequential_worst_us
    );
    println!("\nKV store (owned by the benchmark): transfer keys left {}, session keys left {}; {} requests served for the child, {:.1} ms spent serving them (blocking waits excluded)",
        kv.transfer_keys_left, kv.other_keys_left, kv.served, kv.serving_ns as f64 / 1e6);
    println!(
        "plugin metrics: receiver {}\n                sender   {}",
        kv.receiver_metrics, kv.sender_metrics
    );
    let find =
        |bytes: usize, batch: usize| rows.iter().find(|r| r.bytes == bytes && r.batch == batch);
    println!("\ntargets (docs/DESIGN.md §10), measured in this run:");
    let fresh = unpooled.gbps / memcpy.fresh_gbps;
    println!(
        "  {} cross-process, receiver pool off, >= 0.8x memcpy into fresh pages: {:.2}x  {}",
        size_name(unpooled.bytes),
        fresh,
        verdict(fresh >= 0.8)
    );
    if let Some(r) = find(unpooled.bytes, 1) {
        println!(
            "  {} with the receiver's pre-faulted pool >= 0.6x warm memcpy:          {:.2}x  {}",
            size_name(r.bytes),
            r.gbps / memcpy.warm_gbps,
            verdict(r.gbps / memcpy.warm_gbps >= 0.6)
        );
    }
    let jax_ok = rows
        .iter()
        .filter_map(|r| jax_reference_gbps(r.bytes, r.batch).map(|j| r.gbps / j))
        .fold(f64::INFINITY, f64::min);
    if jax_ok.is_finite() {
        println!(
            "  >= 4x JAX's socket path at every reference size:        min {:.1}x  {}",
            jax_ok,
            verdict(jax_ok >= 4.0)
        );
    }
    if let Some(r) = find(1 << 20, 64) {
        println!(
            "  64 x 1 MiB >= NIXL's 5.4 GB/s:                            {:.2} GB/s  {}",
            r.gbps,
            verdict(r.gbps >= 5.4)
        );
        println!(
            "  64 x 1 MiB per-buffer readiness p50 < 183 µs:             {:.1} µs  {}",
            r.notify_p50_us,
            verdict(r.notify_p50_us < 183.0)
        );
    }
    println!(
        "  completion overhead p50 <= 20 µs (memory store, key set -> ready -> key deleted): {:.1} µs  {}  (set -> ready {:.1} µs)",
        staggered.set_to_retired_p50_us,
        verdict(staggered.set_to_retired_p50_us <= 20.0),
        staggered.set_to_ready_p50_us
    );
    println!(
        "  4 KiB one-buffer in-process <= 50 µs:                     {:.1} µs  {}",
        local.total_p50_us,
        verdict(local.total_p50_us <= 50.0)
    );
    println!(
        "  zero transfer keys left in a deleting store:              {}  {}",
        kv.transfer_keys_left,
        verdict(kv.transfer_keys_left == 0)
    );
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "NOT met"
    }
}

/// `--kv etcd`: the same cases over the memory store (through the KV
/// callbacks) and over etcd, with what each store holds afterwards.
pub struct KvComparison<'a> {
    /// Per case: (memory store, etcd).
    pub rows: &'a [(Row, Row)],
    pub kv_store: &'a str,
    /// Transfer keys with the clients alive: first count, count once the
    /// last deletes landed (or the wait ran out), and the time that took.
    pub memory_transfer_keys: (usize, usize, std::time::Duration),
    pub memory_transfer_keys_after_close: usize,
    pub memory_other_keys_after_close: usize,
    pub etcd_transfer_keys_live: (usize, usize, std::time::Duration),
    pub etcd_transfer_keys_after_close: usize,
    pub etcd_other_keys_after_close: usize,
    /// (receiver, sender) metrics JSON.
    pub memory_metrics: (String, String),
    pub etcd_metrics: (String, String),
}

/// One integer field of the plugin's flat metrics JSON.
fn metric(json: &str, name: &str) -> String {
    let tag = format!("\"{name}\":");
    json.find(&tag)
        .map(|i| {
            json[i + tag.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
        })
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "?".into())
}

fn key_counters(json: &str) -> String {
    format!(
        "keys_created {} keys_deleted {}",
        metric(json, "keys_created"),
        metric(json, "keys_deleted")
    )
}

fn live_keys(counts: &(usize, usize, std::time::Duration)) -> String {
    let (first, last, took) = counts;
    if first == last {
        format!("{last}")
    } else {
        format!(
            "{last} ({first} at the first count, {:.0} ms earlier)",
            took.as_secs_f64() * 1e3
        )
    }
}

pub fn print_kv_comparison(c: &KvComparison) {
    println!(
        "{:>9} {:>5}   {:^32}   {:^32}   {:>8}",
        "", "", "memory store (callbacks)", "etcd", "etcd/mem"
    );
    println!(
        "{:>9} {:>5}   {:>11} {:>10} {:>9}   {:>11} {:>10} {:>9}   {:>8}",
        "size", "batch", "total µs", "rdy p50µs", "GB/s", "total µs", "rdy p50µs", "GB/s", "total"
    );
    for (m, e) in c.rows {
        println!(
            "{:>9} {:>5}   {:>11.1} {:>10.1} {:>9.3}   {:>11.1} {:>10.1} {:>9.3}   {:>7.2}x",
            size_name(m.bytes),
            m.batch,
            m.total_us,
            m.notify_p50_us,
            m.gbps,
            e.total_us,
            e.notify_p50_us,
            e.gbps,
            e.total_us / m.total_us
        );
    }
    println!("\nmedians per case. total = sender's send call to the last buffer ready on the receiver; rdy = receiver's buffer ready minus the sender's send event for the same buffer (the completion overhead), across processes; GB/s = bytes x batch / total; etcd/mem = etcd's total over the memory store's.");
    println!(
        "\nmemory store: transfer keys left {} with the clients alive, {} after they closed; other keys left {}",
        live_keys(&c.memory_transfer_keys),
        c.memory_transfer_keys_after_close,
        c.memory_other_keys_after_close
    );
    println!(
        "etcd ({}): transfer keys left (crosshost/recv/, crosshost/desc/) {} with the clients alive, {} after they closed (leases revoked); other crosshost/ keys left {}",
        c.kv_store,
        live_keys(&c.etcd_transfer_keys_live),
        c.etcd_transfer_keys_after_close,
        c.etcd_other_keys_after_close
    );
    println!(
        "plugin metrics, memory store: receiver {}; sender {}",
        key_counters(&c.memory_metrics.0),
        key_counters(&c.memory_metrics.1)
    );
    println!(
        "plugin metrics, etcd:         receiver {}; sender {}",
        key_counters(&c.etcd_metrics.0),
        key_counters(&c.etcd_metrics.1)
    );
    println!(
        "\n  zero transfer keys left in etcd (clients alive): {}  {}",
        c.etcd_transfer_keys_live.1,
        verdict(c.etcd_transfer_keys_live.1 == 0 && c.etcd_transfer_keys_after_close == 0)
    );
    println!(
        "  zero transfer keys left in the memory store:     {}  {}",
        c.memory_transfer_keys.1,
        verdict(c.memory_transfer_keys.1 == 0 && c.memory_transfer_keys_after_close == 0)
    );
}
