//! Host directories a sandbox sees live (a create's `mounts`, or one added
//! to a running sandbox, as a pod's volume is): each goes in one of its
//! template's empty virtio-fs slots after the clone is restored or claimed
//! from the pool, so pooled clones take them too, and the template's
//! snapshot holds no share.
//!
//! For each mount, in order: the host directory is checked (beneath one of
//! the daemon's mount roots, a directory, owned by someone other than
//! root unless read-only); a jailed VMM gets it bound into its running jail at
//! `/shares/fsN` by `husk-jailer --enter`, idmapped so that the owner's
//! files are the jail uid's there (what the guest creates is the owner's on
//! the host); the VMM's slot serves it (its `share` request), the owner
//! shown to the guest as its `user`; the agent mounts it at the guest path.
//!
//! A FUSE session is not saved: a sandbox with mounts neither hibernates
//! nor snapshots (see [`super::media::refuse_with_media`]). Destroying it
//! leaves the host directories as they are: the jail's mounts go with its
//! mount namespace.

use std::os::unix::fs::MetadataExt;

use husk_types::{fs_slot_id, MountSpec};

use super::*;

/// The guest user the owner of a shared directory appears as (guest-init's
/// root file system's `user`).
const GUEST_USER: (u32, u32) = (1000, 1000);

/// Where a jailed VMM finds its added shares.
const JAIL_SHARES: &str = husk_jailer::SHARES;

/// A create's mount, checked: its host path resolved, and that directory's
/// owner (whose files the guest's user's are).
pub(super) struct CheckedMount {
    pub(super) spec: MountSpec,
    owner: (u32, u32),
}

impl Daemon {
    /// Checks a create's mounts against template `t` and the daemon's mount
    /// roots before a clone is taken; returns them with their host paths
    /// resolved.
    pub(super) fn check_mounts(
        &self,
        t: &TemplateRecord,
        mounts: &[MountSpec],
    ) -> Result<Vec<CheckedMount>, DaemonError> {
        if mounts.is_empty() {
            return Ok(Vec::new());
        }
        if self.cfg.mount_roots.is_empty() && mounts.iter().any(|m| m.volume.is_none()) {
            return Err(DaemonError::Invalid(
                "this daemon gives sandboxes no host directories: start it with \
                 --mount-root DIR to allow those beneath DIR (named volumes need none)"
                    .into(),
            ));
        }
        if mounts.len() > usize::from(t.fs_slots) {
            return Err(DaemonError::Invalid(format!(
                "{} mounts, but template `{}` has {} fs slots (husk template build --fs-slots N)",
                mounts.len(),
                t.name,
                t.fs_slots
            )));
        }
        let mut resolved = Vec::with_capacity(mounts.len());
        for (index, mount) in mounts.iter().enumerate() {
            if mounts[..index].iter().any(|m| m.guest == mount.guest) {
                return Err(DaemonError::Invalid(format!(
                    "two mounts at {} in the guest",
                    mount.guest
                )));
            }
            resolved.push(self.check_one_mount(mount)?);
        }
        Ok(resolved)
    }

    /// One mount, checked: a volume's or a host directory's.
    fn check_one_mount(&self, mount: &MountSpec) -> Result<CheckedMount, DaemonError> {
        let (mount, real, owner) = match &mount.volume {
            Some(volume) => self.check_volume_mount(mount, volume)?,
            None => {
                let (real, owner) = self.check_mount(mount)?;
                (mount.clone(), real, owner)
            }
        };
        Ok(CheckedMount {
            spec: MountSpec {
                host: real.display().to_string(),
                ..mount
            },
            owner,
        })
    }

