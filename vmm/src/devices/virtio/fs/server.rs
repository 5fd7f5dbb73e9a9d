//! A FUSE server over one host directory (the share), for virtio-fs.
//!
//! Safe by construction: every inode the guest knows is an `O_PATH` file
//! descriptor this server opened, one name at a time, beneath the share's
//! root or an inode it already holds (`openat2` with `RESOLVE_BENEATH`, no
//! symlink followed, `.` and `..` refused: the guest's kernel resolves
//! `..` from its own dentries). A guest therefore names only what lies
//! beneath the share; a symlink it plants is resolved by its own kernel,
//! never here. Only regular files and directories are ever opened for I/O
//! (reopened through `/proc/self/fd`), device nodes cannot be made, and a
//! read-only share refuses every change with EROFS. Requests come from a
//! guest that may lie: every length and name is checked, a bad request gets
//! an error reply, and the tables the guest fills are bounded.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::Path;

use vm_memory::ByteValued;

use super::abi::{self, op, Attr, EntryOut, InHeader, OutHeader};

/// Largest READ or WRITE (and so `max_write`): 1 MiB.
pub const MAX_IO: u32 = 1 << 20;
/// Inodes the guest may hold at once (each is an open descriptor here).
const MAX_INODES: usize = 1 << 16;
/// Files and directories the guest may hold open at once.
const MAX_HANDLES: usize = 1 << 14;
/// How long the guest may cache names and attributes: not at all. The
/// share is live (the host edits it too), so the guest asks each time.
const VALID_SECS: u64 = 0;

type Errno = i32;
type Reply = Result<Vec<u8>, Errno>;

/// What the share is and who new files belong to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShareOptions {
    pub read_only: bool,
    /// The host owner (uid, gid) of every file and directory the guest
    /// creates; `None`: the creating guest user's ids (as root; otherwise
    /// the VMM's own).
    pub owner: Option<(u32, u32)>,
    /// The guest ids `owner` appears as, both ways: in the attributes the
    /// guest reads and in the chowns it asks for (in a jail the VMM sees
    /// the share's owner as its own uid: the guest sees its own user).
    pub guest_owner: Option<(u32, u32)>,
    /// What the guest must not see (secrets, hooks): a pattern without `/`
    /// matches a name at any depth (`.env`, `*.pem`), one with `/` a path
    /// from the share's root (`.git/hooks`); `*` and `?` match within one
    /// name. A hidden entry is absent to the guest: not found, not listed,
    /// not to be created, replaced or renamed over.
    pub hidden: Vec<String>,
}

/// Whether `text` matches glob `pattern` (`*`, `?`; neither matches `/`).
pub fn glob(pattern: &[u8], text: &[u8]) -> bool {
    match (pattern.first(), text.first()) {
        (None, None) => true,
        (Some(b'*'), _) => {
            glob(&pattern[1..], text)
                || (text.first().is_some_and(|&c| c != b'/') && glob(pattern, &text[1..]))
        }
        (Some(b'?'), Some(&c)) if c != b'/' => glob(&pattern[1..], &text[1..]),
        (Some(p), Some(c)) if p == c => glob(&pattern[1..], &text[1..]),
        _ => false,
    }
}

#[derive(Debug)]
struct Inode {
    fd: OwnedFd,
    /// (st_dev, st_ino): one inode per host file, however many names.
    key: (u64, u64),
    /// Lookups the guest has not forgotten.
    refs: u64,
}

/// A FUSE server for one share. Without a directory (an empty slot) it
/// refuses INIT, so a mount fails with the reason in the guest's log.
#[derive(Debug)]
pub struct Server {
    root: Option<OwnedFd>,
    /// The root's path in this process's mount namespace (for hidden paths).
    root_path: Vec<u8>,
    options: ShareOptions,
    inodes: HashMap<u64, Inode>,
    by_key: HashMap<(u64, u64), u64>,
    next_node: u64,
    handles: HashMap<u64, File>,
    next_handle: u64,
    /// The guest's FUSE session (between INIT and DESTROY).
    session: bool,
}

/// The request's body after its header, read field by field.
struct Body<'a>(&'a [u8]);

impl<'a> Body<'a> {
    fn take<T: ByteValued + Default>(&mut self) -> Result<T, Errno> {
        let value = read::<T>(self.0).ok_or(libc::EINVAL)?;
        self.0 = &self.0[std::mem::size_of::<T>()..];
        Ok(value)
    }

    /// A NUL-terminated name: one path component, not `.` or `..`.
    fn name(&mut self) -> Result<CString, Errno> {
        let name = self.cstr()?;
        match name.to_bytes() {
            b"" | b"." | b".." => Err(libc::EINVAL),
            n if n.contains(&b'/') => Err(libc::EINVAL),
            n if n.len() > 255 => Err(libc::ENAMETOOLONG),
            _ => Ok(name),
        }
    }

    /// A NUL-terminated string.
    fn cstr(&mut self) -> Result<CString, Errno> {
        let end = self.0.iter().position(|&b| b == 0).ok_or(libc::EINVAL)?;
        let s = CString::new(&self.0[..end]).map_err(|_| libc::EINVAL)?;
        self.0 = &self.0[end + 1..];
        Ok(s)
    }
}

/// A `T` from the start of `bytes` (at any alignment), if they hold one.
fn read<T: ByteValued + Default>(bytes: &[u8]) -> Option<T> {
    let mut value = T::default();
    let n = std::mem::size_of::<T>();
    value.as_mut_slice().copy_from_slice(bytes.get(..n)?);
    Some(value)
}

fn io_errno(e: std::io::Error) -> Errno {
    e.raw_os_error().unwrap_or(libc::EIO)
}

fn errno() -> Errno {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// `ret` as a result: -1 is the thread's errno.
fn check(ret: libc::c_int) -> Result<libc::c_int, Errno> {
    if ret < 0 {
        Err(errno())
    } else {
        Ok(ret)
    }
}

const EMPTY: &CStr = c"";

fn stat_fd(fd: RawFd) -> Result<libc::stat, Errno> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: fstatat writes a stat into `st`; the path is a valid C string.
    check(unsafe {
        libc::fstatat(
            fd,
            EMPTY.as_ptr(),
            st.as_mut_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
        )
    })?;
    // SAFETY: fstatat succeeded, so `st` is initialised.
    Ok(unsafe { st.assume_init() })
}

/// `openat2(dir, name, flags, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`:
/// `name` (one component) beneath `dir`, never a symlink followed (with
/// `O_PATH` a trailing symlink is opened as itself; otherwise ELOOP).
fn open_beneath(dir: RawFd, name: &CStr, flags: i32, mode: u32) -> Result<OwnedFd, Errno> {
    #[repr(C)]
    struct OpenHow {
        flags: u64,
        mode: u64,
        resolve: u64,
    }
    const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
    const RESOLVE_NO_SYMLINKS: u64 = 0x04;
    const RESOLVE_BENEATH: u64 = 0x08;
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC | libc::O_NOFOLLOW) as u64,
        mode: u64::from(mode),
        resolve: RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS,
    };
    // SAFETY: the arguments are a valid descriptor, a C string and an
    // open_how of the size passed; the returned descriptor is owned here.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir,
            name.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(errno());
    }
    // SAFETY: a descriptor the kernel just returned and nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Changes the owner of the file (a symlink itself, not its target) an
