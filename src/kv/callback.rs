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
//! a known stale one (`async_get` with `unless`, polled with `try_get`, which
//! returns at once) are re-queued after a delay that doubles up to
//! `max_backoff`: bounded and never spinning.
//!
//! Every other call into the callbacks (put, delete, try_get and the
//! blocking get) runs on a second bounded pool, the *call* pool, and is
//! bounded by a deadline: the caller (or the `set_async` / `delete_async`
//! callback) gets `DEADLINE_EXCEEDED` when the callback has not returned in
//! time, and a call whose caller already gave up is never started. A
//! callback that never returns keeps its worker, nothing else: destroying
//! the store waits at most `stop_grace` for its workers and detaches the
//! ones still inside a callback (they hold the shared state, so nothing
//! they touch is freed under them, and they make no further calls).
//! Puts, deletes and their callbacks therefore never run on the caller's
//! thread, so a framework callback that needs a lock (Python's GIL) never
//! holds up readiness.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};
use parking_lot::Mutex;

use super::{GetCallback, KeyValueStore, SetCallback, StoreCapabilities, Unless, WaiterId};
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
    /// Workers of the call pool (put, delete, try_get, blocking get).
    pub call_threads: usize,
    /// Bound on one put, delete or try_get (a blocking get is bounded by its
    /// own timeout plus `call_grace`).
    pub call_timeout: Duration,
    /// How long past its timeout a blocking get may take to return.
    pub call_grace: Duration,
    /// How long destroying the store waits for its workers.
    pub stop_grace: Duration,
}

