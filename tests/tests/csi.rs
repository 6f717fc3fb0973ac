//! `arbor csi` played the way the kubelet plays a CSI node plugin: gRPC
//! over its Unix socket (a tonic client), against real FUSE mounts of a
//! branch through its owner (ReadWriteMany) and of a checkpoint in memory
//! only (ReadOnlyMany). The same sequence from Python grpcio is in
//! `tests/clients/csi_kubelet.py`.

use arbor_csi::proto::identity_client::IdentityClient;
use arbor_csi::proto::node_client::NodeClient;
use arbor_csi::proto::node_service_capability::{rpc, Type as CapType};
use arbor_csi::proto::volume_capability::{access_mode::Mode, AccessMode, AccessType, MountVolume};
use arbor_csi::proto::*;
use arbor_tests::*;
use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tonic::transport::Channel;
use tonic::Code;

/// `arbor csi` on a socket in a temporary folder; killed on drop.
struct Plugin {
    child: Child,
    socket: PathBuf,
    state: PathBuf,
    log: PathBuf,
}

impl Plugin {
    fn start(dir: &Path) -> Plugin {
        Self::start_env(dir, &[])
    }

    /// With extra environment variables (an S3 endpoint, without credentials).
    fn start_env(dir: &Path, env: &[(&str, String)]) -> Plugin {
        Self::start_with(dir, env, &[])
    }

    /// With extra environment variables and arguments.
    fn start_with(dir: &Path, env: &[(&str, String)], args: &[&str]) -> Plugin {
        let socket = dir.join("csi.sock");
        let state = dir.join("csi-state");
        let log = dir.join("csi.log");
        let _ = std::fs::remove_file(&socket);
        let child = Command::new(arbor_bin())
            .args(["csi", "--endpoint", &format!("unix://{}", socket.display()), "--node-id", "node-a"])
            .arg("--state-dir")
            .arg(&state)
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, v)))
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).expect("log"))
            .stderr(std::fs::OpenOptions::new().append(true).open(&log).expect("log"))
            .spawn()
            .expect("spawn arbor csi");
        let mut p = Plugin { child, socket, state, log };
        wait_until("arbor csi to listen", Duration::from_secs(20), || {
            if let Ok(Some(status)) = p.child.try_wait() {
                panic!("arbor csi exited with {status}: {}", std::fs::read_to_string(&p.log).unwrap_or_default());
            }
            std::os::unix::net::UnixStream::connect(&p.socket).is_ok()
        });
        p
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Unmounts what a test bound or staged, whatever happened to the test.
struct Cleanup {
    targets: Vec<PathBuf>,
    staging: Vec<PathBuf>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for t in &self.targets {
            for _ in 0..4 {
                if !is_mounted(t) {
                    break;
                }
                let _ = Command::new("umount").arg("-l").arg(t).output();
            }
        }
        for s in &self.staging {
            if is_mounted(s) {
                let _ = Command::new(arbor_bin()).arg("unmount").arg(s).output();
            }
            if is_mounted(s) {
                let _ = Command::new("fusermount3").arg("-uz").arg(s).output();
            }
        }
    }
}

async fn connect(socket: &Path) -> Channel {
    let socket = socket.to_path_buf();
    tonic::transport::Endpoint::from_static("http://[::1]:50051")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let socket = socket.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(socket).await?))
            }
        }))
        .await
        .expect("connect to the plugin's socket")
}

fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn capability(mode: Mode) -> Option<VolumeCapability> {
    Some(VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume::default())),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    })
}

fn stage_req(
    id: &str,
    staging: &Path,
    mode: Mode,
    ctx: &[(&str, &str)],
    secrets: &[(&str, &str)],
) -> NodeStageVolumeRequest {
    NodeStageVolumeRequest {
        volume_id: id.into(),
        publish_context: HashMap::new(),
        staging_target_path: staging.to_string_lossy().into(),
        volume_capability: capability(mode),
        secrets: map(secrets),
        volume_context: map(ctx),
    }
}

fn publish_req(id: &str, staging: &Path, target: &Path, mode: Mode, readonly: bool) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: id.into(),
        publish_context: HashMap::new(),
        staging_target_path: staging.to_string_lossy().into(),
        target_path: target.to_string_lossy().into(),
        volume_capability: capability(mode),
        readonly,
        secrets: HashMap::new(),
        volume_context: map(&[("csi.storage.k8s.io/pod.name", "trainer-0")]),
    }
}

fn unpublish_req(id: &str, target: &Path) -> NodeUnpublishVolumeRequest {
    NodeUnpublishVolumeRequest { volume_id: id.into(), target_path: target.to_string_lossy().into() }
}

fn unstage_req(id: &str, staging: &Path) -> NodeUnstageVolumeRequest {
    NodeUnstageVolumeRequest { volume_id: id.into(), staging_target_path: staging.to_string_lossy().into() }
}

fn code<T>(r: Result<T, tonic::Status>) -> Code {
    match r {
        Ok(_) => Code::Ok,
        Err(s) => s.code(),
    }
}

