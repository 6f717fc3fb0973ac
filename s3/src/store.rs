//! Objects as files of one root (a branch or a checkpoint), through its
//! [`Files`]: key `a/b/c` is file `a/b/c`, its folders implied; a key
//! ending in `/` is a folder marker (a folder with [`FOLDER_XATTR`]).
//!
//! Every call here blocks (the engine's file operations do); the service
//! runs them off its async threads.
//!
//! A PUT writes a hidden temporary file under [`HIDDEN`] (never listed,
//! never a key), checks it, gives it its ETag, renames it onto the key and
//! then syncs: the log of a branch is one sequence and a crash keeps a
//! prefix of it, so once the sync after the rename returns the object is
//! as durable as an fsync makes a file, and before it a crash leaves the
//! old object or none, never part of the new one under the key.

use arbor_engine::files::Files;
use arbor_engine::volume::{Attr, FileKind, RenameMode, XattrFlags, ROOT_INO};
use arbor_engine::Error as EngineError;
use s3s::crypto::{Checksum, Md5};
use s3s::{s3_error, S3Error, S3ErrorCode, S3Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The folder at a root's top that holds what is not an object yet:
/// `tmp/` (PUTs in progress) and `uploads/` (multipart uploads). It is
/// never listed, and keys under it are refused.
pub const HIDDEN: &[u8] = b".arbor-s3";
/// A file's ETag as it was put: `v1 ETAG SIZE MTIME_S MTIME_NS` (the
/// size and modification time it had then: a file changed since, on a
/// mount, gets a derived ETag instead).
pub const ETAG_XATTR: &[u8] = b"user.arbor.s3.etag";
/// Content-Type, Content-Encoding and the like, and `x-amz-meta-*`, as JSON.
pub const META_XATTR: &[u8] = b"user.arbor.s3.meta";
/// On a folder: the folder marker object (key `a/b/`) exists.
pub const FOLDER_XATTR: &[u8] = b"user.arbor.s3.folder";
/// The MD5 of nothing: a folder marker's ETag.
pub const EMPTY_MD5: &str = "d41d8cd98f00b204e9800998ecf8427e";
/// Bytes one read or write of the engine moves at most.
pub const IO_SIZE: usize = 1 << 20;
const NAME_MAX: usize = 255;

/// A key, checked, as the names of the files on its path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Key {
    pub segs: Vec<Vec<u8>>,
    /// The key ends in `/`: a folder marker.
    pub folder: bool,
}

impl Key {
    pub fn name(&self) -> &[u8] {
        self.segs.last().map_or(&[], |s| s.as_slice())
    }
    pub fn parents(&self) -> &[Vec<u8>] {
        &self.segs[..self.segs.len() - 1]
    }
}

fn bad_key(key: &str, why: &str) -> S3Error {
    S3Error::with_message(S3ErrorCode::InvalidArgument, format!("key {key:?} cannot be a file: {why}"))
}

/// An S3 error with a code of its own and an HTTP status.
pub fn custom(code: &'static str, status: u16, msg: String) -> S3Error {
    let mut e = S3Error::with_message(S3ErrorCode::Custom(code.into()), msg);
    if let Ok(s) = http::StatusCode::from_u16(status) {
        e.set_status_code(s);
    }
    e
}

/// A key in the way of another: `a` and `a/b` cannot both be objects.
pub fn conflict(msg: String) -> S3Error {
    custom("KeyConflict", 409, msg)
}

