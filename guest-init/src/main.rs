//! guest-init: PID 1 of every husk guest.
//!
//! It mounts the pseudo file systems, sets the hostname, prints one
//! machine-readable readiness line on the console, reaps orphans, and shuts
//! the machine down cleanly when asked. PID 1 must never exit: the kernel
//! panics if it does, so every error here is reported and survived.
//!
//! Readiness line (one write, so it is never interleaved):
//! `husk-guest-init: ready uptime_ms=<guest CLOCK_BOOTTIME ms> init_ms=<the same
//! clock when guest-init began> hostname=<name>` (the VMM splits a cold boot
//! into the kernel's part and guest-init's with the two).
//!
//! Shutdown: SIGUSR2 or SIGUSR1 (busybox `poweroff`/`halt`) and SIGTERM or
//! SIGINT (busybox `reboot`, Ctrl-Alt-Del) all end the VM the same way: a
//! microVM has nothing to reboot into, so guest-init syncs, stops every
//! process and asks the kernel to reboot, which with `reboot=k` pulses the
//! i8042 reset line and the VMM exits 0. (A plain power-off would only halt
//! the CPUs: there is no ACPI to turn the machine off.)
//!
//! Arguments after `--` on the kernel command line are run once the guest is
//! ready, with the console as stdio; guest-init prints
//! `husk-guest-init: exit status=<n>` (or `signal=<n>`) and shuts down.

mod agent;
mod cgroup;
mod conn;
mod container;
mod egress;
mod exec;
mod files;
mod image;
mod medium;
mod net;
mod ports;
mod probe;
mod process;
mod reaper;
mod ring;
mod simd;
mod splice;
mod sys;
mod unpack;
mod vsock;
mod watch;

use std::ffi::CString;
use std::io::Write;

const HOSTNAME_PARAM: &str = "husk.hostname=";
const DEFAULT_HOSTNAME: &str = "husk";

fn main() -> std::process::ExitCode {
    let started_ms = sys::uptime_ms();
    let args: Vec<String> = std::env::args().collect();
    let name = args
        .first()
        .map(|a| a.rsplit('/').next().unwrap_or(a).to_owned());
    if name.as_deref() == Some("husk-vsock-probe") {
        return probe::main(&args[1..]);
    }
    if std::process::id() != 1 {
        eprintln!("guest-init: must run as PID 1 of a husk guest");
        std::process::exit(1);
    }
    sys::block_signals();
    mount_all();
    sys::ensure_console();
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    if let Err(e) = cgroup::setup(&cmdline) {
        log(&format!(
            "no pids limit for sandbox programs: cgroup setup failed: {e}"
        ));
    }
    // With a balloon, freed memory goes back to the host in blocks of
    // this order: 2 MiB, not the kernel's 4 MiB default (no hugetlb),
    // which fragmentation makes rarer. No balloon: no such file.
    let _ = std::fs::write(
        "/sys/module/page_reporting/parameters/page_reporting_order",
        "9",
    );
    // Compaction only when an allocation needs it, never in the
    // background: kcompactd moving pages about costs every sandbox CPU
    // (and a clone private copies of the pages it moves).
    let _ = std::fs::write("/proc/sys/vm/compaction_proactiveness", "0");
    if let Err(e) = sys::exempt_from_oom() {
        log(&format!("the agent is not exempt from the OOM killer: {e}"));
    }
    image::load();
    // Decided once, before any program runs (see simd.rs).
    simd::glibc_tunables();
    let hostname = hostname_from_cmdline(&cmdline);
    if let Err(e) = sys::set_hostname(&hostname) {
        log(&format!("cannot set hostname: {e}"));
    }
    // The agent listens before readiness is announced, so "ready" means a
    // client can connect. Without a vsock device the guest still runs.
    let agent = match agent::start() {
        Ok(()) => format!("agent_port={}", husk_protocol::AGENT_PORT),
        Err(e) => {
            log(&format!("agent not started: {e}"));
            "agent=none".to_owned()
        }
    };
    if let Err(e) = egress::start() {
        log(&format!("no egress proxy for programs: {e}"));
    }
    if let Err(e) = ports::start() {
        log(&format!("no way in to the guest's ports: {e}"));
    }
    say(&format!(
        "ready uptime_ms={} init_ms={started_ms} hostname={hostname} {agent}",
        sys::uptime_ms()
    ));

    let command: Vec<String> = args[1..].to_vec();
    let mut child = None;
    if !command.is_empty() {
        match sys::spawn(&command) {
            Ok(pid) => child = Some(pid),
            Err(e) => {
                say(&format!("exit error=\"cannot run {}: {e}\"", command[0]));
                shutdown();
            }
        }
    }
    loop {
        match sys::wait_signal() {
            libc::SIGCHLD => {
                let exits = sys::reap_all();
                reaper::record(&exits);
                if let Some((_, exit)) = exits.iter().find(|(pid, _)| Some(*pid) == child) {
                    say(&format!("exit {}", sys::describe(exit.status)));
                    shutdown();
                }
            }
            libc::SIGUSR1 | libc::SIGUSR2 | libc::SIGTERM | libc::SIGINT => shutdown(),
            _ => {}
        }
    }
}

