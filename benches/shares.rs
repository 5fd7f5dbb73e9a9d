//! Shared directories (virtio-fs) through the daemon, against the files
//! API and a copy, as a client sees them:
//!
//!     cargo build --release -p husk-cli -p husk-jailer && cargo bench --bench shares
//!     HUSK_BENCH_CREATES=20 HUSK_BENCH_FILES=200 (0: the creates alone) HUSK_BENCH_RUNS=3
//!     HUSK_BENCH_NO_JAIL=1   (the daemon with --no-jail; the jail needs root)
//!
//! Starts a daemon with a mount root, builds a 256 MiB template with one
//! empty fs slot (one boot), then measures:
//! - pooled create with a mount against one without (alternating, from a
//!   pool of 2): the API call until the daemon answers with a sandbox that
//!   takes an exec; the difference is the host's part of mounting (the
//!   daemon's detached idmapped mount, the VMM's share request passing
//!   it; the create's audit entry has it); then the create with its first exec
//!   (ahead of which the guest mounts the share) with against without;
//! - a source tree (FILES files of 4 KiB in 10 directories) reaching a
//!   guest program: on the share (the host wrote it; the guest reads every
//!   file where it is) against the files API (its tar uploaded, unpacked in
//!   the guest's tmpfs, every file read);
//! - a walk that stats every file of it (what `git status` does first): on
//!   the share against the guest's tmpfs;
//! - that tree's tar unpacked in the guest: onto the share against tmpfs;
//! - 32 MiB: written by the guest (dd) onto the share against tmpfs; a file
//!   the host wrote read by the guest from the share, against the files
//!   API's download of 32 MiB from the guest.
//!
//! Guest-side steps on an emulating (PVM) host are ~1000x slower than on
//! hardware KVM; the numbers are this host's.

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{env_count, kill_everything_under, percentile};
use husk_client::{ApiClient, Endpoint, Payload};
use husk_types::{AuditEntry, Created, ExecEvent, PoolInfo};
use serde_json::{json, Value};

fn summary(label: &str, samples: &[f64]) {
    if samples.is_empty() {
        println!("  {label}: no samples");
        return;
    }
    println!(
        "  {label} (n={}): p50 {:.1} / min {:.1} / max {:.1} ms",
        samples.len(),
        percentile(samples, 0.5),
        percentile(samples, 0.0),
        percentile(samples, 1.0)
    );
}

/// Where the host side of the share lives, owned by this uid and gid (not
/// root's: a jailed daemon refuses those).
const OWNER: u32 = 4242;

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
    /// A create; its answer and how long it took, in ms.
    fn create(&self, body: &Value) -> (Created, f64) {
        let t = Instant::now();
        let c: Created = self
            .api
            .call("POST", "/v1/sandboxes", Some(body))
            .expect("create");
        (c, t.elapsed().as_secs_f64() * 1000.0)
    }

    fn destroy(&self, id: &str) {
        let _ = self
            .api
            .send("DELETE", &format!("/v1/sandboxes/{id}"), Payload::None);
    }

    fn ready(&self) -> u32 {
        let pools: Vec<PoolInfo> = self.api.call("GET", "/v1/pools", None).expect("pools");
        pools.first().map_or(0, |p| p.ready)
    }

    /// Runs `script` with sh in sandbox `id`: its time in ms; panics unless
    /// it exits 0.
    fn sh(&self, id: &str, script: &str) -> f64 {
        let t = Instant::now();
        let mut resp = self
            .api
            .send(
                "POST",
                &format!("/v1/sandboxes/{id}/exec"),
                Payload::Json(
                    serde_json::to_vec(&json!({ "argv": ["/bin/sh", "-c", script] }))
                        .expect("json"),
                ),
            )
            .expect("exec");
        let mut stderr = Vec::new();
        loop {
            match resp.next_line::<ExecEvent>().expect("event") {
                Some(ExecEvent::Exit { code: Some(0), .. }) => break,
                Some(ExecEvent::Stderr { data }) => stderr.push(data),
                Some(ExecEvent::Exit { code, .. }) => {
                    panic!("`{script}` exited {code:?} (stderr, base64: {stderr:?})")
                }
                Some(ExecEvent::Error { error, .. }) => panic!("`{script}`: {error}"),
                None => panic!("`{script}`: the stream ended"),
                Some(_) => {}
            }
        }
        t.elapsed().as_secs_f64() * 1000.0
    }

    /// The host's part of sandbox `id`'s mounts at its create, in ms (its
    /// audit entry's `mounts_ms=HOST`; the guest mounts them ahead of its
    /// first request).
    fn mount_host_ms(&self, id: &str) -> f64 {
        let log: Vec<AuditEntry> = self
            .api
            .call("GET", &format!("/v1/audit?sandbox={id}"), None)
            .expect("audit");
        log.iter()
            .filter(|e| e.action == "create")
            .find_map(|e| {
                let took = e.detail.split_once("mounts_ms=")?.1;
                took.split_whitespace().next()?.parse().ok()
            })
            .expect("the create's mounts_ms in the audit log")
    }

    fn put(&self, id: &str, path: &str, mut body: &[u8]) -> f64 {
        let t = Instant::now();
        self.api
            .send(
                "PUT",
                &format!("/v1/sandboxes/{id}/files?path={path}"),
                Payload::Stream(&mut body),
            )
            .expect("upload");
        t.elapsed().as_secs_f64() * 1000.0
    }

    /// Downloads `path`: its time in ms and its length.
    fn get(&self, id: &str, path: &str) -> (f64, usize) {
        let t = Instant::now();
        let mut resp = self
            .api
            .send(
                "GET",
                &format!("/v1/sandboxes/{id}/files?path={path}"),
                Payload::None,
            )
            .expect("download");
        let mut out = Vec::new();
        resp.read_to_end(&mut out).expect("download body");
        (t.elapsed().as_secs_f64() * 1000.0, out.len())
    }
}

