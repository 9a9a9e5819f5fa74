"""Scale benchmark: one ctypes job of N processes, one per host of an N-host
bed (scripts/n-hosts.sh, python_tests/n_hosts.py; root only), for N in
2, 4, 8, 16, 32, 64.

    python bench/scale.py [--max 64 | --counts 2,4,8] [--store etcd|callbacks]
                          [--tcp] [--sizes 65536] [--json out.json]
                          [--per-host K] [--nofile 1024] [--round all|ring]
                          [--option k=v ...]

With --per-host K each host runs K processes (one per GPU of a node, say),
process i on host i mod N, so N*K processes form the job (column P); those
of one host reach each other through shared memory. With --nofile every
process sets that soft open-file limit and the plugin is told not to raise
it (PJRT_CROSSHOST_RAISE_FD_LIMIT=0); a process whose limit did not hold
fails the run. --round ring measures a ring instead of the all-to-all.

For each N a fresh bed of N hosts and a store host (etcd, or with
--store callbacks the KV server of the plugin's default multi-process mode),
one process per host (python_tests/n_host_worker.py). Every process starts
creating its client at once; once all are created, an all-to-all round
(every process sends --sizes bytes to every other and receives as much from
each, every byte checked). Per N:

  create_s     from the start to the last process created
  fds, thr, rss_mib, tcp
               per process (mean over the N), after creation and after the
               all-to-all round: open fds, threads, RSS, established TCP
               connections to the job's other hosts (+ to the store host)
  a2a_s        the slowest process's all-to-all round
  s:tcp, s:max tcp, s:ucx eps
               after --settle seconds with nothing sent (default 3: past the
               1 s grace and a sweep): established TCP connections to peers
               (mean, most), and UCX endpoints the plugin holds open (mean);
               what max_peer_connections bounds
  etcd_cpu_s   etcd's CPU time (/proc/<pid>/stat, user + system) to start
               the job, and (a2a_etcd_s) during the all-to-all round

and under the table each column's least-squares fit a + b*(N-1): b is what
one more host costs each process (or the job, for times and etcd's CPU).
An N whose job fails (a creation, a transfer, a byte, a key left) ends the
run: what failed is printed, counted by kind, and larger N are not run.

With --store etcd every process gets etcd_lease_ttl_s=60 (ETCD_LEASE_TTL_S;
--option etcd_lease_ttl_s=... overrides): etcd shares the machine's cores
with every worker, and on 2 cores a 64-host all-to-all (about 16,000 puts
and deletes) keeps it a backlog of writes behind for longer than the
default 10 s lease. etcd renews a lease only after applying every write it
has committed (1 s at most, else "waiting for the applied index took too
long"), so with 10 s every lease lapsed and every process was declared gone.

With --store callbacks, +st counts the test harness's connections to its
KV server (kv_server.KvClient: one per call in flight), not the plugin's.

Many processes on one machine: each process's first receive makes a
256 MiB shared-memory segment (shm_pool_bytes, 1 GiB by default, in 256 MiB
segments), and UCX's own shared-memory transports take 8 MiB a process
(posix and SysV segments; the plugin moves bytes between processes of one
host through its own shm transport, never through UCX's). For 300
processes on a 24 GiB machine pass --option shm_pool_bytes=0 (each buffer
a region of its own size) and UCX_TLS=tcp: about 22 MiB a process then
(PSS after creation, 4 x 4 processes).

Environment: PJRT_CROSSHOST_LIB (default target/release/libpjrt_crosshost.so);
PJRT_CROSSHOST_UCX_WHEEL_LIB (default: the libucx wheel's, as scripts/test.sh
finds it). The machine's cores run every host: on a 2-core machine times grow
with N for that reason too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python_tests"))

import n_hosts  # noqa: E402
from n_host_job import NHostJob  # noqa: E402

COUNTS = [2, 4, 8, 16, 32, 64]
# etcd's lease for the bench (see the docstring): longer than its write
# backlog on a shared 2-core machine.
ETCD_LEASE_TTL_S = 60
UCX_WHEEL_ENV = "PJRT_CROSSHOST_UCX_WHEEL_LIB"
# (column, heading, format)
COLUMNS = [
    ("bed_s", "bed s", "{:.1f}"),
    ("create_s", "create s", "{:.2f}"),
    ("create_fds", "c:fds", "{:.0f}"),
    ("create_threads", "c:thr", "{:.0f}"),
    ("create_rss_mib", "c:MiB", "{:.1f}"),
    ("create_tcp_peers", "c:tcp", "{:.1f}"),
    ("create_tcp_store", "c:+st", "{:.1f}"),
    ("a2a_s", "a2a s", "{:.2f}"),
    ("a2a_fds", "a:fds", "{:.0f}"),
    ("a2a_max_fds", "a:max fds", "{:.0f}"),
    ("a2a_threads", "a:thr", "{:.0f}"),
    ("a2a_rss_mib", "a:MiB", "{:.1f}"),
    ("a2a_tcp_peers", "a:tcp", "{:.1f}"),
    ("a2a_tcp_store", "a:+st", "{:.1f}"),
    ("settled_tcp_peers", "s:tcp", "{:.1f}"),
    ("settled_max_tcp_peers", "s:max tcp", "{:.0f}"),
    ("settled_ucx_endpoints", "s:ucx eps", "{:.1f}"),
    ("etcd_cpu_s", "etcd cpu s", "{:.2f}"),
    ("a2a_etcd_s", "a2a etcd s", "{:.2f}"),
]


def fit(ns: list[int], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b*(n-1)."""
    xs = [n - 1 for n in ns]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def usage_means(results: dict, phase: str) -> dict:
    rows = [r[phase] for r in results.values()]
    return {
        "fds": statistics.fmean(u["fds"] for u in rows),
        "threads": statistics.fmean(u["threads"] for u in rows),
        "rss_mib": statistics.fmean(u["rss_mib"] for u in rows),
        "tcp_peers": statistics.fmean(u["tcp"]["peers"] for u in rows),
        "tcp_store": statistics.fmean(u["tcp"]["store"] for u in rows),
        "max_fds": max(u["fds"] for u in rows),
        "max_threads": max(u["threads"] for u in rows),
        "max_tcp_peers": max(u["tcp"]["peers"] for u in rows),
        **({"ucx_endpoints": statistics.fmean(u["ucx_endpoints"] for u in rows)}
           if all("ucx_endpoints" in u for u in rows) else {}),
    }


