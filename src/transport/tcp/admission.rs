//! The TCP receive server's front door: one thread accepts connections and,
//! with poll(2) over nonblocking sockets, reads each one's fixed-size
//! request header under a single deadline (counted from accept, or from the
//! answer to the connection's previous request), then authenticates it by
//! claiming its token. A small payload, which its sender writes with the
//! header, is landed and answered here without waiting (no hand-off, one
//! wake-up less); a larger one is handed to a payload handler. Every refused
//! request is answered and its connection closed here. After an OK answer a
//! connection (a handler gives it back) waits here for its next request,
//! under the same deadline as a new one.
//!
//! So an unauthenticated peer, however slow or silent, costs one slot of a
//! bounded table for at most `header_deadline` and never a handler thread,
//! and nothing here blocks, so it never delays accepting or authenticating
//! anyone else. When the table is full the entry nearest its deadline is
//! closed to make room: a legitimate sender writes its header right after
//! connecting, so to evict it a flood must fill the whole table within that
//! round trip, whereas refusing newcomers would let a slow trickle of
//! connections (the table size per `header_deadline`) lock everybody out. A
//! sender whose idle connection was closed so sends on a new one.
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use once_cell::sync::OnceCell;

use super::landing::{landed, Claim};
use super::server_config::TcpServerConfig;
use super::socket::recv_now_into;
use super::wire::{
    encode_refusal, encode_response, RequestHeader, COALESCED_PAYLOAD_BYTES, REQUEST_HEADER_LEN,
};
use crate::status::{self, Status};
use crate::transport::poll::poll;
use crate::transport::registry::{DestinationRegistry, ReceiptSink};

/// How long accepting pauses after an accept error such as running out of
/// descriptors, instead of spinning on a listener that stays readable.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);
/// Connections accepted per poll round, so a flood of connects cannot
/// starve the connections already waiting.
const ACCEPTS_PER_ROUND: usize = 64;
/// Bytes of a refused request's payload discarded per connection and round.
const DISCARD_CHUNK: usize = 64 << 10;
const DISCARD_CHUNKS_PER_ROUND: usize = 16;

/// An authenticated connection whose payload a handler receives. The
/// stream is blocking again, with the configured I/O timeouts.
pub(super) struct Admitted {
    pub stream: TcpStream,
    pub peer: SocketAddr,
    pub claim: Claim,
}

/// A connection a handler answered OK, and its peer.
type Answered = (TcpStream, SocketAddr);

/// Where handlers give back a connection they answered OK, for its next
/// request.
#[derive(Clone)]
pub(super) struct Rejoin {
    queue: Sender<Answered>,
    /// A byte written here wakes the front door.
    wake: Arc<UnixStream>,
}

impl Rejoin {
    /// The handlers' end and the front door's (the queue, and the socket
    /// that turns readable when something is queued).
    pub(super) fn pair() -> io::Result<(Rejoin, Receiver<Answered>, UnixStream)> {
        let (wake, woken) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        woken.set_nonblocking(true)?;
        let (queue, queued) = crossbeam_channel::unbounded();
        let rejoin = Rejoin {
            queue,
            wake: Arc::new(wake),
        };
        Ok((rejoin, queued, woken))
    }

    /// Hands `stream` back; dropped (closed) if the front door is gone.
    pub(super) fn give_back(&self, stream: TcpStream, peer: SocketAddr) {
        if self.queue.send((stream, peer)).is_ok() {
            // A full socket already holds a wake-up: nothing is lost.
            let _ = (&*self.wake).write(&[1]);
        }
    }
}

enum Stage {
    /// Reading the request header.
    Header {
        bytes: [u8; REQUEST_HEADER_LEN],
        filled: usize,
    },
    /// Authenticated with a small payload: landing it here.
    Payload { claim: Claim, received: usize },
    /// Writing the answer. A refusal then discards up to `discard_left`
    /// payload bytes so the sender gets to read the answer rather than a
    /// connection reset, and closes; an OK answer makes the connection
    /// wait for its next request.
    Answering {
        answer: Vec<u8>,
        written: usize,
        discard_left: u64,
        next_request: bool,
    },
}

