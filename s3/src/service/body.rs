//! Request and response bodies: a file streamed out to a GET, a PUT's
//! body received into a temporary file with the checksums it claims.

use super::blocking;
use crate::conn::BODY_IDLE_TIMEOUT;
use crate::store::{s3_err, Tree, IO_SIZE};
use arbor_engine::files::Files;
use bytes::Bytes;
use futures::StreamExt;
use s3s::checksum::ChecksumHasher;
use s3s::crypto::{Checksum, Md5};
use s3s::dto::*;
use s3s::{s3_error, S3Error, S3ErrorCode, S3Result};
use std::sync::Arc;

/// A file held open while its bytes stream out: released when dropped.
pub(super) struct Held {
    pub(super) files: Arc<dyn Files>,
    pub(super) ino: u64,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Err(e) = self.files.release(self.ino) {
            tracing::debug!(error = %e, "releasing a file read through S3");
        }
    }
}

/// Bytes `start..end` of an open file, read one chunk ahead of the client.
pub(super) fn body_stream(held: Held, start: u64, end: u64) -> StreamingBlob {
    type Read = tokio::task::JoinHandle<std::io::Result<Vec<u8>>>;
    fn read(files: Arc<dyn Files>, ino: u64, off: u64, len: usize) -> Read {
        tokio::task::spawn_blocking(move || {
            let mut buf = vec![0u8; len];
            let mut got = 0;
            while got < len {
                let n = files
                    .read_into(ino, off + got as u64, &mut buf[got..])
                    .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
                if n == 0 {
                    return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the file shrank under a GET"));
                }
                got += n;
            }
            Ok(buf)
        })
    }
    struct State {
        held: Held,
        next: u64,
        end: u64,
        pending: Option<Read>,
    }
    let start_read = |s: &mut State| {
        if s.pending.is_none() && s.next < s.end {
            let len = (s.end - s.next).min(IO_SIZE as u64) as usize;
            s.pending = Some(read(s.held.files.clone(), s.held.ino, s.next, len));
            s.next += len as u64;
        }
    };
    let mut first = State { held, next: start, end, pending: None };
    start_read(&mut first);
    let stream = futures::stream::unfold(Some(first), move |state| async move {
        let mut s = state?;
        let pending = s.pending.take()?;
        let got = match pending.await {
            Ok(r) => r,
            Err(e) => Err(std::io::Error::other(e.to_string())),
        };
        match got {
            Ok(buf) => {
                start_read(&mut s);
                Some((Ok(Bytes::from(buf)), Some(s)))
            }
            Err(e) => Some((Err(e), None)),
        }
    });
    StreamingBlob::wrap(stream)
}

/// A temporary file being written: removed if the PUT does not place it.
pub(super) struct Temp {
    pub(super) tree: Tree,
    pub(super) dir: u64,
    pub(super) name: Vec<u8>,
    pub(super) ino: u64,
    pub(super) placed: bool,
}

impl Drop for Temp {
    fn drop(&mut self) {
        if !self.placed {
            let (tree, dir, name) = (self.tree.clone(), self.dir, std::mem::take(&mut self.name));
            let drop_it = move || tree.drop_temp(dir, &name);
            match tokio::runtime::Handle::try_current() {
                Ok(h) => {
                    h.spawn_blocking(drop_it);
                }
                Err(_) => drop_it(),
            }
        }
    }
}

/// Which checksums a PUT's body is checked against (its headers, its
/// trailer, or `x-amz-checksum-algorithm`).
pub(super) fn hasher(
    alg: Option<&ChecksumAlgorithm>,
    given: [bool; 5],
    trailer: Option<&str>,
) -> S3Result<ChecksumHasher> {
    let mut h = ChecksumHasher::default();
    let [crc32, crc32c, sha1, sha256, crc64] = given;
    let want = |name: &str| trailer.is_some_and(|t| t.eq_ignore_ascii_case(name));
    if crc32 || want("x-amz-checksum-crc32") {
        h.crc32 = Some(Default::default());
    }
    if crc32c || want("x-amz-checksum-crc32c") {
        h.crc32c = Some(Default::default());
    }
    if sha1 || want("x-amz-checksum-sha1") {
        h.sha1 = Some(Default::default());
    }
    if sha256 || want("x-amz-checksum-sha256") {
        h.sha256 = Some(Default::default());
    }
    if crc64 || want("x-amz-checksum-crc64nvme") {
        h.crc64nvme = Some(Default::default());
    }
    if let Some(alg) = alg {
        match alg.as_str() {
            ChecksumAlgorithm::CRC32 => h.crc32 = Some(Default::default()),
            ChecksumAlgorithm::CRC32C => h.crc32c = Some(Default::default()),
            ChecksumAlgorithm::SHA1 => h.sha1 = Some(Default::default()),
            ChecksumAlgorithm::SHA256 => h.sha256 = Some(Default::default()),
            ChecksumAlgorithm::CRC64NVME => h.crc64nvme = Some(Default::default()),
            _ => return Err(s3_error!(NotImplemented, "unsupported checksum algorithm")),
        }
    }
    Ok(h)
}

