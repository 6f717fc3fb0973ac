//! `arbor`: mount a disk made of a bucket (or a local folder), and manage it.

mod commands;
mod control;
mod export;
mod import;
mod json;
mod keeper;
mod mount;
mod mount_metrics;
mod prefetch;
mod remote_mount;
mod serve;
mod session;
mod settings;
mod tls;
mod warm;

use arbor_node::disk;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use indicatif::HumanBytes;
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "arbor", version, about = "A disk made of a bucket: mount it anywhere, fsync is durable.")]
#[command(
    after_help = "Example:\n  arbor init ./disk && mkdir -p /mnt/data && arbor mount ./disk /mnt/data\n  arbor init s3://my-bucket/disk1 && arbor mount s3://my-bucket/disk1 /mnt/data --cache-size 100G"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a new disk (with branch main) in a bucket or a local folder.
    #[command(after_help = "Example:\n  arbor init /data/arbor-disk\n  arbor init s3://my-bucket/team/disk1")]
    Init {
        /// The disk: s3://bucket/prefix, or a local folder (the embedded default).
        disk: String,
    },
    /// Mount a branch (read-write) or checkpoint (read-only) of DISK at MOUNTPOINT.
    #[command(
        after_help = "Example:\n  arbor mount /data/arbor-disk /mnt/data\n  arbor mount /data/arbor-disk /mnt/run-a --branch run-a\n  arbor mount /data/arbor-disk /mnt/v1 --checkpoint dataset-v1\n  arbor mount s3://my-bucket/disk1 /mnt/run-b --branch run-b --durability bucket --cache-dir /nvme/arbor"
    )]
    Mount(MountCmd),
    /// Unmount MOUNTPOINT, waiting until everything is durable and in the bucket.
    #[command(after_help = "Example:\n  arbor unmount /mnt/data")]
    Unmount {
        mountpoint: PathBuf,
        /// The `arbor keeper` socket the mount was started with: if its
        /// server is gone, the keeper lets the connection go, and the dead
        /// mount is detached instead of waiting for a server.
        #[arg(long, value_name = "SOCKET")]
        keeper: Option<PathBuf>,
    },
    /// Hold the FUSE connections of mounts started with `--keeper SOCKET`,
    /// so that a mount process killed with its whole process tree (a
    /// `systemctl restart`, a container's restart) comes back on the same
    /// kernel mount: its open files stall, then go on. Opens no disk.
    #[command(
        after_help = "Example:\n  arbor keeper --socket /run/arbor/keeper.sock\n  arbor mount /data/arbor-disk /mnt/data --foreground --keeper /run/arbor/keeper.sock"
    )]
    Keeper {
        /// The Unix socket to serve on (made 0600).
        #[arg(long)]
        socket: PathBuf,
        /// Print the mount points whose connections the running keeper
        /// holds (JSON), and exit.
        #[arg(long)]
        list: bool,
    },
    /// Show what the mount at MOUNTPOINT is doing.
    #[command(after_help = "Example:\n  arbor status /mnt/data --json")]
    Status {
        mountpoint: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Frozen, named states of a branch (TARGET: a mountpoint or a DISK).
    #[command(
        subcommand,
        after_help = "Example:\n  arbor checkpoints create /mnt/data dataset-v1\n  arbor checkpoints list /mnt/data"
    )]
    Checkpoints(CheckpointsCmd),
    /// Writable forks of a checkpoint or branch (TARGET: a mountpoint or a DISK).
    #[command(
        subcommand,
        after_help = "Example:\n  arbor branches create /mnt/data run-a --from-checkpoint dataset-v1"
    )]
    Branches(BranchesCmd),
    /// Paths added, removed and modified between two checkpoints or branches.
    #[command(
        after_help = "Example:\n  arbor diff /mnt/data dataset-v1 run-a\n  arbor diff /data/arbor-disk branch:run-a branch:run-b --json"
    )]
    Diff {
        target: String,
        from: String,
        to: String,
        #[arg(long)]
        json: bool,
    },
    /// Read files ahead of their first use, with a progress bar.
    #[command(after_help = "Example:\n  arbor prefetch /mnt/data datasets/tokens.bin shards/")]
    Prefetch {
        mountpoint: PathBuf,
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Delete segments no branch or checkpoint reaches.
    #[command(after_help = "Example:\n  arbor gc /data/arbor-disk")]
    Gc {
        target: String,
        /// Keep segments written within this many seconds (live writers).
        #[arg(long, default_value_t = arbor_snapshot::GC_GRACE.as_secs())]
        grace: u64,
    },
    /// Move a branch's live bytes (file data and tree nodes) out of segments
    /// that are mostly dead, so that `gc` can delete those segments.
    #[command(
        after_help = "Example:\n  arbor compact /mnt/arbor            # the mounted branch\n  arbor compact /data/arbor-disk --branch run-a --max-live 0.5"
    )]
    Compact {
        /// A disk or a mountpoint.
        target: String,
        /// The branch (default: the mounted one, else main).
        #[arg(long)]
        branch: Option<String>,
        /// Move out of segments whose live bytes are at most this fraction.
        #[arg(long, default_value_t = arbor_engine::volume::MAX_LIVE)]
        max_live: f64,
    },
    /// Serve a shared cache of DISK's data to every node that mounts it
    /// (`arbor mount … --cache-server HOST:PORT`): each chunk is fetched from
    /// the bucket once, checked, kept on this node, and served from here.
    /// With --branch, also own those branches: `arbor mount DISK MNT
    /// --branch B --token-file F` on any node then writes through here.
    #[command(
        after_help = "Example:\n  arbor serve s3://my-bucket/disk1 --listen 0.0.0.0:7070 --cache-dir /nvme/arbor-cache --cache-size 2T --token-file /etc/arbor/token\n  arbor mount s3://my-bucket/disk1 /mnt/data --checkpoint v1 --cache-server cache1:7070,cache2:7070 --token-file /etc/arbor/token\n  arbor serve s3://my-bucket/disk1 --listen 0.0.0.0:7070 --branch main --token-file /etc/arbor/token\n  arbor mount s3://my-bucket/disk1 /mnt/disk --branch main --token-file /etc/arbor/token   # on every node"
    )]
    Serve(ServeCmd),
    /// Read PATHs of a checkpoint through the cache servers, without a mount,
    /// so that the jobs that follow start warm (each chunk is fetched from
    /// the bucket once, by the server that owns it).
    #[command(
        after_help = "Example:\n  arbor warm s3://my-bucket/disk1 --checkpoint v1 datasets/tokens shards/ --cache-server cache1:7070,cache2:7070 --token-file /etc/arbor/token"
    )]
    Warm {
        disk: String,
        #[arg(long)]
        checkpoint: String,
        /// Files or folders inside the checkpoint (`/` for all of it).
        #[arg(required = true)]
        paths: Vec<String>,
        #[command(flatten)]
        servers: CacheServers,
    },
    /// Add the objects under an S3 prefix to a branch as files, copying no
    /// data: each file reads its object (while it keeps the ETag it had).
    #[command(
        after_help = "Example:\n  arbor import /mnt/data s3://corpus/raw/v3 --at /datasets/raw\n  arbor import s3://my-bucket/disk1 s3://corpus/tokens --branch run-a\n  arbor import /mnt/data s3://corpus/raw/v3 --at /datasets/raw --refresh"
    )]
    Import {
        /// A disk or a mountpoint.
        target: String,
        /// s3://bucket/prefix: every object under it becomes a file.
        source: String,
        /// The folder of the branch the objects go under (made if missing).
        #[arg(long, default_value = "/")]
        at: String,
        /// The branch (default: the mounted one, else main).
        #[arg(long)]
        branch: Option<String>,
        /// Also follow objects changed or deleted since the last import
        /// (files the branch changed are left alone and reported).
        #[arg(long)]
        refresh: bool,
        #[arg(long)]
        json: bool,
    },
    /// Write every file of a branch or checkpoint as one plain object under
    /// an S3 prefix; a second run uploads only what changed since the first.
    #[command(
        after_help = "Example:\n  arbor export /mnt/data --checkpoint step-9000 s3://team-results/run-a\n  arbor export s3://my-bucket/disk1 --branch run-a s3://team-results/run-a --since step-8000"
    )]
    Export {
        /// A disk or a mountpoint.
        target: String,
        /// The branch to export (default: the mounted one, else main).
        #[arg(long, conflicts_with = "checkpoint")]
        branch: Option<String>,
        /// A checkpoint to export.
        #[arg(long)]
        checkpoint: Option<String>,
        /// s3://bucket/prefix: each file becomes prefix/PATH.
        dest: String,
        /// Upload what changed since this checkpoint (from the tree diff)
        /// instead of comparing every file.
        #[arg(long)]
        since: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Serve the Kubernetes CSI node plugin (Identity and Node) on a Unix
    /// socket: the kubelet stages a volume (one `arbor mount` per node) and
    /// bind-mounts it into each pod (see docs/kubernetes.md).
    #[command(after_help = "Example:\n  arbor csi --endpoint unix:///csi/csi.sock --node-id \"$NODE_NAME\"")]
    Csi(CsiCmd),
    /// Verify every record, every file byte the disk holds in every branch
    /// and checkpoint, and that imported files' objects are unchanged.
    #[command(after_help = "Example:\n  arbor fsck /data/arbor-disk")]
    Fsck {
        disk: String,
        #[arg(long)]
        json: bool,
        /// Do not ask the bucket whether imported files' objects still have
        /// the ETags the files recorded.
        #[arg(long)]
        offline: bool,
    },
}

