//! What the egress proxy costs a request, host side:
//!
//!     cargo bench --bench egress          (root: it makes a network namespace)
//!     HUSK_BENCH_REQUESTS=200
//!
//! A server in a network namespace of the bench's own (only loopback, which
//! also carries 198.51.100.1: nothing can leave the machine) answers a small
//! HTTP request. Each request is made three ways, interleaved so a noisy
//! host hurts all alike:
//! - direct: a TCP connection to the server (plain HTTP), or TLS to it;
//! - through the proxy: a connection to the sandbox's proxy socket (what
//!   the VMM connects to for the guest), the `CONNECT` or absolute-form
//!   request, the allowlist and address checks, a connection to the server;
//! - HTTPS to a host the sandbox holds a credential for: the proxy is the
//!   guest's TLS server, adds the credential and opens its own TLS.
//!
//! Timed: from opening the connection to the last byte of the answer. The
//! guest's side of the way (its loopback, guest-init's forwarder, vsock)
//! is not in these numbers; on this host it is dominated by the emulated
//! guest.

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use common::percentile;
use husk_core::egress::{Allowlist, Egress, Secret, Tls};

const SERVER_IP: &str = "198.51.100.1";
const BODY: &str = "hello from the bench server\n";

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn enter(netns: &Path) {
    let f = std::fs::File::open(netns).expect("netns");
    // SAFETY: moves this thread (only) into the bench's namespace.
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
}

/// Reads one request head (and a Content-Length body) and answers it.
fn serve_one(conn: &mut (impl Read + Write)) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match conn.read(&mut buf) {
            Ok(n @ 1..) => got.extend_from_slice(&buf[..n]),
            _ => return,
        }
    }
    let reply = format!(
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{BODY}",
        BODY.len()
    );
    let _ = conn.write_all(reply.as_bytes());
    let _ = conn.flush();
}

/// Servers in `netns`: plain HTTP and HTTPS (a certificate for
/// `SERVER_IP` from `ca`).
fn servers(netns: PathBuf, tls: Arc<rustls::ServerConfig>) -> (SocketAddr, SocketAddr) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        enter(&netns);
        let plain = TcpListener::bind((SERVER_IP, 0)).expect("bind");
        let secure = TcpListener::bind((SERVER_IP, 0)).expect("bind");
        tx.send((
            plain.local_addr().expect("addr"),
            secure.local_addr().expect("addr"),
        ))
        .expect("send");
        std::thread::spawn(move || {
            for conn in secure.incoming().flatten() {
                let tls = tls.clone();
                std::thread::spawn(move || {
                    let server = rustls::ServerConnection::new(tls).expect("server");
                    let mut s = rustls::StreamOwned::new(server, conn);
                    serve_one(&mut s);
                    s.conn.send_close_notify();
                    let _ = s.flush();
                });
            }
        });
        for mut conn in plain.incoming().flatten() {
            std::thread::spawn(move || serve_one(&mut conn));
        }
    });
    rx.recv().expect("servers")
}

fn client_config(roots_pem: &[String]) -> Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for pem in roots_pem {
        roots
            .add(rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).expect("pem"))
            .expect("root");
    }
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// Sends `request` over `conn` (TLS to `tls_to` when given) and reads the
/// answer to its end; checks it.
fn request<S: Read + Write>(
    conn: S,
    tls: Option<(&Arc<rustls::ClientConfig>, SocketAddr)>,
    request: &str,
) {
    let mut answer = Vec::new();
    match tls {
        Some((cfg, to)) => {
            let name = rustls::pki_types::ServerName::from(to.ip());
            let client = rustls::ClientConnection::new(cfg.clone(), name).expect("client");
            let mut s = rustls::StreamOwned::new(client, conn);
            s.write_all(request.as_bytes()).expect("write");
            match s.read_to_end(&mut answer) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
                Err(e) => panic!("TLS: {e}"),
            }
        }
        None => {
            let mut conn = conn;
            conn.write_all(request.as_bytes()).expect("write");
            conn.read_to_end(&mut answer).expect("read");
        }
    }
    let text = String::from_utf8_lossy(&answer);
    assert!(text.ends_with(BODY), "{text}");
}

/// Opens a tunnel through the proxy; returns the connection after the 200.
fn tunnel(socket: &Path, to: SocketAddr) -> UnixStream {
    let mut s = UnixStream::connect(socket).expect("proxy");
    s.write_all(format!("CONNECT {to} HTTP/1.1\r\nHost: {to}\r\n\r\n").as_bytes())
        .expect("CONNECT");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut byte).expect("read"), 1, "proxy closed");
        head.push(byte[0]);
    }
    assert!(head.starts_with(b"HTTP/1.1 200"), "{head:?}");
    s
}

fn report(label: &str, samples: &[f64], direct: f64) {
    let p50 = percentile(samples, 0.5);
    println!(
        "{label:<40} p50 {p50:>7.3} ms  p99 {:>7.3} ms  (+{:.3} ms over direct)",
        percentile(samples, 0.99),
        p50 - direct
    );
}

