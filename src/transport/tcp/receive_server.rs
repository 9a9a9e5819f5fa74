//! `TcpReceiveServer`: the receiver's end of the TCP transport. One accept
//! thread hands connections to a fixed pool of handler threads (bounded
//! queue, so a flood of connections waits in the listen backlog instead of
//! spawning threads). Each connection carries one transfer: the handler
//! checks the token (constant time) and the bounds, receives the payload
//! straight into the registered destination, and acks.
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use super::socket::{is_timeout, recv_exact_into, set_large_buffers};
use super::wire::{encode_response, RequestHeader, REQUEST_HEADER_LEN};
use crate::status::{self, Result};
use crate::transport::auth_token::AuthToken;
use crate::transport::destination::WritableDestination;

#[derive(Clone, Debug)]
pub struct TcpServerConfig {
    /// Connections served at once; more wait in the listen backlog.
    pub handler_threads: usize,
    /// Bound on every blocking read or write of a connection; a stalled or
    /// dead peer costs at most this long per operation.
    pub io_timeout: Duration,
    /// After refusing a request, up to this many payload bytes are read and
    /// discarded so the sender can still read the refusal; beyond it the
    /// connection is simply closed.
    pub max_discard_bytes: u64,
}

impl Default for TcpServerConfig {
    fn default() -> TcpServerConfig {
        TcpServerConfig {
            handler_threads: 4,
            io_timeout: Duration::from_secs(30),
            max_discard_bytes: 64 << 20,
        }
    }
}

/// The destinations senders may write, by token. A token is single-use: the
/// first accepted transfer claims (removes) it, so a second or replayed
/// sender is refused instead of writing a destination that may already be
/// published. Memory stays valid while a write is in flight because handlers
/// hold their own `Arc` clone.
#[derive(Default)]
struct Registry {
    destinations: Mutex<HashMap<AuthToken, Arc<dyn WritableDestination>>>,
}

impl Registry {
    fn claim(&self, token: &AuthToken) -> Option<Arc<dyn WritableDestination>> {
        // `AuthToken`'s equality is the constant-time compare, and the map's
        // hasher is randomly keyed, so lookup timing reveals nothing useful
        // about registered tokens.
        self.destinations.lock().remove(token)
    }
}

/// Streams currently being served, so that shutdown can cut them off
/// instead of waiting for their timeouts.
#[derive(Default)]
struct ActiveConnections {
    next_id: AtomicU64,
    streams: Mutex<HashMap<u64, TcpStream>>,
}

pub struct TcpReceiveServer {
    local_addr: SocketAddr,
    listener: Arc<TcpListener>,
    registry: Arc<Registry>,
    active: Arc<ActiveConnections>,
    stopping: Arc<AtomicBool>,
    accept_thread: Option<JoinHandle<()>>,
    handler_threads: Vec<JoinHandle<()>>,
}

impl TcpReceiveServer {
    pub fn bind(addr: SocketAddr) -> Result<TcpReceiveServer> {
        TcpReceiveServer::bind_with(addr, TcpServerConfig::default())
    }

    pub fn bind_with(addr: SocketAddr, config: TcpServerConfig) -> Result<TcpReceiveServer> {
        if config.handler_threads == 0 {
            return Err(status::invalid_argument(
                "TcpServerConfig.handler_threads must be at least 1",
            ));
        }
        let listener = TcpListener::bind(addr).map_err(|error| {
            status::unavailable(format!(
                "cannot bind TCP transfer server to {addr}: {error}"
            ))
        })?;
        let local_addr = listener.local_addr().map_err(|error| {
            status::internal(format!("TCP transfer server has no local address: {error}"))
        })?;
        let listener = Arc::new(listener);
        let registry = Arc::new(Registry::default());
        let active = Arc::new(ActiveConnections::default());
        let stopping = Arc::new(AtomicBool::new(false));
        let (connections, queued) = crossbeam_channel::bounded::<TcpStream>(config.handler_threads);

        let mut handler_threads = Vec::with_capacity(config.handler_threads);
        for index in 0..config.handler_threads {
            let queued = queued.clone();
            let registry = registry.clone();
            let active = active.clone();
            let stopping = stopping.clone();
            let config = config.clone();
            let handle = std::thread::Builder::new()
                .name(format!("crosshost-tcp-recv-{index}"))
                .spawn(move || serve_connections(queued, &registry, &active, &stopping, &config))
                .map_err(|error| status::internal(format!("cannot spawn TCP handler: {error}")))?;
            handler_threads.push(handle);
        }
        let accept_thread = {
            let listener = listener.clone();
            let stopping = stopping.clone();
            std::thread::Builder::new()
                .name("crosshost-tcp-accept".into())
                .spawn(move || accept_connections(&listener, &stopping, connections))
                .map_err(|error| status::internal(format!("cannot spawn TCP acceptor: {error}")))?
        };
        log::info!("TCP transfer server listening on {local_addr}");
        Ok(TcpReceiveServer {
            local_addr,
            listener,
            registry,
            active,
            stopping,
            accept_thread: Some(accept_thread),
            handler_threads,
        })
    }

    /// The address senders connect to (the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Lets senders presenting `token` write into `destination`.
    /// `ALREADY_EXISTS` if the token is registered already.
    pub fn register(
        &self,
        token: AuthToken,
        destination: Arc<dyn WritableDestination>,
    ) -> Result<()> {
        let mut destinations = self.registry.destinations.lock();
        if destinations.contains_key(&token) {
            return Err(status::already_exists(
                "a destination is already registered under this auth token",
            ));
        }
        destinations.insert(token, destination);
        Ok(())
    }

