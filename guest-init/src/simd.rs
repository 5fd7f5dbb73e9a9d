//! Vector state that the guest kernel cannot keep.
//!
//! User space decides whether to use AVX from CPUID and XGETBV, which it
//! runs itself. On the emulating (PVM) hosts we build on those come from
//! the host CPU, unfiltered: XCR0 enables AVX and AVX-512 state, while the
//! guest kernel, which cannot execute XSAVE there (`clearcpuid=xsave`),
//! saves only the legacy FXSAVE area on a context switch. A program's YMM
//! and ZMM upper halves then change under it whenever another program runs:
//! glibc's AVX `memcpy` copied zeros into the TLS block of a freshly
//! started busybox, which died of SIGSEGV one pipeline in three.
//!
//! guest-init detects exactly that mismatch (user-visible XCR0 has state
//! beyond x87/SSE, and the kernel does not use XSAVE) and then tells glibc
//! in each program's environment not to use AVX (`GLIBC_TUNABLES`). On
//! hardware KVM the kernel uses XSAVE and nothing changes. Programs that
//! use AVX on their own (not through glibc) are not protected: see
//! kernel-config/README.md.

use std::sync::OnceLock;

/// glibc's CPU features that use state beyond XMM, turned off.
const NO_AVX_TUNABLES: &str = "glibc.cpu.hwcaps=-AVX,-AVX2,-AVX512F,-AVX512VL,-AVX512BW,\
-AVX512DQ,-AVX512CD,-AVX_Fast_Unaligned_Load,-FMA,-FMA4,-F16C";

/// XCR0 bits for x87 and SSE state: what FXSAVE saves.
const XCR0_FXSAVE_STATE: u64 = 0b11;

/// `GLIBC_TUNABLES` for every program this guest runs, if its kernel
/// cannot keep the vector state the CPU lets user space use.
pub fn glibc_tunables() -> Option<&'static str> {
    static TUNABLES: OnceLock<Option<&'static str>> = OnceLock::new();
    *TUNABLES.get_or_init(|| {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        (user_xcr0() & !XCR0_FXSAVE_STATE != 0 && !kernel_uses_xsave(&cpuinfo))
            .then_some(NO_AVX_TUNABLES)
    })
}

/// Whether the kernel saves extended state with XSAVE (the `xsave` flag).
fn kernel_uses_xsave(cpuinfo: &str) -> bool {
    cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .is_some_and(|l| l.split_whitespace().any(|f| f == "xsave"))
}

/// XCR0 as user space sees it (0 when the OS has not enabled XGETBV).
fn user_xcr0() -> u64 {
    let leaf1 = std::arch::x86_64::__cpuid(1);
    if leaf1.ecx & (1 << 27) == 0 {
        return 0; // no OSXSAVE: XGETBV would fault
    }
    let (lo, hi): (u32, u32);
    // SAFETY: OSXSAVE is set, so XGETBV with ECX = 0 reads XCR0.
    unsafe {
        std::arch::asm!("xgetbv", in("ecx") 0, out("eax") lo, out("edx") hi, options(nomem, nostack));
    }
    (u64::from(hi) << 32) | u64::from(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_xsave_flag_is_read_from_cpuinfo() {
        assert!(kernel_uses_xsave(
            "processor : 0\nflags : fpu sse xsave avx\n"
        ));
        assert!(!kernel_uses_xsave("flags : fpu sse sse2 xsaveopt\n"));
        assert!(!kernel_uses_xsave(""));
    }

    #[test]
    fn tunables_name_only_features() {
        assert!(NO_AVX_TUNABLES.starts_with("glibc.cpu.hwcaps=-AVX,"));
        assert!(!NO_AVX_TUNABLES.contains(' '));
    }
}
