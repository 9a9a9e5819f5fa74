//! `MemoryBudget`: a bound on the bytes one side of a client holds at once.
//!
//! Two bounds, one mechanism:
//! - received buffers (create option `max_receive_bytes`). A receive's size
//!   comes from the caller (or, through JAX, from a peer's array), and
//!   without a bound a 20 GiB receive on a 24 GiB machine is granted,
//!   faulted in for a minute and ends with the OOM killer;
//! - sends not yet delivered (`max_pending_send_bytes`). Each send holds its
//!   source until its receiver takes the bytes; a receiver that stops
//!   receiving (dead, stuck, never called) while the program keeps sending
//!   held 21.9 GiB of 1 MiB sends before anything failed.
//!
//! A transfer reserves its bytes before anything is allocated or started;
//! the reservation lives as long as the memory (the received buffer, the
//! send's outcome), and a transfer that would pass the bound fails at once
//! with RESOURCE_EXHAUSTED, naming its size, the bound and its option.
//!
//! The defaults are fractions of the memory this process may use: the
//! machine's, or its cgroup's limit where that is lower (in a container a
//! fraction of the host's memory bounds nothing).
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::status::{self, Result};

/// Half of the memory this process may use: room for the process's own
/// data beside what it receives.
pub fn default_max_receive_bytes() -> u64 {
    usable_memory_bytes() / 2
}

/// A quarter of the memory this process may use: with the receive bound's
/// half, a quarter stays for the program itself. A sender needs little: a
/// live receiver takes each send within milliseconds, so only a receiver
/// that stopped lets sends pile up.
pub fn default_max_pending_send_bytes() -> u64 {
    usable_memory_bytes() / 4
}

/// The machine's memory, or its cgroup's limit where lower (32 GiB when
/// neither can be read).
pub fn usable_memory_bytes() -> u64 {
    let machine = physical_memory_bytes();
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|cgroups| cgroup_memory_limit(&cgroups, Path::new("/sys/fs/cgroup")));
    machine.into_iter().chain(cgroup).min().unwrap_or(32 << 30)
}

fn physical_memory_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The lowest memory limit on the way from this process's cgroup to the
/// root, under `root` (normally `/sys/fs/cgroup`), for cgroup v2
/// (`memory.max`, "max" when unlimited) and v1 (`memory.limit_in_bytes`,
/// a huge number when unlimited). `cgroups` is `/proc/self/cgroup`. In a
/// container whose cgroup namespace makes its own cgroup "/", the limit is
/// the root's file.
fn cgroup_memory_limit(cgroups: &str, root: &Path) -> Option<u64> {
    let mut lowest: Option<u64> = None;
    let mut consider = |file: std::path::PathBuf| {
        let Ok(text) = std::fs::read_to_string(file) else {
            return;
        };
        // v1 writes "unlimited" as the largest page-aligned i64.
        if let Ok(limit) = text.trim().parse::<u64>() {
            if limit < (1 << 62) {
                lowest = Some(lowest.map_or(limit, |l| l.min(limit)));
            }
        }
    };
    for line in cgroups.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let (base, file) = if controllers.is_empty() {
            (root.to_path_buf(), "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            (root.join("memory"), "memory.limit_in_bytes")
        } else {
            continue;
        };
        // The cgroup itself and each parent: a limit set above applies too.
        let mut dir = base.clone();
        consider(dir.join(file));
        for part in path.split('/').filter(|p| !p.is_empty() && *p != "..") {
            dir.push(part);
            consider(dir.join(file));
        }
    }
    lowest
}

/// Which of a client's bounds a budget is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// `max_receive_bytes`: received buffers held at once.
    Receive,
    /// `max_pending_send_bytes`: sends not yet delivered.
    PendingSend,
}

impl Bound {
    pub fn option(self) -> &'static str {
        match self {
            Bound::Receive => "max_receive_bytes",
            Bound::PendingSend => "max_pending_send_bytes",
        }
    }

    fn what(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Bound::Receive => ("receive", "received buffers", "free received buffers"),
            Bound::PendingSend => (
                "send",
                "sends not yet delivered",
                "wait for earlier sends to complete (is their receiver still receiving?)",
            ),
        }
    }
}

#[derive(Debug)]
pub struct MemoryBudget {
    bound: Bound,
    limit: u64,
    live: AtomicU64,
}

/// Bytes reserved for one transfer, given back when dropped.
#[derive(Debug)]
pub struct BudgetLease {
    budget: Arc<MemoryBudget>,
    bytes: u64,
}

