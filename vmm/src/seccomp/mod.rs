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

mod rules;

use std::cell::Cell;

use seccompiler::sock_filter;

pub use self::rules::{filter, ThreadKind};

/// The filters, compiled from [`rules`] by the build script: no VMM spends
/// its start compiling them (Firecracker does the same).
mod built {
    use seccompiler::sock_filter;
    include!(concat!(env!("OUT_DIR"), "/seccomp_filters.rs"));
}

/// Errors installing a filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("cannot install the {0} thread's seccomp filter: {1}")]
    Install(&'static str, String),
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

/// The filters of every thread kind (compiled at build time).
#[derive(Debug, Clone)]
pub struct Filters {
    programs: Option<[&'static [sock_filter]; 4]>,
    selftest: Option<ThreadKind>,
}

impl Filters {
    pub fn new(policy: SeccompPolicy) -> Self {
        Filters {
            programs: policy.enabled.then_some([
                built::CONTROL,
                built::DEVICES,
                built::VCPU,
                built::FS,
            ]),
            selftest: policy.selftest,
        }
    }

    /// Installs `kind`'s filter on the calling thread. A thread that cannot
    /// be filtered must not serve the guest: the VMM exits.
    pub fn enter(&self, kind: ThreadKind) {
        let Some(programs) = &self.programs else {
            return;
        };
        KIND.with(|k| k.set(kind as u8));
        if let Err(e) = seccompiler::apply_filter(programs[kind as usize - 1]) {
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
        4 => ThreadKind::Fs.name(),
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
    use super::rules::*;
    use super::*;

    #[test]
    fn the_built_filters_are_the_rules_compiled_now() {
        let Filters {
            programs: Some(built),
            ..
        } = Filters::new(SeccompPolicy::default())
        else {
            panic!("filters on by default");
        };
        for (kind, built) in [ThreadKind::Control, ThreadKind::Devices, ThreadKind::Vcpu]
            .into_iter()
            .zip(built)
        {
            let now = filter(kind).expect("filter");
            assert!(!now.is_empty(), "{kind:?}");
            let same = now.len() == built.len()
                && now
                    .iter()
                    .zip(built)
                    .all(|(a, b)| (a.code, a.jt, a.jf, a.k) == (b.code, b.jt, b.jf, b.k));
            assert!(same, "{kind:?}: the built filter differs from its rules");
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
