"""JAX-level benchmark: cross-process jax.device_put through crosshost against
the same program on JAX's own CPU backend (its socket transfer server), in
one run.

    python bench/jax_device_put.py [--reps 7] [--quick] [--json out.json]
                                   [--hosts [--rounds 3]]

For each backend, two processes join a jax.distributed job on 127.0.0.1 and
put process 0's arrays onto process 1's device. Each figure is the
receiver's time from a barrier both processes leave together to
block_until_ready of what it received; the median of --reps repetitions
(after one unmeasured warm-up of each case). Crosshost runs with its default
configuration: shared memory on one host, the default compute plugin when
installed, JAX's coordination service as the key-value store. Afterwards the
crosshost job lists what its transfers left in that store.

With --hosts the two processes run on two hosts of a two-host bed
(scripts/two-hosts.sh, python_tests/two_hosts.py; root only): process 0 and
JAX's coordinator on host a (xh-a, 10.77.0.1), process 1 on host b (xh-b,
10.77.0.2), joined by a veth, each host with its own network, pid, IPC, UTS
namespace, /dev/shm and boot id, so no same-host shortcut exists. One run
measures JAX's own CPU path (its socket transfer server, told each host's
bed address), crosshost in each of HOST_VARIANTS (or --variant), one raw
TCP stream over the same veth (256 MiB, sendall/recv_into), and the bytes
of the 1 MiB case raw on one stream and of the 64 x 1 MiB case over 1, 2
and 4 parallel streams (RAW_CEILINGS: what the veth moves at all with
plain sockets, beside JAX's path and ours); each of these jobs runs
--rounds times in alternating order, with its times pooled. It prints the
ratios to JAX's path, each variant's ratio to the fastest raw streams of
the same bytes (median, and each round's own), and crosshost's
large-transfer rate as a fraction of the raw stream's.
Options in --per-host-options (default PER_HOST_OPTIONS) are added to
every crosshost variant, with {addr} replaced by each host's own bed
address and {host} by its name.

Environment: the library under test is PJRT_CROSSHOST_LIB (default
target/release/libpjrt_crosshost.so), loaded through the in-repo package.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
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

# --hosts: the crosshost variants measured, (label, create options), in
# PJRT_CROSSHOST_CREATE_OPTIONS' k=v form; "{addr}" / "{host}" are replaced
# by each host's own bed address / name. A label ending in "-noucx" runs with
# the system's libucp hidden on both hosts (the TCP fallback a machine
# without UCX gets). No variant needs options: each process finds the
# address it is reached at and, where both have it, moves bytes over UCX.
HOST_VARIANTS = [
    ("auto", ""),
    ("tcp-noucx", ""),
]
# --hosts: options every variant gets on each host (none are needed).
PER_HOST_OPTIONS = ""
# --hosts: bulk transport connections of JAX's own path (each "<addr>:0");
# JAX's default, when jax_cross_host_transport_addresses is not set, is
# 4 x 0.0.0.0:0 -- an address the other host cannot connect to.
JAX_TRANSPORTS = 4
RAW_TCP_BYTES = 256 * MIB
# --hosts: the bytes of these cases, raw, over each number of parallel
# streams: what the veth moves with plain sockets, beside JAX and us.
# (1 MiB on one stream only: starting a thread per stream per repetition
# costs more than such a buffer's time on the wire.)
RAW_CEILINGS = (("1 MiB", MIB, (1,)), ("64 x 1 MiB", 64 * MIB, (1, 2, 4)))
# Cases of at most SMALL_BYTES in all run SMALL_REPS_FACTOR times --reps.
SMALL_BYTES = 4 * MIB
SMALL_REPS_FACTOR = 5


def parse_cases(text: str) -> list:
    """'16x256 KiB,4 MiB' -> [("16 x 256 KiB", 262144, 16), ("4 MiB", 4194304, 1)]."""
    units = {"KiB": 1 << 10, "MiB": MIB}
    cases = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(?:(\d+)\s*x\s*)?(\d+)\s*(KiB|MiB)\s*", item)
        if match is None:
            raise argparse.ArgumentTypeError(f"not a case: {item!r} (want e.g. '16x256 KiB')")
        count, size, unit = int(match.group(1) or 1), int(match.group(2)), match.group(3)
        name = f"{size} {unit}" if count == 1 else f"{count} x {size} {unit}"
        cases.append((name, size * units[unit], count))
    return cases


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ worker --


def worker(process_id: int, port: int, out: str, backend: str, reps: int, cases: list,
           where: dict | None = None) -> None:
    """One process of a job. ``where`` (--hosts): the coordinator's address
    and this host's own bed address."""
    import numpy as np

    import jax

    where = where or {}
    address = where.get("address")
    if backend == "cpu":
        if address is None:
            jax.config.update(
                "jax_cross_host_transfer_socket_address", f"127.0.0.1:{free_port()}"
            )
        else:
            # On the bed JAX's socket transfer server needs this host's own
            # address and a real port (port 0 is advertised as such: the
            # peer's pull never connects), and its bulk transports need the
            # address too (their default, 0.0.0.0:0, makes the peer connect
            # to itself: "Connection refused" and an abort).
            jax.config.update(
                "jax_cross_host_transfer_socket_address", f"{address}:{free_port(address)}"
            )
            jax.config.update(
                "jax_cross_host_transport_addresses",
                ",".join([f"{address}:0"] * int(where.get("jax_transports", JAX_TRANSPORTS))),
            )
    from jax._src import distributed
    from jax.sharding import SingleDeviceSharding

    jax.distributed.initialize(
        coordinator_address=where.get("coordinator", f"127.0.0.1:{port}"), num_processes=2,
        process_id=process_id, initialization_timeout=120,
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
        # Small transfers take tens of microseconds and vary more than that
        # on a busy 2-core machine: they get more repetitions.
        case_reps = reps * SMALL_REPS_FACTOR if nbytes * count <= SMALL_BYTES else reps
        for rep in range(case_reps + 1):
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


# ---------------------------------------------------------- raw TCP stream --


def _split(nbytes: int, streams: int) -> list[tuple[int, int]]:
    """``nbytes`` as ``streams`` contiguous (start, end) slices."""
    step = -(-nbytes // streams)
    return [(i, min(i + step, nbytes)) for i in range(0, nbytes, step)]


def _in_parallel(jobs) -> None:
    """Runs each callable on its own thread (sendall and recv_into release
    the GIL); re-raises the first failure."""
    if len(jobs) == 1:  # one stream: no thread to start on the timed path
        jobs[0]()
        return
    failures = []

    def run(job):
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            failures.append(e)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]


def raw_receive(out: str, reps: int, nbytes: int, address: str, streams: int = 1) -> None:
    """Receiver of the raw TCP streams: listens on ``address``, prints its
    port, takes ``streams`` connections, then per repetition asks each for
    its slice of ``nbytes`` (one byte "go") and times until all of them are
    in (recv_into one buffer, one thread per stream)."""
    srv = socket.create_server((address, 0))
    print(srv.getsockname()[1], flush=True)
    srv.settimeout(120)
    conns = []
    for _ in range(streams):
        conn, _ = srv.accept()
        conn.settimeout(300)
        conns.append(conn)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    slices = _split(nbytes, streams)

    def receive(conn, start, end):
        got = start
        while got < end:
            k = conn.recv_into(view[got:end])
            if not k:
                raise SystemExit(f"raw TCP: a sender closed after {got - start} of {end - start} bytes")
            got += k

    times = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        for conn in conns:
            conn.sendall(b"g")
        _in_parallel([lambda c=c, a=a, b=b: receive(c, a, b) for c, (a, b) in zip(conns, slices)])
        elapsed = time.perf_counter() - t0
        assert all(buf[a] == rep % 256 and buf[b - 1] == rep % 256 for a, b in slices), \
            "raw TCP: wrong data"
        if rep > 0:  # the first is the warm-up
            times.append(elapsed)
    for conn in conns:
        conn.close()
    with open(out, "w") as f:
        json.dump({"times": times, "bytes": nbytes, "streams": streams}, f)


def raw_send(host: str, port: int, reps: int, nbytes: int, streams: int = 1) -> None:
    """Sender of the raw TCP streams: per "go", one sendall of its slice."""
    conns = [socket.create_connection((host, port), timeout=120) for _ in range(streams)]
    for conn in conns:
        conn.settimeout(300)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    slices = _split(nbytes, streams)

    def send(conn, start, end, rep):
        buf[start] = buf[end - 1] = rep % 256
        if conn.recv(1) != b"g":
            raise SystemExit("raw TCP: the receiver went away")
        conn.sendall(view[start:end])

    for rep in range(reps + 1):
        _in_parallel([lambda c=c, a=a, b=b: send(c, a, b, rep) for c, (a, b) in zip(conns, slices)])
    for conn in conns:
        conn.close()


# ------------------------------------------------------------- orchestrator --


def worker_env(backend: str, options: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.pop("PJRT_CROSSHOST_CREATE_OPTIONS", None)
    if options:
        env["PJRT_CROSSHOST_CREATE_OPTIONS"] = options
    env["JAX_PLATFORMS"] = backend
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    lib = os.environ.get("PJRT_CROSSHOST_LIB", str(REPO / "target/release/libpjrt_crosshost.so"))
    env["PJRT_CROSSHOST_JAX_LIBRARY"] = lib
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), env.get("PYTHONPATH", "")])
    return env


