//! The etcd store against a real etcd server (tests/etcd_server): the store
//! contract, leases, dead writers, compaction, a server stopped and
//! restarted, and the lifecycle regression set over etcd.
#![cfg(feature = "etcd")]

mod common;
mod etcd_server;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver};

use common::{ok, wait, wait_retired};
use etcd_server::EtcdServer;
use pjrt_crosshost::kv::etcd::{EtcdConfig, EtcdStore};
use pjrt_crosshost::kv::{GetCallback, KeyValueStore, Op, TestStore};
use pjrt_crosshost::status::{self, Code, Result};
use pjrt_crosshost::sync::{AsyncWorkRunner, Metrics};
use pjrt_crosshost::transfer::{CompletionKey, PendingReceive, ReceiveConfig, ReceiveTracker};

/// Long enough never to pass in a good run; a hang fails instead.
const PATIENCE: Duration = Duration::from_secs(20);

fn store(server: &EtcdServer, call_timeout: Duration) -> Arc<EtcdStore> {
    Arc::new(
        EtcdStore::connect(EtcdConfig {
            access: Default::default(),
            endpoints: vec![server.endpoint()],
            lease_ttl: Duration::from_secs(2),
            call_timeout,
        })
        .expect("connecting to the test's etcd"),
    )
}

type Delivery = Receiver<Result<Vec<u8>>>;

fn waiter() -> (GetCallback, Delivery) {
    let (tx, rx) = bounded(1);
    (
        Box::new(move |value| {
            tx.send(value).unwrap();
        }),
        rx,
    )
}

