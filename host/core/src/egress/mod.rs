//! The egress proxy: the only way out of a sandbox.
//!
//! A guest has no route off its VM: no NIC, or a TAP in a network namespace
//! of its own. What it may reach goes through this proxy, which the guest
//! sees as an HTTP(S) proxy on its loopback (`127.0.0.1:3128`; guest-init
//! carries each connection over vsock to `<vsock socket>_3128`, where the
//! daemon listens for that sandbox).
//!
//! Each connection is one request: `CONNECT host:port` (a tunnel, for
//! HTTPS) or a plain-HTTP request in absolute form (`GET http://host/...`).
//! The proxy
//! 1. checks the host and port against the sandbox's allowlist ([`Allowlist`]:
//!    exact names, `*.` wildcards, IP literals, optional ports);
//! 2. resolves the name itself and refuses it if *any* address it resolves
//!    to is private, loopback, link-local (the metadata address included) or
//!    otherwise not public ([`refusal`]): a name cannot smuggle the guest
//!    onto the host's network;
//! 3. connects to the address it checked (never to a name again, so a second
//!    resolution cannot change the answer);
//! 4. in a tunnel, reads the TLS ClientHello the guest sends first and
//!    checks its server name against the allowlist as well, before one byte
//!    reaches the server.
//!
//! A refusal is an HTTP answer a program (or an agent reading its output)
//! can act on: `403` with `blocked by sandbox policy: <host> is not in this
//! sandbox's allowlist`. Every decision, allowed or not, goes to the audit
//! log. The proxy's own sockets can be opened in a network namespace the
//! operator names (`husk serve --egress-netns`), so the way out itself can be
//! confined.

pub mod intercept;

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, RwLock};
use std::time::Duration;

/// Largest request head (request line and headers) read from the guest.
const MAX_HEAD: usize = 16 << 10;
/// Largest TLS record awaited for the ClientHello's server name.
const MAX_HELLO: usize = 16 << 10;
/// How long the guest may take to send a request head. Generous: the guest
/// may be slow (an emulating host) or busy.
const HEAD_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a connection to the destination may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// A tunnel with no traffic either way for this long is closed.
const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// Connections one sandbox may have through the proxy at once.
pub const MAX_CONNS: usize = 64;

/// One entry of an allowlist.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostPattern {
    /// Any host (the address checks still apply).
    Any,
    /// Exactly this name (lowercase, no trailing dot).
    Name(String),
    /// Any name below this one: `*.example.com` is stored as `.example.com`
    /// and matches `a.example.com`, not `example.com`.
    Below(String),
    Ip(IpAddr),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    host: HostPattern,
    /// None: any port.
    port: Option<u16>,
}

/// Where a sandbox may connect: names, wildcards, IP literals, each with an
/// optional port (`api.example.com`, `*.example.com:443`, `203.0.113.7:8080`,
/// `[2001:db8::1]:443`, `*`). Empty: nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowlist {
    rules: Vec<Rule>,
}

/// A host as it is compared: lowercase, without a trailing dot or the
/// brackets of an IPv6 literal.
pub(crate) fn normalise(host: &str) -> String {
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    host.trim_end_matches('.').to_ascii_lowercase()
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// Splits `host[:port]` (IPv6 literals in brackets).
pub(crate) fn split_host_port(s: &str) -> Result<(&str, Option<u16>), String> {
    let bad_port = |p: &str| format!("`{s}`: `{p}` is not a port (1-65535)");
    let port = |p: &str| match p.parse::<u16>() {
        Ok(0) | Err(_) => Err(bad_port(p)),
        Ok(n) => Ok(Some(n)),
    };
    if let Some(rest) = s.strip_prefix('[') {
        let (ip, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("`{s}`: unclosed `[`"))?;
        return match after {
            "" => Ok((ip, None)),
            _ => match after.strip_prefix(':') {
                Some(p) => Ok((ip, port(p)?)),
                None => Err(format!("`{s}`: expected `:port` after `]`")),
            },
        };
    }
    match s.rsplit_once(':') {
        // More than one colon and no brackets: a bare IPv6 literal.
        Some((h, _)) if h.contains(':') => Ok((s, None)),
        Some((h, p)) => Ok((h, port(p)?)),
        None => Ok((s, None)),
    }
}

impl Allowlist {
    /// Parses the entries; an entry that is not a name, a wildcard or an
    /// address is an error naming it.
    pub fn parse(entries: &[String]) -> Result<Allowlist, String> {
        let mut rules = Vec::with_capacity(entries.len());
        for entry in entries {
            let (raw, port) = split_host_port(entry.trim())?;
            let host = normalise(raw);
            let pattern = if raw == "*" {
                HostPattern::Any
            } else if let Ok(ip) = host.parse::<IpAddr>() {
                HostPattern::Ip(ip)
            } else if let Some(below) = host.strip_prefix("*.") {
                if !valid_name(below) {
                    return Err(format!(
                        "`{entry}` is not a valid wildcard (`*.example.com`)"
                    ));
                }
                HostPattern::Below(format!(".{below}"))
            } else if valid_name(&host) {
                HostPattern::Name(host)
            } else {
                return Err(format!(
                    "`{entry}` is not a host name, `*.domain` wildcard, IP address or `*`"
                ));
            };
            rules.push(Rule {
                host: pattern,
                port,
            });
        }
        Ok(Allowlist { rules })
    }

    /// Whether it allows nothing.
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Whether `host` (a name or an address literal) on `port` is allowed.
    pub fn allows(&self, host: &str, port: u16) -> bool {
        let host = normalise(host);
        let ip = host.parse::<IpAddr>().ok();
        self.rules.iter().any(|rule| {
            rule.port.is_none_or(|p| p == port)
                && match &rule.host {
                    HostPattern::Any => true,
                    HostPattern::Name(name) => *name == host,
                    HostPattern::Below(suffix) => ip.is_none() && host.ends_with(suffix.as_str()),
                    HostPattern::Ip(allowed) => ip == Some(*allowed),
                }
        })
    }
}

/// A credential the proxy adds to a sandbox's requests to the hosts it is
/// bound to; the guest never sees it. Any header of the same name the guest
/// sent itself is dropped first.
#[derive(Clone)]
pub struct Secret {
    hosts: Allowlist,
    header: String,
    value: String,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secret")
            .field("hosts", &self.hosts)
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

impl Secret {
    /// `host` as an allowlist entry (`api.example.com`, `*.example.com:443`),
    /// `header` a header name, `value` its value.
    pub fn new(host: &str, header: &str, value: &str) -> Result<Secret, String> {
        let hosts = Allowlist::parse(&[host.to_owned()])?;
        let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
        if header.is_empty() || !header.bytes().all(token) {
            return Err(format!("`{header}` is not a header name"));
        }
        if matches!(
            header.to_ascii_lowercase().as_str(),
            "host" | "connection" | "content-length" | "transfer-encoding"
        ) {
            return Err(format!("`{header}` cannot carry a credential"));
        }
        if value.is_empty() || value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
            return Err(format!(
                "the value for `{header}` must be one non-empty line"
            ));
        }
        Ok(Secret {
            hosts,
            header: header.to_owned(),
            value: value.to_owned(),
        })
    }
}

/// The daemon's named secrets, which credentials' values name
/// (`${husk.secrets.NAME}`): shared by every sandbox's proxy and read per
/// request, so a secret's new value is used from the next request on and a
/// deleted one no longer. Never printed.
#[derive(Clone, Default)]
pub struct Vault(Arc<RwLock<HashMap<String, String>>>);

impl std::fmt::Debug for Vault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vault").finish_non_exhaustive()
    }
}

