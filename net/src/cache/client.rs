//! The client side of the shared cache: a [`ChunkSource`] a mount's
//! bucket tier (segment chunks) and its imported files (source object
//! chunks) ask before the bucket.
//!
//! Each chunk has one owner among the servers, by rendezvous (highest
//! random weight) hashing of (server address, segment, chunk): every
//! client with the same list agrees on the owner without talking to the
//! others, and adding a server moves only the chunks it now wins. The list
//! is fixed for the life of the mount. A server that is slow past the
//! timeout or answers with an error is skipped for that chunk — the reader
//! goes to the bucket; one that cannot be reached (or whose connection
//! breaks) is also left alone for [`DOWN_FOR`] before it is tried again.
//! Its chunks are never handed to another server.
//!
//! Segment chunks and their parts travel on chunk connections (see
//! [`crate::wire::frames`]): a small pool of blocking sockets per server, the
//! reading thread writing its asks and reading the answers itself.
//! Footers and source-object chunks, and everything with a server that
//! does not take chunk connections, go over one HTTP/2 connection per
//! server. [`CacheClient::set_framed`] sends everything over HTTP/2 (for
//! comparing the two).

use crate::wire::frames::ChunkAsk;
use crate::wire::http::{connect, CACHE_HEADER, CRC_HEADER};
use arbor_engine::chunks::{fnv1a, ChunkRequest, ChunkSource};
use arbor_engine::format::SegId;
use arbor_engine::metrics::Counter;
use arbor_engine::source::Source;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper::header::{HeaderValue, AUTHORIZATION};
use hyper::{Request, StatusCode};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a server that failed is skipped before it is tried again.
pub const DOWN_FOR: Duration = Duration::from_secs(2);
/// How long a chunk request may take before the reader goes to the bucket.
pub const TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// `host:port` of each server, the same list (in any order) on every
    /// client so that they agree on each chunk's owner.
    pub servers: Vec<String>,
    pub token: String,
    /// How long one chunk request may take.
    pub timeout: Duration,
    /// Speak TLS to every server, trusting it this way (never clear text).
    pub tls: Option<crate::wire::tls::ClientTls>,
}

arbor_engine::counters! {
    /// What one server gave this client, counted as it happens.
    struct Counters;
    /// What one server gave this client, and why it was passed over.
    #[derive(PartialEq, Eq)]
    pub struct ServerStats {
        /// Chunks and bytes it answered (before the client's checks).
        chunks: Counter,
        bytes: Counter,
        /// Of those, how many it had cached already, and how many were parts
        /// of chunks (for small reads).
        hits: Counter,
        parts: Counter,
        /// Segment footers it gave (each saving two trips to the bucket).
        footers: Counter,
        /// Chunks read from the bucket instead, by reason.
        fallback_down: Counter,
        fallback_timeout: Counter,
        fallback_error: Counter,
        fallback_not_found: Counter,
        /// Chunks it gave that failed their checksum (read from the bucket).
        rejected: Counter,
        /// Requests it refused for want of a valid token.
        unauthorized: Counter,
    } and {
        addr: String,
    }
}

/// What a request asks a server for, for its counters.
#[derive(Clone, Copy)]
enum Ask {
    Chunk,
    Part,
    Footer,
}

struct Peer {
    addr: String,
    /// FNV-1a of the address, the server's part of every chunk's score.
    seed: u64,
    conn: tokio::sync::Mutex<Option<SendRequest<Full<Bytes>>>>,
    /// Idle chunk connections (see [`Inner::framed`]).
    chunk_conns: Mutex<Vec<ChunkConn>>,
    /// Cleared when the server does not take chunk connections (an older
    /// one): its chunks and parts then go over HTTP/2.
    takes_chunk_conns: AtomicBool,
    down_until: Mutex<Option<Instant>>,
    n: Counters,
}

