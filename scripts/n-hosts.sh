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
STATE_ROOT="${XH_NBED_STATE_ROOT:-/tmp/pjrt-crosshost-nbeds}"
NET=10.78.0
PREFIX_LEN=24
STORE_OCTET=254
MAX_HOSTS=250
IFACE=eth0
OURS_RE='^xhnet([0-9]+)-[a-z0-9]+$'

die() { echo "n-hosts.sh: $*" >&2; exit 1; }

valid_name() {
  # A netns name becomes /run/netns/NAME-h<i>; keep it a plain word.
  [[ "$1" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$ ]] || die "bad bed name '$1' (letters, digits, _ . -; at most 40)"
}

ns_exists() { [ -e "/run/netns/$1" ]; }

state_dir() { printf '%s/%s' "$STATE_ROOT" "$1"; }

# Host ids: 0..N-1, and "store". Their namespace, last address octet, port, name.
host_ns() { if [ "$2" = store ]; then printf '%s-store' "$1"; else printf '%s-h%s' "$1" "$2"; fi; }
host_octet() { if [ "$1" = store ]; then printf '%s' "$STORE_OCTET"; else printf '%s' "$(($1 + 1))"; fi; }
host_port() { if [ "$1" = store ]; then printf 'ps'; else printf 'p%s' "$1"; fi; }
host_mac() { printf '02:78:00:00:00:%02x' "$(host_octet "$1")"; }
host_name() { printf 'xh-%s' "$1"; }

# The bed's namespaces that exist (hosts, store host, switch), one a line.
bed_namespaces() {
  ip netns list 2>/dev/null | awk -v p="$1-" '
    index($1, p) == 1 { rest = substr($1, length(p) + 1)
      if (rest ~ /^(h[0-9]+|store|sw)$/) print $1 }'
}

# Start time (clock ticks since boot, /proc/PID/stat field 22) of a live,
# non-zombie process; empty when there is none. With the pid it identifies a
# process even after its pid is reused.
start_time() {
  local stat rest
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 0
  rest="${stat##*) }"
  set -- $rest
  [ "$1" = Z ] && return 0
  shift 19
  printf '%s' "$1"
}

cmd_check() {
  [ "$(id -u)" = 0 ] || die "not root (network namespaces, veth pairs and bridges need root)"
  local c
  for c in ip bridge unshare nsenter setpriv mount perl; do
    command -v "$c" >/dev/null 2>&1 || die "no '$c' on PATH (ip, bridge: iproute2; unshare, nsenter, setpriv, mount: util-linux; perl: perl-base)"
  done
  unshare --net --mount --uts --ipc --pid --fork true 2>/dev/null \
    || die "namespaces are not permitted here (unshare --net --mount --uts --ipc --pid failed)"
  # What `up` makes, made and deleted; named as ours, so `reap` removes it if
  # this is killed half-way.
  local probe="xhnet$$-chk" out
  if ! out="$(ip netns add "$probe-sw" 2>&1)"; then
    die "ip netns add is not permitted: $(echo "$out" | head -n1)"
  fi
  if ! out="$(ip -n "$probe-sw" link add br0 type bridge 2>&1)"; then
    ip netns del "$probe-sw" 2>/dev/null || true
    die "cannot make a bridge: $(echo "$out" | head -n1)"
  fi
  if ! out="$(ip -n "$probe-sw" link add x0 type veth peer name x1 2>&1)"; then
    ip netns del "$probe-sw" 2>/dev/null || true
    die "cannot make a veth pair: $(echo "$out" | head -n1)"
  fi
  ip netns del "$probe-sw"
  echo "ok"
}

