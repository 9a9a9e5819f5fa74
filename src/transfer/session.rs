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
use std::time::Duration;

use crate::kv::KeyValueStore;
use crate::status::{self, Result};
use crate::transport::control::{ControlEndpoint, Secret};
use crate::transport::host_identity::HostIdentity;
use crate::transport::random::random_u64;

/// The most devices a peer's session entry may state (XLA numbers a
/// process's devices below 2048 apart; twice that is generous).
pub const MAX_DEVICES_PER_PROCESS: usize = 4096;

/// The longest UCX worker address a peer may state (a few hundred bytes
/// per network device; generous for many).
pub const MAX_UCX_ADDRESS_LEN: usize = 64 << 10;
/// The most UCX workers a peer may state.
pub const MAX_UCX_WORKERS: usize = 64;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

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
        format!("crosshost/session/{name}/{epoch}/process/{index}")
    }

    /// Agrees on the epoch and exchanges process entries with the other
    /// `num_processes - 1` processes, waiting at most `timeout` for each.
    /// `control` starts this process's control links (and TCP receive
    /// server) once the job's secret is known and returns where peers reach
    /// them (`Reachable`, or just the control endpoint or `None`).
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
        let epoch_key = format!("crosshost/session/{name}/epoch");
        let (epoch, secret) = if process_index == 0 {
            let epoch = format!("{:016x}", random_u64()?);
            let secret = Secret::generate()?;
            store.set(
                &epoch_key,
                format!("{epoch} {}", secret.to_hex()).as_bytes(),
            )?;
            (epoch, secret)
        } else {
            let bytes = store.get(&epoch_key, timeout).map_err(|e| {
                status::Status::new(
                    e.code,
                    format!(
                        "waiting for process 0 to publish session {name:?}: {}",
                        e.message
                    ),
                )
            })?;
            let bad = || status::data_loss(format!("session {name:?}: malformed epoch record"));
            let text = String::from_utf8(bytes).map_err(|_| bad())?;
            let (epoch, secret) = text.split_once(' ').ok_or_else(bad)?;
            (epoch.to_string(), Secret::from_hex(secret).ok_or_else(bad)?)
        };
        let mut me = ProcessEntry::mine(process_index, devices, transport)?;
        let reachable: Reachable = control(&epoch, secret)?.into();
        me.control = reachable.control;
        me.tcp_data = reachable.tcp_data;
        let entry_key = |i: usize| Session::entry_key(name, &epoch, i);
        store.set(&entry_key(process_index as usize), me.encode().as_bytes())?;
        let mut processes = Vec::with_capacity(num_processes);
        for i in 0..num_processes {
            if i == process_index as usize {
                processes.push(me.clone());
                continue;
            }
            let bytes = store.get(&entry_key(i), timeout).map_err(|e| {
                status::Status::new(
                    e.code,
                    format!(
                        "waiting for process {i} to join session {name:?}: {}",
                        e.message
                    ),
                )
            })?;
            let entry = ProcessEntry::decode(i as i32, &bytes)?;
            if entry.transport != transport {
                return Err(status::failed_precondition(format!(
                    "session {name:?}: process {i} uses transport={} and this process (process \
                     {process_index}) transport={transport}: every process of a job needs the same \
                     transport",
                    entry.transport
                )));
            }
            processes.push(entry);
        }
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

    /// Publishes this process's UCX worker addresses (or, `Err`, why it has
    /// none) and reads those of `peers`, waiting at most `timeout` for each.
    /// Peers without any are left out of `ucx`; their reasons come back.
    pub fn exchange_ucx(
        &mut self,
        store: &dyn KeyValueStore,
        name: &str,
        mine: std::result::Result<&[Vec<u8>], &str>,
        peers: &[i32],
        timeout: Duration,
    ) -> Result<Vec<(i32, String)>> {
        let value = match mine {
            Ok(addresses) => {
                let list: Vec<String> = addresses.iter().map(|a| hex(a)).collect();
                format!("xu1 {}", list.join(","))
            }
            Err(reason) => format!("xu1 - {}", reason.replace('\n', " ")),
        };
        store.set(
            &Session::ucx_key(name, &self.epoch, self.process_index),
            value.as_bytes(),
        )?;
        let mut without = Vec::new();
        for &peer in peers {
            let bytes = store
                .get(&Session::ucx_key(name, &self.epoch, peer), timeout)
                .map_err(|e| {
                    status::Status::new(
                        e.code,
                        format!(
                            "waiting for process {peer} of session {name:?} to state its UCX address: {}",
                            e.message
                        ),
                    )
                })?;
            let bad = || {
                status::data_loss(format!(
                    "session {name:?}: process {peer}'s UCX address is malformed"
                ))
            };
            let text = String::from_utf8(bytes).map_err(|_| bad())?;
            match text.strip_prefix("xu1 ").ok_or_else(bad)? {
                reason if reason.starts_with("- ") => {
                    without.push((peer, reason[2..].to_string()));
                }
                list => {
                    let addresses = list
                        .split(',')
                        .map(|text| unhex(text).filter(|a| !a.is_empty()).ok_or_else(bad))
                        .collect::<Result<Vec<Vec<u8>>>>()?;
                    let total: usize = addresses.iter().map(Vec::len).sum();
                    if addresses.len() > MAX_UCX_WORKERS || total > MAX_UCX_ADDRESS_LEN {
                        return Err(bad());
                    }
                    self.ucx.insert(peer, addresses);
                }
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
    fn ucx_addresses_travel_between_the_peers_that_need_them_and_reasons_otherwise() {
        let store = Arc::new(MemoryStore::new());
        let s2 = store.clone();
        let other = std::thread::spawn(move || {
            let mut session = Session::establish(
                &*s2,
                "ucx",
                1,
                3,
                host(1),
                "auto",
                Duration::from_secs(10),
                no_control,
            )
            .unwrap();
            let without = session
                .exchange_ucx(
                    &*s2,
                    "ucx",
                    Ok(&[vec![1, 2, 0xff], vec![3]]),
                    &[0, 2],
                    Duration::from_secs(10),
                )
                .unwrap();
            (session, without)
        });
        let third = {
            let store = store.clone();
            std::thread::spawn(move || {
                let mut session = Session::establish(
                    &*store,
                    "ucx",
                    2,
                    3,
                    host(1),
                    "auto",
                    Duration::from_secs(10),
                    no_control,
                )
                .unwrap();
                session
                    .exchange_ucx(
                        &*store,
                        "ucx",
                        Err("no libucp"),
                        &[1],
                        Duration::from_secs(10),
                    )
                    .unwrap();
            })
        };
        let mut first = Session::establish(
            &*store,
            "ucx",
            0,
            3,
            host(1),
            "auto",
            Duration::from_secs(10),
            no_control,
        )
        .unwrap();
        let without = first
            .exchange_ucx(
                &*store,
                "ucx",
                Ok(&[vec![9]]),
                &[1],
                Duration::from_secs(10),
            )
            .unwrap();
        assert!(without.is_empty());
        assert_eq!(first.ucx.get(&1), Some(&vec![vec![1, 2, 0xff], vec![3]]));
        let (second, reasons) = other.join().unwrap();
        third.join().unwrap();
        assert_eq!(second.ucx.get(&0), Some(&vec![vec![9]]));
        assert!(!second.ucx.contains_key(&2));
        assert_eq!(reasons, vec![(2, "no libucp".to_string())]);
        // A garbled address is refused, not half-read.
        store
            .set(&Session::ucx_key("ucx", &first.epoch, 1), b"xu1 zz")
            .unwrap();
        let err = first
            .exchange_ucx(&*store, "ucx", Ok(&[vec![9]]), &[1], Duration::from_secs(1))
            .unwrap_err();
        assert_eq!(err.code, crate::status::Code::DataLoss);
    }
}