#[derive(Args)]
struct MountCmd {
    disk: String,
    mountpoint: PathBuf,
    /// The branch to mount read-write (default: main).
    #[arg(long, conflicts_with = "checkpoint")]
    branch: Option<String>,
    /// A checkpoint to mount read-only.
    #[arg(long)]
    checkpoint: Option<String>,
    /// Read-ahead for sequential readers, in bytes: the kernel's for the
    /// mount (set through sysfs; root) and the first window of arbor's own.
    #[arg(long, default_value_t = arbor_engine::tier::READ_AHEAD as u32)]
    read_ahead: u32,
    /// Threads answering the kernel: also how many reads may wait for the
    /// bucket at once (chunks not cached yet, imported files' objects).
    #[arg(long, default_value_t = arbor_fs::THREADS as u16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    threads: u16,
    /// Paths (inside the mount, comma-separated) to read in the background once mounted.
    #[arg(long, value_delimiter = ',')]
    pre_fetch: Vec<PathBuf>,
    /// Let other users access the mount.
    #[arg(long)]
    allow_other: bool,
    /// Every this many seconds, compact the mounted branch and delete the
    /// segments no branch or checkpoint reaches (0: never; `arbor compact`
    /// and `arbor gc` do it by hand).
    #[arg(long, default_value_t = 0)]
    maintain_every: u64,
    /// Every this many seconds, refresh what `arbor import` brought into the
    /// mounted branch from its buckets (new, changed and deleted objects;
    /// 0: never, `arbor import --refresh` does it by hand).
    #[arg(long, default_value_t = 0)]
    refresh_source: u64,
    /// Stay attached and log to stderr (for systemd and containers).
    #[arg(long)]
    foreground: bool,
    /// Where an s3:// disk keeps its local cache (default: a folder per mount
    /// under ~/.cache/arbor); `none`: in memory only (checkpoint mounts), see --cache-memory.
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// With --cache-dir none: how much chunk data the memory cache keeps.
    #[arg(long, default_value_t = disk::Size(arbor_engine::tier::CACHE_MEMORY))]
    cache_memory: disk::Size,
    /// How much chunk data (segments' and imported files') the cache of an s3:// disk keeps, e.g. 50G.
    #[arg(long, default_value_t = disk::Size(arbor_engine::tier::CACHE_SIZE))]
    cache_size: disk::Size,
    /// local: fsync is durable on this node, the bucket catches up in the background;
    /// bucket: fsync returns once the bytes are in the bucket.
    #[arg(long, default_value = "local")]
    durability: arbor_engine::tier::Durability,
    /// How large a log segment grows before it is sealed (and, on an s3://
    /// disk, uploaded): fewer, larger objects, or a bucket that catches up sooner.
    #[arg(long, default_value_t = disk::Size(arbor_engine::volume::SEGMENT_SIZE))]
    segment_size: disk::Size,
    #[command(flatten)]
    servers: CacheServers,
    /// Mount the branch through the `arbor serve --branch` at HOST:PORT
    /// (default: the owner the bucket names, if the branch is served).
    #[arg(long, conflicts_with = "checkpoint")]
    server: Option<String>,
    /// Through an owner: an operation fails with EIO after this long
    /// without an answer, e.g. 30s (default: wait for the owner).
    #[arg(long)]
    timeout: Option<disk::Span>,
    /// Through an owner: honour set-user-ID and set-group-ID bits, file
    /// capabilities and device nodes on this mount (without, it is
    /// nosuid,nodev). Root on any node that can write the branch is then
    /// root on this one. (A mount of a branch this node writes itself
    /// always honours them.)
    #[arg(long)]
    allow_suid_devices: bool,
    /// Survive the death of the process serving the mount (kill -9, an OOM
    /// kill, an upgrade's restart): a small keeper process holds the FUSE
    /// connection and starts a new server on it; open files stall, then go
    /// on. Each change is then answered once it outlives the server (a
    /// write system call per change; a mount through an owner waits for
    /// the owner's answer to each write). `arbor csi` mounts this way.
    #[arg(long, conflicts_with = "keeper")]
    restartable: bool,
    /// Hand the FUSE connection to the `arbor keeper` at SOCKET, and take
    /// it back from there when started again on a mount point it holds:
    /// the mount survives this process and every process around it (kill
    /// -9, `systemctl restart`, a container's restart); open files stall
    /// until `arbor mount` runs again with the same arguments. SIGTERM
    /// makes what was answered durable and exits leaving the mount to the
    /// keeper (so `systemctl restart` restarts it in place); SIGINT and
    /// `arbor unmount` unmount. Each change is answered once it outlives
    /// the process, as with --restartable.
    #[arg(long, value_name = "SOCKET")]
    keeper: Option<PathBuf>,
    /// Serve `GET /metrics` (Prometheus text: FUSE operations, bucket calls,
    /// the chunk cache) on this address, e.g. 127.0.0.1:9101. No token: bind
    /// it where only the scraper reaches.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
}

