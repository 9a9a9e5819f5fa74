//! Scenario tests of the receive completion lifecycle (docs/DESIGN.md §3, §7).
//! Concurrency is driven by channels; "the runner has done its
//! work" is observed by queueing a marker behind it on a one-thread runner.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Once};
use std::time::Duration;

mod common;

use common::{ok, wait, wait_retired};
use crossbeam_channel::bounded;
use once_cell::sync::Lazy;
use parking_lot::Mutex;

use pjrt_crosshost::kv::{
    CallbackStore, CallbackStoreOptions, KeyValueStore, MemoryStore, Op, RawKvCallbacks, TestStore,
};
use pjrt_crosshost::status::{self, Code, Outcome, Result};
use pjrt_crosshost::sync::{AsyncWorkRunner, Metrics, MetricsSnapshot};
use pjrt_crosshost::transfer::recv_state::RecordOutcome;
use pjrt_crosshost::transfer::{
    CompletionKey, PendingReceive, Receipt, ReceiveConfig, ReceiveTracker,
};

/// Long enough never to fire in a passing run; a hang fails instead of blocking CI.
const PATIENCE: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------

/// Records every log line so that tests can check what was logged.
struct CaptureLog;
static LOGGED: Lazy<Mutex<Vec<(log::Level, String)>>> = Lazy::new(Default::default);

impl log::Log for CaptureLog {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, record: &log::Record) {
        LOGGED
            .lock()
            .push((record.level(), record.args().to_string()));
    }
    fn flush(&self) {}
}

fn capture_logs() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        log::set_boxed_logger(Box::new(CaptureLog)).unwrap();
        log::set_max_level(log::LevelFilter::Debug);
    });
}

fn logged(level: log::Level, containing: &str) -> bool {
    LOGGED
        .lock()
        .iter()
        .any(|(l, m)| *l == level && m.contains(containing))
}

struct Harness {
    mem: Arc<MemoryStore>,
    store: Arc<TestStore>,
    runner: Arc<AsyncWorkRunner>,
    metrics: Arc<Metrics>,
    tracker: Arc<ReceiveTracker>,
}

impl Harness {
    fn new(config: ReceiveConfig) -> Harness {
        Harness::over(Arc::new(MemoryStore::new()), config)
    }

    fn over(mem: Arc<MemoryStore>, config: ReceiveConfig) -> Harness {
        capture_logs();
        let store = Arc::new(TestStore::new(mem.clone()));
        // One worker: a marker queued after a callback runs after it.
        let runner = Arc::new(AsyncWorkRunner::new("lifecycle-test", 1));
        let metrics = Arc::new(Metrics::new());
        let tracker = ReceiveTracker::new(store.clone(), runner.clone(), metrics.clone(), config);
        Harness {
            mem,
            store,
            runner,
            metrics,
            tracker,
        }
    }

    /// Returns once everything queued on the runner so far has run.
    fn drain_runner(&self) {
        let (tx, rx) = bounded(1);
        self.runner.submit(move || tx.send(()).unwrap());
        rx.recv_timeout(PATIENCE).expect("runner drained");
    }

    fn m(&self) -> MetricsSnapshot {
        self.metrics.snapshot()
    }
}

fn key(transfer: i64, index: u64) -> CompletionKey {
    CompletionKey::new("test-epoch", transfer, index).unwrap()
}

fn code(outcome: &Outcome) -> Option<Code> {
    outcome.as_ref().err().map(|e| e.code)
}

// ---------------------------------------------------------------------------
// Success, cancellation, timeout
// ---------------------------------------------------------------------------

#[test]
fn success_deletes_the_key_after_the_event_is_ready_and_try_get_is_not_found() {
    let h = Harness::new(ReceiveConfig::default());
    let k = key(1, 0);
    let rx = h.tracker.begin(k.clone(), 7, vec![]).unwrap();
    assert!(!rx.future().is_ready());
    h.store.set(k.as_str(), &ok(7)).unwrap();
    assert_eq!(wait(&rx.future()), Ok(()));
    assert_eq!(wait_retired(&rx), Ok(()));
    assert_eq!(h.store.calls_for(Op::Delete, k.as_str()), 1);
    assert_eq!(
        h.store.try_get(k.as_str()).unwrap_err().code,
        Code::NotFound
    );
    let m = h.m();
    assert_eq!(
        (m.keys_created, m.keys_deleted, m.keys_outstanding),
        (1, 1, 0)
    );
    assert_eq!(h.tracker.outstanding(), 0);
}

