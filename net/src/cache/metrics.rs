//! The server's counters and request latency histogram, rendered in the
//! Prometheus text format.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency histogram's buckets, in seconds.
const BOUNDS: [f64; 14] = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0];

#[derive(Default)]
pub(crate) struct Histogram {
    /// Non-cumulative counts per bucket, the last one for +Inf.
    counts: [AtomicU64; BOUNDS.len() + 1],
    sum_ns: AtomicU64,
}

impl Histogram {
    pub(crate) fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = BOUNDS.iter().position(|&b| s <= b).unwrap_or(BOUNDS.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut total = 0;
        for (i, c) in self.counts.iter().enumerate() {
            total += c.load(Ordering::Relaxed);
            match BOUNDS.get(i) {
                Some(b) => {
                    let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {total}");
                }
                None => {
                    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {total}");
                }
            }
        }
        let _ = writeln!(out, "{name}_sum {}", self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9);
        let _ = writeln!(out, "{name}_count {total}");
    }
}

#[derive(Default)]
pub(crate) struct Metrics {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    /// Of the hits and misses, requests for part of a chunk.
    pub parts: AtomicU64,
    /// Segment footers sent (not chunk requests).
    pub footers: AtomicU64,
    pub served_bytes: AtomicU64,
    pub not_found: AtomicU64,
    pub errors: AtomicU64,
    pub unauthorized: AtomicU64,
    /// Source-object requests refused: no import of the disk names them.
    pub refused_objects: AtomicU64,
    /// Chunk connections opened (framed connections for parts).
    pub chunk_connections: AtomicU64,
    /// Connections closed as they were accepted: their peer, or the
    /// server, held as many as it may.
    pub refused_connections: AtomicU64,
    /// Connections closed before their first request: nothing said by
    /// the hello deadline, or a framed hello too large, garbled or late.
    pub failed_hellos: AtomicU64,
    pub latency: Histogram,
}

/// What the cache itself counts, read when rendering.
pub(crate) struct CacheGauges {
    pub bucket_bytes: u64,
    pub bucket_gets: u64,
    pub resident_bytes: u64,
    pub capacity: u64,
    pub evicted_bytes: u64,
    /// Connections open now (not the cache's, but read at the same time).
    pub open_connections: u64,
}

impl Metrics {
    pub(crate) fn render(&self, cache: &CacheGauges) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
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
        gauge(&mut out, "arbor_cache_capacity_bytes", "The cache's size limit.", cache.capacity);
        gauge(&mut out, "arbor_open_connections", "Connections open now, of every kind.", cache.open_connections);
        self.latency.render("arbor_cache_request_seconds", "Time to answer a chunk request.", &mut out);
        out
    }
}

/// The value of an unlabelled sample `name` in Prometheus text `text`.
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_sum_in_seconds() {
        let m = Metrics::default();
        m.latency.observe(Duration::from_micros(50));
        m.latency.observe(Duration::from_micros(300));
        m.latency.observe(Duration::from_secs(9));
        m.hits.fetch_add(3, Ordering::Relaxed);
        let text = m.render(&CacheGauges {
            bucket_bytes: 7,
            bucket_gets: 1,
            resident_bytes: 5,
            capacity: 10,
            evicted_bytes: 0,
            open_connections: 0,
        });
        assert!(text.contains("arbor_cache_request_seconds_bucket{le=\"0.0001\"} 1\n"), "{text}");
        assert!(text.contains("arbor_cache_request_seconds_bucket{le=\"0.0005\"} 2\n"), "{text}");
        assert!(text.contains("arbor_cache_request_seconds_bucket{le=\"5\"} 2\n"), "{text}");
        assert!(text.contains("arbor_cache_request_seconds_bucket{le=\"+Inf\"} 3\n"), "{text}");
        assert_eq!(sample(&text, "arbor_cache_request_seconds_count"), Some(3.0));
        assert_eq!(sample(&text, "arbor_cache_hits_total"), Some(3.0));
        assert_eq!(sample(&text, "arbor_cache_bucket_bytes_total"), Some(7.0));
        let sum = sample(&text, "arbor_cache_request_seconds_sum").expect("sum");
        assert!((sum - 9.00035).abs() < 1e-6, "{sum}");
    }
}
