//! `arbor serve`: answers chunk requests from a [`SegmentCache`] on chunk
//! connections (framed, see [`crate::wire::frames`]) and over HTTP/2 (and
//! HTTP/1.1: footers, source objects, `/metrics`), behind a shared token.
//!
//! A connection is admitted under caps per peer and in total, and a framed
//! one says its hello on the runtime, within a deadline, before it gets a
//! thread (see [`crate::wire::admission`]): one without the token costs a task
//! and a few KiB. With TLS ([`ServerOptions::tls`]) every connection's
//! handshake is done on the runtime too, by the same deadline; a framed
//! connection then goes to its thread as a blocking TLS stream
//! ([`crate::wire::stream`]), and chunks are read and encrypted, not sent with
//! `sendfile`.

use crate::authorized;
use crate::branch::owner::{Op, SharedBranch, EVENT_WAIT};
use crate::cache::metrics::{CacheGauges, Metrics};
use crate::wire::admission::{Admission, Admitted, ConnLimits};
use crate::wire::frames::{Hello, Welcome};
use crate::wire::http::{
    chunk_part, object_source, CACHE_HEADER, CONNECTION_WINDOW, CRC_HEADER, MAX_FRAME, STREAM_WINDOW,
};
use crate::wire::stream::{AcceptedStream, Stream};
use arbor_engine::format::{encode_value, SegId};
use arbor_engine::source::SourceReader;
use arbor_engine::tier::SegmentCache;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
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

#[derive(Clone, Debug, Default)]
pub struct ServerOptions {
    /// The shared secret every request must carry.
    pub token: String,
    pub fault: Option<Fault>,
    /// Evict chunks nobody read for this long, however much room is left.
    pub keep_for: Option<std::time::Duration>,
    /// Serves chunks of imported files' source objects, from this reader
    /// (its own buckets and cache).
    pub objects: Option<Arc<SourceReader>>,
    /// The source objects it serves: those an import of its disk names
    /// (none without a scope).
    pub object_scope: Option<Arc<crate::ObjectScope>>,
    /// The connections admitted at once, and the hello's deadline.
    pub limits: ConnLimits,
    /// Every connection speaks TLS (see [`crate::wire::tls`]).
    pub tls: Option<crate::wire::tls::ServerTls>,
}

/// What a chunk request found: the bytes and whether they were cached
/// already (`None`: not a chunk, a footer), or no such chunk.
type Found = arbor_engine::Result<Option<(Vec<u8>, Option<bool>)>>;

/// The smallest answer a chunk connection sends with `sendfile` (smaller
/// ones are read and written: two system calls cost more than the copy).
const SEND_FILE_MIN: usize = 64 << 10;

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

pub struct CacheServer {
    /// `None`: a server of shared branches on a local-folder disk, which
    /// has no bucket to cache.
    cache: Option<Arc<SegmentCache>>,
    /// The branches this process owns, by name.
    branches: HashMap<String, Arc<SharedBranch>>,
    opts: ServerOptions,
    metrics: Metrics,
    /// The connections open now, under their caps.
    admission: Arc<Admission>,
    /// The framed connections being served, each on a thread of its own.
    framed: parking_lot::Mutex<FramedConns>,
}

