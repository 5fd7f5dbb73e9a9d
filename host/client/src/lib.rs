//! A typed blocking client of the daemon's API, for the CLI, the
//! containerd shim, the bench and the tests, on hyper (HTTP/1.1 over the
//! daemon's Unix socket, or TCP with its bearer token). Bodies stream both
//! ways: an upload is sent as it is read, an answer is read as it comes.
//!
//! Calls block. They run on one small runtime of the client's own (a
//! thread), so they may be made from any thread that is not itself running
//! async code (a `spawn_blocking` closure is fine).

use std::collections::BTreeMap;
use std::future::Future;
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Bytes, Frame, Incoming};
use hyper_util::rt::TokioIo;
use tokio::sync::mpsc;

use husk_types::{
    AuditEntry, BuildEvent, CreateRequest, Created, DirEntry, ExecEvent, ExecSpec, ForkRequest,
    Forked, Killed, PoolInfo, PoolSize, PortInfo, ProcessEvent, ProcessInfo, ProcessSpec,
    SandboxInfo, SandboxUpdate, SecretInfo, SecretRequest, SignalName, SignalRequest,
    SnapshotRequest, TemplateRecord, TemplateSpec, TerminalSize, VolumeInfo, VolumeRequest,
};

/// Errors talking to the daemon.
#[derive(Debug, thiserror::Error)]
pub enum ApiClientError {
    #[error("cannot reach the husk daemon at {0}: {1} (is `husk serve` running?)")]
    Connect(String, #[source] std::io::Error),
    #[error("{message} (HTTP {status})")]
    Status { status: u16, message: String },
    #[error("the daemon's answer is malformed: {0}")]
    Malformed(String),
    #[error("I/O error talking to the daemon: {0}")]
    Io(#[from] std::io::Error),
}

/// Where the daemon listens.
#[derive(Debug, Clone)]
pub enum Endpoint {
    Unix(PathBuf),
    /// `host:port` and the bearer token.
    Tcp(String, String),
}

/// A blocking connection to the daemon ([`ApiClient::connect_stream`]).
#[derive(Debug)]
pub enum DaemonStream {
    Unix(UnixStream),
    Tcp(std::net::TcpStream),
}

impl DaemonStream {
    /// Reads and writes return `WouldBlock` instead of waiting.
    pub fn set_nonblocking(&self, on: bool) -> std::io::Result<()> {
        match self {
            DaemonStream::Unix(s) => s.set_nonblocking(on),
            DaemonStream::Tcp(s) => s.set_nonblocking(on),
        }
    }
}

impl std::io::Read for DaemonStream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            DaemonStream::Unix(s) => s.read(buf),
            DaemonStream::Tcp(s) => s.read(buf),
        }
    }
}

impl std::io::Write for DaemonStream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            DaemonStream::Unix(s) => s.write(buf),
            DaemonStream::Tcp(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            DaemonStream::Unix(s) => s.flush(),
            DaemonStream::Tcp(s) => s.flush(),
        }
    }
}

impl std::os::fd::AsRawFd for DaemonStream {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        match self {
            DaemonStream::Unix(s) => s.as_raw_fd(),
            DaemonStream::Tcp(s) => s.as_raw_fd(),
        }
    }
}

/// The daemon's client.
#[derive(Debug, Clone)]
pub struct ApiClient {
    endpoint: Endpoint,
    timeout: Option<Duration>,
}

/// The runtime every client's I/O runs on: one worker thread, made on
/// first use.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("husk-client")
            .enable_all()
            .build()
            .expect("the client's runtime (a thread) cannot be made")
    })
}

/// Runs `fut` to its end on the client's runtime, within `timeout`.
fn wait<T>(
    timeout: Option<Duration>,
    fut: impl Future<Output = Result<T, ApiClientError>>,
) -> Result<T, ApiClientError> {
    runtime().block_on(async {
        match timeout {
            Some(t) => tokio::time::timeout(t, fut)
                .await
                .unwrap_or_else(|_| Err(std::io::Error::from(std::io::ErrorKind::TimedOut).into())),
            None => fut.await,
        }
    })
}

/// An answer whose body is read as it comes.
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    body: Incoming,
    /// What the last frame held past what was read.
    pending: Bytes,
    timeout: Option<Duration>,
}

impl std::fmt::Debug for Response {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Response")
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

impl Read for Response {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.pending.is_empty() {
            let body = &mut self.body;
            let frame = wait(self.timeout, async {
                match std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await {
                    None => Ok(None),
                    Some(Ok(frame)) => Ok(Some(frame)),
                    Some(Err(e)) => Err(std::io::Error::other(e).into()),
                }
            })
            .map_err(|e| match e {
                ApiClientError::Io(e) => e,
                other => std::io::Error::other(other),
            })?;
            match frame {
                // The end (trailers are not used).
                None => return Ok(0),
                Some(frame) => {
                    if let Ok(data) = frame.into_data() {
                        self.pending = data;
                    }
                }
            }
        }
        let n = buf.len().min(self.pending.len());
        buf[..n].copy_from_slice(&self.pending[..n]);
        self.pending = self.pending.slice(n..);
        Ok(n)
    }
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The whole body as JSON.
    pub fn json<T: serde::de::DeserializeOwned>(mut self) -> Result<T, ApiClientError> {
        let mut body = Vec::new();
        self.read_to_end(&mut body)?;
        serde_json::from_slice(&body).map_err(|e| ApiClientError::Malformed(e.to_string()))
    }

