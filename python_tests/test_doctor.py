"""The doctor (`python -m jax_plugins.crosshost doctor` and the C-level
`crosshost-doctor`, both the library's `api::doctor`): what it names on this
machine (the UCX wheel taken, the system's 1.13 refused; both hidden), a
wrong advertise_address, the libucp choice between two candidates (the
second faked by path: a copy of the wheel's UCX with a verbs module, found
as the system's through LD_LIBRARY_PATH, and RDMA devices faked by a
directory), a job of two processes on this host, and on the two-host bed a
peer that is unreachable, named on both sides. Every problem comes with the
option to change and a non-zero exit status.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import two_hosts as th
from conftest import REPO, library_path

PY = sys.executable
T = 120  # seconds: bound on each doctor run
LIB = library_path()
DOCTOR = LIB.parent / "crosshost-doctor"
SYSTEM_LIBUCP = next(
    (f for f in ("/usr/lib/x86_64-linux-gnu/libucp.so.0", "/usr/lib/aarch64-linux-gnu/libucp.so.0")
     if os.path.exists(f)),
    None,
)


def wheel_dir() -> str | None:
    """The libucx wheel's library directory, as jax_plugins.crosshost finds it."""
    given = os.environ.get("PJRT_CROSSHOST_UCX_WHEEL_LIB")
    if given:
        return given
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.origin:
        return None
    lib = Path(spec.origin).resolve().parent / "lib"
    return str(lib) if (lib / "libucp.so").is_file() else None


WHEEL = wheel_dir()
needs_wheel = pytest.mark.skipif(WHEEL is None, reason="no libucx wheel (pip install libucx-cu12)")


def system_version() -> str | None:
    """The system libucp's version, from its package (Debian's libucx0)."""
    if SYSTEM_LIBUCP is None:
        return None
    r = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "libucx0"], capture_output=True, text=True)
    return r.stdout.split("-")[0] if r.returncode == 0 else None


def base_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PJRT_CROSSHOST_CREATE_OPTIONS", "PJRT_CROSSHOST_UCX_LIBRARY",
                        "PJRT_CROSSHOST_UCX_WHEEL_LIB", "PJRT_CROSSHOST_TEST_RDMA_DEVICES_DIR")}
    env["PJRT_CROSSHOST_JAX_LIBRARY"] = str(LIB)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if WHEEL is not None:
        env["PJRT_CROSSHOST_UCX_WHEEL_LIB"] = WHEEL
    env.update(extra)
    return env


def python_doctor(*args: str) -> list[str]:
    return [PY, "-m", "jax_plugins.crosshost", "doctor", "--json", *args]


def c_doctor(*args: str) -> list[str]:
    assert DOCTOR.is_file(), f"{DOCTOR} not built (cargo build --release builds it beside the library)"
    return [str(DOCTOR), "--json", *args]


def doctor(argv: list[str], env: dict, timeout: float = T) -> tuple[int, dict, str]:
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    assert r.stdout.strip(), f"no report; exit {r.returncode}\n{r.stderr}"
    report = json.loads(r.stdout.strip().splitlines()[-1])
    return r.returncode, report, r.stderr


def problem(report: dict, needle: str) -> dict:
    found = [p for p in report["problems"] if needle in p["problem"]]
    assert found, f"no problem mentioning {needle!r}:\n{report['text']}"
    return found[0]


