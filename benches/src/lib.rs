//! Shared helpers for arbor's comparison harnesses: timing, medians,
//! percentiles, and a markdown table.

use std::time::{Duration, Instant};

/// The number in environment variable `name`, or `default`.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

pub fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    match xs.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

/// The `p`-th percentile (0..=100) of durations, in microseconds.
pub fn percentile_us(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

pub fn time<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let out = f();
    (out, t.elapsed())
}

/// Waits until the kernel has written back every dirty page, so that
/// writeback of what a bench just wrote does not run under its timings.
pub fn settle() {
    // SAFETY: plain syscall.
    unsafe { libc::sync() };
}

/// Drops the page cache (root only); returns whether it could.
pub fn drop_page_cache() -> bool {
    settle();
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// Drops from the page cache every file under `dir` (clean pages only:
/// `settle` first), so that the next read of them comes from the disk.
/// Any user may do this for files it can open; other files keep theirs.
/// Returns the bytes of the files it went through.
pub fn evict_dir(dir: &std::path::Path) -> u64 {
    settle();
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let path = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(path),
                Ok(t) if t.is_file() => {
                    if let Ok(f) = std::fs::File::open(&path) {
                        use std::os::fd::AsRawFd;
                        // SAFETY: plain syscall on a descriptor we own.
                        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
                        total += f.metadata().map(|m| m.len()).unwrap_or(0);
                    }
                }
                _ => {}
            }
        }
    }
    total
}

/// Fills `bytes` of page cache with a file in `dir` and deletes it, so
/// that the next phase finds that much free memory ready to use.
///
/// On this kind of virtual machine the guest hands its free memory back
/// to the host (virtio-balloon free page reporting, a DAMON pageout
/// scheme), and the first write into such memory runs at ~0.5 GB/s
/// against ~5 GB/s into memory a file held a moment ago (`dd` of 512 MiB
/// into a new file; 1.2–1.8 GB/s after touching as much anonymous memory
/// instead). A bench that fills the page cache (a cache landing chunks, a
/// log being written) would measure the host's page faults, not the code.
/// Freed memory is handed back after about 2 s, so call this right before
/// each timed phase, on every side being compared. The file is deleted
/// before writeback, so nothing reaches the disk.
pub fn touch_memory(dir: &std::path::Path, bytes: usize) {
    use std::io::Write;
    let path = dir.join(".touch-memory");
    if let Ok(mut f) = std::fs::File::create(&path) {
        let block = vec![1u8; 1 << 20];
        for _ in 0..bytes.div_ceil(block.len()) {
            if f.write_all(&block).is_err() {
                break;
            }
        }
    }
    let _ = std::fs::remove_file(&path);
}

/// A small deterministic generator for offsets.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

pub struct Row {
    pub name: String,
    pub baseline: String,
    pub arbor: String,
    pub ratio: f64,
    pub target: String,
}

impl Row {
    /// A row of medians in MiB/s: `arbor` against `baseline`, which `how`
    /// describes.
    pub fn mib_per_s(name: impl Into<String>, how: &str, baseline: &[f64], arbor: &[f64], target: &str) -> Row {
        let (b, a) = (median(baseline.to_vec()), median(arbor.to_vec()));
        Row {
            name: name.into(),
            baseline: format!("{b:.0} MiB/s ({how})"),
            arbor: format!("{a:.0} MiB/s"),
            ratio: a / b,
            target: target.into(),
        }
    }
}

pub fn print_table(title: &str, rows: &[Row]) {
    println!("\n### {title}\n");
    println!("| workload | baseline | arbor | ratio | target |");
    println!("| --- | ---: | ---: | ---: | --- |");
    for r in rows {
        println!("| {} | {} | {} | {:.2}× | {} |", r.name, r.baseline, r.arbor, r.ratio, r.target);
    }
}

/// This process's resident memory in bytes (VmRSS), if known.
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 =
        status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb << 10)
}

/// A runtime and a plain aws-sdk-s3 client of an S3-compatible server with
/// the test credentials: what the baselines use.
pub fn s3_client(endpoint: &str) -> (tokio::runtime::Runtime, aws_sdk_s3::Client) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let client = rt.block_on(async {
        let conf = aws_config::defaults(aws_config::BehaviorVersion::latest())
            .region(aws_config::Region::new("us-east-1"))
            .endpoint_url(endpoint)
            .credentials_provider(aws_sdk_s3::config::Credentials::new(
                arbor_engine::testkit::S3_KEY,
                arbor_engine::testkit::S3_SECRET,
                None,
                None,
                "bench",
            ))
            .load()
            .await;
        aws_sdk_s3::Client::from_conf(aws_sdk_s3::config::Builder::from(&conf).force_path_style(true).build())
    });
    (rt, client)
}

/// A plain parallel download of whole objects with aws-sdk-s3 by ranged
/// GETs (`ARBOR_BENCH_RANGE_MIB`, default 8 MiB), 8 in flight, from an
/// S3-compatible server with the test credentials: the baseline of the
/// bucket benchmarks. Returns MiB/s of bytes received.
pub fn parallel_download(endpoint: &str, bucket: &str, keys: &[(String, u64)]) -> f64 {
    use std::sync::Arc;
    const MIB: u64 = 1 << 20;
    let (rt, client) = s3_client(endpoint);
    let mut ranges = Vec::new();
    for (key, size) in keys {
        let mut off = 0;
        while off < *size {
            let end = (off + env_usize("ARBOR_BENCH_RANGE_MIB", 8) as u64 * MIB).min(*size);
            ranges.push((key.clone(), off, end));
            off = end;
        }
    }
    let t = Instant::now();
    let bytes = rt.block_on(async {
        let sem = Arc::new(tokio::sync::Semaphore::new(8));
        let mut tasks = Vec::new();
        for (key, start, end) in ranges {
            let (client, sem, bucket) = (client.clone(), sem.clone(), bucket.to_string());
            tasks.push(tokio::spawn(async move {
                let _permit = sem.acquire().await.expect("semaphore");
                let out = client
                    .get_object()
                    .bucket(bucket)
                    .key(key)
                    .range(format!("bytes={start}-{}", end - 1))
                    .send()
                    .await
                    .expect("ranged get");
                out.body.collect().await.expect("body").into_bytes().len()
            }));
        }
        let mut n = 0;
        for t in tasks {
            n += t.await.expect("task");
        }
        n
    });
    bytes as f64 / MIB as f64 / t.elapsed().as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_percentiles() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        let d: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        assert_eq!(percentile_us(&d, 50.0).round(), 51.0);
        assert_eq!(percentile_us(&d, 99.0).round(), 99.0);
    }
}
