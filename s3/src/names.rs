//! Bucket names: a branch is the bucket of its name (`main`); a
//! checkpoint is `<branch>--<checkpoint>`, the branch it was taken from,
//! two hyphens, and its name (`main--step-9000`).
//!
//! Branch and checkpoint names are `[A-Za-z0-9._-]{1,128}`, so either
//! may hold `--`. The scheme stays unambiguous by splitting a bucket name
//! at its first `--`: a name with none is a branch; `B--C` is checkpoint
//! `C` of branch `B`, where `B` has no `--` (`C` may). So a branch whose
//! name holds `--` is not served as a bucket (it would read as a
//! checkpoint), nor are its checkpoints; and only names S3 accepts as
//! bucket names are served (3 to 63 characters of `a-z 0-9 . -`,
//! starting and ending with a letter or digit, no `..`): a branch named
//! `Main` or `run_1` has no bucket. [`unserved`] says why for a start-up
//! warning.

/// What a bucket name stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Bucket {
    Branch(String),
    Checkpoint { branch: String, name: String },
}

/// The separator between a checkpoint's branch and its name.
pub const SEP: &str = "--";

/// The bucket of branch `name`, if it can have one.
pub fn branch_bucket(name: &str) -> Option<String> {
    (!name.contains(SEP) && s3s::path::check_bucket_name(name)).then(|| name.to_string())
}

/// The bucket of checkpoint `name` taken from `branch`, if it can have one.
pub fn checkpoint_bucket(branch: &str, name: &str) -> Option<String> {
    if branch.is_empty() || branch.contains(SEP) {
        return None;
    }
    let b = format!("{branch}{SEP}{name}");
    s3s::path::check_bucket_name(&b).then_some(b)
}

/// What bucket `bucket` names (whether it exists is the disk's to say).
pub fn parse(bucket: &str) -> Bucket {
    match bucket.split_once(SEP) {
        None => Bucket::Branch(bucket.to_string()),
        Some((branch, name)) => Bucket::Checkpoint { branch: branch.to_string(), name: name.to_string() },
    }
}

/// Why branch `name` has no bucket, if it has none.
pub fn unserved(name: &str) -> Option<&'static str> {
    if name.contains(SEP) {
        Some("its name holds \"--\", which separates a checkpoint's branch from its name in bucket names")
    } else if !s3s::path::check_bucket_name(name) {
        Some("its name is not a valid S3 bucket name (3 to 63 characters of a-z, 0-9, '.' and '-', starting and ending with a letter or digit)")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn branch_and_checkpoint_buckets_round_trip_and_never_collide() {
        assert_eq!(branch_bucket("main").as_deref(), Some("main"));
        assert_eq!(parse("main"), Bucket::Branch("main".into()));
        let b = checkpoint_bucket("main", "step-9000").expect("bucket");
        assert_eq!(b, "main--step-9000");
        assert_eq!(parse(&b), Bucket::Checkpoint { branch: "main".into(), name: "step-9000".into() });
        // A checkpoint name may hold the separator; the first one splits.
        let b = checkpoint_bucket("run.a", "x--y").expect("bucket");
        assert_eq!(parse(&b), Bucket::Checkpoint { branch: "run.a".into(), name: "x--y".into() });
        // A branch holding the separator has no bucket, nor its checkpoints.
        assert_eq!(branch_bucket("a--b"), None);
        assert_eq!(checkpoint_bucket("a--b", "c"), None);
        assert!(unserved("a--b").is_some());
        // Names S3 refuses.
        for bad in ["Main", "run_1", "ab", "-x-", "a..b"] {
            assert_eq!(branch_bucket(bad), None, "{bad}");
            assert!(unserved(bad).is_some(), "{bad}");
        }
        assert_eq!(checkpoint_bucket("main", "Step_1"), None);
        assert_eq!(checkpoint_bucket("main", "x-"), None);
        assert!(unserved("main").is_none());
    }
}