#[test]
fn publication_and_recording_run_on_the_lifecycle_runner_not_on_the_thread_that_observed_the_key() {
    let h = Harness::new(ReceiveConfig::default());
    let k = key(1, 1);
    let current = || {
        std::thread::current()
            .name()
            .unwrap_or("unnamed")
            .to_string()
    };
    let (recorded_tx, recorded_rx) = bounded(1);
    let record: RecordOutcome = Box::new(move |_: &Outcome| {
        recorded_tx.send(current()).unwrap();
    });
    let rx = h
        .tracker
        .begin_recording(k.clone(), 7, vec![], Some(record))
        .unwrap();
    let (published_tx, published_rx) = bounded(1);
    rx.future()
        .on_ready(move |_| published_tx.send(current()).unwrap());
    // The memory store fires the AsyncGet on the thread that sets the key.
    let store = h.store.clone();
    let observer = std::thread::Builder::new()
        .name("key-observer".into())
        .spawn(move || store.set(k.as_str(), &ok(7)).unwrap())
        .unwrap();
    observer.join().unwrap();
    let published_on = published_rx.recv_timeout(PATIENCE).expect("published");
    let recorded_on = recorded_rx.recv_timeout(PATIENCE).expect("recorded");
    assert_eq!(
        published_on, "lifecycle-test-0",
        "the outcome was published off the runner"
    );
    assert_eq!(
        recorded_on, "lifecycle-test-0",
        "the outcome was recorded off the runner"
    );
    assert_eq!(wait(&rx.future()), Ok(()));
}

#[test]
fn cancellation_publishes_cancelled_wakes_the_async_get_and_the_key_ends_absent() {
    let h = Harness::new(ReceiveConfig::default());
    let k = key(2, 0);
    let rx = h.tracker.begin(k.clone(), 3, vec![]).unwrap();
    assert_eq!(h.mem.waiter_count(), 1);
    rx.cancel(status::cancelled("user cancelled")).unwrap();
    // Published before cancel() returned, not after the wake-up round trip.
    assert_eq!(
        rx.future().try_get(),
        Some(Err(status::cancelled("user cancelled")))
    );
    // The wake-up: a CANCEL receipt set on the key fired the AsyncGet...
    assert_eq!(h.store.calls_for(Op::Set, k.as_str()), 1);
    assert_eq!(h.mem.waiter_count(), 0);
    assert_eq!(h.store.calls_for(Op::CancelAsyncGet, k.as_str()), 0);
    // ...whose callback retired the key.
    assert_eq!(wait_retired(&rx), Ok(()));
    assert_eq!(
        h.store.try_get(k.as_str()).unwrap_err().code,
        Code::NotFound
    );
    assert_eq!(wait(&rx.future()).unwrap_err().code, Code::Cancelled);
    let m = h.m();
    assert_eq!((m.cancellations, m.keys_outstanding), (1, 0));
}

#[test]
fn timeout_publishes_deadline_exceeded_and_still_retires_key_and_waiter() {
    let h = Harness::new(ReceiveConfig {
        timeout: Some(Duration::from_millis(20)),
        retire_keys: true,
    });
    let k = key(3, 0);
    h.store.set(&k.descriptor_key(), b"descriptor").unwrap();
    let rx = h
        .tracker
        .begin(k.clone(), 1, vec![k.descriptor_key()])
        .unwrap();
    assert_eq!(code(&wait(&rx.future())), Some(Code::DeadlineExceeded));
    assert_eq!(wait_retired(&rx), Ok(()));
    assert_eq!(h.mem.waiter_count(), 0, "pending AsyncGet retired");
    assert!(
        h.mem.is_empty(),
        "descriptor key retired too: {:?}",
        h.mem.keys()
    );
    let m = h.m();
    assert_eq!((m.timeouts, m.keys_created, m.keys_deleted), (1, 2, 2));
    // A sender that shows up late changes nothing.
    h.store.set(k.as_str(), &ok(1)).unwrap();
    h.drain_runner();
    assert_eq!(code(&wait(&rx.future())), Some(Code::DeadlineExceeded));
}

#[test]
fn a_receive_that_completes_in_time_is_not_touched_by_its_deadline() {
    let h = Harness::new(ReceiveConfig {
        timeout: Some(Duration::from_secs(3600)),
        retire_keys: true,
    });
    let k = key(3, 1);
    let rx = h.tracker.begin(k.clone(), 1, vec![]).unwrap();
    h.store.set(k.as_str(), &ok(1)).unwrap();
    assert_eq!(wait(&rx.future()), Ok(()));
    wait_retired(&rx).unwrap();
    assert_eq!(h.m().timeouts, 0);
}

// ---------------------------------------------------------------------------
// Deterministic key reuse, with its negative control
// ---------------------------------------------------------------------------

/// Transfer 1 completes on key X (same nonce both times: a deterministic
/// protocol reusing X). Then a second receive begins on X. Returns whether it
/// is waiting for its own sender (its AsyncGet registered, not ready), and
/// the harness and receive to continue with.
fn second_receive_waits_for_its_own_sender(retire_keys: bool) -> (bool, Harness, PendingReceive) {
    let h = Harness::new(ReceiveConfig {
        timeout: None,
        retire_keys,
    });
    let k = key(4, 0);
    let first = h.tracker.begin(k.clone(), 11, vec![]).unwrap();
    h.store.set(k.as_str(), &ok(11)).unwrap();
    assert_eq!(wait(&first.future()), Ok(()));
    wait_retired(&first).unwrap();
    let second = h.tracker.begin(k.clone(), 11, vec![]).unwrap();
    // An AsyncGet on a present key fires inside begin(); on an absent key it
    // is registered and waits. Both are decided before begin() returns.
    let waits = h.mem.waiter_count() == 1 && !second.future().is_ready();
    (waits, h, second)
}

