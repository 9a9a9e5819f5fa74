"""One process of bench/staging.py, run on a host of the two-host bed:

    staging_worker.py CONFIG_JSON

Node 0 (host a) sends one buffer of CONFIG["bytes"] to node 1 (host b)
CONFIG["reps"] + 1 times (the first unmeasured); node 1 times each from the
moment it tells the sender to go (its receive posted, the KV store's "go"
key set) to the buffer's ready event, checks every byte of the first and
last outside the timed part, and prints one JSON line: the times and its
metrics. The job's KV store is python_tests/two_host_worker.py's server on
host a, its address in CONFIG["kv"].
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "python_tests"))

import numpy as np  # noqa: E402

import pjrt_ctypes as pc  # noqa: E402
import transfer_helpers as th  # noqa: E402
from peer_process import client_options, worker_setup  # noqa: E402


def run(cfg: dict) -> dict:
    node, reps, nbytes = cfg["node"], cfg["reps"], cfg["bytes"]
    _, ch, api, xh, callbacks = worker_setup(cfg)
    client = callbacks.create_client(api, client_options(node, 2, cfg["session"], cfg["options"]))
    device = client.addressable_devices()[0]
    peer = th.device_ids(client, 1 - node)[0]
    spec = th.spec(pc.BufferType.U8, nbytes)
    data = th.make_data(spec, 38)
    times = []
    if node == 0:
        source = th.upload(client, device, spec, data)
        for rep in range(reps + 1):
            ch.get(f"go/{rep}", 120)
            (event,) = xh.send(client, [source], [peer], [10 + rep])
            th.expect_ok(th.wait_event(event, timeout=120), f"send {rep}")
    else:
        for rep in range(reps + 1):
            (buffer,) = xh.receive(client, device, [spec], [peer], [10 + rep])
            started = time.perf_counter()
            ch.put(f"go/{rep}", b"1")
            th.expect_ok(th.buffer_status(buffer, timeout=120), f"receive {rep}")
            elapsed = time.perf_counter() - started
            if rep in (0, reps):
                got = th.read_back(buffer, spec)
                assert np.array_equal(got.view(np.uint8), data.view(np.uint8)), f"rep {rep} differs"
            if rep > 0:
                times.append(elapsed)
            del buffer
    return {"node": node, "times": times, "metrics": th.metrics(client), "client": client, "ch": ch}


def main() -> int:
    cfg = json.loads(sys.argv[1])
    try:
        result = run(cfg)
    except BaseException:  # noqa: BLE001 - reported to the driver
        print(json.dumps({"node": cfg["node"], "error": traceback.format_exc()}), flush=True)
        return 1
    client, ch = result.pop("client"), result.pop("ch")
    print(json.dumps(result), flush=True)
    # Stay until the other side is done with our memory and links.
    ch.put(f"done/{cfg['node']}", b"1")
    ch.get(f"done/{1 - cfg['node']}", 120)
    del client
    return 0


if __name__ == "__main__":
    sys.exit(main())
