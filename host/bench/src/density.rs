//! Density: N clones parked in the private daemon's warm pool at once, and
//! what each costs the host: the fall in `MemAvailable` (page cache dropped
//! first where the bench may), the kernel's share of it (slab, kernel
//! stacks, page tables, KVM's secondary page tables, vmalloc and per-CPU
//! allocations), and each VMM's own
//! mappings by kind (guest memory, heap, stacks, binary).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::report::{kib_field, MappingCost, Parked, SlabCost};

/// `/proc/meminfo` fields the figure needs, in KiB.
#[derive(Debug, Clone, Copy, Default)]
pub struct Meminfo {
    pub available: u64,
    pub slab: u64,
    pub kernel_stack: u64,
    pub page_tables: u64,
    pub secondary_page_tables: u64,
    pub vmalloc: u64,
    pub percpu: u64,
    pub cached: u64,
}

impl Meminfo {
    pub fn read() -> Result<Meminfo, String> {
        let text = std::fs::read_to_string("/proc/meminfo")
            .map_err(|e| format!("cannot read /proc/meminfo: {e}"))?;
        let field = |key: &str| kib_field(&text, key);
        Ok(Meminfo {
            available: field("MemAvailable"),
            slab: field("Slab"),
            kernel_stack: field("KernelStack"),
            page_tables: field("PageTables"),
            secondary_page_tables: field("SecPageTables"),
            vmalloc: field("VmallocUsed"),
            percpu: field("Percpu"),
            cached: field("Cached"),
        })
    }
}

/// Each slab cache's size in KiB (`num_slabs * pages_per_slab * 4`), from
/// `/proc/slabinfo` (root only: empty otherwise).
pub fn slab_caches() -> BTreeMap<String, u64> {
    let Ok(text) = std::fs::read_to_string("/proc/slabinfo") else {
        return BTreeMap::new();
    };
    text.lines()
        .skip(2)
        .filter_map(|line| {
            let (head, data) = line.split_once(": slabdata")?;
            let mut fields = head.split_whitespace();
            let name = fields.next()?.to_owned();
            let pages_per_slab: u64 = fields.nth(4)?.parse().ok()?;
            let num_slabs: u64 = data.split_whitespace().nth(1)?.parse().ok()?;
            Some((name, num_slabs * pages_per_slab * 4))
        })
        .collect()
}

/// Writes back and drops the page cache (root only); whether it did.
pub fn drop_caches() -> bool {
    // SAFETY: sync(2) takes no arguments.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// Every `husk-vmm` process below `root` (the daemon: a jailed VMM's
/// parent is its jailer).
pub fn vmms_below(root: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parent = |pid: u32| -> Option<u32> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // After the command's closing parenthesis: state, then the ppid.
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() == "husk-vmm")
        })
        .filter(|&pid| {
            let mut p = pid;
            for _ in 0..8 {
                match parent(p) {
                    Some(pp) if pp == root => return true,
                    Some(pp) if pp > 1 => p = pp,
                    _ => return false,
                }
            }
            false
        })
        .collect()
}

/// The kind of a mapping in `/proc/PID/smaps`, by its name.
fn kind(name: &str) -> &'static str {
    match name {
        "[heap]" => "heap",
        "[stack]" => "main thread's stack",
        "" => "anonymous: thread stacks, allocator arenas",
        n if n.starts_with("/memfd:") || n.contains("memory") || n.contains("snapshot") => {
            "guest memory"
        }
        n if n.starts_with('/') => "binary and libraries",
        _ => "other (vdso, vvar)",
    }
}

