"""ctypes view of the PJRT C API (0.114) and a small wrapper over it.

Layouts are written by hand from pjrt_c_api/xla/pjrt/c/pjrt_c_api.h; the
test ``test_struct_layouts.py`` compiles a C program against that header and
checks every struct size and field offset declared here, so a mistake here
fails loudly instead of corrupting memory.

Conventions:
* Every ``*_Args`` struct starts with ``struct_size`` and ``extension_start``;
  ``STRUCT_SIZE`` is ``offsetof(last) + sizeof(last)``, as the header's
  ``PJRT_DEFINE_STRUCT_TRAITS`` computes it.
* Opaque handles (``PJRT_Client*``, ``PJRT_Buffer*``...) are ``c_void_p``.
* ``Api.call(name, **fields)`` fills an args struct, calls the slot and
  raises :class:`PjrtError` (carrying the PJRT error code) on failure.
"""

from __future__ import annotations

import ctypes
import enum
import threading
from ctypes import (
    POINTER,
    c_bool,
    c_char_p,
    c_float,
    c_int,
    c_int64,
    c_size_t,
    c_void_p,
)

import numpy as np

c_uintptr = ctypes.c_size_t  # uintptr_t on LP64
c_enum = c_int

PJRT_API_MAJOR = 0
PJRT_API_MINOR = 114


