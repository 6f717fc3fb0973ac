#!/bin/bash
# arbor serve with every party on a host of its own: network namespaces
# joined by a bridge (veth pairs), the bucket (s3s-fs) 20 ms away behind a
# delaying proxy that counts what it sends, a cache server 0.2 ms away, and
# client nodes mounting a checkpoint through FUSE. Kills the server with -9
# in the middle of a client's reads. Prints markdown tables: the bytes the
# bucket served and the time each phase took, 4 KiB random reads, cold
# sequential reads against the bucket and the client's own cache, the
# memory of a memory-only client, and the CPU each read cost.
#
#   benches/cache_netns.sh [MIB]     (root; s3s-fs; openssl; arbor and delay_proxy built)
#
# ARBOR / PROXY point at the binaries (default: target/release). Everything
# it starts it stops, and it removes its namespaces, bridge and folders.
#
# TLS=on: the cache server speaks TLS (a CA and a certificate made here
# with openssl) and every client trusts its CA (default: off). Whatever
# TLS is, phase H reads the dataset through the warm server with TLS off
# and on, TLS_ROUNDS times each (default 3, alternating; 0: no phase H),
# and reports the median of each and their ratio. ONLY_TLS=1 runs only
# what phase H needs (the writer, the cold server of phase B, then H).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
mib=${1:-256}
files=4
. "$here/benches/netns.sh"
. "$here/benches/common.sh"
netns_bench netns bucket cache writer c1 c2
bucket_ip=10.77.0.2 cache_ip=10.77.0.3

start_bucket "$bucket_ip"
disk=s3://arbor-test/netns
tls_rounds=${TLS_ROUNDS:-3}
only_tls=${ONLY_TLS:-0}
server_tls=${TLS:-off} client_tls=${TLS:-off}

# A CA and the cache server's certificate, for its address.
mkdir -p "$work/tls"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=arbor-bench-ca \
  -keyout "$work/tls/ca.key" -out "$work/tls/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=cache \
  -keyout "$work/tls/server.key" -out "$work/tls/server.csr" 2>/dev/null
openssl x509 -req -in "$work/tls/server.csr" -CA "$work/tls/ca.pem" -CAkey "$work/tls/ca.key" -CAcreateserial -days 2 \
  -extfile <(printf 'subjectAltName=IP:%s\n' "$cache_ip") -out "$work/tls/server.pem" 2>/dev/null

# The writer: a dataset, checkpoint v1, unmount (uploads everything).
XDG_CACHE_HOME=$(node writer) on writer "$arbor" init "$disk" >/dev/null
mkdir -p "$work/mnt-writer"
XDG_CACHE_HOME=$(node writer) on writer "$arbor" mount "$disk" "$work/mnt-writer" >/dev/null; mounts+=("$work/mnt-writer")
for f in $(seq "$files"); do head -c "$((mib / files))M" /dev/urandom > "$work/mnt-writer/shard-$f.bin"; done
sync
(cd "$work/mnt-writer" && sha256sum shard-*.bin) > "$work/sums"
XDG_CACHE_HOME=$(node writer) "$arbor" checkpoints create "$work/mnt-writer" v1 >/dev/null
XDG_CACHE_HOME=$(node writer) "$arbor" unmount "$work/mnt-writer" >/dev/null
dataset=$(( mib * 1048576 ))

mount_client() { # host name [extra args…]: mounts checkpoint v1 on a fresh cache
  local h=$1 name=$2 tls=(); shift 2
  # A client of the cache server trusts its CA when the server speaks TLS.
  case " $* " in *" --cache-server="*) [ "$client_tls" = on ] && tls=(--tls-ca "$work/tls/ca.pem") ;; esac
  mkdir -p "$work/mnt-$name"
  XDG_CACHE_HOME=$(node "$name") on "$h" "$arbor" mount "$disk" "$work/mnt-$name" --checkpoint v1 "$@" "${tls[@]}" >/dev/null
  mounts+=("$work/mnt-$name")
}
check() { (cd "$work/mnt-$1" && sha256sum -c --quiet "$work/sums") || { echo "client $1 read wrong bytes" >&2; exit 1; }; }
unmount_client() { XDG_CACHE_HOME=$(node "$1") "$arbor" unmount "$work/mnt-$1" >/dev/null; }
rows=()
row() { rows+=("| $1 | $(echo "scale=3; $2 / $dataset" | bc)× the dataset ($2 B) | $(printf %.1f "$3") s | $4 |"); }

