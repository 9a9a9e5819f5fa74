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
use super::transfer::{stripes, workers_per_process, Payload, SendDone, Transfer};
use super::worker::{SendPart, WorkerHandle};
use crate::status::Result;
use crate::transport::auth_token::AuthToken;
use crate::transport::connections::ConnectionLimits;
use crate::transport::registry::DestinationRegistry;
use crate::transport::registry::ReceiptSink;

pub struct UcxTransport {
    workers: Vec<WorkerHandle>,
    registry: Arc<DestinationRegistry>,
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
        let workers = (0..count.clamp(1, u16::MAX as usize))
            .map(|index| WorkerHandle::start(ucx, me, index as u16, registry.clone(), sink.clone()))
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
            workers,
            registry,
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
        for worker in &self.workers {
            worker.set_peers(peers.clone());
        }
    }

    /// Wires up the connections to every peer now (a client makes each on
    /// first use instead; tests wire up to start from connected endpoints).
    pub fn connect(&self, timeout: Duration) -> Result<()> {
        for worker in &self.workers {
            worker.connect(timeout)?;
        }
        Ok(())
    }

    /// The lanes UCX chose to each peer (over all workers) that carried a
    /// transfer.
    /// Process `process` is gone (its control link closed): its sends
    /// waiting for an acknowledgement fail now, not at their deadline.
    pub fn peer_lost(&self, process: u32) {
        for worker in &self.workers {
            worker.peer_lost(process);
        }
    }

    pub fn lanes(&self) -> HashMap<u32, String> {
        let mut lanes: HashMap<u32, Vec<String>> = HashMap::new();
        for worker in &self.workers {
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

    /// DATA messages refused (unknown token, bad header or bounds).
    /// Endpoints open to peers, over all workers.
    pub fn open_endpoints(&self) -> usize {
        self.workers.iter().map(WorkerHandle::open_endpoints).sum()
    }

    /// Bounds each worker's sweeps keep its open endpoints to (the
    /// client's `max_peer_connections`, `peer_idle_timeout_ms`).
    pub fn set_connection_limits(&self, limits: &ConnectionLimits) {
        for worker in &self.workers {
            worker.set_connection_limits(limits.clone());
        }
    }

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
}
