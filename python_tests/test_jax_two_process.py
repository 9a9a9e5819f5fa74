"""JAX cross-process device_put through the plugin's v2 path, without a
compute plugin (embedded) and delegating to XLA's CPU plugins; and a job
that computes on both sides of 200 transfers (test_compute_on_both_sides...).

Two Python processes join a jax.distributed job on 127.0.0.1 with
JAX_PLATFORMS=crosshost (JAX only uses cross-host transfers of the default
backend). Process 0's arrays are device_put onto process 1's devices --
several shapes and dtypes one call each, and a batch of arrays in one call,
in two rounds -- and process 1 checks every byte
(jax_two_process_worker.py). Both children are bounded by a timeout and
killed, with their process groups, on any failure.

Metrics: JAX never hands out its PJRT_Client*, so the workers read
pjrt_crosshost_live_clients_metrics_json() (jax_plugins.crosshost.metrics()).

Keys: by default the plugin keeps only its session in JAX's coordination
service (reached through the PJRT KV callbacks) and carries each transfer's
keys (completion receipt + descriptor) over control links between the two
processes (kv/peer.rs), where they are really deleted: the receiver reports
keys_deleted = keys_created = 2 x buffers received, and the workers list JAX's
store (key_value_dir_get_bytes) to show that no transfer key is in it. With
kv_store=callbacks every key goes through JAX's store, which the PJRT C API
gives no delete: the package registers one (pjrt_crosshost_set_kv_delete,
calling JAX's key_value_delete), so those keys are deleted too; without it
(PJRT_CROSSHOST_JAX_KV_DELETE=0) each buffer leaves its two keys there
(retained_keys = 2 x buffers), and the epoch and per-buffer nonces keep those
from ever completing a later buffer. The delete route's hazards (the GIL, a
failing delete, a hanging one) have a test each (jax_kv_delete_worker.py),
and a job of 1,000 transfers ends with transfers in flight at exit
(jax_thousand_worker.py).

Known JAX 0.10.2 limitation (test_mixed_source_batch_never_delivers_wrong_data):
in one device_put batch whose arrays come from several source devices, JAX
numbers the transfer keys per source-device group in a hash-map order that
differs between the processes, so sender and receiver may give one key to
different arrays. The plugin's key names include both device ids, so such
buffers fail with DEADLINE_EXCEEDED after receive_timeout_ms; they never
receive another array's bytes. Batches from one source device always work.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from jax_harness import (
    COMPUTE_PLUGINS,
    HERE,
    child_env,
    free_port,
    kill_group,
    run_python,
    skip_unless_jax,
    start,
)

pytestmark = skip_unless_jax()

WORKER = HERE / "jax_two_process_worker.py"
COMPUTE_WORKER = HERE / "jax_compute_worker.py"
THOUSAND_WORKER = HERE / "jax_thousand_worker.py"
DELETE_WORKER = HERE / "jax_kv_delete_worker.py"
MODES = [None, "fastatomstruct"]
TIMEOUT_S = 180
KEYS_PER_RECEIVED_BUFFER = 2  # completion receipt + descriptor (v2)


def run_job(tmp_path, extra_env=None, mode="standard", compute=None, worker=WORKER, args=None):
    port = free_port()
    env = child_env(extra_env, compute=compute)
    outs = [tmp_path / f"result{p}.json" for p in (0, 1)]
    logs = [tmp_path / f"log{p}.txt" for p in (0, 1)]
    procs = []
    try:
        for p in (0, 1):
            with open(logs[p], "w") as log:
                argv = [str(worker), str(p), str(port), str(outs[p]), *(args or [mode])]
                procs.append(start(argv, env, log=log))
        deadline = time.monotonic() + TIMEOUT_S
        for p, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    kill_group(q)
                pytest.fail(
                    f"two-process job timed out after {TIMEOUT_S}s; logs:\n"
                    + "\n".join(f"--- process {q} ---\n{logs[q].read_text()}" for q in (0, 1))
                )
            if proc.returncode != 0:
                # One side failed: the other would wait at a barrier.
                for q in procs:
                    kill_group(q)
        codes = [proc.returncode for proc in procs]
    finally:
        for proc in procs:
            kill_group(proc)
    logs = [log.read_text() for log in logs]
    results = []
    for p in (0, 1):
        assert outs[p].is_file(), f"process {p} wrote no result (exit {codes[p]}):\n{logs[p]}"
        results.append(json.loads(outs[p].read_text()))
    for p in (0, 1):
        assert codes[p] == 0 and not results[p]["errors"], (
            f"process {p} failed (exit {codes[p]}):\n"
            + "\n".join(results[p]["errors"])
            + f"\n--- log ---\n{logs[p]}"
        )
    return results


def expected_devices(compute):
    """Global ids of the job: embedded, in process order; delegated, XLA's
    numbering (process * 2048 + i)."""
    p1 = [2, 3] if compute is None else [2048, 2049]
    return [[0, 0], [1, 0], [p1[0], 1], [p1[1], 1]], [0, 1], p1


@pytest.mark.parametrize("compute", MODES)
def test_cross_process_device_put_every_byte_and_metrics(tmp_path, compute):
    sender, receiver = run_job(tmp_path, compute=compute)

    devices, local0, local1 = expected_devices(compute)
    assert sender["devices"] == devices and receiver["devices"] == devices
    assert sender["local_devices"] == local0 and receiver["local_devices"] == local1

    n = receiver["num_transfers"]
    checks = receiver["checks"]
    assert len(checks) == n and n >= 30, checks
    bad = [c for c in checks if not all(v for k, v in c.items() if k.endswith("_ok"))]
    assert not bad, f"received arrays differ from what was sent: {bad}"
    total = receiver["total_bytes"]
    assert total == sum(c["nbytes"] for c in checks) and total > 1_000_000

    s, r = sender["metrics"], receiver["metrics"]
    # Every transfer completed, on both sides.
    assert s["bytes_sent"] == total and r["bytes_received"] == total, (s, r)
    # No stale completion, no timeout, no cancellation, no failed delete.
    for m in (s, r):
        assert m["stale_receipts_rejected"] == 0, m
        assert m["timeouts"] == 0 and m["cancellations"] == 0, m
        assert m["delete_failures"] == 0, m
    # The sender never creates (or deletes) completion keys.
    assert s["keys_created"] == 0 and s["keys_outstanding"] == 0, s
    # Receiver: two keys per buffer, each deleted once the buffer's outcome
    # was published; none retained, none pending, none in JAX's store.
    assert r["keys_created"] == KEYS_PER_RECEIVED_BUFFER * n, r
    assert r["keys_deleted"] == r["keys_created"] and r["retained_keys"] == 0, r
    assert r["keys_outstanding"] == 0, r
    for side in (sender, receiver):
        assert side["jax_store_transfer_keys"] == [], side["jax_store_transfer_keys"][:5]
    # One client per process.
    assert len(sender["clients"]) == 1 and sender["clients"][0]["process_index"] == 0
    assert len(receiver["clients"]) == 1 and receiver["clients"][0]["process_index"] == 1


@pytest.mark.parametrize("compute", MODES)
def test_cross_process_device_put_over_tcp(tmp_path, compute):
    # The same job with the plugin's TCP transport instead of shared memory.
    _, receiver = run_job(
        tmp_path, {"PJRT_CROSSHOST_CREATE_OPTIONS": "transport=tcp"}, compute=compute
    )
    bad = [c for c in receiver["checks"] if not all(v for k, v in c.items() if k.endswith("_ok"))]
    assert not bad and len(receiver["checks"]) == receiver["num_transfers"], bad
    assert receiver["metrics"]["bytes_received"] == receiver["total_bytes"]
    assert receiver["metrics"]["stale_receipts_rejected"] == 0


@pytest.mark.parametrize("store", ["peer", "callbacks"])
def test_with_a_job_secret_every_value_in_jax_store_is_sealed(tmp_path, store):
    # PJRT_CROSSHOST_JOB_SECRET_FILE: the package passes job_secret_file;
    # what the plugin leaves in JAX's coordination service (its session;
    # with kv_store=callbacks each transfer's keys too) is sealed, and the
    # job's transfers are what they would be without it.
    secret = tmp_path / "job-secret"
    secret.write_bytes(os.urandom(32))
    env = {"PJRT_CROSSHOST_JOB_SECRET_FILE": str(secret)}
    if store == "callbacks":
        env["PJRT_CROSSHOST_CREATE_OPTIONS"] = "kv_store=callbacks"
    sender, receiver = run_job(tmp_path, env)
    checks = receiver["checks"]
    bad = [c for c in checks if not all(v for k, v in c.items() if k.endswith("_ok"))]
    assert not bad and len(checks) == receiver["num_transfers"], bad
    for side in (sender, receiver):
        values = side["jax_store_values"]
        assert any(k.endswith("/epoch") for k in values), values
        unsealed = {k: v for k, v in values.items() if not v.startswith("xsv1")}
        assert not unsealed, unsealed
        assert side["metrics"]["forged_values_rejected"] == 0, side["metrics"]


def test_cross_process_device_put_with_every_key_in_etcd(tmp_path):
    # kv_store=etcd://: the session and every transfer key in a real etcd
    # server, none in JAX's coordination service; afterwards none in etcd.
    from etcd_server import EtcdServer
    from transfer_helpers import poll_until

    etcd = EtcdServer()
    try:
        options = f"kv_store={etcd.url},etcd_lease_ttl_s=2"
        _, receiver = run_job(tmp_path, {"PJRT_CROSSHOST_CREATE_OPTIONS": options})
        checks = receiver["checks"]
        bad = [c for c in checks if not all(v for k, v in c.items() if k.endswith("_ok"))]
        assert not bad and len(checks) == receiver["num_transfers"], bad
        r = receiver["metrics"]
        assert r["bytes_received"] == receiver["total_bytes"], r
        assert r["keys_deleted"] == r["keys_created"] == KEYS_PER_RECEIVED_BUFFER * len(checks), r
        assert receiver["jax_store_transfer_keys"] == []
        # Deleted as each buffer was retired; whatever else the processes
        # wrote went with their leases (revoked, or expired if JAX exited
        # without destroying its client).
        assert not etcd.transfer_keys(), etcd.transfer_keys()[:5]
        assert poll_until(lambda: etcd.keys() == [], 5), etcd.keys()
    finally:
        etcd.close()


@pytest.mark.parametrize("route", ["jax_delete", "no_delete"])
def test_with_kv_store_callbacks_keys_in_jax_store_are_deleted_through_jax_or_never_complete_a_later_buffer(
    tmp_path, route
):
    # Every key through JAX's store. With the package's delete route
    # (default) each key is deleted through JAX's distributed client once the
    # buffer's outcome is published: none is left in JAX's store. Without it
    # (PJRT_CROSSHOST_JAX_KV_DELETE=0, a runtime that gives no delete) each
    # buffer leaves its two keys, and the second round still gets the second
    # round's bytes.
    env = {"PJRT_CROSSHOST_CREATE_OPTIONS": "kv_store=callbacks"}
    if route == "no_delete":
        env["PJRT_CROSSHOST_JAX_KV_DELETE"] = "0"
    sender, receiver = run_job(tmp_path, env)
    n = receiver["num_transfers"]
    bad = [c for c in receiver["checks"] if not all(v for k, v in c.items() if k.endswith("_ok"))]
    assert not bad and len(receiver["checks"]) == n, bad
    r = receiver["metrics"]
    assert r["keys_created"] == KEYS_PER_RECEIVED_BUFFER * n, r
    assert r["stale_receipts_rejected"] == 0 and r["timeouts"] == 0, r
    assert r["delete_failures"] == 0, r
    left = receiver["jax_store_transfer_keys"]
    if route == "jax_delete":
        assert r["keys_deleted"] == r["keys_created"] and r["retained_keys"] == 0, r
        assert r["keys_outstanding"] == 0, r
        assert left == [] and sender["jax_store_transfer_keys"] == [], left[:5]
    else:
        assert r["retained_keys"] == r["keys_created"] and r["keys_deleted"] == 0, r
        assert r["keys_outstanding"] == r["retained_keys"], r
        # The listing the other tests rely on does see them.
        assert len(left) == r["keys_created"], (len(left), r)


def test_mixed_source_batch_never_delivers_wrong_data(tmp_path):
    options = {"PJRT_CROSSHOST_CREATE_OPTIONS": "receive_timeout_ms=4000,send_timeout_ms=4000"}
    _, receiver = run_job(tmp_path, options, mode="mixed")
    checks = receiver["checks"]
    assert len(checks) == 6, checks
    failed = [c for c in checks if "error" in c]
    for c in failed:
        assert "DEADLINE_EXCEEDED" in c["error"] and "no receipt" in c["error"], c
    wrong = [c for c in checks if "error" not in c and not all(
        v for k, v in c.items() if k.endswith("_ok"))]
    assert not wrong, f"a buffer received another array's data: {wrong}"
    m = receiver["metrics"]
    assert m["timeouts"] == len(failed) and m["stale_receipts_rejected"] == 0, m
    assert m["keys_created"] == KEYS_PER_RECEIVED_BUFFER * 6, m
    assert m["keys_outstanding"] == m["retained_keys"], m


@pytest.mark.parametrize("store", ["peer", "callbacks"])
def test_1000_mixed_size_device_puts_leave_no_key_in_jax_store_and_exit_cleanly_in_flight(
    tmp_path, store
):
    # 1,000 arrays of 16 B to 1 MiB, every byte checked; the keys go to the
    # peer store (default) or through JAX's store with the package's delete
    # route (kv_store=callbacks). Either way none is left in JAX's store and
    # every key created was deleted. Then both processes exit with 16 more
    # transfers in flight: exit code 0 (run_job), no crash, no hang.
    env = {"PJRT_CROSSHOST_CREATE_OPTIONS": "kv_store=callbacks"} if store == "callbacks" else {}
    sender, receiver = run_job(tmp_path, env, worker=THOUSAND_WORKER)
    assert receiver["transfers"] == 1000 and receiver["checks"] == 1000, receiver
    assert not receiver["bad"], receiver["bad"][:5]
    total = receiver["total_bytes"]
    assert sender["total_bytes"] == total > 100_000_000
    s, r = sender["metrics"], receiver["metrics"]
    assert s["bytes_sent"] == total and r["bytes_received"] == total, (s, r)
    assert r["keys_created"] == KEYS_PER_RECEIVED_BUFFER * 1000, r
    assert r["keys_deleted"] == r["keys_created"] and r["retained_keys"] == 0, r
    assert r["keys_outstanding"] == 0 and r["delete_failures"] == 0, r
    for m in (s, r):
        assert m["timeouts"] == 0 and m["stale_receipts_rejected"] == 0, m
    for side in (sender, receiver):
        assert side["jax_store_transfer_keys"] == [], side["jax_store_transfer_keys"][:5]
    for p in (0, 1):
        log = (tmp_path / f"log{p}.txt").read_text()
        assert "exiting with transfers in flight" in log, log[-3000:]
        for fatal in ("Segmentation fault", "Fatal Python error", "panicked", "core dumped"):
            assert fatal not in log, log[-3000:]


def _delete_route_job(tmp_path, mode, options="kv_store=callbacks"):
    _, receiver = run_job(
        tmp_path, {"PJRT_CROSSHOST_CREATE_OPTIONS": options}, worker=DELETE_WORKER, args=[mode]
    )
    assert not receiver["bad"] and receiver["transfers"] == 4, receiver
    return receiver


def test_the_jax_delete_route_never_makes_readiness_wait_for_the_gil(tmp_path):
    # The receiver holds the GIL while the sender sends: every byte arrives
    # and is counted (readiness needs no Python); no delete has run yet (they
    # need the GIL, and come after readiness). Then all of them do.
    receiver = _delete_route_job(tmp_path, "gil")
    held = receiver["while_gil_held"]
    assert held["bytes_received"] == receiver["total_bytes"], held
    assert held["keys_deleted"] == 0, held
    r = receiver["metrics"]
    assert r["keys_deleted"] == r["keys_created"] == 2 * 4 and r["delete_failures"] == 0, r
    assert receiver["jax_store_transfer_keys"] == [], receiver["jax_store_transfer_keys"]


def test_the_jax_delete_route_failing_is_counted_and_the_buffers_stand(tmp_path):
    receiver = _delete_route_job(tmp_path, "failing")
    r = receiver["metrics"]
    assert receiver["delete_calls"] == r["keys_created"] == 2 * 4, (receiver["delete_calls"], r)
    assert r["delete_failures"] == r["keys_created"] and r["keys_deleted"] == 0, r
    assert r["timeouts"] == 0 and r["bytes_received"] == receiver["total_bytes"], r
    # The failed deletes left their keys where they were.
    assert len(receiver["jax_store_transfer_keys"]) == r["keys_created"], receiver


def test_the_jax_delete_route_hanging_is_bounded_by_kv_call_timeout(tmp_path):
    receiver = _delete_route_job(tmp_path, "hanging", "kv_store=callbacks,kv_call_timeout_ms=500")
    r = receiver["metrics"]
    assert r["delete_failures"] == r["keys_created"] == 2 * 4 and r["keys_deleted"] == 0, r
    assert r["timeouts"] == 0 and r["bytes_received"] == receiver["total_bytes"], r


@pytest.mark.parametrize("compute", COMPUTE_PLUGINS)
def test_compute_on_both_sides_of_200_cross_process_transfers(tmp_path, compute):
    rounds = 200
    sender, receiver = run_job(
        tmp_path, compute=compute, worker=COMPUTE_WORKER, args=[str(rounds)]
    )
    assert receiver["checks"] == rounds and not receiver["bad"], receiver["bad"][:5]
    total = receiver["total_bytes"]
    assert sender["total_bytes"] == total and total > 20_000_000
    # The bytes went through the plugin's transfers, not around them.
    assert sender["metrics"]["bytes_sent"] == total, sender["metrics"]
    assert receiver["metrics"]["bytes_received"] == total, receiver["metrics"]
    for side in (sender, receiver):
        m = side["metrics"]
        assert m["timeouts"] == 0 and m["cancellations"] == 0 and m["stale_receipts_rejected"] == 0, m
        assert side["compute_plugin"], side


def _readme_demo(name: str) -> str:
    """The python block after "save this as `name`" in README.md (its
    single-process and two-process examples)."""
    text = (HERE.parent / "README.md").read_text()
    m = re.search(rf"[Ss]ave this as `{re.escape(name)}`.*?```python\n(.*?)```", text, re.S)
    assert m, f"README.md has no example {name}"
    return m.group(1)


def test_readme_jax_demos_run(tmp_path):
    single = tmp_path / "single.py"
    single.write_text(_readme_demo("single.py"))
    code, out = run_python([str(single)], timeout=120, env=child_env(compute="fastatomstruct"))
    assert code == 0 and "66.0" in out and "(3, 3) 2.0" in out, out

    port = free_port()
    two = tmp_path / "two_process.py"
    two.write_text(_readme_demo("two_process.py").replace("127.0.0.1:12345", f"127.0.0.1:{port}"))
    env = child_env()
    procs = []
    try:
        for p in (0, 1):
            procs.append(start([str(two), str(p)], env))
        outs = [proc.communicate(timeout=TIMEOUT_S)[0] for proc in procs]
    finally:
        for proc in procs:
            kill_group(proc)
    assert all(proc.returncode == 0 for proc in procs), outs
    assert "received True" in outs[1], outs[1]
    assert "'keys_deleted': 2" in outs[1] and "'retained_keys': 0" in outs[1], outs[1]
