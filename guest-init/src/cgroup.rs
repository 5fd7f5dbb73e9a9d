//! cgroup v2 for the programs the agent starts. Each program gets its own
//! cgroup under `sandbox/`, whose `pids.max` bounds everything started in
//! the sandbox: a fork bomb hits that limit while PID 1 and the agent, in
//! the root cgroup, keep their threads and can still fork. Killing a
//! program kills its cgroup (`cgroup.kill`), which also reaches processes
//! that left its process group or session.
//!
//! Where the guest kernel has the cpu controller, the sandbox cgroup gets
//! the lowest CPU weight: a program gets all the CPU the agent, PID 1 and
//! the kernel's workers (virtio, vsock) leave, but never delays them, so
//! the agent answers within seconds whatever runs in the sandbox; inside
//! it, each program's cgroup gets an equal share, so a program with
//! hundreds of processes does not starve one started after it. `kill_all`
//! empties the whole sandbox cgroup, which reaches what a program left
//! behind in a cgroup of its own after its exec returned.

use std::ffi::CString;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

const ROOT: &str = "/sys/fs/cgroup";
const SANDBOX: &str = "/sys/fs/cgroup/sandbox";
const PIDS_PARAM: &str = "husk.pids_max=";

static READY: AtomicBool = AtomicBool::new(false);
/// Whether the sandbox cgroup's children have the cpu controller, and the
/// guest the memory controller.
static CPU: AtomicBool = AtomicBool::new(false);
static MEMORY: AtomicBool = AtomicBool::new(false);
static NEXT: AtomicU64 = AtomicU64::new(1);
/// Cgroups that still had processes when their program was collected;
/// removal is retried when the next one is created.
static STALE: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Mounts cgroup2 and creates the sandbox cgroup; returns its pids limit.
/// The limit is `husk.pids_max=` from the kernel command line, or three
/// quarters of the kernel's thread limit, so the agent always has room.
pub fn setup(cmdline: &str) -> io::Result<u64> {
    // favordynmods: moving a task into a cgroup (every exec does) then
    // skips an RCU grace period, which costs about a second here.
    crate::sys::mount(
        "cgroup2",
        ROOT,
        "cgroup2",
        crate::sys::NOSUID_NODEV_NOEXEC,
        "favordynmods",
    )?;
    std::fs::write(format!("{ROOT}/cgroup.subtree_control"), "+pids")?;
    let controllers = std::fs::read_to_string(format!("{ROOT}/cgroup.controllers"))?;
    let has = |name: &str| controllers.split_whitespace().any(|c| c == name);
    let cpu =
        has("cpu") && std::fs::write(format!("{ROOT}/cgroup.subtree_control"), "+cpu").is_ok();
    // Enabled by the first container with a memory limit: until then no
    // program pays for a memory cgroup of its own.
    MEMORY.store(has("memory"), Ordering::SeqCst);
    match std::fs::create_dir(SANDBOX) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    if cpu {
        std::fs::write(format!("{SANDBOX}/cpu.weight"), "1")?;
    } else {
        crate::log("no cpu controller: sandbox programs compete with the agent for CPU");
    }
    let threads_max: u64 = std::fs::read_to_string("/proc/sys/kernel/threads-max")?
        .trim()
        .parse()
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    let limit = cmdline
        .split_whitespace()
        .find_map(|p| p.strip_prefix(PIDS_PARAM))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(threads_max * 3 / 4)
        .max(1);
    std::fs::write(format!("{SANDBOX}/pids.max"), limit.to_string())?;
    std::fs::write(format!("{SANDBOX}/cgroup.subtree_control"), "+pids")?;
    // Each program's cgroup then gets an equal share of the sandbox's CPU,
    // however many processes it has: a fork bomb does not starve the next
    // program either.
    if cpu {
        std::fs::write(format!("{SANDBOX}/cgroup.subtree_control"), "+cpu")?;
        CPU.store(true, Ordering::SeqCst);
    }
    READY.store(true, Ordering::SeqCst);
    Ok(limit)
}

/// SIGKILLs everything in the sandbox cgroup and waits (up to `limit`)
/// until it is all gone; returns how many tasks there were. Every program
/// the agent started and all they left behind are in it; PID 1 and the
/// agent are not.
pub fn kill_all(limit: std::time::Duration) -> io::Result<u64> {
    if !READY.load(Ordering::SeqCst) {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this guest has no sandbox cgroup (cgroup2 setup failed at boot)",
        ));
    }
    let current = || -> io::Result<u64> {
        std::fs::read_to_string(format!("{SANDBOX}/pids.current"))?
            .trim()
            .parse()
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidData))
    };
    let tasks = current()?;
    std::fs::write(format!("{SANDBOX}/cgroup.kill"), "1")?;
    let deadline = std::time::Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if current()? == 0 {
            return Ok(tasks);
        }
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{} tasks were still exiting after {limit:?}", current()?),
            ));
        }
        // Woken by each reap of a program; children of programs that are
        // reparented to PID 1 are reaped there too.
        crate::reaper::wait_any(left.min(std::time::Duration::from_millis(100)));
    }
}

/// The cgroup of one program.
#[derive(Debug)]
pub struct Cgroup {
    path: String,
    /// `cgroup.procs`, for the child to move itself into before exec.
    pub procs: CString,
}

/// A container's cgroup: its programs' cgroups go below it, its
/// `memory.max` bounds them together, and it counts what they use.
#[derive(Debug)]
pub struct Group {
    path: String,
}

