//! FUSE over io_uring: the kernel hands each request to a ring entry of the
//! queue of the CPU that made it, and takes the answer back with the next
//! fetch in one `io_uring_enter`, instead of a `read` and a `write` on
//! `/dev/fuse` and a wake-up of a thread on another CPU per request.
//!
//! fuser still mounts, negotiates INIT and runs its classic loop beside the
//! ring: the kernel keeps sending FORGET and INTERRUPT there, and serves
//! every request there until each CPU's queue has an entry. Once the ring
//! is ready, every other request arrives here, is decoded from the entry's
//! header and payload, answered by the same [`ArborFs`] methods the classic
//! loop calls, and encoded back into the same buffers.
//!
//! Each CPU gets a queue; each queue gets a few threads, each with its own
//! io_uring and one entry, so a slow request (a cold read from the bucket,
//! a lock wait) holds only its own thread. The threads are not pinned to
//! their queue's CPU: on this 2-vCPU machine kind, pinned threads answered
//! an unpinned program's round trips in 28–41 µs (the program bounces
//! between CPUs and each answer wakes it on the other one), unpinned ones
//! in 8–12 µs against 17–22 µs for the classic loop; only a program pinned
//! to one CPU did better with pinned threads (5.8 µs). Spinning on the
//! completion queue after an answer instead of sleeping was slower still.

use crate::adapter::{time_set, ArborFs, Entry, Xattr};
use arbor_engine::files::{Caller, Files, Lock};
use arbor_engine::metrics::Counter;
use arbor_engine::volume::{DirEntryOut, SetAttr};
use fuser::{Errno, FileAttr, FileType, InitFlags, KernelConfig, TimeOrNow};
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// The largest write the kernel may send (and so the largest payload).
pub const MAX_WRITE: u32 = 1 << 20;

/// Which transport a mount should use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RingChoice {
    /// The ring where the kernel offers it, the classic loop otherwise.
    #[default]
    Auto,
    /// The classic `/dev/fuse` loop only.
    Classic,
    /// The ring, or the mount fails.
    Ring,
}

impl std::str::FromStr for RingChoice {
    type Err = String;
    /// `ring` (or `io_uring`), `classic` or `auto` (or empty).
    fn from_str(s: &str) -> Result<RingChoice, String> {
        match s {
            "" | "auto" => Ok(RingChoice::Auto),
            "classic" => Ok(RingChoice::Classic),
            "ring" | "io_uring" => Ok(RingChoice::Ring),
            other => Err(format!("expected ring, classic or auto (got {other:?})")),
        }
    }
}

/// The module parameter that lets FUSE connections use io_uring.
const ENABLE_PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// Whether this kernel lets FUSE use io_uring now.
pub fn kernel_allows_ring() -> bool {
    std::fs::read_to_string(ENABLE_PARAM).is_ok_and(|s| s.trim() == "Y" || s.trim() == "1")
}

/// What a mount negotiated and runs, shared by fuser's INIT callback, the
/// ring's threads and `arbor status`.
#[derive(Default)]
pub struct Transport {
    choice: RingChoice,
    negotiated: AtomicBool,
    running: AtomicBool,
    stop: Arc<AtomicBool>,
    requests: Arc<Counter>,
    threads: parking_lot::Mutex<Vec<JoinHandle<()>>>,
    why_classic: parking_lot::Mutex<Option<String>>,
}

impl Transport {
    pub fn new(choice: RingChoice) -> Self {
        Transport { choice, ..Default::default() }
    }

    /// At INIT: ask for the ring if wanted and offered.
    pub(crate) fn negotiate(&self, config: &mut KernelConfig) {
        if self.choice == RingChoice::Classic {
            self.classic_because("the classic transport was asked for");
            return;
        }
        match config.add_capabilities(InitFlags::FUSE_OVER_IO_URING) {
            Ok(()) => self.negotiated.store(true, Ordering::SeqCst),
            Err(_) if kernel_allows_ring() => self.classic_because("the kernel does not offer FUSE over io_uring"),
            Err(_) => self.classic_because("fuse.enable_uring is off"),
        }
    }

    pub(crate) fn classic_because(&self, why: &str) {
        *self.why_classic.lock() = Some(why.to_string());
    }

    pub(crate) fn negotiated(&self) -> bool {
        self.negotiated.load(Ordering::SeqCst)
    }

    /// Whether requests travel on the ring.
    pub fn is_ring(&self) -> bool {
        self.running.load(Ordering::SeqCst)
    }

    /// "io_uring", or "classic" with the reason.
    pub fn describe(&self) -> String {
        if self.is_ring() {
            let n = self.threads.lock().len();
            return format!("io_uring ({} queues, {n} threads)", queue_count());
        }
        match &*self.why_classic.lock() {
            Some(why) => format!("classic /dev/fuse ({why})"),
            None => "classic /dev/fuse".to_string(),
        }
    }

    /// Requests answered on the ring so far.
    pub fn ring_requests(&self) -> u64 {
        self.requests.get()
    }

    /// Stops and joins the ring's threads (after the kernel ended the
    /// connection, or to give up on a ring that did not start).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.lock().drain(..) {
            let _ = t.join();
        }
        self.running.store(false, Ordering::SeqCst);
    }

    /// Starts one queue per possible CPU on `dev` (the session's
    /// `/dev/fuse`), each registered before this returns. An error leaves
    /// the classic loop serving everything.
    pub(crate) fn start<F: Files + ?Sized>(
        &self,
        fs: &Arc<ArborFs<F>>,
        dev: OwnedFd,
        threads: usize,
    ) -> io::Result<()> {
        let dev = Arc::new(dev);
        let queues = queue_count();
        let per_queue = threads.div_ceil(queues).max(2);
        let payload = payload_size(fs.read_ahead());
        let (tx, rx) = std::sync::mpsc::channel::<io::Result<()>>();
        for qid in 0..queues {
            for t in 0..per_queue {
                let worker = Worker {
                    fs: fs.clone(),
                    dev: dev.clone(),
                    qid: qid as u16,
                    stop: self.stop.clone(),
                    requests: self.requests.clone(),
                };
                let tx = tx.clone();
                let handle = std::thread::Builder::new()
                    .name(format!("arbor-ring-{qid}.{t}"))
                    .spawn(move || worker.run(payload, tx))?;
                self.threads.lock().push(handle);
            }
        }
        drop(tx);
        for _ in 0..queues * per_queue {
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    self.stop();
                    self.classic_because(&format!("registering the ring failed: {e}"));
                    return Err(e);
                }
                Err(_) => {
                    self.stop();
                    self.classic_because("a ring thread did not start");
                    return Err(io::Error::other("a ring thread did not start"));
                }
            }
        }
        self.running.store(true, Ordering::SeqCst);
        Ok(())
    }
}

/// The kernel makes one queue per possible CPU and routes a request to the
/// queue of the CPU its caller runs on.
fn queue_count() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| cpu_list_max(s.trim()))
        .map(|max| max + 1)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The highest CPU in a list such as `0-3,8`.
