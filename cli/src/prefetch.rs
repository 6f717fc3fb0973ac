//! Reading files ahead of their users, so the first epoch finds them warm.

use std::io::Read;
use std::path::{Path, PathBuf};

fn files_under(paths: &[PathBuf]) -> Vec<(PathBuf, u64)> {
    let mut out = Vec::new();
    let mut stack: Vec<PathBuf> = paths.to_vec();
    while let Some(p) = stack.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&p) else { continue };
        if meta.is_dir() {
            if let Ok(entries) = std::fs::read_dir(&p) {
                stack.extend(entries.filter_map(|e| e.ok().map(|e| e.path())));
            }
        } else if meta.is_file() {
            out.push((p, meta.len()));
        }
    }
    out
}

/// The total size of the files under `paths`.
pub fn total_bytes(paths: &[PathBuf]) -> (usize, u64) {
    let files = files_under(paths);
    (files.len(), files.iter().map(|(_, n)| n).sum())
}

/// Reads every file under `paths` once; `progress` gets each chunk's size.
/// Returns (files, bytes) read.
pub fn warm(paths: &[PathBuf], progress: &mut dyn FnMut(u64)) -> (usize, u64) {
    let mut buf = vec![0u8; 4 << 20];
    let (mut files, mut bytes) = (0, 0);
    for (path, _) in files_under(paths) {
        if read_through(&path, &mut buf, &mut |n| {
            bytes += n;
            progress(n)
        }) {
            files += 1;
        }
    }
    (files, bytes)
}

fn read_through(path: &Path, buf: &mut [u8], progress: &mut dyn FnMut(u64)) -> bool {
    let Ok(mut f) = std::fs::File::open(path) else { return false };
    loop {
        match f.read(buf) {
            Ok(0) => return true,
            Ok(n) => progress(n as u64),
            Err(_) => return false,
        }
    }
}
