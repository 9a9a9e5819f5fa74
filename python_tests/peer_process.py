"""The second process of the two-process transfer tests.

Run by test_transfers_processes.py as

    python peer_process.py <json config>

config: lib, kv ([host, port]), node, nodes, session, scenario, options
(extra create options), with_delete. The process creates node ``node`` of
the job with PJRT KV callbacks talking to the test's KvServer, then plays
its half of ``scenario``. The test and this process talk through the same
server under ``test/<session>/...`` keys (the tests' own channel, apart from
the plugin's ``crosshost/...`` keys). The process reports ``ok`` or the
failure text under ``test/<session>/result/<step>``, and exits with
os._exit after destroying its client (no interpreter teardown while plugin
threads may still call into Python).

The shared constants (specs, seeds, keys) live here so both sides agree.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pjrt_ctypes as pc  # noqa: E402
import transfer_helpers as th  # noqa: E402
from kv_server import KvClient  # noqa: E402

BT = pc.BufferType

# node 0 (the test) owns two devices, node 1 (this process) two more. Their
# global ids depend on the plugin's mode (th.expected_pair_ids), so both sides
# take them from the client (th.device_ids), never from literals.
V2_SPECS = [
    th.spec(BT.F32, 256, 17),
    th.spec(BT.S8, 1001),
    th.spec(BT.U8, 0),
    th.spec(BT.F64),
    th.spec(BT.BF16, 3, 7),
    th.spec(BT.C64, 5),
    th.spec(BT.PRED, 33),
    th.spec(BT.S64, 1 << 15),  # 256 KiB
]
V2_KEYS_0_TO_1 = [1000 + i for i in range(len(V2_SPECS))]  # node 0 dev 0 -> node 1 dev 0
V2_KEYS_1_TO_0 = [2000 + i for i in range(len(V2_SPECS))]  # node 1 dev 1 -> node 0 dev 1
SEED_0 = 100  # data node 0 sends: make_data(spec, SEED_0 + i)
SEED_1 = 500  # data node 1 sends

V1_SPECS = [th.spec(BT.S32, 64, 3), th.spec(BT.F16, 0), th.spec(BT.U64, 9), th.spec(BT.F32)]
V1_SEED_0 = 700
V1_SEED_1 = 900


class Channel:
    """The test's own channel over the KV server."""

    def __init__(self, kv: KvClient, session: str):
        self.kv = kv
        self.prefix = f"test/{session}/"

    def put(self, name: str, value: bytes) -> None:
        err = self.kv.put(self.prefix + name, value)
        assert err is None, err

    def get(self, name: str, timeout: float = th.WAIT) -> bytes:
        v = self.kv.get(self.prefix + name, int(timeout * 1000))
        if v is None:
            raise TimeoutError(f"channel key {name} not set within {timeout}s")
        return v

    def put_list(self, name: str, items: list[bytes]) -> None:
        for i, item in enumerate(items):
            self.put(f"{name}/{i}", item)
        self.put(f"{name}/n", str(len(items)).encode())

    def get_list(self, name: str, timeout: float = th.WAIT) -> list[bytes]:
        n = int(self.get(f"{name}/n", timeout))
        return [self.get(f"{name}/{i}", timeout) for i in range(n)]


def worker_setup(cfg: dict, **callbacks_kwargs):
    """What a worker process starts from: (kv, ch, api, xh, callbacks) -- a
    client of the job's KV server (``cfg["kv"]``), the test's channel on it
    (``cfg["session"]``), the plugin at ``cfg["lib"]`` initialized, its
    transfer calls, and PJRT KV callbacks on that server (``callbacks_kwargs``
    are theirs)."""
    kv = KvClient(cfg["kv"])
    ch = Channel(kv, cfg["session"])
    api = pc.Api(cfg["lib"])
    api.initialize()
    return kv, ch, api, th.Transfers(api), th.PjrtKvCallbacks(kv, **callbacks_kwargs)


def client_options(node, nodes, session, extra):
    o = {"num_devices": 2, "node_id": node, "num_nodes": nodes, "session": session,
         "session_timeout_ms": 20000}
    o.update(extra or {})
    return o


# ---------------------------------------------------------------------------
# Scenario halves run by this process (node 1)
# ---------------------------------------------------------------------------


def v2_peer(api, xh, client, ch):
    d2, d3 = client.addressable_devices()
    t0, t1 = th.device_ids(client, 0)  # the test's (node 0's) two devices
    bufs = xh.receive(client, d2, V2_SPECS, [t0] * len(V2_SPECS), V2_KEYS_0_TO_1)
    datas = [th.make_data(s, SEED_1 + i) for i, s in enumerate(V2_SPECS)]
    srcs = [th.upload(client, d3, s, d) for s, d in zip(V2_SPECS, datas)]
    evs = xh.send(client, srcs, [t1] * len(V2_SPECS), V2_KEYS_1_TO_0)
    for i, (b, e, s) in enumerate(zip(bufs, evs, V2_SPECS)):
        th.expect_ok(th.wait_event(e), f"peer send event {i}")
        th.expect_ok(th.buffer_status(b), f"peer receive buffer {i}")
        th.assert_same_bytes(th.read_back(b, s), th.make_data(s, SEED_0 + i), f"peer buffer {i}")


