//! The shared chunk cache in one process: a real server on 127.0.0.1 over
//! HTTP/2, real clients, a volume on the bucket tier reading through them,
//! and a bucket that counts what it sends.

use arbor_engine::bucket::{MemObjectStore, ObjectStore};
use arbor_engine::chunks::{ChunkRequest, ChunkSource};
use arbor_engine::env::TestEnv;
use arbor_engine::head::HeadDevice;
use arbor_engine::source::{FixedSources, Source, SourceReader};
use arbor_engine::testkit::{bytes_under, http_get};
use arbor_engine::tier::{BucketDevice, SegmentCache, TierConfig};
use arbor_engine::volume::{Config, Volume, ROOT_INO};
use arbor_engine::Result;
use arbor_net::{
    metric_sample, CacheClient, CacheServer, ClientOptions, Fault, ObjectScope, Running, ServerOptions, ServerStats,
};
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const TOKEN: &str = "a-shared-secret";
const MIB: usize = 1 << 20;

/// A bucket that counts the bytes of segment data it sends, and of
/// conditional GETs (source objects read by imported files).
struct Counting {
    inner: MemObjectStore,
    segment_bytes: AtomicU64,
    source_bytes: AtomicU64,
    /// The version ids source reads asked for.
    versions: parking_lot::Mutex<Vec<Option<String>>>,
    /// Segment GETs under way now, the most at once, and how long each
    /// is held back (ms; 0: not at all).
    segment_gets: AtomicU64,
    most_segment_gets: AtomicU64,
    segment_delay_ms: AtomicU64,
    /// GETs of segment footers (the tails of segment objects) that found one.
    footer_gets: AtomicU64,
}

impl Counting {
    /// Bytes of segment chunks sent (footers not counted).
    fn sent(&self) -> u64 {
        self.segment_bytes.load(Ordering::Relaxed)
    }
    fn footer_gets(&self) -> u64 {
        self.footer_gets.load(Ordering::Relaxed)
    }
}

impl ObjectStore for Counting {
    fn put(&self, key: &str, body: &[u8]) -> Result<String> {
        self.inner.put(key, body)
    }
    fn put_if_absent(&self, key: &str, body: &[u8]) -> Result<String> {
        self.inner.put_if_absent(key, body)
    }
    fn put_if_match(&self, key: &str, body: &[u8], etag: &str) -> Result<String> {
        self.inner.put_if_match(key, body, etag)
    }
    fn get(&self, key: &str) -> Result<(Vec<u8>, String)> {
        self.inner.get(key)
    }
    fn get_range_if(&self, key: &str, range: Range<u64>, etag: &str, version: Option<&str>) -> Result<Vec<u8>> {
        self.versions.lock().push(version.map(str::to_string));
        let got = self.inner.get_range_if(key, range, etag, version)?;
        self.source_bytes.fetch_add(got.len() as u64, Ordering::Relaxed);
        Ok(got)
    }
    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>> {
        if !key.starts_with("segments/") {
            return self.inner.get_range(key, range);
        }
        let now = self.segment_gets.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_segment_gets.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(self.segment_delay_ms.load(Ordering::Relaxed)));
        let got = self.inner.get_range(key, range);
        self.segment_gets.fetch_sub(1, Ordering::SeqCst);
        let got = got?;
        self.segment_bytes.fetch_add(got.len() as u64, Ordering::Relaxed);
        Ok(got)
    }
    fn list(&self, prefix: &str) -> Result<Vec<String>> {
        self.inner.list(prefix)
    }
    fn size(&self, key: &str) -> Result<u64> {
        self.inner.size(key)
    }
    fn get_tail(&self, key: &str, len: u64) -> Result<(Vec<u8>, u64)> {
        // Looking for a segment that does not exist (yet) is not counted.
        let got = self.inner.get_tail(key, len)?;
        self.footer_gets.fetch_add(1, Ordering::Relaxed);
        Ok(got)
    }
    fn delete(&self, key: &str) -> Result<()> {
        self.inner.delete(key)
    }
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 11) as u8).collect()
}

fn vol_cfg(read_only: bool) -> Config {
    Config { commit_interval: None, read_only, env: TestEnv::new(3), ..Config::default() }
}

