//! File requests: streamed reads, and streamed writes that land atomically
//! (temporary file beside the target, fsync, rename).

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::conn::Conn;
use husk_protocol::{
    Body, DirEntry, ErrorKind, FileKind, FileStat, Frame, User, FILE_CHUNK, LIST_BATCH,
};

pub(crate) fn kind_of(e: &std::io::Error) -> ErrorKind {
    match e.raw_os_error() {
        Some(libc::ENOENT) | Some(libc::ENOTDIR) => ErrorKind::NotFound,
        Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => ErrorKind::PermissionDenied,
        Some(libc::EEXIST) | Some(libc::ENOTEMPTY) | Some(libc::EISDIR) => ErrorKind::Conflict,
        Some(libc::EINVAL) | Some(libc::ENAMETOOLONG) | Some(libc::EXDEV) => ErrorKind::Invalid,
        Some(_) => ErrorKind::Internal,
        // An error of the agent's own making: by what it says it is.
        None => match e.kind() {
            std::io::ErrorKind::NotFound => ErrorKind::NotFound,
            std::io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
            std::io::ErrorKind::AlreadyExists => ErrorKind::Conflict,
            std::io::ErrorKind::InvalidInput => ErrorKind::Invalid,
            std::io::ErrorKind::TimedOut => ErrorKind::Timeout,
            _ => ErrorKind::Internal,
        },
    }
}

fn done(id: u64, result: std::io::Result<()>, what: &str) -> Frame {
    match result {
        Ok(()) => Frame {
            id,
            body: Body::Done,
        },
        Err(e) => error(id, kind_of(&e), format!("cannot {what}: {e}")),
    }
}

fn file_stat(meta: &std::fs::Metadata) -> FileStat {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let t = meta.file_type();
    let kind = if t.is_symlink() {
        FileKind::Symlink
    } else if t.is_dir() {
        FileKind::Dir
    } else if t.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    };
    FileStat {
        kind,
        size: meta.len(),
        mode: meta.permissions().mode() & 0o7777,
        mtime_s: meta.mtime(),
    }
}

/// `Stat`.
pub fn stat(id: u64, path: &str) -> Frame {
    match std::fs::symlink_metadata(path) {
        Ok(meta) => Frame {
            id,
            body: Body::StatInfo(file_stat(&meta)),
        },
        Err(e) => error(id, kind_of(&e), format!("cannot stat {path}: {e}")),
    }
}

/// `List`: entries in batches; returns the last frame.
pub fn list(id: u64, path: &str, conn: &Conn) -> Frame {
    let dir = match std::fs::read_dir(path) {
        Ok(d) => d,
        Err(e) => return error(id, kind_of(&e), format!("cannot list {path}: {e}")),
    };
    let mut batch = Vec::with_capacity(LIST_BATCH);
    for entry in dir.flatten() {
        let Ok(meta) = entry.metadata() else { continue };
        batch.push(DirEntry {
            name: entry.file_name().to_string_lossy().into_owned(),
            stat: file_stat(&meta),
        });
        if batch.len() == LIST_BATCH {
            let frame = Frame {
                id,
                body: Body::Entries {
                    entries: std::mem::take(&mut batch),
                    more: true,
                },
            };
            if conn.send(&frame).is_err() {
                return error(id, ErrorKind::Internal, "the client went away".into());
            }
        }
    }
    Frame {
        id,
        body: Body::Entries {
            entries: batch,
            more: false,
        },
    }
}

/// `Mkdir` (with parents).
pub fn mkdir(id: u64, path: &str) -> Frame {
    done(id, std::fs::create_dir_all(path), &format!("create {path}"))
}

/// `MkdirAs`: `mkdir -p`, each directory it creates given to `user` (as
/// one the user made would be; those already there are left as they are).
pub fn mkdir_as(id: u64, path: &str, user: User) -> Frame {
    let path = std::path::Path::new(path);
    let mut missing = Vec::new();
    let mut at = Some(path);
    while let Some(p) = at.filter(|p| !p.as_os_str().is_empty() && p.symlink_metadata().is_err()) {
        missing.push(p);
        at = p.parent();
    }
    let result = std::fs::create_dir_all(path).and_then(|()| {
        missing
            .iter()
            .rev()
            .try_for_each(|d| std::os::unix::fs::lchown(d, Some(user.uid), Some(user.gid)))
    });
    done(id, result, &format!("create {}", path.display()))
}

/// `Chown`: the path itself (a link, not what it points to).
pub fn chown(id: u64, path: &str, user: User) -> Frame {
    done(
        id,
        std::os::unix::fs::lchown(path, Some(user.uid), Some(user.gid)),
        &format!("give {path} to {}:{}", user.uid, user.gid),
    )
}

