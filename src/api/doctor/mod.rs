//! The doctor: what this process would use for a job, and whether the
//! job's peers answer. It runs the library's own code for each step (the
//! options' parser, the compute plugin's loader, the libucp choice and a
//! UCP context, the advertised address's choice, client creation, control
//! links) and says, for each problem it meets, the option to change.
//! `crosshost-doctor` (src/bin/) and `python -m jax_plugins.crosshost
//! doctor` (through `pjrt_crosshost_doctor_json`) print its report.
//!
//! Given a job (`num_nodes` > 1 and a store: `coordinator=host:port`, where
//! process 0 serves the doctor's own store as JAX's coordinator does, or
//! `kv_store=etcd://...`), every process of the job runs the doctor: they
//! form a job as a client would (session `crosshost-doctor` unless told
//! otherwise), each opens a control link to every peer and times round
//! trips on it, and connects to each peer's TCP data port; then each
//! publishes what it saw, so that a process also hears which peers could
//! not reach it. Every process stays until all have published.
mod rendezvous;
mod report;

use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use rendezvous::{RendezvousClient, RendezvousServer};
pub use report::{quote, Fact, Problem, Report, Section};

use super::client::{store_addresses, Client};
use super::options::{ClientOptions, ComputeChoice, OptionValue, StoreChoice, TransportChoice};
use crate::backend::{self, BackendChoice};
use crate::compute_plugin;
use crate::kv::callback::RawKvCallbacks;
use crate::status::{Result, Status};
use crate::transfer::route::{UcxLanes, TCP_BATCH_MIN_BYTES, TCP_BATCH_MIN_COUNT};
use crate::transfer::session::Session;
use crate::transport::advertise::{self, AddressHints};
use crate::transport::connections::Connection;
use crate::transport::control::ControlLink;
use crate::transport::host_identity::HostIdentity;
use crate::transport::ucx;

/// The session the doctor's job uses unless `session` is given, so that it
/// never joins a real job's session in a shared store.
pub const DOCTOR_SESSION: &str = "crosshost-doctor";
/// Round trips timed on each control link and UCX endpoint.
const PINGS: usize = 5;
/// What to change when a peer's UCX endpoint does not answer (UCX picks its
/// own interfaces from the worker addresses).
const UCX_CHANGE: &str = "UCX_NET_DEVICES=<the interface the hosts share, e.g. eth0> on every \
     process (UCX's own setting), or transport=tcp to leave UCX out";

/// What the doctor is asked: create options, and its own.
#[derive(Clone, Debug, Default)]
pub struct Request {
    pub options: Vec<(String, OptionValue)>,
    /// `doctor.coordinator=host:port`: the job's store is served there by
    /// process 0 (`rendezvous.rs`); also the route hint for the address.
    pub coordinator: Option<String>,
    /// `doctor.timeout_ms`: bound on each peer check and on the wait for the
    /// others' reports.
    pub timeout: Duration,
}

impl Request {
    /// `key=value` lines (or `,`-separated pairs): create options (values
    /// that read as integers pass as int64, `true`/`false` as bools), plus
    /// `doctor.coordinator` and `doctor.timeout_ms`.
    pub fn parse(text: &str) -> std::result::Result<Request, String> {
        let mut request = Request {
            timeout: Duration::from_secs(10),
            ..Request::default()
        };
        for item in text.split(['\n', ',']) {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| format!("expected key=value, got {item:?}"))?;
            let (key, value) = (key.trim(), value.trim());
            match key {
                "doctor.coordinator" => request.coordinator = Some(value.to_string()),
                "doctor.timeout_ms" => {
                    let ms: u64 = value.parse().map_err(|_| {
                        format!("doctor.timeout_ms must be an integer, got {value:?}")
                    })?;
                    request.timeout = Duration::from_millis(ms);
                }
                _ => request.options.push((key.to_string(), coerce(value))),
            }
        }
        Ok(request)
    }
}

fn coerce(value: &str) -> OptionValue {
    if let Ok(i) = value.parse::<i64>() {
        return OptionValue::Int(i);
    }
    match value {
        "true" => OptionValue::Bool(true),
        "false" => OptionValue::Bool(false),
        _ => OptionValue::Str(value.to_string()),
    }
}

