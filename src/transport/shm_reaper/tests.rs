use super::*;
use crate::transport::random::random_hex;
use crate::transport::shm::{SharedRegion, SHM_NAME_RANDOM_HEX_LEN};
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

/// Runs in a child process (see the tests below): creates a region, prints
/// its name and its watchdog's pid, then answers each line on stdin with
/// its watchdog's pid until stdin closes or it is killed.
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
    while std::io::stdin().read_line(&mut line).unwrap_or(0) > 0 {
        println!("watchdog {}", watchdog_pid().map_or(0, |pid| pid));
        line.clear();
    }
    drop(region);
}

struct ChildOwner {
    process: std::process::Child,
    stdout: BufReader<std::process::ChildStdout>,
    region: String,
    watchdog: u32,
}

/// Starts `child_creates_a_region_and_waits` in a child process.
fn start_child() -> ChildOwner {
    let mut process = Command::new(std::env::current_exe().unwrap())
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
    let mut stdout = BufReader::new(process.stdout.take().unwrap());
    // libtest may print "test <name> ... " on the same line first.
    let mut line = String::new();
    let report = loop {
        line.clear();
        if stdout.read_line(&mut line).unwrap() == 0 {
            let _ = process.kill();
            let _ = process.wait();
            panic!("the child printed no region");
        }
        if let Some(at) = line.find("region /") {
            break line[at..].to_string();
        }
    };
    let fields: Vec<&str> = report.split_whitespace().collect();
    let watchdog: u32 = fields[3].parse().unwrap();
    assert!(watchdog > 0, "the child started no watchdog");
    ChildOwner {
        region: fields[1].to_string(),
        watchdog,
        process,
        stdout,
    }
}

impl ChildOwner {
    /// The child's watchdog pid now.
    fn ask_watchdog(&mut self) -> u32 {
        use std::io::Write;
        let stdin = self.process.stdin.as_mut().unwrap();
        stdin.write_all(b"?\n").unwrap();
        stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim()
            .strip_prefix("watchdog ")
            .unwrap_or_else(|| panic!("unexpected answer {line:?}"))
            .parse()
            .unwrap()
    }

    fn kill(mut self) {
        self.process.kill().unwrap(); // SIGKILL: no destructor runs
        self.process.wait().unwrap();
    }
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
    let child = start_child();
    let guard = NamedShmObject::adopt(child.region.clone());
    assert!(guard.exists());
    let watchdog_exit = pidfd_of(child.watchdog);
    assert!(!wait_exit(&watchdog_exit, 0), "the watchdog ended early");
    child.kill();
    assert!(
        wait_exit(&watchdog_exit, 20_000),
        "the watchdog did not finish within 20 s of its process's death"
    );
    assert!(!guard.exists(), "{} is still in {SHM_DIR}", guard.name());
}

/// More names under the owner's prefix than fit in one command line
/// (ARG_MAX, 2 MiB here: ~60 bytes a name): the watchdog still removes the
/// owner's region, and the planted names with it.
#[test]
fn names_planted_under_the_owners_prefix_do_not_stop_its_watchdog() {
    let child = start_child();
    let guard = NamedShmObject::adopt(child.region.clone());
    let prefix = &child.region[..child.region.len() - SHM_NAME_RANDOM_HEX_LEN];
    let planted: Vec<String> = (0..40_000)
        .map(|i| {
            format!(
                "{SHM_DIR}{prefix}{i:0>width$x}",
                width = SHM_NAME_RANDOM_HEX_LEN
            )
        })
        .collect();
    let planted_bytes: usize = planted.iter().map(|p| p.len() + 1).sum();
    assert!(
        planted_bytes > 2 << 20,
        "plant more: {planted_bytes} bytes of names"
    );
    for path in &planted {
        std::fs::File::create(path).unwrap();
    }
    let watchdog_exit = pidfd_of(child.watchdog);
    child.kill();
    let finished = wait_exit(&watchdog_exit, 30_000);
    let left = planted
        .iter()
        .filter(|p| std::path::Path::new(p).exists())
        .count();
    for path in &planted {
        let _ = std::fs::remove_file(path);
    }
    assert!(finished, "the watchdog did not finish within 30 s");
    assert!(!guard.exists(), "{} is still in {SHM_DIR}", guard.name());
    assert_eq!(left, 0, "planted names left");
}

/// A watchdog killed before its owner is replaced, and the replacement
/// removes the owner's region when the owner dies.
#[test]
fn a_watchdog_killed_before_its_owner_is_replaced() {
    let mut child = start_child();
    let guard = NamedShmObject::adopt(child.region.clone());
    let first = child.watchdog;
    let first_exit = pidfd_of(first);
    // SAFETY: plain syscall on a pid we were told is the child's watchdog.
    assert_eq!(
        unsafe { libc::kill(first as libc::pid_t, libc::SIGKILL) },
        0
    );
    assert!(wait_exit(&first_exit, 10_000), "the watchdog did not die");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let second = loop {
        let now = child.ask_watchdog();
        if now != first && now != 0 {
            break now;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no new watchdog within 10 s (still {now})"
        );
        std::thread::yield_now();
    };
    assert!(guard.exists());
    let second_exit = pidfd_of(second);
    child.kill();
    assert!(
        wait_exit(&second_exit, 20_000),
        "the new watchdog did not finish within 20 s of its process's death"
    );
    assert!(!guard.exists(), "{} is still in {SHM_DIR}", guard.name());
}

