//! Hibernation: a sandbox's memory (the pages it changed since its
//! template's snapshot), vCPU and device state written under its run
//! directory, its VMM gone and its memory freed; brought back by a wake,
//! which any use of the sandbox does first.
//!
//! A hibernation is a diff snapshot against the template's memory file,
//! taken without dirty tracking (the VMM reads which of its copy-on-write
//! pages are private copies), so its size is what the sandbox changed, and
//! a sandbox woken and hibernated again diffs against the template again:
//! only the last hibernation's memory is kept. Drive layers stay (each
//! hibernation's drive layer lies above the previous one's).

use std::os::unix::fs::FileTypeExt;

use super::*;

/// The refusal of a hibernation or snapshot that would pass the disk
/// budget.
fn over_budget(budget: u64, used: u64, needed: u64) -> String {
    format!(
        "hibernated sandboxes and sandboxes' snapshots may take {} MiB of disk \
         (husk serve --hibernated-disk-mib); {} MiB are taken{}: destroy or wake some \
         sandboxes, or delete snapshots, first (the sandbox is left as it was)",
        budget >> 20,
        used >> 20,
        match needed {
            0 => String::new(),
            n => format!(" and this one needs {} MiB", n.div_ceil(1 << 20)),
        }
    )
}

/// A hibernation's directory in the run directory: `hibernation-<ms>`.
const PREFIX: &str = "hibernation-";

/// Sandbox `id`'s hibernation or wake in progress: others of the same
/// sandbox wait for it; other sandboxes' go on.
pub(super) struct Change<'a> {
    daemon: &'a Daemon,
    id: String,
}

/// The key in the changes of a snapshot's reservation (no sandbox id has a
/// space).
const SNAPSHOT_KEY: &str = "snapshot ";

impl Drop for Change<'_> {
    fn drop(&mut self) {
        self.daemon.changes().remove(&self.id);
        self.daemon.changed.notify_all();
    }
}

impl Daemon {
    /// Hibernates a running or paused sandbox: its state goes to disk and
    /// its VMM exits. A hibernation that fails leaves the sandbox as it
    /// was.
    pub fn hibernate(&self, id: &str, who: &str) -> Result<SandboxInfo, DaemonError> {
        self.hibernate_unless_used(id, who, None)
    }

    /// Hibernates sandbox `id` for its idle policy: unless it was used
    /// in the last `idle` (checked again once it is paused, so that a
    /// request that came meanwhile is not cut).
    pub(super) fn hibernate_idle(&self, id: &str, idle: Duration) -> Result<(), DaemonError> {
        self.hibernate_unless_used(id, "idle", Some(idle)).map(drop)
    }

