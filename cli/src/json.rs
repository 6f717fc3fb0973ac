//! The JSON the commands and the control socket answer with: commits,
//! compactions, cache servers and a mount's FUSE side.

use serde_json::{json, Value};
use std::sync::Arc;

/// A mount's transport and what reached it.
pub type Fuse = (Arc<arbor_fs::Transport>, Arc<arbor_fs::Counters>);

/// Adds what `status` says of a mount's FUSE side to `status`: the
/// transport, its requests, and what reached arbor.
pub fn with_fuse(status: &mut Value, (transport, c): &Fuse) {
    use arbor_fs::FuseOp;
    let fuse = json!({
        "fuse_transport": transport.describe(),
        "fuse_ring_requests": transport.ring_requests(),
        "fuse_read_requests": c.ops.count(FuseOp::Read),
        "fuse_lookup_requests": c.ops.count(FuseOp::Lookup),
        "fuse_getxattr_requests": c.ops.count(FuseOp::Getxattr),
        "fuse_direct_write_opens": c.direct_opens.get(),
        "kernel_read_ahead": c.kernel_read_ahead.get(),
    });
    if let (Some(to), Value::Object(from)) = (status.as_object_mut(), fuse) {
        to.extend(from);
    }
}

/// What `status` says of each cache server a mount reads through.
pub fn cache_servers_json(client: Option<&arbor_net::CacheClient>) -> serde_json::Value {
    let Some(c) = client else { return serde_json::Value::Null };
    c.stats()
        .into_iter()
        .map(|s| {
            json!({
                "addr": s.addr,
                "chunks": s.chunks,
                "bytes": s.bytes,
                "hits": s.hits,
                "parts": s.parts,
                "footers": s.footers,
                "fallback_down": s.fallback_down,
                "fallback_timeout": s.fallback_timeout,
                "fallback_error": s.fallback_error,
                "fallback_not_found": s.fallback_not_found,
                "rejected": s.rejected,
            })
        })
        .collect()
}

pub fn compact_json(r: arbor_engine::volume::CompactReport) -> Value {
    json!({"segments": r.segments.len(), "nodes": r.nodes, "bytes": r.bytes, "data_bytes": r.data_bytes})
}

pub fn addr_json(a: arbor_engine::format::Addr) -> Value {
    json!({"writer": a.seg.writer, "seq": a.seg.seq, "off": a.off, "len": a.len})
}
