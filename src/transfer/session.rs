//! The job's session: a random epoch agreed by every process at client
//! creation, and the process table (devices per process, host identity)
//! exchanged through the store. A process either states its devices' global
//! ids (a delegating client takes its compute plugin's numbering) or leaves
//! them to be assigned in process order; either way every process derives
//! the same ids.
//!
//! Keys (under the caller's session name):
//! - `crosshost/session/<name>/epoch`: written by process 0;
//! - `crosshost/session/<name>/<epoch>/process/<i>`: each process's entry;
//! - `crosshost/session/<name>/<epoch>/ucx/<i>`: process i's UCX worker
//!   address (or why it has none), written only by processes that have a
//!   peer to reach over UCX (one on another host, or `transport=ucx`), and
//!   read only by those peers: a job on one host never starts UCX.
//!
//! A store shared by several jobs must give each job its own session name
//! (JAX's coordination service is per job, so under JAX this holds).
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::kv::KeyValueStore;
use crate::status::{self, Result, Status};
use crate::transport::control::{ControlEndpoint, Secret};
use crate::transport::hex;
use crate::transport::host_identity::HostIdentity;
use crate::transport::random::random_u64;

pub mod epoch_record;
pub mod roster;

/// The most devices a peer's session entry may state (XLA numbers a
/// process's devices below 2048 apart; twice that is generous).
pub const MAX_DEVICES_PER_PROCESS: usize = 4096;

/// The longest UCX worker address a peer may state (a few hundred bytes
/// per network device; generous for many).
pub const MAX_UCX_ADDRESS_LEN: usize = 64 << 10;
/// The most UCX workers a peer may state.
pub const MAX_UCX_WORKERS: usize = 64;

/// The devices a process brings to the session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalDevices {
    pub count: usize,
    /// Their global ids, if the process chose them; `None`: assigned in
    /// process order.
    pub ids: Option<Vec<i32>>,
    /// Device kind (the same for all of a process's devices).
    pub kind: String,
}

