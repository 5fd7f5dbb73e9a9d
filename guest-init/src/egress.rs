//! The sandbox's way out: an HTTP(S) proxy address on the guest's loopback
//! (`127.0.0.1:3128`) whose every connection is carried over vsock to the
//! host, where the daemon's egress proxy checks it against the sandbox's
//! allowlist. Programs find it through `HTTP_PROXY`/`HTTPS_PROXY`, which
//! the agent sets for them. Nothing is decided here: a guest that bypasses
//! this forwarder still has no route out (no NIC, or one whose namespace
//! drops everything but the proxy).

use std::io::{self, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use husk_protocol::{EGRESS_PROXY_PORT, EGRESS_VSOCK_PORT};

/// Connections carried at once; more are answered 503 and closed.
const MAX_CONNS: usize = 64;

static ACTIVE: AtomicUsize = AtomicUsize::new(0);
static LISTENING: AtomicBool = AtomicBool::new(false);

/// The proxy URL programs get, once the forwarder listens.
pub fn proxy_url() -> Option<String> {
    LISTENING
        .load(Ordering::SeqCst)
        .then(|| format!("http://127.0.0.1:{EGRESS_PROXY_PORT}"))
}

/// Brings up loopback and starts forwarding.
pub fn start() -> io::Result<()> {
    crate::net::loopback_up()?;
    let listener = TcpListener::bind(("127.0.0.1", EGRESS_PROXY_PORT))?;
    std::thread::Builder::new()
        .name("egress".into())
        .spawn(move || accept_loop(listener))?;
    LISTENING.store(true, Ordering::SeqCst);
    Ok(())
}

fn accept_loop(listener: TcpListener) {
    loop {
        let Ok((mut tcp, _)) = listener.accept() else {
            // Out of descriptors or memory: wait for a connection to end
            // instead of spinning.
            std::thread::sleep(std::time::Duration::from_millis(100));
            continue;
        };
        if ACTIVE.fetch_add(1, Ordering::SeqCst) >= MAX_CONNS {
            ACTIVE.fetch_sub(1, Ordering::SeqCst);
            let _ = tcp.write_all(&answer(
                "503 Service Unavailable",
                &format!(
                    "husk: {MAX_CONNS} proxied connections are open already in this sandbox\n"
                ),
            ));
            continue;
        }
        let spawned = std::thread::Builder::new()
            .name("egress-conn".into())
            .spawn(move || {
                forward(tcp);
                ACTIVE.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            ACTIVE.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A complete HTTP response that ends the connection.
fn answer(status: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn forward(mut tcp: TcpStream) {
    let vsock = match crate::vsock::connect_host(EGRESS_VSOCK_PORT) {
        Ok(v) => v,
        Err(e) => {
            let body = format!(
                "husk: this sandbox's egress proxy is not reachable ({e}); \
                 nothing leaves the sandbox without it\n"
            );
            let _ = tcp.write_all(&answer("502 Bad Gateway", &body));
            return;
        }
    };
    crate::splice::both(tcp, vsock);
}
