//! virtio-net with the real guest: the test builds its own network namespace
//! with a TAP, boots the guest attached to it, gives the guest an address
//! and exchanges TCP data with a server in the namespace. A snapshot of a
//! guest with a network device restores into another namespace, on its
//! own TAP, with its own MAC address.

mod common;

use std::io::{BufRead, Read, Write};
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
    fn new(tag: &str) -> Self {
        let name = format!("husk-net-{}-{tag}", std::process::id());
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

/// The first connection to `listener` within `timeout` (blocking, with a
/// read timeout).
fn accept_one(listener: &TcpListener, timeout: Duration) -> std::net::TcpStream {
    listener.set_nonblocking(true).expect("nonblocking");
    let deadline = Instant::now() + timeout;
    let (stream, _) = loop {
        match listener.accept() {
            Ok(conn) => break conn,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => panic!("the guest never connected: {e}"),
        }
    };
    stream.set_nonblocking(false).expect("blocking");
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .expect("timeout");
    stream
}

/// Accepts one connection, reads `BYTES`, answers with how many arrived.
fn serve_one() -> usize {
    let listener = TcpListener::bind((HOST_IP, PORT)).expect("bind in the namespace");
    let mut stream = accept_one(&listener, BOOT_TIMEOUT);
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
    let netns = Netns::new("boot");
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

/// Accepts one connection, reads one line, answers `got <line>`; returns
/// the line.
fn echo_one_line() -> String {
    let listener = TcpListener::bind((HOST_IP, PORT)).expect("bind in the namespace");
    let stream = accept_one(&listener, Duration::from_secs(300));
    let mut line = String::new();
    std::io::BufReader::new(&stream)
        .read_line(&mut line)
        .expect("read from the clone");
    (&stream)
        .write_all(format!("got {line}").as_bytes())
        .expect("answer");
    line
}

#[test]
fn a_clone_gets_its_own_tap_and_mac_and_keeps_its_network_setup() {
    use husk_agent_client::AgentClient;
    let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
    let (uds, api) = (dir.as_path().join("b.vsock"), dir.as_path().join("b.api"));
    let boot_ns = Netns::new("snap");
    let clone_ns = Netns::new("clone");
    let boot = agent_guest_command(&uds, &api, &["--net", "tap=tap0,mac=06:00:00:00:00:02"]);
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &boot_ns.name])
        .arg(boot.get_program())
        .args(boot.get_args())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null());
    let base = Vmm(cmd.spawn().expect("husk-vmm"));
    let timeout = Duration::from_secs(120);
    let mut client = AgentClient::connect_when_ready(&uds, BOOT_TIMEOUT, timeout).expect("agent");
    let up = client
        .exec(sh(&format!(
            "ifconfig eth0 {GUEST_IP} netmask 255.255.255.0 up"
        )))
        .expect("configure eth0");
    let snapshot = dir.as_path().join("snap");
    let reply = common::snapshot(&api, &snapshot, false);
    drop((client, base));

    let server = clone_ns.spawn_inside(echo_one_line);
    let clone_uds = dir.as_path().join("clone.vsock");
    let clone = Vmm(Command::new("ip")
        .args(["netns", "exec", &clone_ns.name, vmm_binary()])
        .arg("--restore")
        .arg(&snapshot)
        .args([
            "--serial",
            "null",
            "--net",
            "tap=tap0,mac=06:00:00:00:00:99",
        ])
        .arg("--vsock")
        .arg(format!("cid=7,path={}", clone_uds.display()))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("husk-vmm --restore"));
    let mut client =
        AgentClient::connect_when_ready(&clone_uds, timeout, timeout).expect("the clone's agent");
    client
        .restored("netclone", Some([6, 0, 0, 0, 0, 0x99]))
        .expect("post-restore step");
    let out = client
        .exec(sh(&format!(
            "cat /sys/class/net/eth0/address; echo hello-from-the-clone | nc {HOST_IP} {PORT}"
        )))
        .expect("exec");
    let line = server.join().expect("server");
    drop(clone);

    assert_eq!(up.report.termination, husk_protocol::Termination::Code(0));
    assert!(reply.is_ok(), "{reply:?}");
    assert_eq!(line, "hello-from-the-clone\n");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "06:00:00:00:00:99\ngot hello-from-the-clone\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