/// Checks `key` and splits it into file names: no empty segment (`a//b`,
/// a leading `/`), no `.` or `..`, no NUL, segments of at most 255 bytes,
/// nothing under the hidden folder.
pub fn parse_key(key: &str) -> S3Result<Key> {
    if key.is_empty() {
        return Err(bad_key(key, "it is empty"));
    }
    if key.len() > 1024 {
        return Err(S3Error::with_message(S3ErrorCode::KeyTooLongError, "keys are at most 1024 bytes"));
    }
    let (body, folder) = match key.strip_suffix('/') {
        Some(b) => (b, true),
        None => (key, false),
    };
    if body.is_empty() {
        return Err(bad_key(key, "a key of only \"/\" names no folder"));
    }
    let mut segs = Vec::new();
    for s in body.split('/') {
        match s {
            "" => return Err(bad_key(key, "it has an empty segment (a leading \"/\" or \"//\")")),
            "." | ".." => return Err(bad_key(key, "\".\" and \"..\" are not file names")),
            _ if s.contains('\0') => return Err(bad_key(key, "it holds a NUL")),
            _ if s.len() > NAME_MAX => return Err(bad_key(key, "a segment is longer than 255 bytes")),
            _ => segs.push(s.as_bytes().to_vec()),
        }
    }
    if segs[0] == HIDDEN {
        return Err(bad_key(key, "the folder .arbor-s3 holds uploads in progress"));
    }
    Ok(Key { segs, folder })
}

