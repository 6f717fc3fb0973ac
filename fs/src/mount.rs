//! Mounting a volume: kernel options chosen for speed, a request pool, and
//! recovery of a stale mount left by a killed process.

use crate::adapter::Counters;
use crate::classic::Classic;
use crate::ring::{RingChoice, Transport};
use crate::{ArborFs, Files};
use fuser::{Config, MountOption, SessionACL};
use std::io;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::Arc;

/// Threads answering FUSE requests by default: enough that many reads
/// waiting for a bucket (~40 ms each for small objects) overlap. With 4,
/// reading 10,000 small imported files with 8 readers went at ~100 files/s;
/// with 16, ~190/s; 32 readers on 32 threads, ~700/s (s3s-fs on 127.0.0.1).
pub const THREADS: usize = 32;

#[derive(Clone, Debug)]
pub struct MountOptions {
    /// Let users other than the mounting one in (needs `user_allow_other`
    /// in /etc/fuse.conf unless root).
    pub allow_other: bool,
    /// Threads answering kernel requests, so a slow read does not block
    /// the rest. A read that waits for a bucket (a chunk not cached yet, an
    /// imported file's object) holds its thread for a round trip: this is
    /// also how many such reads are in flight at once.
    pub threads: usize,
    /// Kernel read-ahead for sequential readers.
    pub read_ahead: u32,
    pub fs_name: String,
    /// How requests reach arbor.
    pub transport: RingChoice,
    /// Write-only opens write past the page cache where the kernel allows
    /// it (see `direct.rs`).
    pub direct_writes: bool,
    /// Honour set-user-ID and set-group-ID bits, file capabilities and
    /// device nodes (`suid,dev`); without, the mount is `nosuid,nodev`. A
    /// mount of this node's own volume has them; a mount through a
    /// branch's owner has them only when asked, since every node that
    /// writes the branch could have made such a file.
    pub suid_devices: bool,
    /// Served so that another process can take the connection over when
    /// this one dies (`fs/src/resume.rs`): on `/dev/fuse` (unless
    /// `ARBOR_FUSE=ring` insists), every thread reading the one file
    /// [`MountHandle::device`] gives out.
    pub restartable: bool,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            allow_other: false,
            threads: THREADS,
            read_ahead: arbor_engine::tier::READ_AHEAD as u32,
            fs_name: "arbor".into(),
            transport: RingChoice::Auto,
            direct_writes: true,
            suid_devices: true,
            restartable: false,
        }
    }
}

pub struct MountHandle {
    session: Option<fuser::BackgroundSession>,
    /// A session taken over from a dead process, instead of fuser's.
    resumed: Option<crate::resume::Resumed>,
    /// The connection's `/dev/fuse` file, for a keeper to hold (restartable
    /// mounts on `/dev/fuse` only).
    device: Option<std::os::fd::OwnedFd>,
    mountpoint: std::path::PathBuf,
    transport: Arc<Transport>,
    counters: Arc<Counters>,
}

impl MountHandle {
    /// Unmounts (which commits the volume) and waits for the session to end.
    ///
    /// A mount point is busy for a moment whenever any process on the node
    /// forks while it holds a file open there (the child has a copy of the
    /// descriptor until it execs), so a busy unmount is tried again for up
    /// to [`BUSY_UNMOUNT`]. A mount still busy after that has files open:
    /// it is detached (gone from the namespace; the open files fail once
    /// the volume closes) and this says so in its error.
    pub fn unmount(mut self) -> io::Result<()> {
        if let Some(r) = self.resumed.take() {
            if !r.is_finished() {
                unmount_when_idle(&self.mountpoint, BUSY_UNMOUNT)?;
            }
            r.join();
            return Ok(());
        }
        let Some(s) = self.session.take() else { return Ok(()) };
        // Already unmounted from outside: something else may be mounted
        // there now.
        if s.guard.is_finished() {
            return s.join();
        }
        if let Err(e) = unmount_when_idle(&self.mountpoint, BUSY_UNMOUNT) {
            // The session thread ends when the last open file closes.
            drop(s);
            return Err(e);
        }
        s.umount_and_join()
    }

