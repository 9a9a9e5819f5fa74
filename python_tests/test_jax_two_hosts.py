"""JAX across two hosts: a two-process jax.distributed job on the two-host
bed (two_hosts.py, scripts/two-hosts.sh) -- process 0 and JAX's coordinator
on host a (xh-a), process 1 on host b (xh-b), each host with its own
network, pid, IPC and UTS namespace, /dev/shm and boot id, joined by a veth.
200 rounds of mixed shapes and dtypes (single arrays and batches from one
source device) are device_put from process 0's devices onto process 1's,
every byte checked on the receiver (jax_two_hosts_worker.py), and at the end
no transfer key is left in JAX's coordination service. Under JAX 0.10.2 (this
interpreter) and 0.12 (Python 3.12: $PYTHON312, .cache/python312 or pyenv's
3.12.1; skipped when absent).

The job runs with NO crosshost create options: each process must find by
itself the address the other host reaches it at.

Development knob: PJRT_CROSSHOST_TEST_TWO_HOSTS_OPTIONS, when set, is passed
to each process as PJRT_CROSSHOST_CREATE_OPTIONS, with {addr} and {host}
replaced by that host's own bed address and name, e.g.
``PJRT_CROSSHOST_TEST_TWO_HOSTS_OPTIONS='tcp_bind={addr}'`` (what the library
needed before it advertised reachable addresses) or ``transport=tcp``.

Skipped, saying why, where no bed can be made (not root, no iproute2,
namespaces not permitted) or JAX cannot be imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import two_hosts as th
from jax_harness import HERE, REPO, child_env, skip_unless_jax

pytestmark = [
    skip_unless_jax(),
    pytest.mark.skipif(th.unavailable_reason() is not None,
                       reason=f"no two-host bed: {th.unavailable_reason()}"),
]

WORKER = HERE / "jax_two_hosts_worker.py"
# `auto`'s batch rule where UCX's only lane is TCP (src/transfer/route.rs).
TCP_BATCH_MIN_BYTES = 256 << 10
TCP_BATCH_MIN_COUNT = 2
ROUNDS = 200
SEED = 7
TIMEOUT_S = 90
OPTIONS_KNOB = "PJRT_CROSSHOST_TEST_TWO_HOSTS_OPTIONS"


def python312() -> str | None:
    for candidate in (os.environ.get("PYTHON312"),
                      (REPO / ".cache" / "python312").read_text().strip()
                      if (REPO / ".cache" / "python312").is_file() else None,
                      "/root/.pyenv/versions/3.12.1/bin/python"):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


_versions: dict[str, str | None] = {}


def jax_version(python: str) -> str | None:
    if python not in _versions:
        try:
            r = subprocess.run([python, "-c", "import jax, jaxlib; print(jax.__version__)"],
                               capture_output=True, text=True, timeout=120)
            _versions[python] = r.stdout.strip() if r.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            _versions[python] = None
    return _versions[python]


def interpreter(which: str) -> str:
    python = sys.executable if which == "system" else python312()
    if python is None:
        pytest.skip("no Python 3.12 (set $PYTHON312; scripts/setup.sh looks for pyenv's 3.12.1)")
    if which == "py312" and os.path.realpath(python) == os.path.realpath(sys.executable):
        pytest.skip("Python 3.12 is this interpreter: the 'system' case ran it")
    if jax_version(python) is None:
        pytest.skip(f"JAX cannot be imported by {python}")
    return python


def run_two_host_job(bed, tmp_path, python: str, hide_ucx: bool = False) -> tuple[dict, dict]:
    port = bed.port()
    coordinator = f"{bed.hostname('a')}:{port}"
    outs = [tmp_path / f"result{p}.json" for p in (0, 1)]
    logs = [tmp_path / f"log{p}.txt" for p in (0, 1)]
    knob = os.environ.get(OPTIONS_KNOB)
    procs = []
    try:
        for p, host in enumerate(("a", "b")):
            env = child_env()  # crosshost only, the in-repo package, the library under test
            if knob:
                env["PJRT_CROSSHOST_CREATE_OPTIONS"] = knob.format(
                    addr=bed.address(host), host=bed.hostname(host))
            argv = [python, str(WORKER), str(p), coordinator, str(outs[p]), str(ROUNDS), str(SEED)]
            if hide_ucx:
                argv = th.without_ucx(argv)
            with open(logs[p], "w") as log:
                procs.append(bed.popen(
                    host, argv,
                    env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT,
                ))
        deadline = time.monotonic() + TIMEOUT_S
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    th.kill_group(q)
                pytest.fail(f"two-host job timed out after {TIMEOUT_S}s; logs:\n" + "\n".join(
                    f"--- process {q} ---\n{logs[q].read_text()[-4000:]}" for q in (0, 1)))
            if proc.returncode != 0:
                for q in procs:  # the other side would wait at a barrier
                    th.kill_group(q)
        codes = [proc.returncode for proc in procs]
    finally:
        for proc in procs:
            th.kill_group(proc)
    texts = [log.read_text() for log in logs]
    results = []
    for p in (0, 1):
        assert outs[p].is_file(), f"process {p} wrote no result (exit {codes[p]}):\n{texts[p][-4000:]}"
        results.append(json.loads(outs[p].read_text()))
    for p in (0, 1):
        assert codes[p] == 0 and not results[p]["errors"], (
            f"process {p} failed (exit {codes[p]}):\n" + "\n".join(results[p]["errors"])
            + f"\n--- log of process {p} ---\n{texts[p][-4000:]}"
            + f"\n--- log of process {1 - p} ---\n{texts[1 - p][-2000:]}")
    return results[0], results[1]


@pytest.mark.parametrize("route", ["ucx", "tcp-fallback"])
@pytest.mark.parametrize("which", ["system", "py312"])
def test_200_rounds_of_mixed_device_puts_across_two_hosts_every_byte_and_no_key_left(
        two_hosts, tmp_path, which, route):
    python = interpreter(which)
    sender, receiver = run_two_host_job(two_hosts, tmp_path, python, hide_ucx=route != "ucx")
    print(f"JAX {jax_version(python)}: {receiver['transfers']} transfers, "
          f"{receiver['total_bytes']} bytes in {receiver['seconds']:.1f} s")
    print("receiver metrics:", json.dumps(receiver["metrics"]))

    # Two hosts, as the processes see it.
    assert sender["hostname"] == "xh-a" and receiver["hostname"] == "xh-b"
    # Every byte of every array arrived.
    n = receiver["transfers"]
    assert n == sender["transfers"] and n > ROUNDS, (n, ROUNDS)
    assert receiver["checks"] == n and receiver["bad"] == [], receiver["bad"][:5]
    total = receiver["total_bytes"]
    assert total == sender["total_bytes"] > 1_000_000
    s, r = sender["metrics"], receiver["metrics"]
    # Through the plugin's transfers, not around them; none timed out.
    assert s["bytes_sent"] == total and r["bytes_received"] == total, (s, r)
    for m in (s, r):
        assert m["timeouts"] == 0 and m["cancellations"] == 0, m
        assert m["stale_receipts_rejected"] == 0 and m["delete_failures"] == 0, m
    # Every key created was deleted; none is left in JAX's coordination service.
    assert r["keys_created"] > 0 and r["keys_deleted"] == r["keys_created"], r
    assert r["retained_keys"] == 0 and r["keys_outstanding"] == 0, r
    for side in (sender, receiver):
        assert side["jax_store_transfer_keys"] == [], side["jax_store_transfer_keys"][:5]
    # Not through shared memory (the hosts share none): over UCX, whose
    # lanes are TCP over the bed's eth0, or with libucp hidden over the
    # plugin's TCP transport. Where UCX's only lane is TCP, as here, `auto`
    # sends a batch's buffers of at least TCP_BATCH_MIN_BYTES over the TCP
    # transport when TCP_BATCH_MIN_COUNT or more of them come from one peer
    # (src/transfer/route.rs); the plan holds such batches.
    carried = "ucx" if route == "ucx" else "tcp"
    if os.environ.get(OPTIONS_KNOB, "").find("transport=tcp") >= 0:
        carried = "tcp"
    transports = r["transports"]
    assert transports["shm"]["bytes_received"] == 0, transports
    if carried == "tcp":
        split = {"tcp": (total, n), "ucx": (0, 0)}
    else:
        by_tcp = [b for batch in receiver["round_nbytes"] for b in batch
                  if b >= TCP_BATCH_MIN_BYTES
                  and sum(x >= TCP_BATCH_MIN_BYTES for x in batch) >= TCP_BATCH_MIN_COUNT]
        assert by_tcp, "the plan has no batch that auto sends over the TCP transport"
        split = {"tcp": (sum(by_tcp), len(by_tcp)),
                 "ucx": (total - sum(by_tcp), n - len(by_tcp))}
    for transport, (nbytes, count) in split.items():
        assert transports[transport]["bytes_received"] == nbytes, (transport, transports)
        assert transports[transport]["transfers_received"] == count, (transport, transports)
        assert s["transports"][transport]["bytes_sent"] == nbytes, (transport, s["transports"])
    if carried == "ucx":
        lanes = transports["ucx"]["lanes"]
        assert "tcp/eth0" in lanes, lanes
        assert not any(t in lanes for t in ("posix", "sysv", "cma")), lanes
