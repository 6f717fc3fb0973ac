#!/usr/bin/env bash
# Workloads through an arbor mount beside the same workloads on the local
# disk, in the same run, printed as a markdown table of medians and ratios:
# the local disk, the mount on the classic /dev/fuse transport, and the
# mount on FUSE over io_uring (skipped, loudly, where the kernel lacks it).
#
#   benches/fuse_compare.sh [WORKDIR]     (root; fio from Debian; arbor built in release)
#   SIZE_GIB=4 RUNS=3 FILES=10000 META=2000 benches/fuse_compare.sh
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
arbor=${ARBOR:-$here/target/release/arbor}
size=${SIZE_GIB:-4}G
runs=${RUNS:-3}
files=${FILES:-10000}
meta=${META:-2000}
work=${1:-$here/target/fuse-bench}
command -v fio >/dev/null || { apt-get update -qq && apt-get install -y -qq fio; }
[ -x "$arbor" ] || (cd "$here" && cargo build --release -p arbor-cli)
param=/sys/module/fuse/parameters/enable_uring
was=$(cat "$param" 2>/dev/null || echo none)
sides="local classic"
if [ "$was" != none ] && echo Y > "$param" 2>/dev/null; then
  sides="$sides ring"
else
  echo "!! FUSE over io_uring is not available here ($param: $was); the ring column is skipped" >&2
fi
rm -rf "$work" && mkdir -p "$work/local" "$work/classic" "$work/ring"
"$arbor" init "$work/disk-classic" >/dev/null
"$arbor" init "$work/disk-ring" >/dev/null
cleanup() {
  for s in classic ring; do "$arbor" unmount "$work/$s" >/dev/null 2>&1 || true; done
  [ "$was" = none ] || echo "$was" > "$param" 2>/dev/null || true
}
trap cleanup EXIT
ARBOR_FUSE=classic "$arbor" mount "$work/disk-classic" "$work/classic" >&2
[[ $sides != *ring* ]] || ARBOR_FUSE=ring "$arbor" mount "$work/disk-ring" "$work/ring" >&2

. "$here/benches/common.sh"

# Each phase that fills the page cache starts on touched memory
# (common.sh, touch_memory), on every side alike.
touch_mib=$(( ${size%G} * 1024 ))
seqwrite() { touch_memory "$work" "$touch_mib"; fio --name=w --directory="$1" --filename=big --rw=write --bs=1M --size="$size" --end_fsync=1 --output-format=json --output="$2" >/dev/null; }
# The same writes as a checkpoint writer makes them: the file opened
# write-only (torch.save, safetensors, numpy.save, dd; fio opens read-write),
# 1 MiB writes of bytes that are not zeros, fsync at the end.
seqwrite_wo() { touch_memory "$work" "$touch_mib"; write_stream "$1" "$touch_mib"; rm -f "$1"; }
seqread() { drop_caches; touch_memory "$work" "$touch_mib"; fio --name=r --directory="$1" --filename=big --rw=read --bs=1M --size="$size" --output-format=json --output="$2" >/dev/null; }
warmread() { fio --name=r --directory="$1" --filename="${3:-big}" --rw=read --bs=1M --size="$size" --invalidate=0 --output-format=json --output="$2" >/dev/null; }
randread() { drop_caches; fio --name=rr --directory="$1" --filename=big --rw=randread --bs=4k --size="$size" --runtime=15 --time_based --output-format=json --output="$2" >/dev/null; }
declare -A R
FOLIOS=""
for r in $(seq "$runs"); do
  echo "run $r/$runs" >&2
  for side in $sides; do
    dir=$work/$side
    R[$side.wo]+=" $(seqwrite_wo "$dir/ckpt")"
    seqwrite "$dir" "$work/w.json"; R[$side.w]+=" $(bw "$work/w.json" write)"
    seqread "$dir" "$work/r.json"; R[$side.r]+=" $(bw "$work/r.json" read)"
    # The cold read above left the file in the page cache (fio drops a
    # file's cached pages before a job unless told not to).
    warmread "$dir" "$work/r.json"; R[$side.warm]+=" $(bw "$work/r.json" read)"
    randread "$dir" "$work/rr.json"; R[$side.p50]+=" $(lat "$work/rr.json" 50.000000)"
    # What the warm re-read copies from: large folios or 4 KiB pages.
    [ "$r" != 1 ] || FOLIOS+="$(python3 "$here/benches/folios.py" "$dir/big")"$'\n'
    if [ "$side" = local ]; then
      # The same re-read of a local file held in 4 KiB pages, as this kernel
      # holds every FUSE file: copied in 4 KiB writes, which ext4 caches in
      # order-0 pages (folios.py checks).
      dd if="$dir/big" of="$dir/big4k" bs=4k status=none
      warmread "$dir" "$work/r.json" big4k; R[local.warm4k]+=" $(bw "$work/r.json" read)"
      [ "$r" != 1 ] || FOLIOS+="$(python3 "$here/benches/folios.py" "$dir/big4k")"$'\n'
      rm -f "$dir/big4k"
    fi
    rm -f "$dir/big"
    R[$side.sf]+=" $(smallfiles "$dir" "$files")"
    read -r st rd cw <<<"$(metadata "$dir" "$meta")"
    R[$side.stat]+=" $st"; R[$side.readdir]+=" $rd"; R[$side.cw]+=" $cw"
  done
done

med() { median ${R[$1]}; }
table() {  # table KEY NAME UNIT TARGET [LOCAL-KEY]: the local side's KEY, or LOCAL-KEY, is the baseline
  local l c g
  l=$(med "local.${5:-$1}"); c=$(med "classic.$1")
  if [[ $sides == *ring* ]]; then g=$(med "ring.$1"); else g=nan; fi
  python3 -c '
import sys
n, u, t, l, c, g = sys.argv[1:]
l, c, g = float(l), float(c), float(g)
ring = "skipped" if g != g else f"{g:.0f} ({g/l:.2f}×)"
print(f"| {n} | {l:.0f} {u} | {c:.0f} ({c/l:.2f}×) | {ring} | {t} |")' "$2" "$3" "$4" "$l" "$c" "$g"
}
echo
echo "### arbor mount vs local disk (medians of $runs runs; ratios to the local disk)"
echo
echo "| workload | local disk | classic /dev/fuse | FUSE over io_uring | target |"
echo "| --- | ---: | ---: | ---: | --- |"
table w "sequential write $size in 1 MiB writes + fsync (fio, read-write open)" MiB/s "≥ 0.8×"
table wo "the same, opened write-only (as checkpoint writers do)" MiB/s "≥ 0.8×"
table r "sequential read, cold cache" MiB/s "≥ 0.8×"
table warm "warm re-read from the page cache" MiB/s "≥ 0.9×"
# The same re-reads against the local file in 4 KiB pages: what is left
# when both sides copy from pages of one size.
table warm "the same, against a local file held in 4 KiB pages" MiB/s "" warm4k
table p50 "random 4 KiB read p50, cold cache" µs "≤ 2× (lower is better)"
table sf "create $files × 4 KiB + stat + readdir + unlink" files/s "≥ 0.5×"
table stat "stat of $meta files (attributes cached)" stats/s "≥ 0.5×"
table readdir "readdir of $meta files" entries/s ""
table cw "create + 4 KiB write + fsync, $meta files" files/s ""
echo
echo "Page-cache folios of the 1st run's file (benches/folios.py):"
printf '%s' "$FOLIOS"
