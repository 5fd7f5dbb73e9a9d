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
//! its jailed VMM sees; the link and the overlay go with the sandbox. An
//! image no sandbox has linked for [`KEEP`] is removed (a link made or
//! removed changes its ctime).

use std::sync::atomic::AtomicU64;

use husk_types::{MediumInfo, MediumRequest};

use super::*;

/// Where images are kept, under the state directory.
const DIR: &str = "media";
/// Room for a container's writes beyond its tree: the image's free
/// space (sparse on the host: only what is written takes disk).
const SPARE_MIB: u64 = 1024;

/// How long an image no sandbox uses is kept.
const KEEP: Duration = Duration::from_secs(3600);

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
        let filled = self.fill_drive(&rec, &drive, &req.upload);
        let (info, rec) = self.change_record(id, |rec| match filled {
            Ok(info) => {
                rec.media.insert(drive.clone(), info.image.clone());
                Ok(info)
            }
            Err(e) => {
                rec.media.remove(&drive);
                Err(e)
            }
        })?;
        self.store.put_sandbox(&rec)?;
        let what = format!("{drive}: sha256 {}", info.image);
        self.store.audit(who, "medium", Some(id), None, &what)?;
        Ok(info)
    }

    /// Frees drive `drive` of sandbox `id` for another medium; the guest
    /// must have unmounted its file system. The medium stays in the drive
    /// until the next one replaces it.
    pub fn release_drive(&self, id: &str, drive: &str, who: &str) -> Result<(), DaemonError> {
        self.record(id)?;
        let ((), rec) = self.change_record(id, |rec| match rec.media.remove(drive) {
            Some(_) => Ok(()),
            None => Err(DaemonError::NotFound(format!(
                "drive `{drive}` of sandbox `{id}` holds no medium"
            ))),
        })?;
        self.store.put_sandbox(&rec)?;
        self.store
            .audit(who, "release-drive", Some(id), None, drive)?;
        Ok(())
    }

    /// Marks a free drive of sandbox `id` (of `slots`) taken; the caller
    /// fills it or gives it back.
    fn reserve_drive(&self, id: &str, slots: u8) -> Result<String, DaemonError> {
        if slots == 0 {
            return Err(DaemonError::Invalid(format!(
                "sandbox `{id}` has no empty drives: its template was built without drive slots \
                 (husk template build --drive-slots N)"
            )));
        }
        let (drive, _) = self.change_record(id, |rec| {
            let drive = (0..slots)
                .map(husk_types::drive_slot_id)
                .find(|d| !rec.media.contains_key(d))
                .ok_or_else(|| {
                    DaemonError::Limit(format!(
                        "all {slots} drives of sandbox `{id}` hold a medium in use"
                    ))
                })?;
            // Taken until filled or given back.
            rec.media.insert(drive.clone(), String::new());
            Ok(drive)
        })?;
        Ok(drive)
    }

    /// Makes (or finds) the image of `upload` and puts it in `drive`.
    fn fill_drive(
        &self,
        rec: &SandboxRecord,
        drive: &str,
        upload: &str,
    ) -> Result<MediumInfo, DaemonError> {
        let dir = self.cfg.state_dir.join(DIR);
        create_private_dir(&dir)?;
        sweep_unused(&dir, KEEP);
        // Unique across daemon restarts: a drive's files are never reused.
        let n = now_unix_ms() * 1000 + NEXT.fetch_add(1, Ordering::Relaxed) % 1000;
        let archive = dir.join(format!(".{}.{n}.tar", std::process::id()));
        let sha = crate::upload::take_hashed(&self.cfg.state_dir, upload, &archive)
            .map_err(|e| DaemonError::Invalid(e.to_string()))?;
        // What the jailed VMM reads: a link in its run directory.
        let link = rec.run_dir.join(format!("{drive}.{n}.ext4"));
        let overlay = rec.run_dir.join(format!("{drive}.{n}.overlay"));
        let linked = link_or_make(&dir.join(format!("{sha}.ext4")), &link, &archive);
        let _ = std::fs::remove_file(&archive);
        let build_ms = linked?;
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

/// Refuses what cannot be done to a sandbox while its drives hold media
/// (a snapshot would name files of its run directory, which others cannot
/// read and which go with it), it has host directories mounted, or it is
/// on a pod's network (a restored VMM's TAP is a new one, in its jail).
pub(super) fn refuse_with_media(rec: &SandboxRecord, what: &str) -> Result<(), DaemonError> {
    if let Some(netns) = &rec.pod_netns {
        return Err(DaemonError::Conflict(format!(
            "sandbox `{}` cannot be {what} while it is on the pod network of {}",
            rec.id,
            netns.display()
        )));
    }
    if !rec.mounts.is_empty() {
        let guest: Vec<&str> = rec.mounts.iter().map(|m| m.guest.as_str()).collect();
        return Err(DaemonError::Conflict(format!(
            "sandbox `{}` cannot be {what} while it has host directories mounted ({}): \
             a live share's session is not saved",
            rec.id,
            guest.join(", ")
        )));
    }
    if rec.media.is_empty() {
        return Ok(());
    }
    let drives: Vec<&str> = rec.media.keys().map(String::as_str).collect();
    Err(DaemonError::Conflict(format!(
        "sandbox `{}` cannot be {what} while its drives hold media ({}): release them first",
        rec.id,
        drives.join(", ")
    )))
}

/// Links image `image` at `link`, made first from tar archive `archive`
/// unless it was before (once linked, no sweep takes it). Returns how long
/// making it took (0: it was there).
fn link_or_make(image: &Path, link: &Path, archive: &Path) -> Result<u64, DaemonError> {
    let mut build_ms = 0;
    let mut made = link_image(image, link);
    if matches!(&made, Err(e) if e.kind() == std::io::ErrorKind::NotFound) {
        let started = Instant::now();
        crate::rootfs::make_medium(archive, image, &archive.with_extension("stage"), SPARE_MIB)
            .map_err(|e| DaemonError::Invalid(format!("the medium's tree: {e}")))?;
        build_ms = started.elapsed().as_millis() as u64;
        made = link_image(image, link);
    }
    made.map_err(|e| DaemonError::Failed(format!("{}: {e}", link.display())))
        .map(|()| build_ms)
}

/// Links image `image` at `link` (copies it where they are on different
/// file systems).
fn link_image(image: &Path, link: &Path) -> std::io::Result<()> {
    std::fs::hard_link(image, link).or_else(|e| match e.raw_os_error() {
        Some(libc::EXDEV) => std::fs::copy(image, link).map(drop),
        _ => Err(e),
    })
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

/// Removes the images in `dir` that no sandbox has linked for `age`.
fn sweep_unused(dir: &Path, age: Duration) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    for entry in entries.flatten() {
        let unused = entry.metadata().is_ok_and(|m| {
            m.is_file()
                && m.nlink() == 1
                && entry.file_name().to_string_lossy().ends_with(".ext4")
                && now.saturating_sub(m.ctime().max(0) as u64) >= age.as_secs()
        });
        if unused {
            let _ = std::fs::remove_file(entry.path());
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_medium_removes_only_the_earlier_media_of_its_drive() {
        let dir = vmm_dir();
        let names = [
            "slot0.7.ext4",
            "slot0.7.overlay",
            "slot0.9.ext4",
            "slot0.9.overlay",
            "slot1.8.ext4",
            "sb-1.slot0.overlay",
            "vsock",
        ];
        for name in names {
            std::fs::write(dir.join(name), b"").expect("file");
        }

        remove_earlier_media(&dir, "slot0", 9);

        let left = names_in(&dir);
        assert_eq!(
            left,
            [
                "sb-1.slot0.overlay",
                "slot0.9.ext4",
                "slot0.9.overlay",
                "slot1.8.ext4",
                "vsock"
            ]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_images_no_sandbox_links_are_swept() {
        let dir = vmm_dir();
        let run = vmm_dir();
        for name in ["used.ext4", "unused.ext4", ".123.4.tar"] {
            std::fs::write(dir.join(name), b"").expect("file");
        }
        std::fs::hard_link(dir.join("used.ext4"), run.join("slot0.1.ext4")).expect("link");

        sweep_unused(&dir, Duration::ZERO);

        let left = names_in(&dir);
        assert_eq!(left, [".123.4.tar", "used.ext4"]);
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&run);
    }

    #[test]
    fn a_sandbox_with_media_names_its_drives_when_refused() {
        let mut rec = crate::store::test_record("sb-1");
        rec.mounts.clear();
        let free = refuse_with_media(&rec, "hibernated");
        rec.media.insert("slot1".into(), "ab".into());
        rec.media.insert("slot0".into(), "cd".into());

        let refused = refuse_with_media(&rec, "hibernated");

        assert!(free.is_ok());
        let message = refused.expect_err("media").to_string();
        assert!(message.contains("(slot0, slot1)"), "{message}");
    }

    #[test]
    fn a_sandbox_with_mounts_names_them_when_refused() {
        let rec = crate::store::test_record("sb-1");

        let refused = refuse_with_media(&rec, "snapshotted");

        let message = refused.expect_err("mounts").to_string();
        assert!(message.contains("(/home/user/work)"), "{message}");
    }

    /// The names in `dir`, sorted.
    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn vmm_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "husk-media-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("dir");
        dir
    }
}