impl Stage {
    /// Before a request's first byte.
    fn awaiting_header() -> Stage {
        Stage::Header {
            bytes: [0u8; REQUEST_HEADER_LEN],
            filled: 0,
        }
    }
}

struct Waiting {
    stream: TcpStream,
    peer: SocketAddr,
    /// Counted from accept, or from the answer to the previous request;
    /// renewed when a small payload is authenticated. Covers the header,
    /// authentication and the answer (for a refused request the
    /// discarding too).
    deadline: Instant,
    stage: Stage,
}

enum Verdict {
    Keep,
    Close,
    /// To a handler, which receives the payload.
    Admit(Claim),
}

pub(super) struct Admission {
    listener: TcpListener,
    /// Readable (end of file) once the server starts shutting down.
    wake: UnixStream,
    stopping: Arc<AtomicBool>,
    registry: Arc<DestinationRegistry>,
    config: TcpServerConfig,
    admitted: Sender<Admitted>,
    /// Connections the handlers answered, and the socket that says so.
    rejoined: Receiver<Answered>,
    rejoin_wake: UnixStream,
    sink: Arc<OnceCell<ReceiptSink>>,
    accepted: Arc<AtomicU64>,
    /// Roughly oldest first (an answered connection goes to the back with a
    /// new deadline); nothing relies on the order.
    waiting: VecDeque<Waiting>,
    accept_paused_until: Option<Instant>,
    scratch: Box<[u8]>,
}

