use super::*;
use crate::transport::random::random_hex;
use crate::transport::shm::SharedRegion;
use crate::transport::shm_test_object::{exists, NamedShmObject};
use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const CHILD_ENV: &str = "PJRT_CROSSHOST_TEST_REAPER_CHILD";

/// The pid of a process that ran and was reaped (free, or reused by a
/// process with another start time by the time anyone looks).
fn dead_pid() -> u32 {
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

#[test]
fn the_reaper_removes_dead_owners_objects_and_keeps_live_ones() {
    let me = ShmOwner::current().unwrap();
    let dead = NamedShmObject::create(
        &ShmOwner {
            pid: dead_pid(),
            start_time: 12345,
            ..me
        },
        4096,
    );
    // This process's pid, but a start time it does not have: a process
    // that had our pid before us.
    let reused = NamedShmObject::create(
        &ShmOwner {
            start_time: me.start_time.wrapping_sub(1),
            ..me
        },
        4096,
    );
    let live = NamedShmObject::create(&me, 4096);
    let region = SharedRegion::create(4096).unwrap();
    // Another pid namespace: its pids mean nothing here.
    let foreign = NamedShmObject::create(
        &ShmOwner {
            pid_namespace: me.pid_namespace + 1,
            pid: dead_pid(),
            ..me
        },
        4096,
    );
    assert!(dead.exists() && reused.exists() && live.exists() && foreign.exists());

    let report = reap_dead_owners();

    // (Another test's client may have run the once-per-process reaper at
    // the same time and removed them first.)
    assert!(!dead.exists(), "{report:?}");
    assert!(!reused.exists(), "{report:?}");
    assert!(live.exists(), "a live owner's object was removed");
    assert!(exists(region.name()), "a live region was removed");
    assert!(
        foreign.exists(),
        "an object of another pid namespace was removed"
    );
    assert!(report.kept >= 3, "{report:?}");
    assert!(!report.removed.contains(&live.0) && !report.removed.contains(&foreign.0));
    region.write_at(0, b"still usable").unwrap();
}

#[test]
fn the_reaper_skips_names_that_are_not_ours() {
    let hex = random_hex(16).unwrap();
    // Our prefix, but not our format: never touched.
    let odd = format!("/crosshost-{hex}");
    let guard = NamedShmObject::create_named(odd.clone(), 0);
    let report = reap_dead_owners();
    assert!(guard.exists(), "{report:?}");
    assert!(!report.removed.contains(&odd));
}

/// Runs in a child process (see the test below): creates a region, prints
/// its name and its watchdog's pid, then waits to be killed.
#[test]
#[ignore = "helper run as a child process by a_killed_process_watchdog_removes_its_objects"]
fn child_creates_a_region_and_waits() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let region = SharedRegion::create(1 << 20).unwrap();
    println!(
        "region {} watchdog {}",
        region.name(),
        watchdog_pid().map_or(0, |pid| pid)
    );
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    drop(region);
}

fn pidfd_of(pid: u32) -> OwnedFd {
    // SAFETY: plain syscall; the descriptor is owned by the result.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    assert!(
        raw >= 0,
        "pidfd_open({pid}): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a fresh descriptor nothing else owns.
    unsafe { OwnedFd::from_raw_fd(raw as libc::c_int) }
}

/// Blocks until the process behind `pidfd` exits, at most `timeout_ms`.
fn wait_exit(pidfd: &OwnedFd, timeout_ms: i32) -> bool {
    let mut poll = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut poll, 1, timeout_ms) == 1 }
}

#[test]
fn a_killed_process_watchdog_removes_its_objects() {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "transport::shm_reaper::tests::child_creates_a_region_and_waits",
            "--ignored",
            "--test-threads=1",
            "--nocapture",
        ])
        .env(CHILD_ENV, "1")
        .env_remove(WATCHDOG_ENV)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // libtest may print "test <name> ... " on the same line first.
    let mut line = String::new();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let report = loop {
        line.clear();
        if stdout.read_line(&mut line).unwrap() == 0 {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the child printed no region");
        }
        if let Some(at) = line.find("region /") {
            break line[at..].to_string();
        }
    };
    let fields: Vec<&str> = report.split_whitespace().collect();
    let name = fields[1].to_string();
    let guard = NamedShmObject::adopt(name.clone());
    let watchdog: u32 = fields[3].parse().unwrap();
    assert!(guard.exists());
    assert!(watchdog > 0, "the child started no watchdog");
    let watchdog_exit = pidfd_of(watchdog);
    assert!(!wait_exit(&watchdog_exit, 0), "the watchdog ended early");

    child.kill().unwrap(); // SIGKILL: no destructor runs
    child.wait().unwrap();

    assert!(
        wait_exit(&watchdog_exit, 20_000),
        "the watchdog did not finish within 20 s of its process's death"
    );
    assert!(!guard.exists(), "{name} is still in {SHM_DIR}");
}
