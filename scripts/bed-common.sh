# What the two test beds share: scripts/two-hosts.sh (two hosts on a veth) and
# scripts/n-hosts.sh (N hosts on a bridge) source this file. Not a command.
#
# Each bed script sets, before sourcing:
#   SCRIPT        the script's own path (for messages and its usage text)
#   BED_TAG       its short name in messages: two-hosts, n-hosts
#   STATE_ROOT    where its beds' state dirs live
#   OURS_RE       the names of its own beds (group 1: the creator's pid); the
#                 prefixes differ (xhbed, xhnet), so one script's reap never
#                 touches the other's beds
#   BED_NS_RE     the suffixes of a bed's namespaces after NAME- (a|b; h<i>, store, sw)
#   HOST_ID_RE    a host id as `run` takes it and pid-<host> files name it
# and defines host_ns NAME HOST (the host's network namespace).
#
# A host is its own network, mount, UTS, IPC and pid namespace: pid 1 of the
# host (init.pl, role hostinit) holds them until `down`; `run` enters them.

die() { echo "$BED_TAG.sh: $*" >&2; exit 1; }

valid_name() {
  # A netns name becomes /run/netns/NAME-<host>; keep it a plain word.
  [[ "$1" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$ ]] || die "bad bed name '$1' (letters, digits, _ . -; at most 40)"
}

ns_exists() { [ -e "/run/netns/$1" ]; }

state_dir() { printf '%s/%s' "$STATE_ROOT" "$1"; }

# The bed's namespaces that exist, one a line.
bed_namespaces() {
  ip netns list 2>/dev/null | awk -v p="$1-" -v re="^($BED_NS_RE)\$" '
    index($1, p) == 1 { rest = substr($1, length(p) + 1)
      if (rest ~ re) print $1 }'
}

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

# `check`, the common part: root (WHAT_NEEDS_ROOT says what needs it), each TOOL
# on PATH (TOOLS_HINT: which package has it), namespaces permitted.
check_base() {
  [ "$(id -u)" = 0 ] || die "not root ($1 need root)"
  local hint="$2" c
  shift 2
  for c in "$@"; do
    command -v "$c" >/dev/null 2>&1 || die "no '$c' on PATH ($hint)"
  done
  unshare --net --mount --uts --ipc --pid --fork true 2>/dev/null \
    || die "namespaces are not permitted here (unshare --net --mount --uts --ipc --pid failed)"
}

