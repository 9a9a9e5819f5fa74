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
- A stranger that holds more connections to the UCX ports than the victim
  may open files: with a hard limit above the flood, the victim raised its
  soft limit at start (as a client's creation does) and still takes a
  friend's bytes during the flood; at a hard limit of 1,024 it runs out of
  descriptors but lives (UCX 1.13 aborted in `tcp_iface.c` there).
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
import time

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
    def __init__(self, bed, open_files: str | None = None):
        if not os.path.exists(BIN):
            pytest.skip(f"{BIN} is not built (cargo build --release)")
        argv = [BIN, "victim"]
        if open_files is not None:
            argv = ["prlimit", f"--nofile={open_files}"] + argv
        self.proc = bed.popen("b", argv, stdin=subprocess.PIPE,
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
    assert friend_sends_to(two_hosts, victim, 1, token) == "OK"
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


# Holds connections to every port of the victim's host that accepts (its UCX
# workers' listeners), raising its own open-file limit first; prints how
# many it holds, then holds them until its stdin closes.
HOLDER = r"""
import resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
host, count = sys.argv[1], int(sys.argv[3])
held = []
def holds(port):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect((host, port))
    except OSError:
        return False
    held.append(s)
    return True
ports = [p for p in map(int, sys.argv[2].split(",")) if holds(p)]
while ports and len(held) < count:
    holds(ports[len(held) % len(ports)])
print(len(held), flush=True)
sys.stdin.read()
"""


def listening_ports(bed, host: str) -> list[int]:
    out = bed.run(host, ["ss", "-ltnH"], timeout=10).stdout
    return sorted({int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()})


def hold_connections(bed, victim_host: str, count: int) -> subprocess.Popen:
    ports = listening_ports(bed, victim_host)
    assert ports, "the victim listens nowhere"
    holder = bed.popen("a", ["python3", "-c", HOLDER, bed.address(victim_host),
                             ",".join(map(str, ports)), str(count)],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    held = int(two_hosts.read_line(holder, 120))
    assert held >= count, f"held only {held} connections"
    return holder


def friend_sends(bed, victim: Victim, process: int) -> str:
    """A new destination on the victim, then `friend_sends_to` it."""
    token = secrets.token_hex(32)
    victim.ask(f"expect {token} 65536")
    return friend_sends_to(bed, victim, process, token)


def friend_sends_to(bed, victim: Victim, process: int, token: str) -> str:
    """A friend, known to the victim as `process`, sends 64 KiB under
    `token`; its outcome."""
    friend = bed.popen("a", [BIN, "friend", victim.addresses, token, "65536"],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    friend_addresses = ",".join(json_line(friend)["addresses"])
    victim.ask(f"peer {process} {friend_addresses}")
    friend.stdin.write(b"go\n")
    friend.stdin.flush()
    outcome = json_line(friend, 60)["outcome"]
    friend.wait(30)
    return outcome


FLOOD = 1300


def test_a_connection_flood_beyond_the_soft_fd_limit_is_absorbed_by_the_raised_limit(two_hosts):
    """Soft limit 1,024, hard 4,096: the victim raised its soft limit at
    start, so 1,300 held connections leave room for a friend's bytes."""
    victim = Victim(two_hosts, open_files="1024:4096")
    holder = hold_connections(two_hosts, "b", FLOOD)
    try:
        # The victim's UCX accepts what the holder made (polled: its
        # progress thread takes them asynchronously).
        deadline = time.monotonic() + 30
        while victim.ask("report")["fds"] < FLOOD:
            assert time.monotonic() < deadline, victim.ask("report")
        assert friend_sends(two_hosts, victim, 1) == "OK"
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert victim.proc.poll() is None
    assert victim.finish() == 0


def test_a_connection_flood_at_the_hard_fd_limit_does_not_take_the_process_down(two_hosts):
    """Hard limit 1,024: the flood exhausts the victim's descriptors. It
    lives on through the flood and after it (no abort in UCX's accept path);
    a stranger can make it unreachable over UCX, which is why the plugin
    raises the soft limit and why UCX ports belong on the job's network."""
    victim = Victim(two_hosts, open_files="1024:1024")
    holder = hold_connections(two_hosts, "b", FLOOD)
    try:
        deadline = time.monotonic() + 30
        while victim.ask("report")["fds"] < 1000:
            assert time.monotonic() < deadline, victim.ask("report")
        assert victim.proc.poll() is None
    finally:
        holder.stdin.close()
        holder.wait(30)
    deadline = time.monotonic() + 30
    while victim.ask("report")["fds"] > 100:
        assert time.monotonic() < deadline, "the flood's connections stay open in the victim"
    assert victim.proc.poll() is None
    assert victim.finish() == 0
