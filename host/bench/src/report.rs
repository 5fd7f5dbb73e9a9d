//! What `husk bench` reports: per contender and mode, every run as
//! consecutive phases (they sum to the run's total), and per phase the
//! min / p50 / p90 / p99 / max over the runs. The JSON form is described
//! by `host/bench-report.schema.json`.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// The report format's name and version (the JSON's `schema`).
pub const SCHEMA: &str = "husk-bench/1";

/// The JSON Schema of [`Report`].
pub const JSON_SCHEMA: &str = include_str!("../../bench-report.schema.json");

/// Who ran a phase: host code (the VMM, the daemon) at full speed
/// everywhere, or the guest (its kernel and agent), which an emulating
/// host slows down about a thousandfold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Side {
    Host,
    Guest,
}

/// One phase of one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    pub name: String,
    pub side: Side,
    pub ms: f64,
}

/// A process's memory, from /proc/PID/smaps_rollup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Memory {
    pub rss_kib: u64,
    /// Proportional set size: shared pages divided among their sharers.
    pub pss_kib: u64,
    pub shared_kib: u64,
    pub private_kib: u64,
}

impl Memory {
    /// Reads `pid`'s smaps_rollup; None if the process is gone.
    pub fn of(pid: u32) -> Option<Memory> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
        let field = |key: &str| kib_field(&text, key);
        Some(Memory {
            rss_kib: field("Rss"),
            pss_kib: field("Pss"),
            shared_kib: field("Shared_Clean") + field("Shared_Dirty"),
            private_kib: field("Private_Clean") + field("Private_Dirty"),
        })
    }
}

/// The `KEY:   N kB` line of a /proc file (`smaps_rollup`, `meminfo`), in
/// KiB (0 without one).
pub fn kib_field(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// One run of one contender and mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub iteration: usize,
    /// Consecutive phases from the spawn (or the request) to the end.
    pub phases: Vec<Segment>,
    /// The sum of `phases`.
    pub total_ms: f64,
    pub memory: Option<Memory>,
    /// Restores: how old the snapshot was when the run started.
    pub snapshot_age_s: Option<f64>,
    /// Restores with an agent: the guest's clock minus the host's, read
    /// right after the first exec (the snapshotted guest's clock was set
    /// from the host's just before its snapshot).
    pub guest_clock_offset_ms: Option<f64>,
    /// From the spawn to the point every contender of this mode can
    /// report (see [`Series::endpoint`]): what ratios compare.
    pub comparable_ms: Option<f64>,
}

impl Sample {
    /// A run whose phases lead from `start` through `points` (see
    /// [`segments`]); the restore and comparison figures are left unset.
    pub fn from_points(
        iteration: usize,
        start: u64,
        points: &[(&str, Side, Option<u64>)],
        memory: Option<Memory>,
    ) -> Sample {
        let phases = segments(start, points);
        Sample {
            iteration,
            total_ms: total(&phases),
            phases,
            memory,
            snapshot_age_s: None,
            guest_clock_offset_ms: None,
            comparable_ms: None,
        }
    }
}

/// Summary statistics over runs, in ms (or KiB for memory).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub n: usize,
    pub min: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Stats {
    /// Statistics of `values` (nearest-rank percentiles); None when empty.
    pub fn of(values: &[f64]) -> Option<Stats> {
        if values.is_empty() {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let rank = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Some(Stats {
            n: v.len(),
            min: v[0],
            p50: rank(0.5),
            p90: rank(0.9),
            p99: rank(0.99),
            max: v[v.len() - 1],
        })
    }
}

/// A phase over all runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseStats {
    pub name: String,
    pub side: Side,
    pub stats: Stats,
}

/// Whether a contender ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Every run finished.
    Ok,
    /// Some runs failed (see `failures`).
    Partial,
    /// No run finished.
    Failed,
    /// Not run (see `note`: e.g. the binary is not installed).
    Skipped,
}