def wait_workers(procs: list, what: str, timeout: float, kill) -> None:
    """Waits for every worker (one deadline for all); when one fails or the
    deadline passes, kills them all and raises SystemExit."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise SystemExit(f"{what}: timed out after {timeout:.0f} s") from None
            if code != 0:
                raise SystemExit(f"{what}: worker failed (exit {code})")
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill(proc)


def run_backend(backend: str, reps: int, cases: list, python: str, options: str = "",
                bed=None, host_options: dict | None = None, timeout: float = 1800,
                hide_ucx: bool = False) -> dict:
    """One two-process job; returns the receiver's report. With ``bed``: on
    its two hosts, ``host_options[host]`` each host's create options, and
    with ``hide_ucx`` the system's libucp hidden there."""
    def kill(proc):
        proc.kill()

    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"out{p}.json") for p in (0, 1)]
        if bed is None:
            port = free_port()
            env = worker_env(backend, options)
            procs = [
                subprocess.Popen(
                    [python, __file__, "--worker", str(p), str(port), outs[p], backend, str(reps),
                     json.dumps(cases)],
                    env=env, start_new_session=True,
                )
                for p in (0, 1)
            ]
        else:
            from two_hosts import kill_group as kill  # noqa: F811 - a host's run, group and all
            from two_hosts import without_ucx

            port = bed.port()
            procs = []
            for p, host in enumerate(("a", "b")):
                where = {"coordinator": f"{bed.hostname('a')}:{port}",
                         "address": bed.address(host), "jax_transports": JAX_TRANSPORTS}
                argv = [python, __file__, "--worker", str(p), str(port), outs[p], backend,
                        str(reps), json.dumps(cases), json.dumps(where)]
                procs.append(bed.popen(
                    host,
                    without_ucx(argv) if hide_ucx else argv,
                    env=worker_env(backend, (host_options or {}).get(host, "")),
                ))
        wait_workers(procs, f"{backend} {options or ''}".strip() + " benchmark", timeout, kill)
        return json.load(open(outs[1]))


