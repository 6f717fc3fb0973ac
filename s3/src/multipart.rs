//! Multipart uploads, kept under the hidden folder of the branch:
//! `.arbor-s3/uploads/<id>/upload` (what the upload is for, as JSON) and
//! `part-NNNNN` (each part, with its ETag). CompleteMultipartUpload
//! joins the parts into a temporary file and places it like a PUT: the
//! parts' extents are shared with it (cloned), their bytes copied only
//! where a tree cannot share them. Uploads
//! survive a restart of the server, as S3's do, until completed or
//! aborted.

use crate::store::{conflict, copy_bytes, hex, s3_err, unhex, unique_name, Key, Meta, Onto, Tree};
use arbor_engine::volume::{Attr, FileKind, RenameMode};
use s3s::crypto::{Checksum, Md5};
use s3s::{s3_error, S3Error, S3ErrorCode, S3Result};

/// The smallest part but the last, as S3 has it.
pub const MIN_PART: u64 = 5 << 20;
/// Part numbers run 1 to this.
pub const MAX_PARTS: i32 = 10_000;
const RECORD: &[u8] = b"upload";

/// What an upload is for.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Upload {
    pub key: String,
    pub meta: Meta,
    /// When it was created, in seconds since the epoch.
    pub initiated: u64,
}

/// A part as stored.
pub struct StoredPart {
    pub number: i32,
    pub etag: String,
    pub attr: Attr,
}

fn no_upload() -> S3Error {
    s3_error!(NoSuchUpload)
}

fn part_name(n: i32) -> Vec<u8> {
    format!("part-{n:05}").into_bytes()
}

/// Checks an upload id: the hex names this server gives.
fn check_id(id: &str) -> S3Result<()> {
    if id.is_empty() || id.len() > 64 || unhex(id).is_none() {
        return Err(no_upload());
    }
    Ok(())
}

pub fn check_part_number(n: i32) -> S3Result<()> {
    if !(1..=MAX_PARTS).contains(&n) {
        return Err(s3_error!(InvalidArgument, "part numbers run from 1 to 10000"));
    }
    Ok(())
}

impl Tree {
    /// Starts an upload of `key`; gives its id.
    pub fn create_upload(&self, key: &str, meta: Meta) -> S3Result<String> {
        let id = unique_name();
        let dir = self.hidden(&[b"uploads", id.as_bytes()])?;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let rec = serde_json::to_vec(&Upload { key: key.to_string(), meta, initiated: now })
            .map_err(|e| s3_error!(InternalError, "{e}"))?;
        let a = self.files.create(dir, RECORD, libc::S_IFREG | 0o600, 0, 0, 0).map_err(|e| s3_err(e, "create"))?;
        self.files.write(a.ino, 0, &rec).map_err(|e| s3_err(e, "write"))?;
        self.files.fsync(a.ino).map_err(|e| s3_err(e, "fsync"))?;
        Ok(id)
    }

    /// Upload `id`'s folder and record, checked to be for `key`.
    pub fn upload(&self, id: &str, key: Option<&str>) -> S3Result<(u64, Upload)> {
        check_id(id)?;
        let dir = self.upload_dir(id)?.ok_or_else(no_upload)?;
        let rec = self.files.lookup(dir, RECORD).map_err(|_| no_upload())?;
        let bytes = self.files.read(rec.ino, 0, rec.size as usize).map_err(|e| s3_err(e, "read"))?;
        let up: Upload = serde_json::from_slice(&bytes).map_err(|_| no_upload())?;
        if key.is_some_and(|k| k != up.key) {
            return Err(no_upload());
        }
        Ok((dir, up))
    }

    fn upload_dir(&self, id: &str) -> S3Result<Option<u64>> {
        let Ok(h) = self.files.lookup(arbor_engine::volume::ROOT_INO, crate::store::HIDDEN) else { return Ok(None) };
        let Ok(u) = self.files.lookup(h.ino, b"uploads") else { return Ok(None) };
        match self.files.lookup(u.ino, id.as_bytes()) {
            Ok(a) if a.kind == FileKind::Directory => Ok(Some(a.ino)),
            _ => Ok(None),
        }
    }

    /// Places temporary file `name` of folder `tmp` as part `n` of upload
    /// folder `dir`, durably.
    pub fn place_part(&self, tmp: u64, name: &[u8], ino: u64, dir: u64, n: i32) -> S3Result<()> {
        self.files.rename(tmp, name, dir, &part_name(n), RenameMode::Plain).map_err(|e| s3_err(e, "rename"))?;
        self.files.fsync(ino).map_err(|e| s3_err(e, "fsync"))
    }

    /// The parts of upload folder `dir`, by number.
    pub fn parts(&self, dir: u64) -> S3Result<Vec<StoredPart>> {
        let mut parts = Vec::new();
        for e in self.entries(dir)? {
            let Some(n) = std::str::from_utf8(&e.name).ok().and_then(|s| s.strip_prefix("part-")?.parse().ok()) else {
                continue;
            };
            let Ok(attr) = self.files.getattr(e.ino) else { continue };
            parts.push(StoredPart { number: n, etag: self.etag(&attr), attr });
        }
        parts.sort_by_key(|p| p.number);
        Ok(parts)
    }