/// `O_PATH` descriptor names; `u32::MAX` leaves an id as it is.
fn chown(fd: RawFd, uid: u32, gid: u32) -> Result<(), Errno> {
    // SAFETY: a valid descriptor and C string.
    check(unsafe {
        libc::fchownat(
            fd,
            EMPTY.as_ptr(),
            uid,
            gid,
            libc::AT_EMPTY_PATH | libc::AT_SYMLINK_NOFOLLOW,
        )
    })
    .map(drop)
}

/// The `/proc/self/fd` path of a descriptor: the way to reopen an `O_PATH`
/// descriptor's file (and nothing else) for I/O.
fn proc_path(fd: RawFd) -> CString {
    CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL in a number")
}

fn file_type(st: &libc::stat) -> u32 {
    st.st_mode & libc::S_IFMT
}

fn attr_of(st: &libc::stat) -> Attr {
    Attr {
        ino: st.st_ino,
        size: st.st_size as u64,
        blocks: st.st_blocks as u64,
        atime: st.st_atime as u64,
        mtime: st.st_mtime as u64,
        ctime: st.st_ctime as u64,
        atimensec: st.st_atime_nsec as u32,
        mtimensec: st.st_mtime_nsec as u32,
        ctimensec: st.st_ctime_nsec as u32,
        mode: st.st_mode,
        nlink: st.st_nlink as u32,
        uid: st.st_uid,
        gid: st.st_gid,
        rdev: st.st_rdev as u32,
        blksize: st.st_blksize as u32,
        flags: 0,
    }
}

fn bytes<T: ByteValued>(value: &T) -> Vec<u8> {
    value.as_slice().to_vec()
}

impl Server {
    /// A server for `dir` (None: an empty slot).
    pub fn new(dir: Option<&Path>, options: ShareOptions) -> std::io::Result<Self> {
        let Some(dir) = dir else {
            return Ok(Self::serving(None, Vec::new(), options));
        };
        let c = CString::new(dir.as_os_str().as_encoded_bytes())
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: a valid C string; the descriptor is owned below.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: just opened, owned by nothing else.
        Self::with_root(unsafe { OwnedFd::from_raw_fd(fd) }, options)
    }

