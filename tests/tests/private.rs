//! A disk's files are its owner's alone: a file that is private in the
//! mount must not be readable by another local user through the disk
//! folder, the cache folder, the logs or the locks.

use arbor_engine::testkit::S3_BUCKET;
use arbor_tests::*;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

const SECRET: &str = "arbor-private-bytes-7f3a91";

/// Lets every user traverse `dir` (a test's scratch folder), so what keeps
/// `nobody` out below is arbor's doing, not the scratch folder's.
fn open_up(dir: &Path) {
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

/// Which files under `dir` user `nobody` finds `SECRET` in (grep's errors
/// for what it cannot open are the point, and are dropped).
fn nobody_finds_secret_in(dir: &Path) -> Vec<String> {
    let out = Command::new("runuser")
        .args(["-u", "nobody", "--", "grep", "-rl", "--no-messages", SECRET])
        .arg(dir)
        .output()
        .expect("runuser");
    String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect()
}

/// Every entry under `root` whose mode lets group or others in.
fn open_to_others(root: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&p) else { continue };
        if meta.file_type().is_socket() {
            continue;
        }
        if meta.mode() & 0o077 != 0 {
            found.push(format!("{} {:o}", p.display(), meta.mode() & 0o777));
        }
        if meta.is_dir() {
            stack.extend(std::fs::read_dir(&p).expect("readdir").map(|e| e.expect("entry").path()));
        }
    }
    found
}

use std::os::unix::fs::FileTypeExt;

/// Writes a 0600 file holding the secret through the mount, fsynced.
fn write_private_file(mnt: &Path) {
    let path = mnt.join("private.txt");
    write_synced(&path, SECRET.repeat(2_000).as_bytes());
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
}

#[test]
fn a_local_disk_and_its_logs_are_private_and_an_old_disk_is_tightened() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::short();
    open_up(s.dir.path());
    // The check itself works: a file readable by all is found.
    let canary = s.dir.path().join("canary");
    std::fs::write(&canary, SECRET).expect("canary");
    std::fs::set_permissions(&canary, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    assert_eq!(nobody_finds_secret_in(s.dir.path()), vec![canary.display().to_string()], "the check cannot see");
    std::fs::remove_file(&canary).expect("rm canary");

    // A background mount, so its log lives in the disk folder too.
    arbor_ok(&["mount", s.disk_str(), s.mnt.to_str().expect("utf8")]);
    write_private_file(&s.mnt);
    assert!(nobody_finds_secret_in(s.dir.path()).is_empty(), "nobody read the secret");
    assert_eq!(open_to_others(&s.disk), Vec::<String>::new(), "open to others");
    arbor_ok(&["unmount", s.mnt.to_str().expect("utf8")]);
    assert!(nobody_finds_secret_in(s.dir.path()).is_empty(), "nobody read the secret after unmount");

    // A disk an older build left readable by all is tightened by the next
    // read-write mount, which says so in its log.
    Command::new("chmod").args(["-R", "go+rX"]).arg(&s.disk).status().expect("chmod -R");
    assert!(!nobody_finds_secret_in(s.dir.path()).is_empty(), "an open disk should leak (the test's premise)");
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    assert_eq!(open_to_others(&s.disk), Vec::<String>::new(), "not tightened");
    assert!(nobody_finds_secret_in(s.dir.path()).is_empty(), "nobody read the secret after tightening");
    let log = m.log.clone();
    m.unmount();
    let log = std::fs::read_to_string(log).expect("log");
    assert_eq!(log.matches("private to their owner").count(), 1, "said once:\n{log}");
}

#[test]
fn the_cache_of_an_s3_disk_is_private() {
    let Some(w) = S3World::start() else { return };
    open_up(w.dir.path());
    let disk = format!("s3://{S3_BUCKET}/disks/private");
    arbor_env_ok(&["init", &disk], &w.env);
    let mnt = w.mnt("m");
    let m = Mount::start_env(&disk, &mnt, &[], &w.env);
    write_private_file(&mnt);
    let cache = w.dir.path().join("cache");
    assert!(cache.is_dir(), "no cache folder at {}", cache.display());
    assert!(nobody_finds_secret_in(w.dir.path()).is_empty(), "nobody read the secret from the cache");
    m.unmount_env(&w.env);
    assert_eq!(open_to_others(&cache), Vec::<String>::new(), "open to others");
    assert!(nobody_finds_secret_in(w.dir.path()).is_empty(), "nobody read the secret after unmount");
}
