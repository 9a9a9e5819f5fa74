#!/usr/bin/env bash
# N "hosts" on one machine, for tests and benchmarks of the plugin at cluster
# scale: each host is its own network, mount, UTS, IPC and pid namespace, as on
# the two-host bed (scripts/two-hosts.sh), all joined by one Linux bridge.
# Host i is 10.78.0.<i+1>, named xh-<i>; the optional store host is 10.78.0.254,
# named xh-store (for a job's KV server or etcd).
#
#   scripts/n-hosts.sh check         can a bed be made here? (else exit 1 and a one-line reason)
#   scripts/n-hosts.sh up NAME N [store]
#                                    make bed NAME: hosts 0..N-1 (and the store host), all up
#   scripts/n-hosts.sh run NAME HOST CMD...
#                                    run CMD on HOST (0..N-1 or store); as two-hosts.sh run:
#                                    this process stays the run, signals reach CMD, SIGKILL of
#                                    it kills CMD, its exit status is CMD's
#   scripts/n-hosts.sh down NAME     kill everything on the bed and delete it (idempotent)
#   scripts/n-hosts.sh reap          down every bed of ours whose creator is gone
#   scripts/n-hosts.sh list          the beds of ours that exist, one a line
#
# Namespaces of bed NAME: NAME-h<i> for host i, NAME-store, and NAME-sw, the
# switch: a network namespace holding only the bridge (br0) and one port (p<i>,
# ps) per host, the other end of each host's eth0. No interface of a bed is ever
# in the machine's namespace; deleting NAME-sw deletes the bridge and its ports.
#
# Beds are named xhnet<pid>-<suffix>, <pid> the creating process
# (python_tests/n_hosts.py uses its own), so `reap` can tell a bed whose creator
# died from one in use; the prefix differs from the two-host bed's (xhbed), so
# neither script's reap touches the other's beds. `down` only deletes a bed that
# has our state dir.
#
# Addresses: 10.78.0.0/24, apart from the two-host bed's 10.77.0.0/24, with no
# route but that prefix and no DNS server (names come from each host's
# /etc/hosts, which names every host of the bed), so nothing reaches past the
# bed. Every neighbour (ARP) entry is pinned (`nud permanent`) in every host,
# and every host's MAC address on its bridge port (static fdb entry): the
# kernel's neighbour table is shared by all namespaces, and once it is full
# (gc_thresh3, 1024 entries, reached by a 32-host bed) ARP replies are lost;
# permanent entries are exempt from that limit and need no ARP at all. IPv6 is
# off on the bed's links (no duplicate address detection to wait for, no
# neighbour discovery entries); each host's loopback keeps ::1.
#
# Needs root, iproute2 (`ip`, `bridge`), util-linux (`unshare`, `nsenter`,
# `setpriv`, `mount`) and perl; `check` tests each, and that namespaces, veth
# pairs and bridges can really be made.
set -euo pipefail

SCRIPT="$(readlink -f "${BASH_SOURCE[0]}")"
BED_TAG=n-hosts
STATE_ROOT="${XH_NBED_STATE_ROOT:-/tmp/pjrt-crosshost-nbeds}"
OURS_RE='^xhnet([0-9]+)-[a-z0-9]+$'
BED_NS_RE='h[0-9]+|store|sw'
HOST_ID_RE='[0-9]+|store'
NET=10.78.0
PREFIX_LEN=24
STORE_OCTET=254
MAX_HOSTS=250
IFACE=eth0

# What both beds share (the hosts' init, run, down, reap): scripts/bed-common.sh.
# shellcheck source=bed-common.sh
. "$(dirname "$SCRIPT")/bed-common.sh"

# Host ids: 0..N-1, and "store". Their namespace, last address octet, port, name.
host_ns() { if [ "$2" = store ]; then printf '%s-store' "$1"; else printf '%s-h%s' "$1" "$2"; fi; }
host_octet() { if [ "$1" = store ]; then printf '%s' "$STORE_OCTET"; else printf '%s' "$(($1 + 1))"; fi; }
host_port() { if [ "$1" = store ]; then printf 'ps'; else printf 'p%s' "$1"; fi; }
host_mac() { printf '02:78:00:00:00:%02x' "$(host_octet "$1")"; }
host_name() { printf 'xh-%s' "$1"; }

cmd_check() {
  check_base "network namespaces, veth pairs and bridges" \
    "ip, bridge: iproute2; unshare, nsenter, setpriv, mount: util-linux; perl: perl-base" \
    ip bridge unshare nsenter setpriv mount perl
  check_probe "xhnet$$-chk-sw" "a bridge" "br0 type bridge" "a veth pair" "x0 type veth peer name x1"
  echo "ok"
}

