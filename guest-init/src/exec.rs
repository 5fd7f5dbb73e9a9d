//! `Exec`: runs a program in its own process group, streams its stdout and
//! stderr back as they come, and reports how it ended.

use std::fs::File;
use std::io::{ErrorKind as IoErrorKind, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
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
    let Some(program) = req.argv.first() else {
        return error(id, ErrorKind::Invalid, "argv is empty".into());
    };
    let mut cmd = Command::new(program);
    cmd.args(&req.argv[1..])
        .env_clear()
        .env("PATH", DEFAULT_PATH)
        .env("HOME", "/root")
        .envs(req.env.iter().map(|(k, v)| (k, v)))
        .current_dir(req.cwd.as_deref().unwrap_or("/"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: setpgid is async-signal-safe; the closure touches no memory.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let spawned = reaper::spawn_watched(|| cmd.spawn().map(|c| (c.id() as libc::pid_t, c)));
    let (pid, mut child) = match spawned {
        Ok(spawned) => spawned,
        Err(e) => {
            let kind = match e.kind() {
                IoErrorKind::NotFound => ErrorKind::NotFound,
                IoErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
                _ => ErrorKind::Internal,
            };
            return error(id, kind, format!("cannot run {program}: {e}"));
        }
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
