"""v1 cross-host transfers (MakeCrossHostReceiveBuffers + notifier,
CopyToRemoteDevice + on_done, the cancel notifier) between two clients of
one 2-node job inside this process; ``auto`` and ``tcp`` transports.

The descriptors travel the way JAX moves them: the receiver's notifier hands
them to the test (copied during the call), the test gives them to the
sender's CopyToRemoteDevice — directly (event NULL) or later through a
PJRT_Event_Create event that is PJRT_Event_Set once the descriptor is
written (JAX's v1 fallback).
"""

from __future__ import annotations

import ctypes

import time
import zlib

import pytest

import pjrt_ctypes as pc
import transfer_helpers as th
from transfer_helpers import spec

BT = pc.BufferType
EC = pc.ErrorCode


def sources(c0, specs, seed):
    dev = c0.addressable_devices()[0]
    datas = [th.make_data(s, seed + i) for i, s in enumerate(specs)]
    return [th.upload(c0, dev, s, d) for s, d in zip(specs, datas)], datas


def receive(xh, c1, specs, **kw):
    return xh.make_receive(c1, c1.addressable_devices()[0], specs, **kw)


def expect_sent(send, what=""):
    err, enqueued = send.wait()
    th.expect_ok(err, f"on_done {what}")
    assert enqueued, f"on_done {what}: sends_were_enqueued false on success"
    time.sleep(0)  # let a (wrong) second call show up before counting
    assert send.done.count() == 1, f"on_done {what} called {send.done.count()} times"


def check_received(r, specs, datas, which=None):
    for i in which if which is not None else range(len(specs)):
        b = r.buffers[i]
        th.expect_ok(th.buffer_status(b), f"receive buffer {i}")
        assert b.dims() == specs[i].dims
        th.assert_same_bytes(th.read_back(b, specs[i]), datas[i], f"buffer {i}")


# ----------------------------------------------------------------------------


def test_v1_notifier_called_once_before_return_with_one_descriptor_per_buffer(xh, auto_pair):
    _, c1 = auto_pair
    specs = [spec(BT.F32, 3), spec(BT.U8, 0), spec(BT.S64)]
    r = receive(xh, c1, specs)
    assert r.notified.count() == 1, "notifier not called exactly once before returning"
    err, n = r.notified.calls[0]
    assert not err and n == 3
    assert r.num_buffers == 3 and len(r.buffers) == 3
    assert len(r.descriptors) == 3 and all(len(d) > 0 for d in r.descriptors)
    assert len(set(r.descriptors)) == 3, "descriptors of different buffers are identical"
    assert r.cancel_fn and r.cancel_arg is not None
    for b, s in zip(r.buffers, specs):
        assert b.dims() == s.dims and b.element_type() == s.type
        assert b.device() == c1.addressable_devices()[0]
    time.sleep(0.05)
    assert not any(th.is_buffer_ready(b) for b in r.buffers), "ready before any send"
    for d in r.descriptors:  # leave nothing pending
        assert r.cancel(d).wait() is None


def test_v1_without_allow_cancel_the_cancel_notifier_is_null(xh, auto_pair):
    _, c1 = auto_pair
    r = receive(xh, c1, [spec(BT.F32, 2)], allow_cancel=False)
    assert r.notified.count() == 1
    assert not r.cancel_fn and not r.cancel_arg
    # 104-byte callers (no allow_cancel_notifier field): no cancel notifier either.
    r2 = receive(xh, c1, [spec(BT.F32, 2)], allow_cancel=True, struct_size=104)
    assert r2.notified.count() == 1 and not r2.cancel_fn


def test_v1_copy_to_remote_with_null_event(xh, pair):
    c0, c1 = pair
    specs = [spec(BT.F32, 128, 3)]
    srcs, datas = sources(c0, specs, 1)
    r = receive(xh, c1, specs)
    send = xh.copy_to_remote(srcs[0], r.descriptors[0])
    expect_sent(send)
    assert send.destructed.count() == 1, "descriptor_destructor not called exactly once"
    check_received(r, specs, datas)
    th.wait_keys_retired(c1)


@pytest.mark.parametrize("with_event", [False, True])
def test_v1_copy_to_remote_v6_with_a_null_destructor_frees_nothing(xh, pair, with_event):
    """A v6-sized args struct whose descriptor_destructor is NULL: nothing is
    the plugin's to free (the pointers are Python's here; C++ delete on them
    aborted the process). The copy goes through and the cells stay intact."""
    c0, c1 = pair
    specs = [spec(BT.F32, 64)]
    srcs, datas = sources(c0, specs, 4)
    r = receive(xh, c1, specs)
    if with_event:
        send = xh.copy_to_remote(srcs[0], None, event=c0.api.create_event(), with_destructor=False)
        send.provide(r.descriptors[0])
    else:
        send = xh.copy_to_remote(srcs[0], r.descriptors[0], with_destructor=False)
    expect_sent(send)
    assert send.destructed.count() == 0
    assert send.desc_size.value == len(r.descriptors[0]), "the caller's size cell changed"
    assert ctypes.string_at(send.desc_ptr.value, send.desc_size.value) == r.descriptors[0]
    check_received(r, specs, datas)
    th.wait_keys_retired(c1)


