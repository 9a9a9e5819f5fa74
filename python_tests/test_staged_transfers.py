"""Staged transfers across the two-host bed (issue #38's CPU half): both
clients are created with ``stage_host_transfers=1``, UCX is hidden, so every
buffer crosses over the TCP fallback through the staging pipeline
(src/transport/staging/): the sender copies its source chunk by chunk into
its send ring while earlier chunks are on the wire, the receiver lands each
chunk in its receive ring and copies it into the destination, and the
completion key is set only once the last copy completed. Mixed sizes (one
byte to several chunks, chunk boundaries straddled), every byte checked, 0
keys left, every transfer counted as staged on both sides, staging memory
within its bound. UCX does not stage yet (the pipeline is wired into the
TCP transport only)."""

from __future__ import annotations

import json
import subprocess

from test_transfers_two_hosts import BedJob

CHUNK = 1 << 20
DEPTH = 3
SIZES = [1, 4097, 300_000, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 9 * CHUNK + 4095]
ROUNDS = 40


def test_mixed_size_staged_transfers_over_the_tcp_fallback(two_hosts, tmp_path):
    job = BedJob(two_hosts, tmp_path, hide_ucx=True,
                 options={"stage_host_transfers": 1, "staging_chunk_bytes": CHUNK,
                          "staging_ring_depth": DEPTH})
    receiver = job.start(1, "rounds", stdin=subprocess.PIPE)
    sender = job.start(0, "rounds", stdin=subprocess.PIPE)
    for proc in (receiver, sender):
        assert "ready" in job.line(proc, 60), "a worker did not start"
    for k in range(1, ROUNDS + 1):
        length = SIZES[(k * 5) % len(SIZES)]
        order = (json.dumps({"round": k, "len": length}) + "\n").encode()
        for proc in (receiver, sender):
            proc.stdin.write(order)
            proc.stdin.flush()
        received, sent = job.line(receiver, 60), job.line(sender, 60)
        assert sent["outcome"] == "OK", (length, sent)
        assert received["outcome"] == "OK" and received["same"] is True, (length, received)
    for proc in (receiver, sender):
        proc.stdin.close()
    sent, received = job.result(sender), job.result(receiver)
    r, s = received["metrics"], sent["metrics"]
    assert r["keys_created"] == r["keys_deleted"] and r["keys_outstanding"] == 0, r
    assert s["keys_outstanding"] == 0, s
    total = sum(SIZES[(k * 5) % len(SIZES)] for k in range(1, ROUNDS + 1))
    assert r["transports"]["tcp"]["bytes_received"] == total, r["transports"]
    assert r["transports"]["tcp"]["transfers_received"] == ROUNDS, r["transports"]
    # Every transfer went through both halves of the pipeline.
    assert r["staged"] == ROUNDS and s["staged"] == ROUNDS, (r["staged"], s["staged"])
    for m in (r, s):
        assert 0 < m["staging_bytes_held"] <= 2 * CHUNK * DEPTH, m["staging_bytes_held"]