/// Runs every check; never fails (each failure is a problem of the report).
pub fn run(request_text: &str) -> Report {
    let mut report = Report::default();
    library(&mut report);
    let request = match Request::parse(request_text) {
        Ok(request) => request,
        Err(e) => {
            report.problem(
                format!("the doctor's request: {e}"),
                "give options as key=value",
            );
            return report;
        }
    };
    let Some(options) = options(&mut report, &request) else {
        return report;
    };
    let compute_in_use = compute(&mut report, &options);
    let cuda_client = !compute_in_use && cuda_client(&options);
    ucx_section(&mut report, &options, cuda_client);
    address(&mut report, &options);
    if options.num_nodes > 1 {
        job(&mut report, &request, options);
    } else {
        report.say(
            "job           none given: with --num-processes N --process-id I and --coordinator \
             HOST:PORT or --etcd URL, run on every process, the doctor also checks the peers",
        );
    }
    report
}

/// This library: its version and where it was loaded from.
fn library(report: &mut Report) {
    let version = env!("CARGO_PKG_VERSION");
    let path = own_path().unwrap_or_else(|| "(not found in /proc/self/maps)".into());
    let api = format!(
        "{}.{}",
        crate::pjrt::bindings::PJRT_API_MAJOR,
        crate::pjrt::bindings::PJRT_API_MINOR
    );
    let linked = if path.ends_with(".so") {
        ""
    } else {
        " (linked in)"
    };
    report.say(format!(
        "library       pjrt-crosshost {version} (PJRT C API {api}) at {path}{linked}"
    ));
    let mut section = Section::new("library");
    section
        .text("version", version)
        .text("path", path)
        .text("pjrt_api", api);
    report.add(section);
}

/// The file mapped at this function's address.
fn own_path() -> Option<String> {
    let here = own_path as fn() -> Option<String> as usize;
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let (start, end) = (
            usize::from_str_radix(start, 16).ok()?,
            usize::from_str_radix(end, 16).ok()?,
        );
        let path = fields.nth(4)?;
        (start <= here && here < end).then(|| path.to_string())
    })
}

/// The create options as a client would read them, with the doctor's
/// defaults (its own session name; no compute client in its job).
fn options(report: &mut Report, request: &Request) -> Option<ClientOptions> {
    let mut given = request.options.clone();
    let has = |given: &[(String, OptionValue)], name: &str| given.iter().any(|(n, _)| n == name);
    if !has(&given, "session") {
        given.push(("session".into(), OptionValue::Str(DOCTOR_SESSION.into())));
    }
    if let Some(coordinator) = &request.coordinator {
        if !has(&given, "coordinator_address") {
            given.push((
                "coordinator_address".into(),
                OptionValue::Str(coordinator.clone()),
            ));
        }
    }
    match ClientOptions::parse(&given) {
        Ok(options) => Some(options),
        Err(e) => {
            report.problem(
                format!("create options: {}", e.message),
                "the option it names (PJRT_CROSSHOST_CREATE_OPTIONS under JAX)",
            );
            None
        }
    }
}

/// The compute plugin the client would delegate to; whether there is one.
fn compute(report: &mut Report, options: &ClientOptions) -> bool {
    let mut section = Section::new("compute_plugin");
    let path = match &options.compute {
        ComputeChoice::Off => None,
        ComputeChoice::Path(path) => Some(std::path::PathBuf::from(path)),
        ComputeChoice::Configured if options.backend_given => None,
        ComputeChoice::Configured => compute_plugin::configured_path(),
    };
    let Some(path) = path else {
        report.say(
            "compute       none: programs (jit) answer UNIMPLEMENTED, arrays are only held and \
             moved (for computing: pip install 'pjrt-crosshost[cpu]', or \
             PJRT_CROSSHOST_COMPUTE_PLUGIN=<an XLA PJRT plugin>)",
        );
        section.text("path", "").flag("loaded", false);
        report.add(section);
        return false;
    };
    section.text("path", path.display().to_string());
    match compute_plugin::load(&path) {
        Ok(plugin) => {
            let (major, minor) = plugin.version();
            let family = match plugin.family() {
                compute_plugin::PluginFamily::Cpu => "CPU",
                compute_plugin::PluginFamily::Gpu => "GPU",
            };
            report.say(format!(
                "compute       {} ({family} plugin, PJRT C API {major}.{minor})",
                path.display()
            ));
            section
                .flag("loaded", true)
                .text("family", family)
                .text("pjrt_api", format!("{major}.{minor}"));
        }
        Err(e) => {
            report.say(format!("compute       {}: does not load", path.display()));
            report.problem(
                format!(
                    "the compute plugin {} does not load: {}",
                    path.display(),
                    e.message
                ),
                "PJRT_CROSSHOST_COMPUTE_PLUGIN=<the path of an XLA PJRT plugin .so> (or pip \
                 install 'pjrt-crosshost[cpu]'), or compute_plugin=\"\" for none",
            );
            section.flag("loaded", false).text("error", e.message);
        }
    }
    report.add(section);
    true
}

