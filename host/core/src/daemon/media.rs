//! Media for a sandbox's empty drives (a template's `drive_slots`): a
//! file tree, uploaded as a tar archive, becomes an ext4 image that a free
//! drive of the sandbox takes at run time, under a copy-on-write overlay
//! of the sandbox's own (the VMM's `Medium` request; the guest is told by
//! a configuration change interrupt). A pod's containers get their root
//! file systems this way: the guest reads the blocks it uses from the
//! host's page cache instead of copying the whole tree into its memory.
//!
//! Images are kept in `<state dir>/media/<sha256 of the archive>.ext4`, so
//! the same tree is made into an image once. A sandbox's drive reads a
//! hard link of its image in the sandbox's run directory, the only place
//! its jailed VMM sees; the link and the overlay go with the sandbox.

use std::sync::atomic::AtomicU64;

use husk_types::{MediumInfo, MediumRequest};
use sha2::{Digest, Sha256};

use super::*;

/// Where images are kept, under the state directory.
const DIR: &str = "media";
/// Room for a container's writes beyond its tree: the image's free
/// space (sparse on the host: only what is written takes disk).
const SPARE_MIB: u64 = 1024;

/// Numbers each medium put in a drive (its files' names).
static NEXT: AtomicU64 = AtomicU64::new(0);

impl Daemon {
    /// Makes the tree in upload `req.upload` (a tar archive) an ext4
    /// image, or finds the one made from the same bytes, and puts it in a
    /// free drive of sandbox `id` under a new overlay. The guest can mount
    /// it once its kernel has read the new capacity (guest-init's
    /// `MountMedium` waits for that).
    pub fn insert_medium(
        &self,
        id: &str,
        req: MediumRequest,
        who: &str,
    ) -> Result<MediumInfo, DaemonError> {
        let rec = self.in_state(
            id,
            SandboxState::Running,
            "a running sandbox takes a medium",
        )?;
        let slots = self
            .store
            .template(&rec.template)?
            .map_or(0, |t| t.drive_slots);
        let drive = self.reserve_drive(id, slots)?;
        let result = self.fill_drive(&rec, &drive, &req.upload);
        let mut inner = self.lock();
        let Some(live) = inner.sandboxes.get_mut(id) else {
            return Err(DaemonError::NotFound(format!("sandbox `{id}` went away")));
        };
        match result {
            Ok(info) => {
                live.rec.media.insert(drive.clone(), info.image.clone());
                let rec = live.rec.clone();
                drop(inner);
                self.store.put_sandbox(&rec)?;
                self.store.audit(
                    who,
                    "medium",
                    Some(id),
                    None,
                    &format!("{drive}: sha256 {}", info.image),
                )?;
                Ok(info)
            }
            Err(e) => {
                live.rec.media.remove(&drive);
                Err(e)
            }
        }
    }

    /// Frees drive `drive` of sandbox `id` for another medium; the guest
    /// must have unmounted its file system. The medium stays in the drive
    /// until the next one replaces it.
    pub fn release_drive(&self, id: &str, drive: &str, who: &str) -> Result<(), DaemonError> {
        self.record(id)?;
        let rec = {
            let mut inner = self.lock();
            let live = inner
                .sandboxes
                .get_mut(id)
                .ok_or_else(|| DaemonError::NotFound(format!("no sandbox `{id}`")))?;
            if live.rec.media.remove(drive).is_none() {
                return Err(DaemonError::NotFound(format!(
                    "drive `{drive}` of sandbox `{id}` holds no medium"
                )));
            }
            live.rec.clone()
        };
        self.store.put_sandbox(&rec)?;
        self.store
            .audit(who, "release-drive", Some(id), None, drive)?;
        Ok(())
    }

    /// Marks a free drive of sandbox `id` (of `slots`) taken; the caller
    /// fills it or gives it back.
    fn reserve_drive(&self, id: &str, slots: u8) -> Result<String, DaemonError> {
        let mut inner = self.lock();
        let live = inner
            .sandboxes
            .get_mut(id)
            .ok_or_else(|| DaemonError::NotFound(format!("no sandbox `{id}`")))?;
        if slots == 0 {
            return Err(DaemonError::Invalid(format!(
                "sandbox `{id}` has no empty drives: its template was built without drive slots \
                 (husk template build --drive-slots N)"
            )));
        }
        let drive = (0..slots)
            .map(husk_types::drive_slot_id)
            .find(|d| !live.rec.media.contains_key(d))
            .ok_or_else(|| {
                DaemonError::Limit(format!(
                    "all {slots} drives of sandbox `{id}` hold a medium in use"
                ))
            })?;
        // Taken until filled or given back.
        live.rec.media.insert(drive.clone(), String::new());
        Ok(drive)
    }

