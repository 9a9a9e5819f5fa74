//! A control link to one peer: pipelined requests, each answered by an ack
//! that the process's link poller (`poller.rs`) hands to the waiting
//! request.
use std::collections::HashMap;
use std::io::{self, Write};
use std::net::TcpStream;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Sender};
use parking_lot::Mutex;

use crate::status::{self, Code, Result, Status};
use crate::sync::{DeadlineTimer, TimerId};
use crate::transport::connections::Connection;
use crate::transport::random::fill_random;

use super::cork::{self, cork, Cork};
use super::frame::*;
use super::poller::{Next, Nonblocking, Poller, Readable, Token};
use super::sealing::{proof_matches, LinkKeys, SealedStream, NONCE_LEN, PROOF_LEN};
use super::secret::*;
use super::ControlEndpoint;

/// Who waits for a request's ack.
enum Waiter {
    Blocking(Sender<Result<()>>),
    Callback(Box<dyn FnOnce(Result<()>) + Send>, Option<TimerId>),
}

impl Waiter {
    fn complete(self, outcome: Result<()>, timer: &DeadlineTimer) {
        match self {
            Waiter::Blocking(sender) => {
                let _ = sender.send(outcome);
            }
            Waiter::Callback(done, deadline) => {
                if let Some(id) = deadline {
                    timer.cancel(id);
                }
                done(outcome);
            }
        }
    }
}

type Waiters = Arc<Mutex<HashMap<u64, Waiter>>>;

/// What the links of one process share, so that its threads do not grow
/// with its peers: the timer bounding their requests' waits and the poller
/// reading their acks (and serving the links its peers made).
#[derive(Clone)]
pub struct LinkThreads {
    pub timer: Arc<DeadlineTimer>,
    pub poller: Arc<Poller>,
}

impl LinkThreads {
    pub fn start() -> Result<LinkThreads> {
        Ok(LinkThreads {
            timer: Arc::new(DeadlineTimer::new("crosshost-ctl-deadline")),
            poller: Poller::start("crosshost-ctl-poll")?,
        })
    }
}

/// One process's link to a peer: requests pipelined on one connection, acks
/// read by the process's poller.
pub struct ControlLink {
    peer: u32,
    writer: Mutex<Box<dyn Stream>>,
    waiters: Waiters,
    /// Bounds the asynchronous requests' waits.
    timer: Arc<DeadlineTimer>,
    next_id: AtomicU64,
    broken: Arc<AtomicBool>,
    /// Set before `Drop` shuts the connection down.
    dropping: Arc<AtomicBool>,
    /// Told once when the peer's end closed (reader or writer noticed).
    on_closed: Option<LinkClosed>,
    reported: Arc<AtomicBool>,
    timeout: Duration,
    poller: Arc<Poller>,
    /// The acks' reader, while the poller reads it.
    reading: Mutex<Option<Token>>,
}

/// Called with the peer when its end of a link closed (it exited or died).
pub type LinkClosed = Arc<dyn Fn(u32) + Send + Sync>;

/// Tells `on_closed` once that `peer`'s end closed, unless we are the ones
/// closing the link.
pub(super) fn report_closed(
    peer: u32,
    on_closed: &Option<LinkClosed>,
    dropping: &AtomicBool,
    reported: &AtomicBool,
) {
    if dropping.load(Ordering::Acquire) || reported.swap(true, Ordering::AcqRel) {
        return;
    }
    if let Some(on_closed) = on_closed {
        on_closed(peer);
    }
}

impl std::fmt::Debug for ControlLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ControlLink(to process {})", self.peer)
    }
}

impl ControlLink {
    /// Connects to `endpoint` (the Unix socket when `same_host`, else TCP)
    /// and authenticates as process `me`; the link has a timer and a poller
    /// of its own.
    pub fn connect(
        peer: u32,
        endpoint: &ControlEndpoint,
        same_host: bool,
        me: u32,
        secret: Secret,
        timeout: Duration,
        on_closed: Option<LinkClosed>,
    ) -> Result<Arc<ControlLink>> {
        let threads = LinkThreads::start()?;
        Self::connect_sharing(
            peer, endpoint, same_host, me, secret, timeout, on_closed, &threads,
        )
    }

