//! Two UCX transports in one process (UCX picks its same-host transports
//! here; the two-host bed in python_tests/ crosses a real network): bytes
//! land where the token says, and every refusal is a clear error, never a
//! write and never a hang. Skipped, saying why, where libucp is missing.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::wire::{CloseKind, CloseMessage};
use super::*;
use crate::status::{Code, Result};
use crate::transport::auth_token::AuthToken;
use crate::transport::destination::HeapDestination;
use crate::transport::registry::Delivered;

const WAIT: Duration = Duration::from_secs(20);

fn pair() -> Option<(UcxTransport, UcxTransport)> {
    let loaded = match load(None) {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("SKIPPED: no UCX: {}", e.message);
            return None;
        }
    };
    // Unequal worker counts: worker k talks to the peer's worker k mod its count.
    let a = UcxTransport::with_workers(&loaded, 0, 2).unwrap();
    let b = UcxTransport::with_workers(&loaded, 1, 3).unwrap();
    let peers: HashMap<u32, Vec<Vec<u8>>> = HashMap::from([(0, a.addresses()), (1, b.addresses())]);
    a.set_peers(&peers);
    b.set_peers(&peers);
    // Wired up while both are alive, as a client does at creation.
    a.connect(WAIT).unwrap();
    b.connect(WAIT).unwrap();
    Some((a, b))
}

fn send(from: &UcxTransport, to: u32, token: AuthToken, offset: u64, bytes: Vec<u8>) -> Result<()> {
    send_with(from, to, token, offset, bytes, None).map(|_| ())
}

fn send_with(
    from: &UcxTransport,
    to: u32,
    token: AuthToken,
    offset: u64,
    bytes: Vec<u8>,
    receipt: Option<Vec<u8>>,
) -> Result<Delivered> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    from.send(
        to,
        token,
        offset,
        Payload::owned(bytes),
        receipt,
        WAIT,
        Box::new(move |outcome| {
            let _ = tx.send(outcome);
        }),
        0,
    );
    rx.recv_timeout(WAIT + Duration::from_secs(5))
        .expect("every send is answered")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn bytes_land_at_their_offset_eager_and_rendezvous_and_the_token_is_single_use() {
    let Some((a, b)) = pair() else { return };
    for (len, offset) in [
        (0usize, 0u64),
        (17, 5),
        (4096, 0),
        (8 << 20, 64),
        ((13 << 20) + 7, 3),
    ] {
        let destination = Arc::new(HeapDestination::new(len + offset as usize + 3));
        let token = AuthToken::generate().unwrap();
        b.registry().register(token, destination.clone()).unwrap();
        let bytes = pattern(len, 7);
        send(&a, 1, token, offset, bytes.clone()).unwrap();
        let landed = destination.to_vec();
        assert_eq!(
            &landed[offset as usize..offset as usize + len],
            &bytes[..],
            "{len} bytes"
        );
        assert!(landed[..offset as usize].iter().all(|&x| x == 0));
        assert!(landed[offset as usize + len..].iter().all(|&x| x == 0));
        // Claimed: a second sender with the same token is refused.
        let again = send(&a, 1, token, offset, bytes).unwrap_err();
        assert_eq!(again.code, Code::Unauthenticated, "{again}");
    }
    assert!(b.registry().is_empty());
    assert!(!a.lanes().is_empty(), "the lanes UCX chose are recorded");
    assert!(
        !b.lanes().is_empty(),
        "the receiver records its lanes back too"
    );
    // Every send's bytes go back once UCX is done with them.
    let deadline = std::time::Instant::now() + WAIT;
    while a.sends_held() > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(a.sends_held(), 0);
}

#[test]
fn a_receipt_sent_with_the_bytes_sets_the_key_the_receiver_holds_after_they_are_in() {
    let Some((a, b)) = pair() else { return };
    let (tx, rx) = crossbeam_channel::unbounded::<(String, Vec<u8>, Vec<u8>)>();
    let watched = Arc::new(parking_lot::Mutex::new(None::<Arc<HeapDestination>>));
    let seen = watched.clone();
    b.set_receipt_sink(Arc::new(move |key: &str, value: &[u8]| {
        // What the destination holds when the receipt is applied.
        let bytes = seen.lock().as_ref().map(|d| d.to_vec()).unwrap_or_default();
        tx.send((key.to_string(), value.to_vec(), bytes)).unwrap();
        Ok(())
    }));
    for len in [64usize, 1 << 20, 9 << 20] {
        let destination = Arc::new(HeapDestination::new(len));
        *watched.lock() = Some(destination.clone());
        let token = AuthToken::generate().unwrap();
        b.registry()
            .register_with_key(token, destination.clone(), Some("crosshost/recv/k".into()))
            .unwrap();
        let bytes = pattern(len, 3);
        let delivered = send_with(&a, 1, token, 0, bytes.clone(), Some(b"xr1 ok 7".to_vec()));
        assert_eq!(
            delivered.unwrap(),
            Delivered {
                receipt_applied: true
            }
        );
        let (key, value, landed) = rx.recv_timeout(WAIT).unwrap();
        assert_eq!(
            (key.as_str(), value.as_slice()),
            ("crosshost/recv/k", &b"xr1 ok 7"[..])
        );
        assert_eq!(
            landed, bytes,
            "the receipt is applied only once every byte is in"
        );
    }
    // A destination registered without its key: the receipt is not applied
    // there, and the sender hears so (it sets the key itself).
    let token = AuthToken::generate().unwrap();
    b.registry()
        .register(token, Arc::new(HeapDestination::new(8)))
        .unwrap();
    let delivered = send_with(&a, 1, token, 0, vec![1; 8], Some(b"xr1 ok 8".to_vec())).unwrap();
    assert!(!delivered.receipt_applied);
    assert!(rx.try_recv().is_err());
}