/// A bucket holding one file of `mib` MiB on branch main.
fn bucket_with_file(dir: &Path, mib: usize) -> (Arc<Counting>, Vec<u8>) {
    let store = Arc::new(Counting {
        inner: MemObjectStore::new(),
        segment_bytes: AtomicU64::new(0),
        source_bytes: AtomicU64::new(0),
        versions: Default::default(),
        segment_gets: AtomicU64::new(0),
        most_segment_gets: AtomicU64::new(0),
        segment_delay_ms: AtomicU64::new(0),
        footer_gets: AtomicU64::new(0),
    });
    let dyn_store: Arc<dyn ObjectStore> = store.clone();
    let data = pattern(mib * MIB, 7);
    let dev = BucketDevice::open(dyn_store.clone(), &dir.join("writer"), TierConfig::default()).expect("device");
    let vol = Volume::open(HeadDevice::new(dev, dyn_store, "main"), vol_cfg(false)).expect("volume");
    let ino = vol.create(ROOT_INO, b"data", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
    for (i, part) in data.chunks(MIB).enumerate() {
        vol.write(ino, (i * MIB) as u64, part).expect("write");
    }
    vol.close().expect("close");
    store.segment_bytes.store(0, Ordering::Relaxed);
    (store, data)
}

/// A server on 127.0.0.1 with its own runtime; stops when dropped.
struct Server {
    addr: String,
    /// `None`: an address nobody answers on.
    running: Option<Running>,
}

impl Server {
    fn start(store: Arc<Counting>, dir: &Path, fault: Option<Fault>) -> Server {
        let cache = SegmentCache::open(store, dir, 1 << 30).expect("cache");
        Self::start_with(CacheServer::new(
            cache,
            ServerOptions { token: TOKEN.into(), fault, ..ServerOptions::default() },
        ))
    }

    fn start_with(server: Arc<CacheServer>) -> Server {
        Self::start_on(server, "127.0.0.1:0")
    }

    fn start_on(server: Arc<CacheServer>, addr: &str) -> Server {
        let running = server.spawn(addr).expect("serve");
        Server { addr: running.addr.to_string(), running: Some(running) }
    }

    fn metric(&self, name: &str) -> u64 {
        let server = &self.running.as_ref().expect("a running server").server;
        metric_sample(&server.metrics_text(), name).unwrap_or_else(|| panic!("no {name}")) as u64
    }

    /// [`settled`] of metric `name`.
    fn metric_settled(&self, name: &str, want: u64) -> u64 {
        settled(want, || self.metric(name))
    }
}

/// What `read` gives once it gives `want`, or whatever it gives after 5 s:
/// a server counts a chunk once its last byte is sent, so a client that
/// has it can be ahead of the count.
fn settled(want: u64, read: impl Fn() -> u64) -> u64 {
    let t = std::time::Instant::now();
    loop {
        let v = read();
        if v == want || t.elapsed() > Duration::from_secs(5) {
            return v;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn client(servers: &[&Server]) -> Arc<CacheClient> {
    Arc::new(
        CacheClient::new(ClientOptions {
            servers: servers.iter().map(|s| s.addr.clone()).collect(),
            token: TOKEN.into(),
            timeout: Duration::from_secs(5),
            tls: None,
        })
        .expect("client"),
    )
}

/// Reads the whole file through a fresh cache folder and the given client.
fn read_through(store: &Arc<Counting>, cache: &Path, peers: Option<Arc<CacheClient>>, want: &[u8]) {
    let dyn_store: Arc<dyn ObjectStore> = store.clone();
    let tier = TierConfig { peers: peers.map(|c| c as Arc<dyn ChunkSource>), ..TierConfig::default() };
    let dev = BucketDevice::open(dyn_store.clone(), cache, tier).expect("device");
    let vol = Volume::open(HeadDevice::new(dev, dyn_store, "main"), vol_cfg(true)).expect("volume");
    let ino = vol.lookup(ROOT_INO, b"data").expect("lookup").ino;
    let mut got = Vec::with_capacity(want.len());
    while got.len() < want.len() {
        let part = vol.read(ino, got.len() as u64, MIB).expect("read");
        assert!(!part.is_empty(), "short file");
        got.extend_from_slice(&part);
    }
    assert!(got == want, "every byte read through the cache is the file's");
}

/// Bytes of every segment object in the bucket.
fn segments_len(store: &Counting) -> u64 {
    store.list("segments/").expect("list").iter().map(|k| store.size(k).expect("size")).sum()
}

fn total(stats: &[ServerStats], f: impl Fn(&ServerStats) -> u64) -> u64 {
    stats.iter().map(f).sum()
}

#[test]
fn four_readers_through_one_server_pull_each_byte_from_the_bucket_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, data) = bucket_with_file(dir.path(), 24);
    let len = data.len() as u64;
    // Without the server: every reader pulls the whole file.
    for r in 0..2 {
        read_through(&store, &dir.path().join(format!("alone{r}")), None, &data);
    }
    let alone = store.sent();
    assert!(alone >= 2 * len, "two readers alone pulled {alone} bytes of {len}");
    store.segment_bytes.store(0, Ordering::Relaxed);

    let footers_before = store.footer_gets();
    let server = Server::start(store.clone(), &dir.path().join("server"), None);
    let readers: Vec<_> = (0..4)
        .map(|r| {
            let (store, data, c) = (store.clone(), data.clone(), client(&[&server]));
            let cache = dir.path().join(format!("reader{r}"));
            std::thread::spawn(move || {
                read_through(&store, &cache, Some(c.clone()), &data);
                c.stats()
            })
        })
        .collect();
    let stats: Vec<ServerStats> = readers.into_iter().flat_map(|t| t.join().expect("reader")).collect();
    let pulled = store.sent();
    let fetched = server.metric("arbor_cache_bucket_bytes_total");
    // The segments hold the file, its metadata and footers; every reader
    // reads each footer it needs (a few KiB a segment) from the bucket
    // itself, one GET a segment, and checks the server's chunks against it.
    let segments = store.list("segments/").expect("list").len() as u64;
    assert!(fetched >= len && fetched <= segments_len(&store), "the server fetched {fetched} bytes");
    let footers = store.footer_gets() - footers_before;
    assert!(footers >= 4 && footers <= 5 * segments, "{footers} footer GETs for 4 readers of {segments} segments");
    assert_eq!(total(&stats, |s| s.footers), 0, "no reader took a footer from the server: {stats:?}");
    assert!(pulled <= fetched + fetched / 10, "the bucket sent {pulled} bytes for a {len}-byte file read 4 times");
    assert!(total(&stats, |s| s.bytes) >= 4 * len, "every reader got the file from the server: {stats:?}");
    assert_eq!(total(&stats, |s| s.rejected + s.fallback_error + s.fallback_timeout), 0, "{stats:?}");
    let hits = server.metric("arbor_cache_hits_total");
    let misses = server.metric("arbor_cache_misses_total");
    assert_eq!(misses, server.metric("arbor_cache_bucket_gets_total"), "one GET per miss");
    assert!(misses >= 24, "at least one miss per MiB of the file: {misses}");
    // Each reader asks for the same chunks (and parts of chunks, for the
    // tree's small reads): the first asks of each went to the bucket, the
    // rest hit.
    assert_eq!(hits + misses, total(&stats, |s| s.chunks), "every request answered, as a hit or a miss");
    assert!(hits >= 3 * misses, "the other three readers hit: {hits} hits, {misses} misses");

    // A second job: new readers, empty caches, nothing from the bucket
    // but each segment's footer once.
    store.segment_bytes.store(0, Ordering::Relaxed);
    let footers_before = store.footer_gets();
    read_through(&store, &dir.path().join("second-job"), Some(client(&[&server])), &data);
    assert_eq!(store.sent(), 0, "the second job pulled no chunk from the bucket");
    assert!(store.footer_gets() - footers_before <= segments, "one footer GET a segment at most");

    // A restarted server finds its chunks again and checks them first.
    drop(server);
    let server = Server::start(store.clone(), &dir.path().join("server"), None);
    store.segment_bytes.store(0, Ordering::Relaxed);
    let c = client(&[&server]);
    read_through(&store, &dir.path().join("after-restart"), Some(c.clone()), &data);
    assert_eq!(server.metric("arbor_cache_bucket_bytes_total"), 0, "the restarted server read its own disk");
    assert_eq!(server.metric("arbor_cache_misses_total"), 0);
    let chunks = c.stats()[0].chunks;
    assert_eq!(server.metric_settled("arbor_cache_hits_total", chunks), chunks, "every request a hit");
}

#[test]
fn corrupt_or_short_chunks_are_caught_and_read_from_the_bucket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, data) = bucket_with_file(dir.path(), 6);
    for (n, fault) in [Fault::Corrupt, Fault::Short].into_iter().enumerate() {
        let server = Server::start(store.clone(), &dir.path().join(format!("server{n}")), Some(fault));
        let c = client(&[&server]);
        read_through(&store, &dir.path().join(format!("reader{n}")), Some(c.clone()), &data);
        let s = &c.stats()[0];
        assert!(s.chunks >= 6 && s.footers == 0, "{fault:?}: {s:?}");
        assert_eq!(s.rejected, s.chunks, "{fault:?}: every chunk was rejected: {s:?}");
    }
}