/// Where a client reads chunks before the bucket.
#[derive(Args)]
struct CacheServers {
    /// Cache servers (`arbor serve`) to read through, HOST:PORT,… (the same
    /// list on every node); chunks they cannot give come from the bucket.
    #[arg(long, value_delimiter = ',', env = "ARBOR_CACHE_SERVERS")]
    cache_server: Vec<String>,
    /// A file holding the cache servers' token.
    #[arg(long, env = "ARBOR_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    #[command(flatten)]
    tls: tls::ClientTlsArgs,
}

/// `--cache-dir none`: a cache in memory only.
fn memory_only(cache_dir: &Option<PathBuf>) -> bool {
    cache_dir.as_deref() == Some(std::path::Path::new("none"))
}

#[derive(Args)]
struct ServeCmd {
    /// An s3:// disk (any disk, with --branch).
    disk: String,
    /// The address to listen on, HOST:PORT.
    #[arg(long)]
    listen: String,
    /// Where the cached chunks live (default: a folder under ~/.cache/arbor);
    /// `none`: in memory only, see --cache-memory.
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// With --cache-dir none: how much chunk data the memory cache keeps.
    #[arg(long, default_value_t = disk::Size(arbor_engine::tier::CACHE_MEMORY))]
    cache_memory: disk::Size,
    /// How much chunk data the cache keeps, e.g. 2T.
    #[arg(long, default_value_t = disk::Size(arbor_engine::tier::CACHE_SIZE))]
    cache_size: disk::Size,
    /// How much of imported files' source objects to keep in memory, in
    /// front of the cache folder (0: do not serve them; their clients read
    /// their buckets).
    #[arg(long, default_value = "1G")]
    object_memory: disk::Size,
    /// A file holding the token every client must present (optional with
    /// --tls-client-ca: a client certificate is then the only way in).
    #[arg(long, env = "ARBOR_TOKEN_FILE", required_unless_present = "tls_client_ca")]
    token_file: Option<PathBuf>,
    #[command(flatten)]
    tls: tls::ServerTlsArgs,
    /// Stay attached and log to stderr (for systemd and containers).
    #[arg(long)]
    foreground: bool,
    /// Evict chunks nobody read for this long, e.g. 30m, 1h, 2d (0: only
    /// when the cache is full).
    #[arg(long, default_value = "1h")]
    keep_for: disk::Span,
    /// Misbehave on purpose (tests of the clients' checks): corrupt or short.
    #[arg(long, hide = true)]
    fault: Option<arbor_net::Fault>,
    /// Own these branches (comma-separated) and serve their files to
    /// `arbor mount --branch` on other nodes, which then write through here.
    #[arg(long, value_delimiter = ',')]
    branch: Vec<String>,
    /// The HOST:PORT other nodes reach this server at (default: --listen,
    /// or this host's name when listening on every interface).
    #[arg(long)]
    advertise: Option<String>,
    /// Take the branches even while another process's lease on them runs
    /// (its node is known to be dead; if it is not, it is fenced).
    #[arg(long)]
    take_over: bool,
    /// For --branch: how long this owner's claim lives without renewal
    /// (renewed every third of it). Another node that finds the owner
    /// silent waits this long and a fifth more, by its own clock, before
    /// it takes the branch; an owner that cannot renew for four fifths of
    /// it stops acknowledging writes.
    #[arg(long, default_value = "60s")]
    lease_ttl: disk::Span,
    /// For --branch: after this owner starts, how long only the locks its
    /// clients held under the owner before are granted (they take them
    /// back); other lock requests wait. Only when the branch may have locks
    /// from before. 0 gives up locks from before at once (their holders'
    /// next fsync fails with EIO).
    #[arg(long, default_value_t = disk::Span(arbor_net::branch::locks::LOCK_GRACE))]
    lock_grace: disk::Span,
    /// For --branch: how long a stop (SIGTERM) waits for the bucket to take
    /// the branches' last bytes before the process exits anyway (non-zero,
    /// saying what is durable where).
    #[arg(long, default_value_t = disk::Span(arbor_node::owner::STOP_WAIT))]
    stop_timeout: disk::Span,
    /// For --branch on an s3:// disk: bucket (the default: a client's
    /// fsync returns once the bytes are in the bucket, so it survives the
    /// loss of this node) or local (durable on this node's disk only until
    /// the bytes are uploaded: losing this node loses clients' fsynced
    /// writes since the last upload, and a client hears of it only for
    /// writes it has not fsynced yet).
    #[arg(long, default_value = "bucket")]
    durability: arbor_engine::tier::Durability,
    /// For --branch: how large a log segment grows before it is sealed (and,
    /// on an s3:// disk, uploaded, after which clients read its bytes from
    /// the bucket and the cache servers rather than through here).
    #[arg(long, default_value_t = disk::Size(arbor_engine::volume::SEGMENT_SIZE))]
    segment_size: disk::Size,
    /// For --branch: accept set-user-ID and set-group-ID bits, file
    /// capabilities and device nodes from clients (refused with EPERM
    /// without). Root on any client is then root on every node that mounts
    /// the branch with --allow-suid-devices.
    #[arg(long)]
    allow_suid_devices: bool,
    /// For --branch: take a client's root (uid 0, gid 0) as root, who may
    /// give files away; by default it is nobody (65534).
    #[arg(long)]
    no_root_squash: bool,
    /// Also answer the S3 API on HOST:PORT: each branch this server owns
    /// (--branch) is a writable bucket of its name, each checkpoint a
    /// read-only bucket BRANCH--CHECKPOINT (see docs/s3.md).
    #[arg(long, requires = "s3_keys")]
    s3: Option<String>,
    /// With --s3: the keys requests are signed with (SigV4), one
    /// `ACCESS_KEY_ID SECRET` a line; refused unless only its owner can
    /// read it (mode 0600).
    #[arg(long, requires = "s3")]
    s3_keys: Option<PathBuf>,
    /// With --s3: a domain under which host BUCKET.DOMAIN addresses a
    /// bucket (virtual-host style); may be given again (default:
    /// localhost). Requests to any other host name the bucket in the path.
    #[arg(long, requires = "s3")]
    s3_domain: Vec<String>,
}

