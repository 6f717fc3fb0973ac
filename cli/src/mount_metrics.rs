//! A mount's `/metrics` (`arbor mount --metrics ADDR`): its FUSE
//! operations, its bucket calls, and what its chunk caches already count
//! for `arbor status`, in the Prometheus text format. `docs/metrics.md`
//! lists the names.

use crate::disk::Disk;
use anyhow::{Context, Result};
use arbor_engine::bucket::BucketMetrics;
use arbor_engine::metrics::Exposition;
use arbor_engine::Volume;
use arbor_net::exporter::{serve_metrics, MetricsExporter};
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

/// Where a mount's metrics are read from.
pub struct Sources {
    /// Set once the file system is mounted.
    pub fuse: Arc<OnceLock<Arc<arbor_fs::Counters>>>,
    pub disk: Arc<Disk>,
    /// The volume on this node (`None`: a mount through a branch's owner).
    pub vol: Option<Arc<Volume>>,
    pub servers: Option<Arc<arbor_net::CacheClient>>,
}

impl Sources {
    /// Serves `GET /metrics` on `addr` until the answer is dropped.
    pub fn serve(self, addr: SocketAddr) -> Result<MetricsExporter> {
        let exporter = serve_metrics(addr, Arc::new(move || self.render()))
            .with_context(|| format!("cannot serve --metrics on {addr}"))?;
        tracing::info!(addr = %exporter.local_addr(), "serving /metrics");
        Ok(exporter)
    }

    pub fn render(&self) -> String {
        let mut page = Exposition::new();
        if let Some(fuse) = self.fuse.get() {
            fuse.render(&mut page);
        }
        BucketMetrics::process().render(&mut page);
        self.render_chunk_cache(&mut page);
        self.render_imports(&mut page);
        self.render_cache_servers(&mut page);
        page.finish()
    }

    /// The segment chunk cache of an s3:// disk (a local folder's
    /// segments are read in place: none).
    fn render_chunk_cache(&self, page: &mut Exposition) {
        let Some(t) = self.disk.tier_stats() else { return };
        let c = &t.cache;
        let counters: [(&str, &str, u64); 8] = [
            ("arbor_mount_cache_hits_total", "Chunk reads the local cache answered.", c.hits),
            ("arbor_mount_cache_bucket_gets_total", "GETs the cache sent to the bucket for chunks.", c.gets),
            ("arbor_mount_cache_bucket_bytes_total", "Bytes the cache fetched from the bucket.", c.fetched_bytes),
            (
                "arbor_mount_cache_server_bytes_total",
                "Chunk bytes cache servers gave.",
                c.peer_bytes + c.peer_part_bytes,
            ),
            ("arbor_mount_cache_evicted_bytes_total", "Bytes evicted from the cache.", c.evicted_bytes),
            (
                "arbor_mount_cache_checksum_retries_total",
                "Chunks read again after a checksum failed.",
                c.checksum_retries,
            ),
            ("arbor_mount_uploaded_bytes_total", "Segment bytes uploaded to the bucket.", t.uploaded_bytes),
            ("arbor_mount_upload_failures_total", "Segment uploads that failed (and are retried).", t.upload_failures),
        ];
        for (name, help, v) in counters {
            page.counter(name, help, &[], v);
        }
        let resident = (c.cached_bytes + c.object_bytes) as f64;
        page.gauge("arbor_mount_cache_resident_bytes", "Bytes of chunks in the cache.", &[], resident);
        let imported = c.object_bytes as f64;
        page.gauge("arbor_mount_cache_imported_bytes", "Of those, bytes of imported files' chunks.", &[], imported);
        page.gauge("arbor_mount_cache_capacity_bytes", "The cache's size limit.", &[], c.capacity as f64);
        page.gauge("arbor_mount_pending_upload_bytes", "Bytes not in the bucket yet.", &[], t.pending_bytes as f64);
    }

    /// Imported files' chunks (`arbor import`).
    fn render_imports(&self, page: &mut Exposition) {
        let Some(vol) = &self.vol else { return };
        let i = vol.source_stats();
        let counters: [(&str, &str, u64); 6] = [
            ("arbor_mount_import_hits_total", "Imported files' chunks found in memory or on their way.", i.hits),
            ("arbor_mount_import_misses_total", "Imported files' chunks a read had to fetch.", i.misses),
            ("arbor_mount_import_bucket_gets_total", "Ranged GETs of imported files' objects.", i.gets),
            ("arbor_mount_import_bucket_bytes_total", "Bytes those GETs brought.", i.fetched_bytes),
            ("arbor_mount_import_server_chunks_total", "Imported files' chunks cache servers gave.", i.from_servers),
            (
                "arbor_mount_import_disk_chunks_total",
                "Imported files' chunks found in the local chunk files.",
                i.from_disk,
            ),
        ];
        for (name, help, v) in counters {
            page.counter(name, help, &[], v);
        }
    }

    /// Each cache server this mount reads through, by its address.
    fn render_cache_servers(&self, page: &mut Exposition) {
        let Some(client) = &self.servers else { return };
        for s in client.stats() {
            let server = [("server", s.addr.as_str())];
            page.counter("arbor_mount_server_chunks_total", "Chunks a cache server answered.", &server, s.chunks);
            page.counter("arbor_mount_server_bytes_total", "Bytes a cache server answered.", &server, s.bytes);
            page.counter("arbor_mount_server_hits_total", "Of those chunks, those it had cached.", &server, s.hits);
            let fallbacks = [
                ("down", s.fallback_down),
                ("timeout", s.fallback_timeout),
                ("error", s.fallback_error),
                ("not_found", s.fallback_not_found),
                ("rejected", s.rejected),
            ];
            for (reason, n) in fallbacks {
                page.counter(
                    "arbor_mount_server_fallbacks_total",
                    "Chunks read from the bucket instead of a cache server, by reason.",
                    &[("server", s.addr.as_str()), ("reason", reason)],
                    n,
                );
            }
        }
    }
}
