//! The append-only segment log. One [`Log`] per open branch, one writer
//! epoch per open: records are appended to the open segment, which is
//! sealed (synced, then never written again) at the size limit.

mod behind;
mod buf;
mod reader;
mod writer;

pub use buf::PAGE;
pub use reader::{read_record_at_addr, read_record_at_offset, Cursor, Next, Record};
pub use writer::{Appended, Log};