    /// The next NDJSON line, or None at the end.
    pub fn next_line<T: serde::de::DeserializeOwned>(
        &mut self,
    ) -> Result<Option<T>, ApiClientError> {
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        loop {
            match self.read(&mut byte)? {
                0 if line.is_empty() => return Ok(None),
                0 => break,
                _ if byte[0] == b'\n' => break,
                _ => line.push(byte[0]),
            }
        }
        serde_json::from_slice(&line)
            .map(Some)
            .map_err(|e| ApiClientError::Malformed(e.to_string()))
    }
}

/// The request body.
pub enum Payload<'a> {
    None,
    Json(Vec<u8>),
    /// Sent chunked as it is read.
    Stream(&'a mut dyn Read),
}

impl std::fmt::Debug for Payload<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Payload::None => f.write_str("None"),
            Payload::Json(b) => write!(f, "Json({} bytes)", b.len()),
            Payload::Stream(_) => f.write_str("Stream"),
        }
    }
}

/// A connection whose writes, once the daemon stopped reading (it closed
/// its end after refusing the request early, say a body over its limit),
/// go nowhere instead of failing: hyper then reads the answer the daemon
/// sent before closing, which is what the caller needs, instead of
/// reporting a broken pipe. `stopped_reading` tells the body's reader.
struct Unheard<T> {
    io: TokioIo<T>,
    stopped_reading: Arc<AtomicBool>,
}

impl<T> Unheard<T> {
    fn swallow<R>(&self, result: Poll<std::io::Result<R>>, done: R) -> Poll<std::io::Result<R>> {
        match result {
            Poll::Ready(Err(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                self.stopped_reading.store(true, Ordering::SeqCst);
                Poll::Ready(Ok(done))
            }
            other => other,
        }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> hyper::rt::Read for Unheard<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> hyper::rt::Write for Unheard<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.stopped_reading.load(Ordering::SeqCst) {
            return Poll::Ready(Ok(buf.len()));
        }
        let written = Pin::new(&mut self.io).poll_write(cx, buf);
        self.swallow(written, buf.len())
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let flushed = Pin::new(&mut self.io).poll_flush(cx);
        self.swallow(flushed, ())
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let shut = Pin::new(&mut self.io).poll_shutdown(cx);
        self.swallow(shut, ())
    }
}

/// A request body: whole, or chunks handed over by the calling thread as
/// it reads them (an error ends the request).
enum RequestBody {
    Whole(Option<Bytes>),
    Chunks(mpsc::Receiver<std::io::Result<Bytes>>),
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        match self.get_mut() {
            RequestBody::Whole(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            RequestBody::Chunks(rx) => rx.poll_recv(cx).map(|c| c.map(|c| c.map(Frame::data))),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, RequestBody::Whole(None))
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            RequestBody::Whole(data) => {
                hyper::body::SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            RequestBody::Chunks(_) => hyper::body::SizeHint::default(),
        }
    }
}

/// The daemon's state directory unless told (`--state-dir`):
/// `$HUSK_STATE_DIR`, else `/var/lib/husk` for root and
/// `~/.local/share/husk` for others.
pub fn default_state_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("HUSK_STATE_DIR") {
        return PathBuf::from(dir);
    }
    // SAFETY: getuid cannot fail.
    if unsafe { libc::getuid() } == 0 {
        return PathBuf::from("/var/lib/husk");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
    home.join(".local/share/husk")
}

/// A client of the daemon at `$HUSK_HOST` (a socket path, or
/// `tcp://HOST:PORT` with the token in `$HUSK_TOKEN`), else the default
/// state directory's socket.
pub fn from_env() -> ApiClient {
    let endpoint = match std::env::var("HUSK_HOST") {
        Ok(h) if h.starts_with("tcp://") => Endpoint::Tcp(
            h.trim_start_matches("tcp://").to_owned(),
            std::env::var("HUSK_TOKEN").unwrap_or_default(),
        ),
        Ok(h) if !h.is_empty() => Endpoint::Unix(PathBuf::from(h)),
        _ => Endpoint::Unix(default_state_dir().join("husk.sock")),
    };
    ApiClient::new(endpoint)
}

impl ApiClient {
    pub fn new(endpoint: Endpoint) -> Self {
        ApiClient {
            endpoint,
            timeout: None,
        }
    }

    /// A plain blocking connection to the daemon (for a protocol of the
    /// caller's own on it, a WebSocket), and the bearer token a TCP
    /// endpoint wants in its requests.
    pub fn connect_stream(&self) -> Result<(DaemonStream, Option<String>), ApiClientError> {
        match &self.endpoint {
            Endpoint::Unix(path) => UnixStream::connect(path)
                .map(|s| (DaemonStream::Unix(s), None))
                .map_err(|e| ApiClientError::Connect(path.display().to_string(), e)),
            Endpoint::Tcp(addr, token) => std::net::TcpStream::connect(addr)
                .map(|s| (DaemonStream::Tcp(s), Some(token.clone())))
                .map_err(|e| ApiClientError::Connect(addr.clone(), e)),
        }
    }