cmd_up() {
  local name="$1" count="$2" with_store="$3" dir sw h hosts=()
  valid_name "$name"
  [[ "$count" =~ ^[0-9]+$ ]] && [ "$count" -ge 1 ] && [ "$count" -le "$MAX_HOSTS" ] \
    || die "the number of hosts must be 1..$MAX_HOSTS, not '$count'"
  dir="$(state_dir "$name")"
  sw="$name-sw"
  mkdir -p "$STATE_ROOT"
  chmod 0755 "$STATE_ROOT" 2>/dev/null || true
  [ -z "$(bed_namespaces "$name")" ] || die "bed $name exists (its namespaces are there)"
  # mkdir is the lock: of two `up NAME`, one makes the dir and the other stops here.
  mkdir "$dir" 2>/dev/null || die "bed $name exists ($dir is there)"
  # Anything half-made is removed if a step fails (die included: an EXIT trap).
  UP_NAME="$name"
  trap 'cmd_down "$UP_NAME" >/dev/null 2>&1 || true' EXIT
  local owner="$PPID"
  [[ "$name" =~ $OURS_RE ]] && owner="${BASH_REMATCH[1]}"
  printf '%s %s\n' "$owner" "$(start_time "$owner")" >"$dir/owner"
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
  {
    printf '127.0.0.1 localhost\n'
    for h in "${hosts[@]}"; do printf '%s.%s %s\n' "$NET" "$(host_octet "$h")" "$(host_name "$h")"; done
  } >"$dir/hosts"
  printf '# n-hosts bed: no DNS; names are in /etc/hosts\noptions attempts:1 timeout:1\n' >"$dir/resolv.conf"
  # Each host its own boot id: the plugin's host identity is hostname + boot id.
  for h in "${hosts[@]}"; do cat /proc/sys/kernel/random/uuid >"$dir/boot_id-$h"; done
  chmod 0644 "$dir"/hosts "$dir"/resolv.conf "$dir"/boot_id-*
  write_init "$dir/init.pl"
  # The hosts' inits, started side by side (see two-hosts.sh for the roles).
  local launchers=() failed=""
  for h in "${hosts[@]}"; do
    ip netns exec "$(host_ns "$name" "$h")" unshare --mount --uts --ipc --pid --propagation private -- \
      perl "$dir/init.pl" host "$h" "$dir" </dev/null &
    launchers+=("$!")
  done
  local i=0 pid
  for h in "${hosts[@]}"; do
    wait "${launchers[$i]}" || failed+=" $h"
    i=$((i + 1))
  done
  [ -z "$failed" ] || die "bed $name: hosts did not come up:$failed"
  for h in "${hosts[@]}"; do
    read -r pid <"$dir/pid-$h"
    printf '%s %s\n' "$pid" "$(start_time "$pid")" >"$dir/pid-$h"
  done
  trap - EXIT
  echo "$name"
}

# The perl program behind a bed, roles host (launcher), hostinit (a host's pid
# 1) and run (CMD on a host): the same as two-hosts.sh's, which explains them.
write_init() {
  cat >"$1" <<'PERL'
use strict;
use warnings;
use POSIX ();
my $role = shift @ARGV;
if ($role eq 'hostinit') {
    $SIG{CHLD} = sub { 1 while waitpid(-1, POSIX::WNOHANG()) > 0 };
    close STDIN; close STDOUT; close STDERR;
    POSIX::pause() while 1;
}
if ($role eq 'host') {
    my ($host, $dir) = @ARGV;
    pipe(my $r, my $w) or die "n-hosts: pipe: $!\n";
    my $pid = fork();
    die "n-hosts: fork: $!\n" unless defined $pid;
    if ($pid == 0) {
        close $r;
        POSIX::dup2(fileno($w), 3) or POSIX::_exit(126);
        POSIX::setsid();
        exec('/bin/sh', "$dir/setup.sh", $host, $dir) or POSIX::_exit(127);
    }
    close $w;
    my $line = <$r> // '';
    if ($line ne "ready\n") {
        waitpid($pid, 0);
        die "n-hosts: host $host did not come up (setup exited " . ($? >> 8) . ")\n";
    }
    open(my $f, '>', "$dir/pid-$host.tmp") or die "n-hosts: $dir/pid-$host: $!\n";
    print $f "$pid\n";
    close $f;
    rename("$dir/pid-$host.tmp", "$dir/pid-$host") or die "n-hosts: rename: $!\n";
    POSIX::_exit(0);
}
die "n-hosts: unknown role $role\n" unless $role eq 'run';
my @cmd = @ARGV;
my $child = 0;
my @forward = qw(TERM INT HUP QUIT USR1 USR2);
my $set = POSIX::SigSet->new(map { POSIX->can("SIG$_")->() } @forward);
POSIX::sigprocmask(POSIX::SIG_BLOCK(), $set);
for my $sig (@forward) { $SIG{$sig} = sub { kill $sig, $child if $child > 0 }; }
$child = fork();
die "n-hosts run: fork: $!\n" unless defined $child;
if ($child == 0) {
    $SIG{$_} = 'DEFAULT' for @forward;
    POSIX::sigprocmask(POSIX::SIG_UNBLOCK(), $set);
    exec('setpriv', '--pdeathsig', 'KILL', '--', @cmd)
        or do { print STDERR "n-hosts run: setpriv: $!\n"; POSIX::_exit(127) };
}
POSIX::sigprocmask(POSIX::SIG_UNBLOCK(), $set);
while (1) {
    my $pid = waitpid($child, 0);
    if ($pid == $child) {
        my $st = $?;
        POSIX::_exit(($st & 127) ? 128 + ($st & 127) : ($st >> 8));
    }
    next if $pid < 0 && $!{EINTR};
    POSIX::_exit(1);
}
PERL
  # pid 1's setup, as /bin/sh setup.sh HOST DIR with fd 3 the launcher's pipe:
  # /proc of the host's pid namespace, its boot id, hostname, a private
  # /dev/shm (no same-host shortcut for the plugin or UCX), the bed's
  # /etc/hosts and resolv.conf; all in the host's own mount namespace.
  cat >"$(dirname "$1")/setup.sh" <<'SH'
set -e
host="$1"; dir="$2"
mount -t proc proc /proc
mount --bind "$dir/boot_id-$host" /proc/sys/kernel/random/boot_id
echo "xh-$host" >/proc/sys/kernel/hostname
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount --bind "$dir/hosts" /etc/hosts
if [ -e /etc/resolv.conf ]; then mount --bind "$dir/resolv.conf" /etc/resolv.conf; fi
echo ready >&3
exec 3>&- </dev/null >/dev/null 2>&1
exec perl "$dir/init.pl" hostinit
SH
}

