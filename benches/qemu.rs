//! The same guest under QEMU (microvm machine, KVM), snapshotted with
//! migration to a file and restored with `-incoming`: the comparison the
//! snapshot benchmark prints next to husk's numbers. Skipped when
//! `qemu-system-x86_64` is not installed.
//!
//! QEMU keeps a stopped source stopped on the destination, so a restore is:
//! spawn, load the migration stream into anonymous memory, `cont`. The
//! time reported is from spawn until QMP says `running` (QEMU has no
//! equivalent of husk's in-guest agent without vhost-vsock, which this host
//! lacks, so there is no guest-side number).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const BINARY: &str = "qemu-system-x86_64";

/// Whether QEMU is installed.
pub fn available() -> bool {
    Command::new(BINARY)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A QMP connection: one JSON object per line, events skipped.
struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    /// Connects once the socket accepts, before `deadline`.
    fn connect(path: &Path, deadline: Instant) -> Qmp {
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => panic!("QMP {}: {e}", path.display()),
                Err(_) => std::thread::sleep(Duration::from_micros(200)),
            }
        };
        let mut qmp = Qmp {
            reader: BufReader::new(stream.try_clone().expect("clone")),
            writer: stream,
        };
        qmp.read(); // greeting
        qmp.cmd("qmp_capabilities", json!({}));
        qmp
    }

    fn read(&mut self) -> Value {
        loop {
            let mut line = String::new();
            let n = self.reader.read_line(&mut line).expect("QMP read");
            assert!(n > 0, "QEMU closed its QMP socket");
            let value: Value = serde_json::from_str(&line).expect("QMP JSON");
            if value.get("event").is_none() {
                return value;
            }
        }
    }

    fn cmd(&mut self, execute: &str, arguments: Value) -> Value {
        let request = json!({ "execute": execute, "arguments": arguments });
        writeln!(self.writer, "{request}").expect("QMP write");
        let reply = self.read();
        assert!(reply.get("error").is_none(), "QMP {execute}: {reply}");
        reply["return"].clone()
    }

    /// Polls `query-migrate` until the migration completes.
    fn wait_migration(&mut self) {
        loop {
            let status = self.cmd("query-migrate", json!({}));
            match status["status"].as_str() {
                Some("completed") => return,
                Some("failed" | "cancelled") => panic!("QEMU migration: {status}"),
                _ => std::thread::sleep(Duration::from_micros(500)),
            }
        }
    }
}

/// A QEMU process, killed when dropped.
struct Qemu {
    child: Child,
    qmp_path: PathBuf,
}

impl Drop for Qemu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.qmp_path);
    }
}

/// QEMU with the husk guest (same kernel, initramfs and command line),
/// `extra` arguments appended.
fn spawn(dir: &Path, name: &str, mem_mib: u32, extra: &[&str]) -> Qemu {
    let qmp_path = dir.join(format!("{name}.qmp"));
    let mut cmdline = husk_vmm::config::BASE_CMDLINE.to_owned();
    if husk_vmm::vstate::kvm::is_pvm_host() {
        cmdline = format!("{cmdline} {}", husk_vmm::config::PVM_CMDLINE);
    }
    let child = Command::new(BINARY)
        .args(husk_bench::qemu::machine_args(Path::new(BINARY)))
        .args(["-enable-kvm", "-cpu", husk_bench::qemu::cpu_model()])
        .args(["-smp", "1"])
        .args(["-m", &mem_mib.to_string()])
        .arg("-kernel")
        .arg(super::common::kernel())
        .arg("-initrd")
        .arg(super::common::initramfs())
        .args(["-append", &cmdline])
        .args(["-nodefaults", "-no-user-config", "-display", "none"])
        .arg("-serial")
        .arg(format!(
            "file:{}",
            dir.join(format!("{name}.console")).display()
        ))
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", qmp_path.display()))
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn QEMU");
    Qemu { child, qmp_path }
}

/// A QEMU restoring the migration stream `incoming`, returned once the
/// stream is loaded (the guest is still stopped).
fn restore(dir: &Path, name: &str, mem_mib: u32, incoming: &str) -> (Qemu, Qmp) {
    let qemu = spawn(dir, name, mem_mib, &["-incoming", incoming]);
    let mut qmp = Qmp::connect(&qemu.qmp_path, Instant::now() + super::TIMEOUT);
    qmp.wait_migration();
    (qemu, qmp)
}

/// Boots QEMU, snapshots it to a file, restores it `restores` times, then
/// keeps 10 restored clones alive to read their memory.
pub fn bench(mem_mib: u32, restores: usize, dir: &Path) {
    let console = dir.join("qemu-base.console");
    let base = spawn(dir, "qemu-base", mem_mib, &[]);
    let deadline = Instant::now() + super::common::BOOT_TIMEOUT;
    let mut qmp = Qmp::connect(&base.qmp_path, deadline);
    while !std::fs::read_to_string(&console)
        .unwrap_or_default()
        .contains("husk-guest-init: ready")
    {
        assert!(Instant::now() < deadline, "the QEMU guest never booted");
        std::thread::sleep(Duration::from_millis(100));
    }
    let state = dir.join("qemu.mig");
    let started = Instant::now();
    qmp.cmd("stop", json!({}));
    let uri = format!("exec:cat > {}", state.display());
    qmp.cmd("migrate", json!({ "uri": uri }));
    qmp.wait_migration();
    std::fs::File::open(&state)
        .and_then(|f| f.sync_all())
        .expect("sync the migration file");
    let write = started.elapsed();
    drop(base);
    let bytes = std::fs::metadata(&state).map_or(0, |m| m.len());

    let incoming = format!("exec:cat {}", state.display());
    let mut loaded = Vec::new();
    let mut running = Vec::new();
    for i in 0..restores {
        let started = Instant::now();
        let (_qemu, mut qmp) = restore(dir, &format!("qemu-r{i}"), mem_mib, &incoming);
        loaded.push(started.elapsed().as_secs_f64() * 1000.0);
        qmp.cmd("cont", json!({}));
        while qmp.cmd("query-status", json!({}))["status"] != "running" {
            std::thread::sleep(Duration::from_micros(200));
        }
        running.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    println!(
        "  QEMU {} (microvm, same guest): snapshot (stop + migrate to a file + fsync) {:.1} ms, {:.1} MiB file",
        qemu_version(),
        write.as_secs_f64() * 1000.0,
        bytes as f64 / f64::from(1 << 20)
    );
    println!("    QEMU restore, {restores} runs (ms)      p50       p99");
    for (name, samples) in [("migration loaded", &loaded), ("running (cont)", &running)] {
        println!(
            "      spawn -> {name:<17} {:>8.1} {:>9.1}",
            super::percentile(samples, 0.5),
            super::percentile(samples, 0.99)
        );
    }

    let clones: Vec<Qemu> = (0..10)
        .map(|i| {
            let (qemu, mut qmp) = restore(dir, &format!("qemu-c{i}"), mem_mib, &incoming);
            qmp.cmd("cont", json!({}));
            qemu
        })
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    let pids: Vec<u32> = clones.iter().map(|q| q.child.id()).collect();
    print!("    QEMU, ");
    super::print_clone_memory("", &pids);
}

fn qemu_version() -> String {
    Command::new(BINARY)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .nth(3)
                .map(str::to_owned)
        })
        .unwrap_or_default()
}
