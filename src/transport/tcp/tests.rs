use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::wire::{read_response, RequestHeader};
use super::*;
use crate::status::Code;
use crate::transport::auth_token::AuthToken;
use crate::transport::destination::{HeapDestination, WritableDestination};

const TIMEOUT: Duration = Duration::from_secs(10);

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|index| (index as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

fn server_with(handler_threads: usize, io_timeout: Duration) -> TcpReceiveServer {
    TcpReceiveServer::bind_with(
        loopback(),
        TcpServerConfig {
            handler_threads,
            io_timeout,
            ..TcpServerConfig::default()
        },
    )
    .unwrap()
}

/// A server whose unauthenticated connections get `header_deadline`.
fn guarded_server(
    handler_threads: usize,
    io_timeout: Duration,
    header_deadline: Duration,
    max_pending_connections: usize,
) -> TcpReceiveServer {
    TcpReceiveServer::bind_with(
        loopback(),
        TcpServerConfig {
            handler_threads,
            io_timeout,
            header_deadline,
            max_pending_connections,
            ..TcpServerConfig::default()
        },
    )
    .unwrap()
}

/// One send on a sender of its own (no kept connection to reuse).
fn tcp_send(
    endpoint: SocketAddr,
    token: &AuthToken,
    offset: u64,
    bytes: &[u8],
    timeout: Duration,
) -> crate::status::Result<()> {
    TcpSender::new()
        .send(endpoint, token, offset, bytes, None, timeout)
        .map(|_| ())
}

/// A connection that sent one request header (no receipt), then `payload`.
fn raw_request(
    endpoint: SocketAddr,
    token: AuthToken,
    offset: u64,
    length: u64,
    payload: &[u8],
) -> TcpStream {
    let mut stream = TcpStream::connect(endpoint).unwrap();
    let header = RequestHeader {
        token,
        offset,
        length,
        receipt: Vec::new(),
    };
    stream.write_all(&header.encode()).unwrap();
    stream.write_all(payload).unwrap();
    stream
}

/// The refusal a receiver answered.
fn refusal(answer: &mut impl Read) -> crate::status::Status {
    read_response(answer).unwrap().unwrap().outcome.unwrap_err()
}

fn registered(server: &TcpReceiveServer, len: usize) -> (AuthToken, Arc<HeapDestination>) {
    let token = AuthToken::generate().unwrap();
    let destination = Arc::new(HeapDestination::new(len));
    server
        .registry()
        .register(token, destination.clone())
        .unwrap();
    (token, destination)
}

#[test]
fn small_and_large_payloads_land_at_their_offset() {
    let server = TcpReceiveServer::bind(loopback()).unwrap();
    let (token, destination) = registered(&server, 100);
    tcp_send(server.local_addr(), &token, 10, b"hello", TIMEOUT).unwrap();
    let seen = destination.to_vec();
    assert_eq!(&seen[10..15], b"hello");
    assert!(seen[..10].iter().chain(&seen[15..]).all(|&byte| byte == 0));

    let len = 24 << 20;
    let (token, destination) = registered(&server, len + 7);
    let payload = pattern(len, 1);
    tcp_send(server.local_addr(), &token, 7, &payload, TIMEOUT).unwrap();
    assert_eq!(&destination.to_vec()[7..], &payload[..]);
}

#[test]
fn zero_length_transfers_are_acknowledged() {
    let server = TcpReceiveServer::bind(loopback()).unwrap();
    let (token, _destination) = registered(&server, 0);
    tcp_send(server.local_addr(), &token, 0, &[], TIMEOUT).unwrap();
}

#[test]
fn unknown_or_retired_tokens_are_refused_and_nothing_is_written() {
    let server = TcpReceiveServer::bind(loopback()).unwrap();
    let (token, destination) = registered(&server, 16);
    let stranger = AuthToken::generate().unwrap();
    let error = tcp_send(server.local_addr(), &stranger, 0, &[1; 16], TIMEOUT).unwrap_err();
    assert_eq!(error.code, Code::Unauthenticated, "{error}");
    assert!(error.message.contains("refused"), "{error}");

    let mut near_miss = *token.as_bytes();
    near_miss[0] ^= 1;
    let error = tcp_send(
        server.local_addr(),
        &AuthToken::from_bytes(near_miss),
        0,
        &[1; 16],
        TIMEOUT,
    )
    .unwrap_err();
    assert_eq!(error.code, Code::Unauthenticated);

    assert!(server.registry().unregister(&token).is_some());
    assert_eq!(server.registry().len(), 0);
    let error = tcp_send(server.local_addr(), &token, 0, &[1; 16], TIMEOUT).unwrap_err();
    assert_eq!(error.code, Code::Unauthenticated);
    assert_eq!(destination.to_vec(), vec![0; 16]);
}

#[test]
fn duplicate_registration_is_rejected() {
    let server = TcpReceiveServer::bind(loopback()).unwrap();
    let (token, _destination) = registered(&server, 4);
    let error = server
        .registry()
        .register(token, Arc::new(HeapDestination::new(4)))
        .unwrap_err();
    assert_eq!(error.code, Code::AlreadyExists);
}

#[test]
fn writes_outside_the_destination_are_refused() {
    let server = TcpReceiveServer::bind(loopback()).unwrap();
    let (token, destination) = registered(&server, 16);
    for (offset, len) in [(0, 17), (16, 1), (10, 7)] {
        let error =
            tcp_send(server.local_addr(), &token, offset, &vec![9; len], TIMEOUT).unwrap_err();
        assert_eq!(error.code, Code::OutOfRange, "{error}");
        assert!(error.message.contains("16-byte destination"), "{error}");
    }
    // An offset chosen so that offset + length wraps around.
    let mut stream = raw_request(server.local_addr(), token, u64::MAX - 1, 4, &[9; 4]);
    let verdict = refusal(&mut stream);
    assert_eq!(verdict.code, Code::OutOfRange);
    assert_eq!(destination.to_vec(), vec![0; 16]);
    tcp_send(server.local_addr(), &token, 0, &[1; 16], TIMEOUT).unwrap();
}

#[test]
fn foreign_protocols_get_an_error_answer() {
    let server = TcpReceiveServer::bind(loopback()).unwrap();
    let mut stream = TcpStream::connect(server.local_addr()).unwrap();
    let mut request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
    request.resize(super::REQUEST_HEADER_LEN, b' ');
    stream.write_all(&request).unwrap();
    let verdict = refusal(&mut stream);
    assert_eq!(verdict.code, Code::InvalidArgument);
}

#[test]
fn a_sender_dying_mid_stream_frees_the_handler() {
    // One handler thread: the next transfer can only succeed if the broken
    // one released it.
    let server = server_with(1, TIMEOUT);
    let (token, _destination) = registered(&server, 1 << 20);
    // Dropped at once: the receiver sees EOF after 100 of 1 MiB bytes.
    drop(raw_request(
        server.local_addr(),
        token,
        0,
        1 << 20,
        &[7; 100],
    ));
    // The dead sender claimed the token (bytes may have landed), so it is
    // spent; the server itself keeps serving other destinations.
    let again = tcp_send(server.local_addr(), &token, 0, &[1; 8], TIMEOUT).unwrap_err();
    assert_eq!(again.code, Code::Unauthenticated, "{again}");
    let (fresh, destination) = registered(&server, 1 << 20);
    let payload = pattern(1 << 20, 5);
    tcp_send(server.local_addr(), &fresh, 0, &payload, TIMEOUT).unwrap();
    assert_eq!(destination.to_vec(), payload);
}

#[test]
fn a_stalled_sender_times_out_on_the_receiver() {
    // A large payload is a handler's (bounded by io_timeout), a small one
    // the front door's (bounded by the header deadline): either way the
    // receiver gives up and says why, and the one handler is free again.
    let server = guarded_server(
        1,
        Duration::from_millis(100),
        Duration::from_millis(200),
        256,
    );
    for length in [1 << 20, 64] {
        let (token, _destination) = registered(&server, length);
        // Never sends the rest of the payload.
        let mut stalled = raw_request(server.local_addr(), token, 0, length as u64, &[3; 10]);
        let verdict = refusal(&mut stalled);
        assert_eq!(verdict.code, Code::DeadlineExceeded, "{length}: {verdict}");
        let (fresh, _other) = registered(&server, length);
        tcp_send(server.local_addr(), &fresh, 0, &vec![1; length], TIMEOUT).unwrap();
    }
}

#[test]
fn a_receiver_that_never_acknowledges_hits_the_sender_deadline() {
    let silent = TcpListener::bind(loopback()).unwrap();
    let endpoint = silent.local_addr().unwrap();
    let token = AuthToken::generate().unwrap();
    let error = tcp_send(endpoint, &token, 0, &[1; 1000], Duration::from_millis(150)).unwrap_err();
    assert_eq!(error.code, Code::DeadlineExceeded, "{error}");
    drop(silent);
}

#[test]
fn a_receiver_that_closes_without_acknowledging_is_unavailable() {
    let listener = TcpListener::bind(loopback()).unwrap();
    let endpoint = listener.local_addr().unwrap();
    let closer = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut header = [0u8; super::REQUEST_HEADER_LEN];
        stream.read_exact(&mut header).unwrap();
        // Closes without reading the payload or answering.
    });
    let token = AuthToken::generate().unwrap();
    let error = tcp_send(endpoint, &token, 0, &[1; 10], TIMEOUT).unwrap_err();
    assert_eq!(error.code, Code::Unavailable, "{error}");
    closer.join().unwrap();
}