fn cpu_list_max(s: &str) -> Option<usize> {
    s.split(',').filter_map(|part| part.rsplit('-').next()?.trim().parse().ok()).max()
}

/// The kernel refuses an entry whose payload buffer is smaller than the
/// largest request or answer it may carry: max(8 KiB, max_write,
/// max_pages pages), where fuser asks for pages enough for the larger of
/// max_write and the read-ahead and the kernel caps them.
fn payload_size(read_ahead: u32) -> usize {
    let page = 4096usize;
    let limit = std::fs::read_to_string("/proc/sys/fs/fuse/max_pages_limit")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .unwrap_or(256);
    let pages = (MAX_WRITE.max(read_ahead) as usize).div_ceil(page).min(limit);
    (MAX_WRITE as usize).max(pages * page).max(8192)
}

// ---- The kernel's ABI (include/uapi/linux/fuse.h), native endian. ----

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// `struct fuse_uring_req_header`: the in/out header, the op's own header,
/// then the entry's bookkeeping.
const HEADER_IN_OUT: usize = 0;
const HEADER_OP: usize = 128;
const HEADER_ENT: usize = 256;
const HEADER_SIZE: usize = 288;

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
pub(crate) struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
    pub total_extlen: u16,
    pub padding: u16,
}

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct OutHeader {
    len: u32,
    error: i32,
    unique: u64,
}

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
pub(crate) struct EntInOut {
    pub flags: u64,
    pub commit_id: u64,
    pub payload_sz: u32,
    pub padding: u32,
    pub reserved: u64,
}

/// `struct fuse_uring_cmd_req`, in the SQE's 80-byte command area.
#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct CmdReq {
    flags: u64,
    commit_id: u64,
    qid: u16,
    padding: [u8; 6],
}

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct AttrOut {
    ino: u64,
    size: u64,
    blocks: u64,
    atime: u64,
    mtime: u64,
    ctime: u64,
    atimensec: u32,
    mtimensec: u32,
    ctimensec: u32,
    mode: u32,
    nlink: u32,
    uid: u32,
    gid: u32,
    rdev: u32,
    blksize: u32,
    flags: u32,
}

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct EntryOut {
    nodeid: u64,
    generation: u64,
    entry_valid: u64,
    attr_valid: u64,
    entry_valid_nsec: u32,
    attr_valid_nsec: u32,
    attr: AttrOut,
}

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct AttrReply {
    attr_valid: u64,
    attr_valid_nsec: u32,
    dummy: u32,
    attr: AttrOut,
}

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct OpenOut {
    fh: u64,
    open_flags: u32,
    backing_id: i32,
}

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct WriteOut {
    size: u32,
    padding: u32,
}

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct StatfsOut {
    blocks: u64,
    bfree: u64,
    bavail: u64,
    files: u64,
    ffree: u64,
    bsize: u32,
    namelen: u32,
    frsize: u32,
    padding: u32,
    spare: [u32; 6],
}

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct FileLock {
    start: u64,
    end: u64,
    typ: u32,
    pid: u32,
}

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct LkIn {
    fh: u64,
    owner: u64,
    lk: FileLock,
    lk_flags: u32,
    padding: u32,
}

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct SetattrIn {
    valid: u32,
    padding: u32,
    fh: u64,
    size: u64,
    lock_owner: u64,
    atime: u64,
    mtime: u64,
    ctime: u64,
    atimensec: u32,
    mtimensec: u32,
    ctimensec: u32,
    mode: u32,
    unused4: u32,
    uid: u32,
    gid: u32,
    unused5: u32,
}

/// `fuse_read_in` and `fuse_write_in` share a layout.
#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
pub(crate) struct IoIn {
    pub fh: u64,
    pub offset: u64,
    pub size: u32,
    pub io_flags: u32,
    pub lock_owner: u64,
    pub flags: u32,
    pub padding: u32,
}

/// `fuse_copy_file_range_in`.
#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct CopyFileRangeIn {
    fh_in: u64,
    off_in: u64,
    nodeid_out: u64,
    fh_out: u64,
    off_out: u64,
    len: u64,
    flags: u64,
}

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct ReleaseIn {
    fh: u64,
    flags: u32,
    release_flags: u32,
    lock_owner: u64,
}

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct FlushIn {
    fh: u64,
    unused: u32,
    padding: u32,
    lock_owner: u64,
}

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct FallocateIn {
    fh: u64,
    offset: u64,
    length: u64,
    mode: u32,
    padding: u32,
}

#[derive(FromBytes, IntoBytes, Immutable, KnownLayout, Clone, Copy, Debug, Default)]
#[repr(C)]
struct DirentHead {
    ino: u64,
    off: u64,
    namelen: u32,
    typ: u32,
}

pub(crate) mod op {
    pub const LOOKUP: u32 = 1;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const SETXATTR: u32 = 21;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const REMOVEXATTR: u32 = 24;
    pub const FLUSH: u32 = 25;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const GETLK: u32 = 31;
    pub const SETLK: u32 = 32;
    pub const SETLKW: u32 = 33;
    pub const CREATE: u32 = 35;
    pub const IOCTL: u32 = 39;
    pub const FALLOCATE: u32 = 43;
    pub const READDIRPLUS: u32 = 44;
    pub const RENAME2: u32 = 45;
    pub const COPY_FILE_RANGE: u32 = 47;
}

const FATTR_MODE: u32 = 1 << 0;
const FATTR_UID: u32 = 1 << 1;
const FATTR_GID: u32 = 1 << 2;
const FATTR_SIZE: u32 = 1 << 3;
const FATTR_ATIME: u32 = 1 << 4;
const FATTR_MTIME: u32 = 1 << 5;
const FATTR_ATIME_NOW: u32 = 1 << 7;
const FATTR_MTIME_NOW: u32 = 1 << 8;
const FATTR_KILL_SUIDGID: u32 = 1 << 11;
const RELEASE_FLOCK_UNLOCK: u32 = 1 << 1;
const WRITE_KILL_SUIDGID: u32 = 1 << 2;

// ---- Decoding a request, encoding its answer. ----

/// One request as the ring delivers it: the in header, the op's header,
/// and the payload (names, values, written bytes).
pub(crate) struct Request<'a> {
    pub head: InHeader,
    pub op: &'a [u8],
    pub payload: &'a [u8],
}

/// An answer: an errno, or the bytes that follow the out header.
pub(crate) type Reply = Result<Vec<u8>, Errno>;

fn arg<T: FromBytes>(b: &[u8]) -> Result<T, Errno> {
    T::read_from_prefix(b).map(|(t, _)| t).map_err(|_| Errno::EINVAL)
}

/// The NUL-terminated name at the start of `b`, and what follows it.
fn name(b: &[u8]) -> Result<(&[u8], &[u8]), Errno> {
    let end = b.iter().position(|&c| c == 0).ok_or(Errno::EINVAL)?;
    Ok((&b[..end], &b[end + 1..]))
}

