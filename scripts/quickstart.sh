#!/usr/bin/env bash
# Installs what arbor needs on Debian, builds it, creates a disk on a local
# folder (the embedded default) and mounts it, ready for files.
#   ARBOR_DISK  where the disk lives   (default: ./arbor-disk)
#   ARBOR_MNT   where it is mounted    (default: ./arbor-mnt)
set -euo pipefail
cd "$(dirname "$0")/.."
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
if ! command -v fusermount3 >/dev/null; then
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq fuse3
fi
cargo build --release -p arbor-cli
arbor=$PWD/target/release/arbor
disk=${ARBOR_DISK:-$PWD/arbor-disk}
mnt=${ARBOR_MNT:-$PWD/arbor-mnt}
[ -f "$disk/disk" ] || "$arbor" init "$disk"
mkdir -p "$mnt"
if mountpoint -q "$mnt" 2>/dev/null && "$arbor" status "$mnt" >/dev/null 2>&1; then
  echo "already mounted at $mnt"
else
  $sudo "$arbor" mount "$disk" "$mnt"
fi
cat <<TXT

arbor is mounted at $mnt: write files there as on any disk.
  $arbor status $mnt       what the mount is doing
  $arbor unmount $mnt      flush everything and unmount
TXT
