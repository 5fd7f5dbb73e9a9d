//! A typed client of guest-init's agent, reached through the VMM's vsock
//! Unix socket (`CONNECT <port>` protocol).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use husk_protocol::{
    read_frame, write_frame, Body, DirEntry, ErrorKind, ExecRequest, ExitReport, FileStat, Frame,
    ProtocolError, Stream, AGENT_PORT, FILE_CHUNK, VERSION,
};

/// Errors talking to the agent.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the VMM's vsock socket {0}: {1}")]
    Connect(String, #[source] std::io::Error),
    #[error("the guest did not accept the connection (is guest-init's agent running?): {0}")]
    Refused(String),
    #[error("the agent refused the request ({kind:?}): {message}")]
    Agent { kind: ErrorKind, message: String },
    #[error("unexpected reply: {0:?}")]
    Unexpected(Body),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

/// What an `exec` produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub report: ExitReport,
}

/// A connection to the agent of one VM.
#[derive(Debug)]
pub struct AgentClient {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    next_id: u64,
}

impl AgentClient {
    /// Connects through the VMM's vsock socket `uds` and shakes hands.
    /// `timeout` bounds each read.
    pub fn connect(uds: &Path, timeout: Duration) -> Result<Self, ClientError> {
        let mut stream = UnixStream::connect(uds)
            .map_err(|e| ClientError::Connect(uds.display().to_string(), e))?;
        stream.set_read_timeout(Some(timeout))?;
        stream.write_all(format!("CONNECT {AGENT_PORT}\n").as_bytes())?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut line = String::new();
        reader.read_line(&mut line)?;
        if !line.starts_with("OK ") {
            return Err(ClientError::Refused(line.trim().to_owned()));
        }
        let mut client = AgentClient {
            reader,
            writer: stream,
            next_id: 1,
        };
        match client.call(Body::Hello { version: VERSION })? {
            Body::Hello { version: VERSION } => Ok(client),
            other => Err(ClientError::Unexpected(other)),
        }
    }

    /// Sends a request under a fresh id; returns the id.
    fn send(&mut self, body: Body) -> Result<u64, ClientError> {
        let id = self.next_id;
        self.next_id += 1;
        write_frame(&mut self.writer, &Frame { id, body })?;
        Ok(id)
    }

    /// Reads the next frame of request `id`; an agent error ends the request.
    fn reply(&mut self, id: u64) -> Result<Body, ClientError> {
        let frame = read_frame(&mut self.reader)?;
        match frame.body {
            Body::Error { kind, message } => Err(ClientError::Agent { kind, message }),
            body if frame.id == id => Ok(body),
            body => Err(ClientError::Unexpected(body)),
        }
    }

    /// Sends one request and waits for its single reply.
    fn call(&mut self, body: Body) -> Result<Body, ClientError> {
        let id = self.send(body)?;
        self.reply(id)
    }

    /// Checks the agent is alive; returns the guest's uptime in ms.
    pub fn ping(&mut self) -> Result<u64, ClientError> {
        match self.call(Body::Ping)? {
            Body::Pong { uptime_ms } => Ok(uptime_ms),
            other => Err(ClientError::Unexpected(other)),
        }
    }

    /// Runs a program in the guest and collects its output. Output chunks
    /// arrive while it runs; they are kept in memory here, so callers that
    /// expect a lot of output should bound it with `timeout_ms` or a wrapper.
    pub fn exec(&mut self, req: ExecRequest) -> Result<ExecOutput, ClientError> {
        let id = self.send(Body::Exec(req))?;
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        loop {
            match self.reply(id)? {
                Body::Output {
                    stream: Stream::Stdout,
                    data,
                } => stdout.extend(data),
                Body::Output {
                    stream: Stream::Stderr,
                    data,
                } => stderr.extend(data),
                Body::Exited(report) => {
                    return Ok(ExecOutput {
                        stdout,
                        stderr,
                        report,
                    })
                }
                other => return Err(ClientError::Unexpected(other)),
            }
        }
    }

    /// Writes `content` to `path` in the guest with permission bits `mode`.
    /// The file appears whole or not at all (temporary file + rename).
    pub fn write_file(
        &mut self,
        path: &str,
        mode: u32,
        mut content: impl Read,
    ) -> Result<u64, ClientError> {
        let id = self.send(Body::WriteFile {
            path: path.to_owned(),
            mode,
        })?;
        let mut buf = vec![0u8; FILE_CHUNK];
        loop {
            let n = content.read(&mut buf)?;
            if n == 0 {
                break;
            }
            let body = Body::FileChunk {
                data: buf[..n].to_vec(),
            };
            write_frame(&mut self.writer, &Frame { id, body })?;
        }
        write_frame(
            &mut self.writer,
            &Frame {
                id,
                body: Body::FileCommit,
            },
        )?;
        match self.reply(id)? {
            Body::Written { size } => Ok(size),
            other => Err(ClientError::Unexpected(other)),
        }
    }

    /// Streams the guest file `path` into `sink`; returns its size.
    pub fn read_file(&mut self, path: &str, mut sink: impl Write) -> Result<u64, ClientError> {
        let id = self.send(Body::ReadFile {
            path: path.to_owned(),
        })?;
        loop {
            match self.reply(id)? {
                Body::FileChunk { data } => sink.write_all(&data)?,
                Body::FileEnd { size } => return Ok(size),
                other => return Err(ClientError::Unexpected(other)),
            }
        }
    }

    /// Metadata of a guest path (a final symlink is not followed).
    pub fn stat(&mut self, path: &str) -> Result<FileStat, ClientError> {
        match self.call(Body::Stat {
            path: path.to_owned(),
        })? {
            Body::StatInfo(stat) => Ok(stat),
            other => Err(ClientError::Unexpected(other)),
        }
    }

    /// The entries of a guest directory.
    pub fn list(&mut self, path: &str) -> Result<Vec<DirEntry>, ClientError> {
        let id = self.send(Body::List {
            path: path.to_owned(),
        })?;
        let mut all = Vec::new();
        loop {
            match self.reply(id)? {
                Body::Entries { entries, more } => {
                    all.extend(entries);
                    if !more {
                        return Ok(all);
                    }
                }
                other => return Err(ClientError::Unexpected(other)),
            }
        }
    }

    /// `mkdir -p` in the guest.
    pub fn mkdir(&mut self, path: &str) -> Result<(), ClientError> {
        self.expect_done(Body::Mkdir {
            path: path.to_owned(),
        })
    }

    /// Removes a file, an empty directory, or (with `recursive`) a tree.
    pub fn remove(&mut self, path: &str, recursive: bool) -> Result<(), ClientError> {
        self.expect_done(Body::Remove {
            path: path.to_owned(),
            recursive,
        })
    }

    /// Renames within the guest.
    pub fn rename(&mut self, from: &str, to: &str) -> Result<(), ClientError> {
        self.expect_done(Body::Rename {
            from: from.to_owned(),
            to: to.to_owned(),
        })
    }

    fn expect_done(&mut self, body: Body) -> Result<(), ClientError> {
        match self.call(body)? {
            Body::Done => Ok(()),
            other => Err(ClientError::Unexpected(other)),
        }
    }

    /// The raw stream, for tests that must misbehave on purpose.
    pub fn stream(&mut self) -> (&mut BufReader<UnixStream>, &mut UnixStream) {
        (&mut self.reader, &mut self.writer)
    }
}
