//! `TcpReceiveServer`: the receiver's end of the TCP transport. A
//! connection carries one request at a time, and the next after an OK
//! answer. The front door (admission.rs, one thread) accepts connections,
//! reads each request header under one deadline, checks the token
//! (constant time) and the bounds, answers refusals itself and lands small
//! payloads itself; only an authenticated request with a larger payload is
//! queued for the fixed pool of handler threads, which receive it straight
//! into the registered destination, ack, and give the connection back to
//! the front door. So unauthenticated peers, slow or silent, never hold a
//! handler thread. A request may carry its completion key's value (the
//! receipt): when the destination was registered with that key, it is set
//! once the bytes are in (`set_receipt_sink`).
use std::collections::HashMap;
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::Receiver;
use once_cell::sync::OnceCell;
use parking_lot::Mutex;

use super::admission::{Admission, Admitted, Rejoin};
use super::landing::landed;
use super::server_config::TcpServerConfig;
use super::socket::{is_timeout, recv_exact_into};
use super::wire::{encode_refusal, encode_response};
use crate::status::{self, Result};
use crate::sync::threads::Slice;
use crate::transport::registry::{DestinationRegistry, ReceiptSink};
use crate::transport::staging::StagedDestination;

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
    sink: Arc<OnceCell<ReceiptSink>>,
    accepted: Arc<AtomicU64>,
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
        let (rejoin, rejoined, rejoin_wake) = Rejoin::pair().map_err(|error| {
            status::internal(format!(
                "cannot create the TCP transfer server's rejoin socket: {error}"
            ))
        })?;
        let sink: Arc<OnceCell<ReceiptSink>> = Arc::default();
        let accepted = Arc::new(AtomicU64::new(0));

        // From here on, returning early drops `wake` and `admitted`, which
        // stops whatever threads were already started.
        let mut handler_threads = Vec::with_capacity(config.handler_threads);
        for index in 0..config.handler_threads {
            let queued = queued.clone();
            let active = active.clone();
            let stopping = stopping.clone();
            let config = config.clone();
            let handlers = Handlers {
                active: active.clone(),
                stopping: stopping.clone(),
                config: config.clone(),
                rejoin: rejoin.clone(),
                sink: sink.clone(),
            };
            let handle = crate::sync::threads::spawn(
                format!("crosshost-tcp-recv-{index}"),
                Slice::Short,
                move || handlers.serve(queued),
            )
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
            (rejoined, rejoin_wake),
            sink.clone(),
            accepted.clone(),
        );
        let admission_thread =
            crate::sync::threads::spawn("crosshost-tcp-accept", Slice::Short, move || {
                admission.run()
            })
            .map_err(|error| status::internal(format!("cannot spawn TCP acceptor: {error}")))?;
        log::info!("TCP transfer server listening on {local_addr}");
        Ok(TcpReceiveServer {
            local_addr,
            registry,
            sink,
            accepted,
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

    /// Connections accepted so far (a sender reuses one for many requests).
    pub fn connections_accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Where the receipts that come with the bytes are applied; set once
    /// (later calls are ignored). Without it every request is answered
    /// "receipt not applied", and its sender sets the key itself.
    pub fn set_receipt_sink(&self, sink: ReceiptSink) {
        let _ = self.sink.set(sink);
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

/// What each handler thread shares.
struct Handlers {
    active: Arc<ActiveConnections>,
    stopping: Arc<AtomicBool>,
    config: TcpServerConfig,
    rejoin: Rejoin,
    sink: Arc<OnceCell<ReceiptSink>>,
}

impl Handlers {
    fn serve(self, queued: Receiver<Admitted>) {
        for transfer in queued {
            let id = self.active.next_id.fetch_add(1, Ordering::Relaxed);
            {
                // Checked under the lock that shutdown also takes: a
                // connection is either registered before shutdown cuts them
                // all, or skipped.
                let mut streams = self.active.streams.lock();
                if self.stopping.load(Ordering::SeqCst) {
                    continue;
                }
                if let Ok(clone) = transfer.stream.try_clone() {
                    streams.insert(id, clone);
                }
            }
            let served = self.serve_one(&transfer);
            self.active.streams.lock().remove(&id);
            match served {
                Ok(()) => self.rejoin.give_back(transfer.stream, transfer.peer),
                Err(error) => log::warn!("TCP transfer from {} failed: {error}", transfer.peer),
            }
        }
    }

    /// Receives one authenticated transfer's payload and acks it. Errors
    /// returned here are connection-level problems (already answered to the
    /// peer where possible) for the log; after `Ok` the connection may carry
    /// the next request.
    fn serve_one(&self, transfer: &Admitted) -> io::Result<()> {
        let stream = &transfer.stream;
        let claim = &transfer.claim;
        if let Some(staged) = claim.destination.staged() {
            return self.serve_staged(transfer, staged);
        }
        // SAFETY: admission checked `offset + length <= destination.len()`,
        // and `destination` (an `Arc` clone held for the whole call) keeps
        // its memory valid and writable under the `WritableDestination`
        // contract; no Rust reference covers that memory.
        let received = unsafe {
            let target = claim.destination.as_mut_ptr().add(claim.offset);
            recv_exact_into(stream, target, claim.length)
        };
        match received {
            Ok(()) => (&*stream).write_all(&encode_response(&landed(claim, &self.sink))),
            Err(error) => {
                if is_timeout(&error) {
                    let verdict = status::deadline_exceeded(format!(
                        "receiver timed out waiting for payload bytes after {:?}",
                        self.config.io_timeout
                    ));
                    let _ = (&*stream).write_all(&encode_refusal(verdict));
                }
                Err(error)
            }
        }
    }

    /// A staged destination's payload: chunk by chunk through its pipeline
    /// (transport/staging/); answered OK, with the receipt applied, only
    /// once the last chunk's device copy completed.
    fn serve_staged(&self, transfer: &Admitted, staged: &StagedDestination) -> io::Result<()> {
        let stream = &transfer.stream;
        let claim = &transfer.claim;
        let peer = transfer.peer;
        let mut received = 0usize;
        let mut wire = |into: &mut [u8]| {
            // SAFETY: `into` is a slot of the staging ring, memory of this
            // process valid for its whole length, borrowed mutably here.
            unsafe { recv_exact_into(stream, into.as_mut_ptr(), into.len()) }.map_err(|error| {
                if is_timeout(&error) {
                    status::deadline_exceeded(format!(
                        "receiver timed out waiting for payload bytes from {peer} after {:?}",
                        self.config.io_timeout
                    ))
                } else {
                    status::unavailable(format!(
                        "the sender at {peer} went away after {received} of {} staged bytes: {error}",
                        claim.length
                    ))
                }
            })?;
            received += into.len();
            Ok(())
        };
        match staged.receive(
            claim.offset,
            claim.length,
            &mut wire,
            self.config.io_timeout,
        ) {
            Ok(_) => (&*stream).write_all(&encode_response(&landed(claim, &self.sink))),
            Err(verdict) => {
                let _ = (&*stream).write_all(&encode_refusal(verdict.clone()));
                Err(io::Error::other(verdict.to_string()))
            }
        }
    }
}
