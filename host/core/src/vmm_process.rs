//! One `husk-vmm` process as the daemon sees it: how it is started (boot
//! or restore), its files, whether it still runs, and how it is stopped.
//!
//! A VMM runs in its own process group, so that it outlives the daemon: a
//! restarted daemon finds it again by its pid and that process's start
//! time (a pid alone may have been reused).

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::cgroup::Cgroup;
use husk_jailer::{Bind, Jail};

/// A VMM's files in its run directory.
pub const VSOCK: &str = "vsock";
/// The control socket in a sandbox's run directory.
pub const API: &str = "api";
/// The serial console's file in a sandbox's run directory.
pub const CONSOLE: &str = "console";
/// The VMM's log in a sandbox's run directory.
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
    /// The TAP device's name.
    pub tap: String,
    /// The guest's MAC address.
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

    /// The NIC a sandbox had (its TAP's name, its MAC as
    /// `aa:bb:cc:dd:ee:ff`).
    pub fn known(tap: &str, mac: &str) -> std::io::Result<Self> {
        let bytes: Vec<u8> = mac
            .split(':')
            .filter_map(|b| u8::from_str_radix(b, 16).ok())
            .collect();
        let mac = <[u8; 6]>::try_from(bytes).map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("`{mac}` is not a MAC address"),
            )
        })?;
        Ok(Nic {
            tap: tap.to_owned(),
            mac,
        })
    }

    /// The MAC as `aa:bb:cc:dd:ee:ff`.
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
        /// The kernel (an uncompressed vmlinux or a bzImage).
        kernel: PathBuf,
        /// The initramfs, if any.
        initramfs: Option<PathBuf>,
        /// `--drive` specs (the first is the root when `cmdline` says so).
        drives: Vec<String>,
        /// `--fs` specs: empty shared-directory slots (`tag=TAG`).
        shares: Vec<String>,
        /// The guest command line's additions.
        cmdline: Option<String>,
        /// vCPUs.
        vcpus: u8,
        /// Guest memory, in MiB.
        mem_mib: u32,
        /// Offer the host's VMX or SVM to the guest (husk-vmm --nested-virt).
        nested_virt: bool,
    },
    /// Restore a snapshot; each writable drive gets an overlay in the run
    /// directory.
    Restore {
        /// The snapshot's directory.
        snapshot: PathBuf,
        /// Check the snapshot's own pages and drive layers against the
        /// checksums written with them first (husk-vmm --verify): for a
        /// hibernation's wake, not for a template's clones.
        verify: bool,
    },
}

/// Runs the VMM in a jail (see [`husk_jailer`]).
#[derive(Debug, Clone)]
pub struct Jailing {
    /// The `husk-jailer` binary.
    pub jailer: PathBuf,
    /// The jail's own uid (and gid).
    pub uid: u32,
    /// Directories a restore reads besides the snapshot (the snapshots
    /// its layers came from).
    pub reads: Vec<PathBuf>,
}

/// Everything about one VMM to start.
#[derive(Debug, Clone, Copy)]
pub struct VmSpawn<'a> {
    /// The husk-vmm binary.
    pub vmm: &'a Path,
    /// The sandbox's id.
    pub id: &'a str,
    /// Its files (must exist).
    pub run_dir: &'a Path,
    /// Boot or restore.
    pub launch: &'a Launch,
    /// The cgroup it joins, if any.
    pub cgroup: Option<&'a Cgroup>,
    /// Its network device, if any.
    pub nic: Option<&'a Nic>,
    /// Its jail, if any.
    pub jail: Option<&'a Jailing>,
    /// `--block-limit` and `--net-limit`, if any.
    pub limits: (Option<&'a str>, Option<&'a str>),
}

