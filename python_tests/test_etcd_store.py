"""kv_store=etcd://...: transfers between processes with every key in a real
etcd server (etcd_server.py), a receiver killed under its lease, and the
server stopped and restarted mid-job.

Two-process jobs reuse test_transfers_processes.Job: node 0 here, node 1 a
child (peer_process.py); the test's own channel to the child still goes
through the test's KvServer, the plugin's keys all go to etcd.
"""

from __future__ import annotations

import json
import time

import pytest

import peer_process as peer
import pjrt_ctypes as pc
import transfer_helpers as th
from etcd_server import EtcdServer, free_port
from test_transfers_processes import Job

BT = pc.BufferType
EC = pc.ErrorCode
TTL_S = 2


@pytest.fixture
def etcd():
    s = EtcdServer()
    yield s
    s.close()


@pytest.fixture
def jobs(api, server, etcd):
    made = []

    def make(scenario, **options):
        options = {"kv_store": etcd.url, "etcd_lease_ttl_s": TTL_S, **options}
        j = Job(api, server, scenario, options=options, store="etcd")
        made.append(j)
        return j

    yield make
    for j in made:
        j.close()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_v2_both_directions_over_etcd_leave_no_key(xh, jobs, etcd, server, transport):
    options = {} if transport == "auto" else {"transport": transport}
    job = jobs("v2", **options)
    c = job.client
    specs = peer.V2_SPECS
    job.exchange_v2(xh)
    (m,) = th.wait_keys_retired(c)
    total = sum(s.nbytes for s in specs)
    assert m["bytes_received"] == total and m["bytes_sent"] == total, m
    # Each v2 buffer has a completion key and a descriptor key.
    assert m["keys_deleted"] == m["keys_created"] == 2 * len(specs), m
    # The child reports right after its buffers are ready, its deletes may
    # still be on their way: etcd itself shows them done below.
    peer_m = json.loads(job.ch.get("metrics"))
    assert peer_m["keys_created"] == 2 * len(specs) and peer_m["delete_failures"] == 0, peer_m
    assert th.poll_until(lambda: not etcd.transfer_keys(), 5), etcd.transfer_keys()
    assert not [k for k in server.keys("crosshost/")], "nothing went to the callbacks' store"
    job.finish()
    job.close()
    # Both leases revoked: not even the session entries are left.
    assert etcd.keys() == [], etcd.keys()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_v1_descriptors_relayed_both_directions_over_etcd(xh, jobs, etcd, transport):
    job = jobs("v1", **({} if transport == "auto" else {"transport": transport}))
    c = job.client
    d0 = c.addressable_devices()[0]
    specs = peer.V1_SPECS
    r = xh.make_receive(c, d0, specs)
    job.ch.put_list("v1/desc0", r.descriptors)
    for i, (b, s) in enumerate(zip(r.buffers, specs)):
        th.expect_ok(th.buffer_status(b), f"v1 buffer {i}")
        th.assert_same_bytes(th.read_back(b, s), th.make_data(s, peer.V1_SEED_1 + i), f"buf {i}")
    job.result("v1send")
    descs = job.ch.get_list("v1/desc1")
    srcs = [th.upload(c, d0, s, th.make_data(s, peer.V1_SEED_0 + i)) for i, s in enumerate(specs)]
    for i, send in enumerate([xh.copy_to_remote(b, d) for b, d in zip(srcs, descs)]):
        err, enqueued = send.wait()
        th.expect_ok(err, f"on_done {i}")
        assert enqueued
    job.result("v1")
    (m,) = th.wait_keys_retired(c)
    assert m["keys_deleted"] == m["keys_created"] == len(specs), m
    assert th.poll_until(lambda: not etcd.transfer_keys(), 5), etcd.transfer_keys()
    job.finish()
    job.close()
    assert etcd.keys() == [], etcd.keys()