    fn hibernate_unless_used(
        &self,
        id: &str,
        who: &str,
        idle: Option<Duration>,
    ) -> Result<SandboxInfo, DaemonError> {
        let change = self.change(id);
        let started = Instant::now();
        let rec = self.record(id)?;
        super::media::refuse_with_media(&rec, "hibernated")?;
        let was_running = match rec.state {
            SandboxState::Running => true,
            SandboxState::Paused => false,
            other => {
                return Err(DaemonError::Conflict(format!(
                    "sandbox `{id}` is {}: only a running or paused sandbox hibernates",
                    other.name()
                )))
            }
        };
        self.reserve(&change, 0)?;
        // Paused first, so that nothing runs between its snapshot and the
        // end of its VMM.
        if was_running {
            control(&rec.run_dir, &husk_vmm_api::Request::Pause)?;
        }
        if let Some(idle) = idle {
            let used = self
                .lock()
                .sandboxes
                .get(id)
                .is_some_and(|l| l.activity.idle_for() < idle);
            if used {
                if was_running {
                    control(&rec.run_dir, &husk_vmm_api::Request::Resume)?;
                }
                return Err(DaemonError::Conflict(format!(
                    "sandbox `{id}` was used again: it stays"
                )));
            }
        }
        let dir = rec.run_dir.join(format!("{PREFIX}{}", now_unix_ms()));
        let written = control(
            &rec.run_dir,
            &husk_vmm_api::Request::Snapshot {
                dir: dir.clone(),
                diff: true,
                // Against the memory its restore mapped, always: a refused
                // hibernation's directory goes, and the next one must not
                // diff against it.
                keep_base: true,
            },
        )
        .and_then(|reply| match reply {
            husk_vmm_api::Reply::Snapshot { .. } => Ok(()),
            other => Err(DaemonError::Failed(format!(
                "the VMM refused the hibernation: {other:?}"
            ))),
        });
        // Within the disk budget, with what others took or are taking
        // meanwhile (its size is final: nothing below changes its files).
        let written = written.and_then(|()| {
            let bytes = disk_bytes(&dir);
            self.reserve(&change, bytes).map(|()| bytes)
        });
        let bytes = match written {
            Ok(bytes) => bytes,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                if was_running {
                    let _ = control(&rec.run_dir, &husk_vmm_api::Request::Resume);
                }
                return Err(e);
            }
        };
        // Its VMM goes; its memory with it.
        let live = {
            let mut inner = self.lock();
            inner.parked_agents.remove(id);
            inner.sandboxes.get_mut(id).map(|live| {
                live.idle.clear();
                live.gate = None;
                (live.child.take(), live.proxy.take())
            })
        };
        let Some((child, proxy)) = live else {
            // Destroyed meanwhile.
            return Err(DaemonError::NotFound(format!("no sandbox `{id}`")));
        };
        drop(proxy);
        match child {
            Some(mut child) => vmm_process::stop(&mut child),
            None => vmm_process::kill(rec.pid, rec.pid_start),
        }
        self.remove_cgroup(id);
        // What the next VMM makes anew (sockets, log, drive overlays: their
        // contents are in the hibernation's drive layers); the console's
        // lines and the earlier drive layers a drive may still read stay.
        clear_run_dir(&rec.run_dir, &dir);
        let rec = {
            let mut inner = self.lock();
            let Some(live) = inner.sandboxes.get_mut(id) else {
                return Err(DaemonError::NotFound(format!("no sandbox `{id}`")));
            };
            live.rec.state = SandboxState::Hibernated;
            live.rec.pid = 0;
            live.rec.pid_start = 0;
            live.rec.hibernation = Some(dir.clone());
            live.rec.hibernated_bytes = Some(bytes);
            live.rec.clone()
        };
        self.store.put_sandbox(&rec)?;
        self.store
            .audit(who, "hibernate", Some(id), None, &format!("{bytes} bytes"))?;
        tracing::info!(
            sandbox = %id,
            bytes,
            ms = started.elapsed().as_secs_f64() * 1000.0,
            "hibernated"
        );
        self.pool_wakeup.notify_all();
        self.sandbox(id)
    }

    /// Whether a hibernation or wake of sandbox `id` is in progress.
    pub(super) fn changing(&self, id: &str) -> bool {
        self.changes().contains_key(id)
    }

    /// Waits for sandbox `id`'s hibernation or wake in progress, if any.
    pub(super) fn wait_for_change(&self, id: &str) {
        drop(self.change(id));
    }

    /// The hibernations and wakes in progress.
    fn changes(&self) -> MutexGuard<'_, HashMap<String, Option<u64>>> {
        self.changing.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for sandbox `id`'s change in progress, if any, and starts
    /// its own.
    fn change(&self, id: &str) -> Change<'_> {
        let mut changes = self.changes();
        while changes.contains_key(id) {
            changes = self
                .changed
                .wait(changes)
                .unwrap_or_else(|e| e.into_inner());
        }
        changes.insert(id.to_owned(), None);
        Change {
            daemon: self,
            id: id.to_owned(),
        }
    }

    /// Counts `bytes` of hibernation (or snapshot) `change` against the
    /// host's limits: the number of hibernated sandboxes and the disk
    /// budget they share with the sandboxes' snapshots, with the changes in
    /// flight (one that ends is counted twice for a moment, never not at
    /// all).
    fn reserve(&self, change: &Change<'_>, bytes: u64) -> Result<(), DaemonError> {
        let mut changes = self.changes();
        let (asleep, recorded) = self
            .lock()
            .sandboxes
            .values()
            .filter(|l| l.rec.state == SandboxState::Hibernated)
            .fold((0, 0u64), |(n, b), l| {
                (n + 1, b + l.rec.hibernated_bytes.unwrap_or(0))
            });
        let others = changes
            .iter()
            .filter(|(id, _)| **id != change.id)
            .filter_map(|(id, b)| Some((id, (*b)?)));
        let in_flight = others
            .clone()
            .filter(|(id, _)| !id.starts_with(SNAPSHOT_KEY))
            .count();
        let used = recorded + self.snapshot_bytes()? + others.map(|(_, b)| b).sum::<u64>();
        let budget = self.cfg.max_hibernated_bytes;
        if bytes == 0 && asleep + in_flight >= self.cfg.max_hibernated as usize {
            return Err(DaemonError::Limit(format!(
                "the host holds its maximum of {} hibernated sandboxes \
                 (husk serve --max-hibernated): destroy some first",
                self.cfg.max_hibernated
            )));
        }
        if used.saturating_add(bytes.max(1)) > budget {
            return Err(DaemonError::Limit(over_budget(budget, used, bytes)));
        }
        changes.insert(change.id.to_owned(), Some(bytes));
        Ok(())
    }

    /// The disk the templates made from sandboxes take (snapshots and
    /// forks' templates): they share the hibernations' budget.
    fn snapshot_bytes(&self) -> Result<u64, DaemonError> {
        Ok(self
            .store
            .templates()?
            .iter()
            .filter(|t| t.source.starts_with(template::FROM_SANDBOX))
            .map(|t| disk_bytes(&t.snapshot_dir))
            .sum())
    }

    /// Holds `bound` bytes of the disk budget for a snapshot of sandbox
    /// `id` about to be written (its memory's size: a snapshot takes no
    /// more), until the change is dropped; refused past the budget before
    /// anything is written (a snapshot written and then removed would
    /// leave the VMM diffing against it).
    pub(super) fn reserve_snapshot(&self, id: &str, bound: u64) -> Result<Change<'_>, DaemonError> {
        let change = self.change(&format!("{SNAPSHOT_KEY}{id}"));
        self.reserve(&change, bound.max(1))?;
        Ok(change)
    }

    /// Wakes a hibernated sandbox (a running one is left as it is).
    pub fn wake(&self, id: &str, who: &str) -> Result<SandboxInfo, DaemonError> {
        self.wake_if_hibernated(id, who)?;
        self.sandbox(id)
    }

    /// Wakes sandbox `id` if it is hibernated; whether it was. Same id,
    /// hostname, network and files; its clock is set by the next request;
    /// a wake that cannot happen marks it failed with the reason.
    pub(super) fn wake_if_hibernated(&self, id: &str, who: &str) -> Result<bool, DaemonError> {
        // On every request's path: a look, no copy.
        let hibernated = self
            .lock()
            .sandboxes
            .get(id)
            .is_some_and(|l| l.rec.state == SandboxState::Hibernated);
        if !hibernated {
            return Ok(false);
        }
        let _change = self.change(id);
        // Woken (or destroyed) while this call waited.
        let rec = self.record(id)?;
        if rec.state != SandboxState::Hibernated {
            return Ok(false);
        }
        // A restore like a create's: a client waits for it.
        let _slot = self.slots.acquire(Priority::Normal);
        let started = Instant::now();
        match self.bring_back(&rec) {
            Ok(()) => {
                let ms = started.elapsed().as_secs_f64() * 1000.0;
                tracing::info!(sandbox = %id, ms, "woke");
                self.store
                    .audit(who, "wake", Some(id), None, &format!("{ms:.1} ms"))?;
                Ok(true)
            }
            // No room for it now, or destroyed meanwhile: it is as it was.
            Err(e @ (DaemonError::Limit(_) | DaemonError::NotFound(_))) => Err(e),
            Err(e) => {
                let why = format!("its wake failed: {e}");
                if let Some(mut child) = self
                    .lock()
                    .sandboxes
                    .get_mut(id)
                    .and_then(|l| l.child.take())
                {
                    vmm_process::stop(&mut child);
                }
                self.remove_cgroup(id);
                self.mark_failed(id, &why, "wake");
                Err(DaemonError::Failed(why))
            }
        }
    }

    /// Restores `rec`'s last hibernation in a new VMM and waits for its
    /// agent.
    fn bring_back(&self, rec: &SandboxRecord) -> Result<(), DaemonError> {
        let dir = rec
            .hibernation
            .clone()
            .ok_or_else(|| DaemonError::Failed("it has no hibernation on record".into()))?;
        for file in ["state", "memory"] {
            if !dir.join(file).is_file() {
                return Err(DaemonError::Failed(format!(
                    "{} is missing",
                    dir.join(file).display()
                )));
            }
        }
        let t = self.store.template(&rec.template)?.ok_or_else(|| {
            DaemonError::Failed(format!("its template `{}` is gone", rec.template))
        })?;
        let room = self.make_room(&t)?;
        let cgroup = match &self.cfg.cgroups {
            Some(h) => Some(
                Cgroup::create(h, &rec.id, Limits::for_vm(t.vcpus, t.mem_mib))
                    .map_err(|e| DaemonError::Failed(e.to_string()))?,
            ),
            None => None,
        };
        let nic = match (&rec.tap, &rec.mac) {
            (Some(tap), Some(mac)) => Some(vmm_process::Nic::known(tap, mac)?),
            _ => None,
        };
        let jailing = self.cfg.jail.as_ref().map(|j| vmm_process::Jailing {
            jailer: j.jailer.clone(),
            // Its own uid, kept while it slept: its files are that uid's.
            uid: rec.uid,
            reads: t
                .reads
                .iter()
                .cloned()
                .chain([t.snapshot_dir.clone()])
                .collect(),
        });
        let child = vmm_process::spawn(&vmm_process::VmSpawn {
            vmm: &self.cfg.vmm,
            id: &rec.id,
            run_dir: &rec.run_dir,
            launch: &Launch::Restore {
                snapshot: dir.clone(),
                verify: true,
            },
            cgroup: cgroup.as_ref(),
            nic: nic.as_ref(),
            jail: jailing.as_ref(),
            limits: (t.block_limit.as_deref(), t.net_limit.as_deref()),
        })
        .map_err(|e| {
            DaemonError::Failed(format!("cannot start {}: {e}", self.cfg.vmm.display()))
        })?;
        let pid = child.id();
        let woken = {
            let mut inner = self.lock();
            match inner.sandboxes.get_mut(&rec.id) {
                Some(live) => {
                    live.child = Some(child);
                    live.rec.pid = pid;
                    live.rec.pid_start = vmm_process::start_time(pid).unwrap_or(0);
                    Ok(live.rec.clone())
                }
                None => Err(child),
            }
        };
        let woken = match woken {
            Ok(woken) => woken,
            // Destroyed while it woke: the VMM just started goes too.
            Err(mut child) => {
                vmm_process::stop(&mut child);
                self.remove_cgroup(&rec.id);
                return Err(DaemonError::NotFound(format!("no sandbox `{}`", rec.id)));
            }
        };
        // It counts itself now.
        drop(room);
        let client = self.bring_up(&woken, nic.map(|n| n.mac)).map_err(|e| {
            DaemonError::Failed(format!(
                "{e}\n{}",
                vmm_process::last_words(
                    &rec.run_dir.join(vmm_process::LOG),
                    &rec.run_dir.join(vmm_process::CONSOLE),
                    10
                )
            ))
        })?;
        let running = {
            let mut inner = self.lock();
            let live = inner
                .sandboxes
                .get_mut(&rec.id)
                .ok_or_else(|| DaemonError::NotFound(format!("no sandbox `{}`", rec.id)))?;
            live.rec.state = SandboxState::Running;
            live.rec.hibernated_bytes = None;
            // A fresh idle period.
            live.activity.touch();
            // Its clock stood still while it slept.
            live.gate = Some(Gate::clock());
            live.idle.push(client);
            live.rec.clone()
        };
        self.store.put_sandbox(&running)?;
        if let Err(e) = self.start_proxy(&running) {
            tracing::error!(sandbox = %rec.id, "its egress proxy did not start again: {e}");
        }
        Ok(())
    }
}