    /// `connect`, with the timer and poller that the links of one process
    /// share.
    #[allow(clippy::too_many_arguments)]
    pub fn connect_sharing(
        peer: u32,
        endpoint: &ControlEndpoint,
        same_host: bool,
        me: u32,
        secret: Secret,
        timeout: Duration,
        on_closed: Option<LinkClosed>,
        threads: &LinkThreads,
    ) -> Result<Arc<ControlLink>> {
        let timer = threads.timer.clone();
        let unavailable = |e: io::Error| {
            if same_host {
                return status::unavailable(format!(
                    "control link to process {peer} on this host (Unix socket {}): {e}",
                    endpoint.unix_name
                ));
            }
            let tcp = endpoint.tcp;
            if e.kind() == io::ErrorKind::ConnectionRefused {
                // The host answered: nothing listens there (any more).
                return status::unavailable(format!(
                    "process {peer} does not answer at {tcp}, the address it advertised ({e}): it \
                     exited or destroyed its client"
                ));
            }
            status::unavailable(format!(
                "cannot reach process {peer} at {tcp}, the address it advertised, for its control link: \
                 {e}; if this host cannot reach {}, give process {peer} the create option \
                 advertise_address=<an address of its host that this host can reach> (from JAX: \
                 PJRT_CROSSHOST_CREATE_OPTIONS=advertise_address=...)",
                tcp.ip()
            ))
        };
        let mut stream: Box<dyn Stream> = if same_host {
            let addr =
                UnixAddr::from_abstract_name(endpoint.unix_name.as_bytes()).map_err(unavailable)?;
            Box::new(UnixStream::connect_addr(&addr).map_err(unavailable)?)
        } else {
            Box::new(TcpStream::connect_timeout(&endpoint.tcp, timeout).map_err(unavailable)?)
        };
        stream
            .set_timeouts(Some(timeout), Some(timeout))
            .map_err(unavailable)?;
        // The handshake proves the secret both ways without sending it
        // (`sealing.rs`); everything after it travels sealed.
        let deadline = Some(Instant::now() + timeout);
        let mut client_nonce = [0u8; NONCE_LEN];
        fill_random(&mut client_nonce).map_err(|e| status::internal(e.message))?;
        stream
            .write_all(&frame(OP_HELLO, 0, &[&client_nonce, &me.to_le_bytes()]))
            .map_err(unavailable)?;
        let keys = match read_frame(&mut *stream, deadline).map_err(unavailable)? {
            (OP_CHALLENGE, _, payload) if payload.len() == NONCE_LEN + PROOF_LEN => {
                let server_nonce: [u8; NONCE_LEN] =
                    payload[..NONCE_LEN].try_into().expect("a nonce");
                let keys = LinkKeys::derive(&secret, &client_nonce, &server_nonce, me);
                if !proof_matches(&keys.server_proof, &payload[NONCE_LEN..]) {
                    return Err(status::unauthenticated(format!(
                        "control link to process {peer}: the server at {} does not know this \
                         job's control secret (another job's process, or an impostor)",
                        if same_host {
                            endpoint.unix_name.clone()
                        } else {
                            endpoint.tcp.to_string()
                        }
                    )));
                }
                keys
            }
            (_, _, payload) => {
                return Err(status::unauthenticated(format!(
                    "control link to process {peer}: refused ({})",
                    String::from_utf8_lossy(payload.get(4..).unwrap_or_default())
                )))
            }
        };
        stream
            .write_all(&frame(OP_PROOF, 0, &[&keys.client_proof]))
            .map_err(unavailable)?;
        match read_frame(&mut *stream, deadline).map_err(unavailable)? {
            (OP_ACK, _, _) => {}
            (_, _, payload) => {
                return Err(status::unauthenticated(format!(
                    "control link to process {peer}: refused ({})",
                    String::from_utf8_lossy(payload.get(4..).unwrap_or_default())
                )))
            }
        }
        stream
            .set_timeouts(None, Some(timeout))
            .map_err(unavailable)?;
        let reader = stream.try_clone_box().map_err(unavailable)?;
        let fd = reader.raw_fd();
        let reader = keys.client_stream(Box::new(Nonblocking::new(reader)));
        let stream: Box<dyn Stream> = Box::new(keys.client_stream(stream));
        let link = Arc::new(ControlLink {
            peer,
            writer: Mutex::new(stream),
            waiters: Arc::default(),
            timer,
            next_id: AtomicU64::new(1),
            broken: Arc::new(AtomicBool::new(false)),
            dropping: Arc::new(AtomicBool::new(false)),
            on_closed: on_closed.clone(),
            reported: Arc::new(AtomicBool::new(false)),
            timeout,
            poller: threads.poller.clone(),
            reading: Mutex::new(None),
        });
        let acks = AckReader {
            peer,
            reader,
            frames: FrameReader::new(),
            burst: None,
            waiters: link.waiters.clone(),
            broken: link.broken.clone(),
            dropping: link.dropping.clone(),
            on_closed,
            reported: link.reported.clone(),
            timer: link.timer.clone(),
        };
        let token = threads.poller.add(fd, Box::new(acks))?;
        *link.reading.lock() = Some(token);
        Ok(link)
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    fn check_size(key: &str, value: &[u8]) -> Result<()> {
        if key.len() > u16::MAX as usize || key.len() + value.len() + 16 > MAX_FRAME {
            return Err(status::invalid_argument(format!(
                "control link: key or value too large ({} + {} bytes)",
                key.len(),
                value.len()
            )));
        }
        Ok(())
    }

    /// Sends a request whose ack goes to `waiter`; `corkable` (an
    /// asynchronous request) waits for the thread's cork, if it holds one.
    /// If it could not be written, the waiter comes back with the error
    /// (nobody will answer it).
    fn send(
        &self,
        id: u64,
        (op, key, value): (u8, &str, &[u8]),
        waiter: Waiter,
        corkable: Option<&Arc<ControlLink>>,
    ) -> std::result::Result<u64, (Status, Waiter)> {
        if let Err(e) = Self::check_size(key, value) {
            return Err((e, waiter));
        }
        self.waiters.lock().insert(id, waiter);
        let mut message = frame(
            op,
            id,
            &[&(key.len() as u16).to_le_bytes(), key.as_bytes(), value],
        );
        match corkable {
            Some(link) => match cork::defer(link, id, message) {
                None => return Ok(id),
                Some(unsent) => message = unsent,
            },
            // Whatever this thread corked goes first: the answer to this
            // request may depend on it.
            None => cork::flush_corked(),
        }
        match self.write(&message) {
            None => Ok(id),
            Some(e) => match self.waiters.lock().remove(&id) {
                Some(waiter) => Err((e, waiter)),
                // The reader already answered it (the link broke after the
                // write): that answer stands.
                None => Ok(id),
            },
        }
    }

    /// Writes frames; the error, if they did not all go out on a live link.
    fn write(&self, bytes: &[u8]) -> Option<Status> {
        match self.writer.lock().write_all(bytes) {
            Err(e) => {
                self.broken.store(true, Ordering::Release);
                report_closed(self.peer, &self.on_closed, &self.dropping, &self.reported);
                Some(status::unavailable(format!(
                    "control link to process {}: write failed: {e}",
                    self.peer
                )))
            }
            Ok(()) if self.is_broken() => Some(status::unavailable(format!(
                "control link to process {} closed",
                self.peer
            ))),
            Ok(()) => None,
        }
    }

    /// Writes the requests `ids` a cork held (`cork.rs`); a failed write
    /// fails those of them nobody answered yet.
    pub(super) fn write_corked(&self, bytes: &[u8], ids: &[u64]) {
        let Some(e) = self.write(bytes) else { return };
        let failed: Vec<Waiter> = {
            let mut waiters = self.waiters.lock();
            ids.iter().filter_map(|id| waiters.remove(id)).collect()
        };
        for waiter in failed {
            waiter.complete(Err(e.clone()), &self.timer);
        }
    }

    fn request(&self, op: u8, key: &str, value: &[u8]) -> Result<()> {
        let (tx, rx) = bounded(1);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let id = self
            .send(id, (op, key, value), Waiter::Blocking(tx), None)
            .map_err(|(e, _)| e)?;
        match rx.recv_timeout(self.timeout) {
            Ok(outcome) => outcome,
            Err(_) => {
                self.waiters.lock().remove(&id);
                Err(status::deadline_exceeded(format!(
                    "control link to process {}: no answer within {:?}",
                    self.peer, self.timeout
                )))
            }
        }
    }

    /// `set`, with `done` called exactly once: when the peer acked, the
    /// request failed, or `timeout` passed; never blocking on the peer.
    pub fn set_async(
        self: &Arc<Self>,
        key: &str,
        value: &[u8],
        done: Box<dyn FnOnce(Result<()>) + Send>,
    ) {
        self.request_async(OP_SET, key, value, done);
    }

    /// `delete`, as `set_async`.
    pub fn delete_async(self: &Arc<Self>, key: &str, done: Box<dyn FnOnce(Result<()>) + Send>) {
        self.request_async(OP_DELETE, key, &[], done);
    }

    fn request_async(
        self: &Arc<Self>,
        op: u8,
        key: &str,
        value: &[u8],
        done: Box<dyn FnOnce(Result<()>) + Send>,
    ) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let link = Arc::downgrade(self);
        let timeout = self.timeout;
        let peer = self.peer;
        let deadline = self.timer.schedule_after(timeout, move || {
            let Some(link) = link.upgrade() else { return };
            let waiter = link.waiters.lock().remove(&id);
            if let Some(Waiter::Callback(done, _)) = waiter {
                done(Err(status::deadline_exceeded(format!(
                    "control link to process {peer}: no answer within {timeout:?}"
                ))));
            }
        });
        let waiter = Waiter::Callback(done, Some(deadline));
        if let Err((e, waiter)) = self.send(id, (op, key, value), waiter, Some(self)) {
            waiter.complete(Err(e), &self.timer);
        }
    }

