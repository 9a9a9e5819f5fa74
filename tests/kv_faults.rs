//! A fault-injecting KV store behind the PJRT KV callbacks (issue 11): for
//! each callback operation (get, which also serves the AsyncGet of a
//! blocking-only store; try_get; put; delete) it returns an error, hangs,
//! returns garbage or returns a huge value. Two clients of one job
//! (kv_store=callbacks, so every key goes through the callbacks) transfer
//! one buffer while the fault is on. Each outcome must be a clear status
//! within its timeout (never OK with wrong bytes), nothing may hang
//! (destroy returns promptly with calls still stuck in a callback), and
//! nothing may leak (every receive retired; stuck calls, released at the
//! end, return into memory that is still theirs).
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use pjrt_crosshost::api::buffer::Buffer;
use pjrt_crosshost::api::options::OptionValue;
use pjrt_crosshost::api::transfers::ReceiveSpec;
use pjrt_crosshost::kv::{KeyValueStore, MemoryStore, RawKvCallbacks};
use pjrt_crosshost::status::{self, Code, Outcome, Result};

mod common;
use common::{pattern, s, u8_shape};

const TIMEOUT_MS: i64 = 1500;
const KV_CALL_TIMEOUT_MS: i64 = 500;
/// An outcome later than its timeout plus this is a hang (issue 11: no
/// wait may exceed its configured timeout by more than 1 s).
const SLACK: Duration = Duration::from_secs(1);
const HUGE: usize = 32 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Get,
    TryGet,
    Put,
    Delete,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    Error,
    Hang,
    Garbage,
    Huge,
}

/// JAX's coordination service, as the callbacks see it: blocking gets, no
/// overwrite; plus the fault of the test.
struct FaultyKv {
    store: MemoryStore,
    fault: Mutex<Option<(Op, Fault)>>,
    released: Mutex<bool>,
    release: Condvar,
    hung: AtomicBool,
    /// The fault hits every key, not only the transfer keys.
    every_key: AtomicBool,
}

impl FaultyKv {
    fn new() -> Arc<FaultyKv> {
        Arc::new(FaultyKv {
            store: MemoryStore::with_overwrite(false),
            fault: Mutex::new(None),
            released: Mutex::new(false),
            release: Condvar::new(),
            hung: AtomicBool::new(false),
            every_key: AtomicBool::new(false),
        })
    }

    fn release_hung_calls(&self) {
        *self.released.lock() = true;
        self.release.notify_all();
    }

    /// The fault's value for `op`, `None` when the call proceeds normally.
    fn inject(&self, op: Op, key: &str) -> Option<Result<Vec<u8>>> {
        // Transfer keys only (receipts and descriptors): the session was
        // established before the fault was switched on.
        let fault = match *self.fault.lock() {
            Some((faulty, fault))
                if faulty == op
                    && (self.every_key.load(Ordering::SeqCst)
                        || key.contains("/recv/")
                        || key.contains("/desc/")) =>
            {
                fault
            }
            _ => return None,
        };
        Some(match fault {
            Fault::Error => Err(status::unavailable(format!(
                "injected: {op:?} {key} failed"
            ))),
            Fault::Hang => {
                self.hung.store(true, Ordering::SeqCst);
                let mut released = self.released.lock();
                while !*released {
                    self.release.wait(&mut released);
                }
                Err(status::unavailable(format!("injected: {op:?} {key} hung")))
            }
            Fault::Garbage => Ok(b"\x00\xffnot a value this plugin wrote\x7f".to_vec()),
            Fault::Huge => Ok(vec![0xa5; HUGE]),
        })
    }
}

impl RawKvCallbacks for FaultyKv {
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        match self.inject(Op::Get, key) {
            Some(value) => value,
            None => self.store.get(key, timeout),
        }
    }
    fn try_get(&self, key: &str) -> Result<Vec<u8>> {
        match self.inject(Op::TryGet, key) {
            Some(value) => value,
            None => self.store.try_get(key),
        }
    }
    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        match self.inject(Op::Put, key) {
            Some(outcome) => outcome.map(drop),
            None => self.store.set(key, value),
        }
    }
    fn delete(&self, key: &str) -> Option<Result<()>> {
        Some(match self.inject(Op::Delete, key) {
            Some(outcome) => outcome.map(drop),
            None => self.store.delete(key),
        })
    }
    fn has_delete(&self) -> bool {
        true
    }
}

