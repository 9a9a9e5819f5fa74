"""One process of the two-process JAX job of
test_jax_failed_receive.py: receives that fail, then the job goes on.

    python jax_failed_receive_worker.py PROCESS_ID COORDINATOR_PORT OUT_JSON [MODE]

(MODE, which test_jax_two_process.run_job passes, is not used.)

Process 0 sends, process 1 receives (JAX_PLATFORMS=crosshost, the plugin's
receive_timeout_ms set short by the test). Two receives fail, each in its
own way, and process 1 then uses the failed array every way a JAX user
would -- block_until_ready, np.asarray, jit (with a compute plugin), a
device_put to its other device -- recording what each raised, or that it did not raise:

``mismatch``: process 0 sends 4 float32 into a receive for 5: the sender's
  check of the destination fails both sides with INVALID_ARGUMENT.
``refused``: 2 MiB into a receiver whose max_receive_bytes is 1 MiB: JAX
  raises RESOURCE_EXHAUSTED from the receiver's device_put, and the
  sender's send fails at once (counted in its plugin's sends_failed).
``timeout``: process 1 receives a transfer process 0 never sends: it ends
  with DEADLINE_EXCEEDED. JAX numbers transfers per process, so process 0
  then sends one array nobody receives (its send fails on its own, later)
  and the two sides' numbers agree again.

Then ROUNDS_AFTER arrays go across and process 1 checks every byte: one
failed transfer does not end the job.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import numpy as np

from jax_two_process_worker import devices_of, finish, held_by, join_job

ROUNDS_AFTER = 100
BARRIER_TIMEOUT_MS = 120_000


def outcome(call) -> dict:
    try:
        value = call()
    except Exception as e:  # noqa: BLE001 - what JAX raised is the result
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None, "value": repr(value)[:200]}


def every_use(y, other, compiles: bool) -> dict:
    """What each way of reading or computing on a (failed) received array
    `y` gives: block_until_ready, np.asarray, a device_put to `other` (a
    device of the same process) and, with a compiler, jit."""
    import jax

    shard = y.addressable_shards[0].data
    uses = {
        "block_until_ready": outcome(lambda: y.block_until_ready()),
        "asarray": outcome(lambda: np.asarray(shard)),
        "device_put": outcome(lambda: np.asarray(jax.device_put(shard, other))),
    }
    if compiles:
        uses["jit"] = outcome(lambda: np.asarray(jax.jit(lambda a: a * 2)(shard)))
    return uses


def main() -> int:
    process_id, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    result: dict = {"process_id": process_id, "errors": [], "failures": {}}
    try:
        import jax
        import jax.numpy as jnp
        from jax.sharding import SingleDeviceSharding

        kv = join_job(process_id, port)
        # Embedded, the plugin has no compiler: jit is UNIMPLEMENTED there.
        compiles = os.environ.get("CROSSHOST_TEST_MODE") == "delegated"
        src = devices_of(0)[0]
        dst, other = devices_of(1)[:2]

        def put(shape, seed):
            """Process 0's array, or process 1's placeholder for it, sent to dst."""
            expected = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
            x = held_by(expected, src, process_id)
            return expected, jax.device_put(x, SingleDeviceSharding(dst))

        def use_failed(name, y):
            result["failures"][name] = every_use(y, other, compiles)

        # mismatch: the sender's 4 elements for a receive of 5.
        if process_id == 0:
            x = jax.device_put(np.arange(4, dtype=np.float32), src)
            y = jax.device_put(x, SingleDeviceSharding(dst))
            result["mismatch_send"] = outcome(lambda: y.block_until_ready())
        else:
            x = jax.make_array_from_single_device_arrays(
                (5,), SingleDeviceSharding(src), [], dtype=np.float32)
            use_failed("mismatch", jax.device_put(x, SingleDeviceSharding(dst)))
        kv.wait_at_barrier("failed_receive_mismatch", BARRIER_TIMEOUT_MS)

        # refused: 2 MiB into a receiver whose max_receive_bytes is 1 MiB
        # (the test's options): the receive fails RESOURCE_EXHAUSTED at
        # once, and the sender's send with it (the refusal reaches it).
        # JAX raises the receive's error from device_put itself (no array is
        # made); the sender's plugin counts its failed send (JAX drops send
        # results).
        x = held_by(np.ones(1 << 19, np.float32), src, process_id)
        if process_id == 0:
            import jax_plugins.crosshost as crosshost

            def sends_failed():
                return crosshost.metrics()[0]["metrics"]["sends_failed"]

            before = sends_failed()
            started = time.monotonic()
            jax.device_put(x, SingleDeviceSharding(dst))
            while sends_failed() == before and time.monotonic() < started + 10:
                time.sleep(0.01)
            result["refused_send_failed"] = sends_failed() > before
            result["refused_send_after_s"] = time.monotonic() - started
        else:
            result["refused_put"] = outcome(
                lambda: jax.device_put(x, SingleDeviceSharding(dst)))
        kv.wait_at_barrier("failed_receive_refused", BARRIER_TIMEOUT_MS)

        # timeout: process 1 waits for an array process 0 sends only after
        # the receive has failed (and into nobody's receive).
        if process_id == 1:
            x = jax.make_array_from_single_device_arrays(
                (3,), SingleDeviceSharding(src), [], dtype=np.float32)
            use_failed("timeout", jax.device_put(x, SingleDeviceSharding(dst)))
        kv.wait_at_barrier("failed_receive_timeout", BARRIER_TIMEOUT_MS)
        if process_id == 0:
            orphan = jax.device_put(jax.device_put(np.zeros(3, np.float32), src),
                                    SingleDeviceSharding(dst))
            del orphan

        # The job goes on.
        checks = []
        for i in range(ROUNDS_AFTER):
            expected, y = put((1 + i % 7, 1 + i % 5), 5000 + i)
            if process_id == 1:
                got = np.asarray(y.addressable_shards[0].data)
                checks.append(bool(got.tobytes() == expected.tobytes()))
                if i == 0 and compiles:
                    result["computed"] = float(jnp.sum(y.addressable_shards[0].data))
                    result["computed_expected"] = float(np.sum(expected))
        result["checks_after"] = checks
        kv.wait_at_barrier("failed_receive_done", BARRIER_TIMEOUT_MS)
    except Exception:  # noqa: BLE001 - reported to the test through the JSON
        result["errors"].append(traceback.format_exc())
    return finish(result, out_path)


if __name__ == "__main__":
    sys.exit(main())