/// `Remove`: a file or symlink, an empty directory, or with `recursive` a tree.
pub fn remove(id: u64, path: &str, recursive: bool) -> Frame {
    let result = match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() && recursive => std::fs::remove_dir_all(path),
        Ok(meta) if meta.is_dir() => std::fs::remove_dir(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) => Err(e),
    };
    done(id, result, &format!("remove {path}"))
}

/// `Rename`.
pub fn rename(id: u64, from: &str, to: &str) -> Frame {
    done(
        id,
        std::fs::rename(from, to),
        &format!("rename {from} to {to}"),
    )
}

pub(crate) fn error(id: u64, kind: ErrorKind, message: String) -> Frame {
    Frame {
        id,
        body: Body::Error { kind, message },
    }
}

/// Streams `path` to `out`; returns the final frame.
pub fn read(id: u64, path: &str, conn: &Conn) -> Frame {
    let mut file = match File::open(path) {
        Ok(f) => f,
        Err(e) => return error(id, kind_of(&e), format!("cannot open {path}: {e}")),
    };
    // One buffer for every chunk: a fresh 256 KiB one per chunk costs the
    // guest kernel an mmap, its page faults and an munmap.
    let mut data = Vec::with_capacity(FILE_CHUNK);
    let mut size = 0u64;
    loop {
        data.resize(FILE_CHUNK, 0);
        let n = match file.read(&mut data) {
            Ok(0) => {
                return Frame {
                    id,
                    body: Body::FileEnd { size },
                }
            }
            Ok(n) => n,
            Err(e) => return error(id, kind_of(&e), format!("cannot read {path}: {e}")),
        };
        data.truncate(n);
        let chunk = Frame {
            id,
            body: Body::FileChunk { data },
        };
        if conn.send(&chunk).is_err() {
            return error(id, ErrorKind::Internal, "the client went away".into());
        }
        data = match chunk.body {
            Body::FileChunk { data } => data,
            _ => Vec::new(),
        };
        size += n as u64;
    }
}

/// A write in progress on one connection.
#[derive(Debug)]
pub struct PendingWrite {
    pub id: u64,
    target: PathBuf,
    tmp: PathBuf,
    file: Option<File>,
    size: u64,
    /// The first failure; reported at commit, the only reply of a write.
    failed: Option<(ErrorKind, String)>,
}

impl PendingWrite {
    /// Starts writing `path` through a temporary file in its directory.
    pub fn start(id: u64, path: &str, mode: u32) -> Self {
        let target = PathBuf::from(path);
        let name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let dir = target
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        let tmp = dir.join(format!(".{name}.husk-{id}.tmp"));
        let mut write = PendingWrite {
            id,
            target,
            tmp,
            file: None,
            size: 0,
            failed: None,
        };
        if name.is_empty() {
            write.failed = Some((ErrorKind::Invalid, format!("{path} names no file")));
            return write;
        }
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode & 0o7777)
            .open(&write.tmp)
        {
            Ok(f) => write.file = Some(f),
            Err(e) => {
                write.failed = Some((
                    kind_of(&e),
                    format!("cannot create a file in {}: {e}", dir.display()),
                ))
            }
        }
        write
    }

    pub fn chunk(&mut self, data: &[u8]) {
        if let Some(file) = self.file.as_mut() {
            if let Err(e) = file.write_all(data) {
                self.failed = Some((
                    kind_of(&e),
                    format!("cannot write {}: {e}", self.target.display()),
                ));
                self.file = None;
            }
            self.size += data.len() as u64;
        }
    }

    /// Finishes the write; returns the reply.
    pub fn commit(mut self) -> Frame {
        let id = self.id;
        if let Some((kind, message)) = self.failed.take() {
            return error(id, kind, message);
        }
        let result = self
            .file
            .take()
            .map_or(Ok(()), |f| f.sync_all())
            .and_then(|()| std::fs::rename(&self.tmp, &self.target));
        match result {
            Ok(()) => Frame {
                id,
                body: Body::Written { size: self.size },
            },
            Err(e) => error(
                id,
                kind_of(&e),
                format!("cannot put {} in place: {e}", self.target.display()),
            ),
        }
    }
}

impl Drop for PendingWrite {
    fn drop(&mut self) {
        // Never committed (or the rename failed): leave nothing behind.
        let _ = std::fs::remove_file(&self.tmp);
    }
}

