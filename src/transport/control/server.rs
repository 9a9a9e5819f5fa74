//! The control server: accepts links, authenticates HELLO within its
//! timeout, applies each request to its handler and acks it. Two threads
//! accept (Unix, TCP); the process's poller (`poller.rs`) reads every link,
//! from the handshake on.
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

use super::poller::{Next, Nonblocking, Poller, Readable, Token};
use super::sealing::SealedStream;

use parking_lot::Mutex;

use crate::status::{self, Result};
use crate::sync::threads::Slice;
use crate::transport::random::random_u64;

use super::frame::*;
use super::sealing::{proof_matches, LinkKeys, NONCE_LEN};
use super::secret::*;
use super::{cork, spawn, ControlConfig, ControlEndpoint, ControlHandler, Cork};

/// A served stream (a clone, to cut it off) and its poller token.
type Served = (Box<dyn Stream>, Option<Token>);

/// Streams being served, so that shutdown can cut them off.
#[derive(Default)]
pub(super) struct Connections {
    next: AtomicU64,
    open: Mutex<HashMap<u64, Served>>,
    /// Not authenticated yet: bounded by `max_connections`.
    count: AtomicUsize,
    /// Authenticated links.
    authenticated: AtomicUsize,
}

pub struct ControlServer {
    endpoint: ControlEndpoint,
    unix: Arc<UnixListener>,
    tcp: Arc<TcpListener>,
    stopping: Arc<AtomicBool>,
    connections: Arc<Connections>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    poller: Arc<Poller>,
}

impl ControlServer {
    /// `start_sharing` with a poller of its own.
    pub fn start(
        tcp_bind: IpAddr,
        advertise: IpAddr,
        secret: Secret,
        handler: Weak<dyn ControlHandler>,
        config: ControlConfig,
    ) -> Result<ControlServer> {
        let poller = Poller::start("crosshost-ctl-poll")?;
        Self::start_sharing(tcp_bind, advertise, secret, handler, config, poller)
    }

