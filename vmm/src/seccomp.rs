//! Seccomp filters, one per kind of VMM thread, installed by each thread
//! before it serves the guest (a vCPU before its first `KVM_RUN`, the device
//! loop before its first event, the control loop once the others run).
//! A syscall or ioctl not listed here is trapped: the thread logs which
//! one, and the process dies by SIGSYS. Filters stack, and threads inherit
//! their creator's, so the control thread installs its own last.
//!
//! Every entry says why the thread needs it. Found with `strace -ff` on a
//! boot, exec, file copies both ways, pause, resume and snapshot, and kept
//! honest by the whole test suite running with the filters on.

use std::cell::Cell;
use std::collections::BTreeMap;

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid2, kvm_debugregs, kvm_dirty_log, kvm_irqchip, kvm_lapic_state,
    kvm_mp_state, kvm_msrs, kvm_regs, kvm_sregs, kvm_userspace_memory_region, kvm_vcpu_events,
    kvm_xcrs, kvm_xsave,
};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};
use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iow_nr, ioctl_iowr_nr};

const KVMIO: u32 = 0xAE;
ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_regs);
ioctl_ior_nr!(KVM_GET_SREGS, KVMIO, 0x83, kvm_sregs);
ioctl_iowr_nr!(KVM_GET_MSRS, KVMIO, 0x88, kvm_msrs);
ioctl_ior_nr!(KVM_GET_LAPIC, KVMIO, 0x8e, kvm_lapic_state);
ioctl_iowr_nr!(KVM_GET_CPUID2, KVMIO, 0x91, kvm_cpuid2);
ioctl_ior_nr!(KVM_GET_MP_STATE, KVMIO, 0x98, kvm_mp_state);
ioctl_ior_nr!(KVM_GET_VCPU_EVENTS, KVMIO, 0x9f, kvm_vcpu_events);
ioctl_ior_nr!(KVM_GET_DEBUGREGS, KVMIO, 0xa1, kvm_debugregs);
ioctl_io_nr!(KVM_GET_TSC_KHZ, KVMIO, 0xa3);
ioctl_ior_nr!(KVM_GET_XSAVE, KVMIO, 0xa4, kvm_xsave);
ioctl_ior_nr!(KVM_GET_XCRS, KVMIO, 0xa6, kvm_xcrs);
ioctl_io_nr!(KVM_KVMCLOCK_CTRL, KVMIO, 0xad);
ioctl_ior_nr!(KVM_GET_XSAVE2, KVMIO, 0xcf, kvm_xsave);
ioctl_ior_nr!(KVM_GET_CLOCK, KVMIO, 0x7c, kvm_clock_data);
ioctl_iowr_nr!(KVM_GET_IRQCHIP, KVMIO, 0x62, kvm_irqchip);
ioctl_iow_nr!(
    KVM_SET_USER_MEMORY_REGION,
    KVMIO,
    0x46,
    kvm_userspace_memory_region
);
ioctl_iow_nr!(KVM_GET_DIRTY_LOG, KVMIO, 0x42, kvm_dirty_log);
/// Non-blocking mode, as std's `set_nonblocking` sets it.
const FIONBIO: u64 = 0x5421;

/// The kinds of VMM thread, each with its own filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadKind {
    /// The control loop: API requests (pause, resume, snapshot), signals,
    /// the guest's exit.
    Control = 1,
    /// The devices' event loop: virtio queues, vsock and TAP traffic.
    Devices = 2,
    /// A vCPU: `KVM_RUN` and the port and MMIO exits it serves.
    Vcpu = 3,
}

impl ThreadKind {
    fn name(self) -> &'static str {
        match self {
            ThreadKind::Control => "control",
            ThreadKind::Devices => "devices",
            ThreadKind::Vcpu => "vcpu",
        }
    }

    /// `control`, `devices` or `vcpu`.
    pub fn parse(name: &str) -> Option<Self> {
        [ThreadKind::Control, ThreadKind::Devices, ThreadKind::Vcpu]
            .into_iter()
            .find(|k| k.name() == name)
    }
}

