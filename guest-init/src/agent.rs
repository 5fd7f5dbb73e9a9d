//! The agent: serves the husk protocol (see the husk-protocol crate) on
//! vsock port AGENT_PORT, one thread per connection, and a thread per
//! long request so requests on one connection run concurrently. Nothing a
//! client sends can end PID 1: every error is answered or ends only that
//! connection, and a panic ends only the thread it happened on.

use std::fs::File;
use std::io::BufReader;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use husk_protocol::{
    decode, file_chunk, read_payload, write_frame, Body, ErrorKind, Frame, ProtocolError,
    AGENT_PORT, VERSION,
};

use crate::conn::{lock, Cancel, Conn};
use crate::vsock::Listener;

/// Most connections served at once; more are closed on accept.
const MAX_CONNECTIONS: usize = 16;
/// Most long requests (exec, attach, wait, read, list, watch) in flight
/// on one connection.
const MAX_IN_FLIGHT: usize = 32;

/// Starts listening; the accept loop runs on its own thread.
pub fn start() -> std::io::Result<()> {
    let listener = Listener::bind(AGENT_PORT)?;
    std::thread::Builder::new()
        .name("agent".into())
        .spawn(move || accept_loop(listener))?;
    Ok(())
}

fn accept_loop(listener: Listener) {
    let active = Arc::new(AtomicUsize::new(0));
    loop {
        let stream = match listener.accept() {
            Ok(s) => s,
            Err(e) => {
                crate::log(&format!("agent: accept failed: {e}"));
                std::thread::sleep(std::time::Duration::from_millis(100));
                continue;
            }
        };
        if active.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
            let msg = format!("the agent serves at most {MAX_CONNECTIONS} connections");
            let mut stream = stream;
            let _ = write_frame(&mut stream, &error(0, ErrorKind::Limit, msg));
            continue; // dropping the stream closes it
        }
        active.fetch_add(1, Ordering::SeqCst);
        let count = active.clone();
        let spawned = std::thread::Builder::new()
            .name("agent-conn".into())
            .spawn(move || {
                // A panic is a bug, but must not take the other clients down.
                if std::panic::catch_unwind(move || serve(stream)).is_err() {
                    crate::log("agent: a connection ended in a panic");
                }
                count.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

pub fn error(id: u64, kind: ErrorKind, message: impl Into<String>) -> Frame {
    Frame {
        id,
        body: Body::Error {
            kind,
            message: message.into(),
        },
    }
}

/// The answer to a change of a container's limits.
fn limits_set(id: u64, root: &str, set: std::io::Result<()>) -> Frame {
    match set {
        Ok(()) => Frame {
            id,
            body: Body::Done,
        },
        Err(e) => {
            let kind = match e.kind() {
                std::io::ErrorKind::Unsupported => ErrorKind::Unsupported,
                std::io::ErrorKind::NotFound => ErrorKind::NotFound,
                _ => crate::files::kind_of(&e),
            };
            error(id, kind, format!("limits of the container at {root}: {e}"))
        }
    }
}

/// Serves one connection until the client leaves or breaks the framing.
fn serve(stream: File) {
    let Ok(out) = stream.try_clone() else {
        return;
    };
    let conn = Arc::new(Conn::new(out));
    let mut input = BufReader::new(stream);
    let mut greeted = false;
    let mut writing: Option<Pending> = None;
    // One payload buffer for the connection's frames: a streamed write's
    // chunks are taken from it in place (each fresh buffer of a large
    // frame would cost the guest kernel an mmap, its page faults and an
    // munmap).
    let mut payload = Vec::new();
    loop {
        match read_payload(&mut input, &mut payload) {
            Ok(()) => {}
            Err(ProtocolError::TooLarge(n)) => {
                // The stream cannot be resynchronised: say why, then close.
                let msg = format!("frame of {n} bytes is over the limit");
                let _ = conn.send(&error(0, ErrorKind::TooLarge, msg));
                break;
            }
            Err(_) => break,
        }
        if let Some((id, data)) = file_chunk(&payload).filter(|_| greeted) {
            let reply = match writing.as_mut() {
                Some(w) if w.id() == id => {
                    w.chunk(data);
                    None
                }
                _ => Some(error(id, ErrorKind::Invalid, "no write in progress")),
            };
            if reply.is_some_and(|r| conn.send(&r).is_err()) {
                break;
            }
            continue;
        }
        let frame = match decode(&payload) {
            Ok(frame) => frame,
            Err(ProtocolError::Malformed(e)) => {
                if conn
                    .send(&error(0, ErrorKind::Malformed, e.to_string()))
                    .is_err()
                {
                    break;
                }
                continue;
            }
            Err(_) => break,
        };
        let id = frame.id;
        let reply = if !greeted {
            match frame.body {
                Body::Hello { version: VERSION } => {
                    greeted = true;
                    Some(Frame {
                        id,
                        body: Body::Hello { version: VERSION },
                    })
                }
                Body::Hello { version } => {
                    let msg = format!("agent speaks version {VERSION}, client {version}");
                    let _ = conn.send(&error(id, ErrorKind::VersionMismatch, msg));
                    break;
                }
                _ => Some(error(
                    id,
                    ErrorKind::Malformed,
                    "the first message must be Hello",
                )),
            }
        } else {
            match frame.body {
                body @ (Body::WriteFile { .. } | Body::Unpack { .. }) => match writing {
                    Some(_) => Some(error(
                        id,
                        ErrorKind::Invalid,
                        "a write is already in progress",
                    )),
                    None => {
                        writing = Some(Pending::start(id, body));
                        None
                    }
                },
                Body::FileCommit => match writing.take() {
                    Some(w) if w.id() == id => Some(w.commit()),
                    other => {
                        writing = other;
                        Some(error(id, ErrorKind::Invalid, "no write in progress"))
                    }
                },
                body => dispatch(id, body, &conn),
            }
        };
        if let Some(reply) = reply {
            if conn.send(&reply).is_err() {
                break;
            }
        }
    }
    conn.close();
    let foreground: Vec<i32> = lock(&conn.foreground).iter().copied().collect();
    for pid in foreground {
        if let Some(p) = crate::process::find(pid) {
            let _ = p.signal(libc::SIGKILL);
        }
    }
}

/// A streamed write in progress on a connection: a file, or a tree.
enum Pending {
    File(crate::files::PendingWrite),
    Tree(crate::unpack::PendingUnpack),
}

impl Pending {
    /// `body` is `WriteFile` or `Unpack`.
    fn start(id: u64, body: Body) -> Self {
        match body {
            Body::Unpack { dir } => Pending::Tree(crate::unpack::PendingUnpack::start(id, &dir)),
            Body::WriteFile { path, mode } => {
                Pending::File(crate::files::PendingWrite::start(id, &path, mode))
            }
            _ => unreachable!("only writes start a pending write"),
        }
    }

    fn id(&self) -> u64 {
        match self {
            Pending::File(w) => w.id,
            Pending::Tree(u) => u.id,
        }
    }

    fn chunk(&mut self, data: &[u8]) {
        match self {
            Pending::File(w) => w.chunk(data),
            Pending::Tree(u) => u.chunk(data),
        }
    }

    fn commit(self) -> Frame {
        match self {
            Pending::File(w) => w.commit(),
            Pending::Tree(u) => u.commit(),
        }
    }
}

/// Answers quick requests inline; runs long ones on their own thread.
fn dispatch(id: u64, body: Body, conn: &Arc<Conn>) -> Option<Frame> {
    let quick = match body {
        Body::Ping => Body::Pong {
            uptime_ms: crate::sys::uptime_ms(),
        },
        Body::Health => match crate::sys::health() {
            Ok(h) => Body::HealthInfo(h),
            Err(e) => return Some(error(id, ErrorKind::Internal, format!("sysinfo: {e}"))),
        },
        Body::SetClock { unix_ns } => match crate::sys::set_clock(unix_ns) {
            Ok(()) => Body::Done,
            Err(e) => {
                let msg = format!("cannot set the clock to {unix_ns} ns: {e}");
                return Some(error(id, ErrorKind::Invalid, msg));
            }
        },
        Body::Restored {
            unix_ns,
            hostname,
            entropy,
            mac,
        } => {
            let valid = !hostname.is_empty()
                && hostname.len() <= 64
                && hostname
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
            if !valid {
                let msg = format!("`{hostname}` is not a valid hostname");
                return Some(error(id, ErrorKind::Invalid, msg));
            }
            let steps = [
                ("set the clock", crate::sys::set_clock(unix_ns)),
                ("set the hostname", crate::sys::set_hostname(&hostname)),
                ("add entropy", crate::sys::add_entropy(&entropy)),
                (
                    "set the MAC address",
                    mac.map_or(Ok(()), |mac| crate::net::set_mac(&mac)),
                ),
            ];
            for (what, result) in steps {
                if let Err(e) = result {
                    let msg = format!("cannot {what} after the restore: {e}");
                    return Some(error(id, ErrorKind::Internal, msg));
                }
            }
            Body::Done
        }
        Body::Stat { path } => return Some(crate::files::stat(id, &path)),
        Body::Mkdir { path } => return Some(crate::files::mkdir(id, &path)),
        Body::MkdirAs { path, user } => return Some(crate::files::mkdir_as(id, &path, user)),
        Body::Chown { path, user } => return Some(crate::files::chown(id, &path, user)),
        Body::Remove { path, recursive } => {
            // A container's tree goes with its declaration.
            crate::container::forget(&path);
            return Some(crate::files::remove(id, &path, recursive));
        }
        Body::ContainerStats { root } => match crate::container::usage(&root) {
            Ok(usage) => Body::ContainerUsage(usage),
            Err(e) => {
                let message = format!("the container at {root}: {e}");
                return Some(error(id, crate::files::kind_of(&e), message));
            }
        },
        Body::Mount {
            root,
            source,
            target,
            readonly,
        } => {
            if let Err(e) = crate::container::bind(&root, &source, &target, readonly) {
                let message = format!("binding {source} at {target} in {root}: {e}");
                return Some(error(id, crate::files::kind_of(&e), message));
            }
            Body::Done
        }
        Body::Network(config) => {
            if let Err(e) = crate::net::configure(&config) {
                let message = format!("configuring the network: {e}");
                return Some(error(id, crate::files::kind_of(&e), message));
            }
            Body::Done
        }
        Body::MountShare {
            tag,
            target,
            readonly,
        } => {
            if let Err(e) = crate::medium::mount_share(&tag, &target, readonly) {
                let message = format!("mounting shared directory {tag:?} at {target}: {e}");
                return Some(error(id, crate::files::kind_of(&e), message));
            }
            Body::Done
        }
        Body::Container {
            root,
            memory_max,
            own_pids,
        } => {
            if let Err(e) = crate::container::declare(&root, memory_max, own_pids) {
                let kind = match e.kind() {
                    std::io::ErrorKind::Unsupported => ErrorKind::Unsupported,
                    std::io::ErrorKind::AlreadyExists => ErrorKind::Conflict,
                    _ => ErrorKind::Internal,
                };
                return Some(error(id, kind, format!("container at {root}: {e}")));
            }
            Body::Done
        }
        Body::ContainerLimits { root, memory_max } => {
            let set = crate::container::set_memory_max(&root, memory_max);
            return Some(limits_set(id, &root, set));
        }
        Body::ContainerCpu {
            root,
            quota_us,
            period_us,
        } => {
            let set = crate::container::set_cpu_max(&root, quota_us, period_us);
            return Some(limits_set(id, &root, set));
        }
        Body::Rename { from, to } => return Some(crate::files::rename(id, &from, &to)),
        Body::UserAttrs { path, set } => {
            return Some(crate::files::set_user_attrs(id, &path, &set))
        }
        Body::Signal { pid, signal } => return Some(crate::exec::signal(id, pid, signal)),
        Body::Processes => return Some(crate::exec::processes(id)),
        Body::Table => return Some(crate::exec::table(id)),
        Body::Forget { pid } => return Some(crate::exec::forget(id, pid)),
        body @ (Body::Stdin { .. } | Body::StdinClose { .. } | Body::Resize { .. }) => {
            return crate::exec::input(id, body)
        }
        Body::Cancel => {
            let watch = lock(&conn.watches).remove(&id);
            return match watch {
                // The watch thread answers Done.
                Some(cancel) => {
                    cancel.cancel();
                    None
                }
                None => Some(error(id, ErrorKind::NotFound, "no watch with this id")),
            };
        }
        Body::Hello { .. } => return Some(error(id, ErrorKind::Malformed, "already greeted")),
        body @ (Body::Exec(_)
        | Body::ExecIn { .. }
        | Body::Attach { .. }
        | Body::Spawn { .. }
        | Body::Follow { .. }
        | Body::FollowHeld { .. }
        | Body::Wait { .. }
        | Body::ReadFile { .. }
        | Body::List { .. }
        | Body::DirUserAttrs { .. }
        | Body::Watch { .. }
        | Body::MountMedium { .. }
        | Body::KillAll
        | Body::Reclaim) => return spawn_long(id, body, conn),
        other => {
            let msg = format!("the agent does not handle {}", name(&other));
            return Some(error(id, ErrorKind::Unsupported, msg));
        }
    };
    Some(Frame { id, body: quick })
}

/// `KillAll`: everything the sandbox's user started, gone.
fn kill_all(id: u64) -> Frame {
    match crate::cgroup::kill_all(husk_protocol::KILL_ALL_DRAIN) {
        Ok(tasks) => {
            crate::log(&format!("agent: killed all {tasks} tasks of the sandbox"));
            Frame {
                id,
                body: Body::KilledAll { tasks },
            }
        }
        Err(e) => {
            let kind = match e.kind() {
                std::io::ErrorKind::Unsupported => ErrorKind::Unsupported,
                std::io::ErrorKind::TimedOut => ErrorKind::Timeout,
                _ => ErrorKind::Internal,
            };
            error(id, kind, format!("cannot kill the sandbox's programs: {e}"))
        }
    }
}

/// `Reclaim`: the page cache dropped and free memory compacted.
fn reclaim(id: u64) -> Frame {
    match crate::sys::reclaim() {
        Ok((free_before_kib, free_after_kib)) => Frame {
            id,
            body: Body::Reclaimed {
                free_before_kib,
                free_after_kib,
            },
        },
        Err(e) => error(
            id,
            ErrorKind::Internal,
            format!("cannot reclaim memory: {e}"),
        ),
    }
}

/// The message's name, without its (possibly large) contents.
fn name(body: &Body) -> String {
    let debug = format!("{body:?}");
    debug
        .split(|c: char| !c.is_alphanumeric())
        .next()
        .unwrap_or("")
        .to_owned()
}

fn spawn_long(id: u64, body: Body, conn: &Arc<Conn>) -> Option<Frame> {
    if conn.in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {
        conn.in_flight.fetch_sub(1, Ordering::SeqCst);
        let msg = format!("at most {MAX_IN_FLIGHT} long requests run at once on one connection");
        return Some(error(id, ErrorKind::Limit, msg));
    }
    let cancel = match &body {
        Body::Watch { .. } => match Cancel::new() {
            Ok(c) => {
                let c = Arc::new(c);
                lock(&conn.watches).insert(id, c.clone());
                Some(c)
            }
            Err(e) => {
                conn.in_flight.fetch_sub(1, Ordering::SeqCst);
                return Some(error(id, ErrorKind::Internal, format!("eventfd: {e}")));
            }
        },
        _ => None,
    };
    let worker = conn.clone();
    let spawned = std::thread::Builder::new()
        .name("agent-req".into())
        .spawn(move || {
            let conn = worker;
            let run = std::panic::AssertUnwindSafe(|| match body {
                Body::Exec(req) => crate::exec::exec(id, req, None, &conn),
                Body::ExecIn { root, request } => crate::exec::exec(id, request, Some(root), &conn),
                Body::Attach { pid } => crate::exec::attach(id, pid, &conn),
                Body::Spawn { request, tag, ring } => crate::exec::spawn(id, request, tag, ring),
                Body::Follow { pid, from } => crate::exec::follow(id, pid, from, false, &conn),
                Body::FollowHeld { pid, from } => crate::exec::follow(id, pid, from, true, &conn),
                Body::Wait { pid } => crate::exec::wait(id, pid, &conn),
                Body::ReadFile { path } => crate::files::read(id, &path, &conn),
                Body::List { path } => crate::files::list(id, &path, &conn),
                Body::DirUserAttrs { path } => crate::files::dir_user_attrs(id, &path),
                Body::KillAll => kill_all(id),
                Body::Reclaim => reclaim(id),
                Body::MountMedium { serial, size, root } => {
                    match crate::medium::mount(&serial, size, &root) {
                        Ok(()) => Frame {
                            id,
                            body: Body::Done,
                        },
                        Err(e) => {
                            let message = format!("the medium of drive {serial:?} at {root}: {e}");
                            error(id, crate::files::kind_of(&e), message)
                        }
                    }
                }
                Body::Watch { path, recursive } => {
                    let cancel = cancel.expect("a watch has a cancel handle");
                    let reply = crate::watch::run(id, &path, recursive, &conn, &cancel);
                    lock(&conn.watches).remove(&id);
                    reply
                }
                _ => error(id, ErrorKind::Internal, "not a long request"),
            });
            let reply = std::panic::catch_unwind(run).unwrap_or_else(|_| {
                crate::log("agent: a request ended in a panic");
                error(id, ErrorKind::Internal, "the agent failed on this request")
            });
            let _ = conn.send(&reply);
            conn.in_flight.fetch_sub(1, Ordering::SeqCst);
        });
    match spawned {
        Ok(_) => None,
        Err(e) => {
            conn.in_flight.fetch_sub(1, Ordering::SeqCst);
            lock(&conn.watches).remove(&id);
            Some(error(
                id,
                ErrorKind::Limit,
                format!("cannot start a thread: {e}"),
            ))
        }
    }
}
