"""Does memory come back after load? A soak of all-to-all transfers.

    python bench/soak.py [--processes 6] [--seconds 180] [--baseline-seconds S]
                         [--sample 3] [--warmup 10] [--every 30]
                         [--min-bytes 4096] [--max-bytes 16777216] [--sizes log|uniform]
                         [--options k=v,...] [--hosts | --n-hosts] [--lib PATH]
                         [--json PATH]

``--processes`` processes (one job, the plugin over ctypes, the PJRT KV
callbacks on a small KV server) move buffers all to all for ``--seconds``:
in each round every process receives one buffer from every other (one v2
receive call) and sends one to every other (one v2 send call), sizes
log-uniform (or ``--sizes uniform``) between ``--min-bytes`` and
``--max-bytes``, the same on both sides of each transfer, the receiver reads
every buffer back and checks its bytes, then every buffer and event of the
round is destroyed. Between rounds, every ``--sample`` seconds, each
process calls glibc's ``malloc_trim(0)`` and reads its anonymous RSS
(``RssAnon`` of /proc/self/status) and glibc's own count of the bytes its
heap holds live (``mallinfo2``: in-use chunks plus mmapped chunks). Live
heap that grows is a leak; RssAnon that grows over a flat live heap is
memory the allocator (or something beside it) keeps without using it.

The table gives each process's RssAnon at the end of the warm-up (the
first sample after ``--warmup`` seconds), then its drift from that figure
every ``--every`` seconds and at the end, the median over processes, the
median drift per transfer, and the same figures of the same harness
without the plugin (``--baseline-seconds``, default ``--seconds``; 0 skips
it): the same processes, rounds and sizes, the same Python-side
allocations and a copy of each buffer where the plugin holds one, no
transfer between processes. The verdict line says
whether every process stayed within 64 MiB of its warm-up figure; the
footer gives the transfers, the CPU time per GB moved, and the bytes each
transport carried.

``--hosts`` places the processes alternately on the two hosts of a
two-host bed (python_tests/two_hosts.py, root), the KV server on host a;
``--n-hosts`` puts each on a host of its own (python_tests/n_hosts.py, the
KV server on the store host), so that every peer is remote. Between hosts
the bytes go over UCX where the libucx wheel is installed (found as
scripts/test.sh finds it), else over the TCP transport. Workers report JSON
lines on stdout; the parent only reads them.

Profiling: ``SOAK_WRAP`` prefixes the command of the plugin workers named by
``SOAK_WRAP_NODES`` (default 0), e.g. ``SOAK_WRAP="heaptrack -o
/tmp/ht/p{node}" SOAK_WRAP_NODES=1``; ``SOAK_SMAPS_DIR`` makes every worker
write, at each sample, its mappings that hold anonymous pages there.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "python_tests"
BOUND_MIB = 64  # the drift the issue allows (issue #36)
MIB = 1 << 20
WAIT_S = 120.0  # bound of any single wait inside a worker

# --------------------------------------------------------------------------
# Measuring one process
# --------------------------------------------------------------------------


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


_LIBC = ctypes.CDLL(None)
_LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
_LIBC.malloc_trim.restype = ctypes.c_int
_MALLINFO2 = getattr(_LIBC, "mallinfo2", None)
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _Mallinfo2


def status_kib(*fields: str) -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in fields:
                out[name] = int(rest.split()[0])
    return out


def sample(t: float, transfers: int, moved: int) -> dict:
    """malloc_trim(0), then this process's memory figures (KiB)."""
    _LIBC.malloc_trim(0)
    s = status_kib("RssAnon", "RssShmem", "VmRSS")
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {"t": round(t, 2), "transfers": transfers, "bytes": moved,
           "cpu_s": round(ru.ru_utime + ru.ru_stime, 3),
           "rss_anon": s.get("RssAnon"), "rss_shmem": s.get("RssShmem")}
    if _MALLINFO2 is not None:
        mi = _MALLINFO2()
        # Live heap: chunks in use in the arenas + chunks mmapped on their own.
        out["heap_live"] = (mi.uordblks + mi.hblkhd) // 1024
        out["heap_free"] = mi.fordblks // 1024  # held free by the arenas
        out["arena_kib"] = mi.arena // 1024
    return out


