//! `husk bench`: cold boot, snapshot restore and pooled create of one
//! guest, next to QEMU's `microvm` and Firecracker booting and restoring
//! the same guest, run by run (each run does every contender and mode once,
//! so a noisy moment of the host hurts all of them alike), reported per
//! phase.
//!
//! - [`husk_vm`]: husk-vmm cold boots and restores, with the VMM's own
//!   timeline for host phases and its guest marks;
//! - [`pooled`]: a private daemon's warm pool, through its API;
//! - [`qemu`]: the same guest under QEMU;
//! - [`firecracker`]: the same guest under Firecracker, through its API;
//! - [`report`]: phases, statistics, labels, the JSON and the table;
//!   [`svg`]: the chart.
//!
//! The first husk cold boot of the run is snapshotted after its exec: that
//! snapshot is what every husk restore and the concurrent clones restore,
//! so restores later in the run find an older snapshot (its age and the
//! guest's clock after the restore are reported with each). QEMU's first
//! cold boot likewise becomes its migration file, and Firecracker's its
//! snapshot.

pub mod density;
pub mod firecracker;
pub mod husk_vm;
pub mod pooled;
pub mod qemu;
pub mod report;
pub mod svg;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use husk_vmm_api::{Reply, Request};

use husk_vm::Vmm;
use report::{Clones, Labels, Memory, Report, Sample, Series, SCHEMA};

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub vmm: PathBuf,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
    pub mem_mib: u32,
    pub vcpus: u8,
    /// Runs of each contender and mode.
    pub iterations: usize,
    /// Of those, the runs that cold boot (the first ones; at least 1, at
    /// most `iterations`): a cold boot is minutes of emulated guest kernel
    /// on some hosts, and restores are what varies run to run.
    pub cold_boots: usize,
    /// Clones of one snapshot kept alive at once for the memory figure
    /// (0: none).
    pub clones: usize,
    /// Clones to park in the daemon's warm pool at once, for the memory
    /// each costs (0: none; needs the pooled path).
    pub parked: usize,
    /// The `husk` binary, to run a private daemon for the pooled path
    /// (None: no pooled runs).
    pub husk: Option<PathBuf>,
    /// `qemu-system-x86_64`, or why QEMU is skipped.
    pub qemu: Result<PathBuf, String>,
    /// A `firecracker` binary, or why Firecracker is skipped.
    pub firecracker: Result<PathBuf, String>,
    /// Where the runs keep their files (sockets, snapshots, logs).
    pub work_dir: PathBuf,
    /// How long a boot may take before the run counts as failed (stretched
    /// by the host's load).
    pub boot_budget: Duration,
    /// Likewise for a restore.
    pub restore_budget: Duration,
}

/// Errors that end the whole bench (a failed run is reported, not this).
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("cannot start {0}: {1}")]
    Spawn(PathBuf, #[source] std::io::Error),
    #[error("the bench's files: {0}")]
    Io(#[source] std::io::Error),
    #[error("the private daemon: {0}")]
    Daemon(String),
    #[error("{0} does not exist")]
    Missing(PathBuf),
}

/// guest-init's readiness line on the console.
const READY: &str = "husk-guest-init: ready";

/// Reads a peer VMM's console: the first readiness line's time goes to
/// `tx`, and with `log` every line to that file.
fn watch_console(
    console: impl std::io::Read,
    log: Option<&Path>,
    tx: &std::sync::mpsc::Sender<u64>,
) {
    use std::io::{BufRead, Write};
    let mut file = log.and_then(|l| std::fs::File::create(l).ok());
    let mut seen = false;
    for line in std::io::BufReader::new(console).lines() {
        let Ok(line) = line else { return };
        if !seen && line.contains(READY) {
            seen = true;
            let _ = tx.send(monotonic_ns());
        }
        if let Some(f) = &mut file {
            let _ = writeln!(f, "{line}");
        }
    }
}

/// CLOCK_MONOTONIC in ns: the clock husk-vmm's timeline reports in, so
/// the bench's points and the VMM's marks fall on one axis.
pub fn monotonic_ns() -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .unwrap_or_else(|_| nix::sys::time::TimeSpec::new(0, 0));
    now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64
}

