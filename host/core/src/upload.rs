//! Uploads: files an API client streams to the daemon for a later template
//! build (a root file system archive, a guest kernel). They are how a
//! client hands the daemon a file without the daemon, which runs as root,
//! reading a host path the client names (only directories the operator
//! listed with `--template-source` are read that way).
//!
//! Each upload is `<state dir>/uploads/<id>`, written as `.<id>.part` and
//! renamed once complete, so a half-received file is never used. A build
//! takes an upload by renaming it into the template's directory: each one
//! is used once. Uploads no build took are removed after [`KEEP`].

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use husk_types::UploadInfo;
use sha2::{Digest, Sha256};

/// Where uploads wait, under the state directory.
const DIR: &str = "uploads";

/// How long an upload no build took is kept.
pub const KEEP: Duration = Duration::from_secs(3600);

/// Errors receiving or taking an upload.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error("the upload is over the daemon's {0}-byte limit (husk serve --max-upload-mib)")]
    /// Over the limit.
    TooLarge(u64),
    #[error(
        "no upload `{0}`: an upload is used by one build and kept for an hour (upload it again)"
    )]
    /// No such upload (or used already).
    NotFound(String),
    #[error("the upload broke off: {0}")]
    /// The client's body broke off.
    Body(#[source] std::io::Error),
    #[error("I/O error on {0}: {1}")]
    /// A file operation failed.
    Io(PathBuf, #[source] std::io::Error),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> UploadError + '_ {
    move |e| UploadError::Io(path.to_owned(), e)
}

/// Writes `body` to a new upload of the host whose state is in
/// `state_dir`, refusing more than `max` bytes (nothing is left of a
/// refused or broken upload).
pub fn receive(state_dir: &Path, body: &mut dyn Read, max: u64) -> Result<UploadInfo, UploadError> {
    let dir = &state_dir.join(DIR);
    create_dir(dir)?;
    sweep(dir, KEEP);
    let id = crate::ids::random_id("up", 16).map_err(io(Path::new("/dev/urandom")))?;
    let part = dir.join(format!(".{id}.part"));
    let result = write_part(&part, body, max);
    let (bytes, sha256) = match result {
        Ok(done) => done,
        Err(e) => {
            let _ = std::fs::remove_file(&part);
            return Err(e);
        }
    };
    let path = dir.join(&id);
    // Its hash beside it, so that a taker need not read it again.
    let hashed = hash_file(dir, &id);
    let kept = std::fs::write(&hashed, &sha256).and_then(|()| std::fs::rename(&part, &path));
    if let Err(e) = kept {
        let _ = std::fs::remove_file(&part);
        let _ = std::fs::remove_file(&hashed);
        return Err(UploadError::Io(path, e));
    }
    Ok(UploadInfo { id, bytes, sha256 })
}

fn create_dir(dir: &Path) -> Result<(), UploadError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io(dir))
}

fn write_part(part: &Path, body: &mut dyn Read, max: u64) -> Result<(u64, String), UploadError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(part)
        .map_err(io(part))?;
    let mut hash = Sha256::new();
    let mut total = 0u64;
    let mut buf = vec![0u8; 256 << 10];
    loop {
        let n = match body.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(UploadError::Body(e)),
        };
        total += n as u64;
        if total > max {
            return Err(UploadError::TooLarge(max));
        }
        hash.update(&buf[..n]);
        file.write_all(&buf[..n]).map_err(io(part))?;
    }
    file.sync_all().map_err(io(part))?;
    let sha256 = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((total, sha256))
}

/// Moves upload `id` of the host whose state is in `state_dir` to `to`
/// (the caller owns it then).
pub fn take(state_dir: &Path, id: &str, to: &Path) -> Result<(), UploadError> {
    take_with_hash(state_dir, id, to).map(drop)
}

/// [`take`], returning the upload's SHA-256 (hex) as it was received (an
/// upload without one, from an older daemon, is not found).
pub fn take_hashed(state_dir: &Path, id: &str, to: &Path) -> Result<String, UploadError> {
    let hash = std::fs::read_to_string(hash_file(&state_dir.join(DIR), id)).unwrap_or_default();
    if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(UploadError::NotFound(id.to_owned()));
    }
    take_with_hash(state_dir, id, to).map(|()| hash)
}

fn take_with_hash(state_dir: &Path, id: &str, to: &Path) -> Result<(), UploadError> {
    if !is_id(id) {
        return Err(UploadError::NotFound(id.to_owned()));
    }
    let dir = state_dir.join(DIR);
    match std::fs::rename(dir.join(id), to) {
        Ok(()) => {
            let _ = std::fs::remove_file(hash_file(&dir, id));
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(UploadError::NotFound(id.to_owned()))
        }
        Err(e) => Err(UploadError::Io(to.to_owned(), e)),
    }
}

/// Where upload `id`'s hash is kept, in the uploads' directory `dir`.
fn hash_file(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!(".{id}.sha256"))
}

/// Removes uploads (and parts of broken ones) older than `age`.
fn sweep(dir: &Path, age: Duration) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let now = SystemTime::now();
    for entry in entries.flatten() {
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| now.duration_since(t).ok())
            .is_some_and(|a| a >= age);
        if old {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// `up-` and 32 lowercase hex digits (128 random bits: not guessable).
fn is_id(id: &str) -> bool {
    id.strip_prefix("up-").is_some_and(|hex| {
        hex.len() == 32
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("husk-upload-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn an_upload_is_received_whole_and_taken_once() {
        let dir = scratch("once");
        let to = dir.with_extension("taken");

        let up = receive(&dir, &mut &b"kernel bytes"[..], 1 << 20).expect("receive");
        take(&dir, &up.id, &to).expect("take");
        let again = take(&dir, &up.id, &to);

        assert_eq!(up.bytes, 12);
        assert_eq!(std::fs::read(&to).expect("taken"), b"kernel bytes");
        assert!(matches!(again, Err(UploadError::NotFound(_))), "{again:?}");
        std::fs::remove_dir_all(&dir).expect("cleanup");
        std::fs::remove_file(&to).expect("cleanup");
    }

    #[test]
    fn an_upload_over_the_limit_is_refused_and_leaves_nothing() {
        let dir = scratch("limit");

        let refused = receive(&dir, &mut &[0u8; 100][..], 99);

        assert!(
            matches!(refused, Err(UploadError::TooLarge(99))),
            "{refused:?}"
        );
        assert_eq!(std::fs::read_dir(dir.join(DIR)).expect("dir").count(), 0);
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn ids_that_are_not_upload_ids_name_no_file() {
        let dir = scratch("ids");
        std::fs::create_dir_all(dir.join(DIR)).expect("dir");
        std::fs::write(dir.join(DIR).join("secret"), b"x").expect("file");

        for id in [
            "secret",
            "../secret",
            "up-../../etc/passwd",
            "up-",
            ".up-0.part",
        ] {
            let taken = take(&dir, id, &dir.join("out"));
            assert!(
                matches!(taken, Err(UploadError::NotFound(_))),
                "{id}: {taken:?}"
            );
        }
        assert!(dir.join(DIR).join("secret").exists());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
