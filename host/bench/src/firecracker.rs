//! The same guest under Firecracker, when the user points `husk bench` at a
//! `firecracker` binary: the same kernel, initramfs and command line, the
//! same size. A cold boot is configured through Firecracker's API (boot
//! source, machine, vsock) and started with `InstanceStart`; the first cold
//! boot is then paused and snapshotted (`PUT /snapshot/create`, Full), and
//! a restore is a fresh process given `PUT /snapshot/load` with
//! `resume_vm`.
//!
//! Firecracker's vsock is a Unix socket that speaks the same `CONNECT
//! <port>` protocol as husk-vmm's, so the bench reaches the same guest agent
//! and runs the same exec as for husk: both runs end at the program's first
//! output, and a restore reports the guest clock's offset as husk's does.
//!
//! Written to Firecracker's documented API (v1.x; `mem_backend` needs
//! v1.1 or later). A snapshot names its vsock socket, and older
//! Firecrackers cannot be told another at load, so every run uses one
//! socket path and runs one at a time.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::husk_vm;
use super::report::{Memory, Sample, Side};
use super::{monotonic_ns, watch_console, BenchConfig};
use husk_agent_client::AgentClient;
use husk_client::{ApiClient, ApiClientError, Endpoint, Payload};

/// Where a Firecracker built from source is kept beside a husk checkout:
/// `../shared/peers/firecracker`, from the current directory or from the
/// checkout `husk` was built in (`<checkout>/target/<profile>/husk`).
pub fn default_binary() -> Option<PathBuf> {
    const PEER: &str = "../shared/peers/firecracker";
    let from_exe = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.parent()?.join(PEER)));
    [Some(PathBuf::from(PEER)), from_exe]
        .into_iter()
        .flatten()
        .find(|p| p.is_file())
}

/// The Firecracker binary the user gave (else [`default_binary`]), or why
/// it is skipped: it must answer `--version` with a Firecracker version
/// line.
pub fn probe(binary: Option<&Path>) -> Result<PathBuf, String> {
    let Some(binary) = binary.map(Path::to_path_buf).or_else(default_binary) else {
        return Err(
            "no Firecracker binary given (--firecracker PATH or HUSK_FIRECRACKER) or found at \
             ../shared/peers/firecracker (Firecracker is not packaged for Debian)"
                .into(),
        );
    };
    let out = Command::new(&binary)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{} cannot be run ({e})", binary.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    match text.lines().next() {
        Some(line) if out.status.success() && line.starts_with("Firecracker v") => Ok(binary),
        _ => Err(format!(
            "{} is not Firecracker (`--version` said {:?}, {})",
            binary.display(),
            text.lines().next().unwrap_or(""),
            out.status
        )),
    }
}

/// The request bodies of a cold boot, in order: what Firecracker is told.
pub fn boot_requests(config: &BenchConfig, uds: &Path) -> [(&'static str, Value); 3] {
    let cmdline = husk_vmm_api::cmdline::guest_cmdline();
    [
        (
            "/boot-source",
            json!({
                "kernel_image_path": config.kernel,
                "initrd_path": config.initramfs,
                "boot_args": cmdline,
            }),
        ),
        (
            "/machine-config",
            json!({ "vcpu_count": config.vcpus, "mem_size_mib": config.mem_mib }),
        ),
        // husk's CID (Firecracker wants 3 or more).
        (
            "/vsock",
            json!({ "guest_cid": husk_vm::CID, "uds_path": uds }),
        ),
    ]
}

/// The files of the Firecracker runs, in one directory.
struct Files {
    /// The vsock socket every run uses (see the module's note).
    uds: PathBuf,
    state: PathBuf,
    memory: PathBuf,
}

impl Files {
    fn new(config: &BenchConfig) -> Files {
        let dir = &config.work_dir;
        Files {
            uds: dir.join("fc.vsock"),
            state: dir.join("fc.snapshot"),
            memory: dir.join("fc.memory"),
        }
    }
}

/// A Firecracker process, killed when dropped.
struct Firecracker {
    child: Child,
    api_sock: PathBuf,
    api: ApiClient,
    log: PathBuf,
    spawned_ns: u64,
    /// When the console showed the readiness line.
    ready: mpsc::Receiver<u64>,
}

impl Drop for Firecracker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.api_sock);
    }
}

