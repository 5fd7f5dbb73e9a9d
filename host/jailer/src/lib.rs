//! The jail every VMM runs in, after Firecracker's jailer: `husk-jailer`
//! (run as root) sets it up and execs `husk-vmm` inside it.
//!
//! In order:
//! 1. No inherited file descriptors beyond stdin/stdout/stderr, and an empty
//!    environment (only `HUSK_LOG` passes).
//! 2. rlimits: open files, file size (when given), no core dumps (a core
//!    would hold guest memory).
//! 3. New mount, PID, network, IPC and UTS namespaces. With a NIC, its TAP
//!    is created in the new network namespace, owned by the jail's uid (so
//!    the VMM attaches to it without CAP_NET_ADMIN) and goes with it; an
//!    nftables firewall in that namespace drops everything the guest sends
//!    or is sent on it ([`FIREWALL`]): the namespace has no route anywhere
//!    today, and the firewall keeps it so if an operator connects it. The
//!    guest's way out is the egress proxy, over vsock, not the NIC.
//! 4. A new root: a small tmpfs holding only the bind mounts the VMM needs,
//!    each at the path it has on the host (so no argument needs rewriting):
//!    the VMM binary and its shared libraries, read-only; the snapshot,
//!    kernel and images, read-only; the sandbox's run directory, writable.
//!    Device nodes: `/dev/kvm`, `/dev/urandom`, and `/dev/net/tun` only with
//!    a NIC. `pivot_root` into it, the old root detached, the new root
//!    remounted read-only.
//! 5. A fork: the child is PID 1 of the new PID namespace, mounts its own
//!    `/proc`, drops to the jail's uid and gid (no supplementary groups, no
//!    capabilities, an empty bounding set), dies with its parent
//!    (`PR_SET_PDEATHSIG`, set after the ids change, which clears it), sets
//!    `no_new_privs` and execs the VMM. The parent gives up the same (the
//!    ids, the bounding set, `no_new_privs`), confines itself with a seccomp
//!    filter to waiting and signalling ([`WAITER_SYSCALLS`]), forwards
//!    SIGTERM/SIGINT/SIGHUP and exits as the VMM did, so to whoever started
//!    it, the jailer *is* the VMM.
//!
//! A running jail's VMM takes more shared directories without a mount in
//! the jail: [`share_tree`] makes a detached idmapped mount of the host
//! directory, and the daemon passes its descriptor to the VMM over the
//! control socket (a pooled clone given a host directory after its
//! restore).
//!
//! Copy-on-write clones still share their snapshot's page cache: a bind
//! mount is the same file.

use std::ffi::{CString, OsString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::resource::{setrlimit, Resource};
use nix::sys::signal::{signal, SigHandler, Signal};
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{chown, fork, ForkResult, Gid, Pid, Uid};

use husk_vmm_api::cmdline::PVM_MODULE;

/// First uid (and gid) the daemon gives a jail; each sandbox gets its own.
pub const UID_BASE: u32 = 200_000;
/// How many uids the daemon hands out.
pub const UID_COUNT: u32 = 65_536;
/// Open files a jailed VMM may have: far above what its bounded devices
/// use (vsock connections are capped at a few hundred).
pub const DEFAULT_NOFILE: u64 = 4096;
/// Where the jail's root is built (a tmpfs mounted in the jail's own mount
/// namespace; on the host this stays an empty directory).
pub const ROOT: &str = "/run/husk-jail";

/// The uids the daemon gives its jails, each to one VMM at a time.
#[derive(Debug, Default)]
pub struct UidPool {
    taken: std::sync::Mutex<std::collections::BTreeSet<u32>>,
}

impl UidPool {
    /// The lowest free uid, now taken; None when all are.
    pub fn take(&self) -> Option<u32> {
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        let uid = (UID_BASE..UID_BASE + UID_COUNT).find(|u| !taken.contains(u))?;
        taken.insert(uid);
        Some(uid)
    }

    /// Marks `uid` taken (a VMM found running when the daemon starts).
    pub fn mark(&self, uid: u32) {
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        taken.insert(uid);
    }

    /// Gives `uid` back once its VMM is gone.
    pub fn give(&self, uid: u32) {
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        taken.remove(&uid);
    }
}

/// How the daemon jails its VMMs.
#[derive(Debug, Clone)]
pub struct JailConfig {
    /// The `husk-jailer` binary.
    pub jailer: PathBuf,
    pub uids: std::sync::Arc<UidPool>,
}

/// A path the VMM sees, at the same place as on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bind {
    pub path: PathBuf,
    pub writable: bool,
}

