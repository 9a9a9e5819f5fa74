//! Starting the plugin's threads that carry transfers between hosts with a
//! short time slice (the others start as any Rust thread does).
//!
//! The threads that carry transfers between hosts (UCX progress threads,
//! the TCP transport's, control links over TCP) wake for a few microseconds
//! of work on a transfer's path and sleep again. Linux's EEVDF scheduler
//! (6.6 and newer) lets a woken thread preempt the running one only when it
//! asks for a shorter slice (`sched_setattr` with `sched_runtime`, honoured
//! since 6.12); at the default slice (0.7 ms times the log of the CPU count)
//! a wake-up can wait that long behind a thread that computes, as XLA's do.
//! Across the two-host bed, a 4 KiB transfer's part in the plugin dropped
//! from 244-356 µs to 192-223 µs (p50) with every thread hinted, and from
//! 623-790 µs to 388-666 µs on a noisier afternoon with only these
//! (docs/across-hosts.md, "Wake-ups").
//!
//! Threads on one host's paths keep the kernel's slice: there the hint cut
//! 64 x 1 MiB from 7.6-9.2 GB/s to 5.9-7.6 GB/s, each completion's threads
//! preempting the copies instead of taking their receipts in bursts.
//!
//! The hint keeps the thread's policy and nice value, and leaves alone a
//! thread whose host made it real-time, deadline or idle. Older kernels
//! accept and ignore it; a kernel or sandbox that refuses it costs nothing
//! but a line in the debug log. `PJRT_CROSSHOST_THREAD_SLICE_US` sets the
//! short slice (100-100000; `0`: no hint, the kernel's slice everywhere).

use std::io;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use once_cell::sync::Lazy;

/// The environment variable that sets (or, with `0`, turns off) the slice.
const SLICE_ENV: &str = "PJRT_CROSSHOST_THREAD_SLICE_US";

/// The slice asked for when the environment says nothing: the shortest the
/// kernel grants.
const DEFAULT_SLICE: Duration = Duration::from_micros(100);

/// The range the kernel clamps a requested slice to.
const SLICE_RANGE_US: (u64, u64) = (100, 100_000);

static REQUESTED: Lazy<Option<Duration>> =
    Lazy::new(|| requested_slice(std::env::var(SLICE_ENV).ok().as_deref()));

/// The time slice a thread of the plugin runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slice {
    /// The short slice: a thread that carries transfers between hosts.
    Short,
    /// The kernel's slice.
    Kernel,
}

impl Slice {
    /// `Short` for a thread that serves a peer on another host.
    pub fn serving(same_host: bool) -> Slice {
        if same_host {
            Slice::Kernel
        } else {
            Slice::Short
        }
    }
}

/// Starts a named thread of the plugin with `slice`.
pub fn spawn<F, T>(name: impl Into<String>, slice: Slice, body: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    thread::Builder::new().name(name.into()).spawn(move || {
        if slice == Slice::Short {
            ask_short_slice();
        }
        body()
    })
}

/// Asks for the short slice on the calling thread.
fn ask_short_slice() {
    let Some(slice) = *REQUESTED else {
        return;
    };
    if let Err(e) = set_own_slice(slice) {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| log::debug!("threads keep the kernel's time slice: sched_setattr: {e}"));
    }
}

/// The slice `setting` (the environment variable's value) asks for; `None`
/// for no hint.
fn requested_slice(setting: Option<&str>) -> Option<Duration> {
    let Some(text) = setting.map(str::trim).filter(|t| !t.is_empty()) else {
        return Some(DEFAULT_SLICE);
    };
    match text.parse::<u64>() {
        Ok(0) => None,
        Ok(us) => Some(Duration::from_micros(
            us.clamp(SLICE_RANGE_US.0, SLICE_RANGE_US.1),
        )),
        Err(_) => {
            log::warn!(
                "{SLICE_ENV}={text:?} is not a number of microseconds; asking for {} µs",
                DEFAULT_SLICE.as_micros()
            );
            Some(DEFAULT_SLICE)
        }
    }
}

