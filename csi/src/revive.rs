//! A plugin started again (its container restarted, its pod replaced on
//! an upgrade) serves its staged volumes again from its watcher's first
//! round, once it answers the kubelet: every volume whose kernel mount outlived its `arbor mount`
//! process (killed with the old container) gets a new one, which takes
//! the live connection from `arbor keeper` over. Pods using the volume
//! see a stall, not an error.

use crate::state::{StageRecord, State};
use crate::{mounts, stage};
use std::collections::HashMap;
use std::path::Path;

/// Serves again every staged volume that is mounted but not served.
/// Failures are logged: the kubelet's next stage of that volume tries
/// again.
pub fn revive(state: &State, arbor: &Path, keeper: &Path) {
    let records = match state.stages() {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the staged volumes' records");
            return;
        }
    };
    for r in records {
        match revive_one(state, arbor, keeper, &r) {
            Ok(true) => tracing::info!(volume = r.volume_id, staging = %r.staging_path.display(), "serving again"),
            Ok(false) => {}
            Err(e) => tracing::warn!(volume = r.volume_id, error = e, "cannot serve the staged volume again"),
        }
    }
}

/// Serves the volume again if it is mounted and not served; whether it
/// started a mount process for it.
pub fn revive_one(state: &State, arbor: &Path, keeper: &Path, r: &StageRecord) -> Result<bool, String> {
    let mounted = mounts::is_mounted(&r.staging_path).map_err(|e| format!("reading the mount table: {e}"))?;
    // Gone: the kubelet's next stage mounts it. Served: nothing to do.
    if !mounted || stage::served(arbor, &r.staging_path) {
        return Ok(false);
    }
    let ctx: HashMap<String, String> = r.attributes.clone().into_iter().collect();
    let spec = crate::volume::VolumeSpec::parse(&ctx)?;
    let files = stage::secret_files(state, &r.volume_id);
    let args = stage::mount_args(&spec, &files, &state.cache_dir(&r.volume_id), Some(keeper))?;
    stage::mount(arbor, &spec, &r.staging_path, &args, &files).map_err(|e| e.to_string())?;
    Ok(true)
}