/// A chunk connection: a framed connection whose Hello names no branch,
/// answering [`ChunkAsk`]s one at a time.
struct ChunkConn {
    stream: crate::wire::stream::Stream,
    rbuf: Vec<u8>,
    wbuf: Vec<u8>,
}

/// Idle chunk connections kept per server; more are closed after use.
const IDLE_CHUNK_CONNS: usize = 16;

struct Inner {
    peers: Vec<Peer>,
    auth: HeaderValue,
    token: Vec<u8>,
    timeout: Duration,
    tls: Option<crate::wire::tls::ClientTls>,
}

pub struct CacheClient {
    inner: Arc<Inner>,
    rt: tokio::runtime::Runtime,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The weight of server `seed` for chunk `index` of `seg`: the highest wins.
fn score(seed: u64, seg: SegId, index: u32) -> u64 {
    splitmix(seed ^ splitmix(seg.writer ^ splitmix(((seg.seq as u64) << 32) | index as u64)))
}

/// The weight of server `seed` for chunk `index` of the source object
/// whose [`Source::id`] hashes to `object`.
fn object_score(seed: u64, object: u64, index: u64) -> u64 {
    splitmix(seed ^ splitmix(object ^ splitmix(index)))
}

impl CacheClient {
    pub fn new(opts: ClientOptions) -> Result<CacheClient, crate::Error> {
        if opts.servers.is_empty() {
            return Err(crate::Error::Config("no cache servers given".into()));
        }
        let mut peers: Vec<Peer> = Vec::new();
        for addr in &opts.servers {
            let addr = addr.trim().to_string();
            crate::check_host_port(&addr).map_err(|e| crate::Error::Config(format!("cache server {e}")))?;
            if peers.iter().any(|p| p.addr == addr) {
                continue;
            }
            peers.push(Peer {
                seed: fnv1a(addr.as_bytes()),
                addr,
                conn: tokio::sync::Mutex::new(None),
                chunk_conns: Mutex::new(Vec::new()),
                takes_chunk_conns: AtomicBool::new(true),
                down_until: Mutex::new(None),
                n: Counters::default(),
            });
        }
        let auth = crate::bearer(&opts.token)?;
        let rt = crate::client_runtime("arbor-cache-client")?;
        let token = opts.token.as_bytes().to_vec();
        let inner = Inner { peers, auth, token, timeout: opts.timeout, tls: opts.tls };
        Ok(CacheClient { inner: Arc::new(inner), rt })
    }

    /// Whether segment chunks and their parts go over chunk connections
    /// (the default) or over HTTP/2 (`false`), for comparing the two.
    pub fn set_framed(&self, on: bool) {
        for p in &self.inner.peers {
            p.takes_chunk_conns.store(on, Ordering::Relaxed);
        }
    }

    /// The index of the server that owns chunk `index` of `seg`.
    pub fn owner(&self, seg: SegId, index: u32) -> usize {
        self.inner.owner(seg, index)
    }

    /// Asks every server whether it answers and takes our token (`GET
    /// /v1/health`, within `timeout`), counting nothing: per server, `None`
    /// when it does, or what is wrong. For a command to say at once that a
    /// server is unreachable or has another token, instead of its chunks
    /// quietly coming from the bucket.
    pub fn check(&self, timeout: Duration) -> Vec<(String, Option<String>)> {
        let inner = self.inner.clone();
        self.rt.block_on(async move {
            let asks: Vec<_> = (0..inner.peers.len())
                .map(|i| {
                    let inner = inner.clone();
                    tokio::spawn(async move {
                        let addr = inner.peers[i].addr.clone();
                        let attempt = async {
                            let mut send = connect(&addr, timeout, inner.tls.as_ref()).await?;
                            let req = Request::get(format!("http://{addr}/v1/health"))
                                .header(AUTHORIZATION, inner.auth.clone())
                                .body(Full::new(Bytes::new()))
                                .map_err(|e| e.to_string())?;
                            let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
                            Ok::<_, String>(resp.status())
                        };
                        match tokio::time::timeout(timeout, attempt).await {
                            Ok(Ok(StatusCode::OK)) => None,
                            Ok(Ok(StatusCode::UNAUTHORIZED)) => Some("refused our token (check --token-file)".into()),
                            Ok(Ok(status)) => Some(format!("answered {status}")),
                            Ok(Err(_)) if inner.tls.is_none() && speaks_tls(&addr, timeout).await => {
                                Some("speaks TLS: give --tls-ca or --tls-fingerprint".into())
                            }
                            Ok(Err(e)) => Some(format!("not reachable: {e}")),
                            Err(_) => Some(format!("no answer within {} ms", timeout.as_millis())),
                        }
                    })
                })
                .collect();
            let mut out = Vec::with_capacity(asks.len());
            for (i, a) in asks.into_iter().enumerate() {
                let problem = a.await.unwrap_or_else(|e| Some(e.to_string()));
                out.push((inner.peers[i].addr.clone(), problem));
            }
            out
        })
    }

