//! arbor's storage engine.
//!
//! Everything that stores bytes lives here: the record format (`format`),
//! the storage devices under the log ([`device`], [`io`]), the append-only
//! segment log ([`log`]), the copy-on-write B+tree ([`tree`]), the POSIX-shaped
//! [`Volume`] API, the [`Files`] trait every way of serving a tree goes
//! through ([`files`]), and the object-store seam ([`bucket`]). The engine
//! knows nothing of FUSE or the command line.

pub mod bucket;
pub mod chunks;
pub mod clock;
pub mod crc;
pub mod device;
pub mod env;
pub mod error;
pub mod files;
pub mod format;
pub mod fsck;
pub mod head;
pub mod io;
pub mod layout;
pub mod log;
pub mod metrics;
pub mod private;
pub mod source;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
pub mod tier;
pub mod tree;
pub mod volume;

pub use error::{Error, ErrorKind, Result};
pub use files::{Caller, Files, Lock};
pub use volume::{Attr, Config, FileKind, RenameMode, SetAttr, StatFs, TimeSet, Volume};
