"""Single-process JAX scenarios for test_jax_single_process.py.

    python jax_single_process_scenarios.py SCENARIO

Each scenario runs in its own process (JAX aborts the process on many PJRT
errors), asserts what it checks, and prints ``SCENARIO OK`` on success.

``CROSSHOST_TEST_MODE`` says which plugin configuration the child runs:
``embedded`` (no compute plugin: crosshost devices hold and move arrays) or
``delegated`` (a compute plugin computes on them; the test sets
``PJRT_CROSSHOST_COMPUTE_PLUGIN``).
"""

from __future__ import annotations

import os
import sys

import numpy as np

# Every dtype JAX 0.10.2 can put on a device (64-bit ones with x64 enabled).
DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "int4", "uint4", "int2", "uint2",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu", "float4_e2m1fn",
]  # fmt: skip
SHAPES = [(), (0,), (7,), (3, 5), (2, 0, 4), (4, 3, 2), (1, 1, 1, 1), (129, 65)]


def jax_x64():
    import jax

    jax.config.update("jax_enable_x64", True)
    return jax


def sample(dtype_name: str, shape, seed: int) -> np.ndarray:
    """Deterministic data that uses every byte where every bit pattern is a
    value, and the whole value range otherwise."""
    import jax.numpy as jnp

    dtype = np.dtype(jnp.dtype(dtype_name))
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype_name in ("int4", "uint4", "int2", "uint2"):
        import ml_dtypes

        info = ml_dtypes.iinfo(dtype)
        return rng.integers(int(info.min), int(info.max) + 1, size=shape).astype(dtype)
    if dtype_name == "float4_e2m1fn":
        return (rng.standard_normal(size=shape) * 3).astype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = rng.integers(0, 256, size=count * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.tobytes() == want.tobytes(), f"{what}: bytes differ"


MODE = os.environ.get("CROSSHOST_TEST_MODE", "embedded")
DELEGATED = MODE == "delegated"


def devices() -> None:
    jax = jax_x64()
    devs = jax.devices("crosshost")
    assert jax.default_backend() == "crosshost", jax.default_backend()
    assert [d.id for d in devs] == [0, 1], devs
    assert jax.devices() == devs and jax.local_devices() == devs
    assert jax.device_count() == 2 and jax.local_device_count() == 2
    assert jax.process_count() == 1 and jax.process_index() == 0
    for d in devs:
        assert d.platform == "crosshost", d.platform
        # Delegated: the compute plugin's devices (XLA's CPU plugin: "cpu",
        # with its three memory kinds).
        assert d.device_kind == ("cpu" if DELEGATED else "crosshost-host"), d.device_kind
        assert d.process_index == 0
        assert d.default_memory().kind == "device", d.default_memory()
        kinds = [m.kind for m in d.addressable_memories()]
        assert kinds == (["device", "pinned_host", "unpinned_host"] if DELEGATED else ["device"]), kinds
        if not DELEGATED:
            stats = d.memory_stats()
            assert stats["bytes_in_use"] >= 0, stats
    backend = devs[0].client
    assert backend.platform == "crosshost"
    assert "pjrt-crosshost" in backend.platform_version, backend.platform_version
    assert ("compute: cpu" in backend.platform_version) == DELEGATED, backend.platform_version
    # The extension advertises cross-host transfers; JAX's cross-process
    # device_put keys off this attribute.
    assert getattr(backend, "supports_cross_host_transfers", None) is True
    # A second device_put after listing still works, and memory stats move
    # (the embedded backend counts them; XLA's CPU plugin keeps none).
    x = jax.device_put(np.arange(1000, dtype=np.float32), devs[1])
    if not DELEGATED:
        assert devs[1].memory_stats()["bytes_in_use"] >= 4000, devs[1].memory_stats()
    same(np.asarray(x), np.arange(1000, dtype=np.float32), "after listing")


def options_from_env() -> None:
    # PJRT_CROSSHOST_CREATE_OPTIONS is set by the test (num_devices=4).
    jax = jax_x64()
    devs = jax.devices("crosshost")
    assert [d.id for d in devs] == [0, 1, 2, 3], devs
    for d in devs:
        x = jax.device_put(np.full((3,), d.id, np.int32), d)
        same(np.asarray(x), np.full((3,), d.id, np.int32), f"device {d.id}")


def options_from_initialize() -> None:
    import jax_plugins.crosshost as plugin

    plugin.initialize(options={"num_devices": 3})
    plugin.initialize(options={"num_devices": 5})  # later calls are no-ops
    jax = jax_x64()
    assert [d.id for d in jax.devices("crosshost")] == [0, 1, 2]


def round_trips() -> None:
    jax = jax_x64()
    devs = jax.devices("crosshost")
    count = 0
    for i, name in enumerate(DTYPES):
        for j, shape in enumerate(SHAPES):
            want = sample(name, shape, 1000 * i + j)
            for d in devs:
                y = jax.device_put(want, d)
                assert y.devices() == {d}, y.devices()
                assert y.dtype == want.dtype and y.shape == want.shape
                # np.asarray takes the zero-copy path (Buffer_IsOnCpu).
                same(np.asarray(y), want, f"{name}{list(shape)} on {d.id}")
                # jax.device_get goes through the same read-back machinery.
                same(np.asarray(jax.device_get(y)), want, f"device_get {name}{list(shape)}")
                count += 1
    # Non-contiguous and Fortran-ordered host input.
    base = sample("float32", (6, 8), 7)
    for view in (base.T, base[::2, 1::3], np.asfortranarray(base)):
        for d in devs:
            same(np.asarray(jax.device_put(view, d)), np.ascontiguousarray(view), "strided input")
    # Python scalars and lists.
    same(np.asarray(jax.device_put(3.5, devs[1])), np.asarray(3.5), "python float")
    same(np.asarray(jax.device_put([1, 2, 3], devs[0])), np.asarray([1, 2, 3]), "python list")
    # The source array may change after device_put: the device copy must not
    # (64-byte aligned, so a plugin that aliased zero-copy host data, as
    # XLA's CPU plugin does with aligned input, would show it every time).
    for n in (64, 1 << 18):
        backing = np.empty(n + 16, dtype=np.int32)
        start = (-backing.ctypes.data % 64) // 4
        src = backing[start : start + n]
        src[:] = np.arange(n, dtype=np.int32)
        y = jax.device_put(src, devs[0])
        y.block_until_ready()
        src[:] = -1
        same(np.asarray(y), np.arange(n, dtype=np.int32), f"host buffer of {n} reused after device_put")
    print(f"{count} round trips")


def device_to_device() -> None:
    jax = jax_x64()
    d0, d1 = jax.devices("crosshost")
    for i, name in enumerate(DTYPES):
        for shape in [(), (0, 3), (5, 7), (300, 41)]:
            want = sample(name, shape, 77 + i)
            a = jax.device_put(want, d0)
            b = jax.device_put(a, d1)
            assert b.devices() == {d1}, b.devices()
            c = jax.device_put(b, d0)
            assert c.devices() == {d0}
            for arr, what in ((a, "source"), (b, "copy"), (c, "copy back")):
                same(np.asarray(arr), want, f"{what} {name}{list(shape)}")
    # Deleting the source does not affect the copy.
    a = jax.device_put(np.arange(100, dtype=np.float64), d0)
    b = jax.device_put(a, d1)
    a.delete()
    same(np.asarray(b), np.arange(100, dtype=np.float64), "copy after source deleted")
    # A batch of arrays in one device_put call.
    wants = [sample(n, (9, 4), k) for k, n in enumerate(["float32", "bfloat16", "int8", "uint64"])]
    srcs = jax.device_put(wants, d0)
    outs = jax.device_put(srcs, d1)
    for out, want in zip(outs, wants):
        assert out.devices() == {d1}
        same(np.asarray(out), want, "batched device-to-device")


def compute_unimplemented() -> None:
    jax = jax_x64()
    import jax.numpy as jnp

    d0, d1 = jax.devices("crosshost")
    x = jax.device_put(np.arange(12, dtype=np.float32).reshape(3, 4), d0)
    for attempt in range(2):
        for op in (lambda: jnp.sin(x), lambda: x + 1, lambda: jax.jit(lambda a: a * 2)(x)):
            try:
                op()
            except jax.errors.JaxRuntimeError as e:
                text = str(e)
                assert text.startswith("UNIMPLEMENTED"), text
                assert "PJRT_Client_Compile is not implemented by pjrt-crosshost" in text, text
                assert "compute plugin" in text and "compute_plugin" in text, text
            else:
                raise AssertionError(f"compute on crosshost succeeded (attempt {attempt})")
        # Everything else keeps working.
        same(np.asarray(x), np.arange(12, dtype=np.float32).reshape(3, 4), "after compile error")
        y = jax.device_put(x, d1)
        same(np.asarray(y), np.asarray(x), "device_put after compile error")
        z = jax.device_put(np.ones((2, 2), np.int16), d1)
        same(np.asarray(z), np.ones((2, 2), np.int16), "new array after compile error")


def close(got, want, what: str, rtol=1e-5, atol=1e-6) -> None:
    got = np.asarray(got)
    assert got.shape == np.shape(want), f"{what}: shape {got.shape} != {np.shape(want)}"
    assert np.allclose(got, want, rtol=rtol, atol=atol), f"{what}: {got} != {want}"


def compute() -> None:
    """jnp ops, jit, grad, reductions and matmul on both crosshost devices
    give numpy's results, on the device of their inputs."""
    jax = jax_x64()
    import jax.numpy as jnp

    rng = np.random.default_rng(5)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    b = rng.standard_normal((7, 3)).astype(np.float32)
    ints = rng.integers(-50, 50, size=(4, 6)).astype(np.int32)
    for d in jax.devices("crosshost"):
        x, y, n = (jax.device_put(v, d) for v in (a, b, ints))
        for got, want, what in [
            (jnp.sin(x), np.sin(a), "sin"),
            (jnp.exp(x) * 2 + 1, np.exp(a) * 2 + 1, "elementwise"),
            (jnp.tanh(x).T, np.tanh(a).T, "transpose"),
            (x.sum(), a.sum(), "sum"),
            (x.mean(axis=0), a.mean(axis=0), "mean"),
            (x.max(axis=1), a.max(axis=1), "max"),
            (jnp.argmax(x, axis=1), np.argmax(a, axis=1), "argmax"),
            (x @ y, a @ b, "matmul"),
            (jnp.einsum("ij,jk->ik", x, y), a @ b, "einsum"),
            (n * 3 - 7, ints * 3 - 7, "int32"),
            ((n % 5) == 0, (ints % 5) == 0, "bool"),
            (jnp.cumsum(x, axis=1), np.cumsum(a, axis=1), "cumsum"),
        ]:
            assert got.devices() == {d}, (what, got.devices())
            close(got, want, f"{what} on {d.id}", rtol=1e-4, atol=1e-5)
        f = jax.jit(lambda u, v: jnp.tanh(u @ v).sum(axis=0))
        close(f(x, y), np.tanh(a @ b).sum(axis=0), f"jit on {d.id}", rtol=1e-4, atol=1e-5)
        g = jax.grad(lambda u: (jnp.sin(u) ** 2).sum())
        close(g(x), 2 * np.sin(a) * np.cos(a), f"grad on {d.id}", rtol=1e-4, atol=1e-5)
        v = jax.vmap(lambda row: row @ y)(x)
        close(v, a @ b, f"vmap on {d.id}", rtol=1e-4, atol=1e-5)
        x64 = jax.device_put(a.astype(np.float64), d)
        close(jnp.linalg.norm(x64), np.linalg.norm(a.astype(np.float64)), "float64 norm")
    # A result of jit moves to the other device and computes there.
    d0, d1 = jax.devices("crosshost")
    out = jax.jit(lambda u: u * 10)(jax.device_put(a, d0))
    moved = jax.device_put(out, d1)
    assert moved.devices() == {d1}
    close(moved, a * 10, "device-to-device after jit")
    close(moved + 1, a * 10 + 1, "compute after device-to-device")


def compute_errors() -> None:
    """An error inside a program (the compute plugin rejects it) is a JAX
    error, and the backend keeps working."""
    jax = jax_x64()
    import jax.numpy as jnp

    d0 = jax.devices("crosshost")[0]
    x = jax.device_put(np.arange(4, dtype=np.float32), d0)
    for attempt in range(2):
        try:
            call = jax.ffi.ffi_call("crosshost_no_such_target", jax.ShapeDtypeStruct((4,), jnp.float32))
            np.asarray(jax.jit(lambda v: call() + v)(x))
        except jax.errors.JaxRuntimeError as e:
            assert "crosshost_no_such_target" in str(e), str(e)
            assert "compute plugin" in str(e), str(e)
        else:
            raise AssertionError(f"a program calling an unknown target ran (attempt {attempt})")
        close(jnp.cos(x), np.cos(np.arange(4, dtype=np.float32)), "compute after the error")


def installed_package() -> None:
    # Run by the test with no plugin environment variables at all: the
    # package found on the path registers its own library.
    import jax

    devs = jax.devices("crosshost")
    assert [d.id for d in devs] == [0, 1], devs
    x = jax.device_put(np.arange(5, dtype=np.int32), devs[1])
    same(np.asarray(x), np.arange(5, dtype=np.int32), "installed package")
    import jax_plugins.crosshost as plugin

    assert plugin.registered_library() == str(plugin.packaged_library()), plugin.registered_library()
    # CPU stays the default backend unless JAX_PLATFORMS selects crosshost.
    assert jax.default_backend() == "cpu", jax.default_backend()
    metrics = plugin.metrics()
    assert len(metrics) == 1 and metrics[0]["process_index"] == 0, metrics
    if DELEGATED:
        # The [cpu] extra's plugin computes, with no configuration at all.
        import fastatomstruct_xla_cpu
        import jax.numpy as jnp

        assert plugin.configured_compute_plugin() == fastatomstruct_xla_cpu.library_path()
        close(jnp.sin(x), np.sin(np.arange(5, dtype=np.int32)), "compute out of the box")
        assert jnp.sin(x).devices() == {devs[1]}


def crosshost_beside_cpu() -> None:
    # JAX_PLATFORMS=crosshost,cpu: crosshost is the default, CPU computes.
    jax = jax_x64()
    import jax.numpy as jnp

    assert jax.default_backend() == "crosshost"
    cpu = jax.devices("cpu")[0]
    d1 = jax.devices("crosshost")[1]
    a = jnp.sin(jax.device_put(np.linspace(0, 1, 50), cpu))
    b = jax.device_put(a, d1)
    assert b.devices() == {d1}
    same(np.asarray(b), np.asarray(a), "cpu -> crosshost")
    c = jax.device_put(b, cpu)
    same(np.asarray(c * 1.0), np.asarray(a), "crosshost -> cpu")


SCENARIOS = {
    f.__name__: f
    for f in (
        devices,
        options_from_env,
        options_from_initialize,
        round_trips,
        device_to_device,
        compute_unimplemented,
        compute,
        compute_errors,
        installed_package,
        crosshost_beside_cpu,
    )
}

if __name__ == "__main__":
    name = sys.argv[1]
    SCENARIOS[name]()
    print(f"{name} OK", flush=True)
