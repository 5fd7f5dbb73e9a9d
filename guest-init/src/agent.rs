//! The agent: serves the husk protocol (see the husk-protocol crate) on
//! vsock port AGENT_PORT, one thread per connection. Nothing a client sends
//! can end PID 1: every error is answered or ends only that connection.

use std::fs::File;
use std::io::BufReader;

use husk_protocol::{
    read_frame, write_frame, Body, ErrorKind, Frame, ProtocolError, AGENT_PORT, VERSION,
};

use crate::vsock::Listener;

/// Most connections served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 16;

/// Starts listening; the accept loop runs on its own thread.
pub fn start() -> std::io::Result<()> {
    let listener = Listener::bind(AGENT_PORT)?;
    std::thread::Builder::new()
        .name("agent".into())
        .spawn(move || accept_loop(listener))?;
    Ok(())
}

fn accept_loop(listener: Listener) {
    let active = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    loop {
        let stream = match listener.accept() {
            Ok(s) => s,
            Err(e) => {
                crate::log(&format!("agent: accept failed: {e}"));
                std::thread::sleep(std::time::Duration::from_millis(100));
                continue;
            }
        };
        if active.load(std::sync::atomic::Ordering::SeqCst) >= MAX_CONNECTIONS {
            continue; // dropping the stream closes it
        }
        active.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let count = active.clone();
        let spawned = std::thread::Builder::new()
            .name("agent-conn".into())
            .spawn(move || {
                serve(stream);
                count.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            });
        if spawned.is_err() {
            active.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

fn error(id: u64, kind: ErrorKind, message: impl Into<String>) -> Frame {
    Frame {
        id,
        body: Body::Error {
            kind,
            message: message.into(),
        },
    }
}

/// Serves one connection until the client leaves or breaks the framing.
fn serve(stream: File) {
    let Ok(out) = stream.try_clone() else {
        return;
    };
    // Replies and the output of running programs share the stream.
    let out = std::sync::Arc::new(std::sync::Mutex::new(out));
    let send = |frame: &Frame| {
        let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
        write_frame(&mut *out, frame)
    };
    let mut input = BufReader::new(stream);
    let mut greeted = false;
    let mut writing: Option<crate::files::PendingWrite> = None;
    loop {
        let reply = match read_frame(&mut input) {
            Ok(frame) if !greeted => match frame.body {
                Body::Hello { version: VERSION } => {
                    greeted = true;
                    Frame {
                        id: frame.id,
                        body: Body::Hello { version: VERSION },
                    }
                }
                Body::Hello { version } => {
                    let msg = format!("agent speaks version {VERSION}, client {version}");
                    let _ = send(&error(frame.id, ErrorKind::VersionMismatch, msg));
                    return;
                }
                _ => error(
                    frame.id,
                    ErrorKind::Malformed,
                    "the first message must be Hello",
                ),
            },
            Ok(Frame {
                id,
                body: Body::WriteFile { path, mode },
            }) => match writing {
                Some(_) => error(id, ErrorKind::Invalid, "a write is already in progress"),
                None => {
                    writing = Some(crate::files::PendingWrite::start(id, &path, mode));
                    continue;
                }
            },
            Ok(Frame {
                id,
                body: Body::FileChunk { data },
            }) => match writing.as_mut() {
                Some(w) if w.id == id => {
                    w.chunk(&data);
                    continue;
                }
                _ => error(id, ErrorKind::Invalid, "no write in progress"),
            },
            Ok(Frame {
                id,
                body: Body::FileCommit,
            }) => match writing.take() {
                Some(w) if w.id == id => w.commit(),
                other => {
                    writing = other;
                    error(id, ErrorKind::Invalid, "no write in progress")
                }
            },
            Ok(frame) => handle(frame, &out),
            Err(ProtocolError::Malformed(e)) => error(0, ErrorKind::Malformed, e.to_string()),
            Err(ProtocolError::TooLarge(n)) => {
                // The stream cannot be resynchronised: say why, then close.
                let msg = format!("frame of {n} bytes is over the limit");
                let _ = send(&error(0, ErrorKind::TooLarge, msg));
                return;
            }
            Err(_) => return,
        };
        if send(&reply).is_err() {
            return;
        }
    }
}

fn handle(frame: Frame, out: &std::sync::Arc<std::sync::Mutex<File>>) -> Frame {
    let body = match frame.body {
        Body::Ping => Body::Pong {
            uptime_ms: crate::sys::uptime_ms(),
        },
        Body::Exec(req) => return crate::exec::run(frame.id, req, out),
        Body::ReadFile { path } => return crate::files::read(frame.id, &path, out),
        Body::Stat { path } => return crate::files::stat(frame.id, &path),
        Body::List { path } => return crate::files::list(frame.id, &path, out),
        Body::Mkdir { path } => return crate::files::mkdir(frame.id, &path),
        Body::Remove { path, recursive } => {
            return crate::files::remove(frame.id, &path, recursive)
        }
        Body::Rename { from, to } => return crate::files::rename(frame.id, &from, &to),
        Body::Hello { .. } => Body::Error {
            kind: ErrorKind::Malformed,
            message: "already greeted".into(),
        },
        other => Body::Error {
            kind: ErrorKind::Unsupported,
            message: format!("the agent does not handle {other:?}"),
        },
    };
    Frame { id: frame.id, body }
}