#[derive(Args)]
struct CsiCmd {
    /// The socket to serve on: unix:///path or a path.
    #[arg(long, env = "CSI_ENDPOINT")]
    endpoint: String,
    /// This node's name as the kubelet knows it.
    #[arg(long, env = "NODE_ID")]
    node_id: String,
    /// Where the plugin keeps its volume records, secrets (0600) and caches.
    #[arg(long, default_value = arbor_csi::STATE_DIR)]
    state_dir: PathBuf,
    /// Mount volumes with `arbor mount --keeper SOCKET` (an `arbor keeper`
    /// outside this plugin's container), and on start serve again every
    /// staged volume whose kernel mount outlived its mount process: pods
    /// keep their files across a restart of the plugin's container.
    #[arg(long, value_name = "SOCKET")]
    keeper: Option<PathBuf>,
}

#[derive(Subcommand)]
enum CheckpointsCmd {
    /// Freeze a branch's current state, unsynced writes included (durable on return).
    Create {
        target: String,
        name: String,
        /// For a DISK target: the branch (default main).
        #[arg(long)]
        branch: Option<String>,
    },
    List {
        target: String,
        #[arg(long)]
        json: bool,
    },
    Delete {
        target: String,
        name: String,
    },
}

#[derive(Subcommand)]
enum BranchesCmd {
    /// A new writable branch equal to a checkpoint or to another branch now.
    Create {
        target: String,
        name: String,
        #[arg(long, conflicts_with = "from_branch", required_unless_present = "from_branch")]
        from_checkpoint: Option<String>,
        #[arg(long)]
        from_branch: Option<String>,
    },
    List {
        target: String,
        #[arg(long)]
        json: bool,
    },
    /// Delete a branch (not main, not while mounted).
    Delete {
        target: String,
        name: String,
    },
    /// Point a branch back at a checkpoint, dropping what it had since.
    Reset {
        target: String,
        name: String,
        #[arg(long)]
        to_checkpoint: String,
    },
    Rename {
        target: String,
        name: String,
        new_name: String,
    },
}

