//! `husk bench`, a tiny run of the real thing: two runs of each contender
//! and mode (QEMU too where it is installed, Firecracker where
//! HUSK_FIRECRACKER names its binary) on real guests, the first of them
//! cold booting (`--cold-boots 1`: a second cold boot checks nothing the
//! first does not, and costs a minute of emulated guest here). Its report
//! must validate against the published schema, and its numbers must be
//! sane: positive, phases in order and summing to each run's total. They
//! are never checked against time limits.

#[path = "common/mod.rs"]
mod common;

use std::path::Path;
use std::process::Command;

use husk_bench::report::{Report, Side, Status};

/// Phases of husk's runs, in the order they happen.
const HUSK_ORDER: [&str; 16] = [
    "process_start",
    "vmm_setup",
    "state_load",
    "vm_create",
    "memory",
    "kernel_load",
    "devices",
    "vcpus",
    "to_first_kvm_run",
    "kernel_init",
    "vsock_reset_handled",
    "connection_accepted",
    "first_reply",
    "claim_and_resume",
    "agent_answering",
    "first_exec_output",
];

fn validate_with_python(report: &Path, schema: &str) {
    let Some(python) = std::env::var_os("HUSK_TEST_PYTHON").filter(|v| !v.is_empty()) else {
        common::skip(
            "the schema check: HUSK_TEST_PYTHON (a python with jsonschema; `make test` sets it up)",
        );
        return;
    };
    let schema_file = report.with_extension("schema.json");
    std::fs::write(&schema_file, schema).expect("schema file");
    let out = Command::new(python)
        .args([
            "-c",
            "import json, sys, jsonschema\n\
             schema = json.load(open(sys.argv[1]))\n\
             jsonschema.Draft202012Validator.check_schema(schema)\n\
             jsonschema.Draft202012Validator(schema).validate(json.load(open(sys.argv[2])))\n\
             print('valid')",
        ])
        .arg(&schema_file)
        .arg(report)
        .output()
        .expect("python");
    assert!(
        out.status.success(),
        "the report does not validate against its schema:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_tiny_bench_run_reports_sane_phases_that_validate_against_the_schema() {
    let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
    let (json, svg) = (
        dir.as_path().join("bench.json"),
        dir.as_path().join("bench.svg"),
    );

    let out = Command::new(common::husk_binary())
        .args([
            "bench",
            "--iterations",
            "2",
            "--cold-boots",
            "1",
            "--clones",
            "2",
            "--parked",
            "3",
        ])
        .arg("--kernel")
        .arg(common::kernel())
        .arg("--initramfs")
        .arg(common::initramfs())
        .arg("--vmm")
        .arg(common::vmm_binary())
        .arg("--json")
        .arg(&json)
        .arg("--svg")
        .arg(&svg)
        .output()
        .expect("husk bench");
    let (stdout, stderr) = (common::text(&out.stdout), common::text(&out.stderr));
    eprintln!("{stderr}\n{stdout}");

    assert!(out.status.success(), "husk bench failed: {}", out.status);
    let schema = Command::new(common::husk_binary())
        .args(["bench", "--schema"])
        .output()
        .expect("husk bench --schema");
    assert!(schema.status.success());
    validate_with_python(&json, &common::text(&schema.stdout));
    let report: Report =
        serde_json::from_slice(&std::fs::read(&json).expect("report")).expect("report JSON");
    assert_eq!(report.schema, "husk-bench/1");
    let pvm = Path::new("/sys/module/kvm_pvm").exists();
    assert_eq!(report.labels.kvm, if pvm { "pvm" } else { "hardware" });
    assert_eq!(report.labels.warning.is_some(), pvm);
    assert!(report.labels.cpus >= 1 && report.labels.guest_kernel_bytes > 0);
    assert_eq!(
        report.labels.guest_clocksource.as_deref(),
        Some("kvm-clock")
    );
    for s in &report.series {
        let label = format!("{} {}", s.contender, s.mode);
        if s.contender == "qemu" && s.status == Status::Skipped {
            assert!(
                which_qemu().is_none(),
                "{label} skipped with QEMU installed: {}",
                s.note
            );
            common::skip(&format!("{label}: QEMU is not installed ({})", s.note));
            continue;
        }
        if s.contender == "firecracker" && s.status == Status::Skipped {
            // Not packaged for Debian: it runs where the user points the
            // bench at a binary (HUSK_FIRECRACKER, which `husk bench`
            // reads) or one is kept beside the checkout.
            assert!(
                !firecracker_expected(),
                "{label} skipped with a Firecracker binary at hand: {}",
                s.note
            );
            assert!(s.note.contains("--firecracker PATH"), "{label}: {}", s.note);
            common::skip(&format!("{label}: no Firecracker binary ({})", s.note));
            continue;
        }
        // Every husk mode, and QEMU and Firecracker where present, ran both
        // times (a cold boot once).
        assert_eq!(s.status, Status::Ok, "{label}: {:?}", s.failures);
        let runs = if s.mode == "cold_boot" { 1 } else { 2 };
        assert_eq!(s.samples.len(), runs, "{label}");
        for sample in &s.samples {
            assert!(sample.total_ms > 0.0, "{label}: {sample:?}");
            assert!(
                sample.phases.iter().all(|p| p.ms >= 0.0),
                "{label}: {sample:?}"
            );
            let sum: f64 = sample.phases.iter().map(|p| p.ms).sum();
            assert!((sum - sample.total_ms).abs() < 1e-6, "{label}: {sample:?}");
            // Host work comes before the guest's.
            let first_guest = sample.phases.iter().position(|p| p.side == Side::Guest);
            let last_host = sample.phases.iter().rposition(|p| p.side == Side::Host);
            if let (Some(g), Some(h)) = (first_guest, last_host) {
                assert!(h < g, "{label}: {sample:?}");
            }
            let memory = sample.memory.expect("memory of the run's VMM");
            assert!(
                memory.pss_kib > 0 && memory.rss_kib >= memory.private_kib,
                "{label}"
            );
        }
        if s.contender == "husk" && s.mode != "pooled_create" {
            // Timed to the point QEMU reaches too, within the run.
            for sample in &s.samples {
                let c = sample.comparable_ms.expect("comparable endpoint");
                assert!(c > 0.0 && c <= sample.total_ms, "{label}: {sample:?}");
            }
        }
        if s.contender == "husk" {
            for sample in &s.samples {
                let at: Vec<usize> = sample
                    .phases
                    .iter()
                    .map(|p| {
                        HUSK_ORDER
                            .iter()
                            .position(|n| *n == p.name)
                            .expect("known phase")
                    })
                    .collect();
                assert!(at.windows(2).all(|w| w[0] < w[1]), "{label}: {sample:?}");
                assert_eq!(
                    sample.phases.last().map(|p| p.name.as_str()),
                    Some("first_exec_output")
                );
            }
        }
    }
    let series = |c: &str, m: &str| {
        report
            .series
            .iter()
            .find(|s| s.contender == c && s.mode == m)
            .unwrap_or_else(|| panic!("no {c} {m}"))
    };
    // A restore is broken into the VMM's phases and the guest's answer.
    let restore = &series("husk", "restore").samples[1];
    let names: Vec<&str> = restore.phases.iter().map(|p| p.name.as_str()).collect();
    for phase in [
        "state_load",
        "memory",
        "devices",
        "vcpus",
        "to_first_kvm_run",
        "connection_accepted",
        "first_exec_output",
    ] {
        assert!(names.contains(&phase), "{names:?}");
    }
    assert!(restore.snapshot_age_s.is_some_and(|a| a >= 0.0));
    assert!(restore.guest_clock_offset_ms.is_some());
    // The pooled sandbox's memory is its VMM's (the daemon's pid for it is
    // the jailer's): at least the guest pages its exec touched.
    let pooled = series("husk", "pooled_create");
    assert!(
        pooled
            .samples
            .iter()
            .all(|s| s.memory.is_some_and(|m| m.rss_kib > 4096)),
        "{:?}",
        pooled.samples
    );
    let cold = &series("husk", "cold_boot").samples[0];
    for phase in ["kernel_init", "connection_accepted"] {
        assert!(
            cold.phases.iter().any(|p| p.name == phase),
            "{phase}: {cold:?}"
        );
    }
    // A peer's modes with a ratio to husk's, each positive.
    let ratio_modes = |contender: &str| -> Vec<String> {
        let ratios = report.ratios.iter().filter(|r| r.contender == contender);
        assert!(
            ratios.clone().all(|r| r.p50_over_husk > 0.0),
            "{:?}",
            report.ratios
        );
        ratios.map(|r| r.mode.clone()).collect()
    };
    // QEMU, where it ran, against husk to the same endpoints.
    if which_qemu().is_some() {
        assert_eq!(ratio_modes("qemu"), ["cold_boot", "restore"]);
    }
    // Firecracker, where at hand: to the same endpoints, and its restored
    // guest's clock read through the same agent; the table says how many
    // times faster husk is.
    if firecracker_expected() {
        assert!(
            stdout.contains("firecracker restore: p50"),
            "no Firecracker ratio in the table"
        );
        assert_eq!(ratio_modes("firecracker"), ["cold_boot", "restore"]);
        let restores = &series("firecracker", "restore").samples;
        assert!(restores.iter().all(|s| s.guest_clock_offset_ms.is_some()));
    }
    // Two clones at once: shared pages counted once in the PSS sum.
    let clones = &report.clones[0];
    assert_eq!((clones.contender.as_str(), clones.count), ("husk", 2));
    assert!(clones.pss_total_kib > 0 && clones.pss_total_kib <= clones.rss_total_kib);
    // Three clones parked at once: what each costs the host, and where it
    // goes (the guest pages each touched since the template's snapshot are
    // its own).
    let parked = report.parked.as_ref().expect("parked clones measured");
    assert_eq!(parked.count, 3);
    // The host-wide figure is only as steady as the host (three clones are
    // little next to what the runs before them free): a per-GiB figure
    // exactly when the clones took something.
    assert_eq!(
        parked.per_gib > 0.0,
        parked.host_kib_per_clone > 0.0,
        "{parked:?}"
    );
    assert!(parked.threads_per_vmm >= 2.0, "{parked:?}");
    assert!(
        parked
            .vmm
            .iter()
            .any(|m| m.kind == "guest memory" && m.private_kib > 0.0),
        "{parked:?}"
    );
    assert!(
        stdout.contains("clones parked in the warm pool"),
        "{stdout}"
    );
    // Every target is stated against this run, met or missed; only the
    // Firecracker ratio (no Firecracker at hand) and the parked clones'
    // (the host's free memory moved more than they took) may be unmeasured.
    assert_eq!(report.targets.len(), 6, "{:?}", report.targets);
    for t in &report.targets {
        let unmeasured_ok = (t.what.contains("Firecracker") && !firecracker_expected())
            || (t.what.contains("parked") && parked.host_kib_per_clone <= 0.0);
        assert!(
            t.measured.is_some() || unmeasured_ok,
            "{} not measured: {:?}",
            t.what,
            report.targets
        );
        assert_eq!(t.met.is_some(), t.measured.is_some(), "{t:?}");
        let line = format!("  {} ", t.what);
        assert!(stdout.contains(&line), "no target line {line:?}: {stdout}");
    }
    // The table shows every phase that ran; the chart a bar per series
    // that ran, with the peers' ratios.
    let chart = std::fs::read_to_string(&svg).expect("svg");
    assert!(chart.starts_with("<svg") && chart.trim_end().ends_with("</svg>"));
    for p in &series("husk", "restore").phases {
        assert!(stdout.contains(&p.name), "{}", p.name);
    }
    for s in report.series.iter().filter(|s| s.status == Status::Ok) {
        let bar = format!(">{} {}</text>", s.contender, s.mode.replace('_', " "));
        assert!(chart.contains(&bar), "no bar {bar}");
    }
    for r in &report.ratios {
        let verdict = if r.p50_over_husk >= 1.0 {
            "faster"
        } else {
            "slower"
        };
        assert!(chart.contains(&format!("x {verdict}</text>")), "{r:?}");
    }
}

/// Whether `husk bench` has a Firecracker to run: HUSK_FIRECRACKER, or
/// the one kept beside the checkout (../shared/peers/firecracker).
fn firecracker_expected() -> bool {
    std::env::var_os("HUSK_FIRECRACKER").is_some()
        || common::repo_root()
            .join("../shared/peers/firecracker")
            .is_file()
}

fn which_qemu() -> Option<()> {
    Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| ())
}