    /// Bounds each wait for the daemon (connecting, the answer's head,
    /// each piece of its body); none by default: an exec may be silent for
    /// a long time.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Connects and shakes hands; the connection is driven on the client's
    /// runtime until the answer is read whole.
    async fn connect(
        &self,
        stopped_reading: Arc<AtomicBool>,
    ) -> Result<hyper::client::conn::http1::SendRequest<RequestBody>, ApiClientError> {
        async fn shake<T>(
            io: T,
            stopped_reading: Arc<AtomicBool>,
        ) -> Result<hyper::client::conn::http1::SendRequest<RequestBody>, ApiClientError>
        where
            T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
        {
            let io = Unheard {
                io: TokioIo::new(io),
                stopped_reading,
            };
            let (sender, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| ApiClientError::Io(std::io::Error::other(e)))?;
            tokio::spawn(conn);
            Ok(sender)
        }
        match &self.endpoint {
            Endpoint::Unix(path) => {
                let s = tokio::net::UnixStream::connect(path)
                    .await
                    .map_err(|e| ApiClientError::Connect(path.display().to_string(), e))?;
                shake(s, stopped_reading).await
            }
            Endpoint::Tcp(addr, _) => {
                let s = tokio::net::TcpStream::connect(addr)
                    .await
                    .map_err(|e| ApiClientError::Connect(addr.clone(), e))?;
                shake(s, stopped_reading).await
            }
        }
    }

    /// Sends a request; an answer with an error status becomes
    /// [`ApiClientError::Status`] with the daemon's message.
    pub fn send(
        &self,
        method: &str,
        path: &str,
        payload: Payload<'_>,
    ) -> Result<Response, ApiClientError> {
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, "husk");
        if let Endpoint::Tcp(_, token) = &self.endpoint {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let (body, mut stream) = match payload {
            Payload::None => (RequestBody::Whole(None), None),
            Payload::Json(body) => {
                req = req.header(hyper::header::CONTENT_TYPE, "application/json");
                (RequestBody::Whole(Some(body.into())), None)
            }
            Payload::Stream(reader) => {
                req = req.header(hyper::header::CONTENT_TYPE, "application/octet-stream");
                let (tx, rx) = mpsc::channel(2);
                (RequestBody::Chunks(rx), Some((reader, tx)))
            }
        };
        let req = req
            .body(body)
            .map_err(|e| ApiClientError::Malformed(format!("the request: {e}")))?;
        let stopped_reading = Arc::new(AtomicBool::new(false));
        let mut sender = wait(self.timeout, self.connect(stopped_reading.clone()))?;
        let answer = runtime().spawn(async move { sender.send_request(req).await });
        // The body is read here, on the caller's thread, and handed over
        // as it comes. A daemon that refuses the request early (a body over
        // its limit) answers and stops reading: its answer is what
        // matters, and the rest is not sent.
        let mut reader_failed = None;
        if let Some((reader, tx)) = &mut stream {
            let mut buf = vec![0u8; 64 << 10];
            // Once the daemon stopped reading, the rest is not read either.
            while !stopped_reading.load(Ordering::SeqCst) {
                match reader.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        if tx
                            .blocking_send(Ok(Bytes::copy_from_slice(&buf[..n])))
                            .is_err()
                        {
                            break;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        // Our own body failed (a file that cannot be read):
                        // the request is abandoned with it.
                        let _ = tx.blocking_send(Err(std::io::Error::new(e.kind(), e.to_string())));
                        reader_failed = Some(e);
                        break;
                    }
                }
            }
        }
        drop(stream);
        let answer = wait(self.timeout, async {
            answer
                .await
                .map_err(|e| ApiClientError::Io(std::io::Error::other(e)))?
                .map_err(|e| ApiClientError::Io(std::io::Error::other(e)))
        });
        let answer = match (answer, reader_failed) {
            (_, Some(e)) => return Err(e.into()),
            (answer, None) => answer?,
        };
        let status = answer.status().as_u16();
        let headers = answer
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let response = Response {
            status,
            headers,
            body: answer.into_body(),
            pending: Bytes::new(),
            timeout: self.timeout,
        };
        if status >= 400 {
            let message = match response.json::<serde_json::Value>() {
                // The daemon's `error`; Firecracker's `fault_message` (the
                // bench's Firecracker runs use this client too).
                Ok(v) => v["error"]
                    .as_str()
                    .or(v["fault_message"].as_str())
                    .unwrap_or("(no message)")
                    .to_owned(),
                Err(e) => format!("(unreadable error: {e})"),
            };
            return Err(ApiClientError::Status { status, message });
        }
        Ok(response)
    }

    /// A request with a JSON body (or none) and a JSON answer.
    pub fn call<T: serde::de::DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<T, ApiClientError> {
        let payload = match body {
            Some(b) => Payload::Json(serde_json::to_vec(b).unwrap_or_default()),
            None => Payload::None,
        };
        self.send(method, path, payload)?.json()
    }

    /// Uploads a file for a template build (`POST /v1/uploads`); returns
    /// the upload's id, which a template spec names.
    pub fn upload(&self, body: &mut dyn Read) -> Result<String, ApiClientError> {
        let answer: serde_json::Value = self
            .send("POST", "/v1/uploads", Payload::Stream(body))?
            .json()?;
        answer["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| ApiClientError::Malformed(format!("an upload without an id: {answer}")))
    }

    /// Uploads directory `dir` as a tar archive made as it is sent
    /// (owners, modes and symbolic links kept; links not followed).
    pub fn upload_dir(&self, dir: &std::path::Path) -> Result<String, ApiClientError> {
        if !dir.is_dir() {
            return Err(ApiClientError::Io(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{} is not a directory", dir.display()),
            )));
        }
        let (mut rx, tx) = UnixStream::pair()?;
        let dir = dir.to_owned();
        let tarring = std::thread::spawn(move || {
            let mut tar = tar::Builder::new(tx);
            tar.follow_symlinks(false);
            tar.mode(tar::HeaderMode::Complete);
            append_tree(&mut tar, &dir)
                .and_then(|()| tar.into_inner().map(drop))
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", dir.display())))
        });
        let sent = self.upload(&mut rx);
        drop(rx);
        let tarred = tarring
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the tar thread panicked")));
        match (sent, tarred) {
            // The daemon refused it (too large): its word is the reason.
            (Err(e @ ApiClientError::Status { .. }), _) => Err(e),
            // The archive could not be made: that is the reason, whatever
            // the daemon made of the cut-off upload.
            (_, Err(e)) => Err(ApiClientError::Io(e)),
            (sent, Ok(())) => sent,
        }
    }
}

