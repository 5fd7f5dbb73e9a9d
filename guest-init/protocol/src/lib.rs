//! The husk agent protocol, spoken over vsock between a host client and the
//! agent in guest-init.
//!
//! # Framing
//!
//! Every message is one frame: a little-endian `u32` length, then that many
//! bytes of a postcard-encoded [`Frame`]. Frames longer than [`MAX_FRAME`]
//! are refused without being read into memory (the connection is then
//! closed, since the rest of the stream cannot be trusted). A frame that is
//! well delimited but does not decode (garbage, a message type this side
//! does not know) is answered with an error and the connection goes on.
//!
//! # Session
//!
//! The host connects to guest port [`AGENT_PORT`] and sends `Hello` with
//! its [`VERSION`]; the agent answers `Hello` with its own, or
//! `Error(VersionMismatch)` and closes. Then the host sends requests, each
//! with a fresh `id`; every reply carries the id of its request.
//!
//! | message | direction | meaning |
//! |---|---|---|
//! | `Hello { version }` | both | handshake; must be the first frame each way |
//! | `Ping` | host → guest | liveness check |
//! | `Pong { uptime_ms }` | guest → host | reply to `Ping`: guest CLOCK_BOOTTIME in ms |
//! | `Health` | host → guest | guest clocks, memory, load and process count |
//! | `HealthInfo(Health)` | guest → host | reply to `Health` |
//! | `SetClock { unix_ns }` | host → guest | set the guest's wall clock |
//! | `Restored { unix_ns, hostname, entropy, mac }` | host → guest | a clone's first message after a restore: wall clock, its own hostname, fresh randomness, its own MAC address |
//! | `Exec(ExecRequest)` | host → guest | start a program (argv, no shell); foreground or background |
//! | `Started { pid }` | guest → host | the program is running (first reply to `Exec`) |
//! | `Output { stream, data }` | guest → host | a chunk of the program's stdout or stderr, as it runs |
//! | `Lost { bytes }` | guest → host | output dropped from a full buffer while no client was attached |
//! | `Exited(ExitReport)` | guest → host | the program ended: exit code or signal, CPU time, peak RSS |
//! | `Stdin { pid, data }` | host → guest | more input for a program started with `stdin_open` (no reply) |
//! | `StdinClose { pid }` | host → guest | end of that input (no reply) |
//! | `Resize { pid, rows, cols }` | host → guest | new terminal size for a PTY program (no reply) |
//! | `Signal { pid, signal }` | host → guest | send a signal to the program's process group |
//! | `Processes` | host → guest | programs the agent started that were not collected yet |
//! | `ProcessList(Vec<ProcessInfo>)` | guest → host | reply to `Processes` |
//! | `Attach { pid }` | host → guest | (re)attach to a program's output: buffered output, then live, then `Exited` |
//! | `Wait { pid }` | host → guest | wait for a program to end; `Exited`, its output discarded |
//! | `ReadFile { path }` | host → guest | stream a file back: `FileChunk`s, then `FileEnd` |
//! | `WriteFile { path, mode }` | host → guest | start an atomic write; `FileChunk`s follow, then `FileCommit` |
//! | `FileChunk { data }` | both | a piece of file content (at most [`FILE_CHUNK`] bytes) |
//! | `FileEnd { size }` | guest → host | end of a `ReadFile` |
//! | `FileCommit` | host → guest | end of a `WriteFile`: the agent fsyncs and renames into place |
//! | `Written { size }` | guest → host | the write is in place (the only reply to a `WriteFile`) |
//! | `Stat { path }` | host → guest | metadata of one path (not following a final symlink) |
//! | `StatInfo(FileStat)` | guest → host | reply to `Stat` |
//! | `List { path }` | host → guest | a directory's entries: `Entries` frames, the last with `more: false` |
//! | `Entries { entries, more }` | guest → host | up to [`LIST_BATCH`] entries |
//! | `Mkdir { path }` | host → guest | create a directory and its parents (`mkdir -p`) |
//! | `MkdirAs { path, user }` | host → guest | `mkdir -p`, the directories it creates owned by `user` |
//! | `Chown { path, user }` | host → guest | give a file, directory or link (not what it points to) to `user` |
//! | `Remove { path, recursive }` | host → guest | remove a file, an empty directory, or a tree |
//! | `Rename { from, to }` | host → guest | rename within the guest |
//! | `Watch { path, recursive }` | host → guest | watch a directory (inotify): `Watching`, then `FsEvents` until `Cancel` |
//! | `Watching` | guest → host | the watch is in place; later changes will be reported |
//! | `FsEvents(Vec<FsEvent>)` | guest → host | changes under a watched directory |
//! | `Cancel` | host → guest | end the `Watch` with the same id; answered by `Done` |
//! | `KillAll` | host → guest | SIGKILL everything started in the sandbox (every program and what it left behind); the agent and PID 1 stay |
//! | `KilledAll { tasks }` | guest → host | reply to `KillAll`, once they are gone: how many tasks (processes and threads) there were |
//! | `Unpack { dir }` | host → guest | lay out a tree (a newc cpio archive in `FileChunk`s, then `FileCommit`) under the new directory `dir`; `Written` |
//! | `ExecIn { root, request }` | host → guest | `Exec` with `root` as the program's `/`, in a mount namespace of its own (and its container's PID namespace, if it has one): a container of a pod |
//! | `UserAttrs { path, set }` | host → guest | set a path's `user.` extended attributes (file metadata), then answer them all: `Attrs` |
//! | `Attrs(Vec<(name, value)>)` | guest → host | a path's `user.` extended attributes, names without the prefix |
//! | `DirUserAttrs { path }` | host → guest | the `user.` extended attributes of each entry of a directory that has any: `DirAttrs` |
//! | `DirAttrs(Vec<(entry, attrs)>)` | guest → host | reply to `DirUserAttrs` |
//! | `Container { root, memory_max, own_pids }` | host → guest | declares the container at `root` before its first `ExecIn`: the memory its programs may use together, whether they have a PID namespace of their own |
//! | `ContainerLimits { root, memory_max }` | host → guest | sets a declared container's memory limit anew (none: unbounded); `Done` |
//! | `ContainerCpu { root, quota_us, period_us }` | host → guest | sets a declared container's CPU limit: `quota_us` of CPU time per `period_us` (none: unbounded); `Done` |
//! | `Mount { root, source, target, readonly }` | host → guest | binds `source` (a directory, or a regular file) at `target` inside the container root `root` (a pod's volume, or a file such as `/etc/hosts`); `Done` |
//! | `MountMedium { serial, size, root }` | host → guest | mounts the ext4 file system on the drive whose serial is `serial` at the new directory `root` (a container's root file system on a drive the host just gave a new medium of `size` bytes: it waits, bounded, until the drive has that size); `Done` |
//! | `MountShare { tag, target, readonly }` | host → guest | mounts the host directory that virtio-fs device `tag` serves at `target` (made if missing; nosuid, nodev; read-only if asked); `Done` |
//! | `Network(NetConfig)` | host → guest | gives the guest's network interface a pod's network: MAC, MTU, IPv4 address, routes (the pod network's interface, which the host connected to the guest's); `Done` |
//! | `ContainerStats { root }` | host → guest | what a declared container uses now (its cgroup): `ContainerUsage` |
//! | `ContainerUsage(usage)` | guest → host | memory, its limit, CPU time and tasks of a container |
//! | `Done` | guest → host | the request succeeded and has nothing (more) to return |
//! | `Error { kind, message }` | guest → host | the request failed; `kind` says why |
//!
//! Requests on one connection run concurrently: a long `Exec`, `Attach`,
//! `ReadFile` or `Watch` does not hold up a `Ping` sent after it, and frames
//! of different requests may interleave. Frames with no reply (`Stdin`,
//! `StdinClose`, `Resize`) are answered only when they fail, with an
//! `Error` under their own id.
//!
//! # Programs
//!
//! A foreground `Exec` streams `Started`, `Output`s and `Exited` on its
//! request; if the client disconnects first, the program is killed. A
//! background `Exec` answers only `Started` and keeps running; its output
//! is kept in the guest, at most [`OUTPUT_BUFFER`] bytes of it, the oldest
//! dropped (and counted) when nobody reads it. `Attach` streams it, first a
//! `Lost` if anything was dropped; while a client is attached the program
//! waits for the client instead of losing output. A program that ended
//! stays listed until `Attach` has delivered its `Exited` or `Wait`
//! collected it. Every program runs in its own cgroup under the sandbox's
//! pids limit; a timeout or `Signal` with SIGKILL ends all of its processes,
//! including ones that left its process group. A program past its
//! `output_max` is killed the same way. The sandbox's programs share one
//! parent cgroup with the lowest CPU weight (where the guest kernel has the
//! cpu controller), so the agent, PID 1 and the kernel's own workers run
//! first whatever the programs do; PID 1 and the agent are exempt from the
//! OOM killer. `KillAll` empties that parent cgroup: a fork bomb that
//! detached from its `Exec` is gone, and the agent never was at risk.
//!
//! A `WriteFile` goes to a temporary file beside the target and is renamed
//! over it only on `FileCommit`, so a reader never sees half a file and a
//! client that disconnects mid-write leaves nothing behind.

