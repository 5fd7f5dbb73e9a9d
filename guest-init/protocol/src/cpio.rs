//! Writing newc ("070701") cpio archives: the guest's initramfs
//! (`husk-mkrootfs`), and a container's root file system streamed into a
//! pod's guest (`Body::Unpack`, unpacked by guest-init).

use std::io::{self, Read, Write};
use std::path::Path;

/// A newc header's length, before the name.
pub const HEADER: usize = 110;
pub const MAGIC: &[u8] = b"070701";
/// The last entry's name.
pub const TRAILER: &[u8] = b"TRAILER!!!";

pub const S_IFMT: u32 = 0o170000;
pub const S_IFDIR: u32 = 0o040000;
pub const S_IFREG: u32 = 0o100000;
pub const S_IFLNK: u32 = 0o120000;
pub const S_IFCHR: u32 = 0o020000;
pub const S_IFIFO: u32 = 0o010000;

/// One entry's header fields.
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    pub name: &'a [u8],
    /// File type and permission bits.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// A device node's major and minor numbers.
    pub rdev: (u32, u32),
    /// The data's length (a file's content, a link's target).
    pub size: u64,
}

impl<'a> Entry<'a> {
    /// `name` with `mode`, owned by root, no data yet.
    pub fn new(name: &'a [u8], mode: u32) -> Self {
        Entry {
            name,
            mode,
            uid: 0,
            gid: 0,
            rdev: (0, 0),
            size: 0,
        }
    }
}

/// Writes a newc archive to `out`.
#[derive(Debug)]
pub struct Writer<W: Write> {
    out: W,
    ino: u32,
    written: u64,
}

impl<W: Write> Writer<W> {
    pub fn new(out: W) -> Self {
        Writer {
            out,
            ino: 0,
            written: 0,
        }
    }

    /// Writes `entry` with exactly `entry.size` bytes read from `data`.
    pub fn entry(&mut self, entry: &Entry<'_>, data: &mut dyn Read) -> io::Result<()> {
        let size = u32::try_from(entry.size).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "a file of 4 GiB or more does not fit a newc archive",
            )
        })?;
        self.ino += 1;
        let nlink = if entry.mode & S_IFMT == S_IFDIR { 2 } else { 1 };
        let fields = [
            self.ino,
            entry.mode,
            entry.uid,
            entry.gid,
            nlink,
            0, // mtime
            size,
            0, // dev major
            0, // dev minor
            entry.rdev.0,
            entry.rdev.1,
            entry.name.len() as u32 + 1,
            0, // check
        ];
        let mut header = Vec::with_capacity(HEADER);
        header.extend_from_slice(MAGIC);
        for f in fields {
            header.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.put(&header)?;
        self.put(entry.name)?;
        self.put(&[0])?;
        self.pad()?;
        let copied = io::copy(&mut data.take(entry.size), &mut self.out)?;
        self.written += copied;
        if copied != entry.size {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{} shrank while it was archived",
                    String::from_utf8_lossy(entry.name)
                ),
            ));
        }
        self.pad()
    }

    /// An entry whose data is `data`.
    pub fn entry_with(&mut self, entry: Entry<'_>, mut data: &[u8]) -> io::Result<()> {
        let entry = Entry {
            size: data.len() as u64,
            ..entry
        };
        self.entry(&entry, &mut data)
    }

    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> io::Result<()> {
        let pad = (4 - self.written % 4) % 4;
        self.put(&[0u8; 3][..pad as usize])
    }

    /// Writes the trailer; returns the output.
    pub fn finish(mut self) -> io::Result<W> {
        self.entry_with(Entry::new(TRAILER, 0), &[])?;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Archives the tree at `root` (its contents, named relative to it, each
/// directory before what it holds; links not followed; sockets and device
/// nodes left out) with owners and modes; returns the output.
pub fn write_tree<W: Write>(root: &Path, out: W) -> io::Result<W> {
    write_tree_with(root, &[], out)
}

/// [`write_tree`], with `files` put in the tree: each a host file and its
/// name in the tree (relative, `/`-separated), which replaces what the
/// tree has there and comes last, its missing parent directories made
/// (mode 0755, root's).
pub fn write_tree_with<W: Write>(
    root: &Path,
    files: &[(String, std::path::PathBuf)],
    out: W,
) -> io::Result<W> {
    write_with(Some(root), files, out)
}

/// An archive of `files` alone (as [`write_tree_with`] puts them in a
/// tree): each a host file and its name (relative, `/`-separated).
pub fn write_files<W: Write>(files: &[(String, std::path::PathBuf)], out: W) -> io::Result<W> {
    write_with(None, files, out)
}

fn write_with<W: Write>(
    root: Option<&Path>,
    files: &[(String, std::path::PathBuf)],
    out: W,
) -> io::Result<W> {
    use std::os::unix::fs::MetadataExt;
    let mut writer = Writer::new(out);
    let mut walked = Walked {
        skip: files
            .iter()
            .map(|(name, _)| name.as_bytes().to_vec())
            .collect(),
        dirs: std::collections::HashSet::new(),
    };
    if let Some(root) = root {
        walk(root, &mut Vec::new(), &mut writer, &mut walked)?;
    }
    for (name, source) in files {
        let parts: Vec<&str> = name.split('/').collect();
        let mut parent = Vec::new();
        for part in &parts[..parts.len() - 1] {
            if !parent.is_empty() {
                parent.push(b'/');
            }
            parent.extend_from_slice(part.as_bytes());
            if walked.dirs.insert(parent.clone()) {
                writer.entry_with(Entry::new(&parent, S_IFDIR | 0o755), &[])?;
            }
        }
        let mut file = std::fs::File::open(source)?;
        let meta = file.metadata()?;
        if meta.mode() & S_IFMT != S_IFREG {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a file", source.display()),
            ));
        }
        writer.entry(
            &Entry {
                mode: meta.mode(),
                uid: meta.uid(),
                gid: meta.gid(),
                size: meta.len(),
                ..Entry::new(name.as_bytes(), 0)
            },
            &mut file,
        )?;
    }
    writer.finish()
}

