//! Memory a clone frees, given back through the balloon's free page
//! reporting, against the same clone with reporting off, and the page
//! cache an idle clone drops when asked to reclaim (`Body::Reclaim`, what
//! the daemon sends a sandbox idle for `--reclaim-idle-s`):
//!
//!     cargo bench --bench balloon   (HUSK_BENCH_FILL_MIB=64 HUSK_BENCH_CACHE_MIB=32 HUSK_BENCH_SETTLE_S=10)
//!
//! Boots once (the test binaries' base guest: 128 MiB, with `--balloon`),
//! then for each clone of it: the clone's private memory (its
//! copy-on-write copies of snapshot pages, from /proc/PID/smaps) when
//! restored, after the guest allocated FILL MiB (one `dd` buffer of that
//! size, filled, then freed as dd exits) and SETTLE seconds later; then the
//! memory of a diff snapshot of it (what a hibernation writes). Reporting
//! is off in the second clone by setting its `page_reporting_order` past
//! the buddy allocator's largest order, so no free block qualifies. A third
//! clone reads a CACHE MiB file from an ext4 medium (its page cache), waits
//! SETTLE seconds, is asked to reclaim, and waits SETTLE seconds again.
//!
//! On an emulating (PVM) host the guest's work is slow (tens of seconds);
//! the memory numbers are the same as on hardware KVM.

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
    let fill = env_count("HUSK_BENCH_FILL_MIB", 64);
    let cache = env_count("HUSK_BENCH_CACHE_MIB", 32);
    let settle = Duration::from_secs(env_count("HUSK_BENCH_SETTLE_S", 10) as u64);
    let diff_mib = |vm: &common::Sandbox| {
        let dir = vm.api.with_extension("diff");
        common::snapshot(&vm.api, &dir, true).expect("diff snapshot");
        let diff = disk_mib(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        diff
    };
    println!(
        "a clone allocates {fill} MiB and frees it; private memory (MiB) restored / \
         allocated / {}s after, and its diff snapshot:",
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
        // dd's one buffer of FILL MiB, filled from /dev/zero, freed as it
        // exits; the peak is read while it sleeps on a FIFO's open.
        run(&mut client, "mkfifo /tmp/hold");
        let holder = std::thread::scope(|scope| {
            let mut second = vm.client();
            second.set_read_timeout(None).expect("timeout");
            let dd = scope.spawn(move || {
                run(
                    &mut second,
                    &format!(
                        "dd if=/dev/zero bs={fill}M count=1 2>/dev/null | \
                         {{ cat /tmp/hold > /dev/null; cat > /dev/null; }}"
                    ),
                )
            });
            // Until dd's buffer is resident (it blocks writing into the
            // pipe, whose reader waits on the FIFO).
            let deadline = std::time::Instant::now() + Duration::from_secs(600);
            let mut peak = private_mib(pid);
            while peak < restored + fill as f64 * 0.75 && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(500));
                peak = private_mib(pid);
            }
            // Then until it stops growing (dd filling the rest).
            loop {
                std::thread::sleep(Duration::from_secs(1));
                let now = private_mib(pid);
                if now < peak + 0.5 || std::time::Instant::now() > deadline {
                    break;
                }
                peak = now;
            }
            run(&mut client, "echo > /tmp/hold");
            dd.join().expect("dd");
            peak
        });
        std::thread::sleep(settle);
        let freed = private_mib(pid);
        let diff = diff_mib(&vm);
        println!(
            "  {name:<9}: {restored:.1} / {holder:.1} / {freed:.1} MiB private \
             ({:.1} MiB given back); diff snapshot {diff:.1} MiB on disk",
            holder - freed
        );
    }

    println!(
        "a clone reads a {cache} MiB file (page cache), then is asked to reclaim; private memory \
         (MiB) restored / read / {0}s after / {0}s after the reclaim, and its diff snapshot:",
        settle.as_secs()
    );
    let vm = sandbox("balloon-cache");
    let mut client = vm.client();
    let pid = vm.pid();
    let dir = vm.api.with_extension("medium");
    std::fs::create_dir_all(dir.join("tree")).expect("tree");
    std::fs::write(dir.join("tree/big"), vec![0x5a_u8; cache << 20]).expect("big");
    let image = dir.join("disk.ext4");
    let image_mib = cache as u64 + 8;
    std::fs::File::create(&image)
        .and_then(|f| f.set_len(image_mib << 20))
        .expect("image");
    let made = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-O", "^has_journal", "-d"])
        .arg(dir.join("tree"))
        .arg(&image)
        .status()
        .expect("mkfs.ext4");
    assert!(made.success(), "mkfs.ext4");
    common::control(
        &vm.api,
        &husk_vmm_api::Request::Medium {
            drive: common::SLOT.into(),
            path: image,
            overlay: Some(dir.join("overlay")),
        },
    )
    .expect("medium");
    client
        .mount_medium(common::SLOT, image_mib << 20, "/ctr/b/root")
        .expect("mount");
    let restored = private_mib(pid);
    run(&mut client, "cat /ctr/b/root/big > /dev/null");
    let read = private_mib(pid);
    std::thread::sleep(settle);
    let kept = private_mib(pid);
    let started = std::time::Instant::now();
    let (free_before, free_after) = client.reclaim().expect("reclaim");
    let took = started.elapsed();
    std::thread::sleep(settle);
    let reclaimed = private_mib(pid);
    let diff = diff_mib(&vm);
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "  reclaim  : {restored:.1} / {read:.1} / {kept:.1} / {reclaimed:.1} MiB private \
         ({:.1} MiB given back); diff snapshot {diff:.1} MiB on disk; the guest's reclaim \
         took {} ms and freed {:.1} MiB",
        kept - reclaimed,
        took.as_millis(),
        (free_after.saturating_sub(free_before)) as f64 / 1024.0
    );
}
