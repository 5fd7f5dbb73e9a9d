//! Shared by the integration tests and benchmarks: the real guest artifacts
//! (kernel from kernel-config/, initramfs with guest-init) and a runner for
//! the husk-vmm binary.
#![allow(dead_code)]

pub mod containerd;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Generous bound for one guest boot on an emulating (PVM) host, where a
/// boot takes 30 to 90 seconds; on hardware KVM it takes well under one.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(900);

/// Says that (part of) a test cannot run here and why. With
/// `HUSK_REQUIRE_ALL=1` (CI sets it, after installing what the tests need)
/// it fails the test instead: a machine that lacks a piece is not green
/// without testing it.
pub fn skip(why: &str) {
    if std::env::var("HUSK_REQUIRE_ALL").is_ok_and(|v| v == "1") {
        panic!("HUSK_REQUIRE_ALL=1, and this test cannot run here: {why}");
    }
    eprintln!("skipped: {why}");
}

/// The repository's root (the tests run from vmm/ and from host/cli/).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .find(|d| d.join("rust-toolchain.toml").exists())
        .expect("the repository root holds rust-toolchain.toml")
        .to_path_buf()
}

/// Runs a build script that prints its artifact's path last, unless `var`
/// already names the artifact.
fn artifact(var: &str, script: &str, args: &[&str]) -> PathBuf {
    if let Some(path) = std::env::var_os(var) {
        return PathBuf::from(path);
    }
    let out = Command::new(repo_root().join(script))
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {script}: {e}"));
    assert!(out.status.success(), "{script} failed: {}", out.status);
    let stdout = String::from_utf8(out.stdout).expect("utf-8 path");
    PathBuf::from(stdout.lines().last().expect("script printed a path"))
}

/// The guest kernel (vmlinux), built by kernel-config/build.sh or `$HUSK_KERNEL`.
pub fn kernel() -> &'static Path {
    static KERNEL: OnceLock<PathBuf> = OnceLock::new();
    KERNEL.get_or_init(|| artifact("HUSK_KERNEL", "kernel-config/build.sh", &[]))
}

/// The guest initramfs, built by guest-init/build-rootfs.sh or `$HUSK_INITRAMFS`.
pub fn initramfs() -> &'static Path {
    static INITRAMFS: OnceLock<PathBuf> = OnceLock::new();
    INITRAMFS.get_or_init(|| {
        artifact(
            "HUSK_INITRAMFS",
            "guest-init/build-rootfs.sh",
            &["initramfs"],
        )
    })
}

/// The guest root file system as an ext4 image (the same tree as the
/// initramfs), built by guest-init/build-rootfs.sh or `$HUSK_ROOTFS`.
/// Tests copy it before booting from it read-write.
pub fn rootfs_ext4() -> &'static Path {
    static ROOTFS: OnceLock<PathBuf> = OnceLock::new();
    ROOTFS.get_or_init(|| artifact("HUSK_ROOTFS", "guest-init/build-rootfs.sh", &["ext4"]))
}

/// A husk-vmm command line booting the real kernel from an ext4 root on
/// virtio-block: `root_drive` is the first drive (/dev/vda).
pub fn disk_guest_command(root_drive: &str, extra_drives: &[&str], cmdline: &str) -> Command {
    let mut cmd = Command::new(vmm_binary());
    cmd.arg("--kernel")
        .arg(kernel())
        .args(["--drive", root_drive]);
    for drive in extra_drives {
        cmd.args(["--drive", drive]);
    }
    cmd.args([
        "--cmdline",
        &format!("root=/dev/vda rw rootfstype=ext4 {cmdline}"),
    ]);
    cmd
}

/// The husk-vmm binary: cargo's, in husk-vmm's own tests; else the one
/// built beside the `husk` binary (make test builds every binary first).
pub fn vmm_binary() -> &'static str {
    static VMM: OnceLock<String> = OnceLock::new();
    VMM.get_or_init(|| {
        option_env!("CARGO_BIN_EXE_husk-vmm")
            .map(str::to_owned)
            .or_else(|| {
                option_env!("CARGO_BIN_EXE_husk").map(|husk| {
                    Path::new(husk)
                        .with_file_name("husk-vmm")
                        .display()
                        .to_string()
                })
            })
            .expect("run from husk-vmm's or husk-cli's tests")
    })
}

