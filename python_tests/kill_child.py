"""The process the kill matrix kills (test_kill_matrix.py).

    python kill_child.py <json config>

config: lib, kv ([host, port]), session, role ("send" or "receive"),
options. Node 1 of a two-process job (the test is node 0), KV callbacks over
the test's KvServer. The kill point is armed by the test through
PJRT_CROSSHOST_TEST_KILL_POINT; the plugin writes the marker file when it
stops there, and the test SIGKILLs this process.

- send: waits for the test's "go", then sends KILL_SPEC from its first
  device to the test's first device under transfer key 1.
- receive: posts a receive of KILL_SPEC from the test's first device under
  transfer key 2, says "posted", and waits for the buffer.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pjrt_ctypes as pc  # noqa: E402
import transfer_helpers as th  # noqa: E402
from peer_process import client_options, worker_setup  # noqa: E402

KILL_SPEC = th.spec(pc.BufferType.U8, 4 << 20)  # 4 MiB: a copy worth interrupting
KILL_SEED = 77


def main(cfg: dict) -> int:
    kv, ch, api, xh, callbacks = worker_setup(cfg)
    client = callbacks.create_client(
        api, client_options(1, 2, cfg["session"], cfg.get("options"))
    )
    ch.put("ready", str(os.getpid()).encode())
    device = client.addressable_devices()[0]
    test_device = th.device_ids(client, 0)[0]
    if cfg["role"] == "send":
        ch.get("go", 60)
        src = th.upload(client, device, KILL_SPEC, th.make_data(KILL_SPEC, KILL_SEED))
        (ev,) = xh.send(client, [src], [test_device], [1])
        th.wait_event(ev, timeout=60)
    else:
        (buf,) = xh.receive(client, device, [KILL_SPEC], [test_device], [2])
        ch.put("posted", b"1")
        th.buffer_status(buf, timeout=60)
    ch.put("survived", b"1")  # the test kills us before this, at the kill point
    ch.get("never", 60)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
