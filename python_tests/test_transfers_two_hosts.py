"""Transfers between two hosts, through the C API, on the two-host bed
(python_tests/two_hosts.py): node 0 on host a sends, node 1 on host b
receives, and neither process is given an address or a transport. Their own
hostname, pid, IPC and mount namespaces and /dev/shm leave no same-host
shortcut, so the bytes go over the bed's network: over UCX where libucp
loads (the metrics name the UCX lanes, tcp over the bed's eth0), over the
TCP transport where it is hidden (bind-mounted over with /dev/null on both
hosts).

Covered: v2 in both call orders (receive first, send first), v1, a v1
cancellation racing its send, a sender and a receiver SIGKILLed mid-transfer
(stopped at a kill point, src/sync/kill_points.rs), and `transport=ucx`
without UCX failing creation with the places it looked. The framework's KV
store runs on host a (two_host_worker.py kv).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

import transfer_helpers as th
import two_hosts
from conftest import library_path

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "two_host_worker.py")
TIMEOUT_MS = 30_000
# Well inside the 30 s receive and send timeouts: a dead peer's link closes.
PROMPT_S = 10.0

def python():
    import sys

    return sys.executable


class BedJob:
    """A job of two workers on the bed, the KV store on host a."""

    def __init__(self, bed, tmp_path, hide_ucx=False, options=None, env=None, kill_point=None):
        self.bed = bed
        inherited = dict(os.environ)
        inherited.pop("PJRT_CROSSHOST_UCX_LIBRARY", None)
        inherited.pop("UCX_TCP_RX_SEG_SIZE", None)
        inherited.pop("PJRT_CROSSHOST_THREAD_SLICE_US", None)
        self.env = dict(inherited, PYTHONPATH=HERE, **(env or {}))
        self.prefix = two_hosts.without_ucx([]) if hide_ucx else []
        port = bed.port()
        self.kv = bed.popen("a", [*self.prefix, python(), WORKER, "kv", port],
                            env=self.env, stdout=__import__("subprocess").PIPE)
        line = two_hosts.read_line(self.kv, 30)
        assert line, "the KV server did not start"
        self.kv_address = json.loads(line)["kv"]
        self.kv_address[0] = bed.address("a")
        self.session = th.unique("hosts")
        self.options = {"receive_timeout_ms": TIMEOUT_MS, "send_timeout_ms": TIMEOUT_MS,
                        **(options or {})}
        self.tmp_path = tmp_path
        self.kill_point = kill_point

    def start(self, node, scenario, order=None, kill=False, extra_options=None, stdin=None):
        import subprocess

        options = {**self.options, **(extra_options or {})}
        cfg = {"lib": str(library_path()), "kv": self.kv_address, "session": self.session,
               "node": node, "scenario": scenario, "order": order, "options": options}
        env = dict(self.env)
        if kill:
            env["PJRT_CROSSHOST_TEST_KILL_POINT"] = self.kill_point
            env["PJRT_CROSSHOST_TEST_KILL_POINT_MARKER"] = str(self.tmp_path / "reached")
        host = "a" if node == 0 else "b"
        log = self.tmp_path / f"node{node}.log"
        proc = self.bed.popen(host, [*self.prefix, python(), WORKER, "run", json.dumps(cfg)],
                              env=env, stdout=subprocess.PIPE, stderr=open(log, "wb"),
                              stdin=stdin if stdin is not None else subprocess.DEVNULL)
        proc.log = log
        return proc

    @staticmethod
    def line(proc, timeout) -> dict:
        """The next JSON line of a worker playing "rounds" (other lines
        passed over); fails with the worker's log when it ended instead."""
        while True:
            text = two_hosts.read_line(proc, timeout)
            if not text:
                log = proc.log.read_text(errors="replace")[-3000:]
                raise AssertionError(f"a worker ended (rc {proc.poll()}):\n{log}")
            if text.startswith("{"):
                return json.loads(text)

    def result(self, proc, timeout=120):
        """The worker's result line (it prints one, then may wait for its peer)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            line = two_hosts.read_line(proc, max(left, 0.001)) if left > 0 else ""
            if not line or line.startswith("{"):
                break
        log = proc.log.read_text(errors="replace")[-4000:]
        assert line, f"worker printed no result (exit {proc.poll()}):\n{log}"
        result = json.loads(line)
        assert "error" not in result, f"worker failed:\n{result['error']}\n{log}"
        return result

    def pair(self, scenario, order=None):
        receiver = self.start(1, scenario, order)
        sender = self.start(0, scenario, order)
        return self.result(sender), self.result(receiver)


def assert_delivered(sent, received, route):
    assert sent["sends"] == ["OK"] * len(sent["sends"]), sent["sends"]
    assert received["buffers"] == ["OK"] * len(received["buffers"]), received["buffers"]
    assert all(received["same"]), received["same"]
    m = received["metrics"]
    assert m["keys_created"] == m["keys_deleted"] and m["keys_outstanding"] == 0, m
    carried = m["transports"][route]
    assert carried["bytes_received"] == m["bytes_received"] > 0, m["transports"]
    assert carried["transfers_received"] == len(received["buffers"]), m["transports"]
    for other in ("shm", "tcp", "ucx"):
        if other != route:
            assert m["transports"][other]["bytes_received"] == 0, m["transports"]
    if route == "ucx":
        # UCX found no same-host shortcut: its lanes are TCP over the bed.
        lanes = m["transports"]["ucx"]["lanes"]
        assert "tcp/eth0" in lanes, lanes
        for shortcut in ("posix", "sysv", "cma", "xpmem", "knem"):
            assert shortcut not in lanes, lanes
        assert sent["metrics"]["transports"]["ucx"]["transfers_sent"] == len(sent["sends"])
    # Nothing a peer of the job sends is refused.
    assert m["ucx_messages_rejected"] == 0, m


@pytest.mark.parametrize("hide_ucx", [False, True], ids=["ucx", "tcp-fallback"])
@pytest.mark.parametrize("order", ["recv_first", "send_first"])
def test_v2_between_hosts_with_no_options(two_hosts, tmp_path, hide_ucx, order):
    job = BedJob(two_hosts, tmp_path, hide_ucx=hide_ucx)
    sent, received = job.pair("v2", order)
    assert_delivered(sent, received, "tcp" if hide_ucx else "ucx")
    # The plugin's UCX defaults are in the environment UCX reads when it
    # loads (set on the TCP fallback too, where no libucp loads).
    for worker in (sent, received):
        assert worker["ucx_env"] == {"UCX_TCP_RX_SEG_SIZE": "512k"}, worker["ucx_env"]
        assert_short_slices(worker["thread_slices"], hide_ucx)


def test_where_ucx_has_only_tcp_lanes_a_batch_of_large_buffers_takes_the_tcp_transport(
        two_hosts, tmp_path):
    """The bed's UCX has no RDMA lane, only TCP: `auto` then sends the eight
    1 MiB buffers of one batch over the plugin's TCP transport, measured
    the faster for such batches (transfer/route.rs), and the batch's small
    buffers over UCX; `transport=ucx` keeps every buffer on UCX."""
    job = BedJob(two_hosts, tmp_path)
    sent, received = job.pair("batch", "recv_first")
    assert sent["sends"] == ["OK"] * 10 and received["buffers"] == ["OK"] * 10, (sent, received)
    assert all(received["same"]), received["same"]
    m = received["metrics"]
    assert m["keys_outstanding"] == 0 and m["keys_created"] == m["keys_deleted"], m
    tcp, ucx = m["transports"]["tcp"], m["transports"]["ucx"]
    assert tcp["transfers_received"] == 8 and tcp["bytes_received"] == 8 << 20, m["transports"]
    assert ucx["transfers_received"] == 2 and ucx["bytes_received"] == 17 + 4096, m["transports"]

    forced = BedJob(two_hosts, tmp_path, options={"transport": "ucx"})
    sent, received = forced.pair("batch", "recv_first")
    assert received["buffers"] == ["OK"] * 10 and all(received["same"]), received
    m = received["metrics"]
    assert m["transports"]["ucx"]["transfers_received"] == 10, m["transports"]
    assert m["transports"]["tcp"]["transfers_received"] == 0, m["transports"]


# The short slice the cross-host threads ask for (sync/threads.rs).
SHORT_SLICE_NS = 100_000


def kernel_reports_slices() -> bool:
    """Linux 6.12 and newer honour a thread's requested slice (and report
    it as ``se.slice``); older kernels accept the hint and ignore it."""
    import re

    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return found is not None and (int(found[1]), int(found[2])) >= (6, 12)


# Threads (their names as the kernel keeps them, 15 characters) that carry
# transfers between hosts, and so ask for the short slice: the control-link
# poller (every link, served or dialled), the TCP transport's, UCX's
# progress threads.
CROSS_HOST_THREADS = {"crosshost-ctl-p", "crosshost-tcp-r", "crosshost-tcp-a"}
# Threads of one host's paths and housekeeping, at the kernel's slice.
KERNEL_SLICE_THREADS = {"crosshost-lifec", "crosshost-copy-", "crosshost-send-", "crosshost-recv-"}


def assert_short_slices(slices, hide_ucx):
    """The threads that carry transfers between hosts ask for the short
    slice; the plugin's other threads and the host's own keep the kernel's."""
    if not kernel_reports_slices():
        return  # the hint is ignored before Linux 6.12: nothing to see
    plugin = slices["plugin"]
    short = CROSS_HOST_THREADS | (set() if hide_ucx else {"crosshost-ucx"})
    # One poller reads every control link: no thread per link any more.
    assert short <= plugin.keys(), plugin
    assert not {"crosshost-ctl-c", "crosshost-ctl-l"} & plugin.keys(), plugin
    assert all(plugin[name] == [SHORT_SLICE_NS] for name in short & plugin.keys()), plugin
    kernel = KERNEL_SLICE_THREADS & plugin.keys()
    assert {"crosshost-lifec"} <= kernel, plugin
    assert all(SHORT_SLICE_NS not in plugin[name] for name in kernel), plugin
    assert slices["main"] not in (None, SHORT_SLICE_NS), slices


