//! `Exec`: runs a program in its own process group, streams its stdout and
//! stderr back as they come, and reports how it ended.

use std::ffi::CString;
use std::fs::File;
use std::io::{ErrorKind as IoErrorKind, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use husk_protocol::{
    write_frame, Body, ErrorKind, ExecRequest, ExitReport, Frame, Stream, Termination,
};

use crate::reaper;

const DEFAULT_PATH: &str = "/bin:/sbin:/usr/bin:/usr/sbin";
/// After the program exits, how long its output pipes may stay open (a
/// background child holding them) before the report is sent anyway.
const OUTPUT_GRACE: Duration = Duration::from_secs(2);
const CHUNK: usize = 32 << 10;

fn error(id: u64, kind: ErrorKind, message: String) -> Frame {
    Frame {
        id,
        body: Body::Error { kind, message },
    }
}

/// Runs `req`; Output frames go to `out` as the program writes; returns the
/// final frame (Exited or Error).
pub fn run(id: u64, req: ExecRequest, out: &Arc<Mutex<File>>) -> Frame {
    let Some(program) = req.argv.first().cloned() else {
        return error(id, ErrorKind::Invalid, "argv is empty".into());
    };
    let (pid, pipes) = match spawn(&req) {
        Ok(spawned) => spawned,
        Err(e) => {
            let kind = match e.kind() {
                IoErrorKind::NotFound => ErrorKind::NotFound,
                IoErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
                IoErrorKind::InvalidInput => ErrorKind::Invalid,
                _ => ErrorKind::Internal,
            };
            return error(id, kind, format!("cannot run {program}: {e}"));
        }
    };
    let [stdin, stdout, stderr] = pipes;
    let mut child = Child {
        stdin: Some(stdin),
        stdout: Some(stdout),
        stderr: Some(stderr),
    };
    if let Some(mut stdin) = child.stdin.take() {
        let input = req.stdin;
        std::thread::spawn(move || {
            // A program that does not read its input is not an error.
            let _ = stdin.write_all(&input);
        });
    }
    let done = Arc::new(AtomicBool::new(false));
    let (finished_tx, finished_rx) = mpsc::channel();
    let pipes: [(Stream, Option<Box<dyn Read + Send>>); 2] = [
        (
            Stream::Stdout,
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        ),
        (
            Stream::Stderr,
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        ),
    ];
    for (stream, pipe) in pipes {
        let Some(mut pipe) = pipe else { continue };
        let (out, done, finished) = (out.clone(), done.clone(), finished_tx.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; CHUNK];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 || done.load(Ordering::SeqCst) {
                    break;
                }
                let frame = Frame {
                    id,
                    body: Body::Output {
                        stream,
                        data: buf[..n].to_vec(),
                    },
                };
                let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
                if write_frame(&mut *out, &frame).is_err() {
                    break;
                }
            }
            let _ = finished.send(());
        });
    }
    drop(finished_tx);
    let deadline = req
        .timeout_ms
        .map(|ms| Instant::now() + Duration::from_millis(ms));
    let (exit, timed_out) = match reaper::wait(pid, deadline) {
        Some(exit) => (exit, false),
        None => {
            // SAFETY: kill the process group the child leads.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            match reaper::wait(pid, None) {
                Some(exit) => (exit, true),
                None => return error(id, ErrorKind::Internal, "lost the program's exit".into()),
            }
        }
    };
    let grace = Instant::now() + OUTPUT_GRACE;
    for _ in 0..2 {
        let left = grace.saturating_duration_since(Instant::now());
        if finished_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    done.store(true, Ordering::SeqCst);
    if timed_out {
        let ms = req.timeout_ms.unwrap_or(0);
        return error(
            id,
            ErrorKind::Timeout,
            format!("{program} ran past {ms} ms; its process group was killed"),
        );
    }
    Frame {
        id,
        body: Body::Exited(report(&exit)),
    }
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

/// The parent's ends of the child's stdin, stdout and stderr.
struct Child {
    stdin: Option<File>,
    stdout: Option<File>,
    stderr: Option<File>,
}

fn pipe() -> std::io::Result<(File, File)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: new descriptors nothing else owns.
    Ok(unsafe {
        (
            File::from(OwnedFd::from_raw_fd(fds[0])),
            File::from(OwnedFd::from_raw_fd(fds[1])),
        )
    })
}