@needs_wheel
@pytest.mark.parametrize("front", [python_doctor, c_doctor], ids=["python", "c"])
def test_here_it_takes_the_wheel_refuses_the_system_ucx_and_finds_no_problem(front):
    rc, report, stderr = doctor(front(), base_env())
    assert rc == 0 and report["ok"], report["text"] + stderr
    assert report["library"]["version"] == "0.1.0"
    expected = "libpjrt_crosshost.so" if front is python_doctor else "crosshost-doctor"
    assert report["library"]["path"].endswith(expected), report["library"]
    ucx = report["ucx"]
    assert ucx["loaded"] and ucx["path"] == os.path.join(WHEEL, "libucp.so"), ucx
    major, minor, _ = (int(x) for x in ucx["version"].split("."))
    assert (major, minor) >= (1, 14), ucx
    assert ucx["why"].startswith("the libucx wheel's libucp ("), ucx["why"]
    version = system_version()
    if version is not None and version.startswith("1.13"):
        # The system's UCX was found, and refused for its version.
        assert f"UCX {version}) is older than UCX 1.14, not used" in ucx["why"], ucx["why"]
    assert "tcp" in ucx["transports"] and "host" in ucx["memory_types"], ucx
    # No RDMA device here, no CUDA driver: said as such.
    assert ucx["rdma"] is False and ucx["cuda"] is False, ucx
    assert "RDMA: no (no RDMA device on this host), CUDA: no" in report["text"], report["text"]
    address = report["address"]
    assert address["local"] and address["source"], address
    if front is python_doctor:
        assert report["python"]["libucx_wheel"] == WHEEL
        assert "python " in report["text"]
        # The compute plugin initialize() would configure.
        assert report["compute_plugin"]["loaded"] in (True, False)


@pytest.mark.parametrize("front", [python_doctor, c_doctor], ids=["python", "c"])
def test_a_hidden_wheel_leaves_no_usable_ucx_a_problem_naming_the_way_out(front):
    rc, report, stderr = doctor(front(), base_env(PJRT_CROSSHOST_UCX_WHEEL_LIB=""))
    assert rc == 1 and not report["ok"], report["text"] + stderr
    assert report["ucx"]["loaded"] is False, report["ucx"]
    found = problem(report, "UCX (libucp) is not available")
    assert "the libucx wheel: $PJRT_CROSSHOST_UCX_WHEEL_LIB not set" in found["problem"], found
    version = system_version()
    if version is not None and version.startswith("1.13"):
        assert f"UCX {version}) is older than UCX 1.14, not used" in found["problem"], found
    assert "pip install libucx-cu12" in found["change"] and "ucx_library=" in found["change"], found
    assert "transport=tcp" in found["change"], found
    # transport=tcp says UCX is not wanted: no problem then.
    rc, report, _ = doctor(front("--transport", "tcp"), base_env(PJRT_CROSSHOST_UCX_WHEEL_LIB=""))
    assert rc == 0, report["text"]
    assert report["ucx"]["loaded"] is False and report["ucx"]["why"] == "transport=tcp", report["ucx"]


@pytest.mark.parametrize("front", [python_doctor, c_doctor], ids=["python", "c"])
def test_a_wrong_advertise_address_is_a_problem_naming_the_option(front):
    # 203.0.113.0/24 is TEST-NET-3: documentation only, never this host's.
    rc, report, _ = doctor(front("-o", "advertise_address=203.0.113.77", "--transport", "tcp"), base_env())
    assert rc == 1, report["text"]
    assert report["address"]["address"] == "203.0.113.77" and report["address"]["local"] is False
    found = problem(report, "203.0.113.77")
    assert "is not an address of this host" in found["problem"], found
    assert "advertise_address=203.0.113.77" in found["problem"], found  # and why it was chosen
    assert found["change"].startswith("advertise_address=<one of "), found
    # One that does not resolve is named too.
    rc, report, _ = doctor(front("--advertise-address", "no-such-host.invalid", "--transport", "tcp"),
                           base_env())
    assert rc == 1
    assert "advertise_address=<an IP address" in problem(report, "no-such-host.invalid")["change"]


def fake_system_ucx(tmp_path: Path, verbs: bool) -> Path:
    """A second UCX found as "the system's libucp.so.0" (through
    LD_LIBRARY_PATH): the wheel's libraries under the system's names, with
    its modules and, when ``verbs``, a verbs module beside them (an empty
    file: UCX cannot load it, so its transports stay the wheel's)."""
    fake = tmp_path / "fake-ucx"
    (fake / "ucx").mkdir(parents=True)
    for lib in Path(WHEEL).iterdir():
        if lib.is_file() and ".so" in lib.name:
            (fake / lib.name).symlink_to(lib)
    for module in (Path(WHEEL) / "ucx").iterdir():
        (fake / "ucx" / module.name).symlink_to(module)
    if verbs:
        (fake / "ucx" / "libuct_ib.so").write_bytes(b"")
    return fake