def test_the_slice_hint_can_be_turned_off(two_hosts, tmp_path):
    if not kernel_reports_slices():
        pytest.skip("this kernel ignores thread slices (before Linux 6.12)")
    job = BedJob(two_hosts, tmp_path, env={"PJRT_CROSSHOST_THREAD_SLICE_US": "0"})
    sent, received = job.pair("v2", "recv_first")
    assert_delivered(sent, received, "ucx")
    for worker in (sent, received):
        slices = worker["thread_slices"]
        # The kernel's default slice, the same as the host's main thread.
        kept = {s for found in slices["plugin"].values() for s in found}
        assert kept == {slices["main"]}, slices


def test_a_ucx_setting_of_the_user_stands(two_hosts, tmp_path):
    job = BedJob(two_hosts, tmp_path, env={"UCX_TCP_RX_SEG_SIZE": "128k"})
    sent, received = job.pair("v2", "recv_first")
    assert_delivered(sent, received, "ucx")
    for worker in (sent, received):
        assert worker["ucx_env"] == {"UCX_TCP_RX_SEG_SIZE": "128k"}, worker["ucx_env"]


def test_the_package_prepares_the_same_ucx_environment_as_the_library():
    """jax_plugins.crosshost sets UCX's environment at import (before JAX's
    threads start), the library before it loads libucp: the same list."""
    import re

    repo = os.path.dirname(HERE)
    with open(os.path.join(repo, "src/transport/ucx/library.rs")) as f:
        rust = f.read().split("pub const UCX_ENVIRONMENT", 1)[1].split("];", 1)[0]
    with open(os.path.join(repo, "python/jax_plugins/crosshost/__init__.py")) as f:
        package = f.read().split("_UCX_ENVIRONMENT = (", 1)[1].split("\n)", 1)[0]
    pair = re.compile(r'\(\s*"([A-Z_]+)",\s*"([^"]*)"\s*\)')
    assert pair.findall(rust) == pair.findall(package) != []