def failure_classes(results: dict, round_name: str = "all", sizes=None) -> dict[str, int]:
    """How many transfers ended each way but OK (messages with their keys,
    ids and numbers blanked), and how many processes failed creation."""
    classes: dict[str, int] = {}

    def count(what: str, outcome: str) -> None:
        key = what + " " + re.sub(r"[0-9a-f]{6,}|\d+", "#", outcome)[:200]
        classes[key] = classes.get(key, 0) + 1

    for r in results.values():
        if "create_error" in r:
            count("create", f"{r['create_error']['code']}: {r['create_error']['message']}")
            continue
        for what in ("sends", "receives"):
            for outcomes in r[round_name][what].values():
                for outcome in outcomes:
                    count(what[:-1], outcome)
        for _ in r[round_name]["bad_bytes"]:
            count("receive", "bytes differ")
        # Every byte that arrived was compared with what its sender wrote.
        rnd = r[round_name]
        if sizes and not rnd["receives"]:
            if rnd["checked_bytes"] != rnd["received"] // len(sizes) * sum(sizes):
                count("receive", f"{rnd['checked_bytes']} bytes checked of {rnd['received']} buffers")
        if r["metrics"]["keys_outstanding"]:
            count("process", "completion keys left")
    return classes


def measure(n: int, args, log_dir: Path) -> dict:
    started = time.monotonic()
    with n_hosts.NHostBed(n, store=True) as bed:
        row: dict = {"n": n, "bed_s": time.monotonic() - started}
        timeout = args.timeout or max(60.0, 3.0 * n)
        round_name = args.round
        job = NHostJob(bed, log_dir, store=args.store, hide_ucx=args.tcp, sizes=args.sizes,
                       rounds=(round_name,), timeout_s=timeout, pause=True,
                       per_host=args.per_host, nofile=args.nofile, options=args.options,
                       settle_s=args.settle)
        row["processes"] = len(job.processes)
        try:
            job.start()
            etcd0 = job.etcd.cpu_seconds() if job.etcd else None
            job.go()
            job.created()
            etcd1 = job.etcd.cpu_seconds() if job.etcd else None
            job.proceed()
            results = job.results()
            etcd2 = job.etcd.cpu_seconds() if job.etcd else None
            row["create_s"] = max(r["create_end"] for r in results.values()) - job.go_time
            row["a2a_s"] = max(r[round_name]["seconds"] for r in results.values())
            after = "after_all_to_all" if round_name == "all" else "after_ring"
            phases = [("after_create", "create"), (after, "a2a")]
            if args.settle:
                phases.append(("settled", "settled"))
            for phase, prefix in phases:
                for key, value in usage_means(results, phase).items():
                    row[f"{prefix}_{key}"] = value
            if job.etcd:
                row["etcd_cpu_s"] = etcd1 - etcd0
                row["a2a_etcd_s"] = etcd2 - etcd1
            failed = failure_classes(results, round_name, args.sizes)
            if args.nofile:
                held = {r.get("nofile_soft") for r in results.values() if "nofile_soft" in r}
                if held != {args.nofile}:
                    failed[f"soft fd limit not held: {sorted(held)}"] = 1
            codes = job.finish()
            if any(code != 0 for code in codes.values()):
                failed[f"workers exited {sorted(set(codes.values()), key=str)}"] = 1
            if failed:
                row["failed"] = failed
        except AssertionError as e:
            # A worker gave no line in time: its log is in the message.
            row["failed"] = {str(e)[:2000]: 1}
        finally:
            job.close()
    return row