fn init_logging(default: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let ansi = std::io::stderr().is_terminal();
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).init();
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Init { disk } => {
            let d = disk::init(&disk)?;
            println!("initialized arbor disk at {} with branch main", d.url);
        }
        Command::Csi(c) => arbor_csi::run(arbor_csi::PluginOptions {
            endpoint: c.endpoint,
            node_id: c.node_id,
            state_dir: std::path::absolute(c.state_dir)?,
            arbor_bin: std::env::current_exe()?,
            keeper: c.keeper.map(std::path::absolute).transpose()?,
        })?,
        Command::Mount(m) => {
            let memory = memory_only(&m.cache_dir);
            // Through an owner (a token given) a branch mount keeps no log
            // here; that is known for sure once the disk is open.
            let bucket_durable = m.durability == arbor_engine::tier::Durability::Bucket;
            let client_tls = m.servers.tls.files()?;
            let through_owner =
                m.servers.token_file.is_some() || arbor_node::cache_client::has_identity(client_tls.as_ref());
            if memory && m.checkpoint.is_none() && !through_owner && !bucket_durable {
                anyhow::bail!(arbor_node::MEMORY_ONLY_BRANCH);
            }
            let args = mount::MountArgs {
                disk: m.disk,
                mountpoint: m.mountpoint,
                branch: m.branch,
                checkpoint: m.checkpoint,
                read_ahead: m.read_ahead,
                threads: m.threads as usize,
                allow_other: m.allow_other,
                pre_fetch: m.pre_fetch,
                maintain_every: m.maintain_every,
                refresh_source: m.refresh_source,
                segment_size: m.segment_size.0,
                cache: disk::CacheOptions {
                    dir: if memory { None } else { m.cache_dir.map(std::path::absolute).transpose()? },
                    size: if memory { m.cache_memory.0 } else { m.cache_size.0 },
                    durability: m.durability,
                    read_ahead: m.read_ahead as u64,
                    peers: None,
                    memory,
                },
                cache_servers: m.servers.cache_server,
                token_file: m.servers.token_file.map(std::path::absolute).transpose()?,
                tls: client_tls,
                server: m.server,
                timeout: m.timeout.map(|t| t.0),
                allow_suid_devices: m.allow_suid_devices,
                restartable: m.restartable,
                keeper: m.keeper.map(std::path::absolute).transpose()?,
                metrics: m.metrics,
            };
            if m.foreground {
                mount::run_foreground(&args)?;
            } else {
                let (log, fuse) = mount::spawn_background(&args)?;
                let what = match &args.checkpoint {
                    Some(c) => format!("checkpoint {c}, read-only"),
                    None => format!("branch {}", args.branch.as_deref().unwrap_or("main")),
                };
                println!(
                    "mounted {} at {} ({what}); FUSE: {fuse}; log: {}",
                    args.disk,
                    args.mountpoint.display(),
                    log.display()
                );
            }
        }
        Command::Keeper { socket, list: true } => {
            println!("{}", json!(keeper::client::Client::new(&socket).list()?));
        }
        Command::Keeper { socket, list: false } => keeper::service::run(&socket)?,
        Command::Unmount { mountpoint, keeper } => {
            mount::unmount(&mountpoint, keeper.as_deref())?;
            println!("unmounted {}", mountpoint.display());
        }
        Command::Status { mountpoint, json } => {
            let s = control::request(&mountpoint, json!({"op": "status"}))?;
            if json {
                println!("{s}");
            } else {
                print_status(&s);
            }
        }
        Command::Checkpoints(c) => match c {
            CheckpointsCmd::Create { target, name, branch } => {
                commands::checkpoint_create(&target, &name, branch.as_deref())?
            }
            CheckpointsCmd::List { target, json } => commands::checkpoint_list(&target, json)?,
            CheckpointsCmd::Delete { target, name } => commands::checkpoint_delete(&target, &name)?,
        },
        Command::Branches(b) => match b {
            BranchesCmd::Create { target, name, from_checkpoint, from_branch } => {
                commands::branch_create(&target, &name, from_checkpoint.as_deref(), from_branch.as_deref())?
            }
            BranchesCmd::List { target, json } => commands::branch_list(&target, json)?,
            BranchesCmd::Delete { target, name } => commands::branch_delete(&target, &name)?,
            BranchesCmd::Reset { target, name, to_checkpoint } => {
                commands::branch_reset(&target, &name, &to_checkpoint)?
            }
            BranchesCmd::Rename { target, name, new_name } => commands::branch_rename(&target, &name, &new_name)?,
        },
        Command::Diff { target, from, to, json } => commands::diff(&target, &from, &to, json)?,
        Command::Prefetch { mountpoint, paths } => commands::prefetch(&mountpoint, &paths)?,
        Command::Gc { target, grace } => commands::gc(&target, grace)?,
        Command::Compact { target, branch, max_live } => commands::compact(&target, branch.as_deref(), max_live)?,
        Command::Fsck { disk, json, offline } => commands::fsck(&disk, json, offline)?,
        Command::Export { target, branch, checkpoint, dest, since, json } => {
            commands::export(&target, branch.as_deref(), checkpoint.as_deref(), &dest, since.as_deref(), json)?
        }
        Command::Import { target, source, at, branch, refresh, json } => {
            commands::import(&target, &source, &at, branch.as_deref(), refresh, json)?
        }
        Command::Warm { disk, checkpoint, paths, servers } => {
            let tls = servers.tls.files()?;
            let auth = arbor_node::cache_client::ClientAuth { token_file: servers.token_file, tls };
            warm::warm(&disk, &checkpoint, &paths, &servers.cache_server, &auth)?
        }
        Command::Serve(c) => {
            let memory = memory_only(&c.cache_dir);
            arbor_node::check_segment_size(c.segment_size.0)?;
            let cache_dir = match c.cache_dir {
                _ if memory => arbor_node::serve::CacheDir::Memory,
                Some(dir) => arbor_node::serve::CacheDir::At(dir),
                None => arbor_node::serve::CacheDir::Node,
            };
            let args = arbor_node::serve::ServeOptions {
                disk: c.disk,
                listen: c.listen,
                cache_size: if memory { c.cache_memory.0 } else { c.cache_size.0 },
                cache_dir,
                object_memory: c.object_memory.0,
                auth: arbor_node::serve::ServerAuth { token_file: c.token_file, tls: c.tls.files()? },
                fault: c.fault,
                keep_for: Some(c.keep_for.0).filter(|d| !d.is_zero()),
                imported_prefixes: serve::imported_prefixes,
                owner: arbor_node::owner::OwnOptions {
                    branches: c.branch,
                    advertise: c.advertise,
                    take_over: c.take_over,
                    lease_ttl: c.lease_ttl.0,
                    lock_grace: c.lock_grace.0,
                    stop_timeout: c.stop_timeout.0,
                    durability: c.durability,
                    segment_size: c.segment_size.0,
                    policy: arbor_net::Policy {
                        allow_suid_devices: c.allow_suid_devices,
                        root_squash: !c.no_root_squash,
                    },
                    checkpoint_reply: serve::checkpoint_reply,
                },
                on_step_down: std::sync::Arc::new(serve::exit_on_step_down),
            };
            let s3 = match (c.s3, c.s3_keys) {
                (Some(listen), Some(keys_file)) => Some(arbor_s3::Options { listen, keys_file, domains: c.s3_domain }),
                _ => None,
            };
            if c.foreground {
                serve::run_foreground(&args, s3.as_ref())?;
            } else {
                let (pid, log) = serve::spawn_background(&args, s3.as_ref())?;
                println!("serving {} on {} (pid {pid}); log: {}", args.disk, args.listen, log.display());
            }
        }
    }
    Ok(())
}