/// Whether the client would have CUDA devices (a UCX with CUDA transports
/// is then preferred).
fn cuda_client(options: &ClientOptions) -> bool {
    match options.backend {
        BackendChoice::Host => false,
        choice => backend::select(choice, options.num_devices).is_ok_and(|b| b.name() == "cuda"),
    }
}

fn yes_no(items: &[String], why_not: &str) -> String {
    if items.is_empty() {
        format!("no ({why_not})")
    } else {
        format!("yes ({})", items.join(", "))
    }
}

/// The libucp the client would load, why, and what it can do here.
fn ucx_section(report: &mut Report, options: &ClientOptions, cuda_client: bool) {
    let mut section = Section::new("ucx");
    let survey = ucx::survey(cuda_client);
    let candidates: Vec<String> = survey
        .candidates
        .iter()
        .map(|c| {
            format!(
                "{}: verbs module {}, CUDA module {}",
                c.name(),
                if c.verbs { "yes" } else { "no" },
                if c.cuda { "yes" } else { "no" }
            )
        })
        .collect();
    section
        .list("candidates", candidates.clone())
        .list("absent", survey.absent.clone())
        .list("rdma_devices", survey.needs.rdma_devices.clone())
        .flag("cuda_client", cuda_client);
    if options.transport == TransportChoice::Tcp {
        report.say("UCX           not used: transport=tcp");
        section.flag("loaded", false).text("why", "transport=tcp");
        report.add(section);
        return;
    }
    let loaded = match ucx::load_for(options.ucx_library.as_deref(), cuda_client) {
        Ok(loaded) => loaded,
        Err(e) => {
            report.say("UCX           none usable: transfers to other hosts would use TCP");
            for candidate in &candidates {
                report.say(format!("              candidate: {candidate}"));
            }
            let change = if options.ucx_library.is_some() {
                "ucx_library=<the path of a libucp of UCX 1.14 or later>".to_string()
            } else {
                "pip install libucx-cu12 (jax_plugins.crosshost finds it; elsewhere \
                 PJRT_CROSSHOST_UCX_WHEEL_LIB=<its libucx/lib directory>), or \
                 ucx_library=<the path of a libucp of UCX 1.14 or later>; or transport=tcp \
                 to use the TCP transport on purpose"
                    .to_string()
            };
            report.problem(e.message.clone(), change);
            section.flag("loaded", false).text("error", e.message);
            report.add(section);
            return;
        }
    };
    // `why` names the candidate first; the path is said already.
    let why = loaded
        .why
        .split_once("): ")
        .filter(|(name, _)| name.contains(&loaded.path))
        .map_or(loaded.why.as_str(), |(_, why)| why);
    report.say(format!(
        "UCX           {} (UCX {})",
        loaded.path, loaded.version
    ));
    report.say(format!("              taken: {why}"));
    for candidate in &candidates {
        report.say(format!("              candidate: {candidate}"));
    }
    section
        .flag("loaded", true)
        .text("path", loaded.path.clone())
        .text("version", loaded.version.clone())
        .text("why", loaded.why.clone());
    match ucx::query(&loaded) {
        Ok(found) => {
            let devices: Vec<String> = found
                .resources
                .iter()
                .map(|(t, d)| format!("{t}/{d}"))
                .collect();
            let rdma = found.rdma();
            let cuda = found.cuda();
            let rdma_why = if survey.needs.rdma_devices.is_empty() {
                "no RDMA device on this host".to_string()
            } else {
                format!(
                    "this UCX has no verbs transport for the host's RDMA devices ({})",
                    survey.needs.rdma_devices.join(", ")
                )
            };
            let cuda_why = if cuda_client {
                "this UCX has no CUDA transport"
            } else {
                "no CUDA transport: no usable CUDA driver and device here, or a UCX without them"
            };
            report.say(format!(
                "              transports: {}",
                found.transports().join(", ")
            ));
            report.say(format!("              resources: {}", devices.join(", ")));
            report.say(format!(
                "              memory types: {}",
                found.memory_types.join(", ")
            ));
            report.say(format!(
                "              RDMA: {}, CUDA: {}",
                yes_no(&rdma, &rdma_why),
                yes_no(&cuda, cuda_why)
            ));
            if rdma.is_empty() && !survey.needs.rdma_devices.is_empty() {
                report.problem(
                    format!(
                        "this host has RDMA devices ({}) but the UCX taken ({}) has no verbs \
                         transport: bytes to other hosts go over TCP",
                        survey.needs.rdma_devices.join(", "),
                        loaded.path
                    ),
                    "ucx_library=<a libucp of UCX 1.14 or later built with verbs, e.g. the \
                     system's or your cluster's UCX>",
                );
            }
            if cuda.is_empty() && cuda_client {
                report.problem(
                    format!(
                        "this client has CUDA devices but the UCX taken ({}) has no CUDA transport",
                        loaded.path
                    ),
                    "pip install libucx-cu12, or ucx_library=<a libucp built with CUDA>",
                );
            }
            section
                .list("transports", found.transports())
                .list("resources", devices)
                .list("memory_types", found.memory_types.clone())
                .flag("rdma", !rdma.is_empty())
                .flag("cuda", !cuda.is_empty());
        }
        Err(e) => {
            report.say(format!(
                "              its transports could not be read: {e}"
            ));
            report.problem(
                format!("UCX {} makes no context here: {}", loaded.path, e.message),
                "ucx_library=<another libucp>, or transport=tcp",
            );
        }
    }
    report.add(section);
}