def test_a_killed_receivers_keys_go_with_its_lease_and_the_waiting_sender_fails_naming_it(
    xh, jobs, etcd
):
    job = jobs("receive_then_idle", send_timeout_ms=60_000)
    c = job.client
    job.ch.get("posted")
    # The child posted its receive: its descriptor key is in etcd, under its lease.
    assert th.poll_until(lambda: [k for k in etcd.transfer_keys() if "/desc/" in k], 5)
    s = th.spec(BT.U8, 4096)
    src = th.upload(c, c.addressable_devices()[0], s, th.make_data(s, 3))
    # A send to a receive the child never posted: it waits on that descriptor.
    (ev,) = xh.send(c, [src], [th.device_ids(c, 1)[0]], [peer.DOOMED_KEY + 1])
    t0 = time.monotonic()
    job.kill()
    st = th.wait_event(ev, timeout=TTL_S + 10)
    failed_after = time.monotonic() - t0
    th.expect_code(st, EC.UNAVAILABLE, "send waiting on the dead receiver's descriptor")
    assert "process 1" in str(st), st
    assert failed_after < TTL_S + 1, f"failed after {failed_after:.2f}s"
    gone = th.poll_until(lambda: not [k for k in etcd.keys() if "/desc/" in k
                                      or k.endswith("/process/1")], TTL_S + 5)
    gone_after = time.monotonic() - t0
    assert gone, etcd.keys()
    assert gone_after < TTL_S + 1, f"keys gone after {gone_after:.2f}s"
    print(f"TTL {TTL_S}s: send failed after {failed_after:.2f}s, keys gone after {gone_after:.2f}s")


def test_an_etcd_server_stopped_mid_job_ends_waits_clearly_and_a_restart_serves_new_transfers(
    xh, api, etcd
):
    call_timeout_ms = 1500
    c0, c1 = th.make_pair(
        api, kv_store=etcd.url, kv_call_timeout_ms=call_timeout_ms, etcd_lease_ttl_s=TTL_S
    )
    try:
        s = th.spec(BT.F32, 256)
        a0, a1 = c0.addressable_devices()[0], c1.addressable_devices()[0]
        # c1 receives from c0 (c0 never sends); c0 sends to a receive c1 never posts.
        (waiting,) = xh.receive(c1, a1, [s], [a0.id()], [5])
        src = th.upload(c0, a0, s, th.make_data(s, 1))
        (sending,) = xh.send(c0, [src], [a1.id()], [6])
        # The receive's descriptor is published (asynchronously) before the stop.
        assert th.poll_until(lambda: [k for k in etcd.transfer_keys() if "/desc/" in k], 5)
        etcd.stop()
        t0 = time.monotonic()
        st = th.buffer_status(waiting, timeout=30)
        th.expect_code(st, EC.UNAVAILABLE, "receive with etcd gone")
        assert "etcd" in str(st), st
        st = th.wait_event(sending, timeout=30)
        th.expect_code(st, EC.UNAVAILABLE, "send with etcd gone")
        assert "etcd" in str(st), st
        assert time.monotonic() - t0 < call_timeout_ms / 1000 + 1.5
    finally:
        for c in (c1, c0):
            t = time.monotonic()
            c.destroy()
            assert time.monotonic() - t < 3, "destroy waited on the dead server"
    etcd.start()
    c0, c1 = th.make_pair(api, kv_store=etcd.url)
    try:
        specs = [th.spec(BT.S32, 1000), th.spec(BT.U8, 1 << 20)]
        a0, a1 = c0.addressable_devices()[0], c1.addressable_devices()[0]
        bufs = xh.receive(c1, a1, specs, [a0.id()] * 2, [7, 8])
        srcs = [th.upload(c0, a0, sp, th.make_data(sp, 9 + i)) for i, sp in enumerate(specs)]
        for i, e in enumerate(xh.send(c0, srcs, [a1.id()] * 2, [7, 8])):
            th.expect_ok(th.wait_event(e), f"send {i} after the restart")
        for i, (b, sp) in enumerate(zip(bufs, specs)):
            th.expect_ok(th.buffer_status(b), f"receive {i} after the restart")
            th.assert_same_bytes(th.read_back(b, sp), th.make_data(sp, 9 + i), f"buf {i}")
        th.wait_keys_retired(c0, c1)
        # The first pair could neither delete nor revoke with etcd down: its
        # keys go when its leases expire, a TTL after the restart.
        assert th.poll_until(lambda: not etcd.transfer_keys(), TTL_S + 3), etcd.transfer_keys()
    finally:
        c1.destroy()
        c0.destroy()
    assert etcd.keys() == [], etcd.keys()


def test_an_unreachable_etcd_fails_client_creation_naming_it(api):
    port = free_port()
    with pytest.raises(pc.PjrtError) as e:
        api.create_client({"kv_store": f"etcd://127.0.0.1:{port}", "kv_call_timeout_ms": 1000})
    assert e.value.code in (EC.UNAVAILABLE, EC.DEADLINE_EXCEEDED), e.value
    assert f"127.0.0.1:{port}" in e.value.message, e.value


def test_a_malformed_etcd_url_is_invalid_argument(api):
    with pytest.raises(pc.PjrtError) as e:
        api.create_client({"kv_store": "etcd://nohost"})
    assert e.value.code == EC.INVALID_ARGUMENT and "no :port" in e.value.message, e.value
