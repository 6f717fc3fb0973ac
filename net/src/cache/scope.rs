//! Which source objects a cache server fetches for its clients: those
//! under a prefix an imported tree of its disk names (`arbor import`
//! records each one in the disk's store). The server reads them with its
//! own credentials, so without this a token holder could read any object
//! those credentials reach.
//!
//! The prefixes are read again at most every [`RELOAD`], and at most every
//! [`RELOAD_ON_MISS`] when an object outside them is asked for (an import
//! made while the server runs becomes servable within that).

use arbor_engine::source::Source;
use parking_lot::Mutex;
use std::time::{Duration, Instant};

/// How long a reading of the import records is used.
pub const RELOAD: Duration = Duration::from_secs(60);
/// How soon an object outside the prefixes makes them read again.
pub const RELOAD_ON_MISS: Duration = Duration::from_secs(2);

/// Reads the (bucket, key prefix) of every import of the served disk.
pub type LoadImports = Box<dyn Fn() -> Result<Vec<(String, String)>, String> + Send + Sync>;

/// The (bucket, key prefix) pairs, and when they were read (`None`: never).
type Reading = (Vec<(String, String)>, Option<Instant>);

pub struct ObjectScope {
    load: LoadImports,
    state: Mutex<Reading>,
}

impl std::fmt::Debug for ObjectScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectScope").field("prefixes", &self.state.lock().0).finish()
    }
}

impl ObjectScope {
    pub fn new(load: LoadImports) -> ObjectScope {
        ObjectScope { load, state: Mutex::new((Vec::new(), None)) }
    }

    /// A scope of these (bucket, key prefix) pairs, never read again.
    pub fn fixed(prefixes: Vec<(String, String)>) -> ObjectScope {
        let again = prefixes.clone();
        ObjectScope::new(Box::new(move || Ok(again.clone())))
    }

    /// `Ok` if an import of the disk names `src`; otherwise why not, in one
    /// line. May read the import records (a bucket LIST and GETs): call it
    /// where blocking is allowed. Records that cannot be read leave the
    /// last reading in place (none: nothing is served).
    pub fn check(&self, src: &Source) -> Result<(), String> {
        let mut state = self.state.lock();
        let mut failed = None;
        let mut fresh = false;
        if state.1.is_none_or(|t| t.elapsed() >= RELOAD) {
            failed = self.reload(&mut state);
            fresh = true;
        }
        if !names(&state.0, src) && !fresh && state.1.is_none_or(|t| t.elapsed() >= RELOAD_ON_MISS) {
            failed = self.reload(&mut state);
        }
        if names(&state.0, src) {
            return Ok(());
        }
        let why = failed.map(|e| format!(" (cannot read its import records: {e})")).unwrap_or_default();
        Err(format!("{} is not under an import of this server's disk{why}", src.url()))
    }

    /// Reads the prefixes again; the error if they cannot be read (the
    /// last reading stays, and is tried again no sooner than a miss allows).
    fn reload(&self, state: &mut Reading) -> Option<String> {
        let got = (self.load)();
        state.1 = Some(Instant::now());
        match got {
            Ok(prefixes) => {
                state.0 = prefixes;
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the disk's import records");
                Some(e)
            }
        }
    }
}

/// Whether one of `prefixes` holds `src`'s key in its bucket.
fn names(prefixes: &[(String, String)], src: &Source) -> bool {
    prefixes.iter().any(|(bucket, prefix)| *bucket == src.bucket && src.key.starts_with(prefix.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src(bucket: &str, key: &str) -> Source {
        Source { bucket: bucket.into(), key: key.into(), size: 1, etag: "\"e\"".into(), version: None }
    }

    #[test]
    fn only_keys_under_an_imported_prefix_of_its_bucket() {
        let scope = ObjectScope::fixed(vec![("corpus".into(), "raw/v1/".into()), ("whole".into(), String::new())]);
        assert!(scope.check(&src("corpus", "raw/v1/a/b.tar")).is_ok());
        assert!(scope.check(&src("whole", "anything")).is_ok());
        let no = scope.check(&src("corpus", "raw/v10/secret")).expect_err("a sibling prefix");
        assert!(no.contains("s3://corpus/raw/v10/secret") && !no.contains('\n'), "{no}");
        assert!(scope.check(&src("other", "raw/v1/a/b.tar")).is_err(), "another bucket");
    }

    #[test]
    fn an_import_made_later_is_found_and_a_failed_read_refuses() {
        let prefixes = std::sync::Arc::new(Mutex::new(Vec::new()));
        let fail = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (p, f) = (prefixes.clone(), fail.clone());
        let scope = ObjectScope::new(Box::new(move || {
            if f.load(std::sync::atomic::Ordering::Relaxed) {
                return Err("bucket away".into());
            }
            Ok(p.lock().clone())
        }));
        assert!(scope.check(&src("corpus", "a")).is_err());
        prefixes.lock().push(("corpus".to_string(), String::new()));
        scope.state.lock().1 = Some(Instant::now() - RELOAD_ON_MISS);
        assert!(scope.check(&src("corpus", "a")).is_ok(), "read again on a miss");
        fail.store(true, std::sync::atomic::Ordering::Relaxed);
        scope.state.lock().1 = Some(Instant::now() - RELOAD);
        assert!(scope.check(&src("corpus", "a")).is_ok(), "the last reading stays");
        scope.state.lock().1 = Some(Instant::now() - RELOAD);
        assert!(scope.check(&src("elsewhere", "a")).expect_err("unreadable").contains("bucket away"));
    }
}