def run_raw_tcp(bed, reps: int, python: str, nbytes: int = RAW_TCP_BYTES, streams: int = 1,
                timeout: float = 600) -> dict:
    """Raw TCP over the bed's veth, the way the arrays go: ``nbytes`` split
    over ``streams`` connections, the senders on a, the receivers on b
    (xh-b); the receiver's times."""
    from two_hosts import kill_group, read_line

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "raw.json")
        receiver = bed.popen("b", [python, __file__, "--raw-receive", out, str(reps), str(nbytes),
                                   bed.address("b"), str(streams)], stdout=subprocess.PIPE)
        try:
            port = int(read_line(receiver, 60))
        except (TimeoutError, ValueError):
            kill_group(receiver)
            raise SystemExit("raw TCP receiver did not start") from None
        sender = bed.popen("a", [python, __file__, "--raw-send", bed.hostname("b"), str(port),
                                 str(reps), str(nbytes), str(streams)])
        wait_workers([receiver, sender], "raw TCP", timeout, kill_group)
        return json.load(open(out))


def host_option_strings(variant: str, per_host: str, bed) -> dict:
    joined = ",".join(o for o in (per_host, variant) if o)
    return {h: joined.format(addr=bed.address(h), host=bed.hostname(h)) for h in ("a", "b")}