/// One contender (husk, qemu) in one mode (cold_boot, restore, pooled_create).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Series {
    pub contender: String,
    pub mode: String,
    pub status: Status,
    /// What this series measures, or why it was skipped.
    pub note: String,
    pub samples: Vec<Sample>,
    pub failures: Vec<String>,
    pub phases: Vec<PhaseStats>,
    pub total: Option<Stats>,
    pub memory_pss_kib: Option<Stats>,
    /// What `comparable` measures to.
    pub endpoint: String,
    pub comparable: Option<Stats>,
}

impl Series {
    /// A series that did not run, and why.
    pub fn skipped(contender: &str, mode: &str, why: impl Into<String>) -> Series {
        Series {
            contender: contender.to_owned(),
            mode: mode.to_owned(),
            status: Status::Skipped,
            note: why.into(),
            samples: Vec::new(),
            failures: Vec::new(),
            phases: Vec::new(),
            total: None,
            memory_pss_kib: None,
            endpoint: endpoint(mode).to_owned(),
            comparable: None,
        }
    }

    /// A series to collect runs into.
    pub fn new(contender: &str, mode: &str, note: impl Into<String>) -> Series {
        Series {
            status: Status::Ok,
            ..Series::skipped(contender, mode, note)
        }
    }

    /// Fills in status and statistics from the samples and failures.
    pub fn summarize(&mut self) {
        if self.status == Status::Skipped {
            return;
        }
        self.status = match (self.samples.is_empty(), self.failures.is_empty()) {
            (true, _) => Status::Failed,
            (false, true) => Status::Ok,
            (false, false) => Status::Partial,
        };
        // Phases in the order they first appear (a run may lack one).
        let mut names: Vec<(String, Side)> = Vec::new();
        for seg in self.samples.iter().flat_map(|s| &s.phases) {
            if !names.iter().any(|(n, _)| *n == seg.name) {
                names.push((seg.name.clone(), seg.side));
            }
        }
        self.phases = names
            .into_iter()
            .filter_map(|(name, side)| {
                let values: Vec<f64> = self
                    .samples
                    .iter()
                    .flat_map(|s| &s.phases)
                    .filter(|seg| seg.name == name)
                    .map(|seg| seg.ms)
                    .collect();
                Some(PhaseStats {
                    stats: Stats::of(&values)?,
                    name,
                    side,
                })
            })
            .collect();
        let totals: Vec<f64> = self.samples.iter().map(|s| s.total_ms).collect();
        self.total = Stats::of(&totals);
        let pss: Vec<f64> = self
            .samples
            .iter()
            .filter_map(|s| s.memory.map(|m| m.pss_kib as f64))
            .collect();
        self.memory_pss_kib = Stats::of(&pss);
        let comparable: Vec<f64> = self
            .samples
            .iter()
            .filter_map(|s| s.comparable_ms)
            .collect();
        self.comparable = Stats::of(&comparable);
    }
}

/// The point every contender of `mode` reaches and can time, so that
/// ratios compare like with like: QEMU here has no agent to answer.
pub fn endpoint(mode: &str) -> &'static str {
    match mode {
        "cold_boot" => "spawn to guest-init's readiness line on the console",
        "restore" => {
            "spawn to the guest running (first KVM_RUN; QEMU: QMP `running`; Firecracker: its \
             snapshot load with resume_vm answered)"
        }
        _ => "spawn to the first exec output",
    }
}

/// K clones of one snapshot alive at once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Clones {
    pub contender: String,
    pub count: usize,
    pub per_clone: Vec<Memory>,
    /// What the clones take together: the sum of their PSS (shared pages
    /// counted once).
    pub pss_total_kib: u64,
    /// The sum of their RSS (shared pages counted in every clone).
    pub rss_total_kib: u64,
}

