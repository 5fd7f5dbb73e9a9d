//! `husk-hostile`: a guest program that attacks its own VMM, for the tests
//! that show the VMM stays bounded. Not in the root file system: a test
//! uploads it into a sandbox. Every mode runs for SECONDS and exits 0.
//!
//!   husk-hostile vsock PORT SECONDS [MIN [CAP]]
//!                                     connect to host port PORT as fast as it
//!                                     can, write into each connection once and
//!                                     keep it open (when the guest's own limit
//!                                     on descriptors is reached, the oldest is
//!                                     closed); prints the connect attempts the
//!                                     guest kernel let start. Goes on past
//!                                     SECONDS until MIN were made, for at most
//!                                     CAP seconds (ten times SECONDS unless
//!                                     given), so a slow guest attacks as hard
//!                                     as a fast one
//!   husk-hostile console SECONDS      write to the console without pause

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

const HOST_CID: u32 = 2;

fn connect(port: u32) -> std::io::Result<File> {
    // SAFETY: a plain socket call.
    let fd = unsafe {
        libc::socket(
            libc::AF_VSOCK,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_vm is plain data.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = HOST_CID;
    addr.svm_port = port;
    // SAFETY: `addr` is a valid sockaddr_vm of the size given.
    let rc = unsafe {
        libc::connect(
            sock.as_raw_fd(),
            (&addr as *const libc::sockaddr_vm).cast(),
            std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
    }
    Ok(File::from(sock))
}

fn vsock(port: u32, until: Instant, min: u64, cap: Instant) -> (u64, u64) {
    let (mut made, mut failed) = (0u64, 0u64);
    let mut open: VecDeque<File> = VecDeque::new();
    let junk = [0x5au8; 4096];
    while (Instant::now() < until || made < min) && Instant::now() < cap {
        match connect(port) {
            Ok(mut conn) => {
                made += 1;
                // Non-blocking: whatever the host does not read stays queued.
                let _ = conn.write(&junk);
                open.push_back(conn);
            }
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) => {
                open.pop_front();
            }
            Err(_) => failed += 1,
        }
    }
    (made, failed)
}

fn console(until: Instant) -> u64 {
    let Ok(mut out) = std::fs::OpenOptions::new().write(true).open("/dev/console") else {
        return 0;
    };
    let line = b"husk-hostile: console flood console flood console flood console flood\n";
    let mut written = 0u64;
    while Instant::now() < until {
        if out.write_all(line).is_ok() {
            written += line.len() as u64;
        }
    }
    written
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let seconds = |s: &str| s.parse::<u64>().ok().map(Duration::from_secs);
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["vsock", port, secs, ..] if args.len() <= 5 => {
            let (Ok(port), Some(d)) = (port.parse::<u32>(), seconds(secs)) else {
                return usage();
            };
            let min = args.get(3).and_then(|m| m.parse().ok()).unwrap_or(0);
            let cap = args.get(4).and_then(|c| seconds(c)).unwrap_or(d * 10);
            let now = Instant::now();
            let (made, failed) = vsock(port, now + d, min, now + cap);
            println!("vsock port={port} connected={made} failed={failed}");
        }
        ["console", secs] => {
            let Some(d) = seconds(secs) else {
                return usage();
            };
            println!("console bytes={}", console(Instant::now() + d));
        }
        _ => return usage(),
    }
    std::process::ExitCode::SUCCESS
}

fn usage() -> std::process::ExitCode {
    eprintln!("usage: husk-hostile vsock PORT SECONDS [MIN [CAP]] | console SECONDS");
    std::process::ExitCode::from(2)
}
