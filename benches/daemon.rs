//! The daemon (`husk serve`) end to end, as a client sees it:
//!
//!     make bench   (or: cargo build --release -p husk-cli -p husk-jailer -p husk-shim && cargo bench --bench daemon)
//!     HUSK_BENCH_CREATES=50 HUSK_BENCH_RESTORES=20 HUSK_BENCH_IDLE=10
//!     HUSK_BENCH_NO_JAIL=1   (the daemon with --no-jail, to see what the
//!                             jail costs; the jail needs root)
//!
//! Starts a daemon, builds a 128 MiB template (one boot), then measures:
//! - pool refill: an empty pool of 4 filled, on a quiet host and with
//!   every core busy;
//! - pooled create: the API call (`POST /v1/sandboxes`) until the daemon
//!   answers with a sandbox that takes an exec (a parked clone resumed:
//!   host work only; its clock is set ahead of its first request), on a
//!   quiet host and with every core busy, and that first exec to its
//!   output;
//! - create without a pool (a restore), and from the exec request to its
//!   first output;
//! - restore to agent answering, on a quiet host and with every core kept
//!   busy, and how many failed;
//! - idle sandboxes' memory (proportional set size of their VMMs, so pages
//!   shared with the snapshot's page cache are split among them), and the
//!   daemon's own.
//!
//! Guest-side steps on an emulating (PVM) host are ~1000x slower than on
//! hardware KVM; the numbers are this host's.

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{env_count, kill_everything_under, percentile, Load};
use husk_client::{ApiClient, Endpoint, Payload};
use husk_types::{Created, ExecEvent, PoolInfo};
use serde_json::{json, Value};

fn summary(label: &str, samples: &[f64]) {
    if samples.is_empty() {
        println!("  {label}: no samples");
        return;
    }
    println!(
        "  {label} (n={}): p50 {:.1} / p99 {:.1} / max {:.1} ms",
        samples.len(),
        percentile(samples, 0.5),
        percentile(samples, 0.99),
        percentile(samples, 1.0)
    );
}

/// Proportional set size, in KiB, of of `pid` and its descendants (a sandbox's pid is its jailer's; the
/// VMM is the jailer's child).
fn pss_kib(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let own: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    let children =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    own + children
        .split_whitespace()
        .filter_map(|c| c.parse::<u32>().ok())
        .map(pss_kib)
        .sum::<u64>()
}

struct Bench {
    api: ApiClient,
    state_dir: PathBuf,
    daemon: Child,
}

impl Drop for Bench {
    fn drop(&mut self) {
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
        kill_everything_under(&self.state_dir);
        let _ = std::fs::remove_dir_all(&self.state_dir);
    }
}

impl Bench {
    fn create(&self, template: &str) -> Result<(Created, f64), String> {
        let t = Instant::now();
        let c: Created = self
            .api
            .call(
                "POST",
                "/v1/sandboxes",
                Some(&json!({ "template": template })),
            )
            .map_err(|e| e.to_string())?;
        Ok((c, t.elapsed().as_secs_f64() * 1000.0))
    }

    fn destroy(&self, id: &str) {
        let _ = self
            .api
            .send("DELETE", &format!("/v1/sandboxes/{id}"), Payload::None);
    }

    fn pool(&self) -> PoolInfo {
        let pools: Vec<PoolInfo> = self.api.call("GET", "/v1/pools", None).expect("pools");
        pools.into_iter().next().expect("a pool")
    }

    /// From the exec request to its first output, in ms.
    fn first_output_ms(&self, id: &str) -> f64 {
        let t = Instant::now();
        let mut resp = self
            .api
            .send(
                "POST",
                &format!("/v1/sandboxes/{id}/exec"),
                Payload::Json(
                    serde_json::to_vec(&json!({ "argv": ["echo", "hi"] })).expect("json"),
                ),
            )
            .expect("exec");
        loop {
            match resp.next_line::<ExecEvent>().expect("event") {
                Some(ExecEvent::Stdout { .. }) => return t.elapsed().as_secs_f64() * 1000.0,
                Some(ExecEvent::Exit { .. } | ExecEvent::Error { .. }) | None => {
                    panic!("exec ended without output")
                }
                Some(_) => {}
            }
        }
    }
}

