"""The ctypes layouts of include/pjrt_crosshost.h used by the transfer tests
(pjrt_ctypes.XH_STRUCTS) match the header, checked by a C compiler, and the
ABI document's struct sizes hold."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

import pjrt_ctypes as pc
from conftest import REPO, header_dir


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory) -> dict:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler (cc/gcc) found"
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        '#include "xla/pjrt/c/pjrt_c_api.h"',
        '#include "pjrt_crosshost.h"',
        "int main(void) {",
    ]
    for cname, cls in pc.XH_STRUCTS.items():
        lines.append(f"#ifdef {cname}_STRUCT_SIZE")
        lines.append(f'  printf("{cname} STRUCT_SIZE %zu\\n", (size_t){cname}_STRUCT_SIZE);')
        lines.append("#endif")
        lines.append(f'  printf("{cname} SIZEOF %zu\\n", sizeof({cname}));')
        for field, *_ in cls._fields_:
            lines.append(f'  printf("{cname} .{field} %zu\\n", offsetof({cname}, {field}));')
    lines.append(
        '  printf("KV_DELETE_TYPE %d\\n", (int)PJRT_CROSSHOST_EXTENSION_TYPE_KV_DELETE);'
    )
    lines += ["  return 0;", "}"]
    d = tmp_path_factory.mktemp("xh_layout")
    src = d / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = d / "layout"
    r = subprocess.run(
        [cc, "-std=c11", "-I", str(header_dir()), "-I", str(REPO / "include"), str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, "layout program did not compile:\n" + r.stderr[-4000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    table = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2:
            table[(parts[0], "")] = int(parts[1])
        else:
            table[(parts[0], parts[1])] = int(parts[2])
    return table


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
