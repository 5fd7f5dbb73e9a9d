//! Token-bucket rate limits for the block and net devices (as Firecracker
//! has): a guest that hammers its disk or network gets the rate its
//! template allows and no more, so its neighbours keep theirs.
//!
//! A [`RateLimiter`] has up to two buckets: bytes and operations. Each
//! holds at most one second of its rate and refills continuously. A request
//! takes from both or from neither; when it cannot, the device leaves it in
//! its queue, and the limiter's timer (a timerfd the device watches) fires
//! when enough has refilled for it. A request larger than a whole bucket
//! goes through when the bucket is full and leaves it in debt, which the
//! next requests wait out: it is slowed, not refused forever, and the rate
//! holds whatever the request sizes.

use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

pub use husk_vmm_api::limits::{parse_limits, Limits};
use vmm_sys_util::timerfd::TimerFd;

/// A rate: so many units per second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate(pub u64);

/// Refills continuously up to `size` units, `size` per second.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    size: u64,
    /// Units in the bucket, in billionths (so refills lose nothing). Below
    /// zero after a request larger than the bucket: a debt later requests
    /// wait out, so the long-run rate holds for any request size.
    budget_nano: i128,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket for `rate` (which must not be 0).
    pub fn new(rate: Rate, now: Instant) -> TokenBucket {
        TokenBucket {
            size: rate.0.max(1),
            budget_nano: i128::from(rate.0.max(1)) * 1_000_000_000,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_nanos();
        self.last = now;
        let full = i128::from(self.size) * 1_000_000_000;
        let gained = i128::try_from(elapsed)
            .unwrap_or(i128::MAX / 2)
            .saturating_mul(i128::from(self.size));
        self.budget_nano = self.budget_nano.saturating_add(gained).min(full);
    }

    /// How long until `units` can be taken (zero if now). A request larger
    /// than the bucket waits for a full bucket.
    fn wait_for(&mut self, units: u64, now: Instant) -> Duration {
        self.refill(now);
        let needed = i128::from(units.min(self.size)) * 1_000_000_000;
        let missing = needed.saturating_sub(self.budget_nano).max(0);
        // The budget grows `size` units (size * 1e9 nano-units) per second.
        let nanos = missing.div_euclid(i128::from(self.size))
            + i128::from(missing.rem_euclid(i128::from(self.size)) != 0);
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    /// Takes `units`, all of them, even past empty.
    fn take(&mut self, units: u64) {
        self.budget_nano = self
            .budget_nano
            .saturating_sub(i128::from(units) * 1_000_000_000);
    }
}

/// A device's limiter: its buckets and the timer that wakes it.
#[derive(Debug)]
pub struct RateLimiter {
    bytes: Option<TokenBucket>,
    ops: Option<TokenBucket>,
    timer: TimerFd,
    /// Set while the timer is armed for a request that had to wait.
    blocked: bool,
    /// Requests that had to wait, for the device's counters.
    pub throttled: u64,
}

impl RateLimiter {
    /// A limiter for `limits`; None when there is nothing to limit.
    pub fn new(limits: Limits) -> std::io::Result<Option<RateLimiter>> {
        if limits.is_unlimited() {
            return Ok(None);
        }
        let now = Instant::now();
        let bucket = |rate: Option<u64>| {
            rate.filter(|&r| r > 0)
                .map(|r| TokenBucket::new(Rate(r), now))
        };
        Ok(Some(RateLimiter {
            bytes: bucket(limits.bytes_per_s),
            ops: bucket(limits.ops_per_s),
            timer: TimerFd::new()?,
            blocked: false,
            throttled: 0,
        }))
    }

    /// Takes one operation of `bytes` from the buckets, or, if they do not
    /// hold enough, takes nothing and arms the timer for when they will.
    pub fn consume(&mut self, bytes: u64) -> bool {
        self.consume_at(bytes, Instant::now())
    }

    fn consume_at(&mut self, bytes: u64, now: Instant) -> bool {
        if self.blocked {
            return false;
        }
        let wait = [(&mut self.bytes, bytes), (&mut self.ops, 1)]
            .into_iter()
            .filter_map(|(bucket, units)| bucket.as_mut().map(|b| b.wait_for(units, now)))
            .max()
            .unwrap_or_default();
        if wait.is_zero() {
            for (bucket, units) in [(&mut self.bytes, bytes), (&mut self.ops, 1)] {
                if let Some(b) = bucket {
                    b.take(units);
                }
            }
            return true;
        }
        self.throttled += 1;
        // A timerfd set to zero is disarmed: wait at least a nanosecond.
        match self.timer.reset(wait.max(Duration::from_nanos(1)), None) {
            Ok(()) => self.blocked = true,
            // Without a timer the device would never wake: let it through.
            Err(e) => {
                tracing::warn!("rate limiter: cannot arm its timer ({e}); not limiting");
                return true;
            }
        }
        false
    }

    /// Whether a request is waiting for the timer.
    pub fn is_blocked(&self) -> bool {
        self.blocked
    }

    /// The timer fired: requests may be tried again.
    pub fn on_timer(&mut self) {
        let _ = self.timer.wait();
        self.blocked = false;
    }
}

impl AsRawFd for RateLimiter {
    fn as_raw_fd(&self) -> RawFd {
        self.timer.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_refills_at_its_rate_and_holds_one_second() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(Rate(1000), t0);
        assert_eq!(b.wait_for(1000, t0), Duration::ZERO);
        b.take(1000);
        assert_eq!(b.wait_for(1, t0), Duration::from_millis(1));
        assert_eq!(b.wait_for(500, t0), Duration::from_millis(500));
        let t1 = t0 + Duration::from_millis(250);
        assert_eq!(b.wait_for(250, t1), Duration::ZERO);
        assert_eq!(b.wait_for(500, t1), Duration::from_millis(250));
        // Idle for long: still only one second's worth.
        let t2 = t0 + Duration::from_secs(60);
        assert_eq!(b.wait_for(1000, t2), Duration::ZERO);
        b.take(1000);
        assert_eq!(b.wait_for(1, t2), Duration::from_millis(1));
    }

    #[test]
    fn a_request_larger_than_the_bucket_passes_when_it_is_full_and_is_paid_for() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(Rate(100), t0);
        assert_eq!(b.wait_for(1_000, t0), Duration::ZERO);
        b.take(1_000);
        // 900 units of debt, then a full bucket: 10 s at 100 per second.
        assert_eq!(b.wait_for(1_000, t0), Duration::from_secs(10));
        assert_eq!(b.wait_for(1, t0), Duration::from_millis(9010));
    }

    #[test]
    fn the_limiter_takes_from_both_buckets_or_neither_and_waits_on_its_timer() {
        let mut l = RateLimiter::new(Limits {
            bytes_per_s: Some(4096),
            ops_per_s: Some(2),
        })
        .expect("timer")
        .expect("limited");
        let t0 = Instant::now();
        assert!(l.consume_at(1024, t0));
        assert!(l.consume_at(1024, t0));
        // Bytes left, but no operation.
        assert!(!l.consume_at(1, t0));
        assert!(l.is_blocked());
        assert_eq!(l.throttled, 1);
        // Blocked until the timer is handled, whatever the buckets hold.
        assert!(!l.consume_at(1, t0 + Duration::from_secs(5)));
        l.timer
            .reset(Duration::from_nanos(1), None)
            .expect("re-arm");
        l.on_timer();
        assert!(!l.is_blocked());
        // Half a second later one operation has refilled; 2048 bytes too.
        let t1 = t0 + Duration::from_millis(500);
        assert!(l.consume_at(2048, t1));
        assert!(!l.consume_at(2048, t1));
        assert_eq!(
            RateLimiter::new(Limits::default())
                .expect("none")
                .map(|_| ()),
            None
        );
    }
}