/// Starts `husk-vmm` for `vm.id` with its files in `vm.run_dir`, in its
/// cgroup and jail if given. stderr (its log) goes to `run_dir/vmm.log`.
pub fn spawn(vm: &VmSpawn<'_>) -> std::io::Result<Child> {
    let run_dir = vm.run_dir;
    let mut args: Vec<OsString> = vec!["--id".into(), vm.id.into()];
    for (flag, limit) in [("--block-limit", vm.limits.0), ("--net-limit", vm.limits.1)] {
        if let Some(limit) = limit {
            args.extend([flag.into(), limit.into()]);
        }
    }
    // What the jail lets it see: its run directory, writable, and what
    // it boots or restores from.
    let mut binds = vec![Bind {
        path: run_dir.to_owned(),
        writable: true,
    }];
    let read = |path: &Path| Bind {
        path: path.to_owned(),
        writable: false,
    };
    if let Some(nic) = vm.nic {
        args.push("--net".into());
        args.push(format!("tap={},mac={}", nic.tap, nic.mac_text()).into());
    }
    match vm.launch {
        Launch::Boot {
            kernel,
            initramfs,
            drives,
            shares,
            cmdline,
            vcpus,
            mem_mib,
            nested_virt,
        } => {
            args.extend(["--kernel".into(), kernel.into()]);
            binds.push(read(kernel));
            if let Some(initramfs) = initramfs {
                args.extend(["--initramfs".into(), initramfs.into()]);
                binds.push(read(initramfs));
            }
            for drive in drives {
                args.extend(["--drive".into(), drive.into()]);
                binds.extend(drive_binds(drive));
            }
            for share in shares {
                args.extend(["--fs".into(), share.into()]);
            }
            if let Some(cmdline) = cmdline {
                args.extend(["--cmdline".into(), cmdline.into()]);
            }
            args.extend(["--vcpus".into(), vcpus.to_string().into()]);
            args.extend(["--mem-mib".into(), mem_mib.to_string().into()]);
            // Memory the guest frees goes back to the host (clones keep
            // the device from the template's snapshot).
            args.push("--balloon".into());
            if *nested_virt {
                args.push("--nested-virt".into());
            }
        }
        Launch::Restore { snapshot, verify } => {
            args.extend(["--restore".into(), snapshot.into()]);
            if *verify {
                args.push("--verify".into());
            }
            args.extend(["--overlay-dir".into(), run_dir.into()]);
            binds.push(read(snapshot));
            if let Some(jail) = vm.jail {
                binds.extend(jail.reads.iter().map(|p| read(p)));
            }
        }
    }
    let log = std::fs::File::create(run_dir.join(LOG))?;
    args.push("--vsock".into());
    args.push(format!("cid={GUEST_CID},path={}", run_dir.join(VSOCK).display()).into());
    args.extend(["--api-sock".into(), run_dir.join(API).into()]);
    args.extend(["--serial".into(), run_dir.join(CONSOLE).into()]);
    let mut cmd = match vm.jail {
        Some(jailing) => {
            let jail = Jail {
                id: vm.id.to_owned(),
                uid: jailing.uid,
                gid: jailing.uid,
                binds,
                shares: Vec::new(),
                tap: vm.nic.map(|n| n.tap.clone()),
                kvm_device: "/dev/kvm".into(),
                nofile: husk_jailer::DEFAULT_NOFILE,
                fsize: None,
            };
            // The VMM creates its sockets, overlay and snapshots in its run
            // directory, and writes its writable drives (a template
            // build's image): they become the jail's.
            for bind in jail.binds.iter().filter(|b| b.writable) {
                std::os::unix::fs::chown(&bind.path, Some(jailing.uid), Some(jailing.uid))?;
            }
            let mut cmd = Command::new(&jailing.jailer);
            cmd.args(jail.args()).arg("--").arg(vm.vmm).args(args);
            cmd
        }
        None => {
            let mut cmd = Command::new(vm.vmm);
            cmd.args(args);
            cmd
        }
    };
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        // Its own process group: a signal to the daemon's group (Ctrl-C)
        // does not reach the sandboxes, and they outlive a daemon restart.
        .process_group(0);
    if let Some(cgroup) = vm.cgroup {
        let procs = cgroup.procs_files();
        // SAFETY: join_in_child allocates nothing and makes only
        // async-signal-safe calls (getpid, open, write, close).
        unsafe {
            cmd.pre_exec(move || crate::cgroup::join_in_child(&procs));
        }
    }
    cmd.spawn()
}

/// The files a `--drive` spec (`path=FILE[,readonly][,overlay=FILE]...`)
/// opens: the image (read-only under an overlay) and the overlay.
fn drive_binds(spec: &str) -> Vec<Bind> {
    let mut path = None;
    let mut overlay = None;
    let mut readonly = false;
    for (i, part) in spec.split(',').enumerate() {
        match part.split_once('=') {
            Some(("path", v)) => path = Some(PathBuf::from(v)),
            Some(("overlay", v)) => overlay = Some(PathBuf::from(v)),
            None if part == "readonly" => readonly = true,
            None if i == 0 => path = Some(PathBuf::from(part)),
            _ => {}
        }
    }
    let writable = !readonly && overlay.is_none();
    let mut binds: Vec<Bind> = path
        .map(|path| Bind { path, writable })
        .into_iter()
        .collect();
    if let Some(overlay) = overlay {
        // The overlay does not exist yet: its directory is bound.
        if let Some(dir) = overlay.parent() {
            binds.push(Bind {
                path: dir.to_owned(),
                writable: true,
            });
        }
    }
    binds
}