impl Vault {
    /// Sets secret `name`'s value.
    pub fn set(&self, name: &str, value: &str) {
        self.0
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_owned(), value.to_owned());
    }

    /// Forgets secret `name`.
    pub fn remove(&self, name: &str) {
        self.0
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
    }

    /// Whether every one of `secrets` resolves (see [`Vault::resolve`]).
    fn check(&self, secrets: &[&Secret]) -> Result<(), Refused> {
        for s in secrets {
            self.resolve(&s.value).map_err(|why| {
                Refused::Unreachable(format!("the credential for `{}`: {why}", s.header))
            })?;
        }
        Ok(())
    }

    /// `text` with every `${husk.secrets.NAME}` replaced by that secret's
    /// value; why not if one names no secret.
    fn resolve(&self, text: &str) -> Result<String, String> {
        use husk_types::SECRET_PLACEHOLDER as OPEN;
        if !text.contains(OPEN) {
            return Ok(text.to_owned());
        }
        let secrets = self.0.read().unwrap_or_else(|e| e.into_inner());
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(at) = rest.find(OPEN) {
            out.push_str(&rest[..at]);
            let after = &rest[at + OPEN.len()..];
            let Some(end) = after.find('}') else {
                return Err("a secret's placeholder is not closed with `}`".into());
            };
            let name = &after[..end];
            match secrets.get(name) {
                Some(value) => out.push_str(value),
                None => return Err(format!("it names secret `{name}`, which does not exist")),
            }
            rest = &after[end + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }
}

/// Why `ip` may not be reached from a sandbox, or None for a public address.
pub fn refusal(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => refusal_v4(v4),
        IpAddr::V6(v6) => {
            let s = v6.segments();
            if let Some(v4) = v6.to_ipv4_mapped() {
                return refusal_v4(v4);
            }
            // NAT64 (64:ff9b::/96) reaches the IPv4 address it embeds.
            if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                let [a, b] = s[6].to_be_bytes();
                let [c, d] = s[7].to_be_bytes();
                return refusal_v4(Ipv4Addr::new(a, b, c, d));
            }
            if v6.is_unspecified() {
                Some("the unspecified address")
            } else if v6.is_loopback() {
                Some("a loopback address")
            } else if s[0] & 0xfe00 == 0xfc00 {
                Some("a private (unique local) address")
            } else if s[0] & 0xffc0 == 0xfe80 || s[0] & 0xffc0 == 0xfec0 {
                Some("a link-local address")
            } else if s[0] & 0xff00 == 0xff00 {
                Some("a multicast address")
            } else if s[..6] == [0; 6] {
                Some("an IPv4-compatible address")
            } else {
                None
            }
        }
    }
}

fn refusal_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    if ip == Ipv4Addr::new(169, 254, 169, 254) {
        Some("the cloud metadata address")
    } else if a == 0 {
        Some("an unspecified (0.0.0.0/8) address")
    } else if a == 127 {
        Some("a loopback address")
    } else if a == 10 || (a == 172 && b & 0xf0 == 16) || (a == 192 && b == 168) {
        Some("a private address")
    } else if a == 100 && b & 0xc0 == 64 {
        Some("a shared (carrier-grade NAT) address")
    } else if a == 169 && b == 254 {
        Some("a link-local address")
    } else if a == 192 && b == 0 && c == 0 {
        Some("an IETF protocol address")
    } else if a == 198 && b & 0xfe == 18 {
        Some("a benchmarking address")
    } else if a >= 224 {
        Some("a multicast, reserved or broadcast address")
    } else {
        None
    }
}

/// One decision, for the audit log.
#[derive(Debug, Clone)]
pub struct Decision {
    /// The sandbox that asked.
    pub sandbox: String,
    /// Whether the connection was carried.
    pub allowed: bool,
    /// What was asked and why it was decided so.
    pub detail: String,
}

/// What every sandbox's proxy shares.
#[derive(Debug)]
pub struct Egress {
    /// The network namespace the proxy's sockets are opened in, if not the
    /// daemon's.
    netns: Option<File>,
    decisions: mpsc::SyncSender<Decision>,
    tls: Option<Tls>,
    vault: Vault,
}

/// What the proxy needs to open tunnels to hosts with credentials
/// (`intercept`).
#[derive(Debug)]
pub struct Tls {
    /// The CA that signs the certificates the proxy shows guests.
    pub ca: crate::egress::intercept::Ca,
    /// How the proxy checks the real hosts' certificates.
    pub upstream: Arc<rustls::ClientConfig>,
}

