//! A small blocking HTTP/1.1 client of the daemon's API, for the CLI and
//! the tests: one connection per request (`Connection: close`), bodies
//! streamed both ways (chunked uploads; chunked or sized answers read as
//! they come).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use husk_types::{CreateRequest, Created, DirEntry, ExecEvent, ExecSpec};

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

trait Conn: Read + Write + Send {}
impl<T: Read + Write + Send> Conn for T {}

/// The daemon's client.
#[derive(Debug, Clone)]
pub struct ApiClient {
    endpoint: Endpoint,
    timeout: Option<Duration>,
}

/// An answer whose body is read as it comes.
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    body: BodyReader,
}

impl std::fmt::Debug for Response {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Response")
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

enum Framing {
    Length(u64),
    Chunked { left: u64, done: bool },
    UntilClose,
}

struct BodyReader {
    conn: BufReader<Box<dyn Conn>>,
    framing: Framing,
}

impl Read for BodyReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match &mut self.framing {
            Framing::Length(0) => Ok(0),
            Framing::Length(left) => {
                let max = (*left).min(buf.len() as u64) as usize;
                let n = self.conn.read(&mut buf[..max])?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                *left -= n as u64;
                Ok(n)
            }
            Framing::UntilClose => self.conn.read(buf),
            Framing::Chunked { left, done } => {
                if *done {
                    return Ok(0);
                }
                if *left == 0 {
                    let mut size = String::new();
                    self.conn.read_line(&mut size)?;
                    if size.is_empty() {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "the daemon ended the answer early",
                        ));
                    }
                    let hex = size.trim().split(';').next().unwrap_or("");
                    *left = u64::from_str_radix(hex, 16).map_err(|_| {
                        std::io::Error::new(std::io::ErrorKind::InvalidData, "bad chunk size")
                    })?;
                    if *left == 0 {
                        *done = true;
                        return Ok(0);
                    }
                }
                let max = (*left).min(buf.len() as u64) as usize;
                let n = self.conn.read(&mut buf[..max])?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                *left -= n as u64;
                if *left == 0 {
                    let mut crlf = [0u8; 2];
                    self.conn.read_exact(&mut crlf)?;
                }
                Ok(n)
            }
        }
    }
}

impl Read for Response {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.body.read(buf)
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

