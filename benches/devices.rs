//! Device throughput with the real guest, measured from the host:
//!
//!     cargo bench --bench devices
//!
//! * virtio-block: the guest reads a 64 MiB data disk with dd; the run is
//!   compared with one that runs `true` instead: the difference in time
//!   from readiness to exit (host clock) gives MiB/s, the difference in the
//!   VMM's userspace exits gives exits per MiB.
//! * virtio-vsock: a host program streams 16 MiB into the guest, which
//!   echoes it back; MB/s is measured on the host (each byte crosses twice).
//!
//! On an emulating (PVM) host every guest-kernel instruction is ~1000x
//! slower than on hardware, so these numbers measure the emulator more than
//! husk; the exit counts are the part that carries over to hardware KVM.

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

const DISK_MIB: u64 = 64;
const VSOCK_BYTES: usize = 16 << 20;

/// (VMM exits, microseconds from guest-init's readiness to the guest's exit).
fn report_of(run: &common::VmmRun, timeline: &std::path::Path) -> (u64, u64) {
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(timeline).expect("timeline")).expect("JSON");
    let phase = |name: &str| report["phases_us"][name].as_u64();
    let command_us = phase("guest_exit")
        .zip(phase("guest_ready"))
        .map(|(e, r)| e - r);
    let exits = report["vcpu_exits"].as_u64();
    exits
        .zip(command_us)
        .unwrap_or_else(|| panic!("incomplete timeline {report}\n{}", run.dump()))
}

fn block_run(dir: &std::path::Path, read_disk: bool) -> (u64, u64) {
    let disk = dir.join("data.img");
    std::fs::write(&disk, vec![0x42u8; (DISK_MIB << 20) as usize]).expect("disk");
    let timeline = dir.join("timeline.json");
    let command = if read_disk {
        "-- /bin/dd if=/dev/vda of=/dev/null bs=1M"
    } else {
        "-- /bin/true"
    };
    let cmd = common::guest_command(&[
        "--drive",
        &format!("path={},readonly", disk.display()),
        "--timeline",
        timeline.to_str().expect("utf-8"),
        "--cmdline",
        command,
    ]);
    let run = common::run(cmd, common::BOOT_TIMEOUT);
    assert_eq!(run.status.code(), Some(0), "{}", run.dump());
    report_of(&run, &timeline)
}

fn vsock_run(dir: &std::path::Path) -> (f64, u64) {
    let uds = dir.join("v.sock");
    let timeline = dir.join("timeline-vsock.json");
    let child = common::spawn(common::guest_command(&[
        "--vsock",
        &format!("cid=3,path={}", uds.display()),
        "--serial",
        "null",
        "--timeline",
        timeline.to_str().expect("utf-8"),
        "--cmdline",
        "-- /bin/husk-vsock-probe listen 5000",
    ]));
    let deadline = Instant::now() + common::BOOT_TIMEOUT;
    let stream = loop {
        assert!(Instant::now() < deadline, "guest never listened");
        if let Ok(mut s) = UnixStream::connect(&uds) {
            s.write_all(b"CONNECT 5000\n").expect("connect line");
            let mut reply = [0u8; 3];
            if s.read_exact(&mut reply).is_ok() && &reply == b"OK " {
                let mut byte = [0u8; 1];
                while s.read(&mut byte).is_ok_and(|n| n == 1 && byte[0] != b'\n') {}
                break s;
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let start = Instant::now();
    let mut writer = stream.try_clone().expect("clone");
    let sender = std::thread::spawn(move || {
        writer.write_all(&vec![7u8; VSOCK_BYTES]).expect("send");
        writer
            .shutdown(std::net::Shutdown::Write)
            .expect("shutdown");
    });
    let mut reader = stream;
    let mut buf = vec![0u8; 64 << 10];
    let mut total = 0;
    while total < VSOCK_BYTES {
        match reader.read(&mut buf).expect("receive") {
            0 => break,
            n => total += n,
        }
    }
    let elapsed = start.elapsed();
    sender.join().expect("sender");
    assert_eq!(total, VSOCK_BYTES, "short echo");
    let run = common::wait(child, common::BOOT_TIMEOUT);
    let (exits, _) = report_of(&run, &timeline);
    (
        2.0 * VSOCK_BYTES as f64 / (1 << 20) as f64 / elapsed.as_secs_f64(),
        exits,
    )
}

fn main() {
    let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
    let (base_exits, base_us) = block_run(dir.as_path(), false);
    let (read_exits, read_us) = block_run(dir.as_path(), true);
    let dd_secs = read_us.saturating_sub(base_us) as f64 / 1e6;
    println!(
        "virtio-block: guest dd of a {DISK_MIB} MiB disk took {dd_secs:.1} s more than `true` \
         (host clock): {:.1} MiB/s",
        DISK_MIB as f64 / dd_secs
    );
    println!(
        "virtio-block: VMM exits {read_exits} with the read, {base_exits} without: {:.1} per MiB",
        read_exits.saturating_sub(base_exits) as f64 / DISK_MIB as f64
    );
    let (mbps, exits) = vsock_run(dir.as_path());
    println!("virtio-vsock: {} MiB echoed host->guest->host: {mbps:.1} MiB/s through the VMM (both directions counted)", VSOCK_BYTES >> 20);
    println!(
        "virtio-vsock: VMM exits {exits}, {base_exits} for a boot alone: {:.1} per MiB moved",
        exits.saturating_sub(base_exits) as f64 / (2 * (VSOCK_BYTES >> 20)) as f64
    );
}
