//! A framed connection's bytes on a blocking thread: plain TCP, or TLS
//! over it (see [`crate::wire::tls`]). Both sides of the framed transport read
//! and write through this; the TCP socket beneath stays reachable for its
//! timeouts and its shutdown.

use std::io::{self, Read, Write};
use std::net::TcpStream;

enum Tls {
    Client(rustls::ClientConnection),
    Server(rustls::ServerConnection),
}

pub struct Stream {
    tcp: TcpStream,
    tls: Option<Box<Tls>>,
}

/// Runs `$e` with `$s`, something that reads and writes the stream's
/// plain bytes: the socket itself, or rustls over it.
macro_rules! plain_bytes {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.tls.as_deref_mut() {
            None => {
                let $s = &mut $self.tcp;
                $e
            }
            Some(Tls::Client(c)) => {
                let mut $s = rustls::Stream::new(c, &mut $self.tcp);
                $e
            }
            Some(Tls::Server(c)) => {
                let mut $s = rustls::Stream::new(c, &mut $self.tcp);
                $e
            }
        }
    };
}

/// Runs `$e` with `$c`, the TLS connection (either side's), if there is one.
macro_rules! with_conn {
    ($self:ident, $c:ident => $e:expr, $plain:expr) => {
        match $self.tls.as_deref_mut() {
            None => $plain,
            Some(Tls::Client($c)) => $e,
            Some(Tls::Server($c)) => $e,
        }
    };
}

impl Stream {
    pub fn plain(tcp: TcpStream) -> Stream {
        Stream { tcp, tls: None }
    }

    pub(crate) fn client(tcp: TcpStream, conn: rustls::ClientConnection) -> Stream {
        Stream { tcp, tls: Some(Box::new(Tls::Client(conn))) }
    }

    pub(crate) fn server(tcp: TcpStream, conn: rustls::ServerConnection) -> Stream {
        Stream { tcp, tls: Some(Box::new(Tls::Server(conn))) }
    }

    /// The socket beneath, for its timeouts and shutdown.
    pub fn tcp(&self) -> &TcpStream {
        &self.tcp
    }

    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Plain bytes already decrypted and waiting to be read.
    fn buffered(&mut self) -> usize {
        with_conn!(self, c => c.process_new_packets().map_or(0, |s| s.plaintext_bytes_to_read()), 0)
    }

    /// Waits (within the socket's read timeout, whose expiry is the error)
    /// until a read would return something: bytes, the end, or an error.
    pub fn wait_readable(&mut self) -> io::Result<()> {
        let mut first = [0u8; 1];
        if self.tls.is_none() {
            return self.tcp.peek(&mut first).map(drop);
        }
        // Each round takes the bytes that arrived; records that carry no
        // plain bytes (a key update) do not end the wait.
        loop {
            if self.buffered() > 0 {
                return Ok(());
            }
            if self.tcp.peek(&mut first)? == 0 {
                return Ok(());
            }
            let took = with_conn!(self, c => c.read_tls(&mut self.tcp), Ok(0))?;
            if took == 0 {
                return Ok(());
            }
            if let Err(e) = with_conn!(self, c => c.process_new_packets().map(drop), Ok(())) {
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
        }
    }

    /// Whether a whole frame (a little-endian `u32` length and that many
    /// bytes) is already here to be read, looked at without taking it and
    /// without waiting.
    pub fn frame_waiting(&mut self) -> bool {
        if self.tls.is_none() {
            return crate::wire::frames::frame_waiting(&self.tcp);
        }
        // What arrived is taken in, without waiting (bounded: a few reads).
        for _ in 0..16 {
            let took = with_conn!(self, c => c.read_tls(&mut DontWait(&self.tcp)), Ok(0));
            match took {
                Ok(n) if n > 0 => {
                    if with_conn!(self, c => c.process_new_packets().is_err(), true) {
                        return false;
                    }
                }
                _ => break,
            }
        }
        let ready = self.buffered();
        with_conn!(self, c => {
            use std::io::BufRead;
            match c.reader().fill_buf() {
                Ok(head) if head.len() >= 4 => {
                    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
                    4 + len <= ready
                }
                _ => false,
            }
        }, false)
    }

    /// Whether the peer showed a certificate the server's verifier took
    /// (only a server with a client CA asks for one).
    pub fn peer_certified(&self) -> bool {
        match self.tls.as_deref() {
            Some(Tls::Server(c)) => c.peer_certificates().is_some_and(|c| !c.is_empty()),
            _ => false,
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        plain_bytes!(self, s => s.read(buf))
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        plain_bytes!(self, s => s.write(buf))
    }

    fn flush(&mut self) -> io::Result<()> {
        plain_bytes!(self, s => s.flush())
    }
}

/// Reads from a socket without waiting: `WouldBlock` when nothing is there.
struct DontWait<'a>(&'a TcpStream);

impl Read for DontWait<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid socket and a buffer of the length given;
        // MSG_DONTWAIT never blocks.
        let n = unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

/// A connection the server accepted, on the runtime until its hello is
/// read; then handed to a thread of its own as a blocking [`Stream`].
pub(crate) trait AcceptedStream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {
    /// Whether the client showed a certificate the server's client CA signed.
    fn certified(&self) -> bool;
    fn into_blocking(self) -> io::Result<Stream>;
}

fn blocking(tcp: tokio::net::TcpStream) -> io::Result<TcpStream> {
    let tcp = tcp.into_std()?;
    tcp.set_nonblocking(false)?;
    Ok(tcp)
}

impl AcceptedStream for tokio::net::TcpStream {
    fn certified(&self) -> bool {
        false
    }

    fn into_blocking(self) -> io::Result<Stream> {
        Ok(Stream::plain(blocking(self)?))
    }
}

impl AcceptedStream for tokio_rustls::server::TlsStream<tokio::net::TcpStream> {
    fn certified(&self) -> bool {
        self.get_ref().1.peer_certificates().is_some_and(|c| !c.is_empty())
    }

    fn into_blocking(self) -> io::Result<Stream> {
        // What rustls already read stays in the connection it hands over.
        let (tcp, conn) = self.into_inner();
        Ok(Stream::server(blocking(tcp)?, conn))
    }
}

impl Stream {
    /// A framed connection to `addr` (see [`crate::wire::frames::dial`]), inside
    /// TLS when `tls` is given (its handshake done within `timeout`);
    /// never in clear when it is.
    pub fn dial(
        addr: &str,
        timeout: std::time::Duration,
        tls: Option<&crate::wire::tls::ClientTls>,
    ) -> io::Result<Stream> {
        let tcp = crate::wire::frames::dial(addr, timeout)?;
        let Some(tls) = tls else { return Ok(Stream::plain(tcp)) };
        tcp.set_read_timeout(Some(timeout))?;
        tcp.set_write_timeout(Some(timeout))?;
        let s = tls.dial(addr, tcp)?;
        // As a plain connection comes: the caller sets its own timeouts.
        s.tcp.set_read_timeout(None)?;
        s.tcp.set_write_timeout(None)?;
        Ok(s)
    }
}