struct Run {
    receive: Outcome,
    receive_after: Duration,
    send: Outcome,
    send_after: Duration,
    bytes_ok: bool,
    delete_failures: u64,
    destroy_took: Duration,
}

fn transfer_with(op: Op, fault: Fault) -> Run {
    let kv = FaultyKv::new();
    let session = format!("faults-{op:?}-{fault:?}");
    let (sender, receiver) = common::two_clients(
        &[
            ("kv_store", s("callbacks")),
            ("session", s(&session)),
            ("receive_timeout_ms", OptionValue::Int(TIMEOUT_MS)),
            ("send_timeout_ms", OptionValue::Int(TIMEOUT_MS)),
            ("kv_call_timeout_ms", OptionValue::Int(KV_CALL_TIMEOUT_MS)),
            ("session_timeout_ms", OptionValue::Int(20_000)),
        ],
        Some(kv.clone() as Arc<dyn RawKvCallbacks>),
    )
    .expect("clients");
    let src = sender.addressable_devices().next().unwrap().clone();
    let dst = receiver.addressable_devices().next().unwrap().clone();
    let data = pattern(8192, 3);
    let source = common::upload(&sender, &src, &data).unwrap();
    *kv.fault.lock() = Some((op, fault));

    let started = Instant::now();
    let spec = ReceiveSpec {
        shape: u8_shape(data.len()),
        peer_global_device_id: src.global_id,
        transfer_key: 7,
    };
    let received: Result<Vec<Arc<Buffer>>> = receiver
        .cross_host_receive(&dst, vec![spec], None, "t")
        .map(|r| r.into_iter().map(|b| b.into_embedded().unwrap()).collect());
    let sent = sender.cross_host_send(vec![source.into()], &[dst.global_id], &[7], None, "t");
    let bound = Duration::from_millis(TIMEOUT_MS as u64) + SLACK;
    let (receive, receive_after, bytes_ok) = match &received {
        Err(e) => (Err(e.clone()), started.elapsed(), false),
        Ok(buffers) => {
            let outcome = buffers[0]
                .definition()
                .wait_timeout(bound)
                .unwrap_or_else(|| panic!("{op:?}/{fault:?}: the receive hung"));
            let after = started.elapsed();
            let mut got = vec![0u8; data.len()];
            let ok = outcome.is_ok()
                && buffers[0]
                    .allocation("t")
                    .unwrap()
                    .read(0, &mut got)
                    .is_ok()
                && got == data;
            (outcome, after, ok)
        }
    };
    let (send, send_after) = match &sent {
        Err(e) => (Err(e.clone()), started.elapsed()),
        Ok(futures) => (
            futures[0]
                .wait_timeout(bound)
                .unwrap_or_else(|| panic!("{op:?}/{fault:?}: the send hung")),
            started.elapsed(),
        ),
    };
    // Let the receive retire (its deletes answer within kv_call_timeout).
    let retire_by = Instant::now() + bound;
    while receiver.transfers().outstanding_receives() > 0 && Instant::now() < retire_by {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        receiver.transfers().outstanding_receives(),
        0,
        "{op:?}/{fault:?}: a receive was never retired"
    );
    let delete_failures = receiver.transfers().metrics().snapshot().delete_failures;
    drop(received);
    let destroying = Instant::now();
    drop(sender);
    drop(receiver);
    let destroy_took = destroying.elapsed();
    // Stuck calls return now, into state their detached workers still own.
    kv.release_hung_calls();
    Run {
        receive,
        receive_after,
        send,
        send_after,
        bytes_ok,
        delete_failures,
        destroy_took,
    }
}

