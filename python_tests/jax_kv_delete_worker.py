"""One process of a two-process JAX job that checks the package's KV delete
route (jax_plugins.crosshost._KvDelete) under its hazards
(test_jax_two_process.py, test_the_jax_delete_route_*).

    python jax_kv_delete_worker.py PROCESS_ID COORDINATOR_PORT OUT_JSON MODE

Run with ``kv_store=callbacks``: every transfer key goes through JAX's
coordination service and is deleted through the route. Process 1 posts its
receives for a batch of arrays from process 0, then tells process 0 to send.

MODE
``gil``
    Process 1 holds the GIL from before it tells process 0 to send (a huge
    switch interval; the go signal written to a FIFO and the metrics read
    through ``ctypes.PyDLL``, which keep the GIL: JAX's ``key_value_set``
    would release it while process 0 may already be sending) until its
    metrics count every byte received. Readiness must not need Python; the
    deletes, which do, must all come after it.
``failing``
    JAX's ``key_value_delete`` raises: every delete fails, is counted, and
    the buffers' status and bytes stand.
``hanging``
    JAX's ``key_value_delete`` blocks until the test's end: each delete
    fails ``DEADLINE_EXCEEDED`` after ``kv_call_timeout_ms`` and the buffers
    are ready and right regardless.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
import traceback

import numpy as np

SHAPES = [(16,), (1024,), (256, 256), (300_000,)]
BARRIER_TIMEOUT_MS = 60_000
GIL_HOLD_LIMIT_S = 30.0


class _DeleteProxy:
    """JAX's distributed client with ``key_value_delete`` replaced."""

    def __init__(self, client, mode: str, release: threading.Event):
        self._client, self._mode, self._release = client, mode, release
        self.calls = 0

    def key_value_delete(self, key):
        self.calls += 1
        if self._mode == "failing":
            raise RuntimeError(f"injected delete failure for {key}")
        self._release.wait(120)  # releases the GIL while it blocks
        return self._client.key_value_delete(key)

    def __getattr__(self, name):
        return getattr(self._client, name)


def metrics_holding_the_gil(library: str) -> dict:
    lib = ctypes.PyDLL(library)  # PyDLL: the GIL stays held during the call
    fetch = lib.pjrt_crosshost_live_clients_metrics_json
    fetch.restype = ctypes.c_void_p
    free = lib.pjrt_crosshost_free_string
    free.argtypes = [ctypes.c_void_p]
    raw = fetch()
    try:
        return json.loads(ctypes.string_at(raw).decode())[-1]["metrics"]
    finally:
        free(raw)


def go_fifo(out_path: str) -> str:
    """The FIFO process 1 says "send" through in ``gil`` mode (both make it;
    the second finds it there)."""
    path = os.path.join(os.path.dirname(out_path), "delete-route-go.fifo")
    try:
        os.mkfifo(path)
    except FileExistsError:
        pass
    return path


def say_go_holding_the_gil(path: str) -> None:
    libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held in each call
    libc.open.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    fd = libc.open(path.encode(), os.O_WRONLY)  # blocks until process 0 reads
    if fd < 0:
        raise OSError(ctypes.get_errno(), f"cannot open {path}")
    try:
        if libc.write(fd, b"1", 1) != 1:
            raise OSError(ctypes.get_errno(), f"cannot write {path}")
    finally:
        libc.close(fd)


def main() -> int:
    process_id, port, out_path, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    result: dict = {"process_id": process_id, "mode": mode, "errors": [], "bad": []}
    release = threading.Event()
    try:
        import jax
        from jax._src import distributed
        from jax.sharding import SingleDeviceSharding

        import jax_job
        import jax_plugins.crosshost as plugin

        kv, src_devices, dst_devices = jax_job.join(process_id, port)
        src, dst = src_devices[0], dst_devices[0]
        proxy = None
        if mode in ("failing", "hanging"):
            proxy = _DeleteProxy(kv, mode, release)
            distributed.global_state.client = proxy

        expected = [
            (np.arange(int(np.prod(s)), dtype=np.float32) * (i + 1)).reshape(s)
            for i, s in enumerate(SHAPES)
        ]
        total = sum(int(e.nbytes) for e in expected)
        shardings = [SingleDeviceSharding(dst)] * len(expected)
        xs = [jax_job.source_array(process_id, e, src) for e in expected]
        fifo = go_fifo(out_path) if mode == "gil" else None
        if process_id == 0:
            if fifo:
                with open(fifo, "rb") as go:
                    go.read(1)
            else:
                kv.blocking_key_value_get("crosshost_test_go", BARRIER_TIMEOUT_MS)
            jax.device_put(xs, shardings)
        else:
            ys = jax.device_put(xs, shardings)  # the receives are posted
            if not fifo:
                kv.key_value_set("crosshost_test_go", "1")
            else:
                old = sys.getswitchinterval()
                sys.setswitchinterval(1000.0)
                try:
                    say_go_holding_the_gil(fifo)
                    started = time.monotonic()
                    while True:
                        m = metrics_holding_the_gil(plugin.registered_library())
                        if m["bytes_received"] >= total:
                            break
                        if time.monotonic() - started > GIL_HOLD_LIMIT_S:
                            break
                finally:
                    sys.setswitchinterval(old)
                result["while_gil_held"] = m
            for i, (e, y) in enumerate(zip(expected, ys)):
                got = np.asarray(y.addressable_shards[0].data)
                if got.tobytes() != e.tobytes():
                    result["bad"].append(i)
        result["total_bytes"] = total
        result["transfers"] = len(expected)
        if process_id == 1:
            # Failing deletes settle at once; hanging ones at kv_call_timeout_ms.
            clients = plugin.settled_metrics(timeout=30)
            result["metrics"] = clients[-1]["metrics"] if clients else {}
        result["delete_calls"] = proxy.calls if proxy else None
        release.set()
        distributed.global_state.client = kv
        kv.wait_at_barrier("crosshost_test_metrics", BARRIER_TIMEOUT_MS)
        entries = kv.key_value_dir_get_bytes("crosshost:crosshost")
        result["jax_store_transfer_keys"] = [
            k for k, _ in entries if "/recv/" in k or "/desc/" in k
        ]
        kv.wait_at_barrier("crosshost_test_listed", BARRIER_TIMEOUT_MS)
    except Exception:  # noqa: BLE001 - reported to the test through the JSON
        result["errors"].append(traceback.format_exc())
    finally:
        release.set()
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
