//! The control socket (`husk-vmm --api-sock PATH`): one request per
//! connection, one JSON line each way; the requests and replies are the
//! serde types of the `husk-vmm-api` crate, which clients share.
//!
//! Requests are carried out on the VMM's main thread between device
//! events, so devices are quiet while a snapshot is taken.

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use husk_vmm_api::{parse_request, read_request, to_line};
pub use husk_vmm_api::{Reply, Request, RunState, SnapshotReport};

/// A request waiting for the main loop, with the connection to answer on.
pub type Pending = Arc<Mutex<Vec<Taken>>>;

/// A request read from the socket.
#[derive(Debug)]
pub struct Taken {
    pub request: Request,
    /// The descriptor that came with it (a share's directory), if any.
    pub fd: Option<OwnedFd>,
    pub stream: UnixStream,
}

/// Sends one reply line; a client that left is not an error.
pub fn reply(mut stream: UnixStream, reply: &Reply) {
    let _ = stream.write_all(to_line(reply).as_bytes());
}

pub fn error_reply(stream: UnixStream, message: &str) {
    reply(
        stream,
        &Reply::Error {
            message: message.to_owned(),
        },
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
        match read_request(&stream).map(|(line, fd)| (parse_request(&line), fd)) {
            Ok((Ok(request), fd)) => {
                self.pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(Taken {
                        request,
                        fd,
                        stream,
                    })
            }
            Ok((Err(message), _)) => error_reply(stream, &message),
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
