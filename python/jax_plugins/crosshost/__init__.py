"""JAX plugin registration for pjrt-crosshost (PJRT platform ``crosshost``).

JAX imports this module when it discovers plugins and calls ``initialize()``,
which registers the ``libpjrt_crosshost.so`` shipped next to this file. After
``pip install`` nothing else is needed: ``jax.devices("crosshost")`` works.

Environment (all optional, read when JAX initializes its backends):

``PJRT_CROSSHOST_CREATE_OPTIONS``
    PJRT_Client_Create options, as a JSON object (``{"num_devices": 4}``) or
    as ``key=value`` pairs separated by ``,`` or ``;``
    (``num_devices=4,receive_timeout_ms=60000``); values that read as
    integers are passed as int64, ``true``/``false`` as bools, the rest as
    strings. The plugin's options: num_devices, session, kv_store,
    transport (auto, tcp, ucx), advertise_address, tcp_bind, ucx_library,
    job_secret_file,
    receive_timeout_ms, send_timeout_ms, session_timeout_ms,
    kv_call_timeout_ms, etcd_lease_ttl_s, max_receive_bytes,
    max_pending_send_bytes, shm_pool_bytes.
    In a ``jax.distributed`` job the package adds ``coordinator_address``
    (JAX's coordinator): each process advertises the local address of its
    route to it, so processes on other hosts reach each other with no
    options.
    ``kv_store=etcd://host:port[,host:port...]`` keeps every key of the job
    in etcd instead of JAX's coordination service (docs/etcd.md).
    In a ``jax.distributed`` job JAX adds node_id and num_nodes itself.
``PJRT_CROSSHOST_JOB_SECRET_FILE``
    A file of at least 32 random bytes, the same for every process of the
    job (the create option ``job_secret_file``): every value the plugin
    puts in JAX's coordination service (or etcd) is then sealed with it, so
    whoever can reach that store can neither read a usable value nor forge
    a completion (docs/trust.md).
``PJRT_CROSSHOST_JAX_PRIORITY``
    Backend priority (default -100, below JAX's CPU backend at 0, so that
    installing the package never makes computations land on a backend that
    cannot compile). Select the plugin with ``JAX_PLATFORMS=crosshost`` (or
    ``crosshost,cpu``), which also makes it the default backend -- JAX's
    cross-process ``device_put`` uses the default backend's transfers.
``PJRT_CROSSHOST_JAX_LIBRARY``
    Use this library instead of the packaged one (development builds).
``PJRT_CROSSHOST_COMPUTE_PLUGIN``
    The PJRT plugin that compiles and runs programs on crosshost devices
    (crosshost moves the buffers between processes and hosts). Default: the
    XLA CPU plugin of ``fastatomstruct-xla-cpu`` when it is installed
    (``pip install pjrt-crosshost[cpu]``); set it to the empty string for no
    compute plugin (crosshost devices then only hold and move arrays).
``PJRT_CROSSHOST_JAX_KV_DELETE``
    ``0`` to keep the package from registering its KV delete (see
    ``_KvDelete``): then keys written to JAX's coordination service with
    ``kv_store=callbacks`` stay there for the life of the job.

Programs can also call ``initialize(options=..., priority=..., library=...)``
themselves before touching JAX's backends; later calls are no-ops.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Mapping

PLATFORM = "crosshost"
LIBRARY_NAME = "libpjrt_crosshost.so"
OPTIONS_ENV = "PJRT_CROSSHOST_CREATE_OPTIONS"
PRIORITY_ENV = "PJRT_CROSSHOST_JAX_PRIORITY"
LIBRARY_ENV = "PJRT_CROSSHOST_JAX_LIBRARY"
COMPUTE_ENV = "PJRT_CROSSHOST_COMPUTE_PLUGIN"
KV_DELETE_ENV = "PJRT_CROSSHOST_JAX_KV_DELETE"
JOB_SECRET_ENV = "PJRT_CROSSHOST_JOB_SECRET_FILE"
DEFAULT_PRIORITY = -100

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_registered_library: str | None = None
_compute_plugin: str | None = None


def packaged_library() -> Path:
    """The library installed with this package."""
    return Path(__file__).resolve().parent / LIBRARY_NAME


def library_path() -> Path:
    """The library ``initialize()`` registers (env override, else packaged)."""
    override = os.environ.get(LIBRARY_ENV)
    return Path(override) if override else packaged_library()


def default_compute_plugin() -> str | None:
    """The compute plugin used when none is configured: the XLA CPU plugin of
    ``fastatomstruct-xla-cpu`` (the ``[cpu]`` extra), if installed. It has no
    dependencies, so installing it never changes the user's JAX."""
    try:
        import fastatomstruct_xla_cpu
    except ImportError:
        return None
    try:
        return fastatomstruct_xla_cpu.library_path()
    except FileNotFoundError:
        return None