/// Mounts what every guest program expects. Failures are logged, not fatal.
fn mount_all() {
    let mounts: [(&str, &str, &str, libc::c_ulong, &str); 6] = [
        ("proc", "/proc", "proc", sys::NOSUID_NODEV_NOEXEC, ""),
        ("sysfs", "/sys", "sysfs", sys::NOSUID_NODEV_NOEXEC, ""),
        ("devtmpfs", "/dev", "devtmpfs", libc::MS_NOSUID, "mode=0755"),
        // PTYs for Exec with a terminal (/dev/ptmx finds its devpts here).
        (
            "devpts",
            "/dev/pts",
            "devpts",
            libc::MS_NOSUID | libc::MS_NOEXEC,
            "mode=0620,ptmxmode=0666",
        ),
        (
            "tmpfs",
            "/tmp",
            "tmpfs",
            libc::MS_NOSUID | libc::MS_NODEV,
            "mode=1777",
        ),
        (
            "tmpfs",
            "/run",
            "tmpfs",
            libc::MS_NOSUID | libc::MS_NODEV,
            "mode=0755",
        ),
    ];
    // An initramfs root is a tmpfs whose root directory the kernel makes
    // world-writable (1777); a sandbox user must not write to `/`.
    {
        use std::os::unix::fs::PermissionsExt;
        let world_writable =
            std::fs::metadata("/").is_ok_and(|m| m.permissions().mode() & 0o002 != 0);
        if world_writable {
            if let Err(e) = std::fs::set_permissions("/", std::fs::Permissions::from_mode(0o755)) {
                log(&format!("cannot make / 0755: {e}"));
            }
        }
    }
    for (source, target, fstype, flags, data) in mounts {
        if let Err(e) = sys::mount(source, target, fstype, flags, data) {
            log(&format!("cannot mount {fstype} on {target}: {e}"));
        }
    }
}

fn hostname_from_cmdline(cmdline: &str) -> String {
    cmdline
        .split_whitespace()
        .find_map(|p| p.strip_prefix(HOSTNAME_PARAM))
        .filter(|h| !h.is_empty() && h.len() <= 64)
        .unwrap_or(DEFAULT_HOSTNAME)
        .to_owned()
}

/// Syncs, stops every other process and resets the machine. Never returns.
fn shutdown() -> ! {
    say("shutdown");
    sys::sync();
    sys::kill_all(libc::SIGTERM);
    std::thread::sleep(std::time::Duration::from_millis(100));
    sys::kill_all(libc::SIGKILL);
    sys::sync();
    // Read-only before the reset: a disk root is then clean (journal flushed).
    if let Err(e) = sys::remount_root_read_only() {
        log(&format!("cannot remount / read-only: {e}"));
    }
    let err = sys::reboot();
    // Still here: the kernel refused. Keep PID 1 alive rather than panic.
    log(&format!("reboot failed: {err}"));
    loop {
        sys::wait_signal();
    }
}

/// A protocol line on the console.
fn say(message: &str) {
    let line = format!("husk-guest-init: {message}\n");
    let _ = std::io::stdout().write_all(line.as_bytes());
}

/// A diagnostic on the console.
pub(crate) fn log(message: &str) {
    let line = format!("husk-guest-init: warning: {message}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// A C string for a path that came from our own constants or the command line.
fn cstring(s: &str) -> std::io::Result<CString> {
    CString::new(s).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
}
