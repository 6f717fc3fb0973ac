//! Old images still open: a small volume written by format 1 is committed
//! under `tests/fixtures/format-v1/`, and every later build must read it
//! exactly. Regenerate only on a deliberate format change (and add a new
//! fixture beside the old one):
//! `ARBOR_WRITE_FIXTURE=1 cargo test -p arbor-engine --test format_fixture`.

use arbor_engine::device::FileDevice;
use arbor_engine::io::IoMode;
use arbor_engine::volume::{read_commit, Config, FileKind, RenameMode, Volume, XattrFlags, ROOT_INO};
use std::path::PathBuf;

fn fixture() -> PathBuf {
    manifest_dir().join("tests/fixtures/format-v1")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
}

fn write_fixture() {
    let dir = fixture();
    let _ = std::fs::remove_dir_all(&dir);
    let dev = FileDevice::open(&dir, IoMode::Syscall).expect("device");
    let vol = Volume::open(dev, Config { commit_interval: None, ..Config::default() }).expect("open");
    let data = vol.mkdir(ROOT_INO, b"data", 0o750, 1000, 1000).expect("mkdir").ino;
    let small = vol.create(data, b"small.txt", libc::S_IFREG | 0o644, 1000, 1000, 0).expect("create").ino;
    vol.write(small, 0, b"inline bytes").expect("write");
    let big = vol.create(data, b"big.bin", libc::S_IFREG | 0o600, 0, 0, 0).expect("create").ino;
    vol.write(big, 0, &pattern(200_000, 1)).expect("write");
    vol.write(big, 50_000, &pattern(5_000, 2)).expect("overwrite");
    let sparse = vol.create(ROOT_INO, b"sparse", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
    vol.write(sparse, 3 << 30, b"far").expect("write");
    vol.symlink(ROOT_INO, b"link", b"data/small.txt", 0, 0).expect("symlink");
    vol.link(small, ROOT_INO, b"hard").expect("link");
    vol.setxattr(big, b"user.origin", b"fixture", XattrFlags::Create).expect("xattr");
    vol.mkdir(ROOT_INO, b"gone", 0o755, 0, 0).expect("mkdir");
    vol.rename(ROOT_INO, b"gone", data, b"moved", RenameMode::Plain).expect("rename");
    vol.close().expect("close");
    // Leave an intent after the last commit too, so replay is exercised.
    let vol = Volume::open(
        FileDevice::open(&dir, IoMode::Syscall).expect("device"),
        Config { commit_interval: None, ..Config::default() },
    )
    .expect("reopen");
    vol.write(small, 0, b"INLINE").expect("write");
    vol.sync_all().expect("sync");
}

#[test]
fn a_format_1_volume_still_opens_and_reads_the_same() {
    if std::env::var_os("ARBOR_WRITE_FIXTURE").is_some() {
        write_fixture();
    }
    // Open a copy: recovery of a writable open would change the fixture.
    let copy = tempfile::tempdir().expect("tempdir");
    for entry in std::fs::read_dir(fixture()).expect("fixture exists") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, copy.path().join(path.file_name().expect("name"))).expect("copy");
    }
    for read_only in [true, false] {
        let dev = FileDevice::open(copy.path(), IoMode::Syscall).expect("device");
        let vol = Volume::open(dev, Config { read_only, commit_interval: None, ..Config::default() }).expect("open");
        // Written before commit records carried feature bits: it promises
        // nothing, and its commits (the writable open makes one) keep none.
        assert_eq!(vol.features(), 0);
        if let Some(at) = vol.last_commit() {
            assert_eq!(
                read_commit(&*FileDevice::open(copy.path(), IoMode::Syscall).expect("device"), at)
                    .expect("commit")
                    .features,
                0
            );
        }
        let data = vol.lookup(ROOT_INO, b"data").expect("data");
        assert_eq!((data.kind, data.perm, data.uid), (FileKind::Directory, 0o750, 1000));
        let small = vol.lookup(data.ino, b"small.txt").expect("small").ino;
        assert_eq!(vol.read(small, 0, 100).expect("read"), b"INLINE bytes");
        assert_eq!(vol.getattr(small).expect("attr").nlink, 2);
        let big = vol.lookup(data.ino, b"big.bin").expect("big").ino;
        let mut want = pattern(200_000, 1);
        want[50_000..55_000].copy_from_slice(&pattern(5_000, 2));
        assert!(vol.read(big, 0, 200_000).expect("read") == want);
        assert_eq!(vol.getxattr(big, b"user.origin").expect("xattr"), b"fixture");
        let sparse = vol.lookup(ROOT_INO, b"sparse").expect("sparse").ino;
        assert_eq!(vol.read(sparse, 3 << 30, 10).expect("read"), b"far");
        assert_eq!(
            vol.readlink(vol.lookup(ROOT_INO, b"link").expect("link").ino).expect("readlink"),
            b"data/small.txt"
        );
        assert!(vol.lookup(data.ino, b"moved").is_ok() && vol.lookup(ROOT_INO, b"gone").is_err());
        vol.close().expect("close");
    }
}

/// This package's folder: where cargo says when it runs the test (the
/// build may have been made in another clone of the repository).
fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}
