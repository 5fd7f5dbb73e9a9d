//! How long to wait for a guest that is booting or restoring.
//!
//! On a busy host a guest makes progress only as fast as the host lets its
//! VMM run: twenty clones restoring on two cores each get a tenth of a CPU,
//! and a fixed wall-clock deadline that is right for a quiet host gives up
//! on all of them. A [`WaitBudget`] is a deadline counted in the CPU share
//! a VMM could get: each moment waited is charged at the share the host
//! can give one runnable task (1 on a quiet host, `cpus / runnable` on a
//! busy one), so the budget stretches with the load while it lasts and a
//! quiet host still fails fast. It never stretches past
//! [`MAX_STRETCH`] times the budget in wall time.

use std::time::{Duration, Instant};

/// The most a budget stretches under load, as a multiple of itself.
pub const MAX_STRETCH: u32 = 10;

/// A deadline counted in the CPU share the host can give a guest.
#[derive(Debug, Clone)]
pub struct WaitBudget {
    budget: Duration,
    spent: Duration,
    started: Instant,
    last: Instant,
    cpus: u32,
    /// The last sample of the host's CPU share, for reports.
    share: f64,
}

impl WaitBudget {
    /// A budget of `budget` on a quiet host, starting now.
    pub fn new(budget: Duration) -> Self {
        let now = Instant::now();
        WaitBudget {
            budget,
            spent: Duration::ZERO,
            started: now,
            last: now,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            share: 1.0,
        }
    }

    /// Charges the time since the last call at the host's current CPU share
    /// and says whether the budget is spent (or the wall-clock cap reached).
    pub fn expired(&mut self) -> bool {
        let now = Instant::now();
        self.share = runnable_tasks().map_or(1.0, |r| cpu_share(self.cpus, r));
        self.spent += (now - self.last).mul_f64(self.share);
        self.last = now;
        self.spent >= self.budget || now - self.started >= self.budget * MAX_STRETCH
    }

    /// Wall-clock time since the wait started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// The budget as given (seconds on a quiet host).
    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// The share of a CPU charged at the last check.
    pub fn last_share(&self) -> f64 {
        self.share
    }
}

/// The most a deadline set once stretches: less than a [`WaitBudget`],
/// since it is charged whether the host stays busy or not, and a request
/// that hangs should still fail in reasonable time.
pub const MAX_DEADLINE_STRETCH: u32 = 4;

/// `budget` stretched by the host's load now (its 1-minute load average
/// over its CPUs, at least 1, at most [`MAX_DEADLINE_STRETCH`]): for a
/// deadline set once, as a request's timeout is, where a [`WaitBudget`]
/// cannot charge the wait as it goes.
pub fn stretched(budget: Duration) -> Duration {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| parse_load(&text))
        .unwrap_or(0.0);
    budget.mul_f64(stretch(cpus, load))
}

/// How much a deadline stretches when `load` tasks (a load average) want
/// `cpus` CPUs.
fn stretch(cpus: u32, load: f64) -> f64 {
    (load / f64::from(cpus)).clamp(1.0, f64::from(MAX_DEADLINE_STRETCH))
}

fn parse_load(loadavg: &str) -> Option<f64> {
    loadavg.split_whitespace().next()?.parse().ok()
}

/// The share of a CPU one runnable task gets when `runnable` other tasks
/// compete for `cpus` CPUs.
pub fn cpu_share(cpus: u32, runnable: u32) -> f64 {
    if runnable <= cpus {
        1.0
    } else {
        f64::from(cpus) / f64::from(runnable)
    }
}

/// Tasks running or waiting for a CPU right now, not counting the caller
/// (the fourth field of /proc/loadavg is `runnable/total`, the reading
/// task included).
fn runnable_tasks() -> Option<u32> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    parse_runnable(&text)
}

fn parse_runnable(loadavg: &str) -> Option<u32> {
    let field = loadavg.split_whitespace().nth(3)?;
    let running: u32 = field.split_once('/')?.0.parse().ok()?;
    Some(running.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quiet_host_charges_time_in_full() {
        assert_eq!(cpu_share(2, 0), 1.0);
        assert_eq!(cpu_share(2, 2), 1.0);
    }

    #[test]
    fn a_busy_host_charges_each_task_its_share() {
        assert_eq!(cpu_share(2, 4), 0.5);
        assert_eq!(cpu_share(2, 20), 0.1);
    }

    #[test]
    fn a_deadline_stretches_with_the_load_average_within_bounds() {
        assert_eq!(stretch(2, 0.4), 1.0);
        assert_eq!(stretch(2, 6.0), 3.0);
        assert_eq!(stretch(2, 400.0), f64::from(MAX_DEADLINE_STRETCH));
        assert_eq!(parse_load("5.98 3.10 0.42 3/92 24174\n"), Some(5.98));
        assert_eq!(parse_load(""), None);
    }

    #[test]
    fn runnable_tasks_come_from_loadavg_without_the_reader() {
        assert_eq!(parse_runnable("2.67 1.10 0.42 3/92 24174\n"), Some(2));
        assert_eq!(parse_runnable("0.00 0.00 0.00 1/50 1\n"), Some(0));
        assert_eq!(parse_runnable("garbage"), None);
    }

    #[test]
    fn a_budget_expires_and_reports_its_wall_time() {
        let mut wait = WaitBudget::new(Duration::ZERO);
        assert!(wait.expired());
        assert!(wait.elapsed() < Duration::from_secs(60));
        let mut wait = WaitBudget::new(Duration::from_secs(3600));
        assert!(!wait.expired());
    }
}
