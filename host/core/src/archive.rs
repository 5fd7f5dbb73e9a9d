//! Tar archives from API clients: hostile input. An entry with an
//! absolute path, a `..` component, a hard link out of the tree, or a
//! device node or FIFO is refused with the entry's name (the daemon runs
//! as root; a device node in a guest image is a hole in the sandbox), and
//! nothing is written through a symbolic link that leads out of the tree.
//! Shared by root file systems from a tar (`rootfs`) and container images
//! (`oci`).

use std::path::{Component, Path, PathBuf};

/// Why an archive could not be unpacked.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("{0}")]
    /// The archive is unusable (a hostile entry, a missing part).
    Invalid(String),
    #[error("I/O error on {0}: {1}")]
    /// A file operation failed.
    Io(PathBuf, #[source] std::io::Error),
}

/// Unpacks a tar archive into `stage`, refusing entries that would leave
/// it or make device nodes.
pub fn unpack(archive: &Path, stage: &Path) -> Result<(), ArchiveError> {
    let file = std::fs::File::open(archive).map_err(|e| ArchiveError::Io(archive.to_owned(), e))?;
    let bad =
        |what: String| ArchiveError::Invalid(format!("tar archive {}: {what}", archive.display()));
    let mut tar = archive_reader(file);
    let entries = tar.entries().map_err(|e| bad(e.to_string()))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| bad(format!("unreadable entry: {e}")))?;
        if let Some(path) = checked_entry(&entry).map_err(bad)? {
            unpack_entry(&mut entry, &path, stage).map_err(bad)?;
        }
    }
    Ok(())
}

/// A tar reader that keeps modes and owners and replaces what is there.
pub(crate) fn archive_reader<R: std::io::Read>(from: R) -> tar::Archive<R> {
    let mut tar = tar::Archive::new(from);
    tar.set_preserve_permissions(true);
    tar.set_preserve_ownerships(true);
    tar.set_overwrite(true);
    tar
}

/// The path of an archive entry that may be unpacked, None for one that
/// carries no file (extended headers), or why it is refused: an absolute
/// or `..` path, a hard link out of the tree, a device node or a FIFO.
pub(crate) fn checked_entry<R: std::io::Read>(
    entry: &tar::Entry<'_, R>,
) -> Result<Option<PathBuf>, String> {
    let path: PathBuf = entry
        .path()
        .map_err(|e| format!("entry with a bad name: {e}"))?
        .into_owned();
    if !is_contained(&path) {
        return Err(format!(
            "entry `{}` is absolute or has a `..` component",
            path.display()
        ));
    }
    use tar::EntryType as T;
    match entry.header().entry_type() {
        T::Regular | T::Continuous | T::Directory | T::Symlink => Ok(Some(path)),
        T::Link => {
            let target = entry
                .link_name()
                .map_err(|e| e.to_string())?
                .map(|t| t.into_owned());
            if target.as_deref().is_some_and(is_contained) {
                Ok(Some(path))
            } else {
                Err(format!(
                    "hard link `{}` points out of the archive",
                    path.display()
                ))
            }
        }
        T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink => Ok(None),
        other => Err(format!(
            "entry `{}` is a {other:?} (device nodes and FIFOs are refused)",
            path.display()
        )),
    }
}

/// Unpacks one checked entry into `stage` (`unpack_in` also refuses to
/// write through a symlink that leads out of `stage`).
pub(crate) fn unpack_entry<R: std::io::Read>(
    entry: &mut tar::Entry<'_, R>,
    path: &Path,
    stage: &Path,
) -> Result<(), String> {
    let inside = entry.unpack_in(stage).map_err(|e| {
        // tar's error names the file; the cause is its source.
        let cause = std::error::Error::source(&e).map_or_else(String::new, |c| format!(": {c}"));
        format!("entry `{}`: {e}{cause}", path.display())
    })?;
    if inside {
        Ok(())
    } else {
        Err(format!("entry `{}` leaves the archive", path.display()))
    }
}

/// A path inside an archive that stays inside the directory it is
/// unpacked in: relative, without `..`.
pub fn is_contained(path: &Path) -> bool {
    path.components()
        .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn archive_paths_must_stay_inside() {
        assert!(is_contained(Path::new("usr/bin/x")));
        assert!(is_contained(Path::new("./etc")));
        assert!(!is_contained(Path::new("/etc/passwd")));
        assert!(!is_contained(Path::new("a/../../x")));
    }

    fn temp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("husk-archive-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    }

    /// A tar with one entry, its header written by hand (the tar crate's
    /// builder refuses bad paths, as it should).
    fn tar_with(name: &str, kind: u8, link: &str) -> Vec<u8> {
        let mut h = [0u8; 512];
        h[..name.len()].copy_from_slice(name.as_bytes());
        h[100..108].copy_from_slice(b"0000644\0");
        h[108..116].copy_from_slice(b"0000000\0");
        h[116..124].copy_from_slice(b"0000000\0");
        h[124..136].copy_from_slice(b"00000000000\0");
        h[136..148].copy_from_slice(b"00000000000\0");
        h[156] = kind;
        h[157..157 + link.len()].copy_from_slice(link.as_bytes());
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        let mut out = h.to_vec();
        out.extend_from_slice(&[0u8; 1024]);
        out
    }

    fn unpack_one(name: &str, kind: u8, link: &str) -> Result<(), ArchiveError> {
        let dir = temp(&format!("{}-{kind}", name.replace('/', "_")));
        let archive = dir.join("a.tar");
        std::fs::write(&archive, tar_with(name, kind, link)).expect("write tar");
        let stage = dir.join("stage");
        std::fs::create_dir_all(&stage).expect("stage");
        let result = unpack(&archive, &stage);
        std::fs::remove_dir_all(dir).expect("cleanup");
        result
    }

    #[test]
    fn a_plain_file_unpacks() {
        assert!(unpack_one("etc/hello", b'0', "").is_ok());
    }

    #[test]
    fn hostile_entries_are_refused_by_name() {
        for (name, kind, link, says) in [
            ("/etc/passwd", b'0', "", "absolute"),
            ("a/../../x", b'0', "", "`..`"),
            ("dev/sda", b'4', "", "device nodes"),
            ("dev/mem", b'3', "", "device nodes"),
            ("fifo", b'6', "", "FIFOs"),
            ("escape", b'1', "../../etc/shadow", "out of the archive"),
        ] {
            let err = unpack_one(name, kind, link).expect_err(name).to_string();
            assert!(err.contains(says), "{name}: {err}");
        }
    }
}
