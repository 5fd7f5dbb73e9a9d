//! husk-vmm's control socket (`husk-vmm --api-sock PATH`): the requests and
//! replies as serde types, shared by husk-vmm and every program that drives
//! it, and a blocking client. No KVM here: the host layer links this crate,
//! not the VMM.
//!
//! One request per connection: the client writes one JSON object on one
//! line, the VMM answers with one JSON line.
//!
//! | request | reply |
//! |---|---|
//! | `{"op":"status"}` | [`Reply::Status`]: running or paused, the VMM's phases |
//! | `{"op":"pause"}` | [`Reply::Paused`]: every vCPU is out of KVM_RUN |
//! | `{"op":"resume"}` | [`Reply::Resumed`] |
//! | `{"op":"snapshot","dir":DIR,"diff":false}` | [`Reply::Snapshot`]: a full snapshot (or with `diff`, only the pages written since the last one; for a restored VM not snapshotted since, the pages that are no longer those of the memory file its restore mapped, which becomes the base) in DIR; a running VM is paused for it and resumed after |
//! | `{"op":"medium","drive":ID,"path":FILE,"overlay":FILE}` | [`Reply::Medium`]: drive ID now reads FILE (copy-on-write into a new `overlay`, or read-only without one) and the guest is told its new capacity by a configuration change interrupt, as a CD drive takes a new disc; the guest must have stopped using the old one |
//! | `{"op":"share","spec":"tag=TAG,path=DIR[,ro][,owner=UID:GID[,guest-owner=UID:GID]][,hide=PATTERN]..."}` | [`Reply::Share`]: the virtio-fs device `TAG` (an empty slot, or a share the guest has not mounted) now serves DIR, with the options of `--fs`; the guest mounts it with `mount -t virtiofs TAG DIR` |
//!
//! A request the VMM cannot carry out gets [`Reply::Error`] with a message
//! that says why.

pub mod cmdline;
pub mod limits;
pub mod sched;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Longest request or reply line, in bytes.
pub const MAX_LINE: u64 = 64 << 10;

/// Most read-only layers husk-vmm stacks under a drive's overlay; a
/// snapshot that would stack more merges them into one (so a host that
/// keeps snapshots' layers knows which can still be read).
pub const MAX_DRIVE_LAYERS: usize = 8;

/// What a client asks of the VMM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Request {
    Status,
    Pause,
    Resume,
    Snapshot {
        dir: PathBuf,
        /// Only the pages written since the VM's last snapshot (or restore).
        #[serde(default)]
        diff: bool,
    },
    /// A new medium in a drive (see the table above).
    Medium {
        /// The drive's id (`--drive ...,id=ID`).
        drive: String,
        path: PathBuf,
        /// Where the guest's writes go (must not exist yet); without it
        /// the medium is read-only.
        #[serde(default)]
        overlay: Option<PathBuf>,
    },
    /// A directory for a virtio-fs device (see the table above).
    Share {
        /// As `--fs` takes it; it names a directory.
        spec: String,
    },
}

/// Whether the vCPUs run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RunState {
    Running,
    Paused,
}

/// What a snapshot took and wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotReport {
    pub dir: PathBuf,
    pub diff: bool,
    /// Guest memory bytes written (a diff: only its pages).
    pub memory_bytes: u64,
    pub state_bytes: u64,
    pub pause_us: u64,
    pub memory_write_us: u64,
    pub state_write_us: u64,
    /// From the request to the reply, the resume included.
    pub total_us: u64,
}

/// The VMM's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "kebab-case")]
pub enum Reply {
    Status {
        id: String,
        state: RunState,
        /// When each phase of the VMM's start was reached, in microseconds
        /// since its `main` (see husk-vmm's timeline).
        phases_us: BTreeMap<String, u64>,
        /// CLOCK_MONOTONIC (ns) at the VMM's `main`: with the moment its
        /// parent spawned it, how long the process took to start.
        #[serde(default)]
        main_monotonic_ns: u64,
    },
    Paused {
        id: String,
        pause_us: u64,
    },
    Resumed {
        id: String,
    },
    Snapshot {
        id: String,
        #[serde(flatten)]
        report: SnapshotReport,
    },
    Medium {
        id: String,
        drive: String,
        /// The new medium's size in bytes.
        size: u64,
    },
    Share {
        id: String,
        tag: String,
    },
    Error {
        message: String,
    },
}

