"""The staging pipeline's cost on CPU: one large buffer between the two
hosts of the two-host bed, through the staging path with host memory
(``stage_host_transfers=1``: the sender's send ring, the receiver's receive
ring, memcpys as the device copies) against the direct host path, over TCP
and over UCX, in one run (issue #38's CPU target: staged <= 1.1x direct at
256 MiB).

    python bench/staging.py [--bytes 268435456] [--reps 5] [--rounds 2]
                            [--chunk 4194304] [--depth 4] [--transports tcp,ucx]
                            [--json out.json]

Each variant is a job of two processes (bench/staging_worker.py; the
sender on host a, the receiver on host b), --rounds times in alternating
order, each job --reps measured transfers after one unmeasured; a time is
the receiver's, from telling the sender to go (its receive posted) to the
buffer's ready event. The table gives each variant's median over all its
transfers and the staged/direct ratio per transport. Root only (the bed
needs network namespaces); PJRT_CROSSHOST_LIB names the library under test,
PJRT_CROSSHOST_UCX_WHEEL_LIB the libucx wheel's UCX where the system's is
too old.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python_tests"))

import two_hosts  # noqa: E402

KV_WORKER = REPO / "python_tests" / "two_host_worker.py"
WORKER = REPO / "bench" / "staging_worker.py"


def library() -> str:
    return os.environ.get("PJRT_CROSSHOST_LIB", str(REPO / "target/release/libpjrt_crosshost.so"))


def run_job(bed, kv: list, label: str, options: dict, args, round_no: int) -> dict:
    session = f"staging-{label.replace(' ', '-')}-{round_no}-{os.getpid()}-{time.monotonic_ns()}"
    procs = []
    for node, host in ((1, "b"), (0, "a")):
        cfg = {"lib": library(), "kv": kv, "session": session, "node": node,
               "bytes": args.bytes, "reps": args.reps,
               "options": {"receive_timeout_ms": 120_000, "send_timeout_ms": 120_000,
                           "staging_chunk_bytes": args.chunk, "staging_ring_depth": args.depth,
                           **options}}
        procs.append(bed.popen(host, [sys.executable, str(WORKER), json.dumps(cfg)],
                               env=dict(os.environ, PYTHONPATH=str(REPO / "python_tests")),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    reports = {}
    for proc in procs:
        line = two_hosts.read_line(proc, args.timeout)
        if not line:
            proc.kill()
            raise RuntimeError(f"{label}: a worker printed nothing (stderr: "
                               f"{proc.stderr.read().decode(errors='replace')[-2000:]})")
        report = json.loads(line)
        if "error" in report:
            raise RuntimeError(f"{label}: node {report['node']} failed:\n{report['error']}")
        reports[report["node"]] = report
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return reports[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=256 << 20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=4 << 20, help="staging_chunk_bytes")
    parser.add_argument("--depth", type=int, default=4, help="staging_ring_depth")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--transports", default="tcp,ucx",
                        help="which transports to run, comma-separated (tcp, ucx)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    reason = two_hosts.unavailable_reason()
    if reason:
        print(f"staging.py: no two-host bed here: {reason}", file=sys.stderr)
        return 2
    variants = [
        ("tcp direct", {"transport": "tcp"}),
        ("tcp staged", {"transport": "tcp", "stage_host_transfers": 1}),
        ("ucx direct", {"transport": "ucx"}),
        ("ucx staged", {"transport": "ucx", "stage_host_transfers": 1}),
    ]
    wanted = set(args.transports.split(","))
    variants = [(label, options) for label, options in variants if label.split()[0] in wanted]
    times: dict = {label: [] for label, _ in variants}
    metrics: dict = {}
    with two_hosts.TwoHostBed() as bed:
        kv_proc = bed.popen("a", [sys.executable, str(KV_WORKER), "kv", str(bed.port())],
                            env=dict(os.environ, PYTHONPATH=str(REPO / "python_tests")),
                            stdout=subprocess.PIPE)
        line = two_hosts.read_line(kv_proc, 30)
        if not line:
            raise RuntimeError("the KV server did not start")
        kv = json.loads(line)["kv"]
        kv[0] = bed.address("a")
        for round_no in range(args.rounds):
            order = variants if round_no % 2 == 0 else list(reversed(variants))
            for label, options in order:
                report = run_job(bed, kv, label, options, args, round_no)
                times[label].extend(report["times"])
                metrics[label] = report["metrics"]
                print(f"staging.py: round {round_no + 1} {label}: "
                      f"{', '.join(f'{t * 1e3:.1f}' for t in report['times'])} ms", flush=True)
    median = {label: statistics.median(t) for label, t in times.items()}
    mib = args.bytes / (1 << 20)
    print(f"\n{mib:.0f} MiB, host memory, two-host bed; chunk {args.chunk >> 10} KiB x "
          f"{args.depth}; median of {args.reps * args.rounds} transfers per variant over "
          f"{args.rounds} alternating rounds")
    print(f"{'variant':<12} {'median ms':>10} {'GB/s':>7} {'staged/direct':>14}")
    results = {"bytes": args.bytes, "chunk": args.chunk, "depth": args.depth,
               "times": times, "median_s": median, "ratios": {}}
    for label, _ in variants:
        transport, kind = label.split()
        ratio = ""
        if kind == "staged":
            r = median[label] / median[f"{transport} direct"]
            results["ratios"][transport] = r
            ratio = f"{r:.2f}x" + ("" if r <= 1.1 else " (above the 1.1x target)")
        print(f"{label:<12} {median[label] * 1e3:>10.1f} "
              f"{args.bytes / median[label] / 1e9:>7.2f} {ratio:>14}")
    for label, m in metrics.items():
        staged = {t: m["transports"][t]["transfers_staged"] for t in ("tcp", "ucx")}
        print(f"{label}: receiver staged {m['staged']} transfers {staged}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