fn print_cache_servers(s: &serde_json::Value) {
    for c in s["cache_servers"].as_array().into_iter().flatten() {
        let n = |k: &str| c[k].as_u64().unwrap_or(0);
        println!(
            "cache server {}: {} chunks ({}), {} hits, {} parts of chunks for small reads; to the bucket instead: {} down, {} timed out, {} errors, {} not there, {} rejected (bad checksum)",
            c["addr"].as_str().unwrap_or("?"),
            n("chunks"),
            HumanBytes(n("bytes")),
            n("hits"),
            n("parts"),
            n("fallback_down"),
            n("fallback_timeout"),
            n("fallback_error"),
            n("fallback_not_found"),
            n("rejected"),
        );
    }
}

fn print_status(s: &serde_json::Value) {
    let get = |k: &str| s[k].as_str().map(str::to_string).unwrap_or_else(|| s[k].to_string());
    println!("mountpoint   {}", get("mountpoint"));
    println!("disk         {}", get("disk"));
    match s["checkpoint"].as_str() {
        Some(c) => println!("checkpoint   {c} (read-only)"),
        None => println!("branch       {}", get("branch")),
    }
    println!("server pid   {}", get("pid"));
    if let Some(k) = s["keeper_pid"].as_u64() {
        println!("keeper       pid {k}: holds the FUSE connection, restarts the server on it");
    }
    if let Some(k) = s["keeper_socket"].as_str() {
        println!("keeper       `arbor keeper` at {k} holds the FUSE connection (the mount outlives this server)");
    }
    println!(
        "fuse         {}, {} requests on the ring, {} write-only opens past the page cache",
        get("fuse_transport"),
        get("fuse_ring_requests"),
        get("fuse_direct_write_opens")
    );
    match s["kernel_read_ahead"].as_u64() {
        Some(b) if b > 0 => println!("read-ahead   {} KiB by the kernel", b / 1024),
        _ => {}
    }
    if !s["owner"].is_null() {
        println!("owner        {} (metadata and writes go there)", get("owner"));
        println!(
            "owner links  {} sessions, {} retried requests, {} lookups of the owner's address, {} files open",
            get("owner_sessions"),
            get("owner_retries"),
            get("owner_lookups"),
            get("open_files")
        );
        let r = &s["reads"];
        let n = |k: &str| r[k].as_u64().unwrap_or(0);
        println!(
            "reads        {} ({}) from the disk's segments here, {} ({}) from the owner; {} locates, {} failed here",
            n("from_segments"),
            HumanBytes(n("from_segments_bytes")),
            n("from_owner"),
            HumanBytes(n("from_owner_bytes")),
            n("locates"),
            n("segment_reads_failed")
        );
        print_cache_servers(s);
        return;
    }
    println!(
        "io           {}, {} of the log written past the page cache (O_DIRECT)",
        get("io_backend"),
        HumanBytes(s["log_direct_bytes"].as_u64().unwrap_or(0))
    );
    println!(
        "log          record {} written, {} durable, {} since last commit",
        get("last_seq"),
        get("durable_seq"),
        get("ops_since_commit")
    );
    println!("node cache   {}", HumanBytes(s["node_cache_bytes"].as_u64().unwrap_or(0)));
    println!(
        "referenced   {} in {} segments",
        HumanBytes(s["live_bytes"].as_u64().unwrap_or(0)),
        s["segments_referenced"].as_u64().unwrap_or(0)
    );
    if let Some(n) = s["compactable"]["segments"].as_u64().filter(|n| *n > 0) {
        println!(
            "compactable  {n} segments hold {} of it (`arbor compact`, then `arbor gc`)",
            HumanBytes(s["compactable"]["live_bytes"].as_u64().unwrap_or(0))
        );
    }
    if let Some(d) = s["durability"].as_str() {
        println!("durability   {d}");
        println!("uploads      {} pending", HumanBytes(s["pending_upload_bytes"].as_u64().unwrap_or(0)));
        if let Some(e) = s["uploads"]["last_error"].as_str() {
            println!("last error   {e}");
        }
        let c = &s["cache"];
        println!(
            "cache        {} of {} ({} imported files' chunks), {} fetched in {} GETs, {} segment footers found kept here, {} read from the bucket",
            HumanBytes(c["bytes"].as_u64().unwrap_or(0) + c["imported_bytes"].as_u64().unwrap_or(0)),
            HumanBytes(c["capacity"].as_u64().unwrap_or(0)),
            HumanBytes(c["imported_bytes"].as_u64().unwrap_or(0)),
            HumanBytes(c["fetched_bytes"].as_u64().unwrap_or(0)),
            c["gets"].as_u64().unwrap_or(0),
            c["kept_footers"].as_u64().unwrap_or(0),
            c["bucket_footers"].as_u64().unwrap_or(0)
        );
    }
    let i = &s["imported"];
    let n = |k: &str| i[k].as_u64().unwrap_or(0);
    if n("misses") + n("disk_bytes") > 0 {
        println!(
            "imported     {} fetched in {} GETs, {} chunk hits, {} misses ({} from disk, {} from cache servers); {} refused (object changed or gone), {} errors; {} of {} on disk",
            HumanBytes(n("fetched_bytes")),
            n("gets"),
            n("hits"),
            n("misses"),
            n("from_disk"),
            n("from_servers"),
            n("changed"),
            n("errors"),
            HumanBytes(n("disk_bytes")),
            HumanBytes(n("disk_capacity")),
        );
    }
    print_cache_servers(s);
    let r = &s["recovery"];
    if r["replayed"].as_u64().unwrap_or(0) > 0 || r["torn_at"].is_string() || r["sealed"].as_u64().unwrap_or(0) > 0 {
        println!(
            "recovery     opened in {} ms: replayed {} operations from {} segments{}; sealed {} segments that were WAL pieces only ({} pieces read, {} deleted)",
            r["open_ms"].as_u64().unwrap_or(0),
            r["replayed"].as_u64().unwrap_or(0),
            r["segments"].as_u64().unwrap_or(0),
            r["torn_at"].as_str().map(|t| format!(", cut a torn tail at {t}")).unwrap_or_default(),
            r["sealed"].as_u64().unwrap_or(0),
            r["wal_pieces_read"].as_u64().unwrap_or(0),
            r["wal_pieces_deleted"].as_u64().unwrap_or(0),
        );
    }
    if s["poisoned"] == json!(true) {
        println!("state        REFUSING WRITES after a failed sync; see the log");
    }
}