#[test]
fn small_scattered_reads_take_parts_of_chunks_and_bad_parts_are_read_again() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mib = 12;
    let (store, data) = bucket_with_file(dir.path(), mib);
    for (n, fault) in [None, Some(Fault::Corrupt), Some(Fault::Short)].into_iter().enumerate() {
        let server = Server::start(store.clone(), &dir.path().join(format!("server{n}")), fault);
        if fault.is_none() {
            // A warm server: what the reader then pulls from the bucket is its own.
            read_through(&store, &dir.path().join("warming"), Some(client(&[&server])), &data);
        }
        let parts_before = if fault.is_none() { server.metric("arbor_cache_part_requests_total") } else { 0 };
        let c = client(&[&server]);
        let dyn_store: Arc<dyn ObjectStore> = store.clone();
        let tier = TierConfig { peers: Some(c.clone() as Arc<dyn ChunkSource>), ..TierConfig::default() };
        let dev = BucketDevice::open(dyn_store.clone(), &dir.path().join(format!("reader{n}")), tier).expect("device");
        let vol = Volume::open(HeadDevice::new(dev.clone(), dyn_store, "main"), vol_cfg(true)).expect("volume");
        let ino = vol.lookup(ROOT_INO, b"data").expect("lookup").ino;
        // Backwards through the file, 4 KiB (not block-aligned) in each
        // MiB: no read starts where the one before ended.
        store.segment_bytes.store(0, Ordering::Relaxed);
        for i in (0..mib).rev() {
            let off = i * MIB + 1000 + i * 40_000;
            let got = vol.read(ino, off as u64, 4096).expect("read");
            assert!(got == data[off..off + 4096], "{fault:?}: the bytes at {off}");
        }
        // Reads across two 1 MiB writes (two records, one after the other
        // in the log): the second record's part is the rest of one small
        // read, not a reader streaming on.
        for i in [9, 5, 2] {
            let off = i * MIB - 2048;
            let got = vol.read(ino, off as u64, 4096).expect("read");
            assert!(got == data[off..off + 4096], "{fault:?}: the bytes at {off}");
        }
        let (cache, s) = (dev.stats().cache, c.stats()[0].clone());
        match fault {
            None => {
                assert_eq!(s.parts, cache.peer_parts, "{s:?}");
                assert_eq!(server.metric("arbor_cache_part_requests_total") - parts_before, s.parts);
                assert!(cache.peer_part_bytes <= cache.peer_parts * (64 << 10), "small parts: {cache:?}");
                // Tree nodes come in whole chunks (kept: the next read's
                // nodes are likely there); file data only in parts.
                assert!(cache.peer_chunks <= 2 && cache.part_rejected == 0, "{cache:?}");
                assert!(cache.cached_bytes <= 2 * MIB as u64, "{cache:?}");
                assert!(cache.peer_parts >= mib as u64 + 6, "every data read took parts: {cache:?}");
                assert!(cache.peer_footers == 0 && s.footers == 0, "footers come from the bucket: {cache:?} {s:?}");
                assert!(cache.bucket_footers >= 1, "{cache:?}");
                assert_eq!(store.sent(), 0, "no chunk from the bucket, only footers");
            }
            Some(Fault::Corrupt) => {
                assert!(cache.part_rejected >= mib as u64, "each bad part was caught: {cache:?}");
                assert!(s.rejected >= 2 * mib as u64, "and its whole chunk too: {s:?}");
                assert_eq!((cache.peer_chunks, cache.peer_footers), (0, 0), "{cache:?}");
            }
            Some(Fault::Short) => {
                assert_eq!((cache.peer_parts, cache.peer_chunks, cache.peer_footers), (0, 0, 0), "{cache:?}");
                assert!(s.rejected >= 2 * mib as u64, "{s:?}");
            }
        }
        if fault.is_some() {
            assert!(cache.gets >= mib as u64, "the bucket gave what the server got wrong: {cache:?}");
        }
    }
}