pub mod cpio;

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

/// Protocol version; the agent refuses other versions.
pub const VERSION: u32 = 4;
/// The guest vsock port the agent listens on.
pub const AGENT_PORT: u32 = 1024;
/// The host vsock port of the sandbox's egress proxy. The agent listens on
/// guest TCP `127.0.0.1:EGRESS_PROXY_PORT` and carries each connection
/// there; the daemon's proxy decides what may leave the sandbox.
pub const EGRESS_VSOCK_PORT: u32 = 3128;
/// The guest loopback port programs use as their HTTP(S) proxy
/// (`HTTP_PROXY`/`HTTPS_PROXY` point here).
pub const EGRESS_PROXY_PORT: u16 = 3128;
/// The guest vsock port of the port forwarder: the host reaches a TCP port
/// inside the guest through it (see [`port_request`]).
pub const PORTS_VSOCK_PORT: u32 = 1025;
/// Longest line of the port forwarder's handshake, either way.
pub const PORT_LINE_MAX: usize = 256;

/// The line a host sends on a new connection to [`PORTS_VSOCK_PORT`] to
/// be connected to guest TCP port `port` on loopback. The forwarder
/// answers `OK\n` and then carries the connection's bytes both ways, or
/// `ERR <reason>\n` and closes (nothing listens on that port, too many
/// connections are open).
pub fn port_request(port: u16) -> String {
    format!("PORT {port}\n")
}
/// Largest frame accepted, in bytes.
pub const MAX_FRAME: usize = 1 << 20;
/// Most directory entries in one `Entries` frame.
pub const LIST_BATCH: usize = 512;
/// Largest `FileChunk` payload either side sends.
pub const FILE_CHUNK: usize = 256 << 10;
/// Output the guest keeps per program for a client that is not attached.
pub const OUTPUT_BUFFER: usize = 1 << 20;
/// How long the tasks `KillAll` SIGKILLed may take to exit before it fails
/// with a timeout. SIGKILLed tasks exit at the pace the host gives the
/// guest's vCPU: on a loaded emulating (PVM) host the 29 tasks of a fork
/// bomb and a memory hog took over a minute.
pub const KILL_ALL_DRAIN: std::time::Duration = std::time::Duration::from_secs(300);

