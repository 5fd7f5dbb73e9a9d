//! A task's Stats, as containerd's cgroup v1 metrics (what `ctr task
//! metrics` and the kubelet read): memory, pids and CPU are the VMM's
//! cgroup on the host (what the sandbox costs the host: guest memory it
//! touched, the VMM's own, its threads); `memory.rss` is what the guest
//! itself says is in use (its total less what it has available). A pod's
//! container reports its own cgroup in the pod's VM instead.

use std::path::{Path, PathBuf};

use containerd_shim::protos::cgroups::metrics::{
    CPUStat, CPUUsage, MemoryEntry, MemoryStat, Metrics, PidsStat,
};
use containerd_shim::protos::protobuf::MessageField;
use husk_protocol::Health;

const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The metrics of the sandbox whose VMM (or jailer) is `pid`.
pub fn metrics(pid: u32, guest: Option<&Health>) -> Metrics {
    let groups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let dir = |controller: &str| cgroup_dir(&groups, controller);
    let read = |dir: &Option<PathBuf>, file: &str| -> Option<u64> {
        let text = std::fs::read_to_string(dir.as_ref()?.join(file)).ok()?;
        text.trim().parse().ok()
    };
    let (memory, pids, cpu) = (dir("memory"), dir("pids"), dir("cpuacct"));
    let v2 = memory
        .as_ref()
        .is_some_and(|d| d.join("memory.current").exists());
    let (usage, limit, max) = if v2 {
        (
            read(&memory, "memory.current"),
            read(&memory, "memory.max"),
            read(&memory, "memory.peak"),
        )
    } else {
        (
            read(&memory, "memory.usage_in_bytes"),
            read(&memory, "memory.limit_in_bytes"),
            read(&memory, "memory.max_usage_in_bytes"),
        )
    };
    let cpu_ns = if v2 {
        cpu.as_ref()
            .and_then(|d| std::fs::read_to_string(d.join("cpu.stat")).ok())
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("usage_usec "))
                    .and_then(|n| n.trim().parse::<u64>().ok())
            })
            .map(|us| us * 1000)
    } else {
        read(&cpu, "cpuacct.usage")
    };
    let guest_used = guest.map_or(0, |h| {
        h.mem_total_kib.saturating_sub(h.mem_available_kib) * 1024
    });
    metrics_of(Figures {
        usage: usage.unwrap_or(0),
        limit: limit.unwrap_or(0),
        max: max.unwrap_or(0),
        rss: guest_used,
        tasks: read(&pids, "pids.current").unwrap_or(0),
        tasks_limit: read(&pids, "pids.max").unwrap_or(0),
        cpu_ns: cpu_ns.unwrap_or(0),
    })
}

/// The metrics of a pod's container, from its cgroup in the pod's VM
/// (what it uses of the VM: its memory, its limit, its CPU time, its
/// tasks).
pub fn container_metrics(usage: &husk_protocol::ContainerUsage) -> Metrics {
    let memory = usage.memory_bytes.unwrap_or(0);
    metrics_of(Figures {
        usage: memory,
        limit: usage.memory_max.unwrap_or(0),
        max: 0,
        rss: memory,
        tasks: usage.tasks,
        tasks_limit: 0,
        cpu_ns: usage.cpu_usec * 1000,
    })
}

/// What a task's metrics report (0: unknown or unbounded).
struct Figures {
    /// Memory in use, its limit, the most used.
    usage: u64,
    limit: u64,
    max: u64,
    /// Resident memory.
    rss: u64,
    tasks: u64,
    tasks_limit: u64,
    /// CPU time used.
    cpu_ns: u64,
}

fn metrics_of(f: Figures) -> Metrics {
    Metrics {
        memory: MessageField::some(MemoryStat {
            usage: MessageField::some(MemoryEntry {
                usage: f.usage,
                limit: f.limit,
                max: f.max,
                ..Default::default()
            }),
            rss: f.rss,
            total_rss: f.rss,
            ..Default::default()
        }),
        pids: MessageField::some(PidsStat {
            current: f.tasks,
            limit: f.tasks_limit,
            ..Default::default()
        }),
        cpu: MessageField::some(CPUStat {
            usage: MessageField::some(CPUUsage {
                total: f.cpu_ns,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The directory of `controller`'s cgroup for a process whose
/// `/proc/PID/cgroup` is `groups` (v1: that controller's hierarchy; v2:
/// the one unified hierarchy).
fn cgroup_dir(groups: &str, controller: &str) -> Option<PathBuf> {
    for line in groups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let rel = path.trim_start_matches('/');
        if controllers.is_empty() {
            return Some(Path::new(CGROUP_ROOT).join(rel));
        }
        if controllers.split(',').any(|c| c == controller) {
            // The hierarchy's mount: `cpu,cpuacct` or `cpuacct`.
            return Some(Path::new(CGROUP_ROOT).join(controllers).join(rel));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_dirs_for_v1_and_v2() {
        let v1 = "12:pids:/husk/sb-1\n4:cpu,cpuacct:/husk/sb-1\n3:memory:/husk/sb-1\n";
        assert_eq!(
            cgroup_dir(v1, "cpuacct").expect("test setup"),
            Path::new("/sys/fs/cgroup/cpu,cpuacct/husk/sb-1")
        );
        assert_eq!(
            cgroup_dir(v1, "memory").expect("test setup"),
            Path::new("/sys/fs/cgroup/memory/husk/sb-1")
        );
        assert_eq!(cgroup_dir(v1, "blkio"), None);
        let v2 = "0::/husk.slice/sb-1\n";
        assert_eq!(
            cgroup_dir(v2, "memory").expect("test setup"),
            Path::new("/sys/fs/cgroup/husk.slice/sb-1")
        );
    }
}