#[test]
fn unknown_tokens_and_writes_outside_the_destination_are_refused_and_write_nothing() {
    let Some((a, b)) = pair() else { return };
    let destination = Arc::new(HeapDestination::new(64));
    let token = AuthToken::generate().unwrap();
    b.registry().register(token, destination.clone()).unwrap();
    let stranger = AuthToken::generate().unwrap();
    let refused = send(&a, 1, stranger, 0, vec![1; 8]).unwrap_err();
    assert_eq!(refused.code, Code::Unauthenticated, "{refused}");
    let outside = send(&a, 1, token, 60, vec![1; 8]).unwrap_err();
    assert_eq!(outside.code, Code::OutOfRange, "{outside}");
    assert!(destination.to_vec().iter().all(|&x| x == 0));
    // The out-of-range request gave the token back: the real sender works.
    send(&a, 1, token, 0, vec![9; 64]).unwrap();
    assert_eq!(destination.to_vec(), vec![9; 64]);
    assert_eq!(b.rejected_messages(), 2);
}

#[test]
fn a_send_to_a_process_without_a_worker_or_after_the_receiver_went_fails_clearly() {
    let Some((a, b)) = pair() else { return };
    let nobody = send(&a, 7, AuthToken::generate().unwrap(), 0, vec![1]).unwrap_err();
    assert_eq!(nobody.code, Code::FailedPrecondition, "{nobody}");
    assert!(nobody.message.contains("process 7"), "{nobody}");
    let destination = Arc::new(HeapDestination::new(16));
    let token = AuthToken::generate().unwrap();
    b.registry().register(token, destination).unwrap();
    send(&a, 1, token, 0, vec![2; 16]).unwrap();
    drop(b);
    let started = std::time::Instant::now();
    let gone = send(&a, 1, AuthToken::generate().unwrap(), 0, vec![3; 1 << 20]).unwrap_err();
    assert!(
        matches!(gone.code, Code::Unavailable | Code::DeadlineExceeded),
        "{gone}"
    );
    assert!(started.elapsed() < WAIT + Duration::from_secs(1), "{gone}");
}

#[test]
fn a_destroyed_transport_answers_every_send() {
    let Some((a, _b)) = pair() else { return };
    let handle = Arc::new(a);
    let (tx, rx) = crossbeam_channel::unbounded();
    for _ in 0..32 {
        let tx = tx.clone();
        handle.send(
            1,
            AuthToken::generate().unwrap(),
            0,
            Payload::owned(vec![0; 4096]),
            None,
            WAIT,
            Box::new(move |outcome| {
                let _ = tx.send(outcome);
            }),
            0,
        );
    }
    drop(Arc::try_unwrap(handle).unwrap());
    for _ in 0..32 {
        let outcome = rx.recv_timeout(WAIT).expect("answered");
        assert!(outcome.is_err());
    }
}

#[test]
fn a_send_waiting_for_a_lost_processs_acknowledgement_fails_at_once() {
    let Some((a, b)) = pair() else { return };
    // The receiver takes the bytes, then hangs before it acknowledges them
    // (its sink blocks), as a process that dies right after they land.
    let (entered, in_sink) = crossbeam_channel::bounded::<()>(1);
    let (release, released) = crossbeam_channel::bounded::<()>(1);
    b.set_receipt_sink(Arc::new(move |_: &str, _: &[u8]| {
        let _ = entered.send(());
        let _ = released.recv();
        Ok(())
    }));
    let token = AuthToken::generate().unwrap();
    b.registry()
        .register_with_key(token, Arc::new(HeapDestination::new(64)), Some("k".into()))
        .unwrap();
    let (tx, rx) = crossbeam_channel::bounded(1);
    a.send(
        1,
        token,
        0,
        Payload::owned(vec![5; 64]),
        Some(b"xr1 ok 1".to_vec()),
        // Far beyond the test: only the loss can end this send.
        Duration::from_secs(3600),
        Box::new(move |outcome| {
            let _ = tx.send(outcome);
        }),
        0,
    );
    in_sink
        .recv_timeout(WAIT)
        .expect("the bytes reach the receiver");
    a.peer_lost(1);
    let outcome = rx
        .recv_timeout(WAIT)
        .expect("the send ends when its receiver is lost");
    let error = outcome.unwrap_err();
    assert_eq!(error.code, Code::Unavailable, "{error}");
    assert!(error.message.contains("control link closed"), "{error}");
    release.send(()).unwrap();
}

