//! Support for tests and benchmarks: a real S3-compatible server
//! (`s3s-fs` 0.14.1) on a free 127.0.0.1 port, with its own data folder,
//! stopped when dropped.

use crate::bucket::S3Config;
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const S3_KEY: &str = "arbor-test-key";
pub const S3_SECRET: &str = "arbor-test-secret";
pub const S3_BUCKET: &str = "arbor-test";

pub struct S3Server {
    child: Child,
    pub port: u16,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl S3Server {
    /// Starts `s3s-fs` serving `data` (bucket [`S3_BUCKET`] is created in
    /// it). `Ok(None)` when `s3s-fs` is not installed and `CI` is unset:
    /// the caller skips, loudly; in CI a missing server is an error.
    pub fn start(data: &Path) -> Result<Option<S3Server>, String> {
        let found = Command::new("s3s-fs").arg("--help").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok();
        if !found {
            if std::env::var_os("CI").is_some() {
                return Err("s3s-fs must be installed in CI (.ci/run installs it)".into());
            }
            eprintln!(
                "SKIPPED: this test needs s3s-fs 0.14.1 \
                 (cargo install s3s-fs --version 0.14.1 --features binary --locked)"
            );
            return Ok(None);
        }
        std::fs::create_dir_all(data.join(S3_BUCKET)).map_err(|e| format!("bucket folder: {e}"))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("free port: {e}"))?
            .port();
        let child = Command::new("s3s-fs")
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--access-key",
                S3_KEY,
                "--secret-key",
                S3_SECRET,
            ])
            .arg(data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("start s3s-fs: {e}"))?;
        let server = S3Server { child, port };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                return Err("s3s-fs did not start listening within 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Some(server))
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A configuration for the test bucket under `prefix`.
    pub fn config(&self, prefix: &str) -> S3Config {
        S3Config {
            bucket: S3_BUCKET.into(),
            prefix: prefix.into(),
            endpoint: Some(self.endpoint()),
            region: Some("us-east-1".into()),
            path_style: true,
            credentials: Some((S3_KEY.into(), S3_SECRET.into())),
        }
    }
}
