//! The client: devices, memories, and buffer creation on its backend.
use std::sync::Arc;

use super::buffer::{Buffer, HostArray};
use super::device::{Device, Memory};
use super::element_type::Shape;
use super::options::{ClientOptions, ComputeChoice, OptionValue, StoreChoice, TransportChoice};
use crate::backend::{self, Allocation, Backend};
use crate::compute_plugin::{self, ComputeClient, InnerOptions, InnerPtr, PluginFamily};
use crate::kv::callback::{CallbackStore, CallbackStoreOptions, RawKvCallbacks};
use crate::kv::memory::MemoryStore;
use crate::kv::peer::{KeyRouter, PeerAddress, PeerStore};
use crate::kv::sealed::{JobSecret, SealedStore};
use crate::kv::KeyValueStore;
use crate::pjrt::named_values::NamedValue;
use crate::status::{invalid_argument, Result};
use crate::sync::{Future, Metrics};
use crate::transfer::keys::{self, KeyReader};
use crate::transfer::memory_budget::{default_max_pending_send_bytes, default_max_receive_bytes};
use crate::transfer::service::{TransferConfig, TransferService};
use crate::transfer::session::{LocalDevices, Reachable, Session};
use crate::transport::advertise::{self, AddressHints};
use crate::transport::host_identity::HostIdentity;
use crate::transport::tcp::TcpReceiveServer;
use crate::transport::ucx::{self, UcxTransport};

pub const PLATFORM_NAME: &str = "crosshost";
pub use crate::backend::host::HOST_DEVICE_KIND;

pub struct Client {
    options: ClientOptions,
    process_index: i32,
    /// Every device of the job, ordered by global id.
    devices: Vec<Arc<Device>>,
    platform_version: String,
    transfers: Arc<TransferService>,
    backend: Arc<dyn Backend>,
    /// The compute plugin's client, when this client delegates compute.
    compute: Option<Arc<ComputeClient>>,
}

/// XLA numbers the devices of process `p` from `p * 2048`; a delegating
/// client of a multi-process job uses that numbering for its devices.
pub const DEVICE_IDS_PER_PROCESS: i32 = 2048;

/// Bound on one request over a control link (descriptor, receipt, delete).
const CONTROL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Opens the compute plugin's client if this client delegates: the
/// `compute_plugin` option, else the process's configured plugin (unless an
/// explicit `backend` asks for an embedded one).
fn open_compute(options: &ClientOptions) -> Result<Option<Arc<ComputeClient>>> {
    let path = match &options.compute {
        ComputeChoice::Off => return Ok(None),
        ComputeChoice::Path(path) => {
            if options.backend_given {
                return Err(invalid_argument(
                    "PJRT_Client_Create: 'backend' and 'compute_plugin' exclude each other: the \
                     compute plugin brings its own devices",
                ));
            }
            std::path::PathBuf::from(path)
        }
        ComputeChoice::Configured if options.backend_given => return Ok(None),
        ComputeChoice::Configured => match compute_plugin::configured_path() {
            Some(path) => path,
            None => return Ok(None),
        },
    };
    let plugin = compute_plugin::load(&path)?;
    let inner = inner_options(options, plugin.family())?;
    ComputeClient::create(plugin, &inner).map(Some)
}

/// Create options of XLA's CPU plugin and the value type each must have:
/// its 0.106 build aborts the process (bad_variant_access) on another type.
const CPU_OPTION_TYPES: &[(&str, &str)] = &[
    ("cpu_device_count", "int64"),
    ("process_id", "int64"),
    ("max_inflight_computations_per_device", "int64"),
    ("asynchronous", "bool"),
];

fn check_cpu_option(name: &str, value: &OptionValue) -> Result<()> {
    let Some((_, wanted)) = CPU_OPTION_TYPES.iter().find(|(n, _)| *n == name) else {
        return Ok(());
    };
    if value.type_name() == *wanted {
        return Ok(());
    }
    Err(invalid_argument(format!(
        "PJRT_Client_Create: create option 'compute.{name}' must be {wanted} for XLA's CPU plugin, got {}",
        value.type_name()
    )))
}

