//! Offline verification of a volume's local segments: every record's
//! checksums, then every file's bytes read through a read-only volume.

use crate::device::Device;
use crate::error::Result;
use crate::log::{Cursor, Next};
use crate::volume::{features, Config, FileKind, Volume, ROOT_INO};
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Debug, Default, Clone)]
pub struct FsckReport {
    pub segments: u64,
    pub records: u64,
    pub files: u64,
    pub directories: u64,
    pub bytes_verified: u64,
    /// One line per problem found; empty means the volume is sound.
    pub problems: Vec<String>,
}

/// Checks every segment and every file. `progress` is called with a short
/// description of each step.
pub fn check(device: Arc<dyn Device>, progress: &mut dyn FnMut(&str)) -> Result<FsckReport> {
    let mut report = check_segments(device.clone(), progress)?;
    progress("files");
    let vol = Volume::open(device, Config { read_only: true, commit_interval: None, ..Config::default() })?;
    check_files(&vol, &mut report)?;
    Ok(report)
}

/// Verifies every record of every segment on `device`.
pub fn check_segments(device: Arc<dyn Device>, progress: &mut dyn FnMut(&str)) -> Result<FsckReport> {
    let mut report = FsckReport::default();
    let segments = device.list_segments()?;
    for seg in &segments {
        progress(&format!("segment {seg}"));
        report.segments += 1;
        let mut cursor = Cursor::new(device.clone(), *seg, 0)?;
        loop {
            match cursor.next_record()? {
                Next::Record(_) => report.records += 1,
                Next::End => break,
                Next::Torn(s, off, why) if s != *seg => {
                    // Walked on into the next segment: that one is checked on its own.
                    let _ = (off, why);
                    break;
                }
                Next::Torn(s, off, why) => {
                    // A record cut short by the end of the file is a torn tail
                    // from a crash (the next mount cuts it off); anything else
                    // is corruption.
                    if !why.contains("past end of segment") {
                        report.problems.push(format!("segment {s} offset {off}: {why}"));
                    }
                    break;
                }
            }
            if cursor.position().0 != *seg {
                break;
            }
        }
    }
    Ok(report)
}

/// Reads every file of `vol`, which verifies every data block it holds; on
/// a tree that promises exact names, checks that each file's recorded name
/// is one of its links. Imported files' objects are checked for their
/// recorded ETag (not read).
pub fn check_files(vol: &Volume, report: &mut FsckReport) -> Result<()> {
    check_files_with(vol, report, true)
}

/// [`check_files`]; without `online`, imported files' objects are not
/// asked for (`arbor fsck --offline`).
pub fn check_files_with(vol: &Volume, report: &mut FsckReport, online: bool) -> Result<()> {
    let check_names = vol.features() & features::NAMES_EXACT != 0;
    // Files by inode: whether one of their links is the recorded name.
    let mut named: HashMap<u64, bool> = HashMap::new();
    let mut stack = vec![ROOT_INO];
    while let Some(dir) = stack.pop() {
        report.directories += 1;
        for e in vol.list_dir(dir)? {
            if check_names && e.kind != FileKind::Directory {
                let found = named.entry(e.ino).or_default();
                if !*found {
                    *found = vol.recorded_name(e.ino)? == (dir, e.name.clone());
                }
            }
            match e.kind {
                FileKind::Directory => stack.push(e.ino),
                FileKind::Regular => {
                    report.files += 1;
                    match vol.verify_file(e.ino, online) {
                        Ok(n) => report.bytes_verified += n,
                        Err(err) => report.problems.push(format!("file inode {}: {err}", e.ino)),
                    }
                }
                _ => report.files += 1,
            }
        }
    }
    let mut stale: Vec<u64> = named.into_iter().filter(|(_, ok)| !ok).map(|(ino, _)| ino).collect();
    stale.sort_unstable();
    for ino in stale {
        let (parent, name) = vol.recorded_name(ino)?;
        report.problems.push(format!(
            "file inode {ino} records the name {:?} in directory inode {parent}, which is not one of its links",
            String::from_utf8_lossy(&name)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::SimDevice;
    use crate::env::TestEnv;

    #[test]
    fn fsck_passes_a_sound_volume_and_names_a_corrupt_block() {
        let dev = SimDevice::new();
        let cfg = Config { commit_interval: None, env: TestEnv::new(3), ..Config::default() };
        let vol = Volume::open(Arc::new(dev.clone()), cfg).expect("open");
        let f = vol.create(ROOT_INO, b"f", libc::S_IFREG | 0o644, 0, 0, 0).expect("create").ino;
        vol.write(f, 0, &vec![9u8; 100_000]).expect("write");
        vol.close().expect("close");
        let (seg, _) = vol.log_handle().expect("log").position();
        drop(vol);
        let ok = check(Arc::new(dev.clone()), &mut |_| {}).expect("fsck");
        assert!(ok.problems.is_empty(), "{:?}", ok.problems);
        assert_eq!((ok.files, ok.bytes_verified), (1, 100_000));
        // Flip a byte in the middle of the file's data.
        dev.corrupt(seg, 50_000);
        let bad = check(Arc::new(dev), &mut |_| {}).expect("fsck");
        assert!(!bad.problems.is_empty());
    }
}
