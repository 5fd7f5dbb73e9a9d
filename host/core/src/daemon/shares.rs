//! Host directories a sandbox sees live (a create's `mounts`, or one added
//! to a running sandbox, as a pod's volume is): each goes in one of its
//! template's empty virtio-fs slots after the clone is restored or claimed
//! from the pool, so pooled clones take them too, and the template's
//! snapshot holds no share.
//!
//! For each mount, in order: the host directory is checked (beneath one of
//! the daemon's mount roots, a directory, owned by someone other than
//! root unless read-only); a jailed VMM is passed a detached mount of it
//! over its control socket ([`husk_jailer::share_tree`]: nothing is mounted
//! in its jail), idmapped so that the owner's files are the jail uid's
//! there (what the guest creates is the owner's on the host); the VMM's
//! slot serves it (its `share` request), the owner
//! shown to the guest as its `user`; the agent mounts it at the guest path:
//! a create's mounts ahead of the first request that reaches the guest (a
//! [`Gate`]: the create answers once the host has served them, and the
//! monitor makes that request itself if no user does), one added to a
//! running sandbox before the add answers.
//!
//! A FUSE session is not saved: a sandbox with mounts neither hibernates
//! nor snapshots (see [`super::media::refuse_with_media`]). Destroying it
//! leaves the host directories as they are: the jail's mounts go with its
//! mount namespace.

use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;

use husk_agent_client::Share;
use husk_types::{fs_slot_id, MountSpec};

use super::*;

/// The guest user the owner of a shared directory appears as (guest-init's
/// root file system's `user`).
const GUEST_USER: (u32, u32) = (1000, 1000);

