//! Programs the agent starts: how they are forked, where their output is
//! kept, and the table of those not yet collected.
//!
//! Every program has a waiter thread (its exit, its timeout) and one pump
//! thread per output pipe (or one for its PTY). Pumps put output into the
//! program's ring (`ring`), which keeps the newest of it. While a
//! collecting client (`Exec`, `Attach`) is attached, a ring full of what
//! that client has not had yet makes the pump wait, so the program waits
//! for the client; otherwise the oldest output goes, counted as lost when
//! no collecting client had it, so a background program can never fill
//! the guest's memory. `Follow` readers never hold a program up;
//! `FollowHeld` readers do, as an attached client does.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::io::{ErrorKind as IoErrorKind, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use husk_protocol::{
    ExecRequest, ExitReport, ProcessInfo, Program, ProgramEnd, Stream, Termination, WindowSize,
    MAX_RING, MIN_RING, OUTPUT_BUFFER,
};

use crate::cgroup::Cgroup;
use crate::container::PidNs;
use crate::reaper;
use crate::ring::Ring;

const DEFAULT_PATH: &str = "/bin:/sbin:/usr/bin:/usr/sbin";
/// Where templates put the egress proxy's CA certificate
/// (`husk_core::template::GUEST_CA`).
const EGRESS_CA: &str = "/etc/husk/egress-ca.pem";
/// After the program exits, how long its output may stay open (a child it
/// left behind holding the pipe) before the output is declared finished.
const OUTPUT_GRACE: Duration = Duration::from_secs(2);
/// When nothing of the program is left alive, its output ends as soon as
/// the pumps have read what is in the pipes: this bounds only a guest too
/// starved to run them (a busy host), not a program.
const OUTPUT_DRAIN: Duration = Duration::from_secs(120);
/// After a timeout's kill, how long the killed processes may take to exit
/// and be reaped before the timeout is reported anyway.
const KILL_DRAIN: Duration = Duration::from_secs(60);
const CHUNK: usize = 32 << 10;
const OOM_SCORE_ADJ: &std::ffi::CStr = c"/proc/self/oom_score_adj";
pub use husk_protocol::MAX_PROCESSES;
/// Stdin chunks queued for a program that is slow to read them.
const STDIN_QUEUE: usize = 16;

/// How a program ended, once it has.
#[derive(Debug, Clone, Copy)]
pub struct Ended {
    pub report: ExitReport,
    pub timed_out: bool,
}

#[derive(Debug)]
pub struct Output {
    pub ring: Ring,
    /// How far collecting clients (`Exec`, `Attach`) have had the output.
    pub delivered: u64,
    pub lost: u64,
    /// Lost bytes not yet reported to an attached client.
    pub unreported_lost: u64,
    /// Generation of the attached client; 0 when nobody is attached.
    pub attached: u64,
    next_attach: u64,
    /// Readers the program waits for (`FollowHeld`): each one's key and
    /// how far it has had the output.
    held: Vec<(u64, u64)>,
    pumps_open: usize,
    pub ended: Option<Ended>,
    /// Set once the program has ended and its output is complete.
    pub finished: bool,
    /// Bytes taken from the program, counted against `output_max`.
    written: u64,
    /// Set when the program passed its `output_max` and was killed.
    pub over_limit: bool,
}

impl Output {
    fn new(ring: usize, pumps_open: usize) -> Output {
        Output {
            ring: Ring::new(ring),
            delivered: 0,
            lost: 0,
            unreported_lost: 0,
            attached: 0,
            next_attach: 0,
            held: Vec::new(),
            pumps_open,
            ended: None,
            finished: false,
            written: 0,
            over_limit: false,
        }
    }

    /// Output kept that collecting clients have not had yet.
    pub fn undelivered(&self) -> u64 {
        self.ring.end() - self.delivered
    }

    /// Whether `len` more bytes would push out output that a client the
    /// program waits for has not had yet.
    fn would_lose(&self, len: usize) -> bool {
        let behind = |had: u64| {
            had < self.ring.end() && self.ring.cost_from(had, len) > self.ring.capacity()
        };
        (self.attached != 0 && behind(self.delivered))
            || self.held.iter().any(|&(_, had)| behind(had))
    }

