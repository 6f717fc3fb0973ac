//! An S3 bucket (or any S3-compatible server) as an [`ObjectStore`].
//!
//! The engine is synchronous; this store owns a small tokio runtime and
//! blocks on each request. Conditional writes use `If-None-Match: *` and
//! `If-Match: <etag>`; a server answering 412 refused the write.

use super::{check_key, ETag, ObjectInfo, ObjectStore};
use crate::error::{Error, Result};
use aws_sdk_s3::error::SdkError;
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use aws_sdk_s3::Client;
use std::ops::Range;

/// Where and how to reach a bucket. Credentials come from the standard AWS
/// chain (environment, profile files, instance roles) unless given.
#[derive(Clone, Debug, Default)]
pub struct S3Config {
    pub bucket: String,
    /// Keys are stored under this prefix (no leading or trailing `/`).
    pub prefix: String,
    /// A custom endpoint (an S3-compatible server), e.g. `http://127.0.0.1:9000`.
    pub endpoint: Option<String>,
    pub region: Option<String>,
    /// Path-style addressing (`endpoint/bucket/key`), which most
    /// S3-compatible servers need.
    pub path_style: bool,
    /// Static credentials: (access key, secret key).
    pub credentials: Option<(String, String)>,
}

impl S3Config {
    /// Settings from the environment: the standard AWS chain for
    /// credentials and region, `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`
    /// for an S3-compatible server (which then gets path-style addressing
    /// unless `ARBOR_S3_PATH_STYLE=0`).
    pub fn from_env(bucket: &str, prefix: &str) -> S3Config {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let endpoint = env("AWS_ENDPOINT_URL_S3").or_else(|| env("AWS_ENDPOINT_URL"));
        let path_style = match env("ARBOR_S3_PATH_STYLE").as_deref() {
            Some("0") | Some("false") => false,
            Some(_) => true,
            None => endpoint.is_some(),
        };
        S3Config {
            bucket: bucket.into(),
            prefix: prefix.into(),
            endpoint,
            // Resolved by the store (environment, profile, else us-east-1).
            region: None,
            path_style,
            credentials: None,
        }
    }
}

pub struct S3Store {
    client: Client,
    bucket: String,
    prefix: String,
    rt: tokio::runtime::Runtime,
}

/// The HTTP status of a failed request, if the server answered at all.
fn status<E>(e: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>) -> Option<u16> {
    e.raw_response().map(|r| r.status().as_u16())
}

fn io_error<E: std::error::Error + aws_sdk_s3::error::ProvideErrorMetadata + Send + Sync + 'static>(
    what: &str,
    e: SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
) -> Error {
    // One short line: the service's code and message, or the innermost
    // cause of a failure to send (no connection, no credentials).
    let meta = e.as_service_error().map(|s| (s.code().map(str::to_string), s.message().map(str::to_string)));
    let detail = match meta.unwrap_or((None, None)) {
        (Some(code), msg) => format!("{code} {}", msg.unwrap_or_default()).trim_end().to_string(),
        _ => {
            let mut cause: &dyn std::error::Error = &e;
            while let Some(next) = cause.source() {
                cause = next;
            }
            let text = cause.to_string();
            let text = text.split(" (").next().unwrap_or(&text).to_string();
            if text.contains("credentials") || text.contains("IMDS") {
                return Error::Io(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!("S3 {what}: no usable credentials ({text})"),
                ));
            }
            text
        }
    };
    let detail: String = detail.chars().take(300).collect();
    // Transient failures (no answer, 5xx, 408, 429) are `Other` and get
    // retried; a refusal (other 4xx) will not change on a retry.
    let kind = match status(&e) {
        Some(401 | 403) => std::io::ErrorKind::PermissionDenied,
        Some(408 | 429) | None => std::io::ErrorKind::Other,
        Some(s) if (400..500).contains(&s) => std::io::ErrorKind::InvalidInput,
        _ => std::io::ErrorKind::Other,
    };
    Error::Io(std::io::Error::new(kind, format!("S3 {what}: {detail}")))
}

