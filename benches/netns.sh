# Hosts of their own for the benchmarks: one network namespace per host,
# joined by a bridge (veth pairs), 10.77.0.2, .3, … in the order given.
# Sourced, not run. Only the network namespace changes: a FUSE mount made
# "on" a host is visible to the script.
#
#   netns_up HOST…     make the bridge and the hosts
#   on HOST CMD…       run CMD on HOST
#   wait_port HOST IP PORT
#   netns_down         stop what runs on them and remove them (call it from
#                      the script's EXIT trap)
#   netns_cleanup      the EXIT trap of a benchmark keeping its mounts in
#                      `mounts`, its background pids in `pids` and its files
#                      in `work`: all of it, then netns_down (KEEP_LOGS=DIR
#                      keeps the logs)
#   start_bucket IP    s3s-fs on host "bucket" behind delay_proxy ($proxy) at
#                      IP:9100, 20 ms round trip, counting what it sends into
#                      $work/bucket-bytes; exports the AWS_* variables
#   netns_bench NAME HOST…
#                      a benchmark's start: $arbor and $proxy (ARBOR / PROXY,
#                      default target/release), a fresh $work, empty `pids`
#                      and `mounts`, netns_cleanup on exit, the hosts up, and
#                      a token in $work/token
#   serve_on HOST DISK ARGS…
#                      `arbor serve DISK ARGS… --foreground` on HOST (its
#                      cache folders under `node HOST`), logging to
#                      $work/owner.log; returns once it logs that it serves
#                      (its port opens before its branches are taken);
#                      $owner_pid is the process
#   node HOST          HOST's XDG_CACHE_HOME (its own cache folders)
#   kill9 PID          kill -9 a process this script started in the
#                      background, and reap it quietly (no "Killed" line)
#   kill_owner_mid_stream DIR SAVED
#                      `stream` into DIR (common.sh), and once 8 files are
#                      fsynced kill -9 $owner_pid; $t0 is the kill's time
#   bucket_bytes       bytes the bucket sent so far

netns_hosts=()
pids=()
mounts=()

netns_bench() { # name host…
  local name=$1; shift
  arbor=${ARBOR:-$here/target/release/arbor}
  proxy=${PROXY:-$here/target/release/delay_proxy}
  work=$(mktemp -d "/var/tmp/arbor-$name.XXXXXX")
  pids=()
  mounts=()
  trap netns_cleanup EXIT
  trap 'exit 130' INT TERM
  netns_up "$@"
  head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/token"
  chmod 600 "$work/token"
}

node() { echo "$work/node-$1"; }

serve_on() { # host disk args…
  local h=$1 ready
  shift
  ready=$(grep -c ' serving disk=' "$work/owner.log" 2>/dev/null || true)
  # nsenter itself, not the `on` function (a subshell): $! must be arbor.
  XDG_CACHE_HOME=$(node "$h") nsenter --net="/run/netns/arb-$h" "$arbor" serve "$@" --foreground \
    2>>"$work/owner.log" & owner_pid=$!; pids+=($owner_pid)
  for _ in $(seq 300); do
    [ "$(grep -c ' serving disk=' "$work/owner.log" 2>/dev/null || true)" -gt "${ready:-0}" ] && return 0
    sleep 0.1
  done
  echo "arbor serve did not start serving on $h; its log:" >&2; cat "$work/owner.log" >&2; return 1
}
bucket_bytes() { cat "$work/bucket-bytes"; }
kill9() { { kill -9 "$1"; wait "$1"; } 2>/dev/null || true; }
kill_owner_mid_stream() { # dir saved
  stream "$1" "$2"
  for _ in $(seq 300); do [ -e "$2" ] && [ "$(wc -l < "$2")" -ge 8 ] && break; sleep 0.05; done
  kill9 "$owner_pid"; t0=$(now)
}

netns_up() {
  netns_hosts=("$@")
  ip link add arbbr type bridge
  ip addr add 10.77.0.1/24 dev arbbr
  ip link set arbbr up
  local i=2 h
  for h in "${netns_hosts[@]}"; do
    ip netns add "arb-$h"
    ip link add "arb-$h" type veth peer name eth0 netns "arb-$h"
    ip link set "arb-$h" master arbbr up
    ip -n "arb-$h" addr add "10.77.0.$i/24" dev eth0
    ip -n "arb-$h" link set eth0 up
    ip -n "arb-$h" link set lo up
    i=$((i + 1))
  done
}

netns_down() {
  local h p
  # Whatever still runs on a host goes with it: a command started in the
  # background through `on` is a child of the subshell whose pid `$!` gave.
  for h in "${netns_hosts[@]}"; do
    for p in $(ip netns pids "arb-$h" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
  done
  for h in "${netns_hosts[@]}"; do ip link del "arb-$h" 2>/dev/null || true; ip netns del "arb-$h" 2>/dev/null || true; done
  ip link del arbbr 2>/dev/null || true
}

on() { local h=$1; shift; nsenter --net="/run/netns/arb-$h" "$@"; }

wait_port() { # host ip port
  for _ in $(seq 200); do on "$1" bash -c "exec 3<>/dev/tcp/$2/$3" 2>/dev/null && return 0; sleep 0.1; done
  echo "nothing listens on $2:$3" >&2; return 1
}

netns_cleanup() {
  local m p
  for m in "${mounts[@]}"; do fusermount3 -uz "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; done
  # Quietly: the shell would report every background job it reaps here as
  # "Killed". Each job is waited for once gone (at most 5 s each), so none
  # is reported on the way out either.
  {
    for p in "${pids[@]}" $(jobs -p); do kill -9 "$p"; done
    netns_down
    for p in $(jobs -p); do
      for _ in $(seq 50); do kill -0 "$p" || break; sleep 0.1; done
      kill -0 "$p" || wait "$p"
    done
  } 2>/dev/null || true
  if [ -n "${KEEP_LOGS:-}" ]; then
    mkdir -p "$KEEP_LOGS"
    find "$work" -name "*.log" -exec cp --backup=numbered {} "$KEEP_LOGS/" \; 2>/dev/null || true
  fi
  rm -rf "$work" 2>/dev/null || true
}

start_bucket() { # ip
  mkdir -p "$work/s3/arbor-test"
  on bucket s3s-fs --host 127.0.0.1 --port 9000 --access-key k --secret-key s "$work/s3" >/dev/null 2>&1 & pids+=($!)
  wait_port bucket 127.0.0.1 9000
  on bucket "$proxy" "$1:9100" 127.0.0.1:9000 10000 "$work/bucket-bytes" & pids+=($!)
  wait_port bucket "$1" 9100
  export AWS_ACCESS_KEY_ID=k AWS_SECRET_ACCESS_KEY=s AWS_REGION=us-east-1 AWS_ENDPOINT_URL="http://$1:9100"
}