#[test]
fn deterministic_key_reuse_second_receive_stays_pending_until_its_sender_sets_the_key() {
    let (waits, h, second) = second_receive_waits_for_its_own_sender(true);
    assert!(waits, "second receive must wait for its own sender");
    h.store.set(second.key().as_str(), &ok(11)).unwrap();
    assert_eq!(wait(&second.future()), Ok(()));
    wait_retired(&second).unwrap();
    assert!(h.mem.is_empty());
}

#[test]
fn negative_control_without_retirement_the_reused_key_completes_at_once_from_the_stale_entry() {
    let (waits, h, second) = second_receive_waits_for_its_own_sender(false);
    // The check above catches the bug this control reintroduces:
    assert!(!waits, "the assertion of the reuse test would have failed");
    // ...and the second receive indeed completed with no sender at all.
    assert_eq!(wait(&second.future()), Ok(()));
    wait_retired(&second).unwrap();
    assert_eq!(h.store.calls(Op::Delete), 0);
    assert_eq!(h.m().retained_keys, 2);
}

// ---------------------------------------------------------------------------
// Failures of the store
// ---------------------------------------------------------------------------

#[test]
fn delete_failure_keeps_the_published_status_and_is_logged_and_counted() {
    let h = Harness::new(ReceiveConfig::default());
    let k = key(5, 0);
    h.store
        .fail_nth_delete(1, status::unavailable("store went away"));
    let rx = h.tracker.begin(k.clone(), 5, vec![]).unwrap();
    h.store.set(k.as_str(), &ok(5)).unwrap();
    assert_eq!(wait(&rx.future()), Ok(()));
    assert_eq!(code(&wait_retired(&rx)), Some(Code::Unavailable));
    assert_eq!(
        wait(&rx.future()),
        Ok(()),
        "status unchanged by the failed delete"
    );
    assert!(
        logged(log::Level::Error, k.as_str()),
        "delete failure logged at error level"
    );
    let m = h.m();
    assert_eq!(
        (m.delete_failures, m.keys_deleted, m.keys_outstanding),
        (1, 0, 1)
    );
    assert_eq!(
        h.mem.keys(),
        vec![k.as_str().to_string()],
        "the key is still there"
    );
    assert_eq!(h.tracker.outstanding(), 0, "but the receive itself is done");
}

#[test]
fn cancel_wake_up_failure_keeps_the_future_cancelled_reports_the_failure_and_retires_the_waiter() {
    let h = Harness::new(ReceiveConfig::default());
    let k = key(6, 0);
    h.store.set(&k.descriptor_key(), b"descriptor").unwrap();
    let rx = h
        .tracker
        .begin(k.clone(), 6, vec![k.descriptor_key()])
        .unwrap();
    h.store
        .fail_nth_set(1, status::unavailable("coordination service down"));
    let err = rx.cancel(status::cancelled("user cancelled")).unwrap_err();
    assert_eq!(err.code, Code::Unavailable);
    assert!(err.message.contains("cancelled"), "{err}");
    assert_eq!(wait(&rx.future()), Err(status::cancelled("user cancelled")));
    assert_eq!(wait_retired(&rx), Ok(()));
    // The AsyncGet was retired locally, not left waiting for a set that never came.
    assert_eq!(h.store.calls_for(Op::CancelAsyncGet, k.as_str()), 1);
    assert_eq!(h.mem.waiter_count(), 0);
    assert_eq!(h.tracker.outstanding(), 0);
    assert!(h.mem.is_empty(), "keys still retired: {:?}", h.mem.keys());
    // A second cancel is a clear precondition failure.
    let again = rx.cancel(status::cancelled("again")).unwrap_err();
    assert_eq!(again.code, Code::FailedPrecondition);
    let m = h.m();
    assert_eq!((m.cancellations, m.keys_outstanding), (1, 0));
}

