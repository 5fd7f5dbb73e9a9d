//! The same guest under QEMU's `microvm` machine (KVM): the same kernel,
//! initramfs and command line as husk-vmm gives it. A cold boot starts
//! stopped (`-S`) so that QEMU's own start-up is timed apart from the
//! guest's boot; a snapshot is a migration to a file, and a restore is
//! `-incoming` from it, then `cont`.
//!
//! QEMU reaches an in-guest agent only through vhost-vsock (AF_VSOCK on
//! the host), so its runs end at guest-init's readiness line (cold boot)
//! and at QMP's `running` (restore): there is no exec and no guest phase
//! after a restore.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::report::{Memory, Sample, Side};
use super::{monotonic_ns, watch_console, BenchConfig};

/// The QEMU binary to use: `binary`, else `qemu-system-x86_64` on `$PATH`;
/// why not, when it does not run (the bench then skips QEMU).
pub fn probe(binary: Option<&Path>) -> Result<PathBuf, String> {
    let binary = binary.map_or_else(|| PathBuf::from("qemu-system-x86_64"), Path::to_owned);
    match Command::new(&binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(s) if s.success() => Ok(binary),
        Ok(s) => Err(format!("{} --version failed ({s})", binary.display())),
        Err(e) => Err(format!(
            "{} cannot be run ({e}); Debian has it in qemu-system-x86",
            binary.display()
        )),
    }
}

/// QEMU's `-cpu`: the host's CPU; on a PVM host without
/// IA32_ARCH_CAPABILITIES, which QEMU 7.2 fails to set there ("failed to
/// set MSR 0x10a", an assertion, exit).
pub fn cpu_model() -> &'static str {
    if husk_vmm_api::cmdline::is_pvm_host() {
        "host,-arch-capabilities"
    } else {
        "host"
    }
}

/// QEMU's `-M` for the husk guest, and its firmware: qboot where QEMU has
/// it (`qboot.rom` in a directory of `binary -L help`). qboot jumps to the
/// kernel's PVH entry itself, so no option ROM runs; it is what Debian's
/// QEMU 7.2 calls `bios-microvm.bin`. QEMU 8 and later (Debian 13,
/// bookworm-backports) default microvm to SeaBIOS, which boots `-kernel`
/// only through an option ROM: without them it never leaves the BIOS, and
/// with them it spends seconds more in emulated real mode on a PVM host.
/// Without qboot, SeaBIOS and its option ROMs.
pub fn machine_args(binary: &Path) -> Vec<String> {
    let qboot = Command::new(binary)
        .args(["-L", "help"])
        .stderr(Stdio::null())
        .output()
        .map(|out| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .any(|dir| Path::new(dir.trim()).join("qboot.rom").is_file())
        })
        .unwrap_or(false);
    let machine = "microvm,isa-serial=on,rtc=off";
    if qboot {
        [
            "-M",
            &format!("{machine},x-option-roms=off"),
            "-bios",
            "qboot.rom",
        ]
        .map(str::to_owned)
        .to_vec()
    } else {
        vec!["-M".to_owned(), machine.to_owned()]
    }
}