/// A host directory shared with the guest (virtio-fs), at the same path
/// inside: an idmapped bind mount on which the host owner's ids are the
/// jail's, so the VMM (the jail's uid, no capabilities) reads and writes
/// the owner's files as its own, and what it creates is the owner's on the
/// host, never the jail uid's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    pub path: PathBuf,
    /// The host uid and gid the jail's stand for on this mount.
    pub owner: (u32, u32),
    pub writable: bool,
}

impl Share {
    /// A writable share of root's files: refused (the jail's uid would
    /// stand for root there, and what it made would be root's on the
    /// host). Read-only, root's files are only read (a pod's configMap).
    fn root_owned_writable(&self) -> bool {
        self.writable && (self.owner.0 == 0 || self.owner.1 == 0)
    }

    /// `UID:GID:PATH` (as `--share` takes it).
    pub fn parse(spec: &str, writable: bool) -> Result<Self, String> {
        let mut parts = spec.splitn(3, ':');
        let (uid, gid, path) = (parts.next(), parts.next(), parts.next());
        let id = |s: Option<&str>| s.and_then(|s| s.parse::<u32>().ok());
        match (id(uid), id(gid), path) {
            (Some(uid), Some(gid), Some(path)) if !path.is_empty() => Ok(Share {
                path: path.into(),
                owner: (uid, gid),
                writable,
            }),
            _ => Err(format!("`{spec}` is not UID:GID:PATH")),
        }
    }
}

/// Everything about one jail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Jail {
    pub id: String,
    pub uid: u32,
    pub gid: u32,
    pub binds: Vec<Bind>,
    /// Shared directories, each seen through an idmapped mount.
    pub shares: Vec<Share>,
    /// The TAP to create in the jail's network namespace.
    pub tap: Option<String>,
    pub kvm_device: PathBuf,
    pub nofile: u64,
    /// Largest file the VMM may write, in bytes.
    pub fsize: Option<u64>,
}

