"""One process of a two-host ctypes job (test_transfers_two_hosts.py), run
on a host of the two-host bed.

    two_host_worker.py kv PORT            serve the job's KV store on this host
    two_host_worker.py run CONFIG_JSON    be node CONFIG["node"] of the job

The KV store (kv_server.KvServer) runs on host a, on the bed's network, so
both processes reach it as a framework's store: the plugin's session goes
through the PJRT KV callbacks, the transfer keys over its control links
between the hosts. The test in the root namespace cannot reach the bed's
network, so each worker prints one JSON line of results on stdout, last.
Node 0 (host a) sends, node 1 (host b) receives.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import pjrt_ctypes as pc  # noqa: E402
import transfer_helpers as th  # noqa: E402
from kv_server import KvServer  # noqa: E402
from peer_process import client_options, worker_setup  # noqa: E402

BT = pc.BufferType
SEED = 4242
# Zero-sized, eager (below UCX's rendezvous threshold) and rendezvous sizes;
# one buffer of 256 KiB or more, so that `auto` sends them all over UCX
# (from two such buffers from one peer it takes the TCP transport where
# UCX's only lane is TCP: transfer/route.rs, and the "batch" scenario).
SPECS = [
    th.spec(BT.F32, 0),
    th.spec(BT.U8, 17),
    th.spec(BT.S32, 1024),
    th.spec(BT.F64, 128, 240),
    th.spec(BT.BF16, 2, 3, 4),
    th.spec(BT.U8, 8 << 20),
]
# Scenario "batch": eight 1 MiB buffers from one peer, beside two small
# ones: where UCX's only lane is TCP, `auto` sends the eight over the TCP
# transport and the small ones over UCX (transfer/route.rs).
BATCH_SPECS = [th.spec(BT.U8, 17), *[th.spec(BT.U8, 1 << 20)] * 8, th.spec(BT.S32, 1024)]


def specs_of(scenario: str) -> list:
    return BATCH_SPECS if scenario == "batch" else SPECS


def keys_of(specs: list) -> list:
    return list(range(100, 100 + len(specs)))
# UCX settings the plugin chooses unless the user did (ucx/library.rs).
UCX_SETTINGS = ["UCX_TCP_RX_SEG_SIZE"]


def c_getenv(name: str) -> str | None:
    """``name`` in the process's C environment, where the plugin sets it."""
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    value = libc.getenv(name.encode())
    return None if value is None else value.decode()


def thread_slices() -> dict:
    """Each thread's scheduler slice in ns (``se.slice`` of its
    /proc/self/task/TID/sched), the plugin's threads (named ``crosshost-*``)
    apart from the others."""
    slices: dict = {"plugin": {}, "main": None}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/sched") as f:
                fields = {k.strip(): v for k, v in (ln.split(":", 1) for ln in f if ":" in ln)}
        except OSError:
            continue  # the thread ended
        slice_ns = int(float(fields["se.slice"].strip())) if "se.slice" in fields else None
        if int(tid) == os.getpid():
            slices["main"] = slice_ns
        elif name.startswith("crosshost"):
            slices["plugin"].setdefault(name, set()).add(slice_ns)
    slices["plugin"] = {name: sorted(s) for name, s in slices["plugin"].items()}
    return slices


def status_code(status) -> str:
    """``OK``, or the error's code name and message."""
    if status is None:
        return "OK"
    return f"{pc.ErrorCode(status.code).name}: {status}"


def serve_kv(port: int) -> int:
    server = KvServer(host="0.0.0.0", port=port)
    print(json.dumps({"kv": list(server.address)}), flush=True)
    # The bed kills us when the test is done.
    while True:
        time.sleep(3600)


def sender(api, xh, client, ch, cfg):
    d0 = client.addressable_devices()[0]
    dst = th.device_ids(client, 1)[0]
    scenario = cfg["scenario"]
    if scenario == "v1" or scenario == "cancel":
        descs = ch.get_list("desc", timeout=60)
        srcs = [th.upload(client, d0, s, th.make_data(s, SEED + i)) for i, s in enumerate(SPECS)]
        sends = [xh.copy_to_remote(b, d) for b, d in zip(srcs, descs)]
        outcomes = []
        for s in sends:
            err, _ = s.wait()
            outcomes.append(status_code(err))
        return {"sends": outcomes}
    if cfg.get("order") == "recv_first":
        ch.get("posted", 60)
    specs = specs_of(scenario)
    srcs = [th.upload(client, d0, s, th.make_data(s, SEED + i)) for i, s in enumerate(specs)]
    events = xh.send(client, srcs, [dst] * len(specs), keys_of(specs))
    ch.put("sent", b"1")
    outcomes = [status_code(th.wait_event(e, timeout=90)) for e in events]
    return {"sends": outcomes}


