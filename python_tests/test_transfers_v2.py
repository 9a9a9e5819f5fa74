"""v2 cross-host transfers (CrossHostReceiveBuffers / CrossHostSendBuffers)
between two clients of one 2-node job inside this process.

Node 0 owns two global devices and node 1 two more; their ids depend on the
plugin's mode (0,1 / 2,3 with the host backend, 0,1 / 2048,2049 delegated to
a compute plugin), so the tests take them from the clients, never from
literals. Most tests run twice:
``auto`` (same host: shared memory / in-process copy) and ``tcp`` (the
"two hosts" path, forced with transport=tcp on both clients). Every byte of
every received buffer is compared with numpy; every wait is bounded.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import pjrt_ctypes as pc
import transfer_helpers as th
from transfer_helpers import WAIT, spec

BT = pc.BufferType
EC = pc.ErrorCode


def devs(c0, c1):
    """(node 0 device 0, node 1 device 0, node 1 device 1); each one's global
    id is ``.id()`` (th.device_ids order)."""
    a0 = c0.addressable_devices()
    a1 = c1.addressable_devices()
    return a0[0], a1[0], a1[1]


def transfer(xh, c0, c1, specs, keys, seed=0, receiver_first=True):
    """Sends ``specs`` from node 0 device 0 to node 1 device 0; returns
    (received buffers, send events, source arrays)."""
    s_dev, r_dev, _ = devs(c0, c1)
    datas = [th.make_data(s, seed + i) for i, s in enumerate(specs)]
    srcs = [th.upload(c0, s_dev, s, d) for s, d in zip(specs, datas)]
    src_ids = [s_dev.id()] * len(specs)
    dst_ids = [r_dev.id()] * len(specs)
    if receiver_first:
        bufs = xh.receive(c1, r_dev, specs, src_ids, keys)
        evs = xh.send(c0, srcs, dst_ids, keys)
    else:
        evs = xh.send(c0, srcs, dst_ids, keys)
        bufs = xh.receive(c1, r_dev, specs, src_ids, keys)
    return bufs, evs, datas


def check_all_arrived(bufs, evs, specs, datas):
    for i, (b, e, s, d) in enumerate(zip(bufs, evs, specs, datas)):
        th.expect_ok(th.wait_event(e), f"send event {i} ({s})")
        th.expect_ok(th.buffer_status(b), f"receive buffer {i} ({s})")
        assert b.dims() == s.dims, f"buffer {i}: dims {b.dims()} != {s.dims}"
        assert b.element_type() == s.type, f"buffer {i}: type {b.element_type()} != {s.type}"
        th.assert_same_bytes(th.read_back(b, s), d, f"buffer {i} ({s})")


# ----------------------------------------------------------------------------


def test_devices_are_global_and_the_peers_are_not_addressable(auto_pair):
    c0, c1 = auto_pair
    expected = th.expected_pair_ids()  # the numbering of the plugin's mode
    for me, c in enumerate((c0, c1)):
        ds = c.devices()
        assert [d.id() for d in ds] == expected
        for d in ds:
            owner = expected.index(d.id()) // 2  # two devices per node, in node order
            assert d.process_index() == owner
            assert d.is_addressable() == (owner == me)
        assert [d.id() for d in c.addressable_devices()] == expected[2 * me : 2 * me + 2]
        assert th.device_ids(c, me) == expected[2 * me : 2 * me + 2]
        assert c.process_index() == me


def test_v2_single_f32_buffer_arrives_byte_exact(xh, pair):
    c0, c1 = pair
    specs = [spec(BT.F32, 64, 33)]
    bufs, evs, datas = transfer(xh, c0, c1, specs, [11])
    check_all_arrived(bufs, evs, specs, datas)
    assert bufs[0].device() == c1.addressable_devices()[0]


MIXED = [
    spec(BT.F32, 17, 3),
    spec(BT.F64, 5),
    spec(BT.S8, 257),
    spec(BT.U8, 0),  # zero-sized
    spec(BT.S16, 2, 3, 4),
    spec(BT.U16, 1),
    spec(BT.S32),  # scalar
    spec(BT.U32, 9, 0, 2),  # zero-sized, rank 3
    spec(BT.S64, 31),
    spec(BT.U64, 4, 4),
    spec(BT.F16, 100),
    spec(BT.BF16, 3, 5),
    spec(BT.PRED, 13),
    spec(BT.C64, 7),
    spec(BT.C128, 2, 2),
    spec(BT.F32, 1 << 16),  # 256 KiB
]


def test_v2_batch_of_16_mixed_dtypes_shapes_zero_sized_and_scalar(xh, pair):
    c0, c1 = pair
    keys = list(range(100, 100 + len(MIXED)))
    bufs, evs, datas = transfer(xh, c0, c1, MIXED, keys, seed=7)
    check_all_arrived(bufs, evs, MIXED, datas)


def test_v2_batch_under_one_key_uses_buffer_index(xh, auto_pair):
    """Several buffers sharing one transfer key (JAX sends a whole array's
    shards under one key): they pair up by position."""
    c0, c1 = auto_pair
    specs = [spec(BT.S32, 10), spec(BT.S32, 10), spec(BT.F32, 3)]
    bufs, evs, datas = transfer(xh, c0, c1, specs, [42, 42, 42], seed=3)
    check_all_arrived(bufs, evs, specs, datas)


def test_v2_one_call_naming_both_peer_devices_pairs_each_buffer_with_its_own_device(xh, pair):
    """One receive call and one send call whose buffers alternate between
    the sender's two devices, all under one transfer key: each device pair
    has its own keys (its epoch names the devices), so the buffers pair up
    by position per device, never across devices."""
    c0, c1 = pair
    s_devs = c0.addressable_devices()
    r_dev = c1.addressable_devices()[0]
    specs = [spec(BT.S32, 10 + i) for i in range(6)]
    datas = [th.make_data(s, 40 + i) for i, s in enumerate(specs)]
    on = [s_devs[i % 2] for i in range(len(specs))]
    srcs = [th.upload(c0, d, s, x) for d, s, x in zip(on, specs, datas)]
    keys = [77] * len(specs)
    bufs = xh.receive(c1, r_dev, specs, [d.id() for d in on], keys)
    evs = xh.send(c0, srcs, [r_dev.id()] * len(specs), keys)
    check_all_arrived(bufs, evs, specs, datas)


@pytest.mark.parametrize("order", ["receiver_first", "sender_first"])
def test_v2_either_side_may_call_first(xh, pair, order):
    c0, c1 = pair
    s_dev, r_dev, _ = devs(c0, c1)
    specs = [spec(BT.F32, 1000), spec(BT.S8, 3)]
    datas = [th.make_data(s, 20 + i) for i, s in enumerate(specs)]
    srcs = [th.upload(c0, s_dev, s, d) for s, d in zip(specs, datas)]
    keys = [5, 6]
    src_ids, dst_ids = [s_dev.id()] * 2, [r_dev.id()] * 2
    if order == "receiver_first":
        bufs = xh.receive(c1, r_dev, specs, src_ids, keys)
        time.sleep(0.05)
        assert not any(th.is_buffer_ready(b) for b in bufs), "ready before any sender"
        evs = xh.send(c0, srcs, dst_ids, keys)
    else:
        evs = xh.send(c0, srcs, dst_ids, keys)
        time.sleep(0.05)
        assert not any(e.is_ready() for e in evs), "send completed before any receiver"
        bufs = xh.receive(c1, r_dev, specs, src_ids, keys)
    check_all_arrived(bufs, evs, specs, datas)


def test_v2_each_buffer_is_ready_on_its_own_send_not_gated_on_earlier_ones(xh, pair):
    """DESIGN §3 rule 1: buffer i ready when its own bytes arrived."""
    c0, c1 = pair
    s_dev, r_dev, _ = devs(c0, c1)
    specs = [spec(BT.S32, 8), spec(BT.S32, 8), spec(BT.S32, 8)]
    datas = [th.make_data(s, 40 + i) for i, s in enumerate(specs)]
    srcs = [th.upload(c0, s_dev, s, d) for s, d in zip(specs, datas)]
    keys = [301, 302, 303]
    bufs = xh.receive(c1, r_dev, specs, [s_dev.id()] * 3, keys)
    # Send the last one only: it completes while 0 and 1 stay pending.
    ev2 = xh.send(c0, [srcs[2]], [r_dev.id()], [303])[0]
    th.expect_ok(th.wait_event(ev2), "send 2")
    th.expect_ok(th.buffer_status(bufs[2]), "buffer 2")
    th.assert_same_bytes(th.read_back(bufs[2], specs[2]), datas[2], "buffer 2")
    assert not th.is_buffer_ready(bufs[0]) and not th.is_buffer_ready(bufs[1])
    evs = xh.send(c0, srcs[:2], [r_dev.id()] * 2, keys[:2])
    check_all_arrived(bufs[:2], evs, specs[:2], datas[:2])


def test_v2_received_buffer_copies_to_the_receivers_other_device(xh, pair):
    c0, c1 = pair
    _, r_dev, r_dev2 = devs(c0, c1)
    specs = [spec(BT.F64, 12, 12), spec(BT.U8, 0)]
    bufs, evs, datas = transfer(xh, c0, c1, specs, [77, 78], seed=11)
    check_all_arrived(bufs, evs, specs, datas)
    for b, s, d in zip(bufs, specs, datas):
        copy = b.copy_to_device(r_dev2)
        th.expect_ok(th.buffer_status(copy), "local copy")
        assert copy.device() == r_dev2
        assert copy.dims() == s.dims
        th.assert_same_bytes(th.read_back(copy, s), d, "local copy")
    # The copy source keeps its bytes too.
    th.assert_same_bytes(th.read_back(bufs[0], specs[0]), datas[0], "source after copy")


def test_v2_reverse_direction_node1_to_node0(xh, pair):
    c0, c1 = pair
    n1 = c1.addressable_devices()[1]  # node 1's second device
    n0 = c0.addressable_devices()[1]  # node 0's second device
    s = spec(BT.S64, 50)
    d = th.make_data(s, 99)
    src = th.upload(c1, n1, s, d)
    ev = xh.send(c1, [src], [n0.id()], [9])
    buf = xh.receive(c0, n0, [s], [n1.id()], [9])
    check_all_arrived(buf, ev, [s], [d])


@pytest.mark.parametrize(
    "recv_spec,send_spec",
    [
        (spec(BT.F32, 4, 4), spec(BT.F32, 4, 5)),  # byte size differs
        (spec(BT.F32, 4, 4), spec(BT.F32, 2, 8)),  # same bytes, other dims
        (spec(BT.F32, 16), spec(BT.S32, 16)),  # same bytes, other dtype
    ],
    ids=["size", "dims", "dtype"],
)
def test_v2_shape_or_dtype_mismatch_fails_both_sides_with_invalid_argument(
    xh, pair, recv_spec, send_spec
):
    c0, c1 = pair
    s_dev, r_dev, _ = devs(c0, c1)
    src = th.upload(c0, s_dev, send_spec, th.make_data(send_spec, 1))
    bufs = xh.receive(c1, r_dev, [recv_spec], [s_dev.id()], [55])
    evs = xh.send(c0, [src], [r_dev.id()], [55])
    th.expect_code(th.wait_event(evs[0]), EC.INVALID_ARGUMENT, "send event")
    th.expect_code(th.buffer_status(bufs[0]), EC.INVALID_ARGUMENT, "receive buffer")
    th.wait_keys_retired(c0, c1)


def test_v2_addressable_peer_device_is_invalid_argument(xh, auto_pair):
    c0, c1 = auto_pair
    s_dev, r_dev, r_dev2 = devs(c0, c1)
    s = spec(BT.F32, 4)
    with pytest.raises(pc.PjrtError) as e:
        xh.receive(c1, r_dev, [s], [r_dev2.id()], [1])
    assert e.value.code == EC.INVALID_ARGUMENT
    assert "between an addressable and a non-addressable device" in e.value.message
    src = th.upload(c0, s_dev, s, th.make_data(s, 0))
    s_dev2 = c0.addressable_devices()[1]  # the sender's own other device
    with pytest.raises(pc.PjrtError) as e:
        xh.send(c0, [src], [s_dev2.id()], [1])
    assert e.value.code == EC.INVALID_ARGUMENT
    assert "between an addressable and a non-addressable device" in e.value.message


def test_v2_receive_device_must_be_addressable_and_peer_must_exist(xh, auto_pair):
    c0, c1 = auto_pair
    s = spec(BT.F32, 4)
    remote = [d for d in c1.devices() if not d.is_addressable()][0]
    with pytest.raises(pc.PjrtError) as e:
        xh.receive(c1, remote, [s], [th.device_ids(c1, 0)[0]], [1])
    assert e.value.code == EC.INVALID_ARGUMENT
    missing = 17  # a device id in neither numbering (0..3, or 0,1,2048,2049)
    assert missing not in [d.id() for d in c1.devices()]
    with pytest.raises(pc.PjrtError) as e:
        xh.receive(c1, c1.addressable_devices()[0], [s], [missing], [1])
    assert e.value.code == EC.INVALID_ARGUMENT


def test_v2_empty_shape_and_buffer_lists_are_invalid_argument(xh, auto_pair):
    c0, c1 = auto_pair
    with pytest.raises(pc.PjrtError) as e:
        xh.receive(c1, c1.addressable_devices()[0], [], [], [])
    assert e.value.code == EC.INVALID_ARGUMENT
    with pytest.raises(pc.PjrtError) as e:
        xh.send(c0, [], [], [])
    assert e.value.code == EC.INVALID_ARGUMENT


@pytest.mark.parametrize("sizes", [(96, 64), (120, 88)], ids=["jax-v6", "v8"])
def test_v2_accepts_the_jax_and_v8_struct_sizes(xh, auto_pair, sizes):
    c0, c1 = auto_pair
    s_dev, r_dev, _ = devs(c0, c1)
    s = spec(BT.U16, 33)
    d = th.make_data(s, 5)
    src = th.upload(c0, s_dev, s, d)
    bufs = xh.receive(c1, r_dev, [s], [s_dev.id()], [3], struct_size=sizes[0])
    evs = xh.send(c0, [src], [r_dev.id()], [3], struct_size=sizes[1])
    check_all_arrived(bufs, evs, [s], [d])


def test_v2_metrics_count_bytes_and_retire_every_key(xh, pair):
    c0, c1 = pair
    before0, before1 = th.metrics(c0), th.metrics(c1)
    specs = MIXED[:8]
    bufs, evs, datas = transfer(xh, c0, c1, specs, list(range(500, 508)), seed=2)
    check_all_arrived(bufs, evs, specs, datas)
    m0, m1 = th.wait_keys_retired(c0, c1)
    total = sum(s.nbytes for s in specs)
    assert m1["bytes_received"] - before1["bytes_received"] == total, m1
    assert m0["bytes_sent"] - before0["bytes_sent"] == total, m0
    # Receiver created and deleted its keys (completion + descriptor keys).
    assert m1["keys_created"] - before1["keys_created"] >= len(specs), m1
    assert m1["keys_deleted"] == m1["keys_created"], m1
    assert m1["delete_failures"] == 0 and m1["timeouts"] == 0 and m1["cancellations"] == 0
    assert m1["stale_receipts_rejected"] == 0
    # The sender never owns receive keys.
    assert m0["keys_outstanding"] == 0 and m0["bytes_received"] == before0["bytes_received"]


def test_v2_same_transfer_key_reused_after_completion_waits_for_the_new_send(xh, pair):
    """DESIGN §7 deterministic key reuse: transfer 1 on key X completes (and
    X is retired); a second receive on X stays pending until the second
    sender, then gets the second sender's bytes."""
    c0, c1 = pair
    s_dev, r_dev, _ = devs(c0, c1)
    s = spec(BT.S32, 64)
    d1, d2 = th.make_data(s, 1), th.make_data(s, 2)
    src1, src2 = th.upload(c0, s_dev, s, d1), th.upload(c0, s_dev, s, d2)
    b1 = xh.receive(c1, r_dev, [s], [s_dev.id()], [7])
    e1 = xh.send(c0, [src1], [r_dev.id()], [7])
    check_all_arrived(b1, e1, [s], [d1])
    th.wait_keys_retired(c1)
    b2 = xh.receive(c1, r_dev, [s], [s_dev.id()], [7])
    time.sleep(0.1)
    assert not th.is_buffer_ready(b2[0]), "second receive on a reused key completed with no sender"
    e2 = xh.send(c0, [src2], [r_dev.id()], [7])
    check_all_arrived(b2, e2, [s], [d2])


