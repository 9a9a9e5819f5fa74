"""Where the time of one small cross-process jax.device_put goes, inside JAX.

    python bench/profile_transfer.py [--bytes 4096] [--batch 1] [--reps 200] [--hosts]
                                     [--python PY] [--save PATH]

Two processes (on one host, or with --hosts on the two hosts of the
two-host bed, python_tests/two_hosts.py) put process 0's array onto process
1's device --reps times. Both record the plugin's timeline marks
(PJRT_CROSSHOST_TIMELINE=1, src/sync/timeline.rs: CLOCK_MONOTONIC
nanoseconds into a preallocated ring, no formatting) and their own
barrier-exit and return times on the same clock. Per step of a transfer the
table gives the median time from the receiver's barrier exit, which process
it ran in, the median gap to the step before it, and each transfer's time
from the later of its two entry calls (the breakdown of the plugin's own
part, median over transfers; the difference of two medians is not the
median of a transfer's gap, and which call comes later changes from one
transfer to the next); then the receiver's
whole barrier-to-block_until_ready time with marks on, and, in the same run,
without them (a second job), to show that recording does not move it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

# The steps, in the order a transfer meets them, and who marks them.
STEPS = [
    ("receive_call", "receiver"),
    ("destination_ready", "receiver"),
    ("wait_registered", "receiver"),
    ("descriptor_published", "receiver"),
    ("aliases_made", "receiver"),
    ("receive_return", "receiver"),
    ("send_call", "sender"),
    ("descriptor_arrived", "sender"),
    ("bytes_start", "sender"),
    ("ucx_send_start", "sender"),
    ("bytes_landed", "receiver"),
    ("receipt_set", "either"),
    ("asyncget_fired", "receiver"),
    ("on_runner", "receiver"),
    ("published", "receiver"),
    ("view_made", "receiver"),
    ("recorded", "receiver"),
    ("bytes_acked", "sender"),
    ("keys_retired", "receiver"),
]
KEYLESS = {"receive_call", "aliases_made", "receive_return", "send_call", "view_made"}
# Marks of every PJRT call into the plugin (key: the function's name), not
# steps of a transfer.
API_POINTS = {"api_enter", "api_exit"}


def worker(pid: int, coordinator: str, nbytes: int, reps: int, out: str, batch: int = 1) -> None:
    import numpy as np

    import jax
    from jax.sharding import SingleDeviceSharding

    jax.distributed.initialize(coordinator, num_processes=2, process_id=pid)
    from jax._src import distributed

    import jax_plugins.crosshost as crosshost

    client = distributed.global_state.client
    src = [d for d in jax.devices() if d.process_index == 0][0]
    dst = [d for d in jax.devices() if d.process_index == 1][0]
    data = [np.arange(nbytes // 4, dtype=np.float32) + i for i in range(batch)]
    times = []
    for rep in range(reps + 5):
        if pid == 0:
            x = [jax.device_put(d, src) for d in data]
            jax.block_until_ready(x)
        else:
            x = [jax.make_array_from_single_device_arrays(
                d.shape, SingleDeviceSharding(src), [], dtype=d.dtype) for d in data]
        client.wait_at_barrier(f"p{rep}", 60_000)
        start = time.monotonic_ns()
        # A list is one CopyArrays: the plugin gets the batch in one call.
        y = jax.device_put(x, SingleDeviceSharding(dst))
        if pid == 1:
            jax.block_until_ready(y)
        end = time.monotonic_ns()
        if rep >= 5:  # warm-up transfers are not counted
            times.append((start, end))
        elif rep == 4:
            crosshost.timeline()  # drop the warm-up's marks
        client.wait_at_barrier(f"q{rep}", 60_000)
    marks = crosshost.timeline()
    with open(out, "w") as f:
        json.dump({"times": times, "marks": marks}, f)
    client.wait_at_barrier("profile_done", 60_000)


def run_job(args, env_extra: dict, bed=None) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"p{p}.json") for p in (0, 1)]
        env = dict(os.environ, JAX_PLATFORMS="crosshost", PYTHONPATH=str(REPO / "python"),
                   **env_extra)
        env.setdefault("PJRT_CROSSHOST_JAX_LIBRARY",
                       os.environ.get("PJRT_CROSSHOST_LIB",
                                      str(REPO / "target/release/libpjrt_crosshost.so")))
        if bed is None:
            import socket

            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            coordinator = f"127.0.0.1:{port}"
            procs = [subprocess.Popen([args.python, __file__, "--worker", str(p), coordinator,
                                       str(args.bytes), str(args.reps), outs[p], str(args.batch)],
                                      env=env)
                     for p in (0, 1)]
        else:
            coordinator = f"{bed.hostname('a')}:{bed.port()}"
            procs = [bed.popen(host, [args.python, __file__, "--worker", str(p), coordinator,
                                      str(args.bytes), str(args.reps), outs[p], str(args.batch)],
                                 env=env)
                     for p, host in enumerate(("a", "b"))]
        for proc in procs:
            if proc.wait(timeout=600) != 0:
                raise SystemExit(f"a profiling worker failed (exit {proc.returncode})")
        return [json.load(open(o)) for o in outs]


def analyse(sender: dict, receiver: dict) -> tuple[list, list]:
    """Per step: (name, who, median µs from the receiver's barrier exit)."""
    rows: dict[str, list] = {name: [] for name, _ in STEPS}
    marks = [("sender", m) for m in sender["marks"]] + [("receiver", m) for m in receiver["marks"]]
    by_key: dict[str, list] = {}
    keyless: dict[tuple, list] = {}
    for who, (ns, point, key, _thread) in marks:
        if point in API_POINTS:
            continue
        if point in KEYLESS:
            keyless.setdefault((who, point), []).append(ns)
        else:
            by_key.setdefault(key, []).append((ns, who, point))
    starts = [s for s, _ in receiver["times"]]
    # Both processes leave each barrier within tens of µs; a transfer's
    # marks belong to the last receiver barrier exit before them (give or
    # take SLACK, the sender's lead).
    slack = 200_000
    for i, start in enumerate(starts):
        end = starts[i + 1] - slack if i + 1 < len(starts) else float("inf")
        for (who, point), stamps in keyless.items():
            inside = [ns for ns in stamps if start - slack <= ns < end]
            if inside:
                rows[point].append((inside[0] - start) / 1e3)
    for key, stamps in by_key.items():
        first = min(ns for ns, _, _ in stamps)
        owners = [s for s in starts if s - slack <= first]
        if not owners:
            continue
        start = owners[-1]
        for ns, who, point in stamps:
            rows[point].append((ns - start) / 1e3)
    table = []
    for name, who in STEPS:
        if rows[name]:
            table.append((name, who, statistics.median(rows[name]), len(rows[name])))
    totals = [(e - s) / 1e3 for s, e in receiver["times"]]
    return table, totals


def mark_times(marks, point) -> list:
    """The sorted times of every `point` mark."""
    return sorted(ns for ns, p, _key, _thread in marks if p == point)


def plugin_part(sender: dict, receiver: dict) -> list:
    """Per transfer, µs from the later of the two entry calls (the
    receiver's receive call, the sender's send call) to the caller's buffer
    fulfilled (`recorded`): the plugin's own part of a transfer."""
    import bisect

    receive_calls = mark_times(receiver["marks"], "receive_call")
    send_calls = mark_times(sender["marks"], "send_call")
    parts = []
    for recorded in mark_times(receiver["marks"], "recorded"):
        i = bisect.bisect_right(receive_calls, recorded) - 1
        j = bisect.bisect_right(send_calls, recorded) - 1
        if i >= 0 and j >= 0:
            parts.append(((i, j), (recorded - max(receive_calls[i], send_calls[j])) / 1e3))
    return parts


def from_later_call(sender: dict, receiver: dict) -> dict:
    """Per step, each transfer's µs from the later of its two entry calls
    (as in plugin_part): the breakdown of the plugin's own part. A keyed
    step belongs to the transfer its `recorded` mark closes; a keyless one
    (the receiver's alias and return marks) to the receive call before it."""
    import bisect

    receive_calls = mark_times(receiver["marks"], "receive_call")
    send_calls = mark_times(sender["marks"], "send_call")
    by_key: dict = {}
    for who, marks in (("sender", sender["marks"]), ("receiver", receiver["marks"])):
        for ns, point, key, _thread in marks:
            if point not in KEYLESS and point not in API_POINTS:
                by_key.setdefault(key, []).append((ns, point))
    keyless = {p: mark_times(receiver["marks"], p) for p in ("aliases_made", "receive_return", "view_made")}
    rows: dict = {}
    for stamped in by_key.values():
        recorded = [ns for ns, point in stamped if point == "recorded"]
        if not recorded:
            continue
        i = bisect.bisect_right(receive_calls, recorded[0]) - 1
        j = bisect.bisect_right(send_calls, recorded[0]) - 1
        if i < 0 or j < 0:
            continue
        later = max(receive_calls[i], send_calls[j])
        rows.setdefault("receive_call", []).append((receive_calls[i] - later) / 1e3)
        rows.setdefault("send_call", []).append((send_calls[j] - later) / 1e3)
        for point, ordered in keyless.items():
            k = bisect.bisect_right(ordered, receive_calls[i])
            if k < len(ordered):
                rows.setdefault(point, []).append((ordered[k] - later) / 1e3)
        for ns, point in stamped:
            rows.setdefault(point, []).append((ns - later) / 1e3)
    return {point: statistics.median(values) for point, values in rows.items()}


def api_spans(marks) -> list:
    """(entry ns, return ns, function) of each outermost PJRT call into the
    plugin, paired per thread (a call made from inside another is part of
    it)."""
    stacks: dict = {}
    spans = []
    for ns, point, name, thread in marks:
        if point == "api_enter":
            stacks.setdefault(thread, []).append((ns, name))
        elif point == "api_exit":
            stack = stacks.get(thread)
            if stack and stack[-1][1] == name:
                start, _ = stack.pop()
                if not stack:
                    spans.append((start, ns, name))
    return spans


def api_windows(sender: dict, receiver: dict) -> list:
    """The PJRT calls the framework makes into the plugin around each
    transfer's entry calls, per window: (window, median µs of the window,
    median calls in it, median µs inside the plugin, {function: (calls,
    µs) per transfer}). A call counts in a window when it both starts and
    returns inside it. Windows: the receiver's barrier exit to its receive
    call and its buffer fulfilled (the last `recorded`) to
    block_until_ready's return; the sender's barrier exit to its send call;
    the receiver's whole barrier-to-block_until_ready time."""
    def until_first(proc, times):
        """Per transfer: its start to the first of `times` inside it."""
        return [(start, inside[0]) for start, end in proc["times"]
                if (inside := [ns for ns in times if start <= ns <= end])]

    def from_last(proc, times):
        """Per transfer: the last of `times` inside it to its end."""
        return [(inside[-1], end) for start, end in proc["times"]
                if (inside := [ns for ns in times if start <= ns <= end])]

    receiver_spans = api_spans(receiver["marks"])
    sender_spans = api_spans(sender["marks"])
    plan = [
        ("receiver: barrier exit -> receive call", receiver_spans,
         until_first(receiver, mark_times(receiver["marks"], "receive_call"))),
        ("receiver: buffer fulfilled -> block_until_ready returns", receiver_spans,
         from_last(receiver, mark_times(receiver["marks"], "recorded"))),
        ("sender: barrier exit -> send call", sender_spans,
         until_first(sender, mark_times(sender["marks"], "send_call"))),
        ("receiver: the whole receive (entry calls included)", receiver_spans,
         [tuple(t) for t in receiver["times"]]),
    ]
    rows = []
    for label, spans, windows in plan:
        if not windows:
            continue
        lengths, counts, inside, per_name = [], [], [], {}
        for start, end in windows:
            calls = [(a, b, name) for a, b, name in spans if start <= a and b <= end]
            lengths.append((end - start) / 1e3)
            counts.append(len(calls))
            inside.append(sum(b - a for a, b, _ in calls) / 1e3)
            for a, b, name in calls:
                n, us = per_name.get(name, (0, 0.0))
                per_name[name] = (n + 1, us + (b - a) / 1e3)
        transfers = len(windows)
        names = {name: (n / transfers, us / transfers) for name, (n, us) in per_name.items()}
        rows.append((label, statistics.median(lengths), statistics.median(counts),
                     statistics.median(inside), names))
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        pid, coordinator, nbytes, reps, out, batch = sys.argv[2:8]
        worker(int(pid), coordinator, int(nbytes), int(reps), out, int(batch))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1,
                        help="arrays per device_put (one CopyArrays); each is a transfer of its own")
    parser.add_argument("--hosts", action="store_true", help="across the two-host bed")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--save", metavar="PATH", help="write both processes' marks and times here")
    args = parser.parse_args()
    bed = None
    if args.hosts:
        sys.path.insert(0, str(REPO / "python_tests"))
        import two_hosts

        reason = two_hosts.unavailable_reason()
        if reason:
            raise SystemExit(f"--hosts: {reason}")
        bed = two_hosts.TwoHostBed().up()
    try:
        plain = run_job(args, {}, bed)
        marked = run_job(args, {"PJRT_CROSSHOST_TIMELINE": "1"}, bed)
    finally:
        if bed is not None:
            bed.close()
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"sender": marked[0], "receiver": marked[1]}, f)
    table, totals = analyse(*marked)
    later = from_later_call(*marked)
    plain_totals = [(e - s) / 1e3 for s, e in plain[1]["times"]]
    where = "two hosts (bed)" if args.hosts else "one host"
    what = f"{args.batch} x {args.bytes}-byte" if args.batch > 1 else f"{args.bytes}-byte"
    print(f"{what} cross-process jax.device_put, {where}, {args.reps} transfers; "
          f"µs from the receiver's barrier exit, medians; 'later call': median µs from the later "
          f"of the transfer's two entry calls")
    print(f"{'step':<22} {'process':<9} {'µs':>8} {'gap':>8} {'later call':>11}")
    previous = 0.0
    for name, who, median, count in table:
        since = f"{later[name]:11.1f}" if name in later else f"{'':>11}"
        print(f"{name:<22} {who:<9} {median:8.1f} {median - previous:8.1f} {since}")
        previous = median
    print(f"{'block_until_ready':<22} {'receiver':<9} {statistics.median(totals):8.1f}")
    calls = plugin_part(*marked)
    parts = [part for _, part in calls]
    if args.batch > 1 and calls:
        last: dict = {}
        for call, part in calls:
            last[call] = max(part, last.get(call, part))
        print(f"whole batch (later entry call -> its last buffer fulfilled): "
              f"p50 {statistics.median(last.values()):.1f} µs over {len(last)} batches")
    if parts:
        ordered = sorted(parts)
        print(f"plugin's part (later entry call -> buffer fulfilled), per transfer: "
              f"p50 {statistics.median(parts):.1f} µs, p25 {ordered[len(ordered) // 4]:.1f}, "
              f"p75 {ordered[3 * len(ordered) // 4]:.1f}")
    print(f"whole receive with marks: {statistics.median(totals):.1f} µs; "
          f"without (same run, another job): {statistics.median(plain_totals):.1f} µs")
    windows = api_windows(*marked)
    if windows:
        print("\nPJRT calls into the plugin outside its entry calls (per transfer, medians; "
              "'inside': µs spent in those calls)")
        print(f"{'window':<56} {'µs':>8} {'calls':>6} {'inside':>8}  most time (calls, µs per transfer)")
        for label, length, count, inside, names in windows:
            top = sorted(names.items(), key=lambda item: -item[1][1])[:4]
            most = ", ".join(f"{name.removeprefix('PJRT_')} {n:.1f}/{us:.1f}" for name, (n, us) in top)
            print(f"{label:<56} {length:8.1f} {count:6.0f} {inside:8.1f}  {most}")


if __name__ == "__main__":
    main()
