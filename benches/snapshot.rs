//! Snapshot and restore, measured from the host:
//!
//!     cargo bench --bench snapshot          (HUSK_BENCH_SIZES=128,1024 HUSK_BENCH_RESTORES=20)
//!
//! For each guest size: boot once, take a full snapshot (pause, memory and
//! state write times from the control socket), then restore it N times one
//! after the other. Each restore is split into husk-vmm's own host phases
//! (from its `main`: state loaded, VM created, memory mapped, vCPUs and
//! devices restored, first KVM_RUN) and the end-to-end time from spawning
//! the process to the agent answering a ping (which adds process start and
//! the guest's side: vsock transport reset, page faults, the agent's reply).
//! Then a diff and a full snapshot of a clone that wrote a 1 MiB file
//! (pages and time), and 10 clones at once, whose resident memory is read from
//! /proc/PID/smaps_rollup: shared (the snapshot's page cache) versus
//! private (what each clone wrote).
//!
//! The same run then does the same with QEMU (see qemu.rs; skipped without
//! `qemu-system-x86_64`, or with HUSK_BENCH_QEMU=0): snapshot as migration
//! to a file, restore with `-incoming`, and 10 clones' memory.
//!
//! On an emulating (PVM) host the guest's side of each number is inflated
//! (every page fault and instruction of the guest kernel is emulated); the
//! host phases run at full speed.

#[path = "../tests/common/mod.rs"]
mod common;
mod qemu;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::percentile;
use husk_agent_client::AgentClient;

const TIMEOUT: Duration = Duration::from_secs(120);

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

fn restore(
    snapshot: &Path,
    dir: &Path,
    name: &str,
    timeline: Option<&Path>,
    api: Option<&Path>,
    extra: &[&str],
) -> (Killed, PathBuf) {
    let uds = dir.join(format!("{name}.vsock"));
    let mut cmd = Command::new(common::vmm_binary());
    cmd.arg("--restore")
        .arg(snapshot)
        .args(["--id", name, "--serial", "null"])
        .arg("--vsock")
        .arg(format!("cid=5,path={}", uds.display()));
    if let Some(t) = timeline {
        cmd.arg("--timeline").arg(t);
    }
    if let Some(api) = api {
        cmd.arg("--api-sock").arg(api);
    }
    let child = cmd
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("husk-vmm --restore");
    (Killed(child), uds)
}

/// Disk space a (sparse) file takes, in MiB.
fn allocated_mib(path: &Path) -> f64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map_or(0.0, |m| (m.blocks() * 512) as f64 / f64::from(1 << 20))
}

fn smaps_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Prints the mean resident memory of the clones `pids`, split into
/// shared and private pages.
fn print_clone_memory(indent: &str, pids: &[u32]) {
    let mean =
        |field: &str| pids.iter().map(|&p| smaps_kib(p, field)).sum::<u64>() / pids.len() as u64;
    println!(
        "{indent}{} clones alive, per clone: RSS {} KiB = shared {} KiB + private {} KiB (PSS {} KiB)",
        pids.len(),
        mean("Rss:"),
        mean("Shared_Clean:") + mean("Shared_Dirty:"),
        mean("Private_Clean:") + mean("Private_Dirty:"),
        mean("Pss:"),
    );
}