def dump_smaps(path: str) -> None:
    """Every mapping that holds anonymous pages (start, end, perms, name,
    Anonymous KiB) into ``path``: where RssAnon lives (SOAK_SMAPS_DIR)."""
    rows, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = head[0].split("-")
                cur = [int(lo, 16), int(hi, 16), head[1], head[5] if len(head) > 5 else ""]
            elif head[0] == "Anonymous:" and int(head[1]) > 0:
                rows.append(cur + [int(head[1])])
    with open(path, "w") as f:
        json.dump(rows, f)


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------
# The schedule both sides of every transfer agree on
# --------------------------------------------------------------------------


def size_of(seed: int, rnd: int, src: int, dst: int, lo: int, hi: int, dist: str = "log") -> int:
    """The byte size of round ``rnd``'s buffer from ``src`` to ``dst``:
    log-uniform (``dist`` "log") or uniform in [lo, hi], the same in both
    processes."""
    import random

    r = random.Random(f"{seed}/{rnd}/{src}/{dst}").random()
    if dist == "uniform":
        return lo + int(r * (hi - lo))
    return int(round(math.exp(math.log(lo) + r * (math.log(hi) - math.log(lo)))))


def offset_of(seed: int, rnd: int, src: int, dst: int, size: int, pool: int) -> int:
    import random

    return random.Random(f"o{seed}/{rnd}/{src}/{dst}").randrange(0, pool - size + 1)


# --------------------------------------------------------------------------
# Workers
# --------------------------------------------------------------------------


def serve_kv(host: str, port: int) -> int:
    sys.path.insert(0, str(TESTS))
    from kv_server import KvServer

    server = KvServer(host=host, port=port)
    emit({"kv": list(server.address)})
    while True:  # the parent kills us
        time.sleep(3600)


