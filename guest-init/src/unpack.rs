//! `Unpack`: a tree streamed as a newc cpio archive (in `FileChunk`s, ended
//! by `FileCommit`) laid out under a new directory: a container's root file
//! system in a pod's guest. Directories, regular files, symbolic links and
//! FIFOs, with their modes and owners; device nodes are left out (the
//! container gets the guest's `/dev`).
//!
//! Entries stay inside the directory: a name must be relative, without
//! `..`, and its parent must be a directory this unpack created, so no entry
//! is written through a link the archive made.

use std::collections::HashSet;
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

use crate::files::kind_of;
use husk_protocol::cpio::{HEADER, MAGIC, S_IFDIR, S_IFIFO, S_IFLNK, S_IFMT, S_IFREG, TRAILER};
use husk_protocol::{Body, ErrorKind, Frame};

/// The longest name (with its NUL) an entry may have.
const NAME_MAX: usize = 4096;
/// The longest symbolic link target.
const LINK_MAX: u64 = 4096;

#[derive(Debug)]
enum State {
    /// Waiting for a whole header and name.
    Header,
    /// An entry's data: written to `file` (a regular file) or kept (a
    /// link's target), then `pad` bytes skipped.
    Data {
        file: Option<File>,
        link: Option<Link>,
        left: u64,
        pad: usize,
    },
    /// The trailer was read.
    Done,
}

/// A symbolic link whose target is being read.
#[derive(Debug)]
struct Link {
    path: PathBuf,
    target: Vec<u8>,
    uid: u32,
    gid: u32,
}

/// An unpack in progress on a connection.
#[derive(Debug)]
pub struct PendingUnpack {
    pub id: u64,
    dir: PathBuf,
    /// The header and name read so far.
    pending: Vec<u8>,
    state: State,
    /// Directories made so far, relative to `dir` ("" is `dir`).
    dirs: HashSet<PathBuf>,
    bytes: u64,
    /// The first failure; reported at commit, the only reply.
    failed: Option<(ErrorKind, String)>,
    /// Whether this unpack made `dir`, and whether to keep it: a failed or
    /// abandoned (the client went) unpack removes what it made, and only
    /// that.
    made: bool,
    keep: bool,
}

fn hex(field: &[u8]) -> Option<u64> {
    std::str::from_utf8(field)
        .ok()
        .and_then(|s| u64::from_str_radix(s, 16).ok())
}

/// What it takes to round `n` up to a multiple of 4.
fn pad4(n: u64) -> usize {
    ((4 - n % 4) % 4) as usize
}

fn invalid(what: &str) -> (ErrorKind, String) {
    (
        ErrorKind::Invalid,
        format!("not a newc cpio archive: {what}"),
    )
}

