//! The cross-host protocol of one client: receive destinations and their
//! descriptors, the send path, v1 cancellation, peer restarts.
//!
//! Every receive buffer completes through `recv_state` (one AsyncGet, one
//! promise, one future per buffer; keys retired after publication). The
//! sender writes the bytes into the destination first and sets the buffer's
//! completion key only after they are there. The sender never deletes a
//! completion key.
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use once_cell::sync::{Lazy, OnceCell};
use parking_lot::Mutex;

use super::cuda_path;
use super::descriptor::{AllocationHandle, Descriptor};
use super::host_destination::{local_region, Destination, HostDestination, HostRoute};
use super::keys::{descriptor_key, CompletionKey};
use super::receipt::Receipt;
use super::receive_budget::ReceiveBudget;
use super::recv_state::{PendingReceive, ReceiveConfig, ReceiveTracker, RecordEvent};
use super::session::Session;
use crate::backend::{Allocation, DevicePlacement};
use crate::kv::KeyValueStore;
use crate::status::{self, Code, Outcome, Result, Status};
use crate::sync::{kill_points, AsyncWorkRunner, DeadlineTimer, Future, Metrics, PromiseOnce};
use crate::transport::auth_token::AuthToken;
use crate::transport::claim::ClaimRange;
use crate::transport::host_identity::HostIdentity;
use crate::transport::random::random_u64;
use crate::transport::shm::{shm_name_owner, SharedRegion};
use crate::transport::shm_owner::{OwnerWatch, ShmOwner};
use crate::transport::shm_pool::{ShmPool, ShmPoolConfig};
use crate::transport::tcp::{tcp_send, TcpReceiveServer};

#[derive(Clone, Debug)]
pub struct TransferConfig {
    /// A receive not completed by then is DEADLINE_EXCEEDED (key retired).
    pub receive_timeout: Duration,
    /// A send whose destination descriptor or copy takes longer fails.
    pub send_timeout: Duration,
    /// Offer only TCP destinations, even to peers on this host.
    pub force_tcp: bool,
    /// Address the TCP receive server binds to (port chosen by the OS).
    pub tcp_bind: IpAddr,
    /// Threads running lifecycle hops and copies.
    pub worker_threads: usize,
    /// Upper bound of the receiver's pool of pre-faulted shared-memory
    /// segments (0: every destination gets a fresh region).
    pub shm_pool_bytes: usize,
    /// Bound on the bytes this client's received host buffers hold at once.
    pub max_receive_bytes: u64,
}

/// Copy threads: half the cores. A single memcpy stream already runs near
/// memory bandwidth; more copies than that only take the CPU from the
/// threads that observe completions and publish readiness (measured on 2
/// cores: 4 copy threads put 64 x 1 MiB per-buffer readiness at ~1.5 ms p50).
fn copy_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| (n.get() / 2).max(1))
        .unwrap_or(1)
}

/// Copies up to this size run on the thread where the source became ready.
const INLINE_COPY_BYTES: usize = 256 << 10;

/// Pooled segments are this large; bigger destinations get their own region.
pub const SHM_SEGMENT_BYTES: usize = 256 << 20;

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            receive_timeout: Duration::from_secs(300),
            send_timeout: Duration::from_secs(300),
            force_tcp: false,
            tcp_bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
            worker_threads: 4,
            shm_pool_bytes: 4 * SHM_SEGMENT_BYTES,
            max_receive_bytes: super::receive_budget::default_max_receive_bytes(),
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

/// Records a receive buffer's outcome where its caller sees it, given the
/// memory the bytes landed in (a delegating client fulfils the compute
/// plugin's alias buffer with a view of it). Runs once, before the keys are
/// retired.
pub type RecordReceived = Box<dyn FnOnce(&Outcome, &Allocation) + Send>;

/// One buffer to receive.
pub struct ReceiveRequest {
    pub spec: BufferSpec,
    pub record: Option<RecordReceived>,
}

impl From<BufferSpec> for ReceiveRequest {
    fn from(spec: BufferSpec) -> ReceiveRequest {
        ReceiveRequest { spec, record: None }
    }
}

/// One receive buffer's memory, readiness event and descriptor.
pub struct ReceiveDestination {
    pub memory: Allocation,
    pub definition: Future,
    pub descriptor: Vec<u8>,
}

/// A source buffer for the send path.
pub struct SendSource {
    pub memory: Allocation,
    pub ready: Future,
    pub spec: BufferSpec,
    pub global_device_id: i32,
}