    /// Registers a reader the program waits for, from offset `at`: its key.
    pub fn hold(&mut self, at: u64) -> u64 {
        self.next_attach += 1;
        self.held.push((self.next_attach, at));
        self.next_attach
    }

    /// Reader `key` has had the output up to `at`.
    pub fn had(&mut self, key: u64, at: u64) {
        if let Some(h) = self.held.iter_mut().find(|(k, _)| *k == key) {
            h.1 = at;
        }
    }

    /// Reader `key` no longer holds the program.
    pub fn release(&mut self, key: u64) {
        self.held.retain(|(k, _)| *k != key);
    }
}

#[derive(Debug)]
pub struct Process {
    pub pid: libc::pid_t,
    pub argv: Vec<String>,
    pub background: bool,
    /// Started by `Spawn`: kept in the table until `Forget`.
    pub kept: bool,
    pub tag: Option<String>,
    pub started_unix_ms: u64,
    pub timeout_ms: Option<u64>,
    pub output_max: Option<u64>,
    cgroup: Option<Cgroup>,
    stdin: Mutex<Option<mpsc::SyncSender<Vec<u8>>>>,
    /// The PTY master, for resizes and for ^D as the end of input.
    pty: Option<File>,
    output: Mutex<Output>,
    pub changed: Condvar,
}

impl Process {
    pub fn output(&self) -> MutexGuard<'_, Output> {
        self.output.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for a change (new output, exit, detach) or `limit`.
    pub fn wait_change<'a>(
        &self,
        guard: MutexGuard<'a, Output>,
        limit: Duration,
    ) -> MutexGuard<'a, Output> {
        self.changed
            .wait_timeout(guard, limit)
            .unwrap_or_else(|e| e.into_inner())
            .0
    }

    /// Takes over the output: any earlier client is detached.
    pub fn attach(&self) -> u64 {
        let mut out = self.output();
        out.next_attach += 1;
        out.attached = out.next_attach;
        self.changed.notify_all();
        out.attached
    }

    pub fn detach(&self, generation: u64) {
        let mut out = self.output();
        if out.attached == generation {
            out.attached = 0;
            // The pump may be waiting for room that nobody will make now.
            self.changed.notify_all();
        }
    }

    /// Sends `signal` to the program's process group; SIGKILL also empties
    /// its cgroup, reaching processes that left the group.
    pub fn signal(&self, signal: libc::c_int) -> std::io::Result<()> {
        if signal == libc::SIGKILL {
            if let Some(cgroup) = &self.cgroup {
                if cgroup.kill().is_ok() {
                    return Ok(());
                }
            }
        }
        // SAFETY: signalling the process group the program leads.
        if unsafe { libc::kill(-self.pid, signal) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Queues more input; fails when stdin was not kept open or is closed.
    pub fn write_stdin(&self, data: Vec<u8>) -> Result<(), &'static str> {
        let sender = self.stdin.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match sender {
            Some(tx) => tx.send(data).map_err(|_| "the program's stdin is closed"),
            None => Err("the program's stdin is not open (start it with stdin_open)"),
        }
    }

    /// Ends the input: closes the pipe, or sends ^D on a PTY.
    pub fn close_stdin(&self) -> Result<(), &'static str> {
        let sender = self.stdin.lock().unwrap_or_else(|e| e.into_inner()).take();
        match (sender, &self.pty) {
            (Some(tx), Some(_)) => tx
                .send(vec![4])
                .map_err(|_| "the program's stdin is closed"),
            (Some(_), None) => Ok(()), // dropping the sender closes the pipe
            (None, _) => Err("the program's stdin is not open"),
        }
    }

    pub fn resize(&self, size: WindowSize) -> Result<(), String> {
        let Some(master) = &self.pty else {
            return Err("the program has no terminal".into());
        };
        let ws = libc::winsize {
            ws_row: size.rows,
            ws_col: size.cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads a winsize from a valid pointer.
        if unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws) } != 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        Ok(())
    }

    pub fn info(&self) -> ProcessInfo {
        let out = self.output();
        ProcessInfo {
            pid: self.pid,
            argv: self.argv.clone(),
            background: self.background,
            exit: out.ended.map(|e| e.report.termination),
            buffered: out.undelivered(),
            lost: out.lost,
        }
    }

    pub fn program(&self) -> Program {
        let stdin_open = self
            .stdin
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        let out = self.output();
        Program {
            pid: self.pid,
            argv: self.argv.clone(),
            tag: self.tag.clone(),
            kept: self.kept,
            background: self.background,
            terminal: self.pty.is_some(),
            stdin_open: stdin_open && out.ended.is_none(),
            started_unix_ms: self.started_unix_ms,
            end: out.ended.map(|e| ProgramEnd {
                report: e.report,
                timed_out: e.timed_out,
                over_limit: out.over_limit,
                output_complete: out.finished,
            }),
            kept_from: out.ring.start(),
            written: out.ring.end(),
            ring: out.ring.capacity() as u64,
        }
    }

    /// Puts a chunk of output in the buffer (see the module docs).
    fn push(&self, stream: Stream, mut data: Vec<u8>) {
        let mut out = self.output();
        if let Some(max) = self.output_max {
            let room = max.saturating_sub(out.written);
            if data.len() as u64 > room {
                data.truncate(room as usize);
                if !out.over_limit {
                    out.over_limit = true;
                    let _ = self.signal(libc::SIGKILL);
                }
            }
            out.written += data.len() as u64;
            if data.is_empty() {
                return;
            }
        }
        while out.would_lose(data.len()) {
            out = self.wait_change(out, Duration::from_secs(1));
        }
        out.ring.push(stream, &data);
        let start = out.ring.start();
        if start > out.delivered {
            let gone = start - out.delivered;
            out.lost += gone;
            out.unreported_lost += gone;
            out.delivered = start;
        }
        self.changed.notify_all();
    }
}

