//! arbor over the network: `arbor serve`, a cache of segment chunks shared
//! by every node that mounts a disk, and the client a mount uses to read
//! through it.
//!
//! A sealed segment object is immutable and its name is never reused, and
//! every 1 MiB chunk of it has a crc32c in the object's footer. A chunk is
//! therefore a pure function of (segment, index): the cache needs no
//! invalidation and no coherence protocol, and a client checks every byte
//! a server gives it against the footer it read from the bucket itself.
//!
//! Imported files' source objects are served the same way, by (bucket,
//! key, ETag, index): one version's bytes, never invalidated. They have no
//! footer, so the server sends each chunk's crc32c (taken before it left
//! the server's cache) and the client checks that and the length; past
//! that, a client trusts the server's conditional GET as it would its own.
//!
//! # Wire protocol
//!
//! HTTP/2 over TCP (prior knowledge; the server also answers HTTP/1.1, so
//! `curl` works), in clear or, when the server has a certificate, inside
//! TLS 1.3 (see [`wire::tls`]). One connection per client and server, many
//! requests in flight on it. Every request carries the shared token as
//! `Authorization: Bearer <token>` (or the connection a client certificate
//! the server's client CA signed); without it the answer is `401` and an
//! empty body, whatever was asked.
//!
//! | request | answer |
//! | --- | --- |
//! | `GET /v1/chunks/<segment file name>/<index>` | `200` the chunk's bytes, `x-arbor-cache: hit\|miss`; `404` no such sealed segment or chunk; `502` the bucket failed |
//! | `GET /v1/objects/<index>?bucket=…&key=…&etag=…&size=…` | chunk `index` of an imported file's source object (that version: the GET to the bucket is conditional on the ETag): `200` as above; `404` no such chunk; `409` the object changed or is gone; `502` the bucket failed |
//! | `GET /metrics` | Prometheus text: hits, misses, bucket bytes, bytes served, evictions, resident bytes, request latency |
//! | `GET /v1/health` | `200 ok` |
//! | `GET /v1/files/<branch>/events?…` | what changed on a branch this process owns: see [`branch::owner`] |
//!
//! File operations on a branch this process owns use framed connections
//! to the same port instead (see [`wire::frames`] and [`branch::frames`]): a connection that starts
//! with `ARBF` is one of those, anything else is HTTP (inside TLS, the
//! protocol the client names in its handshake, ALPN, tells them apart).
//! A client mount reads the file bytes the bucket already holds from the
//! bucket (through its chunk cache and these servers) after asking the
//! owner where they are: see [`branch::reads`].
//!
//! # Rooms
//!
//! - [`branch`]: a branch's owner ([`SharedBranch`]) and its client
//!   ([`BranchClient`]), with the journal, locks, reply cache, located
//!   reads and the owner's policy.
//! - [`cache`]: the chunk cache service ([`cache::server`]: chunk
//!   connections, the HTTP routes, `/metrics`), its client
//!   ([`CacheClient`]), the server's counters and the scope of imported
//!   objects it may fetch.
//! - [`wire`]: what both services put on the wire: framed connections
//!   ([`wire::frames`]: the frame, hello, chunk asks; a branch's requests
//!   and answers are [`branch::frames`], built on it), the HTTP routes' headers, windows and queries
//!   ([`wire::http`]), a connection's stream, plain or TLS
//!   ([`wire::stream`], [`wire::tls`]), admission before the hello
//!   ([`wire::admission`]).
//! - [`server`]: the listener; it tells framed connections from HTTP and
//!   hands chunks to the cache service and file operations to a branch.
//!
//! Imports between them (checked with `grep crate::`): `server` → `cache`,
//! `branch`, `wire`; `branch` → `wire` only; `cache` → `wire` only;
//! `wire` → nothing of `cache`, `branch` or `server`: no import runs from
//! the wire up into a service.

pub mod branch;
pub mod cache;
pub mod exporter;
pub mod server;
pub mod wire;

