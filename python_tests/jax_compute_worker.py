"""One process of the two-process compute job of test_jax_two_process.py.

    python jax_compute_worker.py PROCESS_ID COORDINATOR_PORT OUT_JSON ROUNDS

Both processes join a jax.distributed job (JAX_PLATFORMS=crosshost, a compute
plugin configured). Each round, process 0 computes an array on its device
(a jitted function of the round number), device_puts it onto process 1's
device -- through the plugin's cross-host transfers -- and process 1
computes on what it received and checks the result against numpy, which
both sides can evaluate because the data is a function of the round. Sizes
cycle from 4 KiB to 1 MiB. Each process then writes its checks and metrics
to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import numpy as np

from jax_two_process_worker import devices_of, join_job

SIZES = [1 << 10, 1 << 14, 1 << 16, 1 << 18]  # float32 elements: 4 KiB .. 1 MiB
BARRIER_TIMEOUT_MS = 120_000


# Integer arithmetic, so both sides agree exactly with numpy (a float
# reduction's rounding depends on the order XLA sums in); the elementwise
# float op on the receiver is compared with a tolerance.
MOD = 10007


def produce_np(n: int, r: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int32) * (r + 1) + 7 * r) % MOD).astype(np.int32)


def consume_np(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return (x * 3 + 1) % 65536, np.sin(x.astype(np.float32) * np.float32(0.01))


def main() -> int:
    process_id, port, out_path, rounds = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    result: dict = {"process_id": process_id, "checks": 0, "bad": [], "errors": []}
    try:
        import jax
        import jax.numpy as jnp
        from jax.sharding import SingleDeviceSharding

        kv = join_job(process_id, port)
        src = devices_of(0)[0]
        dst = devices_of(1)[0]
        result["devices"] = [(d.id, d.process_index) for d in jax.devices()]

        @jax.jit
        def produce(r, base):
            return (base * (r + 1) + 7 * r) % MOD

        @jax.jit
        def consume(x):
            return (x * 3 + 1) % 65536, jnp.sin(x.astype(jnp.float32) * 0.01)

        total = 0
        for r in range(rounds):
            n = SIZES[r % len(SIZES)]
            shape = (n,)
            if process_id == 0:
                base = jax.device_put(np.arange(n, dtype=np.int32), src)
                x = produce(jnp.int32(r), base)
                assert x.devices() == {src}, x.devices()
            else:
                x = jax.make_array_from_single_device_arrays(
                    shape, SingleDeviceSharding(src), [], dtype=np.int32
                )
            y = jax.device_put(x, SingleDeviceSharding(dst))
            total += n * 4
            if process_id == 1:
                ints, floats = consume(y.addressable_data(0))
                want_ints, want_floats = consume_np(produce_np(n, r))
                result["checks"] += 1
                ok = (
                    ints.devices() == {dst}
                    and np.array_equal(np.asarray(ints), want_ints)
                    and np.allclose(np.asarray(floats), want_floats, rtol=1e-5, atol=1e-6)
                )
                if not ok:
                    result["bad"].append({"round": r, "n": n})
        result["total_bytes"] = total
        kv.wait_at_barrier("crosshost_compute_checked", BARRIER_TIMEOUT_MS)

        import jax_plugins.crosshost as plugin

        counter = "bytes_sent" if process_id == 0 else "bytes_received"
        deadline = time.monotonic() + 20
        while True:
            metrics = plugin.metrics()[-1]["metrics"]
            if metrics.get(counter) == total or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        result["metrics"] = metrics
        result["compute_plugin"] = plugin.configured_compute_plugin()
        kv.wait_at_barrier("crosshost_compute_metrics", BARRIER_TIMEOUT_MS)
    except Exception:  # noqa: BLE001 - reported to the test through the JSON
        result["errors"].append(traceback.format_exc())
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