def pooled(reports: list) -> dict:
    """One job's reports over the rounds as one: every round's times of each
    case together, the keys every round left added up, the last round's
    metrics; the first failure if a round failed."""
    for report in reports:
        if "error" in report:
            return report
    merged = dict(reports[-1])
    merged["results"] = {
        name: [t for report in reports for t in report["results"].get(name, [])]
        for name in reports[-1]["results"]
    }
    unread = [report for report in reports if not isinstance(report.get("transfer_keys"), int)]
    if unread:
        merged.pop("transfer_keys", None)
        merged["store_keys_error"] = unread[0].get("store_keys_error", "not reported")
    else:
        merged["transfer_keys"] = sum(report["transfer_keys"] for report in reports)
    return merged


def pooled_raw(reports: list) -> dict:
    """One raw TCP job's reports over the rounds as one: every round's
    times together; the first failure if a round failed."""
    for report in reports:
        if "error" in report:
            return report
    return {**reports[-1], "times": [t for report in reports for t in report["times"]]}


def main_hosts(args, cases: list, jax_version: str) -> None:
    sys.path.insert(0, str(REPO / "python_tests"))
    import two_hosts

    reason = two_hosts.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"--hosts: no two-host bed can be made here: {reason}")
    args.rounds = max(1, args.rounds)
    variants = HOST_VARIANTS
    if args.variant:
        variants = [tuple(v.split("=", 1)) if "=" in v else (v, "") for v in args.variant]
    results: dict = {"variants": {}, "options": {}}
    with two_hosts.TwoHostBed() as bed:
        print(f"two-host bed {bed.name}: process 0 and the coordinator on {bed.hostname('a')} "
              f"({bed.address('a')}), process 1 on {bed.hostname('b')} ({bed.address('b')})",
              flush=True)

        def attempt(what, fn):
            try:
                return fn()
            except SystemExit as e:
                print(f"{what}: FAILED: {e}", flush=True)
                return {"error": str(e)}

        # Each round runs every job once, starting one job later than the
        # round before: a slow spell of this shared machine then falls on
        # each job in turn instead of on whichever happened to run in it.
        # The raw streams are jobs of the rounds too, so that each ratio to
        # them compares times of the same spells.
        ceilings = [(case, nbytes, streams) for case, nbytes, streams in RAW_CEILINGS
                    if any(c[0] == case for c in cases)]
        rounds: dict = {"cpu": [], "variants": {label: [] for label, _ in variants},
                        "raw_tcp": [],
                        "raw_ceilings": {case: {n: [] for n in streams}
                                         for case, _, streams in ceilings}}
        # (what, how, where its rounds' reports go)
        jobs = [("JAX's CPU path", lambda: run_backend(
            "cpu", args.reps, cases, args.python, bed=bed, timeout=args.timeout), rounds["cpu"])]
        for label, variant in variants:
            opts = host_option_strings(variant, args.per_host_options, bed)
            results["options"][label] = opts
            jobs.append((f"crosshost {label} ({opts})",
                         lambda label=label, variant=variant, opts=opts: run_backend(
                             "crosshost", args.reps, cases, args.python, options=variant, bed=bed,
                             host_options=opts, timeout=args.timeout,
                             hide_ucx=label.endswith("-noucx")),
                         rounds["variants"][label]))
        jobs.append(("raw TCP", lambda: run_raw_tcp(bed, args.reps, args.python), rounds["raw_tcp"]))
        for case, nbytes, streams in ceilings:
            for n in streams:
                jobs.append((f"raw TCP, {case}, {n} streams",
                             lambda nbytes=nbytes, n=n: run_raw_tcp(
                                 bed, args.reps * (SMALL_REPS_FACTOR if nbytes <= SMALL_BYTES else 1),
                                 args.python, nbytes=nbytes, streams=n),
                             rounds["raw_ceilings"][case][n]))
        for r in range(args.rounds):
            for what, run, reports in jobs[r % len(jobs):] + jobs[:r % len(jobs)]:
                reports.append(attempt(f"{what}, round {r + 1}", run))
        results["rounds"] = rounds
        results["cpu"] = pooled(rounds["cpu"])
        for label, reports in rounds["variants"].items():
            results["variants"][label] = pooled(reports)
        results["raw_tcp"] = pooled_raw(rounds["raw_tcp"])
        results["raw_ceilings"] = {case: {n: pooled_raw(reports) for n, reports in by_n.items()}
                                   for case, by_n in rounds["raw_ceilings"].items()}

    cpu, raw = results["cpu"], results["raw_tcp"]
    labels = [label for label, _ in variants]

    def med(report, name):
        times = report.get("results", {}).get(name)
        return statistics.median(times) if times else None

    def ms(t):
        return f"{t * 1e3:.2f} ms" if t is not None else "failed"

    print(f"\nJAX {jax_version}, two hosts (xh-a -> xh-b over a veth): cross-host "
          f"jax.device_put, receiver's time from a shared barrier to block_until_ready, "
          f"median of {args.reps * args.rounds} ({args.reps * SMALL_REPS_FACTOR * args.rounds} "
          f"for cases of at most 4 MiB) over {args.rounds} alternating rounds")
    for label in labels:
        print(f"crosshost {label}: a: {results['options'][label]['a'] or '(no options)'}; "
              f"b: {results['options'][label]['b'] or '(no options)'}")
    head = ["case", "JAX's path"] + [f"crosshost {lb}" for lb in labels] + [f"ratio {lb}" for lb in labels]
    rows = []
    table = []
    for name, _, _ in cases:
        theirs = med(cpu, name)
        mine = [med(results["variants"][lb], name) for lb in labels]
        ratios = [f"{theirs / m:.2f}x" if theirs and m else "-" for m in mine]
        rows.append([name, ms(theirs)] + [ms(m) for m in mine] + ratios)
        table.append({"case": name, "jax_ms": theirs and theirs * 1e3,
                      **{f"crosshost_{lb}_ms": m and m * 1e3 for lb, m in zip(labels, mine)}})
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    if args.rounds > 1:
        # The same ratio within each round (JAX's median / crosshost's, both
        # of that round): how far one round's verdict can be trusted.
        for label in labels:
            spans = []
            for name, _, _ in cases:
                ratios = [med(theirs, name) / med(mine, name)
                          for theirs, mine in zip(results["rounds"]["cpu"],
                                                 results["rounds"]["variants"][label])
                          if med(theirs, name) and med(mine, name)]
                if ratios:
                    spans.append(f"{name} {min(ratios):.2f}-{max(ratios):.2f}x")
            print(f"ratio {label} per round (lowest-highest): " + ", ".join(spans))
    if raw.get("times"):
        raw_t = statistics.median(raw["times"])
        raw_gbps = raw["bytes"] / raw_t / 1e9
        big = "256 MiB" if any(c[0] == "256 MiB" for c in cases) else "64 MiB"
        nbytes = 256 * MIB if big == "256 MiB" else 64 * MIB
        line = (f"raw TCP, one stream a -> b over the veth, {raw['bytes'] >> 20} MiB "
                f"(sendall/recv_into): {raw_gbps:.2f} GB/s ({raw_t * 1e3:.1f} ms)")
        fractions = []
        for label in [None] + labels:
            t = med(cpu if label is None else results["variants"][label], big)
            if t:
                gbps = nbytes / t / 1e9
                fractions.append(f"{'JAX' if label is None else 'crosshost ' + label} {big}: "
                                 f"{gbps:.2f} GB/s = {gbps / raw_gbps:.0%} of it")
        print(line)
        for f in fractions:
            print("  " + f)
    for case, by_streams in results["raw_ceilings"].items():
        theirs = med(cpu, case)
        for n, report in by_streams.items():
            if not report.get("times"):
                continue
            t = statistics.median(report["times"])
            line = (f"raw TCP for {case}: {report['bytes'] >> 20} MiB over {n} stream(s) "
                    f"a -> b in {t * 1e3:.2f} ms ({report['bytes'] / t / 1e9:.2f} GB/s)")
            if theirs:
                line += f"; JAX's path takes {theirs / t:.2f}x as long"
            print(line)
    # Each variant against the fastest raw streams of the same bytes (the
    # median over the rounds; in brackets each round's own ratio, that
    # round's fastest raw streams / that round's variant): above 1 is faster.
    for case, by_streams in results["raw_ceilings"].items():
        timed = {n: statistics.median(r["times"]) for n, r in by_streams.items() if r.get("times")}
        if not timed:
            continue
        best_n = min(timed, key=timed.get)
        for label in labels:
            mine = med(results["variants"][label], case)
            if not mine:
                continue
            per_round = []
            for r, report in enumerate(results["rounds"]["variants"][label]):
                raws = [statistics.median(reports[r]["times"])
                        for reports in results["rounds"]["raw_ceilings"][case].values()
                        if r < len(reports) and reports[r].get("times")]
                if raws and med(report, case):
                    per_round.append(min(raws) / med(report, case))
            spread = (f" ({min(per_round):.2f}-{max(per_round):.2f} per round)"
                      if len(per_round) > 1 else "")
            print(f"crosshost {label} for {case}: {timed[best_n] / mine:.2f}x the best raw TCP "
                  f"({best_n} stream(s), {timed[best_n] * 1e3:.2f} ms){spread}")
    for label in labels:
        report = results["variants"][label]
        if "error" in report:
            continue
        keys = report.get("transfer_keys", report.get("store_keys_error"))
        # Which transport carried each round's bytes: a job that meant UCX
        # but fell back shows here, not only in the last round's metrics.
        carried = [",".join(t for t, c in (r.get("metrics") or {}).get("transports", {}).items()
                            if c.get("bytes_received")) or "?"
                   for r in results["rounds"]["variants"][label]]
        print(f"crosshost {label}: bytes carried by (per round): {' / '.join(carried)}; "
              f"transfer keys left in JAX's coordination service "
              f"(all rounds): {keys}; receiver's metrics (last round): {report.get('metrics')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax_version, "hosts": True, "table": table, **results}, f, indent=1)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        pid, port, out, backend, reps, cases = sys.argv[2:8]
        where = json.loads(sys.argv[8]) if len(sys.argv) > 8 else None
        worker(int(pid), int(port), out, backend, int(reps), json.loads(cases), where)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-receive":
        out, reps, nbytes, address, streams = sys.argv[2:7]
        raw_receive(out, int(reps), int(nbytes), address, int(streams))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-send":
        host, port, reps, nbytes, streams = sys.argv[2:7]
        raw_send(host, int(port), int(reps), int(nbytes), int(streams))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="fewer cases (no 256 MiB)")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the workers")
    parser.add_argument("--hosts", action="store_true",
                        help="across the two hosts of a two-host bed (scripts/two-hosts.sh; root)")
    parser.add_argument("--variant", action="append", metavar="LABEL=OPTIONS",
                        help="--hosts: a crosshost variant (repeat; replaces HOST_VARIANTS)")
    parser.add_argument("--per-host-options", default=PER_HOST_OPTIONS, metavar="OPTIONS",
                        help="--hosts: options for every variant, {addr}/{host} per host "
                             f"(default {PER_HOST_OPTIONS!r}; '' for none)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="--hosts: every job this many times, alternating, times pooled")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="bound on each job, seconds")
    parser.add_argument("--cases", type=parse_cases, metavar="[COUNTx]SIZE,...",
                        help="these cases instead of CASES, e.g. '256 KiB,16x256 KiB,4 MiB' "
                             "(sizes in KiB or MiB)")
    args = parser.parse_args()
    cases = [c for c in CASES if not args.quick or c[0] in QUICK]
    if args.hosts:  # every case; --quick drops only 256 MiB
        cases = [c for c in CASES if not args.quick or c[0] != "256 MiB"]
    if args.cases:
        cases = args.cases

    import jax  # noqa: F401 - fail early, with a clear message, if JAX is absent

    jax_version = subprocess.check_output(
        [args.python, "-c", "import jax; print(jax.__version__)"], text=True
    ).strip()
    if args.hosts:
        main_hosts(args, cases, jax_version)
        return
    cpu = run_backend("cpu", args.reps, cases, args.python)
    ours = run_backend("crosshost", args.reps, cases, args.python)
    # Every key through JAX's coordination service, whose gets only block:
    # the batch-versus-one-buffer cost on a blocking-get-only store.
    small = [c for c in CASES if c[0] in ("4 KiB", "64 x 4 KiB")]
    blocking = run_backend("crosshost", args.reps, small, args.python, options="kv_store=callbacks")

    print(f"\nJAX {jax_version}: cross-process jax.device_put, receiver's time from a shared "
          f"barrier to block_until_ready, median of {args.reps} ({args.reps * SMALL_REPS_FACTOR} for cases of at most 4 MiB)")
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