/// Adds `pid`'s mappings, by kind, to `into` (private, PSS in KiB); its
/// thread count.
fn add_mappings(pid: u32, into: &mut BTreeMap<&'static str, (u64, u64)>) -> Option<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let mut current = "";
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or_default();
        if first.contains('-') && !first.ends_with(':') {
            // An address range: the name is the sixth column onwards.
            current = kind(words.nth(4).unwrap_or_default());
            continue;
        }
        let value = || words.clone().next().and_then(|v| v.parse::<u64>().ok());
        let entry = into.entry(current).or_default();
        match first {
            "Private_Clean:" | "Private_Dirty:" => entry.0 += value().unwrap_or(0),
            "Pss:" => entry.1 += value().unwrap_or(0),
            _ => {}
        }
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The host's memory before the pool fills (caches dropped where allowed).
#[derive(Debug, Clone)]
pub struct Before {
    meminfo: Meminfo,
    slabs: BTreeMap<String, u64>,
    dropped: bool,
}

pub fn before() -> Result<Before, String> {
    let dropped = drop_caches();
    std::thread::sleep(Duration::from_secs(1));
    Ok(Before {
        meminfo: Meminfo::read()?,
        slabs: slab_caches(),
        dropped,
    })
}

/// The slab caches that grew most, per clone (at most 8).
fn grown_slabs(before: &BTreeMap<String, u64>, n: f64) -> Vec<(String, f64)> {
    let mut grown: Vec<(String, f64)> = slab_caches()
        .into_iter()
        .map(|(name, kib)| {
            let was = before.get(&name).copied().unwrap_or(0);
            let per = (kib as f64 - was as f64) / n;
            (name, per)
        })
        .filter(|(_, per)| *per >= 1.0)
        .collect();
    grown.sort_by(|a, b| b.1.total_cmp(&a.1));
    grown.truncate(8);
    grown
}

/// What `count` parked clones (the VMMs below `daemon`) cost, against
/// `before`.
pub fn measure(
    daemon: u32,
    count: usize,
    Before {
        meminfo: before,
        slabs,
        dropped,
    }: Before,
    since: Instant,
) -> Result<Parked, String> {
    // Let the last clone's guest settle into its pause.
    std::thread::sleep(Duration::from_secs(2));
    if dropped {
        drop_caches();
    }
    let after = Meminfo::read()?;
    let pids = vmms_below(daemon);
    if pids.len() < count {
        return Err(format!(
            "{} VMMs below the daemon for {count} parked clones",
            pids.len()
        ));
    }
    let n = pids.len() as f64;
    let mut kinds = BTreeMap::new();
    let threads: u64 = pids
        .iter()
        .filter_map(|&pid| add_mappings(pid, &mut kinds))
        .sum();
    let per = |b: u64, a: u64| (a as f64 - b as f64) / n;
    let host_kib_per_clone = per(after.available, before.available);
    Ok(Parked {
        count: pids.len(),
        fill_s: since.elapsed().as_secs_f64(),
        caches_dropped: dropped,
        host_kib_per_clone,
        per_gib: if host_kib_per_clone > 0.0 {
            1024.0 * 1024.0 / host_kib_per_clone
        } else {
            0.0
        },
        slab_kib: per(before.slab, after.slab),
        kernel_stack_kib: per(before.kernel_stack, after.kernel_stack),
        page_tables_kib: per(before.page_tables, after.page_tables),
        secondary_page_tables_kib: per(before.secondary_page_tables, after.secondary_page_tables),
        vmalloc_kib: per(before.vmalloc, after.vmalloc),
        percpu_kib: per(before.percpu, after.percpu),
        page_cache_kib: per(before.cached, after.cached),
        slab_caches: grown_slabs(&slabs, n)
            .into_iter()
            .map(|(name, kib)| SlabCost { name, kib })
            .collect(),
        threads_per_vmm: threads as f64 / n,
        vmm: kinds
            .into_iter()
            .map(|(kind, (private, pss))| MappingCost {
                kind: kind.to_owned(),
                private_kib: private as f64 / n,
                pss_kib: pss as f64 / n,
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mappings_are_sorted_by_their_names() {
        assert_eq!(kind("[heap]"), "heap");
        assert_eq!(kind(""), "anonymous: thread stacks, allocator arenas");
        assert_eq!(kind("/memfd:husk-guest-memory (deleted)"), "guest memory");
        assert_eq!(
            kind("/var/lib/husk/templates/t1/snapshot/memory"),
            "guest memory"
        );
        assert_eq!(
            kind("/usr/lib/x86_64-linux-gnu/libc.so.6"),
            "binary and libraries"
        );
        assert_eq!(kind("[vdso]"), "other (vdso, vvar)");
    }

    #[test]
    fn this_process_has_mappings_and_a_thread() {
        let mut kinds = BTreeMap::new();
        let threads = add_mappings(std::process::id(), &mut kinds).expect("own smaps");
        assert!(threads >= 1);
        assert!(kinds
            .get("binary and libraries")
            .is_some_and(|(_, pss)| *pss > 0));
    }
}