impl Group {
    /// A new container cgroup whose programs together may use at most
    /// `memory_max` bytes (unbounded without). Where the guest has the
    /// memory controller it is enabled (by the first container: until
    /// then no program pays for it), so that the container's memory is
    /// counted.
    pub fn create(memory_max: Option<u64>) -> io::Result<Group> {
        let memory = MEMORY.load(Ordering::SeqCst);
        if !READY.load(Ordering::SeqCst) || (memory_max.is_some() && !memory) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "this guest has no memory cgroup controller (a template built with an older \
                 husk kernel): rebuild the template, or run the container without a memory limit",
            ));
        }
        if memory {
            for parent in [ROOT, SANDBOX] {
                std::fs::write(format!("{parent}/cgroup.subtree_control"), "+memory")?;
            }
        }
        let path = format!("{SANDBOX}/c{}", NEXT.fetch_add(1, Ordering::SeqCst));
        std::fs::create_dir(&path)?;
        let group = Group { path };
        if memory_max.is_some() {
            group.set_memory_max(memory_max)?;
        }
        std::fs::write(format!("{}/cgroup.subtree_control", group.path), "+pids")?;
        if CPU.load(Ordering::SeqCst) {
            std::fs::write(format!("{}/cgroup.subtree_control", group.path), "+cpu")?;
        }
        Ok(group)
    }

    /// Sets its memory limit anew (bytes; `None`: unbounded).
    pub fn set_memory_max(&self, memory_max: Option<u64>) -> io::Result<()> {
        if !MEMORY.load(Ordering::SeqCst) {
            return match memory_max {
                None => Ok(()),
                Some(_) => Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "this guest has no memory cgroup controller",
                )),
            };
        }
        let max = memory_max.map_or("max".to_owned(), |m| m.to_string());
        std::fs::write(format!("{}/memory.max", self.path), max)
    }

    /// Sets its CPU limit: `quota_us` microseconds of CPU time in each
    /// `period_us` (`None`: unbounded).
    pub fn set_cpu_max(&self, quota_us: Option<u64>, period_us: u64) -> io::Result<()> {
        let file = format!("{}/cpu.max", self.path);
        if !CPU.load(Ordering::SeqCst) || !std::path::Path::new(&file).exists() {
            return match quota_us {
                None => Ok(()),
                Some(_) => Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "this guest has no CPU bandwidth control (a template built with an older \
                     husk kernel): rebuild the template",
                )),
            };
        }
        let quota = quota_us.map_or("max".to_owned(), |q| q.to_string());
        std::fs::write(file, format!("{quota} {period_us}"))
    }

    /// What its programs use now.
    pub fn usage(&self) -> io::Result<husk_protocol::ContainerUsage> {
        let read = |file: &str| std::fs::read_to_string(format!("{}/{file}", self.path));
        let number = |file: &str| read(file).ok().and_then(|t| t.trim().parse::<u64>().ok());
        let cpu_usec = read("cpu.stat")?
            .lines()
            .find_map(|l| l.strip_prefix("usage_usec "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0);
        Ok(husk_protocol::ContainerUsage {
            memory_bytes: number("memory.current"),
            // "max" (none) does not parse.
            memory_max: number("memory.max"),
            cpu_usec,
            tasks: number("pids.current").unwrap_or(0),
        })
    }

    pub fn path(&self) -> &str {
        &self.path
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // Its programs' cgroups may still be there: retried after theirs
        // (STALE is retried in order).
        retire(&mut self.path);
    }
}

/// Removes cgroup `path`, or leaves it to be retried.
fn retire(path: &mut String) {
    if std::fs::remove_dir(&*path).is_err() {
        STALE
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(std::mem::take(path));
    }
}

impl Cgroup {
    /// Creates a fresh cgroup (below `parent`, a container's, or the
    /// sandbox's), with its own pids limit if asked. `None` when the guest
    /// has no cgroup support (then only process groups are used).
    pub fn create(pids_max: Option<u32>, parent: Option<&str>) -> io::Result<Option<Cgroup>> {
        if !READY.load(Ordering::SeqCst) {
            return Ok(None);
        }
        STALE
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|p| std::fs::remove_dir(p).is_err());
        let path = format!(
            "{}/p{}",
            parent.unwrap_or(SANDBOX),
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        std::fs::create_dir(&path)?;
        let cgroup = Cgroup {
            procs: crate::cstring(&format!("{path}/cgroup.procs"))?,
            path,
        };
        if let Some(max) = pids_max {
            std::fs::write(format!("{}/pids.max", cgroup.path), max.max(1).to_string())?;
        }
        Ok(Some(cgroup))
    }

    /// SIGKILLs every process in the cgroup.
    pub fn kill(&self) -> io::Result<()> {
        std::fs::write(format!("{}/cgroup.kill", self.path), "1")
    }

    /// Whether a process of the program is still alive (`cgroup.events`).
    pub fn populated(&self) -> bool {
        std::fs::read_to_string(format!("{}/cgroup.events", self.path))
            .map_or(true, |events| events.lines().any(|l| l == "populated 1"))
    }

    /// Waits until every process of the cgroup has exited and been reaped,
    /// so that their pids count against the sandbox's limit no more, or
    /// until `limit` passes; says whether it drained. Woken by each reap.
    pub fn wait_drained(&self, limit: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        let current = format!("{}/pids.current", self.path);
        loop {
            let drained = match std::fs::read_to_string(&current) {
                Ok(n) => n.trim() == "0",
                // No pids controller here: exited is the best we can see.
                Err(_) => !self.populated(),
            };
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if drained || left.is_zero() {
                return drained;
            }
            crate::reaper::wait_any(left.min(std::time::Duration::from_millis(100)));
        }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // Still populated (a daemon the program left behind) or dying:
        // retried.
        retire(&mut self.path);
    }
}
