"""The ctypes layouts of include/pjrt_crosshost.h used by the transfer tests
(pjrt_ctypes.XH_STRUCTS) match the header, checked by a C compiler, and the
ABI document's struct sizes hold."""

from __future__ import annotations

import ctypes

import pytest

import pjrt_ctypes as pc
from conftest import REPO, compiled_c_table


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory) -> dict:
    body = []
    for cname, cls in pc.XH_STRUCTS.items():
        body.append(f"#ifdef {cname}_STRUCT_SIZE")
        body.append(f'  printf("{cname} STRUCT_SIZE %zu\\n", (size_t){cname}_STRUCT_SIZE);')
        body.append("#endif")
        body.append(f'  printf("{cname} SIZEOF %zu\\n", sizeof({cname}));')
        for field, *_ in cls._fields_:
            body.append(f'  printf("{cname} .{field} %zu\\n", offsetof({cname}, {field}));')
    body.append(
        '  printf("KV_DELETE_TYPE %d\\n", (int)PJRT_CROSSHOST_EXTENSION_TYPE_KV_DELETE);'
    )
    return compiled_c_table(
        tmp_path_factory.mktemp("xh_layout"),
        ["xla/pjrt/c/pjrt_c_api.h", "pjrt_crosshost.h"],
        body,
        include_dirs=(REPO / "include",),
    )


@pytest.mark.parametrize("cname", sorted(pc.XH_STRUCTS))
def test_crosshost_ctypes_layouts_match_the_plugin_header(c_layout, cname):
    cls = pc.XH_STRUCTS[cname]
    if (cname, "STRUCT_SIZE") in c_layout:
        assert cls.STRUCT_SIZE == c_layout[(cname, "STRUCT_SIZE")], "STRUCT_SIZE"
    assert ctypes.sizeof(cls) == c_layout[(cname, "SIZEOF")], "sizeof"
    for field, *_ in cls._fields_:
        assert getattr(cls, field).offset == c_layout[(cname, "." + field)], field


def test_kv_delete_extension_type_number(c_layout):
    assert c_layout[("KV_DELETE_TYPE", "")] == pc.EXTENSION_TYPE_KV_DELETE


def test_abi_document_sizes():
    f = lambda cls, field: getattr(cls, field).offset + getattr(cls, field).size  # noqa: E731
    assert f(pc.PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args, "send_events") == 64
    assert pc.PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args.STRUCT_SIZE == 88
    assert f(pc.PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args, "buffers") == 96
    assert pc.PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args.STRUCT_SIZE == 120
    assert f(pc.PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers_Args, "num_buffers") == 104
    assert pc.PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers_Args.STRUCT_SIZE == 105
    assert f(pc.PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args, "on_done") == 64
    assert pc.PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args.STRUCT_SIZE == 72


def test_the_extension_is_on_the_api_chain_with_all_four_entries(api):
    found = [e for e in api.extensions() if e[0] == pc.ExtensionType.CrossHostTransfers]
    assert len(found) == 1
    _, size, addr = found[0]
    assert size >= ctypes.sizeof(pc.PJRT_CrossHostTransfers_Extension)
    ext = pc.PJRT_CrossHostTransfers_Extension.from_address(addr)
    for name, *_ in ext._fields_[1:]:
        assert getattr(ext, name), f"{name} is NULL"