/// Whether any FUSE mount is listed at `path` in this node's mount table.
fn fuse_mounted_at(path: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines().any(|l| {
        let at = l.split(' ').nth(4).is_some_and(|m| Path::new(m) == path);
        let fs = l.split(" - ").nth(1).and_then(|t| t.split(' ').next()).unwrap_or("");
        at && fs.starts_with("fuse")
    })
}

/// The processes whose command line mentions `path`, and whether any of
/// them holds `needle` in its command line or environment.
fn processes_at(path: &Path, needle: &str) -> (usize, bool) {
    let has = |bytes: &[u8], what: &[u8]| bytes.windows(what.len()).any(|w| w == what);
    let path = path.to_string_lossy();
    let (mut n, mut leaked) = (0, false);
    for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(cmdline) = std::fs::read(p.path().join("cmdline")) else { continue };
        if !has(&cmdline, path.as_bytes()) {
            continue;
        }
        n += 1;
        let environ = std::fs::read(p.path().join("environ")).unwrap_or_default();
        leaked |= has(&cmdline, needle.as_bytes()) || has(&environ, needle.as_bytes());
    }
    (n, leaked)
}

/// The processes whose command line mentions `path`.
fn pids_at(path: &Path) -> Vec<libc::pid_t> {
    let path = path.to_string_lossy();
    let mut pids = Vec::new();
    for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse().ok()) else { continue };
        let Ok(cmdline) = std::fs::read(p.path().join("cmdline")) else { continue };
        if cmdline.windows(path.len()).any(|w| w == path.as_bytes()) {
            pids.push(pid);
        }
    }
    pids
}