    /// Per server: what it gave and why it was passed over.
    pub fn stats(&self) -> Vec<ServerStats> {
        self.inner.peers.iter().map(|p| ServerStats { addr: p.addr.clone(), ..p.n.snapshot() }).collect()
    }
}

impl Inner {
    /// The server with the highest `score`.
    fn highest(&self, score: impl Fn(u64) -> u64) -> usize {
        let mut best = (0, 0);
        for (i, p) in self.peers.iter().enumerate() {
            let s = score(p.seed);
            if i == 0 || s > best.1 {
                best = (i, s);
            }
        }
        best.0
    }

    fn owner(&self, seg: SegId, index: u32) -> usize {
        self.highest(|seed| score(seed, seg, index))
    }

    /// The server that owns a segment's footer: the owner of a chunk
    /// index no segment has, so footers spread like chunks.
    fn footer_owner(&self, seg: SegId) -> usize {
        self.owner(seg, u32::MAX)
    }

    fn object_owner(&self, object: u64, index: u64) -> usize {
        self.highest(|seed| object_score(seed, object, index))
    }

    /// Asks server `owner` for the chunk at `path`: its bytes, if it gave
    /// them and they match the checksum it sent.
    async fn get(self: Arc<Self>, owner: usize, path: String, ask: Ask) -> Option<Vec<u8>> {
        let peer = &self.peers[owner];
        if peer.down_until.lock().is_some_and(|t| Instant::now() < t) {
            peer.n.fallback_down.inc();
            return None;
        }
        let uri = format!("http://{}{path}", peer.addr);
        // A server that cannot be reached is left alone for a while; one
        // that is slow or answers an error loses only this chunk.
        let mut send = match peer.sender(self.timeout, self.tls.as_ref()).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(server = %peer.addr, error = %e, "a cache server is unreachable");
                peer.n.fallback_error.inc();
                peer.failed().await;
                return None;
            }
        };
        let attempt = async {
            let req = Request::get(uri)
                .header(AUTHORIZATION, self.auth.clone())
                .body(Full::new(Bytes::new()))
                .map_err(|e| e.to_string())?;
            let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
            let status = resp.status();
            let hit = resp.headers().get(CACHE_HEADER).is_some_and(|v| v.as_bytes() == b"hit");
            let crc = resp
                .headers()
                .get(CRC_HEADER)
                .map(|v| std::str::from_utf8(v.as_bytes()).ok().and_then(|v| u32::from_str_radix(v, 16).ok()));
            let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
            Ok::<_, String>((status, hit, crc, body))
        };
        match tokio::time::timeout(self.timeout, attempt).await {
            Ok(Ok((StatusCode::OK, hit, crc, body))) => {
                peer.gave(ask, body.len(), hit);
                // A checksum that is there must be right (a server that
                // sends none is checked by the caller alone).
                if crc.is_some_and(|crc| crc != Some(arbor_engine::crc::crc32c(&body))) {
                    tracing::warn!(server = %peer.addr, chunk = %path, "a cache server sent a chunk that fails its checksum; reading the bucket");
                    peer.n.rejected.inc();
                    return None;
                }
                Some(Vec::from(body))
            }
            Ok(Ok((StatusCode::NOT_FOUND, ..))) => {
                peer.n.fallback_not_found.inc();
                None
            }
            Ok(Ok((StatusCode::UNAUTHORIZED, ..))) => {
                peer.refused();
                peer.n.fallback_error.inc();
                None
            }
            Ok(Ok((status, ..))) => {
                tracing::debug!(server = %peer.addr, %status, "a cache server answered with an error");
                peer.n.fallback_error.inc();
                None
            }
            Ok(Err(e)) => {
                tracing::debug!(server = %peer.addr, error = %e, "the connection to a cache server broke");
                peer.n.fallback_error.inc();
                peer.failed().await;
                None
            }
            Err(_) => {
                tracing::debug!(server = %peer.addr, chunk = %path, "a cache server was too slow; reading the bucket");
                peer.n.fallback_timeout.inc();
                None
            }
        }
    }
}