fn main() {
    let state_dir = std::env::temp_dir().join(format!("husk-bench-daemon-{}", std::process::id()));
    std::fs::create_dir_all(&state_dir).expect("state dir");
    let daemon = Command::new(common::husk_binary())
        .arg("serve")
        .arg("--state-dir")
        .arg(&state_dir)
        .arg("--kernel")
        .arg(common::kernel())
        .arg("--initramfs")
        .arg(common::initramfs())
        .arg("--vmm")
        .arg(common::vmm_binary())
        .args(std::env::var_os("HUSK_BENCH_NO_JAIL").map(|_| "--no-jail"))
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("husk serve");
    let bench = Bench {
        api: ApiClient::new(Endpoint::Unix(state_dir.join("husk.sock")))
            .with_timeout(Duration::from_secs(900)),
        state_dir,
        daemon,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while bench.api.call::<Value>("GET", "/v1/info", None).is_err() {
        assert!(Instant::now() < deadline, "the daemon did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    let info: Value = bench.api.call("GET", "/v1/info", None).expect("info");

    let t = Instant::now();
    let mut resp = bench
        .api
        .send(
            "POST",
            "/v1/templates",
            Payload::Json(br#"{"name":"base","mem_mib":128}"#.to_vec()),
        )
        .expect("template build");
    while let Some(event) = resp.next_line::<Value>().expect("progress") {
        if event["type"] == "error" {
            panic!("template build failed: {}", event["error"]);
        }
    }
    println!(
        "daemon: template build (boot + snapshot + checksums) {:.1} s; cgroups {}; jail {}",
        t.elapsed().as_secs_f64(),
        info["cgroups"],
        info["jail"]
    );

    // Pool refill: from empty to 4 parked clones, quiet, then with every
    // core busy.
    let fill = |label: &str| {
        let t = Instant::now();
        bench
            .api
            .call::<PoolInfo>("PUT", "/v1/pools/base", Some(&json!({ "size": 4 })))
            .expect("pool");
        while bench.pool().ready < 4 {
            assert!(
                t.elapsed() < Duration::from_secs(900),
                "the pool did not fill"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        println!(
            "pool of 4 filled from empty ({label}): {:.0} ms",
            t.elapsed().as_secs_f64() * 1000.0
        );
        bench
            .api
            .call::<PoolInfo>("PUT", "/v1/pools/base", Some(&json!({ "size": 0 })))
            .expect("pool off");
    };
    fill("quiet host");
    {
        let _load = Load::start(std::thread::available_parallelism().map_or(2, |n| n.get()));
        fill("all cores busy");
    }

    // Pooled creates, quiet and with every core busy; each sandbox's first
    // exec (which carries its clock) timed too.
    let creates = env_count("HUSK_BENCH_CREATES", 50);
    let pooled_creates = |label: &str| {
        bench
            .api
            .call::<PoolInfo>("PUT", "/v1/pools/base", Some(&json!({ "size": 4 })))
            .expect("pool");
        let (mut pooled, mut first, mut misses) = (Vec::new(), Vec::new(), 0);
        for _ in 0..creates {
            let deadline = Instant::now() + Duration::from_secs(600);
            while bench.pool().ready == 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let (c, ms) = bench.create("base").expect("pooled create");
            if c.pooled {
                pooled.push(ms);
                first.push(bench.first_output_ms(&c.sandbox.id));
            } else {
                misses += 1;
            }
            bench.destroy(&c.sandbox.id);
        }
        bench
            .api
            .call::<PoolInfo>("PUT", "/v1/pools/base", Some(&json!({ "size": 0 })))
            .expect("pool off");
        println!(
            "pooled create, API call to a sandbox that takes an exec, {label} ({misses} pool misses):"
        );
        summary("pooled create", &pooled);
        summary("its first exec to the first output", &first);
    };
    pooled_creates("quiet host");
    {
        let _load = Load::start(std::thread::available_parallelism().map_or(2, |n| n.get()));
        pooled_creates("all cores busy");
    }

    // Creates without a pool, quiet and busy.
    let restores = env_count("HUSK_BENCH_RESTORES", 20);
    let (mut quiet, mut first_output, mut quiet_failed) = (Vec::new(), Vec::new(), 0);
    for _ in 0..restores {
        match bench.create("base") {
            Ok((c, ms)) => {
                quiet.push(ms);
                first_output.push(bench.first_output_ms(&c.sandbox.id));
                bench.destroy(&c.sandbox.id);
            }
            Err(e) => {
                eprintln!("quiet create failed: {e}");
                quiet_failed += 1;
            }
        }
    }
    let (mut busy, mut busy_failed) = (Vec::new(), 0);
    {
        let _load = Load::start(std::thread::available_parallelism().map_or(2, |n| n.get()));
        for _ in 0..restores {
            match bench.create("base") {
                Ok((c, ms)) => {
                    busy.push(ms);
                    bench.destroy(&c.sandbox.id);
                }
                Err(e) => {
                    eprintln!("busy create failed: {e}");
                    busy_failed += 1;
                }
            }
        }
    }
    println!("create without a pool (restore to agent answering, identity given):");
    summary("quiet host", &quiet);
    summary(&format!("all cores busy ({busy_failed} failed)"), &busy);
    if !quiet.is_empty() && !busy.is_empty() {
        println!(
            "  busy/quiet p50: {:.2}x; quiet failures {quiet_failed}",
            percentile(&busy, 0.5) / percentile(&quiet, 0.5)
        );
    }
    summary("exec request to first output (echo)", &first_output);
    let to_output: Vec<f64> = quiet
        .iter()
        .zip(&first_output)
        .map(|(a, b)| a + b)
        .collect();
    summary("create + exec to first output", &to_output);

    // Idle density.
    let idle = env_count("HUSK_BENCH_IDLE", 10);
    let made: Vec<Created> = (0..idle)
        .map(|_| bench.create("base").expect("idle sandbox").0)
        .collect();
    std::thread::sleep(Duration::from_secs(5));
    let pss: Vec<u64> = made.iter().map(|c| pss_kib(c.sandbox.pid)).collect();
    let total_mib = pss.iter().sum::<u64>() as f64 / 1024.0;
    let per = total_mib / idle as f64;
    println!(
        "idle sandboxes: {idle} use {total_mib:.1} MiB (PSS of their VMMs), {per:.1} MiB each: \
         {:.0} per GiB of host memory; the daemon: {:.1} MiB PSS",
        1024.0 / per,
        pss_kib(bench.daemon.id()) as f64 / 1024.0
    );
    for c in &made {
        bench.destroy(&c.sandbox.id);
    }
}