/// The daemon's API, typed: the routes and bodies of `host/openapi.json`.
impl ApiClient {
    fn json_body<T: serde::Serialize>(value: &T) -> Result<Payload<'static>, ApiClientError> {
        serde_json::to_vec(value)
            .map(Payload::Json)
            .map_err(|e| ApiClientError::Malformed(e.to_string()))
    }

    fn sandbox_path(id: &str, rest: &str) -> String {
        format!("/v1/sandboxes/{}{rest}", encode(id))
    }

    fn template_path(name: &str, rest: &str) -> String {
        format!("/v1/templates/{}{rest}", encode(name))
    }

    /// Creates a sandbox (`POST /v1/sandboxes`).
    pub fn create_sandbox(&self, req: &CreateRequest) -> Result<Created, ApiClientError> {
        self.send("POST", "/v1/sandboxes", Self::json_body(req)?)?
            .json()
    }

    /// The sandboxes with every label of `labels` and, if given, in
    /// `state` (`GET /v1/sandboxes`).
    pub fn sandboxes(
        &self,
        labels: &BTreeMap<String, String>,
        state: Option<&str>,
    ) -> Result<Vec<SandboxInfo>, ApiClientError> {
        let mut query: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("label={}", encode(&format!("{k}={v}"))))
            .collect();
        if let Some(s) = state {
            query.push(format!("state={}", encode(s)));
        }
        self.send(
            "GET",
            &format!("/v1/sandboxes?{}", query.join("&")),
            Payload::None,
        )?
        .json()
    }

    /// Sandbox `id` (`GET /v1/sandboxes/{id}`).
    pub fn sandbox(&self, id: &str) -> Result<SandboxInfo, ApiClientError> {
        self.send("GET", &Self::sandbox_path(id, ""), Payload::None)?
            .json()
    }

    /// Changes sandbox `id`'s time to live, expiry policy or labels
    /// (`PATCH /v1/sandboxes/{id}`).
    pub fn update_sandbox(
        &self,
        id: &str,
        update: &SandboxUpdate,
    ) -> Result<SandboxInfo, ApiClientError> {
        self.send(
            "PATCH",
            &Self::sandbox_path(id, ""),
            Self::json_body(update)?,
        )?
        .json()
    }

    /// Destroys sandbox `id` (`DELETE /v1/sandboxes/{id}`).
    pub fn destroy_sandbox(&self, id: &str) -> Result<(), ApiClientError> {
        self.send("DELETE", &Self::sandbox_path(id, ""), Payload::None)
            .map(drop)
    }

    /// Stops sandbox `id`'s vCPUs (`POST /v1/sandboxes/{id}/pause`).
    pub fn pause(&self, id: &str) -> Result<SandboxInfo, ApiClientError> {
        self.send("POST", &Self::sandbox_path(id, "/pause"), Payload::None)?
            .json()
    }

    /// Lets a paused sandbox run again (`POST /v1/sandboxes/{id}/resume`).
    pub fn resume(&self, id: &str) -> Result<SandboxInfo, ApiClientError> {
        self.send("POST", &Self::sandbox_path(id, "/resume"), Payload::None)?
            .json()
    }

    /// Writes sandbox `id` to disk and frees its memory
    /// (`POST /v1/sandboxes/{id}/hibernate`).
    pub fn hibernate(&self, id: &str) -> Result<SandboxInfo, ApiClientError> {
        self.send("POST", &Self::sandbox_path(id, "/hibernate"), Payload::None)?
            .json()
    }

    /// Where TCP `port` inside sandbox `id` is published, and whether a
    /// program listens on it (`GET /v1/sandboxes/{id}/ports/{port}`).
    pub fn port(&self, id: &str, port: u16) -> Result<PortInfo, ApiClientError> {
        self.wait_for_port(id, port, 0)
    }

    /// [`ApiClient::port`] once a program listens on it, or after
    /// `wait_s` seconds (at most 600).
    pub fn wait_for_port(
        &self,
        id: &str,
        port: u16,
        wait_s: u64,
    ) -> Result<PortInfo, ApiClientError> {
        self.send(
            "GET",
            &Self::sandbox_path(id, &format!("/ports/{port}?wait_s={wait_s}")),
            Payload::None,
        )?
        .json()
    }

    /// Brings a hibernated sandbox back (`POST /v1/sandboxes/{id}/wake`).
    pub fn wake(&self, id: &str) -> Result<SandboxInfo, ApiClientError> {
        self.send("POST", &Self::sandbox_path(id, "/wake"), Payload::None)?
            .json()
    }

    /// Kills everything started in sandbox `id`
    /// (`POST /v1/sandboxes/{id}/kill-all`).
    pub fn kill_all(&self, id: &str) -> Result<Killed, ApiClientError> {
        self.send("POST", &Self::sandbox_path(id, "/kill-all"), Payload::None)?
            .json()
    }

    /// Puts host directory `tree` in a free empty drive of sandbox `id`
    /// (uploaded as a tar archive, made an ext4 image by the daemon; `POST
    /// /v1/sandboxes/{id}/media`); the guest can then mount it.
    pub fn insert_medium(
        &self,
        id: &str,
        tree: &std::path::Path,
    ) -> Result<husk_types::MediumInfo, ApiClientError> {
        let upload = self.upload_dir(tree)?;
        let body = Self::json_body(&husk_types::MediumRequest { upload })?;
        self.send("POST", &Self::sandbox_path(id, "/media"), body)?
            .json()
    }

    /// Frees drive `drive` of sandbox `id` for another medium, once the
    /// guest has unmounted it (`DELETE /v1/sandboxes/{id}/media/{drive}`).
    pub fn release_drive(&self, id: &str, drive: &str) -> Result<(), ApiClientError> {
        let path = Self::sandbox_path(id, &format!("/media/{}", encode(drive)));
        self.send("DELETE", &path, Payload::None).map(drop)
    }

    /// Joins sandbox `id` to the Kubernetes pod network of network
    /// namespace `netns` (`POST /v1/sandboxes/{id}/network`).
    pub fn attach_pod_network(
        &self,
        id: &str,
        netns: &str,
    ) -> Result<husk_types::PodNetworkInfo, ApiClientError> {
        let body = Self::json_body(&husk_types::PodNetworkRequest {
            netns: netns.to_owned(),
        })?;
        self.send("POST", &Self::sandbox_path(id, "/network"), body)?
            .json()
    }

    /// Gives running sandbox `id` one more host directory or volume, in its
    /// template's next free fs slot (`POST /v1/sandboxes/{id}/mounts`).
    pub fn add_mount(
        &self,
        id: &str,
        mount: &husk_types::MountSpec,
    ) -> Result<husk_types::SandboxInfo, ApiClientError> {
        let body = Self::json_body(mount)?;
        self.send("POST", &Self::sandbox_path(id, "/mounts"), body)?
            .json()
    }

    /// Replaces sandbox `id`'s egress policy; connections made from now on
    /// follow it (`PUT /v1/sandboxes/{id}/egress`).
    pub fn set_egress(
        &self,
        id: &str,
        egress: &husk_types::EgressSpec,
    ) -> Result<husk_types::SandboxInfo, ApiClientError> {
        let body = Self::json_body(egress)?;
        self.send("PUT", &Self::sandbox_path(id, "/egress"), body)?
            .json()
    }

    /// Snapshots sandbox `id` into template `name`
    /// (`POST /v1/sandboxes/{id}/snapshot`).
    pub fn snapshot(&self, id: &str, name: &str) -> Result<TemplateRecord, ApiClientError> {
        let body = Self::json_body(&SnapshotRequest {
            name: name.to_owned(),
        })?;
        self.send("POST", &Self::sandbox_path(id, "/snapshot"), body)?
            .json()
    }

    /// Forks sandbox `id` (`POST /v1/sandboxes/{id}/fork`).
    pub fn fork(&self, id: &str, req: &ForkRequest) -> Result<Forked, ApiClientError> {
        self.send(
            "POST",
            &Self::sandbox_path(id, "/fork"),
            Self::json_body(req)?,
        )?
        .json()
    }

    /// Sandbox `id`'s console, its end (`GET /v1/sandboxes/{id}/logs`).
    pub fn logs(&self, id: &str) -> Result<Response, ApiClientError> {
        self.send("GET", &Self::sandbox_path(id, "/logs"), Payload::None)
    }

    /// Runs `spec` in sandbox `id`; its events as they come
    /// (`POST /v1/sandboxes/{id}/exec`).
    pub fn exec(&self, id: &str, spec: &ExecSpec) -> Result<ExecStream, ApiClientError> {
        let resp = self.send(
            "POST",
            &Self::sandbox_path(id, "/exec"),
            Self::json_body(spec)?,
        )?;
        Ok(ExecStream(resp))
    }

    /// Starts a program in the background in sandbox `id`
    /// (`POST /v1/sandboxes/{id}/processes`).
    pub fn start_process(
        &self,
        id: &str,
        spec: &ProcessSpec,
    ) -> Result<ProcessInfo, ApiClientError> {
        self.send(
            "POST",
            &Self::sandbox_path(id, "/processes"),
            Self::json_body(spec)?,
        )?
        .json()
    }

    /// Sandbox `id`'s programs (`GET /v1/sandboxes/{id}/processes`).
    pub fn processes(&self, id: &str) -> Result<Vec<ProcessInfo>, ApiClientError> {
        self.send("GET", &Self::sandbox_path(id, "/processes"), Payload::None)?
            .json()
    }

    fn process_path(id: &str, pid: i32, rest: &str) -> String {
        Self::sandbox_path(id, &format!("/processes/{pid}{rest}"))
    }

    /// Program `pid` of sandbox `id`.
    pub fn process(&self, id: &str, pid: i32) -> Result<ProcessInfo, ApiClientError> {
        self.send("GET", &Self::process_path(id, pid, ""), Payload::None)?
            .json()
    }

    /// Program `pid`'s output from byte `from`: what the guest kept, then,
    /// with `follow`, live output until it ends (or until it wrote the
    /// text `until`: a `matched` event).
    pub fn process_output(
        &self,
        id: &str,
        pid: i32,
        from: u64,
        follow: bool,
        until: Option<&str>,
    ) -> Result<ProcessStream, ApiClientError> {
        let mut query = format!("/output?from={from}&follow={follow}");
        if let Some(text) = until {
            query.push_str(&format!("&until={}", encode(text)));
        }
        let route = Self::process_path(id, pid, &query);
        Ok(ProcessStream(self.send("GET", &route, Payload::None)?))
    }

    /// Writes `data` to program `pid`'s stdin; with `close`, then ends it.
    pub fn write_process_stdin(
        &self,
        id: &str,
        pid: i32,
        data: &[u8],
        close: bool,
    ) -> Result<(), ApiClientError> {
        let route = Self::process_path(id, pid, &format!("/stdin?close={close}"));
        let mut data = data;
        self.send("POST", &route, Payload::Stream(&mut data))
            .map(drop)
    }

    /// Sends `signal` (a name such as `TERM`, or a number) to program `pid`.
    pub fn signal_process(&self, id: &str, pid: i32, signal: &str) -> Result<(), ApiClientError> {
        let signal = match signal.parse::<i32>() {
            Ok(n) => SignalName::Number(n),
            Err(_) => SignalName::Name(signal.to_owned()),
        };
        self.send(
            "POST",
            &Self::process_path(id, pid, "/signal"),
            Self::json_body(&SignalRequest { signal })?,
        )
        .map(drop)
    }

    /// Resizes program `pid`'s terminal.
    pub fn resize_process(
        &self,
        id: &str,
        pid: i32,
        size: TerminalSize,
    ) -> Result<(), ApiClientError> {
        self.send(
            "POST",
            &Self::process_path(id, pid, "/resize"),
            Self::json_body(&size)?,
        )
        .map(drop)
    }

    /// Removes ended program `pid` and its kept output.
    pub fn remove_process(&self, id: &str, pid: i32) -> Result<(), ApiClientError> {
        self.send("DELETE", &Self::process_path(id, pid, ""), Payload::None)
            .map(drop)
    }

    /// Sandbox `id`'s guest: uptime, clock, memory, load, processes
    /// (`GET /v1/sandboxes/{id}/health`).
    pub fn guest_health(&self, id: &str) -> Result<husk_types::Health, ApiClientError> {
        self.send("GET", &Self::sandbox_path(id, "/health"), Payload::None)?
            .json()
    }

    /// Changes under guest directory `path`, one JSON line each (`GET
    /// /v1/sandboxes/{id}/watch`; `{"watching": PATH}` first).
    pub fn watch(&self, id: &str, path: &str, recursive: bool) -> Result<Response, ApiClientError> {
        let route = format!("/watch?path={}&recursive={recursive}", encode(path));
        self.send("GET", &Self::sandbox_path(id, &route), Payload::None)
    }

    /// The guest file `path`, its body read as it comes (its size in
    /// `content-length`) (`GET /v1/sandboxes/{id}/files`).
    pub fn read_file(&self, id: &str, path: &str) -> Result<Response, ApiClientError> {
        let route = Self::sandbox_path(id, &format!("/files?path={}", encode(path)));
        self.send("GET", &route, Payload::None)
    }

    /// Writes the guest file `path` (permission bits `mode`, 0644 if not
    /// given) from `data`, whole or not at all
    /// (`PUT /v1/sandboxes/{id}/files`).
    pub fn write_file(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        data: &mut dyn Read,
    ) -> Result<(), ApiClientError> {
        let mut query = format!("/files?path={}", encode(path));
        if let Some(mode) = mode {
            query.push_str(&format!("&mode={mode:o}"));
        }
        self.send(
            "PUT",
            &Self::sandbox_path(id, &query),
            Payload::Stream(data),
        )
        .map(drop)
    }

    /// The entries of the guest directory `path`
    /// (`GET /v1/sandboxes/{id}/dir`).
    pub fn list_dir(&self, id: &str, path: &str) -> Result<Vec<DirEntry>, ApiClientError> {
        let route = Self::sandbox_path(id, &format!("/dir?path={}", encode(path)));
        self.send("GET", &route, Payload::None)?.json()
    }

    /// Every template (`GET /v1/templates`).
    pub fn templates(&self) -> Result<Vec<TemplateRecord>, ApiClientError> {
        self.send("GET", "/v1/templates", Payload::None)?.json()
    }

    /// Template `name` (`GET /v1/templates/{name}`).
    pub fn template(&self, name: &str) -> Result<TemplateRecord, ApiClientError> {
        self.send("GET", &Self::template_path(name, ""), Payload::None)?
            .json()
    }

    /// Builds a template; its progress as it comes (`POST /v1/templates`).
    pub fn build_template(&self, spec: &TemplateSpec) -> Result<BuildStream, ApiClientError> {
        let resp = self.send("POST", "/v1/templates", Self::json_body(spec)?)?;
        Ok(BuildStream(resp))
    }

    /// Removes template `name` (`DELETE /v1/templates/{name}`).
    pub fn remove_template(&self, name: &str) -> Result<(), ApiClientError> {
        self.send("DELETE", &Self::template_path(name, ""), Payload::None)
            .map(drop)
    }

    /// Checks template `name`'s files against their checksums
    /// (`POST /v1/templates/{name}/verify`); what was checked.
    pub fn verify_template(&self, name: &str) -> Result<serde_json::Value, ApiClientError> {
        self.send("POST", &Self::template_path(name, "/verify"), Payload::None)?
            .json()
    }

    /// Makes named volume `name` (`POST /v1/volumes`).
    pub fn create_volume(&self, name: &str) -> Result<VolumeInfo, ApiClientError> {
        let body = serde_json::to_vec(&VolumeRequest {
            name: name.to_owned(),
        })
        .unwrap_or_default();
        self.send("POST", "/v1/volumes", Payload::Json(body))?
            .json()
    }

    /// Every named volume (`GET /v1/volumes`).
    pub fn volumes(&self) -> Result<Vec<VolumeInfo>, ApiClientError> {
        self.send("GET", "/v1/volumes", Payload::None)?.json()
    }

    /// Deletes named volume `name` and its files (`DELETE /v1/volumes/{name}`).
    pub fn delete_volume(&self, name: &str) -> Result<(), ApiClientError> {
        self.send(
            "DELETE",
            &format!("/v1/volumes/{}", encode(name)),
            Payload::None,
        )
        .map(drop)
    }

    /// Makes named secret `name` with `value` (`POST /v1/secrets`).
    pub fn create_secret(&self, name: &str, value: &str) -> Result<SecretInfo, ApiClientError> {
        let body = serde_json::to_vec(&SecretRequest {
            name: Some(name.to_owned()),
            value: value.to_owned(),
            metadata: None,
        })
        .unwrap_or_default();
        self.send("POST", "/v1/secrets", Payload::Json(body))?
            .json()
    }

    /// Gives secret `id_or_name` a new value, its next version (`PUT
    /// /v1/secrets/{id}`).
    pub fn update_secret(
        &self,
        id_or_name: &str,
        value: &str,
    ) -> Result<SecretInfo, ApiClientError> {
        let body = serde_json::to_vec(&SecretRequest {
            name: None,
            value: value.to_owned(),
            metadata: None,
        })
        .unwrap_or_default();
        let path = format!("/v1/secrets/{}", encode(id_or_name));
        self.send("PUT", &path, Payload::Json(body))?.json()
    }

    /// Every named secret, never a value (`GET /v1/secrets`).
    pub fn secrets(&self) -> Result<Vec<SecretInfo>, ApiClientError> {
        self.send("GET", "/v1/secrets", Payload::None)?.json()
    }

    /// Deletes secret `id_or_name` (`DELETE /v1/secrets/{id}`).
    pub fn delete_secret(&self, id_or_name: &str) -> Result<(), ApiClientError> {
        let path = format!("/v1/secrets/{}", encode(id_or_name));
        self.send("DELETE", &path, Payload::None).map(drop)
    }

    /// Every warm pool (`GET /v1/pools`).
    pub fn pools(&self) -> Result<Vec<PoolInfo>, ApiClientError> {
        self.send("GET", "/v1/pools", Payload::None)?.json()
    }

    /// Sets template `template`'s warm pool to `size` clones
    /// (`PUT /v1/pools/{template}`).
    pub fn set_pool(&self, template: &str, size: u32) -> Result<PoolInfo, ApiClientError> {
        let route = format!("/v1/pools/{}", encode(template));
        self.send("PUT", &route, Self::json_body(&PoolSize { size })?)?
            .json()
    }

    /// The audit log, of one sandbox if given (`GET /v1/audit`).
    pub fn audit(&self, sandbox: Option<&str>) -> Result<Vec<AuditEntry>, ApiClientError> {
        let route = match sandbox {
            Some(s) => format!("/v1/audit?sandbox={}", encode(s)),
            None => "/v1/audit".to_owned(),
        };
        self.send("GET", &route, Payload::None)?.json()
    }
}

