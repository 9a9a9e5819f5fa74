"""One process of the two-process JAX job that test_jax_two_process.py runs.

    python jax_two_process_worker.py PROCESS_ID COORDINATOR_PORT OUT_JSON [MODE]

Both processes join a jax.distributed job on 127.0.0.1 (JAX_PLATFORMS must be
``crosshost``: JAX's cross-process device_put uses the default backend's
cross-host transfers). Process 0 owns the source arrays; process 1 builds the
matching non-addressable arrays. Both call jax.device_put onto a device of
process 1 -- one call per array, then one call with a batch of arrays -- and
process 1 compares every byte it received with what process 0 sent (both
derive the data from the same seeds). Each process then waits until the
plugin's metrics settle and writes them, with the checks, to OUT_JSON.

MODE ``mixed`` instead puts one batch whose arrays come from both of process
0's devices. JAX 0.10.2 numbers a batch's transfer keys per source-device
group, iterating the groups in a hash-map order that differs between the two
processes, so the two sides can give the same key to different arrays. The
plugin's key names carry the source and destination devices, so such a pair
never meets: those buffers fail with DEADLINE_EXCEEDED (receive_timeout_ms)
instead of receiving another array's bytes. Each array's outcome is recorded.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

CASES = [
    # (shape, dtype, source device index on process 0, destination index on process 1)
    ((4, 6), "float32", 0, 0),
    ((3, 5, 7), "bfloat16", 1, 0),
    ((1000,), "int8", 0, 1),
    ((17, 3), "float64", 1, 1),
    ((2, 2), "complex64", 0, 0),
    ((5,), "bool", 0, 0),
    ((6, 9), "int4", 0, 1),
    ((256, 1024), "float16", 1, 0),  # 512 KiB
    ((0, 3), "float32", 0, 0),
    ((), "uint32", 0, 1),
]
BATCH = [((64, 64), "float32"), ((33,), "uint16"), ((8, 8, 8), "bfloat16"), ((0,), "int64"),
         ((1, 1), "float8_e4m3fn"), ((4096,), "int32")]
ROUNDS = 2
BARRIER_TIMEOUT_MS = 60_000


def make_array(seed: int, shape, dtype_name: str) -> np.ndarray:
    import jax.numpy as jnp

    dtype = np.dtype(jnp.dtype(dtype_name))
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype.name in ("int4", "uint4", "int2", "uint2"):
        import ml_dtypes

        info = ml_dtypes.iinfo(dtype)
        return rng.integers(int(info.min), int(info.max) + 1, size=shape).astype(dtype)
    # Every bit pattern is a valid value: random bytes test every byte.
    count = int(np.prod(shape, dtype=np.int64))
    raw = rng.integers(0, 256, size=count * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def main() -> int:
    process_id, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mode = sys.argv[4] if len(sys.argv) > 4 else "standard"
    result: dict = {"process_id": process_id, "mode": mode, "checks": [], "errors": []}
    try:
        import jax

        jax.config.update("jax_enable_x64", True)
        from jax.sharding import SingleDeviceSharding

        kv = join_job(process_id, port)
        assert jax.default_backend() == "crosshost", jax.default_backend()
        src_devices = devices_of(0)
        dst_devices = devices_of(1)
        result["devices"] = [(d.id, d.process_index) for d in jax.devices()]
        result["local_devices"] = [d.id for d in jax.local_devices()]

        def source(seed, shape, dtype_name, src_index):
            expected = make_array(seed, shape, dtype_name)
            return expected, held_by(expected, src_devices[src_index], process_id)

        def check(name, y, expected, dst):
            if process_id != 1:
                return
            shard = y.addressable_shards[0]
            try:
                got = np.asarray(shard.data)
            except Exception as e:  # noqa: BLE001 - recorded for the test
                if mode != "mixed":
                    raise
                result["checks"].append({"name": name, "error": f"{type(e).__name__}: {e}"})
                return
            result["checks"].append(
                {
                    "name": name,
                    "device_ok": shard.device == dst,
                    "dtype_ok": got.dtype == expected.dtype,
                    "shape_ok": got.shape == expected.shape,
                    "bytes_ok": got.tobytes() == expected.tobytes(),
                    "nbytes": int(expected.nbytes),
                }
            )

        total_bytes = 0
        if mode == "mixed":
            dst = dst_devices[0]
            pairs = [source(300 + i, shape, name, i % 2) for i, (shape, name) in enumerate(BATCH)]
            ys = jax.device_put([x for _, x in pairs], [SingleDeviceSharding(dst)] * len(pairs))
            for (shape, name), (expected, _), y in zip(BATCH, pairs, ys):
                check(f"mixed/{name}{list(shape)}", y, expected, dst)
            kv.wait_at_barrier("crosshost_test_checked", BARRIER_TIMEOUT_MS)
            import jax_plugins.crosshost as plugin

            # Let the sender's side of timed-out transfers finish too.
            time.sleep(0.5)
            result["metrics"] = plugin.metrics()[-1]["metrics"]
            kv.wait_at_barrier("crosshost_test_metrics", BARRIER_TIMEOUT_MS)
            return finish(result, out_path)
        # Two rounds: the second round's receipts must not be confused with
        # the first round's, which JAX's store keeps (it cannot delete).
        for round_ in range(ROUNDS):
            seed = 1000 * round_
            for i, (shape, dtype_name, src_index, dst_index) in enumerate(CASES):
                expected, x = source(seed + 100 + i, shape, dtype_name, src_index)
                dst = dst_devices[dst_index]
                y = jax.device_put(x, SingleDeviceSharding(dst))
                check(f"r{round_}/single/{dtype_name}{list(shape)}", y, expected, dst)
                total_bytes += expected.nbytes

            # One source device per batch: JAX 0.10.2 numbers a batch's
            # transfers per source-device group, in a hash-map order that
            # differs between the processes, so a batch mixing source devices
            # pairs the wrong arrays (see test_jax_two_process.py).
            dst = dst_devices[round_ % 2]
            pairs = [
                source(seed + 200 + i, shape, name, round_ % 2)
                for i, (shape, name) in enumerate(BATCH)
            ]
            ys = jax.device_put([x for _, x in pairs], [SingleDeviceSharding(dst)] * len(pairs))
            for (shape, name), (expected, _), y in zip(BATCH, pairs, ys):
                check(f"r{round_}/batch/{name}{list(shape)}", y, expected, dst)
                total_bytes += expected.nbytes
        result["total_bytes"] = int(total_bytes)
        result["num_transfers"] = ROUNDS * (len(CASES) + len(BATCH))

        # Both sides are done with the data once the receiver has checked it.
        kv.wait_at_barrier("crosshost_test_checked", BARRIER_TIMEOUT_MS)

        clients, metrics = metrics_once_all_bytes_counted(process_id, total_bytes)
        result["clients"] = clients
        result["metrics"] = metrics
        kv.wait_at_barrier("crosshost_test_metrics", BARRIER_TIMEOUT_MS)
        result["jax_store_transfer_keys"] = jax_store_transfer_keys(kv)
        result["jax_store_values"] = jax_store_values(kv)
    except Exception:  # noqa: BLE001 - reported to the test through the JSON
        result["errors"].append(traceback.format_exc())
    return finish(result, out_path)


def jax_store_transfer_keys(kv) -> list[str]:
    """The plugin's transfer keys (receipts, descriptors) in JAX's
    coordination service, which gives the plugin its keys prefixed by the
    platform name ("crosshost:crosshost/recv/...")."""
    entries = kv.key_value_dir_get_bytes("crosshost:crosshost")
    return [k for k, _ in entries if "/recv/" in k or "/desc/" in k]


def jax_store_values(kv) -> dict[str, str]:
    """Every value the plugin keeps in JAX's coordination service, by key:
    its first bytes (a sealed value starts with ``xsv1``)."""
    entries = kv.key_value_dir_get_bytes("crosshost:crosshost")
    return {k: bytes(v[:8]).decode("latin-1") for k, v in entries}


def join_job(process_id: int, port: int, num_processes: int = 2):
    """Joins the jax.distributed job whose coordinator listens on
    127.0.0.1:PORT; returns JAX's coordination-service client."""
    import jax
    from jax._src import distributed

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )
    return distributed.global_state.client


