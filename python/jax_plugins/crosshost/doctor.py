"""``python -m jax_plugins.crosshost doctor``: what this process would use
under JAX, and whether a job's peers answer.

It loads the library JAX would load, configures the compute plugin as
``initialize()`` does, and runs the library's doctor
(``pjrt_crosshost_doctor_json``, the checks ``crosshost-doctor`` runs): the
library and its version, the compute plugin, the libucp it would load with
its version, transports and memory types ("RDMA: yes/no, CUDA: yes/no") and
why it was taken, the address it would advertise and why, and, given a job
(``--coordinator HOST:PORT`` or ``--etcd URL`` with ``--num-processes`` and
``--process-id``, run on every process), whether every peer's control link
and TCP data port answer, with round-trip times. The create options are
read from ``PJRT_CROSSHOST_CREATE_OPTIONS`` (and ``-o KEY=VALUE``), as JAX
would pass them. Exit status 0: no problem; 1: problems, each printed with
the option to change; 2: a usage error.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from . import (
    JOB_SECRET_ENV,
    LIBRARY_ENV,
    OPTIONS_ENV,
    UCX_WHEEL_ENV,
    _configure_compute_plugin,
    compute_plugin_path,
    library_path,
    parse_options,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_plugins.crosshost doctor",
        description="Checks what pjrt-crosshost would use here and, run on every "
        "process of a job, whether the peers answer.",
    )
    store = p.add_mutually_exclusive_group()
    store.add_argument("--coordinator", metavar="HOST:PORT",
                       help="process 0 serves the job's store there (as JAX's coordinator)")
    store.add_argument("--etcd", metavar="URL", help="the job's store is etcd (kv_store=URL)")
    p.add_argument("--num-processes", type=int, metavar="N")
    p.add_argument("--process-id", type=int, metavar="I")
    p.add_argument("--advertise-address", metavar="ADDRESS")
    p.add_argument("--transport", choices=("auto", "tcp", "ucx"))
    p.add_argument("--ucx-library", metavar="PATH")
    p.add_argument("--session", metavar="NAME")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="bound on each peer check (default 10)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a PJRT_Client_Create option (after PJRT_CROSSHOST_CREATE_OPTIONS)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def request(args: argparse.Namespace) -> str:
    """The doctor's request: ``key=value`` lines (library side:
    ``api::doctor::Request``)."""
    options: dict[str, Any] = parse_options(os.environ.get(OPTIONS_ENV, ""))
    secret = os.environ.get(JOB_SECRET_ENV)
    if secret and "job_secret_file" not in options:
        options["job_secret_file"] = secret
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"-o takes KEY=VALUE, got {item!r}")
        options[key.strip()] = value.strip()
    flags = {
        "kv_store": args.etcd,
        "num_nodes": args.num_processes,
        "node_id": args.process_id,
        "advertise_address": args.advertise_address,
        "transport": args.transport,
        "ucx_library": args.ucx_library,
        "session": args.session,
    }
    options.update({k: v for k, v in flags.items() if v is not None})
    lines = [f"{k}={_text(v)}" for k, v in options.items()]
    if args.coordinator:
        lines.append(f"doctor.coordinator={args.coordinator}")
    if args.timeout is not None:
        lines.append(f"doctor.timeout_ms={int(args.timeout * 1000)}")
    return "\n".join(lines)


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def python_facts() -> dict[str, Any]:
    """What the package sees: itself, JAX (not imported), the libucx wheel."""
    return {
        "package": str(Path(__file__).resolve().parent),
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "libucx_wheel": os.environ.get(UCX_WHEEL_ENV) or None,
        "create_options": os.environ.get(OPTIONS_ENV) or None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The library's report (a dict), with a ``python`` section."""
    facts = python_facts()
    path = library_path()
    if not path.is_file():
        problem = {
            "problem": f"the plugin library {path} does not exist",
            "change": f"pip install the package with its library, or {LIBRARY_ENV}=<path of "
            "libpjrt_crosshost.so>",
        }
        return {"ok": False, "problems": [problem], "python": facts,
                "text": f"pjrt-crosshost doctor\n\n1 problem(s):\n  1. {problem['problem']}\n"
                        f"     change: {problem['change']}\n"}
    facts["library"] = str(path)
    # As initialize() does before JAX loads the library: the same instance.
    compute = compute_plugin_path()
    _configure_compute_plugin(path, compute)
    lib = ctypes.CDLL(str(path))
    doctor = lib.pjrt_crosshost_doctor_json
    doctor.restype = ctypes.c_void_p
    doctor.argtypes = [ctypes.c_char_p]
    free = lib.pjrt_crosshost_free_string
    free.restype = None
    free.argtypes = [ctypes.c_void_p]
    raw = doctor(request(args).encode())
    if not raw:
        raise RuntimeError("pjrt-crosshost: the doctor export failed (PJRT_CROSSHOST_LOG=info says why)")
    try:
        report = json.loads(ctypes.string_at(raw).decode())
    finally:
        free(raw)
    report["python"] = facts
    jax = f"JAX {facts['jax']} (jaxlib {facts['jaxlib']})" if facts["jax"] else "JAX not installed"
    head, _, rest = report["text"].partition("\n")
    report["text"] = f"{head}\npython        {facts['package']}; {jax}\n{rest}"
    return report


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return 2 if e.code not in (0, None) else 0
    report = run(args)
    if args.json:
        print(json.dumps(report))
    else:
        print(report["text"], end="")
    return 0 if report["ok"] else 1
