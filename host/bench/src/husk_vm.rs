//! husk's cold boot and snapshot restore, run straight on `husk-vmm` with
//! its timeline: host phases from the VMM's own clock (from its `main`),
//! guest phases from the marks it sets as the guest reaches them (the vsock
//! transport reset handled, the first connection accepted, the first
//! reply), and the agent's answer and the first exec output as the bench
//! sees them.
//!
//! A cold boot's guest phases are the kernel's boot until guest-init's
//! `main` (`kernel_init`, counted back from its readiness line), then
//! guest-init's start until its agent accepts (`connection_accepted`; the
//! bench retries a refused connection within half a second). The readiness
//! line itself comes around the agent's first connection, before or after
//! it (the egress proxy starts in between, and each console byte is a VM
//! exit), so it is no phase boundary: it is the cold boot's endpoint shared
//! with QEMU and Firecracker.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use husk_protocol::{ExecRequest, Stream};

use super::report::{Memory, Sample, Side};
use super::{monotonic_ns, BenchConfig, BenchError};
use husk_agent_client::readiness::WaitBudget;
use husk_agent_client::{AgentClient, ClientError};

/// The guest's CID (any valid one: each VMM has its own socket).
pub(super) const CID: u32 = 3;
/// The program whose first output ends a run.
pub(super) const PROGRAM: [&str; 3] = ["/bin/busybox", "echo", "husk-bench"];
/// How long one request to a guest that answered may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// A `husk-vmm` the bench started: killed when dropped, unless stopped.
#[derive(Debug)]
pub struct Vmm {
    child: Child,
    /// CLOCK_MONOTONIC just before the spawn.
    spawned_ns: u64,
    pub uds: PathBuf,
    pub api: PathBuf,
    timeline: PathBuf,
}

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Vmm {
    /// Boots the guest (`snapshot` None) or restores `snapshot`, with its
    /// files under `dir/name.*`.
    pub fn spawn(
        config: &BenchConfig,
        dir: &Path,
        name: &str,
        snapshot: Option<&Path>,
    ) -> Result<Vmm, BenchError> {
        let file = |ext: &str| dir.join(format!("{name}.{ext}"));
        let (uds, api, timeline) = (file("vsock"), file("api"), file("timeline.json"));
        let mut cmd = Command::new(&config.vmm);
        match snapshot {
            None => {
                cmd.arg("--kernel")
                    .arg(&config.kernel)
                    .arg("--initramfs")
                    .arg(&config.initramfs)
                    .args(["--mem-mib", &config.mem_mib.to_string()])
                    .args(["--vcpus", &config.vcpus.to_string()]);
            }
            Some(snapshot) => {
                cmd.arg("--restore").arg(snapshot);
            }
        }
        cmd.args(["--id", name])
            .arg("--vsock")
            .arg(format!("cid={CID},path={}", uds.display()))
            .arg("--api-sock")
            .arg(&api)
            .arg("--serial")
            .arg(file("console"))
            .arg("--timeline")
            .arg(&timeline)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(file("log")).map_err(BenchError::Io)?);
        let spawned_ns = monotonic_ns();
        let child = cmd
            .spawn()
            .map_err(|e| BenchError::Spawn(config.vmm.clone(), e))?;
        Ok(Vmm {
            child,
            spawned_ns,
            uds,
            api,
            timeline,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// CLOCK_MONOTONIC just before the spawn.
    pub fn spawned_ns(&self) -> u64 {
        self.spawned_ns
    }

    /// Waits for the agent, within `budget` (stretched by the host's load).
    pub fn connect(&mut self, budget: Duration) -> Result<AgentClient, String> {
        connect_agent(&self.uds, &mut self.child, "husk-vmm", budget)
    }

    /// Ends the VMM (SIGTERM: it writes its timeline) and returns the
    /// timeline's phases as CLOCK_MONOTONIC points.
    pub fn stop(mut self) -> Result<Timeline, String> {
        // SAFETY: signalling our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().ok().flatten().is_none() {
            if Instant::now() > deadline {
                return Err("husk-vmm did not stop within 30 s of SIGTERM".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let text = std::fs::read_to_string(&self.timeline)
            .map_err(|e| format!("no timeline {}: {e}", self.timeline.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("timeline JSON: {e}"))?;
        let main_ns = json["main_monotonic_ns"]
            .as_u64()
            .ok_or("the timeline has no main_monotonic_ns")?;
        Ok(Timeline {
            main_ns,
            phases_us: json["phases_us"].clone(),
        })
    }
}

/// husk-vmm's timeline of one run.
#[derive(Debug)]
pub struct Timeline {
    main_ns: u64,
    phases_us: serde_json::Value,
}

impl Timeline {
    /// When `phase` ended, on CLOCK_MONOTONIC.
    fn at(&self, phase: &str) -> Option<u64> {
        self.phases_us[phase]
            .as_u64()
            .map(|us| self.main_ns + us * 1000)
    }
}

/// Waits for the agent behind the vsock socket `uds` of VMM process
/// `vmm` (`name` in errors), within `budget` (stretched by the host's
/// load); a VMM that exits ends the wait.
pub(super) fn connect_agent(
    uds: &Path,
    vmm: &mut Child,
    name: &str,
    budget: Duration,
) -> Result<AgentClient, String> {
    let mut alive = || match vmm.try_wait() {
        Ok(Some(status)) => Err(ClientError::VmmGone(format!("{name} exited: {status}"))),
        _ => Ok(()),
    };
    AgentClient::connect_patiently(
        uds,
        &mut WaitBudget::new(budget),
        &mut alive,
        REQUEST_TIMEOUT,
    )
    .map_err(|e| format!("the agent did not answer: {e}"))
}

/// What the bench saw of the guest once it answered.
#[derive(Debug)]
pub struct Answered {
    answered_ns: u64,
    output_ns: u64,
    pub memory: Option<Memory>,
}

/// Waits for the agent and runs the program; the connection is returned
/// for further questions.
pub fn answer(vmm: &mut Vmm, budget: Duration) -> Result<(Answered, AgentClient), String> {
    let mut client = vmm.connect(budget)?;
    let answered_ns = monotonic_ns();
    let output_ns = first_output(&mut client)?;
    let answered = Answered {
        answered_ns,
        output_ns,
        memory: Memory::of(vmm.pid()),
    };
    Ok((answered, client))
}

/// Runs the bench's program through the agent: when its first output came.
pub(super) fn first_output(client: &mut AgentClient) -> Result<u64, String> {
    let mut output_ns = None;
    let request = ExecRequest {
        argv: PROGRAM.map(String::from).to_vec(),
        ..Default::default()
    };
    let report = client
        .exec_streaming(request, |stream, _| {
            if stream == Stream::Stdout && output_ns.is_none() {
                output_ns = Some(monotonic_ns());
            }
        })
        .map_err(|e| format!("exec: {e}"))?;
    output_ns.ok_or(format!("the program wrote nothing ({report:?})"))
}

/// The guest's clock minus the host's, in ms.
pub fn clock_offset_ms(client: &mut AgentClient) -> Option<f64> {
    let health = client.health().ok()?;
    let host = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_nanos() as i64;
    Some((health.unix_ns - host) as f64 / 1e6)
}

/// The guest's clocksource.
pub fn clocksource(client: &mut AgentClient) -> Option<String> {
    let mut text = Vec::new();
    client
        .read_file(
            "/sys/devices/system/clocksource/clocksource0/current_clocksource",
            &mut text,
        )
        .ok()?;
    Some(String::from_utf8_lossy(&text).trim().to_owned())
}

/// One run's phases, from the spawn to the first exec output; `restore`:
/// the snapshot's age (s) and the guest clock's offset (ms).
pub fn sample(
    iteration: usize,
    spawned_ns: u64,
    answered: &Answered,
    timeline: &Timeline,
    restore: Option<(f64, Option<f64>)>,
) -> Sample {
    let t = |p: &str| timeline.at(p);
    let points = [
        ("process_start", Side::Host, Some(timeline.main_ns)),
        ("vmm_setup", Side::Host, t("filters_ready")),
        ("state_load", Side::Host, t("state_loaded")),
        ("vm_create", Side::Host, t("vm_created")),
        ("memory", Side::Host, t("memory_ready")),
        ("kernel_load", Side::Host, t("kernel_loaded")),
        ("devices", Side::Host, t("devices_ready")),
        ("vcpus", Side::Host, t("vcpus_ready")),
        ("to_first_kvm_run", Side::Host, t("first_kvm_run")),
        // A cold boot only: the kernel's boot until guest-init starts.
        // guest-init's readiness line is no boundary: it may come before or
        // after the agent accepts (see the module's note).
        ("kernel_init", Side::Guest, t("init_started")),
        ("vsock_reset_handled", Side::Guest, t("vsock_reset_handled")),
        ("connection_accepted", Side::Guest, t("vsock_connected")),
        ("first_reply", Side::Guest, t("vsock_first_reply")),
        ("agent_answering", Side::Guest, Some(answered.answered_ns)),
        ("first_exec_output", Side::Guest, Some(answered.output_ns)),
    ];
    // What QEMU can be timed to as well (see report::endpoint).
    let endpoint = if restore.is_some() {
        t("first_kvm_run")
    } else {
        t("guest_ready")
    };
    Sample {
        snapshot_age_s: restore.map(|(age, _)| age),
        guest_clock_offset_ms: restore.and_then(|(_, offset)| offset),
        comparable_ms: endpoint.map(|e| e.saturating_sub(spawned_ns) as f64 / 1e6),
        ..Sample::from_points(iteration, spawned_ns, &points, answered.memory)
    }
}
