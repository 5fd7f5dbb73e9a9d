//! Credentials inside TLS: the egress proxy opens the tunnels to hosts a
//! sandbox holds credentials for.
//!
//! A sandbox's programs talk TLS to such a host through a `CONNECT` tunnel
//! as to any other. For these hosts only, the proxy is the TLS server the
//! guest talks to: it answers with a certificate for the host issued by the
//! daemon's own CA ([`Ca`], kept in `<state dir>/egress-ca/`, its key never
//! leaving the host; templates trust it, see `template`), reads one HTTP/1
//! request, drops any header a credential replaces, adds the credentials and
//! sends the request on over its own TLS connection to the host, whose
//! certificate it checks against the public roots (and the operator's extra
//! roots, `husk serve --egress-upstream-ca`). The answer flows back as it
//! comes.
//!
//! What it refuses, each with an answer the guest reads inside its TLS
//! session: a request whose `Host` is not the tunnel's host (a credential is
//! for one host), a request body in chunked encoding (the proxy carries one
//! request with a `Content-Length` per connection), and anything that is not
//! HTTP/1. A guest that does not trust the CA gets a failed handshake and
//! nothing is sent to the host.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};

use rcgen::{
    date_time_ymd, BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SerialNumber,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection};
use sha2::{Digest, Sha256};

use crate::egress::{Refused, Secret};

/// The CA's subject.
const CA_NAME: &str = "husk egress CA";
/// Host certificates kept; past this the cache starts again.
const MAX_LEAVES: usize = 1024;
/// Largest request body carried to a host with credentials.
const MAX_BODY: u64 = 1 << 30;

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn invalid(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// The daemon's CA for the hosts whose tunnels the proxy opens.
pub struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
    /// The certificate guests trust, as stored.
    pem: String,
    leaves: Mutex<HashMap<String, Arc<ServerConfig>>>,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

/// The CA certificate's fields, all derived from its key: the same key
/// always gives a certificate that the stored one vouches for.
fn ca_params(key: &KeyPair) -> CertificateParams {
    let mut p = CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(DnType::OrganizationName, "husk");
    p.distinguished_name.push(DnType::CommonName, CA_NAME);
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    p.not_before = date_time_ymd(2025, 1, 1);
    p.not_after = date_time_ymd(2125, 1, 1);
    let mut serial = Sha256::digest(key.public_key_der())[..16].to_vec();
    serial[0] &= 0x7f;
    p.serial_number = Some(SerialNumber::from_slice(&serial));
    p
}

/// Writes `data` to `path` whole (a temporary file, then a rename), with
/// permission bits `mode`.
fn write_whole(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)?;
    f.write_all(data)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// Where in the state directory the daemon keeps its CA.
pub const CA_DIR: &str = "egress-ca";

/// The CA certificate the daemon with state directory `state_dir` uses, if
/// it has made one.
pub fn stored_ca_pem(state_dir: &Path) -> Option<String> {
    std::fs::read_to_string(state_dir.join(CA_DIR).join("ca.pem")).ok()
}

impl Ca {
    /// Loads the CA kept in `dir` (`ca.key`, `ca.pem`), or makes one.
    pub fn load_or_create(dir: &Path) -> io::Result<Ca> {
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        let key_path = dir.join("ca.key");
        let key = match std::fs::read_to_string(&key_path) {
            Ok(pem) => KeyPair::from_pem(&pem)
                .map_err(|e| invalid(format!("{}: {e}", key_path.display())))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let key = KeyPair::generate().map_err(invalid)?;
                write_whole(&key_path, key.serialize_pem().as_bytes(), 0o600)?;
                key
            }
            Err(e) => return Err(e),
        };
        let cert = ca_params(&key).self_signed(&key).map_err(invalid)?;
        // The stored certificate is the one guests trust: kept as long as
        // it holds this key.
        let pem_path = dir.join("ca.pem");
        let public = key.public_key_raw().to_vec();
        let stored = std::fs::read_to_string(&pem_path).ok().filter(|pem| {
            CertificateDer::from_pem_slice(pem.as_bytes())
                .is_ok_and(|der| der.windows(public.len()).any(|w| w == public))
        });
        let pem = match stored {
            Some(pem) => pem,
            None => {
                let pem = cert.pem();
                write_whole(&pem_path, pem.as_bytes(), 0o644)?;
                pem
            }
        };
        Ok(Ca {
            cert,
            key,
            pem,
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The CA certificate (PEM) that guests trust.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A TLS server configuration with a certificate for `host` (a name or
    /// an address).
    fn server_config(&self, host: &str) -> Result<Arc<ServerConfig>, String> {
        let mut leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(cfg) = leaves.get(host) {
            return Ok(cfg.clone());
        }
        let key = KeyPair::generate().map_err(|e| e.to_string())?;
        let mut p = CertificateParams::new(vec![host.to_owned()]).map_err(|e| e.to_string())?;
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name.push(DnType::CommonName, host);
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        p.not_before = date_time_ymd(2025, 1, 1);
        p.not_after = date_time_ymd(2125, 1, 1);
        p.use_authority_key_identifier_extension = true;
        let cert = p
            .signed_by(&key, &self.cert, &self.key)
            .map_err(|e| e.to_string())?;
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut cfg = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], der)
            .map_err(|e| e.to_string())?;
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        let cfg = Arc::new(cfg);
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        leaves.insert(host.to_owned(), cfg.clone());
        Ok(cfg)
    }
}

/// The TLS client configuration for hosts: the public roots, and the
/// certificates in `extra` (PEM) if given.
pub fn upstream_config(extra: Option<&Path>) -> io::Result<Arc<ClientConfig>> {
    let mut roots = RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    if let Some(path) = extra {
        let at = |e: &dyn std::fmt::Display| invalid(format!("{}: {e}", path.display()));
        let mut added = 0;
        for cert in CertificateDer::pem_file_iter(path).map_err(|e| at(&e))? {
            roots.add(cert.map_err(|e| at(&e))?).map_err(|e| at(&e))?;
            added += 1;
        }
        if added == 0 {
            return Err(at(&"no certificate in it"));
        }
    }
    let mut cfg = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(invalid)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The guest's side of the tunnel: what the proxy already read (the
/// ClientHello), then the socket.
struct Prefixed {
    first: io::Cursor<Vec<u8>>,
    sock: UnixStream,
}

impl Read for Prefixed {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if (self.first.position() as usize) < self.first.get_ref().len() {
            return self.first.read(buf);
        }
        self.sock.read(buf)
    }
}

impl Write for Prefixed {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.sock.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.sock.flush()
    }
}

/// A request inside the tunnel, checked: the head to send (line by line,
/// as `egress::compose` takes it) and its body's length.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Inner {
    pub lines: Vec<String>,
    pub body: u64,
}