start_server() {
  local tls=()
  [ "$server_tls" = on ] && tls=(--tls-cert "$work/tls/server.pem" --tls-key "$work/tls/server.key")
  # nsenter itself, not the `on` function (a subshell): $! must be the server.
  XDG_CACHE_HOME=$(node cache) nsenter --net=/run/netns/arb-cache "$arbor" serve "$disk" --listen "$cache_ip:7070" --cache-dir "$work/server-cache" \
    --token-file "$work/token" "${tls[@]}" --foreground 2>>"$work/serve.log" & server_pid=$!; pids+=($server_pid)
  wait_port c1 "$cache_ip" 7070
}
servers="--cache-server=$cache_ip:7071"
on cache "$proxy" "$cache_ip:7071" "$cache_ip:7070" 100 "$work/served-bytes" & pids+=($!)

# A: two clients, no server.
if [ "$only_tls" = 0 ]; then
b0=$(bucket_bytes); t0=$(now)
mount_client c1 a1; mount_client c2 a2
check a1 & r1=$!; check a2 & r2=$!; wait "$r1"; wait "$r2"
row "2 clients, no cache server" $(( $(bucket_bytes) - b0 )) "$(echo "$(now) - $t0" | bc)" "each pulls the whole dataset"
unmount_client a1; unmount_client a2
fi

# B: two clients through one cold server.
start_server
b0=$(bucket_bytes); t0=$(now)
mount_client c1 b1 "$servers" --token-file "$work/token"; mount_client c2 b2 "$servers" --token-file "$work/token"
check b1 & r1=$!; check b2 & r2=$!; wait "$r1"; wait "$r2"
row "2 clients through a cold server" $(( $(bucket_bytes) - b0 )) "$(echo "$(now) - $t0" | bc)" "each chunk from the bucket once"
unmount_client b1; unmount_client b2

if [ "$only_tls" = 0 ]; then
# C: a new client, the server warm, then killed -9 in the middle of its
# reads (once it has sent a quarter of the dataset to this client).
b0=$(bucket_bytes); t0=$(now); s0=$(cat "$work/served-bytes")
mount_client c1 c1 "$servers" --token-file "$work/token" --read-ahead 0
check c1 & reader=$!
for _ in $(seq 3000); do
  [ $(( $(cat "$work/served-bytes") - s0 )) -ge $(( dataset / 4 )) ] && break
  sleep 0.01
done
kill9 "$server_pid"
served_before_kill=$(( $(cat "$work/served-bytes") - s0 ))
wait "$reader"
fallbacks=$(XDG_CACHE_HOME=$(node c1) "$arbor" status "$work/mnt-c1" | grep "cache server" || true)
row "1 client, server killed -9 after sending it $(( served_before_kill >> 20 )) MiB" $(( $(bucket_bytes) - b0 )) "$(echo "$(now) - $t0" | bc)" "read on from the bucket, every byte checked: ${fallbacks#*: }"
unmount_client c1

# D: the server restarted on its cache folder; a new client.
start_server
b0=$(bucket_bytes); t0=$(now)
mount_client c2 d2 "$servers" --token-file "$work/token"
check d2
row "1 new client, the server restarted on its cache" $(( $(bucket_bytes) - b0 )) "$(echo "$(now) - $t0" | bc)" "the restarted server serves its own disk"
unmount_client d2

