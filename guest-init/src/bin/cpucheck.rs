//! `husk-cpucheck`: a guest program for the tests of what a vCPU keeps
//! across snapshots and restores (uploaded into a sandbox, not in the root
//! file system).
//!
//!   husk-cpucheck clock MS [CPU]  two samples MS milliseconds apart of the
//!                                 TSC against CLOCK_MONOTONIC (on vCPU CPU
//!                                 if given), one line each: `sample TSC NS`;
//!                                 then every kernel log line that names a
//!                                 clocksource: `log LINE`
//!   husk-cpucheck simd SECONDS FILE
//!                                 holds patterns in all sixteen vector
//!                                 registers (YMM where the guest kernel keeps
//!                                 AVX state, else XMM) and MXCSR, and checks
//!                                 them after each spin, for SECONDS; writes
//!                                 `simd KIND holding` to FILE after its first
//!                                 round, then `simd KIND rounds N bad M`

use std::arch::asm;
use std::arch::x86_64::_rdtsc;
use std::time::{Duration, Instant};

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The TSC and CLOCK_MONOTONIC at (nearly) one instant: the TSC read
/// between two clock reads, the closest of a few tries.
fn sample() -> (u64, u64) {
    (0..16)
        .map(|_| {
            let before = monotonic_ns();
            // SAFETY: RDTSC has no memory effects.
            let tsc = unsafe { _rdtsc() };
            let after = monotonic_ns();
            (after - before, tsc, before + (after - before) / 2)
        })
        .min()
        .map(|(_, tsc, ns)| (tsc, ns))
        .unwrap_or_default()
}

/// The kernel log lines that name a clocksource.
fn clocksource_log() -> Vec<String> {
    const SYSLOG_ACTION_READ_ALL: libc::c_int = 3;
    let mut buf = vec![0u8; 1 << 20];
    // SAFETY: the buffer is valid for its length.
    let n = unsafe {
        libc::klogctl(
            SYSLOG_ACTION_READ_ALL,
            buf.as_mut_ptr().cast(),
            buf.len() as libc::c_int,
        )
    };
    let n = usize::try_from(n).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n])
        .lines()
        .filter(|l| l.contains("clocksource"))
        .map(str::to_owned)
        .collect()
}

/// Runs this thread on `cpu` alone.
fn pin_to(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes
    // inside it (`cpu` is checked against its size).
    let ok = cpu < libc::CPU_SETSIZE as usize
        && unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        };
    if !ok {
        eprintln!(
            "husk-cpucheck: cannot run on CPU {cpu}: {}",
            std::io::Error::last_os_error()
        );
        std::process::exit(1);
    }
}

fn clock(ms: u64, cpu: Option<usize>) {
    if let Some(cpu) = cpu {
        pin_to(cpu);
    }
    let (tsc, ns) = sample();
    std::thread::sleep(Duration::from_millis(ms));
    let (tsc2, ns2) = sample();
    println!("sample {tsc} {ns}");
    println!("sample {tsc2} {ns2}");
    for line in clocksource_log() {
        println!("log {line}");
    }
}

/// Whether the guest kernel keeps AVX state across context switches: it
/// lists `avx` only when it saves it (XSAVE on).
fn kernel_keeps_avx() -> bool {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .is_some_and(|l| l.split_whitespace().any(|f| f == "avx"))
}

