//! The way in: the host reaches a TCP port inside the guest (a dev server
//! a program started) through vsock port PORTS_VSOCK_PORT. Each connection
//! names its port in one line (`PORT 8000\n`); the forwarder connects to it
//! on loopback (IPv4, then IPv6), answers `OK\n` or `ERR <reason>\n`, and
//! then carries the bytes both ways. Who may connect is the host's
//! decision (the daemon's front door): a guest program sees an ordinary
//! connection from loopback.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use husk_protocol::{PORTS_VSOCK_PORT, PORT_LINE_MAX};

use crate::vsock::Listener;

/// Connections carried at once; more are refused with a reason. Below the
/// VMM's own bound on host connections, so the agent's always fit.
const MAX_CONNS: usize = 96;
/// How long a host connection may take to name its port.
const LINE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long connecting to a guest program's port may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

static ACTIVE: AtomicUsize = AtomicUsize::new(0);

/// Starts listening (loopback is up: the egress forwarder brought it up);
/// the accept loop runs on its own thread.
pub fn start() -> io::Result<()> {
    let listener = Listener::bind(PORTS_VSOCK_PORT)?;
    std::thread::Builder::new()
        .name("ports".into())
        .spawn(move || accept_loop(listener))?;
    Ok(())
}

fn accept_loop(listener: Listener) {
    loop {
        let Ok(mut conn) = listener.accept() else {
            // Out of descriptors or memory: wait for a connection to end
            // instead of spinning.
            std::thread::sleep(Duration::from_millis(100));
            continue;
        };
        if ACTIVE.fetch_add(1, Ordering::SeqCst) >= MAX_CONNS {
            ACTIVE.fetch_sub(1, Ordering::SeqCst);
            let _ = conn.write_all(
                format!("ERR {MAX_CONNS} connections to this sandbox's ports are open\n")
                    .as_bytes(),
            );
            continue;
        }
        let spawned = std::thread::Builder::new()
            .name("port-conn".into())
            .spawn(move || {
                serve(conn);
                ACTIVE.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            ACTIVE.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn serve(mut conn: File) {
    let port = match read_line(&conn).and_then(|line| parse(&line)) {
        Ok(port) => port,
        Err(e) => {
            let _ = conn.write_all(format!("ERR {e}\n").as_bytes());
            return;
        }
    };
    match connect(port) {
        Ok(tcp) => {
            if conn.write_all(b"OK\n").is_ok() {
                crate::splice::both(tcp, conn);
            }
        }
        Err(e) => {
            let _ = conn.write_all(format!("ERR port {port} in the guest: {e}\n").as_bytes());
        }
    }
}

/// The request line. The host sends it in one write and then waits for
/// the answer, so one read takes it whole (a syscall costs here).
fn read_line(mut conn: &File) -> io::Result<String> {
    crate::vsock::set_read_timeout(conn, Some(LINE_TIMEOUT))?;
    let mut line = [0u8; PORT_LINE_MAX];
    let mut len = 0;
    while !line[..len].contains(&b'\n') {
        match conn.read(&mut line[len..])? {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => len += n,
        }
        if len == line.len() && !line.contains(&b'\n') {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "line too long"));
        }
    }
    crate::vsock::set_read_timeout(conn, None)?;
    let end = line[..len].iter().position(|&b| b == b'\n').unwrap_or(len);
    if end + 1 != len {
        // Nothing may follow it before the answer.
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "data after the request line, before the answer",
        ));
    }
    String::from_utf8(line[..end].to_vec())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not UTF-8"))
}

fn parse(line: &str) -> io::Result<u16> {
    line.strip_prefix("PORT ")
        .and_then(|p| p.parse::<u16>().ok())
        .filter(|&p| p != 0)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("expected `PORT <1-65535>`, got {line:?}"),
            )
        })
}

/// Connects to `port` on loopback: IPv4 first, then IPv6 (a server that
/// bound `localhost` may have only one of them).
fn connect(port: u16) -> io::Result<TcpStream> {
    let v4 = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    match TcpStream::connect_timeout(&v4, CONNECT_TIMEOUT) {
        Ok(tcp) => Ok(tcp),
        Err(e4) => {
            let v6 = SocketAddr::from((Ipv6Addr::LOCALHOST, port));
            TcpStream::connect_timeout(&v6, CONNECT_TIMEOUT).map_err(|_| e4)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn a_request_names_one_port() {
        assert_eq!(parse("PORT 8000").expect("port"), 8000);
        assert_eq!(parse("PORT 65535").expect("port"), 65535);
        for bad in [
            "PORT 0",
            "PORT 65536",
            "PORT",
            "port 80",
            "PORT 80 ",
            "PORT -1",
            "",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} was taken");
        }
    }
}