/// Errors building or installing a filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("cannot build the {0} thread's seccomp filter: {1}")]
    Build(&'static str, String),
    #[error("cannot install the {0} thread's seccomp filter: {1}")]
    Install(&'static str, String),
}

/// Syscalls every thread makes, with why.
const COMMON: &[(i64, &str)] = &[
    (libc::SYS_read, "eventfds, sockets, files"),
    (libc::SYS_write, "eventfds (interrupts, wake-ups), the log on stderr"),
    (libc::SYS_close, "dropping descriptors"),
    (libc::SYS_futex, "locks and channels between threads"),
    (libc::SYS_mmap, "the allocator"),
    (libc::SYS_munmap, "the allocator"),
    (libc::SYS_mremap, "the allocator"),
    (libc::SYS_mprotect, "the allocator"),
    (libc::SYS_madvise, "the allocator returning memory"),
    (libc::SYS_brk, "the allocator"),
    (
        libc::SYS_openat,
        "glibc's allocator reads /proc/sys/vm/overcommit_memory once, on whichever thread first trims; the jail bounds what any open can reach",
    ),
    (libc::SYS_fstat, "std's file metadata"),
    (libc::SYS_newfstatat, "std's file metadata"),
    (libc::SYS_statx, "std's file metadata"),
    (libc::SYS_lseek, "file positions"),
    (libc::SYS_fcntl, "descriptor flags (std checks and sets CLOEXEC)"),
    (libc::SYS_clock_gettime, "timestamps (also served by the vDSO)"),
    (libc::SYS_clock_nanosleep, "short waits"),
    (libc::SYS_nanosleep, "short waits"),
    (libc::SYS_sched_yield, "spinning locks"),
    (libc::SYS_gettid, "logging, the SIGSYS report"),
    (libc::SYS_getpid, "logging, the SIGSYS report"),
    (libc::SYS_getrandom, "hash map seeds"),
    (libc::SYS_rt_sigprocmask, "signal masks (SIGTERM/SIGINT go to a signalfd)"),
    (libc::SYS_rt_sigreturn, "returning from the vCPU kick and SIGSYS handlers"),
    (libc::SYS_rt_sigaction, "the SIGSYS report restores the default action"),
    (libc::SYS_sigaltstack, "signal stacks of exiting threads"),
    (libc::SYS_tgkill, "kicking a vCPU out of KVM_RUN; abort and SIGSYS re-raise"),
    (libc::SYS_restart_syscall, "syscalls interrupted by the vCPU kick"),
    (libc::SYS_exit, "a thread ending"),
    (libc::SYS_exit_group, "the VMM ending"),
    (libc::SYS_rseq, "glibc's restartable sequences"),
];

/// The control loop's syscalls beyond [`COMMON`].
const CONTROL: &[(i64, &str)] = &[
    (libc::SYS_epoll_wait, "its event loop"),
    (libc::SYS_epoll_pwait, "its event loop"),
    (libc::SYS_epoll_ctl, "its event loop"),
    (libc::SYS_accept4, "control socket connections"),
    (libc::SYS_recvfrom, "control requests"),
    (libc::SYS_sendto, "control replies"),
    (libc::SYS_setsockopt, "control connection timeouts"),
    (libc::SYS_shutdown, "closing control connections"),
    (
        libc::SYS_pread64,
        "snapshots: reading disk layers and /proc/self/pagemap",
    ),
    (libc::SYS_pwrite64, "snapshots: memory and state files"),
    (
        libc::SYS_copy_file_range,
        "snapshots: copying disk clusters",
    ),
    (libc::SYS_ftruncate, "snapshots: file sizes"),
    (libc::SYS_fallocate, "snapshots: file sizes"),
    (libc::SYS_fsync, "snapshots: durable files"),
    (libc::SYS_fdatasync, "snapshots: durable files"),
    (libc::SYS_mkdir, "snapshots: the directory"),
    (libc::SYS_mkdirat, "snapshots: the directory"),
    (libc::SYS_rename, "snapshots: atomic file names"),
    (libc::SYS_renameat, "snapshots: atomic file names"),
    (libc::SYS_renameat2, "snapshots: atomic file names"),
    (
        libc::SYS_unlink,
        "snapshots: temporary files; the sockets at exit",
    ),
    (
        libc::SYS_unlinkat,
        "snapshots: temporary files; the sockets at exit",
    ),
    (libc::SYS_readlink, "canonical paths of snapshot files"),
    (libc::SYS_readlinkat, "canonical paths of snapshot files"),
    (libc::SYS_getdents64, "snapshots: reading a directory"),
    (libc::SYS_getcwd, "canonical paths of snapshot files"),
];

/// The device loop's syscalls beyond [`COMMON`].
const DEVICES: &[(i64, &str)] = &[
    (libc::SYS_epoll_wait, "its event loop"),
    (libc::SYS_epoll_pwait, "its event loop"),
    (libc::SYS_epoll_ctl, "its event loop"),
    (libc::SYS_pread64, "virtio-block reads"),
    (libc::SYS_pwrite64, "virtio-block writes"),
    (libc::SYS_preadv, "virtio-block reads"),
    (libc::SYS_pwritev, "virtio-block writes"),
    (libc::SYS_readv, "TAP frames"),
    (libc::SYS_writev, "TAP frames"),
    (libc::SYS_fsync, "virtio-block flush"),
    (libc::SYS_fdatasync, "virtio-block flush"),
    (libc::SYS_fallocate, "virtio-block discard and write-zeroes"),
    (
        libc::SYS_accept4,
        "host programs connecting to the vsock socket",
    ),
    (
        libc::SYS_socket,
        "guest vsock connections to host Unix sockets",
    ),
    (
        libc::SYS_connect,
        "guest vsock connections to host Unix sockets",
    ),
    (libc::SYS_recvfrom, "vsock stream data"),
    (libc::SYS_sendto, "vsock stream data"),
    (libc::SYS_shutdown, "vsock half-closes"),
    (
        libc::SYS_timerfd_settime,
        "block and net rate limiters arm their timers",
    ),
];

/// A vCPU's syscalls beyond [`COMMON`].
const VCPU: &[(i64, &str)] = &[(libc::SYS_pwrite64, "the serial console file")];

/// ioctls (request numbers) by thread kind, with why.
fn ioctls(kind: ThreadKind) -> Vec<(u64, &'static str)> {
    let mut list = vec![(FIONBIO, "std's set_nonblocking")];
    match kind {
        ThreadKind::Control => list.extend([
            (KVM_GET_CLOCK(), "snapshot: the VM's clock"),
            (KVM_GET_IRQCHIP(), "snapshot: the interrupt controllers"),
            (KVM_GET_DIRTY_LOG(), "diff snapshots: pages written"),
            (
                KVM_SET_USER_MEMORY_REGION(),
                "diff snapshots: turning dirty logging on",
            ),
        ]),
        ThreadKind::Devices => {}
        ThreadKind::Vcpu => list.extend([
            (KVM_RUN(), "running the guest"),
            (KVM_KVMCLOCK_CTRL(), "telling the guest it was paused"),
            (KVM_GET_REGS(), "snapshot: registers"),
            (KVM_GET_SREGS(), "snapshot: registers"),
            (KVM_GET_MSRS(), "snapshot: MSRs"),
            (KVM_GET_LAPIC(), "snapshot: the local APIC"),
            (KVM_GET_CPUID2(), "snapshot: CPUID"),
            (KVM_GET_MP_STATE(), "snapshot: run state"),
            (KVM_GET_VCPU_EVENTS(), "snapshot: pending events"),
            (KVM_GET_DEBUGREGS(), "snapshot: debug registers"),
            (KVM_GET_TSC_KHZ(), "snapshot: TSC frequency"),
            (KVM_GET_XSAVE(), "snapshot: FPU state"),
            (KVM_GET_XSAVE2(), "snapshot: FPU state"),
            (KVM_GET_XCRS(), "snapshot: XCRs"),
        ]),
    }
    list
}

/// The filter of `kind`.
pub fn filter(kind: ThreadKind) -> Result<BpfProgram, SeccompError> {
    let build = |e: seccompiler::BackendError| SeccompError::Build(kind.name(), e.to_string());
    let own = match kind {
        ThreadKind::Control => CONTROL,
        ThreadKind::Devices => DEVICES,
        ThreadKind::Vcpu => VCPU,
    };
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = COMMON
        .iter()
        .chain(own)
        .map(|(nr, _why)| (*nr, Vec::new()))
        .collect();
    let ioctl_rules = ioctls(kind)
        .into_iter()
        .map(|(request, _why)| {
            SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, request)
                .and_then(|c| SeccompRule::new(vec![c]))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(build)?;
    rules.insert(libc::SYS_ioctl, ioctl_rules);
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Trap,
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .map_err(build)?;
    filter.try_into().map_err(build)
}

thread_local! {
    /// This thread's kind, for the SIGSYS report (const: no lazy set-up
    /// inside a signal handler).
    static KIND: Cell<u8> = const { Cell::new(0) };
}

/// Whether the VMM's threads get their filters, and the tests' switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeccompPolicy {
    pub enabled: bool,
    /// Make this kind of thread try a forbidden syscall once its filter is
    /// on (tests only: the process must die by SIGSYS).
    pub selftest: Option<ThreadKind>,
}

impl Default for SeccompPolicy {
    fn default() -> Self {
        SeccompPolicy {
            enabled: true,
            selftest: None,
        }
    }
}

/// The filters of every thread kind, built before any thread starts.
#[derive(Debug, Clone)]
pub struct Filters {
    programs: Option<[BpfProgram; 3]>,
    selftest: Option<ThreadKind>,
}

impl Filters {
    pub fn new(policy: SeccompPolicy) -> Result<Self, SeccompError> {
        let programs = if policy.enabled {
            Some([
                filter(ThreadKind::Control)?,
                filter(ThreadKind::Devices)?,
                filter(ThreadKind::Vcpu)?,
            ])
        } else {
            None
        };
        Ok(Filters {
            programs,
            selftest: policy.selftest,
        })
    }

    /// Installs `kind`'s filter on the calling thread. A thread that cannot
    /// be filtered must not serve the guest: the VMM exits.
    pub fn enter(&self, kind: ThreadKind) {
        let Some(programs) = &self.programs else {
            return;
        };
        KIND.with(|k| k.set(kind as u8));
        if let Err(e) = seccompiler::apply_filter(&programs[kind as usize - 1]) {
            tracing::error!("{}", SeccompError::Install(kind.name(), e.to_string()));
            std::process::exit(1);
        }
        if self.selftest == Some(kind) {
            forbidden_syscall();
        }
    }
}

/// Installs the SIGSYS handler that reports a forbidden syscall before the
/// process dies. Call once, before any filter.
pub fn install_report() {
    // SAFETY: a zeroed sigaction with a handler of the right signature and
    // SA_SIGINFO; sigaction(2) copies it.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = report as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut());
    }
}