# What `up` makes, made and deleted: network namespace NS, and in it, for each
# pair WHAT LINK_ARGS, `ip link add LINK_ARGS` (or die "cannot make WHAT"). NS
# is named as ours, so if this is killed half-way `reap` removes it.
check_probe() {
  local ns="$1" out
  shift
  if ! out="$(ip netns add "$ns" 2>&1)"; then
    die "ip netns add is not permitted: $(echo "$out" | head -n1)"
  fi
  while [ $# -ge 2 ]; do
    # shellcheck disable=SC2086 # LINK_ARGS are words
    if ! out="$(ip -n "$ns" link add $2 2>&1)"; then
      ip netns del "$ns" 2>/dev/null || true
      die "cannot make $1: $(echo "$out" | head -n1)"
    fi
    shift 2
  done
  ip netns del "$ns"
}

# The start of `up NAME` (state dir DIR): refuses a bed that exists, takes the
# lock, arranges that anything half-made is removed if a step fails (die
# included: an EXIT trap; up_done lifts it), and records who made the bed.
up_begin() {
  local name="$1" dir="$2"
  mkdir -p "$STATE_ROOT"
  chmod 0755 "$STATE_ROOT" 2>/dev/null || true
  [ -z "$(bed_namespaces "$name")" ] || die "bed $name exists (its namespaces are there)"
  # mkdir is the lock: of two `up NAME`, one makes the dir and the other stops here.
  mkdir "$dir" 2>/dev/null || die "bed $name exists ($dir is there)"
  UP_NAME="$name"
  trap 'cmd_down "$UP_NAME" >/dev/null 2>&1 || true' EXIT
  # Who made it, for reap: the pid its name encodes (or our parent) and its start time.
  local owner="$PPID"
  [[ "$name" =~ $OURS_RE ]] && owner="${BASH_REMATCH[1]}"
  printf '%s %s\n' "$owner" "$(start_time "$owner")" >"$dir/owner"
}

up_done() {
  trap - EXIT
  echo "$1"
}

# The hosts' files in DIR, HOSTS_FILE the bed's /etc/hosts (every host names
# every host, the same way), for each HOST: resolv.conf, a boot id of its own,
# the init (write_init).
write_host_files() {
  local dir="$1" h
  printf '%s' "$2" >"$dir/hosts"
  shift 2
  # No DNS server: a name not in the hosts file fails at once (nothing listens on the
  # host's own 127.0.0.1:53) instead of being asked of a server outside.
  printf '# %s bed: no DNS; names are in /etc/hosts\noptions attempts:1 timeout:1\n' "$BED_TAG" >"$dir/resolv.conf"
  # Each host its own boot id: the plugin's host identity is hostname + boot id
  # (/proc/sys/kernel/random/boot_id, one per machine), so they must differ for the
  # hosts to be hosts to it -- and to anything else that keys "same machine" on the boot id.
  for h in "$@"; do cat /proc/sys/kernel/random/uuid >"$dir/boot_id-$h"; done
  chmod 0644 "$dir"/hosts "$dir"/resolv.conf "$dir"/boot_id-*
  write_init "$dir/init.pl"
}

# The hosts of bed NAME (state dir DIR), each its pid 1 in its own mount, UTS, IPC
# and pid namespace, inside its network namespace (see write_init), started side by
# side. pid-<host>: their pids and start times.
start_hosts() {
  local name="$1" dir="$2" h i=0 pid failed="" launchers=()
  shift 2
  for h in "$@"; do
    ip netns exec "$(host_ns "$name" "$h")" unshare --mount --uts --ipc --pid --propagation private -- \
      perl "$dir/init.pl" host "$h" "$dir" </dev/null &
    launchers+=("$!")
  done
  for h in "$@"; do
    wait "${launchers[$i]}" || failed+=" $h"
    i=$((i + 1))
  done
  [ -z "$failed" ] || die "bed $name: hosts did not come up:$failed"
  for h in "$@"; do
    read -r pid <"$dir/pid-$h"
    printf '%s %s\n' "$pid" "$(start_time "$pid")" >"$dir/pid-$h"
  done
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
# So every run on a host is on the same host: one /dev/shm, one pid namespace, one hostname.
#
# Why not `unshare --fork --kill-child` per run with CMD as pid 1: unshare's parent blocks
# SIGTERM and SIGINT while its child runs, and a pid namespace's init gets from outside only
# signals it handles (SIGTERM to a Python pid 1 is ignored), so `kill PID` would do nothing;
# and two runs on one host would not share a host.
write_init() {
  sed "s/@TAG@/$BED_TAG/g" >"$1" <<'PERL'
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
    pipe(my $r, my $w) or die "@TAG@: pipe: $!\n";
    my $pid = fork();
    die "@TAG@: fork: $!\n" unless defined $pid;
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
        die "@TAG@: host $host did not come up (setup exited " . ($? >> 8) . ")\n";
    }
    open(my $f, '>', "$dir/pid-$host.tmp") or die "@TAG@: $dir/pid-$host: $!\n";
    print $f "$pid\n";
    close $f;
    rename("$dir/pid-$host.tmp", "$dir/pid-$host") or die "@TAG@: rename: $!\n";
    POSIX::_exit(0);
}
die "@TAG@: unknown role $role\n" unless $role eq 'run';
my @cmd = @ARGV;
my $child = 0;
my @forward = qw(TERM INT HUP QUIT USR1 USR2);
# Signals arriving before the fork is done wait (blocked), then go to the child.
my $set = POSIX::SigSet->new(map { POSIX->can("SIG$_")->() } @forward);
POSIX::sigprocmask(POSIX::SIG_BLOCK(), $set);
for my $sig (@forward) { $SIG{$sig} = sub { kill $sig, $child if $child > 0 }; }
$child = fork();
die "@TAG@ run: fork: $!\n" unless defined $child;
if ($child == 0) {
    $SIG{$_} = 'DEFAULT' for @forward;
    POSIX::sigprocmask(POSIX::SIG_UNBLOCK(), $set);
    exec('setpriv', '--pdeathsig', 'KILL', '--', @cmd)
        or do { print STDERR "@TAG@ run: setpriv: $!\n"; POSIX::_exit(127) };
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
# This host's boot id (see write_host_files), over the machine's.
mount --bind "$dir/boot_id-$host" /proc/sys/kernel/random/boot_id
# Own UTS namespace: own hostname (the other half of the plugin's host identity).
echo "xh-$host" >/proc/sys/kernel/hostname
# Own /dev/shm: POSIX shared memory of one host is invisible to the others (and to the
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

# `run NAME HOST CMD...` once NAME and HOST are checked: becomes the run (exec), or
# dies with MISSING when the bed has no such host up.
run_on_host() {
  local name="$1" host="$2" missing="$3" dir pid
  shift 3
  dir="$(state_dir "$name")"
  pid="$(host_pid "$dir" "$host")"
  [ -n "$pid" ] || die "$missing"
  # Into the host's namespaces: network (lo + eth0), mount (/proc, /dev/shm, /etc/hosts, a
  # /sys showing only its interfaces), UTS, IPC, and pid for the children: -F, no fork, so
  # this process (the caller's) stays in the machine's pid namespace and can be signalled,
  # and the child it forks is a process of the host. The environment is kept, the working
  # directory too (--wd: entering a mount namespace would otherwise move it to /).
  #   pid + IPC + UTS namespaces: nothing on one host, UCX included, can see another
  #   host's processes or find a same-host shortcut (shared memory: /dev/shm and SysV are
  #   private; CMA, process_vm_readv, needs the peer's pid, which is not visible), and the
  #   plugin's host identity (hostname + boot id) differs between hosts.
  exec nsenter --target "$pid" --net --mount --uts --ipc --pid --no-fork --wd="$(pwd -P)" -- \
    perl "$dir/init.pl" run "$@"
}

cmd_down() {
  local name="$1" dir f pid pids namespaces ns deadline
  valid_name "$name"
  dir="$(state_dir "$name")"
  namespaces="$(bed_namespaces "$name")"
  if [ ! -d "$dir" ] && ! [[ "$name" =~ $OURS_RE ]]; then
    # Not made by this script (e.g. a bed made by hand): never ours to delete.
    [ -z "$namespaces" ] || die "bed $name was not made by $SCRIPT (no $dir); not deleting it"
    return 0
  fi
  # Kill every process on the bed first: a network namespace lives on, unnamed, while any
  # process is in it, and with it its links. Every host's pid 1 first: with it every
  # process of its pid namespace dies; then whatever else is in the bed's network
  # namespaces (a run's nsenter'd parent, an `ip netns exec` of someone's).
  for f in "$dir"/pid-*; do
    [ -e "$f" ] || continue
    f="${f##*/pid-}"
    [[ "$f" =~ ^($HOST_ID_RE)$ ]] || continue
    pid="$(host_pid "$dir" "$f")"
    [ -z "$pid" ] || kill -KILL "$pid" 2>/dev/null || true
  done
  for ns in $namespaces; do
    pids="$(ip netns pids "$ns" 2>/dev/null || true)"
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
  done
  deadline=$(( $(date +%s) + 10 ))
  for ns in $namespaces; do
    # Until no process is left in the namespace (a dying process leaves it before it is
    # reaped: a host's pid 1 may wait for its namespace's last zombies a moment longer, but
    # holds none of the host's namespaces, its /dev/shm, or its links any more).
    while ns_exists "$ns" && [ -n "$(ip netns pids "$ns" 2>/dev/null || true)" ]; do
      [ "$(date +%s)" -lt "$deadline" ] || { echo "$BED_TAG.sh: processes on $ns outlive SIGKILL" >&2; break; }
      sleep 0.05
    done
  done
  # The hosts (deleting a host's namespace deletes its end of its veth, and with it the
  # pair), then the switch, if the bed has one (its bridge).
  for ns in $namespaces; do
    [ "$ns" = "$name-sw" ] || ! ns_exists "$ns" || ip netns del "$ns" 2>/dev/null || true
  done
  for ns in $namespaces; do
    [ "$ns" != "$name-sw" ] || ! ns_exists "$ns" || ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$dir"
  [ -z "$(bed_namespaces "$name")" ] || die "bed $name: a namespace could not be deleted"
}

# Our beds: from the namespace names and the state dirs.
our_beds() {
  {
    ip netns list 2>/dev/null | awk '{print $1}' | sed -n -E "s/-($BED_NS_RE)\$//p"
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
