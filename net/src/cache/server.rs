//! The chunk cache service of `arbor serve`: answers chunk requests from a
//! [`SegmentCache`] on chunk connections (framed, see
//! [`crate::wire::frames`]) and over HTTP/2 (and HTTP/1.1: footers, source
//! objects, `/metrics`), sending cached chunks with `sendfile`, and the
//! fault switch tests use.
//!
//! It is handed its connections and requests by the listener
//! (`server`, above this room) once they are admitted and authorized; it knows
//! nothing of a branch.

use crate::cache::metrics::{CacheGauges, Metrics};
use crate::cache::scope::ObjectScope;
use crate::wire::admission::Admission;
use crate::wire::http::{chunk_part, object_source, CACHE_HEADER, CRC_HEADER};
use crate::wire::stream::Stream;
use arbor_engine::format::SegId;
use arbor_engine::source::SourceReader;
use arbor_engine::tier::SegmentCache;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::CONTENT_TYPE;
use hyper::{Request, Response, StatusCode};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// A deliberate misbehaviour, for tests of the clients' checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Every chunk served has one byte flipped.
    Corrupt,
    /// Every chunk served is cut to half its length.
    Short,
}
impl std::str::FromStr for Fault {
    type Err = String;
    fn from_str(s: &str) -> Result<Fault, String> {
        match s {
            "corrupt" => Ok(Fault::Corrupt),
            "short" => Ok(Fault::Short),
            _ => Err(format!("{s:?}: a fault is corrupt or short")),
        }
    }
}

/// What a chunk request found: the bytes and whether they were cached
/// already (`None`: not a chunk, a footer), or no such chunk.
type Found = arbor_engine::Result<Option<(Vec<u8>, Option<bool>)>>;

/// The smallest answer a chunk connection sends with `sendfile` (smaller
/// ones are read and written: two system calls cost more than the copy).
const SEND_FILE_MIN: usize = 64 << 10;

/// How long a chunk connection's write may wait for a client that stopped
/// reading, and how long one chunk's head and `sendfile` may take in all
/// (give or take one write's wait: at most twice this), before the
/// connection is dropped: a `sendfile` from the cache
/// holds the cache's reader lock, which every eviction that punches (and
/// so, behind it, every other reader) waits for. Five times a client's own
/// timeout ([`super::client::TIMEOUT`]).
const SEND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// What a chunk request comes to, on either transport.
enum Served {
    /// The bytes; whether they were cached already (`None`: a footer);
    /// their crc32c when asked for.
    Bytes {
        bytes: Vec<u8>,
        hit: Option<bool>,
        crc: Option<u32>,
    },
    NotFound,
    /// A source object changed since it was imported.
    Conflict(String),
    /// Could not be fetched (the bucket failed).
    Failed(String),
    /// The server broke while looking.
    Broken(String),
}

/// The chunk cache service: chunks, footers and source objects from a
/// [`SegmentCache`] on chunk connections and over HTTP, counted in its
/// [`Metrics`], with the fault switch applied.
pub(crate) struct ChunkService {
    /// `None`: a server of shared branches on a local-folder disk, which
    /// has no bucket to cache.
    pub(crate) cache: Option<Arc<SegmentCache>>,
    fault: Option<Fault>,
    objects: Option<Arc<SourceReader>>,
    object_scope: Option<Arc<ObjectScope>>,
    pub(crate) metrics: Metrics,
    /// The server's connections, for the open-connections gauge.
    admission: Arc<Admission>,
}

pub(crate) type Reply = Response<Full<Bytes>>;