/// The address the process would advertise, why, and whether it is one of
/// this host's.
fn address(report: &mut Report, options: &ClientOptions) {
    let mut section = Section::new("address");
    let chosen = advertise::choose(&AddressHints {
        advertise_address: options.advertise_address.as_deref(),
        tcp_bind: options.tcp_bind,
        store_addresses: store_addresses(options),
        // What it would advertise to a job's other processes.
        multi_process: true,
    });
    let advertised = match chosen {
        Ok(advertised) => advertised,
        Err(e) => {
            report.say("address       none");
            report.problem(
                e.message.clone(),
                "advertise_address=<an IP address or a resolvable host name of this host>",
            );
            section.text("error", e.message);
            report.add(section);
            return;
        }
    };
    report.say(format!(
        "address       {} (chosen from {}), listening on {}",
        advertised.address, advertised.source, advertised.bind
    ));
    section
        .text("address", advertised.address.to_string())
        .text("source", advertised.source.clone())
        .text("bind", advertised.bind.to_string());
    let interfaces = advertise::interface_addresses();
    let own: Vec<String> = interfaces
        .iter()
        .filter(|i| !i.address.is_loopback() && !is_link_local(&i.address))
        .map(|i| format!("{} ({})", i.address, i.name))
        .collect();
    let local = advertised.address.is_loopback()
        || interfaces.iter().any(|i| i.address == advertised.address);
    section.flag("local", local);
    if !local {
        report.problem(
            format!(
                "the advertised address {} ({}) is not an address of this host (its addresses: \
                 {}): the job's other processes would look for this process there",
                advertised.address,
                advertised.source,
                own.join(", ")
            ),
            format!(
                "advertise_address=<one of {}> (or leave advertise_address unset to have one chosen)",
                own.iter()
                    .map(|a| a.split(' ').next().unwrap_or(a))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        );
    } else if let Err(e) = TcpListener::bind(SocketAddr::new(advertised.bind, 0)) {
        report.problem(
            format!("cannot listen on {}: {e}", advertised.bind),
            "tcp_bind=<an address of this host, or 0.0.0.0>",
        );
    } else if advertised.address.is_loopback() && options.num_nodes > 1 {
        report.say(
            "              loopback: only processes on this host can reach it (set \
             advertise_address for a job across hosts)",
        );
    }
    report.add(section);
}

fn is_link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// What one process saw of one peer.
#[derive(Clone, Debug)]
struct Seen {
    peer: i32,
    /// `control` or `tcp`.
    what: String,
    /// Where it tried.
    at: String,
    outcome: std::result::Result<f64, String>,
}

impl Seen {
    fn encode(&self) -> String {
        let (verdict, detail) = match &self.outcome {
            Ok(ms) => ("ok", format!("{ms}")),
            Err(e) => ("fail", e.replace(['\t', '\n'], " ")),
        };
        format!(
            "{}\t{}\t{}\t{verdict}\t{detail}",
            self.peer, self.what, self.at
        )
    }

    /// What to change where it did not answer: UCX's own setting for a UCX
    /// endpoint, else `advertise` (the address to advertise instead).
    fn change(&self, advertise: String) -> String {
        if self.what == "ucx" {
            UCX_CHANGE.to_string()
        } else {
            advertise
        }
    }

    fn decode(line: &str) -> Option<Seen> {
        let mut f = line.splitn(5, '\t');
        let peer = f.next()?.parse().ok()?;
        let what = f.next()?.to_string();
        let at = f.next()?.to_string();
        let verdict = f.next()?;
        let detail = f.next().unwrap_or("");
        let outcome = match verdict {
            "ok" => Ok(detail.parse().ok()?),
            _ => Err(detail.to_string()),
        };
        Some(Seen {
            peer,
            what,
            at,
            outcome,
        })
    }
}

/// Where the processes publish what they saw (the job's own store).
trait Board {
    fn put(&self, key: &str, value: &[u8]) -> Result<()>;
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
}

impl Board for RendezvousClient {
    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        RawKvCallbacks::put(self, key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        RawKvCallbacks::get(self, key, timeout)
    }
}

impl Board for Arc<dyn crate::kv::KeyValueStore> {
    fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        self.set(key, value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        crate::kv::KeyValueStore::get(&**self, key, timeout)
    }
}

/// Forms the job, checks every peer, publishes and reads what each saw.
fn job(report: &mut Report, request: &Request, mut options: ClientOptions) {
    let me = options.node_id;
    let n = options.num_nodes;
    // The doctor's job needs no compute client: it checks the data plane.
    options.compute = ComputeChoice::Off;
    report.say(format!(
        "job           process {me} of {n}, session {:?}",
        options.session
    ));
    let mut section = Section::new("job");
    section
        .number("process", me as f64)
        .number("processes", n as f64)
        .text("session", options.session.clone());
    let mut server = None;
    let (callbacks, board): (Option<Arc<dyn RawKvCallbacks>>, Box<dyn Board>) = match (
        &request.coordinator,
        &options.store,
    ) {
        (Some(coordinator), StoreChoice::Default | StoreChoice::Callbacks) => {
            if me == 0 {
                match RendezvousServer::start(coordinator) {
                    Ok(started) => server = Some(started),
                    Err(e) => {
                        report.problem(
                            e.message,
                            "--coordinator <host:port>: a free port on process 0's host",
                        );
                        report.add(section);
                        return;
                    }
                }
            }
            let timeout = options.session_timeout.max(request.timeout);
            let client = Arc::new(RendezvousClient::new(coordinator, timeout));
            (
                Some(client.clone()),
                Box::new(RendezvousClient::new(coordinator, timeout)),
            )
        }
        (_, StoreChoice::Etcd(_)) => match super::client::connect_etcd(&options) {
            Ok(Some(etcd)) => (
                None,
                Box::new(etcd as Arc<dyn crate::kv::KeyValueStore>) as Box<dyn Board>,
            ),
            Ok(None) => unreachable!("kv_store=etcd connects etcd"),
            Err(e) => {
                report.problem(
                        format!("etcd: {}", e.message),
                        "kv_store=etcd://<host:port of a member this host reaches> (and the etcd_* options)",
                    );
                report.add(section);
                return;
            }
        },
        _ => {
            report.problem(
                format!("a job of {n} processes needs a store that every process reaches"),
                "--coordinator <host:port of process 0> (the doctor serves it there), or \
                     --etcd etcd://<host:port> (kv_store=etcd://...)",
            );
            report.add(section);
            return;
        }
    };
    let started = Instant::now();
    let client = match Client::create_with_callbacks(options.clone(), callbacks) {
        Ok(client) => client,
        Err(e) => {
            report.say(format!("              the job did not form: {e}"));
            report.problem(
                format!("creating this process's client of the job: {e}"),
                "start the doctor on every process of the job with the same store, \
                 --num-processes and session (and a distinct --process-id each); \
                 session_timeout_ms bounds the wait for the others",
            );
            report.add(section);
            return;
        }
    };
    report.say(format!(
        "              formed in {:.0} ms",
        started.elapsed().as_secs_f64() * 1e3
    ));
    let session = client.transfers().session();
    let mut seen = check_peers(session, options.transport, request.timeout);
    // Kept until every process has published what it saw: the others ping it.
    let _ucx = ping_ucx(session, &options, &*board, request.timeout, &mut seen);
    let mut peers = Vec::new();
    for process in session.processes.iter().filter(|p| p.process_index != me) {
        let p = process.process_index;
        let same_host = HostIdentity::local().is_ok_and(|h| h == process.host);
        let route = if same_host && options.transport == TransportChoice::Auto {
            "shared memory (same host)"
        } else if session.ucx.contains_key(&p) {
            "UCX"
        } else {
            "TCP"
        };
        // Where UCX's only lane is TCP, `auto` sends batches of large
        // buffers over the TCP transport (`transfer::route`): say so.
        let tcp_only = client.transfers().ucx_lanes() == Some(UcxLanes::TcpOnly);
        let batches = if route == "UCX" && tcp_only && options.transport == TransportChoice::Auto {
            format!(
                " (batches of {} or more buffers of at least {} KiB by TCP: this host's UCX \
                 has no RDMA lane; transport=ucx keeps them on UCX)",
                TCP_BATCH_MIN_COUNT,
                TCP_BATCH_MIN_BYTES >> 10
            )
        } else {
            String::new()
        };
        let mut facts = vec![
            ("process".to_string(), Fact::Number(p as f64)),
            (
                "host".to_string(),
                Fact::Text(process.host.hostname.clone()),
            ),
            ("route".to_string(), Fact::Text(route.to_string())),
        ];
        let mut line = format!(
            "peer {p}        host {}, bytes by {route}{batches}",
            process.host.hostname
        );
        for s in seen.iter().filter(|s| s.peer == p) {
            match &s.outcome {
                Ok(ms) => {
                    line.push_str(&format!(
                        "; {} {} answers, {ms:.3} ms round trip",
                        describe_what(&s.what),
                        s.at
                    ));
                    facts.push((format!("{}_rtt_ms", s.what), Fact::Number(*ms)));
                }
                Err(e) => {
                    line.push_str(&format!(
                        "; {} {} does not answer",
                        describe_what(&s.what),
                        s.at
                    ));
                    facts.push((format!("{}_error", s.what), Fact::Text(e.clone())));
                    report.problem(
                        format!(
                            "process {p} (host {}) does not answer on its {} {}: {e}",
                            process.host.hostname,
                            describe_what(&s.what),
                            s.at
                        ),
                        s.change(format!(
                            "give process {p} the create option advertise_address=<an \
                             address of its host that this host can reach> (under JAX: \
                             PJRT_CROSSHOST_CREATE_OPTIONS=advertise_address=...)"
                        )),
                    );
                }
            }
            facts.push((format!("{}_at", s.what), Fact::Text(s.at.clone())));
        }
        report.say(line);
        peers.push(facts);
    }
    // What the others saw of this process: a peer it cannot reach is a
    // problem on both ends.
    let key = |process: i32| {
        format!(
            "{}/doctor/{}/seen/{process}",
            options.session, session.epoch
        )
    };
    let mine: String = seen.iter().map(|s| s.encode() + "\n").collect();
    if let Err(e) = board.put(&key(me), mine.as_bytes()) {
        report.problem(
            format!("publishing what this process saw: {e}"),
            "the store's options (--coordinator / --etcd)",
        );
    }
    let wait = request.timeout * 2 + options.session_timeout.min(Duration::from_secs(30));
    for other in (0..n as i32).filter(|&p| p != me) {
        match board.get(&key(other), wait) {
            Ok(value) => {
                for s in String::from_utf8_lossy(&value)
                    .lines()
                    .filter_map(Seen::decode)
                {
                    if s.peer != me {
                        continue;
                    }
                    if let Err(e) = &s.outcome {
                        report.problem(
                            format!(
                                "process {other} cannot reach this process on its {} {}: {e}",
                                describe_what(&s.what),
                                s.at
                            ),
                            s.change(format!(
                                "advertise_address=<an address of this host that process \
                                 {other}'s host can reach>{}",
                                advertised_note(session, me)
                            )),
                        );
                    }
                }
            }
            Err(e) => report.problem(
                format!("process {other} published no result within {wait:?}: {e}"),
                "run the doctor on every process of the job; doctor.timeout_ms (--timeout) \
                 bounds the wait",
            ),
        }
    }
    // Process 0 serves the coordinator's store: it stays until everyone has
    // read the results.
    let done = |process: i32| {
        format!(
            "{}/doctor/{}/done/{process}",
            options.session, session.epoch
        )
    };
    let _ = board.put(&done(me), b"1");
    if me == 0 && server.is_some() {
        for other in 1..n as i32 {
            let _ = board.get(&done(other), wait);
        }
    }
    section.objects("peers", peers);
    report.add(section);
    drop(client);
}

fn describe_what(what: &str) -> &'static str {
    match what {
        "control" => "control link",
        "ucx" => "UCX endpoint",
        _ => "TCP data port",
    }
}

