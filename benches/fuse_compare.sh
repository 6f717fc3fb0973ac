#!/usr/bin/env bash
# Workloads through an arbor mount beside the same workloads on the local
# disk, in the same run, printed as a markdown table of medians and ratios.
#
#   benches/fuse_compare.sh [WORKDIR]     (root; fio from Debian; arbor built in release)
#   SIZE_GIB=4 RUNS=3 FILES=10000 benches/fuse_compare.sh
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
arbor=${ARBOR:-$here/target/release/arbor}
size=${SIZE_GIB:-4}G
runs=${RUNS:-3}
files=${FILES:-10000}
work=${1:-$here/target/fuse-bench}
command -v fio >/dev/null || { apt-get update -qq && apt-get install -y -qq fio; }
[ -x "$arbor" ] || (cd "$here" && cargo build --release -p arbor-cli)
rm -rf "$work" && mkdir -p "$work/local" "$work/mnt"
"$arbor" init "$work/disk" >/dev/null
"$arbor" mount "$work/disk" "$work/mnt" >/dev/null
trap '"$arbor" unmount "$work/mnt" >/dev/null 2>&1 || true' EXIT

. "$here/benches/common.sh"

seqwrite() { fio --name=w --directory="$1" --filename=big --rw=write --bs=1M --size="$size" --end_fsync=1 --output-format=json --output="$2" >/dev/null; }
seqread() { drop_caches; fio --name=r --directory="$1" --filename=big --rw=read --bs=1M --size="$size" --output-format=json --output="$2" >/dev/null; }
randread() { drop_caches; fio --name=rr --directory="$1" --filename=big --rw=randread --bs=4k --size="$size" --runtime=15 --time_based --output-format=json --output="$2" >/dev/null; }
declare -A L A
for r in $(seq "$runs"); do
  echo "run $r/$runs" >&2
  for side in local mnt; do
    dir=$work/$side
    seqwrite "$dir" "$work/w.json"; w=$(bw "$work/w.json" write)
    seqread "$dir" "$work/r.json"; rd=$(bw "$work/r.json" read)
    randread "$dir" "$work/rr.json"; p50=$(lat "$work/rr.json" 50.000000); p99=$(lat "$work/rr.json" 99.000000)
    sf=$(smallfiles "$dir" "$files")
    rm -f "$dir/big"
    if [ "$side" = local ]; then L[w]+=" $w"; L[r]+=" $rd"; L[p50]+=" $p50"; L[p99]+=" $p99"; L[sf]+=" $sf"
    else A[w]+=" $w"; A[r]+=" $rd"; A[p50]+=" $p50"; A[p99]+=" $p99"; A[sf]+=" $sf"; fi
  done
done

echo
echo "### arbor mount vs local disk (medians of $runs runs, $size file)"
echo
echo "| workload | local disk | arbor mount | ratio | target |"
echo "| --- | ---: | ---: | ---: | --- |"
row "sequential write $size + fsync" MiB/s "$(median ${L[w]})" "$(median ${A[w]})" "≥ 0.7×"
row "sequential re-read (cold cache)" MiB/s "$(median ${L[r]})" "$(median ${A[r]})" "≥ 0.8×"
row "random 4 KiB read p50 (cold cache)" µs "$(median ${L[p50]})" "$(median ${A[p50]})" "≤ 2× (lower is better)"
row "random 4 KiB read p99 (cold cache)" µs "$(median ${L[p99]})" "$(median ${A[p99]})" "(lower is better)"
row "create $files × 4 KiB + stat + readdir + unlink" files/s "$(median ${L[sf]})" "$(median ${A[sf]})" "≥ 0.5×"