impl S3Store {
    pub fn open(cfg: &S3Config) -> Result<S3Store> {
        if cfg.bucket.is_empty() {
            return Err(Error::Invalid("S3 bucket name"));
        }
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
        // The region: given, else the environment's or the profile's, else
        // us-east-1 (S3-compatible servers accept any; AWS redirects). Not
        // asked of the instance metadata service, which off EC2 only warns.
        let region = match &cfg.region {
            Some(r) => r.clone(),
            None => {
                let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
                let from_profile = || {
                    use aws_config::meta::region::ProvideRegion;
                    rt.block_on(aws_config::profile::ProfileFileRegionProvider::new().region()).map(|r| r.to_string())
                };
                env("AWS_REGION")
                    .or_else(|| env("AWS_DEFAULT_REGION"))
                    .or_else(from_profile)
                    .unwrap_or_else(|| "us-east-1".into())
            }
        };
        loader = loader.region(aws_config::Region::new(region));
        if let Some(endpoint) = &cfg.endpoint {
            loader = loader.endpoint_url(endpoint);
        }
        if let Some((key, secret)) = &cfg.credentials {
            loader =
                loader.credentials_provider(aws_sdk_s3::config::Credentials::new(key, secret, None, None, "arbor"));
        }
        let shared = rt.block_on(loader.load());
        // Every byte arbor stores carries its own crc32c (records, segment
        // footers, heads), checked on read; the SDK's optional checksums
        // would only add CPU, and a server that stores a stale one (s3s-fs
        // after a client dies mid-PUT) would make good bytes unreadable.
        let conf = aws_sdk_s3::config::Builder::from(&shared)
            .force_path_style(cfg.path_style)
            .request_checksum_calculation(aws_sdk_s3::config::RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(aws_sdk_s3::config::ResponseChecksumValidation::WhenRequired)
            .build();
        let prefix = cfg.prefix.trim_matches('/').to_string();
        Ok(S3Store { client: Client::from_conf(conf), bucket: cfg.bucket.clone(), prefix, rt })
    }

    fn key(&self, key: &str) -> Result<String> {
        check_key(key)?;
        Ok(if self.prefix.is_empty() { key.to_string() } else { format!("{}/{key}", self.prefix) })
    }

    fn put_with(&self, key: &str, body: &[u8], if_none: bool, if_match: Option<&str>) -> Result<ETag> {
        let full = self.key(key)?;
        let mut req = self.client.put_object().bucket(&self.bucket).key(&full).body(ByteStream::from(body.to_vec()));
        if if_none {
            req = req.if_none_match("*");
        }
        if let Some(tag) = if_match {
            req = req.if_match(tag);
        }
        match self.rt.block_on(req.send()) {
            Ok(out) => Ok(out.e_tag().unwrap_or_default().to_string()),
            Err(e) => match (status(&e), if_none) {
                (Some(412), true) => Err(Error::AlreadyExists(key.into())),
                (Some(412), false) => Err(Error::PreconditionFailed(key.into())),
                (Some(404), false) if if_match.is_some() => Err(Error::NoSuchObject(key.into())),
                _ => Err(io_error("put", e)),
            },
        }
    }
}

impl S3Store {
    fn ranged_get(
        &self,
        key: &str,
        range: Range<u64>,
        if_match: Option<&str>,
        version: Option<&str>,
    ) -> Result<Vec<u8>> {
        if range.start >= range.end {
            return Err(Error::Invalid("range outside the object"));
        }
        let full = self.key(key)?;
        let mut req = self.client.get_object().bucket(&self.bucket).key(&full).range(format!(
            "bytes={}-{}",
            range.start,
            range.end - 1
        ));
        if let Some(tag) = if_match {
            req = req.if_match(tag);
        }
        if let Some(v) = version {
            req = req.version_id(v);
        }
        // The request and its body run as one task on the store's runtime:
        // the caller's thread only waits, so many concurrent readers do not
        // each poll sockets of their own.
        let task = self.rt.spawn(async move {
            let out = req.send().await?;
            let tag = out.e_tag().map(str::to_string);
            Ok::<_, SdkError<_, _>>(out.body.collect().await.map(|b| (b.into_bytes(), tag)))
        });
        let joined = self.rt.block_on(task).map_err(|e| Error::Io(std::io::Error::other(format!("S3 task: {e}"))))?;
        match joined {
            // A server that ignores If-Match still names what it sent.
            Ok(Ok((_, Some(tag)))) if if_match.is_some_and(|want| want != tag) => {
                Err(Error::PreconditionFailed(key.into()))
            }
            Ok(Ok((bytes, _))) => Ok(Vec::from(bytes)),
            Ok(Err(e)) => Err(Error::Io(std::io::Error::other(format!("S3 ranged get body: {e}")))),
            Err(e) if status(&e) == Some(404) => Err(Error::NoSuchObject(key.into())),
            Err(e) if status(&e) == Some(412) => Err(Error::PreconditionFailed(key.into())),
            Err(e) if status(&e) == Some(416) => Err(Error::Invalid("range outside the object")),
            Err(e) => Err(io_error("ranged get", e)),
        }
    }