impl Admission {
    /// `listener` must already be nonblocking; `rejoined` and
    /// `rejoin_wake` are the front door's end of `Rejoin::pair`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        listener: TcpListener,
        wake: UnixStream,
        stopping: Arc<AtomicBool>,
        registry: Arc<DestinationRegistry>,
        config: TcpServerConfig,
        admitted: Sender<Admitted>,
        (rejoined, rejoin_wake): (Receiver<Answered>, UnixStream),
        sink: Arc<OnceCell<ReceiptSink>>,
        accepted: Arc<AtomicU64>,
    ) -> Admission {
        Admission {
            listener,
            wake,
            stopping,
            registry,
            config,
            admitted,
            rejoined,
            rejoin_wake,
            sink,
            accepted,
            waiting: VecDeque::new(),
            accept_paused_until: None,
            scratch: vec![0u8; DISCARD_CHUNK].into_boxed_slice(),
        }
    }

    /// Runs until the server shuts down; dropping `self` then closes every
    /// connection still waiting and lets the handlers finish their queue.
    pub(super) fn run(mut self) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        loop {
            if self.stopping.load(Ordering::SeqCst) {
                return;
            }
            let now = Instant::now();
            self.expire(now);
            if self.accept_paused_until.is_some_and(|until| until <= now) {
                self.accept_paused_until = None;
            }
            let accepting = self.accept_paused_until.is_none();

            fds.clear();
            fds.push(pollfd(self.wake.as_raw_fd(), libc::POLLIN));
            fds.push(pollfd(self.rejoin_wake.as_raw_fd(), libc::POLLIN));
            if accepting {
                fds.push(pollfd(self.listener.as_raw_fd(), libc::POLLIN));
            }
            let first_waiting = fds.len();
            fds.extend(
                self.waiting
                    .iter()
                    .map(|entry| pollfd(entry.stream.as_raw_fd(), interest(&entry.stage))),
            );
            let wake_at = [
                self.waiting.iter().map(|entry| entry.deadline).min(),
                self.accept_paused_until,
            ]
            .into_iter()
            .flatten()
            .min();
            if let Err(error) = poll(
                &mut fds,
                wake_at.map(|at| at.saturating_duration_since(now)),
            ) {
                log::warn!("TCP transfer server poll failed: {error}");
                std::thread::sleep(ACCEPT_BACKOFF);
                continue;
            }
            if fds[0].revents != 0 {
                // The server dropped the other end: shutting down.
                return;
            }

            // Existing connections first: accepting may evict some of them
            // and so shift the indices that `fds` refers to.
            let ready: Vec<bool> = fds[first_waiting..]
                .iter()
                .map(|fd| fd.revents != 0)
                .collect();
            if ready.iter().any(|&ready| ready) {
                let entries = std::mem::take(&mut self.waiting);
                for (mut entry, ready) in entries.into_iter().zip(ready) {
                    let verdict = if ready {
                        self.advance(&mut entry)
                    } else {
                        Verdict::Keep
                    };
                    self.settle(entry, verdict);
                }
            }
            if fds[1].revents != 0 {
                self.take_back_answered();
            }
            if accepting && fds[2].revents != 0 {
                self.accept_ready();
            }
        }
    }

    /// Closes the connections whose deadline has passed.
    fn expire(&mut self, now: Instant) {
        let deadline = self.config.header_deadline;
        self.waiting.retain(|entry| {
            if entry.deadline > now {
                return true;
            }
            let what = match &entry.stage {
                Stage::Header { filled, .. } => {
                    format!("sent {filled} of {REQUEST_HEADER_LEN} request header bytes")
                }
                Stage::Payload { claim, received } => {
                    format!("sent {received} of {} payload bytes", claim.length)
                }
                Stage::Answering {
                    next_request: false,
                    ..
                } => "was still being refused".into(),
                Stage::Answering { .. } => "was still being answered".into(),
            };
            log::debug!(
                "closing TCP transfer connection from {}: it {what} after the {deadline:?} deadline",
                entry.peer,
            );
            if let Stage::Payload { claim, received } = &entry.stage {
                // Its sender waits for an answer: say why, if the socket
                // takes it now (it has room for an answer this small).
                let verdict = status::deadline_exceeded(format!(
                    "receiver timed out waiting for payload bytes ({received} of {} after {deadline:?})",
                    claim.length
                ));
                let _ = (&entry.stream).write(&encode_refusal(verdict));
            }
            false
        });
    }

    /// Connections a handler answered OK wait here for their next request.
    fn take_back_answered(&mut self) {
        let mut drained = [0u8; 64];
        while matches!((&self.rejoin_wake).read(&mut drained), Ok(count) if count > 0) {}
        while let Ok((stream, peer)) = self.rejoined.try_recv() {
            if let Err(error) = stream.set_nonblocking(true) {
                log::debug!("closing the TCP transfer connection from {peer}: {error}");
                continue;
            }
            let entry = self.waiting_for_request(stream, peer);
            self.admit_entry(entry);
        }
    }

    fn waiting_for_request(&self, stream: TcpStream, peer: SocketAddr) -> Waiting {
        Waiting {
            stream,
            peer,
            deadline: Instant::now() + self.config.header_deadline,
            stage: Stage::awaiting_header(),
        }
    }

    fn accept_ready(&mut self) {
        for _ in 0..ACCEPTS_PER_ROUND {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    self.accepted.fetch_add(1, Ordering::Relaxed);
                    self.welcome(stream, peer)
                }
                Err(error) => match error.kind() {
                    io::ErrorKind::WouldBlock => return,
                    io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted => {}
                    _ => {
                        // Out of descriptors and similar: back off instead
                        // of spinning; waiting connections still progress.
                        log::warn!("TCP transfer server accept failed: {error}");
                        self.accept_paused_until = Some(Instant::now() + ACCEPT_BACKOFF);
                        return;
                    }
                },
            }
        }
    }

    fn welcome(&mut self, stream: TcpStream, peer: SocketAddr) {
        log::debug!("TCP transfer connection from {peer}");
        if let Err(error) = stream.set_nonblocking(true) {
            log::warn!("cannot make the TCP transfer connection from {peer} nonblocking: {error}");
            return;
        }
        let entry = self.waiting_for_request(stream, peer);
        self.admit_entry(entry);
    }

    /// A new or answered connection: its request often is there already,
    /// so it is read now rather than at the next poll round; if it must
    /// wait, it takes a slot of the table.
    fn admit_entry(&mut self, mut entry: Waiting) {
        let verdict = self.advance(&mut entry);
        if matches!(verdict, Verdict::Keep)
            && self.waiting.len() >= self.config.max_pending_connections
        {
            let nearest = self
                .waiting
                .iter()
                .enumerate()
                .min_by_key(|(_, entry)| entry.deadline)
                .map(|(index, _)| index);
            if let Some(evicted) = nearest.and_then(|index| self.waiting.remove(index)) {
                log::debug!(
                    "closing unauthenticated TCP transfer connection from {}: {} connections are already waiting",
                    evicted.peer,
                    self.config.max_pending_connections
                );
            }
        }
        self.settle(entry, verdict);
    }

    fn settle(&mut self, entry: Waiting, verdict: Verdict) {
        match verdict {
            Verdict::Keep => self.waiting.push_back(entry),
            Verdict::Close => {}
            Verdict::Admit(claim) => self.hand_off(entry, claim),
        }
    }

    /// Makes what progress the socket allows without blocking.
    fn advance(&mut self, entry: &mut Waiting) -> Verdict {
        let Waiting {
            stream,
            peer,
            stage,
            deadline,
        } = entry;
        loop {
            match stage {
                Stage::Header { bytes, filled } => {
                    while *filled < REQUEST_HEADER_LEN {
                        match (&*stream).read(&mut bytes[*filled..]) {
                            Ok(0) => {
                                if *filled > 0 {
                                    log::debug!(
                                        "TCP transfer connection from {peer} closed after {filled} of {REQUEST_HEADER_LEN} request header bytes"
                                    );
                                }
                                return Verdict::Close;
                            }
                            Ok(count) => *filled += count,
                            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                                return Verdict::Keep;
                            }
                            Err(error) => {
                                log::debug!(
                                    "reading the TCP transfer request from {peer} failed: {error}"
                                );
                                return Verdict::Close;
                            }
                        }
                    }
                    match self.authenticate(bytes) {
                        Ok(claim)
                            if claim.length <= COALESCED_PAYLOAD_BYTES
                                && claim.destination.staged().is_none() =>
                        {
                            // Its sender wrote it with the header: it has the
                            // deadline a new header would have.
                            *deadline = Instant::now() + self.config.header_deadline;
                            *stage = Stage::Payload { claim, received: 0 };
                        }
                        // Larger payloads, and every staged one (its
                        // pipeline blocks), go to a handler.
                        Ok(claim) => return Verdict::Admit(claim),
                        Err((verdict, discard)) => {
                            log::warn!("refusing TCP transfer from {peer}: {verdict}");
                            *stage = Stage::Answering {
                                answer: encode_refusal(verdict),
                                written: 0,
                                discard_left: discard,
                                next_request: false,
                            };
                        }
                    }
                }
                Stage::Payload { claim, received } => {
                    while *received < claim.length {
                        // SAFETY: `authenticate` checked `offset + length <=
                        // destination.len()` and `received < length`, so the
                        // range written lies inside the destination, whose
                        // memory the claim's `Arc` keeps valid and writable
                        // under the `WritableDestination` contract; no Rust
                        // reference covers that memory.
                        let got = unsafe {
                            let target =
                                claim.destination.as_mut_ptr().add(claim.offset + *received);
                            recv_now_into(stream, target, claim.length - *received)
                        };
                        match got {
                            Ok(0) => {
                                // The token stays spent, like any transfer
                                // that failed after claiming it.
                                log::warn!(
                                    "TCP transfer from {peer} closed after {received} of {} payload bytes",
                                    claim.length
                                );
                                return Verdict::Close;
                            }
                            Ok(count) => *received += count,
                            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                                return Verdict::Keep;
                            }
                            Err(error) => {
                                log::warn!("TCP transfer from {peer} failed: {error}");
                                return Verdict::Close;
                            }
                        }
                    }
                    let answer = encode_response(&landed(claim, &self.sink));
                    *stage = Stage::Answering {
                        answer,
                        written: 0,
                        discard_left: 0,
                        next_request: true,
                    };
                }
                Stage::Answering {
                    answer,
                    written,
                    discard_left,
                    next_request,
                } => {
                    while *written < answer.len() {
                        match (&*stream).write(&answer[*written..]) {
                            Ok(0) => return Verdict::Close,
                            Ok(count) => *written += count,
                            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                            Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                            Err(_) => return Verdict::Close,
                        }
                    }
                    let mut chunks = 0;
                    while *discard_left > 0 && chunks < DISCARD_CHUNKS_PER_ROUND {
                        let want = (*discard_left).min(self.scratch.len() as u64) as usize;
                        match (&*stream).read(&mut self.scratch[..want]) {
                            // The sender has nothing more to send.
                            Ok(0) => *discard_left = 0,
                            Ok(count) => *discard_left -= count as u64,
                            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                            Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                            Err(_) => return Verdict::Close,
                        }
                        chunks += 1;
                    }
                    if *written < answer.len() || *discard_left > 0 {
                        return Verdict::Keep;
                    }
                    if !*next_request {
                        return Verdict::Close;
                    }
                    *deadline = Instant::now() + self.config.header_deadline;
                    *stage = Stage::awaiting_header();
                }
            }
        }
    }

    /// Decodes a complete header and claims its destination. `Err` is the
    /// refusal to send and how many payload bytes to discard after it.
    fn authenticate(
        &self,
        bytes: &[u8; REQUEST_HEADER_LEN],
    ) -> std::result::Result<Claim, (Status, u64)> {
        // Not our protocol: answer without reading further.
        let header = RequestHeader::decode(bytes).map_err(|error| (error, 0))?;
        let discard = header.length.min(self.config.max_discard_bytes);
        // A range outside the destination claims nothing: the rightful
        // sender may still use the token.
        let claimed = self
            .registry
            .claim_part(&header.token, 0, 1, header.offset, header.length)
            .map_err(|refusal| (refusal, discard))?;
        // Both fit in usize: their sum is at most `destination.len()`.
        Ok(Claim {
            destination: claimed.destination,
            offset: header.offset as usize,
            length: header.length as usize,
            landing: claimed.landing,
            receipt: header.receipt,
        })
    }

    fn hand_off(&self, entry: Waiting, claim: Claim) {
        let Waiting { stream, peer, .. } = entry;
        if let Err(error) = prepare_for_payload(&stream, &self.config) {
            // The token stays spent, like any transfer that failed after
            // claiming it.
            log::warn!("cannot configure the TCP transfer connection from {peer}: {error}");
            return;
        }
        let admitted = Admitted {
            stream,
            peer,
            claim,
        };
        // The queue is unbounded on purpose: only a sender holding a
        // registered token gets here, once per token, so its length is
        // bounded by the receives this process posted, and a full queue must
        // never stall the front door. It fails only when the handlers are
        // gone, that is while shutting down.
        let _ = self.admitted.send(admitted);
    }
}

/// Back to blocking reads and writes, each bounded by `io_timeout`, for the
/// payload handler.
fn prepare_for_payload(stream: &TcpStream, config: &TcpServerConfig) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(config.io_timeout))?;
    stream.set_write_timeout(Some(config.io_timeout))?;
    Ok(())
}

fn interest(stage: &Stage) -> libc::c_short {
    match stage {
        Stage::Header { .. } | Stage::Payload { .. } => libc::POLLIN,
        Stage::Answering {
            answer,
            written,
            discard_left,
            ..
        } => {
            let mut events = 0;
            if *written < answer.len() {
                events |= libc::POLLOUT;
            }
            if *discard_left > 0 {
                events |= libc::POLLIN;
            }
            events
        }
    }
}

fn pollfd(fd: std::os::fd::RawFd, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}
