//! The cross-host protocol of one client: receive destinations and their
//! descriptors (`receive.rs`), the send path (`send.rs`), v1 cancellation,
//! peer restarts.
//!
//! Every receive buffer completes through `recv_state` (one AsyncGet, one
//! promise, one future per buffer; keys retired after publication). The
//! sender writes the bytes into the destination first and sets the buffer's
//! completion key only after they are there. The sender never deletes a
//! completion key.
mod receive;
mod send;

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::AtomicI64;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use once_cell::sync::OnceCell;
use parking_lot::Mutex;

use super::memory_budget::{Bound, BudgetLease, MemoryBudget};
use super::recv_state::{PendingReceive, ReceiveConfig, ReceiveTracker};
use super::route::{TransportChoice, UcxLanes};
use super::session::Session;
use crate::backend::Allocation;
use crate::kv::KeyValueStore;
use crate::status::{self, Code, Outcome, Result, Status};
use crate::sync::runner::BurstScope;
use crate::sync::ByteRoute;
use crate::sync::{AsyncWorkRunner, DeadlineTimer, Future, Metrics, PromiseOnce};
use crate::transport::advertise::Advertised;
use crate::transport::registry::ReceiptSink;
use crate::transport::shm_pool::{ShmPool, ShmPoolConfig};
use crate::transport::staging::{Staging, StagingConfig};
use crate::transport::tcp::{TcpReceiveServer, TcpSender};
use crate::transport::ucx::UcxTransport;

#[derive(Clone, Debug)]
pub struct TransferConfig {
    /// A receive not completed by then is DEADLINE_EXCEEDED (key retired).
    pub receive_timeout: Duration,
    /// A send whose destination descriptor or copy takes longer fails.
    pub send_timeout: Duration,
    /// Which transport destinations are offered over (`transport`).
    pub transport: TransportChoice,
    /// Where the TCP receive server binds (port chosen by the OS), and the
    /// address its descriptors name.
    pub advertised: Advertised,
    /// Threads running lifecycle hops and copies.
    pub worker_threads: usize,
    /// Upper bound of the receiver's pool of pre-faulted shared-memory
    /// segments (0: every destination gets a fresh region).
    pub shm_pool_bytes: usize,
    /// Bound on the bytes this client's received host buffers hold at once.
    pub max_receive_bytes: u64,
    /// Bound on the bytes of this client's sends not yet delivered.
    pub max_pending_send_bytes: u64,
    /// Each completion key lives in the process that reads it (the peer
    /// store): a UCX sender may then send the receipt with the bytes, for
    /// the receiver to apply once they are in.
    pub completion_keys_local: bool,
    /// Staging rings (pinned for a CUDA client) and whether host transfers
    /// over TCP and UCX go through them (transport/staging/).
    pub staging: StagingConfig,
    /// The client's counters, when something below the service (the sealed
    /// store) counts into them too; `None`: the service's own.
    pub metrics: Option<Arc<Metrics>>,
}

/// Copy threads: half the cores, and at least two. One copy stream does
/// not reach memory bandwidth (two moved a 64 x 1 MiB batch about twice as
/// fast on the 2-core reference machine: inside JAX 9.4-12.8 ms against
/// 17.5-20.6 ms, three alternating runs each, per-buffer readiness p50
/// 25 µs in crosshost-bench), while more copies than cores only take the
/// CPU from the threads that observe completions and publish readiness (4
/// copy threads on 2 cores put that readiness at ~1.5 ms p50).
fn copy_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| (n.get() / 2).max(2))
        .unwrap_or(2)
}

/// TCP sends at once. A TCP send mostly waits (for the socket, then for the
/// receiver's answer), so sends to a receiver overlap on their own threads
/// and connections instead of queueing behind the copy threads; the
/// receiver lands small ones in one front-door round and has 4 handlers
/// for the rest.
const TCP_SEND_THREADS: usize = 4;

/// Copies up to this size run on the thread where the source became ready.
const INLINE_COPY_BYTES: usize = 256 << 10;