    /// One folder level of a listing: its objects and its sub-prefixes.
    /// With `versions` (ListObjectVersions), each key's current version
    /// with its id; a key whose latest version is a delete marker is not
    /// listed.
    async fn list_level(
        client: Client,
        bucket: String,
        prefix: String,
        strip: usize,
        versions: bool,
    ) -> Result<(Vec<ObjectInfo>, Vec<String>)> {
        let (mut objects, mut folders) = (Vec::new(), Vec::new());
        let mut token: Option<String> = None;
        let mut marker: Option<(String, Option<String>)> = None;
        let key_of = |k: Option<&str>| k.and_then(|k| k.get(strip..)).map(str::to_string);
        let info = |key,
                    size: Option<i64>,
                    etag: Option<&str>,
                    modified: Option<&aws_sdk_s3::primitives::DateTime>,
                    version| {
            ObjectInfo {
                key,
                size: size.unwrap_or(0).max(0) as u64,
                etag: etag.unwrap_or_default().to_string(),
                modified: modified.and_then(|t| std::time::SystemTime::try_from(*t).ok()),
                version,
            }
        };
        // Bounded: a folder of more than a billion keys is not listed here.
        for _ in 0..1_000_000 {
            let first = objects.len();
            let more = if versions {
                let mut req = client.list_object_versions().bucket(&bucket).prefix(&prefix).delimiter("/");
                if let Some((k, v)) = &marker {
                    req = req.key_marker(k).set_version_id_marker(v.clone());
                }
                let page = req.send().await.map_err(|e| io_error("list versions", e))?;
                for o in page.versions().iter().filter(|o| o.is_latest() == Some(true)) {
                    let Some(key) = key_of(o.key()) else { continue };
                    // `null`: written while the bucket kept no versions;
                    // the next write replaces it, so it names nothing.
                    let version = o.version_id().filter(|v| *v != "null").map(str::to_string);
                    objects.push(info(key, o.size(), o.e_tag(), o.last_modified(), version));
                }
                folders.extend(page.common_prefixes().iter().filter_map(|p| p.prefix()).map(str::to_string));
                marker =
                    page.next_key_marker().map(|k| (k.to_string(), page.next_version_id_marker().map(str::to_string)));
                page.is_truncated() == Some(true) && marker.is_some()
            } else {
                let mut req = client.list_objects_v2().bucket(&bucket).prefix(&prefix).delimiter("/");
                if let Some(t) = &token {
                    req = req.continuation_token(t);
                }
                let page = req.send().await.map_err(|e| io_error("list", e))?;
                for o in page.contents() {
                    let Some(key) = key_of(o.key()) else { continue };
                    objects.push(info(key, o.size(), o.e_tag(), o.last_modified(), None));
                }
                folders.extend(page.common_prefixes().iter().filter_map(|p| p.prefix()).map(str::to_string));
                token = page.next_continuation_token().map(str::to_string);
                page.is_truncated() == Some(true) && token.is_some()
            };
            // Servers that list no ETags (some S3-compatible ones) are asked
            // per object of this page, many at once.
            let missing: Vec<usize> = (first..objects.len()).filter(|&i| objects[i].etag.is_empty()).collect();
            for batch in missing.chunks(HEADS_IN_FLIGHT) {
                let mut heads = tokio::task::JoinSet::new();
                for &i in batch {
                    let key = &objects[i].key;
                    let full = if strip == 0 { key.clone() } else { format!("{}{key}", &prefix[..strip]) };
                    let req = client.head_object().bucket(&bucket).key(full).set_version_id(objects[i].version.clone());
                    heads.spawn(async move { (i, req.send().await) });
                }
                while let Some(done) = heads.join_next().await {
                    let (i, head) = done.map_err(|e| Error::Io(std::io::Error::other(format!("S3 head task: {e}"))))?;
                    match head {
                        Ok(h) => objects[i].etag = h.e_tag().unwrap_or_default().to_string(),
                        Err(e) if status(&e) == Some(404) => {}
                        Err(e) => return Err(io_error("head", e)),
                    }
                }
            }
            if !more {
                break;
            }
        }
        Ok((objects, folders))
    }