fn main() {
    // SAFETY: getuid cannot fail.
    if unsafe { libc::getuid() } != 0 {
        println!("skipped: the bench's network namespace needs root");
        return;
    }
    let n: usize = std::env::var("HUSK_BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let name = format!("husk-bench-egress-{}", std::process::id());
    let ip = |args: &[&str]| {
        let ok = Command::new("ip")
            .args(args)
            .status()
            .expect("ip")
            .success();
        assert!(ok, "ip {args:?}");
    };
    ip(&["netns", "add", &name]);
    ip(&["-n", &name, "link", "set", "lo", "up"]);
    ip(&[
        "-n",
        &name,
        "addr",
        "add",
        &format!("{SERVER_IP}/32"),
        "dev",
        "lo",
    ]);
    let netns = PathBuf::from(format!("/run/netns/{name}"));
    let dir = std::env::temp_dir().join(format!("husk-bench-egress-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");

    // The server's CA (the proxy trusts it as an operator's extra root).
    let server_ca_key = rcgen::KeyPair::generate().expect("key");
    let mut params = rcgen::CertificateParams::default();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let server_ca = params.self_signed(&server_ca_key).expect("CA");
    let server_ca_file = dir.join("server-ca.pem");
    std::fs::write(&server_ca_file, server_ca.pem()).expect("write");
    let leaf_key = rcgen::KeyPair::generate().expect("key");
    let leaf = rcgen::CertificateParams::new(vec![SERVER_IP.to_owned()])
        .expect("params")
        .signed_by(&leaf_key, &server_ca, &server_ca_key)
        .expect("leaf");
    let server_tls = Arc::new(
        rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into()),
            )
            .expect("server config"),
    );
    let (plain, secure) = servers(netns.clone(), server_tls);

    // The proxy, as the daemon runs it for a sandbox.
    let tls = Tls {
        ca: husk_core::egress::intercept::Ca::load_or_create(&dir.join("egress-ca")).expect("CA"),
        upstream: husk_core::egress::intercept::upstream_config(Some(&server_ca_file))
            .expect("roots"),
    };
    let proxy_ca = tls.ca.pem().to_owned();
    let (decisions, decided) = std::sync::mpsc::sync_channel(1024);
    std::thread::spawn(move || for _ in decided {});
    let egress = Arc::new(
        Egress::new(Some(&netns), decisions, Some(tls), Default::default()).expect("egress"),
    );
    let allow = Allowlist::parse(&[plain.to_string(), secure.to_string()]).expect("allowlist");
    let plain_socket = dir.join("plain.sock");
    let _plain_proxy = egress
        .serve("bench", allow.clone(), Vec::new(), plain_socket.clone(), 0)
        .expect("proxy");
    let secret = Secret::new(&secure.to_string(), "Authorization", "Bearer bench").expect("secret");
    let bound_socket = dir.join("bound.sock");
    let _bound_proxy = egress
        .serve("bench-bound", allow, vec![secret], bound_socket.clone(), 0)
        .expect("proxy");

    let to_server = client_config(&[server_ca.pem()]);
    let to_proxy = client_config(&[proxy_ca]);
    let get = |to: SocketAddr| format!("GET /x HTTP/1.1\r\nHost: {to}\r\n\r\n");
    let absolute = format!("GET http://{plain}/x HTTP/1.1\r\nHost: {plain}\r\n\r\n");
    // The bench itself reaches the server directly from the namespace (the
    // proxy's sockets are Unix sockets, reached by path from anywhere).
    enter(&netns);
    let direct_from_netns = |to: SocketAddr| TcpStream::connect(to).expect("direct");

    let mut times: [Vec<f64>; 5] = Default::default();
    for _ in 0..n {
        let t = Instant::now();
        request(direct_from_netns(plain), None, &get(plain));
        times[0].push(t.elapsed().as_secs_f64() * 1e3);

        let t = Instant::now();
        request(
            UnixStream::connect(&plain_socket).expect("proxy"),
            None,
            &absolute,
        );
        times[1].push(t.elapsed().as_secs_f64() * 1e3);

        let t = Instant::now();
        request(
            direct_from_netns(secure),
            Some((&to_server, secure)),
            &get(secure),
        );
        times[2].push(t.elapsed().as_secs_f64() * 1e3);

        let t = Instant::now();
        request(
            tunnel(&plain_socket, secure),
            Some((&to_server, secure)),
            &get(secure),
        );
        times[3].push(t.elapsed().as_secs_f64() * 1e3);

        let t = Instant::now();
        request(
            tunnel(&bound_socket, secure),
            Some((&to_proxy, secure)),
            &get(secure),
        );
        times[4].push(t.elapsed().as_secs_f64() * 1e3);
    }
    let [direct, proxied, direct_tls, tunnelled, opened] = times;
    let (d, dt) = (percentile(&direct, 0.5), percentile(&direct_tls, 0.5));
    println!("egress proxy, host side, {n} requests each (loopback in a private netns):");
    report("HTTP direct", &direct, d);
    report("HTTP through the proxy", &proxied, d);
    report("HTTPS direct", &direct_tls, dt);
    report("HTTPS through a tunnel", &tunnelled, dt);
    report("HTTPS with a credential (TLS opened)", &opened, dt);
    let _ = Command::new("ip").args(["netns", "delete", &name]).status();
    let _ = std::fs::remove_dir_all(&dir);
}