def table(rows: list[dict]) -> str:
    cols = [c for c in COLUMNS if all(c[0] in r for r in rows)]
    head = ["N", "P"] + [h for _, h, _ in cols]
    lines = [[str(r["n"]), str(r["processes"])] + [fmt.format(r[k]) for k, _, fmt in cols]
             for r in rows]
    if len(rows) >= 2:
        ns = [r["n"] for r in rows]
        fits = [fit(ns, [r[k] for r in rows]) for k, _, _ in cols]
        lines.append(["a", ""] + [fmt.format(a) for (a, _), (_, _, fmt) in zip(fits, cols)])
        lines.append(["b", ""] + [f"{b:.3g}" for _, b in fits])
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    out = ["  ".join(x.rjust(w) for x, w in zip(head, widths))]
    out += ["  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max", type=int, default=64, help="the largest N (of 2, 4, ... 64)")
    parser.add_argument("--counts", help="the Ns, comma-separated (instead of --max)")
    parser.add_argument("--store", choices=["etcd", "callbacks"], default="etcd")
    parser.add_argument("--tcp", action="store_true", help="hide UCX: the TCP fallback")
    parser.add_argument("--sizes", default="65536",
                        help="bytes of the buffers each pair exchanges, comma-separated")
    parser.add_argument("--timeout", type=float, help="seconds: every deadline of the job "
                        "(default max(60, 3 N))")
    parser.add_argument("--per-host", type=int, default=1, metavar="K",
                        help="processes on each host (N hosts, N*K processes)")
    parser.add_argument("--nofile", type=int, metavar="LIMIT",
                        help="each process's soft open-file limit, the plugin's raise of it off")
    parser.add_argument("--round", choices=["all", "ring"], default="all",
                        help="the round after creation: all-to-all or a ring")
    parser.add_argument("--option", action="append", default=[], metavar="K=V",
                        help="a create option for every process (repeat)")
    parser.add_argument("--settle", type=float, default=3.0, metavar="S",
                        help="after the round, S seconds with nothing sent, then what "
                        "stays open is measured (s: columns; 0: not measured)")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    args.options = {}
    for item in args.option:
        key, _, value = item.partition("=")
        args.options[key] = int(value) if value.lstrip("-").isdigit() else value
    if args.store == "etcd":
        args.options.setdefault("etcd_lease_ttl_s", ETCD_LEASE_TTL_S)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    counts = [int(c) for c in args.counts.split(",")] if args.counts else [c for c in COUNTS if c <= args.max]
    if not counts:
        raise SystemExit("no N to measure")
    if not os.environ.get(UCX_WHEEL_ENV) and not args.tcp:
        # As scripts/test.sh: the libucx wheel's UCX (Debian's 1.13 is refused).
        try:
            import libucx

            os.environ[UCX_WHEEL_ENV] = os.path.join(os.path.dirname(libucx.__file__), "lib")
        except ImportError:
            print("WARNING: no libucx wheel (scripts/setup.sh installs it): no UCX", flush=True)
    reason = n_hosts.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"bench/scale.py: no N-host bed can be made here: {reason}")
    transport = "TCP fallback (UCX hidden)" if args.tcp else "UCX"
    what = "all-to-all" if args.round == "all" else "ring"
    limit = f", soft fd limit {args.nofile} (not raised)" if args.nofile else ""
    if args.options:
        limit += ", " + ", ".join(f"{k}={v}" for k, v in sorted(args.options.items()))
    print(f"scale: N = {counts} hosts x {args.per_host} processes, store {args.store}, {transport}, "
          f"{what} of {args.sizes} bytes per pair{limit}", flush=True)
    rows, failed = [], None
    with tempfile.TemporaryDirectory(prefix="xh-scale-") as logs:
        logs = os.environ.get("XH_SCALE_LOGS") or logs
        for n in counts:
            row = measure(n, args, Path(logs))
            if args.json:
                Path(args.json).write_text(json.dumps([*rows, row], indent=1))
            if "failed" in row:
                failed = row
                break
            rows.append(row)
            print(f"N={n} ({row['processes']} processes): created in {row['create_s']:.2f} s, "
                  f"{what} {row['a2a_s']:.2f} s", flush=True)
    print()
    print(f"per process, mean over the N: c: after creation, a: after the {what} round; fds, "
          "threads, RSS MiB, established TCP connections to other hosts (tcp) and to the store host (+st)")
    print(table(rows))
    print("a, b: least squares a + b*(N-1)")
    if failed is not None:
        times = "".join(f", {k} {failed[k]:.2f} s" for k in ("create_s", "a2a_s", "etcd_cpu_s") if k in failed)
        print(f"\nN={failed['n']} FAILED (larger N not run){times}:")
        for what, count in sorted(failed["failed"].items(), key=lambda kv: -kv[1]):
            print(f"  {count:5d} x {what}")
        sys.exit(1)


if __name__ == "__main__":
    main()