/// Programs started and not yet collected, by pid.
static TABLE: Mutex<Option<HashMap<libc::pid_t, Arc<Process>>>> = Mutex::new(None);

fn table() -> MutexGuard<'static, Option<HashMap<libc::pid_t, Arc<Process>>>> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn find(pid: libc::pid_t) -> Option<Arc<Process>> {
    table().as_ref().and_then(|t| t.get(&pid).cloned())
}

/// Forgets a program (collected, or its foreground client left).
pub fn remove(pid: libc::pid_t) {
    if let Some(t) = table().as_mut() {
        t.remove(&pid);
    }
}

/// The programs in the table, by pid (the table's lock is not held while
/// each is asked about itself).
fn by_pid() -> Vec<Arc<Process>> {
    let mut all: Vec<Arc<Process>> = table()
        .as_ref()
        .map(|t| t.values().cloned().collect())
        .unwrap_or_default();
    all.sort_by_key(|p| p.pid);
    all
}

/// Every program in the table, by pid.
pub fn programs() -> Vec<Program> {
    by_pid().iter().map(|p| p.program()).collect()
}

pub fn list() -> Vec<ProcessInfo> {
    by_pid().iter().map(|p| p.info()).collect()
}

/// Makes room for one more program: evicts the ended background program
/// with the lowest pid if the table is full. False if all are running.
fn make_room() -> bool {
    let mut guard = table();
    let t = guard.get_or_insert_with(HashMap::new);
    if t.len() < MAX_PROCESSES {
        return true;
    }
    let oldest = t
        .values()
        .filter(|p| p.background && p.output().ended.is_some())
        .map(|p| p.pid)
        .min();
    match oldest {
        Some(pid) => {
            t.remove(&pid);
            true
        }
        None => false,
    }
}

/// Why a program could not be started.
#[derive(Debug)]
pub enum StartError {
    /// The table is full of running programs.
    Full,
    Io(std::io::Error),
}

/// Starts `req` and registers it; its threads are running when this
/// returns.
pub fn start(req: &ExecRequest, root: Option<&str>) -> Result<Arc<Process>, StartError> {
    start_kept(req, root, None)
}

