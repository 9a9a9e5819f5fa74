"""A ctypes job of one process per host on an N-host bed (n_hosts.py): the
store on the store host (a KV server for the PJRT KV callbacks, the plugin's
default multi-process mode, or etcd), n_host_worker.py on every host.
Used by test_n_host_bed.py and bench/scale.py.

    job = NHostJob(bed, tmp_path, store="etcd", hide_ucx=True)
    job.start()          # the store, then every worker, each up to "ready"
    job.go()             # every worker creates its client now
    results = job.results()
    job.finish()         # every worker destroys its client and exits
    job.close()          # the store too (and whatever is still running)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import n_hosts

HERE = Path(__file__).resolve().parent
WORKER = HERE / "n_host_worker.py"
KV_WORKER = HERE / "two_host_worker.py"
STORES = ("callbacks", "etcd")


def library_path() -> str:
    return os.environ.get("PJRT_CROSSHOST_LIB") or str(HERE.parent / "target/release/libpjrt_crosshost.so")


class NHostJob:
    def __init__(self, bed: n_hosts.NHostBed, log_dir: Path, store: str = "callbacks",
                 hide_ucx: bool = False, sizes=(17, 4096, 256 << 10), rounds=("ring", "all"),
                 options: dict | None = None, timeout_s: float = 30.0, pause: bool = False,
                 per_host: int = 1, nofile: int | None = None, settle_s: float = 0.0,
                 settle_endpoints: int | None = None):
        assert store in STORES, store
        assert bed.store, "the job's store runs on the bed's store host"
        self.bed = bed
        self.log_dir = Path(log_dir)
        self.store = store
        self.hosts = bed.hosts
        # Processes 0..P-1, process i on host i mod N: a ring's neighbours
        # are on different hosts, as an all-to-all's mostly are.
        self.processes = list(range(len(bed.hosts) * per_host))
        # A soft open-file limit each worker sets for itself, with the
        # plugin's raise of it turned off, so that the limit holds.
        self.nofile = nofile
        self.pause = pause
        # After the rounds, what is open is measured: after settle_s idle,
        # or once the process's UCX endpoints are down to settle_endpoints
        # (settle_s then bounds the wait).
        self.settle_s = settle_s
        self.settle_endpoints = settle_endpoints
        self.prefix = n_hosts.without_ucx([]) if hide_ucx else []
        inherited = dict(os.environ)
        for name in ("PJRT_CROSSHOST_UCX_LIBRARY", "UCX_TCP_RX_SEG_SIZE", "PJRT_CROSSHOST_THREAD_SLICE_US"):
            inherited.pop(name, None)
        self.env = dict(inherited, PYTHONPATH=str(HERE))
        if nofile is not None:
            self.env["PJRT_CROSSHOST_RAISE_FD_LIMIT"] = "0"
        self.session = f"nhosts{uuid.uuid4().hex[:12]}"
        self.timeout_s = timeout_s
        self.options = {"session_timeout_ms": int(timeout_s * 1000),
                        "receive_timeout_ms": int(timeout_s * 1000),
                        "send_timeout_ms": int(timeout_s * 1000), **(options or {})}
        self.sizes = list(sizes)
        self.rounds = list(rounds)
        self.kv_proc = None
        self.etcd: n_hosts.BedEtcd | None = None
        self.workers: dict[int, subprocess.Popen] = {}
        self.go_time: float | None = None

    def start(self) -> None:
        kv = None
        if self.store == "callbacks":
            port = self.bed.port()
            self.kv_proc = self.bed.popen(n_hosts.STORE, [sys.executable, KV_WORKER, "kv", port],
                                          env=self.env, stdout=subprocess.PIPE)
            line = n_hosts.read_line(self.kv_proc, 30)
            assert line, "the KV server did not start"
            kv = [self.bed.address(n_hosts.STORE), json.loads(line)["kv"][1]]
        else:
            self.etcd = n_hosts.BedEtcd(self.bed)
            self.options.setdefault("kv_store", self.etcd.url)
        for node in self.processes:
            cfg = {"lib": library_path(), "node": node, "nodes": len(self.processes),
                   "session": self.session, "options": self.options, "kv": kv,
                   "store": self.bed.address(n_hosts.STORE), "sizes": self.sizes,
                   "rounds": self.rounds, "timeout_s": self.timeout_s, "pause": self.pause,
                   "nofile": self.nofile, "settle_s": self.settle_s,
                   "settle_endpoints": self.settle_endpoints}
            log = self.log_dir / f"node{node}.log"
            host = self.hosts[node % len(self.hosts)]
            proc = self.bed.popen(host, [*self.prefix, sys.executable, WORKER, json.dumps(cfg)],
                                  env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=open(log, "wb"))
            proc.log = log
            self.workers[node] = proc
        for node, proc in self.workers.items():
            line = self._line(proc, 60 + 2 * len(self.processes))
            assert json.loads(line) == {"ready": node}, line

    def _line(self, proc, timeout: float) -> str:
        line = n_hosts.read_line(proc, timeout)
        if not line:
            log = proc.log.read_text(errors="replace")[-4000:]
            raise AssertionError(f"worker {proc.args[3:5]} ended (exit {proc.poll()}):\n{log}")
        return line

    def go(self) -> None:
        """Every worker starts creating its client."""
        self.go_time = time.time()
        for proc in self.workers.values():
            proc.stdin.write(b"go\n")
            proc.stdin.flush()

    def created(self, timeout: float | None = None) -> None:
        """With ``pause``: returns once every worker has created its client
        (and waits for ``proceed``); AssertionError when one did not."""
        deadline = time.monotonic() + (timeout or 4 * self.timeout_s)
        for node, proc in self.workers.items():
            try:
                line = self._line(proc, max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                raise AssertionError(f"node {node} was not created in time") from None
            assert json.loads(line) == {"created": node}, f"node {node}: {line}"

    def proceed(self) -> None:
        """With ``pause``: every worker goes on to the rounds."""
        for proc in self.workers.values():
            proc.stdin.write(b"rounds\n")
            proc.stdin.flush()

    def results(self, timeout: float | None = None) -> dict[int, dict]:
        """Each worker's result line; AssertionError when a worker printed
        none before the deadline (its log in the message)."""
        deadline = time.monotonic() + (timeout or 4 * self.timeout_s)
        out = {}
        for node, proc in self.workers.items():
            try:
                line = self._line(proc, max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                log = proc.log.read_text(errors="replace")[-4000:]
                raise AssertionError(f"node {node} gave no result in time:\n{log}") from None
            try:
                out[node] = json.loads(line)
            except ValueError:
                # Something besides the worker wrote to its stdout (a
                # library's abort message, say): a failure, with its log.
                log = proc.log.read_text(errors="replace")[-4000:]
                raise AssertionError(f"node {node} gave no result but {line[:500]!r}:\n{log}") from None
            assert "error" not in out[node], f"node {node} failed:\n{out[node]['error']}"
        return out

    def close(self) -> None:
        """Kills whatever of the job is still running (after a failure)."""
        for proc in self.workers.values():
            n_hosts.kill_group(proc)
        if self.kv_proc is not None:
            n_hosts.kill_group(self.kv_proc)
        if self.etcd is not None:
            self.etcd.stop()

    def finish(self, timeout: float = 60.0) -> dict[int, int]:
        """Lets every worker destroy its client and exit; their exit codes.
        The store stays until ``close()``."""
        for proc in self.workers.values():
            try:
                proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        codes = {}
        for node, proc in self.workers.items():
            try:
                codes[node] = proc.wait(max(deadline - time.monotonic(), 0.001))
            except subprocess.TimeoutExpired:
                n_hosts.kill_group(proc)
                codes[node] = None
        return codes