fn split_ttl(d: Duration) -> (u64, u32) {
    (d.as_secs(), d.subsec_nanos())
}

fn split_time(t: SystemTime) -> (u64, u32) {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs(), d.subsec_nanos()),
        Err(e) => {
            // Before 1970: seconds as a two's-complement i64 and a
            // non-negative nanosecond part, as the kernel stores them.
            let d = e.duration();
            let (mut s, mut n) = (-(d.as_secs() as i64), d.subsec_nanos());
            if n > 0 {
                s -= 1;
                n = 1_000_000_000 - n;
            }
            (s as u64, n)
        }
    }
}

fn mode_bits(kind: FileType) -> u32 {
    match kind {
        FileType::NamedPipe => libc::S_IFIFO,
        FileType::CharDevice => libc::S_IFCHR,
        FileType::BlockDevice => libc::S_IFBLK,
        FileType::Directory => libc::S_IFDIR,
        FileType::RegularFile => libc::S_IFREG,
        FileType::Symlink => libc::S_IFLNK,
        FileType::Socket => libc::S_IFSOCK,
    }
}

fn attr_out(a: &FileAttr) -> AttrOut {
    let (atime, atimensec) = split_time(a.atime);
    let (mtime, mtimensec) = split_time(a.mtime);
    let (ctime, ctimensec) = split_time(a.ctime);
    AttrOut {
        ino: a.ino.0,
        size: a.size,
        blocks: a.blocks,
        atime,
        mtime,
        ctime,
        atimensec,
        mtimensec,
        ctimensec,
        mode: mode_bits(a.kind) | u32::from(a.perm),
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: a.blksize,
        flags: a.flags,
    }
}

fn entry_out(e: &Entry) -> EntryOut {
    let (secs, nsecs) = split_ttl(e.ttl);
    EntryOut {
        nodeid: e.attr.ino.0,
        generation: 0,
        entry_valid: secs,
        attr_valid: secs,
        entry_valid_nsec: nsecs,
        attr_valid_nsec: nsecs,
        attr: attr_out(&e.attr),
    }
}

fn entry(r: Result<Entry, Errno>) -> Reply {
    r.map(|e| entry_out(&e).as_bytes().to_vec())
}

fn empty(r: Result<(), Errno>) -> Reply {
    r.map(|()| Vec::new())
}

fn attr(ttl: Duration, r: Result<FileAttr, Errno>) -> Reply {
    let (secs, nsecs) = split_ttl(ttl);
    r.map(|a| AttrReply { attr_valid: secs, attr_valid_nsec: nsecs, dummy: 0, attr: attr_out(&a) }.as_bytes().to_vec())
}

fn opened(fh: u64, r: Result<fuser::FopenFlags, Errno>) -> Reply {
    r.map(|f| OpenOut { fh, open_flags: f.bits(), backing_id: 0 }.as_bytes().to_vec())
}

fn xattr(r: Result<Xattr, Errno>) -> Reply {
    r.map(|x| match x {
        Xattr::Size(n) => WriteOut { size: n, padding: 0 }.as_bytes().to_vec(),
        Xattr::Data(d) => d,
    })
}

fn system_time(secs: u64, nsecs: u32) -> SystemTime {
    let secs = secs as i64;
    if secs >= 0 {
        UNIX_EPOCH + Duration::new(secs as u64, nsecs)
    } else {
        UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs()) + Duration::from_nanos(u64::from(nsecs))
    }
}

fn set_attr(a: &SetattrIn) -> SetAttr {
    let time = |now: u32, set: u32, secs: u64, nsecs: u32| {
        let t = if a.valid & now != 0 {
            Some(TimeOrNow::Now)
        } else if a.valid & set != 0 {
            Some(TimeOrNow::SpecificTime(system_time(secs, nsecs)))
        } else {
            None
        };
        time_set(t)
    };
    SetAttr {
        perm: (a.valid & FATTR_MODE != 0).then_some((a.mode & 0o7777) as u16),
        uid: (a.valid & FATTR_UID != 0).then_some(a.uid),
        gid: (a.valid & FATTR_GID != 0).then_some(a.gid),
        size: (a.valid & FATTR_SIZE != 0).then_some(a.size),
        atime: time(FATTR_ATIME_NOW, FATTR_ATIME, a.atime, a.atimensec),
        mtime: time(FATTR_MTIME_NOW, FATTR_MTIME, a.mtime, a.mtimensec),
    }
}

/// The bytes one READDIR entry takes: its head and name, padded to 8.
fn dirent_size(name: &[u8]) -> usize {
    (std::mem::size_of::<DirentHead>() + name.len()).div_ceil(8) * 8
}

/// The bytes one entry of a READDIRPLUS answer takes.
pub(crate) fn direntplus_size(name: &[u8]) -> usize {
    std::mem::size_of::<EntryOut>() + dirent_size(name)
}

/// Appends one directory entry (head, name, padding) to `buf`.
fn push_dirent(buf: &mut Vec<u8>, e: &DirEntryOut) {
    let end = buf.len() + dirent_size(&e.name);
    let head = DirentHead {
        ino: e.ino,
        off: e.offset,
        namelen: e.name.len() as u32,
        typ: mode_bits(crate::adapter::file_type(e.kind)) >> 12,
    };
    buf.extend_from_slice(head.as_bytes());
    buf.extend_from_slice(&e.name);
    buf.resize(end, 0);
}

/// The directory entries from `offset` that fit in `size` bytes.
fn readdir<F: Files + ?Sized>(fs: &ArborFs<F>, ino: u64, offset: u64, size: usize) -> Reply {
    let mut buf = Vec::with_capacity(size.min(64 << 10));
    fs.readdir(ino, offset, &mut |e| {
        if buf.len() + dirent_size(&e.name) > size {
            return true;
        }
        push_dirent(&mut buf, &e);
        false
    })?;
    Ok(buf)
}

/// The entries from `offset` with their attributes, in `size` bytes.
fn readdirplus<F: Files + ?Sized>(fs: &ArborFs<F>, ino: u64, offset: u64, size: usize) -> Reply {
    let mut buf = Vec::with_capacity(size.min(64 << 10));
    fs.readdirplus(ino, offset, size, direntplus_size, &mut |e, entry| {
        if buf.len() + direntplus_size(&e.name) > size {
            return true;
        }
        buf.extend_from_slice(entry_out(entry).as_bytes());
        push_dirent(&mut buf, e);
        false
    })?;
    Ok(buf)
}

fn lock_of(l: &FileLock) -> Lock {
    Lock { start: l.start, end: l.end, typ: l.typ as i32, pid: l.pid }
}

fn caller(h: &InHeader) -> Caller {
    Caller { uid: h.uid, gid: h.gid }
}

