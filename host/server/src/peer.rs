//! Who made a request, as the front-ends pass it to the audit log.

use axum::extract::connect_info::Connected;
use axum::serve::IncomingStream;

/// Who made a request, for the audit log: the peer's uid and pid on the
/// Unix socket, its address on TCP.
#[derive(Debug, Clone)]
pub struct Peer(pub String);

impl Connected<IncomingStream<'_, tokio::net::UnixListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, tokio::net::UnixListener>) -> Self {
        Peer(match stream.io().peer_cred() {
            Ok(c) => format!("uid={} pid={}", c.uid(), c.pid().unwrap_or(0)),
            Err(_) => "unix".to_owned(),
        })
    }
}

impl Connected<IncomingStream<'_, tokio::net::TcpListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, tokio::net::TcpListener>) -> Self {
        Peer(format!("tcp {}", stream.remote_addr()))
    }
}
