"""Lifecycle edges of cross-host transfers inside one process: buffers or
clients going away mid-transfer, errors read back from failed buffers,
many transfers (zero keys left), concurrent senders, cancel-vs-send races
(exactly one terminal outcome per buffer), a large TCP transfer.

Tests that may crash the plugin are ``isolated`` (run in a child pytest).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import pjrt_ctypes as pc
import transfer_helpers as th
from transfer_helpers import spec

BT = pc.BufferType
EC = pc.ErrorCode


def upload0(c0, s, seed):
    d = th.make_data(s, seed)
    return th.upload(c0, c0.addressable_devices()[0], s, d), d


def src_id(c):
    """Global id of node 0's first device (where upload0 puts the sources);
    taken from the client because the numbering depends on the plugin's mode."""
    return th.device_ids(c, 0)[0]


def dst_id(c):
    """Global id of node 1's first device (c1.addressable_devices()[0])."""
    return th.device_ids(c, 1)[0]


@pytest.mark.isolated
def test_receive_buffer_destroyed_before_the_send_is_harmless(xh, pair):
    c0, c1 = pair
    s = spec(BT.F32, 4096)
    src, _ = upload0(c0, s, 1)
    (buf,) = xh.receive(c1, c1.addressable_devices()[0], [s], [src_id(c1)], [1])
    buf.destroy()
    (ev,) = xh.send(c0, [src], [dst_id(c0)], [1])
    th.wait_event(ev)  # OK or an error: bounded, and no crash
    th.wait_keys_retired(c1)
    # Both clients still work.
    src2, d2 = upload0(c0, s, 2)
    (b2,) = xh.receive(c1, c1.addressable_devices()[0], [s], [src_id(c1)], [2])
    (e2,) = xh.send(c0, [src2], [dst_id(c0)], [2])
    th.expect_ok(th.wait_event(e2))
    th.expect_ok(th.buffer_status(b2))
    th.assert_same_bytes(th.read_back(b2, s), d2)


@pytest.mark.isolated
def test_buffer_delete_on_a_pending_receive_then_send_is_harmless(xh, pair):
    c0, c1 = pair
    s = spec(BT.S16, 999)
    src, _ = upload0(c0, s, 3)
    (buf,) = xh.receive(c1, c1.addressable_devices()[0], [s], [src_id(c1)], [4])
    buf.delete()
    assert buf.is_deleted()
    (ev,) = xh.send(c0, [src], [dst_id(c0)], [4])
    th.wait_event(ev)
    th.wait_keys_retired(c1)


@pytest.mark.isolated
def test_receiver_client_destroyed_with_pending_receives_does_not_hang(api, xh):
    c0, c1 = th.make_pair(api, send_timeout_ms=1000)
    try:
        s = spec(BT.U8, 10000)
        src, _ = upload0(c0, s, 4)
        dst = dst_id(c0)  # before c1 goes away (c0 knows it either way)
        xh.receive(c1, c1.addressable_devices()[0], [s, s], [src_id(c1)] * 2, [1, 2])
        t0 = time.monotonic()
        c1.destroy()
        assert time.monotonic() - t0 < 5, "client destroy blocked on pending receives"
        evs = xh.send(c0, [src, src], [dst, dst], [1, 2])
        for e in evs:
            th.wait_event(e, timeout=10)  # bounded by send_timeout; any status
    finally:
        c1.destroy()
        c0.destroy()


def test_a_failed_buffer_reports_its_error_on_read(xh, pair):
    c0, c1 = pair
    r = xh.make_receive(c1, c1.addressable_devices()[0], [spec(BT.F32, 8)])
    assert r.cancel(r.descriptors[0], EC.ABORTED, "nope").wait() is None
    with pytest.raises(pc.PjrtError) as e:
        r.buffers[0].to_host_bytes(32)
    assert e.value.code == EC.ABORTED