/// Checks a request read inside a tunnel to `host:port`.
pub(crate) fn parse_inner(head: &[u8], host: &str, port: u16) -> Result<Inner, Refused> {
    let crate::egress::Head {
        method,
        target,
        version,
        headers,
    } = crate::egress::parse_head(head)?;
    let first = format!("{method} {target} HTTP/1.{version}");
    if !target.starts_with('/') {
        return Err(Refused::Bad(format!(
            "`{first}` is not an HTTP/1 request in origin form"
        )));
    }
    let mut out = vec![first];
    let mut seen_host = None;
    let mut body: Option<u64> = None;
    for (name, value) in &headers {
        let line = format!("{name}: {value}");
        let value = value.as_str();
        match name.to_ascii_lowercase().as_str() {
            "host" => {
                if seen_host.replace(value.to_owned()).is_some() {
                    return Err(Refused::Bad("two Host headers".into()));
                }
            }
            "content-length" => {
                let n: u64 = value
                    .parse()
                    .map_err(|_| Refused::Bad(format!("Content-Length `{value}`")))?;
                if body.is_some_and(|b| b != n) {
                    return Err(Refused::Bad("two different Content-Lengths".into()));
                }
                if n > MAX_BODY {
                    return Err(Refused::Bad(format!(
                        "a request body of {n} bytes; at most {MAX_BODY} through the proxy"
                    )));
                }
                body = Some(n);
                out.push(line);
            }
            "transfer-encoding" => {
                return Err(Refused::Bad(
                    "a chunked request body to a host this sandbox holds credentials for: \
                     send it with a Content-Length"
                        .into(),
                ))
            }
            "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authorization"
            | "te"
            | "upgrade" => {}
            _ => out.push(line),
        }
    }
    let Some(named) = seen_host else {
        return Err(Refused::Bad("the request has no Host header".into()));
    };
    let matches = crate::egress::split_host_port(&named)
        .is_ok_and(|(h, p)| crate::egress::normalise(h) == host && p.unwrap_or(443) == port);
    if !matches {
        return Err(Refused::Denied(format!(
            "blocked by sandbox policy: a request for {named} inside the tunnel to {}",
            crate::egress::authority_of(host, Some(port))
        )));
    }
    out.insert(1, format!("Host: {named}"));
    Ok(Inner {
        lines: out,
        body: body.unwrap_or(0),
    })
}

