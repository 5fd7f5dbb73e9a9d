//! The boot timeline: when each host phase ended, relative to the VMM's
//! `main`, so host work can be told apart from (slow, emulated) guest work.

use std::sync::OnceLock;
use std::time::Instant;

/// Phases in the order they happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The VMM's own set-up done (arguments, logging, scheduling, the
    /// SIGSYS report) and the seccomp filters ready (compiled at build
    /// time).
    FiltersReady,
    /// Restore only: the snapshot's state read, checked and decoded.
    StateLoaded,
    /// KVM opened and checked, VM created.
    VmCreated,
    /// Guest memory allocated (and prefaulted) or mapped, registered; irqchip and PIT created.
    MemoryReady,
    /// Kernel, initramfs, command line, zero page and MP table in memory.
    KernelLoaded,
    /// The VM's own state restored (restore only: interrupt controllers,
    /// clock),
    /// COM1 and the i8042 made and every virtio device attached (its MMIO
    /// range, ioeventfds and irqfd registered with KVM).
    DevicesReady,
    /// All vCPUs created and configured (restore: their saved state set).
    VcpusReady,
    /// vCPU 0 is about to enter KVM_RUN for the first time.
    FirstKvmRun,
    /// guest-init (PID 1) began: the kernel's own boot ended. Not seen by
    /// the host as it happens: counted back from the readiness line, which
    /// says how long guest-init took on the guest's clock.
    InitStarted,
    /// guest-init printed its readiness line.
    GuestReady,
    /// Restore only: the vsock transport reset was put in the guest's event
    /// queue (its old connections are gone).
    VsockResetSent,
    /// Restore only: the guest handed its event buffer back, so it has
    /// handled the reset and may be given new connections.
    VsockResetHandled,
    /// The guest accepted the first host-initiated vsock connection.
    VsockConnected,
    /// The guest sent its first data on a vsock connection (for a host
    /// client of the agent: the first reply).
    VsockFirstReply,
    /// The guest asked to be reset or powered off.
    GuestExit,
}

impl Phase {
    /// Every phase, in order.
    pub const ALL: [Phase; 15] = [
        Phase::FiltersReady,
        Phase::StateLoaded,
        Phase::VmCreated,
        Phase::MemoryReady,
        Phase::KernelLoaded,
        Phase::DevicesReady,
        Phase::VcpusReady,
        Phase::FirstKvmRun,
        Phase::InitStarted,
        Phase::GuestReady,
        Phase::VsockResetSent,
        Phase::VsockResetHandled,
        Phase::VsockConnected,
        Phase::VsockFirstReply,
        Phase::GuestExit,
    ];

    /// The name used in the JSON report.
    pub fn name(self) -> &'static str {
        match self {
            Phase::FiltersReady => "filters_ready",
            Phase::StateLoaded => "state_loaded",
            Phase::VmCreated => "vm_created",
            Phase::MemoryReady => "memory_ready",
            Phase::KernelLoaded => "kernel_loaded",
            Phase::DevicesReady => "devices_ready",
            Phase::VcpusReady => "vcpus_ready",
            Phase::FirstKvmRun => "first_kvm_run",
            Phase::InitStarted => "init_started",
            Phase::GuestReady => "guest_ready",
            Phase::VsockResetSent => "vsock_reset_sent",
            Phase::VsockResetHandled => "vsock_reset_handled",
            Phase::VsockConnected => "vsock_connected",
            Phase::VsockFirstReply => "vsock_first_reply",
            Phase::GuestExit => "guest_exit",
        }
    }
}

/// Timestamps of each phase; each is recorded once, from any thread.
#[derive(Debug)]
pub struct Timeline {
    start: Instant,
    /// CLOCK_MONOTONIC at the start, comparable across processes (a parent
    /// can tell how long the process took to reach `main`).
    start_monotonic_ns: u64,
    marks: [OnceLock<Instant>; Phase::ALL.len()],
}

/// CLOCK_MONOTONIC in nanoseconds: the same clock for every process.
pub fn monotonic_ns() -> u64 {
    // SAFETY: timespec is plain data that clock_gettime fills.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a valid clock id and a pointer to a live timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Default for Timeline {
    fn default() -> Self {
        Self::new()
    }
}

impl Timeline {
    /// A timeline starting now.
    pub fn new() -> Self {
        Timeline {
            start: Instant::now(),
            start_monotonic_ns: monotonic_ns(),
            marks: Default::default(),
        }
    }

    /// CLOCK_MONOTONIC (ns) when the timeline started.
    pub fn start_monotonic_ns(&self) -> u64 {
        self.start_monotonic_ns
    }

    /// Records the end of `phase`; later calls for the same phase are ignored.
    pub fn mark(&self, phase: Phase) {
        let _ = self.marks[phase as usize].set(Instant::now());
    }

    /// Records that `phase` ended at `at` (a moment worked out after the
    /// fact); ignored if it is already recorded or lies before the start.
    pub fn mark_at(&self, phase: Phase, at: Instant) {
        if at >= self.start {
            let _ = self.marks[phase as usize].set(at);
        }
    }

    /// Microseconds from the start to the end of `phase`, if it happened.
    pub fn elapsed_us(&self, phase: Phase) -> Option<u64> {
        self.marks[phase as usize]
            .get()
            .map(|t| t.duration_since(self.start).as_micros() as u64)
    }

    /// The phases that happened, as (name, microseconds since start).
    pub fn report(&self) -> Vec<(&'static str, u64)> {
        Phase::ALL
            .iter()
            .filter_map(|p| self.elapsed_us(*p).map(|us| (p.name(), us)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_once_and_reports_in_order() {
        let t = Timeline::new();

        t.mark(Phase::MemoryReady);
        let first = t.elapsed_us(Phase::MemoryReady);
        std::thread::sleep(std::time::Duration::from_millis(2));
        t.mark(Phase::MemoryReady);
        t.mark(Phase::VmCreated);

        assert_eq!(t.elapsed_us(Phase::MemoryReady), first);
        let names: Vec<_> = t.report().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, vec!["vm_created", "memory_ready"]);
    }
}
