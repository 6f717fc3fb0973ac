//! The HTTP side of the wire: the headers a chunk's answer carries, the
//! HTTP/2 windows both ends set, and the queries of the chunk and object
//! routes (`/v1/chunks/…`, `/v1/objects/…`), written by the cache client
//! and read by the server, and a client's HTTP/2 connection (`connect`:
//! the cache client's, and a branch client's event polls).

use arbor_engine::source::Source;
use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::time::Duration;

/// The header a server says whether a chunk was already cached in.
pub const CACHE_HEADER: &str = "x-arbor-cache";
/// The header with the crc32c (hex) of a source object's chunk a server
/// sends, taken before it left the server: a client gives up a chunk that
/// does not match. (A segment chunk has none: the client checks it against
/// its object's footer.)
pub const CRC_HEADER: &str = "x-arbor-crc32c";

/// HTTP/2 flow-control windows: a 1 MiB chunk must not wait for window
/// updates (the protocol's default stream window is 64 KiB).
pub(crate) const STREAM_WINDOW: u32 = 8 << 20;
pub(crate) const CONNECTION_WINDOW: u32 = 256 << 20;
pub(crate) const MAX_FRAME: u32 = 1 << 20;

/// The part of a chunk a `/v1/chunks/…?at=…&len=…` request asks for
/// (offsets inside the chunk); `None` for the whole chunk.
/// `&proved=1` asks for a proved part (see [`crate::wire::frames::ChunkAsk`]).
pub(crate) fn chunk_part(query: Option<&str>) -> Result<(Option<std::ops::Range<u64>>, bool), ()> {
    let Some(query) = query else { return Ok((None, false)) };
    let (mut at, mut len, mut proved) = (None, None, false);
    for (k, v) in form_urlencoded::parse(query.as_bytes()) {
        match &*k {
            "at" => at = Some(v.parse::<u64>().map_err(|_| ())?),
            "len" => len = Some(v.parse::<u64>().map_err(|_| ())?),
            "proved" if v == "1" => proved = true,
            _ => return Err(()),
        }
    }
    match (at, len) {
        (None, None) if !proved => Ok((None, false)),
        (Some(at), Some(len)) if len > 0 => Ok((Some(at..at.checked_add(len).ok_or(())?), proved)),
        _ => Err(()),
    }
}

/// The query that asks for bytes `within` of a chunk (`proved`: with the
/// chunk's leaf hashes).
pub(crate) fn part_query(within: &std::ops::Range<u64>, proved: bool) -> String {
    let proof = if proved { "&proved=1" } else { "" };
    format!("at={}&len={}{proof}", within.start, within.end - within.start)
}

/// The source object a `/v1/objects/…` request names in its query.
pub(crate) fn object_source(query: Option<&str>) -> Option<Source> {
    let (mut bucket, mut key, mut etag, mut size, mut version) = (None, None, None, None, None);
    for (k, v) in form_urlencoded::parse(query?.as_bytes()) {
        match &*k {
            "bucket" => bucket = Some(v.into_owned()),
            "key" => key = Some(v.into_owned()),
            "etag" => etag = Some(v.into_owned()),
            "size" => size = v.parse::<u64>().ok(),
            "version" => version = Some(v.into_owned()),
            _ => {}
        }
    }
    let src = Source { bucket: bucket?, key: key?, size: size?, etag: etag?, version };
    (!src.bucket.is_empty() && !src.key.is_empty()).then_some(src)
}

/// The query of a `/v1/objects/…` request for `src`.
pub(crate) fn object_query(src: &Source) -> String {
    form_urlencoded::Serializer::new(String::new())
        .append_pair("bucket", &src.bucket)
        .append_pair("key", &src.key)
        .append_pair("etag", &src.etag)
        .append_pair("size", &src.size.to_string())
        .extend_pairs(src.version.as_deref().map(|v| ("version", v)))
        .finish()
}

/// An HTTP/2 connection to `addr`, with windows sized for 1 MiB bodies
/// and pings that notice a peer gone silent (a partition, a dead host),
/// driven by a task of its own; inside TLS when `tls` is given (connected
/// and past the handshake within `timeout`).
pub(crate) async fn connect(
    addr: &str,
    timeout: Duration,
    tls: Option<&crate::wire::tls::ClientTls>,
) -> Result<SendRequest<Full<Bytes>>, String> {
    let attempt = async {
        let stream = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let _ = stream.set_nodelay(true);
        match tls {
            Some(tls) => handshake(addr, tls.connect(addr, stream).await.map_err(|e| e.to_string())?).await,
            None => handshake(addr, stream).await,
        }
    };
    tokio::time::timeout(timeout, attempt).await.map_err(|_| "connect timed out".to_string())?
}

/// HTTP/2 on `io`, a connection to `addr`.
async fn handshake<I>(addr: &str, io: I) -> Result<SendRequest<Full<Bytes>>, String>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (send, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .handshake(TokioIo::new(io))
        .await
        .map_err(|e| e.to_string())?;
    let addr = addr.to_string();
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(server = %addr, error = %e, "a connection ended");
        }
    });
    Ok(send)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_query_names_its_version_when_it_has_one() {
        let src = Source {
            bucket: "corpus".into(),
            key: "raw/a b&c=d.bin".into(),
            size: 12 << 20,
            etag: "\"5eb63bbbe01eeed093cb22bb8f5acdc3\"".into(),
            version: None,
        };
        let plain = object_query(&src);
        assert!(!plain.contains("version"), "{plain}");
        assert_eq!(object_source(Some(&plain)), Some(src.clone()));
        let versioned = Source { version: Some("2480dfda-651d+42a0/a493".into()), ..src };
        assert_eq!(object_source(Some(&object_query(&versioned))), Some(versioned.clone()));
        // Another version is another object: another id, so other chunks.
        assert_ne!(versioned.id(), Source { version: None, ..versioned.clone() }.id());
        for bad in ["", "bucket=corpus&key=a&etag=x", "bucket=&key=a&etag=x&size=1", "bucket=c&key=a&etag=x&size=-1"] {
            assert_eq!(object_source(Some(bad)), None, "{bad}");
        }
    }

    #[test]
    fn a_part_query_round_trips_and_nonsense_is_refused() {
        assert_eq!(chunk_part(None), Ok((None, false)));
        assert_eq!(chunk_part(Some("")), Ok((None, false)));
        let within = 4096..12_288;
        assert_eq!(chunk_part(Some(&part_query(&within, false))), Ok((Some(within.clone()), false)));
        assert_eq!(chunk_part(Some(&part_query(&within, true))), Ok((Some(within), true)));
        assert_eq!(chunk_part(Some("proved=1")), Err(()));
        for bad in ["at=1", "len=4", "at=1&len=0", "at=x&len=4", "at=1&len=4&what=2", "at=18446744073709551615&len=2"] {
            assert_eq!(chunk_part(Some(bad)), Err(()), "{bad}");
        }
    }
}
