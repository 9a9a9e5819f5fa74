//! `UcxTransport`: a client's UCX data plane, a few workers (each its own
//! context, progress thread and connections) writing one registry of
//! destinations. Worker k of a process talks to worker k of each peer (the
//! peer's worker k mod its count). A small buffer goes whole to one worker,
//! in turn; a large one is striped, one part per worker, so that both ends
//! copy and process packets on several cores at once.
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use once_cell::sync::OnceCell;

use super::library::LoadedUcx;
use super::stream::{ChunkOrder, ChunkPoster, ChunkSender, KeepAlive, StagedStreams};
use super::transfer::{stripes, workers_per_process, Payload, SendDone, Transfer};
use super::wire::{ChunkHeader, MAX_RECEIPT_LEN};
use super::worker::{SendPart, WorkerHandle};
use crate::status::{self, Result};
use crate::transport::auth_token::AuthToken;
use crate::transport::connections::ConnectionLimits;
use crate::transport::registry::DestinationRegistry;
use crate::transport::registry::ReceiptSink;
use crate::transport::staging::Stop;

pub struct UcxTransport {
    workers: Arc<Vec<WorkerHandle>>,
    registry: Arc<DestinationRegistry>,
    streams: Arc<StagedStreams>,
    sink: Arc<OnceCell<ReceiptSink>>,
    next: AtomicUsize,
    version: String,
    rdma: bool,
}

impl std::fmt::Debug for UcxTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "UcxTransport(UCX {}, {} workers)",
            self.version,
            self.workers.len()
        )
    }
}

impl UcxTransport {
    /// Starts this process's workers (`me` among the job's processes).
    pub fn start(ucx: &LoadedUcx, me: u32) -> Result<UcxTransport> {
        UcxTransport::with_workers(ucx, me, workers_per_process())
    }

