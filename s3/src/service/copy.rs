//! Copies (CopyObject, UploadPartCopy): the source, its range and
//! conditions, its bytes into a temporary file of the destination.

use super::body::Temp;
use super::{blocking, check_conditions, RETRIES};
use crate::store::{self, s3_err, Key, Meta, Tree};
use s3s::dto::*;
use s3s::{s3_error, S3ErrorCode, S3Result};
use std::time::SystemTime;

/// The source of a copy: its tree and key.
pub(super) fn copy_source(cs: &CopySource) -> S3Result<(String, String)> {
    match cs {
        CopySource::Bucket { bucket, key, .. } => Ok((bucket.to_string(), key.to_string())),
        _ => Err(s3_error!(NotImplemented, "copies from access points are not served")),
    }
}

/// `bytes=A-B` of a CopySourceRange, inclusive, within `size`.
pub(super) fn copy_range(r: Option<&str>, size: u64) -> S3Result<(u64, u64)> {
    let Some(r) = r else { return Ok((0, size)) };
    let bad = || s3_error!(InvalidArgument, "x-amz-copy-source-range is bytes=FIRST-LAST");
    let (a, b) = r.strip_prefix("bytes=").and_then(|r| r.split_once('-')).ok_or_else(bad)?;
    let a: u64 = a.parse().map_err(|_| bad())?;
    let b: u64 = b.parse().map_err(|_| bad())?;
    if a > b || b >= size {
        return Err(s3_error!(InvalidRange));
    }
    Ok((a, b + 1))
}

/// What a copy read from its source.
pub(super) struct Copied {
    pub(super) temp: Temp,
    pub(super) md5: [u8; 16],
    pub(super) meta: Meta,
}

/// The source conditions of a CopyObject or UploadPartCopy input (two
/// types with the same four fields).
macro_rules! copy_conditions {
    ($i:expr) => {
        SourceConditions {
            if_match: $i.copy_source_if_match,
            if_none_match: $i.copy_source_if_none_match,
            if_modified_since: $i.copy_source_if_modified_since,
            if_unmodified_since: $i.copy_source_if_unmodified_since,
        }
    };
}

/// Copies `range` of `src`'s `key` into a temporary file of `dst` if the
/// source meets `conds`, looking the key up again if it is replaced
/// between its lookup and its open.
pub(super) async fn copy_into_temp(
    src: Tree,
    key: Key,
    dst: Tree,
    range: Option<String>,
    conds: SourceConditions,
) -> S3Result<Copied> {
    blocking(move || {
        for _ in 0..RETRIES {
            match copy_once(&src, &key, &dst, range.as_deref(), &conds)? {
                Some(c) => return Ok(c),
                None => continue,
            }
        }
        Err(s3_error!(SlowDown, "the source kept being replaced"))
    })
    .await
}

/// The conditions of a copy's source, as sent.
pub(super) struct SourceConditions {
    pub(super) if_match: Option<ETagCondition>,
    pub(super) if_none_match: Option<ETagCondition>,
    pub(super) if_modified_since: Option<Timestamp>,
    pub(super) if_unmodified_since: Option<Timestamp>,
}

impl SourceConditions {
    /// A failed condition of a copy's source is 412 (never 304).
    pub(super) fn check(&self, etag: &str, modified: SystemTime) -> S3Result<()> {
        let (m, n) = (self.if_match.as_ref(), self.if_none_match.as_ref());
        match check_conditions(etag, modified, m, n, self.if_modified_since.as_ref(), self.if_unmodified_since.as_ref())
        {
            Err(e) if *e.code() == S3ErrorCode::NotModified => Err(s3_error!(PreconditionFailed)),
            r => r,
        }
    }
}

/// One try of [`copy_into_temp`]; `None` if the source was replaced
/// (its file deleted) between its lookup and its open.
fn copy_once(src: &Tree, key: &Key, dst: &Tree, range: Option<&str>, c: &SourceConditions) -> S3Result<Option<Copied>> {
    {
        let p = src.stat(key)?.ok_or_else(|| s3_error!(NoSuchKey))?;
        let etag = src.etag(&p.attr);
        c.check(&etag, store::mtime(&p.attr))?;
        let meta = src.meta(p.attr.ino);
        let size = if key.folder { 0 } else { p.attr.size };
        let (start, end) = copy_range(range, size)?;
        let a = if key.folder {
            p.attr
        } else {
            match src.files.open(p.attr.ino) {
                Ok(a) => a,
                Err(e) if e.errno() == libc::ENOENT => return Ok(None),
                Err(e) => return Err(s3_err(e, "open")),
            }
        };
        // A whole object whose ETag is the MD5 of its bytes needs no read.
        let known_md5 = (start == 0 && end == size)
            .then(|| store::unhex(etag.trim_matches('"')))
            .flatten()
            .and_then(|b| <[u8; 16]>::try_from(b).ok());
        let copied = dst.copy_to_temp(&*src.files, a.ino, (start, end), known_md5);
        if !key.folder {
            let _ = src.files.release(a.ino);
        }
        let (dir, name, ino, md5) = copied?;
        // Guarded from here: a client gone before the copy is placed
        // leaves no temporary file.
        let temp = Temp { tree: dst.clone(), dir, name, ino, placed: false };
        Ok(Some(Copied { temp, md5, meta }))
    }
}