/// A QMP connection: one JSON object per line, events skipped.
struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    /// Connects once QEMU's socket accepts (it creates it early), before
    /// `deadline`, and leaves capabilities negotiation done.
    fn connect(qemu: &mut Qemu, deadline: Instant) -> Result<Qmp, String> {
        let path = &qemu.qmp;
        let mut backoff = Duration::from_millis(1);
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => {
                    return Err(format!("QMP {}: {e}", path.display()))
                }
                Err(_) if qemu.child.try_wait().ok().flatten().is_some() => {
                    return Err(format!("QEMU exited: {}", qemu.stderr()))
                }
                Err(_) => {
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(100));
                }
            }
        };
        let left = deadline.saturating_duration_since(Instant::now());
        stream
            .set_read_timeout(Some(left.max(Duration::from_secs(1))))
            .map_err(|e| e.to_string())?;
        let mut qmp = Qmp {
            reader: BufReader::new(stream.try_clone().map_err(|e| e.to_string())?),
            writer: stream,
        };
        qmp.read()?; // greeting
        qmp.cmd("qmp_capabilities", json!({}))?;
        Ok(qmp)
    }

    fn read(&mut self) -> Result<Value, String> {
        loop {
            let mut line = String::new();
            let n = self
                .reader
                .read_line(&mut line)
                .map_err(|e| format!("QMP read: {e}"))?;
            if n == 0 {
                return Err("QEMU closed its QMP socket".into());
            }
            let value: Value = serde_json::from_str(&line).map_err(|e| format!("QMP: {e}"))?;
            if value.get("event").is_none() {
                return Ok(value);
            }
        }
    }

    fn cmd(&mut self, execute: &str, arguments: Value) -> Result<Value, String> {
        let request = json!({ "execute": execute, "arguments": arguments });
        writeln!(self.writer, "{request}").map_err(|e| format!("QMP write: {e}"))?;
        let reply = self.read()?;
        match reply.get("error") {
            Some(e) => Err(format!("QMP {execute}: {e}")),
            None => Ok(reply["return"].clone()),
        }
    }

    /// Waits for a migration (out or in) to complete, polling every 5 ms.
    fn wait_migration(&mut self, deadline: Instant) -> Result<(), String> {
        loop {
            let status = self.cmd("query-migrate", json!({}))?;
            match status["status"].as_str() {
                Some("completed") => return Ok(()),
                Some("failed" | "cancelled") => return Err(format!("migration: {status}")),
                _ if Instant::now() > deadline => return Err("migration timed out".into()),
                _ => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    /// Resumes the guest and waits until QEMU says it runs.
    fn cont(&mut self, deadline: Instant) -> Result<(), String> {
        self.cmd("cont", json!({}))?;
        while self.cmd("query-status", json!({}))?["status"] != "running" {
            if Instant::now() > deadline {
                return Err("QEMU did not resume".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }
}

/// A QEMU process, killed when dropped.
struct Qemu {
    child: Child,
    qmp: PathBuf,
    spawned_ns: u64,
    /// When the console showed the readiness line (cold boots).
    ready: Option<mpsc::Receiver<u64>>,
}

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.qmp);
    }
}

impl Qemu {
    /// QEMU with the husk guest, stopped (`-S`) or restoring `incoming`.
    fn spawn(
        config: &BenchConfig,
        binary: &Path,
        qmp: PathBuf,
        incoming: Option<&Path>,
    ) -> Result<Qemu, String> {
        let cmdline = husk_vmm_api::cmdline::guest_cmdline();
        let mut cmd = Command::new(binary);
        cmd.args(machine_args(binary))
            .args(["-enable-kvm", "-cpu", cpu_model()])
            .args(["-smp", &config.vcpus.to_string()])
            .args(["-m", &config.mem_mib.to_string()])
            .arg("-kernel")
            .arg(&config.kernel)
            .arg("-initrd")
            .arg(&config.initramfs)
            .args(["-append", &cmdline])
            .args(["-nodefaults", "-no-user-config", "-display", "none"])
            .args(["-serial", "stdio"])
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", qmp.display()));
        match incoming {
            Some(file) => cmd.args(["-incoming", &format!("exec:cat {}", file.display())]),
            None => cmd.arg("-S"),
        };
        let log = qmp.with_extension("log");
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?);
        let spawned_ns = monotonic_ns();
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", binary.display()))?;
        let (tx, rx) = mpsc::channel();
        if let Some(console) = child.stdout.take() {
            std::thread::spawn(move || watch_console(console, None, &tx));
        }
        Ok(Qemu {
            child,
            qmp,
            spawned_ns,
            ready: Some(rx),
        })
    }

    /// The end of what QEMU wrote on stderr.
    fn stderr(&self) -> String {
        let text = std::fs::read_to_string(self.qmp.with_extension("log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().rev().take(3).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join(" / ")
    }

    fn wait_ready(&mut self, deadline: Instant) -> Result<u64, String> {
        let rx = self.ready.as_ref().ok_or("no console")?;
        rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .map_err(|_| format!("no readiness line on the console: {}", self.stderr()))
    }
}

/// One cold boot: spawn (stopped) to QMP answering is QEMU's start-up and
/// VM setup; `cont` to the readiness line is the guest's boot. With
/// `snapshot`, the booted guest is then stopped and migrated to that file.
pub fn cold_boot(
    config: &BenchConfig,
    binary: &Path,
    iteration: usize,
    snapshot: Option<&Path>,
) -> Result<Sample, String> {
    let deadline = Instant::now() + config.boot_budget;
    let qmp_path = config.work_dir.join(format!("qemu-cold{iteration}.qmp"));
    let mut qemu = Qemu::spawn(config, binary, qmp_path, None)?;
    let mut qmp = Qmp::connect(&mut qemu, deadline)?;
    let setup_ns = monotonic_ns();
    qmp.cont(deadline)?;
    let ready_ns = qemu.wait_ready(deadline)?;
    let memory = Memory::of(qemu.child.id());
    if let Some(file) = snapshot {
        qmp.cmd("stop", json!({}))?;
        let uri = format!("exec:cat > {}", file.display());
        qmp.cmd("migrate", json!({ "uri": uri }))?;
        qmp.wait_migration(Instant::now() + config.boot_budget)?;
    }
    let points = [
        ("process_start_and_vm_setup", Side::Host, Some(setup_ns)),
        ("guest_init_ready", Side::Guest, Some(ready_ns)),
    ];
    Ok(comparable(Sample::from_points(
        iteration,
        qemu.spawned_ns,
        &points,
        memory,
    )))
}

/// QEMU's runs end at the endpoint every contender reaches: their whole
/// span is what ratios compare.
fn comparable(sample: Sample) -> Sample {
    Sample {
        comparable_ms: Some(sample.total_ms),
        ..sample
    }
}

/// One restore of the migration file `snapshot`, to QMP's `running`.
pub fn restore(
    config: &BenchConfig,
    binary: &Path,
    iteration: usize,
    snapshot: (&Path, Instant),
) -> Result<Sample, String> {
    let (file, taken) = snapshot;
    let age = taken.elapsed().as_secs_f64();
    let deadline = Instant::now() + config.restore_budget;
    let qmp_path = config.work_dir.join(format!("qemu-restore{iteration}.qmp"));
    let mut qemu = Qemu::spawn(config, binary, qmp_path, Some(file))?;
    let mut qmp = Qmp::connect(&mut qemu, deadline)?;
    let started_ns = monotonic_ns();
    qmp.wait_migration(deadline)?;
    let loaded_ns = monotonic_ns();
    qmp.cont(deadline)?;
    let running_ns = monotonic_ns();
    let memory = Memory::of(qemu.child.id());
    let points = [
        ("process_start", Side::Host, Some(started_ns)),
        ("state_and_memory_load", Side::Host, Some(loaded_ns)),
        ("resume", Side::Host, Some(running_ns)),
    ];
    Ok(comparable(Sample {
        snapshot_age_s: Some(age),
        ..Sample::from_points(iteration, qemu.spawned_ns, &points, memory)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_binary_is_a_reason_to_skip() {
        let why = probe(Some(Path::new("/nonexistent/qemu-system-x86_64"))).expect_err("missing");

        assert!(
            why.contains("/nonexistent/qemu-system-x86_64 cannot be run"),
            "{why}"
        );
    }
}
