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
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
}

impl Error {
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
            Error::Corrupted { .. } | Error::Poisoned | Error::Crashed(_) => libc::EIO,
            Error::Busy(_) => libc::EBUSY,
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
            (Error::Io(io::Error::from_raw_os_error(libc::ENOSPC)), libc::ENOSPC),
            (Error::Io(io::Error::other("no errno")), libc::EIO),
        ];
        for (err, errno) in cases {
            assert_eq!(err.errno(), errno, "{err}");
        }
    }
}
