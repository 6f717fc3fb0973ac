//! The Node service: stage a volume (one `arbor mount` per node), publish
//! it into pods (bind mounts), and undo both; every call idempotent.
//!
//! Calls for one volume run one at a time (a lock per volume id); the
//! work itself (processes, mounts, files) runs on blocking threads.

use crate::mounts;
use crate::proto::node_server::Node;
use crate::proto::node_service_capability::{rpc, Rpc, Type};
use crate::proto::volume_capability::access_mode::Mode;
use crate::proto::volume_capability::AccessType;
use crate::proto::*;
use crate::stage::{self, StageError};
use crate::state::{PublishRecord, StageRecord, State};
use crate::volume::{attributes_key, Secrets, VolumeSpec};
use crate::PluginOptions;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tonic::{Code, Request, Response, Status};

pub struct NodeService {
    node_id: String,
    arbor: PathBuf,
    keeper: Option<PathBuf>,
    state: State,
    locks: parking_lot::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

fn invalid(msg: impl Into<String>) -> Status {
    Status::invalid_argument(msg)
}

fn internal(what: &str) -> impl FnOnce(std::io::Error) -> Status + '_ {
    move |e| Status::internal(format!("{what}: {e}"))
}

fn required<'a>(value: &'a str, name: &str) -> Result<&'a str, Status> {
    if value.is_empty() {
        return Err(invalid(format!("{name} is missing")));
    }
    Ok(value)
}

/// An absolute path from a request field.
fn required_path(value: &str, name: &str) -> Result<PathBuf, Status> {
    let p = Path::new(required(value, name)?);
    if !p.is_absolute() {
        return Err(invalid(format!("{name} {value:?} is not an absolute path")));
    }
    Ok(p.to_path_buf())
}

/// A volume capability the plugin serves: a file system (not a block
/// device) and a known access mode. Returns its description for records.
fn capability(cap: Option<&VolumeCapability>) -> Result<(String, Mode), Status> {
    let cap = cap.ok_or_else(|| invalid("volume_capability is missing"))?;
    let mount = match &cap.access_type {
        Some(AccessType::Mount(m)) => m,
        Some(AccessType::Block(_)) => return Err(invalid("arbor volumes are file systems, not block devices")),
        None => return Err(invalid("volume_capability has neither mount nor block")),
    };
    let mode = cap.access_mode.as_ref().map(|a| a.mode()).unwrap_or(Mode::Unknown);
    if mode == Mode::Unknown {
        return Err(invalid("volume_capability.access_mode is missing"));
    }
    let desc = format!("{} fs_type={:?} flags={:?}", mode.as_str_name(), mount.fs_type, mount.mount_flags);
    Ok((desc, mode))
}

fn reader_only(mode: Mode) -> bool {
    matches!(mode, Mode::SingleNodeReaderOnly | Mode::MultiNodeReaderOnly)
}

impl NodeService {
    pub fn open(opts: &PluginOptions) -> std::io::Result<NodeService> {
        Ok(NodeService {
            node_id: opts.node_id.clone(),
            arbor: opts.arbor_bin.clone(),
            keeper: opts.keeper.clone(),
            state: State::open(&opts.state_dir)?,
            locks: Default::default(),
        })
    }

    /// Whether a FUSE mount at `path` is there and served. Without a
    /// keeper, whether it answers (a mount whose process died fails with
    /// ENOTCONN); with one, whether a mount process answers on its control
    /// socket (a mount the keeper holds waits for a server, and would not
    /// fail).
    fn serving(&self, path: &Path) -> Result<bool, Status> {
        if !mounts::is_mounted(path).map_err(internal("reading the mount table"))? {
            return Ok(false);
        }
        Ok(match &self.keeper {
            Some(_) => stage::served(&self.arbor, path),
            None => mounts::answers(path),
        })
    }

