//! The few system calls guest-init makes, each wrapped once.

use std::ffi::CString;
use std::io;

use crate::cstring;

pub const NOSUID_NODEV_NOEXEC: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
const HANDLED: [libc::c_int; 5] = [
    libc::SIGCHLD,
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn handled_set() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t and the signal numbers are valid.
    unsafe {
        libc::sigemptyset(&mut set);
        for s in HANDLED {
            libc::sigaddset(&mut set, s);
        }
    }
    set
}

/// Blocks the signals PID 1 handles, so they queue for `wait_signal`.
pub fn block_signals() {
    let set = handled_set();
    // SAFETY: `set` is initialised; the old mask is not needed.
    unsafe { libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
}

/// Waits for one of the handled signals and returns its number.
pub fn wait_signal() -> libc::c_int {
    let set = handled_set();
    loop {
        // SAFETY: `set` is initialised; the siginfo is not needed.
        let sig = unsafe { libc::sigwaitinfo(&set, std::ptr::null_mut()) };
        if sig > 0 {
            return sig;
        }
    }
}

/// Mounts `source` on `target`, creating the directory if needed.
pub fn mount(
    source: &str,
    target: &str,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> io::Result<()> {
    match std::fs::create_dir(target) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    let (source, target, fstype, data) = (
        cstring(source)?,
        cstring(target)?,
        cstring(fstype)?,
        cstring(data)?,
    );
    // SAFETY: all pointers are NUL-terminated strings that outlive the call.
    check(unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            flags,
            data.as_ptr().cast(),
        )
    })
}

/// Makes sure fds 0, 1 and 2 are the console, in case the kernel could not
/// open it before starting init.
pub fn ensure_console() {
    // SAFETY: F_GETFD on any fd number is harmless.
    if unsafe { libc::fcntl(1, libc::F_GETFD) } >= 0 {
        return;
    }
    let Ok(path) = cstring("/dev/console") else {
        return;
    };
    // SAFETY: `path` is NUL-terminated.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_NOCTTY) };
    if fd >= 0 {
        for target in 0..3 {
            // SAFETY: dup2 onto the standard descriptors.
            unsafe { libc::dup2(fd, target) };
        }
    }
}

pub fn set_hostname(name: &str) -> io::Result<()> {
    // SAFETY: the pointer and length describe `name`'s bytes.
    check(unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) })
}

/// Milliseconds since the guest kernel booted.
pub fn uptime_ms() -> u64 {
    // SAFETY: timespec is plain data.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: `ts` is a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// The guest's clocks, memory, load and process count.
pub fn health() -> io::Result<husk_protocol::Health> {
    // SAFETY: sysinfo is plain data; sysinfo() fills it.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid sysinfo to fill.
    check(unsafe { libc::sysinfo(&mut info) })?;
    let unit = u64::from(info.mem_unit.max(1));
    let kib = |pages: u64| pages * unit / 1024;
    // MemAvailable counts reclaimable cache; sysinfo's free memory does not.
    let available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or_else(|| kib(info.freeram + info.bufferram));
    // Load averages are fixed point with 16 fractional bits.
    let load = |l: libc::c_ulong| ((l * 1000) >> 16) as u32;
    // SAFETY: timespec is plain data.
    let mut now: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: `now` is a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut now) };
    Ok(husk_protocol::Health {
        uptime_ms: uptime_ms(),
        unix_ns: now.tv_sec * 1_000_000_000 + now.tv_nsec,
        mem_total_kib: kib(info.totalram),
        mem_available_kib: available,
        load_milli: [
            load(info.loads[0]),
            load(info.loads[1]),
            load(info.loads[2]),
        ],
        procs: u32::from(info.procs),
    })
}

/// `Reclaim`: drops the page cache's clean pages and compacts free memory,
/// so that free page reporting finds whole blocks to hand to the host.
/// Returns `MemFree` before and after, in KiB.
pub fn reclaim() -> io::Result<(u64, u64)> {
    let free = || -> io::Result<u64> {
        std::fs::read_to_string("/proc/meminfo")?
            .lines()
            .find_map(|l| l.strip_prefix("MemFree:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidData, "no MemFree in /proc/meminfo")
            })
    };
    let before = free()?;
    // 1: the page cache only (dentries and inodes stay: a shell's next
    // command would look them all up again).
    std::fs::write("/proc/sys/vm/drop_caches", "1")?;
    // Without it (no CONFIG_COMPACTION) the freed pages are reported
    // where they already form whole blocks.
    match std::fs::write("/proc/sys/vm/compact_memory", "1") {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    Ok((before, free()?))
}

/// Sets the wall clock (CLOCK_REALTIME) to `unix_ns` since the epoch.
pub fn set_clock(unix_ns: i64) -> io::Result<()> {
    if unix_ns < 0 {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    let ts = libc::timespec {
        tv_sec: unix_ns / 1_000_000_000,
        tv_nsec: unix_ns % 1_000_000_000,
    };
    // SAFETY: `ts` is a valid, normalised timespec.
    check(unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) })
}

