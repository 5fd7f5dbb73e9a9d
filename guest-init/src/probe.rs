//! `husk-vsock-probe`: a vsock test tool in the guest (guest-init is a
//! multi-call binary; /bin/husk-vsock-probe links to it).
//!
//!   husk-vsock-probe listen PORT          accept one connection, echo it back
//!   husk-vsock-probe connect PORT BYTES   connect to the host, send BYTES of a
//!                                         pattern, check the echo byte by byte
//!
//! Byte i of the pattern is `i % 251`.

use std::io::{self, Read, Write};
use std::process::ExitCode;

fn pattern(i: u64) -> u8 {
    (i % 251) as u8
}

fn listen(port: u32) -> io::Result<u64> {
    let listener = crate::vsock::Listener::bind(port)?;
    println!("vsock-listening port={port}");
    let mut conn = listener.accept()?;
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
    let conn = crate::vsock::connect_host(port)?;
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
        crate::vsock::shutdown_write(&writer)
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
