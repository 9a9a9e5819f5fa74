"""What an observer on the wire sees of a job, captured on the two-host bed
(every frame on host b's eth0, read with a raw packet socket inside its
namespace), with `job_secret_file` given to both processes:

- the control links' frames are sealed: no transfer key name (a descriptor
  `crosshost/desc/…`, a receipt `crosshost/recv/…`) crosses in clear;
- the framework's store holds only sealed values: no session entry crosses
  in clear;
- the buffers' bytes do cross in clear (the capture holds them), as NCCL's
  and UCX's do (docs/trust.md): the capture saw the transfer.

Without the secret the same capture shows the session entries: the check
can fail. Over UCX and the TCP fallback. Skipped without a bed (not root).
"""
from __future__ import annotations

import os
import subprocess

import pytest

import transfer_helpers as th
import two_hosts
from test_transfers_two_hosts import BedJob, assert_delivered
from two_host_worker import SEED, SPECS

# Records every frame on eth0 until its stdin closes, then writes them out.
CAPTURE = r"""
import select, socket, sys
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
s.bind(("eth0", 0))
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
frames = []
print("capturing", flush=True)
while True:
    ready, _, _ = select.select([s, sys.stdin], [], [])
    if s in ready:
        frames.append(s.recv(65536))
    if sys.stdin in ready and not sys.stdin.read(1):
        while True:
            try:
                frames.append(s.recv(65536, socket.MSG_DONTWAIT))
            except BlockingIOError:
                break
        break
with open(sys.argv[1], "wb") as out:
    out.write(b"".join(frames))
print(len(frames), flush=True)
"""


def captured(bed, tmp_path, run) -> bytes:
    path = tmp_path / "wire.bin"
    capture = bed.popen("b", ["python3", "-c", CAPTURE, str(path)],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert two_hosts.read_line(capture, 30).strip() == "capturing"
    try:
        run()
    finally:
        capture.stdin.close()
        frames = two_hosts.read_line(capture, 60)
        capture.wait(30)
    assert frames.strip() and int(frames) > 0, "nothing captured"
    return path.read_bytes()


def secret_file(tmp_path) -> str:
    path = tmp_path / "job.secret"
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return str(path)


@pytest.mark.parametrize("sealed", [True, False], ids=["secret", "no-secret"])
@pytest.mark.parametrize("hide_ucx", [False, True], ids=["ucx", "tcp-fallback"])
def test_an_observer_on_the_wire_reads_the_bytes_and_nothing_that_opens_the_job(
        two_hosts, tmp_path, hide_ucx, sealed):
    options = {"job_secret_file": secret_file(tmp_path)} if sealed else {}
    job = BedJob(two_hosts, tmp_path, hide_ucx=hide_ucx, options=options)
    results = {}

    def run():
        results["sent"], results["received"] = job.pair("v2", "recv_first")

    wire = captured(two_hosts, tmp_path, run)
    assert_delivered(results["sent"], results["received"], "tcp" if hide_ucx else "ucx")
    # The capture saw the transfer: the largest buffer's bytes are in it.
    largest = max(range(len(SPECS)), key=lambda i: th.make_data(SPECS[i], SEED + i).nbytes)
    data = th.make_data(SPECS[largest], SEED + largest).view("uint8").tobytes()
    assert data[4096:4096 + 256] in wire, "the buffers' bytes were not on the wire"
    if sealed:
        for clear in (b"crosshost/desc/", b"crosshost/recv/", b"xs5 ", b"xu1 "):
            assert clear not in wire, f"{clear!r} crossed the wire in clear"
    else:
        # Without the secret the store's values travel as they are.
        assert b"xs5 " in wire