def test_v2_receive_without_sender_times_out_with_deadline_exceeded(api, xh):
    c0, c1 = th.make_pair(api, receive_timeout_ms=300)
    try:
        s_dev, r_dev, _ = devs(c0, c1)
        t0 = time.monotonic()
        specs = [spec(BT.F32, 8), spec(BT.U8, 0)]
        bufs = xh.receive(c1, r_dev, specs, [s_dev.id()] * 2, [1, 2])
        for b in bufs:
            th.expect_code(th.buffer_status(b, timeout=5), EC.DEADLINE_EXCEEDED, "receive")
        elapsed = time.monotonic() - t0
        assert 0.25 <= elapsed < 3.0, f"timed out after {elapsed:.3f}s (limit 0.3s)"
        (m1,) = th.wait_keys_retired(c1)
        assert m1["timeouts"] == 2, m1
        assert m1["bytes_received"] == 0, m1
    finally:
        c1.destroy()
        c0.destroy()


def test_v2_receives_past_max_receive_bytes_fail_at_once_naming_size_and_bound(api, xh):
    bound = 1 << 20
    c0, c1 = th.make_pair(api, max_receive_bytes=bound)
    try:
        s_dev, r_dev, _ = devs(c0, c1)
        big = spec(BT.U8, 2 << 20)
        with pytest.raises(pc.PjrtError) as e:
            xh.receive(c1, r_dev, [big], [s_dev.id()], [1])
        assert e.value.code == EC.RESOURCE_EXHAUSTED, e.value
        assert str(2 << 20) in e.value.message and f"max_receive_bytes = {bound}" in e.value.message
        # The bound counts what received buffers hold: a second 600 KiB
        # receive fails while the first one's buffer lives, and works once
        # it is destroyed. A batch that does not fit fails as a whole.
        part = spec(BT.U8, 600 << 10)
        bufs, evs, datas = transfer(xh, c0, c1, [part], [2])
        check_all_arrived(bufs, evs, [part], datas)
        with pytest.raises(pc.PjrtError) as e:
            xh.receive(c1, r_dev, [spec(BT.U8, 100 << 10), part], [s_dev.id()] * 2, [3, 4])
        assert e.value.code == EC.RESOURCE_EXHAUSTED, e.value
        for b in bufs:
            b.destroy()
        bufs, evs, datas = transfer(xh, c0, c1, [part], [5])
        check_all_arrived(bufs, evs, [part], datas)
        th.wait_keys_retired(c1)
    finally:
        c1.destroy()
        c0.destroy()