impl Firecracker {
    /// Starts `binary` with its API on a socket of its own; the console
    /// (Firecracker's stdout) is watched for the readiness line and kept in
    /// the run's log with Firecracker's stderr.
    fn spawn(binary: &Path, config: &BenchConfig, name: &str, uds: &Path) -> Result<Self, String> {
        let api_sock = config.work_dir.join(format!("{name}.api"));
        let log = config.work_dir.join(format!("{name}.log"));
        // Firecracker binds its sockets and refuses paths that exist.
        for stale in [api_sock.as_path(), uds] {
            let _ = std::fs::remove_file(stale);
        }
        let stderr = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let spawned_ns = monotonic_ns();
        let mut child = Command::new(binary)
            .arg("--api-sock")
            .arg(&api_sock)
            .args(["--id", name])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", binary.display()))?;
        let (tx, ready) = mpsc::channel();
        if let Some(console) = child.stdout.take() {
            let console_log = log.with_extension("console");
            std::thread::spawn(move || watch_console(console, Some(&console_log), &tx));
        }
        Ok(Firecracker {
            child,
            api: ApiClient::new(Endpoint::Unix(api_sock.clone()))
                .with_timeout(Duration::from_secs(60)),
            api_sock,
            log,
            spawned_ns,
            ready,
        })
    }

    /// The end of what Firecracker wrote on stderr and its console.
    fn tail(&self) -> String {
        let mut text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.push_str(
            &std::fs::read_to_string(self.log.with_extension("console")).unwrap_or_default(),
        );
        let lines: Vec<&str> = text.lines().rev().take(3).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join(" / ")
    }

    /// Waits until the API answers `GET /`, before `deadline`.
    fn wait_api(&mut self, deadline: Instant) -> Result<(), String> {
        let mut backoff = Duration::from_millis(1);
        loop {
            match self.api.send("GET", "/", Payload::None) {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() > deadline => {
                    return Err(format!("Firecracker's API did not answer: {e}"))
                }
                Err(_) if self.child.try_wait().ok().flatten().is_some() => {
                    return Err(format!("Firecracker exited: {}", self.tail()))
                }
                Err(_) => {
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(20));
                }
            }
        }
    }

    /// One API request; an error status becomes Firecracker's message.
    fn call(&self, method: &str, path: &str, body: &Value) -> Result<(), String> {
        let payload = Payload::Json(body.to_string().into_bytes());
        match self.api.send(method, path, payload) {
            Ok(_) => Ok(()),
            Err(ApiClientError::Status { status, message }) => Err(format!(
                "Firecracker {method} {path}: HTTP {status}: {message}"
            )),
            Err(e) => Err(format!("Firecracker {method} {path}: {e}")),
        }
    }

    /// Waits for the agent behind Firecracker's vsock socket, before
    /// `deadline`, and runs the bench's program: the connection, when the
    /// agent answered and when the program's first output came.
    fn answer(&mut self, uds: &Path, deadline: Instant) -> Result<(AgentClient, u64, u64), String> {
        let budget = deadline.saturating_duration_since(Instant::now());
        let mut client = husk_vm::connect_agent(uds, &mut self.child, "firecracker", budget)
            .map_err(|e| format!("{e} ({})", self.tail()))?;
        let answered_ns = monotonic_ns();
        let output_ns = husk_vm::first_output(&mut client)?;
        Ok((client, answered_ns, output_ns))
    }
}

