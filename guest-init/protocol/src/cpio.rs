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
        let mut header = String::with_capacity(HEADER);
        header.push_str("070701");
        for f in fields {
            header.push_str(&format!("{f:08x}"));
        }
        self.put(header.as_bytes())?;
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
    let mut writer = Writer::new(out);
    walk(root, &mut Vec::new(), &mut writer)?;
    writer.finish()
}

fn walk<W: Write>(dir: &Path, prefix: &mut Vec<u8>, writer: &mut Writer<W>) -> io::Result<()> {
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
                walk(&path, prefix, writer)?;
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
