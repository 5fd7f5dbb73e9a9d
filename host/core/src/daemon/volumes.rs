//! Named volumes: directories the daemon keeps under
//! `<state dir>/volumes/<id>/`, which sandboxes mount like a host
//! directory (one of their template's fs slots; see `shares`) but by name,
//! several at once and one after another; a volume outlives them and goes
//! only when deleted, never while a sandbox has it mounted.
//!
//! A volume's directory belongs to [`VOLUME_OWNER`] (when the daemon runs as
//! root): neither root nor any jail's uid, so a jailed VMM gets it, idmapped,
//! as its own and what guests make there stays that owner's on the host.

pub use husk_types::VOLUME_OWNER;
use husk_types::{check_volume_name, VolumeInfo};

use super::*;

const _: () = assert!(VOLUME_OWNER == husk_jailer::UID_BASE - 1);

/// Where volumes live, beneath the state directory.
const VOLUMES: &str = "volumes";

impl Daemon {
    /// Makes volume `name` (an empty directory).
    pub fn create_volume(&self, name: &str, who: &str) -> Result<VolumeInfo, DaemonError> {
        check_volume_name(name).map_err(DaemonError::Invalid)?;
        let id = crate::ids::random_id("vol", 8)?;
        let dir = self.volume_dir(&id);
        std::fs::create_dir_all(dir.parent().unwrap_or(&dir))?;
        std::fs::create_dir(&dir)?;
        let made = (|| {
            // SAFETY: geteuid cannot fail.
            if unsafe { libc::geteuid() } == 0 {
                std::os::unix::fs::chown(&dir, Some(VOLUME_OWNER), Some(VOLUME_OWNER))?;
            }
            let created = now_unix_ms();
            if !self.store.add_volume(&id, name, created)? {
                return Err(DaemonError::Conflict(format!(
                    "a volume named `{name}` exists already"
                )));
            }
            Ok(created)
        })();
        let created_unix_ms = match made {
            Ok(created) => created,
            Err(e) => {
                let _ = std::fs::remove_dir(&dir);
                return Err(e);
            }
        };
        self.store
            .audit(who, "volume-create", None, None, &format!("{id} {name}"))?;
        Ok(VolumeInfo {
            id,
            name: name.to_owned(),
            created_unix_ms,
            mounted_by: Vec::new(),
        })
    }

    /// Every volume, by name.
    pub fn volumes(&self) -> Result<Vec<VolumeInfo>, DaemonError> {
        let rows = self.store.volumes()?;
        Ok(rows
            .into_iter()
            .map(|(id, name, created_unix_ms)| VolumeInfo {
                mounted_by: self.mounted_by(&id),
                id,
                name,
                created_unix_ms,
            })
            .collect())
    }

    /// The volume with this id or name.
    pub fn volume(&self, id_or_name: &str) -> Result<VolumeInfo, DaemonError> {
        let (id, name, created_unix_ms) = self.store.volume(id_or_name)?.ok_or_else(|| {
            DaemonError::NotFound(format!("no volume `{id_or_name}` (see GET /v1/volumes)"))
        })?;
        Ok(VolumeInfo {
            mounted_by: self.mounted_by(&id),
            id,
            name,
            created_unix_ms,
        })
    }

    /// Deletes a volume and everything in it; refused while a sandbox has
    /// it mounted.
    pub fn delete_volume(&self, id_or_name: &str, who: &str) -> Result<(), DaemonError> {
        let v = self.volume(id_or_name)?;
        if !v.mounted_by.is_empty() {
            return Err(DaemonError::Conflict(format!(
                "volume `{}` is mounted by sandboxes {}: destroy them first",
                v.name,
                v.mounted_by.join(", ")
            )));
        }
        // The record first: a delete that fails half way leaves files no
        // volume names, never a volume without its directory.
        self.store.remove_volume(&v.id)?;
        match std::fs::remove_dir_all(self.volume_dir(&v.id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                tracing::warn!(volume = %v.id, "removing its directory: {e}");
            }
            _ => {}
        }
        self.store.audit(
            who,
            "volume-delete",
            None,
            None,
            &format!("{} {}", v.id, v.name),
        )?;
        Ok(())
    }

    /// Volume `id`'s directory.
    pub(super) fn volume_dir(&self, id: &str) -> PathBuf {
        self.cfg.state_dir.join(VOLUMES).join(id)
    }

    /// The sandboxes that have volume `id` mounted (running or paused). One
    /// being created with it is not among them until it runs: a delete
    /// before then fails that create, which says why.
    fn mounted_by(&self, id: &str) -> Vec<String> {
        let inner = self.lock();
        let mut ids: Vec<String> = inner
            .sandboxes
            .values()
            .filter(|l| !matches!(l.rec.state, SandboxState::Failed))
            .filter(|l| l.rec.mounts.iter().any(|m| m.volume.as_deref() == Some(id)))
            .map(|l| l.rec.id.clone())
            .collect();
        ids.sort();
        ids
    }
}
