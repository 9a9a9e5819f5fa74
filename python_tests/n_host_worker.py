"""One process of an N-host ctypes job (test_n_host_bed.py, bench/scale.py),
run on host CONFIG["node"] of an N-host bed (n_hosts.py).

    n_host_worker.py CONFIG_JSON

CONFIG: lib, node, nodes, session, options (create options), kv ([host,
port] of the job's KV server for the PJRT KV callbacks, or null when the
options name the store, e.g. kv_store=etcd://...), store (the store host's
address: connections to it are counted apart), sizes (bytes of the buffers
each pair exchanges per round), rounds ("ring", "all"), timeout_s (bound on
the plugin's deadlines; a transfer without an outcome well past it is
reported "HUNG"), pause (after creation, print ``{"created": node}`` and wait for
another line on stdin before the rounds).

The worker loads the plugin, prints ``{"ready": node}`` and waits for a line
on stdin (the test's "go": every process starts creation together), creates
its client, then:

* ring: sends to node + 1 and receives from node - 1 (mod N);
* all: sends to and receives from every other node, in one call each.

Every buffer's bytes depend on (round, sender, receiver, index) only, so the
receiver checks every byte. It prints one JSON line: creation's start and end
(time.time()), what the process holds after creation and after the
all-to-all round (fds, threads, RSS, TCP connections, from /proc/self), each
round's outcome, and the plugin's metrics once no completion key is left
(or as they are at the deadline). A creation that fails is reported with its
error. Then it waits until stdin closes (the test has every result: nobody
still needs this process), destroys its client and exits.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import pjrt_ctypes as pc  # noqa: E402
import transfer_helpers as th  # noqa: E402
from kv_server import KvClient  # noqa: E402

BT = pc.BufferType
TCP_STATES = {"01": "established", "0A": "listening"}


def pair_id(round_no: int, src: int, dst: int, i: int) -> int:
    """Transfer key and data seed of buffer ``i`` from ``src`` to ``dst``."""
    return round_no * 10_000_000 + src * 10_000 + dst * 10 + i


def usage(store: str | None) -> dict:
    """What this process holds: fds, threads (the plugin's apart), RSS and
    its TCP sockets (established to job peers, to the store host; listening)."""
    inodes = set()
    fds = os.listdir("/proc/self/fd")
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    tcp = {"peers": 0, "store": 0, "listening": 0}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[9] not in inodes:
                continue
            state = TCP_STATES.get(cols[3])
            if state == "listening":
                tcp["listening"] += 1
            elif state == "established":
                # The IPv4 address (an IPv6 one's last 32 bits), host byte order.
                remote = cols[2].split(":")[0][-8:]
                addr = ".".join(str(int(remote[k:k + 2], 16)) for k in (6, 4, 2, 0))
                tcp["store" if addr == store else "peers"] += 1
    threads = os.listdir("/proc/self/task")
    plugin_threads = 0
    for tid in threads:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                plugin_threads += f.read().startswith("crosshost")
        except OSError:
            pass
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"fds": len(fds), "threads": len(threads), "plugin_threads": plugin_threads,
            "rss_mib": round(rss_kb / 1024, 1), "tcp": tcp}


def settle(client, cfg: dict) -> dict:
    """What stays open once nothing is sent: with ``settle_endpoints``, as
    soon as the process's UCX endpoints are down to that bound (or
    ``settle_s`` passed); else after ``settle_s`` of nothing (a benchmark's
    look, past the sweeps' grace)."""
    started = time.monotonic()
    bound = cfg.get("settle_endpoints")
    while True:
        m = th.metrics(client)
        if bound is not None and m.get("ucx_endpoints_open", 0) <= bound:
            break
        if time.monotonic() - started >= cfg["settle_s"]:
            break
        time.sleep(0.05)  # polling the plugin's metrics, with a deadline
    out = usage(cfg.get("store"))
    out.update(seconds=round(time.monotonic() - started, 2),
               ucx_endpoints=m.get("ucx_endpoints_open", 0), ucx_workers=m.get("ucx_workers", 0),
               ucx_pairs_closed=m.get("ucx_endpoint_pairs_closed", 0))
    return out


def status_code(status) -> str:
    if status is None:
        return "OK"
    return f"{pc.ErrorCode(status.code).name}: {status}"


class Job:
    def __init__(self, xh, client, cfg):
        self.xh = xh
        self.client = client
        self.node = cfg["node"]
        self.nodes = cfg["nodes"]
        self.specs = [th.spec(BT.U8, n) for n in cfg["sizes"]]
        self.deadline_s = cfg["timeout_s"]
        self.device = client.addressable_devices()[0]
        ids: dict[int, int] = {}
        for d in client.devices():
            ids.setdefault(d.process_index(), d.id())
        self.ids = ids

    def exchange(self, round_no: int, to: list[int], frm: list[int]) -> dict:
        """One receive call for every buffer from ``frm``, one send call for
        every buffer to ``to``; every outcome waited for until the deadline
        and every received byte checked."""
        started = time.monotonic()
        # The plugin's own deadlines (receive_timeout_ms, send_timeout_ms)
        # start at the calls below; an outcome still missing well past them
        # is a hang.
        deadline = started + self.deadline_s * 1.1 + 5
        n = len(self.specs)
        specs = [s for _ in frm for s in self.specs]
        buffers = self.xh.receive(
            self.client, self.device, specs, [self.ids[p] for p in frm for _ in range(n)],
            [pair_id(round_no, p, self.node, i) for p in frm for i in range(n)])
        srcs = [th.upload(self.client, self.device, s, th.make_data(s, pair_id(round_no, self.node, p, i)))
                for p in to for i, s in enumerate(self.specs)]
        events = self.xh.send(
            self.client, srcs, [self.ids[p] for p in to for _ in range(n)],
            [pair_id(round_no, self.node, p, i) for p in to for i in range(n)])
        # checked_bytes: bytes compared with what the sender wrote (a test
        # can tell a check that never ran from one that passed).
        out = {"sends": {}, "receives": {}, "bad_bytes": [], "checked_bytes": 0}
        for k, ev in enumerate(events):
            peer = to[k // n]
            try:
                outcome = status_code(th.wait_event(ev, max(deadline - time.monotonic(), 0.001)))
            except TimeoutError:
                outcome = "HUNG past the deadline"
            if outcome != "OK":
                out["sends"].setdefault(str(peer), []).append(outcome)
        for k, buf in enumerate(buffers):
            peer, i = frm[k // n], k % n
            try:
                status = th.buffer_status(buf, max(deadline - time.monotonic(), 0.001))
                outcome = status_code(status)
            except TimeoutError:
                status, outcome = "hung", "HUNG past the deadline"
            if status is None:
                spec = self.specs[i]
                got = th.read_back(buf, spec).view(np.uint8)
                want = th.make_data(spec, pair_id(round_no, peer, self.node, i)).view(np.uint8)
                if not np.array_equal(got, want):
                    out["bad_bytes"].append([peer, i])
                out["checked_bytes"] += int(want.size)
            else:
                out["receives"].setdefault(str(peer), []).append(outcome)
        out["sent"] = len(events)
        out["received"] = len(buffers)
        out["seconds"] = round(time.monotonic() - started, 3)
        return out


def wait_for_stdin_line(timeout: float) -> str:
    """The next line of stdin ("" at EOF); TimeoutError after ``timeout``.
    Reads byte by byte below Python's buffering, so select() sees the rest."""
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        ready, _, _ = select.select([0], [], [], max(left, 0))
        if not ready:
            raise TimeoutError(f"no line on stdin in {timeout}s (so far {line!r})")
        b = os.read(0, 1)
        if not b:
            break
        line += b
    return line.decode()


def main(cfg: dict) -> int:
    node, nodes = cfg["node"], cfg["nodes"]
    result: dict = {"node": node}
    if cfg.get("nofile"):
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["nofile"], hard))
    client = None
    api = pc.Api(cfg["lib"])
    api.initialize()
    xh = th.Transfers(api)
    callbacks = th.PjrtKvCallbacks(KvClient(tuple(cfg["kv"]))) if cfg.get("kv") else None
    options = {"num_devices": 1, "node_id": node, "num_nodes": nodes, "session": cfg["session"],
               **cfg.get("options", {})}
    print(json.dumps({"ready": node}), flush=True)
    wait_for_stdin_line(cfg["timeout_s"] * 4)
    try:
        result["create_start"] = time.time()
        try:
            if callbacks is not None:
                client = callbacks.create_client(api, options)
            else:
                client = api.create_client(options)
        except pc.PjrtError as e:
            result["create_end"] = time.time()
            result["create_error"] = {"code": pc.ErrorCode(e.code).name, "message": str(e)}
            client = None
        else:
            result["create_end"] = time.time()
            result["after_create"] = usage(cfg.get("store"))
            if cfg.get("pause"):
                # Until every process is created (a benchmark measures the
                # store's work for the start apart from the transfers').
                print(json.dumps({"created": node}), flush=True)
                wait_for_stdin_line(cfg["timeout_s"] * 4)
            job = Job(xh, client, cfg)
            others = [p for p in range(nodes) if p != node]
            if "ring" in cfg["rounds"] and nodes > 1:
                result["ring"] = job.exchange(1, [(node + 1) % nodes], [(node - 1) % nodes])
                result["after_ring"] = usage(cfg.get("store"))
            if "all" in cfg["rounds"] and nodes > 1:
                result["all"] = job.exchange(2, others, others)
                result["after_all_to_all"] = usage(cfg.get("store"))
            try:
                result["metrics"] = th.wait_keys_retired(client, timeout=cfg["timeout_s"])[0]
            except AssertionError:
                result["metrics"] = th.metrics(client)
            if cfg.get("settle_s"):
                result["settled"] = settle(client, cfg)
            import resource

            # The soft limit as the plugin left it (a test checks it held).
            result["nofile_soft"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except BaseException:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    print(json.dumps(result), flush=True)
    try:
        while wait_for_stdin_line(cfg["timeout_s"] * 4):
            pass
    except TimeoutError:
        pass
    if client is not None:
        client.destroy()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
