//! The daemon's metrics, rendered in Prometheus' text format at /metrics.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use husk_types::PoolInfo;

/// Counts for /metrics.
#[derive(Debug)]
pub struct Gauges {
    pub by_state: BTreeMap<&'static str, u64>,
    pub vmm_rss_bytes: u64,
    pub guest_mem_mib: u64,
    pub memory_budget_mib: u64,
}

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
    egress_allowed: AtomicU64,
    egress_denied: AtomicU64,
}

/// A metric's lines: (labels, value).
type Samples = Vec<(String, u64)>;

fn head(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// One metric: its header, then a line per (labels, value).
fn metric(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(String, u64)]) {
    head(out, name, kind, help);
    for (labels, value) in samples {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {value}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
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

    /// One egress proxy decision.
    pub fn egress(&self, allowed: bool) {
        let c = if allowed {
            &self.egress_allowed
        } else {
            &self.egress_denied
        };
        c.fetch_add(1, Ordering::Relaxed);
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
        let by_state: Samples = gauges
            .by_state
            .iter()
            .map(|(state, n)| (format!("state=\"{state}\""), *n))
            .collect();
        let per_pool = |value: fn(&PoolInfo) -> u32| -> Samples {
            pools
                .iter()
                .map(|p| {
                    (
                        format!("template=\"{}\"", p.template_name),
                        u64::from(value(p)),
                    )
                })
                .collect()
        };
        let counter = |c: &AtomicU64| vec![(String::new(), c.load(Ordering::Relaxed))];
        let gauge = |v: u64| vec![(String::new(), v)];
        let simple: [(&str, &str, &str, Samples); 8] = [
            ("husk_sandboxes", "gauge", "Sandboxes by state.", by_state),
            (
                "husk_pool_target",
                "gauge",
                "Clones each warm pool keeps.",
                per_pool(|p| p.target),
            ),
            (
                "husk_pool_ready",
                "gauge",
                "Parked clones ready to hand out.",
                per_pool(|p| p.ready),
            ),
            (
                "husk_pool_hits_total",
                "counter",
                "Creates served from a pool.",
                counter(&self.pool_hits),
            ),
            (
                "husk_pool_misses_total",
                "counter",
                "Creates that had to restore.",
                counter(&self.pool_misses),
            ),
            (
                "husk_vmm_failures_total",
                "counter",
                "VMMs that exited on their own.",
                counter(&self.vmm_failures),
            ),
            (
                "husk_api_requests_total",
                "counter",
                "API requests served.",
                counter(&self.requests),
            ),
            (
                "husk_egress_decisions_total",
                "counter",
                "Connections the egress proxy allowed or refused.",
                vec![
                    (
                        "decision=\"allow\"".to_owned(),
                        self.egress_allowed.load(Ordering::Relaxed),
                    ),
                    (
                        "decision=\"deny\"".to_owned(),
                        self.egress_denied.load(Ordering::Relaxed),
                    ),
                ],
            ),
        ];
        for (name, kind, help, samples) in simple {
            metric(&mut out, name, kind, help, &samples);
        }
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
        let memory: [(&str, &str, u64); 4] = [
            (
                "husk_vmm_resident_bytes",
                "Resident memory of all VMM processes.",
                gauges.vmm_rss_bytes,
            ),
            (
                "husk_guest_memory_mib",
                "Guest memory of live sandboxes.",
                gauges.guest_mem_mib,
            ),
            (
                "husk_guest_memory_budget_mib",
                "The host's sandbox memory budget.",
                gauges.memory_budget_mib,
            ),
            (
                "husk_daemon_resident_bytes",
                "The daemon's own resident memory.",
                daemon_rss_bytes,
            ),
        ];
        for (name, help, v) in memory {
            metric(&mut out, name, "gauge", help, &gauge(v));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_gives_each_metric_its_header_and_labelled_lines() {
        let m = Metrics::default();
        m.pool_hit();
        let gauges = Gauges {
            by_state: [("running", 3)].into_iter().collect(),
            vmm_rss_bytes: 10,
            guest_mem_mib: 256,
            memory_budget_mib: 1024,
        };
        let pool = PoolInfo {
            template: "tpl-1".into(),
            template_name: "base".into(),
            target: 4,
            ready: 2,
            restoring: 1,
            hits: 1,
            misses: 0,
        };

        let text = m.render(&gauges, &[pool], 99);

        for line in [
            "# TYPE husk_sandboxes gauge\nhusk_sandboxes{state=\"running\"} 3\n",
            "husk_pool_target{template=\"base\"} 4\n",
            "# TYPE husk_pool_ready gauge\nhusk_pool_ready{template=\"base\"} 2\n",
            "# TYPE husk_pool_hits_total counter\nhusk_pool_hits_total 1\n",
            "husk_create_seconds_count{pooled=\"false\"} 0\n",
            "husk_guest_memory_budget_mib 1024\n",
            "husk_daemon_resident_bytes 99\n",
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
    }

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
