//! The shared chunk cache (`arbor serve`) on a network shaped like a real
//! one: the bucket 20 ms round trip away, the cache server 0.2 ms, each
//! through a delaying proxy (this kernel has no netem). The S3 server is a
//! real s3s-fs; the cache server and its clients are arbor's own code in
//! this process, reading through the bucket tier (no FUSE: the kernel's
//! part is the same on every path compared here).
//!
//! `cargo run --release -p arbor-benches --bin cache_bench [DIR]`
//! (`ARBOR_BENCH_MIB`, default 512: the dataset; `ARBOR_BENCH_RANDOM`,
//! default 300: random reads per path). Prints a markdown table.

use arbor_benches::{percentile_us, print_table, Rng, Row};
use arbor_engine::bucket::{ObjectStore, S3Store};
use arbor_engine::chunks::ChunkSource;
use arbor_engine::head::HeadDevice;
use arbor_engine::testkit::{Proxy, S3Server};
use arbor_engine::tier::{BucketDevice, SegmentCache, TierConfig};
use arbor_engine::volume::{Config, Volume, ROOT_INO};
use arbor_net::{CacheClient, CacheServer, ClientOptions, Running, ServerOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
const TOKEN: &str = "bench-token";

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn fresh(base: &Path, name: &str) -> PathBuf {
    let p = base.join(name);
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).expect("mkdir");
    p
}

fn cfg(read_only: bool) -> Config {
    Config { commit_interval: None, read_only, ..Config::default() }
}

fn store_at(server: &S3Server, endpoint: String) -> Arc<dyn ObjectStore> {
    let mut c = server.config("cache-bench");
    c.endpoint = Some(endpoint);
    Arc::new(S3Store::open(&c).expect("s3"))
}

/// A reader: a volume on its own empty cache, through `peers` or not.
fn reader(store: &Arc<dyn ObjectStore>, cache: &Path, peers: Option<Arc<CacheClient>>, read_ahead: u64) -> Arc<Volume> {
    let tier = TierConfig { read_ahead, peers: peers.map(|p| p as Arc<dyn ChunkSource>), ..TierConfig::default() };
    let dev = BucketDevice::open(store.clone(), cache, tier).expect("device");
    Volume::open(HeadDevice::new(dev, store.clone(), "main"), cfg(true)).expect("volume")
}

fn read_seq(vol: &Volume, len: u64) -> f64 {
    let ino = vol.lookup(ROOT_INO, b"data").expect("lookup").ino;
    let t = Instant::now();
    let mut off = 0;
    while off < len {
        let n = vol.read(ino, off, MIB).expect("read").len() as u64;
        assert!(n > 0, "short file");
        off += n;
    }
    len as f64 / MIB as f64 / t.elapsed().as_secs_f64()
}

/// 4 KiB reads, each in a chunk not read before (so each misses the
/// reader's own cache): at most one per MiB of the file.
fn random_reads(vol: &Volume, len: u64, n: usize, seed: u64) -> Vec<Duration> {
    let ino = vol.lookup(ROOT_INO, b"data").expect("lookup").ino;
    let mut rng = Rng::new(seed);
    let mut chunks: Vec<u64> = (0..len / MIB as u64).collect();
    for i in (1..chunks.len()).rev() {
        chunks.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut lat: Vec<Duration> = chunks
        .into_iter()
        .take(n)
        .map(|chunk| {
            let off = chunk * MIB as u64 + (rng.next_u64() % (MIB as u64 / 4096)) * 4096;
            let t = Instant::now();
            let got = vol.read(ino, off, 4096).expect("read");
            let d = t.elapsed();
            assert_eq!(got.len(), 4096);
            d
        })
        .collect();
    lat.sort();
    lat
}

/// "p50 … µs, p99 … µs" of sorted latencies `lat`, then `what`.
fn p50_p99(lat: &[Duration], what: &str) -> String {
    format!("p50 {:.0} µs, p99 {:.0} µs{what}", percentile_us(lat, 50.0), percentile_us(lat, 99.0))
}

/// A row of two latency samples (sorted, each with what it is), compared
/// by their medians; reported, no target.
fn latency_row(name: &str, baseline: (&[Duration], &str), arbor: (&[Duration], &str)) -> Row {
    Row {
        name: name.into(),
        baseline: p50_p99(baseline.0, baseline.1),
        arbor: p50_p99(arbor.0, arbor.1),
        ratio: percentile_us(baseline.0, 50.0) / percentile_us(arbor.0, 50.0),
        target: "report".into(),
    }
}

/// The largest segment in `store`, and its size.
fn largest_segment(store: &Arc<dyn ObjectStore>) -> (arbor_engine::format::SegId, u64) {
    store
        .list("segments/")
        .expect("list")
        .iter()
        .filter_map(|k| Some((arbor_engine::layout::segment_of_key(k)?, store.size(k).ok()?)))
        .max_by_key(|s| s.1)
        .expect("a segment")
}

/// `n` round trips of a 16-byte ask and a 4 KiB answer through a proxy
/// holding each direction back `one_way_us` (none: straight to the
/// echoing thread), sorted.
fn echo_round_trips(one_way_us: u64, n: usize) -> Vec<Duration> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let echo = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let _ = s.set_nodelay(true);
        let (mut ask, answer) = ([0u8; 16], vec![7u8; 4096]);
        while s.read_exact(&mut ask).is_ok() {
            if s.write_all(&answer).is_err() {
                break;
            }
        }
    });
    let proxy = Proxy::start(addr, Duration::from_micros(one_way_us)).expect("proxy");
    let to = if one_way_us == 0 { addr } else { proxy.addr().parse().expect("addr") };
    let mut s = std::net::TcpStream::connect(to).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let mut answer = vec![0u8; 4096];
    let mut lat: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            s.write_all(&[1; 16]).expect("ask");
            s.read_exact(&mut answer).expect("answer");
            t.elapsed()
        })
        .collect();
    drop(s);
    let _ = echo.join();
    lat.sort();
    lat
}