/// How a `Spawn` keeps its program: its tag and ring size.
#[derive(Debug)]
pub struct Keep {
    pub tag: Option<String>,
    pub ring: Option<u32>,
}

/// [`start`], for `Spawn` with `keep`.
pub fn start_kept(
    req: &ExecRequest,
    root: Option<&str>,
    keep: Option<Keep>,
) -> Result<Arc<Process>, StartError> {
    if !make_room() {
        return Err(StartError::Full);
    }
    let (spawned, cgroup) = match root {
        None => {
            let cgroup = Cgroup::create(req.pids_max, None).map_err(StartError::Io)?;
            let spawned = spawn(req, cgroup.as_ref(), None, &PidNs::Own);
            (spawned.map_err(StartError::Io)?, cgroup)
        }
        // A container's program: in its PID namespace and cgroup.
        Some(dir) => {
            let root = Root::new(dir).map_err(StartError::Io)?;
            let mut made = None;
            crate::container::start(dir, |parent, ns| {
                let cgroup = Cgroup::create(req.pids_max, parent)?;
                let spawned = spawn(req, cgroup.as_ref(), Some(&root), &ns)?;
                let pid = spawned.pid;
                made = Some((spawned, cgroup));
                Ok(pid)
            })
            .map_err(StartError::Io)?;
            made.ok_or(StartError::Io(IoErrorKind::Other.into()))?
        }
    };
    let (stdin_tx, stdin_rx) = mpsc::sync_channel::<Vec<u8>>(STDIN_QUEUE);
    let ring = keep
        .as_ref()
        .and_then(|k| k.ring)
        .map_or(OUTPUT_BUFFER, |r| r.clamp(MIN_RING, MAX_RING) as usize);
    let started_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let process = Arc::new(Process {
        pid: spawned.pid,
        argv: req.argv.clone(),
        background: req.background,
        kept: keep.is_some(),
        tag: keep.and_then(|k| k.tag),
        started_unix_ms,
        timeout_ms: req.timeout_ms,
        output_max: req.output_max,
        cgroup,
        stdin: Mutex::new(req.stdin_open.then(|| stdin_tx.clone())),
        pty: spawned.pty,
        output: Mutex::new(Output::new(ring, spawned.outputs.len())),
        changed: Condvar::new(),
    });
    drop(stdin_tx); // without stdin_open, the writer ends after `req.stdin`
    table()
        .get_or_insert_with(HashMap::new)
        .insert(process.pid, process.clone());

    let initial = req.stdin.clone();
    let mut input = spawned.input;
    std::thread::spawn(move || {
        // A program that does not read its input is not an error.
        if input.write_all(&initial).is_ok() {
            while let Ok(data) = stdin_rx.recv() {
                if input.write_all(&data).is_err() {
                    break;
                }
            }
        }
    });
    for (stream, mut pipe) in spawned.outputs {
        let p = process.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; CHUNK];
            // A PTY master reads EIO once the terminal's last user is gone.
            while let Ok(n @ 1..) = pipe.read(&mut buf) {
                p.push(stream, buf[..n].to_vec());
            }
            p.output().pumps_open -= 1;
            p.changed.notify_all();
        });
    }
    let p = process.clone();
    let deadline = req
        .timeout_ms
        .map(|ms| Instant::now() + Duration::from_millis(ms));
    std::thread::spawn(move || wait_for_exit(&p, deadline));
    Ok(process)
}

/// The waiter thread: the exit (or the timeout and kill), then the end of
/// the output.
fn wait_for_exit(p: &Process, deadline: Option<Instant>) {
    let (exit, timed_out) = match reaper::wait(p.pid, deadline) {
        Some(exit) => (exit, false),
        None => {
            let _ = p.signal(libc::SIGKILL);
            let Some(exit) = reaper::wait(p.pid, None) else {
                return;
            };
            // The timeout is reported once everything the program started
            // is gone and its pids are free again: the next program starts
            // in a sandbox without the killed one's processes.
            if let Some(cgroup) = &p.cgroup {
                if !cgroup.wait_drained(KILL_DRAIN) {
                    crate::log(&format!("pid {}: killed processes are still there", p.pid));
                }
            }
            (exit, true)
        }
    };
    crate::container::reaped(p.pid);
    // A child left behind may hold the output open: it gets a short grace.
    // Without one, the output is complete at the pipes' end, however slowly
    // this guest runs.
    let left_behind = p.cgroup.as_ref().is_none_or(Cgroup::populated);
    let grace = Instant::now()
        + if left_behind {
            OUTPUT_GRACE
        } else {
            OUTPUT_DRAIN
        };
    let mut out = p.output();
    out.ended = Some(Ended {
        report: report(&exit),
        timed_out,
    });
    p.changed.notify_all();
    while out.pumps_open > 0 {
        let left = grace.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        out = p.wait_change(out, left);
    }
    out.finished = true;
    p.changed.notify_all();
}