/// What `call` writes into a buffer it is given, retried with a larger
/// one while it says the buffer is too small (`ERANGE`: the value grew
/// meanwhile, or is long; the kernel answers at most 64 KiB).
fn sized(
    first: usize,
    mut call: impl FnMut(&mut [u8]) -> libc::ssize_t,
) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; first];
    loop {
        let n = call(&mut buf);
        if n >= 0 {
            buf.truncate(n as usize);
            return Ok(buf);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ERANGE) if buf.len() < 1 << 17 => buf.resize(buf.len() * 4, 0),
            _ => return Err(e),
        }
    }
}

/// The `user.` extended attributes of `path` (a final symlink not
/// followed), names without the prefix; none where its file system keeps
/// none.
fn user_attrs(path: &std::ffi::CStr) -> std::io::Result<husk_protocol::Attributes> {
    let list = |buf: &mut [u8]| {
        // SAFETY: a NUL-terminated path and a writable buffer of the
        // length given.
        unsafe { libc::llistxattr(path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) }
    };
    let names = match sized(1024, list) {
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => return Ok(Vec::new()),
        names => names?,
    };
    let mut attrs = Vec::new();
    for name in names.split(|b| *b == 0) {
        let Some(short) = name.strip_prefix(b"user.") else {
            continue;
        };
        let cname = std::ffi::CString::new(name).map_err(|_| std::io::ErrorKind::InvalidData)?;
        let get = |buf: &mut [u8]| {
            // SAFETY: NUL-terminated strings and a writable buffer of the
            // length given.
            unsafe {
                libc::lgetxattr(
                    path.as_ptr(),
                    cname.as_ptr(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            }
        };
        let value = match sized(256, get) {
            // Removed meanwhile.
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => continue,
            value => value?,
        };
        attrs.push((
            String::from_utf8_lossy(short).into_owned(),
            String::from_utf8_lossy(&value).into_owned(),
        ));
    }
    Ok(attrs)
}

/// `UserAttrs`: sets `set` on `path`, then answers its `user.` attributes.
pub fn set_user_attrs(id: u64, path: &str, set: &[(String, String)]) -> Frame {
    let Ok(cpath) = std::ffi::CString::new(path) else {
        return error(id, ErrorKind::Invalid, format!("{path:?} holds a NUL"));
    };
    for (name, value) in set {
        let Ok(full) = std::ffi::CString::new(format!("user.{name}")) else {
            return error(
                id,
                ErrorKind::Invalid,
                format!("attribute {name:?} holds a NUL"),
            );
        };
        // SAFETY: NUL-terminated strings and a buffer of the length given.
        let rc = unsafe {
            libc::lsetxattr(
                cpath.as_ptr(),
                full.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            let (kind, why) = match e.raw_os_error() {
                Some(libc::ENOTSUP) => (
                    ErrorKind::Unsupported,
                    "its file system keeps no user extended attributes".to_owned(),
                ),
                Some(libc::ERANGE) | Some(libc::E2BIG) => (
                    ErrorKind::Invalid,
                    "the name or value is too long for its file system".to_owned(),
                ),
                Some(libc::ENOSPC) | Some(libc::EDQUOT) => (
                    ErrorKind::Limit,
                    "no room for more attributes on it".to_owned(),
                ),
                _ => (kind_of(&e), e.to_string()),
            };
            return error(id, kind, format!("cannot set {name:?} on {path}: {why}"));
        }
    }
    match user_attrs(&cpath) {
        Ok(attrs) => Frame {
            id,
            body: Body::Attrs(attrs),
        },
        Err(e) => error(
            id,
            kind_of(&e),
            format!("cannot read the attributes of {path}: {e}"),
        ),
    }
}

/// `DirUserAttrs`: the entries of `path` that have `user.` attributes.
pub fn dir_user_attrs(id: u64, path: &str) -> Frame {
    let dir = match std::fs::read_dir(path) {
        Ok(d) => d,
        Err(e) => return error(id, kind_of(&e), format!("cannot list {path}: {e}")),
    };
    let mut entries = Vec::new();
    let mut bytes = 0;
    for entry in dir.flatten() {
        use std::os::unix::ffi::OsStrExt;
        let Ok(full) = std::ffi::CString::new(entry.path().as_os_str().as_bytes()) else {
            continue;
        };
        let attrs = match user_attrs(&full) {
            Ok(a) if !a.is_empty() => a,
            // None, or gone meanwhile.
            _ => continue,
        };
        let name = entry.file_name().to_string_lossy().into_owned();
        bytes += name.len() + attrs.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>();
        if bytes > husk_protocol::MAX_DIR_ATTRS {
            return error(
                id,
                ErrorKind::Limit,
                format!(
                    "the attributes of {path}'s entries pass {} KiB",
                    husk_protocol::MAX_DIR_ATTRS >> 10
                ),
            );
        }
        entries.push((name, attrs));
    }
    Frame {
        id,
        body: Body::DirAttrs(entries),
    }
}