def test_a_refused_receive_fails_its_senders_at_once_with_the_receivers_reason(api, xh):
    # The receiver's max_receive_bytes refuses a batch: its senders learn
    # why at the keys they wait on, instead of waiting send_timeout_ms
    # (issue 18), and nothing of the batch is offered to them.
    bound = 1 << 20
    c0, c1 = th.make_pair(api, max_receive_bytes=bound, send_timeout_ms=60_000)
    try:
        s_dev, r_dev, _ = devs(c0, c1)
        specs = [spec(BT.U8, 4096), spec(BT.U8, 2 << 20)]
        srcs = [th.upload(c0, s_dev, sp, th.make_data(sp, i)) for i, sp in enumerate(specs)]
        with pytest.raises(pc.PjrtError) as e:
            xh.receive(c1, r_dev, specs, [s_dev.id()] * 2, [7, 8])
        assert e.value.code == EC.RESOURCE_EXHAUSTED, e.value
        t0 = time.monotonic()
        evs = xh.send(c0, srcs, [r_dev.id()] * 2, [7, 8])
        for i, ev in enumerate(evs):
            st = th.wait_event(ev, timeout=10)
            th.expect_code(st, EC.RESOURCE_EXHAUSTED, f"send {i}")
            assert "process 1 refused the receive" in str(st), st
            assert f"max_receive_bytes = {bound}" in str(st), st
        assert time.monotonic() - t0 < 5, "the senders waited for their timeout"
        assert th.metrics(c0)["sends_failed"] == 2
        # The refusals were read and deleted; the pair goes on.
        bufs, evs, datas = transfer(xh, c0, c1, [specs[0]], [9])
        check_all_arrived(bufs, evs, [specs[0]], datas)
        th.wait_keys_retired(c0, c1)
    finally:
        c1.destroy()
        c0.destroy()


