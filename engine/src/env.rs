//! Time and randomness go through this shim so tests can control both.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds and nanoseconds since the Unix epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, bincode::Encode, bincode::Decode)]
pub struct Timestamp {
    pub secs: i64,
    pub nanos: u32,
}

impl Timestamp {
    pub fn from_system(t: SystemTime) -> Self {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Timestamp { secs: d.as_secs() as i64, nanos: d.subsec_nanos() },
            Err(e) => {
                let d = e.duration();
                let (secs, nanos) = if d.subsec_nanos() == 0 {
                    (-(d.as_secs() as i64), 0)
                } else {
                    (-(d.as_secs() as i64) - 1, 1_000_000_000 - d.subsec_nanos())
                };
                Timestamp { secs, nanos }
            }
        }
    }

    pub fn to_system(self) -> SystemTime {
        let nanos = std::time::Duration::from_nanos(self.nanos as u64);
        if self.secs >= 0 {
            UNIX_EPOCH + std::time::Duration::from_secs(self.secs as u64) + nanos
        } else {
            UNIX_EPOCH - std::time::Duration::from_secs(self.secs.unsigned_abs()) + nanos
        }
    }
}

/// The engine's view of the outside world.
pub trait Env: Send + Sync {
    fn now(&self) -> Timestamp;
    fn random_u64(&self) -> u64;
}

/// The real clock and a random source seeded by the OS.
pub struct SystemEnv;

impl Env for SystemEnv {
    fn now(&self) -> Timestamp {
        Timestamp::from_system(SystemTime::now())
    }

    fn random_u64(&self) -> u64 {
        use std::hash::{BuildHasher, Hasher};
        // RandomState is seeded from the OS once per process; mixing in the
        // time and a counter gives distinct values per call.
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        h.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
        h.finish()
    }
}

/// A deterministic clock that ticks one microsecond per call, and a seeded
/// xorshift generator: for tests that must replay exactly.
pub struct TestEnv {
    ticks: AtomicU64,
    rng: AtomicU64,
}

impl TestEnv {
    pub fn new(seed: u64) -> Arc<Self> {
        Arc::new(TestEnv { ticks: AtomicU64::new(1_700_000_000_000_000), rng: AtomicU64::new(seed | 1) })
    }
}

impl Env for TestEnv {
    fn now(&self) -> Timestamp {
        let us = self.ticks.fetch_add(1, Ordering::Relaxed);
        Timestamp { secs: (us / 1_000_000) as i64, nanos: ((us % 1_000_000) * 1000) as u32 }
    }

    fn random_u64(&self) -> u64 {
        let mut x = self.rng.load(Ordering::Relaxed);
        loop {
            let mut y = x;
            y ^= y << 13;
            y ^= y >> 7;
            y ^= y << 17;
            match self.rng.compare_exchange(x, y, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return y,
                Err(cur) => x = cur,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_round_trip_through_system_time_both_sides_of_the_epoch() {
        for ts in [Timestamp { secs: 5, nanos: 7 }, Timestamp { secs: -5, nanos: 7 }, Timestamp::default()] {
            assert_eq!(Timestamp::from_system(ts.to_system()), ts);
        }
    }

    #[test]
    fn test_env_is_deterministic() {
        let (a, b) = (TestEnv::new(9), TestEnv::new(9));
        assert_eq!(a.random_u64(), b.random_u64());
        assert_ne!(a.random_u64(), a.random_u64());
        assert!(a.now() < a.now());
    }
}
