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
//! | `{"op":"snapshot","dir":DIR,"diff":false,"keep_base":false}` | [`Reply::Snapshot`]: a full snapshot (or with `diff`, only the pages written since the last one; for a restored VM not snapshotted since, the pages that are no longer those of the memory file its restore mapped, which becomes the base) in DIR; a running VM is paused for it and resumed after. With `keep_base`, a snapshot taken for elsewhere (moved, or perhaps discarded): the VM's next diff stays against its earlier base |
//! | `{"op":"medium","drive":ID,"path":FILE,"overlay":FILE}` | [`Reply::Medium`]: drive ID now reads FILE (copy-on-write into a new `overlay`, or read-only without one) and the guest is told its new capacity by a configuration change interrupt, as a CD drive takes a new disc; the guest must have stopped using the old one |
//! | `{"op":"share","spec":"tag=TAG[,path=DIR][,ro][,owner=UID:GID[,guest-owner=UID:GID]][,hide=PATTERN]..."}` | [`Reply::Share`]: the virtio-fs device `TAG` (an empty slot, or a share the guest has not mounted) now serves DIR, or the directory whose descriptor comes with the request (SCM_RIGHTS: see [`call_with_fd`]), with the options of `--fs`; the guest mounts it with `mount -t virtiofs TAG DIR` |
//!
//! A request the VMM cannot carry out gets [`Reply::Error`] with a message
//! that says why.

pub mod cmdline;
pub mod limits;
pub mod sched;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
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
        /// Taken for elsewhere (a template, a hibernation that may be
        /// discarded): the VM's next diff stays against what it diffed
        /// against before, as if this snapshot had not been taken.
        #[serde(default)]
        keep_base: bool,
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
    call_passing(socket, request, None, timeout)
}

/// As [`call`], with descriptor `fd` passed along with the request (the
/// directory a share request serves, where the VMM cannot open it by path:
/// a detached mount made for a jailed VMM).
pub fn call_with_fd(
    socket: &Path,
    request: &Request,
    fd: BorrowedFd<'_>,
    timeout: Duration,
) -> Result<Reply, ControlError> {
    call_passing(socket, request, Some(fd), timeout)
}

fn call_passing(
    socket: &Path,
    request: &Request,
    fd: Option<BorrowedFd<'_>>,
    timeout: Duration,
) -> Result<Reply, ControlError> {
    let io = |e| ControlError::Io(socket.to_owned(), e);
    let mut stream =
        UnixStream::connect(socket).map_err(|e| ControlError::Connect(socket.to_owned(), e))?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    let line = to_line(request);
    let sent = match fd {
        Some(fd) => send_with_fd(&stream, line.as_bytes(), fd).map_err(io)?,
        None => 0,
    };
    stream.write_all(&line.as_bytes()[sent..]).map_err(io)?;
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

/// Room for one descriptor's control message, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct OneFd([u8; 32]);

/// Sends the start of `bytes` with `fd` attached (SCM_RIGHTS); returns how
/// many bytes went.
fn send_with_fd(stream: &UnixStream, bytes: &[u8], fd: BorrowedFd<'_>) -> std::io::Result<usize> {
    let mut space = OneFd([0; 32]);
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: msghdr is plain data; the fields set below point at `iov`
    // and `space`, which outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = space.0.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE only computes a size.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as _;
    // SAFETY: `space` holds one aligned header and one descriptor
    // (CMSG_SPACE of an int is 24 bytes on 64-bit, within its 32).
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd.as_raw_fd());
    }
    // SAFETY: a connected socket and the message built above.
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    usize::try_from(sent).map_err(|_| std::io::Error::last_os_error())
}

