#!/usr/bin/env bash
# What `arbor mount --restartable` costs: two mounts of two local-folder
# disks on the classic /dev/fuse transport, one plain and one restartable
# (its keeper holds the connection; every change is written out of the
# process before it is answered), the same workloads on each, alternating,
# in the same run. Prints a markdown table of medians and the ratio
# restartable ÷ plain.
#
#   benches/keeper_cost.sh [WORKDIR]     (root; arbor built in release)
#   SIZE_MIB=1024 RUNS=5 FILES=5000 benches/keeper_cost.sh
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
arbor=${ARBOR:-$here/target/release/arbor}
size=${SIZE_MIB:-1024}
runs=${RUNS:-5}
files=${FILES:-5000}
meta=${META:-1000}
work=${1:-$here/target/keeper-bench}
. "$here/benches/common.sh"
[ -x "$arbor" ] || (cd "$here" && cargo build --release -p arbor-cli)
rm -rf "$work" && mkdir -p "$work/plain" "$work/kept"
"$arbor" init "$work/disk-plain" >/dev/null
"$arbor" init "$work/disk-kept" >/dev/null
pids=()
cleanup() {
  for s in plain kept; do "$arbor" unmount "$work/$s" >/dev/null 2>&1 || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
# Both in the foreground (the keeper needs it), so that they differ in
# the keeper alone.
mount_side() { # side extra…
  local side=$1; shift
  ARBOR_FUSE=classic "$arbor" mount "$work/disk-$side" "$work/$side" --foreground "$@" >"$work/$side.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 200); do
    grep -q " $work/$side fuse" /proc/self/mounts && return
    sleep 0.05
  done
  cat "$work/$side.log" >&2
  exit 1
}
mount_side plain
mount_side kept --restartable

seqwrite_wo() { write_stream "$1" "$size"; rm -f "$1"; }
declare -A R
for r in $(seq "$runs"); do
  echo "run $r/$runs" >&2
  # Alternate which side goes first: the machine's noise falls on both.
  order="plain kept"; [ $((r % 2)) = 0 ] && order="kept plain"
  for side in $order; do
    dir=$work/$side
    R[$side.wo]+=" $(seqwrite_wo "$dir/ckpt")"
    R[$side.sf]+=" $(smallfiles "$dir" "$files")"
    read -r st rd cw <<<"$(metadata "$dir" "$meta")"
    R[$side.stat]+=" $st"; R[$side.cw]+=" $cw"
    rm -rf "$dir/meta" "$dir/small"
  done
done
line() { # KEY NAME UNIT
  local p k
  p=$(median ${R[plain.$1]}); k=$(median ${R[kept.$1]})
  python3 -c 'import sys; n,u,p,k=sys.argv[1:]; p=float(p); k=float(k); print(f"| {n} | {p:.0f} {u} | {k:.0f} {u} | {k/p:.2f}× |")' "$2" "$3" "$p" "$k"
}
echo
echo "### arbor mount --restartable vs a plain mount (classic /dev/fuse, medians of $runs runs)"
echo
echo "| workload | plain | --restartable | ratio |"
echo "| --- | ---: | ---: | ---: |"
line wo "sequential write $size MiB, write-only open, 1 MiB writes + fsync" MiB/s
line sf "create $files × 4 KiB + stat + readdir + unlink" files/s
line stat "stat of $meta files (attributes cached)" stats/s
line cw "create + 4 KiB write + fsync, $meta files" files/s