fn bench_size(mem_mib: u32, restores: usize) {
    let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
    let d = dir.as_path();
    let uds = d.join("base.vsock");
    let api = d.join("base.api");
    let mem = mem_mib.to_string();
    let base = Killed(
        common::agent_guest_command(&uds, &api, &["--mem-mib", &mem])
            .spawn()
            .expect("husk-vmm"),
    );
    let mut client =
        AgentClient::connect_when_ready(&uds, common::BOOT_TIMEOUT, TIMEOUT).expect("agent");
    client.ping().expect("ping");
    drop(client);
    let snapshot = d.join("snap");
    let reply = common::snapshot(&api, &snapshot, false).expect("snapshot");
    drop(base);
    println!("\n{mem_mib} MiB guest");
    println!(
        "  snapshot memory file: {:.1} MiB on disk of {mem_mib} MiB (all-zero pages are holes)",
        allocated_mib(&snapshot.join("memory"))
    );
    println!(
        "  snapshot: pause {:.2} ms, memory write {:.1} ms, state write {:.2} ms ({} bytes), total {:.1} ms",
        reply.pause_us as f64 / 1000.0,
        reply.memory_write_us as f64 / 1000.0,
        reply.state_write_us as f64 / 1000.0,
        reply.state_bytes,
        reply.total_us as f64 / 1000.0,
    );

    let phases = [
        "state_loaded",
        "vm_created",
        "memory_ready",
        "vcpus_ready",
        "first_kvm_run",
    ];
    let mut host: Vec<Vec<f64>> = vec![Vec::new(); phases.len()];
    let mut end_to_end = Vec::new();
    let (mut to_main_ms, mut spawn_to_run) = (Vec::new(), Vec::new());
    for i in 0..restores {
        let timeline = d.join(format!("r{i}.json"));
        let started = Instant::now();
        let spawned_ns = husk_vmm::timeline::monotonic_ns();
        let (vmm, uds) = restore(&snapshot, d, &format!("r{i}"), Some(&timeline), None, &[]);
        while !uds.exists() {
            std::thread::sleep(Duration::from_micros(200));
        }
        let mut client =
            AgentClient::connect_when_ready(&uds, TIMEOUT, TIMEOUT).expect("restored agent");
        client.ping().expect("ping");
        end_to_end.push(started.elapsed().as_secs_f64() * 1000.0);
        drop(client);
        drop(vmm);
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&timeline).expect("timeline"))
                .expect("JSON");
        for (k, name) in phases.iter().enumerate() {
            host[k].push(report["phases_us"][name].as_f64().unwrap_or(f64::NAN) / 1000.0);
        }
        let main_ns = report["main_monotonic_ns"].as_u64().unwrap_or(spawned_ns);
        let to_main = main_ns.saturating_sub(spawned_ns) as f64 / 1e6;
        to_main_ms.push(to_main);
        spawn_to_run.push(to_main + host[phases.len() - 1].last().copied().unwrap_or(f64::NAN));
    }
    println!("  restore, {restores} runs (ms)        p50       p99");
    for (k, name) in phases.iter().enumerate() {
        println!(
            "    host  {name:<14}  {:>9.2} {:>9.2}",
            percentile(&host[k], 0.5),
            percentile(&host[k], 0.99)
        );
    }
    println!(
        "    spawn -> main (process start) {:>6.2} {:>9.2}",
        percentile(&to_main_ms, 0.5),
        percentile(&to_main_ms, 0.99)
    );
    println!(
        "    spawn -> first KVM_RUN        {:>6.2} {:>9.2}",
        percentile(&spawn_to_run, 0.5),
        percentile(&spawn_to_run, 0.99)
    );
    println!(
        "    spawn -> agent ping answered {:>7.1} {:>9.1}",
        percentile(&end_to_end, 0.5),
        percentile(&end_to_end, 0.99)
    );

    // A diff snapshot of a clone after a little work: how much it writes.
    {
        let api = d.join("differ.api");
        let (_differ, uds) = restore(&snapshot, d, "differ", None, Some(&api), &["--dirty-log"]);
        let mut client =
            AgentClient::connect_when_ready(&uds, TIMEOUT, TIMEOUT).expect("clone agent");
        client
            .write_file("/tmp/one-mebibyte", 0o644, &vec![7u8; 1 << 20][..])
            .expect("write");
        let diff = common::snapshot(&api, &d.join("diff"), true).expect("diff snapshot");
        println!(
            "  diff snapshot of a clone that wrote a 1 MiB file: {:.1} MiB of pages, memory write {:.1} ms, total {:.1} ms",
            diff.memory_bytes as f64 / f64::from(1 << 20),
            diff.memory_write_us as f64 / 1000.0,
            diff.total_us as f64 / 1000.0,
        );
        let full = common::snapshot(&api, &d.join("full"), false).expect("full snapshot");
        println!(
            "  full snapshot of that clone: memory write {:.1} ms, {:.1} MiB on disk, total {:.1} ms",
            full.memory_write_us as f64 / 1000.0,
            allocated_mib(&d.join("full").join("memory")),
            full.total_us as f64 / 1000.0,
        );
    }

    // What a hibernation's checksum costs (issue 41): a clone that wrote
    // half its memory, diff-snapshotted as the daemon hibernates; the wake
    // verifies the diff's pages against the CRC-64 written with them
    // (husk-vmm --restore --verify), timed here from the page cache (the
    // wake right after) and cold. The hibernation computes the same CRC
    // over the same bytes as it writes them: at most the warm figure.
    {
        let half = mem_mib / 2;
        let api = d.join("half.api");
        let (_half, uds) = restore(&snapshot, d, "half", None, Some(&api), &["--dirty-log"]);
        let mut client =
            AgentClient::connect_when_ready(&uds, TIMEOUT, TIMEOUT).expect("clone agent");
        let write = husk_protocol::ExecRequest {
            argv: [
                "/bin/sh".to_owned(),
                "-c".to_owned(),
                format!("dd if=/dev/zero of=/tmp/half bs=1M count={half} 2>/dev/null"),
            ]
            .to_vec(),
            ..Default::default()
        };
        client.exec(write).expect("write half the memory");
        let dir = d.join("half-diff");
        let diff = common::snapshot(&api, &dir, true).expect("diff snapshot");
        let restorable = husk_vmm::persist::read(&dir).expect("the diff reads back");
        let verify = |cold: bool| {
            if cold {
                let _ = std::fs::write("/proc/sys/vm/drop_caches", "3");
            }
            let started = Instant::now();
            husk_vmm::persist::verify_memory(&dir, &restorable).expect("the diff verifies");
            started.elapsed().as_secs_f64() * 1000.0
        };
        let warm: Vec<f64> = (0..5).map(|_| verify(false)).collect();
        // Dropping the page cache needs root; elsewhere the cold runs are warm.
        let cold: Vec<f64> = (0..3).map(|_| verify(true)).collect();
        println!(
            "  hibernation checksum, a clone that wrote {half} MiB: diff {:.1} MiB written in {:.1} ms \
             (CRC included); verifying it at wake p50 {:.1} ms from the page cache, {:.1} ms cold",
            diff.memory_bytes as f64 / f64::from(1 << 20),
            diff.memory_write_us as f64 / 1000.0,
            percentile(&warm, 0.5),
            percentile(&cold, 0.5),
        );
    }

    // What dirty page tracking costs a clone that writes: the same writes
    // in a clone with it and one restored without it (the default).
    for (label, extra) in [("on", &["--dirty-log"][..]), ("off", &[][..])] {
        let (_clone, uds) = restore(&snapshot, d, &format!("dirty-{label}"), None, None, extra);
        while !uds.exists() {
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut client =
            AgentClient::connect_when_ready(&uds, TIMEOUT, TIMEOUT).expect("clone agent");
        let write = husk_protocol::ExecRequest {
            argv: [
                "/bin/sh",
                "-c",
                "dd if=/dev/zero of=/tmp/w bs=1M count=8 2>/dev/null; rm /tmp/w",
            ]
            .map(String::from)
            .to_vec(),
            ..Default::default()
        };
        let mut times = Vec::new();
        for _ in 0..3 {
            let started = Instant::now();
            client.exec(write.clone()).expect("exec");
            times.push(started.elapsed().as_secs_f64() * 1000.0);
        }
        println!(
            "  clone writing 8 MiB to tmpfs (3 runs), dirty tracking {label}: p50 {:.0} ms, min {:.0} ms",
            percentile(&times, 0.5),
            percentile(&times, 0.0)
        );
    }

    // Ten clones at once: what each costs in memory.
    let clones: Vec<_> = (0..10)
        .map(|i| restore(&snapshot, d, &format!("c{i}"), None, None, &[]))
        .collect();
    for (_, uds) in &clones {
        while !uds.exists() {
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut client =
            AgentClient::connect_when_ready(uds, TIMEOUT, TIMEOUT).expect("clone agent");
        client.ping().expect("ping");
    }
    let pids: Vec<u32> = clones.iter().map(|(k, _)| k.0.id()).collect();
    print_clone_memory("  ", &pids);
    drop(clones);

    if std::env::var("HUSK_BENCH_QEMU").as_deref() != Ok("0") {
        if qemu::available() {
            qemu::bench(mem_mib, restores, d);
        } else {
            println!("  QEMU: qemu-system-x86_64 is not installed; no comparison");
        }
    }
}

fn main() {
    let sizes: Vec<u32> = std::env::var("HUSK_BENCH_SIZES")
        .unwrap_or_else(|_| "128,1024".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let restores: usize = std::env::var("HUSK_BENCH_RESTORES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let start = Instant::now();
    let version = Command::new(common::vmm_binary())
        .arg("--version")
        .output()
        .expect("husk-vmm --version");
    assert!(version.status.success());
    println!(
        "process start baseline: spawn + exit of `husk-vmm --version` {:.2} ms",
        start.elapsed().as_secs_f64() * 1000.0
    );
    for size in sizes {
        bench_size(size, restores);
    }
}
