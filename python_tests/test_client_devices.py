"""Client creation, create options, devices, memories, descriptions."""

from __future__ import annotations

import pytest

import pjrt_ctypes as pc
from pjrt_ctypes import ErrorCode, NamedValueType


def test_client_platform_name_is_crosshost(client):
    assert client.platform_name() == "crosshost"


def test_client_platform_version_is_a_string(client):
    assert isinstance(client.platform_version(), str)


def test_single_process_client_has_process_index_0(client):
    assert client.process_index() == 0


def test_default_client_has_two_devices_with_ids_0_and_1(client):
    devs = client.devices()
    assert len(devs) == 2
    assert [d.id() for d in devs] == [0, 1]


@pytest.mark.parametrize("n", [1, 3, 8, 64])
def test_num_devices_option_sets_the_device_count(api, n):
    with api.create_client({"num_devices": n}) as c:
        devs = c.devices()
        assert len(devs) == n
        assert [d.id() for d in devs] == list(range(n))
        assert len(c.addressable_devices()) == n


def test_devices_and_addressable_devices_are_the_same_list(client):
    assert [d.handle for d in client.devices()] == [d.handle for d in client.addressable_devices()]


def test_client_created_with_null_kv_callbacks_works(api):
    # The fixture's client already passes NULL callbacks; be explicit here.
    a = api.call("PJRT_Client_Create", kv_get_callback=None, kv_put_callback=None,
                  kv_try_get_callback=None)
    assert a.client
    api.call("PJRT_Client_Destroy", client=a.client)


def test_two_clients_coexist_in_one_process(api):
    with api.create_client() as a, api.create_client({"num_devices": 3}) as b:
        assert len(a.devices()) == 2
        assert len(b.devices()) == 3
        assert a.handle != b.handle


def test_client_create_from_an_older_header_without_kv_try_get_fields_succeeds(api):
    older = pc.ARGS["PJRT_Client_Create"].kv_try_get_callback.offset
    c = pc.Client.create(api, {"num_devices": 2}, struct_size=older)
    try:
        assert len(c.devices()) == 2
    finally:
        c.destroy()


def _create_error(api, options):
    with pytest.raises(pc.PjrtError) as e:
        api.create_client(options).destroy()
    return e.value


def test_unknown_create_option_is_invalid_argument_naming_the_option(api):
    err = _create_error(api, {"definitely_not_an_option": 1})
    assert err.code == ErrorCode.INVALID_ARGUMENT
    assert "definitely_not_an_option" in err.message


@pytest.mark.parametrize("n", [0, 65, -1])
def test_num_devices_outside_1_to_64_is_invalid_argument(api, n):
    err = _create_error(api, {"num_devices": n})
    assert err.code == ErrorCode.INVALID_ARGUMENT
    assert "num_devices" in err.message


def test_num_devices_of_the_wrong_type_is_invalid_argument(api):
    err = _create_error(api, {"num_devices": (NamedValueType.kString, "2")})
    assert err.code == ErrorCode.INVALID_ARGUMENT
    assert "num_devices" in err.message


def test_lookup_device_by_id_returns_the_listed_device(client):
    for d in client.devices():
        assert client.lookup_device(d.id()) == d


@pytest.mark.parametrize("bad_id", [2, -1, 1000])
def test_lookup_of_unknown_device_id_is_invalid_argument(client, bad_id):
    with pytest.raises(pc.PjrtError) as e:
        client.lookup_device(bad_id)
    assert e.value.code == ErrorCode.INVALID_ARGUMENT


def test_lookup_addressable_device_by_local_hardware_id(client):
    for d in client.devices():
        assert client.lookup_addressable_device(d.local_hardware_id()) == d


def test_lookup_of_unknown_local_hardware_id_is_invalid_argument(client):
    with pytest.raises(pc.PjrtError) as e:
        client.lookup_addressable_device(99)
    assert e.value.code == ErrorCode.INVALID_ARGUMENT


def test_local_hardware_id_is_the_device_index(client):
    assert [d.local_hardware_id() for d in client.devices()] == [0, 1]


def test_devices_are_addressable_and_belong_to_process_0(client):
    for d in client.devices():
        assert d.is_addressable()
        assert d.process_index() == 0


def test_device_description_strings_succeed_and_are_non_empty(client):
    for d in client.devices():
        assert d.kind()
        assert d.debug_string()
        assert d.to_string()


def test_device_description_attributes_succeed_with_well_formed_entries(client):
    for d in client.devices():
        attrs = d.attributes()
        for name, (t, _v) in attrs.items():
            assert name
            assert isinstance(t, NamedValueType)


def test_each_device_has_exactly_one_memory_of_kind_device(client):
    for d in client.devices():
        mems = d.memories()
        assert len(mems) == 1
        assert mems[0].kind() == "device"


def test_default_memory_is_the_devices_only_memory(client):
    for d in client.devices():
        assert d.default_memory() == d.memories()[0]


def test_memory_is_addressable_by_exactly_its_device(client):
    for d in client.devices():
        assert d.default_memory().addressable_by_devices() == [d.handle]


def test_memories_are_distinct_per_device_and_listed_by_the_client(client):
    per_device = [d.default_memory() for d in client.devices()]
    assert len(set(per_device)) == len(per_device)
    assert set(client.addressable_memories()) == set(per_device)


def test_memory_ids_are_distinct_and_strings_succeed(client):
    mems = client.addressable_memories()
    assert len({m.id() for m in mems}) == len(mems)
    for m in mems:
        assert m.debug_string()
        assert m.to_string()
        m.kind_id()


def test_device_memory_stats_succeed(client):
    for d in client.devices():
        s = d.memory_stats()
        assert s.bytes_in_use >= 0


def test_client_destroy_with_null_client_is_ok(api):
    # Header: "`client` can be nullptr".
    api.call("PJRT_Client_Destroy", client=None)
