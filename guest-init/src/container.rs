//! The containers of a pod (`ExecIn`), as declared (`Container`). One with
//! a PID namespace of its own (Kubernetes' default) gets it from its first
//! program (PID 1 in it); every later one (an exec) joins it, so the
//! container sees only its own processes and the end of its first program
//! ends them all, as under runc; then the container has ended and later
//! programs in its root are refused. One without (the pod's PID namespace
//! shared, or none declared) runs in the guest's. A container with a
//! memory limit gets a cgroup whose `memory.max` bounds all its programs
//! together (each program's own cgroup is below it).

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::cgroup::Group;

/// Where a program is forked.
pub enum PidNs<'a> {
    /// In the agent's PID namespace (not a container's program).
    Own,
    /// Into a new PID namespace (a container's first program).
    New,
    /// Into the container's namespace.
    Join(&'a File),
}

#[derive(Default)]
struct Container {
    /// Whether it has a PID namespace of its own.
    own_pids: bool,
    /// Its PID namespace, once its first program runs.
    pid_ns: Option<File>,
    /// Its first program, in the agent's PID namespace.
    init: Option<libc::pid_t>,
    ended: bool,
    /// Its cgroup, when it has a memory limit.
    group: Option<Group>,
}

/// The containers by root directory.
static CONTAINERS: Mutex<Option<HashMap<String, Container>>> = Mutex::new(None);

fn containers() -> MutexGuard<'static, Option<HashMap<String, Container>>> {
    CONTAINERS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The agent's own PID namespace, to come back to after forking into a
/// container's.
fn own_pid_ns() -> io::Result<&'static File> {
    static OWN: OnceLock<File> = OnceLock::new();
    if let Some(f) = OWN.get() {
        return Ok(f);
    }
    let f = File::open("/proc/self/ns/pid")?;
    Ok(OWN.get_or_init(|| f))
}

/// Declares the container rooted at `root`, before its first program:
/// its memory limit (bytes) if it has one, whether it has a PID namespace
/// of its own.
pub fn declare(root: &str, memory_max: Option<u64>, own_pids: bool) -> io::Result<()> {
    let mut all = containers();
    let map = all.get_or_insert_with(HashMap::new);
    if map.contains_key(root) {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("a container is declared at {root} already"),
        ));
    }
    let group = memory_max.map(Group::create).transpose()?;
    map.insert(
        root.to_owned(),
        Container {
            own_pids,
            group,
            ..Container::default()
        },
    );
    Ok(())
}

/// Starts a program of the container rooted at `root`: `spawn` gets the
/// cgroup its program's cgroup goes below and where to fork it, and
/// returns its pid. The container's first program makes its namespace.
pub fn start(
    root: &str,
    spawn: impl FnOnce(Option<&str>, PidNs<'_>) -> io::Result<libc::pid_t>,
) -> io::Result<libc::pid_t> {
    let mut all = containers();
    let Some(c) = all.get_or_insert_with(HashMap::new).get_mut(root) else {
        // Not declared: as before containers were, in the guest's.
        return spawn(None, PidNs::Own);
    };
    if c.ended {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("the container at {root} has ended (its first program exited)"),
        ));
    }
    let parent = c.group.as_ref().map(Group::path);
    if !c.own_pids {
        return spawn(parent, PidNs::Own);
    }
    match &c.pid_ns {
        Some(ns) => spawn(parent, PidNs::Join(ns)).map_err(|e| match e.raw_os_error() {
            // Its first program is gone and not yet reaped.
            Some(libc::ENOMEM) => io::Error::new(
                io::ErrorKind::NotFound,
                format!("the container at {root} has ended (its first program exited)"),
            ),
            _ => e,
        }),
        None => {
            let pid = spawn(parent, PidNs::New)?;
            c.init = Some(pid);
            match File::open(format!("/proc/{pid}/ns/pid")) {
                Ok(ns) => c.pid_ns = Some(ns),
                // Gone already: so is the container.
                Err(_) => c.ended = true,
            }
            Ok(pid)
        }
    }
}

/// Forks per `ns`, on this thread (a thread's PID namespace for its
/// children is its own: it is put back after the fork). Returns as fork.
///
/// # Safety
/// As `fork`: the child must only make async-signal-safe calls.
pub unsafe fn fork_in(ns: &PidNs<'_>) -> io::Result<libc::pid_t> {
    use std::os::fd::AsRawFd;
    // SAFETY: the caller's contract; setns on descriptors we own.
    unsafe {
        let pid = match ns {
            PidNs::Own => libc::fork(),
            PidNs::New => libc::syscall(
                libc::SYS_clone,
                (libc::CLONE_NEWPID | libc::SIGCHLD) as libc::c_ulong,
                0usize,
                0usize,
                0usize,
                0usize,
            ) as libc::pid_t,
            PidNs::Join(target) => {
                let own = own_pid_ns()?;
                if libc::setns(target.as_raw_fd(), libc::CLONE_NEWPID) != 0 {
                    return Err(io::Error::last_os_error());
                }
                let pid = libc::fork();
                let forked = io::Error::last_os_error();
                if pid != 0 && libc::setns(own.as_raw_fd(), libc::CLONE_NEWPID) != 0 {
                    crate::log(&format!(
                        "cannot return to the agent's PID namespace: {}",
                        io::Error::last_os_error()
                    ));
                }
                if pid < 0 {
                    return Err(forked);
                }
                pid
            }
        };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(pid)
    }
}

/// Program `pid` was reaped: if it was a container's first, the container
/// has ended (its namespace's other processes are gone with it).
pub fn reaped(pid: libc::pid_t) {
    let mut all = containers();
    let Some(map) = all.as_mut() else { return };
    if let Some(c) = map.values_mut().find(|c| c.init == Some(pid)) {
        c.ended = true;
        c.pid_ns = None;
        c.group = None;
    }
}

/// The tree at `dir` is removed: the containers rooted in it are
/// forgotten.
pub fn forget(dir: &str) {
    let dir = dir.trim_end_matches('/');
    let mut all = containers();
    if let Some(map) = all.as_mut() {
        map.retain(|root, _| {
            !(root == dir || root.strip_prefix(dir).is_some_and(|r| r.starts_with('/')))
        });
    }
}
