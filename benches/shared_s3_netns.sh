#!/bin/bash
# A shared branch on an s3 disk, every party on a host of its own (network
# namespaces joined by a bridge): the bucket (s3s-fs) 20 ms away behind a
# delaying proxy that counts what it sends, `arbor serve --branch main`
# (also the cache server) 0.2 ms from two client nodes. c1 writes a file
# through the owner; c2 reads it cold with every read through the owner
# (ARBOR_READ_THROUGH_OWNER=1), then reading the bytes from the disk's
# segments (chunks through the owner's cache server), then the same after
# the owner was restarted with its cache kept, and with an empty cache
# (data the owner no longer holds). Then kills the owner with -9 under a stream of fsynced files and
# restarts it. Prints markdown tables: MiB/s, the bucket's bytes, and what
# survived the kill.
#
#   benches/shared_s3_netns.sh [MIB]     (root; s3s-fs; arbor and delay_proxy built)
#
# ARBOR / PROXY point at the binaries (default: target/release). Everything
# it starts it stops, and it removes its namespaces, bridge and folders.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
mib=${1:-256}
. "$here/benches/netns.sh"
. "$here/benches/common.sh"
netns_bench shared-s3 bucket owner c1 c2
bucket_ip=10.77.0.2 owner_ip=10.77.0.3
start_bucket "$bucket_ip"
disk=s3://arbor-test/shared
XDG_CACHE_HOME=$(node owner) on owner "$arbor" init "$disk" >/dev/null

on owner "$proxy" "$owner_ip:7071" "$owner_ip:7070" 100 "$work/proxied" & pids+=($!)
start_owner() {
  serve_on owner "$disk" --branch main --listen "$owner_ip:7070" --advertise "$owner_ip:7071" \
    --token-file "$work/token" --segment-size 16M
}
start_owner
client() { # host [env…]: mounts main at $work/mnt-HOST through the owner, memory only
  local h=$1; shift
  mkdir -p "$work/mnt-$h"
  env "$@" XDG_CACHE_HOME="$(node "$h")" nsenter --net="/run/netns/arb-$h" "$arbor" mount "$disk" "$work/mnt-$h" \
    --token-file "$work/token" --cache-server "$owner_ip:7071" --cache-dir none --cache-memory 1G >/dev/null
  mounts+=("$work/mnt-$h")
}
unmount() { XDG_CACHE_HOME=$(node "$1") "$arbor" unmount "$work/mnt-$1" >/dev/null; }
rows=()

# c1 writes the file through the owner, and waits until the bucket holds
# every sealed segment of it.
client c1
head -c "${mib}M" /dev/urandom > "$work/src"
sum=$(sha256sum < "$work/src")
segments() { find "$work/s3/arbor-test/shared/segments" -type f 2>/dev/null | wc -l; }
s0=$(segments)
t0=$(now); dd if="$work/src" of="$work/mnt-c1/big" bs=1M conv=fsync status=none; t1=$(now)
rows+=("| c1 writes $mib MiB + fsync | $(rate "$mib" "$t0" "$t1") MiB/s | — | — |")
for _ in $(seq 600); do [ "$(segments)" -ge $(( s0 + mib / 16 - 1 )) ] && break; sleep 0.1; done

# read PHASE [env…]: c2 mounts afresh, reads the file cold, unmounts.
read_cold() {
  local what=$1; shift
  client c2 "$@"
  drop_caches
  local b0 t0 t1 got where
  b0=$(bucket_bytes); t0=$(now)
  got=$(sha256sum < "$work/mnt-c2/big")
  t1=$(now)
  [ "$got" = "$sum" ] || { echo "c2 read other bytes than c1 wrote" >&2; exit 1; }
  where=$(XDG_CACHE_HOME=$(node c2) "$arbor" status "$work/mnt-c2" --json | python3 -c '
import json, sys
r = json.load(sys.stdin)["reads"]
print("{:.0f} MiB from the segments, {:.0f} MiB through the owner".format(r["from_segments_bytes"] / 2**20, r["from_owner_bytes"] / 2**20))')
  rows+=("| c2 reads it cold: $what | $(rate "$mib" "$t0" "$t1") MiB/s | $(( ($(bucket_bytes) - b0) >> 20 )) MiB | $where |")
  unmount c2
}
read_cold "every read through the owner" ARBOR_READ_THROUGH_OWNER=1
read_cold "bytes from the segments (the owner's cache server)"

# The owner restarted on its node, its cache kept: the chunks c1 wrote are
# still in the branch's cache files, which its cache server gives again.
unmount c1
kill -TERM "$owner_pid"; wait "$owner_pid" 2>/dev/null || true
start_owner
read_cold "owner restarted, cache kept; from the segments"

# The owner restarted with an empty cache: the data is in the bucket only.
kill -TERM "$owner_pid"; wait "$owner_pid" 2>/dev/null || true
rm -rf "$(node owner)/arbor"/*/mounts
start_owner
read_cold "owner restarted, cache empty; through the owner" ARBOR_READ_THROUGH_OWNER=1
kill -TERM "$owner_pid"; wait "$owner_pid" 2>/dev/null || true
rm -rf "$(node owner)/arbor"/*/mounts "$(node owner)/arbor"/*/serve
start_owner
read_cold "owner restarted, cache empty; from the segments"
read_cold "again, a new client (the server now warm)"

# The owner killed -9 under a stream of fsynced files from c1 and started
# again on its node 1 s later; c2 then reads every file c1 fsynced.
client c1
b0=$(bucket_bytes)
kill_owner_mid_stream "$work/mnt-c1/stream" "$work/saved"
sleep 1
start_owner
wait "$writer"; t1=$(now)
client c2
bad=$(whole "$work/mnt-c2/stream" "$work/saved")
faults=("| owner killed -9 at file 8 of 40 (4 MiB, fsync each), restarted 1 s later | $bad on c2; the writer finished $(secs "$t0" "$t1") s after the kill, no remount | $(( ($(bucket_bytes) - b0) >> 20 )) MiB |")
unmount c2

echo
echo "### a shared branch on an s3 disk across network namespaces (bucket 20 ms, owner 0.2 ms, $mib MiB)"
echo
echo "| what | speed | from the bucket | where c2's bytes came from |"
echo "| --- | ---: | ---: | --- |"
printf '%s\n' "${rows[@]}"
echo
echo "| fault | result | the bucket sent |"
echo "| --- | --- | ---: |"
printf '%s\n' "${faults[@]}"