class ErrorCode(enum.IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class NamedValueType(enum.IntEnum):
    kString = 0
    kInt64 = 1
    kInt64List = 2
    kFloat = 3
    kBool = 4


class BufferType(enum.IntEnum):
    INVALID = 0
    PRED = 1
    S8 = 2
    S16 = 3
    S32 = 4
    S64 = 5
    U8 = 6
    U16 = 7
    U32 = 8
    U64 = 9
    F16 = 10
    F32 = 11
    F64 = 12
    BF16 = 13
    C64 = 14
    C128 = 15
    F8E5M2 = 16
    F8E4M3FN = 17
    F8E4M3B11FNUZ = 18
    F8E5M2FNUZ = 19
    F8E4M3FNUZ = 20
    S4 = 21
    U4 = 22
    TOKEN = 23
    S2 = 24
    U2 = 25
    F8E4M3 = 26
    F8E3M4 = 27
    F8E8M0FNU = 28
    F4E2M1FN = 29
    S1 = 30
    U1 = 31
    F6E2M3FN = 32
    F6E3M2FN = 33


class HostBufferSemantics(enum.IntEnum):
    kImmutableOnlyDuringCall = 0
    kImmutableUntilTransferCompletes = 1
    kImmutableZeroCopy = 2
    kMutableZeroCopy = 3


class MemoryLayoutType(enum.IntEnum):
    Tiled = 0
    Strides = 1


class ExtensionType(enum.IntEnum):
    Gpu_Custom_Call = 0
    Profiler = 1
    Custom_Partitioner = 2
    Stream = 3
    Layouts = 4
    FFI = 5
    MemoryDescriptions = 6
    Triton = 7
    RawBuffer = 8
    PhaseCompile = 9
    Example = 10
    Unknown = 11
    CrossHostTransfers = 12
    ExecutableMetadata = 13
    Callback = 14
    HostAllocator = 15
    TpuTopology = 16
    TpuExecutable = 17
    Megascale = 18
    Shardings = 19
    AbiVersion = 20
    Collectives = 21
    MultiSlice = 22
    HostMemoryAllocator = 23
    XlaTransform = 24


# Host representation used by the tests for each element type: the numpy
# dtype whose bytes are exactly the device bytes. Types numpy lacks (bf16,
# the f8 family) travel as raw unsigned integers of the same width; sub-byte
# types are stored unpacked, one byte per element.
HOST_DTYPE = {
    BufferType.PRED: np.dtype(np.bool_),
    BufferType.S8: np.dtype(np.int8),
    BufferType.S16: np.dtype(np.int16),
    BufferType.S32: np.dtype(np.int32),
    BufferType.S64: np.dtype(np.int64),
    BufferType.U8: np.dtype(np.uint8),
    BufferType.U16: np.dtype(np.uint16),
    BufferType.U32: np.dtype(np.uint32),
    BufferType.U64: np.dtype(np.uint64),
    BufferType.F16: np.dtype(np.float16),
    BufferType.F32: np.dtype(np.float32),
    BufferType.F64: np.dtype(np.float64),
    BufferType.BF16: np.dtype(np.uint16),
    BufferType.C64: np.dtype(np.complex64),
    BufferType.C128: np.dtype(np.complex128),
    BufferType.F8E5M2: np.dtype(np.uint8),
    BufferType.F8E4M3FN: np.dtype(np.uint8),
    BufferType.F8E4M3B11FNUZ: np.dtype(np.uint8),
    BufferType.F8E5M2FNUZ: np.dtype(np.uint8),
    BufferType.F8E4M3FNUZ: np.dtype(np.uint8),
    BufferType.F8E4M3: np.dtype(np.uint8),
    BufferType.F8E3M4: np.dtype(np.uint8),
    BufferType.F8E8M0FNU: np.dtype(np.uint8),
    BufferType.S4: np.dtype(np.int8),
    BufferType.U4: np.dtype(np.uint8),
    BufferType.S2: np.dtype(np.int8),
    BufferType.U2: np.dtype(np.uint8),
    BufferType.F4E2M1FN: np.dtype(np.uint8),
}

# numpy dtype -> PJRT type, for the dtypes numpy has natively.
NUMPY_TO_PJRT = {
    np.dtype(np.bool_): BufferType.PRED,
    np.dtype(np.int8): BufferType.S8,
    np.dtype(np.int16): BufferType.S16,
    np.dtype(np.int32): BufferType.S32,
    np.dtype(np.int64): BufferType.S64,
    np.dtype(np.uint8): BufferType.U8,
    np.dtype(np.uint16): BufferType.U16,
    np.dtype(np.uint32): BufferType.U32,
    np.dtype(np.uint64): BufferType.U64,
    np.dtype(np.float16): BufferType.F16,
    np.dtype(np.float32): BufferType.F32,
    np.dtype(np.float64): BufferType.F64,
    np.dtype(np.complex64): BufferType.C64,
    np.dtype(np.complex128): BufferType.C128,
}


# --------------------------------------------------------------------------
# Structs
# --------------------------------------------------------------------------

STRUCTS: dict[str, type] = {}  # C name -> ctypes class (for the layout test)
ARGS: dict[str, type] = {}  # PJRT function name -> its *_Args class


class PjrtStruct(ctypes.Structure):
    """Base: STRUCT_SIZE is offsetof(last) + sizeof(last), as in the header."""

    STRUCT_SIZE = 0  # set by _finish() once _fields_ are known

    @classmethod
    def _compute_struct_size(cls) -> int:
        last = cls._fields_[-1][0]
        f = getattr(cls, last)
        return f.offset + f.size

    @classmethod
    def offset_of(cls, field: str) -> int:
        return getattr(cls, field).offset

    @classmethod
    def new(cls, **fields):
        obj = cls()
        if any(name == "struct_size" for name, *_ in cls._fields_):
            obj.struct_size = cls.STRUCT_SIZE
        for k, v in fields.items():
            setattr(obj, k, v)
        return obj


def _struct(name, fields, anonymous=()):
    attrs = {"_fields_": fields}
    if anonymous:
        attrs["_anonymous_"] = tuple(anonymous)
    cls = type(name, (PjrtStruct,), attrs)
    return _finish(cls)


def _finish(cls):
    cls.STRUCT_SIZE = cls._compute_struct_size()
    STRUCTS[cls.__name__] = cls
    return cls


class PJRT_Extension_Base(PjrtStruct):
    pass


PJRT_Extension_Base._fields_ = [
    ("struct_size", c_size_t),
    ("type", c_enum),
    ("next", POINTER(PJRT_Extension_Base)),
]
_finish(PJRT_Extension_Base)

_HEAD = [("struct_size", c_size_t), ("extension_start", POINTER(PJRT_Extension_Base))]


def _args(fn_name, fields, anonymous=()):
    cls = _struct(fn_name + "_Args", _HEAD + fields, anonymous)
    ARGS[fn_name] = cls
    return cls


PJRT_Api_Version = _struct(
    "PJRT_Api_Version", _HEAD + [("major_version", c_int), ("minor_version", c_int)]
)


class _NamedValueUnion(ctypes.Union):
    _fields_ = [
        ("string_value", c_void_p),
        ("int64_value", c_int64),
        ("int64_array_value", POINTER(c_int64)),
        ("float_value", c_float),
        ("bool_value", c_bool),
    ]


PJRT_NamedValue = _struct(
    "PJRT_NamedValue",
    _HEAD
    + [
        ("name", c_void_p),
        ("name_size", c_size_t),
        ("type", c_enum),
        ("u", _NamedValueUnion),
        ("value_size", c_size_t),
    ],
    anonymous=("u",),
)

PJRT_Buffer_MemoryLayout_Tiled = _struct(
    "PJRT_Buffer_MemoryLayout_Tiled",
    _HEAD
    + [
        ("minor_to_major", POINTER(c_int64)),
        ("minor_to_major_size", c_size_t),
        ("tile_dims", POINTER(c_int64)),
        ("tile_dim_sizes", POINTER(c_size_t)),
        ("num_tiles", c_size_t),
    ],
)
PJRT_Buffer_MemoryLayout_Strides = _struct(
    "PJRT_Buffer_MemoryLayout_Strides",
    _HEAD + [("byte_strides", POINTER(c_int64)), ("num_byte_strides", c_size_t)],
)


class _LayoutUnion(ctypes.Union):
    _fields_ = [
        ("tiled", PJRT_Buffer_MemoryLayout_Tiled),
        ("strides", PJRT_Buffer_MemoryLayout_Strides),
    ]


PJRT_Buffer_MemoryLayout = _struct(
    "PJRT_Buffer_MemoryLayout",
    _HEAD + [("u", _LayoutUnion), ("type", c_enum)],
    anonymous=("u",),
)

PJRT_Program = _struct(
    "PJRT_Program",
    _HEAD
    + [
        ("code", c_void_p),
        ("code_size", c_size_t),
        ("format", c_void_p),
        ("format_size", c_size_t),
    ],
)

# Callbacks
PJRT_Event_OnReadyCallback = ctypes.CFUNCTYPE(None, c_void_p, c_void_p)

# ---- errors
_args("PJRT_Error_Destroy", [("error", c_void_p)])
_args(
    "PJRT_Error_Message",
    [("error", c_void_p), ("message", c_void_p), ("message_size", c_size_t)],
)
_args("PJRT_Error_GetCode", [("error", c_void_p), ("code", c_enum)])

# ---- plugin
_args("PJRT_Plugin_Initialize", [])
_args(
    "PJRT_Plugin_Attributes",
    [("attributes", POINTER(PJRT_NamedValue)), ("num_attributes", c_size_t)],
)

# ---- events
_args("PJRT_Event_Destroy", [("event", c_void_p)])
_args("PJRT_Event_IsReady", [("event", c_void_p), ("is_ready", c_bool)])
_args("PJRT_Event_Error", [("event", c_void_p)])
_args("PJRT_Event_Await", [("event", c_void_p)])
_args(
    "PJRT_Event_OnReady",
    [("event", c_void_p), ("callback", PJRT_Event_OnReadyCallback), ("user_arg", c_void_p)],
)
_args("PJRT_Event_Create", [("event", c_void_p)])
_args(
    "PJRT_Event_Set",
    [
        ("event", c_void_p),
        ("error_code", c_enum),
        ("error_message", c_void_p),
        ("error_message_size", c_size_t),
    ],
)

# ---- client
_args(
    "PJRT_Client_Create",
    [
        ("create_options", POINTER(PJRT_NamedValue)),
        ("num_options", c_size_t),
        ("kv_get_callback", c_void_p),
        ("kv_get_user_arg", c_void_p),
        ("kv_put_callback", c_void_p),
        ("kv_put_user_arg", c_void_p),
        ("client", c_void_p),
        ("kv_try_get_callback", c_void_p),
        ("kv_try_get_user_arg", c_void_p),
    ],
)
_args("PJRT_Client_Destroy", [("client", c_void_p)])
_args(
    "PJRT_Client_PlatformName",
    [("client", c_void_p), ("platform_name", c_void_p), ("platform_name_size", c_size_t)],
)
_args("PJRT_Client_ProcessIndex", [("client", c_void_p), ("process_index", c_int)])
_args(
    "PJRT_Client_PlatformVersion",
    [
        ("client", c_void_p),
        ("platform_version", c_void_p),
        ("platform_version_size", c_size_t),
    ],
)
_args("PJRT_Client_TopologyDescription", [("client", c_void_p), ("topology", c_void_p)])
_args(
    "PJRT_Client_Devices",
    [("client", c_void_p), ("devices", POINTER(c_void_p)), ("num_devices", c_size_t)],
)
_args(
    "PJRT_Client_AddressableDevices",
    [
        ("client", c_void_p),
        ("addressable_devices", POINTER(c_void_p)),
        ("num_addressable_devices", c_size_t),
    ],
)
_args(
    "PJRT_Client_LookupDevice",
    [("client", c_void_p), ("id", c_int), ("device", c_void_p)],
)
_args(
    "PJRT_Client_LookupAddressableDevice",
    [("client", c_void_p), ("local_hardware_id", c_int), ("addressable_device", c_void_p)],
)
_args(
    "PJRT_Client_AddressableMemories",
    [
        ("client", c_void_p),
        ("addressable_memories", POINTER(c_void_p)),
        ("num_addressable_memories", c_size_t),
    ],
)
_args(
    "PJRT_Client_Compile",
    [
        ("client", c_void_p),
        ("program", POINTER(PJRT_Program)),
        ("compile_options", c_void_p),
        ("compile_options_size", c_size_t),
        ("executable", c_void_p),
    ],
)
_args(
    "PJRT_Client_DefaultDeviceAssignment",
    [
        ("client", c_void_p),
        ("num_replicas", c_int),
        ("num_partitions", c_int),
        ("default_assignment_size", c_size_t),
        ("default_assignment", POINTER(c_int)),
    ],
)
_args(
    "PJRT_Client_BufferFromHostBuffer",
    [
        ("client", c_void_p),
        ("data", c_void_p),
        ("type", c_enum),
        ("dims", POINTER(c_int64)),
        ("num_dims", c_size_t),
        ("byte_strides", POINTER(c_int64)),
        ("num_byte_strides", c_size_t),
        ("host_buffer_semantics", c_enum),
        ("device", c_void_p),
        ("memory", c_void_p),
        ("device_layout", POINTER(PJRT_Buffer_MemoryLayout)),
        ("done_with_host_buffer", c_void_p),
        ("buffer", c_void_p),
    ],
)

# ---- device descriptions
_args("PJRT_DeviceDescription_Id", [("device_description", c_void_p), ("id", c_int)])
_args(
    "PJRT_DeviceDescription_ProcessIndex",
    [("device_description", c_void_p), ("process_index", c_int)],
)
_args(
    "PJRT_DeviceDescription_Attributes",
    [
        ("device_description", c_void_p),
        ("num_attributes", c_size_t),
        ("attributes", POINTER(PJRT_NamedValue)),
    ],
)
_args(
    "PJRT_DeviceDescription_Kind",
    [("device_description", c_void_p), ("device_kind", c_void_p), ("device_kind_size", c_size_t)],
)
_args(
    "PJRT_DeviceDescription_DebugString",
    [
        ("device_description", c_void_p),
        ("debug_string", c_void_p),
        ("debug_string_size", c_size_t),
    ],
)
_args(
    "PJRT_DeviceDescription_ToString",
    [("device_description", c_void_p), ("to_string", c_void_p), ("to_string_size", c_size_t)],
)

# ---- devices
_args(
    "PJRT_Device_GetDescription",
    [("device", c_void_p), ("device_description", c_void_p)],
)
_args("PJRT_Device_IsAddressable", [("device", c_void_p), ("is_addressable", c_bool)])
_args("PJRT_Device_LocalHardwareId", [("device", c_void_p), ("local_hardware_id", c_int)])
_args(
    "PJRT_Device_AddressableMemories",
    [("device", c_void_p), ("memories", POINTER(c_void_p)), ("num_memories", c_size_t)],
)
_args("PJRT_Device_DefaultMemory", [("device", c_void_p), ("memory", c_void_p)])
_MEMSTATS = [("device", c_void_p), ("bytes_in_use", c_int64)]
for _stat in (
    "peak_bytes_in_use",
    "num_allocs",
    "largest_alloc_size",
    "bytes_limit",
    "bytes_reserved",
    "peak_bytes_reserved",
    "bytes_reservable_limit",
    "largest_free_block_bytes",
    "pool_bytes",
    "peak_pool_bytes",
    "peak_allocated_bytes",
):
    _MEMSTATS += [(_stat, c_int64), (_stat + "_is_set", c_bool)]
_args("PJRT_Device_MemoryStats", _MEMSTATS)

# ---- memories
_args("PJRT_Memory_Id", [("memory", c_void_p), ("id", c_int)])
_args("PJRT_Memory_Kind", [("memory", c_void_p), ("kind", c_void_p), ("kind_size", c_size_t)])
_args("PJRT_Memory_Kind_Id", [("memory", c_void_p), ("kind_id", c_int)])
_args(
    "PJRT_Memory_DebugString",
    [("memory", c_void_p), ("debug_string", c_void_p), ("debug_string_size", c_size_t)],
)
_args(
    "PJRT_Memory_ToString",
    [("memory", c_void_p), ("to_string", c_void_p), ("to_string_size", c_size_t)],
)
_args(
    "PJRT_Memory_AddressableByDevices",
    [("memory", c_void_p), ("devices", POINTER(c_void_p)), ("num_devices", c_size_t)],
)

# ---- buffers
_args("PJRT_Buffer_Destroy", [("buffer", c_void_p)])
_args("PJRT_Buffer_ElementType", [("buffer", c_void_p), ("type", c_enum)])
_args(
    "PJRT_Buffer_Dimensions",
    [("buffer", c_void_p), ("dims", POINTER(c_int64)), ("num_dims", c_size_t)],
)
_args(
    "PJRT_Buffer_UnpaddedDimensions",
    [("buffer", c_void_p), ("unpadded_dims", POINTER(c_int64)), ("num_dims", c_size_t)],
)
_args(
    "PJRT_Buffer_DynamicDimensionIndices",
    [
        ("buffer", c_void_p),
        ("dynamic_dim_indices", POINTER(c_size_t)),
        ("num_dynamic_dims", c_size_t),
    ],
)
_args(
    "PJRT_Buffer_GetMemoryLayout",
    [("buffer", c_void_p), ("layout", PJRT_Buffer_MemoryLayout)],
)
_args(
    "PJRT_Buffer_ToHostBuffer",
    [
        ("src", c_void_p),
        ("host_layout", POINTER(PJRT_Buffer_MemoryLayout)),
        ("dst", c_void_p),
        ("dst_size", c_size_t),
        ("event", c_void_p),
    ],
)
_args(
    "PJRT_Buffer_OnDeviceSizeInBytes",
    [("buffer", c_void_p), ("on_device_size_in_bytes", c_size_t)],
)
_args("PJRT_Buffer_Delete", [("buffer", c_void_p)])
_args("PJRT_Buffer_IsDeleted", [("buffer", c_void_p), ("is_deleted", c_bool)])
_args(
    "PJRT_Buffer_CopyRawToHost",
    [
        ("buffer", c_void_p),
        ("dst", c_void_p),
        ("offset", c_int64),
        ("transfer_size", c_int64),
        ("event", c_void_p),
    ],
)
_args(
    "PJRT_Buffer_CopyToDevice",
    [("buffer", c_void_p), ("dst_device", c_void_p), ("dst_buffer", c_void_p)],
)
_args(
    "PJRT_Buffer_CopyToMemory",
    [("buffer", c_void_p), ("dst_memory", c_void_p), ("dst_buffer", c_void_p)],
)
_args("PJRT_Buffer_IsOnCpu", [("buffer", c_void_p), ("is_on_cpu", c_bool)])
_args("PJRT_Buffer_Device", [("buffer", c_void_p), ("device", c_void_p)])
_args("PJRT_Buffer_Memory", [("buffer", c_void_p), ("memory", c_void_p)])
_args("PJRT_Buffer_ReadyEvent", [("buffer", c_void_p), ("event", c_void_p)])
_args("PJRT_Buffer_UnsafePointer", [("buffer", c_void_p), ("buffer_pointer", c_uintptr)])
_args("PJRT_Buffer_IncreaseExternalReferenceCount", [("buffer", c_void_p)])
_args("PJRT_Buffer_DecreaseExternalReferenceCount", [("buffer", c_void_p)])
_args(
    "PJRT_Buffer_OpaqueDeviceMemoryDataPointer",
    [("buffer", c_void_p), ("device_memory_ptr", c_void_p)],
)

# ---- functions the plugin does not offer (used to check UNIMPLEMENTED)
_args(
    "PJRT_Compile",
    [
        ("topology", c_void_p),
        ("program", POINTER(PJRT_Program)),
        ("compile_options", c_void_p),
        ("compile_options_size", c_size_t),
        ("client", c_void_p),
        ("executable", c_void_p),
    ],
)
_args(
    "PJRT_LoadedExecutable_Execute",
    [
        ("executable", c_void_p),
        ("options", c_void_p),
        ("argument_lists", c_void_p),
        ("num_devices", c_size_t),
        ("num_args", c_size_t),
        ("output_lists", c_void_p),
        ("device_complete_events", c_void_p),
        ("execute_device", c_void_p),
    ],
)
_args(
    "PJRT_TopologyDescription_Create",
    [
        ("topology_name", c_void_p),
        ("topology_name_size", c_size_t),
        ("create_options", POINTER(PJRT_NamedValue)),
        ("num_options", c_size_t),
        ("topology", c_void_p),
    ],
)
_args(
    "PJRT_Executable_DeserializeAndLoad",
    [
        ("client", c_void_p),
        ("serialized_executable", c_void_p),
        ("serialized_executable_size", c_size_t),
        ("loaded_executable", c_void_p),
        ("overridden_serialized_compile_options", c_void_p),
        ("overridden_serialized_compile_options_size", c_size_t),
        ("load_options", c_void_p),
    ],
)

# ---- the API table: every field after the version is a function pointer.
API_SLOTS = [
    "PJRT_Error_Destroy",
    "PJRT_Error_Message",
    "PJRT_Error_GetCode",
    "PJRT_Plugin_Initialize",
    "PJRT_Plugin_Attributes",
    "PJRT_Event_Destroy",
    "PJRT_Event_IsReady",
    "PJRT_Event_Error",
    "PJRT_Event_Await",
    "PJRT_Event_OnReady",
    "PJRT_Client_Create",
    "PJRT_Client_Destroy",
    "PJRT_Client_PlatformName",
    "PJRT_Client_ProcessIndex",
    "PJRT_Client_PlatformVersion",
    "PJRT_Client_Devices",
    "PJRT_Client_AddressableDevices",
    "PJRT_Client_LookupDevice",
    "PJRT_Client_LookupAddressableDevice",
    "PJRT_Client_AddressableMemories",
    "PJRT_Client_Compile",
    "PJRT_Client_DefaultDeviceAssignment",
    "PJRT_Client_BufferFromHostBuffer",
    "PJRT_DeviceDescription_Id",
    "PJRT_DeviceDescription_ProcessIndex",
    "PJRT_DeviceDescription_Attributes",
    "PJRT_DeviceDescription_Kind",
    "PJRT_DeviceDescription_DebugString",
    "PJRT_DeviceDescription_ToString",
    "PJRT_Device_GetDescription",
    "PJRT_Device_IsAddressable",
    "PJRT_Device_LocalHardwareId",
    "PJRT_Device_AddressableMemories",
    "PJRT_Device_DefaultMemory",
    "PJRT_Device_MemoryStats",
    "PJRT_Memory_Id",
    "PJRT_Memory_Kind",
    "PJRT_Memory_DebugString",
    "PJRT_Memory_ToString",
    "PJRT_Memory_AddressableByDevices",
    "PJRT_Executable_Destroy",
    "PJRT_Executable_Name",
    "PJRT_Executable_NumReplicas",
    "PJRT_Executable_NumPartitions",
    "PJRT_Executable_NumOutputs",
    "PJRT_Executable_SizeOfGeneratedCodeInBytes",
    "PJRT_Executable_GetCostAnalysis",
    "PJRT_Executable_OutputMemoryKinds",
    "PJRT_Executable_OptimizedProgram",
    "PJRT_Executable_Serialize",
    "PJRT_LoadedExecutable_Destroy",
    "PJRT_LoadedExecutable_GetExecutable",
    "PJRT_LoadedExecutable_AddressableDevices",
    "PJRT_LoadedExecutable_Delete",
    "PJRT_LoadedExecutable_IsDeleted",
    "PJRT_LoadedExecutable_Execute",
    "PJRT_Executable_DeserializeAndLoad",
    "PJRT_LoadedExecutable_Fingerprint",
    "PJRT_Buffer_Destroy",
    "PJRT_Buffer_ElementType",
    "PJRT_Buffer_Dimensions",
    "PJRT_Buffer_UnpaddedDimensions",
    "PJRT_Buffer_DynamicDimensionIndices",
    "PJRT_Buffer_GetMemoryLayout",
    "PJRT_Buffer_OnDeviceSizeInBytes",
    "PJRT_Buffer_Device",
    "PJRT_Buffer_Memory",
    "PJRT_Buffer_Delete",
    "PJRT_Buffer_IsDeleted",
    "PJRT_Buffer_CopyToDevice",
    "PJRT_Buffer_ToHostBuffer",
    "PJRT_Buffer_IsOnCpu",
    "PJRT_Buffer_ReadyEvent",
    "PJRT_Buffer_UnsafePointer",
    "PJRT_Buffer_IncreaseExternalReferenceCount",
    "PJRT_Buffer_DecreaseExternalReferenceCount",
    "PJRT_Buffer_OpaqueDeviceMemoryDataPointer",
    "PJRT_CopyToDeviceStream_Destroy",
    "PJRT_CopyToDeviceStream_AddChunk",
    "PJRT_CopyToDeviceStream_TotalBytes",
    "PJRT_CopyToDeviceStream_GranuleSize",
    "PJRT_CopyToDeviceStream_CurrentBytes",
    "PJRT_TopologyDescription_Create",
    "PJRT_TopologyDescription_Destroy",
    "PJRT_TopologyDescription_PlatformName",
    "PJRT_TopologyDescription_PlatformVersion",
    "PJRT_TopologyDescription_GetDeviceDescriptions",
    "PJRT_TopologyDescription_Serialize",
    "PJRT_TopologyDescription_Attributes",
    "PJRT_Compile",
    "PJRT_Executable_OutputElementTypes",
    "PJRT_Executable_OutputDimensions",
    "PJRT_Buffer_CopyToMemory",
    "PJRT_Client_CreateViewOfDeviceBuffer",
    "PJRT_Executable_Fingerprint",
    "PJRT_Client_TopologyDescription",
    "PJRT_Executable_GetCompiledMemoryStats",
    "PJRT_Memory_Kind_Id",
    "PJRT_ExecuteContext_Create",
    "PJRT_ExecuteContext_Destroy",
    "PJRT_Buffer_CopyRawToHost",
    "PJRT_AsyncHostToDeviceTransferManager_Destroy",
    "PJRT_AsyncHostToDeviceTransferManager_TransferData",
    "PJRT_Client_CreateBuffersForAsyncHostToDevice",
    "PJRT_AsyncHostToDeviceTransferManager_RetrieveBuffer",
    "PJRT_AsyncHostToDeviceTransferManager_Device",
    "PJRT_AsyncHostToDeviceTransferManager_BufferCount",
    "PJRT_AsyncHostToDeviceTransferManager_BufferSize",
    "PJRT_AsyncHostToDeviceTransferManager_SetBufferError",
    "PJRT_AsyncHostToDeviceTransferManager_AddMetadata",
    "PJRT_Client_DmaMap",
    "PJRT_Client_DmaUnmap",
    "PJRT_Client_CreateUninitializedBuffer",
    "PJRT_Client_UpdateGlobalProcessInfo",
    "PJRT_TopologyDescription_Deserialize",
    "PJRT_Client_CreateAliasBuffer",
    "PJRT_Client_FulfillAliasBuffer",
    "PJRT_LoadedExecutable_GetDeviceAssignment",
    "PJRT_Client_CreateErrorBuffer",
    "PJRT_AsyncHostToDeviceTransferManager_TransferLiteral",
    "PJRT_Buffer_CopyRawToHostFuture",
    "PJRT_Device_PoisonExecution",
    "PJRT_Device_CreateAsyncTrackingEvent",
    "PJRT_AsyncTrackingEvent_Destroy",
    "PJRT_Executable_GetCompileOptions",
    "PJRT_Buffer_DonateWithControlDependency",
    "PJRT_Event_Create",
    "PJRT_Event_Set",
    "PJRT_Device_GetAttributes",
    "PJRT_Client_Load",
    "PJRT_LoadedExecutable_AddressableDeviceLogicalIds",
    "PJRT_Buffer_Bitcast",
    "PJRT_Error_ForEachPayload",
    "PJRT_TopologyDescription_Fingerprint",
    "PJRT_Executable_ParameterMemoryKinds",
    "PJRT_Device_ClearMemoryStats",
    "PJRT_TopologyDescription_MakeCanonicalShapeForMemorySpace",
    "PJRT_TopologyDescription_GetMemorySpaceKindIds",
]

# Entries that return void instead of PJRT_Error*.
VOID_SLOTS = {"PJRT_Error_Destroy", "PJRT_Error_Message"}

PJRT_Api = _struct(
    "PJRT_Api",
    _HEAD + [("pjrt_api_version", PJRT_Api_Version)] + [(n, c_void_p) for n in API_SLOTS],
)

_ERR_FN = ctypes.CFUNCTYPE(c_void_p, c_void_p)
_VOID_FN = ctypes.CFUNCTYPE(None, c_void_p)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class PjrtError(Exception):
    """A PJRT_Error turned into Python: ``code`` is an :class:`ErrorCode`."""

    def __init__(self, function: str, code: int, message: str):
        self.function = function
        try:
            self.code = ErrorCode(code)
        except ValueError:
            self.code = code
        self.message = message
        name = self.code.name if isinstance(self.code, ErrorCode) else str(code)
        super().__init__(f"{function} -> {name} ({int(code)}): {message}")


def _string(ptr, size) -> str:
    if not ptr or not size:
        return ""
    return ctypes.string_at(ptr, size).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------


class Api:
    """The plugin's ``PJRT_Api`` table, loaded from a shared library."""

    def __init__(self, path: str):
        self.path = str(path)
        self.lib = ctypes.CDLL(self.path, mode=ctypes.RTLD_LOCAL)
        get = self.lib.GetPjrtApi
        get.restype = c_void_p
        get.argtypes = []
        self.api_ptr = get()
        if not self.api_ptr:
            raise RuntimeError(f"GetPjrtApi() in {self.path} returned NULL")
        self.table = PJRT_Api.from_address(self.api_ptr)
        self._fns = {}

    # ---- raw access ----------------------------------------------------
    def slot_address(self, name: str) -> int:
        return getattr(self.table, name) or 0

    def _fn(self, name: str):
        fn = self._fns.get(name)
        if fn is None:
            addr = self.slot_address(name)
            if not addr:
                raise RuntimeError(f"PJRT_Api slot {name} is NULL")
            proto = _VOID_FN if name in VOID_SLOTS else _ERR_FN
            fn = proto(addr)
            self._fns[name] = fn
        return fn

    def raw_call(self, name: str, args) -> int | None:
        """Calls slot ``name`` with ``args`` (a struct, or None for NULL).

        Returns the raw PJRT_Error* (an int) or None."""
        ptr = None if args is None else ctypes.addressof(args)
        return self._fn(name)(ptr)

    def error_info(self, err: int, destroy: bool = True) -> tuple[int, str]:
        """(code, message) of a PJRT_Error*, destroying it by default."""
        gc = ARGS["PJRT_Error_GetCode"].new(error=err)
        code_err = self.raw_call("PJRT_Error_GetCode", gc)
        code = gc.code
        if code_err:
            # GetCode itself failed: report that, don't loop.
            code = -1
            self.destroy_error(code_err)
        msg = ARGS["PJRT_Error_Message"].new(error=err)
        self.raw_call("PJRT_Error_Message", msg)
        text = _string(msg.message, msg.message_size)
        if destroy:
            self.destroy_error(err)
        return code, text

    def destroy_error(self, err: int) -> None:
        self.raw_call("PJRT_Error_Destroy", ARGS["PJRT_Error_Destroy"].new(error=err))

    def to_exception(self, name: str, err: int) -> PjrtError:
        code, text = self.error_info(err)
        return PjrtError(name, code, text)

    def args(self, name: str, **fields):
        return ARGS[name].new(**fields)

    def call_args(self, name: str, args):
        err = self.raw_call(name, args)
        if err:
            raise self.to_exception(name, err)
        return args

    def call(self, name: str, **fields):
        """Fills ``name``'s args struct, calls it, raises PjrtError on error."""
        return self.call_args(name, self.args(name, **fields))

    def try_call(self, name: str, **fields):
        """Like call() but returns (args, PjrtError | None)."""
        a = self.args(name, **fields)
        err = self.raw_call(name, a)
        return a, (self.to_exception(name, err) if err else None)

    # ---- plugin ----------------------------------------------------------
    @property
    def version(self) -> tuple[int, int]:
        v = self.table.pjrt_api_version
        return v.major_version, v.minor_version

    def initialize(self) -> None:
        self.call("PJRT_Plugin_Initialize")

    def attributes(self) -> dict:
        a = self.call("PJRT_Plugin_Attributes")
        return named_values_to_dict(a.attributes, a.num_attributes)

    def extensions(self, limit: int = 64) -> list:
        """Walks extension_start; returns [(type, struct_size, address)]."""
        out = []
        node = self.table.extension_start
        while node and len(out) < limit:
            base = node.contents
            out.append((base.type, base.struct_size, ctypes.addressof(base)))
            node = base.next
        if node and len(out) >= limit:
            raise RuntimeError("extension chain longer than %d: a cycle?" % limit)
        return out

    # ---- objects -----------------------------------------------------------
    def create_client(self, options: dict | None = None, **kw) -> "Client":
        return Client.create(self, options or {}, **kw)

    def create_event(self) -> "Event":
        a = self.call("PJRT_Event_Create")
        return Event(self, a.event)


def named_values(options: dict):
    """dict -> (ctypes array of PJRT_NamedValue, keepalive list).

    Values: bool -> kBool, int -> kInt64, float -> kFloat, str/bytes ->
    kString, list/tuple of int -> kInt64List. A value given as a
    ``(NamedValueType, value)`` pair forces the type."""
    arr = (PJRT_NamedValue * max(1, len(options)))()
    keep = []
    for i, (name, value) in enumerate(options.items()):
        nv = arr[i]
        nv.struct_size = PJRT_NamedValue.STRUCT_SIZE
        bname = name.encode() if isinstance(name, str) else bytes(name)
        keep.append(bname)
        nv.name = ctypes.cast(c_char_p(bname), c_void_p)
        nv.name_size = len(bname)
        forced = None
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], NamedValueType):
            forced, value = value
        if forced == NamedValueType.kBool or (forced is None and isinstance(value, bool)):
            nv.type = NamedValueType.kBool
            nv.bool_value = bool(value)
            nv.value_size = 1
        elif forced == NamedValueType.kInt64 or (forced is None and isinstance(value, int)):
            nv.type = NamedValueType.kInt64
            nv.int64_value = int(value)
            nv.value_size = 1
        elif forced == NamedValueType.kFloat or (forced is None and isinstance(value, float)):
            nv.type = NamedValueType.kFloat
            nv.float_value = float(value)
            nv.value_size = 1
        elif forced == NamedValueType.kString or (
            forced is None and isinstance(value, (str, bytes))
        ):
            b = value.encode() if isinstance(value, str) else bytes(value)
            keep.append(b)
            nv.type = NamedValueType.kString
            nv.string_value = ctypes.cast(c_char_p(b), c_void_p)
            nv.value_size = len(b)
        else:
            ints = (c_int64 * max(1, len(value)))(*value)
            keep.append(ints)
            nv.type = NamedValueType.kInt64List
            nv.int64_array_value = ints
            nv.value_size = len(value)
    keep.append(arr)
    return arr, keep