/// Answers one request with the same [`ArborFs`] call the classic loop
/// makes for it.
pub(crate) fn dispatch<F: Files + ?Sized>(fs: &ArborFs<F>, r: &Request) -> Reply {
    let h = &r.head;
    let ino = h.nodeid;
    let p = r.payload;
    arbor_engine::files::serving(h.pid);
    match h.opcode {
        op::LOOKUP => entry(fs.lookup(ino, name(p)?.0)),
        op::GETATTR => attr(fs.attr_ttl(), fs.getattr(ino)),
        op::SETATTR => {
            let a: SetattrIn = arg(r.op)?;
            let kill = a.valid & FATTR_KILL_SUIDGID != 0;
            attr(fs.attr_ttl(), fs.setattr(ino, set_attr(&a), caller(h), kill))
        }
        op::READLINK => fs.readlink(ino),
        op::SYMLINK => {
            let (link, rest) = name(p)?;
            entry(fs.symlink(ino, link, name(rest)?.0, h.uid, h.gid))
        }
        op::MKNOD => {
            let [mode, rdev, umask, _] = arg::<[u32; 4]>(r.op)?;
            entry(fs.mknod(ino, name(p)?.0, mode, umask, rdev, h.uid, h.gid))
        }
        op::MKDIR => {
            let [mode, umask] = arg::<[u32; 2]>(r.op)?;
            entry(fs.mkdir(ino, name(p)?.0, mode, umask, h.uid, h.gid))
        }
        op::UNLINK => empty(fs.unlink(ino, name(p)?.0)),
        op::RMDIR => empty(fs.rmdir(ino, name(p)?.0)),
        op::RENAME | op::RENAME2 => {
            let newdir = arg::<u64>(r.op)?;
            let flags = if h.opcode == op::RENAME2 { arg::<[u32; 4]>(r.op)?[2] } else { 0 };
            let (from, rest) = name(p)?;
            empty(fs.rename(ino, from, newdir, name(rest)?.0, flags))
        }
        op::LINK => entry(fs.link(arg::<u64>(r.op)?, ino, name(p)?.0)),
        op::OPEN => opened(fs.new_handle(), fs.open(ino, arg::<[u32; 2]>(r.op)?[0] as i32)),
        op::OPENDIR => opened(0, fs.opendir(ino)),
        op::WRITE => {
            let a: IoIn = arg(r.op)?;
            let data = p.get(..a.size as usize).ok_or(Errno::EINVAL)?;
            let kill = a.io_flags & WRITE_KILL_SUIDGID != 0;
            let append = a.flags & libc::O_APPEND as u32 != 0;
            fs.write(ino, a.offset, data, kill, append).map(|n| WriteOut { size: n, padding: 0 }.as_bytes().to_vec())
        }
        op::COPY_FILE_RANGE => {
            let a: CopyFileRangeIn = arg(r.op)?;
            fs.copy_file_range(ino, a.off_in, a.nodeid_out, a.off_out, a.len)
                .map(|n| WriteOut { size: n, padding: 0 }.as_bytes().to_vec())
        }
        op::STATFS => fs.statfs().map(|s| {
            let out = StatfsOut {
                blocks: s.blocks,
                bfree: s.bfree,
                bavail: s.bavail,
                files: s.files,
                ffree: s.ffree,
                bsize: s.bsize,
                namelen: s.namelen,
                frsize: s.bsize,
                ..Default::default()
            };
            out.as_bytes().to_vec()
        }),
        op::RELEASE => {
            let a: ReleaseIn = arg(r.op)?;
            let owner = (a.release_flags & RELEASE_FLOCK_UNLOCK != 0).then_some(a.lock_owner);
            empty(fs.release(ino, a.fh, a.flags as i32, owner))
        }
        op::RELEASEDIR => Ok(Vec::new()),
        op::FSYNC | op::FSYNCDIR => empty(fs.fsync(ino)),
        op::SETXATTR => {
            let [size, flags] = arg::<[u32; 2]>(r.op)?;
            let (n, rest) = name(p)?;
            let value = rest.get(..size as usize).ok_or(Errno::EINVAL)?;
            empty(fs.setxattr(ino, n, value, flags as i32))
        }
        op::GETXATTR => {
            let [size, _] = arg::<[u32; 2]>(r.op)?;
            xattr(fs.getxattr(ino, name(p)?.0, size))
        }
        op::LISTXATTR => {
            let [size, _] = arg::<[u32; 2]>(r.op)?;
            xattr(fs.listxattr(ino, size))
        }
        op::REMOVEXATTR => empty(fs.removexattr(ino, name(p)?.0)),
        op::FLUSH => empty(fs.flush(ino, arg::<FlushIn>(r.op)?.lock_owner)),
        op::READDIR => {
            let a: IoIn = arg(r.op)?;
            readdir(fs, ino, a.offset, a.size as usize)
        }
        op::READDIRPLUS => {
            let a: IoIn = arg(r.op)?;
            readdirplus(fs, ino, a.offset, a.size as usize)
        }
        op::GETLK => {
            let a: LkIn = arg(r.op)?;
            let l = fs.getlk(ino, a.owner, lock_of(&a.lk))?;
            let out = FileLock { start: l.start, end: l.end, typ: l.typ as u32, pid: l.pid };
            Ok(out.as_bytes().to_vec())
        }
        op::SETLK | op::SETLKW => {
            let a: LkIn = arg(r.op)?;
            empty(fs.setlk(ino, a.fh, a.owner, lock_of(&a.lk), h.opcode == op::SETLKW))
        }
        op::CREATE => {
            let [open, mode, umask, _] = arg::<[u32; 4]>(r.op)?;
            let (e, flags) = fs.create(ino, name(p)?.0, mode, umask, open as i32, h.uid, h.gid)?;
            let mut out = entry_out(&e).as_bytes().to_vec();
            out.extend_from_slice(OpenOut { fh: fs.new_handle(), open_flags: flags.bits(), backing_id: 0 }.as_bytes());
            Ok(out)
        }
        op::IOCTL => empty(fs.ioctl()),
        op::FALLOCATE => {
            let a: FallocateIn = arg(r.op)?;
            empty(fs.fallocate(ino, a.offset, a.length, a.mode as i32, caller(h)))
        }
        _ => Err(Errno::ENOSYS),
    }
}

/// Whether a resent CREATE that finds its name already there must be
/// refused (EIO) rather than answered as done: with `O_EXCL` on files
/// other nodes change too, the name may be another node's, made while
/// this request was in flight, and two callers would each believe they
/// made it (a lock file taken twice). Nothing tells the two apart.
fn resent_exclusive_create_is_ambiguous(shared: bool, open_flags: u32) -> bool {
    shared && open_flags as i32 & libc::O_EXCL != 0
}

