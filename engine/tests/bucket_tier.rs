//! The bucket tier end to end: a volume on a [`BucketDevice`] over each
//! object store (in memory, a local folder, and S3 through a real s3s-fs
//! on 127.0.0.1), losing its cache, crashing, and meeting a faulty bucket.

use arbor_engine::bucket::S3Store;
use arbor_engine::bucket::{Fault, FaultStore, LocalFolderStore, MemObjectStore, ObjectStore, RetryPolicy, RetryStore};
use arbor_engine::device::{Device, Replica};
use arbor_engine::env::TestEnv;
use arbor_engine::head::{HeadDevice, LeaseConfig};
use arbor_engine::testkit::S3Server;
use arbor_engine::tier::{BucketDevice, Durability, TierConfig};
use arbor_engine::volume::{Config, Volume, ROOT_INO};
use arbor_engine::Error;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn vol_cfg() -> Config {
    Config { commit_interval: None, segment_size: 1 << 20, env: TestEnv::new(11), ..Config::default() }
}

fn tier(durability: Durability) -> TierConfig {
    TierConfig {
        durability,
        chunk_size: 64 << 10,
        read_ahead: 256 << 10,
        drain_timeout: Some(Duration::from_secs(60)),
        ..TierConfig::default()
    }
}

fn open(store: &Arc<dyn ObjectStore>, cache: &Path, t: TierConfig) -> (Arc<Volume>, Arc<BucketDevice>) {
    let dev = BucketDevice::open(store.clone(), cache, t).expect("bucket device");
    let vol = Volume::open(HeadDevice::new(dev.clone(), store.clone(), "main"), vol_cfg()).expect("open volume");
    (vol, dev)
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32).map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8).collect()
}

/// Writes `files` (name, bytes) under the root, fsyncing after each.
fn write_files(vol: &Volume, files: &[(String, Vec<u8>)]) {
    for (name, bytes) in files {
        let ino = vol.create(ROOT_INO, name.as_bytes(), libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
        for (i, chunk) in bytes.chunks(256 << 10).enumerate() {
            vol.write(ino, (i * (256 << 10)) as u64, chunk).expect("write");
        }
        vol.fsync(ino).expect("fsync");
    }
}

fn check_files(vol: &Volume, files: &[(String, Vec<u8>)]) {
    for (name, bytes) in files {
        let attr = vol.lookup(ROOT_INO, name.as_bytes()).unwrap_or_else(|e| panic!("{name} lost: {e}"));
        assert_eq!(attr.size, bytes.len() as u64, "{name}");
        let mut got = Vec::new();
        while got.len() < bytes.len() {
            let part = vol.read(attr.ino, got.len() as u64, 300_000).expect("read");
            assert!(!part.is_empty(), "{name}: short file");
            got.extend_from_slice(&part);
        }
        assert!(got == *bytes, "{name}: bytes differ");
    }
}

/// Writes `files` through a volume with its cache in `cache`, and closes
/// it: everything uploaded, every segment's file a cached copy.
fn write_and_close(store: &Arc<dyn ObjectStore>, cache: &Path, files: &[(String, Vec<u8>)]) {
    let (vol, dev) = open(store, cache, tier(Durability::Local));
    write_files(&vol, files);
    vol.close().expect("close");
    drop(vol);
    drop(dev);
}

fn some_files(n: usize, seed: u32) -> Vec<(String, Vec<u8>)> {
    (0..n).map(|i| (format!("f{seed}-{i}"), pattern(1000 + i * 197_531 % 900_000, seed + i as u32))).collect()
}

/// Every store the tier runs on; S3 only where s3s-fs is installed.
fn each_store(test: impl Fn(&str, Arc<dyn ObjectStore>)) {
    test("memory", Arc::new(MemObjectStore::new()));
    let dir = tempfile::tempdir().expect("tempdir");
    test("local folder", Arc::new(LocalFolderStore::open(dir.path()).expect("folder")));
    let data = tempfile::tempdir().expect("tempdir");
    if let Some(server) = S3Server::start(data.path()).expect("s3s-fs") {
        test("s3", Arc::new(S3Store::open(&server.config("disk")).expect("s3")));
    }
}

#[test]
fn bucket_durability_fsync_survives_losing_the_whole_cache() {
    each_store(|name, store| {
        let cache = tempfile::tempdir().expect("cache");
        let files = some_files(8, 1);
        let (vol, dev) = open(&store, &cache.path().join("a"), tier(Durability::Bucket));
        write_files(&vol, &files);
        assert!(dev.stats().wal_pieces > 0, "{name}: fsync shipped no WAL piece");
        // The node dies: no close, no drain; then its disk is gone.
        drop(vol);
        drop(dev);
        std::fs::remove_dir_all(cache.path().join("a")).expect("rm cache");
        let (vol, _dev) = open(&store, &cache.path().join("b"), tier(Durability::Bucket));
        check_files(&vol, &files);
        // And the new writer goes on from there.
        let more = some_files(2, 99);
        write_files(&vol, &more);
        vol.close().expect("close");
        let (vol, _dev) = open(&store, &cache.path().join("c"), tier(Durability::Local));
        check_files(&vol, &files);
        check_files(&vol, &more);
    });
}

#[test]
fn local_durability_close_uploads_everything_and_drops_the_wal() {
    each_store(|name, store| {
        let cache = tempfile::tempdir().expect("cache");
        let files = some_files(6, 2);
        let (vol, dev) = open(&store, &cache.path().join("a"), tier(Durability::Local));
        // The claim at open shipped the opening commit; fsyncs ship nothing.
        let claimed = dev.stats().wal_pieces;
        write_files(&vol, &files);
        assert_eq!(dev.stats().wal_pieces, claimed, "{name}: local durability ships no WAL on fsync");
        assert!(vol.pending_upload_bytes() > 0, "{name}: nothing pending before close?");
        vol.close().expect("close waits for uploads");
        assert_eq!(vol.pending_upload_bytes(), 0, "{name}");
        assert!(store.list("wal/").expect("list").is_empty(), "{name}: WAL pieces left after upload");
        assert!(!store.list("segments/").expect("list").is_empty(), "{name}");
        drop(vol);
        drop(dev);
        std::fs::remove_dir_all(cache.path().join("a")).expect("rm cache");
        let (vol, _dev) = open(&store, &cache.path().join("b"), tier(Durability::Local));
        check_files(&vol, &files);
    });
}

#[test]
fn local_durability_crash_replays_the_local_log_and_the_bucket_catches_up() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let cache = tempfile::tempdir().expect("cache");
    let files = some_files(6, 3);
    let (vol, dev) = open(&store, cache.path(), tier(Durability::Local));
    write_files(&vol, &files);
    drop(vol);
    drop(dev);
    // Same node, same cache: everything fsynced is there, from the local log.
    let (vol, dev) = open(&store, cache.path(), tier(Durability::Local));
    check_files(&vol, &files);
    vol.close().expect("close");
    drop(vol);
    drop(dev);
    // And after close the bucket alone has it all.
    let fresh = tempfile::tempdir().expect("cache");
    let (vol, _dev) = open(&store, fresh.path(), tier(Durability::Local));
    check_files(&vol, &files);
}

