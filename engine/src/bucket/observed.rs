//! Every bucket call, watched: a `tracing` span with the call, its key and
//! its bytes, and per-kind counts, bytes, errors and latencies.
//!
//! It wraps the whole store (retries included), so one call here is one
//! call of the engine, however many tries it took. It changes nothing the
//! store answers.

use super::{ETag, ObjectInfo, ObjectStore};
use crate::error::Result;
use crate::metrics::{Counter, Exposition, Histogram};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// The kinds of bucket call, as metrics name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Get,
    Put,
    List,
    Delete,
    Head,
}

const KINDS: [Kind; 5] = [Kind::Get, Kind::Put, Kind::List, Kind::Delete, Kind::Head];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Get => "get",
            Kind::Put => "put",
            Kind::List => "list",
            Kind::Delete => "delete",
            Kind::Head => "head",
        }
    }
}

/// What one kind of call did.
#[derive(Debug)]
struct Calls {
    count: Counter,
    errors: Counter,
    latency: Histogram,
}

impl Calls {
    const fn new() -> Calls {
        Calls { count: Counter::new(), errors: Counter::new(), latency: Histogram::new() }
    }
}

/// Bucket calls of one process (or of one store, in tests).
#[derive(Debug)]
pub struct BucketMetrics {
    calls: [Calls; KINDS.len()],
    read_bytes: Counter,
    written_bytes: Counter,
}

impl Default for BucketMetrics {
    fn default() -> Self {
        BucketMetrics::new()
    }
}

static PROCESS: BucketMetrics = BucketMetrics::new();

impl BucketMetrics {
    pub const fn new() -> BucketMetrics {
        BucketMetrics {
            calls: [const { Calls::new() }; KINDS.len()],
            read_bytes: Counter::new(),
            written_bytes: Counter::new(),
        }
    }

    /// What every store opened with [`ObservedStore::new`] in this process counts into.
    pub fn process() -> &'static BucketMetrics {
        &PROCESS
    }

    fn of(&self, kind: Kind) -> &Calls {
        &self.calls[kind as usize]
    }

    /// Calls of kind `kind` (`get`, `put`, `list`, `delete`, `head`) so far.
    pub fn calls(&self, kind: &str) -> u64 {
        KINDS.iter().find(|k| k.name() == kind).map_or(0, |k| self.of(*k).count.get())
    }

    /// Body bytes read from and written to the bucket.
    pub fn bytes(&self) -> (u64, u64) {
        (self.read_bytes.get(), self.written_bytes.get())
    }

    pub fn render(&self, page: &mut Exposition) {
        for k in KINDS {
            let c = self.of(k);
            let labels = [("op", k.name())];
            page.counter(
                "arbor_bucket_requests_total",
                "Bucket calls, retries included in one.",
                &labels,
                c.count.get(),
            );
            page.counter(
                "arbor_bucket_errors_total",
                "Bucket calls that failed (after retries).",
                &labels,
                c.errors.get(),
            );
        }
        for k in KINDS {
            page.histogram(
                "arbor_bucket_request_seconds",
                "Time a bucket call took, retries included.",
                &[("op", k.name())],
                &self.of(k).latency.snapshot(),
            );
        }
        page.counter("arbor_bucket_read_bytes_total", "Body bytes read from the bucket.", &[], self.read_bytes.get());
        page.counter(
            "arbor_bucket_written_bytes_total",
            "Body bytes written to the bucket.",
            &[],
            self.written_bytes.get(),
        );
    }
}

/// A store whose calls are traced and counted.
pub struct ObservedStore {
    inner: Arc<dyn ObjectStore>,
    metrics: &'static BucketMetrics,
}

impl ObservedStore {
    /// `inner`, counting into [`BucketMetrics::process`].
    pub fn new(inner: Arc<dyn ObjectStore>) -> Arc<ObservedStore> {
        Self::counting_into(inner, BucketMetrics::process())
    }

    /// `inner`, counting into `metrics` (a test's own).
    pub fn counting_into(inner: Arc<dyn ObjectStore>, metrics: &'static BucketMetrics) -> Arc<ObservedStore> {
        Arc::new(ObservedStore { inner, metrics })
    }

    /// Runs `call` of kind `kind` on `key` in a span; `sent`: body bytes
    /// going out, `got`: how many bytes its answer brought.
    fn call<T>(
        &self,
        kind: Kind,
        key: &str,
        sent: u64,
        call: impl FnOnce() -> Result<T>,
        got: fn(&T) -> u64,
    ) -> Result<T> {
        let span = tracing::debug_span!("bucket", op = kind.name(), key, bytes = sent);
        let _in = span.enter();
        let start = Instant::now();
        let r = call();
        let c = self.metrics.of(kind);
        c.latency.observe(start.elapsed());
        c.count.inc();
        match &r {
            Ok(v) => {
                let n = got(v);
                if n > 0 {
                    span.record("bytes", n);
                }
                self.metrics.read_bytes.add(n);
                self.metrics.written_bytes.add(sent);
            }
            Err(_) => c.errors.inc(),
        }
        r
    }
}

