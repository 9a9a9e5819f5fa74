use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::*;
use crate::status::Code;

#[derive(Default)]
struct Recorder {
    sets: Mutex<Vec<(u32, String, Vec<u8>)>>,
    deletes: Mutex<Vec<(u32, String)>>,
    closed: Mutex<Vec<u32>>,
}

impl ControlHandler for Recorder {
    fn set(&self, from: u32, key: &str, value: &[u8]) -> Result<()> {
        if key == "refuse" {
            return Err(status::already_exists("refused on purpose"));
        }
        self.sets
            .lock()
            .push((from, key.to_string(), value.to_vec()));
        Ok(())
    }
    fn delete(&self, from: u32, key: &str) -> Result<()> {
        self.deletes.lock().push((from, key.to_string()));
        Ok(())
    }
    fn peer_closed(&self, process: u32) {
        self.closed.lock().push(process);
    }
}

/// The recorder, the server, and the handler the server holds weakly (kept
/// by the test for as long as the server runs).
fn server(
    secret: Secret,
    config: ControlConfig,
) -> (Arc<Recorder>, ControlServer, Arc<dyn ControlHandler>) {
    let recorder = Arc::new(Recorder::default());
    let handler: Arc<dyn ControlHandler> = recorder.clone();
    let server = ControlServer::start(
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        secret,
        Arc::downgrade(&handler),
        config,
    )
    .unwrap();
    (recorder, server, handler)
}

/// A link from process `me` to `server` over its Unix socket (5 s timeout,
/// no close callback).
fn connect_as(server: &ControlServer, me: u32, secret: Secret) -> Result<Arc<ControlLink>> {
    ControlLink::connect(
        0,
        server.endpoint(),
        true,
        me,
        secret,
        Duration::from_secs(5),
        None,
    )
}

fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn requests_over_unix_and_tcp_reach_the_handler_before_they_return() {
    let secret = Secret::generate().unwrap();
    let (recorder, server, _handler) = server(secret, ControlConfig::default());
    for same_host in [true, false] {
        let link = ControlLink::connect(
            0,
            server.endpoint(),
            same_host,
            7,
            secret,
            Duration::from_secs(5),
            None,
        )
        .unwrap();
        link.set("k", b"value").unwrap();
        // Acked means applied: the handler has it already.
        assert_eq!(
            recorder.sets.lock().last().unwrap(),
            &(7, "k".to_string(), b"value".to_vec())
        );
        link.delete("k").unwrap();
        assert_eq!(
            recorder.deletes.lock().last().unwrap(),
            &(7, "k".to_string())
        );
        let err = link.set("refuse", b"").unwrap_err();
        assert_eq!(err.code, Code::AlreadyExists, "{err}");
        assert!(err.message.contains("refused on purpose"), "{err}");
    }
    // Pipelined requests from several threads all complete.
    let link = connect_as(&server, 3, secret).unwrap();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let link = link.clone();
            std::thread::spawn(move || {
                for i in 0..50 {
                    link.set(&format!("t{t}/{i}"), &[t as u8]).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(
        recorder
            .sets
            .lock()
            .iter()
            .filter(|(from, _, _)| *from == 3)
            .count(),
        400
    );
}

#[test]
fn a_peer_without_the_secret_is_refused_and_reaches_nothing() {
    let (recorder, server, _handler) =
        server(Secret::generate().unwrap(), ControlConfig::default());
    let wrong = Secret::generate().unwrap();
    let err = connect_as(&server, 1, wrong).unwrap_err();
    assert_eq!(err.code, Code::Unauthenticated, "{err}");
    assert!(recorder.sets.lock().is_empty());
    eventually("the refused connection is closed", || {
        server.connection_count() == 0
    });
}

#[test]
fn a_silent_or_trickling_peer_is_closed_at_the_hello_deadline() {
    let config = ControlConfig {
        hello_timeout: Duration::from_millis(300),
        ..ControlConfig::default()
    };
    let (_recorder, server, _handler) = server(Secret::generate().unwrap(), config);
    let addr = UnixAddr::from_abstract_name(server.endpoint().unix_name.as_bytes()).unwrap();
    let _silent = UnixStream::connect_addr(&addr).unwrap();
    let mut trickle = UnixStream::connect_addr(&addr).unwrap();
    let started = Instant::now();
    eventually("both connections are accepted", || {
        server.connection_count() == 2
    });
    // One byte every 100 ms would keep a per-read timeout alive forever.
    let writer = std::thread::spawn(move || {
        for _ in 0..30 {
            if trickle.write_all(&[0]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    eventually("both are closed", || server.connection_count() == 0);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    writer.join().unwrap();
}

#[test]
fn connections_beyond_the_bound_are_refused_without_blocking_the_others() {
    let config = ControlConfig {
        max_connections: 2,
        hello_timeout: Duration::from_secs(10),
        ..ControlConfig::default()
    };
    let secret = Secret::generate().unwrap();
    let (_recorder, server, _handler) = server(secret, config);
    let addr = UnixAddr::from_abstract_name(server.endpoint().unix_name.as_bytes()).unwrap();
    let _a = UnixStream::connect_addr(&addr).unwrap();
    let _b = UnixStream::connect_addr(&addr).unwrap();
    eventually("two silent connections are held", || {
        server.connection_count() == 2
    });
    // The third is refused at once (not queued behind the silent ones).
    let started = Instant::now();
    let err = connect_as(&server, 1, secret).unwrap_err();
    assert_eq!(err.code, Code::Unavailable, "{err}");
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[test]
fn a_closed_link_is_reported_and_its_waiting_requests_fail_at_once() {
    let secret = Secret::generate().unwrap();
    let (recorder, server, _handler) = server(secret, ControlConfig::default());
    let (closed_tx, closed_rx) = crossbeam_channel::unbounded();
    let on_closed: LinkClosed = Arc::new(move |peer| {
        let _ = closed_tx.send(peer);
    });
    let link = ControlLink::connect(
        0,
        server.endpoint(),
        true,
        9,
        secret,
        Duration::from_secs(30),
        Some(on_closed.clone()),
    )
    .unwrap();
    link.set("k", b"v").unwrap();
    drop(link);
    eventually("the server saw the link close", || {
        recorder.closed.lock().contains(&9)
    });
    // A server that goes away fails its peers' requests, it does not hang
    // them, and the link reports it (our own drop above reported nothing).
    let link = ControlLink::connect(
        5,
        server.endpoint(),
        true,
        9,
        secret,
        Duration::from_secs(30),
        Some(on_closed),
    )
    .unwrap();
    drop(server);
    assert_eq!(closed_rx.recv_timeout(Duration::from_secs(10)), Ok(5));
    assert!(
        closed_rx.try_recv().is_err(),
        "our own drop was reported as the peer's loss"
    );
    let started = Instant::now();
    let err = link.set("k", b"v").unwrap_err();
    assert_eq!(err.code, Code::Unavailable, "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[test]
fn secrets_and_endpoints_round_trip_through_text() {
    let secret = Secret::generate().unwrap();
    assert_eq!(Secret::from_hex(&secret.to_hex()), Some(secret));
    assert_eq!(Secret::from_hex("00"), None);
    let endpoint = ControlEndpoint {
        unix_name: "pjrt-crosshost/1/ab".into(),
        tcp: "10.0.0.2:5000".parse().unwrap(),
    };
    assert_eq!(ControlEndpoint::decode(&endpoint.encode()), Some(endpoint));
    assert_eq!(ControlEndpoint::decode("tcp=1.2.3.4:5"), None);
}

#[test]
fn the_frame_reader_takes_a_burst_in_one_read_and_frames_split_anyhow() {
    // Small frames, and one larger than a read chunk (it grows the buffer).
    let frames: Vec<(u8, u64, Vec<u8>)> = (0..40u64)
        .map(|i| {
            let len = if i == 17 { 200_000 } else { i as usize * 3 };
            (OP_SET, i, (0..len).map(|b| (b as u64 ^ i) as u8).collect())
        })
        .collect();
    let bytes: Vec<u8> = frames
        .iter()
        .flat_map(|(op, id, payload)| frame(*op, *id, &[payload]))
        .collect();
    for max_read in [1, 7, 4096, usize::MAX] {
        let mut stream = SliceStream::new(&bytes, max_read);
        let mut reader = FrameReader::new();
        for expected in &frames {
            assert_eq!(
                &reader.next(&mut stream).unwrap(),
                expected,
                "max_read {max_read}"
            );
        }
        assert!(!reader.has_frame());
        let end = reader.next(&mut stream).unwrap_err();
        assert_eq!(end.kind(), std::io::ErrorKind::UnexpectedEof, "{end}");
    }
    // A burst of small frames that arrived together is one read, and the
    // reader knows the next frame is already here.
    let burst: Vec<u8> = (0..16u64).flat_map(|i| frame(OP_ACK, i, &[])).collect();
    let mut stream = SliceStream::new(&burst, usize::MAX);
    let mut reader = FrameReader::new();
    for i in 0..16u64 {
        assert_eq!(reader.next(&mut stream).unwrap().1, i);
        assert_eq!(reader.has_frame(), i < 15);
    }
    assert_eq!(stream.reads, 1);
    // A length no frame has ends the stream.
    let mut bad = frame(OP_SET, 1, &[b"ok"]);
    bad.extend_from_slice(&((MAX_FRAME + 1) as u32).to_le_bytes());
    bad.extend_from_slice(&[0; 9]);
    let mut stream = SliceStream::new(&bad, usize::MAX);
    let mut reader = FrameReader::new();
    assert_eq!(reader.next(&mut stream).unwrap().2, b"ok");
    let end = reader.next(&mut stream).unwrap_err();
    assert_eq!(end.kind(), std::io::ErrorKind::InvalidData, "{end}");
}

#[test]
fn corked_requests_go_out_when_the_cork_drops_in_order_and_all_complete() {
    let secret = Secret::generate().unwrap();
    let (recorder, server, _handler) = server(secret, ControlConfig::default());
    let link = connect_as(&server, 4, secret).unwrap();
    let (done_tx, done_rx) = crossbeam_channel::unbounded();
    let held = cork();
    for i in 0..10 {
        let done_tx = done_tx.clone();
        link.set_async(
            &format!("c{i}"),
            &[i],
            Box::new(move |outcome| done_tx.send((i, outcome)).unwrap()),
        );
    }
    // Held, not written: nothing can have been answered.
    assert_eq!(cork::corked_requests(), 10);
    assert!(done_rx.try_recv().is_err());
    // A nested cork is the same cork: dropping it writes nothing.
    drop(cork());
    assert_eq!(cork::corked_requests(), 10);
    // A blocking request does not wait behind them: they go first.
    link.set("blocking", b"b").unwrap();
    assert_eq!(cork::corked_requests(), 0);
    let keys: Vec<String> = recorder
        .sets
        .lock()
        .iter()
        .map(|(_, k, _)| k.clone())
        .collect();
    let expected: Vec<String> = (0..10)
        .map(|i| format!("c{i}"))
        .chain(["blocking".to_string()])
        .collect();
    assert_eq!(keys, expected);
    // An explicit flush writes them and keeps the cork.
    let flushed = done_tx.clone();
    link.set_async(
        "flushed",
        b"f",
        Box::new(move |outcome| flushed.send((10, outcome)).unwrap()),
    );
    assert_eq!(cork::corked_requests(), 1);
    flush_corked();
    assert_eq!(cork::corked_requests(), 0);
    link.set_async(
        "after",
        b"a",
        Box::new(move |outcome| done_tx.send((11, outcome)).unwrap()),
    );
    assert_eq!(cork::corked_requests(), 1);
    drop(held);
    assert_eq!(cork::corked_requests(), 0);
    let mut answered: Vec<u8> = (0..12)
        .map(|_| {
            let (i, outcome) = done_rx.recv_timeout(Duration::from_secs(5)).unwrap();
            outcome.unwrap();
            i
        })
        .collect();
    answered.sort();
    assert_eq!(answered, (0..12).collect::<Vec<u8>>());
    assert_eq!(recorder.sets.lock().last().unwrap().1, "after");
}

#[test]
fn corked_requests_on_a_link_that_closed_fail_once_each() {
    let secret = Secret::generate().unwrap();
    let (_recorder, server, handler) = server(secret, ControlConfig::default());
    let link = connect_as(&server, 5, secret).unwrap();
    let (done_tx, done_rx) = crossbeam_channel::unbounded();
    let request = |i: usize| {
        let done_tx = done_tx.clone();
        link.set_async(
            &format!("lost{i}"),
            b"x",
            Box::new(move |outcome| done_tx.send(outcome).unwrap()),
        );
    };
    let held = cork();
    // Corked before the peer went: the link's reader fails them when it
    // sees the close.
    (0..3).for_each(request);
    drop(server);
    drop(handler);
    eventually("the link notices its peer is gone", || link.is_broken());
    // Corked after: only the failed write of the cork can fail them.
    (3..5).for_each(request);
    drop(held);
    for _ in 0..5 {
        let err = done_rx
            .recv_timeout(Duration::from_secs(5))
            .unwrap()
            .unwrap_err();
        assert_eq!(err.code, Code::Unavailable, "{err}");
    }
    drop(link);
    // Its drop answers whatever still waits: nothing is answered twice.
    assert!(done_rx.try_recv().is_err());
}

/// A man in the middle on loopback TCP between one link and `target`: it
/// records every byte each way and passes it on, flipping the byte at
/// `flip` (counted from the first byte the client sends) when asked.
struct Wire {
    address: std::net::SocketAddr,
    seen: Arc<Mutex<Vec<u8>>>,
    pumps: Vec<std::thread::JoinHandle<()>>,
}

impl Wire {
    fn between(target: std::net::SocketAddr, flip: Option<usize>) -> Wire {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let recorded = seen.clone();
        let accept = std::thread::spawn(move || {
            let (client, _) = listener.accept().unwrap();
            let server = std::net::TcpStream::connect(target).unwrap();
            let pump = |mut from: std::net::TcpStream,
                        mut to: std::net::TcpStream,
                        flip: Option<usize>,
                        seen: Arc<Mutex<Vec<u8>>>| {
                std::thread::spawn(move || {
                    use std::io::Read;
                    let mut at = 0usize;
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = from.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        if let Some(flip) = flip.filter(|f| (at..at + n).contains(f)) {
                            buf[flip - at] ^= 0x40;
                        }
                        at += n;
                        seen.lock().extend_from_slice(&buf[..n]);
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(std::net::Shutdown::Both);
                })
            };
            let up = pump(
                client.try_clone().unwrap(),
                server.try_clone().unwrap(),
                flip,
                recorded.clone(),
            );
            let down = pump(server, client, None, recorded);
            up.join().unwrap();
            down.join().unwrap();
        });
        Wire {
            address,
            seen,
            pumps: vec![accept],
        }
    }

    /// A link from process 9 to `server` through this wire.
    fn link(&self, server: &ControlServer, secret: Secret) -> Arc<ControlLink> {
        let endpoint = ControlEndpoint {
            unix_name: server.endpoint().unix_name.clone(),
            tcp: self.address,
        };
        ControlLink::connect(3, &endpoint, false, 9, secret, Duration::from_secs(5), None).unwrap()
    }

    fn contains(&self, needle: &[u8]) -> bool {
        self.seen.lock().windows(needle.len()).any(|w| w == needle)
    }
}

impl Drop for Wire {
    fn drop(&mut self) {
        // The pumps end when either side closes.
        for pump in self.pumps.drain(..) {
            let _ = pump.join();
        }
    }
}

#[test]
fn an_observer_on_the_wire_reads_no_key_value_or_secret() {
    let secret = Secret::generate().unwrap();
    let (recorder, server, _handler) = server(secret, ControlConfig::default());
    let wire = Wire::between(server.endpoint().tcp, None);
    let link = wire.link(&server, secret);
    let key = "crosshost/desc/0123456789abcdef.d0-2/7/0";
    let value = b"token=SEKRIT-TOKEN-BYTES nonce=0xfeedface";
    link.set(key, value).unwrap();
    link.delete(key).unwrap();
    assert_eq!(
        recorder.sets.lock().as_slice(),
        &[(9, key.to_string(), value.to_vec())]
    );
    drop(link);
    drop(server);
    assert!(wire.seen.lock().len() > 100, "the wire carried the link");
    for needle in [
        key.as_bytes(),
        &value[..],
        b"SEKRIT",
        &secret.0[..],
        &secret.0[..8],
    ] {
        assert!(
            !wire.contains(needle),
            "an observer read {:?} on the wire",
            String::from_utf8_lossy(needle)
        );
    }
}

#[test]
fn a_byte_altered_on_the_wire_breaks_the_link_and_reaches_no_handler() {
    let secret = Secret::generate().unwrap();
    let (recorder, server, _handler) = server(secret, ControlConfig::default());
    // The client's handshake is HELLO (49 bytes) then PROOF (45): byte 120
    // lies in the first sealed frame after it.
    let wire = Wire::between(server.endpoint().tcp, Some(120));
    let link = wire.link(&server, secret);
    let error = link
        .set("crosshost/desc/0123456789abcdef.d0-2/7/0", &[7u8; 64])
        .unwrap_err();
    assert_eq!(error.code, Code::Unavailable, "{error}");
    assert!(
        recorder.sets.lock().is_empty(),
        "an altered frame was applied"
    );
    drop(link);
    drop(server);
}

#[test]
fn a_server_that_does_not_know_the_secret_is_refused_by_the_client() {
    let (_recorder, server, _handler) =
        server(Secret::generate().unwrap(), ControlConfig::default());
    let error = connect_as(&server, 4, Secret::generate().unwrap()).unwrap_err();
    assert_eq!(error.code, Code::Unauthenticated, "{error}");
    assert!(error.message.contains("does not know"), "{error}");
}

#[test]
fn the_links_a_process_serves_and_makes_are_all_read_by_its_one_poller() {
    let secret = Secret::generate().unwrap();
    let threads = LinkThreads::start().unwrap();
    let recorder = Arc::new(Recorder::default());
    let handler: Arc<dyn ControlHandler> = recorder.clone();
    let server = ControlServer::start_sharing(
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        secret,
        Arc::downgrade(&handler),
        ControlConfig::default(),
        threads.poller.clone(),
    )
    .unwrap();
    let links: Vec<Arc<ControlLink>> = (0..40)
        .map(|i| {
            ControlLink::connect_sharing(
                0,
                server.endpoint(),
                i % 2 == 0,
                i,
                secret,
                Duration::from_secs(5),
                None,
                &threads,
            )
            .unwrap()
        })
        .collect();
    for (i, link) in links.iter().enumerate() {
        link.set(&format!("k{i}"), b"v").unwrap();
    }
    assert_eq!(recorder.sets.lock().len(), 40);
    // Each link twice: the end this process made and the end it serves.
    assert_eq!(threads.poller.link_count(), 80);
    assert_eq!(server.link_count(), 40);
    // Closed in order (BYE): not a death. Then dropped.
    for link in &links {
        crate::transport::connections::Connection::close(&**link);
    }
    eventually("the served ends closed", || server.link_count() == 0);
    assert!(
        recorder.closed.lock().is_empty(),
        "an idle close is not a death"
    );
    drop(links);
    eventually("every link left the poller", || {
        threads.poller.link_count() == 0
    });
}