/// Every quarter of `keep_for` (from 0.1 s to a minute) reads the cache's
/// clock, and evicts what was not used since the reading `keep_for` ago.
/// Runs until the runtime stops.
pub(crate) async fn keep_only_recent(cache: Arc<SegmentCache>, keep_for: std::time::Duration) {
    use std::time::Duration;
    let step = (keep_for / 4).clamp(Duration::from_millis(100), Duration::from_secs(60));
    let mut readings: std::collections::VecDeque<(Instant, u64)> = std::collections::VecDeque::new();
    loop {
        tokio::time::sleep(step).await;
        let now = Instant::now();
        readings.push_back((now, cache.clock()));
        let mut cut = None;
        while let Some(&(at, tick)) = readings.front() {
            if now.duration_since(at) < keep_for {
                break;
            }
            cut = Some(tick);
            readings.pop_front();
        }
        if let Some(tick) = cut {
            let cache = cache.clone();
            let _ = tokio::task::spawn_blocking(move || cache.evict_unused_since(tick)).await;
        }
    }
}

pub(crate) fn reply(status: StatusCode, body: impl Into<Bytes>) -> Reply {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r
}

impl ChunkService {
    pub(crate) fn new(
        cache: Option<Arc<SegmentCache>>,
        fault: Option<Fault>,
        objects: Option<Arc<SourceReader>>,
        object_scope: Option<Arc<ObjectScope>>,
        admission: Arc<Admission>,
    ) -> ChunkService {
        ChunkService { cache, fault, objects, object_scope, metrics: Metrics::default(), admission }
    }