# The root-namespace pid of a host's pid 1, when it is alive (and the one the bed started).
host_pid() {
  local dir="$1" host="$2" pid st
  [ -f "$dir/pid-$host" ] && read -r pid st <"$dir/pid-$host" || return 0
  [ -n "$pid" ] && [ -n "$(start_time "$pid")" ] && [ "$(start_time "$pid")" = "$st" ] && printf '%s' "$pid"
  return 0
}

cmd_run() {
  [ $# -ge 3 ] || die "usage: run NAME HOST CMD..."
  local name="$1" host="$2" dir pid
  shift 2
  valid_name "$name"
  [[ "$host" =~ ^([0-9]+|store)$ ]] || die "host must be a number or 'store', not '$host'"
  dir="$(state_dir "$name")"
  pid="$(host_pid "$dir" "$host")"
  [ -n "$pid" ] || die "no bed $name, or it has no host $host, or that host is down"
  # Into the host's namespaces, no fork (see two-hosts.sh run).
  exec nsenter --target "$pid" --net --mount --uts --ipc --pid --no-fork --wd="$(pwd -P)" -- \
    perl "$dir/init.pl" run "$@"
}

cmd_down() {
  local name="$1" dir f pid pids namespaces ns deadline
  valid_name "$name"
  dir="$(state_dir "$name")"
  namespaces="$(bed_namespaces "$name")"
  if [ ! -d "$dir" ] && ! [[ "$name" =~ $OURS_RE ]]; then
    [ -z "$namespaces" ] || die "bed $name was not made by $SCRIPT (no $dir); not deleting it"
    return 0
  fi
  # Every host's pid 1 first (with it every process of its pid namespace),
  # then whatever else is in the bed's network namespaces.
  for f in "$dir"/pid-*; do
    [ -e "$f" ] || continue
    f="${f##*/pid-}"
    [[ "$f" =~ ^([0-9]+|store)$ ]] || continue
    pid="$(host_pid "$dir" "$f")"
    [ -z "$pid" ] || kill -KILL "$pid" 2>/dev/null || true
  done
  for ns in $namespaces; do
    pids="$(ip netns pids "$ns" 2>/dev/null || true)"
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
  done
  deadline=$(( $(date +%s) + 10 ))
  for ns in $namespaces; do
    while ns_exists "$ns" && [ -n "$(ip netns pids "$ns" 2>/dev/null || true)" ]; do
      [ "$(date +%s)" -lt "$deadline" ] || { echo "n-hosts.sh: processes on $ns outlive SIGKILL" >&2; break; }
      sleep 0.05
    done
  done
  # The hosts (each deletion takes its veth pair), then the switch (its bridge).
  for ns in $namespaces; do
    [ "$ns" = "$name-sw" ] || ip netns del "$ns" 2>/dev/null || true
  done
  ! ns_exists "$name-sw" || ip netns del "$name-sw" 2>/dev/null || true
  rm -rf "$dir"
  [ -z "$(bed_namespaces "$name")" ] || die "bed $name: a namespace could not be deleted"
}

# Our beds: from the namespace names and the state dirs.
our_beds() {
  {
    ip netns list 2>/dev/null | awk '{print $1}' | sed -n -E 's/-(h[0-9]+|store|sw)$//p'
    [ -d "$STATE_ROOT" ] && ls -1 "$STATE_ROOT"
  } | grep -E "$OURS_RE" | sort -u || true
}

cmd_reap() {
  local name pid recorded now
  for name in $(our_beds); do
    [[ "$name" =~ $OURS_RE ]] || continue
    pid="${BASH_REMATCH[1]}"
    now="$(start_time "$pid")"
    if [ -n "$now" ]; then
      recorded="$(awk '{print $2}' "$(state_dir "$name")/owner" 2>/dev/null || true)"
      if [ -z "$recorded" ] || [ "$recorded" = "$now" ]; then
        continue
      fi
    fi
    echo "reaping bed $name (creator $pid is gone)"
    cmd_down "$name" || true
  done
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