# E: 4 KiB random reads through FUSE on a fresh client (each in a MiB of
# the dataset not read before, readahead off by fadvise): through the warm
# server, then a client without one (the bucket directly).
random_reads() { # name count: "p50 p99" in µs
  python3 - "$work/mnt-$1" "$2" <<'PY'
import os, random, sys, time
root, n = sys.argv[1], int(sys.argv[2])
files = sorted(os.path.join(root, f) for f in os.listdir(root) if f.startswith("shard-"))
spots = [(f, mib) for f in files for mib in range(os.path.getsize(f) >> 20)]
random.Random(7).shuffle(spots)
lat, fds = [], {f: os.open(f, os.O_RDONLY) for f in files}
for fd in fds.values():
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
for f, mib in spots[:n]:
    off = (mib << 20) + random.Random(mib).randrange(256) * 4096
    t = time.perf_counter()
    got = os.pread(fds[f], 4096, off)
    lat.append(time.perf_counter() - t)
    if lat[-1] > 0.01: print(f"slow read {len(lat)} {f} {mib} {lat[-1]*1e3:.1f} ms", file=sys.stderr)
    assert len(got) == 4096
lat.sort()
print(f"{lat[len(lat) // 2] * 1e6:.0f} {lat[min(len(lat) - 1, len(lat) * 99 // 100)] * 1e6:.0f}")
PY
}
n_random=$(( mib < 200 ? mib : 200 ))
# (A command substitution waits for the reader to exit, so nothing holds
# the mount when it is unmounted.)
mount_client c1 e1 "$servers" --token-file "$work/token"
got=$(random_reads e1 "$n_random"); read -r p50 p99 <<< "$got"; XDG_CACHE_HOME=$(node e1) "$arbor" status "$work/mnt-e1" >&2
unmount_client e1
mount_client c2 e2
got=$(random_reads e2 $(( n_random / 4 ))); read -r b50 b99 <<< "$got"
unmount_client e2
random_row="| $n_random × 4 KiB random reads on a new client (FUSE) | p50 $p50 µs, p99 $p99 µs through the warm server | p50 $b50 µs, p99 $b99 µs from the bucket ($(( n_random / 4 )) reads) | target p50 ≤ 500 µs |"
fi

# F: cold sequential reads through FUSE, each phase on touched memory
# (common.sh): a new client through the warm server; a client without one
# (the bucket itself); that client remounted on its own warm cache, first
# with its cache files in the page cache, then with the page cache dropped
# (its cache read from its disk). `cat`, not `sha256sum` (which caps a
# read near 330 MiB/s here); the bytes are checked after, from the page
# cache.
# CPU time in clock ticks: of processes (user + system, all their threads),
# and of the whole machine ("busy total": every CPU's busy ticks, and all).
proc_ticks() { local t=0 p; for p in "$@"; do [ -r "/proc/$p/stat" ] && t=$(( t + $(awk '{print $14 + $15}' "/proc/$p/stat") )); done; echo "$t"; }
machine_ticks() { awk '/^cpu /{b = $2 + $3 + $4 + $7 + $8 + $9; print b, b + $5 + $6}' /proc/stat; }
hz=$(getconf CLK_TCK)
per_mib() { echo "scale=2; $1 * 1000 / $hz / $mib" | bc; } # ticks -> ms per MiB of the dataset
seq_read() { # name: "MiB/s bucket-bytes client server proxy machine busy-%" (CPU in ms per MiB) for reading every shard once
  local t0 t1 b0 client proxies c0 s0 p0 m0 a0 m1 a1 c s p perf=
  touch_memory "$work" $(( 2 * mib ))
  # The client's mount, and the proxy in front of the cache server.
  client=$(pgrep -f -- "mount $disk $work/mnt-$1 " | tr '\n' ' ')
  proxies=$(pgrep -f -- "delay_proxy $cache_ip:7071" | tr '\n' ' ')
  if [ -n "${PERF_OUT:-}" ] && [ "$1" = f1 ]; then
    # PERF_OUT=FILE: a system-wide profile of the warm-server read. perf
    # starts first (it takes a second to set up, which the read's time
    # must not include) and stops when the read ends.
    perf record -a -g -o "$PERF_OUT" 2>"$work/perf.log" & perf=$!
    sleep 2
  fi
  c0=$(proc_ticks $client); s0=$(proc_ticks "$server_pid"); p0=$(proc_ticks $proxies); read -r m0 a0 <<< "$(machine_ticks)"
  b0=$(bucket_bytes); t0=$(now)
  cat "$work/mnt-$1"/shard-*.bin > /dev/null
  t1=$(now)
  c=$(( $(proc_ticks $client) - c0 )); s=$(( $(proc_ticks "$server_pid") - s0 )); p=$(( $(proc_ticks $proxies) - p0 ))
  read -r m1 a1 <<< "$(machine_ticks)"
  [ -z "$perf" ] || { kill -INT "$perf"; wait "$perf" || true; }
  echo "$(rate "$mib" "$t0" "$t1") $(( $(bucket_bytes) - b0 )) $(per_mib $c) $(per_mib $s) $(per_mib $p) $(per_mib $(( m1 - m0 ))) $(( 100 * (m1 - m0) / (a1 - a0 > 0 ? a1 - a0 : 1) ))"
}
ratio() { python3 -c "import sys; print(f'{float(sys.argv[1]) / float(sys.argv[2]):.2f}')" "$@"; }
if [ "$only_tls" = 0 ]; then
mount_client c1 f1 "$servers" --token-file "$work/token"
read -r seq_server bytes_server cpu_server <<< "$(seq_read f1)"; check f1; unmount_client f1
mount_client c2 f2
read -r seq_bucket bytes_bucket cpu_bucket <<< "$(seq_read f2)"; check f2; unmount_client f2
mount_client c2 f2
read -r seq_local bytes_local cpu_local <<< "$(seq_read f2)"; check f2; unmount_client f2
drop_caches
mount_client c2 f2
read -r seq_disk bytes_disk cpu_disk <<< "$(seq_read f2)"; check f2; unmount_client f2

