//! What can go wrong opening a disk, a branch or a checkpoint on this
//! node, as a kind a front end can match.

/// The node's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An option, a name or the disk's state rules the request out.
    #[error("{0}")]
    Invalid(String),
    /// The branch is open for writing by another process.
    #[error("{0}")]
    Busy(String),
    /// The branch's owner could not be found or reached.
    #[error("{0}")]
    NoOwner(String),
    #[error(transparent)]
    Catalog(#[from] arbor_snapshot::Error),
    #[error(transparent)]
    Engine(#[from] arbor_engine::Error),
    #[error(transparent)]
    Net(#[from] arbor_net::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A stop ran out of time before the bucket took a branch's last bytes.
    #[error("{0}")]
    NotClosed(crate::owner::Left),
    /// What was being done when `source` failed.
    #[error("{what}")]
    Context { what: String, source: Box<Error> },
}

impl Error {
    /// This error, said to have happened while doing `what`.
    pub fn context(self, what: impl Into<String>) -> Error {
        Error::Context { what: what.into(), source: Box::new(self) }
    }
}

/// `e` and what caused it, as one line: "what: why: …".
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

/// [`Error::context`] on a result.
pub trait Context<T> {
    fn context(self, what: impl Into<String>) -> Result<T>;
}

impl<T, E: Into<Error>> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| e.into().context(what))
    }
}