/// Answers a request the kernel sent again after the process that first
/// read it died (`FUSE_NOTIFY_RESEND`, see `resume.rs`): that process may
/// have applied it before it died. The kernel keeps the directories of a
/// create, link, unlink or rename locked from the first send until the
/// answer, so a name already there (or already gone) is this request's
/// own doing, and it is answered as done — but for an exclusive create on
/// a shared tree, which no node-local lock covers (EIO). Other requests
/// are applied again (a write of the same bytes at the same place changes
/// nothing).
pub(crate) fn dispatch_resent<F: Files + ?Sized>(fs: &ArborFs<F>, r: &Request) -> Reply {
    let (h, p) = (&r.head, r.payload);
    // An exchange the dead process may have applied would swap the names
    // back if applied again, and nothing tells the two apart: refused.
    if h.opcode == op::RENAME2 && arg::<[u32; 4]>(r.op)?[2] & libc::RENAME_EXCHANGE != 0 {
        return Err(Errno::EIO);
    }
    let first = dispatch(fs, r);
    let found = |parent: u64, n: &[u8]| -> Result<Entry, Errno> {
        match fs.lookup(parent, n)? {
            e if e.attr.ino.0 == 0 => Err(Errno::ENOENT),
            e => Ok(e),
        }
    };
    match (h.opcode, first) {
        (op::CREATE, Err(e)) if e == Errno::EEXIST => {
            let [open, ..] = arg::<[u32; 4]>(r.op)?;
            if resent_exclusive_create_is_ambiguous(fs.is_shared(), open) {
                return Err(Errno::EIO);
            }
            let e = found(h.nodeid, name(p)?.0).map_err(|_| Errno::EEXIST)?;
            let flags = fs.open(e.attr.ino.0, open as i32)?;
            let mut out = entry_out(&e).as_bytes().to_vec();
            out.extend_from_slice(OpenOut { fh: fs.new_handle(), open_flags: flags.bits(), backing_id: 0 }.as_bytes());
            Ok(out)
        }
        (op::MKDIR | op::MKNOD | op::SYMLINK, Err(e)) if e == Errno::EEXIST => {
            entry(found(h.nodeid, name(p)?.0).map_err(|_| Errno::EEXIST))
        }
        (op::LINK, Err(e)) if e == Errno::EEXIST => entry(found(h.nodeid, name(p)?.0).map_err(|_| Errno::EEXIST)),
        (op::UNLINK | op::RMDIR, Err(e)) if e == Errno::ENOENT => Ok(Vec::new()),
        (op::RENAME | op::RENAME2, Err(e)) if e == Errno::ENOENT => {
            let newdir = arg::<u64>(r.op)?;
            let (_, rest) = name(p)?;
            found(newdir, name(rest)?.0).map(|_| Vec::new()).map_err(|_| Errno::ENOENT)
        }
        (_, answer) => answer,
    }
}

/// Decodes the request in `header` and `payload`, answers it, writes the
/// answer back into both, and returns the commit id to send with it.
pub(crate) fn answer_entry<F: Files + ?Sized>(fs: &ArborFs<F>, header: &mut [u8], payload: &mut [u8]) -> u64 {
    let head = InHeader::read_from_prefix(&header[HEADER_IN_OUT..]).map(|(h, _)| h).unwrap_or_default();
    let ent = EntInOut::read_from_prefix(&header[HEADER_ENT..]).map(|(e, _)| e).unwrap_or_default();
    let len = (ent.payload_sz as usize).min(payload.len());
    let op_in = &header[HEADER_OP..HEADER_ENT];
    let answered = if head.total_extlen != 0 {
        // Extensions (security contexts, supplementary groups) are never
        // negotiated; a request carrying them is not one we understand.
        Err(Errno::EINVAL)
    } else if head.opcode == op::READ {
        // Read straight into the buffer the kernel copies the answer from
        // (a READ carries no payload).
        arg::<IoIn>(op_in).and_then(|a| {
            let want = (a.size as usize).min(payload.len());
            fs.read(head.nodeid, a.offset, &mut payload[..want])
        })
    } else {
        let req = Request { head, op: op_in, payload: &payload[..len] };
        dispatch(fs, &req).and_then(|body| match payload.get_mut(..body.len()) {
            Some(dst) => {
                dst.copy_from_slice(&body);
                Ok(body.len())
            }
            None => {
                tracing::error!(
                    opcode = head.opcode,
                    len = body.len(),
                    "an answer larger than the ring's payload buffer"
                );
                Err(Errno::EIO)
            }
        })
    };
    let (error, n) = match answered {
        Ok(n) => (0, n),
        Err(e) => (-i32::from(e), 0),
    };
    let out = OutHeader { len: (std::mem::size_of::<OutHeader>() + n) as u32, error, unique: head.unique };
    header[HEADER_IN_OUT..HEADER_IN_OUT + 16].copy_from_slice(out.as_bytes());
    let ent_out = EntInOut { payload_sz: n as u32, ..ent };
    header[HEADER_ENT..HEADER_SIZE].copy_from_slice(ent_out.as_bytes());
    ent.commit_id
}

// ---- The queues. ----

/// A page-aligned buffer the kernel reads and writes in place.
struct Buffer {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: the buffer is plain memory owned by one thread at a time.
unsafe impl Send for Buffer {}

impl Buffer {
    fn new(len: usize) -> io::Result<Buffer> {
        let layout = std::alloc::Layout::from_size_align(len.max(4096), 4096)
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(io::Error::from_raw_os_error(libc::ENOMEM));
        }
        Ok(Buffer { ptr, layout })
    }

    fn len(&self) -> usize {
        self.layout.size()
    }

    /// SAFETY: the caller must not hold the slice while the kernel owns the
    /// buffer (between a fetch and its completion).
    unsafe fn slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr is a live allocation of len bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len()) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

struct Worker<F: Files + ?Sized> {
    fs: Arc<ArborFs<F>>,
    dev: Arc<OwnedFd>,
    qid: u16,
    stop: Arc<AtomicBool>,
    requests: Arc<Counter>,
}

/// The command area of an SQE for `cmd` on queue `qid`.
fn command(qid: u16, commit_id: u64) -> [u8; 80] {
    let mut area = [0u8; 80];
    let req = CmdReq { flags: 0, commit_id, qid, padding: [0; 6] };
    area[..std::mem::size_of::<CmdReq>()].copy_from_slice(req.as_bytes());
    area
}

