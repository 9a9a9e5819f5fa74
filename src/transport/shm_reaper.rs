//! Removing the shared-memory objects of processes that died without
//! unlinking them (SIGKILL, `_exit`, a fatal error raised by a framework).
//! Their names carry their owner (`shm_owner.rs`), so two things can find
//! them:
//!
//! - the reaper: `reap_dead_owners` scans `/dev/shm` for our prefix and
//!   unlinks every object whose owner is certainly gone (pid not running, a
//!   zombie, or the pid reused by a process with another start time). A
//!   live owner's objects, and those of owners it cannot judge (another pid
//!   namespace), are never touched. Each process runs it once, when its
//!   first client is created (`reap_dead_owners_once`);
//! - the watchdog: with its first object, a process starts a tiny helper
//!   (`/bin/sh`, ignoring the usual termination signals) that blocks reading
//!   a pipe only this process holds open. When this process ends, however
//!   it ends, the pipe closes and the helper unlinks every name with this
//!   process's owner prefix (with `find`, so no number of names planted
//!   under that prefix can exceed the argument limit), then exits. A
//!   keeper thread of this process waits, in poll(2), for the helper's end
//!   of the pipe to close: a helper that was killed is replaced at once.
//!   `PJRT_CROSSHOST_SHM_WATCHDOG=0` turns it off.
//!
//! What can remain after a death: nothing once the watchdog has run (a few
//! milliseconds). Without the watchdog (turned off, `/bin/sh` missing, or
//! killed together with the process, e.g. SIGKILL to the whole process
//! group or cgroup, or in the moment between a helper's death and its
//! replacement), the dead process's objects stay in `/dev/shm` until
//! the next process of this plugin creates a client on the host. Unlinking
//! frees the memory once no process maps it any more; a sender that mapped
//! a dead receiver's pooled segment drops its mapping at its next send to a
//! destination on this host (`transfer/service.rs`).
use std::ffi::OsStr;
use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Once;

use parking_lot::Mutex;

use super::shm_name::{shm_name_owner, shm_name_prefix_of, unlink_name, SHM_NAME_PREFIX};
use super::shm_owner::{OwnerState, ShmOwner};
use crate::status::Status;

/// Where POSIX shared-memory objects live on Linux (glibc and musl).
pub const SHM_DIR: &str = "/dev/shm";

/// Setting this to `0` keeps the watchdog from starting.
pub const WATCHDOG_ENV: &str = "PJRT_CROSSHOST_SHM_WATCHDOG";

/// What one scan did.
#[derive(Debug, Default)]
pub struct ReapReport {
    /// Names unlinked (their owner was gone).
    pub removed: Vec<String>,
    /// Our names left alone (owner alive or not judgeable).
    pub kept: usize,
    /// Names whose unlink failed (e.g. another user's object).
    pub failed: Vec<(String, Status)>,
}

/// Scans `/dev/shm` and unlinks the objects of dead owners (see the module
/// docs). Entries that are not our well-formed names are skipped.
pub fn reap_dead_owners() -> ReapReport {
    let mut report = ReapReport::default();
    let entries = match std::fs::read_dir(SHM_DIR) {
        Ok(entries) => entries,
        Err(e) => {
            log::debug!("shared-memory reaper: cannot list {SHM_DIR}: {e}");
            return report;
        }
    };
    let prefix = &SHM_NAME_PREFIX[1..];
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(file_name) = file_name.to_str() else {
            continue;
        };
        if !file_name.starts_with(prefix) {
            continue;
        }
        let name = format!("/{file_name}");
        let Ok(owner) = shm_name_owner(&name) else {
            continue;
        };
        if owner.state() != OwnerState::Gone {
            report.kept += 1;
            continue;
        }
        match unlink_name(&name) {
            Ok(()) => report.removed.push(name),
            // Another process reaped it first.
            Err(e) if e.code == crate::status::Code::NotFound => {}
            Err(e) => report.failed.push((name, e)),
        }
    }
    if !report.removed.is_empty() {
        log::info!(
            "removed {} shared-memory objects left by processes that died: {:?}",
            report.removed.len(),
            report.removed
        );
    }
    for (name, error) in &report.failed {
        log::warn!("could not remove {name}, left by a process that died: {error}");
    }
    report
}

/// `reap_dead_owners`, the first time it is called in this process.
pub fn reap_dead_owners_once() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        reap_dead_owners();
    });
}

struct Watchdog {
    /// The process that started it (a forked child starts its own).
    pid: u32,
    /// The helper and the write end of its pipe; `None` when it could not
    /// start or is turned off.
    running: Option<(Child, ChildStdin)>,
}

static WATCHDOG: Mutex<Option<Watchdog>> = Mutex::new(None);

/// Starts this process's watchdog for `owner`'s names unless it runs
/// already (see the module docs). Never fails: without a watchdog the
/// reaper still removes the objects at the next start.
pub fn ensure_watchdog(owner: &ShmOwner) {
    let pid = std::process::id();
    let mut watchdog = WATCHDOG.lock();
    if watchdog.as_ref().is_some_and(|w| w.pid == pid) {
        return;
    }
    // Inherited through fork: the pipe end is the parent's business (the
    // descriptor closes here, the parent keeps its own).
    let running = start_watchdog(owner);
    if running.is_some() {
        let owner = *owner;
        let kept = std::thread::Builder::new()
            .name("crosshost-shm-keeper".into())
            .spawn(move || keep_watchdog(owner));
        if let Err(e) = kept {
            log::warn!(
                "no keeper for the shared-memory watchdog ({e}): if it is killed, it stays dead"
            );
        }
    }
    *watchdog = Some(Watchdog { pid, running });
}