/// A template build's progress, as it comes.
#[derive(Debug)]
pub struct BuildStream(Response);

impl BuildStream {
    /// The next event; None when the stream ended (after `done` or
    /// `error`, or cut off).
    pub fn next_event(&mut self) -> Result<Option<BuildEvent>, ApiClientError> {
        self.0.next_line()
    }

    /// Waits for the build's end: the template, or the daemon's refusal
    /// (progress goes to `progress`).
    pub fn finish(
        mut self,
        mut progress: impl FnMut(&str),
    ) -> Result<TemplateRecord, ApiClientError> {
        while let Some(event) = self.next_event()? {
            match event {
                BuildEvent::Progress { message } => progress(&message),
                BuildEvent::Done { template } => return Ok(*template),
                BuildEvent::Error { status, error } => {
                    return Err(ApiClientError::Status {
                        status,
                        message: error,
                    })
                }
            }
        }
        Err(ApiClientError::Malformed(
            "the build's stream ended without a result".into(),
        ))
    }
}

/// The events of an exec, as they come.
#[derive(Debug)]
pub struct ExecStream(Response);

impl ExecStream {
    /// The next event; None when the stream ended (after `exit` or
    /// `error`, or cut off).
    pub fn next_event(&mut self) -> Result<Option<ExecEvent>, ApiClientError> {
        self.0.next_line()
    }
}