#[test]
fn two_servers_share_the_chunks_and_one_stopped_costs_only_its_share() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, data) = bucket_with_file(dir.path(), 32);
    let len = data.len() as u64;
    let a = Server::start(store.clone(), &dir.path().join("a"), None);
    let b = Server::start(store.clone(), &dir.path().join("b"), None);
    let metric = |name: &str| a.metric(name) + b.metric(name);
    read_through(&store, &dir.path().join("r0"), Some(client(&[&a, &b])), &data);
    let (from_a, from_b) = (a.metric("arbor_cache_bucket_bytes_total"), b.metric("arbor_cache_bucket_bytes_total"));
    assert!(from_a + from_b >= len && from_a + from_b <= segments_len(&store), "{from_a} + {from_b}");
    let gets = metric("arbor_cache_bucket_gets_total");
    assert_eq!(gets, metric("arbor_cache_misses_total"), "each chunk was fetched from the bucket once in total");
    let (hits, second) = (metric("arbor_cache_hits_total"), client(&[&a, &b]));
    read_through(&store, &dir.path().join("r1"), Some(second.clone()), &data);
    assert_eq!(metric("arbor_cache_bucket_gets_total"), gets, "the second reader's chunks were all there");
    let want = hits + total(&second.stats(), |s| s.chunks);
    assert_eq!(settled(want, || metric("arbor_cache_hits_total")), want, "and hit");
    assert!(from_a > 0 && from_b > 0, "both servers own a share: {from_a} / {from_b}");
    drop(b);
    let c = client(&[&a, &dummy_down()]);
    read_through(&store, &dir.path().join("one-down"), Some(c.clone()), &data);
    let stats = c.stats();
    assert!(stats[1].fallback_error + stats[1].fallback_down > 0, "{stats:?}");
    assert_eq!(stats[1].chunks, 0);
}