    /// Waits until the file system is unmounted from outside (for example
    /// by `fusermount3 -u`).
    pub fn join(mut self) -> io::Result<()> {
        if let Some(r) = self.resumed.take() {
            r.join();
            return Ok(());
        }
        match self.session.take() {
            Some(s) => s.join(),
            None => Ok(()),
        }
    }

    /// What pushes invalidations of names and inodes into the kernel's
    /// caches (a shared tree's owner says what other nodes changed).
    pub fn notifier(&self) -> Option<crate::Notify> {
        match &self.session {
            Some(s) => Some(crate::Notify::Fuser(s.notifier())),
            None => self.device.as_ref().and_then(|d| d.try_clone().ok()).map(|d| crate::Notify::Device(Arc::new(d))),
        }
    }

    /// Drops what the kernel caches of names and inodes changed by
    /// something other than this mount's requests (an import or refresh run
    /// through the control socket).
    pub fn invalidator(&self) -> Invalidator {
        Invalidator(self.notifier())
    }

    /// The transport requests travel on.
    pub fn transport(&self) -> &Arc<Transport> {
        &self.transport
    }

    /// What reached arbor through this mount.
    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    /// Whether the session thread has ended.
    pub fn is_finished(&self) -> bool {
        if let Some(r) = &self.resumed {
            return r.is_finished();
        }
        self.session.as_ref().is_none_or(|s| s.guard.is_finished())
    }

    /// A copy of the connection's `/dev/fuse` file, which a new process can
    /// serve with [`resume`] once this one is gone; `None` unless the
    /// mount is [`MountOptions::restartable`] and served on `/dev/fuse`.
    pub fn device(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.device.as_ref().map(|d| d.as_fd())
    }
}

fn config(opts: &MountOptions, read_only: bool) -> Config {
    let mut cfg = Config::default();
    cfg.mount_options = vec![
        MountOption::FSName(opts.fs_name.clone()),
        MountOption::Subtype("arbor".into()),
        // The kernel checks mode bits, owners and the sticky bit.
        MountOption::DefaultPermissions,
        MountOption::Exec,
        MountOption::NoAtime,
    ];
    if opts.suid_devices {
        cfg.mount_options.extend([MountOption::Dev, MountOption::Suid]);
    } else {
        cfg.mount_options.extend([MountOption::NoDev, MountOption::NoSuid]);
    }
    if read_only {
        cfg.mount_options.push(MountOption::RO);
    }
    if opts.allow_other {
        cfg.acl = SessionACL::All;
    }
    cfg.n_threads = Some(opts.threads.max(1));
    // A clone of the file per thread is cheaper to read, but a clone dies
    // with its process and fails the requests it had read: a restartable
    // mount's threads all read the one file its keeper holds too.
    cfg.clone_fd = !opts.restartable;
    cfg
}

/// See [`MountHandle::invalidator`]. Failures are logged, not returned: the
/// kernel answers ENOENT for what it does not hold, and an unmounted file
/// system has nothing cached.
pub struct Invalidator(Option<crate::Notify>);

impl Invalidator {
    /// The name `name` in directory `parent` (added, removed or replaced).
    pub fn entry(&self, parent: u64, name: &[u8]) {
        if let Some(n) = &self.0 {
            if let Err(e) = n.inval_entry(parent, name) {
                tracing::debug!(parent, error = %e, "cannot invalidate a kernel name");
            }
        }
    }

    /// Inode `ino`'s attributes and cached pages (its bytes changed).
    pub fn inode(&self, ino: u64) {
        if let Some(n) = &self.0 {
            if let Err(e) = n.inval_inode(ino, 0, 0) {
                tracing::debug!(ino, error = %e, "cannot invalidate a kernel inode");
            }
        }
    }
}