/// One cold boot: spawn to the API answering, the configuration, then
/// `InstanceStart` (VM and vCPU setup), the readiness line, the agent and
/// the exec's first output. With `snapshot`, the guest (its clock set from
/// the host's) is then paused and snapshotted.
pub fn cold_boot(
    config: &BenchConfig,
    binary: &Path,
    iteration: usize,
    snapshot: bool,
) -> Result<Sample, String> {
    let deadline = Instant::now() + config.boot_budget;
    let files = Files::new(config);
    let mut fc = Firecracker::spawn(binary, config, &format!("fc-cold{iteration}"), &files.uds)?;
    fc.wait_api(deadline)?;
    let api_ns = monotonic_ns();
    for (path, body) in boot_requests(config, &files.uds) {
        fc.call("PUT", path, &body)?;
    }
    let configured_ns = monotonic_ns();
    fc.call(
        "PUT",
        "/actions",
        &json!({ "action_type": "InstanceStart" }),
    )?;
    let started_ns = monotonic_ns();
    let ready_ns = fc
        .ready
        .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .map_err(|_| format!("no readiness line on the console: {}", fc.tail()))?;
    let (mut client, answered_ns, output_ns) = fc.answer(&files.uds, deadline)?;
    let memory = Memory::of(fc.child.id());
    if snapshot {
        client
            .set_clock(std::time::SystemTime::now())
            .map_err(|e| format!("set the guest clock: {e}"))?;
        drop(client);
        fc.call("PATCH", "/vm", &json!({ "state": "Paused" }))?;
        fc.call(
            "PUT",
            "/snapshot/create",
            &json!({
                "snapshot_type": "Full",
                "snapshot_path": files.state,
                "mem_file_path": files.memory,
            }),
        )?;
    }
    let points = [
        ("process_start", Side::Host, Some(api_ns)),
        ("configure", Side::Host, Some(configured_ns)),
        ("instance_start", Side::Host, Some(started_ns)),
        ("guest_init_ready", Side::Guest, Some(ready_ns)),
        ("agent_answering", Side::Guest, Some(answered_ns)),
        ("first_exec_output", Side::Guest, Some(output_ns)),
    ];
    Ok(Sample {
        comparable_ms: Some(ready_ns.saturating_sub(fc.spawned_ns) as f64 / 1e6),
        ..Sample::from_points(iteration, fc.spawned_ns, &points, memory)
    })
}

/// One restore of the snapshot taken at `taken`: spawn to the API
/// answering, the snapshot's load with the guest resumed, the agent and the
/// exec's first output; the guest clock's offset after.
pub fn restore(
    config: &BenchConfig,
    binary: &Path,
    iteration: usize,
    taken: Instant,
) -> Result<Sample, String> {
    let age = taken.elapsed().as_secs_f64();
    let deadline = Instant::now() + config.restore_budget;
    let files = Files::new(config);
    let name = format!("fc-restore{iteration}");
    let mut fc = Firecracker::spawn(binary, config, &name, &files.uds)?;
    fc.wait_api(deadline)?;
    let api_ns = monotonic_ns();
    fc.call(
        "PUT",
        "/snapshot/load",
        &json!({
            "snapshot_path": files.state,
            "mem_backend": { "backend_type": "File", "backend_path": files.memory },
            "resume_vm": true,
        }),
    )?;
    let resumed_ns = monotonic_ns();
    let (mut client, answered_ns, output_ns) = fc.answer(&files.uds, deadline)?;
    let offset = husk_vm::clock_offset_ms(&mut client);
    let memory = Memory::of(fc.child.id());
    let points = [
        ("process_start", Side::Host, Some(api_ns)),
        ("snapshot_load_and_resume", Side::Host, Some(resumed_ns)),
        ("agent_answering", Side::Guest, Some(answered_ns)),
        ("first_exec_output", Side::Guest, Some(output_ns)),
    ];
    Ok(Sample {
        snapshot_age_s: Some(age),
        guest_clock_offset_ms: offset,
        comparable_ms: Some(resumed_ns.saturating_sub(fc.spawned_ns) as f64 / 1e6),
        ..Sample::from_points(iteration, fc.spawned_ns, &points, memory)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_binary_or_another_program_is_a_reason_to_skip() {
        let none = probe(None).expect_err("none given");
        let missing = probe(Some(Path::new("/nonexistent/firecracker"))).expect_err("missing");
        let other = probe(Some(Path::new("/bin/true"))).expect_err("not firecracker");

        assert!(none.contains("--firecracker"), "{none}");
        assert!(
            missing.contains("/nonexistent/firecracker cannot be run"),
            "{missing}"
        );
        assert!(other.contains("/bin/true is not Firecracker"), "{other}");
    }
}
