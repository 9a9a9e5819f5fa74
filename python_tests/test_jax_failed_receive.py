"""A failed cross-process receive inside JAX is an error, never an abort.

Two JAX processes (jax_failed_receive_worker.py, receive_timeout_ms=3000):
a receive whose sender's array has the wrong size (INVALID_ARGUMENT, from
the sender's check of the destination) and one that is never sent
(DEADLINE_EXCEEDED), and one past the receiver's max_receive_bytes
(RESOURCE_EXHAUSTED, raised by device_put itself; the sender's send fails
at once). On each failed array the receiver calls
block_until_ready, np.asarray, jit (delegated only) and device_put to its other device: every
one raises the transfer's own status -- XLA's CPU plugin, delegated to,
aborts the process when asked for the memory of an alias buffer that was
fulfilled with an error, so the plugin answers those calls itself
(src/compute_plugin/receives.rs). Then 100 more arrays go across and
every byte is checked. Embedded and delegating to XLA's CPU plugin.
"""

from __future__ import annotations

import pytest

import json
import subprocess

from jax_harness import HERE, child_env, free_port, kill_group, skip_unless_jax, start
from test_jax_two_process import run_job

pytestmark = skip_unless_jax()

WORKER = HERE / "jax_failed_receive_worker.py"
OPTIONS = "receive_timeout_ms=3000,send_timeout_ms=3000,max_receive_bytes=1048576"
EXPECTED = {"mismatch": "INVALID_ARGUMENT", "timeout": "DEADLINE_EXCEEDED"}
USES = ["block_until_ready", "asarray", "device_put"]


@pytest.mark.parametrize("compute", [None, "fastatomstruct"])
def test_a_failed_receive_raises_its_own_status_everywhere_and_the_job_goes_on(tmp_path, compute):
    # Fails unless both processes exit 0 with no errors: an abort (SIGABRT,
    # exit -6) is exactly what this test is about.
    sender, receiver = run_job(
        tmp_path, {"PJRT_CROSSHOST_CREATE_OPTIONS": OPTIONS}, compute=compute, worker=WORKER
    )
    failures = receiver["failures"]
    assert sorted(failures) == sorted(EXPECTED), failures
    # Embedded, the plugin has no compiler to run jit with.
    uses = USES if compute is None else USES + ["jit"]
    for case, code in EXPECTED.items():
        assert sorted(failures[case]) == sorted(uses), failures[case]
        for use in uses:
            got = failures[case][use]
            assert got["raised"], f"{case}: {use} did not raise: {got}"
            assert code in got["message"], f"{case}: {use}: {got['message']}"
    assert "expects 20 bytes" in failures["mismatch"]["asarray"]["message"], failures["mismatch"]
    # A receive nobody sends names the likely cause: an uncommitted array.
    assert "sends only committed arrays" in failures["timeout"]["block_until_ready"]["message"], (
        failures["timeout"])
    # Refused by the receiver's max_receive_bytes: device_put raises it
    # there, and the sender's send fails at once, not at send_timeout_ms.
    refused = receiver["refused_put"]
    assert refused["raised"] and "RESOURCE_EXHAUSTED" in refused["message"], refused
    assert "max_receive_bytes = 1048576" in refused["message"], refused
    assert sender["refused_send_failed"] and sender["refused_send_after_s"] < 2.5, sender
    checks = receiver["checks_after"]
    assert len(checks) == 100 and all(checks), checks
    if compute is not None:
        assert receiver["computed"] == pytest.approx(receiver["computed_expected"], rel=1e-6)


DEAD_SENDER_WORKER = HERE / "jax_dead_sender_worker.py"


@pytest.mark.parametrize("compute", [None, "fastatomstruct"])
def test_a_receive_whose_sender_died_raises_unavailable_everywhere_and_the_job_goes_on(
    tmp_path, compute
):
    # Three processes: 0 (JAX's coordinator) sends what comes after, 1
    # receives, 2 sends itself SIGKILL before its send.
    port = free_port()
    env = child_env({"PJRT_CROSSHOST_CREATE_OPTIONS": OPTIONS}, compute=compute)
    outs = [tmp_path / f"result{p}.json" for p in range(3)]
    logs = [tmp_path / f"log{p}.txt" for p in range(3)]
    procs = []
    try:
        for p in range(3):
            with open(logs[p], "w") as log:
                procs.append(start([str(DEAD_SENDER_WORKER), str(p), str(port), str(outs[p])],
                                   env, log=log))
        for p in (2, 1, 0):
            try:
                procs[p].wait(timeout=120)
            except subprocess.TimeoutExpired:
                pytest.fail(f"process {p} did not finish; logs:\n" + "\n".join(
                    f"--- {q} ---\n{logs[q].read_text()[-3000:]}" for q in range(3)))
    finally:
        for proc in procs:
            kill_group(proc)
    texts = [log.read_text() for log in logs]
    assert procs[2].returncode == -9, texts[2][-3000:]
    results = []
    for p in (0, 1):
        assert procs[p].returncode == 0, f"process {p} exit {procs[p].returncode}:\n{texts[p][-4000:]}"
        results.append(json.loads(outs[p].read_text()))
        assert not results[p]["errors"], "\n".join(results[p]["errors"])
    failures = results[1]["failures"]["dead_sender"]
    uses = USES if compute is None else USES + ["jit"]
    assert sorted(failures) == sorted(uses), failures
    for use in uses:
        got = failures[use]
        assert got["raised"], f"{use} did not raise: {got}"
        assert "UNAVAILABLE" in got["message"] and "process 2" in got["message"], (
            f"{use}: {got['message']}")
    checks = results[1]["checks_after"]
    assert len(checks) == 100 and all(checks), checks