#[test]
fn parts_go_over_one_kept_chunk_connection_which_a_restarted_server_replaces() {
    use arbor_net::wire::frames::{
        read_chunk_answer, read_frame, write_frame, ChunkAsk, Hello, Welcome, MAGIC, VERSION,
    };
    use std::io::Write;
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = bucket_with_file(dir.path(), 4);
    let key = store.list("segments/").expect("list").into_iter().max_by_key(|k| store.size(k).expect("size"));
    let key = key.expect("a segment");
    let seg = arbor_engine::format::SegId::parse_file_name(key.rsplit('/').next().expect("name")).expect("a segment");
    let object = store.get(&key).expect("object").0;
    let whole = (object.len() / MIB).saturating_sub(1);
    assert!(whole >= 2, "{} bytes", object.len());
    let want = |i: usize, at: usize| Some(object[i * MIB + at..i * MIB + at + 4096].to_vec());
    let new_server = || {
        let cache = SegmentCache::open(store.clone(), &dir.path().join("server"), 1 << 30).expect("cache");
        CacheServer::new(cache, ServerOptions { token: TOKEN.into(), ..ServerOptions::default() })
    };
    let server = Server::start_with(new_server());
    let c = client(&[&server]);
    for n in 0..8 {
        let (i, at) = (n % whole, n * 5 * 4096 + 100);
        assert_eq!(c.fetch_part(seg, i as u32, at as u64..at as u64 + 4096), want(i, at), "part {n}");
    }
    assert_eq!(server.metric("arbor_cache_chunk_connections_total"), 1, "one connection for them all");
    assert_eq!(server.metric("arbor_cache_part_requests_total"), 8);

    // Whole chunks asked together on one connection are fetched from the
    // bucket together by a cold server, not one after another.
    let cold = Server::start(store.clone(), &dir.path().join("cold"), None);
    let c2 = client(&[&cold]);
    store.segment_delay_ms.store(50, Ordering::Relaxed);
    let asks: Vec<ChunkRequest> = (0..whole as u32)
        .map(|i| ChunkRequest { index: i, range: i as u64 * MIB as u64..(i as u64 + 1) * MIB as u64 })
        .collect();
    let got = c2.fetch(seg, &asks);
    store.segment_delay_ms.store(0, Ordering::Relaxed);
    for (i, bytes) in got.iter().enumerate() {
        assert!(bytes.as_deref() == Some(&object[i * MIB..(i + 1) * MIB]), "chunk {i}");
    }
    assert_eq!(cold.metric("arbor_cache_chunk_connections_total"), 1, "one connection");
    assert_eq!(cold.metric("arbor_cache_misses_total"), whole as u64);
    let most = store.most_segment_gets.load(Ordering::SeqCst);
    assert!(most >= 2, "the server fetched the chunks together: at most {most} GETs at once");
    // Asked again, they come from the server's cache file (by sendfile),
    // every byte the same, each handed on as it comes, in order.
    let mut again = Vec::new();
    c2.fetch_each(seg, &asks, &mut |k, bytes| again.push((k, bytes)));
    assert!(again.iter().map(|(k, _)| *k).eq(0..whole), "in order, once each");
    assert!(again.into_iter().map(|(_, b)| b).eq(got.iter().cloned()), "the same chunks from the cache");
    assert_eq!(cold.metric_settled("arbor_cache_hits_total", whole as u64), whole as u64);
    let served = 2 * (whole * MIB) as u64;
    assert_eq!(cold.metric_settled("arbor_cache_served_bytes_total", served), served);
    drop(cold);

    // The same address, a new process: the connection kept idle is dead,
    // and the next part goes over a new one without counting a failure.
    let addr = server.addr.clone();
    drop(server);
    let server = Server::start_on(new_server(), &addr);
    assert_eq!(c.fetch_part(seg, 1, 8192..8192 + 4096), want(1, 8192));
    let s = &c.stats()[0];
    assert_eq!((s.parts, s.fallback_error, s.fallback_down, s.fallback_timeout), (9, 0, 0, 0), "{s:?}");
    assert_eq!(server.metric("arbor_cache_chunk_connections_total"), 1);

    // Without the token the connection is refused at its Hello, and a
    // part asked on it anyway gets no answer.
    let mut raw = std::net::TcpStream::connect(&addr).expect("connect");
    raw.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let (mut rbuf, mut wbuf) = (Vec::new(), Vec::new());
    raw.write_all(&MAGIC).expect("magic");
    let hello = Hello { version: VERSION, token: b"not-the-token".to_vec(), branch: String::new() };
    write_frame(&mut raw, &mut wbuf, &hello).expect("hello");
    assert_eq!(read_frame::<Welcome>(&mut raw, &mut rbuf).expect("welcome"), Welcome::Refused);
    let _ = write_frame(&mut raw, &mut wbuf, &ChunkAsk { seg, index: 0, part: Some((0, 4096)), proved: false });
    assert!(read_chunk_answer(&mut raw, &mut rbuf).is_err(), "nothing answered");
    assert_eq!(server.metric("arbor_cache_unauthorized_total"), 1);
    assert_eq!(server.metric("arbor_cache_part_requests_total"), 1, "only the client's part was answered");
}

