"""A receiver that stops inside a two-process JAX job, while its sender goes
on making and sending a fresh 1 MiB array every few milliseconds as a
training loop would (issue 18: such a sender reached 21.9 GiB of waiting
sends).

- killed with SIGKILL: within 10 s the sends fail with UNAVAILABLE naming the
  dead process, and for 60 s the sender's memory stays within its bound;
- frozen with SIGSTOP (alive, its links open, never receiving): the sends
  waiting for it hold at most max_pending_send_bytes, every send past that
  fails at once with RESOURCE_EXHAUSTED naming the bound, and the RSS stays
  within the bound.

JAX drops a send's future, so the failures are read from the plugin's
metrics (`sends_failed`, `pending_send_bytes`) and from JAX's log of each
failed send. JAX 0.10.2 (this interpreter) and 0.12 (Python 3.12, skipped
when absent)."""
from __future__ import annotations

import json
import subprocess

import pytest

from jax_harness import HERE, REPO, child_env, free_port, kill_group, skip_unless_jax
from test_jax_two_hosts import interpreter

pytestmark = skip_unless_jax()

WORKER = HERE / "jax_dead_receiver_worker.py"
SECONDS = {"killed": 60, "frozen": 20}
BOUND = 64 << 20
# What else the sender's RSS may grow by in 60 s: JAX's and the plugin's own
# allocations (arrays made and dropped, logs, compiled transfers).
SLACK = 192 << 20


def run_job(tmp_path, python: str, mode: str) -> tuple[dict, str]:
    """Runs the job; returns the sender's result and log."""
    port = free_port()
    env = child_env({
        "PJRT_CROSSHOST_CREATE_OPTIONS": f"max_pending_send_bytes={BOUND}",
    })
    outs = [tmp_path / f"result{p}.json" for p in (0, 1)]
    logs = [tmp_path / f"log{p}.txt" for p in (0, 1)]
    procs = []
    try:
        for p in (0, 1):
            with open(logs[p], "w") as log:
                procs.append(subprocess.Popen(
                    [python, str(WORKER), str(p), str(port), str(outs[p]),
                     str(SECONDS[mode]), mode],
                    env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True))
        procs[0].wait(timeout=SECONDS[mode] + 120)
        if mode == "killed":
            procs[1].wait(timeout=10)
    finally:
        for proc in procs:
            kill_group(proc)
    texts = [log.read_text() for log in logs]
    if mode == "killed":
        assert procs[1].returncode == -9, f"the receiver did not die by SIGKILL:\n{texts[1][-3000:]}"
    assert procs[0].returncode == 0, f"sender exit {procs[0].returncode}:\n{texts[0][-4000:]}"
    sender = json.loads(outs[0].read_text())
    assert not sender["errors"], "\n".join(sender["errors"])
    samples = sender["samples"]
    assert samples and samples[-1]["t"] > SECONDS[mode] - 5, samples[-3:]
    assert sender["bound"] == BOUND, sender["bound"]
    return sender, texts[0]


def rss_growth(sender: dict) -> int:
    return max(s["rss"] for s in sender["samples"]) - sender["rss_at_kill"]


@pytest.mark.parametrize("which", ["system", "py312"])
def test_a_killed_receivers_sender_fails_its_sends_naming_it_and_stays_within_its_bound(
    tmp_path, which
):
    sender, log = run_job(tmp_path, interpreter(which), "killed")
    samples = sender["samples"]
    # Within 10 s of the kill the sends fail, and keep failing.
    failing = [s for s in samples if s["sends_failed"] > 0]
    assert failing and failing[0]["t"] < 10, samples[:12]
    assert samples[-1]["sends_failed"] > failing[0]["sends_failed"], samples[-3:]
    assert "UNAVAILABLE" in log and "receiving process 1 is gone" in log, log[-4000:]
    # Memory: the sends waiting never pass the bound, nor the RSS what the
    # bound allows.
    assert max(s["pending_send_bytes"] for s in samples) <= BOUND, samples
    assert rss_growth(sender) <= BOUND + SLACK, (rss_growth(sender), samples)
    assert sender["sent"] > 1000, sender["sent"]


@pytest.mark.parametrize("which", ["system", "py312"])
def test_a_frozen_receivers_sender_holds_at_most_its_bound_and_fails_the_sends_past_it(
    tmp_path, which
):
    sender, log = run_job(tmp_path, interpreter(which), "frozen")
    samples = sender["samples"]
    held = max(s["pending_send_bytes"] for s in samples)
    # Full up to the last 1 MiB send that fits, never past it.
    assert BOUND - (1 << 20) < held <= BOUND, samples
    assert samples[-1]["sends_failed"] > 100, samples[-3:]
    assert "RESOURCE_EXHAUSTED" in log and f"max_pending_send_bytes = {BOUND}" in log, log[-4000:]
    assert rss_growth(sender) <= BOUND + SLACK, (rss_growth(sender), samples)
