"""bench/profile_transfer.py's arithmetic, on marks made up here: each step
of a transfer is timed from the later of its two entry calls, whichever
process made it, and a batch's buffers all belong to their one call."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import profile_transfer  # noqa: E402

US = 1000  # marks are in nanoseconds


def mark(us, point, key=""):
    return [us * US, point, key, 1]


def two_transfers():
    """Transfer a: the receive call is the later one (at 100); transfer b:
    the send call is (at 1050). Both are fulfilled 60 µs after it."""
    receiver = {"marks": [
        mark(100, "receive_call"), mark(120, "descriptor_published", "a"),
        mark(160, "recorded", "a"),
        mark(1000, "receive_call"), mark(1070, "descriptor_published", "b"),
        mark(1110, "recorded", "b"),
    ], "times": []}
    sender = {"marks": [
        mark(50, "send_call"), mark(130, "descriptor_arrived", "a"),
        mark(1050, "send_call"), mark(1060, "descriptor_arrived", "b"),
    ], "times": []}
    return sender, receiver


def test_each_step_is_timed_from_the_later_entry_call_of_its_own_transfer():
    later = profile_transfer.from_later_call(*two_transfers())
    assert later["recorded"] == 60
    # a: 30 µs after the receive call; b: 10 µs after the send call.
    assert later["descriptor_arrived"] == 20
    # a: the receive call is the later one (0); b: 50 µs before the send.
    assert later["receive_call"] == -25
    assert later["send_call"] == -25


def test_the_plugins_part_runs_from_the_later_call_to_fulfilment():
    parts = profile_transfer.plugin_part(*two_transfers())
    assert sorted(part for _, part in parts) == [60, 60]
    assert len({call for call, _ in parts}) == 2


def test_a_batchs_buffers_belong_to_one_call():
    receiver = {"marks": [mark(0, "receive_call")]
                + [mark(100 + 10 * i, "recorded", f"k{i}") for i in range(4)], "times": []}
    sender = {"marks": [mark(20, "send_call")], "times": []}
    parts = profile_transfer.plugin_part(sender, receiver)
    assert [part for _, part in parts] == [80, 90, 100, 110]
    assert len({call for call, _ in parts}) == 1


def call(us_in, us_out, name, thread=1):
    return [[us_in * US, "api_enter", name, thread], [us_out * US, "api_exit", name, thread]]


def test_the_calls_around_the_entry_calls_are_counted_per_window_outermost_only():
    """Receiver: barrier exit at 0, receive call at 100, fulfilled at 300,
    block_until_ready back at 350. Two calls before the receive call (one
    with a call made inside it, which is part of it), one that straddles
    the receive call (in no window before it), one after fulfilment, on
    another thread."""
    marks = (call(10, 30, "PJRT_Client_LookupDevice")
             + [[40 * US, "api_enter", "PJRT_Buffer_ReadyEvent", 1],
                *call(42, 45, "PJRT_Event_Destroy"),
                [50 * US, "api_exit", "PJRT_Buffer_ReadyEvent", 1]]
             + [[95 * US, "api_enter", "PJRT_Transfers_CrossHostReceiveBuffers", 1],
                mark(100, "receive_call"),
                [110 * US, "api_exit", "PJRT_Transfers_CrossHostReceiveBuffers", 1]]
             + [mark(300, "recorded", "k")]
             + call(310, 314, "PJRT_Buffer_Destroy", thread=2))
    marks.sort(key=lambda m: m[0])
    receiver = {"marks": marks, "times": [[0, 350 * US]]}
    sender = {"marks": [mark(5, "send_call")], "times": [[0, 400 * US]]}
    rows = {label: rest for label, *rest in profile_transfer.api_windows(sender, receiver)}
    length, count, inside, names = rows["receiver: barrier exit -> receive call"]
    assert (length, count, inside) == (100, 2, 30)
    assert names == {"PJRT_Client_LookupDevice": (1, 20), "PJRT_Buffer_ReadyEvent": (1, 10)}
    length, count, inside, names = rows["receiver: buffer fulfilled -> block_until_ready returns"]
    assert (length, count, inside) == (50, 1, 4)
    assert names == {"PJRT_Buffer_Destroy": (1, 4)}
    length, count, inside, _ = rows["receiver: the whole receive (entry calls included)"]
    assert (length, count, inside) == (350, 4, 49)
    assert rows["sender: barrier exit -> send call"][:3] == [5, 0, 0]


def test_api_marks_are_not_steps_of_a_transfer():
    sender, receiver = two_transfers()
    receiver["marks"] += call(170, 171, "PJRT_Buffer_Destroy")
    receiver["times"] = [[90 * US, 200 * US]]
    table, _ = profile_transfer.analyse(sender, receiver)
    assert "api_enter" not in {name for name, *_ in table}