/// Removes what a VMM leaves in its run directory but the console and the
/// hibernations' drive layers; of hibernations before `current`, only
/// their drive layers stay (its own drive layers may lie above them).
fn clear_run_dir(run_dir: &Path, current: &Path) {
    let Ok(entries) = std::fs::read_dir(run_dir) else {
        return;
    };
    let mut layered = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path == current || name == vmm_process::CONSOLE {
            continue;
        }
        if let Some(made) = name.strip_prefix(PREFIX).filter(|_| path.is_dir()) {
            for file in ["state", "memory"] {
                let _ = std::fs::remove_file(path.join(file));
            }
            // Gone whole if it held no drive layer.
            if std::fs::remove_dir(&path).is_err() {
                layered.push((made.parse::<u64>().unwrap_or(0), path));
            }
            continue;
        }
        if path.is_file() || entry.file_type().is_ok_and(|t| t.is_socket()) {
            let _ = std::fs::remove_file(&path);
        }
    }
    // A drive's snapshot stacks at most MAX_DRIVE_LAYERS layers (more are
    // merged into one, in the newest hibernation): older ones are no one's.
    layered.sort();
    let unused = layered.len().saturating_sub(husk_vmm_api::MAX_DRIVE_LAYERS);
    for (_, path) in layered.into_iter().take(unused) {
        let _ = std::fs::remove_dir_all(&path);
    }
}