@needs_wheel
def test_two_candidates_the_one_with_verbs_is_taken_where_the_host_has_rdma_devices(tmp_path):
    fake = fake_system_ucx(tmp_path, verbs=True)
    rdma = tmp_path / "infiniband"
    (rdma / "mlx5_0").mkdir(parents=True)
    env = base_env(LD_LIBRARY_PATH=str(fake), PJRT_CROSSHOST_LOG="pjrt_crosshost=info",
                   PJRT_CROSSHOST_TEST_RDMA_DEVICES_DIR=str(rdma))
    rc, report, stderr = doctor(c_doctor("--transport", "auto"), env)
    ucx = report["ucx"]
    assert ucx["path"] == str(fake / "libucp.so.0"), report["text"]
    assert ucx["rdma_devices"] == ["mlx5_0"], ucx
    assert ucx["why"].startswith(f"the system's libucp.so.0 ({fake / 'libucp.so.0'}, UCX "), ucx["why"]
    assert "has verbs transports (rc, ud, dc) for this host's RDMA devices (mlx5_0), which the libucx " \
           f"wheel's libucp ({WHEEL}/libucp.so" in ucx["why"], ucx["why"]
    # Said in the log, with why.
    assert f"loaded from {fake / 'libucp.so.0'}: the system's libucp.so.0" in stderr, stderr
    # The verbs module here is a fake that UCX cannot load: the doctor sees
    # that no verbs transport came of it, and says what to change.
    assert ucx["rdma"] is False
    found = problem(report, "this host has RDMA devices (mlx5_0)")
    assert found["change"].startswith("ucx_library="), found
    assert rc == 1

    # Without RDMA devices a verbs module counts for nothing: the wheel, first
    # in the default order, is taken.
    del env["PJRT_CROSSHOST_TEST_RDMA_DEVICES_DIR"]
    rc, report, stderr = doctor(c_doctor(), env)
    assert rc == 0, report["text"]
    assert report["ucx"]["path"] == os.path.join(WHEEL, "libucp.so"), report["ucx"]
    assert "first in the default order" in report["ucx"]["why"], report["ucx"]["why"]
    assert "no RDMA device on this host" in report["ucx"]["why"], report["ucx"]["why"]
    assert f"loaded from {WHEEL}/libucp.so: the libucx wheel's libucp" in stderr, stderr


