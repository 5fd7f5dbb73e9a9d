//! The daemon's metrics, rendered in Prometheus' text format at /metrics.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::daemon::{Gauges, PoolInfo};

/// Bucket bounds of the latency histograms, in seconds.
const BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// A cumulative histogram.
#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, v: f64) {
        for (i, le) in BUCKETS.iter().enumerate() {
            if v <= *le {
                self.counts[i] += 1;
            }
        }
        self.count += 1;
        self.sum += v;
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (le, n) in BUCKETS.iter().zip(self.counts) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count
        );
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}

/// Counters and histograms the daemon updates as it works.
#[derive(Debug, Default)]
pub struct Metrics {
    create_pooled: Mutex<Histogram>,
    create_restored: Mutex<Histogram>,
    restore: Mutex<Histogram>,
    pool_hits: AtomicU64,
    pool_misses: AtomicU64,
    vmm_failures: AtomicU64,
    requests: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Metrics {
    pub fn observe_create(&self, pooled: bool, seconds: f64) {
        let h = if pooled {
            &self.create_pooled
        } else {
            &self.create_restored
        };
        lock(h).observe(seconds);
    }

    pub fn observe_restore(&self, seconds: f64) {
        lock(&self.restore).observe(seconds);
    }

    pub fn pool_hit(&self) {
        self.pool_hits.fetch_add(1, Ordering::Relaxed);
    }

    pub fn pool_miss(&self) {
        self.pool_misses.fetch_add(1, Ordering::Relaxed);
    }

    pub fn vmm_failed(&self) {
        self.vmm_failures.fetch_add(1, Ordering::Relaxed);
    }

    pub fn request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// The text exposition of everything, with the daemon's gauges and
    /// pools as they are now.
    pub fn render(&self, gauges: &Gauges, pools: &[PoolInfo], daemon_rss_bytes: u64) -> String {
        let mut out = String::new();
        let head = |out: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        head(&mut out, "husk_sandboxes", "gauge", "Sandboxes by state.");
        for (state, n) in &gauges.by_state {
            let _ = writeln!(out, "husk_sandboxes{{state=\"{state}\"}} {n}");
        }
        head(
            &mut out,
            "husk_pool_target",
            "gauge",
            "Clones each warm pool keeps.",
        );
        for p in pools {
            let _ = writeln!(
                out,
                "husk_pool_target{{template=\"{}\"}} {}",
                p.template_name, p.target
            );
        }
        head(
            &mut out,
            "husk_pool_ready",
            "gauge",
            "Parked clones ready to hand out.",
        );
        for p in pools {
            let _ = writeln!(
                out,
                "husk_pool_ready{{template=\"{}\"}} {}",
                p.template_name, p.ready
            );
        }
        head(
            &mut out,
            "husk_pool_hits_total",
            "counter",
            "Creates served from a pool.",
        );
        let _ = writeln!(
            out,
            "husk_pool_hits_total {}",
            self.pool_hits.load(Ordering::Relaxed)
        );
        head(
            &mut out,
            "husk_pool_misses_total",
            "counter",
            "Creates that had to restore.",
        );
        let _ = writeln!(
            out,
            "husk_pool_misses_total {}",
            self.pool_misses.load(Ordering::Relaxed)
        );
        head(
            &mut out,
            "husk_vmm_failures_total",
            "counter",
            "VMMs that exited on their own.",
        );
        let _ = writeln!(
            out,
            "husk_vmm_failures_total {}",
            self.vmm_failures.load(Ordering::Relaxed)
        );
        head(
            &mut out,
            "husk_api_requests_total",
            "counter",
            "API requests served.",
        );
        let _ = writeln!(
            out,
            "husk_api_requests_total {}",
            self.requests.load(Ordering::Relaxed)
        );
        head(
            &mut out,
            "husk_create_seconds",
            "histogram",
            "From a create request to a sandbox whose agent answered.",
        );
        lock(&self.create_pooled).render(&mut out, "husk_create_seconds", "pooled=\"true\"");
        lock(&self.create_restored).render(&mut out, "husk_create_seconds", "pooled=\"false\"");
        head(
            &mut out,
            "husk_restore_seconds",
            "histogram",
            "From spawning a VMM to its restored guest's agent answering.",
        );
        lock(&self.restore).render(&mut out, "husk_restore_seconds", "");
        head(
            &mut out,
            "husk_vmm_resident_bytes",
            "gauge",
            "Resident memory of all VMM processes.",
        );
        let _ = writeln!(out, "husk_vmm_resident_bytes {}", gauges.vmm_rss_bytes);
        head(
            &mut out,
            "husk_guest_memory_mib",
            "gauge",
            "Guest memory of live sandboxes.",
        );
        let _ = writeln!(out, "husk_guest_memory_mib {}", gauges.guest_mem_mib);
        head(
            &mut out,
            "husk_guest_memory_budget_mib",
            "gauge",
            "The host's sandbox memory budget.",
        );
        let _ = writeln!(
            out,
            "husk_guest_memory_budget_mib {}",
            gauges.memory_budget_mib
        );
        head(
            &mut out,
            "husk_daemon_resident_bytes",
            "gauge",
            "The daemon's own resident memory.",
        );
        let _ = writeln!(out, "husk_daemon_resident_bytes {daemon_rss_bytes}");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::default();
        h.observe(0.015);
        h.observe(3.0);
        let mut out = String::new();
        h.render(&mut out, "x", "");

        assert!(out.contains("x_bucket{le=\"0.01\"} 0\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"0.02\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"5\"} 2\n"), "{out}");
        assert!(
            out.contains("x_bucket{le=\"+Inf\"} 2\nx_sum 3.015\nx_count 2\n"),
            "{out}"
        );
    }
}