impl Egress {
    /// `netns`: a network namespace file (`/run/netns/NAME`) whose network
    /// the proxy uses to resolve and connect. `decisions` receives every
    /// decision; when it is full, decisions are counted in the log instead
    /// of slowing the proxy. `tls`: how to carry credentials into TLS
    /// (None: tunnels stay closed to the proxy, and credentials reach
    /// plain-HTTP requests only).
    pub fn new(
        netns: Option<&Path>,
        decisions: mpsc::SyncSender<Decision>,
        tls: Option<Tls>,
        vault: Vault,
    ) -> io::Result<Egress> {
        let netns = match netns {
            Some(p) => Some(File::open(p).map_err(|e| {
                io::Error::new(e.kind(), format!("network namespace {}: {e}", p.display()))
            })?),
            None => None,
        };
        Ok(Egress {
            netns,
            decisions,
            tls,
            vault,
        })
    }

    /// The named secrets credentials may name.
    pub fn vault(&self) -> &Vault {
        &self.vault
    }

    /// Starts a sandbox's proxy, listening at `socket` (the VMM's vsock
    /// socket path + `_3128`), owned by `uid` (the VMM's jail user; 0 for
    /// none) so its VMM may connect.
    pub fn serve(
        self: &Arc<Self>,
        sandbox: &str,
        allow: Allowlist,
        secrets: Vec<Secret>,
        socket: PathBuf,
        uid: u32,
    ) -> io::Result<Proxy> {
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket)?;
        if uid != 0 {
            std::os::unix::fs::chown(&socket, Some(uid), Some(uid))?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let policy = Arc::new(RwLock::new(Arc::new(Policy { allow, secrets })));
        let shared = Arc::new(Sandbox {
            id: sandbox.to_owned(),
            policy: policy.clone(),
            egress: self.clone(),
            active: AtomicUsize::new(0),
        });
        let l = listener.try_clone()?;
        let s = stop.clone();
        std::thread::Builder::new()
            .name(format!("egress-{sandbox}"))
            .spawn(move || accept_loop(l, shared, s))?;
        Ok(Proxy {
            socket,
            listener,
            stop,
            policy,
        })
    }

    /// The CA certificate (PEM) guests trust for the hosts the proxy
    /// opens tunnels to, if it does.
    pub fn ca_pem(&self) -> Option<&str> {
        self.tls.as_ref().map(|t| t.ca.pem())
    }

    fn record(&self, sandbox: &str, allowed: bool, detail: String) {
        tracing::info!(sandbox, allowed, "egress: {detail}");
        let _ = self.decisions.try_send(Decision {
            sandbox: sandbox.to_owned(),
            allowed,
            detail,
        });
    }
}

/// A sandbox's running proxy; dropping it stops it and removes its socket.
#[derive(Debug)]
pub struct Proxy {
    socket: PathBuf,
    listener: UnixListener,
    stop: Arc<AtomicBool>,
    policy: Arc<RwLock<Arc<Policy>>>,
}

impl Proxy {
    /// Replaces the sandbox's policy: connections made from now on follow
    /// it; those open keep the policy they were checked by.
    pub fn set_policy(&self, allow: Allowlist, secrets: Vec<Secret>) {
        *self.policy.write().unwrap_or_else(|e| e.into_inner()) =
            Arc::new(Policy { allow, secrets });
    }
}

/// Where a sandbox may connect, and what the proxy adds on the way.
#[derive(Debug)]
struct Policy {
    allow: Allowlist,
    secrets: Vec<Secret>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept: a shut-down listening socket fails accept().
        // SAFETY: shutdown on a socket this Proxy owns.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        let _ = std::fs::remove_file(&self.socket);
    }
}

#[derive(Debug)]
struct Sandbox {
    id: String,
    policy: Arc<RwLock<Arc<Policy>>>,
    egress: Arc<Egress>,
    active: AtomicUsize,
}

impl Sandbox {
    /// The policy a connection made now is checked by.
    fn policy(&self) -> Arc<Policy> {
        self.policy
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

fn accept_loop(listener: UnixListener, sandbox: Arc<Sandbox>, stop: Arc<AtomicBool>) {
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let mut conn = match accepted {
            Ok((c, _)) => c,
            Err(e) => {
                tracing::warn!(sandbox = %sandbox.id, "egress: accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if sandbox.active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNS {
            sandbox.active.fetch_sub(1, Ordering::SeqCst);
            let _ = conn.set_write_timeout(Some(HEAD_TIMEOUT));
            let msg = format!("blocked by sandbox policy: at most {MAX_CONNS} connections at once");
            let _ = conn.write_all(&answer("503 Service Unavailable", &msg));
            continue;
        }
        let s = sandbox.clone();
        let spawned = std::thread::Builder::new()
            .name("egress-conn".into())
            .spawn(move || {
                handle(conn, &s);
                s.active.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            sandbox.active.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A complete response that ends the connection.
pub(crate) fn answer(status: &str, message: &str) -> Vec<u8> {
    let body = format!("{message}\n");
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n\
         X-Husk-Egress: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        if status.starts_with("403") {
            "denied"
        } else {
            "error"
        },
        body.len()
    )
    .into_bytes()
}

/// A request as the proxy sees it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Request {
    method: String,
    host: String,
    port: u16,
    /// For plain HTTP: the head to send on, in origin form, line by line
    /// (without `Connection` and the blank line, which [`compose`] adds
    /// after any credentials).
    forward: Option<Vec<String>>,
}

/// Most headers a request head may have.
const MAX_HEADERS: usize = 128;

/// An HTTP/1 request head, as httparse reads it.
pub(crate) struct Head {
    pub method: String,
    pub target: String,
    /// The minor version: HTTP/1.0 or HTTP/1.1.
    pub version: u8,
    /// Each header's name (as sent) and value (UTF-8, trimmed).
    pub headers: Vec<(String, String)>,
}

/// Reads a whole request head (up to and including its blank line):
/// anything that is not a well-formed HTTP/1 head, a header folded over
/// lines or a value that is not UTF-8 is refused with a reason.
pub(crate) fn parse_head(head: &[u8]) -> Result<Head, Refused> {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut slots);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => {
            return Err(Refused::Bad("the request head is incomplete".into()))
        }
        Err(httparse::Error::TooManyHeaders) => {
            return Err(Refused::Bad(format!(
                "more than {MAX_HEADERS} headers in the request"
            )))
        }
        Err(e) => return Err(Refused::Bad(format!("not an HTTP/1 request head: {e}"))),
    }
    let (Some(method), Some(target), Some(version)) = (req.method, req.path, req.version) else {
        return Err(Refused::Bad("not an HTTP/1 request head".into()));
    };
    let headers = req
        .headers
        .iter()
        .map(|h| match std::str::from_utf8(h.value) {
            Ok(v) => Ok((h.name.to_owned(), v.trim().to_owned())),
            Err(_) => Err(Refused::Bad(format!("header `{}` is not UTF-8", h.name))),
        })
        .collect::<Result<_, _>>()?;
    Ok(Head {
        method: method.to_owned(),
        target: target.to_owned(),
        version,
        headers,
    })
}

/// Why a connection ended before it was carried.
pub(crate) enum Refused {
    /// The guest's request was not understood (400).
    Bad(String),
    /// Policy (403).
    Denied(String),
    /// The destination could not be reached (502).
    Unreachable(String),
}

impl Refused {
    /// The HTTP status of the answer, and the message.
    pub(crate) fn status(self) -> (&'static str, String) {
        match self {
            Refused::Bad(m) => ("400 Bad Request", m),
            Refused::Denied(m) => ("403 Forbidden", m),
            Refused::Unreachable(m) => ("502 Bad Gateway", m),
        }
    }
}

/// Reads the request head: up to the blank line. Returns it and what came
/// after it in the same reads.
pub(crate) fn read_head(conn: &mut impl Read) -> Result<(Vec<u8>, Vec<u8>), Refused> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(end + 4);
            return Ok((buf, rest));
        }
        if buf.len() > MAX_HEAD {
            return Err(Refused::Bad(format!(
                "the request head is longer than {MAX_HEAD} bytes"
            )));
        }
        match conn.read(&mut chunk) {
            Ok(0) => {
                return Err(Refused::Bad(
                    "the connection ended inside the request head".into(),
                ))
            }
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(Refused::Bad(format!("reading the request: {e}"))),
        }
    }
}