#[test]
fn a_send_that_misses_its_deadline_does_not_cut_the_pair_apart() {
    let Some((a, b)) = pair() else { return };
    // Each of the receiver's workers that a sends to (a has 2) takes one
    // small transfer and then stalls before acknowledging it (its sink
    // blocks), so a large send after them cannot complete: it misses its
    // deadline while UCX still holds it, and the sender closes that
    // connection by force.
    let stalled = a.addresses().len();
    let (entered, in_sink) = crossbeam_channel::unbounded::<()>();
    let (release, released) = crossbeam_channel::unbounded::<()>();
    let stalls = Arc::new(std::sync::atomic::AtomicUsize::new(stalled));
    b.set_receipt_sink(Arc::new(move |_: &str, _: &[u8]| {
        let left = stalls.fetch_update(
            std::sync::atomic::Ordering::AcqRel,
            std::sync::atomic::Ordering::Acquire,
            |n| n.checked_sub(1),
        );
        if left.is_ok() {
            let _ = entered.send(());
            let _ = released.recv();
        }
        Ok(())
    }));
    let (tx, rx) = crossbeam_channel::unbounded();
    let start = |len: usize, timeout: Duration, key: String| {
        let token = AuthToken::generate().unwrap();
        b.registry()
            .register_with_key(token, Arc::new(HeapDestination::new(len)), Some(key))
            .unwrap();
        let tx = tx.clone();
        a.send(
            1,
            token,
            0,
            Payload::owned(vec![5; len]),
            Some(b"xr1 ok 1".to_vec()),
            timeout,
            Box::new(move |outcome| {
                let _ = tx.send((len, outcome));
            }),
            0,
        );
    };
    for stall in 0..stalled {
        start(64, WAIT, format!("stall{stall}"));
        in_sink
            .recv_timeout(WAIT)
            .expect("the bytes reach the receiver");
    }
    start(900 << 10, Duration::from_millis(300), "late".into());
    let (len, outcome) = rx.recv_timeout(WAIT).expect("the late send ends");
    assert_eq!(len, 900 << 10, "only the late send can end now");
    let error = outcome.unwrap_err();
    assert_eq!(error.code, Code::DeadlineExceeded, "{error}");
    for _ in 0..stalled {
        release.send(()).unwrap();
    }
    for _ in 0..stalled {
        // Acknowledged, or failed by the connection's forced close.
        let _answered = rx.recv_timeout(WAIT).expect("every send is answered");
    }
    // Both processes live: the next transfers connect again and land.
    for round in 0..4u8 {
        let destination = Arc::new(HeapDestination::new(4096));
        let token = AuthToken::generate().unwrap();
        b.registry()
            .register_with_key(token, destination.clone(), Some(format!("k{round}")))
            .unwrap();
        let bytes = pattern(4096, round);
        send_with(&a, 1, token, 0, bytes.clone(), Some(b"xr1 ok 1".to_vec()))
            .unwrap_or_else(|e| panic!("transfer {round} after the late one: {e}"));
        assert_eq!(destination.to_vec(), bytes);
    }
}

#[test]
fn a_refusal_goes_back_over_the_senders_own_connection_and_dials_nobody() {
    let Some((a, b)) = pair() else { return };
    let loaded = load(None).unwrap();
    // Process 2 is in b's session but b has no connection to it: b answers
    // a message under a token it never gave over the connection the message
    // came on, and dials nobody (answering by dialling the process a message
    // names would let anyone make b dial anyone).
    let c = UcxTransport::with_workers(&loaded, 2, 1).unwrap();
    let peers: HashMap<u32, Vec<Vec<u8>>> =
        HashMap::from([(0, a.addresses()), (1, b.addresses()), (2, c.addresses())]);
    b.set_peers(&peers);
    c.set_peers(&peers);
    let refused = send(&c, 1, AuthToken::generate().unwrap(), 0, vec![9; 64]).unwrap_err();
    assert_ne!(refused.code, Code::DeadlineExceeded, "{refused}");
    assert!(refused.message.contains("token"), "{refused}");
    assert_eq!(b.rejected_messages(), 1);
    assert!(
        !b.lanes().contains_key(&2),
        "b connected to the process a refused message named: {:?}",
        b.lanes()
    );
}