    /// Listens on a fresh abstract Unix socket and on `tcp_bind` (a port the
    /// OS picks), telling peers to reach it at `advertise` (the listener
    /// may be a wildcard); requests go to `handler` once a peer knows
    /// `secret`; `poller` reads the links (the one the process's own links
    /// use).
    pub fn start_sharing(
        tcp_bind: IpAddr,
        advertise: IpAddr,
        secret: Secret,
        handler: Weak<dyn ControlHandler>,
        config: ControlConfig,
        poller: Arc<Poller>,
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
            poller: poller.clone(),
        };
        let serve = Arc::new(Serve {
            secret,
            handler,
            config,
            stopping: server.stopping.clone(),
            connections: server.connections.clone(),
            poller,
        });
        let unix = server.unix.clone();
        let tcp = server.tcp.clone();
        let mut threads = server.threads.lock();
        threads.push(serve.clone().accepting(
            "crosshost-ctl-accept",
            "the Unix socket",
            move || unix.accept().map(|(s, _)| Box::new(s) as Box<dyn Stream>),
        )?);
        threads.push(serve.accepting("crosshost-ctl-accept-tcp", "TCP", move || {
            tcp.accept().map(|(s, _)| Box::new(s) as Box<dyn Stream>)
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
            + self.connections.authenticated.load(Ordering::Acquire)
    }

    /// Authenticated links being served.
    pub fn link_count(&self) -> usize {
        self.connections.authenticated.load(Ordering::Acquire)
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
        let threads = std::mem::take(&mut *self.threads.lock());
        crate::sync::runner::join_all_except_current(threads, "ControlServer");
        // No accept is running: nothing is added any more.
        let open: Vec<_> = self.connections.open.lock().drain().collect();
        for (_, (stream, token)) in open {
            stream.shutdown_both();
            if let Some(token) = token {
                self.poller.remove(token);
            }
        }
    }
}

pub(super) struct Serve {
    secret: Secret,
    handler: Weak<dyn ControlHandler>,
    config: ControlConfig,
    stopping: Arc<AtomicBool>,
    connections: Arc<Connections>,
    poller: Arc<Poller>,
}

impl Serve {
    /// Accepts connections on a thread of its own until the server stops;
    /// the poller serves each.
    fn accepting(
        self: Arc<Self>,
        name: &str,
        socket: &'static str,
        accept: impl Fn() -> std::io::Result<Box<dyn Stream>> + Send + 'static,
    ) -> Result<JoinHandle<()>> {
        spawn(name, Slice::Kernel, move || loop {
            match accept() {
                Ok(stream) => self.clone().accepted(stream),
                Err(_) if self.stopping.load(Ordering::Acquire) => return,
                Err(e) => log::warn!("control link: accept on {socket}: {e}"),
            }
        })
    }

    /// Hands one accepted connection to the poller (HELLO first, within the
    /// deadline, or it is closed).
    fn accepted(self: Arc<Self>, stream: Box<dyn Stream>) {
        if self.connections.count.fetch_add(1, Ordering::AcqRel) >= self.config.max_connections {
            self.connections.count.fetch_sub(1, Ordering::AcqRel);
            log::warn!(
                "control link: refusing a connection (already {} unauthenticated ones open)",
                self.config.max_connections
            );
            stream.shutdown_both();
            return;
        }
        // The handshake's few frames are small: a peer that does not read
        // them cannot hold a write longer than the handshake's time.
        let _ = stream.set_timeouts(None, Some(self.config.hello_timeout));
        let clone = match stream.try_clone_box() {
            Ok(clone) => clone,
            Err(e) => {
                log::warn!("control link: {e}");
                self.connections.count.fetch_sub(1, Ordering::AcqRel);
                return;
            }
        };
        let id = self.connections.next.fetch_add(1, Ordering::Relaxed);
        // Registered before the poller can finish with it (its drop removes
        // the entry).
        self.connections.open.lock().insert(id, (clone, None));
        let fd = stream.raw_fd();
        let served = ServedLink {
            serve: self.clone(),
            id,
            deadline: Instant::now() + self.config.hello_timeout,
            phase: Phase::Hello,
            plain: Some(Box::new(Nonblocking::new(stream))),
            sealed: None,
            frames: FrameReader::for_handshake(),
            acks: Vec::new(),
            burst: None,
        };
        match self.poller.add(fd, Box::new(served)) {
            Ok(token) => {
                if let Some(entry) = self.connections.open.lock().get_mut(&id) {
                    entry.1 = Some(token);
                }
            }
            Err(e) => log::error!("control link: {e}"),
        }
    }
}

enum Phase {
    /// Waiting for HELLO.
    Hello,
    /// CHALLENGE sent; waiting for PROOF.
    Proof { keys: LinkKeys, peer: u32 },
    /// Authenticated: requests until the peer goes away.
    Linked { peer: u32 },
}

/// One connection the server serves, read by the poller: the handshake
/// (HELLO, CHALLENGE, PROOF, ACK within one deadline: `sealing.rs`; a
/// stranger holds nothing longer than that, and learns nothing), then
/// requests, each applied to the handler and acked. A burst of requests (a
/// batch's descriptors or receipts) is answered with one write of its
/// acks, after the writes its handling made on our own links (a small
/// send's receipt) went out together.
struct ServedLink {
    serve: Arc<Serve>,
    id: u64,
    deadline: Instant,
    phase: Phase,
    /// The stream until the handshake is done; then `sealed`.
    plain: Option<Box<dyn Stream>>,
    sealed: Option<SealedStream>,
    frames: FrameReader,
    acks: Vec<u8>,
    burst: Option<Cork>,
}

impl ServedLink {
    fn stream(&mut self) -> &mut dyn Stream {
        match (&mut self.sealed, &mut self.plain) {
            (Some(sealed), _) => sealed,
            (None, Some(plain)) => &mut **plain,
            (None, None) => unreachable!("a served link has a stream until it is dropped"),
        }
    }

    fn refuse(&mut self, why: &str) -> Next {
        log::warn!("control link: a peer failed to authenticate ({why})");
        let refusal = nack_payload(&status::unauthenticated("control link: bad HELLO"));
        let _ = self.stream().write_all(&frame(OP_NACK, 0, &[&refusal]));
        Next::Done
    }

    /// One handshake frame; `Done` when the peer failed it.
    fn handshake(&mut self, op: u8, id: u64, payload: Vec<u8>) -> Next {
        match std::mem::replace(&mut self.phase, Phase::Hello) {
            Phase::Hello if op == OP_HELLO && payload.len() == NONCE_LEN + 4 => {
                let client_nonce: [u8; NONCE_LEN] =
                    payload[..NONCE_LEN].try_into().expect("a nonce");
                let peer = u32::from_le_bytes(payload[NONCE_LEN..].try_into().expect("4 bytes"));
                let mut server_nonce = [0u8; NONCE_LEN];
                if crate::transport::random::fill_random(&mut server_nonce).is_err() {
                    return Next::Done;
                }
                let keys = LinkKeys::derive(&self.serve.secret, &client_nonce, &server_nonce, peer);
                let challenge = frame(OP_CHALLENGE, 0, &[&server_nonce, &keys.server_proof]);
                if self.stream().write_all(&challenge).is_err() {
                    return Next::Done;
                }
                self.phase = Phase::Proof { keys, peer };
                Next::Keep
            }
            Phase::Hello => self.refuse("not a HELLO"),
            Phase::Proof { keys, peer } => {
                if op != OP_PROOF || !proof_matches(&keys.client_proof, &payload) {
                    return self.refuse("its proof does not match the job's secret");
                }
                if self.stream().write_all(&frame(OP_ACK, id, &[])).is_err() {
                    return Next::Done;
                }
                // The client waits for the ACK before its first sealed
                // frame: anything already here is not from the job's peer.
                if self.frames.buffered() > 0 {
                    return self.refuse("it sent before the handshake ended");
                }
                let connections = &self.serve.connections;
                connections.count.fetch_sub(1, Ordering::AcqRel);
                connections.authenticated.fetch_add(1, Ordering::AcqRel);
                let plain = self.plain.take().expect("the handshake's stream");
                let _ = plain.set_timeouts(None, Some(self.serve.config.request_timeout));
                self.sealed = Some(keys.server_stream(plain));
                self.frames = FrameReader::new();
                self.phase = Phase::Linked { peer };
                Next::Keep
            }
            Phase::Linked { .. } => unreachable!("the handshake is over"),
        }
    }

    /// One request of an authenticated peer; `Done` at its BYE.
    fn request(&mut self, peer: u32, op: u8, id: u64, payload: Vec<u8>) -> Next {
        let Some(handler) = self.serve.handler.upgrade() else {
            return Next::Done;
        };
        if op == OP_BYE {
            // An idle link closed in order: its process lives on.
            let acks = std::mem::take(&mut self.acks);
            let _ = self.stream().write_all(&acks);
            log::debug!("control link from process {peer} closed (idle)");
            return Next::Done;
        }
        let outcome = match (op, split_key(&payload)) {
            (OP_SET, Some((key, value))) => handler.set(peer, key, value),
            (OP_DELETE, Some((key, _))) => handler.delete(peer, key),
            _ => Err(status::invalid_argument(format!(
                "control link: bad request op {op}"
            ))),
        };
        self.acks.extend_from_slice(&match outcome {
            Ok(()) => frame(OP_ACK, id, &[]),
            Err(e) => frame(OP_NACK, id, &[&nack_payload(&e)]),
        });
        Next::Keep
    }

    /// The burst read so far is handled: what it set off goes out, then
    /// its acks.
    fn end_burst(&mut self) -> Next {
        self.burst = None;
        if self.acks.is_empty() {
            return Next::Keep;
        }
        let acks = std::mem::take(&mut self.acks);
        match self.stream().write_all(&acks) {
            Ok(()) => Next::Keep,
            Err(_) => Next::Done,
        }
    }

    fn closed(&mut self, e: io::Error) -> Next {
        let stopping = self.serve.stopping.load(Ordering::Acquire);
        match self.phase {
            Phase::Linked { peer } if !stopping => {
                log::debug!("control link from process {peer} closed: {e}");
                if let Some(handler) = self.serve.handler.upgrade() {
                    handler.peer_closed(peer);
                }
            }
            Phase::Linked { .. } => {}
            _ if !stopping => log::debug!("control link: closed during its handshake: {e}"),
            _ => {}
        }
        Next::Done
    }
}

impl Readable for ServedLink {
    fn readable(&mut self) -> Next {
        loop {
            if !self.frames.has_frame() && self.end_burst() == Next::Done {
                return Next::Done;
            }
            let mut frames = std::mem::replace(&mut self.frames, FrameReader::for_handshake());
            let next = frames.next(self.stream());
            self.frames = frames;
            let (op, id, payload) = match next {
                Ok(frame) => frame,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return self.end_burst();
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.burst = None;
                    return self.closed(e);
                }
            };
            let step = match self.phase {
                Phase::Linked { peer } => {
                    self.burst.get_or_insert_with(cork);
                    self.request(peer, op, id, payload)
                }
                _ => self.handshake(op, id, payload),
            };
            if step == Next::Done {
                self.burst = None;
                return Next::Done;
            }
        }
    }

    fn deadline(&self) -> Option<Instant> {
        match self.phase {
            Phase::Linked { .. } => None,
            _ => Some(self.deadline),
        }
    }

    fn expired(&mut self) {
        if !self.serve.stopping.load(Ordering::Acquire) {
            log::debug!(
                "control link: no handshake within {:?}",
                self.serve.config.hello_timeout
            );
        }
    }
}

impl Drop for ServedLink {
    fn drop(&mut self) {
        if let Some(stream) = self
            .sealed
            .as_ref()
            .map(|s| s as &dyn Stream)
            .or(self.plain.as_deref())
        {
            stream.shutdown_both();
        }
        self.serve.connections.open.lock().remove(&self.id);
        let counter = match self.phase {
            Phase::Linked { .. } => &self.serve.connections.authenticated,
            _ => &self.serve.connections.count,
        };
        counter.fetch_sub(1, Ordering::AcqRel);
    }
}
