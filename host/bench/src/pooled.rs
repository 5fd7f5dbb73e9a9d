//! The pooled path, through the daemon as a user meets it: a private
//! `husk serve` builds a template of the same guest and keeps a warm pool
//! of one clone; each run is `POST /v1/sandboxes` (a claim: the clone is
//! resumed; it got its identity when it was parked, and its clock is set
//! ahead of the first request) and an exec through the API to the
//! program's first output. The sandbox is then destroyed and the pool
//! refilled before the next run, so every run is a pool hit.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::density;
use super::report::{Memory, Parked, Sample, Side};
use super::{monotonic_ns, BenchConfig, BenchError};
use husk_client::{ApiClient, Endpoint};
use husk_types::{CreateRequest, ExecEvent, ExecSpec, TemplateSpec};

/// The template's name in the private daemon.
const TEMPLATE: &str = "bench";

/// A private daemon, stopped (with its sandboxes) when dropped.
#[derive(Debug)]
pub struct Daemon {
    child: Child,
    api: ApiClient,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.api.set_pool(TEMPLATE, 0);
        // SAFETY: signalling our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `husk serve` in `state_dir`, answering on its socket.
pub fn start(
    config: &BenchConfig,
    husk: &Path,
    state_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<Daemon, BenchError> {
    let socket = state_dir.join("husk.sock");
    let log = std::fs::File::create(state_dir.with_extension("log")).map_err(BenchError::Io)?;
    let child = Command::new(husk)
        .arg("serve")
        .arg("--state-dir")
        .arg(state_dir)
        .arg("--kernel")
        .arg(&config.kernel)
        .arg("--initramfs")
        .arg(&config.initramfs)
        .arg("--vmm")
        .arg(&config.vmm)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| BenchError::Spawn(husk.to_owned(), e))?;
    let daemon = Daemon {
        child,
        api: ApiClient::new(Endpoint::Unix(socket)),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut backoff = Duration::from_millis(5);
    while daemon.api.templates().is_err() {
        if Instant::now() > deadline {
            return Err(BenchError::Daemon(
                "husk serve did not answer within 60 s".into(),
            ));
        }
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
    progress("pooled: building the daemon's template (one cold boot and a snapshot)");
    let spec = TemplateSpec {
        vcpus: config.vcpus,
        mem_mib: config.mem_mib,
        ..TemplateSpec::new(TEMPLATE)
    };
    let failed = |e: husk_client::ApiClientError| BenchError::Daemon(e.to_string());
    daemon
        .api
        .build_template(&spec)
        .and_then(|build| build.finish(|message| progress(&format!("pooled: {message}"))))
        .map_err(failed)?;
    daemon.api.set_pool(TEMPLATE, 1).map_err(failed)?;
    Ok(daemon)
}

impl Daemon {
    /// Waits until the pool holds a parked clone.
    fn wait_pool(&self, budget: Duration) -> Result<(), String> {
        let deadline = Instant::now() + budget;
        loop {
            let pools = self.api.pools().map_err(|e| e.to_string())?;
            if pools
                .iter()
                .any(|p| p.template_name == TEMPLATE && p.ready > 0)
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("the pool had no clone ready after {budget:?}"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Parks `n` clones in the pool at once and measures what each costs
    /// the host (see [`density`](super::density)); the pool is back to one
    /// after.
    pub fn park(&self, n: usize, budget: Duration) -> Result<Parked, String> {
        let failed = |e: husk_client::ApiClientError| e.to_string();
        self.api.set_pool(TEMPLATE, 0).map_err(failed)?;
        let result = self.wait_parked(0, budget).and_then(|()| {
            let before = density::before()?;
            let since = Instant::now();
            self.api
                .set_pool(TEMPLATE, u32::try_from(n).unwrap_or(u32::MAX))
                .map_err(failed)?;
            self.wait_parked(n, budget)?;
            density::measure(self.child.id(), n, before, since)
        });
        self.api.set_pool(TEMPLATE, 1).map_err(failed)?;
        result
    }

    /// Waits until exactly `n` clones are parked and none is restoring.
    fn wait_parked(&self, n: usize, budget: Duration) -> Result<(), String> {
        let deadline = Instant::now() + budget;
        loop {
            let vmms = density::vmms_below(self.child.id()).len();
            let ready = self
                .api
                .pools()
                .map_err(|e| e.to_string())?
                .iter()
                .find(|p| p.template_name == TEMPLATE)
                .map_or(0, |p| p.ready as usize);
            if ready == n && vmms == n {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the pool had {ready} clones parked ({vmms} VMMs) for {n} after {budget:?}"
                ));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// One pooled create and exec; the sandbox is destroyed after.
    pub fn run(&self, iteration: usize, budget: Duration) -> Result<Sample, String> {
        self.wait_pool(budget)?;
        let started_ns = monotonic_ns();
        let created = self
            .api
            .create_sandbox(&CreateRequest {
                template: TEMPLATE.into(),
                ..Default::default()
            })
            .map_err(|e| format!("create: {e}"))?;
        let created_ns = monotonic_ns();
        let id = created.sandbox.id.clone();
        let result = self.first_output(&id).map(|output_ns| {
            let vmm = vmm_process(created.sandbox.pid);
            (output_ns, vmm.and_then(Memory::of))
        });
        let _ = self.api.destroy_sandbox(&id);
        let (output_ns, memory) = result?;
        if !created.pooled {
            return Err("a pool miss: the daemon restored a clone instead of claiming one".into());
        }
        let points = [
            // Host work only: the clone's vCPUs resumed, no guest round
            // trip (its clock is set ahead of the exec).
            ("claim_and_resume", Side::Host, Some(created_ns)),
            ("first_exec_output", Side::Guest, Some(output_ns)),
        ];
        Ok(Sample::from_points(iteration, started_ns, &points, memory))
    }

    /// Runs the program through the API; when its first output came.
    fn first_output(&self, id: &str) -> Result<u64, String> {
        let spec = ExecSpec {
            argv: super::husk_vm::PROGRAM.map(String::from).to_vec(),
            ..Default::default()
        };
        let mut events = self.api.exec(id, &spec).map_err(|e| format!("exec: {e}"))?;
        let mut first = None;
        while let Some(event) = events.next_event().map_err(|e| e.to_string())? {
            match event {
                ExecEvent::Stdout { .. } if first.is_none() => first = Some(monotonic_ns()),
                ExecEvent::Exit { .. } => break,
                ExecEvent::Error { error, .. } => return Err(format!("exec: {error}")),
                _ => {}
            }
        }
        first.ok_or_else(|| "the program wrote nothing".to_owned())
    }
}

/// The husk-vmm process at or below `pid` (a jailed sandbox's pid is its
/// jailer's, and the VMM runs as its child).
fn vmm_process(pid: u32) -> Option<u32> {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    if comm.trim() == "husk-vmm" {
        return Some(pid);
    }
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
    children
        .split_whitespace()
        .filter_map(|c| c.parse().ok())
        .find_map(vmm_process)
}

/// The daemon's state directory under the bench's work directory.
pub fn state_dir(work_dir: &Path) -> PathBuf {
    work_dir.join("daemon")
}
