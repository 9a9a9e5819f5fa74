"""A process that owns shared memory, for test_shm_reaping.py.

    python shm_child.py <lib> <mode>

modes:

- ``hold``: creates a single-process client, posts v1 receives (one
  destination carved from a pooled 256 MiB segment, one zero-sized buffer,
  which gets a dedicated region), prints ``ready <pid>`` and waits for a
  line on stdin; then destroys the client and exits 0 (a clean end). The
  test SIGKILLs it instead to play a death.
- ``exit``: the same receives, prints ``ready <pid>``, waits for a line on
  stdin, then calls ``os._exit(0)`` without destroying anything (a death
  without cleanup).
- ``start``: creates a client and destroys it (the "next start" that reaps
  what dead processes left), prints ``done``.

$PJRT_CROSSHOST_SHM_WATCHDOG=0 in the environment turns the plugin's
watchdog off, so that only the next start removes what a death leaves.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pjrt_ctypes as pc  # noqa: E402
import transfer_helpers as th  # noqa: E402

SPECS = [th.spec(pc.BufferType.U8, 4096), th.spec(pc.BufferType.U8, 0)]


def main(lib: str, mode: str) -> None:
    api = pc.Api(lib)
    api.initialize()
    client = api.create_client()
    if mode == "start":
        client.destroy()
        print("done", flush=True)
        os._exit(0)
    xh = th.Transfers(api)
    receive = xh.make_receive(client, client.addressable_devices()[0], SPECS)
    assert receive.notified.count() == 1
    print(f"ready {os.getpid()}", flush=True)
    sys.stdin.readline()
    if mode == "exit":
        os._exit(0)
    assert mode == "hold", mode
    client.destroy()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