#[test]
fn cancel_racing_the_senders_receipt_on_a_no_overwrite_store_reports_already_exists_and_retires_once(
) {
    let h = Harness::over(
        Arc::new(MemoryStore::with_overwrite(false)),
        ReceiveConfig::default(),
    );
    let k = key(6, 1);
    let rx = h.tracker.begin(k.clone(), 8, vec![]).unwrap();
    // Hold the runner so that the receipt's callback is queued, not run.
    let (release, held) = bounded::<()>(0);
    h.runner.submit(move || held.recv().unwrap());
    h.store.set(k.as_str(), &ok(8)).unwrap();
    assert_eq!(h.mem.waiter_count(), 0, "the receipt fired the AsyncGet");
    // Cancel wins the outcome; its wake-up set meets the sender's receipt.
    let err = rx.cancel(status::cancelled("user")).unwrap_err();
    assert_eq!(err.code, Code::AlreadyExists);
    assert_eq!(rx.future().try_get(), Some(Err(status::cancelled("user"))));
    release.send(()).unwrap();
    assert_eq!(wait_retired(&rx), Ok(()));
    assert_eq!(
        h.store.calls_for(Op::Delete, k.as_str()),
        1,
        "retired exactly once"
    );
    assert!(h.mem.is_empty());
    assert_eq!(wait(&rx.future()), Err(status::cancelled("user")));
}

#[test]
fn begin_on_an_unavailable_store_fails_clearly_and_leaves_nothing_behind() {
    let h = Harness::new(ReceiveConfig {
        timeout: Some(Duration::from_secs(3600)),
        retire_keys: true,
    });
    let k = key(7, 0);
    h.store
        .fail_nth_async_get(1, status::unavailable("no store"));
    let err = h.tracker.begin(k.clone(), 1, vec![]).err().unwrap();
    assert_eq!(err.code, Code::Unavailable);
    assert!(
        err.message.contains("begin receive") && err.message.contains(k.as_str()),
        "{err}"
    );
    assert_eq!(h.tracker.outstanding(), 0);
    assert_eq!(h.m().keys_created, 0);
    // The key can be used once the store is back.
    let rx = h.tracker.begin(k.clone(), 1, vec![]).unwrap();
    h.store.set(k.as_str(), &ok(1)).unwrap();
    assert_eq!(wait(&rx.future()), Ok(()));
}

#[test]
fn store_error_while_waiting_becomes_the_outcome_and_the_key_is_retired() {
    let h = Harness::new(ReceiveConfig::default());
    let k = key(8, 0);
    h.store
        .fail_wait_on(k.as_str(), status::unavailable("watch broke"));
    let rx = h.tracker.begin(k.clone(), 1, vec![]).unwrap();
    let outcome = wait(&rx.future());
    assert_eq!(code(&outcome), Some(Code::Unavailable));
    assert_eq!(wait_retired(&rx), Ok(()));
    assert_eq!(h.store.calls_for(Op::Delete, k.as_str()), 1);
}

#[test]
fn sender_error_receipt_is_published_and_the_key_is_retired_all_the_same() {
    let h = Harness::new(ReceiveConfig::default());
    let k = key(9, 0);
    let rx = h.tracker.begin(k.clone(), 2, vec![]).unwrap();
    let failure = status::resource_exhausted("sender out of memory");
    let receipt = Receipt::Error {
        nonce: 2,
        status: failure.clone(),
    };
    h.store.set(k.as_str(), &receipt.encode()).unwrap();
    assert_eq!(wait(&rx.future()), Err(failure));
    wait_retired(&rx).unwrap();
    assert!(h.mem.is_empty());
}

// ---------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------

#[test]
fn cancel_after_completion_or_twice_is_failed_precondition_and_the_outcome_is_unchanged() {
    let h = Harness::new(ReceiveConfig::default());
    let done = h.tracker.begin(key(10, 0), 1, vec![]).unwrap();
    h.store.set(done.key().as_str(), &ok(1)).unwrap();
    assert_eq!(wait(&done.future()), Ok(()));
    let err = done.cancel(status::cancelled("too late")).unwrap_err();
    assert_eq!(err.code, Code::FailedPrecondition);
    assert!(err.message.contains("already completed"), "{err}");
    assert_eq!(wait(&done.future()), Ok(()));

    let cancelled = h.tracker.begin(key(10, 1), 1, vec![]).unwrap();
    cancelled.cancel(status::cancelled("first")).unwrap();
    let err = cancelled.cancel(status::cancelled("second")).unwrap_err();
    assert_eq!(err.code, Code::FailedPrecondition);
    assert!(err.message.contains("already cancelled"), "{err}");
    assert_eq!(wait(&cancelled.future()), Err(status::cancelled("first")));
    assert_eq!(h.m().cancellations, 1);
}

// ---------------------------------------------------------------------------
// Per-buffer readiness
// ---------------------------------------------------------------------------

#[test]
fn staggered_completion_buffer_three_is_ready_before_buffer_zero() {
    let h = Harness::new(ReceiveConfig::default());
    let rxs: Vec<PendingReceive> = (0..4)
        .map(|i| h.tracker.begin(key(11, i), 100 + i, vec![]).unwrap())
        .collect();
    h.store.set(rxs[3].key().as_str(), &ok(103)).unwrap();
    assert_eq!(wait(&rxs[3].future()), Ok(()));
    for rx in &rxs[..3] {
        assert!(!rx.future().is_ready(), "{} gated on buffer 3?", rx.key());
    }
    for i in (0..3).rev() {
        h.store
            .set(rxs[i].key().as_str(), &ok(100 + i as u64))
            .unwrap();
        assert_eq!(wait(&rxs[i].future()), Ok(()));
        for rx in &rxs[..i] {
            assert!(!rx.future().is_ready());
        }
    }
    for rx in &rxs {
        wait_retired(rx).unwrap();
    }
    assert!(h.mem.is_empty());
}

