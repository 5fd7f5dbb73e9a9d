//! Program requests: `Exec` (foreground or background), `Attach`, `Wait`,
//! `Signal`, `Stdin`, `StdinClose`, `Resize` and `Processes`; the kept
//! programs' `Spawn`, `Follow`, `Table` and `Forget`. The programs
//! themselves live in `process`.

use std::io::ErrorKind as IoErrorKind;
use std::time::Duration;

use husk_protocol::{Body, ErrorKind, ExecRequest, Frame, WindowSize};

use crate::conn::Conn;
use crate::process::{self, Ended, Process, StartError};

fn error(id: u64, kind: ErrorKind, message: String) -> Frame {
    Frame {
        id,
        body: Body::Error { kind, message },
    }
}

fn not_found(id: u64, pid: i32) -> Frame {
    error(
        id,
        ErrorKind::NotFound,
        format!("no program with pid {pid} (never started by the agent, or already collected)"),
    )
}

/// `Exec` (and `ExecIn`, with the program's `root`): starts the program; a
/// foreground one is streamed until it ends.
pub fn exec(id: u64, req: ExecRequest, root: Option<String>, conn: &Conn) -> Frame {
    let Some(program) = req.argv.first().cloned() else {
        return error(id, ErrorKind::Invalid, "argv is empty".into());
    };
    let process = match process::start(&req, root.as_deref()) {
        Ok(p) => p,
        Err(e) => return start_error(id, &program, e),
    };
    let pid = process.pid;
    let started = Frame {
        id,
        body: Body::Started { pid },
    };
    if req.background {
        return started;
    }
    conn.adopt(pid);
    let streamed = match conn.send(&started) {
        Ok(()) => stream(id, &process, conn),
        Err(_) => Streamed::ClientGone,
    };
    conn.disown(pid);
    process::remove(pid);
    match streamed {
        Streamed::Ended(ended) => final_frame(id, &process, ended),
        _ => {
            // Nobody is left to see it: a foreground program ends with its client.
            let _ = process.signal(libc::SIGKILL);
            error(id, ErrorKind::Internal, "the client went away".into())
        }
    }
}

fn start_error(id: u64, program: &str, e: StartError) -> Frame {
    match e {
        StartError::Full => {
            let max = process::MAX_PROCESSES;
            let msg = format!("{max} programs are running already; wait for or kill some");
            error(id, ErrorKind::Limit, msg)
        }
        StartError::Io(e) => {
            let kind = match e.kind() {
                IoErrorKind::NotFound => ErrorKind::NotFound,
                IoErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
                IoErrorKind::InvalidInput => ErrorKind::Invalid,
                _ if e.raw_os_error() == Some(libc::EAGAIN) => ErrorKind::Limit,
                _ => ErrorKind::Internal,
            };
            error(id, kind, format!("cannot run {program}: {e}"))
        }
    }
}

fn final_frame(id: u64, p: &Process, ended: Ended) -> Frame {
    if ended.timed_out {
        let ms = p.timeout_ms.unwrap_or(0);
        let program = p.argv.first().map_or("the program", |a| a.as_str());
        return error(
            id,
            ErrorKind::Timeout,
            format!("{program} ran past {ms} ms; it and everything it started were killed"),
        );
    }
    if p.output().over_limit {
        let max = p.output_max.unwrap_or(0);
        let program = p.argv.first().map_or("the program", |a| a.as_str());
        return error(
            id,
            ErrorKind::Limit,
            format!(
                "{program} wrote more than its limit of {max} bytes of output; \
                 it and everything it started were killed"
            ),
        );
    }
    Frame {
        id,
        body: Body::Exited(ended.report),
    }
}

enum Streamed {
    Ended(Ended),
    ClientGone,
    Superseded,
}

/// Most bytes of output in one frame.
const FRAME_DATA: usize = 32 << 10;