/// One message with its request id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frame {
    pub id: u64,
    pub body: Body,
}

/// The messages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Body {
    Hello {
        version: u32,
    },
    Ping,
    Pong {
        uptime_ms: u64,
    },
    Health,
    HealthInfo(Health),
    SetClock {
        unix_ns: i64,
    },
    Restored {
        unix_ns: i64,
        hostname: String,
        entropy: Vec<u8>,
        /// The clone's MAC address for its network interface, if it has one.
        mac: Option<[u8; 6]>,
    },
    Exec(ExecRequest),
    Started {
        pid: i32,
    },
    Output {
        stream: Stream,
        data: Vec<u8>,
    },
    Lost {
        bytes: u64,
    },
    Exited(ExitReport),
    Stdin {
        pid: i32,
        data: Vec<u8>,
    },
    StdinClose {
        pid: i32,
    },
    Resize {
        pid: i32,
        rows: u16,
        cols: u16,
    },
    Signal {
        pid: i32,
        signal: i32,
    },
    Processes,
    ProcessList(Vec<ProcessInfo>),
    Attach {
        pid: i32,
    },
    Wait {
        pid: i32,
    },
    ReadFile {
        path: String,
    },
    WriteFile {
        path: String,
        mode: u32,
    },
    FileChunk {
        data: Vec<u8>,
    },
    FileEnd {
        size: u64,
    },
    FileCommit,
    Written {
        size: u64,
    },
    Stat {
        path: String,
    },
    StatInfo(FileStat),
    List {
        path: String,
    },
    Entries {
        entries: Vec<DirEntry>,
        more: bool,
    },
    Mkdir {
        path: String,
    },
    Remove {
        path: String,
        recursive: bool,
    },
    Rename {
        from: String,
        to: String,
    },
    Watch {
        path: String,
        recursive: bool,
    },
    Watching,
    FsEvents(Vec<FsEvent>),
    Cancel,
    Done,
    Error {
        kind: ErrorKind,
        message: String,
    },
    KillAll,
    KilledAll {
        tasks: u64,
    },
    // Added after version 4 shipped: an older agent answers these
    // `Error(Malformed)`, and a client may fall back.
    MkdirAs {
        path: String,
        user: User,
    },
    Chown {
        path: String,
        user: User,
    },
    /// Lays out a tree, streamed as a newc cpio archive in `FileChunk`s
    /// ended by `FileCommit`, under the new directory `dir` (answered
    /// `Written` with the archive's size): a container's root file system.
    Unpack {
        dir: String,
    },
    /// `Exec` with `root` as the program's root directory, in a mount
    /// namespace of its own (the guest's `/proc`, `/dev` and `/sys` mounted
    /// inside): a container's process in a pod's guest.
    ExecIn {
        root: String,
        request: ExecRequest,
    },
    /// Declares the container whose root is `root` before its first
    /// `ExecIn`: its programs together may use at most `memory_max` bytes
    /// (a cgroup of its own); with `own_pids`, they are in a PID namespace
    /// of their own, which its first program makes (else in the guest's,
    /// shared with the pod's other containers). `Done`.
    Container {
        root: String,
        memory_max: Option<u64>,
        own_pids: bool,
    },
    /// Sets the `user.` extended attributes `set` (names without the
    /// prefix) of `path` (not following a final symlink), then answers
    /// all of its `user.` attributes (`UserAttrs`).
    UserAttrs {
        path: String,
        set: Attributes,
    },
    /// The `user.` extended attributes of a path (names without the
    /// prefix, values as text), or of each entry of a directory that has
    /// any (`DirAttrs`).
    Attrs(Attributes),
    /// The entries of directory `path` that have `user.` extended
    /// attributes, with them (`DirAttrs`); at most [`MAX_DIR_ATTRS`]
    /// bytes of them.
    DirUserAttrs {
        path: String,
    },
    DirAttrs(Vec<(String, Attributes)>),
    /// Binds guest directory (or regular file) `source` at `target`
    /// inside the container root `root` (resolved there: a link in the
    /// container's tree cannot lead out of it; missing directories, and a
    /// missing file, are made), read-only with `readonly`: a pod's volume,
    /// or a file such as `/etc/hosts`. Before the container's first
    /// `ExecIn`; removing the container's tree unbinds it (the source
    /// stays). `Done`.
    Mount {
        root: String,
        source: String,
        target: String,
        readonly: bool,
    },
    /// What the declared container rooted at `root` uses now:
    /// `ContainerUsage`.
    ContainerStats {
        root: String,
    },
    /// Sets the limit of the declared container rooted at `root` anew:
    /// its programs together may use `memory_max` bytes (`None`:
    /// unbounded). `Done`.
    ContainerLimits {
        root: String,
        memory_max: Option<u64>,
    },
    ContainerUsage(ContainerUsage),
    /// Sets the CPU limit of the declared container rooted at `root`: its
    /// programs together may run `quota_us` of every `period_us`
    /// microseconds (`None`: unbounded; its cgroup's `cpu.max`). `Done`.
    ContainerCpu {
        root: String,
        quota_us: Option<u64>,
        period_us: u64,
    },
    /// Mounts the ext4 file system on the drive with serial `serial` at
    /// the new directory `root`, read-write (the host keeps the image
    /// unchanged under a copy-on-write overlay): a container's root file
    /// system. The host has just put a medium of `size` bytes in the
    /// drive; the guest learns of it from a configuration change, so the
    /// mount waits (bounded) until the drive has that size, and drops
    /// what it had cached of an earlier medium. Unmounted when a tree it
    /// is in is removed. `Done`.
    MountMedium {
        serial: String,
        size: u64,
        root: String,
    },
    /// Mounts the host directory that virtio-fs device `tag` serves at
    /// `target` (an absolute path, made if missing), nosuid and nodev, and
    /// read-only if `readonly`. `Done`.
    MountShare {
        tag: String,
        target: String,
        readonly: bool,
    },
    /// Configures the guest's network interface (its virtio-net device)
    /// as `NetConfig` says, replacing what it had: a Kubernetes pod's
    /// network, whose interface the host has connected to the guest's.
    /// `Done`.
    Network(NetConfig),
    /// Starts a program in the background and keeps it in the agent's
    /// table with the caller's `tag`, its output in a ring of `ring` bytes
    /// ([`OUTPUT_BUFFER`] if none, clamped to [`MIN_RING`]..=[`MAX_RING`]):
    /// `Started`. Nothing collects it: its output is read with `Follow`
    /// from any offset still kept, as often as wanted, and it stays
    /// listed until `Forget` (or, once it ended, until the table is full).
    Spawn {
        request: ExecRequest,
        tag: Option<String>,
        ring: Option<u32>,
    },
    /// Streams program `pid`'s output from byte `from` of everything it
    /// wrote (stdout and stderr together, in the order written; from an
    /// offset not written yet, output comes once it is): `Replay`,
    /// then `Output`s, then live output, then `Exited` once it has ended
    /// and all was sent. Never slows the program: a reader that falls
    /// behind the ring gets `Lost` for what it missed. Any number of
    /// readers; none collects the program.
    Follow {
        pid: i32,
        from: u64,
    },
    /// The start of a `Follow`: the offset of the first byte to follow,
    /// and how many bytes from the requested offset are no longer kept.
    Replay {
        offset: u64,
        dropped: u64,
    },
    /// The table, with what each program was started with: `Programs`.
    Table,
    Programs(Vec<Program>),
    /// Forgets a program that has ended, and its kept output. `Done`;
    /// `Conflict` while it runs.
    Forget {
        pid: i32,
    },
    /// As `Follow`, but the program waits for this reader as for an
    /// attached client: while the ring holds a full ring of output this
    /// reader has not had, the program's writes wait, so the reader never
    /// gets `Lost` (a client that relays every byte, as E2B's does). The
    /// hold ends with the reader's connection.
    FollowHeld {
        pid: i32,
        from: u64,
    },
    /// Gives the host back what an idle guest can spare: the page cache's
    /// clean pages are dropped and free memory is compacted into the
    /// blocks free page reporting hands to the host (its
    /// `page_reporting_order`). Nothing a program holds is touched.
    /// `Reclaimed`.
    Reclaim,
    /// What `Reclaim` freed: `MemFree` before and after, in KiB.
    Reclaimed {
        free_before_kib: u64,
        free_after_kib: u64,
    },
}

