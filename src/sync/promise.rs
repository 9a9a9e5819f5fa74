//! `PromiseOnce` / `Future`: a once-only result shared by any number of
//! readers. The first `set` wins and says so; later sets are no-ops. Callbacks
//! registered with `on_ready` run exactly once, outside the lock, on the thread
//! that published the result (or at once, if it is already published).
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::status::{self, Outcome};

type Callback = Box<dyn FnOnce(&Outcome) + Send + 'static>;

enum State {
    Pending(Vec<Callback>),
    Ready(Outcome),
}

struct Shared {
    state: Mutex<State>,
    published: Condvar,
}

impl Shared {
    fn publish(&self, outcome: Outcome) -> bool {
        let callbacks = {
            let mut state = self.state.lock();
            match &mut *state {
                State::Ready(_) => return false,
                State::Pending(callbacks) => {
                    let callbacks = std::mem::take(callbacks);
                    *state = State::Ready(outcome.clone());
                    callbacks
                }
            }
        };
        self.published.notify_all();
        for callback in callbacks {
            callback(&outcome);
        }
        true
    }
}

/// Keeps track of the live writer handles: when the last one goes away
/// without a result, readers get an INTERNAL error instead of waiting forever.
struct Writer {
    shared: Arc<Shared>,
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.shared.publish(Err(status::internal(
            "promise abandoned: its last writer was dropped without a result",
        )));
    }
}

/// The writing side. Cloneable: several paths (completion, cancellation,
/// timeout) may race to set it; exactly one wins.
#[derive(Clone)]
pub struct PromiseOnce {
    writer: Arc<Writer>,
}

/// The reading side. Cloneable and cheap.
#[derive(Clone)]
pub struct Future {
    shared: Arc<Shared>,
}

impl PromiseOnce {
    pub fn new() -> (PromiseOnce, Future) {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::Pending(Vec::new())),
            published: Condvar::new(),
        });
        let future = Future {
            shared: shared.clone(),
        };
        (
            PromiseOnce {
                writer: Arc::new(Writer { shared }),
            },
            future,
        )
    }

    /// Publishes `outcome` if nothing was published yet. Returns whether this
    /// call won.
    pub fn set(&self, outcome: Outcome) -> bool {
        self.writer.shared.publish(outcome)
    }

    pub fn future(&self) -> Future {
        Future {
            shared: self.writer.shared.clone(),
        }
    }

    pub fn is_set(&self) -> bool {
        matches!(*self.writer.shared.state.lock(), State::Ready(_))
    }
}

impl Future {
    /// A future that is already resolved.
    pub fn ready(outcome: Outcome) -> Future {
        let (promise, future) = PromiseOnce::new();
        promise.set(outcome);
        future
    }

    pub fn is_ready(&self) -> bool {
        matches!(*self.shared.state.lock(), State::Ready(_))
    }

    /// The outcome, if published.
    pub fn try_get(&self) -> Option<Outcome> {
        match &*self.shared.state.lock() {
            State::Ready(outcome) => Some(outcome.clone()),
            State::Pending(_) => None,
        }
    }

    /// Blocks until the outcome is published.
    pub fn wait(&self) -> Outcome {
        let mut state = self.shared.state.lock();
        loop {
            if let State::Ready(outcome) = &*state {
                return outcome.clone();
            }
            self.shared.published.wait(&mut state);
        }
    }

    /// Blocks at most `timeout`; `None` if still pending then.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Outcome> {
        let deadline = Instant::now() + timeout;
        let mut state = self.shared.state.lock();
        loop {
            if let State::Ready(outcome) = &*state {
                return Some(outcome.clone());
            }
            if self
                .shared
                .published
                .wait_until(&mut state, deadline)
                .timed_out()
            {
                return match &*state {
                    State::Ready(outcome) => Some(outcome.clone()),
                    State::Pending(_) => None,
                };
            }
        }
    }

    /// Runs `callback` exactly once with the outcome: now (on this thread) if
    /// already published, else on the publishing thread.
    pub fn on_ready(&self, callback: impl FnOnce(&Outcome) + Send + 'static) {
        let mut state = self.shared.state.lock();
        match &mut *state {
            State::Pending(callbacks) => callbacks.push(Box::new(callback)),
            State::Ready(outcome) => {
                let outcome = outcome.clone();
                drop(state);
                callback(&outcome);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{cancelled, Code};
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn first_set_wins_and_later_sets_are_no_ops() {
        let (promise, future) = PromiseOnce::new();
        assert!(promise.set(Err(cancelled("first"))));
        assert!(!promise.set(Ok(())));
        assert_eq!(future.wait().unwrap_err().code, Code::Cancelled);
    }

    #[test]
    fn on_ready_runs_exactly_once_before_and_after_publication() {
        let calls = Arc::new(AtomicUsize::new(0));
        let (promise, future) = PromiseOnce::new();
        let c = calls.clone();
        future.on_ready(move |o| {
            assert!(o.is_ok());
            c.fetch_add(1, Ordering::SeqCst);
        });
        promise.set(Ok(()));
        promise.set(Ok(()));
        let c = calls.clone();
        future.on_ready(move |_| {
            c.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn dropping_every_writer_publishes_internal_instead_of_hanging() {
        let (promise, future) = PromiseOnce::new();
        let clone = promise.clone();
        drop(promise);
        assert!(!future.is_ready());
        drop(clone);
        assert_eq!(future.wait().unwrap_err().code, Code::Internal);
    }

    #[test]
    fn wait_timeout_returns_none_while_pending() {
        let (_promise, future) = PromiseOnce::new();
        assert!(future.wait_timeout(Duration::from_millis(1)).is_none());
    }

    #[test]
    fn wait_wakes_on_set_from_another_thread() {
        let (promise, future) = PromiseOnce::new();
        let t = std::thread::spawn(move || future.wait());
        promise.set(Ok(()));
        assert!(t.join().unwrap().is_ok());
    }
}