/// A server address nobody answers on.
fn dummy_down() -> Server {
    let port = arbor_engine::testkit::free_port().expect("free port");
    Server { addr: format!("127.0.0.1:{port}"), running: None }
}

#[test]
fn a_request_without_the_token_gets_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = bucket_with_file(dir.path(), 2);
    let seg = store.list("segments/").expect("list")[0].rsplit('/').next().expect("name").to_string();
    let server = Server::start(store.clone(), &dir.path().join("server"), None);
    let real = format!("/v1/chunks/{seg}/0");
    let missing = "/v1/chunks/seg-00000000000000ff-00000001/0";
    for path in [real.as_str(), missing, "/metrics"] {
        for auth in [None, Some("Bearer wrong"), Some("a-shared-secret"), Some("Bearer a-shared-secre")] {
            let (status, body) = http_get(&server.addr, path, auth).expect("GET");
            assert!(status.contains(" 401 "), "{path} with {auth:?}: {status}");
            assert!(body.trim_end_matches(['0', '\r', '\n']).is_empty(), "no body for {path}: {body:?}");
        }
    }
    assert_eq!(server.metric("arbor_cache_bucket_bytes_total"), 0, "nothing was fetched for them");
    let (status, _) = http_get(&server.addr, &real, Some("Bearer a-shared-secret")).expect("GET");
    assert!(status.contains(" 200 "), "{status}");
    let (status, _) = http_get(&server.addr, missing, Some("Bearer a-shared-secret")).expect("GET");
    assert!(status.contains(" 404 "), "{status}");
    let (status, body) = http_get(&server.addr, "/metrics", Some("Bearer a-shared-secret")).expect("GET");
    assert!(status.contains(" 200 ") && body.contains("arbor_cache_unauthorized_total 12"), "{status}\n{body}");
}

#[test]
fn memory_only_readers_and_servers_keep_no_chunk_on_disk_and_stay_in_bounds() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, data) = bucket_with_file(dir.path(), 16);
    let cache = SegmentCache::in_memory(store.clone(), 1 << 30).expect("memory server cache");
    let server = CacheServer::new(cache, ServerOptions { token: TOKEN.into(), ..ServerOptions::default() });
    let started = Server::start_with(server);
    let reader_dir = dir.path().join("reader");
    let dyn_store: Arc<dyn ObjectStore> = store.clone();
    let capacity = 4 << 20;
    let tier = TierConfig {
        memory_cache: true,
        cache_size: capacity,
        peers: Some(client(&[&started]) as Arc<dyn ChunkSource>),
        ..TierConfig::default()
    };
    let dev = BucketDevice::open(dyn_store.clone(), &reader_dir, tier).expect("device");
    let vol = Volume::open(HeadDevice::new(dev.clone(), dyn_store, "main"), vol_cfg(true)).expect("volume");
    let ino = vol.lookup(ROOT_INO, b"data").expect("lookup").ino;
    for pass in 0..2 {
        let mut off = 0;
        while off < data.len() {
            let part = vol.read(ino, off as u64, MIB).expect("read");
            assert!(part[..] == data[off..off + part.len()], "pass {pass} at {off}: wrong bytes");
            off += part.len();
        }
        let cached = dev.stats().cache.cached_bytes;
        assert!(cached <= capacity, "pass {pass}: {cached} bytes cached, more than the {capacity} allowed");
    }
    assert!(dev.stats().cache.evicted_bytes > 0, "a 16 MiB file through a 4 MiB memory cache evicts");
    assert!(bytes_under(&reader_dir) < 64 << 10, "the reader wrote {} bytes to its folder", bytes_under(&reader_dir));
    assert!(started.metric("arbor_cache_bucket_bytes_total") >= data.len() as u64, "the server fetched the file");
}

