//! Counters, gauges and latency histograms, and their rendering in the
//! Prometheus text exposition format (version 0.0.4).
//!
//! The storage path only bumps relaxed atomics: no lock, no allocation, no
//! registry to look a name up in. Whoever owns a set of metrics renders
//! them into an [`Exposition`] when asked (an HTTP `GET /metrics`), so the
//! names and help texts live beside the code that renders them, not here.
//! This module must not know what arbor counts.

use std::collections::{HashMap, HashSet};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// A count that only grows.
#[derive(Default, Debug)]
pub struct Counter(AtomicU64);

impl Counter {
    pub const fn new() -> Counter {
        Counter(AtomicU64::new(0))
    }

    pub fn inc(&self) {
        self.add(1);
    }

    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Relaxed);
    }

    /// Adds one; whether it was the first (for what is said only once).
    pub fn inc_is_first(&self) -> bool {
        self.0.fetch_add(1, Relaxed) == 0
    }

    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

/// A value that is set, and may go down.
#[derive(Default, Debug)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub const fn new() -> Gauge {
        Gauge(AtomicU64::new(0))
    }

    pub fn set(&self, v: u64) {
        self.0.store(v, Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

/// Declares a room's counters and their snapshot, field for field: a
/// struct of [`Counter`]s (or [`Gauge`]s) that the storage path bumps, a
/// plain `Copy` struct of `u64`s of the same names (what `status`, tests
/// and benchmarks read), and `snapshot()` from the one to the other. A
/// field added to the room is counted and reported at once; no
/// hand-written mirror can forget it.
///
/// Fields after `and` are in the snapshot only: values the owner reads
/// from elsewhere (a cache's size, a server's address) and sets on the
/// snapshot it returns; `snapshot()` leaves them at their default. The
/// snapshot derives `Clone`, `Debug` and `Default`; add `Copy` and the
/// like with attributes.
///
/// ```
/// arbor_engine::counters! {
///     /// What a reader counts.
///     pub struct ReadCounters;
///     /// Its counts at one moment.
///     #[derive(Copy, PartialEq)]
///     pub struct ReadStats {
///         /// Reads answered.
///         reads: Counter,
///         /// Readers now.
///         readers: Gauge,
///     } and {
///         /// Set by the owner.
///         capacity: u64,
///     }
/// }
/// let c = ReadCounters::default();
/// c.reads.inc();
/// c.readers.set(3);
/// let s = ReadStats { capacity: 9, ..c.snapshot() };
/// assert_eq!(s, ReadStats { reads: 1, readers: 3, capacity: 9 });
/// ```
#[macro_export]
macro_rules! counters {
    (
        $(#[$cattr:meta])*
        $cvis:vis struct $Counters:ident;
        $(#[$sattr:meta])*
        $svis:vis struct $Stats:ident {
            $( $(#[$fattr:meta])* $field:ident: $Kind:ident ),* $(,)?
        }
        $( and {
            $( $(#[$oattr:meta])* $ofield:ident: $oty:ty ),* $(,)?
        } )?
    ) => {
        $(#[$cattr])*
        #[derive(Debug, Default)]
        $cvis struct $Counters {
            $( $(#[$fattr])* $cvis $field: $crate::metrics::$Kind, )*
        }

        $(#[$sattr])*
        #[derive(Clone, Debug, Default)]
        $svis struct $Stats {
            $( $(#[$fattr])* pub $field: u64, )*
            $( $( $(#[$oattr])* pub $ofield: $oty, )* )?
        }

        impl $Counters {
            /// The counts now, each read on its own (relaxed): one bumped
            /// meanwhile may be in the snapshot while another is not.
            $cvis fn snapshot(&self) -> $Stats {
                $Stats {
                    $( $field: self.$field.get(), )*
                    $( $( $ofield: Default::default(), )* )?
                }
            }
        }
    };
}

/// Upper bounds of the latency histograms' buckets, in seconds: from
/// 100 µs (a page-cache miss answered from memory) to 5 s (a bucket call
/// that retried); slower lands in `+Inf`.
pub const LATENCY_BOUNDS: [f64; 14] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0];

/// A latency histogram over [`LATENCY_BOUNDS`].
#[derive(Debug)]
pub struct Histogram {
    /// Non-cumulative counts per bucket, the last one for `+Inf`: one
    /// atomic add per observation; the sums are made when rendering.
    counts: [AtomicU64; LATENCY_BOUNDS.len() + 1],
    sum_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram::new()
    }
}

impl Histogram {
    pub const fn new() -> Histogram {
        Histogram { counts: [const { AtomicU64::new(0) }; LATENCY_BOUNDS.len() + 1], sum_ns: AtomicU64::new(0) }
    }

    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = LATENCY_BOUNDS.iter().position(|&b| s <= b).unwrap_or(LATENCY_BOUNDS.len());
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }

    /// The counts now. Taken bucket by bucket without a lock, so an
    /// observation made meanwhile may be in the buckets and not the sum:
    /// what Prometheus clients accept for a scrape.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut total = 0;
        let cumulative = self
            .counts
            .iter()
            .map(|c| {
                total += c.load(Relaxed);
                total
            })
            .collect();
        HistogramSnapshot { cumulative, sum_seconds: self.sum_ns.load(Relaxed) as f64 / 1e9 }
    }
}

/// A histogram's counts at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct HistogramSnapshot {
    /// Observations at most each of [`LATENCY_BOUNDS`], then all of them.
    pub cumulative: Vec<u64>,
    pub sum_seconds: f64,
}

impl HistogramSnapshot {
    pub fn count(&self) -> u64 {
        self.cumulative.last().copied().unwrap_or(0)
    }
}

/// Label names and values of one sample.
pub type Labels<'a> = &'a [(&'a str, &'a str)];

/// A `/metrics` page being written. Samples of one family may be added
/// in any order among others'; the page groups them, each family under
/// its `# HELP` and `# TYPE`, as the format requires.
#[derive(Default)]
pub struct Exposition {
    families: Vec<Family>,
    index: HashMap<String, usize>,
}

struct Family {
    head: String,
    samples: String,
}

impl Exposition {
    pub fn new() -> Exposition {
        Exposition::default()
    }

    pub fn counter(&mut self, name: &str, help: &str, labels: Labels<'_>, v: u64) {
        self.family(name, help, "counter").sample(name, labels, None, &v.to_string());
    }

    pub fn gauge(&mut self, name: &str, help: &str, labels: Labels<'_>, v: f64) {
        self.family(name, help, "gauge").sample(name, labels, None, &v.to_string());
    }

    pub fn histogram(&mut self, name: &str, help: &str, labels: Labels<'_>, h: &HistogramSnapshot) {
        let f = self.family(name, help, "histogram");
        let bucket = format!("{name}_bucket");
        for (i, n) in h.cumulative.iter().enumerate() {
            let le = LATENCY_BOUNDS.get(i).map_or("+Inf".to_string(), |b| b.to_string());
            f.sample(&bucket, labels, Some(&le), &n.to_string());
        }
        f.sample(&format!("{name}_sum"), labels, None, &h.sum_seconds.to_string());
        f.sample(&format!("{name}_count"), labels, None, &h.count().to_string());
    }

    /// The page, in the text format.
    pub fn finish(self) -> String {
        self.families.into_iter().flat_map(|f| [f.head, f.samples]).collect()
    }

    /// Family `name`, its header written the first time it is named.
    fn family(&mut self, name: &str, help: &str, kind: &str) -> &mut Family {
        let i = *self.index.entry(name.to_string()).or_insert_with(|| {
            let help = help.replace('\\', "\\\\").replace('\n', "\\n");
            let head = format!("# HELP {name} {help}\n# TYPE {name} {kind}\n");
            self.families.push(Family { head, samples: String::new() });
            self.families.len() - 1
        });
        &mut self.families[i]
    }
}

impl Family {
    fn sample(&mut self, name: &str, labels: Labels<'_>, le: Option<&str>, value: &str) {
        let out = &mut self.samples;
        out.push_str(name);
        let all: Vec<(&str, &str)> = labels.iter().copied().chain(le.map(|le| ("le", le))).collect();
        if !all.is_empty() {
            out.push('{');
            for (i, (k, v)) in all.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let v = v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
                let _ = write!(out, "{k}=\"{v}\"");
            }
            out.push('}');
        }
        let _ = writeln!(out, " {value}");
    }
}

/// A label's name and value.
pub type Label = (String, String);

/// One sample of a parsed page.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<Label>,
    pub value: f64,
}

impl Sample {
    /// The value of label `name`.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// Parses a page in the text format, strictly enough to catch what a
/// Prometheus server would refuse: every sample belongs to a family with
/// a `# TYPE` line before it (a histogram's `_bucket`, `_sum` and `_count`
/// to the histogram), names and labels are well formed, values are numbers.
pub fn parse(text: &str) -> Result<Vec<Sample>, String> {
    let mut types: HashMap<String, String> = Default::default();
    let mut samples = Vec::new();
    // The family of the samples being read, and those already read.
    let (mut current, mut done) = (None::<String>, HashSet::new());
    for (n, line) in text.lines().enumerate() {
        let fail = |why: &str| format!("line {}: {why}: {line:?}", n + 1);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').ok_or_else(|| fail("TYPE without a type"))?;
            if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                return Err(fail("unknown type"));
            }
            if types.insert(name.to_string(), kind.to_string()).is_some() {
                return Err(fail("second TYPE line for a family"));
            }
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let s = parse_sample(line).map_err(|e| fail(&e))?;
        let family = family_of(&s.name, &types).ok_or_else(|| fail("sample of no declared family"))?;
        if current.as_deref() != Some(family) {
            if !done.insert(family.to_string()) {
                return Err(fail("a family's samples not in one group"));
            }
            current = Some(family.to_string());
        }
        if types[family] == "histogram" && s.name.ends_with("_bucket") && s.label("le").is_none() {
            return Err(fail("bucket without le"));
        }
        samples.push(s);
    }
    Ok(samples)
}

/// The declared family a sample named `name` belongs to.
fn family_of<'a>(name: &'a str, types: &HashMap<String, String>) -> Option<&'a str> {
    if types.contains_key(name) {
        return Some(name);
    }
    ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
        let base = name.strip_suffix(suffix)?;
        matches!(types.get(base).map(String::as_str), Some("histogram" | "summary")).then_some(base)
    })
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line.find(['{', ' ']).ok_or("no value")?;
    let name = &line[..name_end];
    if !valid_name(name) {
        return Err("bad metric name".into());
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(inner) = rest.strip_prefix('{') {
        let (parsed, after) = parse_labels(inner)?;
        labels = parsed;
        rest = after;
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().ok_or("no value")?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse::<f64>().map_err(|_| "value is not a number")?,
    };
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().map_err(|_| "bad timestamp")?;
    }
    if fields.next().is_some() {
        return Err("text after the value".into());
    }
    Ok(Sample { name: name.to_string(), labels, value })
}

/// `k="v",...}` and what follows the closing brace.
fn parse_labels(mut s: &str) -> Result<(Vec<Label>, &str), String> {
    let mut labels = Vec::new();
    loop {
        if let Some(after) = s.strip_prefix('}') {
            return Ok((labels, after));
        }
        let (key, rest) = s.split_once("=\"").ok_or("label without =\"")?;
        if !valid_name(key) || key.contains(':') {
            return Err("bad label name".into());
        }
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next() {
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    _ => return Err("bad escape in a label value".into()),
                },
                Some((_, c)) => value.push(c),
                None => return Err("unterminated label value".into()),
            }
        };
        labels.push((key.to_string(), value));
        s = &rest[end + 1..];
        s = s.strip_prefix(',').unwrap_or(s);
    }
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// The value of the sample `name` whose labels include all of `labels`.
pub fn find(samples: &[Sample], name: &str, labels: Labels<'_>) -> Option<f64> {
    samples.iter().find(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(v))).map(|s| s.value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rendered_page_parses_back_to_the_values_recorded() {
        let (c, g, h) = (Counter::new(), Gauge::new(), Histogram::new());
        c.add(41);
        c.inc();
        g.set(7);
        for us in [50, 300, 300, 2_000_000, 9_000_000] {
            h.observe(Duration::from_micros(us));
        }
        let mut page = Exposition::new();
        page.counter("t_ops_total", "Ops.", &[("op", "read")], c.get());
        page.counter("t_ops_total", "Ops.", &[("op", "we\"ird\\\n")], 3);
        page.gauge("t_bytes", "Bytes.", &[], g.get() as f64);
        page.histogram("t_seconds", "Latency.", &[("op", "read")], &h.snapshot());
        // Added after another family: still rendered in its group.
        page.counter("t_ops_total", "Ops.", &[("op", "write")], 0);
        let text = page.finish();
        assert_eq!(text.matches("# TYPE t_ops_total counter").count(), 1, "{text}");
        let s = parse(&text).expect("parses");
        assert_eq!(find(&s, "t_ops_total", &[("op", "read")]), Some(42.0));
        assert_eq!(find(&s, "t_ops_total", &[("op", "we\"ird\\\n")]), Some(3.0));
        assert_eq!(find(&s, "t_bytes", &[]), Some(7.0));
        let bucket = |le| find(&s, "t_seconds_bucket", &[("op", "read"), ("le", le)]);
        assert_eq!(bucket("0.0001"), Some(1.0));
        assert_eq!(bucket("0.00025"), Some(1.0));
        assert_eq!(bucket("0.0005"), Some(3.0));
        assert_eq!(bucket("1"), Some(3.0));
        assert_eq!(bucket("5"), Some(4.0));
        assert_eq!(bucket("+Inf"), Some(5.0));
        assert_eq!(find(&s, "t_seconds_count", &[("op", "read")]), Some(5.0));
        let sum = find(&s, "t_seconds_sum", &[("op", "read")]).expect("sum");
        assert!((sum - 11.00065).abs() < 1e-9, "{sum}");
    }

    #[test]
    fn buckets_are_cumulative_and_never_decrease() {
        let h = Histogram::new();
        for ms in [0, 1, 3, 7, 20, 40, 80, 200, 400, 900, 3000, 6000] {
            h.observe(Duration::from_millis(ms));
        }
        let snap = h.snapshot();
        assert_eq!(snap.cumulative.len(), LATENCY_BOUNDS.len() + 1);
        assert!(snap.cumulative.windows(2).all(|w| w[0] <= w[1]), "{snap:?}");
        assert_eq!(snap.count(), 12);
    }

    #[test]
    fn a_snapshot_holds_every_counter_and_leaves_owner_fields_to_the_owner() {
        crate::counters! {
            struct Counts;
            struct CountsNow {
                a: Counter,
                b: Counter,
                g: Gauge,
            } and {
                size: u64,
            }
        }
        let c = Counts::default();
        c.a.inc();
        c.b.add(5);
        c.b.inc();
        c.g.set(9);
        let now = c.snapshot();
        assert_eq!((now.a, now.b, now.g, now.size), (1, 6, 9, 0));
        c.g.set(2);
        assert_eq!(c.snapshot().g, 2);
        assert_eq!(now.g, 9, "a snapshot does not move");
    }

    #[test]
    fn malformed_pages_are_refused() {
        for bad in [
            "x 1",                                                        // no TYPE
            "# TYPE x counter\nx{a=\"1\" 1",                              // unterminated labels
            "# TYPE x counter\nx one",                                    // not a number
            "# TYPE x counter\n# TYPE x counter\nx 1",                    // declared twice
            "# TYPE x histogram\nx_bucket 1",                             // bucket without le
            "# TYPE x counter\nx_count 1",                                // suffix of a counter
            "# TYPE 1x counter\n1x 1",                                    // bad name
            "# TYPE x counter\nx{a=\"\\q\"} 1",                           // bad escape
            "# TYPE x counter\n# TYPE y counter\nx 1\ny 1\nx{a=\"1\"} 1", // x in two groups
        ] {
            assert!(parse(bad).is_err(), "accepted {bad:?}");
        }
        assert!(parse("# TYPE x counter\nx{a=\"1\",b=\"2\"} 1 1700000000000\n").is_ok());
    }
}
