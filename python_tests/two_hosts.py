"""Two hosts on one machine for tests and benchmarks: a Python face of
scripts/two-hosts.sh (see there for what a bed is and why each part exists).

    from two_hosts import TwoHostBed

    with TwoHostBed() as bed:                    # or the pytest fixture `two_hosts`
        server = bed.popen("a", ["python3", "server.py", bed.address("a")])
        client = bed.popen("b", ["python3", "client.py", "xh-a"])
        ...
    # every process started on the bed is killed; the bed is gone

Host "a" is 10.77.0.1, named xh-a; host "b" is 10.77.0.2, named xh-b. Each
has its own network (lo + eth0), pid, IPC, UTS (hostname) and mount
namespace with a private /dev/shm, its own boot id, and an /etc/hosts naming
both. The filesystem is otherwise shared (scripts, output files, the
library under test are where they are on the machine).

Cleanup: ``close()`` (the ``with`` block's end, also when it raised) kills
every process group it started, then deletes the bed. A bed left by a
process that died without that (SIGKILL) is removed by a watchdog started
with it -- a ``/bin/sh`` in its own session, blocked reading a pipe only the
creator holds: when the creator dies the pipe closes and the watchdog runs
``two-hosts.sh down``. Beds are named ``xhbed<creator pid>-<suffix>`` so that
``two-hosts.sh reap`` (run before each new bed) removes any bed whose creator
is gone even if its watchdog never ran.
"""

from __future__ import annotations

import atexit
import itertools
import os
import random
import secrets
import signal
import subprocess
import threading
from pathlib import Path
from typing import Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SCRIPT = REPO / "scripts" / "two-hosts.sh"
STATE_ROOT = Path(os.environ.get("XH_BED_STATE_ROOT", "/tmp/pjrt-crosshost-beds"))

HOSTS = ("a", "b")
ADDRESSES = {"a": "10.77.0.1", "b": "10.77.0.2"}
HOSTNAMES = {"a": "xh-a", "b": "xh-b"}
SCRIPT_TIMEOUT_S = 60.0

_counter = itertools.count()
_live: set["TwoHostBed"] = set()
_live_lock = threading.Lock()
_check_result: str | None | bool = False  # False: not checked yet


class BedUnavailable(RuntimeError):
    """The bed cannot be made on this machine; ``reason`` says why (from
    ``two-hosts.sh check``: not root, no ``ip``, namespaces not permitted...)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _script(*args: str, timeout: float = SCRIPT_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def unavailable_reason() -> str | None:
    """Why no bed can be made here (one line), or None when one can. Cached."""
    global _check_result
    if _check_result is False:
        try:
            r = _script("check")
            if r.returncode == 0:
                _check_result = None
            else:
                lines = (r.stderr or r.stdout).strip().splitlines()
                _check_result = lines[-1] if lines else f"two-hosts.sh check exited {r.returncode}"
        except (OSError, subprocess.TimeoutExpired) as e:
            _check_result = f"two-hosts.sh check failed: {type(e).__name__}: {e}"
    return _check_result  # type: ignore[return-value]


def reap() -> str:
    """Removes the beds of ours whose creator is gone; returns what it said."""
    r = _script("reap")
    return r.stdout + r.stderr


def bed_exists(name: str) -> dict[str, bool]:
    """What of bed ``name`` exists: its namespaces and its state dir."""
    return {
        "netns_a": Path(f"/run/netns/{name}-a").exists(),
        "netns_b": Path(f"/run/netns/{name}-b").exists(),
        "state_dir": (STATE_ROOT / name).exists(),
    }


def kill_group(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGKILLs a child started in its own process group, group and all.
    (A run's processes on a host also die with its pid namespace.)"""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