    /// Stops accepting writes for `token` and returns its destination;
    /// `None` when a sender already claimed it (a write may be in progress
    /// and finishes into the still valid memory) or it was never registered.
    pub fn unregister(&self, token: &AuthToken) -> Option<Arc<dyn WritableDestination>> {
        self.registry.destinations.lock().remove(token)
    }

    pub fn registered_count(&self) -> usize {
        self.registry.destinations.lock().len()
    }
}

impl Drop for TcpReceiveServer {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        // SAFETY: the listener is kept alive by our own `Arc`, so the
        // descriptor is valid; shutting down a listening socket makes the
        // acceptor's blocked `accept` return with an error.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(thread) = self.accept_thread.take() {
            let _ = thread.join();
        }
        for stream in self.active.streams.lock().values() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for thread in self.handler_threads.drain(..) {
            let _ = thread.join();
        }
        log::info!("TCP transfer server on {} stopped", self.local_addr);
    }
}

fn accept_connections(
    listener: &TcpListener,
    stopping: &AtomicBool,
    connections: Sender<TcpStream>,
) {
    loop {
        match listener.accept() {
            Ok((stream, peer)) => {
                if stopping.load(Ordering::SeqCst) {
                    return;
                }
                log::debug!("TCP transfer connection from {peer}");
                if connections.send(stream).is_err() {
                    return;
                }
            }
            Err(error) => {
                if stopping.load(Ordering::SeqCst) {
                    return;
                }
                log::warn!("TCP transfer server accept failed: {error}");
                // Out of descriptors and similar: back off instead of spinning.
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn serve_connections(
    queued: Receiver<TcpStream>,
    registry: &Registry,
    active: &ActiveConnections,
    stopping: &AtomicBool,
    config: &TcpServerConfig,
) {
    for stream in queued {
        let id = active.next_id.fetch_add(1, Ordering::Relaxed);
        {
            // Checked under the lock that shutdown also takes: a connection is
            // either registered before shutdown cuts them all, or skipped.
            let mut streams = active.streams.lock();
            if stopping.load(Ordering::SeqCst) {
                continue;
            }
            if let Ok(clone) = stream.try_clone() {
                streams.insert(id, clone);
            }
        }
        let peer = stream
            .peer_addr()
            .map(|addr| addr.to_string())
            .unwrap_or_else(|_| "<unknown peer>".into());
        if let Err(error) = serve_one(&stream, registry, config) {
            log::warn!("TCP transfer from {peer} failed: {error}");
        }
        active.streams.lock().remove(&id);
    }
}

/// Serves one transfer. Errors returned here are connection-level problems
/// (already answered to the peer where possible) for the log.
fn serve_one(stream: &TcpStream, registry: &Registry, config: &TcpServerConfig) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(config.io_timeout))?;
    stream.set_write_timeout(Some(config.io_timeout))?;
    set_large_buffers(stream);

    let mut header_bytes = [0u8; REQUEST_HEADER_LEN];
    (&*stream).read_exact(&mut header_bytes)?;
    let header = match RequestHeader::decode(&header_bytes) {
        Ok(header) => header,
        Err(error) => {
            // Not our protocol: answer and close without reading further.
            (&*stream).write_all(&encode_response(&Err(error)))?;
            return Ok(());
        }
    };
    let Some(destination) = registry.claim(&header.token) else {
        return refuse(
            stream,
            status::unauthenticated(
                "no destination is registered for this auth token (unknown, or the receive already completed or was cancelled)",
            ),
            header.length,
            config,
        );
    };
    let end = header.offset.checked_add(header.length);
    if end.is_none_or(|end| end > destination.len() as u64) {
        // Nothing was written: the rightful sender may still use the token.
        registry
            .destinations
            .lock()
            .insert(header.token, destination.clone());
        let message = format!(
            "write of {} bytes at offset {} exceeds the {}-byte destination",
            header.length,
            header.offset,
            destination.len()
        );
        return refuse(stream, status::out_of_range(message), header.length, config);
    }
    let (offset, length) = (header.offset as usize, header.length as usize);
    // SAFETY: `offset + length <= destination.len()` was checked above and
    // `destination` (an `Arc` clone held for the whole call) keeps its memory
    // valid and writable under the `WritableDestination` contract; no Rust
    // reference covers that memory.
    let received = unsafe {
        let target = destination.as_mut_ptr().add(offset);
        recv_exact_into(stream, target, length)
    };
    match received {
        Ok(()) => (&*stream).write_all(&encode_response(&Ok(()))),
        Err(error) => {
            if is_timeout(&error) {
                let verdict = status::deadline_exceeded(format!(
                    "receiver timed out waiting for payload bytes after {:?}",
                    config.io_timeout
                ));
                let _ = (&*stream).write_all(&encode_response(&Err(verdict)));
            }
            Err(error)
        }
    }
}

/// Answers with an error, then reads and discards the payload (up to the
/// configured bound) so that the sender gets to read the answer instead of
/// a connection reset.
fn refuse(
    stream: &TcpStream,
    verdict: status::Status,
    payload_length: u64,
    config: &TcpServerConfig,
) -> io::Result<()> {
    log::warn!("refusing TCP transfer: {verdict}");
    (&*stream).write_all(&encode_response(&Err(verdict)))?;
    let discard = payload_length.min(config.max_discard_bytes);
    io::copy(&mut stream.take(discard), &mut io::sink())?;
    Ok(())
}