/// Sets the `len` field of an SQE, which fuser's REGISTER needs (the count
/// of iovecs at `addr`) and `UringCmd80` has no setter for.
fn with_len(e: squeue::Entry128, len: u32) -> squeue::Entry128 {
    // SAFETY: Entry128 is repr(C), a 64-byte io_uring_sqe followed by 64
    // bytes of command, all initialised; `len` is the u32 at offset 24.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(e) };
    raw[24..28].copy_from_slice(len.as_bytes());
    // SAFETY: any bytes are a valid Entry128.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

fn is_end(errno: i32) -> bool {
    matches!(errno, libc::ENOTCONN | libc::ENODEV | libc::ECONNABORTED | libc::ECANCELED)
}

impl<F: Files + ?Sized> Worker<F> {
    fn run(self, payload_len: usize, started: std::sync::mpsc::Sender<io::Result<()>>) {
        let mut state = match self.register(payload_len) {
            Ok(s) => {
                let _ = started.send(Ok(()));
                s
            }
            Err(e) => {
                let _ = started.send(Err(e));
                return;
            }
        };
        if let Err(e) = self.serve(&mut state) {
            tracing::error!(qid = self.qid, error = %e, "a FUSE ring queue stopped");
        }
    }

    /// Sets up this thread's ring and registers its one entry.
    fn register(&self, payload_len: usize) -> io::Result<State> {
        let ring: IoUring<squeue::Entry128, cqueue::Entry> = IoUring::builder().build(4)?;
        let mut header = Buffer::new(4096)?;
        let mut payload = Buffer::new(payload_len)?;
        let iov = Box::new([
            // SAFETY: only the address is taken.
            libc::iovec { iov_base: unsafe { header.slice() }.as_mut_ptr().cast(), iov_len: header.len() },
            libc::iovec { iov_base: unsafe { payload.slice() }.as_mut_ptr().cast(), iov_len: payload.len() },
        ]);
        let mut state = State { ring, header, payload, iov, early: None };
        state.push(self.register_sqe(&state))?;
        state.ring.submit()?;
        // A refused registration completes at once with its errno; a
        // registered entry completes only when a request arrives.
        let ts = types::Timespec::new().nsec(20_000_000);
        match state.ring.submitter().submit_with_args(1, &types::SubmitArgs::new().timespec(&ts)) {
            Ok(_) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME) | Some(libc::EINTR)) => {}
            Err(e) => return Err(e),
        }
        if let Some(cqe) = state.ring.completion().next() {
            // The connection may already be over (unmounted while
            // mounting): then the thread just ends, as it would later.
            if cqe.result() < 0 && !is_end(-cqe.result()) {
                return Err(io::Error::from_raw_os_error(-cqe.result()));
            }
            state.early = Some(cqe.result());
        }
        Ok(state)
    }

    /// Registers the entry's two buffers and waits for a request.
    fn register_sqe(&self, s: &State) -> squeue::Entry128 {
        let sqe = opcode::UringCmd80::new(types::Fd(self.dev.as_raw_fd()), CMD_REGISTER)
            .cmd(command(self.qid, 0))
            .addr(Some(s.iov.as_ptr() as u64))
            .build();
        with_len(sqe, 2)
    }

    fn serve(&self, s: &mut State) -> io::Result<()> {
        let ts = types::Timespec::new().sec(1);
        let mut pending = s.early.take();
        loop {
            if let Some(res) = pending.take() {
                if res < 0 {
                    match -res {
                        libc::EINTR | libc::EAGAIN => {
                            // Fetch again: the entry was never handed over.
                            s.push(self.register_sqe(s))?;
                        }
                        e if is_end(e) => return Ok(()),
                        e => return Err(io::Error::from_raw_os_error(e)),
                    }
                } else {
                    // SAFETY: the kernel handed the entry over with this
                    // completion and takes it back with the commit below.
                    let (header, payload) = unsafe { (s.header.slice(), s.payload.slice()) };
                    let commit_id = answer_entry(&self.fs, header, payload);
                    self.requests.inc();
                    let sqe = opcode::UringCmd80::new(types::Fd(self.dev.as_raw_fd()), CMD_COMMIT_AND_FETCH)
                        .cmd(command(self.qid, commit_id))
                        .build();
                    s.push(sqe)?;
                }
            }
            if self.stop.load(Ordering::SeqCst) {
                return Ok(());
            }
            match s.ring.submitter().submit_with_args(1, &types::SubmitArgs::new().timespec(&ts)) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME) | Some(libc::EINTR)) => {}
                Err(e) if e.raw_os_error().is_some_and(is_end) => return Ok(()),
                Err(e) => return Err(e),
            }
            pending = s.ring.completion().next().map(|c| c.result());
        }
    }
}

/// One thread's ring and its entry's buffers; the iovecs stay put for as
/// long as the entry is registered.
struct State {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    header: Buffer,
    payload: Buffer,
    iov: Box<[libc::iovec; 2]>,
    early: Option<i32>,
}