    /// Runs `work` on a blocking thread while holding the volume's lock.
    async fn with_volume<T: Send + 'static>(
        self: &Arc<Self>,
        volume_id: &str,
        work: impl FnOnce(&NodeService) -> Result<T, Status> + Send + 'static,
    ) -> Result<T, Status> {
        let lock = self.locks.lock().entry(volume_id.to_string()).or_default().clone();
        let guard = lock.lock_owned().await;
        let me = self.clone();
        let done = tokio::task::spawn_blocking(move || {
            let r = work(&me);
            drop(guard);
            r
        })
        .await;
        self.forget_idle_lock(volume_id);
        done.map_err(|e| Status::internal(format!("the call's thread failed: {e}")))?
    }

    /// Drops a volume's lock when no call holds or waits for it (each
    /// holds a clone; the map holds the last one).
    fn forget_idle_lock(&self, volume_id: &str) {
        let mut locks = self.locks.lock();
        if locks.get(volume_id).is_some_and(|l| Arc::strong_count(l) == 1) {
            locks.remove(volume_id);
        }
    }

    fn stage(&self, req: NodeStageVolumeRequest) -> Result<(), Status> {
        let id = required(&req.volume_id, "volume_id")?;
        let staging = required_path(&req.staging_target_path, "staging_target_path")?;
        let (cap, mode) = capability(req.volume_capability.as_ref())?;
        let spec = VolumeSpec::parse(&req.volume_context).map_err(invalid)?;
        let secrets = Secrets::parse(&req.secrets).map_err(invalid)?;
        if spec.read_only() && !reader_only(mode) {
            return Err(Status::failed_precondition(format!(
                "a checkpoint volume is read-only: access mode {} needs a branch",
                mode.as_str_name()
            )));
        }
        let record = StageRecord {
            volume_id: id.to_string(),
            staging_path: staging.clone(),
            attributes: attributes_key(&req.volume_context),
            capability: cap,
            secrets_digest: secrets.digest(),
            waiting_for_secrets: false,
        };
        if let Some(old) = self.state.stage(id).map_err(internal("reading the volume's record"))? {
            if old.staging_path != record.staging_path
                || old.attributes != record.attributes
                || old.capability != record.capability
            {
                return Err(Status::already_exists(format!(
                    "volume {id:?} is staged at {} with other attributes or capability",
                    old.staging_path.display()
                )));
            }
            if self.serving(&staging)? {
                return Ok(());
            }
            tracing::warn!(volume = id, staging = %staging.display(), "staged volume is not served; mounting it again");
        }
        std::fs::create_dir_all(&staging).map_err(internal("creating the staging path"))?;
        if req.secrets.is_empty()
            && stage::mount_args(&spec, &stage::SecretFiles::default(), Path::new("/"), None).is_err()
        {
            // Its secrets may come with each publish (`nodePublishSecretRef`).
            tracing::info!(volume = id, staging = %staging.display(), "staged without secrets: mounting at the first publish");
            let record = StageRecord { waiting_for_secrets: true, ..record };
            return self.state.put_stage(&record).map_err(internal("writing the volume's record"));
        }
        self.mount_staged(id, &spec, &staging, &secrets, &record)
    }

    /// Mounts a staged volume at `staging` with `secrets`, its record
    /// written first (a plugin that dies while mounting finds it); undone
    /// if the mount fails.
    fn mount_staged(
        &self,
        id: &str,
        spec: &VolumeSpec,
        staging: &Path,
        secrets: &Secrets,
        record: &StageRecord,
    ) -> Result<(), Status> {
        let files = stage::write_secrets(&self.state, id, secrets).map_err(internal("writing the secrets"))?;
        let args =
            stage::mount_args(spec, &files, &self.state.cache_dir(id), self.keeper.as_deref()).map_err(invalid)?;
        self.state.put_stage(record).map_err(internal("writing the volume's record"))?;
        tracing::info!(volume = id, staging = %staging.display(), disk = %spec.disk, root = ?spec.root, "staging");
        if let Err(e) = stage::mount(&self.arbor, spec, staging, &args, &files) {
            let _ = self.state.remove_stage(id);
            let _ = stage::remove_secrets(&self.state, id);
            return Err(match e {
                StageError::NotFound(m) => Status::not_found(m),
                StageError::Failed(m) => Status::internal(m),
            });
        }
        Ok(())
    }

    /// What a publish's secrets (`nodePublishSecretRef`) do: a volume
    /// staged without the secrets it needs is mounted now, with them; a
    /// volume already mounted takes none (one mount serves every pod on
    /// the node), so other secrets than it was mounted with are refused.
    fn publish_secrets(
        &self,
        id: &str,
        staging: &Path,
        staged: &StageRecord,
        given: &HashMap<String, String>,
    ) -> Result<(), Status> {
        let secrets = Secrets::parse(given).map_err(invalid)?;
        if staged.waiting_for_secrets {
            if given.is_empty() {
                return Err(Status::failed_precondition(format!(
                    "volume {id:?} was staged without secrets and its mount needs them (a \"token\"): give them in nodeStageSecretRef or nodePublishSecretRef"
                )));
            }
            let ctx: HashMap<String, String> = staged.attributes.clone().into_iter().collect();
            let spec = VolumeSpec::parse(&ctx).map_err(invalid)?;
            let record = StageRecord { secrets_digest: secrets.digest(), waiting_for_secrets: false, ..staged.clone() };
            tracing::info!(volume = id, "mounting with the publish's secrets");
            return self.mount_staged(id, &spec, staging, &secrets, &record).inspect_err(|_| {
                // Still staged, still waiting: the next publish tries again.
                let _ = self.state.put_stage(staged);
            });
        }
        if !given.is_empty() && secrets.digest() != staged.secrets_digest {
            return Err(Status::failed_precondition(format!(
                "volume {id:?} is mounted with other secrets than this publish's (nodePublishSecretRef): one mount serves every pod on the node, so every publish must give the secrets it was mounted with, or none"
            )));
        }
        Ok(())
    }

    fn unstage(&self, req: NodeUnstageVolumeRequest) -> Result<(), Status> {
        let id = required(&req.volume_id, "volume_id")?;
        let staging = required_path(&req.staging_target_path, "staging_target_path")?;
        let record = self.state.stage(id).map_err(internal("reading the volume's record"))?;
        if let Some(r) = &record {
            if r.staging_path != staging {
                return Err(Status::not_found(format!(
                    "volume {id:?} is staged at {}, not at {}",
                    r.staging_path.display(),
                    staging.display()
                )));
            }
        }
        for p in self.state.publishes_of(id).map_err(internal("reading the targets' records"))? {
            if mounts::is_mounted(&p.target_path).map_err(internal("reading the mount table"))? {
                return Err(Status::failed_precondition(format!(
                    "volume {id:?} is still published at {}: unpublish it first",
                    p.target_path.display()
                )));
            }
        }
        if mounts::is_mounted(&staging).map_err(internal("reading the mount table"))? {
            if record.is_none() {
                return Err(Status::failed_precondition(format!(
                    "{} is mounted, but not by this plugin for volume {id:?}",
                    staging.display()
                )));
            }
            tracing::info!(volume = id, staging = %staging.display(), "unstaging");
            stage::unmount(&self.arbor, &staging, self.keeper.as_deref())
                .map_err(|e| Status::internal(e.to_string()))?;
        }
        stage::remove_secrets(&self.state, id).map_err(internal("removing the secrets"))?;
        match std::fs::remove_dir_all(self.state.cache_dir(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(internal("removing the cache")(e)),
            _ => {}
        }
        self.state.remove_stage(id).map_err(internal("removing the volume's record"))
    }

    fn publish(&self, req: NodePublishVolumeRequest) -> Result<(), Status> {
        let id = required(&req.volume_id, "volume_id")?;
        let target = required_path(&req.target_path, "target_path")?;
        let (cap, mode) = capability(req.volume_capability.as_ref())?;
        if req.staging_target_path.is_empty() {
            return Err(Status::failed_precondition("staging_target_path is not set: stage the volume first"));
        }
        let staging = required_path(&req.staging_target_path, "staging_target_path")?;
        let staged = self.state.stage(id).map_err(internal("reading the volume's record"))?;
        let Some(staged) = staged.filter(|s| s.staging_path == staging) else {
            return Err(Status::failed_precondition(format!("volume {id:?} is not staged at {}", staging.display())));
        };
        let checkpoint = staged.attributes.contains_key(crate::volume::CHECKPOINT);
        if checkpoint && !reader_only(mode) {
            return Err(Status::failed_precondition(
                "a checkpoint volume is read-only: publish it with a reader access mode",
            ));
        }
        self.publish_secrets(id, &staging, &staged, &req.secrets)?;
        if !self.serving(&staging)? {
            return Err(Status::failed_precondition(format!(
                "volume {id:?} is not mounted at {} (stage it again)",
                staging.display()
            )));
        }
        let record = PublishRecord {
            volume_id: id.to_string(),
            target_path: target.clone(),
            staging_path: staging.clone(),
            read_only: req.readonly || reader_only(mode) || checkpoint,
            capability: cap,
        };
        let mounted = mounts::is_mounted(&target).map_err(internal("reading the mount table"))?;
        match self.state.publish(&target).map_err(internal("reading the target's record"))? {
            Some(old) if old != record => {
                return Err(Status::already_exists(format!(
                    "{} is published for volume {:?} with other arguments",
                    target.display(),
                    old.volume_id
                )))
            }
            Some(_) if mounted && mounts::answers(&target) => return Ok(()),
            // Bound to a mount whose process died: bound again to the live one.
            Some(_) if mounted => mounts::unmount_all(&target).map_err(internal("unmounting a dead bind"))?,
            Some(_) => {}
            None if mounted => {
                return Err(Status::already_exists(format!("something else is mounted at {}", target.display())))
            }
            None => {}
        }
        std::fs::create_dir_all(&target).map_err(internal("creating the target path"))?;
        self.state.put_publish(&record).map_err(internal("writing the target's record"))?;
        if let Err(e) = mounts::bind(&staging, &target, record.read_only) {
            let _ = self.state.remove_publish(&target);
            return Err(Status::internal(format!("bind-mounting {} at {}: {e}", staging.display(), target.display())));
        }
        tracing::info!(volume = id, target = %target.display(), read_only = record.read_only, "published");
        Ok(())
    }

    fn unpublish(&self, req: NodeUnpublishVolumeRequest) -> Result<(), Status> {
        let id = required(&req.volume_id, "volume_id")?;
        let target = required_path(&req.target_path, "target_path")?;
        if let Some(r) = self.state.publish(&target).map_err(internal("reading the target's record"))? {
            if r.volume_id != id {
                return Err(Status::not_found(format!(
                    "{} is published for volume {:?}, not {id:?}",
                    target.display(),
                    r.volume_id
                )));
            }
        }
        mounts::unmount_all(&target).map_err(internal("unmounting the target"))?;
        match std::fs::remove_dir(&target) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(internal("removing the target path")(e)),
            _ => {}
        }
        self.state.remove_publish(&target).map_err(internal("removing the target's record"))?;
        tracing::info!(volume = id, target = %target.display(), "unpublished");
        Ok(())
    }
}