    /// Every upload in progress: (id, upload).
    pub fn uploads(&self) -> S3Result<Vec<(String, Upload)>> {
        let Ok(h) = self.files.lookup(arbor_engine::volume::ROOT_INO, crate::store::HIDDEN) else {
            return Ok(Vec::new());
        };
        let Ok(u) = self.files.lookup(h.ino, b"uploads") else { return Ok(Vec::new()) };
        let mut out = Vec::new();
        for e in self.entries(u.ino)? {
            let Ok(id) = String::from_utf8(e.name) else { continue };
            if let Ok((_, up)) = self.upload(&id, None) {
                out.push((id, up));
            }
        }
        Ok(out)
    }

    /// Removes upload `id` and its parts.
    pub fn abort_upload(&self, id: &str) -> S3Result<()> {
        check_id(id)?;
        let dir = self.upload_dir(id)?.ok_or_else(no_upload)?;
        // The record last: an abort cut short leaves an upload that is
        // still listed, and can be aborted again, not parts no upload
        // names.
        for e in self.entries(dir)?.into_iter().filter(|e| e.name != RECORD) {
            let _ = self.files.unlink(dir, &e.name);
        }
        let _ = self.files.unlink(dir, RECORD);
        let h =
            self.files.lookup(arbor_engine::volume::ROOT_INO, crate::store::HIDDEN).map_err(|e| s3_err(e, "lookup"))?;
        let u = self.files.lookup(h.ino, b"uploads").map_err(|e| s3_err(e, "lookup"))?;
        match self.files.rmdir(u.ino, id.as_bytes()) {
            Ok(()) => {}
            Err(e) if e.errno() == libc::ENOENT => {}
            Err(e) => return Err(s3_err(e, "rmdir")),
        }
        self.files.fsync(u.ino).map_err(|e| s3_err(e, "fsync"))
    }

    /// Concatenates the parts `asked` (number, ETag) of upload `id` onto
    /// `key`, durably; gives the object's ETag and attributes. The
    /// upload is gone once the object is in place.
    pub fn complete_upload(
        &self,
        id: &str,
        key: &Key,
        shown: &str,
        asked: &[(i32, String)],
        onto: &Onto,
    ) -> S3Result<(String, Attr)> {
        let (dir, up) = self.upload(id, Some(shown))?;
        if asked.is_empty() {
            return Err(s3_error!(InvalidRequest, "give at least one part"));
        }
        if asked.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err(s3_error!(InvalidPartOrder));
        }
        let stored = self.parts(dir)?;
        let mut chosen = Vec::with_capacity(asked.len());
        for (i, (n, etag)) in asked.iter().enumerate() {
            let p = stored
                .iter()
                .find(|p| p.number == *n)
                .ok_or_else(|| S3Error::with_message(S3ErrorCode::InvalidPart, format!("part {n} was not uploaded")))?;
            if etag.trim_matches('"') != p.etag {
                return Err(S3Error::with_message(S3ErrorCode::InvalidPart, format!("part {n} has another ETag")));
            }
            if i + 1 < asked.len() && p.attr.size < MIN_PART {
                return Err(s3_error!(EntityTooSmall, "every part but the last is at least 5 MiB"));
            }
            chosen.push(p);
        }
        let mut md5s = Vec::with_capacity(16 * chosen.len());
        for p in &chosen {
            md5s.extend(unhex(&p.etag).filter(|b| b.len() == 16).ok_or_else(|| s3_error!(InvalidPart))?);
        }
        let mut m = Md5::new();
        m.update(&md5s);
        let etag = format!("{}-{}", hex(&m.finalize()), chosen.len());
        let (tmp, name, ino) = self.temp_file()?;
        let done = (|| {
            // The parts' extents are joined, not their bytes copied.
            let mut at = 0;
            for p in &chosen {
                let size = p.attr.size;
                if !self.share(&*self.files, p.attr.ino, 0, ino, at, size)? {
                    copy_bytes(&*self.files, p.attr.ino, (0, size), &*self.files, ino, at, None)?;
                }
                at += size;
            }
            let a = self.label(ino, &etag, &up.meta)?;
            self.place(tmp, &name, ino, key, shown, onto)?;
            Ok(a)
        })();
        match done {
            Ok(a) => {
                if let Err(e) = self.abort_upload(id) {
                    tracing::warn!(error = %e, upload = id, "cannot remove a completed upload's parts");
                }
                Ok((etag, a))
            }
            Err(e) => {
                self.drop_temp(tmp, &name);
                Err(e)
            }
        }
    }
}

/// Refuses a key a multipart upload cannot end at, before any part is sent.
pub fn check_target(key: &Key, shown: &str) -> S3Result<()> {
    if key.folder {
        return Err(conflict(format!("key {shown:?} is a folder marker: it holds no bytes")));
    }
    Ok(())
}