/// Clones parked in the daemon's warm pool at once (`husk bench --parked`):
/// what each costs the host, and where it goes. Figures are per clone, in
/// KiB (kernel figures may be slightly negative on a noisy host).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Parked {
    pub count: usize,
    /// How long the pool took to fill.
    pub fill_s: f64,
    /// Whether the page cache was dropped before each reading (root only;
    /// without it, cache the host drops meanwhile hides some of the cost).
    pub caches_dropped: bool,
    /// The fall in the host's `MemAvailable`.
    pub host_kib_per_clone: f64,
    /// Parked clones per GiB of host memory at that cost.
    pub per_gib: f64,
    pub slab_kib: f64,
    pub kernel_stack_kib: f64,
    pub page_tables_kib: f64,
    /// KVM's page tables for the guests (EPT, or PVM's shadow tables).
    pub secondary_page_tables_kib: f64,
    /// The kernel's vmalloc and per-CPU allocations (KVM's per-VM and
    /// per-vCPU structures are largely these).
    pub vmalloc_kib: f64,
    pub percpu_kib: f64,
    /// The page cache's growth (the template's files, shared by all).
    pub page_cache_kib: f64,
    /// The slab caches that grew most, per clone (root only).
    pub slab_caches: Vec<SlabCost>,
    pub threads_per_vmm: f64,
    /// Each VMM's mappings by kind: private and proportional memory.
    pub vmm: Vec<MappingCost>,
}

/// A kernel slab cache's growth per parked clone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlabCost {
    pub name: String,
    pub kib: f64,
}

/// One kind of mapping of a VMM, averaged over the parked clones.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MappingCost {
    pub kind: String,
    pub private_kib: f64,
    pub pss_kib: f64,
}

/// A performance target of the project's, against this run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Target {
    pub what: String,
    /// `at_most` or `at_least`.
    pub bound: String,
    pub limit: f64,
    /// None: this run did not measure it.
    pub measured: Option<f64>,
    pub met: Option<bool>,
}

/// A contender's p50 over husk's in the same mode, to the same endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ratio {
    pub contender: String,
    pub mode: String,
    pub endpoint: String,
    /// The contender's p50 over husk's (above 1: husk is faster).
    pub p50_over_husk: f64,
}

/// Where the numbers come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Labels {
    pub cpu_model: String,
    pub cpus: usize,
    /// `hardware`, or `pvm` where the guest kernel runs through KVM's
    /// instruction emulator.
    pub kvm: String,
    pub host_kernel: String,
    pub guest_kernel: String,
    pub guest_kernel_bytes: u64,
    pub initramfs: String,
    pub initramfs_bytes: u64,
    pub guest_mem_mib: u32,
    pub guest_vcpus: u8,
    /// The guest's clocksource, as its agent reads it.
    pub guest_clocksource: Option<String>,
    pub husk_version: String,
    pub commit: String,
    pub started_unix_s: u64,
    pub iterations: usize,
    /// Present on an emulating host: what its guest numbers do not say.
    pub warning: Option<String>,
}

/// A whole `husk bench` run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub schema: String,
    pub labels: Labels,
    pub series: Vec<Series>,
    pub clones: Vec<Clones>,
    pub ratios: Vec<Ratio>,
    pub parked: Option<Parked>,
    pub targets: Vec<Target>,
}

impl Report {
    /// Ratios of every other contender's p50 to husk's, mode by mode, to
    /// the endpoint both reach.
    pub fn compute_ratios(&mut self) {
        let p50 = |s: &Series| s.comparable.map(|t| t.p50);
        let mut ratios = Vec::new();
        for other in self.series.iter().filter(|s| s.contender != "husk") {
            let husk = self
                .series
                .iter()
                .find(|s| s.contender == "husk" && s.mode == other.mode);
            if let (Some(theirs), Some(ours)) = (p50(other), husk.and_then(p50)) {
                if ours > 0.0 {
                    ratios.push(Ratio {
                        contender: other.contender.clone(),
                        mode: other.mode.clone(),
                        endpoint: other.endpoint.clone(),
                        p50_over_husk: theirs / ours,
                    });
                }
            }
        }
        self.ratios = ratios;
    }