const INHERIT_CHILD_ENV: &str = "PJRT_CROSSHOST_TEST_WATCHDOG_FDS_CHILD";

/// Run as a child process (so no other test's descriptors, and no watchdog
/// started earlier, are in the way): opens a listener without close-on-exec,
/// as UCX does, starts its watchdog, prints the watchdog's pid and every
/// descriptor it holds (`watchdog-fds PID [N->target ...]`), then waits for
/// stdin to close.
#[test]
#[ignore = "helper run as a child process by the_watchdog_inherits_only_its_pipe"]
fn child_with_an_inheritable_socket_starts_its_watchdog() {
    if std::env::var_os(INHERIT_CHILD_ENV).is_none() {
        return;
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    // SAFETY: clearing FD_CLOEXEC on a descriptor we own.
    assert_eq!(
        unsafe { libc::fcntl(listener.as_raw_fd(), libc::F_SETFD, 0) },
        0
    );
    // SAFETY: reading the flags of a descriptor we own.
    let flags = unsafe { libc::fcntl(listener.as_raw_fd(), libc::F_GETFD) };
    assert_eq!(flags & libc::FD_CLOEXEC, 0, "the listener is still CLOEXEC");
    let region = SharedRegion::create(4096).unwrap();
    let watchdog = watchdog_pid().expect("a watchdog runs once a region exists");
    // Its inherited descriptors are settled at exec (spawn returns after
    // it), but the dynamic loader of /bin/sh briefly holds the libraries it
    // opens. So wait until the shell runs its read loop: it has consumed a
    // line written into its pipe (none left unread in the pipe).
    let pipe = {
        let guard = WATCHDOG.lock();
        let (_, stdin) = guard.as_ref().unwrap().running.as_ref().unwrap();
        let mut writer: &ChildStdin = stdin;
        std::io::Write::write_all(&mut writer, b"settled?\n").unwrap();
        stdin.as_raw_fd()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let mut unread: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int; the pipe stays open while the
        // watchdog runs (its keeper replaces it only after it died).
        assert_eq!(unsafe { libc::ioctl(pipe, libc::FIONREAD, &mut unread) }, 0);
        if unread == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the watchdog {watchdog} did not read its pipe within 10 s"
        );
        std::thread::yield_now();
    }
    let exe = std::fs::read_link(format!("/proc/{watchdog}/exe")).unwrap();
    assert_eq!(exe, std::fs::canonicalize("/bin/sh").unwrap());
    let mut fds: Vec<(i32, String)> = std::fs::read_dir(format!("/proc/{watchdog}/fd"))
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let fd = e.file_name().to_str().unwrap().parse::<i32>().unwrap();
            let target = std::fs::read_link(e.path())
                .map_or_else(|e| format!("?({e})"), |t| t.display().to_string());
            (fd, target)
        })
        .collect();
    fds.sort();
    let fds: Vec<String> = fds.iter().map(|(fd, t)| format!("{fd}->{t}")).collect();
    println!("\nwatchdog-fds {watchdog} [{}]", fds.join(" "));
    // Hold the region and the listener until the parent has looked.
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).unwrap_or(0) > 0 {
        line.clear();
    }
    drop(region);
    drop(listener);
}

/// UCX's sockets lack close-on-exec; the watchdog must not hold them (a
/// killed process's connections would stay open until it exits). Its
/// descriptors: its pipe on 0, /dev/null on 1 and 2, nothing else.
#[test]
fn the_watchdog_inherits_only_its_pipe() {
    let mut process = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "transport::shm_reaper::tests::child_with_an_inheritable_socket_starts_its_watchdog",
            "--ignored",
            "--test-threads=1",
            "--nocapture",
        ])
        .env(INHERIT_CHILD_ENV, "1")
        .env_remove(WATCHDOG_ENV)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(process.stdout.take().unwrap());
    let mut line = String::new();
    let report = loop {
        line.clear();
        if stdout.read_line(&mut line).unwrap() == 0 {
            let _ = process.kill();
            let _ = process.wait();
            panic!("the child printed no report");
        }
        if let Some(at) = line.find("watchdog-fds ") {
            break line[at..].trim().to_string();
        }
    };
    let (watchdog, fds) = report["watchdog-fds ".len()..]
        .split_once(" [")
        .unwrap_or_else(|| panic!("unexpected report {report:?}"));
    let watchdog: u32 = watchdog.parse().unwrap();
    let fds: Vec<&str> = fds
        .strip_suffix(']')
        .unwrap_or(fds)
        .split_whitespace()
        .collect();
    // Watch the watchdog's end before the child lets it go.
    let watchdog_exit = pidfd_of(watchdog);
    drop(process.stdin.take()); // the child drops its region and exits
    let status = process.wait().unwrap();
    let finished = wait_exit(&watchdog_exit, 20_000);

    let numbers: Vec<&str> = fds
        .iter()
        .map(|f| f.split_once("->").map_or(*f, |(n, _)| n))
        .collect();
    assert_eq!(
        numbers,
        ["0", "1", "2"],
        "the watchdog holds more than its stdio: {fds:?}"
    );
    assert!(fds[0].starts_with("0->pipe:["), "{fds:?}");
    assert_eq!(fds[1..], ["1->/dev/null", "2->/dev/null"], "{fds:?}");
    assert!(status.success(), "the child failed: {status}");
    assert!(
        finished,
        "the watchdog {watchdog} did not finish within 20 s of its process's end"
    );
}
