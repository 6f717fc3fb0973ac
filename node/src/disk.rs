//! Opening disks on this node: [`arbor_snapshot::disk`] does the work;
//! this adds this process's writer lease, I/O mode and bucket retries,
//! and sizes and lengths of time as a person writes them.

use crate::error::{Error, Result};
pub use arbor_snapshot::disk::{io_cause, quiet_config, CacheOptions, Disk, DiskOptions};

fn options(mount: Option<&str>, cache: CacheOptions) -> Result<DiskOptions> {
    Ok(DiskOptions {
        cache,
        mount: mount.map(str::to_string),
        lease: Some(crate::identity::lease()),
        io: crate::settings::get().io,
        retries: crate::settings::get().s3_retries,
        ..DiskOptions::default()
    })
}

/// Creates the disk `arg` names.
pub fn init(arg: &str) -> Result<Disk> {
    Ok(Disk::init(arg, options(None, CacheOptions::default())?)?)
}

/// Opens the disk `arg` names for a command.
pub fn open(arg: &str) -> Result<Disk> {
    Ok(Disk::open(arg, options(None, CacheOptions::default())?)?)
}

/// Opens the disk `arg` names for a command with its own cache options.
pub fn open_with_cache(arg: &str, cache: CacheOptions) -> Result<Disk> {
    Ok(Disk::open(arg, options(None, cache)?)?)
}

/// Opens the disk for a mount of `name` with its cache options.
pub fn open_for_mount(arg: &str, name: &str, cache: CacheOptions) -> Result<Disk> {
    Ok(Disk::open(arg, options(Some(name), cache)?)?)
}

/// Opens the disk for the process that owns branch `name` and serves it
/// (`take_over`: even from a live lease whose holder is known dead), with
/// a lease that lives `ttl` without renewal.
pub fn open_for_owner(
    arg: &str,
    name: &str,
    cache: CacheOptions,
    take_over: bool,
    ttl: std::time::Duration,
) -> Result<Disk> {
    if ttl < std::time::Duration::from_secs(1) || ttl > std::time::Duration::from_secs(500) {
        // A claimant watches a lease for at most 600 s, a fifth more than
        // its life: longer lives would let it claim too soon.
        return Err(Error::Invalid("--lease-ttl must be between 1s and 500s".into()));
    }
    let mut o = options(Some(name), cache)?;
    if let Some(l) = o.lease.as_mut() {
        l.take_over = take_over;
        l.ttl = ttl;
    }
    Ok(Disk::open(arg, o)?)
}

/// A byte count as a person writes it: parsed from `10G`, shown as `10G`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Size(pub u64);

impl std::fmt::Display for Size {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let units = [(1u64 << 40, "T"), (1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")];
        match units.iter().find(|(u, _)| self.0 >= *u && self.0.is_multiple_of(*u)) {
            Some((u, name)) => write!(f, "{}{name}", self.0 / u),
            None => write!(f, "{}", self.0),
        }
    }
}

impl std::str::FromStr for Size {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Size, String> {
        parse_size(s).map(Size)
    }
}

/// A length of time as a person writes it: `90s`, `30m`, `1h`, `2d`, `0`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span(pub std::time::Duration);

impl std::fmt::Display for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.0.as_secs();
        match [(86_400, "d"), (3_600, "h"), (60, "m")].iter().find(|(u, _)| s >= *u && s.is_multiple_of(*u)) {
            Some((u, name)) => write!(f, "{}{name}", s / u),
            None => write!(f, "{s}s"),
        }
    }
}

impl std::str::FromStr for Span {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Span, String> {
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a length of time (try 30m or 1h)"))?;
        let secs = match unit {
            "" | "s" => 1,
            "m" => 60,
            "h" => 3_600,
            "d" => 86_400,
            _ => return Err(format!("{s:?}: unknown unit (use s, m, h or d)")),
        };
        n.checked_mul(secs).map(|x| Span(std::time::Duration::from_secs(x))).ok_or_else(|| format!("{s:?} is too long"))
    }
}

/// Parses a size such as `10G`, `512MiB`, `1.5T` or `4096`.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a size (try 10G or 512M)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(format!("{s:?}: unknown unit (use K, M, G or T)")),
    };
    if !n.is_finite() || n < 0.0 {
        return Err(format!("{s:?} is not a size"));
    }
    Ok((n * mult as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("10G"), Ok(10 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5k"), Ok(1536));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("ten").is_err());
        assert!(parse_size("5X").is_err());
        for n in [arbor_engine::tier::CACHE_SIZE, arbor_engine::tier::READ_AHEAD, 1536, 4096, (3 << 40) + 1] {
            assert_eq!(Size(n).to_string().parse::<Size>(), Ok(Size(n)), "{n} shown as {}", Size(n));
        }
        assert_eq!(Size(10 << 30).to_string(), "10G");
        for (text, secs) in [("90s", 90), ("30m", 1800), ("1h", 3600), ("2d", 172_800), ("0", 0), ("45", 45)] {
            let span: Span = text.parse().expect(text);
            assert_eq!(span.0.as_secs(), secs, "{text}");
            assert_eq!(span.to_string().parse::<Span>(), Ok(span));
        }
        for bad in ["", "1w", "h", "-1h", "99999999999999999999d"] {
            assert!(bad.parse::<Span>().is_err(), "{bad:?}");
        }
    }
}
