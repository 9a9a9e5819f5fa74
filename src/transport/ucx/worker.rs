//! `WorkerHandle`: one UCP context and worker, driven by one progress thread
//! (a client's UCX transport has a few, `transport.rs`). UCX runs in its
//! serialized mode: any thread may call it, one at a time, which the
//! worker's lock (a mutex around `Worker`) ensures. The progress thread holds
//! it except while it sleeps in poll(2) on the worker's event fd and an
//! eventfd, waking at least every `IDLE_WAKE` so UCX's keepalive (which runs
//! inside `ucp_worker_progress`) still finds dead peers on idle endpoints;
//! it never spins. A sender that finds the lock free sends at once, on its
//! own thread (measured: the hop to the progress thread cost a small
//! transfer 26-53 µs); otherwise it queues the send and wakes the thread.
//!
//! Callbacks from UCX (active messages, completions, endpoint failures) run
//! inside `ucp_worker_progress` on the thread. They only record events; the
//! loop acts on them between UCP calls, so no UCP call is made re-entrantly
//! and no Rust state is borrowed across one. The exception is a DATA or
//! CHUNK message, which must be taken while UCX holds it: its destination
//! is claimed from the registry, eager bytes are copied in and a rendezvous
//! receive into it is started right in the callback (a chunk of a staged
//! stream is queued instead, its rendezvous data left with UCX until the
//! stream's thread has a ring slot for it and receives it through this
//! worker's `ChunkPort`: `stream.rs`).
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ffi::{c_void, CString};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use once_cell::sync::OnceCell;
use parking_lot::Mutex;

use super::library::LoadedUcx;
use super::stream::{
    Arrived, ChunkOrder, ChunkPlace, ChunkPort, HeldData, KeepAlive, Signal, StagedStreams,
};
use super::sys::*;
use super::transfer::Transfer;
use super::wire::{
    Ack, ChunkHeader, CloseKind, CloseMessage, DataHeader, AM_ACK, AM_CHUNK, AM_CLOSE, AM_DATA,
};
use crate::status::{self, Result, Status};
use crate::sync::threads::Slice;
use crate::sync::timeline::{self, Point};
use crate::transport::auth_token::AuthToken;
use crate::transport::connections::{choose_to_close, ConnectionLimits, Use};
use crate::transport::destination::WritableDestination;
use crate::transport::poll::WakeFd;
use crate::transport::registry::{DestinationRegistry, Landing, ReceiptSink, StreamProgress};

/// Longest sleep of an idle progress thread.
const IDLE_WAKE: Duration = Duration::from_millis(200);
/// How often idle endpoints are looked for (at most; as often as the
/// connection limits' grace where that is shorter, but not more than
/// `MIN_SWEEP_EVERY`).
const SWEEP_EVERY: Duration = Duration::from_secs(1);
const MIN_SWEEP_EVERY: Duration = Duration::from_millis(20);
/// Bound on closing the endpoints at shutdown.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// How long a peer asked to close a pair of endpoints has to answer; then
/// this side closes its own (the peer is not progressing: dead, or stuck).
const ANSWER_WAIT: Duration = Duration::from_secs(2);
/// Parts of at least this go by rendezvous, straight into the destination.
/// Over TCP, UCX sends a message of up to ~24 MiB eagerly, in receive
/// segments (512 KiB, `library.rs`), and the receiver assembles one longer
/// than a segment in a `malloc` of its whole size on the progress thread
/// before our callback copies it out (heaptrack: `ucp_am_long_first_handler`).
/// Those blocks came from the progress threads' glibc arenas, whose free tops
/// `malloc_trim` does not give back: on the N-host bed each process held
/// 8-18 MiB of anonymous memory above its live heap after 10 s of all to all
/// and 1-12 MiB more after 3 minutes (bench/soak.py). A rendezvous lands the
/// bytes in the destination with no such block; a part that fits one segment
/// still goes eagerly.
const RENDEZVOUS_FROM: usize = super::transfer::STRIPE_MIN;

/// One part of a buffer for one worker to send (the whole buffer unless it
/// is striped over several workers).
pub struct SendPart {
    pub peer: u32,
    pub token: AuthToken,
    pub part: u16,
    pub parts: u16,
    /// Where the part goes in the destination.
    pub offset: u64,
    pub transfer: Arc<Transfer>,
    /// The part's range in the transfer's payload.
    pub start: usize,
    pub len: usize,
    pub deadline: Instant,
    pub timeout: Duration,
    /// The receipt to carry (the receiver holds the key it sets).
    pub receipt: Vec<u8>,
    /// The completion key's hash, for the timeline's marks.
    pub mark_key: u64,
}

enum Command {
    /// Connect to every peer's counterpart now; answer when all are wired
    /// up (or failed).
    Connect(Sender<Result<()>>),
    Send(Box<SendPart>),
    SendChunk(Box<ChunkOrder>),
    /// What a staged stream asks of the worker holding its chunks' data
    /// (`WorkerPort`), when the worker was busy.
    Held(HeldOrder),
    /// The process is gone (its control link closed): what waits on it
    /// fails now.
    PeerLost(u32),
    Stop,
}

/// A staged stream's order to the worker that holds its chunks' data.
enum HeldOrder {
    /// Receive `data` into `len` bytes at `target`; tell `done`.
    Receive {
        data: HeldData,
        target: SlotPointer,
        len: usize,
        done: Arc<Signal>,
    },
    Release(HeldData),
    Acknowledge {
        peer: Remote,
        ack: Ack,
        receipt: Option<(Arc<Landing>, Vec<u8>)>,
    },
}

/// Where a held chunk lands: a ring slot its stream lends until `done`.
struct SlotPointer(*mut u8);

// SAFETY: the slot is the stream's pipeline's, lent whole to this receive
// (`ChunkPort::receive`'s contract); only UCX writes it, from whichever
// thread holds the worker.
unsafe impl Send for SlotPointer {}

/// What a UCX callback saw, for the loop to act on.
enum Event {
    SendCompleted {
        request: u64,
        status: ucs_status_t,
    },
    Ack(Ack),
    /// Bytes landed in a claimed destination (or could not): apply the
    /// receipt they came with, if any, then tell the sender's worker.
    Received {
        peer: Remote,
        ack: Ack,
        receipt: Option<(Arc<Landing>, Vec<u8>)>,
    },
    ReceiveCompleted {
        op: *mut ReceiveOp,
        status: ucs_status_t,
    },
    EndpointFailed {
        peer: Remote,
        ep: ucp_ep_h,
        status: ucs_status_t,
    },
    /// A close handshake's message, and the endpoint of the connection it
    /// came over.
    Close {
        message: CloseMessage,
        reply_ep: ucp_ep_h,
    },
    /// A flush of the endpoint to `peer` (its wireup) completed.
    Flushed {
        peer: Remote,
        status: ucs_status_t,
    },
    Dropped(String),
}

/// What callbacks may touch: fixed handles, the registry, and the event
/// list (borrowed for one push at a time).
struct Callbacks {
    api: Arc<UcpApi>,
    /// This worker, as its close messages name it.
    me: Remote,
    worker: ucp_worker_h,
    registry: Arc<DestinationRegistry>,
    events: RefCell<Vec<Event>>,
    /// Rendezvous receives in flight (their ops are freed on completion, or
    /// at shutdown once the worker is gone).
    receiving: RefCell<HashSet<usize>>,
    /// The endpoints this worker made and has not closed: a close message
    /// that came over one of them may close it (`on_close`).
    own_endpoints: RefCell<HashSet<usize>>,
    rejected: Arc<AtomicU64>,
    /// Endpoints closed by a handshake both sides agreed to.
    closed_by_handshake: Arc<AtomicU64>,
    sink: Arc<OnceCell<ReceiptSink>>,
    /// Streams into staged destinations (all workers of the transport).
    streams: Arc<StagedStreams>,
    /// This worker, as a staged stream reaches it (set once it runs).
    port: OnceCell<Arc<dyn ChunkPort>>,
}

// SAFETY: the callbacks' state (the event list, the rendezvous set) is only
// touched by the thread holding the worker's lock: UCX calls them inside
// `ucp_worker_progress`, which runs under it (the worker is in UCX's
// serialized mode, see `Worker`), and the loop reads them under it too.
unsafe impl Send for Callbacks {}
// SAFETY: as above; shared references never cross the lock.
unsafe impl Sync for Callbacks {}

impl Callbacks {
    fn push(&self, event: Event) {
        self.events.borrow_mut().push(event);
    }

    /// Counts a message refused without an answer, and says why in the log
    /// (the event is logged on the worker's thread, not in the callback).
    fn drop_message(&self, why: String) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        self.push(Event::Dropped(why));
    }
}

/// A worker of another process: (process, worker index).
type Remote = (u32, u16);

/// A rendezvous receive into a claimed destination.
struct ReceiveOp {
    callbacks: *const Callbacks,
    _destination: Arc<dyn WritableDestination>,
    peer: Remote,
    request: u64,
    token: AuthToken,
    receipt: Option<(Arc<Landing>, Vec<u8>)>,
    /// A chunk of a stream written directly: the stream's progress and the
    /// chunk's length (the stream is ACKed once, when its last byte landed).
    chunk: Option<(Arc<StreamProgress>, u64)>,
}

/// What a send op's bytes are, and what answers it.
enum OpBytes {
    /// A part of a DATA send: its range of the transfer's payload; its
    /// receiver's ACK answers it.
    Part,
    /// One CHUNK message: its own bytes (kept mapped by `keep`); no ACK of
    /// its own (a refusal may come); `sent` is told when UCX is done
    /// reading them.
    Chunk {
        bytes: *const u8,
        _keep: KeepAlive,
        sent: Arc<Signal>,
    },
    /// A chunked stream's home: no bytes, answered by the stream's one ACK.
    Stream,
}

/// One part of a send (the whole buffer unless striped): its header stays
/// here, and its transfer's bytes, until UCX is done with them.
struct SendOp {
    peer: u32,
    token: AuthToken,
    header: Vec<u8>,
    bytes: OpBytes,
    transfer: Arc<Transfer>,
    /// The part's range in the payload.
    start: usize,
    len: usize,
    /// Acknowledged, failed or expired: nothing more to tell.
    answered: bool,
    /// Its deadline passed (and its endpoint was cut if UCX held it).
    expired: bool,
    ucx_done: bool,
    deadline: Instant,
    timeout: Duration,
}

/// Tells the endpoint's error handler whose endpoint it is.
struct EndpointTag {
    callbacks: *const Callbacks,
    peer: Remote,
}

struct Peer {
    address: Vec<u8>,
    /// Created on first use, and again on the first use after a failure.
    ep: Option<ucp_ep_h>,
    /// When a send last asked for the endpoint (sweeps close idle ones).
    last_used: Instant,
    /// Why its last endpoint was closed (it failed, or a send to it missed
    /// its deadline), until a new one is made: said when redialling. A late
    /// transfer must not cut two live processes apart for good, and UCX 1.14
    /// and later (the only ones loaded) survive a failed wire-up.
    failed: Option<String>,
    /// This side asked the peer to close the pair (`ask_to_close`).
    handshake: Option<Handshake>,
}

/// A close this side asked for: until the peer answers, nothing is sent on
/// the endpoint (the peer may already have stopped reading its side), and
/// what would have been is held here.
struct Handshake {
    number: u64,
    asked: Instant,
    held: Vec<Deferred>,
}

/// Something to send to a peer, held while its pair of endpoints closes.
enum Deferred {
    Send(SendPart),
    Chunk(ChunkOrder),
    Ack(Ack),
}

impl Deferred {
    /// When a held send is late (an ack has no deadline of its own).
    fn deadline(&self) -> Option<Instant> {
        match self {
            Deferred::Send(order) => Some(order.deadline),
            Deferred::Chunk(order) => Some(order.deadline),
            Deferred::Ack(_) => None,
        }
    }
}