def v1_peer(api, xh, client, ch):
    d2 = client.addressable_devices()[0]
    # 1) send to the test's v1 receive buffers, descriptors relayed by the test.
    descs = ch.get_list("v1/desc0")
    datas = [th.make_data(s, V1_SEED_1 + i) for i, s in enumerate(V1_SPECS)]
    srcs = [th.upload(client, d2, s, d) for s, d in zip(V1_SPECS, datas)]
    sends = [xh.copy_to_remote(b, d) for b, d in zip(srcs, descs)]
    for i, s in enumerate(sends):
        err, enqueued = s.wait()
        th.expect_ok(err, f"peer on_done {i}")
        assert enqueued and s.done.count() == 1
    ch.put("result/v1send", b"ok")
    # 2) receive from the test: publish our descriptors, check the bytes.
    r = xh.make_receive(client, d2, V1_SPECS)
    ch.put_list("v1/desc1", r.descriptors)
    for i, (b, s) in enumerate(zip(r.buffers, V1_SPECS)):
        th.expect_ok(th.buffer_status(b), f"peer v1 buffer {i}")
        th.assert_same_bytes(th.read_back(b, s), th.make_data(s, V1_SEED_0 + i), f"v1 buf {i}")


STALE_SPEC = th.spec(BT.S32, 4096)
STALE_SEED = 321


def send_on_go_peer(api, xh, client, ch):
    """Waits for the test's "go", then sends STALE_SPEC from this node's
    first device to node 0's first device under transfer key 1."""
    ch.get("go", 30)
    d2 = client.addressable_devices()[0]
    src = th.upload(client, d2, STALE_SPEC, th.make_data(STALE_SPEC, STALE_SEED))
    (ev,) = xh.send(client, [src], [th.device_ids(client, 0)[0]], [1])
    th.expect_ok(th.wait_event(ev), "peer send")


def idle_peer(api, xh, client, ch):
    time.sleep(120)  # the test SIGKILLs us


DOOMED_SPEC = th.spec(BT.U8, 4096)
DOOMED_KEY = 77


def receive_then_idle_peer(api, xh, client, ch):
    """Posts one receive (DOOMED_SPEC, key DOOMED_KEY) from node 0's first
    device into this node's first device, says "posted", then idles until
    the test SIGKILLs it."""
    d2 = client.addressable_devices()[0]
    bufs = xh.receive(client, d2, [DOOMED_SPEC], [th.device_ids(client, 0)[0]], [DOOMED_KEY])
    ch.put("posted", b"1")
    idle_peer(api, xh, client, ch)
    del bufs


SHRINK_SPEC = th.spec(BT.U8, 64 * 1024)


def receive_thrice_peer(api, xh, client, ch):
    """Receives SHRINK_SPEC from node 0's first device three times (keys
    1, 2, 3): the first must arrive intact; the second is posted, said
    ("posted2"), and its outcome reported as "outcome2" (the test truncates
    this process's shared memory before sending it); the third, after it,
    must arrive intact again."""
    d2 = client.addressable_devices()[0]
    src = [th.device_ids(client, 0)[0]]
    (first,) = xh.receive(client, d2, [SHRINK_SPEC], src, [1])
    th.expect_ok(th.buffer_status(first), "first receive")
    th.assert_same_bytes(th.read_back(first, SHRINK_SPEC), th.make_data(SHRINK_SPEC, 1), "first")
    ch.put("first_done", b"1")
    (second,) = xh.receive(client, d2, [SHRINK_SPEC], src, [2])
    ch.put("posted2", b"1")
    status = th.buffer_status(second)
    ch.put("outcome2", b"ok" if status is None else f"{status.code.name}: {status.message}".encode())
    # The pool no longer carves from the truncated segment: key 3 lands.
    (third,) = xh.receive(client, d2, [SHRINK_SPEC], src, [3])
    th.expect_ok(th.buffer_status(third), "third receive")
    th.assert_same_bytes(th.read_back(third, SHRINK_SPEC), th.make_data(SHRINK_SPEC, 3), "third")


SCENARIOS = {
    "v2": v2_peer,
    "receive_thrice": receive_thrice_peer,
    "v1": v1_peer,
    "idle": idle_peer,
    "send_on_go": send_on_go_peer,
    "receive_then_idle": receive_then_idle_peer,
}


def main(cfg: dict) -> int:
    kv = KvClient(cfg["kv"])
    ch = Channel(kv, cfg["session"])
    step = cfg["scenario"]
    client = None
    try:
        api = pc.Api(cfg["lib"])
        api.initialize()
        xh = th.Transfers(api)
        callbacks = th.PjrtKvCallbacks(kv, with_delete=cfg.get("with_delete", True))
        client = callbacks.create_client(
            api, client_options(cfg["node"], cfg["nodes"], cfg["session"], cfg.get("options"))
        )
        ch.put("ready", str(os.getpid()).encode())
        SCENARIOS[step](api, xh, client, ch)
        assert not callbacks.errors, f"KV callbacks raised: {callbacks.errors}"
        ch.put("metrics", json.dumps(th.metrics(client)).encode())
        ch.put(f"result/{step}", b"ok")
        ch.get("finish", 60)
        rc = 0
    except BaseException:  # noqa: BLE001 - reported to the test
        text = traceback.format_exc()
        sys.stderr.write(text)
        try:
            ch.put(f"result/{step}", ("FAILED\n" + text).encode())
        except Exception:  # noqa: BLE001
            pass
        rc = 1
    if client is not None:
        client.destroy()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