def named_values_to_dict(ptr, count) -> dict:
    out = {}
    for i in range(count):
        nv = ptr[i]
        name = _string(nv.name, nv.name_size)
        t = nv.type
        if t == NamedValueType.kString:
            val = _string(nv.string_value, nv.value_size)
        elif t == NamedValueType.kInt64:
            val = nv.int64_value
        elif t == NamedValueType.kInt64List:
            val = [nv.int64_array_value[j] for j in range(nv.value_size)]
        elif t == NamedValueType.kFloat:
            val = nv.float_value
        elif t == NamedValueType.kBool:
            val = bool(nv.bool_value)
        else:
            val = ("<unknown type>", t)
        out[name] = (NamedValueType(t) if t in NamedValueType._value2member_map_ else t, val)
    return out


def _ptr_list(ptr, n) -> list[int]:
    return [ptr[i] for i in range(n)] if n else []


class Event:
    def __init__(self, api: Api, handle: int):
        self.api = api
        self.handle = handle

    def is_ready(self) -> bool:
        return bool(self.api.call("PJRT_Event_IsReady", event=self.handle).is_ready)

    def error(self) -> PjrtError | None:
        """PJRT_Event_Error: the status of a ready event (None = OK)."""
        err = self.api.raw_call("PJRT_Event_Error", self.api.args("PJRT_Event_Error", event=self.handle))
        return self.api.to_exception("PJRT_Event_Error", err) if err else None

    def await_status(self) -> PjrtError | None:
        """PJRT_Event_Await: blocks, returns the status (None = OK)."""
        err = self.api.raw_call("PJRT_Event_Await", self.api.args("PJRT_Event_Await", event=self.handle))
        return self.api.to_exception("PJRT_Event_Await", err) if err else None

    def wait(self) -> None:
        """Awaits and raises the event's error, if any."""
        e = self.await_status()
        if e is not None:
            raise e

    def on_ready(self, callback) -> None:
        """PJRT_Event_OnReady; ``callback(status)`` gets None or a PjrtError.

        The ctypes trampoline is kept alive until it has run."""
        api = self.api
        holder = {}

        def trampoline(err, _user_arg):
            try:
                status = api.to_exception("PJRT_Event_OnReady callback", err) if err else None
                callback(status)
            finally:
                _LIVE_CALLBACKS.pop(id(holder), None)

        cb = PJRT_Event_OnReadyCallback(trampoline)
        holder["cb"] = cb
        _LIVE_CALLBACKS[id(holder)] = holder
        try:
            api.call("PJRT_Event_OnReady", event=self.handle, callback=cb, user_arg=None)
        except Exception:
            _LIVE_CALLBACKS.pop(id(holder), None)
            raise

    def wait_ready(self, timeout: float) -> PjrtError | None:
        """Waits through OnReady with a timeout (no hang if never ready).

        Raises TimeoutError if the event is not ready in time."""
        done = threading.Event()
        box = []

        def cb(status):
            box.append(status)
            done.set()

        self.on_ready(cb)
        if not done.wait(timeout):
            raise TimeoutError("event not ready after %.1fs" % timeout)
        return box[0]

    def set(self, code: int = ErrorCode.OK, message: str = "") -> None:
        b = message.encode()
        buf = ctypes.create_string_buffer(b, len(b) + 1)
        self.api.call(
            "PJRT_Event_Set",
            event=self.handle,
            error_code=int(code),
            error_message=ctypes.cast(buf, c_void_p) if b else None,
            error_message_size=len(b),
        )

    def destroy(self) -> None:
        if self.handle:
            self.api.call("PJRT_Event_Destroy", event=self.handle)
            self.handle = None