/// Pooled segments are this large; bigger destinations get their own region.
pub const SHM_SEGMENT_BYTES: usize = 256 << 20;

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            receive_timeout: Duration::from_secs(300),
            send_timeout: Duration::from_secs(300),
            transport: TransportChoice::Auto,
            advertised: Advertised {
                bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
                address: IpAddr::V4(Ipv4Addr::LOCALHOST),
                source: "loopback".into(),
            },
            worker_threads: 4,
            shm_pool_bytes: 4 * SHM_SEGMENT_BYTES,
            max_receive_bytes: super::memory_budget::default_max_receive_bytes(),
            max_pending_send_bytes: super::memory_budget::default_max_pending_send_bytes(),
            completion_keys_local: false,
            staging: StagingConfig::default(),
            metrics: None,
        }
    }
}

/// Why a send did not put its bytes in the destination.
enum CopyError {
    /// The destination was not this sender's to write (claimed by another
    /// sender, or no longer there): nothing written, no receipt.
    Refused(Status),
    /// This sender held the destination and failed: the receiver is told.
    Failed(Status),
}

impl From<Status> for CopyError {
    fn from(status: Status) -> CopyError {
        CopyError::Failed(status)
    }
}

/// Shape of one buffer as the descriptor states it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferSpec {
    pub byte_size: usize,
    pub element_type: u32,
    pub dims: Vec<i64>,
}

/// The lifecycle's `RecordOutcome` as the service's caller gives it: the
/// same recording, also handed the memory the bytes landed in (a delegating
/// client fulfils the compute plugin's alias buffer with a view of it); the
/// service binds the memory once the destination exists.
pub type RecordOutcomeWithBytes = Box<dyn FnOnce(&Outcome, &Allocation) + Send>;

/// One buffer to receive.
pub struct ReceiveRequest {
    pub spec: BufferSpec,
    pub record: Option<RecordOutcomeWithBytes>,
}

impl From<BufferSpec> for ReceiveRequest {
    fn from(spec: BufferSpec) -> ReceiveRequest {
        ReceiveRequest { spec, record: None }
    }
}

/// One receive buffer's memory, readiness event and descriptor, and its
/// receive (for the caller to cancel it when it cannot use the buffer).
pub struct ReceiveDestination {
    pub memory: Allocation,
    pub definition: Future,
    pub descriptor: Vec<u8>,
    pub receive: PendingReceive,
}

/// A source buffer for the send path.
pub struct SendSource {
    pub memory: Allocation,
    pub ready: Future,
    pub spec: BufferSpec,
    pub global_device_id: i32,
}

/// Asks whether process N answers (e.g. by opening a control link to it).
pub type Liveness = Box<dyn Fn(i32) -> Result<()> + Send + Sync>;

/// Called with a process that a send now waits on (for its descriptors):
/// the peer store makes a link to it, so that its death is noticed.
pub type Watch = Box<dyn Fn(i32) + Send + Sync>;

type EndWait = Arc<dyn Fn(Status) + Send + Sync>;

/// Sends waiting for a descriptor, each with the receiver it waits on and
/// how to end its wait.
#[derive(Default)]
struct DescribedWaits {
    next: AtomicU64,
    waits: Mutex<HashMap<u64, (i32, EndWait)>>,
}

impl DescribedWaits {
    fn register(&self, peer: i32, end: EndWait) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.waits.lock().insert(id, (peer, end));
        id
    }

    fn remove(&self, id: u64) {
        self.waits.lock().remove(&id);
    }

    fn waits_on(&self, peer: i32) -> bool {
        self.waits.lock().values().any(|(p, _)| *p == peer)
    }

    /// Ends every wait on `peer` with `reason`; returns how many.
    fn fail_peer(&self, peer: i32, reason: &Status) -> usize {
        let ended: Vec<EndWait> = {
            let mut waits = self.waits.lock();
            let ids: Vec<u64> = waits
                .iter()
                .filter(|(_, (p, _))| *p == peer)
                .map(|(id, _)| *id)
                .collect();
            ids.into_iter()
                .filter_map(|id| waits.remove(&id).map(|(_, end)| end))
                .collect()
        };
        for end in &ended {
            end(reason.clone());
        }
        ended.len()
    }
}

struct PendingEntry {
    receive: PendingReceive,
    peer_process: Option<i32>,
}

