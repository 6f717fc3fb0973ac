//! What both services put on the wire, and nothing of either: framed
//! connections ([`frames`]: hello, chunk asks, and the envelopes of a
//! branch's requests), the HTTP routes' headers, windows and queries
//! ([`http`]), a connection's blocking stream, plain or TLS ([`stream`],
//! [`tls`]), and the admission of connections before their hello
//! ([`admission`]).
//!
//! One import still runs from here into a service: [`frames`] carries a
//! branch's file operations (`branch::owner::Op`, `Reply`) in its request
//! and answer frames.

pub mod admission;
pub mod frames;
pub mod http;
pub mod stream;
pub mod tls;
pub(crate) mod validity;
