"""Buffers on the host backend: host -> device -> host round trips for every
fixed-width element type, strided inputs, host-buffer semantics, metadata,
device-to-device copies, raw reads, external references and deletion."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import pjrt_ctypes as pc
from pjrt_ctypes import BufferType as T
from pjrt_ctypes import ErrorCode, HostBufferSemantics

# Valid value range, for types stored as one (unpacked) byte per element.
SUB_BYTE_RANGE = {
    T.S4: (-8, 7),
    T.U4: (0, 15),
    T.S2: (-2, 1),
    T.U2: (0, 3),
    T.F4E2M1FN: (0, 15),
}

ROUND_TRIP_TYPES = [
    T.PRED, T.S8, T.S16, T.S32, T.S64, T.U8, T.U16, T.U32, T.U64,
    T.F16, T.F32, T.F64, T.BF16, T.C64, T.C128,
    T.F8E5M2, T.F8E4M3FN, T.F8E4M3B11FNUZ, T.F8E5M2FNUZ, T.F8E4M3FNUZ,
    T.F8E4M3, T.F8E3M4, T.F8E8M0FNU,
    T.S4, T.U4, T.S2, T.U2, T.F4E2M1FN,
]  # fmt: skip

SHAPES = [(), (0,), (1,), (7,), (3, 4), (2, 3, 5), (2, 0, 3), (4, 1, 1, 3)]


def sample(t: pc.BufferType, shape, seed=0) -> np.ndarray:
    """Deterministic data whose bytes are valid for ``t``."""
    rng = np.random.default_rng(seed + int(t) * 101 + len(shape))
    dt = pc.HOST_DTYPE[t]
    n = int(np.prod(shape, dtype=np.int64))
    if t == T.PRED:
        a = rng.integers(0, 2, n).astype(np.bool_)
    elif t in SUB_BYTE_RANGE:
        lo, hi = SUB_BYTE_RANGE[t]
        a = rng.integers(lo, hi + 1, n).astype(dt)
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        a = rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
    elif dt.kind == "f":
        a = (rng.standard_normal(n) * 1000).astype(dt)
        if n >= 3:
            a[:3] = [np.inf, -0.0, np.nan]
    elif dt.kind == "c":
        a = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dt)
    else:
        raise AssertionError(dt)
    return a.reshape(shape)


@pytest.fixture(scope="module")
def mclient(api):
    c = api.create_client()
    yield c
    c.destroy()


def _bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("t", ROUND_TRIP_TYPES, ids=lambda t: t.name)
def test_host_round_trip_preserves_every_byte_type_and_shape(mclient, t, shape):
    a = sample(t, shape)
    buf = mclient.buffer_from_host(a, type=t)
    try:
        assert buf.element_type() == t
        assert buf.dims() == shape
        assert buf.unpadded_dims() == shape
        assert buf.dynamic_dim_indices() == []
        assert buf.on_device_size() == a.nbytes
        assert buf.required_host_size() == a.nbytes
        assert buf.to_host_bytes() == _bytes(a)
    finally:
        buf.destroy()


@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 3, 4), (2, 0, 3)])
def test_memory_layout_is_dense_row_major(mclient, shape):
    a = np.zeros(shape, np.float32)
    buf = mclient.buffer_from_host(a)
    try:
        layout = buf.memory_layout()
        assert layout.type == pc.MemoryLayoutType.Tiled
        rank = len(shape)
        m2m = [layout.tiled.minor_to_major[i] for i in range(layout.tiled.minor_to_major_size)]
        assert m2m == list(range(rank - 1, -1, -1))
        assert layout.tiled.num_tiles == 0
    finally:
        buf.destroy()


def test_done_with_host_buffer_event_is_returned_and_completes_ok(mclient):
    a = np.arange(10, dtype=np.float32)
    buf = mclient.buffer_from_host(a)
    try:
        assert buf.done_event is not None, "done_with_host_buffer was NULL"
        assert buf.done_event.await_status() is None
    finally:
        buf.destroy()


def test_buffer_ready_event_completes_ok(mclient):
    buf = mclient.buffer_from_host(np.arange(6, dtype=np.int32))
    try:
        ev = buf.ready_event()
        try:
            assert ev.await_status() is None
            assert ev.is_ready()
            assert ev.error() is None
        finally:
            ev.destroy()
    finally:
        buf.destroy()


def test_buffer_reports_device_memory_and_is_on_cpu(mclient):
    d1 = mclient.devices()[1]
    buf = mclient.buffer_from_host(np.ones(3, np.float64), device=d1)
    try:
        assert buf.device() == d1
        assert buf.memory() == d1.default_memory()
        assert buf.is_on_cpu()
    finally:
        buf.destroy()


def test_destination_given_by_memory_with_null_device_lands_on_that_memory(mclient):
    d1 = mclient.devices()[1]
    mem = d1.default_memory()
    a = np.arange(12, dtype=np.int16).reshape(3, 4)
    buf = mclient.buffer_from_host(a, memory=mem, use_default_device=False)
    try:
        assert buf.memory() == mem
        assert buf.device() == d1
        assert buf.to_host_bytes() == _bytes(a)
    finally:
        buf.destroy()


def test_to_host_with_null_dst_reports_the_needed_size(mclient):
    a = np.arange(30, dtype=np.complex64).reshape(5, 6)
    buf = mclient.buffer_from_host(a)
    try:
        assert buf.required_host_size() == a.nbytes == 240
    finally:
        buf.destroy()


# ------------------------------------------------------------ strided inputs


def _strided_cases():
    base = np.arange(20, dtype=np.float32).reshape(5, 4)
    cube = np.arange(2 * 3 * 4, dtype=np.int64).reshape(2, 3, 4)
    wide = np.arange(6 * 8, dtype=np.int16).reshape(6, 8)
    cplx = (np.arange(12) + 1j * np.arange(12)[::-1]).astype(np.complex128).reshape(3, 4)
    return {
        "transposed_2d": base.T,
        "sliced_rows_and_cols": base[::2, 1:3],
        "column": base[:, 2],
        "permuted_3d": np.transpose(cube, (2, 0, 1)),
        "every_third_of_a_row": wide[1, ::3],
        "sliced_then_transposed": wide[1:5, ::2].T,
        "reversed_negative_stride": base[::-1, :],
        "complex_transposed": cplx.T,
        "uint8_step_slice": np.arange(64, dtype=np.uint8).reshape(8, 8)[::3, ::2],
    }


@pytest.mark.parametrize("case", sorted(_strided_cases()))
def test_non_contiguous_input_with_byte_strides_is_gathered_correctly(mclient, case):
    view = _strided_cases()[case]
    assert not view.flags["C_CONTIGUOUS"] or view.ndim <= 1
    buf = mclient.buffer_from_host(view, byte_strides=list(view.strides))
    try:
        assert buf.dims() == view.shape
        assert buf.to_host_bytes() == _bytes(view)
    finally:
        buf.destroy()


def test_explicit_dense_byte_strides_are_accepted(mclient):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    buf = mclient.buffer_from_host(a, byte_strides=list(a.strides))
    try:
        assert buf.to_host_bytes() == _bytes(a)
    finally:
        buf.destroy()


# ---------------------------------------------------- host buffer semantics


@pytest.mark.parametrize("sem", list(HostBufferSemantics), ids=lambda s: s.name)
def test_every_host_buffer_semantics_round_trips(mclient, sem):
    a = np.arange(32, dtype=np.float32).reshape(4, 8)
    expect = _bytes(a)
    buf = mclient.buffer_from_host(a, semantics=sem)
    try:
        assert buf.to_host_bytes() == expect
    finally:
        buf.destroy()


def test_immutable_only_during_call_copies_so_later_host_writes_do_not_leak_in(mclient):
    a = np.arange(16, dtype=np.int32)
    expect = _bytes(a)
    buf = mclient.buffer_from_host(a, semantics=HostBufferSemantics.kImmutableOnlyDuringCall)
    try:
        a[:] = -1  # allowed: the call has returned
        assert buf.to_host_bytes() == expect
    finally:
        buf.destroy()


def test_until_transfer_completes_host_may_be_reused_after_done_event(mclient):
    a = np.arange(16, dtype=np.int32)
    expect = _bytes(a)
    buf = mclient.buffer_from_host(
        a, semantics=HostBufferSemantics.kImmutableUntilTransferCompletes
    )
    try:
        assert buf.done_event is not None
        assert buf.done_event.wait_ready(timeout=10) is None
        a[:] = -1  # allowed: done_with_host_buffer fired
        assert buf.to_host_bytes() == expect
    finally:
        buf.destroy()


@pytest.mark.parametrize(
    "sem", [HostBufferSemantics.kImmutableZeroCopy, HostBufferSemantics.kMutableZeroCopy]
)
def test_zero_copy_done_event_fires_once_the_buffer_is_destroyed(mclient, sem):
    a = np.arange(16, dtype=np.float64)
    buf = mclient.buffer_from_host(a, semantics=sem)
    assert buf.done_event is not None
    done, buf.done_event = buf.done_event, None
    buf.destroy()
    try:
        assert done.wait_ready(timeout=10) is None
    finally:
        done.destroy()


# --------------------------------------------------------------- copies


def test_copy_to_device_copies_bytes_to_the_other_device(mclient):
    d0, d1 = mclient.devices()
    a = sample(T.F32, (6, 7))
    src = mclient.buffer_from_host(a, device=d0)
    dst = src.copy_to_device(d1)
    try:
        assert dst.device() == d1
        assert dst.memory() == d1.default_memory()
        assert dst.element_type() == T.F32 and dst.dims() == (6, 7)
        assert dst.to_host_bytes() == _bytes(a)
        assert src.to_host_bytes() == _bytes(a)
    finally:
        dst.destroy()
        src.destroy()


def test_copy_to_memory_copies_bytes_to_that_memory(mclient):
    d0, d1 = mclient.devices()
    a = sample(T.S64, (3, 5))
    src = mclient.buffer_from_host(a, device=d0)
    dst = src.copy_to_memory(d1.default_memory())
    try:
        assert dst.memory() == d1.default_memory()
        assert dst.device() == d1
        assert dst.to_host_bytes() == _bytes(a)
    finally:
        dst.destroy()
        src.destroy()


def test_copy_of_a_zero_sized_buffer_to_another_device(mclient):
    d0, d1 = mclient.devices()
    src = mclient.buffer_from_host(np.zeros((0, 4), np.float32), device=d0)
    dst = src.copy_to_device(d1)
    try:
        assert dst.dims() == (0, 4)
        assert dst.to_host_bytes(0) == b""
    finally:
        dst.destroy()
        src.destroy()


def test_copy_is_independent_of_the_source_after_source_is_destroyed(mclient):
    d0, d1 = mclient.devices()
    a = sample(T.U8, (100,))
    src = mclient.buffer_from_host(a, device=d0)
    dst = src.copy_to_device(d1)
    src.destroy()
    try:
        assert dst.to_host_bytes() == _bytes(a)
    finally:
        dst.destroy()


def test_copy_to_its_own_device_is_an_error_as_the_header_says(mclient):
    d0 = mclient.devices()[0]
    src = mclient.buffer_from_host(np.ones(4, np.float32), device=d0)
    try:
        with pytest.raises(pc.PjrtError):
            src.copy_to_device(d0)
    finally:
        src.destroy()


def test_copy_to_its_own_memory_is_an_error_as_the_header_says(mclient):
    d0 = mclient.devices()[0]
    src = mclient.buffer_from_host(np.ones(4, np.float32), device=d0)
    try:
        with pytest.raises(pc.PjrtError):
            src.copy_to_memory(d0.default_memory())
    finally:
        src.destroy()


# ------------------------------------------------------------- raw access


def test_copy_raw_to_host_reads_the_requested_byte_range(mclient):
    a = np.arange(16, dtype=np.float32)
    raw = _bytes(a)
    buf = mclient.buffer_from_host(a)
    try:
        assert buf.copy_raw_to_host(0, len(raw)) == raw
        assert buf.copy_raw_to_host(4, 8) == raw[4:12]
        assert buf.copy_raw_to_host(len(raw) - 3, 3) == raw[-3:]
    finally:
        buf.destroy()


def _raw_copy_error(buf, offset, size):
    """Returns the PjrtError of an out-of-range raw copy (direct or via event)."""
    api = buf.api
    dst = ctypes.create_string_buffer(max(1, abs(size)) + 64)
    a, err = api.try_call(
        "PJRT_Buffer_CopyRawToHost",
        buffer=buf.handle,
        dst=ctypes.addressof(dst),
        offset=offset,
        transfer_size=size,
    )
    if err is None and a.event:
        ev = pc.Event(api, a.event)
        err = ev.await_status()
        ev.destroy()
    return err


@pytest.mark.isolated
@pytest.mark.parametrize(
    "offset,size", [(60, 8), (64, 1), (0, 65), (-4, 8), (0, -1), (1 << 62, 8)]
)
def test_copy_raw_to_host_out_of_range_is_an_error_not_a_crash(client, offset, size):
    buf = client.buffer_from_host(np.arange(16, dtype=np.float32))  # 64 bytes
    err = _raw_copy_error(buf, offset, size)
    assert err is not None, f"offset={offset} size={size} on 64 bytes succeeded"
    assert err.code in (ErrorCode.INVALID_ARGUMENT, ErrorCode.OUT_OF_RANGE)


def test_unsafe_pointer_with_external_reference_reads_the_bytes_directly(mclient):
    a = sample(T.F64, (3, 5))
    buf = mclient.buffer_from_host(a)
    try:
        buf.increase_external_ref()
        ptr = buf.unsafe_pointer()
        assert ptr, "UnsafePointer returned NULL for a non-empty buffer"
        assert ctypes.string_at(ptr, a.nbytes) == _bytes(a)
        assert buf.opaque_device_pointer(), "OpaqueDeviceMemoryDataPointer returned NULL"
        buf.decrease_external_ref()
    finally:
        buf.destroy()


def test_external_reference_count_nests(mclient):
    buf = mclient.buffer_from_host(np.ones(8, np.uint8))
    try:
        buf.increase_external_ref()
        buf.increase_external_ref()
        buf.decrease_external_ref()
        buf.decrease_external_ref()
    finally:
        buf.destroy()


@pytest.mark.isolated
def test_decrease_external_reference_below_zero_is_an_error(client):
    buf = client.buffer_from_host(np.ones(8, np.uint8))
    with pytest.raises(pc.PjrtError):
        buf.decrease_external_ref()
    buf.increase_external_ref()
    buf.decrease_external_ref()
    with pytest.raises(pc.PjrtError):
        buf.decrease_external_ref()


# ---------------------------------------------------------- delete / destroy


def test_delete_marks_the_buffer_deleted(mclient):
    buf = mclient.buffer_from_host(np.ones(4, np.float32))
    try:
        assert not buf.is_deleted()
        buf.delete()
        assert buf.is_deleted()
    finally:
        buf.destroy()


def _deleted(client):
    buf = client.buffer_from_host(np.arange(8, dtype=np.float32))
    buf.delete()
    return buf


@pytest.mark.isolated
def test_to_host_of_a_deleted_buffer_is_invalid_argument(client):
    buf = _deleted(client)
    dst = ctypes.create_string_buffer(32)
    a, err = client.api.try_call(
        "PJRT_Buffer_ToHostBuffer", src=buf.handle, dst=ctypes.addressof(dst), dst_size=32
    )
    if err is None:
        assert a.event, "ToHostBuffer of a deleted buffer returned OK and no event"
        ev = pc.Event(client.api, a.event)
        err = ev.await_status()
        ev.destroy()
    assert err is not None, "reading a deleted buffer succeeded"
    assert err.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.isolated
def test_copy_to_device_of_a_deleted_buffer_is_invalid_argument(client):
    buf = _deleted(client)
    d1 = client.devices()[1]
    a, err = client.api.try_call(
        "PJRT_Buffer_CopyToDevice", buffer=buf.handle, dst_device=d1.handle
    )
    if err is None:
        # Accept an error surfacing through the new buffer's ready event.
        assert a.dst_buffer
        nb = pc.Buffer(client, a.dst_buffer)
        ev = nb.ready_event()
        err = ev.await_status()
        ev.destroy()
        nb.destroy()
    assert err is not None, "copying a deleted buffer succeeded"
    assert err.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.isolated
def test_copy_raw_to_host_of_a_deleted_buffer_is_invalid_argument(client):
    buf = _deleted(client)
    err = _raw_copy_error(buf, 0, 8)
    assert err is not None, "raw copy of a deleted buffer succeeded"
    assert err.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.isolated
def test_copy_to_memory_of_a_deleted_buffer_is_an_error(client):
    buf = _deleted(client)
    mem = client.devices()[1].default_memory()
    a, err = client.api.try_call(
        "PJRT_Buffer_CopyToMemory", buffer=buf.handle, dst_memory=mem.handle
    )
    if err is None:
        nb = pc.Buffer(client, a.dst_buffer)
        ev = nb.ready_event()
        err = ev.await_status()
        ev.destroy()
        nb.destroy()
    assert err is not None
    assert err.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.isolated
def test_ready_event_of_a_deleted_buffer_reports_an_error(client):
    buf = _deleted(client)
    a, err = client.api.try_call("PJRT_Buffer_ReadyEvent", buffer=buf.handle)
    if err is None:
        ev = pc.Event(client.api, a.event)
        err = ev.await_status()
        ev.destroy()
    assert err is not None, "header: the ready event of a deleted buffer indicates an error"


@pytest.mark.isolated
def test_delete_twice_does_not_crash_and_buffer_stays_deleted(client):
    buf = _deleted(client)
    client.api.try_call("PJRT_Buffer_Delete", buffer=buf.handle)
    assert buf.is_deleted()
    buf.destroy()


def test_destroy_with_null_buffer_is_ok(api):
    api.call("PJRT_Buffer_Destroy", buffer=None)


def test_many_buffers_created_and_destroyed(mclient):
    a = np.arange(1024, dtype=np.uint8)
    for _ in range(200):
        b = mclient.buffer_from_host(a)
        b.destroy()


def test_large_buffer_round_trip_16_mib(mclient):
    a = np.random.default_rng(1).integers(0, 255, 16 << 20, dtype=np.uint8)
    buf = mclient.buffer_from_host(a)
    try:
        assert buf.to_host_bytes() == a.tobytes()
    finally:
        buf.destroy()


def test_to_host_buffer_returns_an_event_that_completes_ok(mclient):
    a = np.arange(10, dtype=np.int32)
    buf = mclient.buffer_from_host(a)
    dst = ctypes.create_string_buffer(a.nbytes)
    try:
        r = mclient.api.call(
            "PJRT_Buffer_ToHostBuffer", src=buf.handle, dst=ctypes.addressof(dst),
            dst_size=a.nbytes,
        )
        assert r.event, "ToHostBuffer returned no event"
        ev = pc.Event(mclient.api, r.event)
        assert ev.await_status() is None
        ev.destroy()
        assert dst.raw == a.tobytes()
    finally:
        buf.destroy()


def test_copy_raw_to_host_returns_an_event_that_completes_ok(mclient):
    a = np.arange(10, dtype=np.int32)
    buf = mclient.buffer_from_host(a)
    dst = ctypes.create_string_buffer(8)
    try:
        r = mclient.api.call(
            "PJRT_Buffer_CopyRawToHost", buffer=buf.handle, dst=ctypes.addressof(dst),
            offset=8, transfer_size=8,
        )
        assert r.event, "CopyRawToHost returned no event"
        ev = pc.Event(mclient.api, r.event)
        assert ev.await_status() is None
        ev.destroy()
        assert dst.raw == a.tobytes()[8:16]
    finally:
        buf.destroy()
