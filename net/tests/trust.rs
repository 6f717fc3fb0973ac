//! What a client trusts of a cache server: nothing it cannot check against
//! the bucket. A real S3 server (s3s-fs on 127.0.0.1) is the bucket; a
//! rogue cache server on a real socket serves a forged copy of the disk:
//! the same segment names and layout, other bytes, footers whose crcs
//! match those bytes.

use arbor_engine::bucket::{open_s3, MemObjectStore, ObjectStore, RetryPolicy};
use arbor_engine::chunks::ChunkSource;
use arbor_engine::env::TestEnv;
use arbor_engine::head::HeadDevice;
use arbor_engine::source::{FixedSources, Source, SourceReader};
use arbor_engine::testkit::forge_keeping_crc;
use arbor_engine::testkit::S3Server;
use arbor_engine::tier::{BucketDevice, CacheStats, Footer, SegmentCache, TierConfig};
use arbor_engine::volume::{Config, Volume, ROOT_INO};
use arbor_net::{CacheClient, CacheServer, ClientOptions, Running, ServerOptions};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const TOKEN: &str = "a-shared-secret";
const MIB: usize = 1 << 20;
const FILE_LEN: usize = 3 * MIB;

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 11) as u8).collect()
}

/// The same seed on both disks: the same segment names, the same layout.
fn vol_cfg(read_only: bool) -> Config {
    Config { commit_interval: None, read_only, env: TestEnv::new(3), ..Config::default() }
}

/// Writes one file holding `data` on branch main of `store`.
fn write_disk(store: &Arc<dyn ObjectStore>, dir: &Path, data: &[u8]) {
    let dev = BucketDevice::open(store.clone(), dir, TierConfig::default()).expect("device");
    let vol = Volume::open(HeadDevice::new(dev, store.clone(), "main"), vol_cfg(false)).expect("volume");
    let ino = vol.create(ROOT_INO, b"data", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
    for (i, part) in data.chunks(MIB).enumerate() {
        vol.write(ino, (i * MIB) as u64, part).expect("write");
    }
    vol.close().expect("close");
}

/// Reads the whole file of the disk in `store` through the chunk cache in
/// `cache` (and `peers`): its bytes, or the first error. `stats` gets the
/// chunk cache's counters at the end.
fn read_file_counted(
    store: &Arc<dyn ObjectStore>,
    cache: &Path,
    peers: Option<Arc<CacheClient>>,
    stats: &mut CacheStats,
) -> arbor_engine::Result<Vec<u8>> {
    let tier = TierConfig { peers: peers.map(|c| c as Arc<dyn ChunkSource>), ..TierConfig::default() };
    let dev = BucketDevice::open(store.clone(), cache, tier)?;
    let got = (|| {
        let vol = Volume::open(HeadDevice::new(dev.clone(), store.clone(), "main"), vol_cfg(true))?;
        let ino = vol.lookup(ROOT_INO, b"data")?.ino;
        let mut got = Vec::with_capacity(FILE_LEN);
        while got.len() < FILE_LEN {
            let part = vol.read(ino, got.len() as u64, MIB)?;
            if part.is_empty() {
                break;
            }
            got.extend_from_slice(&part);
        }
        Ok(got)
    })();
    *stats = dev.stats().cache;
    got
}

fn read_file(
    store: &Arc<dyn ObjectStore>,
    cache: &Path,
    peers: Option<Arc<CacheClient>>,
) -> arbor_engine::Result<Vec<u8>> {
    read_file_counted(store, cache, peers, &mut CacheStats::default())
}

fn client(addr: &str) -> Arc<CacheClient> {
    Arc::new(
        CacheClient::new(ClientOptions {
            servers: vec![addr.to_string()],
            token: TOKEN.into(),
            timeout: Duration::from_secs(5),
            tls: None,
        })
        .expect("client"),
    )
}

#[test]
fn a_rogue_cache_server_with_forged_footers_never_gets_its_bytes_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data_dir = dir.path().join("s3-data");
    std::fs::create_dir_all(&data_dir).expect("mkdir");
    let Some(s3) = S3Server::start(&data_dir).expect("s3s-fs") else { return };
    let policy = RetryPolicy { attempts: 4, base: Duration::from_millis(1), max_backoff: Duration::from_millis(10) };
    let bucket = open_s3(&s3.config("disk"), policy).expect("bucket");
    let right = pattern(FILE_LEN, 7);
    write_disk(&bucket, &dir.path().join("writer"), &right);

    // The rogue's copy: the same disk written with other bytes.
    let forged: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let wrong = pattern(FILE_LEN, 99);
    write_disk(&forged, &dir.path().join("forger"), &wrong);
    let real_segments = bucket.list("segments/").expect("list");
    assert_eq!(forged.list("segments/").expect("list"), real_segments, "the forgery names the same segments");
    for key in &real_segments {
        assert_eq!(forged.size(key).expect("size"), bucket.size(key).expect("size"), "{key}: the same layout");
    }
    let rogue_cache = SegmentCache::open(forged.clone(), &dir.path().join("rogue"), 1 << 30).expect("cache");
    let rogue = CacheServer::new(rogue_cache, ServerOptions { token: TOKEN.into(), ..ServerOptions::default() });
    let running: Running = rogue.spawn("127.0.0.1:0").expect("serve");
    let addr = running.addr.to_string();
    // The forgery is good enough to fool anyone who trusts the server's
    // footers: a reader of the forged bucket itself reads it back.
    assert!(read_file(&forged, &dir.path().join("forged-reader"), None).expect("read") == wrong);

    let cache = dir.path().join("client");
    let c = client(&addr);
    let mut stats = CacheStats::default();
    match read_file_counted(&bucket, &cache, Some(c.clone()), &mut stats) {
        Ok(got) => assert!(got == right, "a reader through the rogue server got bytes the bucket does not hold"),
        Err(e) => eprintln!("the read through the rogue server failed (never wrong bytes): {e}"),
    }
    let s = c.stats()[0].clone();
    assert!(s.rejected >= 1, "the server that sent bad bytes is counted: {s:?}");
    // Each segment's footer came from the bucket, one GET a segment.
    let segments = real_segments.len() as u64;
    assert!(stats.peer_footers == 0 && s.footers == 0, "{stats:?} {s:?}");
    assert!(stats.bucket_footers >= 1 && stats.bucket_footers <= segments, "{stats:?}, {segments} segments");

    // A remount with no server trusts nothing the rogue left behind.
    drop(running);
    let got = read_file_counted(&bucket, &cache, None, &mut stats).expect("a remount reads the bucket's bytes");
    assert!(got == right, "a remount read bytes the rogue server left in its cache");
    assert_eq!(stats.bucket_footers, 0, "the footers kept were the bucket's: {stats:?}");
}

