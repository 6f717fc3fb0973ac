//! A Kubernetes CSI node plugin for arbor (`arbor csi`).
//!
//! The kubelet stages a volume once per node ([`node`]: `NodeStageVolume`
//! starts one `arbor mount` of the volume's branch or checkpoint at the
//! staging path) and publishes it into each pod that uses it (a bind mount
//! of the staging path at the pod's target path, read-only on request).
//! What a volume is comes from the PersistentVolume's `volumeAttributes`
//! ([`volume`]); what the plugin did is kept in small JSON files in its
//! state folder ([`state`]), so that every call stays idempotent across a
//! restart of the plugin.
//!
//! The gRPC messages and services are generated at build time from
//! `proto/csi.proto`, the subset of the CSI spec v1.9.0 a node plugin
//! serves, by a pure-Rust proto compiler.

pub mod identity;
pub mod mounts;
pub mod node;
pub mod revive;
pub mod stage;
pub mod state;
pub mod volume;

use std::path::{Path, PathBuf};

/// The messages and services of the CSI spec (package `csi.v1`).
pub mod proto {
    #![allow(missing_docs, clippy::all, rustdoc::all)]
    tonic::include_proto!("csi.v1");
}

/// The driver's name: `spec.csi.driver` of a PersistentVolume, the
/// CSIDriver object's name, and what `GetPluginInfo` answers.
pub const DRIVER_NAME: &str = "csi.arbor.dev";

/// Where the plugin keeps its state (volume records, secrets, caches)
/// unless told otherwise.
pub const STATE_DIR: &str = "/var/lib/arbor-csi";

/// How `arbor csi` runs.
#[derive(Clone, Debug)]
pub struct PluginOptions {
    /// The Unix socket to serve on (`unix:///csi/csi.sock` or a path).
    pub endpoint: String,
    /// This node's name, as the kubelet knows it (`NodeGetInfo`).
    pub node_id: String,
    /// The plugin's state folder.
    pub state_dir: PathBuf,
    /// The `arbor` binary that mounts volumes (normally this process's own).
    pub arbor_bin: PathBuf,
    /// The socket of an `arbor keeper` outside the plugin's container:
    /// volumes are mounted with `--keeper`, and served again at start.
    pub keeper: Option<PathBuf>,
}

/// Why the plugin could not start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("endpoint {0:?}: give unix:///path/to/socket or a path")]
    Endpoint(String),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("serving gRPC: {0}")]
    Transport(#[from] tonic::transport::Error),
}

fn io_error(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// The socket path of an endpoint: `unix:///csi/csi.sock`, `unix:/csi/csi.sock` or `/csi/csi.sock`.
pub fn socket_path(endpoint: &str) -> Result<PathBuf, Error> {
    let path = endpoint.strip_prefix("unix://").or_else(|| endpoint.strip_prefix("unix:")).unwrap_or(endpoint);
    if !path.starts_with('/') {
        return Err(Error::Endpoint(endpoint.to_string()));
    }
    Ok(PathBuf::from(path))
}

/// Serves Identity and Node on the endpoint's Unix socket until SIGTERM or
/// SIGINT; with a keeper, the watcher serves again, from its first round
/// on, the staged volumes whose mount processes died with an earlier
/// plugin. Not before the socket: a revival takes up to a minute a volume,
/// and a plugin that answers no probe meanwhile is restarted, forever.
pub fn run(opts: PluginOptions) -> Result<(), Error> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(io_error("starting the runtime"))?;
    rt.block_on(serve(opts, shutdown_signal()))
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// Serves until `stop` completes. A stale socket file from an earlier run
/// is replaced.
pub async fn serve(opts: PluginOptions, stop: impl std::future::Future<Output = ()>) -> Result<(), Error> {
    let path = socket_path(&opts.endpoint)?;
    let listener = bind(&path)?;
    let node = node::NodeService::open(&opts)
        .map(node::NodeServer::new)
        .map_err(io_error(format!("state folder {}", opts.state_dir.display())))?;
    let watcher = tokio::spawn(node.clone().watch());
    let identity = identity::IdentityService;
    tracing::info!(endpoint = %path.display(), node = %opts.node_id, driver = DRIVER_NAME, "CSI plugin serving");
    let served = tonic::transport::Server::builder()
        .add_service(proto::identity_server::IdentityServer::new(identity))
        .add_service(proto::node_server::NodeServer::new(node))
        .serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(listener), stop)
        .await;
    watcher.abort();
    let _ = std::fs::remove_file(&path);
    served?;
    Ok(())
}

fn bind(path: &Path) -> Result<tokio::net::UnixListener, Error> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io_error(format!("creating {}", dir.display())))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error(format!("removing the old socket {}", path.display()))(e)),
    }
    tokio::net::UnixListener::bind(path).map_err(io_error(format!("binding {}", path.display())))
}