_LIVE_CALLBACKS: dict = {}


class _SameByHandle:
    """Each lookup makes a new wrapper of the same plugin object, so two
    wrappers of one kind are equal exactly when their handles are."""

    def __init__(self, api: Api, handle: int):
        self.api = api
        self.handle = handle

    def __eq__(self, other):
        return isinstance(other, type(self)) and other.handle == self.handle

    def __hash__(self):
        return hash(self.handle)


class Memory(_SameByHandle):
    def id(self) -> int:
        return self.api.call("PJRT_Memory_Id", memory=self.handle).id

    def kind(self) -> str:
        a = self.api.call("PJRT_Memory_Kind", memory=self.handle)
        return _string(a.kind, a.kind_size)

    def kind_id(self) -> int:
        return self.api.call("PJRT_Memory_Kind_Id", memory=self.handle).kind_id

    def debug_string(self) -> str:
        a = self.api.call("PJRT_Memory_DebugString", memory=self.handle)
        return _string(a.debug_string, a.debug_string_size)

    def to_string(self) -> str:
        a = self.api.call("PJRT_Memory_ToString", memory=self.handle)
        return _string(a.to_string, a.to_string_size)

    def addressable_by_devices(self) -> list[int]:
        a = self.api.call("PJRT_Memory_AddressableByDevices", memory=self.handle)
        return _ptr_list(a.devices, a.num_devices)