/// Errors reaching the VMM.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error(
        "cannot reach the VMM's control socket {0}: {1} (is husk-vmm running with --api-sock?)"
    )]
    Connect(PathBuf, #[source] std::io::Error),
    #[error("the VMM's control socket {0} failed: {1}")]
    Io(PathBuf, #[source] std::io::Error),
    #[error("the VMM answered something that is not a reply: {0}")]
    BadReply(String),
    #[error("the VMM refused: {0}")]
    Refused(String),
}

/// Parses one request line; the error says what was wrong.
pub fn parse_request(line: &str) -> Result<Request, String> {
    serde_json::from_str(line.trim()).map_err(|e| {
        format!(
            "not a request ({e}); send one JSON line such as {{\"op\":\"status\"}}, \
             {{\"op\":\"pause\"}}, {{\"op\":\"resume\"}}, \
             {{\"op\":\"snapshot\",\"dir\":\"/path\",\"diff\":false}} or \
             {{\"op\":\"medium\",\"drive\":\"id\",\"path\":\"/file\"}}"
        )
    })
}

/// One line of JSON for `value`.
pub fn to_line<T: Serialize>(value: &T) -> String {
    // Serializing these types cannot fail: no maps with non-string keys.
    let mut line = serde_json::to_string(value).unwrap_or_default();
    line.push('\n');
    line
}

/// Sends `request` to the VMM at `socket` and waits up to `timeout` for
/// its reply; a [`Reply::Error`] becomes [`ControlError::Refused`].
pub fn call(socket: &Path, request: &Request, timeout: Duration) -> Result<Reply, ControlError> {
    let io = |e| ControlError::Io(socket.to_owned(), e);
    let mut stream =
        UnixStream::connect(socket).map_err(|e| ControlError::Connect(socket.to_owned(), e))?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.write_all(to_line(request).as_bytes()).map_err(io)?;
    let mut line = String::new();
    BufReader::new(stream.take(MAX_LINE))
        .read_line(&mut line)
        .map_err(io)?;
    match serde_json::from_str(&line) {
        Ok(Reply::Error { message }) => Err(ControlError::Refused(message)),
        Ok(reply) => Ok(reply),
        Err(e) => Err(ControlError::BadReply(format!("{e}: {}", line.trim()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_as_one_json_line() {
        for request in [
            Request::Status,
            Request::Pause,
            Request::Resume,
            Request::Snapshot {
                dir: "/tmp/s 1".into(),
                diff: true,
            },
            Request::Medium {
                drive: "ctr0".into(),
                path: "/images/a.ext4".into(),
                overlay: Some("/run/a.overlay".into()),
            },
            Request::Share {
                spec: "tag=fs0,path=/shares/fs0,ro,hide=.env".into(),
            },
        ] {
            let line = to_line(&request);
            assert_eq!(line.matches('\n').count(), 1, "{line}");
            assert_eq!(parse_request(&line), Ok(request));
        }
    }

    #[test]
    fn a_snapshot_is_full_unless_asked() {
        assert_eq!(
            parse_request(r#"{"op":"snapshot","dir":"/s"}"#),
            Ok(Request::Snapshot {
                dir: "/s".into(),
                diff: false
            })
        );
    }

    #[test]
    fn bad_requests_say_what_to_send() {
        for bad in [
            "pause",
            "{}",
            r#"{"op":"reboot"}"#,
            r#"{"op":"snapshot"}"#,
            r#"{"op":"snapshot","dir":"/s","now":1}"#,
            r#"{"op":"medium","drive":"ctr0"}"#,
            r#"{"op":"share"}"#,
        ] {
            let e = parse_request(bad).expect_err(bad);
            assert!(e.contains(r#"{"op":"status"}"#), "{e}");
        }
    }

    #[test]
    fn replies_round_trip() {
        let reply = Reply::Snapshot {
            id: "vm".into(),
            report: SnapshotReport {
                dir: "/s".into(),
                diff: false,
                memory_bytes: 1,
                state_bytes: 2,
                pause_us: 3,
                memory_write_us: 4,
                state_write_us: 5,
                total_us: 6,
            },
        };
        let line = to_line(&reply);
        assert!(line.contains(r#""reply":"snapshot""#), "{line}");
        assert!(line.contains(r#""memory_bytes":1"#), "{line}");
        assert_eq!(serde_json::from_str::<Reply>(&line).ok(), Some(reply));
    }
}