impl Peer {
    /// Counts what this server gave for `ask`: `len` bytes, a hit or not.
    fn gave(&self, ask: Ask, len: usize, hit: bool) {
        match ask {
            Ask::Chunk => self.n.chunks.inc(),
            Ask::Part => {
                self.n.parts.inc();
                self.n.chunks.inc();
            }
            Ask::Footer => self.n.footers.inc(),
        }
        self.n.bytes.add(len as u64);
        if hit {
            self.n.hits.inc();
        }
    }

    /// The server refused our token. Misconfigured, not busy: said once,
    /// and the server left alone for a while instead of paying a round
    /// trip per chunk (the caller counts the chunks as errors).
    fn refused(&self) {
        if self.n.unauthorized.inc_is_first() {
            tracing::warn!(server = %self.addr, "the cache server refused our token; reading from the bucket (check --token-file)");
        }
        *self.down_until.lock() = Some(Instant::now() + DOWN_FOR);
    }

    /// The connection to this server, made anew when there is none.
    async fn sender(
        &self,
        timeout: Duration,
        tls: Option<&crate::wire::tls::ClientTls>,
    ) -> Result<SendRequest<Full<Bytes>>, String> {
        let mut conn = self.conn.lock().await;
        if let Some(s) = conn.as_ref() {
            if !s.is_closed() {
                return Ok(s.clone());
            }
        }
        let send = connect(&self.addr, timeout, tls).await?;
        *conn = Some(send.clone());
        Ok(send)
    }

    /// Drops the connection and leaves the server alone for a while.
    async fn failed(&self) {
        *self.down_until.lock() = Some(Instant::now() + DOWN_FOR);
        *self.conn.lock().await = None;
        self.chunk_conns.lock().clear();
    }
}

/// Whether the server at `addr` answers clear text with a TLS alert
/// record (content type 21, version 3.x): a server that speaks TLS.
async fn speaks_tls(addr: &str, timeout: Duration) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let probe = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await?;
        let mut head = [0u8; 2];
        s.read_exact(&mut head).await?;
        Ok::<_, std::io::Error>(head == [0x15, 0x03])
    };
    matches!(tokio::time::timeout(timeout, probe).await, Ok(Ok(true)))
}

impl CacheClient {
    /// Bytes `within` of chunk `index` of `seg` from the server that holds
    /// it; `proved`: with the chunk's leaf hashes after them.
    fn part(&self, seg: SegId, index: u32, within: std::ops::Range<u64>, proved: bool) -> Option<Vec<u8>> {
        let owner = self.inner.owner(seg, index);
        if self.inner.peers[owner].takes_chunk_conns.load(Ordering::Relaxed) {
            let len = u32::try_from(within.end.saturating_sub(within.start)).ok()?;
            let ask = ChunkAsk { seg, index, part: Some((within.start, len)), proved };
            let mut part = None;
            if self.inner.framed(owner, &[ask], Ask::Part, &mut |_, bytes| part = bytes) {
                return part;
            }
        }
        let path = format!("/v1/chunks/{}/{index}?{}", seg.file_name(), crate::wire::http::part_query(&within, proved));
        self.rt.block_on(self.inner.clone().get(owner, path, Ask::Part))
    }
}