/// A bucket that answers every read with its own bytes, whatever the ETag
/// asked for: what a rogue server's reads of an imported object give.
struct Lying {
    body: Vec<u8>,
}

impl ObjectStore for Lying {
    fn put(&self, _key: &str, _body: &[u8]) -> arbor_engine::Result<String> {
        Err(arbor_engine::Error::Invalid("read only"))
    }
    fn put_if_absent(&self, key: &str, body: &[u8]) -> arbor_engine::Result<String> {
        self.put(key, body)
    }
    fn put_if_match(&self, key: &str, body: &[u8], _etag: &str) -> arbor_engine::Result<String> {
        self.put(key, body)
    }
    fn get(&self, _key: &str) -> arbor_engine::Result<(Vec<u8>, String)> {
        Ok((self.body.clone(), "\"any\"".into()))
    }
    fn get_range(&self, _key: &str, range: std::ops::Range<u64>) -> arbor_engine::Result<Vec<u8>> {
        let end = range.end.min(self.body.len() as u64);
        Ok(self.body[range.start as usize..end as usize].to_vec())
    }
    fn get_range_if(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
        _etag: &str,
        _version: Option<&str>,
    ) -> arbor_engine::Result<Vec<u8>> {
        self.get_range(key, range)
    }
    fn list(&self, _prefix: &str) -> arbor_engine::Result<Vec<String>> {
        Ok(Vec::new())
    }
    fn size(&self, _key: &str) -> arbor_engine::Result<u64> {
        Ok(self.body.len() as u64)
    }
    fn delete(&self, _key: &str) -> arbor_engine::Result<()> {
        Ok(())
    }
}

/// A volume on a local folder with `object` imported as file "data",
/// reading sources from `bucket` (as bucket "corpus") and `servers`.
fn imported(
    dir: &Path,
    bucket: &Arc<dyn ObjectStore>,
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
    let ino = match vol.lookup(ROOT_INO, b"data") {
        Ok(attr) => attr.ino,
        Err(_) => {
            let now = arbor_engine::env::Timestamp { secs: 0, nanos: 0 };
            vol.import(ROOT_INO, b"data", 0o644, (0, 0), object.clone(), now).expect("import").ino
        }
    };
    (vol, ino)
}