class Device(_SameByHandle):
    def description(self) -> int:
        return self.api.call("PJRT_Device_GetDescription", device=self.handle).device_description

    def id(self) -> int:
        return self.api.call("PJRT_DeviceDescription_Id", device_description=self.description()).id

    def process_index(self) -> int:
        return self.api.call(
            "PJRT_DeviceDescription_ProcessIndex", device_description=self.description()
        ).process_index

    def kind(self) -> str:
        a = self.api.call("PJRT_DeviceDescription_Kind", device_description=self.description())
        return _string(a.device_kind, a.device_kind_size)

    def debug_string(self) -> str:
        a = self.api.call(
            "PJRT_DeviceDescription_DebugString", device_description=self.description()
        )
        return _string(a.debug_string, a.debug_string_size)

    def to_string(self) -> str:
        a = self.api.call("PJRT_DeviceDescription_ToString", device_description=self.description())
        return _string(a.to_string, a.to_string_size)

    def attributes(self) -> dict:
        a = self.api.call(
            "PJRT_DeviceDescription_Attributes", device_description=self.description()
        )
        return named_values_to_dict(a.attributes, a.num_attributes)

    def is_addressable(self) -> bool:
        return bool(self.api.call("PJRT_Device_IsAddressable", device=self.handle).is_addressable)

    def local_hardware_id(self) -> int:
        return self.api.call("PJRT_Device_LocalHardwareId", device=self.handle).local_hardware_id

    def memories(self) -> list[Memory]:
        a = self.api.call("PJRT_Device_AddressableMemories", device=self.handle)
        return [Memory(self.api, h) for h in _ptr_list(a.memories, a.num_memories)]

    def default_memory(self) -> Memory:
        return Memory(self.api, self.api.call("PJRT_Device_DefaultMemory", device=self.handle).memory)

    def memory_stats(self):
        return self.api.call("PJRT_Device_MemoryStats", device=self.handle)


