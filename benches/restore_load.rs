//! Restore-to-ready on a quiet and on a busy host, through `husk restore`
//! (the CLI's whole path: spawn, restore, the agent's first answer, the
//! post-restore identity step):
//!
//!     cargo bench --bench restore_load       (HUSK_BENCH_RESTORES=10 HUSK_BENCH_CLONES=20)
//!
//! Boots one 128 MiB guest and snapshots it, then, run by run interleaved:
//! one clone restored on the quiet host, and one restored while two busy
//! loops (`sh -c 'while :; do :; done'`) hold the host's cores. Then the
//! same one clone with KVM dirty logging on and off (husk-vmm
//! `--dirty-log`), and last N clones restored at once (`--clones N`), each
//! reporting when its agent answered and whether it got its identity.
//!
//! `agent_ms` is spawn to the agent's first answer; `ready_ms` adds the
//! post-restore step. Both include the guest's side, which on an emulating
//! (PVM) host is inflated: the host phases of a restore are in `snapshot`.

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{percentile, Load};
use husk_agent_client::AgentClient;

fn summary(label: &str, samples: &[f64]) {
    if samples.is_empty() {
        println!("  {label}: no samples");
        return;
    }
    println!(
        "  {label} (n={}): min {:.0} / p50 {:.0} / p90 {:.0} / max {:.0} ms",
        samples.len(),
        percentile(samples, 0.0),
        percentile(samples, 0.5),
        percentile(samples, 0.9),
        percentile(samples, 1.0)
    );
}

/// One clone line of `husk restore`: (agent_ms, ready_ms, pid).
fn parse_clone(line: &str) -> Option<(f64, f64, u32)> {
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .map(str::to_owned)
    };
    Some((
        field("agent_ms=")?.parse().ok()?,
        field("ready_ms=")?.parse().ok()?,
        field("pid=")?.parse().ok()?,
    ))
}

/// `husk restore --clones n`; returns each clone's (agent_ms, ready_ms)
/// and how many failed. Stops the clones.
fn husk_restore(snapshot: &Path, run_dir: &Path, name: &str, n: u32) -> (Vec<(f64, f64)>, u32) {
    let out = Command::new(common::husk_binary())
        .arg("restore")
        .arg(snapshot)
        .args(["--clones", &n.to_string(), "--name", name])
        .arg("--run-dir")
        .arg(run_dir)
        .env("HUSK_VMM", common::vmm_binary())
        .stdin(Stdio::null())
        .output()
        .expect("husk restore");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut up = Vec::new();
    for (agent, ready, pid) in stdout.lines().filter_map(parse_clone) {
        up.push((agent, ready));
        // SAFETY: signalling a clone this run started.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    }
    let failed = n - up.len() as u32;
    if failed > 0 {
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
    }
    (up, failed)
}

/// Spawn to the agent's first answer of one clone started by husk-vmm.
fn vmm_restore_ms(snapshot: &Path, dir: &Path, name: &str, extra: &[&str]) -> f64 {
    let uds = dir.join(format!("{name}.vsock"));
    let started = Instant::now();
    let vmm = common::Vmm(
        Command::new(common::vmm_binary())
            .arg("--restore")
            .arg(snapshot)
            .args(["--id", name, "--serial", "null"])
            .arg("--vsock")
            .arg(format!("cid=7,path={}", uds.display()))
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("husk-vmm --restore"),
    );
    let mut client =
        AgentClient::connect_when_ready(&uds, Duration::from_secs(120), Duration::from_secs(120))
            .expect("the clone's agent");
    client.ping().expect("ping");
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    drop(vmm);
    ms
}

fn main() {
    let restores: usize = std::env::var("HUSK_BENCH_RESTORES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let clones: u32 = std::env::var("HUSK_BENCH_CLONES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
    let d = dir.as_path();
    let (uds, api) = (d.join("base.vsock"), d.join("base.api"));
    let base = common::Vmm(
        common::agent_guest_command(&uds, &api, &[])
            .stderr(Stdio::null())
            .spawn()
            .expect("husk-vmm"),
    );
    AgentClient::connect_when_ready(&uds, common::BOOT_TIMEOUT, Duration::from_secs(120))
        .expect("the base guest's agent")
        .ping()
        .expect("ping");
    let snapshot = d.join("snapshot");
    common::snapshot(&api, &snapshot, false).expect("snapshot");
    drop(base);

    println!("restore to ready through `husk restore`, one clone at a time, interleaved:");
    let (mut quiet, mut busy) = (Vec::new(), Vec::new());
    let (mut quiet_ready, mut busy_ready) = (Vec::new(), Vec::new());
    let mut failed = 0;
    for i in 0..restores {
        let (up, f) = husk_restore(&snapshot, d, &format!("q{i}"), 1);
        quiet.extend(up.iter().map(|c| c.0));
        quiet_ready.extend(up.iter().map(|c| c.1));
        failed += f;
        let load = Load::start(cores);
        let (up, f) = husk_restore(&snapshot, d, &format!("b{i}"), 1);
        drop(load);
        busy.extend(up.iter().map(|c| c.0));
        busy_ready.extend(up.iter().map(|c| c.1));
        failed += f;
    }
    summary("quiet host, agent_ms", &quiet);
    summary(&format!("{cores} busy loops, agent_ms"), &busy);
    summary("quiet host, ready_ms", &quiet_ready);
    summary(&format!("{cores} busy loops, ready_ms"), &busy_ready);
    if !quiet.is_empty() && !busy.is_empty() {
        println!(
            "  busy / quiet at p50: {:.2}x; restores that failed: {failed}",
            percentile(&busy, 0.5) / percentile(&quiet, 0.5)
        );
    }

    println!("KVM dirty logging at restore (spawn to the agent's answer), interleaved:");
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for i in 0..restores {
        off.push(vmm_restore_ms(&snapshot, d, &format!("off{i}"), &[]));
        on.push(vmm_restore_ms(
            &snapshot,
            d,
            &format!("on{i}"),
            &["--dirty-log"],
        ));
    }
    summary("dirty logging off (default)", &off);
    summary("dirty logging on (--dirty-log)", &on);

    println!("{clones} clones restored at once (`husk restore --clones {clones}`):");
    let started = Instant::now();
    let (up, failed) = husk_restore(&snapshot, d, "many", clones);
    let wall = started.elapsed();
    let agent: Vec<f64> = up.iter().map(|c| c.0).collect();
    let ready: Vec<f64> = up.iter().map(|c| c.1).collect();
    summary("agent_ms", &agent);
    summary("ready_ms (identity given)", &ready);
    println!(
        "  {} of {clones} ready with their identity, {failed} failed, all in {:.1} s",
        up.len(),
        wall.as_secs_f64()
    );
}
