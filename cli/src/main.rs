//! `arbor`: mount a disk made of a bucket (or a local folder), and manage it.

mod control;
mod disk;
mod serve;

use anyhow::{bail, Result};
use arbor_engine::device::FileDevice;
use arbor_engine::io::IoMode;
use clap::{Parser, Subcommand};
use indicatif::{HumanBytes, ProgressBar, ProgressStyle};
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(name = "arbor", version, about = "A disk made of a bucket: mount it anywhere, fsync is durable.")]
#[command(after_help = "Example:\n  arbor init ./disk && mkdir -p /mnt/data && arbor mount ./disk /mnt/data")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a new disk in DISK (a local folder).
    #[command(after_help = "Example:\n  arbor init /data/arbor-disk")]
    Init {
        /// The disk: a local folder (s3:// URLs are not supported yet).
        disk: String,
    },
    /// Mount a branch of DISK at MOUNTPOINT (in the background unless --foreground).
    #[command(
        after_help = "Example:\n  arbor mount /data/arbor-disk /mnt/data\n  arbor mount /data/arbor-disk /mnt/data --foreground"
    )]
    Mount {
        disk: String,
        mountpoint: PathBuf,
        /// The branch to mount.
        #[arg(long, default_value = "main")]
        branch: String,
        /// Where this node keeps the branch's segments (default: inside DISK).
        #[arg(long)]
        cache_dir: Option<PathBuf>,
        /// Kernel read-ahead for sequential readers, in bytes.
        #[arg(long, default_value_t = 4 << 20)]
        read_ahead: u32,
        /// Let other users access the mount.
        #[arg(long)]
        allow_other: bool,
        /// Stay attached and log to stderr (for systemd and containers).
        #[arg(long)]
        foreground: bool,
    },
    /// Unmount MOUNTPOINT, waiting until everything is durable.
    #[command(after_help = "Example:\n  arbor unmount /mnt/data")]
    Unmount { mountpoint: PathBuf },
    /// Show what the mount at MOUNTPOINT is doing.
    #[command(after_help = "Example:\n  arbor status /mnt/data --json")]
    Status {
        mountpoint: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Verify every record and every file byte of an unmounted branch.
    #[command(after_help = "Example:\n  arbor fsck /data/arbor-disk")]
    Fsck {
        disk: String,
        #[arg(long, default_value = "main")]
        branch: String,
        #[arg(long)]
        cache_dir: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
}

fn init_logging(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    use std::io::IsTerminal;
    let ansi = std::io::stderr().is_terminal();
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).init();
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Init { disk } => {
            let d = disk::Disk::init(&disk)?;
            println!("initialized arbor disk at {}", d.root.display());
        }
        Command::Mount { disk, mountpoint, branch, cache_dir, read_ahead, allow_other, foreground } => {
            let args = serve::MountArgs { disk, mountpoint, branch, cache_dir, read_ahead, allow_other };
            if foreground {
                serve::run_foreground(&args)?;
            } else {
                let log = serve::spawn_background(&args)?;
                println!(
                    "mounted {} at {} (branch {}); log: {}",
                    args.disk,
                    args.mountpoint.display(),
                    args.branch,
                    log.display()
                );
            }
        }
        Command::Unmount { mountpoint } => {
            serve::unmount(&mountpoint)?;
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
        Command::Fsck { disk, branch, cache_dir, json } => fsck(&disk, &branch, cache_dir, json)?,
    }
    Ok(())
}

fn print_status(s: &serde_json::Value) {
    let get = |k: &str| s[k].as_str().map(str::to_string).unwrap_or_else(|| s[k].to_string());
    println!("mountpoint   {}", get("mountpoint"));
    println!("disk         {}", get("disk"));
    println!("branch       {}{}", get("branch"), if s["read_only"] == json!(true) { " (read-only)" } else { "" });
    println!("cache        {}", get("cache_dir"));
    println!("server pid   {}", get("pid"));
    println!("io           {}", get("io_backend"));
    println!(
        "log          record {} written, {} durable, {} since last commit",
        get("last_seq"),
        get("durable_seq"),
        get("ops_since_commit")
    );
    println!("node cache   {}", HumanBytes(s["node_cache_bytes"].as_u64().unwrap_or(0)));
    if s["poisoned"] == json!(true) {
        println!("state        REFUSING WRITES after a failed sync; see the log");
    }
}

fn fsck(disk_arg: &str, branch: &str, cache_dir: Option<PathBuf>, json_out: bool) -> Result<()> {
    disk::check_branch_name(branch)?;
    let d = disk::Disk::open(disk_arg)?;
    let dir = cache_dir.unwrap_or_else(|| d.default_cache_dir(branch));
    if !dir.join("superblock").exists() {
        bail!("no branch {branch:?} in {}", dir.display());
    }
    let device = FileDevice::open_exclusive(&dir, IoMode::Auto)
        .map_err(|e| anyhow::anyhow!("cannot check a mounted branch: {e}"))?;
    let bar = ProgressBar::new_spinner().with_style(ProgressStyle::with_template("{spinner} fsck {msg}")?);
    bar.enable_steady_tick(Duration::from_millis(100));
    let report = arbor_engine::fsck::check(device, &mut |step| bar.set_message(step.to_string()))?;
    bar.finish_and_clear();
    if json_out {
        println!(
            "{}",
            json!({"segments": report.segments, "records": report.records, "files": report.files,
                   "directories": report.directories, "bytes_verified": report.bytes_verified, "problems": report.problems})
        );
    } else {
        println!(
            "{} segments, {} records, {} files, {} directories, {} verified",
            report.segments,
            report.records,
            report.files,
            report.directories,
            HumanBytes(report.bytes_verified)
        );
        for p in &report.problems {
            println!("PROBLEM: {p}");
        }
    }
    if !report.problems.is_empty() {
        bail!("{} problems found", report.problems.len());
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let foreground_mount = matches!(cli.command, Command::Mount { foreground: true, .. });
    init_logging(if foreground_mount { "info" } else { "warn" });
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let msg = format!("{e:#}").replace('\n', " ");
            if foreground_mount {
                tracing::error!("{msg}");
            }
            eprintln!("arbor: {msg}");
            ExitCode::FAILURE
        }
    }
}