pub use branch::policy::Policy;
pub use branch::{BranchClient, BranchClientOptions, BranchClientStats, SharedBranch};
pub use cache::metrics::sample as metric_sample;
pub use cache::scope::ObjectScope;
pub use cache::{CacheClient, ClientOptions, ServerStats};
pub use server::{CacheServer, Fault, Running, ServerOptions};
pub use wire::admission::ConnLimits;
pub use wire::http::{CACHE_HEADER, CRC_HEADER};
pub use wire::tls::{ClientTls, ServerTls};

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("token file {path}: {cause}")]
    Token { path: String, cause: String },
    #[error("{what} {path}: {cause}")]
    Tls { what: &'static str, path: String, cause: String },
    #[error("{0}")]
    Config(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Checks that `addr` reads as `HOST:PORT` (a name or an address, a port
/// from 1 to 65535; an IPv6 address in brackets), without resolving it:
/// a typo is refused when it is given, not found as a server "down".
pub fn check_host_port(addr: &str) -> Result<(), Error> {
    let bad = || Error::Config(format!("{addr:?} is not HOST:PORT"));
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let host_ok = match host.strip_prefix('[') {
        Some(v6) => v6.strip_suffix(']').is_some_and(|a| a.parse::<std::net::Ipv6Addr>().is_ok()),
        None => !host.is_empty() && !host.contains(|c: char| c.is_whitespace() || c == '/' || c == ':'),
    };
    match port.parse::<u16>() {
        Ok(p) if p != 0 && host_ok => Ok(()),
        _ => Err(bad()),
    }
}

/// Reads a shared token: the file's first line, trimmed; it must not be
/// empty. A token file others can read is used, with a warning.
pub fn read_token(path: &Path) -> Result<String, Error> {
    let fail = |cause: String| Error::Token { path: path.display().to_string(), cause };
    let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
    let token = text.lines().next().unwrap_or("").trim().to_string();
    if token.is_empty() {
        return Err(fail("is empty; put a long random secret in it (e.g. openssl rand -hex 32)".into()));
    }
    use std::os::unix::fs::PermissionsExt;
    if let Ok(m) = std::fs::metadata(path) {
        if m.permissions().mode() & 0o077 != 0 {
            tracing::warn!(file = %path.display(), "the token file can be read by other users; chmod 600 it");
        }
    }
    Ok(token)
}

/// The `Authorization` header a client sends with `token`.
pub(crate) fn bearer(token: &str) -> Result<hyper::header::HeaderValue, Error> {
    hyper::header::HeaderValue::from_str(&format!("Bearer {token}"))
        .map_err(|_| Error::Config("the token must be printable ASCII".into()))
}

/// A client's own runtime: two threads named `name`.
pub(crate) fn client_runtime(name: &str) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).thread_name(name).enable_all().build()
}

/// Whether `got` is the `Authorization` header for `token`, compared in
/// constant time. An empty token (a server that takes client certificates
/// alone) matches nothing.
pub(crate) fn authorized(got: Option<&[u8]>, token: &str) -> bool {
    use subtle::ConstantTimeEq;
    if token.is_empty() {
        return false;
    }
    let want = format!("Bearer {token}");
    match got {
        Some(got) => bool::from(got.ct_eq(want.as_bytes())),
        None => false,
    }
}

/// Whether `got` is `token`, compared in constant time; an empty token
/// matches nothing.
pub(crate) fn token_matches(got: &[u8], token: &str) -> bool {
    use subtle::ConstantTimeEq;
    if token.is_empty() {
        return false;
    }
    bool::from(got.ct_eq(token.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_is_checked_without_resolving() {
        for good in ["127.0.0.1:7070", "cache-a:80", "cache-a.example.com:65535", "[::1]:7070"] {
            assert!(check_host_port(good).is_ok(), "{good}");
        }
        let bad = [
            "127.0.0.1:notaport",
            "cache-a",
            ":7070",
            "cache-a:0",
            "cache-a:70000",
            "[::1:7070",
            "a b:1",
            "http://a:1",
            "",
        ];
        for addr in bad {
            assert!(check_host_port(addr).is_err(), "{addr}");
        }
    }

    #[test]
    fn tokens_are_read_trimmed_and_must_not_be_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("t");
        std::fs::write(&f, "  s3cret \nignored\n").expect("write");
        assert_eq!(read_token(&f).expect("token"), "s3cret");
        std::fs::write(&f, "\n").expect("write");
        assert!(read_token(&f).is_err());
        assert!(read_token(&dir.path().join("missing")).is_err());
    }

    #[test]
    fn only_the_exact_bearer_token_is_authorized() {
        assert!(authorized(Some(b"Bearer abc"), "abc"));
        for bad in [&b"Bearer abd"[..], b"Bearer ab", b"abc", b"Bearer abcd", b""] {
            assert!(!authorized(Some(bad), "abc"), "{bad:?}");
        }
        assert!(!authorized(None, "abc"));
        assert!(!authorized(Some(b"Bearer "), ""), "an empty token matches nothing");
        assert!(!token_matches(b"", ""), "an empty token matches nothing");
    }
}