    /// Gives running sandbox `id` one more mount, in its next free fs slot
    /// (a pod's volume, when the pod's container that mounts it is made).
    /// A slot whose mount failed is not used again: the VMM may hold its
    /// share.
    pub fn add_mount(
        &self,
        id: &str,
        mount: MountSpec,
        who: &str,
    ) -> Result<SandboxInfo, DaemonError> {
        let rec = self.in_state(id, SandboxState::Running, "a running sandbox takes a mount")?;
        if rec
            .on_idle
            .is_some_and(|p| p.action == IdleAction::Hibernate)
        {
            return Err(DaemonError::Conflict(format!(
                "sandbox `{id}` hibernates when idle, and a live share is not saved: \
                 give it on_idle destroy first"
            )));
        }
        if self.cfg.mount_roots.is_empty() && mount.volume.is_none() {
            return Err(DaemonError::Invalid(
                "this daemon gives sandboxes no host directories: start it with \
                 --mount-root DIR to allow those beneath DIR (named volumes need none)"
                    .into(),
            ));
        }
        let t = self.template(&rec.template)?;
        let checked = self.check_one_mount(&mount)?;
        // The slot is taken under the lock, so that two mounts at once get
        // two slots.
        let (slot, _) = self.change_record(id, |rec| {
            if rec.state != SandboxState::Running {
                return Err(DaemonError::Conflict(format!(
                    "sandbox `{id}` is {}: only a running sandbox takes a mount",
                    rec.state.name()
                )));
            }
            if rec.mounts.iter().any(|m| m.guest == checked.spec.guest) {
                return Err(DaemonError::Conflict(format!(
                    "sandbox `{id}` has a mount at {} already",
                    checked.spec.guest
                )));
            }
            let slot = rec.fs_slots_used.max(rec.mounts.len() as u8);
            if slot >= t.fs_slots {
                return Err(DaemonError::Conflict(format!(
                    "sandbox `{id}`'s template `{}` has {} fs slots, all taken \
                     (husk template build --fs-slots N)",
                    t.name, t.fs_slots
                )));
            }
            rec.fs_slots_used = slot + 1;
            Ok(slot)
        })?;
        let tag = fs_slot_id(slot);
        let attached = self.attach_mount(&rec, &tag, &checked.spec, checked.owner, who);
        let ((), rec) = self.change_record(id, |rec| {
            if attached.is_ok() {
                rec.mounts.push(checked.spec.clone());
            }
            Ok(())
        })?;
        self.store.put_sandbox(&rec)?;
        let (host_ms, guest_ms) = attached.map_err(|e| match e {
            DaemonError::Failed(why) => DaemonError::Failed(format!(
                "mount {} at {}: {why}",
                checked.spec.host, checked.spec.guest
            )),
            other => other,
        })?;
        let what = match &checked.spec.volume {
            Some(volume) => format!("volume {volume}"),
            None => checked.spec.host.clone(),
        };
        self.store.audit(
            who,
            "mount",
            Some(id),
            None,
            &format!(
                "{what} at {} in {tag} mount_ms={host_ms:.1}+{guest_ms:.1}",
                checked.spec.guest
            ),
        )?;
        Ok(info(&rec))
    }