/// A server on its own runtime thread, over `store`, cache in `dir`.
fn serve(store: Arc<dyn ObjectStore>, dir: &Path) -> Running {
    let cache = SegmentCache::open(store, dir, 64 << 30).expect("cache");
    let server = CacheServer::new(cache, ServerOptions { token: TOKEN.into(), ..ServerOptions::default() });
    server.spawn("127.0.0.1:0").expect("serve")
}

fn client(addrs: &[String]) -> Arc<CacheClient> {
    Arc::new(
        CacheClient::new(ClientOptions {
            servers: addrs.to_vec(),
            token: TOKEN.into(),
            timeout: Duration::from_secs(10),
            tls: None,
        })
        .expect("client"),
    )
}

fn main() {
    let base = std::env::args().nth(1).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("target/bench-cache"));
    let mib = env_usize("ARBOR_BENCH_MIB", 512);
    let n_random = env_usize("ARBOR_BENCH_RANDOM", 300);
    let len = (mib * MIB) as u64;
    let Some(s3) = S3Server::start(&fresh(&base, "s3")).expect("s3s-fs") else {
        eprintln!("cache_bench needs s3s-fs");
        std::process::exit(2);
    };
    let bucket_proxy =
        Proxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], s3.port)), Duration::from_millis(10)).expect("proxy");
    let direct = store_at(&s3, s3.endpoint());
    let far = store_at(&s3, bucket_proxy.endpoint());
    eprintln!("writing {mib} MiB");
    {
        let dev = BucketDevice::open(direct.clone(), &fresh(&base, "writer"), TierConfig::default()).expect("dev");
        let vol = Volume::open(HeadDevice::new(dev, direct.clone(), "main"), cfg(false)).expect("vol");
        let ino = vol.create(ROOT_INO, b"data", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
        let block: Vec<u8> = (0..MIB).map(|i| (i * 31 % 251) as u8).collect();
        for i in 0..mib {
            vol.write(ino, (i * MIB) as u64, &block).expect("write");
        }
        vol.close().expect("close");
    }

    // The server, 0.2 ms round trip from its clients, warmed by one reader.
    let served = serve(far.clone(), &fresh(&base, "server"));
    // ARBOR_BENCH_SERVER_US=0: no proxy in front of the server at all.
    let server_us = env_usize("ARBOR_BENCH_SERVER_US", 100) as u64;
    let server_proxy = Proxy::start(served.addr, Duration::from_micros(server_us)).expect("proxy");
    let near = if server_us == 0 { vec![served.addr.to_string()] } else { vec![server_proxy.addr()] };
    eprintln!("warming the server");
    read_seq(&reader(&far, &fresh(&base, "warm"), Some(client(&near)), 4 << 20), len);

    // The wire alone: warm chunks fetched by the client, nothing else.
    let wire = |framed: bool| {
        let c = client(&near);
        c.set_framed(framed);
        // The largest segment's first chunks (all whole 1 MiB chunks).
        let (seg, size) = largest_segment(&far);
        let n = ((size / MIB as u64).saturating_sub(1)).clamp(1, 32);
        let mut lat = Vec::new();
        for i in 0..200u64 {
            let want = [arbor_engine::chunks::ChunkRequest { index: (i % n) as u32, range: 0..MIB as u64 }];
            let t = Instant::now();
            let got = c.fetch(seg, &want);
            lat.push(t.elapsed());
            assert!(got[0].is_some(), "a warm chunk");
        }
        lat.sort();
        lat
    };
    let (wire, wire_http) = (wire(true), wire(false));
    // The same for 4 KiB parts of those chunks (what a random read asks),
    // on chunk connections and over HTTP/2.
    let wire_part = |framed: bool| {
        let c = client(&near);
        c.set_framed(framed);
        let (seg, size) = largest_segment(&far);
        let n = ((size / MIB as u64).saturating_sub(1)).clamp(1, 32);
        let mut lat = Vec::new();
        for i in 0..300u64 {
            let at = (i * 7 % 256) * 4096;
            let t = Instant::now();
            let got = c.fetch_part(seg, (i % n) as u32, at..at + 4096);
            lat.push(t.elapsed());
            assert_eq!(got.map(|b| b.len()), Some(4096), "a warm part");
        }
        lat.sort();
        lat
    };
    let (wire_part, wire_part_http) = (wire_part(true), wire_part(false));
    // The network alone: 4 KiB answers to 16-byte asks from an echo
    // thread behind a proxy like the server's (its floor, whatever arbor
    // does).
    let wire_floor = echo_round_trips(server_us, 300);

    eprintln!("random 4 KiB reads");
    let via_server = random_reads(&reader(&far, &fresh(&base, "r1"), Some(client(&near)), 0), len, n_random, 1);
    let via_bucket = random_reads(&reader(&far, &fresh(&base, "r2"), None, 0), len, n_random / 3, 2);

    eprintln!("cold sequential reads");
    // Each timed phase starts with free memory the guest has touched
    // (`touch_memory`): the reads land up to `len` in the page cache.
    let touch = || arbor_benches::touch_memory(&base, 2 * len as usize);
    let server_reader = reader(&far, &fresh(&base, "s1"), Some(client(&near)), 4 << 20);
    touch();
    let seq_server = read_seq(&server_reader, len);
    drop(server_reader);
    let http_client = client(&near);
    http_client.set_framed(false);
    let server_reader = reader(&far, &fresh(&base, "s1-http"), Some(http_client), 4 << 20);
    touch();
    let seq_server_http = read_seq(&server_reader, len);
    drop(server_reader);
    let bucket_reader = reader(&far, &fresh(&base, "s2"), None, 4 << 20);
    touch();
    let seq_bucket = read_seq(&bucket_reader, len);
    touch();
    let seq_local = read_seq(&bucket_reader, len);
    // The same local cache, its files no longer in memory: a cold read of
    // the client's own disk, as after a reboot or with a dataset larger
    // than the page cache. Only the client's files are dropped; the
    // server's stay in memory, as a warm server's would.
    arbor_benches::evict_dir(&base.join("s2"));
    touch();
    let seq_local_disk = read_seq(&bucket_reader, len);
    drop(bucket_reader);

    // A memory-only client: a dataset four times its cache, read twice.
    let limit = len / 4;
    let rss_before = arbor_benches::resident_bytes().unwrap_or(0);
    let (mem_cached, rss_growth) = {
        let store = far.clone();
        let tier = TierConfig {
            read_ahead: 4 << 20,
            cache_size: limit,
            memory_cache: true,
            peers: Some(client(&near) as Arc<dyn ChunkSource>),
            ..TierConfig::default()
        };
        let dev = BucketDevice::open(store.clone(), &fresh(&base, "memory-client"), tier).expect("device");
        let vol = Volume::open(HeadDevice::new(dev.clone(), store, "main"), cfg(true)).expect("volume");
        read_seq(&vol, len);
        read_seq(&vol, len);
        let rss = arbor_benches::resident_bytes().unwrap_or(0).saturating_sub(rss_before);
        (dev.stats().cache.cached_bytes, rss)
    };

    let mut pulled = Vec::new();
    let counts: Vec<usize> = if env_usize("ARBOR_BENCH_SKIP_N", 0) == 1 { vec![] } else { vec![1, 2, 4, 8] };
    for n in counts {
        eprintln!("{n} clients on a cold server");
        let served = serve(far.clone(), &fresh(&base, &format!("server-{n}")));
        let proxy = Proxy::start(served.addr, Duration::from_micros(100)).expect("proxy");
        let before = bucket_proxy.sent();
        std::thread::scope(|s| {
            for c in 0..n {
                let (far, base, addr) = (far.clone(), base.clone(), proxy.addr());
                s.spawn(move || {
                    read_seq(&reader(&far, &fresh(&base, &format!("n{n}-{c}")), Some(client(&[addr])), 4 << 20), len)
                });
            }
        });
        pulled.push((n, (bucket_proxy.sent() - before) as f64 / len as f64));
        drop(proxy);
        drop(served);
        let _ = std::fs::remove_dir_all(base.join(format!("server-{n}")));
        for c in 0..n {
            let _ = std::fs::remove_dir_all(base.join(format!("n{n}-{c}")));
        }
    }
    let metrics = served.server.metrics_text();
    let hits = arbor_net::metric_sample(&metrics, "arbor_cache_hits_total").unwrap_or(0.0);

    let mut rows = vec![
        latency_row(
            "1 MiB warm chunk, client ↔ server alone (no volume, no bucket)",
            (&wire_http, " over HTTP/2"),
            (&wire, " on a chunk connection"),
        ),
        latency_row(
            "4 KiB part of a warm chunk, client ↔ server alone, HTTP/2 vs chunk connection",
            (&wire_part_http, " over HTTP/2"),
            (&wire_part, " on a chunk connection"),
        ),
        latency_row(
            "4 KiB part of a warm chunk, client ↔ server alone, vs the network alone",
            (&wire_floor, ": the network alone (4 KiB echoed through the same proxy)"),
            (&wire_part, ""),
        ),
        Row {
            name: "4 KiB random read, p50 (miss the client, hit the server)".into(),
            baseline: format!("{:.0} µs from the bucket", percentile_us(&via_bucket, 50.0)),
            arbor: format!("{:.0} µs via the server", percentile_us(&via_server, 50.0)),
            ratio: percentile_us(&via_bucket, 50.0) / percentile_us(&via_server, 50.0),
            target: "p50 ≤ 500 µs".into(),
        },
        Row {
            name: "4 KiB random read, p99".into(),
            baseline: format!("{:.0} µs from the bucket", percentile_us(&via_bucket, 99.0)),
            arbor: format!("{:.0} µs via the server", percentile_us(&via_server, 99.0)),
            ratio: percentile_us(&via_bucket, 99.0) / percentile_us(&via_server, 99.0),
            target: "report".into(),
        },
        Row {
            name: format!("cold sequential read of {mib} MiB, warm server vs the bucket"),
            baseline: format!("{seq_bucket:.0} MiB/s from the bucket"),
            arbor: format!("{seq_server:.0} MiB/s via the server"),
            ratio: seq_server / seq_bucket,
            target: "≥ 2".into(),
        },
        Row {
            name: format!("cold sequential read of {mib} MiB via the warm server, HTTP/2 vs chunk connections"),
            baseline: format!("{seq_server_http:.0} MiB/s over HTTP/2"),
            arbor: format!("{seq_server:.0} MiB/s on chunk connections"),
            ratio: seq_server / seq_server_http,
            target: "report".into(),
        },
        Row {
            name: format!("cold sequential read of {mib} MiB, warm server vs the client's warm cache"),
            baseline: format!("{seq_local:.0} MiB/s from the local cache"),
            arbor: format!("{seq_server:.0} MiB/s via the server"),
            ratio: seq_server / seq_local,
            target: "≥ 0.7".into(),
        },
        Row {
            name: "same, the client's cache read from its disk (its files evicted from the page cache)".into(),
            baseline: format!("{seq_local_disk:.0} MiB/s from the local cache's disk"),
            arbor: format!("{seq_server:.0} MiB/s via the server"),
            ratio: seq_server / seq_local_disk,
            target: "≥ 0.7".into(),
        },
    ];
    for (n, x) in &pulled {
        rows.push(Row {
            name: format!("bucket bytes pulled, {n} clients at once on a cold server"),
            baseline: format!("{n}× the dataset without a server"),
            arbor: format!("{x:.3}× the dataset"),
            ratio: *n as f64 / x,
            target: "≈ 1× for every N".into(),
        });
    }
    rows.push(Row {
        name: format!("memory-only client, {mib} MiB read twice through a {} MiB memory cache", limit >> 20),
        baseline: format!("limit {} MiB", limit >> 20),
        arbor: format!("chunks in memory {} MiB, process RSS +{} MiB", mem_cached >> 20, rss_growth >> 20),
        ratio: (mem_cached + rss_growth) as f64 / limit as f64,
        target: "≤ 1 + fixed overhead".into(),
    });
    print_table("arbor serve: the bucket 20 ms away, the server 0.2 ms (ratio: higher is better)", &rows);
    println!("\n(server hits during the single-client runs: {hits:.0})");
}