    /// The project's targets (issue 25) against this run: restore to the
    /// guest running, the ratio to Firecracker's, the pooled claim (the
    /// API call to a resumed clone), and parked clones per GiB.
    pub fn compute_targets(&mut self) {
        let series = |mode: &str| {
            self.series
                .iter()
                .find(|s| s.contender == "husk" && s.mode == mode)
        };
        let restore = series("restore").and_then(|s| s.comparable);
        let claim = series("pooled_create").and_then(|s| {
            s.phases
                .iter()
                .find(|p| p.name == "claim_and_resume")
                .map(|p| p.stats)
        });
        let firecracker = self
            .ratios
            .iter()
            .find(|r| r.contender == "firecracker" && r.mode == "restore")
            .map(|r| r.p50_over_husk);
        // Unmeasured when the host's free memory moved more than the
        // clones took.
        let parked = self
            .parked
            .as_ref()
            .filter(|p| p.host_kib_per_clone > 0.0)
            .map(|p| p.per_gib);
        let target = |what: &str, at_most: bool, limit: f64, measured: Option<f64>| Target {
            what: what.to_owned(),
            bound: if at_most { "at_most" } else { "at_least" }.to_owned(),
            limit,
            measured,
            met: measured.map(|m| if at_most { m <= limit } else { m >= limit }),
        };
        self.targets = vec![
            target(
                "restore to the guest running, p50 ms",
                true,
                3.0,
                restore.map(|s| s.p50),
            ),
            target(
                "restore to the guest running, p90 ms",
                true,
                5.0,
                restore.map(|s| s.p90),
            ),
            target(
                "restore: Firecracker's p50 over husk's",
                false,
                5.0,
                firecracker,
            ),
            target("pooled claim, p50 ms", true, 10.0, claim.map(|s| s.p50)),
            target("pooled claim, p99 ms", true, 20.0, claim.map(|s| s.p99)),
            target("parked clones per GiB", false, 1000.0, parked),
        ];
    }