/// The file at the top of a host directory that lists what its guests
/// must not see (patterns as a mount's `hide` takes them).
pub const SANDBOXIGNORE: &str = ".sandboxignore";
/// Most bytes of a `.sandboxignore`.
const SANDBOXIGNORE_MAX: u64 = 64 << 10;
/// Most hidden patterns of one mount (each is tried at every lookup).
const MAX_HIDDEN: usize = 64;

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
                let mut mount = mount.clone();
                let listed = sandboxignore(&real)
                    .map_err(|why| DaemonError::Invalid(format!("mount {}: {why}", mount.host)))?;
                for pattern in listed {
                    if !mount.hide.contains(&pattern) {
                        mount.hide.push(pattern);
                    }
                }
                (mount, real, owner)
            }
        };
        if mount.hide.len() > MAX_HIDDEN {
            return Err(DaemonError::Invalid(format!(
                "mount at {}: {} hidden patterns, at most {MAX_HIDDEN}",
                mount.guest,
                mount.hide.len()
            )));
        }
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
        let attached = self
            .serve_mount(&rec, &tag, &checked.spec, checked.owner)
            .and_then(|host_ms| {
                let started = Instant::now();
                let mount = &checked.spec;
                self.with_agent(id, who, ("mount", &mount_detail(mount)), |agent| {
                    agent.mount_share(&tag, &mount.guest, mount.readonly)
                })?;
                Ok((host_ms, started.elapsed().as_secs_f64() * 1000.0))
            });
        let ((), rec) = self.change_record(id, |rec| {
            if attached.is_ok() {
                rec.mounts.push(checked.spec.clone());
                rec.mount_slots.push(slot);
            }
            Ok(())
        })?;
        self.store.put_sandbox(&rec)?;
        let (host_ms, guest_ms) = attached.map_err(|e| naming(&checked.spec, e))?;
        self.store.audit(
            who,
            "mount",
            Some(id),
            None,
            &format!(
                "{} in {tag} mount_ms={host_ms:.1}+{guest_ms:.1}",
                mount_detail(&checked.spec)
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

    /// Serves sandbox `rec`'s create mounts from fs slots 0, 1, ... (the
    /// host's part: its guest mounts them ahead of its first request, see
    /// [`Gate`]); the shares for its gate, and what serving them took
    /// (for the create's audit entry): ` mounts_ms=HOST` or nothing.
    pub(super) fn serve_mounts(
        &self,
        rec: &SandboxRecord,
        mounts: &[CheckedMount],
    ) -> Result<(Vec<Share>, String), DaemonError> {
        let started = Instant::now();
        let mut shares = Vec::with_capacity(mounts.len());
        for (index, CheckedMount { spec: mount, owner }) in mounts.iter().enumerate() {
            let tag = fs_slot_id(index as u8);
            self.serve_mount(rec, &tag, mount, *owner)
                .map_err(|e| naming(mount, e))?;
            shares.push(Share {
                tag,
                target: mount.guest.clone(),
                readonly: mount.readonly,
            });
        }
        let took = match mounts.is_empty() {
            true => String::new(),
            false => format!(" mounts_ms={:.1}", started.elapsed().as_secs_f64() * 1000.0),
        };
        Ok((shares, took))
    }

    /// The host's part of a mount: the directory (for a jailed VMM, a
    /// detached idmapped mount of it) served from fs slot `tag`; what it
    /// took in ms.
    fn serve_mount(
        &self,
        rec: &SandboxRecord,
        tag: &str,
        mount: &MountSpec,
        owner: (u32, u32),
    ) -> Result<f64, DaemonError> {
        let started = Instant::now();
        // The VMM sees the owner's files as the ids it runs with in its
        // jail, or as the owner's where it runs unjailed; the guest sees
        // them as its user's, and what the guest makes is the owner's.
        // A jailed VMM cannot reach the host's directory by path: it is
        // passed a detached idmapped mount of it (no mount in its jail).
        let (dir, ids) = match &self.cfg.jail {
            Some(_) => {
                let share = husk_jailer::Share {
                    path: PathBuf::from(&mount.host),
                    owner,
                    writable: !mount.readonly,
                };
                let tree = husk_jailer::share_tree(&share, (rec.uid, rec.uid))
                    .map_err(|e| DaemonError::Failed(e.to_string()))?;
                (Some(tree), (rec.uid, rec.uid))
            }
            None => (None, owner),
        };
        let tree_ms = started.elapsed().as_secs_f64() * 1000.0;
        // A root-owned directory (only ever read-only, see `check_mount`:
        // a pod's configMap or secret) shows its files as root's.
        let guest_owner = match owner.0 == 0 || owner.1 == 0 {
            true => (0, 0),
            false => GUEST_USER,
        };
        let mut spec = format!(
            "tag={tag},owner={}:{},guest-owner={}:{}",
            ids.0, ids.1, guest_owner.0, guest_owner.1
        );
        if dir.is_none() {
            spec.push_str(",path=");
            spec.push_str(&mount.host);
        }
        if mount.readonly {
            spec.push_str(",ro");
        }
        for pattern in &mount.hide {
            spec.push_str(",hide=");
            spec.push_str(pattern);
        }
        let request = husk_vmm_api::Request::Share { spec };
        match control_with_fd(&rec.run_dir, &request, dir.as_ref().map(|d| d.as_fd()))? {
            husk_vmm_api::Reply::Share { .. } => {}
            other => {
                return Err(DaemonError::Failed(format!(
                    "the VMM answered {other:?} to a share"
                )))
            }
        }
        let host_ms = started.elapsed().as_secs_f64() * 1000.0;
        tracing::debug!(sandbox = %rec.id, tag, tree_ms, vmm_ms = host_ms - tree_ms, "share served");
        Ok(host_ms)
    }
}

/// The patterns of the `.sandboxignore` at the top of host directory
/// `dir`, and that file's own name, if it has one: a pattern a line,
/// blank lines and `#` comments skipped. The file is hidden too, so that
/// no guest reads it or rewrites what later guests are kept from. Only a
/// regular file is read (never through a link: the daemon may read what
/// the directory's owner may not).
fn sandboxignore(dir: &Path) -> Result<Vec<String>, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(SANDBOXIGNORE);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&path);
    let file = match file {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(format!("its {SANDBOXIGNORE} is a symbolic link"))
        }
        Err(e) => return Err(format!("its {SANDBOXIGNORE}: {e}")),
    };
    let meta = file
        .metadata()
        .map_err(|e| format!("its {SANDBOXIGNORE}: {e}"))?;
    if !meta.is_file() {
        return Err(format!("its {SANDBOXIGNORE} is not a regular file"));
    }
    if meta.len() > SANDBOXIGNORE_MAX {
        return Err(format!(
            "its {SANDBOXIGNORE} has {} bytes, at most {SANDBOXIGNORE_MAX}",
            meta.len()
        ));
    }
    let mut text = String::new();
    file.take(SANDBOXIGNORE_MAX)
        .read_to_string(&mut text)
        .map_err(|e| format!("its {SANDBOXIGNORE}: {e}"))?;
    let mut patterns = vec![SANDBOXIGNORE.to_owned()];
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if line.starts_with('!') || line.contains(',') {
            return Err(format!(
                "line {} of its {SANDBOXIGNORE}, `{line}`: a pattern may not start with `!` \
                 (nothing hidden is shown again) nor have a comma",
                n + 1
            ));
        }
        patterns.push(line.to_owned());
    }
    Ok(patterns)
}