impl Drop for BudgetLease {
    fn drop(&mut self) {
        self.budget.live.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl MemoryBudget {
    pub fn new(bound: Bound, limit: u64) -> Arc<MemoryBudget> {
        Arc::new(MemoryBudget {
            bound,
            limit,
            live: AtomicU64::new(0),
        })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes reserved now.
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Acquire)
    }

    /// Reserves `bytes`, or RESOURCE_EXHAUSTED when the live total would
    /// pass the bound.
    pub fn reserve(self: &Arc<Self>, bytes: u64, what: &str) -> Result<BudgetLease> {
        let mut live = self.live.load(Ordering::Acquire);
        loop {
            let total = live.saturating_add(bytes);
            if total > self.limit {
                let (transfer, held, remedy) = self.bound.what();
                let option = self.bound.option();
                return Err(status::resource_exhausted(format!(
                    "{what}: a {bytes}-byte {transfer} would bring this client's {held} to \
                     {total} bytes, above {option} = {} ({live} bytes held now; raise the \
                     create option {option} or {remedy})",
                    self.limit
                )));
            }
            match self
                .live
                .compare_exchange_weak(live, total, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    return Ok(BudgetLease {
                        budget: self.clone(),
                        bytes,
                    })
                }
                Err(now) => live = now,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Code;

    #[test]
    fn reservations_are_bounded_and_given_back_when_dropped() {
        let budget = MemoryBudget::new(Bound::Receive, 100);
        let a = budget.reserve(60, "receive").unwrap();
        let error = budget.reserve(41, "receive").unwrap_err();
        assert_eq!(error.code, Code::ResourceExhausted);
        assert!(
            error.message.contains("41-byte") && error.message.contains("max_receive_bytes = 100"),
            "{error}"
        );
        let b = budget.reserve(40, "receive").unwrap();
        assert_eq!(budget.live(), 100);
        drop(a);
        assert_eq!(budget.live(), 40);
        assert!(budget.reserve(u64::MAX, "receive").is_err());
        drop(b);
        assert_eq!(budget.live(), 0);
    }

    #[test]
    fn a_pending_send_bound_names_its_option() {
        let budget = MemoryBudget::new(Bound::PendingSend, 10);
        let error = budget.reserve(11, "send to device 1").unwrap_err();
        assert_eq!(error.code, Code::ResourceExhausted);
        assert!(
            error.message.contains("max_pending_send_bytes = 10")
                && error.message.contains("11-byte send"),
            "{error}"
        );
    }

    #[test]
    fn the_defaults_are_fractions_of_the_usable_memory() {
        let machine = physical_memory_bytes().expect("/proc/meminfo on Linux");
        let usable = usable_memory_bytes();
        assert!(
            usable <= machine && usable > 1 << 26,
            "{usable} of {machine}"
        );
        assert_eq!(default_max_receive_bytes(), usable / 2);
        assert_eq!(default_max_pending_send_bytes(), usable / 4);
    }

    fn write(dir: &Path, rel: &str, text: &str) {
        let file = dir.join(rel);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(file, text).unwrap();
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("crosshost-cgroup-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_cgroup_v2_limit_on_the_group_or_a_parent_is_found() {
        let root = scratch("v2");
        write(&root, "memory.max", "max\n");
        write(&root, "job/memory.max", "4294967296\n");
        write(&root, "job/step/memory.max", "max\n");
        let cgroups = "0::/job/step\n";
        assert_eq!(cgroup_memory_limit(cgroups, &root), Some(4 << 30));
        write(&root, "job/step/memory.max", "1073741824\n");
        assert_eq!(cgroup_memory_limit(cgroups, &root), Some(1 << 30));
        // A container's own namespace: its group is "/", the limit is the root's.
        write(&root, "memory.max", "536870912\n");
        assert_eq!(cgroup_memory_limit("0::/\n", &root), Some(512 << 20));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_cgroup_v1_memory_limit_is_found_and_unlimited_is_none() {
        let root = scratch("v1");
        let unlimited = "9223372036854771712\n";
        write(&root, "memory/memory.limit_in_bytes", unlimited);
        write(&root, "memory/a/b/memory.limit_in_bytes", unlimited);
        write(&root, "memory/a/memory.limit_in_bytes", unlimited);
        let cgroups = "12:cpu,cpuacct:/x\n4:memory:/a/b\n0::/\n";
        assert_eq!(cgroup_memory_limit(cgroups, &root), None);
        write(&root, "memory/a/memory.limit_in_bytes", "2147483648\n");
        assert_eq!(cgroup_memory_limit(cgroups, &root), Some(2 << 30));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
