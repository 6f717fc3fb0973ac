//! The file-system operations as metrics and traces name them, and what
//! each one cost: how many, how many failed, and how long they took.
//!
//! [`crate::ArborFs`] runs every operation through [`OpMetrics::run`]:
//! one `tracing` span (the operation and its inode, the parent directory's
//! for an operation on a name; a level check when debug tracing is off)
//! and a few relaxed atomic adds.

use arbor_engine::metrics::{Counter, Exposition, Histogram};
use fuser::Errno;
use std::time::Instant;

macro_rules! ops {
    ($($op:ident => $name:literal),* $(,)?) => {
        /// One kind of FUSE request.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum FuseOp { $($op),* }

        impl FuseOp {
            pub const ALL: &'static [FuseOp] = &[$(FuseOp::$op),*];

            pub fn name(self) -> &'static str {
                match self { $(FuseOp::$op => $name),* }
            }
        }
    };
}

ops! {
    Lookup => "lookup", Getattr => "getattr", Setattr => "setattr", Readlink => "readlink",
    Mknod => "mknod", Mkdir => "mkdir", Unlink => "unlink", Rmdir => "rmdir", Symlink => "symlink",
    Rename => "rename", Link => "link", Open => "open", Opendir => "opendir", Read => "read",
    Write => "write", Flush => "flush", Release => "release", Fsync => "fsync", Readdir => "readdir",
    Readdirplus => "readdirplus", Statfs => "statfs", Setxattr => "setxattr", Getxattr => "getxattr",
    Listxattr => "listxattr", Removexattr => "removexattr", Create => "create", Fallocate => "fallocate",
    Getlk => "getlk", Setlk => "setlk", Ioctl => "ioctl", CopyFileRange => "copy_file_range",
}

/// What one kind of operation cost.
#[derive(Debug, Default)]
struct Costs {
    errors: Counter,
    latency: Histogram,
}

/// Per-operation counts, errors and latencies of one mount.
#[derive(Debug)]
pub struct OpMetrics {
    costs: Vec<Costs>,
}

impl Default for OpMetrics {
    fn default() -> Self {
        OpMetrics { costs: FuseOp::ALL.iter().map(|_| Costs::default()).collect() }
    }
}

impl OpMetrics {
    /// Runs `f`, the operation `op` on inode `ino`, in its span, and counts it.
    pub fn run<T>(&self, op: FuseOp, ino: u64, f: impl FnOnce() -> Result<T, Errno>) -> Result<T, Errno> {
        let span = tracing::debug_span!("fuse", op = op.name(), ino);
        let _in = span.enter();
        let start = Instant::now();
        let r = f();
        let c = &self.costs[op as usize];
        c.latency.observe(start.elapsed());
        if r.is_err() {
            c.errors.inc();
        }
        r
    }

    /// Operations `op` answered so far, failed or not.
    pub fn count(&self, op: FuseOp) -> u64 {
        self.costs[op as usize].latency.snapshot().count()
    }

    /// Operations `op` that failed (an errno answered).
    pub fn errors(&self, op: FuseOp) -> u64 {
        self.costs[op as usize].errors.get()
    }

    pub fn render(&self, page: &mut Exposition) {
        for &op in FuseOp::ALL {
            let c = &self.costs[op as usize];
            page.histogram(
                "arbor_fuse_request_seconds",
                "Time to answer a FUSE request, by operation (its _count: requests answered).",
                &[("op", op.name())],
                &c.latency.snapshot(),
            );
        }
        for &op in FuseOp::ALL {
            page.counter(
                "arbor_fuse_errors_total",
                "FUSE requests answered with an error, by operation.",
                &[("op", op.name())],
                self.costs[op as usize].errors.get(),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operation_is_counted_under_its_own_name() {
        let m = OpMetrics::default();
        let _ = m.run(FuseOp::Write, 5, || Ok(3));
        let _ = m.run(FuseOp::Write, 5, || Ok(3));
        let _: Result<(), _> = m.run(FuseOp::Fsync, 5, || Err(Errno::EIO));
        assert_eq!((m.count(FuseOp::Write), m.count(FuseOp::Fsync), m.count(FuseOp::Read)), (2, 1, 0));
        assert_eq!((m.errors(FuseOp::Write), m.errors(FuseOp::Fsync)), (0, 1));
        let mut page = Exposition::new();
        m.render(&mut page);
        let s = arbor_engine::metrics::parse(&page.finish()).expect("parses");
        let count = |op| arbor_engine::metrics::find(&s, "arbor_fuse_request_seconds_count", &[("op", op)]);
        assert_eq!((count("write"), count("fsync"), count("ioctl")), (Some(2.0), Some(1.0), Some(0.0)));
        let mut names: Vec<_> = FuseOp::ALL.iter().map(|o| o.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), FuseOp::ALL.len());
    }
}
