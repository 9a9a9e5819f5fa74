//! `AsyncWorkRunner`: a fixed pool of worker threads fed by one
//! crossbeam channel. Completion steps (publish a result, retire a key) hop
//! onto it from whatever thread a store callback fired on.
//!
//! Shutdown: `shutdown()` (also run on drop) closes the queue, lets the
//! workers drain what was already submitted, and joins them. Work submitted
//! *after* shutdown runs inline on the submitting thread. We never reject:
//! the work items are completion steps, and dropping one would strand a
//! promise or leave a key behind; running it late but exactly once is the
//! lesser evil.
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::{self, JoinHandle};

use crossbeam_channel::{unbounded, Sender};
use parking_lot::Mutex;

type Work = Box<dyn FnOnce() + Send + 'static>;

/// Opens a scope held while a worker runs a burst (the items queued back to
/// back); dropped when the queue is empty. The transfer layer corks its
/// control links with it, so the deletes a burst of publications makes go
/// out together.
pub type BurstScope = Arc<dyn Fn() -> Box<dyn Any> + Send + Sync>;

/// The most items one burst scope covers.
const MAX_BURST: usize = 64;

pub struct AsyncWorkRunner {
    name: String,
    sender: Mutex<Option<Sender<Work>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl AsyncWorkRunner {
    /// Starts `threads` workers (at least one) named `<name>-<i>`.
    pub fn new(name: &str, threads: usize) -> AsyncWorkRunner {
        Self::with_bursts(name, threads, None)
    }

    /// As `new`, each worker holding `burst`'s scope while it runs items
    /// queued back to back.
    pub fn with_bursts(name: &str, threads: usize, burst: Option<BurstScope>) -> AsyncWorkRunner {
        let (sender, receiver) = unbounded::<Work>();
        let workers = (0..threads.max(1))
            .map(|i| {
                let receiver = receiver.clone();
                let thread_name = format!("{name}-{i}");
                let burst = burst.clone();
                thread::Builder::new()
                    .name(thread_name.clone())
                    .spawn(move || {
                        while let Ok(work) = receiver.recv() {
                            let mut scope = burst.as_ref().map(|open| open());
                            run_guarded(&thread_name, work);
                            let mut in_scope = 1;
                            while let Ok(work) = receiver.try_recv() {
                                // A queue that never empties still closes
                                // its scope now and then.
                                if in_scope == MAX_BURST {
                                    drop(scope.take());
                                    scope = burst.as_ref().map(|open| open());
                                    in_scope = 0;
                                }
                                run_guarded(&thread_name, work);
                                in_scope += 1;
                            }
                        }
                    })
                    .expect("spawn AsyncWorkRunner worker")
            })
            .collect();
        AsyncWorkRunner {
            name: name.to_string(),
            sender: Mutex::new(Some(sender)),
            workers: Mutex::new(workers),
        }
    }

    pub fn threads(&self) -> usize {
        self.workers.lock().len()
    }

    /// Queues `work`; after shutdown it runs inline (see the module doc).
    pub fn submit(&self, work: impl FnOnce() + Send + 'static) {
        let work: Work = Box::new(work);
        let rejected = match &*self.sender.lock() {
            Some(sender) => match sender.send(work) {
                Ok(()) => None,
                Err(returned) => Some(returned.into_inner()),
            },
            None => Some(work),
        };
        if let Some(work) = rejected {
            log::debug!("{}: shut down, running submitted work inline", self.name);
            run_guarded(&self.name, work);
        }
    }

    /// Closes the queue, drains it and joins the workers. Idempotent. Called
    /// from one of our own workers (the last owner dropped inside a work
    /// item), that worker is not joined: it exits after its current item.
    pub fn shutdown(&self) {
        drop(self.sender.lock().take());
        let workers = std::mem::take(&mut *self.workers.lock());
        join_all_except_current(workers, &self.name);
    }
}

impl Drop for AsyncWorkRunner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn run_guarded(name: &str, work: Work) {
    if catch_unwind(AssertUnwindSafe(work)).is_err() {
        log::error!("{name}: a work item panicked; the worker keeps running");
    }
}

/// Joins every handle except the calling thread's own (joining oneself would
/// deadlock).
pub(crate) fn join_all_except_current(handles: Vec<JoinHandle<()>>, name: &str) {
    let me = thread::current().id();
    for handle in handles {
        if handle.thread().id() == me {
            continue;
        }
        if handle.join().is_err() {
            log::error!("{name}: a worker thread panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Barrier};

    #[test]
    fn submitted_work_runs_on_a_fixed_number_of_workers() {
        let runner = AsyncWorkRunner::new("test-runner", 2);
        assert_eq!(runner.threads(), 2);
        let barrier = Arc::new(Barrier::new(3));
        for _ in 0..2 {
            let barrier = barrier.clone();
            runner.submit(move || {
                barrier.wait();
            });
        }
        // Both items run at once, so both workers exist.
        barrier.wait();
    }

    #[test]
    fn shutdown_drains_queued_work_and_later_work_runs_inline() {
        let count = Arc::new(AtomicUsize::new(0));
        let runner = AsyncWorkRunner::new("test-runner", 1);
        for _ in 0..100 {
            let count = count.clone();
            runner.submit(move || {
                count.fetch_add(1, Ordering::SeqCst);
            });
        }
        runner.shutdown();
        assert_eq!(count.load(Ordering::SeqCst), 100);
        let me = thread::current().id();
        let ran_on = Arc::new(Mutex::new(None));
        let r = ran_on.clone();
        runner.submit(move || *r.lock() = Some(thread::current().id()));
        assert_eq!(*ran_on.lock(), Some(me));
    }

    #[test]
    fn a_panicking_item_does_not_kill_the_worker() {
        let runner = AsyncWorkRunner::new("test-runner", 1);
        runner.submit(|| panic!("deliberate"));
        let (tx, rx) = crossbeam_channel::bounded(1);
        runner.submit(move || tx.send(()).unwrap());
        rx.recv().unwrap();
    }

    #[test]
    fn items_queued_back_to_back_run_inside_one_burst_scope() {
        // (scopes opened, scopes open now)
        let scopes = Arc::new(Mutex::new((0usize, 0usize)));
        struct Open(Arc<Mutex<(usize, usize)>>);
        impl Drop for Open {
            fn drop(&mut self) {
                self.0.lock().1 -= 1;
            }
        }
        let opener = scopes.clone();
        let burst: BurstScope = Arc::new(move || {
            let mut counts = opener.lock();
            counts.0 += 1;
            counts.1 += 1;
            Box::new(Open(opener.clone()))
        });
        let runner = AsyncWorkRunner::with_bursts("test-runner", 1, Some(burst));
        let (release_tx, release_rx) = crossbeam_channel::bounded::<()>(0);
        let (seen_tx, seen_rx) = crossbeam_channel::unbounded();
        let seen = seen_tx.clone();
        let counts = scopes.clone();
        runner.submit(move || {
            release_rx.recv().unwrap();
            seen.send(*counts.lock()).unwrap();
        });
        for _ in 0..4 {
            let (seen, counts) = (seen_tx.clone(), scopes.clone());
            runner.submit(move || seen.send(*counts.lock()).unwrap());
        }
        // All five are queued before the first finishes: one burst.
        release_tx.send(()).unwrap();
        for _ in 0..5 {
            assert_eq!(seen_rx.recv().unwrap(), (1, 1));
        }
        runner.shutdown();
        assert_eq!(*scopes.lock(), (1, 0), "the scope closes with the burst");
    }

    #[test]
    fn dropping_the_last_owner_inside_a_work_item_does_not_deadlock() {
        let runner = Arc::new(AsyncWorkRunner::new("test-runner", 1));
        let (tx, rx) = crossbeam_channel::bounded(1);
        let inner = runner.clone();
        runner.submit(move || {
            drop(inner);
            tx.send(()).unwrap();
        });
        drop(runner);
        rx.recv().unwrap();
    }
}