#[test]
fn readiness_does_not_wait_on_delete() {
    let h = Harness::new(ReceiveConfig::default());
    let (gate, gate_rx) = bounded(0);
    h.store.gate_deletes(gate_rx);
    let k = key(12, 0);
    let rx = h.tracker.begin(k.clone(), 1, vec![]).unwrap();
    h.store.set(k.as_str(), &ok(1)).unwrap();
    // Every delete is blocked on the gate: if readiness waited on delete this
    // would time out.
    assert_eq!(wait(&rx.future()), Ok(()));
    assert!(!rx.retired().is_ready());
    assert_eq!(
        h.mem.keys(),
        vec![k.as_str().to_string()],
        "not deleted yet"
    );
    gate.send(()).unwrap();
    assert_eq!(wait_retired(&rx), Ok(()));
    assert!(h.mem.is_empty());
}

// ---------------------------------------------------------------------------
// Stale receipts
// ---------------------------------------------------------------------------

#[test]
fn stale_receipt_with_wrong_nonce_never_completes() {
    let h = Harness::new(ReceiveConfig::default());
    let k = key(13, 0);
    // Left over from an earlier transfer on the same key.
    h.store.set(k.as_str(), &ok(1)).unwrap();
    let rx = h.tracker.begin(k.clone(), 2, vec![]).unwrap();
    h.drain_runner();
    assert!(!rx.future().is_ready());
    assert_eq!(h.m().stale_receipts_rejected, 1);
    // More wrong values: another nonce, an error and a cancel for someone
    // else, and garbage. None completes the buffer.
    let strangers = [
        ok(3),
        Receipt::Error {
            nonce: 4,
            status: status::internal("not yours"),
        }
        .encode(),
        Receipt::Cancel { nonce: 5 }.encode(),
        b"garbage".to_vec(),
    ];
    for (i, value) in strangers.iter().enumerate() {
        h.store.set(k.as_str(), value).unwrap();
        h.drain_runner();
        assert!(!rx.future().is_ready(), "completed by stranger #{i}");
        assert_eq!(h.m().stale_receipts_rejected, 2 + i as u64);
        assert_eq!(h.mem.waiter_count(), 1, "re-armed, one waiter");
    }
    // Re-setting the same stale value does not even wake the waiter.
    h.store.set(k.as_str(), b"garbage").unwrap();
    h.drain_runner();
    assert_eq!(h.m().stale_receipts_rejected, 5);
    h.store.set(k.as_str(), &ok(2)).unwrap();
    assert_eq!(wait(&rx.future()), Ok(()));
    wait_retired(&rx).unwrap();
    assert!(h.mem.is_empty());
}

#[test]
fn store_that_cannot_delete_retains_keys_honestly_and_the_nonce_protects_reuse() {
    let h = Harness::new(ReceiveConfig::default());
    h.store.disable_delete();
    let k = key(14, 0);
    let first = h.tracker.begin(k.clone(), 1, vec![]).unwrap();
    h.store.set(k.as_str(), &ok(1)).unwrap();
    assert_eq!(wait(&first.future()), Ok(()));
    wait_retired(&first).unwrap();
    assert_eq!(h.store.calls(Op::Delete), 0, "no pointless delete calls");
    let m = h.m();
    assert_eq!(
        (m.retained_keys, m.keys_deleted, m.keys_outstanding),
        (1, 0, 1)
    );
    // Reuse with a fresh nonce: the retained receipt is stale.
    let second = h.tracker.begin(k.clone(), 2, vec![]).unwrap();
    h.drain_runner();
    assert!(!second.future().is_ready());
    h.store.set(k.as_str(), &ok(2)).unwrap();
    assert_eq!(wait(&second.future()), Ok(()));
    assert_eq!(h.m().stale_receipts_rejected, 1);
}

/// KV callbacks over a memory store without a delete callback (what JAX
/// gives), counting polls.
struct NoDeleteCallbacks {
    store: MemoryStore,
    try_gets: AtomicUsize,
    first_poll: Mutex<Option<crossbeam_channel::Sender<()>>>,
}

impl RawKvCallbacks for NoDeleteCallbacks {
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.store.get(key, timeout)
    }
    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        self.try_gets.fetch_add(1, Ordering::SeqCst);
        if let Some(first) = self.first_poll.lock().take() {
            first.send(()).unwrap();
        }
        self.store.try_get(key)
    }
    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        self.store.set(key, value)
    }
    fn delete(&self, _key: &str) -> Option<Result<()>> {
        None
    }
    fn has_delete(&self) -> bool {
        false
    }
}

