"""One process of the two-process JAX job of test_jax_multiprocess.py:
multi-process programs, each of which must fail with the one error that
says what runs instead, the same on both processes; then what does run.

    python jax_multiprocess_worker.py PROCESS_ID COORDINATOR_PORT OUT_JSON [MODE]

Each process records, per program, what it raised (or that it did not):
``jit`` (x * 2 over a global mesh), ``shard_map_psum``,
``sync_global_devices``, ``process_allgather``. Then a jit on this
process's own devices and a cross-process device_put run and are checked.
"""

from __future__ import annotations

import sys
import traceback

import numpy as np

from jax_failed_receive_worker import outcome
from jax_two_process_worker import devices_of, finish, held_by, join_job

BARRIER_TIMEOUT_MS = 120_000


def main() -> int:
    process_id, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    result: dict = {"process_id": process_id, "errors": [], "programs": {}}
    try:
        import jax
        import jax.numpy as jnp
        from jax.experimental import multihost_utils
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

        kv = join_job(process_id, port)
        mesh = Mesh(np.array(jax.devices()), ("x",))
        sharding = NamedSharding(mesh, P("x"))
        n = len(jax.devices())
        full = np.arange(n * 2, dtype=np.float32)
        local = [jax.device_put(full[i * 2:i * 2 + 2], d)
                 for i, d in enumerate(jax.devices()) if d.process_index == process_id]
        global_x = jax.make_array_from_single_device_arrays(full.shape, sharding, local)

        try:
            from jax import shard_map
        except ImportError:
            from jax.experimental.shard_map import shard_map

        def psum(a):
            return jax.lax.psum(a, "x")

        programs = {
            "jit": lambda: np.asarray(jax.jit(lambda a: a * 2)(global_x).addressable_data(0)),
            "shard_map_psum": lambda: np.asarray(jax.jit(shard_map(
                psum, mesh=mesh, in_specs=P("x"), out_specs=P()))(global_x).addressable_data(0)),
            "sync_global_devices": lambda: multihost_utils.sync_global_devices("crosshost"),
            "process_allgather": lambda: multihost_utils.process_allgather(
                np.full(2, process_id, np.float32)),
        }
        for name, program in programs.items():
            result["programs"][name] = outcome(program)
            kv.wait_at_barrier(f"multiprocess_{name}", BARRIER_TIMEOUT_MS)

        # What runs: a program on this process's devices, and a transfer.
        here = jax.device_put(np.arange(4, dtype=np.float32), devices_of(process_id)[0])
        result["local_jit"] = np.asarray(jax.jit(lambda a: a * 2)(here)).tolist()
        expected = np.arange(6, dtype=np.float32) + 0.5
        x = held_by(expected, devices_of(0)[0], process_id)
        y = jax.device_put(x, SingleDeviceSharding(devices_of(1)[0]))
        if process_id == 1:
            result["moved"] = np.asarray(y.addressable_shards[0].data).tolist() == expected.tolist()
            result["moved_sum"] = float(jnp.sum(y.addressable_shards[0].data))
        kv.wait_at_barrier("multiprocess_done", BARRIER_TIMEOUT_MS)
    except Exception:  # noqa: BLE001 - reported to the test through the JSON
        result["errors"].append(traceback.format_exc())
    return finish(result, out_path)


if __name__ == "__main__":
    sys.exit(main())
