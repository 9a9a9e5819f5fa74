"""The ``backend`` create option through the C API: ``host`` keeps working
everywhere, ``cuda`` without a driver is a clear FAILED_PRECONDITION at client
creation, ``auto`` falls back to host; with a GPU, CUDA devices describe the
real device and buffers live in device memory. GPU-only tests skip with the
driver's reason where there is none."""

from __future__ import annotations

import numpy as np
import pytest

import pjrt_ctypes as pc
from pjrt_ctypes import ErrorCode


def _cuda_unavailable_reason(api) -> str | None:
    """None when a backend=cuda client can be created, else why not."""
    try:
        c = api.create_client({"backend": "cuda"})
    except pc.PjrtError as e:
        return e.message
    c.destroy()
    return None


@pytest.fixture(scope="module")
def cuda_reason(api):
    return _cuda_unavailable_reason(api)


@pytest.fixture
def require_cuda(cuda_reason):
    if cuda_reason is not None:
        pytest.skip(f"no CUDA driver/device: {cuda_reason}")


@pytest.fixture
def require_no_cuda(cuda_reason):
    if cuda_reason is None:
        pytest.skip("CUDA is available here; this test checks the no-driver behaviour")


def test_backend_host_still_works_with_two_host_devices(api):
    with api.create_client({"backend": "host"}) as c:
        devs = c.devices()
        assert len(devs) == 2
        assert all(d.kind() == "crosshost-host" for d in devs)
        assert devs[0].attributes()["backend"][1] == "host"
        a = np.arange(16, dtype=np.float32)
        buf = c.buffer_from_host(a, device=devs[1])
        try:
            assert buf.is_on_cpu()
            assert buf.to_host_bytes() == a.tobytes()
        finally:
            buf.destroy()


def test_unknown_backend_value_is_invalid_argument_naming_the_choices(api):
    with pytest.raises(pc.PjrtError) as e:
        api.create_client({"backend": "rocm"})
    assert e.value.code == ErrorCode.INVALID_ARGUMENT
    assert "backend" in e.value.message and "cuda" in e.value.message


def test_backend_cuda_without_a_driver_is_failed_precondition_with_the_reason(
    api, require_no_cuda
):
    with pytest.raises(pc.PjrtError) as e:
        api.create_client({"backend": "cuda"})
    assert e.value.code == ErrorCode.FAILED_PRECONDITION
    assert "backend=cuda" in e.value.message
    assert "CUDA is unavailable" in e.value.message


def test_backend_auto_without_a_driver_falls_back_to_host(api, require_no_cuda):
    with api.create_client({"backend": "auto"}) as c:
        assert "host backend" in c.platform_version()
        assert c.devices()[0].kind() == "crosshost-host"


def test_cuda_devices_describe_the_real_gpu(api, require_cuda):
    with api.create_client({"backend": "cuda"}) as c:
        assert "cuda backend" in c.platform_version()
        for d in c.addressable_devices():
            assert d.kind() and d.kind() != "crosshost-host"
            attrs = d.attributes()
            assert attrs["backend"][1] == "cuda"
            assert "compute_capability" in attrs
            assert attrs["total_memory_bytes"][1] > 0
            stats = d.memory_stats()
            assert stats.bytes_limit_is_set and stats.bytes_limit > 0


def test_cuda_buffers_live_in_device_memory_and_round_trip(api, require_cuda):
    with api.create_client({"backend": "cuda"}) as c:
        a = np.arange(1 << 18, dtype=np.float32)
        buf = c.buffer_from_host(a)
        try:
            assert not buf.is_on_cpu()
            assert buf.to_host_bytes() == a.tobytes()
        finally:
            buf.destroy()
