//! The containers of a pod (`ExecIn`), as declared (`Container`). One with
//! a PID namespace of its own (Kubernetes' default) gets it from its first
//! program (PID 1 in it); every later one (an exec) joins it, so the
//! container sees only its own processes and the end of its first program
//! ends them all, as under runc; then the container has ended and later
//! programs in its root are refused. One without (the pod's PID namespace
//! shared, or none declared) runs in the guest's. A declared container
//! has a cgroup that counts what its programs use (each program's own
//! cgroup is below it), whose `memory.max` bounds them together when it
//! has a memory limit. Volumes are bound into its root (`bind`) before
//! its first program.

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
    /// Its cgroup (until it ends; none in a guest without cgroups).
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
    let group = match Group::create(memory_max) {
        Ok(g) => Some(g),
        // A guest without cgroups (their setup failed at boot) runs a
        // container that asks for no limit, without its stats.
        Err(e) if memory_max.is_none() && e.kind() == io::ErrorKind::Unsupported => None,
        Err(e) => return Err(e),
    };
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

/// Sets the memory limit of the container rooted at `root` anew (`None`:
/// unbounded).
pub fn set_memory_max(root: &str, memory_max: Option<u64>) -> io::Result<()> {
    with_group(root, |g| g.set_memory_max(memory_max))
}

/// Sets the CPU limit of the container rooted at `root`: `quota_us` of
/// every `period_us` microseconds (`None`: unbounded).
pub fn set_cpu_max(root: &str, quota_us: Option<u64>, period_us: u64) -> io::Result<()> {
    with_group(root, |g| g.set_cpu_max(quota_us, period_us))
}

/// What the container rooted at `root` uses now.
pub fn usage(root: &str) -> io::Result<husk_protocol::ContainerUsage> {
    with_group(root, Group::usage)
}

/// `f` of the cgroup of the container rooted at `root`, while it has one.
fn with_group<T>(root: &str, f: impl FnOnce(&Group) -> io::Result<T>) -> io::Result<T> {
    let all = containers();
    let c = all.as_ref().and_then(|m| m.get(root)).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("no container is declared at {root}"),
        )
    })?;
    match &c.group {
        Some(g) => f(g),
        None if c.ended => Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("the container at {root} has ended"),
        )),
        None => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this guest keeps no cgroups (their setup failed at boot)",
        )),
    }
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
/// forgotten, and what is bound inside it (volumes) unbound first, so
/// that the removal does not reach into them.
pub fn forget(dir: &str) {
    let dir = dir.trim_end_matches('/');
    let below = |p: &str| p == dir || p.strip_prefix(dir).is_some_and(|r| r.starts_with('/'));
    let mut points: Vec<String> = {
        let mut binds = BINDS.lock().unwrap_or_else(|e| e.into_inner());
        let (gone, kept) = binds.drain(..).partition(|p| below(p));
        *binds = kept;
        gone
    };
    // The deepest first.
    points.sort_by_key(|p| std::cmp::Reverse(p.len()));
    for p in points {
        if let Ok(c) = std::ffi::CString::new(p) {
            // SAFETY: a NUL-terminated path.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
    }
    let mut all = containers();
    if let Some(map) = all.as_mut() {
        map.retain(|root, _| !below(root));
    }
}

/// Where volumes and media are mounted (in the guest's mount namespace),
/// to unmount them before their container's tree is removed.
static BINDS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Records a mount at `path` (a container's root on a medium): removing
/// a tree it is in unmounts it first.
pub fn track_mount(path: &str) {
    BINDS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(path.trim_end_matches('/').to_owned());
}

/// Binds directory (or regular file) `source` at `target` inside the
/// container root `root`, read-only with `readonly` (a pod's volume, or a
/// file such as `/etc/hosts`). `target` is resolved as if `root` were `/`
/// (a link in the container's tree stays inside it) and its missing
/// directories (and, for a file, the file) are made. The bind is a
/// detached clone of `source` attached at the resolved target
/// (`open_tree`, `move_mount`): nothing is looked up by path after the
/// resolution.
pub fn bind(root: &str, source: &str, target: &str, readonly: bool) -> io::Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let meta = std::fs::metadata(source)?;
    if !meta.is_dir() && !meta.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{source} is neither a directory nor a regular file"),
        ));
    }
    let root_fd = File::open(root)?;
    let target_fd = if meta.is_dir() {
        make_dirs_in(&root_fd, target)?
    } else {
        make_file_in(&root_fd, target)?
    };
    // Where it is in the guest's namespace (recorded once bound).
    let at = std::fs::read_link(format!("/proc/self/fd/{}", target_fd.as_raw_fd()))?;
    let source_c = std::ffi::CString::new(source).map_err(|_| io::ErrorKind::InvalidInput)?;
    let check = |rc: libc::c_long| {
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(rc)
        }
    };
    // SAFETY: a NUL-terminated path; the returned descriptor is owned.
    let tree = unsafe {
        OwnedFd::from_raw_fd(check(libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            source_c.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint | libc::AT_RECURSIVE as libc::c_uint,
        ))? as libc::c_int)
    };
    if readonly {
        let attr = MountAttr {
            attr_set: MOUNT_ATTR_RDONLY,
            ..MountAttr::default()
        };
        // SAFETY: an owned descriptor, an empty path and a mount_attr of
        // the size given.
        check(unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                tree.as_raw_fd(),
                c"".as_ptr(),
                (libc::AT_EMPTY_PATH | libc::AT_RECURSIVE) as libc::c_uint,
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            )
        })?;
    }
    // SAFETY: owned descriptors and empty paths.
    check(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            target_fd.as_raw_fd(),
            c"".as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
        )
    })?;
    BINDS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(at.to_string_lossy().into_owned());
    Ok(())
}

