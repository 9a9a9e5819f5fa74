//! Control links: small authenticated messages between the processes of a
//! job, over connections kept open for the job's life. The peer store
//! (`kv/peer.rs`) carries the transfer keys on them: a receiver's descriptor
//! goes straight to the process that will send, a sender's receipt straight
//! to the process that waits for it, without a round trip through a
//! framework's coordination service.
//!
//! Each process listens on an abstract Unix socket (peers on this host; no
//! file to clean up) and on TCP (peers elsewhere). A connection starts with
//! HELLO: the job's secret (agreed through the session, constant-time
//! compared) and the caller's process index, within `hello_timeout` of
//! accept, or it is closed; an unauthenticated peer holds only its own
//! thread, never an accept loop, and at most `max_connections` of them exist.
//! After HELLO, requests are pipelined: each carries an id, the receiving
//! side applies it to its handler and acks with the id, and the caller's
//! reader thread hands the ack to the waiting request.
//!
//! Frames, little endian: `u32 length` (of what follows) `u8 op` `u64 id`
//! then the op's payload. SET: `u16 key length`, key, value. DELETE: key.
//! ACK: nothing. NACK: `u32 code`, message. HELLO: 32-byte secret, `u32`
//! process index.
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Sender};
use parking_lot::Mutex;

use crate::status::{self, Code, Result, Status};
use crate::sync::{DeadlineTimer, TimerId};
use crate::transport::random::random_u64;

pub const SECRET_LEN: usize = 32;
/// Frames larger than this are refused (a descriptor or receipt is a few
/// hundred bytes).
pub const MAX_FRAME: usize = 1 << 20;

const OP_HELLO: u8 = 1;
const OP_SET: u8 = 2;
const OP_DELETE: u8 = 3;
const OP_ACK: u8 = 0x80;
const OP_NACK: u8 = 0x81;

/// The job's shared secret for control links.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Secret(pub [u8; SECRET_LEN]);

impl Secret {
    pub fn generate() -> Result<Secret> {
        let mut bytes = [0u8; SECRET_LEN];
        for chunk in bytes.chunks_mut(8) {
            chunk.copy_from_slice(&random_u64()?.to_le_bytes());
        }
        Ok(Secret(bytes))
    }

    pub fn to_hex(self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(text: &str) -> Option<Secret> {
        if text.len() != 2 * SECRET_LEN {
            return None;
        }
        let mut bytes = [0u8; SECRET_LEN];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Secret(bytes))
    }

    /// Constant-time comparison.
    fn matches(&self, other: &[u8]) -> bool {
        other.len() == SECRET_LEN
            && self
                .0
                .iter()
                .zip(other)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Where a process listens for control links.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControlEndpoint {
    /// Abstract Unix socket name (peers on the same host).
    pub unix_name: String,
    pub tcp: SocketAddr,
}

impl ControlEndpoint {
    /// `unix=<name>,tcp=<addr>`.
    pub fn encode(&self) -> String {
        format!("unix={},tcp={}", self.unix_name, self.tcp)
    }

    pub fn decode(text: &str) -> Option<ControlEndpoint> {
        let (unix, tcp) = text.split_once(",tcp=")?;
        Some(ControlEndpoint {
            unix_name: unix.strip_prefix("unix=")?.to_string(),
            tcp: tcp.parse().ok()?,
        })
    }
}

/// What a control server does with the requests it receives.
pub trait ControlHandler: Send + Sync {
    fn set(&self, from: u32, key: &str, value: &[u8]) -> Result<()>;
    fn delete(&self, from: u32, key: &str) -> Result<()>;
    /// An authenticated link from `process` closed (it exited, crashed, or
    /// destroyed its client).
    fn peer_closed(&self, process: u32);
}

#[derive(Clone, Debug)]
pub struct ControlConfig {
    /// HELLO must arrive within this long of accept.
    pub hello_timeout: Duration,
    /// Connections (authenticated or not) served at once.
    pub max_connections: usize,
    /// Bound on a request's wait for its ack, and on each write.
    pub request_timeout: Duration,
}

impl Default for ControlConfig {
    fn default() -> ControlConfig {
        ControlConfig {
            hello_timeout: Duration::from_secs(5),
            max_connections: 256,
            request_timeout: Duration::from_secs(30),
        }
    }
}

// ---------------------------------- framing ----------------------------------

trait Stream: Read + Write + Send + Sync {
    fn shutdown_both(&self);
    fn try_clone_box(&self) -> io::Result<Box<dyn Stream>>;
    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()>;
}

impl Stream for UnixStream {
    fn shutdown_both(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
    fn try_clone_box(&self) -> io::Result<Box<dyn Stream>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        self.set_read_timeout(read)?;
        self.set_write_timeout(write)
    }
}

impl Stream for TcpStream {
    fn shutdown_both(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
    fn try_clone_box(&self) -> io::Result<Box<dyn Stream>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        self.set_nodelay(true)?;
        self.set_read_timeout(read)?;
        self.set_write_timeout(write)
    }
}

fn frame(op: u8, id: u64, payload: &[&[u8]]) -> Vec<u8> {
    let len = 1 + 8 + payload.iter().map(|p| p.len()).sum::<usize>();
    let mut out = Vec::with_capacity(4 + len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.push(op);
    out.extend_from_slice(&id.to_le_bytes());
    for p in payload {
        out.extend_from_slice(p);
    }
    out
}

/// Reads one frame: `(op, id, payload)`. `deadline` bounds the whole frame.
fn read_frame(
    stream: &mut dyn Stream,
    deadline: Option<Instant>,
) -> io::Result<(u8, u64, Vec<u8>)> {
    let mut header = [0u8; 13];
    read_exact_by(stream, &mut header, deadline)?;
    let len = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes")) as usize;
    if !(9..=MAX_FRAME).contains(&len) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame length {len}"),
        ));
    }
    let op = header[4];
    let id = u64::from_le_bytes(header[5..13].try_into().expect("8 bytes"));
    let mut payload = vec![0u8; len - 9];
    read_exact_by(stream, &mut payload, deadline)?;
    Ok((op, id, payload))
}