def receiver(api, xh, client, ch, cfg):
    d2 = client.addressable_devices()[0]
    src = th.device_ids(client, 0)[0]
    scenario = cfg["scenario"]
    started = time.monotonic()
    specs = specs_of(scenario)
    if scenario in ("v1", "cancel"):
        r = xh.make_receive(client, d2, SPECS)
        if scenario == "cancel":
            r.cancel(r.descriptors[1])
        ch.put_list("desc", r.descriptors)
        buffers = r.buffers
    else:
        if cfg.get("order") == "send_first":
            ch.get("sent", 60)
        buffers = xh.receive(client, d2, specs, [src] * len(specs), keys_of(specs))
        ch.put("posted", b"1")
    outcomes, same = [], []
    for i, (b, s) in enumerate(zip(buffers, specs)):
        status = th.buffer_status(b, timeout=90)
        outcomes.append(status_code(status))
        if status is None:
            got = th.read_back(b, s)
            same.append(bool(np.array_equal(got.view(np.uint8), th.make_data(s, SEED + i).view(np.uint8))))
        else:
            same.append(None)
    return {"buffers": outcomes, "same": same, "seconds": time.monotonic() - started}


def rounds(api, xh, client, ch, cfg):
    """Transfers on command, one a line of stdin (``{"round": k, "len":
    n}``, or ``"lens": [n, ...]`` for a batch of buffers in one call),
    each answered on stdout with its outcome and how long it took: the test
    cuts and heals the bed's link between them (test_bed_faults.py).
    Nothing goes through the KV store after creation, since the faults cut
    host b from it too."""
    node = cfg["node"]
    device = client.addressable_devices()[0]
    peer_device = th.device_ids(client, 1 - node)[0]
    print(json.dumps({"ready": node}), flush=True)
    for line in sys.stdin:
        order = json.loads(line)
        k = order["round"]
        batch = "lens" in order
        lengths = order["lens"] if batch else [order["len"]]
        specs = [th.spec(BT.U8, n) for n in lengths]
        # One key and one seed per buffer (a lone buffer keeps round k's).
        keys = [1000 + k] if not batch else [100_000 + 64 * k + i for i in range(len(specs))]
        seeds = [SEED + key for key in keys] if batch else [SEED + k]
        # Timed from the call that starts the transfer's own deadline to its
        # outcome: making and uploading 64 MiB, or reading it back, is not
        # the transfer's time.
        if node == 1:
            started = time.monotonic()
            bufs = xh.receive(client, device, specs, [peer_device] * len(specs), keys)
            statuses = [th.buffer_status(b, timeout=120) for b in bufs]
            seconds = time.monotonic() - started
            same = []
            for b, s, seed, status in zip(bufs, specs, seeds, statuses):
                if status is None:
                    got = th.read_back(b, s)
                    same.append(bool(np.array_equal(got.view(np.uint8), th.make_data(s, seed).view(np.uint8))))
                else:
                    same.append(None)
        else:
            srcs = [th.upload(client, device, s, th.make_data(s, seed)) for s, seed in zip(specs, seeds)]
            started = time.monotonic()
            events = xh.send(client, srcs, [peer_device] * len(specs), keys)
            statuses = [th.wait_event(e, timeout=120) for e in events]
            seconds = time.monotonic() - started
            same = [None] * len(specs)
        outcomes = [status_code(status) for status in statuses]
        if batch:
            answer = {"round": k, "outcomes": outcomes, "same": same}
        else:
            answer = {"round": k, "outcome": outcomes[0], "same": same[0]}
        answer["seconds"] = seconds
        print(json.dumps(answer), flush=True)
    return {"rounds": "done", "metrics": th.metrics(client)}


def run(cfg: dict) -> int:
    result: dict = {"node": cfg["node"]}
    client = None
    try:
        kv, ch, api, xh, callbacks = worker_setup(cfg)
        options = client_options(cfg["node"], 2, cfg["session"], cfg.get("options"))
        try:
            client = callbacks.create_client(api, options)
        except pc.PjrtError as e:
            result["create_error"] = {"code": int(e.code), "message": str(e)}
            print(json.dumps(result), flush=True)
            return 0
        # What UCX was configured with: the plugin's defaults, set in the C
        # environment before libucp loads (os.environ is Python's copy).
        result["ucx_env"] = {name: c_getenv(name) for name in UCX_SETTINGS}
        if cfg["scenario"] == "rounds":
            role = rounds
        else:
            role = sender if cfg["node"] == 0 else receiver
        result.update(role(api, xh, client, ch, cfg))
        result["thread_slices"] = thread_slices()
        try:
            result["metrics"] = th.wait_keys_retired(client, timeout=30)[0]
        except AssertionError:
            result["metrics"] = th.metrics(client)
    except BaseException:  # noqa: BLE001 - reported to the test
        result["error"] = traceback.format_exc()
    print(json.dumps(result), flush=True)
    if client is not None and "error" not in result:
        # Stay until the other side is done with our memory and links (the
        # test kills us first when the other side was killed).
        ch.put(f"done/{cfg['node']}", b"1")
        ch.get(f"done/{1 - cfg['node']}", 120)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "kv":
        sys.exit(serve_kv(int(sys.argv[2])))
    sys.exit(run(json.loads(sys.argv[2])))
