//! A clock for leases and sessions that counts the time a machine spent
//! suspended.
//!
//! [`std::time::Instant`] reads `CLOCK_MONOTONIC`, which stops while the
//! machine sleeps (a suspended laptop, a VM paused for migration). A lease
//! holder judging its lease by it would believe, on waking, that little
//! time had passed, while the rest of the cluster watched the lease lapse
//! and moved on. [`BootInstant`] reads `CLOCK_BOOTTIME`: monotonic, never
//! stepped by NTP or an operator, and counting suspended time.

use std::time::Duration;

/// A moment on `CLOCK_BOOTTIME`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BootInstant(Duration);

impl BootInstant {
    /// Now.
    pub fn now() -> BootInstant {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `ts` is a valid timespec for the call to fill.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
        if rc != 0 {
            // Every Linux since 2.6.39 has it; a kernel without it would
            // fail here on every call, so the monotonic clock stands in.
            return BootInstant(fallback());
        }
        BootInstant(Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
    }

    /// Time since `self` (zero if `self` is later).
    pub fn elapsed(&self) -> Duration {
        BootInstant::now().0.saturating_sub(self.0)
    }

    /// Time from `earlier` to `self` (zero if `earlier` is later).
    pub fn duration_since(&self, earlier: BootInstant) -> Duration {
        self.0.saturating_sub(earlier.0)
    }
}

impl std::ops::Add<Duration> for BootInstant {
    type Output = BootInstant;
    fn add(self, d: Duration) -> BootInstant {
        BootInstant(self.0.saturating_add(d))
    }
}

impl std::ops::Sub<Duration> for BootInstant {
    type Output = BootInstant;
    fn sub(self, d: Duration) -> BootInstant {
        BootInstant(self.0.saturating_sub(d))
    }
}

fn fallback() -> Duration {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_boot_clock_moves_forward_with_the_monotonic_one() {
        let (b, m) = (BootInstant::now(), std::time::Instant::now());
        std::thread::sleep(Duration::from_millis(30));
        let (db, dm) = (b.elapsed(), m.elapsed());
        assert!(db >= Duration::from_millis(30), "{db:?}");
        // Without a suspend in between, the two clocks agree closely.
        assert!(db.abs_diff(dm) < Duration::from_millis(20), "boot {db:?}, monotonic {dm:?}");
        let later = b + Duration::from_secs(5);
        assert_eq!(later.duration_since(b), Duration::from_secs(5));
        assert_eq!(b.duration_since(later), Duration::ZERO);
        assert!(later.elapsed() == Duration::ZERO);
    }
}