impl State {
    fn push(&mut self, sqe: squeue::Entry128) -> io::Result<()> {
        // SAFETY: the buffers and iovecs the entry points at live in self,
        // which outlives the ring's use of them (the ring is dropped first).
        unsafe { self.ring.submission().push(&sqe) }
            .map_err(|_| io::Error::other("the ring's submission queue is full"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_give_their_highest_cpu() {
        assert_eq!(cpu_list_max("0-1"), Some(1));
        assert_eq!(cpu_list_max("0"), Some(0));
        assert_eq!(cpu_list_max("0-3,8,10-11"), Some(11));
        assert_eq!(cpu_list_max(""), None);
    }

    #[test]
    fn abi_structs_have_the_kernels_sizes() {
        assert_eq!(std::mem::size_of::<InHeader>(), 40);
        assert_eq!(std::mem::size_of::<OutHeader>(), 16);
        assert_eq!(std::mem::size_of::<EntInOut>(), 32);
        assert_eq!(HEADER_ENT + std::mem::size_of::<EntInOut>(), HEADER_SIZE);
        assert_eq!(std::mem::size_of::<CmdReq>(), 24);
        assert_eq!(std::mem::size_of::<AttrOut>(), 88);
        assert_eq!(std::mem::size_of::<EntryOut>(), 128);
        assert_eq!(std::mem::size_of::<AttrReply>(), 104);
        assert_eq!(std::mem::size_of::<StatfsOut>(), 80);
        assert_eq!(std::mem::size_of::<SetattrIn>(), 88);
        assert_eq!(std::mem::size_of::<IoIn>(), 40);
        assert_eq!(std::mem::size_of::<LkIn>(), 48);
    }

    #[test]
    fn times_before_1970_keep_a_positive_nanosecond_part() {
        let t = UNIX_EPOCH - Duration::from_millis(1500);
        let (s, n) = split_time(t);
        assert_eq!((s as i64, n), (-2, 500_000_000));
        assert_eq!(system_time(s, n), t);
        assert_eq!(split_time(UNIX_EPOCH + Duration::new(7, 9)), (7, 9));
    }

    use arbor_engine::device::SimDevice;
    use arbor_engine::env::TestEnv;
    use arbor_engine::volume::{Config, Volume, ROOT_INO};

    fn arbor() -> ArborFs<Volume> {
        let cfg = Config { commit_interval: None, env: TestEnv::new(1), ..Config::default() };
        let vol = Volume::open(Arc::new(SimDevice::new()), cfg).expect("volume");
        ArborFs::new(vol, 1 << 20, true)
    }

    /// Puts one request into an entry's buffers the way the kernel does,
    /// answers it, and returns the errno and the answer's bytes.
    fn call(fs: &ArborFs<Volume>, opcode: u32, nodeid: u64, op_in: &[u8], payload: &[u8]) -> (i32, Vec<u8>) {
        let mut header = vec![0u8; 4096];
        let head = InHeader { len: 0, opcode, unique: 77, nodeid, uid: 1000, gid: 1000, pid: 1, ..Default::default() };
        header[..40].copy_from_slice(head.as_bytes());
        header[HEADER_OP..HEADER_OP + op_in.len()].copy_from_slice(op_in);
        let ent = EntInOut { commit_id: 99, payload_sz: payload.len() as u32, ..Default::default() };
        header[HEADER_ENT..HEADER_SIZE].copy_from_slice(ent.as_bytes());
        // Junk where the answer goes: an answer must write every byte it sends.
        let mut buf = vec![0xeeu8; 1 << 20];
        buf[..payload.len()].copy_from_slice(payload);
        assert_eq!(answer_entry(fs, &mut header, &mut buf), 99, "the commit id goes back as it came");
        let (out, _) = OutHeader::read_from_prefix(&header[..]).expect("out header");
        assert_eq!(out.unique, 77);
        let (ent, _) = EntInOut::read_from_prefix(&header[HEADER_ENT..]).expect("entry");
        assert!(out.error == 0 || ent.payload_sz == 0, "an error carries no payload");
        assert_eq!(out.len as usize, 16 + ent.payload_sz as usize);
        (-out.error, buf[..ent.payload_sz as usize].to_vec())
    }

    fn nodeid(entry: &[u8]) -> u64 {
        EntryOut::read_from_prefix(entry).expect("entry_out").0.nodeid
    }

    fn words(w: &[u32]) -> Vec<u8> {
        w.iter().flat_map(|x| x.as_bytes().to_vec()).collect()
    }

    #[test]
    fn requests_from_the_ring_are_answered_in_the_kernels_layout() {
        let fs = arbor();
        let create = words(&[libc::O_RDWR as u32, libc::S_IFREG | 0o666, 0o022, 0]);
        let (err, out) = call(&fs, op::CREATE, ROOT_INO, &create, b"f\0");
        assert_eq!((err, out.len()), (0, 128 + 16));
        let (e, _) = EntryOut::read_from_prefix(&out[..]).expect("entry_out");
        assert_eq!(e.attr.mode, libc::S_IFREG | 0o644, "the umask applies");
        assert_eq!((e.attr.uid, e.attr.gid), (1000, 1000), "the caller owns what it creates");
        let ino = e.nodeid;

        let write = IoIn { offset: 3, size: 5, ..Default::default() };
        let (err, out) = call(&fs, op::WRITE, ino, write.as_bytes(), b"hello");
        assert_eq!((err, u32::read_from_prefix(&out[..]).ok().map(|(n, _)| n)), (0, Some(5)));
        let read = IoIn { offset: 0, size: 100, ..Default::default() };
        assert_eq!(call(&fs, op::READ, ino, read.as_bytes(), b""), (0, b"\0\0\0hello".to_vec()));

        let (err, out) = call(&fs, op::LOOKUP, ROOT_INO, b"", b"f\0");
        assert_eq!((err, nodeid(&out)), (0, ino));
        let (err, out) = call(&fs, op::LOOKUP, ROOT_INO, b"", b"nope\0");
        assert_eq!((err, nodeid(&out)), (0, 0), "a missing name is a negative entry");

        let (err, out) = call(&fs, op::GETATTR, ino, &[0u8; 16], b"");
        let (a, _) = AttrReply::read_from_prefix(&out[..]).expect("attr_out");
        assert_eq!((err, a.attr.size, a.attr.ino), (0, 8, ino));

        let (err, out) = call(&fs, op::READDIR, ROOT_INO, IoIn { size: 4096, ..Default::default() }.as_bytes(), b"");
        assert_eq!(err, 0);
        let mut names = Vec::new();
        let mut at = 0;
        while at < out.len() {
            let (d, rest) = DirentHead::read_from_prefix(&out[at..]).expect("dirent");
            names.push((rest[..d.namelen as usize].to_vec(), d.typ));
            at += (24 + d.namelen as usize).div_ceil(8) * 8;
        }
        assert_eq!(at, out.len(), "records are padded to 8 bytes");
        assert!(names.contains(&(b"f".to_vec(), libc::DT_REG as u32)), "{names:?}");

        let (err, _) = call(&fs, op::RENAME2, ROOT_INO, &[ROOT_INO.as_bytes(), &words(&[1, 0])].concat(), b"f\0f\0");
        assert_eq!(err, libc::EEXIST, "RENAME_NOREPLACE onto an existing name");
    }

    #[test]
    fn readdirplus_answers_carry_each_entrys_attributes() {
        let fs = arbor();
        let mut inos = Vec::new();
        for (name, len) in [(&b"a\0"[..], 3usize), (b"bb\0", 40)] {
            let (_, out) = call(&fs, op::CREATE, ROOT_INO, &words(&[0, libc::S_IFREG | 0o600, 0, 0]), name);
            let ino = nodeid(&out);
            let write = IoIn { size: len as u32, ..Default::default() };
            assert_eq!(call(&fs, op::WRITE, ino, write.as_bytes(), &vec![1u8; len]).0, 0);
            inos.push((name[..name.len() - 1].to_vec(), ino, len as u64));
        }
        let (err, out) =
            call(&fs, op::READDIRPLUS, ROOT_INO, IoIn { size: 4096, ..Default::default() }.as_bytes(), b"");
        assert_eq!(err, 0);
        let mut found = Vec::new();
        let mut at = 0;
        while at < out.len() {
            let (e, rest) = EntryOut::read_from_prefix(&out[at..]).expect("entry_out");
            let (d, rest) = DirentHead::read_from_prefix(rest).expect("dirent");
            let name = rest[..d.namelen as usize].to_vec();
            assert_eq!(e.attr.ino, d.ino, "{name:?}");
            found.push((name.clone(), e.nodeid, e.attr.size));
            at += direntplus_size(&name);
        }
        assert_eq!(at, out.len());
        for want in &inos {
            assert!(found.contains(want), "{want:?} in {found:?}");
        }
        // A buffer too small for one entry gets none, and no error.
        let small = IoIn { size: 100, ..Default::default() };
        assert_eq!(call(&fs, op::READDIRPLUS, ROOT_INO, small.as_bytes(), b""), (0, Vec::new()));
    }

    #[test]
    fn bad_requests_get_an_errno_and_change_nothing() {
        let fs = arbor();
        assert_eq!(call(&fs, 999, ROOT_INO, b"", b"").0, libc::ENOSYS);
        assert_eq!(call(&fs, op::MKDIR, ROOT_INO, &words(&[0o755, 0]), b"no-nul").0, libc::EINVAL);
        let write = IoIn { size: 100, ..Default::default() };
        assert_eq!(call(&fs, op::WRITE, ROOT_INO, write.as_bytes(), b"short").0, libc::EINVAL);
        let (err, out) = call(&fs, op::LOOKUP, ROOT_INO, b"", b"no-nul\0");
        assert_eq!((err, nodeid(&out)), (0, 0), "nothing was created");

        let (_, out) = call(&fs, op::CREATE, ROOT_INO, &words(&[0, libc::S_IFREG | 0o644, 0, 0]), b"x\0");
        let ino = nodeid(&out);
        assert_eq!(call(&fs, op::GETXATTR, ino, &words(&[0, 0]), b"user.a\0").0, libc::ENODATA);
        assert_eq!(call(&fs, op::SETXATTR, ino, &words(&[2, 0]), b"user.a\0hi").0, 0);
        assert_eq!(call(&fs, op::GETXATTR, ino, &words(&[0, 0]), b"user.a\0"), (0, words(&[2, 0])));
        assert_eq!(call(&fs, op::GETXATTR, ino, &words(&[1, 0]), b"user.a\0").0, libc::ERANGE);
        assert_eq!(call(&fs, op::GETXATTR, ino, &words(&[8, 0]), b"user.a\0"), (0, b"hi".to_vec()));
        assert_eq!(call(&fs, op::SETXATTR, ino, &words(&[9, 0]), b"user.b\0hi").0, libc::EINVAL);
    }

    /// `dispatch_resent` for one request.
    fn resent(fs: &ArborFs<Volume>, opcode: u32, nodeid: u64, op_in: &[u8], payload: &[u8]) -> Reply {
        let head = InHeader { opcode, unique: 1 << 63, nodeid, uid: 1000, gid: 1000, ..Default::default() };
        dispatch_resent(fs, &Request { head, op: op_in, payload })
    }

    #[test]
    fn a_request_sent_again_after_its_first_server_applied_it_is_answered_as_done() {
        let fs = arbor();
        let create = words(&[libc::O_RDWR as u32, libc::S_IFREG | 0o644, 0, 0]);
        let (_, out) = call(&fs, op::CREATE, ROOT_INO, &create, b"f\0");
        let ino = nodeid(&out);
        assert_eq!(call(&fs, op::CREATE, ROOT_INO, &create, b"f\0").0, libc::EEXIST, "a first send");
        let again = resent(&fs, op::CREATE, ROOT_INO, &create, b"f\0").expect("the create, sent again");
        assert_eq!((nodeid(&again), again.len()), (ino, 128 + 16));
        assert_eq!(call(&fs, op::MKDIR, ROOT_INO, &words(&[0o755, 0]), b"d\0").0, 0);
        let dir = resent(&fs, op::MKDIR, ROOT_INO, &words(&[0o755, 0]), b"d\0").expect("mkdir, sent again");
        assert_ne!(nodeid(&dir), 0);
        // Unlinked by the dead process: done.
        assert_eq!(call(&fs, op::UNLINK, ROOT_INO, b"", b"d2\0").0, libc::ENOENT);
        assert_eq!(resent(&fs, op::UNLINK, ROOT_INO, b"", b"d2\0"), Ok(Vec::new()));
        // Renamed: the source is gone and the target there.
        let to_root = ROOT_INO.as_bytes().to_vec();
        assert_eq!(call(&fs, op::RENAME, ROOT_INO, &to_root, b"f\0g\0").0, 0);
        assert_eq!(resent(&fs, op::RENAME, ROOT_INO, &to_root, b"f\0g\0"), Ok(Vec::new()));
        // Neither name: the error stands.
        assert_eq!(resent(&fs, op::RENAME, ROOT_INO, &to_root, b"x\0y\0"), Err(Errno::ENOENT));
        // A link whose name is already there (the dead process made it).
        let link = resent(&fs, op::LINK, ROOT_INO, ino.as_bytes(), b"g\0").expect("link, sent again");
        assert_eq!(nodeid(&link), ino);
    }

    #[test]
    fn an_exclusive_create_sent_again_on_a_shared_tree_is_ambiguous() {
        let excl = (libc::O_RDWR | libc::O_CREAT | libc::O_EXCL) as u32;
        assert!(resent_exclusive_create_is_ambiguous(true, excl));
        assert!(!resent_exclusive_create_is_ambiguous(false, excl), "node-local: the kernel's lock covers it");
        assert!(!resent_exclusive_create_is_ambiguous(true, (libc::O_RDWR | libc::O_CREAT) as u32));
        // On a local tree the exclusive create sent again is answered as done.
        let fs = arbor();
        let create = words(&[excl, libc::S_IFREG | 0o644, 0, 0]);
        let ino = nodeid(&call(&fs, op::CREATE, ROOT_INO, &create, b"lock\0").1);
        let again = resent(&fs, op::CREATE, ROOT_INO, &create, b"lock\0").expect("done");
        assert_eq!(nodeid(&again), ino);
    }

    #[test]
    fn the_sqe_length_lands_where_the_kernel_reads_it() {
        let sqe = opcode::UringCmd80::new(types::Fd(3), CMD_REGISTER).addr(Some(0x1000)).build();
        let raw: [u8; 128] = unsafe { std::mem::transmute(with_len(sqe, 2)) };
        assert_eq!(u32::read_from_bytes(&raw[24..28]).ok(), Some(2));
        assert_eq!(u64::read_from_bytes(&raw[16..24]).ok(), Some(0x1000));
        assert_eq!(raw[0], io_uring::opcode::UringCmd80::CODE);
    }

    #[test]
    fn an_exchange_sent_again_is_refused_and_closes_of_handles_given_elsewhere_do_not_count() {
        let fs = arbor();
        let file = words(&[libc::S_IFREG | 0o644, 0, 0, 0]);
        let a = nodeid(&call(&fs, op::MKNOD, ROOT_INO, &file, b"a\0").1);
        let b = nodeid(&call(&fs, op::MKNOD, ROOT_INO, &file, b"b\0").1);
        let exchange = [ROOT_INO.as_bytes(), &words(&[libc::RENAME_EXCHANGE, 0])].concat();
        assert_eq!(resent(&fs, op::RENAME2, ROOT_INO, &exchange, b"a\0b\0"), Err(Errno::EIO));
        assert_eq!(nodeid(&call(&fs, op::LOOKUP, ROOT_INO, b"", b"a\0").1), a, "the names stayed");
        // A process resuming a connection: this open is its own, the
        // release of handle 5 was a dead process's open.
        fs.skip_handles(7 << 32);
        let (err, _) = call(&fs, op::OPEN, b, &words(&[libc::O_RDWR as u32, 0]), b"");
        assert_eq!(err, 0);
        let write = IoIn { size: 4, ..Default::default() };
        assert_eq!(call(&fs, op::WRITE, b, write.as_bytes(), b"kept").0, 0);
        let foreign = [5u64.as_bytes(), &words(&[0, 0]), 0u64.as_bytes()].concat();
        assert_eq!(call(&fs, op::RELEASE, b, &foreign, b"").0, 0);
        assert_eq!(call(&fs, op::UNLINK, ROOT_INO, b"", b"b\0").0, 0);
        let read = IoIn { size: 100, ..Default::default() };
        assert_eq!(call(&fs, op::READ, b, read.as_bytes(), b""), (0, b"kept".to_vec()), "the open file is gone");
    }
}
