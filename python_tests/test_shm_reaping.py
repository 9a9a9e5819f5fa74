"""Shared memory left by a process that dies (issue 11, item 4).

A receiver owns POSIX shared-memory objects in /dev/shm (a 256 MiB pooled
segment, dedicated regions). Their names carry the owner's pid namespace,
pid and start time: ``crosshost-<ns>-<pid>-<start>-<32 hex>``. When the
owner dies without destroying its client (SIGKILL, ``os._exit``), either
its watchdog removes them at once, or, with the watchdog off
($PJRT_CROSSHOST_SHM_WATCHDOG=0), the next process that creates a client on
the host does; live processes' objects are never touched. The child
processes are shm_child.py; every object and child a test makes is removed
at teardown, also on failure.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys

import pytest

from conftest import library_path

HERE = os.path.dirname(os.path.abspath(__file__))
SHM = "/dev/shm"
PREFIX = "crosshost-"
POOL_SEGMENT_BYTES = 256 << 20


def start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return int(text[text.rindex(")") + 1 :].split()[19])


def pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def ours() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(PREFIX)}


def owned_by(names, pid: int) -> set[str]:
    """The names whose owner field is ``pid`` (in our pid namespace)."""
    ns = str(pid_namespace())
    return {n for n in names if n.split("-")[1:3] == [ns, str(pid)]}


def size(name: str) -> int:
    return os.stat(os.path.join(SHM, name)).st_size


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            if int(text[text.rindex(")") + 1 :].split()[1]) == pid:
                found.append(int(entry))
    return found


def wait_exit(pidfd: int, timeout: float) -> bool:
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(int(timeout * 1000)))


class Children:
    """shm_child.py processes and the /dev/shm names to remove at the end."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.names: set[str] = set()

    def start(self, mode: str, watchdog: bool) -> subprocess.Popen:
        env = dict(os.environ)
        env["PJRT_CROSSHOST_SHM_WATCHDOG"] = "1" if watchdog else "0"
        proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "shm_child.py"), str(library_path()), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=HERE,
        )
        self.procs.append(proc)
        return proc

    def line(self, proc: subprocess.Popen, timeout: float = 30) -> str:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"child {proc.pid} said nothing within {timeout}s")
        line = proc.stdout.readline().decode()
        if not line:
            proc.wait(timeout=10)
            raise AssertionError(
                f"child {proc.pid} exited with {proc.returncode}: {proc.stderr.read().decode()}"
            )
        return line.strip()

    def owner_with_shared_memory(self, mode: str, watchdog: bool):
        """A child that posted its receives: (process, the names it made)."""
        before = ours()
        proc = self.start(mode, watchdog)
        assert self.line(proc) == f"ready {proc.pid}"
        made = owned_by(ours() - before, proc.pid)
        self.names |= made
        return proc, made

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                stream.close()
        for name in self.names:
            try:
                os.unlink(os.path.join(SHM, name))
            except FileNotFoundError:
                pass


@pytest.fixture
def children():
    c = Children()
    yield c
    c.close()


def die(proc: subprocess.Popen, how: str) -> None:
    if how == "sigkill":
        proc.kill()  # SIGKILL: no destructor, no atexit
        assert proc.wait(timeout=10) == -9
    else:  # os._exit(0) without destroying the client
        proc.stdin.write(b"exit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=10) == 0, proc.stderr.read().decode()


def check_made(made: set[str]) -> None:
    # One pooled segment (the 4 KiB destination is carved from it) and one
    # dedicated region (the zero-sized buffer).
    assert len(made) == 2, made
    assert sorted(size(n) >= POOL_SEGMENT_BYTES for n in made) == [False, True], {
        n: size(n) for n in made
    }


@pytest.mark.parametrize("how", ["sigkill", "os_exit"])
def test_the_next_start_removes_what_a_dead_process_left_and_keeps_live_ones(children, how):
    dead, made = children.owner_with_shared_memory("hold" if how == "sigkill" else "exit", False)
    check_made(made)
    live, live_made = children.owner_with_shared_memory("hold", False)
    check_made(live_made)
    # An object of this (live) process, named as the plugin names them.
    me = os.getpid()
    mine = f"{PREFIX}{pid_namespace()}-{me}-{start_time(me)}-{os.urandom(16).hex()}"
    fd = os.open(os.path.join(SHM, mine), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    children.names.add(mine)

    die(dead, how)
    # Nobody cleaned up: the watchdog is off, no new process started yet.
    assert made <= ours(), f"gone before any new start: {made - ours()}"

    starter = children.start("start", True)
    assert children.line(starter) == "done"
    assert starter.wait(timeout=10) == 0

    assert not made & ours(), f"left by the dead process {dead.pid}: {made & ours()}"
    assert live_made <= ours(), f"a live process's objects were removed: {live_made - ours()}"
    assert mine in ours(), "this process's object was removed"
    # The live child ends cleanly: its client takes its own objects along.
    live.stdin.write(b"finish\n")
    live.stdin.flush()
    assert live.wait(timeout=20) == 0, live.stderr.read().decode()
    assert not live_made & ours(), live_made & ours()


@pytest.mark.parametrize("how", ["sigkill", "os_exit"])
def test_the_watchdog_removes_what_a_dead_process_left_without_any_new_start(children, how):
    proc, made = children.owner_with_shared_memory("hold" if how == "sigkill" else "exit", True)
    check_made(made)
    watchdogs = children_of(proc.pid)
    assert len(watchdogs) == 1, f"child {proc.pid} has {watchdogs}, expected one watchdog"
    pidfd = os.pidfd_open(watchdogs[0])
    try:
        assert not wait_exit(pidfd, 0), "the watchdog ended while its process lives"
        die(proc, how)
        assert wait_exit(pidfd, 20), "the watchdog did not end within 20 s of the death"
    finally:
        os.close(pidfd)
    assert not made & ours(), f"left by the dead process {proc.pid}: {made & ours()}"