def test_many_sequential_transfers_leave_zero_keys(xh, pair):
    c0, c1 = pair
    s = spec(BT.S32, 16)
    src, d = upload0(c0, s, 5)
    r_dev = c1.addressable_devices()[0]
    n = 60
    for k in range(n):
        (b,) = xh.receive(c1, r_dev, [s], [src_id(c1)], [k])
        (e,) = xh.send(c0, [src], [r_dev.id()], [k])
        th.expect_ok(th.wait_event(e, destroy=False))
        th.expect_ok(th.buffer_status(b))
        th.assert_same_bytes(th.read_back(b, s), d, f"transfer {k}")
        b.destroy()
    m1, m0 = th.wait_keys_retired(c1, c0)
    assert m1["keys_created"] >= n and m1["keys_deleted"] == m1["keys_created"], m1
    assert m1["bytes_received"] == n * s.nbytes and m0["bytes_sent"] == n * s.nbytes


def test_concurrent_senders_and_receivers(xh, pair):
    c0, c1 = pair
    r_dev = c1.addressable_devices()[0]
    s_devs = c0.addressable_devices()
    threads_n, per = 4, 8
    failures = []
    results = {}

    def worker(t):
        try:
            specs = [spec(BT.F32, 100 + 37 * i + t) for i in range(per)]
            datas = [th.make_data(x, 1000 * t + i) for i, x in enumerate(specs)]
            dev = s_devs[t % 2]
            srcs = [th.upload(c0, dev, x, d) for x, d in zip(specs, datas)]
            keys = [10000 * (t + 1) + i for i in range(per)]
            if t % 2:
                evs = xh.send(c0, srcs, [r_dev.id()] * per, keys)
                bufs = xh.receive(c1, r_dev, specs, [dev.id()] * per, keys)
            else:
                bufs = xh.receive(c1, r_dev, specs, [dev.id()] * per, keys)
                evs = xh.send(c0, srcs, [r_dev.id()] * per, keys)
            results[t] = (bufs, evs, specs, datas)
        except BaseException as e:  # noqa: BLE001
            failures.append(e)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads_n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not failures, failures
    assert len(results) == threads_n
    for t, (bufs, evs, specs, datas) in results.items():
        for i, (b, e, x, d) in enumerate(zip(bufs, evs, specs, datas)):
            th.expect_ok(th.wait_event(e), f"thread {t} send {i}")
            th.expect_ok(th.buffer_status(b), f"thread {t} buffer {i}")
            th.assert_same_bytes(th.read_back(b, x), d, f"thread {t} buffer {i}")
    th.wait_keys_retired(c1)