/// `read_exact`, with one deadline for all of it (a peer trickling a byte at
/// a time cannot extend it).
fn read_exact_by(
    stream: &mut dyn Stream,
    mut buf: &mut [u8],
    deadline: Option<Instant>,
) -> io::Result<()> {
    while !buf.is_empty() {
        if let Some(deadline) = deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "control frame deadline",
                ));
            }
            stream.set_timeouts(Some(left), None)?;
        }
        match stream.read(buf) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "control link closed",
                ))
            }
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn split_key(payload: &[u8]) -> Option<(&str, &[u8])> {
    let len = u16::from_le_bytes(payload.get(0..2)?.try_into().ok()?) as usize;
    let key = std::str::from_utf8(payload.get(2..2 + len)?).ok()?;
    Some((key, &payload[2 + len..]))
}

fn nack_payload(status: &Status) -> Vec<u8> {
    let mut out = (status.code as u32).to_le_bytes().to_vec();
    out.extend_from_slice(status.message.as_bytes());
    out
}

// ---------------------------------- server -----------------------------------

/// Streams being served, so that shutdown can cut them off.
#[derive(Default)]
struct Connections {
    next: AtomicU64,
    open: Mutex<HashMap<u64, Box<dyn Stream>>>,
    count: AtomicUsize,
}