def run_plugin(cfg: dict) -> None:
    sys.path.insert(0, str(TESTS))
    import numpy as np

    import pjrt_ctypes as pc
    import transfer_helpers as th
    from peer_process import worker_setup

    node, nodes, seed = cfg["node"], cfg["nodes"], cfg["seed"]
    lo, hi, dist = cfg["min_bytes"], cfg["max_bytes"], cfg["sizes"]
    kv, ch, api, xh, callbacks = worker_setup(cfg)
    options = {"num_devices": 1, "node_id": node, "num_nodes": nodes,
               "session": cfg["session"], "session_timeout_ms": 120000}
    options.update(cfg.get("options") or {})
    client = callbacks.create_client(api, options)
    device = client.addressable_devices()[0]
    ids = {p: th.device_ids(client, p)[0] for p in range(nodes)}
    peers = [p for p in range(nodes) if p != node]
    # What this process sends: slices of one random block (made once).
    block = np.random.default_rng(seed + node).integers(0, 256, size=hi, dtype=np.uint8)
    blocks = {}

    def block_of(p):
        if p not in blocks:
            blocks[p] = np.random.default_rng(seed + p).integers(0, 256, size=hi, dtype=np.uint8)
        return blocks[p]

    ch.put(f"ready/{node}", b"1")
    for p in peers:
        ch.get(f"ready/{p}", WAIT_S)
    start = time.monotonic()
    transfers = moved = 0
    last_sample = -math.inf
    rnd = 0
    stop = None
    while True:
        # Node 0 ends the run: it names the first round nobody starts, the
        # one after its own. Others may have started this round already, but
        # none can finish it before node 0's transfers of it, which come
        # after the stop is in the store: everyone sees it at the next start.
        if node == 0 and stop is None and time.monotonic() - start >= cfg["seconds"]:
            ch.put("stop", str(rnd + 1).encode())
        stop = kv.try_get(ch.prefix + "stop")
        if stop is not None and rnd >= int(stop):
            break
        recv_specs = [th.spec(pc.BufferType.U8, size_of(seed, rnd, p, node, lo, hi, dist)) for p in peers]
        received = xh.receive(client, device, recv_specs, [ids[p] for p in peers], [rnd] * len(peers))
        sources = []
        for p in peers:
            n = size_of(seed, rnd, node, p, lo, hi, dist)
            off = offset_of(seed, rnd, node, p, n, hi)
            s = th.spec(pc.BufferType.U8, n)
            sources.append(client.buffer_from_host(block[off:off + n], type=s.type, device=device))
        events = xh.send(client, sources, [ids[p] for p in peers], [rnd] * len(peers))
        for i, ev in enumerate(events):
            status = th.wait_event(ev, WAIT_S)
            if status is not None:
                raise RuntimeError(f"round {rnd}: send to {peers[i]} failed: {status}")
        for p, buf, s in zip(peers, received, recv_specs):
            status = th.buffer_status(buf, WAIT_S)
            if status is not None:
                raise RuntimeError(f"round {rnd}: receive from {p} failed: {status}")
            got = np.frombuffer(buf.to_host_bytes(s.nbytes), dtype=np.uint8)
            off = offset_of(seed, rnd, p, node, s.nbytes, hi)
            if not np.array_equal(got, block_of(p)[off:off + s.nbytes]):
                raise RuntimeError(f"round {rnd}: bytes from {p} differ")
            moved += s.nbytes
            transfers += 1
        for obj in client._owned:  # every buffer and event of the round
            obj.destroy()
        client._owned.clear()
        del received, sources, events, got
        rnd += 1
        now = time.monotonic() - start
        if now - last_sample >= cfg["sample"]:
            last_sample = now
            emit(dict(sample(now, transfers, moved), node=node, round=rnd))
            if os.environ.get("SOAK_SMAPS_DIR"):
                dump_smaps(os.path.join(os.environ["SOAK_SMAPS_DIR"], f"p{node}-{now:07.1f}.json"))
    emit(dict(sample(time.monotonic() - start, transfers, moved), node=node, round=rnd,
              last=True, metrics=th.metrics(client)))
    # Nobody leaves before every peer is done with its memory and links.
    ch.put(f"done/{node}", b"1")
    for p in peers:
        ch.get(f"done/{p}", WAIT_S)
    client.destroy()


def run_baseline(cfg: dict) -> None:
    """The same rounds without the plugin, allocating what the plugin run
    allocates on the Python side and what the plugin holds per buffer: every
    process's random block, a copy of each buffer to send (what
    buffer_from_host's copy holds), each buffer received as a copy of its
    sender's bytes, read back into a ctypes buffer and a bytes object, and
    checked. Nothing crosses between processes."""
    import numpy as np

    node, nodes, seed = cfg["node"], cfg["nodes"], cfg["seed"]
    lo, hi, dist = cfg["min_bytes"], cfg["max_bytes"], cfg["sizes"]
    peers = [p for p in range(nodes) if p != node]
    blocks = {p: np.random.default_rng(seed + p).integers(0, 256, size=hi, dtype=np.uint8)
              for p in range(nodes)}
    start = time.monotonic()
    transfers = moved = 0
    last_sample = -math.inf
    rnd = 0
    while time.monotonic() - start < cfg["seconds"]:
        sources = []
        for p in peers:
            n = size_of(seed, rnd, node, p, lo, hi, dist)
            off = offset_of(seed, rnd, node, p, n, hi)
            sources.append(blocks[node][off:off + n].copy())
        for p in peers:
            n = size_of(seed, rnd, p, node, lo, hi, dist)
            off = offset_of(seed, rnd, p, node, n, hi)
            landed = blocks[p][off:off + n].copy()
            raw = ctypes.create_string_buffer(max(1, n))
            ctypes.memmove(raw, landed.ctypes.data, n)
            got = np.frombuffer(raw.raw[:n], dtype=np.uint8)
            if not np.array_equal(got, blocks[p][off:off + n]):
                raise RuntimeError(f"round {rnd}: bytes from {p} differ")
            del landed, raw, got
            moved += n
            transfers += 1
        del sources
        rnd += 1
        now = time.monotonic() - start
        if now - last_sample >= cfg["sample"]:
            last_sample = now
            emit(dict(sample(now, transfers, moved), node=node, round=rnd))
    emit(dict(sample(time.monotonic() - start, transfers, moved), node=node, round=rnd, last=True))