    /// Answers the [`ChunkAsk`](crate::wire::frames::ChunkAsk)s of one chunk connection, each on this
    /// thread, until it closes.
    pub(crate) fn chunk_connection(
        &self,
        mut stream: Stream,
        mut rbuf: Vec<u8>,
        mut wbuf: Vec<u8>,
        idle: &std::sync::atomic::AtomicBool,
    ) -> std::io::Result<()> {
        use crate::wire::frames::{read_frame, write_chunk_answer, ChunkAnswer, ChunkAsk};
        stream.tcp().set_write_timeout(Some(SEND_TIMEOUT))?;
        loop {
            idle.store(true, Ordering::Release);
            stream.wait_readable()?;
            idle.store(false, Ordering::Release);
            let ask: ChunkAsk = match read_frame(&mut stream, &mut rbuf) {
                Ok(r) => r,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            };
            // The asks a client sent together (a run of read-ahead) are
            // taken together: those not cached are fetched from the bucket
            // at once, a thread each, not one after another; the cached
            // ones are read here; all are answered in order.
            let mut asks = vec![ask];
            for _ in 1..crate::wire::frames::MAX_PIPELINED {
                if !stream.frame_waiting() {
                    break;
                }
                asks.push(read_frame(&mut stream, &mut rbuf)?);
            }
            let mut answers: Vec<Option<ChunkAnswer>> = vec![None; asks.len()];
            let held = |a: &ChunkAsk| self.cache.as_ref().is_some_and(|c| c.holds(a.seg, a.index));
            let missing: Vec<usize> = (0..asks.len()).filter(|&k| !held(&asks[k])).collect();
            if missing.len() > 1 {
                let fetched: Vec<ChunkAnswer> = std::thread::scope(|s| {
                    let handles: Vec<_> = missing
                        .iter()
                        .map(|&k| {
                            let ask = asks[k];
                            s.spawn(move || self.part(ask))
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().unwrap_or_else(|_| ChunkAnswer::Failed("a fetch failed".into())))
                        .collect()
                });
                for (&k, a) in missing.iter().zip(fetched) {
                    answers[k] = Some(a);
                }
            }
            for (k, answer) in answers.into_iter().enumerate() {
                let answer = match answer {
                    Some(a) => a,
                    None if self.send_cached(&mut stream, &mut wbuf, asks[k])? => continue,
                    None => self.part(asks[k]),
                };
                write_chunk_answer(&mut stream, &mut wbuf, &answer)?;
            }
        }
    }

    /// Answers `ask` on `stream` straight from the cache file with
    /// `sendfile` when it is at least [`SEND_FILE_MIN`] bytes, cached and
    /// checked: the server neither copies the bytes into a buffer of its
    /// own nor out of it into the socket (most of a warm server's time
    /// went there). False when it did not (not cached, small, the fault
    /// switch is on, which needs the bytes in hand, or the connection is
    /// TLS, whose bytes this process encrypts); an error when the
    /// connection broke.
    fn send_cached(
        &self,
        stream: &mut Stream,
        wbuf: &mut Vec<u8>,
        ask: crate::wire::frames::ChunkAsk,
    ) -> std::io::Result<bool> {
        if stream.is_tls() {
            return Ok(false);
        }
        let Some(cache) = self.cache.as_ref().filter(|_| self.fault.is_none()) else { return Ok(false) };
        if ask.proved {
            // The leaf hashes are made from the bytes, not sent from the file.
            return Ok(false);
        }
        let within = match ask.part {
            Some((_, len)) if (len as usize) < SEND_FILE_MIN => return Ok(false),
            Some((at, len)) => match at.checked_add(len as u64) {
                Some(end) => Some(at..end),
                None => return Ok(false),
            },
            None => None,
        };
        let started = Instant::now();
        let sent = cache.send_cached_part(ask.seg, ask.index, within.clone(), |file, off, len| {
            if len < SEND_FILE_MIN {
                return None;
            }
            let head = u32::try_from(len).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput));
            let deadline = Instant::now() + SEND_TIMEOUT;
            Some(head.and_then(|len32| {
                crate::wire::frames::write_chunk_head(stream, wbuf, true, len32)?;
                crate::wire::frames::send_file(stream.tcp(), file, off, len, deadline)
            }))
        });
        let m = &self.metrics;
        match sent {
            None => Ok(false),
            Some(Err(e)) => Err(e),
            Some(Ok(len)) => {
                m.hits.inc();
                if within.is_some() {
                    m.parts.inc();
                }
                m.served_bytes.add(len as u64);
                m.latency.observe(started.elapsed());
                Ok(true)
            }
        }
    }

    /// A chunk or a part of it, as a chunk connection answers it: read
    /// from the cache, or fetched (and cached whole) on this thread.
    fn part(&self, ask: crate::wire::frames::ChunkAsk) -> crate::wire::frames::ChunkAnswer {
        use crate::wire::frames::ChunkAnswer;
        let Some(cache) = &self.cache else { return ChunkAnswer::NotFound };
        let within = match ask.part {
            Some((at, len)) => match at.checked_add(len as u64) {
                Some(end) => Some(at..end),
                None => return ChunkAnswer::NotFound,
            },
            None => None,
        };
        let started = Instant::now();
        let got = match (ask.proved, within.clone()) {
            (true, Some(leaves)) => {
                cache.proved_part(ask.seg, ask.index, leaves).map(|c| c.map(|c| (c.bytes, Some(c.hit))))
            }
            (true, None) => Ok(None),
            (false, _) => match cache.cached_part(ask.seg, ask.index, within.clone()) {
                Some(c) => Ok(Some((c.bytes, Some(c.hit)))),
                None => cache.chunk_part(ask.seg, ask.index, within.clone()).map(|c| c.map(|c| (c.bytes, Some(c.hit)))),
            },
        };
        if within.is_some() {
            self.metrics.parts.inc();
        }
        match self.served(|| format!("chunk {} of {}", ask.index, ask.seg), false, started, Ok(got)) {
            Served::Bytes { bytes, hit, .. } => ChunkAnswer::Bytes { hit: hit == Some(true), bytes },
            Served::NotFound | Served::Conflict(_) => ChunkAnswer::NotFound,
            Served::Failed(why) | Served::Broken(why) => ChunkAnswer::Failed(why),
        }
    }

    /// Answers an authorized HTTP `GET` of the chunk cache's routes
    /// (`/metrics`, `/v1/health`, chunks, footers, source objects), its
    /// path split at `/` in `parts`.
    pub(crate) async fn route(&self, req: &Request<Incoming>, parts: &[&str]) -> Reply {
        match parts {
            ["metrics"] => {
                let mut r = reply(StatusCode::OK, self.metrics_text());
                r.headers_mut()
                    .insert(CONTENT_TYPE, hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"));
                r
            }
            ["v1", "health"] => reply(StatusCode::OK, "ok\n"),
            ["v1", "chunks", seg, index] => match (SegId::parse_file_name(seg), index.parse::<u32>()) {
                (Some(seg), Ok(index)) => {
                    let Some(cache) = self.cache.clone() else { return reply(StatusCode::NOT_FOUND, Bytes::new()) };
                    let Ok((within, proved)) = chunk_part(req.uri().query()) else {
                        return reply(StatusCode::BAD_REQUEST, "?at=OFFSET&len=LENGTH[&proved=1] inside the chunk\n");
                    };
                    if within.is_some() {
                        self.metrics.parts.inc();
                    }
                    let what = format!("chunk {index} of {seg}");
                    if let (true, Some(leaves)) = (proved, within.clone()) {
                        let get =
                            move || cache.proved_part(seg, index, leaves).map(|c| c.map(|c| (c.bytes, Some(c.hit))));
                        return self.chunk(what, false, get).await;
                    }
                    // A small part of a cached chunk is one read of the
                    // cache: answered here, not handed to a blocking thread
                    // and back (two wake-ups, most of a part's latency).
                    if let Some(c) = within.clone().and_then(|w| cache.cached_part(seg, index, Some(w))) {
                        let started = Instant::now();
                        return self.answer(what, false, started, Ok(Ok(Some((c.bytes, Some(c.hit))))));
                    }
                    // No checksum header: the client checks a segment
                    // chunk against its object's footer, a part against
                    // the block crcs of the records it reads.
                    let get = move || cache.chunk_part(seg, index, within).map(|c| c.map(|c| (c.bytes, Some(c.hit))));
                    self.chunk(what, false, get).await
                }
                _ => reply(StatusCode::BAD_REQUEST, "not a segment chunk\n"),
            },
            ["v1", "footers", seg] => match SegId::parse_file_name(seg) {
                Some(seg) => {
                    let Some(cache) = self.cache.clone() else { return reply(StatusCode::NOT_FOUND, Bytes::new()) };
                    // Checked by the client against its own crc32c.
                    let get = move || cache.footer(seg).map(|f| f.map(|f| (f, None)));
                    self.chunk(format!("footer of {seg}"), false, get).await
                }
                None => reply(StatusCode::BAD_REQUEST, "not a segment\n"),
            },
            ["v1", "objects", index] => match (object_source(req.uri().query()), index.parse::<u64>()) {
                (Some(src), Ok(index)) => {
                    let Some(objects) = self.objects.clone() else {
                        return reply(StatusCode::NOT_FOUND, "this server does not serve source objects\n");
                    };
                    // Fetched with the server's credentials: only what an
                    // import of its disk names.
                    let scope = self.object_scope.clone();
                    let asked = src.clone();
                    let verdict = tokio::task::spawn_blocking(move || match scope {
                        Some(scope) => scope.check(&asked),
                        None => Err("this server serves no source objects of its disk".into()),
                    })
                    .await
                    .unwrap_or_else(|e| Err(format!("the check failed: {e}")));
                    if let Err(why) = verdict {
                        self.metrics.refused_objects.inc();
                        return reply(StatusCode::FORBIDDEN, format!("{why}\n"));
                    }
                    let what = format!("chunk {index} of {}", src.url());
                    self.chunk(what, true, move || match objects.chunk(&src, index) {
                        Ok((bytes, hit)) => Ok(Some((bytes, Some(hit)))),
                        Err(arbor_engine::Error::NoSuchObject(_)) => Ok(None),
                        Err(e) => Err(e),
                    })
                    .await
                }
                _ => reply(StatusCode::BAD_REQUEST, "objects/<index>?bucket=…&key=…&etag=…&size=…\n"),
            },
            _ => reply(StatusCode::NOT_FOUND, Bytes::new()),
        }
    }

    /// Answers with the chunk `get` finds (`None`: there is no such chunk)
    /// and whether it was cached already (`None`: not a chunk, a footer),
    /// and with its crc32c if `crc`; counts and times it.
    async fn chunk(&self, what: String, crc: bool, get: impl FnOnce() -> Found + Send + 'static) -> Reply {
        let started = Instant::now();
        let got = tokio::task::spawn_blocking(get).await;
        self.answer(what, crc, started, got)
    }

    /// The answer for what [`ChunkService::chunk`] found, counted and timed.
    fn answer(
        &self,
        what: String,
        crc: bool,
        started: Instant,
        got: std::result::Result<Found, tokio::task::JoinError>,
    ) -> Reply {
        match self.served(|| what, crc, started, got.map_err(|e| e.to_string())) {
            Served::Bytes { bytes, hit, crc } => {
                let mut r = reply(StatusCode::OK, bytes);
                if let Some(hit) = hit {
                    let state = if hit { "hit" } else { "miss" };
                    r.headers_mut().insert(CACHE_HEADER, hyper::header::HeaderValue::from_static(state));
                }
                if let Some(Ok(v)) = crc.map(|crc| hyper::header::HeaderValue::from_str(&format!("{crc:08x}"))) {
                    r.headers_mut().insert(CRC_HEADER, v);
                }
                r
            }
            Served::NotFound => reply(StatusCode::NOT_FOUND, Bytes::new()),
            Served::Conflict(why) => reply(StatusCode::CONFLICT, format!("{why}\n")),
            Served::Failed(why) => reply(StatusCode::BAD_GATEWAY, format!("{why}\n")),
            Served::Broken(why) => reply(StatusCode::INTERNAL_SERVER_ERROR, format!("{why}\n")),
        }
    }

    /// What a chunk request found (`Err`: the task looking broke), as
    /// either transport answers it: counted, timed, and with the fault
    /// switch applied.
    fn served(
        &self,
        what: impl FnOnce() -> String,
        crc: bool,
        started: Instant,
        got: std::result::Result<Found, String>,
    ) -> Served {
        let m = &self.metrics;
        let r = match got {
            Ok(Ok(Some((mut bytes, hit)))) => {
                match hit {
                    Some(true) => m.hits.inc(),
                    Some(false) => m.misses.inc(),
                    None => m.footers.inc(),
                }
                let crc = crc.then(|| arbor_engine::crc::crc32c(&bytes));
                match self.fault {
                    Some(Fault::Corrupt) => {
                        let mid = bytes.len() / 2;
                        if let Some(b) = bytes.get_mut(mid) {
                            *b ^= 0x5a;
                        }
                    }
                    Some(Fault::Short) => bytes.truncate(bytes.len() / 2),
                    None => {}
                }
                m.served_bytes.add(bytes.len() as u64);
                Served::Bytes { bytes, hit, crc }
            }
            Ok(Ok(None)) => {
                m.not_found.inc();
                Served::NotFound
            }
            Ok(Err(arbor_engine::Error::SourceChanged(why))) => {
                m.not_found.inc();
                Served::Conflict(why)
            }
            Ok(Err(e)) => {
                m.errors.inc();
                tracing::warn!(chunk = %what(), error = %e, "cannot serve a chunk");
                Served::Failed(e.to_string())
            }
            Err(e) => {
                m.errors.inc();
                Served::Broken(e)
            }
        };
        m.latency.observe(started.elapsed());
        r
    }

    /// Evicts, now, every chunk not read since the cache's clock read `tick`.
    pub fn evict_unused_since(&self, tick: u64) {
        if let Some(c) = &self.cache {
            c.evict_unused_since(tick);
        }
    }

    /// The server's counters in the Prometheus text format.
    pub fn metrics_text(&self) -> String {
        let s = self.cache.as_ref().map(|c| c.stats()).unwrap_or_default();
        let o = self.objects.as_ref().map(|o| o.stats()).unwrap_or_default();
        self.metrics.render(&CacheGauges {
            bucket_bytes: s.fetched_bytes + o.fetched_bytes,
            bucket_gets: s.gets + o.gets,
            resident_bytes: s.cached_bytes + s.object_bytes,
            imported_bytes: s.object_bytes,
            capacity: s.capacity,
            evicted_bytes: s.evicted_bytes,
            open_connections: self.admission.open() as u64,
        })
    }
}