#[test]
fn endpoints_made_on_first_use_carry_transfers_both_ways_at_once() {
    let loaded = match load(None) {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("SKIPPED: no UCX: {}", e.message);
            return;
        }
    };
    let a = UcxTransport::with_workers(&loaded, 0, 2).unwrap();
    let b = UcxTransport::with_workers(&loaded, 1, 2).unwrap();
    let peers: HashMap<u32, Vec<Vec<u8>>> = HashMap::from([(0, a.addresses()), (1, b.addresses())]);
    a.set_peers(&peers);
    b.set_peers(&peers);
    // No connect(): every endpoint is made by the transfer that needs it,
    // both sides dialling each other at the same time.
    let (tx, rx) = crossbeam_channel::unbounded();
    let mut expected = Vec::new();
    for round in 0..6u8 {
        for (from, to, to_index) in [(&a, &b, 1u32), (&b, &a, 0u32)] {
            let len = [64usize, 100 << 10, 3 << 20][round as usize % 3];
            let destination = Arc::new(HeapDestination::new(len));
            let token = AuthToken::generate().unwrap();
            to.registry().register(token, destination.clone()).unwrap();
            let bytes = pattern(len, round);
            let tx = tx.clone();
            from.send(
                to_index,
                token,
                0,
                Payload::owned(bytes.clone()),
                None,
                WAIT,
                Box::new(move |outcome| {
                    let _ = tx.send(outcome.map(|_| ()));
                }),
                0,
            );
            expected.push((destination, bytes));
        }
    }
    for _ in 0..expected.len() {
        rx.recv_timeout(WAIT + Duration::from_secs(5))
            .expect("every send is answered")
            .unwrap();
    }
    for (destination, bytes) in expected {
        assert_eq!(destination.to_vec(), bytes);
    }
}

#[test]
fn idle_endpoints_are_closed_by_the_sweep_and_the_next_send_dials_again() {
    let Some((a, b)) = pair() else { return };
    a.set_connection_limits(&crate::transport::connections::ConnectionLimits {
        max_open: 64,
        idle_timeout: Duration::from_millis(200),
        grace: Duration::from_millis(0),
    });
    let round = |seed: u8| {
        let destination = Arc::new(HeapDestination::new(4096));
        let token = AuthToken::generate().unwrap();
        b.registry().register(token, destination.clone()).unwrap();
        send(&a, 1, token, 0, pattern(4096, seed)).unwrap();
        assert_eq!(destination.to_vec(), pattern(4096, seed));
    };
    round(1);
    assert!(a.open_endpoints() > 0);
    let deadline = std::time::Instant::now() + WAIT;
    while a.open_endpoints() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "idle endpoints stay open"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Closed in order: the peer is alive and the next send dials again.
    round(2);
    assert!(a.open_endpoints() > 0);
}

/// Transports 0..count on one worker each, every one knowing the others.
fn job(count: u32) -> Option<Vec<UcxTransport>> {
    let loaded = match load(None) {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("SKIPPED: no UCX: {}", e.message);
            return None;
        }
    };
    let job: Vec<UcxTransport> = (0..count)
        .map(|p| UcxTransport::with_workers(&loaded, p, 1).unwrap())
        .collect();
    let peers: HashMap<u32, Vec<Vec<u8>>> = job
        .iter()
        .enumerate()
        .map(|(p, t)| (p as u32, t.addresses()))
        .collect();
    for t in &job {
        t.set_peers(&peers);
    }
    Some(job)
}

/// 4 KiB from `from` to `to` of `job`, landed and checked.
fn deliver(job: &[UcxTransport], from: usize, to: usize, seed: u8) {
    let destination = Arc::new(HeapDestination::new(4096));
    let token = AuthToken::generate().unwrap();
    job[to]
        .registry()
        .register(token, destination.clone())
        .unwrap();
    send(&job[from], to as u32, token, 0, pattern(4096, seed)).unwrap();
    assert_eq!(destination.to_vec(), pattern(4096, seed));
}