/// Round trips over UCX to each peer reached over it: the doctor's own
/// workers (the client's are not reachable from here), started with the
/// library the client took, their addresses exchanged on the board. Each
/// ping is a DATA message for a token the peer does not know, which it
/// refuses over the same connection: an answer, timed. The first send
/// also wires the endpoint up; the median of the ones after it is kept.
fn ping_ucx(
    session: &Session,
    options: &ClientOptions,
    board: &dyn Board,
    timeout: Duration,
    seen: &mut Vec<Seen>,
) -> Option<ucx::UcxTransport> {
    let me = session.process_index;
    let local = HostIdentity::local().ok();
    let peers: Vec<i32> = session
        .processes
        .iter()
        .filter(|p| {
            p.process_index != me && options.transport.wants_ucx(local.as_ref() == Some(&p.host))
        })
        .map(|p| p.process_index)
        .collect();
    if options.transport == TransportChoice::Tcp || session.processes.len() < 2 {
        return None;
    }
    let key = |process: i32| format!("{}/doctor/{}/ucx/{process}", options.session, session.epoch);
    let transport = ucx::load_for(options.ucx_library.as_deref(), false)
        .and_then(|loaded| ucx::UcxTransport::start(&loaded, me as u32))
        .ok();
    // Published by every process (empty without UCX), read by those that
    // reach it over UCX.
    let mine = transport.as_ref().map_or(String::new(), |t| {
        t.addresses()
            .iter()
            .map(|a| rendezvous::hex(a))
            .collect::<Vec<_>>()
            .join(",")
    });
    let _ = board.put(&key(me), mine.as_bytes());
    let transport = transport?;
    let mut addresses = std::collections::HashMap::new();
    addresses.insert(me as u32, transport.addresses());
    for &peer in &peers {
        let theirs = board
            .get(&key(peer), timeout * 3)
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .unwrap_or_default();
        let workers: Vec<Vec<u8>> = theirs
            .split(',')
            .filter_map(rendezvous::unhex)
            .filter(|a| !a.is_empty())
            .collect();
        if !workers.is_empty() {
            addresses.insert(peer as u32, workers);
        }
    }
    transport.set_peers(&addresses);
    for &peer in peers
        .iter()
        .filter(|p| addresses.contains_key(&(**p as u32)))
    {
        let mut times = Vec::new();
        let mut failure = None;
        for _ in 0..PINGS {
            match ucx_round_trip(&transport, peer as u32, timeout) {
                Ok(ms) => times.push(ms),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        // Lanes are known only for transfers that carried bytes; pings do not.
        let at = format!("at its {} workers", addresses[&(peer as u32)].len());
        let outcome = match failure {
            Some(e) => Err(e),
            None => {
                let mut after_wireup = times.split_off(1);
                after_wireup.sort_by(f64::total_cmp);
                Ok(after_wireup[after_wireup.len() / 2])
            }
        };
        seen.push(Seen {
            peer,
            what: "ucx".into(),
            at,
            outcome,
        });
    }
    Some(transport)
}

/// One DATA message to `peer` for an unknown token, and its refusal.
fn ucx_round_trip(
    transport: &ucx::UcxTransport,
    peer: u32,
    timeout: Duration,
) -> std::result::Result<f64, String> {
    let token = crate::transport::auth_token::AuthToken::generate().map_err(|e| e.message)?;
    let (tx, rx) = crossbeam_channel::bounded(1);
    let started = Instant::now();
    transport.send(
        peer,
        token,
        0,
        ucx::Payload::owned(vec![0; 8]),
        None,
        timeout,
        Box::new(move |outcome| {
            let _ = tx.send(outcome.map(|_| ()));
        }),
        0,
    );
    let answer = rx
        .recv_timeout(timeout + Duration::from_secs(1))
        .map_err(|_| format!("no answer within {timeout:?}"))?;
    let elapsed = started.elapsed().as_secs_f64() * 1e3;
    match answer {
        Ok(()) => Ok(elapsed),
        // The refusal of an unknown token is the answer looked for.
        Err(e)
            if !matches!(
                e.code,
                crate::status::Code::DeadlineExceeded
                    | crate::status::Code::Unavailable
                    | crate::status::Code::Cancelled
            ) =>
        {
            Ok(elapsed)
        }
        Err(e) => Err(e.message),
    }
}

fn advertised_note(session: &Session, me: i32) -> String {
    session
        .processes
        .iter()
        .find(|p| p.process_index == me)
        .and_then(|p| {
            p.control
                .as_ref()
                .map(|c| c.tcp.ip())
                .or(p.tcp_data.map(|a| a.ip()))
        })
        .map_or(String::new(), |ip: IpAddr| {
            format!(" (this process advertised {ip})")
        })
}

/// Opens a control link to each peer (the job's handshake, over TCP or,
/// on this host, its Unix socket) and times round trips on it; connects to
/// each peer's TCP data port.
fn check_peers(session: &Session, transport: TransportChoice, timeout: Duration) -> Vec<Seen> {
    let me = session.process_index;
    let local = HostIdentity::local().ok();
    let mut seen = Vec::new();
    for process in session.processes.iter().filter(|p| p.process_index != me) {
        let peer = process.process_index;
        let same_host = local.as_ref() == Some(&process.host) && transport != TransportChoice::Tcp;
        if let Some(endpoint) = &process.control {
            let at = if same_host {
                format!("at unix:{}", endpoint.unix_name)
            } else {
                format!("at {}", endpoint.tcp)
            };
            seen.push(Seen {
                peer,
                what: "control".into(),
                at,
                outcome: ping(session, peer, endpoint, same_host, timeout),
            });
        }
        if let Some(tcp) = process.tcp_data {
            let started = Instant::now();
            let outcome = TcpStream::connect_timeout(&tcp, timeout)
                .map(|_| started.elapsed().as_secs_f64() * 1e3)
                .map_err(|e| e.to_string());
            seen.push(Seen {
                peer,
                what: "tcp".into(),
                at: format!("at {tcp}"),
                outcome,
            });
        }
    }
    seen
}

/// The median round trip of `PINGS` SETs on a control link to `peer`, in
/// ms; the key is deleted and the link closed with BYE after.
fn ping(
    session: &Session,
    peer: i32,
    endpoint: &crate::transport::control::ControlEndpoint,
    same_host: bool,
    timeout: Duration,
) -> std::result::Result<f64, String> {
    let link = ControlLink::connect(
        peer as u32,
        endpoint,
        same_host,
        session.process_index as u32,
        session.secret,
        timeout,
        None,
    )
    .map_err(|e: Status| e.message)?;
    let key = format!(
        "crosshost/doctor/{}/{}/{peer}",
        session.epoch, session.process_index
    );
    let mut times = Vec::with_capacity(PINGS);
    for _ in 0..PINGS {
        let started = Instant::now();
        link.set(&key, b"ping").map_err(|e| e.message)?;
        times.push(started.elapsed().as_secs_f64() * 1e3);
    }
    let _ = link.delete(&key);
    Connection::close(&*link);
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_create_options_and_the_doctors_own() {
        let request = Request::parse(
            "num_nodes=2\nnode_id=1\ndoctor.coordinator=10.0.0.1:1234, advertise_address=10.0.0.2\ndoctor.timeout_ms=2500",
        )
        .unwrap();
        assert_eq!(request.coordinator.as_deref(), Some("10.0.0.1:1234"));
        assert_eq!(request.timeout, Duration::from_millis(2500));
        assert_eq!(
            request.options,
            vec![
                ("num_nodes".into(), OptionValue::Int(2)),
                ("node_id".into(), OptionValue::Int(1)),
                (
                    "advertise_address".into(),
                    OptionValue::Str("10.0.0.2".into())
                ),
            ]
        );
        assert!(Request::parse("no equals sign").is_err());
    }

    #[test]
    fn what_a_process_saw_survives_the_store() {
        let seen = Seen {
            peer: 3,
            what: "control".into(),
            at: "10.0.0.7:41553".into(),
            outcome: Err("connect\ttimed out\n".into()),
        };
        let back = Seen::decode(&seen.encode()).unwrap();
        assert_eq!(
            (back.peer, back.what.as_str(), back.at.as_str()),
            (3, "control", "10.0.0.7:41553")
        );
        assert_eq!(back.outcome, Err("connect timed out ".into()));
        let ok = Seen::decode("1\ttcp\t10.0.0.1:9\tok\t0.25").unwrap();
        assert_eq!(ok.outcome, Ok(0.25));
    }

    #[test]
    fn an_advertised_address_that_is_not_this_hosts_is_a_problem_naming_the_option() {
        let report = run("advertise_address=192.0.2.77\ntransport=tcp");
        let problem = report
            .problems
            .iter()
            .find(|p| p.problem.contains("192.0.2.77"))
            .unwrap_or_else(|| panic!("{}", report.text()));
        assert!(
            problem.problem.contains("not an address of this host"),
            "{problem:?}"
        );
        assert!(
            problem.change.starts_with("advertise_address=<one of"),
            "{problem:?}"
        );
        assert!(!report.ok());
    }
}