/// The `husk` CLI (package husk-cli), built next to husk-vmm by
/// `make test` (which builds every binary of the workspace first).
pub fn husk_binary() -> PathBuf {
    let husk = Path::new(vmm_binary()).with_file_name("husk");
    assert!(
        husk.exists(),
        "{} is missing: build every binary first (`cargo build --workspace --bins`, as make test does)",
        husk.display()
    );
    husk
}

/// A count a benchmark takes from environment variable `var` (`default`
/// when unset or not a number).
pub fn env_count(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The `p` quantile (0..=1, nearest rank) of `samples`, for benchmarks.
pub fn percentile(samples: &[f64], p: f64) -> f64 {
    let mut s = samples.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s[((s.len() - 1) as f64 * p).round() as usize]
}

/// What one husk-vmm process did.
#[derive(Debug)]
pub struct VmmRun {
    pub status: ExitStatus,
    /// The guest's serial console.
    pub serial: String,
    /// The VMM's own log.
    pub stderr: String,
    pub wall: Duration,
}

impl VmmRun {
    /// Whether the console printed exactly `line` (the guest's tty ends
    /// lines with CR LF).
    pub fn has_line(&self, line: &str) -> bool {
        self.serial
            .lines()
            .any(|l| l.trim_end_matches('\r') == line)
    }

    /// The console and the log, for assertion messages.
    pub fn dump(&self) -> String {
        format!(
            "status: {}\n--- serial ---\n{}\n--- stderr ---\n{}",
            self.status, self.serial, self.stderr
        )
    }
}

/// A husk-vmm command line with the real kernel and initramfs.
pub fn guest_command(extra: &[&str]) -> Command {
    let mut cmd = Command::new(vmm_binary());
    cmd.arg("--kernel")
        .arg(kernel())
        .arg("--initramfs")
        .arg(initramfs())
        .args(extra);
    cmd
}

/// A quiet guest (console discarded) with a vsock device at `uds` and a
/// control socket at `api`, plus `extra` husk-vmm arguments.
pub fn agent_guest_command(uds: &Path, api: &Path, extra: &[&str]) -> Command {
    let mut cmd = guest_command(extra);
    cmd.arg("--vsock")
        .arg(format!("cid=3,path={}", uds.display()))
        .arg("--api-sock")
        .arg(api)
        .args(["--serial", "null"])
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    cmd
}

/// Spawns `cmd` with captured output.
pub fn spawn(mut cmd: Command) -> Child {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn husk-vmm")
}

/// Waits for `child` to exit, killing it after `timeout` (the test then fails
/// with whatever the guest printed).
pub fn wait(mut child: Child, timeout: Duration) -> VmmRun {
    let start = Instant::now();
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let status = child.wait().expect("wait after kill");
            let run = VmmRun {
                status,
                serial: out_reader.join().unwrap_or_default(),
                stderr: err_reader.join().unwrap_or_default(),
                wall: start.elapsed(),
            };
            panic!("husk-vmm did not exit within {timeout:?}\n{}", run.dump());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    VmmRun {
        status,
        serial: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
        wall: start.elapsed(),
    }
}

/// Runs husk-vmm to completion.
pub fn run(cmd: Command, timeout: Duration) -> VmmRun {
    wait(spawn(cmd), timeout)
}

/// A copy of husk-vmm that an unprivileged user can execute (the build
/// directory may sit below a directory only root can enter). Keep the
/// returned directory alive while the copy is used.
pub fn vmm_binary_for_anyone() -> (vmm_sys_util::tempdir::TempDir, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let dir = vmm_sys_util::tempdir::TempDir::new_with_prefix("/tmp/husk-test-").expect("tempdir");
    std::fs::set_permissions(dir.as_path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod dir");
    let copy = dir.as_path().join("husk-vmm");
    std::fs::copy(vmm_binary(), &copy).expect("copy husk-vmm");
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    (dir, copy)
}

/// `argv` run as the unprivileged user nobody (65534).
pub fn as_nobody(program: &Path) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(program);
    cmd
}

/// A husk-vmm (or any child) that is killed when the test lets go of it.
#[derive(Debug)]
pub struct Vmm(pub Child);

impl Drop for Vmm {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `/bin/sh -c script` for the agent.
pub fn sh(script: &str) -> husk_protocol::ExecRequest {
    husk_protocol::ExecRequest {
        argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
        ..Default::default()
    }
}

/// `husk-cpucheck` (built with guest-init), to upload into guests.
pub fn cpucheck_tool() -> PathBuf {
    repo_root().join("target/x86_64-unknown-linux-musl/guest/husk-cpucheck")
}

/// What `husk-cpucheck clock` printed: its two samples of (TSC, CLOCK_MONOTONIC
/// ns) and the kernel log lines that name a clocksource.
pub fn clock_report(out: &str) -> ([(u64, u64); 2], Vec<String>) {
    let samples: Vec<(u64, u64)> = out
        .lines()
        .filter_map(|l| {
            let mut w = l.strip_prefix("sample ")?.split(' ');
            Some((w.next()?.parse().ok()?, w.next()?.parse().ok()?))
        })
        .collect();
    let log = out
        .lines()
        .filter_map(|l| l.strip_prefix("log "))
        .map(str::to_owned)
        .collect();
    match samples[..] {
        [a, b] => ([a, b], log),
        _ => panic!("husk-cpucheck clock printed {out}"),
    }
}

/// How far (ns) `sample`'s TSC stands from where an earlier relation of TSC
/// to CLOCK_MONOTONIC (two samples) puts it, at the rate those samples show.
pub fn tsc_drift_ns(relation: [(u64, u64); 2], sample: (u64, u64)) -> f64 {
    let [(t0, n0), (t1, n1)] = relation;
    let cycles_per_ns = (t1 - t0) as f64 / (n1 - n0) as f64;
    let guest_ns = sample.1 as f64 - n0 as f64;
    let tsc_ns = (sample.0 as f64 - t0 as f64) / cycles_per_ns;
    tsc_ns - guest_ns
}

/// How far off its clock a guest's TSC may stand after a restore (1 ms):
/// checked where guest user space reads the TSC the VMM restores (not on a
/// PVM host, where it reads the host's: [`husk_vmm_api::cmdline::is_pvm_host`]).
pub const TSC_DRIFT_BOUND_NS: f64 = 1_000_000.0;

/// Asserts every drift (ns) within `bound`, except on a PVM host, where
/// guest user space reads the host's TSC, which no write of IA32_TSC moves
/// (there a clone's TSC is off by its snapshot's age whatever the VMM does).
/// `what` names whose TSC it is in the message.
pub fn assert_tsc_kept(drifts: &[f64], bound: f64, what: &str) {
    if husk_vmm_api::cmdline::is_pvm_host() {
        return;
    }
    for drift in drifts {
        assert!(
            drift.abs() < bound,
            "{what}'s TSC is {drift:.0} ns off its clock's"
        );
    }
}

/// Asserts no clocksource line of the guest's log (`husk-cpucheck clock`)
/// calls the TSC unstable.
pub fn assert_tsc_stable(log: &[String]) {
    assert!(
        !log.iter().any(|l| l.contains("unstable")),
        "{}",
        log.join("\n")
    );
}

/// Bytes as (lossy) UTF-8.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Makes the child die with the thread that spawned it (tests end by
/// exiting, without dropping statics).
fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl is async-signal-safe and touches no memory of ours.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// Where a test binary keeps its snapshot and its sandboxes' sockets;
/// removed when the test process exits.
fn scratch_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        extern "C" fn remove_scratch() {
            if let Some(dir) = DIR.get() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
        let dir = std::env::temp_dir().join(format!("husk-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        // SAFETY: registers a plain function to run at exit.
        unsafe { libc::atexit(remove_scratch) };
        dir
    })
}

/// A snapshot of a guest booted to its agent, taken once per test binary:
/// every [`sandbox`] is a clone of it.
fn base_snapshot() -> &'static Path {
    static SNAPSHOT: OnceLock<PathBuf> = OnceLock::new();
    SNAPSHOT.get_or_init(|| {
        let dir = scratch_dir();
        let (uds, api) = (dir.join("base.vsock"), dir.join("base.api"));
        // An empty drive, as a template's container slots are: a clone
        // can put a medium in it.
        let slot = dir.join("slot.img");
        std::fs::File::create(&slot).expect("empty drive");
        let slot = format!("path={},id={SLOT}", slot.display());
        // And empty shared-directory slots, which a clone fills.
        // And a balloon: what a clone frees goes back to the host.
        let mut args = vec!["--drive".to_owned(), slot, "--balloon".to_owned()];
        for tag in FS_SLOTS {
            args.extend(["--fs".to_owned(), format!("tag={tag}")]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut cmd = agent_guest_command(&uds, &api, &args);
        cmd.stderr(Stdio::inherit());
        die_with_parent(&mut cmd);
        let mut base = cmd.spawn().expect("spawn husk-vmm");
        let timeout = Duration::from_secs(120);
        let mut client =
            husk_agent_client::AgentClient::connect_when_ready(&uds, BOOT_TIMEOUT, timeout)
                .expect("base agent");
        client.ping().expect("ping");
        drop(client);
        let snapshot_dir = dir.join("snapshot");
        snapshot(&api, &snapshot_dir, false).expect("snapshot of the base guest");
        let _ = base.kill();
        let _ = base.wait();
        snapshot_dir
    })
}

/// A guest of its own for one test: a clone restored from the test
/// binary's snapshot (one boot per binary), with its own vsock, console
/// file and identity. Killed when dropped.
#[derive(Debug)]
pub struct Sandbox {
    pub name: String,
    /// The VMM's vsock socket.
    pub uds: PathBuf,
    /// The VMM's control socket.
    pub api: PathBuf,
    /// The guest's console.
    pub console: PathBuf,
    child: Child,
}

impl Sandbox {
    /// A new connection to the clone's agent.
    pub fn client(&self) -> husk_agent_client::AgentClient {
        husk_agent_client::AgentClient::connect(&self.uds, Duration::from_secs(120)).expect("agent")
    }

    /// The guest's console so far.
    pub fn serial(&self) -> String {
        std::fs::read_to_string(&self.console).unwrap_or_default()
    }

    /// The VMM's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The id of the base guest's empty drive (its /dev/vda).
pub const SLOT: &str = "slot";
/// The tags of the base guest's empty shared-directory slots.
pub const FS_SLOTS: [&str; 2] = ["fs0", "fs1"];

/// Restores a clone named `name` (also its hostname) and runs its
/// post-restore step.
pub fn sandbox(name: &str) -> Sandbox {
    sandbox_with(name, &[])
}

/// As [`sandbox`], with more `husk-vmm --restore` arguments (directories
/// for the shared-directory slots: `--fs tag=fs0,path=DIR`).
pub fn sandbox_with(name: &str, extra: &[&str]) -> Sandbox {
    static NEXT_CID: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(10);
    let snapshot = base_snapshot();
    let dir = scratch_dir();
    let cid = NEXT_CID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let uds = dir.join(format!("{name}.vsock"));
    let api = dir.join(format!("{name}.api"));
    let console = dir.join(format!("{name}.console"));
    let mut cmd = Command::new(vmm_binary());
    cmd.arg("--restore")
        .arg(snapshot)
        .args(["--id", name])
        .arg("--overlay-dir")
        .arg(dir)
        .arg("--api-sock")
        .arg(&api)
        .arg("--vsock")
        .arg(format!("cid={cid},path={}", uds.display()))
        .arg("--serial")
        .arg(&console)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    die_with_parent(&mut cmd);
    let child = cmd.spawn().expect("husk-vmm --restore");
    let sandbox = Sandbox {
        name: name.to_owned(),
        uds,
        api,
        console,
        child,
    };
    let timeout = Duration::from_secs(120);
    let mut client = husk_agent_client::AgentClient::connect_when_ready(
        &sandbox.uds,
        Duration::from_secs(300),
        timeout,
    )
    .expect("the clone's agent");
    client.restored(name, None).expect("post-restore step");
    sandbox
}

/// Sends one request to a VMM's control socket (`--api-sock`); its reply,
/// or the VMM's refusal.
pub fn control(api: &Path, request: &husk_vmm_api::Request) -> Result<husk_vmm_api::Reply, String> {
    husk_vmm_api::call(api, request, Duration::from_secs(300)).map_err(|e| e.to_string())
}

/// A snapshot of the VMM at `api` into `dir` (only the pages written since
/// its last one with `diff`): what it wrote, or why it was refused.
pub fn snapshot(
    api: &Path,
    dir: &Path,
    diff: bool,
) -> Result<husk_vmm_api::SnapshotReport, String> {
    let request = husk_vmm_api::Request::Snapshot {
        dir: dir.to_owned(),
        diff,
        keep_base: false,
    };
    match control(api, &request)? {
        husk_vmm_api::Reply::Snapshot { report, .. } => Ok(report),
        other => Err(format!("not a snapshot reply: {other:?}")),
    }
}

/// `n` busy loops (`sh -c 'while :; do :; done'`) until dropped: a
/// host with its cores kept busy.
pub struct Load(Vec<Child>);

impl Load {
    pub fn start(n: usize) -> Self {
        Load(
            (0..n)
                .map(|_| {
                    Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .expect("busy loop")
                })
                .collect(),
        )
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Kills every process whose command line names `dir` (a daemon and the
/// VMMs it started, which run in their own process groups).
pub fn kill_everything_under(dir: &Path) {
    let needle = dir.to_string_lossy().into_owned();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&needle) {
            // SAFETY: kill(2) on a pid read from /proc.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Removes the cgroups of the sandboxes and templates under `dir` (the
/// daemon's, left when the test process kills it), once their processes
/// are gone.
pub fn remove_cgroups_of(dir: &Path) {
    let ids: Vec<String> = ["sandboxes", "templates"]
        .iter()
        .flat_map(|sub| {
            std::fs::read_dir(dir.join(sub))
                .into_iter()
                .flatten()
                .flatten()
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    for id in ids {
        for base in [
            "/sys/fs/cgroup",
            "/sys/fs/cgroup/memory",
            "/sys/fs/cgroup/cpu",
            "/sys/fs/cgroup/pids",
        ] {
            let cg = Path::new(base).join("husk").join(&id);
            // A killed process leaves its cgroup a moment after SIGKILL.
            for _ in 0..50 {
                if !cg.exists() || std::fs::remove_dir(&cg).is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// The data extents of a sparse file: (offset, length).
pub fn data_extents(path: &Path) -> Vec<(u64, u64)> {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).expect("open");
    let size = file.metadata().expect("stat").len() as i64;
    let fd = file.as_raw_fd();
    let mut extents = Vec::new();
    let mut at = 0i64;
    while at < size {
        // SAFETY: lseek on our own descriptor.
        let data = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
        if data < 0 {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        extents.push((data as u64, (hole - data) as u64));
        at = hole;
    }
    extents
}

/// Flips the bits of the byte at `offset` of `path` in place.
pub fn flip_byte(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open to flip a byte");
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, offset)
        .expect("read the byte");
    file.write_all_at(&[!byte[0]], offset)
        .expect("flip the byte");
}

/// A clone's private copies of its guest memory, in KiB: the anonymous
/// pages of VMM `pid`'s mapping of the snapshot's memory file.
pub fn guest_private_kib(pid: u32) -> u64 {
    smaps_kib(pid, "Anonymous:", true)
}

/// The sum of smaps field `field` (KiB) over VMM `pid`'s mappings of guest
/// memory (the snapshot's memory file), or (`guest` false) over all others.
pub fn smaps_kib(pid: u32, field: &str, guest: bool) -> u64 {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let mut sum = 0;
    let mut guest_mapping = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or_default();
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            guest_mapping = line.ends_with("/memory");
        } else if let Some(kib) = line.strip_prefix(field) {
            if guest_mapping == guest {
                sum += kib
                    .trim()
                    .trim_end_matches(" kB")
                    .parse::<u64>()
                    .unwrap_or(0);
            }
        }
    }
    sum
}