pub struct ControlServer {
    endpoint: ControlEndpoint,
    unix: Arc<UnixListener>,
    tcp: Arc<TcpListener>,
    stopping: Arc<AtomicBool>,
    connections: Arc<Connections>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl ControlServer {
    /// Listens on a fresh abstract Unix socket and on `tcp_bind` (a port the
    /// OS picks), telling peers to reach it at `advertise` (the listener
    /// may be a wildcard); requests go to `handler` once a peer knows
    /// `secret`.
    pub fn start(
        tcp_bind: IpAddr,
        advertise: IpAddr,
        secret: Secret,
        handler: Weak<dyn ControlHandler>,
        config: ControlConfig,
    ) -> Result<ControlServer> {
        let unix_name = format!(
            "pjrt-crosshost/{}/{:016x}",
            std::process::id(),
            random_u64()?
        );
        let addr = UnixAddr::from_abstract_name(unix_name.as_bytes())
            .map_err(|e| status::internal(format!("control link name: {e}")))?;
        let unix = UnixListener::bind_addr(&addr).map_err(|e| {
            status::unavailable(format!("control link: cannot listen on a Unix socket: {e}"))
        })?;
        let tcp = TcpListener::bind(SocketAddr::new(tcp_bind, 0)).map_err(|e| {
            status::unavailable(format!("control link: cannot listen on {tcp_bind}: {e}"))
        })?;
        let port = tcp
            .local_addr()
            .map_err(|e| status::internal(e.to_string()))?
            .port();
        let endpoint = ControlEndpoint {
            unix_name,
            tcp: SocketAddr::new(advertise, port),
        };
        let server = ControlServer {
            endpoint,
            unix: Arc::new(unix),
            tcp: Arc::new(tcp),
            stopping: Arc::new(AtomicBool::new(false)),
            connections: Arc::new(Connections::default()),
            threads: Mutex::new(Vec::new()),
        };
        let serve = Arc::new(Serve {
            secret,
            handler,
            config,
            stopping: server.stopping.clone(),
            connections: server.connections.clone(),
        });
        let unix = server.unix.clone();
        let serve_unix = serve.clone();
        let tcp = server.tcp.clone();
        let mut threads = server.threads.lock();
        threads.push(spawn("crosshost-ctl-accept", move || loop {
            match unix.accept() {
                Ok((stream, _)) => serve_unix.clone().accepted(Box::new(stream)),
                Err(_) if serve_unix.stopping.load(Ordering::Acquire) => return,
                Err(e) => log::warn!("control link: accept on the Unix socket: {e}"),
            }
        })?);
        threads.push(spawn("crosshost-ctl-accept-tcp", move || loop {
            match tcp.accept() {
                Ok((stream, _)) => serve.clone().accepted(Box::new(stream)),
                Err(_) if serve.stopping.load(Ordering::Acquire) => return,
                Err(e) => log::warn!("control link: accept on TCP: {e}"),
            }
        })?);
        drop(threads);
        Ok(server)
    }

    pub fn endpoint(&self) -> &ControlEndpoint {
        &self.endpoint
    }

    /// Connections being served (authenticated or not).
    pub fn connection_count(&self) -> usize {
        self.connections.count.load(Ordering::Acquire)
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Release);
        // SAFETY: shutting down our own listening sockets (valid fds owned by
        // the Arcs above) wakes the threads blocked in accept.
        unsafe {
            libc::shutdown(self.unix.as_raw_fd(), libc::SHUT_RDWR);
            libc::shutdown(self.tcp.as_raw_fd(), libc::SHUT_RDWR);
        }
        for (_, stream) in self.connections.open.lock().drain() {
            stream.shutdown_both();
        }
        let threads = std::mem::take(&mut *self.threads.lock());
        crate::sync::runner::join_all_except_current(threads, "ControlServer");
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(f)
        .map_err(|e| status::resource_exhausted(format!("cannot start thread {name}: {e}")))
}

struct Serve {
    secret: Secret,
    handler: Weak<dyn ControlHandler>,
    config: ControlConfig,
    stopping: Arc<AtomicBool>,
    connections: Arc<Connections>,
}

impl Serve {
    /// Serves one accepted connection on its own thread (HELLO first, within
    /// the deadline, or it is closed).
    fn accepted(self: Arc<Self>, stream: Box<dyn Stream>) {
        if self.connections.count.fetch_add(1, Ordering::AcqRel) >= self.config.max_connections {
            self.connections.count.fetch_sub(1, Ordering::AcqRel);
            log::warn!(
                "control link: refusing a connection (already {} open)",
                self.config.max_connections
            );
            stream.shutdown_both();
            return;
        }
        let id = self.connections.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(clone) = stream.try_clone_box() {
            self.connections.open.lock().insert(id, clone);
        }
        let serve = self.clone();
        let started = spawn("crosshost-ctl-conn", move || {
            serve.serve(stream);
            serve.connections.open.lock().remove(&id);
            serve.connections.count.fetch_sub(1, Ordering::AcqRel);
        });
        if let Err(e) = started {
            log::error!("control link: {e}");
            self.connections.open.lock().remove(&id);
            self.connections.count.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn serve(&self, mut stream: Box<dyn Stream>) {
        let deadline = Instant::now() + self.config.hello_timeout;
        let peer = match read_frame(&mut *stream, Some(deadline)) {
            Ok((OP_HELLO, id, payload))
                if payload.len() == SECRET_LEN + 4
                    && self.secret.matches(&payload[..SECRET_LEN]) =>
            {
                let process =
                    u32::from_le_bytes(payload[SECRET_LEN..].try_into().expect("4 bytes"));
                if stream.write_all(&frame(OP_ACK, id, &[])).is_err() {
                    return;
                }
                process
            }
            Ok(_) => {
                log::warn!("control link: a peer failed to authenticate");
                let refusal = nack_payload(&status::unauthenticated("control link: bad HELLO"));
                let _ = stream.write_all(&frame(OP_NACK, 0, &[&refusal]));
                return;
            }
            Err(e) => {
                if !self.stopping.load(Ordering::Acquire) {
                    log::debug!(
                        "control link: no HELLO within {:?}: {e}",
                        self.config.hello_timeout
                    );
                }
                return;
            }
        };
        // Authenticated: requests until the peer goes away.
        let _ = stream.set_timeouts(None, Some(self.config.request_timeout));
        loop {
            let (op, id, payload) = match read_frame(&mut *stream, None) {
                Ok(frame) => frame,
                Err(e) => {
                    if !self.stopping.load(Ordering::Acquire) {
                        log::debug!("control link from process {peer} closed: {e}");
                        if let Some(handler) = self.handler.upgrade() {
                            handler.peer_closed(peer);
                        }
                    }
                    return;
                }
            };
            let Some(handler) = self.handler.upgrade() else {
                return;
            };
            let outcome = match (op, split_key(&payload)) {
                (OP_SET, Some((key, value))) => handler.set(peer, key, value),
                (OP_DELETE, Some((key, _))) => handler.delete(peer, key),
                _ => Err(status::invalid_argument(format!(
                    "control link: bad request op {op}"
                ))),
            };
            let reply = match outcome {
                Ok(()) => frame(OP_ACK, id, &[]),
                Err(e) => frame(OP_NACK, id, &[&nack_payload(&e)]),
            };
            if stream.write_all(&reply).is_err() {
                return;
            }
        }
    }
}

// ---------------------------------- client -----------------------------------

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

/// One process's link to a peer: requests pipelined on one connection, acks
/// read by its own thread.
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
    reader: Mutex<Option<JoinHandle<()>>>,
}

/// Called with the peer when its end of a link closed (it exited or died).
pub type LinkClosed = Arc<dyn Fn(u32) + Send + Sync>;

/// Tells `on_closed` once that `peer`'s end closed, unless we are the ones
/// closing the link.
fn report_closed(
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
    /// and authenticates as process `me`.
    pub fn connect(
        peer: u32,
        endpoint: &ControlEndpoint,
        same_host: bool,
        me: u32,
        secret: Secret,
        timeout: Duration,
        on_closed: Option<LinkClosed>,
    ) -> Result<Arc<ControlLink>> {
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
        let mut hello = secret.0.to_vec();
        hello.extend_from_slice(&me.to_le_bytes());
        stream
            .write_all(&frame(OP_HELLO, 0, &[&hello]))
            .map_err(unavailable)?;
        match read_frame(&mut *stream, Some(Instant::now() + timeout)).map_err(unavailable)? {
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
        let mut reader = stream.try_clone_box().map_err(unavailable)?;
        let link = Arc::new(ControlLink {
            peer,
            writer: Mutex::new(stream),
            waiters: Arc::default(),
            timer: Arc::new(DeadlineTimer::new("crosshost-ctl-deadline")),
            next_id: AtomicU64::new(1),
            broken: Arc::new(AtomicBool::new(false)),
            dropping: Arc::new(AtomicBool::new(false)),
            on_closed: on_closed.clone(),
            reported: Arc::new(AtomicBool::new(false)),
            timeout,
            reader: Mutex::new(None),
        });
        let waiters = link.waiters.clone();
        let broken = link.broken.clone();
        let dropping = link.dropping.clone();
        let reported = link.reported.clone();
        let timer = link.timer.clone();
        let handle = spawn("crosshost-ctl-acks", move || loop {
            match read_frame(&mut *reader, None) {
                Ok((op, id, payload)) => {
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
                    let waiter = waiters.lock().remove(&id);
                    if let Some(waiter) = waiter {
                        waiter.complete(outcome, &timer);
                    }
                }
                Err(_) => {
                    broken.store(true, Ordering::Release);
                    // The peer's loss is reported before its waiting requests
                    // fail, so what they do on failure (retire a receive,
                    // delete its keys) already knows the peer is gone. Our
                    // own drop closes the link too; that is no news.
                    report_closed(peer, &on_closed, &dropping, &reported);
                    let waiting: Vec<Waiter> = waiters.lock().drain().map(|(_, w)| w).collect();
                    for waiter in waiting {
                        waiter.complete(
                            Err(status::unavailable(format!(
                                "control link to process {peer} closed"
                            ))),
                            &timer,
                        );
                    }
                    return;
                }
            }
        })?;
        *link.reader.lock() = Some(handle);
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

    /// Sends a request whose ack goes to `waiter`. If it could not be
    /// written, the waiter comes back with the error (nobody will answer it).
    fn send(
        &self,
        id: u64,
        op: u8,
        key: &str,
        value: &[u8],
        waiter: Waiter,
    ) -> std::result::Result<u64, (Status, Waiter)> {
        if let Err(e) = Self::check_size(key, value) {
            return Err((e, waiter));
        }
        self.waiters.lock().insert(id, waiter);
        let message = frame(
            op,
            id,
            &[&(key.len() as u16).to_le_bytes(), key.as_bytes(), value],
        );
        let written = self.writer.lock().write_all(&message);
        let failure = match written {
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
        };
        match failure {
            None => Ok(id),
            Some(e) => match self.waiters.lock().remove(&id) {
                Some(waiter) => Err((e, waiter)),
                // The reader already answered it (the link broke after the
                // write): that answer stands.
                None => Ok(id),
            },
        }
    }

    fn request(&self, op: u8, key: &str, value: &[u8]) -> Result<()> {
        let (tx, rx) = bounded(1);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let id = self
            .send(id, op, key, value, Waiter::Blocking(tx))
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
        if let Err((e, waiter)) =
            self.send(id, op, key, value, Waiter::Callback(done, Some(deadline)))
        {
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

impl Drop for ControlLink {
    fn drop(&mut self) {
        self.dropping.store(true, Ordering::Release);
        self.writer.lock().shutdown_both();
        // Nobody will answer what is still waiting.
        let waiting: Vec<Waiter> = self.waiters.lock().drain().map(|(_, w)| w).collect();
        for waiter in waiting {
            let closed = format!(
                "control link to process {} closed by this process",
                self.peer
            );
            waiter.complete(Err(status::unavailable(closed)), &self.timer);
        }
        if let Some(reader) = self.reader.lock().take() {
            crate::sync::runner::join_all_except_current(vec![reader], "ControlLink");
        }
    }
}

#[cfg(test)]
mod tests;

// ------------------------------ fuzzing hooks -------------------------------
// Entry points for the cargo-fuzz targets (fuzz/); not part of the API.

/// An in-memory `Stream` over `bytes` that hands out at most `max_read` bytes
/// per `read` (a peer's short writes), writes nowhere.
struct FuzzStream<'a> {
    bytes: &'a [u8],
    max_read: usize,
}

impl Read for FuzzStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.max_read.max(1)).min(self.bytes.len());
        buf[..n].copy_from_slice(&self.bytes[..n]);
        self.bytes = &self.bytes[n..];
        Ok(n)
    }
}

impl Write for FuzzStream<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Stream for FuzzStream<'_> {
    fn shutdown_both(&self) {}
    fn try_clone_box(&self) -> io::Result<Box<dyn Stream>> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "fuzz stream"))
    }
    fn set_timeouts(&self, _: Option<Duration>, _: Option<Duration>) -> io::Result<()> {
        Ok(())
    }
}

/// `read_frame` over `bytes`, delivered at most `max_read` bytes per read;
/// with `with_deadline`, under a deadline an hour away (the HELLO path).
#[doc(hidden)]
pub fn decode_frame_for_fuzzing(
    bytes: &[u8],
    max_read: usize,
    with_deadline: bool,
) -> io::Result<(u8, u64, Vec<u8>)> {
    let mut stream = FuzzStream { bytes, max_read };
    let deadline = with_deadline.then(|| Instant::now() + Duration::from_secs(3600));
    read_frame(&mut stream, deadline)
}

/// `frame` with one payload part.
#[doc(hidden)]
pub fn encode_frame_for_fuzzing(op: u8, id: u64, payload: &[u8]) -> Vec<u8> {
    frame(op, id, &[payload])
}

/// `split_key`: a SET/DELETE payload's key and value.
#[doc(hidden)]
pub fn split_key_for_fuzzing(payload: &[u8]) -> Option<(&str, &[u8])> {
    split_key(payload)
}
