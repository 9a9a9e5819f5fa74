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

Cleanup (bed_common.py, shared with the N-host bed): ``close()`` (the
``with`` block's end, also when it raised) kills every process group it
started, then deletes the bed. A bed left by a process that died without
that (SIGKILL) is removed by a watchdog started with it -- a ``/bin/sh`` in
its own session, blocked reading a pipe only the creator holds: when the
creator dies the pipe closes and the watchdog runs ``two-hosts.sh down``.
Beds are named ``xhbed<creator pid>-<suffix>`` so that ``two-hosts.sh
reap`` (run before each new bed) removes any bed whose creator is gone even
if its watchdog never ran.
"""

from __future__ import annotations

import os
from pathlib import Path

from bed_common import (  # noqa: F401 - re-exported
    HERE, REPO, Bed, BedScript, BedUnavailable, kill_group, read_line, without_ucx,
)

SCRIPT = REPO / "scripts" / "two-hosts.sh"
STATE_ROOT = Path(os.environ.get("XH_BED_STATE_ROOT", "/tmp/pjrt-crosshost-beds"))

HOSTS = ("a", "b")
ADDRESSES = {"a": "10.77.0.1", "b": "10.77.0.2"}
HOSTNAMES = {"a": "xh-a", "b": "xh-b"}
SCRIPT_TIMEOUT_S = 60.0

_script = BedScript(SCRIPT, SCRIPT_TIMEOUT_S)
unavailable_reason = _script.unavailable_reason
reap = _script.reap


def bed_exists(name: str) -> dict[str, bool]:
    """What of bed ``name`` exists: its namespaces and its state dir."""
    return {
        "netns_a": Path(f"/run/netns/{name}-a").exists(),
        "netns_b": Path(f"/run/netns/{name}-b").exists(),
        "state_dir": (STATE_ROOT / name).exists(),
    }


class TwoHostBed(Bed):
    """One bed: two hosts, "a" and "b". Use as a context manager (or call
    ``up()`` and ``close()``)."""

    script = _script
    prefix = "xhbed"

    def _leftovers(self) -> bool:
        return any(bed_exists(self.name).values())

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