fn report(exit: &reaper::Exit) -> ExitReport {
    let micros = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    let termination = if libc::WIFSIGNALED(exit.status) {
        Termination::Signal(libc::WTERMSIG(exit.status))
    } else {
        Termination::Code(libc::WEXITSTATUS(exit.status))
    };
    ExitReport {
        termination,
        user_us: micros(exit.rusage.ru_utime),
        system_us: micros(exit.rusage.ru_stime),
        max_rss_kib: exit.rusage.ru_maxrss as u64,
    }
}

/// A running program's descriptors.
struct Spawned {
    pid: libc::pid_t,
    input: File,
    outputs: Vec<(Stream, File)>,
    pty: Option<File>,
}

fn owned(fd: libc::c_int) -> std::io::Result<File> {
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor nothing else owns.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

fn pipe() -> std::io::Result<(File, File)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((owned(fds[0])?, owned(fds[1])?))
}

/// A new PTY of `size`: (master, slave).
fn openpty(size: WindowSize) -> std::io::Result<(File, File)> {
    // SAFETY: posix_openpt returns a new descriptor or -1.
    let master =
        owned(unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) })?;
    let fd = master.as_raw_fd();
    let mut name = [0 as libc::c_char; 64];
    // SAFETY: `fd` is a PTY master; ptsname_r writes at most `name.len()` bytes.
    let rc = unsafe {
        if libc::grantpt(fd) != 0 || libc::unlockpt(fd) != 0 {
            -1
        } else {
            libc::ptsname_r(fd, name.as_mut_ptr(), name.len())
        }
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: ptsname_r NUL-terminated `name`.
    let slave = owned(unsafe {
        libc::open(
            name.as_ptr(),
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    })?;
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize from a valid pointer.
    unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) };
    Ok((master, slave))
}

fn cstring(s: &str) -> std::io::Result<CString> {
    CString::new(s).map_err(|_| std::io::Error::from(IoErrorKind::InvalidInput))
}