/// Errors setting up a jail.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("bad jail setting: {0}")]
    Invalid(String),
    #[error("cannot {0}: {1}")]
    Sys(String, #[source] nix::Error),
    #[error("cannot {0}: {1}")]
    Io(String, #[source] std::io::Error),
    #[error("cannot confine the jailer with its seccomp filter: {0}")]
    Seccomp(String),
}

fn sys(what: impl Into<String>) -> impl FnOnce(nix::Error) -> JailError {
    let what = what.into();
    move |e| JailError::Sys(what, e)
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> JailError {
    let what = what.into();
    move |e| JailError::Io(what, e)
}

impl Jail {
    /// `husk-jailer`'s arguments for this jail (before `--`).
    pub fn args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec![
            "--id".into(),
            self.id.clone().into(),
            "--uid".into(),
            self.uid.to_string().into(),
            "--gid".into(),
            self.gid.to_string().into(),
            "--kvm-device".into(),
            self.kvm_device.clone().into(),
            "--nofile".into(),
            self.nofile.to_string().into(),
        ];
        for bind in &self.binds {
            args.push(if bind.writable { "--bind" } else { "--bind-ro" }.into());
            args.push(bind.path.clone().into());
        }
        for share in &self.shares {
            args.push(
                if share.writable {
                    "--share"
                } else {
                    "--share-ro"
                }
                .into(),
            );
            let mut spec = OsString::from(format!("{}:{}:", share.owner.0, share.owner.1));
            spec.push(&share.path);
            args.push(spec);
        }
        if let Some(tap) = &self.tap {
            args.extend(["--tap".into(), tap.into()]);
        }
        if let Some(fsize) = self.fsize {
            args.extend(["--fsize".into(), fsize.to_string().into()]);
        }
        args
    }

    fn check(&self) -> Result<(), JailError> {
        let bad = |why: String| Err(JailError::Invalid(why));
        if self.id.is_empty()
            || self.id.len() > 64
            || !self
                .id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return bad(format!(
                "id `{}`: 1 to 64 letters, digits, `-` or `_`",
                self.id
            ));
        }
        if self.uid == 0 || self.gid == 0 {
            return bad("the jail's uid and gid must not be 0".into());
        }
        let paths = self.binds.iter().map(|b| &b.path);
        for path in paths.chain(self.shares.iter().map(|s| &s.path)) {
            if !path.is_absolute()
                || path
                    .components()
                    .any(|c| matches!(c, std::path::Component::ParentDir))
            {
                return bad(format!(
                    "bind {}: give an absolute path without `..`",
                    path.display()
                ));
            }
        }
        if let Some(share) = self.shares.iter().find(|s| s.root_owned_writable()) {
            return bad(format!(
                "share {}: a writable share's owner must not be root",
                share.path.display()
            ));
        }
        Ok(())
    }

    /// Builds the jail around this process and execs `program` with `args`
    /// inside it. Returns only on failure. The process must be
    /// single-threaded (namespaces and credentials are per process).
    pub fn exec(&self, program: &Path, args: &[OsString]) -> Result<(), JailError> {
        self.check()?;
        if !program.is_absolute() {
            return Err(JailError::Invalid(format!(
                "program {}: give an absolute path",
                program.display()
            )));
        }
        let mut binds = vec![Bind {
            path: program.to_owned(),
            writable: false,
        }];
        binds.extend(shared_libraries(program)?.into_iter().map(|path| Bind {
            path,
            writable: false,
        }));
        binds.extend(self.binds.iter().cloned());
        // husk-vmm recognises a PVM host (whose guests need extra kernel
        // flags) by this sysfs directory: it alone of /sys is shown.
        if Path::new(PVM_MODULE).exists() {
            binds.push(Bind {
                path: PVM_MODULE.into(),
                writable: false,
            });
        }
        // Outer directories first, so an inner bind lands on top; a path
        // given twice is bound once, writable if either says so.
        binds.sort_by(|a, b| {
            (a.path.components().count(), &a.path).cmp(&(b.path.components().count(), &b.path))
        });
        binds.dedup_by(|later, kept| {
            let same = later.path == kept.path;
            if same {
                kept.writable |= later.writable;
            }
            same
        });
        let kvm = device_number(&self.kvm_device)?;
        let env: Vec<CString> = std::env::var_os("HUSK_LOG")
            .map(|v| {
                let mut pair = OsString::from("HUSK_LOG=");
                pair.push(v);
                c_string(pair)
            })
            .into_iter()
            .collect();
        let argv: Vec<CString> = std::iter::once(program.as_os_str().to_owned())
            .chain(args.iter().cloned())
            .map(c_string)
            .collect();
        let exe = c_string(program.as_os_str().to_owned());

        close_inherited_fds();
        self.limit_resources()?;
        // Before the new PID namespace: the helper that holds each user
        // namespace would be its PID 1.
        let idmaps = self
            .shares
            .iter()
            .map(|share| idmap(share.owner, (self.uid, self.gid)))
            .collect::<Result<Vec<_>, _>>()?;
        // The network first: the firewall is loaded by a child (`nft`),
        // which must not become PID 1 of the new PID namespace (its exit
        // would end the namespace before the VMM is in it).
        unshare(CloneFlags::CLONE_NEWNET).map_err(sys(
            "enter a new network namespace (run husk-jailer as root)",
        ))?;
        if let Some(tap) = &self.tap {
            create_tap(tap, self.uid, self.gid)?;
            firewall()?;
        }
        unshare(
            CloneFlags::CLONE_NEWNS
                | CloneFlags::CLONE_NEWPID
                | CloneFlags::CLONE_NEWIPC
                | CloneFlags::CLONE_NEWUTS,
        )
        .map_err(sys("enter new namespaces (run husk-jailer as root)"))?;
        nix::unistd::sethostname(&self.id).map_err(sys("set the host name"))?;
        self.build_root(&binds, &idmaps, kvm)?;
        self.fork_and_exec(&exe, &argv, &env)
    }

    fn limit_resources(&self) -> Result<(), JailError> {
        setrlimit(Resource::RLIMIT_NOFILE, self.nofile, self.nofile)
            .map_err(sys("limit open files"))?;
        setrlimit(Resource::RLIMIT_CORE, 0, 0).map_err(sys("turn off core dumps"))?;
        if let Some(fsize) = self.fsize {
            setrlimit(Resource::RLIMIT_FSIZE, fsize, fsize).map_err(sys("limit file size"))?;
        }
        Ok(())
    }

    /// The new root, entered with `pivot_root`.
    fn build_root(&self, binds: &[Bind], idmaps: &[OwnedFd], kvm: u64) -> Result<(), JailError> {
        let root = Path::new(ROOT);
        // Nothing mounted from here on propagates back to the host.
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_SLAVE | MsFlags::MS_REC,
            None::<&str>,
        )
        .map_err(sys("make the mounts private"))?;
        std::fs::create_dir_all(root).map_err(io(format!("create {ROOT}")))?;
        mount(
            Some("tmpfs"),
            root,
            Some("tmpfs"),
            MsFlags::MS_NOSUID,
            Some("size=1m,mode=0755"),
        )
        .map_err(sys(format!("mount a tmpfs on {ROOT}")))?;
        for bind in binds {
            bind_into(root, bind)?;
        }
        for (share, userns) in self.shares.iter().zip(idmaps) {
            share_into(root, share, userns)?;
        }
        let dev = root.join("dev");
        std::fs::create_dir_all(dev.join("net")).map_err(io("create /dev"))?;
        let mut nodes = vec![("kvm", kvm, 0o600), ("urandom", makedev(1, 9), 0o444)];
        if self.tap.is_some() {
            nodes.push(("net/tun", makedev(10, 200), 0o600));
        }
        for (name, rdev, mode) in nodes {
            let path = dev.join(name);
            mknod(&path, SFlag::S_IFCHR, Mode::from_bits_truncate(mode), rdev)
                .map_err(sys(format!("create /dev/{name}")))?;
            chown(
                &path,
                Some(Uid::from_raw(self.uid)),
                Some(Gid::from_raw(self.gid)),
            )
            .map_err(sys(format!("chown /dev/{name}")))?;
        }
        std::fs::create_dir_all(root.join("proc")).map_err(io("create /proc"))?;
        nix::unistd::chdir(root).map_err(sys(format!("enter {ROOT}")))?;
        // The old root goes under the new one, and is detached at once.
        nix::unistd::pivot_root(".", ".").map_err(sys("pivot_root"))?;
        umount2(".", MntFlags::MNT_DETACH).map_err(sys("detach the old root"))?;
        nix::unistd::chdir("/").map_err(sys("enter the new root"))?;
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID,
            None::<&str>,
        )
        .map_err(sys("make the new root read-only"))?;
        Ok(())
    }

    fn fork_and_exec(
        &self,
        exe: &CString,
        argv: &[CString],
        env: &[CString],
    ) -> Result<(), JailError> {
        // SAFETY: this process is single-threaded (see `exec`), so the child
        // may do anything the parent could.
        match unsafe { fork() }.map_err(sys("fork into the new PID namespace"))? {
            ForkResult::Child => {
                let err = self.child(exe, argv, env);
                eprintln!("husk-jailer: {err}");
                // SAFETY: _exit ends the child without running the parent's
                // destructors twice.
                unsafe { libc::_exit(2) }
            }
            ForkResult::Parent { child } => {
                // The parent stays beside the VMM for its life: it keeps no
                // privileges either, and may make only the few syscalls
                // that waiting for the VMM and passing on signals take.
                give_up_privileges(self.uid, self.gid)?;
                apply_waiter_filter()?;
                wait_as(child)
            }
        }
    }

    /// In the child, PID 1 of the new namespace: returns only on failure.
    fn child(&self, exe: &CString, argv: &[CString], env: &[CString]) -> JailError {
        if let Err(e) = mount(
            Some("proc"),
            "/proc",
            Some("proc"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            None::<&str>,
        ) {
            return JailError::Sys("mount /proc".into(), e);
        }
        if let Err(e) = give_up_privileges(self.uid, self.gid) {
            return e;
        }
        // After the ids change, which clears it.
        if let Err(e) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
            return JailError::Sys("die with the jailer".into(), e);
        }
        match nix::unistd::execve(exe, argv, env) {
            Err(e) => JailError::Sys(format!("exec {}", exe.to_string_lossy()), e),
        }
    }
}

