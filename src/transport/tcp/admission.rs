//! The TCP receive server's front door: one thread accepts connections and,
//! with poll(2) over nonblocking sockets, reads each one's fixed-size
//! request header under a single deadline counted from accept, then
//! authenticates it by claiming its token. Only a connection that claimed a
//! registered destination (and asks for a write inside it) is handed to a
//! payload handler; every other one is answered and closed here.
//!
//! So an unauthenticated peer, however slow or silent, costs one slot of a
//! bounded table for at most `header_deadline` and never a handler thread,
//! and nothing here blocks, so it never delays accepting or authenticating
//! anyone else. When the table is full the oldest entry is closed to make
//! room: a legitimate sender writes its header right after connecting, so to
//! evict it a flood must fill the whole table within that round trip,
//! whereas refusing newcomers would let a slow trickle of connections (the
//! table size per `header_deadline`) lock everybody out.
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use super::server_config::TcpServerConfig;
use super::socket::set_large_buffers;
use super::wire::{encode_response, RequestHeader, REQUEST_HEADER_LEN};
use crate::status::{self, Status};
use crate::transport::destination::WritableDestination;
use crate::transport::poll::poll;
use crate::transport::registry::DestinationRegistry;

/// How long accepting pauses after an accept error such as running out of
/// descriptors, instead of spinning on a listener that stays readable.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);
/// Connections accepted per poll round, so a flood of connects cannot
/// starve the connections already waiting.
const ACCEPTS_PER_ROUND: usize = 64;
/// Bytes of a refused request's payload discarded per connection and round.
const DISCARD_CHUNK: usize = 64 << 10;
const DISCARD_CHUNKS_PER_ROUND: usize = 16;

/// An authenticated connection: its token claimed `destination`, and
/// `offset + length` lies inside it. The stream is blocking again, with the
/// configured I/O timeouts.
pub(super) struct Admitted {
    pub stream: TcpStream,
    pub peer: SocketAddr,
    pub destination: Arc<dyn WritableDestination>,
    pub offset: usize,
    pub length: usize,
}

enum Stage {
    /// Reading the request header.
    Header {
        bytes: [u8; REQUEST_HEADER_LEN],
        filled: usize,
    },
    /// Refused: writing the answer, then discarding up to `discard_left`
    /// payload bytes so the sender gets to read the answer rather than a
    /// connection reset.
    Refusing {
        answer: Vec<u8>,
        written: usize,
        discard_left: u64,
    },
}

struct Waiting {
    stream: TcpStream,
    peer: SocketAddr,
    /// Counted from accept; covers the header, authentication and, for a
    /// refused request, the answer and the discarding.
    deadline: Instant,
    stage: Stage,
}

enum Verdict {
    Keep,
    Close,
    Admit {
        destination: Arc<dyn WritableDestination>,
        offset: usize,
        length: usize,
    },
}

pub(super) struct Admission {
    listener: TcpListener,
    /// Readable (end of file) once the server starts shutting down.
    wake: UnixStream,
    stopping: Arc<AtomicBool>,
    registry: Arc<DestinationRegistry>,
    config: TcpServerConfig,
    admitted: Sender<Admitted>,
    /// Oldest first; all deadlines are accept time plus the same duration,
    /// so this is also nearest deadline first.
    waiting: VecDeque<Waiting>,
    accept_paused_until: Option<Instant>,
    scratch: Box<[u8]>,
}

impl Admission {
    /// `listener` must already be nonblocking.
    pub(super) fn new(
        listener: TcpListener,
        wake: UnixStream,
        stopping: Arc<AtomicBool>,
        registry: Arc<DestinationRegistry>,
        config: TcpServerConfig,
        admitted: Sender<Admitted>,
    ) -> Admission {
        Admission {
            listener,
            wake,
            stopping,
            registry,
            config,
            admitted,
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
                self.waiting.front().map(|entry| entry.deadline),
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
            if accepting && fds[1].revents != 0 {
                self.accept_ready();
            }
        }
    }

