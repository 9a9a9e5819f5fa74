"""PJRT_Event: readiness, status, OnReady exactly once, user-made events."""

from __future__ import annotations

import ctypes
import threading

import pytest

import pjrt_ctypes as pc
from pjrt_ctypes import ErrorCode


@pytest.fixture
def event(api):
    ev = api.create_event()
    yield ev
    ev.destroy()


def test_created_event_is_not_ready_until_set(event):
    assert not event.is_ready()
    event.set(ErrorCode.OK)
    assert event.is_ready()


def test_event_set_ok_awaits_ok_and_error_is_null(event):
    event.set(ErrorCode.OK)
    assert event.await_status() is None
    assert event.error() is None


def test_event_set_with_error_code_and_message_is_returned_by_await_and_error(event):
    event.set(ErrorCode.FAILED_PRECONDITION, "boom: sender went away")
    err = event.await_status()
    assert err is not None
    assert err.code == ErrorCode.FAILED_PRECONDITION
    assert "boom: sender went away" in err.message
    err2 = event.error()
    assert err2 is not None and err2.code == ErrorCode.FAILED_PRECONDITION
    # Each call returns an independent error the caller destroys.
    err3 = event.await_status()
    assert err3 is not None and err3.code == ErrorCode.FAILED_PRECONDITION


def test_event_set_copies_the_message_so_the_caller_may_free_it(api, event):
    msg = b"transient message"
    buf = ctypes.create_string_buffer(msg, len(msg) + 1)
    api.call(
        "PJRT_Event_Set",
        event=event.handle,
        error_code=int(ErrorCode.ABORTED),
        error_message=ctypes.addressof(buf),
        error_message_size=len(msg),
    )
    ctypes.memset(buf, ord("X"), len(msg))
    err = event.await_status()
    assert err.code == ErrorCode.ABORTED
    assert "transient message" in err.message


@pytest.mark.parametrize("code", [ErrorCode.CANCELLED, ErrorCode.DEADLINE_EXCEEDED,
                                  ErrorCode.INTERNAL, ErrorCode.DATA_LOSS])
def test_event_error_code_survives_set_and_await(event, code):
    event.set(code, code.name)
    err = event.await_status()
    assert err.code == code


def _counting_callback():
    calls = []
    fired = threading.Event()

    def cb(status):
        calls.append(status)
        fired.set()

    return calls, fired, cb


def test_on_ready_registered_before_set_fires_exactly_once_after_set(event):
    calls, fired, cb = _counting_callback()
    event.on_ready(cb)
    assert calls == []
    event.set(ErrorCode.OK)
    assert fired.wait(10), "OnReady callback never ran"
    assert event.await_status() is None
    assert len(calls) == 1 and calls[0] is None


def test_on_ready_on_an_already_ready_event_fires_exactly_once(event):
    event.set(ErrorCode.OK)
    calls, fired, cb = _counting_callback()
    event.on_ready(cb)
    assert fired.wait(10)
    assert len(calls) == 1 and calls[0] is None


def test_on_ready_passes_the_error_status_to_the_callback(event):
    calls, fired, cb = _counting_callback()
    event.on_ready(cb)
    event.set(ErrorCode.UNAVAILABLE, "peer unreachable")
    assert fired.wait(10)
    assert len(calls) == 1
    assert calls[0].code == ErrorCode.UNAVAILABLE
    assert "peer unreachable" in calls[0].message


def test_several_on_ready_callbacks_each_fire_exactly_once(event):
    results = [_counting_callback() for _ in range(5)]
    for _calls, _fired, cb in results[:3]:
        event.on_ready(cb)
    event.set(ErrorCode.OK)
    for _calls, _fired, cb in results[3:]:
        event.on_ready(cb)
    for calls, fired, _ in results:
        assert fired.wait(10)
    event.await_status()
    assert [len(c) for c, _, _ in results] == [1] * 5


def test_on_ready_callback_count_stays_one_after_event_is_destroyed(api):
    ev = api.create_event()
    calls, fired, cb = _counting_callback()
    ev.on_ready(cb)
    ev.set(ErrorCode.OK)
    assert fired.wait(10)
    ev.await_status()
    ev.destroy()
    assert len(calls) == 1


def test_await_blocks_until_another_thread_sets_the_event(api, event):
    started = threading.Barrier(2)
    box = []

    def waiter():
        started.wait()
        box.append(event.await_status())

    t = threading.Thread(target=waiter)
    t.start()
    started.wait()
    event.set(ErrorCode.OK)
    t.join(10)
    assert not t.is_alive(), "Await did not return after Set"
    assert box == [None]


def test_event_destroy_with_null_event_is_ok(api):
    api.call("PJRT_Event_Destroy", event=None)


def test_destroying_an_unset_event_is_ok(api):
    ev = api.create_event()
    ev.destroy()


def test_error_destroy_with_null_error_is_ok(api):
    api.raw_call("PJRT_Error_Destroy", api.args("PJRT_Error_Destroy", error=None))


def test_error_get_code_and_message_of_a_returned_error(api):
    with pytest.raises(pc.PjrtError) as e:
        api.create_client({"no_such_option_xyz": 1})
    assert e.value.code == ErrorCode.INVALID_ARGUMENT
    assert e.value.message