/// The service as tonic serves it (the volume locks need it shared).
#[derive(Clone)]
pub struct NodeServer(Arc<NodeService>);

/// With a keeper, how often the plugin looks for staged volumes whose
/// mount process died alone (the OOM killer, a kill -9): their pods stall
/// until then.
pub const WATCH_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

impl NodeServer {
    pub fn new(service: NodeService) -> NodeServer {
        NodeServer(Arc::new(service))
    }

    /// With a keeper: at once, then every [`WATCH_EVERY`], starts a mount
    /// process for each staged volume whose kernel mount is there and not
    /// served (under the volume's lock, so never during its stage or
    /// unstage), all volumes at once: one slow volume must not hold the
    /// others back. Without one, returns at once (the in-process keeper
    /// restarts its own child).
    pub async fn watch(self) {
        let Some(keeper) = self.0.keeper.clone() else { return };
        loop {
            let records = match self.0.state.stages() {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the staged volumes' records");
                    Vec::new()
                }
            };
            let rounds: Vec<_> =
                records.into_iter().map(|r| tokio::spawn(self.clone().revive(r, keeper.clone()))).collect();
            for round in rounds {
                let _ = round.await;
            }
            tokio::time::sleep(WATCH_EVERY).await;
        }
    }

    /// One volume's round of [`NodeServer::watch`].
    async fn revive(self, r: crate::state::StageRecord, keeper: std::path::PathBuf) {
        let id = r.volume_id.clone();
        let revived =
            self.0.with_volume(&id, move |n| Ok(crate::revive::revive_one(&n.state, &n.arbor, &keeper, &r))).await;
        match revived {
            Ok(Ok(true)) => tracing::warn!(volume = id, "its mount process had died: serving again"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => tracing::warn!(volume = id, error = e, "cannot serve the staged volume again"),
            Err(s) => tracing::warn!(volume = id, error = s.message(), "cannot serve the staged volume again"),
        }
    }
}

