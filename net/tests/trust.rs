//! What a client trusts of a cache server: nothing it cannot check against
//! the bucket. A real S3 server (s3s-fs on 127.0.0.1) is the bucket; a
//! rogue cache server on a real socket serves a forged copy of the disk:
//! the same segment names and layout, other bytes, footers whose crcs
//! match those bytes.

use arbor_engine::bucket::{open_s3, MemObjectStore, ObjectStore, RetryPolicy};
use arbor_engine::disk::HeadDevice;
use arbor_engine::env::TestEnv;
use arbor_engine::testkit::S3Server;
use arbor_engine::tier::{BucketDevice, ChunkSource, SegmentCache, TierConfig};
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
/// `cache` (and `peers`): its bytes, or the first error.
fn read_file(
    store: &Arc<dyn ObjectStore>,
    cache: &Path,
    peers: Option<Arc<CacheClient>>,
) -> arbor_engine::Result<Vec<u8>> {
    let tier = TierConfig { peers: peers.map(|c| c as Arc<dyn ChunkSource>), ..TierConfig::default() };
    let dev = BucketDevice::open(store.clone(), cache, tier)?;
    let vol = Volume::open(HeadDevice::new(dev, store.clone(), "main"), vol_cfg(true))?;
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
}

fn client(addr: &str) -> Arc<CacheClient> {
    Arc::new(
        CacheClient::new(ClientOptions {
            servers: vec![addr.to_string()],
            token: TOKEN.into(),
            timeout: Duration::from_secs(5),
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
    match read_file(&bucket, &cache, Some(c.clone())) {
        Ok(got) => assert!(got == right, "a reader through the rogue server got bytes the bucket does not hold"),
        Err(e) => eprintln!("the read through the rogue server failed (never wrong bytes): {e}"),
    }
    let s = c.stats()[0].clone();
    assert!(s.rejected >= 1, "the server that sent bad bytes is counted: {s:?}");

    // A remount with no server trusts nothing the rogue left behind.
    drop(running);
    let got = read_file(&bucket, &cache, None).expect("a remount reads the bucket's bytes");
    assert!(got == right, "a remount read bytes the rogue server left in its cache");
}