/// The state a crash between a segment's upload and its move into the
/// cache leaves: every uploaded segment back in the local segment folder.
fn unadopt_all(cache: &Path) -> Vec<std::path::PathBuf> {
    let mut moved = Vec::new();
    for e in std::fs::read_dir(cache.join("chunks")).expect("chunks") {
        let from = e.expect("entry").path();
        if from.to_string_lossy().ends_with(".bucket-footer") {
            // Kept when the segment became a cached copy: not yet, then.
            std::fs::remove_file(&from).expect("remove footer");
            continue;
        }
        let to = cache.join("segments").join(from.file_name().expect("name"));
        std::fs::rename(&from, &to).expect("move back");
        moved.push(to);
    }
    assert!(!moved.is_empty(), "nothing was uploaded");
    moved
}

#[test]
fn a_segment_uploaded_just_before_a_crash_is_kept_from_its_local_copy_when_it_matches() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let cache = tempfile::tempdir().expect("cache");
    let files = some_files(6, 5);
    write_and_close(&store, cache.path(), &files);
    let moved = unadopt_all(cache.path());
    let (vol, dev) = open(&store, cache.path(), tier(Durability::Local));
    check_files(&vol, &files);
    let s = dev.stats().cache;
    assert_eq!(s.fetched_bytes, 0, "a segment this node held was fetched again: {s:?}");
    for path in &moved {
        assert!(!path.exists(), "{} is still waiting to be uploaded", path.display());
    }
    drop(vol);
    drop(dev);

    // A local copy that is not the object's data (here: one byte changed)
    // is dropped, and the bucket's bytes are read instead.
    let moved = unadopt_all(cache.path());
    let victim = moved.iter().max_by_key(|p| std::fs::metadata(p).expect("meta").len()).expect("a segment");
    let mut bytes = std::fs::read(victim).expect("read");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(victim, &bytes).expect("write");
    let (vol, dev) = open(&store, cache.path(), tier(Durability::Local));
    check_files(&vol, &files);
    let s = dev.stats().cache;
    assert!(s.fetched_bytes > 0, "the changed copy was kept: {s:?}");
    assert!(!victim.exists(), "the changed copy is still in the segment folder");
}

#[test]
fn a_cache_server_beside_a_restarted_writer_serves_its_kept_chunks_and_checks_them() {
    use arbor_engine::tier::{segment_key, segment_of_key, SegmentCache};
    let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let cache = tempfile::tempdir().expect("cache");
    let files = some_files(6, 7);
    write_and_close(&store, &cache.path().join("owner"), &files);
    // One byte of the writer's kept copy goes bad: that chunk must come
    // from the bucket, checked, and every other from the kept copy.
    let kept = std::fs::read_dir(cache.path().join("owner/chunks"))
        .expect("chunks")
        .map(|e| e.expect("entry").path())
        .max_by_key(|p| std::fs::metadata(p).expect("meta").len())
        .expect("a kept segment");
    let mut bytes = std::fs::read(&kept).expect("read");
    bytes[100] ^= 0xff;
    std::fs::write(&kept, &bytes).expect("write");
    // The writer started again; it has read nothing of its segments yet.
    let dev = BucketDevice::open(store.clone(), &cache.path().join("owner"), tier(Durability::Local)).expect("device");
    let server = SegmentCache::with_sources(
        store.clone(),
        Some(&cache.path().join("server")),
        64 << 20,
        Some(dev.cached_chunks()),
    )
    .expect("server cache");
    let segments: Vec<_> =
        store.list(arbor_engine::layout::SEGMENTS).expect("list").iter().filter_map(|k| segment_of_key(k)).collect();
    assert!(!segments.is_empty());
    let mut served = 0;
    for id in segments {
        let (object, _) = store.get(&segment_key(id)).expect("object");
        let mut at = 0;
        for index in 0..10_000 {
            let Some(chunk) = server.chunk(id, index).expect("chunk") else { break };
            assert!(object[at..at + chunk.bytes.len()] == chunk.bytes[..], "{id} chunk {index}: other bytes");
            at += chunk.bytes.len();
            served += 1;
        }
        assert!(at > 0 && at < object.len(), "{id}: {at} bytes served of a {}-byte object", object.len());
    }
    let s = server.stats();
    assert_eq!(s.fetched_bytes, 64 << 10, "the server fetched other chunks than the bad one: {s:?}");
    assert_eq!(s.peer_chunks, served - 1, "{s:?}");
}

