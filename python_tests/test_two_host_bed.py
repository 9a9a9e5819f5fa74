"""The two-host bed itself (scripts/two-hosts.sh, two_hosts.py): two hosts
that are two hosts to anything run on them -- own hostname, boot id,
/dev/shm, pids, IPC, network -- joined by one veth; and nothing of a bed
left afterwards, however it ends.

Skipped, with the reason `two-hosts.sh check` gives, where no bed can be
made (not root, no iproute2, namespaces not permitted).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import two_hosts as th

pytestmark = pytest.mark.skipif(
    th.unavailable_reason() is not None, reason=f"no two-host bed: {th.unavailable_reason()}"
)

PY = sys.executable
T = 30  # seconds: bound on each child


def on(bed, host, code: str, *args, env=None) -> dict:
    """Runs Python ``code`` on ``host``; it prints one JSON object, returned."""
    r = bed.run(host, [PY, "-c", textwrap.dedent(code), *map(str, args)], timeout=T, env=env)
    assert r.returncode == 0, f"on {host}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _blocker(bed, host, code: str = "", **kw):
    """A process on ``host`` that runs ``code``, prints "ready" and waits
    until its stdin closes."""
    proc = bed.popen(
        host,
        [PY, "-c", textwrap.dedent(code) + "\nimport sys\nprint('ready', flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, **kw,
    )
    assert th.read_line(proc, T) == "ready\n"
    return proc


def _root_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def _netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


IDENTITY = """
    import json, socket
    print(json.dumps({
        "hostname": socket.gethostname(),
        "xh_a": socket.gethostbyname("xh-a"),
        "xh_b": socket.gethostbyname("xh-b"),
        "hosts": open("/etc/hosts").read(),
        "boot_id": open("/proc/sys/kernel/random/boot_id").read().strip(),
        "ns": {k: __import__("os").readlink(f"/proc/self/ns/{k}")
               for k in ("net", "mnt", "uts", "ipc", "pid")},
    }))