class Client:
    def __init__(self, api: Api, handle: int):
        self.api = api
        self.handle = handle
        self._owned: list = []  # buffers/events to destroy before the client

    @classmethod
    def create(cls, api: Api, options: dict, struct_size: int | None = None) -> "Client":
        arr, keep = named_values(options)
        a = api.args(
            "PJRT_Client_Create",
            create_options=ctypes.cast(arr, POINTER(PJRT_NamedValue)) if options else None,
            num_options=len(options),
        )
        if struct_size is not None:
            a.struct_size = struct_size
        api.call_args("PJRT_Client_Create", a)
        del keep
        if not a.client:
            raise AssertionError("PJRT_Client_Create returned OK but client is NULL")
        return cls(api, a.client)

    def destroy(self) -> None:
        if not self.handle:
            return
        for obj in reversed(self._owned):
            try:
                obj.destroy()
            except PjrtError:
                pass
        self._owned.clear()
        self.api.call("PJRT_Client_Destroy", client=self.handle)
        self.handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()

    def own(self, obj):
        self._owned.append(obj)
        return obj

    def platform_name(self) -> str:
        a = self.api.call("PJRT_Client_PlatformName", client=self.handle)
        return _string(a.platform_name, a.platform_name_size)

    def platform_version(self) -> str:
        a = self.api.call("PJRT_Client_PlatformVersion", client=self.handle)
        return _string(a.platform_version, a.platform_version_size)

    def process_index(self) -> int:
        return self.api.call("PJRT_Client_ProcessIndex", client=self.handle).process_index

    def devices(self) -> list[Device]:
        a = self.api.call("PJRT_Client_Devices", client=self.handle)
        return [Device(self.api, h) for h in _ptr_list(a.devices, a.num_devices)]

    def addressable_devices(self) -> list[Device]:
        a = self.api.call("PJRT_Client_AddressableDevices", client=self.handle)
        return [
            Device(self.api, h) for h in _ptr_list(a.addressable_devices, a.num_addressable_devices)
        ]

    def lookup_device(self, id_: int) -> Device:
        return Device(self.api, self.api.call("PJRT_Client_LookupDevice", client=self.handle, id=id_).device)

    def lookup_addressable_device(self, local_id: int) -> Device:
        a = self.api.call(
            "PJRT_Client_LookupAddressableDevice", client=self.handle, local_hardware_id=local_id
        )
        return Device(self.api, a.addressable_device)

    def addressable_memories(self) -> list[Memory]:
        a = self.api.call("PJRT_Client_AddressableMemories", client=self.handle)
        return [
            Memory(self.api, h) for h in _ptr_list(a.addressable_memories, a.num_addressable_memories)
        ]

    def buffer_from_host(
        self,
        array: np.ndarray,
        type: BufferType | None = None,
        device: Device | None = None,
        memory: Memory | None = None,
        semantics: HostBufferSemantics = HostBufferSemantics.kImmutableOnlyDuringCall,
        byte_strides: list[int] | None = None,
        use_default_device: bool = True,
    ) -> "Buffer":
        """PJRT_Client_BufferFromHostBuffer from a numpy array (or view).

        ``byte_strides`` defaults to the array's own strides when the array
        is not C-contiguous, else none are passed (dense). ``device``
        defaults to the first device unless ``memory`` is given or
        ``use_default_device`` is False."""
        if type is None:
            type = NUMPY_TO_PJRT[array.dtype]
        if device is None and memory is None and use_default_device:
            device = self.devices()[0]
        dims = (c_int64 * max(1, array.ndim))(*array.shape)
        if byte_strides is None and not array.flags["C_CONTIGUOUS"]:
            byte_strides = list(array.strides)
        strides = None
        if byte_strides is not None:
            strides = (c_int64 * max(1, len(byte_strides)))(*byte_strides)
        a = self.api.args(
            "PJRT_Client_BufferFromHostBuffer",
            client=self.handle,
            data=array.ctypes.data,
            type=int(type),
            dims=dims,
            num_dims=array.ndim,
            byte_strides=strides,
            num_byte_strides=len(byte_strides) if byte_strides is not None else 0,
            host_buffer_semantics=int(semantics),
            device=device.handle if device is not None else None,
            memory=memory.handle if memory is not None else None,
        )
        self.api.call_args("PJRT_Client_BufferFromHostBuffer", a)
        if not a.buffer:
            raise AssertionError("BufferFromHostBuffer returned OK but buffer is NULL")
        done = Event(self.api, a.done_with_host_buffer) if a.done_with_host_buffer else None
        buf = Buffer(self, a.buffer, keepalive=array, done_event=done)
        return self.own(buf)