/// How a client of a shared branch drops what other nodes changed from
/// this mount's kernel.
impl arbor_engine::files::Invalidate for Invalidator {
    fn inode(&self, ino: u64) {
        Invalidator::inode(self, ino);
    }
    fn entry(&self, parent: u64, name: &[u8]) {
        Invalidator::entry(self, parent, name);
    }
}

/// Mounts `vol` at `mountpoint` and returns once the kernel answers, with
/// FUSE over io_uring when the kernel offers it (see [`RingChoice`]).
pub fn mount<F: Files + ?Sized>(vol: Arc<F>, mountpoint: &Path, opts: &MountOptions) -> io::Result<MountHandle> {
    recover_stale_mount(mountpoint)?;
    let choice = opts.transport;
    // Requests in flight on a ring die with its process.
    let kept_classic = opts.restartable && choice == RingChoice::Auto;
    let choice = if kept_classic { RingChoice::Classic } else { choice };
    let read_only = vol.is_read_only();
    let fs = Arc::new(ArborFs::new(vol, opts.read_ahead, opts.direct_writes));
    if opts.restartable {
        fs.outlive_process();
    }
    let transport = Arc::new(Transport::new(choice));
    let classic = Classic { fs: fs.clone(), transport: transport.clone() };
    // INIT is answered before this returns, so the transport is known.
    let session = fuser::Session::new(classic, mountpoint, &config(opts, read_only))?;
    // Before anything answers the kernel: a ring answers from its start.
    fs.set_notifier(crate::Notify::Fuser(session.notifier()));
    let kernel_read_ahead = set_kernel_read_ahead(mountpoint, opts.read_ahead);
    if kept_classic {
        transport.classic_because("restartable: a ring's requests would die with this process");
    }
    if transport.negotiated() {
        let dev = session.as_fd().try_clone_to_owned()?;
        if let Err(e) = transport.start(&fs, dev, opts.threads) {
            if choice == RingChoice::Ring {
                return Err(io::Error::other(format!(
                    "the io_uring transport was asked for: {}",
                    transport.describe()
                )));
            }
            tracing::warn!(error = %e, "FUSE over io_uring did not start; using /dev/fuse");
        }
    } else if choice == RingChoice::Ring {
        return Err(io::Error::other(format!("the io_uring transport was asked for, but {}", transport.describe())));
    }
    let device = match opts.restartable && !transport.is_ring() {
        true => Some(session.as_fd().try_clone_to_owned()?),
        false => None,
    };
    let session = session.spawn()?;
    let counters = fs.counters().clone();
    counters.kernel_read_ahead.set(kernel_read_ahead.unwrap_or(0).into());
    Ok(MountHandle {
        session: Some(session),
        resumed: None,
        device,
        mountpoint: mountpoint.to_path_buf(),
        transport,
        counters,
    })
}

/// Serves the mount at `mountpoint` on `dev`, its `/dev/fuse` file, after
/// the process that served it died (see `fs/src/resume.rs`): asks the
/// kernel to send again what that process left unanswered, then answers
/// every request with `opts.threads` threads. Nothing is mounted and
/// nothing asks the mount point anything (it has no server until this
/// returns).
pub fn resume<F: Files + ?Sized>(
    vol: Arc<F>,
    dev: std::os::fd::OwnedFd,
    mountpoint: &Path,
    opts: &MountOptions,
) -> io::Result<MountHandle> {
    let fs = Arc::new(ArborFs::new(vol, opts.read_ahead, opts.direct_writes));
    fs.outlive_process();
    // Handles the dead process gave out stay with the kernel's open files:
    // new ones must not repeat them, nor be taken for theirs.
    fs.skip_handles(crate::resume::incarnation() << 32);
    // Before Linux 6.9 what the dead process read and did not answer
    // would wait forever (holding its folder's lock, so every later change
    // there would too): the mount is given up instead.
    crate::resume::resend(&dev).map_err(|e| {
        io::Error::other(format!("the kernel cannot send again what the dead process read ({e}): not resuming"))
    })?;
    let keep = dev.try_clone()?;
    let dev = Arc::new(dev);
    fs.set_notifier(crate::Notify::Device(dev.clone()));
    let resumed = crate::resume::serve(fs.clone(), dev, opts.threads)?;
    let transport = Arc::new(Transport::new(RingChoice::Classic));
    transport.classic_because("taken over from a process that died");
    let counters = fs.counters().clone();
    counters.kernel_read_ahead.set(kernel_read_ahead(mountpoint).unwrap_or(0).into());
    Ok(MountHandle {
        session: None,
        resumed: Some(resumed),
        device: Some(keep),
        mountpoint: mountpoint.to_path_buf(),
        transport,
        counters,
    })
}