/// Programs the agent keeps at once, running or ended but not collected;
/// a start past it fails with `Limit`.
pub const MAX_PROCESSES: usize = 64;
/// The smallest output ring a `Spawn` may ask for.
pub const MIN_RING: u32 = 4 << 10;
/// The largest output ring a `Spawn` may ask for.
pub const MAX_RING: u32 = 16 << 20;

/// A program in the agent's table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Program {
    pub pid: i32,
    pub argv: Vec<String>,
    /// The caller's tag (`Spawn`).
    pub tag: Option<String>,
    /// Started with `Spawn`: kept until forgotten.
    pub kept: bool,
    pub background: bool,
    /// It runs on a terminal.
    pub terminal: bool,
    /// Its stdin takes `Stdin`.
    pub stdin_open: bool,
    /// When it started, by the guest's clock.
    pub started_unix_ms: u64,
    /// How it ended; `None` while it runs.
    pub end: Option<ProgramEnd>,
    /// The oldest byte of output still kept, and the end of all it wrote.
    pub kept_from: u64,
    pub written: u64,
    /// The size of its output ring.
    pub ring: u64,
}

/// How a program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgramEnd {
    pub report: ExitReport,
    /// Killed at its timeout.
    pub timed_out: bool,
    /// Killed past its `output_max`.
    pub over_limit: bool,
    /// All of its output has been read from its pipes.
    pub output_complete: bool,
}