pub struct TransferService {
    store: Arc<dyn KeyValueStore>,
    tracker: Arc<ReceiveTracker>,
    /// Copies run here, apart from the lifecycle's hops.
    copies: Arc<AsyncWorkRunner>,
    timer: DeadlineTimer,
    metrics: Arc<Metrics>,
    session: Session,
    config: TransferConfig,
    next_v1_transfer: AtomicI64,
    pending: Mutex<HashMap<String, PendingEntry>>,
    /// Sends waiting for their receiver's descriptor, by receiver.
    described_waits: DescribedWaits,
    /// Receivers whose link closed; a new send to one first asks whether it
    /// is back (`liveness`).
    lost: Mutex<HashSet<i32>>,
    liveness: Mutex<Option<Liveness>>,
    watch: Mutex<Option<Watch>>,
    tcp_server: OnceCell<TcpReceiveServer>,
    /// The TCP transport's sending side (its kept connections).
    tcp: TcpSender,
    /// A sweep of `tcp`'s kept connections is scheduled.
    tcp_sweep_scheduled: AtomicBool,
    /// Where TCP sends run, started at the first.
    tcp_sends: OnceCell<Arc<AsyncWorkRunner>>,
    /// Where chunked UCX sends run (each drives its pipeline), started at
    /// the first.
    staged_sends: OnceCell<Arc<AsyncWorkRunner>>,
    /// Where the receipts that come with the bytes set their keys (the peer
    /// store's local part), for a TCP server bound later.
    receipt_sink: OnceCell<ReceiptSink>,
    /// The UCX data plane, when this client reaches peers over UCX.
    ucx: Option<UcxTransport>,
    incarnations: Mutex<HashMap<i32, i64>>,
    pool: ShmPool,
    receive_budget: Arc<MemoryBudget>,
    pending_send_budget: Arc<MemoryBudget>,
    /// The staging rings: for a CUDA client (its buffers cross nodes through
    /// them) and with `stage_host_transfers`.
    staging: Option<Arc<Staging>>,
}

impl TransferService {
    /// The service of one client. `ucx` is its UCX transport when the
    /// session found peers to reach over it (their addresses are in
    /// `session.ucx`); `tcp_server` its TCP receive server when it was
    /// bound before the session (its address is in the session entry),
    /// else one is bound at the first TCP destination.
    pub fn new(
        store: Arc<dyn KeyValueStore>,
        session: Session,
        config: TransferConfig,
        ucx: Option<UcxTransport>,
        tcp_server: Option<TcpReceiveServer>,
    ) -> Arc<Self> {
        // Shared memory of processes that died without unlinking it goes
        // before this client adds its own (once per process).
        crate::transport::shm_reaper::reap_dead_owners_once();
        let metrics = config.metrics.clone().unwrap_or_default();
        // A burst of publications retires its keys with one control-link
        // write per peer (the descriptor keys its senders hold).
        let corked: BurstScope = Arc::new(|| Box::new(crate::transport::control::cork()));
        let runner = Arc::new(AsyncWorkRunner::with_bursts(
            "crosshost-lifecycle",
            config.worker_threads.max(1),
            Some(corked),
        ));
        let tracker = ReceiveTracker::new(
            store.clone(),
            runner,
            metrics.clone(),
            ReceiveConfig {
                timeout: Some(config.receive_timeout),
                retire_keys: true,
            },
        );
        Arc::new(TransferService {
            store,
            tracker,
            copies: Arc::new(AsyncWorkRunner::new("crosshost-copy", copy_threads())),
            timer: DeadlineTimer::new("crosshost-send-deadline"),
            metrics,
            session,
            next_v1_transfer: AtomicI64::new(0),
            pending: Mutex::new(HashMap::new()),
            described_waits: DescribedWaits::default(),
            lost: Mutex::new(HashSet::new()),
            liveness: Mutex::new(None),
            watch: Mutex::new(None),
            tcp_server: tcp_server.map_or_else(OnceCell::new, OnceCell::with_value),
            tcp: TcpSender::new(),
            tcp_sweep_scheduled: AtomicBool::new(false),
            tcp_sends: OnceCell::new(),
            staged_sends: OnceCell::new(),
            receipt_sink: OnceCell::new(),
            ucx,
            incarnations: Mutex::new(HashMap::new()),
            pool: ShmPool::new(ShmPoolConfig {
                segment_len: SHM_SEGMENT_BYTES,
                max_segments: config.shm_pool_bytes / SHM_SEGMENT_BYTES,
            })
            .expect("segment length is a positive multiple of the page size"),
            receive_budget: MemoryBudget::new(Bound::Receive, config.max_receive_bytes),
            pending_send_budget: MemoryBudget::new(
                Bound::PendingSend,
                config.max_pending_send_bytes,
            ),
            staging: (config.staging.stage_host_transfers || config.staging.pinned)
                .then(|| Staging::new(config.staging.clone()))
                .and_then(|made| {
                    made.map_err(|e| log::warn!("staging rings not made: {e}"))
                        .ok()
                }),
            config,
        })
    }

    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The bound on the bytes received host buffers hold at once.
    pub fn max_receive_bytes(&self) -> u64 {
        self.receive_budget.limit()
    }