/// Reads `files` through a volume with its cache in `cache`, over
/// `store`: (reads of segment bytes from the bucket, footers found kept
/// in the cache).
fn read_through(store: &Arc<dyn ObjectStore>, cache: &Path, files: &[(String, Vec<u8>)]) -> (u64, u64) {
    let counted = Counting::over(store);
    let as_store: Arc<dyn ObjectStore> = counted.clone();
    // No read-ahead: every segment opened is one the reader needs. Read
    // only: a writable volume would add segments of its own.
    let dev = BucketDevice::open(as_store.clone(), cache, TierConfig { read_ahead: 0, ..tier(Durability::Local) })
        .expect("bucket device");
    let head = HeadDevice::new(dev.clone(), as_store.clone(), "main");
    let vol = Volume::open(head, Config { read_only: true, ..vol_cfg() }).expect("open volume");
    check_files(&vol, files);
    let kept = dev.stats().cache.kept_footers;
    drop(vol);
    drop(dev);
    (counted.segment_reads(), kept)
}

#[test]
fn footers_kept_by_an_earlier_build_are_never_read() {
    // An earlier build kept footers a cache server gave as `….footer`:
    // such a footer may vouch for bytes the bucket does not hold, so it is
    // removed and the bucket's footer read instead.
    let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let cache = tempfile::tempdir().expect("cache");
    let files = some_files(4, 13);
    write_and_close(&store, &cache.path().join("writer"), &files);
    let reader = cache.path().join("reader");
    let (first, _) = read_through(&store, &reader, &files);
    let mut old = Vec::new();
    for e in std::fs::read_dir(reader.join("chunks")).expect("chunks") {
        let p = e.expect("entry").path();
        let name = p.to_string_lossy().to_string();
        if let Some(stem) = name.strip_suffix(".bucket-footer") {
            let to = std::path::PathBuf::from(format!("{stem}.footer"));
            std::fs::rename(&p, &to).expect("rename");
            old.push(to);
        }
    }
    assert!(!old.is_empty(), "no footer was kept");
    let (calls, kept) = read_through(&store, &reader, &files);
    assert_eq!(kept, 0, "an old kept footer was taken");
    assert_eq!(calls as usize, old.len(), "one bucket GET per footer, no chunk again ({first} on an empty cache)");
    assert!(old.iter().all(|p| !p.exists()), "the old footers are removed");
}

#[test]
fn a_cache_opened_again_finds_its_segment_footers_and_asks_the_bucket_nothing() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let cache = tempfile::tempdir().expect("cache");
    let files = some_files(6, 12);
    write_and_close(&store, &cache.path().join("writer"), &files);
    // A reader on an empty cache asks the bucket for every footer and chunk.
    let reader = cache.path().join("reader");
    let (calls, kept) = read_through(&store, &reader, &files);
    assert!(calls > 0 && kept == 0, "{calls} reads, {kept} kept footers on an empty cache");
    // Opened again: the chunks and the footers are all here.
    let (calls, kept) = read_through(&store, &reader, &files);
    assert_eq!(calls, 0, "{calls} reads from the bucket for segments this cache holds whole");
    assert!(kept > 0, "no footer was found kept");
    // So is the writer's cache, whose segments became cached copies.
    let (calls, _) = read_through(&store, &cache.path().join("writer"), &files);
    assert_eq!(calls, 0, "the writer's own segments cost {calls} reads from the bucket");
    // A kept footer that fails its check is read from the bucket again
    // (one GET of the object's tail), and kept anew.
    let footer = std::fs::read_dir(reader.join("chunks"))
        .expect("chunks")
        .map(|e| e.expect("entry").path())
        .find(|p| p.to_string_lossy().ends_with(".bucket-footer"))
        .expect("a kept footer");
    let good = std::fs::read(&footer).expect("read");
    let mut bad = good.clone();
    bad[0] ^= 0x01;
    std::fs::write(&footer, &bad).expect("write");
    let (calls, kept) = read_through(&store, &reader, &files);
    assert_eq!(calls, 1, "{calls} reads from the bucket for one bad footer");
    assert!(kept > 0);
    assert_eq!(std::fs::read(&footer).expect("read"), good, "the footer was not kept again as the object has it");
}

#[test]
fn a_writer_streaming_its_own_file_reads_its_open_segment_locally_not_its_wal_pieces() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let cache = tempfile::tempdir().expect("cache");
    let (vol, dev) = open(&store, cache.path(), tier(Durability::Bucket));
    // Several sealed segments (uploaded, now cached copies) and an open one
    // whose bytes are also in the bucket as WAL pieces.
    let files = vec![("big".to_string(), pattern((3 << 20) + (300 << 10), 8))];
    write_files(&vol, &files);
    dev.drain().expect("uploads");
    assert!(!store.list("wal/").expect("list").is_empty(), "no WAL pieces to leave alone");
    check_files(&vol, &files);
    // Read-ahead runs on threads of its own: give it time to do harm.
    std::thread::sleep(Duration::from_millis(300));
    let s = dev.stats().cache;
    assert_eq!(s.wal_pieces_read, 0, "read-ahead fetched the writer's own open segment: {s:?}");
    assert_eq!(s.fetched_bytes, 0, "{s:?}");
}