/// How long an unmount waits for a busy mount point to become idle.
pub const BUSY_UNMOUNT: std::time::Duration = std::time::Duration::from_secs(10);

/// Unmounts `mountpoint` as root would, trying again while it is busy for
/// up to `wait`, then detaching it. Without the privilege (EPERM) it does
/// nothing and leaves the unmount to `fusermount3 -u`; a mount point no
/// longer mounted (EINVAL) is fine.
fn unmount_when_idle(mountpoint: &Path, wait: std::time::Duration) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(mountpoint.as_os_str().as_bytes())?;
    let started = std::time::Instant::now();
    let mut pause = std::time::Duration::from_millis(5);
    loop {
        // SAFETY: a NUL-terminated path.
        if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EBUSY) if started.elapsed() < wait => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(std::time::Duration::from_millis(200));
            }
            Some(libc::EBUSY) => {
                // SAFETY: as above.
                unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
                return Err(io::Error::other(format!(
                    "{} stayed busy for {} s (files open there); detached it: those files now fail",
                    mountpoint.display(),
                    wait.as_secs()
                )));
            }
            _ => return Ok(()),
        }
    }
}

/// The kernel's read-ahead for the mount: the most it reads ahead of a
/// sequential reader, in bytes, where it could be read.
///
/// A FUSE connection's read-ahead is the smaller of what the server asks
/// for at INIT and the 128 KiB every new backing device starts with, so
/// what `--read-ahead` asks reaches the kernel only through sysfs
/// (`/sys/class/bdi/MAJ:MIN/read_ahead_kb`, root's to write). With 128 KiB
/// the kernel keeps about one 128 KiB READ in flight per reader; with
/// 4 MiB, several of up to 1 MiB each, and a cold sequential read of
/// arbor's own cache went about 1.4× as fast (ARCHITECTURE.md, "FUSE
/// transports").
///
/// Without the right to write it, the mount keeps the kernel's 128 KiB and
/// says so in its log. Called after INIT, whose answer would cap it again,
/// and before the mount answers anything else.
fn set_kernel_read_ahead(mountpoint: &Path, bytes: u32) -> Option<u32> {
    let dev = mount_device(mountpoint)?;
    let knob = format!("/sys/class/bdi/{dev}/read_ahead_kb");
    // No more than arbor's own largest window.
    let kib = bytes.min(KERNEL_READ_AHEAD_MAX).div_ceil(1024);
    match std::fs::write(&knob, format!("{kib}\n")) {
        Ok(()) => {}
        Err(e) => tracing::info!(knob, error = %e, "cannot set the kernel's read-ahead; it stays at its default"),
    }
    kernel_read_ahead(mountpoint)
}

/// The kernel's read-ahead for the mount at `mountpoint`, in bytes.
fn kernel_read_ahead(mountpoint: &Path) -> Option<u32> {
    let dev = mount_device(mountpoint)?;
    let now = std::fs::read_to_string(format!("/sys/class/bdi/{dev}/read_ahead_kb")).ok()?;
    now.trim().parse::<u32>().ok().map(|k| k.saturating_mul(1024))
}

/// The most read-ahead a mount asks of the kernel, whatever `--read-ahead` says.
const KERNEL_READ_AHEAD_MAX: u32 = 64 << 20;

