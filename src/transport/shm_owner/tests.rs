use super::*;
use std::process::{Child, Command, Stdio};

/// A child that runs until its stdin closes (`cat`), so a test decides
/// when it ends without sleeping.
fn held_child() -> Child {
    Command::new("cat")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

/// Ends `child` and waits until it has exited, leaving it a zombie
/// (`WNOWAIT`): not yet reaped, so its pid and /proc entry remain.
fn end_leaving_zombie(child: &mut Child) {
    drop(child.stdin.take());
    // SAFETY: siginfo_t is plain data; waitid fills it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child; `info` is a valid out-pointer.
    let rc = unsafe {
        libc::waitid(
            libc::P_PID,
            child.id() as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOWAIT,
        )
    };
    assert_eq!(rc, 0, "{}", io::Error::last_os_error());
}

fn owner_of(pid: u32) -> ShmOwner {
    ShmOwner {
        pid_namespace: ShmOwner::current().unwrap().pid_namespace,
        pid,
        start_time: read_proc_stat(pid).unwrap().unwrap().start_time,
    }
}

#[test]
fn proc_stat_fields_are_counted_after_the_last_parenthesis() {
    let line = "4242 (we) ird (name)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 \
                987654 1000 10 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";
    assert_eq!(
        parse_proc_stat(line),
        Some(ProcStat {
            pid: 4242,
            state: 'S',
            start_time: 987654,
        })
    );
    for bad in [
        "",
        "4242 (cat) S 1 2",
        "x (cat) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 5",
        "4242 (cat) SS 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 5",
        "4242 (cat) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 -5",
    ] {
        assert_eq!(parse_proc_stat(bad), None, "{bad:?}");
    }
}

#[test]
fn the_current_owner_is_this_process_as_proc_sees_it() {
    let me = ShmOwner::current().unwrap();
    assert_eq!(me.pid, std::process::id());
    let stat = read_proc_stat(me.pid).unwrap().unwrap();
    assert_eq!(stat.start_time, me.start_time);
    assert_eq!(
        me.pid_namespace,
        std::fs::metadata("/proc/self/ns/pid").unwrap().ino()
    );
    assert_eq!(me.state(), OwnerState::Alive);
    assert_eq!(ShmOwner::current().unwrap(), me);
}

#[test]
fn a_running_process_is_alive_and_an_exited_one_gone() {
    let mut child = held_child();
    let owner = owner_of(child.id());
    assert_eq!(owner.state(), OwnerState::Alive);
    let watch = OwnerWatch::new(owner);
    assert!(!watch.is_gone());
    // Exited but not reaped: a zombie is gone too.
    end_leaving_zombie(&mut child);
    assert_eq!(owner.state(), OwnerState::Gone);
    assert!(watch.is_gone(), "the pidfd (or /proc) reports the exit");
    child.wait().unwrap();
    assert_eq!(owner.state(), OwnerState::Gone);
    assert!(watch.is_gone());
    assert!(OwnerWatch::new(owner).is_gone());
}

#[test]
fn a_reused_pid_is_not_its_old_owner() {
    let mut child = held_child();
    let live = owner_of(child.id());
    // The same pid with another start time: the pid now belongs to a
    // process that is not the owner.
    let impostor = ShmOwner {
        start_time: live.start_time + 1,
        ..live
    };
    assert_eq!(impostor.state(), OwnerState::Gone);
    assert!(OwnerWatch::new(impostor).is_gone());
    let me = ShmOwner::current().unwrap();
    let my_pid_reused = ShmOwner {
        start_time: me.start_time.wrapping_sub(1),
        ..me
    };
    assert_eq!(my_pid_reused.state(), OwnerState::Gone);
    drop(child.stdin.take());
    child.wait().unwrap();
}

#[test]
fn owners_in_another_pid_namespace_are_never_judged_gone() {
    let mut child = held_child();
    let mut foreign = owner_of(child.id());
    foreign.pid_namespace += 1;
    drop(child.stdin.take());
    child.wait().unwrap();
    assert_eq!(foreign.state(), OwnerState::Unknown);
    assert!(!foreign.is_gone());
    assert!(!OwnerWatch::new(foreign).is_gone());
}