/// What one intercepted tunnel needs.
pub(crate) struct Tunnel<'a> {
    pub ca: &'a Ca,
    pub upstream_tls: Arc<ClientConfig>,
    pub host: &'a str,
    pub port: u16,
    pub secrets: &'a [&'a Secret],
    pub vault: &'a crate::egress::Vault,
}

/// Carries one request through a tunnel the proxy opens: `guest` after the
/// `200` (with `hello` read from it already), `upstream` connected to the
/// checked address. Returns what happened, for the audit log; `Err` when
/// nothing was sent to the host.
pub(crate) fn carry(
    t: &Tunnel<'_>,
    guest: UnixStream,
    hello: Vec<u8>,
    upstream: TcpStream,
) -> Result<String, String> {
    let cfg = t.ca.server_config(t.host)?;
    let conn = ServerConnection::new(cfg).map_err(|e| e.to_string())?;
    let mut g = rustls::StreamOwned::new(
        conn,
        Prefixed {
            first: io::Cursor::new(hello),
            sock: guest,
        },
    );
    let (head, rest) = match crate::egress::read_head(&mut g) {
        Ok(v) => v,
        Err(Refused::Bad(e)) if g.conn.is_handshaking() => {
            return Err(format!(
                "the guest's TLS handshake failed ({e}): does it trust the husk egress CA?"
            ))
        }
        Err(r) => return Err(answer_inside(&mut g, r)),
    };
    let inner = match parse_inner(&head, t.host, t.port) {
        Ok(i) => i,
        Err(r) => return Err(answer_inside(&mut g, r)),
    };
    let name = ServerName::try_from(t.host.to_owned()).map_err(|e| e.to_string())?;
    let client = ClientConnection::new(t.upstream_tls.clone(), name).map_err(|e| e.to_string())?;
    let head = match crate::egress::compose(&inner.lines, t.secrets, t.vault) {
        Ok(head) => head,
        Err(why) => return Err(answer_inside(&mut g, Refused::Unreachable(why))),
    };
    let mut u = rustls::StreamOwned::new(client, upstream);
    let sent = u.write_all(&head).and_then(|()| {
        let early = &rest[..rest.len().min(inner.body as usize)];
        u.write_all(early)?;
        let left = inner.body - early.len() as u64;
        let copied = io::copy(&mut (&mut g).take(left), &mut u)?;
        if copied < left {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the guest stopped inside the request body",
            ));
        }
        u.flush()
    });
    if let Err(e) = sent {
        let msg = format!(
            "TLS to {}: {e}",
            crate::egress::authority_of(t.host, Some(t.port))
        );
        return Err(answer_inside(&mut g, Refused::Unreachable(msg)));
    }
    // The answer, as it comes, until the host closes (the request said
    // `Connection: close`). A host that closes without TLS's goodbye ends
    // the answer as well.
    let mut buf = vec![0u8; 16 << 10];
    let mut answered = 0u64;
    loop {
        match u.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if g.write_all(&buf[..n]).and_then(|()| g.flush()).is_err() {
                    break;
                }
                answered += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
            Err(_) => break,
        }
    }
    g.conn.send_close_notify();
    let _ = g.flush();
    let method = inner.lines[0].split(' ').next().unwrap_or_default();
    Ok(format!("{method} inside, {answered} bytes answered"))
}

