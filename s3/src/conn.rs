//! What one client may hold of the server: how many connections, how
//! long it may take to send a request's head or the next chunk of a
//! body, and how long it may leave an answer unread. Each bound frees
//! what a stalled or hostile client would otherwise keep forever: a
//! task, a socket, a file held open under a GET, a temporary file.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Connections served at once; the next waits in the listen queue.
pub const MAX_CONNECTIONS: usize = 1024;

/// How long a request's head may take to arrive, counted from the
/// connection's first byte or the end of its previous answer (so an
/// idle kept-alive connection is closed after it too).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a request body may pause between two chunks.
pub const BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// How long an answer may wait for the client to read more of it.
pub const SEND_STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// A connection whose writes fail once one has waited
/// [`SEND_STALL_TIMEOUT`] for the client to read: hyper has no write
/// timeout, and a GET whose client stopped reading would hold its file
/// and task open for as long as the client keeps the socket.
pub struct Stalling<T> {
    inner: T,
    stall: Duration,
    deadline: Option<Pin<Box<Sleep>>>,
}

impl<T> Stalling<T> {
    pub fn new(inner: T, stall: Duration) -> Stalling<T> {
        Stalling { inner, stall, deadline: None }
    }

    /// After a write was refused for now: fails if it has been refused
    /// for too long, else waits to be woken by the socket or the timer.
    fn pending<R>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<R>> {
        let stall = self.stall;
        let d = self.deadline.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(Instant::now() + stall)));
        match d.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client read nothing of its answer for too long",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn progressed<R>(&mut self, r: Poll<io::Result<R>>, cx: &mut Context<'_>) -> Poll<io::Result<R>> {
        match r {
            Poll::Pending => self.pending(cx),
            ready => {
                self.deadline = None;
                ready
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Stalling<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Stalling<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.progressed(r, cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.progressed(r, cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.progressed(r, cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.progressed(r, cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that never takes a byte.
    struct Stuck;

    impl AsyncWrite for Stuck {
        fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, _: &[u8]) -> Poll<io::Result<usize>> {
            Poll::Pending
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_the_client_never_takes_fails_after_the_stall_timeout() {
        let mut s = Stalling::new(Stuck, Duration::from_secs(60));
        let started = Instant::now();
        let write = std::future::poll_fn(|cx| Pin::new(&mut s).poll_write(cx, b"answer"));
        let e = write.await.expect_err("a stalled write fails");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(60));
    }
}
