//! The `ARBOR_*` variables of the environment (docs/configuration.md):
//! read here once, before a command runs, and handed to the libraries as
//! settings and options. No library crate reads the environment.

use anyhow::{bail, Result};
use arbor_fs::RingChoice;
use arbor_node::settings::Settings;
use std::sync::OnceLock;
use std::time::Duration;

/// What the environment asks of this process's FUSE mounts.
#[derive(Clone, Copy, Debug)]
pub struct Fuse {
    /// `ARBOR_FUSE`: how requests reach arbor.
    pub transport: RingChoice,
    /// `ARBOR_DIRECT_WRITES`: write-only opens past the page cache.
    pub direct_writes: bool,
}

static FUSE: OnceLock<Fuse> = OnceLock::new();

/// Reads the variables and sets the node's settings; a variable with a
/// value it cannot take is an error naming it.
pub fn read() -> Result<()> {
    let (node, fuse) = parse(&|name| std::env::var(name).ok())?;
    arbor_node::settings::set(node)?;
    let _ = FUSE.set(fuse);
    Ok(())
}

/// The FUSE settings [`read`] found (the defaults before it ran).
pub fn fuse() -> Fuse {
    *FUSE.get_or_init(|| Fuse { transport: RingChoice::Auto, direct_writes: true })
}

fn parse(var: &dyn Fn(&str) -> Option<String>) -> Result<(Settings, Fuse)> {
    let value = |name: &str| var(name).filter(|v| !v.is_empty());
    let mut node = Settings::default();
    let mut fuse = Fuse { transport: RingChoice::Auto, direct_writes: true };
    if let Some(v) = value("ARBOR_FUSE") {
        fuse.transport = v.parse().map_err(|e| anyhow::anyhow!("ARBOR_FUSE: {e}"))?;
    }
    if let Some(v) = value("ARBOR_DIRECT_WRITES") {
        fuse.direct_writes = flag("ARBOR_DIRECT_WRITES", &v)?;
    }
    if let Some(v) = value("ARBOR_IO") {
        node.io = v.parse().map_err(|e| anyhow::anyhow!("ARBOR_IO: {e}"))?;
    }
    if let Some(v) = value("ARBOR_S3_RETRIES") {
        match v.parse::<u32>() {
            Ok(n) if n >= 1 => node.s3_retries = Some(n),
            _ => bail!("ARBOR_S3_RETRIES: expected a number of tries, 1 or more (got {v:?})"),
        }
    }
    if let Some(v) = value("ARBOR_CACHE_TIMEOUT_MS") {
        match v.parse::<u64>() {
            Ok(ms) if ms >= 1 => node.cache_timeout = Duration::from_millis(ms),
            _ => bail!("ARBOR_CACHE_TIMEOUT_MS: expected milliseconds, 1 or more (got {v:?})"),
        }
    }
    if let Some(v) = value("ARBOR_CACHE_WIRE") {
        node.cache_framed = match v.as_str() {
            "framed" => true,
            "http" => false,
            _ => bail!("ARBOR_CACHE_WIRE: expected framed or http (got {v:?})"),
        };
    }
    if let Some(v) = value("ARBOR_READ_THROUGH_OWNER") {
        node.read_through_owner = flag("ARBOR_READ_THROUGH_OWNER", &v)?;
    }
    Ok((node, fuse))
}

fn flag(name: &str, v: &str) -> Result<bool> {
    match v {
        "1" => Ok(true),
        "0" => Ok(false),
        _ => bail!("{name}: expected 0 or 1 (got {v:?})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with(vars: &[(&str, &str)]) -> Result<(Settings, Fuse)> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        parse(&|name| map.get(name).cloned())
    }

    #[test]
    fn unset_and_empty_variables_leave_the_defaults() {
        let (node, fuse) = with(&[("ARBOR_IO", ""), ("ARBOR_FUSE", "")]).unwrap();
        assert_eq!(node, Settings::default());
        assert_eq!(fuse.transport, RingChoice::Auto);
        assert!(fuse.direct_writes);
    }

    #[test]
    fn every_variable_reaches_its_setting() {
        let (node, fuse) = with(&[
            ("ARBOR_FUSE", "classic"),
            ("ARBOR_DIRECT_WRITES", "0"),
            ("ARBOR_IO", "buffered"),
            ("ARBOR_S3_RETRIES", "2"),
            ("ARBOR_CACHE_TIMEOUT_MS", "30000"),
            ("ARBOR_CACHE_WIRE", "http"),
            ("ARBOR_READ_THROUGH_OWNER", "1"),
        ])
        .unwrap();
        assert_eq!(fuse.transport, RingChoice::Classic);
        assert!(!fuse.direct_writes);
        assert_eq!(node.io, arbor_engine::io::IoMode::Buffered);
        assert_eq!(node.s3_retries, Some(2));
        assert_eq!(node.cache_timeout, Duration::from_secs(30));
        assert!(!node.cache_framed);
        assert!(node.read_through_owner);
    }

    #[test]
    fn a_value_a_variable_cannot_take_is_an_error_naming_it() {
        for (name, bad) in [
            ("ARBOR_FUSE", "fast"),
            ("ARBOR_DIRECT_WRITES", "yes"),
            ("ARBOR_IO", "direct"),
            ("ARBOR_S3_RETRIES", "0"),
            ("ARBOR_CACHE_TIMEOUT_MS", "soon"),
            ("ARBOR_CACHE_WIRE", "udp"),
            ("ARBOR_READ_THROUGH_OWNER", "true"),
        ] {
            let err = with(&[(name, bad)]).err().unwrap_or_else(|| panic!("{name}={bad} was taken"));
            assert!(err.to_string().starts_with(name), "{err}");
        }
    }
}
