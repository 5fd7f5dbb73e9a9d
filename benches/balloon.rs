//! Memory a clone frees, given back through the balloon's free page
//! reporting, against the same clone with reporting off:
//!
//!     cargo bench --bench balloon          (HUSK_BENCH_FILL_MIB=48 HUSK_BENCH_SETTLE_S=10)
//!
//! Boots once (the test binaries' base guest: 128 MiB, with `--balloon`;
//! its /tmp holds at most half of that), then for
//! each of two clones of it: the clone's private memory (its copy-on-write
//! copies of snapshot pages, from /proc/PID/smaps) when restored, after the
//! guest wrote FILL MiB into its tmpfs, and SETTLE seconds after it removed
//! that file; then the memory of a diff snapshot of it (what a hibernation
//! writes). Reporting is off in the second clone by setting its
//! `page_reporting_order` past the buddy allocator's largest order, so no
//! free block qualifies.
//!
//! On an emulating (PVM) host the guest's writes are slow (the fill takes
//! tens of seconds); the memory numbers are the same as on hardware KVM.

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::time::Duration;

use common::{env_count, sandbox};
use husk_protocol::Termination;

/// The clone's private copies of guest memory, in MiB.
fn private_mib(pid: u32) -> f64 {
    common::guest_private_kib(pid) as f64 / 1024.0
}

/// Allocated bytes of the files in `dir`, in MiB.
fn disk_mib(dir: &Path) -> f64 {
    use std::os::unix::fs::MetadataExt;
    let bytes: u64 = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.blocks() * 512)
                .sum()
        })
        .unwrap_or(0);
    bytes as f64 / f64::from(1 << 20)
}

fn run(client: &mut husk_agent_client::AgentClient, script: &str) {
    let out = client.exec(common::sh(script)).expect("exec");
    assert_eq!(
        out.report.termination,
        Termination::Code(0),
        "{script}: {out:?}"
    );
}

fn main() {
    let fill = env_count("HUSK_BENCH_FILL_MIB", 48);
    let settle = Duration::from_secs(env_count("HUSK_BENCH_SETTLE_S", 10) as u64);
    println!(
        "a clone writes {fill} MiB into its tmpfs and removes it; private memory \
         (MiB) restored / filled / {}s after the remove, and its diff snapshot:",
        settle.as_secs()
    );
    for (name, reporting) in [("reporting", true), ("off", false)] {
        let vm = sandbox(&format!("balloon-{name}"));
        let mut client = vm.client();
        if !reporting {
            run(
                &mut client,
                "echo 11 > /sys/module/page_reporting/parameters/page_reporting_order",
            );
        }
        let pid = vm.pid();
        let restored = private_mib(pid);
        run(
            &mut client,
            &format!("dd if=/dev/zero of=/tmp/fill bs=1M count={fill} 2>/dev/null"),
        );
        let filled = private_mib(pid);
        run(&mut client, "rm /tmp/fill");
        std::thread::sleep(settle);
        let freed = private_mib(pid);
        let dir = vm.api.with_extension("diff");
        common::snapshot(&vm.api, &dir, true).expect("diff snapshot");
        let diff = disk_mib(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        println!(
            "  {name:<9}: {restored:.1} / {filled:.1} / {freed:.1} MiB private \
             ({:.1} MiB given back); diff snapshot {diff:.1} MiB on disk",
            filled - freed
        );
    }
}
