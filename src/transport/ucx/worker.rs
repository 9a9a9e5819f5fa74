//! `UcxTransport`: one UCP context and worker per client, owned by one
//! progress thread. UCX runs in its single-thread mode: every UCP call is
//! made on that thread; other threads hand it sends through a channel and
//! wake it through an eventfd. The thread sleeps in poll(2) on the worker's
//! event fd and that eventfd, waking at least every `IDLE_WAKE` so UCX's
//! keepalive (which runs inside `ucp_worker_progress`) still finds dead
//! peers on idle endpoints; it never spins.
//!
//! Callbacks from UCX (active messages, completions, endpoint failures) run
//! inside `ucp_worker_progress` on the thread. They only record events; the
//! loop acts on them between UCP calls, so no UCP call is made re-entrantly
//! and no Rust state is borrowed across one. The exception is a DATA
//! message, which must be taken while UCX holds it: its destination is
//! claimed from the registry, eager bytes are copied in and a rendezvous
//! receive into it is started right in the callback.
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ffi::{c_void, CString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;

use super::library::LoadedUcx;
use super::sys::*;
use super::wire::{Ack, DataHeader, AM_ACK, AM_DATA, DATA_HEADER_LEN};
use crate::backend::Allocation;
use crate::status::{self, Code, Result, Status};
use crate::transport::auth_token::AuthToken;
use crate::transport::destination::WritableDestination;
use crate::transport::registry::DestinationRegistry;

/// Longest sleep of an idle progress thread.
const IDLE_WAKE: Duration = Duration::from_millis(200);
/// Bound on closing the endpoints at shutdown.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// The bytes of one send, kept alive (by `_owner`) until UCX is done
/// reading them.
pub struct Payload {
    pointer: *const u8,
    len: usize,
    _owner: Box<dyn Send>,
}

// SAFETY: the pointer is only read, by the progress thread, while the owner
// (moved along with it) keeps the bytes alive.
unsafe impl Send for Payload {}

impl Payload {
    /// Bytes this payload owns.
    pub fn owned(bytes: Vec<u8>) -> Payload {
        let bytes = bytes.into_boxed_slice();
        Payload {
            pointer: bytes.as_ptr(),
            len: bytes.len(),
            _owner: Box::new(bytes),
        }
    }

    /// `len` bytes at `pointer`, kept valid and unwritten by `owner`.
    ///
    /// # Safety
    ///
    /// `pointer` must be readable for `len` bytes, nothing may write them,
    /// and they must stay mapped for as long as `owner` lives.
    pub unsafe fn borrowed(owner: Box<dyn Send>, pointer: *const u8, len: usize) -> Payload {
        Payload {
            pointer,
            len,
            _owner: owner,
        }
    }

    /// The first `len` bytes of `memory`: in place where they are host
    /// memory (the allocation kept alive with them), else copied out.
    pub fn of_allocation(memory: &Allocation, len: usize) -> Result<Payload> {
        if memory.len() < len {
            return Err(status::internal(format!(
                "a {}-byte source for a {len}-byte send",
                memory.len()
            )));
        }
        match memory.host_pointer()? {
            // SAFETY: `host_pointer` promises `len()` readable bytes that
            // stay valid, and unwritten once defined, while the allocation
            // lives; the payload owns a clone of it.
            Some(pointer) => Ok(unsafe {
                Payload::borrowed(Box::new(memory.clone()), pointer as *const u8, len)
            }),
            None => {
                let mut staged = vec![0u8; len];
                memory.read(0, &mut staged)?;
                Ok(Payload::owned(staged))
            }
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Told the outcome of one send, exactly once.
pub type SendDone = Box<dyn FnOnce(Result<()>) + Send>;

struct SendOrder {
    peer: u32,
    token: AuthToken,
    offset: u64,
    payload: Payload,
    deadline: Instant,
    timeout: Duration,
    done: SendDone,
}

enum Command {
    Peers(HashMap<u32, Vec<u8>>),
    Send(Box<SendOrder>),
    Stop,
}

/// What a UCX callback saw, for the loop to act on.
enum Event {
    SendCompleted {
        request: u64,
        status: ucs_status_t,
    },
    Ack(Ack),
    /// Bytes landed in a claimed destination (or could not): tell the sender.
    Received {
        peer: u32,
        ack: Ack,
    },
    ReceiveCompleted {
        op: *mut ReceiveOp,
        status: ucs_status_t,
    },
    EndpointFailed {
        peer: u32,
        ep: ucp_ep_h,
        status: ucs_status_t,
    },
    Dropped(String),
}

/// What callbacks may touch: fixed handles, the registry, and the event
/// list (borrowed for one push at a time).
struct Callbacks {
    api: Arc<UcpApi>,
    worker: ucp_worker_h,
    registry: Arc<DestinationRegistry>,
    events: RefCell<Vec<Event>>,
    /// Rendezvous receives in flight (their ops are freed on completion, or
    /// at shutdown once the worker is gone).
    receiving: RefCell<HashSet<usize>>,
    rejected: Arc<AtomicU64>,
}

impl Callbacks {
    fn push(&self, event: Event) {
        self.events.borrow_mut().push(event);
    }
}

/// A rendezvous receive into a claimed destination.
struct ReceiveOp {
    callbacks: *const Callbacks,
    _destination: Arc<dyn WritableDestination>,
    peer: u32,
    request: u64,
    token: AuthToken,
}

/// One send: its header and bytes stay here until UCX is done with them.
struct SendOp {
    peer: u32,
    token: AuthToken,
    header: [u8; DATA_HEADER_LEN],
    payload: Payload,
    done: Option<SendDone>,
    ucx_done: bool,
    deadline: Instant,
    timeout: Duration,
}

/// Tells the endpoint's error handler whose endpoint it is.
struct EndpointTag {
    callbacks: *const Callbacks,
    peer: u32,
}

struct Peer {
    address: Vec<u8>,
    ep: Option<ucp_ep_h>,
}

/// Transport names of each peer's endpoint lanes (e.g. `tcp/eth0`), as UCX
/// chose them, once an endpoint carried a transfer.
pub type Lanes = Arc<Mutex<HashMap<u32, String>>>;

struct Handle {
    commands: Sender<Command>,
    wake: OwnedFd,
    stopping: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Handle {
    fn order(&self, command: Command) -> std::result::Result<(), Command> {
        self.commands.send(command).map_err(|e| e.0)?;
        let one: u64 = 1;
        // SAFETY: writing 8 bytes from a live u64 to our own eventfd.
        unsafe {
            libc::write(
                self.wake.as_raw_fd(),
                (&one as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        Ok(())
    }
}

/// The UCX data plane of one client.
pub struct UcxTransport {
    handle: Arc<Handle>,
    address: Vec<u8>,
    registry: Arc<DestinationRegistry>,
    lanes: Lanes,
    rejected: Arc<AtomicU64>,
    held: Arc<AtomicUsize>,
    version: String,
}

impl std::fmt::Debug for UcxTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UcxTransport(UCX {})", self.version)
    }
}

impl UcxTransport {
    /// Creates the context and worker on a new progress thread; this process
    /// is `me` among the job's processes. The worker's address is known on
    /// return.
    pub fn start(ucx: &LoadedUcx, me: u32) -> Result<UcxTransport> {
        let (commands, orders) = crossbeam_channel::unbounded();
        // SAFETY: eventfd with valid flags; the result is checked.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(status::resource_exhausted(format!(
                "UCX transport: eventfd: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let wake = unsafe { OwnedFd::from_raw_fd(raw) };
        let wake_fd = wake.as_raw_fd();
        let registry = DestinationRegistry::new();
        let lanes: Lanes = Arc::default();
        let held: Arc<AtomicUsize> = Arc::default();
        let thread_held = held.clone();
        let (ready, started) = crossbeam_channel::bounded(1);
        let api = ucx.api.clone();
        let thread_registry = registry.clone();
        let thread_lanes = lanes.clone();
        let thread = std::thread::Builder::new()
            .name("crosshost-ucx".into())
            .spawn(move || {
                let setup =
                    match Worker::create(api, me, thread_registry, thread_lanes, thread_held) {
                        Ok(worker) => worker,
                        Err(e) => {
                            let _ = ready.send(Err(e));
                            return;
                        }
                    };
                let _ = ready.send(Ok((
                    setup.address.clone(),
                    setup.callbacks.rejected.clone(),
                )));
                setup.run(orders, wake_fd);
            })
            .map_err(|e| status::resource_exhausted(format!("UCX transport: thread: {e}")))?;
        let (address, rejected) = match started.recv() {
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
        Ok(UcxTransport {
            handle: Arc::new(Handle {
                commands,
                wake,
                stopping: AtomicBool::new(false),
                thread: Mutex::new(Some(thread)),
            }),
            address,
            registry,
            lanes,
            rejected,
            held,
            version: ucx.version.clone(),
        })
    }

    /// This worker's address, for the job's other processes.
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    /// The destinations UCX senders may write.
    pub fn registry(&self) -> &Arc<DestinationRegistry> {
        &self.registry
    }

    /// The other processes' worker addresses.
    pub fn set_peers(&self, peers: HashMap<u32, Vec<u8>>) {
        let _ = self.handle.order(Command::Peers(peers));
    }

    /// The lanes UCX chose to each peer it carried a transfer to or from.
    pub fn lanes(&self) -> HashMap<u32, String> {
        self.lanes.lock().clone()
    }

    /// Sends whose bytes UCX still holds (answered or not).
    pub fn sends_held(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    /// DATA messages refused (unknown token, bad header or bounds).
    pub fn rejected_messages(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }

    /// Sends `payload` into the destination registered under `token` at
    /// process `peer`, `offset` bytes in. `done` hears the receiver's verdict
    /// (OK once the bytes are in the destination), a failure, or
    /// DEADLINE_EXCEEDED after `timeout`.
    pub fn send(
        &self,
        peer: u32,
        token: AuthToken,
        offset: u64,
        payload: Payload,
        timeout: Duration,
        done: SendDone,
    ) {
        let order = SendOrder {
            peer,
            token,
            offset,
            payload,
            deadline: Instant::now() + timeout,
            timeout,
            done,
        };
        if self.handle.stopping.load(Ordering::Acquire) {
            (order.done)(Err(stopped()));
            return;
        }
        if let Err(Command::Send(order)) = self.handle.order(Command::Send(Box::new(order))) {
            (order.done)(Err(stopped()));
        }
    }
}

fn stopped() -> Status {
    status::unavailable("UCX transport: the client is being destroyed")
}

impl Drop for UcxTransport {
    fn drop(&mut self) {
        self.handle.stopping.store(true, Ordering::Release);
        let _ = self.handle.order(Command::Stop);
        if let Some(thread) = self.handle.thread.lock().take() {
            crate::sync::runner::join_all_except_current(vec![thread], "UcxTransport");
        }
    }
}

// --------------------------- the progress thread ---------------------------

struct Worker {
    api: Arc<UcpApi>,
    context: ucp_context_h,
    worker: ucp_worker_h,
    efd: RawFd,
    me: u32,
    address: Vec<u8>,
    callbacks: Rc<Callbacks>,
    peers: HashMap<u32, Peer>,
    sends: HashMap<u64, SendOp>,
    next_request: u64,
    /// Boxed: UCX holds each tag's address for its endpoint's life.
    #[allow(clippy::vec_box)]
    tags: Vec<Box<EndpointTag>>,
    lanes: Lanes,
    held: Arc<AtomicUsize>,
    closing: Vec<ucs_status_ptr_t>,
}

fn ucx_error(api: &UcpApi, what: &str, status: ucs_status_t) -> Status {
    status::unavailable(format!("UCX: {what} failed: {}", api.describe(status)))
}

impl Worker {
    fn create(
        api: Arc<UcpApi>,
        me: u32,
        registry: Arc<DestinationRegistry>,
        lanes: Lanes,
        held: Arc<AtomicUsize>,
    ) -> Result<Worker> {
        let name = CString::new("pjrt-crosshost").expect("no NUL");
        let mut config: *mut ucp_config = std::ptr::null_mut();
        // SAFETY: null prefix and file mean UCX's defaults and environment;
        // `config` is a valid out-pointer.
        let status = unsafe { (api.config_read)(std::ptr::null(), std::ptr::null(), &mut config) };
        if status != UCS_OK {
            return Err(ucx_error(&api, "ucp_config_read", status));
        }
        let params = ucp_params_t {
            field_mask: UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
            features: UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
            request_size: 0,
            request_init: None,
            request_cleanup: None,
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: name.as_ptr(),
        };
        let mut context: ucp_context_h = std::ptr::null_mut();
        // SAFETY: params and config are valid for the call; API 1.13 is the
        // oldest we load, later libraries accept it.
        let status = unsafe { (api.init_version)(1, 13, &params, config, &mut context) };
        // SAFETY: the config is ours and no longer needed.
        unsafe { (api.config_release)(config) };
        if status != UCS_OK {
            return Err(ucx_error(&api, "ucp_init", status));
        }
        let worker_params = ucp_worker_params_t {
            field_mask: UCP_WORKER_PARAM_FIELD_THREAD_MODE
                | UCP_WORKER_PARAM_FIELD_EVENTS
                | UCP_WORKER_PARAM_FIELD_NAME,
            thread_mode: UCS_THREAD_MODE_SINGLE,
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
        let callbacks = Rc::new(Callbacks {
            api: api.clone(),
            worker,
            registry,
            events: RefCell::new(Vec::new()),
            receiving: RefCell::new(HashSet::new()),
            rejected: Default::default(),
        });
        for (id, cb) in [
            (AM_DATA, on_data as ucp_am_recv_callback_t),
            (AM_ACK, on_ack as ucp_am_recv_callback_t),
        ] {
            let handler = ucp_am_handler_param_t {
                field_mask: UCP_AM_HANDLER_PARAM_FIELD_ID
                    | UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                    | UCP_AM_HANDLER_PARAM_FIELD_CB
                    | UCP_AM_HANDLER_PARAM_FIELD_ARG,
                id,
                flags: UCP_AM_FLAG_WHOLE_MSG,
                cb: Some(cb),
                arg: Rc::as_ptr(&callbacks) as *mut c_void,
            };
            // SAFETY: the handler's arg outlives the worker (the Arc is held
            // by the Worker, which destroys the worker before dropping it).
            let status = unsafe { (api.worker_set_am_recv_handler)(worker, &handler) };
            if status != UCS_OK {
                return Err(fail("ucp_worker_set_am_recv_handler", status));
            }
        }
        Ok(Worker {
            api,
            context,
            worker,
            efd,
            me,
            address,
            callbacks,
            peers: HashMap::new(),
            sends: HashMap::new(),
            next_request: 1,
            tags: Vec::new(),
            lanes,
            held,
            closing: Vec::new(),
        })
    }

    fn run(mut self, orders: Receiver<Command>, wake: RawFd) {
        CURRENT.with(|current| *current.borrow_mut() = Some(self.callbacks.clone()));
        'serve: loop {
            while let Ok(command) = orders.try_recv() {
                match command {
                    Command::Peers(peers) => self.set_peers(peers),
                    Command::Send(order) => self.start_send(*order),
                    Command::Stop => break 'serve,
                }
            }
            self.progress();
            self.expire(Instant::now());
            // SAFETY: a live worker of this thread.
            let armed = unsafe { (self.api.worker_arm)(self.worker) };
            if armed == UCS_ERR_BUSY {
                continue;
            }
            let mut fds = [
                libc::pollfd {
                    fd: self.efd,
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: wake,
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            let sleep = self
                .sends
                .values()
                .map(|op| op.deadline.saturating_duration_since(Instant::now()))
                .min()
                .unwrap_or(IDLE_WAKE)
                .min(IDLE_WAKE);
            let _ = crate::transport::poll::poll(&mut fds, Some(sleep));
            if fds[1].revents != 0 {
                let mut count = 0u64;
                // SAFETY: reading 8 bytes into a live u64 from our eventfd
                // (nonblocking: at most it fails with EAGAIN).
                unsafe { libc::read(wake, (&mut count as *mut u64).cast(), 8) };
            }
        }
        self.shut_down(orders);
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
                Event::Received { peer, ack } => self.send_ack(peer, ack),
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
                    };
                    self.send_ack(op.peer, ack);
                }
                Event::EndpointFailed { peer, ep, status } => {
                    self.endpoint_failed(peer, ep, status)
                }
                Event::Dropped(why) => log::warn!("UCX transport: {why}"),
            }
        }
        any
    }

    fn set_peers(&mut self, peers: HashMap<u32, Vec<u8>>) {
        for (process, address) in peers {
            if process == self.me {
                continue;
            }
            self.peers.insert(process, Peer { address, ep: None });
        }
    }

    /// The endpoint to `peer`, created on first use.
    fn endpoint(&mut self, peer: u32) -> Result<ucp_ep_h> {
        let callbacks = Rc::as_ptr(&self.callbacks);
        let Some(state) = self.peers.get_mut(&peer) else {
            return Err(status::failed_precondition(format!(
                "UCX transport: process {peer} has no UCX worker in this job's session"
            )));
        };
        if let Some(ep) = state.ep {
            return Ok(ep);
        }
        let tag = Box::new(EndpointTag { callbacks, peer });
        let name = CString::new(format!("crosshost-to-{peer}")).expect("no NUL");
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
        // (kept in `tags` until shutdown), and the worker is ours.
        let created = unsafe { (self.api.ep_create)(self.worker, &params, &mut ep) };
        if created != UCS_OK {
            return Err(status::unavailable(format!(
                "UCX transport: cannot create an endpoint to process {peer}: {}",
                self.api.describe(created)
            )));
        }
        self.tags.push(tag);
        state.ep = Some(ep);
        Ok(ep)
    }

    fn start_send(&mut self, order: SendOrder) {
        let request = self.next_request;
        self.next_request += 1;
        let ep = match self.endpoint(order.peer) {
            Ok(ep) => ep,
            Err(e) => return (order.done)(Err(e)),
        };
        let header = DataHeader {
            token: order.token,
            offset: order.offset,
            length: order.payload.len() as u64,
            request,
            sender: self.me,
        }
        .encode();
        self.sends.insert(
            request,
            SendOp {
                peer: order.peer,
                token: order.token,
                header,
                payload: order.payload,
                done: Some(order.done),
                ucx_done: false,
                deadline: order.deadline,
                timeout: order.timeout,
            },
        );
        self.held.store(self.sends.len(), Ordering::Release);
        let op = self.sends.get(&request).expect("just inserted");
        let mut param = ucp_request_param_t::empty();
        param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK
            | UCP_OP_ATTR_FIELD_USER_DATA
            | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        param.cb.send = Some(on_send_complete);
        param.user_data = request as usize as *mut c_void;
        param.memory_type = UCS_MEMORY_TYPE_HOST;
        // SAFETY: header and payload live in the op, which stays in `sends`
        // until UCX reports the request complete; the ep is live.
        let sent = unsafe {
            (self.api.am_send_nbx)(
                ep,
                AM_DATA,
                op.header.as_ptr().cast(),
                op.header.len(),
                op.payload.pointer.cast(),
                op.payload.len,
                &param,
            )
        };
        self.submitted(request, sent);
    }

    /// Records how `am_send_nbx` answered: done at once, failed, or pending
    /// (its completion comes as an event).
    fn submitted(&mut self, request: u64, sent: ucs_status_ptr_t) {
        // A request completes through its callback, which frees it
        // (`ucp_request_free` before completion would silence the callback).
        if !ptr_is_request(sent) {
            self.send_completed(request, ptr_status(sent));
        }
    }

    fn send_completed(&mut self, request: u64, status: ucs_status_t) {
        let Some(op) = self.sends.get_mut(&request) else {
            return;
        };
        op.ucx_done = true;
        if status != UCS_OK {
            let peer = op.peer;
            let error = status::unavailable(format!(
                "UCX send to process {peer} failed: {}",
                self.api.describe(status)
            ));
            if let Some(done) = op.done.take() {
                done(Err(error));
            }
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
        if let Some(done) = op.done.take() {
            done(ack.outcome.clone());
        }
        if ack.outcome.is_ok() && !self.lanes.lock().contains_key(&peer) {
            self.record_lanes(peer);
        }
        self.release_if_finished(ack.request);
    }

    fn release_if_finished(&mut self, request: u64) {
        if let Some(op) = self.sends.get(&request) {
            if op.ucx_done && op.done.is_none() {
                self.sends.remove(&request);
                self.held.store(self.sends.len(), Ordering::Release);
            }
        }
    }

    /// Sends past their deadline fail; one that UCX still holds is cut off
    /// by closing its endpoint (the peer is not answering).
    fn expire(&mut self, now: Instant) {
        let late: Vec<u64> = self
            .sends
            .iter()
            .filter(|(_, op)| op.done.is_some() && op.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for request in late {
            let Some(op) = self.sends.get_mut(&request) else {
                continue;
            };
            let peer = op.peer;
            let error = status::deadline_exceeded(format!(
                "UCX transfer to process {peer} did not complete within {:?}",
                op.timeout
            ));
            if let Some(done) = op.done.take() {
                done(Err(error));
            }
            let stuck = !op.ucx_done;
            self.release_if_finished(request);
            if stuck {
                self.close_endpoint(peer);
            }
        }
    }

    fn endpoint_failed(&mut self, peer: u32, ep: ucp_ep_h, status: ucs_status_t) {
        log::warn!(
            "UCX transport: the endpoint to process {peer} failed: {}",
            self.api.describe(status)
        );
        if self.peers.get(&peer).and_then(|p| p.ep) == Some(ep) {
            self.close_endpoint(peer);
        }
    }

    /// Closes (forcibly) the endpoint to `peer`: its requests complete with
    /// an error, and the next send creates a new one.
    fn close_endpoint(&mut self, peer: u32) {
        let Some(ep) = self.peers.get_mut(&peer).and_then(|p| p.ep.take()) else {
            return;
        };
        let mut param = ucp_request_param_t::empty();
        param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_EP_CLOSE_FLAG_FORCE;
        // SAFETY: a live endpoint of this worker, closed once (taken above).
        let closing = unsafe { (self.api.ep_close_nbx)(ep, &param) };
        if ptr_is_request(closing) {
            self.closing.push(closing);
        }
        self.lanes.lock().remove(&peer);
    }

    fn send_ack(&mut self, peer: u32, ack: Ack) {
        let ep = match self.endpoint(peer) {
            Ok(ep) => ep,
            Err(e) => {
                log::warn!("UCX receiver: cannot acknowledge to process {peer}: {e}");
                return;
            }
        };
        if !self.lanes.lock().contains_key(&peer) {
            self.record_lanes(peer);
        }
        let (header, message) = ack.encode();
        // The ack's bytes must live until UCX is done with them; a small
        // leak-free holder freed by the completion callback.
        let holder = Box::into_raw(Box::new((header, message)));
        let mut param = ucp_request_param_t::empty();
        param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb.send = Some(on_ack_sent);
        param.user_data = holder.cast();
        // SAFETY: the holder stays allocated until the completion callback
        // (or the immediate completion below) frees it; the ep is live.
        let sent = unsafe {
            let (header, message) = &*holder;
            (self.api.am_send_nbx)(
                ep,
                AM_ACK,
                header.as_ptr().cast(),
                header.len(),
                message.as_ptr().cast(),
                message.len(),
                &param,
            )
        };
        // A request frees itself and the holder in its callback.
        if !ptr_is_request(sent) {
            if ptr_is_err(sent) {
                log::warn!(
                    "UCX receiver: acknowledging to process {peer} failed: {}",
                    self.api.describe(ptr_status(sent))
                );
            }
            // SAFETY: completed (or failed) at once: no callback will come.
            drop(unsafe { Box::from_raw(holder) });
        }
    }

    /// What UCX says about the endpoint to `peer` (its lanes' transports).
    fn record_lanes(&mut self, peer: u32) {
        let Some(ep) = self.peers.get(&peer).and_then(|p| p.ep) else {
            return;
        };
        let text = print_to_string(|file| {
            // SAFETY: a live endpoint and an open stream.
            unsafe { (self.api.ep_print_info)(ep, file) }
        });
        let lanes = lane_transports(&text);
        if !lanes.is_empty() {
            log::info!("UCX transport: process {peer} is reached over {lanes}");
        }
        self.lanes.lock().insert(peer, lanes);
    }

    fn shut_down(mut self, orders: Receiver<Command>) {
        // Whatever is still queued or waiting fails now.
        while let Ok(command) = orders.try_recv() {
            if let Command::Send(order) = command {
                (order.done)(Err(stopped()));
            }
        }
        for op in self.sends.values_mut() {
            if let Some(done) = op.done.take() {
                done(Err(stopped()));
            }
        }
        let peers: Vec<u32> = self.peers.keys().copied().collect();
        for peer in peers {
            self.close_endpoint(peer);
        }
        let until = Instant::now() + CLOSE_GRACE;
        while Instant::now() < until {
            self.progress();
            let still_closing = self.closing.iter().any(|&request| {
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
        for request in self.closing.drain(..) {
            // SAFETY: each close request is freed once.
            unsafe { (self.api.request_free)(request) };
        }
        // SAFETY: every endpoint is closed; destroying the worker, then the
        // context, is the last UCP use of either.
        unsafe {
            (self.api.worker_destroy)(self.worker);
            (self.api.cleanup)(self.context);
        }
        CURRENT.with(|current| current.borrow_mut().take());
        // No callback can run any more: free what was still in flight.
        for op in self.callbacks.receiving.borrow_mut().drain() {
            // SAFETY: ops in `receiving` came from Box::into_raw and were not
            // freed (their completion never came).
            drop(unsafe { Box::from_raw(op as *mut ReceiveOp) });
        }
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
    let refuse = |why: String| {
        callbacks.rejected.fetch_add(1, Ordering::Relaxed);
        callbacks.push(Event::Dropped(why));
        UCS_OK
    };
    let parsed = match DataHeader::decode(header) {
        Ok(parsed) => parsed,
        Err(e) => return refuse(format!("a DATA message was dropped: {}", e.message)),
    };
    let verdict = |outcome: Result<()>| Event::Received {
        peer: parsed.sender,
        ack: Ack {
            request: parsed.request,
            token: parsed.token,
            outcome,
        },
    };
    let Some(destination) = callbacks.registry.claim(&parsed.token) else {
        callbacks.rejected.fetch_add(1, Ordering::Relaxed);
        callbacks.push(verdict(Err(status::unauthenticated(
            "no destination is registered for this auth token (unknown, or the receive already \
             completed or was cancelled)",
        ))));
        return UCS_OK;
    };
    let fits = parsed.length == length as u64
        && parsed
            .offset
            .checked_add(parsed.length)
            .is_some_and(|end| end <= destination.len() as u64);
    if !fits {
        let message = format!(
            "a {length}-byte message (header: {} bytes at offset {}) does not fit the {}-byte destination",
            parsed.length,
            parsed.offset,
            destination.len()
        );
        callbacks.registry.restore(parsed.token, destination);
        callbacks.rejected.fetch_add(1, Ordering::Relaxed);
        callbacks.push(verdict(Err(Status::new(Code::OutOfRange, message))));
        return UCS_OK;
    }
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
        callbacks.push(verdict(Ok(())));
        return UCS_OK;
    }
    let op = Box::into_raw(Box::new(ReceiveOp {
        callbacks,
        _destination: destination,
        peer: parsed.sender,
        request: parsed.request,
        token: parsed.token,
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
        callbacks.push(Event::Received {
            peer: op.peer,
            ack: Ack {
                request: op.request,
                token: op.token,
                outcome,
            },
        });
    }
    UCS_INPROGRESS
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
            callbacks.rejected.fetch_add(1, Ordering::Relaxed);
            callbacks.push(Event::Dropped(format!(
                "an acknowledgement was dropped: {}",
                e.message
            )));
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

unsafe extern "C" fn on_ack_sent(
    request: *mut c_void,
    _status: ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: the holder was made by Box::into_raw in `send_ack` and is
    // freed only here (this request's one completion).
    drop(unsafe { Box::from_raw(user_data as *mut ([u8; super::wire::ACK_HEADER_LEN], Vec<u8>)) });
    CURRENT.with(|current| {
        if let Some(callbacks) = current.borrow().as_ref() {
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
    static CURRENT: RefCell<Option<Rc<Callbacks>>> = const { RefCell::new(None) };
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
