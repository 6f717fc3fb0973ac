//! Imported files: extents that name ranges of a plain object. Reads,
//! writes on top, truncate, links, unlink, replay, commit, and objects
//! changed or deleted behind the volume's back (model store; the S3 path
//! is tested end to end in `tests/tests/import.rs`).

use arbor_engine::bucket::{MemObjectStore, ObjectStore};
use arbor_engine::device::SimDevice;
use arbor_engine::env::{TestEnv, Timestamp};
use arbor_engine::source::{FixedSources, Source};
use arbor_engine::volume::*;
use std::sync::Arc;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8).collect()
}

struct World {
    dev: SimDevice,
    bucket: Arc<MemObjectStore>,
}

impl World {
    fn new() -> World {
        World { dev: SimDevice::new(), bucket: Arc::new(MemObjectStore::new()) }
    }

    fn cfg(&self) -> Config {
        Config {
            commit_interval: None,
            segment_size: 1 << 20,
            env: TestEnv::new(7),
            sources: FixedSources::with("corpus", self.bucket.clone()),
            ..Config::default()
        }
    }

    fn open(&self) -> Arc<Volume> {
        Volume::open(Arc::new(self.dev.clone()), self.cfg()).expect("open")
    }

    /// Puts an object and imports it as `name` in the root.
    fn import(&self, vol: &Volume, name: &str, body: &[u8]) -> u64 {
        let etag = self.bucket.put(name, body).expect("put");
        let source = Source { bucket: "corpus".into(), key: name.into(), size: body.len() as u64, etag, version: None };
        vol.import(ROOT_INO, name.as_bytes(), 0o644, (1000, 1000), source, Timestamp { secs: 1_700_000_000, nanos: 0 })
            .expect("import")
            .ino
    }
}

#[test]
fn imported_files_read_their_objects_at_every_offset() {
    let w = World::new();
    let vol = w.open();
    let body = pattern((3 << 20) + 12_345, 1);
    let ino = w.import(&vol, "big.bin", &body);
    let empty = w.import(&vol, "empty", b"");
    let tiny = w.import(&vol, "tiny", b"x");
    let a = vol.getattr(ino).expect("attr");
    assert_eq!((a.size, a.kind, a.perm, a.uid), (body.len() as u64, FileKind::Regular, 0o644, 1000));
    assert_eq!(a.mtime.secs, 1_700_000_000, "mtime is the object's");
    assert_eq!(vol.getattr(empty).expect("attr").size, 0);
    assert_eq!(vol.read(empty, 0, 10).expect("read"), b"");
    assert_eq!(vol.read(tiny, 0, 10).expect("read"), b"x");
    // Whole, across chunk edges, sequentially in kernel-sized requests, and past the end.
    assert_eq!(vol.read(ino, 0, body.len() + 10).expect("read"), body);
    for (off, len) in [(0, 1), ((1 << 20) - 3, 10), ((2 << 20) + 7, 1 << 20), (body.len() as u64 - 5, 100)] {
        let want = &body[off as usize..(off as usize + len).min(body.len())];
        assert_eq!(vol.read(ino, off, len).expect("read"), want, "at {off}");
    }
    let mut off = 0;
    while off < body.len() {
        let got = vol.read(ino, off as u64, 128 << 10).expect("read");
        assert_eq!(got, &body[off..off + got.len()], "at {off}");
        off += got.len();
    }
    assert_ne!(vol.features() & features::EXTERNAL_EXTENTS, 0, "the tree says it holds external extents");
}