impl ChunkSource for CacheClient {
    fn fetch(&self, seg: SegId, wanted: &[ChunkRequest]) -> Vec<Option<Vec<u8>>> {
        let inner = &self.inner;
        let mut out = vec![None; wanted.len()];
        if inner.fetch_framed(seg, wanted, &mut |k, bytes| out[k] = bytes) {
            return out;
        }
        self.rt.block_on(async {
            let asks = wanted.iter().map(|w| {
                let path = format!("/v1/chunks/{}/{}", seg.file_name(), w.index);
                (inner.owner(seg, w.index), path)
            });
            inner.clone().get_all(asks.collect()).await
        })
    }

    fn fetch_each(&self, seg: SegId, wanted: &[ChunkRequest], got: &mut dyn FnMut(usize, Option<Vec<u8>>)) {
        if !self.inner.fetch_framed(seg, wanted, got) {
            for (k, bytes) in self.fetch(seg, wanted).into_iter().enumerate() {
                got(k, bytes);
            }
        }
    }

    fn rejected(&self, seg: SegId, index: u32) {
        let peer = &self.inner.peers[self.inner.owner(seg, index)];
        peer.n.rejected.inc();
    }

    fn fetch_footer(&self, seg: SegId) -> Option<Vec<u8>> {
        let owner = self.inner.footer_owner(seg);
        self.rt.block_on(self.inner.clone().get(owner, format!("/v1/footers/{}", seg.file_name()), Ask::Footer))
    }

    fn footer_rejected(&self, seg: SegId) {
        self.inner.peers[self.inner.footer_owner(seg)].n.rejected.inc();
    }

    fn fetch_part(&self, seg: SegId, index: u32, within: std::ops::Range<u64>) -> Option<Vec<u8>> {
        self.part(seg, index, within, false)
    }

    fn fetch_proved_part(&self, seg: SegId, index: u32, leaves: std::ops::Range<u64>) -> Option<Vec<u8>> {
        self.part(seg, index, leaves, true)
    }

    fn fetch_object(&self, src: &Source, wanted: &[u64]) -> Vec<Option<Vec<u8>>> {
        let inner = &self.inner;
        let query = crate::wire::http::object_query(src);
        let object = fnv1a(src.id().as_bytes());
        self.rt.block_on(async {
            let asks = wanted.iter().map(|&i| (inner.object_owner(object, i), format!("/v1/objects/{i}?{query}")));
            inner.clone().get_all(asks.collect()).await
        })
    }

    fn object_rejected(&self, src: &Source, index: u64) {
        let peer = &self.inner.peers[self.inner.object_owner(fnv1a(src.id().as_bytes()), index)];
        peer.n.rejected.inc();
    }
}

/// Why a chunk connection could not be opened.
enum ChunkConnError {
    /// The server does not take chunk connections.
    Unsupported,
    /// It refused our token.
    Refused,
    /// It took the connection and did not answer its Hello in time.
    Slow,
    Io(std::io::Error),
}

