"""A real etcd server for the tests: Debian's etcd 3.4 (scripts/setup.sh
installs etcd-server and etcd-client) on free localhost ports, its data on
tmpfs (/dev/shm). ``stop`` kills it like a crash and keeps the data;
``start`` brings it back on the same ports. ``close`` kills it and removes
the data. The server dies with the test process (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid

ETCD = next((p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.path.exists(p)), None)
ETCDCTL = shutil.which("etcdctl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class EtcdServer:
    def __init__(self):
        if ETCD is None or ETCDCTL is None:
            raise RuntimeError(
                "etcd and etcdctl are needed: scripts/setup.sh installs Debian's etcd-server "
                "and etcd-client"
            )
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data = f"/dev/shm/etcd-test-crosshost-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        """The ``kv_store`` option's value."""
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self) -> None:
        assert self.proc is None, "already running"
        client, peer = self.endpoint, f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [ETCD, "--name", "crosshost-test", "--data-dir", self.data,
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"crosshost-test={peer}",
             "--logger", "zap", "--log-level", "error"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + 20
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not become healthy (rc={self.proc.poll()})")
            time.sleep(0.05)

    def _healthy(self) -> bool:
        r = self._ctl("--command-timeout=1s", "endpoint", "health", check=False)
        return r.returncode == 0

    def _ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(
            [ETCDCTL, "--endpoints", self.endpoint, *args],
            env=dict(os.environ, ETCDCTL_API="3"),
            capture_output=True,
            text=True,
            timeout=30,
        )
        if check and r.returncode != 0:
            raise RuntimeError(f"etcdctl {args}: {r.stderr}")
        return r

    def keys(self, prefix: str = "crosshost/") -> list[str]:
        """``etcdctl get --prefix <prefix> --keys-only``."""
        out = self._ctl("get", "--prefix", prefix, "--keys-only").stdout
        return [line for line in out.splitlines() if line]

    def transfer_keys(self) -> list[str]:
        return [k for k in self.keys() if k.startswith(("crosshost/recv/", "crosshost/desc/"))]

    def stop(self) -> None:
        """SIGKILL: a crash. The data stays for ``start``."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data, ignore_errors=True)