/// A failure to give `mount`, naming it.
fn naming(mount: &MountSpec, e: DaemonError) -> DaemonError {
    match e {
        DaemonError::Failed(why) => {
            DaemonError::Failed(format!("mount {} at {}: {why}", mount.host, mount.guest))
        }
        other => other,
    }
}

/// A mount as the audit log names it.
fn mount_detail(mount: &MountSpec) -> String {
    match &mount.volume {
        Some(volume) => format!("volume {volume} at {}", mount.guest),
        None => format!("{} at {}", mount.host, mount.guest),
    }
}

/// The shares sandbox `rec`'s guest has mounted (or is to mount).
pub(super) fn shares_of(rec: &SandboxRecord) -> Vec<Share> {
    rec.mounts
        .iter()
        .enumerate()
        .map(|(index, mount)| Share {
            // Records from before slots were kept had theirs in order.
            tag: fs_slot_id(rec.mount_slots.get(index).copied().unwrap_or(index as u8)),
            target: mount.guest.clone(),
            readonly: mount.readonly,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("husk-ignore-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    }

    #[test]
    fn a_sandboxignore_hides_its_patterns_and_itself() {
        let d = dir("plain");
        assert_eq!(sandboxignore(&d), Ok(Vec::new()));
        std::fs::write(d.join(SANDBOXIGNORE), "# secrets\n\n  *.pem \n.git/hooks\n")
            .expect("write");

        let patterns = sandboxignore(&d);

        std::fs::remove_dir_all(&d).expect("clean up");
        assert_eq!(
            patterns.expect("read"),
            [SANDBOXIGNORE, "*.pem", ".git/hooks"]
        );
    }

    #[test]
    fn a_sandboxignore_that_is_not_a_plain_short_list_is_refused() {
        let d = dir("bad");
        let at = d.join(SANDBOXIGNORE);
        std::os::unix::fs::symlink("/etc/hostname", &at).expect("symlink");
        let linked = sandboxignore(&d);
        std::fs::remove_file(&at).expect("unlink");
        std::fs::create_dir(&at).expect("mkdir");
        let a_dir = sandboxignore(&d);
        std::fs::remove_dir(&at).expect("rmdir");
        std::fs::write(&at, "ok\n!shown\n").expect("write");
        let negated = sandboxignore(&d);
        std::fs::write(&at, "a,b\n").expect("write");
        let comma = sandboxignore(&d);
        std::fs::write(&at, vec![b'x'; SANDBOXIGNORE_MAX as usize + 1]).expect("write");
        let big = sandboxignore(&d);
        std::fs::remove_dir_all(&d).expect("clean up");

        for (what, got, says) in [
            ("a link", linked, "symbolic link"),
            ("a directory", a_dir, "not a regular file"),
            ("a negation", negated, "line 2"),
            ("a comma", comma, "comma"),
            ("too long", big, "at most"),
        ] {
            let why = got.expect_err(what);
            assert!(why.contains(says), "{what}: {why}");
        }
    }
}