/// Forks and execs `req` in a new process group (a new session on a PTY),
/// in `cgroup`, with pipes or a PTY for its stdio. Written out instead of
/// std's Command because Command reaps a child whose exec failed with
/// waitpid, which races PID 1's reap-everything loop (std then panics).
/// Here the exec error comes back through a close-on-exec pipe and the
/// reaper owns every exit.
fn spawn(
    req: &ExecRequest,
    cgroup: Option<&Cgroup>,
    root: Option<&Root>,
    ns: &PidNs<'_>,
) -> std::io::Result<Spawned> {
    let Some(program) = req.argv.first() else {
        return Err(IoErrorKind::InvalidInput.into());
    };
    let argv: Vec<CString> = req
        .argv
        .iter()
        .map(|a| cstring(a))
        .collect::<Result<_, _>>()?;
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("HOME".into(), "/root".into()),
    ];
    if req.pty.is_some() {
        env.push(("TERM".into(), "xterm".into()));
    }
    // The way out of the sandbox is its egress proxy (see egress.rs).
    if let Some(proxy) = crate::egress::proxy_url() {
        for key in ["http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"] {
            env.push((key.into(), proxy.clone()));
        }
        for key in ["no_proxy", "NO_PROXY"] {
            env.push((key.into(), "localhost,127.0.0.1,::1".into()));
        }
    }
    // The proxy's CA (for hosts it adds credentials to) is in the system
    // bundles a template has; Node reads only its own, plus this.
    if std::path::Path::new(EGRESS_CA).exists() {
        env.push(("NODE_EXTRA_CA_CERTS".into(), EGRESS_CA.into()));
    }
    if let Some(tunables) = crate::simd::glibc_tunables() {
        env.push(("GLIBC_TUNABLES".into(), tunables.into()));
    }
    // The image's settings, then the request's own.
    let image = image_for(root);
    for (k, v) in image.env.iter().chain(&req.env) {
        env.retain(|(key, _)| key != k);
        env.push((k.clone(), v.clone()));
    }
    let envp: Vec<CString> = env
        .iter()
        .map(|(k, v)| cstring(&format!("{k}={v}")))
        .collect::<Result<_, _>>()?;
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map_or(DEFAULT_PATH, |(_, v)| v.as_str());
    let candidates: Vec<CString> = if program.contains('/') {
        vec![cstring(program)?]
    } else {
        path.split(':')
            .filter(|d| !d.is_empty())
            .map(|d| cstring(&format!("{d}/{program}")))
            .collect::<Result<_, _>>()?
    };
    let cwd = cstring(req.cwd.as_deref().or(image.cwd.as_deref()).unwrap_or("/"))?;
    let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut envp_ptrs: Vec<*const libc::c_char> = envp.iter().map(|e| e.as_ptr()).collect();
    envp_ptrs.push(std::ptr::null());

    // The child's stdio, and the parent's ends of it.
    let (child_io, input, outputs, pty) = match req.pty {
        Some(size) => {
            let (master, slave) = openpty(size)?;
            let reader = master.try_clone()?;
            let writer = master.try_clone()?;
            (
                vec![slave],
                writer,
                vec![(Stream::Stdout, reader)],
                Some(master),
            )
        }
        None => {
            let (in_r, in_w) = pipe()?;
            let (out_r, out_w) = pipe()?;
            let (err_r, err_w) = pipe()?;
            let outputs = vec![(Stream::Stdout, out_r), (Stream::Stderr, err_r)];
            (vec![in_r, out_w, err_w], in_w, outputs, None)
        }
    };
    finish_spawn(
        &child_io,
        input,
        outputs,
        pty,
        (&candidates, &argv_ptrs, &envp_ptrs, &cwd),
        req,
        (cgroup, root, ns),
    )
}

/// The image settings a program gets: the template image's, none in a
/// container (its own come with each request).
fn image_for(root: Option<&Root>) -> &'static crate::image::Image {
    match root {
        Some(_) => &crate::image::NONE,
        None => crate::image::get(),
    }
}

/// A container's root directory, and what the child mounts inside it
/// before it makes it its root (prepared before the fork: the child only
/// makes system calls).
pub struct Root {
    dir: CString,
    proc: CString,
    dev: CString,
    sys: CString,
}

impl Root {
    /// `dir` must be a directory; its `proc`, `dev` and `sys` are made.
    fn new(dir: &str) -> std::io::Result<Root> {
        let path = std::path::Path::new(dir);
        if !path.is_absolute() || !std::fs::metadata(path)?.is_dir() {
            return Err(std::io::Error::new(
                IoErrorKind::InvalidInput,
                format!("{dir} is not an absolute path of a directory"),
            ));
        }
        for sub in ["proc", "dev", "sys"] {
            // The archive may have them already (as directories or not:
            // then the mount fails and says so).
            let _ = std::fs::create_dir(path.join(sub));
        }
        Ok(Root {
            dir: cstring(dir)?,
            proc: cstring(&format!("{dir}/proc"))?,
            dev: cstring(&format!("{dir}/dev"))?,
            sys: cstring(&format!("{dir}/sys"))?,
        })
    }

