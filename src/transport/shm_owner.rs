//! `ShmOwner`: which process created a shared-memory object, and whether it
//! is still there. Every name `SharedRegion::create` makes carries its
//! creator's tag (`shm.rs`), so a process can tell the objects of a dead
//! process from those of a live one: the reaper (`shm_reaper.rs`) unlinks
//! the former, and a sender refuses to report a write into a dead
//! receiver's memory as delivered.
//!
//! A pid alone is not an identity: pids are reused. The tag is the pid, the
//! process's start time (field 22 of `/proc/<pid>/stat`, clock ticks after
//! boot) and its pid namespace (the inode of `/proc/self/ns/pid`): two
//! processes sharing `/dev/shm` from different pid namespaces (containers of
//! one pod) cannot judge each other's pids, so such owners are `Unknown` and
//! never treated as gone.
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::status::{self, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShmOwner {
    /// Inode of the creator's pid namespace.
    pub pid_namespace: u64,
    pub pid: u32,
    /// Start time of the creator (clock ticks after boot).
    pub start_time: u64,
}

/// What `ShmOwner::state` can tell about an owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnerState {
    Alive,
    /// Certainly gone: no such pid, a zombie, or the pid now belongs to a
    /// process that started at another time.
    Gone,
    /// Cannot be judged (another pid namespace, `/proc` unreadable): treat
    /// as alive.
    Unknown,
}

/// The parts of `/proc/<pid>/stat` the tag needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcStat {
    pub pid: u32,
    /// Field 3: `R`, `S`, `Z` (zombie), `X` (dead), ...
    pub state: char,
    /// Field 22.
    pub start_time: u64,
}

/// Parses a `/proc/<pid>/stat` line. The command name (field 2) is in
/// parentheses and may itself contain spaces and parentheses, so fields are
/// counted from the last `)`.
pub fn parse_proc_stat(text: &str) -> Option<ProcStat> {
    let open = text.find(" (")?;
    let close = text.rfind(')')?;
    let pid = text[..open].trim().parse().ok()?;
    let mut rest = text.get(close + 1..)?.split_ascii_whitespace();
    let state_field = rest.next()?;
    let mut state_chars = state_field.chars();
    let state = state_chars.next()?;
    if state_chars.next().is_some() {
        return None;
    }
    // Fields 4..=21 lie between the state and the start time.
    let start_time = rest.nth(18)?.parse().ok()?;
    Some(ProcStat {
        pid,
        state,
        start_time,
    })
}

/// `/proc/<pid>/stat` of `pid`; `Ok(None)` when there is no such process.
pub fn read_proc_stat(pid: u32) -> io::Result<Option<ProcStat>> {
    read_stat_file(&format!("/proc/{pid}/stat"))
}

fn read_stat_file(path: &str) -> io::Result<Option<ProcStat>> {
    match std::fs::read_to_string(path) {
        Ok(text) => parse_proc_stat(&text).map(Some).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidData, format!("unparsable {path}"))
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH) => {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

fn current_pid_namespace() -> io::Result<u64> {
    Ok(std::fs::metadata("/proc/self/ns/pid")?.ino())
}

impl ShmOwner {
    /// This process's tag, read from `/proc` once per process (a forked
    /// child reads its own).
    pub fn current() -> Result<ShmOwner> {
        static CURRENT: Mutex<Option<(u32, ShmOwner)>> = Mutex::new(None);
        let pid = std::process::id();
        let mut current = CURRENT.lock();
        if let Some((cached_pid, owner)) = *current {
            if cached_pid == pid {
                return Ok(owner);
            }
        }
        let unreadable = |e: io::Error| {
            status::internal(format!(
                "cannot read this process's identity from /proc (needed to name shared memory): {e}"
            ))
        };
        let stat = read_stat_file("/proc/self/stat")
            .map_err(unreadable)?
            .ok_or_else(|| unreadable(io::ErrorKind::NotFound.into()))?;
        let owner = ShmOwner {
            pid_namespace: current_pid_namespace().map_err(unreadable)?,
            // As /proc numbers it, which is how other processes will look
            // it up.
            pid: stat.pid,
            start_time: stat.start_time,
        };
        *current = Some((pid, owner));
        Ok(owner)
    }

    /// Whether the owner still runs. Only `Gone` is a certainty.
    pub fn state(&self) -> OwnerState {
        match ShmOwner::current() {
            Ok(me) if me == *self => return OwnerState::Alive,
            Ok(me) if me.pid_namespace == self.pid_namespace => {}
            _ => return OwnerState::Unknown,
        }
        match read_proc_stat(self.pid) {
            Ok(None) => OwnerState::Gone,
            Ok(Some(stat)) if stat.start_time != self.start_time => OwnerState::Gone,
            Ok(Some(stat)) if matches!(stat.state, 'Z' | 'X' | 'x') => OwnerState::Gone,
            Ok(Some(_)) => OwnerState::Alive,
            Err(e) => {
                log::debug!("cannot tell whether process {} runs: {e}", self.pid);
                OwnerState::Unknown
            }
        }
    }

    pub fn is_gone(&self) -> bool {
        self.state() == OwnerState::Gone
    }
}

/// A cheap, repeatable liveness check of one owner, for senders that ask on
/// every transfer: a pidfd (`pidfd_open(2)`, readable once the process has
/// exited) where the kernel has them, else a read of `/proc/<pid>/stat`.
pub struct OwnerWatch {
    owner: ShmOwner,
    pidfd: Option<OwnedFd>,
    gone: AtomicBool,
}

impl OwnerWatch {
    pub fn new(owner: ShmOwner) -> OwnerWatch {
        let same_namespace =
            ShmOwner::current().is_ok_and(|me| me.pid_namespace == owner.pid_namespace);
        let (pidfd, gone) = if same_namespace {
            // SAFETY: plain syscall; a returned descriptor is ours to own.
            let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, owner.pid as libc::pid_t, 0) };
            if raw >= 0 {
                // SAFETY: `raw` is a fresh descriptor nothing else owns.
                let pidfd = unsafe { OwnedFd::from_raw_fd(raw as libc::c_int) };
                // The pid may have been reused before the pidfd was opened:
                // the start time, read after, says whether it is the owner.
                (Some(pidfd), owner.is_gone())
            } else {
                let no_such_process =
                    io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
                // No pidfds here (old kernel, seccomp): `/proc` each time.
                (None, no_such_process)
            }
        } else {
            (None, false)
        };
        OwnerWatch {
            owner,
            pidfd,
            gone: AtomicBool::new(gone),
        }
    }

    pub fn owner(&self) -> ShmOwner {
        self.owner
    }

    /// True once the owner is certainly gone (then forever).
    pub fn is_gone(&self) -> bool {
        if self.gone.load(Ordering::Acquire) {
            return true;
        }
        let gone = match &self.pidfd {
            Some(fd) => {
                let mut poll = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, no waiting.
                let ready = unsafe { libc::poll(&mut poll, 1, 0) };
                ready > 0 && poll.revents != 0
            }
            None => self.owner.is_gone(),
        };
        if gone {
            self.gone.store(true, Ordering::Release);
        }
        gone
    }
}

impl std::fmt::Debug for OwnerWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnerWatch")
            .field("owner", &self.owner)
            .field("pidfd", &self.pidfd.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests;