#[test]
fn writes_on_top_keep_the_rest_reading_from_the_object() {
    let w = World::new();
    let vol = w.open();
    let body = pattern(5 << 20, 2);
    let ino = w.import(&vol, "f", &body);
    let mut model = body.clone();
    for (off, len, seed) in [(100u64, 5000usize, 9u8), ((2 << 20) - 10, 20, 8), ((5 << 20) - 4, 10, 7)] {
        let data = pattern(len, seed);
        vol.write(ino, off, &data).expect("write");
        let end = off as usize + len;
        if model.len() < end {
            model.resize(end, 0);
        }
        model[off as usize..end].copy_from_slice(&data);
    }
    assert_eq!(vol.read(ino, 0, model.len()).expect("read"), model);
    vol.setattr(ino, SetAttr { size: Some(3 << 20), ..SetAttr::default() }).expect("truncate");
    model.truncate(3 << 20);
    vol.setattr(ino, SetAttr { size: Some(4 << 20), ..SetAttr::default() }).expect("extend");
    model.resize(4 << 20, 0);
    assert_eq!(vol.read(ino, 0, model.len()).expect("read"), model);
    // A hard link and a rename read the same bytes; reopening replays them.
    vol.link(ino, ROOT_INO, b"g").expect("link");
    vol.rename(ROOT_INO, b"f", ROOT_INO, b"h", RenameMode::Plain).expect("rename");
    vol.fsync(ino).expect("fsync");
    drop(vol);
    let vol = w.open();
    let ino = vol.lookup(ROOT_INO, b"h").expect("lookup").ino;
    assert_eq!(vol.read(ino, 0, model.len()).expect("read after replay"), model);
    assert_ne!(vol.features() & features::EXTERNAL_EXTENTS, 0, "replay sets the bit too");
    vol.commit().expect("commit");
    drop(vol);
    let vol = w.open();
    assert_ne!(vol.features() & features::EXTERNAL_EXTENTS, 0, "the commit keeps the bit");
    assert_eq!(vol.read(ino, 0, model.len()).expect("read after commit"), model);
    // Unlinking both names drops the file with its source record.
    vol.unlink(ROOT_INO, b"g").expect("unlink");
    vol.unlink(ROOT_INO, b"h").expect("unlink");
    assert_eq!(vol.source(ino).expect("source"), None);
}

#[test]
fn a_changed_or_deleted_object_fails_the_read_and_never_returns_other_bytes() {
    let w = World::new();
    let vol = w.open();
    let a = w.import(&vol, "a", &pattern(2 << 20, 3));
    let b = w.import(&vol, "b", &pattern(2 << 20, 4));
    w.bucket.put("a", &pattern(2 << 20, 5)).expect("overwrite outside");
    w.bucket.delete("b").expect("delete outside");
    for ino in [a, b] {
        let err = vol.read(ino, 0, 4096).expect_err("must fail");
        assert_eq!(err.errno(), libc::EIO, "{err}");
        assert!(matches!(err, arbor_engine::Error::SourceChanged(_)), "{err}");
    }
    let stats = vol.source_stats();
    assert_eq!((stats.gets, stats.changed, stats.fetched_bytes, stats.misses), (2, 2, 0, 2), "{stats:?}");
    // Bytes written on top still read; the object's part still fails.
    vol.write(a, 0, b"mine").expect("write");
    assert_eq!(vol.read(a, 0, 4).expect("read"), b"mine");
    assert_eq!(vol.read(a, 4096, 10).expect_err("object part").errno(), libc::EIO);
}

#[test]
fn bad_imports_are_refused_and_change_nothing() {
    let w = World::new();
    let vol = w.open();
    w.import(&vol, "x", b"abc");
    let source = vol.source(vol.lookup(ROOT_INO, b"x").expect("x").ino).expect("source").expect("imported");
    let t = Timestamp { secs: 1, nanos: 0 };
    let errno = |name: &[u8], parent: u64, s: Source| {
        vol.import(parent, name, 0o644, (0, 0), s, t).expect_err("must fail").errno()
    };
    assert_eq!(errno(b"x", ROOT_INO, source.clone()), libc::EEXIST);
    assert_eq!(errno(b"a/b", ROOT_INO, source.clone()), libc::EINVAL);
    assert_eq!(errno(b"..", ROOT_INO, source.clone()), libc::EEXIST);
    assert_eq!(errno(b"y", 999, source.clone()), libc::ENOENT);
    assert_eq!(errno(b"y", ROOT_INO, Source { size: 1 << 50, ..source.clone() }), libc::EFBIG);
    assert_eq!(errno(b"y", ROOT_INO, Source { key: String::new(), ..source }), libc::EINVAL);
    assert_eq!(vol.list_dir(ROOT_INO).expect("list").len(), 1);
}