impl PendingUnpack {
    /// Starts unpacking into `dir`, which must not exist (its parents are
    /// made).
    pub fn start(id: u64, dir: &str) -> Self {
        let mut unpack = PendingUnpack {
            id,
            dir: PathBuf::from(dir),
            pending: Vec::new(),
            state: State::Header,
            dirs: HashSet::from([PathBuf::new()]),
            bytes: 0,
            failed: None,
            made: false,
            keep: false,
        };
        if !unpack.dir.is_absolute() {
            unpack.fail((ErrorKind::Invalid, format!("{dir}: not an absolute path")));
            return unpack;
        }
        let made = unpack
            .dir
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::DirBuilder::new().mode(0o755).create(&unpack.dir));
        match made {
            Ok(()) => unpack.made = true,
            Err(e) => unpack.fail((kind_of(&e), format!("cannot create {dir}: {e}"))),
        }
        unpack
    }

    fn fail(&mut self, (kind, message): (ErrorKind, String)) {
        if self.failed.is_none() {
            self.failed = Some((kind, message));
        }
        self.state = State::Done;
    }

    pub fn chunk(&mut self, mut data: &[u8]) {
        self.bytes += data.len() as u64;
        while !data.is_empty() && self.failed.is_none() {
            let used = match self.state {
                // Padding after the trailer.
                State::Done => return,
                State::Header => self.header(data),
                State::Data { .. } => self.data(data),
            };
            data = &data[used..];
        }
    }

    /// Takes header and name bytes from `data`; once both are whole,
    /// creates the entry. How much it took.
    fn header(&mut self, data: &[u8]) -> usize {
        let need = match self.pending.len() {
            n if n < HEADER => HEADER,
            _ => match self.name_size() {
                Ok(size) => HEADER + size + pad4((HEADER + size) as u64),
                Err(e) => {
                    self.fail(e);
                    return data.len();
                }
            },
        };
        let take = (need - self.pending.len()).min(data.len());
        self.pending.extend_from_slice(&data[..take]);
        if self.pending.len() == need && need > HEADER {
            let entry = std::mem::take(&mut self.pending);
            if let Err(e) = self.entry(&entry) {
                self.fail(e);
            }
        }
        take
    }

    fn field(header: &[u8], i: usize) -> Result<u64, (ErrorKind, String)> {
        hex(&header[6 + 8 * i..14 + 8 * i]).ok_or_else(|| invalid("a bad header"))
    }

    fn name_size(&self) -> Result<usize, (ErrorKind, String)> {
        if &self.pending[..6] != MAGIC {
            return Err(invalid("a bad magic number"));
        }
        match Self::field(&self.pending, 11)? as usize {
            size @ 1..=NAME_MAX => Ok(size),
            _ => Err(invalid("a bad name length")),
        }
    }

    /// Creates the entry whose header and name are `entry`.
    fn entry(&mut self, entry: &[u8]) -> Result<(), (ErrorKind, String)> {
        let mode = Self::field(entry, 1)? as u32;
        let uid = Self::field(entry, 2)? as u32;
        let gid = Self::field(entry, 3)? as u32;
        let size = Self::field(entry, 6)?;
        let name_size = Self::field(entry, 11)? as usize;
        let raw = &entry[HEADER..HEADER + name_size - 1];
        if raw == TRAILER {
            self.state = State::Done;
            return Ok(());
        }
        let name = Path::new(std::ffi::OsStr::from_bytes(raw));
        let rel = self.relative(name)?;
        let path = self.dir.join(&rel);
        let io = |e: std::io::Error| (kind_of(&e), format!("{}: {e}", name.display()));
        let (mut file, mut link) = (None, None);
        match mode & S_IFMT {
            S_IFDIR if rel.as_os_str().is_empty() => {}
            S_IFDIR => {
                std::fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&path)
                    .map_err(io)?;
                self.dirs.insert(rel);
            }
            S_IFREG => {
                let f = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&path)
                    .map_err(io)?;
                file = Some(f);
            }
            S_IFLNK if size <= LINK_MAX => {
                link = Some(Link {
                    path: path.clone(),
                    target: Vec::new(),
                    uid,
                    gid,
                })
            }
            S_IFLNK => return Err(invalid("a link target over 4096 bytes")),
            S_IFIFO => {
                let c = CString::new(path.as_os_str().as_bytes())
                    .map_err(|_| invalid("a NUL in a name"))?;
                // SAFETY: mkfifo reads a NUL-terminated path.
                if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
                    return Err(io(std::io::Error::last_os_error()));
                }
            }
            // Devices and sockets: the container has the guest's /dev.
            _ => {}
        }
        // What was made here (a link's owner is set once it exists).
        if matches!(mode & S_IFMT, S_IFDIR | S_IFREG | S_IFIFO) {
            set_owner_and_mode(&path, uid, gid, mode & 0o7777).map_err(io)?;
        }
        self.state = State::Data {
            file,
            link,
            left: size,
            pad: pad4(size),
        };
        Ok(())
    }

    /// Takes an entry's data (and padding) from `data`; how much it took.
    fn data(&mut self, data: &[u8]) -> usize {
        let State::Data {
            file,
            link,
            left,
            pad,
        } = &mut self.state
        else {
            return 0;
        };
        let take = (*left).min(data.len() as u64) as usize;
        *left -= take as u64;
        let body = &data[..take];
        let mut result = Ok(());
        if let Some(f) = file.as_mut() {
            result = f.write_all(body);
        }
        if let Some(l) = link.as_mut() {
            l.target.extend_from_slice(body);
        }
        let mut used = take;
        if *left == 0 {
            let skip = (*pad).min(data.len() - take);
            *pad -= skip;
            used += skip;
            if *pad == 0 {
                if let Some(l) = link.take() {
                    let target = std::ffi::OsStr::from_bytes(&l.target);
                    result = std::os::unix::fs::symlink(target, &l.path).and_then(|()| {
                        std::os::unix::fs::lchown(&l.path, Some(l.uid), Some(l.gid))
                    });
                }
                self.state = State::Header;
            }
        }
        if let Err(e) = result {
            let message = format!("cannot write under {}: {e}", self.dir.display());
            self.fail((kind_of(&e), message));
            return data.len();
        }
        used
    }

    /// `name` as a path relative to the directory, if it stays inside it
    /// and its parent is a directory this unpack made.
    fn relative(&self, name: &Path) -> Result<PathBuf, (ErrorKind, String)> {
        let mut rel = PathBuf::new();
        for c in name.components() {
            match c {
                Component::Normal(part) => rel.push(part),
                Component::CurDir => {}
                _ => {
                    return Err((
                        ErrorKind::Invalid,
                        format!("{}: an entry outside the directory", name.display()),
                    ))
                }
            }
        }
        let parent = rel.parent().map(Path::to_path_buf).unwrap_or_default();
        if !rel.as_os_str().is_empty() && !self.dirs.contains(&parent) {
            return Err((
                ErrorKind::Invalid,
                format!(
                    "{}: its directory is not in the archive before it",
                    name.display()
                ),
            ));
        }
        Ok(rel)
    }

    /// Finishes the unpack; returns the reply (`Written` with the archive's
    /// size).
    pub fn commit(mut self) -> Frame {
        let id = self.id;
        if self.failed.is_none() && !matches!(self.state, State::Done) {
            self.fail((
                ErrorKind::Invalid,
                "the archive ended early (no trailer)".into(),
            ));
        }
        match self.failed.take() {
            // Nothing half-made is left (see Drop).
            Some((kind, message)) => crate::files::error(id, kind, message),
            None => {
                self.keep = true;
                Frame {
                    id,
                    body: Body::Written { size: self.bytes },
                }
            }
        }
    }
}