class TwoHostBed:
    """One bed: two hosts, "a" and "b". Use as a context manager (or call
    ``up()`` and ``close()``)."""

    def __init__(self, name: str | None = None):
        self.name = name or f"xhbed{os.getpid()}-{next(_counter)}{secrets.token_hex(2)}"
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._watchdog: subprocess.Popen | None = None
        self._up = False
        self._closed = False
        self._ports = itertools.count(random.randrange(20000, 30000, 100))

    # -- lifecycle ---------------------------------------------------------

    def up(self) -> "TwoHostBed":
        reason = unavailable_reason()
        if reason is not None:
            raise BedUnavailable(reason)
        reap()
        with _live_lock:
            _live.add(self)
        # The watchdog first: if this process dies from here on, the bed (or
        # what `up` made of it so far) is deleted.
        self._watchdog = subprocess.Popen(
            ["/bin/sh", "-c", 'read _ignored || true; exec "$0" down "$1"', str(SCRIPT), self.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            r = _script("up", self.name)
        except BaseException:
            self.close()
            raise
        if r.returncode != 0:
            self.close()
            raise RuntimeError(f"two-hosts.sh up {self.name} failed: {r.stderr.strip()}")
        self._up = True
        return self

    def close(self) -> None:
        """Kills every process started on the bed (its process group), then
        deletes the bed. Idempotent; raises if the bed could not be deleted."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs, self._procs = self._procs, []
        try:
            for proc in procs:
                kill_group(proc)
            watchdog, self._watchdog = self._watchdog, None
            done = False
            if watchdog is not None:
                # Closing its pipe makes the watchdog run `down` now.
                try:
                    watchdog.stdin.close()
                    done = watchdog.wait(timeout=SCRIPT_TIMEOUT_S) == 0
                except (OSError, subprocess.TimeoutExpired):
                    kill_group(watchdog)
            if not done or any(bed_exists(self.name).values()):
                r = _script("down", self.name)
                if r.returncode != 0:
                    raise RuntimeError(f"two-hosts.sh down {self.name} failed: {r.stderr.strip()}")
        finally:
            with _live_lock:
                _live.discard(self)

    def __enter__(self) -> "TwoHostBed":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- hosts -------------------------------------------------------------

    @staticmethod
    def _host(host: str) -> str:
        if host not in HOSTS:
            raise ValueError(f"host must be 'a' or 'b', not {host!r}")
        return host

    def address(self, host: str) -> str:
        """The host's address on the bed: "10.77.0.1" (a) or "10.77.0.2" (b)."""
        return ADDRESSES[self._host(host)]

    def hostname(self, host: str) -> str:
        """The host's name, in both hosts' /etc/hosts: "xh-a" or "xh-b"."""
        return HOSTNAMES[self._host(host)]

    def netns(self, host: str) -> str:
        """The host's network namespace (`ip netns` name)."""
        return f"{self.name}-{self._host(host)}"

    def port(self) -> int:
        """A TCP port for a server on the bed (each call another; below the
        ephemeral range, so no port 0 bind on the bed takes it first). The
        bed's namespaces hold only what runs on the bed, so it is free."""
        return next(self._ports)

    def argv(self, host: str, argv: Sequence) -> list[str]:
        """The command line that runs ``argv`` on ``host``."""
        return [str(SCRIPT), "run", self.name, self._host(host), *map(str, argv)]

    def popen(self, host: str, argv: Sequence, env: dict | None = None, **popen_kwargs) -> subprocess.Popen:
        """Starts ``argv`` on ``host`` in a process group of its own
        (killed, group and all, at ``close()``). ``env`` (default: this
        process's environment) reaches the command as it is; the other
        arguments are Popen's."""
        popen_kwargs.pop("start_new_session", None)
        popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
        with self._lock:
            if not self._up or self._closed:
                raise RuntimeError(f"bed {self.name} is not up")
            proc = subprocess.Popen(
                self.argv(host, argv), env=env, start_new_session=True, **popen_kwargs
            )
            self._procs.append(proc)
        return proc

    def run(self, host: str, argv: Sequence, *, timeout: float, env: dict | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
        """Runs ``argv`` on ``host`` to its end, output captured (text); a run
        still going at ``timeout`` is killed and TimeoutExpired raised."""
        proc = self.popen(
            host, argv, env=env, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# Hides every UCX from one command on its host: the libucx wheel by an empty
# variable that would name it (jax_plugins.crosshost then looks no further), the system's libucp by a bind mount in a mount
# namespace of the command's own (gone with it: a later run on that host
# still finds UCX), so the plugin finds no UCX and falls back to TCP.
_HIDE_UCX = (
    'export PJRT_CROSSHOST_UCX_WHEEL_LIB=; '
    'for f in /usr/lib/x86_64-linux-gnu/libucp.so.0 /usr/lib/aarch64-linux-gnu/libucp.so.0; do '
    '[ -e "$f" ] && mount --bind /dev/null "$(readlink -f "$f")"; done; exec "$@"'
)


def without_ucx(argv: Sequence) -> list[str]:
    """``argv``, run with the system's libucp hidden from it (and its children)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _HIDE_UCX, "sh",
            *map(str, argv)]


@atexit.register
def _close_all() -> None:
    with _live_lock:
        beds = list(_live)
    for bed in beds:
        try:
            bed.close()
        except Exception:  # noqa: BLE001 - the watchdog and reap remain
            pass


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line of ``proc``'s stdout (a pipe), waiting at most
    ``timeout`` seconds; "" if the process closed it. TimeoutError after.
    Reads byte by byte below Python's buffering, so select() sees the rest."""
    import select
    import time

    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no line from {proc.args[:6]} within {timeout}s (so far {line!r})")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            b = os.read(fd, 1)
            if not b:
                break
            line += b
    return line.decode()
