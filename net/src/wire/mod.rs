//! What both services put on the wire, and nothing of either: framed
//! connections ([`frames`]: the frame itself, hello, chunk asks; a
//! branch's requests are any bincode type to it), the HTTP routes' headers, windows and queries
//! ([`http`]), a connection's blocking stream, plain or TLS ([`stream`],
//! [`tls`]), and the admission of connections before their hello
//! ([`admission`]).
//!
//! Nothing here imports a service: a branch's request and answer frames
//! are the branch's own (`branch::frames`), built on [`frames`]'
//! `write_frame`, `read_frame` and payloads.

pub mod admission;
pub mod frames;
pub mod http;
pub mod stream;
pub mod tls;
pub(crate) mod validity;