    /// The terminal table.
    pub fn table(&self) -> String {
        let l = &self.labels;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "husk bench: {} ({} CPUs), KVM {}, host kernel {}",
            l.cpu_model, l.cpus, l.kvm, l.host_kernel
        );
        let _ = writeln!(
            out,
            "guest: {} ({} bytes) + {} ({} bytes), {} MiB, {} vCPU, clocksource {}; husk {} ({}); {} runs each",
            l.guest_kernel,
            l.guest_kernel_bytes,
            l.initramfs,
            l.initramfs_bytes,
            l.guest_mem_mib,
            l.guest_vcpus,
            l.guest_clocksource.as_deref().unwrap_or("unknown"),
            l.husk_version,
            l.commit,
            l.iterations
        );
        if let Some(w) = &l.warning {
            let _ = writeln!(out, "NOTE: {w}");
        }
        for s in &self.series {
            let _ = writeln!(out, "\n{} {}: {}", s.contender, s.mode, s.note);
            if s.status == Status::Skipped {
                let _ = writeln!(out, "  skipped");
                continue;
            }
            let _ = writeln!(
                out,
                "  {:<6} {:<26} {:>10} {:>10} {:>10} {:>10} {:>10}",
                "side", "phase (ms)", "min", "p50", "p90", "p99", "max"
            );
            let row = |out: &mut String, side: &str, name: &str, st: &Stats| {
                let _ = writeln!(
                    out,
                    "  {side:<6} {name:<26} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
                    st.min, st.p50, st.p90, st.p99, st.max
                );
            };
            for p in &s.phases {
                let side = match p.side {
                    Side::Host => "host",
                    Side::Guest => "guest",
                };
                row(&mut out, side, &p.name, &p.stats);
            }
            if let Some(t) = &s.total {
                row(&mut out, "", "total", t);
            }
            if let Some(c) = &s.comparable {
                row(&mut out, "", "to the shared endpoint", c);
            }
            if let Some(m) = &s.memory_pss_kib {
                let _ = writeln!(
                    out,
                    "  {:<6} {:<26} {:>10.0} {:>10.0} {:>10.0} {:>10.0} {:>10.0}",
                    "", "memory PSS (KiB)", m.min, m.p50, m.p90, m.p99, m.max
                );
            }
            let ages: Vec<String> = s
                .samples
                .iter()
                .filter_map(|x| {
                    let age = x.snapshot_age_s?;
                    Some(match x.guest_clock_offset_ms {
                        Some(off) => format!("{age:.0} s old: guest clock {off:+.0} ms"),
                        None => format!("{age:.0} s old"),
                    })
                })
                .collect();
            if !ages.is_empty() {
                let _ = writeln!(out, "  snapshot age: {}", ages.join("; "));
            }
            for f in &s.failures {
                let _ = writeln!(out, "  FAILED run: {f}");
            }
        }
        for c in &self.clones {
            let _ = writeln!(
                out,
                "\n{} {} clones of one snapshot at once: {} KiB together (sum of PSS), {} KiB summing RSS",
                c.contender, c.count, c.pss_total_kib, c.rss_total_kib
            );
        }
        if let Some(p) = &self.parked {
            let _ = writeln!(
                out,
                "\nhusk {} clones parked in the warm pool (filled in {:.0} s): {:.0} KiB of the host's \
                 available memory each, {}{}",
                p.count,
                p.fill_s,
                p.host_kib_per_clone,
                if p.host_kib_per_clone > 0.0 {
                    format!("{:.0} per GiB", p.per_gib)
                } else {
                    "no per-GiB figure (the host's free memory moved more than the clones took)".into()
                },
                if p.caches_dropped { "" } else { " (page cache not dropped: not root)" }
            );
            let _ = writeln!(
                out,
                "  kernel, per clone: slab {:.0} KiB, kernel stacks {:.0} KiB ({:.1} threads per VMM), \
                 page tables {:.0} KiB, KVM's page tables {:.0} KiB, vmalloc {:.0} KiB, per-CPU {:.0} KiB; \
                 page cache {:+.0} KiB (shared)",
                p.slab_kib,
                p.kernel_stack_kib,
                p.threads_per_vmm,
                p.page_tables_kib,
                p.secondary_page_tables_kib,
                p.vmalloc_kib,
                p.percpu_kib,
                p.page_cache_kib
            );
            if !p.slab_caches.is_empty() {
                let caches: Vec<String> = p
                    .slab_caches
                    .iter()
                    .map(|c| format!("{} {:.0}", c.name, c.kib))
                    .collect();
                let _ = writeln!(
                    out,
                    "  slab caches that grew, KiB per clone: {}",
                    caches.join(", ")
                );
            }
            for m in &p.vmm {
                let _ = writeln!(
                    out,
                    "  VMM {}: private {:.0} KiB, PSS {:.0} KiB",
                    m.kind, m.private_kib, m.pss_kib
                );
            }
        }
        if !self.targets.is_empty() {
            let _ = writeln!(out, "\ntargets:");
            for t in &self.targets {
                let sign = if t.bound == "at_most" { "<=" } else { ">=" };
                let verdict = match (t.measured, t.met) {
                    (Some(m), Some(true)) => format!("met: {m:.2}"),
                    (Some(m), _) => format!("MISSED: {m:.2}"),
                    (None, _) => "not measured in this run".to_owned(),
                };
                let _ = writeln!(out, "  {} {sign} {}: {verdict}", t.what, t.limit);
            }
        }
        if !self.ratios.is_empty() {
            let _ = writeln!(out);
            for r in &self.ratios {
                let verdict = if r.p50_over_husk >= 1.0 {
                    format!("husk {:.2}x faster", r.p50_over_husk)
                } else {
                    format!("husk {:.2}x slower", 1.0 / r.p50_over_husk)
                };
                let _ = writeln!(
                    out,
                    "{} {}: p50 {:.2}x husk's: {verdict} ({})",
                    r.contender, r.mode, r.p50_over_husk, r.endpoint
                );
            }
        }
        out
    }
}