#[test]
fn ucx_endpoints_beyond_the_bound_close_by_handshake_while_the_peers_keep_sending() {
    // Process 0 keeps one endpoint and sweeps every 20 ms, while it and
    // three peers send to each other without a pause: each close of an
    // endpoint pair is agreed with the peer first, so nothing in flight is
    // lost (closing one side under a sending peer loses its messages
    // without an error, and its transfers run into their deadline).
    let Some(job) = job(4) else { return };
    job[0].set_connection_limits(&crate::transport::connections::ConnectionLimits {
        max_open: 1,
        idle_timeout: Duration::from_secs(600),
        grace: Duration::from_millis(0),
    });
    let rounds = 120u8;
    let results = std::thread::scope(|scope| {
        let mut workers = Vec::new();
        for from in 0..4u32 {
            let job = &job;
            workers.push(scope.spawn(move || {
                let mut failures = Vec::new();
                for round in 0..rounds {
                    let targets: Vec<u32> = if from == 0 { vec![1, 2, 3] } else { vec![0] };
                    for to in targets {
                        let len = [64usize, 200 << 10, 1 << 20][(round as usize + to as usize) % 3];
                        let destination = Arc::new(HeapDestination::new(len));
                        let token = AuthToken::generate().unwrap();
                        job[to as usize]
                            .registry()
                            .register(token, destination.clone())
                            .unwrap();
                        let bytes = pattern(len, round ^ from as u8);
                        match send(&job[from as usize], to, token, 0, bytes.clone()) {
                            Ok(()) if destination.to_vec() == bytes => {}
                            Ok(()) => failures.push(format!("{from}->{to} #{round}: wrong bytes")),
                            Err(e) => failures.push(format!("{from}->{to} #{round}: {e}")),
                        }
                        if !failures.is_empty() {
                            // A lost message costs its sender the whole wait.
                            return failures;
                        }
                    }
                }
                failures
            }));
        }
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(results.is_empty(), "transfers failed: {results:?}");
    let closed = job[0].closed_by_handshake();
    assert!(closed > 0, "no endpoint pair was closed to meet the bound");
    wait_until("process 0 is back within its bound of one endpoint", || {
        job[0].open_endpoints() <= 1
    });
}

#[test]
fn a_close_asked_over_another_connection_closes_nothing() {
    // Process 2 asks process 0 to close, in process 1's name, over its own
    // connection: process 0 answers (it closes nothing of its own there)
    // and keeps its endpoint to process 1, which still carries transfers.
    let Some(job) = job(3) else { return };
    let transfer = |from: usize, to: usize, seed: u8| deliver(&job, from, to, seed);
    transfer(0, 1, 1);
    transfer(1, 0, 2);
    let open = job[0].open_endpoints();
    assert_eq!(open, 1, "process 0 holds its endpoint to process 1");
    for kind in [CloseKind::Ask, CloseKind::Agree] {
        job[2]
            .send_close_message(
                0,
                CloseMessage {
                    kind,
                    sender: 1,
                    sender_worker: 0,
                    handshake: 1,
                },
            )
            .unwrap();
    }
    // Process 0 handles messages over one connection in order: once a
    // refusal of a later DATA came back, it has seen both close messages.
    let refused = send(&job[2], 0, AuthToken::generate().unwrap(), 0, vec![1; 8]).unwrap_err();
    assert_eq!(refused.code, Code::Unauthenticated, "{refused}");
    transfer(1, 0, 3);
    transfer(0, 1, 4);
    assert_eq!(job[0].closed_by_handshake(), 0);
    assert_eq!(job[1].closed_by_handshake(), 0);
    // Its endpoint to process 1; a refusal dials nobody.
    assert_eq!(job[0].open_endpoints(), 1);
}

// ----------------------------- chunked streams -----------------------------

use crate::transport::staging::{
    CopyCompletion, DeviceCopy, HostCopy, Pending, Slot, StagedDestination, Staging, StagingConfig,
};

fn staging(chunk_bytes: usize, ring_depth: usize) -> Arc<Staging> {
    Staging::new(StagingConfig {
        chunk_bytes,
        ring_depth,
        stage_host_transfers: true,
        ..StagingConfig::default()
    })
    .unwrap()
}

/// Opens a stream from `from` to process 1; the receiver's verdict comes
/// on the returned channel.
#[allow(clippy::too_many_arguments)]
fn open(
    from: &UcxTransport,
    token: AuthToken,
    offset: u64,
    len: usize,
    chunk_limit: usize,
    rendezvous: bool,
    receipt: Option<Vec<u8>>,
    keep: KeepAlive,
) -> (ChunkSender, crossbeam_channel::Receiver<Result<Delivered>>) {
    let (tx, rx) = crossbeam_channel::bounded(1);
    let stream = from
        .open_stream(
            1,
            token,
            offset,
            len,
            chunk_limit,
            rendezvous,
            receipt,
            WAIT,
            keep,
            Box::new(move |outcome| {
                let _ = tx.send(outcome);
            }),
        )
        .unwrap();
    (stream, rx)
}

fn wait_until(what: &str, condition: impl FnMut() -> bool) {
    wait_until_within(WAIT, what, condition)
}

fn wait_until_within(limit: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + limit;
    while !condition() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn a_chunked_stream_lands_in_a_staged_destination_eager_and_rendezvous() {
    let Some((a, b)) = pair() else { return };
    let (tx, rx) = crossbeam_channel::unbounded::<String>();
    b.set_receipt_sink(Arc::new(move |key: &str, _: &[u8]| {
        tx.send(key.to_string()).unwrap();
        Ok(())
    }));
    let rings = staging(64 << 10, 3);
    // Sizes around the chunk and UCX's rendezvous threshold; chunks forced
    // to rendezvous (a staged receiver's) and eager ones (any receiver
    // takes both).
    for (index, (len, offset, rendezvous)) in [
        (1usize, 0u64, true),
        (64 << 10, 3, true),
        ((64 << 10) + 1, 0, false),
        ((3 << 20) + 17, 5, true),
        (300_000, 0, false),
    ]
    .into_iter()
    .enumerate()
    {
        let memory = Arc::new(HeapDestination::new(len + offset as usize + 2));
        let staged = Arc::new(StagedDestination::host(memory.clone(), rings.clone()));
        let token = AuthToken::generate().unwrap();
        b.registry()
            .register_with_key(token, staged, Some("crosshost/recv/s".into()))
            .unwrap();
        let bytes = Arc::new(pattern(len, 9));
        let keep: KeepAlive = bytes.clone();
        let (mut stream, verdict) = open(
            &a,
            token,
            offset,
            len,
            64 << 10,
            rendezvous,
            Some(b"xr1 ok 3".to_vec()),
            keep,
        );
        // Straight from a copy, or from a host allocation read in place.
        let source = if index % 2 == 0 {
            SendBytes::Copy(bytes.clone())
        } else {
            let memory =
                crate::backend::host::HostMemory::allocate(len, Default::default()).unwrap();
            crate::backend::DeviceMemory::write(&memory, 0, &bytes).unwrap();
            SendBytes::Memory(Arc::new(memory))
        };
        stream.send_from(source, WAIT).unwrap();
        let delivered = verdict.recv_timeout(WAIT).unwrap().unwrap();
        assert!(delivered.receipt_applied, "{len}");
        assert_eq!(rx.recv_timeout(WAIT).unwrap(), "crosshost/recv/s");
        let landed = memory.to_vec();
        assert_eq!(
            &landed[offset as usize..offset as usize + len],
            &bytes[..],
            "{len}"
        );
        assert!(landed[..offset as usize].iter().all(|&x| x == 0));
        assert!(landed[offset as usize + len..].iter().all(|&x| x == 0));
    }
    assert!(b.registry().is_empty(), "every token used up");
    wait_until("the streams' threads end", || b.staged_streams() == 0);
    assert!(rings.staged() >= 5);
    assert!(rings.bytes_held() <= 3 * (64 << 10) * 2);
    wait_until("UCX gives every chunk back", || a.sends_held() == 0);
}

#[test]
fn a_staged_source_streams_into_a_destination_written_directly() {
    let Some((a, b)) = pair() else { return };
    let rings = staging(4096 * 16, 2);
    for len in [5usize, 4096 * 16, (1 << 20) + 3] {
        let memory = Arc::new(HeapDestination::new(len));
        let token = AuthToken::generate().unwrap();
        b.registry().register(token, memory.clone()).unwrap();
        let source = pattern(len, 4);
        let keep: KeepAlive = rings.clone();
        // The receiver does not stage: any message size.
        let (mut stream, verdict) = open(&a, token, 0, len, usize::MAX, false, None, keep);
        let stop = stream.stop().clone();
        let mut wire = |bytes: &[u8], at: usize| {
            // SAFETY: a send-ring slot, left alone by the pipeline until the
            // completion is done; the ring lives in `keep`.
            unsafe { stream.send(bytes.as_ptr(), bytes.len(), at) }
        };
        let chunks = rings
            .send_async(
                &crate::transport::staging::HostSource::new(&source),
                0,
                len,
                &mut wire,
                &stop,
                WAIT,
            )
            .unwrap();
        assert_eq!(chunks, len.div_ceil(4096 * 16));
        let delivered = verdict.recv_timeout(WAIT).unwrap().unwrap();
        assert!(!delivered.receipt_applied, "none was sent");
        assert_eq!(memory.to_vec(), source, "{len}");
    }
    assert!(b.registry().is_empty());
    assert_eq!(
        b.staged_streams(),
        0,
        "nothing staged on the receiving side"
    );
}

/// Host memory reached through copies that complete when the test says.
struct GatedCopy {
    memory: Arc<HeapDestination>,
    open: Arc<(parking_lot::Mutex<bool>, parking_lot::Condvar)>,
    started: Arc<std::sync::atomic::AtomicUsize>,
}

struct Gate(Arc<(parking_lot::Mutex<bool>, parking_lot::Condvar)>);

impl CopyCompletion for Gate {
    fn is_done(&mut self) -> Result<bool> {
        Ok(*self.0 .0.lock())
    }

    fn wait_until(&mut self, until: std::time::Instant) -> Result<bool> {
        let mut open = self.0 .0.lock();
        while !*open {
            if self.0 .1.wait_until(&mut open, until).timed_out() {
                break;
            }
        }
        Ok(*open)
    }
}

impl DeviceCopy for GatedCopy {
    fn len(&self) -> usize {
        crate::transport::destination::WritableDestination::len(&*self.memory)
    }

    fn to_device(&self, slot: &Slot, offset: usize, len: usize) -> Result<Pending> {
        HostCopy::new(self.memory.clone()).to_device(slot, offset, len)?;
        self.started
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(Pending::Running(Box::new(Gate(self.open.clone()))))
    }

    fn to_host(&self, _: usize, _: &Slot, _: usize) -> Result<Pending> {
        unreachable!("a receive only")
    }
}

#[test]
fn the_receipt_and_the_ack_wait_for_the_last_chunks_copy() {
    let Some((a, b)) = pair() else { return };
    let (applied_tx, applied) = crossbeam_channel::unbounded::<String>();
    b.set_receipt_sink(Arc::new(move |key: &str, _: &[u8]| {
        applied_tx.send(key.to_string()).unwrap();
        Ok(())
    }));
    let len = (256 << 10) + 99;
    let memory = Arc::new(HeapDestination::new(len));
    let open_gate = Arc::new((parking_lot::Mutex::new(false), parking_lot::Condvar::new()));
    let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let device = Arc::new(GatedCopy {
        memory: memory.clone(),
        open: open_gate.clone(),
        started: started.clone(),
    });
    // Ring deep enough for every chunk: all copies start, none completes.
    let staged = Arc::new(StagedDestination::new(
        memory.clone(),
        device,
        staging(64 << 10, 8),
    ));
    let token = AuthToken::generate().unwrap();
    b.registry()
        .register_with_key(token, staged, Some("k".into()))
        .unwrap();
    let bytes = Arc::new(pattern(len, 1));
    let (mut stream, verdict) = open(
        &a,
        token,
        0,
        len,
        64 << 10,
        true,
        Some(b"xr1 ok 1".to_vec()),
        bytes.clone(),
    );
    // SAFETY: kept alive and unwritten, as above.
    unsafe { stream.send_all(bytes.as_ptr(), WAIT) }.unwrap();
    wait_until("every chunk's copy started", || {
        started.load(std::sync::atomic::Ordering::SeqCst) == 5
    });
    // Every byte is in the ring and queued to the device: not landed, however
    // long the receiver is given (one that reported the stream landed once
    // its copies were queued would ACK at once).
    assert!(
        applied.recv_timeout(Duration::from_millis(300)).is_err(),
        "receipt applied before the copies completed"
    );
    assert!(
        verdict.try_recv().is_err(),
        "acknowledged before the copies completed"
    );
    *open_gate.0.lock() = true;
    open_gate.1.notify_all();
    let delivered = verdict.recv_timeout(WAIT).unwrap().unwrap();
    assert!(delivered.receipt_applied);
    assert_eq!(applied.recv_timeout(WAIT).unwrap(), "k");
    assert_eq!(memory.to_vec(), *bytes);
}

#[test]
fn chunks_a_staged_receiver_cannot_take_are_refused_and_fail_the_stream() {
    let Some((a, b)) = pair() else { return };
    let memory = Arc::new(HeapDestination::new(1 << 20));
    let staged = Arc::new(StagedDestination::host(
        memory.clone(),
        staging(64 << 10, 2),
    ));
    let token = AuthToken::generate().unwrap();
    b.registry().register(token, staged).unwrap();
    let bytes = Arc::new(vec![7u8; 1 << 20]);
    // The receiver's ring holds 64 KiB chunks: a sender ignoring that.
    let (mut stream, verdict) = open(&a, token, 0, 1 << 20, 128 << 10, true, None, bytes.clone());
    // SAFETY: kept alive and unwritten.
    let sent = unsafe { stream.send_all(bytes.as_ptr(), WAIT) };
    let error = verdict.recv_timeout(WAIT).unwrap().unwrap_err();
    assert_eq!(error.code, Code::InvalidArgument, "{error}");
    assert!(error.message.contains("chunk"), "{error}");
    assert!(sent.is_err() || stream.stop().is_raised());
    assert!(memory.to_vec().iter().all(|&x| x == 0), "nothing written");

    // A token nobody registered: refused, the stream fails.
    let stranger = AuthToken::generate().unwrap();
    let bytes = Arc::new(vec![1u8; 4096]);
    let (mut stream, verdict) = open(&a, stranger, 0, 4096, 4096, true, None, bytes.clone());
    // SAFETY: kept alive and unwritten.
    let _ = unsafe { stream.send_all(bytes.as_ptr(), WAIT) };
    let error = verdict.recv_timeout(WAIT).unwrap().unwrap_err();
    assert_eq!(error.code, Code::Unauthenticated, "{error}");
    // A refused chunk UCX still holds is given back when its stream's
    // deadline (WAIT from its opening) cuts the endpoint: waited for that
    // long, and a sweep's slack, from now.
    wait_until_within(
        WAIT + Duration::from_secs(10),
        "UCX gives every chunk back",
        || a.sends_held() == 0,
    );
}

#[test]
fn a_sender_lost_mid_stream_ends_the_staged_receive_at_once() {
    let Some((a, b)) = pair() else { return };
    let memory = Arc::new(HeapDestination::new(256 << 10));
    let rings = staging(64 << 10, 2);
    let staged = Arc::new(StagedDestination::host(memory.clone(), rings.clone()));
    let token = AuthToken::generate().unwrap();
    b.registry().register(token, staged).unwrap();
    let bytes = Arc::new(pattern(256 << 10, 2));
    let (mut stream, verdict) = open(&a, token, 0, 256 << 10, 64 << 10, true, None, bytes.clone());
    // Half the stream, then the sender is gone (its link closed).
    // SAFETY: kept alive and unwritten.
    let mut half = unsafe { stream.send(bytes.as_ptr(), 128 << 10, 0) }.unwrap();
    assert!(
        half.wait_until(std::time::Instant::now() + WAIT).unwrap(),
        "the first half went"
    );
    wait_until("the receiver's stream started", || b.staged_streams() == 1);
    let started = std::time::Instant::now();
    b.peer_lost(0);
    // Not at a deadline: at once (the reason, naming the sender, is the
    // stream's: `stream.rs`'s own tests read it).
    wait_until("the staged stream ends", || b.staged_streams() == 0);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    wait_until("no slot stays parked", || {
        rings.receive_ring().parked() == 0
    });
    assert_eq!(
        &memory.to_vec()[128 << 10..],
        &vec![0u8; 128 << 10][..],
        "no more landed"
    );
    // The sender, told of its receiver's loss in turn, fails too.
    a.peer_lost(1);
    let error = verdict.recv_timeout(WAIT).unwrap().unwrap_err();
    assert_eq!(error.code, Code::Unavailable, "{error}");
}

#[test]
fn a_receiver_lost_mid_stream_fails_the_send_at_once() {
    let Some((a, b)) = pair() else { return };
    let memory = Arc::new(HeapDestination::new(256 << 10));
    let staged = Arc::new(StagedDestination::host(memory, staging(64 << 10, 2)));
    let token = AuthToken::generate().unwrap();
    b.registry().register(token, staged).unwrap();
    let bytes = Arc::new(pattern(256 << 10, 2));
    let (tx, verdict) = crossbeam_channel::bounded(1);
    let mut stream = a
        .open_stream(
            1,
            token,
            0,
            256 << 10,
            64 << 10,
            true,
            None,
            // Far beyond the test: only the loss can end this send.
            Duration::from_secs(3600),
            bytes.clone(),
            Box::new(move |outcome| {
                let _ = tx.send(outcome);
            }),
        )
        .unwrap();
    // SAFETY: kept alive and unwritten.
    let mut first = unsafe { stream.send(bytes.as_ptr(), 64 << 10, 0) }.unwrap();
    assert!(first.wait_until(std::time::Instant::now() + WAIT).unwrap());
    a.peer_lost(1);
    let error = verdict.recv_timeout(WAIT).unwrap().unwrap_err();
    assert_eq!(error.code, Code::Unavailable, "{error}");
    assert!(error.message.contains("process 1"), "{error}");
    assert!(stream.stop().is_raised(), "a pipeline feeding it stops");
    // SAFETY: as above.
    let after = unsafe { stream.send(bytes.as_ptr(), 64 << 10, 64 << 10) };
    assert!(after.is_err(), "no more chunks go");
    drop(b);
}

/// Established TCP connections of this process (both ends counted; the
/// network namespace's table also lists other processes' sockets).
fn established_tcp() -> usize {
    let mine: std::collections::HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            Some(
                target
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_string(),
            )
        })
        .collect();
    std::fs::read_to_string("/proc/self/net/tcp")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|cols| cols.get(3) == Some(&"01") && cols.get(9).is_some_and(|i| mine.contains(*i)))
        .count()
}

