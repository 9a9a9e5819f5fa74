"""Staged transfers across the two-host bed (issue #38's CPU half): both
clients are created with ``stage_host_transfers=1``, so every buffer
crosses through the staging pipeline (src/transport/staging/): the sender
copies its source chunk by chunk into its send ring while earlier chunks
are on the wire, the receiver lands each chunk in its receive ring and
copies it into the destination, and the completion key is set only once
the last copy completed. Over UCX (``transport=ucx``) the chunks go as
chunk messages of at most the receiver's ring chunk, each pulled by the
receiver once it has a slot for it (src/transport/ucx/stream.rs); over the
TCP fallback (UCX hidden) as one byte stream.

Each test: 200 transfers of mixed sizes (one byte to several chunks, chunk
boundaries straddled), 4 buffers to a call so that streams share the rings,
every byte checked, 0 keys left, every transfer counted as staged on both
sides and in its transport's ``bytes_staged``, staging memory within its
bound, no pinned memory on a host client."""

from __future__ import annotations

import json
import random
import subprocess

from test_transfers_two_hosts import BedJob

CHUNK = 1 << 20
DEPTH = 3
SIZES = [1, 4097, 300_000, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 9 * CHUNK + 4095]
ROUNDS = 50
PER_ROUND = 4


def plan() -> list[list[int]]:
    """Each round's buffer sizes (the same in every run)."""
    rng = random.Random(38)
    return [[rng.choice(SIZES) for _ in range(PER_ROUND)] for _ in range(ROUNDS)]


def run_staged(two_hosts, tmp_path, route: str, **job) -> None:
    options = {"stage_host_transfers": 1, "staging_chunk_bytes": CHUNK,
               "staging_ring_depth": DEPTH, **job.pop("options", {})}
    job = BedJob(two_hosts, tmp_path, options=options, **job)
    receiver = job.start(1, "rounds", stdin=subprocess.PIPE)
    sender = job.start(0, "rounds", stdin=subprocess.PIPE)
    for proc in (receiver, sender):
        assert "ready" in job.line(proc, 60), "a worker did not start"
    rounds = plan()
    for k, lengths in enumerate(rounds, start=1):
        order = (json.dumps({"round": k, "lens": lengths}) + "\n").encode()
        for proc in (receiver, sender):
            proc.stdin.write(order)
            proc.stdin.flush()
        received, sent = job.line(receiver, 60), job.line(sender, 60)
        assert sent["outcomes"] == ["OK"] * PER_ROUND, (lengths, sent)
        assert received["outcomes"] == ["OK"] * PER_ROUND, (lengths, received)
        assert received["same"] == [True] * PER_ROUND, (lengths, received)
    for proc in (receiver, sender):
        proc.stdin.close()
    sent, received = job.result(sender), job.result(receiver)
    r, s = received["metrics"], sent["metrics"]
    assert r["keys_created"] == r["keys_deleted"] and r["keys_outstanding"] == 0, r
    assert s["keys_outstanding"] == 0, s
    transfers = ROUNDS * PER_ROUND
    total = sum(sum(lengths) for lengths in rounds)
    carried = r["transports"][route]
    assert carried["bytes_received"] == total, r["transports"]
    assert carried["transfers_received"] == transfers, r["transports"]
    # Every transfer went through both halves of the pipeline.
    assert r["staged"] == transfers and s["staged"] == transfers, (r["staged"], s["staged"])
    for m in (r, s):
        assert m["transports"][route]["transfers_staged"] == transfers, m["transports"]
        assert m["transports"][route]["bytes_staged"] == total, m["transports"]
        assert 0 < m["staging_bytes_held"] <= 2 * CHUNK * DEPTH, m["staging_bytes_held"]
        # Host clients stage through heap memory: nothing pinned.
        assert m["pinned_bytes_held"] == 0, m


def test_200_mixed_size_staged_transfers_over_ucx(two_hosts, tmp_path):
    run_staged(two_hosts, tmp_path, "ucx", options={"transport": "ucx"})


def test_200_mixed_size_staged_transfers_over_the_tcp_fallback(two_hosts, tmp_path):
    run_staged(two_hosts, tmp_path, "tcp", hide_ucx=True)