@pytest.mark.parametrize("hide_ucx", [False, True], ids=["ucx", "tcp-fallback"])
def test_v1_between_hosts(two_hosts, tmp_path, hide_ucx):
    # v1's receiver cannot know where its sender is: it offers UCX or TCP
    # only when told (transport=ucx|tcp); shared memory would not reach.
    transport = "tcp" if hide_ucx else "ucx"
    job = BedJob(two_hosts, tmp_path, hide_ucx=hide_ucx, options={"transport": transport})
    sent, received = job.pair("v1")
    assert_delivered(sent, received, transport)


def test_a_cancelled_v1_buffer_refuses_its_late_send_and_the_rest_arrive(two_hosts, tmp_path):
    job = BedJob(two_hosts, tmp_path, options={"transport": "ucx"})
    sent, received = job.pair("cancel")
    assert received["buffers"][1].startswith("CANCELLED"), received["buffers"]
    assert sent["sends"][1] != "OK", sent["sends"]
    others = [i for i in range(len(received["buffers"])) if i != 1]
    assert all(received["buffers"][i] == "OK" and received["same"][i] for i in others), received
    assert all(sent["sends"][i] == "OK" for i in others), sent["sends"]
    assert received["metrics"]["keys_outstanding"] == 0


def wait_for_marker(path, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "the worker to be killed exited first"
        assert time.monotonic() < deadline, "the kill point was never reached"
        time.sleep(0.01)


@pytest.mark.parametrize("hide_ucx", [False, True], ids=["ucx", "tcp-fallback"])
def test_a_sender_killed_mid_transfer_fails_the_receive_promptly(two_hosts, tmp_path, hide_ucx):
    job = BedJob(two_hosts, tmp_path, hide_ucx=hide_ucx, kill_point="sender_after_descriptor")
    receiver = job.start(1, "v2", "recv_first")
    sender = job.start(0, "v2", "recv_first", kill=True)
    wait_for_marker(tmp_path / "reached", sender)
    killed_at = time.monotonic()
    os.killpg(sender.pid, signal.SIGKILL)
    sender.wait(30)
    received = job.result(receiver)
    # The buffer whose send reached the kill point fails. Sends run side by
    # side (TCP sends on several threads), so others may have landed before
    # the kill: each is OK or failed, none is left waiting.
    assert any(b.startswith("UNAVAILABLE") for b in received["buffers"]), received["buffers"]
    assert all(b == "OK" or b.startswith("UNAVAILABLE") for b in received["buffers"]), received
    assert time.monotonic() - killed_at < PROMPT_S + 30, received
    assert received["seconds"] < TIMEOUT_MS / 1000, received


@pytest.mark.parametrize("hide_ucx", [False, True], ids=["ucx", "tcp-fallback"])
def test_a_receiver_killed_mid_transfer_fails_the_send_promptly(two_hosts, tmp_path, hide_ucx):
    job = BedJob(two_hosts, tmp_path, hide_ucx=hide_ucx, kill_point="receiver_after_descriptor")
    receiver = job.start(1, "v2", "recv_first", kill=True)
    sender = job.start(0, "v2", "send_first")
    wait_for_marker(tmp_path / "reached", receiver)
    started = time.monotonic()
    os.killpg(receiver.pid, signal.SIGKILL)
    receiver.wait(30)
    sent = job.result(sender)
    # The receiver dies with its first descriptor out and the rest not
    # published: the first buffer may have landed before the kill (its OK
    # then says the receiver acknowledged it), every other send fails.
    first, rest = sent["sends"][0], sent["sends"][1:]
    assert rest and "OK" not in rest, sent["sends"]
    assert all(s.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED")) for s in rest), sent
    assert first == "OK" or first.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED")), sent
    assert time.monotonic() - started < TIMEOUT_MS / 1000, sent


def test_transport_ucx_without_ucx_fails_creation_naming_where_it_looked(two_hosts, tmp_path):
    job = BedJob(two_hosts, tmp_path, hide_ucx=True, options={"transport": "ucx"})
    receiver = job.start(1, "v2")
    sender = job.start(0, "v2")
    for proc in (sender, receiver):
        result = job.result(proc)
        error = result["create_error"]
        assert error["code"] == 9, error  # FAILED_PRECONDITION
        message = error["message"]
        assert "transport=ucx" in message, message
        assert "libucp.so.0" in message and "PJRT_CROSSHOST_UCX_LIBRARY" in message, message


def test_a_receiver_that_advertises_an_unreachable_address_gets_an_error_naming_it(
        two_hosts, tmp_path):
    # Host b listens everywhere but advertises an address nobody has (a NAT
    # or a wrong advertise_address): the sender's error says which address
    # it tried, whose it was, and which option sets it.
    job = BedJob(two_hosts, tmp_path, hide_ucx=True,
                 options={"receive_timeout_ms": 8000, "send_timeout_ms": 8000})
    receiver = job.start(1, "v2", "recv_first",
                         extra_options={"advertise_address": "10.77.0.99", "tcp_bind": "0.0.0.0"})
    sender = job.start(0, "v2", "recv_first")
    sent = job.result(sender)
    assert "OK" not in sent["sends"], sent["sends"]
    for message in sent["sends"]:
        # Refused by the network (no route) or, when the send's deadline
        # comes first (each send's control-link dial waits for the
        # network's answer too), DEADLINE_EXCEEDED: either way naming the
        # address and the option.
        assert message.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED")), message
        assert "10.77.0.99" in message, message
    # The first to try says what to change (those queued behind it may find
    # their time gone before they try).
    assert any("advertise_address" in message for message in sent["sends"]), sent["sends"]
    # The receiver hears nothing from a sender that cannot reach it: its
    # receives end at their deadline, not never.
    received = job.result(receiver)
    assert all(b.startswith("DEADLINE_EXCEEDED") for b in received["buffers"]), received
    assert received["metrics"]["keys_outstanding"] == 0, received["metrics"]
