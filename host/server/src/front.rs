//! The front door: HTTP from browsers and clients to the ports of
//! sandboxes. A request for `PORT-SANDBOXID.DOMAIN` (E2B's host format)
//! goes to TCP `PORT` on the guest's loopback over a new vsock connection
//! ([`Daemon::connect_port`]); bodies stream both ways, and a WebSocket (any
//! `Upgrade`) becomes a byte stream between the client and the guest
//! program. Ports are open to whoever reaches the front door unless the
//! sandbox was created with private ports: then each request must carry
//! its traffic token in [`TOKEN_HEADER`] (which the guest never sees).
//! What cannot be reached is answered with a page that says why: no such
//! sandbox (404), a paused or failed one (409), nothing listening (502). A
//! hibernated sandbox is woken. With the operator's certificate (one for
//! `*.DOMAIN`) the front door speaks HTTPS instead ([`tls_config`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use husk_core::daemon::{Daemon, DaemonError, FrontDoorAddr};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::TlsAcceptor;

/// The header that carries a sandbox's traffic token (E2B's name).
pub const TOKEN_HEADER: &str = "e2b-traffic-access-token";
/// Client connections served at once; more wait to be accepted.
const MAX_CONNECTIONS: usize = 1024;
/// How long a client may take to send a request's head (or to finish its
/// TLS handshake).
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);

/// Hop-by-hop headers (RFC 9110 7.6.1): they are about one connection and
/// are not passed on (except `Connection`/`Upgrade` of an upgrade).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

/// The front door of one daemon.
pub struct FrontDoor {
    daemon: Arc<Daemon>,
    addr: FrontDoorAddr,
    /// Its TLS (HTTPS), if the operator gave a certificate.
    tls: Option<TlsAcceptor>,
}

impl std::fmt::Debug for FrontDoor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrontDoor")
            .field("addr", &self.addr)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl FrontDoor {
    /// The front door at `addr`; HTTPS with `tls` (`addr.https` says so).
    pub fn new(
        daemon: Arc<Daemon>,
        addr: FrontDoorAddr,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> Arc<Self> {
        Arc::new(FrontDoor {
            daemon,
            addr,
            tls: tls.map(TlsAcceptor::from),
        })
    }
}

/// The front door's TLS: the certificate chain in PEM file `cert` (the
/// server's first) and its private key in PEM file `key`; HTTP/1.1.
pub fn tls_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, String> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{}: no PEM certificates: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no PEM certificates", cert.display()));
    }
    let private = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("{}: no PEM private key: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(|e| {
            format!(
                "{} and {}: not a certificate and its key: {e}",
                cert.display(),
                key.display()
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Serves `listener` until `stop` fires.
pub async fn serve(
    door: Arc<FrontDoor>,
    listener: tokio::net::TcpListener,
    stop: impl std::future::Future<Output = ()>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    tokio::pin!(stop);
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let (tcp, peer) = tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors: wait for a connection to end.
                    tracing::warn!("front door: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let door = door.clone();
        tokio::spawn(async move {
            match door.tls.clone() {
                None => door.serve_connection(tcp, peer).await,
                Some(tls) => match tokio::time::timeout(HEAD_TIMEOUT, tls.accept(tcp)).await {
                    Ok(Ok(stream)) => door.serve_connection(stream, peer).await,
                    Ok(Err(e)) => tracing::debug!("front door: TLS from {peer}: {e}"),
                    Err(_) => tracing::debug!("front door: TLS from {peer}: timed out"),
                },
            }
            drop(slot);
        });
    }
}

impl FrontDoor {
    /// Serves HTTP/1.1 on one client connection (TCP, or TLS over it).
    async fn serve_connection<I>(self: Arc<Self>, io: I, peer: SocketAddr)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let service = hyper::service::service_fn(move |req| {
            let door = self.clone();
            async move { Ok::<_, Infallible>(door.handle(req, peer).await) }
        });
        let served = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEAD_TIMEOUT)
            .serve_connection(TokioIo::new(io), service)
            .with_upgrades()
            .await;
        if let Err(e) = served {
            tracing::debug!("front door: connection from {peer}: {e}");
        }
    }

    async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let host = req
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .or_else(|| req.uri().authority().map(|a| a.as_str()))
            .unwrap_or_default()
            .to_owned();
        let Some((id, port)) = self.addr.route(&host) else {
            return page(
                StatusCode::NOT_FOUND,
                &format!(
                    "`{host}` is not a sandbox's address here: use PORT-SANDBOXID.{}",
                    self.addr.domain
                ),
            );
        };
        match self.forward(req, peer, &host, &id, port).await {
            Ok(resp) => resp,
            Err((status, why)) => page(status, &why),
        }
    }

    async fn forward(
        &self,
        mut req: Request<Incoming>,
        peer: SocketAddr,
        host: &str,
        id: &str,
        port: u16,
    ) -> Result<Response<Body>, (StatusCode, String)> {
        let info = self.daemon.sandbox(id).map_err(refusal)?;
        if let Some(token) = &info.traffic_token {
            let given = req
                .headers()
                .get(TOKEN_HEADER)
                .map(HeaderValue::as_bytes)
                .unwrap_or_default();
            if !crate::api::constant_time_eq(given, token.as_bytes()) {
                return Err((
                    StatusCode::FORBIDDEN,
                    format!(
                        "sandbox `{id}`'s ports are private: send its traffic token in \
                         the {TOKEN_HEADER} header"
                    ),
                ));
            }
        }
        let daemon = self.daemon.clone();
        let target = id.to_owned();
        let conn = tokio::task::spawn_blocking(move || daemon.connect_port(&target, port))
            .await
            .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
            .map_err(refusal)?;
        let (stream, held) = conn.into_parts();
        let stream = stream
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UnixStream::from_std(stream))
            .map_err(|e| (StatusCode::BAD_GATEWAY, e.to_string()))?;
        let (mut sender, connection) = hyper::client::conn::http1::Builder::new()
            .handshake::<_, Incoming>(TokioIo::new(stream))
            .await
            .map_err(|e| (StatusCode::BAD_GATEWAY, e.to_string()))?;
        // The guest connection is counted against the sandbox's limit, and
        // is a use of it, as long as its exchange lasts: an upgraded one
        // until both sides of the upgrade close.
        let held = Arc::new(held);
        let exchange = held.clone();
        tokio::spawn(async move {
            let _ = connection.with_upgrades().await;
            drop(exchange);
        });

        let upgrade = req.headers().contains_key(header::UPGRADE);
        let from_client = upgrade.then(|| hyper::upgrade::on(&mut req));
        let (mut parts, body) = req.into_parts();
        strip_hop_by_hop(&mut parts.headers, upgrade);
        parts.headers.remove(TOKEN_HEADER);
        let forwarded = |v: &str| HeaderValue::from_str(v).ok();
        if let Some(v) = forwarded(&peer.ip().to_string()) {
            parts
                .headers
                .append(HeaderName::from_static("x-forwarded-for"), v);
        }
        if let Some(v) = forwarded(host) {
            parts
                .headers
                .insert(HeaderName::from_static("x-forwarded-host"), v);
        }
        parts.headers.insert(
            HeaderName::from_static("x-forwarded-proto"),
            HeaderValue::from_static(if self.addr.https { "https" } else { "http" }),
        );
        // Origin form: the guest program sees the path, as from a browser.
        parts.uri = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .parse()
            .map_err(|e| (StatusCode::BAD_REQUEST, format!("{e}")))?;
        let mut resp = sender
            .send_request(Request::from_parts(parts, body))
            .await
            .map_err(|e| {
                (
                    StatusCode::BAD_GATEWAY,
                    format!("port {port} in sandbox `{id}` did not answer with HTTP: {e}"),
                )
            })?;
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            let from_guest = hyper::upgrade::on(&mut resp);
            if let Some(from_client) = from_client {
                tokio::spawn(async move {
                    if let (Ok(client), Ok(guest)) = tokio::join!(from_client, from_guest) {
                        let _ = tokio::io::copy_bidirectional(
                            &mut TokioIo::new(client),
                            &mut TokioIo::new(guest),
                        )
                        .await;
                    }
                    drop(held);
                });
            }
        }
        let (mut parts, body) = resp.into_parts();
        let switching = parts.status == StatusCode::SWITCHING_PROTOCOLS;
        strip_hop_by_hop(&mut parts.headers, switching);
        Ok(Response::from_parts(parts, Body::new(body)))
    }
}