    /// Makes (or finds) the image of `upload` and puts it in `drive`.
    fn fill_drive(
        &self,
        rec: &SandboxRecord,
        drive: &str,
        upload: &str,
    ) -> Result<MediumInfo, DaemonError> {
        let started = Instant::now();
        let dir = self.cfg.state_dir.join(DIR);
        create_private_dir(&dir)?;
        // Unique across daemon restarts: a drive's files are never reused.
        let n = now_unix_ms() * 1000 + NEXT.fetch_add(1, Ordering::Relaxed) % 1000;
        let archive = dir.join(format!(".{}.{n}.tar", std::process::id()));
        crate::upload::take(&self.cfg.state_dir, upload, &archive)
            .map_err(|e| DaemonError::Invalid(e.to_string()))?;
        let image = sha256_of(&archive).and_then(|sha| {
            let image = dir.join(format!("{sha}.ext4"));
            if !image.exists() {
                let stage = archive.with_extension("stage");
                crate::rootfs::make_medium(&archive, &image, &stage, SPARE_MIB)
                    .map_err(|e| DaemonError::Invalid(format!("the medium's tree: {e}")))?;
            }
            Ok((sha, image))
        });
        let _ = std::fs::remove_file(&archive);
        let (sha, image) = image?;
        let build_ms = started.elapsed().as_millis() as u64;
        // What the jailed VMM reads: a link in its run directory.
        let link = rec.run_dir.join(format!("{drive}.{n}.ext4"));
        let overlay = rec.run_dir.join(format!("{drive}.{n}.overlay"));
        std::fs::hard_link(&image, &link)
            .or_else(|e| match e.raw_os_error() {
                // Run directories on another file system: a copy.
                Some(libc::EXDEV) => std::fs::copy(&image, &link).map(drop),
                _ => Err(e),
            })
            .map_err(|e| DaemonError::Failed(format!("{}: {e}", link.display())))?;
        let request = husk_vmm_api::Request::Medium {
            drive: drive.to_owned(),
            path: link.clone(),
            overlay: Some(overlay.clone()),
        };
        let size = match control(&rec.run_dir, &request) {
            Ok(husk_vmm_api::Reply::Medium { size, .. }) => size,
            other => {
                let _ = std::fs::remove_file(&link);
                let _ = std::fs::remove_file(&overlay);
                return Err(match other {
                    Err(e) => e,
                    Ok(reply) => {
                        DaemonError::Failed(format!("the VMM answered {reply:?} to a medium"))
                    }
                });
            }
        };
        remove_earlier_media(&rec.run_dir, drive, n);
        tracing::info!(
            sandbox = %rec.id, drive, image = %sha, size, build_ms,
            "a medium in the sandbox's drive"
        );
        Ok(MediumInfo {
            drive: drive.to_owned(),
            size,
            image: sha,
            build_ms,
        })
    }
}

/// The hex SHA-256 of the file at `path`.
fn sha256_of(path: &Path) -> Result<String, DaemonError> {
    let mut file = std::fs::File::open(path)
        .map_err(|e| DaemonError::Failed(format!("{}: {e}", path.display())))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher)
        .map_err(|e| DaemonError::Failed(format!("{}: {e}", path.display())))?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Makes `dir` (root's alone) if it is missing.
fn create_private_dir(dir: &Path) -> Result<(), DaemonError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| DaemonError::Failed(format!("{}: {e}", dir.display())))
}

/// Removes the files of the media `drive` held before medium `n` (the VMM
/// has closed them).
fn remove_earlier_media(run_dir: &Path, drive: &str, n: u64) {
    let Ok(entries) = std::fs::read_dir(run_dir) else {
        return;
    };
    let prefix = format!("{drive}.");
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let earlier = name
            .strip_prefix(&prefix)
            .and_then(|rest| rest.split_once('.'))
            .is_some_and(|(m, ext)| {
                m.parse::<u64>().is_ok_and(|m| m != n) && matches!(ext, "ext4" | "overlay")
            });
        if earlier {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}