/// Sends the program's output to the client until it is complete.
fn stream(id: u64, p: &Process, conn: &Conn) -> Streamed {
    let generation = p.attach();
    loop {
        let mut out = p.output();
        while out.attached == generation
            && !conn.is_closed()
            && out.unreported_lost == 0
            && out.undelivered() == 0
            && !out.finished
        {
            out = p.wait_change(out, Duration::from_secs(1));
        }
        if out.attached != generation {
            return Streamed::Superseded;
        }
        let body = if conn.is_closed() {
            None
        } else if out.unreported_lost > 0 {
            Some(Body::Lost {
                bytes: std::mem::take(&mut out.unreported_lost),
            })
        } else if let Some((stream, data)) = out.ring.read(out.delivered, FRAME_DATA) {
            out.delivered += data.len() as u64;
            p.changed.notify_all();
            Some(Body::Output { stream, data })
        } else {
            let ended = out.ended;
            drop(out);
            p.detach(generation);
            return ended.map_or(Streamed::ClientGone, Streamed::Ended);
        };
        drop(out);
        let sent = body.is_some_and(|body| conn.send(&Frame { id, body }).is_ok());
        if !sent {
            p.detach(generation);
            return Streamed::ClientGone;
        }
    }
}

/// `Spawn`: a background program kept in the table.
pub fn spawn(id: u64, mut req: ExecRequest, tag: Option<String>, ring: Option<u32>) -> Frame {
    if req.argv.is_empty() {
        return error(id, ErrorKind::Invalid, "argv is empty".into());
    }
    req.background = true;
    let keep = process::Keep { tag, ring };
    match process::start_kept(&req, None, Some(keep)) {
        Ok(p) => Frame {
            id,
            body: Body::Started { pid: p.pid },
        },
        Err(e) => start_error(id, &req.argv[0], e),
    }
}

/// `Follow` (and `FollowHeld`, with `hold`: the program waits for this
/// reader): a program's output from offset `from`, live, then its end.
pub fn follow(id: u64, pid: i32, from: u64, hold: bool, conn: &Conn) -> Frame {
    let Some(p) = process::find(pid) else {
        return not_found(id, pid);
    };
    // From an offset not written yet, output comes once it is.
    let (mut at, dropped, held) = {
        let mut out = p.output();
        let at = from.max(out.ring.start());
        let held = hold.then(|| Held {
            process: &p,
            key: out.hold(at),
        });
        (at, out.ring.start().saturating_sub(from), held)
    };
    let replay = Frame {
        id,
        body: Body::Replay {
            offset: at,
            dropped,
        },
    };
    if conn.send(&replay).is_err() {
        return error(id, ErrorKind::Internal, "the client went away".into());
    }
    loop {
        let mut out = p.output();
        if let Some(h) = &held {
            out.had(h.key, at);
            p.changed.notify_all();
        }
        while !conn.is_closed() && at >= out.ring.end() && !out.finished {
            out = p.wait_change(out, Duration::from_secs(1));
        }
        let body = if conn.is_closed() {
            return error(id, ErrorKind::Internal, "the client went away".into());
        } else if at < out.ring.start() {
            let bytes = out.ring.start() - at;
            at = out.ring.start();
            Body::Lost { bytes }
        } else if let Some((stream, data)) = out.ring.read(at, FRAME_DATA) {
            at += data.len() as u64;
            Body::Output { stream, data }
        } else {
            let ended = out.ended;
            drop(out);
            drop(held);
            return match ended {
                Some(ended) => final_frame(id, &p, ended),
                None => error(
                    id,
                    ErrorKind::Internal,
                    "the program's output ended early".into(),
                ),
            };
        };
        drop(out);
        if conn.send(&Frame { id, body }).is_err() {
            return error(id, ErrorKind::Internal, "the client went away".into());
        }
    }
}

/// A `FollowHeld` reader's hold on its program, released when it goes.
struct Held<'a> {
    process: &'a process::Process,
    key: u64,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.process.output().release(self.key);
        // The pump may be waiting for room that this reader will not make.
        self.process.changed.notify_all();
    }
}

