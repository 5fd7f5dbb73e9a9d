//! The host scheduler's slice for husk's own threads: the VMM's and the
//! daemon's.
//!
//! Linux 6.12 and later (EEVDF) let a thread of the normal policy ask for a
//! slice between 0.1 and 100 ms: how long it runs before another task of
//! the same weight may take the CPU, and so how soon it is picked when it
//! wakes. It changes when a thread runs, not how much CPU it gets. Older
//! kernels ignore or refuse it, which only costs speed.

use std::time::Duration;

/// The slice of threads that run for microseconds at a time and should
/// not wait behind a busy neighbour's slice: the VMM's own (start-up,
/// control, devices; not its vCPUs) and the daemon's. The shortest there
/// is. With both cores of a PVM host busy, a restore's thread start took
/// 3.7 ms to reach the first KVM_RUN with the default slice and 0.3-1.4 ms
/// with this one.
pub const SHORT_SLICE: Duration = Duration::from_micros(100);

/// `struct sched_attr` of sched_setattr(2) (its first version, 56 bytes).
#[repr(C)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime: u64,
    deadline: u64,
    period: u64,
    util_min: u32,
    util_max: u32,
}

/// Asks the scheduler to run the calling thread (normal policy, its nice
/// value kept) for up to `slice` at a time, or with the scheduler's
/// default slice (`None`). Threads started afterwards inherit it. A
/// refusal (an older kernel) only costs speed: callers log it.
pub fn set_slice(slice: Option<Duration>) -> std::io::Result<()> {
    // SAFETY: getpriority(PRIO_PROCESS, 0) only reads the calling
    // thread's nice value.
    let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        policy: libc::SCHED_OTHER as u32,
        flags: 0,
        nice,
        priority: 0,
        // 0: the default slice.
        runtime: slice.map_or(0, |s| u64::try_from(s.as_nanos()).unwrap_or(u64::MAX)),
        deadline: 0,
        period: 0,
        util_min: 0,
        util_max: 0,
    };
    // SAFETY: `attr` is a valid sched_attr whose `size` says how much of it
    // the kernel may read; pid 0 is the calling thread; flags are 0.
    let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
    match rc {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}