fn cstring(s: &str) -> std::io::Result<CString> {
    CString::new(s).map_err(|_| std::io::Error::from(IoErrorKind::InvalidInput))
}

/// Forks and execs `req` in a new process group, with pipes for its stdio.
/// Written out instead of std's Command because Command reaps a child whose
/// exec failed with waitpid, which races PID 1's reap-everything loop (std
/// then panics, and a panic in PID 1 panics the kernel). Here the exec error
/// comes back through a close-on-exec pipe and the reaper owns every exit.
fn spawn(req: &ExecRequest) -> std::io::Result<(libc::pid_t, [File; 3])> {
    use std::os::fd::AsRawFd;
    let program = &req.argv[0];
    let argv: Vec<CString> = req
        .argv
        .iter()
        .map(|a| cstring(a))
        .collect::<Result<_, _>>()?;
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("HOME".into(), "/root".into()),
    ];
    for (k, v) in &req.env {
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
    let cwd = cstring(req.cwd.as_deref().unwrap_or("/"))?;
    let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut envp_ptrs: Vec<*const libc::c_char> = envp.iter().map(|e| e.as_ptr()).collect();
    envp_ptrs.push(std::ptr::null());
    let (in_r, in_w) = pipe()?;
    let (out_r, out_w) = pipe()?;
    let (err_r, err_w) = pipe()?;
    let (exec_r, exec_w) = pipe()?;
    // SAFETY: sigset_t is plain data; sigemptyset initialises it.
    let mut empty: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `empty` is a valid sigset_t.
    unsafe { libc::sigemptyset(&mut empty) };
    let child_fds = (
        in_r.as_raw_fd(),
        out_w.as_raw_fd(),
        err_w.as_raw_fd(),
        exec_w.as_raw_fd(),
    );
    let (pid, ()) = reaper::spawn_watched(|| {
        // SAFETY: after fork the child only makes async-signal-safe calls on
        // memory prepared before the fork, then execs or _exits.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if pid == 0 {
            // SAFETY: see above.
            unsafe {
                let (stdin, stdout, stderr, report) = child_fds;
                libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
                libc::setpgid(0, 0);
                libc::dup2(stdin, 0);
                libc::dup2(stdout, 1);
                libc::dup2(stderr, 2);
                let mut errno = 0;
                if libc::chdir(cwd.as_ptr()) != 0 {
                    errno = *libc::__errno_location();
                } else {
                    for candidate in &candidates {
                        libc::execve(candidate.as_ptr(), argv_ptrs.as_ptr(), envp_ptrs.as_ptr());
                        let e = *libc::__errno_location();
                        // Like execvp: a permission problem beats "not found".
                        if errno == 0 || e != libc::ENOENT {
                            errno = e;
                        }
                    }
                }
                libc::write(report, (&errno as *const i32).cast(), 4);
                libc::_exit(127);
            }
        }
        Ok((pid, ()))
    })?;
    drop((in_r, out_w, err_w, exec_w));
    let mut exec_r = exec_r;
    let mut errno = [0u8; 4];
    match exec_r.read(&mut errno) {
        // The pipe closed on exec: the program is running.
        Ok(0) => Ok((pid, [in_w, out_r, err_r])),
        _ => {
            // The child exits with 127; take its exit so nothing waits for it.
            let _ = reaper::wait(pid, None);
            Err(std::io::Error::from_raw_os_error(i32::from_ne_bytes(errno)))
        }
    }
}
