"""One process of the 1,000-transfer JAX job (test_jax_two_process.py,
test_1000_mixed_size_device_puts_leave_no_key_in_jax_store...).

    python jax_thousand_worker.py PROCESS_ID COORDINATOR_PORT OUT_JSON

Process 0 device_puts 1,000 arrays of mixed sizes (16 B to 1 MiB, several
dtypes) onto process 1's devices: 600 one call each, then 50 batches of 8.
Process 1 checks every byte. Both wait until the plugin's metrics settle,
list the transfer keys left in JAX's coordination service, and write the
result. Then each starts one more batch of 16 x 1 MiB and exits without
waiting for it: the interpreter must exit cleanly with transfers in flight
(the test checks the exit code and the log).
"""

from __future__ import annotations

import json
import sys
import traceback

import numpy as np

SIZES = [16, 1000, 4096, 65536, 300_000, 1 << 20]
DTYPES = ["uint8", "float32", "int16", "bfloat16", "float64", "int32"]
SINGLES = 600
BATCHES = 50
BATCH_SIZE = 8
IN_FLIGHT_AT_EXIT = 16
BARRIER_TIMEOUT_MS = 120_000


def case(i: int) -> tuple[int, str]:
    # Sizes and dtypes cycle at different periods, so every size meets
    # several dtypes.
    return SIZES[i % len(SIZES)], DTYPES[(i // 2) % len(DTYPES)]


def make_array(seed: int, nbytes: int, dtype_name: str) -> np.ndarray:
    import jax.numpy as jnp

    dtype = np.dtype(jnp.dtype(dtype_name))
    count = max(1, nbytes // dtype.itemsize)
    # Cheap, and distinct for every array and every byte position.
    raw = (np.arange(count * dtype.itemsize, dtype=np.uint64) * 2654435761 + seed * 97 + 11) >> 7
    return raw.astype(np.uint8).view(dtype)


def main() -> int:
    process_id, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    result: dict = {"process_id": process_id, "errors": [], "bad": []}
    try:
        import jax

        jax.config.update("jax_enable_x64", True)
        from jax.sharding import SingleDeviceSharding

        import jax_job
        import jax_plugins.crosshost as plugin

        kv, src_devices, dst_devices = jax_job.join(process_id, port)
        src = src_devices[0]

        def source(seed):
            nbytes, dtype_name = case(seed)
            expected = make_array(seed, nbytes, dtype_name)
            return expected, jax_job.source_array(process_id, expected, src)

        checked = 0
        total_bytes = 0

        def check(seed, expected, y):
            nonlocal checked, total_bytes
            total_bytes += expected.nbytes
            if process_id != 1:
                return
            got = np.asarray(y.addressable_shards[0].data)
            checked += 1
            if got.dtype != expected.dtype or got.tobytes() != expected.tobytes():
                result["bad"].append({"seed": seed, "dtype": str(got.dtype), "shape": got.shape})

        for seed in range(SINGLES):
            expected, x = source(seed)
            dst = dst_devices[seed % 2]
            check(seed, expected, jax.device_put(x, SingleDeviceSharding(dst)))
        for b in range(BATCHES):
            seeds = range(SINGLES + b * BATCH_SIZE, SINGLES + (b + 1) * BATCH_SIZE)
            pairs = [source(s) for s in seeds]
            dst = dst_devices[b % 2]
            ys = jax.device_put([x for _, x in pairs], [SingleDeviceSharding(dst)] * len(pairs))
            for s, (expected, _), y in zip(seeds, pairs, ys):
                check(s, expected, y)
        result["transfers"] = SINGLES + BATCHES * BATCH_SIZE
        result["checks"] = checked
        result["total_bytes"] = int(total_bytes)
        kv.wait_at_barrier("crosshost_thousand_checked", BARRIER_TIMEOUT_MS)

        clients = plugin.settled_metrics(timeout=30)
        result["metrics"] = clients[-1]["metrics"] if clients else {}
        kv.wait_at_barrier("crosshost_thousand_metrics", BARRIER_TIMEOUT_MS)
        entries = kv.key_value_dir_get_bytes("crosshost:crosshost")
        result["jax_store_transfer_keys"] = [
            k for k, _ in entries if "/recv/" in k or "/desc/" in k
        ]
        kv.wait_at_barrier("crosshost_thousand_listed", BARRIER_TIMEOUT_MS)
        write(result, out_path)

        # Transfers in flight at exit: started, never waited for.
        pairs = [source(5 + len(SIZES) * k) for k in range(IN_FLIGHT_AT_EXIT)]  # 1 MiB each
        jax.device_put([x for _, x in pairs], [SingleDeviceSharding(dst_devices[0])] * len(pairs))
        print("crosshost-thousand: exiting with transfers in flight", flush=True)
        return 0
    except Exception:  # noqa: BLE001 - reported to the test through the JSON
        result["errors"].append(traceback.format_exc())
        write(result, out_path)
        return 1


def write(result: dict, out_path: str) -> None:
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    sys.exit(main())
