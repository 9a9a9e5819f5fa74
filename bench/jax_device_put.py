"""JAX-level benchmark: cross-process jax.device_put through crosshost against
the same program on JAX's own CPU backend (its socket transfer server), in
one run.

    python bench/jax_device_put.py [--reps 7] [--quick] [--json out.json]

For each backend, two processes join a jax.distributed job on 127.0.0.1 and
put process 0's arrays onto process 1's device. Each figure is the
receiver's time from a barrier both processes leave together to
block_until_ready of what it received; the median of --reps repetitions
(after one unmeasured warm-up of each case). Crosshost runs with its default
configuration: shared memory on one host, the default compute plugin when
installed, JAX's coordination service as the key-value store. Afterwards the
crosshost job lists what its transfers left in that store.

Environment: the library under test is PJRT_CROSSHOST_LIB (default
target/release/libpjrt_crosshost.so), loaded through the in-repo package.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
# JAX hands a plugin its coordination service with keys prefixed by the
# platform name: the plugin's "crosshost/..." keys are "crosshost:crosshost/...".
JAX_STORE_PREFIX = "crosshost:crosshost"

# (name, bytes of each array, arrays per device_put call)
CASES = [
    ("4 KiB", 4 << 10, 1),
    ("64 x 4 KiB", 4 << 10, 64),
    ("1 MiB", MIB, 1),
    ("64 x 1 MiB", MIB, 64),
    ("64 MiB", 64 * MIB, 1),
    ("256 MiB", 256 * MIB, 1),
]
QUICK = {"4 KiB", "1 MiB", "64 x 1 MiB", "64 MiB"}

# Targets (docs/DESIGN.md §10, inside JAX): crosshost / JAX's path.
TARGETS = {"4 KiB": 2.0, "64 x 1 MiB": 2.0, "1 MiB": 4.0, "64 MiB": 4.0, "256 MiB": 10.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ worker --


def worker(process_id: int, port: int, out: str, backend: str, reps: int, cases: list) -> None:
    import numpy as np

    import jax

    if backend == "cpu":
        jax.config.update(
            "jax_cross_host_transfer_socket_address", f"127.0.0.1:{free_port()}"
        )
    from jax._src import distributed
    from jax.sharding import SingleDeviceSharding

    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
        initialization_timeout=120,
    )
    kv = distributed.global_state.client
    assert jax.default_backend() == backend, (jax.default_backend(), backend)
    src = [d for d in jax.devices() if d.process_index == 0][0]
    dst = [d for d in jax.devices() if d.process_index == 1][0]
    results = {}
    barrier = 0

    def sync() -> None:
        nonlocal barrier
        barrier += 1
        kv.wait_at_barrier(f"bench_{barrier}", 300_000)

    for name, nbytes, count in cases:
        n = nbytes // 4
        times = []
        for rep in range(reps + 1):
            data = [np.full(n, rep * 100 + i, dtype=np.float32) for i in range(count)]
            if process_id == 0:
                xs = [jax.device_put(d, src) for d in data]
                jax.block_until_ready(xs)
            else:
                xs = [
                    jax.make_array_from_single_device_arrays(
                        (n,), SingleDeviceSharding(src), [], dtype=np.float32
                    )
                    for _ in range(count)
                ]
            sync()
            t0 = time.perf_counter()
            ys = jax.device_put(xs, [SingleDeviceSharding(dst)] * count)
            if process_id == 1:
                jax.block_until_ready(ys)
                elapsed = time.perf_counter() - t0
                ok = all(
                    float(np.asarray(y.addressable_data(0))[-1]) == rep * 100 + i
                    for i, y in enumerate(ys)
                )
                assert ok, f"{name}: wrong data received"
                if rep > 0:  # the first is the warm-up
                    times.append(elapsed)
            sync()  # the sender keeps its arrays until the receiver has them
            del xs, ys
        if process_id == 1:
            results[name] = times
    report = {"results": results}
    if backend == "crosshost" and process_id == 1:
        try:
            entries = kv.key_value_dir_get_bytes(JAX_STORE_PREFIX)
            report["store_keys"] = len(entries)
            report["transfer_keys"] = sum(
                1 for k, _ in entries if "/recv/" in k or "/desc/" in k
            )
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            report["store_keys_error"] = f"{type(e).__name__}: {e}"
        import jax_plugins.crosshost as plugin

        report["metrics"] = plugin.metrics()[-1]["metrics"]
        report["compute_plugin"] = plugin.configured_compute_plugin()
    sync()
    with open(out, "w") as f:
        json.dump(report, f)


# ------------------------------------------------------------- orchestrator --


def run_backend(backend: str, reps: int, cases: list, python: str, options: str = "") -> dict:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.pop("PJRT_CROSSHOST_CREATE_OPTIONS", None)
    if options:
        env["PJRT_CROSSHOST_CREATE_OPTIONS"] = options
    env["JAX_PLATFORMS"] = backend
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    lib = os.environ.get("PJRT_CROSSHOST_LIB", str(REPO / "target/release/libpjrt_crosshost.so"))
    env["PJRT_CROSSHOST_JAX_LIBRARY"] = lib
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"out{p}.json") for p in (0, 1)]
        procs = [
            subprocess.Popen(
                [python, __file__, "--worker", str(p), str(port), outs[p], backend, str(reps),
                 json.dumps(cases)],
                env=env, start_new_session=True,
            )
            for p in (0, 1)
        ]
        try:
            for proc in procs:
                if proc.wait(timeout=1800) != 0:
                    raise SystemExit(f"{backend} benchmark worker failed (exit {proc.returncode})")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        return json.load(open(outs[1]))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        pid, port, out, backend, reps, cases = sys.argv[2:8]
        worker(int(pid), int(port), out, backend, int(reps), json.loads(cases))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="fewer cases (no 256 MiB)")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the workers")
    args = parser.parse_args()
    cases = [c for c in CASES if not args.quick or c[0] in QUICK]

    import jax  # noqa: F401 - fail early, with a clear message, if JAX is absent

    jax_version = subprocess.check_output(
        [args.python, "-c", "import jax; print(jax.__version__)"], text=True
    ).strip()
    cpu = run_backend("cpu", args.reps, cases, args.python)
    ours = run_backend("crosshost", args.reps, cases, args.python)
    # Every key through JAX's coordination service, whose gets only block:
    # the batch-versus-one-buffer cost on a blocking-get-only store.
    small = [c for c in CASES if c[0] in ("4 KiB", "64 x 4 KiB")]
    blocking = run_backend("crosshost", args.reps, small, args.python, options="kv_store=callbacks")

    print(f"\nJAX {jax_version}: cross-process jax.device_put, receiver's time from a shared "
          f"barrier to block_until_ready, median of {args.reps}")
    print(f"compute plugin: {ours.get('compute_plugin')}")
    print(f"{'case':<12} {'JAX CPU path':>14} {'crosshost':>12} {'ratio':>8} {'target':>8}")
    table = []
    for name, _, _ in cases:
        theirs = statistics.median(cpu["results"][name])
        mine = statistics.median(ours["results"][name])
        ratio = theirs / mine
        target = TARGETS.get(name)
        verdict = "" if target is None else ("met" if ratio >= target else "NOT met")
        table.append({"case": name, "jax_ms": theirs * 1e3, "crosshost_ms": mine * 1e3,
                      "ratio": ratio, "target": target})
        target_text = f">={target:g}x {verdict}" if target else ""
        print(f"{name:<12} {theirs * 1e3:>11.2f} ms {mine * 1e3:>9.2f} ms {ratio:>7.2f}x {target_text}")
    single = statistics.median(ours["results"]["4 KiB"]) if "4 KiB" in ours["results"] else None
    batch = statistics.median(ours["results"]["64 x 4 KiB"]) if "64 x 4 KiB" in ours["results"] else None
    if single and batch:
        print(f"crosshost 64 x 4 KiB / one 4 KiB: {batch / single:.1f}x")
    b_single = statistics.median(blocking["results"]["4 KiB"])
    b_batch = statistics.median(blocking["results"]["64 x 4 KiB"])
    verdict = "met" if b_batch / b_single <= 4 else "NOT met"
    print(f"blocking-get store (kv_store=callbacks, JAX's coordination service): "
          f"4 KiB {b_single * 1e3:.2f} ms, 64 x 4 KiB {b_batch * 1e3:.2f} ms, "
          f"ratio {b_batch / b_single:.1f}x (target <=4x {verdict})")
    keys = ours.get("transfer_keys", ours.get("store_keys_error"))
    print(f"transfer keys left in JAX's coordination service: {keys}")
    print(f"crosshost metrics (receiver): {ours.get('metrics')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax_version, "table": table, "crosshost": ours, "cpu": cpu,
                       "blocking_store": blocking}, f, indent=1)


if __name__ == "__main__":
    main()