def test_cancel_racing_send_gives_exactly_one_consistent_outcome_per_buffer(xh, pair):
    """DESIGN §3 rule 8: cancel and send race on every buffer; each buffer
    ends either OK with the sent bytes (and the cancel says NOT_FOUND) or
    with the cancel's reason (and the cancel says OK). on_done and
    on_canceled are each called exactly once.

    The sender's side of the contract (DESIGN §3, "v1 send racing a cancel"):
    a buffer the receiver kept was always reported sent (OK); a send that
    reports OK says its bytes and receipt reached the receiver, not that the
    receiver kept them: a cancel racing it may still win there, and the
    receiver's outcome is the one that counts."""
    c0, c1 = pair
    n = 24
    specs = [spec(BT.U8, 2048) for _ in range(n)]
    srcs = []
    datas = []
    for i, x in enumerate(specs):
        b, d = upload0(c0, x, 200 + i)
        srcs.append(b)
        datas.append(d)
    r = xh.make_receive(c1, c1.addressable_devices()[0], specs)
    sends = [None] * n
    cancels = [None] * n
    go = threading.Barrier(2)

    def do_sends():
        go.wait(5)
        for i in range(n):
            sends[i] = xh.copy_to_remote(srcs[i], r.descriptors[i])

    def do_cancels():
        go.wait(5)
        for i in range(n):
            cancels[i] = r.cancel(r.descriptors[i], EC.CANCELLED, f"race {i}")

    ts = [threading.Thread(target=do_sends), threading.Thread(target=do_cancels)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    outcomes = {"ok": 0, "cancelled": 0, "sent_then_discarded": 0}
    for i in range(n):
        send_err, _ = sends[i].wait()
        c_err = cancels[i].wait()
        st = th.buffer_status(r.buffers[i])
        if st is not None and send_err is None:
            outcomes["sent_then_discarded"] += 1
        if st is None:
            assert send_err is None, f"buffer {i} kept the bytes but its send said {send_err}"
            th.assert_same_bytes(th.read_back(r.buffers[i], specs[i]), datas[i], f"buffer {i}")
            th.expect_code(c_err, EC.NOT_FOUND, f"cancel of completed buffer {i}")
            outcomes["ok"] += 1
        else:
            th.expect_code(st, EC.CANCELLED, f"buffer {i}")
            assert f"race {i}" in st.message
            assert c_err is None, f"buffer {i} cancelled but on_canceled said {c_err}"
            outcomes["cancelled"] += 1
    time.sleep(0.05)
    for i in range(n):
        assert sends[i].done.count() == 1, f"on_done {i} x{sends[i].done.count()}"
        assert cancels[i].count() == 1, f"on_canceled {i} x{cancels[i].count()}"
    m1 = th.wait_keys_retired(c1)[0]
    assert m1["cancellations"] == outcomes["cancelled"], (m1, outcomes)


def test_large_buffer_over_tcp(api, xh):
    c0, c1 = th.make_pair(api, transport="tcp")
    try:
        s = spec(BT.U32, 8 * 1024 * 1024)  # 32 MiB
        src, d = upload0(c0, s, 9)
        (b,) = xh.receive(c1, c1.addressable_devices()[0], [s], [src_id(c1)], [1])
        (e,) = xh.send(c0, [src], [dst_id(c0)], [1])
        th.expect_ok(th.wait_event(e, timeout=30))
        th.expect_ok(th.buffer_status(b, timeout=30))
        th.assert_same_bytes(th.read_back(b, s), d, "32 MiB")
    finally:
        c1.destroy()
        c0.destroy()


def _one_winner(statuses, buf, s, sources, what):
    """Exactly one sender succeeded; the buffer holds exactly that sender's
    bytes, and they do not change after the buffer became ready."""
    th.expect_ok(th.buffer_status(buf), f"{what}: receive buffer")
    at_ready = th.read_back(buf, s).copy()
    time.sleep(0.2)
    later = th.read_back(buf, s)
    ok = [i for i, st in enumerate(statuses) if st is None]
    whole = [i for i, d in enumerate(sources) if np.array_equal(at_ready, d)]
    assert np.array_equal(at_ready, later), (
        f"{what}: the buffer's bytes changed after it was ready "
        f"(values at ready {np.unique(at_ready)}, later {np.unique(later)})"
    )
    assert whole, (
        f"{what}: the ready buffer is a mix of both sources "
        f"(values {np.unique(at_ready)}); sender statuses {statuses}"
    )
    assert ok == whole, (
        f"{what}: senders {ok} reported success for one destination; the buffer holds "
        f"sender {whole}'s bytes; statuses {statuses}"
    )


def test_v2_two_senders_on_one_transfer_key_do_not_both_write_the_destination(xh, pair):
    """A descriptor names one destination: one sender may fill it. A second
    send under the same key (a caller bug, or a retry) must fail without
    touching the buffer, which stays immutable once ready. (A race: three
    rounds, each on a fresh key.)"""
    c0, c1 = pair
    s = spec(BT.U8, 8 << 20)
    sources = [np.full(s.dims, v, np.uint8) for v in (1, 2)]
    dev = c0.addressable_devices()[0]
    srcs = [th.upload(c0, dev, s, d) for d in sources]
    for key in (5, 6, 7):
        evs = [xh.send(c0, [b], [dst_id(c0)], [key])[0] for b in srcs]
        (buf,) = xh.receive(c1, c1.addressable_devices()[0], [s], [dev.id()], [key])
        statuses = [th.wait_event(e) for e in evs]
        _one_winner(statuses, buf, s, sources, f"v2 duplicate senders, key {key}")
        buf.destroy()


def test_v1_one_descriptor_given_to_two_copies_fills_the_buffer_once(xh, pair):
    c0, c1 = pair
    s = spec(BT.U8, 8 << 20)
    sources = [np.full(s.dims, v, np.uint8) for v in (1, 2)]
    dev = c0.addressable_devices()[0]
    srcs = [th.upload(c0, dev, s, d) for d in sources]
    for round_ in range(3):
        r = xh.make_receive(c1, c1.addressable_devices()[0], [s])
        sends = [xh.copy_to_remote(b, r.descriptors[0]) for b in srcs]
        statuses = [snd.wait()[0] for snd in sends]
        _one_winner(statuses, r.buffers[0], s, sources, f"v1 duplicate descriptor, round {round_}")
        r.buffers[0].destroy()