    /// In the child: a mount namespace of its own in which `dir` is `/`,
    /// with the guest's /proc (the pod's processes), /dev and /sys.
    ///
    /// # Safety
    /// Only system calls on the prepared paths: safe after fork.
    unsafe fn enter(&self) -> Result<(), libc::c_int> {
        // SAFETY: system calls on NUL-terminated paths prepared before fork.
        unsafe {
            let ok = |rc: libc::c_int| {
                if rc == 0 {
                    Ok(())
                } else {
                    Err(*libc::__errno_location())
                }
            };
            let none = std::ptr::null::<libc::c_char>();
            ok(libc::unshare(libc::CLONE_NEWNS))?;
            ok(libc::mount(
                none,
                c"/".as_ptr(),
                none,
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            ok(libc::mount(
                self.dir.as_ptr(),
                self.dir.as_ptr(),
                none,
                libc::MS_BIND | libc::MS_REC,
                std::ptr::null(),
            ))?;
            let hardened = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
            ok(libc::mount(
                c"proc".as_ptr(),
                self.proc.as_ptr(),
                c"proc".as_ptr(),
                hardened,
                std::ptr::null(),
            ))?;
            ok(libc::mount(
                c"/dev".as_ptr(),
                self.dev.as_ptr(),
                none,
                libc::MS_BIND | libc::MS_REC,
                std::ptr::null(),
            ))?;
            ok(libc::mount(
                c"sysfs".as_ptr(),
                self.sys.as_ptr(),
                c"sysfs".as_ptr(),
                hardened | libc::MS_RDONLY,
                std::ptr::null(),
            ))?;
            ok(libc::chdir(self.dir.as_ptr()))?;
            // The old root goes under the new one, then is detached. An
            // initramfs root cannot be pivoted (EINVAL): then the tree is
            // moved over `/` and made the root, as switch_root does.
            if libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) == 0 {
                ok(libc::umount2(c".".as_ptr(), libc::MNT_DETACH))?;
            } else {
                ok(libc::mount(
                    c".".as_ptr(),
                    c"/".as_ptr(),
                    none,
                    libc::MS_MOVE,
                    std::ptr::null(),
                ))?;
                ok(libc::chroot(c".".as_ptr()))?;
            }
            ok(libc::chdir(c"/".as_ptr()))
        }
    }
}

type ExecArgs<'a> = (
    &'a [CString],
    &'a [*const libc::c_char],
    &'a [*const libc::c_char],
    &'a CString,
);

