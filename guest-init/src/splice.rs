//! Carrying one TCP connection over one vsock stream, both ways, until
//! both sides are done: what the egress forwarder and the port forwarder
//! share.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};

/// Copies `tcp` to `vsock` on a thread of its own and `vsock` to `tcp` on
/// this one; each side's end of input half-closes the other's output, so
/// a request-then-answer protocol sees its EOFs. Returns when both
/// directions are done.
pub fn both(mut tcp: TcpStream, vsock: File) {
    let (Ok(tcp_in), Ok(vsock_out)) = (tcp.try_clone(), vsock.try_clone()) else {
        return;
    };
    let up = std::thread::Builder::new()
        .name("splice-up".into())
        .spawn(move || {
            pump(tcp_in, &vsock_out);
            let _ = crate::vsock::shutdown_write(&vsock_out);
        });
    let mut vsock_in = vsock;
    if io::copy(&mut vsock_in, &mut tcp).is_err() {
        // The guest's side is gone: stop reading the host's too.
        let _ = crate::vsock::shutdown_read(&vsock_in);
    }
    let _ = tcp.shutdown(Shutdown::Write);
    if let Ok(up) = up {
        let _ = up.join();
    }
}

fn pump(mut from: TcpStream, mut to: &File) {
    let mut buf = vec![0u8; 32 << 10];
    while let Ok(n @ 1..) = from.read(&mut buf) {
        if to.write_all(&buf[..n]).is_err() {
            // The host side is gone: stop the program's side too.
            let _ = from.shutdown(Shutdown::Both);
            return;
        }
    }
}