#[derive(Default)]
struct FramedConns {
    /// Set when the server stops: lock waits give up, no new connection is taken.
    stopping: bool,
    /// A handle on each open connection, to shut it when the server stops,
    /// and whether its thread waits for the next request (set before a
    /// read, cleared once a request is read).
    open: HashMap<u64, (std::net::TcpStream, Arc<std::sync::atomic::AtomicBool>)>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

type Reply = Response<Full<Bytes>>;

/// How the server speaks HTTP (HTTP/2 or HTTP/1.1, by what the client sends).
type Http = hyper_util::server::conn::auto::Builder<TokioExecutor>;

/// A connection accepted under the caps: its place there (given back when
/// this is dropped), its number and peer, and its hello's deadline.
struct Accepted {
    conn: u64,
    peer: std::net::SocketAddr,
    admitted: Admitted,
    hello_by: tokio::time::Instant,
}

/// Every quarter of `keep_for` (from 0.1 s to a minute) reads the cache's
/// clock, and evicts what was not used since the reading `keep_for` ago.
/// Runs until the runtime stops.
async fn keep_only_recent(cache: Arc<SegmentCache>, keep_for: std::time::Duration) {
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

fn reply(status: StatusCode, body: impl Into<Bytes>) -> Reply {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r
}

impl CacheServer {
    pub fn new(cache: SegmentCache, opts: ServerOptions) -> Arc<CacheServer> {
        CacheServer::owner(Some(Arc::new(cache)), Vec::new(), opts)
    }

    /// A server that also owns `branches` and serves their files.
    pub fn owner(
        cache: Option<Arc<SegmentCache>>,
        branches: Vec<Arc<SharedBranch>>,
        opts: ServerOptions,
    ) -> Arc<CacheServer> {
        let branches = branches.into_iter().map(|b| (b.name().to_string(), b)).collect();
        Arc::new(CacheServer {
            cache,
            branches,
            admission: Admission::new(opts.limits),
            opts,
            metrics: Metrics::default(),
            framed: parking_lot::Mutex::new(FramedConns::default()),
        })
    }

    /// A branch this server owns.
    pub fn branch(&self, name: &str) -> Option<&Arc<SharedBranch>> {
        self.branches.get(name)
    }

    /// Serves connections from `listener` until `shutdown` completes.
    pub async fn run(
        self: Arc<Self>,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()>,
    ) -> std::io::Result<()> {
        let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        builder
            .http2()
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW)
            .max_frame_size(MAX_FRAME)
            .max_concurrent_streams(1024);
        let builder = Arc::new(builder);
        if let (Some(keep_for), Some(cache)) = (self.opts.keep_for, &self.cache) {
            tokio::spawn(keep_only_recent(cache.clone(), keep_for));
        }
        for b in self.branches.values() {
            tokio::spawn(reap_sessions(b.clone()));
        }
        let mut next_conn = 0u64;
        tokio::pin!(shutdown);
        loop {
            let (stream, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors and the like: keep serving.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = &mut shutdown => {
                    self.stop_framed().await;
                    return Ok(());
                }
            };
            let Some(admitted) = self.admission.admit(peer.ip()) else {
                // Closed at once (dropped): it costs nothing more.
                self.metrics.refused_connections.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%peer, "a connection over the caps; closed");
                continue;
            };
            let hello_by = tokio::time::Instant::now() + self.admission.limits().hello_deadline;
            let _ = stream.set_nodelay(true);
            let (me, builder) = (self.clone(), builder.clone());
            next_conn += 1;
            let conn = Accepted { conn: next_conn, peer, admitted, hello_by };
            tokio::spawn(async move {
                match me.opts.tls.clone() {
                    Some(tls) => me.tls_connection(stream, conn, &tls, builder).await,
                    None => me.plain_connection(stream, conn, builder).await,
                }
            });
        }
    }

