//! Memory back from idle sandboxes. A running guest reports the blocks of
//! memory it frees through its balloon, and the VMM drops them (issue 40);
//! what a guest keeps without needing it, its page cache, and free memory
//! scattered among pages in use, are never reported. A sandbox nobody has
//! used for `--reclaim-idle-s` is asked once per idle period to drop its
//! clean page cache and compact its free memory (the agent's `Reclaim`),
//! after which free page reporting hands the host what was freed.
//!
//! The request is not a use of the sandbox: its idle policy's clock runs
//! on, and a connection it takes from the idle ones goes back to them.
//! One worker asks one sandbox at a time, so a host whose sandboxes all go
//! idle at once is not handed all their compactions at once.

use super::*;

/// How long a guest may take to drop its cache and compact (an emulated
/// guest compacting a few hundred MiB takes seconds).
const RECLAIM_WAIT: Duration = Duration::from_secs(120);

impl Daemon {
    /// Starts a worker that asks each running sandbox idle for
    /// `--reclaim-idle-s`, and not asked since its last use, to give
    /// memory back, unless one is at work.
    pub(super) fn reclaim_idle(self: &Arc<Self>) {
        let Some(after) = self.cfg.reclaim_idle else {
            return;
        };
        if self.reclaiming.swap(true, Ordering::SeqCst) {
            return;
        }
        let due: Vec<(String, PathBuf, Option<AgentClient>)> = {
            let mut inner = self.lock();
            inner
                .sandboxes
                .values_mut()
                // A gate not yet opened has shares to mount first.
                .filter(|l| l.rec.state == SandboxState::Running)
                .filter(|l| l.gate.as_ref().is_none_or(|g| g.is_set()))
                .filter_map(|l| {
                    let last = l.activity.last();
                    if l.activity.idle_for() < after || l.reclaimed == Some(last) {
                        return None;
                    }
                    l.reclaimed = Some(last);
                    Some((l.rec.id.clone(), l.rec.run_dir.clone(), l.kept_connection()))
                })
                .collect()
        };
        if due.is_empty() {
            self.reclaiming.store(false, Ordering::SeqCst);
            return;
        }
        let d = self.clone();
        let spawned = std::thread::Builder::new()
            .name("reclaim".into())
            .spawn(move || {
                for (id, run_dir, kept) in due {
                    if d.stopping.load(Ordering::SeqCst) {
                        break;
                    }
                    // Hibernating (paused for it) or waking: asked again
                    // after its next use.
                    if !d.changing(&id) {
                        d.reclaim(&id, &run_dir, kept);
                    }
                }
                d.reclaiming.store(false, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            tracing::error!("cannot start reclaiming idle sandboxes' memory: {e}");
            self.reclaiming.store(false, Ordering::SeqCst);
        }
    }

    /// One sandbox's `Reclaim`, on `kept` or a new connection of its own
    /// (no lease: not a use), given back to its idle ones after.
    fn reclaim(&self, id: &str, run_dir: &Path, kept: Option<AgentClient>) {
        let started = Instant::now();
        let client = match kept {
            Some(c) => Ok(c),
            None => AgentClient::connect(&run_dir.join(vmm_process::VSOCK), AGENT_TIMEOUT),
        };
        let result = client.and_then(|mut c| {
            c.set_read_timeout(Some(RECLAIM_WAIT))?;
            let freed = c.reclaim()?;
            Ok((c, freed))
        });
        match result {
            Ok((client, (before, after))) => {
                self.give_back(id, client);
                self.metrics.idle_reclaim();
                tracing::info!(
                    sandbox = %id,
                    free_before_kib = before,
                    free_after_kib = after,
                    ms = started.elapsed().as_millis() as u64,
                    "idle: memory reclaimed"
                );
            }
            // Paused, hibernated or destroyed meanwhile, or a guest whose
            // agent predates `Reclaim`: asked again after its next use.
            Err(e) => tracing::debug!(sandbox = %id, "idle reclaim: {e}"),
        }
    }
}
