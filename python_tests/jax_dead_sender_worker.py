"""One process of the three-process JAX job of test_jax_failed_receive.py's
dead-sender test: a receive whose sender dies, then the job goes on.

    python jax_dead_sender_worker.py PROCESS_ID COORDINATOR_PORT OUT_JSON

Process 0 runs JAX's coordinator and sends the arrays that come after,
process 1 receives, process 2 is the sender that dies: after a barrier it
sends itself SIGKILL, and process 1 then receives an array from it. The
failed array is used every way a JAX user would (block_until_ready,
np.asarray, jit with a compute plugin, device_put to process 1's other
device); each must raise UNAVAILABLE naming process 2. Then ROUNDS_AFTER
arrays go from process 0 to process 1, every byte checked. JAX numbers each process's
transfers in order, so process 0 spends the dead receive's number on an
array nobody receives. Past the death JAX's barriers would wait for process 2, so processes 0 and 1 meet through
a key in JAX's store, and leave with os._exit once their result is written.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

import numpy as np

from jax_failed_receive_worker import every_use
from jax_two_process_worker import devices_of, finish, finish_and_exit_now, held_by, join_job

ROUNDS_AFTER = 100
BARRIER_TIMEOUT_MS = 120_000


def main() -> int:
    process_id, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    result: dict = {"process_id": process_id, "errors": [], "failures": {}}
    try:
        import jax
        from jax.sharding import SingleDeviceSharding

        kv = join_job(process_id, port, num_processes=3)
        compiles = os.environ.get("CROSSHOST_TEST_MODE") == "delegated"
        first = {p: devices_of(p)[0] for p in range(3)}
        dst, other = devices_of(1)[:2]

        def put(src, shape, seed):
            expected = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
            x = held_by(expected, src, process_id)
            return expected, jax.device_put(x, SingleDeviceSharding(dst))

        kv.wait_at_barrier("dead_sender_ready", BARRIER_TIMEOUT_MS)
        if process_id == 2:
            finish(result, out_path)
            os.kill(os.getpid(), signal.SIGKILL)
        if process_id == 1:
            _, y = put(first[2], (4, 4), 1)
            result["failures"]["dead_sender"] = every_use(y, other, compiles)
        else:
            # JAX numbers each process's transfers in order: process 1's
            # failed receive took a number, so process 0 spends one too, on
            # an array nobody receives (its send fails on its own, later).
            orphan = jax.device_put(jax.device_put(np.zeros(3, np.float32), first[0]),
                                    SingleDeviceSharding(dst))
            del orphan
        checks = []
        for i in range(ROUNDS_AFTER):
            expected, y = put(first[0], (1 + i % 7, 1 + i % 5), 7000 + i)
            if process_id == 1:
                got = np.asarray(y.addressable_shards[0].data)
                checks.append(bool(got.tobytes() == expected.tobytes()))
        result["checks_after"] = checks
        if process_id == 1:
            # Result first, then the signal, then out at once: once process
            # 0 (the coordination service) is gone, JAX aborts a task that
            # is still running.
            finish(result, out_path)
            kv.key_value_set("dead_sender_done", str(os.getpid()))
            os._exit(0)
        # Process 0 hosts the coordination service: it outlives process 1,
        # whose pid (same host) it watches until it is gone.
        receiver = int(kv.blocking_key_value_get("dead_sender_done", BARRIER_TIMEOUT_MS))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(receiver, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - reported to the test through the JSON
        result["errors"].append(traceback.format_exc())
    finish_and_exit_now(result, out_path)


if __name__ == "__main__":
    sys.exit(main())
