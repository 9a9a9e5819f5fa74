"""GetPjrtApi: the table a framework sees first."""

from __future__ import annotations

import pjrt_ctypes as pc


def test_get_pjrt_api_struct_size_is_the_headers_pjrt_api_struct_size(api):
    assert api.table.struct_size == pc.PJRT_Api.STRUCT_SIZE


def test_api_version_is_0_114(api):
    assert api.version == (pc.PJRT_API_MAJOR, pc.PJRT_API_MINOR) == (0, 114)
    assert api.table.pjrt_api_version.struct_size == pc.PJRT_Api_Version.STRUCT_SIZE


def test_every_one_of_the_138_function_slots_is_non_null(api):
    null = [name for name in pc.API_SLOTS if not api.slot_address(name)]
    assert len(pc.API_SLOTS) == 138
    assert null == [], f"NULL slots: {null}"


def test_get_pjrt_api_returns_the_same_table_every_call(api):
    again = pc.Api(api.path)
    assert again.api_ptr == api.api_ptr


def test_extension_chain_is_present_and_well_formed(api):
    chain = api.extensions()
    assert chain, "PJRT_Api.extension_start is NULL"
    for ext_type, size, _addr in chain:
        assert size >= pc.PJRT_Extension_Base.STRUCT_SIZE, (ext_type, size)


def test_plugin_initialize_succeeds_and_may_be_called_again(api):
    api.initialize()
    api.initialize()


def test_plugin_attributes_advertise_cross_host_transfers_as_bool_true(api):
    attrs = api.attributes()
    assert "supports_cross_host_transfers" in attrs, attrs
    t, v = attrs["supports_cross_host_transfers"]
    assert t == pc.NamedValueType.kBool
    assert v is True


def test_plugin_attributes_have_non_empty_names_and_known_types(api):
    a = api.call("PJRT_Plugin_Attributes")
    for i in range(a.num_attributes):
        nv = a.attributes[i]
        assert nv.name and nv.name_size > 0
        assert nv.type in pc.NamedValueType._value2member_map_
        assert nv.struct_size >= pc.PJRT_NamedValue.STRUCT_SIZE


def test_plugin_attributes_are_stable_across_calls(api):
    assert api.attributes() == api.attributes()
