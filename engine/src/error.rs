//! The engine's one error type and its POSIX errno mapping.

use std::io;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no such file or directory")]
    NotFound,
    #[error("file exists")]
    Exists,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("directory not empty")]
    NotEmpty,
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    #[error("file name too long")]
    NameTooLong,
    #[error("file too large")]
    TooBig,
    #[error("no such extended attribute")]
    NoAttr,
    #[error("extended attribute too large")]
    AttrTooBig,
    #[error("too many links")]
    TooManyLinks,
    #[error("operation not permitted")]
    NotPermitted,
    #[error("read-only volume")]
    ReadOnly,
    #[error("corrupted {what} at {addr}")]
    Corrupted { what: &'static str, addr: String },
    #[error("volume refuses writes after a failed sync")]
    Poisoned,
    #[error("device crashed at failpoint {0}")]
    Crashed(&'static str),
    #[error("object already exists: {0}")]
    AlreadyExists(String),
    #[error("object changed since it was read: {0}")]
    PreconditionFailed(String),
    #[error("no such object: {0}")]
    NoSuchObject(String),
    #[error("busy: {0}")]
    Busy(String),
    /// Another writer took this one's branch; it refuses further writes.
    #[error("fenced off: {0}")]
    Fenced(String),
    /// An imported file's object is not the one its extents name.
    #[error("source object changed: {0}")]
    SourceChanged(String),
    /// The tree needs features this build does not have.
    #[error("this disk needs a newer arbor: {0}")]
    NeedsNewer(String),
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
}

/// What a caller can do about an error, without reading its text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The same call may succeed later: a network or bucket hiccup, a busy
    /// resource, a conditional write that lost a race.
    Transient,
    /// Credentials or file permissions refuse it; retrying will not help.
    Permission,
    /// What it names does not exist.
    NotFound,
    /// Another writer owns the branch now; this writer must stop.
    Fenced,
    /// Stored bytes failed their checksum or make no sense.
    Corrupt,
    /// No space (or quota) left where the bytes go; retry once freed.
    NoSpace,
    /// The request itself is refused (bad input, or what POSIX forbids):
    /// the same call fails the same way.
    Refused,
    /// The volume stopped accepting writes after a failed sync.
    Poisoned,
}

impl Error {
    /// Which [`ErrorKind`] this is.
    pub fn kind(&self) -> ErrorKind {
        use std::io::ErrorKind as Io;
        match self {
            Error::NotFound | Error::NoSuchObject(_) => ErrorKind::NotFound,
            Error::NotPermitted => ErrorKind::Permission,
            Error::Corrupted { .. } | Error::SourceChanged(_) => ErrorKind::Corrupt,
            Error::Poisoned | Error::Crashed(_) => ErrorKind::Poisoned,
            Error::Fenced(_) => ErrorKind::Fenced,
            Error::Busy(_) | Error::PreconditionFailed(_) => ErrorKind::Transient,
            Error::Io(e) => match (e.kind(), e.raw_os_error()) {
                (_, Some(libc::ENOSPC) | Some(libc::EDQUOT)) => ErrorKind::NoSpace,
                (Io::PermissionDenied, _) | (_, Some(libc::EROFS)) => ErrorKind::Permission,
                (Io::NotFound, _) => ErrorKind::NotFound,
                (Io::InvalidInput | Io::InvalidData, _) => ErrorKind::Refused,
                _ => ErrorKind::Transient,
            },
            _ => ErrorKind::Refused,
        }
    }

    /// Whether the same call may succeed if tried again.
    pub fn is_transient(&self) -> bool {
        self.kind() == ErrorKind::Transient
    }

    pub fn corrupted(what: &'static str, addr: impl std::fmt::Display) -> Self {
        let addr = addr.to_string();
        tracing::error!(what, %addr, "corruption detected");
        Error::Corrupted { what, addr }
    }

