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
# (Debian's perl-base, for the small init below). `check` tests each, and that namespaces and veth
# pairs can really be made.
set -euo pipefail

SCRIPT="$(readlink -f "${BASH_SOURCE[0]}")"
# State of each bed: hosts file, per-host boot ids, the init, who made it. Kept out of
# /tmp/<name> so that a hand-made bed's files are never ours.
STATE_ROOT="${XH_BED_STATE_ROOT:-/tmp/pjrt-crosshost-beds}"
ADDR_A=10.77.0.1
ADDR_B=10.77.0.2
PREFIX_LEN=24
# Inside each host the veth end is simply eth0: interface names are per network namespace,
# and the pair is created directly inside the two namespaces (below), so no interface of a
# bed ever exists in the root namespace, even for a moment, and none can be left there.
IFACE=eth0
OURS_RE='^xhbed([0-9]+)-[a-z0-9]+$'

die() { echo "two-hosts.sh: $*" >&2; exit 1; }

valid_name() {
  # A netns name becomes /run/netns/NAME-a; keep it a plain word.
  [[ "$1" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$ ]] || die "bad bed name '$1' (letters, digits, _ . -; at most 40)"
}

ns_exists() { [ -e "/run/netns/$1" ]; }

state_dir() { printf '%s/%s' "$STATE_ROOT" "$1"; }

# Start time (clock ticks since boot, /proc/PID/stat field 22) of a live, non-zombie
# process; empty when there is no such process. With the pid it identifies a process
# even after its pid is reused.
start_time() {
  local stat rest
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 0
  rest="${stat##*) }"             # fields from 3 on (the command may contain spaces and ')')
  set -- $rest
  [ "$1" = Z ] && return 0         # a zombie has finished
  shift 19                         # field 3 is $1; field 22 is $20
  printf '%s' "$1"
}

cmd_check() {
  [ "$(id -u)" = 0 ] || die "not root (network namespaces and veth pairs need root)"
  local c
  for c in ip unshare nsenter setpriv mount perl; do
    command -v "$c" >/dev/null 2>&1 || die "no '$c' on PATH (ip: iproute2; unshare, nsenter, setpriv, mount: util-linux; perl: perl-base)"
  done
  unshare --net --mount --uts --ipc --pid --fork true 2>/dev/null \
    || die "namespaces are not permitted here (unshare --net --mount --uts --ipc --pid failed)"
  # A named network namespace and a veth pair, made and deleted: what `up` does. The name
  # is one of ours, so if this is killed half-way `reap` removes it.
  local probe="xhbed$$-chk" out
  if ! out="$(ip netns add "$probe-a" 2>&1)"; then
    die "ip netns add is not permitted: $(echo "$out" | head -n1)"
  fi
  if ! out="$(ip -n "$probe-a" link add x0 type veth peer name x1 2>&1)"; then
    ip netns del "$probe-a" 2>/dev/null || true
    die "cannot make a veth pair: $(echo "$out" | head -n1)"
  fi
  ip netns del "$probe-a"
  echo "ok"
}

cmd_up() {
  local name="$1" dir
  valid_name "$name"
  dir="$(state_dir "$name")"
  mkdir -p "$STATE_ROOT"
  chmod 0755 "$STATE_ROOT" 2>/dev/null || true
  ns_exists "$name-a" || ns_exists "$name-b" && die "bed $name exists (its namespaces are there)"
  # mkdir is the lock: of two `up NAME`, one makes the dir and the other stops here.
  mkdir "$dir" 2>/dev/null || die "bed $name exists ($dir is there)"
  # Anything half-made is removed if a step fails.
  trap 'cmd_down "$name" >/dev/null 2>&1 || true' ERR
  # Who made it, for reap: the pid its name encodes (or our parent) and its start time.
  local owner="$PPID"
  [[ "$name" =~ $OURS_RE ]] && owner="${BASH_REMATCH[1]}"
  printf '%s %s\n' "$owner" "$(start_time "$owner")" >"$dir/owner"

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
  printf '127.0.0.1 localhost\n%s xh-a\n%s xh-b\n' "$ADDR_A" "$ADDR_B" >"$dir/hosts"
  # No DNS server: a name not in the hosts file fails at once (nothing listens on the
  # host's own 127.0.0.1:53) instead of being asked of a server outside.
  printf '# two-hosts bed: no DNS; names are in /etc/hosts\noptions attempts:1 timeout:1\n' >"$dir/resolv.conf"
  # Each host its own boot id: the plugin's host identity is hostname + boot id
  # (/proc/sys/kernel/random/boot_id, one per machine), so both must differ for the two to be
  # two hosts to it -- and to anything else that keys "same machine" on the boot id.
  cat /proc/sys/kernel/random/uuid >"$dir/boot_id-a"
  cat /proc/sys/kernel/random/uuid >"$dir/boot_id-b"
  chmod 0644 "$dir/hosts" "$dir/resolv.conf" "$dir/boot_id-a" "$dir/boot_id-b"
  write_init "$dir/init.pl"
  # The hosts: each its pid 1 in its own mount, UTS, IPC and pid namespace, inside its
  # network namespace (see write_init). pid-a, pid-b: their pids and start times.
  local h pid
  for h in a b; do
    ip netns exec "$name-$h" unshare --mount --uts --ipc --pid --propagation private -- \
      perl "$dir/init.pl" host "$h" "$dir" </dev/null
    read -r pid <"$dir/pid-$h"
    printf '%s %s\n' "$pid" "$(start_time "$pid")" >"$dir/pid-$h"
  done
  trap - ERR
  echo "$name"
}

