//! The S3 operations over the roots of one `arbor serve`: the trait's
//! one impl here, bodies in `body.rs`, copies in `copy.rs`.

mod body;
#[macro_use]
mod copy;

use crate::list::{self, Entry};
use crate::multipart;
use crate::names::{self, Bucket as Named};
use crate::store::{self, parse_key, s3_err, Key, Meta, Onto, Tree};
use arbor_engine::format::Addr;
use arbor_engine::volume::{Attr, ROOT_INO};
use arbor_node::serve::Roots;
use body::{body_stream, hasher, next_chunk, receive, Claimed, Held, Received};
use bytes::Bytes;
use copy::{copy_into_temp, copy_source, SourceConditions};
use parking_lot::Mutex;
use s3s::dto::*;
use s3s::{s3_error, S3Error, S3ErrorCode, S3Request, S3Response, S3Result, S3};
use std::collections::HashMap;
use std::time::SystemTime;

/// Keys one DeleteObjects may name (as S3).
const MAX_DELETE_KEYS: usize = 1000;

/// How often a request looks a key up again when the file it found was
/// replaced by another PUT before it could open it.
const RETRIES: usize = 8;

/// Checkpoints kept open at once (each holds its tree's cache).
const OPEN_CHECKPOINTS: usize = 16;

/// The service: buckets are the roots of the disk.
pub struct Arbor {
    roots: Roots,
    /// Open checkpoints by bucket and the commit their record names.
    checkpoints: Mutex<HashMap<(String, Addr), Tree>>,
}

/// Runs `f` off the async threads.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> S3Result<T> + Send + 'static) -> S3Result<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => Err(s3_error!(InternalError, "a file operation failed: {e}")),
    }
}

fn ts(t: SystemTime) -> Timestamp {
    Timestamp::from(t)
}

fn engine_ts(t: arbor_engine::env::Timestamp) -> Timestamp {
    let secs = u64::try_from(t.secs).unwrap_or(0);
    ts(SystemTime::UNIX_EPOCH + std::time::Duration::new(secs, t.nanos))
}