    /// Stores `value` under `key` in the peer's store; returns once it is
    /// there.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.request(OP_SET, key, value)
    }

    /// Deletes `key` from the peer's store.
    pub fn delete(&self, key: &str) -> Result<()> {
        self.request(OP_DELETE, key, &[])
    }
}

impl Connection for ControlLink {
    fn is_broken(&self) -> bool {
        ControlLink::is_broken(self)
    }

    /// No request waits for its ack.
    fn is_idle(&self) -> bool {
        self.waiters.lock().is_empty()
    }

    /// BYE, then the connection is cut: the server hears an orderly close,
    /// not the death of this process. What still waited fails.
    fn close(&self) {
        self.dropping.store(true, Ordering::Release);
        {
            let mut writer = self.writer.lock();
            let _ = writer.write_all(&frame(OP_BYE, 0, &[]));
            writer.shutdown_both();
        }
        self.fail_waiting("closed by this process (idle)");
    }
}

impl ControlLink {
    fn fail_waiting(&self, why: &str) {
        let waiting: Vec<Waiter> = self.waiters.lock().drain().map(|(_, w)| w).collect();
        for waiter in waiting {
            let closed = format!("control link to process {} {why}", self.peer);
            waiter.complete(Err(status::unavailable(closed)), &self.timer);
        }
    }
}