/// The compute plugin's create options: for XLA's CPU plugin our device
/// count and (in a multi-process job) our node id as its process id; then
/// the caller's `compute.*` options, which override ours.
fn inner_options(options: &ClientOptions, family: PluginFamily) -> Result<InnerOptions> {
    let mut inner: InnerOptions = Vec::new();
    if family == PluginFamily::Cpu {
        inner.push((
            "cpu_device_count".into(),
            NamedValue::Int(options.num_devices as i64),
        ));
        if options.num_nodes > 1 {
            inner.push(("process_id".into(), NamedValue::Int(options.node_id as i64)));
        }
    }
    for (name, value) in &options.compute_options {
        if family == PluginFamily::Cpu {
            check_cpu_option(name, value)?;
        }
        let value = match value {
            OptionValue::Str(s) => NamedValue::Str(s.clone()),
            OptionValue::Int(i) => NamedValue::Int(*i),
            OptionValue::IntList(l) => NamedValue::IntList(l.clone()),
            OptionValue::Float(f) => NamedValue::Float(*f),
            OptionValue::Bool(b) => NamedValue::Bool(*b),
        };
        inner.retain(|(existing, _)| existing != name);
        inner.push((name.clone(), value));
    }
    Ok(inner)
}

/// Our global ids for the compute plugin's devices: its own where they are
/// already global (one process, or a plugin that took `process_id`), else
/// XLA's numbering for this node.
fn delegated_ids(compute: &ComputeClient, options: &ClientOptions) -> Vec<i32> {
    let ids: Vec<i32> = compute.devices().iter().map(|d| d.id).collect();
    if options.num_nodes <= 1 {
        return ids;
    }
    let first = options.node_id * DEVICE_IDS_PER_PROCESS;
    let range = first..first + DEVICE_IDS_PER_PROCESS;
    if ids.iter().all(|id| range.contains(id)) {
        ids
    } else {
        (0..ids.len() as i32).map(|i| first + i).collect()
    }
}

/// Picks the store: a named in-process store when asked for; the creator's
/// KV callbacks in a multi-process job; a private store otherwise. The
/// callbacks are never used by a single-process client (JAX passes them even
/// then, and calling them there crashes).
fn choose_store(
    options: &ClientOptions,
    callbacks: Option<Arc<dyn RawKvCallbacks>>,
    etcd: Option<&Arc<EtcdHandle>>,
) -> Result<Arc<dyn KeyValueStore>> {
    Ok(match &options.store {
        StoreChoice::NamedMemory(name) => MemoryStore::named(name),
        StoreChoice::Etcd(_) => match etcd {
            Some(store) => store.clone() as Arc<dyn KeyValueStore>,
            None => return Err(crate::status::internal("kv_store=etcd without its store")),
        },
        StoreChoice::Default | StoreChoice::Callbacks if options.num_nodes > 1 => {
            let raw = callbacks.ok_or_else(|| {
                invalid_argument(
                    "PJRT_Client_Create: num_nodes > 1 needs the KV callbacks (kv_get/kv_put/kv_try_get) \
                     or the create option kv_store=memory:<name>",
                )
            })?;
            Arc::new(CallbackStore::new(
                raw,
                CallbackStoreOptions {
                    call_timeout: options.kv_call_timeout,
                    ..CallbackStoreOptions::default()
                },
            ))
        }
        StoreChoice::Default | StoreChoice::Callbacks => Arc::new(MemoryStore::new()),
    })
}

/// With `job_secret_file`, the shared store seen through `SealedStore`:
/// nobody without the secret can read a usable value from it or write one
/// the job accepts. Without it, a store others can reach is said once.
fn seal_if_asked(
    options: &ClientOptions,
    store: Arc<dyn KeyValueStore>,
    metrics: &Arc<Metrics>,
) -> Result<Arc<dyn KeyValueStore>> {
    let Some(path) = &options.job_secret_file else {
        if options.num_nodes > 1 {
            warn_if_store_is_reachable(options);
        }
        return Ok(store);
    };
    let secret = JobSecret::from_file(path)?;
    Ok(Arc::new(SealedStore::new(store, secret, metrics.clone())))
}