impl LocalDevices {
    pub fn sequential(count: usize, kind: &str) -> LocalDevices {
        LocalDevices {
            count,
            ids: None,
            kind: kind.to_string(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessEntry {
    pub process_index: i32,
    pub num_devices: usize,
    pub device_ids: Option<Vec<i32>>,
    pub device_kind: String,
    pub host: HostIdentity,
    pub pid: u32,
    /// Where its control links are served (peer store), if it has them.
    pub control: Option<ControlEndpoint>,
    /// Where its TCP receive server listens, if it has one: a sender sends
    /// TCP bytes only there, whatever a descriptor says.
    pub tcp_data: Option<SocketAddr>,
    /// Its `transport` option (every process of a job must use the same).
    pub transport: String,
}

impl ProcessEntry {
    fn mine(process_index: i32, devices: LocalDevices, transport: &str) -> Result<ProcessEntry> {
        Ok(ProcessEntry {
            transport: transport.to_string(),
            process_index,
            num_devices: devices.count,
            device_ids: devices.ids,
            device_kind: devices.kind,
            host: HostIdentity::local()?,
            pid: std::process::id(),
            control: None,
            tcp_data: None,
        })
    }

    pub fn encode(&self) -> String {
        let ids = match &self.device_ids {
            None => "-".to_string(),
            Some(ids) => ids.iter().map(i32::to_string).collect::<Vec<_>>().join(","),
        };
        let control = self
            .control
            .as_ref()
            .map_or_else(|| "-".to_string(), ControlEndpoint::encode);
        let tcp_data = self
            .tcp_data
            .map_or_else(|| "-".to_string(), |addr| addr.to_string());
        format!(
            "xs5 {} {} {} {} {} {} {} {} {}",
            self.num_devices,
            self.host.hostname,
            self.host.boot_id,
            self.pid,
            ids,
            control,
            tcp_data,
            self.transport,
            self.device_kind
        )
    }

    pub fn decode(process_index: i32, bytes: &[u8]) -> Result<ProcessEntry> {
        let bad = || {
            status::data_loss(format!(
                "session entry of process {process_index} is malformed: {:?}",
                String::from_utf8_lossy(bytes)
            ))
        };
        let text = std::str::from_utf8(bytes).map_err(|_| bad())?;
        // The kind is last and may contain spaces (a GPU's name).
        let parts: Vec<&str> = text.splitn(10, ' ').collect();
        let ["xs5", devices, hostname, boot_id, pid, ids, control, tcp_data, transport, kind] =
            parts[..]
        else {
            return Err(bad());
        };
        let tcp_data = match tcp_data {
            "-" => None,
            text => Some(text.parse::<SocketAddr>().map_err(|_| bad())?),
        };
        let control = match control {
            "-" => None,
            text => Some(ControlEndpoint::decode(text).ok_or_else(bad)?),
        };
        // One entry is one line of process 0's roster.
        if kind.contains('\n') {
            return Err(bad());
        }
        let num_devices: usize = devices.parse().map_err(|_| bad())?;
        // A peer states its own count; an absurd one would make every
        // process allocate that many devices at client creation.
        if num_devices > MAX_DEVICES_PER_PROCESS {
            return Err(bad());
        }
        let device_ids = match ids {
            "-" => None,
            list => {
                let ids = list
                    .split(',')
                    .map(|id| id.parse::<i32>().map_err(|_| bad()))
                    .collect::<Result<Vec<i32>>>()?;
                if ids.len() != num_devices {
                    return Err(bad());
                }
                Some(ids)
            }
        };
        Ok(ProcessEntry {
            process_index,
            num_devices,
            device_ids,
            device_kind: kind.to_string(),
            host: HostIdentity {
                hostname: hostname.to_string(),
                boot_id: boot_id.to_string(),
            },
            pid: pid.parse().map_err(|_| bad())?,
            control,
            tcp_data,
            transport: transport.to_string(),
        })
    }
}

/// Where the job's other processes reach this one, as its session entry
/// states it.
#[derive(Clone, Debug, Default)]
pub struct Reachable {
    pub control: Option<ControlEndpoint>,
    pub tcp_data: Option<SocketAddr>,
}

impl From<Option<ControlEndpoint>> for Reachable {
    fn from(control: Option<ControlEndpoint>) -> Reachable {
        Reachable {
            control,
            tcp_data: None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Session {
    /// Random id shared by all processes of this job: the temporal identity
    /// at the front of every key name.
    pub epoch: String,
    /// The job's secret for control links (made by process 0 with the
    /// epoch).
    pub secret: Secret,
    pub process_index: i32,
    /// Every process of the job, ordered by process index.
    pub processes: Vec<ProcessEntry>,
    /// UCX worker addresses of the peers this process reaches over UCX
    /// (each process has a few workers).
    pub ucx: HashMap<i32, Vec<Vec<u8>>>,
}

impl Session {
    /// A single-process session: nothing to agree on.
    pub fn local(devices: LocalDevices, transport: &str) -> Result<Session> {
        Ok(Session {
            epoch: format!("{:016x}", random_u64()?),
            secret: Secret::generate()?,
            process_index: 0,
            processes: vec![ProcessEntry::mine(0, devices, transport)?],
            ucx: HashMap::new(),
        })
    }

    /// Where process `index` of session `name` (at `epoch`) states itself.
    /// On a store with leases (etcd) this key lives exactly as long as the
    /// process does.
    pub fn entry_key(name: &str, epoch: &str, index: usize) -> String {
        format!("{}{index}", Session::entries_prefix(name, epoch))
    }

    /// The prefix of every process's entry (one watch covers them all).
    pub fn entries_prefix(name: &str, epoch: &str) -> String {
        format!("crosshost/session/{name}/{epoch}/process/")
    }

    /// Where process 0 publishes the job's table (a `roster`).
    pub fn roster_key(name: &str, epoch: &str) -> String {
        format!("crosshost/session/{name}/{epoch}/roster")
    }

    /// Agrees on the epoch and exchanges process entries with the other
    /// `num_processes - 1` processes: each writes its entry, process 0
    /// gathers them (waiting at most `timeout` in all) and publishes the
    /// table, which every other process reads in one call (waiting at most
    /// `timeout` for it). `control` starts this process's control links (and
    /// TCP receive server) once the job's secret is known and returns where
    /// peers reach them (`Reachable`, or just the control endpoint or
    /// `None`).
    #[allow(clippy::too_many_arguments)]
    pub fn establish<R: Into<Reachable>>(
        store: &dyn KeyValueStore,
        name: &str,
        process_index: i32,
        num_processes: usize,
        devices: LocalDevices,
        transport: &str,
        timeout: Duration,
        control: impl FnOnce(&str, Secret) -> Result<R>,
    ) -> Result<Session> {
        let (epoch, secret) = if process_index == 0 {
            epoch_record::publish(store, name)?
        } else {
            epoch_record::await_fresh(store, name, timeout)?
        };
        let gathering_since = Instant::now();
        let mut me = ProcessEntry::mine(process_index, devices, transport)?;
        let reachable: Reachable = control(&epoch, secret)?.into();
        me.control = reachable.control;
        me.tcp_data = reachable.tcp_data;
        // Every process writes its own entry: on a store with leases it is
        // the process's liveness key.
        store.set(
            &Session::entry_key(name, &epoch, process_index as usize),
            me.encode().as_bytes(),
        )?;
        let roster_key = Session::roster_key(name, &epoch);
        let processes = if process_index == 0 {
            let transport = me.transport.clone();
            roster::gather_and_publish(
                store,
                &roster_key,
                roster::Gathering {
                    count: num_processes,
                    own: me.clone(),
                    deadline: gathering_since + timeout,
                    key: &|i| Session::entry_key(name, &epoch, i),
                    waiting: &|i| format!("waiting for process {i} to join session {name:?}"),
                    decode: &|i, bytes| {
                        let entry = ProcessEntry::decode(i as i32, bytes)?;
                        if entry.transport != transport {
                            return Err(mixed_transports(name, &entry, 0, &transport));
                        }
                        Ok(entry)
                    },
                    encode: &ProcessEntry::encode,
                },
            )?
        } else {
            let waiting = format!("waiting for process 0 to form session {name:?}");
            let lines = roster::read(
                store,
                &roster_key,
                num_processes,
                timeout + roster::GRACE,
                &waiting,
            )?;
            let processes = lines
                .iter()
                .enumerate()
                .map(|(i, line)| ProcessEntry::decode(i as i32, line.as_bytes()))
                .collect::<Result<Vec<_>>>()?;
            let listed = &processes[process_index as usize];
            if listed.pid != me.pid || listed.host != me.host {
                return Err(status::failed_precondition(format!(
                    "session {name:?}: process 0 lists pid {} on {} as process {process_index}, \
                     not this process (pid {} on {}): two processes were started with the same \
                     index",
                    listed.pid, listed.host.hostname, me.pid, me.host.hostname
                )));
            }
            if let Some(other) = processes.iter().find(|p| p.transport != transport) {
                return Err(mixed_transports(name, other, process_index, transport));
            }
            processes
        };
        let total: usize = processes.iter().map(|p| p.num_devices).sum();
        if total > i32::MAX as usize {
            return Err(status::data_loss(format!(
                "session {name:?}: the processes state {total} devices in all, more than global \
                 device ids can number"
            )));
        }
        Ok(Session {
            epoch,
            secret,
            process_index,
            processes,
            ucx: HashMap::new(),
        })
    }

    /// Where process `index` states its UCX worker address.
    pub fn ucx_key(name: &str, epoch: &str, index: i32) -> String {
        format!("crosshost/session/{name}/{epoch}/ucx/{index}")
    }

    /// Where process 0 publishes every process's UCX worker addresses.
    pub fn ucx_roster_key(name: &str, epoch: &str) -> String {
        format!("crosshost/session/{name}/{epoch}/ucx-roster")
    }

    /// Publishes this process's UCX worker addresses (or, `Err`, why it has
    /// none) and learns every other process's, through process 0 as the
    /// entries are (one read per process; process 0 waits at most `timeout`
    /// for them all). Every process of the job calls it, or none: UCX is
    /// wanted by all when the job spans hosts or `transport=ucx`. Peers
    /// without addresses are left out of `ucx`; their reasons come back.
    pub fn exchange_ucx(
        &mut self,
        store: &dyn KeyValueStore,
        name: &str,
        mine: std::result::Result<&[Vec<u8>], &str>,
        timeout: Duration,
    ) -> Result<Vec<(i32, String)>> {
        let mine = match mine {
            Ok(addresses) => UcxStated::Addresses(addresses.to_vec()),
            Err(reason) => UcxStated::Without(reason.to_string()),
        };
        store.set(
            &Session::ucx_key(name, &self.epoch, self.process_index),
            mine.encode().as_bytes(),
        )?;
        let roster_key = Session::ucx_roster_key(name, &self.epoch);
        let count = self.processes.len();
        let stated: Vec<UcxStated> = if self.process_index == 0 {
            let epoch = &self.epoch;
            roster::gather_and_publish(
                store,
                &roster_key,
                roster::Gathering {
                    count,
                    own: mine,
                    deadline: Instant::now() + timeout,
                    key: &|i| Session::ucx_key(name, epoch, i as i32),
                    waiting: &|i| {
                        format!(
                            "waiting for process {i} of session {name:?} to state its UCX address"
                        )
                    },
                    decode: &|i, bytes| UcxStated::decode(name, i as i32, bytes),
                    encode: &UcxStated::encode,
                },
            )?
        } else {
            let waiting =
                format!("waiting for process 0 to gather session {name:?}'s UCX addresses");
            roster::read(store, &roster_key, count, timeout + roster::GRACE, &waiting)?
                .iter()
                .enumerate()
                .map(|(peer, line)| UcxStated::decode(name, peer as i32, line.as_bytes()))
                .collect::<Result<Vec<_>>>()?
        };
        let mut without = Vec::new();
        for (peer, stated) in stated.into_iter().enumerate() {
            let peer = peer as i32;
            if peer == self.process_index {
                continue;
            }
            match stated {
                UcxStated::Addresses(addresses) => {
                    self.ucx.insert(peer, addresses);
                }
                UcxStated::Without(reason) => without.push((peer, reason)),
            }
        }
        Ok(without)
    }

    /// The global ids of each process's devices: the ones it stated, or
    /// assigned in process order (counting every process's devices).
    pub fn device_ids(&self) -> Vec<Vec<i32>> {
        let mut next = 0i32;
        self.processes
            .iter()
            .map(|p| {
                let first = next;
                next += p.num_devices as i32;
                match &p.device_ids {
                    Some(ids) => ids.clone(),
                    None => (first..first + p.num_devices as i32).collect(),
                }
            })
            .collect()
    }

    /// The process owning a global device id.
    pub fn process_of_device(&self, global_id: i32) -> Option<&ProcessEntry> {
        self.processes
            .iter()
            .zip(self.device_ids())
            .find(|(_, ids)| ids.contains(&global_id))
            .map(|(p, _)| p)
    }
}

fn mixed_transports(name: &str, other: &ProcessEntry, me: i32, transport: &str) -> Status {
    status::failed_precondition(format!(
        "session {name:?}: process {} uses transport={} and process {me} transport={transport}: \
         every process of a job needs the same transport",
        other.process_index, other.transport
    ))
}

/// What a process states about UCX: its workers' addresses, or why it has
/// none.
#[derive(Clone, Debug, PartialEq, Eq)]
enum UcxStated {
    Addresses(Vec<Vec<u8>>),
    Without(String),
}

impl UcxStated {
    fn encode(&self) -> String {
        match self {
            UcxStated::Addresses(addresses) => {
                let list: Vec<String> = addresses.iter().map(|a| hex::encode(a)).collect();
                format!("xu1 {}", list.join(","))
            }
            UcxStated::Without(reason) => format!("xu1 - {}", reason.replace('\n', " ")),
        }
    }

    fn decode(name: &str, peer: i32, bytes: &[u8]) -> Result<UcxStated> {
        let bad = || {
            status::data_loss(format!(
                "session {name:?}: process {peer}'s UCX address is malformed"
            ))
        };
        let text = std::str::from_utf8(bytes).map_err(|_| bad())?;
        if text.contains('\n') {
            return Err(bad());
        }
        match text.strip_prefix("xu1 ").ok_or_else(bad)? {
            reason if reason.starts_with("- ") => Ok(UcxStated::Without(reason[2..].to_string())),
            list => {
                let addresses = list
                    .split(',')
                    .map(|text| hex::decode(text).filter(|a| !a.is_empty()).ok_or_else(bad))
                    .collect::<Result<Vec<Vec<u8>>>>()?;
                let total: usize = addresses.iter().map(Vec::len).sum();
                if addresses.len() > MAX_UCX_WORKERS || total > MAX_UCX_ADDRESS_LEN {
                    return Err(bad());
                }
                Ok(UcxStated::Addresses(addresses))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::memory::MemoryStore;
    use std::sync::Arc;

    #[test]
    fn processes_agree_on_epoch_and_global_ids() {
        let store = Arc::new(MemoryStore::new());
        let s2 = store.clone();
        let other = std::thread::spawn(move || {
            Session::establish(
                &*s2,
                "job",
                1,
                2,
                host(3),
                "auto",
                Duration::from_secs(10),
                no_control,
            )
            .unwrap()
        });
        let first = Session::establish(
            &*store,
            "job",
            0,
            2,
            host(2),
            "auto",
            Duration::from_secs(10),
            no_control,
        )
        .unwrap();
        let second = other.join().unwrap();
        assert_eq!(first.epoch, second.epoch);
        assert_eq!(first.processes, second.processes);
        assert_eq!(first.device_ids(), vec![vec![0, 1], vec![2, 3, 4]]);
        assert_eq!(first.process_of_device(4).unwrap().process_index, 1);
        assert!(first.process_of_device(5).is_none());
    }

    fn no_control(_: &str, _: Secret) -> Result<Option<ControlEndpoint>> {
        Ok(None)
    }

    fn host(count: usize) -> LocalDevices {
        LocalDevices::sequential(count, "crosshost-host")
    }

    #[test]
    fn stated_device_ids_and_kinds_travel_to_every_process() {
        let store = Arc::new(MemoryStore::new());
        let s2 = store.clone();
        let stated = |ids: Vec<i32>, kind: &str| LocalDevices {
            count: ids.len(),
            ids: Some(ids),
            kind: kind.to_string(),
        };
        let other = std::thread::spawn(move || {
            let devices = stated(vec![2048, 2049], "NVIDIA H200 (141 GB)");
            let control = |_: &str, _: Secret| {
                Ok(Some(ControlEndpoint {
                    unix_name: "pjrt-crosshost/test/1".into(),
                    tcp: "127.0.0.1:4242".parse().unwrap(),
                }))
            };
            Session::establish(
                &*s2,
                "ids",
                1,
                2,
                devices,
                "auto",
                Duration::from_secs(10),
                control,
            )
            .unwrap()
        });
        let devices = stated(vec![0, 1], "cpu");
        let first = Session::establish(
            &*store,
            "ids",
            0,
            2,
            devices,
            "auto",
            Duration::from_secs(10),
            no_control,
        )
        .unwrap();
        let second = other.join().unwrap();
        assert_eq!(first.processes, second.processes);
        assert_eq!(first.device_ids(), vec![vec![0, 1], vec![2048, 2049]]);
        assert_eq!(first.processes[1].device_kind, "NVIDIA H200 (141 GB)");
        assert_eq!(first.process_of_device(2049).unwrap().process_index, 1);
        assert!(first.process_of_device(2).is_none());
        assert_eq!(first.secret, second.secret);
        assert_eq!(first.processes[0].control, None);
        assert_eq!(
            first.processes[1].control.as_ref().unwrap().tcp,
            "127.0.0.1:4242".parse().unwrap()
        );
    }

    #[test]
    fn malformed_entries_are_data_loss() {
        for text in [
            "xs1 2 h b 1",
            "xs2 2 h b 1 - cpu",
            "xs3 2 h b 7 - - crosshost host",
            "xs4 2 h b 7 - - tcp crosshost host",
            "xs5 2 h b 1 0,1,2 - - auto cpu",
            "xs5 x h b 1 - - - auto cpu",
            "xs5 1 h b 1 a - - auto cpu",
            "xs5 1 h b 1 - unix=x - auto cpu",
            "xs5 1 h b 1 - - 10.0.0.1 auto cpu",
            "xs5 1 h b 1 - - 10.0.0.1:x auto cpu",
        ] {
            let err = ProcessEntry::decode(3, text.as_bytes()).unwrap_err();
            assert_eq!(err.code, crate::status::Code::DataLoss, "{text}");
        }
        let ok = ProcessEntry::decode(3, b"xs5 2 h b 7 - - - tcp crosshost host").unwrap();
        assert_eq!(ok.device_kind, "crosshost host");
        assert_eq!(ok.transport, "tcp");
        assert_eq!((ok.num_devices, ok.pid, ok.device_ids), (2, 7, None));
        assert_eq!(ok.tcp_data, None);
        let with_tcp = ProcessEntry::decode(3, b"xs5 1 h b 7 - - [::1]:4242 tcp cpu").unwrap();
        assert_eq!(with_tcp.tcp_data, Some("[::1]:4242".parse().unwrap()));
        assert_eq!(
            ProcessEntry::decode(3, with_tcp.encode().as_bytes()).unwrap(),
            with_tcp
        );
    }

    #[test]
    fn a_missing_peer_is_a_bounded_error() {
        let store = MemoryStore::new();
        let err = Session::establish(
            &store,
            "lonely",
            0,
            2,
            host(1),
            "auto",
            Duration::from_millis(20),
            no_control,
        )
        .unwrap_err();
        assert!(err.message.contains("process 1"), "{}", err.message);
    }

    #[test]
    fn processes_with_different_transports_are_refused_naming_both() {
        let store = Arc::new(MemoryStore::new());
        let s2 = store.clone();
        let other = std::thread::spawn(move || {
            Session::establish(
                &*s2,
                "mixed",
                1,
                2,
                host(1),
                "tcp",
                Duration::from_secs(10),
                no_control,
            )
        });
        let err = Session::establish(
            &*store,
            "mixed",
            0,
            2,
            host(1),
            "auto",
            Duration::from_secs(10),
            no_control,
        )
        .unwrap_err();
        assert_eq!(err.code, crate::status::Code::FailedPrecondition);
        assert!(
            err.message.contains("transport=tcp") && err.message.contains("transport=auto"),
            "{err}"
        );
        assert!(other.join().unwrap().is_err());
    }

    #[test]
    fn ucx_addresses_travel_to_every_process_and_reasons_otherwise() {
        let store = Arc::new(MemoryStore::new());
        let join = |index: i32, mine: std::result::Result<Vec<Vec<u8>>, String>| {
            let store = store.clone();
            std::thread::spawn(move || {
                let mut session = Session::establish(
                    &*store,
                    "ucx",
                    index,
                    3,
                    host(1),
                    "auto",
                    Duration::from_secs(10),
                    no_control,
                )
                .unwrap();
                let mine = match &mine {
                    Ok(addresses) => Ok(addresses.as_slice()),
                    Err(reason) => Err(reason.as_str()),
                };
                let without = session
                    .exchange_ucx(&*store, "ucx", mine, Duration::from_secs(10))
                    .unwrap();
                (session, without)
            })
        };
        let second = join(1, Ok(vec![vec![1, 2, 0xff], vec![3]]));
        let third = join(2, Err("no libucp\nat all".to_string()));
        let first = join(0, Ok(vec![vec![9]]));
        let (first, first_without) = first.join().unwrap();
        let (second, second_without) = second.join().unwrap();
        let (third, _) = third.join().unwrap();
        assert_eq!(first.ucx.get(&1), Some(&vec![vec![1, 2, 0xff], vec![3]]));
        assert_eq!(second.ucx.get(&0), Some(&vec![vec![9]]));
        assert_eq!(third.ucx.get(&1), first.ucx.get(&1));
        assert!(!second.ucx.contains_key(&2) && !second.ucx.contains_key(&1));
        let reason = vec![(2, "no libucp at all".to_string())];
        assert_eq!((first_without, second_without), (reason.clone(), reason));
        // Each process read one roster, not one key per peer.
        assert!(store
            .try_get(&(Session::ucx_roster_key("ucx", &first.epoch) + "/0"))
            .is_ok());
    }

    #[test]
    fn a_garbled_ucx_address_is_refused_and_the_others_are_told() {
        let store = Arc::new(MemoryStore::new());
        let other = {
            let store = store.clone();
            std::thread::spawn(move || {
                let session = Session::establish(
                    &*store,
                    "garbled",
                    1,
                    2,
                    host(1),
                    "auto",
                    Duration::from_secs(10),
                    no_control,
                )
                .unwrap();
                // Bypass the encoder: a peer (or forger) writing nonsense.
                let key = Session::ucx_key("garbled", &session.epoch, 1);
                store.set(&key, b"xu1 zz").unwrap();
                let roster = Session::ucx_roster_key("garbled", &session.epoch);
                roster::read(&*store, &roster, 2, Duration::from_secs(10), "t").unwrap_err()
            })
        };
        let mut first = Session::establish(
            &*store,
            "garbled",
            0,
            2,
            host(1),
            "auto",
            Duration::from_secs(10),
            no_control,
        )
        .unwrap();
        let err = first
            .exchange_ucx(&*store, "garbled", Ok(&[vec![9]]), Duration::from_secs(10))
            .unwrap_err();
        assert_eq!(err.code, crate::status::Code::DataLoss);
        let told = other.join().unwrap();
        assert_eq!(told.code, crate::status::Code::DataLoss, "{told}");
        assert!(told.message.contains("process 0 gave up"), "{told}");
    }

    #[test]
    fn each_process_but_the_first_reads_the_job_in_a_constant_number_of_calls() {
        use crate::kv::{Op, TestStore};
        let shared: Arc<dyn KeyValueStore> = Arc::new(MemoryStore::new());
        let count = 2 * roster::CHUNK_LINES + 3;
        let stores: Vec<Arc<TestStore>> = (0..count)
            .map(|_| Arc::new(TestStore::new(shared.clone())))
            .collect();
        let joins: Vec<_> = stores
            .iter()
            .enumerate()
            .map(|(i, store)| {
                let store = store.clone();
                std::thread::spawn(move || {
                    Session::establish(
                        &*store,
                        "big",
                        i as i32,
                        count,
                        host(1),
                        "auto",
                        Duration::from_secs(30),
                        no_control,
                    )
                    .unwrap()
                })
            })
            .collect();
        let sessions: Vec<Session> = joins.into_iter().map(|j| j.join().unwrap()).collect();
        assert!(sessions
            .iter()
            .all(|s| s.processes == sessions[0].processes));
        assert_eq!(sessions[0].processes.len(), count);
        for (i, store) in stores.iter().enumerate().skip(1) {
            // The epoch and the roster's first chunk; its other chunks are
            // read without waiting.
            assert_eq!(store.calls(Op::Get), 2, "process {i}");
            assert_eq!(store.calls(Op::TryGet), 2, "process {i}");
            assert_eq!(store.calls(Op::Set), 1, "process {i}");
        }
        assert_eq!(stores[0].calls(Op::Get), count - 1);
    }

    #[test]
    fn two_processes_with_one_index_are_told() {
        let store = Arc::new(MemoryStore::new());
        // Process 1's entry, written by another process claiming index 1.
        let impostor = {
            let store = store.clone();
            std::thread::spawn(move || {
                Session::establish(
                    &*store,
                    "twice",
                    0,
                    2,
                    host(1),
                    "auto",
                    Duration::from_secs(10),
                    no_control,
                )
            })
        };
        while store.try_get(&epoch_record::key("twice")).is_err() {
            std::thread::yield_now();
        }
        let (epoch, _) =
            epoch_record::await_fresh(&*store, "twice", Duration::from_secs(5)).unwrap();
        let mut entry = ProcessEntry::mine(1, host(1), "auto").unwrap();
        entry.pid += 1;
        store
            .set(
                &Session::entry_key("twice", &epoch, 1),
                entry.encode().as_bytes(),
            )
            .unwrap();
        impostor.join().unwrap().unwrap();
        // This process's own write lands after process 0 gathered: the
        // roster names the other pid.
        let err = Session::establish(
            &*store,
            "twice",
            1,
            2,
            host(1),
            "auto",
            Duration::from_secs(10),
            no_control,
        )
        .unwrap_err();
        assert_eq!(err.code, crate::status::Code::FailedPrecondition);
        assert!(err.message.contains("the same index"), "{err}");
    }

    #[test]
    fn every_waiting_process_hears_which_process_did_not_join() {
        let store = Arc::new(MemoryStore::new());
        let timeout = Duration::from_millis(300);
        let waiting = {
            let store = store.clone();
            std::thread::spawn(move || {
                Session::establish(&*store, "gap", 1, 3, host(1), "auto", timeout, no_control)
            })
        };
        let first = Session::establish(&*store, "gap", 0, 3, host(1), "auto", timeout, no_control)
            .unwrap_err();
        let second = waiting.join().unwrap().unwrap_err();
        for err in [&first, &second] {
            assert_eq!(err.code, crate::status::Code::DeadlineExceeded, "{err}");
            assert!(
                err.message.contains("waiting for process 2 to join"),
                "{err}"
            );
        }
        assert!(second.message.contains("process 0 gave up"), "{second}");
    }
}