impl Inner {
    /// `asks` (parts or whole chunks of `seg`) of server `owner`, over a
    /// chunk connection: the calling thread writes every request and then
    /// reads the answers, in order, itself, handing each to `got` (its
    /// number in `asks`, and the bytes or `None`) as it comes; the server
    /// answers on a thread of the connection's own. A part costs the round
    /// trip and two wake-ups — the HTTP/2 path hands each request between
    /// four tasks and threads, which on a few busy cores was most of a
    /// 4 KiB read's latency — and a chunk's bytes are read from the socket
    /// straight into the buffer handed on. Counted as the HTTP path
    /// counts. False, and nothing handed to `got`: the server does not
    /// take chunk connections (ask it over HTTP).
    fn framed(&self, owner: usize, asks: &[ChunkAsk], ask: Ask, got: &mut dyn FnMut(usize, Option<Vec<u8>>)) -> bool {
        use crate::wire::frames::{read_chunk_answer, write_frame};
        let peer = &self.peers[owner];
        // The asks from `from` on get nothing: counted under `counter`.
        let fail = |from: usize, counter: &Counter, down: bool, got: &mut dyn FnMut(usize, Option<Vec<u8>>)| {
            counter.add((asks.len() - from) as u64);
            if down {
                *peer.down_until.lock() = Some(Instant::now() + DOWN_FOR);
                peer.chunk_conns.lock().clear();
            }
            for k in from..asks.len() {
                got(k, None);
            }
            true
        };
        if peer.down_until.lock().is_some_and(|t| Instant::now() < t) {
            return fail(0, &peer.n.fallback_down, false, got);
        }
        // A connection kept idle may have been closed by a server that
        // restarted since: such a failure, before any answer, is tried
        // once more on a new one.
        for _ in 0..2 {
            let pooled = peer.chunk_conns.lock().pop();
            let reused = pooled.is_some();
            let mut c = match pooled.map_or_else(|| self.connect_framed(peer), Ok) {
                Ok(c) => c,
                Err(ChunkConnError::Unsupported) => {
                    peer.takes_chunk_conns.store(false, Ordering::Relaxed);
                    return false;
                }
                Err(ChunkConnError::Refused) => {
                    peer.refused();
                    return fail(0, &peer.n.fallback_error, false, got);
                }
                Err(ChunkConnError::Slow) => {
                    tracing::debug!(server = %peer.addr, "a cache server did not answer in time; reading the bucket");
                    return fail(0, &peer.n.fallback_timeout, false, got);
                }
                Err(ChunkConnError::Io(e)) => {
                    tracing::debug!(server = %peer.addr, error = %e, "a cache server is unreachable");
                    return fail(0, &peer.n.fallback_error, true, got);
                }
            };
            let mut sent = Ok(());
            for a in asks {
                sent = sent.and_then(|()| write_frame(&mut c.stream, &mut c.wbuf, a));
            }
            let mut answered = 0;
            let mut broke = sent.err();
            while broke.is_none() && answered < asks.len() {
                match read_chunk_answer(&mut c.stream, &mut c.rbuf) {
                    Ok(a) => {
                        got(answered, self.counted(peer, a, ask));
                        answered += 1;
                    }
                    Err(e) => broke = Some(e),
                }
            }
            match broke {
                None => {
                    let mut idle = peer.chunk_conns.lock();
                    if idle.len() < IDLE_CHUNK_CONNS {
                        idle.push(c);
                    }
                    return true;
                }
                Some(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    tracing::debug!(server = %peer.addr, seg = %asks[0].seg, "a cache server was too slow; reading the bucket");
                    return fail(answered, &peer.n.fallback_timeout, false, got);
                }
                Some(_) if reused && answered == 0 => continue,
                Some(e) => {
                    tracing::debug!(server = %peer.addr, error = %e, "the connection to a cache server broke");
                    return fail(answered, &peer.n.fallback_error, true, got);
                }
            }
        }
        // Both tries failed on connections that broke.
        fail(0, &peer.n.fallback_error, true, got)
    }

    /// The bytes of one answer from `peer`, counted.
    fn counted(&self, peer: &Peer, answer: crate::wire::frames::ChunkAnswer, ask: Ask) -> Option<Vec<u8>> {
        use crate::wire::frames::ChunkAnswer;
        match answer {
            ChunkAnswer::Bytes { hit, bytes } => {
                peer.gave(ask, bytes.len(), hit);
                Some(bytes)
            }
            ChunkAnswer::NotFound => {
                peer.n.fallback_not_found.inc();
                None
            }
            ChunkAnswer::Failed(why) => {
                tracing::debug!(server = %peer.addr, error = %why, "a cache server answered with an error");
                peer.n.fallback_error.inc();
                None
            }
        }
    }