/// The identity and node calls the kubelet makes when it registers a plugin.
async fn registration(channel: &Channel) {
    let mut id = IdentityClient::new(channel.clone());
    let info = id.get_plugin_info(GetPluginInfoRequest {}).await.expect("GetPluginInfo").into_inner();
    assert_eq!(info.name, arbor_csi::DRIVER_NAME);
    assert!(!info.vendor_version.is_empty());
    let probe = id.probe(ProbeRequest {}).await.expect("Probe").into_inner();
    assert_eq!(probe.ready, Some(true));
    let mut node = NodeClient::new(channel.clone());
    let ni = node.node_get_info(NodeGetInfoRequest {}).await.expect("NodeGetInfo").into_inner();
    assert_eq!(ni.node_id, "node-a");
    let caps = node.node_get_capabilities(NodeGetCapabilitiesRequest {}).await.expect("caps").into_inner();
    let rpcs: Vec<i32> =
        caps.capabilities.iter().filter_map(|c| c.r#type.as_ref().map(|CapType::Rpc(r)| r.r#type)).collect();
    assert_eq!(rpcs, [rpc::Type::StageUnstageVolume as i32]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_branch_volume_through_its_owner_staged_once_and_bound_into_pods() {
    let Some(w) = SharedWorld::start() else { return };
    let dir = w.s.dir.path();
    let plugin = Plugin::start(dir);
    let channel = connect(&plugin.socket).await;
    registration(&channel).await;
    let mut node = NodeClient::new(channel.clone());

    let staging = dir.join("plugins/csi.arbor.dev/globalmount");
    std::fs::create_dir_all(staging.parent().expect("parent")).expect("mkdir");
    let pods = dir.join("pods");
    let (a, b, ro) = (pods.join("a/volumes/data"), pods.join("b/volumes/data"), pods.join("c/volumes/data"));
    for t in [&a, &b, &ro] {
        std::fs::create_dir_all(t.parent().expect("parent")).expect("mkdir");
    }
    let _cleanup = Cleanup { targets: vec![a.clone(), b.clone(), ro.clone()], staging: vec![staging.clone()] };
    let ctx = [("disk", w.s.disk_str()), ("branch", "main"), ("server", w.owner.addr.as_str())];
    let secrets = [("token", TOKEN)];
    let rwx = Mode::MultiNodeMultiWriter;

    // Missing fields are INVALID_ARGUMENT, and nothing gets mounted.
    let mut no_id = stage_req("vol-1", &staging, rwx, &ctx, &secrets);
    no_id.volume_id.clear();
    assert_eq!(code(node.node_stage_volume(no_id).await), Code::InvalidArgument);
    let mut no_cap = stage_req("vol-1", &staging, rwx, &ctx, &secrets);
    no_cap.volume_capability = None;
    assert_eq!(code(node.node_stage_volume(no_cap).await), Code::InvalidArgument);
    let mut block = stage_req("vol-1", &staging, rwx, &ctx, &secrets);
    block.volume_capability = Some(VolumeCapability {
        access_type: Some(AccessType::Block(volume_capability::BlockVolume {})),
        access_mode: Some(AccessMode { mode: rwx as i32 }),
    });
    assert_eq!(code(node.node_stage_volume(block).await), Code::InvalidArgument, "a block volume");
    let unknown = [("disk", w.s.disk_str()), ("branch", "main"), ("cachesize", "1G")];
    assert_eq!(
        code(node.node_stage_volume(stage_req("vol-1", &staging, rwx, &unknown, &secrets)).await),
        Code::InvalidArgument
    );
    assert_eq!(code(node.node_unstage_volume(unstage_req("", &staging)).await), Code::InvalidArgument);
    assert_eq!(code(node.node_unpublish_volume(unpublish_req("vol-1", Path::new(""))).await), Code::InvalidArgument);
    let no_path = stage_req("vol-1", Path::new(""), rwx, &ctx, &secrets);
    assert_eq!(code(node.node_stage_volume(no_path).await), Code::InvalidArgument);
    let no_disk = stage_req("vol-1", &staging, rwx, &[("branch", "main")], &secrets);
    assert_eq!(code(node.node_stage_volume(no_disk).await), Code::InvalidArgument);
    let both = [("disk", w.s.disk_str()), ("branch", "main"), ("checkpoint", "v1")];
    assert_eq!(
        code(node.node_stage_volume(stage_req("vol-1", &staging, rwx, &both, &secrets)).await),
        Code::InvalidArgument
    );
    // Without the token its mount needs, a stage mounts nothing (the
    // secrets may come with each publish, nodePublishSecretRef), and a
    // publish that gives none either is refused.
    node.node_stage_volume(stage_req("vol-1", &staging, rwx, &ctx, &[])).await.expect("a stage waiting for secrets");
    assert!(!fuse_mounted_at(&staging), "mounted without the token");
    let no_secrets = node.node_publish_volume(publish_req("vol-1", &staging, &a, rwx, false)).await;
    assert_eq!(code(no_secrets), Code::FailedPrecondition);
    assert!(!is_mounted(&a));
    node.node_unstage_volume(unstage_req("vol-1", &staging)).await.expect("unstage the waiting stage");
    let missing = [("disk", w.s.disk_str()), ("branch", "no-such-branch"), ("server", w.owner.addr.as_str())];
    assert_eq!(
        code(node.node_stage_volume(stage_req("vol-1", &staging, rwx, &missing, &secrets)).await),
        Code::NotFound
    );
    assert!(!fuse_mounted_at(&staging), "a refused stage mounted something");
    let mut no_target = publish_req("vol-1", &staging, &a, rwx, false);
    no_target.target_path.clear();
    assert_eq!(code(node.node_publish_volume(no_target).await), Code::InvalidArgument);
    assert_eq!(
        code(node.node_publish_volume(publish_req("vol-1", &staging, &a, rwx, false)).await),
        Code::FailedPrecondition,
        "publish before stage"
    );

    // Stage: one arbor mount, through the owner, holding the token in a 0600 file only.
    node.node_stage_volume(stage_req("vol-1", &staging, rwx, &ctx, &secrets)).await.expect("NodeStageVolume");
    assert!(fuse_mounted_at(&staging));
    let status: serde_json::Value =
        serde_json::from_str(&arbor_ok(&["status", staging.to_str().expect("utf8"), "--json"])).expect("status json");
    assert_eq!(status["owner"].as_str(), Some(w.owner.addr.as_str()), "mounted through the owner: {status}");
    node.node_stage_volume(stage_req("vol-1", &staging, rwx, &ctx, &secrets)).await.expect("the same stage again");
    let other = [("disk", w.s.disk_str()), ("branch", "main"), ("server", w.owner.addr.as_str()), ("cacheSize", "1G")];
    let again = node.node_stage_volume(stage_req("vol-1", &staging, rwx, &other, &secrets)).await;
    assert_eq!(code(again), Code::AlreadyExists);
    for p in [&staging, &plugin.socket] {
        let (n, leaked) = processes_at(p, TOKEN);
        assert!(
            n >= 1 && !leaked,
            "{n} processes at {}; the token in their argv or environment: {leaked}",
            p.display()
        );
    }
    assert!(!plugin.log_text().contains(TOKEN), "the token shows in the plugin's log");
    let token_files: Vec<_> = walk(&plugin.state).into_iter().filter(|p| p.ends_with("token")).collect();
    assert_eq!(token_files.len(), 1);
    let mode = std::fs::metadata(&token_files[0]).expect("token file").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);

    // Publish into two pods: what one writes, the other reads.
    node.node_publish_volume(publish_req("vol-1", &staging, &a, rwx, false)).await.expect("publish a");
    node.node_publish_volume(publish_req("vol-1", &staging, &b, rwx, false)).await.expect("publish b");
    std::fs::write(a.join("written-in-a"), b"from pod a").expect("write in a");
    assert_eq!(std::fs::read(b.join("written-in-a")).expect("read in b"), b"from pod a");
    node.node_publish_volume(publish_req("vol-1", &staging, &a, rwx, false)).await.expect("the same publish again");
    let ro_again = node.node_publish_volume(publish_req("vol-1", &staging, &a, rwx, true)).await;
    assert_eq!(code(ro_again), Code::AlreadyExists);
    let other_volume = node.node_publish_volume(publish_req("vol-2", &staging, &a, rwx, false)).await;
    assert_eq!(code(other_volume), Code::FailedPrecondition, "vol-2 is not staged");

    // A read-only publish reads and refuses writes with EROFS.
    node.node_publish_volume(publish_req("vol-1", &staging, &ro, rwx, true)).await.expect("publish read-only");
    assert_eq!(std::fs::read(ro.join("written-in-a")).expect("read"), b"from pod a");
    assert_eq!(errno_of(std::fs::write(ro.join("refused"), b"x")), libc::EROFS);
    assert!(!a.join("refused").exists());

    // Unstage while pods still use it is refused.
    assert_eq!(code(node.node_unstage_volume(unstage_req("vol-1", &staging)).await), Code::FailedPrecondition);
    assert!(fuse_mounted_at(&staging));

    // Unpublish twice: OK both times, and the target is gone.
    for t in [&a, &b, &ro] {
        node.node_unpublish_volume(unpublish_req("vol-1", t)).await.expect("unpublish");
        node.node_unpublish_volume(unpublish_req("vol-1", t)).await.expect("unpublish again");
        assert!(!t.exists(), "{} left behind", t.display());
    }
    // Unstage: the mount is gone, and with it the secrets.
    node.node_unstage_volume(unstage_req("vol-1", &staging)).await.expect("unstage");
    assert!(!fuse_mounted_at(&staging), "the staging mount is still listed");
    node.node_unstage_volume(unstage_req("vol-1", &staging)).await.expect("unstage again");
    assert!(walk(&plugin.state).iter().all(|p| !p.ends_with("token")), "a token file outlived its volume");
    // What pod a wrote is on the branch: the owner has it.
    let c = w.client("check");
    assert_eq!(std::fs::read(c.mnt.join("written-in-a")).expect("read through a client"), b"from pod a");
    c.unmount();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_branch_volume_whose_token_comes_only_with_the_publish() {
    let Some(w) = SharedWorld::start() else { return };
    let dir = w.s.dir.path();
    let plugin = Plugin::start(dir);
    let mut node = NodeClient::new(connect(&plugin.socket).await);
    let staging = dir.join("globalmount");
    let (a, b) = (dir.join("pods/a/volumes/data"), dir.join("pods/b/volumes/data"));
    for t in [&a, &b] {
        std::fs::create_dir_all(t.parent().expect("parent")).expect("mkdir");
    }
    let _cleanup = Cleanup { targets: vec![a.clone(), b.clone()], staging: vec![staging.clone()] };
    let ctx = [("disk", w.s.disk_str()), ("branch", "main"), ("server", w.owner.addr.as_str())];
    let rwx = Mode::MultiNodeMultiWriter;
    let with = |target: &Path, secrets: &[(&str, &str)]| {
        let mut r = publish_req("vol", &staging, target, rwx, false);
        r.secrets = map(secrets);
        r
    };

    // Staged without secrets (no nodeStageSecretRef): nothing is mounted
    // until a publish brings the token.
    node.node_stage_volume(stage_req("vol", &staging, rwx, &ctx, &[])).await.expect("stage");
    assert!(!fuse_mounted_at(&staging));
    let wrong_key = node.node_publish_volume(with(&a, &[("password", "x")])).await;
    assert_eq!(code(wrong_key), Code::InvalidArgument, "an unknown secret key");
    let no_token = node.node_publish_volume(with(&a, &[])).await;
    assert_eq!(code(no_token), Code::FailedPrecondition);
    let refused = node.node_publish_volume(with(&a, &[("token", "not-the-token")])).await;
    assert!(refused.is_err() && !fuse_mounted_at(&staging), "mounted with a token the owner refuses");

    // The first publish with the token mounts the volume with it, then
    // binds the pod's target.
    node.node_publish_volume(with(&a, &[("token", TOKEN)])).await.expect("publish with the token");
    assert!(fuse_mounted_at(&staging));
    let status: serde_json::Value =
        serde_json::from_str(&arbor_ok(&["status", staging.to_str().expect("utf8"), "--json"])).expect("status json");
    assert_eq!(status["owner"].as_str(), Some(w.owner.addr.as_str()), "mounted through the owner: {status}");
    std::fs::write(a.join("from-a"), b"written with the publish's token").expect("write in a");
    let (n, leaked) = processes_at(&staging, TOKEN);
    assert!(n >= 1 && !leaked, "the token in a mount process's argv or environment");

    // Another pod: the same token (or none) binds the same mount; another
    // token is refused, since the mount has one already.
    let other = node.node_publish_volume(with(&b, &[("token", "another-token")])).await;
    let other = other.expect_err("a publish with other secrets");
    assert_eq!(other.code(), Code::FailedPrecondition);
    assert!(other.message().contains("other secrets"), "{other:?}");
    assert!(!is_mounted(&b));
    node.node_publish_volume(with(&b, &[("token", TOKEN)])).await.expect("publish b with the same token");
    assert_eq!(std::fs::read(b.join("from-a")).expect("read in b"), b"written with the publish's token");
    node.node_publish_volume(with(&b, &[])).await.expect("the same publish without secrets");

    for t in [&a, &b] {
        node.node_unpublish_volume(unpublish_req("vol", t)).await.expect("unpublish");
    }
    node.node_unstage_volume(unstage_req("vol", &staging)).await.expect("unstage");
    assert!(!fuse_mounted_at(&staging));
    assert!(walk(&plugin.state).iter().all(|p| !p.ends_with("token")), "a token file outlived its volume");
    let c = w.client("check");
    assert_eq!(
        std::fs::read(c.mnt.join("from-a")).expect("read through a client"),
        b"written with the publish's token"
    );
    c.unmount();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_writing_a_branch_volume_sees_no_error_when_its_mount_process_and_the_plugin_are_killed() {
    let Some(w) = SharedWorld::start() else { return };
    let dir = w.s.dir.path();
    // `ARBOR_FUSE=ring` (a CI run) would insist on the ring, whose requests
    // in flight die with its process.
    let env = [("ARBOR_FUSE", "auto".to_string())];
    let mut plugin = Plugin::start_env(dir, &env);
    let mut node = NodeClient::new(connect(&plugin.socket).await);
    let staging = dir.join("globalmount");
    let target = dir.join("pods/p/volumes/data");
    std::fs::create_dir_all(target.parent().expect("parent")).expect("mkdir");
    let _cleanup = Cleanup { targets: vec![target.clone()], staging: vec![staging.clone()] };
    let ctx = [("disk", w.s.disk_str()), ("branch", "main"), ("server", w.owner.addr.as_str())];
    let (rwx, secrets) = (Mode::MultiNodeMultiWriter, [("token", TOKEN)]);
    node.node_stage_volume(stage_req("vol", &staging, rwx, &ctx, &secrets)).await.expect("stage");
    node.node_publish_volume(publish_req("vol", &staging, &target, rwx, false)).await.expect("publish");

    // A pod holds a file open and writes, fsyncs and reads it in a loop
    // while the mount's serving process is killed, then the plugin, then
    // the serving process again.
    let file = target.join("held-open.bin");
    let watcher = Watcher::start(&target);
    let (mut lp, out) = HoldOpenLoop::start(&file, 7);
    let mut serving = serving_pid(&staging, None);
    for kill_plugin in [false, true, false] {
        std::thread::sleep(Duration::from_millis(1200));
        assert!(lp.running(), "the loop ended before the kills");
        if kill_plugin {
            plugin.stop();
            assert!(fuse_mounted_at(&staging), "the mount died with the plugin");
            continue;
        }
        // SAFETY: a signal to the mount process the plugin started.
        assert_eq!(unsafe { libc::kill(serving as libc::pid_t, libc::SIGKILL) }, 0);
        serving = serving_pid(&staging, Some(serving));
    }
    assert!(lp.running(), "the loop ended before the last kill was survived");
    let (rounds, worst) = lp.finish(out);
    assert_eq!(watcher.finish(), 0, "statfs of the pod's target failed");
    eprintln!("{rounds} rounds, worst round {worst} ms");
    assert!(std::fs::read(&file).expect("read") == hold_open_expected(rounds), "bytes differ after the kills");
    check_hold_open_files(&file, rounds);

    // A new plugin finds the volume staged and published, and lets it go.
    let plugin = Plugin::start_env(dir, &env);
    let mut node = NodeClient::new(connect(&plugin.socket).await);
    node.node_stage_volume(stage_req("vol", &staging, rwx, &ctx, &secrets)).await.expect("stage again");
    node.node_publish_volume(publish_req("vol", &staging, &target, rwx, false)).await.expect("publish again");
    node.node_unpublish_volume(unpublish_req("vol", &target)).await.expect("unpublish");
    node.node_unstage_volume(unstage_req("vol", &staging)).await.expect("unstage");
    assert!(!fuse_mounted_at(&staging));
    // The owner has every byte.
    let c = w.client("check");
    assert!(std::fs::read(c.mnt.join("held-open.bin")).expect("read") == hold_open_expected(rounds));
    c.unmount();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_writing_a_branch_volume_sees_no_error_when_the_plugin_container_restarts_or_its_mount_process_dies() {
    let Some(w) = SharedWorld::start() else { return };
    let dir = w.s.dir.path();
    let env = [("ARBOR_FUSE", "auto".to_string())];
    let staging = dir.join("globalmount");
    let target = dir.join("pods/p/volumes/data");
    std::fs::create_dir_all(target.parent().expect("parent")).expect("mkdir");
    // Declared before the keeper, so dropped after it: a mount the keeper
    // no longer holds fails at once, and is detached.
    let _cleanup = Cleanup { targets: vec![target.clone()], staging: vec![staging.clone()] };
    // The keeper runs outside the plugin's container (its own DaemonSet).
    let keeper = Keeper::start(dir);
    let with_keeper = ["--keeper", keeper.socket_str()];
    let mut plugin = Plugin::start_with(dir, &env, &with_keeper);
    let mut node = NodeClient::new(connect(&plugin.socket).await);
    let ctx = [("disk", w.s.disk_str()), ("branch", "main"), ("server", w.owner.addr.as_str())];
    let (rwx, secrets) = (Mode::MultiNodeMultiWriter, [("token", TOKEN)]);
    node.node_stage_volume(stage_req("vol", &staging, rwx, &ctx, &secrets)).await.expect("stage");
    node.node_publish_volume(publish_req("vol", &staging, &target, rwx, false)).await.expect("publish");
    assert_eq!(keeper.held(), vec![staging.to_string_lossy().into_owned()], "the keeper holds the staged mount");
    assert_eq!(pids_at(&staging).len(), 1, "one mount process, no keeper of its own");

    // A pod holds a file open and writes, fsyncs and reads it in a loop
    // while the plugin's container restarts twice (the plugin and every
    // mount process it started are killed at once, and a new plugin starts
    // on the same state folder and keeper), then the mount process alone
    // is killed (the plugin notices and starts another).
    let file = target.join("held-open.bin");
    let watcher = Watcher::start(&target);
    let (mut lp, out) = HoldOpenLoop::start(&file, 10);
    for restart in 0..3 {
        std::thread::sleep(Duration::from_millis(1200));
        assert!(lp.running(), "the loop ended before restart {restart}");
        let mounts = pids_at(&staging);
        assert!(!mounts.is_empty(), "no mount process at {}", staging.display());
        let t = std::time::Instant::now();
        let container = restart < 2;
        if container {
            plugin.stop();
        }
        for pid in mounts {
            // SAFETY: a signal to a mount process the plugin started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        wait_until("every mount process to die", Duration::from_secs(10), || pids_at(&staging).is_empty());
        assert!(fuse_mounted_at(&staging), "the kernel mount died with its processes");
        if container {
            plugin = Plugin::start_with(dir, &env, &with_keeper);
        }
        serving_pid(&staging, None);
        let what = if container { "the plugin and its mount process" } else { "the mount process alone" };
        eprintln!("restart {restart} ({what}): served again {} ms after the kill", t.elapsed().as_millis());
    }
    assert!(lp.running(), "the loop ended before the last restart was survived");
    let (rounds, worst) = lp.finish(out);
    assert_eq!(watcher.finish(), 0, "statfs of the pod's target failed");
    eprintln!("{rounds} rounds, worst round {worst} ms");
    assert!(std::fs::read(&file).expect("read") == hold_open_expected(rounds), "bytes differ after the restarts");
    check_hold_open_files(&file, rounds);
    assert!(plugin.log_text().contains("serving again"), "{}", plugin.log_text());

    // The kubelet's repeated calls get the same answers; then unpublish and
    // unstage leave no mount, and the keeper holds nothing.
    let mut node = NodeClient::new(connect(&plugin.socket).await);
    node.node_stage_volume(stage_req("vol", &staging, rwx, &ctx, &secrets)).await.expect("stage again");
    node.node_publish_volume(publish_req("vol", &staging, &target, rwx, false)).await.expect("publish again");
    node.node_unpublish_volume(unpublish_req("vol", &target)).await.expect("unpublish");
    node.node_unstage_volume(unstage_req("vol", &staging)).await.expect("unstage");
    assert!(!fuse_mounted_at(&staging) && !is_mounted(&target), "a mount is left");
    assert!(keeper.held().is_empty(), "the keeper still holds {:?}", keeper.held());
    // The owner has every byte.
    let c = w.client("check");
    assert!(std::fs::read(c.mnt.join("held-open.bin")).expect("read") == hold_open_expected(rounds));
    c.unmount();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_volume_in_memory_only_survives_a_plugin_restart_and_its_mount_process_dying() {
    if !fuse_available() {
        return;
    }
    let s = Scratch::new();
    let m = Mount::start(s.disk_str(), &s.mnt, &[]);
    std::fs::write(s.mnt.join("tokens.bin"), pattern(300_000, 7)).expect("write");
    arbor_ok(&["checkpoints", "create", s.mnt.to_str().expect("utf8"), "v1"]);
    m.unmount();

    let dir = s.dir.path();
    // Its mount's serving process is killed below: `ARBOR_FUSE=ring` would
    // insist on the ring, whose requests in flight die with its process.
    let restartable = [("ARBOR_FUSE", "auto".to_string())];
    let mut plugin = Plugin::start_env(dir, &restartable);
    let mut node = NodeClient::new(connect(&plugin.socket).await);
    let staging = dir.join("globalmount");
    let target = dir.join("pods/p/volumes/data");
    std::fs::create_dir_all(target.parent().expect("parent")).expect("mkdir");
    let _cleanup = Cleanup { targets: vec![target.clone()], staging: vec![staging.clone()] };
    let ctx = [("disk", s.disk_str()), ("checkpoint", "v1"), ("cacheMemory", "64M")];
    let rox = Mode::MultiNodeReaderOnly;

    // A checkpoint cannot be written: a writer's access mode is refused.
    let writer = stage_req("ckpt", &staging, Mode::MultiNodeMultiWriter, &ctx, &[]);
    assert_eq!(code(node.node_stage_volume(writer).await), Code::FailedPrecondition);
    let missing = [("disk", s.disk_str()), ("checkpoint", "v9"), ("cacheMemory", "64M")];
    assert_eq!(code(node.node_stage_volume(stage_req("ckpt", &staging, rox, &missing, &[])).await), Code::NotFound);

    // The kubelet retries a stage that timed out while the first still
    // runs: both succeed, and one process mounts the volume.
    let mut second = node.clone();
    let (one, two) = tokio::join!(
        node.node_stage_volume(stage_req("ckpt", &staging, rox, &ctx, &[])),
        second.node_stage_volume(stage_req("ckpt", &staging, rox, &ctx, &[]))
    );
    one.expect("stage");
    two.expect("the same stage at the same time");
    // One mount: its keeper and the process serving it.
    assert_eq!(processes_at(&staging, "\u{1}").0, 2, "one mount (keeper and server) for the volume");
    let status: serde_json::Value =
        serde_json::from_str(&arbor_ok(&["status", staging.to_str().expect("utf8"), "--json"])).expect("status json");
    assert_eq!(status["checkpoint"].as_str(), Some("v1"));
    assert_eq!(status["read_only"].as_bool(), Some(true));
    node.node_publish_volume(publish_req("ckpt", &staging, &target, rox, false)).await.expect("publish");
    assert_eq!(std::fs::read(target.join("tokens.bin")).expect("read"), pattern(300_000, 7));
    assert_eq!(errno_of(std::fs::write(target.join("new"), b"x")), libc::EROFS);

    // The plugin restarts (a new DaemonSet pod): the kubelet repeats its
    // calls and gets the same answers, from the records on disk.
    plugin.stop();
    let plugin = Plugin::start_env(dir, &restartable);
    let mut node = NodeClient::new(connect(&plugin.socket).await);
    node.node_stage_volume(stage_req("ckpt", &staging, rox, &ctx, &[])).await.expect("stage after restart");
    node.node_publish_volume(publish_req("ckpt", &staging, &target, rox, false)).await.expect("publish after restart");
    let same = node.node_publish_volume(publish_req("ckpt", &staging, &target, rox, true)).await;
    assert_eq!(code(same), Code::Ok, "a checkpoint is bound read-only either way");
    let other = publish_req("ckpt", &staging, &target, Mode::SingleNodeReaderOnly, false);
    assert_eq!(code(node.node_publish_volume(other).await), Code::AlreadyExists);
    assert_eq!(std::fs::read(target.join("tokens.bin")).expect("read"), pattern(300_000, 7));

    // The process serving the mount dies (kill -9): its keeper starts
    // another on the same mount, and the pod reads on without an error.
    let serving = serving_pid(&staging, None);
    // SAFETY: a signal to the mount process the plugin started.
    unsafe { libc::kill(serving as libc::pid_t, libc::SIGKILL) };
    assert_eq!(std::fs::read(target.join("tokens.bin")).expect("read while the server restarts"), pattern(300_000, 7));
    serving_pid(&staging, Some(serving));
    assert_eq!(processes_at(&staging, "\u{1}").0, 2, "the keeper and a new server");

    // The keeper dies (kill -9), and the mount with it: the next stage
    // finds its mount dead and mounts the volume again; the next publish
    // binds the pod's target to the live mount.
    let status: serde_json::Value =
        serde_json::from_str(&arbor_ok(&["status", staging.to_str().expect("utf8"), "--json"])).expect("status json");
    let pid = status["keeper_pid"].as_i64().expect("the mount's keeper") as libc::pid_t;
    // SAFETY: a signal to the mount process the plugin started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    wait_until("the mount process to die", Duration::from_secs(10), || !statfs_ok(&staging));
    node.node_stage_volume(stage_req("ckpt", &staging, rox, &ctx, &[])).await.expect("stage a dead mount again");
    assert_eq!(errno_of(std::fs::read(target.join("tokens.bin"))), libc::ENOTCONN, "still bound to the dead mount");
    node.node_publish_volume(publish_req("ckpt", &staging, &target, rox, false)).await.expect("publish again");
    assert_eq!(std::fs::read(target.join("tokens.bin")).expect("read after the remount"), pattern(300_000, 7));
    node.node_unpublish_volume(unpublish_req("ckpt", &target)).await.expect("unpublish");
    assert!(!target.exists());
    node.node_unstage_volume(unstage_req("ckpt", &staging)).await.expect("unstage");
    assert!(!fuse_mounted_at(&staging));
    node.node_unstage_volume(unstage_req("ckpt", &staging)).await.expect("unstage again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_an_s3_disk_with_the_bucket_credentials_from_the_secret() {
    use arbor_engine::testkit::{S3_BUCKET, S3_KEY, S3_SECRET};
    let Some(w) = S3World::start() else { return };
    let disk = format!("s3://{S3_BUCKET}/csi");
    arbor_env_ok(&["init", &disk], &w.env);
    let mnt = w.mnt("writer");
    let m = Mount::start_env(&disk, &mnt, &[], &w.env);
    std::fs::write(mnt.join("shard-0"), pattern(2_000_000, 3)).expect("write");
    arbor_env_ok(&["checkpoints", "create", mnt.to_str().expect("utf8"), "v1"], &w.env);
    m.unmount_env(&w.env);

    // The plugin knows where the bucket is, not how to sign for it: the
    // credentials come from the volume's secret.
    let env: Vec<(&str, String)> =
        w.env.iter().filter(|(k, _)| !k.starts_with("AWS_SECRET") && !k.starts_with("AWS_ACCESS")).cloned().collect();
    let dir = w.dir.path();
    let plugin = Plugin::start_env(dir, &env);
    let mut node = NodeClient::new(connect(&plugin.socket).await);
    let staging = dir.join("globalmount");
    let target = dir.join("pods/p/volumes/data");
    std::fs::create_dir_all(target.parent().expect("parent")).expect("mkdir");
    let _cleanup = Cleanup { targets: vec![target.clone()], staging: vec![staging.clone()] };
    let ctx = [("disk", disk.as_str()), ("checkpoint", "v1"), ("cacheSize", "64M")];
    let secrets = [("awsAccessKeyId", S3_KEY), ("awsSecretAccessKey", S3_SECRET)];
    let rox = Mode::MultiNodeReaderOnly;
    let unsigned = node.node_stage_volume(stage_req("s3-ckpt", &staging, rox, &ctx, &[])).await;
    let refused = unsigned.expect_err("a stage without the secret's credentials");
    assert!(refused.message().contains("credentials"), "{refused:?}");
    assert!(!fuse_mounted_at(&staging));
    node.node_stage_volume(stage_req("s3-ckpt", &staging, rox, &ctx, &secrets)).await.expect("stage");
    for p in [&staging, &plugin.socket] {
        let (n, leaked) = processes_at(p, S3_SECRET);
        assert!(n >= 1 && !leaked, "{n} processes at {}; the key in their argv or environment: {leaked}", p.display());
    }
    let creds: Vec<_> = walk(&plugin.state).into_iter().filter(|p| p.ends_with("aws-credentials")).collect();
    assert_eq!(creds.len(), 1);
    assert_eq!(std::fs::metadata(&creds[0]).expect("credentials").permissions().mode() & 0o777, 0o600);
    node.node_publish_volume(publish_req("s3-ckpt", &staging, &target, rox, true)).await.expect("publish");
    assert_eq!(std::fs::read(target.join("shard-0")).expect("read from the bucket"), pattern(2_000_000, 3));
    node.node_unpublish_volume(unpublish_req("s3-ckpt", &target)).await.expect("unpublish");
    node.node_unstage_volume(unstage_req("s3-ckpt", &staging)).await.expect("unstage");
    assert!(!fuse_mounted_at(&staging));
    // Its chunk cache and credentials went with it.
    let left: Vec<_> =
        walk(&plugin.state.join("cache")).into_iter().chain(walk(&plugin.state.join("secrets"))).collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out
}

/// Whether grpcio and grpcio-tools are importable; in CI they must be.
fn grpcio_available() -> bool {
    let ok = Command::new("python3").args(["-c", "import grpc, grpc_tools"]).status().is_ok_and(|s| s.success());
    if !ok {
        if std::env::var_os("CI").is_some() {
            panic!("grpcio and grpcio-tools must be installed in CI");
        }
        eprintln!("SKIPPED: grpcio or grpcio-tools is not installed");
    }
    ok
}

#[test]
fn the_same_calls_from_python_grpcio_with_stubs_from_the_proto() {
    if !grpcio_available() {
        return;
    }
    let Some(w) = SharedWorld::start() else { return };
    let dir = w.s.dir.path();
    let plugin = Plugin::start(dir);
    let staging = dir.join("py-globalmount");
    let pods = dir.join("py-pods");
    let targets = ["a", "b", "ro"].map(|p| pods.join(p).join("data")).to_vec();
    let _cleanup = Cleanup { targets, staging: vec![staging.clone()] };
    let proto = Path::new(env!("CARGO_MANIFEST_DIR")).join("../csi/proto/csi.proto");
    let out = python(
        "csi_kubelet.py",
        &[
            proto.to_str().expect("utf8"),
            plugin.socket.to_str().expect("utf8"),
            dir.to_str().expect("utf8"),
            w.s.disk_str(),
            &w.owner.addr,
            TOKEN,
        ],
    );
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert!(
        out.status.success() && text.contains("ALL OK"),
        "the Python kubelet failed:\n{text}\n{}",
        plugin.log_text()
    );
    assert!(!fuse_mounted_at(&staging));
}