/// A network interface's configuration: a pod's, as its CNI plugins made
/// it on the host (IPv4; the interface's IPv6 addresses are not carried).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetConfig {
    /// Its MAC address (the pod interface's, which the pod network
    /// expects frames from).
    pub mac: [u8; 6],
    /// Its MTU.
    pub mtu: u32,
    /// Its IPv4 address and prefix length.
    pub addr: ([u8; 4], u8),
    /// Routes through it besides its own subnet's.
    pub routes: Vec<Route>,
}

/// An IPv4 route through the network interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Route {
    /// Destination network and prefix length (`0.0.0.0/0`: the default
    /// route).
    pub dst: ([u8; 4], u8),
    /// The next hop; none: the destination is on the link.
    pub via: Option<[u8; 4]>,
}

/// What a container's programs use together (its cgroup in the guest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerUsage {
    /// Memory charged to it, bytes (none where the guest has no memory
    /// controller).
    pub memory_bytes: Option<u64>,
    /// Its memory limit, bytes.
    pub memory_max: Option<u64>,
    /// CPU time its programs used, microseconds.
    pub cpu_usec: u64,
    /// Its processes and threads.
    pub tasks: u64,
}

/// A path's `user.` extended attributes: (name without the prefix, value).
pub type Attributes = Vec<(String, String)>;

