"""C ABI rules (docs/DESIGN.md §8): NULL args, short struct_size, NULL handles,
functions not offered, bad arguments. Every one is an error value with the
right code and a message naming the function, never a crash.

Anything that could crash runs in a child process: the NULL-args sweep runs
all 138 slots in one child that is restarted after the slot that crashed, and
the other tests are ``isolated`` (one child each)."""

from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest

import pjrt_ctypes as pc
from conftest import run_child_python
from pjrt_ctypes import ErrorCode

# ----------------------------------------------------------- NULL args sweep

_SWEEP_CHILD = """
start = int(sys.argv[1]) if len(sys.argv) > 1 else START
for name in pc.API_SLOTS[start:]:
    print("BEGIN " + name, flush=True)
    err = api.raw_call(name, None)
    if name in pc.VOID_SLOTS:
        rec = {"name": name, "void": True}
    elif not err:
        rec = {"name": name, "code": 0, "message": ""}
    else:
        code, msg = api.error_info(err)
        rec = {"name": name, "code": code, "message": msg}
    print("RESULT " + json.dumps(rec), flush=True)
"""


@pytest.fixture(scope="module")
def null_args_results() -> dict:
    results: dict = {}
    start = 0
    while start < len(pc.API_SLOTS):
        proc = run_child_python(_SWEEP_CHILD.replace("START", str(start)))
        last_begin = None
        for line in proc.stdout.splitlines():
            if line.startswith("BEGIN "):
                last_begin = line[6:]
            elif line.startswith("RESULT "):
                rec = json.loads(line[7:])
                results[rec["name"]] = rec
                last_begin = None
        if proc.returncode == 0 and last_begin is None:
            break
        crashed = last_begin or pc.API_SLOTS[start]
        results[crashed] = {
            "name": crashed,
            "crash": proc.returncode,
            "stderr": proc.stderr[-1500:],
        }
        start = pc.API_SLOTS.index(crashed) + 1
    return results


@pytest.mark.parametrize("name", pc.API_SLOTS)
def test_null_args_is_an_error_naming_the_function_never_a_crash(null_args_results, name):
    rec = null_args_results.get(name)
    assert rec is not None, f"{name} was never reached"
    assert "crash" not in rec, (
        f"{name}(NULL) crashed the process (exit {rec['crash']}):\n{rec['stderr']}"
    )
    if rec.get("void"):
        return  # PJRT_Error_Destroy / PJRT_Error_Message return nothing: not crashing is all.
    assert rec["code"] != 0, f"{name}(NULL) returned no error"
    assert rec["code"] in (ErrorCode.INVALID_ARGUMENT, ErrorCode.UNIMPLEMENTED), rec
    assert name in rec["message"], f"message does not name {name}: {rec['message']!r}"


# Implemented functions across every area: NULL args must be INVALID_ARGUMENT.
IMPLEMENTED_SAMPLE = [
    "PJRT_Error_GetCode",
    "PJRT_Plugin_Initialize",
    "PJRT_Plugin_Attributes",
    "PJRT_Event_Destroy",
    "PJRT_Event_IsReady",
    "PJRT_Event_Error",
    "PJRT_Event_Await",
    "PJRT_Event_OnReady",
    "PJRT_Event_Create",
    "PJRT_Event_Set",
    "PJRT_Client_Create",
    "PJRT_Client_Destroy",
    "PJRT_Client_PlatformName",
    "PJRT_Client_Devices",
    "PJRT_Client_LookupDevice",
    "PJRT_Client_AddressableMemories",
    "PJRT_Client_BufferFromHostBuffer",
    "PJRT_DeviceDescription_Id",
    "PJRT_DeviceDescription_Kind",
    "PJRT_Device_GetDescription",
    "PJRT_Device_DefaultMemory",
    "PJRT_Device_MemoryStats",
    "PJRT_Memory_Kind",
    "PJRT_Memory_AddressableByDevices",
    "PJRT_Buffer_Destroy",
    "PJRT_Buffer_Dimensions",
    "PJRT_Buffer_ToHostBuffer",
    "PJRT_Buffer_Delete",
    "PJRT_Buffer_CopyToDevice",
    "PJRT_Buffer_CopyToMemory",
    "PJRT_Buffer_CopyRawToHost",
    "PJRT_Buffer_UnsafePointer",
    "PJRT_Buffer_IncreaseExternalReferenceCount",
]