    /// What a mount's guest side must be, whatever it mounts: `what` names
    /// the mount in the refusal.
    fn check_guest_side(what: &str, mount: &MountSpec) -> Result<(), DaemonError> {
        let bad = |why: String| Err(DaemonError::Invalid(format!("mount {what}: {why}")));
        let guest = Path::new(&mount.guest);
        if !guest.is_absolute()
            || guest.parent().is_none()
            || guest
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            return bad(format!(
                "the guest path `{}` is not an absolute path below / without `..`",
                mount.guest
            ));
        }
        // The VMM's share syntax separates options with commas.
        if let Some(p) = mount.hide.iter().find(|p| p.is_empty() || p.contains(',')) {
            return bad(format!("the hidden pattern `{p}` is empty or has a comma"));
        }
        Ok(())
    }

    /// A volume's mount: the mount as recorded (the volume by id), the
    /// volume's directory and its owner.
    fn check_volume_mount(
        &self,
        mount: &MountSpec,
        volume: &str,
    ) -> Result<(MountSpec, PathBuf, (u32, u32)), DaemonError> {
        Self::check_guest_side(&format!("of volume {volume}"), mount)?;
        if !mount.host.is_empty() {
            return Err(DaemonError::Invalid(format!(
                "mount of volume {volume}: give a host directory or a volume, not both"
            )));
        }
        let v = self.volume(volume).map_err(|e| match e {
            DaemonError::NotFound(why) => DaemonError::Invalid(why),
            other => other,
        })?;
        let dir = self.volume_dir(&v.id);
        let meta = std::fs::metadata(&dir)?;
        let recorded = MountSpec {
            volume: Some(v.id),
            ..mount.clone()
        };
        Ok((recorded, dir, (meta.uid(), meta.gid())))
    }

    /// One mount's host directory (real path) and its owner.
    fn check_mount(&self, mount: &MountSpec) -> Result<(PathBuf, (u32, u32)), DaemonError> {
        let bad = |why: String| Err(DaemonError::Invalid(format!("mount {}: {why}", mount.host)));
        Self::check_guest_side(&mount.host, mount)?;
        let real = match std::fs::canonicalize(&mount.host) {
            Ok(real) => real,
            Err(e) => return bad(e.to_string()),
        };
        if !self
            .cfg
            .mount_roots
            .iter()
            .any(|root| real.starts_with(root))
        {
            return bad(format!(
                "{} is not beneath a mount root of this daemon (husk serve --mount-root)",
                real.display()
            ));
        }
        let meta = match std::fs::metadata(&real) {
            Ok(meta) => meta,
            Err(e) => return bad(e.to_string()),
        };
        if !meta.is_dir() {
            return bad("not a directory".into());
        }
        if self.cfg.jail.is_some() && !mount.readonly && (meta.uid() == 0 || meta.gid() == 0) {
            return bad(
                "owned by root: what the guest creates there would be root's; chown it to the \
                 user whose files these are, or mount it read-only"
                    .into(),
            );
        }
        if real.as_os_str().as_encoded_bytes().contains(&b',') && self.cfg.jail.is_none() {
            return bad("a path with a comma".into());
        }
        Ok((real, (meta.uid(), meta.gid())))
    }

    /// Gives sandbox `rec` (running, its agent answering) its mounts, in
    /// fs slots 0, 1, ...; what that took, host and guest apart (for the
    /// create's audit entry): ` mounts_ms=HOST+GUEST` or nothing.
    pub(super) fn attach_mounts(
        &self,
        rec: &SandboxRecord,
        mounts: &[CheckedMount],
        who: &str,
    ) -> Result<String, DaemonError> {
        let (mut host_ms, mut guest_ms) = (0.0, 0.0);
        for (index, CheckedMount { spec: mount, owner }) in mounts.iter().enumerate() {
            let tag = fs_slot_id(index as u8);
            let (host, guest) = self
                .attach_mount(rec, &tag, mount, *owner, who)
                .map_err(|e| match e {
                    DaemonError::Failed(why) => DaemonError::Failed(format!(
                        "mount {} at {}: {why}",
                        mount.host, mount.guest
                    )),
                    other => other,
                })?;
            host_ms += host;
            guest_ms += guest;
        }
        Ok(match mounts.is_empty() {
            true => String::new(),
            false => format!(" mounts_ms={host_ms:.1}+{guest_ms:.1}"),
        })
    }

    fn attach_mount(
        &self,
        rec: &SandboxRecord,
        tag: &str,
        mount: &MountSpec,
        owner: (u32, u32),
        who: &str,
    ) -> Result<(f64, f64), DaemonError> {
        let started = Instant::now();
        // The VMM sees the owner's files as the ids it runs with in its
        // jail, or as the owner's where it runs unjailed; the guest sees
        // them as its user's, and what the guest makes is the owner's.
        let (path, ids) = match &self.cfg.jail {
            Some(jail) => {
                let at = Path::new(JAIL_SHARES).join(tag);
                let out = std::process::Command::new(&jail.jailer)
                    .arg("--enter")
                    .arg(rec.pid.to_string())
                    .args(["--uid", &rec.uid.to_string(), "--gid", &rec.uid.to_string()])
                    .arg(if mount.readonly {
                        "--share-ro"
                    } else {
                        "--share"
                    })
                    .arg(format!("{}:{}:{}", owner.0, owner.1, mount.host))
                    .arg("--at")
                    .arg(&at)
                    .stdin(std::process::Stdio::null())
                    .output()
                    .map_err(|e| DaemonError::Failed(format!("{}: {e}", jail.jailer.display())))?;
                if !out.status.success() {
                    return Err(DaemonError::Failed(
                        String::from_utf8_lossy(&out.stderr).trim().to_owned(),
                    ));
                }
                (at.display().to_string(), (rec.uid, rec.uid))
            }
            None => (mount.host.clone(), owner),
        };
        let jail_ms = started.elapsed().as_secs_f64() * 1000.0;
        // A root-owned directory (only ever read-only, see `check_mount`:
        // a pod's configMap or secret) shows its files as root's.
        let guest_owner = match owner.0 == 0 || owner.1 == 0 {
            true => (0, 0),
            false => GUEST_USER,
        };
        let mut spec = format!(
            "tag={tag},path={path},owner={}:{},guest-owner={}:{}",
            ids.0, ids.1, guest_owner.0, guest_owner.1
        );
        if mount.readonly {
            spec.push_str(",ro");
        }
        for pattern in &mount.hide {
            spec.push_str(",hide=");
            spec.push_str(pattern);
        }
        match control(&rec.run_dir, &husk_vmm_api::Request::Share { spec })? {
            husk_vmm_api::Reply::Share { .. } => {}
            other => {
                return Err(DaemonError::Failed(format!(
                    "the VMM answered {other:?} to a share"
                )))
            }
        }
        let host_ms = started.elapsed().as_secs_f64() * 1000.0;
        tracing::debug!(sandbox = %rec.id, tag, jail_ms, vmm_ms = host_ms - jail_ms, "share served");
        let started = Instant::now();
        let detail = match &mount.volume {
            Some(volume) => format!("volume {volume} at {}", mount.guest),
            None => format!("{} at {}", mount.host, mount.guest),
        };
        self.with_agent(&rec.id, who, ("mount", &detail), |agent| {
            agent.mount_share(tag, &mount.guest, mount.readonly)
        })?;
        Ok((host_ms, started.elapsed().as_secs_f64() * 1000.0))
    }
}