#[test]
fn stale_receipt_on_a_callback_store_without_delete_is_waited_out_by_bounded_polling() {
    capture_logs();
    let (first_poll, polled) = bounded(1);
    let raw = Arc::new(NoDeleteCallbacks {
        store: MemoryStore::new(),
        try_gets: AtomicUsize::new(0),
        first_poll: Mutex::new(Some(first_poll)),
    });
    let store = Arc::new(CallbackStore::new(
        raw.clone(),
        CallbackStoreOptions {
            pool_threads: 2,
            wait_slice: Duration::from_millis(20),
            max_backoff: Duration::from_millis(20),
            can_overwrite: true,
            ..CallbackStoreOptions::default()
        },
    ));
    let metrics = Arc::new(Metrics::new());
    let runner = Arc::new(AsyncWorkRunner::new("cb-test", 1));
    let tracker = ReceiveTracker::new(
        store.clone(),
        runner,
        metrics.clone(),
        ReceiveConfig::default(),
    );
    let k = key(15, 0);
    store.set(k.as_str(), &ok(1)).unwrap();
    let rx = tracker.begin(k.clone(), 2, vec![]).unwrap();
    let started = std::time::Instant::now();
    // The first try_get poll means the stale value was seen and the wait
    // re-armed past it.
    polled.recv_timeout(PATIENCE).unwrap();
    assert!(!rx.future().is_ready());
    store.set(k.as_str(), &ok(2)).unwrap();
    assert_eq!(wait(&rx.future()), Ok(()));
    wait_retired(&rx).unwrap();
    let elapsed = started.elapsed();
    let polls = raw.try_gets.load(Ordering::SeqCst);
    // Backoff 1, 2, 4, ... capped at 20 ms: about elapsed/20ms polls plus the
    // ramp-up; a spinning loop would make thousands.
    let bound = (elapsed.as_millis() / 20) as usize + 10;
    assert!(polls <= bound, "{polls} polls in {elapsed:?}");
    let m = metrics.snapshot();
    assert_eq!((m.stale_receipts_rejected, m.retained_keys), (1, 1));
    assert_eq!(store.pending_waiters(), 0);
}

// ---------------------------------------------------------------------------
// Randomized races
// ---------------------------------------------------------------------------

/// SplitMix64: a tiny seeded generator, so failures reproduce by seed.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Plan {
    Success,
    SenderError,
    Cancel,
    SuccessRacingCancel,
    StoreError,
    NothingHappens,
}