/// What a walk leaves out, and the directories it archived.
struct Walked {
    skip: std::collections::HashSet<Vec<u8>>,
    dirs: std::collections::HashSet<Vec<u8>>,
}

fn walk<W: Write>(
    dir: &Path,
    prefix: &mut Vec<u8>,
    writer: &mut Writer<W>,
    walked: &mut Walked,
) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    let mut names: Vec<_> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()?;
    names.sort();
    for name in names {
        let path = dir.join(&name);
        let meta = std::fs::symlink_metadata(&path)?;
        let len = prefix.len();
        if !prefix.is_empty() {
            prefix.push(b'/');
        }
        prefix.extend_from_slice(name.as_bytes());
        if walked.skip.contains(prefix.as_slice()) {
            prefix.truncate(len);
            continue;
        }
        let entry = Entry {
            name: prefix,
            mode: meta.mode(),
            uid: meta.uid(),
            gid: meta.gid(),
            rdev: (0, 0),
            size: 0,
        };
        match meta.mode() & S_IFMT {
            S_IFDIR => {
                writer.entry_with(entry, &[])?;
                walked.dirs.insert(prefix.clone());
                walk(&path, prefix, writer, walked)?;
            }
            S_IFREG => {
                let mut file = std::fs::File::open(&path)?;
                writer.entry(
                    &Entry {
                        size: meta.len(),
                        ..entry
                    },
                    &mut file,
                )?;
            }
            S_IFLNK => {
                let target = std::fs::read_link(&path)?;
                writer.entry_with(entry, target.as_os_str().as_bytes())?;
            }
            S_IFIFO => writer.entry_with(entry, &[])?,
            _ => {}
        }
        prefix.truncate(len);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names and data of a newc archive's entries.
    fn entries(mut bytes: &[u8]) -> Vec<(String, u32, Vec<u8>)> {
        let hex =
            |b: &[u8]| u32::from_str_radix(std::str::from_utf8(b).expect("hex"), 16).expect("hex");
        let mut out = Vec::new();
        let pad = |n: usize| (4 - n % 4) % 4;
        loop {
            let (mode, size, namesize) = (
                hex(&bytes[14..22]),
                hex(&bytes[54..62]) as usize,
                hex(&bytes[94..102]) as usize,
            );
            let name = &bytes[HEADER..HEADER + namesize - 1];
            let data_at = HEADER + namesize + pad(HEADER + namesize);
            if name == TRAILER {
                return out;
            }
            let name = String::from_utf8_lossy(name).into_owned();
            out.push((name, mode, bytes[data_at..data_at + size].to_vec()));
            bytes = &bytes[data_at + size + pad(size)..];
        }
    }

    #[test]
    fn a_tree_with_files_put_in_replaces_and_adds_them() {
        let dir = std::env::temp_dir().join(format!("husk-cpio-with-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("tree/etc")).expect("tree");
        std::fs::write(dir.join("tree/etc/hosts"), "the image's").expect("file");
        std::fs::write(dir.join("tree/etc/passwd"), "kept").expect("file");
        std::fs::write(dir.join("hosts"), "the pod's").expect("file");
        std::fs::write(dir.join("log"), "").expect("file");
        let archive = write_tree_with(
            &dir.join("tree"),
            &[
                ("etc/hosts".into(), dir.join("hosts")),
                ("dev/termination-log".into(), dir.join("log")),
            ],
            Vec::new(),
        )
        .expect("archive");
        let got: Vec<(String, Vec<u8>)> = entries(&archive)
            .into_iter()
            .map(|(name, _, data)| (name, data))
            .collect();
        let _ = std::fs::remove_dir_all(&dir);

        assert_eq!(
            got,
            [
                ("etc".to_owned(), vec![]),
                ("etc/passwd".to_owned(), b"kept".to_vec()),
                ("etc/hosts".to_owned(), b"the pod's".to_vec()),
                ("dev".to_owned(), vec![]),
                ("dev/termination-log".to_owned(), vec![]),
            ]
        );
    }

    #[test]
    fn entries_are_aligned_and_terminated() {
        let mut w = Writer::new(Vec::new());
        w.entry_with(Entry::new(b"a", S_IFREG | 0o644), b"hello")
            .expect("entry");
        let bytes = w.finish().expect("finish");

        assert_eq!(&bytes[..6], b"070701");
        // 110 + "a\0" = 112; data 5 bytes, padded to 8.
        assert_eq!(&bytes[112..117], b"hello");
        assert_eq!(&bytes[120..126], b"070701");
        assert_eq!(bytes.len() % 4, 0);
    }

    #[test]
    fn a_short_read_is_an_error() {
        let mut w = Writer::new(Vec::new());
        let entry = Entry {
            size: 10,
            ..Entry::new(b"a", S_IFREG | 0o644)
        };
        let err = w.entry(&entry, &mut &b"short"[..]).expect_err("short");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
