//! virtio-vsock with the real guest: a host program connecting into the
//! guest through the VMM's Unix socket, and a guest program connecting out to
//! a host Unix socket, each moving 1 MiB both ways, checked byte by byte.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use vmm_sys_util::tempdir::TempDir;

const BYTES: u64 = 1 << 20;
/// A transfer that makes no progress for this long has failed.
const STALL: Duration = Duration::from_secs(120);

fn pattern(i: u64) -> u8 {
    (i % 251) as u8
}

/// Connects to guest port `port` through the VMM's socket, retrying until the
/// guest listens (until then the guest refuses: an `ERROR` line, not `OK`).
fn connect_to_guest(uds: &Path, port: u32, deadline: Instant) -> UnixStream {
    loop {
        assert!(
            Instant::now() < deadline,
            "the guest never accepted on port {port}"
        );
        if let Ok(mut stream) = UnixStream::connect(uds) {
            stream
                .write_all(format!("CONNECT {port}\n").as_bytes())
                .expect("write CONNECT");
            let mut line = Vec::new();
            let mut byte = [0u8; 1];
            while let Ok(1) = stream.read(&mut byte) {
                if byte[0] == b'\n' {
                    break;
                }
                line.push(byte[0]);
            }
            if line.starts_with(b"OK ") {
                return stream;
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Sends the pattern on one half and checks the echo on the other.
fn exchange(stream: UnixStream) -> u64 {
    stream.set_read_timeout(Some(STALL)).expect("timeout");
    let mut writer = stream.try_clone().expect("clone");
    let sender = std::thread::spawn(move || {
        let buf: Vec<u8> = (0..BYTES).map(pattern).collect();
        writer.write_all(&buf).expect("send");
        writer
            .shutdown(std::net::Shutdown::Write)
            .expect("shutdown");
    });
    let mut reader = stream;
    let mut buf = vec![0u8; 64 << 10];
    let mut received = 0u64;
    loop {
        let n = reader.read(&mut buf).expect("receive");
        if n == 0 {
            break;
        }
        for (i, b) in buf[..n].iter().enumerate() {
            assert_eq!(
                *b,
                pattern(received + i as u64),
                "byte {} of the echo",
                received + i as u64
            );
        }
        received += n as u64;
    }
    sender.join().expect("sender");
    received
}

/// Echoes one connection from the guest, checking what it sends.
fn echo_one(listener: UnixListener) -> u64 {
    listener.set_nonblocking(true).expect("nonblocking");
    let deadline = Instant::now() + BOOT_TIMEOUT;
    let mut stream = loop {
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => panic!("the guest never connected: {e}"),
        }
    };
    stream.set_nonblocking(false).expect("blocking");
    stream.set_read_timeout(Some(STALL)).expect("timeout");
    let mut buf = vec![0u8; 64 << 10];
    let mut total = 0u64;
    loop {
        let n = stream.read(&mut buf).expect("read from guest");
        if n == 0 {
            return total;
        }
        for (i, b) in buf[..n].iter().enumerate() {
            assert_eq!(
                *b,
                pattern(total + i as u64),
                "byte {} from the guest",
                total + i as u64
            );
        }
        stream.write_all(&buf[..n]).expect("echo to guest");
        total += n as u64;
    }
}

#[test]
fn host_to_guest_and_guest_to_host_streams_carry_a_mebibyte_each_way() {
    let dir = TempDir::new().expect("tempdir");
    let uds = dir.as_path().join("vsock.sock");
    let host_listener = UnixListener::bind(format!("{}_6000", uds.display())).expect("listen");
    let echo = std::thread::spawn(move || echo_one(host_listener));
    let vsock = format!("cid=3,path={}", uds.display());
    let command = format!(
        "-- /bin/sh -c \"husk-vsock-probe listen 5000 && husk-vsock-probe connect 6000 {BYTES}\""
    );
    let child = spawn(guest_command(&["--vsock", &vsock, "--cmdline", &command]));

    let into_guest = exchange(connect_to_guest(&uds, 5000, Instant::now() + BOOT_TIMEOUT));
    let out_of_guest = echo.join().expect("echo server");
    let run = wait(child, BOOT_TIMEOUT);

    assert_eq!(into_guest, BYTES, "{}", run.dump());
    assert_eq!(out_of_guest, BYTES, "{}", run.dump());
    assert_eq!(run.status.code(), Some(0), "{}", run.dump());
    assert!(
        run.has_line(&format!("vsock-echo-done bytes={BYTES}")),
        "{}",
        run.dump()
    );
    assert!(
        run.has_line(&format!("vsock-connect-ok bytes={BYTES}")),
        "{}",
        run.dump()
    );
}

#[test]
fn a_guest_connecting_to_a_port_nobody_listens_on_is_reset() {
    let dir = TempDir::new().expect("tempdir");
    let uds = dir.as_path().join("vsock.sock");
    let vsock = format!("cid=7,path={}", uds.display());

    let run = run(
        guest_command(&[
            "--vsock",
            &vsock,
            "--cmdline",
            "-- /bin/husk-vsock-probe connect 7000 10",
        ]),
        BOOT_TIMEOUT,
    );

    assert_eq!(run.status.code(), Some(0), "{}", run.dump());
    assert!(
        run.serial
            .contains("vsock-probe-error Connection reset by peer"),
        "{}",
        run.dump()
    );
    assert!(
        run.serial.contains("husk-guest-init: exit status=1"),
        "{}",
        run.dump()
    );
}
