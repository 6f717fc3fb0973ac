//! `arbor serve`'s listener: one port, behind a shared token, for two
//! services. It accepts a connection, tells a framed one from HTTP (by its
//! first bytes, or inside TLS by ALPN) and hands it on: a chunk connection
//! or an HTTP request of the chunk cache's routes to the chunk cache
//! service ([`crate::cache::server`]), a branch's framed connection or its
//! event polls to that branch's owner ([`crate::branch::owner`]).
//!
//! A connection is admitted under caps per peer and in total, and a framed
//! one says its hello on the runtime, within a deadline, before it gets a
//! thread (see [`crate::wire::admission`]): one without the token costs a task
//! and a few KiB. With TLS ([`ServerOptions::tls`]) every connection's
//! handshake is done on the runtime too, by the same deadline; a framed
//! connection then goes to its thread as a blocking TLS stream
//! ([`crate::wire::stream`]), and chunks are read and encrypted, not sent with
//! `sendfile`.

pub use crate::cache::server::Fault;

use crate::authorized;
use crate::branch::owner::{FileOp, SharedBranch, EVENT_WAIT};
use crate::cache::server::{keep_only_recent, reply, ChunkService, Reply};
use crate::wire::admission::{Admission, Admitted, ConnLimits};
use crate::wire::frames::{Hello, Welcome};
use crate::wire::http::{CONNECTION_WINDOW, MAX_FRAME, STREAM_WINDOW};
use crate::wire::stream::{AcceptedStream, Stream};
use arbor_engine::format::encode_value;
use arbor_engine::source::SourceReader;
use arbor_engine::tier::SegmentCache;
use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::AUTHORIZATION;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

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

pub struct CacheServer {
    /// The chunk cache service, and the server's counters.
    chunks: ChunkService,
    /// The branches this process owns, by name.
    branches: HashMap<String, Arc<SharedBranch>>,
    opts: ServerOptions,
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
        let admission = Admission::new(opts.limits);
        let chunks =
            ChunkService::new(cache, opts.fault, opts.objects.clone(), opts.object_scope.clone(), admission.clone());
        Arc::new(CacheServer {
            chunks,
            branches,
            admission,
            opts,
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
        if let (Some(keep_for), Some(cache)) = (self.opts.keep_for, &self.chunks.cache) {
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
                self.chunks.metrics.refused_connections.inc();
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
                self.chunks.metrics.failed_hellos.inc();
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
                self.chunks.metrics.failed_hellos.inc();
                tracing::debug!(peer = %conn.peer, error = %e, "a TLS handshake failed; closed");
                return;
            }
            Err(_) => {
                self.chunks.metrics.failed_hellos.inc();
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
                self.chunks.metrics.failed_hellos.inc();
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
                self.chunks.metrics.failed_hellos.inc();
                tracing::debug!(conn, error = %e, "a framed connection without a good hello; closed");
                return;
            }
            Err(_) => {
                self.chunks.metrics.failed_hellos.inc();
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
            self.chunks.metrics.unauthorized.inc();
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
            self.chunks.metrics.chunk_connections.inc();
            return self.chunks.chunk_connection(stream, Vec::new(), Vec::new(), idle);
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
                Request::Op { session, op: FileOp::SetLk { ino, owner, lock, wait: true, reclaim: false }, .. }
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
            self.chunks.metrics.unauthorized.inc();
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
        self.chunks.route(&req, &parts).await
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
    /// Evicts, now, every chunk not read since the cache's clock read `tick`.
    pub fn evict_unused_since(&self, tick: u64) {
        self.chunks.evict_unused_since(tick)
    }

    /// The server's counters in the Prometheus text format.
    pub fn metrics_text(&self) -> String {
        self.chunks.metrics_text()
    }

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