/// Reads one request line (at most [`MAX_LINE`] bytes) from `stream`, and
/// the one descriptor it may carry (SCM_RIGHTS; any more are closed).
pub fn read_request(stream: &UnixStream) -> std::io::Result<(String, Option<OwnedFd>)> {
    let mut line = Vec::new();
    let mut passed: Option<OwnedFd> = None;
    let mut buf = [0u8; 4096];
    while !line.contains(&b'\n') {
        if line.len() as u64 >= MAX_LINE {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "a request line longer than 64 KiB",
            ));
        }
        let mut space = OneFd([0; 32]);
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: as in `send_with_fd`.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = space.0.as_mut_ptr().cast();
        msg.msg_controllen = space.0.len() as _;
        // SAFETY: a connected socket and a message whose buffers outlive
        // the call; descriptors arrive close-on-exec.
        let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        let n = match usize::try_from(n) {
            Ok(0) => break,
            Ok(n) => n,
            Err(_) => {
                let e = std::io::Error::last_os_error();
                match e.kind() {
                    std::io::ErrorKind::Interrupted => continue,
                    _ => return Err(e),
                }
            }
        };
        // SAFETY: walking the control messages the kernel wrote into
        // `space`, within `msg_controllen`.
        let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
        while !cmsg.is_null() {
            // SAFETY: a header within the control buffer.
            let (level, kind, len) = unsafe {
                (
                    (*cmsg).cmsg_level,
                    (*cmsg).cmsg_type,
                    (*cmsg).cmsg_len as usize,
                )
            };
            if (level, kind) == (libc::SOL_SOCKET, libc::SCM_RIGHTS) {
                // SAFETY: CMSG_LEN only computes a size.
                let header = unsafe { libc::CMSG_LEN(0) } as usize;
                let count = len.saturating_sub(header) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    // SAFETY: `count` descriptors follow the header; each
                    // is this process's now, owned by nothing else.
                    let fd = unsafe {
                        let raw =
                            std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>().add(i));
                        OwnedFd::from_raw_fd(raw)
                    };
                    // A second descriptor is closed here (dropped).
                    if passed.is_none() {
                        passed = Some(fd);
                    }
                }
            }
            // SAFETY: the next header, or null past the buffer.
            cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
        }
        line.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8(line).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "a request that is not UTF-8",
        )
    })?;
    Ok((line, passed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_request_carries_one_descriptor_and_no_more() {
        use std::io::Seek;
        let (client, server) = UnixStream::pair().expect("pair");
        let mut file = tempfile_with(b"passed");
        let line = to_line(&Request::Status);
        let sent = send_with_fd(&client, line.as_bytes(), file.as_fd()).expect("send");
        (&client).write_all(&line.as_bytes()[sent..]).expect("rest");
        let (got, fd) = read_request(&server).expect("read");
        assert_eq!(got, line);
        let mut passed = std::fs::File::from(fd.expect("the descriptor"));
        passed.rewind().expect("rewind");
        let mut text = String::new();
        passed.read_to_string(&mut text).expect("read");
        assert_eq!(text, "passed");

        // Without one: the line alone. Two in one message: the second closed.
        (&client).write_all(line.as_bytes()).expect("plain");
        assert!(read_request(&server).expect("read").1.is_none());
        file.rewind().expect("rewind");
        // SAFETY: as in `send_with_fd`, with room for two descriptors.
        let two = unsafe {
            let mut space = [0u64; 8];
            let mut iov = libc::iovec {
                iov_base: line.as_ptr() as *mut libc::c_void,
                iov_len: line.len(),
            };
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = space.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(8) as _;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(8) as _;
            let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
            std::ptr::write_unaligned(data, file.as_raw_fd());
            std::ptr::write_unaligned(data.add(1), file.as_raw_fd());
            libc::sendmsg(client.as_raw_fd(), &msg, 0)
        };
        assert_eq!(two, line.len() as isize);
        let (got, fd) = read_request(&server).expect("read two");
        assert_eq!(got, line);
        assert!(fd.is_some());

        // A line that never ends is cut off.
        let long = vec![b'x'; MAX_LINE as usize + 10];
        let writer = std::thread::spawn(move || {
            let _ = (&client).write_all(&long);
        });
        assert!(read_request(&server).is_err());
        drop(server);
        writer.join().expect("writer");
    }

    fn tempfile_with(bytes: &[u8]) -> std::fs::File {
        let path = std::env::temp_dir().join(format!("husk-vmm-api-{}", std::process::id()));
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("temp file");
        let _ = std::fs::remove_file(&path);
        file.write_all(bytes).expect("write");
        file
    }

    #[test]
    fn requests_round_trip_as_one_json_line() {
        for request in [
            Request::Status,
            Request::Pause,
            Request::Resume,
            Request::Snapshot {
                dir: "/tmp/s 1".into(),
                diff: true,
                keep_base: false,
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
                diff: false,
                keep_base: false,
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