#[test]
fn nobody_listening_is_unavailable() {
    let endpoint = TcpListener::bind(loopback()).unwrap().local_addr().unwrap();
    let token = AuthToken::generate().unwrap();
    let error = tcp_send(endpoint, &token, 0, &[1], TIMEOUT).unwrap_err();
    assert_eq!(error.code, Code::Unavailable, "{error}");
}

#[test]
fn refusing_a_payload_larger_than_the_discard_bound_still_fails_cleanly() {
    let server = TcpReceiveServer::bind_with(
        loopback(),
        TcpServerConfig {
            max_discard_bytes: 1024,
            ..TcpServerConfig::default()
        },
    )
    .unwrap();
    let stranger = AuthToken::generate().unwrap();
    let error = tcp_send(
        server.local_addr(),
        &stranger,
        0,
        &vec![0; 8 << 20],
        TIMEOUT,
    )
    .unwrap_err();
    assert!(
        matches!(error.code, Code::Unauthenticated | Code::Unavailable),
        "{error}"
    );
}

#[test]
fn a_token_admits_exactly_one_transfer_even_when_senders_race() {
    let server = server_with(4, TIMEOUT);
    let len = 1 << 20;
    let senders = 6u8;
    let (token, destination) = registered(&server, len);
    let endpoint = server.local_addr();
    let outcomes: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..senders)
            .map(|index| {
                scope.spawn(move || {
                    let payload = pattern(len, index);
                    (index, tcp_send(endpoint, &token, 0, &payload, TIMEOUT))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let winners: Vec<u8> = outcomes
        .iter()
        .filter(|(_, r)| r.is_ok())
        .map(|(i, _)| *i)
        .collect();
    assert_eq!(winners.len(), 1, "{outcomes:?}");
    for (_, r) in outcomes.iter().filter(|(_, r)| r.is_err()) {
        assert_eq!(r.as_ref().unwrap_err().code, Code::Unauthenticated);
    }
    assert_eq!(destination.to_vec(), pattern(len, winners[0]));
}

#[test]
fn dropping_the_server_cuts_idle_connections_instead_of_waiting() {
    let server = TcpReceiveServer::bind(loopback()).unwrap();
    let _destination: Arc<dyn WritableDestination> = registered(&server, 8).1;
    let idle = TcpStream::connect(server.local_addr()).unwrap();
    // Half a header: whoever serves this connection would wait for the rest.
    (&idle).write_all(&[0u8; 10]).unwrap();
    let (done, finished) = crossbeam_channel::bounded(1);
    std::thread::spawn(move || {
        drop(server);
        done.send(()).unwrap();
    });
    finished
        .recv_timeout(Duration::from_secs(5))
        .expect("dropping the server must not wait for the 30 s I/O timeout");
    let mut rest = Vec::new();
    let _ = (&idle).read_to_end(&mut rest);
}

#[test]
fn transfers_into_shared_memory_destinations() {
    use crate::transport::shm::SharedRegion;
    let server = TcpReceiveServer::bind(loopback()).unwrap();
    let region = Arc::new(SharedRegion::create(4096).unwrap());
    let token = AuthToken::generate().unwrap();
    server.registry().register(token, region.clone()).unwrap();
    tcp_send(server.local_addr(), &token, 100, b"via tcp", TIMEOUT).unwrap();
    let mut seen = [0u8; 7];
    region.read_at(100, &mut seen).unwrap();
    assert_eq!(&seen, b"via tcp");
}

/// How soon after connecting an attacker must see the server close its
/// connection (the tests' header deadline is far shorter).
const CLOSED_WITHIN: Duration = Duration::from_secs(5);

/// How long an attacker keeps at it unless the server closes its
/// connection: beyond the legitimate transfer's deadline, so that transfer
/// cannot succeed merely because the attack stopped.
const ATTACK_LASTS: Duration = Duration::from_secs(15);

/// What an attacking connection saw.
struct Trickled {
    /// Since connecting; `None` if the server still had not closed it after
    /// `ATTACK_LASTS`.
    closed_after: Option<Duration>,
    /// Whatever the server wrote to it.
    answer: Vec<u8>,
}

/// An attacker: connects, sends the first `opening` bytes of `script` at
/// once, then the rest one byte every `pace`, then zeros at that pace, for
/// as long as the server keeps the connection open (at most
/// `ATTACK_LASTS`). Signals `started` once
/// the opening is sent.
fn trickle(
    endpoint: SocketAddr,
    script: Vec<u8>,
    opening: usize,
    pace: Duration,
    started: crossbeam_channel::Sender<()>,
) -> JoinHandle<Trickled> {
    std::thread::spawn(move || {
        let stream = TcpStream::connect(endpoint).unwrap();
        let connected = Instant::now();
        (&stream).write_all(&script[..opening]).unwrap();
        started.send(()).unwrap();
        // The attacker's pause between bytes is a read with a timeout, so a
        // close is noticed the moment it happens.
        stream.set_read_timeout(Some(pace)).unwrap();
        let mut rest = script[opening..]
            .iter()
            .copied()
            .chain(std::iter::repeat(0));
        let mut answer = Vec::new();
        let mut buffer = [0u8; 4096];
        while connected.elapsed() < ATTACK_LASTS {
            let closed = match (&stream).read(&mut buffer) {
                Ok(0) => true,
                Ok(count) => {
                    answer.extend_from_slice(&buffer[..count]);
                    continue;
                }
                Err(error) => !matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
            };
            if closed || (&stream).write_all(&[rest.next().unwrap()]).is_err() {
                return Trickled {
                    closed_after: Some(connected.elapsed()),
                    answer,
                };
            }
        }
        Trickled {
            closed_after: None,
            answer,
        }
    })
}

/// A well-formed header with a token nobody registered, announcing a
/// payload that never ends.
fn forged_header() -> Vec<u8> {
    RequestHeader {
        token: AuthToken::generate().unwrap(),
        offset: 0,
        length: u64::MAX,
        receipt: Vec::new(),
    }
    .encode()
    .to_vec()
}

/// Starts `count` attackers and returns once each has sent its opening.
fn attack(
    server: &TcpReceiveServer,
    count: usize,
    opening: usize,
    pace: Duration,
) -> Vec<JoinHandle<Trickled>> {
    let (started, opened) = crossbeam_channel::unbounded();
    let attackers: Vec<_> = (0..count)
        .map(|_| {
            trickle(
                server.local_addr(),
                forged_header(),
                opening,
                pace,
                started.clone(),
            )
        })
        .collect();
    for _ in 0..count {
        opened.recv_timeout(TIMEOUT).expect("attacker connected");
    }
    attackers
}

/// A legitimate transfer, bounded by `TIMEOUT`, lands intact.
fn assert_transfer_completes(server: &TcpReceiveServer) {
    let len = 1 << 20;
    let (token, destination) = registered(server, len);
    let payload = pattern(len, 3);
    let started = Instant::now();
    tcp_send(server.local_addr(), &token, 0, &payload, TIMEOUT).unwrap_or_else(|error| {
        panic!(
            "legitimate transfer failed after {:?}: {error}",
            started.elapsed()
        )
    });
    assert_eq!(destination.to_vec(), payload);
}

fn assert_closed_by_server(attackers: Vec<JoinHandle<Trickled>>) -> Vec<Trickled> {
    attackers
        .into_iter()
        .map(|attacker| {
            let seen = attacker.join().unwrap();
            let after = seen
                .closed_after
                .expect("the server never closed an unauthenticated connection");
            assert!(after < CLOSED_WITHIN, "closed only after {after:?}");
            seen
        })
        .collect()
}

#[test]
fn trickling_unauthenticated_connections_hold_no_handler() {
    // Three times as many attackers as handlers, each sending its header a
    // byte at a time (5.6 s for the header, then a payload that never ends),
    // so a read timeout that restarts with every byte never fires.
    let server = guarded_server(2, Duration::from_secs(1), Duration::from_millis(300), 256);
    let attackers = attack(&server, 6, 8, Duration::from_millis(100));
    assert_transfer_completes(&server);
    for seen in assert_closed_by_server(attackers) {
        assert!(
            seen.answer.is_empty(),
            "nothing is answered to a partial header"
        );
    }
}

#[test]
fn silent_connections_do_not_delay_transfers() {
    let server = guarded_server(2, Duration::from_secs(1), Duration::from_millis(300), 256);
    let opened = Instant::now();
    let silent: Vec<TcpStream> = (0..40)
        .map(|_| TcpStream::connect(server.local_addr()).unwrap())
        .collect();
    assert_transfer_completes(&server);
    for stream in &silent {
        stream.set_read_timeout(Some(CLOSED_WITHIN)).unwrap();
        let mut byte = [0u8; 1];
        match (&*stream).read(&mut byte) {
            Ok(0) => {}
            Ok(_) => panic!("a silent connection was answered"),
            Err(error) => assert!(
                !matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
                "a silent connection stayed open: {error}"
            ),
        }
    }
    assert!(opened.elapsed() < CLOSED_WITHIN, "{:?}", opened.elapsed());
}

#[test]
fn refused_connections_hold_no_handler() {
    // Full headers with tokens nobody registered, then the announced
    // payload trickles: each is refused, and discarding its payload must
    // not tie up the only handler either.
    let server = guarded_server(1, Duration::from_secs(1), Duration::from_millis(300), 256);
    let attackers = attack(
        &server,
        3,
        super::REQUEST_HEADER_LEN,
        Duration::from_millis(100),
    );
    assert_transfer_completes(&server);
    for seen in assert_closed_by_server(attackers) {
        let verdict = refusal(&mut &seen.answer[..]);
        assert_eq!(verdict.code, Code::Unauthenticated, "{verdict}");
    }
}

#[test]
fn beyond_the_pending_cap_the_oldest_unauthenticated_connections_are_closed() {
    // A header deadline the test never reaches: only the cap closes them.
    let server = guarded_server(1, TIMEOUT, Duration::from_secs(60), 4);
    let silent: Vec<TcpStream> = (0..8)
        .map(|_| TcpStream::connect(server.local_addr()).unwrap())
        .collect();
    let (report, reports) = crossbeam_channel::unbounded();
    for stream in &silent {
        let stream = stream.try_clone().unwrap();
        let report = report.clone();
        std::thread::spawn(move || {
            stream.set_read_timeout(Some(CLOSED_WITHIN)).unwrap();
            let mut byte = [0u8; 1];
            let closed = match (&stream).read(&mut byte) {
                Ok(count) => count == 0,
                Err(error) => !matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
            };
            let _ = report.send(closed);
        });
    }
    let mut closed = 0;
    while closed < 4 {
        let was_closed = reports
            .recv_timeout(CLOSED_WITHIN + Duration::from_secs(1))
            .unwrap();
        assert!(was_closed, "fewer than 4 of 8 connections were evicted");
        closed += 1;
    }
    assert_transfer_completes(&server);
}

#[test]
fn pre_authentication_limits_must_be_positive() {
    for config in [
        TcpServerConfig {
            header_deadline: Duration::ZERO,
            ..TcpServerConfig::default()
        },
        TcpServerConfig {
            max_pending_connections: 0,
            ..TcpServerConfig::default()
        },
    ] {
        let error = TcpReceiveServer::bind_with(loopback(), config)
            .err()
            .unwrap();
        assert_eq!(error.code, Code::InvalidArgument, "{error}");
    }
}

#[test]
fn one_kept_connection_carries_a_senders_transfers_to_a_receiver() {
    // Small payloads are landed by the front door, large ones by a handler:
    // both give the connection back for the next request.
    let server = server_with(2, TIMEOUT);
    let sender = TcpSender::new();
    for (index, len) in [4096, 1 << 20, 0, 64 << 10, (64 << 10) + 1, 4096]
        .into_iter()
        .enumerate()
    {
        let (token, destination) = registered(&server, len.max(1));
        let payload = pattern(len, index as u8);
        let delivered = sender
            .send(server.local_addr(), &token, 0, &payload, None, TIMEOUT)
            .unwrap();
        assert!(!delivered.receipt_applied);
        assert_eq!(
            &destination.to_vec()[..len],
            &payload[..],
            "transfer {index}"
        );
    }
    assert_eq!(server.connections_accepted(), 1);
    assert_eq!(sender.idle_connections(), 1);
    // A refusal closes the connection: the next transfer reconnects.
    let stranger = AuthToken::generate().unwrap();
    let refused = sender
        .send(server.local_addr(), &stranger, 0, &[1; 8], None, TIMEOUT)
        .unwrap_err();
    assert_eq!(refused.code, Code::Unauthenticated, "{refused}");
    assert_eq!(sender.idle_connections(), 0);
    let (token, destination) = registered(&server, 8);
    tcp_send(server.local_addr(), &token, 0, &[6; 8], TIMEOUT).unwrap();
    assert_eq!(destination.to_vec(), vec![6; 8]);
}

/// Receipts applied: key, value, and the destination's bytes then.
type Applied = Arc<parking_lot::Mutex<Vec<(String, Vec<u8>, Vec<u8>)>>>;

/// A sink that records each receipt with what the destination held when it
/// was applied.
fn recording_sink(server: &TcpReceiveServer, destination: Arc<HeapDestination>) -> Applied {
    let seen: Applied = Arc::default();
    let record = seen.clone();
    server.set_receipt_sink(Arc::new(move |key: &str, value: &[u8]| {
        record
            .lock()
            .push((key.to_string(), value.to_vec(), destination.to_vec()));
        Ok(())
    }));
    seen
}

/// One send of `bytes` with the receipt `xr1 ok 7f`, on a sender of its own.
fn send_with_receipt(
    server: &TcpReceiveServer,
    token: &AuthToken,
    bytes: &[u8],
) -> crate::transport::registry::Delivered {
    TcpSender::new()
        .send(
            server.local_addr(),
            token,
            0,
            bytes,
            Some(b"xr1 ok 7f"),
            TIMEOUT,
        )
        .unwrap()
}

#[test]
fn a_receipt_sent_with_the_bytes_sets_the_key_once_they_are_in() {
    for len in [4096, 1 << 20] {
        let server = server_with(1, TIMEOUT);
        let token = AuthToken::generate().unwrap();
        let destination = Arc::new(HeapDestination::new(len));
        server
            .registry()
            .register_with_key(token, destination.clone(), Some("done/7".into()))
            .unwrap();
        let seen = recording_sink(&server, destination.clone());
        let payload = pattern(len, 3);
        let delivered = send_with_receipt(&server, &token, &payload);
        assert!(delivered.receipt_applied, "{len}");
        let seen = seen.lock();
        assert_eq!(seen.len(), 1, "{len}: applied exactly once");
        assert_eq!(seen[0].0, "done/7");
        assert_eq!(seen[0].1, b"xr1 ok 7f");
        assert_eq!(
            seen[0].2, payload,
            "{len}: the key was set before the bytes were in"
        );
    }
}

#[test]
fn a_receipt_is_applied_only_for_a_key_held_here() {
    let server = server_with(1, TIMEOUT);
    // Registered without a key: the receipt is not the receiver's to set.
    let (token, destination) = registered(&server, 16);
    let seen = recording_sink(&server, destination.clone());
    let delivered = send_with_receipt(&server, &token, &[1; 16]);
    assert!(!delivered.receipt_applied);
    assert!(seen.lock().is_empty());
    // Registered with a key but no sink set: the sender must set it.
    let bare = server_with(1, TIMEOUT);
    let token = AuthToken::generate().unwrap();
    bare.registry()
        .register_with_key(token, Arc::new(HeapDestination::new(16)), Some("k".into()))
        .unwrap();
    let delivered = send_with_receipt(&bare, &token, &[1; 16]);
    assert!(!delivered.receipt_applied);
}

/// Sends two requests from one sender to a receiver that answers the first
/// OK, then closes that connection once the second arrives, unanswered (as
/// a receiver that closed an idle connection just as it was reused), and on
/// the sender's new connection answers `second`. The second send's outcome.
fn resent_after_a_close(
    second: Vec<u8>,
) -> crate::status::Result<crate::transport::registry::Delivered> {
    let listener = TcpListener::bind(loopback()).unwrap();
    let endpoint = listener.local_addr().unwrap();
    let receiver = std::thread::spawn(move || {
        let (mut first, _) = listener.accept().unwrap();
        let mut request = [0u8; super::REQUEST_HEADER_LEN + 8];
        first.read_exact(&mut request).unwrap();
        first
            .write_all(&super::wire::encode_response(&super::wire::Response {
                outcome: Ok(()),
                receipt_applied: false,
            }))
            .unwrap();
        first.read_exact(&mut request).unwrap();
        drop(first);
        let (mut again, _) = listener.accept().unwrap();
        again.read_exact(&mut request).unwrap();
        again.write_all(&second).unwrap();
    });
    let sender = TcpSender::new();
    let token = AuthToken::generate().unwrap();
    sender
        .send(endpoint, &token, 0, &[1; 8], None, TIMEOUT)
        .unwrap();
    let outcome = sender.send(endpoint, &token, 0, &[2; 8], None, TIMEOUT);
    receiver.join().unwrap();
    outcome
}

#[test]
fn a_kept_connection_closed_by_the_receiver_is_replaced_by_a_new_one() {
    let ok = super::wire::encode_response(&super::wire::Response {
        outcome: Ok(()),
        receipt_applied: true,
    });
    let delivered = resent_after_a_close(ok).unwrap();
    assert!(
        delivered.receipt_applied,
        "the answer came on the new connection"
    );
}

#[test]
fn a_resent_request_whose_destination_is_gone_fails_rather_than_reads_as_foreign() {
    // The closed connection may have claimed the destination: the send
    // failed (its receipt is the sender's to set), it was not refused as
    // somebody else's.
    let refusal = super::wire::encode_refusal(crate::status::unauthenticated("no such token"));
    let error = resent_after_a_close(refusal).unwrap_err();
    assert_eq!(error.code, Code::Unavailable, "{error}");
    assert!(error.message.contains("sent again"), "{error}");
}

#[test]
fn kept_connections_too_old_to_reuse_or_closed_by_the_receiver_are_closed_by_a_sweep() {
    let server = server_with(2, TIMEOUT);
    let sender = TcpSender::new();
    let (token, _destination) = registered(&server, 64);
    sender
        .send(server.local_addr(), &token, 0, &[7; 64], None, TIMEOUT)
        .unwrap();
    assert_eq!(sender.idle_connections(), 1);
    // Fresh and open: kept.
    assert_eq!(sender.close_stale(std::time::Instant::now()), 1);
    // Past the reuse window it would only sit in CLOSE_WAIT once the
    // receiver closes it: closed now.
    let later = std::time::Instant::now() + TcpSender::reuse_window() * 2;
    assert_eq!(sender.close_stale(later), 0);
    assert_eq!(sender.idle_connections(), 0);
    // Closed by the receiver: also gone, however fresh.
    let (token, _destination) = registered(&server, 64);
    sender
        .send(server.local_addr(), &token, 0, &[8; 64], None, TIMEOUT)
        .unwrap();
    assert_eq!(sender.idle_connections(), 1);
    drop(server);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while sender.close_stale(std::time::Instant::now()) > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "a closed connection stayed kept"
        );
        std::thread::yield_now();
    }
}

/// Host memory whose LAST chunk's copy completes only when the test opens
/// the gate (the other copies complete at once).
struct GatedDevice {
    memory: Arc<HeapDestination>,
    gate: Arc<(parking_lot::Mutex<(bool, bool)>, parking_lot::Condvar)>,
}

struct GateCompletion(Arc<(parking_lot::Mutex<(bool, bool)>, parking_lot::Condvar)>);

impl crate::transport::staging::CopyCompletion for GateCompletion {
    fn is_done(&mut self) -> crate::status::Result<bool> {
        Ok(self.0 .0.lock().1)
    }

    fn wait_until(&mut self, until: Instant) -> crate::status::Result<bool> {
        let mut state = self.0 .0.lock();
        while !state.1 {
            if self.0 .1.wait_until(&mut state, until).timed_out() {
                break;
            }
        }
        Ok(state.1)
    }
}

impl crate::transport::staging::DeviceCopy for GatedDevice {
    fn len(&self) -> usize {
        self.memory.len()
    }

    fn to_device(
        &self,
        slot: &crate::transport::staging::Slot,
        offset: usize,
        len: usize,
    ) -> crate::status::Result<crate::transport::staging::Pending> {
        use crate::transport::staging::{HostCopy, Pending};
        HostCopy::new(self.memory.clone()).to_device(slot, offset, len)?;
        if offset + len < self.memory.len() {
            return Ok(Pending::Done);
        }
        let mut state = self.gate.0.lock();
        state.0 = true;
        self.gate.1.notify_all();
        Ok(Pending::Running(Box::new(GateCompletion(
            self.gate.clone(),
        ))))
    }

    fn to_host(
        &self,
        _offset: usize,
        _slot: &crate::transport::staging::Slot,
        _len: usize,
    ) -> crate::status::Result<crate::transport::staging::Pending> {
        Err(crate::status::unimplemented("receive side only"))
    }
}

#[test]
fn a_staged_receive_sets_the_receipt_only_after_its_last_copy_completed() {
    use crate::transport::staging::{HostSource, StagedDestination, Staging, StagingConfig, Stop};
    let server = server_with(2, Duration::from_secs(10));
    let (set_tx, set_rx) = crossbeam_channel::unbounded::<String>();
    server.set_receipt_sink(Arc::new(move |key: &str, _value: &[u8]| {
        set_tx.send(key.to_string()).unwrap();
        Ok(())
    }));
    let staging = Staging::new(StagingConfig {
        chunk_bytes: 64 << 10,
        ring_depth: 3,
        stage_host_transfers: true,
        ..StagingConfig::default()
    })
    .unwrap();
    let len = (1 << 20) + 123;
    let memory = Arc::new(HeapDestination::new(len));
    let gate = Arc::new(Default::default());
    let device = Arc::new(GatedDevice {
        memory: memory.clone(),
        gate: Arc::clone(&gate),
    });
    let staged = Arc::new(StagedDestination::new(
        memory.clone(),
        device,
        staging.clone(),
    ));
    let token = AuthToken::generate().unwrap();
    server
        .registry()
        .register_with_key(token, staged, Some("the-key".into()))
        .unwrap();
    let bytes = pattern(len, 77);
    let endpoint = server.local_addr();
    let sending = {
        let (bytes, staging) = (bytes.clone(), staging.clone());
        std::thread::spawn(move || {
            let mut write = |wire: &mut crate::transport::staging::Drain<'_>| {
                staging
                    .send(
                        &HostSource::new(&bytes),
                        0,
                        bytes.len(),
                        wire,
                        &Stop::new(),
                        Duration::from_secs(10),
                    )
                    .map(|_| ())
            };
            let mut payload = Payload::Chunks {
                len: bytes.len(),
                write: &mut write,
            };
            TcpSender::new().send_payload(
                endpoint,
                &token,
                0,
                &mut payload,
                Some(b"receipt"),
                Duration::from_secs(10),
            )
        })
    };
    {
        let mut state = gate.0.lock();
        while !state.0 {
            gate.1.wait(&mut state);
        }
    }
    // Every byte is on the receiver's side, the last copy not completed:
    // no receipt comes, however long the receiver is given (a pipeline that
    // reported the bytes landed once the copy was queued sets it at once).
    assert!(
        set_rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "receipt set before the last copy completed"
    );
    assert!(
        !sending.is_finished(),
        "acknowledged before the last copy completed"
    );
    {
        let mut state = gate.0.lock();
        state.1 = true;
        gate.1.notify_all();
    }
    let delivered = sending.join().unwrap().unwrap();
    assert!(delivered.receipt_applied);
    assert_eq!(set_rx.recv().unwrap(), "the-key");
    assert_eq!(memory.to_vec(), bytes);
    assert_eq!(staging.staged(), 2, "both halves went through the pipeline");
    assert!(server.registry().is_empty());
}