"""


def test_the_two_hosts_have_their_own_names_boot_ids_and_namespaces_and_both_name_both(two_hosts):
    a = on(two_hosts, "a", IDENTITY)
    b = on(two_hosts, "b", IDENTITY)
    assert a["hostname"] == two_hosts.hostname("a") == "xh-a"
    assert b["hostname"] == two_hosts.hostname("b") == "xh-b"
    for side in (a, b):
        # Both hosts name both, the same way.
        assert side["xh_a"] == two_hosts.address("a") == "10.77.0.1", side
        assert side["xh_b"] == two_hosts.address("b") == "10.77.0.2", side
        assert "xh-a" in side["hosts"] and "xh-b" in side["hosts"]
    # The plugin's host identity is hostname + boot id: both differ.
    machine_boot_id = open("/proc/sys/kernel/random/boot_id").read().strip()
    assert len({a["boot_id"], b["boot_id"], machine_boot_id}) == 3
    machine_ns = {k: os.readlink(f"/proc/self/ns/{k}") for k in a["ns"]}
    for kind in ("net", "mnt", "uts", "ipc", "pid"):
        assert len({a["ns"][kind], b["ns"][kind], machine_ns[kind]}) == 3, kind
    # A second run on a host is on the same host.
    assert on(two_hosts, "a", IDENTITY) == a


def test_dev_shm_is_private_to_a_host(two_hosts):
    name = f"xhbed-test-{os.getpid()}-{time.monotonic_ns()}"
    holder = _blocker(two_hosts, "a", f"open('/dev/shm/{name}', 'w').write('a')")
    try:
        exists = f"import json, os; print(json.dumps(os.path.exists('/dev/shm/{name}')))"
        assert on(two_hosts, "a", exists) is True  # another process on a sees it
        assert on(two_hosts, "b", exists) is False
        assert not os.path.exists(f"/dev/shm/{name}")  # nor does the machine
    finally:
        holder.stdin.close()
        assert holder.wait(T) == 0
    # It went with nothing: host a's /dev/shm is its own tmpfs.
    assert not os.path.exists(f"/dev/shm/{name}")


def test_a_host_sees_only_its_own_processes(two_hosts):
    code = """
        import json, os
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        print(json.dumps({"pid": os.getpid(), "pids": pids,
                          "init": open("/proc/1/cmdline").read().replace("\\0", " ")}))
    """
    holder = _blocker(two_hosts, "b")
    try:
        a = on(two_hosts, "a", code)
        b = on(two_hosts, "b", code)
    finally:
        holder.stdin.close()
        holder.wait(T)
    machine = [p for p in os.listdir("/proc") if p.isdigit()]
    for side in (a, b):
        assert side["pids"][0] == 1 and "hostinit" in side["init"], side
        assert side["pid"] < 100 and side["pid"] in side["pids"], side
        assert len(side["pids"]) < len(machine), (side, len(machine))
    # Host a: its init and the reader; host b also the holder (and its run's process).
    assert len(a["pids"]) == 2, a
    assert len(b["pids"]) == 3, b


def test_each_host_has_only_loopback_and_its_veth_and_no_route_out(two_hosts):
    code = """
        import json, os, subprocess
        addr = json.loads(subprocess.run(["ip", "-j", "addr"], capture_output=True, check=True).stdout)
        route = json.loads(subprocess.run(["ip", "-j", "route"], capture_output=True, check=True).stdout)
        print(json.dumps({
            "sys": sorted(os.listdir("/sys/class/net")),
            "ifaces": {i["ifname"]: sorted(a["local"] + "/" + str(a["prefixlen"])
                                           for a in i["addr_info"] if a["family"] == "inet")
                       for i in addr},
            "up": {i["ifname"]: "UP" in i["flags"] for i in addr},
            "routes": sorted(r["dst"] for r in route),
        }))
    """
    for host in ("a", "b"):
        got = on(two_hosts, host, code)
        assert got["sys"] == ["eth0", "lo"], got
        assert got["ifaces"] == {"lo": ["127.0.0.1/8"], "eth0": [f"{two_hosts.address(host)}/24"]}, got
        assert all(got["up"].values()), got
        # One route, to the other host: no default route, nothing reaches past the bed.
        assert got["routes"] == ["10.77.0.0/24"], got
    # No interface of the bed is in the machine's namespace.
    assert two_hosts.name not in _root_links()


def test_each_host_knows_the_others_hardware_address_for_good(two_hosts):
    """Pinned neighbours: the machine's shared neighbour table (or a fault
    test dropping packets) cannot make the bed lose its ARP."""
    code = """
        import json, subprocess
        link = json.loads(subprocess.run(["ip", "-j", "link", "show", "eth0"],
                                         capture_output=True, check=True).stdout)
        neigh = json.loads(subprocess.run(["ip", "-j", "neigh", "show", "dev", "eth0"],
                                          capture_output=True, check=True).stdout)
        print(json.dumps({"mac": link[0]["address"],
                          "neigh": {n["dst"]: [n.get("lladdr"), n.get("state")] for n in neigh}}))
    """
    seen = {host: on(two_hosts, host, code) for host in ("a", "b")}
    for host, other in (("a", "b"), ("b", "a")):
        entry = seen[host]["neigh"].get(two_hosts.address(other))
        assert entry == [seen[other]["mac"], ["PERMANENT"]], seen


SERVER = """
    import hashlib, json, socket, sys
    port = int(sys.argv[1])
    srv = socket.create_server(("0.0.0.0", port))
    lo = socket.create_server(("127.0.0.1", port + 1))  # host a's own loopback
    print("listening", flush=True)
    conn, peer = srv.accept()
    h, n = hashlib.sha256(), 0
    buf = bytearray(1 << 20)
    while True:
        k = conn.recv_into(buf)
        if not k:
            break
        h.update(memoryview(buf)[:k]); n += k
    conn.sendall(json.dumps({"peer": peer[0], "bytes": n, "sha256": h.hexdigest()}).encode())
    conn.close()
"""

CLIENT = """
    import hashlib, json, socket, sys
    port = int(sys.argv[1])
    data = bytes(range(256)) * (32 << 12)  # 32 MiB
    try:
        socket.create_connection(("127.0.0.1", port + 1), timeout=5).close()
        loopback = "connected"
    except ConnectionRefusedError:
        loopback = "refused"
    s = socket.create_connection(("xh-a", port), timeout=20)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    reply = b""
    while chunk := s.recv(4096):
        reply += chunk
    print(json.dumps({"server": json.loads(reply), "sha256": hashlib.sha256(data).hexdigest(),
                      "bytes": len(data), "loopback": loopback}))