    pub fn with_workers(ucx: &LoadedUcx, me: u32, count: usize) -> Result<UcxTransport> {
        let registry = DestinationRegistry::new();
        let sink: Arc<OnceCell<ReceiptSink>> = Arc::default();
        let streams = StagedStreams::new();
        let workers = (0..count.clamp(1, u16::MAX as usize))
            .map(|index| {
                WorkerHandle::start(
                    ucx,
                    me,
                    index as u16,
                    registry.clone(),
                    sink.clone(),
                    streams.clone(),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        // Which lanes UCX can have toward a peer decides whether the TCP
        // transport is the faster for some transfers (`transfer::route`).
        // A library that cannot say is taken to have RDMA: UCX is then
        // preferred, as before this was asked.
        let rdma = match super::capabilities::query(ucx) {
            Ok(found) => !found.rdma().is_empty(),
            Err(e) => {
                log::warn!(
                    "UCX: could not list its transports ({e}); taking it to have RDMA lanes"
                );
                true
            }
        };
        Ok(UcxTransport {
            workers: Arc::new(workers),
            registry,
            streams,
            sink,
            next: AtomicUsize::new(0),
            version: ucx.version.clone(),
            rdma,
        })
    }

    /// Whether this host's UCX has an RDMA transport (verbs, EFA): else
    /// its lanes toward any peer are TCP, as the plugin's TCP transport's.
    pub fn has_rdma(&self) -> bool {
        self.rdma
    }

    /// The workers' addresses, in order, for the job's other processes.
    pub fn addresses(&self) -> Vec<Vec<u8>> {
        self.workers.iter().map(|w| w.address().to_vec()).collect()
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    /// The destinations UCX senders may write.
    pub fn registry(&self) -> &Arc<DestinationRegistry> {
        &self.registry
    }

    /// How receipts that come with the bytes are applied (set once, by the
    /// client whose store holds its completion keys itself).
    pub fn set_receipt_sink(&self, sink: ReceiptSink) {
        let _ = self.sink.set(sink);
    }

    /// Every process's worker addresses (this one's included).
    pub fn set_peers(&self, peers: &HashMap<u32, Vec<Vec<u8>>>) {
        for worker in self.workers.iter() {
            worker.set_peers(peers.clone());
        }
    }

    /// Wires up the connections to every peer now (a client makes each on
    /// first use instead; tests wire up to start from connected endpoints).
    pub fn connect(&self, timeout: Duration) -> Result<()> {
        for worker in self.workers.iter() {
            worker.connect(timeout)?;
        }
        Ok(())
    }

    /// The lanes UCX chose to each peer (over all workers) that carried a
    /// transfer.
    /// Process `process` is gone (its control link closed): its sends
    /// waiting for an acknowledgement fail now, not at their deadline.
    pub fn peer_lost(&self, process: u32) {
        for worker in self.workers.iter() {
            worker.peer_lost(process);
        }
    }

    pub fn lanes(&self) -> HashMap<u32, String> {
        let mut lanes: HashMap<u32, Vec<String>> = HashMap::new();
        for worker in self.workers.iter() {
            for (peer, text) in worker.lanes() {
                let known = lanes.entry(peer).or_default();
                for lane in text.split(',').filter(|l| !l.is_empty()) {
                    if !known.iter().any(|k| k == lane) {
                        known.push(lane.to_string());
                    }
                }
            }
        }
        lanes
            .into_iter()
            .map(|(peer, list)| (peer, list.join(",")))
            .collect()
    }

    /// Parts whose bytes UCX still holds.
    pub fn sends_held(&self) -> usize {
        self.workers.iter().map(WorkerHandle::sends_held).sum()
    }

    /// Workers (each with its own endpoints to the peers).
    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    /// Endpoints open to peers, over all workers.
    pub fn open_endpoints(&self) -> usize {
        self.workers.iter().map(WorkerHandle::open_endpoints).sum()
    }

    /// Sends a close handshake's message to process `to` as it is, for
    /// tests that forge one.
    #[cfg(test)]
    pub fn send_close_message(
        &self,
        to: u32,
        message: super::wire::CloseMessage,
    ) -> crate::status::Result<()> {
        self.workers[0].send_close_message(to, message)
    }

    /// Endpoint tags the workers hold (open, closing and retired).
    #[cfg(test)]
    pub fn endpoint_tags(&self) -> usize {
        self.workers.iter().map(WorkerHandle::endpoint_tags).sum()
    }

    /// Endpoint pairs closed by a handshake both sides agreed to.
    pub fn closed_by_handshake(&self) -> u64 {
        self.workers
            .iter()
            .map(WorkerHandle::closed_by_handshake)
            .sum()
    }

    /// The bounds the workers keep their endpoints to (the client's
    /// `max_peer_connections` and `peer_idle_timeout_ms`): an idle endpoint
    /// unused for the timeout, and beyond the bound the least recently used
    /// idle ones, close by a handshake with the peer (`worker.rs`), never
    /// under a peer that still sends on the pair. The bound is the
    /// process's: each of the `w` workers keeps `max_open / w` idle ones.
    pub fn set_connection_limits(&self, limits: &ConnectionLimits) {
        let per_worker = ConnectionLimits {
            max_open: limits.max_open / self.workers.len().max(1),
            ..limits.clone()
        };
        for worker in self.workers.iter() {
            worker.set_connection_limits(per_worker.clone());
        }
    }

    /// Staged streams being landed now.
    pub fn staged_streams(&self) -> usize {
        self.streams.count()
    }

    /// DATA messages refused (unknown token, bad header or bounds).
    pub fn rejected_messages(&self) -> u64 {
        self.workers
            .iter()
            .map(WorkerHandle::rejected_messages)
            .sum()
    }

    /// Sends `payload` into the destination registered under `token` at
    /// process `peer`, `offset` bytes in, with `receipt` when the receiver
    /// should set the completion key itself once every byte is in (each part
    /// carries it; the last to land applies it). `done` hears the
    /// receiver's verdict (delivered once every byte is in the
    /// destination), a failure, or DEADLINE_EXCEEDED after `timeout`.
    /// `mark_key` is the completion key's hash for the timeline's marks
    /// (0 when the timeline is off).
    #[allow(clippy::too_many_arguments)]
    pub fn send(
        &self,
        peer: u32,
        token: AuthToken,
        offset: u64,
        payload: Payload,
        receipt: Option<Vec<u8>>,
        timeout: Duration,
        done: SendDone,
        mark_key: u64,
    ) {
        let parts = stripes(payload.len(), self.workers.len());
        let receipt = receipt.unwrap_or_default();
        let first = self.next.fetch_add(parts.len(), Ordering::Relaxed);
        let transfer = Arc::new(Transfer::new(payload, parts.len(), done));
        let deadline = Instant::now() + timeout;
        for (part, &(start, len)) in parts.iter().enumerate() {
            let worker = &self.workers[(first + part) % self.workers.len()];
            worker.send_part(SendPart {
                peer,
                token,
                part: part as u16,
                parts: parts.len() as u16,
                offset: offset + start as u64,
                transfer: transfer.clone(),
                start,
                len,
                deadline,
                timeout,
                receipt: receipt.clone(),
                mark_key,
            });
        }
    }

    /// Opens a chunked stream of `len` bytes into the destination
    /// registered under `token` at process `peer`, `offset` bytes in: each
    /// chunk message at most `chunk_limit` bytes (the receiver's staging
    /// chunk, or any size where it does not stage) and, where
    /// `rendezvous`, forced to rendezvous. `keep` keeps the memory chunks
    /// are sent from mapped while UCX may read it. `done` hears the
    /// stream's one verdict (see `send`); the returned sender's stop is
    /// raised if the stream fails first.
    #[allow(clippy::too_many_arguments)]
    pub fn open_stream(
        &self,
        peer: u32,
        token: AuthToken,
        offset: u64,
        len: usize,
        chunk_limit: usize,
        rendezvous: bool,
        receipt: Option<Vec<u8>>,
        timeout: Duration,
        keep: KeepAlive,
        done: SendDone,
    ) -> Result<ChunkSender> {
        let stop = Stop::new();
        let on_failure = stop.clone();
        let transfer = Arc::new(Transfer::new(
            Payload::owned(Vec::new()),
            1,
            Box::new(move |outcome| {
                if let Err(e) = &outcome {
                    on_failure.raise(e.clone());
                }
                done(outcome);
            }),
        ));
        let deadline = Instant::now() + timeout;
        let home = self.next.fetch_add(1, Ordering::Relaxed) % self.workers.len();
        let stream_request =
            match self.workers[home].await_stream(peer, token, transfer.clone(), deadline, timeout)
            {
                Ok(request) => request,
                Err(e) => {
                    transfer.fail(e.clone());
                    return Err(e);
                }
            };
        let receipt = receipt
            .filter(|receipt| receipt.len() <= MAX_RECEIPT_LEN)
            .unwrap_or_default();
        let poster: Arc<dyn ChunkPoster> = Arc::new(Poster {
            workers: Arc::downgrade(&self.workers),
            count: self.workers.len(),
        });
        Ok(ChunkSender {
            poster,
            peer,
            transfer,
            deadline,
            timeout,
            header: ChunkHeader {
                token,
                stream_offset: offset,
                stream_length: len as u64,
                offset,
                length: 0,
                request: 0,
                stream_request,
                sender: 0,
                sender_worker: 0,
                home_worker: home as u16,
                receipt,
            },
            chunk_limit: chunk_limit.max(1),
            rendezvous,
            keep,
            stop,
            next_worker: home + 1,
        })
    }
}

/// A stream's way to the workers: weak, so a stream outliving its
/// transport finds it stopped.
struct Poster {
    workers: std::sync::Weak<Vec<WorkerHandle>>,
    count: usize,
}

impl ChunkPoster for Poster {
    fn workers(&self) -> usize {
        self.count
    }

    fn post(&self, worker: usize, chunk: ChunkOrder) {
        match self.workers.upgrade() {
            Some(workers) => workers[worker % workers.len()].send_chunk(chunk),
            None => {
                let stopped = status::unavailable("UCX transport: the client is being destroyed");
                chunk.sent.set(Err(stopped.clone()));
                chunk.transfer.fail(stopped);
            }
        }
    }

    fn abandon(&self, home: usize, stream_request: u64) {
        if let Some(workers) = self.workers.upgrade() {
            workers[home % workers.len()].abandon(stream_request);
        }
    }
}