fn run_races(seed: u64, buffers: u64) {
    capture_logs();
    let mut rng = SplitMix(seed);
    let mem = Arc::new(MemoryStore::new());
    let store = Arc::new(TestStore::new(mem.clone()));
    let runner = Arc::new(AsyncWorkRunner::new("race", 2));
    let metrics = Arc::new(Metrics::new());
    // No deadline, and deadlines short enough to race the senders.
    let trackers: Vec<(Option<Duration>, Arc<ReceiveTracker>)> =
        [None, Some(50), Some(300), Some(1000)]
            .into_iter()
            .map(|micros| {
                let timeout = micros.map(Duration::from_micros);
                let config = ReceiveConfig {
                    timeout,
                    retire_keys: true,
                };
                let tracker =
                    ReceiveTracker::new(store.clone(), runner.clone(), metrics.clone(), config);
                (timeout, tracker)
            })
            .collect();
    let plans = [
        Plan::Success,
        Plan::SenderError,
        Plan::Cancel,
        Plan::SuccessRacingCancel,
        Plan::StoreError,
        Plan::NothingHappens,
    ];
    struct Case {
        plan: Plan,
        deadline: bool,
        rx: PendingReceive,
        ready_calls: Arc<AtomicUsize>,
        cancel_result: Mutex<Option<Result<()>>>,
    }
    type Batch = Arc<Vec<Case>>;
    // The sender walks each batch forwards, the canceller backwards, at the
    // same time: they meet (and race) in the middle, while the deadlines run.
    let (to_sender, sender_batches) = crossbeam_channel::unbounded::<Batch>();
    let (to_canceller, canceller_batches) = crossbeam_channel::unbounded::<Batch>();
    let (done, batch_done) = crossbeam_channel::unbounded::<()>();
    let sender = {
        let (store, done) = (store.clone(), done.clone());
        std::thread::spawn(move || {
            for batch in sender_batches {
                for case in batch.iter() {
                    let key = case.rx.key().as_str();
                    let nonce = case.rx.nonce();
                    match case.plan {
                        Plan::Success | Plan::SuccessRacingCancel => {
                            store.set(key, &ok(nonce)).unwrap()
                        }
                        Plan::SenderError => {
                            let receipt = Receipt::Error {
                                nonce,
                                status: status::data_loss("sender failed"),
                            };
                            store.set(key, &receipt.encode()).unwrap()
                        }
                        _ => {}
                    }
                }
                done.send(()).unwrap();
            }
        })
    };
    let canceller = std::thread::spawn(move || {
        for batch in canceller_batches {
            for case in batch.iter().rev() {
                if matches!(case.plan, Plan::Cancel | Plan::SuccessRacingCancel) {
                    let result = case.rx.cancel(status::cancelled("race"));
                    *case.cancel_result.lock() = Some(result);
                }
            }
            done.send(()).unwrap();
        }
    });
    let mut batches: Vec<Batch> = Vec::new();
    let mut i = 0;
    while i < buffers {
        let mut batch = Vec::new();
        for _ in 0..16.min(buffers - i) {
            let plan = plans[(rng.next() % plans.len() as u64) as usize];
            let (timeout, tracker) = if plan == Plan::NothingHappens {
                &trackers[1 + (rng.next() % 3) as usize]
            } else {
                &trackers[(rng.next() % 4) as usize]
            };
            let k = CompletionKey::new(&format!("race-{seed}"), 1, i).unwrap();
            i += 1;
            if plan == Plan::StoreError {
                store.fail_wait_on(k.as_str(), status::unavailable("injected"));
            }
            let rx = tracker.begin(k, rng.next(), vec![]).unwrap();
            let ready_calls = Arc::new(AtomicUsize::new(0));
            let calls = ready_calls.clone();
            rx.future().on_ready(move |_| {
                calls.fetch_add(1, Ordering::SeqCst);
            });
            batch.push(Case {
                plan,
                deadline: timeout.is_some(),
                rx,
                ready_calls,
                cancel_result: Mutex::new(None),
            });
        }
        let batch = Arc::new(batch);
        to_sender.send(batch.clone()).unwrap();
        to_canceller.send(batch.clone()).unwrap();
        batch_done.recv().unwrap();
        batch_done.recv().unwrap();
        batches.push(batch);
    }
    drop((to_sender, to_canceller));
    sender.join().unwrap();
    canceller.join().unwrap();
    let cases: Vec<&Case> = batches.iter().flat_map(|b| b.iter()).collect();

    let mut late_sender_keys = Vec::new();
    let (mut cancelled_ok, mut timed_out) = (0u64, 0u64);
    for case in cases {
        let outcome = wait(&case.rx.future());
        assert_eq!(
            wait_retired(&case.rx),
            Ok(()),
            "seed {seed}: {:?}",
            case.plan
        );
        let c = code(&outcome);
        if c == Some(Code::DeadlineExceeded) {
            assert!(
                case.deadline,
                "seed {seed}: deadline without a timeout configured"
            );
            timed_out += 1;
        } else {
            let allowed: &[Option<Code>] = match case.plan {
                Plan::Success => &[None],
                Plan::SenderError => &[Some(Code::DataLoss)],
                Plan::Cancel => &[Some(Code::Cancelled)],
                Plan::SuccessRacingCancel => &[None, Some(Code::Cancelled)],
                Plan::StoreError => &[Some(Code::Unavailable)],
                Plan::NothingHappens => &[],
            };
            assert!(
                allowed.contains(&c),
                "seed {seed}: {:?} ended {outcome:?}",
                case.plan
            );
        }
        // cancel() agrees with the outcome: Ok exactly when it won.
        if let Some(result) = case.cancel_result.lock().take() {
            match result {
                Ok(()) => {
                    assert_eq!(outcome, Err(status::cancelled("race")));
                    cancelled_ok += 1;
                }
                Err(e) => {
                    assert_eq!(e.code, Code::FailedPrecondition, "seed {seed}: {e}");
                    assert_ne!(outcome, Err(status::cancelled("race")));
                }
            }
        }
        assert_eq!(
            case.ready_calls.load(Ordering::SeqCst),
            1,
            "exactly one callback"
        );
        // A sender whose receipt arrived after the receiver had decided
        // (cancel, deadline) and retired leaves its receipt: only the sender's
        // own value, never one of ours.
        let decided_locally = matches!(c, Some(Code::Cancelled | Code::DeadlineExceeded));
        let sender_wrote = matches!(
            case.plan,
            Plan::Success | Plan::SenderError | Plan::SuccessRacingCancel
        );
        if let Ok(value) = mem.try_get(case.rx.key().as_str()) {
            assert!(
                decided_locally && sender_wrote,
                "seed {seed}: key left by {:?}",
                case.plan
            );
            let receipt = Receipt::decode(&value).unwrap();
            assert!(
                !matches!(receipt, Receipt::Cancel { .. }),
                "our CANCEL receipt leaked"
            );
            late_sender_keys.push(case.rx.key().as_str().to_string());
        }
    }
    assert_eq!(
        mem.len(),
        late_sender_keys.len(),
        "seed {seed}: only late senders' keys remain"
    );
    for k in &late_sender_keys {
        mem.delete(k).unwrap();
    }
    assert!(mem.is_empty());
    assert_eq!(mem.waiter_count(), 0, "seed {seed}: no waiter left");
    for (_, tracker) in &trackers {
        assert_eq!(tracker.outstanding(), 0);
    }
    let m = metrics.snapshot();
    assert_eq!(m.keys_created, buffers);
    assert_eq!(m.keys_deleted, buffers);
    assert_eq!(
        (
            m.keys_outstanding,
            m.delete_failures,
            m.stale_receipts_rejected
        ),
        (0, 0, 0)
    );
    assert_eq!(m.cancellations, cancelled_ok);
    assert_eq!(m.timeouts, timed_out);
}