@pytest.mark.isolated
@pytest.mark.parametrize("outcome", ["ok", "error"])
def test_v1_copy_to_remote_with_an_event_set_after_the_descriptor_arrived(xh, pair, outcome):
    """JAX's v1 path: PJRT_Event_Create, CopyToRemoteDevice(event), write
    the descriptor, PJRT_Event_Set. With an error set instead, nothing is
    sent and on_done reports it."""
    c0, c1 = pair
    specs = [spec(BT.S32, 1000)]
    srcs, datas = sources(c0, specs, 2)
    r = receive(xh, c1, specs)
    ev = c0.api.create_event()  # ownership passes to the plugin
    send = xh.copy_to_remote(srcs[0], None, event=ev)
    time.sleep(0.05)
    assert send.done.count() == 0, f"on_done before the event was set: {send.done.calls}"
    if outcome == "ok":
        send.provide(r.descriptors[0])
        expect_sent(send)
        check_received(r, specs, datas)
    else:
        send.provide(None, EC.ABORTED, "descriptor never came")
        err, enqueued = send.wait()
        th.expect_code(err, EC.ABORTED, "on_done")
        assert not enqueued
        assert not th.is_buffer_ready(r.buffers[0])
        assert r.cancel(r.descriptors[0]).wait() is None


def test_v1_multi_buffer_mixed_dtypes(xh, pair):
    c0, c1 = pair
    specs = [spec(BT.F64, 7, 7), spec(BT.U8, 0), spec(BT.S32), spec(BT.BF16, 300), spec(BT.PRED, 9)]
    srcs, datas = sources(c0, specs, 30)
    r = receive(xh, c1, specs)
    sends = [xh.copy_to_remote(b, d) for b, d in zip(srcs, r.descriptors)]
    for i, s in enumerate(sends):
        expect_sent(s, str(i))
    check_received(r, specs, datas)
    m1 = th.wait_keys_retired(c1)[0]
    assert m1["bytes_received"] == sum(s.nbytes for s in specs), m1


def test_v1_partial_cancel_fails_only_the_cancelled_buffers_with_the_reason(xh, pair):
    c0, c1 = pair
    specs = [spec(BT.F32, 16) for _ in range(4)]
    srcs, datas = sources(c0, specs, 50)
    r = receive(xh, c1, specs)
    done1 = r.cancel(r.descriptors[1], EC.ABORTED, "peer went away")
    done3 = r.cancel(r.descriptors[3], EC.UNAVAILABLE, "link down")
    assert done1.wait() is None and done3.wait() is None
    for i, code, msg in [(1, EC.ABORTED, "peer went away"), (3, EC.UNAVAILABLE, "link down")]:
        st = th.buffer_status(r.buffers[i])
        th.expect_code(st, code, f"cancelled buffer {i}")
        assert msg in st.message, st
    assert not th.is_buffer_ready(r.buffers[0]) and not th.is_buffer_ready(r.buffers[2])
    sends = [xh.copy_to_remote(srcs[i], r.descriptors[i]) for i in (0, 2)]
    for s in sends:
        expect_sent(s)
    check_received(r, specs, datas, which=[0, 2])
    m1 = th.wait_keys_retired(c1)[0]
    assert m1["cancellations"] == 2, m1
    time.sleep(0.05)
    assert done1.count() == 1 and done3.count() == 1, "on_canceled not exactly once"


def test_v1_full_cancel_fails_every_buffer(xh, pair):
    _, c1 = pair
    specs = [spec(BT.U8, 5), spec(BT.S16, 0), spec(BT.C64, 2)]
    r = receive(xh, c1, specs)
    dones = [r.cancel(d, EC.CANCELLED, f"stop {i}") for i, d in enumerate(r.descriptors)]
    for i, d in enumerate(dones):
        assert d.wait() is None
    for i, b in enumerate(r.buffers):
        st = th.buffer_status(b)
        th.expect_code(st, EC.CANCELLED, f"buffer {i}")
        assert f"stop {i}" in st.message
    m1 = th.wait_keys_retired(c1)[0]
    assert m1["cancellations"] == 3, m1
    time.sleep(0.05)
    assert [d.count() for d in dones] == [1, 1, 1]