class Buffer:
    def __init__(self, client: Client, handle: int, keepalive=None, done_event: Event | None = None):
        self.client = client
        self.api = client.api
        self.handle = handle
        self._keepalive = keepalive
        self.done_event = done_event  # done_with_host_buffer, owned by us

    def destroy(self) -> None:
        if self.handle:
            self.api.call("PJRT_Buffer_Destroy", buffer=self.handle)
            self.handle = None
        if self.done_event is not None:
            self.done_event.destroy()
            self.done_event = None
        self._keepalive = None

    def element_type(self) -> BufferType:
        t = self.api.call("PJRT_Buffer_ElementType", buffer=self.handle).type
        return BufferType(t) if t in BufferType._value2member_map_ else t

    def dims(self) -> tuple:
        a = self.api.call("PJRT_Buffer_Dimensions", buffer=self.handle)
        return tuple(a.dims[i] for i in range(a.num_dims))

    def unpadded_dims(self) -> tuple:
        a = self.api.call("PJRT_Buffer_UnpaddedDimensions", buffer=self.handle)
        return tuple(a.unpadded_dims[i] for i in range(a.num_dims))

    def dynamic_dim_indices(self) -> list:
        a = self.api.call("PJRT_Buffer_DynamicDimensionIndices", buffer=self.handle)
        return [a.dynamic_dim_indices[i] for i in range(a.num_dynamic_dims)]

    def memory_layout(self):
        return self.api.call("PJRT_Buffer_GetMemoryLayout", buffer=self.handle).layout

    def on_device_size(self) -> int:
        return self.api.call("PJRT_Buffer_OnDeviceSizeInBytes", buffer=self.handle).on_device_size_in_bytes

    def device(self) -> Device:
        return Device(self.api, self.api.call("PJRT_Buffer_Device", buffer=self.handle).device)

    def memory(self) -> Memory:
        return Memory(self.api, self.api.call("PJRT_Buffer_Memory", buffer=self.handle).memory)

    def is_on_cpu(self) -> bool:
        return bool(self.api.call("PJRT_Buffer_IsOnCpu", buffer=self.handle).is_on_cpu)

    def ready_event(self) -> Event:
        return Event(self.api, self.api.call("PJRT_Buffer_ReadyEvent", buffer=self.handle).event)

    def delete(self) -> None:
        self.api.call("PJRT_Buffer_Delete", buffer=self.handle)

    def is_deleted(self) -> bool:
        return bool(self.api.call("PJRT_Buffer_IsDeleted", buffer=self.handle).is_deleted)

    def required_host_size(self) -> int:
        a = self.api.call("PJRT_Buffer_ToHostBuffer", src=self.handle, dst=None, dst_size=0)
        if a.event:
            Event(self.api, a.event).destroy()
        return a.dst_size

    def to_host_bytes(self, size: int | None = None) -> bytes:
        if size is None:
            size = self.required_host_size()
        dst = ctypes.create_string_buffer(max(1, size))
        a = self.api.call(
            "PJRT_Buffer_ToHostBuffer", src=self.handle, dst=ctypes.addressof(dst), dst_size=size
        )
        if a.event:
            ev = Event(self.api, a.event)
            try:
                ev.wait()
            finally:
                ev.destroy()
        return dst.raw[:size]

    def to_numpy(self, dtype, shape) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = self.to_host_bytes(n)
        return np.frombuffer(raw, dtype=dtype, count=n // dtype.itemsize if dtype.itemsize else 0).reshape(shape)

    def copy_raw_to_host(self, offset: int, size: int) -> bytes:
        dst = ctypes.create_string_buffer(max(1, size))
        a = self.api.call(
            "PJRT_Buffer_CopyRawToHost",
            buffer=self.handle,
            dst=ctypes.addressof(dst),
            offset=offset,
            transfer_size=size,
        )
        if a.event:
            ev = Event(self.api, a.event)
            try:
                ev.wait()
            finally:
                ev.destroy()
        return dst.raw[:size]

    def copy_to_device(self, device: Device) -> "Buffer":
        a = self.api.call("PJRT_Buffer_CopyToDevice", buffer=self.handle, dst_device=device.handle)
        return self.client.own(Buffer(self.client, a.dst_buffer))

    def copy_to_memory(self, memory: Memory) -> "Buffer":
        a = self.api.call("PJRT_Buffer_CopyToMemory", buffer=self.handle, dst_memory=memory.handle)
        return self.client.own(Buffer(self.client, a.dst_buffer))

    def unsafe_pointer(self) -> int:
        return self.api.call("PJRT_Buffer_UnsafePointer", buffer=self.handle).buffer_pointer

    def opaque_device_pointer(self) -> int:
        return self.api.call(
            "PJRT_Buffer_OpaqueDeviceMemoryDataPointer", buffer=self.handle
        ).device_memory_ptr

    def increase_external_ref(self) -> None:
        self.api.call("PJRT_Buffer_IncreaseExternalReferenceCount", buffer=self.handle)

    def decrease_external_ref(self) -> None:
        self.api.call("PJRT_Buffer_DecreaseExternalReferenceCount", buffer=self.handle)


# ==========================================================================
# Cross-host transfers (added for test_transfers_*.py; nothing above changed)
# ==========================================================================
#
# KV callback args are declared by pjrt_c_api.h, so they join STRUCTS and the
# existing layout test checks them against the header. The extension structs
# of include/pjrt_crosshost.h are NOT in that header: they live in
# XH_STRUCTS, which test_transfers_layouts.py checks against
# include/pjrt_crosshost.h with a C compiler.

# PJRT_Error* (*PJRT_CallbackError)(PJRT_Error_Code, const char*, size_t)
PJRT_CallbackError = ctypes.CFUNCTYPE(c_void_p, c_enum, c_void_p, c_size_t)
# void (*)(char* value)
PJRT_KeyValue_ValueDeleter = ctypes.CFUNCTYPE(None, c_void_p)

PJRT_KeyValueGetCallback_Args = _struct(
    "PJRT_KeyValueGetCallback_Args",
    _HEAD
    + [
        ("key", c_void_p),
        ("key_size", c_size_t),
        ("timeout_in_ms", c_int),
        ("callback_error", c_void_p),  # PJRT_CallbackError* (pointer TO the fn pointer)
        ("user_arg", c_void_p),
        ("value", c_void_p),
        ("value_size", c_size_t),
        ("value_deleter_callback", c_void_p),
    ],
)
PJRT_KeyValueTryGetCallback_Args = _struct(
    "PJRT_KeyValueTryGetCallback_Args",
    _HEAD
    + [
        ("key", c_void_p),
        ("key_size", c_size_t),
        ("callback_error", c_void_p),
        ("user_arg", c_void_p),
        ("value", c_void_p),
        ("value_size", c_size_t),
        ("value_deleter_callback", c_void_p),
    ],
)
PJRT_KeyValuePutCallback_Args = _struct(
    "PJRT_KeyValuePutCallback_Args",
    _HEAD
    + [
        ("key", c_void_p),
        ("key_size", c_size_t),
        ("value", c_void_p),
        ("value_size", c_size_t),
        ("callback_error", c_void_p),
        ("user_arg", c_void_p),
    ],
)

PJRT_KeyValueGetCallback = ctypes.CFUNCTYPE(c_void_p, POINTER(PJRT_KeyValueGetCallback_Args))
PJRT_KeyValueTryGetCallback = ctypes.CFUNCTYPE(
    c_void_p, POINTER(PJRT_KeyValueTryGetCallback_Args)
)
PJRT_KeyValuePutCallback = ctypes.CFUNCTYPE(c_void_p, POINTER(PJRT_KeyValuePutCallback_Args))

XH_STRUCTS: dict[str, type] = {}  # C name (include/pjrt_crosshost.h) -> ctypes class


def _xh_struct(name, fields):
    cls = type(name, (PjrtStruct,), {"_fields_": fields})
    cls.STRUCT_SIZE = cls._compute_struct_size()
    XH_STRUCTS[name] = cls
    return cls


EXTENSION_TYPE_KV_DELETE = 0x43480001

PJRT_CrossHost_KeyValueDeleteCallback_Args = _xh_struct(
    "PJRT_CrossHost_KeyValueDeleteCallback_Args",
    _HEAD
    + [
        ("key", c_void_p),
        ("key_size", c_size_t),
        ("callback_error", c_void_p),
        ("user_arg", c_void_p),
    ],
)
PJRT_CrossHost_KeyValueDeleteCallback = ctypes.CFUNCTYPE(
    c_void_p, POINTER(PJRT_CrossHost_KeyValueDeleteCallback_Args)
)
PJRT_CrossHost_KvDeleteExtension = _xh_struct(
    "PJRT_CrossHost_KvDeleteExtension",
    [
        ("base", PJRT_Extension_Base),
        ("kv_delete_callback", c_void_p),
        ("kv_delete_user_arg", c_void_p),
    ],
)

# void on_canceled(PJRT_Error* error, void* user_arg)
PJRT_Transfers_CrossHostOnCanceledCallback = ctypes.CFUNCTYPE(None, c_void_p, c_void_p)
# void cancel_notifier(const char* desc, size_t size, PJRT_Error_Code reason,
#   const char* msg, size_t msg_size, on_canceled, void* on_canceled_user_arg,
#   void* user_arg)
PJRT_Transfers_CrossHostRecvCancelNotifier = ctypes.CFUNCTYPE(
    None,
    c_void_p,
    c_size_t,
    c_enum,
    c_void_p,
    c_size_t,
    PJRT_Transfers_CrossHostOnCanceledCallback,
    c_void_p,
    c_void_p,
)
# void notifier(PJRT_Error*, const char** descs, size_t* sizes, size_t n,
#   void* user_arg, cancel_notifier, void* cancel_notifier_user_arg)
PJRT_Transfers_CrossHostRecvNotifier = ctypes.CFUNCTYPE(
    None,
    c_void_p,
    POINTER(c_void_p),
    POINTER(c_size_t),
    c_size_t,
    c_void_p,
    c_void_p,  # cancel notifier fn pointer (may be NULL)
    c_void_p,
)
# void on_done(PJRT_Error* error, bool sends_were_enqueued, void* user_arg)
PJRT_Transfers_CrossHostOnDone = ctypes.CFUNCTYPE(None, c_void_p, c_bool, c_void_p)
# void descriptor_destructor(char** data, size_t* size)
PJRT_Transfers_DescriptorDestructor = ctypes.CFUNCTYPE(None, c_void_p, c_void_p)

PJRT_Transfers_CrossHostRecvNotifierInfo = _xh_struct(
    "PJRT_Transfers_CrossHostRecvNotifierInfo",
    [("user_arg", c_void_p), ("notifier", c_void_p)],
)
PJRT_Transfers_CrossHostRemoteSendCallbackInfo = _xh_struct(
    "PJRT_Transfers_CrossHostRemoteSendCallbackInfo",
    [("user_arg", c_void_p), ("on_done", c_void_p)],
)

PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers_Args = _xh_struct(
    "PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers_Args",
    _HEAD
    + [
        ("client", c_void_p),
        ("num_shapes", c_size_t),
        ("shape_num_dims", POINTER(c_size_t)),
        ("num_dims", POINTER(POINTER(c_int64))),
        ("element_types", POINTER(c_enum)),
        ("layouts", c_void_p),
        ("device", c_void_p),
        ("notifier", PJRT_Transfers_CrossHostRecvNotifierInfo),
        ("buffers", POINTER(c_void_p)),
        ("num_buffers", c_size_t),
        ("allow_cancel_notifier", c_bool),
    ],
)
PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args = _xh_struct(
    "PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args",
    _HEAD
    + [
        ("buffer", c_void_p),
        ("event", c_void_p),
        ("serialized_descriptor", c_void_p),  # char**
        ("serialized_descriptor_size", c_void_p),  # size_t*
        ("on_done", PJRT_Transfers_CrossHostRemoteSendCallbackInfo),
        ("descriptor_destructor", c_void_p),
    ],
)
PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args = _xh_struct(
    "PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args",
    _HEAD
    + [
        ("client", c_void_p),
        ("num_shapes", c_size_t),
        ("shape_num_dims", POINTER(c_size_t)),
        ("num_dims", POINTER(POINTER(c_int64))),
        ("element_types", POINTER(c_enum)),
        ("layouts", c_void_p),
        ("device", c_void_p),
        ("src_global_device_ids", POINTER(ctypes.c_int32)),
        ("transfer_keys", POINTER(c_int64)),
        ("buffers", POINTER(c_void_p)),
        ("num_tasks", c_size_t),
        ("task_ids", POINTER(c_int)),
        ("incarnation_ids", POINTER(c_int64)),
    ],
)
PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args = _xh_struct(
    "PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args",
    _HEAD
    + [
        ("client", c_void_p),
        ("num_buffers", c_size_t),
        ("buffers", POINTER(c_void_p)),
        ("dst_global_device_ids", POINTER(ctypes.c_int32)),
        ("transfer_keys", POINTER(c_int64)),
        ("send_events", POINTER(c_void_p)),
        ("num_tasks", c_size_t),
        ("task_ids", POINTER(c_int)),
        ("incarnation_ids", POINTER(c_int64)),
    ],
)
PJRT_CrossHostTransfers_Extension = _xh_struct(
    "PJRT_CrossHostTransfers_Extension",
    [
        ("base", PJRT_Extension_Base),
        ("PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers", c_void_p),
        ("PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice", c_void_p),
        ("PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers", c_void_p),
        ("PJRT_Transfers_PJRT_Client_CrossHostSendBuffers", c_void_p),
    ],
)

# Entry prototypes (args passed as an address).
XH_ERR_ENTRY = ctypes.CFUNCTYPE(c_void_p, c_void_p)  # PJRT_Error* (*)(Args*)
XH_VOID_ENTRY = ctypes.CFUNCTYPE(None, c_void_p)  # void (*)(Args*)


def declare_crosshost_exports(lib) -> None:
    """Declares pjrt_crosshost_metrics_json / pjrt_crosshost_free_string on a
    ctypes.CDLL of the plugin (returns char* as c_void_p so it can be freed)."""
    lib.pjrt_crosshost_metrics_json.restype = c_void_p
    lib.pjrt_crosshost_metrics_json.argtypes = [c_void_p]
    lib.pjrt_crosshost_free_string.restype = None
    lib.pjrt_crosshost_free_string.argtypes = [c_void_p]