/// Gives `path` and everything beneath it to OWNER (when root).
fn own(path: &Path) {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return;
    }
    let status = Command::new("chown")
        .arg("-R")
        .arg(format!("{OWNER}:{OWNER}"))
        .arg(path)
        .status()
        .expect("chown");
    assert!(status.success(), "chown -R {}", path.display());
}

/// Writes a tree of `files` files of 4 KiB (distinct bytes) in 10
/// directories under `dir`.
fn make_tree(dir: &Path, files: usize) {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for i in 0..files {
        let sub = dir.join(format!("d{}", i % 10));
        std::fs::create_dir_all(&sub).expect("tree dir");
        let bytes: Vec<u8> = (0..4096)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect();
        std::fs::write(sub.join(format!("f{i}.rs")), bytes).expect("tree file");
    }
}

fn main() {
    let runs = env_count("HUSK_BENCH_RUNS", 3);
    let files = env_count("HUSK_BENCH_FILES", 200);
    let creates = env_count("HUSK_BENCH_CREATES", 20);
    let state_dir = std::env::temp_dir().join(format!("husk-bench-shares-{}", std::process::id()));
    let root = state_dir.join("shared");
    std::fs::create_dir_all(&root).expect("mount root");
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
        .arg("--mount-root")
        .arg(&root)
        .args(std::env::var_os("HUSK_BENCH_NO_JAIL").map(|_| "--no-jail"))
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("husk serve");
    let bench = Bench {
        api: ApiClient::new(Endpoint::Unix(state_dir.join("husk.sock")))
            .with_timeout(Duration::from_secs(900)),
        state_dir: state_dir.clone(),
        daemon,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while bench.api.call::<Value>("GET", "/v1/info", None).is_err() {
        assert!(Instant::now() < deadline, "the daemon did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut resp = bench
        .api
        .send(
            "POST",
            "/v1/templates",
            Payload::Json(br#"{"name":"base","mem_mib":256,"fs_slots":1}"#.to_vec()),
        )
        .expect("template build");
    while let Some(event) = resp.next_line::<Value>().expect("progress") {
        if event["type"] == "error" {
            panic!("template build failed: {}", event["error"]);
        }
    }

    // The host side: a tree, a 32 MiB file, and room for the guest's.
    let work = root.join("work");
    std::fs::create_dir_all(work.join("tree")).expect("the share's directory");
    make_tree(&work.join("tree"), files);
    std::fs::write(work.join("big"), vec![0x5au8; 32 << 20]).expect("big file");
    let tar_path = state_dir.join("tree.tar");
    let tarred = Command::new("tar")
        .arg("-C")
        .arg(&work)
        .arg("-cf")
        .arg(&tar_path)
        .arg("tree")
        .status()
        .expect("tar");
    assert!(tarred.success());
    let tar = std::fs::read(&tar_path).expect("the tree's tar");
    own(&work);
    let mounted = json!({ "template": "base", "mounts": [{ "host": work, "guest": "/mnt/w" }] });
    let plain = json!({ "template": "base" });

    // Pooled creates, with and without a mount, alternating.
    bench
        .api
        .call::<PoolInfo>("PUT", "/v1/pools/base", Some(&json!({ "size": 2 })))
        .expect("pool");
    let (mut with, mut without, mut misses) = (Vec::new(), Vec::new(), 0);
    let (mut first_with, mut first_without, mut host_side) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..creates * 2 {
        let deadline = Instant::now() + Duration::from_secs(600);
        while bench.ready() < 2 {
            assert!(Instant::now() < deadline, "the pool did not refill");
            std::thread::sleep(Duration::from_millis(50));
        }
        let body = if i % 2 == 0 { &mounted } else { &plain };
        let (c, ms) = bench.create(body);
        // The first exec: with a mount, the guest mounts it ahead of it.
        let first = match i % 2 == 0 {
            true => bench.sh(&c.sandbox.id, "test -f /mnt/w/big"),
            false => bench.sh(&c.sandbox.id, "true"),
        };
        match (c.pooled, i % 2 == 0) {
            (false, _) => misses += 1,
            (true, true) => {
                with.push(ms);
                first_with.push(ms + first);
                host_side.push(bench.mount_host_ms(&c.sandbox.id));
            }
            (true, false) => {
                without.push(ms);
                first_without.push(ms + first);
            }
        }
        bench.destroy(&c.sandbox.id);
    }
    bench
        .api
        .call::<PoolInfo>("PUT", "/v1/pools/base", Some(&json!({ "size": 0 })))
        .expect("pool off");
    println!("pooled create, API call to a sandbox that takes an exec ({misses} pool misses):");
    summary("with a host directory mounted", &with);
    summary("without", &without);
    let p50 = |v: &[f64]| percentile(v, 0.5);
    if !with.is_empty() && !without.is_empty() {
        println!(
            "  the mount adds (p50): {:.1} ms",
            p50(&with) - p50(&without)
        );
    }
    summary(
        "of which the host's part (the detached mount, the VMM's share request)",
        &host_side,
    );
    println!("create and a first exec (the guest mounts the share ahead of it):");
    summary("with a host directory mounted", &first_with);
    summary("without", &first_without);
    if !first_with.is_empty() && !first_without.is_empty() {
        println!(
            "  the mount adds (p50): {:.1} ms",
            p50(&first_with) - p50(&first_without)
        );
    }
    if files == 0 {
        return;
    }

    // One sandbox with the share for the rest.
    let (s, _) = bench.create(&mounted);
    let id = s.sandbox.id.clone();
    let measure = |label: &str, one: &mut dyn FnMut(usize) -> f64| {
        let samples: Vec<f64> = (0..runs).map(one).collect();
        summary(label, &samples);
    };
    let read_all = |dir: &str| format!("find {dir} -type f -exec cat {{}} + > /dev/null");
    println!("a tree of {files} files of 4 KiB reaching a guest program (read whole):");
    measure(
        "on the share (the host's files, read in place)",
        &mut |_| bench.sh(&id, &read_all("/mnt/w/tree")),
    );
    measure(
        "through the files API (tar uploaded, unpacked in tmpfs, read)",
        &mut |r| {
            let dir = format!("/tmp/api{r}");
            bench.put(&id, "/tmp/tree.tar", &tar)
                + bench.sh(
                    &id,
                    &format!(
                        "mkdir {dir} && tar -xf /tmp/tree.tar -C {dir} && {}",
                        read_all(&dir)
                    ),
                )
        },
    );
    println!("a walk that stats every file of it (git status's first step):");
    measure("on the share", &mut |_| {
        bench.sh(&id, "ls -lR /mnt/w/tree > /dev/null")
    });
    measure("on tmpfs", &mut |_| {
        bench.sh(&id, "ls -lR /tmp/api0 > /dev/null")
    });
    println!("its tar unpacked in the guest:");
    measure("onto the share", &mut |r| {
        bench.sh(
            &id,
            &format!("mkdir /mnt/w/u{r} && tar -xf /tmp/tree.tar -C /mnt/w/u{r}"),
        )
    });
    measure("onto tmpfs", &mut |r| {
        bench.sh(
            &id,
            &format!("mkdir /tmp/u{r} && tar -xf /tmp/tree.tar -C /tmp/u{r}"),
        )
    });
    println!("32 MiB:");
    measure(
        "written by the guest onto the share (dd, 1 MiB blocks)",
        &mut |r| {
            bench.sh(
                &id,
                &format!("dd if=/dev/zero of=/mnt/w/out{r} bs=1M count=32 2>/dev/null"),
            )
        },
    );
    measure("written by the guest onto tmpfs", &mut |r| {
        bench.sh(
            &id,
            &format!("dd if=/dev/zero of=/tmp/out{r} bs=1M count=32 2>/dev/null && rm /tmp/out{r}"),
        )
    });
    measure(
        "the host's file read by the guest from the share",
        &mut |_| bench.sh(&id, "dd if=/mnt/w/big of=/dev/null bs=1M 2>/dev/null"),
    );
    bench.sh(
        &id,
        "dd if=/dev/zero of=/tmp/big bs=1M count=32 2>/dev/null",
    );
    measure("a guest file downloaded through the files API", &mut |_| {
        let (ms, len) = bench.get(&id, "/tmp/big");
        assert_eq!(len, 32 << 20);
        ms
    });
    bench.destroy(&id);
}
