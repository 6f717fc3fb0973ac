#!/usr/bin/env bash
# A hyper-parameter sweep on arbor: one dataset, frozen once, forked into a
# branch per run; each run writes its own model checkpoints; then compare.
#
#   examples/sweep.sh [WORKDIR]      (needs root or FUSE access; arbor built)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
arbor=${ARBOR:-$here/target/release/arbor}
[ -x "$arbor" ] || arbor=$here/target/debug/arbor
work=${1:-$(mktemp -d)}
disk=$work/disk
mkdir -p "$work/main" "$work/run-a" "$work/run-b"
cleanup() {
  for m in "$work/main" "$work/run-a" "$work/run-b"; do "$arbor" unmount "$m" >/dev/null 2>&1 || true; done
}
trap cleanup EXIT

"$arbor" init "$disk"
"$arbor" mount "$disk" "$work/main"

# 1. The dataset and config, written once.
mkdir -p "$work/main/data" "$work/main/config"
for i in 0 1 2 3; do head -c 2000000 /dev/urandom > "$work/main/data/shard-$i.bin"; done
echo "lr: 0.001" > "$work/main/config/base.yaml"
sync

# 2. Freeze it, and fork one branch per run.
"$arbor" checkpoints create "$work/main" dataset-v1
"$arbor" branches create "$work/main" run-a --from-checkpoint dataset-v1
"$arbor" branches create "$work/main" run-b --from-checkpoint dataset-v1
"$arbor" mount "$disk" "$work/run-a" --branch run-a
"$arbor" mount "$disk" "$work/run-b" --branch run-b

# 3. Each run writes its own model checkpoints (tmp + fsync + rename).
for run in run-a run-b; do
  mkdir -p "$work/$run/ckpt"
  for step in 100 200; do
    head -c 3000000 /dev/urandom > "$work/$run/ckpt/step-$step.pt.tmp"
    python3 -c 'import os,sys; f=open(sys.argv[1],"rb+"); os.fsync(f.fileno())' "$work/$run/ckpt/step-$step.pt.tmp"
    mv "$work/$run/ckpt/step-$step.pt.tmp" "$work/$run/ckpt/step-$step.pt"
  done
done
echo "lr: 0.01" > "$work/run-b/config/base.yaml"

# 4. Compare: each run against the dataset, and the runs against each other.
"$arbor" diff "$work/main" dataset-v1 run-a
"$arbor" diff "$work/main" run-a run-b
"$arbor" branches list "$work/main"
"$arbor" checkpoints list "$work/main"

# The dataset is untouched on main.
[ ! -e "$work/main/ckpt" ] || { echo "main changed" >&2; exit 1; }
echo "sweep done in $work"