def worker(cfg: dict) -> int:
    try:
        (run_plugin if cfg["mode"] == "plugin" else run_baseline)(cfg)
        code = 0
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        emit({"node": cfg["node"], "error": f"{type(e).__name__}: {e}",
              "traceback": traceback.format_exc()})
        code = 1
    sys.stdout.flush()
    # No interpreter teardown while plugin threads may still call into Python.
    os._exit(code)


# --------------------------------------------------------------------------
# The parent
# --------------------------------------------------------------------------


class Job:
    """The worker processes of one run and the lines they report."""

    def __init__(self, procs: list, kill):
        self.procs = procs
        self.kill = kill
        self.lines: list[list[dict]] = [[] for _ in procs]
        self.threads = [threading.Thread(target=self._read, args=(i,), daemon=True)
                        for i in range(len(procs))]
        for t in self.threads:
            t.start()

    def _read(self, i: int) -> None:
        for raw in self.procs[i].stdout:
            try:
                self.lines[i].append(json.loads(raw))
            except ValueError:
                sys.stderr.write(f"[p{i}] {raw.decode(errors='replace') if isinstance(raw, bytes) else raw}")

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        try:
            for p in self.procs:
                p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SystemExit(f"workers still running after {timeout:.0f}s") from None
        finally:
            for p in self.procs:
                self.kill(p)
            for t in self.threads:
                t.join(5)
        errors = [(i, ln) for i, lines in enumerate(self.lines) for ln in lines if "error" in ln]
        if errors:
            i, ln = errors[0]
            raise SystemExit(f"worker {i} failed: {ln['error']}\n{ln.get('traceback', '')}")


def run_job(args, mode: str, seconds: float, launch, kv_address) -> list[list[dict]]:
    session = "soak" + uuid.uuid4().hex[:10]
    procs = []
    for node in range(args.processes):
        cfg = {"mode": mode, "node": node, "nodes": args.processes, "session": session,
               "seconds": seconds, "sample": args.sample, "seed": args.seed,
               "min_bytes": args.min_bytes, "max_bytes": args.max_bytes, "sizes": args.sizes,
               "lib": args.lib, "kv": kv_address, "options": parse_options(args.options)}
        argv = [args.python, str(Path(__file__).resolve()), "--worker", json.dumps(cfg)]
        wrap = os.environ.get("SOAK_WRAP")  # e.g. "heaptrack -o /tmp/ht/p{node}"
        if wrap and mode == "plugin" and str(node) in os.environ.get("SOAK_WRAP_NODES", "0").split(","):
            argv = shlex.split(wrap.format(node=node)) + argv
        procs.append(launch(node, argv))
    job = Job(procs, kill_proc)
    job.wait(seconds + 300)
    return [[ln for ln in lines if "t" in ln] for lines in job.lines]