/// A `Connect` in progress: the flushes still out, the first failure, and
/// who waits.
struct Connecting {
    remaining: usize,
    failure: Option<Status>,
    reply: Sender<Result<()>>,
}

/// Transport names of each peer's endpoint lanes (e.g. `tcp/eth0`), as UCX
/// chose them, once an endpoint carried a transfer.
pub type Lanes = Arc<Mutex<HashMap<u32, String>>>;

struct Handle {
    commands: Sender<Command>,
    wake: Arc<WakeFd>,
    stopping: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Handle {
    fn order(&self, command: Command) -> std::result::Result<(), Command> {
        self.commands.send(command).map_err(|e| e.0)?;
        self.wake();
        Ok(())
    }

    fn wake(&self) {
        self.wake.wake();
    }
}

/// One worker of a client's UCX transport (`transport.rs` holds them all).
pub struct WorkerHandle {
    handle: Arc<Handle>,
    /// The worker, for senders that find it free.
    worker: Arc<Mutex<Worker>>,
    address: Vec<u8>,
    lanes: Lanes,
    rejected: Arc<AtomicU64>,
    held: Arc<AtomicUsize>,
}

impl WorkerHandle {
    /// Creates a context and a worker on a new progress thread; this process
    /// is `me` among the job's processes, and DATA messages write the
    /// destinations of `registry`. The worker's address is known on return.
    pub fn start(
        ucx: &LoadedUcx,
        me: u32,
        index: u16,
        registry: Arc<DestinationRegistry>,
        sink: Arc<OnceCell<ReceiptSink>>,
        streams: Arc<StagedStreams>,
    ) -> Result<WorkerHandle> {
        let (commands, orders) = crossbeam_channel::unbounded();
        let wake = Arc::new(
            WakeFd::new()
                .map_err(|e| status::resource_exhausted(format!("UCX transport: eventfd: {e}")))?,
        );
        let thread_wake = wake.clone();
        let lanes: Lanes = Arc::default();
        let held: Arc<AtomicUsize> = Arc::default();
        let thread_held = held.clone();
        let (ready, started) = crossbeam_channel::bounded(1);
        let api = ucx.api.clone();
        let thread_lanes = lanes.clone();
        let (port_tx, port_rx) = crossbeam_channel::bounded::<Arc<Handle>>(1);
        let thread = crate::sync::threads::spawn("crosshost-ucx", Slice::Short, move || {
            let created = Worker::create(
                api,
                (me, index),
                registry,
                sink,
                streams,
                thread_lanes,
                thread_held,
            );
            let setup = match created {
                Ok(worker) => worker,
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            let address = setup.address.clone();
            let rejected = setup.callbacks.rejected.clone();
            let callbacks = setup.callbacks.clone();
            let worker = Arc::new(Mutex::new(setup));
            let _ = ready.send(Ok((address, rejected, worker.clone())));
            // The handle exists once `start` has it: then chunks may come.
            if let Ok(handle) = port_rx.recv() {
                let port: Arc<dyn ChunkPort> = Arc::new(WorkerPort {
                    worker: Arc::downgrade(&worker),
                    handle: Arc::downgrade(&handle),
                });
                let _ = callbacks.port.set(port);
            }
            Worker::run(&worker, orders, &thread_wake);
        })
        .map_err(|e| status::resource_exhausted(format!("UCX transport: thread: {e}")))?;
        let (address, rejected, worker) = match started.recv() {
            Ok(Ok(started)) => started,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(status::internal("UCX transport: the progress thread died"));
            }
        };
        let handle = Arc::new(Handle {
            commands,
            wake,
            stopping: AtomicBool::new(false),
            thread: Mutex::new(Some(thread)),
        });
        let _ = port_tx.send(handle.clone());
        Ok(WorkerHandle {
            worker,
            handle,
            address,
            lanes,
            rejected,
            held,
        })
    }

    /// This worker's address, for the job's other processes.
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    /// Every process's worker addresses, in their order. Applied before
    /// this returns: a send from another thread may take the worker at once
    /// (`send_part`), ahead of anything queued for its thread.
    pub fn set_peers(&self, peers: HashMap<u32, Vec<Vec<u8>>>) {
        self.worker.lock().set_peers(peers);
    }

    /// The lanes UCX chose to each peer it carried a transfer to or from.
    pub fn lanes(&self) -> HashMap<u32, String> {
        self.lanes.lock().clone()
    }

    /// Parts whose bytes UCX still holds (answered or not).
    pub fn sends_held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// DATA messages refused (unknown token, bad header or bounds).
    pub fn rejected_messages(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }

    /// Endpoints this worker has open to its peers.
    pub fn open_endpoints(&self) -> usize {
        self.worker.lock().open_endpoints()
    }

    /// Sends `message` to process `to` over this worker's endpoint to it.
    #[cfg(test)]
    pub fn send_close_message(&self, to: u32, message: CloseMessage) -> Result<()> {
        let mut worker = self.worker.lock();
        let remote = worker.counterpart(to);
        let ep = worker.endpoint(remote)?;
        send_close_over(&worker.api, ep, &message).map_err(status::unavailable)?;
        drop(worker);
        self.handle.wake();
        Ok(())
    }

    /// Endpoint tags this worker holds (open, closing and retired).
    #[cfg(test)]
    pub fn endpoint_tags(&self) -> usize {
        let worker = self.worker.lock();
        worker.tags.len() + worker.closing.len() + worker.retired_tags.len()
    }

    /// Endpoint pairs closed by a handshake both sides agreed to.
    pub fn closed_by_handshake(&self) -> u64 {
        self.worker
            .lock()
            .callbacks
            .closed_by_handshake
            .load(Ordering::Relaxed)
    }

    /// The bounds its sweeps keep open endpoints to.
    pub fn set_connection_limits(&self, limits: ConnectionLimits) {
        let mut worker = self.worker.lock();
        worker.limits = limits;
        worker.next_sweep = Instant::now();
    }

    /// Connects to every peer now (waiting at most `timeout`).
    pub fn connect(&self, timeout: Duration) -> Result<()> {
        let (reply, answer) = crossbeam_channel::bounded(1);
        if self.handle.order(Command::Connect(reply)).is_err() {
            return Err(stopped());
        }
        answer.recv_timeout(timeout).unwrap_or_else(|_| {
            Err(status::deadline_exceeded(format!(
                "UCX transport: connecting to the job's other processes took longer than {timeout:?}"
            )))
        })
    }

    /// Process `process` is gone: fails what waits on it (see
    /// `Worker::peer_lost`).
    pub fn peer_lost(&self, process: u32) {
        let _ = self.handle.order(Command::PeerLost(process));
    }

    /// Sends one part; its transfer hears how it went. On this thread when
    /// the worker is free, else through its progress thread.
    pub fn send_part(&self, part: SendPart) {
        if self.handle.stopping.load(Ordering::Acquire) {
            part.transfer.fail(stopped());
            return;
        }
        if let Some(mut worker) = self.worker.try_lock() {
            if !worker.stopped {
                let left_work = worker.start_send(part);
                drop(worker);
                // What UCX could not finish at once (a rendezvous, a full
                // socket) needs progress: make sure the thread looks.
                if left_work {
                    self.handle.wake();
                }
                return;
            }
        }
        if let Err(Command::Send(part)) = self.handle.order(Command::Send(Box::new(part))) {
            part.transfer.fail(stopped());
        }
    }

    /// Sends one chunk message of a stream (see `send_part`).
    pub fn send_chunk(&self, chunk: ChunkOrder) {
        if self.handle.stopping.load(Ordering::Acquire) {
            chunk.transfer.fail(stopped());
            chunk.sent.set(Err(stopped()));
            return;
        }
        if let Some(mut worker) = self.worker.try_lock() {
            if !worker.stopped {
                let left_work = worker.start_chunk(chunk);
                drop(worker);
                if left_work {
                    self.handle.wake();
                }
                return;
            }
        }
        if let Err(Command::SendChunk(chunk)) =
            self.handle.order(Command::SendChunk(Box::new(chunk)))
        {
            chunk.transfer.fail(stopped());
            chunk.sent.set(Err(stopped()));
        }
    }

    /// Waits, on this worker, for the one ACK of a chunked stream to
    /// `peer` under `token`; returns the request id its chunks name.
    pub fn await_stream(
        &self,
        peer: u32,
        token: AuthToken,
        transfer: Arc<Transfer>,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<u64> {
        let mut worker = self.worker.lock();
        if worker.stopped || self.handle.stopping.load(Ordering::Acquire) {
            return Err(stopped());
        }
        Ok(worker.await_stream(peer, token, transfer, deadline, timeout))
    }

    /// A stream this worker waits for failed on its sending side: no ACK
    /// is awaited any more.
    pub fn abandon(&self, request: u64) {
        let mut worker = self.worker.lock();
        if let Some(op) = worker.sends.get_mut(&request) {
            op.answered = true;
        }
        worker.release_if_finished(request);
    }
}

/// A worker as a staged stream reaches it (`stream.rs`); weak, so a
/// stream that outlives its transport finds it stopped.
struct WorkerPort {
    worker: std::sync::Weak<Mutex<Worker>>,
    handle: std::sync::Weak<Handle>,
}

impl WorkerPort {
    /// Carries out `order` on this thread if the worker is free, else has
    /// its thread do so between two rounds of progress (never waiting for
    /// the lock: the progress thread holds it while data flows). Gives the
    /// order back when the worker is stopped.
    fn order(&self, order: HeldOrder) -> std::result::Result<(), HeldOrder> {
        let (Some(worker), Some(handle)) = (self.worker.upgrade(), self.handle.upgrade()) else {
            return Err(order);
        };
        if let Some(mut worker) = worker.try_lock() {
            if worker.stopped {
                return Err(order);
            }
            worker.held(order);
            drop(worker);
            // What UCX was asked to do needs progress.
            handle.wake();
            return Ok(());
        }
        if handle.stopping.load(Ordering::Acquire) {
            return Err(order);
        }
        match handle.order(Command::Held(order)) {
            Ok(()) => Ok(()),
            Err(Command::Held(order)) => Err(order),
            Err(_) => unreachable!("the command given back is the one sent"),
        }
    }
}

impl ChunkPort for WorkerPort {
    unsafe fn receive(&self, data: HeldData, target: *mut u8, len: usize, done: Arc<Signal>) {
        let order = HeldOrder::Receive {
            data,
            target: SlotPointer(target),
            len,
            done,
        };
        if let Err(HeldOrder::Receive { done, .. }) = self.order(order) {
            done.set(Err(stopped()));
        }
    }

    fn release(&self, data: HeldData) {
        // A stopped worker's UCX is gone with everything it held.
        let _ = self.order(HeldOrder::Release(data));
    }