    /// Whether the server answers ListObjectVersions for `prefix` (asked
    /// for one key). Bucket versioning is not asked: a version listing is
    /// right for a bucket with or without versions (an object that has
    /// none is listed with the id `null`), and some servers that keep
    /// versions answer GetBucketVersioning in a shape the SDK refuses. One
    /// that cannot list versions (or a caller not allowed to) is listed
    /// plainly, without version ids.
    async fn lists_versions(client: &Client, bucket: &str, prefix: &str) -> bool {
        match client.list_object_versions().bucket(bucket).prefix(prefix).max_keys(1).send().await {
            Ok(_) => true,
            Err(e) => {
                tracing::debug!(error = %aws_sdk_s3::error::DisplayErrorContext(&e), "no version listing; listing without version ids");
                false
            }
        }
    }
}

impl S3Store {
    fn join_part(&self, h: tokio::task::JoinHandle<Result<CompletedPart>>) -> Result<CompletedPart> {
        self.rt.block_on(h).map_err(|e| Error::Io(std::io::Error::other(format!("upload task: {e}"))))?
    }
}

/// Folder listings in flight at once in [`ObjectStore::list_objects`].
const LISTINGS_IN_FLIGHT: usize = 32;
/// HEADs in flight at once for one listing page without ETags.
const HEADS_IN_FLIGHT: usize = 32;

/// Bodies larger than this go up in parts of [`PART_SIZE`], in parallel.
const MULTIPART_OVER: usize = 16 << 20;
const PART_SIZE: usize = 8 << 20;

impl S3Store {
    async fn multipart(&self, full: &str, body: &[u8]) -> Result<ETag> {
        let created = self
            .client
            .create_multipart_upload()
            .bucket(&self.bucket)
            .key(full)
            .send()
            .await
            .map_err(|e| io_error("create multipart upload", e))?;
        let id = created.upload_id().ok_or(Error::Invalid("S3 returned no upload id"))?.to_string();
        let parts = body.chunks(PART_SIZE).enumerate().map(|(i, part)| {
            let req = self
                .client
                .upload_part()
                .bucket(&self.bucket)
                .key(full)
                .upload_id(&id)
                .part_number(i as i32 + 1)
                .body(ByteStream::from(part.to_vec()));
            async move {
                let out = req.send().await.map_err(|e| io_error("upload part", e))?;
                Ok::<_, Error>(
                    CompletedPart::builder().part_number(i as i32 + 1).e_tag(out.e_tag().unwrap_or_default()).build(),
                )
            }
        });
        let done = async {
            let mut completed = Vec::new();
            // Four parts in flight at a time.
            let mut parts = parts.collect::<Vec<_>>().into_iter();
            loop {
                let batch: Vec<_> = parts.by_ref().take(4).collect();
                if batch.is_empty() {
                    break;
                }
                let handles: Vec<_> = batch.into_iter().map(tokio::spawn).collect();
                for h in handles {
                    let part = h.await.map_err(|e| Error::Io(std::io::Error::other(format!("upload task: {e}"))))?;
                    completed.push(part?);
                }
            }
            let upload = CompletedMultipartUpload::builder().set_parts(Some(completed)).build();
            let out = self
                .client
                .complete_multipart_upload()
                .bucket(&self.bucket)
                .key(full)
                .upload_id(&id)
                .multipart_upload(upload)
                .send()
                .await
                .map_err(|e| io_error("complete multipart upload", e))?;
            Ok(out.e_tag().unwrap_or_default().to_string())
        }
        .await;
        if done.is_err() {
            let abort = self.client.abort_multipart_upload().bucket(&self.bucket).key(full).upload_id(&id);
            if let Err(e) = abort.send().await {
                tracing::warn!(error = %aws_sdk_s3::error::DisplayErrorContext(&e), "aborting a multipart upload failed");
            }
        }
        done
    }
}

impl ObjectStore for S3Store {
    fn put(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.put_with(key, body, false, None)
    }

    fn put_if_absent(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.put_with(key, body, true, None)
    }

    fn put_if_match(&self, key: &str, body: &[u8], etag: &str) -> Result<ETag> {
        // S3 answers 412 both when the tag differs and when the key is gone;
        // tell them apart so callers can say which.
        match self.put_with(key, body, false, Some(etag)) {
            Err(Error::PreconditionFailed(k)) => match self.get(key) {
                Err(Error::NoSuchObject(_)) => Err(Error::NoSuchObject(k)),
                _ => Err(Error::PreconditionFailed(k)),
            },
            other => other,
        }
    }