# The processes behind a bed, all one perl program (init.pl) in different roles:
#
#   up:   launcher (role host, in the host's network, mount, UTS, IPC namespaces, made by
#         `ip netns exec` + `unshare`) forks the host's pid 1 and exits once pid 1 has set
#         the host up (setup.sh: /proc, hostname, boot id, /dev/shm, /etc/hosts) and says so.
#         pid 1 (role hostinit) then lives until `down`, holding the host's namespaces and
#         reaping orphans, as an init does (e.g. the plugin's shared-memory watchdog).
#   run:  `nsenter` into pid 1's namespaces (this very pid, so the caller's kill reaches it),
#         then role run forks CMD -- a process of the host's pid namespace -- forwards TERM,
#         INT, HUP, QUIT, USR1, USR2 to it, and exits with CMD's status (or 128 + the signal
#         that killed it). CMD has SIGKILL as parent-death signal: SIGKILL of the caller's pid
#         kills CMD too.
#
# So every run on host a is on the same host: one /dev/shm, one pid namespace, one hostname.
#
# Why not `unshare --fork --kill-child` per run with CMD as pid 1: unshare's parent blocks
# SIGTERM and SIGINT while its child runs, and a pid namespace's init gets from outside only
# signals it handles (SIGTERM to a Python pid 1 is ignored), so `kill PID` would do nothing;
# and two runs on "host a" would not share a host.
write_init() {
  cat >"$1" <<'PERL'
use strict;
use warnings;
use POSIX ();
my $role = shift @ARGV;
if ($role eq 'hostinit') {
    # pid 1 of a host: reap whatever ends; signals from outside the host (but SIGKILL, which
    # `down` sends) do not reach an init without handlers.
    $SIG{CHLD} = sub { 1 while waitpid(-1, POSIX::WNOHANG()) > 0 };
    close STDIN; close STDOUT; close STDERR;
    POSIX::pause() while 1;
}
if ($role eq 'host') {
    # The launcher: fork pid 1, wait until its setup says "ready" on a pipe, record its pid.
    my ($host, $dir) = @ARGV;
    pipe(my $r, my $w) or die "two-hosts: pipe: $!\n";
    my $pid = fork();
    die "two-hosts: fork: $!\n" unless defined $pid;
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
        die "two-hosts: host $host did not come up (setup exited " . ($? >> 8) . ")\n";
    }
    open(my $f, '>', "$dir/pid-$host.tmp") or die "two-hosts: $dir/pid-$host: $!\n";
    print $f "$pid\n";
    close $f;
    rename("$dir/pid-$host.tmp", "$dir/pid-$host") or die "two-hosts: rename: $!\n";
    POSIX::_exit(0);
}
die "two-hosts: unknown role $role\n" unless $role eq 'run';
my @cmd = @ARGV;
my $child = 0;
my @forward = qw(TERM INT HUP QUIT USR1 USR2);
# Signals arriving before the fork is done wait (blocked), then go to the child.
my $set = POSIX::SigSet->new(map { POSIX->can("SIG$_")->() } @forward);
POSIX::sigprocmask(POSIX::SIG_BLOCK(), $set);
for my $sig (@forward) { $SIG{$sig} = sub { kill $sig, $child if $child > 0 }; }
$child = fork();
die "two-hosts run: fork: $!\n" unless defined $child;
if ($child == 0) {
    $SIG{$_} = 'DEFAULT' for @forward;
    POSIX::sigprocmask(POSIX::SIG_UNBLOCK(), $set);
    exec('setpriv', '--pdeathsig', 'KILL', '--', @cmd)
        or do { print STDERR "two-hosts run: setpriv: $!\n"; POSIX::_exit(127) };
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
  # pid 1's setup, as /bin/sh setup.sh HOST DIR with fd 3 the launcher's pipe: mounts in
  # the host's own mount namespace (private propagation: none of them is seen outside).
  cat >"$(dirname "$1")/setup.sh" <<'SH'
set -e
host="$1"; dir="$2"
# /proc of this pid namespace: ps, /proc/<pid> and the plugin's pid checks see only this host.
mount -t proc proc /proc
# This host's boot id (see up), over the machine's.
mount --bind "$dir/boot_id-$host" /proc/sys/kernel/random/boot_id
# Own UTS namespace: own hostname (the other half of the plugin's host identity).
echo "xh-$host" >/proc/sys/kernel/hostname
# Own /dev/shm: POSIX shared memory of one host is invisible to the other (and to the
# machine), so neither the plugin nor UCX (its posix/sysv transports; SysV is per IPC
# namespace) can find a same-host shortcut; the tmpfs and what is in it vanish with the host.
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
  [ $# -ge 3 ] || die "usage: run NAME a|b CMD..."
  local name="$1" host="$2" dir pid
  shift 2
  valid_name "$name"
  [ "$host" = a ] || [ "$host" = b ] || die "host must be a or b, not '$host'"
  dir="$(state_dir "$name")"
  pid="$(host_pid "$dir" "$host")"
  [ -n "$pid" ] || die "no bed $name, or its host $host is down (make one: $SCRIPT up $name)"
  # Into the host's namespaces: network (lo + eth0), mount (/proc, /dev/shm, /etc/hosts, a
  # /sys showing only its interfaces), UTS, IPC, and pid for the children: -F, no fork, so
  # this process (the caller's) stays in the machine's pid namespace and can be signalled,
  # and the child it forks is a process of the host. The environment is kept, the working
  # directory too (--wd: entering a mount namespace would otherwise move it to /).
  #   pid + IPC + UTS namespaces: nothing on one host, UCX included, can see the other
  #   host's processes or find a same-host shortcut (shared memory: /dev/shm and SysV are
  #   private; CMA, process_vm_readv, needs the peer's pid, which is not visible), and the
  #   plugin's host identity (hostname + boot id) differs between the two.
  exec nsenter --target "$pid" --net --mount --uts --ipc --pid --no-fork --wd="$(pwd -P)" -- \
    perl "$dir/init.pl" run "$@"
}

cmd_down() {
  local name="$1" dir h pid pids deadline
  valid_name "$name"
  dir="$(state_dir "$name")"
  if [ ! -d "$dir" ] && ! [[ "$name" =~ $OURS_RE ]]; then
    # Not made by this script (e.g. a bed made by hand): never ours to delete.
    if ns_exists "$name-a" || ns_exists "$name-b"; then
      die "bed $name was not made by $SCRIPT (no $dir); not deleting it"
    fi
    return 0
  fi
  # Kill every process on the bed first: a network namespace lives on, unnamed, while any
  # process is in it, and with it its veth. A host's pid 1 first: with it every process of
  # its pid namespace dies; then whatever else is in the network namespaces (a run's
  # nsenter'd parent, an `ip netns exec` of someone's).
  for h in a b; do
    pid="$(host_pid "$dir" "$h")"
    [ -z "$pid" ] || kill -KILL "$pid" 2>/dev/null || true
  done
  for h in a b; do
    ns_exists "$name-$h" || continue
    pids="$(ip netns pids "$name-$h" 2>/dev/null || true)"
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
  done
  deadline=$(( $(date +%s) + 10 ))
  for h in a b; do
    # Until no process is left in the namespace (a dying process leaves it before it is
    # reaped: a host's pid 1 may wait for its namespace's last zombies a moment longer, but
    # holds none of the host's namespaces, its /dev/shm, or the veth any more).
    while ns_exists "$name-$h" && [ -n "$(ip netns pids "$name-$h" 2>/dev/null || true)" ]; do
      [ "$(date +%s)" -lt "$deadline" ] || { echo "two-hosts.sh: processes on $name-$h outlive SIGKILL" >&2; break; }
      sleep 0.05
    done
    # Deleting the namespace deletes its end of the veth, and with it the pair.
    if ns_exists "$name-$h"; then
      ip netns del "$name-$h" 2>/dev/null || true
    fi
  done
  rm -rf "$dir"
  ! ns_exists "$name-a" && ! ns_exists "$name-b" || die "bed $name: a namespace could not be deleted"
}

# Our beds: from the namespace names (NAME-a, NAME-b) and the state dirs.
our_beds() {
  {
    ip netns list 2>/dev/null | awk '{print $1}' | sed -n 's/-[ab]$//p'
    [ -d "$STATE_ROOT" ] && ls -1 "$STATE_ROOT"
  } | grep -E "$OURS_RE" | sort -u || true
}

cmd_list() { our_beds; }

cmd_reap() {
  local name pid recorded now
  for name in $(our_beds); do
    [[ "$name" =~ $OURS_RE ]] || continue
    pid="${BASH_REMATCH[1]}"
    now="$(start_time "$pid")"
    if [ -n "$now" ]; then
      # The pid is alive; it is the creator unless the bed recorded another start time.
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
  up) [ $# -eq 1 ] || die "usage: up NAME"; cmd_check >/dev/null; cmd_up "$1" ;;
  run) cmd_run "$@" ;;
  down) [ $# -eq 1 ] || die "usage: down NAME"; cmd_down "$1" ;;
  reap) cmd_reap ;;
  list) cmd_list ;;
  *) sed -n '2,16s/^# \{0,1\}//p' "$SCRIPT" >&2; exit 2 ;;
esac