/// The SIGSYS handler: says which thread made which syscall, then lets the
/// pending SIGSYS kill the process when the handler returns.
extern "C" fn report(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: for SIGSYS the kernel fills siginfo's `_sigsys` member: the
    // syscall number is the int at byte 24 (after signo, errno, code, the
    // padding and the call address).
    let nr = unsafe { *(info as *const u8).add(24).cast::<libc::c_int>() };
    let name = match KIND.with(Cell::get) {
        1 => ThreadKind::Control.name(),
        2 => ThreadKind::Devices.name(),
        3 => ThreadKind::Vcpu.name(),
        _ => "unknown",
    };
    let mut line = [0u8; 96];
    let mut w = Cursor {
        buf: &mut line,
        len: 0,
    };
    w.put(b"husk-vmm: seccomp: the ");
    w.put(name.as_bytes());
    w.put(b" thread made forbidden syscall ");
    w.number(nr);
    w.put(b"; exiting\n");
    let len = w.len;
    // SAFETY: write(2), signal(2) and tgkill(2) are async-signal-safe; the
    // buffer is live; SIGSYS stays blocked until this handler returns, then
    // its default action ends the process.
    unsafe {
        libc::write(2, line.as_ptr().cast(), len);
        libc::signal(libc::SIGSYS, libc::SIG_DFL);
        libc::syscall(
            libc::SYS_tgkill,
            libc::getpid(),
            libc::syscall(libc::SYS_gettid),
            libc::SIGSYS,
        );
    }
}