/// `right` put as `key` of bucket "corpus" on an s3s-fs of the test's own,
/// and a rogue cache server (with the token) that gives `wrong` for it.
struct RogueObject {
    _s3: S3Server,
    bucket: Arc<dyn ObjectStore>,
    object: Source,
    running: Running,
    client: Arc<CacheClient>,
}

fn rogue_object(dir: &Path, key: &str, right: &[u8], wrong: &[u8]) -> Option<RogueObject> {
    let data_dir = dir.join("s3-data");
    std::fs::create_dir_all(&data_dir).expect("mkdir");
    let s3 = S3Server::start(&data_dir).expect("s3s-fs")?;
    let policy = RetryPolicy { attempts: 4, base: Duration::from_millis(1), max_backoff: Duration::from_millis(10) };
    let bucket = open_s3(&s3.config("corpus"), policy).expect("bucket");
    let etag = bucket.put(key, right).expect("put");
    let object = Source { bucket: "corpus".into(), key: key.into(), size: right.len() as u64, etag, version: None };
    let lies: Arc<dyn ObjectStore> = Arc::new(Lying { body: wrong.to_vec() });
    let objects = SourceReader::serving(FixedSources::with("corpus", lies), 64 << 20, None);
    let cache = SegmentCache::in_memory(Arc::new(MemObjectStore::new()), 1 << 20).expect("cache");
    let rogue = CacheServer::new(
        cache,
        ServerOptions {
            token: TOKEN.into(),
            objects: Some(Arc::new(objects)),
            object_scope: Some(Arc::new(arbor_net::ObjectScope::fixed(vec![("corpus".into(), "shards/".into())]))),
            ..ServerOptions::default()
        },
    );
    let running = rogue.spawn("127.0.0.1:0").expect("serve");
    let client = client(&running.addr.to_string());
    Some(RogueObject { _s3: s3, bucket, object, running, client })
}

#[test]
fn a_small_imported_object_from_a_rogue_server_is_checked_against_its_etag() {
    let dir = tempfile::tempdir().expect("tempdir");
    let right = pattern(200 << 10, 5);
    let wrong = pattern(right.len(), 6);
    let Some(r) = rogue_object(dir.path(), "shards/small.json", &right, &wrong) else { return };
    let c = r.client.clone();
    let vol_dir = dir.path().join("vol");
    let (vol, ino) = imported(&vol_dir, &r.bucket, &r.object, Some(c.clone()));
    let got = vol.read(ino, 0, right.len()).expect("read");
    assert!(got == right, "a reader got bytes the bucket does not hold");
    let s = vol.source_stats();
    assert_eq!((s.server_rejected, s.from_servers), (1, 0), "the server's copy was refused: {s:?}");
    assert_eq!(c.stats()[0].rejected, 1, "and the server counted: {:?}", c.stats());
    vol.close().expect("close");
    drop(vol);
    drop(r.running);
    // Opened again without the server: nothing the rogue sent was kept.
    let (vol, ino) = imported(&vol_dir, &r.bucket, &r.object, None);
    assert!(vol.read(ino, 0, right.len()).expect("read") == right);
}

/// What a client accepts where the bucket gives nothing to check against:
/// an imported object over 1 MiB (its ETag is no MD5 of a part a reader
/// fetches), from a cache server holding the token, is taken as the server
/// gives it, as README ("What a client trusts") says. If this starts to
/// fail, the client checks such objects now: say so there.
#[test]
fn a_large_imported_object_from_a_rogue_server_is_taken_on_the_tokens_trust() {
    let dir = tempfile::tempdir().expect("tempdir");
    let right = pattern(2 * MIB, 5);
    let wrong = pattern(right.len(), 6);
    let Some(r) = rogue_object(dir.path(), "shards/large.bin", &right, &wrong) else { return };
    let (vol, ino) = imported(&dir.path().join("vol"), &r.bucket, &r.object, Some(r.client.clone()));
    let got = vol.read(ino, 0, right.len()).expect("read");
    let s = vol.source_stats();
    assert!(s.from_servers >= 1, "the server's chunks were not taken: {s:?}");
    assert!(got != right && got == wrong, "the server's bytes were not what the reader got: {s:?}");
}

