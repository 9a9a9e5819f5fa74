"""Helpers for the cross-host transfer tests (test_transfers_*.py).

Everything here drives the plugin through its C ABI with ctypes:

* :class:`Transfers` finds ``PJRT_CrossHostTransfers_Extension`` on the
  ``PJRT_Api.extension_start`` chain and wraps its four entries (v2
  receive/send, v1 make-receive / copy-to-remote, v1 cancel notifier);
* :func:`make_pair` creates a two-node job inside one process (two clients,
  ``kv_store=memory:<unique>``, created concurrently because creation of a
  multi-node client blocks until every node joined);
* :class:`PjrtKvCallbacks` implements the PJRT KV callbacks (get / try_get /
  put, plus the plugin's delete extension) over a :class:`kv_server.KvClient`
  so that two *processes* share one store owned by the test;
* :func:`metrics` reads ``pjrt_crosshost_metrics_json``;
* :func:`device_ids` / :func:`expected_pair_ids` give the global device ids
  of a job, so the tests hold whichever numbering the plugin's mode uses.

Every wait is bounded: helpers take a timeout and raise ``TimeoutError``.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
import uuid
from ctypes import POINTER, c_int, c_int64, c_size_t, c_void_p
from dataclasses import dataclass

import numpy as np

import pjrt_ctypes as pc
from kv_server import KvStoreError

WAIT = 20.0  # default bound (s) for any single wait in these tests

XH = pc.PJRT_CrossHostTransfers_Extension
RECV_ARGS = pc.PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers_Args
SEND_ARGS = pc.PJRT_Transfers_PJRT_Client_CrossHostSendBuffers_Args
MAKE_ARGS = pc.PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers_Args
COPY_ARGS = pc.PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice_Args

RECV_SIZE_V6 = 96  # what JAX 0.10.2 sends (through `buffers`)
SEND_SIZE_V6 = 64  # through `send_events`

# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


@dataclass
class Spec:
    """One buffer: PJRT element type and dims."""

    type: pc.BufferType
    dims: tuple

    @property
    def host_dtype(self) -> np.dtype:
        return pc.HOST_DTYPE[self.type]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64)) * self.host_dtype.itemsize


def spec(type_, *dims) -> Spec:
    return Spec(pc.BufferType(type_), tuple(dims))


def make_data(s: Spec, seed: int) -> np.ndarray:
    """Deterministic, non-trivial contents (every byte pattern varies)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(s.dims, dtype=np.int64))
    dt = s.host_dtype
    if dt == np.bool_:
        arr = rng.integers(0, 2, size=n).astype(np.bool_)
    else:
        raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
        arr = raw.view(dt) if n else np.zeros(0, dtype=dt)
    # Random bits may be NaN for floats: checks compare bytes, not values.
    # (.copy(), not ascontiguousarray, which turns a 0-d scalar into 1-d.)
    return arr.reshape(s.dims).copy()


