//! Each VMM in a cgroup of its own (`husk/<sandbox id>`) with memory, CPU
//! and pid limits, on cgroup v2 where the unified hierarchy has the
//! controllers, else on the v1 controllers' own hierarchies (this build
//! machine's case: v1 controllers, an empty v2 hierarchy).
//!
//! The VMM joins its cgroup between fork and exec (`pre_exec`), so it
//! never runs a single instruction outside its limits.

use std::ffi::CString;
use std::path::{Path, PathBuf};

/// Which cgroup hierarchy the limits go to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// The unified hierarchy, mounted here.
    V2(PathBuf),
    /// The v1 controllers' mount points.
    V1 {
        /// The memory controller's mount point.
        memory: PathBuf,
        /// The cpu controller's mount point.
        cpu: PathBuf,
        /// The pids controller's mount point.
        pids: PathBuf,
    },
}

impl Hierarchy {
    /// Finds a hierarchy with the memory, cpu and pids controllers that
    /// this process may write to, or None.
    pub fn detect() -> Option<Self> {
        let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
        let mut v1 = (None, None, None);
        let mut v2 = None;
        for line in mounts.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [_, dir, fstype, options, ..] = fields.as_slice() else {
                continue;
            };
            let dir = PathBuf::from(dir);
            match *fstype {
                "cgroup2" => v2 = Some(dir),
                "cgroup" => {
                    let opts: Vec<&str> = options.split(',').collect();
                    if opts.contains(&"memory") {
                        v1.0 = Some(dir.clone());
                    }
                    if opts.contains(&"cpu") {
                        v1.1 = Some(dir.clone());
                    }
                    if opts.contains(&"pids") {
                        v1.2 = Some(dir);
                    }
                }
                _ => {}
            }
        }
        let writable = |p: &Path| {
            let c = CString::new(p.as_os_str().as_encoded_bytes()).unwrap_or_default();
            // SAFETY: access(2) with a valid C string.
            unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
        };
        if let Some(dir) = v2 {
            let controllers =
                std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
            let has = |c: &str| controllers.split_whitespace().any(|x| x == c);
            if has("memory") && has("cpu") && has("pids") && writable(&dir) {
                return Some(Hierarchy::V2(dir));
            }
        }
        match v1 {
            (Some(memory), Some(cpu), Some(pids))
                if writable(&memory) && writable(&cpu) && writable(&pids) =>
            {
                Some(Hierarchy::V1 { memory, cpu, pids })
            }
            _ => None,
        }
    }

    /// `v2` or `v1`.
    pub fn name(&self) -> &'static str {
        match self {
            Hierarchy::V2(_) => "v2",
            Hierarchy::V1 { .. } => "v1",
        }
    }
}

/// A VMM's limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most memory, in bytes (guest memory and the VMM's own).
    pub memory_bytes: u64,
    /// CPU time per 100 ms period, in microseconds.
    pub cpu_quota_us: u64,
    /// Most processes and threads.
    pub pids_max: u32,
}

const CPU_PERIOD_US: u64 = 100_000;

impl Limits {
    /// Limits for a VMM with `vcpus` and `mem_mib` of guest memory: the
    /// guest's memory plus room for the VMM itself, its vCPUs' time plus
    /// half a CPU for its device and API threads, and a few dozen threads.
    pub fn for_vm(vcpus: u8, mem_mib: u32) -> Self {
        Limits {
            memory_bytes: (u64::from(mem_mib) + 128) << 20,
            cpu_quota_us: u64::from(vcpus) * CPU_PERIOD_US + CPU_PERIOD_US / 2,
            pids_max: 64,
        }
    }
}

/// One sandbox's cgroup (in each controller's hierarchy on v1).
#[derive(Debug, Clone)]
pub struct Cgroup {
    dirs: Vec<PathBuf>,
    /// Where its CPU weight is set, and whether that is v2's `cpu.weight`
    /// (else v1's `cpu.shares`).
    cpu: PathBuf,
    v2: bool,
}

/// A cgroup's share of contended CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// A sandbox someone is using.
    Normal,
    /// A pool clone restoring or parked: it yields to the sandboxes in use.
    Background,
}

/// Errors setting up a cgroup.
#[derive(Debug, thiserror::Error)]
#[error(
    "cgroup {path}: {source} (run the daemon as root, or on a host whose cgroups it may manage)"
)]
pub struct CgroupError {
    path: PathBuf,
    #[source]
    source: std::io::Error,
}

fn write(path: PathBuf, value: &str) -> Result<(), CgroupError> {
    std::fs::write(&path, value).map_err(|source| CgroupError { path, source })
}

