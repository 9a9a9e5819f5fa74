//! `PJRT_Client_Create` options, parsed and validated.
use std::net::IpAddr;
use std::time::Duration;

use crate::backend::BackendChoice;
use crate::kv::etcd::access::EtcdAccess;
use crate::kv::etcd::endpoints as etcd_endpoints;
use crate::status::{invalid_argument, Result};
pub use crate::transfer::route::TransportChoice;

#[derive(Clone, Debug, PartialEq)]
pub enum OptionValue {
    Str(String),
    Int(i64),
    IntList(Vec<i64>),
    Float(f32),
    Bool(bool),
}

impl OptionValue {
    pub fn type_name(&self) -> &'static str {
        match self {
            OptionValue::Str(_) => "string",
            OptionValue::Int(_) => "int64",
            OptionValue::IntList(_) => "int64 list",
            OptionValue::Float(_) => "float",
            OptionValue::Bool(_) => "bool",
        }
    }
}

pub const MAX_DEVICES: i64 = 64;

/// Whether a client delegates compute to another PJRT plugin.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum ComputeChoice {
    /// The process's configured compute plugin (the Python package's
    /// configuration or `PJRT_CROSSHOST_COMPUTE_PLUGIN`), if any.
    #[default]
    Configured,
    /// `compute_plugin=<path>`.
    Path(String),
    /// `compute_plugin=""`: no compute plugin, whatever the process
    /// configured (the embedded backend).
    Off,
}

/// Prefix of create options that go to the compute plugin's client.
pub const COMPUTE_OPTION_PREFIX: &str = "compute.";

/// Where the client's key-value store comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreChoice {
    /// Single process: a private in-memory store. Multi-process: the KV
    /// callbacks the creator passed for the session, and the peer store
    /// (control links between the processes, `kv/peer.rs`) for the transfer
    /// keys.
    Default,
    /// `kv_store=callbacks`: the creator's KV callbacks for everything, the
    /// transfer keys included.
    Callbacks,
    /// `kv_store=memory:<name>`: an in-memory store shared by name inside
    /// this process (several clients, one store).
    NamedMemory(String),
    /// `kv_store=etcd://host:port[,...]` (or `etcds://` for TLS): an etcd
    /// cluster for everything (session and transfer keys), these gRPC
    /// endpoints (`http://` or `https://`).
    Etcd(Vec<String>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct ClientOptions {
    /// Addressable devices of this process (host backend; the CUDA backend
    /// has the devices the driver shows).
    pub num_devices: usize,
    /// `backend=auto|host|cuda` (default host).
    pub backend: BackendChoice,
    pub node_id: i32,
    pub num_nodes: usize,
    /// Name of the job's session in the store (all processes use the same).
    pub session: String,
    pub store: StoreChoice,
    /// `transport=auto|tcp|ucx`.
    pub transport: TransportChoice,
    /// `advertise_address`: the address (or host name) the job's other
    /// processes reach this one at; `None`: chosen (transport/advertise.rs).
    pub advertise_address: Option<String>,
    /// `tcp_bind`: the address this process's listeners bind to; `None`: the
    /// advertised address. A wildcard (`0.0.0.0`, `::`) listens everywhere.
    pub tcp_bind: Option<IpAddr>,
    /// `coordinator_address`: `host:port` of the job's store (JAX's
    /// coordination service; the Python package passes it), whose route
    /// names the local address to advertise.
    pub coordinator_address: Option<String>,
    /// `ucx_library`: the libucp to load (else the environment, the libucx
    /// wheel, the system's).
    pub ucx_library: Option<String>,
    /// `job_secret_file`: a file of at least 32 random bytes, the same for
    /// every process of the job; with it every value in a shared store is
    /// sealed (kv/sealed.rs).
    pub job_secret_file: Option<std::path::PathBuf>,
    pub receive_timeout: Duration,
    pub send_timeout: Duration,
    /// How long client creation waits for the other processes.
    pub session_timeout: Duration,
    /// Bound on one KV callback call (put, try_get, delete) of the
    /// callback store; a blocking get is bounded by its own timeout.
    pub kv_call_timeout: Duration,
    /// TTL of the etcd store's lease (`etcd_lease_ttl_s`): how long a dead
    /// process's keys outlive it, and how soon its peers learn of it.
    pub etcd_lease_ttl: Duration,
    /// TLS, RBAC credentials and key prefix for etcd (`etcd_*`).
    pub etcd_access: EtcdAccess,
    /// Bound on the bytes received host buffers hold at once (None: half
    /// the memory this process may use, its cgroup's limit included).
    pub max_receive_bytes: Option<u64>,
    /// Bound on the bytes of sends not yet delivered (None: a quarter of
    /// the memory this process may use).
    pub max_pending_send_bytes: Option<u64>,
    /// Upper bound of the receive-side pool of pre-faulted shared memory.
    pub shm_pool_bytes: usize,
    /// `staging_chunk_bytes`, `staging_ring_depth`,
    /// `stage_host_transfers` and `max_pinned_bytes` (transport/staging/).
    pub staging: crate::transport::staging::StagingConfig,
    /// `max_peer_connections` and `peer_idle_timeout_ms`: the connections
    /// this process keeps toward its peers, made on first use
    /// (transport/connections/).
    pub peer_connections: crate::transport::connections::ConnectionLimits,
    /// `compute_plugin`: the PJRT plugin that compiles and runs programs
    /// for this client (docs/DESIGN.md §11).
    pub compute: ComputeChoice,
    /// `compute.<name>` options, passed to the compute plugin's client
    /// with the prefix removed.
    pub compute_options: Vec<(String, OptionValue)>,
    /// Whether `backend` was given explicitly (it conflicts with a compute
    /// plugin, which brings its own devices).
    pub backend_given: bool,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            num_devices: 2,
            backend: BackendChoice::default(),
            node_id: 0,
            num_nodes: 1,
            session: "default".into(),
            store: StoreChoice::Default,
            transport: TransportChoice::default(),
            advertise_address: None,
            tcp_bind: None,
            coordinator_address: None,
            ucx_library: None,
            job_secret_file: None,
            receive_timeout: Duration::from_secs(300),
            send_timeout: Duration::from_secs(300),
            session_timeout: Duration::from_secs(120),
            kv_call_timeout: Duration::from_secs(30),
            etcd_lease_ttl: Duration::from_secs(10),
            etcd_access: EtcdAccess::default(),
            max_receive_bytes: None,
            max_pending_send_bytes: None,
            shm_pool_bytes: 1 << 30,
            staging: Default::default(),
            peer_connections: Default::default(),
            compute: ComputeChoice::default(),
            compute_options: Vec::new(),
            backend_given: false,
        }
    }
}

