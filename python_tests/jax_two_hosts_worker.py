"""One process of the two-host JAX job that test_jax_two_hosts.py runs.

    python jax_two_hosts_worker.py PROCESS_ID COORDINATOR OUT_JSON ROUNDS SEED

Process 0 runs on host a of a two-host bed with JAX's coordinator
(COORDINATOR is ``xh-a:<port>``), process 1 on host b. Both derive the same
plan from SEED: ROUNDS rounds, each one device_put from a device of process
0 onto a device of process 1 -- a single array, or a batch of arrays from
one source device -- of mixed shapes (scalars, zero-size, 1-4 dimensions)
and dtypes (bfloat16, int8, bool, float64, complex, int4, float8...).
Process 1 compares every byte it received with what process 0 sent (both
make the data from the same seeds). Then each process waits until the
plugin's metrics settle and writes them, the checks and the transfer keys
left in JAX's coordination service, to OUT_JSON.
"""

from __future__ import annotations

import json
import random
import sys
import time
import traceback

import numpy as np

from jax_two_process_worker import (
    finish,
    jax_store_transfer_keys,
    make_array,
    metrics_once_all_bytes_counted,
)

DTYPES = ["float32", "bfloat16", "int8", "bool", "float64", "int64", "uint16", "float16",
          "complex64", "int4", "float8_e4m3fn", "uint8", "int32"]
SHAPES = [(), (0,), (3, 0), (1,), (7,), (33,), (4, 6), (3, 5, 7), (2, 3, 4, 5), (256,),
          (128, 129), (1000,), (64, 64), (1 << 16,), (512, 1024)]
BARRIER_TIMEOUT_MS = 60_000


def plan(rounds: int, seed: int) -> list[dict]:
    """The job's rounds, the same in both processes: each a list of arrays
    (shape, dtype, data seed), one source device, one destination."""
    rng = random.Random(seed)
    out = []
    for r in range(rounds):
        count = 1 if rng.random() < 0.6 else rng.randint(2, 6)
        arrays = [(rng.choice(SHAPES), rng.choice(DTYPES), seed * 100_000 + r * 10 + i)
                  for i in range(count)]
        out.append({"arrays": arrays, "src": rng.randrange(2), "dst": rng.randrange(2)})
    return out


def main() -> int:
    process_id, coordinator, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    rounds, seed = int(sys.argv[4]), int(sys.argv[5])
    result: dict = {"process_id": process_id, "errors": [], "bad": [], "checks": 0}
    try:
        import socket

        import jax

        jax.config.update("jax_enable_x64", True)
        from jax._src import distributed
        from jax.sharding import SingleDeviceSharding

        result["hostname"] = socket.gethostname()
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=2, process_id=process_id,
            initialization_timeout=60,
        )
        kv = distributed.global_state.client
        assert jax.default_backend() == "crosshost", jax.default_backend()
        src_devices = [d for d in jax.devices() if d.process_index == 0]
        dst_devices = [d for d in jax.devices() if d.process_index == 1]
        total = 0
        # Per round, the bytes of each array: the test tells from them which
        # transport `auto` picks for each (src/transfer/route.rs).
        result["round_nbytes"] = []
        t0 = time.monotonic()
        for r, step in enumerate(plan(rounds, seed)):
            src, dst = src_devices[step["src"]], dst_devices[step["dst"]]
            expected = [make_array(s, shape, dt) for shape, dt, s in step["arrays"]]
            if process_id == 0:
                xs = [jax.device_put(e, src) for e in expected]
            else:
                xs = [jax.make_array_from_single_device_arrays(
                    e.shape, SingleDeviceSharding(src), [], dtype=e.dtype) for e in expected]
            single = len(xs) == 1
            ys = jax.device_put(xs[0] if single else xs,
                                SingleDeviceSharding(dst) if single else [SingleDeviceSharding(dst)] * len(xs))
            ys = [ys] if single else ys
            if process_id == 1:
                for (shape, dt, _), e, y in zip(step["arrays"], expected, ys):
                    shard = y.addressable_shards[0]
                    got = np.asarray(shard.data)
                    ok = (shard.device == dst and got.dtype == e.dtype and got.shape == e.shape
                          and got.tobytes() == e.tobytes())
                    result["checks"] += 1
                    if not ok:
                        result["bad"].append({"round": r, "shape": list(shape), "dtype": dt})
            total += sum(e.nbytes for e in expected)
            result["round_nbytes"].append([int(e.nbytes) for e in expected])
        result["transfers"] = sum(len(s["arrays"]) for s in plan(rounds, seed))
        result["total_bytes"] = int(total)
        result["seconds"] = time.monotonic() - t0
        # The sender keeps its arrays until the receiver has checked them.
        kv.wait_at_barrier("two_hosts_checked", BARRIER_TIMEOUT_MS)

        clients, metrics = metrics_once_all_bytes_counted(process_id, total)
        result["metrics"] = metrics
        result["clients"] = len(clients)
        kv.wait_at_barrier("two_hosts_metrics", BARRIER_TIMEOUT_MS)
        result["jax_store_transfer_keys"] = jax_store_transfer_keys(kv)
        kv.wait_at_barrier("two_hosts_listed", BARRIER_TIMEOUT_MS)
    except Exception:  # noqa: BLE001 - reported to the test through the JSON
        result["errors"].append(traceback.format_exc())
    if "metrics" in result and process_id == 1:
        print("receiver metrics:", json.dumps(result["metrics"]), flush=True)
    return finish(result, out_path)


if __name__ == "__main__":
    sys.exit(main())
