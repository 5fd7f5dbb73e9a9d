//! The VMM threads' seccomp rules: which syscalls and ioctls each kind of
//! thread may make, and why. Compiled into BPF by the build script (this
//! file is its module too), so a VMM starts with its filters ready; the
//! crate's tests compile them again and compare.

use std::collections::BTreeMap;

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid2, kvm_debugregs, kvm_device_attr, kvm_dirty_log, kvm_irqchip,
    kvm_lapic_state, kvm_mp_state, kvm_msrs, kvm_regs, kvm_sregs, kvm_userspace_memory_region,
    kvm_vcpu_events, kvm_xcrs, kvm_xsave,
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
ioctl_iow_nr!(KVM_GET_DEVICE_ATTR, KVMIO, 0xe2, kvm_device_attr);
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
    Fs = 4,
}

impl ThreadKind {
    pub fn name(self) -> &'static str {
        match self {
            ThreadKind::Control => "control",
            ThreadKind::Devices => "devices",
            ThreadKind::Vcpu => "vcpu",
            ThreadKind::Fs => "fs",
        }
    }

    /// `control`, `devices` or `vcpu`.
    pub fn parse(name: &str) -> Option<Self> {
        [
            ThreadKind::Control,
            ThreadKind::Devices,
            ThreadKind::Vcpu,
            ThreadKind::Fs,
        ]
        .into_iter()
        .find(|k| k.name() == name)
    }
}

/// Syscalls every thread makes, with why.
pub const COMMON: &[(i64, &str)] = &[
    (libc::SYS_read, "eventfds, sockets, files"),
    (libc::SYS_write, "eventfds (interrupts, wake-ups), the log on stderr"),
    (libc::SYS_close, "dropping descriptors"),
    (libc::SYS_futex, "locks and channels between threads"),
    (libc::SYS_mmap, "the allocator"),
    (libc::SYS_munmap, "the allocator"),
    (libc::SYS_mremap, "the allocator"),
    (libc::SYS_mprotect, "the allocator"),
    (
        libc::SYS_madvise,
        "the allocator returning memory; the balloon dropping memory the guest freed",
    ),
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
pub const CONTROL: &[(i64, &str)] = &[
    (libc::SYS_epoll_wait, "its event loop"),
    (libc::SYS_epoll_pwait, "its event loop"),
    (libc::SYS_epoll_ctl, "its event loop"),
    (libc::SYS_accept4, "control socket connections"),
    (libc::SYS_recvfrom, "std's reads of sockets"),
    (
        libc::SYS_recvmsg,
        "control requests, and the directory a share request passes",
    ),
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
    (
        libc::SYS_ftruncate,
        "snapshots and a new medium's overlay: file sizes",
    ),
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
/// The shared directories' thread (virtio-fs): file system calls beneath
/// the shares' descriptors, which no other thread makes.
pub const FS: &[(i64, &str)] = &[
    (libc::SYS_epoll_wait, "its event loop"),
    (libc::SYS_epoll_pwait, "its event loop"),
    (libc::SYS_epoll_ctl, "its event loop"),
    (
        libc::SYS_openat2,
        "lookups beneath a share (RESOLVE_BENEATH)",
    ),
    (
        libc::SYS_open,
        "reopening a looked-up file through /proc/self/fd",
    ),
    (libc::SYS_pread64, "reads"),
    (libc::SYS_pwrite64, "writes"),
    (libc::SYS_getdents64, "directory listings"),
    (libc::SYS_mkdirat, "mkdir"),
    (libc::SYS_mknodat, "FIFOs and sockets (never device nodes)"),
    (libc::SYS_symlinkat, "symlink"),
    (libc::SYS_linkat, "hard links within a share"),
    (libc::SYS_unlinkat, "unlink, rmdir"),
    (libc::SYS_renameat2, "rename within a share"),
    (libc::SYS_readlinkat, "readlink"),
    (libc::SYS_fchmodat, "chmod"),
    (
        libc::SYS_fchownat,
        "chown; the owner of what the guest creates",
    ),
    (libc::SYS_utimensat, "timestamps"),
    (libc::SYS_ftruncate, "truncate"),
    (libc::SYS_fallocate, "fallocate"),
    (libc::SYS_fsync, "fsync"),
    (libc::SYS_fdatasync, "fdatasync"),
    (libc::SYS_fstatfs, "statfs"),
];

pub const DEVICES: &[(i64, &str)] = &[
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
pub const VCPU: &[(i64, &str)] = &[(libc::SYS_pwrite64, "the serial console file")];

/// ioctls (request numbers) by thread kind, with why.
pub fn ioctls(kind: ThreadKind) -> Vec<(u64, &'static str)> {
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
        ThreadKind::Devices | ThreadKind::Fs => {}
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
            (KVM_GET_DEVICE_ATTR(), "snapshot: TSC offset"),
            (KVM_GET_XSAVE(), "snapshot: FPU state"),
            (KVM_GET_XSAVE2(), "snapshot: FPU state"),
            (KVM_GET_XCRS(), "snapshot: XCRs"),
        ]),
    }
    list
}

/// The filter of `kind`.
pub fn filter(kind: ThreadKind) -> Result<BpfProgram, String> {
    let build = |e: seccompiler::BackendError| format!("the {} thread's filter: {e}", kind.name());
    let own = match kind {
        ThreadKind::Control => CONTROL,
        ThreadKind::Devices => DEVICES,
        ThreadKind::Vcpu => VCPU,
        ThreadKind::Fs => FS,
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
