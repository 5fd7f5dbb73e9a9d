//! husk-mkrootfs: lays out the guest's root file system: guest-init as
//! `/init` (and `/sbin/init`, where the kernel looks on a disk root), a
//! static busybox with a symlink per applet, the mount points guest-init
//! uses and the two device nodes a console needs; with a static bash, that
//! as `/bin/bash`; and the users E2B-style clients expect: `root`, and
//! `user` (uid 1000) with its home `/home/user`.
//!
//! usage: husk-mkrootfs <guest-init> <busybox> cpio <output.cpio> [<bash>]
//!        husk-mkrootfs <guest-init> <busybox> dir <output-dir> [<bash>]
//!
//! `cpio` writes a newc initramfs: no root privileges needed, reproducible
//! (timestamps 0, owner root). `dir` writes the same tree as a directory for
//! `mkfs.ext4 -d`, without the device nodes (creating those needs root;
//! guest-init/build-rootfs.sh adds them to the image with debugfs).

use std::io::{self, Write};
use std::path::Path;
use std::process::{Command, ExitCode};

use husk_protocol::cpio::{self, S_IFCHR, S_IFDIR, S_IFLNK, S_IFREG};

const DIRS: &[&str] = &[
    "bin", "dev", "etc", "proc", "root", "run", "sbin", "sys", "tmp", "usr", "usr/bin", "usr/sbin",
];

/// One entry of the initramfs.
fn put(
    cpio: &mut cpio::Writer<impl Write>,
    name: &str,
    mode: u32,
    (rdev, owner): ((u32, u32), u32),
    data: &[u8],
) -> io::Result<()> {
    let entry = cpio::Entry {
        uid: owner,
        gid: owner,
        rdev,
        ..cpio::Entry::new(name.as_bytes(), mode)
    };
    cpio.entry_with(entry, data)
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

/// One entry of the root file system.
enum Node {
    Dir,
    File(Vec<u8>),
    Symlink(&'static str),
    CharDevice(u32, u32),
    /// A directory owned by this uid (and gid).
    OwnedDir(u32),
}

/// The users: root, and `user` as E2B templates have it.
const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n";
const GROUP: &str = "root:x:0:\nuser:x:1000:\n";

/// The tree: (path without leading slash, permission bits, node).
fn tree(init: &Path, busybox: &Path, bash: Option<&Path>) -> io::Result<Vec<(String, u32, Node)>> {
    let mut entries: Vec<(String, u32, Node)> = DIRS
        .iter()
        .map(|d| (d.to_string(), 0o755, Node::Dir))
        .collect();
    entries.push(("etc/passwd".into(), 0o644, Node::File(PASSWD.into())));
    entries.push(("etc/group".into(), 0o644, Node::File(GROUP.into())));
    entries.push(("home".into(), 0o755, Node::Dir));
    entries.push(("home/user".into(), 0o755, Node::OwnedDir(1000)));
    if let Some(bash) = bash {
        entries.push(("bin/bash".into(), 0o755, Node::File(std::fs::read(bash)?)));
    }
    entries.push(("dev/console".into(), 0o600, Node::CharDevice(5, 1)));
    entries.push(("dev/null".into(), 0o666, Node::CharDevice(1, 3)));
    entries.push(("init".into(), 0o755, Node::File(std::fs::read(init)?)));
    entries.push(("sbin/init".into(), 0o777, Node::Symlink("/init")));
    // guest-init is also the vsock test tool (a multi-call binary).
    entries.push(("bin/husk-vsock-probe".into(), 0o777, Node::Symlink("/init")));
    entries.push((
        "bin/busybox".into(),
        0o755,
        Node::File(std::fs::read(busybox)?),
    ));
    let mut applets = applets(busybox)?;
    applets.sort();
    applets.dedup();
    for applet in applets {
        // guest-init is init; busybox's init and linuxrc must not shadow it.
        let shadows = entries.iter().any(|(p, _, _)| *p == applet);
        let in_tree = DIRS.iter().any(|d| applet.starts_with(&format!("{d}/")));
        if in_tree && !shadows {
            entries.push((applet, 0o777, Node::Symlink("/bin/busybox")));
        }
    }
    Ok(entries)
}

fn write_cpio(entries: &[(String, u32, Node)], output: &Path) -> io::Result<()> {
    let tmp = output.with_extension("tmp");
    let mut cpio = cpio::Writer::new(io::BufWriter::new(std::fs::File::create(&tmp)?));
    let root = ((0, 0), 0);
    for (path, perm, node) in entries {
        match node {
            Node::Dir => put(&mut cpio, path, S_IFDIR | perm, root, &[])?,
            Node::OwnedDir(uid) => put(&mut cpio, path, S_IFDIR | perm, ((0, 0), *uid), &[])?,
            Node::File(bytes) => put(&mut cpio, path, S_IFREG | perm, root, bytes)?,
            Node::Symlink(target) => put(&mut cpio, path, S_IFLNK | perm, root, target.as_bytes())?,
            Node::CharDevice(major, minor) => {
                put(&mut cpio, path, S_IFCHR | perm, ((*major, *minor), 0), &[])?
            }
        }
    }
    cpio.finish()?;
    std::fs::rename(&tmp, output)
}

fn write_dir(entries: &[(String, u32, Node)], output: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if output.exists() {
        std::fs::remove_dir_all(output)?;
    }
    std::fs::create_dir_all(output)?;
    for (path, perm, node) in entries {
        let target = output.join(path);
        match node {
            Node::Dir => std::fs::create_dir_all(&target)?,
            Node::OwnedDir(uid) => {
                std::fs::create_dir_all(&target)?;
                // Only root may give it away; mkfs.ext4 -d keeps the owner.
                let _ = std::os::unix::fs::chown(&target, Some(*uid), Some(*uid));
            }
            Node::File(bytes) => {
                std::fs::write(&target, bytes)?;
                std::fs::set_permissions(&target, std::fs::Permissions::from_mode(*perm))?;
            }
            Node::Symlink(to) => std::os::unix::fs::symlink(to, &target)?,
            Node::CharDevice(..) => {}
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (init, busybox, format, output, bash) = match args.as_slice() {
        [_, init, busybox, format, output] => (init, busybox, format, output, None),
        [_, init, busybox, format, output, bash] => {
            (init, busybox, format, output, Some(Path::new(bash)))
        }
        _ => {
            eprintln!("usage: husk-mkrootfs <guest-init> <busybox> cpio|dir <output> [<bash>]");
            return ExitCode::from(2);
        }
    };
    let result =
        tree(Path::new(init), Path::new(busybox), bash).and_then(|entries| match format.as_str() {
            "cpio" => write_cpio(&entries, Path::new(output)),
            "dir" => write_dir(&entries, Path::new(output)),
            other => Err(io::Error::other(format!("unknown output format `{other}`"))),
        });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("husk-mkrootfs: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_entries_are_aligned_and_terminated() {
        let mut cpio = cpio::Writer::new(Vec::new());
        put(&mut cpio, "init", S_IFREG | 0o755, ((0, 0), 0), b"abcde").expect("entry");

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
