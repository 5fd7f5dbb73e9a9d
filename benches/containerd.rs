//! containerd with husk, as the user of `ctr` sees it: from starting
//! `ctr run` to the task's first line of output, and to `ctr run`'s exit
//! (the task deleted), for
//! - runc, the default runtime, with the same root file system;
//! - husk, boot path: a tree husk has not seen (its template is built: one
//!   boot and a snapshot); once, as it takes minutes on an emulating host;
//! - husk, restore path: the same tree again (the template's snapshot is
//!   restored: a copy-on-write clone);
//! - husk, pooled: `--annotation io.husk.template=...` with a warm pool (a
//!   parked clone is resumed).
//!
//! Run:
//!
//!     make bench   (or: cargo build --release -p husk-cli -p husk-jailer -p husk-shim && cargo bench --bench containerd)
//!     HUSK_BENCH_RUNS=5   runs per path (the boot path runs once)
//!
//! Needs root, containerd and runc (the benchmark says so and stops
//! otherwise). Guest-side steps on an emulating (PVM) host are ~1000x
//! slower than on hardware KVM; the numbers are this host's.

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::containerd::{busybox_rootfs, Containerd, RUNTIME};

/// One `ctr run`: to the first output line, and to its exit.
fn timed_run(ctr: &Containerd, args: &[&str]) -> (Duration, Duration) {
    let started = Instant::now();
    let mut child = ctr
        .ctr_command(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ctr run");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = match lines.next() {
        Some(Ok(_)) => started.elapsed(),
        other => panic!("no output from ctr {args:?}: {other:?}"),
    };
    let out = child.wait_with_output().expect("ctr run");
    assert!(
        out.status.success(),
        "ctr {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (first, started.elapsed())
}

fn report(label: &str, runs: &[(Duration, Duration)]) {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let first: Vec<f64> = runs.iter().map(|r| ms(r.0)).collect();
    let total: Vec<f64> = runs.iter().map(|r| ms(r.1)).collect();
    println!(
        "{label:<22} n={:<2} first output p50 {:>9.1} ms (min {:>9.1}, max {:>9.1}); \
         ctr run exit p50 {:>9.1} ms",
        runs.len(),
        common::percentile(&first, 0.5),
        common::percentile(&first, 0.0),
        common::percentile(&first, 1.0),
        common::percentile(&total, 0.5),
    );
}

fn main() {
    let Some(runs) = common::containerd::bench_runs("containerd") else {
        return;
    };
    let ctr = Containerd::start("bench");
    let rootfs = busybox_rootfs(&ctr.dir.join("rootfs"), "bench");
    let rootfs = rootfs.to_str().expect("utf-8");
    let echo = ["/bin/echo", "first output"];
    let run_args = |id: &str, extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["run", "--rm"].iter().map(|s| (*s).to_owned()).collect();
        v.extend(extra.iter().map(|s| (*s).to_owned()));
        v.extend(["--rootfs".to_owned(), rootfs.to_owned(), id.to_owned()]);
        v.extend(echo.iter().map(|s| (*s).to_owned()));
        v
    };
    let go = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        timed_run(&ctr, &args)
    };
    let husk = ["--runtime", RUNTIME];

    let version = std::process::Command::new("containerd")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    println!("{version}; ctr run to the first line of `echo`, and to ctr's exit");
    let boot = go(run_args("boot-0", &husk));
    report("husk boot path", &[boot]);
    let template = ctr
        .templates()
        .into_iter()
        .find(|n| n.starts_with("oci-"))
        .expect("the boot path's template");
    let annotation = format!("io.husk.template={template}");
    let pooled_args = ["--runtime", RUNTIME, "--annotation", &annotation];
    let (mut runc, mut restore, mut pooled) = (Vec::new(), Vec::new(), Vec::new());
    ctr.pool(&template, 1);
    for i in 0..runs {
        runc.push(go(run_args(&format!("runc-{i}"), &[])));
        restore.push(go(run_args(&format!("restore-{i}"), &husk)));
        // A full pool: the clone is parked and ready.
        ctr.wait_for_pool(&template, 1);
        pooled.push(go(run_args(&format!("pooled-{i}"), &pooled_args)));
    }
    report("runc", &runc);
    report("husk restore path", &restore);
    report("husk pooled", &pooled);
    ctr.pool(&template, 0);
}