/// The most bytes of names and values a `DirAttrs` answer carries.
pub const MAX_DIR_ATTRS: usize = 512 << 10;

/// The guest's state, for health checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// CLOCK_BOOTTIME, ms.
    pub uptime_ms: u64,
    /// CLOCK_REALTIME, ns since the epoch.
    pub unix_ns: i64,
    pub mem_total_kib: u64,
    pub mem_available_kib: u64,
    /// 1, 5 and 15 minute load averages, in thousandths.
    pub load_milli: [u32; 3],
    /// Processes (and threads) in the guest.
    pub procs: u32,
}

/// A program the agent started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    pub pid: i32,
    pub argv: Vec<String>,
    pub background: bool,
    /// `None` while it runs.
    pub exit: Option<Termination>,
    /// Output held in the guest, not yet delivered.
    pub buffered: u64,
    /// Output dropped so far because the buffer was full.
    pub lost: u64,
}

/// What changed under a watched directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FsEventKind {
    Created,
    Modified,
    /// Written and closed: the writer is done with it.
    Closed,
    Removed,
    MovedFrom,
    MovedTo,
    /// Too many events at once: some were dropped; list the directory again.
    Overflow,
}

/// One change, with the absolute guest path it happened to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsEvent {
    pub kind: FsEventKind,
    pub path: String,
    pub is_dir: bool,
}

/// What a path is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// Metadata of one path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    /// Modification time, seconds since the epoch (guest clock).
    pub mtime_s: i64,
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: String,
    pub stat: FileStat,
}

/// A program to run in the guest.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ExecRequest {
    /// Program and arguments; `argv[0]` is looked up in PATH if it has no `/`.
    pub argv: Vec<String>,
    /// Environment (replaces the agent's); PATH defaults to the usual dirs.
    pub env: Vec<(String, String)>,
    /// Working directory (default `/`).
    pub cwd: Option<String>,
    /// Run as this user and group (default root). Supplementary groups are
    /// cleared.
    pub user: Option<User>,
    /// Bytes written to the program's stdin first.
    pub stdin: Vec<u8>,
    /// Keep stdin open after `stdin` for `Stdin` frames until `StdinClose`;
    /// otherwise it is closed once `stdin` is written.
    pub stdin_open: bool,
    /// Run on a pseudo-terminal of this size (stdin, stdout and stderr are
    /// the terminal; all output comes back as `Stdout`).
    pub pty: Option<WindowSize>,
    /// Wall-clock limit; the program and everything it started are killed
    /// when it passes.
    pub timeout_ms: Option<u64>,
    /// Most processes (and threads) the program may have at once, within
    /// the sandbox-wide limit.
    pub pids_max: Option<u32>,
    /// Keep running after the reply and after the client leaves.
    pub background: bool,
    /// Most bytes of output (stdout and stderr together) the program may
    /// write; past it the program and everything it started are killed and
    /// the request fails with `Limit`.
    pub output_max: Option<u64>,
}

/// A user and group id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct User {
    pub uid: u32,
    pub gid: u32,
}

/// A terminal size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowSize {
    pub rows: u16,
    pub cols: u16,
}

/// Which output stream a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// How a program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Termination {
    Code(i32),
    Signal(i32),
}

/// The end of an `Exec`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitReport {
    pub termination: Termination,
    pub user_us: u64,
    pub system_us: u64,
    pub max_rss_kib: u64,
}

/// Why a request failed, as a kind a client can act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    /// The peers speak different protocol versions.
    VersionMismatch,
    /// The frame did not decode, or came out of order (no handshake).
    Malformed,
    /// The frame was longer than [`MAX_FRAME`].
    TooLarge,
    /// The message is valid but this agent does not handle it.
    Unsupported,
    /// The program, the working directory, the path or the process does
    /// not exist.
    NotFound,
    /// The program exists but may not be executed (or entered).
    PermissionDenied,
    /// The program ran past its timeout and was killed with its process group.
    Timeout,
    /// The request is well formed but cannot be carried out (empty argv...).
    Invalid,
    /// The path already exists, or a directory to remove is not empty.
    Conflict,
    /// A limit was reached: too many connections, requests or processes.
    Limit,
    /// The guest failed for another reason (fork failed, out of memory...).
    Internal,
}