/// Parses the head into a request (see the module docs).
pub(crate) fn parse(head: &[u8]) -> Result<Request, Refused> {
    let Head {
        method,
        target,
        version,
        headers,
    } = parse_head(head)?;
    let (method, target) = (method.as_str(), target.as_str());
    if method == "CONNECT" {
        let (host, port) = split_host_port(target).map_err(Refused::Bad)?;
        let port = port.ok_or_else(|| Refused::Bad(format!("CONNECT `{target}` has no port")))?;
        return Ok(Request {
            method: method.into(),
            host: normalise(host),
            port,
            forward: None,
        });
    }
    let Some(rest) = target.strip_prefix("http://") else {
        let msg = if target.starts_with("https://") {
            format!("`{target}`: use CONNECT for https (set HTTPS_PROXY)")
        } else {
            format!("`{target}` is not an absolute http:// URL (this is a proxy)")
        };
        return Err(Refused::Bad(msg));
    };
    let (authority, path) = match rest.find(['/', '?']) {
        Some(i) if rest.as_bytes()[i] == b'/' => (&rest[..i], rest[i..].to_owned()),
        Some(i) => (&rest[..i], format!("/{}", &rest[i..])),
        None => (rest, "/".to_owned()),
    };
    if authority.contains('@') {
        return Err(Refused::Bad(
            "credentials in the URL are not forwarded".into(),
        ));
    }
    let (host, port) = split_host_port(authority).map_err(Refused::Bad)?;
    let host = normalise(host);
    let port = port.unwrap_or(80);
    // The head sent on: origin form, the authority as Host, no proxy or
    // hop-by-hop headers, one request per connection.
    let mut out = vec![format!("{method} {path} HTTP/1.{version}")];
    let host_header = if port == 80 {
        authority_of(&host, None)
    } else {
        authority_of(&host, Some(port))
    };
    out.push(format!("Host: {host_header}"));
    for (name, value) in headers {
        if matches!(
            name.to_ascii_lowercase().as_str(),
            "host"
                | "connection"
                | "keep-alive"
                | "proxy-connection"
                | "proxy-authorization"
                | "te"
        ) {
            continue;
        }
        out.push(format!("{name}: {value}"));
    }
    Ok(Request {
        method: method.into(),
        host,
        port,
        forward: Some(out),
    })
}