fn nothing<T>(_: &T) -> u64 {
    0
}

fn body_len(v: &[u8]) -> u64 {
    v.len() as u64
}

impl ObjectStore for ObservedStore {
    fn put(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.call(Kind::Put, key, body.len() as u64, || self.inner.put(key, body), nothing)
    }

    fn put_if_absent(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.call(Kind::Put, key, body.len() as u64, || self.inner.put_if_absent(key, body), nothing)
    }

    fn put_if_match(&self, key: &str, body: &[u8], etag: &str) -> Result<ETag> {
        self.call(Kind::Put, key, body.len() as u64, || self.inner.put_if_match(key, body, etag), nothing)
    }

    fn put_large(&self, key: &str, body: &[u8]) -> Result<ETag> {
        self.call(Kind::Put, key, body.len() as u64, || self.inner.put_large(key, body), nothing)
    }

    fn put_from(&self, key: &str, len: u64, fill: &mut dyn FnMut(u64, &mut [u8]) -> Result<()>) -> Result<ETag> {
        self.call(Kind::Put, key, len, || self.inner.put_from(key, len, fill), nothing)
    }

    fn get(&self, key: &str) -> Result<(Vec<u8>, ETag)> {
        self.call(Kind::Get, key, 0, || self.inner.get(key), |(body, _)| body.len() as u64)
    }

    fn get_range(&self, key: &str, range: Range<u64>) -> Result<Vec<u8>> {
        self.call(Kind::Get, key, 0, || self.inner.get_range(key, range), |b| body_len(b))
    }

    fn get_range_if(&self, key: &str, range: Range<u64>, etag: &str, version: Option<&str>) -> Result<Vec<u8>> {
        self.call(Kind::Get, key, 0, || self.inner.get_range_if(key, range, etag, version), |b| body_len(b))
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>> {
        self.call(Kind::List, prefix, 0, || self.inner.list(prefix), nothing)
    }

    fn list_objects(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.call(Kind::List, prefix, 0, || self.inner.list_objects(prefix), nothing)
    }

    fn size(&self, key: &str) -> Result<u64> {
        self.call(Kind::Head, key, 0, || self.inner.size(key), nothing)
    }

    fn get_tail(&self, key: &str, len: u64) -> Result<(Vec<u8>, u64)> {
        self.call(Kind::Get, key, 0, || self.inner.get_tail(key, len), |(body, _)| body.len() as u64)
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.call(Kind::Delete, key, 0, || self.inner.delete(key), nothing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket::{Fault, FaultStore, MemObjectStore};
    use crate::metrics::{find, parse};

    #[test]
    fn calls_bytes_and_errors_are_counted_by_kind() {
        static M: BucketMetrics = BucketMetrics::new();
        let mem: Arc<dyn ObjectStore> = Arc::new(MemObjectStore::default());
        let faults = FaultStore::new(mem);
        let store = ObservedStore::counting_into(faults.clone(), &M);
        store.put("a/b", &[7; 100]).expect("put");
        store.put_if_absent("a/c", &[7; 20]).expect("put");
        assert_eq!(store.get_range("a/b", 10..40).expect("get").len(), 30);
        assert_eq!(store.get("a/c").expect("get").0.len(), 20);
        assert_eq!(store.list("a/").expect("list").len(), 2);
        faults.inject(Fault::Fail(1));
        assert!(store.put("a/d", &[1; 5]).is_err());
        store.delete("a/b").expect("delete");

        assert_eq!((M.calls("put"), M.calls("get"), M.calls("list"), M.calls("delete")), (3, 2, 1, 1));
        assert_eq!(M.bytes(), (50, 120));
        let mut page = Exposition::new();
        M.render(&mut page);
        let s = parse(&page.finish()).expect("parses");
        assert_eq!(find(&s, "arbor_bucket_errors_total", &[("op", "put")]), Some(1.0));
        assert_eq!(find(&s, "arbor_bucket_request_seconds_count", &[("op", "get")]), Some(2.0));
        assert_eq!(find(&s, "arbor_bucket_request_seconds_bucket", &[("op", "put"), ("le", "+Inf")]), Some(3.0));
        assert_eq!(find(&s, "arbor_bucket_read_bytes_total", &[]), Some(50.0));
    }
}