/// Empties the capability bounding set (no capability can come back,
/// whatever is exec'd), takes the jail's ids and sets `no_new_privs`.
fn give_up_privileges(uid: u32, gid: u32) -> Result<(), JailError> {
    for cap in 0..64 {
        // SAFETY: PR_CAPBSET_DROP takes a capability number; numbers the
        // kernel does not know fail with EINVAL, which is fine.
        unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
    }
    drop_privileges(uid, gid)?;
    nix::sys::prctl::set_no_new_privs().map_err(sys("set no_new_privs"))
}

/// What the jailer's parent half does after the fork: wait for the VMM,
/// pass signals on, and end as it ended (and write a line on failure).
/// Anything else kills it, and the VMM with it (`PR_SET_PDEATHSIG`).
const WAITER_SYSCALLS: &[i64] = &[
    libc::SYS_wait4,
    libc::SYS_waitid,
    libc::SYS_kill,
    libc::SYS_tgkill,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_restart_syscall,
    libc::SYS_sigaltstack,
    libc::SYS_write,
    libc::SYS_futex,
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_madvise,
    libc::SYS_close,
    libc::SYS_exit,
    libc::SYS_exit_group,
];

/// Confines this process to [`WAITER_SYSCALLS`].
fn apply_waiter_filter() -> Result<(), JailError> {
    use seccompiler::{BpfProgram, SeccompAction, SeccompFilter, TargetArch};
    let build = |e: seccompiler::BackendError| JailError::Seccomp(e.to_string());
    let rules = WAITER_SYSCALLS.iter().map(|nr| (*nr, Vec::new())).collect();
    let program: BpfProgram = SeccompFilter::new(
        rules,
        SeccompAction::KillProcess,
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .map_err(build)?
    .try_into()
    .map_err(build)?;
    seccompiler::apply_filter(&program).map_err(|e| JailError::Seccomp(e.to_string()))
}

/// Sets every uid and gid of this process, with no supplementary groups.
fn drop_privileges(uid: u32, gid: u32) -> Result<(), JailError> {
    let (uid, gid) = (Uid::from_raw(uid), Gid::from_raw(gid));
    nix::unistd::setgroups(&[]).map_err(sys("drop supplementary groups"))?;
    nix::unistd::setresgid(gid, gid, gid).map_err(sys("set the gid"))?;
    nix::unistd::setresuid(uid, uid, uid).map_err(sys("set the uid"))?;
    Ok(())
}

/// The VMM's pid, for the signal forwarder.
static CHILD: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward(sig: libc::c_int) {
    let child = CHILD.load(Ordering::Relaxed);
    if child > 0 {
        // SAFETY: kill(2) is async-signal-safe.
        unsafe { libc::kill(child, sig) };
    }
}

/// Waits for the VMM and ends this process the way it ended.
fn wait_as(child: Pid) -> Result<(), JailError> {
    CHILD.store(child.as_raw(), Ordering::Relaxed);
    for sig in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        // SAFETY: `forward` only loads an atomic and calls kill(2).
        unsafe { signal(sig, SigHandler::Handler(forward)) }.map_err(sys("forward signals"))?;
    }
    loop {
        match waitpid(child, None) {
            Ok(WaitStatus::Exited(_, code)) => std::process::exit(code),
            Ok(WaitStatus::Signaled(_, sig, _)) => {
                // Die the same way, so the daemon sees what the VMM saw.
                // SAFETY: restoring the default action has no preconditions.
                let _ = unsafe { signal(sig, SigHandler::SigDfl) };
                let _ = nix::sys::signal::raise(sig);
                std::process::exit(128 + sig as i32);
            }
            Ok(_) | Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(JailError::Sys("wait for the VMM".into(), e)),
        }
    }
}