/// The bytes `dir`'s files take on disk (their allocated blocks: a memory
/// diff is a sparse file).
fn disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.blocks() * 512)
                .sum()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_hibernations_whose_layers_a_drive_may_stack_are_kept() {
        let run_dir = std::env::temp_dir().join(format!("husk-hib-test-{}", std::process::id()));
        std::fs::create_dir_all(&run_dir).expect("run dir");
        for made in 1..=19u64 {
            let dir = run_dir.join(format!("{PREFIX}{made}"));
            std::fs::create_dir_all(&dir).expect("hibernation");
            std::fs::write(dir.join("state"), b"s").expect("state");
            // All but one wrote a drive layer.
            if made != 16 {
                std::fs::write(dir.join("drive-0"), b"l").expect("layer");
            }
        }
        std::fs::write(run_dir.join("vsock"), b"").expect("socket stand-in");
        let current = run_dir.join(format!("{PREFIX}20"));
        std::fs::create_dir_all(&current).expect("current");

        clear_run_dir(&run_dir, &current);

        let mut left: Vec<String> = std::fs::read_dir(&run_dir)
            .expect("run dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort_by_key(|n| n.strip_prefix(PREFIX).and_then(|m| m.parse::<u64>().ok()));
        let _ = std::fs::remove_dir_all(&run_dir);
        // The eight newest with a layer stay (without their state), and
        // the current one; the rest go.
        assert_eq!(
            left,
            [11, 12, 13, 14, 15, 17, 18, 19, 20].map(|m| format!("{PREFIX}{m}"))
        );
    }
}
