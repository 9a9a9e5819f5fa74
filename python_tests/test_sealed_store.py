"""job_secret_file: a party with full read and write access to the job's
etcd cannot complete a receive, get bytes into a receiver's buffer, or
take a sender's bytes (issue 17). Every value the plugin puts in the store
is sealed with the job's secret (src/kv/sealed.rs).

Two clients of one job in this process, kv_store=etcd, over shared memory,
TCP and UCX. The attacker is etcdctl: it reads every key and writes what it
likes where the job's waiters look. With the secret the attacker reads
nothing usable (no descriptor, token, nonce or control secret in clear),
each forged value is rejected and counted (`forged_values_rejected`), and
the transfer the job then really makes completes with the right bytes. A
client with another secret cannot join the job.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import zlib

import pytest

import pjrt_ctypes as pc
import transfer_helpers as th
from etcd_server import ETCD, ETCDCTL, EtcdServer



def ucx_available() -> bool:
    """Whether the plugin finds a UCX it uses (1.14 or later: the libucx
    wheel scripts/test.sh names). Not by loading one here: a UCX loaded in
    this process first would be the one the plugin's finds its parts in."""
    wheel = os.environ.get("PJRT_CROSSHOST_UCX_WHEEL_LIB", "")
    explicit = os.environ.get("PJRT_CROSSHOST_UCX_LIBRARY", "")
    return bool(explicit) or (bool(wheel) and os.path.isfile(os.path.join(wheel, "libucp.so")))


BT = pc.BufferType
EC = pc.ErrorCode

pytestmark = pytest.mark.skipif(
    ETCD is None or ETCDCTL is None, reason="etcd-server and etcd-client are not installed"
)

TRANSPORTS = ["auto", "tcp", pytest.param("ucx", marks=pytest.mark.skipif(
    not ucx_available(), reason="no UCX 1.14 or later (the libucx wheel) for the plugin"))]


@pytest.fixture
def etcd():
    s = EtcdServer()
    yield s
    s.close()


def write_secret(path, data: bytes | None = None):
    path.write_bytes(os.urandom(32) if data is None else data)
    return str(path)


def make_job(api, etcd, secret_file, transport="auto", nodes=(0, 1), **extra):
    session = th.unique("sealed")

    def opts(node):
        o = {
            "num_devices": 1,
            "node_id": node,
            "num_nodes": 2,
            "session": session,
            "kv_store": etcd.url,
            "transport": transport,
            "receive_timeout_ms": 20000,
            "send_timeout_ms": 20000,
            "session_timeout_ms": 20000,
            **extra,
        }
        if secret_file is not None:
            o["job_secret_file"] = secret_file[node] if isinstance(secret_file, tuple) else secret_file
        return o

    return th.create_concurrently([lambda n=n: api.create_client(opts(n)) for n in nodes])


def etcd_values(etcd, prefix="crosshost/") -> dict[str, bytes]:
    """Every key under ``prefix`` with its value, as the attacker reads it."""
    out = etcd._ctl("get", "--prefix", prefix, "-w", "json").stdout
    kvs = json.loads(out).get("kvs", [])
    return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")) for kv in kvs}


def etcd_put(etcd, key: str, value: bytes) -> None:
    # etcdctl put reads the value from stdin when it is not an argument.
    subprocess.run(
        [ETCDCTL, "--endpoints", etcd.endpoint, "put", key],
        input=value,
        env=dict(os.environ, ETCDCTL_API="3"),
        check=True,
        capture_output=True,
        timeout=30,
    )