impl Drop for ControlLink {
    fn drop(&mut self) {
        self.dropping.store(true, Ordering::Release);
        self.writer.lock().shutdown_both();
        // Nobody will answer what is still waiting.
        self.fail_waiting("closed by this process");
        if let Some(token) = self.reading.lock().take() {
            self.poller.remove(token);
        }
    }
}

/// A link's acks, read by the poller: each goes to its waiting request.
struct AckReader {
    peer: u32,
    reader: SealedStream,
    frames: FrameReader,
    /// What the acks of one burst set off (a waiter that makes another
    /// request) goes out together, once the burst is answered.
    burst: Option<Cork>,
    waiters: Waiters,
    broken: Arc<AtomicBool>,
    dropping: Arc<AtomicBool>,
    on_closed: Option<LinkClosed>,
    reported: Arc<AtomicBool>,
    timer: Arc<DeadlineTimer>,
}

impl Readable for AckReader {
    fn readable(&mut self) -> Next {
        let peer = self.peer;
        loop {
            if !self.frames.has_frame() {
                self.burst = None;
            }
            let next = self.frames.next(&mut self.reader);
            match next {
                Ok((op, id, payload)) => {
                    self.burst.get_or_insert_with(cork);
                    let outcome = match op {
                        OP_ACK => Ok(()),
                        _ => {
                            let code = payload
                                .get(0..4)
                                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                                .unwrap_or(2);
                            Err(Status::new(
                                Code::from_raw(code as i32),
                                format!(
                                    "process {peer} refused: {}",
                                    String::from_utf8_lossy(payload.get(4..).unwrap_or_default())
                                ),
                            ))
                        }
                    };
                    let waiter = self.waiters.lock().remove(&id);
                    if let Some(waiter) = waiter {
                        waiter.complete(outcome, &self.timer);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.burst = None;
                    return Next::Keep;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.burst = None;
                    self.broken.store(true, Ordering::Release);
                    // The peer's loss is reported before its waiting requests
                    // fail, so what they do on failure (retire a receive,
                    // delete its keys) already knows the peer is gone. Our
                    // own drop closes the link too; that is no news.
                    report_closed(peer, &self.on_closed, &self.dropping, &self.reported);
                    let waiting: Vec<Waiter> =
                        self.waiters.lock().drain().map(|(_, w)| w).collect();
                    for waiter in waiting {
                        waiter.complete(
                            Err(status::unavailable(format!(
                                "control link to process {peer} closed"
                            ))),
                            &self.timer,
                        );
                    }
                    return Next::Done;
                }
            }
        }
    }
}