/// Says once per process that a store reachable beyond loopback lets anyone
/// who reaches it forge completions, and what to do about it.
fn warn_if_store_is_reachable(options: &ClientOptions) {
    static SAID: std::sync::Once = std::sync::Once::new();
    // An etcd that checks who calls (a client certificate or an RBAC user)
    // keeps strangers out; JAX's coordination service checks nobody.
    let access = &options.etcd_access;
    let open_to_all = |address: &String| {
        let is_etcd = Some(address) != options.coordinator_address.as_ref();
        !(is_etcd && (access.cert_file.is_some() || access.user.is_some()))
    };
    let reachable: Vec<String> = store_addresses(options)
        .into_iter()
        .filter(|address| !is_loopback_host(address) && open_to_all(address))
        .collect();
    if reachable.is_empty() {
        return;
    }
    SAID.call_once(|| {
        log::warn!(
            "the job's store ({}) is reachable beyond this host, and its values are not \
             sealed: anyone who can reach it can read descriptors and forge completions. \
             Give every process the same create option job_secret_file=<a file of 32 random \
             bytes> (PJRT_CROSSHOST_JOB_SECRET_FILE under JAX) to seal them",
            reachable.join(", ")
        )
    });
}

/// `host:port` (or `[v6]:port`) names a loopback host.
fn is_loopback_host(address: &str) -> bool {
    let host = match address.rsplit_once(':') {
        Some((host, _)) => host,
        None => address,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(feature = "etcd")]
pub(crate) type EtcdHandle = crate::kv::etcd::EtcdStore;
#[cfg(not(feature = "etcd"))]
pub(crate) type EtcdHandle = MemoryStore;

/// Connects to etcd when `kv_store=etcd://...` asks for it.
#[cfg(feature = "etcd")]
pub(crate) fn connect_etcd(options: &ClientOptions) -> Result<Option<Arc<EtcdHandle>>> {
    let StoreChoice::Etcd(endpoints) = &options.store else {
        return Ok(None);
    };
    let access = options.etcd_access.load()?;
    let store = crate::kv::etcd::EtcdStore::connect(crate::kv::etcd::EtcdConfig {
        endpoints: endpoints.clone(),
        access,
        lease_ttl: options.etcd_lease_ttl,
        call_timeout: options.kv_call_timeout,
    })
    .map_err(|e| {
        crate::status::Status::new(e.code, format!("PJRT_Client_Create: {}", e.message))
    })?;
    Ok(Some(Arc::new(store)))
}

#[cfg(not(feature = "etcd"))]
pub(crate) fn connect_etcd(options: &ClientOptions) -> Result<Option<Arc<EtcdHandle>>> {
    match &options.store {
        StoreChoice::Etcd(_) => Err(crate::status::unimplemented(
            "PJRT_Client_Create: kv_store=etcd://...: this build of pjrt-crosshost has no etcd \
             client (built without the cargo feature `etcd`)",
        )),
        _ => Ok(None),
    }
}

/// Watches the other processes' session entries (they live under their
/// leases): a process that dies ends the waits on the keys it writes.
#[cfg(feature = "etcd")]
fn track_etcd_peers(etcd: &EtcdHandle, session: &Session, name: &str) {
    let entries = session
        .processes
        .iter()
        .filter(|p| p.process_index != session.process_index)
        .map(|p| {
            (
                p.process_index as u32,
                Session::entry_key(name, &session.epoch, p.process_index as usize),
            )
        })
        .collect();
    let prefix = Session::entries_prefix(name, &session.epoch);
    let session = session.clone();
    let tracked = etcd.track_processes(
        &prefix,
        entries,
        Box::new(move |key| {
            let device = keys::writer_device_of(key)?;
            session
                .process_of_device(device)
                .map(|p| p.process_index as u32)
        }),
    );
    if let Err(e) = tracked {
        log::warn!("etcd: the job's processes are not watched for liveness: {e}");
    }
}

#[cfg(not(feature = "etcd"))]
fn track_etcd_peers(_: &EtcdHandle, _: &Session, _: &str) {}

/// The peer store's reader of each transfer key: the process of the device
/// its name gives, or the process it names.
fn key_router(session: &Session) -> KeyRouter {
    let session = session.clone();
    Box::new(move |key| match keys::reader_of(key)? {
        KeyReader::Device(device) => session
            .process_of_device(device)
            .map(|p| p.process_index as u32),
        KeyReader::Process(process) => u32::try_from(process).ok(),
    })
}

/// Connects the peer store to the job's other processes.
fn connect_peers(peer: &PeerStore, session: &Session, force_tcp: bool) -> Result<()> {
    let local = HostIdentity::local()?;
    let mut peers = std::collections::HashMap::new();
    for p in session
        .processes
        .iter()
        .filter(|p| p.process_index != session.process_index)
    {
        let endpoint = p.control.clone().ok_or_else(|| {
            crate::status::failed_precondition(format!(
                "PJRT_Client_Create: process {} of the job keeps its transfer keys in the                  framework's store (kv_store=callbacks?) and this one over control links                  (kv_store=default): every process of a job needs the same kv_store",
                p.process_index
            ))
        })?;
        let same_host = p.host == local && !force_tcp;
        peers.insert(
            p.process_index as u32,
            PeerAddress {
                endpoint,
                same_host,
            },
        );
    }
    peer.connect(peers, key_router(session));
    Ok(())
}

/// `host:port` of the job's stores, whose routes name the address to
/// advertise (JAX's coordination service, etcd's members).
pub(crate) fn store_addresses(options: &ClientOptions) -> Vec<String> {
    let mut addresses: Vec<String> = options.coordinator_address.iter().cloned().collect();
    if let StoreChoice::Etcd(endpoints) = &options.store {
        for endpoint in endpoints {
            let host_port = endpoint
                .split_once("://")
                .map_or(endpoint.as_str(), |(_, rest)| rest);
            addresses.push(host_port.trim_end_matches('/').to_string());
        }
    }
    addresses
}

/// Starts UCX when this process has peers to reach over it (on other hosts,
/// or any with `transport=ucx`) and exchanges worker addresses with them.
/// Under `transport=auto` a missing UCX only means TCP (said once in the
/// log); under `transport=ucx` it fails creation, naming why.
fn start_ucx(
    options: &ClientOptions,
    session: &mut Session,
    store: &dyn KeyValueStore,
    cuda_client: bool,
) -> Result<Option<UcxTransport>> {
    let local = HostIdentity::local()?;
    let me = session.process_index;
    let peers: Vec<i32> = session
        .processes
        .iter()
        .filter(|p| p.process_index != me && options.transport.wants_ucx(p.host == local))
        .map(|p| p.process_index)
        .collect();
    let forced = options.transport == TransportChoice::Ucx;
    // The same answer in every process (a job that spans hosts gives each
    // process a peer on another host): the address exchange below needs
    // all of them or none.
    if peers.is_empty() && !forced {
        return Ok(None);
    }
    let started = ucx::load_for(options.ucx_library.as_deref(), cuda_client)
        .and_then(|loaded| UcxTransport::start(&loaded, me as u32));
    if options.num_nodes > 1 {
        let addresses = started.as_ref().map(UcxTransport::addresses);
        let mine = match &addresses {
            Ok(addresses) => Ok(addresses.as_slice()),
            Err(e) => Err(e.message.as_str()),
        };
        let without =
            session.exchange_ucx(store, &options.session, mine, options.session_timeout)?;
        // Every process learns every address; only the peers reached over
        // UCX matter here (under `auto`, the ones on other hosts).
        session.ucx.retain(|peer, _| peers.contains(peer));
        let without: Vec<(i32, String)> = without
            .into_iter()
            .filter(|(peer, _)| peers.contains(peer))
            .collect();
        if forced {
            if let Some((peer, reason)) = without.first() {
                return Err(crate::status::failed_precondition(format!(
                    "PJRT_Client_Create: transport=ucx, but process {peer} of the job has no UCX: {reason}"
                )));
            }
        } else {
            for (peer, reason) in without {
                log::info!("process {peer} has no UCX ({reason}): transfers with it use TCP");
            }
        }
    }
    match started {
        Ok(transport) => {
            let mut peers: std::collections::HashMap<u32, Vec<Vec<u8>>> = session
                .ucx
                .iter()
                .map(|(process, addresses)| (*process as u32, addresses.clone()))
                .collect();
            peers.insert(me as u32, transport.addresses());
            transport.set_peers(&peers);
            transport.set_connection_limits(&options.peer_connections);
            // No endpoint is made now: each is made by the first transfer
            // to its peer (UCX 1.14 and later, the only ones used, survive a
            // peer that fails during the wire-up), so creation costs nothing
            // per peer and never waits for a slow one.
            log::info!(
                "UCX {} is this client's data plane across hosts",
                transport.version()
            );
            Ok(Some(transport))
        }
        Err(e) if forced => Err(crate::status::failed_precondition(format!(
            "PJRT_Client_Create: transport=ucx: {}",
            e.message
        ))),
        Err(e) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                log::warn!("{}: transfers to other hosts use TCP", e.message);
            });
            Ok(None)
        }
    }
}