fn log_result<T>(call: &str, volume_id: &str, r: Result<T, Status>) -> Result<T, Status> {
    if let Err(s) = &r {
        if s.code() != Code::AlreadyExists {
            tracing::warn!(call, volume = volume_id, code = ?s.code(), message = s.message(), "call failed");
        }
    }
    r
}

#[tonic::async_trait]
impl Node for NodeServer {
    async fn node_stage_volume(
        &self,
        req: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        let req = req.into_inner();
        let id = req.volume_id.clone();
        let r = self.0.with_volume(&id, move |n| n.stage(req)).await;
        log_result("NodeStageVolume", &id, r).map(|()| Response::new(NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        req: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        let req = req.into_inner();
        let id = req.volume_id.clone();
        let r = self.0.with_volume(&id, move |n| n.unstage(req)).await;
        log_result("NodeUnstageVolume", &id, r).map(|()| Response::new(NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        req: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let req = req.into_inner();
        let id = req.volume_id.clone();
        let r = self.0.with_volume(&id, move |n| n.publish(req)).await;
        log_result("NodePublishVolume", &id, r).map(|()| Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        req: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let req = req.into_inner();
        let id = req.volume_id.clone();
        let r = self.0.with_volume(&id, move |n| n.unpublish(req)).await;
        log_result("NodeUnpublishVolume", &id, r).map(|()| Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        let stage =
            NodeServiceCapability { r#type: Some(Type::Rpc(Rpc { r#type: rpc::Type::StageUnstageVolume as i32 })) };
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities: vec![stage] }))
    }

    async fn node_get_info(&self, _: Request<NodeGetInfoRequest>) -> Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.0.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}