    /// Bounds each read of an answer (none by default: an exec may be
    /// silent for a long time).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    fn connect(&self) -> Result<Box<dyn Conn>, ApiClientError> {
        Ok(match &self.endpoint {
            Endpoint::Unix(path) => {
                let s = UnixStream::connect(path)
                    .map_err(|e| ApiClientError::Connect(path.display().to_string(), e))?;
                s.set_read_timeout(self.timeout)?;
                Box::new(s)
            }
            Endpoint::Tcp(addr, _) => {
                let s = TcpStream::connect(addr)
                    .map_err(|e| ApiClientError::Connect(addr.clone(), e))?;
                s.set_read_timeout(self.timeout)?;
                Box::new(s)
            }
        })
    }

    /// Sends a request; an answer with an error status becomes
    /// [`ApiClientError::Status`] with the daemon's message.
    pub fn send(
        &self,
        method: &str,
        path: &str,
        payload: Payload<'_>,
    ) -> Result<Response, ApiClientError> {
        let mut conn = self.connect()?;
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: husk\r\nConnection: close\r\n");
        if let Endpoint::Tcp(_, token) = &self.endpoint {
            head.push_str(&format!("Authorization: Bearer {token}\r\n"));
        }
        match &payload {
            Payload::None => head.push_str("Content-Length: 0\r\n\r\n"),
            Payload::Json(body) => head.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                body.len()
            )),
            Payload::Stream(_) => head.push_str(
                "Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n",
            ),
        }
        // A daemon that refuses the request early (a body over its limit)
        // answers and closes before the body is all sent: its answer is
        // what matters, so a failed write is reported only without one.
        let written = match write_request(&mut *conn, head.as_bytes(), payload) {
            // Our own body failed (a file that cannot be read): the
            // request is abandoned, and the connection closed with it.
            Err(Failed::Payload(e)) => return Err(e.into()),
            Err(Failed::Socket(e)) => Err(e),
            Ok(()) => Ok(()),
        };
        let response = match (read_head(BufReader::new(conn)), written) {
            (Ok(r), _) => r,
            (Err(_), Err(e)) => return Err(e.into()),
            (Err(e), Ok(())) => return Err(e),
        };
        if response.status >= 400 {
            let status = response.status;
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
            tar.append_dir_all(".", &dir)
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

/// Sandboxes, typed: the routes and bodies of `host/openapi.json`.
impl ApiClient {
    fn sandbox_path(id: &str, rest: &str) -> String {
        format!("/v1/sandboxes/{}{rest}", encode(id))
    }

    /// Creates a sandbox (`POST /v1/sandboxes`).
    pub fn create_sandbox(&self, req: &CreateRequest) -> Result<Created, ApiClientError> {
        let body = serde_json::to_vec(req).map_err(|e| ApiClientError::Malformed(e.to_string()))?;
        self.send("POST", "/v1/sandboxes", Payload::Json(body))?
            .json()
    }

    /// Destroys sandbox `id` (`DELETE /v1/sandboxes/{id}`).
    pub fn destroy_sandbox(&self, id: &str) -> Result<(), ApiClientError> {
        self.send("DELETE", &Self::sandbox_path(id, ""), Payload::None)
            .map(drop)
    }

    /// Runs `spec` in sandbox `id`; its events as they come
    /// (`POST /v1/sandboxes/{id}/exec`).
    pub fn exec(&self, id: &str, spec: &ExecSpec) -> Result<ExecStream, ApiClientError> {
        let body =
            serde_json::to_vec(spec).map_err(|e| ApiClientError::Malformed(e.to_string()))?;
        let resp = self.send(
            "POST",
            &Self::sandbox_path(id, "/exec"),
            Payload::Json(body),
        )?;
        Ok(ExecStream(resp))
    }

    /// The guest file `path`, its body read as it comes (its size in
    /// `content-length`) (`GET /v1/sandboxes/{id}/files`).
    pub fn read_file(&self, id: &str, path: &str) -> Result<Response, ApiClientError> {
        let route = Self::sandbox_path(id, &format!("/files?path={}", encode(path)));
        self.send("GET", &route, Payload::None)
    }

    /// Writes the guest file `path` from `data`, whole or not at all
    /// (`PUT /v1/sandboxes/{id}/files`).
    pub fn write_file(
        &self,
        id: &str,
        path: &str,
        data: &mut dyn Read,
    ) -> Result<(), ApiClientError> {
        let route = Self::sandbox_path(id, &format!("/files?path={}", encode(path)));
        self.send("PUT", &route, Payload::Stream(data)).map(drop)
    }

    /// The entries of the guest directory `path`
    /// (`GET /v1/sandboxes/{id}/dir`).
    pub fn list_dir(&self, id: &str, path: &str) -> Result<Vec<DirEntry>, ApiClientError> {
        let route = Self::sandbox_path(id, &format!("/dir?path={}", encode(path)));
        self.send("GET", &route, Payload::None)?.json()
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

/// Why a request could not be written.
enum Failed {
    /// The request body's reader failed.
    Payload(std::io::Error),
    /// The connection failed (the daemon may have answered early).
    Socket(std::io::Error),
}

fn write_request(conn: &mut dyn Conn, head: &[u8], payload: Payload<'_>) -> Result<(), Failed> {
    let sock = Failed::Socket;
    conn.write_all(head).map_err(sock)?;
    match payload {
        Payload::None => {}
        Payload::Json(body) => conn.write_all(&body).map_err(sock)?,
        Payload::Stream(reader) => {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = reader.read(&mut buf).map_err(Failed::Payload)?;
                if n == 0 {
                    break;
                }
                conn.write_all(format!("{n:x}\r\n").as_bytes())
                    .map_err(sock)?;
                conn.write_all(&buf[..n]).map_err(sock)?;
                conn.write_all(b"\r\n").map_err(sock)?;
            }
            conn.write_all(b"0\r\n\r\n").map_err(sock)?;
        }
    }
    conn.flush().map_err(sock)
}

fn read_head(mut conn: BufReader<Box<dyn Conn>>) -> Result<Response, ApiClientError> {
    let mut status_line = String::new();
    conn.read_line(&mut status_line)?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| ApiClientError::Malformed(format!("status line {status_line:?}")))?;
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        conn.read_line(&mut h)?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if headers.len() > 100 {
            return Err(ApiClientError::Malformed("too many headers".into()));
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
    let get = |name: &str| {
        headers
            .iter()
            .find(|(k, _): &&(String, String)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let framing = if get("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        Framing::Chunked {
            left: 0,
            done: false,
        }
    } else if let Some(len) = get("content-length") {
        Framing::Length(
            len.parse()
                .map_err(|_| ApiClientError::Malformed(format!("content-length {len}")))?,
        )
    } else {
        Framing::UntilClose
    };
    Ok(Response {
        status,
        headers,
        body: BodyReader { conn, framing },
    })
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
