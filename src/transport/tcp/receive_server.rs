//! `TcpReceiveServer`: the receiver's end of the TCP transport. Each
//! connection carries one transfer. The front door (admission.rs, one
//! thread) accepts connections, reads their request header under one
//! deadline counted from accept, checks the token (constant time) and the
//! bounds, and answers refusals itself; only an authenticated connection is
//! queued for the fixed pool of handler threads, which receive the payload
//! straight into the registered destination and ack. So unauthenticated
//! peers, slow or silent, never hold a handler thread.
use std::collections::HashMap;
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::Receiver;
use parking_lot::Mutex;

use super::admission::{Admission, Admitted};
use super::server_config::TcpServerConfig;
use super::socket::{is_timeout, recv_exact_into};
use super::wire::encode_response;
use crate::status::{self, Result};
use crate::transport::registry::DestinationRegistry;

/// Streams currently being served, so that shutdown can cut them off
/// instead of waiting for their timeouts.
#[derive(Default)]
struct ActiveConnections {
    next_id: AtomicU64,
    streams: Mutex<HashMap<u64, TcpStream>>,
}

pub struct TcpReceiveServer {
    local_addr: SocketAddr,
    registry: Arc<DestinationRegistry>,
    active: Arc<ActiveConnections>,
    stopping: Arc<AtomicBool>,
    /// Dropping it wakes the front door to shut down.
    wake: Option<UnixStream>,
    admission_thread: Option<JoinHandle<()>>,
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
        if config.max_pending_connections == 0 {
            return Err(status::invalid_argument(
                "TcpServerConfig.max_pending_connections must be at least 1",
            ));
        }
        if config.header_deadline.is_zero() {
            return Err(status::invalid_argument(
                "TcpServerConfig.header_deadline must be positive",
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
        listener.set_nonblocking(true).map_err(|error| {
            status::internal(format!(
                "cannot make the TCP transfer server's listener nonblocking: {error}"
            ))
        })?;
        let (wake, woken) = UnixStream::pair().map_err(|error| {
            status::internal(format!(
                "cannot create the TCP transfer server's wake-up socket: {error}"
            ))
        })?;
        let registry = DestinationRegistry::new();
        let active = Arc::new(ActiveConnections::default());
        let stopping = Arc::new(AtomicBool::new(false));
        let (admitted, queued) = crossbeam_channel::unbounded::<Admitted>();

        // From here on, returning early drops `wake` and `admitted`, which
        // stops whatever threads were already started.
        let mut handler_threads = Vec::with_capacity(config.handler_threads);
        for index in 0..config.handler_threads {
            let queued = queued.clone();
            let active = active.clone();
            let stopping = stopping.clone();
            let config = config.clone();
            let handle = std::thread::Builder::new()
                .name(format!("crosshost-tcp-recv-{index}"))
                .spawn(move || serve_connections(queued, &active, &stopping, &config))
                .map_err(|error| status::internal(format!("cannot spawn TCP handler: {error}")))?;
            handler_threads.push(handle);
        }
        let admission = Admission::new(
            listener,
            woken,
            stopping.clone(),
            registry.clone(),
            config,
            admitted,
        );
        let admission_thread = std::thread::Builder::new()
            .name("crosshost-tcp-accept".into())
            .spawn(move || admission.run())
            .map_err(|error| status::internal(format!("cannot spawn TCP acceptor: {error}")))?;
        log::info!("TCP transfer server listening on {local_addr}");
        Ok(TcpReceiveServer {
            local_addr,
            registry,
            active,
            stopping,
            wake: Some(wake),
            admission_thread: Some(admission_thread),
            handler_threads,
        })
    }

    /// The address senders connect to (the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The destinations senders may write through this server.
    pub fn registry(&self) -> &Arc<DestinationRegistry> {
        &self.registry
    }
}

impl Drop for TcpReceiveServer {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        // Closing our end makes the front door's poll return; it then closes
        // the listener and every unauthenticated connection, and drops the
        // queue's sender, which ends the handlers' loops.
        drop(self.wake.take());
        if let Some(thread) = self.admission_thread.take() {
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

fn serve_connections(
    queued: Receiver<Admitted>,
    active: &ActiveConnections,
    stopping: &AtomicBool,
    config: &TcpServerConfig,
) {
    for transfer in queued {
        let id = active.next_id.fetch_add(1, Ordering::Relaxed);
        {
            // Checked under the lock that shutdown also takes: a connection is
            // either registered before shutdown cuts them all, or skipped.
            let mut streams = active.streams.lock();
            if stopping.load(Ordering::SeqCst) {
                continue;
            }
            if let Ok(clone) = transfer.stream.try_clone() {
                streams.insert(id, clone);
            }
        }
        if let Err(error) = serve_one(&transfer, config) {
            log::warn!("TCP transfer from {} failed: {error}", transfer.peer);
        }
        active.streams.lock().remove(&id);
    }
}

/// Receives one authenticated transfer's payload and acks it. Errors
/// returned here are connection-level problems (already answered to the
/// peer where possible) for the log.
fn serve_one(transfer: &Admitted, config: &TcpServerConfig) -> io::Result<()> {
    let stream = &transfer.stream;
    // SAFETY: admission checked `offset + length <= destination.len()`, and
    // `destination` (an `Arc` clone held for the whole call) keeps its memory
    // valid and writable under the `WritableDestination` contract; no Rust
    // reference covers that memory.
    let received = unsafe {
        let target = transfer.destination.as_mut_ptr().add(transfer.offset);
        recv_exact_into(stream, target, transfer.length)
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
