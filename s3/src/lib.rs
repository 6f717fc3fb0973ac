//! The disk as an S3 endpoint (`arbor serve DISK --branch main --s3
//! ADDR --s3-keys FILE`).
//!
//! Buckets are roots of the disk ([`names`]): every branch the server
//! owns is a writable bucket of its name, every checkpoint a read-only
//! bucket `<branch>--<checkpoint>`. A branch's files are reached through
//! its owner (`arbor_node::serve::Roots`), the path client mounts'
//! changes take, so an object put here is a file every mount sees at its
//! next open, and a file written on a mount is an object here.
//!
//! Objects are files ([`store`]): key `a/b/c` is file `a/b/c`, its
//! folders implied; the ETag, Content-Type and `x-amz-meta-*` are the
//! file's extended attributes. Listings walk the folders in key order
//! ([`list`]). Requests are signed (SigV4) with a key of the keys file
//! ([`auth`]); buckets are addressed path-style, or virtual-host-style
//! under the `--s3-domain` names.
//!
//! The protocol (parsing, signatures, aws-chunked bodies and their
//! trailers, XML) is the `s3s` crate's; this crate is its `S3` trait over
//! the disk ([`service`]) and the server around it.

pub mod auth;
pub mod conn;
pub mod list;
pub mod multipart;
pub mod names;
pub mod service;
pub mod store;

use arbor_node::serve::Roots;
use arbor_node::{Error, Result};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use s3s::config::{S3Config, StaticConfigProvider};
use s3s::host::{S3Host, VirtualHost};
use s3s::service::{S3Service, S3ServiceBuilder};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// What `--s3`, `--s3-keys` and `--s3-domain` say.
#[derive(Clone, Debug)]
pub struct Options {
    /// `HOST:PORT` to listen on.
    pub listen: String,
    /// The keys file: one `ACCESS_KEY_ID SECRET` a line, mode 0600.
    pub keys_file: PathBuf,
    /// Domains under which a request's host names its bucket
    /// (`main.DOMAIN`: virtual-host style); any other host is path-style.
    pub domains: Vec<String>,
}

/// The default `--s3-domain`.
pub const DEFAULT_DOMAIN: &str = "localhost";

/// Refuses what [`start`] would refuse before anything is opened.
pub fn check(opts: &Options) -> Result<()> {
    auth::load(&opts.keys_file)?;
    for d in &opts.domains {
        if d.is_empty() || d.contains(['/', ':']) {
            return Err(Error::Invalid(format!("--s3-domain {d:?}: give a host name, such as s3.example.com")));
        }
    }
    Ok(())
}

/// Virtual-host-style addressing under the configured domains; path
/// style for any other host (an address, another name).
struct Hosts(Vec<String>);

impl S3Host for Hosts {
    fn parse_host_header<'a>(&'a self, host: &'a str) -> s3s::S3Result<VirtualHost<'a>> {
        let name = match host.rsplit_once(':') {
            Some((h, port)) if !h.ends_with(']') && port.bytes().all(|b| b.is_ascii_digit()) => h,
            _ => host,
        };
        for d in &self.0 {
            if let Some(bucket) = name.strip_suffix(d.as_str()).and_then(|b| b.strip_suffix('.')) {
                if !bucket.is_empty() {
                    return Ok(VirtualHost::new(host).with_bucket(bucket.to_ascii_lowercase()));
                }
            }
        }
        Ok(VirtualHost::new(host))
    }
}

/// What s3s may hold in memory of a request. POST form uploads are
/// refused before s3s sees them ([`RefuseForms`]); should one get
/// through, its file and fields may not be big.
fn config() -> S3Config {
    let mut c = S3Config::default();
    c.post_object_max_file_size = 0;
    c.form_max_field_size = 8 << 10;
    c.form_max_fields_size = 64 << 10;
    c.form_max_parts = 32;
    c
}

/// Whether a request is a browser form upload (`POST` of
/// `multipart/form-data`). s3s reads such a form, its file part in
/// memory, before it checks who sent it: an unsigned form is anonymous
/// and refused only after the whole body arrived.
pub fn is_form_post<B>(req: &http::Request<B>) -> bool {
    req.method() == http::Method::POST
        && req
            .headers()
            .get_all(http::header::CONTENT_TYPE)
            .iter()
            .any(|v| v.to_str().is_ok_and(|t| t.trim_start().to_ascii_lowercase().starts_with("multipart/form-data")))
}

/// The S3 service behind a guard that answers form uploads 501 before
/// reading their bodies.
#[derive(Clone)]
struct RefuseForms(S3Service);

impl hyper::service::Service<http::Request<hyper::body::Incoming>> for RefuseForms {
    type Response = s3s::HttpResponse;
    type Error = s3s::HttpError;
    type Future = futures::future::BoxFuture<'static, std::result::Result<s3s::HttpResponse, s3s::HttpError>>;

    fn call(&self, req: http::Request<hyper::body::Incoming>) -> Self::Future {
        if is_form_post(&req) {
            return Box::pin(futures::future::ready(Ok(refusal())));
        }
        hyper::service::Service::call(&self.0, req)
    }
}