fn check_bounded(op: Op, fault: Fault, run: &Run) {
    let bound = Duration::from_millis(TIMEOUT_MS as u64) + SLACK;
    assert!(
        run.receive_after < bound,
        "{op:?}/{fault:?}: receive took {:?}",
        run.receive_after
    );
    assert!(
        run.send_after < bound,
        "{op:?}/{fault:?}: send took {:?}",
        run.send_after
    );
    assert!(
        run.destroy_took < Duration::from_secs(3),
        "{op:?}/{fault:?}: destroy took {:?}",
        run.destroy_took
    );
    if run.receive.is_ok() {
        assert!(run.bytes_ok, "{op:?}/{fault:?}: OK with the wrong bytes");
    }
    for outcome in [&run.receive, &run.send] {
        if let Err(e) = outcome {
            assert!(
                !e.message.is_empty(),
                "{op:?}/{fault:?}: an error without a message"
            );
        }
    }
}

fn code(outcome: &Outcome) -> Option<Code> {
    outcome.as_ref().err().map(|e| e.code)
}

#[test]
fn a_failing_or_hanging_or_lying_get_ends_both_sides_with_an_error_in_time() {
    for fault in [Fault::Error, Fault::Hang, Fault::Garbage, Fault::Huge] {
        let run = transfer_with(Op::Get, fault);
        check_bounded(Op::Get, fault, &run);
        // The sender cannot read the descriptor; the receiver never sees
        // its receipt (or only values that are not one).
        assert!(run.send.is_err(), "{fault:?}: send {:?}", run.send);
        assert!(run.receive.is_err(), "{fault:?}: receive {:?}", run.receive);
        if matches!(fault, Fault::Garbage | Fault::Huge) {
            assert_eq!(
                code(&run.receive),
                Some(Code::DeadlineExceeded),
                "{fault:?}"
            );
        }
    }
}

#[test]
fn a_failing_or_hanging_put_ends_both_sides_with_an_error_in_time() {
    for fault in [Fault::Error, Fault::Hang] {
        let run = transfer_with(Op::Put, fault);
        check_bounded(Op::Put, fault, &run);
        assert!(run.receive.is_err(), "{fault:?}: receive {:?}", run.receive);
        assert!(run.send.is_err(), "{fault:?}: send {:?}", run.send);
    }
}

#[test]
fn a_failing_or_hanging_delete_keeps_the_transfer_ok_and_is_counted() {
    for fault in [Fault::Error, Fault::Hang] {
        let run = transfer_with(Op::Delete, fault);
        check_bounded(Op::Delete, fault, &run);
        assert_eq!(run.receive, Ok(()), "{fault:?}");
        assert!(run.bytes_ok, "{fault:?}");
        assert_eq!(run.send, Ok(()), "{fault:?}");
        assert_eq!(run.delete_failures, 2, "{fault:?}: receipt + descriptor");
    }
}

#[test]
fn try_get_faults_never_make_a_transfer_lie_or_hang() {
    // The transfer path reads with blocking gets; try_get serves the
    // stale-value polling. Whatever a faulty try_get does, the outcome is
    // right or a clear error, in time.
    for fault in [Fault::Error, Fault::Hang, Fault::Garbage, Fault::Huge] {
        let run = transfer_with(Op::TryGet, fault);
        check_bounded(Op::TryGet, fault, &run);
    }
}

#[test]
fn a_get_that_never_returns_during_creation_ends_it_at_session_timeout() {
    // Node 0 of a two-node job waits for node 1's session entry through a
    // get that never returns: creation fails DEADLINE_EXCEEDED by
    // session_timeout_ms (+1 s), not never.
    let kv = FaultyKv::new();
    kv.every_key.store(true, Ordering::SeqCst);
    *kv.fault.lock() = Some((Op::Get, Fault::Hang));
    let started = Instant::now();
    let created = pjrt_crosshost::api::client::Client::create_with_callbacks(
        common::options(&[
            ("kv_store", s("callbacks")),
            ("session", s("faults-creation")),
            ("node_id", OptionValue::Int(0)),
            ("num_nodes", OptionValue::Int(2)),
            ("session_timeout_ms", OptionValue::Int(1000)),
        ]),
        Some(kv.clone() as Arc<dyn RawKvCallbacks>),
    );
    let took = started.elapsed();
    kv.release_hung_calls();
    let error = created.err().expect("creation succeeded without node 1");
    assert_eq!(error.code, Code::DeadlineExceeded, "{error}");
    assert!(
        took < Duration::from_millis(1000) + SLACK,
        "creation took {took:?}"
    );
    assert!(
        kv.hung.load(Ordering::SeqCst),
        "the hanging get was never made"
    );
}