    /// The chunks `wanted` of `seg` over chunk connections, each handed to
    /// `got` as it comes (its number in `wanted`, and the bytes or `None`):
    /// each owner's share asked on one connection, the owners at once (a
    /// thread each beyond the first, their chunks handed on when all are
    /// in). False, and nothing handed on: an owner does not take chunk
    /// connections (ask over HTTP).
    fn fetch_framed(&self, seg: SegId, wanted: &[ChunkRequest], got: &mut dyn FnMut(usize, Option<Vec<u8>>)) -> bool {
        let mut shares: Vec<(usize, Vec<usize>)> = Vec::new();
        for (k, w) in wanted.iter().enumerate() {
            let owner = self.owner(seg, w.index);
            if !self.peers[owner].takes_chunk_conns.load(Ordering::Relaxed) {
                return false;
            }
            match shares.iter_mut().find(|s| s.0 == owner) {
                Some(s) => s.1.push(k),
                None => shares.push((owner, vec![k])),
            }
        }
        let asks_of = |ks: &[usize]| -> Vec<ChunkAsk> {
            ks.iter().map(|&k| ChunkAsk { seg, index: wanted[k].index, part: None, proved: false }).collect()
        };
        if let [(owner, ks)] = shares.as_slice() {
            return self.framed(*owner, &asks_of(ks), Ask::Chunk, &mut |n, bytes| got(ks[n], bytes));
        }
        let answers: Vec<Option<Vec<Option<Vec<u8>>>>> = std::thread::scope(|s| {
            let handles: Vec<_> = shares
                .iter()
                .map(|(owner, ks)| {
                    let asks = asks_of(ks);
                    s.spawn(move || {
                        let mut out = vec![None; asks.len()];
                        self.framed(*owner, &asks, Ask::Chunk, &mut |n, bytes| out[n] = bytes).then_some(out)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().ok().flatten()).collect()
        });
        if answers.iter().any(Option::is_none) {
            return false;
        }
        for ((_, ks), share) in shares.iter().zip(answers) {
            for (&k, bytes) in ks.iter().zip(share.into_iter().flatten()) {
                got(k, bytes);
            }
        }
        true
    }

    /// A new chunk connection to `peer`, its Hello answered; every read
    /// and write on it bounded by the timeout.
    fn connect_framed(&self, peer: &Peer) -> Result<ChunkConn, ChunkConnError> {
        use crate::wire::frames::{read_welcome, write_hello, Hello, Welcome, MAGIC, VERSION};
        use std::io::Write;
        let io = ChunkConnError::Io;
        let stream = crate::wire::stream::Stream::dial(&peer.addr, self.timeout, self.tls.as_ref()).map_err(io)?;
        stream.tcp().set_read_timeout(Some(self.timeout)).map_err(io)?;
        stream.tcp().set_write_timeout(Some(self.timeout)).map_err(io)?;
        let mut c = ChunkConn { stream, rbuf: Vec::new(), wbuf: Vec::new() };
        let hello = Hello { version: VERSION, token: self.token.clone(), branch: String::new() };
        // The magic and the Hello in one write: the server sorts its
        // connections by their first bytes.
        let mut first = MAGIC.to_vec();
        write_hello(&mut first, &mut c.wbuf, &hello).map_err(io)?;
        c.stream.write_all(&first).map_err(io)?;
        let welcome = read_welcome(&mut c.stream, &mut c.rbuf).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => ChunkConnError::Slow,
            _ => io(e),
        });
        match welcome? {
            Welcome::Ok => Ok(c),
            Welcome::Refused => Err(ChunkConnError::Refused),
            Welcome::NoBranch | Welcome::Version(_) => Err(ChunkConnError::Unsupported),
        }
    }
}

impl Inner {
    /// Each (server, path) of `asks` at once; the answers in order.
    async fn get_all(self: Arc<Self>, asks: Vec<(usize, String)>) -> Vec<Option<Vec<u8>>> {
        let tasks: Vec<_> =
            asks.into_iter().map(|(owner, path)| tokio::spawn(self.clone().get(owner, path, Ask::Chunk))).collect();
        let mut out = Vec::with_capacity(tasks.len());
        for t in tasks {
            out.push(t.await.ok().flatten());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(servers: &[&str]) -> CacheClient {
        CacheClient::new(ClientOptions {
            servers: servers.iter().map(|s| s.to_string()).collect(),
            token: "t".into(),
            timeout: TIMEOUT,
            tls: None,
        })
        .expect("client")
    }

    #[test]
    fn owners_spread_evenly_and_a_new_server_takes_only_its_share() {
        let three = client(&["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"]);
        let four = client(&["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000", "10.0.0.4:7000"]);
        let mut per = [0usize; 3];
        let (mut moved, n) = (0, 30_000u32);
        for i in 0..n {
            let seg = SegId { writer: 0xfeed + (i / 100) as u64, seq: i % 7 };
            let (a, b) = (three.owner(seg, i % 100), four.owner(seg, i % 100));
            per[a] += 1;
            if a != b {
                assert_eq!(b, 3, "a chunk moves only to the new server");
                moved += 1;
            }
        }
        for c in per {
            assert!((9_000..11_000).contains(&c), "an even spread: {per:?}");
        }
        assert!((6_500..8_500).contains(&moved), "about a quarter moves: {moved}");
        let reordered = client(&["10.0.0.3:7000", "10.0.0.1:7000", "10.0.0.2:7000"]);
        let seg = SegId { writer: 1, seq: 2 };
        for i in 0..100 {
            assert_eq!(
                three.inner.peers[three.owner(seg, i)].addr,
                reordered.inner.peers[reordered.owner(seg, i)].addr,
                "the order of the list does not matter"
            );
        }
    }

    #[test]
    fn a_server_that_never_answers_costs_one_timeout_per_chunk() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        // Accepts, keeps the connection open, and says nothing.
        let held = std::thread::spawn(move || listener.accept().map(|(s, _)| s));
        let c = CacheClient::new(ClientOptions {
            servers: vec![addr],
            token: "t".into(),
            timeout: Duration::from_millis(300),
            tls: None,
        })
        .expect("client");
        let t = Instant::now();
        let got = c.fetch(SegId { writer: 9, seq: 1 }, &[ChunkRequest { index: 0, range: 0..10 }]);
        assert_eq!(got, vec![None]);
        assert!(t.elapsed() < Duration::from_secs(5), "bounded by the timeout: {:?}", t.elapsed());
        let s = &c.stats()[0];
        assert_eq!((s.fallback_timeout, s.fallback_down, s.chunks), (1, 0, 0), "{s:?}");
        drop(held);
    }

    #[test]
    fn a_server_that_is_not_there_gives_nothing_quickly_and_is_counted() {
        // A port nothing listens on: bind one, then close it.
        let port = arbor_engine::testkit::free_port().expect("free port");
        let c = client(&[&format!("127.0.0.1:{port}")]);
        let seg = SegId { writer: 1, seq: 1 };
        let got = c.fetch(seg, &[ChunkRequest { index: 0, range: 0..10 }, ChunkRequest { index: 1, range: 10..20 }]);
        assert_eq!(got, vec![None, None]);
        let s = &c.stats()[0];
        assert_eq!(s.fallback_error + s.fallback_down, 2, "{s:?}");
        assert_eq!(s.chunks, 0);
        assert!(CacheClient::new(ClientOptions { servers: vec![], token: "t".into(), timeout: TIMEOUT, tls: None })
            .is_err());
        assert!(CacheClient::new(ClientOptions {
            servers: vec!["nohost".into()],
            token: "t".into(),
            timeout: TIMEOUT,
            tls: None,
        })
        .is_err());
    }
}