/// Loads 16 registers of `WIDTH` bytes from `src`, spins `spins` times
/// (long enough for the kernel to switch tasks or the VM to be snapshotted
/// in between), then stores them to `dst`.
macro_rules! hold {
    ($name:ident, $feature:literal, $mov:literal, $r:literal, $width:literal) => {
        #[target_feature(enable = $feature)]
        unsafe fn $name(src: &[u8], dst: &mut [u8], spins: u64) {
            assert!(src.len() >= 16 * $width && dst.len() >= 16 * $width);
            // SAFETY: both buffers hold 16 registers' worth (checked above);
            // every register written is declared clobbered.
            unsafe {
                asm!(
                    concat!($mov, " ", $r, "0, [{s}]"),
                    concat!($mov, " ", $r, "1, [{s} + ", $width, "*1]"),
                    concat!($mov, " ", $r, "2, [{s} + ", $width, "*2]"),
                    concat!($mov, " ", $r, "3, [{s} + ", $width, "*3]"),
                    concat!($mov, " ", $r, "4, [{s} + ", $width, "*4]"),
                    concat!($mov, " ", $r, "5, [{s} + ", $width, "*5]"),
                    concat!($mov, " ", $r, "6, [{s} + ", $width, "*6]"),
                    concat!($mov, " ", $r, "7, [{s} + ", $width, "*7]"),
                    concat!($mov, " ", $r, "8, [{s} + ", $width, "*8]"),
                    concat!($mov, " ", $r, "9, [{s} + ", $width, "*9]"),
                    concat!($mov, " ", $r, "10, [{s} + ", $width, "*10]"),
                    concat!($mov, " ", $r, "11, [{s} + ", $width, "*11]"),
                    concat!($mov, " ", $r, "12, [{s} + ", $width, "*12]"),
                    concat!($mov, " ", $r, "13, [{s} + ", $width, "*13]"),
                    concat!($mov, " ", $r, "14, [{s} + ", $width, "*14]"),
                    concat!($mov, " ", $r, "15, [{s} + ", $width, "*15]"),
                    "2:",
                    "pause",
                    "dec {n}",
                    "jnz 2b",
                    concat!($mov, " [{d}], ", $r, "0"),
                    concat!($mov, " [{d} + ", $width, "*1], ", $r, "1"),
                    concat!($mov, " [{d} + ", $width, "*2], ", $r, "2"),
                    concat!($mov, " [{d} + ", $width, "*3], ", $r, "3"),
                    concat!($mov, " [{d} + ", $width, "*4], ", $r, "4"),
                    concat!($mov, " [{d} + ", $width, "*5], ", $r, "5"),
                    concat!($mov, " [{d} + ", $width, "*6], ", $r, "6"),
                    concat!($mov, " [{d} + ", $width, "*7], ", $r, "7"),
                    concat!($mov, " [{d} + ", $width, "*8], ", $r, "8"),
                    concat!($mov, " [{d} + ", $width, "*9], ", $r, "9"),
                    concat!($mov, " [{d} + ", $width, "*10], ", $r, "10"),
                    concat!($mov, " [{d} + ", $width, "*11], ", $r, "11"),
                    concat!($mov, " [{d} + ", $width, "*12], ", $r, "12"),
                    concat!($mov, " [{d} + ", $width, "*13], ", $r, "13"),
                    concat!($mov, " [{d} + ", $width, "*14], ", $r, "14"),
                    concat!($mov, " [{d} + ", $width, "*15], ", $r, "15"),
                    s = in(reg) src.as_ptr(),
                    d = in(reg) dst.as_mut_ptr(),
                    n = inout(reg) spins.max(1) => _,
                    out("xmm0") _, out("xmm1") _, out("xmm2") _, out("xmm3") _,
                    out("xmm4") _, out("xmm5") _, out("xmm6") _, out("xmm7") _,
                    out("xmm8") _, out("xmm9") _, out("xmm10") _, out("xmm11") _,
                    out("xmm12") _, out("xmm13") _, out("xmm14") _, out("xmm15") _,
                    options(nostack),
                );
            }
        }
    };
}

hold!(hold_xmm, "sse2", "movdqu", "xmm", 16);
hold!(hold_ymm, "avx", "vmovdqu", "ymm", 32);

/// MXCSR with round-toward-zero and flush-to-zero: not what any other
/// program leaves there.
const MXCSR_PATTERN: u32 = 0x1f80 | (3 << 13) | (1 << 15);

fn mxcsr() -> u32 {
    let mut v: u32 = 0;
    // SAFETY: stores MXCSR into a local.
    unsafe { asm!("stmxcsr [{}]", in(reg) &mut v, options(nostack)) };
    v
}

fn set_mxcsr(v: u32) {
    // SAFETY: loads MXCSR from a local holding a valid value (reserved bits clear).
    unsafe { asm!("ldmxcsr [{}]", in(reg) &v, options(nostack)) };
}

fn simd(seconds: u64, file: &str) {
    let avx = kernel_keeps_avx() && std::arch::is_x86_feature_detected!("avx");
    let width = if avx { 32 } else { 16 };
    let mut src = vec![0u8; 16 * width];
    let mut dst = vec![0u8; 16 * width];
    let (mut rounds, mut bad) = (0u64, 0u64);
    let end = Instant::now() + Duration::from_secs(seconds);
    set_mxcsr(MXCSR_PATTERN);
    let kind = if avx { "avx" } else { "sse" };
    let mut said = false;
    while Instant::now() < end {
        for (i, b) in src.iter_mut().enumerate() {
            *b = (rounds as u8).wrapping_mul(31).wrapping_add(i as u8) ^ 0x5a;
        }
        if avx {
            // SAFETY: AVX is on (checked above); buffers are 16 registers long.
            unsafe { hold_ymm(&src, &mut dst, 2_000_000) };
        } else {
            // SAFETY: SSE2 is part of x86-64; buffers are 16 registers long.
            unsafe { hold_xmm(&src, &mut dst, 2_000_000) };
        }
        if src != dst || mxcsr() != MXCSR_PATTERN {
            bad += 1;
        }
        rounds += 1;
        if !said {
            // A test waits for this before it snapshots the guest.
            said = std::fs::write(file, format!("simd {kind} holding\n")).is_ok();
        }
    }
    let line = format!("simd {kind} rounds {rounds} bad {bad}\n");
    if let Err(e) = std::fs::write(file, line) {
        eprintln!("husk-cpucheck: cannot write {file}: {e}");
        std::process::exit(1);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number = |i: usize| args.get(i).and_then(|a| a.parse::<u64>().ok());
    match (args.first().map(String::as_str), number(1), args.get(2)) {
        (Some("clock"), Some(ms), None) => clock(ms, None),
        (Some("clock"), Some(ms), Some(_)) if number(2).is_some() => {
            clock(ms, number(2).map(|c| c as usize))
        }
        (Some("simd"), Some(seconds), Some(file)) => simd(seconds, file),
        _ => {
            eprintln!("usage: husk-cpucheck clock MS [CPU] | simd SECONDS FILE");
            std::process::exit(2);
        }
    }
}