    /// Serves a connection in clear: framed or HTTP, by its first bytes.
    async fn plain_connection(self: Arc<Self>, stream: tokio::net::TcpStream, conn: Accepted, builder: Arc<Http>) {
        match is_framed(&stream, conn.hello_by).await {
            Some(true) => self.admit_framed(stream, conn).await,
            Some(false) => self.serve_http(stream, false, conn, &builder).await,
            None => {
                self.metrics.failed_hellos.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Serves a connection inside TLS: its handshake done by the hello's
    /// deadline (a client that never finishes it costs a task until then),
    /// then framed or HTTP by the protocol its client named (ALPN).
    async fn tls_connection(
        self: Arc<Self>,
        stream: tokio::net::TcpStream,
        conn: Accepted,
        tls: &crate::wire::tls::ServerTls,
        builder: Arc<Http>,
    ) {
        let stream = match tokio::time::timeout_at(conn.hello_by, tls.acceptor().accept(stream)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                self.metrics.failed_hellos.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(peer = %conn.peer, error = %e, "a TLS handshake failed; closed");
                return;
            }
            Err(_) => {
                self.metrics.failed_hellos.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(peer = %conn.peer, "no TLS handshake by the deadline; closed");
                return;
            }
        };
        let session = stream.get_ref().1;
        let certified = session.peer_certificates().is_some_and(|c| !c.is_empty());
        if session.alpn_protocol() == Some(crate::wire::tls::ALPN_FRAMES) {
            self.admit_framed(stream, conn).await
        } else {
            self.serve_http(stream, certified, conn, &builder).await
        }
    }

    /// Answers HTTP requests on a connection until it closes; `certified`:
    /// its client showed a certificate the client CA signed.
    async fn serve_http<I>(self: Arc<Self>, io: I, certified: bool, conn: Accepted, builder: &Http)
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let me = self.clone();
        // A connection that has not made one authorized request by the
        // hello's deadline is closed, as a framed one is.
        let trusted = Arc::new(std::sync::atomic::AtomicBool::new(certified));
        let seen = trusted.clone();
        let service = hyper::service::service_fn(move |req| {
            let (me, seen) = (me.clone(), seen.clone());
            async move {
                if certified || authorized(req.headers().get(AUTHORIZATION).map(|v| v.as_bytes()), &me.opts.token) {
                    seen.store(true, Ordering::Relaxed);
                }
                Ok::<_, Infallible>(me.handle(req, certified).await)
            }
        });
        let served = builder.serve_connection(TokioIo::new(io), service);
        tokio::pin!(served);
        let ended = tokio::select! {
            r = &mut served => Some(r),
            () = tokio::time::sleep_until(conn.hello_by) => None,
        };
        let ended = match ended {
            Some(r) => r,
            None if trusted.load(Ordering::Relaxed) => served.await,
            None => {
                self.metrics.failed_hellos.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(peer = %conn.peer, "an HTTP connection without an authorized request by the deadline; closed");
                return;
            }
        };
        if let Err(e) = ended {
            tracing::debug!(peer = %conn.peer, error = %e, "connection ended");
        }
        drop(conn);
    }

    /// Reads a framed connection's hello by `hello_by` and answers it, on
    /// the runtime: only a connection with the token is handed to a thread
    /// ([`CacheServer::serve_framed`]); any other is closed here.
    async fn admit_framed(self: Arc<Self>, mut stream: impl AcceptedStream, accepted: Accepted) {
        use tokio::io::AsyncWriteExt;
        let Accepted { conn, hello_by, admitted, .. } = accepted;
        let hello = match tokio::time::timeout_at(hello_by, crate::wire::admission::read_hello(&mut stream)).await {
            Ok(Ok(hello)) => hello,
            Ok(Err(e)) => {
                self.metrics.failed_hellos.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(conn, error = %e, "a framed connection without a good hello; closed");
                return;
            }
            Err(_) => {
                self.metrics.failed_hellos.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(conn, "a framed connection without a hello by its deadline; closed");
                return;
            }
        };
        let welcome = self.welcome(&hello, stream.certified());
        let mut frame = Vec::new();
        if crate::wire::frames::write_frame(&mut frame, &mut Vec::new(), &welcome).is_err() {
            return;
        }
        let sent = async {
            stream.write_all(&frame).await?;
            stream.flush().await
        };
        match tokio::time::timeout_at(hello_by, sent).await {
            Ok(Ok(())) if welcome == Welcome::Ok => match stream.into_blocking() {
                Ok(stream) => self.serve_framed(stream, conn, hello, admitted),
                Err(e) => tracing::warn!(error = %e, "cannot take a framed connection"),
            },
            _ => {}
        }
    }

    /// What the server answers `hello`; `certified`: its client showed a
    /// certificate the client CA signed, which stands for the token.
    fn welcome(&self, hello: &Hello, certified: bool) -> Welcome {
        // A Hello that names no branch opens a chunk connection.
        let chunks = hello.branch.is_empty();
        if !certified && !crate::token_matches(&hello.token, &self.opts.token) {
            self.metrics.unauthorized.fetch_add(1, Ordering::Relaxed);
            Welcome::Refused
        } else if hello.version != crate::wire::frames::VERSION {
            Welcome::Version(crate::wire::frames::VERSION)
        } else if !chunks && self.branches.get(&hello.branch).is_none_or(|b| b.stepped_down()) {
            Welcome::NoBranch
        } else {
            Welcome::Ok
        }
    }

    /// Hands a framed connection whose hello was welcomed to a thread of
    /// its own (see [`crate::wire::frames`]), which holds its place under the
    /// caps until it ends.
    fn serve_framed(self: Arc<Self>, stream: Stream, conn: u64, hello: Hello, admitted: Admitted) {
        crate::wire::frames::keep_alive(stream.tcp());
        let rt = tokio::runtime::Handle::current();
        let mut framed = self.framed.lock();
        framed.threads.retain(|t| !t.is_finished());
        let Ok(handle) = stream.tcp().try_clone() else { return };
        if framed.stopping {
            return;
        }
        let idle = Arc::new(std::sync::atomic::AtomicBool::new(true));
        framed.open.insert(conn, (handle, idle.clone()));
        let me = self.clone();
        let spawned = std::thread::Builder::new().name("arbor-files".into()).spawn(move || {
            if let Err(e) = me.framed_connection(stream, &hello, &rt, &idle) {
                tracing::debug!(conn, error = %e, "a framed connection ended");
            }
            me.framed.lock().open.remove(&conn);
            drop(admitted);
        });
        match spawned {
            Ok(t) => framed.threads.push(t),
            Err(e) => {
                framed.open.remove(&conn);
                tracing::warn!(error = %e, "cannot start a thread for a framed connection");
            }
        }
    }

    /// Answers one framed connection, its `hello` welcomed, until it closes.
    fn framed_connection(
        &self,
        stream: Stream,
        hello: &Hello,
        rt: &tokio::runtime::Handle,
        idle: &std::sync::atomic::AtomicBool,
    ) -> std::io::Result<()> {
        if hello.branch.is_empty() {
            self.metrics.chunk_connections.fetch_add(1, Ordering::Relaxed);
            return self.chunk_connection(stream, Vec::new(), Vec::new(), idle);
        }
        match self.branches.get(&hello.branch) {
            Some(b) => self.branch_connection(stream, b, rt, idle),
            None => Ok(()),
        }
    }

    /// Answers the [`Request`](crate::branch::frames::Request)s of one framed
    /// connection to branch `b`, each on this thread, until it closes.
    fn branch_connection(
        &self,
        mut stream: Stream,
        b: &SharedBranch,
        rt: &tokio::runtime::Handle,
        idle: &std::sync::atomic::AtomicBool,
    ) -> std::io::Result<()> {
        use crate::branch::frames::{read_request, write_answer, Answer, Request};
        let (mut rbuf, mut wbuf) = (Vec::new(), Vec::new());
        loop {
            // Idle only until a request's first byte: a stop shuts an idle
            // connection with nothing unread at once, and must not cut one
            // whose request is half read.
            idle.store(true, Ordering::Release);
            stream.wait_readable()?;
            idle.store(false, Ordering::Release);
            let req: Request = match read_request(&mut stream, &mut rbuf) {
                Ok(r) => r,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            };
            if b.stepped_down() {
                // Another writer took the branch (or the log failed): the
                // client looks for the owner again rather than be answered
                // by one that can no longer write.
                tracing::warn!(branch = %b.name(), "no longer serving the branch; closing a client's connection");
                return Ok(());
            }
            let answer = match req {
                Request::Session => match b.open_session() {
                    Some(info) => Answer::Session(info),
                    None => {
                        tracing::warn!(branch = %b.name(), "as many sessions as a branch keeps; closing a client's connection");
                        return Ok(());
                    }
                },
                Request::Op { session, .. } if !b.touch(session) => Answer::UnknownSession,
                Request::Op { session, op: Op::SetLk { ino, owner, lock, wait: true, reclaim: false }, .. }
                    if lock.typ != libc::F_UNLCK =>
                {
                    // A wait ends when the owner stops or the client hung up
                    // (a lock granted then would be held by nobody who knows).
                    let tcp = stream.tcp();
                    let go_on = || !self.framed.lock().stopping && !peer_closed(tcp);
                    match rt.block_on(b.set_lock_while(session, ino, owner, lock, go_on)) {
                        // Not answered: the client asks the next owner, as
                        // a blocking F_SETLKW must not fail with EINTR
                        // because its owner restarts.
                        Err(libc::EINTR) => return Ok(()),
                        r => Answer::Reply(r),
                    }
                }
                Request::Op { tag: Some(t), .. }
                    if t.slot & crate::branch::requests::PIPELINED_SLOT != 0 && peer_closed(stream.tcp()) =>
                {
                    // A lane's write read after its client closed the
                    // connection: the client gave it up (a close that could
                    // not get its answer reported it lost) or will send it
                    // again under its session. Applied now, it could land
                    // after that close returned, over another node's newer
                    // bytes; so the rest of this connection is dropped.
                    tracing::debug!("a client closed a write connection with writes unread; not applying them");
                    return Ok(());
                }
                Request::Op { session, op, tag } => Answer::Reply(b.apply_request(session, tag, op)),
            };
            write_answer(&mut stream, &mut wbuf, &answer)?;
        }
    }

    /// Answers the [`ChunkAsk`](crate::wire::frames::ChunkAsk)s of one chunk connection, each on this
    /// thread, until it closes.
    fn chunk_connection(
        &self,
        mut stream: Stream,
        mut rbuf: Vec<u8>,
        mut wbuf: Vec<u8>,
        idle: &std::sync::atomic::AtomicBool,
    ) -> std::io::Result<()> {
        use crate::wire::frames::{read_frame, write_chunk_answer, ChunkAnswer, ChunkAsk};
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
        let Some(cache) = self.cache.as_ref().filter(|_| self.opts.fault.is_none()) else { return Ok(false) };
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
            Some(head.and_then(|len32| {
                crate::wire::frames::write_chunk_head(stream, wbuf, true, len32)?;
                crate::wire::frames::send_file(stream.tcp(), file, off, len)
            }))
        });
        let m = &self.metrics;
        match sent {
            None => Ok(false),
            Some(Err(e)) => Err(e),
            Some(Ok(len)) => {
                m.hits.fetch_add(1, Ordering::Relaxed);
                if within.is_some() {
                    m.parts.fetch_add(1, Ordering::Relaxed);
                }
                m.served_bytes.fetch_add(len as u64, Ordering::Relaxed);
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
            self.metrics.parts.fetch_add(1, Ordering::Relaxed);
        }
        match self.served(|| format!("chunk {} of {}", ask.index, ask.seg), false, started, Ok(got)) {
            Served::Bytes { bytes, hit, .. } => ChunkAnswer::Bytes { hit: hit == Some(true), bytes },
            Served::NotFound | Served::Conflict(_) => ChunkAnswer::NotFound,
            Served::Failed(why) | Served::Broken(why) => ChunkAnswer::Failed(why),
        }
    }

