//! Bytes on disk: record headers, addresses and the small binary codec that
//! every decoder of untrusted bytes uses. See `engine/FORMAT.md`.

mod address;
mod codec;
mod record;
mod source;
mod superblock;

pub use address::{Addr, SegId};
pub(crate) use codec::DECODE_LIMIT;
pub use codec::{decode_value, encode_value, Reader, Writer};
pub use record::{
    block_crcs, RecordHeader, RecordKind, ALIGN_DATA_MIN, BLOCK_SIZE, FORMAT_VERSION, HEADER_LEN, MAGIC, MAX_PAYLOAD,
};
pub use source::Source;
pub use superblock::Superblock;