def compute_plugin_path() -> str | None:
    """The compute plugin ``initialize()`` configures: ``PJRT_CROSSHOST_COMPUTE_PLUGIN``
    if set (empty: none), else the default CPU plugin if installed."""
    if COMPUTE_ENV in os.environ:
        return os.environ[COMPUTE_ENV] or None
    return default_compute_plugin()


def _configure_compute_plugin(library: Path, compute: str | None) -> None:
    """Tells the library which compute plugin to load, before JAX loads it
    (loading the library here and in JAX yields one instance)."""
    lib = ctypes.CDLL(str(library))
    configure = lib.pjrt_crosshost_set_compute_plugin
    configure.restype = ctypes.c_int
    configure.argtypes = [ctypes.c_char_p]
    if configure(compute.encode() if compute else None) != 0:
        raise RuntimeError(
            f"pjrt-crosshost: could not configure the compute plugin {compute!r} "
            "(another one is already loaded in this process; set PJRT_CROSSHOST_LOG=info to see why)"
        )


class _DeleteArgs(ctypes.Structure):
    """PJRT_CrossHost_KeyValueDeleteCallback_Args (include/pjrt_crosshost.h)."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("key", ctypes.c_void_p),
        ("key_size", ctypes.c_size_t),
        ("callback_error", ctypes.c_void_p),
        ("user_arg", ctypes.c_void_p),
    ]


_DELETE_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_DeleteArgs))
# PJRT_CallbackError: PJRT_Error* (*)(PJRT_Error_Code, const char*, size_t).
_CALLBACK_ERROR_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
_PJRT_UNAVAILABLE = 14
_PJRT_INTERNAL = 13


class _KvDelete:
    """The KV delete the plugin lacks under JAX: the PJRT C API's KV
    callbacks have no delete, but JAX's distributed client has
    ``key_value_delete``. Registered with the library
    (``pjrt_crosshost_set_kv_delete``), it is used by clients whose keys go
    through JAX's coordination service (``kv_store=callbacks``), so their
    receipts and descriptors are deleted for real. JAX prefixes every key
    the plugin writes with ``"crosshost:"``; the delete adds the same prefix.

    The plugin calls it on its own delete workers after the buffer's
    outcome is published (readiness never waits for the GIL), and never
    after ``unregister`` returned: that runs at interpreter exit, before
    finalization, and the library refuses a registration inherited by a
    forked child. Errors go back to the plugin as PJRT errors (counted as
    delete_failures, the buffer's status stands).
    """

    def __init__(self, library: Path):
        self._lib = ctypes.CDLL(str(library))
        self._set = self._lib.pjrt_crosshost_set_kv_delete
        self._set.restype = ctypes.c_int
        self._set.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._callback = _DELETE_FN(self._delete)  # kept alive with self

    def register(self) -> None:
        if self._set(ctypes.cast(self._callback, ctypes.c_void_p), None) != 0:
            raise RuntimeError("pjrt-crosshost: registering the KV delete failed")
        atexit.register(self.unregister)

    def unregister(self) -> None:
        # ctypes releases the GIL for the call, so deletes in flight (which
        # need it) can finish while the library waits for them.
        if self._set(None, None) != 0:
            logger.warning("pjrt-crosshost: KV deletes still in flight at exit")

    @staticmethod
    def _delete(args_ptr) -> int | None:
        args = args_ptr.contents
        try:
            key = ctypes.string_at(args.key, args.key_size).decode()
            from jax._src import distributed

            client = distributed.global_state.client
            if client is None:
                raise ConnectionError("no jax.distributed client in this process")
            client.key_value_delete(f"{PLATFORM}:{key}")
            return None
        except BaseException as e:  # noqa: BLE001 - every failure goes back as a PJRT error
            code = _PJRT_UNAVAILABLE if isinstance(e, ConnectionError) else _PJRT_INTERNAL
            message = f"jax_plugins.crosshost KV delete: {type(e).__name__}: {e}".encode()
            if not args.callback_error:
                return None
            make_error = ctypes.cast(args.callback_error, ctypes.POINTER(_CALLBACK_ERROR_FN))[0]
            return make_error(code, message, len(message))


_kv_delete: _KvDelete | None = None


def _register_kv_delete(library: Path) -> None:
    global _kv_delete
    if os.environ.get(KV_DELETE_ENV, "1") == "0" or _kv_delete is not None:
        return
    try:
        route = _KvDelete(library)
        route.register()
        _kv_delete = route
    except (OSError, AttributeError, RuntimeError) as e:
        logger.warning("pjrt-crosshost: KV deletes through JAX are off: %s", e)


def _coerce(text: str) -> Any:
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    try:
        return int(t)
    except ValueError:
        return t


def parse_options(text: str) -> dict[str, Any]:
    """Parses ``PJRT_CROSSHOST_CREATE_OPTIONS`` (JSON object or k=v pairs)."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError(f"{OPTIONS_ENV} must be a JSON object, got {text!r}")
        return dict(value)
    options: dict[str, Any] = {}
    for item in text.replace(";", ",").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{OPTIONS_ENV}: expected key=value, got {item!r}")
        options[key.strip()] = _coerce(value)
    return options


def _env_registers_us() -> str | None:
    """The path PJRT_NAMES_AND_LIBRARY_PATHS gives for our platform, if any
    (JAX registers those itself; registering twice would fail)."""
    spec = os.environ.get("PJRT_NAMES_AND_LIBRARY_PATHS", "")
    for entry in spec.split(","):
        name, sep, path = entry.partition(":")
        if sep and name.strip() == PLATFORM:
            return path.strip()
    return None


_DEFAULT = object()


def initialize(
    options: Mapping[str, Any] | None = None,
    *,
    priority: int | None = None,
    library: str | os.PathLike[str] | None = None,
    compute_plugin: Any = _DEFAULT,
) -> None:
    """Registers the plugin with JAX (JAX calls this with no arguments).

    ``options`` are PJRT_Client_Create options (default: parsed from
    ``PJRT_CROSSHOST_CREATE_OPTIONS``); ``priority`` the backend priority
    (default ``PJRT_CROSSHOST_JAX_PRIORITY`` or -100); ``library`` the .so
    (default ``PJRT_CROSSHOST_JAX_LIBRARY`` or the packaged one);
    ``compute_plugin`` the PJRT plugin that computes (default
    ``compute_plugin_path()``; ``None`` or ``""`` for none).
    """
    global _registered_library, _compute_plugin
    with _lock:
        if _registered_library is not None:
            return
        from_env = _env_registers_us()
        if from_env is not None:
            logger.debug("%s registered through PJRT_NAMES_AND_LIBRARY_PATHS", PLATFORM)
            compute = compute_plugin_path() if compute_plugin is _DEFAULT else (compute_plugin or None)
            try:
                _configure_compute_plugin(Path(from_env), compute)
                _compute_plugin = compute
            except (OSError, RuntimeError) as e:
                logger.debug("compute plugin not configured: %s", e)
            _register_kv_delete(Path(from_env))
            _registered_library = from_env
            return
        path = Path(library) if library is not None else library_path()
        if not path.is_file():
            raise FileNotFoundError(
                f"pjrt-crosshost: plugin library {path} not found. Install the package "
                "with its library (`pip install .` at the repository root builds it), "
                f"or set {LIBRARY_ENV}."
            )
        if options is None:
            options = parse_options(os.environ.get(OPTIONS_ENV, ""))
        if priority is None:
            priority = int(os.environ.get(PRIORITY_ENV, DEFAULT_PRIORITY))
        compute = compute_plugin_path() if compute_plugin is _DEFAULT else (compute_plugin or None)
        _configure_compute_plugin(path, compute)
        _compute_plugin = compute
        _register_kv_delete(path)
        from jax._src import xla_bridge

        fixed = dict(options)

        def create_options() -> dict[str, Any]:
            # Called by JAX when it creates the client, after
            # jax.distributed.initialize: the coordinator's address is known.
            return _with_job_hints(fixed)

        xla_bridge.register_plugin(
            PLATFORM,
            priority=priority,
            library_path=str(path),
            options=create_options,
        )
        _registered_library = str(path)


def _with_job_hints(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` plus what the plugin cannot learn itself: the address of
    JAX's coordination service, whose route tells each process which of its
    addresses the others can reach (``coordinator_address``)."""
    options = dict(options)
    secret = os.environ.get(JOB_SECRET_ENV)
    if secret and "job_secret_file" not in options:
        options["job_secret_file"] = secret
    if "coordinator_address" not in options:
        try:
            from jax._src import distributed

            address = distributed.global_state.coordinator_address
        except Exception:  # noqa: BLE001 - a JAX without it: no hint
            address = None
        if address:
            options["coordinator_address"] = str(address)
    return options


def _prepare_ucx() -> None:
    """Keeps UCX off the signals and the allocator of the process (JAX owns
    them) and points the plugin at the ``libucx`` wheel's UCX when it is
    installed (``pip install libucx-cu12``). Done at import, before JAX
    starts its threads: the environment must not change under them."""
    for name, value in _UCX_ENVIRONMENT:
        os.environ.setdefault(name, value)
    if UCX_WHEEL_ENV in os.environ:
        return
    try:
        import importlib.util

        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        lib = Path(spec.origin).resolve().parent / "lib"
        if (lib / "libucp.so").is_file():
            os.environ[UCX_WHEEL_ENV] = str(lib)


# The same as the library's UCX_ENVIRONMENT (src/transport/ucx/library.rs).
_UCX_ENVIRONMENT = (
    ("UCX_ERROR_SIGNALS", ""),
    ("UCX_MEM_MALLOC_HOOKS", "no"),
    ("UCX_MEM_EVENTS", "no"),
    ("UCX_WARN_UNUSED_ENV_VARS", "n"),
    ("UCX_TCP_RX_SEG_SIZE", "512k"),
)
UCX_WHEEL_ENV = "PJRT_CROSSHOST_UCX_WHEEL_LIB"
_prepare_ucx()


def configured_compute_plugin() -> str | None:
    """The compute plugin ``initialize()`` configured (None: none)."""
    return _compute_plugin


def registered_library() -> str | None:
    """The library JAX loaded for this platform, once registered."""
    return _registered_library or _env_registers_us()


def timeline() -> list[list]:
    """The plugin's transfer timeline marks recorded so far in this process,
    ``[[nanoseconds, point, key hash, thread], ...]`` (CLOCK_MONOTONIC, the
    clock of ``time.monotonic_ns()``; for ``api_enter`` and ``api_exit``,
    each PJRT call into the plugin, the function's name in place of the key
    hash), emptying the record: empty unless the
    process runs with ``PJRT_CROSSHOST_TIMELINE=1``
    (bench/profile_transfer.py)."""
    library = registered_library()
    if library is None:
        return []
    lib = ctypes.CDLL(str(library))
    take = lib.pjrt_crosshost_timeline_json
    take.restype = ctypes.c_void_p
    take.argtypes = []
    release = lib.pjrt_crosshost_free_string
    release.argtypes = [ctypes.c_void_p]
    pointer = take()
    if not pointer:
        return []
    try:
        return json.loads(ctypes.string_at(pointer).decode())
    finally:
        release(pointer)


def metrics() -> list[dict[str, Any]]:
    """Transfer metrics of every live ``crosshost`` client in this process.

    JAX does not expose its ``PJRT_Client*``, so this reads the plugin's
    ``pjrt_crosshost_live_clients_metrics_json()`` export: a list of
    ``{"process_index": N, "metrics": {...}}``, one per client, with the keys
    of ``pjrt_crosshost_metrics_json`` (keys_created, keys_deleted,
    delete_failures, keys_outstanding, retained_keys, stale_receipts_rejected,
    cancellations, timeouts, bytes_received, bytes_sent).
    Call it after JAX created the backend (e.g. after ``jax.devices()``).
    """
    path = registered_library()
    if path is None:
        raise RuntimeError("pjrt-crosshost: the plugin is not registered with JAX yet")
    # dlopen of the path JAX already loaded returns the same library object.
    lib = ctypes.CDLL(path)
    fetch = lib.pjrt_crosshost_live_clients_metrics_json
    fetch.restype = ctypes.c_void_p
    fetch.argtypes = []
    free = lib.pjrt_crosshost_free_string
    free.restype = None
    free.argtypes = [ctypes.c_void_p]
    raw = fetch()
    if not raw:
        raise RuntimeError("pjrt-crosshost: the metrics export failed")
    try:
        return json.loads(ctypes.string_at(raw).decode())
    finally:
        free(raw)


def _settled(m: dict[str, Any]) -> bool:
    # Every key not deleted is retained (a store that cannot delete) or
    # failed to delete: no receive is still in its lifecycle.
    return m["keys_outstanding"] == m["retained_keys"] + m["delete_failures"]


def settled_metrics(timeout: float = 10.0) -> list[dict[str, Any]]:
    """``metrics()`` once no received buffer's keys are still in flight.

    A buffer is ready as soon as its data is; the plugin deletes its keys
    right after (one more message to the peer), so metrics read the moment
    an array arrives can still count those keys as outstanding. This waits,
    up to ``timeout`` seconds, until every client's lifecycle has settled and
    returns the metrics then (unsettled ones, if the time ran out).
    """
    deadline = time.monotonic() + timeout
    while True:
        clients = metrics()
        if all(_settled(c["metrics"]) for c in clients) or time.monotonic() >= deadline:
            return clients
        time.sleep(0.01)