    /// The errno a POSIX caller sees for this error.
    pub fn errno(&self) -> i32 {
        match self {
            Error::NotFound | Error::NoSuchObject(_) => libc::ENOENT,
            Error::Exists | Error::AlreadyExists(_) => libc::EEXIST,
            Error::NotDir => libc::ENOTDIR,
            Error::IsDir => libc::EISDIR,
            Error::NotEmpty => libc::ENOTEMPTY,
            Error::Invalid(_) => libc::EINVAL,
            Error::NameTooLong => libc::ENAMETOOLONG,
            Error::TooBig => libc::EFBIG,
            Error::NoAttr => libc::ENODATA,
            Error::AttrTooBig => libc::E2BIG,
            Error::TooManyLinks => libc::EMLINK,
            Error::NotPermitted => libc::EPERM,
            Error::ReadOnly => libc::EROFS,
            Error::PreconditionFailed(_) => libc::EAGAIN,
            Error::Corrupted { .. } | Error::SourceChanged(_) | Error::Poisoned | Error::Crashed(_) => libc::EIO,
            Error::NeedsNewer(_) => libc::EOPNOTSUPP,
            Error::Busy(_) | Error::Fenced(_) => libc::EBUSY,
            Error::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_maps_to_a_distinct_meaningful_errno() {
        let cases = [
            (Error::NotFound, libc::ENOENT),
            (Error::Exists, libc::EEXIST),
            (Error::NotDir, libc::ENOTDIR),
            (Error::IsDir, libc::EISDIR),
            (Error::NotEmpty, libc::ENOTEMPTY),
            (Error::Invalid("x"), libc::EINVAL),
            (Error::NameTooLong, libc::ENAMETOOLONG),
            (Error::TooBig, libc::EFBIG),
            (Error::NoAttr, libc::ENODATA),
            (Error::AttrTooBig, libc::E2BIG),
            (Error::TooManyLinks, libc::EMLINK),
            (Error::NotPermitted, libc::EPERM),
            (Error::Busy("x".into()), libc::EBUSY),
            (Error::ReadOnly, libc::EROFS),
            (Error::Poisoned, libc::EIO),
            (Error::corrupted("node", "w1-2@3"), libc::EIO),
            (Error::SourceChanged("s3://b/k".into()), libc::EIO),
            (Error::NeedsNewer("x".into()), libc::EOPNOTSUPP),
            (Error::Io(io::Error::from_raw_os_error(libc::ENOSPC)), libc::ENOSPC),
            (Error::Io(io::Error::other("no errno")), libc::EIO),
        ];
        for (err, errno) in cases {
            assert_eq!(err.errno(), errno, "{err}");
        }
    }

    #[test]
    fn every_error_says_whether_to_retry() {
        use std::io::ErrorKind as Io;
        let cases = [
            (Error::Io(io::Error::from(Io::TimedOut)), ErrorKind::Transient),
            (Error::Io(io::Error::from(Io::ConnectionRefused)), ErrorKind::Transient),
            (Error::PreconditionFailed("k".into()), ErrorKind::Transient),
            (Error::Io(io::Error::from(Io::PermissionDenied)), ErrorKind::Permission),
            (Error::Io(io::Error::from_raw_os_error(libc::EROFS)), ErrorKind::Permission),
            (Error::NotPermitted, ErrorKind::Permission),
            (Error::NoSuchObject("k".into()), ErrorKind::NotFound),
            (Error::NotFound, ErrorKind::NotFound),
            (Error::Fenced("b".into()), ErrorKind::Fenced),
            (Error::corrupted("node", "w1-2@3"), ErrorKind::Corrupt),
            (Error::Io(io::Error::from_raw_os_error(libc::ENOSPC)), ErrorKind::NoSpace),
            (Error::NameTooLong, ErrorKind::Refused),
            (Error::Exists, ErrorKind::Refused),
            (Error::Poisoned, ErrorKind::Poisoned),
        ];
        for (err, kind) in cases {
            assert_eq!(err.kind(), kind, "{err}");
            assert_eq!(err.is_transient(), kind == ErrorKind::Transient, "{err}");
        }
    }
}
