"""What the Python faces of the two test beds share: two_hosts.py (the
two-host bed, scripts/two-hosts.sh) and n_hosts.py (the N-host bed,
scripts/n-hosts.sh) each define their bed as a ``Bed`` on their own
``BedScript``.

Cleanup, for both: ``close()`` (a ``with`` block's end, also when it raised)
kills every process group it started, then deletes the bed. A bed left by a
process that died without that (SIGKILL) is removed by a watchdog started
with it -- a ``/bin/sh`` in its own session, blocked reading a pipe only the
creator holds: when the creator dies the pipe closes and the watchdog runs
the script's ``down``. Beds are named ``<prefix><creator pid>-<suffix>``
(xhbed, xhnet) so that the script's ``reap`` (run before each new bed)
removes any bed of its kind whose creator is gone even if its watchdog
never ran. Beds still open at exit are closed (atexit).
"""

from __future__ import annotations

import atexit
import itertools
import os
import random
import secrets
import select
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

_counter = itertools.count()
_live: set["Bed"] = set()
_live_lock = threading.Lock()


class BedUnavailable(RuntimeError):
    """The bed cannot be made on this machine; ``reason`` says why (from the
    script's ``check``: not root, no ``ip``, namespaces not permitted...)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class BedScript:
    """One bed script (scripts/<name>.sh): its runs, its cached ``check``."""

    def __init__(self, path: Path, timeout: float):
        self.path = path
        self.timeout = timeout
        self._check_result: str | None | bool = False  # False: not checked yet

    @property
    def tag(self) -> str:
        return self.path.name

    def __call__(self, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.path), *args], capture_output=True, text=True,
            timeout=self.timeout if timeout is None else timeout, stdin=subprocess.DEVNULL,
        )

    def unavailable_reason(self) -> str | None:
        """Why no bed can be made here (one line), or None when one can. Cached."""
        if self._check_result is False:
            try:
                r = self("check")
                if r.returncode == 0:
                    self._check_result = None
                else:
                    lines = (r.stderr or r.stdout).strip().splitlines()
                    self._check_result = lines[-1] if lines else f"{self.tag} check exited {r.returncode}"
            except (OSError, subprocess.TimeoutExpired) as e:
                self._check_result = f"{self.tag} check failed: {type(e).__name__}: {e}"
        return self._check_result  # type: ignore[return-value]

    def reap(self) -> str:
        """Removes the beds of this kind whose creator is gone; returns what it said."""
        r = self("reap")
        return r.stdout + r.stderr


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


class Bed:
    """One bed of a kind: subclasses set ``script`` and ``prefix``, and say
    what ``up`` is given (``_up_args``), which hosts there are (``_host``)
    and whether anything of the bed is left (``_leftovers``). Use as a
    context manager (or call ``up()`` and ``close()``)."""

    script: BedScript
    prefix: str

    def __init__(self, name: str | None = None):
        self.name = name or f"{self.prefix}{os.getpid()}-{next(_counter)}{secrets.token_hex(2)}"
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._watchdog: subprocess.Popen | None = None
        self._up = False
        self._closed = False
        self._ports = itertools.count(random.randrange(20000, 30000, 100))

    def _up_args(self) -> list[str]:
        return []

    def _host(self, host) -> str:
        raise NotImplementedError

    def _leftovers(self) -> bool:
        raise NotImplementedError

    @property
    def is_up(self) -> bool:
        return self._up and not self._closed

    # -- lifecycle ---------------------------------------------------------

    def up(self):
        reason = self.script.unavailable_reason()
        if reason is not None:
            raise BedUnavailable(reason)
        self.script.reap()
        with _live_lock:
            _live.add(self)
        # The watchdog first: if this process dies from here on, the bed (or
        # what `up` made of it so far) is deleted.
        self._watchdog = subprocess.Popen(
            ["/bin/sh", "-c", 'read _ignored || true; exec "$0" down "$1"', str(self.script.path), self.name],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            r = self.script("up", self.name, *self._up_args())
        except BaseException:
            self.close()
            raise
        if r.returncode != 0:
            self.close()
            raise RuntimeError(f"{self.script.tag} up {self.name} failed: {r.stderr.strip()}")
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
                    done = watchdog.wait(timeout=self.script.timeout) == 0
                except (OSError, subprocess.TimeoutExpired):
                    kill_group(watchdog)
            if not done or self._leftovers():
                r = self.script("down", self.name)
                if r.returncode != 0:
                    raise RuntimeError(f"{self.script.tag} down {self.name} failed: {r.stderr.strip()}")
        finally:
            with _live_lock:
                _live.discard(self)

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- runs --------------------------------------------------------------

    def port(self) -> int:
        """A TCP port for a server on the bed (each call another; below the
        ephemeral range, so no port 0 bind on the bed takes it first). The
        bed's namespaces hold only what runs on the bed, so it is free."""
        return next(self._ports)

    def argv(self, host, argv: Sequence) -> list[str]:
        """The command line that runs ``argv`` on ``host``."""
        return [str(self.script.path), "run", self.name, self._host(host), *map(str, argv)]

    def popen(self, host, argv: Sequence, env: dict | None = None, **popen_kwargs) -> subprocess.Popen:
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

    def run(self, host, argv: Sequence, *, timeout: float, env: dict | None = None,
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


@atexit.register
def _close_all() -> None:
    with _live_lock:
        beds = list(_live)
    for bed in beds:
        try:
            bed.close()
        except Exception:  # noqa: BLE001 - the watchdog and reap remain
            pass


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


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line of ``proc``'s stdout (a pipe), waiting at most
    ``timeout`` seconds; "" if the process closed it. TimeoutError after.
    Reads byte by byte below Python's buffering, so select() sees the rest."""
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