"""


def test_a_tcp_connection_from_b_to_xh_a_carries_the_bytes(two_hosts):
    port = two_hosts.port()
    server = two_hosts.popen("a", [PY, "-c", textwrap.dedent(SERVER), str(port)],
                             stdout=subprocess.PIPE)
    assert th.read_line(server, T) == "listening\n"
    got = on(two_hosts, "b", CLIENT, port)
    assert server.wait(T) == 0
    assert got["server"]["bytes"] == got["bytes"] == 32 << 20
    assert got["server"]["sha256"] == got["sha256"]
    assert got["server"]["peer"] == two_hosts.address("b")
    # b's 127.0.0.1 is b's own: a server on a's loopback is not there.
    assert got["loopback"] == "refused"


def test_run_passes_environment_working_directory_and_exit_status(two_hosts, tmp_path):
    env = dict(os.environ, PJRT_CROSSHOST_CREATE_OPTIONS="transport=tcp", XH_BED_PROBE="42",
               PYTHONPATH="/nowhere:" + os.environ.get("PYTHONPATH", ""))
    code = """
        import json, os, sys
        print(json.dumps({k: os.environ.get(k) for k in
                          ("PATH", "PYTHONPATH", "PJRT_CROSSHOST_CREATE_OPTIONS", "XH_BED_PROBE")}
                         | {"cwd": os.getcwd()}))
        sys.exit(int(sys.argv[1]))
    """
    r = two_hosts.run("b", [PY, "-c", textwrap.dedent(code), "7"], timeout=T, env=env)
    assert r.returncode == 7, r
    got = json.loads(r.stdout)
    for k in ("PATH", "PYTHONPATH", "PJRT_CROSSHOST_CREATE_OPTIONS", "XH_BED_PROBE"):
        assert got[k] == env[k], (k, got)
    assert got["cwd"] == os.getcwd()


def test_libucp_is_hidden_from_one_command_only(two_hosts):
    # A benchmark alternates UCX and hidden-UCX jobs on one bed: a run after
    # a hidden one must find the library again, and a run beside it too.
    lib = next((f for f in ("/usr/lib/x86_64-linux-gnu/libucp.so.0",
                            "/usr/lib/aarch64-linux-gnu/libucp.so.0") if os.path.exists(f)), None)
    if lib is None:
        pytest.skip("no system libucp to hide")
    size = [PY, "-c", "import os, sys; print(os.path.getsize(os.path.realpath(sys.argv[1])))", lib]
    whole = os.path.getsize(os.path.realpath(lib))
    assert whole > 0
    hidden = two_hosts.run("b", th.without_ucx(size), timeout=T)
    assert hidden.returncode == 0, hidden
    assert int(hidden.stdout) == 0, "the hidden command sees an empty library"
    after = two_hosts.run("b", size, timeout=T)
    assert after.returncode == 0, after
    assert int(after.stdout) == whole, "the next command on that host finds libucp whole"


def _host_pids(bed, host) -> list[int]:
    """The live processes of ``host`` (zombies, which have ended, left out)."""
    code = textwrap.dedent("""
        import json, os
        def live(p):
            try:
                return open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
            except OSError:
                return False
        print(json.dumps(sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and live(p))))
    """)
    r = bed.run(host, [PY, "-c", code], timeout=T)
    return json.loads(r.stdout)


def test_signals_to_the_run_reach_the_command_and_sigkill_kills_it(two_hosts):
    # SIGTERM to the pid the caller holds reaches the command (pid 1 of a
    # namespace would ignore it; the run's command is not pid 1).
    code = """
        import signal, sys
        signal.signal(signal.SIGTERM, lambda *a: (print("got TERM", flush=True), sys.exit(5)))
    """
    proc = _blocker(two_hosts, "a", code)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(T) == 5
    assert th.read_line(proc, T) == "got TERM\n"
    # SIGKILL of the caller's pid alone (not its group) kills the command too.
    proc = _blocker(two_hosts, "a")
    before = _host_pids(two_hosts, "a")
    assert len(before) == 3, before  # init, the blocker, the lister
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(T) == -signal.SIGKILL
    deadline = time.monotonic() + T
    while len(_host_pids(two_hosts, "a")) != 2:  # init + the lister
        assert time.monotonic() < deadline, _host_pids(two_hosts, "a")


def test_teardown_removes_everything_even_when_the_body_raised():
    with pytest.raises(RuntimeError, match="the body failed"):
        with th.TwoHostBed() as bed:
            name = bed.name
            procs = [_blocker(bed, host) for host in ("a", "b")]
            inits = [int(open(th.STATE_ROOT / name / f"pid-{h}").read().split()[0]) for h in "ab"]
            assert all(bed_part for bed_part in th.bed_exists(name).values())
            raise RuntimeError("the body failed")
    assert th.bed_exists(name) == {"netns_a": False, "netns_b": False, "state_dir": False}
    assert not [n for n in _netns_names() if n.startswith(name)]
    assert name not in _root_links()
    assert all(p.poll() is not None for p in procs)
    for pid in inits:  # the hosts' inits have exited: gone, or holding no namespace
        assert not _in_namespaces(pid), pid
    # And close() again is a no-op.
    bed.close()


def _in_namespaces(pid: int) -> bool:
    """Whether process ``pid`` exists and still holds its namespaces (an
    exiting process drops them before it is reaped)."""
    try:
        os.readlink(f"/proc/{pid}/ns/net")
        return True
    except OSError:
        return False


def _wait_gone(name: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while any(th.bed_exists(name).values()) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition, with a deadline
    return th.bed_exists(name)


def test_a_bed_whose_creator_is_sigkilled_is_deleted_by_its_watchdog(tmp_path):
    code = f"""
        import os, signal, sys
        sys.path.insert(0, {str(th.HERE)!r})
        import two_hosts as th
        bed = th.TwoHostBed().up()
        print(bed.name, flush=True)
        bed.popen("a", [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    r = subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=T)
    assert r.returncode == -signal.SIGKILL, r
    name = r.stdout.strip()
    assert name.startswith("xhbed")
    assert _wait_gone(name, T) == {"netns_a": False, "netns_b": False, "state_dir": False}


def test_reap_removes_a_bed_whose_creator_died_and_no_other():
    creator = subprocess.Popen([PY, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    dead = f"xhbed{creator.pid}-reap"
    other = f"xhtest{os.getpid()}"  # not of our naming: reap never touches it
    try:
        for name in (dead, other):
            r = subprocess.run([str(th.SCRIPT), "up", name], capture_output=True, text=True, timeout=T)
            assert r.returncode == 0, r.stderr
        with th.TwoHostBed() as live:  # its creator (this process) is alive
            assert f"reaping bed {dead}" not in th.reap()  # its creator still lives
            assert all(th.bed_exists(dead).values())
            creator.stdin.close()
            creator.wait(T)
            out = th.reap()
            assert f"reaping bed {dead}" in out, out
            assert th.bed_exists(dead) == {"netns_a": False, "netns_b": False, "state_dir": False}
            assert all(th.bed_exists(live.name).values())
            assert all(th.bed_exists(other).values())
    finally:
        if creator.poll() is None:
            creator.kill()
            creator.wait()
        for name in (dead, other):
            subprocess.run([str(th.SCRIPT), "down", name], capture_output=True, timeout=T)
    assert not any(th.bed_exists(other).values())


def test_down_refuses_a_bed_it_did_not_make():
    # A bed made by hand (e.g. xhb0 on a developer's machine) is never ours to
    # delete: down of a name without our state dir leaves its namespaces.
    name = f"xhhand{os.getpid()}"
    subprocess.run(["ip", "netns", "add", f"{name}-a"], check=True)
    try:
        r = subprocess.run([str(th.SCRIPT), "down", name], capture_output=True, text=True, timeout=T)
        assert r.returncode != 0 and "not made by" in r.stderr, r
        assert th.bed_exists(name)["netns_a"]
    finally:
        subprocess.run(["ip", "netns", "del", f"{name}-a"], check=True)


def test_check_says_ok_here():
    r = subprocess.run([str(th.SCRIPT), "check"], capture_output=True, text=True, timeout=T)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r
    assert not [n for n in _netns_names() if n.endswith("-chk-a")]
