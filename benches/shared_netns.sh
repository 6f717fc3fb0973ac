#!/bin/bash
# arbor serve --branch with the owner and two client nodes on hosts of their
# own (network namespaces joined by a bridge), the owner 0.2 ms away from
# the clients (delay_proxy, 100 µs each way). Measures a write on one node
# read cold on the other, how soon a name made on one shows on the other, a
# distributed checkpoint save from both, and kills the owner with -9 under
# a stream of fsynced files. Prints a markdown table.
#
#   benches/shared_netns.sh [MIB]     (root; arbor and delay_proxy built)
#
# ARBOR / PROXY point at the binaries (default: target/release). Everything
# it starts it stops, and it removes its namespaces, bridge and folders.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
mib=${1:-256}
. "$here/benches/netns.sh"
. "$here/benches/common.sh"
netns_bench shared-netns owner c1 c2 owner2
owner_ip=10.77.0.2
"$arbor" init "$work/disk" >/dev/null
on owner "$proxy" "$owner_ip:7071" "$owner_ip:7070" 100 "$work/proxied" & pids+=($!)
start_owner() {
  serve_on owner "$work/disk" --branch main --listen "$owner_ip:7070" --advertise "$owner_ip:7071" \
    --token-file "$work/token"
}
start_owner
for h in c1 c2; do
  mkdir -p "$work/mnt-$h"
  on "$h" "$arbor" mount "$work/disk" "$work/mnt-$h" --token-file "$work/token" >/dev/null; mounts+=("$work/mnt-$h")
done
a=$work/mnt-c1 b=$work/mnt-c2
rows=()

# One node writes, the other reads it cold.
head -c "${mib}M" /dev/urandom > "$work/src"
sum=$(sha256sum < "$work/src")
t0=$(now); dd if="$work/src" of="$a/big" bs=1M conv=fsync status=none; t1=$(now)
rows+=("| c1 writes $mib MiB + fsync | $(rate "$mib" "$t0" "$t1") MiB/s |")
drop_caches
t0=$(now); got=$(sha256sum < "$b/big"); t1=$(now)
[ "$got" = "$sum" ] || { echo "c2 read other bytes than c1 wrote" >&2; exit 1; }
rows+=("| c2 reads it, cold | $(rate "$mib" "$t0" "$t1") MiB/s |")
split=$(on c2 "$arbor" status "$b" --json | python3 -c '
import json, sys
r = json.load(sys.stdin)["reads"]
print("{:.1f} MiB from the disk itself, {:.1f} MiB through the owner, {} locates".format(r["from_segments_bytes"] / 2**20, r["from_owner_bytes"] / 2**20, r["locates"]))')
rows+=("| where c2's bytes came from | $split |")

# A name made on c1, polled for on c2 (which was told it is not there).
seen=$(python3 - "$a" "$b" <<'PY'
import os, sys, time, statistics
a, b = sys.argv[1], sys.argv[2]
os.makedirs(os.path.join(a, "names"), exist_ok=True)
ms = []
for i in range(20):
    name = f"names/n{i}"
    assert not os.path.exists(os.path.join(b, name))
    t = time.perf_counter()
    open(os.path.join(a, name), "w").close()
    while not os.path.exists(os.path.join(b, name)):
        if time.perf_counter() - t > 5:
            sys.exit("never showed")
        time.sleep(0.0005)
    ms.append((time.perf_counter() - t) * 1000)
print(f"{statistics.median(ms):.1f} ms (max {max(ms):.1f} ms)")
PY
)
rows+=("| a file made on c1 shows on c2, median of 20 | $seen |")

# A distributed checkpoint: 4 ranks on each node, one shard each, fsync;
# rank 0 writes the metadata and renames the folder into place.
shard=$((mib / 8))
mkdir "$a/step.tmp"
t0=$(now)
ranks=()
for r in 0 1 2 3 4 5 6 7; do
  m=$a; [ "$r" -ge 4 ] && m=$b
  (for _ in $(seq 100); do [ -d "$m/step.tmp" ] && break; sleep 0.01; done
   dd if="$work/src" of="$m/step.tmp/__${r}_0.distcp" bs=1M count="$shard" conv=fsync status=none) & ranks+=($!)
done
for p in "${ranks[@]}"; do wait "$p"; done
echo "step" > "$a/step.tmp/.metadata"; sync "$a/step.tmp/.metadata"
mv "$a/step.tmp" "$a/step"
t1=$(now)
rows+=("| checkpoint save: 8 ranks × $shard MiB (4 per node) + fsync + rename | $(rate "$((8 * shard))" "$t0" "$t1") MiB/s |")

# The owner killed -9 under a stream of fsynced files, and started again.
kill_owner_mid_stream "$a/stream" "$work/saved"
sleep 1
start_owner
wait "$writer"; t1=$(now)
bad=$(whole "$b/stream" "$work/saved")
rows+=("| owner killed -9 at file 8 of 40 (4 MiB, fsync each), restarted 1 s later | $bad on c2; the writer finished $(secs "$t0" "$t1") s after the kill, no remount |")

# Take-over: the owner killed -9 again, and a new owner started on another
# host (its own network namespace and address) with --take-over; the
# clients find it through the owner record in the disk.
owner2_ip=10.77.0.5
kill_owner_mid_stream "$a/stream2" "$work/saved2"
serve_on owner2 "$work/disk" --branch main --listen "$owner2_ip:7070" --token-file "$work/token" --take-over
wait "$writer"; t1=$(now)
bad=$(whole "$b/stream2" "$work/saved2")
owner_now=$(on c2 "$arbor" status "$b" --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["owner"])')
[ "$owner_now" = "$owner2_ip:7070" ] || { echo "c2 did not follow the new owner (it names $owner_now)" >&2; exit 1; }
rows+=("| owner killed -9 at file 8 of 40, a new owner on another host with --take-over | $bad on c2; the writer finished $(secs "$t0" "$t1") s after the kill; both clients on $owner_now, no remount |")

echo
echo "### arbor serve --branch across network namespaces (owner 0.2 ms from two client nodes, $mib MiB)"
echo
echo "| what | result |"
echo "| --- | --- |"
printf '%s\n' "${rows[@]}"
