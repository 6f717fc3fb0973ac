//! The server's counters and request latency histogram, rendered in the
//! Prometheus text format by the engine's [`arbor_engine::metrics`].

use arbor_engine::metrics::{Counter, Exposition, Histogram};

#[derive(Default)]
pub(crate) struct Metrics {
    pub hits: Counter,
    pub misses: Counter,
    /// Of the hits and misses, requests for part of a chunk.
    pub parts: Counter,
    /// Segment footers sent (not chunk requests).
    pub footers: Counter,
    pub served_bytes: Counter,
    pub not_found: Counter,
    pub errors: Counter,
    pub unauthorized: Counter,
    /// Source-object requests refused: no import of the disk names them.
    pub refused_objects: Counter,
    /// Chunk connections opened (framed connections for parts).
    pub chunk_connections: Counter,
    /// Connections closed as they were accepted: their peer, or the
    /// server, held as many as it may.
    pub refused_connections: Counter,
    /// Connections closed before their first request: nothing said by
    /// the hello deadline, or a framed hello too large, garbled or late.
    pub failed_hellos: Counter,
    pub latency: Histogram,
}

/// What the cache itself counts, read when rendering.
pub(crate) struct CacheGauges {
    pub bucket_bytes: u64,
    pub bucket_gets: u64,
    /// Bytes of chunks of both kinds in the cache's one budget, and of
    /// those the imported objects' chunk files.
    pub resident_bytes: u64,
    pub imported_bytes: u64,
    pub capacity: u64,
    pub evicted_bytes: u64,
    /// Connections open now (not the cache's, but read at the same time).
    pub open_connections: u64,
}

impl Metrics {
    pub(crate) fn render(&self, cache: &CacheGauges) -> String {
        let mut out = Exposition::new();
        let counter = |out: &mut Exposition, name: &str, help: &str, v: u64| out.counter(name, help, &[], v);
        let gauge = |out: &mut Exposition, name: &str, help: &str, v: u64| out.gauge(name, help, &[], v as f64);
        let get = Counter::get;
        counter(&mut out, "arbor_cache_hits_total", "Chunk requests answered from the cache.", get(&self.hits));
        counter(
            &mut out,
            "arbor_cache_misses_total",
            "Chunk requests that fetched from the bucket.",
            get(&self.misses),
        );
        counter(
            &mut out,
            "arbor_cache_part_requests_total",
            "Of those, requests for part of a chunk (small reads).",
            get(&self.parts),
        );
        counter(&mut out, "arbor_cache_footer_requests_total", "Segment footers sent.", get(&self.footers));
        counter(&mut out, "arbor_cache_served_bytes_total", "Chunk bytes sent to clients.", get(&self.served_bytes));
        counter(
            &mut out,
            "arbor_cache_refused_objects_total",
            "Source-object requests refused: no import of the disk names the object.",
            get(&self.refused_objects),
        );
        counter(
            &mut out,
            "arbor_cache_not_found_total",
            "Requests for no sealed segment or chunk.",
            get(&self.not_found),
        );
        counter(
            &mut out,
            "arbor_cache_errors_total",
            "Requests that failed (the bucket, the cache).",
            get(&self.errors),
        );
        counter(
            &mut out,
            "arbor_cache_unauthorized_total",
            "Requests refused for a missing or wrong token.",
            get(&self.unauthorized),
        );
        counter(
            &mut out,
            "arbor_cache_chunk_connections_total",
            "Framed connections opened for parts of chunks.",
            get(&self.chunk_connections),
        );
        counter(
            &mut out,
            "arbor_cache_refused_connections_total",
            "Connections closed at once: their peer, or the server, held as many as it may.",
            get(&self.refused_connections),
        );
        counter(
            &mut out,
            "arbor_cache_failed_hellos_total",
            "Connections closed before their first request: silent, or a hello too large, garbled or late.",
            get(&self.failed_hellos),
        );
        counter(&mut out, "arbor_cache_bucket_bytes_total", "Bytes fetched from the bucket.", cache.bucket_bytes);
        counter(&mut out, "arbor_cache_bucket_gets_total", "GET requests sent to the bucket.", cache.bucket_gets);
        counter(&mut out, "arbor_cache_evicted_bytes_total", "Bytes evicted from the cache.", cache.evicted_bytes);
        gauge(&mut out, "arbor_cache_resident_bytes", "Bytes of chunks in the cache.", cache.resident_bytes);
        gauge(
            &mut out,
            "arbor_cache_imported_bytes",
            "Of those, bytes of imported objects' chunk files.",
            cache.imported_bytes,
        );
        gauge(&mut out, "arbor_cache_capacity_bytes", "The cache's size limit.", cache.capacity);
        gauge(&mut out, "arbor_open_connections", "Connections open now, of every kind.", cache.open_connections);
        out.histogram("arbor_cache_request_seconds", "Time to answer a chunk request.", &[], &self.latency.snapshot());
        // This process's bucket calls (the cache's misses, and the rest).
        arbor_engine::bucket::BucketMetrics::process().render(&mut out);
        out.finish()
    }
}

/// The value of an unlabelled sample `name` in Prometheus text `text`.
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn histogram_buckets_are_cumulative_and_sum_in_seconds() {
        let m = Metrics::default();
        m.latency.observe(Duration::from_micros(50));
        m.latency.observe(Duration::from_micros(300));
        m.latency.observe(Duration::from_secs(9));
        m.hits.add(3);
        let text = m.render(&CacheGauges {
            bucket_bytes: 7,
            bucket_gets: 1,
            resident_bytes: 5,
            imported_bytes: 2,
            capacity: 10,
            evicted_bytes: 0,
            open_connections: 0,
        });
        assert!(text.contains("arbor_cache_request_seconds_bucket{le=\"0.0001\"} 1\n"), "{text}");
        assert!(text.contains("arbor_cache_request_seconds_bucket{le=\"0.0005\"} 2\n"), "{text}");
        assert!(text.contains("arbor_cache_request_seconds_bucket{le=\"5\"} 2\n"), "{text}");
        assert!(text.contains("arbor_cache_request_seconds_bucket{le=\"+Inf\"} 3\n"), "{text}");
        assert_eq!(sample(&text, "arbor_cache_request_seconds_count"), Some(3.0));
        let parsed = arbor_engine::metrics::parse(&text).expect("Prometheus text");
        assert_eq!(arbor_engine::metrics::find(&parsed, "arbor_cache_resident_bytes", &[]), Some(5.0));
        assert_eq!(arbor_engine::metrics::find(&parsed, "arbor_cache_imported_bytes", &[]), Some(2.0));
        assert_eq!(sample(&text, "arbor_cache_hits_total"), Some(3.0));
        assert_eq!(sample(&text, "arbor_cache_bucket_bytes_total"), Some(7.0));
        let sum = sample(&text, "arbor_cache_request_seconds_sum").expect("sum");
        assert!((sum - 9.00035).abs() < 1e-6, "{sum}");
    }
}
