//! The daemon's metrics, kept and rendered by `prometheus-client`
//! (OpenMetrics text at /metrics).

use std::collections::BTreeMap;
use std::sync::Mutex;

use husk_types::PoolInfo;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// The Content-Type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Counts for /metrics.
#[derive(Debug)]
pub struct Gauges {
    /// Sandboxes by state.
    pub by_state: BTreeMap<&'static str, u64>,
    /// Resident memory of all VMM processes.
    pub vmm_rss_bytes: u64,
    /// Guest memory of live sandboxes, in MiB.
    pub guest_mem_mib: u64,
    /// The host's guest memory budget, in MiB.
    pub memory_budget_mib: u64,
}

/// Bucket bounds of the latency histograms, in seconds.
const BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0,
];

fn latency() -> Histogram {
    Histogram::new(BUCKETS)
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct State {
    state: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Template {
    template: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Pooled {
    pooled: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Decision {
    decision: String,
}

/// A value for a gauge (they are signed).
fn level(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Counters and histograms the daemon updates as it works, and the gauges
/// it sets when asked for them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Renders one at a time (each sets the gauges, then encodes).
    rendering: Mutex<()>,
    create: Family<Pooled, Histogram, fn() -> Histogram>,
    restore: Histogram,
    pool_hits: Counter,
    pool_misses: Counter,
    vmm_failures: Counter,
    requests: Counter,
    idle_reclaims: Counter,
    egress: Family<Decision, Counter>,
    sandboxes: Family<State, Gauge>,
    pool_target: Family<Template, Gauge>,
    pool_ready: Family<Template, Gauge>,
    vmm_resident: Gauge,
    guest_memory: Gauge,
    guest_memory_budget: Gauge,
    daemon_resident: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut m = Metrics {
            registry: Registry::default(),
            rendering: Mutex::new(()),
            create: Family::new_with_constructor(latency as fn() -> Histogram),
            restore: latency(),
            pool_hits: Counter::default(),
            pool_misses: Counter::default(),
            vmm_failures: Counter::default(),
            requests: Counter::default(),
            idle_reclaims: Counter::default(),
            egress: Family::default(),
            sandboxes: Family::default(),
            pool_target: Family::default(),
            pool_ready: Family::default(),
            vmm_resident: Gauge::default(),
            guest_memory: Gauge::default(),
            guest_memory_budget: Gauge::default(),
            daemon_resident: Gauge::default(),
        };
        // Both kinds of create and decision show from the start.
        for pooled in ["true", "false"] {
            let _ = m.create.get_or_create(&Pooled {
                pooled: pooled.to_owned(),
            });
        }
        for decision in ["allow", "deny"] {
            let _ = m.egress.get_or_create(&Decision {
                decision: decision.to_owned(),
            });
        }
        let r = &mut m.registry;
        r.register("husk_sandboxes", "Sandboxes by state", m.sandboxes.clone());
        r.register(
            "husk_pool_target",
            "Clones each warm pool keeps",
            m.pool_target.clone(),
        );
        r.register(
            "husk_pool_ready",
            "Parked clones ready to hand out",
            m.pool_ready.clone(),
        );
        r.register(
            "husk_pool_hits",
            "Creates served from a pool",
            m.pool_hits.clone(),
        );
        r.register(
            "husk_pool_misses",
            "Creates that had to restore",
            m.pool_misses.clone(),
        );
        r.register(
            "husk_vmm_failures",
            "VMMs that exited on their own",
            m.vmm_failures.clone(),
        );
        r.register(
            "husk_api_requests",
            "API requests served",
            m.requests.clone(),
        );
        r.register(
            "husk_idle_reclaims",
            "Idle sandboxes whose guests dropped their page cache and compacted free memory \
             (--reclaim-idle-s)",
            m.idle_reclaims.clone(),
        );
        r.register(
            "husk_egress_decisions",
            "Connections the egress proxy allowed or refused",
            m.egress.clone(),
        );
        r.register(
            "husk_create_seconds",
            "From a create request to a sandbox whose agent answered",
            m.create.clone(),
        );
        r.register(
            "husk_restore_seconds",
            "From spawning a VMM to its restored guest's agent answering",
            m.restore.clone(),
        );
        r.register(
            "husk_vmm_resident_bytes",
            "Resident memory of all VMM processes",
            m.vmm_resident.clone(),
        );
        r.register(
            "husk_guest_memory_mib",
            "Guest memory of live sandboxes",
            m.guest_memory.clone(),
        );
        r.register(
            "husk_guest_memory_budget_mib",
            "The host's sandbox memory budget",
            m.guest_memory_budget.clone(),
        );
        r.register(
            "husk_daemon_resident_bytes",
            "The daemon's own resident memory",
            m.daemon_resident.clone(),
        );
        m
    }
}

impl Metrics {
    /// A create took `seconds` (from a pool or not).
    pub fn observe_create(&self, pooled: bool, seconds: f64) {
        let pooled = if pooled { "true" } else { "false" };
        self.create
            .get_or_create(&Pooled {
                pooled: pooled.to_owned(),
            })
            .observe(seconds);
    }

    /// A restore took `seconds`.
    pub fn observe_restore(&self, seconds: f64) {
        self.restore.observe(seconds);
    }

    /// A create was served from a pool.
    pub fn pool_hit(&self) {
        self.pool_hits.inc();
    }

    /// A create had to restore.
    pub fn pool_miss(&self) {
        self.pool_misses.inc();
    }

    /// One egress proxy decision.
    pub fn egress(&self, allowed: bool) {
        let decision = if allowed { "allow" } else { "deny" };
        self.egress
            .get_or_create(&Decision {
                decision: decision.to_owned(),
            })
            .inc();
    }

    /// A VMM exited on its own.
    pub fn vmm_failed(&self) {
        self.vmm_failures.inc();
    }

    /// An idle sandbox's guest gave memory back.
    pub fn idle_reclaim(&self) {
        self.idle_reclaims.inc();
    }

    /// An API request was served.
    pub fn request(&self) {
        self.requests.inc();
    }

    /// The text exposition of everything, with the daemon's gauges and
    /// pools as they are now.
    pub fn render(&self, gauges: &Gauges, pools: &[PoolInfo], daemon_rss_bytes: u64) -> String {
        let _one = self.rendering.lock().unwrap_or_else(|e| e.into_inner());
        self.sandboxes.clear();
        for (state, n) in &gauges.by_state {
            self.sandboxes
                .get_or_create(&State {
                    state: (*state).to_owned(),
                })
                .set(level(*n));
        }
        self.pool_target.clear();
        self.pool_ready.clear();
        for p in pools {
            let t = Template {
                template: p.template_name.clone(),
            };
            self.pool_target.get_or_create(&t).set(i64::from(p.target));
            self.pool_ready.get_or_create(&t).set(i64::from(p.ready));
        }
        self.vmm_resident.set(level(gauges.vmm_rss_bytes));
        self.guest_memory.set(level(gauges.guest_mem_mib));
        self.guest_memory_budget
            .set(level(gauges.memory_budget_mib));
        self.daemon_resident.set(level(daemon_rss_bytes));
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
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
            "# TYPE husk_pool_hits counter\nhusk_pool_hits_total 1\n",
            "husk_create_seconds_count{pooled=\"false\"} 0\n",
            "husk_guest_memory_budget_mib 1024\n",
            "husk_daemon_resident_bytes 99\n",
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.observe_restore(0.015);
        m.observe_restore(3.0);
        let gauges = Gauges {
            by_state: BTreeMap::new(),
            vmm_rss_bytes: 0,
            guest_mem_mib: 0,
            memory_budget_mib: 0,
        };

        let out = m.render(&gauges, &[], 0);

        for line in [
            "husk_restore_seconds_bucket{le=\"0.01\"} 0\n",
            "husk_restore_seconds_bucket{le=\"0.02\"} 1\n",
            "husk_restore_seconds_bucket{le=\"5.0\"} 2\n",
            "husk_restore_seconds_count 2\n",
        ] {
            assert!(out.contains(line), "{line} missing from:\n{out}");
        }
    }
}
