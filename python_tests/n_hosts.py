"""N hosts on one machine for tests and benchmarks: a Python face of
scripts/n-hosts.sh (see there for what a bed is and why each part exists).

    from n_hosts import NHostBed

    with NHostBed(16, store=True) as bed:
        kv = bed.popen("store", ["python3", "server.py"])
        workers = [bed.popen(h, ["python3", "worker.py", str(h)]) for h in bed.hosts]
        ...
    # every process started on the bed is killed; the bed is gone

Host i (0..N-1) is 10.78.0.<i+1>, named xh-<i>; the store host, when asked
for, is 10.78.0.254, named xh-store. Each host has its own network (lo +
eth0 on the bed's bridge), pid, IPC, UTS (hostname) and mount namespace with
a private /dev/shm, its own boot id, and an /etc/hosts naming every host.
Every neighbour entry is pinned, so no ARP is needed on the bed.

Cleanup is the two-host bed's (bed_common.py): ``close()`` kills every
process group it started, then deletes the bed; a watchdog deletes it when
the creator dies without that; beds are named ``xhnet<creator pid>-<suffix>``
and ``n-hosts.sh reap`` (run before each new bed) removes any whose creator
is gone.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

from bed_common import (  # noqa: F401 - re-exported
    HERE, REPO, Bed, BedScript, BedUnavailable, kill_group, read_line, without_ucx,
)

SCRIPT = REPO / "scripts" / "n-hosts.sh"
STATE_ROOT = Path(os.environ.get("XH_NBED_STATE_ROOT", "/tmp/pjrt-crosshost-nbeds"))
NET = "10.78.0"
STORE = "store"
SCRIPT_TIMEOUT_S = 180.0

_script = BedScript(SCRIPT, SCRIPT_TIMEOUT_S)
unavailable_reason = _script.unavailable_reason
reap = _script.reap


def bed_parts(name: str) -> list[str]:
    """What of bed ``name`` exists: its namespaces and its state dir."""
    parts = [p.name for p in Path("/run/netns").glob(f"{name}-*")
             if p.name[len(name) + 1:] in ("sw", STORE) or p.name[len(name) + 1:].lstrip("h").isdigit()]
    if (STATE_ROOT / name).exists():
        parts.append(str(STATE_ROOT / name))
    return sorted(parts)


class NHostBed(Bed):
    """One bed of ``count`` hosts (0..count-1) and, with ``store``, the
    store host. Use as a context manager (or call ``up()`` and ``close()``)."""

    script = _script
    prefix = "xhnet"

    def __init__(self, count: int, store: bool = False, name: str | None = None):
        self.count = count
        self.store = store
        super().__init__(name)

    @property
    def hosts(self) -> list[int]:
        """The job hosts, 0..count-1 (the store host apart)."""
        return list(range(self.count))

    def _up_args(self) -> list[str]:
        return [str(self.count), *([STORE] if self.store else [])]

    def _leftovers(self) -> bool:
        return bool(bed_parts(self.name))

    # -- hosts -------------------------------------------------------------

    def _host(self, host) -> str:
        if host == STORE and self.store:
            return STORE
        if isinstance(host, int) and 0 <= host < self.count:
            return str(host)
        raise ValueError(f"bed {self.name} has no host {host!r}")

    def address(self, host) -> str:
        """The host's address: 10.78.0.<host+1>, the store host's 10.78.0.254."""
        h = self._host(host)
        return f"{NET}.254" if h == STORE else f"{NET}.{int(h) + 1}"

    def hostname(self, host) -> str:
        """The host's name, in every host's /etc/hosts: xh-<host>, xh-store."""
        return f"xh-{self._host(host)}"

    def netns(self, host) -> str:
        """The host's network namespace (`ip netns` name)."""
        h = self._host(host)
        return f"{self.name}-{STORE if h == STORE else 'h' + h}"

    def switch_port(self, host) -> tuple[str, str]:
        """(namespace, interface) of the host's port on the bed's bridge."""
        h = self._host(host)
        return f"{self.name}-sw", "ps" if h == STORE else f"p{h}"

    # -- faults ------------------------------------------------------------

    def drop_packets(self, host) -> None:
        """Every packet to and from ``host`` is dropped from now on: a queue
        of length 0 (pfifo limit 0) on its eth0 and on its bridge port (the
        kernel here has neither netem nor tc actions)."""
        switch, port = self.switch_port(host)
        for netns, dev in ((self.netns(host), "eth0"), (switch, port)):
            subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev,
                            "root", "pfifo", "limit", "0"], check=True, capture_output=True)

    def pass_packets(self, host) -> None:
        """Undoes ``drop_packets``."""
        switch, port = self.switch_port(host)
        for netns, dev in ((self.netns(host), "eth0"), (switch, port)):
            subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)

    def dropped(self, host) -> int:
        """Packets dropped so far by ``drop_packets`` on the host's eth0 and port."""
        switch, port = self.switch_port(host)
        total = 0
        for netns, dev in ((self.netns(host), "eth0"), (switch, port)):
            out = subprocess.run(["ip", "netns", "exec", netns, "tc", "-s", "qdisc", "show", "dev", dev],
                                 capture_output=True, text=True).stdout
            if "pfifo" in out and "dropped" in out:
                total += int(out.split("dropped", 1)[1].split(",", 1)[0])
        return total