/// Replaces the watchdog whenever its end of the pipe closes (it was
/// killed) while this process lives. Blocks in poll(2), never spins.
fn keep_watchdog(owner: ShmOwner) {
    loop {
        let fd = {
            let watchdog = WATCHDOG.lock();
            match watchdog.as_ref().and_then(|w| w.running.as_ref()) {
                Some((_, stdin)) => stdin.as_raw_fd(),
                None => return,
            }
        };
        // No events asked for: poll returns when the read end closes
        // (POLLERR), which is the helper's death.
        let mut pollfd = libc::pollfd {
            fd,
            events: 0,
            revents: 0,
        };
        // SAFETY: one valid pollfd; `fd` stays open while the watchdog
        // entry holds its ChildStdin, which only this thread replaces.
        let ready = unsafe { libc::poll(&mut pollfd, 1, -1) };
        if ready < 0 {
            if std::io::Error::last_os_error().kind() == ErrorKind::Interrupted {
                continue;
            }
            log::warn!(
                "shared-memory watchdog keeper: poll failed ({}); it stops",
                std::io::Error::last_os_error()
            );
            return;
        }
        let mut watchdog = WATCHDOG.lock();
        let Some(entry) = watchdog.as_mut() else {
            return;
        };
        if let Some((mut child, _)) = entry.running.take() {
            let status = child.wait();
            log::warn!(
                "the shared-memory watchdog {} of this process ended ({status:?}) while the \
                 process lives; starting another",
                child.id()
            );
        }
        entry.running = start_watchdog(&owner);
        if entry.running.is_none() {
            return;
        }
    }
}

/// The watchdog's process id, if one runs for this process (for tests).
pub fn watchdog_pid() -> Option<u32> {
    let watchdog = WATCHDOG.lock();
    watchdog
        .as_ref()
        .filter(|w| w.pid == std::process::id())
        .and_then(|w| w.running.as_ref())
        .map(|(child, _)| child.id())
}

fn start_watchdog(owner: &ShmOwner) -> Option<(Child, ChildStdin)> {
    if std::env::var_os(WATCHDOG_ENV).as_deref() == Some(OsStr::from_bytes(b"0")) {
        log::debug!("shared-memory watchdog turned off by {WATCHDOG_ENV}=0");
        return None;
    }
    // Only digits and dashes follow the fixed prefix: nothing to quote.
    let pattern = format!("{SHM_DIR}{}*", shm_name_prefix_of(owner));
    let dir = SHM_DIR;
    let name = format!("{}*", &shm_name_prefix_of(owner)[1..]);
    // `find` takes any number of names; `rm` with the glob as arguments
    // would fail outright past the argument limit (names can be planted).
    let script = format!(
        "trap '' HUP INT QUIT TERM PIPE USR1 USR2\n\
         while read -r _; do :; done\n\
         if command -v find >/dev/null 2>&1; then\n\
           exec find {dir} -maxdepth 1 -name '{name}' -delete\n\
         fi\n\
         for f in {pattern}; do rm -f -- \"$f\"; done\n"
    );
    let mut command = Command::new("/bin/sh");
    command
        .arg("-c")
        .arg(script)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // Nothing but its pipe crosses into the watchdog: UCX opens its
    // listeners and connections without close-on-exec, and a watchdog that
    // held them would keep a killed process's connections open until it
    // exits. Its stdio is in place by the time this runs.
    let limit = crate::transport::fd_limit::current().map_or(65_536, |(soft, _)| soft.min(1 << 20));
    // SAFETY: between fork and exec the hook makes only async-signal-safe
    // system calls (close_range, fcntl) on descriptors of the child's own.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, move || {
            close_on_exec_from(3, limit);
            Ok(())
        })
    };
    let spawned = command.spawn();
    match spawned {
        Ok(mut child) => {
            let stdin = child.stdin.take().expect("stdin was piped");
            log::debug!(
                "shared-memory watchdog {} removes {pattern} when this process ends",
                child.id()
            );
            Some((child, stdin))
        }
        Err(e) => {
            let level = if e.kind() == ErrorKind::NotFound {
                log::Level::Debug
            } else {
                log::Level::Warn
            };
            log::log!(
                level,
                "no shared-memory watchdog ({e}): if this process dies, its shared memory \
                 stays until the next client starts on this host"
            );
            None
        }
    }
}

/// Marks every descriptor from `first` up close-on-exec: one close_range
/// (Linux 5.11 and later), else one fcntl per descriptor below `limit`.
/// Async-signal-safe: it runs between fork and exec.
fn close_on_exec_from(first: u32, limit: u64) {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: close_range only changes flags of this process's descriptors.
    let done =
        unsafe { libc::syscall(libc::SYS_close_range, first, u32::MAX, CLOSE_RANGE_CLOEXEC) } == 0;
    if done {
        return;
    }
    for fd in first as u64..limit {
        // SAFETY: fcntl on a descriptor number; a closed one answers EBADF.
        unsafe { libc::fcntl(fd as libc::c_int, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
}

#[cfg(test)]
mod tests;
