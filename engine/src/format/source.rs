//! The `'S'` record: which object (one version of it) an imported file's
//! external extents read from. A record of the tree (see `engine/FORMAT.md`),
//! and the name of an object whose chunks are cached (`crate::chunks`).

/// `'S' ino` → the object an imported file's external extents read from.
#[derive(Clone, Debug, PartialEq, Eq, bincode::Encode, bincode::Decode)]
pub struct Source {
    pub bucket: String,
    pub key: String,
    /// The object's size when it was imported.
    pub size: u64,
    /// Its ETag then; every read is conditional on it.
    pub etag: String,
    /// Its version id, where the bucket keeps versions: reads ask for that
    /// version, so a checkpoint reads it while the key moves on.
    pub version: Option<String>,
}

impl Source {
    pub fn url(&self) -> String {
        format!("s3://{}/{}", self.bucket, self.key)
    }

    /// One version of one object: bucket, key, ETag and the version id if
    /// any, NUL-separated. Its chunks' bytes never change, wherever they
    /// are cached.
    pub fn id(&self) -> String {
        match &self.version {
            None => format!("{}\0{}\0{}", self.bucket, self.key, self.etag),
            Some(v) => format!("{}\0{}\0{}\0{v}", self.bucket, self.key, self.etag),
        }
    }

    /// Whether `listed` (a listing's entry for this key) is still the
    /// object this names: the same ETag, and the same version where both
    /// know one (a file imported before its bucket kept versions stays
    /// what it was while its ETag does).
    pub fn is_listed(&self, listed: &Source) -> bool {
        self.bucket == listed.bucket
            && self.key == listed.key
            && self.etag == listed.etag
            && (self.version.is_none() || self.version == listed.version)
    }
}
