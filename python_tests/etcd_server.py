"""A real etcd server for the tests: Debian's etcd 3.4 (scripts/setup.sh
installs etcd-server and etcd-client) on free localhost ports, its data on
tmpfs (/dev/shm). ``stop`` kills it like a crash and keeps the data;
``start`` brings it back on the same ports. ``close`` kills it and removes
the data. The server dies with the test process (PR_SET_PDEATHSIG).

``EtcdServer(tls=Certificates(dir))`` serves over TLS and demands client
certificates signed by the test's CA (``--client-cert-auth``); ``enable_auth``
turns on etcd's RBAC with a root user and per-job users whose roles grant only
their job's key prefix."""

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


def _openssl(*args: str, cwd: str) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {args}: {r.stderr}")


class Certificates:
    """A CA, a server certificate for 127.0.0.1/localhost and client
    certificates, made with openssl in ``dir`` (EC P-256 keys, PKCS#8)."""

    def __init__(self, dir: str, ca: str = "ca"):
        if shutil.which("openssl") is None:
            raise RuntimeError("openssl is needed: scripts/setup.sh installs it")
        self.dir = dir
        self.ca_name = ca
        os.makedirs(dir, exist_ok=True)
        self._key(f"{ca}.key")
        _openssl("req", "-x509", "-new", "-key", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
                 "-subj", f"/CN=crosshost test {ca}", cwd=dir)
        self.server = self.issue("server", "127.0.0.1", server=True)

    @property
    def ca(self) -> str:
        return os.path.join(self.dir, f"{self.ca_name}.pem")

    def _key(self, name: str) -> None:
        _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
                 "-out", name, cwd=self.dir)

    def issue(self, name: str, common_name: str, server: bool = False) -> tuple[str, str]:
        """(certificate, key) paths of a certificate this CA signs."""
        self._key(f"{name}.key")
        _openssl("req", "-new", "-key", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={common_name}", cwd=self.dir)
        ext = os.path.join(self.dir, f"{name}.ext")
        with open(ext, "w") as f:
            if server:
                f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                        "extendedKeyUsage=serverAuth,clientAuth\n")
            else:
                f.write("extendedKeyUsage=clientAuth\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{self.ca_name}.pem",
                 "-CAkey", f"{self.ca_name}.key", "-CAcreateserial", "-out", f"{name}.pem",
                 "-days", "2", "-extfile", ext, cwd=self.dir)
        return os.path.join(self.dir, f"{name}.pem"), os.path.join(self.dir, f"{name}.key")


class EtcdServer:
    def __init__(self, tls: Certificates | None = None):
        self.tls = tls
        self.root_password: str | None = None
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
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        """The ``kv_store`` option's value."""
        scheme = "etcds" if self.tls else "etcd"
        return f"{scheme}://127.0.0.1:{self.client_port}"

    def start(self) -> None:
        assert self.proc is None, "already running"
        client, peer = self.endpoint, f"http://127.0.0.1:{self.peer_port}"
        tls = []
        if self.tls:
            cert, key = self.tls.server
            tls = ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", self.tls.ca,
                   "--client-cert-auth"]
        self.proc = subprocess.Popen(
            [ETCD, "--name", "crosshost-test", "--data-dir", self.data,
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"crosshost-test={peer}",
             "--logger", "zap", "--log-level", "error", *tls],
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
        access = []
        if self.tls:
            # The server's certificate also serves as etcdctl's client one.
            cert, key = self.tls.server
            access += ["--cacert", self.tls.ca, "--cert", cert, "--key", key]
        if self.root_password:
            access += ["--user", f"root:{self.root_password}"]
        r = subprocess.run(
            [ETCDCTL, "--endpoints", self.endpoint, *access, *args],
            env=dict(os.environ, ETCDCTL_API="3"),
            capture_output=True,
            text=True,
            timeout=30,
        )
        if check and r.returncode != 0:
            raise RuntimeError(f"etcdctl {args}: {r.stderr}")
        return r

    def enable_auth(self, jobs: dict[str, tuple[str, str]]) -> None:
        """RBAC on: a root user, and per job ``user: (password, key prefix)``
        a user whose one role may read and write that prefix only."""
        root_password = uuid.uuid4().hex
        self._ctl("role", "add", "root")
        self._ctl("user", "add", f"root:{root_password}")
        self._ctl("user", "grant-role", "root", "root")
        for user, (password, prefix) in jobs.items():
            self._ctl("role", "add", user)
            self._ctl("role", "grant-permission", user, "--prefix=true", "readwrite", prefix)
            self._ctl("user", "add", f"{user}:{password}")
            self._ctl("user", "grant-role", user, user)
        self._ctl("auth", "enable")
        # From now on etcdctl logs in as root.
        self.root_password = root_password

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