#[test]
fn a_refresh_replaces_a_pristine_file_in_one_step_and_sees_writes_on_top() {
    let w = World::new();
    let vol = w.open();
    let a = w.import(&vol, "a", &pattern(3 << 20, 1));
    let b = w.import(&vol, "b", &pattern(100, 2));
    let empty = w.import(&vol, "e", b"");
    assert!(vol.pristine_source(a).expect("a").is_some());
    assert!(vol.pristine_source(empty).expect("e").is_some());
    vol.write(b, 10, b"mine").expect("write");
    assert_eq!(vol.pristine_source(b).expect("b"), None, "written on top");
    let c = vol.create(ROOT_INO, b"c", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
    assert_eq!(vol.pristine_source(c).expect("c"), None, "not imported");
    // The object changes; the refresh points the file at the new one.
    let new = pattern(5 << 20, 9);
    let etag = w.bucket.put("a", &new).expect("put");
    let src = Source { bucket: "corpus".into(), key: "a".into(), size: new.len() as u64, etag, version: None };
    let t = Timestamp { secs: 1_800_000_000, nanos: 0 };
    let attr = vol.reimport(a, src.clone(), t).expect("reimport");
    assert_eq!((attr.size, attr.mtime.secs), (new.len() as u64, 1_800_000_000));
    assert_eq!(vol.read(a, 0, new.len()).expect("read"), new);
    assert_eq!(vol.pristine_source(a).expect("a"), Some(src.clone()));
    // Replayed the same way.
    vol.fsync(a).expect("fsync");
    drop(vol);
    let vol = w.open();
    assert_eq!(vol.read(a, 0, new.len()).expect("read after replay"), new);
    // A shrinking object, and a refused target.
    let small = pattern(10, 3);
    let etag = w.bucket.put("a", &small).expect("put");
    vol.reimport(a, Source { size: 10, etag, ..src.clone() }, t).expect("reimport smaller");
    assert_eq!(vol.read(a, 0, 100).expect("read"), small);
    assert_eq!(vol.reimport(ROOT_INO, src, t).expect_err("a directory").errno(), libc::EISDIR);
}

/// An import killed anywhere (a crash at every durable step, unsynced
/// bytes dropped or torn) recovers to a prefix of its files, each whole and
/// reading its object; running it again adds exactly the rest.
#[test]
fn an_import_crashed_anywhere_recovers_a_prefix_and_a_rerun_completes_it() {
    use arbor_engine::device::CrashMode;
    let names: Vec<String> = (0..40).map(|i| format!("obj-{i:02}")).collect();
    let w = World::new();
    let bodies: Vec<Vec<u8>> = (0..40).map(|i| pattern(1000 + i * 4099, i as u8)).collect();
    let etags: Vec<String> = names.iter().zip(&bodies).map(|(n, b)| w.bucket.put(n, b).expect("put")).collect();
    let import_rest = |vol: &Volume| {
        for (i, n) in names.iter().enumerate() {
            if vol.lookup(ROOT_INO, n.as_bytes()).is_ok() {
                continue;
            }
            let source = Source {
                bucket: "corpus".into(),
                key: n.clone(),
                size: bodies[i].len() as u64,
                etag: etags[i].clone(),
                version: None,
            };
            vol.import(ROOT_INO, n.as_bytes(), 0o644, (0, 0), source, Timestamp { secs: 5, nanos: 0 })?;
            if i % 8 == 7 {
                vol.sync_all()?;
            }
        }
        vol.sync_all()
    };
    let (mut prefixes, mut crashed) = (std::collections::BTreeSet::new(), 0);
    for nth in 0..30 {
        for mode in [CrashMode::DropUnsynced, CrashMode::Scramble { seed: nth }] {
            let dev = SimDevice::new();
            let cfg = Config { commit_every_ops: 7, ..w.cfg() };
            let vol = Volume::open(Arc::new(dev.clone()), cfg.clone()).expect("open");
            dev.crash_at_failpoint(None, nth);
            crashed += usize::from(import_rest(&vol).is_err());
            dev.crash(mode);
            drop(vol);
            let vol = Volume::open(Arc::new(dev.clone()), cfg.clone()).expect("recovery");
            let present: Vec<bool> = names.iter().map(|n| vol.lookup(ROOT_INO, n.as_bytes()).is_ok()).collect();
            let n = present.iter().take_while(|p| **p).count();
            assert!(present[n..].iter().all(|p| !p), "crash at {nth}: not a prefix: {present:?}");
            prefixes.insert(n);
            import_rest(&vol).expect("rerun");
            for (i, name) in names.iter().enumerate() {
                let ino = vol.lookup(ROOT_INO, name.as_bytes()).expect("imported").ino;
                assert!(vol.read(ino, 0, 1 << 20).expect("read") == bodies[i], "crash at {nth}: {name}");
            }
            assert_eq!(vol.list_dir(ROOT_INO).expect("list").len(), names.len(), "nothing twice");
        }
    }
    assert!(crashed > 0 && prefixes.len() > 2, "crashes landed inside the import: {prefixes:?}");
}

#[test]
fn chunks_kept_on_local_disk_serve_the_next_volume_and_damage_costs_only_a_fetch() {
    use arbor_engine::chunks::{ChunkFiles, ChunkStore};
    let w = World::new();
    let files_dir = tempfile::tempdir().expect("tempdir");
    let body = pattern((5 << 20) + 777, 3);
    let chunks = body.len().div_ceil(1 << 20) as u64;
    let open = || {
        let files = ChunkFiles::open(files_dir.path(), &ChunkStore::new(64 << 20)).expect("files");
        let cfg = Config { source_files: Some(files), ..w.cfg() };
        Volume::open(Arc::new(w.dev.clone()), cfg).expect("open")
    };
    let vol = open();
    let ino = w.import(&vol, "big.bin", &body);
    assert_eq!(vol.read(ino, 0, body.len()).expect("read"), body);
    // Chunks go to disk once their readers have them: wait (bounded) for
    // all of them (each file is its body and a header of 20 bytes and more;
    // a missing one, the smallest 777 bytes, would leave less).
    let settle = |vol: &Volume| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while vol.source_stats().disk_bytes < body.len() as u64 + chunks * 20 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    };
    settle(&vol);
    let s = vol.source_stats();
    assert_eq!((s.fetched_bytes, s.from_disk), (body.len() as u64, 0), "{s:?}");
    assert!(s.disk_bytes >= body.len() as u64 + chunks * 20, "kept on disk: {s:?}");
    vol.close().expect("close");

    // A new process: its memory is empty, the files are not.
    let vol = open();
    assert_eq!(vol.read(ino, 0, body.len()).expect("read"), body);
    let s = vol.source_stats();
    assert_eq!((s.gets, s.from_disk), (0, chunks), "every chunk from disk: {s:?}");
    vol.close().expect("close");
    // Nor is the bucket needed then: a volume that cannot open it reads.
    let files = ChunkFiles::open(files_dir.path(), &ChunkStore::new(64 << 20)).expect("files");
    let no_bucket = Config {
        source_files: Some(files),
        sources: Arc::new(arbor_engine::source::FixedSources::default()),
        ..w.cfg()
    };
    let vol = Volume::open(Arc::new(w.dev.clone()), no_bucket).expect("open");
    assert_eq!(vol.read(ino, 0, body.len()).expect("read without the bucket"), body);
    vol.close().expect("close");

    // Every chunk file damaged: each is caught, fetched again, right.
    let mut damaged = 0;
    for sub in std::fs::read_dir(files_dir.path()).expect("dir").flatten() {
        for f in std::fs::read_dir(sub.path()).expect("sub").flatten() {
            let mut raw = std::fs::read(f.path()).expect("read");
            let mid = raw.len() - 100;
            raw[mid] ^= 0x40;
            std::fs::write(f.path(), &raw).expect("write");
            damaged += 1;
        }
    }
    assert_eq!(damaged, chunks);
    let vol = open();
    assert_eq!(vol.read(ino, 0, body.len()).expect("read"), body, "never the damaged bytes");
    let s = vol.source_stats();
    assert_eq!((s.from_disk, s.disk_damaged, s.fetched_bytes), (0, chunks, body.len() as u64), "{s:?}");
    settle(&vol);

    // The object changed: the chunks on disk are the imported version's
    // bytes (their id names its ETag), so they are still served; a chunk
    // that has to be fetched fails. Never the new bytes.
    w.bucket.put("big.bin", &pattern(body.len(), 9)).expect("overwrite");
    vol.close().expect("close");
    let vol = open();
    assert!(vol.read(ino, 0, body.len()).expect("cached") == body, "the imported version's bytes");
    vol.close().expect("close");
    let vol = Volume::open(Arc::new(w.dev.clone()), w.cfg()).expect("open without the files");
    let err = vol.read(ino, 0, 1 << 20).expect_err("changed");
    assert_eq!(err.errno(), libc::EIO, "{err}");
}