@pytest.mark.parametrize("name", IMPLEMENTED_SAMPLE)
def test_null_args_to_an_implemented_function_is_invalid_argument(null_args_results, name):
    rec = null_args_results[name]
    assert "crash" not in rec, f"{name}(NULL) crashed"
    assert rec["code"] == ErrorCode.INVALID_ARGUMENT, rec


# ---------------------------------------------------------- short struct_size


def _short_call(api, name, struct_size, **fields):
    a = api.args(name, **fields)
    a.struct_size = struct_size
    err = api.raw_call(name, a)
    return a, (api.to_exception(name, err) if err else None)


def _assert_rejected(err, name):
    assert err is not None, f"{name} accepted a struct_size too small for its fields"
    assert err.code == ErrorCode.INVALID_ARGUMENT, err
    assert name in err.message, err.message


@pytest.mark.isolated
@pytest.mark.parametrize("size", [0, 8, 16], ids=lambda s: f"size{s}")
def test_client_devices_with_header_only_struct_size_is_invalid_argument(client, size):
    _, err = _short_call(client.api, "PJRT_Client_Devices", size, client=client.handle)
    _assert_rejected(err, "PJRT_Client_Devices")


@pytest.mark.isolated
def test_struct_size_one_output_short_is_invalid_argument(client):
    api = client.api
    A = pc.ARGS["PJRT_Client_Devices"]
    _, err = _short_call(api, "PJRT_Client_Devices", A.num_devices.offset, client=client.handle)
    _assert_rejected(err, "PJRT_Client_Devices")
    A = pc.ARGS["PJRT_Client_LookupDevice"]
    _, err = _short_call(api, "PJRT_Client_LookupDevice", A.device.offset, client=client.handle, id=0)
    _assert_rejected(err, "PJRT_Client_LookupDevice")


@pytest.mark.isolated
def test_error_get_code_with_struct_too_short_for_code_is_invalid_argument(api):
    a = api.args("PJRT_Client_LookupDevice", client=None, id=0)
    raw = api.raw_call("PJRT_Client_LookupDevice", a)  # NULL client -> an error to query
    assert raw
    g = api.args("PJRT_Error_GetCode", error=raw)
    g.struct_size = pc.ARGS["PJRT_Error_GetCode"].code.offset
    err = api.raw_call("PJRT_Error_GetCode", g)
    api.destroy_error(raw)
    assert err, "GetCode accepted a struct without room for `code`"
    code, msg = api.error_info(err)
    assert code == ErrorCode.INVALID_ARGUMENT
    assert "PJRT_Error_GetCode" in msg


@pytest.mark.isolated
def test_buffer_from_host_buffer_with_struct_size_short_of_buffer_is_invalid_argument(client):
    api = client.api
    data = np.arange(4, dtype=np.float32)
    dims = (ctypes.c_int64 * 1)(4)
    A = pc.ARGS["PJRT_Client_BufferFromHostBuffer"]
    _, err = _short_call(
        api,
        "PJRT_Client_BufferFromHostBuffer",
        A.buffer.offset,
        client=client.handle,
        data=data.ctypes.data,
        type=int(pc.BufferType.F32),
        dims=dims,
        num_dims=1,
        device=client.devices()[0].handle,
    )
    _assert_rejected(err, "PJRT_Client_BufferFromHostBuffer")