/// crc32c is no defence against a server (or, without TLS, anyone on the
/// path) that means harm: a block rewritten with 4 bytes chosen passes both
/// the chunk's crc in the footer and the block's crc. The footer from the
/// bucket also holds a BLAKE3 digest per chunk: a forged chunk fails it,
/// and so does a forged small part, which comes with the chunk's leaf
/// hashes. The reader never returns the forged bytes.
#[test]
fn a_rogue_server_forging_crc32c_never_gets_its_bytes_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bucket: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let right = pattern(FILE_LEN, 7);
    write_disk(&bucket, &dir.path().join("writer"), &right);
    // The rogue's copy: the bucket's objects, with the file's block at
    // offset 64 KiB rewritten keeping every crc32c.
    let forged: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let needle = &right[64 << 10..(64 << 10) + 64];
    let evil = b"EVIL BYTES FROM A CACHE SERVER; THE FOOTER CAME FROM THE BUCKET ";
    let mut planted = 0;
    for key in bucket.list("").expect("list") {
        let (mut body, _) = bucket.get(&key).expect("get");
        if key.starts_with("segments/") {
            if let Some(at) = body.windows(needle.len()).position(|w| w == needle) {
                forge_keeping_crc(&mut body[at..at + 4096], evil);
                planted += 1;
                // The rogue's copy ends in a footer of its own bytes (the
                // crcs are the same; the digests are not), so its own
                // cache serves them. The client's footer is the bucket's.
                let trailer = &body[body.len() - 24..];
                let chunk_size = u32::from_le_bytes(trailer[0..4].try_into().expect("4 bytes"));
                let data_len = u64::from_le_bytes(trailer[8..16].try_into().expect("8 bytes")) as usize;
                let data = body[..data_len].to_vec();
                let footer = Footer::of(&data, chunk_size);
                body = data;
                footer.encode(&mut body);
            }
        }
        forged.put(&key, &body).expect("put");
    }
    assert_eq!(planted, 1, "the block was found in one segment");
    let rogue_cache = SegmentCache::open(forged.clone(), &dir.path().join("rogue"), 1 << 30).expect("cache");
    let rogue = CacheServer::new(rogue_cache, ServerOptions { token: TOKEN.into(), ..ServerOptions::default() });
    let running: Running = rogue.spawn("127.0.0.1:0").expect("serve");

    // Whole chunks, read as a streaming reader reads them.
    let c = client(&running.addr.to_string());
    let mut stats = CacheStats::default();
    let got = read_file_counted(&bucket, &dir.path().join("client"), Some(c.clone()), &mut stats).expect("read");
    let s = c.stats()[0].clone();
    assert!(
        got == right,
        "a reader through the rogue server got bytes the bucket does not hold: {:?} at 64 KiB (rejected {})",
        String::from_utf8_lossy(&got[64 << 10..(64 << 10) + 32]),
        s.rejected,
    );
    assert!(s.rejected >= 1, "the forged chunk was never rejected: {s:?}");

    // A small read of the forged block alone: a part of a chunk, proved
    // against the chunk's digest, fails and is read from the bucket.
    let c2 = client(&running.addr.to_string());
    let tier = TierConfig { peers: Some(c2.clone() as Arc<dyn ChunkSource>), ..TierConfig::default() };
    let dev = BucketDevice::open(bucket.clone(), &dir.path().join("small"), tier).expect("device");
    let vol = Volume::open(HeadDevice::new(dev.clone(), bucket.clone(), "main"), vol_cfg(true)).expect("open");
    let ino = vol.lookup(ROOT_INO, b"data").expect("lookup").ino;
    let small = vol.read(ino, 64 << 10, 100).expect("small read");
    assert_eq!(small, right[64 << 10..(64 << 10) + 100], "a small read returned forged bytes");
    // An honest part of another chunk passes its proof.
    let honest = vol.read(ino, (2 * MIB + (200 << 10)) as u64, 100).expect("small read");
    assert_eq!(honest, right[2 * MIB + (200 << 10)..2 * MIB + (200 << 10) + 100]);
    let st = dev.stats().cache;
    assert!(st.part_rejected >= 1, "the forged part was not rejected: {st:?}");
    assert!(st.peer_parts >= 1, "no proved part was taken from the server: {st:?}");
}