    /// A server for the directory `root` is a descriptor of (opened by
    /// path, or a detached mount passed by the daemon).
    pub fn with_root(root: OwnedFd, options: ShareOptions) -> std::io::Result<Self> {
        let st = stat_fd(root.as_raw_fd()).map_err(std::io::Error::from_raw_os_error)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
            return Err(std::io::Error::from_raw_os_error(libc::ENOTDIR));
        }
        // Hidden paths are matched on paths beneath this one: without it,
        // nothing is served (a directory deleted since it was given).
        let mut root_path = fd_path(root.as_raw_fd())
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOENT))?;
        // A detached mount's root reads as `/`: kept without a trailing
        // `/`, every path beneath the root is the root's and `/NAME...`.
        while root_path.last() == Some(&b'/') {
            root_path.pop();
        }
        Ok(Self::serving(Some(root), root_path, options))
    }

    fn serving(root: Option<OwnedFd>, root_path: Vec<u8>, options: ShareOptions) -> Self {
        Server {
            root,
            root_path,
            options,
            inodes: HashMap::new(),
            by_key: HashMap::new(),
            next_node: abi::ROOT_ID + 1,
            handles: HashMap::new(),
            next_handle: 1,
            session: false,
        }
    }

    /// Whether the guest has the share mounted (a FUSE session).
    pub fn has_session(&self) -> bool {
        self.session
    }

    /// Forgets the guest's session (the device was reset).
    pub fn reset(&mut self) {
        self.inodes.clear();
        self.by_key.clear();
        self.handles.clear();
        self.session = false;
    }

    /// Serves one request; returns the reply (None: this request has none).
    /// A request too short for its header is dropped.
    pub fn handle(&mut self, request: &[u8]) -> Option<Vec<u8>> {
        let header: InHeader = read(request)?;
        let end = usize::try_from(header.len).ok()?;
        let body = request.get(std::mem::size_of::<InHeader>()..end.min(request.len()))?;
        let result = if end > request.len() {
            Err(libc::EINVAL)
        } else {
            match header.opcode {
                op::FORGET => {
                    let nlookup = Body(body).take::<abi::ForgetIn>().map(|f| f.nlookup);
                    self.forget(header.nodeid, nlookup.unwrap_or(0));
                    return None;
                }
                op::BATCH_FORGET => {
                    self.batch_forget(body);
                    return None;
                }
                op::INTERRUPT => return None,
                op::INIT => self.init(Body(body)),
                _ if !self.session => Err(libc::EIO),
                _ => self.dispatch(&header, Body(body)),
            }
        };
        let (error, payload) = match result {
            Ok(payload) => (0, payload),
            Err(e) => (-e, Vec::new()),
        };
        let out = OutHeader {
            len: (std::mem::size_of::<OutHeader>() + payload.len()) as u32,
            error,
            unique: header.unique,
        };
        let mut reply = bytes(&out);
        reply.extend_from_slice(&payload);
        Some(reply)
    }

    fn dispatch(&mut self, h: &InHeader, mut body: Body) -> Reply {
        let node = h.nodeid;
        let writes = matches!(
            h.opcode,
            op::SETATTR
                | op::SYMLINK
                | op::MKNOD
                | op::MKDIR
                | op::UNLINK
                | op::RMDIR
                | op::RENAME
                | op::RENAME2
                | op::LINK
                | op::CREATE
                | op::WRITE
                | op::FALLOCATE
        );
        if writes && self.options.read_only {
            return Err(libc::EROFS);
        }
        match h.opcode {
            op::LOOKUP => {
                let name = body.name()?;
                self.unhidden(node, &name, libc::ENOENT)?;
                self.lookup(node, &name).map(|e| bytes(&e))
            }
            op::GETATTR => self.getattr(node),
            op::SETATTR => self.setattr(node, body.take()?),
            op::READLINK => self.readlink(node),
            op::SYMLINK => {
                let name = body.name()?;
                let target = body.cstr()?;
                self.unhidden(node, &name, libc::EACCES)?;
                let dir = self.fd(node)?;
                // SAFETY: valid C strings and descriptor.
                check(unsafe { libc::symlinkat(target.as_ptr(), dir, name.as_ptr()) })?;
                self.created(node, &name, h, None)
            }
            op::MKNOD => {
                let arg: abi::MknodIn = body.take()?;
                let name = body.name()?;
                self.unhidden(node, &name, libc::EACCES)?;
                // Regular files, FIFOs and sockets; never a device node.
                let kind = arg.mode & libc::S_IFMT;
                if ![libc::S_IFREG, libc::S_IFIFO, libc::S_IFSOCK].contains(&kind) {
                    return Err(libc::EPERM);
                }
                let dir = self.fd(node)?;
                // SAFETY: valid C string and descriptor.
                check(unsafe { libc::mknodat(dir, name.as_ptr(), arg.mode, 0) })?;
                self.created(node, &name, h, Some(arg.mode & 0o7777))
            }
            op::MKDIR => {
                let arg: abi::MkdirIn = body.take()?;
                let name = body.name()?;
                self.unhidden(node, &name, libc::EACCES)?;
                let dir = self.fd(node)?;
                // SAFETY: valid C string and descriptor.
                check(unsafe { libc::mkdirat(dir, name.as_ptr(), arg.mode & 0o7777) })?;
                self.created(node, &name, h, Some(arg.mode & 0o7777))
            }
            op::UNLINK | op::RMDIR => {
                let name = body.name()?;
                self.unhidden(node, &name, libc::ENOENT)?;
                let dir = self.fd(node)?;
                let flags = if h.opcode == op::RMDIR {
                    libc::AT_REMOVEDIR
                } else {
                    0
                };
                // SAFETY: valid C string and descriptor.
                check(unsafe { libc::unlinkat(dir, name.as_ptr(), flags) })?;
                Ok(Vec::new())
            }
            op::RENAME => {
                let arg: abi::RenameIn = body.take()?;
                self.rename(node, arg.newdir, 0, body)
            }
            op::RENAME2 => {
                let arg: abi::Rename2In = body.take()?;
                self.rename(node, arg.newdir, arg.flags, body)
            }
            op::LINK => {
                let arg: abi::LinkIn = body.take()?;
                let name = body.name()?;
                self.unhidden(node, &name, libc::EACCES)?;
                let old = self.fd(arg.oldnodeid)?;
                let dir = self.fd(node)?;
                let from = proc_path(old);
                // SAFETY: valid C strings and descriptors.
                check(unsafe {
                    libc::linkat(
                        libc::AT_FDCWD,
                        from.as_ptr(),
                        dir,
                        name.as_ptr(),
                        libc::AT_SYMLINK_FOLLOW,
                    )
                })?;
                self.lookup(node, &name).map(|e| bytes(&e))
            }
            op::OPEN => {
                let arg: abi::OpenIn = body.take()?;
                self.open(node, arg.flags as i32, false)
            }
            op::OPENDIR => self.open(node, libc::O_RDONLY | libc::O_DIRECTORY, true),
            op::READ => self.read(body.take()?),
            op::WRITE => {
                let arg: abi::WriteIn = body.take()?;
                self.write(arg, body.0)
            }
            op::STATFS => self.statfs(),
            op::RELEASE | op::RELEASEDIR => {
                let arg: abi::ReleaseIn = body.take()?;
                self.handles.remove(&arg.fh);
                Ok(Vec::new())
            }
            op::FSYNC | op::FSYNCDIR => {
                let arg: abi::FsyncIn = body.take()?;
                let file = self.handle_fd(arg.fh)?;
                let ret = if arg.fsync_flags & 1 != 0 {
                    // SAFETY: a descriptor this server holds.
                    unsafe { libc::fdatasync(file) }
                } else {
                    // SAFETY: a descriptor this server holds.
                    unsafe { libc::fsync(file) }
                };
                check(ret).map(|_| Vec::new())
            }
            op::FLUSH => Ok(Vec::new()),
            op::READDIR => self.readdir(body.take()?),
            op::CREATE => {
                let arg: abi::CreateIn = body.take()?;
                let name = body.name()?;
                self.unhidden(node, &name, libc::EACCES)?;
                self.create(node, &name, arg, h)
            }
            op::FALLOCATE => {
                let arg: abi::FallocateIn = body.take()?;
                let file = self.handle_fd(arg.fh)?;
                // SAFETY: a descriptor this server holds.
                check(unsafe {
                    libc::fallocate(
                        file,
                        arg.mode as i32,
                        arg.offset as libc::off_t,
                        arg.length as libc::off_t,
                    )
                })
                .map(|_| Vec::new())
            }
            op::LSEEK => {
                let arg: abi::LseekIn = body.take()?;
                let file = self.handle_fd(arg.fh)?;
                // SAFETY: a descriptor this server holds.
                let at = unsafe { libc::lseek(file, arg.offset as libc::off_t, arg.whence as i32) };
                if at < 0 {
                    return Err(errno());
                }
                Ok(bytes(&abi::LseekOut { offset: at as u64 }))
            }
            op::DESTROY => {
                self.reset();
                Ok(Vec::new())
            }
            // ACCESS: the guest checks permissions itself
            // (default_permissions); xattrs, locks, ioctls: not served.
            _ => Err(libc::ENOSYS),
        }
    }

    fn init(&mut self, mut body: Body) -> Reply {
        let arg: abi::InitIn = body.take()?;
        if self.root.is_none() {
            // An empty slot: nothing to serve.
            return Err(libc::ENODEV);
        }
        if arg.major != abi::KERNEL_VERSION {
            // A newer major: answer with ours (the kernel retries or gives up).
            if arg.major > abi::KERNEL_VERSION {
                return Ok(bytes(&abi::InitOut {
                    major: abi::KERNEL_VERSION,
                    minor: abi::KERNEL_MINOR_VERSION,
                    ..Default::default()
                }));
            }
            return Err(libc::EPROTO);
        }
        self.reset();
        self.session = true;
        let wanted = abi::init::ASYNC_READ
            | abi::init::ATOMIC_O_TRUNC
            | abi::init::BIG_WRITES
            | abi::init::PARALLEL_DIROPS
            | abi::init::MAX_PAGES;
        let out = abi::InitOut {
            major: abi::KERNEL_VERSION,
            minor: arg.minor.min(abi::KERNEL_MINOR_VERSION),
            max_readahead: arg.max_readahead,
            flags: arg.flags & wanted,
            max_background: 64,
            congestion_threshold: 48,
            max_write: MAX_IO,
            time_gran: 1,
            max_pages: (MAX_IO / 4096) as u16,
            ..Default::default()
        };
        Ok(bytes(&out))
    }

    /// The `O_PATH` descriptor of inode `node`.
    fn fd(&self, node: u64) -> Result<RawFd, Errno> {
        if node == abi::ROOT_ID {
            return self
                .root
                .as_ref()
                .map(AsRawFd::as_raw_fd)
                .ok_or(libc::ENODEV);
        }
        self.inodes
            .get(&node)
            .map(|i| i.fd.as_raw_fd())
            .ok_or(libc::ESTALE)
    }

    fn handle_fd(&self, fh: u64) -> Result<RawFd, Errno> {
        self.handles
            .get(&fh)
            .map(AsRawFd::as_raw_fd)
            .ok_or(libc::EBADF)
    }

    fn entry(&self, node: u64, st: &libc::stat) -> EntryOut {
        EntryOut {
            nodeid: node,
            generation: 0,
            entry_valid: VALID_SECS,
            attr_valid: VALID_SECS,
            entry_valid_nsec: 0,
            attr_valid_nsec: 0,
            attr: self.attr(st),
        }
    }

    /// A file's attributes as the guest sees them: the share's owner as
    /// `guest_owner`.
    fn attr(&self, st: &libc::stat) -> Attr {
        let mut attr = attr_of(st);
        if let (Some(owner), Some(guest)) = (self.options.owner, self.options.guest_owner) {
            if attr.uid == owner.0 {
                attr.uid = guest.0;
            }
            if attr.gid == owner.1 {
                attr.gid = guest.1;
            }
        }
        attr
    }

    /// `Err(error)` if `name` in directory `dir` is hidden from the guest.
    fn unhidden(&self, dir: u64, name: &CStr, error: Errno) -> Result<(), Errno> {
        if self.options.hidden.is_empty() {
            return Ok(());
        }
        let path = self.dir_path(self.fd(dir)?);
        match self.is_hidden(path.as_deref(), name.to_bytes()) {
            false => Ok(()),
            true => Err(error),
        }
    }

    /// A directory's path from the share's root ("" for the root; None if
    /// it is no longer beneath it).
    fn dir_path(&self, fd: RawFd) -> Option<Vec<u8>> {
        let path = fd_path(fd)?;
        let rest = path.strip_prefix(self.root_path.as_slice())?;
        match rest {
            [] => Some(Vec::new()),
            [b'/', rest @ ..] => Some(rest.to_vec()),
            _ => None,
        }
    }

    /// Whether `name` in the directory at `dir` (from the root; None: not
    /// known, when path patterns hide it to be safe) is hidden.
    fn is_hidden(&self, dir: Option<&[u8]>, name: &[u8]) -> bool {
        self.options.hidden.iter().any(|pattern| {
            let pattern = pattern.trim_matches('/').as_bytes();
            if !pattern.contains(&b'/') {
                return glob(pattern, name);
            }
            match dir {
                None => true,
                Some([]) => glob(pattern, name),
                Some(dir) => {
                    let mut path = dir.to_vec();
                    path.push(b'/');
                    path.extend_from_slice(name);
                    glob(pattern, &path)
                }
            }
        })
    }

    fn lookup(&mut self, parent: u64, name: &CStr) -> Result<EntryOut, Errno> {
        let dir = self.fd(parent)?;
        // A trailing symlink is opened as itself (O_PATH | O_NOFOLLOW).
        let fd = open_beneath(dir, name, libc::O_PATH, 0)?;
        let st = stat_fd(fd.as_raw_fd())?;
        let key = (st.st_dev, st.st_ino);
        if let Some(&node) = self.by_key.get(&key) {
            if let Some(inode) = self.inodes.get_mut(&node) {
                inode.refs += 1;
                return Ok(self.entry(node, &st));
            }
        }
        if self.inodes.len() >= MAX_INODES {
            return Err(libc::ENFILE);
        }
        let node = self.next_node;
        self.next_node += 1;
        self.inodes.insert(node, Inode { fd, key, refs: 1 });
        self.by_key.insert(key, node);
        Ok(self.entry(node, &st))
    }

    fn forget(&mut self, node: u64, n: u64) {
        let Some(inode) = self.inodes.get_mut(&node) else {
            return;
        };
        inode.refs = inode.refs.saturating_sub(n);
        if inode.refs == 0 {
            let key = inode.key;
            self.inodes.remove(&node);
            self.by_key.remove(&key);
        }
    }

    fn batch_forget(&mut self, body: &[u8]) {
        let mut body = Body(body);
        let Ok(arg) = body.take::<abi::BatchForgetIn>() else {
            return;
        };
        for _ in 0..arg.count {
            match body.take::<abi::ForgetOne>() {
                Ok(one) => self.forget(one.nodeid, one.nlookup),
                Err(_) => return,
            }
        }
    }

    fn getattr(&self, node: u64) -> Reply {
        let st = stat_fd(self.fd(node)?)?;
        Ok(bytes(&abi::AttrOut {
            attr_valid: VALID_SECS,
            attr: self.attr(&st),
            ..Default::default()
        }))
    }

    /// Sets the new entry `name` in `dir` up as the guest asked (its mode
    /// beyond this process's umask, its owner) and answers its entry.
    fn created(&mut self, dir: u64, name: &CStr, h: &InHeader, mode: Option<u32>) -> Reply {
        let entry = self.lookup(dir, name)?;
        let fd = self.fd(entry.nodeid)?;
        if let Some(mode) = mode {
            let path = proc_path(fd);
            // SAFETY: a valid C string.
            unsafe { libc::fchmodat(libc::AT_FDCWD, path.as_ptr(), mode, 0) };
        }
        self.chown_new(fd, h);
        let st = stat_fd(fd)?;
        Ok(bytes(&self.entry(entry.nodeid, &st)))
    }

    /// Gives a file the guest created its owner: the share's, else the
    /// creating guest user's. Unprivileged, the VMM's own ids stay.
    fn chown_new(&self, fd: RawFd, h: &InHeader) {
        let (uid, gid) = self.options.owner.unwrap_or((h.uid, h.gid));
        let _ = chown(fd, uid, gid);
    }

    fn setattr(&mut self, node: u64, arg: abi::SetattrIn) -> Reply {
        use abi::fattr;
        let fd = self.fd(node)?;
        let st = stat_fd(fd)?;
        let kind = file_type(&st);
        let path = proc_path(fd);
        if arg.valid & fattr::MODE != 0 && kind != libc::S_IFLNK {
            // SAFETY: a valid C string.
            check(unsafe { libc::fchmodat(libc::AT_FDCWD, path.as_ptr(), arg.mode & 0o7777, 0) })?;
        }
        if arg.valid & (fattr::UID | fattr::GID) != 0 {
            // The guest's view of the share's owner is the owner.
            let (mut uid, mut gid) = (arg.uid, arg.gid);
            if let (Some(owner), Some(guest)) = (self.options.owner, self.options.guest_owner) {
                uid = if uid == guest.0 { owner.0 } else { uid };
                gid = if gid == guest.1 { owner.1 } else { gid };
            }
            let uid = if arg.valid & fattr::UID != 0 {
                uid
            } else {
                u32::MAX
            };
            let gid = if arg.valid & fattr::GID != 0 {
                gid
            } else {
                u32::MAX
            };
            chown(fd, uid, gid)?;
        }
        if arg.valid & fattr::SIZE != 0 {
            if kind != libc::S_IFREG {
                return Err(libc::EINVAL);
            }
            let size = arg.size as libc::off_t;
            match self
                .handles
                .get(&arg.fh)
                .filter(|_| arg.valid & fattr::FH != 0)
            {
                // SAFETY: a descriptor this server holds.
                Some(file) => check(unsafe { libc::ftruncate(file.as_raw_fd(), size) })?,
                None => {
                    let file = reopen(fd, libc::O_WRONLY)?;
                    // SAFETY: a descriptor just opened.
                    check(unsafe { libc::ftruncate(file.as_raw_fd(), size) })?
                }
            };
        }
        if arg.valid & (fattr::ATIME | fattr::MTIME) != 0 && kind != libc::S_IFLNK {
            let time = |set: u32, now: u32, secs: u64, nsecs: u32| libc::timespec {
                tv_sec: secs as libc::time_t,
                tv_nsec: if arg.valid & set == 0 {
                    libc::UTIME_OMIT
                } else if arg.valid & now != 0 {
                    libc::UTIME_NOW
                } else {
                    i64::from(nsecs)
                },
            };
            let times = [
                time(fattr::ATIME, fattr::ATIME_NOW, arg.atime, arg.atimensec),
                time(fattr::MTIME, fattr::MTIME_NOW, arg.mtime, arg.mtimensec),
            ];
            // SAFETY: a valid C string and two timespecs.
            check(unsafe { libc::utimensat(libc::AT_FDCWD, path.as_ptr(), times.as_ptr(), 0) })?;
        }
        self.getattr(node)
    }

    fn readlink(&self, node: u64) -> Reply {
        let fd = self.fd(node)?;
        let mut buf = vec![0u8; libc::PATH_MAX as usize];
        // SAFETY: the buffer is as long as passed.
        let n = unsafe { libc::readlinkat(fd, EMPTY.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(errno());
        }
        buf.truncate(n as usize);
        Ok(buf)
    }

    fn rename(&mut self, dir: u64, newdir: u64, flags: u32, mut body: Body) -> Reply {
        let name = body.name()?;
        let newname = body.name()?;
        self.unhidden(dir, &name, libc::ENOENT)?;
        self.unhidden(newdir, &newname, libc::EACCES)?;
        // RENAME_NOREPLACE and RENAME_EXCHANGE; not WHITEOUT (overlayfs').
        if flags & !(libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE) != 0 {
            return Err(libc::EINVAL);
        }
        let (from, to) = (self.fd(dir)?, self.fd(newdir)?);
        // SAFETY: valid C strings and descriptors.
        check(unsafe {
            libc::syscall(
                libc::SYS_renameat2,
                from,
                name.as_ptr(),
                to,
                newname.as_ptr(),
                flags,
            ) as libc::c_int
        })?;
        Ok(Vec::new())
    }

    fn open(&mut self, node: u64, flags: i32, dir: bool) -> Reply {
        let fd = self.fd(node)?;
        let st = stat_fd(fd)?;
        match (file_type(&st), dir) {
            (libc::S_IFDIR, true) | (libc::S_IFREG, false) => {}
            (libc::S_IFDIR, false) => return Err(libc::EISDIR),
            (_, true) => return Err(libc::ENOTDIR),
            _ => return Err(libc::EPERM),
        }
        let access = flags & libc::O_ACCMODE;
        if self.options.read_only && (access != libc::O_RDONLY || flags & libc::O_TRUNC != 0) {
            return Err(libc::EROFS);
        }
        let keep = libc::O_ACCMODE
            | libc::O_APPEND
            | libc::O_TRUNC
            | libc::O_DIRECTORY
            | libc::O_NONBLOCK
            | libc::O_SYNC
            | libc::O_DSYNC
            | libc::O_NOATIME;
        let file = reopen(fd, flags & keep)?;
        if self.handles.len() >= MAX_HANDLES {
            return Err(libc::ENFILE);
        }
        let fh = self.next_handle;
        self.next_handle += 1;
        self.handles.insert(fh, file);
        Ok(bytes(&abi::OpenOut {
            fh,
            ..Default::default()
        }))
    }

    fn create(&mut self, dir: u64, name: &CStr, arg: abi::CreateIn, h: &InHeader) -> Reply {
        if self.handles.len() >= MAX_HANDLES {
            return Err(libc::ENFILE);
        }
        let parent = self.fd(dir)?;
        let keep = libc::O_ACCMODE
            | libc::O_APPEND
            | libc::O_TRUNC
            | libc::O_EXCL
            | libc::O_NONBLOCK
            | libc::O_SYNC
            | libc::O_DSYNC
            | libc::O_NOATIME;
        let flags = (arg.flags as i32 & keep) | libc::O_CREAT;
        let file = File::from(open_beneath(parent, name, flags, arg.mode & 0o7777)?);
        let entry = self.created(dir, name, h, Some(arg.mode & 0o7777))?;
        let fh = self.next_handle;
        self.next_handle += 1;
        self.handles.insert(fh, file);
        let mut out = entry;
        out.extend_from_slice(
            abi::OpenOut {
                fh,
                ..Default::default()
            }
            .as_slice(),
        );
        Ok(out)
    }

    fn read(&mut self, arg: abi::ReadIn) -> Reply {
        let file = self.handles.get(&arg.fh).ok_or(libc::EBADF)?;
        let mut buf = vec![0u8; arg.size.min(MAX_IO) as usize];
        let n = file.read_at(&mut buf, arg.offset).map_err(io_errno)?;
        buf.truncate(n);
        Ok(buf)
    }

    fn write(&mut self, arg: abi::WriteIn, data: &[u8]) -> Reply {
        let file = self.handles.get(&arg.fh).ok_or(libc::EBADF)?;
        let data = data.get(..arg.size as usize).ok_or(libc::EINVAL)?;
        let n = file.write_at(data, arg.offset).map_err(io_errno)?;
        Ok(bytes(&abi::WriteOut {
            size: n as u32,
            padding: 0,
        }))
    }

    fn statfs(&self) -> Reply {
        let root = self.fd(abi::ROOT_ID)?;
        let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
        // SAFETY: fstatvfs writes a statvfs.
        check(unsafe { libc::fstatvfs(root, st.as_mut_ptr()) })?;
        // SAFETY: it succeeded.
        let st = unsafe { st.assume_init() };
        Ok(bytes(&abi::Kstatfs {
            blocks: st.f_blocks,
            bfree: st.f_bfree,
            bavail: st.f_bavail,
            files: st.f_files,
            ffree: st.f_ffree,
            bsize: st.f_bsize as u32,
            namelen: st.f_namemax as u32,
            frsize: st.f_frsize as u32,
            ..Default::default()
        }))
    }

    /// Directory entries from `offset` (a position `getdents64` gave),
    /// as many as fit in `size` bytes.
    fn readdir(&mut self, arg: abi::ReadIn) -> Reply {
        let dir = self.handle_fd(arg.fh)?;
        let size = arg.size.min(MAX_IO) as usize;
        // SAFETY: a descriptor this server holds.
        if unsafe { libc::lseek(dir, arg.offset as libc::off_t, libc::SEEK_SET) } < 0 {
            return Err(errno());
        }
        let mut raw = vec![0u8; size.max(512)];
        // SAFETY: the buffer is as long as passed.
        let n = unsafe { libc::syscall(libc::SYS_getdents64, dir, raw.as_mut_ptr(), raw.len()) };
        if n < 0 {
            return Err(errno());
        }
        let raw = &raw[..n as usize];
        let path = (!self.options.hidden.is_empty()).then(|| self.dir_path(dir));
        let mut out = Vec::with_capacity(size);
        let mut at = 0;
        // struct linux_dirent64 { u64 ino; i64 off; u16 reclen; u8 type; char name[]; }
        while at + 19 <= raw.len() {
            let ino = u64::from_ne_bytes(raw[at..at + 8].try_into().unwrap_or_default());
            let off = u64::from_ne_bytes(raw[at + 8..at + 16].try_into().unwrap_or_default());
            let reclen = usize::from(u16::from_ne_bytes([raw[at + 16], raw[at + 17]]));
            let typ = raw[at + 18];
            if reclen < 19 || at + reclen > raw.len() {
                break;
            }
            let name = &raw[at + 19..at + reclen];
            let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
            if let Some(path) = &path {
                if self.is_hidden(path.as_deref(), name) {
                    at += reclen;
                    continue;
                }
            }
            let entry = std::mem::size_of::<abi::Dirent>() + name.len();
            let padded = (entry + 7) & !7;
            if out.len() + padded > size {
                break;
            }
            out.extend_from_slice(
                abi::Dirent {
                    ino,
                    off,
                    namelen: name.len() as u32,
                    typ: u32::from(typ),
                }
                .as_slice(),
            );
            out.extend_from_slice(name);
            out.resize(out.len() + (padded - entry), 0);
            at += reclen;
        }
        Ok(out)
    }
}