cmd_up() {
  local name="$1" count="$2" with_store="$3" dir sw h hosts=()
  valid_name "$name"
  [[ "$count" =~ ^[0-9]+$ ]] && [ "$count" -ge 1 ] && [ "$count" -le "$MAX_HOSTS" ] \
    || die "the number of hosts must be 1..$MAX_HOSTS, not '$count'"
  dir="$(state_dir "$name")"
  sw="$name-sw"
  up_begin "$name" "$dir"
  for ((h = 0; h < count; h++)); do hosts+=("$h"); done
  [ "$with_store" = store ] && hosts+=(store)
  printf '%s\n' "${hosts[@]}" >"$dir/members"

  # The switch: one bridge, spanning tree off (ports forward at once), no
  # multicast snooping; IPv6 off on whatever is made in it.
  ip netns add "$sw"
  ip netns exec "$sw" sysctl -q -w net.ipv6.conf.default.disable_ipv6=1
  ip -n "$sw" link add br0 type bridge stp_state 0 mcast_snooping 0
  # Each host: a namespace with IPv6 off for links made in it, its eth0 one
  # end of a veth pair whose other end is its port on the bridge, made
  # directly in the two namespaces (so none is ever in the machine's).
  local ns sw_batch="" fdb_batch="" neigh_lines=""
  for h in "${hosts[@]}"; do
    ns="$(host_ns "$name" "$h")"
    ip netns add "$ns"
    ip netns exec "$ns" sysctl -q -w net.ipv6.conf.default.disable_ipv6=1
    ip link add "$IFACE" netns "$ns" address "$(host_mac "$h")" type veth \
      peer name "$(host_port "$h")" netns "$sw"
    sw_batch+="link set $(host_port "$h") master br0 up"$'\n'
    fdb_batch+="fdb replace $(host_mac "$h") dev $(host_port "$h") master static"$'\n'
    neigh_lines+="$h $NET.$(host_octet "$h") $(host_mac "$h")"$'\n'
  done
  sw_batch+="link set br0 up"$'\n'
  printf '%s' "$sw_batch" | ip -n "$sw" -batch -
  printf '%s' "$fdb_batch" | bridge -n "$sw" -batch -
  # In each host: loopback and eth0 up, its address, and every other host's
  # neighbour entry pinned (see the header).
  local batch other addr mac
  for h in "${hosts[@]}"; do
    batch="link set lo up"$'\n'"addr add $NET.$(host_octet "$h")/$PREFIX_LEN dev $IFACE"$'\n'
    batch+="link set $IFACE up"$'\n'
    while read -r other addr mac; do
      [ -n "$other" ] && [ "$other" != "$h" ] || continue
      batch+="neigh replace $addr lladdr $mac dev $IFACE nud permanent"$'\n'
    done <<<"$neigh_lines"
    printf '%s' "$batch" | ip -n "$(host_ns "$name" "$h")" -batch -
  done

  # Every host names every host, the same way.
  local names='127.0.0.1 localhost'$'\n'
  for h in "${hosts[@]}"; do names+="$NET.$(host_octet "$h") $(host_name "$h")"$'\n'; done
  write_host_files "$dir" "$names" "${hosts[@]}"
  start_hosts "$name" "$dir" "${hosts[@]}"
  up_done "$name"
}

cmd_run() {
  [ $# -ge 3 ] || die "usage: run NAME HOST CMD..."
  local name="$1" host="$2"
  shift 2
  valid_name "$name"
  [[ "$host" =~ ^($HOST_ID_RE)$ ]] || die "host must be a number or 'store', not '$host'"
  run_on_host "$name" "$host" "no bed $name, or it has no host $host, or that host is down" "$@"
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  check) cmd_check ;;
  up)
    [ $# -eq 2 ] || [ $# -eq 3 ] || die "usage: up NAME N [store]"
    [ $# -eq 2 ] || [ "$3" = store ] || die "usage: up NAME N [store]"
    cmd_check >/dev/null; cmd_up "$1" "$2" "${3:-}" ;;
  run) cmd_run "$@" ;;
  down) [ $# -eq 1 ] || die "usage: down NAME"; cmd_down "$1" ;;
  reap) cmd_reap ;;
  list) our_beds ;;
  *) sed -n '2,17s/^# \{0,1\}//p' "$SCRIPT" >&2; exit 2 ;;
esac