def kill_proc(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        pass


def parse_options(text: str) -> dict:
    out = {}
    for item in filter(None, (text or "").split(",")):
        k, _, v = item.partition("=")
        out[k] = int(v) if v.lstrip("-").isdigit() else v
    return out


def at(samples: list[dict], t: float) -> dict:
    """The first sample at or after ``t`` (the last one if none)."""
    for s in samples:
        if s["t"] >= t:
            return s
    return samples[-1]


def summarize(runs: list[list[dict]], warmup: float, every: float) -> dict:
    warm = [at(s, warmup) for s in runs]
    end = max(s[-1]["t"] for s in runs)
    marks = [("warm-up", warmup)]
    t = every * math.ceil((warmup + 1e-9) / every)
    while t < end - every / 3:
        marks.append((f"{t:.0f} s", t))
        t += every
    rows = []
    for label, t in marks:
        now = [at(s, t) for s in runs]
        rows.append((label, now))
    rows.append(("last", [s[-1] for s in runs]))
    return {"warm": warm, "rows": rows}


def mib(kib) -> float:
    return kib / 1024


def table(title: str, runs: list[list[dict]], warmup: float, every: float) -> dict:
    sm = summarize(runs, warmup, every)
    warm = sm["warm"]
    n = len(runs)
    head = ("| t | " + " | ".join(f"p{i}" for i in range(n))
            + " | median | heap live (median) |")
    print(f"\n{title}: RssAnon after malloc_trim(0), MiB (warm-up absolute, then drift from it)\n")
    print(head)
    print("|" + "---|" * (n + 3))
    result = {"rows": []}
    for label, now in sm["rows"]:
        if label == "warm-up":
            vals = [mib(s["rss_anon"]) for s in now]
            cells = [f"{v:.1f}" for v in vals]
            med = statistics.median(vals)
            live = statistics.median(mib(s.get("heap_live", 0)) for s in now)
            print(f"| warm-up ({now[0]['t']:.0f} s) | " + " | ".join(cells)
                  + f" | {med:.1f} | {live:.1f} |")
        else:
            vals = [mib(s["rss_anon"] - w["rss_anon"]) for s, w in zip(now, warm)]
            cells = [f"{v:+.1f}" for v in vals]
            med = statistics.median(vals)
            live = statistics.median(mib(s.get("heap_live", 0) - w.get("heap_live", 0))
                                     for s, w in zip(now, warm))
            t_label = f"last ({max(s['t'] for s in now):.0f} s)" if label == "last" else label
            print(f"| {t_label} | " + " | ".join(cells) + f" | {med:+.1f} | {live:+.1f} |")
        result["rows"].append({"t": label, "values": vals, "median": med})
    last = sm["rows"][-1][1]
    drift = [mib(s["rss_anon"] - w["rss_anon"]) for s, w in zip(last, warm)]
    per_transfer = [
        (s["rss_anon"] - w["rss_anon"]) * 1024 / max(1, s["transfers"] - w["transfers"])
        for s, w in zip(last, warm)
    ]
    routes: dict = {}
    for s in last:
        for name, t in (s.get("metrics") or {}).get("transports", {}).items():
            routes[name] = routes.get(name, 0) + t.get("bytes_received", 0)
    transfers = sum(s["transfers"] for s in last)
    moved = sum(s["bytes"] for s in last)
    print(f"\ndrift per transfer after warm-up (B): "
          + ", ".join(f"{v:.0f}" for v in per_transfer)
          + f"; median {statistics.median(per_transfer):.0f}")
    cpu = sum(s.get("cpu_s", 0) - w.get("cpu_s", 0) for s, w in zip(last, warm))
    moved_after = sum(s["bytes"] - w["bytes"] for s, w in zip(last, warm))
    print(f"transfers received: {transfers} ({moved / 1e9:.1f} GB) in {last[0]['t']:.0f} s, "
          f"{cpu / max(1e-9, moved_after / 1e9):.2f} CPU s per GB after warm-up; "
          f"RssShmem at the end (median): {statistics.median(mib(s.get('rss_shmem') or 0) for s in last):.1f} MiB")
    if routes:
        print("bytes received by transport: "
              + ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in sorted(routes.items()) if v))
    result.update(drift=drift, max_drift=max(drift), median_drift=statistics.median(drift),
                  per_transfer=per_transfer, transfers=transfers, bytes=moved,
                  warm=[mib(s["rss_anon"]) for s in warm])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--baseline-seconds", type=float, default=None,
                    help="the run without the plugin (default --seconds, 0 skips it)")
    ap.add_argument("--sample", type=float, default=3, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=10)
    ap.add_argument("--every", type=float, default=30, help="seconds between table rows")
    ap.add_argument("--min-bytes", type=int, default=4096)
    ap.add_argument("--max-bytes", type=int, default=16 * MIB)
    ap.add_argument("--sizes", choices=["log", "uniform"], default="log",
                    help="how sizes spread between the bounds (default log-uniform)")
    ap.add_argument("--seed", type=int, default=36)
    ap.add_argument("--options", default="", help="extra create options, k=v,k=v")
    ap.add_argument("--hosts", action="store_true", help="on the two-host bed (root)")
    ap.add_argument("--n-hosts", action="store_true",
                    help="one process per host of an N-host bed (root): every peer remote")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--lib", default=os.environ.get(
        "PJRT_CROSSHOST_LIB", str(REPO / "target/release/libpjrt_crosshost.so")))
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--kv-server", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        sys.exit(worker(json.loads(args.worker)))
    if args.kv_server:
        sys.exit(serve_kv(args.kv_server[0], int(args.kv_server[1])))
    if args.processes < 2:
        ap.error("--processes must be at least 2")
    baseline_s = args.seconds if args.baseline_seconds is None else args.baseline_seconds
    if not os.environ.get("PJRT_CROSSHOST_UCX_WHEEL_LIB"):
        # UCX from the libucx wheel, as scripts/test.sh finds it: between
        # hosts the bytes then go over UCX (else over the TCP transport).
        try:
            import libucx

            os.environ["PJRT_CROSSHOST_UCX_WHEEL_LIB"] = os.path.join(
                os.path.dirname(libucx.__file__), "lib")
        except ImportError:
            pass
    me = [args.python, str(Path(__file__).resolve())]

    bed = None
    if args.hosts or args.n_hosts:
        sys.path.insert(0, str(TESTS))
        import two_hosts

        if args.n_hosts:
            import n_hosts

            bed = n_hosts.NHostBed(args.processes, store=True).up()
        else:
            bed = two_hosts.TwoHostBed().up()
    try:
        if bed is None:
            kv_proc = subprocess.Popen(me + ["--kv-server", "127.0.0.1", "0"],
                                       stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
            kv_address = json.loads(kv_proc.stdout.readline())["kv"]

            def launch(node, argv):
                return subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        else:
            import two_hosts

            port = bed.port()
            kv_host = "store" if args.n_hosts else "a"
            kv_proc = bed.popen(kv_host, me + ["--kv-server", "0.0.0.0", str(port)],
                                stdout=subprocess.PIPE)
            json.loads(two_hosts.read_line(kv_proc, 60))
            kv_address = [bed.address(kv_host), port]

            def launch(node, argv):
                host = node if args.n_hosts else "ab"[node % 2]
                return bed.popen(host, argv, stdout=subprocess.PIPE)
        try:
            where = ("one host" if bed is None else f"{args.processes} hosts, one each"
                     if args.n_hosts else "two hosts (a, b alternately)")
            print(f"soak: {args.processes} processes on {where}, all to all, "
                  f"{args.min_bytes}-{args.max_bytes} B {'log-uniform' if args.sizes == 'log' else 'uniform'}, {args.seconds:.0f} s; "
                  f"library {args.lib}", flush=True)
            plugin = run_job(args, "plugin", args.seconds, launch, kv_address)
        finally:
            kill_proc(kv_proc)
        results = {"plugin": table("with the plugin", plugin, args.warmup, args.every)}
        if baseline_s > 0:
            base = run_job(args, "baseline", baseline_s, launch, kv_address)
            results["baseline"] = table("the same harness without the plugin", base,
                                        args.warmup, args.every)
    finally:
        if bed is not None:
            bed.close()
    ok = results["plugin"]["max_drift"] <= BOUND_MIB
    line = (f"\nverdict: largest drift {results['plugin']['max_drift']:+.1f} MiB, median "
            f"{results['plugin']['median_drift']:+.1f} MiB: "
            + (f"within {BOUND_MIB} MiB" if ok else f"NOT within {BOUND_MIB} MiB"))
    if "baseline" in results:
        line += f" (without the plugin: median {results['baseline']['median_drift']:+.1f} MiB)"
    print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results,
                                               "samples": plugin}, indent=1))


if __name__ == "__main__":
    main()