#[test]
fn cold_reads_fetch_verified_chunks_and_the_cache_stays_bounded() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let cache = tempfile::tempdir().expect("cache");
    let files = vec![("big".to_string(), pattern(6 << 20, 4))];
    write_and_close(&store, &cache.path().join("a"), &files);
    let small = TierConfig { cache_size: 1 << 20, ..tier(Durability::Local) };
    let (vol, dev) = open(&store, &cache.path().join("b"), small);
    check_files(&vol, &files);
    check_files(&vol, &files);
    let s = dev.stats().cache;
    assert!(s.gets > 0 && s.fetched_bytes >= 6 << 20, "{s:?}");
    // A short-lived cache goes with its device.
    let scratch = cache.path().join("scratch");
    let temp = BucketDevice::open(store.clone(), &scratch, TierConfig { ephemeral: true, ..tier(Durability::Local) })
        .expect("device");
    assert!(scratch.exists());
    drop(temp);
    assert!(!scratch.exists(), "an ephemeral cache outlived its device");
    assert!(s.cached_bytes <= 1 << 20, "cache grew past its bound: {s:?}");
    assert!(s.evicted_bytes > 0, "{s:?}");
    // The chunk files on disk hold no more than the bound either.
    let on_disk: u64 = std::fs::read_dir(cache.path().join("b/chunks"))
        .expect("chunks")
        .map(|e| {
            let meta = e.expect("entry").metadata().expect("meta");
            std::os::unix::fs::MetadataExt::blocks(&meta) * 512
        })
        .sum();
    assert!(on_disk <= (1 << 20) + (256 << 10), "chunk files use {on_disk} bytes");
}

fn faulty(inner: Arc<dyn ObjectStore>) -> (Arc<FaultStore>, Arc<dyn ObjectStore>) {
    let faults = FaultStore::new(inner);
    let policy = RetryPolicy { attempts: 4, base: Duration::from_millis(1), max_backoff: Duration::from_millis(10) };
    let store: Arc<dyn ObjectStore> = RetryStore::new(faults.clone(), policy);
    (faults, store)
}

#[test]
fn failed_calls_are_retried_and_a_bucket_fsync_still_lands() {
    let (faults, store) = faulty(Arc::new(MemObjectStore::new()));
    let cache = tempfile::tempdir().expect("cache");
    let (vol, dev) = open(&store, &cache.path().join("a"), tier(Durability::Bucket));
    let files = some_files(4, 5);
    faults.inject(Fault::Fail(3));
    write_files(&vol, &files[..2]);
    faults.inject(Fault::ApplyThenFail(2));
    write_files(&vol, &files[2..]);
    assert!(faults.injected() >= 5, "faults were not hit: {}", faults.injected());
    drop(vol);
    drop(dev);
    let (vol, _dev) = open(&store, &cache.path().join("b"), tier(Durability::Bucket));
    check_files(&vol, &files);
}

#[test]
fn a_conditional_put_that_landed_but_reported_an_error_counts_as_done() {
    let (faults, store) = faulty(Arc::new(MemObjectStore::new()));
    faults.inject(Fault::ApplyThenFail(1));
    let t1 = store.put_if_absent("branches/x", b"one").expect("landed, then the answer was lost");
    faults.inject(Fault::ApplyThenFail(1));
    store.put_if_match("branches/x", b"two", &t1).expect("landed, then the answer was lost");
    assert_eq!(store.get("branches/x").expect("get").0, b"two");
    // A real conflict is still a conflict.
    assert!(matches!(store.put_if_absent("branches/x", b"three"), Err(Error::AlreadyExists(_))));
    assert!(matches!(store.put_if_match("branches/x", b"three", &t1), Err(Error::PreconditionFailed(_))));
}

#[test]
fn wrong_bytes_from_the_bucket_are_caught_by_checksum_never_returned() {
    let (faults, store) = faulty(Arc::new(MemObjectStore::new()));
    let cache = tempfile::tempdir().expect("cache");
    let files = vec![("data".to_string(), pattern(3 << 20, 6))];
    let (vol, dev) = open(&store, &cache.path().join("a"), tier(Durability::Local));
    write_files(&vol, &files);
    vol.close().expect("close");
    drop(vol);
    drop(dev);
    // A few bad bodies: retried, the reader sees the right bytes.
    let no_read_ahead = TierConfig { read_ahead: 0, ..tier(Durability::Local) };
    // (Each volume looks its file up first, so the faults hit the GETs of
    // file data, not the footer read, whose tail may hold unused bytes.)
    let (vol, dev) = open(&store, &cache.path().join("b"), no_read_ahead.clone());
    vol.lookup(ROOT_INO, b"data").expect("lookup");
    faults.inject(Fault::CorruptGets(2));
    check_files(&vol, &files);
    let (vol2, dev2) = open(&store, &cache.path().join("c"), no_read_ahead.clone());
    vol2.lookup(ROOT_INO, b"data").expect("lookup");
    faults.inject(Fault::TruncateGets(2));
    check_files(&vol2, &files);
    assert!(dev.stats().cache.checksum_retries + dev2.stats().cache.checksum_retries >= 2);
    drop((vol, dev, vol2, dev2));
    // A bucket that always answers wrong: an error, not wrong data.
    let (vol, _dev) = open(&store, &cache.path().join("d"), no_read_ahead);
    let ino = vol.lookup(ROOT_INO, b"data").expect("lookup").ino;
    faults.inject(Fault::CorruptGets(10_000));
    let err = vol.read(ino, 1 << 20, 4096).expect_err("every copy is corrupt");
    assert_eq!(err.errno(), libc::EIO, "{err}");
    faults.inject(Fault::CorruptGets(0));
    assert_eq!(vol.read(ino, 1 << 20, 4096).expect("healthy again"), files[0].1[1 << 20..(1 << 20) + 4096]);
}