/// A big disk reads from many segment files: lift the soft descriptor
/// limit to the hard one.
fn raise_fd_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit fill and read a plain struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

fn main() -> ExitCode {
    raise_fd_limit();
    let cli = Cli::parse();
    let foreground_mount = matches!(&cli.command, Command::Mount(m) if m.foreground)
        || matches!(&cli.command, Command::Serve(c) if c.foreground)
        || matches!(&cli.command, Command::Csi(_))
        || matches!(&cli.command, Command::Keeper { list: false, .. });
    if !matches!(&cli.command, Command::Mount(_) | Command::Serve(_) | Command::Csi(_) | Command::Keeper { .. }) {
        // A command whose output goes to `head` stops quietly when the
        // reader does, as other tools do, instead of failing to print.
        // (Sockets are written with MSG_NOSIGNAL and are not affected; the
        // long-running commands keep the signal ignored all the same.)
        // SAFETY: setting a signal's disposition to its default.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // The AWS SDK warns about every provider it tries (instance metadata
    // off EC2, for one); arbor reports what failed itself.
    init_logging(if foreground_mount {
        "info,aws_config=error,aws_smithy_runtime=error"
    } else {
        "warn,aws_config=error,aws_smithy_runtime=error"
    });
    match settings::read().and_then(|()| run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let msg = format!("{e:#}").replace('\n', " ");
            // A long-running command's log (its file, the journal) gets a
            // timestamped line too; a terminal gets the one line below.
            if foreground_mount && !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
                tracing::error!("{msg}");
            }
            eprintln!("arbor: {msg}");
            ExitCode::FAILURE
        }
    }
}