/// Devices of every process of the job on an embedded backend.
fn embedded_devices(session: &Session, backend: &Arc<dyn Backend>) -> Vec<Arc<Device>> {
    let mut devices = Vec::new();
    for (process, ids) in session.processes.iter().zip(session.device_ids()) {
        let mine = process.process_index == session.process_index;
        for (i, id) in ids.into_iter().enumerate() {
            let local_id = if mine { i as i32 } else { -1 };
            let kind = if mine {
                backend.device_kind(i)
            } else {
                process.device_kind.clone()
            };
            devices.push(Arc::new(Device::new(
                id,
                process.process_index,
                local_id,
                mine,
                &kind,
                backend.clone(),
            )));
        }
    }
    devices.sort_by_key(|d| d.global_id);
    devices
}

/// Devices of a delegating client: this process's are the compute plugin's
/// (each inner memory shared by the devices that address it), the others'
/// come from the session.
fn delegated_devices(
    compute: &ComputeClient,
    session: &Session,
    backend: &Arc<dyn Backend>,
) -> Vec<Arc<Device>> {
    let all_ids = session.device_ids();
    let mine = session.process_index as usize;
    let local_ids = &all_ids[mine];
    let mut memories: Vec<(InnerPtr, Arc<Memory>)> = Vec::new();
    for (inner, &id) in compute.devices().iter().zip(local_ids) {
        for memory in &inner.memories {
            match memories.iter_mut().find(|(p, _)| *p == memory.memory) {
                Some((_, existing)) => {
                    let mut devices = existing.devices.clone();
                    devices.push(id);
                    *existing = Arc::new(Memory::delegated(memory, devices));
                }
                None => {
                    memories.push((memory.memory, Arc::new(Memory::delegated(memory, vec![id]))))
                }
            }
        }
    }
    let mut devices = Vec::new();
    for (process, ids) in session.processes.iter().zip(&all_ids) {
        if process.process_index == session.process_index {
            for (inner, &id) in compute.devices().iter().zip(ids) {
                let own: Vec<Arc<Memory>> = inner
                    .memories
                    .iter()
                    .filter_map(|m| memories.iter().find(|(p, _)| *p == m.memory))
                    .map(|(_, m)| m.clone())
                    .collect();
                devices.push(Arc::new(Device::delegated(
                    id,
                    process.process_index,
                    inner.clone(),
                    own,
                    backend.clone(),
                )));
            }
        } else {
            for &id in ids {
                devices.push(Arc::new(Device::new(
                    id,
                    process.process_index,
                    -1,
                    false,
                    &process.device_kind,
                    backend.clone(),
                )));
            }
        }
    }
    devices.sort_by_key(|d| d.global_id);
    devices
}

