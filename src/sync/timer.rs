//! `DeadlineTimer`: one thread that runs callbacks at deadlines (receive
//! timeouts, delayed re-polls). Entries are cancellable. Callbacks run on the
//! timer thread, outside the lock, and must be short: the receive path only
//! hops onto the `AsyncWorkRunner` from them.
//!
//! Dropping the timer stops its thread; entries still pending are dropped
//! without running.
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

type Callback = Box<dyn FnOnce() + Send + 'static>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TimerId(u64);

struct Entries {
    /// Deadlines, possibly including cancelled ids (removed lazily).
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
    live: HashMap<u64, Callback>,
    next_id: u64,
    shutdown: bool,
}

struct Shared {
    entries: Mutex<Entries>,
    changed: Condvar,
}

pub struct DeadlineTimer {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl DeadlineTimer {
    pub fn new(name: &str) -> DeadlineTimer {
        let shared = Arc::new(Shared {
            entries: Mutex::new(Entries {
                heap: BinaryHeap::new(),
                live: HashMap::new(),
                next_id: 0,
                shutdown: false,
            }),
            changed: Condvar::new(),
        });
        let s = shared.clone();
        let thread = thread::Builder::new()
            .name(name.to_string())
            .spawn(move || run(&s))
            .expect("spawn DeadlineTimer thread");
        DeadlineTimer {
            shared,
            thread: Mutex::new(Some(thread)),
        }
    }

    /// Runs `callback` once `delay` has passed, unless cancelled first.
    pub fn schedule_after(
        &self,
        delay: Duration,
        callback: impl FnOnce() + Send + 'static,
    ) -> TimerId {
        let deadline = Instant::now() + delay;
        let mut entries = self.shared.entries.lock();
        let id = entries.next_id;
        entries.next_id += 1;
        // The thread sleeps until the earliest deadline: only a new earliest
        // one needs to wake it. Most entries (a receive's or a request's
        // timeout) are later than one already waiting, and waking the
        // thread for each cost every transfer a context switch.
        let earliest = entries
            .heap
            .peek()
            .is_none_or(|Reverse((first, _))| deadline < *first);
        entries.heap.push(Reverse((deadline, id)));
        entries.live.insert(id, Box::new(callback));
        // Keep cancelled leftovers from piling up under long deadlines.
        if entries.heap.len() > 64 && entries.heap.len() > 2 * entries.live.len() {
            let Entries { heap, live, .. } = &mut *entries;
            heap.retain(|Reverse((_, id))| live.contains_key(id));
        }
        drop(entries);
        if earliest {
            self.shared.changed.notify_one();
        }
        TimerId(id)
    }

    /// Returns true if the entry was pending (it will never run now).
    pub fn cancel(&self, id: TimerId) -> bool {
        self.shared.entries.lock().live.remove(&id.0).is_some()
    }

    pub fn pending(&self) -> usize {
        self.shared.entries.lock().live.len()
    }
}

impl Drop for DeadlineTimer {
    fn drop(&mut self) {
        let dropped = {
            let mut entries = self.shared.entries.lock();
            entries.shutdown = true;
            entries.heap.clear();
            std::mem::take(&mut entries.live)
        };
        self.shared.changed.notify_all();
        drop(dropped);
        if let Some(handle) = self.thread.lock().take() {
            super::runner::join_all_except_current(vec![handle], "DeadlineTimer");
        }
    }
}

fn run(shared: &Shared) {
    let mut entries = shared.entries.lock();
    loop {
        if entries.shutdown {
            return;
        }
        let now = Instant::now();
        let mut due = Vec::new();
        let mut next = None;
        while let Some(Reverse((deadline, id))) = entries.heap.peek().copied() {
            if !entries.live.contains_key(&id) {
                entries.heap.pop();
            } else if deadline <= now {
                entries.heap.pop();
                due.extend(entries.live.remove(&id));
            } else {
                next = Some(deadline);
                break;
            }
        }
        if !due.is_empty() {
            drop(entries);
            for callback in due {
                let run = std::panic::AssertUnwindSafe(callback);
                if std::panic::catch_unwind(run).is_err() {
                    log::error!("DeadlineTimer: a callback panicked; the timer keeps running");
                }
            }
            entries = shared.entries.lock();
            continue;
        }
        match next {
            Some(deadline) => {
                shared.changed.wait_until(&mut entries, deadline);
            }
            None => shared.changed.wait(&mut entries),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crossbeam_channel::bounded;

    #[test]
    fn entries_fire_in_deadline_order() {
        let timer = DeadlineTimer::new("test-timer");
        let (tx, rx) = bounded(3);
        for (delay, tag) in [(30u64, 3), (10, 1), (20, 2)] {
            let tx = tx.clone();
            timer.schedule_after(Duration::from_millis(delay), move || tx.send(tag).unwrap());
        }
        let got: Vec<i32> = (0..3).map(|_| rx.recv().unwrap()).collect();
        assert_eq!(got, vec![1, 2, 3]);
    }

    #[test]
    fn cancelled_entries_never_fire() {
        let timer = DeadlineTimer::new("test-timer");
        let (tx, rx) = bounded(2);
        let t = tx.clone();
        let cancelled = timer.schedule_after(Duration::from_millis(1), move || t.send(1).unwrap());
        assert!(timer.cancel(cancelled));
        assert!(!timer.cancel(cancelled));
        timer.schedule_after(Duration::from_millis(5), move || tx.send(2).unwrap());
        assert_eq!(rx.recv().unwrap(), 2);
        assert_eq!(timer.pending(), 0);
    }

    #[test]
    fn drop_discards_pending_entries_without_running_them() {
        let timer = DeadlineTimer::new("test-timer");
        let (tx, rx) = bounded::<()>(1);
        timer.schedule_after(Duration::from_secs(3600), move || tx.send(()).unwrap());
        drop(timer);
        assert!(rx.recv().is_err(), "callback dropped, sender gone");
    }
}