fn own_attr() -> io::Result<libc::sched_attr> {
    // SAFETY: sched_attr is plain integers, for which all zeroes is a value.
    let mut attr: libc::sched_attr = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::sched_attr>() as libc::c_uint;
    // SAFETY: pid 0 is the calling thread; `attr` is writable for `size`
    // bytes, and the kernel writes at most that many.
    let rc = unsafe { libc::syscall(libc::SYS_sched_getattr, 0, &mut attr, size, 0) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(attr)
}

fn set_own_slice(slice: Duration) -> io::Result<()> {
    let mut attr = own_attr()?;
    let policy = attr.sched_policy as libc::c_int;
    if policy != libc::SCHED_OTHER && policy != libc::SCHED_BATCH {
        return Ok(());
    }
    attr.size = std::mem::size_of::<libc::sched_attr>() as u32;
    attr.sched_flags &= libc::SCHED_FLAG_RESET_ON_FORK as u64;
    attr.sched_runtime = slice.as_nanos() as u64;
    // SAFETY: pid 0 is the calling thread; `attr` is a complete sched_attr
    // of the size it states, with the thread's own policy and nice value.
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const _, 0) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calling thread's scheduling as the kernel reports it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Scheduling {
        policy: u32,
        nice: i32,
        /// The thread's slice where the kernel reports one (6.12 and
        /// newer), else 0.
        slice_ns: u64,
    }

    fn own_scheduling() -> io::Result<Scheduling> {
        let attr = own_attr()?;
        Ok(Scheduling {
            policy: attr.sched_policy,
            nice: attr.sched_nice,
            slice_ns: attr.sched_runtime,
        })
    }

    /// Whether this kernel reports a thread's slice (6.12 and newer): where
    /// it does not, the hint is accepted and ignored, and there is nothing
    /// to observe.
    fn kernel_reports_slices() -> bool {
        let reports = own_scheduling().map(|s| s.slice_ns > 0).unwrap_or(false);
        if !reports {
            eprintln!("skipped: this kernel does not report thread slices (before 6.12)");
        }
        reports
    }

    #[test]
    fn the_setting_names_the_slice_or_turns_the_hint_off() {
        assert_eq!(requested_slice(None), Some(DEFAULT_SLICE));
        assert_eq!(requested_slice(Some("")), Some(DEFAULT_SLICE));
        assert_eq!(requested_slice(Some("0")), None);
        assert_eq!(
            requested_slice(Some("250")),
            Some(Duration::from_micros(250))
        );
        assert_eq!(
            requested_slice(Some(" 250 ")),
            Some(Duration::from_micros(250))
        );
        assert_eq!(requested_slice(Some("5")), Some(Duration::from_micros(100)));
        assert_eq!(
            requested_slice(Some("9999999")),
            Some(Duration::from_millis(100))
        );
        assert_eq!(requested_slice(Some("fast")), Some(DEFAULT_SLICE));
    }

    #[test]
    fn a_spawned_thread_runs_with_the_short_slice_and_its_creators_nice_value() {
        if !kernel_reports_slices() {
            return;
        }
        // A creator at nice 3: threads inherit it, and the hint must keep it.
        let seen = thread::spawn(|| {
            // SAFETY: setpriority on the calling thread (who 0, PRIO_PROCESS
            // names the thread on Linux), raising nice, which needs no
            // privilege.
            let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 3) };
            assert_eq!(rc, 0, "setpriority: {}", io::Error::last_os_error());
            let before = own_scheduling().unwrap();
            let inner = spawn("crosshost-test-slice", Slice::Short, own_scheduling).unwrap();
            (before, inner.join().unwrap().unwrap())
        })
        .join()
        .unwrap();
        let (creator, spawned) = seen;
        assert_eq!(creator.nice, 3);
        assert_ne!(creator.slice_ns, DEFAULT_SLICE.as_nanos() as u64);
        assert_eq!(
            spawned,
            Scheduling {
                policy: libc::SCHED_OTHER as u32,
                nice: 3,
                slice_ns: DEFAULT_SLICE.as_nanos() as u64,
            }
        );
    }

    #[test]
    fn a_thread_at_the_kernels_slice_keeps_its_creators_scheduling() {
        if !kernel_reports_slices() {
            return;
        }
        let creator = own_scheduling().unwrap();
        let plain = spawn("crosshost-test-plain", Slice::Kernel, own_scheduling).unwrap();
        assert_eq!(plain.join().unwrap().unwrap(), creator);
        assert_ne!(creator.slice_ns, DEFAULT_SLICE.as_nanos() as u64);
    }

    #[test]
    fn a_batch_thread_stays_batch_with_the_short_slice() {
        if !kernel_reports_slices() {
            return;
        }
        let spawned = thread::spawn(|| {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: pid 0 is the calling thread; `param` is a valid
            // sched_param; SCHED_BATCH needs no privilege.
            let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
            assert_eq!(rc, 0, "sched_setscheduler: {}", io::Error::last_os_error());
            spawn("crosshost-test-batch", Slice::Short, own_scheduling)
                .unwrap()
                .join()
                .unwrap()
                .unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(spawned.policy, libc::SCHED_BATCH as u32);
        assert_eq!(spawned.slice_ns, DEFAULT_SLICE.as_nanos() as u64);
    }
}
