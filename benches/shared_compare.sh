#!/usr/bin/env bash
# A client mount of a branch owned by `arbor serve --branch`, 0.2 ms round
# trip away (delay_proxy adds ONE_WAY_US, 100 µs, each way), beside a local mount of the
# same branch, in the same run: a markdown table of medians and ratios.
#
#   benches/shared_compare.sh [WORKDIR]   (root; fio from Debian; release build)
#   SIZE_GIB=1 RUNS=3 FILES=10000 CKPT_MIB=256 CLIENTS=8 benches/shared_compare.sh
#
# The checkpoint save is CLIENTS writers at once, each writing CKPT_MIB to
# `rank-R.tmp` in 1 MiB writes, fsync, rename to `rank-R`: through CLIENTS
# client mounts on one side, in the one local mount on the other.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
arbor=${ARBOR:-$here/target/release/arbor}
proxy=${DELAY_PROXY:-$here/target/release/delay_proxy}
size=${SIZE_GIB:-1}G
runs=${RUNS:-3}
files=${FILES:-10000}
ckpt_mib=${CKPT_MIB:-256}
clients=${CLIENTS:-8}
one_way_us=${ONE_WAY_US:-100}
work=${1:-$here/target/shared-bench}
command -v fio >/dev/null || { apt-get update -qq && apt-get install -y -qq fio; }
[ -x "$arbor" ] && [ -x "$proxy" ] || (cd "$here" && cargo build --release -p arbor-cli -p arbor-benches)
rm -rf "$work" && mkdir -p "$work"
for i in $(seq 0 $((clients - 1))); do mkdir -p "$work/mnt$i"; done
"$arbor" init "$work/disk" >/dev/null
openssl rand -hex 32 >"$work/token" 2>/dev/null || head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/token"
chmod 600 "$work/token"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
pport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
proxy_pid=

unmount_all() { for i in $(seq 0 $((clients - 1))); do "$arbor" unmount "$work/mnt$i" >/dev/null 2>&1 || true; done; }
stop_owner() {
  pkill -TERM -f "arbor serve $work/disk" 2>/dev/null || true
  for _ in $(seq 100); do pgrep -f "arbor serve $work/disk" >/dev/null || break; sleep 0.1; done
  [ -n "$proxy_pid" ] && kill "$proxy_pid" 2>/dev/null && wait "$proxy_pid" 2>/dev/null || true
  proxy_pid=
}
cleanup() { unmount_all; stop_owner; }
trap cleanup EXIT INT TERM

local_side() { "$arbor" mount "$work/disk" "$work/mnt0" >/dev/null; }
remote_side() {
  "$arbor" serve "$work/disk" --branch main --listen "127.0.0.1:$port" --token-file "$work/token" >/dev/null
  "$proxy" "127.0.0.1:$pport" "127.0.0.1:$port" "$one_way_us" "$work/proxy.count" &
  proxy_pid=$!
  for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/$pport) 2>/dev/null && break; sleep 0.1; done
  for i in $(seq 0 $((clients - 1))); do
    "$arbor" mount "$work/disk" "$work/mnt$i" --token-file "$work/token" --server "127.0.0.1:$pport" >/dev/null
  done
}

. "$here/benches/common.sh"
# Each timed phase starts on touched memory (common.sh, touch_memory).
touch_mib=$(( ${size%G} * 1024 ))
seqwrite() { touch_memory "$work" "$touch_mib"; fio --name=w --directory="$1" --filename=big --rw=write --bs=1M --size="$size" --end_fsync=1 --output-format=json --output="$2" >/dev/null; }
seqread() { drop_caches; touch_memory "$work" "$touch_mib"; fio --name=r --directory="$1" --filename=big --rw=read --bs=1M --size="$size" --output-format=json --output="$2" >/dev/null; }
# ckpt DIR… : one writer per DIR, at once; prints GB/s over them all.
ckpt() {
  python3 - "$ckpt_mib" "$@" <<'PY'
import os, sys, time, multiprocessing as mp
mib, dirs = int(sys.argv[1]), sys.argv[2:]
def save(a):
    r, d = a
    block = os.urandom(1 << 20)
    tmp, final = os.path.join(d, f"rank-{r}.tmp"), os.path.join(d, f"rank-{r}")
    with open(tmp, "wb") as f:
        for _ in range(mib):
            f.write(block)
        f.flush(); os.fsync(f.fileno())
    os.rename(tmp, final)
t = time.perf_counter()
with mp.Pool(len(dirs)) as p:
    p.map(save, list(enumerate(dirs)))
print(len(dirs) * mib * (1 << 20) / (time.perf_counter() - t) / 1e9)
PY
}

declare -A L R
for r in $(seq "$runs"); do
  echo "run $r/$runs" >&2
  for side in local remote; do
    if [ "$side" = local ]; then local_side; else remote_side; fi
    dir=$work/mnt0
    seqwrite "$dir" "$work/w.json"; w=$(bw "$work/w.json" write)
    seqread "$dir" "$work/r.json"; rd=$(bw "$work/r.json" read)
    rm -f "$dir/big"
    sf=$(smallfiles "$dir" "$files")
    if [ "$side" = local ]; then dirs=$(for i in $(seq "$clients"); do echo "$dir"; done)
    else dirs=$(for i in $(seq 0 $((clients - 1))); do echo "$work/mnt$i"; done); fi
    # shellcheck disable=SC2086
    ck=$(ckpt $dirs)
    rm -f "$dir"/rank-*
    unmount_all
    stop_owner
    if [ "$side" = local ]; then L[w]+=" $w"; L[r]+=" $rd"; L[sf]+=" $sf"; L[ck]+=" $ck"
    else R[w]+=" $w"; R[r]+=" $rd"; R[sf]+=" $sf"; R[ck]+=" $ck"; fi
  done
done

echo
echo "### client mount through the owner ($one_way_us µs each way) vs local mount (medians of $runs runs)"
echo
echo "| workload | local mount | client mount | ratio | target |"
echo "| --- | ---: | ---: | ---: | --- |"
row "sequential write $size + fsync" MiB/s "$(median ${L[w]})" "$(median ${R[w]})" "≥ 0.5×"
row "sequential read $size, cold cache" MiB/s "$(median ${L[r]})" "$(median ${R[r]})" "≥ 0.7×"
row "$files × (create 4 KiB + stat + unlink)" files/s "$(median ${L[sf]})" "$(median ${R[sf]})" "report"
row "checkpoint save: $clients × $ckpt_mib MiB, fsync, rename" GB/s "$(median ${L[ck]})" "$(median ${R[ck]})" "report"