/// An engine error as an S3 error.
pub fn s3_err(e: EngineError, doing: &str) -> S3Error {
    match e.errno() {
        libc::ENOENT => s3_error!(NoSuchKey),
        libc::EROFS => s3_error!(AccessDenied, "a checkpoint's bucket is read-only"),
        libc::ENOSPC => custom("InsufficientStorage", 507, format!("{doing}: the disk is full")),
        libc::EFBIG => s3_error!(EntityTooLarge),
        libc::EACCES | libc::EPERM => S3Error::with_message(S3ErrorCode::AccessDenied, format!("{doing}: {e}")),
        _ => {
            tracing::warn!(error = %e, doing, "S3 request failed");
            S3Error::with_message(S3ErrorCode::InternalError, format!("{doing}: {e}"))
        }
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

pub fn md5_hex(data: &[u8]) -> String {
    let mut m = Md5::new();
    m.update(data);
    hex(&m.finalize())
}

/// A file's modification time.
pub fn mtime(a: &Attr) -> SystemTime {
    let t = a.mtime;
    if t.secs >= 0 {
        UNIX_EPOCH + Duration::new(t.secs as u64, t.nanos)
    } else {
        UNIX_EPOCH
    }
}

/// What an object carries besides its bytes.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Meta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content_encoding: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content_disposition: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content_language: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_control: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<std::collections::HashMap<String, String>>,
}

impl Meta {
    fn is_empty(&self) -> bool {
        *self == Meta::default()
    }
}

/// Folders from the root, each `(parent, name, inode)`.
type Chain = Vec<(u64, Vec<u8>, u64)>;

/// Held around the short steps that change the folders of a bucket:
/// making a key's folders and renaming its file there, marking a folder,
/// deleting a key and pruning the folders it alone kept. Never held while
/// a body is received nor during a sync. Without it a DELETE's pruning
/// could remove a folder a PUT had just made or marked, and two
/// conditional PUTs could both pass their check. One for the process:
/// the steps are short, and all buckets' are in one engine anyway.
static NAMESPACE: parking_lot::Mutex<()> = parking_lot::const_mutex(());

/// What a PUT may find at its key.
#[derive(Clone, Debug)]
pub enum Onto {
    /// Anything (an object is replaced).
    Any,
    /// Nothing (`If-None-Match: *`), else PreconditionFailed.
    Absent,
    /// An object whose ETag matches (`If-Match`), else PreconditionFailed
    /// (NoSuchKey if there is no object).
    Matching(s3s::dto::ETagCondition),
}

fn cond_matches(c: &s3s::dto::ETagCondition, etag: &str) -> bool {
    match c {
        s3s::dto::ETagCondition::Any => true,
        s3s::dto::ETagCondition::ETag(e) => e.value() == etag,
    }
}

/// The root of one bucket.
#[derive(Clone)]
pub struct Tree {
    pub files: Arc<dyn Files>,
}

/// A file's place: the folder it is in, its name, and its attributes.
pub struct Placed {
    pub parent: u64,
    pub attr: Attr,
}

impl Tree {
    pub fn new(files: Arc<dyn Files>) -> Tree {
        Tree { files }
    }

    fn lookup(&self, parent: u64, name: &[u8]) -> S3Result<Option<Attr>> {
        match self.files.lookup(parent, name) {
            Ok(a) => Ok(Some(a)),
            Err(e) if matches!(e.errno(), libc::ENOENT | libc::ENOTDIR) => Ok(None),
            Err(e) => Err(s3_err(e, "lookup")),
        }
    }

    /// The folders of `segs` from the root, each `(parent, name, ino)`;
    /// `None` if one is missing or not a folder.
    fn folders(&self, segs: &[Vec<u8>]) -> S3Result<Option<Chain>> {
        let mut chain = Vec::with_capacity(segs.len());
        let mut at = ROOT_INO;
        for s in segs {
            match self.lookup(at, s)? {
                Some(a) if a.kind == FileKind::Directory => {
                    chain.push((at, s.clone(), a.ino));
                    at = a.ino;
                }
                _ => return Ok(None),
            }
        }
        Ok(Some(chain))
    }

    /// The object at `key`: a regular file, or for a folder key a folder
    /// with the marker.
    pub fn stat(&self, key: &Key) -> S3Result<Option<Placed>> {
        if key.folder {
            let Some(chain) = self.folders(&key.segs)? else { return Ok(None) };
            let (parent, _, ino) = chain.last().cloned().expect("a key has a segment");
            if !self.is_marked(ino)? {
                return Ok(None);
            }
            let attr = self.files.getattr(ino).map_err(|e| s3_err(e, "getattr"))?;
            return Ok(Some(Placed { parent, attr }));
        }
        let Some(chain) = self.folders(key.parents())? else { return Ok(None) };
        let parent = chain.last().map_or(ROOT_INO, |c| c.2);
        match self.lookup(parent, key.name())? {
            Some(a) if a.kind == FileKind::Regular => Ok(Some(Placed { parent, attr: a })),
            _ => Ok(None),
        }
    }

    pub fn is_marked(&self, ino: u64) -> S3Result<bool> {
        match self.files.getxattr(ino, FOLDER_XATTR) {
            Ok(_) => Ok(true),
            Err(e) if matches!(e.errno(), libc::ENODATA | libc::ENOENT) => Ok(false),
            Err(e) => Err(s3_err(e, "getxattr")),
        }
    }

    /// The ETag of the object `a` describes: as put, if the file is as
    /// it was put; else one derived from its inode, size and time (a file
    /// written on a mount), shaped like a multipart ETag since it is no
    /// MD5 of the bytes.
    pub fn etag(&self, a: &Attr) -> String {
        if a.kind == FileKind::Directory {
            return EMPTY_MD5.to_string();
        }
        if let Ok(v) = self.files.getxattr(a.ino, ETAG_XATTR) {
            if let Some(e) = String::from_utf8(v).ok().and_then(|s| etag_if_current(&s, a)) {
                return e;
            }
        }
        derived_etag(a)
    }

    pub fn meta(&self, ino: u64) -> Meta {
        match self.files.getxattr(ino, META_XATTR) {
            Ok(v) => serde_json::from_slice(&v).unwrap_or_default(),
            Err(_) => Meta::default(),
        }
    }

    /// Records the ETag and metadata of file `ino` as it is now.
    pub fn label(&self, ino: u64, etag: &str, meta: &Meta) -> S3Result<Attr> {
        let a = self.files.getattr(ino).map_err(|e| s3_err(e, "getattr"))?;
        let rec = format!("v1 {etag} {} {} {}", a.size, a.mtime.secs, a.mtime.nanos);
        self.files.setxattr(ino, ETAG_XATTR, rec.as_bytes(), XattrFlags::Any).map_err(|e| s3_err(e, "setxattr"))?;
        if !meta.is_empty() {
            let json = serde_json::to_vec(meta).map_err(|e| s3_error!(InternalError, "{e}"))?;
            self.files.setxattr(ino, META_XATTR, &json, XattrFlags::Any).map_err(|e| s3_err(e, "setxattr"))?;
        }
        Ok(a)
    }

    /// The folder `names` under the hidden folder, made if missing.
    pub fn hidden(&self, names: &[&[u8]]) -> S3Result<u64> {
        let mut at = self.folder_in(ROOT_INO, HIDDEN, 0o700)?;
        for n in names {
            at = self.folder_in(at, n, 0o700)?;
        }
        Ok(at)
    }

    /// Folder `name` in `parent`, made if missing.
    fn folder_in(&self, parent: u64, name: &[u8], perm: u16) -> S3Result<u64> {
        for _ in 0..3 {
            match self.lookup(parent, name)? {
                Some(a) if a.kind == FileKind::Directory => return Ok(a.ino),
                Some(_) => {
                    return Err(conflict(format!("{} is an object, not a folder", String::from_utf8_lossy(name))))
                }
                None => {}
            }
            match self.files.mkdir(parent, name, perm, 0, 0) {
                Ok(a) => return Ok(a.ino),
                Err(e) if e.errno() == libc::EEXIST => continue,
                Err(e) => return Err(s3_err(e, "mkdir")),
            }
        }
        Err(s3_error!(InternalError, "a folder kept changing under a PUT"))
    }

    /// The folders of `segs`, made where missing; a file on the way is a
    /// conflict.
    fn make_folders(&self, segs: &[Vec<u8>], key: &str) -> S3Result<u64> {
        let mut at = ROOT_INO;
        for (i, s) in segs.iter().enumerate() {
            at = self.folder_in(at, s, 0o755).map_err(|e| {
                if e.code() == &S3ErrorCode::Custom("KeyConflict".into()) {
                    let mut path = segs[..=i].iter().map(|s| String::from_utf8_lossy(s)).collect::<Vec<_>>().join("/");
                    path.push('/');
                    conflict(format!(
                        "key {key:?} needs a folder {path:?}, but {:?} is an object",
                        path.trim_end_matches('/')
                    ))
                } else {
                    e
                }
            })?;
        }
        Ok(at)
    }

    /// A new temporary file in the hidden folder: (folder, name, inode).
    pub fn temp_file(&self) -> S3Result<(u64, Vec<u8>, u64)> {
        let dir = self.hidden(&[b"tmp"])?;
        let name = unique_name().into_bytes();
        let a = self.files.create(dir, &name, libc::S_IFREG | 0o644, 0, 0, 0).map_err(|e| s3_err(e, "create"))?;
        Ok((dir, name, a.ino))
    }

    /// Removes a temporary file (a PUT that failed its checks).
    pub fn drop_temp(&self, dir: u64, name: &[u8]) {
        if let Err(e) = self.files.unlink(dir, name) {
            tracing::warn!(error = %e, "cannot remove a temporary file");
        }
    }

    /// Removes what PUTs left in the temporary folder (a crash mid-PUT):
    /// none is an object.
    pub fn clear_temps(&self) -> S3Result<usize> {
        let Some(hidden) = self.lookup(ROOT_INO, HIDDEN)? else { return Ok(0) };
        let Some(tmp) = self.lookup(hidden.ino, b"tmp")? else { return Ok(0) };
        let mut n = 0;
        for e in self.entries(tmp.ino)? {
            if self.files.unlink(tmp.ino, &e.name).is_ok() {
                n += 1;
            }
        }
        Ok(n)
    }

    /// The entries of folder `ino`, without `.` and `..`.
    pub fn entries(&self, ino: u64) -> S3Result<Vec<arbor_engine::volume::DirEntryOut>> {
        let mut out = Vec::new();
        let mut offset = 2;
        loop {
            let before = out.len();
            self.files
                .readdir(ino, offset, &mut |e| {
                    offset = e.offset;
                    if e.name != b"." && e.name != b".." {
                        out.push(e);
                    }
                    true
                })
                .map_err(|e| s3_err(e, "readdir"))?;
            if out.len() == before {
                return Ok(out);
            }
        }
    }

    /// Renames temporary file `name` of folder `dir` onto `key`, then
    /// syncs (see the module's doc). `onto` says what may be at the key:
    /// checked and renamed under the namespace lock, so two conditional
    /// PUTs cannot both pass their check.
    pub fn place(&self, dir: u64, name: &[u8], ino: u64, key: &Key, shown: &str, onto: &Onto) -> S3Result<()> {
        {
            let _ns = NAMESPACE.lock();
            self.place_locked(dir, name, key, shown, onto)?;
        }
        self.files.fsync(ino).map_err(|e| s3_err(e, "fsync"))
    }

    fn place_locked(&self, dir: u64, name: &[u8], key: &Key, shown: &str, onto: &Onto) -> S3Result<()> {
        // A folder this PUT needs may be removed by a mount's rmdir
        // between its mkdir and the rename (an S3 DELETE waits for the
        // namespace lock): the PUT goes again.
        for _ in 0..5 {
            let parent = match self.make_folders(key.parents(), shown) {
                Err(e) if *e.code() == S3ErrorCode::NoSuchKey => continue,
                r => r?,
            };
            let there = self.lookup(parent, key.name())?;
            if let Onto::Matching(cond) = onto {
                match &there {
                    Some(a) if a.kind == FileKind::Regular && cond_matches(cond, &self.etag(a)) => {}
                    Some(a) if a.kind == FileKind::Regular => return Err(s3_error!(PreconditionFailed)),
                    _ => return Err(s3_error!(NoSuchKey, "If-Match: there is no object at the key")),
                }
            }
            if let Some(there) = there {
                if there.kind == FileKind::Directory {
                    let in_use = self.is_marked(there.ino)?
                        || match self.files.rmdir(parent, key.name()) {
                            Ok(()) => false,
                            Err(e) if e.errno() == libc::ENOENT => false,
                            Err(_) => true,
                        };
                    if in_use {
                        return Err(conflict(format!(
                            "key {shown:?} is a folder holding other objects (keys under {shown:?}/)"
                        )));
                    }
                } else if there.kind != FileKind::Regular {
                    return Err(conflict(format!("key {shown:?} is a special file (a link or device) on the disk")));
                }
            }
            let mode = if matches!(onto, Onto::Absent) { RenameMode::NoReplace } else { RenameMode::Plain };
            match self.files.rename(dir, name, parent, key.name(), mode) {
                Ok(()) => return Ok(()),
                Err(e) if e.errno() == libc::ENOENT => continue,
                Err(e) if e.errno() == libc::EEXIST => {
                    return Err(s3_error!(PreconditionFailed, "the key exists (If-None-Match: *)"))
                }
                Err(e) if matches!(e.errno(), libc::EISDIR | libc::ENOTEMPTY) => {
                    return Err(conflict(format!("key {shown:?} is a folder holding other objects")))
                }
                Err(e) => return Err(s3_err(e, "rename")),
            }
        }
        Err(s3_error!(InternalError, "the key's folders kept being removed under the PUT"))
    }

    /// Makes folder marker `key` (its folders too), durably. `absent`:
    /// fail with PreconditionFailed if the marker is there
    /// (`If-None-Match: *`).
    pub fn put_folder(&self, key: &Key, shown: &str, absent: bool) -> S3Result<Attr> {
        let ino = {
            let _ns = NAMESPACE.lock();
            let mut made = None;
            for _ in 0..5 {
                match self.make_folders(&key.segs, shown) {
                    Err(e) if *e.code() == S3ErrorCode::NoSuchKey => continue,
                    r => {
                        made = Some(r?);
                        break;
                    }
                }
            }
            let ino = made.ok_or_else(|| s3_error!(InternalError, "the key's folders kept being removed"))?;
            let flags = if absent { XattrFlags::Create } else { XattrFlags::Any };
            match self.files.setxattr(ino, FOLDER_XATTR, b"", flags) {
                Ok(()) => ino,
                Err(e) if e.errno() == libc::EEXIST => return Err(s3_error!(PreconditionFailed)),
                Err(e) => return Err(s3_err(e, "setxattr")),
            }
        };
        self.files.fsync(ino).map_err(|e| s3_err(e, "fsync"))?;
        self.files.getattr(ino).map_err(|e| s3_err(e, "getattr"))
    }

    /// Deletes the object at `key` if there is one (and the folders that
    /// only it kept), durably: synced even if the key was already absent,
    /// since the DELETE that removed it may not have synced yet.
    pub fn delete(&self, key: &Key) -> S3Result<()> {
        self.unlink(key)?;
        self.sync()
    }

    /// Syncs the tree: what was deleted stays deleted.
    pub fn sync(&self) -> S3Result<()> {
        self.files.fsync(ROOT_INO).map_err(|e| s3_err(e, "fsync"))
    }

    /// Deletes the object at `key` if there is one, and the folders only
    /// it kept, without syncing ([`Tree::delete`], or many and one sync).
    pub fn unlink(&self, key: &Key) -> S3Result<()> {
        let _ns = NAMESPACE.lock();
        let segs = if key.folder { &key.segs[..] } else { key.parents() };
        let Some(chain) = self.folders(segs)? else { return Ok(()) };
        let mut keep = chain.len();
        if key.folder {
            let (parent, name, ino) = chain.last().cloned().expect("a key has a segment");
            match self.files.removexattr(ino, FOLDER_XATTR) {
                Ok(()) => {}
                Err(e) if matches!(e.errno(), libc::ENODATA | libc::ENOENT) => return Ok(()),
                Err(e) => return Err(s3_err(e, "removexattr")),
            }
            keep -= 1;
            if self.files.rmdir(parent, &name).is_err() {
                return Ok(());
            }
        } else {
            let parent = chain.last().map_or(ROOT_INO, |c| c.2);
            match self.lookup(parent, key.name())? {
                Some(a) if a.kind == FileKind::Regular => {}
                _ => return Ok(()),
            }
            match self.files.unlink(parent, key.name()) {
                Ok(()) => {}
                Err(e) if e.errno() == libc::ENOENT => return Ok(()),
                Err(e) => return Err(s3_err(e, "unlink")),
            }
        }
        // The folders only this object kept go with it (none is an
        // object: S3 would list no prefix for them). Under the namespace
        // lock no PUT of a marker or of a key below can come between the
        // check and the rmdir.
        for (parent, name, ino) in chain[..keep].iter().rev() {
            if self.is_marked(*ino)? || self.files.rmdir(*parent, name).is_err() {
                break;
            }
        }
        Ok(())
    }

    /// Copies bytes `start..end` of file `src` of `from` (held open) to
    /// a new temporary file of this tree: (folder, name, inode, MD5). In
    /// the same tree the bytes are shared, not copied (a clone of their
    /// extents); `known_md5`, the MD5 of exactly those bytes if the caller
    /// knows it, spares reading them.
    pub fn copy_to_temp(
        &self,
        from: &dyn Files,
        src: u64,
        (start, end): (u64, u64),
        known_md5: Option<[u8; 16]>,
    ) -> S3Result<(u64, Vec<u8>, u64, [u8; 16])> {
        let (dir, name, ino) = self.temp_file()?;
        let copied = (|| {
            if self.share(from, src, start, ino, 0, end - start)? {
                return match known_md5 {
                    Some(md5) => Ok(md5),
                    None => md5_of(&*self.files, ino, end - start),
                };
            }
            let mut md5 = Md5::new();
            copy_bytes(from, src, (start, end), &*self.files, ino, 0, Some(&mut md5))?;
            Ok(md5.finalize())
        })();
        match copied {
            Ok(md5) => Ok((dir, name, ino, md5)),
            Err(e) => {
                self.drop_temp(dir, &name);
                Err(e)
            }
        }
    }

    /// Makes `len` bytes of `dst` from `at` the bytes of `src` of `from`
    /// from `start` by sharing their extents, when `from` is this tree and
    /// the engine can (`false`: the caller copies them). Every byte or
    /// none: a source shorter than the range is an error.
    pub fn share(&self, from: &dyn Files, src: u64, start: u64, dst: u64, at: u64, len: u64) -> S3Result<bool> {
        let same_tree = std::ptr::addr_eq(from as *const dyn Files, Arc::as_ptr(&self.files));
        if !same_tree || len == 0 {
            return Ok(len == 0);
        }
        match self.files.clone_range(src, start, dst, at, len) {
            Ok(n) if n == len => Ok(true),
            Ok(_) => Err(s3_error!(InternalError, "the source shrank under the copy")),
            Err(e) if e.errno() == libc::EOPNOTSUPP => Ok(false),
            Err(e) => Err(s3_err(e, "clone")),
        }
    }
}

/// Copies bytes `start..end` of `src` of `from` to `dst` of `to` from
/// `at`, adding them to `md5` if given.
pub fn copy_bytes(
    from: &dyn Files,
    src: u64,
    (start, end): (u64, u64),
    to: &dyn Files,
    dst: u64,
    at: u64,
    mut md5: Option<&mut Md5>,
) -> S3Result<()> {
    let mut buf = vec![0u8; IO_SIZE];
    let mut off = start;
    while off < end {
        let want = ((end - off) as usize).min(IO_SIZE);
        let n = from.read_into(src, off, &mut buf[..want]).map_err(|e| s3_err(e, "read"))?;
        if n == 0 {
            return Err(s3_error!(InternalError, "the source shrank under the copy"));
        }
        if let Some(m) = md5.as_mut() {
            m.update(&buf[..n]);
        }
        to.write(dst, at + (off - start), &buf[..n]).map_err(|e| s3_err(e, "write"))?;
        off += n as u64;
    }
    Ok(())
}

/// The MD5 of the first `len` bytes of `ino`.
fn md5_of(files: &dyn Files, ino: u64, len: u64) -> S3Result<[u8; 16]> {
    let mut md5 = Md5::new();
    let mut buf = vec![0u8; IO_SIZE];
    let mut off = 0;
    while off < len {
        let want = ((len - off) as usize).min(IO_SIZE);
        let n = files.read_into(ino, off, &mut buf[..want]).map_err(|e| s3_err(e, "read"))?;
        if n == 0 {
            return Err(s3_error!(InternalError, "a copy is shorter than its source"));
        }
        md5.update(&buf[..n]);
        off += n as u64;
    }
    Ok(md5.finalize())
}

/// The ETag in record `rec` if file `a` is as it was when recorded.
fn etag_if_current(rec: &str, a: &Attr) -> Option<String> {
    let mut w = rec.split(' ');
    if w.next()? != "v1" {
        return None;
    }
    let etag = w.next()?;
    let size: u64 = w.next()?.parse().ok()?;
    let secs: i64 = w.next()?.parse().ok()?;
    let nanos: u32 = w.next()?.parse().ok()?;
    (size == a.size && secs == a.mtime.secs && nanos == a.mtime.nanos).then(|| etag.to_string())
}

/// An ETag for a file not put through S3 (or changed since), from what
/// changes when its bytes do.
fn derived_etag(a: &Attr) -> String {
    let id = format!("{}:{}:{}.{}", a.ino, a.size, a.mtime.secs, a.mtime.nanos);
    format!("{}-1", md5_hex(id.as_bytes()))
}

/// A name no other temporary file or upload of this process, or of an
/// earlier one, has.
pub fn unique_name() -> String {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos() as u64;
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    format!("{now:016x}{:08x}{n:08x}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_that_cannot_be_files_are_refused() {
        let k = parse_key("a/b/c.txt").expect("key");
        assert_eq!(k.segs, vec![b"a".to_vec(), b"b".to_vec(), b"c.txt".to_vec()]);
        assert!(!k.folder);
        let k = parse_key("a/b/").expect("folder key");
        assert!(k.folder);
        assert_eq!(k.segs.len(), 2);
        for bad in ["", "/", "/a", "a//b", "a/./b", "../a", "a/..", "a\0b", ".arbor-s3/tmp/x", "//"] {
            assert!(parse_key(bad).is_err(), "{bad:?}");
        }
        assert!(parse_key(&"x".repeat(256)).is_err());
        assert!(parse_key(&"x/".repeat(600)).is_err());
        assert!(parse_key("a/.arbor-s3").is_ok());
        assert!(parse_key("a b/ü-€/~!*'()").is_ok());
    }

    #[test]
    fn hex_round_trips() {
        assert_eq!(hex(&[0, 1, 0xab, 0xff]), "0001abff");
        assert_eq!(unhex("0001abff"), Some(vec![0, 1, 0xab, 0xff]));
        assert_eq!(unhex("0g"), None);
        assert_eq!(unhex("abc"), None);
        assert_eq!(md5_hex(b""), EMPTY_MD5);
    }
}
