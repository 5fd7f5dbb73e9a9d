//! Shared by the integration tests and benchmarks: the real guest artifacts
//! (kernel from kernel-config/, initramfs with guest-init) and a runner for
//! the husk-vmm binary.
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Generous bound for one guest boot on an emulating (PVM) host, where a
/// boot takes 30 to 90 seconds; on hardware KVM it takes well under one.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(900);

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("vmm/ has a parent")
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

pub fn vmm_binary() -> &'static str {
    env!("CARGO_BIN_EXE_husk-vmm")
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

/// One guest with a vsock device shared by every test of a test binary:
/// booted on first use, killed with the test process. Tests that only talk
/// to the agent use it, so a test file pays for one boot.
#[derive(Debug)]
pub struct SharedVm {
    /// The VMM's vsock socket.
    pub uds: PathBuf,
    /// The guest's console so far.
    pub serial: std::sync::Arc<std::sync::Mutex<String>>,
}

pub fn shared_vm() -> &'static SharedVm {
    static VM: OnceLock<SharedVm> = OnceLock::new();
    VM.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("husk-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("socket dir");
        let uds = dir.join("vsock.sock");
        let serial = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let mut cmd = guest_command(&["--vsock", &format!("cid=3,path={}", uds.display())]);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // SAFETY: prctl is async-signal-safe; the VMM dies with the thread
        // that forked it, which below lives until the VMM exits.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let console = serial.clone();
        std::thread::spawn(move || {
            let mut child = cmd.spawn().expect("spawn husk-vmm");
            let mut stdout = child.stdout.take().expect("piped stdout");
            started_tx.send(()).expect("test thread waits");
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = stdout.read(&mut buf) {
                let text = String::from_utf8_lossy(&buf[..n]);
                console
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push_str(&text);
            }
            let _ = child.wait();
            let _ = std::fs::remove_dir_all(&dir);
        });
        started_rx.recv().expect("husk-vmm started");
        SharedVm { uds, serial }
    })
}

/// Sends one request to a VMM's control socket (`--api-sock`); returns
/// its JSON reply.
pub fn control(api: &Path, request: &str) -> serde_json::Value {
    use std::io::{BufRead, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(api).expect("control socket");
    stream
        .write_all(format!("{request}\n").as_bytes())
        .expect("request");
    let mut line = String::new();
    std::io::BufReader::new(stream)
        .read_line(&mut line)
        .expect("reply");
    serde_json::from_str(&line).expect("JSON reply")
}