/// Whole seconds since the epoch: HTTP dates carry no more, so the
/// conditions compare at that grain.
fn secs(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn ts_secs(t: &Timestamp) -> u64 {
    let t: SystemTime = time::OffsetDateTime::from(t.clone()).into();
    secs(t)
}

fn matches(cond: &ETagCondition, etag: &str) -> bool {
    match cond {
        ETagCondition::Any => true,
        ETagCondition::ETag(e) => e.value() == etag,
    }
}

/// The conditions of a GET or HEAD (RFC 9110): If-Match, else
/// If-Unmodified-Since, fails with 412; If-None-Match, else
/// If-Modified-Since, answers 304.
fn check_conditions(
    etag: &str,
    modified: SystemTime,
    if_match: Option<&ETagCondition>,
    if_none_match: Option<&ETagCondition>,
    if_modified_since: Option<&Timestamp>,
    if_unmodified_since: Option<&Timestamp>,
) -> S3Result<()> {
    let m = secs(modified);
    match (if_match, if_unmodified_since) {
        (Some(c), _) if !matches(c, etag) => return Err(s3_error!(PreconditionFailed)),
        (None, Some(t)) if m > ts_secs(t) => return Err(s3_error!(PreconditionFailed)),
        _ => {}
    }
    match (if_none_match, if_modified_since) {
        (Some(c), _) if matches(c, etag) => Err(s3_error!(NotModified)),
        (None, Some(t)) if m <= ts_secs(t) => Err(s3_error!(NotModified)),
        _ => Ok(()),
    }
}

/// Keys and prefixes in a listing as the client asked: as they are, or
/// URL-encoded (`EncodingType=url`, which boto3 asks for).
struct Encoding(bool);

impl Encoding {
    fn of(e: &Option<EncodingType>) -> Encoding {
        Encoding(e.as_ref().is_some_and(|e| e.as_str() == EncodingType::URL))
    }
    fn show(&self, s: &str) -> String {
        if !self.0 {
            return s.to_string();
        }
        let mut out = String::with_capacity(s.len());
        for b in s.bytes() {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
                out.push(b as char);
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
        out
    }
    fn opt(&self, s: Option<String>) -> Option<String> {
        s.map(|s| self.show(&s))
    }
}

fn utf8(key: &[u8]) -> String {
    String::from_utf8_lossy(key).into_owned()
}

fn meta_of(
    content_type: Option<String>,
    content_encoding: Option<String>,
    content_disposition: Option<String>,
    content_language: Option<String>,
    cache_control: Option<String>,
    metadata: Option<Metadata>,
) -> Meta {
    Meta {
        content_type,
        content_encoding,
        content_disposition,
        content_language,
        cache_control,
        metadata: metadata.filter(|m| !m.is_empty()).map(|m| m.into_iter().collect()),
    }
}

impl Arbor {
    pub fn new(roots: Roots) -> Arbor {
        Arbor { roots, checkpoints: Mutex::new(HashMap::new()) }
    }

    /// The branches served as buckets, and why the others are not.
    pub fn served_branches(&self) -> (Vec<String>, Vec<(String, &'static str)>) {
        let (mut ok, mut not) = (Vec::new(), Vec::new());
        for b in self.roots.branches() {
            match names::unserved(&b) {
                None => ok.push(b),
                Some(why) => not.push((b, why)),
            }
        }
        (ok, not)
    }

    /// A branch's tree.
    pub fn branch_tree(&self, name: &str) -> Option<Tree> {
        names::branch_bucket(name)?;
        self.roots.branch(name).map(Tree::new)
    }

    /// The tree of `bucket`; `write`: for a change (a checkpoint's bucket
    /// refuses it).
    async fn tree(&self, bucket: &str, write: bool) -> S3Result<Tree> {
        match names::parse(bucket) {
            Named::Branch(b) => self.branch_tree(&b).ok_or_else(|| s3_error!(NoSuchBucket)),
            Named::Checkpoint { branch, name } => {
                let t = self.checkpoint_tree(bucket, &branch, &name).await?;
                if write {
                    return Err(S3Error::with_message(
                        S3ErrorCode::AccessDenied,
                        format!("bucket {bucket} is checkpoint {name}: read-only"),
                    ));
                }
                Ok(t)
            }
        }
    }

    /// The tree of checkpoint `name` of `branch`. The checkpoint's
    /// record is read on every use (it is small): a deleted checkpoint is
    /// NoSuchBucket at once, and one deleted and made again under its name
    /// serves its new tree, never the old one kept open here.
    async fn checkpoint_tree(&self, bucket: &str, branch: &str, name: &str) -> S3Result<Tree> {
        let (roots, b, n) = (self.roots.clone(), branch.to_string(), name.to_string());
        let commit = blocking(move || {
            Ok(match roots.checkpoint(&n) {
                Ok(info) if info.branch == b && names::checkpoint_bucket(&b, &n).is_some() => Some(info.commit),
                _ => None,
            })
        })
        .await?
        .ok_or_else(|| s3_error!(NoSuchBucket))?;
        let at = (bucket.to_string(), commit);
        if let Some(t) = self.checkpoints.lock().get(&at) {
            return Ok(t.clone());
        }
        let (roots, n) = (self.roots.clone(), name.to_string());
        let files = blocking(move || roots.open_checkpoint(&n).map_err(|e| s3_error!(InternalError, "{e}"))).await?;
        let t = Tree::new(files);
        let mut open = self.checkpoints.lock();
        if open.len() >= OPEN_CHECKPOINTS {
            open.clear();
        }
        open.retain(|(b, _), _| b != bucket);
        open.insert(at, t.clone());
        Ok(t)
    }

    /// Stat of `key` in `tree`, off the async threads.
    async fn stat(tree: &Tree, key: &Key) -> S3Result<Option<(Attr, String)>> {
        let (t, k) = (tree.clone(), key.clone());
        blocking(move || {
            // A PUT replacing the key may delete the file between its
            // lookup and the read of its ETag: that is no answer (its ETag
            // would be a derived one), the key is looked up again.
            for _ in 0..RETRIES {
                let Some(p) = t.stat(&k)? else { return Ok(None) };
                let e = t.etag(&p.attr);
                match t.files.getattr(p.attr.ino) {
                    Ok(_) => return Ok(Some((p.attr, e))),
                    Err(e) if e.errno() == libc::ENOENT => continue,
                    Err(e) => return Err(s3_err(e, "getattr")),
                }
            }
            Err(s3_error!(SlowDown, "the key kept being replaced"))
        })
        .await
    }

    /// Writes a body to a temporary file and places it at `key`: the
    /// shared part of PutObject and CopyObject.
    async fn finish_put(
        tree: &Tree,
        key: &Key,
        shown: &str,
        r: Received,
        etag: String,
        meta: Meta,
        onto: Onto,
    ) -> S3Result<Attr> {
        let (t, k, shown) = (tree.clone(), key.clone(), shown.to_string());
        let mut temp = r.temp;
        let (dir, name, ino) = (temp.dir, temp.name.clone(), temp.ino);
        let placed = blocking(move || {
            let a = t.label(ino, &etag, &meta)?;
            t.place(dir, &name, ino, &k, &shown, &onto)?;
            Ok(a)
        })
        .await;
        if placed.is_ok() {
            temp.placed = true;
        }
        placed
    }
}

/// A GET or HEAD of one part of an object (`partNumber`) is not served:
/// the parts of a completed upload are not kept apart. Refused rather
/// than answered with the whole object.
fn refuse_part_number(n: Option<PartNumber>) -> S3Result<()> {
    match n {
        Some(_) => Err(s3_error!(NotImplemented, "GET and HEAD by partNumber are not served")),
        None => Ok(()),
    }
}

/// Whether a V1 marker is a common prefix a listing of `prefix` with
/// `delimiter` can give: past the prefix, something that ends at the
/// delimiter's first occurrence. A marker equal to the prefix (or a key
/// ending in the delimiter further in) is not, and skipping everything
/// under it would skip the page's keys.
fn is_common_prefix(marker: &str, prefix: &str, delimiter: &str) -> bool {
    if delimiter.is_empty() {
        return false;
    }
    let Some(rest) = marker.strip_prefix(prefix) else { return false };
    !rest.is_empty() && rest.find(delimiter) == Some(rest.len() - delimiter.len())
}

/// The bytes of `size` a Range header asks for, and its Content-Range.
/// No byte of an empty object is satisfiable (RFC 9110 14.1.2): s3s
/// gives `0..0` for a suffix of one, which has no last byte to show.
fn satisfiable(r: &Range, size: u64) -> S3Result<(std::ops::Range<u64>, String)> {
    let r = r.check(size)?;
    if r.is_empty() {
        return Err(s3_error!(InvalidRange));
    }
    let shown = format!("bytes {}-{}/{size}", r.start, r.end - 1);
    Ok((r, shown))
}

#[async_trait::async_trait]
impl S3 for Arbor {
    async fn list_buckets(&self, _req: S3Request<ListBucketsInput>) -> S3Result<S3Response<ListBucketsOutput>> {
        let mut buckets = Vec::new();
        for b in self.served_branches().0 {
            let Some(t) = self.branch_tree(&b) else { continue };
            let created = blocking(move || Ok(t.files.getattr(ROOT_INO).ok().map(|a| engine_ts(a.crtime)))).await?;
            buckets.push(Bucket { name: Some(b), creation_date: created, bucket_region: None });
        }
        let roots = self.roots.clone();
        let cps = blocking(move || roots.checkpoints().map_err(|e| s3_error!(InternalError, "{e}"))).await?;
        for c in cps {
            if let Some(name) = names::checkpoint_bucket(&c.branch, &c.name) {
                buckets.push(Bucket {
                    name: Some(name),
                    creation_date: Some(engine_ts(c.created)),
                    bucket_region: None,
                });
            }
        }
        buckets.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(S3Response::new(ListBucketsOutput { buckets: Some(buckets), ..Default::default() }))
    }

    async fn head_bucket(&self, req: S3Request<HeadBucketInput>) -> S3Result<S3Response<HeadBucketOutput>> {
        self.tree(&req.input.bucket, false).await?;
        Ok(S3Response::new(HeadBucketOutput::default()))
    }

    async fn get_bucket_location(
        &self,
        req: S3Request<GetBucketLocationInput>,
    ) -> S3Result<S3Response<GetBucketLocationOutput>> {
        self.tree(&req.input.bucket, false).await?;
        Ok(S3Response::new(GetBucketLocationOutput::default()))
    }

    async fn create_bucket(&self, req: S3Request<CreateBucketInput>) -> S3Result<S3Response<CreateBucketOutput>> {
        let b = &req.input.bucket;
        if self.tree(b, false).await.is_ok() {
            return Err(s3_error!(BucketAlreadyOwnedByYou));
        }
        Err(S3Error::with_message(
            S3ErrorCode::AccessDenied,
            "buckets are the disk's branches (arbor branch create, then arbor serve --branch) and checkpoints",
        ))
    }

    async fn delete_bucket(&self, _req: S3Request<DeleteBucketInput>) -> S3Result<S3Response<DeleteBucketOutput>> {
        Err(S3Error::with_message(S3ErrorCode::AccessDenied, "buckets are the disk's branches and checkpoints"))
    }

    /// Browser form uploads are not served: the server in front refuses
    /// them before reading a body ([`crate::is_form_post`]); this is the
    /// second line, should one reach here.
    async fn post_object(&self, _req: S3Request<PostObjectInput>) -> S3Result<S3Response<PostObjectOutput>> {
        Err(s3_error!(NotImplemented, "POST uploads (HTML forms) are not served: PUT the object"))
    }

    async fn head_object(&self, req: S3Request<HeadObjectInput>) -> S3Result<S3Response<HeadObjectOutput>> {
        let i = req.input;
        refuse_part_number(i.part_number)?;
        let tree = self.tree(&i.bucket, false).await?;
        let key = parse_key(&i.key)?;
        let (attr, etag) = Self::stat(&tree, &key).await?.ok_or_else(|| s3_error!(NoSuchKey))?;
        let modified = store::mtime(&attr);
        check_conditions(
            &etag,
            modified,
            i.if_match.as_ref(),
            i.if_none_match.as_ref(),
            i.if_modified_since.as_ref(),
            i.if_unmodified_since.as_ref(),
        )?;
        let size = if key.folder { 0 } else { attr.size };
        let (content_length, content_range) = match &i.range {
            None => (size, None),
            Some(r) => {
                let (r, shown) = satisfiable(r, size)?;
                (r.end - r.start, Some(shown))
            }
        };
        let t = tree.clone();
        let meta = blocking(move || Ok(t.meta(attr.ino))).await?;
        Ok(S3Response::new(HeadObjectOutput {
            content_length: Some(content_length as i64),
            content_range,
            accept_ranges: Some("bytes".into()),
            e_tag: Some(ETag::Strong(etag)),
            last_modified: Some(ts(modified)),
            content_type: meta.content_type,
            content_encoding: meta.content_encoding,
            content_disposition: meta.content_disposition,
            content_language: meta.content_language,
            cache_control: meta.cache_control,
            metadata: meta.metadata.map(|m| m.into_iter().collect()),
            ..Default::default()
        }))
    }

    async fn get_object(&self, req: S3Request<GetObjectInput>) -> S3Result<S3Response<GetObjectOutput>> {
        let i = req.input;
        refuse_part_number(i.part_number)?;
        let tree = self.tree(&i.bucket, false).await?;
        let key = parse_key(&i.key)?;
        let (t, k) = (tree.clone(), key.clone());
        // Opened before its size is read: the bytes streamed are the
        // file's as it is now, even if another PUT replaces it meanwhile.
        let found = blocking(move || {
            for _ in 0..RETRIES {
                let Some(p) = t.stat(&k)? else { return Ok(None) };
                if k.folder {
                    let e = t.etag(&p.attr);
                    let meta = t.meta(p.attr.ino);
                    return Ok(Some((p.attr, e, None, meta)));
                }
                // Replaced (and so deleted) since the lookup: look again.
                let a = match t.files.open(p.attr.ino) {
                    Ok(a) => a,
                    Err(e) if e.errno() == libc::ENOENT => continue,
                    Err(e) => return Err(s3_err(e, "open")),
                };
                let held = Held { files: t.files.clone(), ino: a.ino };
                let e = t.etag(&a);
                return Ok(Some((a, e, Some(held), t.meta(p.attr.ino))));
            }
            Err(s3_error!(SlowDown, "the key kept being replaced"))
        })
        .await?;
        let (attr, etag, held, meta) = found.ok_or_else(|| s3_error!(NoSuchKey))?;
        let modified = store::mtime(&attr);
        check_conditions(
            &etag,
            modified,
            i.if_match.as_ref(),
            i.if_none_match.as_ref(),
            i.if_modified_since.as_ref(),
            i.if_unmodified_since.as_ref(),
        )?;
        let size = if key.folder { 0 } else { attr.size };
        let (range, content_range) = match &i.range {
            None => (0..size, None),
            Some(r) => {
                let (r, shown) = satisfiable(r, size)?;
                (r, Some(shown))
            }
        };
        let body = match held {
            Some(h) => body_stream(h, range.start, range.end),
            None => StreamingBlob::wrap(futures::stream::empty::<Result<Bytes, std::io::Error>>()),
        };
        Ok(S3Response::new(GetObjectOutput {
            body: Some(body),
            content_length: Some((range.end - range.start) as i64),
            content_range,
            accept_ranges: Some("bytes".into()),
            e_tag: Some(ETag::Strong(etag)),
            last_modified: Some(ts(modified)),
            content_type: meta.content_type,
            content_encoding: meta.content_encoding,
            content_disposition: meta.content_disposition,
            content_language: meta.content_language,
            cache_control: meta.cache_control,
            metadata: meta.metadata.map(|m| m.into_iter().collect()),
            ..Default::default()
        }))
    }

    async fn put_object(&self, req: S3Request<PutObjectInput>) -> S3Result<S3Response<PutObjectOutput>> {
        let trailer = req.headers.get("x-amz-trailer").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let trailers = req.trailing_headers;
        let i = req.input;
        let tree = self.tree(&i.bucket, true).await?;
        let key = parse_key(&i.key)?;
        let given = [
            i.checksum_crc32.is_some(),
            i.checksum_crc32c.is_some(),
            i.checksum_sha1.is_some(),
            i.checksum_sha256.is_some(),
            i.checksum_crc64nvme.is_some(),
        ];
        let sums = hasher(i.checksum_algorithm.as_ref(), given, trailer.as_deref())?;
        let mut claimed = Claimed {
            crc32: i.checksum_crc32,
            crc32c: i.checksum_crc32c,
            sha1: i.checksum_sha1,
            sha256: i.checksum_sha256,
            crc64nvme: i.checksum_crc64nvme,
        };
        let no_replace = i.if_none_match.as_ref().is_some_and(ETagCondition::is_any);
        // Checked before the body is received, to fail early, and again
        // where the file is renamed onto the key, atomically.
        let onto = match &i.if_match {
            Some(cond) => {
                match Self::stat(&tree, &key).await? {
                    Some((_, etag)) if matches(cond, &etag) => {}
                    Some(_) => return Err(s3_error!(PreconditionFailed)),
                    None => return Err(s3_error!(NoSuchKey, "If-Match: there is no object at the key")),
                }
                Onto::Matching(cond.clone())
            }
            None if no_replace => Onto::Absent,
            None => Onto::Any,
        };
        if key.folder {
            let mut body = i.body;
            if let Some(b) = body.as_mut() {
                while let Some(chunk) = next_chunk(b).await? {
                    if !chunk.is_empty() {
                        return Err(S3Error::with_message(
                            S3ErrorCode::InvalidArgument,
                            "a key ending in / is a folder marker: it holds no bytes",
                        ));
                    }
                }
            }
            let (t, k, shown) = (tree.clone(), key.clone(), i.key.clone());
            blocking(move || t.put_folder(&k, &shown, no_replace)).await?;
            return Ok(S3Response::new(PutObjectOutput {
                e_tag: Some(ETag::Strong(store::EMPTY_MD5.into())),
                ..Default::default()
            }));
        }
        let r = receive(&tree, i.body, sums).await?;
        if let Some(len) = i.content_length {
            if len >= 0 && len as u64 != r.size {
                return Err(s3_error!(IncompleteBody, "the body is not Content-Length long"));
            }
        }
        let md5 = store::hex(&r.md5);
        if let Some(content_md5) = &i.content_md5 {
            let sent = base64_simd::STANDARD.decode_to_vec(content_md5).map_err(|_| s3_error!(InvalidDigest))?;
            if store::hex(&sent) != md5 {
                return Err(s3_error!(BadDigest, "the body's MD5 is not its Content-MD5"));
            }
        }
        claimed.add_trailers(trailers.as_ref())?;
        let sums = claimed.check(r.sums.clone())?;
        let meta = meta_of(
            i.content_type,
            i.content_encoding,
            i.content_disposition,
            i.content_language,
            i.cache_control,
            i.metadata,
        );
        Self::finish_put(&tree, &key, &i.key, r, md5.clone(), meta, onto).await?;
        Ok(S3Response::new(PutObjectOutput {
            e_tag: Some(ETag::Strong(md5)),
            checksum_crc32: sums.checksum_crc32,
            checksum_crc32c: sums.checksum_crc32c,
            checksum_sha1: sums.checksum_sha1,
            checksum_sha256: sums.checksum_sha256,
            checksum_crc64nvme: sums.checksum_crc64nvme,
            ..Default::default()
        }))
    }

    async fn delete_object(&self, req: S3Request<DeleteObjectInput>) -> S3Result<S3Response<DeleteObjectOutput>> {
        let i = req.input;
        let tree = self.tree(&i.bucket, true).await?;
        let key = parse_key(&i.key)?;
        blocking(move || tree.delete(&key)).await?;
        Ok(S3Response::new(DeleteObjectOutput::default()))
    }

    async fn delete_objects(&self, req: S3Request<DeleteObjectsInput>) -> S3Result<S3Response<DeleteObjectsOutput>> {
        let i = req.input;
        let tree = self.tree(&i.bucket, true).await?;
        let quiet = i.delete.quiet.unwrap_or(false);
        let objects = i.delete.objects;
        if objects.len() > MAX_DELETE_KEYS {
            return Err(S3Error::with_message(
                S3ErrorCode::MalformedXML,
                format!("a DeleteObjects request names at most {MAX_DELETE_KEYS} keys"),
            ));
        }
        let (deleted, errors) = blocking(move || {
            let (mut deleted, mut errors) = (Vec::new(), Vec::new());
            for o in objects {
                match parse_key(&o.key).and_then(|k| tree.unlink(&k)) {
                    Ok(()) => {
                        if !quiet {
                            deleted.push(DeletedObject { key: Some(o.key), ..Default::default() })
                        }
                    }
                    Err(e) => errors.push(s3s::dto::Error {
                        code: Some(e.code().as_str().to_string()),
                        key: Some(o.key),
                        message: e.message().map(str::to_owned),
                        ..Default::default()
                    }),
                }
            }
            // One sync for all: none is answered deleted before it.
            tree.sync()?;
            Ok((deleted, errors))
        })
        .await?;
        Ok(S3Response::new(DeleteObjectsOutput {
            deleted: Some(deleted),
            errors: (!errors.is_empty()).then_some(errors),
            ..Default::default()
        }))
    }

    async fn list_objects(&self, req: S3Request<ListObjectsInput>) -> S3Result<S3Response<ListObjectsOutput>> {
        let marker = req.input.marker.clone();
        let v2 = self
            .list_objects_v2(req.map_input(|i| {
                // A V1 marker may be a common prefix the page before
                // ended with: everything under it is skipped too.
                let prefix = i.prefix.as_deref().unwrap_or("");
                let (token, start_after) = match (&i.marker, &i.delimiter) {
                    (Some(m), Some(d)) if is_common_prefix(m, prefix, d) => {
                        (Some(format!("p{}", store::hex(m.as_bytes()))), None)
                    }
                    _ => (None, i.marker),
                };
                ListObjectsV2Input {
                    bucket: i.bucket,
                    delimiter: i.delimiter,
                    encoding_type: i.encoding_type,
                    max_keys: i.max_keys,
                    prefix: i.prefix,
                    start_after,
                    continuation_token: token,
                    ..Default::default()
                }
            }))
            .await?;
        Ok(v2.map_output(|v2| {
            // A V1 client pages with the last key (or prefix) it got.
            let next_marker = if v2.is_truncated == Some(true) {
                let last_key = v2.contents.as_ref().and_then(|c| c.last()).and_then(|o| o.key.clone());
                let last_prefix = v2.common_prefixes.as_ref().and_then(|c| c.last()).and_then(|p| p.prefix.clone());
                last_key.into_iter().chain(last_prefix).max()
            } else {
                None
            };
            ListObjectsOutput {
                contents: v2.contents,
                common_prefixes: v2.common_prefixes,
                delimiter: v2.delimiter,
                encoding_type: v2.encoding_type,
                name: v2.name,
                prefix: v2.prefix,
                max_keys: v2.max_keys,
                is_truncated: v2.is_truncated,
                marker,
                next_marker,
                ..Default::default()
            }
        }))
    }

    async fn list_objects_v2(&self, req: S3Request<ListObjectsV2Input>) -> S3Result<S3Response<ListObjectsV2Output>> {
        let i = req.input;
        let tree = self.tree(&i.bucket, false).await?;
        let max = i.max_keys.unwrap_or(1000).clamp(0, 1000) as usize;
        let after = list::start_after(i.continuation_token.as_deref(), i.start_after.as_deref())?;
        let prefix = i.prefix.clone().unwrap_or_default();
        let delimiter = i.delimiter.clone();
        let enc = Encoding::of(&i.encoding_type);
        let t = tree.clone();
        let (contents, prefixes, next_token) = blocking(move || {
            let page = if max == 0 {
                list::Page { entries: Vec::new(), truncated: false }
            } else {
                list::page(&t, &prefix, delimiter.as_deref(), &after, max)?
            };
            let next_token = if page.truncated { page.entries.last().map(list::token_after) } else { None };
            let (mut contents, mut prefixes) = (Vec::new(), Vec::new());
            for e in page.entries {
                match e {
                    Entry::Object(f) => {
                        let size = if f.key.ends_with(b"/") { 0 } else { f.attr.size };
                        contents.push(Object {
                            key: Some(utf8(&f.key)),
                            size: Some(size as i64),
                            e_tag: Some(ETag::Strong(t.etag(&f.attr))),
                            last_modified: Some(ts(store::mtime(&f.attr))),
                            storage_class: Some(ObjectStorageClass::from_static(ObjectStorageClass::STANDARD)),
                            ..Default::default()
                        })
                    }
                    Entry::Prefix(p) => prefixes.push(utf8(&p)),
                }
            }
            Ok((contents, prefixes, next_token))
        })
        .await?;
        let key_count = (contents.len() + prefixes.len()) as i32;
        let contents: Vec<Object> = contents
            .into_iter()
            .map(|mut o| {
                o.key = enc.opt(o.key);
                o
            })
            .collect();
        let prefixes: Vec<CommonPrefix> =
            prefixes.into_iter().map(|p| CommonPrefix { prefix: Some(enc.show(&p)) }).collect();
        Ok(S3Response::new(ListObjectsV2Output {
            name: Some(i.bucket),
            prefix: Some(enc.show(i.prefix.as_deref().unwrap_or(""))),
            delimiter: enc.opt(i.delimiter),
            start_after: enc.opt(i.start_after),
            encoding_type: i.encoding_type,
            max_keys: Some(max as i32),
            key_count: Some(key_count),
            is_truncated: Some(next_token.is_some()),
            continuation_token: i.continuation_token,
            next_continuation_token: next_token,
            contents: (!contents.is_empty()).then_some(contents),
            common_prefixes: (!prefixes.is_empty()).then_some(prefixes),
            ..Default::default()
        }))
    }

    async fn copy_object(&self, req: S3Request<CopyObjectInput>) -> S3Result<S3Response<CopyObjectOutput>> {
        let i = req.input;
        let dst = self.tree(&i.bucket, true).await?;
        let key = parse_key(&i.key)?;
        let (src_bucket, src_key) = copy_source(&i.copy_source)?;
        let src = self.tree(&src_bucket, false).await?;
        let skey = parse_key(&src_key)?;
        if key.folder {
            return Err(S3Error::with_message(
                S3ErrorCode::InvalidArgument,
                "a folder marker holds no bytes to copy to",
            ));
        }
        let replace = i.metadata_directive.as_ref().is_some_and(|d| d.as_str() == MetadataDirective::REPLACE);
        if src_bucket == i.bucket && src_key == i.key && !replace {
            return Err(S3Error::with_message(
                S3ErrorCode::InvalidRequest,
                "a copy of an object onto itself must change its metadata (x-amz-metadata-directive: REPLACE)",
            ));
        }
        let c = copy_into_temp(src, skey, dst.clone(), None, copy_conditions!(i)).await?;
        let meta = if replace {
            meta_of(
                i.content_type,
                i.content_encoding,
                i.content_disposition,
                i.content_language,
                i.cache_control,
                i.metadata,
            )
        } else {
            c.meta
        };
        let md5 = store::hex(&c.md5);
        let r = Received { temp: c.temp, size: 0, md5: c.md5, sums: Default::default() };
        let a = Self::finish_put(&dst, &key, &i.key, r, md5.clone(), meta, Onto::Any).await?;
        Ok(S3Response::new(CopyObjectOutput {
            copy_object_result: Some(CopyObjectResult {
                e_tag: Some(ETag::Strong(md5)),
                last_modified: Some(ts(store::mtime(&a))),
                ..Default::default()
            }),
            ..Default::default()
        }))
    }

    async fn create_multipart_upload(
        &self,
        req: S3Request<CreateMultipartUploadInput>,
    ) -> S3Result<S3Response<CreateMultipartUploadOutput>> {
        let i = req.input;
        let tree = self.tree(&i.bucket, true).await?;
        let key = parse_key(&i.key)?;
        multipart::check_target(&key, &i.key)?;
        let meta = meta_of(
            i.content_type,
            i.content_encoding,
            i.content_disposition,
            i.content_language,
            i.cache_control,
            i.metadata,
        );
        let k = i.key.clone();
        let id = blocking(move || tree.create_upload(&k, meta)).await?;
        Ok(S3Response::new(CreateMultipartUploadOutput {
            bucket: Some(i.bucket),
            key: Some(i.key),
            upload_id: Some(id),
            ..Default::default()
        }))
    }

    async fn upload_part(&self, req: S3Request<UploadPartInput>) -> S3Result<S3Response<UploadPartOutput>> {
        let trailer = req.headers.get("x-amz-trailer").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let trailers = req.trailing_headers;
        let i = req.input;
        let tree = self.tree(&i.bucket, true).await?;
        multipart::check_part_number(i.part_number)?;
        let (t, id, k) = (tree.clone(), i.upload_id.clone(), i.key.clone());
        let (dir, _) = blocking(move || t.upload(&id, Some(&k))).await?;
        let given = [
            i.checksum_crc32.is_some(),
            i.checksum_crc32c.is_some(),
            i.checksum_sha1.is_some(),
            i.checksum_sha256.is_some(),
            i.checksum_crc64nvme.is_some(),
        ];
        let sums = hasher(i.checksum_algorithm.as_ref(), given, trailer.as_deref())?;
        let mut claimed = Claimed {
            crc32: i.checksum_crc32,
            crc32c: i.checksum_crc32c,
            sha1: i.checksum_sha1,
            sha256: i.checksum_sha256,
            crc64nvme: i.checksum_crc64nvme,
        };
        let r = receive(&tree, i.body, sums).await?;
        if let Some(len) = i.content_length {
            if len >= 0 && len as u64 != r.size {
                return Err(s3_error!(IncompleteBody, "the body is not Content-Length long"));
            }
        }
        let md5 = store::hex(&r.md5);
        if let Some(content_md5) = &i.content_md5 {
            let sent = base64_simd::STANDARD.decode_to_vec(content_md5).map_err(|_| s3_error!(InvalidDigest))?;
            if store::hex(&sent) != md5 {
                return Err(s3_error!(BadDigest, "the body's MD5 is not its Content-MD5"));
            }
        }
        claimed.add_trailers(trailers.as_ref())?;
        let sums = claimed.check(r.sums.clone())?;
        let mut temp = r.temp;
        let (t, e, n) = (tree.clone(), md5.clone(), i.part_number);
        let (tmp, name, ino) = (temp.dir, temp.name.clone(), temp.ino);
        blocking(move || {
            t.label(ino, &e, &Meta::default())?;
            t.place_part(tmp, &name, ino, dir, n)
        })
        .await?;
        temp.placed = true;
        Ok(S3Response::new(UploadPartOutput {
            e_tag: Some(ETag::Strong(md5)),
            checksum_crc32: sums.checksum_crc32,
            checksum_crc32c: sums.checksum_crc32c,
            checksum_sha1: sums.checksum_sha1,
            checksum_sha256: sums.checksum_sha256,
            checksum_crc64nvme: sums.checksum_crc64nvme,
            ..Default::default()
        }))
    }

    async fn upload_part_copy(
        &self,
        req: S3Request<UploadPartCopyInput>,
    ) -> S3Result<S3Response<UploadPartCopyOutput>> {
        let i = req.input;
        let tree = self.tree(&i.bucket, true).await?;
        multipart::check_part_number(i.part_number)?;
        let (t, id, k) = (tree.clone(), i.upload_id.clone(), i.key.clone());
        let (dir, _) = blocking(move || t.upload(&id, Some(&k))).await?;
        let (src_bucket, src_key) = copy_source(&i.copy_source)?;
        let src = self.tree(&src_bucket, false).await?;
        let skey = parse_key(&src_key)?;
        let c = copy_into_temp(src, skey, tree.clone(), i.copy_source_range, copy_conditions!(i)).await?;
        let md5 = store::hex(&c.md5);
        let mut temp = c.temp;
        let (tmp, name, ino) = (temp.dir, temp.name.clone(), temp.ino);
        let (t, e, n) = (tree.clone(), md5.clone(), i.part_number);
        let a = blocking(move || {
            let a = t.label(ino, &e, &Meta::default())?;
            t.place_part(tmp, &name, ino, dir, n)?;
            Ok(a)
        })
        .await?;
        temp.placed = true;
        Ok(S3Response::new(UploadPartCopyOutput {
            copy_part_result: Some(CopyPartResult {
                e_tag: Some(ETag::Strong(md5)),
                last_modified: Some(ts(store::mtime(&a))),
                ..Default::default()
            }),
            ..Default::default()
        }))
    }

    async fn complete_multipart_upload(
        &self,
        req: S3Request<CompleteMultipartUploadInput>,
    ) -> S3Result<S3Response<CompleteMultipartUploadOutput>> {
        let i = req.input;
        let tree = self.tree(&i.bucket, true).await?;
        let key = parse_key(&i.key)?;
        let mut asked = Vec::new();
        for p in i.multipart_upload.and_then(|m| m.parts).unwrap_or_default() {
            let n = p.part_number.ok_or_else(|| s3_error!(InvalidPart, "a part without its number"))?;
            let etag = p
                .e_tag
                .map(|e| e.value().to_string())
                .ok_or_else(|| s3_error!(InvalidPart, "a part without its ETag"))?;
            asked.push((n, etag));
        }
        // Checked where the joined file is renamed onto the key.
        let onto = match (&i.if_match, &i.if_none_match) {
            (Some(cond), _) => Onto::Matching(cond.clone()),
            (None, Some(c)) if c.is_any() => Onto::Absent,
            _ => Onto::Any,
        };
        let (t, id, k, shown) = (tree.clone(), i.upload_id.clone(), key.clone(), i.key.clone());
        let (etag, _) = blocking(move || t.complete_upload(&id, &k, &shown, &asked, &onto)).await?;
        Ok(S3Response::new(CompleteMultipartUploadOutput {
            bucket: Some(i.bucket),
            key: Some(i.key),
            e_tag: Some(ETag::Strong(etag)),
            ..Default::default()
        }))
    }

    async fn abort_multipart_upload(
        &self,
        req: S3Request<AbortMultipartUploadInput>,
    ) -> S3Result<S3Response<AbortMultipartUploadOutput>> {
        let i = req.input;
        let tree = self.tree(&i.bucket, true).await?;
        let (id, k) = (i.upload_id.clone(), i.key.clone());
        blocking(move || {
            tree.upload(&id, Some(&k))?;
            tree.abort_upload(&id)
        })
        .await?;
        Ok(S3Response::new(AbortMultipartUploadOutput::default()))
    }

    async fn list_parts(&self, req: S3Request<ListPartsInput>) -> S3Result<S3Response<ListPartsOutput>> {
        let i = req.input;
        let tree = self.tree(&i.bucket, true).await?;
        let (id, k) = (i.upload_id.clone(), i.key.clone());
        let marker = i.part_number_marker.unwrap_or(0);
        let max = i.max_parts.unwrap_or(1000).clamp(1, 1000) as usize;
        let (parts, truncated) = blocking(move || {
            let (dir, _) = tree.upload(&id, Some(&k))?;
            let all: Vec<_> = tree.parts(dir)?.into_iter().filter(|p| p.number > marker).collect();
            let truncated = all.len() > max;
            Ok((all.into_iter().take(max).collect::<Vec<_>>(), truncated))
        })
        .await?;
        let next = if truncated { parts.last().map(|p| p.number) } else { None };
        let parts: Vec<Part> = parts
            .into_iter()
            .map(|p| Part {
                part_number: Some(p.number),
                e_tag: Some(ETag::Strong(p.etag)),
                size: Some(p.attr.size as i64),
                last_modified: Some(ts(store::mtime(&p.attr))),
                ..Default::default()
            })
            .collect();
        Ok(S3Response::new(ListPartsOutput {
            bucket: Some(i.bucket),
            key: Some(i.key),
            upload_id: Some(i.upload_id),
            is_truncated: Some(truncated),
            next_part_number_marker: next,
            max_parts: Some(max as i32),
            part_number_marker: i.part_number_marker,
            parts: Some(parts),
            ..Default::default()
        }))
    }

    async fn list_multipart_uploads(
        &self,
        req: S3Request<ListMultipartUploadsInput>,
    ) -> S3Result<S3Response<ListMultipartUploadsOutput>> {
        let i = req.input;
        let tree = self.tree(&i.bucket, true).await?;
        let prefix = i.prefix.clone().unwrap_or_default();
        let mut uploads = blocking(move || tree.uploads()).await?;
        uploads.retain(|(_, u)| u.key.starts_with(&prefix));
        if let Some(m) = &i.key_marker {
            uploads.retain(|(id, u)| {
                u.key.as_str() > m.as_str()
                    || (u.key == *m && i.upload_id_marker.as_ref().is_some_and(|im| id.as_str() > im.as_str()))
            });
        }
        uploads.sort_by(|a, b| (&a.1.key, a.1.initiated, &a.0).cmp(&(&b.1.key, b.1.initiated, &b.0)));
        let max = i.max_uploads.unwrap_or(1000).clamp(1, 1000) as usize;
        let truncated = uploads.len() > max;
        uploads.truncate(max);
        let (next_key, next_id) = match (truncated, uploads.last()) {
            (true, Some((id, u))) => (Some(u.key.clone()), Some(id.clone())),
            _ => (None, None),
        };
        let list: Vec<MultipartUpload> = uploads
            .into_iter()
            .map(|(id, u)| MultipartUpload {
                key: Some(u.key),
                upload_id: Some(id),
                initiated: Some(ts(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(u.initiated))),
                ..Default::default()
            })
            .collect();
        Ok(S3Response::new(ListMultipartUploadsOutput {
            bucket: Some(i.bucket),
            prefix: i.prefix,
            key_marker: i.key_marker,
            upload_id_marker: i.upload_id_marker,
            max_uploads: Some(max as i32),
            is_truncated: Some(truncated),
            next_key_marker: next_key,
            next_upload_id_marker: next_id,
            uploads: Some(list),
            ..Default::default()
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(h: &str) -> Range {
        Range::parse(h).expect("a range")
    }

    #[test]
    fn no_range_of_an_empty_object_is_satisfiable() {
        for h in ["bytes=-1", "bytes=-100", "bytes=0-", "bytes=0-0"] {
            let e = satisfiable(&range(h), 0).expect_err(h);
            assert_eq!(*e.code(), S3ErrorCode::InvalidRange, "{h}");
        }
    }

    #[test]
    fn a_v1_marker_is_a_common_prefix_only_as_a_listing_gives_one() {
        assert!(is_common_prefix("a/b/", "a/", "/"));
        assert!(is_common_prefix("b/", "", "/"));
        assert!(is_common_prefix("a/b--", "a/", "--"));
        // The prefix itself, as a marker: a/x is still to come.
        assert!(!is_common_prefix("a/", "a/", "/"));
        // A key ending in the delimiter deeper down is a key (a marker).
        assert!(!is_common_prefix("a/b/c/", "a/", "/"));
        assert!(!is_common_prefix("a/b", "a/", "/"));
        assert!(!is_common_prefix("b/", "a/", "/"));
        assert!(!is_common_prefix("a/b/", "a/", ""));
    }

    #[test]
    fn ranges_of_a_small_object() {
        assert_eq!(satisfiable(&range("bytes=-1"), 5).expect("suffix"), (4..5, "bytes 4-4/5".into()));
        assert_eq!(satisfiable(&range("bytes=-9"), 5).expect("long suffix"), (0..5, "bytes 0-4/5".into()));
        assert_eq!(satisfiable(&range("bytes=2-"), 5).expect("open"), (2..5, "bytes 2-4/5".into()));
        assert!(satisfiable(&range("bytes=5-"), 5).is_err());
    }
}