@pytest.mark.isolated
def test_to_host_buffer_with_struct_size_short_of_event_is_invalid_argument(client):
    buf = client.buffer_from_host(np.arange(4, dtype=np.float32))
    dst = ctypes.create_string_buffer(16)
    A = pc.ARGS["PJRT_Buffer_ToHostBuffer"]
    _, err = _short_call(
        client.api, "PJRT_Buffer_ToHostBuffer", A.event.offset,
        src=buf.handle, dst=ctypes.addressof(dst), dst_size=16,
    )
    _assert_rejected(err, "PJRT_Buffer_ToHostBuffer")


@pytest.mark.isolated
def test_event_await_and_device_get_description_with_struct_size_16_are_invalid_argument(client):
    api = client.api
    ev = api.create_event()
    ev.set()
    _, err = _short_call(api, "PJRT_Event_Await", 16, event=ev.handle)
    _assert_rejected(err, "PJRT_Event_Await")
    ev.destroy()
    _, err = _short_call(
        api, "PJRT_Device_GetDescription", 16, device=client.devices()[0].handle
    )
    _assert_rejected(err, "PJRT_Device_GetDescription")


@pytest.mark.isolated
def test_client_create_with_struct_size_0_is_invalid_argument(api):
    a, err = _short_call(api, "PJRT_Client_Create", 0)
    _assert_rejected(err, "PJRT_Client_Create")
    assert not a.client


# ------------------------------------------------------------- NULL handles


@pytest.mark.isolated
@pytest.mark.parametrize(
    "name,field",
    [
        ("PJRT_Client_Devices", "client"),
        ("PJRT_Client_PlatformName", "client"),
        ("PJRT_Device_GetDescription", "device"),
        ("PJRT_Device_DefaultMemory", "device"),
        ("PJRT_DeviceDescription_Id", "device_description"),
        ("PJRT_Memory_Kind", "memory"),
        ("PJRT_Buffer_Dimensions", "buffer"),
        ("PJRT_Buffer_ElementType", "buffer"),
        ("PJRT_Buffer_ToHostBuffer", "src"),
        ("PJRT_Buffer_IsDeleted", "buffer"),
        ("PJRT_Event_Await", "event"),
        ("PJRT_Event_IsReady", "event"),
        ("PJRT_Event_Set", "event"),
        ("PJRT_Error_GetCode", "error"),
    ],
)
def test_null_handle_inside_args_is_invalid_argument(api, name, field):
    a, err = api.try_call(name, **{field: None})
    assert err is not None, f"{name} with NULL {field} succeeded"
    assert err.code == ErrorCode.INVALID_ARGUMENT
    assert name in err.message


# ---------------------------------------------- BufferFromHostBuffer misuse


def _bfhb(client, **over):
    data = np.arange(6, dtype=np.float32)
    dims = (ctypes.c_int64 * 2)(2, 3)
    fields = dict(
        client=client.handle,
        data=data.ctypes.data,
        type=int(pc.BufferType.F32),
        dims=dims,
        num_dims=2,
        device=client.devices()[0].handle,
    )
    fields.update(over)
    a, err = client.api.try_call("PJRT_Client_BufferFromHostBuffer", **fields)
    if err is None and a.buffer:
        client.api.call("PJRT_Buffer_Destroy", buffer=a.buffer)
    if a.done_with_host_buffer:
        client.api.call("PJRT_Event_Destroy", event=a.done_with_host_buffer)
    return err


@pytest.mark.isolated
def test_buffer_from_host_without_device_or_memory_is_invalid_argument(client):
    err = _bfhb(client, device=None, memory=None)
    assert err is not None and err.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.isolated
def test_buffer_from_host_with_null_data_for_a_non_empty_array_is_invalid_argument(client):
    err = _bfhb(client, data=None)
    assert err is not None and err.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.isolated
def test_buffer_from_host_with_null_dims_and_rank_2_is_invalid_argument(client):
    err = _bfhb(client, dims=None)
    assert err is not None and err.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.isolated
def test_buffer_from_host_with_negative_dim_is_invalid_argument(client):
    dims = (ctypes.c_int64 * 2)(2, -3)
    err = _bfhb(client, dims=dims)
    assert err is not None and err.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.isolated
