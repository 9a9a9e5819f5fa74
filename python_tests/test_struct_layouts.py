"""The hand-written ctypes layouts match the real header, checked by a C
compiler: every struct's *_STRUCT_SIZE, sizeof and every field offset, and
the PJRT_Api slot list (names and order) parsed from the header."""

from __future__ import annotations

import re

import pytest

import pjrt_ctypes as pc
from conftest import compiled_c_table, header_dir

HEADER = header_dir() / "xla" / "pjrt" / "c" / "pjrt_c_api.h"


def _layout_rows(cls):
    """(field name as C spells it, ctypes offset) incl. anonymous-union members."""
    anon = set(getattr(cls, "_anonymous_", ()))
    for name, ftype, *_ in cls._fields_:
        if name in anon:
            for sub, *_ in ftype._fields_:
                yield sub, getattr(cls, sub).offset
        else:
            yield name, getattr(cls, name).offset


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory) -> dict:
    assert HEADER.is_file(), f"{HEADER} missing: run scripts/fetch-pjrt-header.sh (make setup)"
    body = []
    for cname, cls in pc.STRUCTS.items():
        body.append(f'  printf("{cname} STRUCT_SIZE %zu\\n", (size_t){cname}_STRUCT_SIZE);')
        body.append(f'  printf("{cname} SIZEOF %zu\\n", sizeof({cname}));')
        for field, _ in _layout_rows(cls):
            body.append(f'  printf("{cname} .{field} %zu\\n", offsetof({cname}, {field}));')
    return compiled_c_table(
        tmp_path_factory.mktemp("layout"), ["xla/pjrt/c/pjrt_c_api.h"], body
    )


@pytest.mark.parametrize("cname", sorted(pc.STRUCTS))
def test_ctypes_struct_size_and_offsets_match_header(c_layout, cname):
    import ctypes

    cls = pc.STRUCTS[cname]
    assert cls.STRUCT_SIZE == c_layout[(cname, "STRUCT_SIZE")], "STRUCT_SIZE"
    assert ctypes.sizeof(cls) == c_layout[(cname, "SIZEOF")], "sizeof"
    for field, off in _layout_rows(cls):
        assert off == c_layout[(cname, "." + field)], f"offsetof({cname}, {field})"


def test_every_args_struct_starts_with_struct_size_and_extension_start():
    for name, cls in pc.ARGS.items():
        assert [f[0] for f in cls._fields_[:2]] == ["struct_size", "extension_start"], name
        assert cls.struct_size.offset == 0 and cls.extension_start.offset == 8, name


def test_api_slot_list_matches_header_order_and_has_138_slots():
    text = HEADER.read_text()
    start = text.index("typedef struct PJRT_Api {")
    end = text.index("} PJRT_Api;", start)
    names = re.findall(r"_PJRT_API_STRUCT_FIELD\(\s*(\w+)\s*\)", text[start:end])
    assert names == pc.API_SLOTS
    assert len(names) == 138


def test_header_is_pjrt_0_114():
    text = HEADER.read_text()
    assert re.search(r"#define PJRT_API_MAJOR 0\b", text)
    assert re.search(r"#define PJRT_API_MINOR 114\b", text)