#[test]
fn chunks_nobody_read_for_keep_for_are_evicted_below_the_size_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, data) = bucket_with_file(dir.path(), 4);
    let cache = SegmentCache::open(store.clone(), &dir.path().join("server"), 1 << 30).expect("cache");
    let keep_for = Duration::from_millis(400);
    let opts = ServerOptions { token: TOKEN.into(), keep_for: Some(keep_for), ..ServerOptions::default() };
    let server = Server::start_with(CacheServer::new(cache, opts));
    read_through(&store, &dir.path().join("reader"), Some(client(&[&server])), &data);
    let resident = server.metric("arbor_cache_resident_bytes");
    assert!(resident >= data.len() as u64, "the server holds what was read: {resident}");
    // Bounded: at most 5 s for a 0.4 s keep-for swept every 0.1 s.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while server.metric("arbor_cache_resident_bytes") > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(server.metric("arbor_cache_resident_bytes"), 0, "nothing read for {keep_for:?} stays");
    assert!(server.metric("arbor_cache_evicted_bytes_total") >= resident);
}

#[test]
fn a_client_with_the_wrong_token_reads_the_bucket_and_stops_asking() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, data) = bucket_with_file(dir.path(), 8);
    let server = Server::start(store.clone(), &dir.path().join("server"), None);
    let wrong = Arc::new(
        CacheClient::new(ClientOptions {
            servers: vec![server.addr.clone()],
            token: "not-the-token".into(),
            timeout: Duration::from_secs(5),
            tls: None,
        })
        .expect("client"),
    );
    // Asked up front, each server says what is wrong with it, and asking
    // counts as nothing.
    let down = dummy_down();
    let both = |token: &str| {
        let c = CacheClient::new(ClientOptions {
            servers: vec![server.addr.clone(), down.addr.clone()],
            token: token.into(),
            timeout: Duration::from_secs(5),
            tls: None,
        })
        .expect("client");
        c.check(Duration::from_secs(5))
    };
    let checked = both(TOKEN);
    assert_eq!(checked[0], (server.addr.clone(), None), "{checked:?}");
    assert!(checked[1].1.as_deref().is_some_and(|p| p.starts_with("not reachable")), "{checked:?}");
    let checked = both("not-the-token");
    assert!(checked[0].1.as_deref().is_some_and(|p| p.contains("refused our token")), "{checked:?}");
    read_through(&store, &dir.path().join("reader"), Some(wrong.clone()), &data);
    let s = &wrong.stats()[0];
    assert_eq!(s.chunks, 0, "{s:?}");
    assert!(s.fallback_error >= 1 && s.fallback_down >= 1, "refused once, then left alone: {s:?}");
    assert!(s.fallback_error < 4, "not one refused round trip per chunk: {s:?}");
    assert_eq!(server.metric("arbor_cache_bucket_bytes_total"), 0, "nothing was fetched for it");
}

/// A volume of its own (a local folder) with `object` of `bucket` imported
/// as file `data`, reading through `servers`.
fn imported(
    dir: &Path,
    bucket: &Arc<Counting>,
    object: &Source,
    servers: Option<Arc<CacheClient>>,
) -> (Arc<Volume>, u64) {
    let dev = arbor_engine::device::FileDevice::open(dir, arbor_engine::io::IoMode::Auto).expect("device");
    let cfg = Config {
        sources: FixedSources::with("corpus", bucket.clone()),
        source_servers: servers.map(|c| c as Arc<dyn ChunkSource>),
        ..vol_cfg(false)
    };
    let vol = Volume::open(dev, cfg).expect("volume");
    let now = arbor_engine::env::Timestamp { secs: 0, nanos: 0 };
    let ino = vol.import(ROOT_INO, b"data", 0o644, (0, 0), object.clone(), now).expect("import").ino;
    (vol, ino)
}

fn read_all(vol: &Volume, ino: u64, len: usize) -> arbor_engine::Result<Vec<u8>> {
    let mut got = Vec::with_capacity(len);
    while got.len() < len {
        let part = vol.read(ino, got.len() as u64, MIB)?;
        assert!(!part.is_empty(), "short file");
        got.extend_from_slice(&part);
    }
    Ok(got)
}