/// 501 NotImplemented, as S3 XML, closing the connection (the form's
/// body is never read).
fn refusal() -> s3s::HttpResponse {
    let xml = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>NotImplemented</Code>\
        <Message>POST uploads (HTML forms) are not served: PUT the object</Message></Error>";
    let mut r = http::Response::new(s3s::Body::from(xml.to_string()));
    *r.status_mut() = http::StatusCode::NOT_IMPLEMENTED;
    r.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/xml"));
    r.headers_mut().insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
    r
}

/// The endpoint, serving on threads of its own until [`Endpoint::stop`].
pub struct Endpoint {
    addr: std::net::SocketAddr,
    buckets: Vec<String>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Starts serving `roots` as S3 on `opts.listen`.
pub fn start(opts: &Options, roots: Roots) -> Result<Endpoint> {
    check(opts)?;
    let keys = auth::load(&opts.keys_file)?;
    let arbor = service::Arbor::new(roots);
    let (served, unserved) = arbor.served_branches();
    for (b, why) in unserved {
        tracing::warn!(branch = %b, "branch not served as an S3 bucket: {why}");
    }
    // What PUTs left half-written when this server last stopped (killed
    // mid-upload) goes: none of it is an object.
    for b in &served {
        if let Some(t) = arbor.branch_tree(b) {
            match t.clear_temps() {
                Ok(0) => {}
                Ok(n) => tracing::info!(branch = %b, files = n, "removed temporary files of PUTs a stop cut short"),
                Err(e) => tracing::warn!(branch = %b, error = %e, "cannot clear the temporary files of PUTs"),
            }
        }
    }
    let mut builder = S3ServiceBuilder::new(arbor);
    builder.set_auth(auth::simple_auth(&keys));
    let mut domains = opts.domains.clone();
    if domains.is_empty() {
        domains.push(DEFAULT_DOMAIN.into());
    }
    builder.set_host(Hosts(domains));
    builder.set_config(Arc::new(StaticConfigProvider::new(Arc::new(config()))));
    let service = RefuseForms(builder.build());

    let listener = std::net::TcpListener::bind(&opts.listen)
        .map_err(|e| Error::Invalid(format!("--s3 {}: cannot listen: {e}", opts.listen)))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("arbor-s3").build()?;
    let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new().name("arbor-s3-main".into()).spawn(move || {
        rt.block_on(async move {
            let listener = match tokio::net::TcpListener::from_std(listener) {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(error = %e, "the S3 endpoint cannot listen");
                    return;
                }
            };
            let mut http = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            http.http1().timer(TokioTimer::new()).header_read_timeout(conn::HEADER_READ_TIMEOUT);
            http.http2().timer(TokioTimer::new());
            let graceful = hyper_util::server::graceful::GracefulShutdown::new();
            let slots = Arc::new(tokio::sync::Semaphore::new(conn::MAX_CONNECTIONS));
            loop {
                let (socket, slot) = tokio::select! {
                    r = accept(&listener, &slots) => match r {
                        Some(accepted) => accepted,
                        None => continue,
                    },
                    _ = &mut rx => break,
                };
                let _ = socket.set_nodelay(true);
                let io = TokioIo::new(conn::Stalling::new(socket, conn::SEND_STALL_TIMEOUT));
                let conn = http.serve_connection(io, service.clone());
                let conn = graceful.watch(conn.into_owned());
                tokio::spawn(async move {
                    let _ = conn.await;
                    drop(slot);
                });
            }
            // Requests in flight are answered (a PUT placed and synced)
            // before the branches close.
            tokio::select! {
                () = graceful.shutdown() => {}
                () = tokio::time::sleep(Duration::from_secs(30)) => {
                    tracing::warn!("S3 requests still running after 30 s; stopping without them");
                }
            }
        });
        rt.shutdown_timeout(Duration::from_secs(5));
    })?;
    Ok(Endpoint { addr, buckets: served, stop: Some(tx), thread: Some(thread) })
}

/// The next connection, once fewer than [`conn::MAX_CONNECTIONS`] are
/// open; `None` after a failed accept (retried after a pause).
async fn accept(
    listener: &tokio::net::TcpListener,
    slots: &Arc<tokio::sync::Semaphore>,
) -> Option<(tokio::net::TcpStream, tokio::sync::OwnedSemaphorePermit)> {
    let slot = slots.clone().acquire_owned().await.ok()?;
    match listener.accept().await {
        Ok((s, _)) => Some((s, slot)),
        Err(e) => {
            tracing::warn!(error = %e, "S3 endpoint: accept failed");
            tokio::time::sleep(Duration::from_millis(50)).await;
            None
        }
    }
}

impl Endpoint {
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// The branches served as writable buckets.
    pub fn branch_buckets(&self) -> &[String] {
        &self.buckets
    }

    /// Stops accepting requests and waits for those in flight.
    pub fn stop(mut self) {
        self.stop_serving();
    }

    fn stop_serving(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop_serving();
    }
}