/// `Forget`: an ended program and its kept output.
pub fn forget(id: u64, pid: i32) -> Frame {
    let Some(p) = process::find(pid) else {
        return not_found(id, pid);
    };
    if p.output().ended.is_none() {
        let msg = format!("pid {pid} is still running; signal it first");
        return error(id, ErrorKind::Conflict, msg);
    }
    process::remove(pid);
    Frame {
        id,
        body: Body::Done,
    }
}

/// `Table`.
pub fn table(id: u64) -> Frame {
    Frame {
        id,
        body: Body::Programs(process::programs()),
    }
}

/// `Attach`: the buffered output of a program, then live output, then how
/// it ended; the program is then collected.
pub fn attach(id: u64, pid: i32, conn: &Conn) -> Frame {
    let Some(p) = process::find(pid) else {
        return not_found(id, pid);
    };
    if !p.background {
        let msg = format!("pid {pid} is a foreground program; its output goes to its own client");
        return error(id, ErrorKind::Conflict, msg);
    }
    match stream(id, &p, conn) {
        Streamed::Ended(ended) => {
            process::remove(pid);
            final_frame(id, &p, ended)
        }
        Streamed::Superseded => {
            let msg = format!("another client attached to pid {pid}");
            error(id, ErrorKind::Conflict, msg)
        }
        Streamed::ClientGone => error(id, ErrorKind::Internal, "the client went away".into()),
    }
}

/// `Wait`: how a background program ended (its output is discarded); the
/// program is then collected.
pub fn wait(id: u64, pid: i32, conn: &Conn) -> Frame {
    let Some(p) = process::find(pid) else {
        return not_found(id, pid);
    };
    if !p.background {
        let msg = format!("pid {pid} is a foreground program; its own client collects it");
        return error(id, ErrorKind::Conflict, msg);
    }
    let mut out = p.output();
    while !out.finished && !conn.is_closed() {
        out = p.wait_change(out, Duration::from_secs(1));
    }
    let Some(ended) = out.ended.filter(|_| out.finished) else {
        return error(id, ErrorKind::Internal, "the client went away".into());
    };
    drop(out);
    process::remove(pid);
    final_frame(id, &p, ended)
}

/// `Signal`: to the program's process group (SIGKILL: its whole cgroup).
pub fn signal(id: u64, pid: i32, signal: i32) -> Frame {
    let Some(p) = process::find(pid) else {
        return not_found(id, pid);
    };
    if !(1..=64).contains(&signal) {
        return error(id, ErrorKind::Invalid, format!("{signal} is not a signal"));
    }
    if p.output().ended.is_some() {
        return error(
            id,
            ErrorKind::Invalid,
            format!("pid {pid} has already exited"),
        );
    }
    match p.signal(signal) {
        Ok(()) => Frame {
            id,
            body: Body::Done,
        },
        Err(e) => error(
            id,
            ErrorKind::Internal,
            format!("cannot signal pid {pid}: {e}"),
        ),
    }
}

/// `Stdin`, `StdinClose` and `Resize` are answered only when they fail.
pub fn input(id: u64, body: Body) -> Option<Frame> {
    let pid = match &body {
        Body::Stdin { pid, .. } | Body::StdinClose { pid } | Body::Resize { pid, .. } => *pid,
        _ => return None,
    };
    let Some(p) = process::find(pid) else {
        return Some(not_found(id, pid));
    };
    let result = match body {
        Body::Stdin { data, .. } => p.write_stdin(data).map_err(String::from),
        Body::StdinClose { .. } => p.close_stdin().map_err(String::from),
        Body::Resize { rows, cols, .. } => p.resize(WindowSize { rows, cols }),
        _ => Ok(()),
    };
    result
        .err()
        .map(|msg| error(id, ErrorKind::Invalid, format!("pid {pid}: {msg}")))
}

/// `Processes`.
pub fn processes(id: u64) -> Frame {
    Frame {
        id,
        body: Body::ProcessList(process::list()),
    }
}