// From <linux/mount.h>.
const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 4;
const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x40;
const MOUNT_ATTR_RDONLY: u64 = 1;

#[repr(C)]
#[derive(Default)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// `struct open_how` of <linux/openat2.h>.
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// Opens `rel` below `root` as if `root` were `/` (links inside it are
/// followed there), with `flags` and `O_PATH`.
fn open_in(
    root: &File,
    rel: &std::ffi::CStr,
    flags: libc::c_int,
) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let how = OpenHow {
        flags: (libc::O_PATH | libc::O_CLOEXEC | flags) as u64,
        mode: 0,
        resolve: libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: a NUL-terminated path and an open_how of the size given.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root.as_raw_fd(),
            rel.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just opened, owned from here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

/// Opens regular file `path` below `root` as if `root` were `/`, making
/// it (empty, mode 0644) and the directories that are missing; an
/// `O_PATH` descriptor.
fn make_file_in(root: &File, path: &str) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::AsRawFd;
    let plain = || {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{path:?}: not a plain path"),
        )
    };
    let (parent, name) = path
        .trim_end_matches('/')
        .rsplit_once('/')
        .unwrap_or(("", path));
    if name.is_empty() || name == "." || name == ".." {
        return Err(plain());
    }
    let dir = make_dirs_in(root, parent)?;
    let name_c = std::ffi::CString::new(name).map_err(|_| plain())?;
    // SAFETY: a directory descriptor and a NUL-terminated name; the
    // descriptor made is closed at once.
    let made = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name_c.as_ptr(),
            libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o644,
        )
    };
    if made >= 0 {
        // SAFETY: the descriptor just made, closed once.
        unsafe { libc::close(made) };
    } else if io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
        return Err(io::Error::last_os_error());
    }
    // From the root: an existing entry that is a link is followed as
    // inside the container.
    let rel = std::ffi::CString::new(format!("./{}", path.trim_start_matches('/')))
        .map_err(|_| plain())?;
    open_in(root, &rel, 0)
}

/// Opens directory `path` below `root` as if `root` were `/`, making the
/// directories that are missing; an `O_PATH` descriptor.
fn make_dirs_in(root: &File, path: &str) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::AsRawFd;
    let open = |rel: &std::ffi::CStr| open_in(root, rel, libc::O_DIRECTORY);
    let mut dir = open(c".")?;
    let mut so_far = String::from(".");
    for part in path.split('/').filter(|p| !p.is_empty() && *p != ".") {
        let name = std::ffi::CString::new(part)
            .ok()
            .filter(|_| part != "..")
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{path:?}: not a plain path"),
                )
            })?;
        so_far = format!("{so_far}/{part}");
        // SAFETY: a directory descriptor and a NUL-terminated name.
        let made = unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), 0o755) };
        if made != 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
            return Err(io::Error::last_os_error());
        }
        // From the root each time: an existing entry that is a link is
        // followed as inside the container.
        let rel =
            std::ffi::CString::new(so_far.as_str()).map_err(|_| io::ErrorKind::InvalidInput)?;
        dir = open(&rel)?;
    }
    Ok(dir)
}