def devices_of(process: int) -> list:
    """Process `process`'s devices, in JAX's order."""
    import jax

    return [d for d in jax.devices() if d.process_index == process]


def held_by(expected: np.ndarray, src, process_id: int):
    """`expected` on device `src` in the process that owns it; in every
    other process, the matching array that process cannot address (what a
    cross-process device_put starts from there)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    if process_id == src.process_index:
        return jax.device_put(expected, src)
    return jax.make_array_from_single_device_arrays(
        expected.shape, SingleDeviceSharding(src), [], dtype=expected.dtype
    )


def metrics_once_all_bytes_counted(process_id: int, total_bytes: int) -> tuple[list, dict]:
    """The plugin's live clients and the last one's metrics, once this
    process (0 sends, 1 receives) has accounted for all `total_bytes` and
    has no receive pending (every key not deleted is retained or failed to
    delete), or as they are after 20 s."""
    import jax_plugins.crosshost as plugin

    counter = "bytes_sent" if process_id == 0 else "bytes_received"
    deadline = time.monotonic() + 20
    while True:
        clients = plugin.metrics()
        metrics = clients[-1]["metrics"] if clients else {}
        settled = metrics.get(counter) == total_bytes and metrics.get(
            "keys_outstanding"
        ) == metrics.get("retained_keys", 0) + metrics.get("delete_failures", 0)
        if settled or time.monotonic() > deadline:
            return clients, metrics
        time.sleep(0.05)  # polling the plugin's counters, with a deadline


def finish(result: dict, out_path: str) -> int:
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    sys.stdout.flush()
    return 0 if not result["errors"] else 1


def finish_and_exit_now(result: dict, out_path: str) -> None:
    """Writes the result and leaves without the interpreter's teardown: once
    a process of the job is dead, JAX's shutdown barrier would wait for it."""
    code = finish(result, out_path)
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