/// Errors reading or writing frames.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("the peer closed the connection")]
    Closed,
    #[error("frame of {0} bytes exceeds the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    #[error("frame does not decode: {0}")]
    Malformed(#[from] postcard::Error),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

/// Writes one frame.
pub fn write_frame<W: Write>(out: &mut W, frame: &Frame) -> Result<(), ProtocolError> {
    write_frame_with(out, frame, &mut Vec::new())
}

/// Writes one frame, encoded in `buf` (cleared first; its capacity kept
/// for the next frame: a writer of many large frames allocates once).
pub fn write_frame_with<W: Write>(
    out: &mut W,
    frame: &Frame,
    buf: &mut Vec<u8>,
) -> Result<(), ProtocolError> {
    buf.clear();
    buf.extend([0u8; 4]);
    let mut bytes = postcard::to_extend(frame, std::mem::take(buf))?;
    let len = bytes.len() - 4;
    if len > MAX_FRAME {
        *buf = bytes;
        return Err(ProtocolError::TooLarge(len));
    }
    bytes[..4].copy_from_slice(&(len as u32).to_le_bytes());
    let written = out.write_all(&bytes).and_then(|()| out.flush());
    *buf = bytes;
    Ok(written?)
}

/// Reads one frame. `Closed` means a clean end between frames.
pub fn read_frame<R: Read>(input: &mut R) -> Result<Frame, ProtocolError> {
    let mut payload = Vec::new();
    read_payload(input, &mut payload)?;
    decode(&payload)
}

/// Reads one frame's payload into `buf` (resized to it; its capacity kept
/// for the next frame: a reader of many large frames allocates once).
/// `Closed` means a clean end between frames.
pub fn read_payload<R: Read>(input: &mut R, buf: &mut Vec<u8>) -> Result<(), ProtocolError> {
    let mut len = [0u8; 4];
    match input.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(ProtocolError::Closed)
        }
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(ProtocolError::TooLarge(len));
    }
    buf.resize(len, 0);
    input.read_exact(buf)?;
    Ok(())
}

/// The frame a payload from [`read_payload`] holds.
pub fn decode(payload: &[u8]) -> Result<Frame, ProtocolError> {
    Ok(postcard::from_bytes(payload)?)
}

/// A `FileChunk` frame as it is encoded: its fields in order, the body's
/// variant index between them, the data borrowed from the payload.
#[derive(Deserialize)]
struct ChunkView<'a> {
    id: u64,
    variant: u32,
    #[serde(borrow)]
    data: &'a [u8],
}

