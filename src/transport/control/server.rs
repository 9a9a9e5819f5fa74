//! The control server: accepts links, authenticates HELLO within its
//! timeout, applies each request to its handler and acks it.
use std::collections::HashMap;
use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::Mutex;

use crate::status::{self, Result};
use crate::sync::threads::Slice;
use crate::transport::random::random_u64;

use super::frame::*;
use super::sealing::{proof_matches, LinkKeys, NONCE_LEN};
use super::secret::*;
use super::{cork, spawn, ControlConfig, ControlEndpoint, ControlHandler, Cork};

/// Streams being served, so that shutdown can cut them off.
#[derive(Default)]
pub(super) struct Connections {
    next: AtomicU64,
    open: Mutex<HashMap<u64, Box<dyn Stream>>>,
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
        let tcp = server.tcp.clone();
        let mut threads = server.threads.lock();
        threads.push(serve.clone().accepting(
            "crosshost-ctl-accept",
            "the Unix socket",
            Slice::Kernel,
            move || unix.accept().map(|(s, _)| Box::new(s) as Box<dyn Stream>),
        )?);
        // A peer over TCP is on another host: its link's wake-ups are a
        // transfer's latency.
        threads.push(serve.accepting(
            "crosshost-ctl-accept-tcp",
            "TCP",
            Slice::Short,
            move || tcp.accept().map(|(s, _)| Box::new(s) as Box<dyn Stream>),
        )?);
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
        for (_, stream) in self.connections.open.lock().drain() {
            stream.shutdown_both();
        }
        let threads = std::mem::take(&mut *self.threads.lock());
        crate::sync::runner::join_all_except_current(threads, "ControlServer");
    }
}

pub(super) struct Serve {
    secret: Secret,
    handler: Weak<dyn ControlHandler>,
    config: ControlConfig,
    stopping: Arc<AtomicBool>,
    connections: Arc<Connections>,
}

impl Serve {
    /// Accepts connections on a thread of its own until the server stops,
    /// each served on a thread at `slice`.
    fn accepting(
        self: Arc<Self>,
        name: &str,
        socket: &'static str,
        slice: Slice,
        accept: impl Fn() -> std::io::Result<Box<dyn Stream>> + Send + 'static,
    ) -> Result<JoinHandle<()>> {
        spawn(name, Slice::Kernel, move || loop {
            match accept() {
                Ok(stream) => self.clone().accepted(stream, slice),
                Err(_) if self.stopping.load(Ordering::Acquire) => return,
                Err(e) => log::warn!("control link: accept on {socket}: {e}"),
            }
        })
    }