/// The start time of process `pid` (clock ticks since boot, field 22 of
/// /proc/PID/stat), or None if there is no such process.
pub fn start_time(pid: u32) -> Option<u64> {
    stat(pid).map(|(_, start)| start)
}

/// Process `pid`'s state letter (field 3 of /proc/PID/stat) and start
/// time (field 22).
fn stat(pid: u32) -> Option<(char, u64)> {
    let fields = stat_fields(pid)?;
    let state = fields.first()?.chars().next()?;
    Some((state, fields.get(19)?.parse().ok()?))
}

/// The fields of /proc/PID/stat from field 3 (the state) on.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields
    // are counted after its closing parenthesis.
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// Process `pid`'s CPU time so far, user and system (fields 14 and 15),
/// in clock ticks.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let fields = stat_fields(pid)?;
    let user: u64 = fields.get(11)?.parse().ok()?;
    let system: u64 = fields.get(12)?.parse().ok()?;
    Some(user + system)
}

/// Process `pid`'s children.
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|c| c.parse().ok())
        .collect()
}

/// Whether `pid` is still the process started at `pid_start`, and is not
/// a zombie.
pub fn is_alive(pid: u32, pid_start: u64) -> bool {
    stat(pid).is_some_and(|(state, start)| state != 'Z' && start == pid_start)
}

/// The VMM's own pid for sandbox process `pid`: a jailer's child (the VMM
/// it started), or `pid` itself (an unjailed VMM).
pub fn vmm_of(pid: u32) -> u32 {
    match children(pid)[..] {
        [child] => child,
        _ => pid,
    }
}

/// Kills the VMM if `pid` is still the process we started. A jailer's
/// VMM (its child) is killed first: the jailer reaps it and dies the same
/// way, so no VMM is left orphaned (and, under an init that does not reap,
/// a zombie).
pub fn kill(pid: u32, pid_start: u64) {
    if pid == 0 || !is_alive(pid, pid_start) {
        return;
    }
    let mut killed = false;
    for child in children(pid) {
        // SAFETY: kill(2) on a child of the process we checked is ours.
        killed |= unsafe { libc::kill(child as i32, libc::SIGKILL) } == 0;
    }
    if !killed {
        // SAFETY: kill(2) with a pid we checked is our VMM; no memory is
        // involved.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
}

/// Kills a VMM we started (see [`kill`]) and waits for it: for its jailer
/// to reap it and die, or, after a few seconds, kills the jailer too.
pub fn stop(child: &mut Child) {
    if let Some(start) = start_time(child.id()) {
        kill(child.id(), start);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while matches!(child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
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
    fn this_process_has_cpu_time_that_grows_and_no_child_vmm() {
        let me = std::process::id();
        let before = cpu_ticks(me).expect("ticks");
        let started = std::time::Instant::now();
        while started.elapsed() < std::time::Duration::from_millis(100) {
            std::hint::black_box(0u64);
        }
        assert!(cpu_ticks(me).expect("ticks") >= before);
        assert_eq!(cpu_ticks(u32::MAX), None);
        assert_eq!(vmm_of(u32::MAX), u32::MAX);
    }

    #[test]
    fn this_process_is_alive_with_its_own_start_time() {
        let me = std::process::id();
        let start = start_time(me).expect("own stat");

        assert!(is_alive(me, start));
        assert!(!is_alive(me, start + 1));
    }

    #[test]
    fn a_drive_binds_its_image_read_only_under_an_overlay() {
        let raw = drive_binds("path=/t/rootfs.ext4");
        let cow = drive_binds("path=/t/rootfs.ext4,overlay=/run/x/o,id=root");
        let ro = drive_binds("/t/data.img,readonly");

        let b = |path: &str, writable| Bind {
            path: path.into(),
            writable,
        };
        assert_eq!(raw, vec![b("/t/rootfs.ext4", true)]);
        assert_eq!(cow, vec![b("/t/rootfs.ext4", false), b("/run/x", true)]);
        assert_eq!(ro, vec![b("/t/data.img", false)]);
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        let path = std::env::temp_dir().join(format!("husk-tail-{}", std::process::id()));
        std::fs::write(&path, "a\nb\nc\nd\n").expect("write");

        assert_eq!(tail(&path, 2), "c\nd");
        std::fs::remove_file(path).expect("cleanup");
    }
}