/// Runs the bench; `progress` hears what happens as it happens.
pub fn run(config: &BenchConfig, progress: &mut dyn FnMut(&str)) -> Result<Report, BenchError> {
    for path in [&config.vmm, &config.kernel, &config.initramfs] {
        if !path.exists() {
            return Err(BenchError::Missing(path.clone()));
        }
    }
    std::fs::create_dir_all(&config.work_dir).map_err(BenchError::Io)?;
    let mut labels = labels(config);
    let mut husk_cold = Series::new(
        "husk",
        "cold_boot",
        "husk-vmm boots the guest; spawn to the first output of an exec through the agent",
    );
    let mut husk_restore = Series::new(
        "husk",
        "restore",
        "husk-vmm restores a snapshot of a booted guest; spawn to the first output of an exec \
         through the agent",
    );
    let mut pooled = match &config.husk {
        Some(_) => Series::new(
            "husk",
            "pooled_create",
            "a private husk daemon hands out a parked clone of its template; POST /v1/sandboxes \
             to the first output of an exec through the API",
        ),
        None => Series::skipped("husk", "pooled_create", "no pooled runs asked for"),
    };
    let qemu_firmware = match &config.qemu {
        Ok(binary) if qemu::machine_args(binary).iter().any(|a| a == "qboot.rom") => "qboot",
        _ => "SeaBIOS and its option ROMs",
    };
    let (mut qemu_cold, mut qemu_restore) = peer_series(
        "qemu",
        &config.qemu,
        &format!(
            "-M microvm ({qemu_firmware}), same kernel, initramfs and command line; spawn to \
             guest-init's readiness line (no agent: QEMU would need vhost-vsock)"
        ),
        "-incoming from a migration file of a booted guest; spawn to QMP `running` (no guest \
         phase: no agent)",
    );
    let (mut fc_cold, mut fc_restore) = peer_series(
        "firecracker",
        &config.firecracker,
        "same kernel, initramfs and command line, configured through its API; spawn to the \
         first output of an exec through the agent on its vsock",
        "PUT /snapshot/load (resume_vm) of a full snapshot of a booted guest; spawn to the \
         first output of an exec through the agent on its vsock",
    );

    // The daemon first: its template build is a boot that no run counts.
    let daemon = match &config.husk {
        Some(husk) => {
            match pooled::start(config, husk, &pooled::state_dir(&config.work_dir), progress) {
                Ok(d) => Some(d),
                Err(e) => {
                    pooled.failures.push(e.to_string());
                    None
                }
            }
        }
        None => None,
    };

    let snapshot_dir = config.work_dir.join("snapshot");
    let mut snapshot: Option<Instant> = None;
    let qemu_file = config.work_dir.join("qemu.migration");
    let mut qemu_snapshot: Option<Instant> = None;
    let mut fc_snapshot: Option<Instant> = None;
    let n = config.iterations;
    for i in 0..n {
        let tag = format!("run {}/{n}", i + 1);
        // Cold boots in the first runs only; a failed one is tried again
        // in the next run while no snapshot exists to restore.
        let cold = i < config.cold_boots.max(1);
        if cold || snapshot.is_none() {
            progress(&format!("{tag}: husk cold boot"));
            let snapshot_to = snapshot.is_none().then_some(snapshot_dir.as_path());
            match husk_cold_run(config, i, snapshot_to) {
                Ok((sample, taken, clocksource)) => {
                    report_run(progress, &tag, &husk_cold, &sample);
                    husk_cold.samples.push(sample);
                    snapshot = snapshot.or(taken);
                    labels.guest_clocksource = labels.guest_clocksource.take().or(clocksource);
                }
                Err(e) => fail(progress, &mut husk_cold, &tag, e),
            }
        }
        if let Some(taken) = snapshot {
            progress(&format!("{tag}: husk restore"));
            match husk_restore_run(config, i, (&snapshot_dir, taken)) {
                Ok(sample) => {
                    report_run(progress, &tag, &husk_restore, &sample);
                    husk_restore.samples.push(sample);
                }
                Err(e) => fail(progress, &mut husk_restore, &tag, e),
            }
        }
        if let Some(daemon) = &daemon {
            progress(&format!("{tag}: husk pooled create"));
            match daemon.run(i, config.restore_budget) {
                Ok(sample) => {
                    report_run(progress, &tag, &pooled, &sample);
                    pooled.samples.push(sample);
                }
                Err(e) => fail(progress, &mut pooled, &tag, e),
            }
        }
        if let Ok(binary) = &config.qemu {
            if cold || qemu_snapshot.is_none() {
                progress(&format!("{tag}: qemu cold boot"));
                let migrate_to = qemu_snapshot.is_none().then_some(qemu_file.as_path());
                match qemu::cold_boot(config, binary, i, migrate_to) {
                    Ok(sample) => {
                        report_run(progress, &tag, &qemu_cold, &sample);
                        qemu_cold.samples.push(sample);
                        if migrate_to.is_some() {
                            qemu_snapshot = Some(Instant::now());
                        }
                    }
                    Err(e) => fail(progress, &mut qemu_cold, &tag, e),
                }
            }
            if let Some(taken) = qemu_snapshot {
                progress(&format!("{tag}: qemu restore"));
                match qemu::restore(config, binary, i, (&qemu_file, taken)) {
                    Ok(sample) => {
                        report_run(progress, &tag, &qemu_restore, &sample);
                        qemu_restore.samples.push(sample);
                    }
                    Err(e) => fail(progress, &mut qemu_restore, &tag, e),
                }
            }
        }
        if let Ok(binary) = &config.firecracker {
            if cold || fc_snapshot.is_none() {
                progress(&format!("{tag}: firecracker cold boot"));
                let snapshot = fc_snapshot.is_none();
                match firecracker::cold_boot(config, binary, i, snapshot) {
                    Ok(sample) => {
                        report_run(progress, &tag, &fc_cold, &sample);
                        fc_cold.samples.push(sample);
                        if snapshot {
                            fc_snapshot = Some(Instant::now());
                        }
                    }
                    Err(e) => fail(progress, &mut fc_cold, &tag, e),
                }
            }
            if let Some(taken) = fc_snapshot {
                progress(&format!("{tag}: firecracker restore"));
                match firecracker::restore(config, binary, i, taken) {
                    Ok(sample) => {
                        report_run(progress, &tag, &fc_restore, &sample);
                        fc_restore.samples.push(sample);
                    }
                    Err(e) => fail(progress, &mut fc_restore, &tag, e),
                }
            }
        }
    }
    let parked = match (&daemon, config.parked) {
        (Some(daemon), n) if n > 0 => {
            progress(&format!("husk: {n} clones parked in the warm pool at once"));
            match daemon.park(n, config.restore_budget * n as u32) {
                Ok(p) => Some(p),
                Err(e) => {
                    progress(&format!("husk parked clones: FAILED: {e}"));
                    None
                }
            }
        }
        _ => None,
    };
    drop(daemon);
    if snapshot.is_none() {
        husk_restore
            .failures
            .push("no snapshot: no husk cold boot finished".into());
    }

    let mut clones = Vec::new();
    if config.clones > 0 && snapshot.is_some() {
        progress(&format!(
            "husk: {} clones of the snapshot at once",
            config.clones
        ));
        match husk_clones(config, &snapshot_dir) {
            Ok(c) => clones.push(c),
            Err(e) => progress(&format!("husk clones: FAILED: {e}")),
        }
    }

    let mut series = vec![
        husk_cold,
        husk_restore,
        pooled,
        qemu_cold,
        qemu_restore,
        fc_cold,
        fc_restore,
    ];
    for s in &mut series {
        s.summarize();
    }
    let mut report = Report {
        schema: SCHEMA.to_owned(),
        labels,
        series,
        clones,
        ratios: Vec::new(),
        parked,
        targets: Vec::new(),
    };
    report.compute_ratios();
    report.compute_targets();
    Ok(report)
}

