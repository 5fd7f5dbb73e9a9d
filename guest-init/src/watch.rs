//! `Watch`: inotify on a directory (and, if asked, every directory below
//! it, including ones created later), with events streamed to the client
//! in batches until it sends `Cancel` or leaves.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use husk_protocol::{Body, ErrorKind, Frame, FsEvent, FsEventKind};

use crate::conn::{Cancel, Conn};

/// Most directories one recursive watch follows.
const MAX_DIRS: usize = 4096;
/// Most events in one `FsEvents` frame.
const BATCH: usize = 256;
const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_CLOSE_WRITE
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_DELETE_SELF
    | libc::IN_ONLYDIR;

fn error(id: u64, kind: ErrorKind, message: String) -> Frame {
    Frame {
        id,
        body: Body::Error { kind, message },
    }
}

struct Watcher {
    inotify: File,
    dirs: HashMap<i32, PathBuf>,
    /// The watched directory's own watch.
    root: i32,
    recursive: bool,
}

impl Watcher {
    /// Watches `dir` (and, if recursive, the directories below it). For a
    /// directory that appeared while watching, `found` gets a `Created`
    /// for everything already in it: those may have been made before its
    /// watch was in place.
    fn add(&mut self, dir: &Path, mut found: Option<&mut Vec<FsEvent>>) -> std::io::Result<()> {
        if self.dirs.len() >= MAX_DIRS {
            return Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let c = crate::cstring(&dir.to_string_lossy())?;
        // SAFETY: valid inotify descriptor and NUL-terminated path.
        let wd = unsafe { libc::inotify_add_watch(self.inotify.as_raw_fd(), c.as_ptr(), MASK) };
        if wd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if self.dirs.is_empty() {
            self.root = wd;
        }
        self.dirs.insert(wd, dir.to_path_buf());
        if self.recursive {
            for entry in std::fs::read_dir(dir)?.flatten() {
                let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
                if let Some(found) = found.as_deref_mut() {
                    found.push(FsEvent {
                        kind: FsEventKind::Created,
                        path: entry.path().to_string_lossy().into_owned(),
                        is_dir,
                    });
                }
                if is_dir {
                    // A directory that vanished meanwhile is not an error.
                    let _ = self.add(&entry.path(), found.as_deref_mut());
                }
            }
        }
        Ok(())
    }

    /// Decodes a buffer of inotify events.
    fn decode(&mut self, buf: &[u8], events: &mut Vec<FsEvent>) -> bool {
        const HEADER: usize = std::mem::size_of::<libc::inotify_event>();
        let mut root_gone = false;
        let mut at = 0;
        while at + HEADER <= buf.len() {
            // SAFETY: the kernel wrote a whole inotify_event header here;
            // read_unaligned copes with any alignment.
            let ev: libc::inotify_event =
                unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
            let name_end = (at + HEADER + ev.len as usize).min(buf.len());
            let name = &buf[at + HEADER..name_end];
            let name = String::from_utf8_lossy(name.split(|&b| b == 0).next().unwrap_or(&[]));
            at = name_end;
            if ev.mask & libc::IN_Q_OVERFLOW != 0 {
                events.push(FsEvent {
                    kind: FsEventKind::Overflow,
                    path: String::new(),
                    is_dir: false,
                });
                continue;
            }
            let Some(dir) = self.dirs.get(&ev.wd).cloned() else {
                continue;
            };
            if ev.wd == self.root && ev.mask & (libc::IN_DELETE_SELF | libc::IN_IGNORED) != 0 {
                root_gone = true;
            }
            if ev.mask & libc::IN_IGNORED != 0 {
                self.dirs.remove(&ev.wd);
                continue;
            }
            let path = if name.is_empty() {
                dir.clone()
            } else {
                dir.join(&*name)
            };
            let is_dir = ev.mask & libc::IN_ISDIR != 0;
            let kind = if ev.mask & libc::IN_CREATE != 0 {
                FsEventKind::Created
            } else if ev.mask & libc::IN_MODIFY != 0 {
                FsEventKind::Modified
            } else if ev.mask & libc::IN_CLOSE_WRITE != 0 {
                FsEventKind::Closed
            } else if ev.mask & libc::IN_MOVED_FROM != 0 {
                FsEventKind::MovedFrom
            } else if ev.mask & libc::IN_MOVED_TO != 0 {
                FsEventKind::MovedTo
            } else if ev.mask & (libc::IN_DELETE | libc::IN_DELETE_SELF) != 0 {
                FsEventKind::Removed
            } else {
                continue;
            };
            events.push(FsEvent {
                kind,
                path: path.to_string_lossy().into_owned(),
                is_dir,
            });
            if self.recursive
                && is_dir
                && matches!(kind, FsEventKind::Created | FsEventKind::MovedTo)
            {
                let _ = self.add(&path, Some(events));
            }
        }
        root_gone
    }
}

/// Runs one watch until cancelled, the client leaves, or the directory is
/// removed; returns the final frame.
pub fn run(id: u64, path: &str, recursive: bool, conn: &Conn, cancel: &Cancel) -> Frame {
    // SAFETY: inotify_init1 returns a new descriptor or -1.
    let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return error(id, ErrorKind::Limit, format!("inotify: {e}"));
    }
    let mut watcher = Watcher {
        // SAFETY: a new descriptor nothing else owns.
        inotify: File::from(unsafe { OwnedFd::from_raw_fd(fd) }),
        dirs: HashMap::new(),
        root: -1,
        recursive,
    };
    if let Err(e) = watcher.add(Path::new(path), None) {
        let kind = match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EMFILE) => ErrorKind::Limit,
            Some(libc::ENOTDIR) => ErrorKind::Invalid,
            _ => crate::files::kind_of(&e),
        };
        return error(id, kind, format!("cannot watch {path}: {e}"));
    }
    if conn
        .send(&Frame {
            id,
            body: Body::Watching,
        })
        .is_err()
    {
        return error(id, ErrorKind::Internal, "the client went away".into());
    }
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let mut fds = [
            libc::pollfd {
                fd: watcher.inotify.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: cancel.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            continue; // EINTR
        }
        if fds[1].revents != 0 || conn.is_closed() {
            return Frame {
                id,
                body: Body::Done,
            };
        }
        let mut events = Vec::new();
        let mut root_gone = false;
        while let Ok(n @ 1..) = watcher.inotify.read(&mut buf) {
            root_gone |= watcher.decode(&buf[..n], &mut events);
        }
        for batch in events.chunks(BATCH) {
            let frame = Frame {
                id,
                body: Body::FsEvents(batch.to_vec()),
            };
            if conn.send(&frame).is_err() {
                return error(id, ErrorKind::Internal, "the client went away".into());
            }
        }
        if root_gone {
            return error(id, ErrorKind::NotFound, format!("{path} was removed"));
        }
    }
}