/// A header line's name, lowercase.
fn header_name(line: &str) -> String {
    line.split(':')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

/// The head to send: the guest's lines without any header a credential
/// replaces, then the credentials (their secrets' placeholders resolved
/// from `vault`), then the end of the head; why not, naming the header,
/// where a credential names a secret that does not exist.
pub(crate) fn compose(
    lines: &[String],
    secrets: &[&Secret],
    vault: &Vault,
) -> Result<Vec<u8>, String> {
    let replaced: Vec<String> = secrets
        .iter()
        .map(|s| s.header.to_ascii_lowercase())
        .collect();
    let mut out = String::new();
    for (i, line) in lines.iter().enumerate() {
        if i > 0 && replaced.contains(&header_name(line)) {
            continue;
        }
        out.push_str(line);
        out.push_str("\r\n");
    }
    for s in secrets {
        let value = vault
            .resolve(&s.value)
            .map_err(|why| format!("the credential for `{}`: {why}", s.header))?;
        out.push_str(&format!("{}: {value}\r\n", s.header));
    }
    out.push_str("Connection: close\r\n\r\n");
    Ok(out.into_bytes())
}

pub(crate) fn authority_of(host: &str, port: Option<u16>) -> String {
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    match port {
        Some(p) => format!("{host}:{p}"),
        None => host,
    }
}

/// Enters the configured network namespace (this thread only).
fn enter_netns(egress: &Egress) -> io::Result<()> {
    if let Some(ns) = &egress.netns {
        // SAFETY: setns on a namespace file we hold; it changes this
        // thread's network namespace only.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Resolves and checks the destination; connects to a checked address.
fn connect(req: &Request) -> Result<(TcpStream, SocketAddr), Refused> {
    let addrs: Vec<SocketAddr> = (req.host.as_str(), req.port)
        .to_socket_addrs()
        .map_err(|e| Refused::Unreachable(format!("cannot resolve {}: {e}", req.host)))?
        .collect();
    if addrs.is_empty() {
        return Err(Refused::Unreachable(format!("{} has no address", req.host)));
    }
    if let Some((ip, why)) = addrs
        .iter()
        .find_map(|a| refusal(a.ip()).map(|w| (a.ip(), w)))
    {
        let msg = if req.host.parse::<IpAddr>().is_ok() {
            format!("blocked by sandbox policy: {} is {why}", req.host)
        } else {
            format!(
                "blocked by sandbox policy: {} resolves to {ip}, {why}",
                req.host
            )
        };
        return Err(Refused::Denied(msg));
    }
    let mut last = None;
    for addr in &addrs {
        match TcpStream::connect_timeout(addr, CONNECT_TIMEOUT) {
            Ok(s) => return Ok((s, *addr)),
            Err(e) => last = Some(e),
        }
    }
    let e = last.map_or_else(String::new, |e| e.to_string());
    Err(Refused::Unreachable(format!(
        "cannot connect to {}: {e}",
        authority_of(&req.host, Some(req.port))
    )))
}

/// Answers a refused request and records the decision.
fn refuse(conn: &mut UnixStream, sandbox: &Sandbox, what: Option<&str>, refused: Refused) {
    let (status, msg) = refused.status();
    let what = what.unwrap_or("(malformed request)");
    sandbox
        .egress
        .record(&sandbox.id, false, format!("deny {what}: {msg}"));
    let _ = conn.write_all(&answer(status, &msg));
}

fn handle(mut conn: UnixStream, sandbox: &Sandbox) {
    let _ = conn.set_read_timeout(Some(HEAD_TIMEOUT));
    let _ = conn.set_write_timeout(Some(HEAD_TIMEOUT));
    let egress = &sandbox.egress;
    let (head, rest) = match read_head(&mut conn) {
        Ok(v) => v,
        Err(r) => return refuse(&mut conn, sandbox, None, r),
    };
    let req = match parse(&head) {
        Ok(r) => r,
        Err(r) => return refuse(&mut conn, sandbox, None, r),
    };
    let what = format!("{} {}", req.method, authority_of(&req.host, Some(req.port)));
    let policy = sandbox.policy();
    let bound: Vec<&Secret> = policy
        .secrets
        .iter()
        .filter(|s| s.hosts.allows(&req.host, req.port))
        .collect();
    let checked = if policy.allow.allows(&req.host, req.port) {
        // A credential that names a secret no longer there: refused before
        // anything reaches the host.
        egress
            .vault
            .check(&bound)
            .and_then(|()| {
                enter_netns(egress)
                    .map_err(|e| Refused::Unreachable(format!("the egress network namespace: {e}")))
            })
            .and_then(|()| connect(&req))
    } else {
        Err(Refused::Denied(format!(
            "blocked by sandbox policy: {} is not in this sandbox's allowlist",
            authority_of(&req.host, Some(req.port))
        )))
    };
    let (upstream, addr) = match checked {
        Ok(v) => v,
        Err(r) => return refuse(&mut conn, sandbox, Some(&what), r),
    };
    let _ = upstream.set_nodelay(true);
    let mut upstream = upstream;
    let _ = conn.set_read_timeout(Some(IDLE_TIMEOUT));
    let _ = conn.set_write_timeout(Some(IDLE_TIMEOUT));
    let _ = upstream.set_read_timeout(Some(IDLE_TIMEOUT));
    let _ = upstream.set_write_timeout(Some(IDLE_TIMEOUT));
    // The server's side flows at once (a server may speak first); the
    // guest's side is checked first.
    let (Ok(mut guest_out), Ok(mut upstream_in)) = (conn.try_clone(), upstream.try_clone()) else {
        return;
    };
    let mut credentials = String::new();
    if !bound.is_empty() {
        let names: Vec<&str> = bound.iter().map(|s| s.header.as_str()).collect();
        credentials = format!(" (with the host's {})", names.join(", "));
        if req.forward.is_none() {
            return open_tunnel(conn, rest, upstream, sandbox, &req, &bound, &what, addr);
        }
    }
    if let Some(lines) = &req.forward {
        let head = match compose(lines, &bound, &egress.vault) {
            Ok(head) => head,
            Err(why) => {
                let msg = format!("{what}: {why}");
                let _ = conn.write_all(&answer("502 Bad Gateway", &msg));
                return egress.record(&sandbox.id, false, msg);
            }
        };
        if upstream.write_all(&head).is_err() {
            let msg = format!("{what}: the server closed the connection");
            let _ = conn.write_all(&answer("502 Bad Gateway", &msg));
            return;
        }
    } else if conn
        .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .is_err()
    {
        return;
    }
    let down = std::thread::Builder::new()
        .name("egress-down".into())
        .spawn(move || {
            let _ = io::copy(&mut upstream_in, &mut guest_out);
            let _ = guest_out.shutdown(Shutdown::Write);
        });
    let first = if req.forward.is_some() {
        Ok((rest, String::new()))
    } else {
        // A tunnel is checked once more, on the TLS server name in what the
        // guest sends first, before any of it reaches the server.
        first_bytes(&mut conn, rest).and_then(|(first, hello)| match hello {
            First::Hello {
                server_name: Some(name),
            } if !policy.allow.allows(&name, req.port) => Err(format!(
                "blocked by sandbox policy: TLS server name {name} is not in this sandbox's allowlist"
            )),
            First::Hello {
                server_name: Some(name),
            } => Ok((first, format!(" (TLS {name})"))),
            // No server name: the connection goes where the CONNECT said,
            // and that host passed the allowlist.
            First::Hello { server_name: None } => {
                Ok((first, format!(" (TLS without a server name, to {})", req.host)))
            }
            First::NotTls => Ok((first, String::new())),
            First::Bad(e) => Err(format!("blocked by sandbox policy: {e}")),
        })
    };
    let sent = match first {
        Ok((first, tls)) => {
            egress.record(
                &sandbox.id,
                true,
                format!("allow {what} via {addr}{tls}{credentials}"),
            );
            upstream.write_all(&first).is_ok()
        }
        Err(e) => {
            egress.record(&sandbox.id, false, format!("deny {what}: {e}"));
            false
        }
    };
    if sent {
        let _ = io::copy(&mut conn, &mut upstream);
        let _ = upstream.shutdown(Shutdown::Write);
    } else {
        let _ = upstream.shutdown(Shutdown::Both);
        let _ = conn.shutdown(Shutdown::Both);
    }
    if let Ok(down) = down {
        let _ = down.join();
    }
}

/// A tunnel to a host the sandbox holds credentials for: the proxy is the
/// TLS server the guest talks to (see `intercept`).
#[allow(clippy::too_many_arguments)]
fn open_tunnel(
    mut conn: UnixStream,
    rest: Vec<u8>,
    upstream: TcpStream,
    sandbox: &Sandbox,
    req: &Request,
    bound: &[&Secret],
    what: &str,
    addr: SocketAddr,
) {
    let egress = &sandbox.egress;
    let deny = |detail: String| egress.record(&sandbox.id, false, format!("deny {what}: {detail}"));
    let Some(tls) = &egress.tls else {
        let msg = "blocked by sandbox policy: this sandbox holds credentials for the host, \
                   and this proxy cannot add them inside TLS (no CA)";
        deny(msg.to_owned());
        let _ = conn.write_all(&answer("403 Forbidden", msg));
        return;
    };
    if conn
        .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .is_err()
    {
        return;
    }
    let (hello, first) = match first_bytes(&mut conn, rest) {
        Ok(h) => h,
        Err(e) => return deny(e),
    };
    match first {
        First::Hello {
            server_name: Some(name),
        } if name != req.host => {
            return deny(format!(
                "blocked by sandbox policy: TLS server name {name} in the tunnel to {}",
                req.host
            ))
        }
        First::Hello { .. } => {}
        First::Bad(e) => return deny(format!("blocked by sandbox policy: {e}")),
        First::NotTls => {
            let msg = format!(
                "blocked by sandbox policy: credentials for {} travel only inside TLS, \
                 and this tunnel is not TLS",
                req.host
            );
            let _ = conn.write_all(&answer("403 Forbidden", &msg));
            return deny(msg);
        }
    }
    let tunnel = crate::egress::intercept::Tunnel {
        ca: &tls.ca,
        upstream_tls: tls.upstream.clone(),
        host: &req.host,
        port: req.port,
        secrets: bound,
        vault: &egress.vault,
    };
    let names: Vec<&str> = bound.iter().map(|s| s.header.as_str()).collect();
    match crate::egress::intercept::carry(&tunnel, conn, hello, upstream) {
        Ok(detail) => egress.record(
            &sandbox.id,
            true,
            format!(
                "allow {what} via {addr} (TLS opened by the proxy: {detail}, with the host's {})",
                names.join(", ")
            ),
        ),
        Err(e) => deny(e),
    }
}

/// What the guest sent first in a tunnel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum First {
    /// Not TLS (no handshake record first): the tunnel's host was checked.
    NotTls,
    /// A whole TLS ClientHello, however many records and segments it came
    /// in, and the server name it asks for, if any.
    Hello { server_name: Option<String> },
    /// A handshake that is not a well-formed ClientHello: refused.
    Bad(String),
}

/// What the guest sends first in a tunnel: a whole TLS ClientHello if it
/// starts one (so that its server name can be checked), else the first
/// bytes that show it is not TLS. Nothing the guest sends passes before
/// this decides, however long the guest waits or however it splits the
/// ClientHello (across TCP segments or TLS records).
fn first_bytes(conn: &mut UnixStream, mut got: Vec<u8>) -> Result<(Vec<u8>, First), String> {
    let mut chunk = [0u8; 4096];
    loop {
        if !got.is_empty() {
            if let Some(first) = read_hello(&got) {
                return Ok((got, first));
            }
            if got.len() > MAX_HELLO {
                return Err("the TLS ClientHello is too long".into());
            }
        }
        match conn.read(&mut chunk) {
            Ok(0) if got.is_empty() => return Ok((got, First::NotTls)),
            Ok(0) => return Err("the guest stopped inside its TLS ClientHello".into()),
            Ok(n) => got.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(format!("reading from the guest: {e}")),
        }
    }
}

/// What `bytes` (all the guest sent so far) are, or None while a
/// ClientHello has begun and is not whole yet. rustls reads the ClientHello
/// (its records reassembled), as a server would.
pub(crate) fn read_hello(bytes: &[u8]) -> Option<First> {
    if bytes.first() != Some(&0x16) {
        return Some(First::NotTls);
    }
    let mut acceptor = rustls::server::Acceptor::default();
    let mut input = bytes;
    while !input.is_empty() {
        match acceptor.read_tls(&mut input) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => return Some(First::Bad(format!("a malformed TLS ClientHello: {e}"))),
        }
    }
    match acceptor.accept() {
        Ok(None) => None,
        Ok(Some(accepted)) => Some(First::Hello {
            server_name: accepted.client_hello().server_name().map(normalise),
        }),
        Err((e, _alert)) => Some(First::Bad(format!("a malformed TLS ClientHello: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(entries: &[&str]) -> Allowlist {
        Allowlist::parse(&entries.iter().map(|e| e.to_string()).collect::<Vec<_>>())
            .expect("allowlist")
    }

    #[test]
    fn allowlists_match_names_wildcards_addresses_and_ports() {
        let a = list(&[
            "api.example.com",
            "*.github.com:443",
            "203.0.113.7:8080",
            "[2001:db8::1]:443",
            "Upper.Example.ORG.",
        ]);
        assert!(a.allows("api.example.com", 443));
        assert!(a.allows("API.example.com.", 80));
        assert!(!a.allows("example.com", 443));
        assert!(!a.allows("evil-api.example.com", 443));
        assert!(!a.allows("api.example.com.evil.net", 443));
        assert!(a.allows("codeload.github.com", 443));
        assert!(!a.allows("codeload.github.com", 80));
        assert!(!a.allows("github.com", 443));
        assert!(!a.allows("xgithub.com", 443));
        assert!(a.allows("203.0.113.7", 8080));
        assert!(!a.allows("203.0.113.7", 8081));
        assert!(a.allows("[2001:db8::1]", 443));
        assert!(a.allows("2001:db8:0::1", 443));
        assert!(a.allows("upper.example.org", 1));
        assert!(!list(&[]).allows("example.com", 80));
        assert!(list(&["*"]).allows("anything.at.all", 9));
        assert!(list(&["*:443"]).allows("x.y", 443));
        assert!(!list(&["*:443"]).allows("x.y", 80));
    }

    #[test]
    fn secrets_are_checked_and_never_printed() {
        let s = Secret::new("*.example.com:443", "Authorization", "Bearer sk-123").expect("secret");
        assert!(!format!("{s:?}").contains("sk-123"));
        assert!(Secret::new("api.example.com", "X-Api-Key", "k").is_ok());
        for (host, header, value) in [
            ("bad host", "Authorization", "v"),
            ("example.com", "Bad Header", "v"),
            ("example.com", "", "v"),
            ("example.com", "Host", "v"),
            ("example.com", "Authorization", ""),
            ("example.com", "Authorization", "a\r\nX-Evil: 1"),
        ] {
            assert!(Secret::new(host, header, value).is_err(), "{host} {header}");
        }
    }

    #[test]
    fn bad_allowlist_entries_are_named() {
        for bad in [
            "",
            "exa mple.com",
            "*.",
            "a..b",
            "host:0",
            "host:99999",
            "[::1",
            "*foo.com",
            "h/x",
        ] {
            let err = Allowlist::parse(&[bad.to_string()]).expect_err(bad);
            assert!(err.contains(bad.trim()), "{err}");
        }
    }

    #[test]
    fn private_loopback_link_local_and_metadata_addresses_are_refused() {
        let refused = [
            "127.0.0.1",
            "127.5.5.5",
            "10.0.0.1",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "169.254.1.1",
            "100.64.0.1",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "198.18.0.1",
            "::1",
            "::",
            "fd00:ec2::254",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "::127.0.0.1",
        ];
        for ip in refused {
            assert!(
                refusal(ip.parse().expect("an address")).is_some(),
                "{ip} is not refused"
            );
        }
        assert_eq!(
            refusal("169.254.169.254".parse().expect("an address")),
            Some("the cloud metadata address")
        );
        for ip in [
            "1.1.1.1",
            "8.8.8.8",
            "172.32.0.1",
            "198.51.100.1",
            "2606:4700::1111",
            "::ffff:1.1.1.1",
        ] {
            assert_eq!(refusal(ip.parse().expect("an address")), None, "{ip}");
        }
    }

    #[test]
    fn credentials_name_secrets_the_vault_resolves_per_request() {
        let vault = Vault::default();
        let lines = vec!["GET / HTTP/1.1".to_owned(), "Host: example.com".to_owned()];
        let secret = Secret::new(
            "example.com",
            "Authorization",
            "Bearer ${husk.secrets.tok}-${husk.secrets.tok}",
        )
        .expect("secret");
        let head = |v: &Vault| {
            compose(&lines, &[&secret], v).map(|h| String::from_utf8(h).expect("UTF-8"))
        };

        let missing = head(&vault).expect_err("no such secret yet");
        vault.set("tok", "s3cr3t");
        let first = head(&vault).expect("resolved");
        vault.set("tok", "n3w");
        let second = head(&vault).expect("resolved again");
        vault.remove("tok");

        assert!(
            missing.contains("`Authorization`") && missing.contains("`tok`"),
            "{missing}"
        );
        assert!(
            first.contains("Authorization: Bearer s3cr3t-s3cr3t\r\n"),
            "{first}"
        );
        assert!(
            second.contains("Authorization: Bearer n3w-n3w\r\n"),
            "{second}"
        );
        assert!(head(&vault).is_err());
        assert!(!format!("{vault:?}").contains("n3w"));
        let open = Secret::new("example.com", "X", "${husk.secrets.tok").expect("secret");
        assert!(compose(&lines, &[&open], &vault).is_err());
    }

    #[test]
    fn plain_http_is_rewritten_to_origin_form_without_proxy_headers() {
        let head = b"GET http://Example.com:8080/a/b?c=d HTTP/1.1\r\nHost: other.example\r\n\
            Proxy-Authorization: Basic eA==\r\nProxy-Connection: keep-alive\r\nAccept: */*\r\n\r\n";
        let req = parse(head).ok().expect("parsed");
        assert_eq!((req.host.as_str(), req.port), ("example.com", 8080));
        let lines = req.forward.expect("a head");
        assert_eq!(
            String::from_utf8(compose(&lines, &[], &Vault::default()).expect("head")).expect("UTF-8"),
            "GET /a/b?c=d HTTP/1.1\r\nHost: example.com:8080\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        );
        // A credential replaces the guest's header of the same name.
        let secret = Secret::new("example.com", "Accept", "text/plain").expect("secret");
        assert_eq!(
            String::from_utf8(compose(&lines, &[&secret], &Vault::default()).expect("head"))
                .expect("UTF-8"),
            "GET /a/b?c=d HTTP/1.1\r\nHost: example.com:8080\r\nAccept: text/plain\r\nConnection: close\r\n\r\n"
        );
        let req = parse(b"GET http://example.com?q HTTP/1.0\r\n\r\n")
            .ok()
            .expect("parsed");
        assert_eq!(req.forward.expect("a head")[0], "GET /?q HTTP/1.0");
        let req = parse(b"CONNECT [2001:db8::1]:443 HTTP/1.1\r\n\r\n")
            .ok()
            .expect("parsed");
        assert_eq!(
            (req.host.as_str(), req.port, req.forward),
            ("2001:db8::1", 443, None)
        );
        for bad in [
            &b"GET https://example.com/ HTTP/1.1\r\n\r\n"[..],
            b"GET /relative HTTP/1.1\r\n\r\n",
            b"CONNECT example.com HTTP/1.1\r\n\r\n",
            b"GET http://user:pw@example.com/ HTTP/1.1\r\n\r\n",
            b"SSH-2.0-OpenSSH\r\n\r\n",
            b"\xff\xfe\r\n\r\n",
        ] {
            assert!(matches!(parse(bad), Err(Refused::Bad(_))), "{bad:?}");
        }
    }

    #[test]
    fn request_heads_that_http_parsers_disagree_on_are_refused() {
        let many: String = (0..200).map(|i| format!("X-{i}: v\r\n")).collect();
        let cases: [(&[u8], &str); 4] = [
            (
                b"GET http://a.example/ HTTP/1.1\r\nX: a\r\n b\r\n\r\n",
                "not an HTTP/1",
            ),
            (
                b"GET http://a.example/ HTTP/1.1\r\nX: \xff\r\n\r\n",
                "not UTF-8",
            ),
            (
                b"GET http://a.example/ HTTP/1.1\r\nX : a\r\n\r\n",
                "not an HTTP/1",
            ),
            (
                format!("GET http://a.example/ HTTP/1.1\r\n{many}\r\n")
                    .leak()
                    .as_bytes(),
                "more than",
            ),
        ];

        for (head, says) in cases {
            match parse(head) {
                Err(Refused::Bad(why)) => assert!(why.contains(says), "{why}"),
                _ => panic!("{:?} was not refused", String::from_utf8_lossy(head)),
            }
        }
    }

    /// The first flight of a real TLS client (rustls) for `name`, or
    /// without a server name.
    fn real_client_hello(name: Option<&str>) -> Vec<u8> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        cfg.enable_sni = name.is_some();
        let server = rustls::pki_types::ServerName::try_from(name.unwrap_or("203.0.113.7"))
            .expect("name")
            .to_owned();
        let mut client = rustls::ClientConnection::new(Arc::new(cfg), server).expect("client");
        let mut out = Vec::new();
        client.write_tls(&mut out).expect("hello");
        out
    }

    /// One ClientHello record cut into TLS records of `size` bytes of
    /// handshake each (as a hostile or unusual client may send it).
    fn in_records(hello: &[u8], size: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for part in hello[5..].chunks(size) {
            out.extend_from_slice(&hello[..3]);
            out.extend_from_slice(&(part.len() as u16).to_be_bytes());
            out.extend_from_slice(part);
        }
        out
    }

    #[test]
    fn the_server_name_of_a_client_hello_is_read_however_it_is_split() {
        let hello = real_client_hello(Some("API.Example.com"));
        let named = Some(First::Hello {
            server_name: Some("api.example.com".into()),
        });

        let whole = read_hello(&hello);
        let fragmented = read_hello(&in_records(&hello, 7));
        let nameless = read_hello(&real_client_hello(None));

        assert_eq!(whole, named);
        assert_eq!(fragmented, named, "split across TLS records");
        assert_eq!(nameless, Some(First::Hello { server_name: None }));
        // Cut anywhere (across TCP segments): not decided yet.
        for n in 1..hello.len() {
            assert_eq!(read_hello(&hello[..n]), None, "{n} bytes");
        }
    }

    #[test]
    fn what_is_not_a_client_hello_is_told_apart_and_garbage_is_refused() {
        let hello = real_client_hello(Some("api.example.com"));

        assert_eq!(read_hello(b"SSH-2.0-OpenSSH"), Some(First::NotTls));
        assert!(matches!(
            read_hello(&[0x16, 3, 1, 0, 4, 2, 0, 0, 0]),
            Some(First::Bad(_))
        ));
        // Any single corrupted byte: a decision or a wait, never a panic.
        for i in 0..hello.len() {
            let mut h = hello.clone();
            h[i] ^= 0xff;
            let _ = read_hello(&h);
        }
    }

    /// The whole proxy on a real socket, for what is decided before any
    /// address is looked up: a refusal is an answer, every decision is
    /// recorded, and a dropped proxy is gone with its socket.
    #[test]
    fn refusals_are_answers_and_a_dropped_proxy_leaves_nothing() {
        let dir = std::env::temp_dir().join(format!("husk-egress-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let socket = dir.join("vsock_3128");
        let (tx, rx) = mpsc::sync_channel(16);
        let egress = Arc::new(Egress::new(None, tx, None, Vault::default()).expect("egress"));
        let proxy = egress
            .serve(
                "sb-unit",
                list(&["allowed.example:443"]),
                Vec::new(),
                socket.clone(),
                0,
            )
            .expect("serve");
        let ask = |request: &[u8]| {
            let mut c = UnixStream::connect(&socket).expect("connect");
            c.write_all(request).expect("write");
            let mut out = String::new();
            c.read_to_string(&mut out).expect("read");
            out
        };
        let denied = ask(b"GET http://example.com/x HTTP/1.1\r\nHost: example.com\r\n\r\n");
        let wrong_port = ask(b"CONNECT allowed.example:80 HTTP/1.1\r\n\r\n");
        let garbage = ask(b"\x16\x03\x01 not a request\r\n\r\n");
        drop(proxy);
        let after = UnixStream::connect(&socket);
        let decisions: Vec<Decision> = rx.try_iter().collect();
        let _ = std::fs::remove_dir_all(&dir);

        assert!(denied.starts_with("HTTP/1.1 403 Forbidden\r\n"), "{denied}");
        assert!(denied.contains("X-Husk-Egress: denied\r\n"), "{denied}");
        assert!(denied.ends_with(
            "\r\n\r\nblocked by sandbox policy: example.com:80 is not in this sandbox's allowlist\n"
        ), "{denied}");
        assert!(
            wrong_port.contains("allowed.example:80 is not in this sandbox's allowlist"),
            "{wrong_port}"
        );
        assert!(
            garbage.starts_with("HTTP/1.1 400 Bad Request\r\n"),
            "{garbage}"
        );
        assert!(after.is_err(), "the socket outlived its proxy");
        assert_eq!(decisions.len(), 3, "{decisions:?}");
        assert!(decisions
            .iter()
            .all(|d| !d.allowed && d.sandbox == "sb-unit"));
        assert!(
            decisions[0].detail.starts_with("deny GET example.com:80: "),
            "{decisions:?}"
        );
    }
}
