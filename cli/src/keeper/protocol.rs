//! What `arbor keeper` and a mount say to each other: one JSON object per
//! message on a `SOCK_SEQPACKET` socket, a `/dev/fuse` descriptor riding
//! with a `deposit` request or a `get` answer.
//!
//! ```text
//! → {"hello":"arbor-keeper","version":1}           ← {"ok":true,"version":1,"pid":N}
//! → {"op":"deposit","mountpoint":"/abs"} + fd      ← {"ok":true}
//! → {"op":"get","mountpoint":"/abs"}               ← {"ok":true,"held":true} + fd | {"ok":true,"held":false}
//! → {"op":"release","mountpoint":"/abs"}           ← {"ok":true,"held":WAS}
//! → {"op":"list"}                                  ← {"ok":true,"mountpoints":["/abs",…]}
//! any refusal                                      ← {"ok":false,"error":"…"}
//! ```
//!
//! The hello comes first on every connection; a version the keeper does
//! not speak is refused and the connection closed.

/// The protocol's version; raised on any change either side would misread.
pub const VERSION: u64 = 1;

/// The hello's greeting.
pub const HELLO: &str = "arbor-keeper";
