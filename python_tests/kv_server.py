"""A small key-value server owned by a test, and its client.

The two-process transfer tests (test_transfers_processes.py) give each
process's PJRT KV callbacks a :class:`KvClient` talking to one
:class:`KvServer` that runs on a thread of the pytest process, so the store
outlives any child that is killed.

Wire format (localhost TCP, one request per round trip, any number of
requests per connection):

  request:  op (1 byte) | key length u32 | key | value length u32 | value | timeout_ms i32
  response: status (1 byte: 0 ok, 1 not found / timed out, 2 refused,
            3 failed on purpose) | length u32 | payload

ops: P put, G get (blocks up to timeout_ms), T try_get, D delete, K keys
(payload: keys joined by "\\n", value = prefix filter).

``KvServer.fail_ops`` (a set of op letters) makes those ops fail with
status 3, to simulate a store that errors (e.g. deletes that fail).
"""

from __future__ import annotations

import socket
import socketserver
import struct
import threading
import time

OK, MISSING, REFUSED, FAILED = 0, 1, 2, 3


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("peer closed")
        out += chunk
    return bytes(out)


class KvServer:
    """In-memory store with blocking gets, served on ``host``:``port``
    (default 127.0.0.1 and a free port)."""

    def __init__(self, allow_overwrite: bool = True, host: str = "127.0.0.1", port: int = 0):
        self.allow_overwrite = allow_overwrite
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.ops = {"P": 0, "G": 0, "T": 0, "D": 0, "K": 0}
        self.fail_ops: set[str] = set()
        self.failed = {}
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                sock = self.request
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    while True:
                        op = sock.recv(1)
                        if not op:
                            return
                        (klen,) = struct.unpack("<I", _recv_exact(sock, 4))
                        key = _recv_exact(sock, klen).decode()
                        (vlen,) = struct.unpack("<I", _recv_exact(sock, 4))
                        value = _recv_exact(sock, vlen)
                        (timeout_ms,) = struct.unpack("<i", _recv_exact(sock, 4))
                        status, payload = server._apply(op.decode(), key, value, timeout_ms)
                        sock.sendall(struct.pack("<BI", status, len(payload)) + payload)
                except (ConnectionError, OSError):
                    return

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            # socketserver's default backlog is 5: a job of hundreds of
            # processes connecting at once had SYNs dropped and retried for
            # a minute (the kernel caps it at somaxconn).
            request_queue_size = 4096

        self._server = Server((host, port), Handler)
        self.address = self._server.server_address
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _apply(self, op: str, key: str, value: bytes, timeout_ms: int):
        with self.cond:
            self.ops[op] = self.ops.get(op, 0) + 1
            if op in self.fail_ops:
                self.failed[op] = self.failed.get(op, 0) + 1
                return FAILED, f"store op {op} on {key} failed (test-injected)".encode()
            if op == "P":
                if not self.allow_overwrite and key in self.data:
                    return REFUSED, f"key {key} exists".encode()
                self.data[key] = value
                self.cond.notify_all()
                return OK, b""
            if op == "T":
                return (OK, self.data[key]) if key in self.data else (MISSING, b"")
            if op == "G":
                deadline = time.monotonic() + max(0, timeout_ms) / 1000.0
                while key not in self.data:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return MISSING, b""
                    self.cond.wait(left)
                return OK, self.data[key]
            if op == "D":
                self.data.pop(key, None)
                return OK, b""
            if op == "K":
                prefix = value.decode()
                return OK, "\n".join(k for k in sorted(self.data) if k.startswith(prefix)).encode()
        return REFUSED, b"unknown op"

    def keys(self, prefix: str = "") -> list[str]:
        with self.cond:
            return sorted(k for k in self.data if k.startswith(prefix))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class KvStoreError(RuntimeError):
    """The server failed the operation on purpose (KvServer.fail_ops)."""


class KvClient:
    """Thread-safe client: a pool of connections, one per call in flight.

    Not one per calling thread: the plugin calls its KV callbacks from its
    own threads, and ctypes gives each such call a Python thread state of
    its own, so a thread-local connection was a new connection per call,
    kept until the client closed. In a 300-process job process 0 held about
    two per peer that way (600 of its 652 fds), which said nothing about the
    plugin."""

    def __init__(self, address):
        self.address = tuple(address)
        self._idle: list[socket.socket] = []
        self._all = []
        self._lock = threading.Lock()

    def _take(self) -> socket.socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        s = socket.create_connection(self.address, timeout=10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._all.append(s)
        return s

    def _call(self, op: str, key: str, value: bytes = b"", timeout_ms: int = 0):
        k = key.encode()
        msg = op.encode() + struct.pack("<I", len(k)) + k + struct.pack("<I", len(value))
        msg += value + struct.pack("<i", int(min(timeout_ms, 2**31 - 1)))
        s = self._take()
        s.settimeout(max(0, timeout_ms) / 1000.0 + 10)
        try:
            s.sendall(msg)
            status, n = struct.unpack("<BI", _recv_exact(s, 5))
            payload = _recv_exact(s, n)
        except BaseException:
            # Mid-message: the connection cannot be used again.
            with self._lock:
                if s in self._all:
                    self._all.remove(s)
            try:
                s.close()
            except OSError:
                pass
            raise
        with self._lock:
            self._idle.append(s)
        if status == FAILED:
            raise KvStoreError(payload.decode())
        return status, payload

    def put(self, key: str, value: bytes) -> str | None:
        """None on success, else the refusal message."""
        status, payload = self._call("P", key, value)
        return None if status == OK else payload.decode() or "refused"

    def get(self, key: str, timeout_ms: int) -> bytes | None:
        status, payload = self._call("G", key, b"", timeout_ms)
        return payload if status == OK else None

    def try_get(self, key: str) -> bytes | None:
        status, payload = self._call("T", key)
        return payload if status == OK else None

    def delete(self, key: str) -> None:
        self._call("D", key)

    def keys(self, prefix: str = "") -> list[str]:
        _, payload = self._call("K", "", prefix.encode())
        return [k for k in payload.decode().split("\n") if k]

    def close(self) -> None:
        with self._lock:
            for s in self._all:
                try:
                    s.close()
                except OSError:
                    pass
            self._all.clear()
            self._idle.clear()
