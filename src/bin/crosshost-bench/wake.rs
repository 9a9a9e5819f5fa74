//! What one wake-up of a sleeping thread costs on this machine, measured in
//! the same run as the transfers: a small transfer across processes is a
//! chain of them (the sender's control reader, the receiver's control
//! reader, the lifecycle runner), and on a virtual machine a wake-up that
//! lands on an idle, halted vCPU costs several times one that lands on a
//! busy core. The figure puts the 4 KiB rows beside their floor.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::ffi_client::monotonic_ns;

/// "Back to back": the next wake-up this soon after the last.
const BACK_TO_BACK_GAP: Duration = Duration::from_micros(20);

pub struct Wake {
    pub wakes: usize,
    /// Median µs from `unpark` to the parked thread running, the waker
    /// waking it again 20 µs after it ran.
    pub back_to_back_p50_us: f64,
    /// The same after the machine was left idle for `idle` first.
    pub after_idle_p50_us: f64,
    pub idle: Duration,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap());
    values[values.len() / 2]
}

/// `wakes` wake-ups of a parked thread (a futex wait), each preceded by
/// `idle` of sleep on the waker's side; µs from the unpark to the wakee
/// running.
fn measure_once(wakes: usize, idle: Duration) -> Vec<f64> {
    // Generation n is announced with the time it was sent; the wakee answers
    // with the generation it saw and its delay.
    let sent_at = Arc::new(AtomicU64::new(0));
    let generation = Arc::new(AtomicU64::new(0));
    let (tx, rx) = crossbeam_channel::bounded::<f64>(1);
    let wakee = {
        let sent_at = sent_at.clone();
        let generation = generation.clone();
        std::thread::spawn(move || {
            let mut seen = 0;
            while seen < wakes as u64 {
                let now_generation = generation.load(Ordering::Acquire);
                if now_generation == seen {
                    std::thread::park();
                    continue;
                }
                let delay = monotonic_ns().saturating_sub(sent_at.load(Ordering::Acquire));
                seen = now_generation;
                if tx.send(delay as f64 / 1e3).is_err() {
                    return;
                }
            }
        })
    };
    let mut delays = Vec::with_capacity(wakes);
    for n in 1..=wakes as u64 {
        if idle.is_zero() {
            // Long enough for the wakee to be parked again, too short for
            // its core to halt; this core stays busy meanwhile.
            let until = std::time::Instant::now() + BACK_TO_BACK_GAP;
            while std::time::Instant::now() < until {
                std::hint::spin_loop();
            }
        } else {
            std::thread::sleep(idle);
        }
        sent_at.store(monotonic_ns(), Ordering::Release);
        generation.store(n, Ordering::Release);
        wakee.thread().unpark();
        match rx.recv() {
            Ok(delay) => delays.push(delay),
            Err(_) => break,
        }
    }
    let _ = wakee.join();
    delays
}

pub fn measure(quick: bool) -> Wake {
    let wakes = if quick { 200 } else { 1000 };
    let idle = Duration::from_millis(1);
    Wake {
        wakes,
        back_to_back_p50_us: median(measure_once(wakes, Duration::ZERO)),
        after_idle_p50_us: median(measure_once(wakes, idle)),
        idle,
    }
}