/// Other processes' pooled segments this process has mapped as a sender,
/// with a liveness watch of each segment's owner (the receiving process).
/// Kept across transfers (mapping and faulting 256 MiB costs more than
/// copying into it); bounded, least recently used first out. Segments of
/// receivers that are gone are dropped at the next lookup, so a dead
/// receiver's memory is not kept alive by our mapping.
struct MappedSegment {
    name: String,
    region: Arc<SharedRegion>,
    receiver: Arc<OwnerWatch>,
}
static REMOTE_SEGMENTS: Lazy<Mutex<Vec<MappedSegment>>> = Lazy::new(Default::default);
const REMOTE_SEGMENT_CACHE: usize = 16;

/// UNAVAILABLE for a send whose receiving process (the owner of the
/// shared-memory object `name`) is gone.
fn receiver_gone(function: &str, name: &str, receiver: &OwnerWatch) -> Status {
    status::unavailable(format!(
        "{function}: the receiving process (pid {}, owner of shared-memory region {name}) is gone; \
         the buffer was not delivered",
        receiver.owner().pid
    ))
}

/// A whole-object mapping of `name` that reaches at least `end`, and the
/// watch of its owner. UNAVAILABLE when the owner is gone.
fn mapped_segment(
    name: &str,
    end: u64,
    function: &str,
) -> Result<(Arc<SharedRegion>, Arc<OwnerWatch>)> {
    let owner = shm_name_owner(name)?;
    let known = {
        let mut cache = REMOTE_SEGMENTS.lock();
        forget_gone_receivers(&mut cache);
        if let Some(pos) = cache.iter().position(|segment| segment.name == name) {
            let entry = cache.remove(pos);
            if entry.region.len() as u64 >= end {
                let found = (entry.region.clone(), entry.receiver.clone());
                cache.push(entry);
                return Ok(found);
            }
        }
        cache
            .iter()
            .find(|segment| segment.receiver.owner() == owner)
            .map(|segment| segment.receiver.clone())
    };
    let watch = known.unwrap_or_else(|| Arc::new(OwnerWatch::new(owner)));
    if watch.is_gone() {
        return Err(receiver_gone(function, name, &watch));
    }
    let region = Arc::new(SharedRegion::open_whole(name)?);
    let mut cache = REMOTE_SEGMENTS.lock();
    cache.push(MappedSegment {
        name: name.to_string(),
        region: region.clone(),
        receiver: watch.clone(),
    });
    if cache.len() > REMOTE_SEGMENT_CACHE {
        cache.remove(0);
    }
    Ok((region, watch))
}

/// Drops the cached segments of every receiver that is gone, asking each
/// receiver once (a pidfd poll where the kernel has pidfds).
fn forget_gone_receivers(cache: &mut Vec<MappedSegment>) {
    let mut gone: Vec<ShmOwner> = Vec::new();
    let mut alive: Vec<ShmOwner> = Vec::new();
    cache.retain(|segment| {
        let owner = segment.receiver.owner();
        if alive.contains(&owner) {
            return true;
        }
        if gone.contains(&owner) {
            return false;
        }
        let is_gone = segment.receiver.is_gone();
        if is_gone {
            gone.push(owner);
        } else {
            alive.push(owner);
        }
        !is_gone
    });
}

/// Drops our mappings of a gone receiver's segments.
fn forget_segments_of(receiver: &OwnerWatch) {
    REMOTE_SEGMENTS
        .lock()
        .retain(|segment| segment.receiver.owner() != receiver.owner());
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
    tcp_server: OnceCell<TcpReceiveServer>,
    incarnations: Mutex<HashMap<i32, i64>>,
    pool: ShmPool,
    receive_budget: Arc<ReceiveBudget>,
}

