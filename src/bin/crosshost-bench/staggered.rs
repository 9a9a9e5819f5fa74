//! Staggered senders (docs/DESIGN.md §10): buffers whose senders finish in
//! reverse order, 1 ms apart. Measured twice in the same run on the same
//! in-memory store: through the plugin's per-buffer lifecycle (one AsyncGet,
//! promise and future per buffer), and through the old design, a blocking
//! get on each key in index order, which makes buffer i wait for 0..i-1.
//! This part uses the crate's safe API (no C boundary is involved in the
//! comparison itself).
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pjrt_crosshost::kv::{KeyValueStore, MemoryStore};
use pjrt_crosshost::sync::{AsyncWorkRunner, Metrics};
use pjrt_crosshost::transfer::{CompletionKey, Receipt, ReceiveConfig, ReceiveTracker};

const BUFFERS: usize = 8;
const GAP: Duration = Duration::from_millis(1);

pub struct Staggered {
    /// Per buffer: ready minus its own completion, µs; max over buffers,
    /// median over rounds.
    pub lifecycle_worst_us: f64,
    pub sequential_worst_us: f64,
    pub rounds: usize,
    /// Completion overhead through the lifecycle, p50 over every buffer:
    /// key set → buffer ready, and key set → key deleted.
    pub set_to_ready_p50_us: f64,
    pub set_to_retired_p50_us: f64,
}

/// Sets the buffers' keys last-to-first, `GAP` apart; returns set times.
fn complete_in_reverse(
    store: &Arc<MemoryStore>,
    keys: &[CompletionKey],
    start: Instant,
) -> Vec<Duration> {
    let mut set_at = vec![Duration::ZERO; keys.len()];
    for i in (0..keys.len()).rev() {
        // Pacing the senders (not synchronisation): sleep until this
        // buffer's completion time.
        let due = GAP * (keys.len() - 1 - i) as u32;
        if let Some(left) = due.checked_sub(start.elapsed()) {
            std::thread::sleep(left);
        }
        set_at[i] = start.elapsed();
        store
            .set(keys[i].as_str(), &Receipt::Ok { nonce: i as u64 }.encode())
            .expect("memory store set");
    }
    set_at
}

fn worst(ready: &[Duration], set_at: &[Duration]) -> f64 {
    ready
        .iter()
        .zip(set_at)
        .map(|(r, s)| r.saturating_sub(*s).as_secs_f64() * 1e6)
        .fold(0.0, f64::max)
}

pub fn measure(rounds: usize) -> Staggered {
    let store = Arc::new(MemoryStore::new());
    let tracker = ReceiveTracker::new(
        store.clone() as Arc<dyn KeyValueStore>,
        Arc::new(AsyncWorkRunner::new("bench-staggered", 2)),
        Arc::new(Metrics::new()),
        ReceiveConfig::default(),
    );
    let (mut lifecycle, mut sequential) = (Vec::new(), Vec::new());
    let (mut to_ready, mut to_retired) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        // Per-buffer lifecycle.
        let keys: Vec<CompletionKey> = (0..BUFFERS)
            .map(|i| CompletionKey::new("bench-staggered", round as i64, i as u64).unwrap())
            .collect();
        let start = Instant::now();
        let ready = Arc::new(Mutex::new(vec![Duration::ZERO; BUFFERS]));
        let retired = Arc::new(Mutex::new(vec![Duration::ZERO; BUFFERS]));
        let pending: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                let receive = tracker
                    .begin(k.clone(), i as u64, Vec::new())
                    .expect("begin");
                let ready = ready.clone();
                receive
                    .future()
                    .on_ready(move |_| ready.lock()[i] = start.elapsed());
                let retired = retired.clone();
                receive
                    .retired()
                    .on_ready(move |_| retired.lock()[i] = start.elapsed());
                receive
            })
            .collect();
        let set_at = complete_in_reverse(&store, &keys, start);
        for p in &pending {
            p.future().wait().expect("lifecycle receive");
            let _ = p.retired().wait();
        }
        lifecycle.push(worst(&ready.lock(), &set_at));
        for (i, set) in set_at.iter().enumerate() {
            to_ready.push(ready.lock()[i].saturating_sub(*set).as_secs_f64() * 1e6);
            to_retired.push(retired.lock()[i].saturating_sub(*set).as_secs_f64() * 1e6);
        }

        // The old design: wait for key 0, then key 1, ...
        let keys: Vec<CompletionKey> = (0..BUFFERS)
            .map(|i| CompletionKey::new("bench-sequential", round as i64, i as u64).unwrap())
            .collect();
        let start = Instant::now();
        let waiter = {
            let store = store.clone();
            let keys = keys.clone();
            std::thread::spawn(move || {
                keys.iter()
                    .map(|k| {
                        store
                            .get(k.as_str(), Duration::from_secs(10))
                            .expect("sequential get");
                        start.elapsed()
                    })
                    .collect::<Vec<_>>()
            })
        };
        let set_at = complete_in_reverse(&store, &keys, start);
        let ready = waiter.join().expect("sequential waiter");
        sequential.push(worst(&ready, &set_at));
        for k in &keys {
            let _ = store.delete(k.as_str());
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    Staggered {
        lifecycle_worst_us: median(&mut lifecycle),
        sequential_worst_us: median(&mut sequential),
        rounds,
        set_to_ready_p50_us: median(&mut to_ready),
        set_to_retired_p50_us: median(&mut to_retired),
    }
}
