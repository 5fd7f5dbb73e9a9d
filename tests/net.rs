//! virtio-net with the real guest: the test builds its own network namespace
//! with a TAP, boots the guest attached to it, gives the guest an address
//! and exchanges TCP data with a server in the namespace.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const HOST_IP: &str = "10.0.2.1";
const GUEST_IP: &str = "10.0.2.2";
const PORT: u16 = 8000;
const BYTES: usize = 64 << 10;

/// A network namespace with a TAP `tap0` at 10.0.2.1/24, deleted on drop.
struct Netns {
    name: String,
}

impl Netns {
    fn new() -> Self {
        let name = format!("husk-net-{}", std::process::id());
        let ns = Netns { name };
        ns.ip(&["netns", "add", &ns.name]);
        ns.ip(&[
            "-n", &ns.name, "tuntap", "add", "dev", "tap0", "mode", "tap",
        ]);
        ns.ip(&[
            "-n",
            &ns.name,
            "addr",
            "add",
            &format!("{HOST_IP}/24"),
            "dev",
            "tap0",
        ]);
        ns.ip(&["-n", &ns.name, "link", "set", "tap0", "up"]);
        ns
    }

    fn ip(&self, args: &[&str]) {
        let status = Command::new("ip").args(args).status().expect("run ip");
        assert!(status.success(), "ip {args:?} failed");
    }

    /// Runs `f` on a thread that has entered the namespace.
    fn spawn_inside<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&path).expect("open netns");
            // SAFETY: setns on a valid namespace fd; it affects this thread only.
            let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
            f()
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// Accepts one connection, reads `BYTES`, answers with how many arrived.
fn serve_one() -> usize {
    let listener = TcpListener::bind((HOST_IP, PORT)).expect("bind in the namespace");
    listener.set_nonblocking(true).expect("nonblocking");
    let deadline = Instant::now() + BOOT_TIMEOUT;
    let (mut stream, _) = loop {
        match listener.accept() {
            Ok(conn) => break conn,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => panic!("the guest never connected: {e}"),
        }
    };
    stream.set_nonblocking(false).expect("blocking");
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .expect("timeout");
    let mut buf = vec![0u8; 16 << 10];
    let mut total = 0;
    while total < BYTES {
        let n = stream.read(&mut buf).expect("read from the guest");
        if n == 0 {
            break;
        }
        total += n;
    }
    stream
        .write_all(format!("host-got-{total}-bytes\n").as_bytes())
        .expect("answer");
    total
}

#[test]
fn guest_exchanges_tcp_data_with_a_server_through_the_tap() {
    let netns = Netns::new();
    let server = netns.spawn_inside(serve_one);
    let script = format!(
        "ifconfig eth0 {GUEST_IP} netmask 255.255.255.0 up && \
         dd if=/dev/zero bs=1024 count={} 2>/dev/null | nc {HOST_IP} {PORT}",
        BYTES / 1024
    );
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &netns.name, vmm_binary()])
        .arg("--kernel")
        .arg(kernel())
        .arg("--initramfs")
        .arg(initramfs())
        .args(["--net", "tap=tap0,mac=06:00:00:00:00:02"])
        .args(["--cmdline", &format!("-- /bin/sh -c \"{script}\"")]);

    let run = run(cmd, BOOT_TIMEOUT);
    let received = server.join().expect("server");

    assert_eq!(received, BYTES, "{}", run.dump());
    assert!(
        run.has_line(&format!("host-got-{BYTES}-bytes")),
        "{}",
        run.dump()
    );
    assert_eq!(run.status.code(), Some(0), "{}", run.dump());
}