/// The path a descriptor's file has now (`/proc/self/fd`), if it has one.
fn fd_path(fd: RawFd) -> Option<Vec<u8>> {
    let link = proc_path(fd);
    let mut buf = vec![0u8; libc::PATH_MAX as usize];
    // SAFETY: a valid C string and a buffer as long as passed.
    let n = unsafe {
        libc::readlinkat(
            libc::AT_FDCWD,
            link.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    let n = usize::try_from(n).ok()?;
    buf.truncate(n);
    // A deleted directory's path says so: it is beneath nothing.
    (!buf.ends_with(b" (deleted)")).then_some(buf)
}

/// Opens the file an `O_PATH` descriptor names, for I/O.
fn reopen(fd: RawFd, flags: i32) -> Result<File, Errno> {
    let path = proc_path(fd);
    // SAFETY: a valid C string; the descriptor is owned below.
    let file = unsafe { libc::open(path.as_ptr(), flags | libc::O_CLOEXEC) };
    if file < 0 {
        return Err(errno());
    }
    // SAFETY: just opened, owned by nothing else.
    Ok(unsafe { File::from_raw_fd(file) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, MetadataExt};
    use vmm_sys_util::tempdir::TempDir;

    /// A server on a fresh directory, after INIT.
    fn server(options: ShareOptions) -> (TempDir, Server) {
        let dir = TempDir::new().expect("tempdir");
        let server = Server::new(Some(dir.as_path()), options).expect("server");
        (dir, init(server))
    }

    /// A server on a detached mount of a fresh directory (as the daemon
    /// passes a jailed VMM), after INIT; None unless run as root.
    fn detached_server(options: ShareOptions) -> Option<(TempDir, Server)> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: a detached mount is made as root");
            return None;
        }
        let dir = TempDir::new().expect("tempdir");
        let path = CString::new(dir.as_path().as_os_str().as_encoded_bytes()).expect("path");
        // SAFETY: a valid C string; the descriptor is owned below.
        let tree = unsafe {
            libc::syscall(
                libc::SYS_open_tree,
                libc::AT_FDCWD,
                path.as_ptr(),
                1 | libc::O_CLOEXEC as libc::c_uint, // OPEN_TREE_CLONE
            )
        };
        assert!(tree >= 0, "open_tree: {}", std::io::Error::last_os_error());
        // SAFETY: just returned, owned by nothing else.
        let tree = unsafe { OwnedFd::from_raw_fd(tree as RawFd) };
        let server = Server::with_root(tree, options).expect("server");
        assert!(server.root_path.is_empty(), "a detached root reads as /");
        Some((dir, init(server)))
    }

    fn init(mut server: Server) -> Server {
        let init = abi::InitIn {
            major: 7,
            minor: 38,
            max_readahead: 1 << 17,
            flags: u32::MAX,
        };
        let (error, out) = call(&mut server, op::INIT, abi::ROOT_ID, init.as_slice());
        assert_eq!(error, 0);
        let out: abi::InitOut = read(&out).expect("init_out");
        assert_eq!((out.major, out.minor, out.max_write), (7, 38, MAX_IO));
        server
    }

    /// Sends one request; its error and payload.
    fn call(server: &mut Server, opcode: u32, nodeid: u64, body: &[u8]) -> (i32, Vec<u8>) {
        let header = InHeader {
            len: (std::mem::size_of::<InHeader>() + body.len()) as u32,
            opcode,
            unique: 7,
            nodeid,
            uid: 1000,
            gid: 1000,
            ..Default::default()
        };
        let mut request = bytes(&header);
        request.extend_from_slice(body);
        let reply = server.handle(&request).expect("a reply");
        let out: OutHeader = read(&reply).expect("out header");
        assert_eq!(out.len as usize, reply.len());
        assert_eq!(out.unique, 7);
        (-out.error, reply[16..].to_vec())
    }

    fn name(n: &str) -> Vec<u8> {
        let mut v = n.as_bytes().to_vec();
        v.push(0);
        v
    }

    fn lookup(server: &mut Server, parent: u64, n: &str) -> Result<EntryOut, i32> {
        match call(server, op::LOOKUP, parent, &name(n)) {
            (0, out) => Ok(read(&out).expect("entry")),
            (e, _) => Err(e),
        }
    }

    /// RENAME of `from` to `to`, both in the root: its error.
    fn rename(server: &mut Server, from: &str, to: &str) -> i32 {
        let mut body = abi::RenameIn {
            newdir: abi::ROOT_ID,
        }
        .as_slice()
        .to_vec();
        body.extend(name(from));
        body.extend(name(to));
        call(server, op::RENAME, abi::ROOT_ID, &body).0
    }

    /// The names READDIR gives for the root, sorted.
    fn listing(server: &mut Server) -> Vec<String> {
        let (e, out) = call(server, op::OPENDIR, abi::ROOT_ID, &[]);
        assert_eq!(e, 0);
        let fh = read::<abi::OpenOut>(&out).expect("open").fh;
        let list = abi::ReadIn {
            fh,
            size: 4096,
            ..Default::default()
        };
        let (e, out) = call(server, op::READDIR, abi::ROOT_ID, list.as_slice());
        assert_eq!(e, 0);
        let mut names = Vec::new();
        let mut at = 0;
        while at < out.len() {
            let d: abi::Dirent = read(&out[at..]).expect("dirent");
            let start = at + std::mem::size_of::<abi::Dirent>();
            names.push(
                String::from_utf8_lossy(&out[start..start + d.namelen as usize]).into_owned(),
            );
            at += (std::mem::size_of::<abi::Dirent>() + d.namelen as usize + 7) & !7;
        }
        names.sort();
        names
    }

    #[test]
    fn dot_dot_and_slashes_are_refused_and_symlinks_are_never_followed() {
        let (dir, mut s) = server(ShareOptions::default());
        let share = dir.as_path();
        std::fs::create_dir(share.join("sub")).expect("mkdir");
        symlink("/", share.join("root")).expect("symlink");
        symlink("..", share.join("sub/up")).expect("symlink");

        assert_eq!(lookup(&mut s, abi::ROOT_ID, "..").err(), Some(libc::EINVAL));
        assert_eq!(lookup(&mut s, abi::ROOT_ID, ".").err(), Some(libc::EINVAL));
        assert_eq!(
            lookup(&mut s, abi::ROOT_ID, "sub/..").err(),
            Some(libc::EINVAL)
        );
        let sub = lookup(&mut s, abi::ROOT_ID, "sub").expect("sub").nodeid;
        assert_eq!(lookup(&mut s, sub, "..").err(), Some(libc::EINVAL));
        // A symlink is an inode of its own; nothing resolves through it.
        let root = lookup(&mut s, abi::ROOT_ID, "root").expect("the link");
        assert_eq!(root.attr.mode & libc::S_IFMT, libc::S_IFLNK);
        assert_eq!(
            lookup(&mut s, root.nodeid, "etc").err(),
            Some(libc::ENOTDIR)
        );
        let up = lookup(&mut s, sub, "up").expect("the link").nodeid;
        assert_eq!(lookup(&mut s, up, "sub").err(), Some(libc::ENOTDIR));
        let (e, target) = call(&mut s, op::READLINK, up, &[]);
        assert_eq!((e, target.as_slice()), (0, &b".."[..]));
        // Nor can it be opened for I/O.
        let open = abi::OpenIn::default();
        assert_eq!(
            call(&mut s, op::OPEN, root.nodeid, open.as_slice()).0,
            libc::EPERM
        );
    }

    #[test]
    fn files_are_created_written_read_listed_and_renamed_beneath_the_share() {
        let (dir, mut s) = server(ShareOptions {
            read_only: false,
            ..Default::default()
        });
        let create = abi::CreateIn {
            flags: libc::O_RDWR as u32,
            mode: libc::S_IFREG | 0o640,
            ..Default::default()
        };
        let mut body = create.as_slice().to_vec();
        body.extend(name("new"));
        let (e, out) = call(&mut s, op::CREATE, abi::ROOT_ID, &body);
        assert_eq!(e, 0);
        let entry: EntryOut = read(&out).expect("entry");
        let open: abi::OpenOut = read(&out[128..]).expect("open");
        let write = abi::WriteIn {
            fh: open.fh,
            size: 5,
            ..Default::default()
        };
        let mut body = write.as_slice().to_vec();
        body.extend(b"hello");
        let (e, out) = call(&mut s, op::WRITE, entry.nodeid, &body);
        assert_eq!(
            (e, read::<abi::WriteOut>(&out).map(|w| w.size)),
            (0, Some(5))
        );
        let read_in = abi::ReadIn {
            fh: open.fh,
            size: 100,
            ..Default::default()
        };
        let (e, data) = call(&mut s, op::READ, entry.nodeid, read_in.as_slice());
        assert_eq!((e, data.as_slice()), (0, &b"hello"[..]));
        let meta = std::fs::metadata(dir.as_path().join("new")).expect("on the host");
        assert_eq!(meta.mode() & 0o7777, 0o640);
        // As root the creating guest user owns it; unprivileged, the VMM.
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        if root {
            assert_eq!((meta.uid(), meta.gid()), (1000, 1000));
        }

        assert_eq!(rename(&mut s, "new", "renamed"), 0);
        assert_eq!(rename(&mut s, "renamed", "../out"), libc::EINVAL);
        assert!(dir.as_path().join("renamed").exists());
        assert_eq!(listing(&mut s), [".", "..", "renamed"]);
    }

    #[test]
    fn a_read_only_share_refuses_every_change() {
        let (dir, mut s) = server(ShareOptions {
            read_only: true,
            ..Default::default()
        });
        std::fs::write(dir.as_path().join("file"), "kept").expect("write");
        let file = lookup(&mut s, abi::ROOT_ID, "file").expect("file").nodeid;
        let mut body = abi::MkdirIn {
            mode: 0o755,
            umask: 0,
        }
        .as_slice()
        .to_vec();
        body.extend(name("d"));
        assert_eq!(call(&mut s, op::MKDIR, abi::ROOT_ID, &body).0, libc::EROFS);
        assert_eq!(
            call(&mut s, op::UNLINK, abi::ROOT_ID, &name("file")).0,
            libc::EROFS
        );
        let rw = abi::OpenIn {
            flags: libc::O_RDWR as u32,
            open_flags: 0,
        };
        assert_eq!(call(&mut s, op::OPEN, file, rw.as_slice()).0, libc::EROFS);
        let trunc = abi::OpenIn {
            flags: (libc::O_RDONLY | libc::O_TRUNC) as u32,
            open_flags: 0,
        };
        assert_eq!(
            call(&mut s, op::OPEN, file, trunc.as_slice()).0,
            libc::EROFS
        );
        let ro = abi::OpenIn::default();
        assert_eq!(call(&mut s, op::OPEN, file, ro.as_slice()).0, 0);
        let setattr = abi::SetattrIn {
            valid: abi::fattr::SIZE,
            ..Default::default()
        };
        assert_eq!(
            call(&mut s, op::SETATTR, file, setattr.as_slice()).0,
            libc::EROFS
        );
        assert_eq!(
            std::fs::read_to_string(dir.as_path().join("file")).expect("the file"),
            "kept"
        );
    }

    #[test]
    fn device_nodes_cannot_be_made_and_garbage_gets_errors() {
        let (_dir, mut s) = server(ShareOptions::default());
        let mut body = abi::MknodIn {
            mode: libc::S_IFBLK | 0o600,
            rdev: 0x0801,
            ..Default::default()
        }
        .as_slice()
        .to_vec();
        body.extend(name("sda"));
        assert_eq!(call(&mut s, op::MKNOD, abi::ROOT_ID, &body).0, libc::EPERM);
        // Truncated bodies, names without a NUL, unknown inodes and
        // handles, unknown opcodes: errors, never a panic.
        assert_eq!(
            call(&mut s, op::SETATTR, abi::ROOT_ID, &[1, 2, 3]).0,
            libc::EINVAL
        );
        assert_eq!(
            call(&mut s, op::LOOKUP, abi::ROOT_ID, b"no-nul").0,
            libc::EINVAL
        );
        assert_eq!(call(&mut s, op::GETATTR, 999, &[0; 16]).0, libc::ESTALE);
        let read_in = abi::ReadIn {
            fh: 42,
            size: u32::MAX,
            ..Default::default()
        };
        assert_eq!(
            call(&mut s, op::READ, abi::ROOT_ID, read_in.as_slice()).0,
            libc::EBADF
        );
        assert_eq!(call(&mut s, 9999, abi::ROOT_ID, &[]).0, libc::ENOSYS);
        // A header whose length runs past the request, and one too short.
        let mut lying = bytes(&InHeader {
            len: 4096,
            opcode: op::GETATTR,
            nodeid: abi::ROOT_ID,
            ..Default::default()
        });
        lying.extend([0; 16]);
        let reply = s.handle(&lying).expect("a reply");
        assert_eq!(
            read::<OutHeader>(&reply).map(|h| h.error),
            Some(-libc::EINVAL)
        );
        assert!(s.handle(&[0; 12]).is_none());
        assert_eq!(
            lookup(&mut s, abi::ROOT_ID, "missing").err(),
            Some(libc::ENOENT)
        );
        // A forget of more than was looked up drops the inode, no more.
        std::fs::create_dir(_dir.as_path().join("d")).expect("mkdir");
        let d = lookup(&mut s, abi::ROOT_ID, "d").expect("d").nodeid;
        assert_eq!(lookup(&mut s, abi::ROOT_ID, "d").map(|e| e.nodeid), Ok(d));
        let mut forget = bytes(&InHeader {
            len: 48,
            opcode: op::FORGET,
            nodeid: d,
            ..Default::default()
        });
        forget.extend(abi::ForgetIn { nlookup: 5 }.as_slice());
        assert!(s.handle(&forget).is_none());
        assert_eq!(call(&mut s, op::GETATTR, d, &[0; 16]).0, libc::ESTALE);
    }

    #[test]
    fn hidden_names_and_paths_are_absent_to_the_guest() {
        let options = ShareOptions {
            hidden: vec![".env".into(), "*.pem".into(), ".git/hooks".into()],
            ..Default::default()
        };
        hidden_are_absent(server(options.clone()));
        if let Some(detached) = detached_server(options) {
            hidden_are_absent(detached);
        }
    }

    fn hidden_are_absent((dir, mut s): (TempDir, Server)) {
        let share = dir.as_path();
        std::fs::create_dir_all(share.join(".git/hooks")).expect("mkdir");
        std::fs::create_dir_all(share.join("app/.git/hooks")).expect("mkdir");
        for file in [".env", "app/.env", "key.pem", "app/main.rs", ".git/config"] {
            std::fs::write(share.join(file), "host").expect("write");
        }
        let app = lookup(&mut s, abi::ROOT_ID, "app").expect("app").nodeid;
        let git = lookup(&mut s, abi::ROOT_ID, ".git").expect(".git").nodeid;
        for (parent, n) in [
            (abi::ROOT_ID, ".env"),
            (app, ".env"),
            (abi::ROOT_ID, "key.pem"),
        ] {
            assert_eq!(lookup(&mut s, parent, n).err(), Some(libc::ENOENT), "{n}");
        }
        assert_eq!(lookup(&mut s, git, "hooks").err(), Some(libc::ENOENT));
        // A path pattern is from the root: app/.git/hooks is not .git/hooks.
        let app_git = lookup(&mut s, app, ".git").expect("app/.git").nodeid;
        assert!(lookup(&mut s, app_git, "hooks").is_ok());
        assert!(lookup(&mut s, git, "config").is_ok());
        assert!(lookup(&mut s, app, "main.rs").is_ok());
        // Not to be created over, replaced, renamed over or removed.
        let create = abi::CreateIn {
            flags: (libc::O_RDWR | libc::O_TRUNC) as u32,
            mode: libc::S_IFREG | 0o644,
            ..Default::default()
        };
        let mut body = create.as_slice().to_vec();
        body.extend(name(".env"));
        assert_eq!(
            call(&mut s, op::CREATE, abi::ROOT_ID, &body).0,
            libc::EACCES
        );
        assert_eq!(rename(&mut s, "app", "x.pem"), libc::EACCES);
        assert_eq!(call(&mut s, op::UNLINK, app, &name(".env")).0, libc::ENOENT);
        assert_eq!(
            std::fs::read_to_string(share.join(".env")).expect(".env"),
            "host"
        );
        // Not listed.
        assert_eq!(listing(&mut s), [".", "..", ".git", "app"]);
        assert!(glob(b"*.pem", b"a.pem") && !glob(b"*.pem", b"a/b.pem"));
        assert!(glob(b"a?c", b"abc") && !glob(b"a?c", b"a/c") && glob(b"*", b""));
    }

    #[test]
    fn the_shares_owner_is_the_guests_user_both_ways() {
        // SAFETY: geteuid and getegid have no preconditions.
        let me = unsafe { (libc::geteuid(), libc::getegid()) };
        let (dir, mut s) = server(ShareOptions {
            owner: Some(me),
            guest_owner: Some((1000, 1001)),
            ..Default::default()
        });
        std::fs::write(dir.as_path().join("mine"), "x").expect("write");
        let entry = lookup(&mut s, abi::ROOT_ID, "mine").expect("mine");
        assert_eq!((entry.attr.uid, entry.attr.gid), (1000, 1001));
        // A chown to the guest's user is one to the owner: nothing changes.
        let chown = abi::SetattrIn {
            valid: abi::fattr::UID | abi::fattr::GID,
            uid: 1000,
            gid: 1001,
            ..Default::default()
        };
        let (e, out) = call(&mut s, op::SETATTR, entry.nodeid, chown.as_slice());
        assert_eq!(e, 0);
        let attr = read::<abi::AttrOut>(&out).expect("attr").attr;
        assert_eq!((attr.uid, attr.gid), (1000, 1001));
        let meta = std::fs::metadata(dir.as_path().join("mine")).expect("metadata");
        assert_eq!((meta.uid(), meta.gid()), me);
    }

    #[test]
    fn an_empty_slot_refuses_to_be_mounted() {
        let mut s = Server::new(None, ShareOptions::default()).expect("slot");
        let init = abi::InitIn {
            major: 7,
            minor: 38,
            ..Default::default()
        };
        assert_eq!(
            call(&mut s, op::INIT, abi::ROOT_ID, init.as_slice()).0,
            libc::ENODEV
        );
        assert!(!s.has_session());
        assert_eq!(
            call(&mut s, op::GETATTR, abi::ROOT_ID, &[0; 16]).0,
            libc::EIO
        );
    }
}