impl TransferService {
    pub fn new(
        store: Arc<dyn KeyValueStore>,
        session: Session,
        config: TransferConfig,
    ) -> Arc<Self> {
        // Shared memory of processes that died without unlinking it goes
        // before this client adds its own (once per process).
        crate::transport::shm_reaper::reap_dead_owners_once();
        let metrics = Arc::new(Metrics::new());
        let runner = Arc::new(AsyncWorkRunner::new(
            "crosshost-lifecycle",
            config.worker_threads.max(1),
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
            tcp_server: OnceCell::new(),
            incarnations: Mutex::new(HashMap::new()),
            pool: ShmPool::new(ShmPoolConfig {
                segment_len: SHM_SEGMENT_BYTES,
                max_segments: config.shm_pool_bytes / SHM_SEGMENT_BYTES,
            })
            .expect("segment length is a positive multiple of the page size"),
            receive_budget: ReceiveBudget::new(config.max_receive_bytes),
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

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Receives whose keys are not retired yet.
    pub fn outstanding_receives(&self) -> usize {
        self.tracker.outstanding()
    }

    fn tcp_server(&self) -> Result<&TcpReceiveServer> {
        self.tcp_server
            .get_or_try_init(|| TcpReceiveServer::bind(SocketAddr::new(self.config.tcp_bind, 0)))
    }

    // ------------------------------ receive ---------------------------------

    /// v1: the caller routes descriptors itself; the sender is unknown, so
    /// shared memory is offered (same host) unless TCP is forced.
    pub fn receive_v1(
        self: &Arc<Self>,
        requests: Vec<ReceiveRequest>,
        placement: &DevicePlacement,
    ) -> Result<Vec<ReceiveDestination>> {
        let transfer_id = self.next_v1_transfer.fetch_add(1, Ordering::Relaxed);
        // Each receiving process numbers its own v1 transfers: its index
        // keeps two receivers of one session from sharing key names.
        let epoch = format!("{}.v1.p{}", self.session.epoch, self.session.process_index);
        let mut opened = Vec::with_capacity(requests.len());
        for (index, request) in requests.into_iter().enumerate() {
            let key = CompletionKey::new(&epoch, transfer_id, index as u64)?;
            let destination =
                self.open_destination(request, key, None, None, self.config.force_tcp, placement);
            opened.push(destination);
        }
        self.all_or_none(opened)
    }

    /// v2: one destination per buffer, its descriptor published under the
    /// pair's descriptor key for the sender to pick up.
    pub fn receive_v2(
        self: &Arc<Self>,
        requests: Vec<ReceiveRequest>,
        my_device: i32,
        peers: &[(i32, i64)],
        incarnations: Option<&[(i32, i64)]>,
        placement: &DevicePlacement,
    ) -> Result<Vec<ReceiveDestination>> {
        const F: &str = "PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers";
        crate::timeline!("receive_v2 of {} buffers", requests.len());
        if let Some(snapshot) = incarnations {
            self.observe_incarnations(snapshot);
        }
        let me = self.session.process_index;
        let local_host = HostIdentity::local()?;
        // Check every peer before opening anything.
        let mut plan = Vec::with_capacity(peers.len());
        let mut occurrences: HashMap<(i32, i64), u64> = HashMap::new();
        for &(peer_device, transfer_key) in peers {
            let peer = self.remote_process(peer_device, F)?;
            let epoch =
                self.pair_epoch(peer_device, my_device, peer.process_index, me, incarnations);
            let index = occurrences.entry((peer_device, transfer_key)).or_insert(0);
            let key = CompletionKey::new(&epoch, transfer_key, *index)?;
            let desc_key = descriptor_key(&epoch, transfer_key, *index)?;
            *index += 1;
            let use_tcp = self.config.force_tcp || peer.host != local_host;
            plan.push((key, desc_key, peer.process_index, use_tcp));
        }
        let mut opened = Vec::with_capacity(plan.len());
        for (request, (key, desc_key, peer_process, use_tcp)) in requests.into_iter().zip(plan) {
            opened.push(self.open_destination(
                request,
                key,
                Some(desc_key),
                Some(peer_process),
                use_tcp,
                placement,
            ));
        }
        self.all_or_none(opened)
    }

    /// All destinations, or the first error after cancelling the ones that
    /// did open (so none waits for a sender until its deadline).
    fn all_or_none(
        &self,
        opened: Vec<Result<(ReceiveDestination, PendingReceive)>>,
    ) -> Result<Vec<ReceiveDestination>> {
        let Some(failure) = opened.iter().find_map(|o| o.as_ref().err()).cloned() else {
            return Ok(opened
                .into_iter()
                .filter_map(|o| o.ok())
                .map(|(d, _)| d)
                .collect());
        };
        for (_, receive) in opened.into_iter().flatten() {
            let _ = receive.cancel(Status::new(
                failure.code,
                format!(
                    "another buffer of this receive could not be set up: {}",
                    failure.message
                ),
            ));
        }
        Err(failure)
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

    /// The temporal identity of one sender/receiver pair: session epoch, the
    /// two devices, and the two processes' incarnations when the caller gave
    /// them (a restarted peer never matches an old key).
    fn pair_epoch(
        &self,
        src: i32,
        dst: i32,
        src_process: i32,
        dst_process: i32,
        incarnations: Option<&[(i32, i64)]>,
    ) -> String {
        let mut epoch = format!("{}.d{src}-{dst}", self.session.epoch);
        if let Some(snapshot) = incarnations {
            let find = |task: i32| snapshot.iter().find(|(t, _)| *t == task).map(|(_, i)| *i);
            if let (Some(a), Some(b)) = (find(src_process), find(dst_process)) {
                epoch.push_str(&format!(".i{a}-{b}"));
            }
        }
        epoch
    }

    fn open_destination(
        self: &Arc<Self>,
        request: ReceiveRequest,
        key: CompletionKey,
        descriptor_key: Option<String>,
        peer_process: Option<i32>,
        use_tcp: bool,
        placement: &DevicePlacement,
    ) -> Result<(ReceiveDestination, PendingReceive)> {
        let ReceiveRequest { spec, record } = request;
        crate::timeline!(
            "receive {key}: opening a {}-byte destination",
            spec.byte_size
        );
        let token = AuthToken::generate()?;
        let nonce = random_u64()?;
        let destination = if placement.is_host() {
            // Reserved before anything is allocated (or faulted in).
            let reservation = self
                .receive_budget
                .reserve(spec.byte_size as u64, &format!("receive {key}"))?;
            let route = if use_tcp {
                HostRoute::Tcp(self.tcp_server()?, token)
            } else {
                HostRoute::SharedMemory
            };
            Destination::Host(HostDestination::open(
                &self.pool,
                spec.byte_size,
                placement.counters.clone(),
                nonce,
                route,
                reservation,
            )?)
        } else {
            // CUDA hook (issue #5): device memory exported as a CUDA IPC
            // handle (transfer/cuda_path.rs).
            Destination::Cuda(cuda_path::open_destination(
                placement,
                spec.byte_size,
                use_tcp,
                "receive",
            )?)
        };
        let (allocation, offset) = destination.location();
        crate::timeline!("receive {key}: destination ready");
        let descriptor = Descriptor {
            host: HostIdentity::local()?,
            process_id: std::process::id(),
            allocation,
            offset,
            byte_size: spec.byte_size as u64,
            element_type: spec.element_type,
            dims: spec.dims.clone(),
            completion_key: key.as_str().to_string(),
            nonce,
            auth_token: token,
        }
        .encode()?;
        let key_name = key.as_str().to_string();
        let extra_keys: Vec<String> = descriptor_key.iter().cloned().collect();
        let memory = destination.memory();
        let record: Option<RecordEvent> = record.map(|record| {
            let memory = memory.clone();
            Box::new(move |outcome: &Outcome| record(outcome, &memory)) as RecordEvent
        });
        // Wait first, publish second: the sender can only act on the
        // descriptor after our AsyncGet is registered.
        let receive = self
            .tracker
            .begin_recording(key, nonce, extra_keys, record)?;
        crate::timeline!("receive {key_name}: AsyncGet registered");
        self.pending.lock().insert(
            key_name.clone(),
            PendingEntry {
                receive: receive.clone(),
                peer_process,
            },
        );
        let service = Arc::downgrade(self);
        let byte_size = spec.byte_size as u64;
        let definition = receive.future();
        definition.on_ready(move |outcome| {
            let service = service.upgrade();
            if let Some(service) = &service {
                service.pending.lock().remove(&key_name);
                if outcome.is_ok() {
                    service.metrics.add_bytes_received(byte_size);
                }
            }
            let server = service.as_ref().and_then(|s| s.tcp_server.get());
            destination.retire(outcome, server);
        });
        // Published last, and without waiting: a store that fails to take
        // it fails this buffer (and retires its keys).
        if let Some(desc_key) = &descriptor_key {
            let failing = receive.clone();
            self.store.set_async(
                desc_key,
                &descriptor,
                Box::new(move |published| {
                    if let Err(e) = published {
                        let _ = failing.cancel(Status::new(
                            e.code,
                            format!("publishing the descriptor failed: {}", e.message),
                        ));
                    }
                }),
            );
            kill_points::reached(kill_points::RECEIVER_AFTER_DESCRIPTOR);
        }
        Ok((
            ReceiveDestination {
                memory,
                definition,
                descriptor,
            },
            receive,
        ))
    }

    /// `future`'s outcome, or DEADLINE_EXCEEDED if it is not ready within
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

    /// v1 cancellation of one descriptor's buffer.
    pub fn cancel_v1(&self, descriptor: &[u8], reason: Status, function: &str) -> Result<()> {
        let descriptor = Descriptor::decode(descriptor)
            .map_err(|e| status::invalid_argument(format!("{function}: {}", e.message)))?;
        let receive = {
            let pending = self.pending.lock();
            let entry = pending.get(&descriptor.completion_key).ok_or_else(|| {
                status::not_found(format!(
                    "{function}: no pending receive for this descriptor (unknown, already completed or cancelled)"
                ))
            })?;
            if entry.receive.nonce() != descriptor.nonce {
                return Err(status::invalid_argument(format!(
                    "{function}: descriptor nonce does not match the pending receive (stale or forged descriptor)"
                )));
            }
            entry.receive.clone()
        };
        receive.cancel(reason)
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

    // -------------------------------- send ----------------------------------

    /// Sends one buffer to the destination a descriptor names. Errors before
    /// any byte moved (undecodable descriptor) come back at once; everything
    /// later (mismatch, copy failure) through the returned future, and — when
    /// the descriptor named a completion key — to the receiver too.
    pub fn send_to_descriptor(
        self: &Arc<Self>,
        source: SendSource,
        descriptor: &[u8],
        function: &str,
    ) -> Result<Future> {
        let descriptor = Descriptor::decode(descriptor)
            .map_err(|e| status::invalid_argument(format!("{function}: {}", e.message)))?;
        let (promise, future) = PromiseOnce::new();
        self.start_send(source, descriptor, promise, function);
        Ok(future)
    }

    fn start_send(
        self: &Arc<Self>,
        source: SendSource,
        descriptor: Descriptor,
        promise: PromiseOnce,
        function: &str,
    ) {
        let function = function.to_string();
        if let Err(mismatch) = descriptor.validate_against(
            source.spec.byte_size as u64,
            source.spec.element_type,
            &source.spec.dims,
        ) {
            let status = status::invalid_argument(format!("{function}: {}", mismatch.message));
            let receipt = Receipt::Error {
                nonce: descriptor.nonce,
                status: status.clone(),
            };
            self.publish_receipt(&descriptor, receipt, move |_| {
                promise.set(Err(status));
            });
            return;
        }
        let service = self.clone();
        let ready = source.ready.clone();
        // Small copies into shared memory from memory we read without
        // waiting run where the source became ready: a hop to the copy pool
        // costs more than the copy (measured: ~0.2-0.4 ms on 2 cores).
        let inline = source.spec.byte_size <= INLINE_COPY_BYTES
            && source.memory.reads_without_waiting()
            && matches!(descriptor.allocation, AllocationHandle::SharedMemory { .. });
        ready.on_ready(move |defined| {
            let defined = defined.clone();
            let copies = service.copies.clone();
            let copy = move || {
                crate::timeline!("send to {}: copy starts", descriptor.completion_key);
                kill_points::reached(kill_points::SENDER_AFTER_DESCRIPTOR);
                let copied = match defined {
                    Ok(()) => service.copy_into_destination(&source, &descriptor, &function),
                    Err(status) => Err(CopyError::Failed(status)),
                };
                match copied {
                    Ok(receiver) => {
                        service.metrics.add_bytes_sent(source.spec.byte_size as u64);
                        // Bytes first, receipt second: the receiver may read
                        // the destination as soon as it observes the key.
                        let receipt = Receipt::Ok {
                            nonce: descriptor.nonce,
                        };
                        let name = match (&receiver, &descriptor.allocation) {
                            (Some(_), AllocationHandle::SharedMemory { name }) => name.clone(),
                            _ => String::new(),
                        };
                        service.publish_receipt(&descriptor, receipt, move |outcome| {
                            // A store nobody reads any more (the framework's,
                            // after the receiver died) takes the receipt too:
                            // OK only if the receiver outlived it.
                            let outcome = match &receiver {
                                Some(receiver) if outcome.is_ok() && receiver.is_gone() => {
                                    forget_segments_of(receiver);
                                    Err(receiver_gone(&function, &name, receiver))
                                }
                                _ => outcome,
                            };
                            promise.set(outcome);
                        });
                    }
                    Err(CopyError::Failed(status)) => {
                        let receipt = Receipt::Error {
                            nonce: descriptor.nonce,
                            status: status.clone(),
                        };
                        service.publish_receipt(&descriptor, receipt, move |_| {
                            promise.set(Err(status));
                        });
                    }
                    // Not this sender's destination (another sender took it,
                    // or the receive is over): its key is not ours to write.
                    Err(CopyError::Refused(status)) => {
                        promise.set(Err(status));
                    }
                }
            };
            if inline {
                copy();
            } else {
                copies.submit(copy);
            }
        });
    }

    /// Sets the completion key; `done` gets the outcome once the store has
    /// it (without blocking this thread where the store can avoid it).
    fn publish_receipt(
        &self,
        descriptor: &Descriptor,
        receipt: Receipt,
        done: impl FnOnce(Outcome) + Send + 'static,
    ) {
        crate::timeline!(
            "send to {}: copied, setting the receipt",
            descriptor.completion_key
        );
        let key = descriptor.completion_key.clone();
        self.store.set_async(
            &descriptor.completion_key,
            &receipt.encode(),
            Box::new(move |outcome| {
                if outcome.is_ok() {
                    kill_points::reached(kill_points::SENDER_AFTER_RECEIPT);
                }
                done(outcome.map_err(|e| {
                    log::error!("setting completion key {key}: {e}");
                    Status::new(
                        e.code,
                        format!("setting the completion key failed: {}", e.message),
                    )
                }))
            }),
        );
    }

    /// Writes the source into the destination. For another process's shared
    /// memory, returns the watch of that receiving process, which was alive
    /// after the write.
    fn copy_into_destination(
        &self,
        source: &SendSource,
        descriptor: &Descriptor,
        function: &str,
    ) -> std::result::Result<Option<Arc<OwnerWatch>>, CopyError> {
        match &descriptor.allocation {
            AllocationHandle::SharedMemory { name } => {
                if !descriptor.host.is_local()? {
                    return Err(CopyError::Failed(status::failed_precondition(format!(
                        "{function}: the destination is shared memory on host {}; this sender is on another \
                         host (create the receiving client with transport=tcp)",
                        descriptor.host.hostname
                    ))));
                }
                // Another process's memory: also the watch of that process
                // (a receiver that is gone gets no bytes and no receipt).
                let (region, receiver) = match local_region(name) {
                    Some(region) => (region, None),
                    None => {
                        let (region, receiver) = mapped_segment(
                            name,
                            descriptor.offset + descriptor.byte_size,
                            function,
                        )
                        .map_err(CopyError::Refused)?;
                        (region, Some(receiver))
                    }
                };
                descriptor.check_fits_in(region.len() as u64)?;
                // Single use: take the destination's exact range before
                // writing a byte, and write nothing outside it.
                let claim = ClaimRange {
                    nonce: descriptor.nonce,
                    offset: descriptor.offset,
                    len: descriptor.byte_size,
                };
                region
                    .claim_slot(descriptor.offset)?
                    .claim(&claim)
                    .map_err(|e| {
                        CopyError::Refused(Status::new(
                            e.code,
                            format!("{function}: {}", e.message),
                        ))
                    })?;
                let len = source.spec.byte_size as u64;
                claim.check_write(descriptor.offset, len)?;
                // Straight into the mapping: a host source is one memcpy, a
                // compute plugin's buffer is read back into it directly.
                let offset = descriptor.offset as usize;
                if kill_points::armed(kill_points::SENDER_MID_COPY) && len > 1 {
                    // Half the bytes in, then the test kills this process.
                    let half = len as usize / 2;
                    region.fill_at(offset, half, |dst| source.memory.read(0, dst))?;
                    kill_points::reached(kill_points::SENDER_MID_COPY);
                }
                region.fill_at(offset, len as usize, |dst| source.memory.read(0, dst))?;
                if let Some(receiver) = &receiver {
                    if receiver.is_gone() {
                        forget_segments_of(receiver);
                        return Err(CopyError::Refused(receiver_gone(function, name, receiver)));
                    }
                }
                Ok(receiver)
            }
            AllocationHandle::Tcp { endpoint } => source
                .memory
                .read_with(&mut |bytes| {
                    tcp_send(
                        *endpoint,
                        &descriptor.auth_token,
                        descriptor.offset,
                        bytes,
                        self.config.send_timeout,
                    )
                })
                .map(|()| None)
                .map_err(|e| match e.code {
                    // The receiver refused the token: another sender took the
                    // destination, or the receive is over.
                    Code::Unauthenticated => CopyError::Refused(e),
                    _ => CopyError::Failed(e),
                }),
            // CUDA hook (issue #5): same-node GPU destinations.
            AllocationHandle::CudaIpc { .. } => {
                cuda_path::copy_to_destination(&source.memory, descriptor, function)?;
                Ok(None)
            }
            AllocationHandle::InProcess { .. } => {
                Err(CopyError::Failed(status::unimplemented(format!(
                    "{function}: destination transport {:?} is not offered by this plugin",
                    descriptor.transport_kind()
                ))))
            }
        }
    }

    /// v2: each buffer waits for its destination's descriptor under the
    /// pair's descriptor key, then goes out through `start_send`.
    pub fn send_v2(
        self: &Arc<Self>,
        sources: Vec<SendSource>,
        destinations: &[i32],
        transfer_keys: &[i64],
        incarnations: Option<&[(i32, i64)]>,
    ) -> Result<Vec<Future>> {
        const F: &str = "PJRT_Transfers_PJRT_Client_CrossHostSendBuffers";
        crate::timeline!("send_v2 of {} buffers", sources.len());
        if let Some(snapshot) = incarnations {
            self.observe_incarnations(snapshot);
        }
        let me = self.session.process_index;
        // Check every buffer before starting any, so a bad argument leaves
        // nothing half-sent.
        let mut plan = Vec::with_capacity(sources.len());
        let mut occurrences: HashMap<(i32, i64), u64> = HashMap::new();
        for (source, (&dst, &key)) in sources.iter().zip(destinations.iter().zip(transfer_keys)) {
            let peer = self.remote_process(dst, F)?;
            let epoch = self.pair_epoch(
                source.global_device_id,
                dst,
                me,
                peer.process_index,
                incarnations,
            );
            let index = occurrences.entry((dst, key)).or_insert(0);
            plan.push(descriptor_key(&epoch, key, *index)?);
            *index += 1;
        }
        let mut futures = Vec::with_capacity(plan.len());
        for (source, desc_key) in sources.into_iter().zip(plan) {
            futures.push(self.send_when_described(source, desc_key));
        }
        Ok(futures)
    }

    fn send_when_described(self: &Arc<Self>, source: SendSource, desc_key: String) -> Future {
        const F: &str = "PJRT_Transfers_PJRT_Client_CrossHostSendBuffers";
        let (promise, future) = PromiseOnce::new();
        let slot = Arc::new(Mutex::new(Some(source)));
        let service = self.clone();
        let on_descriptor = {
            let promise = promise.clone();
            let slot = slot.clone();
            let desc_key = desc_key.clone();
            move |value: Result<Vec<u8>>| {
                crate::timeline!("send: descriptor {desc_key} arrived");
                let Some(source) = slot.lock().take() else {
                    return;
                };
                let started = value.and_then(|bytes| {
                    Descriptor::decode(&bytes).map_err(|e| {
                        status::invalid_argument(format!(
                            "{F}: descriptor at {desc_key}: {}",
                            e.message
                        ))
                    })
                });
                match started {
                    Ok(descriptor) => service.start_send(source, descriptor, promise, F),
                    Err(status) => {
                        promise.set(Err(status));
                    }
                }
            }
        };
        let waiter = match self.store.async_get(&desc_key, Box::new(on_descriptor)) {
            Ok(id) => id,
            Err(e) => {
                promise.set(Err(Status::new(
                    e.code,
                    format!("{F}: waiting for the descriptor: {}", e.message),
                )));
                return future;
            }
        };
        let store = self.store.clone();
        let timeout = self.config.send_timeout;
        let timer_id = self.timer.schedule_after(timeout, move || {
            if slot.lock().take().is_some() {
                store.cancel_async_get(&desc_key, waiter);
                promise.set(Err(status::deadline_exceeded(format!(
                    "{F}: the receiver's descriptor ({desc_key}) did not arrive within {timeout:?}"
                ))));
            }
        });
        let service = Arc::downgrade(self);
        future.on_ready(move |_| {
            if let Some(service) = service.upgrade() {
                service.timer.cancel(timer_id);
            }
        });
        future
    }
}

#[cfg(test)]
mod tests;