impl Cgroup {
    /// Creates `husk/<id>` with `limits`.
    pub fn create(h: &Hierarchy, id: &str, limits: Limits) -> Result<Self, CgroupError> {
        let mk = |base: &Path| -> Result<PathBuf, CgroupError> {
            let dir = base.join("husk").join(id);
            std::fs::create_dir_all(&dir).map_err(|source| CgroupError {
                path: dir.clone(),
                source,
            })?;
            Ok(dir)
        };
        let cg = match h {
            Hierarchy::V2(root) => {
                // The parent must hand the controllers down.
                let _ = write(root.join("cgroup.subtree_control"), "+memory +cpu +pids");
                let parent = root.join("husk");
                std::fs::create_dir_all(&parent).map_err(|source| CgroupError {
                    path: parent.clone(),
                    source,
                })?;
                write(parent.join("cgroup.subtree_control"), "+memory +cpu +pids")?;
                let dir = mk(root)?;
                write(dir.join("memory.max"), &limits.memory_bytes.to_string())?;
                write(dir.join("memory.swap.max"), "0").ok();
                write(
                    dir.join("cpu.max"),
                    &format!("{} {CPU_PERIOD_US}", limits.cpu_quota_us),
                )?;
                write(dir.join("pids.max"), &limits.pids_max.to_string())?;
                Cgroup {
                    cpu: dir.clone(),
                    dirs: vec![dir],
                    v2: true,
                }
            }
            Hierarchy::V1 { memory, cpu, pids } => {
                let m = mk(memory)?;
                write(
                    m.join("memory.limit_in_bytes"),
                    &limits.memory_bytes.to_string(),
                )?;
                let c = mk(cpu)?;
                write(c.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                write(c.join("cpu.cfs_quota_us"), &limits.cpu_quota_us.to_string())?;
                let p = mk(pids)?;
                write(p.join("pids.max"), &limits.pids_max.to_string())?;
                Cgroup {
                    cpu: c.clone(),
                    dirs: vec![m, c, p],
                    v2: false,
                }
            }
        };
        Ok(cg)
    }

    /// The sandbox's cgroup `id`, to remove (it need not exist).
    pub fn existing(h: &Hierarchy, id: &str) -> Self {
        match h {
            Hierarchy::V2(root) => Cgroup {
                dirs: vec![root.join("husk").join(id)],
                cpu: root.join("husk").join(id),
                v2: true,
            },
            Hierarchy::V1 { memory, cpu, pids } => Cgroup {
                dirs: [memory, cpu, pids]
                    .iter()
                    .map(|b| b.join("husk").join(id))
                    .collect(),
                cpu: cpu.join("husk").join(id),
                v2: false,
            },
        }
    }

    /// Sets its share of contended CPU (v1 `cpu.shares`, v2 `cpu.weight`:
    /// a background cgroup gets an eighth of a normal one's).
    pub fn set_priority(&self, priority: Priority) -> Result<(), CgroupError> {
        let (file, normal) = if self.v2 {
            ("cpu.weight", 100)
        } else {
            ("cpu.shares", 1024)
        };
        let value = match priority {
            Priority::Normal => normal,
            Priority::Background => normal / 8,
        };
        write(self.cpu.join(file), &value.to_string())
    }

    /// The `cgroup.procs` files a process joins, for [`join_in_child`].
    pub fn procs_files(&self) -> Vec<CString> {
        self.dirs
            .iter()
            .filter_map(|d| {
                CString::new(d.join("cgroup.procs").into_os_string().into_encoded_bytes()).ok()
            })
            .collect()
    }

    /// Removes the cgroup, killing whatever still runs in it (a VMM whose
    /// jailer was killed dies a moment later; nothing may outlive its
    /// sandbox). A cgroup still busy with exiting processes is tried again
    /// for a few seconds.
    pub fn remove(&self) {
        for d in &self.dirs {
            let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap_or_default();
            for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                // SAFETY: kill(2) on a pid in this sandbox's cgroup; no
                // memory is involved.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        for d in &self.dirs {
            let mut tries = 0;
            loop {
                match std::fs::remove_dir(d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) && tries < 250 => {
                        tries += 1;
                        std::thread::sleep(std::time::Duration::from_millis(20));
                    }
                    Err(e) => {
                        tracing::warn!("cannot remove cgroup {}: {e}", d.display());
                        break;
                    }
                }
            }
        }
    }
}

/// Writes the calling process's pid to each of `procs`. Runs between fork
/// and exec, so it allocates nothing and uses only async-signal-safe calls.
pub fn join_in_child(procs: &[CString]) -> std::io::Result<()> {
    // SAFETY: getpid cannot fail.
    let pid = unsafe { libc::getpid() };
    let mut digits = [0u8; 16];
    let mut n = pid as u32;
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let text = &digits[i..];
    for path in procs {
        // SAFETY: open/write/close with a valid C string and a live buffer.
        unsafe {
            let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let written = libc::write(fd, text.as_ptr().cast(), text.len());
            libc::close(fd);
            if written != text.len() as isize {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_leave_the_vmm_room_beyond_its_guest() {
        let l = Limits::for_vm(2, 256);

        assert_eq!(l.memory_bytes, 384 << 20);
        assert_eq!(l.cpu_quota_us, 250_000);
    }
}