impl Client {
    pub fn create(options: ClientOptions) -> Result<Arc<Client>> {
        Client::create_with_callbacks(options, None)
    }

    /// Creates the client; in a multi-process job this blocks until every
    /// process joined the session (bounded by `session_timeout`).
    pub fn create_with_callbacks(
        options: ClientOptions,
        callbacks: Option<Arc<dyn RawKvCallbacks>>,
    ) -> Result<Arc<Client>> {
        let compute = open_compute(&options)?;
        let backend = match &compute {
            // Receive destinations of a delegating client are host memory.
            Some(_) => Arc::new(backend::host::HostBackend::new(1)) as Arc<dyn Backend>,
            None => backend::select(options.backend, options.num_devices)?,
        };
        let local = match &compute {
            Some(compute) => LocalDevices {
                count: compute.devices().len(),
                ids: Some(delegated_ids(compute, &options)),
                kind: compute
                    .devices()
                    .first()
                    .map(|d| d.kind.clone())
                    .unwrap_or_default(),
            },
            None => LocalDevices::sequential(backend.device_count(), &backend.device_kind(0)),
        };
        let etcd = connect_etcd(&options)?;
        let metrics = Arc::new(Metrics::new());
        let framework_store = seal_if_asked(
            &options,
            choose_store(&options, callbacks, etcd.as_ref())?,
            &metrics,
        )?;
        let advertised = advertise::choose(&AddressHints {
            advertise_address: options.advertise_address.as_deref(),
            tcp_bind: options.tcp_bind,
            store_addresses: store_addresses(&options),
            multi_process: options.num_nodes > 1,
        })?;
        if options.num_nodes > 1 {
            // Every peer costs descriptors; the soft limit is the first wall.
            crate::transport::fd_limit::raise_once();
            log::info!(
                "process {} is reached at {} (chosen from {}; listening on {})",
                options.node_id,
                advertised.address,
                advertised.source,
                advertised.bind
            );
        }
        // Transfer keys go over control links between the processes unless
        // the caller asked for its own store (kv_store=callbacks/memory).
        let use_peer_store = options.num_nodes > 1 && options.store == StoreChoice::Default;
        let mut peer_store: Option<Arc<PeerStore>> = None;
        // Bound before the session entry is written, which states its
        // address: senders then send TCP bytes to nowhere else.
        let tcp_server = match (options.num_nodes > 1, options.transport) {
            (true, TransportChoice::Auto | TransportChoice::Tcp) => Some(TcpReceiveServer::bind(
                std::net::SocketAddr::new(advertised.bind, 0),
            )?),
            _ => None,
        };
        let tcp_data = tcp_server.as_ref().map(|server| {
            std::net::SocketAddr::new(advertised.address, server.local_addr().port())
        });
        let mut session = if options.num_nodes > 1 {
            Session::establish(
                &*framework_store,
                &options.session,
                options.node_id,
                options.num_nodes,
                local,
                options.transport.name(),
                options.session_timeout,
                |_epoch, secret| {
                    if !use_peer_store {
                        return Ok(Reachable {
                            control: None,
                            tcp_data,
                        });
                    }
                    let store = PeerStore::start(
                        options.node_id as u32,
                        secret,
                        &advertised,
                        options.send_timeout.min(CONTROL_TIMEOUT),
                        options.peer_connections.clone(),
                    )?;
                    let endpoint = store.endpoint().clone();
                    peer_store = Some(store);
                    Ok(Reachable {
                        control: Some(endpoint),
                        tcp_data,
                    })
                },
            )?
        } else {
            Session::local(local, options.transport.name())?
        };
        // A UCX with CUDA transports is preferred for a client with CUDA
        // devices (transport/ucx/library.rs).
        let cuda_client = backend.name() == "cuda";
        let ucx = start_ucx(&options, &mut session, &*framework_store, cuda_client)?;
        if let Some(etcd) = &etcd {
            track_etcd_peers(etcd, &session, &options.session);
        }
        let store: Arc<dyn KeyValueStore> = match &peer_store {
            Some(peer) => {
                connect_peers(peer, &session, options.transport == TransportChoice::Tcp)?;
                peer.clone()
            }
            None => framework_store,
        };
        let process_index = session.process_index;
        let devices = match &compute {
            Some(compute) => delegated_devices(compute, &session, &backend),
            None => embedded_devices(&session, &backend),
        };
        let transfers = TransferService::new(
            store,
            session,
            TransferConfig {
                receive_timeout: options.receive_timeout,
                send_timeout: options.send_timeout,
                transport: options.transport,
                advertised,
                shm_pool_bytes: options.shm_pool_bytes,
                max_receive_bytes: options
                    .max_receive_bytes
                    .unwrap_or_else(default_max_receive_bytes),
                max_pending_send_bytes: options
                    .max_pending_send_bytes
                    .unwrap_or_else(default_max_pending_send_bytes),
                completion_keys_local: peer_store.is_some(),
                // A CUDA client's rings are pinned: its buffers cross nodes
                // through them (transport/staging/).
                staging: crate::transport::staging::StagingConfig {
                    pinned: cuda_client,
                    ..options.staging.clone()
                },
                metrics: Some(metrics),
                ..TransferConfig::default()
            },
            ucx,
            tcp_server,
        );
        if let Some(peer) = &peer_store {
            // A receipt that comes with the bytes sets the key here, in the
            // peer store's local part, as a sender's SET over the link would.
            let peer = Arc::downgrade(peer);
            transfers.set_receipt_sink(Arc::new(move |key: &str, value: &[u8]| {
                match peer.upgrade() {
                    Some(peer) => peer.set_held_here(key, value),
                    None => Err(crate::status::unavailable("the client is being destroyed")),
                }
            }));
        }
        if let Some(peer) = &peer_store {
            // A peer whose link closed is gone: its receives fail now, and
            // the sends waiting for its descriptors.
            let service = Arc::downgrade(&transfers);
            peer.on_peer_lost(Box::new(move |process| {
                if let Some(service) = service.upgrade() {
                    let (receives, sends) = service.peer_lost(process as i32);
                    log::debug!("process {process} lost: {receives} receives, {sends} sends failed");
                    if receives + sends > 0 {
                        log::warn!(
                            "process {process} is gone; failed {receives} receives and {sends} sends"
                        );
                    }
                }
            }));
            let probe = Arc::downgrade(peer);
            transfers.set_liveness(Box::new(move |process| match probe.upgrade() {
                Some(peer) => peer.probe(process as u32),
                None => Err(crate::status::unavailable("the client is being destroyed")),
            }));
            // No link is made now: each is made by the first transfer that
            // needs it, and the links to the peers a transfer waits on stay
            // open while it waits, so that their death is noticed.
            let watch = Arc::downgrade(peer);
            transfers.set_watch(Box::new(move |process| {
                if let (Some(peer), Ok(process)) = (watch.upgrade(), u32::try_from(process)) {
                    peer.watch(process);
                }
            }));
            let service = Arc::downgrade(&transfers);
            peer.set_waited_on(Box::new(move |process| {
                service
                    .upgrade()
                    .is_some_and(|s| i32::try_from(process).is_ok_and(|p| s.waits_on(p)))
            }));
        }
        let platform_version = match &compute {
            Some(compute) => format!(
                "pjrt-crosshost {} (compute: {} {})",
                env!("CARGO_PKG_VERSION"),
                compute.platform_name(),
                compute.platform_version()
            ),
            None => format!(
                "pjrt-crosshost {} ({} backend)",
                env!("CARGO_PKG_VERSION"),
                backend.name()
            ),
        };
        Ok(Arc::new(Client {
            options,
            process_index,
            devices,
            transfers,
            platform_version,
            backend,
            compute,
        }))
    }