/// The fork itself. `child_io` is [stdin, stdout, stderr] for pipes, or
/// [terminal] for a PTY.
fn finish_spawn(
    child_io: &[File],
    input: File,
    outputs: Vec<(Stream, File)>,
    pty: Option<File>,
    (candidates, argv_ptrs, envp_ptrs, cwd): ExecArgs<'_>,
    req: &ExecRequest,
    (cgroup, root, ns): (Option<&Cgroup>, Option<&Root>, &PidNs<'_>),
) -> std::io::Result<Spawned> {
    let (exec_r, exec_w) = pipe()?;
    let fds: [libc::c_int; 3] = match child_io {
        [tty] => [tty.as_raw_fd(); 3],
        [i, o, e] => [i.as_raw_fd(), o.as_raw_fd(), e.as_raw_fd()],
        _ => return Err(IoErrorKind::InvalidInput.into()),
    };
    let on_pty = pty.is_some();
    let report = exec_w.as_raw_fd();
    let user = req.user.or(image_for(root).user);
    let procs = cgroup.map(|c| c.procs.as_ptr());
    // SAFETY: sigset_t is plain data; sigemptyset initialises it.
    let mut empty: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `empty` is a valid sigset_t.
    unsafe { libc::sigemptyset(&mut empty) };
    let (pid, ()) = reaper::spawn_watched(|| {
        // SAFETY: after fork the child only makes async-signal-safe calls on
        // memory prepared before the fork, then execs or _exits.
        let pid = unsafe { crate::container::fork_in(ns)? };
        if pid == 0 {
            // SAFETY: see above.
            unsafe {
                child(
                    fds, on_pty, procs, root, user, cwd, candidates, argv_ptrs, envp_ptrs, report,
                    &empty,
                )
            }
        }
        Ok::<_, std::io::Error>((pid, ()))
    })?;
    drop(exec_w);
    let mut exec_r = exec_r;
    let mut errno = [0u8; 4];
    match exec_r.read(&mut errno) {
        // The pipe closed on exec: the program is running.
        Ok(0) => Ok(Spawned {
            pid,
            input,
            outputs,
            pty,
        }),
        _ => {
            // The child exits with 127; take its exit so nothing waits for it.
            let _ = reaper::wait(pid, None);
            Err(std::io::Error::from_raw_os_error(i32::from_ne_bytes(errno)))
        }
    }
}

/// The child between fork and exec. Reports the errno of the first step
/// that failed through `report`, then exits.
///
/// # Safety
/// Must only be called in a freshly forked child; every pointer must stay
/// valid (they point into the parent's memory, copied by fork).
#[allow(clippy::too_many_arguments)]
unsafe fn child(
    [stdin, stdout, stderr]: [libc::c_int; 3],
    on_pty: bool,
    procs: Option<*const libc::c_char>,
    root: Option<&Root>,
    user: Option<husk_protocol::User>,
    cwd: &CString,
    candidates: &[CString],
    argv: &[*const libc::c_char],
    envp: &[*const libc::c_char],
    report: libc::c_int,
    empty: &libc::sigset_t,
) -> ! {
    // SAFETY: async-signal-safe calls on valid arguments (caller's contract).
    unsafe {
        let fail = |errno: libc::c_int| -> ! {
            libc::write(report, (&errno as *const i32).cast(), 4);
            libc::_exit(127)
        };
        let errno = || *libc::__errno_location();
        libc::sigprocmask(libc::SIG_SETMASK, empty, std::ptr::null_mut());
        // Rust ignores SIGPIPE; programs expect the default.
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        // The agent's exemption from the OOM killer is not for programs.
        // Raising the score needs no privilege; without /proc it stays.
        let fd = libc::open(OOM_SCORE_ADJ.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd >= 0 {
            libc::write(fd, b"0".as_ptr().cast(), 1);
            libc::close(fd);
        }
        if let Some(procs) = procs {
            let fd = libc::open(procs, libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                fail(errno());
            }
            libc::close(fd);
        }
        if on_pty {
            libc::setsid();
            if libc::ioctl(stdin, libc::TIOCSCTTY, 0) != 0 {
                fail(errno());
            }
        } else {
            libc::setpgid(0, 0);
        }
        libc::dup2(stdin, 0);
        libc::dup2(stdout, 1);
        libc::dup2(stderr, 2);
        if let Some(root) = root {
            if let Err(e) = root.enter() {
                fail(e);
            }
        }
        if let Some(u) = user {
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(u.gid) != 0
                || libc::setuid(u.uid) != 0
            {
                fail(errno());
            }
        }
        if libc::chdir(cwd.as_ptr()) != 0 {
            fail(errno());
        }
        let mut first = 0;
        for candidate in candidates {
            libc::execve(candidate.as_ptr(), argv.as_ptr(), envp.as_ptr());
            let e = errno();
            // Like execvp: a permission problem beats "not found".
            if first == 0 || e != libc::ENOENT {
                first = e;
            }
        }
        fail(first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_reader_keeps_what_it_has_not_had_and_lets_go_when_released() {
        let mut out = Output::new(MIN_RING as usize, 1);
        let key = out.hold(0);
        out.ring.push(Stream::Stdout, &[b'x'; 3000]);

        // Another 3000 bytes would push out some the reader has not had.
        assert!(out.would_lose(3000));
        assert!(!out.would_lose(100));
        out.had(key, 2000);
        assert!(out.would_lose(3000));
        out.had(key, 3000);
        assert!(!out.would_lose(3000));
        out.had(key, 0);
        out.release(key);
        assert!(!out.would_lose(3000), "a released reader holds nothing");
    }

    #[test]
    fn the_slowest_of_several_held_readers_holds_the_program() {
        let mut out = Output::new(MIN_RING as usize, 1);
        let (fast, slow) = (out.hold(0), out.hold(0));
        out.ring.push(Stream::Stderr, &[b'y'; 3000]);
        out.had(fast, 3000);

        assert!(out.would_lose(3000));
        out.had(slow, 3000);
        assert!(!out.would_lose(3000));
        out.release(fast);
        out.release(slow);
        assert!(out.held.is_empty());
    }
}