impl Drop for PendingUnpack {
    fn drop(&mut self) {
        if self.made && !self.keep {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn set_owner_and_mode(path: &Path, uid: u32, gid: u32, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::os::unix::fs::lchown(path, Some(uid), Some(gid))?;
    // After the owner: chown clears set-id bits.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

#[cfg(test)]
mod tests {
    use super::*;
    use husk_protocol::cpio;
    use std::os::unix::fs::PermissionsExt;

    /// A new directory under the system's, removed with its contents
    /// when dropped.
    struct TempDir(PathBuf);

    impl std::ops::Deref for TempDir {
        type Target = Path;
        fn deref(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn tempdir(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("husk-unpack-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("tempdir");
        TempDir(dir)
    }

    /// Feeds `archive` in chunks of `size`; the reply.
    fn unpack(archive: &[u8], into: &Path, size: usize) -> Frame {
        let mut u = PendingUnpack::start(7, into.to_str().expect("utf-8"));
        for chunk in archive.chunks(size) {
            u.chunk(chunk);
        }
        u.commit()
    }

    #[test]
    fn a_tree_comes_out_as_it_went_in_whatever_the_chunk_size() {
        let src = tempdir("src");
        std::fs::create_dir_all(src.join("bin/sub")).expect("dirs");
        std::fs::write(src.join("bin/busybox"), vec![7u8; 5000]).expect("file");
        std::fs::set_permissions(
            src.join("bin/busybox"),
            std::fs::Permissions::from_mode(0o755),
        )
        .expect("mode");
        std::fs::write(src.join("bin/sub/odd"), b"abc").expect("file");
        std::os::unix::fs::symlink("/bin/busybox", src.join("bin/sh")).expect("link");
        std::fs::write(src.join("empty"), b"").expect("file");
        let archive = cpio::write_tree(&src, Vec::new()).expect("archive");

        for size in [1, 3, 110, 4096, archive.len()] {
            let parent = tempdir("out");
            let out = parent.join("rootfs");
            let reply = unpack(&archive, &out, size);
            assert!(
                matches!(reply.body, Body::Written { .. }),
                "{size}: {reply:?}"
            );
            assert_eq!(
                std::fs::read(out.join("bin/busybox")).expect("busybox"),
                vec![7u8; 5000]
            );
            let mode = std::fs::metadata(out.join("bin/busybox"))
                .expect("meta")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o755);
            assert_eq!(std::fs::read(out.join("bin/sub/odd")).expect("odd"), b"abc");
            assert_eq!(
                std::fs::read_link(out.join("bin/sh")).expect("link"),
                Path::new("/bin/busybox")
            );
            assert_eq!(std::fs::read(out.join("empty")).expect("empty"), b"");
        }
    }

    #[test]
    fn entries_outside_the_directory_or_through_a_link_are_refused_and_nothing_stays() {
        /// Name, mode, data.
        type Entry<'a> = (&'a [u8], u32, &'a [u8]);
        let cases: [&[Entry<'_>]; 4] = [
            &[(b"../escape", cpio::S_IFREG | 0o644, b"x")],
            &[(b"/etc/passwd", cpio::S_IFREG | 0o644, b"x")],
            // A link to a directory outside, then a file "in" it.
            &[
                (b"l", cpio::S_IFLNK | 0o777, b"/tmp"),
                (b"l/x", cpio::S_IFREG | 0o644, b"x"),
            ],
            // A file before its directory.
            &[(b"d/x", cpio::S_IFREG | 0o644, b"x")],
        ];
        for case in cases {
            let mut w = cpio::Writer::new(Vec::new());
            for (name, mode, data) in case {
                w.entry_with(cpio::Entry::new(name, *mode), data)
                    .expect("entry");
            }
            let archive = w.finish().expect("archive");
            let parent = tempdir("bad");
            let out = parent.join("rootfs");
            let reply = unpack(&archive, &out, 64);
            assert!(
                matches!(
                    reply.body,
                    Body::Error {
                        kind: ErrorKind::Invalid,
                        ..
                    }
                ),
                "{case:?}: {reply:?}"
            );
            assert!(!out.exists(), "{case:?}: the half-made tree stayed");
        }
    }

    #[test]
    fn a_directory_that_exists_is_refused_and_kept() {
        let dir = tempdir("exists");
        std::fs::write(dir.join("precious"), b"x").expect("file");
        let archive = cpio::Writer::new(Vec::new()).finish().expect("archive");

        let reply = unpack(&archive, &dir, 64);

        assert!(
            matches!(
                reply.body,
                Body::Error {
                    kind: ErrorKind::Conflict,
                    ..
                }
            ),
            "{reply:?}"
        );
        assert!(
            dir.join("precious").exists(),
            "an existing directory was removed"
        );
    }

    #[test]
    fn an_abandoned_unpack_leaves_nothing() {
        let src = tempdir("abandoned-src");
        std::fs::write(src.join("f"), vec![1u8; 10_000]).expect("file");
        let archive = cpio::write_tree(&src, Vec::new()).expect("archive");
        let parent = tempdir("abandoned");
        let out = parent.join("rootfs");
        let mut u = PendingUnpack::start(1, out.to_str().expect("utf-8"));
        u.chunk(&archive[..archive.len() / 2]);
        assert!(out.exists());

        drop(u);

        assert!(!out.exists(), "the client went, the half-made tree stayed");
    }

    #[test]
    fn garbage_and_a_missing_trailer_are_errors() {
        let parent = tempdir("garbage");
        let out = parent.join("rootfs");
        let reply = unpack(&[b'x'; 300], &out, 50);
        assert!(matches!(reply.body, Body::Error { .. }), "{reply:?}");

        let mut w = cpio::Writer::new(Vec::new());
        w.entry_with(cpio::Entry::new(b"a", cpio::S_IFREG | 0o644), b"data")
            .expect("entry");
        let mut archive = w.finish().expect("archive");
        archive.truncate(120);
        let reply = unpack(&archive, &out, 50);
        assert!(matches!(reply.body, Body::Error { .. }), "{reply:?}");
        assert!(!out.exists());
    }
}
