"""Multi-process programs in a two-process JAX job delegating to XLA's CPU
plugin: the compute plugin's client holds one process's devices, so a
program across processes cannot run. Each such program (jit over a global
mesh, shard_map + psum, multihost_utils.sync_global_devices,
process_allgather) raises the one error that says so and what runs instead,
the same on both processes (issue 18: process 0 got XLA's "Multiprocess
computations aren't implemented", process 1 an unmapped device id). After
them a jit on one process's devices and a cross-process device_put run
(jax_multiprocess_worker.py).
"""

from __future__ import annotations

import pytest

from jax_harness import HERE, skip_unless_jax
from test_jax_two_process import run_job

pytestmark = skip_unless_jax()

WORKER = HERE / "jax_multiprocess_worker.py"
PROGRAMS = ["jit", "shard_map_psum", "sync_global_devices", "process_allgather"]


def test_a_program_across_processes_gets_one_clear_error_on_both_and_the_rest_runs(tmp_path):
    results = run_job(tmp_path, compute="fastatomstruct", worker=WORKER)
    for p, r in enumerate(results):
        assert sorted(r["programs"]) == sorted(PROGRAMS), r["programs"]
        for name in PROGRAMS:
            got = r["programs"][name]
            assert got["raised"], f"process {p}: {name} did not raise: {got}"
            message = got["message"]
            assert "UNIMPLEMENTED" in message and "cannot run a program across processes" in message, (
                f"process {p}: {name}: {message}")
            assert "JAX_PLATFORMS=cpu" in message and "of processes 0, 1" in message, message
        assert r["local_jit"] == [0.0, 2.0, 4.0, 6.0], r["local_jit"]
    # One error: the same words on both processes.
    for name in PROGRAMS:
        assert results[0]["programs"][name]["message"] == results[1]["programs"][name]["message"], name
    assert results[1]["moved"] and results[1]["moved_sum"] == pytest.approx(18.0), results[1]