/// Closes every descriptor above stderr.
fn close_inherited_fds() {
    // SAFETY: close_range(2) only closes descriptors; nothing in this
    // single-threaded process holds one above 2 that it still uses.
    unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
}

/// Bind-mounts `bind.path` at the same path under `root`.
fn bind_into(root: &Path, bind: &Bind) -> Result<(), JailError> {
    let source =
        std::fs::canonicalize(&bind.path).map_err(io(format!("find {}", bind.path.display())))?;
    let target = root.join(bind.path.strip_prefix("/").unwrap_or(&bind.path));
    let is_dir = source.is_dir();
    let parent = target.parent().unwrap_or(root);
    std::fs::create_dir_all(parent).map_err(io(format!("create {}", parent.display())))?;
    if is_dir {
        std::fs::create_dir_all(&target)
    } else {
        std::fs::write(&target, b"")
    }
    .map_err(io(format!("create {}", target.display())))?;
    mount(
        Some(&source),
        &target,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(sys(format!("bind {}", bind.path.display())))?;
    let mut flags = MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    if !bind.writable {
        flags |= MsFlags::MS_RDONLY;
    }
    mount(None::<&str>, &target, None::<&str>, flags, None::<&str>)
        .map_err(sys(format!("restrict {}", bind.path.display())))?;
    Ok(())
}

/// A user namespace whose only ids are `owner`'s, seen as `jail`'s: the
/// idmapping of a share's mount. Made by a child cloned into it that only
/// waits to be killed, on a stack of its own and sharing this process's
/// memory (no copy of a large daemon's page tables), with every signal
/// blocked: cheap, and safe in a threaded process (the daemon's). Its maps
/// are written and the namespace opened from here.
fn idmap(owner: (u32, u32), jail: (u32, u32)) -> Result<OwnedFd, JailError> {
    extern "C" fn wait(_: *mut libc::c_void) -> libc::c_int {
        loop {
            // SAFETY: pause(2) has no preconditions; only SIGKILL ends it.
            unsafe { libc::syscall(libc::SYS_pause) };
        }
    }
    const STACK: usize = 16 << 10;
    let mut stack = vec![0u128; STACK / 16];
    // SAFETY: one past the end of the stack's allocation, 16-byte aligned.
    let top = unsafe { stack.as_mut_ptr().add(stack.len()) }.cast::<libc::c_void>();
    // SAFETY: sigset_t is plain data; sigfillset and pthread_sigmask only
    // write the sets passed.
    let (all, mut old) = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        (all, std::mem::zeroed::<libc::sigset_t>())
    };
    // SAFETY: as above; the child inherits this thread's mask.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old) };
    // SAFETY: `wait` touches no memory but its own stack frame on `stack`,
    // which outlives the child (reaped below before `stack` is dropped).
    let child = unsafe {
        libc::clone(
            wait,
            top,
            libc::CLONE_NEWUSER | libc::CLONE_VM | libc::SIGCHLD,
            std::ptr::null_mut(),
        )
    };
    let cloned = std::io::Error::last_os_error();
    // SAFETY: restores the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    if child < 0 {
        return Err(JailError::Io(
            "make a user namespace for a share's idmapped mount".into(),
            cloned,
        ));
    }
    let proc = PathBuf::from(format!("/proc/{child}"));
    let result = std::fs::write(proc.join("uid_map"), format!("{} {} 1\n", owner.0, jail.0))
        .and_then(|()| std::fs::write(proc.join("gid_map"), format!("{} {} 1\n", owner.1, jail.1)))
        .and_then(|()| std::fs::File::open(proc.join("ns/user")))
        .map(OwnedFd::from)
        .map_err(io("map a share's owner to the jail's ids"));
    // SAFETY: kill(2) of the child made above, then reaping it.
    unsafe { libc::kill(child, libc::SIGKILL) };
    let _ = waitpid(Pid::from_raw(child), None);
    drop(stack);
    result
}