impl Default for CallbackStoreOptions {
    fn default() -> Self {
        CallbackStoreOptions {
            pool_threads: 64,
            wait_slice: Duration::from_millis(50),
            min_backoff: Duration::from_millis(1),
            max_backoff: Duration::from_millis(100),
            can_overwrite: false,
            call_threads: 16,
            call_timeout: Duration::from_secs(30),
            call_grace: Duration::from_millis(200),
            stop_grace: Duration::from_millis(500),
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

/// One call into the callbacks, run on the call pool.
type Call = Box<dyn FnOnce(&Shared) + Send>;

enum CallJob {
    Run(Call),
    Stop,
}

/// A queue of calls and its workers' idle count.
struct CallPool {
    queue: Sender<CallJob>,
    jobs: Receiver<CallJob>,
    idle: AtomicUsize,
}

impl CallPool {
    fn new() -> CallPool {
        let (queue, jobs) = unbounded();
        CallPool {
            queue,
            jobs,
            idle: AtomicUsize::new(0),
        }
    }
}

#[derive(Clone, Copy)]
enum Pool {
    Calls,
    Deletes,
}

/// Whoever takes the callback first answers: the call, or its deadline.
type Answer<T> = Arc<Mutex<Option<Box<dyn FnOnce(Result<T>) + Send>>>>;

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
    /// Puts, try_gets and blocking gets.
    calls: CallPool,
    /// Deletes, apart: a delete that waits on a framework lock (Python's
    /// GIL, for the delete `jax_plugins.crosshost` registers) never holds up
    /// a receipt's put.
    deletes: CallPool,
    /// Set when the store is destroyed: workers make no more calls.
    stopping: AtomicBool,
}

pub struct CallbackStore {
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    call_workers: Mutex<Vec<JoinHandle<()>>>,
    delete_workers: Mutex<Vec<JoinHandle<()>>>,
    /// Every worker holds a clone; all gone = all workers exited.
    exit_tx: Mutex<Option<Sender<()>>>,
    exit_rx: Receiver<()>,
}

impl CallbackStore {
    pub fn new(raw: Arc<dyn RawKvCallbacks>, options: CallbackStoreOptions) -> CallbackStore {
        let (queue, jobs) = unbounded();
        let (exit_tx, exit_rx) = unbounded();
        let shared = Arc::new(Shared {
            raw,
            options,
            pending: Mutex::new(HashMap::new()),
            next_id: Mutex::new(0),
            queue,
            jobs,
            timer: DeadlineTimer::new("crosshost-kv-retry"),
            idle: AtomicUsize::new(0),
            calls: CallPool::new(),
            deletes: CallPool::new(),
            stopping: AtomicBool::new(false),
        });
        let store = CallbackStore {
            shared,
            workers: Mutex::new(Vec::new()),
            call_workers: Mutex::new(Vec::new()),
            delete_workers: Mutex::new(Vec::new()),
            exit_tx: Mutex::new(Some(exit_tx)),
            exit_rx,
        };
        store.add_worker();
        store
    }

    /// Starts one more get worker if none is idle and the bound allows.
    fn add_worker(&self) {
        let bound = self.shared.options.pool_threads;
        let idle = &self.shared.idle;
        self.spawn_if_needed(&self.workers, bound, idle, "crosshost-kv-get", worker);
    }

    /// Starts one more worker of `pool` if none is idle and the bound allows.
    fn add_call_worker(&self, pool: Pool) {
        let bound = self.shared.options.call_threads;
        let (workers, idle, name, body): (_, _, _, fn(&Arc<Shared>)) = match pool {
            Pool::Calls => (
                &self.call_workers,
                &self.shared.calls.idle,
                "crosshost-kv-call",
                call_worker,
            ),
            Pool::Deletes => (
                &self.delete_workers,
                &self.shared.deletes.idle,
                "crosshost-kv-delete",
                delete_worker,
            ),
        };
        self.spawn_if_needed(workers, bound, idle, name, body);
    }

    fn spawn_if_needed(
        &self,
        workers: &Mutex<Vec<JoinHandle<()>>>,
        bound: usize,
        idle: &AtomicUsize,
        name: &str,
        body: fn(&Arc<Shared>),
    ) {
        let mut workers = workers.lock();
        if workers.len() >= bound.max(1)
            || (!workers.is_empty() && idle.load(AtomicOrdering::Acquire) > 0)
        {
            return;
        }
        let Some(exit) = self.exit_tx.lock().clone() else {
            return;
        };
        let shared = self.shared.clone();
        let name = format!("{name}-{}", workers.len());
        let spawned = thread::Builder::new().name(name).spawn(move || {
            body(&shared);
            drop(exit);
        });
        match spawned {
            Ok(handle) => workers.push(handle),
            Err(e) => log::error!("CallbackStore: cannot start a worker: {e}"),
        }
    }

    /// Runs `call` on `pool`; `done` gets its result, or
    /// `DEADLINE_EXCEEDED` once `timeout` passed without one. A call still
    /// queued when its deadline passed is never made.
    fn call_async<T: Send + 'static>(
        &self,
        pool: Pool,
        what: String,
        timeout: Duration,
        call: impl FnOnce(&dyn RawKvCallbacks) -> Result<T> + Send + 'static,
        done: impl FnOnce(Result<T>) + Send + 'static,
    ) {
        let answer: Answer<T> = Arc::new(Mutex::new(Some(Box::new(done))));
        let expired = answer.clone();
        let deadline = self.shared.timer.schedule_after(timeout, move || {
            let done = expired.lock().take();
            if let Some(done) = done {
                done(Err(status::deadline_exceeded(format!(
                    "{what}: the KV callback did not return within {timeout:?}"
                ))));
            }
        });
        let job: Call = Box::new(move |shared: &Shared| {
            if answer.lock().is_none() {
                return; // its caller was already told it timed out
            }
            let result = if shared.stopping.load(AtomicOrdering::Acquire) {
                Err(status::cancelled("the KV store was destroyed"))
            } else {
                call(&*shared.raw)
            };
            let done = answer.lock().take();
            if let Some(done) = done {
                shared.timer.cancel(deadline);
                done(result);
            }
        });
        let queue = match pool {
            Pool::Calls => &self.shared.calls.queue,
            Pool::Deletes => &self.shared.deletes.queue,
        };
        if queue.send(CallJob::Run(job)).is_ok() {
            self.add_call_worker(pool);
        }
    }

    /// `call_async`, waiting for the answer.
    fn call_blocking<T: Send + 'static>(
        &self,
        pool: Pool,
        what: String,
        timeout: Duration,
        call: impl FnOnce(&dyn RawKvCallbacks) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.call_async(pool, what.clone(), timeout, call, move |result| {
            let _ = tx.send(result);
        });
        // The deadline answers first; this only guards a stopped timer.
        rx.recv_timeout(timeout + self.shared.options.call_grace)
            .unwrap_or_else(|_| {
                Err(status::deadline_exceeded(format!(
                    "{what}: the KV callback did not return within {timeout:?}"
                )))
            })
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
        self.shared.stopping.store(true, AtomicOrdering::Release);
        let workers = std::mem::take(&mut *self.workers.lock());
        let call_workers = std::mem::take(&mut *self.call_workers.lock());
        let delete_workers = std::mem::take(&mut *self.delete_workers.lock());
        for _ in 0..workers.len() {
            let _ = self.shared.queue.send(Job::Stop);
        }
        for _ in 0..call_workers.len() {
            let _ = self.shared.calls.queue.send(CallJob::Stop);
        }
        for _ in 0..delete_workers.len() {
            let _ = self.shared.deletes.queue.send(CallJob::Stop);
        }
        // Wait a bounded time for them to leave; one stuck in a callback that
        // never returns is detached, holding the shared state it uses.
        self.exit_tx.lock().take();
        let deadline = Instant::now() + self.shared.options.stop_grace;
        while self.exit_rx.recv_deadline(deadline).is_ok() {}
        let me = thread::current().id();
        let mut detached = 0;
        for handle in workers
            .into_iter()
            .chain(call_workers)
            .chain(delete_workers)
        {
            if handle.thread().id() == me {
                continue;
            }
            if handle.is_finished() {
                if handle.join().is_err() {
                    log::error!("CallbackStore: a worker thread panicked");
                }
            } else {
                detached += 1;
            }
        }
        if detached > 0 {
            log::warn!(
                "CallbackStore: {detached} worker(s) still inside a KV callback after {:?}; \
                 detached (they make no further calls)",
                self.shared.options.stop_grace
            );
        }
        // Waiters still pending are dropped without running (store contract:
        // the store is gone, nobody can cancel them any more).
        let dropped = std::mem::take(&mut *self.shared.pending.lock());
        drop(dropped);
    }
}