/// Turns points in time (ns on one monotonic clock; None where a phase was
/// not seen) into consecutive phases from `start`. A point that is missing
/// or earlier than the one before is left out and its time goes to the
/// next phase, so the phases always sum to the last point minus `start`.
pub fn segments(start: u64, points: &[(&str, Side, Option<u64>)]) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut at = start;
    for (name, side, point) in points {
        if let Some(p) = point.filter(|p| *p >= at) {
            out.push(Segment {
                name: (*name).to_owned(),
                side: *side,
                ms: (p - at) as f64 / 1e6,
            });
            at = p;
        }
    }
    out
}

/// The sum of a run's phases.
pub fn total(phases: &[Segment]) -> f64 {
    phases.iter().map(|s| s.ms).sum()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn labels() -> Labels {
        Labels {
            cpu_model: "CPU <model> & co".into(),
            cpus: 2,
            kvm: "hardware".into(),
            host_kernel: "6.1".into(),
            guest_kernel: "vmlinux".into(),
            guest_kernel_bytes: 1,
            initramfs: "initramfs".into(),
            initramfs_bytes: 1,
            guest_mem_mib: 128,
            guest_vcpus: 1,
            guest_clocksource: None,
            husk_version: "0".into(),
            commit: "c".into(),
            started_unix_s: 0,
            iterations: 2,
            warning: None,
        }
    }

    #[test]
    fn targets_say_met_missed_or_not_measured() {
        let mut restore = Series::new("husk", "restore", "");
        for (i, ms) in [2.0, 2.5, 6.0].into_iter().enumerate() {
            let mut sample = Sample::from_points(i, 0, &[], None);
            sample.comparable_ms = Some(ms);
            restore.samples.push(sample);
        }
        restore.summarize();
        let mut report = Report {
            schema: SCHEMA.into(),
            labels: labels(),
            series: vec![restore],
            clones: Vec::new(),
            ratios: vec![Ratio {
                contender: "firecracker".into(),
                mode: "restore".into(),
                endpoint: String::new(),
                p50_over_husk: 4.0,
            }],
            parked: None,
            targets: Vec::new(),
        };

        report.compute_targets();

        let verdict = |what: &str| {
            report
                .targets
                .iter()
                .find(|t| t.what.starts_with(what))
                .map(|t| t.met)
                .expect(what)
        };
        assert_eq!(verdict("restore to the guest running, p50"), Some(true));
        assert_eq!(verdict("restore to the guest running, p90"), Some(false));
        assert_eq!(verdict("restore: Firecracker"), Some(false));
        assert_eq!(verdict("pooled claim, p50"), None);
        assert_eq!(verdict("parked clones per GiB"), None);
        assert!(report.table().contains("MISSED: 4.00"));
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();

        let s = Stats::of(&v).expect("stats");

        assert_eq!(
            (s.min, s.p50, s.p90, s.p99, s.max),
            (1.0, 50.0, 90.0, 99.0, 100.0)
        );
        assert_eq!(s.n, 100);
        assert!(Stats::of(&[]).is_none());
    }

    #[test]
    fn segments_sum_to_the_span_even_with_missing_or_early_points() {
        let points = [
            ("a", Side::Host, Some(1_000_000)),
            ("missing", Side::Host, None),
            ("b", Side::Guest, Some(4_000_000)),
            ("early", Side::Guest, Some(2_000_000)),
            ("c", Side::Guest, Some(10_000_000)),
        ];

        let segs = segments(0, &points);

        let names: Vec<&str> = segs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert_eq!(total(&segs), 10.0);
    }

    #[test]
    fn the_schema_is_json_and_names_the_top_level_fields() {
        let schema: serde_json::Value = serde_json::from_str(JSON_SCHEMA).expect("schema JSON");

        let required = schema["required"].as_array().expect("required");
        for field in [
            "schema", "labels", "series", "clones", "ratios", "parked", "targets",
        ] {
            assert!(required.iter().any(|r| r == field), "{field}");
        }
    }
}
