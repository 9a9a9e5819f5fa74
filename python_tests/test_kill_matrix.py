"""The kill matrix (issue 11): the other process of a transfer is SIGKILLed
at each phase, stopped there exactly by the plugin's kill points
(src/sync/kill_points.rs, armed through PJRT_CROSSHOST_TEST_KILL_POINT):

| killed | at | the survivor (this process) |
|---|---|---|
| sender | after it got the descriptor | receive fails UNAVAILABLE, naming process 1, at once |
| sender | mid-copy (half the bytes written) | receive fails UNAVAILABLE, at once |
| sender | after its receipt was acked | receive is OK, every byte |
| receiver | after publishing its descriptor | send fails (never OK), at once |
| receiver | before deleting its keys | send is OK (the receiver had the bytes) |

"At once" is well inside the 30 s receive and send timeouts: the lost
control link tells the survivor. Then the survivor's lifecycle has settled
(every receive retired, no key outstanding), /dev/shm holds nothing of the
dead process (its watchdog removed it; src/transport/shm_reaper.rs), and the
framework's store holds no transfer key of either process (the peer store
keeps them in process memory; the dead process's went with it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import pjrt_ctypes as pc
import transfer_helpers as th
from conftest import library_path
from kill_child import KILL_SEED, KILL_SPEC
from kv_server import KvClient
from peer_process import Channel, client_options

EC = pc.ErrorCode
HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_MS = 30_000
PROMPT_S = 8.0  # well inside TIMEOUT_MS


class KilledPeer:
    def __init__(self, api, server, tmp_path, role: str, point: str):
        self.session = th.unique("kill")
        self.kv = KvClient(server.address)
        self.ch = Channel(self.kv, self.session)
        self.callbacks = th.PjrtKvCallbacks(self.kv)
        self.marker = tmp_path / "kill-point-reached"
        options = {"receive_timeout_ms": TIMEOUT_MS, "send_timeout_ms": TIMEOUT_MS}
        cfg = {"lib": str(library_path()), "kv": list(server.address),
               "session": self.session, "role": role, "options": options}
        env = dict(os.environ, PJRT_CROSSHOST_TEST_KILL_POINT=point,
                   PJRT_CROSSHOST_TEST_KILL_POINT_MARKER=str(self.marker))
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "kill_child.py"), json.dumps(cfg)],
            stdout=subprocess.DEVNULL, stderr=self.err, cwd=HERE, env=env,
        )
        opts = client_options(0, 2, self.session, options)
        self.client = None
        (self.client,) = th.create_concurrently(
            [lambda: self.callbacks.create_client(api, opts)], timeout=30
        )
        self.ch.get("ready", 30)

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()[-3000:]

    def segments(self) -> list[str]:
        """The child's shared-memory objects (crosshost-<ns>-<pid>-...)."""
        pid = f"-{self.proc.pid}-"
        return [n for n in os.listdir("/dev/shm") if n.startswith("crosshost-") and pid in n]

    def check_nothing_left_in_dev_shm(self) -> None:
        assert th.poll_until(lambda: not self.segments(), 10), self.segments()

    def kill_at_the_point(self, point: str) -> float:
        """Waits until the child stopped at its kill point, SIGKILLs it;
        returns the time of the kill."""
        deadline = time.monotonic() + 20
        while not self.marker.exists():
            assert self.proc.poll() is None, f"child exited early:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"{point} never reached:\n{self.stderr()}"
            time.sleep(0.01)
        assert self.marker.read_text() == point
        self.segments_at_kill = self.segments()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        return time.monotonic()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.client is not None:
            self.client.destroy()
        self.kv.close()
        self.err.close()


@pytest.fixture
def killed_peer(api, server, tmp_path):
    peers = []

    def make(role, point):
        p = KilledPeer(api, server, tmp_path, role, point)
        peers.append(p)
        return p

    yield make
    for p in peers:
        p.close()


def transfer_keys(server) -> list[str]:
    return [k for k in server.keys("crosshost/") if "/recv/" in k or "/desc/" in k]


def settled(client) -> dict:
    (m,) = th.wait_keys_retired(client)
    return m


@pytest.mark.parametrize(
    "point,expect_ok",
    [("sender_after_descriptor", False), ("sender_mid_copy", False),
     ("sender_after_receipt", True)],
)
def test_sender_killed(xh, killed_peer, server, point, expect_ok):
    peer = killed_peer("send", point)
    c = peer.client
    (buf,) = xh.receive(c, c.addressable_devices()[0], [KILL_SPEC], [th.device_ids(c, 1)[0]], [1])
    peer.ch.put("go", b"1")
    killed_at = peer.kill_at_the_point(point)
    status = th.buffer_status(buf, timeout=TIMEOUT_MS / 1000 + 10)
    took = time.monotonic() - killed_at
    if expect_ok:
        th.expect_ok(status, f"receive after the sender died {point}")
        th.assert_same_bytes(th.read_back(buf, KILL_SPEC), th.make_data(KILL_SPEC, KILL_SEED))
    else:
        th.expect_code(status, EC.UNAVAILABLE, f"receive after the sender died {point}")
        assert "process 1" in status.message, status
        assert took < PROMPT_S, f"the receive failed {took:.1f}s after the kill"
    m = settled(c)
    assert m["keys_outstanding"] == 0 and m["timeouts"] == 0, m
    peer.check_nothing_left_in_dev_shm()
    assert transfer_keys(server) == []


@pytest.mark.parametrize(
    "point,expect_ok",
    [("receiver_after_descriptor", False), ("receiver_before_delete", True)],
)
def test_receiver_killed(xh, killed_peer, server, point, expect_ok):
    peer = killed_peer("receive", point)
    c = peer.client
    src = th.upload(c, c.addressable_devices()[0], KILL_SPEC, th.make_data(KILL_SPEC, KILL_SEED))
    if expect_ok:
        peer.ch.get("posted", 30)
        (ev,) = xh.send(c, [src], [th.device_ids(c, 1)[0]], [2])
        th.expect_ok(th.wait_event(ev, timeout=30), "send before the receiver died")
        peer.kill_at_the_point(point)
    else:
        killed_at = peer.kill_at_the_point(point)
        (ev,) = xh.send(c, [src], [th.device_ids(c, 1)[0]], [2])
        status = th.wait_event(ev, timeout=TIMEOUT_MS / 1000 + 10)
        took = time.monotonic() - killed_at
        assert status is not None, "a send into a dead receiver reported OK"
        assert status.code in (EC.UNAVAILABLE, EC.NOT_FOUND, EC.FAILED_PRECONDITION), status
        assert took < PROMPT_S, f"the send failed {took:.1f}s after the kill"
    assert peer.segments_at_kill, "the receiver had no shared memory to leave behind?"
    peer.check_nothing_left_in_dev_shm()
    assert transfer_keys(server) == []