    /// The compute plugin's client, when this client delegates compute.
    pub fn compute(&self) -> Option<&Arc<ComputeClient>> {
        self.compute.as_ref()
    }

    /// Our addressable device behind a compute plugin's device.
    pub fn device_of_compute(&self, inner: InnerPtr) -> Option<&Arc<Device>> {
        self.devices
            .iter()
            .find(|d| d.compute.as_ref().is_some_and(|c| c.device == inner))
    }

    /// `(our global id, the compute plugin's id)` of each addressable
    /// device of a delegating client (equal unless the plugin numbers its
    /// devices from 0 in every process).
    pub fn compute_device_ids(&self) -> Vec<(i32, i32)> {
        self.devices
            .iter()
            .filter_map(|d| d.compute.as_ref().map(|c| (d.global_id, c.id)))
            .collect()
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn transfers(&self) -> &Arc<TransferService> {
        &self.transfers
    }

    pub fn options(&self) -> &ClientOptions {
        &self.options
    }

    pub fn process_index(&self) -> i32 {
        self.process_index
    }

    pub fn platform_version(&self) -> &str {
        &self.platform_version
    }

    pub fn devices(&self) -> &[Arc<Device>] {
        &self.devices
    }

    pub fn addressable_devices(&self) -> impl Iterator<Item = &Arc<Device>> {
        self.devices.iter().filter(|d| d.addressable)
    }

    pub fn device_by_global_id(&self, id: i32, context: &str) -> Result<&Arc<Device>> {
        self.devices
            .iter()
            .find(|d| d.global_id == id)
            .ok_or_else(|| invalid_argument(format!("{context}: no device with global id {id}")))
    }

    pub fn addressable_device_by_local_id(&self, id: i32, context: &str) -> Result<&Arc<Device>> {
        self.addressable_devices()
            .find(|d| d.local_hardware_id == id)
            .ok_or_else(|| {
                invalid_argument(format!(
                    "{context}: no addressable device with local hardware id {id}"
                ))
            })
    }

    fn require_addressable(device: &Device, context: &str) -> Result<()> {
        if device.addressable {
            Ok(())
        } else {
            Err(invalid_argument(format!(
                "{context}: device {} belongs to process {} and is not addressable here",
                device.global_id, device.process_index
            )))
        }
    }

    pub fn allocate(&self, device: &Device, bytes: usize, context: &str) -> Result<Allocation> {
        Self::require_addressable(device, context)?;
        self.backend.allocate(
            device.local_hardware_id as usize,
            bytes,
            device.counters.clone(),
        )
    }

    /// Copies a host array onto `device`. The data is copied before return,
    /// so the host buffer is free as soon as this returns.
    pub fn buffer_from_host(
        &self,
        host: &HostArray<'_>,
        shape: Shape,
        device: &Arc<Device>,
        context: &str,
    ) -> Result<Arc<Buffer>> {
        let data = self.allocate(device, shape.byte_size(), context)?;
        match host.contiguous(&shape, context)? {
            // Row-major input is copied once, straight into device memory.
            Some(bytes) => data.write(0, bytes)?,
            None => data.write(0, &host.to_dense(&shape, context)?)?,
        }
        Ok(Buffer::new(
            shape,
            device.clone(),
            data,
            Future::ready(Ok(())),
        ))
    }

    /// Copies `src` to `device`, after `src` is defined. The new buffer's
    /// definition event carries the copy's outcome.
    pub fn copy_buffer(
        &self,
        src: &Buffer,
        device: &Arc<Device>,
        context: &str,
    ) -> Result<Arc<Buffer>> {
        if Arc::ptr_eq(src.device(), device) {
            return Err(invalid_argument(format!(
                "{context}: the buffer is already on device {} (its memory)",
                device.global_id
            )));
        }
        let dst = self.allocate(device, src.byte_size(), context)?;
        let target = dst.clone();
        let backend = self.backend.clone();
        let definition =
            src.when_defined(context, move |source| backend.copy(&**source, &*target))?;
        Ok(Buffer::new(
            src.shape().clone(),
            device.clone(),
            dst,
            definition,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::element_type::ElementType;

    #[test]
    fn copy_buffer_moves_bytes_to_the_other_device() {
        let client = Client::create(ClientOptions::default()).unwrap();
        let shape = Shape::new(ElementType::F32, vec![2], "t").unwrap();
        let bytes = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let host = HostArray {
            bytes: &bytes,
            origin: 0,
            byte_strides: None,
        };
        let d0 = client.devices()[0].clone();
        let d1 = client.devices()[1].clone();
        let b0 = client.buffer_from_host(&host, shape, &d0, "t").unwrap();
        let b1 = client.copy_buffer(&b0, &d1, "t").unwrap();
        b1.definition().wait().unwrap();
        let mut out = [0u8; 8];
        b1.allocation("t").unwrap().read(0, &mut out).unwrap();
        assert_eq!(out, bytes);
        assert_eq!(b1.device().global_id, 1);
        b0.delete();
        assert!(b0.allocation("t").is_err());
        assert!(client.copy_buffer(&b0, &d1, "t").is_err());
    }
}