/// The checksums a body must have: its headers', else its trailer's.
#[derive(Default)]
pub(super) struct Claimed {
    pub(super) crc32: Option<String>,
    pub(super) crc32c: Option<String>,
    pub(super) sha1: Option<String>,
    pub(super) sha256: Option<String>,
    pub(super) crc64nvme: Option<String>,
}

impl Claimed {
    pub(super) fn add_trailers(&mut self, trailers: Option<&s3s::TrailingHeaders>) -> S3Result<()> {
        let Some(map) = trailers.and_then(|t| t.take()) else { return Ok(()) };
        let get = |name: &str| -> S3Result<Option<String>> {
            map.get(name)
                .map(|v| v.to_str().map(str::to_owned).map_err(|_| s3_error!(InvalidArgument, "bad trailer {name}")))
                .transpose()
        };
        self.crc32 = self.crc32.take().or(get("x-amz-checksum-crc32")?);
        self.crc32c = self.crc32c.take().or(get("x-amz-checksum-crc32c")?);
        self.sha1 = self.sha1.take().or(get("x-amz-checksum-sha1")?);
        self.sha256 = self.sha256.take().or(get("x-amz-checksum-sha256")?);
        self.crc64nvme = self.crc64nvme.take().or(get("x-amz-checksum-crc64nvme")?);
        Ok(())
    }

    /// Fails with BadDigest where a claimed checksum differs from the
    /// body's; gives the body's.
    pub(super) fn check(&self, got: s3s::dto::Checksum) -> S3Result<s3s::dto::Checksum> {
        let pairs = [
            ("CRC32", &self.crc32, &got.checksum_crc32),
            ("CRC32C", &self.crc32c, &got.checksum_crc32c),
            ("SHA1", &self.sha1, &got.checksum_sha1),
            ("SHA256", &self.sha256, &got.checksum_sha256),
            ("CRC64NVME", &self.crc64nvme, &got.checksum_crc64nvme),
        ];
        for (name, claimed, computed) in pairs {
            if let Some(c) = claimed {
                if Some(c) != computed.as_ref() {
                    return Err(S3Error::with_message(
                        S3ErrorCode::BadDigest,
                        format!("the body's {name} is not the one sent with it"),
                    ));
                }
            }
        }
        Ok(got)
    }
}

/// What a body gave as it was written to a temporary file.
pub(super) struct Received {
    pub(super) temp: Temp,
    pub(super) size: u64,
    pub(super) md5: [u8; 16],
    pub(super) sums: s3s::dto::Checksum,
}

/// The next chunk of a request body; RequestTimeout if the client sends
/// nothing for [`BODY_IDLE_TIMEOUT`].
pub(super) async fn next_chunk(body: &mut StreamingBlob) -> S3Result<Option<Bytes>> {
    match tokio::time::timeout(BODY_IDLE_TIMEOUT, body.next()).await {
        Err(_) => Err(S3Error::with_message(
            S3ErrorCode::RequestTimeout,
            format!("the body paused for more than {} s", BODY_IDLE_TIMEOUT.as_secs()),
        )),
        Ok(None) => Ok(None),
        Ok(Some(chunk)) => {
            chunk.map(Some).map_err(|e| S3Error::with_message(S3ErrorCode::IncompleteBody, e.to_string()))
        }
    }
}

/// Writes `body` to a new temporary file of `tree`, a chunk at a time
/// (one write in flight while the next chunk arrives), hashing it.
pub(super) async fn receive(tree: &Tree, body: Option<StreamingBlob>, mut sums: ChecksumHasher) -> S3Result<Received> {
    let t = tree.clone();
    let (dir, name, ino) = blocking(move || t.temp_file()).await?;
    let temp = Temp { tree: tree.clone(), dir, name, ino, placed: false };
    let mut md5 = Md5::new();
    let mut size = 0u64;
    let mut buf: Vec<u8> = Vec::with_capacity(IO_SIZE);
    let mut pending: Option<tokio::task::JoinHandle<S3Result<()>>> = None;
    let write = |files: Arc<dyn Files>, off: u64, data: Vec<u8>| {
        tokio::task::spawn_blocking(move || files.write(ino, off, &data).map(|_| ()).map_err(|e| s3_err(e, "write")))
    };
    async fn settle(p: Option<tokio::task::JoinHandle<S3Result<()>>>) -> S3Result<()> {
        match p {
            Some(p) => p.await.map_err(|e| s3_error!(InternalError, "{e}"))?,
            None => Ok(()),
        }
    }
    if let Some(mut body) = body {
        while let Some(chunk) = next_chunk(&mut body).await? {
            md5.update(&chunk);
            sums.update(&chunk);
            buf.extend_from_slice(&chunk);
            if buf.len() >= IO_SIZE {
                settle(pending.take()).await?;
                let full = std::mem::replace(&mut buf, Vec::with_capacity(IO_SIZE));
                let len = full.len() as u64;
                pending = Some(write(tree.files.clone(), size, full));
                size += len;
            }
        }
    }
    settle(pending.take()).await?;
    if !buf.is_empty() {
        let len = buf.len() as u64;
        settle(Some(write(tree.files.clone(), size, buf))).await?;
        size += len;
    }
    Ok(Received { temp, size, md5: md5.finalize(), sums: sums.finalize() })
}
