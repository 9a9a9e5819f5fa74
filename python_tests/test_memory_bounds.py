"""The default memory bounds follow the memory a process may use: in a
cgroup with a memory limit (a container, a batch job's step), the default
max_receive_bytes is half that limit and max_pending_send_bytes a quarter,
not fractions of the host's memory, which would bound nothing there (issue
18). The bounds themselves are tested with explicit values
(test_transfers_v2.py, test_transfers_processes.py); here a real kernel
cgroup, made and removed by the test, sets the limit."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import run_child_python

LIMIT = 1 << 30


def _memory_cgroup():
    """(directory of this process's memory cgroup, limit file) or a reason."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError as e:
        return None, f"/proc/self/cgroup: {e}"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            if "memory" in (base / "cgroup.controllers").read_text(errors="replace").split():
                return base, "memory.max"
    return None, "no memory cgroup controller"


@pytest.fixture
def limited_cgroup():
    """A child memory cgroup limited to LIMIT bytes; removed afterwards."""
    parent, limit_file = _memory_cgroup()
    if parent is None:
        pytest.skip(limit_file)
    group = parent / f"crosshost-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a cgroup under {parent}: {e}")
    try:
        (group / limit_file).write_text(str(LIMIT))
        yield group
    finally:
        group.rmdir()


CHILD = """
import transfer_helpers as th
c = api.create_client()
m = th.metrics(c)
print(json.dumps({k: m[k] for k in ("max_receive_bytes", "max_pending_send_bytes")}))
c.destroy()
"""


def test_in_a_cgroup_with_a_memory_limit_the_default_bounds_are_fractions_of_it(limited_cgroup):
    procs = limited_cgroup / "cgroup.procs"
    joined = run_child_python(CHILD, preexec_fn=lambda: procs.write_text(str(os.getpid())))
    assert joined.returncode == 0, joined.stderr
    bounds = json.loads(joined.stdout.strip().splitlines()[-1])
    assert bounds == {"max_receive_bytes": LIMIT // 2, "max_pending_send_bytes": LIMIT // 4}, bounds
    # The same child outside the cgroup: fractions of the machine, far more.
    free = run_child_python(CHILD)
    assert free.returncode == 0, free.stderr
    machine = json.loads(free.stdout.strip().splitlines()[-1])
    assert machine["max_receive_bytes"] > LIMIT, machine
    assert machine["max_pending_send_bytes"] == machine["max_receive_bytes"] // 2, machine