    fn acknowledge(&self, peer: Remote, ack: Ack, receipt: Option<(Arc<Landing>, Vec<u8>)>) {
        let _ = self.order(HeldOrder::Acknowledge { peer, ack, receipt });
    }
}

/// A receive of held chunk data into a ring slot: who hears of it.
struct HeldReceive {
    done: Arc<Signal>,
    api: Arc<UcpApi>,
}

fn stopped() -> Status {
    status::unavailable("UCX transport: the client is being destroyed")
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        self.handle.stopping.store(true, Ordering::Release);
        let _ = self.handle.order(Command::Stop);
        if let Some(thread) = self.handle.thread.lock().take() {
            crate::sync::runner::join_all_except_current(vec![thread], "UcxTransport");
        }
    }
}

// --------------------------- the progress thread ---------------------------

/// The worker and everything its callbacks and the loop share; used only
/// under its lock.
struct Worker {
    /// Shut down: no more UCP calls.
    stopped: bool,
    api: Arc<UcpApi>,
    context: ucp_context_h,
    worker: ucp_worker_h,
    efd: RawFd,
    /// This process, and this worker's index among its workers.
    me: Remote,
    address: Vec<u8>,
    callbacks: Arc<Callbacks>,
    peers: HashMap<Remote, Peer>,
    connecting: Vec<Connecting>,
    /// Workers of each process.
    worker_counts: HashMap<u32, u16>,
    sends: HashMap<u64, SendOp>,
    next_request: u64,
    /// Each open endpoint's tag, by endpoint. Boxed: UCX holds the tag's
    /// address for the endpoint's life.
    tags: HashMap<usize, Box<EndpointTag>>,
    lanes: Lanes,
    held: Arc<AtomicUsize>,
    /// Closes UCX has not finished, with their endpoint's tag.
    closing: Vec<(ucs_status_ptr_t, Box<EndpointTag>)>,
    /// Tags of closed endpoints, freed a sweep after the close (a callback
    /// UCX had queued for the endpoint has run by then).
    retired_tags: Vec<(Instant, Box<EndpointTag>)>,
    /// Bounds on open endpoints (`transport/connections/`'s rules).
    limits: ConnectionLimits,
    next_sweep: Instant,
    next_handshake: u64,
    /// Held sends and acks whose handshake ended, to start again.
    replay: Vec<(Remote, Deferred)>,
}

// SAFETY: the UCP handles are used by one thread at a time (the worker's
// lock), which UCX's serialized thread mode allows; the callbacks' state is
// under the same lock (see `Callbacks`).
unsafe impl Send for Worker {}

fn ucx_error(api: &UcpApi, what: &str, status: ucs_status_t) -> Status {
    status::unavailable(format!("UCX: {what} failed: {}", api.describe(status)))
}

impl Worker {
    fn create(
        api: Arc<UcpApi>,
        me: Remote,
        registry: Arc<DestinationRegistry>,
        sink: Arc<OnceCell<ReceiptSink>>,
        streams: Arc<StagedStreams>,
        lanes: Lanes,
        held: Arc<AtomicUsize>,
    ) -> Result<Worker> {
        let name = CString::new("pjrt-crosshost").expect("no NUL");
        // API 1.13 is the oldest we load, later libraries accept it.
        let context = api
            .init_context(
                (1, 13),
                UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
                Some(name.as_c_str()),
            )
            .map_err(|(call, status)| ucx_error(&api, call, status))?;
        let worker_params = ucp_worker_params_t {
            field_mask: UCP_WORKER_PARAM_FIELD_THREAD_MODE
                | UCP_WORKER_PARAM_FIELD_EVENTS
                | UCP_WORKER_PARAM_FIELD_NAME,
            thread_mode: UCS_THREAD_MODE_SERIALIZED,
            cpu_mask: [0; 16],
            events: UCP_WAKEUP_RX | UCP_WAKEUP_TX,
            user_data: std::ptr::null_mut(),
            event_fd: -1,
            flags: 0,
            name: name.as_ptr(),
            am_alignment: 0,
            client_id: 0,
        };
        let mut worker: ucp_worker_h = std::ptr::null_mut();
        // SAFETY: a live context and valid params; the worker belongs to this
        // thread from here on.
        let status = unsafe { (api.worker_create)(context, &worker_params, &mut worker) };
        if status != UCS_OK {
            // SAFETY: the context has no worker.
            unsafe { (api.cleanup)(context) };
            return Err(ucx_error(&api, "ucp_worker_create", status));
        }
        let fail = |what: &str, status: ucs_status_t| {
            // SAFETY: tearing down what this function created, in order.
            unsafe {
                (api.worker_destroy)(worker);
                (api.cleanup)(context);
            }
            ucx_error(&api, what, status)
        };
        let mut efd: i32 = -1;
        // SAFETY: a live worker created with the wakeup feature.
        let status = unsafe { (api.worker_get_efd)(worker, &mut efd) };
        if status != UCS_OK {
            return Err(fail("ucp_worker_get_efd", status));
        }
        let mut raw_address: *mut ucp_address = std::ptr::null_mut();
        let mut address_len = 0usize;
        // SAFETY: valid out-pointers on a live worker.
        let status =
            unsafe { (api.worker_get_address)(worker, &mut raw_address, &mut address_len) };
        if status != UCS_OK {
            return Err(fail("ucp_worker_get_address", status));
        }
        // SAFETY: UCX returned `address_len` readable bytes, released below.
        let address =
            unsafe { std::slice::from_raw_parts(raw_address.cast::<u8>(), address_len) }.to_vec();
        // SAFETY: releasing what ucp_worker_get_address returned.
        unsafe { (api.worker_release_address)(worker, raw_address) };
        let callbacks = Arc::new(Callbacks {
            api: api.clone(),
            me,
            worker,
            registry,
            events: RefCell::new(Vec::new()),
            receiving: RefCell::new(HashSet::new()),
            own_endpoints: RefCell::new(HashSet::new()),
            rejected: Default::default(),
            closed_by_handshake: Default::default(),
            sink,
            streams,
            port: OnceCell::new(),
        });
        for (id, cb) in [
            (AM_DATA, on_data as ucp_am_recv_callback_t),
            (AM_ACK, on_ack as ucp_am_recv_callback_t),
            (AM_CHUNK, on_chunk as ucp_am_recv_callback_t),
            (AM_CLOSE, on_close as ucp_am_recv_callback_t),
        ] {
            let handler = ucp_am_handler_param_t {
                field_mask: UCP_AM_HANDLER_PARAM_FIELD_ID
                    | UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                    | UCP_AM_HANDLER_PARAM_FIELD_CB
                    | UCP_AM_HANDLER_PARAM_FIELD_ARG,
                id,
                flags: UCP_AM_FLAG_WHOLE_MSG,
                cb: Some(cb),
                arg: Arc::as_ptr(&callbacks) as *mut c_void,
            };
            // SAFETY: the handler's arg outlives the worker (the Arc is held
            // by the Worker, which destroys the worker before dropping it).
            let status = unsafe { (api.worker_set_am_recv_handler)(worker, &handler) };
            if status != UCS_OK {
                return Err(fail("ucp_worker_set_am_recv_handler", status));
            }
        }
        Ok(Worker {
            stopped: false,
            api,
            context,
            worker,
            efd,
            me,
            address,
            callbacks,
            peers: HashMap::new(),
            connecting: Vec::new(),
            worker_counts: HashMap::new(),
            sends: HashMap::new(),
            next_request: 1,
            tags: HashMap::new(),
            lanes,
            held,
            closing: Vec::new(),
            retired_tags: Vec::new(),
            limits: ConnectionLimits::default(),
            next_sweep: Instant::now() + SWEEP_EVERY,
            next_handshake: 1,
            replay: Vec::new(),
        })
    }

