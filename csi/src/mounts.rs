//! The node's mount table (`/proc/self/mountinfo`) and the bind mounts
//! that publish a staged volume into a pod.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// One line of `/proc/self/mountinfo`, the fields the plugin needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    /// The mounted file system's device, `MAJOR:MINOR` (a FUSE mount's
    /// connection: a new mount at the same path has another).
    pub device: String,
    pub mount_point: PathBuf,
    pub fs_type: String,
    pub read_only: bool,
}

/// Undoes mountinfo's octal escapes (`\040` for a space, …).
fn unescape(field: &str) -> PathBuf {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    PathBuf::from(std::ffi::OsStr::from_bytes(&out))
}

/// Parses mountinfo text; malformed lines are skipped.
pub fn parse(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            let fields: Vec<&str> = before.split(' ').collect();
            let device = fields.get(2)?.to_string();
            let mount_point = unescape(fields.get(4)?);
            let read_only = fields.get(5)?.split(',').any(|o| o == "ro");
            let fs_type = after.split(' ').next()?.to_string();
            Some(MountEntry { device, mount_point, fs_type, read_only })
        })
        .collect()
}

/// The mounts at `path` now, the last one on top.
pub fn mounts_at(path: &Path) -> io::Result<Vec<MountEntry>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(parse(&text).into_iter().filter(|m| m.mount_point == path).collect())
}

pub fn is_mounted(path: &Path) -> io::Result<bool> {
    Ok(!mounts_at(path)?.is_empty())
}

/// Whether the file system at `path` answers `statfs`, which always
/// reaches a FUSE server (a `stat` may be answered from the kernel's
/// cache after the server died; `statfs` then fails with ENOTCONN).
pub fn answers(path: &Path) -> bool {
    let Ok(c) = c_path(path) else { return false };
    let mut buf = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: a valid NUL-terminated path and a buffer statfs fills.
    unsafe { libc::statfs(c.as_ptr(), buf.as_mut_ptr()) == 0 }
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))
}

/// Binds `source` at `target`, then makes that bind read-only if asked
/// (a bind mount takes its flags only from a remount).
pub fn bind(source: &Path, target: &Path, read_only: bool) -> io::Result<()> {
    let (src, dst) = (c_path(source)?, c_path(target)?);
    // SAFETY: valid NUL-terminated paths; no file system type or data.
    let r = unsafe { libc::mount(src.as_ptr(), dst.as_ptr(), std::ptr::null(), libc::MS_BIND, std::ptr::null()) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    if read_only {
        let flags = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY;
        // SAFETY: as above, on the bind just made.
        let r = unsafe { libc::mount(std::ptr::null(), dst.as_ptr(), std::ptr::null(), flags, std::ptr::null()) };
        if r != 0 {
            let e = io::Error::last_os_error();
            let _ = unmount(target);
            return Err(e);
        }
    }
    Ok(())
}

/// Unmounts whatever is mounted at `target`, every layer (bounded).
pub fn unmount_all(target: &Path) -> io::Result<()> {
    for _ in 0..16 {
        if !is_mounted(target)? {
            return Ok(());
        }
        unmount(target)?;
    }
    Err(io::Error::other(format!("{} is still mounted after 16 unmounts", target.display())))
}

fn unmount(target: &Path) -> io::Result<()> {
    let dst = c_path(target)?;
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::umount2(dst.as_ptr(), 0) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINVAL) {
            return Err(e);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_with_escapes_and_options() {
        let text = "36 35 98:0 /mnt1 /mnt/a\\040b rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n\
                    37 35 0:44 / /var/lib/kubelet/pods/x/mount ro,nosuid shared:2 - fuse.arbor arbor rw\n\
                    garbage line\n";
        let m = parse(text);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].mount_point, Path::new("/mnt/a b"));
        assert_eq!(m[0].fs_type, "ext3");
        assert!(!m[0].read_only);
        assert_eq!(m[1].fs_type, "fuse.arbor");
        assert_eq!((m[0].device.as_str(), m[1].device.as_str()), ("98:0", "0:44"));
        assert!(m[1].read_only);
    }
}
