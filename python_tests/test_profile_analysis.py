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
