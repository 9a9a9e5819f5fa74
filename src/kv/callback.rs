//! `CallbackStore`: the store behind the `kv_get` / `kv_put` / `kv_try_get`
//! callbacks that `PJRT_Client_Create` receives (how JAX hands over its
//! coordination service), plus the optional delete callback of the plugin's
//! KV-delete extension. The unsafe calls live in `ffi/kv_callbacks.rs`; this
//! file is the logic over them.
//!
//! The callbacks only offer *blocking* gets, so `async_get` runs them on a
//! bounded pool: up to `pool_threads` workers fed by one channel, never one
//! thread per key without bound. The pool grows on demand (a job queued while
//! no worker is idle starts one more, up to the bound), so up to
//! `pool_threads` keys are each watched by a blocked get and observed the
//! moment they are set. Fairness: a worker blocks at most `wait_slice` on one key, then
//! puts the job back at the end of the queue, so a few keys that are never
//! set cannot starve the others; a key that is set is observed within about
//! `ceil(pending / pool_threads) * wait_slice`. A get that returns "not yet"
//! early (a callback that does not block) and a wait for a value other than
//! a known stale one (`async_get_changed`, polled with `try_get`, which
//! returns at once) are re-queued after a delay that doubles up to
//! `max_backoff`: bounded and never spinning.
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};
use parking_lot::Mutex;

use super::{GetCallback, KeyValueStore, StoreCapabilities, WaiterId};
use crate::status::{self, Code, Result};
use crate::sync::DeadlineTimer;

/// The raw callbacks, safe side. `delete` is `None` when the caller gave no
/// delete callback.
pub trait RawKvCallbacks: Send + Sync {
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    fn try_get(&self, key: &str) -> Result<Vec<u8>>;
    fn put(&self, key: &str, value: &[u8]) -> Result<()>;
    fn delete(&self, key: &str) -> Option<Result<()>>;
    fn has_delete(&self) -> bool;
}

#[derive(Clone, Debug)]
pub struct CallbackStoreOptions {
    pub pool_threads: usize,
    pub wait_slice: Duration,
    pub min_backoff: Duration,
    pub max_backoff: Duration,
    /// Whether `put` overwrites. JAX's coordination service refuses (it
    /// answers `ALREADY_EXISTS`), so the default is false.
    pub can_overwrite: bool,
}

impl Default for CallbackStoreOptions {
    fn default() -> Self {
        CallbackStoreOptions {
            pool_threads: 64,
            wait_slice: Duration::from_millis(50),
            min_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(100),
            can_overwrite: false,
        }
    }
}

struct GetJob {
    id: u64,
    key: String,
    /// `Some(v)`: wait for a value other than `v`.
    stale: Option<Vec<u8>>,
    backoff: Duration,
}

enum Job {
    Get(GetJob),
    Stop,
}

struct Shared {
    raw: Arc<dyn RawKvCallbacks>,
    options: CallbackStoreOptions,
    /// Callbacks of waiters not yet fired nor cancelled. Whoever removes an
    /// entry owns its callback: the worker fires it, `cancel_async_get`
    /// drops it.
    pending: Mutex<HashMap<u64, GetCallback>>,
    next_id: Mutex<u64>,
    queue: Sender<Job>,
    jobs: Receiver<Job>,
    timer: DeadlineTimer,
    /// Workers waiting for a job (not blocked in a get).
    idle: AtomicUsize,
}