/// A program's output events, as they come.
#[derive(Debug)]
pub struct ProcessStream(Response);

impl ProcessStream {
    /// The next event; None when the stream ended (after `exit`, `caught`
    /// or `error`, or cut off).
    pub fn next_event(&mut self) -> Result<Option<ProcessEvent>, ApiClientError> {
        self.0.next_line()
    }
}

/// Appends the tree at `dir` as `.` and what is below it. The top
/// directory's modification time is left out (0): a container's root is
/// a mount made for it, whose time says when, so that the same image's
/// trees archive to the same bytes (the daemon keeps media by their hash).
fn append_tree<W: std::io::Write>(
    tar: &mut tar::Builder<W>,
    dir: &std::path::Path,
) -> std::io::Result<()> {
    let mut top = tar::Header::new_gnu();
    top.set_metadata_in_mode(&std::fs::metadata(dir)?, tar::HeaderMode::Complete);
    top.set_mtime(0);
    tar.append_data(&mut top, ".", std::io::empty())?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = std::path::Path::new(".").join(entry.file_name());
        if entry.file_type()?.is_dir() {
            tar.append_dir_all(&name, entry.path())?;
        } else {
            tar.append_path_with_name(entry.path(), &name)?;
        }
    }
    Ok(())
}

/// Percent-encodes a query value.
pub fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixListener;

    /// A one-request server on a Unix socket: reads the request head,
    /// then `answer(head, stream)`.
    fn server(
        answer: impl FnOnce(String, &mut std::os::unix::net::UnixStream) + Send + 'static,
    ) -> (ApiClient, std::thread::JoinHandle<()>, tempdir::Dir) {
        let dir = tempdir::Dir::new();
        let path = dir.0.join("api.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let served = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().expect("accept");
            let mut reader = BufReader::new(conn.try_clone().expect("clone"));
            let mut head = String::new();
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).expect("read") == 0 || line == "\r\n" {
                    break;
                }
                head.push_str(&line);
            }
            answer(head, &mut conn);
        });
        (ApiClient::new(Endpoint::Unix(path)), served, dir)
    }

    mod tempdir {
        /// A directory removed when dropped.
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Self {
                let dir = std::env::temp_dir().join(format!(
                    "husk-client-test-{}-{:?}",
                    std::process::id(),
                    std::thread::current().id()
                ));
                let _ = std::fs::remove_dir_all(&dir);
                std::fs::create_dir_all(&dir).expect("dir");
                Dir(dir)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn a_chunked_answer_is_read_as_it_comes() {
        let (api, served, _dir) = server(|head, conn| {
            assert!(
                head.starts_with("POST /v1/sandboxes/sb-1/exec HTTP/1.1\r\n"),
                "{head}"
            );
            assert!(head.to_ascii_lowercase().contains("host: husk"), "{head}");
            let events = [
                r#"{"type":"started","pid":7}"#,
                r#"{"type":"stdout","data":"aGkK"}"#,
                r#"{"type":"exit","code":0,"user_us":1,"system_us":2}"#,
            ];
            conn.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                .expect("write");
            for e in events {
                // Each event cut in two chunks.
                let line = format!("{e}\n");
                let (a, b) = line.split_at(5);
                for part in [a, b] {
                    write!(conn, "{:x}\r\n{part}\r\n", part.len()).expect("write");
                }
            }
            conn.write_all(b"0\r\n\r\n").expect("write");
        });
        let spec = ExecSpec {
            argv: vec!["echo".into(), "hi".into()],
            ..Default::default()
        };
        let mut events = api.exec("sb-1", &spec).expect("exec");
        let mut seen = Vec::new();
        while let Some(e) = events.next_event().expect("event") {
            seen.push(e);
        }
        assert_eq!(seen.len(), 3, "{seen:?}");
        assert!(matches!(&seen[1], ExecEvent::Stdout { data } if data == "aGkK"));
        assert!(matches!(seen[2], ExecEvent::Exit { code: Some(0), .. }));
        served.join().expect("server");
    }

    #[test]
    fn an_early_refusal_of_an_upload_is_the_answer() {
        let (api, served, _dir) = server(|_, conn| {
            let body = r#"{"error":"the upload is over this daemon's limit"}"#;
            write!(
                conn,
                "HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
            .expect("write");
        });
        // Far more than the socket buffers hold: the daemon reads none.
        let mut big = std::io::repeat(b'x').take(64 << 20);
        match api.send("POST", "/v1/uploads", Payload::Stream(&mut big)) {
            Err(ApiClientError::Status {
                status: 413,
                message,
            }) => {
                assert!(message.contains("over this daemon's limit"), "{message}")
            }
            other => panic!("{other:?}"),
        }
        served.join().expect("server");
    }

    #[test]
    fn a_body_that_cannot_be_read_abandons_the_request() {
        struct Broken;
        impl Read for Broken {
            fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
                Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    "the file cannot be read",
                ))
            }
        }
        let (api, served, _dir) = server(|_, conn| {
            // The request never completes: whatever is read ends when the
            // client gives up.
            let mut rest = Vec::new();
            let _ = conn.read_to_end(&mut rest);
        });
        match api.send("PUT", "/x", Payload::Stream(&mut Broken)) {
            Err(ApiClientError::Io(e)) => {
                assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}")
            }
            other => panic!("{other:?}"),
        }
        served.join().expect("server");
    }

    #[test]
    fn errors_say_where_and_what() {
        let api = ApiClient::new(Endpoint::Unix("/nonexistent/husk.sock".into()));
        let e = api.list_dir("sb-1", "/").expect_err("no daemon");
        assert!(
            e.to_string()
                .contains("cannot reach the husk daemon at /nonexistent/husk.sock"),
            "{e}"
        );
        let (api, served, _dir) = server(|head, conn| {
            assert!(
                head.starts_with("GET /v1/sandboxes/sb-1/dir?path=/a%20b HTTP/1.1"),
                "{head}"
            );
            let body = r#"{"error":"no sandbox `sb-1`"}"#;
            write!(
                conn,
                "HTTP/1.1 404 Not Found\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .expect("write");
        });
        match api.list_dir("sb-1", "/a b") {
            Err(ApiClientError::Status {
                status: 404,
                message,
            }) => {
                assert_eq!(message, "no sandbox `sb-1`")
            }
            other => panic!("{other:?}"),
        }
        served.join().expect("server");
    }
}