/// Adds `entropy` to the kernel's random pool, credited as entropy (the
/// host's randomness is trusted), and reseeds the CRNG at once: clones of
/// one snapshot stop sharing random state, and a guest with no entropy
/// source of its own gets a ready RNG (getrandom stops blocking).
pub fn add_entropy(entropy: &[u8]) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // _IOW('R', 0x03, int[2]) and _IO('R', 0x07).
    const RNDADDENTROPY: libc::Ioctl = 0x4008_5203;
    const RNDRESEEDCRNG: libc::Ioctl = 0x5207;
    let urandom = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + entropy.len());
    info.extend(((entropy.len() * 8) as i32).to_ne_bytes());
    info.extend((entropy.len() as i32).to_ne_bytes());
    info.extend(entropy);
    // Keep the buffer 4-byte aligned for the kernel's u32 array.
    let words: Vec<u32> = info
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_ne_bytes(w)
        })
        .collect();
    // SAFETY: `words` holds a rand_pool_info whose buf_size bytes follow
    // the header; the kernel only reads it.
    check(unsafe { libc::ioctl(urandom.as_raw_fd(), RNDADDENTROPY, words.as_ptr()) })?;
    // SAFETY: an ioctl without arguments on our own descriptor.
    check(unsafe { libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG) })
}

/// Starts `argv` as a child in its own session with the console as stdio and
/// default signal handling. Returns its pid.
pub fn spawn(argv: &[String]) -> io::Result<libc::pid_t> {
    let args: Vec<CString> = argv.iter().map(|a| cstring(a)).collect::<io::Result<_>>()?;
    let mut ptrs: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    ptrs.push(std::ptr::null());
    let tunables = crate::simd::glibc_tunables()
        .map(|t| cstring(&format!("GLIBC_TUNABLES={t}")))
        .transpose()?;
    let mut env = vec![
        c"PATH=/bin:/sbin:/usr/bin:/usr/sbin".as_ptr(),
        c"HOME=/root".as_ptr(),
    ];
    env.extend(tunables.as_ref().map(|t| t.as_ptr()));
    env.push(std::ptr::null());
    let empty = {
        // SAFETY: sigset_t is plain data; sigemptyset initialises it.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid sigset_t.
        unsafe { libc::sigemptyset(&mut set) };
        set
    };
    // SAFETY: fork in a single-threaded process; the child only calls
    // async-signal-safe functions before execve or _exit.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: child side: restore the signal mask, start a session,
        // exec; `ptrs` and `env` are NULL-terminated arrays of C strings.
        unsafe {
            libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            // Rust ignores SIGPIPE; programs expect the default.
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            libc::setsid();
            libc::execve(ptrs[0], ptrs.as_ptr(), env.as_ptr());
            libc::_exit(127);
        }
    }
    Ok(pid)
}

/// Reaps every exited child with its resource use.
pub fn reap_all() -> Vec<(libc::pid_t, crate::reaper::Exit)> {
    let mut reaped = Vec::new();
    loop {
        let mut status = 0;
        // SAFETY: rusage is plain data; wait4 fills it.
        let mut rusage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `status` and `rusage` are valid to fill.
        let pid = unsafe { libc::wait4(-1, &mut status, libc::WNOHANG, &mut rusage) };
        if pid <= 0 {
            return reaped;
        }
        reaped.push((pid, crate::reaper::Exit { status, rusage }));
    }
}

/// "status=<n>" or "signal=<n>" for a wait status.
pub fn describe(status: libc::c_int) -> String {
    if libc::WIFSIGNALED(status) {
        format!("signal={}", libc::WTERMSIG(status))
    } else {
        format!("status={}", libc::WEXITSTATUS(status))
    }
}

pub fn remount_root_read_only() -> io::Result<()> {
    let root = cstring("/")?;
    // SAFETY: NUL-terminated target; source, type and data may be null for a remount.
    check(unsafe {
        libc::mount(
            std::ptr::null(),
            root.as_ptr(),
            std::ptr::null(),
            libc::MS_REMOUNT | libc::MS_RDONLY,
            std::ptr::null(),
        )
    })
}

pub fn sync() {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
}

/// Exempts PID 1, and so the agent (its threads), from the OOM killer: a
/// program that fills the guest's memory is killed, not the agent. Programs
/// get the default back before they exec (`OOM_SCORE_ADJ`, `process.rs`).
pub fn exempt_from_oom() -> io::Result<()> {
    std::fs::write("/proc/self/oom_score_adj", "-1000")
}

/// Sends `sig` to every process but PID 1.
pub fn kill_all(sig: libc::c_int) {
    // SAFETY: kill(-1) signals every process we may signal, except init itself.
    unsafe { libc::kill(-1, sig) };
}

/// Asks the kernel to restart; returns only on failure.
pub fn reboot() -> io::Error {
    // SAFETY: reboot with a valid command; on success it does not return.
    unsafe { libc::reboot(libc::RB_AUTOBOOT) };
    io::Error::last_os_error()
}