    fn run(shared: &Mutex<Worker>, orders: Receiver<Command>, wake: &WakeFd) {
        let callbacks = shared.lock().callbacks.clone();
        CURRENT.with(|current| *current.borrow_mut() = Some(callbacks));
        'serve: loop {
            let (efd, sleep) = {
                let mut worker = shared.lock();
                // Orders are taken between rounds of progress, not only once
                // UCX has nothing left to do: a stream's next chunk, sent
                // while earlier ones flow, must not wait for a lull.
                loop {
                    let mut ordered = false;
                    while let Ok(command) = orders.try_recv() {
                        ordered = true;
                        if worker.obey(command) {
                            break 'serve;
                        }
                    }
                    // SAFETY: a live worker of this thread.
                    let worked = unsafe { (worker.api.worker_progress)(worker.worker) };
                    let acted = worker.handle_events();
                    let replayed = worker.replay_deferred();
                    if worked == 0 && !acted && !ordered && !replayed {
                        break;
                    }
                }
                let now = Instant::now();
                worker.expire(now);
                worker.sweep_endpoints(now);
                if worker.replay_deferred() {
                    continue;
                }
                // SAFETY: a live worker, under its lock.
                let armed = unsafe { (worker.api.worker_arm)(worker.worker) };
                if armed == UCS_ERR_BUSY {
                    continue;
                }
                let sleep = worker
                    .sends
                    .values()
                    .filter(|op| !op.answered)
                    .map(|op| op.deadline.saturating_duration_since(Instant::now()))
                    .min()
                    .unwrap_or(IDLE_WAKE)
                    .min(IDLE_WAKE);
                (worker.efd, sleep)
            };
            // Unlocked while asleep: senders may use the worker meanwhile
            // (what they start wakes us through the event fd or `wake`).
            let mut fds = [
                libc::pollfd {
                    fd: efd,
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: wake.raw(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            let _ = crate::transport::poll::poll(&mut fds, Some(sleep));
            if fds[1].revents != 0 {
                wake.drain();
            }
        }
        shared.lock().shut_down(orders);
    }

    /// Carries out one order; true for `Stop`.
    fn obey(&mut self, command: Command) -> bool {
        match command {
            Command::Connect(reply) => self.connect_all(reply),
            Command::Send(order) => {
                self.start_send(*order);
            }
            Command::SendChunk(order) => {
                self.start_chunk(*order);
            }
            Command::Held(order) => self.held(order),
            Command::PeerLost(process) => self.peer_lost(process),
            Command::Stop => return true,
        }
        false
    }

    /// A staged stream's order (`WorkerPort`).
    fn held(&mut self, order: HeldOrder) {
        match order {
            // SAFETY: `ChunkPort::receive`'s caller keeps the slot valid
            // and to itself until `done` is told.
            HeldOrder::Receive {
                data,
                target,
                len,
                done,
            } => unsafe { self.receive_held(data, target.0, len, done) },
            // SAFETY: data UCX handed to this worker's callback and kept
            // (the callback returned UCS_INPROGRESS), released once.
            HeldOrder::Release(data) => unsafe { (self.api.am_data_release)(self.worker, data.0) },
            HeldOrder::Acknowledge { peer, ack, receipt } => self.landed(peer, ack, receipt),
        }
    }

    /// Runs UCX until it has nothing more to do, acting on what its
    /// callbacks saw after each round.
    fn progress(&mut self) {
        loop {
            // SAFETY: a live worker of this thread.
            let worked = unsafe { (self.api.worker_progress)(self.worker) };
            let acted = self.handle_events();
            if worked == 0 && !acted {
                return;
            }
        }
    }

    fn handle_events(&mut self) -> bool {
        let events = std::mem::take(&mut *self.callbacks.events.borrow_mut());
        let any = !events.is_empty();
        for event in events {
            match event {
                Event::SendCompleted { request, status } => self.send_completed(request, status),
                Event::Ack(ack) => self.acked(ack),
                Event::Received { peer, ack, receipt } => self.landed(peer, ack, receipt),
                Event::ReceiveCompleted { op, status } => {
                    self.callbacks.receiving.borrow_mut().remove(&(op as usize));
                    // SAFETY: `op` came from Box::into_raw in `on_data`, UCX
                    // is done with it (this is its completion), and it is
                    // freed only here.
                    let op = unsafe { Box::from_raw(op) };
                    let outcome = if status == UCS_OK {
                        Ok(())
                    } else {
                        Err(status::unavailable(format!(
                            "UCX receiver: the rendezvous receive failed: {}",
                            self.api.describe(status)
                        )))
                    };
                    let ack = Ack {
                        request: op.request,
                        token: op.token,
                        outcome,
                        receipt_applied: false,
                    };
                    match &op.chunk {
                        None => self.landed(op.peer, ack, op.receipt),
                        // A stream's one ACK: once its last byte landed,
                        // or at its first failure.
                        Some((progress, length)) => {
                            let ok = ack.outcome.is_ok();
                            if (ok && progress.landed(*length)) || (!ok && progress.fail()) {
                                let receipt = if ok { op.receipt } else { None };
                                self.landed(op.peer, ack, receipt);
                            }
                        }
                    }
                }
                Event::EndpointFailed { peer, ep, status } => {
                    self.endpoint_failed(peer, ep, status)
                }
                Event::Close { message, reply_ep } => self.close_message(message, reply_ep),
                Event::Flushed { peer, status } => self.flushed(peer, status),
                Event::Dropped(why) => log::warn!("UCX transport: {why}"),
            }
        }
        any
    }

    fn set_peers(&mut self, peers: HashMap<u32, Vec<Vec<u8>>>) {
        for (process, addresses) in peers {
            let count = addresses.len().min(u16::MAX as usize) as u16;
            self.worker_counts.insert(process, count);
            for (index, address) in addresses.into_iter().take(count as usize).enumerate() {
                let remote = (process, index as u16);
                if remote == self.me {
                    continue;
                }
                // A peer already known keeps its endpoint; one that moved
                // (a new address) is dialled anew.
                if self
                    .peers
                    .get(&remote)
                    .is_some_and(|p| p.address == address)
                {
                    continue;
                }
                self.close_endpoint(remote, true);
                self.peers.insert(
                    remote,
                    Peer {
                        address,
                        ep: None,
                        last_used: Instant::now(),
                        failed: None,
                        handshake: None,
                    },
                );
            }
        }
    }

    /// Dials every peer's counterpart and flushes the endpoint, which
    /// completes once its wireup has.
    fn connect_all(&mut self, reply: Sender<Result<()>>) {
        let processes: Vec<u32> = self.worker_counts.keys().copied().collect();
        let remotes: Vec<Remote> = processes
            .into_iter()
            .map(|process| self.counterpart(process))
            .filter(|remote| *remote != self.me && self.peers.contains_key(remote))
            .collect();
        let mut connecting = Connecting {
            remaining: 0,
            failure: None,
            reply,
        };
        for remote in remotes {
            let ep = match self.endpoint(remote) {
                Ok(ep) => ep,
                Err(e) => {
                    connecting.failure.get_or_insert(e);
                    continue;
                }
            };
            let mut param = ucp_request_param_t::empty();
            param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
            param.cb.send = Some(on_flushed);
            param.user_data = remote_to_user_data(remote);
            // SAFETY: a live endpoint of this worker; the callback frees the
            // request.
            let flushing = unsafe { (self.api.ep_flush_nbx)(ep, &param) };
            if ptr_is_request(flushing) {
                connecting.remaining += 1;
            } else if ptr_is_err(flushing) {
                let error = status::unavailable(format!(
                    "UCX transport: connecting to process {} failed: {}",
                    remote.0,
                    self.api.describe(ptr_status(flushing))
                ));
                connecting.failure.get_or_insert(error);
            }
        }
        if connecting.remaining == 0 {
            let _ = connecting
                .reply
                .send(connecting.failure.map_or(Ok(()), Err));
        } else {
            self.connecting.push(connecting);
        }
    }

    fn flushed(&mut self, peer: Remote, status: ucs_status_t) {
        let failure = (status != UCS_OK).then(|| {
            status::unavailable(format!(
                "UCX transport: connecting to process {} failed: {}",
                peer.0,
                self.api.describe(status)
            ))
        });
        // Flushes are answered in the order of the Connects that made them;
        // the oldest Connect still waiting takes this one.
        if let Some(connecting) = self.connecting.first_mut() {
            connecting.remaining -= 1;
            if let Some(failure) = failure {
                connecting.failure.get_or_insert(failure);
            }
            if connecting.remaining == 0 {
                let done = self.connecting.remove(0);
                let _ = done.reply.send(done.failure.map_or(Ok(()), Err));
            }
        }
    }

    /// The worker of `process` this one sends to: the one of the same
    /// index, wrapped to its count.
    fn counterpart(&self, process: u32) -> Remote {
        let count = self
            .worker_counts
            .get(&process)
            .copied()
            .unwrap_or(1)
            .max(1);
        (process, self.me.1 % count)
    }

    /// The endpoint to worker `peer`, created on first use.
    fn endpoint(&mut self, peer: Remote) -> Result<ucp_ep_h> {
        let callbacks = Arc::as_ptr(&self.callbacks);
        let Some(state) = self.peers.get_mut(&peer) else {
            return Err(status::failed_precondition(format!(
                "UCX transport: process {} has no UCX worker {} in this job's session",
                peer.0, peer.1
            )));
        };
        state.last_used = Instant::now();
        if let Some(ep) = state.ep {
            return Ok(ep);
        }
        if let Some(why) = state.failed.take() {
            log::info!(
                "UCX transport: connecting to process {} worker {} again (its last connection \
                 was closed: {why})",
                peer.0,
                peer.1
            );
        }
        let tag = Box::new(EndpointTag { callbacks, peer });
        let name = CString::new(format!("crosshost-to-{}.{}", peer.0, peer.1)).expect("no NUL");
        let params = ucp_ep_params_t {
            field_mask: UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | UCP_EP_PARAM_FIELD_ERR_HANDLER
                | UCP_EP_PARAM_FIELD_NAME,
            address: state.address.as_ptr().cast(),
            err_mode: UCP_ERR_HANDLING_MODE_PEER,
            err_handler: ucp_err_handler_t {
                cb: Some(on_endpoint_error),
                arg: (&*tag as *const EndpointTag).cast_mut().cast(),
            },
            user_data: std::ptr::null_mut(),
            flags: 0,
            sockaddr: ucs_sock_addr_t {
                addr: std::ptr::null(),
                addrlen: 0,
            },
            conn_request: std::ptr::null_mut(),
            name: name.as_ptr(),
            local_sockaddr: ucs_sock_addr_t {
                addr: std::ptr::null(),
                addrlen: 0,
            },
        };
        let mut ep: ucp_ep_h = std::ptr::null_mut();
        // SAFETY: the address bytes are a worker address from the peer's
        // session entry (UCX validates it), the tag outlives the endpoint
        // (kept in `tags` until the endpoint is closed and retired a sweep
        // later), and the worker is ours.
        let created = unsafe { (self.api.ep_create)(self.worker, &params, &mut ep) };
        if created != UCS_OK {
            return Err(status::unavailable(format!(
                "UCX transport: cannot create an endpoint to process {}: {}",
                peer.0,
                self.api.describe(created)
            )));
        }
        self.tags.insert(ep as usize, tag);
        state.ep = Some(ep);
        self.callbacks
            .own_endpoints
            .borrow_mut()
            .insert(ep as usize);
        Ok(ep)
    }

    /// Starts one part; true when UCX holds it for later progress.
    fn start_send(&mut self, order: SendPart) -> bool {
        timeline::mark_hash(Point::UcxSendStart, order.mark_key);
        let remote = self.counterpart(order.peer);
        if let Some(handshake) = self.handshake_mut(remote) {
            handshake.held.push(Deferred::Send(order));
            return false;
        }
        let ep = match self.endpoint(remote) {
            Ok(ep) => ep,
            Err(e) => {
                order.transfer.fail(e);
                return false;
            }
        };
        let request = self.next_request;
        self.next_request += 1;
        let header = DataHeader {
            part: order.part,
            parts: order.parts,
            token: order.token,
            offset: order.offset,
            length: order.len as u64,
            request,
            sender: self.me.0,
            sender_worker: self.me.1,
            receipt: order.receipt,
        }
        .encode();
        self.sends.insert(
            request,
            SendOp {
                peer: order.peer,
                token: order.token,
                header,
                bytes: OpBytes::Part,
                transfer: order.transfer,
                start: order.start,
                len: order.len,
                answered: false,
                expired: false,
                ucx_done: false,
                deadline: order.deadline,
                timeout: order.timeout,
            },
        );
        self.held.store(self.sends.len(), Ordering::Release);
        let rendezvous = order.len >= RENDEZVOUS_FROM;
        self.submit(request, ep, AM_DATA, rendezvous)
    }

    /// Starts one chunk message of a stream; true when UCX holds it for
    /// later progress.
    fn start_chunk(&mut self, order: ChunkOrder) -> bool {
        let remote = self.counterpart(order.peer);
        if let Some(handshake) = self.handshake_mut(remote) {
            handshake.held.push(Deferred::Chunk(order));
            return false;
        }
        let ep = match self.endpoint(remote) {
            Ok(ep) => ep,
            Err(e) => {
                order.sent.set(Err(e.clone()));
                order.transfer.fail(e);
                return false;
            }
        };
        let request = self.next_request;
        self.next_request += 1;
        let mut header = order.header;
        header.request = request;
        header.sender = self.me.0;
        header.sender_worker = self.me.1;
        let len = header.length as usize;
        let rendezvous = order.rendezvous || len >= RENDEZVOUS_FROM;
        self.sends.insert(
            request,
            SendOp {
                peer: order.peer,
                token: header.token,
                header: header.encode(),
                bytes: OpBytes::Chunk {
                    bytes: order.bytes,
                    _keep: order.keep,
                    sent: order.sent,
                },
                transfer: order.transfer,
                start: 0,
                len,
                // No ACK of its own: the stream's home waits for that.
                answered: true,
                expired: false,
                ucx_done: false,
                deadline: order.deadline,
                timeout: order.timeout,
            },
        );
        self.held.store(self.sends.len(), Ordering::Release);
        self.submit(request, ep, AM_CHUNK, rendezvous)
    }

    /// A chunked stream's home: waits for its one ACK until `deadline`.
    fn await_stream(
        &mut self,
        peer: u32,
        token: AuthToken,
        transfer: Arc<Transfer>,
        deadline: Instant,
        timeout: Duration,
    ) -> u64 {
        let request = self.next_request;
        self.next_request += 1;
        self.sends.insert(
            request,
            SendOp {
                peer,
                token,
                header: Vec::new(),
                bytes: OpBytes::Stream,
                transfer,
                start: 0,
                len: 0,
                answered: false,
                expired: false,
                // Nothing of its own for UCX to send.
                ucx_done: true,
                deadline,
                timeout,
            },
        );
        self.held.store(self.sends.len(), Ordering::Release);
        request
    }

    /// Receives held rendezvous data into `target`; `done` is told from
    /// the completion callback, or now if UCX finished (or failed) at once.
    ///
    /// # Safety
    /// `target` must stay valid for `len` bytes, and unused by anyone else,
    /// until `done` is told.
    unsafe fn receive_held(
        &mut self,
        data: HeldData,
        target: *mut u8,
        len: usize,
        done: Arc<Signal>,
    ) {
        let op = Box::into_raw(Box::new(HeldReceive {
            done,
            api: self.api.clone(),
        }));
        let mut recv = ucp_request_param_t::empty();
        recv.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK
            | UCP_OP_ATTR_FIELD_USER_DATA
            | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        recv.cb.recv_am = Some(on_held_received);
        recv.user_data = op.cast();
        recv.memory_type = UCS_MEMORY_TYPE_HOST;
        // SAFETY: `data` is rendezvous data this worker's callback kept
        // (returning UCS_INPROGRESS) and nobody received or released yet;
        // the caller keeps `target` valid until `done` is told.
        let started =
            unsafe { (self.api.am_recv_data_nbx)(self.worker, data.0, target.cast(), len, &recv) };
        if ptr_is_request(started) {
            return;
        }
        // SAFETY: done (or failed) at once: no callback will come, and the
        // op is still ours.
        let op = unsafe { Box::from_raw(op) };
        op.done.set(match ptr_status(started) {
            UCS_OK => Ok(()),
            failed => Err(status::unavailable(format!(
                "UCX receiver: receiving a staged chunk failed: {}",
                self.api.describe(failed)
            ))),
        });
    }

    /// Sends the op `request` (already in `sends`) over `ep` as active
    /// message `id`; true when UCX holds it for later progress.
    fn submit(&mut self, request: u64, ep: ucp_ep_h, id: u32, rendezvous: bool) -> bool {
        let op = self.sends.get(&request).expect("inserted by the caller");
        let mut param = ucp_request_param_t::empty();
        param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK
            | UCP_OP_ATTR_FIELD_USER_DATA
            | UCP_OP_ATTR_FIELD_MEMORY_TYPE
            | UCP_OP_ATTR_FIELD_FLAGS;
        param.cb.send = Some(on_send_complete);
        param.user_data = request as usize as *mut c_void;
        param.memory_type = UCS_MEMORY_TYPE_HOST;
        // The receiver answers a refusal over this very connection: it never
        // dials a sender it does not know to be real.
        param.flags = UCP_AM_SEND_FLAG_REPLY;
        if rendezvous {
            param.flags |= UCP_AM_SEND_FLAG_RNDV;
        }
        let bytes = match &op.bytes {
            // SAFETY: the part's range lies inside the payload
            // (`UcxTransport::send` cut it).
            OpBytes::Part => unsafe { op.transfer.payload.as_ptr().add(op.start) },
            OpBytes::Chunk { bytes, .. } => *bytes,
            OpBytes::Stream => std::ptr::null(),
        };
        // SAFETY: the header lives in the op and the bytes in its transfer
        // (a part) or with its keep-alive and unwritten until `sent` is told
        // (a chunk), all kept until UCX reports the request complete; the ep
        // is live.
        let sent = unsafe {
            (self.api.am_send_nbx)(
                ep,
                id,
                op.header.as_ptr().cast(),
                op.header.len(),
                bytes.cast(),
                op.len,
                &param,
            )
        };
        self.submitted(request, sent)
    }

    /// Records how `am_send_nbx` answered: done at once, failed, or pending
    /// (its completion comes as an event).
    fn submitted(&mut self, request: u64, sent: ucs_status_ptr_t) -> bool {
        // A request completes through its callback, which frees it
        // (`ucp_request_free` before completion would silence the callback).
        if !ptr_is_request(sent) {
            self.send_completed(request, ptr_status(sent));
        }
        // A done send still waits for its receiver's ack, which arrives as
        // a network event; a pending one needs progress.
        ptr_is_request(sent)
    }

    fn send_completed(&mut self, request: u64, status: ucs_status_t) {
        let Some(op) = self.sends.get_mut(&request) else {
            return;
        };
        op.ucx_done = true;
        let chunk = matches!(op.bytes, OpBytes::Chunk { .. });
        let error = (status != UCS_OK).then(|| {
            status::unavailable(format!(
                "UCX send to process {} failed: {}",
                op.peer,
                self.api.describe(status)
            ))
        });
        if let Some(error) = &error {
            // A chunk answers for its stream: its failure is the stream's.
            if !op.answered || chunk {
                op.answered = true;
                op.transfer.fail(error.clone());
            }
        }
        // UCX no longer reads the chunk's bytes.
        if let OpBytes::Chunk { sent, .. } = &op.bytes {
            sent.set(error.map_or(Ok(()), Err));
        }
        self.release_if_finished(request);
    }

    fn acked(&mut self, ack: Ack) {
        let Some(op) = self.sends.get_mut(&ack.request) else {
            return;
        };
        // Only the receiver knows the token: anything else is a forgery.
        if op.token != ack.token {
            self.callbacks.rejected.fetch_add(1, Ordering::Relaxed);
            log::warn!(
                "UCX transport: an acknowledgement for request {} with the wrong token was ignored",
                ack.request
            );
            return;
        }
        let peer = op.peer;
        let remote = self.counterpart(peer);
        self.heard_from(remote);
        let Some(op) = self.sends.get_mut(&ack.request) else {
            return;
        };
        if let (OpBytes::Chunk { .. }, Err(e)) = (&op.bytes, &ack.outcome) {
            // A chunk is answered only by a refusal: its stream fails.
            op.transfer.fail(e.clone());
        } else if !op.answered {
            op.answered = true;
            match &ack.outcome {
                Ok(()) => op.transfer.part_acked(ack.receipt_applied),
                Err(e) => op.transfer.fail(e.clone()),
            }
        }
        if ack.outcome.is_ok() && !self.lanes.lock().contains_key(&peer) {
            self.record_lanes(self.counterpart(peer));
        }
        self.release_if_finished(ack.request);
    }

    fn release_if_finished(&mut self, request: u64) {
        if let Some(op) = self.sends.get(&request) {
            if op.ucx_done && op.answered {
                self.sends.remove(&request);
                self.held.store(self.sends.len(), Ordering::Release);
            }
        }
    }

    /// Sends past their deadline fail; one that UCX still holds is cut off
    /// by closing its endpoint (the peer is not answering).
    fn expire(&mut self, now: Instant) {
        // A chunk UCX still holds past its stream's deadline is late too
        // (its receiver is not taking it): the endpoint is cut.
        let late: Vec<u64> = self
            .sends
            .iter()
            .filter(|(_, op)| {
                let chunk_held = matches!(op.bytes, OpBytes::Chunk { .. }) && !op.ucx_done;
                (!op.answered || chunk_held) && !op.expired && op.deadline <= now
            })
            .map(|(id, _)| *id)
            .collect();
        for request in late {
            let Some(op) = self.sends.get_mut(&request) else {
                continue;
            };
            op.answered = true;
            // Once: the endpoint is cut below, and UCX completes the chunk.
            op.expired = true;
            let peer = op.peer;
            // `timeout` is what was left of the send's own time when the
            // transfer began.
            let left = Duration::from_millis(op.timeout.as_millis() as u64);
            let error = status::deadline_exceeded(format!(
                "UCX transfer to process {peer} did not complete by the send's deadline ({left:?} \
                 were left when it began)"
            ));
            op.transfer.fail(error);
            let stuck = !op.ucx_done;
            self.release_if_finished(request);
            if stuck {
                let remote = self.counterpart(peer);
                self.close_endpoint(remote, true);
                if let Some(state) = self.peers.get_mut(&remote) {
                    state.failed = Some("a send to it missed its deadline".into());
                }
            }
        }
    }

    fn endpoint_failed(&mut self, peer: Remote, ep: ucp_ep_h, status: ucs_status_t) {
        log::warn!(
            "UCX transport: an endpoint to process {} failed: {}",
            peer.0,
            self.api.describe(status)
        );
        if self.peers.get(&peer).and_then(|p| p.ep) == Some(ep) {
            let why = self.api.describe(status);
            // The acknowledgements of sends whose bytes already left would
            // come from that process: they fail now, not at their deadline.
            self.fail_unanswered_to(
                peer.0,
                status::unavailable(format!(
                    "UCX transfer to process {}: its endpoint failed ({why}) before the receiver \
                     acknowledged the bytes",
                    peer.0
                )),
            );
            self.close_endpoint(peer, true);
            // Its staged streams into this process fail now too.
            self.callbacks.streams.end_from(
                peer.0,
                &status::unavailable(format!(
                    "UCX: the endpoint to the sending process {} failed ({why}) before its \
                     staged stream landed",
                    peer.0
                )),
            );
            if let Some(state) = self.peers.get_mut(&peer) {
                state.failed = Some(why);
            }
        }
    }

    /// Process `process` is gone (its control link closed): its sends that
    /// wait for an acknowledgement fail now, and its endpoint is closed,
    /// cutting off what UCX still holds for it. The endpoint is not marked
    /// failed: a send to the process is only made again once it answers
    /// on its link (`TransferService::check_receiver_alive`).
    fn peer_lost(&mut self, process: u32) {
        self.fail_unanswered_to(
            process,
            status::unavailable(format!(
                "UCX transfer to process {process}: the process is gone (its control link \
                 closed) before it acknowledged the bytes"
            )),
        );
        let remote = self.counterpart(process);
        self.close_endpoint(remote, true);
        // What a close handshake held for it is not sent to a dead process.
        let (lost, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.replay)
            .into_iter()
            .partition(|(held_for, _)| held_for.0 == process);
        self.replay = kept;
        let gone = status::unavailable(format!(
            "UCX transfer to process {process}: the process is gone (its control link closed) \
             before the transfer was sent"
        ));
        for (_, held) in lost {
            fail_deferred(held, &gone);
        }
        self.callbacks.streams.end_from(
            process,
            &status::unavailable(format!(
                "the sending process {process} is gone (its control link closed) before its \
                 staged stream landed"
            )),
        );
    }

    fn fail_unanswered_to(&mut self, process: u32, error: Status) {
        let waiting: Vec<u64> = self
            .sends
            .iter()
            .filter(|(_, op)| !op.answered && op.peer == process)
            .map(|(id, _)| *id)
            .collect();
        for request in waiting {
            if let Some(op) = self.sends.get_mut(&request) {
                op.answered = true;
                op.transfer.fail(error.clone());
            }
            self.release_if_finished(request);
        }
    }

    /// Closes idle endpoints by the connection room's rules (unused for the
    /// idle timeout, or least recently used beyond the bound; never one a
    /// send still uses or waits on), at most once a second, each by a
    /// handshake with its peer (`ask_to_close`). The next send to a closed
    /// one dials again.
    fn sweep_endpoints(&mut self, now: Instant) {
        if now < self.next_sweep {
            return;
        }
        self.next_sweep = now + SWEEP_EVERY.min(self.limits.grace.max(MIN_SWEEP_EVERY));
        self.free_finished_closes(now);
        let unanswered: Vec<Remote> = self
            .peers
            .iter()
            .filter(|(_, p)| {
                p.handshake
                    .as_ref()
                    .is_some_and(|h| h.asked + ANSWER_WAIT <= now)
            })
            .map(|(remote, _)| *remote)
            .collect();
        for remote in unanswered {
            log::warn!(
                "UCX transport: process {} worker {} did not answer a close of its endpoint pair \
                 in {ANSWER_WAIT:?}: closing this side",
                remote.0,
                remote.1
            );
            self.close_endpoint(remote, true);
            if let Some(state) = self.peers.get_mut(&remote) {
                state.failed = Some(format!("it did not answer a close in {ANSWER_WAIT:?}"));
            }
        }
        let open: Vec<Remote> = self
            .peers
            .iter()
            .filter(|(_, p)| p.ep.is_some())
            .map(|(remote, _)| *remote)
            .collect();
        let uses: Vec<Use> = open
            .iter()
            .enumerate()
            .map(|(i, remote)| Use {
                peer: i as u32,
                last_used: self.peers[remote].last_used,
                // One already asked about counts as open until it closes.
                idle: self.peers[remote].handshake.is_none() && self.quiet_toward(*remote),
            })
            .collect();
        for chosen in choose_to_close(&uses, &self.limits, now) {
            self.ask_to_close(open[chosen as usize], now);
        }
    }

    /// Nothing of this worker's is in flight toward `remote`'s process, or
    /// waits on it.
    fn quiet_toward(&self, remote: Remote) -> bool {
        !self
            .sends
            .values()
            .any(|op| op.peer == remote.0 && !(op.answered && op.ucx_done))
    }

    fn handshake_mut(&mut self, remote: Remote) -> Option<&mut Handshake> {
        self.peers.get_mut(&remote)?.handshake.as_mut()
    }

    /// Starts closing the pair of endpoints to `remote`: UCX drops, without
    /// an error, what a peer sends on its endpoint of a pair whose other
    /// endpoint was closed, so the peer is asked first and this side closes
    /// only once it agreed (it had nothing in flight on the pair, and makes
    /// a new endpoint for anything later). Until the answer, what this side
    /// would send to the peer is held.
    fn ask_to_close(&mut self, remote: Remote, now: Instant) {
        let Some(ep) = self.peers.get(&remote).and_then(|p| p.ep) else {
            return;
        };
        let number = self.next_handshake;
        self.next_handshake += 1;
        let ask = CloseMessage {
            kind: CloseKind::Ask,
            sender: self.me.0,
            sender_worker: self.me.1,
            handshake: number,
        };
        match send_close_over(&self.api, ep, &ask) {
            Ok(_) => {
                log::debug!(
                    "UCX transport: asking process {} worker {} to close the idle endpoint pair",
                    remote.0,
                    remote.1
                );
                if let Some(state) = self.peers.get_mut(&remote) {
                    state.handshake = Some(Handshake {
                        number,
                        asked: now,
                        held: Vec::new(),
                    });
                }
            }
            // An endpoint that cannot carry a few bytes is broken anyway.
            Err(e) => {
                log::debug!(
                    "UCX transport: the endpoint to process {} worker {} failed a close's ask \
                     ({e}): closing it",
                    remote.0,
                    remote.1
                );
                self.close_endpoint(remote, true);
            }
        }
    }

    /// A close handshake's message that came over `ep`, one of this
    /// worker's own endpoints (`on_close` answers an ask over any other
    /// connection itself: it closes nothing of this side's).
    fn close_message(&mut self, message: CloseMessage, ep: ucp_ep_h) {
        // Closed since the message came (an earlier event of the same round
        // of progress): nothing to answer over, nothing left to close.
        if !self
            .callbacks
            .own_endpoints
            .borrow()
            .contains(&(ep as usize))
        {
            return;
        }
        let remote = (message.sender, message.sender_worker);
        if self.peers.get(&remote).and_then(|p| p.ep) != Some(ep) {
            // A message naming one worker over the endpoint to another.
            self.callbacks.rejected.fetch_add(1, Ordering::Relaxed);
            log::warn!(
                "UCX transport: a close message naming process {} worker {} came over the \
                 endpoint to another worker: ignored",
                remote.0,
                remote.1
            );
            return;
        }
        match message.kind {
            CloseKind::Ask => {
                let agree = self.quiet_toward(remote);
                let answer = CloseMessage {
                    kind: if agree {
                        CloseKind::Agree
                    } else {
                        CloseKind::Decline
                    },
                    sender: self.me.0,
                    sender_worker: self.me.1,
                    handshake: message.handshake,
                };
                let answered_at_once = match send_close_over(&self.api, ep, &answer) {
                    Ok(pending) => !pending,
                    Err(e) => {
                        log::debug!(
                            "UCX transport: answering a close to process {} failed: {e}",
                            remote.0
                        );
                        false
                    }
                };
                if agree {
                    self.callbacks
                        .closed_by_handshake
                        .fetch_add(1, Ordering::Relaxed);
                    // Forced where nothing is left to send: UCX (1.22, over
                    // TCP) keeps the socket of a pair closed by flushing on
                    // both sides open for the process's life, one more per
                    // close and redial. An answer UCX still holds is
                    // flushed first (its socket may then stay).
                    self.close_endpoint(remote, answered_at_once);
                }
            }
            CloseKind::Agree | CloseKind::Decline => {
                let asked = self
                    .peers
                    .get(&remote)
                    .and_then(|p| p.handshake.as_ref())
                    .is_some_and(|h| h.number == message.handshake);
                if !asked {
                    // An answer to an ask this side gave up on, or to none.
                    return;
                }
                if message.kind == CloseKind::Agree {
                    self.callbacks
                        .closed_by_handshake
                        .fetch_add(1, Ordering::Relaxed);
                    // Nothing of this side's is in flight on the pair (it
                    // held what came since its ask): forced, see above.
                    self.close_endpoint(remote, true);
                } else {
                    // The peer still uses the pair: keep it, and do not ask
                    // again before it was idle a while.
                    if let Some(state) = self.peers.get_mut(&remote) {
                        state.last_used = Instant::now();
                    }
                    self.end_handshake(remote);
                }
            }
        }
    }

    /// Starts what handshakes held, now that they ended; true if any.
    fn replay_deferred(&mut self) -> bool {
        if self.replay.is_empty() {
            return false;
        }
        let now = Instant::now();
        for (remote, held) in std::mem::take(&mut self.replay) {
            if held.deadline().is_some_and(|deadline| deadline <= now) {
                fail_deferred(held, &held_past_deadline(remote));
                continue;
            }
            match held {
                Deferred::Send(order) => {
                    self.start_send(order);
                }
                Deferred::Chunk(order) => {
                    self.start_chunk(order);
                }
                Deferred::Ack(ack) => self.send_ack(remote, ack),
            }
        }
        true
    }

    /// Ends this side's handshake with `remote`, if any: what it held is
    /// started again by `replay_deferred`.
    fn end_handshake(&mut self, remote: Remote) {
        if let Some(handshake) = self
            .peers
            .get_mut(&remote)
            .and_then(|state| state.handshake.take())
        {
            self.replay
                .extend(handshake.held.into_iter().map(|held| (remote, held)));
        }
    }

    /// Frees the requests of endpoint closes UCX has finished, and the tags
    /// of endpoints closed before the last sweep.
    fn free_finished_closes(&mut self, now: Instant) {
        self.retired_tags
            .retain(|(closed, _)| *closed + SWEEP_EVERY > now);
        let mut finished = Vec::new();
        for (request, tag) in std::mem::take(&mut self.closing) {
            // SAFETY: a close request UCX returned and nobody freed yet.
            if unsafe { (self.api.request_check_status)(request) } == UCS_INPROGRESS {
                self.closing.push((request, tag));
            } else {
                // SAFETY: finished, and freed once (it leaves the list).
                unsafe { (self.api.request_free)(request) };
                finished.push((now, tag));
            }
        }
        self.retired_tags.extend(finished);
    }

    fn open_endpoints(&self) -> usize {
        self.peers.values().filter(|p| p.ep.is_some()).count()
    }

    /// Closes the endpoint to `peer`, forcibly (its requests complete with
    /// an error) or after flushing what is in flight.
    /// What a close handshake held for the peer is started again (on a new
    /// endpoint) by `replay_deferred`.
    fn close_endpoint(&mut self, peer: Remote, force: bool) {
        self.end_handshake(peer);
        let Some(ep) = self.peers.get_mut(&peer).and_then(|state| state.ep.take()) else {
            return;
        };
        self.callbacks
            .own_endpoints
            .borrow_mut()
            .remove(&(ep as usize));
        let mut param = ucp_request_param_t::empty();
        param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = if force { UCP_EP_CLOSE_FLAG_FORCE } else { 0 };
        // SAFETY: a live endpoint of this worker, closed once (taken above).
        let closing = unsafe { (self.api.ep_close_nbx)(ep, &param) };
        if let Some(tag) = self.tags.remove(&(ep as usize)) {
            if ptr_is_request(closing) {
                self.closing.push((closing, tag));
            } else {
                self.retired_tags.push((Instant::now(), tag));
            }
        } else if ptr_is_request(closing) {
            // SAFETY: a request UCX returned, not kept anywhere.
            unsafe { (self.api.request_free)(closing) };
        }
        self.lanes.lock().remove(&peer.0);
    }

    /// Bytes are in (or refused): the receipt they carried sets its key
    /// first (so the receiver's wait ends without a trip back to the
    /// sender), then the sender hears it.
    /// Traffic from `peer` counts as use of this side's endpoint to it: an
    /// endpoint closed while its peer still sends loses what is in flight.
    fn heard_from(&mut self, peer: Remote) {
        if let Some(state) = self.peers.get_mut(&peer) {
            state.last_used = Instant::now();
        }
    }

    fn landed(&mut self, peer: Remote, mut ack: Ack, receipt: Option<(Arc<Landing>, Vec<u8>)>) {
        self.heard_from(peer);
        let last = match &receipt {
            // Every part carries the receipt; the last to land applies it.
            Some((landing, _)) if ack.outcome.is_ok() => landing.part_landed(),
            _ => false,
        };
        if let (true, Some((landing, value))) = (last, receipt) {
            ack.receipt_applied = landing.apply_receipt(&value, &self.callbacks.sink, "UCX");
        }
        self.send_ack(peer, ack);
    }

    fn send_ack(&mut self, peer: Remote, ack: Ack) {
        if let Some(handshake) = self.handshake_mut(peer) {
            handshake.held.push(Deferred::Ack(ack));
            return;
        }
        // Bytes that landed prove their sender knew a destination's token:
        // it may be dialled to hear so. A refusal goes back over the
        // connection its message came on (`on_data`), never over a new one:
        // a message naming any sender at all (a dead process, one of another
        // job) must not make this process dial it.
        let open = self.peers.get(&peer).and_then(|p| p.ep);
        let ep = match (open, &ack.outcome) {
            (Some(ep), _) => ep,
            (None, Err(refusal)) => {
                log::debug!(
                    "UCX receiver: a refusal for process {} was not sent (no connection to it): \
                     {refusal}",
                    peer.0
                );
                return;
            }
            (None, Ok(())) => match self.endpoint(peer) {
                Ok(ep) => ep,
                Err(e) => {
                    log::warn!(
                        "UCX receiver: cannot acknowledge to process {}: {e}",
                        peer.0
                    );
                    return;
                }
            },
        };
        if !self.lanes.lock().contains_key(&peer.0) {
            self.record_lanes(peer);
        }
        if let Err(e) = send_ack_over(&self.api, ep, &ack) {
            log::warn!(
                "UCX receiver: acknowledging to process {} failed: {e}",
                peer.0
            );
        }
    }

    /// What UCX says about the endpoint to `peer` (its lanes' transports).
    fn record_lanes(&mut self, peer: Remote) {
        let Some(ep) = self.peers.get(&peer).and_then(|p| p.ep) else {
            return;
        };
        let text = print_to_string(|file| {
            // SAFETY: a live endpoint and an open stream.
            unsafe { (self.api.ep_print_info)(ep, file) }
        });
        let lanes = lane_transports(&text);
        if !lanes.is_empty() {
            log::info!("UCX transport: process {} is reached over {lanes}", peer.0);
        }
        self.lanes.lock().insert(peer.0, lanes);
    }

    fn shut_down(&mut self, orders: Receiver<Command>) {
        self.stopped = true;
        // Whatever is still queued or waiting fails now.
        while let Ok(command) = orders.try_recv() {
            match command {
                Command::Send(order) => order.transfer.fail(stopped()),
                Command::SendChunk(order) => {
                    order.transfer.fail(stopped());
                    order.sent.set(Err(stopped()));
                }
                Command::Held(HeldOrder::Receive { done, .. }) => done.set(Err(stopped())),
                _ => {}
            }
        }
        for op in self.sends.values_mut() {
            op.answered = true;
            op.transfer.fail(stopped());
        }
        // The transport's staged streams stop where they are.
        self.callbacks.streams.end_all(&stopped());
        for connecting in self.connecting.drain(..) {
            let _ = connecting.reply.send(Err(stopped()));
        }
        // Flushed, not forced: a peer still wiring up with us gets its
        // messages through (UCX 1.13 aborts a process whose connection
        // fails while its wireup replies are pending).
        let peers: Vec<Remote> = self.peers.keys().copied().collect();
        for peer in peers {
            self.close_endpoint(peer, false);
        }
        for (_, held) in std::mem::take(&mut self.replay) {
            fail_deferred(held, &stopped());
        }
        let until = Instant::now() + CLOSE_GRACE;
        while Instant::now() < until {
            self.progress();
            let still_closing = self.closing.iter().any(|&(request, _)| {
                // SAFETY: close requests UCX returned, freed only below.
                unsafe { (self.api.request_check_status)(request) == UCS_INPROGRESS }
            });
            let still_sending = self.sends.values().any(|op| !op.ucx_done);
            if !still_closing && !still_sending {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let stuck = self.sends.values().filter(|op| !op.ucx_done).count();
        if stuck > 0 {
            log::warn!("UCX transport: {stuck} sends were still held by UCX at shutdown");
        }
        // Tags outlive the worker: UCX may call an endpoint's handler until
        // it is destroyed.
        let mut tags_until_destroyed = Vec::new();
        for (request, tag) in self.closing.drain(..) {
            // SAFETY: each close request is freed once.
            unsafe { (self.api.request_free)(request) };
            tags_until_destroyed.push(tag);
        }
        // SAFETY: every endpoint is closed; destroying the worker, then the
        // context, is the last UCP use of either.
        unsafe {
            (self.api.worker_destroy)(self.worker);
            (self.api.cleanup)(self.context);
        }
        CURRENT.with(|current| current.borrow_mut().take());
        // UCX is gone: no chunk's bytes are read any more.
        for op in self.sends.values() {
            if let OpBytes::Chunk { sent, .. } = &op.bytes {
                sent.set(Err(stopped()));
            }
        }
        // No callback can run any more: free what was still in flight.
        for op in self.callbacks.receiving.borrow_mut().drain() {
            // SAFETY: ops in `receiving` came from Box::into_raw and were not
            // freed (their completion never came).
            drop(unsafe { Box::from_raw(op as *mut ReceiveOp) });
        }
    }
}

fn held_past_deadline(remote: Remote) -> Status {
    status::deadline_exceeded(format!(
        "UCX transfer to process {}: its deadline passed while the endpoint to it was being \
         closed (the peer was asked to close an idle pair and answered late)",
        remote.0
    ))
}

/// Fails what a close handshake held and will never send.
fn fail_deferred(held: Deferred, error: &Status) {
    match held {
        Deferred::Send(order) => order.transfer.fail(error.clone()),
        Deferred::Chunk(order) => {
            order.sent.set(Err(error.clone()));
            order.transfer.fail(error.clone());
        }
        Deferred::Ack(_) => {}
    }
}

/// Runs `print` on a memory stream and returns what it wrote.
fn print_to_string(print: impl FnOnce(*mut libc::FILE)) -> String {
    let mut buffer: *mut libc::c_char = std::ptr::null_mut();
    let mut size: libc::size_t = 0;
    // SAFETY: valid out-pointers; the stream is closed and the buffer freed
    // below.
    let file = unsafe { libc::open_memstream(&mut buffer, &mut size) };
    if file.is_null() {
        return String::new();
    }
    print(file);
    // SAFETY: closing the stream we opened finalises `buffer` and `size`.
    unsafe { libc::fclose(file) };
    if buffer.is_null() {
        return String::new();
    }
    // SAFETY: open_memstream's buffer holds `size` bytes (and a NUL).
    let text = unsafe { std::slice::from_raw_parts(buffer.cast::<u8>(), size) };
    let text = String::from_utf8_lossy(text).into_owned();
    // SAFETY: the buffer was allocated by open_memstream with malloc.
    unsafe { libc::free(buffer.cast()) };
    text
}

/// The distinct `transport/device` names in `ucp_ep_print_info`'s lane
/// table (lines like `#                 lane[0]:  3:tcp/eth0.0 md[1] ...`).
pub fn lane_transports(text: &str) -> String {
    let mut names: Vec<String> = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.split("lane[").nth(1) else {
            continue;
        };
        let Some(spec) = rest.split_whitespace().nth(1) else {
            continue;
        };
        let name = spec.split_once(':').map_or(spec, |(_, n)| n);
        let name = name.split(' ').next().unwrap_or(name).to_string();
        if name.contains('/') && !names.contains(&name) {
            names.push(name);
        }
    }
    names.join(",")
}

// ------------------------------ UCX callbacks ------------------------------

/// DATA: claim the destination, take the bytes (eager: copy now;
/// rendezvous: start the receive into it), and have the loop acknowledge.
unsafe extern "C" fn on_data(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: `arg` is the worker's Callbacks (see `Worker::create`), alive
    // for as long as the worker can call us.
    let callbacks = unsafe { &*(arg as *const Callbacks) };
    // SAFETY: UCX passes a valid param and `header_length` header bytes.
    let (recv_attr, header) = unsafe {
        (
            (*param).recv_attr,
            std::slice::from_raw_parts(header.cast::<u8>(), header_length),
        )
    };
    let rendezvous = recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV != 0;
    let parsed = match DataHeader::decode(header) {
        Ok(parsed) => parsed,
        Err(e) => {
            callbacks.drop_message(format!("a DATA message was dropped: {}", e.message));
            return UCS_OK;
        }
    };
    // A refusal goes back over the connection the message came on, now,
    // while UCX vouches for that endpoint; where there is none, only over
    // an endpoint of ours already open (`Worker::send_ack`).
    // SAFETY: `param` is valid for the duration of this callback.
    let reply_ep = unsafe { (*param).reply_ep };
    let refuse_answering = |refusal: Status| {
        refuse_over_reply(
            callbacks,
            recv_attr,
            reply_ep,
            (parsed.sender, parsed.sender_worker),
            parsed.request,
            parsed.token,
            refusal,
        )
    };
    if parsed.length != length as u64 {
        return refuse_answering(status::invalid_argument(format!(
            "a {length}-byte message whose header says {} bytes",
            parsed.length
        )));
    }
    let claimed = match callbacks.registry.claim_part(
        &parsed.token,
        parsed.part,
        parsed.parts,
        parsed.offset,
        parsed.length,
    ) {
        Ok(claimed) => claimed,
        Err(refusal) => return refuse_answering(refusal),
    };
    let destination = claimed.destination;
    if destination.staged().is_some() && length > 0 {
        // Its bytes land through its staging ring, in chunks (its pointer
        // may be null): a DATA message cannot take it.
        return refuse_answering(status::failed_precondition(
            "the destination is staged: it takes its bytes as chunk messages of at most the \
             size its descriptor names",
        ));
    }
    // A receipt applies only to a destination whose key this process holds.
    let receipt = match claimed.landing {
        Some(landing) if !parsed.receipt.is_empty() => Some((landing, parsed.receipt.clone())),
        _ => None,
    };
    // SAFETY: offset + length lies inside the destination (checked above),
    // whose memory stays valid while `destination` (or the op holding it)
    // lives, under the WritableDestination contract.
    let target = unsafe { destination.as_mut_ptr().add(parsed.offset as usize) };
    if !rendezvous {
        if length > 0 {
            // SAFETY: eager data: `length` readable bytes at `data` for the
            // duration of this callback; the target range is ours (claimed).
            unsafe { std::ptr::copy_nonoverlapping(data.cast::<u8>(), target, length) };
        }
        callbacks.push(Event::Received {
            peer: (parsed.sender, parsed.sender_worker),
            ack: Ack {
                request: parsed.request,
                token: parsed.token,
                outcome: Ok(()),
                receipt_applied: false,
            },
            receipt,
        });
        return UCS_OK;
    }
    let op = Box::into_raw(Box::new(ReceiveOp {
        callbacks,
        _destination: destination,
        peer: (parsed.sender, parsed.sender_worker),
        request: parsed.request,
        token: parsed.token,
        receipt,
        chunk: None,
    }));
    let mut recv = ucp_request_param_t::empty();
    recv.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    recv.cb.recv_am = Some(on_receive_complete);
    recv.user_data = op.cast();
    recv.memory_type = UCS_MEMORY_TYPE_HOST;
    // SAFETY: `data` is the rendezvous descriptor UCX just handed us; the
    // target range stays valid while the op (holding the destination) lives.
    let started = unsafe {
        (callbacks.api.am_recv_data_nbx)(callbacks.worker, data, target.cast(), length, &recv)
    };
    if ptr_is_request(started) {
        // Completion comes through the callback, with the op as user data.
        callbacks.receiving.borrow_mut().insert(op as usize);
    } else {
        // Done (or failed) at once: no callback will come.
        // SAFETY: `op` came from Box::into_raw above and UCX holds no
        // reference to it.
        let op = unsafe { Box::from_raw(op) };
        let outcome = match ptr_status(started) {
            UCS_OK => Ok(()),
            failed => Err(status::unavailable(format!(
                "UCX receiver: the rendezvous receive failed: {}",
                callbacks.api.describe(failed)
            ))),
        };
        let ok = outcome.is_ok();
        callbacks.push(Event::Received {
            peer: op.peer,
            ack: Ack {
                request: op.request,
                token: op.token,
                outcome,
                receipt_applied: false,
            },
            receipt: if ok { op.receipt } else { None },
        });
    }
    UCS_INPROGRESS
}

/// Refuses a DATA or CHUNK message: its request is answered with
/// `refusal` over the connection it came on (UCX names it in `reply_ep`),
/// never over a new one, or, where UCX gave none, by the loop.
fn refuse_over_reply(
    callbacks: &Callbacks,
    recv_attr: u64,
    reply_ep: ucp_ep_h,
    sender: Remote,
    request: u64,
    token: AuthToken,
    refusal: Status,
) -> ucs_status_t {
    callbacks.rejected.fetch_add(1, Ordering::Relaxed);
    let ack = Ack {
        request,
        token,
        outcome: Err(refusal),
        receipt_applied: false,
    };
    if recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP != 0 && !reply_ep.is_null() {
        if let Err(e) = send_ack_over(&callbacks.api, reply_ep, &ack) {
            callbacks.push(Event::Dropped(format!(
                "a refusal for process {} could not be sent: {e}",
                sender.0
            )));
        }
    } else {
        callbacks.push(Event::Received {
            peer: sender,
            ack,
            receipt: None,
        });
    }
    UCS_OK
}

unsafe extern "C" fn on_receive_complete(
    request: *mut c_void,
    status: ucs_status_t,
    _length: usize,
    user_data: *mut c_void,
) {
    let op = user_data as *mut ReceiveOp;
    // SAFETY: the op is alive until the loop handles this event; its
    // callbacks pointer is the worker's, alive as long as the worker.
    let callbacks = unsafe { &*(*op).callbacks };
    callbacks.push(Event::ReceiveCompleted { op, status });
    // SAFETY: the request's one completion; UCX allows freeing it here.
    unsafe { (callbacks.api.request_free)(request) };
}

/// CHUNK: one message of a chunked stream (`stream.rs`). Claimed from the
/// registry; a staged destination's chunk is queued for its stream's thread
/// (rendezvous data kept with UCX: `UCS_INPROGRESS`), any other's lands
/// where it belongs at once (eager) or through a rendezvous receive, and
/// the stream is ACKed once, when its last byte landed.
unsafe extern "C" fn on_chunk(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: as in `on_data`.
    let callbacks = unsafe { &*(arg as *const Callbacks) };
    // SAFETY: UCX passes a valid param and `header_length` header bytes.
    let (recv_attr, header, reply_ep) = unsafe {
        (
            (*param).recv_attr,
            std::slice::from_raw_parts(header.cast::<u8>(), header_length),
            (*param).reply_ep,
        )
    };
    let rendezvous = recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV != 0;
    let parsed = match ChunkHeader::decode(header) {
        Ok(parsed) => parsed,
        Err(e) => {
            callbacks.drop_message(format!("a chunk message was dropped: {}", e.message));
            return UCS_OK;
        }
    };
    // A refusal answers this message's own request, over the connection it
    // came on (never over a new one), and fails its stream at the sender.
    let refuse = |refusal: Status| {
        refuse_over_reply(
            callbacks,
            recv_attr,
            reply_ep,
            (parsed.sender, parsed.sender_worker),
            parsed.request,
            parsed.token,
            refusal,
        )
    };
    if parsed.length != length as u64 {
        return refuse(status::invalid_argument(format!(
            "a {length}-byte chunk whose header says {} bytes",
            parsed.length
        )));
    }
    let Some(port) = callbacks.port.get() else {
        return refuse(status::unavailable(
            "UCX receiver: not ready for chunks yet",
        ));
    };
    let placed = callbacks
        .streams
        .arrive(&callbacks.registry, &parsed, port, || {
            if rendezvous {
                Arrived::Held {
                    data: HeldData(data),
                    port: port.clone(),
                }
            } else {
                let bytes = if length == 0 {
                    Vec::new()
                } else {
                    // SAFETY: eager data: `length` readable bytes at `data`
                    // for the duration of this callback.
                    unsafe { std::slice::from_raw_parts(data.cast::<u8>(), length) }.to_vec()
                };
                Arrived::Eager(bytes)
            }
        });
    let claimed = match placed {
        Err(refusal) => return refuse(refusal),
        // Kept by its stream until its thread has a slot for it.
        Ok(ChunkPlace::Staged) if rendezvous => return UCS_INPROGRESS,
        Ok(ChunkPlace::Staged) => return UCS_OK,
        Ok(ChunkPlace::Direct(claimed)) => claimed,
    };
    let home = (parsed.sender, parsed.home_worker);
    let receipt = match &claimed.landing {
        Some(landing) if !parsed.receipt.is_empty() => {
            Some((landing.clone(), parsed.receipt.clone()))
        }
        _ => None,
    };
    let ack = |outcome: Result<()>| Ack {
        request: parsed.stream_request,
        token: parsed.token,
        outcome,
        receipt_applied: false,
    };
    // SAFETY: the chunk lies inside its stream's range, which lies inside
    // the destination (both checked by the claim); the memory stays valid
    // while `claimed.destination` (or the op holding it) lives, under the
    // WritableDestination contract (not staged: its pointer is real).
    let target = unsafe { claimed.destination.as_mut_ptr().add(parsed.offset as usize) };
    if !rendezvous {
        if length > 0 {
            // SAFETY: eager data: `length` readable bytes at `data` for the
            // duration of this callback; the target range is ours (claimed).
            unsafe { std::ptr::copy_nonoverlapping(data.cast::<u8>(), target, length) };
        }
        if claimed.progress.landed(parsed.length) {
            callbacks.push(Event::Received {
                peer: home,
                ack: ack(Ok(())),
                receipt,
            });
        }
        return UCS_OK;
    }
    let op = Box::into_raw(Box::new(ReceiveOp {
        callbacks,
        _destination: claimed.destination,
        peer: home,
        request: parsed.stream_request,
        token: parsed.token,
        receipt,
        chunk: Some((claimed.progress, parsed.length)),
    }));
    let mut recv = ucp_request_param_t::empty();
    recv.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    recv.cb.recv_am = Some(on_receive_complete);
    recv.user_data = op.cast();
    recv.memory_type = UCS_MEMORY_TYPE_HOST;
    // SAFETY: `data` is the rendezvous descriptor UCX just handed us; the
    // target range stays valid while the op (holding the destination) lives.
    let started = unsafe {
        (callbacks.api.am_recv_data_nbx)(callbacks.worker, data, target.cast(), length, &recv)
    };
    if ptr_is_request(started) {
        callbacks.receiving.borrow_mut().insert(op as usize);
        return UCS_INPROGRESS;
    }
    // SAFETY: done (or failed) at once: no callback will come, and the op
    // is still ours.
    let op = unsafe { Box::from_raw(op) };
    let Some((progress, chunk_len)) = op.chunk else {
        return UCS_INPROGRESS;
    };
    match ptr_status(started) {
        UCS_OK if progress.landed(chunk_len) => callbacks.push(Event::Received {
            peer: home,
            ack: ack(Ok(())),
            receipt: op.receipt,
        }),
        UCS_OK => {}
        failed if progress.fail() => callbacks.push(Event::Received {
            peer: home,
            ack: ack(Err(status::unavailable(format!(
                "UCX receiver: receiving a chunk failed: {}",
                callbacks.api.describe(failed)
            )))),
            receipt: None,
        }),
        _ => {}
    }
    UCS_INPROGRESS
}

/// A receive of held chunk data into a ring slot completed.
unsafe extern "C" fn on_held_received(
    request: *mut c_void,
    status: ucs_status_t,
    _length: usize,
    user_data: *mut c_void,
) {
    // SAFETY: made by Box::into_raw in `receive_held`, freed only here
    // (this request's one completion).
    let op = unsafe { Box::from_raw(user_data as *mut HeldReceive) };
    op.done.set(if status == UCS_OK {
        Ok(())
    } else {
        Err(status::unavailable(format!(
            "UCX receiver: receiving a staged chunk failed: {}",
            op.api.describe(status)
        )))
    });
    // SAFETY: the request's one completion; UCX allows freeing it here.
    unsafe { (op.api.request_free)(request) };
}

unsafe extern "C" fn on_ack(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: as in `on_data`.
    let callbacks = unsafe { &*(arg as *const Callbacks) };
    // SAFETY: UCX passes a valid param.
    if unsafe { (*param).recv_attr } & UCP_AM_RECV_ATTR_FLAG_RNDV != 0 {
        // An ack is a few bytes; a rendezvous one is not ours.
        callbacks.rejected.fetch_add(1, Ordering::Relaxed);
        return UCS_OK;
    }
    // SAFETY: `header_length` header bytes and `length` eager data bytes,
    // valid during this callback.
    let (header, payload) = unsafe {
        (
            std::slice::from_raw_parts(header.cast::<u8>(), header_length),
            if length == 0 {
                &[][..]
            } else {
                std::slice::from_raw_parts(data.cast::<u8>(), length)
            },
        )
    };
    match Ack::decode(header, payload) {
        Ok(ack) => callbacks.push(Event::Ack(ack)),
        Err(e) => {
            callbacks.drop_message(format!("an acknowledgement was dropped: {}", e.message));
        }
    }
    UCS_OK
}

unsafe extern "C" fn on_send_complete(
    request: *mut c_void,
    status: ucs_status_t,
    user_data: *mut c_void,
) {
    // The request id travels as the user data; the Callbacks come through a
    // thread-local set by the loop (UCX calls this only inside progress, on
    // the progress thread).
    CURRENT.with(|current| {
        if let Some(callbacks) = current.borrow().as_ref() {
            callbacks.push(Event::SendCompleted {
                request: user_data as usize as u64,
                status,
            });
            // SAFETY: the request's one completion; UCX allows freeing it here.
            unsafe { (callbacks.api.request_free)(request) };
        }
    });
}

/// Sends `ack` over `ep`, a live endpoint of the calling thread's worker.
fn send_ack_over(api: &UcpApi, ep: ucp_ep_h, ack: &Ack) -> std::result::Result<(), String> {
    let (header, message) = ack.encode();
    send_small_over(api, ep, AM_ACK, header.to_vec(), message, false).map(|_| ())
}

/// Sends a close handshake's message over `ep`, a live endpoint of the
/// calling thread's worker, with the reply flag: its receiver learns which
/// connection it came over. True while UCX still holds it.
fn send_close_over(
    api: &UcpApi,
    ep: ucp_ep_h,
    message: &CloseMessage,
) -> std::result::Result<bool, String> {
    send_small_over(
        api,
        ep,
        AM_CLOSE,
        message.encode().to_vec(),
        Vec::new(),
        true,
    )
}

/// Sends a few bytes of header and payload as active message `id`; true
/// while UCX still holds them (false: sent at once).
fn send_small_over(
    api: &UcpApi,
    ep: ucp_ep_h,
    id: u32,
    header: Vec<u8>,
    payload: Vec<u8>,
    reply: bool,
) -> std::result::Result<bool, String> {
    // The bytes must live until UCX is done with them: a holder freed by
    // the completion callback.
    let holder = Box::into_raw(Box::new((header, payload)));
    let mut param = ucp_request_param_t::empty();
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = Some(on_small_sent);
    param.user_data = holder.cast();
    if reply {
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_AM_SEND_FLAG_REPLY;
    }
    // SAFETY: the holder stays allocated until the completion callback (or
    // the immediate completion below) frees it; the caller vouches for ep.
    let sent = unsafe {
        let (header, payload) = &*holder;
        (api.am_send_nbx)(
            ep,
            id,
            header.as_ptr().cast(),
            header.len(),
            payload.as_ptr().cast(),
            payload.len(),
            &param,
        )
    };
    // A request frees itself and the holder in its callback.
    if ptr_is_request(sent) {
        return Ok(true);
    }
    // SAFETY: completed (or failed) at once: no callback will come.
    drop(unsafe { Box::from_raw(holder) });
    if ptr_is_err(sent) {
        return Err(api.describe(ptr_status(sent)));
    }
    Ok(false)
}

unsafe extern "C" fn on_small_sent(
    request: *mut c_void,
    _status: ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: the holder was made by Box::into_raw in `send_small_over` and
    // is freed only here (this request's one completion).
    drop(unsafe { Box::from_raw(user_data as *mut (Vec<u8>, Vec<u8>)) });
    CURRENT.with(|current| {
        if let Some(callbacks) = current.borrow().as_ref() {
            // SAFETY: the request's one completion; UCX allows freeing it here.
            unsafe { (callbacks.api.request_free)(request) };
        }
    });
}

unsafe extern "C" fn on_close(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    _data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: as in `on_data`.
    let callbacks = unsafe { &*(arg as *const Callbacks) };
    // SAFETY: UCX passes a valid param.
    let (recv_attr, reply_ep) = unsafe { ((*param).recv_attr, (*param).reply_ep) };
    let decoded = if header.is_null() || length != 0 || recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV != 0
    {
        Err(status::invalid_argument(
            "a close message is a header of its own length and nothing else",
        ))
    } else {
        // SAFETY: `header_length` header bytes, valid during this callback.
        CloseMessage::decode(unsafe {
            std::slice::from_raw_parts(header.cast::<u8>(), header_length)
        })
    };
    let message = match decoded {
        Ok(message) => message,
        Err(e) => {
            callbacks.drop_message(format!("a close message was dropped: {}", e.message));
            return UCS_OK;
        }
    };
    if recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP == 0 || reply_ep.is_null() {
        callbacks.rejected.fetch_add(1, Ordering::Relaxed);
        return UCS_OK;
    }
    if callbacks
        .own_endpoints
        .borrow()
        .contains(&(reply_ep as usize))
    {
        // The loop decides: it knows what this side has in flight.
        callbacks.push(Event::Close { message, reply_ep });
    } else if message.kind == CloseKind::Ask {
        // Over a connection this side did not make (a stranger's, or the
        // peer's half of a pair UCX did not join with this side's
        // endpoint): nothing of this side's rides on it, so closing it
        // loses nothing here. Answered now, while UCX vouches for the
        // endpoint (it may drop one it made itself once this returns).
        let agree = CloseMessage {
            kind: CloseKind::Agree,
            sender: callbacks.me.0,
            sender_worker: callbacks.me.1,
            handshake: message.handshake,
        };
        if let Err(e) = send_close_over(&callbacks.api, reply_ep, &agree) {
            callbacks.push(Event::Dropped(format!("answering a close failed: {e}")));
        }
    }
    UCS_OK
}

fn remote_to_user_data(remote: Remote) -> *mut c_void {
    (((remote.0 as usize) << 16) | remote.1 as usize) as *mut c_void
}

unsafe extern "C" fn on_flushed(
    request: *mut c_void,
    status: ucs_status_t,
    user_data: *mut c_void,
) {
    let packed = user_data as usize;
    let peer = ((packed >> 16) as u32, (packed & 0xffff) as u16);
    CURRENT.with(|current| {
        if let Some(callbacks) = current.borrow().as_ref() {
            callbacks.push(Event::Flushed { peer, status });
            // SAFETY: the request's one completion; UCX allows freeing it here.
            unsafe { (callbacks.api.request_free)(request) };
        }
    });
}

unsafe extern "C" fn on_endpoint_error(arg: *mut c_void, ep: ucp_ep_h, status: ucs_status_t) {
    // SAFETY: the tag lives until shutdown, after the worker is destroyed.
    let tag = unsafe { &*(arg as *const EndpointTag) };
    // SAFETY: the tag's callbacks are the worker's, alive with it.
    let callbacks = unsafe { &*tag.callbacks };
    callbacks.push(Event::EndpointFailed {
        peer: tag.peer,
        ep,
        status,
    });
}

thread_local! {
    /// The progress thread's Callbacks, for completion callbacks whose user
    /// data is taken by a request id.
    static CURRENT: RefCell<Option<Arc<Callbacks>>> = const { RefCell::new(None) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_transports_reads_ucx_lane_tables() {
        let text = "#\n# UCP endpoint 0x7f\n#\n#               peer: <no debug data>\n\
                    #                 lane[0]:  2:tcp/xhb0-va.0 md[1]           -> md[1]/tcp/sysdev[255] am am_bw#0\n\
                    #                 lane[1]:  3:tcp/xhb0-va.0 md[1]           -> md[1]/tcp/sysdev[255] rma_bw#0\n\
                    #                 lane[2]:  0:self/memory md[0]             -> am\n";
        assert_eq!(lane_transports(text), "tcp/xhb0-va.0,self/memory");
        assert_eq!(lane_transports("nothing here"), "");
    }
}
