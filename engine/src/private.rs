//! Files and folders only their owner can open. A disk is a block device:
//! its segments hold every file's bytes whatever the file's mode inside
//! the disk, so everything arbor creates on the node (disk folders, caches,
//! logs, locks) is 0700 / 0600, whatever the umask says.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

pub const DIR_MODE: u32 = 0o700;
pub const FILE_MODE: u32 = 0o600;

/// `fs::create_dir_all`, with every folder it creates private.
pub fn create_dir_all(path: &Path) -> io::Result<()> {
    DirBuilder::new().recursive(true).mode(DIR_MODE).create(path)
}

/// Open options that create files private.
pub fn options() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.mode(FILE_MODE);
    o
}

/// `File::create`, private.
pub fn create(path: &Path) -> io::Result<File> {
    options().write(true).create(true).truncate(true).open(path)
}

/// Takes group and other permissions off everything under `root` (and
/// `root` itself) that the current user owns: what an older build created
/// readable by all. Symbolic links are not followed. Returns how many
/// entries changed.
pub fn tighten(root: &Path) -> io::Result<u64> {
    // SAFETY: plain syscall.
    let me = unsafe { libc::geteuid() };
    let mut changed = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(path) = stack.pop() {
        let meta = match std::fs::symlink_metadata(&path) {
            Ok(m) => m,
            // Removed meanwhile (a lock, a temporary object): nothing to tighten.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        if meta.file_type().is_symlink() || meta.uid() != me {
            continue;
        }
        if meta.mode() & 0o077 != 0 {
            let mode = meta.mode() & 0o700;
            match std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)) {
                Ok(()) => changed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            }
        }
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path)? {
                stack.push(entry?.path());
            }
        }
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).expect("stat").mode() & 0o777
    }

    #[test]
    fn created_private_whatever_the_umask() {
        let dir = tempfile::tempdir().expect("tempdir");
        // SAFETY: plain syscall; the old mask is put back.
        let old = unsafe { libc::umask(0) };
        let made = (|| {
            create_dir_all(&dir.path().join("a/b"))?;
            create(&dir.path().join("a/b/f"))?;
            io::Result::Ok(())
        })();
        // SAFETY: as above.
        unsafe { libc::umask(old) };
        made.expect("create");
        assert_eq!(mode(&dir.path().join("a")), 0o700);
        assert_eq!(mode(&dir.path().join("a/b")), 0o700);
        assert_eq!(mode(&dir.path().join("a/b/f")), 0o600);
    }

    #[test]
    fn tighten_takes_group_and_other_bits_off_everything() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("disk");
        std::fs::create_dir_all(root.join("segments")).expect("mkdir");
        std::fs::write(root.join("segments/seg-1"), b"bytes").expect("write");
        std::fs::write(root.join("disk"), b"id").expect("write");
        for (p, m) in [("", 0o755), ("segments", 0o775), ("segments/seg-1", 0o644), ("disk", 0o640)] {
            std::fs::set_permissions(root.join(p), std::fs::Permissions::from_mode(m)).expect("chmod");
        }
        assert_eq!(tighten(&root).expect("tighten"), 4);
        assert_eq!(mode(&root), 0o700);
        assert_eq!(mode(&root.join("segments")), 0o700);
        assert_eq!(mode(&root.join("segments/seg-1")), 0o600);
        assert_eq!(mode(&root.join("disk")), 0o600);
        assert_eq!(tighten(&root).expect("again"), 0, "a second pass changes nothing");
    }
}