    fn get(&self, key: &str) -> Result<(Vec<u8>, ETag)> {
        let full = self.key(key)?;
        let out = match self.rt.block_on(self.client.get_object().bucket(&self.bucket).key(&full).send()) {
            Ok(out) => out,
            Err(e) if status(&e) == Some(404) => return Err(Error::NoSuchObject(key.into())),
            Err(e) => return Err(io_error("get", e)),
        };
        let tag = out.e_tag().unwrap_or_default().to_string();
        let body = self.rt.block_on(out.body.collect()).map_err(|e| Error::Io(std::io::Error::other(e.to_string())))?;
        Ok((Vec::from(body.into_bytes()), tag))
    }

    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>> {
        self.ranged_get(key, range, None, None)
    }

    fn get_range_if(&self, key: &str, range: Range<u64>, etag: &str, version: Option<&str>) -> Result<Vec<u8>> {
        self.ranged_get(key, range, Some(etag), version)
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>> {
        let full = if self.prefix.is_empty() { prefix.to_string() } else { format!("{}/{prefix}", self.prefix) };
        let strip = if self.prefix.is_empty() { 0 } else { self.prefix.len() + 1 };
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        // Bounded: a listing of more than a billion keys is not a disk.
        for _ in 0..1_000_000 {
            let mut req = self.client.list_objects_v2().bucket(&self.bucket).prefix(&full);
            if let Some(t) = &token {
                req = req.continuation_token(t);
            }
            let page = self.rt.block_on(req.send()).map_err(|e| io_error("list", e))?;
            out.extend(
                page.contents().iter().filter_map(|o| o.key()).filter_map(|k| k.get(strip..)).map(str::to_string),
            );
            match page.next_continuation_token() {
                Some(t) if page.is_truncated() == Some(true) => token = Some(t.to_string()),
                _ => break,
            }
        }
        out.sort();
        Ok(out)
    }

    /// Lists folder by folder (`/` as the delimiter), many folders at once,
    /// so a wide tree lists in parallel.
    fn list_objects(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let full = if self.prefix.is_empty() { prefix.to_string() } else { format!("{}/{prefix}", self.prefix) };
        let strip = if self.prefix.is_empty() { 0 } else { self.prefix.len() + 1 };
        let (client, bucket) = (self.client.clone(), self.bucket.clone());
        let mut out = self.rt.block_on(async move {
            let versions = S3Store::lists_versions(&client, &bucket, &full).await;
            let mut out = Vec::new();
            let mut waiting = vec![full];
            let mut running = tokio::task::JoinSet::new();
            loop {
                while running.len() < LISTINGS_IN_FLIGHT {
                    let Some(p) = waiting.pop() else { break };
                    running.spawn(S3Store::list_level(client.clone(), bucket.clone(), p, strip, versions));
                }
                let Some(done) = running.join_next().await else { break };
                let (objects, folders) =
                    done.map_err(|e| Error::Io(std::io::Error::other(format!("S3 list task: {e}"))))??;
                out.extend(objects);
                waiting.extend(folders);
            }
            Ok::<_, Error>(out)
        })?;
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// One GET of a suffix range; the object's length from its
    /// `Content-Range` (or, when the whole object came, its body).
    fn get_tail(&self, key: &str, len: u64) -> Result<(Vec<u8>, u64)> {
        if len == 0 {
            return Ok((Vec::new(), self.size(key)?));
        }
        let full = self.key(key)?;
        let req = self.client.get_object().bucket(&self.bucket).key(&full).range(format!("bytes=-{len}"));
        let task = self.rt.spawn(async move {
            let out = req.send().await?;
            let total = out.content_range().and_then(|r| r.rsplit('/').next()).and_then(|t| t.parse::<u64>().ok());
            Ok::<_, SdkError<_, _>>(out.body.collect().await.map(|b| (b.into_bytes(), total)))
        });
        let joined = self.rt.block_on(task).map_err(|e| Error::Io(std::io::Error::other(format!("S3 task: {e}"))))?;
        match joined {
            Ok(Ok((bytes, Some(total)))) if bytes.len() as u64 <= total => Ok((Vec::from(bytes), total)),
            // No total named: the whole object came only if it is shorter.
            Ok(Ok((bytes, None))) if (bytes.len() as u64) < len => {
                let n = bytes.len() as u64;
                Ok((Vec::from(bytes), n))
            }
            Ok(Err(e)) => Err(Error::Io(std::io::Error::other(format!("S3 ranged get body: {e}")))),
            Err(e) if status(&e) == Some(404) => Err(Error::NoSuchObject(key.into())),
            // No total named, or a server that takes no suffix range longer
            // than the object (s3s-fs answers 500) or none at all: the
            // length, then the bytes.
            _ => {
                let size = self.size(key)?;
                if size == 0 {
                    return Ok((Vec::new(), 0));
                }
                Ok((self.get_range(key, size.saturating_sub(len)..size)?, size))
            }
        }
    }

    fn size(&self, key: &str) -> Result<u64> {
        let full = self.key(key)?;
        match self.rt.block_on(self.client.head_object().bucket(&self.bucket).key(&full).send()) {
            Ok(out) => Ok(out.content_length().unwrap_or(0).max(0) as u64),
            Err(e) if status(&e) == Some(404) => Err(Error::NoSuchObject(key.into())),
            Err(e) => Err(io_error("head", e)),
        }
    }

    fn put_large(&self, key: &str, body: &[u8]) -> Result<ETag> {
        if body.len() <= MULTIPART_OVER {
            return self.put(key, body);
        }
        let full = self.key(key)?;
        self.rt.block_on(self.multipart(&full, body))
    }

    fn put_from(&self, key: &str, len: u64, fill: &mut dyn FnMut(u64, &mut [u8]) -> Result<()>) -> Result<ETag> {
        if len <= MULTIPART_OVER as u64 {
            let mut body = vec![0u8; len as usize];
            fill(0, &mut body)?;
            return self.put(key, &body);
        }
        let full = self.key(key)?;
        let created = self
            .rt
            .block_on(self.client.create_multipart_upload().bucket(&self.bucket).key(&full).send())
            .map_err(|e| io_error("create multipart upload", e))?;
        let id = created.upload_id().ok_or(Error::Invalid("S3 returned no upload id"))?.to_string();
        let done = (|| {
            let mut in_flight = std::collections::VecDeque::new();
            let mut completed = Vec::new();
            let mut off = 0u64;
            let mut part = 1i32;
            while off < len {
                let n = (len - off).min(PART_SIZE as u64) as usize;
                let mut buf = vec![0u8; n];
                fill(off, &mut buf)?;
                let req = self
                    .client
                    .upload_part()
                    .bucket(&self.bucket)
                    .key(&full)
                    .upload_id(&id)
                    .part_number(part)
                    .body(ByteStream::from(buf));
                let number = part;
                in_flight.push_back(self.rt.spawn(async move {
                    let out = req.send().await.map_err(|e| io_error("upload part", e))?;
                    Ok::<_, Error>(
                        CompletedPart::builder().part_number(number).e_tag(out.e_tag().unwrap_or_default()).build(),
                    )
                }));
                // Four parts in flight; the next one is read meanwhile.
                if in_flight.len() >= 4 {
                    if let Some(h) = in_flight.pop_front() {
                        completed.push(self.join_part(h)?);
                    }
                }
                off += n as u64;
                part += 1;
            }
            while let Some(h) = in_flight.pop_front() {
                completed.push(self.join_part(h)?);
            }
            let upload = CompletedMultipartUpload::builder().set_parts(Some(completed)).build();
            let out = self
                .rt
                .block_on(
                    self.client
                        .complete_multipart_upload()
                        .bucket(&self.bucket)
                        .key(&full)
                        .upload_id(&id)
                        .multipart_upload(upload)
                        .send(),
                )
                .map_err(|e| io_error("complete multipart upload", e))?;
            Ok(out.e_tag().unwrap_or_default().to_string())
        })();
        if done.is_err() {
            let abort = self.client.abort_multipart_upload().bucket(&self.bucket).key(&full).upload_id(&id);
            if let Err(e) = self.rt.block_on(abort.send()) {
                tracing::warn!(error = %aws_sdk_s3::error::DisplayErrorContext(&e), "aborting a multipart upload failed");
            }
        }
        done
    }

    fn delete(&self, key: &str) -> Result<()> {
        let full = self.key(key)?;
        match self.rt.block_on(self.client.delete_object().bucket(&self.bucket).key(&full).send()) {
            Ok(_) => Ok(()),
            Err(e) if status(&e) == Some(404) => Ok(()),
            Err(e) => Err(io_error("delete", e)),
        }
    }
}