#[test]
fn imported_chunks_and_segment_chunks_share_one_budget_and_give_way_to_each_other() {
    use arbor_engine::chunks::ChunkFiles;
    use arbor_engine::head::HeadDevice;
    use arbor_engine::tier::{BucketDevice, Durability, TierConfig};
    let disk: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::new());
    let corpus = Arc::new(MemObjectStore::new());
    let cache = tempfile::tempdir().expect("tempdir");
    let tier = TierConfig {
        durability: Durability::Local,
        chunk_size: 64 << 10,
        read_ahead: 256 << 10,
        drain_timeout: Some(std::time::Duration::from_secs(60)),
        ..TierConfig::default()
    };
    let cfg = || Config {
        commit_interval: None,
        segment_size: 1 << 20,
        env: TestEnv::new(5),
        sources: FixedSources::with("corpus", corpus.clone()),
        ..Config::default()
    };
    // A writer puts 6 MiB in segments and imports a 6 MiB object.
    let written = pattern(6 << 20, 8);
    let object = pattern(6 << 20, 9);
    {
        let dev = BucketDevice::open(disk.clone(), &cache.path().join("writer"), tier.clone()).expect("device");
        let vol = Volume::open(HeadDevice::new(dev.clone(), disk.clone(), "main"), cfg()).expect("open");
        let ino = vol.create(ROOT_INO, b"written", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
        for (i, part) in written.chunks(1 << 20).enumerate() {
            vol.write(ino, (i << 20) as u64, part).expect("write");
        }
        let etag = corpus.put("object", &object).expect("put");
        let source =
            Source { bucket: "corpus".into(), key: "object".into(), size: object.len() as u64, etag, version: None };
        vol.import(ROOT_INO, b"object", 0o644, (0, 0), source, Timestamp { secs: 1_700_000_000, nanos: 0 })
            .expect("import");
        vol.close().expect("close");
    }

    // A reader with a cold cache folder of 3 MiB for both kinds of chunk.
    let capacity = 3 << 20;
    let folder = cache.path().join("reader");
    let dev = BucketDevice::open(disk.clone(), &folder, TierConfig { cache_size: capacity, ..tier }).expect("device");
    let files = ChunkFiles::open(&folder.join("objects"), &dev.chunk_store()).expect("files");
    let reader = || {
        let cfg = Config { read_only: true, source_files: Some(files.clone()), ..cfg() };
        Volume::open(HeadDevice::new(dev.clone(), disk.clone(), "main"), cfg).expect("open")
    };
    let read_all = |vol: &Volume, name: &[u8], want: &[u8]| {
        let ino = vol.lookup(ROOT_INO, name).expect("lookup").ino;
        for (i, part) in want.chunks(1 << 20).enumerate() {
            assert!(vol.read(ino, (i << 20) as u64, 1 << 20).expect("read") == part, "chunk {i}");
        }
    };
    // (segment bytes, imported bytes), checked against the one budget and
    // the files in the objects folder.
    let held = || {
        let s = dev.stats().cache;
        assert_eq!(s.capacity, capacity);
        assert!(s.cached_bytes + s.object_bytes <= capacity, "over the one budget: {s:?}");
        let on_disk: u64 = std::fs::read_dir(folder.join("objects"))
            .expect("objects")
            .flatten()
            .flat_map(|sub| std::fs::read_dir(sub.path()).expect("sub").flatten())
            .map(|f| f.metadata().expect("meta").len())
            .sum();
        assert_eq!(on_disk, s.object_bytes, "the chunk files follow the store");
        (s.cached_bytes, s.object_bytes)
    };

    let vol = reader();
    read_all(&vol, b"written", &written);
    let (segments, objects) = held();
    assert!(segments > capacity / 2 && objects == 0, "segment chunks fill the store: {segments} {objects}");
    read_all(&vol, b"object", &object);
    // Its chunk files land once their readers have them.
    vol.close().expect("close");
    let (after, objects) = held();
    assert!(objects > capacity / 2, "imported chunks were kept: {objects}");
    assert!(after < segments, "segment chunks gave way to imported ones: {after} of {segments}");
    assert_eq!(vol.source_stats().disk_capacity, capacity, "one capacity, reported by both");
    drop(vol);

    // The segments read again (a new volume: nothing in its memory) push
    // the imported chunks out in turn.
    let vol = reader();
    read_all(&vol, b"written", &written);
    vol.close().expect("close");
    let (segments, objects) = held();
    assert!(segments > capacity / 2 && objects == 0, "imported chunks gave way: {segments} {objects}");
    assert!(dev.stats().cache.evicted_bytes >= 12 << 20, "{:?}", dev.stats().cache);
}