const CONTEXT: &str = "PJRT_Client_Create";
const KNOWN: &str = "num_devices, backend, node_id, num_nodes, session, kv_store, transport, \
                     advertise_address, tcp_bind, coordinator_address, ucx_library, job_secret_file, receive_timeout_ms, send_timeout_ms, session_timeout_ms, kv_call_timeout_ms, etcd_lease_ttl_s, etcd_ca_file, etcd_cert_file, etcd_key_file, etcd_user, etcd_password_file, etcd_key_prefix, shm_pool_bytes, staging_chunk_bytes, staging_ring_depth, stage_host_transfers, max_pinned_bytes, max_receive_bytes, max_pending_send_bytes, max_peer_connections, peer_idle_timeout_ms, \
                     compute_plugin, compute.<option of the compute plugin>";

fn expect_int(name: &str, value: &OptionValue) -> Result<i64> {
    match value {
        OptionValue::Int(v) => Ok(*v),
        other => Err(invalid_argument(format!(
            "{CONTEXT}: create option '{name}' must be int64, got {}",
            other.type_name()
        ))),
    }
}

fn expect_str<'a>(name: &str, value: &'a OptionValue) -> Result<&'a str> {
    match value {
        OptionValue::Str(v) => Ok(v),
        other => Err(invalid_argument(format!(
            "{CONTEXT}: create option '{name}' must be a string, got {}",
            other.type_name()
        ))),
    }
}

/// A host name or address: printable ASCII, no spaces, not empty.
fn expect_host<'a>(name: &str, value: &'a OptionValue) -> Result<&'a str> {
    let s = expect_str(name, value)?;
    if s.is_empty() || s.len() > 255 || !s.chars().all(|c| c.is_ascii_graphic()) {
        return Err(invalid_argument(format!(
            "{CONTEXT}: create option '{name}' must be a host name or IP address, got {s:?}"
        )));
    }
    Ok(s)
}

/// A file's path; empty means not given.
fn expect_path(name: &str, value: &OptionValue) -> Result<Option<std::path::PathBuf>> {
    let s = expect_str(name, value)?;
    Ok((!s.is_empty()).then(|| s.into()))
}