#[test]
fn an_unreachable_bucket_fails_bucket_fsyncs_without_losing_the_local_copy() {
    let (faults, store) = faulty(Arc::new(MemObjectStore::new()));
    let cache = tempfile::tempdir().expect("cache");
    let (vol, dev) = open(&store, &cache.path().join("a"), tier(Durability::Bucket));
    let files = some_files(3, 7);
    write_files(&vol, &files[..1]);
    faults.inject(Fault::Offline(true));
    let ino = vol.create(ROOT_INO, b"late", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
    vol.write(ino, 0, b"written while the bucket is away").expect("write");
    let err = vol.fsync(ino).expect_err("the bucket is unreachable");
    assert_eq!(err.errno(), libc::EIO, "{err}");
    assert!(!vol.is_poisoned(), "an unreachable bucket must not poison the local log");
    faults.inject(Fault::Offline(false));
    vol.fsync(ino).expect("the bucket is back");
    write_files(&vol, &files[1..]);
    drop(vol);
    drop(dev);
    let (vol, _dev) = open(&store, &cache.path().join("b"), tier(Durability::Bucket));
    check_files(&vol, &files);
    let late = vol.lookup(ROOT_INO, b"late").expect("late").ino;
    assert_eq!(vol.read(late, 0, 100).expect("read"), b"written while the bucket is away");
}

#[test]
fn local_writes_continue_while_the_bucket_is_away_up_to_a_bound_then_wait() {
    let (faults, store) = faulty(Arc::new(MemObjectStore::new()));
    let cache = tempfile::tempdir().expect("cache");
    let bounded = TierConfig { max_pending: 2 << 20, ..tier(Durability::Local) };
    let (vol, dev) = open(&store, &cache.path().join("a"), bounded.clone());
    faults.inject(Fault::Offline(true));
    let written = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let writer = {
        let (vol, written) = (vol.clone(), written.clone());
        std::thread::spawn(move || {
            let ino = vol.create(ROOT_INO, b"stream", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
            let block = pattern(256 << 10, 8);
            for i in 0..32u64 {
                vol.write(ino, i * (256 << 10), &block).expect("write");
                vol.fsync(ino).expect("local fsync");
                written.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        })
    };
    // The writer gets a few MiB ahead of the bucket, then waits.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut stalled_at = None;
    while Instant::now() < deadline {
        let before = written.load(std::sync::atomic::Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(500));
        let after = written.load(std::sync::atomic::Ordering::SeqCst);
        if after == before && after > 0 {
            stalled_at = Some(after);
            break;
        }
    }
    let stalled_at = stalled_at.expect("the writer never waited for the bucket");
    assert!(stalled_at < 32, "the writer finished though the bucket was away");
    assert!(stalled_at >= 8, "the writer stopped before the bound: {stalled_at} blocks");
    faults.inject(Fault::Offline(false));
    writer.join().expect("writer");
    vol.close().expect("close");
    drop(vol);
    drop(dev);
    let (vol, _dev) = open(&store, &cache.path().join("b"), bounded);
    let ino = vol.lookup(ROOT_INO, b"stream").expect("stream").ino;
    assert_eq!(vol.getattr(ino).expect("attr").size, 32 * (256 << 10));
    assert_eq!(vol.read(ino, 31 * (256 << 10), 256 << 10).expect("read"), pattern(256 << 10, 8));
}

fn open_leased(
    store: &Arc<dyn ObjectStore>,
    cache: &Path,
    host: &str,
    ttl: Duration,
) -> arbor_engine::Result<(Arc<Volume>, Arc<BucketDevice>)> {
    let dev = BucketDevice::open(store.clone(), cache, tier(Durability::Local)).expect("bucket device");
    let lease = LeaseConfig::new(host, ttl);
    let head = HeadDevice::with_lease(dev.clone(), store.clone(), "main", Some(lease));
    Ok((Volume::open(head, vol_cfg())?, dev))
}

#[test]
fn a_second_writer_on_another_host_is_refused_while_the_lease_lives() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let cache = tempfile::tempdir().expect("cache");
    let ttl = Duration::from_secs(2);
    let (a, _da) = open_leased(&store, &cache.path().join("a"), "node-a", ttl).expect("first writer");
    write_files(&a, &some_files(1, 20));
    let err = open_leased(&store, &cache.path().join("b"), "node-b", ttl).err().expect("second writer refused");
    assert!(matches!(err, Error::Busy(ref why) if why.contains("node-a")), "{err}");
    // Held past its first life: the writer renews its lease.
    std::thread::sleep(ttl + Duration::from_millis(500));
    assert!(open_leased(&store, &cache.path().join("c"), "node-b", ttl).is_err(), "the lease was not renewed");
    // A clean close gives the branch back at once.
    a.close().expect("close");
    drop(a);
    let (b, _db) = open_leased(&store, &cache.path().join("d"), "node-b", ttl).expect("after close");
    b.close().expect("close");
}

#[test]
fn a_dead_writers_lease_lapses_and_the_next_writer_takes_over() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let cache = tempfile::tempdir().expect("cache");
    let ttl = Duration::from_secs(2);
    let files = some_files(2, 21);
    let (a, da) = open_leased(&store, &cache.path().join("a"), "node-a", ttl).expect("first writer");
    write_files(&a, &files);
    a.commit().expect("commit");
    da.drain().ok();
    // node-a dies: no close, no renewals.
    drop(a);
    drop(da);
    let started = Instant::now();
    let (b, _db) = open_leased(&store, &cache.path().join("b"), "node-b", ttl).expect("the lease lapses");
    assert!(
        started.elapsed() >= ttl,
        "claimed after {:?}, before the lease's life was seen to pass",
        started.elapsed()
    );
    b.lookup(ROOT_INO, files[0].0.as_bytes()).expect("the new writer sees the committed files");
}

#[test]
fn a_lease_is_judged_by_watching_it_never_by_comparing_clocks() {
    use arbor_engine::head::{branch_key, decode_head, encode_head, Lease};
    let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let cache = tempfile::tempdir().expect("cache");
    let ttl = Duration::from_secs(1);
    let (a, da) = open_leased(&store, &cache.path().join("a"), "node-a", ttl).expect("first writer");
    a.commit().expect("commit");
    da.drain().ok();
    drop(a);
    drop(da);
    // The dead holder's clock ran years ahead: its lease "expires" in the
    // far future, yet nobody renews it.
    let (body, tag) = store.get(&branch_key("main")).expect("head");
    let (sb, _, lease) = decode_head(&body).expect("decode");
    let ahead = Lease { expires: u64::MAX / 2, ..lease.expect("a lease") };
    store.put_if_match(&branch_key("main"), &encode_head(&sb, Some(&ahead)), &tag).expect("rewrite");
    let started = Instant::now();
    let (b, _db) = open_leased(&store, &cache.path().join("b"), "node-b", ttl).expect("lapsed by this node's clock");
    assert!(started.elapsed() >= ttl);
    drop(b);
}

#[test]
fn a_writer_that_cannot_renew_its_lease_stops_acknowledging_fsyncs() {
    let (faults, store) = faulty(Arc::new(MemObjectStore::new()));
    let cache = tempfile::tempdir().expect("cache");
    let ttl = Duration::from_secs(1);
    let (a, _da) = open_leased(&store, &cache.path().join("a"), "node-a", ttl).expect("writer");
    let ino = a.create(ROOT_INO, b"f", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
    a.write(ino, 0, b"before").expect("write");
    a.fsync(ino).expect("a local fsync with a fresh lease");
    // The bucket goes away: no renewal lands. Past four fifths of the
    // lease's life a reader may be about to claim the branch.
    faults.inject(Fault::Offline(true));
    std::thread::sleep(ttl);
    let late = a.write(ino, 0, b"after").and_then(|_| a.fsync(ino));
    assert!(matches!(late, Err(Error::Fenced(_))), "acknowledged after the lease could have lapsed: {late:?}");
    faults.inject(Fault::Offline(false));
}

#[test]
fn slow_bucket_calls_are_shared_by_concurrent_fsyncs() {
    let (faults, store) = faulty(Arc::new(MemObjectStore::new()));
    let cache = tempfile::tempdir().expect("cache");
    let (vol, dev) = open(&store, cache.path(), tier(Durability::Bucket));
    faults.inject(Fault::Delay(Duration::from_millis(20)));
    let before = dev.stats().wal_pieces;
    let threads: Vec<_> = (0..8u32)
        .map(|t| {
            let vol = vol.clone();
            std::thread::spawn(move || {
                let name = format!("t{t}");
                let ino = vol.create(ROOT_INO, name.as_bytes(), libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
                for i in 0..10u64 {
                    vol.write(ino, i * 4096, &pattern(4096, t)).expect("write");
                    vol.fsync(ino).expect("fsync");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
    let pieces = dev.stats().wal_pieces - before;
    assert!(pieces < 80, "80 fsyncs made {pieces} WAL PUTs: no group commit over a slow bucket");
    assert!(pieces > 0);
    faults.inject(Fault::Delay(Duration::ZERO));
    drop(vol);
    drop(dev);
    let fresh = tempfile::tempdir().expect("cache");
    let (vol, _dev) = open(&store, fresh.path(), tier(Durability::Bucket));
    for t in 0..8u32 {
        let ino = vol.lookup(ROOT_INO, format!("t{t}").as_bytes()).expect("file").ino;
        assert_eq!(vol.read(ino, 9 * 4096, 4096).expect("read"), pattern(4096, t));
    }
}

/// Counts the ranged GETs, and the reads of segment objects' bytes (their
/// footers, their chunks). Asking whether a segment exists is not counted:
/// opening a volume asks about the segment after its last, whatever its
/// cache holds.
struct Counting {
    inner: Arc<dyn ObjectStore>,
    gets: std::sync::atomic::AtomicU64,
    segment_reads: std::sync::atomic::AtomicU64,
}

impl Counting {
    fn over(inner: &Arc<dyn ObjectStore>) -> Arc<Counting> {
        Arc::new(Counting { inner: inner.clone(), gets: Default::default(), segment_reads: Default::default() })
    }
    fn read_of(&self, key: &str) {
        if key.starts_with(arbor_engine::layout::SEGMENTS) {
            self.segment_reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
    fn segment_reads(&self) -> u64 {
        self.segment_reads.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl ObjectStore for Counting {
    fn put(&self, key: &str, body: &[u8]) -> arbor_engine::Result<String> {
        self.inner.put(key, body)
    }
    fn put_if_absent(&self, key: &str, body: &[u8]) -> arbor_engine::Result<String> {
        self.inner.put_if_absent(key, body)
    }
    fn put_if_match(&self, key: &str, body: &[u8], etag: &str) -> arbor_engine::Result<String> {
        self.inner.put_if_match(key, body, etag)
    }
    fn get(&self, key: &str) -> arbor_engine::Result<(Vec<u8>, String)> {
        self.read_of(key);
        self.inner.get(key)
    }
    fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> arbor_engine::Result<Vec<u8>> {
        self.gets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.read_of(key);
        self.inner.get_range(key, range)
    }
    fn list(&self, prefix: &str) -> arbor_engine::Result<Vec<String>> {
        self.inner.list(prefix)
    }
    fn size(&self, key: &str) -> arbor_engine::Result<u64> {
        self.inner.size(key)
    }
    fn delete(&self, key: &str) -> arbor_engine::Result<()> {
        self.inner.delete(key)
    }
}

#[test]
fn read_ahead_streams_across_segments_in_runs_of_chunks() {
    // 200-byte chunks: a 1 MiB segment's footer (over 20 KiB) is larger
    // than one tail GET brings.
    let mem: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let cache = tempfile::tempdir().expect("cache");
    let small_chunks = TierConfig { chunk_size: 200, ..tier(Durability::Local) };
    let len = 3 << 20;
    let files = vec![("stream".to_string(), pattern(len, 21))];
    let (vol, dev) = open(&mem, &cache.path().join("a"), small_chunks.clone());
    write_files(&vol, &files);
    vol.close().expect("close");
    drop((vol, dev));
    let counting = Counting::over(&mem);
    let store: Arc<dyn ObjectStore> = counting.clone();
    let (vol, dev) = open(&store, &cache.path().join("b"), small_chunks);
    // Sequential 64 KiB reads: read-ahead runs ahead through the segments.
    let ino = vol.lookup(ROOT_INO, b"stream").expect("lookup").ino;
    let mut got = Vec::new();
    while got.len() < files[0].1.len() {
        let part = vol.read(ino, got.len() as u64, 64 << 10).expect("read");
        assert!(!part.is_empty(), "short file");
        got.extend_from_slice(&part);
    }
    assert!(got == files[0].1, "bytes differ");
    let stats = dev.stats().cache;
    assert_eq!(stats.checksum_retries, 0);
    assert!(stats.fetched_bytes >= len as u64, "fetched {}", stats.fetched_bytes);
    // Read-ahead asks for runs of chunks: far fewer GETs than chunks.
    let gets = counting.gets.load(std::sync::atomic::Ordering::Relaxed);
    assert!(gets < (len / 200 / 3) as u64, "{gets} GETs for {} chunks", len / 200);
}

#[test]
fn a_reader_streaming_a_file_larger_than_the_cache_fetches_each_chunk_once() {
    // Read-ahead fetches chunks that wait in the cache for their reader:
    // a window as large as the cache would evict them first, and each
    // would be fetched again (2.2× the file, from a cache server, for a
    // memory-only client of 64 MiB streaming 256 MiB).
    let mem: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let cache = tempfile::tempdir().expect("cache");
    let len = 12 << 20;
    let files = vec![("stream".to_string(), pattern(len, 22))];
    write_and_close(&mem, &cache.path().join("a"), &files);
    let small = TierConfig { cache_size: 2 << 20, ..tier(Durability::Local) };
    let (vol, dev) = open(&mem, &cache.path().join("b"), small);
    let ino = vol.lookup(ROOT_INO, b"stream").expect("lookup").ino;
    let mut got = Vec::new();
    while got.len() < len {
        let part = vol.read(ino, got.len() as u64, 128 << 10).expect("read");
        assert!(!part.is_empty(), "short file");
        got.extend_from_slice(&part);
    }
    assert!(got == files[0].1, "bytes differ");
    let s = dev.stats().cache;
    assert!(s.evicted_bytes > 0, "the file did not outgrow the cache: {s:?}");
    assert!(s.fetched_bytes <= len as u64 * 11 / 10, "fetched {} B for a {len} B file: {s:?}", s.fetched_bytes);
}

/// A store whose first `size` and first `list` answer from a copy of the
/// bucket taken earlier, as a reader that looked just before the writer
/// sealed its segment and retired the WAL pieces would see it.
struct LookedEarlier {
    now: Arc<dyn ObjectStore>,
    before: MemObjectStore,
    stale_size: std::sync::atomic::AtomicBool,
    stale_list: std::sync::atomic::AtomicBool,
}

impl LookedEarlier {
    fn new(now: Arc<dyn ObjectStore>) -> LookedEarlier {
        let before = MemObjectStore::new();
        for key in now.list("").expect("list") {
            before.put(&key, &now.get(&key).expect("get").0).expect("copy");
        }
        let flag = || std::sync::atomic::AtomicBool::new(true);
        LookedEarlier { now, before, stale_size: flag(), stale_list: flag() }
    }
}

impl ObjectStore for LookedEarlier {
    fn put(&self, key: &str, body: &[u8]) -> arbor_engine::Result<String> {
        self.now.put(key, body)
    }
    fn put_if_absent(&self, key: &str, body: &[u8]) -> arbor_engine::Result<String> {
        self.now.put_if_absent(key, body)
    }
    fn put_if_match(&self, key: &str, body: &[u8], etag: &str) -> arbor_engine::Result<String> {
        self.now.put_if_match(key, body, etag)
    }
    fn get(&self, key: &str) -> arbor_engine::Result<(Vec<u8>, String)> {
        self.now.get(key)
    }
    fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> arbor_engine::Result<Vec<u8>> {
        self.now.get_range(key, range)
    }
    fn list(&self, prefix: &str) -> arbor_engine::Result<Vec<String>> {
        match self.stale_list.swap(false, std::sync::atomic::Ordering::SeqCst) {
            true => self.before.list(prefix),
            false => self.now.list(prefix),
        }
    }
    fn size(&self, key: &str) -> arbor_engine::Result<u64> {
        match self.stale_size.swap(false, std::sync::atomic::Ordering::SeqCst) {
            true => self.before.size(key),
            false => self.now.size(key),
        }
    }
    fn delete(&self, key: &str) -> arbor_engine::Result<()> {
        self.now.delete(key)
    }
}

/// Every byte of segment `id` as `dev` reads it.
fn segment_bytes(dev: &BucketDevice, id: arbor_engine::format::SegId) -> Vec<u8> {
    let file = dev.open_segment(id).expect("open").expect("the segment is in the bucket");
    let mut buf = vec![0; file.size().expect("size") as usize];
    file.read_at(&mut buf, 0).expect("read");
    buf
}

#[test]
fn a_reader_follows_a_live_writers_segment_while_its_wal_pieces_are_retired() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let cache = tempfile::tempdir().expect("cache");
    let (vol, _dev) = open(&store, &cache.path().join("w"), tier(Durability::Bucket));
    write_files(&vol, &some_files(1, 5));
    let wal = store.list("wal/").expect("list");
    let open_seg = wal.iter().find_map(|k| arbor_engine::tier::segment_of_key(k)).expect("a WAL piece");
    // A reader (gc, diff, another node) opens the open segment from its pieces…
    let reader = BucketDevice::open(store.clone(), &cache.path().join("r"), tier(Durability::Local)).expect("reader");
    let early = reader.open_segment(open_seg).expect("open").expect("from the WAL");
    let early_len = early.size().expect("size");
    // …the writer goes on, and the reader asks for bytes written since.
    write_files(&vol, &some_files(1, 6));
    let later = LookedEarlier::new(store.clone());
    vol.close().expect("close seals and uploads, then drops the WAL pieces");
    assert!(store.list("wal/").expect("list").is_empty(), "WAL pieces left after upload");
    let sealed = segment_bytes(
        &BucketDevice::open(store.clone(), &cache.path().join("s"), tier(Durability::Local)).expect("dev"),
        open_seg,
    );
    assert!(sealed.len() as u64 > early_len, "the writer wrote nothing more to its segment");
    let mut tail = vec![0; (sealed.len() as u64 - early_len + 8) as usize];
    early.read_at(&mut tail, early_len - 8).expect("bytes the writer added after the reader looked");
    assert!(tail == sealed[early_len as usize - 8..], "wrong bytes after following the writer");
    // A reader that listed the pieces just before they were retired finds
    // them gone, and reads the sealed object instead of failing.
    let racing =
        BucketDevice::open(Arc::new(later), &cache.path().join("x"), tier(Durability::Local)).expect("racing reader");
    assert!(segment_bytes(&racing, open_seg) == sealed, "wrong bytes after the pieces were retired");
    // A segment with neither object nor pieces is missing, and says so.
    let gone = arbor_engine::format::SegId { writer: open_seg.writer, seq: open_seg.seq + 1000 };
    assert!(racing.open_segment(gone).expect("open").is_none());
}

/// A bucket whose clock runs an hour behind this node's.
struct SlowClock(Arc<dyn ObjectStore>);

const BEHIND: Duration = Duration::from_secs(3600);

impl ObjectStore for SlowClock {
    fn put(&self, key: &str, body: &[u8]) -> arbor_engine::Result<arbor_engine::bucket::ETag> {
        self.0.put(key, body)
    }
    fn put_if_absent(&self, key: &str, body: &[u8]) -> arbor_engine::Result<arbor_engine::bucket::ETag> {
        self.0.put_if_absent(key, body)
    }
    fn put_if_match(&self, key: &str, body: &[u8], etag: &str) -> arbor_engine::Result<arbor_engine::bucket::ETag> {
        self.0.put_if_match(key, body, etag)
    }
    fn get(&self, key: &str) -> arbor_engine::Result<(Vec<u8>, arbor_engine::bucket::ETag)> {
        self.0.get(key)
    }
    fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> arbor_engine::Result<Vec<u8>> {
        self.0.get_range(key, range)
    }
    fn list(&self, prefix: &str) -> arbor_engine::Result<Vec<String>> {
        self.0.list(prefix)
    }
    fn list_objects(&self, prefix: &str) -> arbor_engine::Result<Vec<arbor_engine::bucket::ObjectInfo>> {
        let mut objects = self.0.list_objects(prefix)?;
        for o in &mut objects {
            o.modified = Some(o.modified.unwrap_or_else(std::time::SystemTime::now) - BEHIND);
        }
        Ok(objects)
    }
    fn size(&self, key: &str) -> arbor_engine::Result<u64> {
        self.0.size(key)
    }
    fn delete(&self, key: &str) -> arbor_engine::Result<()> {
        self.0.delete(key)
    }
}

/// gc ages a segment that is only in the bucket by the bucket's clock: a
/// node whose clock runs an hour ahead of the bucket's does not take a
/// segment another node wrote a moment ago for an hour old one.
#[test]
fn a_segment_in_the_bucket_is_aged_by_the_buckets_clock() {
    let dir = tempfile::tempdir().expect("dir");
    let store: Arc<dyn ObjectStore> = Arc::new(SlowClock(Arc::new(MemObjectStore::new())));
    // Another node's segment, just written.
    let id = arbor_engine::format::SegId { writer: 0xabc, seq: 7 };
    store.put(&arbor_engine::layout::segment_key(id), b"a segment").expect("put");
    let dev = BucketDevice::open(store.clone(), dir.path(), tier(Durability::Local)).expect("device");
    let at = dev.clocks().expect("clocks");
    let stamped = dev.segment_modified(id).expect("modified").expect("the bucket says when");
    // By this node's clock it looks an hour old ...
    assert!(at.here.duration_since(stamped).unwrap_or_default() >= BEHIND - Duration::from_secs(60));
    // ... by the bucket's, it is new.
    let age = dev.segment_age(id, at).expect("age").expect("an age");
    assert!(age < Duration::from_secs(60), "aged by this node's clock: {age:?}");
}