/// A peer's cold boot and restore series: notes after its version line,
/// or skipped for the reason its binary is missing.
fn peer_series(
    contender: &str,
    binary: &Result<PathBuf, String>,
    cold: &str,
    restore: &str,
) -> (Series, Series) {
    match binary {
        Ok(b) => {
            let v = version_line(b);
            (
                Series::new(contender, "cold_boot", format!("{v}, {cold}")),
                Series::new(contender, "restore", format!("{v}, {restore}")),
            )
        }
        Err(why) => (
            Series::skipped(contender, "cold_boot", why.clone()),
            Series::skipped(contender, "restore", why.clone()),
        ),
    }
}

/// The first line `binary --version` prints (empty if it prints none).
pub fn version_line(binary: &Path) -> String {
    std::process::Command::new(binary)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_owned)
        })
        .unwrap_or_default()
}

fn report_run(progress: &mut dyn FnMut(&str), tag: &str, series: &Series, sample: &Sample) {
    let phases: Vec<String> = sample
        .phases
        .iter()
        .map(|p| format!("{} {:.1}", p.name, p.ms))
        .collect();
    progress(&format!(
        "{tag}: {} {}: {:.1} ms ({})",
        series.contender,
        series.mode,
        sample.total_ms,
        phases.join(", ")
    ));
}

fn fail(progress: &mut dyn FnMut(&str), series: &mut Series, tag: &str, error: String) {
    progress(&format!(
        "{tag}: {} {}: FAILED: {error}",
        series.contender, series.mode
    ));
    series.failures.push(format!("{tag}: {error}"));
}