/// Removes the hop-by-hop headers, and those `Connection` names; an
/// upgrade keeps its `Connection: upgrade` and `Upgrade`.
fn strip_hop_by_hop(headers: &mut HeaderMap, upgrade: bool) {
    let named: Vec<String> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !(upgrade && n == "upgrade"))
        .collect();
    for name in named.iter().map(String::as_str).chain(HOP_BY_HOP) {
        if upgrade && name == "connection" {
            continue;
        }
        headers.remove(name);
    }
    if upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    } else {
        headers.remove(header::UPGRADE);
    }
}

/// How the daemon's refusal reads at the front door: as on the API.
fn refusal(e: DaemonError) -> (StatusCode, String) {
    (crate::api::daemon_status(&e), e.to_string())
}

/// An error page: what went wrong, in a line of text.
fn page(status: StatusCode, why: &str) -> Response<Body> {
    let mut resp = Response::new(Body::from(format!("husk: {why}\n")));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_stay_on_their_hop() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, X-Secret-Hop"),
        );
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        let mut plain = h.clone();
        strip_hop_by_hop(&mut plain, false);
        assert_eq!(plain.len(), 1, "{plain:?}");
        assert!(plain.contains_key(header::CONTENT_TYPE));

        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("Upgrade, X-Secret-Hop"),
        );
        strip_hop_by_hop(&mut h, true);
        assert_eq!(
            h.get(header::CONNECTION).map(|v| v.as_bytes()),
            Some(&b"upgrade"[..])
        );
        assert_eq!(
            h.get(header::UPGRADE).map(|v| v.as_bytes()),
            Some(&b"websocket"[..])
        );
        assert!(!h.contains_key("x-secret-hop") && !h.contains_key(header::TRANSFER_ENCODING));
    }
}