def test_v1_cancel_of_a_finished_or_already_cancelled_buffer_is_not_found(xh, auto_pair):
    c0, c1 = auto_pair
    specs = [spec(BT.F32, 4), spec(BT.F32, 4)]
    srcs, datas = sources(c0, specs, 60)
    r = receive(xh, c1, specs)
    expect_sent(xh.copy_to_remote(srcs[0], r.descriptors[0]))
    check_received(r, specs, datas, which=[0])
    th.expect_code(r.cancel(r.descriptors[0]).wait(), EC.NOT_FOUND, "cancel after completion")
    assert r.cancel(r.descriptors[1]).wait() is None
    th.expect_code(r.cancel(r.descriptors[1]).wait(), EC.NOT_FOUND, "second cancel")
    # The completed buffer keeps its bytes and status.
    check_received(r, specs, datas, which=[0])
    th.expect_code(th.buffer_status(r.buffers[1]), EC.CANCELLED, "cancelled buffer")


@pytest.mark.isolated
def test_v1_cancel_of_a_forged_descriptor_reports_an_error_and_touches_nothing(xh, auto_pair):
    c0, c1 = auto_pair
    specs = [spec(BT.S32, 32)]
    srcs, datas = sources(c0, specs, 70)
    r = receive(xh, c1, specs)
    d = r.descriptors[0]
    flipped = bytearray(d)
    flipped[len(d) // 2] ^= 0x40
    for forged in (b"", b"garbage", d[: len(d) // 2], bytes(flipped), d + b"x"):
        done = r.cancel(forged)
        err = done.wait()
        assert err is not None, f"cancel of forged descriptor {forged[:16]!r}... succeeded"
        assert err.code in (EC.INVALID_ARGUMENT, EC.NOT_FOUND, EC.DATA_LOSS), err
        time.sleep(0.01)
        assert done.count() == 1
    assert not th.is_buffer_ready(r.buffers[0]), "a forged cancel touched the real buffer"
    expect_sent(xh.copy_to_remote(srcs[0], d))
    check_received(r, specs, datas)


@pytest.mark.isolated
def test_v1_forged_or_truncated_descriptor_to_copy_to_remote_is_invalid_argument(xh, pair):
    c0, c1 = pair
    specs = [spec(BT.F32, 64)]
    srcs, datas = sources(c0, specs, 80)
    r = receive(xh, c1, specs)
    d = r.descriptors[0]
    flipped = bytearray(d)
    flipped[len(d) // 3] ^= 0x01
    forgeries = {
        "empty": b"",
        "garbage": b"\x00" * 7 + b"not a descriptor" * 4,
        "truncated-half": d[: len(d) // 2],
        "truncated-1": d[:-1],
        "bit-flip": bytes(flipped),
        "trailing-byte": d + b"\x00",
    }
    for name, forged in forgeries.items():
        send = xh.copy_to_remote(srcs[0], forged)
        err, enqueued = send.wait()
        th.expect_code(err, EC.INVALID_ARGUMENT, f"on_done for {name} descriptor")
        assert not enqueued, name
        time.sleep(0.005)
        assert send.done.count() == 1, f"{name}: on_done called {send.done.count()} times"
    assert not th.is_buffer_ready(r.buffers[0]), "a forged descriptor completed the buffer"
    expect_sent(xh.copy_to_remote(srcs[0], d))
    check_received(r, specs, datas)


def test_v1_size_mismatch_fails_the_send_and_the_receive_buffer(xh, pair):
    c0, c1 = pair
    r = receive(xh, c1, [spec(BT.F32, 8)])
    big = spec(BT.F32, 9)
    srcs, _ = sources(c0, [big], 90)
    send = xh.copy_to_remote(srcs[0], r.descriptors[0])
    err, _ = send.wait()
    th.expect_code(err, EC.INVALID_ARGUMENT, "on_done")
    th.expect_code(th.buffer_status(r.buffers[0]), EC.INVALID_ARGUMENT, "receive buffer")
    th.wait_keys_retired(c1)


def test_v1_send_to_a_cancelled_buffer_does_not_revive_it(xh, pair):
    c0, c1 = pair
    specs = [spec(BT.S8, 100)]
    srcs, _ = sources(c0, specs, 95)
    r = receive(xh, c1, specs)
    assert r.cancel(r.descriptors[0], EC.ABORTED, "gone").wait() is None
    th.expect_code(th.buffer_status(r.buffers[0]), EC.ABORTED, "cancelled")
    send = xh.copy_to_remote(srcs[0], r.descriptors[0])
    send.wait()  # either outcome is acceptable for the sender...
    time.sleep(0.02)
    assert send.done.count() == 1
    st = th.buffer_status(r.buffers[0])  # ...but the receiver stays cancelled
    th.expect_code(st, EC.ABORTED, "cancelled buffer after a late send")
    th.wait_keys_retired(c1)


def test_v1_receive_without_sender_times_out(api, xh):
    c0, c1 = th.make_pair(api, receive_timeout_ms=300)
    try:
        r = receive(xh, c1, [spec(BT.F32, 4)])
        th.expect_code(th.buffer_status(r.buffers[0], timeout=5), EC.DEADLINE_EXCEEDED, "v1")
        m1 = th.wait_keys_retired(c1)[0]
        assert m1["timeouts"] == 1, m1
        th.expect_code(r.cancel(r.descriptors[0]).wait(), EC.NOT_FOUND, "cancel after timeout")
    finally:
        c1.destroy()
        c0.destroy()


@pytest.mark.isolated
def test_v1_descriptor_event_never_set_ends_in_deadline_exceeded_not_never(xh, api):
    """A caller that hands CopyToRemoteDevice an event and never sets it gets
    on_done(DEADLINE_EXCEEDED, sends_were_enqueued=false) once the sending
    client's send timeout passed: the wait is bounded."""
    c0, c1 = th.make_pair(api, send_timeout_ms=300)
    try:
        specs = [spec(BT.S32, 16)]
        srcs, _ = sources(c0, specs, 3)
        r = receive(xh, c1, specs)
        send = xh.copy_to_remote(srcs[0], None, event=c0.api.create_event())
        err, enqueued = send.wait()
        th.expect_code(err, EC.DEADLINE_EXCEEDED, "on_done")
        assert not enqueued
        assert send.done.count() == 1
        assert not th.is_buffer_ready(r.buffers[0])
        assert r.cancel(r.descriptors[0]).wait() is None
    finally:
        c1.destroy()
        c0.destroy()


def forged_descriptor(d: bytes, shift: int = 0, length: int | None = None) -> bytes:
    """A hostile peer's forgery: a real descriptor of a 1-D u8 destination
    whose offset moved ``shift`` bytes and, with ``length``, whose size
    (byte_size and the one dim) changed, with a valid checksum (zlib crc32,
    the last four bytes). Layout: magic, version, kind, flags, total length
    (12 bytes), hostname, boot id (u16 length + bytes each), pid (u32),
    allocation (u16 length + bytes), offset u64, byte_size u64, element
    type u32, rank u16, dims i64..."""
    body = bytearray(d[:-4])
    at = 12
    for _ in range(2):
        at += 2 + int.from_bytes(body[at:at + 2], "little")
    at += 4
    at += 2 + int.from_bytes(body[at:at + 2], "little")
    offset = int.from_bytes(body[at:at + 8], "little")
    body[at:at + 8] = (offset + shift).to_bytes(8, "little")
    if length is not None:
        body[at + 8:at + 16] = length.to_bytes(8, "little")
        assert int.from_bytes(body[at + 20:at + 22], "little") == 1, "not a 1-D destination"
        body[at + 22:at + 30] = length.to_bytes(8, "little", signed=True)
    return bytes(body) + zlib.crc32(bytes(body)).to_bytes(4, "little")


@pytest.mark.isolated
def test_v1_a_descriptor_moved_inside_its_page_or_grown_is_refused_and_never_writes_the_neighbour(
    xh, auto_pair
):
    # Two shared-memory destinations side by side; the second is complete
    # when forgeries of the first, reaching into it, arrive.
    c0, c1 = auto_pair
    specs = [spec(BT.U8, 4096), spec(BT.U8, 4096)]
    srcs, datas = sources(c0, specs, 90)
    big = spec(BT.U8, 8192)
    big_src = th.upload(c0, c0.addressable_devices()[0], big, th.make_data(big, 99))
    r = receive(xh, c1, specs)
    expect_sent(xh.copy_to_remote(srcs[1], r.descriptors[1]))
    check_received(r, specs, datas, which=[1])
    forgeries = [(f"moved by {n}", srcs[0], forged_descriptor(r.descriptors[0], shift=n))
                 for n in (1, 8, 4088)]
    forgeries.append(("grown to 8 KiB", big_src, forged_descriptor(r.descriptors[0], length=8192)))
    for name, src, forged in forgeries:
        err, _ = xh.copy_to_remote(src, forged).wait()
        assert err is not None, f"a descriptor {name} was accepted"
        assert err.code in (EC.INVALID_ARGUMENT, EC.FAILED_PRECONDITION), (name, err)
        check_received(r, specs, datas, which=[1])  # the neighbour is intact
        assert not th.is_buffer_ready(r.buffers[0]), f"{name}: the buffer completed"
    # The real descriptor still works: the forgeries claimed nothing.
    expect_sent(xh.copy_to_remote(srcs[0], r.descriptors[0]))
    check_received(r, specs, datas)
