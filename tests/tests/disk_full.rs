//! A full disk under the log: writes through the mount fail with ENOSPC,
//! nothing fsynced is lost or damaged, and once space is freed the same
//! mount works again. The log's file system is a small tmpfs, filled up by
//! the mount and by a ballast file that is then deleted.

use arbor_engine::testkit::S3_BUCKET;
use arbor_tests::*;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A tmpfs of `mib` MiB mounted on a temporary folder; unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(mib: u32) -> Tmpfs {
        let dir = tempfile::Builder::new().prefix("arbfull").tempdir().expect("tempdir");
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("mount");
        assert!(ok.success(), "cannot mount a tmpfs");
        Tmpfs { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

fn try_write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// Writes 1 MiB files through the mount until one fails, which must be
/// with ENOSPC; returns the names that were fsynced.
fn fill(mnt: &Path) -> Vec<(String, u32)> {
    let mut synced = Vec::new();
    for i in 0..400u32 {
        let name = format!("f{i:03}");
        match try_write_synced(&mnt.join(&name), &pattern(1 << 20, i)) {
            Ok(()) => synced.push((name, i)),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "a full disk must say ENOSPC, not {e}");
                return synced;
            }
        }
    }
    panic!("400 MiB went into a small tmpfs without ENOSPC");
}

fn check(mnt: &Path, files: &[(String, u32)]) {
    for (name, seed) in files {
        let got = std::fs::read(mnt.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(got == pattern(1 << 20, *seed), "{name}: bytes differ");
    }
}

fn ballast(dir: &Path, mib: usize) -> PathBuf {
    let p = dir.join("ballast");
    std::fs::write(&p, vec![1u8; mib << 20]).expect("ballast");
    p
}

/// Fills the log's file system through `mnt`, frees the ballast, and
/// writes again through the same mount. Returns every fsynced file.
fn fill_then_free(mnt: &Path, ballast: &Path) -> Vec<(String, u32)> {
    let mut synced = fill(mnt);
    assert!(synced.len() >= 4, "only {} files fit", synced.len());
    check(mnt, &synced);
    std::fs::remove_file(ballast).expect("free the ballast");
    for i in 1000..1004u32 {
        let name = format!("after-{i}");
        try_write_synced(&mnt.join(&name), &pattern(1 << 20, i)).expect("write once space is freed");
        synced.push((name, i));
    }
    check(mnt, &synced);
    synced
}

#[test]
fn a_full_local_disk_says_enospc_keeps_what_was_fsynced_and_recovers_without_a_remount() {
    if !fuse_available() {
        return;
    }
    let fs = Tmpfs::mount(96);
    let disk = fs.path().join("disk");
    arbor_ok(&["init", disk.to_str().expect("utf8")]);
    let ballast = ballast(fs.path(), 24);
    let s = Scratch::new();
    let d = disk.to_str().expect("utf8");
    let m = Mount::start(d, &s.mnt, &["--segment-size", "4M"]);
    let synced = fill_then_free(&s.mnt, &ballast);
    m.unmount();
    let m = Mount::start(d, &s.mnt, &[]);
    check(&s.mnt, &synced);
    m.unmount();
    let fsck = arbor_ok(&["fsck", d, "--json"]);
    assert!(fsck.contains("\"problems\":[]"), "{fsck}");
}

#[test]
fn a_full_cache_folder_of_an_s3_disk_says_enospc_and_recovers_without_a_remount() {
    let Some(w) = S3World::start() else { return };
    let fs = Tmpfs::mount(96);
    let disk = format!("s3://{S3_BUCKET}/disks/full");
    arbor_env_ok(&["init", &disk], &w.env);
    let ballast = ballast(fs.path(), 24);
    let cache = fs.path().join("cache").display().to_string();
    let mnt = w.mnt("m");
    let m = Mount::start_env(&disk, &mnt, &["--segment-size", "4M", "--cache-dir", &cache], &w.env);
    let synced = fill_then_free(&mnt, &ballast);
    m.unmount_env(&w.env);
    // From the bucket alone.
    w.lose_the_cache();
    let m = Mount::start_env(&disk, &mnt, &["--cache-dir", &w.dir.path().join("fresh").display().to_string()], &w.env);
    check(&mnt, &synced);
    m.unmount_env(&w.env);
}