/// Mounts `share.path` at the same path under `root`, idmapped through
/// `userns` (its owner's files are the jail's), nosuid, nodev, and
/// read-only unless writable.
fn share_into(root: &Path, share: &Share, userns: &OwnedFd) -> Result<(), JailError> {
    let tree = idmapped_tree(share, userns)?;
    let target = root.join(share.path.strip_prefix("/").unwrap_or(&share.path));
    std::fs::create_dir_all(&target).map_err(io(format!("create {}", target.display())))?;
    attach(&tree, &target, share)
}

/// A detached mount of `share` for a running jail's VMM, which serves the
/// share from this descriptor (passed over its control socket): idmapped so
/// that the owner's files are `jail`'s ids on it, nosuid, nodev, and
/// read-only unless writable. Nothing is mounted anywhere: the mount lives
/// as long as a descriptor of it does, and reaches nothing above the
/// share. Run as root; safe in a threaded process.
pub fn share_tree(share: &Share, jail: (u32, u32)) -> Result<OwnedFd, JailError> {
    if share.root_owned_writable() {
        return Err(JailError::Invalid(format!(
            "share {}: a writable share's owner must not be root",
            share.path.display()
        )));
    }
    if !share.path.is_absolute() || jail.0 == 0 || jail.1 == 0 {
        return Err(JailError::Invalid(format!(
            "share {}: give an absolute path, and the jail's ids (not root's)",
            share.path.display()
        )));
    }
    idmapped_tree(share, &idmap(share.owner, jail)?)
}