#[test]
fn imported_files_read_through_a_server_pull_each_object_chunk_from_the_bucket_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (store, _) = bucket_with_file(dir.path(), 1);
    let body = pattern(5 * MIB + 12_345, 11);
    let etag = store.put("shards/train-0001.tar", &body).expect("put");
    let object = Source {
        bucket: "corpus".into(),
        key: "shards/train-0001.tar".into(),
        size: body.len() as u64,
        etag: etag.clone(),
        version: None,
    };
    let sources = FixedSources::with("corpus", store.clone());
    let opts = |fault| ServerOptions {
        token: TOKEN.into(),
        fault,
        objects: Some(Arc::new(SourceReader::serving(sources.clone(), 64 << 20, None))),
        object_scope: Some(Arc::new(ObjectScope::fixed(vec![("corpus".into(), "shards/".into())]))),
        ..ServerOptions::default()
    };
    let cache = SegmentCache::in_memory(store.clone(), 1 << 30).expect("cache");
    let server = Server::start_with(CacheServer::new(cache, opts(None)));
    let chunks = body.len().div_ceil(MIB) as u64;

    // Two readers in turn: the first one's chunks come from the bucket once
    // (through the server), the second's from the server alone.
    for reader in 0..2 {
        let (vol, ino) =
            imported(&dir.path().join(format!("reader{reader}")), &store, &object, Some(client(&[&server])));
        assert!(read_all(&vol, ino, body.len()).expect("read") == body, "reader {reader}: the object's bytes");
        let s = vol.source_stats();
        assert_eq!((s.from_servers, s.gets), (chunks, 0), "reader {reader}: every chunk from the server: {s:?}");
    }
    assert_eq!(store.source_bytes.load(Ordering::Relaxed), body.len() as u64, "the bucket sent the object once");
    assert_eq!(server.metric("arbor_cache_misses_total"), chunks);
    assert_eq!(server.metric_settled("arbor_cache_hits_total", chunks), chunks);
    assert!(store.versions.lock().iter().all(Option::is_none), "no version asked for an object without one");
    store.versions.lock().clear();

    // A file that recorded a version id: the server asks the bucket for that
    // version, and keeps it apart from the same key's other chunks.
    let versioned = Source { version: Some("3HL4kqtJlcpXroDTDmjVBH40Nrjfkd".into()), ..object.clone() };
    let (vol, ino) = imported(&dir.path().join("versioned"), &store, &versioned, Some(client(&[&server])));
    assert!(read_all(&vol, ino, body.len()).expect("read") == body);
    assert_eq!(vol.source_stats().from_servers, chunks);
    assert_eq!(server.metric("arbor_cache_misses_total"), 2 * chunks, "another version is another object");
    let asked = store.versions.lock().clone();
    assert!(!asked.is_empty() && asked.iter().all(|v| *v == versioned.version), "{asked:?}");
    store.versions.lock().clear();

    // A server that damages what it sends: caught by the checksum it sent,
    // every chunk read from the bucket, the bytes right.
    for (n, fault) in [Fault::Corrupt, Fault::Short].into_iter().enumerate() {
        let cache = SegmentCache::in_memory(store.clone(), 1 << 30).expect("cache");
        let bad = Server::start_with(CacheServer::new(cache, opts(Some(fault))));
        let c = client(&[&bad]);
        let (vol, ino) = imported(&dir.path().join(format!("faulty{n}")), &store, &object, Some(c.clone()));
        assert!(read_all(&vol, ino, body.len()).expect("read") == body, "{fault:?}: the object's bytes");
        let s = vol.source_stats();
        assert_eq!(s.from_servers, 0, "{fault:?}: nothing damaged was used: {s:?}");
        assert_eq!(c.stats()[0].rejected, chunks, "{fault:?}: {:?}", c.stats());
    }

    // The object changed in the bucket: the server does not serve the old
    // version's chunks it no longer has, and the reader gets EIO from the
    // bucket's refusal, never the new bytes.
    store.put("shards/train-0001.tar", &pattern(body.len(), 99)).expect("overwrite");
    let cache = SegmentCache::in_memory(store.clone(), 1 << 30).expect("cache");
    let fresh = Server::start_with(CacheServer::new(cache, opts(None)));
    let (vol, ino) = imported(&dir.path().join("after-change"), &store, &object, Some(client(&[&fresh])));
    let err = read_all(&vol, ino, body.len()).expect_err("a changed object");
    assert_eq!(err.errno(), libc::EIO, "{err}");
}