def test_v2_send_without_receiver_times_out(api, xh):
    c0, c1 = th.make_pair(api, send_timeout_ms=300)
    try:
        s = spec(BT.F32, 8)
        src = th.upload(c0, c0.addressable_devices()[0], s, th.make_data(s, 0))
        t0 = time.monotonic()
        ev = xh.send(c0, [src], [th.device_ids(c0, 1)[0]], [1])[0]
        th.expect_code(th.wait_event(ev, timeout=5), EC.DEADLINE_EXCEEDED, "send")
        assert time.monotonic() - t0 < 3.0
    finally:
        c1.destroy()
        c0.destroy()


def test_v2_with_the_same_task_snapshot_on_both_sides_transfers(xh, pair):
    c0, c1 = pair
    s_dev, r_dev, _ = devs(c0, c1)
    s = spec(BT.F32, 40)
    d = th.make_data(s, 61)
    src = th.upload(c0, s_dev, s, d)
    tasks = {0: 11, 1: 22}  # task ids are process indices, not device ids
    bufs = xh.receive(c1, r_dev, [s], [s_dev.id()], [8], tasks=tasks)
    evs = xh.send(c0, [src], [r_dev.id()], [8], tasks=tasks)
    check_all_arrived(bufs, evs, [s], [d])


def test_v2_a_restarted_peer_fails_the_pending_receives_with_aborted(xh, auto_pair):
    """v8: a snapshot in which the peer's incarnation changed means the peer
    restarted: receives waiting on it fail now, not at the deadline."""
    c0, c1 = auto_pair
    s_dev, r_dev, _ = devs(c0, c1)
    s = spec(BT.S32, 4)
    (pending,) = xh.receive(c1, r_dev, [s], [s_dev.id()], [1], tasks={0: 1, 1: 5})
    time.sleep(0.02)
    assert not th.is_buffer_ready(pending)
    # A later call carries a snapshot where task 0 has a new incarnation.
    (other,) = xh.receive(c1, r_dev, [s], [s_dev.id()], [2], tasks={0: 2, 1: 5})
    st = th.buffer_status(pending, timeout=5)
    th.expect_code(st, EC.ABORTED, "receive from the restarted peer")
    assert not th.is_buffer_ready(other), "the new-incarnation receive must stay pending"


def test_v2_num_tasks_without_arrays_is_invalid_argument(xh, auto_pair):
    c0, c1 = auto_pair
    s_dev, r_dev, _ = devs(c0, c1)  # valid ids: only the NULL task arrays are wrong
    with pytest.raises(pc.PjrtError) as e:
        xh.receive(c1, r_dev, [spec(BT.F32, 1)], [s_dev.id()], [1], tasks=("null", 2))
    assert e.value.code == EC.INVALID_ARGUMENT
    s = spec(BT.F32, 1)
    src = th.upload(c0, s_dev, s, th.make_data(s, 0))
    with pytest.raises(pc.PjrtError) as e:
        xh.send(c0, [src], [r_dev.id()], [1], tasks=("null", 1))
    assert e.value.code == EC.INVALID_ARGUMENT