    /// Closes the connections whose deadline has passed.
    fn expire(&mut self, now: Instant) {
        while let Some(entry) = self.waiting.front() {
            if entry.deadline > now {
                break;
            }
            let entry = self.waiting.pop_front().expect("front exists");
            let what = match entry.stage {
                Stage::Header { filled, .. } => {
                    format!("sent {filled} of {REQUEST_HEADER_LEN} request header bytes")
                }
                Stage::Refusing { .. } => "was still being refused".into(),
            };
            log::debug!(
                "closing TCP transfer connection from {}: it {what} after the {:?} header deadline",
                entry.peer,
                self.config.header_deadline
            );
        }
    }

    fn accept_ready(&mut self) {
        for _ in 0..ACCEPTS_PER_ROUND {
            match self.listener.accept() {
                Ok((stream, peer)) => self.welcome(stream, peer),
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
        let mut entry = Waiting {
            stream,
            peer,
            deadline: Instant::now() + self.config.header_deadline,
            stage: Stage::Header {
                bytes: [0u8; REQUEST_HEADER_LEN],
                filled: 0,
            },
        };
        // The header often arrived with the connection: no need to wait
        // for the next poll round.
        let verdict = self.advance(&mut entry);
        if matches!(verdict, Verdict::Keep)
            && self.waiting.len() >= self.config.max_pending_connections
        {
            if let Some(oldest) = self.waiting.pop_front() {
                log::debug!(
                    "closing unauthenticated TCP transfer connection from {}: {} connections are already waiting",
                    oldest.peer,
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
            Verdict::Admit {
                destination,
                offset,
                length,
            } => self.hand_off(entry, destination, offset, length),
        }
    }

    /// Makes what progress the socket allows without blocking.
    fn advance(&mut self, entry: &mut Waiting) -> Verdict {
        let Waiting {
            stream,
            peer,
            stage,
            ..
        } = entry;
        loop {
            match stage {
                Stage::Header { bytes, filled } => {
                    while *filled < REQUEST_HEADER_LEN {
                        match (&*stream).read(&mut bytes[*filled..]) {
                            Ok(0) => {
                                log::debug!(
                                    "TCP transfer connection from {peer} closed after {filled} of {REQUEST_HEADER_LEN} request header bytes"
                                );
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
                        Ok(verdict) => return verdict,
                        Err((verdict, discard)) => {
                            log::warn!("refusing TCP transfer from {peer}: {verdict}");
                            *stage = Stage::Refusing {
                                answer: encode_response(&Err(verdict)),
                                written: 0,
                                discard_left: discard,
                            };
                        }
                    }
                }
                Stage::Refusing {
                    answer,
                    written,
                    discard_left,
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
                    return if *written == answer.len() && *discard_left == 0 {
                        Verdict::Close
                    } else {
                        Verdict::Keep
                    };
                }
            }
        }
    }

    /// Decodes a complete header and claims its destination. `Err` is the
    /// refusal to send and how many payload bytes to discard after it.
    fn authenticate(
        &self,
        bytes: &[u8; REQUEST_HEADER_LEN],
    ) -> std::result::Result<Verdict, (Status, u64)> {
        // Not our protocol: answer without reading further.
        let header = RequestHeader::decode(bytes).map_err(|error| (error, 0))?;
        let discard = header.length.min(self.config.max_discard_bytes);
        let Some(destination) = self.registry.claim(&header.token) else {
            return Err((
                status::unauthenticated(
                    "no destination is registered for this auth token (unknown, or the receive already completed or was cancelled)",
                ),
                discard,
            ));
        };
        let end = header.offset.checked_add(header.length);
        if end.is_none_or(|end| end > destination.len() as u64) {
            let message = format!(
                "write of {} bytes at offset {} exceeds the {}-byte destination",
                header.length,
                header.offset,
                destination.len()
            );
            // Nothing was written: the rightful sender may still use the token.
            self.registry.restore(header.token, destination);
            return Err((status::out_of_range(message), discard));
        }
        // Both fit in usize: their sum is at most `destination.len()`.
        Ok(Verdict::Admit {
            destination,
            offset: header.offset as usize,
            length: header.length as usize,
        })
    }

    fn hand_off(
        &self,
        entry: Waiting,
        destination: Arc<dyn WritableDestination>,
        offset: usize,
        length: usize,
    ) {
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
            destination,
            offset,
            length,
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
    set_large_buffers(stream);
    Ok(())
}

fn interest(stage: &Stage) -> libc::c_short {
    match stage {
        Stage::Header { .. } => libc::POLLIN,
        Stage::Refusing {
            answer,
            written,
            discard_left,
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
