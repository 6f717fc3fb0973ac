//! Reachability GC: mark every segment a branch head or checkpoint
//! reaches, then delete the segments nothing reaches.
//!
//! Safety against writers running during a GC:
//! - only segments that existed before marking began are candidates;
//! - heads are read again after marking, and every segment of a head's
//!   writer from its commit on is kept (it holds intents not yet in any
//!   root, and the writer's next commits land there);
//! - segments written within the grace period are kept, which covers a
//!   writer that opened but has not yet published its first head.
//!
//! A crash during GC leaves some garbage behind; it never deletes anything
//! reachable, because the only writes GC makes are deletions of segments
//! it proved unreachable.

use crate::catalog::Catalog;
use crate::error::Result;
use arbor_engine::device::Clocks;
use arbor_engine::format::{Addr, SegId};
use std::collections::HashSet;
use std::time::Duration;

/// How old an unreachable segment must be before gc deletes it, by
/// default: a live writer's newest segments may not be in any head yet.
pub const GC_GRACE: Duration = Duration::from_secs(600);

/// The result of the mark phase.
pub struct GcPlan {
    candidates: Vec<SegId>,
    live: HashSet<SegId>,
    seen_nodes: HashSet<Addr>,
    /// When the plan was made, by this node's clock and the store's.
    started: Clocks,
}

#[derive(Clone, Debug, Default)]
pub struct GcReport {
    pub segments: usize,
    pub deleted: Vec<SegId>,
    pub reachable: usize,
    pub kept_for_writers: usize,
}

impl Catalog {
    fn mark_roots(&self, live: &mut HashSet<SegId>, seen: &mut HashSet<Addr>) -> Result<Vec<(u64, u32)>> {
        let mut writers = Vec::new();
        for b in self.list_branches()? {
            self.inspector().reachable_segments(b.commit, seen, live)?;
            writers.push((b.commit.seg.writer, b.commit.seg.seq));
        }
        for c in self.list_checkpoints()? {
            self.inspector().reachable_segments(c.commit, seen, live)?;
        }
        Ok(writers)
    }

    /// Lists the candidates, then marks everything every root reaches.
    pub fn gc_plan(&self) -> Result<GcPlan> {
        let started = self.segments().clocks()?;
        let candidates = self.segments().list_segments()?;
        let mut plan = GcPlan { candidates, live: HashSet::new(), seen_nodes: HashSet::new(), started };
        self.mark_roots(&mut plan.live, &mut plan.seen_nodes)?;
        Ok(plan)
    }

    /// Re-reads the roots (marking what changed since the plan), then
    /// deletes the candidates nothing needs.
    pub fn gc_sweep(&self, mut plan: GcPlan, grace: Duration) -> Result<GcReport> {
        let writers = self.mark_roots(&mut plan.live, &mut plan.seen_nodes)?;
        let mut report = GcReport { segments: plan.candidates.len(), ..GcReport::default() };
        for seg in plan.candidates {
            if plan.live.contains(&seg) {
                report.reachable += 1;
                continue;
            }
            if writers.iter().any(|(w, s)| seg.writer == *w && seg.seq >= *s) {
                report.kept_for_writers += 1;
                continue;
            }
            // Written less than `grace` before the plan, on the clock that
            // stamped it (a bucket's own for a segment only there).
            if self.segments().segment_age(seg, plan.started)?.is_some_and(|age| age < grace) {
                report.kept_for_writers += 1;
                continue;
            }
            tracing::info!(%seg, "gc: deleting an unreachable segment");
            self.segments().remove_segment(seg)?;
            report.deleted.push(seg);
        }
        Ok(report)
    }

    pub fn gc(&self, grace: Duration) -> Result<GcReport> {
        let plan = self.gc_plan()?;
        self.gc_sweep(plan, grace)
    }
}
