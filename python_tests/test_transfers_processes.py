"""Two processes, one job: node 0 is this pytest process, node 1 a child
interpreter (peer_process.py). The key-value store is a KvServer owned by
the test (a thread here, on localhost TCP); each process reaches it through
PJRT_Client_Create's KV callbacks (get / try_get / put) plus the plugin's
KV delete extension, so completion receipts are really deleted.

Most tests here are about that framework-owned store, so their jobs pass
kv_store=callbacks: every key, the transfer keys included, goes through the
callbacks. The tests named *_peer_store* run with the default instead: the
session through the callbacks, the transfer keys over control links between
the two processes (kv/peer.rs), so the framework's store never sees a
transfer key and a peer that dies is noticed when its link closes. Every
wait is bounded; a child still alive at the end of a test is killed.

Device ids (in transfer calls and in the plugin's ``.d<src>-<dst>`` store
keys) come from the client (th.device_ids): the numbering depends on the
plugin's mode (th.expected_pair_ids).
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

import peer_process as peer
import pjrt_ctypes as pc
import transfer_helpers as th
from conftest import library_path
from kv_server import KvClient

BT = pc.BufferType
EC = pc.ErrorCode
HERE = os.path.dirname(os.path.abspath(__file__))


class Job:
    """Node 0 here + node 1 in a child process, sharing ``server``."""

    def __init__(
        self, api, server, scenario, options=None, with_delete=True, store="callbacks", env=None
    ):
        options = dict(options or {})
        if store == "callbacks":
            options.setdefault("kv_store", "callbacks")
        self.api = api
        self.server = server
        self.session = th.unique("job")
        self.kv = KvClient(server.address)
        self.ch = peer.Channel(self.kv, self.session)
        self.callbacks = th.PjrtKvCallbacks(self.kv, with_delete=with_delete)
        self.client = None
        cfg = {
            "lib": str(library_path()),
            "kv": list(server.address),
            "node": 1,
            "nodes": 2,
            "session": self.session,
            "scenario": scenario,
            "options": options or {},
            "with_delete": with_delete,
        }
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "peer_process.py"), json.dumps(cfg)],
            stdout=subprocess.DEVNULL,
            stderr=self.err,
            cwd=HERE,
            env=dict(os.environ, **(env or {})),
        )
        opts = peer.client_options(0, 2, self.session, options)
        (self.client,) = th.create_concurrently(
            [lambda: self.callbacks.create_client(api, opts)], timeout=30
        )
        self.ch.get("ready", 30)

    def child_stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()[-4000:]

    def result(self, step: str, timeout: float = th.WAIT) -> None:
        try:
            r = self.ch.get(f"result/{step}", timeout).decode()
        except TimeoutError:
            raise AssertionError(
                f"peer gave no result for {step} in {timeout}s; rc={self.proc.poll()}\n"
                + self.child_stderr()
            ) from None
        assert r == "ok", f"peer step {step}: {r}"

    def exchange_v2(self, xh) -> list:
        """Our side of the peer's "v2" scenario: sends peer.V2_SPECS from our
        first device to the peer's first and receives the peer's on our
        second, checks every send event, buffer and byte, then the peer's
        own result. Returns the received buffers, in V2_SPECS order."""
        c = self.client
        d0, d1 = c.addressable_devices()
        p0, p1 = th.device_ids(c, 1)
        specs = peer.V2_SPECS
        datas = [th.make_data(s, peer.SEED_0 + i) for i, s in enumerate(specs)]
        srcs = [th.upload(c, d0, s, d) for s, d in zip(specs, datas)]
        evs = xh.send(c, srcs, [p0] * len(specs), peer.V2_KEYS_0_TO_1)
        bufs = xh.receive(c, d1, specs, [p1] * len(specs), peer.V2_KEYS_1_TO_0)
        for i, (e, b, s) in enumerate(zip(evs, bufs, specs)):
            th.expect_ok(th.wait_event(e), f"send event {i}")
            th.expect_ok(th.buffer_status(b), f"receive buffer {i}")
            th.assert_same_bytes(th.read_back(b, s), th.make_data(s, peer.SEED_1 + i), f"buf {i}")
        self.result("v2")
        return bufs

    def finish(self) -> None:
        """Lets the child destroy its client and exit; checks its exit code."""
        self.ch.put("finish", b"1")
        try:
            rc = self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError("peer did not exit within 20s\n" + self.child_stderr())
        assert rc == 0, f"peer exited with {rc}\n{self.child_stderr()}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        if self.client is not None:
            self.client.destroy()
            self.client = None
        assert not self.callbacks.errors, f"KV callbacks raised: {self.callbacks.errors}"
        self.kv.close()
        self.err.close()


@pytest.fixture
def job_factory(api, server):
    jobs = []

    def make(*a, **kw):
        j = Job(api, server, *a, **kw)
        jobs.append(j)
        return j

    yield make
    for j in jobs:
        j.close()


def plugin_keys(server, pattern: str = "") -> list[str]:
    return [
        k
        for k in server.keys("crosshost/")
        if (k.startswith("crosshost/recv/") or k.startswith("crosshost/desc/")) and pattern in k
    ]


# ----------------------------------------------------------------------------


def test_two_processes_see_the_same_global_devices(job_factory):
    job = job_factory("v1", options={})  # any scenario; we only look at devices
    c = job.client
    assert [d.id() for d in c.devices()] == th.expected_pair_ids()
    assert [d.is_addressable() for d in c.devices()] == [True, True, False, False]
    assert [d.process_index() for d in c.devices()] == [0, 0, 1, 1]
    job.kill()


@pytest.mark.parametrize(
    "transport,with_delete",
    [("auto", True), ("tcp", True), ("auto", False)],
    ids=["auto", "tcp", "auto-no-delete"],
)
def test_v2_both_directions_between_processes(xh, job_factory, server, transport, with_delete):
    options = {} if transport == "auto" else {"transport": transport}
    job = job_factory("v2", options=options, with_delete=with_delete)
    c = job.client
    specs = peer.V2_SPECS
    for b, s in zip(job.exchange_v2(xh), specs):
        assert b.dims() == s.dims and b.element_type() == s.type
    total = sum(s.nbytes for s in specs)
    if with_delete:
        (m,) = th.wait_keys_retired(c)
        # Every receipt and descriptor key of both directions is gone from
        # the store (node 1 retires its own; poll: it deletes after readiness).
        left = th.poll_until(lambda: not plugin_keys(server), 5) or plugin_keys(server)
        assert left is True or not left, f"keys left in the store: {left}"
        assert m["retained_keys"] == 0
    else:
        m = th.metrics(c)
        # pair (src p1 -> dst d1): we are the receiver
        d1 = c.addressable_devices()[1]
        p1 = th.device_ids(c, 1)[1]
        mine = plugin_keys(server, f".d{p1}-{d1.id()}/")
        assert m["retained_keys"] > 0, m
        assert m["retained_keys"] == len(mine), (m, mine)
        assert m["keys_outstanding"] == m["retained_keys"], m
    assert m["bytes_received"] == total and m["bytes_sent"] == total, m
    peer_m = json.loads(job.ch.get("metrics"))
    assert peer_m["bytes_received"] == total and peer_m["bytes_sent"] == total, peer_m
    job.finish()


def test_v1_descriptors_relayed_by_the_test_both_directions(xh, job_factory, server):
    job = job_factory("v1")
    c = job.client
    d0 = c.addressable_devices()[0]
    specs = peer.V1_SPECS
    # 1) node 1 sends into our v1 receive buffers.
    r = xh.make_receive(c, d0, specs)
    assert r.notified.count() == 1
    job.ch.put_list("v1/desc0", r.descriptors)
    for i, (b, s) in enumerate(zip(r.buffers, specs)):
        th.expect_ok(th.buffer_status(b), f"v1 buffer {i}")
        th.assert_same_bytes(th.read_back(b, s), th.make_data(s, peer.V1_SEED_1 + i), f"buf {i}")
    job.result("v1send")
    # 2) we send into node 1's buffers.
    descs = job.ch.get_list("v1/desc1")
    datas = [th.make_data(s, peer.V1_SEED_0 + i) for i, s in enumerate(specs)]
    srcs = [th.upload(c, d0, s, d) for s, d in zip(specs, datas)]
    sends = [xh.copy_to_remote(b, d) for b, d in zip(srcs, descs)]
    for i, s in enumerate(sends):
        err, enqueued = s.wait()
        th.expect_ok(err, f"on_done {i}")
        assert enqueued
    job.result("v1")
    (m,) = th.wait_keys_retired(c)
    assert m["bytes_received"] == sum(s.nbytes for s in specs), m
    job.finish()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_sender_process_killed_before_sending_gives_deadline_exceeded(
    xh, job_factory, transport
):
    timeout_ms = 1500
    options = {"receive_timeout_ms": timeout_ms}
    if transport != "auto":
        options["transport"] = transport
    job = job_factory("idle", options=options)
    c = job.client
    d0 = c.addressable_devices()[0]
    s = th.spec(BT.F32, 1024)
    t0 = time.monotonic()
    bufs = xh.receive(c, d0, [s, s], th.device_ids(c, 1), [1, 2])
    job.kill()  # SIGKILL: the sender never sends, never says goodbye
    for i, b in enumerate(bufs):
        th.expect_code(th.buffer_status(b, timeout=10), EC.DEADLINE_EXCEEDED, f"buffer {i}")
    elapsed = time.monotonic() - t0
    assert timeout_ms / 1000 * 0.9 <= elapsed < timeout_ms / 1000 + 3, f"{elapsed:.2f}s"
    (m,) = th.wait_keys_retired(c)
    assert m["timeouts"] == 2, m
    # The client still works and is destroyed without hanging (close()).
    t1 = time.monotonic()
    job.close()
    assert time.monotonic() - t1 < 10


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_v2_both_directions_over_the_peer_store_leave_no_key_in_the_framework_store(
    xh, job_factory, server, transport
):
    options = {} if transport == "auto" else {"transport": transport}
    job = job_factory("v2", options=options, store="peer")
    c = job.client
    specs = peer.V2_SPECS
    job.exchange_v2(xh)
    (m,) = th.wait_keys_retired(c)
    # Receipt and descriptor of every buffer created and deleted for real...
    assert m["keys_created"] == 2 * len(specs), m
    assert m["keys_deleted"] == m["keys_created"] and m["retained_keys"] == 0, m
    # ...and none of them ever in the framework's store (the session's are).
    assert not plugin_keys(server), plugin_keys(server)
    assert server.keys(f"crosshost/session/{job.session}/"), server.keys("crosshost/")
    job.finish()


def test_a_killed_sender_fails_the_peer_store_receives_at_once_naming_it(xh, job_factory):
    timeout_ms = 60_000
    job = job_factory("idle", options={"receive_timeout_ms": timeout_ms}, store="peer")
    c = job.client
    s = th.spec(BT.F32, 1024)
    t0 = time.monotonic()
    bufs = xh.receive(c, c.addressable_devices()[0], [s, s], th.device_ids(c, 1), [1, 2])
    job.kill()  # SIGKILL: its control link closes with the process
    for i, b in enumerate(bufs):
        st = th.buffer_status(b, timeout=10)
        th.expect_code(st, EC.UNAVAILABLE, f"buffer {i}")
        assert "process 1" in str(st), st
    assert time.monotonic() - t0 < 5, "waited for the deadline instead of the closed link"
    (m,) = th.wait_keys_retired(c)
    assert m["timeouts"] == 0 and m["keys_outstanding"] == 0, m
    t1 = time.monotonic()
    job.close()
    assert time.monotonic() - t1 < 10


def test_a_killed_receiver_fails_the_peer_store_send_at_once_naming_it(xh, job_factory):
    job = job_factory("idle", options={"send_timeout_ms": 1000}, store="peer")
    c = job.client
    s = th.spec(BT.U8, 4096)
    src = th.upload(c, c.addressable_devices()[0], s, th.make_data(s, 3))
    t0 = time.monotonic()
    job.kill()
    (ev,) = xh.send(c, [src], [th.device_ids(c, 1)[0]], [9])
    # Its link closed: the send fails naming it, well before its timeout
    # would (issue 18; a receiver whose death went unnoticed would leave
    # the send DEADLINE_EXCEEDED at send_timeout_ms).
    st = th.wait_event(ev, timeout=10)
    th.expect_code(st, EC.UNAVAILABLE, "send event")
    assert "process 1" in str(st), st
    assert time.monotonic() - t0 < 5


def test_sends_past_max_pending_send_bytes_fail_at_once_and_their_bytes_come_back(xh, job_factory):
    # A receiver that never receives: each send holds its 1 MiB until the
    # bound, then the next fails at once (issue 18: a sender whose receiver
    # stopped grew to 21.9 GiB of waiting sends).
    mib = 1 << 20
    options = {"send_timeout_ms": 60_000, "max_pending_send_bytes": 3 * mib}
    job = job_factory("idle", options=options, store="peer")
    c = job.client
    s = th.spec(BT.U8, mib)
    src = th.upload(c, c.addressable_devices()[0], s, th.make_data(s, 5))
    dst = th.device_ids(c, 1)[0]
    held = [xh.send(c, [src], [dst], [k])[0] for k in range(3)]
    m = th.metrics(c)
    assert m["pending_send_bytes"] == 3 * mib and m["max_pending_send_bytes"] == 3 * mib, m
    t0 = time.monotonic()
    (over,) = xh.send(c, [src], [dst], [99])
    st = th.wait_event(over, timeout=5)
    th.expect_code(st, EC.RESOURCE_EXHAUSTED, "the send past the bound")
    assert f"max_pending_send_bytes = {3 * mib}" in str(st) and f"{mib}-byte send" in str(st), st
    assert time.monotonic() - t0 < 2, "the send past the bound waited"
    assert not any(ev.is_ready() for ev in held), "a send within the bound ended early"
    job.kill()
    for i, ev in enumerate(held):
        th.expect_code(th.wait_event(ev, timeout=10), EC.UNAVAILABLE, f"held send {i}")
    assert th.poll_until(lambda: th.metrics(c)["pending_send_bytes"] == 0), th.metrics(c)


def test_creation_without_the_peer_fails_within_session_timeout(api, server):
    kv = KvClient(server.address)
    cb = th.PjrtKvCallbacks(kv)
    opts = peer.client_options(0, 2, th.unique("lonely"), {"session_timeout_ms": 500})
    t0 = time.monotonic()
    with pytest.raises(pc.PjrtError) as e:
        (c,) = th.create_concurrently([lambda: cb.create_client(api, opts)], timeout=15)
        c.destroy()
    assert time.monotonic() - t0 < 10
    assert e.value.code == EC.DEADLINE_EXCEEDED, e.value
    kv.close()


def test_processes_that_disagree_on_kv_store_fail_creation_naming_the_option(api, server):
    # Node 0 would send descriptors over control links that node 1 never
    # opened: creation says so instead of leaving transfers to time out.
    session = th.unique("mixed-store")
    makers = []
    kvs = []
    for node, extra in ((0, {}), (1, {"kv_store": "callbacks"})):
        kv = KvClient(server.address)
        kvs.append(kv)
        cb = th.PjrtKvCallbacks(kv)
        opts = peer.client_options(node, 2, session, {"session_timeout_ms": 5000, **extra})
        makers.append(lambda cb=cb, opts=opts: cb.create_client(api, opts))
    with pytest.raises(pc.PjrtError) as e:
        th.create_concurrently(makers, timeout=15)
    assert e.value.code == EC.FAILED_PRECONDITION, e.value
    assert "kv_store" in e.value.message and "process 1" in e.value.message, e.value
    for kv in kvs:
        kv.close()


def test_multi_node_without_kv_callbacks_or_store_is_invalid_argument(api):
    with pytest.raises(pc.PjrtError) as e:
        api.create_client({"num_nodes": 2, "node_id": 0, "session": th.unique("x")})
    assert e.value.code == EC.INVALID_ARGUMENT


def test_receiver_process_killed_gives_the_sender_deadline_exceeded(xh, job_factory):
    job = job_factory("idle", options={"send_timeout_ms": 1000})
    c = job.client
    s = th.spec(BT.U8, 4096)
    src = th.upload(c, c.addressable_devices()[0], s, th.make_data(s, 3))
    t0 = time.monotonic()
    job.kill()
    (ev,) = xh.send(c, [src], [th.device_ids(c, 1)[0]], [9])
    th.expect_code(th.wait_event(ev, timeout=10), EC.DEADLINE_EXCEEDED, "send event")
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("watchdog", [False, True], ids=["segment-kept", "watchdog"])
def test_a_send_into_a_killed_receivers_shared_memory_is_unavailable_not_ok(
    xh, job_factory, server, watchdog
):
    """Issue 11 item 4: the receiver posted its receive (its descriptor is in
    the framework's store, which outlives it), then died. The sender's
    receipt would land in a store nobody reads: the send must fail, naming
    the receiver, instead of reporting OK. With the watchdog off the
    receiver's segment is still in /dev/shm, so the bytes are copied first;
    with it on, the segment may already be gone."""
    env = {"PJRT_CROSSHOST_SHM_WATCHDOG": "1" if watchdog else "0"}
    job = job_factory("receive_then_idle", options={"send_timeout_ms": 3000}, env=env)
    receiver = job.proc.pid
    c = job.client
    try:
        job.ch.get("posted", 30)
        pattern = f"/{peer.DOOMED_KEY}/0"
        published = th.poll_until(
            lambda: [k for k in plugin_keys(server, pattern) if k.startswith("crosshost/desc/")],
            timeout=10,
        )
        assert published, server.keys("crosshost/")
        made = receiver_segments(receiver)
        job.kill()  # SIGKILL after posting: no destroy, no goodbye
        s = peer.DOOMED_SPEC
        src = th.upload(c, c.addressable_devices()[0], s, th.make_data(s, 5))
        t0 = time.monotonic()
        (ev,) = xh.send(c, [src], [th.device_ids(c, 1)[0]], [peer.DOOMED_KEY])
        st = th.wait_event(ev, timeout=10)
        elapsed = time.monotonic() - t0
        th.expect_code(st, EC.UNAVAILABLE, "send into a dead receiver")
        assert f"pid {receiver}" in str(st), st
        assert elapsed < 3 + 2, f"{elapsed:.2f}s"
        # No receipt was written for the dead receiver.
        receipts = [k for k in plugin_keys(server, pattern) if k.startswith("crosshost/recv/")]
        assert not receipts, receipts
        assert made, f"receiver {receiver} had no shared memory: {sorted(os.listdir('/dev/shm'))}"
    finally:
        for name in receiver_segments(receiver):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass


def test_a_receivers_segment_truncated_under_the_senders_mapping_fails_that_send_only(
    xh, job_factory
):
    """Issue 17: a process of the same user ftruncates the receiver's
    shared memory after the sender mapped it (the first transfer). The
    sender's next copy into it used to die of SIGBUS (rc -7); now that send
    fails DATA_LOSS naming the segment, the receiver is told, and the
    sender's process goes on: a later transfer into another process's fresh
    memory passes."""
    job = job_factory("receive_thrice")
    receiver = job.proc.pid
    c = job.client
    s = peer.SHRINK_SPEC
    d0 = c.addressable_devices()[0]
    dst = [th.device_ids(c, 1)[0]]
    (ev,) = xh.send(c, [th.upload(c, d0, s, th.make_data(s, 1))], dst, [1])
    th.expect_ok(th.wait_event(ev), "first send")
    job.ch.get("first_done", 30)
    job.ch.get("posted2", 30)
    segments = receiver_segments(receiver)
    assert segments, sorted(os.listdir("/dev/shm"))
    for name in segments:
        os.truncate(os.path.join("/dev/shm", name), 0)
    (ev,) = xh.send(c, [th.upload(c, d0, s, th.make_data(s, 2))], dst, [2])
    st = th.wait_event(ev)
    th.expect_code(st, EC.DATA_LOSS, "send into a truncated segment")
    assert "shrank under the copy" in str(st) and segments[0] in str(st), st
    try:
        outcome = job.ch.get("outcome2", 30).decode()
    except TimeoutError:
        raise AssertionError(f"receiver rc={job.proc.poll()}: {job.child_stderr()}") from None
    assert outcome.startswith("DATA_LOSS"), outcome
    # Both processes live on: the receiver's pool leaves the truncated
    # segment alone, and the next transfer lands in fresh memory.
    (ev,) = xh.send(c, [th.upload(c, d0, s, th.make_data(s, 3))], dst, [3])
    th.expect_ok(th.wait_event(ev), "send after the fault")
    job.result("receive_thrice")
    job.finish()


def receiver_segments(pid: int) -> list[str]:
    """The /dev/shm objects process ``pid`` created
    (``crosshost-<pid namespace>-<pid>-<start time>-<hex>``)."""
    return [
        n
        for n in os.listdir("/dev/shm")
        if n.startswith("crosshost-") and n.split("-")[2:3] == [str(pid)]
    ]


def test_stale_or_foreign_receipts_never_complete_a_buffer(xh, job_factory, server):
    """DESIGN §3 rule 6: a value at the completion key whose nonce does not
    match (a receipt from an earlier job or a forger) is rejected and
    counted; the real sender's receipt still completes the buffer."""
    job = job_factory("send_on_go")
    c = job.client
    d0 = c.addressable_devices()[0]
    p0 = th.device_ids(c, 1)[0]  # the peer's sending device
    s = peer.STALE_SPEC
    (buf,) = xh.receive(c, d0, [s], [p0], [1])
    epoch = server.keys(f"crosshost/session/{job.session}/epoch")
    assert epoch, server.keys("crosshost/")
    # The record is "<epoch> <control-link secret> <written ms>"; keys carry the epoch.
    epoch = job.kv.try_get(epoch[0]).decode().split()[0]
    pair = f"{epoch}.d{p0}-{d0.id()}"
    key = f"crosshost/recv/{pair}/1/0"
    # The descriptor is published off the receiving thread: wait for it.
    published = th.poll_until(
        lambda: any(k.startswith("crosshost/desc/") for k in plugin_keys(server, f"{pair}/1/0")),
        timeout=10,
    )
    assert published, (key, server.keys("crosshost/"))
    before = th.metrics(c)["stale_receipts_rejected"]
    for forged in (b"xr1 ok 123456789abcdef", b"xr1 err 42 13 forged failure", b"xr1 cancel 7"):
        assert job.kv.put(key, forged) is None
        got = th.poll_until(
            lambda: th.metrics(c)["stale_receipts_rejected"] > before, timeout=5
        )
        assert got, f"forged receipt {forged!r} not counted as stale: {th.metrics(c)}"
        before = th.metrics(c)["stale_receipts_rejected"]
        assert not th.is_buffer_ready(buf), f"forged receipt {forged!r} completed the buffer"
    job.ch.put("go", b"1")
    th.expect_ok(th.buffer_status(buf), "buffer after the real send")
    th.assert_same_bytes(th.read_back(buf, s), th.make_data(s, peer.STALE_SEED), "stale test")
    job.result("send_on_go")
    th.wait_keys_retired(c)
    assert th.poll_until(lambda: not plugin_keys(server, f"{pair}/"), 5), plugin_keys(server)
    job.finish()


def test_failed_deletes_keep_the_transfer_status_and_are_counted(xh, job_factory, server):
    """DESIGN §3 / §7 delete failure: the buffer's status is what the
    transfer decided (OK, right bytes); the failed deletes are counted and
    the keys stay in the store."""
    job = job_factory("send_on_go")
    c = job.client
    s = peer.STALE_SPEC
    d0 = c.addressable_devices()[0]
    p0 = th.device_ids(c, 1)[0]  # the peer's sending device
    (buf,) = xh.receive(c, d0, [s], [p0], [1])
    server.fail_ops = {"D"}
    try:
        job.ch.put("go", b"1")
        th.expect_ok(th.buffer_status(buf), "buffer with failing deletes")
        th.assert_same_bytes(th.read_back(buf, s), th.make_data(s, peer.STALE_SEED), "bytes")
        job.result("send_on_go")
        m = th.poll_until(
            lambda: (lambda m: m if m["delete_failures"] >= 2 else None)(th.metrics(c)), 5
        ) or th.metrics(c)
        assert m["delete_failures"] == 2, m  # completion key + descriptor key
        assert m["keys_deleted"] == 0 and m["keys_outstanding"] == 2, m
        assert len(plugin_keys(server, f".d{p0}-{d0.id()}/1/0")) == 2, server.keys("crosshost/")
        th.expect_ok(th.buffer_status(buf), "status unchanged after the failed deletes")
    finally:
        server.fail_ops = set()
    job.finish()


@pytest.mark.isolated
def test_a_store_that_fails_every_read_still_ends_the_receive_by_its_deadline(xh, job_factory, server):
    timeout_ms = 1000
    job = job_factory("idle", options={"receive_timeout_ms": timeout_ms})
    c = job.client
    s = th.spec(BT.F32, 16)
    server.fail_ops = {"G", "T"}
    try:
        t0 = time.monotonic()
        (buf,) = xh.receive(c, c.addressable_devices()[0], [s], [th.device_ids(c, 1)[0]], [1])
        st = th.buffer_status(buf, timeout=10)
        elapsed = time.monotonic() - t0
        assert st is not None, "receive succeeded with no sender and a failing store"
        assert st.code in (EC.DEADLINE_EXCEEDED, EC.UNAVAILABLE), st
        assert elapsed < timeout_ms / 1000 + 3, f"{elapsed:.2f}s"
    finally:
        server.fail_ops = set()
    th.wait_keys_retired(c)
