//! husk-mkinitramfs: writes the guest's initramfs, a newc cpio archive with
//! guest-init as `/init`, a static busybox with a symlink per applet, the
//! mount points guest-init uses and the two device nodes a console needs.
//! No root privileges are needed and the output is reproducible (all
//! timestamps 0, owner root).
//!
//! usage: husk-mkinitramfs <guest-init> <busybox> <output.cpio>

use std::io::{self, Write};
use std::path::Path;
use std::process::{Command, ExitCode};

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const S_IFCHR: u32 = 0o020000;
const DIRS: &[&str] = &[
    "bin", "dev", "etc", "proc", "root", "run", "sbin", "sys", "tmp", "usr", "usr/bin", "usr/sbin",
];

/// Writes a newc ("070701") cpio archive.
struct Cpio<W: Write> {
    out: W,
    ino: u32,
    written: u64,
}

impl<W: Write> Cpio<W> {
    fn new(out: W) -> Self {
        Cpio {
            out,
            ino: 0,
            written: 0,
        }
    }

    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) -> io::Result<()> {
        self.ino += 1;
        let nlink = if mode & S_IFDIR != 0 { 2 } else { 1 };
        let fields = [
            self.ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            data.len() as u32,
            0, // dev major
            0, // dev minor
            rdev.0,
            rdev.1,
            name.len() as u32 + 1,
            0, // check
        ];
        let mut header = String::from("070701");
        for f in fields {
            header.push_str(&format!("{f:08x}"));
        }
        self.put(header.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
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

    fn finish(mut self) -> io::Result<W> {
        self.entry("TRAILER!!!", 0, (0, 0), &[])?;
        self.out.flush()?;
        Ok(self.out)
    }
}

fn applets(busybox: &Path) -> io::Result<Vec<String>> {
    let out = Command::new(busybox).arg("--list-full").output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "{} --list-full failed",
            busybox.display()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && *l != "bin/busybox" && !l.contains(".."))
        .map(str::to_owned)
        .collect())
}

fn build(init: &Path, busybox: &Path, output: &Path) -> io::Result<()> {
    let init_bytes = std::fs::read(init)?;
    let busybox_bytes = std::fs::read(busybox)?;
    let mut applets = applets(busybox)?;
    applets.sort();
    applets.dedup();
    let tmp = output.with_extension("tmp");
    let mut cpio = Cpio::new(io::BufWriter::new(std::fs::File::create(&tmp)?));
    for dir in DIRS {
        cpio.entry(dir, S_IFDIR | 0o755, (0, 0), &[])?;
    }
    cpio.entry("dev/console", S_IFCHR | 0o600, (5, 1), &[])?;
    cpio.entry("dev/null", S_IFCHR | 0o666, (1, 3), &[])?;
    cpio.entry("init", S_IFREG | 0o755, (0, 0), &init_bytes)?;
    cpio.entry("bin/busybox", S_IFREG | 0o755, (0, 0), &busybox_bytes)?;
    for applet in &applets {
        if DIRS.iter().any(|d| applet.starts_with(&format!("{d}/"))) {
            cpio.entry(applet, S_IFLNK | 0o777, (0, 0), b"/bin/busybox")?;
        }
    }
    cpio.finish()?;
    std::fs::rename(&tmp, output)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let [_, init, busybox, output] = args.as_slice() else {
        eprintln!("usage: husk-mkinitramfs <guest-init> <busybox> <output.cpio>");
        return ExitCode::from(2);
    };
    match build(Path::new(init), Path::new(busybox), Path::new(output)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("husk-mkinitramfs: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_entries_are_aligned_and_terminated() {
        let mut cpio = Cpio::new(Vec::new());
        cpio.entry("init", S_IFREG | 0o755, (0, 0), b"abcde")
            .expect("entry");

        let bytes = cpio.finish().expect("finish");

        assert_eq!(&bytes[..6], b"070701");
        assert_eq!(&bytes[110..115], b"init\0");
        // 110-byte header + 5-byte name padded to 116, then 5 data bytes padded to 124.
        assert_eq!(&bytes[116..121], b"abcde");
        assert_eq!(&bytes[124..130], b"070701");
        assert!(bytes.windows(10).any(|w| w == b"TRAILER!!!"));
        assert_eq!(bytes.len() % 4, 0);
    }
}