    /// Serves one accepted connection on its own thread (HELLO first, within
    /// the deadline, or it is closed).
    fn accepted(self: Arc<Self>, stream: Box<dyn Stream>, slice: Slice) {
        if self.connections.count.fetch_add(1, Ordering::AcqRel) >= self.config.max_connections {
            self.connections.count.fetch_sub(1, Ordering::AcqRel);
            log::warn!(
                "control link: refusing a connection (already {} unauthenticated ones open)",
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
        let started = spawn("crosshost-ctl-conn", slice, move || {
            let authenticated = serve.serve(stream);
            serve.connections.open.lock().remove(&id);
            if authenticated {
                serve
                    .connections
                    .authenticated
                    .fetch_sub(1, Ordering::AcqRel);
            } else {
                serve.connections.count.fetch_sub(1, Ordering::AcqRel);
            }
        });
        if let Err(e) = started {
            log::error!("control link: {e}");
            self.connections.open.lock().remove(&id);
            self.connections.count.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Serves `stream` until it closes; true when it had authenticated
    /// (and so counts among the links, no longer among the strangers).
    fn serve(&self, mut stream: Box<dyn Stream>) -> bool {
        // HELLO, CHALLENGE, PROOF, ACK within one deadline (`sealing.rs`):
        // a stranger holds nothing longer than that, and learns nothing.
        let deadline = Some(Instant::now() + self.config.hello_timeout);
        let refuse = |stream: &mut Box<dyn Stream>, why: &str| {
            log::warn!("control link: a peer failed to authenticate ({why})");
            let refusal = nack_payload(&status::unauthenticated("control link: bad HELLO"));
            let _ = stream.write_all(&frame(OP_NACK, 0, &[&refusal]));
        };
        let quiet = |e: std::io::Error| {
            if !self.stopping.load(Ordering::Acquire) {
                log::debug!(
                    "control link: no handshake within {:?}: {e}",
                    self.config.hello_timeout
                );
            }
        };
        let (client_nonce, peer) = match read_frame(&mut *stream, deadline) {
            Ok((OP_HELLO, _, payload)) if payload.len() == NONCE_LEN + 4 => (
                <[u8; NONCE_LEN]>::try_from(&payload[..NONCE_LEN]).expect("a nonce"),
                u32::from_le_bytes(payload[NONCE_LEN..].try_into().expect("4 bytes")),
            ),
            Ok(_) => {
                refuse(&mut stream, "not a HELLO");
                return false;
            }
            Err(e) => {
                quiet(e);
                return false;
            }
        };
        let mut server_nonce = [0u8; NONCE_LEN];
        if crate::transport::random::fill_random(&mut server_nonce).is_err() {
            return false;
        }
        let keys = LinkKeys::derive(&self.secret, &client_nonce, &server_nonce, peer);
        let challenge = frame(OP_CHALLENGE, 0, &[&server_nonce, &keys.server_proof]);
        if stream.write_all(&challenge).is_err() {
            return false;
        }
        match read_frame(&mut *stream, deadline) {
            Ok((OP_PROOF, id, proof)) if proof_matches(&keys.client_proof, &proof) => {
                if stream.write_all(&frame(OP_ACK, id, &[])).is_err() {
                    return false;
                }
            }
            Ok(_) => {
                refuse(&mut stream, "its proof does not match the job's secret");
                return false;
            }
            Err(e) => {
                quiet(e);
                return false;
            }
        }
        self.connections.count.fetch_sub(1, Ordering::AcqRel);
        self.connections
            .authenticated
            .fetch_add(1, Ordering::AcqRel);
        let mut stream: Box<dyn Stream> = Box::new(keys.server_stream(stream));
        // Authenticated: requests until the peer goes away. A burst of them
        // (a batch's descriptors or receipts) is answered with one write of
        // its acks, after the writes its handling made on our own links
        // (a small send's receipt) went out together.
        let _ = stream.set_timeouts(None, Some(self.config.request_timeout));
        let mut frames = FrameReader::new();
        let mut acks = Vec::new();
        let mut burst: Option<Cork> = None;
        loop {
            if !frames.has_frame() {
                burst = None;
                if !acks.is_empty() {
                    if stream.write_all(&acks).is_err() {
                        return true;
                    }
                    acks.clear();
                }
            }
            let next = frames.next(&mut *stream);
            burst.get_or_insert_with(cork);
            let (op, id, payload) = match next {
                Ok(frame) => frame,
                Err(e) => {
                    if !self.stopping.load(Ordering::Acquire) {
                        log::debug!("control link from process {peer} closed: {e}");
                        if let Some(handler) = self.handler.upgrade() {
                            handler.peer_closed(peer);
                        }
                    }
                    return true;
                }
            };
            let Some(handler) = self.handler.upgrade() else {
                return true;
            };
            if op == OP_BYE {
                // An idle link closed in order: its process lives on.
                let _ = stream.write_all(&acks);
                log::debug!("control link from process {peer} closed (idle)");
                return true;
            }
            let outcome = match (op, split_key(&payload)) {
                (OP_SET, Some((key, value))) => handler.set(peer, key, value),
                (OP_DELETE, Some((key, _))) => handler.delete(peer, key),
                _ => Err(status::invalid_argument(format!(
                    "control link: bad request op {op}"
                ))),
            };
            acks.extend_from_slice(&match outcome {
                Ok(()) => frame(OP_ACK, id, &[]),
                Err(e) => frame(OP_NACK, id, &[&nack_payload(&e)]),
            });
        }
    }
}