@needs_wheel
def test_an_explicit_ucx_library_wins_over_the_choice(tmp_path):
    fake = fake_system_ucx(tmp_path, verbs=True)
    rdma = tmp_path / "infiniband"
    (rdma / "mlx5_0").mkdir(parents=True)
    env = base_env(LD_LIBRARY_PATH=str(fake), PJRT_CROSSHOST_TEST_RDMA_DEVICES_DIR=str(rdma))
    wheel = os.path.join(WHEEL, "libucp.so")
    rc, report, _ = doctor(c_doctor("--ucx-library", wheel), env)
    assert report["ucx"]["path"] == wheel, report["text"]
    assert report["ucx"]["why"].startswith("named by ucx_library"), report["ucx"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(fronts: list[list[str]], env: dict) -> list[tuple[int, dict, str]]:
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for argv in fronts]
    out = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=T)
            assert stdout.strip(), f"no report; exit {proc.returncode}\n{stderr}"
            out.append((proc.returncode, json.loads(stdout.strip().splitlines()[-1]), stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def test_a_job_of_two_processes_on_this_host_answers_with_round_trip_times():
    coordinator = f"127.0.0.1:{free_port()}"
    job = ["--coordinator", coordinator, "--num-processes", "2", "--timeout", "5",
           "-o", "session_timeout_ms=30000"]
    results = run_job([c_doctor(*job, "--process-id", "0"),
                       python_doctor(*job, "--process-id", "1")], base_env())
    for index, (rc, report, stderr) in enumerate(results):
        assert rc == 0, report["text"] + stderr
        (peer,) = report["job"]["peers"]
        assert peer["process"] == 1 - index
        assert peer["route"] == "shared memory (same host)", peer
        assert peer["control_rtt_ms"] > 0 and peer["control_at"].startswith("at unix:"), peer
        assert peer["tcp_rtt_ms"] > 0, peer
        assert "ucx_rtt_ms" not in peer, peer  # same host: no UCX under transport=auto


def test_a_job_whose_other_process_never_starts_names_it_and_the_option():
    coordinator = f"127.0.0.1:{free_port()}"
    rc, report, _ = doctor(c_doctor("--coordinator", coordinator, "--num-processes", "2",
                                    "--process-id", "0", "-o", "session_timeout_ms=1500",
                                    "--transport", "tcp"), base_env())
    assert rc == 1
    found = problem(report, "creating this process's client of the job")
    assert "session_timeout_ms" in found["change"] and "--num-processes" in found["change"], found


# -- the two-host bed ----------------------------------------------------------

bed_needed = pytest.mark.skipif(th.unavailable_reason() is not None,
                                reason=f"no two-host bed: {th.unavailable_reason()}")


def bed_job(bed, args_a: list[str], args_b: list[str], env: dict) -> list[tuple[int, dict, str]]:
    procs = [bed.popen(host, python_doctor(*args), env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
             for host, args in (("a", args_a), ("b", args_b))]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=T)
        assert stdout.strip(), f"no report; exit {proc.returncode}\n{stderr}"
        out.append((proc.returncode, json.loads(stdout.strip().splitlines()[-1]), stderr))
    return out


@bed_needed
def test_on_the_two_host_bed_the_peers_answer_and_an_unreachable_one_is_named_on_both_sides(two_hosts):
    bed = two_hosts
    env = base_env()
    common = ["--num-processes", "2", "--timeout", "5", "-o", "session_timeout_ms=30000"]

    # Both hosts with no options: each reaches the other, over UCX where the
    # wheel is there.
    coordinator = f"{bed.address('a')}:{bed.port()}"
    job = ["--coordinator", coordinator, *common]
    (rc_a, a, err_a), (rc_b, b, err_b) = bed_job(bed, [*job, "--process-id", "0"],
                                                 [*job, "--process-id", "1"], env)
    assert rc_a == 0 and rc_b == 0, a["text"] + err_a + b["text"] + err_b
    assert a["address"]["address"] == bed.address("a") and b["address"]["address"] == bed.address("b")
    for report, other in ((a, "b"), (b, "a")):
        (peer,) = report["job"]["peers"]
        assert peer["host"] == bed.hostname(other), peer
        assert peer["control_at"].startswith(f"at {bed.address(other)}:"), peer
        assert peer["control_rtt_ms"] > 0 and peer["tcp_rtt_ms"] > 0, peer
        assert peer["route"] == ("UCX" if WHEEL else "TCP"), peer
        if WHEEL:
            # The UCX endpoint answered too, over TCP on the bed's veth.
            assert peer["ucx_rtt_ms"] > 0 and peer["ucx_at"].endswith(" workers"), peer

    # Host b advertises an address of its own that host a has no route to
    # (a second address, on its loopback: a multi-homed host advertising the
    # wrong network).
    r = bed.run("b", ["ip", "addr", "add", "10.99.0.2/32", "dev", "lo"], timeout=30)
    assert r.returncode == 0, r.stderr
    coordinator = f"{bed.address('a')}:{bed.port()}"
    job = ["--coordinator", coordinator, *common]
    (rc_a, a, err_a), (rc_b, b, err_b) = bed_job(
        bed, [*job, "--process-id", "0"], [*job, "--process-id", "1", "--advertise-address", "10.99.0.2"],
        env)
    assert rc_a == 1 and rc_b == 1, a["text"] + b["text"]
    # Host b's own checks pass: the address is one of its own.
    assert b["address"]["local"] is True
    # Host a: process 1 does not answer there, and what to give it.
    found = problem(a, "process 1 (host xh-b) does not answer on its control link at 10.99.0.2:")
    assert "give process 1 the create option advertise_address=" in found["change"], found
    # Host b hears it from process 0, with its own address named.
    found = problem(b, "process 0 cannot reach this process on its control link at 10.99.0.2:")
    assert found["change"].startswith("advertise_address=<an address of this host that process 0's host can reach>"), found
    assert "(this process advertised 10.99.0.2)" in found["change"], found
