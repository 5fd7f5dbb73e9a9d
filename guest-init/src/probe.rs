//! `husk-vsock-probe`: a vsock test tool in the guest (guest-init is a
//! multi-call binary; /bin/husk-vsock-probe links to it).
//!
//!   husk-vsock-probe listen PORT          accept one connection, echo it back
//!   husk-vsock-probe connect PORT BYTES   connect to the host, send BYTES of a
//!                                         pattern, check the echo byte by byte
//!
//! Byte i of the pattern is `i % 251`.

use std::io::{self, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::ExitCode;

const HOST_CID: u32 = 2;
const CID_ANY: u32 = u32::MAX;

fn pattern(i: u64) -> u8 {
    (i % 251) as u8
}

fn vsock_addr(cid: u32, port: u32) -> libc::sockaddr_vm {
    // SAFETY: sockaddr_vm is plain data; all-zero is a valid value.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = cid;
    addr.svm_port = port;
    addr
}

fn socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn listen(port: u32) -> io::Result<u64> {
    let sock = socket()?;
    let addr = vsock_addr(CID_ANY, port);
    let len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
    use std::os::fd::AsRawFd;
    // SAFETY: `addr` is a valid sockaddr_vm of `len` bytes.
    check(unsafe {
        libc::bind(
            sock.as_raw_fd(),
            (&addr as *const libc::sockaddr_vm).cast(),
            len,
        )
    })?;
    // SAFETY: listen on a bound socket.
    check(unsafe { libc::listen(sock.as_raw_fd(), 1) })?;
    println!("vsock-listening port={port}");
    // SAFETY: accept without the peer address.
    let fd = unsafe { libc::accept(sock.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut()) };
    check(fd)?;
    // SAFETY: a new descriptor nothing else owns.
    let mut conn = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let mut buf = vec![0u8; 64 << 10];
    let mut total = 0u64;
    loop {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            return Ok(total);
        }
        conn.write_all(&buf[..n])?;
        total += n as u64;
    }
}

fn connect(port: u32, bytes: u64) -> io::Result<()> {
    let sock = socket()?;
    let addr = vsock_addr(HOST_CID, port);
    let len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
    use std::os::fd::AsRawFd;
    // SAFETY: `addr` is a valid sockaddr_vm of `len` bytes.
    check(unsafe {
        libc::connect(
            sock.as_raw_fd(),
            (&addr as *const libc::sockaddr_vm).cast(),
            len,
        )
    })?;
    let conn = std::fs::File::from(sock);
    let mut writer = conn.try_clone()?;
    let sender = std::thread::spawn(move || -> io::Result<()> {
        let mut buf = vec![0u8; 32 << 10];
        let mut sent = 0u64;
        while sent < bytes {
            let n = (bytes - sent).min(buf.len() as u64) as usize;
            for (i, b) in buf[..n].iter_mut().enumerate() {
                *b = pattern(sent + i as u64);
            }
            writer.write_all(&buf[..n])?;
            sent += n as u64;
        }
        // SAFETY: half-close the socket we own.
        check(unsafe { libc::shutdown(writer.as_raw_fd(), libc::SHUT_WR) })
    });
    let mut reader = conn;
    let mut buf = vec![0u8; 64 << 10];
    let mut received = 0u64;
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        for (i, b) in buf[..n].iter().enumerate() {
            if *b != pattern(received + i as u64) {
                return Err(io::Error::other(format!(
                    "byte {} differs",
                    received + i as u64
                )));
            }
        }
        received += n as u64;
    }
    sender
        .join()
        .map_err(|_| io::Error::other("sender panicked"))??;
    if received != bytes {
        return Err(io::Error::other(format!(
            "echoed {received} of {bytes} bytes"
        )));
    }
    Ok(())
}

pub fn main(args: &[String]) -> ExitCode {
    let parse = |s: Option<&String>| s.and_then(|v| v.parse::<u64>().ok());
    let result = match (
        args.first().map(String::as_str),
        parse(args.get(1)),
        parse(args.get(2)),
    ) {
        (Some("listen"), Some(port), None) => {
            listen(port as u32).map(|n| println!("vsock-echo-done bytes={n}"))
        }
        (Some("connect"), Some(port), Some(bytes)) => {
            connect(port as u32, bytes).map(|()| println!("vsock-connect-ok bytes={bytes}"))
        }
        _ => {
            eprintln!("usage: husk-vsock-probe listen PORT | connect PORT BYTES");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("vsock-probe-error {e}");
            ExitCode::FAILURE
        }
    }
}