/// Answers the guest inside its TLS session; returns the reason.
fn answer_inside(g: &mut rustls::StreamOwned<ServerConnection, Prefixed>, r: Refused) -> String {
    let (status, msg) = r.status();
    let _ = g.write_all(&crate::egress::answer(status, &msg));
    g.conn.send_close_notify();
    let _ = g.flush();
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_is_kept_and_its_host_certificates_chain_to_it() {
        let dir = std::env::temp_dir().join(format!("husk-ca-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = Ca::load_or_create(&dir).expect("new CA");
        let again = Ca::load_or_create(&dir).expect("the same CA");
        assert_eq!(ca.pem(), again.pem());
        let mode = std::fs::metadata(dir.join("ca.key"))
            .expect("key")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // A client trusting the stored certificate accepts a host
        // certificate from the reloaded CA (a handshake in memory).
        let mut roots = RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.pem().as_bytes()).expect("pem"))
            .expect("root");
        let client_cfg = Arc::new(
            ClientConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .expect("versions")
                .with_root_certificates(roots)
                .with_no_client_auth(),
        );
        for host in ["api.example.com", "198.51.100.7"] {
            let server_cfg = again.server_config(host).expect("leaf");
            let mut server = ServerConnection::new(server_cfg).expect("server");
            let name = ServerName::try_from(host.to_owned()).expect("name");
            let mut client = ClientConnection::new(client_cfg.clone(), name).expect("client");
            let mut rounds = 0;
            while client.is_handshaking() || server.is_handshaking() {
                let mut wire = Vec::new();
                client.write_tls(&mut wire).expect("client out");
                server.read_tls(&mut &wire[..]).expect("server in");
                server.process_new_packets().expect("server accepts");
                let mut wire = Vec::new();
                server.write_tls(&mut wire).expect("server out");
                client.read_tls(&mut &wire[..]).expect("client in");
                client
                    .process_new_packets()
                    .expect("client trusts the host certificate");
                rounds += 1;
                assert!(rounds < 10, "no handshake");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn requests_inside_a_tunnel_must_be_for_its_host() {
        let ok = parse_inner(
            b"POST /v1/x HTTP/1.1\r\nHost: api.test\r\nAuthorization: p\r\nContent-Length: 5\r\nConnection: keep-alive\r\n\r\n",
            "api.test",
            443,
        )
        .ok()
        .expect("accepted");
        assert_eq!(
            ok.lines,
            [
                "POST /v1/x HTTP/1.1",
                "Host: api.test",
                "Authorization: p",
                "Content-Length: 5"
            ]
        );
        assert_eq!(ok.body, 5);
        let refused = |head: &[u8]| match parse_inner(head, "api.test", 443) {
            Err(Refused::Bad(m)) | Err(Refused::Denied(m)) => m,
            _ => panic!("accepted {}", String::from_utf8_lossy(head)),
        };
        assert!(refused(b"GET / HTTP/1.1\r\nHost: evil.test\r\n\r\n").contains("evil.test"));
        assert!(refused(b"GET / HTTP/1.1\r\nHost: api.test:8443\r\n\r\n").contains("8443"));
        assert!(refused(b"GET / HTTP/1.1\r\n\r\n").contains("no Host"));
        assert!(
            refused(b"GET / HTTP/1.1\r\nHost: api.test\r\nHost: evil.test\r\n\r\n")
                .contains("two Host")
        );
        assert!(refused(
            b"POST / HTTP/1.1\r\nHost: api.test\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        .contains("chunked"));
        assert!(refused(
            b"POST / HTTP/1.1\r\nHost: api.test\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"
        )
        .contains("Content-Length"));
        assert!(
            refused(b"GET http://evil.test/ HTTP/1.1\r\nHost: api.test\r\n\r\n")
                .contains("origin form")
        );
        assert!(refused(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").contains("HTTP/1"));
    }
}
