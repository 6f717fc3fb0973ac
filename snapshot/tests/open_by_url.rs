//! Opening a disk from its URL, as the CLI, the benches and the tests do:
//! the same calls on a local folder and on an s3:// disk (a real S3 server).

use arbor_engine::layout;
use arbor_engine::testkit::{S3Server, S3_BUCKET};
use arbor_engine::volume::{Config, ROOT_INO};
use arbor_snapshot::disk::{CacheOptions, Disk, DiskOptions, S3Overrides};

fn quiet() -> Config {
    Config { commit_interval: None, ..Config::default() }
}

/// Writes a file on main, checkpoints it, and reads it back through a
/// second open of the disk with its own (empty) cache.
fn round_trip(url: &str, opts: impl Fn(&str) -> DiskOptions) {
    let disk = Disk::init(url, opts("writer")).expect("init");
    {
        let cat = disk.catalog().expect("catalog");
        let (vol, _lock) = cat.open_branch("main", quiet()).expect("main");
        let ino = vol.create(ROOT_INO, b"hello", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
        vol.write(ino, 0, b"from one open to another").expect("write");
        cat.checkpoint_volume("v1", "main", &vol).expect("checkpoint");
        vol.close().expect("close");
    }
    drop(disk);
    let disk = Disk::open(url, opts("reader")).expect("open");
    let vol = disk.catalog().expect("catalog").open_checkpoint("v1", quiet()).expect("checkpoint");
    let ino = vol.lookup(ROOT_INO, b"hello").expect("lookup").ino;
    assert_eq!(vol.read(ino, 0, 64).expect("read"), b"from one open to another");
    assert_eq!(disk.catalog().expect("catalog").list_branches().expect("branches").len(), 1);
    assert!(disk.store().get(layout::IDENTITY).expect("identity").0.starts_with(layout::FORMAT.as_bytes()));
}

#[test]
fn a_local_folder_disk_opens_from_its_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = dir.path().join("disk").display().to_string();
    round_trip(&url, |_| DiskOptions::default());
    assert!(dir.path().join("disk").join(layout::SEGMENT_DIR).is_dir());
}

#[test]
fn an_s3_disk_opens_from_its_url_with_a_cache_per_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(server) = S3Server::start(&dir.path().join("s3")).expect("s3s-fs") else { return };
    let url = format!("s3://{S3_BUCKET}/disk");
    let node = dir.path().join("node");
    round_trip(&url, |who| DiskOptions {
        cache: CacheOptions { dir: Some(node.join(who)), ..CacheOptions::default() },
        s3: Some(S3Overrides::from(&server.config("disk"))),
        node_dir: Some(node.clone()),
        ..DiskOptions::default()
    });
    assert!(node.join("reader").is_dir(), "the reader used the cache folder it was given");
    let again =
        Disk::init(&url, DiskOptions { s3: Some(S3Overrides::from(&server.config("disk"))), ..DiskOptions::default() });
    assert_eq!(again.err().map(|e| e.errno()), Some(libc::EEXIST), "a second init is refused");
}