fn expect_range(name: &str, value: &OptionValue, low: i64, high: i64) -> Result<i64> {
    let v = expect_int(name, value)?;
    if (low..=high).contains(&v) {
        Ok(v)
    } else {
        Err(invalid_argument(format!(
            "{CONTEXT}: create option '{name}' must be in {low}..={high}, got {v}"
        )))
    }
}

fn expect_millis(name: &str, value: &OptionValue) -> Result<Duration> {
    Ok(Duration::from_millis(
        expect_range(name, value, 1, 7 * 24 * 3600 * 1000)? as u64,
    ))
}

impl ClientOptions {
    pub fn parse(options: &[(String, OptionValue)]) -> Result<ClientOptions> {
        let mut parsed = ClientOptions::default();
        let mut unknown = Vec::new();
        for (name, value) in options {
            match name.as_str() {
                "num_devices" => {
                    parsed.num_devices = expect_range(name, value, 1, MAX_DEVICES)? as usize
                }
                "backend" => {
                    parsed.backend_given = true;
                    let s = expect_str(name, value)?;
                    parsed.backend = BackendChoice::parse(s).ok_or_else(|| {
                        invalid_argument(format!(
                            "{CONTEXT}: create option 'backend' must be 'auto', 'host' or 'cuda', got {s:?}"
                        ))
                    })?;
                }
                "node_id" => parsed.node_id = expect_range(name, value, 0, 1 << 20)? as i32,
                "num_nodes" => parsed.num_nodes = expect_range(name, value, 1, 1 << 20)? as usize,
                "session" => {
                    let s = expect_str(name, value)?;
                    if s.is_empty() || s.contains('/') || s.chars().any(|c| !c.is_ascii_graphic()) {
                        return Err(invalid_argument(format!(
                            "{CONTEXT}: create option 'session' must be printable ASCII without '/', got {s:?}"
                        )));
                    }
                    parsed.session = s.to_string();
                }
                "kv_store" => {
                    let s = expect_str(name, value)?;
                    parsed.store = match s.strip_prefix("memory:") {
                        Some(n) if !n.is_empty() => StoreChoice::NamedMemory(n.to_string()),
                        _ if s == "default" => StoreChoice::Default,
                        _ if s == "callbacks" => StoreChoice::Callbacks,
                        _ if etcd_endpoints::names_etcd(s) => {
                            StoreChoice::Etcd(etcd_endpoints::parse(s).map_err(|e| {
                                invalid_argument(format!("{CONTEXT}: {}", e.message))
                            })?)
                        }
                        _ => {
                            return Err(invalid_argument(format!(
                            "{CONTEXT}: create option 'kv_store' must be 'default', 'callbacks', \
                                 'memory:<name>', 'etcd://host:port[,host:port...]' or \
                                 'etcds://host:port[,host:port...]', got {s:?}"
                        )))
                        }
                    };
                }
                "transport" => {
                    let s = expect_str(name, value)?;
                    parsed.transport = TransportChoice::parse(s).ok_or_else(|| {
                        invalid_argument(format!(
                            "{CONTEXT}: create option 'transport' must be 'auto', 'tcp' or 'ucx', got {s:?}"
                        ))
                    })?;
                }
                "tcp_bind" => {
                    let s = expect_str(name, value)?;
                    parsed.tcp_bind = Some(s.parse().map_err(|_| {
                        invalid_argument(format!(
                            "{CONTEXT}: create option 'tcp_bind' must be an IP address, got {s:?}"
                        ))
                    })?);
                }
                "advertise_address" => {
                    parsed.advertise_address = Some(expect_host(name, value)?.to_string())
                }
                "coordinator_address" => {
                    let s = expect_host(name, value)?;
                    if !s.contains(':') {
                        return Err(invalid_argument(format!(
                            "{CONTEXT}: create option 'coordinator_address' must be host:port, got {s:?}"
                        )));
                    }
                    parsed.coordinator_address = Some(s.to_string())
                }
                "ucx_library" => {
                    let s = expect_str(name, value)?;
                    parsed.ucx_library = (!s.is_empty()).then(|| s.to_string());
                }
                "job_secret_file" => parsed.job_secret_file = expect_path(name, value)?,
                "receive_timeout_ms" => parsed.receive_timeout = expect_millis(name, value)?,
                "send_timeout_ms" => parsed.send_timeout = expect_millis(name, value)?,
                "session_timeout_ms" => parsed.session_timeout = expect_millis(name, value)?,
                "kv_call_timeout_ms" => parsed.kv_call_timeout = expect_millis(name, value)?,
                "etcd_lease_ttl_s" => {
                    parsed.etcd_lease_ttl =
                        Duration::from_secs(expect_range(name, value, 1, 86_400)? as u64)
                }
                "etcd_ca_file" => parsed.etcd_access.ca_file = expect_path(name, value)?,
                "etcd_cert_file" => parsed.etcd_access.cert_file = expect_path(name, value)?,
                "etcd_key_file" => parsed.etcd_access.key_file = expect_path(name, value)?,
                "etcd_password_file" => {
                    parsed.etcd_access.password_file = expect_path(name, value)?
                }
                "etcd_user" => parsed.etcd_access.user = Some(expect_str(name, value)?.to_string()),
                "etcd_key_prefix" => {
                    parsed.etcd_access.key_prefix = expect_str(name, value)?.to_string()
                }
                "max_peer_connections" => {
                    parsed.peer_connections.max_open =
                        expect_range(name, value, 1, 1 << 20)? as usize
                }
                "peer_idle_timeout_ms" => {
                    parsed.peer_connections.idle_timeout = expect_millis(name, value)?
                }
                "max_receive_bytes" => {
                    parsed.max_receive_bytes = Some(expect_range(name, value, 1, 1 << 50)? as u64)
                }
                "max_pending_send_bytes" => {
                    parsed.max_pending_send_bytes =
                        Some(expect_range(name, value, 1, 1 << 50)? as u64)
                }
                "shm_pool_bytes" => {
                    parsed.shm_pool_bytes = expect_range(name, value, 0, 1 << 40)? as usize
                }
                "staging_chunk_bytes" => {
                    parsed.staging.chunk_bytes = expect_range(name, value, 4096, 1 << 30)? as usize
                }
                "staging_ring_depth" => {
                    parsed.staging.ring_depth = expect_range(name, value, 1, 1024)? as usize
                }
                "max_pinned_bytes" => {
                    parsed.staging.max_pinned_bytes =
                        expect_range(name, value, 4096, 1 << 40)? as usize
                }
                "stage_host_transfers" => {
                    parsed.staging.stage_host_transfers = match value {
                        OptionValue::Bool(b) => *b,
                        _ => expect_range(name, value, 0, 1)? == 1,
                    }
                }
                "compute_plugin" => {
                    let s = expect_str(name, value)?;
                    parsed.compute = if s.is_empty() {
                        ComputeChoice::Off
                    } else {
                        ComputeChoice::Path(s.to_string())
                    };
                }
                _ => match name.strip_prefix(COMPUTE_OPTION_PREFIX) {
                    Some(inner) if !inner.is_empty() => parsed
                        .compute_options
                        .push((inner.to_string(), value.clone())),
                    _ => unknown.push(name.clone()),
                },
            }
        }
        if !unknown.is_empty() {
            return Err(invalid_argument(format!(
                "{CONTEXT}: unknown create option(s) {unknown:?}; known: {KNOWN}"
            )));
        }
        match &parsed.store {
            StoreChoice::Etcd(endpoints) => parsed.etcd_access.check(endpoints)?,
            _ if parsed.etcd_access.any_given() => {
                return Err(invalid_argument(format!(
                    "{CONTEXT}: the etcd_* create options need kv_store=etcd://... or \
                     kv_store=etcds://..."
                )))
            }
            _ => {}
        }
        if parsed.staging.max_pinned_bytes < parsed.staging.chunk_bytes {
            return Err(invalid_argument(format!(
                "{CONTEXT}: max_pinned_bytes ({}) must hold at least one staging chunk \
                 (staging_chunk_bytes = {})",
                parsed.staging.max_pinned_bytes, parsed.staging.chunk_bytes
            )));
        }
        if parsed.node_id as usize >= parsed.num_nodes {
            return Err(invalid_argument(format!(
                "{CONTEXT}: node_id {} must be below num_nodes {}",
                parsed.node_id, parsed.num_nodes
            )));
        }
        Ok(parsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_options_are_named_in_the_error() {
        let err = ClientOptions::parse(&[("bogus".into(), OptionValue::Int(1))]).unwrap_err();
        assert!(err.message.contains("bogus"), "{}", err.message);
    }

    #[test]
    fn max_pinned_bytes_bounds_the_pinned_staging_and_holds_at_least_one_chunk() {
        let defaults = ClientOptions::default().staging;
        assert_eq!(defaults.max_pinned_bytes, 128 << 20);
        assert!(!defaults.pinned, "only a CUDA client's rings are pinned");
        let o = ClientOptions::parse(&[
            ("max_pinned_bytes".into(), OptionValue::Int(64 << 20)),
            ("staging_chunk_bytes".into(), OptionValue::Int(1 << 20)),
        ])
        .unwrap();
        assert_eq!(o.staging.max_pinned_bytes, 64 << 20);
        let too_small = ClientOptions::parse(&[
            ("max_pinned_bytes".into(), OptionValue::Int(1 << 20)),
            ("staging_chunk_bytes".into(), OptionValue::Int(2 << 20)),
        ])
        .unwrap_err();
        assert!(
            too_small.message.contains("max_pinned_bytes")
                && too_small.message.contains("staging_chunk_bytes"),
            "{too_small}"
        );
        assert!(ClientOptions::parse(&[("max_pinned_bytes".into(), OptionValue::Int(0))]).is_err());
    }

    #[test]
    fn num_devices_is_range_and_type_checked() {
        let ok = ClientOptions::parse(&[("num_devices".into(), OptionValue::Int(4))]).unwrap();
        assert_eq!(ok.num_devices, 4);
        assert!(ClientOptions::parse(&[("num_devices".into(), OptionValue::Int(0))]).is_err());
        assert!(
            ClientOptions::parse(&[("num_devices".into(), OptionValue::Str("2".into()))]).is_err()
        );
    }

    #[test]
    fn store_transport_and_topology_options_parse() {
        let o = ClientOptions::parse(&[
            ("kv_store".into(), OptionValue::Str("memory:job1".into())),
            ("transport".into(), OptionValue::Str("tcp".into())),
            ("node_id".into(), OptionValue::Int(1)),
            ("num_nodes".into(), OptionValue::Int(2)),
            ("receive_timeout_ms".into(), OptionValue::Int(250)),
        ])
        .unwrap();
        assert_eq!(o.store, StoreChoice::NamedMemory("job1".into()));
        assert_eq!(o.transport, TransportChoice::Tcp);
        assert_eq!(o.receive_timeout, Duration::from_millis(250));
        assert!(ClientOptions::parse(&[("node_id".into(), OptionValue::Int(1))]).is_err());
        assert!(
            ClientOptions::parse(&[("kv_store".into(), OptionValue::Str("etcd".into()))]).is_err()
        );
    }

    #[test]
    fn transport_and_address_options_parse_and_bad_ones_name_themselves() {
        let o = ClientOptions::parse(&[
            ("transport".into(), OptionValue::Str("ucx".into())),
            (
                "advertise_address".into(),
                OptionValue::Str("host-b".into()),
            ),
            ("tcp_bind".into(), OptionValue::Str("::".into())),
            (
                "coordinator_address".into(),
                OptionValue::Str("10.0.0.1:1234".into()),
            ),
            (
                "ucx_library".into(),
                OptionValue::Str("/opt/ucx/libucp.so".into()),
            ),
        ])
        .unwrap();
        assert_eq!(o.transport, TransportChoice::Ucx);
        assert_eq!(o.advertise_address.as_deref(), Some("host-b"));
        assert_eq!(o.tcp_bind, Some("::".parse().unwrap()));
        assert_eq!(o.coordinator_address.as_deref(), Some("10.0.0.1:1234"));
        assert_eq!(o.ucx_library.as_deref(), Some("/opt/ucx/libucp.so"));
        let defaults = ClientOptions::default();
        assert_eq!(defaults.transport, TransportChoice::Auto);
        assert_eq!(
            (defaults.advertise_address, defaults.tcp_bind),
            (None, None)
        );
        for (name, bad) in [
            ("transport", "rdma"),
            ("advertise_address", "a b"),
            ("advertise_address", ""),
            ("coordinator_address", "no-port"),
            ("tcp_bind", "host-b"),
        ] {
            let e =
                ClientOptions::parse(&[(name.into(), OptionValue::Str(bad.into()))]).unwrap_err();
            assert!(e.message.contains(name), "{name}={bad:?}: {e}");
        }
    }

    #[test]
    fn etcd_access_options_need_an_etcd_store_and_tls_needs_a_ca() {
        let str_opt = |n: &str, v: &str| (n.to_string(), OptionValue::Str(v.into()));
        let o = ClientOptions::parse(&[
            str_opt("kv_store", "etcds://etcd-a:2379"),
            str_opt("etcd_ca_file", "/etc/ca.pem"),
            str_opt("etcd_user", "job"),
            str_opt("etcd_password_file", "/run/pw"),
            str_opt("etcd_key_prefix", "jobs/a/"),
        ])
        .unwrap();
        assert_eq!(
            o.store,
            StoreChoice::Etcd(vec!["https://etcd-a:2379".into()])
        );
        assert_eq!(o.etcd_access.user.as_deref(), Some("job"));
        assert_eq!(o.etcd_access.key_prefix, "jobs/a/");
        let e = ClientOptions::parse(&[str_opt("etcd_user", "job")]).unwrap_err();
        assert!(e.message.contains("need kv_store=etcd"), "{e}");
        let e = ClientOptions::parse(&[str_opt("kv_store", "etcds://a:1")]).unwrap_err();
        assert!(e.message.contains("etcd_ca_file"), "{e}");
    }

    #[test]
    fn an_etcd_store_names_its_members_and_lease_ttl() {
        let o = ClientOptions::parse(&[
            (
                "kv_store".into(),
                OptionValue::Str("etcd://10.0.0.1:2379,etcd-b:2380".into()),
            ),
            ("etcd_lease_ttl_s".into(), OptionValue::Int(3)),
        ])
        .unwrap();
        assert_eq!(
            o.store,
            StoreChoice::Etcd(vec![
                "http://10.0.0.1:2379".into(),
                "http://etcd-b:2380".into()
            ])
        );
        assert_eq!(o.etcd_lease_ttl, Duration::from_secs(3));
        let e = ClientOptions::parse(&[("kv_store".into(), OptionValue::Str("etcd://h".into()))])
            .unwrap_err();
        assert!(
            e.message.contains("PJRT_Client_Create") && e.message.contains("no :port"),
            "{e}"
        );
        assert!(ClientOptions::parse(&[("etcd_lease_ttl_s".into(), OptionValue::Int(0))]).is_err());
    }

    #[test]
    fn compute_plugin_and_prefixed_options_parse() {
        let o = ClientOptions::parse(&[
            (
                "compute_plugin".into(),
                OptionValue::Str("/x/libpjrt_cpu.so".into()),
            ),
            ("compute.asynchronous".into(), OptionValue::Bool(false)),
            ("compute.cpu_device_count".into(), OptionValue::Int(3)),
        ])
        .unwrap();
        assert_eq!(o.compute, ComputeChoice::Path("/x/libpjrt_cpu.so".into()));
        assert_eq!(
            o.compute_options,
            vec![
                ("asynchronous".to_string(), OptionValue::Bool(false)),
                ("cpu_device_count".to_string(), OptionValue::Int(3)),
            ]
        );
        let off = ClientOptions::parse(&[("compute_plugin".into(), OptionValue::Str("".into()))])
            .unwrap();
        assert_eq!(off.compute, ComputeChoice::Off);
        assert_eq!(ClientOptions::default().compute, ComputeChoice::Configured);
        let err = ClientOptions::parse(&[("compute.".into(), OptionValue::Int(1))]).unwrap_err();
        assert!(err.message.contains("compute."), "{}", err.message);
        assert!(ClientOptions::parse(&[("compute_plugin".into(), OptionValue::Int(1))]).is_err());
    }

    #[test]
    fn backend_option_parses_and_defaults_to_host() {
        assert_eq!(ClientOptions::default().backend, BackendChoice::Host);
        for (text, choice) in [
            ("auto", BackendChoice::Auto),
            ("host", BackendChoice::Host),
            ("cuda", BackendChoice::Cuda),
        ] {
            let o =
                ClientOptions::parse(&[("backend".into(), OptionValue::Str(text.into()))]).unwrap();
            assert_eq!(o.backend, choice);
        }
        let err = ClientOptions::parse(&[("backend".into(), OptionValue::Str("rocm".into()))])
            .unwrap_err();
        assert!(err.message.contains("backend"), "{}", err.message);
        assert!(ClientOptions::parse(&[("backend".into(), OptionValue::Int(1))]).is_err());
    }
}