/// Blocks until `what` holds, polling a state (not a clock) for PATIENCE.
fn until(what: &str, mut holds: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !holds() {
        assert!(Instant::now() < deadline, "not within {PATIENCE:?}: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Every wait registered so far has fired or is covered by a watch.
fn settled(store: &EtcdStore) {
    until("the store's Ranges settled", || store.arms_in_flight() == 0);
}

fn delivered(rx: &Delivery) -> Result<Vec<u8>> {
    rx.recv_timeout(PATIENCE).expect("the callback ran")
}

// ---------------------------------------------------------------------------
// The store contract
// ---------------------------------------------------------------------------

#[test]
fn values_round_trip_and_waits_fire_on_the_write_or_at_once_if_present() {
    let server = EtcdServer::start_new();
    let s = store(&server, Duration::from_secs(5));
    assert_eq!(s.try_get("crosshost/t/a").unwrap_err().code, Code::NotFound);
    // A wait registered before the write fires on it...
    let (cb, before) = waiter();
    s.async_get("crosshost/t/a", None, cb).unwrap();
    settled(&s);
    assert!(before.try_recv().is_err(), "nothing written yet");
    assert_eq!(s.active_watches(), 1);
    s.set("crosshost/t/a", b"one").unwrap();
    assert_eq!(delivered(&before).unwrap(), b"one");
    // ...one registered after it fires at once.
    let (cb, after) = waiter();
    s.async_get("crosshost/t/a", None, cb).unwrap();
    assert_eq!(delivered(&after).unwrap(), b"one");
    assert_eq!(s.get("crosshost/t/a", PATIENCE).unwrap(), b"one");
    assert_eq!(s.try_get("crosshost/t/a").unwrap(), b"one");
    // A value equal to the stale one does not count; the next write does.
    let (cb, changed) = waiter();
    s.async_get("crosshost/t/a", Some(b"one"), cb).unwrap();
    settled(&s);
    s.set("crosshost/t/a", b"one").unwrap();
    s.set("crosshost/t/a", b"two").unwrap();
    assert_eq!(delivered(&changed).unwrap(), b"two");
    // Delete is real, and deleting an absent key is fine.
    s.delete("crosshost/t/a").unwrap();
    s.delete("crosshost/t/a").unwrap();
    assert!(server.keys("crosshost/t/").is_empty());
    // A cancelled wait never runs; its watch goes with it.
    let (cb, cancelled) = waiter();
    let id = s.async_get("crosshost/t/b", None, cb).unwrap();
    settled(&s);
    assert!(s.cancel_async_get("crosshost/t/b", id));
    assert!(!s.cancel_async_get("crosshost/t/b", id), "only once");
    s.set("crosshost/t/b", b"late").unwrap();
    until("the watch was cancelled", || s.active_watches() == 0);
    assert!(cancelled.try_recv().is_err());
    assert_eq!(
        s.get("crosshost/t/none", Duration::from_millis(300))
            .unwrap_err()
            .code,
        Code::DeadlineExceeded
    );
    assert_eq!(s.pending_waiters(), 0);
}

#[test]
fn a_thousand_waits_share_one_stream_and_each_gets_its_own_value() {
    let server = EtcdServer::start_new();
    let s = store(&server, Duration::from_secs(5));
    let rxs: Vec<Delivery> = (0..1000)
        .map(|i| {
            let (cb, rx) = waiter();
            s.async_get(&format!("crosshost/many/{i}"), None, cb)
                .unwrap();
            rx
        })
        .collect();
    settled(&s);
    assert_eq!(s.active_watches(), 1000);
    for i in (0..1000).rev() {
        s.set_async(
            &format!("crosshost/many/{i}"),
            format!("v{i}").as_bytes(),
            Box::new(|r| r.unwrap()),
        );
    }
    for (i, rx) in rxs.iter().enumerate() {
        assert_eq!(delivered(rx).unwrap(), format!("v{i}").as_bytes());
    }
    until("every watch retired", || s.active_watches() == 0);
    assert_eq!(s.pending_waiters(), 0);
}

#[test]
fn every_key_lives_under_the_stores_lease_and_dropping_the_store_revokes_it() {
    let server = EtcdServer::start_new();
    let s = store(&server, Duration::from_secs(5));
    s.set("crosshost/lease/a", b"1").unwrap();
    s.set("crosshost/lease/b", b"2").unwrap();
    let listed = server.ctl(&["get", "crosshost/lease/a", "-w", "json"]);
    assert!(
        listed.contains(&format!("\"lease\":{}", s.lease_id())),
        "key not under lease {}: {listed}",
        s.lease_id()
    );
    assert!(s.lease_ttl() >= Duration::from_secs(2));
    let started = Instant::now();
    drop(s);
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(
        server.keys("crosshost/").is_empty(),
        "{:?}",
        server.keys("crosshost/")
    );
}

// ---------------------------------------------------------------------------
// Dead writers
// ---------------------------------------------------------------------------

/// `reader` tracks process 1, whose liveness key `writer` wrote; keys
/// under `crosshost/w1/` are process 1's to write.
fn tracking(server: &EtcdServer) -> (Arc<EtcdStore>, Arc<EtcdStore>) {
    let reader = store(server, Duration::from_secs(5));
    let writer = store(server, Duration::from_secs(5));
    writer.set("crosshost/live/1", b"entry").unwrap();
    reader
        .track_processes(
            "crosshost/live/",
            vec![(1, "crosshost/live/1".into())],
            Box::new(|key| key.starts_with("crosshost/w1/").then_some(1)),
        )
        .unwrap();
    settled(&reader);
    (reader, writer)
}

#[test]
fn a_writer_that_goes_fails_the_waits_on_its_keys_naming_it_and_nothing_else() {
    let server = EtcdServer::start_new();
    let (reader, writer) = tracking(&server);
    let (cb, its) = waiter();
    reader.async_get("crosshost/w1/receipt", None, cb).unwrap();
    let (cb, other) = waiter();
    reader.async_get("crosshost/w2/receipt", None, cb).unwrap();
    settled(&reader);
    let started = Instant::now();
    drop(writer); // revokes its lease: its liveness key goes
    let e = delivered(&its).unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(e.code, Code::Unavailable);
    assert!(
        e.message.contains("process 1") && e.message.contains("crosshost/w1/receipt"),
        "{e}"
    );
    assert!(
        other.try_recv().is_err(),
        "a key another process writes still waits"
    );
    // A later wait on the dead process's keys fails at once.
    let (cb, later) = waiter();
    reader.async_get("crosshost/w1/next", None, cb).unwrap();
    assert_eq!(delivered(&later).unwrap_err().code, Code::Unavailable);
    reader.set("crosshost/w2/receipt", b"fine").unwrap();
    assert_eq!(delivered(&other).unwrap(), b"fine");
}

#[test]
fn many_processes_are_watched_with_one_watch_and_each_loss_names_only_its_process() {
    let server = EtcdServer::start_new();
    let reader = store(&server, Duration::from_secs(5));
    let writers: Vec<Arc<EtcdStore>> = (0..8)
        .map(|i| {
            let w = store(&server, Duration::from_secs(5));
            w.set(&format!("crosshost/live/{i}"), b"entry").unwrap();
            w
        })
        .collect();
    reader
        .track_processes(
            "crosshost/live/",
            (0..9u32)
                .map(|i| (i, format!("crosshost/live/{i}")))
                .collect(),
            Box::new(|key| {
                key.strip_prefix("crosshost/w")?
                    .split('/')
                    .next()?
                    .parse()
                    .ok()
            }),
        )
        .unwrap();
    settled(&reader);
    assert_eq!(
        reader.active_watches(),
        1,
        "one prefix watch for 8 processes"
    );
    let waits: Vec<_> = (0..8)
        .map(|i| {
            let (cb, rx) = waiter();
            reader
                .async_get(&format!("crosshost/w{i}/receipt"), None, cb)
                .unwrap();
            rx
        })
        .collect();
    settled(&reader);
    let mut writers: Vec<Option<Arc<EtcdStore>>> = writers.into_iter().map(Some).collect();
    drop(writers[5].take()); // revokes its lease: its liveness key goes
    let e = delivered(&waits[5]).unwrap_err();
    assert_eq!(e.code, Code::Unavailable);
    assert!(e.message.contains("process 5"), "{e}");
    for (i, rx) in waits.iter().enumerate().filter(|(i, _)| *i != 5) {
        assert!(
            rx.try_recv().is_err(),
            "process {i}'s wait ended with 5's loss"
        );
    }
    // Process 8 never wrote its entry: lost as soon as the watch is armed.
    let (cb, eight) = waiter();
    reader.async_get("crosshost/w8/receipt", None, cb).unwrap();
    let e = delivered(&eight).unwrap_err();
    assert!(e.message.contains("process 8"), "{e}");
}

#[test]
fn a_value_the_writer_wrote_just_before_it_went_is_still_delivered() {
    let server = EtcdServer::start_new();
    for round in 0..20 {
        let (reader, writer) = tracking(&server);
        let key = format!("crosshost/w1/r{round}");
        let (cb, rx) = waiter();
        reader.async_get(&key, None, cb).unwrap();
        settled(&reader);
        writer.set(&key, b"sent").unwrap();
        drop(writer); // the receipt and the liveness key go in one revision
        assert_eq!(delivered(&rx).unwrap(), b"sent", "round {round}");
    }
}

#[test]
fn a_value_the_writer_wrote_before_it_went_counts_even_when_the_watch_missed_it() {
    // The wait's watch does not see the write (here: a watch from far
    // ahead; in life: one re-armed after a reconnect, or events of two
    // watches out of order). The loss then reads the key as it was just
    // before the writer's lease went, not as it is after (deleted with it).
    let server = EtcdServer::start_new();
    let (reader, writer) = tracking(&server);
    until("the stream is up", || reader.stream_is_up());
    let (cb, rx) = waiter();
    let ahead = current_revision(&server) + 1_000_000;
    reader
        .async_get_watching_from("crosshost/w1/missed", ahead, cb)
        .unwrap();
    settled(&reader);
    writer.set("crosshost/w1/missed", b"sent").unwrap();
    drop(writer);
    assert_eq!(delivered(&rx).unwrap(), b"sent");
}

/// The store's revision now (`etcdctl endpoint status`).
fn current_revision(server: &EtcdServer) -> i64 {
    let status = server.ctl(&["endpoint", "status", "-w", "json"]);
    status
        .split("\"revision\":")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no revision in {status}"))
}

// ---------------------------------------------------------------------------
// Compaction, a stopped and restarted server
// ---------------------------------------------------------------------------

#[test]
fn a_watch_whose_start_revision_was_compacted_is_re_armed_and_sees_the_next_value() {
    let server = EtcdServer::start_new();
    let s = store(&server, Duration::from_secs(5));
    s.set("crosshost/c/k", b"old").unwrap();
    s.delete("crosshost/c/k").unwrap();
    for i in 0..5 {
        s.set("crosshost/c/other", format!("{i}").as_bytes())
            .unwrap();
    }
    server.ctl(&["compact", &current_revision(&server).to_string()]);
    until("the stream is up", || s.stream_is_up());
    let (cb, rx) = waiter();
    // From revision 1: the "old" value's write was compacted away.
    s.async_get_watching_from("crosshost/c/k", 1, cb).unwrap();
    until("re-armed after the compaction", || {
        s.arms_in_flight() == 0 && s.active_watches() == 1
    });
    assert!(rx.try_recv().is_err(), "the key is absent now");
    s.set("crosshost/c/k", b"new").unwrap();
    assert_eq!(delivered(&rx).unwrap(), b"new");
}

#[test]
fn a_stopped_server_fails_waits_and_calls_within_the_call_timeout_and_drop_is_prompt() {
    let mut server = EtcdServer::start_new();
    let call_timeout = Duration::from_millis(1500);
    let s = store(&server, call_timeout);
    let (cb, rx) = waiter();
    s.async_get("crosshost/down/k", None, cb).unwrap();
    settled(&s);
    server.stop();
    let stopped = Instant::now();
    let e = delivered(&rx).unwrap_err();
    let waited = stopped.elapsed();
    assert_eq!(e.code, Code::Unavailable, "{e}");
    assert!(
        e.message.contains("unreachable") && e.message.contains("crosshost/down/k"),
        "{e}"
    );
    assert!(waited < call_timeout + Duration::from_secs(1), "{waited:?}");
    let t = Instant::now();
    let e = s.set("crosshost/down/x", b"1").unwrap_err();
    assert!(
        matches!(e.code, Code::Unavailable | Code::DeadlineExceeded),
        "{e}"
    );
    assert!(t.elapsed() < call_timeout + Duration::from_secs(1));
    let t = Instant::now();
    drop(s);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "drop took {:?}",
        t.elapsed()
    );
    // Back up: a new store works.
    server.start();
    let s = store(&server, call_timeout);
    s.set("crosshost/up/k", b"back").unwrap();
    assert_eq!(s.get("crosshost/up/k", PATIENCE).unwrap(), b"back");
}

#[test]
fn a_wait_survives_a_short_restart_of_the_server() {
    let mut server = EtcdServer::start_new();
    let s = store(&server, Duration::from_secs(10));
    let (cb, rx) = waiter();
    s.async_get("crosshost/restart/k", None, cb).unwrap();
    settled(&s);
    server.stop();
    until("the store noticed", || !s.stream_is_up());
    server.start();
    until("the stream is back", || s.stream_is_up());
    let other = store(&server, Duration::from_secs(10));
    other.set("crosshost/restart/k", b"after").unwrap();
    assert_eq!(delivered(&rx).unwrap(), b"after");
    // The first store's lease survived the restart: its writes still work.
    s.set("crosshost/restart/mine", b"1").unwrap();
}

#[test]
fn a_lease_that_expired_while_etcd_answered_nothing_is_replaced_and_writes_work_again() {
    let server = EtcdServer::start_new();
    let s = store(&server, Duration::from_secs(10));
    let first = s.lease_id();
    // etcd frozen past the lease's TTL (an etcd starved, or refusing
    // renewals while its apply lags): the keep-alive stream breaks
    // unanswered, and the lease is past its time when etcd answers again.
    server.pause();
    std::thread::sleep(s.lease_ttl() * 2); // the fault's length, not a wait for an event
    server.resume();
    until("a new lease replaced the expired one", || {
        s.lease_id() != first
    });
    s.set("crosshost/relet/k", b"1").unwrap();
    let listed = server.ctl(&["get", "crosshost/relet/k", "-w", "json"]);
    assert!(
        listed.contains(&format!("\"lease\":{}", s.lease_id())),
        "key not under the new lease {}: {listed}",
        s.lease_id()
    );
}

#[test]
fn an_idle_connection_under_a_long_lease_is_not_closed_by_etcd_for_pinging_too_often() {
    // Renewals every 10 s: in between etcd sends nothing. A client that
    // pings more often than etcd's --grpc-keepalive-min-time (5 s) while it
    // hears nothing gets the connection closed (GOAWAY "too_many_pings" at
    // the third such ping), and every call and watch on it fails: at a 1 s
    // interval this store's stream was lost 3 times in 20 s.
    let server = EtcdServer::start_new();
    let s = EtcdStore::connect(EtcdConfig {
        access: Default::default(),
        endpoints: vec![server.endpoint()],
        lease_ttl: Duration::from_secs(30),
        call_timeout: Duration::from_secs(10),
    })
    .unwrap();
    let (cb, _rx) = waiter();
    s.async_get("crosshost/idle/k", None, cb).unwrap();
    settled(&s);
    assert_eq!(s.watch_streams_opened(), 1);
    std::thread::sleep(Duration::from_secs(9)); // idle: the time is the test
    assert_eq!(
        s.watch_streams_opened(),
        1,
        "the stream was lost while idle"
    );
    assert!(s.stream_is_up());
}

#[test]
fn a_store_has_at_most_four_writes_at_etcd_and_the_others_wait_their_turn() {
    let server = EtcdServer::start_new();
    let s = store(&server, Duration::from_secs(20));
    server.pause();
    let (done, outcomes) = crossbeam_channel::unbounded();
    for i in 0..20 {
        let done = done.clone();
        s.set_async(
            &format!("crosshost/turns/{i}"),
            b"v",
            Box::new(move |outcome| done.send(outcome).unwrap()),
        );
    }
    until("four writes at etcd", || s.mutations_at_etcd() == 4);
    assert!(outcomes.try_recv().is_err(), "nothing answered yet");
    server.resume();
    for _ in 0..20 {
        outcomes.recv_timeout(PATIENCE).unwrap().unwrap();
    }
    assert_eq!(s.mutations_at_etcd(), 0, "every turn given back");
    assert_eq!(server.keys("crosshost/turns/").len(), 20);
}

// ---------------------------------------------------------------------------
// The lifecycle regression set, over etcd
// ---------------------------------------------------------------------------

struct Lifecycle {
    server: EtcdServer,
    etcd: Arc<EtcdStore>,
    store: Arc<TestStore>,
    metrics: Arc<Metrics>,
    tracker: Arc<ReceiveTracker>,
}

impl Lifecycle {
    fn new(retire_keys: bool) -> Lifecycle {
        let server = EtcdServer::start_new();
        let etcd = store(&server, Duration::from_secs(5));
        let store = Arc::new(TestStore::new(etcd.clone()));
        let runner = Arc::new(AsyncWorkRunner::new("etcd-lifecycle", 2));
        let metrics = Arc::new(Metrics::new());
        let tracker = ReceiveTracker::new(
            store.clone(),
            runner,
            metrics.clone(),
            ReceiveConfig {
                timeout: None,
                retire_keys,
            },
        );
        Lifecycle {
            server,
            etcd,
            store,
            metrics,
            tracker,
        }
    }

    fn transfer_keys(&self) -> Vec<String> {
        self.server.keys("crosshost/recv/")
    }
}

fn key(transfer: i64) -> CompletionKey {
    CompletionKey::new("etcd-test", transfer, 0).unwrap()
}

#[test]
fn lifecycle_success_deletes_the_key_in_etcd() {
    let h = Lifecycle::new(true);
    let k = key(1);
    let rx = h.tracker.begin(k.clone(), 7, vec![]).unwrap();
    settled(&h.etcd);
    assert!(!rx.future().is_ready());
    h.store.set(k.as_str(), &ok(7)).unwrap();
    assert_eq!(wait(&rx.future()), Ok(()));
    assert_eq!(wait_retired(&rx), Ok(()));
    assert!(h.transfer_keys().is_empty(), "{:?}", h.transfer_keys());
    let m = h.metrics.snapshot();
    assert_eq!(
        (m.keys_created, m.keys_deleted, m.keys_outstanding),
        (1, 1, 0)
    );
}

/// A first receive on X completes; a second one on X begins (same nonce:
/// a deterministic protocol). Whether the second waits for its own sender.
fn second_receive_waits(h: &Lifecycle) -> (bool, PendingReceive) {
    let k = key(2);
    let first = h.tracker.begin(k.clone(), 11, vec![]).unwrap();
    h.store.set(k.as_str(), &ok(11)).unwrap();
    assert_eq!(wait(&first.future()), Ok(()));
    wait_retired(&first).unwrap();
    let second = h.tracker.begin(k, 11, vec![]).unwrap();
    settled(&h.etcd);
    // The second's Range has run: it fired (stale entry) or is watching.
    let waits = h.etcd.active_watches() == 1 && !second.future().is_ready();
    (waits, second)
}

#[test]
fn lifecycle_deterministic_key_reuse_waits_for_its_own_sender_in_etcd() {
    let h = Lifecycle::new(true);
    let (waits, second) = second_receive_waits(&h);
    assert!(waits, "the second receive must wait for its own sender");
    h.store.set(second.key().as_str(), &ok(11)).unwrap();
    assert_eq!(wait(&second.future()), Ok(()));
    wait_retired(&second).unwrap();
    assert!(h.transfer_keys().is_empty());
}

#[test]
fn lifecycle_negative_control_without_retirement_the_stale_etcd_entry_completes_the_reuse() {
    let h = Lifecycle::new(false);
    let (waits, second) = second_receive_waits(&h);
    assert!(!waits, "the reuse test's assertion would have failed");
    assert_eq!(wait(&second.future()), Ok(()));
    assert_eq!(h.store.calls(Op::Delete), 0);
    assert_eq!(h.transfer_keys(), vec![key(2).as_str().to_string()]);
}

#[test]
fn lifecycle_delete_failure_keeps_the_status_and_the_key_in_etcd() {
    let h = Lifecycle::new(true);
    let k = key(3);
    h.store
        .fail_nth_delete(1, status::unavailable("etcd went away"));
    let rx = h.tracker.begin(k.clone(), 5, vec![]).unwrap();
    h.store.set(k.as_str(), &ok(5)).unwrap();
    assert_eq!(wait(&rx.future()), Ok(()));
    assert_eq!(wait_retired(&rx).unwrap_err().code, Code::Unavailable);
    assert_eq!(
        wait(&rx.future()),
        Ok(()),
        "status unchanged by the failed delete"
    );
    let m = h.metrics.snapshot();
    assert_eq!(
        (m.delete_failures, m.keys_deleted, m.keys_outstanding),
        (1, 0, 1)
    );
    assert_eq!(h.transfer_keys(), vec![k.as_str().to_string()]);
}

#[test]
fn lifecycle_cancel_wake_up_failure_keeps_the_cancel_and_retires_the_etcd_watch() {
    let h = Lifecycle::new(true);
    let k = key(4);
    let rx = h.tracker.begin(k.clone(), 6, vec![]).unwrap();
    settled(&h.etcd);
    assert_eq!(h.etcd.active_watches(), 1);
    h.store.fail_nth_set(1, status::unavailable("etcd down"));
    let e = rx.cancel(status::cancelled("user cancelled")).unwrap_err();
    assert_eq!(e.code, Code::Unavailable);
    assert_eq!(wait(&rx.future()), Err(status::cancelled("user cancelled")));
    assert_eq!(wait_retired(&rx), Ok(()));
    assert_eq!(h.store.calls_for(Op::CancelAsyncGet, k.as_str()), 1);
    until("the watch retired", || h.etcd.active_watches() == 0);
    assert_eq!(h.etcd.pending_waiters(), 0);
    assert!(h.transfer_keys().is_empty());
}

#[test]
fn lifecycle_a_stale_receipt_in_etcd_is_waited_past_and_the_real_one_completes() {
    let h = Lifecycle::new(true);
    let k = key(5);
    let rx = h.tracker.begin(k.clone(), 9, vec![]).unwrap();
    h.store.set(k.as_str(), &ok(8)).unwrap(); // another transfer's nonce
    until("the stale receipt was seen", || {
        h.metrics.snapshot().stale_receipts_rejected == 1
    });
    settled(&h.etcd);
    assert!(
        !rx.future().is_ready(),
        "a stale receipt completed the buffer"
    );
    // Re-armed once, past the stale value (a re-armed async_get counts as a get).
    assert_eq!(h.store.calls_for(Op::AsyncGet, k.as_str()), 2);
    h.store.set(k.as_str(), &ok(9)).unwrap();
    assert_eq!(wait(&rx.future()), Ok(()));
    assert_eq!(wait_retired(&rx), Ok(()));
    assert!(h.transfer_keys().is_empty(), "{:?}", h.transfer_keys());
}