# G: a memory-only client (no cache folder, chunks in anonymous memory
# files) with a memory cache a quarter of the dataset reads all of it
# through the warm server. Its memory is sampled every 50 ms while it
# reads: resident pages (VmRSS) and the pages its memory files hold, which
# VmRSS does not count (they are never mapped).
mem_now() { # pid: "rss memfd" in bytes
  local f b n memfd=0 rss
  rss=$(awk '/^VmRSS:/{print $2 * 1024}' "/proc/$1/status" 2>/dev/null || echo 0)
  for f in /proc/"$1"/fd/*; do
    case "$(readlink "$f" 2>/dev/null)" in
      /memfd:arbor-*) read -r b n <<< "$(stat -L -c '%b %B' "$f" 2>/dev/null || echo "0 0")"; memfd=$(( memfd + b * n )) ;;
    esac
  done
  echo "${rss:-0} $memfd"
}
cache_mem=$(( mib / 4 ))
mount_client c1 g1 "$servers" --token-file "$work/token" --cache-dir none --cache-memory "${cache_mem}M"
client=$(pgrep -f -- "mount $disk $work/mnt-g1 " | head -1)
s0=$(cat "$work/served-bytes"); b0=$(bucket_bytes)
check g1 & reader=$!
peak_rss=0 peak_mem=0 peak_sum=0
for _ in $(seq 6000); do # at most 5 minutes
  read -r r m <<< "$(mem_now "$client")"
  (( r > peak_rss )) && peak_rss=$r
  (( m > peak_mem )) && peak_mem=$m
  (( r + m > peak_sum )) && peak_sum=$(( r + m ))
  kill -0 "$reader" 2>/dev/null || break
  sleep 0.05
done
wait "$reader"
hwm=$(awk '/^VmHWM:/{print $2 * 1024}' "/proc/$client/status")
mem_served=$(( $(cat "$work/served-bytes") - s0 )); mem_bucket=$(( $(bucket_bytes) - b0 ))
unmount_client g1
mem_row="| a memory-only client, \`--cache-memory ${cache_mem}M\`, reading the $mib MiB once through the warm server | $(( peak_sum >> 20 )) MiB at most (resident $(( peak_rss >> 20 )) MiB, peak $(( hwm >> 20 )) MiB; memory files $(( peak_mem >> 20 )) MiB) | $(( mem_served >> 20 )) MiB from the server, $mem_bucket B from the bucket | the cache size plus a fixed overhead |"
fi

# H: TLS off against on. Each round restarts the warm server on its cache
# folder without TLS, then with it, and a new client reads the dataset
# through it; the medians of the rounds, and on ÷ off.
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
tls_rates=() plain_rates=() tls_cpu=() plain_cpu=() tls_bucket=0 plain_bucket=0
for round in $(seq "$tls_rounds"); do
  for mode in off on; do
    kill -TERM "$server_pid"; wait "$server_pid" 2>/dev/null || true
    server_tls=$mode client_tls=$mode
    start_server
    mount_client c1 "h$round$mode" "$servers" --token-file "$work/token"
    read -r rate from_bucket _ srv _ <<< "$(seq_read "h$round$mode")"; check "h$round$mode"; unmount_client "h$round$mode"
    if [ "$mode" = on ]; then
      tls_rates+=("$rate"); tls_cpu+=("$srv"); tls_bucket=$(( tls_bucket + from_bucket ))
    else
      plain_rates+=("$rate"); plain_cpu+=("$srv"); plain_bucket=$(( plain_bucket + from_bucket ))
    fi
  done
done
server_tls=${TLS:-off} client_tls=${TLS:-off}
if [ "$tls_rounds" -gt 0 ]; then
  tls_med=$(median "${tls_rates[@]}") plain_med=$(median "${plain_rates[@]}")
  tls_row="| TLS off | ${plain_rates[*]} | $plain_med | $(median "${plain_cpu[@]}") | $plain_bucket B | — |"
  tls_row2="| TLS on | ${tls_rates[*]} | $tls_med | $(median "${tls_cpu[@]}") | $tls_bucket B | $(ratio "$tls_med" "$plain_med")× |"
fi

echo
echo "### arbor serve across network namespaces ($mib MiB dataset; bucket 20 ms away, server 0.2 ms; TLS ${TLS:-off})"
if [ "$tls_rounds" -gt 0 ]; then
  echo
  echo "| a new client reading $mib MiB through the warm server (FUSE, cold client) | MiB/s, each round | median MiB/s | server CPU per MiB (ms, median) | from the bucket, all rounds | on ÷ off |"
  echo "| --- | ---: | ---: | ---: | ---: | ---: |"
  echo "$tls_row"
  echo "$tls_row2"
fi
[ "$only_tls" = 0 ] || exit 0
echo
echo "| phase | bytes the bucket served (counted by its proxy) | time | note |"
echo "| --- | ---: | ---: | --- |"
printf '%s\n' "${rows[@]}"
echo
echo "| reads | arbor serve | no cache server | |"
echo "| --- | ---: | ---: | --- |"
echo "$random_row"
echo
echo "| cold sequential read of $mib MiB through FUSE | MiB/s | from the bucket | warm server ÷ this | target |"
echo "| --- | ---: | ---: | ---: | --- |"
echo "| a new client through the warm server | $seq_server | $bytes_server B | — | |"
echo "| a client without a cache server (the bucket) | $seq_bucket | $bytes_bucket B | $(ratio "$seq_server" "$seq_bucket")× | ≥ 2× |"
echo "| that client remounted on its own warm cache, its files in the page cache | $seq_local | $bytes_local B | $(ratio "$seq_server" "$seq_local")× | ≥ 0.7× |"
echo "| the same, the page cache dropped (its cache read from its disk) | $seq_disk | $bytes_disk B | $(ratio "$seq_server" "$seq_disk")× | ≥ 0.7× |"
# What each read cost in CPU: this machine's two vCPUs run the reader, the
# client, the cache server and the proxies alike, so a read that costs more
# CPU per MiB is slower here however well it overlaps.
cpu_row() { # label "client server proxy machine busy"
  local c s p m b; read -r c s p m b <<< "$2"
  echo "| $1 | $c | $s | $p | $m | $b % |"
}
echo
echo "| memory | resident memory and memory files, sampled every 50 ms | bytes moved | target |"
echo "| --- | ---: | ---: | --- |"
echo "$mem_row"
echo
echo "| CPU per MiB read (ms) | the client's mount | the cache server | the proxy in front of it | the whole machine | the machine busy |"
echo "| --- | ---: | ---: | ---: | ---: | ---: |"
cpu_row "through the warm server" "$cpu_server"
cpu_row "from the bucket" "$cpu_bucket"
cpu_row "own warm cache, page cache" "$cpu_local"
cpu_row "own warm cache, from its disk" "$cpu_disk"
