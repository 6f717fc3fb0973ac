//! A `/metrics` endpoint for a process that serves nothing else over
//! HTTP (a mount): `GET /metrics` answers what `render` returns, in the
//! Prometheus text format; every other request is a `404`.
//!
//! It runs on a thread of its own with a one-thread runtime, so a scrape
//! never waits behind the file system's threads, nor they behind it. It
//! asks for no token: bind it to an address only the scraper reaches.

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{HeaderValue, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

/// What renders the page, called once per scrape.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// A running endpoint; dropping it stops it.
pub struct MetricsExporter {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MetricsExporter {
    /// The address it listens on (the port the system chose for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsExporter {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Listens on `addr` and answers `GET /metrics` with `render()`; fails at
/// once if `addr` cannot be bound.
pub fn serve_metrics(addr: SocketAddr, render: Render) -> std::io::Result<MetricsExporter> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_io().build()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
    let thread = std::thread::Builder::new().name("arbor-metrics".into()).spawn(move || {
        rt.block_on(async move {
            match tokio::net::TcpListener::from_std(listener) {
                Ok(listener) => accept(listener, render, stop_rx).await,
                Err(e) => tracing::error!(error = %e, "the metrics endpoint cannot listen"),
            }
        })
    })?;
    Ok(MetricsExporter { addr, stop: Some(stop_tx), thread: Some(thread) })
}

async fn accept(listener: tokio::net::TcpListener, render: Render, mut stop: tokio::sync::oneshot::Receiver<()>) {
    loop {
        let stream = tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "the metrics endpoint failed to accept a connection");
                    continue;
                }
            },
        };
        let render = render.clone();
        let service = hyper::service::service_fn(move |req| {
            let render = render.clone();
            async move { Ok::<_, Infallible>(answer(&req, &render)) }
        });
        tokio::spawn(async move {
            let served = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
            if let Err(e) = served.await {
                tracing::debug!(error = %e, "a metrics connection ended with an error");
            }
        });
    }
}

fn answer<B>(req: &Request<B>, render: &Render) -> Response<Full<Bytes>> {
    if req.method() != Method::GET || req.uri().path() != "/metrics" {
        let mut r = Response::new(Full::new(Bytes::from_static(b"not found\n")));
        *r.status_mut() = StatusCode::NOT_FOUND;
        return r;
    }
    let mut r = Response::new(Full::new(Bytes::from(render())));
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").expect("send");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read");
        out
    }

    #[test]
    fn answers_metrics_with_what_render_says_and_nothing_else() {
        let n = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let seen = n.clone();
        let render: Render = Arc::new(move || {
            let v = seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            format!("# TYPE t_scrapes_total counter\nt_scrapes_total {v}\n")
        });
        let e = serve_metrics("127.0.0.1:0".parse().expect("addr"), render).expect("serve");
        let first = get(e.local_addr(), "/metrics");
        assert!(first.starts_with("HTTP/1.1 200"), "{first}");
        assert!(first.contains("text/plain; version=0.0.4"), "{first}");
        assert!(first.ends_with("t_scrapes_total 1\n"), "{first}");
        assert!(get(e.local_addr(), "/metrics").ends_with("t_scrapes_total 2\n"));
        assert!(get(e.local_addr(), "/other").starts_with("HTTP/1.1 404"));
        let addr = e.local_addr();
        drop(e);
        assert!(std::net::TcpStream::connect(addr).is_err(), "still listening after drop");
    }

    #[test]
    fn an_address_in_use_is_an_error_at_once() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let render: Render = Arc::new(String::new);
        assert!(serve_metrics(taken.local_addr().expect("addr"), render).is_err());
    }
}