#[test]
fn randomized_success_cancel_error_timeout_races_have_exactly_one_outcome_each_and_leave_no_key() {
    // 3 x 34,000 = 102,000 buffers: rule 8 of docs/DESIGN.md §3 asks for 100k.
    // About 2.5 s in release (make test), longer in debug.
    for seed in [1, 2, 3] {
        run_races(seed, 34_000);
    }
}

// ---------------------------------------------------------------------------
// Order of the steps, raced at the exact point where a wrong order shows
// ---------------------------------------------------------------------------

#[test]
fn cancellation_is_published_while_the_wake_up_set_is_still_in_flight() {
    // A store whose set does not return at once: the cancelled outcome must
    // be visible before the wake-up `set` returns (rule 4: publish first).
    let h = Harness::new(ReceiveConfig::default());
    let (release, gate) = bounded(0);
    h.store.gate_sets(gate);
    let k = key(40, 0);
    let rx = h.tracker.begin(k.clone(), 9, vec![]).unwrap();
    let canceller = {
        let rx = rx.clone();
        std::thread::spawn(move || rx.cancel(status::cancelled("user cancelled")))
    };
    assert_eq!(
        code(&wait(&rx.future())),
        Some(Code::Cancelled),
        "the cancellation waited for the wake-up set"
    );
    // Publishing comes before the set, so the set may not have been reached
    // yet; it cannot return before it takes the gate below (a rendezvous).
    assert!(!canceller.is_finished(), "the wake-up set is still held");
    release
        .send_timeout((), Duration::from_secs(10))
        .expect("the wake-up set was never issued");
    assert_eq!(h.store.calls_for(Op::Set, k.as_str()), 1, "one wake-up set");
    canceller.join().unwrap().unwrap();
    assert_eq!(wait_retired(&rx), Ok(()));
    assert!(h.mem.is_empty(), "{:?}", h.mem.keys());
}

#[test]
fn the_real_receipt_written_just_after_a_stale_one_was_seen_completes_the_buffer() {
    // The sender's receipt lands right after the tracker read a stale value
    // and before its next store call on the key. Re-arming past the stale
    // value sees it; deleting the stale value first would destroy it, and the
    // buffer would wait out its deadline.
    let h = Harness::new(ReceiveConfig {
        timeout: Some(Duration::from_secs(5)),
        retire_keys: true,
    });
    let k = key(41, 0);
    let rx = h.tracker.begin(k.clone(), 2, vec![]).unwrap();
    let (mem, real) = (h.mem.clone(), k.as_str().to_string());
    h.store.before_next_op_on(k.as_str(), move || {
        mem.set(&real, &ok(2)).unwrap();
    });
    // Bypasses the TestStore: the hook fires on the tracker's reaction.
    h.mem.set(k.as_str(), &ok(1)).unwrap();
    assert_eq!(wait(&rx.future()), Ok(()), "the real receipt was lost");
    assert_eq!(h.m().stale_receipts_rejected, 1);
    assert_eq!(
        h.store.calls_for(Op::AsyncGet, k.as_str()),
        2,
        "re-armed once"
    );
    assert_eq!(wait_retired(&rx), Ok(()));
    assert!(h.mem.is_empty(), "{:?}", h.mem.keys());
}

#[test]
fn a_retired_receive_leaves_no_deadline_timer_armed_on_any_path() {
    let h = Harness::new(ReceiveConfig {
        timeout: Some(Duration::from_secs(600)),
        retire_keys: true,
    });
    // Completed by its receipt.
    let done = h.tracker.begin(key(42, 0), 1, vec![]).unwrap();
    // Cancelled.
    let cancelled = h.tracker.begin(key(42, 1), 2, vec![]).unwrap();
    // Failed by the sender.
    let failed = h.tracker.begin(key(42, 2), 3, vec![]).unwrap();
    assert_eq!(h.tracker.deadline_timers_pending(), 3);
    h.store.set(done.key().as_str(), &ok(1)).unwrap();
    cancelled.cancel(status::cancelled("test")).unwrap();
    let error = Receipt::Error {
        nonce: 3,
        status: status::internal("sender failed"),
    };
    h.store.set(failed.key().as_str(), &error.encode()).unwrap();
    for rx in [&done, &cancelled, &failed] {
        assert_eq!(wait_retired(rx), Ok(()));
    }
    assert_eq!(h.tracker.outstanding(), 0);
    assert_eq!(
        h.tracker.deadline_timers_pending(),
        0,
        "a retired receive kept its deadline timer (and itself) alive"
    );
}
