"""Strangers on a process's UCX port, on the two-host bed: nothing someone
who can reach the port does takes the process down or costs it a connection.

The actors are small processes of the plugin's own UCX transport
(src/bin/crosshost-ucx-stranger): a victim on host b holding a destination,
strangers on host a that know only the victim's worker addresses (what a
port scan of its host and UCX's wire format give), and a friend that sends
real bytes afterwards.

- A stranger connects, sends one message under a made-up token and dies at
  once, in the middle of its connection's wire-up. UCX 1.13 aborts the
  process at the other end of such a connection (`ucp_request.c:684`): with
  it, the victim died within a few strangers. The plugin loads no UCX before
  1.14, so the victim lives, refuses every message, and still receives the
  friend's bytes.
- A message that names a dead process of the job as its sender makes the
  victim open no connection: a refusal is told only over a connection that
  is already open, so the victim's descriptors stay where they were.

Skipped, saying why, without a bed (not root) or without a UCX the plugin
uses (1.14 or later: `pip install libucx-cu12`, as scripts/setup.sh does).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess

import pytest

import two_hosts

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.join(os.path.dirname(HERE), "target", "release", "crosshost-ucx-stranger")
STRANGERS = 12
# From at once to a few milliseconds: the victim's side of the wire-up is at
# a different step each time.
DELAYS_US = (0, 100, 300, 1000, 3000, 6000)


def json_line(proc: subprocess.Popen, timeout: float = 30.0) -> dict:
    """The next JSON line of ``proc`` (UCX prints its own log lines on
    stdout too, which are skipped)."""
    while True:
        line = two_hosts.read_line(proc, timeout)
        if not line:
            raise AssertionError(f"{proc.args[-3:]} ended without a line (rc {proc.poll()})")
        if line.startswith("{"):
            return json.loads(line)


class Victim:
    def __init__(self, bed):
        if not os.path.exists(BIN):
            pytest.skip(f"{BIN} is not built (cargo build --release)")
        self.proc = bed.popen("b", [BIN, "victim"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            hello = json_line(self.proc)
        except AssertionError:
            err = self.proc.stderr.read().decode()
            if "not used" in err or "not available" in err:
                pytest.skip(f"no UCX the plugin uses: {err.strip()}")
            raise
        self.version = hello["version"]
        self.addresses = ",".join(hello["addresses"])

    def ask(self, command: str) -> dict:
        assert self.proc.poll() is None, f"the victim died (rc {self.proc.returncode})"
        self.proc.stdin.write((command + "\n").encode())
        self.proc.stdin.flush()
        return json_line(self.proc)

    def finish(self) -> int:
        self.proc.stdin.close()
        return self.proc.wait(30)


def stranger(bed, victim: Victim, delay_us: int, claimed_process: int | None = None):
    argv = [BIN, "stranger", victim.addresses, str(delay_us)]
    if claimed_process is not None:
        argv.append(str(claimed_process))
    bed.run("a", argv, timeout=60)


def test_strangers_that_die_in_the_middle_of_wire_up_do_not_take_the_process_down(two_hosts):
    victim = Victim(two_hosts)
    major, minor = map(int, victim.version.split(".")[:2])
    assert (major, minor) >= (1, 14), victim.version
    token = secrets.token_hex(32)
    victim.ask(f"expect {token} 65536")
    for i in range(STRANGERS):
        stranger(two_hosts, victim, DELAYS_US[i % len(DELAYS_US)])
        assert victim.proc.poll() is None, (
            f"the victim died after {i + 1} strangers (rc {victim.proc.returncode}): "
            f"{victim.proc.stderr.read().decode()[-2000:]}")
    # A real peer still gets its bytes in.
    friend = two_hosts.popen("a", [BIN, "friend", victim.addresses, token, "65536"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    friend_addresses = ",".join(json_line(friend)["addresses"])
    victim.ask(f"peer 1 {friend_addresses}")
    friend.stdin.write(b"go\n")
    friend.stdin.flush()
    assert json_line(friend, 60)["outcome"] == "OK"
    report = victim.ask("report")
    assert report["destinations"] == {token: "pattern"}, report
    # Every stranger whose message arrived was refused (some die before
    # their message leaves).
    assert 1 <= report["rejected"] <= STRANGERS, report
    assert victim.finish() == 0


def test_a_message_naming_a_dead_process_costs_no_connection(two_hosts):
    victim = Victim(two_hosts)
    # Process 1 of the job was here and died.
    friend = two_hosts.popen("a", [BIN, "friend", victim.addresses, "00" * 32, "8"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    victim.ask("peer 1 " + ",".join(json_line(friend)["addresses"]))
    two_hosts_kill(friend)
    before = victim.ask("report")
    for _ in range(STRANGERS):
        stranger(two_hosts, victim, 3000, claimed_process=1)
    after = victim.ask("report")
    assert after["rejected"] >= before["rejected"] + 1, (before, after)
    # Answering each would dial the dead process: a socket a message.
    assert after["fds"] <= before["fds"] + 2, (before, after)
    assert victim.finish() == 0


def two_hosts_kill(proc: subprocess.Popen) -> None:
    two_hosts.kill_group(proc)