def assert_same_bytes(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    g = np.frombuffer(got.tobytes(), dtype=np.uint8)
    w = np.frombuffer(want.tobytes(), dtype=np.uint8)
    if not np.array_equal(g, w):
        bad = np.flatnonzero(g != w)
        raise AssertionError(
            f"{what}: {bad.size} of {w.size} bytes differ, first at byte {bad[0]} "
            f"(got {g[bad[0]]:#04x}, want {w[bad[0]]:#04x})"
        )


def upload(client: pc.Client, device: pc.Device, s: Spec, data: np.ndarray) -> pc.Buffer:
    buf = client.buffer_from_host(data, type=s.type, device=device)
    status = wait_event(buf.ready_event(), WAIT, destroy=True)
    assert status is None, f"upload not ready: {status}"
    return buf


def read_back(buf: pc.Buffer, s: Spec) -> np.ndarray:
    return buf.to_numpy(s.host_dtype, s.dims)


# --------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------


def wait_event(ev: pc.Event, timeout: float = WAIT, destroy: bool = False):
    """Status of ``ev`` (None = OK) once ready; TimeoutError if not in time."""
    status = ev.wait_ready(timeout)  # raises TimeoutError; leaves ev alive then
    if destroy:
        ev.destroy()
    return status


def buffer_status(buf: pc.Buffer, timeout: float = WAIT):
    """Waits for a buffer's ready event; returns None (OK) or a PjrtError."""
    return wait_event(buf.ready_event(), timeout, destroy=True)


def is_buffer_ready(buf: pc.Buffer) -> bool:
    ev = buf.ready_event()
    try:
        return ev.is_ready()
    finally:
        ev.destroy()


def expect_ok(status, what: str = "") -> None:
    assert status is None, f"{what}: expected OK, got {status}"


def expect_code(status, code: pc.ErrorCode, what: str = "") -> None:
    assert status is not None, f"{what}: expected {code.name}, got OK"
    assert status.code == code, f"{what}: expected {code.name}, got {status}"


# --------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------

_DECLARED = set()


def metrics(client: pc.Client) -> dict:
    lib = client.api.lib
    if id(lib) not in _DECLARED:
        pc.declare_crosshost_exports(lib)
        _DECLARED.add(id(lib))
    p = lib.pjrt_crosshost_metrics_json(client.handle)
    assert p, "pjrt_crosshost_metrics_json returned NULL for a live client"
    try:
        return json.loads(ctypes.string_at(p).decode())
    finally:
        lib.pjrt_crosshost_free_string(p)


def poll_until(pred, timeout: float = 5.0, interval: float = 0.005):
    """Polls ``pred()`` until truthy or the deadline; returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval)


def wait_keys_retired(*clients, timeout: float = 5.0) -> list:
    """Polls until keys_outstanding == 0 on every client; returns the metrics."""
    snaps = poll_until(
        lambda: (lambda ms: ms if all(m["keys_outstanding"] == 0 for m in ms) else None)(
            [metrics(c) for c in clients]
        ),
        timeout,
    )
    if snaps is None:
        snaps = [metrics(c) for c in clients]
        raise AssertionError(f"keys still outstanding after {timeout}s: {snaps}")
    return snaps


# --------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------


def unique(prefix: str = "t") -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]}"


def create_concurrently(makers, timeout: float = 30.0) -> list:
    """Runs the zero-arg ``makers`` on threads at once (multi-node creation
    blocks until every node joined); returns their results in order or
    raises the first failure. Clients created by others are destroyed on
    failure."""
    results = [None] * len(makers)
    errors = [None] * len(makers)

    def run(i):
        try:
            results[i] = makers[i]()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(makers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"client creation still blocked after {timeout}s")
    bad = [e for e in errors if e is not None]
    if bad:
        for r in results:
            if r is not None:
                r.destroy()
        raise bad[0]
    return results


def device_ids(client: pc.Client, process_index: int) -> list:
    """The global ids of process ``process_index``'s devices, in the order of
    ``client.devices()`` (any client of the job sees every device).

    The tests name devices by these ids instead of literals because the
    numbering depends on the plugin's mode (see :func:`expected_pair_ids`)."""
    ids = [d.id() for d in client.devices() if d.process_index() == process_index]
    assert ids, f"no device of process {process_index} in {[d.id() for d in client.devices()]}"
    return ids


def expected_pair_ids() -> list:
    """The exact global device ids of a two-process job with two devices per
    process, in ``client.devices()`` order.

    The embedded host backend numbers devices in process order (process 0
    has 0,1, process 1 has 2,3). With PJRT_CROSSHOST_COMPUTE_PLUGIN set
    (read when the library is loaded; peer processes inherit it) the plugin
    delegates to an XLA CPU plugin, which numbers the devices of a
    multi-process job ``2048 * process_index + i``."""
    if os.environ.get("PJRT_CROSSHOST_COMPUTE_PLUGIN"):
        return [0, 1, 2048, 2049]
    return [0, 1, 2, 3]


def make_pair(api: pc.Api, transport: str | None = None, num_devices=(2, 2), **extra):
    """Two clients of one 2-node job in this process (node 0 and node 1)."""
    store = "memory:" + unique("store")
    session = unique("sess")

    def opts(node):
        o = {
            "num_devices": num_devices[node],
            "node_id": node,
            "num_nodes": 2,
            "session": session,
            "kv_store": store,
            "session_timeout_ms": 20000,
        }
        if transport:
            o["transport"] = transport
        o.update(extra)
        return o

    return create_concurrently([lambda n=n: api.create_client(opts(n)) for n in (0, 1)])


# --------------------------------------------------------------------------
# The extension
# --------------------------------------------------------------------------


def _keep(*objs):
    return list(objs)


def _shape_arrays(specs):
    n = len(specs)
    ranks = (c_size_t * max(1, n))(*[len(s.dims) for s in specs])
    dim_arrays = [(c_int64 * max(1, len(s.dims)))(*s.dims) for s in specs]
    dims = (POINTER(c_int64) * max(1, n))(
        *[ctypes.cast(d, POINTER(c_int64)) for d in dim_arrays]
    )
    types = (c_int * max(1, n))(*[int(s.type) for s in specs])
    return ranks, dims, types, dim_arrays


def _set_tasks(a, tasks):
    """Fills the v8 alive-tasks snapshot of a send/receive args struct.
    ``tasks`` may be a dict, or ("null", n) to pass n with NULL arrays."""
    if not tasks:
        return None
    if isinstance(tasks, tuple) and tasks[0] == "null":
        a.num_tasks = tasks[1]
        return None
    ids = (c_int * len(tasks))(*tasks.keys())
    inc = (c_int64 * len(tasks))(*tasks.values())
    a.num_tasks = len(tasks)
    a.task_ids = ids
    a.incarnation_ids = inc
    return ids, inc


class Transfers:
    """The plugin's PJRT_CrossHostTransfers_Extension."""

    def __init__(self, api: pc.Api):
        self.api = api
        found = [e for e in api.extensions() if e[0] == pc.ExtensionType.CrossHostTransfers]
        assert found, "no CrossHostTransfers extension on PJRT_Api.extension_start"
        self.ext = XH.from_address(found[0][2])
        self._recv = pc.XH_ERR_ENTRY(self.ext.PJRT_Transfers_PJRT_Client_CrossHostReceiveBuffers)
        self._send = pc.XH_ERR_ENTRY(self.ext.PJRT_Transfers_PJRT_Client_CrossHostSendBuffers)
        self._make = pc.XH_ERR_ENTRY(
            self.ext.PJRT_Transfers_PJRT_Client_MakeCrossHostReceiveBuffers
        )
        self._copy = pc.XH_VOID_ENTRY(self.ext.PJRT_Transfers_PJRT_Buffer_CopyToRemoteDevice)

    def _check(self, name, err):
        if err:
            raise self.api.to_exception(name, err)

    # ---- v2 ---------------------------------------------------------------
    def receive(
        self,
        client: pc.Client,
        device: pc.Device,
        specs: list,
        src_ids: list,
        keys: list,
        struct_size: int | None = None,
        num_shapes: int | None = None,
        tasks: dict | None = None,
    ) -> list:
        """v2 receive. ``tasks``: {task id: incarnation} snapshot (v8)."""
        n = len(specs)
        ranks, dims, types, keep = _shape_arrays(specs)
        src = (ctypes.c_int32 * max(1, n))(*src_ids)
        k = (c_int64 * max(1, n))(*keys)
        out = (c_void_p * max(1, n))()
        a = RECV_ARGS.new(
            client=client.handle,
            num_shapes=n if num_shapes is None else num_shapes,
            shape_num_dims=ranks,
            num_dims=dims,
            element_types=types,
            layouts=None,
            device=device.handle,
            src_global_device_ids=src,
            transfer_keys=k,
            buffers=out,
        )
        tkeep = _set_tasks(a, tasks)
        if struct_size is not None:
            a.struct_size = struct_size
        self._check(
            "CrossHostReceiveBuffers", self._recv(ctypes.addressof(a))
        )
        del tkeep
        del keep
        bufs = []
        for i in range(n):
            assert out[i], f"CrossHostReceiveBuffers: buffers[{i}] is NULL after OK"
            bufs.append(client.own(pc.Buffer(client, out[i])))
        return bufs

    def send(
        self,
        client: pc.Client,
        buffers: list,
        dst_ids: list,
        keys: list,
        struct_size: int | None = None,
        tasks: dict | None = None,
    ) -> list:
        """v2 send. ``tasks``: {task id: incarnation} snapshot (v8)."""
        n = len(buffers)
        bufs = (c_void_p * max(1, n))(*[b.handle for b in buffers])
        dst = (ctypes.c_int32 * max(1, n))(*dst_ids)
        k = (c_int64 * max(1, n))(*keys)
        out = (c_void_p * max(1, n))()
        a = SEND_ARGS.new(
            client=client.handle,
            num_buffers=n,
            buffers=bufs,
            dst_global_device_ids=dst,
            transfer_keys=k,
            send_events=out,
        )
        tkeep = _set_tasks(a, tasks)
        if struct_size is not None:
            a.struct_size = struct_size
        self._check("CrossHostSendBuffers", self._send(ctypes.addressof(a)))
        del tkeep
        evs = []
        for i in range(n):
            assert out[i], f"CrossHostSendBuffers: send_events[{i}] is NULL after OK"
            evs.append(client.own(pc.Event(client.api, out[i])))
        return evs

    # ---- v1 ---------------------------------------------------------------
    def make_receive(
        self,
        client: pc.Client,
        device: pc.Device,
        specs: list,
        allow_cancel: bool = True,
        struct_size: int | None = None,
    ) -> "V1Receive":
        return V1Receive(self, client, device, specs, allow_cancel, struct_size)

    def copy_to_remote(
        self,
        buffer: pc.Buffer,
        descriptor: bytes | None,
        event: pc.Event | None = None,
        with_destructor: bool = True,
    ) -> "RemoteSend":
        """CopyToRemoteDevice. With ``event`` (from PJRT_Event_Create), the
        descriptor is written later by :meth:`RemoteSend.provide` which then
        sets the event; without it, ``descriptor`` is readable at once.
        ``with_destructor=False`` passes a v6-sized struct whose
        descriptor_destructor is NULL (the caller keeps its pointers)."""
        return RemoteSend(self, buffer, descriptor, event, with_destructor)


_LIVE = {}  # id -> object kept alive while C may still call into it


class Once:
    """Records every call of a C callback; wait() bounds the wait."""

    def __init__(self):
        self.calls = []
        self._ev = threading.Event()
        self._lock = threading.Lock()

    def record(self, item):
        with self._lock:
            self.calls.append(item)
        self._ev.set()

    def wait(self, timeout: float = WAIT):
        if not self._ev.wait(timeout):
            raise TimeoutError(f"callback not called within {timeout}s")
        return self.calls[0]

    def count(self) -> int:
        with self._lock:
            return len(self.calls)


class V1Receive:
    """MakeCrossHostReceiveBuffers; copies the descriptors inside the notifier."""

    def __init__(self, xh: Transfers, client, device, specs, allow_cancel, struct_size):
        self.xh = xh
        self.api = xh.api
        self.client = client
        self.specs = specs
        self.notified = Once()
        self.descriptors: list[bytes] = []
        self.cancel_fn = None
        self.cancel_arg = None
        self.notifier_error = None
        n = len(specs)
        ranks, dims, types, keep = _shape_arrays(specs)
        out = (c_void_p * max(1, n))()

        def notifier(err, descs, sizes, count, user_arg, cancel, cancel_arg):
            try:
                if err:
                    self.notifier_error = self.api.to_exception("notifier", err)
                else:
                    self.descriptors = [ctypes.string_at(descs[i], sizes[i]) for i in range(count)]
                self.cancel_fn = cancel
                self.cancel_arg = cancel_arg
            finally:
                self.notified.record((err, count))

        self._notifier = pc.PJRT_Transfers_CrossHostRecvNotifier(notifier)
        a = MAKE_ARGS.new(
            client=client.handle,
            num_shapes=n,
            shape_num_dims=ranks,
            num_dims=dims,
            element_types=types,
            layouts=None,
            device=device.handle,
            buffers=out,
            allow_cancel_notifier=allow_cancel,
        )
        a.notifier.user_arg = None
        a.notifier.notifier = ctypes.cast(self._notifier, c_void_p)
        if struct_size is not None:
            a.struct_size = struct_size
        err = xh._make(ctypes.addressof(a))
        del keep
        if err:
            raise self.api.to_exception("MakeCrossHostReceiveBuffers", err)
        self.num_buffers = a.num_buffers
        self.buffers = [client.own(pc.Buffer(client, out[i])) for i in range(n) if out[i]]
        _LIVE[id(self)] = self

    def cancel(self, descriptor: bytes, code=pc.ErrorCode.CANCELLED, message="cancelled by test"):
        """Calls the cancel notifier; returns a :class:`Once` for on_canceled
        whose first call is the PjrtError or None."""
        assert self.cancel_fn, "no cancel notifier (allow_cancel_notifier false?)"
        fn = pc.PJRT_Transfers_CrossHostRecvCancelNotifier(self.cancel_fn)
        done = Once()

        def on_canceled(err, _user):
            done.record(self.api.to_exception("on_canceled", err) if err else None)

        cb = pc.PJRT_Transfers_CrossHostOnCanceledCallback(on_canceled)
        _LIVE[id(done)] = (done, cb)
        d = ctypes.create_string_buffer(descriptor, max(1, len(descriptor)))
        m = message.encode()
        mb = ctypes.create_string_buffer(m, len(m) + 1)
        fn(
            ctypes.addressof(d),
            len(descriptor),
            int(code),
            ctypes.addressof(mb),
            len(m),
            cb,
            None,
            self.cancel_arg,
        )
        return done


class RemoteSend:
    """One CopyToRemoteDevice call; the descriptor cells live here."""

    def __init__(self, xh: Transfers, buffer: pc.Buffer, descriptor, event, with_destructor=True):
        self.api = xh.api
        self.done = Once()
        self.destructed = Once()
        self._data = None
        self.desc_ptr = c_void_p(0)
        self.desc_size = c_size_t(0)
        self.event = event
        if descriptor is not None:
            self._fill(descriptor)

        def on_done(err, enqueued, _user):
            self.done.record(
                (self.api.to_exception("on_done", err) if err else None, bool(enqueued))
            )

        def destructor(pdata, psize):
            self.destructed.record((pdata, psize))

        self._on_done = pc.PJRT_Transfers_CrossHostOnDone(on_done)
        self._destructor = pc.PJRT_Transfers_DescriptorDestructor(destructor)
        a = COPY_ARGS.new(
            buffer=buffer.handle,
            event=event.handle if event is not None else None,
            serialized_descriptor=ctypes.addressof(self.desc_ptr),
            serialized_descriptor_size=ctypes.addressof(self.desc_size),
            descriptor_destructor=(
                ctypes.cast(self._destructor, c_void_p) if with_destructor else None
            ),
        )
        a.on_done.user_arg = None
        a.on_done.on_done = ctypes.cast(self._on_done, c_void_p)
        self._args = a
        _LIVE[id(self)] = self
        xh._copy(ctypes.addressof(a))

    def _fill(self, descriptor: bytes):
        self._data = ctypes.create_string_buffer(descriptor, max(1, len(descriptor)))
        self.desc_ptr.value = ctypes.addressof(self._data)
        self.desc_size.value = len(descriptor)

    def provide(self, descriptor: bytes | None, code=pc.ErrorCode.OK, message=""):
        """Writes the descriptor, then PJRT_Event_Set (what JAX does)."""
        if descriptor is not None:
            self._fill(descriptor)
        self.event.set(code, message)

    def wait(self, timeout: float = WAIT):
        """(error or None, sends_were_enqueued) of the single on_done call."""
        return self.done.wait(timeout)


# --------------------------------------------------------------------------
# PJRT KV callbacks over a kv_server.KvClient
# --------------------------------------------------------------------------


class ForeignErrorPointer(Exception):
    """Raised by a store operation under PjrtKvCallbacks: the callback then
    returns ``pointer`` as its error, one the plugin's callback_error never
    made."""

    def __init__(self, pointer: int):
        super().__init__(hex(pointer))
        self.pointer = pointer


class RaiseThroughCtypes(BaseException):
    """Raised by a store operation under PjrtKvCallbacks: escapes the
    callback, so ctypes returns an undefined pointer (what a user's own
    callback that raises does)."""


class PjrtKvCallbacks:
    """get / try_get / put callbacks for PJRT_Client_Create_Args and the
    plugin's KV delete extension, all forwarding to ``kv`` (a KvClient).

    Returned values are ctypes buffers kept alive in ``self._values`` until
    the plugin calls the value deleter. Errors are made with the plugin's
    ``(*args.callback_error)(code, msg, size)``.
    """

    def __init__(self, kv, with_delete: bool = True):
        self.kv = kv
        self._values = {}
        self._lock = threading.Lock()
        self.counts = {"get": 0, "try_get": 0, "put": 0, "delete": 0, "deleter": 0}
        self.errors = []  # exceptions raised inside callbacks (should stay empty)
        self.injected = []  # store failures injected by the test (KvStoreError)

        def deleter(ptr):
            with self._lock:
                self.counts["deleter"] += 1
                self._values.pop(ptr, None)

        self._deleter = pc.PJRT_KeyValue_ValueDeleter(deleter)
        self._deleter_addr = ctypes.cast(self._deleter, c_void_p).value

        def fail(args, code, msg):
            fnptr = c_void_p.from_address(args.callback_error).value
            make = pc.PJRT_CallbackError(fnptr)
            m = msg.encode()
            mb = ctypes.create_string_buffer(m, len(m) + 1)
            return make(int(code), ctypes.addressof(mb), len(m))

        def give(args, value: bytes):
            buf = ctypes.create_string_buffer(value, max(1, len(value)))
            addr = ctypes.addressof(buf)
            with self._lock:
                self._values[addr] = buf
            args.value = addr
            args.value_size = len(value)
            args.value_deleter_callback = self._deleter_addr
            return None

        def key_of(args):
            return ctypes.string_at(args.key, args.key_size).decode()

        def guard(name, body):
            def cb(p):
                args = p.contents
                try:
                    with self._lock:
                        self.counts[name] += 1
                    return body(args)
                except ForeignErrorPointer as e:  # injected: not our error
                    return e.pointer
                except KvStoreError as e:  # injected by the test: a store error
                    with self._lock:
                        self.injected.append((name, str(e)))
                    return fail(args, pc.ErrorCode.UNAVAILABLE, str(e))
                except Exception as e:  # noqa: BLE001 - becomes a PJRT error
                    self.errors.append((name, repr(e)))
                    return fail(args, pc.ErrorCode.INTERNAL, f"{name} callback raised {e!r}")

            return cb

        def get(args):
            r = self.kv.get(key_of(args), max(0, args.timeout_in_ms))
            if r is None:
                return fail(
                    args,
                    pc.ErrorCode.DEADLINE_EXCEEDED,
                    f"key {key_of(args)} not set within {args.timeout_in_ms} ms",
                )
            return give(args, r)

        def try_get(args):
            r = self.kv.try_get(key_of(args))
            if r is None:
                return fail(args, pc.ErrorCode.NOT_FOUND, f"key {key_of(args)} not found")
            return give(args, r)

        def put(args):
            value = ctypes.string_at(args.value, args.value_size) if args.value_size else b""
            err = self.kv.put(key_of(args), value)
            if err:
                return fail(args, pc.ErrorCode.ALREADY_EXISTS, err)
            return None

        def delete(args):
            self.kv.delete(key_of(args))
            return None

        self._get = pc.PJRT_KeyValueGetCallback(guard("get", get))
        self._try_get = pc.PJRT_KeyValueTryGetCallback(guard("try_get", try_get))
        self._put = pc.PJRT_KeyValuePutCallback(guard("put", put))
        self._delete = pc.PJRT_CrossHost_KeyValueDeleteCallback(guard("delete", delete))
        self.delete_ext = None
        if with_delete:
            ext = pc.PJRT_CrossHost_KvDeleteExtension()
            ext.base.struct_size = pc.PJRT_CrossHost_KvDeleteExtension.STRUCT_SIZE
            ext.base.type = pc.EXTENSION_TYPE_KV_DELETE
            ext.base.next = None
            ext.kv_delete_callback = ctypes.cast(self._delete, c_void_p)
            ext.kv_delete_user_arg = None
            self.delete_ext = ext

    def outstanding_values(self) -> int:
        with self._lock:
            return len(self._values)

    def create_client(self, api: pc.Api, options: dict) -> pc.Client:
        arr, keep = pc.named_values(options)
        a = api.args(
            "PJRT_Client_Create",
            create_options=ctypes.cast(arr, POINTER(pc.PJRT_NamedValue)),
            num_options=len(options),
            kv_get_callback=ctypes.cast(self._get, c_void_p),
            kv_get_user_arg=None,
            kv_put_callback=ctypes.cast(self._put, c_void_p),
            kv_put_user_arg=None,
            kv_try_get_callback=ctypes.cast(self._try_get, c_void_p),
            kv_try_get_user_arg=None,
        )
        if self.delete_ext is not None:
            a.extension_start = ctypes.cast(
                ctypes.pointer(self.delete_ext.base), POINTER(pc.PJRT_Extension_Base)
            )
        api.call_args("PJRT_Client_Create", a)
        del keep
        assert a.client, "PJRT_Client_Create returned OK but client is NULL"
        return pc.Client(api, a.client)