/// `MAJ:MIN` of the file system mounted at `path` (the topmost mount there),
/// from /proc/self/mountinfo, without a request to that file system.
fn mount_device(path: &Path) -> Option<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let target = mount_path(path);
    info.lines().rev().find_map(|l| {
        let fields: Vec<&str> = l.split(' ').collect();
        (fields.len() > 4 && Path::new(&unescape(fields[4])) == target).then(|| fields[2].to_string())
    })
}

/// If `mountpoint` is a FUSE mount whose server died, detach it so it can
/// be mounted again.
///
/// A server killed a moment ago may still be torn down by the kernel (the
/// last reference to its /dev/fuse file, or its FUSE ring, goes away after
/// the process is reaped), and requests then fail for a short while with
/// other errors than ENOTCONN. So a mount point that fails a `statfs` is
/// probed again for up to [`STALE_PROBE`] before the error is reported.
pub fn recover_stale_mount(mountpoint: &Path) -> io::Result<()> {
    let deadline = std::time::Instant::now() + STALE_PROBE;
    loop {
        match probe(mountpoint) {
            Probe::Answers => return Ok(()),
            Probe::Gone => {
                tracing::warn!(mountpoint = %mountpoint.display(), "detaching a stale mount left by a killed process");
                return detach(mountpoint);
            }
            // Not a mount point: whatever is wrong is the caller's to report.
            Probe::Failed(_) if !is_mountpoint(mountpoint) => return Ok(()),
            Probe::Failed(e) if std::time::Instant::now() >= deadline => {
                return Err(io::Error::new(e.kind(), format!("mountpoint {}: {e}", mountpoint.display())));
            }
            Probe::Failed(e) => {
                tracing::debug!(error = %e, "the mount point does not answer yet; probing again");
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
    }
}

/// How long [`recover_stale_mount`] waits for a failing mount point to
/// settle into answering or being gone.
pub const STALE_PROBE: std::time::Duration = std::time::Duration::from_secs(5);

enum Probe {
    Answers,
    Gone,
    Failed(io::Error),
}

/// `statfs` always reaches the server (a `stat` may be answered from the
/// kernel's attribute cache even after the server died).
fn probe(mountpoint: &Path) -> Probe {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(mountpoint.as_os_str().as_bytes()) else {
        return Probe::Failed(io::Error::from_raw_os_error(libc::EINVAL));
    };
    let mut buf = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: a valid path and a buffer statfs fills.
    if unsafe { libc::statfs(c.as_ptr(), buf.as_mut_ptr()) } == 0 {
        return Probe::Answers;
    }
    let e = io::Error::last_os_error();
    // ECONNABORTED: the request was in flight when the kernel aborted the
    // connection (or a FUSE ring is still being torn down).
    match e.raw_os_error() {
        Some(libc::ENOTCONN) | Some(libc::ECONNABORTED) => Probe::Gone,
        _ => Probe::Failed(e),
    }
}

/// Whether `path` is the mount point of a mount in this namespace.
pub fn is_mountpoint(path: &Path) -> bool {
    mount_device(path).is_some()
}

/// The path the kernel knows mount point `path` by (as in
/// /proc/self/mountinfo): absolute, with symbolic links resolved. The
/// mount point is not resolved as a whole, which would ask the file system
/// mounted there (it may be dead, or not answering yet): its parent is,
/// and its last part only if that is a symbolic link itself (`readlink`
/// of a mounted directory fails without a request to the mount).
pub fn mount_path(path: &Path) -> std::path::PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    if std::fs::read_link(&absolute).is_ok() {
        if let Ok(real) = absolute.canonicalize() {
            return real;
        }
    }
    match (absolute.parent().map(Path::canonicalize), absolute.file_name()) {
        (Some(Ok(parent)), Some(name)) => parent.join(name),
        _ => absolute,
    }
}

/// /proc/self/mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> String {
    s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
}

fn detach(mountpoint: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(mountpoint.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
        return Ok(());
    }
    // Not root: ask fusermount3, which may unmount the user's own mounts.
    let status = std::process::Command::new("fusermount3").arg("-u").arg("-z").arg(mountpoint).status()?;
    if status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!("could not detach the stale mount at {}", mountpoint.display())))
    }
}