def test_buffer_from_host_with_byte_strides_count_not_matching_rank_is_invalid_argument(client):
    strides = (ctypes.c_int64 * 1)(4)
    err = _bfhb(client, byte_strides=strides, num_byte_strides=1)
    assert err is not None and err.code == ErrorCode.INVALID_ARGUMENT


@pytest.mark.isolated
@pytest.mark.parametrize("t", [pc.BufferType.INVALID, pc.BufferType.TOKEN, 999])
def test_buffer_from_host_with_invalid_element_type_is_an_error(client, t):
    err = _bfhb(client, type=int(t))
    assert err is not None
    assert err.code in (ErrorCode.INVALID_ARGUMENT, ErrorCode.UNIMPLEMENTED)


@pytest.mark.isolated
def test_to_host_buffer_with_dst_size_too_small_is_an_error(client):
    buf = client.buffer_from_host(np.arange(4, dtype=np.float32))
    dst = ctypes.create_string_buffer(16)
    a, err = client.api.try_call(
        "PJRT_Buffer_ToHostBuffer", src=buf.handle, dst=ctypes.addressof(dst), dst_size=15
    )
    if err is None and a.event:
        ev = pc.Event(client.api, a.event)
        err = ev.await_status()
        ev.destroy()
    assert err is not None, "ToHostBuffer wrote 16 bytes into a 15-byte dst"
    assert err.code == ErrorCode.INVALID_ARGUMENT


# ------------------------------------------------------ functions not offered


@pytest.mark.isolated
def test_client_compile_is_unimplemented_naming_the_function(client):
    code = b"module {}"
    fmt = b"mlir"
    cbuf = ctypes.create_string_buffer(code)
    fbuf = ctypes.create_string_buffer(fmt)
    prog = pc.PJRT_Program.new(
        code=ctypes.addressof(cbuf), code_size=len(code),
        format=ctypes.addressof(fbuf), format_size=len(fmt),
    )
    _, err = client.api.try_call(
        "PJRT_Client_Compile", client=client.handle, program=ctypes.pointer(prog)
    )
    assert err is not None
    assert err.code == ErrorCode.UNIMPLEMENTED
    assert "PJRT_Client_Compile" in err.message


@pytest.mark.isolated
def test_pjrt_compile_is_unimplemented_naming_the_function(client):
    prog = pc.PJRT_Program.new()
    _, err = client.api.try_call(
        "PJRT_Compile", client=client.handle, program=ctypes.pointer(prog)
    )
    assert err is not None
    assert err.code == ErrorCode.UNIMPLEMENTED
    assert "PJRT_Compile" in err.message


@pytest.mark.isolated
def test_topology_description_create_is_unimplemented_naming_the_function(api):
    name = b"crosshost"
    nbuf = ctypes.create_string_buffer(name)
    _, err = api.try_call(
        "PJRT_TopologyDescription_Create",
        topology_name=ctypes.addressof(nbuf), topology_name_size=len(name),
    )
    assert err is not None
    assert err.code == ErrorCode.UNIMPLEMENTED
    assert "PJRT_TopologyDescription_Create" in err.message


@pytest.mark.isolated
def test_loaded_executable_execute_is_unimplemented_naming_the_function(api):
    _, err = api.try_call("PJRT_LoadedExecutable_Execute")
    assert err is not None
    assert err.code == ErrorCode.UNIMPLEMENTED
    assert "PJRT_LoadedExecutable_Execute" in err.message


@pytest.mark.isolated
def test_executable_deserialize_and_load_is_unimplemented(client):
    blob = ctypes.create_string_buffer(b"\x00" * 8)
    _, err = client.api.try_call(
        "PJRT_Executable_DeserializeAndLoad", client=client.handle,
        serialized_executable=ctypes.addressof(blob), serialized_executable_size=8,
    )
    assert err is not None
    assert err.code == ErrorCode.UNIMPLEMENTED
    assert "PJRT_Executable_DeserializeAndLoad" in err.message
