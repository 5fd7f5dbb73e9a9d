//! End-to-end cold boot: husk-vmm against QEMU's microvm machine, booting the
//! same kernel and initramfs to guest-init's readiness line, in one run.
//!
//!     make bench                      (or: cargo bench --bench boot_timeline)
//!     HUSK_BENCH_RUNS=5 HUSK_BENCH_QEMU=0 make bench
//!
//! For husk the report splits host phases (from husk-vmm's own timeline)
//! from guest phases. For both it measures, from the harness, spawn to the
//! readiness line on the serial console and spawn to process exit, and
//! samples the VMM's resident memory right after readiness. On an emulating
//! (PVM) host the guest phase dominates and is about 1000x slower than on
//! hardware; the host phases run at full speed everywhere.

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use husk_vmm::timeline::Phase;

const READY: &str = "husk-guest-init: ready";
const GUEST_COMMAND: &str = "-- /bin/busybox poweroff";

struct Sample {
    ready: Duration,
    exit: Duration,
    rss_kib: u64,
    timeline: Option<serde_json::Value>,
}

/// Resident set of `pid` in KiB (VmRSS), which for QEMU includes guest RAM
/// touched so far.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Spawns `cmd` with the guest console on stdout and times the readiness
/// line and the exit.
fn measure(
    mut cmd: Command,
    timeline: Option<&std::path::Path>,
    deadline: Duration,
) -> Result<Sample, String> {
    let start = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watchdog = {
        let (done, pid) = (done.clone(), child.id() as i32);
        std::thread::spawn(move || {
            while start.elapsed() < deadline {
                if done.load(std::sync::atomic::Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            // SAFETY: killing our own child, which has not been reaped yet.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        })
    };
    let mut ready = None;
    let mut rss = 0;
    for line in stdout.lines() {
        let Ok(line) = line else { break };
        if ready.is_none() && line.contains(READY) {
            ready = Some(start.elapsed());
            rss = rss_kib(child.id());
        }
    }
    let status = child.wait().expect("wait");
    let exit = start.elapsed();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = watchdog.join();
    let Some(ready) = ready else {
        return Err(format!("no readiness line after {exit:?} ({status})"));
    };
    if !status.success() {
        return Err(format!("exited with {status} after {exit:?}"));
    }
    Ok(Sample {
        ready,
        exit,
        rss_kib: rss,
        timeline: timeline.map(|p| {
            serde_json::from_slice(&std::fs::read(p).expect("timeline")).expect("timeline JSON")
        }),
    })
}

fn husk_run() -> Result<Sample, String> {
    let timeline = vmm_sys_util::tempfile::TempFile::new().expect("tempfile");
    let mut cmd = Command::new(common::vmm_binary());
    cmd.arg("--kernel")
        .arg(common::kernel())
        .arg("--initramfs")
        .arg(common::initramfs())
        .arg("--timeline")
        .arg(timeline.as_path())
        .args(["--cmdline", GUEST_COMMAND]);
    measure(cmd, Some(timeline.as_path()), common::BOOT_TIMEOUT)
}

fn qemu_run() -> Result<Sample, String> {
    // Same kernel parameters husk-vmm would use on this host.
    let pvm = std::path::Path::new("/sys/module/kvm_pvm").exists();
    let mut append = husk_vmm::config::BASE_CMDLINE.to_owned();
    if pvm {
        append = format!("{append} {}", husk_vmm::config::PVM_CMDLINE);
    }
    append = format!("{append} {GUEST_COMMAND}");
    let mut cmd = Command::new("qemu-system-x86_64");
    // On a PVM host QEMU's PVH entry often loops forever re-emulating
    // `mov %eax,%ds` at 0x100060d (tracefs kvm_emulate_insn): every run this
    // harness started hung so, while 4 of 5 started by hand from a shell or
    // Python booted. The cause is not known; hung runs are reported.
    cmd.args([
        "-M",
        // Our kernel has no ACPI.
        "microvm,acpi=off",
        "-enable-kvm",
        "-cpu",
        husk_bench::qemu::cpu_model(),
        "-m",
        "128",
        "-smp",
        "1",
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        "-serial",
        "stdio",
        "-kernel",
    ])
    .arg(common::kernel())
    .arg("-initrd")
    .arg(common::initramfs())
    .args(["-append", &append]);
    // Give up on a run after 5 minutes, 3x QEMU's usual cold boot here.
    measure(cmd, None, Duration::from_secs(300))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn stats(values: &mut [f64]) -> String {
    if values.is_empty() {
        return "no samples".to_owned();
    }
    values.sort_by(f64::total_cmp);
    let median = values[values.len() / 2];
    format!(
        "median {median:>10.1}  min {:>10.1}  max {:>10.1}",
        values[0],
        values[values.len() - 1]
    )
}

fn main() {
    // `cargo bench` passes --bench; nothing else is configurable by flags.
    let runs: usize = std::env::var("HUSK_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let with_qemu = std::env::var("HUSK_BENCH_QEMU").map_or(true, |v| v != "0");
    println!("kernel    {}", common::kernel().display());
    println!("initramfs {}", common::initramfs().display());
    println!("runs      {runs} per VMM, 1 vCPU, 128 MiB\n");

    let husk = collect("husk-vmm", runs, husk_run);
    println!("husk-vmm (ms; host phases from husk-vmm's own clock, from main())");
    let host_phases = Phase::ALL.iter().take_while(|p| **p != Phase::InitStarted);
    for phase in host_phases.map(|p| p.name()) {
        let mut v: Vec<f64> = husk
            .iter()
            .filter_map(|s| s.timeline.as_ref()?["phases_us"][phase].as_u64())
            .map(|us| us as f64 / 1000.0)
            .collect();
        println!("  host  {phase:<28} {}", stats(&mut v));
    }
    let mut guest: Vec<f64> = husk
        .iter()
        .filter_map(|s| {
            let p = &s.timeline.as_ref()?["phases_us"];
            Some((p["guest_ready"].as_u64()? - p["first_kvm_run"].as_u64()?) as f64 / 1000.0)
        })
        .collect();
    println!("  guest first KVM_RUN -> ready      {}", stats(&mut guest));
    report_common("husk-vmm", &husk);
    let mut vmm_rss: Vec<f64> = husk
        .iter()
        .filter_map(|s| s.timeline.as_ref()?["vmm_rss_kib"].as_u64())
        .map(|k| k as f64)
        .collect();
    println!(
        "  VMM RSS excluding guest RAM (KiB)  {}",
        stats(&mut vmm_rss)
    );

    if with_qemu {
        let qemu = collect("qemu", runs, qemu_run);
        println!("\nqemu-system-x86_64 -M microvm (ms)");
        if !qemu.is_empty() {
            report_common("qemu", &qemu);
        }
    }
}

/// Runs `run` `runs` times; failed runs are reported and left out.
fn collect(name: &str, runs: usize, run: fn() -> Result<Sample, String>) -> Vec<Sample> {
    let mut samples = Vec::new();
    for i in 0..runs {
        match run() {
            Ok(sample) => samples.push(sample),
            Err(e) => println!("  {name} run {}: FAILED: {e}", i + 1),
        }
    }
    samples
}

fn report_common(name: &str, samples: &[Sample]) {
    let mut ready: Vec<f64> = samples.iter().map(|s| ms(s.ready)).collect();
    let mut exit: Vec<f64> = samples.iter().map(|s| ms(s.exit)).collect();
    let mut rss: Vec<f64> = samples.iter().map(|s| s.rss_kib as f64).collect();
    println!("  {name}: spawn -> readiness line  {}", stats(&mut ready));
    println!("  {name}: spawn -> process exit    {}", stats(&mut exit));
    println!("  {name}: total RSS at ready (KiB) {}", stats(&mut rss));
}