pub struct CallbackStore {
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl CallbackStore {
    pub fn new(raw: Arc<dyn RawKvCallbacks>, options: CallbackStoreOptions) -> CallbackStore {
        let (queue, jobs) = unbounded();
        let shared = Arc::new(Shared {
            raw,
            options,
            pending: Mutex::new(HashMap::new()),
            next_id: Mutex::new(0),
            queue,
            jobs,
            timer: DeadlineTimer::new("crosshost-kv-retry"),
            idle: AtomicUsize::new(0),
        });
        let store = CallbackStore {
            shared,
            workers: Mutex::new(Vec::new()),
        };
        store.add_worker();
        store
    }

    /// Starts one more worker if none is idle and the bound allows.
    fn add_worker(&self) {
        let mut workers = self.workers.lock();
        if workers.len() >= self.shared.options.pool_threads.max(1)
            || (!workers.is_empty() && self.shared.idle.load(AtomicOrdering::Acquire) > 0)
        {
            return;
        }
        let shared = self.shared.clone();
        let name = format!("crosshost-kv-get-{}", workers.len());
        match thread::Builder::new()
            .name(name)
            .spawn(move || worker(&shared))
        {
            Ok(handle) => workers.push(handle),
            Err(e) => log::error!("CallbackStore: cannot start a worker: {e}"),
        }
    }

    /// Waiters neither fired nor cancelled.
    pub fn pending_waiters(&self) -> usize {
        self.shared.pending.lock().len()
    }

    fn enqueue(&self, key: &str, stale: Option<&[u8]>, callback: GetCallback) -> WaiterId {
        let id = {
            let mut next = self.shared.next_id.lock();
            *next += 1;
            *next
        };
        self.shared.pending.lock().insert(id, callback);
        let job = GetJob {
            id,
            key: key.to_string(),
            stale: stale.map(<[u8]>::to_vec),
            backoff: self.shared.options.min_backoff,
        };
        // The store holds the receiver, so this cannot fail while it lives.
        let _ = self.shared.queue.send(Job::Get(job));
        self.add_worker();
        WaiterId(id)
    }
}

impl Drop for CallbackStore {
    fn drop(&mut self) {
        let workers = std::mem::take(&mut *self.workers.lock());
        for _ in 0..workers.len() {
            let _ = self.shared.queue.send(Job::Stop);
        }
        crate::sync::runner::join_all_except_current(workers, "CallbackStore");
        // Waiters still pending are dropped without running (store contract:
        // the store is gone, nobody can cancel them any more).
        let dropped = std::mem::take(&mut *self.shared.pending.lock());
        drop(dropped);
    }
}

fn worker(shared: &Arc<Shared>) {
    loop {
        shared.idle.fetch_add(1, AtomicOrdering::AcqRel);
        let next = shared.jobs.recv();
        shared.idle.fetch_sub(1, AtomicOrdering::AcqRel);
        let Ok(Job::Get(mut job)) = next else { return };
        if !shared.pending.lock().contains_key(&job.id) {
            continue; // cancelled
        }
        let started = Instant::now();
        let result = match &job.stale {
            None => shared.raw.get(&job.key, shared.options.wait_slice),
            Some(_) => shared.raw.try_get(&job.key),
        };
        match result {
            Ok(value) if job.stale.as_deref() != Some(value.as_slice()) => {
                fire(shared, job.id, Ok(value))
            }
            Ok(_) => requeue_later(shared, job),
            Err(e) if matches!(e.code, Code::NotFound | Code::DeadlineExceeded) => {
                if started.elapsed() >= shared.options.wait_slice / 2 {
                    job.backoff = shared.options.min_backoff;
                    let _ = shared.queue.send(Job::Get(job));
                } else {
                    requeue_later(shared, job);
                }
            }
            Err(e) => fire(shared, job.id, Err(e)),
        }
    }
}

fn fire(shared: &Shared, id: u64, result: Result<Vec<u8>>) {
    let callback = shared.pending.lock().remove(&id);
    if let Some(callback) = callback {
        callback(result);
    }
}

fn requeue_later(shared: &Arc<Shared>, mut job: GetJob) {
    let delay = job.backoff;
    job.backoff = (job.backoff * 2).min(shared.options.max_backoff);
    let queue = shared.queue.clone();
    shared.timer.schedule_after(delay, move || {
        let _ = queue.send(Job::Get(job));
    });
}

impl KeyValueStore for CallbackStore {
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.shared.raw.get(key, timeout)
    }

    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        self.shared.raw.try_get(key)
    }

    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.shared.raw.put(key, value)
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.shared.raw.delete(key).unwrap_or_else(|| {
            Err(status::unimplemented(format!(
                "CallbackStore::delete({key:?}): the PJRT KV callbacks have no delete and no \
                 PJRT_CrossHost_KvDeleteExtension was attached"
            )))
        })
    }

    fn async_get(&self, key: &str, callback: GetCallback) -> Result<WaiterId> {
        Ok(self.enqueue(key, None, callback))
    }

    fn async_get_changed(
        &self,
        key: &str,
        stale: &[u8],
        callback: GetCallback,
    ) -> Result<WaiterId> {
        Ok(self.enqueue(key, Some(stale), callback))
    }

    fn cancel_async_get(&self, _key: &str, id: WaiterId) -> bool {
        let removed = self.shared.pending.lock().remove(&id.0);
        removed.is_some()
    }

    fn capabilities(&self) -> StoreCapabilities {
        StoreCapabilities {
            can_delete: self.shared.raw.has_delete(),
            can_overwrite: self.shared.options.can_overwrite,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::MemoryStore;
    use crossbeam_channel::bounded;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Raw callbacks over a memory store, counting gets.
    pub(crate) struct FakeRaw {
        pub store: MemoryStore,
        pub with_delete: bool,
        pub gets: AtomicUsize,
        pub try_gets: AtomicUsize,
    }

    impl FakeRaw {
        fn new(with_delete: bool) -> Arc<FakeRaw> {
            Arc::new(FakeRaw {
                store: MemoryStore::with_overwrite(false),
                with_delete,
                gets: AtomicUsize::new(0),
                try_gets: AtomicUsize::new(0),
            })
        }
    }

    impl RawKvCallbacks for FakeRaw {
        fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
            self.gets.fetch_add(1, Ordering::SeqCst);
            self.store.get(key, timeout)
        }
        fn try_get(&self, key: &str) -> Result<Vec<u8>> {
            self.try_gets.fetch_add(1, Ordering::SeqCst);
            self.store.try_get(key)
        }
        fn put(&self, key: &str, value: &[u8]) -> Result<()> {
            self.store.set(key, value)
        }
        fn delete(&self, key: &str) -> Option<Result<()>> {
            self.with_delete.then(|| self.store.delete(key))
        }
        fn has_delete(&self) -> bool {
            self.with_delete
        }
    }

    fn options(threads: usize) -> CallbackStoreOptions {
        CallbackStoreOptions {
            pool_threads: threads,
            wait_slice: Duration::from_millis(10),
            ..CallbackStoreOptions::default()
        }
    }

    #[test]
    fn without_a_delete_callback_delete_is_unimplemented_and_capability_says_so() {
        let store = CallbackStore::new(FakeRaw::new(false), options(1));
        assert!(!store.capabilities().can_delete);
        assert!(!store.capabilities().can_overwrite);
        assert_eq!(store.delete("k").unwrap_err().code, Code::Unimplemented);
        let store = CallbackStore::new(FakeRaw::new(true), options(1));
        assert!(store.capabilities().can_delete);
        store.set("k", b"v").unwrap();
        store.delete("k").unwrap();
        assert_eq!(store.try_get("k").unwrap_err().code, Code::NotFound);
    }

    #[test]
    fn pending_keys_beyond_the_pool_size_do_not_starve_a_key_that_is_set() {
        let raw = FakeRaw::new(true);
        let store = CallbackStore::new(raw.clone(), options(2));
        // Eight keys that are never set, more than the two workers.
        for i in 0..8 {
            store
                .async_get(&format!("never/{i}"), Box::new(|_| panic!("never set")))
                .unwrap();
        }
        let (tx, rx) = bounded(1);
        store
            .async_get("set", Box::new(move |r| tx.send(r).unwrap()))
            .unwrap();
        store.set("set", b"v").unwrap();
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(10)).unwrap().unwrap(),
            b"v"
        );
        assert_eq!(store.pending_waiters(), 8);
    }

    #[test]
    fn cancelled_waiters_never_fire() {
        let store = CallbackStore::new(FakeRaw::new(true), options(1));
        let id = store
            .async_get("k", Box::new(|_| panic!("cancelled waiter fired")))
            .unwrap();
        assert!(store.cancel_async_get("k", id));
        assert!(!store.cancel_async_get("k", id));
        let (tx, rx) = bounded(1);
        store
            .async_get("k", Box::new(move |r| tx.send(r).unwrap()))
            .unwrap();
        store.set("k", b"v").unwrap();
        rx.recv().unwrap().unwrap();
        assert_eq!(store.pending_waiters(), 0);
    }

    #[test]
    fn waiting_for_a_change_past_a_stale_value_polls_with_backoff_not_spinning() {
        let raw = FakeRaw::new(false);
        let store = CallbackStore::new(
            raw.clone(),
            CallbackStoreOptions {
                pool_threads: 1,
                min_backoff: Duration::from_millis(1),
                max_backoff: Duration::from_millis(20),
                ..CallbackStoreOptions::default()
            },
        );
        store.set("k", b"stale").unwrap();
        let (tx, rx) = bounded(1);
        store
            .async_get_changed("k", b"stale", Box::new(move |r| tx.send(r).unwrap()))
            .unwrap();
        // Let it poll for 200 ms: with backoff doubling to 20 ms that is at
        // most ~15 polls; a spinning loop would do thousands.
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err());
        let polls = raw.try_gets.load(Ordering::SeqCst);
        assert!((1..=20).contains(&polls), "{polls} polls in 200 ms");
        // A no-overwrite store: the real receipt can only come after a
        // delete, which the fake supports directly.
        raw.store.delete("k").unwrap();
        store.set("k", b"fresh").unwrap();
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(10)).unwrap().unwrap(),
            b"fresh"
        );
    }
}
