"""One process of the two-process JAX job of test_jax_dead_receiver.py: a
receiver killed with SIGKILL (or frozen with SIGSTOP), and its sender going
on sending.

    python jax_dead_receiver_worker.py PROCESS_ID COORDINATOR_PORT OUT_JSON SECONDS MODE

Process 0 sends 1 MiB float32 arrays to process 1 (JAX_PLATFORMS=crosshost).
After WARMUP good transfers and a barrier, process 1 sends itself SIGKILL
(MODE ``killed``: no exit path of its own runs) or SIGSTOP (``frozen``: alive,
its links open, never receiving again; the test kills it). Process 0 keeps making and sending
a fresh 1 MiB array every few milliseconds for SECONDS seconds, as a
training loop would, and samples once a second: its RSS and the plugin's
metrics (sends failed, the bytes of sends not yet delivered). Its result
JSON holds the samples; the test reads them, and the log, for when the sends
began to fail and how much memory they held.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback

import numpy as np

from jax_two_process_worker import devices_of, finish, finish_and_exit_now, held_by, join_job

WARMUP = 20
BARRIER_TIMEOUT_MS = 60_000
MIB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> int:
    process_id, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    seconds, mode = float(sys.argv[4]), sys.argv[5]
    result: dict = {"process_id": process_id, "errors": [], "samples": []}
    try:
        import jax
        from jax.sharding import SingleDeviceSharding

        import jax_plugins.crosshost as crosshost

        kv = join_job(process_id, port)
        src = devices_of(0)[0]
        to_dst = SingleDeviceSharding(devices_of(1)[0])

        def put(i):
            x = held_by(np.full(MIB // 4, i, np.float32), src, process_id)
            return jax.device_put(x, to_dst)

        for i in range(WARMUP):
            y = put(i)
            if process_id == 1:
                assert float(np.asarray(y.addressable_shards[0].data)[0]) == i
        kv.wait_at_barrier("dead_receiver_warm", BARRIER_TIMEOUT_MS)
        if process_id == 1:
            finish(result, out_path)
            os.kill(os.getpid(), signal.SIGKILL if mode == "killed" else signal.SIGSTOP)

        def client_metrics() -> dict:
            return crosshost.metrics()[0]["metrics"]

        result["killed_at"] = time.monotonic()
        result["rss_at_kill"] = rss_bytes()
        result["bound"] = client_metrics()["max_pending_send_bytes"]
        next_sample = time.monotonic()
        end = time.monotonic() + seconds
        sent = 0
        while time.monotonic() < end:
            y = put(WARMUP + sent)
            del y
            sent += 1
            now = time.monotonic()
            if now >= next_sample:
                m = client_metrics()
                result["samples"].append({
                    "t": now - result["killed_at"],
                    "rss": rss_bytes(),
                    "sends_failed": m["sends_failed"],
                    "pending_send_bytes": m["pending_send_bytes"],
                })
                next_sample = now + 1.0
            time.sleep(0.005)
        result["sent"] = sent
    except Exception:  # noqa: BLE001 - reported to the test through the JSON
        result["errors"].append(traceback.format_exc())
    finish_and_exit_now(result, out_path)


if __name__ == "__main__":
    sys.exit(main())
