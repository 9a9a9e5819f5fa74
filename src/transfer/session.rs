//! The job's session: a random epoch agreed by every process at client
//! creation, and the process table (devices per process, host identity)
//! exchanged through the store. Global device ids are assigned in process
//! order, so every process derives the same ids.
//!
//! Keys (under the caller's session name):
//! - `crosshost/session/<name>/epoch`: written by process 0;
//! - `crosshost/session/<name>/<epoch>/process/<i>`: each process's entry.
//!
//! A store shared by several jobs must give each job its own session name
//! (JAX's coordination service is per job, so under JAX this holds).
use std::time::Duration;

use crate::kv::KeyValueStore;
use crate::status::{self, Result};
use crate::transport::host_identity::HostIdentity;
use crate::transport::random::random_u64;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessEntry {
    pub process_index: i32,
    pub num_devices: usize,
    pub host: HostIdentity,
    pub pid: u32,
}

impl ProcessEntry {
    fn encode(&self) -> String {
        format!(
            "xs1 {} {} {} {}",
            self.num_devices, self.host.hostname, self.host.boot_id, self.pid
        )
    }

    fn decode(process_index: i32, bytes: &[u8]) -> Result<ProcessEntry> {
        let bad = || {
            status::data_loss(format!(
                "session entry of process {process_index} is malformed: {:?}",
                String::from_utf8_lossy(bytes)
            ))
        };
        let text = std::str::from_utf8(bytes).map_err(|_| bad())?;
        let parts: Vec<&str> = text.split(' ').collect();
        let ["xs1", devices, hostname, boot_id, pid] = parts[..] else {
            return Err(bad());
        };
        Ok(ProcessEntry {
            process_index,
            num_devices: devices.parse().map_err(|_| bad())?,
            host: HostIdentity {
                hostname: hostname.to_string(),
                boot_id: boot_id.to_string(),
            },
            pid: pid.parse().map_err(|_| bad())?,
        })
    }
}

#[derive(Clone, Debug)]
pub struct Session {
    /// Random id shared by all processes of this job: the temporal identity
    /// at the front of every key name.
    pub epoch: String,
    pub process_index: i32,
    /// Every process of the job, ordered by process index.
    pub processes: Vec<ProcessEntry>,
}

impl Session {
    /// A single-process session: nothing to agree on.
    pub fn local(num_devices: usize) -> Result<Session> {
        Ok(Session {
            epoch: format!("{:016x}", random_u64()?),
            process_index: 0,
            processes: vec![ProcessEntry {
                process_index: 0,
                num_devices,
                host: HostIdentity::local()?,
                pid: std::process::id(),
            }],
        })
    }

    /// Agrees on the epoch and exchanges process entries with the other
    /// `num_processes - 1` processes, waiting at most `timeout` for each.
    pub fn establish(
        store: &dyn KeyValueStore,
        name: &str,
        process_index: i32,
        num_processes: usize,
        num_devices: usize,
        timeout: Duration,
    ) -> Result<Session> {
        let epoch_key = format!("crosshost/session/{name}/epoch");
        let epoch = if process_index == 0 {
            let epoch = format!("{:016x}", random_u64()?);
            store.set(&epoch_key, epoch.as_bytes())?;
            epoch
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
            String::from_utf8(bytes)
                .map_err(|_| status::data_loss(format!("session {name:?}: epoch is not UTF-8")))?
        };
        let me = ProcessEntry {
            process_index,
            num_devices,
            host: HostIdentity::local()?,
            pid: std::process::id(),
        };
        let entry_key = |i: usize| format!("crosshost/session/{name}/{epoch}/process/{i}");
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
            processes.push(ProcessEntry::decode(i as i32, &bytes)?);
        }
        Ok(Session {
            epoch,
            process_index,
            processes,
        })
    }

    /// Global id of the first device of each process.
    pub fn first_global_ids(&self) -> Vec<i32> {
        let mut next = 0i32;
        self.processes
            .iter()
            .map(|p| {
                let first = next;
                next += p.num_devices as i32;
                first
            })
            .collect()
    }

    /// The process owning a global device id.
    pub fn process_of_device(&self, global_id: i32) -> Option<&ProcessEntry> {
        let firsts = self.first_global_ids();
        self.processes
            .iter()
            .zip(firsts)
            .find(|(p, first)| global_id >= *first && global_id < first + p.num_devices as i32)
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
            Session::establish(&*s2, "job", 1, 2, 3, Duration::from_secs(10)).unwrap()
        });
        let first = Session::establish(&*store, "job", 0, 2, 2, Duration::from_secs(10)).unwrap();
        let second = other.join().unwrap();
        assert_eq!(first.epoch, second.epoch);
        assert_eq!(first.processes, second.processes);
        assert_eq!(first.first_global_ids(), vec![0, 2]);
        assert_eq!(first.process_of_device(4).unwrap().process_index, 1);
        assert!(first.process_of_device(5).is_none());
    }

    #[test]
    fn a_missing_peer_is_a_bounded_error() {
        let store = MemoryStore::new();
        let err =
            Session::establish(&store, "lonely", 0, 2, 1, Duration::from_millis(20)).unwrap_err();
        assert!(err.message.contains("process 1"), "{}", err.message);
    }
}