/// One husk cold boot; with `snapshot_to`, the guest is snapshotted there
/// after its exec (when it was taken is returned), and the guest's
/// clocksource read.
fn husk_cold_run(
    config: &BenchConfig,
    iteration: usize,
    snapshot_to: Option<&Path>,
) -> Result<(Sample, Option<Instant>, Option<String>), String> {
    let mut vmm = Vmm::spawn(config, &config.work_dir, &format!("cold{iteration}"), None)
        .map_err(|e| e.to_string())?;
    let spawned = vmm.spawned_ns();
    let (answered, mut client) = husk_vm::answer(&mut vmm, config.boot_budget)?;
    let clocksource = husk_vm::clocksource(&mut client);
    let mut taken = None;
    if let Some(dir) = snapshot_to {
        // The guest's clock from the host's, so that a restore's clock
        // offset says what the restore did to it.
        client
            .set_clock(std::time::SystemTime::now())
            .map_err(|e| format!("set the guest clock: {e}"))?;
        drop(client);
        let request = Request::Snapshot {
            dir: dir.to_owned(),
            diff: false,
            keep_base: false,
        };
        match husk_vmm_api::call(&vmm.api, &request, config.restore_budget) {
            Ok(Reply::Snapshot { .. }) => taken = Some(Instant::now()),
            Ok(other) => return Err(format!("snapshot: unexpected reply {other:?}")),
            Err(e) => return Err(format!("snapshot: {e}")),
        }
    } else {
        drop(client);
    }
    let timeline = vmm.stop()?;
    let sample = husk_vm::sample(iteration, spawned, &answered, &timeline, None);
    Ok((sample, taken, clocksource))
}

/// One husk restore of `snapshot` (its directory and when it was taken).
fn husk_restore_run(
    config: &BenchConfig,
    iteration: usize,
    snapshot: (&Path, Instant),
) -> Result<Sample, String> {
    let (dir, taken) = snapshot;
    let age = taken.elapsed().as_secs_f64();
    let name = format!("restore{iteration}");
    let mut vmm =
        Vmm::spawn(config, &config.work_dir, &name, Some(dir)).map_err(|e| e.to_string())?;
    let spawned = vmm.spawned_ns();
    let (answered, mut client) = husk_vm::answer(&mut vmm, config.restore_budget)?;
    let offset = husk_vm::clock_offset_ms(&mut client);
    drop(client);
    let timeline = vmm.stop()?;
    Ok(husk_vm::sample(
        iteration,
        spawned,
        &answered,
        &timeline,
        Some((age, offset)),
    ))
}

/// `config.clones` restores of the snapshot alive at once, each answering:
/// what they take together.
fn husk_clones(config: &BenchConfig, snapshot: &Path) -> Result<Clones, String> {
    let mut vmms = Vec::new();
    for k in 0..config.clones {
        let vmm = Vmm::spawn(
            config,
            &config.work_dir,
            &format!("clone{k}"),
            Some(snapshot),
        )
        .map_err(|e| e.to_string())?;
        vmms.push(vmm);
    }
    // Each clone answers once (its agent's pages are then resident).
    let mut clients = Vec::new();
    for vmm in &mut vmms {
        let mut client = vmm.connect(config.restore_budget)?;
        client.ping().map_err(|e| format!("ping: {e}"))?;
        clients.push(client);
    }
    let per_clone: Vec<Memory> = vmms
        .iter()
        .map(|v| Memory::of(v.pid()).ok_or("a clone exited".to_owned()))
        .collect::<Result<_, _>>()?;
    Ok(Clones {
        contender: "husk".into(),
        count: per_clone.len(),
        pss_total_kib: per_clone.iter().map(|m| m.pss_kib).sum(),
        rss_total_kib: per_clone.iter().map(|m| m.rss_kib).sum(),
        per_clone,
    })
}

/// What the numbers were measured on.
fn labels(config: &BenchConfig) -> Labels {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|v| v.split_once(':'))
        .map_or("unknown".to_owned(), |(_, v)| v.trim().to_owned());
    let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
    let pvm = husk_vmm_api::cmdline::is_pvm_host();
    Labels {
        cpu_model,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        kvm: if pvm { "pvm" } else { "hardware" }.to_owned(),
        host_kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_owned(),
        guest_kernel: config.kernel.display().to_string(),
        guest_kernel_bytes: size(&config.kernel),
        initramfs: config.initramfs.display().to_string(),
        initramfs_bytes: size(&config.initramfs),
        guest_mem_mib: config.mem_mib,
        guest_vcpus: config.vcpus,
        guest_clocksource: None,
        husk_version: env!("CARGO_PKG_VERSION").to_owned(),
        commit: env!("HUSK_COMMIT").to_owned(),
        started_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        iterations: config.iterations,
        warning: pvm.then(|| {
            "this host's KVM is PVM: the guest kernel runs through an instruction emulator, \
             about 1000x slower than hardware KVM. Guest phases measured here say nothing about \
             hardware; host phases do."
                .to_owned()
        }),
    }
}
