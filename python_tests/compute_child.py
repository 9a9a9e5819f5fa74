"""Scenarios of test_compute_delegation.py, each in its own process: the
compute plugin is per process and chosen when the library is loaded.

    python compute_child.py SCENARIO [ARG]

Prints ``SCENARIO OK`` on success; any assertion fails the child.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pjrt_ctypes as pc  # noqa: E402

EC = pc.ErrorCode


def api() -> pc.Api:
    return pc.Api(os.environ["PJRT_CROSSHOST_LIB"])


def expect_create_error(a: pc.Api, code: int, *needles: str, options=None) -> str:
    try:
        a.create_client(options or {})
    except pc.PjrtError as e:
        assert e.code == code, (e.code, str(e))
        for n in needles:
            assert n in str(e), f"{n!r} not in {e}"
        return str(e)
    raise AssertionError("client creation succeeded")


def bad_plugin(path: str, *needles: str) -> None:
    """The configured compute plugin cannot be used: GetPjrtApi and
    Plugin_Initialize still work, client creation fails naming the plugin and
    what is wrong, and an embedded client is still possible."""
    a = api()
    a.initialize()
    assert "xla_version" not in a.attributes()
    expect_create_error(a, EC.FAILED_PRECONDITION, path, *needles)
    with a.create_client({"compute_plugin": ""}) as c:
        assert [d.kind() for d in c.addressable_devices()] == ["crosshost-host"] * 2


def delegated_client() -> None:
    """With a good compute plugin: its attributes and extensions are ours, the
    client's devices are its devices, and the embedded backend can still be
    chosen per client."""
    a = api()
    a.initialize()
    attrs = a.attributes()
    assert attrs["supports_cross_host_transfers"][1] is True, attrs
    for name in ("xla_version", "stablehlo_current_version", "stablehlo_minimum_version"):
        assert name in attrs, (name, attrs)
    types = [t for t, _, _ in a.extensions()]
    assert types[0] == pc.ExtensionType.CrossHostTransfers, types
    assert types.count(pc.ExtensionType.CrossHostTransfers) == 1, types
    assert pc.ExtensionType.Layouts in types and pc.ExtensionType.FFI in types, types
    with a.create_client() as c:
        assert c.platform_name() == "crosshost"
        kinds = [d.kind() for d in c.addressable_devices()]
        assert kinds == ["cpu", "cpu"], kinds
        a2 = a.call("PJRT_Client_PlatformVersion", client=c.handle)
        version = pc._string(a2.platform_version, a2.platform_version_size)
        assert "compute: cpu" in version, version
        with a.create_client({"compute_plugin": "", "num_devices": 3}) as embedded:
            assert [d.kind() for d in embedded.addressable_devices()] == ["crosshost-host"] * 3
    # One compute plugin per process; backend and compute_plugin exclude each other.
    expect_create_error(a, EC.INVALID_ARGUMENT, "one per process",
                        options={"compute_plugin": "/no/such/other/plugin.so"})
    expect_create_error(a, EC.INVALID_ARGUMENT, "exclude each other",
                        options={"compute_plugin": os.environ["PJRT_CROSSHOST_COMPUTE_PLUGIN"],
                                 "backend": "host"})
    # Options under the compute. prefix reach the compute plugin's client.
    with a.create_client({"compute.cpu_device_count": 3}) as c3:
        assert len(c3.addressable_devices()) == 3
    # XLA's 0.106 CPU plugin aborts the process on a mistyped option: checked first.
    expect_create_error(a, EC.INVALID_ARGUMENT, "'compute.cpu_device_count' must be int64",
                        options={"compute.cpu_device_count": "three"})
    expect_create_error(a, EC.INVALID_ARGUMENT, "'compute.asynchronous' must be bool",
                        options={"compute.asynchronous": 1})


SCENARIOS = {"bad_plugin": bad_plugin, "delegated_client": delegated_client}

if __name__ == "__main__":
    name = sys.argv[1]
    SCENARIOS[name](*sys.argv[2:])
    print(f"{name} OK", flush=True)