fn call_worker(shared: &Arc<Shared>) {
    run_pool(shared, &shared.calls);
}

fn delete_worker(shared: &Arc<Shared>) {
    run_pool(shared, &shared.deletes);
}

fn run_pool(shared: &Shared, pool: &CallPool) {
    loop {
        pool.idle.fetch_add(1, AtomicOrdering::AcqRel);
        let next = pool.jobs.recv();
        pool.idle.fetch_sub(1, AtomicOrdering::AcqRel);
        match next {
            Ok(CallJob::Run(call)) => call(shared),
            Ok(CallJob::Stop) | Err(_) => return,
        }
    }
}

fn worker(shared: &Arc<Shared>) {
    loop {
        shared.idle.fetch_add(1, AtomicOrdering::AcqRel);
        let next = shared.jobs.recv();
        shared.idle.fetch_sub(1, AtomicOrdering::AcqRel);
        let Ok(Job::Get(mut job)) = next else { return };
        if shared.stopping.load(AtomicOrdering::Acquire) {
            return;
        }
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
        let key = key.to_string();
        let bound = timeout + self.shared.options.call_grace;
        self.call_blocking(Pool::Calls, format!("kv get {key:?}"), bound, move |raw| {
            raw.get(&key, timeout)
        })
    }

    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        let key = key.to_string();
        let timeout = self.shared.options.call_timeout;
        self.call_blocking(
            Pool::Calls,
            format!("kv try_get {key:?}"),
            timeout,
            move |raw| raw.try_get(&key),
        )
    }

    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let (key, value) = (key.to_string(), value.to_vec());
        let timeout = self.shared.options.call_timeout;
        self.call_blocking(
            Pool::Calls,
            format!("kv put {key:?}"),
            timeout,
            move |raw| raw.put(&key, &value),
        )
    }

    fn set_async(&self, key: &str, value: &[u8], done: SetCallback) {
        let (key, value) = (key.to_string(), value.to_vec());
        let timeout = self.shared.options.call_timeout;
        self.call_async(
            Pool::Calls,
            format!("kv put {key:?}"),
            timeout,
            move |raw| raw.put(&key, &value),
            done,
        );
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.check_delete(key)?;
        let key = key.to_string();
        let timeout = self.shared.options.call_timeout;
        self.call_blocking(
            Pool::Deletes,
            format!("kv delete {key:?}"),
            timeout,
            move |raw| delete_with(raw, &key),
        )
    }

    fn delete_async(&self, key: &str, done: SetCallback) {
        if let Err(e) = self.check_delete(key) {
            return done(Err(e));
        }
        let key = key.to_string();
        let timeout = self.shared.options.call_timeout;
        self.call_async(
            Pool::Deletes,
            format!("kv delete {key:?}"),
            timeout,
            move |raw| delete_with(raw, &key),
            done,
        );
    }

    fn async_get(&self, key: &str, unless: Unless, callback: GetCallback) -> Result<WaiterId> {
        Ok(self.enqueue(key, unless, callback))
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

impl CallbackStore {
    fn check_delete(&self, key: &str) -> Result<()> {
        if self.shared.raw.has_delete() {
            return Ok(());
        }
        Err(status::unimplemented(format!(
            "CallbackStore::delete({key:?}): the PJRT KV callbacks have no delete, no \
             PJRT_CrossHost_KvDeleteExtension was attached and no delete function was registered"
        )))
    }
}

fn delete_with(raw: &dyn RawKvCallbacks, key: &str) -> Result<()> {
    raw.delete(key).unwrap_or_else(|| {
        Err(status::unimplemented(format!(
            "kv delete {key:?}: no delete callback"
        )))
    })
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
                .async_get(
                    &format!("never/{i}"),
                    None,
                    Box::new(|_| panic!("never set")),
                )
                .unwrap();
        }
        let (tx, rx) = bounded(1);
        store
            .async_get("set", None, Box::new(move |r| tx.send(r).unwrap()))
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
            .async_get("k", None, Box::new(|_| panic!("cancelled waiter fired")))
            .unwrap();
        assert!(store.cancel_async_get("k", id));
        assert!(!store.cancel_async_get("k", id));
        let (tx, rx) = bounded(1);
        store
            .async_get("k", None, Box::new(move |r| tx.send(r).unwrap()))
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
            .async_get("k", Some(b"stale"), Box::new(move |r| tx.send(r).unwrap()))
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

    /// Raw callbacks that block until `release` (a framework callback that
    /// never returns), counting the calls that started.
    struct StuckRaw {
        gate: Receiver<()>,
        release: Sender<()>,
        calls: AtomicUsize,
    }

    impl StuckRaw {
        fn new() -> Arc<StuckRaw> {
            let (release, gate) = crossbeam_channel::unbounded();
            Arc::new(StuckRaw {
                gate,
                release,
                calls: AtomicUsize::new(0),
            })
        }
        fn stuck(&self) -> Result<()> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let _ = self.gate.recv();
            Ok(())
        }
        /// Lets every stuck call return (dropping the senders' side).
        fn free(&self) {
            for _ in 0..64 {
                let _ = self.release.send(());
            }
        }
    }

    impl RawKvCallbacks for StuckRaw {
        fn get(&self, _key: &str, _timeout: Duration) -> Result<Vec<u8>> {
            self.stuck().map(|_| b"late".to_vec())
        }
        fn try_get(&self, _key: &str) -> Result<Vec<u8>> {
            self.stuck().map(|_| b"late".to_vec())
        }
        fn put(&self, _key: &str, _value: &[u8]) -> Result<()> {
            self.stuck()
        }
        fn delete(&self, _key: &str) -> Option<Result<()>> {
            Some(self.stuck())
        }
        fn has_delete(&self) -> bool {
            true
        }
    }

    fn bounded_options(call_threads: usize) -> CallbackStoreOptions {
        CallbackStoreOptions {
            call_threads,
            call_timeout: Duration::from_millis(200),
            call_grace: Duration::from_millis(100),
            stop_grace: Duration::from_millis(200),
            ..options(2)
        }
    }

    #[test]
    fn callbacks_that_never_return_fail_each_call_with_deadline_exceeded_in_time() {
        let raw = StuckRaw::new();
        let store = CallbackStore::new(raw.clone(), bounded_options(8));
        let started = Instant::now();
        assert_eq!(
            store.set("k", b"v").unwrap_err().code,
            Code::DeadlineExceeded
        );
        assert_eq!(store.delete("k").unwrap_err().code, Code::DeadlineExceeded);
        assert_eq!(store.try_get("k").unwrap_err().code, Code::DeadlineExceeded);
        let err = store.get("k", Duration::from_millis(100)).unwrap_err();
        assert_eq!(err.code, Code::DeadlineExceeded, "{err}");
        let (tx, rx) = bounded(2);
        let tx2 = tx.clone();
        store.set_async("k", b"v", Box::new(move |r| tx.send(r).unwrap()));
        store.delete_async("k", Box::new(move |r| tx2.send(r).unwrap()));
        for _ in 0..2 {
            let outcome = rx.recv_timeout(Duration::from_secs(5)).unwrap();
            assert_eq!(outcome.unwrap_err().code, Code::DeadlineExceeded);
        }
        // Four 200 ms bounds, one 200 ms, two concurrent: well under 2 s.
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        raw.free();
    }

    #[test]
    fn a_call_whose_caller_gave_up_while_it_was_queued_is_never_made() {
        let raw = StuckRaw::new();
        let store = CallbackStore::new(raw.clone(), bounded_options(1));
        // The one call worker is stuck in the first put; the second waits
        // behind it past its deadline.
        assert_eq!(
            store.set("a", b"1").unwrap_err().code,
            Code::DeadlineExceeded
        );
        assert_eq!(
            store.set("b", b"2").unwrap_err().code,
            Code::DeadlineExceeded
        );
        assert_eq!(raw.calls.load(Ordering::SeqCst), 1);
        // Freed, the worker skips the abandoned put and answers a new one.
        raw.free();
        let (tx, rx) = bounded(1);
        store.set_async("c", b"3", Box::new(move |r| tx.send(r).unwrap()));
        rx.recv_timeout(Duration::from_secs(5)).unwrap().unwrap();
        assert_eq!(
            raw.calls.load(Ordering::SeqCst),
            2,
            "the abandoned put was made"
        );
    }

    #[test]
    fn destroying_the_store_with_callbacks_stuck_returns_promptly_and_calls_no_more() {
        let raw = StuckRaw::new();
        let store = CallbackStore::new(raw.clone(), bounded_options(4));
        store.async_get("watched", None, Box::new(|_| {})).unwrap();
        store.set_async("k", b"v", Box::new(|_| {}));
        let deadline = Instant::now() + Duration::from_secs(5);
        while raw.calls.load(Ordering::SeqCst) < 2 {
            assert!(Instant::now() < deadline, "the two calls never started");
            std::thread::yield_now();
        }
        let started = Instant::now();
        drop(store);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
        // The detached workers return from their callbacks and stop there.
        raw.free();
        // They hold the store's shared state, and with it `raw`: its count
        // falls to ours once every worker has exited.
        let deadline = Instant::now() + Duration::from_secs(5);
        while Arc::strong_count(&raw) > 1 {
            assert!(Instant::now() < deadline, "detached workers never exited");
            std::thread::yield_now();
        }
        assert_eq!(
            raw.calls.load(Ordering::SeqCst),
            2,
            "a destroyed store made a call"
        );
    }
}