    /// Stops serving framed connections, drained rather than cut: what a
    /// client already sent (a lane's writes in flight, which it counts as
    /// written) is read, applied and answered, so a clean stop loses
    /// nothing; a connection then idle for [`DRAIN_IDLE`] ends, and any
    /// left after [`DRAIN_MAX`] is shut. Each thread is joined once it has
    /// answered what it was doing.
    async fn stop_framed(&self) {
        let threads = {
            let mut framed = self.framed.lock();
            framed.stopping = true;
            for (s, idle) in framed.open.values() {
                // A thread waiting for a request with none arrived has
                // nothing to drain (a timeout set now would not end its
                // wait, which began before); the others finish theirs.
                let waiting = idle.load(Ordering::Acquire) && unread(s) == Some(0);
                if waiting || s.set_read_timeout(Some(DRAIN_IDLE)).is_err() {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
            }
            std::mem::take(&mut framed.threads)
        };
        let deadline = Instant::now() + DRAIN_MAX;
        // Bounded by DRAIN_MAX, then by the shut connections' threads.
        while !threads.iter().all(|t| t.is_finished()) {
            if Instant::now() >= deadline {
                for (s, _) in self.framed.lock().open.values() {
                    let _ = s.shutdown(std::net::Shutdown::Both);
                }
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let _ = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        })
        .await;
    }

    async fn handle(&self, req: Request<Incoming>, certified: bool) -> Reply {
        let auth = req.headers().get(AUTHORIZATION).map(|v| v.as_bytes());
        if !certified && !authorized(auth, &self.opts.token) {
            self.metrics.unauthorized.fetch_add(1, Ordering::Relaxed);
            return reply(StatusCode::UNAUTHORIZED, Bytes::new());
        }
        let path = req.uri().path().to_string();
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        if let ["v1", "files", branch, rest @ ..] = parts.as_slice() {
            let Some(b) = self.branches.get(*branch).cloned() else {
                return reply(StatusCode::NOT_FOUND, format!("branch {branch} is not served here\n"));
            };
            return match (req.method(), rest) {
                (&Method::GET, ["events"]) => events(b, &req).await,
                _ => reply(StatusCode::NOT_FOUND, Bytes::new()),
            };
        }
        if req.method() != Method::GET {
            return reply(StatusCode::METHOD_NOT_ALLOWED, Bytes::new());
        }
        match parts.as_slice() {
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
                        self.metrics.parts.fetch_add(1, Ordering::Relaxed);
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
                    let Some(objects) = self.opts.objects.clone() else {
                        return reply(StatusCode::NOT_FOUND, "this server does not serve source objects\n");
                    };
                    // Fetched with the server's credentials: only what an
                    // import of its disk names.
                    let scope = self.opts.object_scope.clone();
                    let asked = src.clone();
                    let verdict = tokio::task::spawn_blocking(move || match scope {
                        Some(scope) => scope.check(&asked),
                        None => Err("this server serves no source objects of its disk".into()),
                    })
                    .await
                    .unwrap_or_else(|e| Err(format!("the check failed: {e}")));
                    if let Err(why) = verdict {
                        self.metrics.refused_objects.fetch_add(1, Ordering::Relaxed);
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

    /// The answer for what [`CacheServer::chunk`] found, counted and timed.
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
                    Some(true) => m.hits.fetch_add(1, Ordering::Relaxed),
                    Some(false) => m.misses.fetch_add(1, Ordering::Relaxed),
                    None => m.footers.fetch_add(1, Ordering::Relaxed),
                };
                let crc = crc.then(|| arbor_engine::crc::crc32c(&bytes));
                match self.opts.fault {
                    Some(Fault::Corrupt) => {
                        let mid = bytes.len() / 2;
                        if let Some(b) = bytes.get_mut(mid) {
                            *b ^= 0x5a;
                        }
                    }
                    Some(Fault::Short) => bytes.truncate(bytes.len() / 2),
                    None => {}
                }
                m.served_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                Served::Bytes { bytes, hit, crc }
            }
            Ok(Ok(None)) => {
                m.not_found.fetch_add(1, Ordering::Relaxed);
                Served::NotFound
            }
            Ok(Err(arbor_engine::Error::SourceChanged(why))) => {
                m.not_found.fetch_add(1, Ordering::Relaxed);
                Served::Conflict(why)
            }
            Ok(Err(e)) => {
                m.errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(chunk = %what(), error = %e, "cannot serve a chunk");
                Served::Failed(e.to_string())
            }
            Err(e) => {
                m.errors.fetch_add(1, Ordering::Relaxed);
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
        let o = self.opts.objects.as_ref().map(|o| o.stats()).unwrap_or_default();
        self.metrics.render(&CacheGauges {
            bucket_bytes: s.fetched_bytes + o.fetched_bytes,
            bucket_gets: s.gets + o.gets,
            resident_bytes: s.cached_bytes,
            capacity: s.capacity,
            evicted_bytes: s.evicted_bytes,
            open_connections: self.admission.open() as u64,
        })
    }
}

/// Whether `stream` starts with [`crate::wire::frames::MAGIC`] (a framed
/// connection) rather than an HTTP request, looked at without taking the
/// bytes. `None` when it sent nothing by `by`: both protocols start with
/// the client speaking, so such a connection is closed.
async fn is_framed(stream: &tokio::net::TcpStream, by: tokio::time::Instant) -> Option<bool> {
    use crate::wire::frames::MAGIC;
    let mut first = [0u8; 4];
    // Bounded: each round waits for more bytes or gives up at `by`.
    for _ in 0..100 {
        let n = match tokio::time::timeout_at(by, stream.peek(&mut first)).await {
            Ok(Ok(n)) => n,
            Ok(Err(_)) => return Some(false),
            Err(_) => return None,
        };
        if n == 0 || first[..n] != MAGIC[..n] {
            return Some(false);
        }
        if n == MAGIC.len() {
            return Some(true);
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    Some(false)
}

/// Drops the sessions of clients that went away, every second.
async fn reap_sessions(b: Arc<SharedBranch>) {
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let b = b.clone();
        let _ = tokio::task::spawn_blocking(move || b.reap()).await;
    }
}

async fn events(b: Arc<SharedBranch>, req: &Request<Incoming>) -> Reply {
    let mut session = None;
    let mut after = None;
    for kv in req.uri().query().unwrap_or("").split('&') {
        match kv.split_once('=') {
            Some(("session", v)) => session = u64::from_str_radix(v, 16).ok(),
            Some(("after", v)) => after = v.parse::<u64>().ok(),
            _ => {}
        }
    }
    let (Some(session), Some(after)) = (session, after) else {
        return reply(StatusCode::BAD_REQUEST, "events?session=<hex>&after=<n>\n");
    };
    if !b.touch(session) {
        return reply(StatusCode::CONFLICT, "unknown session\n");
    }
    reply(StatusCode::OK, encode_value(&b.events(session, after, EVENT_WAIT).await))
}

/// A server running on its own runtime thread (tests, benchmarks, and
/// anything that embeds one); stopped and joined when dropped.
pub struct Running {
    pub addr: std::net::SocketAddr,
    pub server: Arc<CacheServer>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

/// Connections the kernel queues for the accept loop (at most
/// `net.core.somaxconn`): a cluster's clients connecting at once, an owner
/// restarted say, wait in the queue rather than resend their SYN a second
/// later, as past the 128 the standard library's listener asks for.
pub const LISTEN_BACKLOG: i32 = 4096;

/// Whether the peer of `s` has shut its side (its FIN arrived), whatever
/// is still unread.
fn peer_closed(s: &std::net::TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd, no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// Bytes received on `s` and not read yet.
fn unread(s: &std::net::TcpStream) -> Option<usize> {
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int.
    let rc = unsafe { libc::ioctl(s.as_raw_fd(), libc::FIONREAD, &mut n) };
    (rc == 0).then_some(n.max(0) as usize)
}

/// A stopping owner ends a framed connection once it sent nothing for this
/// long (its requests in flight are answered first).
pub const DRAIN_IDLE: std::time::Duration = std::time::Duration::from_millis(250);
/// The longest a stopping owner drains its framed connections.
pub const DRAIN_MAX: std::time::Duration = std::time::Duration::from_secs(3);

/// A listening socket on `addr` (`HOST:PORT`, the first address it
/// resolves to that binds), queueing [`LISTEN_BACKLOG`] connections.
pub fn listen(addr: &str) -> std::io::Result<std::net::TcpListener> {
    use std::net::ToSocketAddrs;
    let mut last = None;
    for a in addr.to_socket_addrs()? {
        match listen_on(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other(format!("{addr} resolves to no address"))))
}

fn listen_on(a: std::net::SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(a), Type::STREAM, None)?;
    // As the standard library's listener: a restarted server binds its
    // port while the old one's connections linger in TIME_WAIT.
    s.set_reuse_address(true)?;
    s.bind(&a.into())?;
    s.listen(LISTEN_BACKLOG)?;
    Ok(s.into())
}

impl CacheServer {
    /// Serves on `listen` (e.g. `127.0.0.1:0`) from a thread of its own.
    pub fn spawn(self: Arc<Self>, listen: &str) -> std::io::Result<Running> {
        let listener = self::listen(listen)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = self.clone();
        let thread = std::thread::spawn(move || {
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                server
                    .run(listener, async move {
                        let _ = rx.await;
                    })
                    .await
            })
        });
        Ok(Running { addr, server: self, stop: Some(tx), thread: Some(thread) })
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