def command_pid(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """The machine's pid of the command a ``popen`` runs (the child of the
    run's process), e.g. to read its /proc/<pid>/stat from here."""
    deadline = time.monotonic() + timeout
    while True:
        # Once the run has become the bed's init.pl (before that, the script's
        # own subshells are its children), its one child is the command.
        try:
            with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                running = b"init.pl\0run\0" in f.read()
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children = f.read().split()
        except OSError:
            running, children = False, []
        if running and children:
            return int(children[0])
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no command under run {proc.pid} (exit {proc.poll()})")
        time.sleep(0.01)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


ETCD = next((p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.path.exists(p)), None)
ETCDCTL = shutil.which("etcdctl")
ETCD_PORT = 2379


class BedEtcd:
    """etcd on the bed's store host, serving ``etcd://xh-store:2379`` to
    the hosts; its data in the store host's own /dev/shm (a tmpfs that
    vanishes with the host). Stopped with the bed, or by ``stop()``."""

    def __init__(self, bed: NHostBed, timeout: float = 30.0):
        if ETCD is None or ETCDCTL is None:
            raise RuntimeError("etcd and etcdctl are needed: scripts/setup.sh installs Debian's "
                               "etcd-server and etcd-client")
        self.bed = bed
        addr = bed.address(STORE)
        client, peer = f"http://{addr}:{ETCD_PORT}", f"http://127.0.0.1:{ETCD_PORT + 1}"
        self.url = f"etcd://{addr}:{ETCD_PORT}"
        self.endpoint = client
        self.data = f"/dev/shm/etcd-{secrets.token_hex(6)}"
        self.proc = bed.popen(STORE, [
            ETCD, "--name", "bed-store", "--data-dir", self.data,
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"bed-store={peer}", "--logger", "zap", "--log-level", "error",
        ], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.pid = command_pid(self.proc)
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                rc = self.proc.poll()
                self.stop()
                raise RuntimeError(f"etcd on the store host did not become healthy (rc={rc})")
            time.sleep(0.05)

    def ctl(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        return self.bed.run(STORE, [ETCDCTL, "--endpoints", self.endpoint, *args], timeout=timeout,
                            env=dict(os.environ, ETCDCTL_API="3"))

    def healthy(self) -> bool:
        return self.ctl("--command-timeout=1s", "endpoint", "health").returncode == 0

    def keys(self, prefix: str = "crosshost/") -> list[str]:
        r = self.ctl("get", "--prefix", prefix, "--keys-only")
        assert r.returncode == 0, r.stderr
        return [line for line in r.stdout.splitlines() if line]

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def stop(self) -> None:
        """Kills etcd and removes its data (from the store host's /dev/shm,
        which would also go with the bed)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        kill_group(proc)
        if self.bed.is_up:
            self.bed.run(STORE, ["rm", "-rf", self.data], timeout=30)
