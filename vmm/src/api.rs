//! The control socket (`husk-vmm --api-sock PATH`): one request per
//! connection, one line each way.
//!
//! | request | reply (one JSON line) |
//! |---|---|
//! | `status` | `{"ok":true,"id":..,"state":"running"\|"paused"}` |
//! | `pause` | `{"ok":true,"pause_us":N}`: every vCPU is out of KVM_RUN |
//! | `resume` | `{"ok":true}` |
//! | `snapshot DIR` | `{"ok":true,...timings}`: a full snapshot in DIR (see `persist`); a running VM is paused for it and resumed after |
//! | `snapshot-diff DIR` | the same, with only the pages written since the last snapshot (or the restore) |
//!
//! Failures answer `{"ok":false,"error":"..."}`. Requests are carried out
//! on the VMM's main thread between device events, so devices are quiet
//! while a snapshot is taken.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};

/// Longest request line.
const MAX_LINE: u64 = 4096;

/// What a client asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Status,
    Pause,
    Resume,
    Snapshot(PathBuf),
    SnapshotDiff(PathBuf),
}

impl std::str::FromStr for Request {
    type Err = String;

    fn from_str(line: &str) -> Result<Self, String> {
        let line = line.trim();
        let (verb, arg) = line.split_once(' ').unwrap_or((line, ""));
        let arg = arg.trim();
        match (verb, arg.is_empty()) {
            ("status", true) => Ok(Request::Status),
            ("pause", true) => Ok(Request::Pause),
            ("resume", true) => Ok(Request::Resume),
            ("snapshot", false) => Ok(Request::Snapshot(PathBuf::from(arg))),
            ("snapshot-diff", false) => Ok(Request::SnapshotDiff(PathBuf::from(arg))),
            ("snapshot" | "snapshot-diff", true) => {
                Err(format!("{verb} needs a directory: `{verb} DIR`"))
            }
            _ => Err(format!(
                "unknown request `{line}` (status, pause, resume, snapshot DIR, snapshot-diff DIR)"
            )),
        }
    }
}

/// A request waiting for the main loop, with the connection to answer on.
pub type Pending = Arc<Mutex<Vec<(Request, UnixStream)>>>;

/// Sends one reply line; a client that left is not an error.
pub fn reply(mut stream: UnixStream, body: &serde_json::Value) {
    let _ = stream.write_all(format!("{body}\n").as_bytes());
}

pub fn error_reply(stream: UnixStream, message: &str) {
    reply(
        stream,
        &serde_json::json!({ "ok": false, "error": message }),
    );
}

/// The listening socket, served in the event loop.
#[derive(Debug)]
pub struct ApiServer {
    listener: UnixListener,
    path: PathBuf,
    pending: Pending,
}

impl ApiServer {
    /// Listens on `path` (a stale socket there is replaced).
    pub fn bind(path: &Path) -> std::io::Result<(Self, Pending)> {
        use std::os::unix::fs::FileTypeExt;
        if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
            std::fs::remove_file(path)?;
        }
        let listener = UnixListener::bind(path)?;
        listener.set_nonblocking(true)?;
        let pending = Pending::default();
        Ok((
            ApiServer {
                listener,
                path: path.to_path_buf(),
                pending: pending.clone(),
            },
            pending,
        ))
    }

    fn take_request(&self, stream: UnixStream) {
        // The main loop waits for at most this long on a slow client.
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let mut line = String::new();
        let read = match stream.try_clone() {
            Ok(s) => std::io::Read::take(BufReader::new(s), MAX_LINE).read_line(&mut line),
            Err(e) => Err(e),
        };
        match read.map(|_| line.parse::<Request>()) {
            Ok(Ok(request)) => self
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((request, stream)),
            Ok(Err(message)) => error_reply(stream, &message),
            Err(e) => error_reply(stream, &format!("cannot read the request: {e}")),
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl MutEventSubscriber for ApiServer {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new_raw(self.listener.as_raw_fd(), EventSet::IN)) {
            tracing::error!("api: cannot watch the socket: {e:?}");
        }
    }

    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        while let Ok((stream, _)) = self.listener.accept() {
            self.take_request(stream);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_and_bad_ones_say_why() {
        assert_eq!("pause\n".parse(), Ok(Request::Pause));
        assert_eq!(" resume ".parse(), Ok(Request::Resume));
        assert_eq!("status".parse(), Ok(Request::Status));
        assert_eq!(
            "snapshot /tmp/s 1".parse(),
            Ok(Request::Snapshot(PathBuf::from("/tmp/s 1")))
        );
        assert!("snapshot".parse::<Request>().is_err());
        assert!("reboot"
            .parse::<Request>()
            .expect_err("unknown request")
            .contains("unknown request"));
        assert!("pause now".parse::<Request>().is_err());
    }
}
