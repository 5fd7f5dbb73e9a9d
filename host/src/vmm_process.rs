//! One `husk-vmm` process as the daemon sees it: how it is started (boot
//! or restore), its files, whether it still runs, and how it is stopped.
//!
//! A VMM runs in its own process group, so that it outlives the daemon: a
//! restarted daemon finds it again by its pid and that process's start
//! time (a pid alone may have been reused).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::cgroup::Cgroup;

/// A VMM's files in its run directory.
pub const VSOCK: &str = "vsock";
pub const API: &str = "api";
pub const CONSOLE: &str = "console";
pub const LOG: &str = "vmm.log";

/// The guest's vsock CID. Every VMM has its own vsock device and socket,
/// so all guests can have the same one (and a clone keeps its template's,
/// which spares the guest a transport reset).
const GUEST_CID: u32 = 3;

/// A VMM's network device: a TAP that husk-vmm creates when it opens it
/// (so the kernel removes it when the VMM exits: nothing to clean up),
/// and the guest's MAC address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nic {
    pub tap: String,
    pub mac: [u8; 6],
}

impl Nic {
    /// A NIC for VM `id`: TAP `<prefix><first 12 hex digits of the id>`
    /// and a random locally administered MAC.
    pub fn for_vm(prefix: &str, id: &str) -> std::io::Result<Self> {
        let hex: String = id.chars().filter(char::is_ascii_hexdigit).collect();
        let tail = &hex[hex.len().saturating_sub(12)..];
        Ok(Nic {
            tap: format!("{prefix}{tail}"),
            mac: random_mac()?,
        })
    }

    pub fn mac_text(&self) -> String {
        mac_text(&self.mac)
    }
}

/// A random locally administered unicast MAC address.
pub fn random_mac() -> std::io::Result<[u8; 6]> {
    use std::io::Read;
    let mut mac = [0u8; 6];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut mac)?;
    mac[0] = 0x06;
    Ok(mac)
}

/// `aa:bb:cc:dd:ee:ff`, as husk-vmm's `--net mac=` takes it.
pub fn mac_text(mac: &[u8; 6]) -> String {
    let parts: Vec<String> = mac.iter().map(|b| format!("{b:02x}")).collect();
    parts.join(":")
}

/// How a VMM is started.
#[derive(Debug, Clone)]
pub enum Launch {
    /// Boot a kernel.
    Boot {
        kernel: PathBuf,
        initramfs: Option<PathBuf>,
        /// `--drive` specs (the first is the root when `cmdline` says so).
        drives: Vec<String>,
        cmdline: Option<String>,
        vcpus: u8,
        mem_mib: u32,
    },
    /// Restore a snapshot; each writable drive gets an overlay in the run
    /// directory.
    Restore { snapshot: PathBuf },
}

/// Starts `husk-vmm` for sandbox `id` with its files in `run_dir` (which
/// must exist), in `cgroup` if given, with `nic` if given. stderr (its
/// log) goes to `run_dir/vmm.log`.
pub fn spawn(
    vmm: &Path,
    id: &str,
    run_dir: &Path,
    launch: &Launch,
    cgroup: Option<&Cgroup>,
    nic: Option<&Nic>,
) -> std::io::Result<Child> {
    let mut cmd = Command::new(vmm);
    cmd.args(["--id", id]);
    if let Some(nic) = nic {
        cmd.arg("--net")
            .arg(format!("tap={},mac={}", nic.tap, nic.mac_text()));
    }
    match launch {
        Launch::Boot {
            kernel,
            initramfs,
            drives,
            cmdline,
            vcpus,
            mem_mib,
        } => {
            cmd.arg("--kernel").arg(kernel);
            if let Some(initramfs) = initramfs {
                cmd.arg("--initramfs").arg(initramfs);
            }
            for drive in drives {
                cmd.args(["--drive", drive]);
            }
            if let Some(cmdline) = cmdline {
                cmd.args(["--cmdline", cmdline]);
            }
            cmd.args(["--vcpus", &vcpus.to_string()])
                .args(["--mem-mib", &mem_mib.to_string()]);
        }
        Launch::Restore { snapshot } => {
            cmd.arg("--restore")
                .arg(snapshot)
                .arg("--overlay-dir")
                .arg(run_dir);
        }
    }
    let log = std::fs::File::create(run_dir.join(LOG))?;
    cmd.arg("--vsock")
        .arg(format!(
            "cid={GUEST_CID},path={}",
            run_dir.join(VSOCK).display()
        ))
        .arg("--api-sock")
        .arg(run_dir.join(API))
        .arg("--serial")
        .arg(run_dir.join(CONSOLE))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        // Its own process group: a signal to the daemon's group (Ctrl-C)
        // does not reach the sandboxes, and they outlive a daemon restart.
        .process_group(0);
    if let Some(cgroup) = cgroup {
        let procs = cgroup.procs_files();
        // SAFETY: join_in_child allocates nothing and makes only
        // async-signal-safe calls (getpid, open, write, close).
        unsafe {
            cmd.pre_exec(move || crate::cgroup::join_in_child(&procs));
        }
    }
    cmd.spawn()
}

/// The start time of process `pid` (clock ticks since boot, field 22 of
/// /proc/PID/stat), or None if there is no such process.
pub fn start_time(pid: u32) -> Option<u64> {
    stat(pid).map(|(_, start)| start)
}

/// Process `pid`'s state letter (field 3 of /proc/PID/stat) and start
/// time (field 22).
fn stat(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields
    // are counted after its closing parenthesis.
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?.chars().next()?;
    Some((state, fields.nth(18)?.parse().ok()?))
}

/// Whether `pid` is still the process started at `pid_start`, and is not
/// a zombie.
pub fn is_alive(pid: u32, pid_start: u64) -> bool {
    stat(pid).is_some_and(|(state, start)| state != 'Z' && start == pid_start)
}

/// Sends SIGKILL to the VMM if it is still the process we started.
pub fn kill(pid: u32, pid_start: u64) {
    if pid != 0 && is_alive(pid, pid_start) {
        // SAFETY: kill(2) with a pid we checked is our VMM; no memory is
        // involved.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
}

/// The end of a VMM's log and console, indented, for an error message.
pub fn last_words(log: &Path, console: &Path, lines: usize) -> String {
    format!(
        "  husk-vmm log:\n    {}\n  console:\n    {}",
        tail(log, lines).replace('\n', "\n    "),
        tail(console, lines).replace('\n', "\n    ")
    )
}

/// The last `lines` lines of a text file (a console or a log), or "".
pub fn tail(path: &Path, lines: usize) -> String {
    use std::io::{Read, Seek, SeekFrom};
    // Only the end of the file is read: a guest may have flooded its console.
    let Ok(mut file) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(16 << 10)));
    let mut bytes = Vec::new();
    let _ = file.read_to_end(&mut bytes);
    let text = String::from_utf8_lossy(&bytes);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_with_its_own_start_time() {
        let me = std::process::id();
        let start = start_time(me).expect("own stat");

        assert!(is_alive(me, start));
        assert!(!is_alive(me, start + 1));
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        let path = std::env::temp_dir().join(format!("husk-tail-{}", std::process::id()));
        std::fs::write(&path, "a\nb\nc\nd\n").expect("write");

        assert_eq!(tail(&path, 2), "c\nd");
        std::fs::remove_file(path).expect("cleanup");
    }
}
