use thiserror::Error;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Error)]
pub enum Error {
    #[error("invalid name {0:?}: use 1 to 128 of A-Z a-z 0-9 . _ -")]
    InvalidName(String),
    #[error("no {0} named {1:?}")]
    NotFound(&'static str, String),
    #[error("a {0} named {1:?} already exists")]
    Exists(&'static str, String),
    #[error("branch {0:?} is mounted read-write; unmount it first")]
    Open(String),
    #[error("{0}")]
    Refused(String),
    /// Opening a disk failed; the message says why for a person.
    #[error("{message}")]
    Disk { message: String, errno: i32 },
    #[error(transparent)]
    Engine(#[from] arbor_engine::Error),
}

impl Error {
    /// The errno a POSIX caller would see.
    pub fn errno(&self) -> i32 {
        match self {
            Error::InvalidName(_) => libc::EINVAL,
            Error::NotFound(..) => libc::ENOENT,
            Error::Exists(..) => libc::EEXIST,
            Error::Open(_) => libc::EBUSY,
            Error::Refused(_) => libc::EPERM,
            Error::Disk { errno, .. } => *errno,
            Error::Engine(e) => e.errno(),
        }
    }
}