def forged(client) -> int:
    return th.metrics(client)["forged_values_rejected"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_with_a_job_secret_the_store_reveals_nothing_and_forged_values_are_rejected(
        api, xh, etcd, tmp_path, transport):
    secret = write_secret(tmp_path / "secret")
    c0, c1 = make_job(api, etcd, secret, transport)
    try:
        stored = etcd_values(etcd)
        assert any(k.endswith("/epoch") for k in stored), stored.keys()
        for key, value in stored.items():
            # Sealed: the format tag, then bytes that say nothing.
            assert value.startswith(b"xsv1"), (key, value[:40])
            # (Whole plaintext markers: three random bytes of a long
            # ciphertext, a roster's, can spell "xs5" by chance.)
            assert b"xs5 " not in value and b"unix=pjrt" not in value, (key, value)

        s = th.spec(BT.F32, 256)
        data = th.make_data(s, 17)
        dst = c1.addressable_devices()[0]
        src_id = th.device_ids(c1, 0)[0]  # the sender's device, for the receive
        dst_id = th.device_ids(c0, 1)[0]  # the receiver's device, for the send

        # 1. A receive waits; the attacker sees its descriptor and writes a
        # receipt at its completion key: garbage, a receipt in the format,
        # and the sealed descriptor moved there.
        (buf,) = xh.receive(c1, dst, [s], [src_id], [41])
        descs = th.poll_until(lambda: {k: v for k, v in etcd_values(etcd, "crosshost/desc/").items()}, 10)
        assert descs, "the receiver's descriptor is in etcd"
        (desc_key, desc_value), = descs.items()
        assert desc_value.startswith(b"xsv1") and b"PXHD" not in desc_value
        recv_key = desc_key.replace("crosshost/desc/", "crosshost/recv/", 1)
        for value in (b"\x00garbage", b"xr1 ok 0000000000000000", desc_value):
            before = forged(c1)
            etcd_put(etcd, recv_key, value)
            assert th.poll_until(lambda: forged(c1) > before, 10), "the forged receipt was not seen"
        assert not buf.ready_event().is_ready(), "a forged receipt completed the receive"

        # 2. A sender waits for the descriptor of transfer 42; the attacker
        # writes one there first, pointing at its own listener: the sealed
        # descriptor of transfer 41 moved there, and one altered.
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.setblocking(False)
        dev0 = c0.addressable_devices()[0]
        data42 = th.make_data(s, 42)
        (ev42,) = xh.send(c0, [th.upload(c0, dev0, s, data42)], [dst_id], [42])
        desc42 = desc_key.replace("/41/0", "/42/0")
        assert desc42 != desc_key, desc_key
        for value in (desc_value, desc_value[:-1] + bytes([desc_value[-1] ^ 1])):
            before = forged(c0)
            etcd_put(etcd, desc42, value)
            assert th.poll_until(lambda: forged(c0) > before, 10), "the forged descriptor was not seen"
        assert not ev42.is_ready(), "a forged descriptor started the send"
        # The real receive of 42 overwrites it; then transfer 41 is sent.
        (buf42,) = xh.receive(c1, dst, [s], [src_id], [42])
        (ev,) = xh.send(c0, [th.upload(c0, dev0, s, data)], [dst_id], [41])
        for e, b, d, name in ((ev42, buf42, data42, "42"), (ev, buf, data, "41")):
            th.expect_ok(th.wait_event(e, timeout=30), f"send {name}")
            th.expect_ok(th.buffer_status(b, timeout=30), f"receive {name}")
            th.assert_same_bytes(th.read_back(b, s), d, f"received bytes of {name}")
        with pytest.raises(BlockingIOError):
            listener.accept()
        listener.close()
        m0, m1 = th.metrics(c0), th.metrics(c1)
        assert m1["forged_values_rejected"] >= 3 and m0["forged_values_rejected"] >= 1, (m0, m1)
        assert m1["stale_receipts_rejected"] == 0, m1

        # 3. The job goes on: more transfers, the right bytes.
        for i in range(5):
            d = th.make_data(s, 100 + i)
            (b,) = xh.receive(c1, dst, [s], [src_id], [100 + i])
            (e,) = xh.send(c0, [th.upload(c0, c0.addressable_devices()[0], s, d)], [dst_id], [100 + i])
            th.expect_ok(th.wait_event(e), f"send {i}")
            th.expect_ok(th.buffer_status(b), f"receive {i}")
            th.assert_same_bytes(th.read_back(b, s), d, f"transfer {i}")
    finally:
        c1.destroy()
        c0.destroy()


def test_without_a_job_secret_the_store_holds_values_in_clear(api, xh, etcd):
    """What the secret changes: the same job unsealed shows its session entries."""
    c0, c1 = make_job(api, etcd, None)
    try:
        stored = etcd_values(etcd)
        assert any(v.startswith(b"xs5") for v in stored.values()), stored
        assert forged(c0) == 0
    finally:
        c1.destroy()
        c0.destroy()


def test_a_process_with_another_secret_cannot_join_the_job(api, etcd, tmp_path):
    secrets = (write_secret(tmp_path / "a"), write_secret(tmp_path / "b"))
    with pytest.raises(pc.PjrtError) as e:
        make_job(api, etcd, secrets, session_timeout_ms=3000)
    assert e.value.code == EC.DEADLINE_EXCEEDED, e.value
    assert "sealed with this job's secret" in e.value.message, e.value.message


@pytest.mark.parametrize("content", [b"", b"short secret", None])
def test_a_bad_secret_file_fails_creation_naming_it_and_never_its_content(api, tmp_path, content):
    path = tmp_path / "secret"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(pc.PjrtError) as e:
        api.create_client({"job_secret_file": str(path)})
    assert e.value.code == EC.INVALID_ARGUMENT, e.value
    assert str(path) in e.value.message and "job_secret_file" in e.value.message
    if content:
        assert content.decode() not in e.value.message


def redirected(d: bytes, *, pid: int | None = None, allocation: bytes | None = None) -> bytes:
    """A real descriptor (clear, version 1) rewritten by someone who can
    write the store: another pid and/or another allocation handle (a TCP
    "ip:port" or a shared-memory name), with a valid length and checksum.
    Layout: magic, version, kind, flags, total length (12 bytes), hostname,
    boot id (u16 length + bytes each), pid (u32), allocation (u16 length +
    bytes), the rest, CRC-32."""
    body = bytearray(d[:-4])
    at = 12
    for _ in range(2):
        at += 2 + int.from_bytes(body[at:at + 2], "little")
    if pid is not None:
        body[at:at + 4] = pid.to_bytes(4, "little")
    at += 4
    size = int.from_bytes(body[at:at + 2], "little")
    if allocation is not None:
        body[at:at + 2 + size] = len(allocation).to_bytes(2, "little") + allocation
    body[8:12] = (len(body) + 4).to_bytes(4, "little")
    return bytes(body) + zlib.crc32(bytes(body)).to_bytes(4, "little")


def allocation_of(d: bytes) -> bytes:
    at = 12
    for _ in range(2):
        at += 2 + int.from_bytes(d[at:at + 2], "little")
    at += 4
    return d[at + 2:at + 2 + int.from_bytes(d[at:at + 2], "little")]


@pytest.mark.parametrize("forgery", ["pid", "shm-owner", "tcp-port"])
def test_without_a_secret_a_sender_refuses_a_descriptor_of_another_process(api, xh, etcd, forgery):
    """Without job_secret_file the store is open, but a descriptor must
    still name a destination of the process that owns the device: its
    host and pid, its shared memory, its TCP receive server (the address
    and port its session entry states, not another listener at the same
    address)."""
    c0, c1 = make_job(api, etcd, None, "auto" if forgery == "shm-owner" else "tcp",
                      advertise_address="127.0.0.1")
    thief = socket.socket()
    thief.bind(("127.0.0.1", 0))
    thief.listen(4)
    thief.setblocking(False)
    try:
        s = th.spec(BT.U8, 4096)
        src_id, dst_id = th.device_ids(c1, 0)[0], th.device_ids(c0, 1)[0]
        dst, dev0 = c1.addressable_devices()[0], c0.addressable_devices()[0]
        # A genuine descriptor (of transfer 51) to forge from.
        (buf51,) = xh.receive(c1, dst, [s], [src_id], [51])
        descs = th.poll_until(lambda: etcd_values(etcd, "crosshost/desc/"), 10)
        assert len(descs) == 1, (
            f"descriptors in etcd: {list(descs)}; the receive "
            + (f"failed: {th.buffer_status(buf51, 1)}" if th.is_buffer_ready(buf51) else "is pending")
            + f"; receiver metrics {th.metrics(c1)}; all keys {list(etcd_values(etcd))}"
        )
        (desc_key, genuine), = descs.items()
        assert genuine.startswith(b"PXHD"), genuine[:8]
        if forgery == "pid":
            fake = redirected(genuine, pid=1)
        elif forgery == "tcp-port":
            ip, _port = allocation_of(genuine).decode().rsplit(":", 1)
            assert ip == "127.0.0.1", ip
            fake = redirected(genuine, allocation=f"{ip}:{thief.getsockname()[1]}".encode())
        else:
            name = allocation_of(genuine).decode()
            fields = name.split("-")  # /crosshost-<ns>-<pid>-<start>-<hex>
            fields[2] = "1"
            fake = redirected(genuine, allocation="-".join(fields).encode())
        (ev52,) = xh.send(c0, [th.upload(c0, dev0, s, th.make_data(s, 52))], [dst_id], [52])
        etcd_put(etcd, desc_key.replace("/51/0", "/52/0"), fake)
        err = th.wait_event(ev52, timeout=30)
        assert err is not None and err.code == EC.PERMISSION_DENIED, err
        assert "job_secret_file" in err.message and "process 1" in err.message, err.message
        with pytest.raises(BlockingIOError):
            thief.accept()  # nobody connected to the forged endpoint
        # The job goes on: transfer 51 arrives whole.
        data = th.make_data(s, 51)
        (ev51,) = xh.send(c0, [th.upload(c0, dev0, s, data)], [dst_id], [51])
        th.expect_ok(th.wait_event(ev51, timeout=30), "send 51")
        th.expect_ok(th.buffer_status(buf51, timeout=30), "receive 51")
        th.assert_same_bytes(th.read_back(buf51, s), data, "received bytes")
    finally:
        thief.close()
        c1.destroy()
        c0.destroy()
