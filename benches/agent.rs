//! guest-init agent latency and throughput over a real vsock, from the host:
//!
//!     cargo bench --bench agent
//!
//! * ping round trip (p50/p99 over 50), the protocol path with no process
//!   work in the guest;
//! * `exec true` round trip (p50/p99 over 10): fork+exec+wait in the guest;
//! * stdout throughput of `dd if=/dev/zero bs=64k count=16` (1 MiB);
//! * host to guest: `write_file` of the host's busybox (~2 MB), and
//!   `unpack` of a busybox tree (the binary and links to it, as a pod's
//!   container's root file system is brought in).
//!
//! On an emulating (PVM) host the guest kernel's share of each number is
//! inflated ~1000x (a fork+exec alone costs seconds there); the host side
//! of the path (VMM muxer, client) runs at full speed.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use husk_agent_client::AgentClient;
use husk_protocol::ExecRequest;

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    samples[((samples.len() - 1) as f64 * p).round() as usize]
}

fn argv(args: &[&str]) -> ExecRequest {
    ExecRequest {
        argv: args.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    }
}

fn main() {
    let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
    let uds = dir.as_path().join("v.sock");
    let child = common::spawn(common::guest_command(&[
        "--vsock",
        &format!("cid=3,path={}", uds.display()),
        "--serial",
        "null",
    ]));
    let spawned = Instant::now();
    let deadline = spawned + common::BOOT_TIMEOUT;
    let mut client = loop {
        match AgentClient::connect(&uds, Duration::from_secs(120)) {
            Ok(c) => break c,
            Err(e) if Instant::now() > deadline => panic!("agent never answered: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    };

    println!(
        "cold boot to agent:   {:>9.2?}  (guest kernel boot: emulated on a PVM host)",
        spawned.elapsed()
    );
    let mut pings: Vec<Duration> = (0..50)
        .map(|_| {
            let t = Instant::now();
            client.ping().expect("ping");
            t.elapsed()
        })
        .collect();
    println!(
        "ping round trip:      p50 {:>9.2?}  p99 {:>9.2?}  (n=50)",
        percentile(&mut pings, 0.5),
        percentile(&mut pings, 0.99)
    );
    let mut execs: Vec<Duration> = (0..10)
        .map(|_| {
            let t = Instant::now();
            client.exec(argv(&["true"])).expect("exec true");
            t.elapsed()
        })
        .collect();
    println!(
        "exec true round trip: p50 {:>9.2?}  p99 {:>9.2?}  (n=10)",
        percentile(&mut execs, 0.5),
        percentile(&mut execs, 0.99)
    );
    let t = Instant::now();
    let out = client
        .exec(argv(&["dd", "if=/dev/zero", "bs=65536", "count=16"]))
        .expect("dd");
    let dd = t.elapsed();
    let busybox = std::path::Path::new("/bin/busybox");
    let size = std::fs::metadata(busybox).map(|m| m.len()).unwrap_or(0);
    let written = (size > 0).then(|| {
        let t = Instant::now();
        let file = std::fs::File::open(busybox).expect("open busybox");
        client
            .write_file("/tmp/busybox", 0o755, file)
            .expect("write_file");
        t.elapsed()
    });
    let unpacked = (size > 0).then(|| {
        let tree = dir.as_path().join("tree");
        common::containerd::busybox_rootfs(&tree, "marker");
        let t = Instant::now();
        client.unpack("/tmp/tree", &tree, &[]).expect("unpack");
        t.elapsed()
    });
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    common::wait(child, Duration::from_secs(60));

    println!(
        "exec stdout:          {} MiB in {dd:.2?}: {:.2} MiB/s",
        out.stdout.len() >> 20,
        out.stdout.len() as f64 / (1 << 20) as f64 / dd.as_secs_f64()
    );
    match (written, unpacked) {
        (Some(w), Some(u)) => {
            let mib = size as f64 / (1 << 20) as f64;
            println!(
                "write_file busybox:   {mib:.2} MiB in {w:.2?}: {:.2} MiB/s",
                mib / w.as_secs_f64()
            );
            println!("unpack busybox tree:  {mib:.2} MiB and its links in {u:.2?}");
        }
        _ => println!(
            "write_file, unpack:   skipped (no /bin/busybox: apt-get install busybox-static)"
        ),
    }
}