/// A detached copy of `share.path`'s mount, idmapped through `userns`,
/// nosuid, nodev, and read-only unless writable.
fn idmapped_tree(share: &Share, userns: &OwnedFd) -> Result<OwnedFd, JailError> {
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    const MOUNT_ATTR_RDONLY: u64 = 0x1;
    const MOUNT_ATTR_NOSUID: u64 = 0x2;
    const MOUNT_ATTR_NODEV: u64 = 0x4;
    const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    let what = |verb: &str| format!("{verb} share {}", share.path.display());
    let source = std::fs::canonicalize(&share.path).map_err(io(what("find")))?;
    if !source.is_dir() {
        return Err(JailError::Invalid(format!(
            "share {}: not a directory",
            share.path.display()
        )));
    }
    let source_c = CString::new(source.as_os_str().as_encoded_bytes())
        .map_err(|_| JailError::Invalid(what("name")))?;
    // SAFETY: a valid C string; the returned descriptor is owned below.
    let tree = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            source_c.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
        )
    };
    if tree < 0 {
        return Err(JailError::Io(
            what("clone"),
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: a descriptor the kernel just returned, owned by nothing else.
    let tree = unsafe { OwnedFd::from_raw_fd(tree as RawFd) };
    let mut set = MOUNT_ATTR_IDMAP | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
    if !share.writable {
        set |= MOUNT_ATTR_RDONLY;
    }
    let attr = MountAttr {
        attr_set: set,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    let empty = c"";
    // SAFETY: valid descriptors, an empty C string and a mount_attr of the
    // size passed.
    let set = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if set < 0 {
        return Err(JailError::Io(
            what("idmap (does its file system support idmapped mounts?)"),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(tree)
}

/// Attaches detached mount `tree` (of `share`) at directory `target`.
fn attach(tree: &OwnedFd, target: &Path, share: &Share) -> Result<(), JailError> {
    const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
    let what = || {
        format!(
            "mount share {} at {}",
            share.path.display(),
            target.display()
        )
    };
    let target_c = CString::new(target.as_os_str().as_encoded_bytes())
        .map_err(|_| JailError::Invalid(what()))?;
    let empty = c"";
    // SAFETY: valid descriptors and C strings.
    let moved = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            target_c.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if moved < 0 {
        return Err(JailError::Io(what(), std::io::Error::last_os_error()));
    }
    Ok(())
}

/// The device number of a character device.
fn device_number(path: &Path) -> Result<u64, JailError> {
    let meta = std::fs::metadata(path).map_err(io(format!("find {}", path.display())))?;
    if !meta.file_type().is_char_device() {
        return Err(JailError::Invalid(format!(
            "{} is not a character device",
            path.display()
        )));
    }
    Ok(meta.rdev())
}

/// The shared libraries (and the loader) a dynamically linked program
/// needs, as `ldd` finds them; none for a static one.
fn shared_libraries(program: &Path) -> Result<Vec<PathBuf>, JailError> {
    let out = std::process::Command::new("ldd")
        .arg(program)
        .env_clear()
        .output()
        .map_err(io("run ldd to find the VMM's libraries"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(parse_ldd(&text))
}

fn parse_ldd(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

fn c_string(s: OsString) -> CString {
    // Arguments come from the command line, which holds no NUL bytes.
    CString::new(s.as_bytes()).unwrap_or_default()
}

/// The rules of a jail's network namespace: nothing in, out or through
/// but loopback. Traffic to and from the guest's NIC is dropped whatever
/// addresses or routes are added later.
pub const FIREWALL: &str = "\
table inet husk {
  chain input { type filter hook input priority 0; policy drop; iif \"lo\" accept; }
  chain forward { type filter hook forward priority 0; policy drop; }
  chain output { type filter hook output priority 0; policy drop; oif \"lo\" accept; }
}
";

/// Where `nft` may be.
const NFT: &[&str] = &["/usr/sbin/nft", "/sbin/nft", "/usr/bin/nft"];

/// Loads [`FIREWALL`] into this process's network namespace.
fn firewall() -> Result<(), JailError> {
    use std::io::Write;
    let Some(nft) = NFT.iter().find(|p| Path::new(p).exists()) else {
        return Err(JailError::Invalid(
            "a sandbox with a NIC gets a firewall, which needs nftables (`nft`): install it".into(),
        ));
    };
    let mut child = std::process::Command::new(nft)
        .args(["-f", "-"])
        .env_clear()
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(io(format!("run {nft}")))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(FIREWALL.as_bytes())
            .map_err(io("give nft the firewall"))?;
    }
    let out = child.wait_with_output().map_err(io("wait for nft"))?;
    if !out.status.success() {
        return Err(JailError::Invalid(format!(
            "nft refused the firewall ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Creates TAP `name` owned by `uid`/`gid`, persistent (it lasts until its
/// network namespace goes), and up.
fn create_tap(name: &str, uid: u32, gid: u32) -> Result<(), JailError> {
    const IFF_TAP: libc::c_short = 0x0002;
    const IFF_NO_PI: libc::c_short = 0x1000;
    const IFF_VNET_HDR: libc::c_short = 0x4000;
    // _IOW('T', 202, int), _IOW('T', 203, int), _IOW('T', 204, int),
    // _IOW('T', 206, int)
    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
    const TUNSETOWNER: libc::c_ulong = 0x4004_54cc;
    const TUNSETGROUP: libc::c_ulong = 0x4004_54ce;
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(JailError::Invalid(format!("TAP name `{name}`")));
    }
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(io("open /dev/net/tun"))?;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&tun);
    // SAFETY: an all-zero ifreq is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.as_bytes()) {
        *dst = *src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR;
    let ioctl = |what: &str, rc: libc::c_int| {
        if rc < 0 {
            Err(io(format!("{what} TAP {name}"))(
                std::io::Error::last_os_error(),
            ))
        } else {
            Ok(())
        }
    };
    // SAFETY: each ioctl reads the ifreq we own or takes an int by value.
    unsafe {
        ioctl("create", libc::ioctl(fd, TUNSETIFF, &mut req))?;
        ioctl("chown", libc::ioctl(fd, TUNSETOWNER, uid as libc::c_ulong))?;
        ioctl("chgrp", libc::ioctl(fd, TUNSETGROUP, gid as libc::c_ulong))?;
        ioctl("keep", libc::ioctl(fd, TUNSETPERSIST, 1 as libc::c_ulong))?;
    }
    // Up, so the guest sees a carrier.
    // SAFETY: socket(2) with constant arguments.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if sock < 0 {
        return Err(io("open a socket")(std::io::Error::last_os_error()));
    }
    // SAFETY: the socket is ours; SIOCGIFFLAGS/SIOCSIFFLAGS read and write
    // the ifreq we own.
    let result = unsafe {
        ioctl("read", libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut req)).and_then(|()| {
            req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            ioctl("bring up", libc::ioctl(sock, libc::SIOCSIFFLAGS, &req))
        })
    };
    // SAFETY: closing the socket we opened.
    unsafe { libc::close(sock) };
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jail() -> Jail {
        Jail {
            shares: Vec::new(),
            id: "sb-1".into(),
            uid: UID_BASE,
            gid: UID_BASE,
            binds: vec![Bind {
                path: "/var/lib/husk/run/sb-1".into(),
                writable: true,
            }],
            tap: None,
            kvm_device: "/dev/kvm".into(),
            nofile: DEFAULT_NOFILE,
            fsize: None,
        }
    }

    #[test]
    fn each_jail_gets_a_uid_of_its_own_until_it_gives_it_back() {
        let pool = UidPool::default();
        pool.mark(UID_BASE + 1);

        let a = pool.take();
        let b = pool.take();
        pool.give(UID_BASE);
        let c = pool.take();

        assert_eq!(a, Some(UID_BASE));
        assert_eq!(b, Some(UID_BASE + 2));
        assert_eq!(c, Some(UID_BASE));
    }

    #[test]
    fn ldd_output_gives_the_libraries_and_the_loader() {
        let text = "\tlinux-vdso.so.1 (0x00007f)\n\
                    \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x1)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x2)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x3)\n";

        assert_eq!(
            parse_ldd(text),
            vec![
                PathBuf::from("/lib/x86_64-linux-gnu/libgcc_s.so.1"),
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ]
        );
        assert!(parse_ldd("\tnot a dynamic executable\n").is_empty());
    }

    #[test]
    fn bad_settings_are_refused_before_anything_happens() {
        let root = Jail { uid: 0, ..jail() };
        let relative = Jail {
            binds: vec![Bind {
                path: "run/sb-1".into(),
                writable: true,
            }],
            ..jail()
        };
        let escape = Jail {
            binds: vec![Bind {
                path: "/var/../etc".into(),
                writable: false,
            }],
            ..jail()
        };
        let bad_id = Jail {
            id: "../x".into(),
            ..jail()
        };

        for j in [root, relative, escape, bad_id] {
            assert!(matches!(j.check(), Err(JailError::Invalid(_))), "{j:?}");
        }
        assert!(jail().check().is_ok());
    }
}