/// Formats into a fixed buffer without allocating (for the handler).
struct Cursor<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl Cursor<'_> {
    fn put(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&bytes[..n]);
        self.len += n;
    }

    fn number(&mut self, n: i32) {
        let mut digits = [0u8; 12];
        let mut i = digits.len();
        let mut v = n.unsigned_abs();
        loop {
            i -= 1;
            digits[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        if n < 0 {
            i -= 1;
            digits[i] = b'-';
        }
        self.put(&digits[i..]);
    }
}

/// Tries a syscall no filter allows (`ptrace`), which must end the process
/// by SIGSYS (see [`SeccompPolicy::selftest`]).
fn forbidden_syscall() {
    // SAFETY: PTRACE_TRACEME has no memory arguments; the filter stops it.
    unsafe { libc::syscall(libc::SYS_ptrace, libc::PTRACE_TRACEME, 0, 0, 0) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_filter_builds() {
        for kind in [ThreadKind::Control, ThreadKind::Devices, ThreadKind::Vcpu] {
            let program = filter(kind).expect("filter");
            assert!(!program.is_empty(), "{kind:?}");
        }
    }

    #[test]
    fn no_thread_may_exec_fork_or_trace() {
        let allowed = |nr: i64| {
            COMMON
                .iter()
                .chain(CONTROL)
                .chain(DEVICES)
                .chain(VCPU)
                .any(|(n, _)| *n == nr)
        };

        for nr in [
            libc::SYS_execve,
            libc::SYS_execveat,
            libc::SYS_fork,
            libc::SYS_vfork,
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_ptrace,
            libc::SYS_mount,
            libc::SYS_setuid,
            libc::SYS_kill,
            libc::SYS_bpf,
            libc::SYS_process_vm_writev,
        ] {
            assert!(!allowed(nr), "syscall {nr} is allowed");
        }
    }

    #[test]
    fn the_ioctl_numbers_are_the_kernels() {
        // From linux/kvm.h, as strace decodes them.
        assert_eq!(KVM_RUN(), 0xae80);
        assert_eq!(KVM_GET_REGS(), 0x8090_ae81);
        assert_eq!(KVM_GET_SREGS(), 0x8138_ae83);
        assert_eq!(KVM_SET_USER_MEMORY_REGION(), 0x4020_ae46);
        assert_eq!(KVM_GET_CLOCK(), 0x8030_ae7c);
    }

    #[test]
    fn the_report_line_formats_numbers_without_allocating() {
        let mut buf = [0u8; 32];
        let mut w = Cursor {
            buf: &mut buf,
            len: 0,
        };
        w.put(b"nr ");
        w.number(-101);
        w.put(b" ");
        w.number(0);

        assert_eq!(&w.buf[..w.len], b"nr -101 0");
    }
}
