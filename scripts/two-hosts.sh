#!/usr/bin/env bash
# Two "hosts" on one machine, for cross-host tests and benchmarks of the
# plugin: each host is its own network, mount, UTS, IPC and pid namespace,
# the two joined by one veth pair (10.77.0.1 = xh-a, 10.77.0.2 = xh-b).
#
#   scripts/two-hosts.sh check       can a bed be made here? (else exit 1 and a one-line reason)
#   scripts/two-hosts.sh up NAME     make bed NAME: namespaces NAME-a, NAME-b, both hosts up
#   scripts/two-hosts.sh run NAME a|b CMD...
#                                    run CMD on host a or b (all runs on a host share it:
#                                    /dev/shm, pids, hostname). This process stays the run
#                                    (exec): TERM, INT, HUP, QUIT, USR1, USR2 sent to it reach
#                                    CMD, SIGKILL of it kills CMD; its exit status is CMD's
#   scripts/two-hosts.sh down NAME   kill everything on the bed and delete it (idempotent)
#   scripts/two-hosts.sh reap        down every bed of ours whose creator is gone
#   scripts/two-hosts.sh list        the beds of ours that exist, one a line
#
# Beds are named xhbed<pid>-<suffix>: <pid> is the creating process (python_tests/two_hosts.py
# uses its own pid), so `reap` can tell a bed whose creator died (and whose cleanup did not
# run: SIGKILL, a crash) from one in use. Names of another form can be used with up/run/down,
# but reap never touches them, and down only deletes a bed that has our state dir: a bed made
# by hand (e.g. one named xhb0) is never ours to delete.
#
# Traffic stays on this machine: the namespaces have no route but 10.77.0.0/24 over their
# own veth and loopback, and no DNS server (names come from the bed's /etc/hosts), so
# nothing started on a host can reach any other address. Every bed uses the same two
# addresses; they live only inside that bed's namespaces, so beds never collide.
#
# Needs root, iproute2 (`ip`), util-linux (`unshare`, `nsenter`, `setpriv`, `mount`) and perl
# (Debian's perl-base, for the small init in scripts/bed-common.sh). `check` tests each, and
# that namespaces and veth pairs can really be made.
set -euo pipefail

SCRIPT="$(readlink -f "${BASH_SOURCE[0]}")"
BED_TAG=two-hosts
# State of each bed: hosts file, per-host boot ids, the init, who made it. Kept out of
# /tmp/<name> so that a hand-made bed's files are never ours.
STATE_ROOT="${XH_BED_STATE_ROOT:-/tmp/pjrt-crosshost-beds}"
OURS_RE='^xhbed([0-9]+)-[a-z0-9]+$'
BED_NS_RE='a|b'
HOST_ID_RE='a|b'
ADDR_A=10.77.0.1
ADDR_B=10.77.0.2
PREFIX_LEN=24
# Inside each host the veth end is simply eth0: interface names are per network namespace,
# and the pair is created directly inside the two namespaces (below), so no interface of a
# bed ever exists in the root namespace, even for a moment, and none can be left there.
IFACE=eth0

# What both beds share (the hosts' init, run, down, reap): scripts/bed-common.sh.
# shellcheck source=bed-common.sh
. "$(dirname "$SCRIPT")/bed-common.sh"

host_ns() { printf '%s-%s' "$1" "$2"; }

cmd_check() {
  check_base "network namespaces and veth pairs" \
    "ip: iproute2; unshare, nsenter, setpriv, mount: util-linux; perl: perl-base" \
    ip unshare nsenter setpriv mount perl
  check_probe "xhbed$$-chk-a" "a veth pair" "x0 type veth peer name x1"
  echo "ok"
}

cmd_up() {
  local name="$1" dir
  valid_name "$name"
  dir="$(state_dir "$name")"
  up_begin "$name" "$dir"

  # Two network namespaces: each host has its own interfaces, addresses, routes, ports and
  # abstract unix sockets, so its loopback is its own and a server bound on one host is
  # not reachable from the other but over the veth.
  ip netns add "$name-a"
  ip netns add "$name-b"
  # One veth pair, one end in each: the "wire" between the hosts. Made inside the
  # namespaces (see IFACE), so deleting them deletes it.
  ip link add "$IFACE" netns "$name-a" type veth peer name "$IFACE" netns "$name-b"
  ip -n "$name-a" addr add "$ADDR_A/$PREFIX_LEN" dev "$IFACE"
  ip -n "$name-b" addr add "$ADDR_B/$PREFIX_LEN" dev "$IFACE"
  # A fresh namespace's loopback is down: up, so each host has a working 127.0.0.1.
  ip -n "$name-a" link set lo up
  ip -n "$name-b" link set lo up
  ip -n "$name-a" link set "$IFACE" up
  ip -n "$name-b" link set "$IFACE" up
  # Each host knows the other's hardware address for good: the neighbour
  # table is shared by every namespace on the machine, and a full one (or
  # a fault test dropping packets) must not make the bed lose its ARP.
  local mac_a mac_b
  mac_a="$(ip -n "$name-a" -o link show "$IFACE" | sed -n 's/.*link\/ether \([0-9a-f:]*\).*/\1/p')"
  mac_b="$(ip -n "$name-b" -o link show "$IFACE" | sed -n 's/.*link\/ether \([0-9a-f:]*\).*/\1/p')"
  [ -n "$mac_a" ] && [ -n "$mac_b" ] || die "bed $name: cannot read the hosts' hardware addresses"
  ip -n "$name-a" neigh replace "$ADDR_B" lladdr "$mac_b" dev "$IFACE" nud permanent
  ip -n "$name-b" neigh replace "$ADDR_A" lladdr "$mac_a" dev "$IFACE" nud permanent
  # A freshly raised link keeps a tentative IPv6 link-local address for about
  # a second (duplicate address detection). UCX 1.13 opened in that window
  # finds the peer's TCP device unreachable ("Destination is unreachable",
  # measured); machines that are really hosts are long past it.
  local waited=0
  while [ -n "$(ip -n "$name-a" addr show tentative)$(ip -n "$name-b" addr show tentative)" ]; do
    [ "$waited" -lt 100 ] || die "bed $name: addresses still tentative after 10 s"
    sleep 0.1; waited=$((waited + 1))
  done

  # Both hosts name both: xh-a, xh-b resolve the same everywhere, like a cluster's hosts.
  write_host_files "$dir" "127.0.0.1 localhost"$'\n'"$ADDR_A xh-a"$'\n'"$ADDR_B xh-b"$'\n' a b
  start_hosts "$name" "$dir" a b
  up_done "$name"
}

cmd_run() {
  [ $# -ge 3 ] || die "usage: run NAME a|b CMD..."
  local name="$1" host="$2"
  shift 2
  valid_name "$name"
  [ "$host" = a ] || [ "$host" = b ] || die "host must be a or b, not '$host'"
  run_on_host "$name" "$host" "no bed $name, or its host $host is down (make one: $SCRIPT up $name)" "$@"
}

cmd_list() { our_beds; }

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  check) cmd_check ;;
  up) [ $# -eq 1 ] || die "usage: up NAME"; cmd_check >/dev/null; cmd_up "$1" ;;
  run) cmd_run "$@" ;;
  down) [ $# -eq 1 ] || die "usage: down NAME"; cmd_down "$1" ;;
  reap) cmd_reap ;;
  list) cmd_list ;;
  *) sed -n '2,16s/^# \{0,1\}//p' "$SCRIPT" >&2; exit 2 ;;
esac