/// The id and data of a payload from [`read_payload`] that holds a
/// `FileChunk`, borrowed from it; `None` for any other frame (decode it).
/// A streamed write takes its chunks this way without copying each one.
pub fn file_chunk(payload: &[u8]) -> Option<(u64, &[u8])> {
    static VARIANT: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    let variant = (*VARIANT.get_or_init(|| {
        let sample = Frame {
            id: 0,
            body: Body::FileChunk { data: Vec::new() },
        };
        let bytes = postcard::to_stdvec(&sample).ok()?;
        postcard::from_bytes::<ChunkView<'_>>(&bytes)
            .ok()
            .map(|v| v.variant)
    }))?;
    match postcard::from_bytes::<ChunkView<'_>>(payload) {
        Ok(view) if view.variant == variant => Some((view.id, view.data)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(frame: &Frame) -> Vec<u8> {
        let mut out = Vec::new();
        write_frame(&mut out, frame).expect("write");
        out
    }

    #[test]
    fn frames_round_trip() {
        let frames = [
            Frame {
                id: 1,
                body: Body::Hello { version: VERSION },
            },
            Frame {
                id: 2,
                body: Body::Ping,
            },
            Frame {
                id: 2,
                body: Body::Pong { uptime_ms: 12345 },
            },
            Frame {
                id: 3,
                body: Body::Error {
                    kind: ErrorKind::Unsupported,
                    message: "no".into(),
                },
            },
            Frame {
                id: 4,
                body: Body::Exec(ExecRequest {
                    argv: vec!["sh".into(), "-c".into(), "true".into()],
                    env: vec![("K".into(), "V".into())],
                    cwd: Some("/tmp".into()),
                    user: Some(User { uid: 1, gid: 2 }),
                    stdin: vec![1, 2, 3],
                    stdin_open: true,
                    pty: Some(WindowSize { rows: 24, cols: 80 }),
                    timeout_ms: Some(5),
                    pids_max: Some(7),
                    background: true,
                    output_max: Some(1 << 20),
                }),
            },
            Frame {
                id: 4,
                body: Body::Started { pid: 42 },
            },
            Frame {
                id: 5,
                body: Body::Lost { bytes: 1 << 40 },
            },
            Frame {
                id: 5,
                body: Body::KilledAll { tasks: 300 },
            },
            Frame {
                id: 6,
                body: Body::Resize {
                    pid: 42,
                    rows: 50,
                    cols: 132,
                },
            },
            Frame {
                id: 7,
                body: Body::ProcessList(vec![ProcessInfo {
                    pid: 42,
                    argv: vec!["yes".into()],
                    background: true,
                    exit: Some(Termination::Signal(9)),
                    buffered: 10,
                    lost: 20,
                }]),
            },
            Frame {
                id: 8,
                body: Body::FsEvents(vec![FsEvent {
                    kind: FsEventKind::MovedTo,
                    path: "/tmp/x".into(),
                    is_dir: true,
                }]),
            },
            Frame {
                id: 9,
                body: Body::HealthInfo(Health {
                    uptime_ms: 1,
                    unix_ns: -2,
                    mem_total_kib: 3,
                    mem_available_kib: 4,
                    load_milli: [5, 6, 7],
                    procs: 8,
                }),
            },
            Frame {
                id: 10,
                body: Body::SetClock { unix_ns: i64::MAX },
            },
        ];
        let bytes: Vec<u8> = frames.iter().flat_map(encoded).collect();

        let mut input = bytes.as_slice();
        let back: Vec<Frame> = (0..frames.len())
            .map(|_| read_frame(&mut input).expect("read"))
            .collect();

        assert_eq!(back, frames);
        assert!(matches!(read_frame(&mut input), Err(ProtocolError::Closed)));
    }

    #[test]
    fn file_chunks_are_read_in_place_and_other_frames_decoded() {
        let chunk = |id, data: &[u8]| Frame {
            id,
            body: Body::FileChunk {
                data: data.to_vec(),
            },
        };
        let frames = [
            chunk(7, b"abc"),
            Frame {
                id: 7,
                body: Body::FileCommit,
            },
            chunk(u64::MAX, &[0xa5; 300]),
            Frame {
                id: 8,
                body: Body::WriteFile {
                    path: "/x".into(),
                    mode: 0o644,
                },
            },
            chunk(9, b""),
        ];
        let mut bytes = Vec::new();
        let mut buf = Vec::new();
        for f in &frames {
            write_frame_with(&mut bytes, f, &mut buf).expect("write");
        }
        assert_eq!(bytes, frames.iter().flat_map(encoded).collect::<Vec<_>>());

        let mut input = bytes.as_slice();
        let mut payload = Vec::new();
        for f in &frames {
            read_payload(&mut input, &mut payload).expect("read");
            let expected = match &f.body {
                Body::FileChunk { data } => Some((f.id, data.as_slice())),
                _ => None,
            };
            assert_eq!(file_chunk(&payload), expected);
            assert_eq!(&decode(&payload).expect("decode"), f);
        }
        assert!(matches!(
            read_payload(&mut input, &mut payload),
            Err(ProtocolError::Closed)
        ));
        // A chunk whose data runs past the payload is not one.
        let mut cut = encoded(&chunk(1, b"abcdef"));
        cut.truncate(cut.len() - 2);
        assert_eq!(file_chunk(&cut[4..]), None);
    }

    #[test]
    fn oversized_frames_are_refused_before_reading_them() {
        let bytes = (MAX_FRAME as u32 + 1).to_le_bytes();

        let err = read_frame(&mut bytes.as_slice()).expect_err("too large");

        assert!(matches!(err, ProtocolError::TooLarge(n) if n == MAX_FRAME + 1));
    }

    #[test]
    fn garbage_and_unknown_messages_are_malformed_but_delimited() {
        let mut bytes = vec![3, 0, 0, 0, 0x01, 0x7f, 0x7f];
        bytes.extend(encoded(&Frame {
            id: 9,
            body: Body::Ping,
        }));
        let mut input = bytes.as_slice();

        let first = read_frame(&mut input);
        let second = read_frame(&mut input).expect("the next frame still reads");

        assert!(matches!(first, Err(ProtocolError::Malformed(_))));
        assert_eq!(
            second,
            Frame {
                id: 9,
                body: Body::Ping
            }
        );
    }

    #[test]
    fn a_frame_cut_short_is_an_io_error() {
        let bytes = encoded(&Frame {
            id: 1,
            body: Body::Pong { uptime_ms: 7 },
        });

        let err = read_frame(&mut &bytes[..bytes.len() - 1]).expect_err("truncated");

        assert!(matches!(err, ProtocolError::Io(_)));
    }
}