    /// The bound on the bytes of sends not yet delivered.
    pub fn max_pending_send_bytes(&self) -> u64 {
        self.pending_send_budget.limit()
    }

    /// Reserves a send's bytes until its future is ready, or fails it at
    /// once (RESOURCE_EXHAUSTED naming `max_pending_send_bytes`).
    fn reserve_send(&self, bytes: usize, what: &str) -> Result<BudgetLease> {
        self.pending_send_budget.reserve(bytes as u64, what)
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Receives whose keys are not retired yet.
    pub fn outstanding_receives(&self) -> usize {
        self.tracker.outstanding()
    }

    fn tcp_server(&self) -> Result<&TcpReceiveServer> {
        self.tcp_server.get_or_try_init(|| {
            let server = TcpReceiveServer::bind(SocketAddr::new(self.config.advertised.bind, 0))?;
            if let Some(sink) = self.receipt_sink.get() {
                server.set_receipt_sink(sink.clone());
            }
            Ok(server)
        })
    }

    fn tcp_sends(&self) -> Arc<AsyncWorkRunner> {
        self.tcp_sends
            .get_or_init(|| Arc::new(AsyncWorkRunner::new("crosshost-tcp-send", TCP_SEND_THREADS)))
            .clone()
    }

    /// A chunked UCX send mostly waits (for its copies, for UCX to read a
    /// chunk), so a few run at once, as TCP sends do; one that waits for a
    /// slot holds none (transport/staging/).
    fn staged_sends(&self) -> Arc<AsyncWorkRunner> {
        self.staged_sends
            .get_or_init(|| {
                Arc::new(AsyncWorkRunner::new(
                    "crosshost-staged-send",
                    TCP_SEND_THREADS,
                ))
            })
            .clone()
    }

    /// Where a receipt that comes with the bytes (over UCX or TCP) sets its
    /// key: this process holds the completion keys of its receives
    /// (`completion_keys_local`). Set once, before the first receive.
    pub fn set_receipt_sink(&self, sink: ReceiptSink) {
        if let Some(ucx) = &self.ucx {
            ucx.set_receipt_sink(sink.clone());
        }
        if let Some(server) = self.tcp_server.get() {
            server.set_receipt_sink(sink.clone());
        }
        let _ = self.receipt_sink.set(sink);
    }

    /// Where senders reach the TCP receive server: the advertised address
    /// (the server may listen on a wildcard) and its port.
    fn tcp_endpoint(&self, server: &TcpReceiveServer) -> SocketAddr {
        SocketAddr::new(self.config.advertised.address, server.local_addr().port())
    }

    /// The UCX transport, or why a UCX destination cannot be used here.
    fn ucx(&self, function: &str) -> Result<&UcxTransport> {
        self.ucx.as_ref().ok_or_else(|| {
            status::failed_precondition(format!(
                "{function}: this client has no UCX transport (transport={} and no peer on \
                 another host with UCX; see the log for why UCX was not started)",
                self.config.transport.name()
            ))
        })
    }

    /// What this process's UCX moves bytes over, `None` without UCX.
    pub fn ucx_lanes(&self) -> Option<UcxLanes> {
        self.ucx.as_ref().map(|ucx| {
            if ucx.has_rdma() {
                UcxLanes::Rdma
            } else {
                UcxLanes::TcpOnly
            }
        })
    }

    /// The metrics JSON, with the lanes UCX chose to each peer.
    pub fn metrics_json(&self) -> String {
        let mut labels = Vec::new();
        if let Some(ucx) = &self.ucx {
            let mut lanes: Vec<(u32, String)> = ucx.lanes().into_iter().collect();
            lanes.sort();
            let text: Vec<String> = lanes
                .into_iter()
                .map(|(peer, lanes)| format!("{peer}={lanes}"))
                .collect();
            labels.push((ByteRoute::Ucx, "lanes", text.join(";")));
            labels.push((ByteRoute::Ucx, "version", ucx.version().to_string()));
            // What memory UCX is handed: host memory only (a GPU buffer
            // crosses through the pinned staging ring).
            labels.push((ByteRoute::Ucx, "memory_type", "host".to_string()));
        }
        let gauges = [
            ("received_bytes_held", self.receive_budget.live()),
            ("max_receive_bytes", self.receive_budget.limit()),
            ("pending_send_bytes", self.pending_send_budget.live()),
            ("max_pending_send_bytes", self.pending_send_budget.limit()),
            // UCX messages dropped or refused unread: malformed, a token no
            // destination holds, a part outside its destination.
            (
                "ucx_messages_rejected",
                self.ucx.as_ref().map_or(0, |ucx| ucx.rejected_messages()),
            ),
            (
                "ucx_endpoints_open",
                self.ucx
                    .as_ref()
                    .map_or(0, |ucx| ucx.open_endpoints() as u64),
            ),
            // Workers of the UCX transport, which share max_peer_connections.
            (
                "ucx_workers",
                self.ucx.as_ref().map_or(0, |ucx| ucx.worker_count() as u64),
            ),
            // Endpoint pairs closed by a handshake both sides agreed to.
            (
                "ucx_endpoint_pairs_closed",
                self.ucx.as_ref().map_or(0, |ucx| ucx.closed_by_handshake()),
            ),
            ("staged", self.staging.as_ref().map_or(0, |s| s.staged())),
            (
                "staging_bytes_held",
                self.staging.as_ref().map_or(0, |s| s.bytes_held() as u64),
            ),
            // Pinned host memory of the whole process (every client's rings).
            (
                "pinned_bytes_held",
                crate::backend::cuda::pinned_bytes_held() as u64,
            ),
            (
                "max_pinned_bytes",
                self.config.staging.max_pinned_bytes as u64,
            ),
        ];
        self.metrics.snapshot().to_json(&labels, &gauges)
    }

    fn remote_process(
        &self,
        global_device: i32,
        function: &str,
    ) -> Result<super::session::ProcessEntry> {
        let process = self
            .session
            .process_of_device(global_device)
            .ok_or_else(|| {
                status::invalid_argument(format!(
                    "{function}: no device with global id {global_device}"
                ))
            })?;
        if process.process_index == self.session.process_index {
            return Err(status::invalid_argument(format!(
                "{function}: device {global_device} is addressable here; cross-host transfers must be \
                 between an addressable and a non-addressable device"
            )));
        }
        Ok(process.clone())
    }

    /// the send timeout (for waits a caller controls, such as v1's
    /// descriptor event).
    pub fn bounded_by_send_timeout(self: &Arc<Self>, future: Future, what: &str) -> Future {
        let (promise, bounded) = PromiseOnce::new();
        let timeout = self.config.send_timeout;
        let what = what.to_string();
        let on_timeout = promise.clone();
        let timer_id = self.timer.schedule_after(timeout, move || {
            on_timeout.set(Err(status::deadline_exceeded(format!(
                "{what} was not ready within the send timeout ({timeout:?})"
            ))));
        });
        let service = Arc::downgrade(self);
        future.on_ready(move |outcome| {
            promise.set(outcome.clone());
            if let Some(service) = service.upgrade() {
                service.timer.cancel(timer_id);
            }
        });
        bounded
    }

    /// Records a task snapshot; a peer whose incarnation changed has
    /// restarted, so receives waiting on it fail now instead of at the
    /// deadline.
    pub fn observe_incarnations(&self, snapshot: &[(i32, i64)]) {
        let mut restarted = Vec::new();
        {
            let mut known = self.incarnations.lock();
            for &(task, incarnation) in snapshot {
                match known.insert(task, incarnation) {
                    // 0 is "not known yet", never a restart.
                    Some(old) if old != incarnation && old != 0 => {
                        restarted.push((task, old, incarnation))
                    }
                    _ => {}
                }
            }
        }
        for (task, old, new) in restarted {
            let failed = self.fail_receives_from(
                task,
                status::Status::new(
                    Code::Aborted,
                    format!("peer task {task} restarted (incarnation {old} -> {new}) before the transfer completed"),
                ),
            );
            log::warn!(
                "peer task {task} restarted (incarnation {old} -> {new}); failed {failed} receives"
            );
        }
    }

    /// How to ask whether a lost receiver is back (the peer store's links).
    pub fn set_liveness(&self, liveness: Liveness) {
        *self.liveness.lock() = Some(liveness);
    }

    /// How to watch a process that a send waits on.
    pub fn set_watch(&self, watch: Watch) {
        *self.watch.lock() = Some(watch);
    }

    fn watch(&self, process: i32) {
        if let Some(watch) = &*self.watch.lock() {
            watch(process);
        }
    }

    /// Whether a receive from `process`, or a send waiting for its
    /// descriptors, is pending here: its link must stay open, since its
    /// closing is how the process's death shows.
    pub fn waits_on(&self, process: i32) -> bool {
        self.pending
            .lock()
            .values()
            .any(|e| e.peer_process == Some(process))
            || self.described_waits.waits_on(process)
    }

    /// Process `process` is gone (its link closed): its receives fail, and
    /// so do the sends waiting for its descriptors or (over UCX) for its
    /// acknowledgement; new sends to it fail at once until it answers again. Returns (receives, sends) failed.
    pub fn peer_lost(&self, process: i32) -> (usize, usize) {
        self.lost.lock().insert(process);
        // Sends whose bytes left and whose acknowledgement would come from
        // it fail too, rather than at their deadline.
        if let (Some(ucx), Ok(process)) = (&self.ucx, u32::try_from(process)) {
            ucx.peer_lost(process);
        }
        let receives = self.fail_receives_from(
            process,
            status::unavailable(format!(
                "process {process} closed its link to this process (it exited, failed or \
                 destroyed its client) before the transfer completed"
            )),
        );
        let sends = self.described_waits.fail_peer(
            process,
            &status::unavailable(format!(
                "PJRT_Transfers_PJRT_Client_CrossHostSendBuffers: the receiving process \
                 {process} is gone (its link to this process closed) before it described the \
                 destination; the buffer was not sent"
            )),
        );
        (receives, sends)
    }

    /// OK unless `process` was lost and still does not answer.
    fn check_receiver_alive(&self, process: i32, function: &str) -> Result<()> {
        if !self.lost.lock().contains(&process) {
            return Ok(());
        }
        let answer = match &*self.liveness.lock() {
            Some(liveness) => liveness(process),
            None => Err(status::unavailable("no way to reach it")),
        };
        match answer {
            Ok(()) => {
                self.lost.lock().remove(&process);
                Ok(())
            }
            Err(e) => Err(status::unavailable(format!(
                "{function}: the receiving process {process} is gone (its link to this process \
                 closed, and it does not answer: {}); nothing was sent",
                e.message
            ))),
        }
    }

    /// Fails every pending receive whose sender is process `task` (it
    /// restarted or is gone), instead of leaving them to their deadline.
    /// Returns how many were failed.
    pub fn fail_receives_from(&self, task: i32, reason: Status) -> usize {
        let victims: Vec<PendingReceive> = self
            .pending
            .lock()
            .values()
            .filter(|e| e.peer_process == Some(task))
            .map(|e| e.receive.clone())
            .collect();
        for receive in &victims {
            let _ = receive.cancel(reason.clone());
        }
        victims.len()
    }
}

#[cfg(test)]
mod tests;