#[test]
fn closing_a_pair_by_handshake_leaves_no_tcp_connection_behind() {
    // UCX picks its same-host transports within one process: this test's
    // body runs again in a child of this binary with UCX on TCP alone.
    let name = "transport::ucx::tests::tcp_connections_closed_with_their_endpoint_pairs";
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            name,
            "--nocapture",
            "--test-threads=1",
        ])
        .env("UCX_TLS", "tcp")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{text}");
    assert!(text.contains("1 passed"), "the body did not run: {text}");
}

#[test]
#[ignore = "run by closing_a_pair_by_handshake_leaves_no_tcp_connection_behind, over TCP"]
fn tcp_connections_closed_with_their_endpoint_pairs() {
    let Some(job) = job(2) else { return };
    let before = established_tcp();
    let transfer = |from: usize, to: usize| deliver(&job, from, to, 1);
    transfer(0, 1);
    transfer(1, 0);
    assert!(established_tcp() > before, "UCX is not on TCP here");
    job[0].set_connection_limits(&crate::transport::connections::ConnectionLimits {
        max_open: 0,
        idle_timeout: Duration::from_secs(600),
        grace: Duration::from_millis(0),
    });
    // Each round makes the pair again and the bound closes it again.
    for round in 1..=4u64 {
        wait_until("the pair closes by handshake", || {
            job[0].closed_by_handshake() >= round
        });
        wait_until("its TCP connection closes with it", || {
            established_tcp() == before
        });
        transfer(0, 1);
        transfer(1, 0);
    }
    // What each closed endpoint left behind is freed too: a tag for UCX's
    // error handler, kept a sweep past the close.
    for t in &job {
        wait_until("closed endpoints' tags are freed", || {
            t.endpoint_tags() == t.open_endpoints()
        });
    }
}
