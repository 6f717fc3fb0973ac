//! Admission to `arbor serve`'s port: what a connection may cost before
//! its token is checked. Every node of a cluster reaches the port, so a
//! connection is counted against caps per peer and in total as it is
//! accepted (over them it is closed at once), and a framed connection's
//! hello is read on the runtime, within [`HELLO_DEADLINE`] of the accept
//! and in at most [`HELLO_MAX`](crate::wire::frames::HELLO_MAX) bytes, before
//! anything is spawned for it: a thread of its own comes only with the
//! token (see the listener, `server`). On a server with TLS the handshake is
//! inside the same deadline: it starts at the accept and the hello must
//! be read by the deadline too.
//!
//! This module reads nothing past the hello and decides nothing about the
//! token; it counts and reads.

use crate::wire::frames::{decode_hello, hello_len, Hello, MAGIC};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// Connections one peer address may hold open at once (an IPv6 peer by its
/// /64, the block one host is given). A client mount holds a few dozen.
pub const MAX_CONNS_PER_PEER: usize = 256;
/// Connections the server holds open at once, from every peer.
pub const MAX_CONNS: usize = 4096;
/// How long after it is accepted a framed connection has to complete its
/// hello; it is closed then.
pub const HELLO_DEADLINE: Duration = Duration::from_secs(2);

/// The caps a server admits connections under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    pub per_peer: usize,
    pub total: usize,
    pub hello_deadline: Duration,
}

impl Default for ConnLimits {
    fn default() -> ConnLimits {
        ConnLimits { per_peer: MAX_CONNS_PER_PEER, total: MAX_CONNS, hello_deadline: HELLO_DEADLINE }
    }
}

/// The connections open now, by peer.
pub(crate) struct Admission {
    limits: ConnLimits,
    open: Mutex<Open>,
}

#[derive(Default)]
struct Open {
    total: usize,
    by_peer: HashMap<IpAddr, usize>,
}

/// One admitted connection's place under the caps, given back when dropped.
pub(crate) struct Admitted {
    admission: Arc<Admission>,
    peer: IpAddr,
}

impl Admission {
    pub(crate) fn new(limits: ConnLimits) -> Arc<Admission> {
        Arc::new(Admission { limits, open: Mutex::new(Open::default()) })
    }

    pub(crate) fn limits(&self) -> ConnLimits {
        self.limits
    }

    /// A place for a connection from `peer`, or `None` when the peer or the
    /// server holds as many as it may.
    pub(crate) fn admit(self: &Arc<Self>, peer: IpAddr) -> Option<Admitted> {
        let peer = peer_key(peer);
        let mut open = self.open.lock();
        if open.total >= self.limits.total {
            return None;
        }
        let held = open.by_peer.entry(peer).or_default();
        if *held >= self.limits.per_peer {
            return None;
        }
        *held += 1;
        open.total += 1;
        Some(Admitted { admission: self.clone(), peer })
    }

    /// Connections open now.
    pub(crate) fn open(&self) -> usize {
        self.open.lock().total
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut open = self.admission.open.lock();
        open.total -= 1;
        if let Some(held) = open.by_peer.get_mut(&self.peer) {
            *held -= 1;
            if *held == 0 {
                open.by_peer.remove(&self.peer);
            }
        }
    }
}

/// The address a peer is counted under: an IPv4 one as itself (also when
/// it arrives mapped into IPv6), an IPv6 one by its /64.
fn peer_key(peer: IpAddr) -> IpAddr {
    match peer.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        v4 => v4,
    }
}

/// Reads a framed connection's [`MAGIC`] and [`Hello`], and nothing after
/// them: at most 8 bytes and [`HELLO_MAX`](crate::wire::frames::HELLO_MAX)
/// more, into a buffer that grows as they arrive. The caller bounds the
/// time.
pub(crate) async fn read_hello(stream: &mut (impl tokio::io::AsyncRead + Unpin)) -> io::Result<Hello> {
    let mut head = [0u8; 4];
    stream.read_exact(&mut head).await?;
    if head != MAGIC {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "not a framed connection"));
    }
    stream.read_exact(&mut head).await?;
    let len = hello_len(head)?;
    let mut frame = Vec::new();
    (&mut *stream).take(len as u64).read_to_end(&mut frame).await?;
    if frame.len() != len {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "a hello cut short"));
    }
    decode_hello(&frame)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(per_peer: usize, total: usize) -> ConnLimits {
        ConnLimits { per_peer, total, ..ConnLimits::default() }
    }

    #[test]
    fn a_peer_and_the_server_hold_at_most_their_caps_and_get_places_back() {
        let a = Admission::new(limits(2, 3));
        let (p, q): (IpAddr, IpAddr) = ("10.0.0.1".parse().expect("ip"), "10.0.0.2".parse().expect("ip"));
        let p1 = a.admit(p).expect("first");
        let p2 = a.admit(p).expect("second");
        assert!(a.admit(p).is_none(), "a third from one peer");
        let q1 = a.admit(q).expect("another peer");
        assert!(a.admit(q).is_none(), "past the total");
        assert_eq!(a.open(), 3);
        drop(p1);
        assert!(a.admit(q).is_some(), "a place given back");
        drop((p2, q1));
        assert_eq!(a.open(), 0);
        assert!(a.open.lock().by_peer.is_empty(), "no peer kept at zero");
    }

    #[test]
    fn ipv6_peers_count_by_their_64_and_mapped_ipv4_as_itself() {
        let a = Admission::new(limits(1, 10));
        let _one = a.admit("2001:db8::1".parse().expect("ip")).expect("first");
        assert!(a.admit("2001:db8::2".parse().expect("ip")).is_none(), "the same /64");
        assert!(a.admit("2001:db8:0:1::1".parse().expect("ip")).is_some(), "another /64");
        let _v4 = a.admit("10.0.0.1".parse().expect("ip")).expect("v4");
        assert!(a.admit("::ffff:10.0.0.1".parse().expect("ip")).is_none(), "mapped is the same peer");
    }
}
