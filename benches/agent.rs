//! guest-init agent latency and throughput over a real vsock, from the host:
//!
//!     cargo bench --bench agent
//!
//! * ping round trip (p50/p99 over 50), the protocol path with no process
//!   work in the guest;
//! * `exec true` round trip (p50/p99 over 10): fork+exec+wait in the guest;
//! * stdout throughput of `dd if=/dev/zero bs=64k count=256` (16 MiB).
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
        .exec(argv(&["dd", "if=/dev/zero", "bs=65536", "count=256"]))
        .expect("dd");
    let dd = t.elapsed();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    common::wait(child, Duration::from_secs(60));

    println!(
        "exec stdout:          {} MiB in {dd:.2?}: {:.2} MiB/s",
        out.stdout.len() >> 20,
        out.stdout.len() as f64 / (1 << 20) as f64 / dd.as_secs_f64()
    );
}
