//! husk-agent-client: a typed client of guest-init's agent, reached through the VMM's vsock
//! Unix socket (`CONNECT <port>` protocol). One `AgentClient` is one
//! connection; requests on it are made one at a time (open more
//! connections for more at once), except that a running program's input
//! can be fed from another thread through [`ProgramInput`].

pub mod readiness;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use crate::readiness::WaitBudget;
use husk_protocol::{
    read_frame, write_frame, Body, DirEntry, ErrorKind, ExecRequest, ExitReport, FileStat, Frame,
    FsEvent, Health, ProcessInfo, ProtocolError, Stream, User, AGENT_PORT, FILE_CHUNK, VERSION,
};

/// Longest wait for the guest to accept a connection and shake hands.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);

/// `time` in ns since the Unix epoch, as the agent takes it.
fn unix_ns(time: SystemTime) -> Result<i64, ClientError> {
    let invalid = || std::io::Error::from(std::io::ErrorKind::InvalidInput);
    let since = time
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_err(|_| invalid())?;
    Ok(i64::try_from(since.as_nanos()).map_err(|_| invalid())?)
}

/// Whether `stream` has data (or an end) to read within `within`.
fn readable(stream: &UnixStream, within: Duration) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    let mut fd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(within.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: one valid pollfd for the duration of the call.
    match unsafe { libc::poll(&mut fd, 1, ms) } {
        -1 => {
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::Interrupted => Ok(false),
                _ => Err(e),
            }
        }
        n => Ok(n > 0),
    }
}

/// Errors talking to the agent.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the VMM's vsock socket {0}: {1}")]
    Connect(String, #[source] std::io::Error),
    #[error("the guest did not accept the connection (is guest-init's agent running?): {0}")]
    Refused(String),
    #[error("{0}")]
    VmmGone(String),
    #[error("the agent refused the request ({kind:?}): {message}")]
    Agent { kind: ErrorKind, message: String },
    #[error("unexpected reply: {0:?}")]
    Unexpected(Box<Body>),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// What was sent ahead of the request (see [`Gate`]) was refused:
    /// the request was not answered.
    #[error("the guest was not made ready for use: {0}")]
    NotReady(String),
}

impl ClientError {
    /// The agent's error kind, if the agent refused the request.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            ClientError::Agent { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}

/// What a foreground `exec` produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    pub pid: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Output the guest dropped (only after a reattach, see `attach`).
    pub lost: u64,
    pub report: ExitReport,
}

/// One step of a program's output stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Output(Stream, Vec<u8>),
    /// This many bytes were dropped in the guest while nobody was attached.
    Lost(u64),
    Exited(ExitReport),
}

/// The sending half, shared with [`ProgramInput`] handles.
#[derive(Debug)]
struct Sender {
    stream: Mutex<UnixStream>,
    next_id: AtomicU64,
}

impl Sender {
    fn send(&self, body: Body) -> Result<u64, ClientError> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        self.send_as(id, body)?;
        Ok(id)
    }

    fn send_as(&self, id: u64, body: Body) -> Result<(), ClientError> {
        let mut stream = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        write_frame(&mut *stream, &Frame { id, body })?;
        Ok(())
    }
}

/// Feeds a running program's stdin (or terminal), from any thread. The
/// agent answers these only when they fail; the failure then comes back
/// through the stream of the program's `Running`.
#[derive(Debug, Clone)]
pub struct ProgramInput {
    sender: Arc<Sender>,
    pid: i32,
}

impl ProgramInput {
    /// Sends input (in chunks of at most 64 KiB).
    pub fn write(&self, data: &[u8]) -> Result<(), ClientError> {
        for chunk in data.chunks(64 << 10) {
            self.sender.send(Body::Stdin {
                pid: self.pid,
                data: chunk.to_vec(),
            })?;
        }
        Ok(())
    }

    /// Ends the input (EOF on a pipe; ^D on a terminal).
    pub fn close(&self) -> Result<(), ClientError> {
        self.sender.send(Body::StdinClose { pid: self.pid })?;
        Ok(())
    }

    /// Resizes the program's terminal.
    pub fn resize(&self, rows: u16, cols: u16) -> Result<(), ClientError> {
        self.sender.send(Body::Resize {
            pid: self.pid,
            rows,
            cols,
        })?;
        Ok(())
    }
}

/// A program's output being read by [`AgentClient::follow`].
#[derive(Debug)]
pub struct Following<'a> {
    client: &'a mut AgentClient,
    id: u64,
    /// The offset of the first byte to come.
    pub offset: u64,
    /// Bytes from the offset asked for that are no longer kept.
    pub dropped: u64,
}

impl Following<'_> {
    /// The next output chunk (or bytes missed), or how the program ended.
    pub fn next_event(&mut self) -> Result<Event, ClientError> {
        self.client.event(self.id)
    }

    /// Waits up to `timeout` for the next event to begin arriving; false
    /// if none did (the agent writes each frame whole, so `next_event`
    /// then returns without waiting on the program). A reader uses it to
    /// notice, while a program is silent, that nobody wants its output.
    pub fn wait(&mut self, timeout: Duration) -> Result<bool, ClientError> {
        self.client.wait_readable(timeout)
    }
}

/// A foreground program started by [`AgentClient::start`].
#[derive(Debug)]
pub struct Running<'a> {
    client: &'a mut AgentClient,
    id: u64,
    pub pid: i32,
}

impl Running<'_> {
    /// A handle for the program's input.
    pub fn input(&self) -> ProgramInput {
        ProgramInput {
            sender: self.client.sender.clone(),
            pid: self.pid,
        }
    }

    /// The next output chunk, or how the program ended. A timeout comes
    /// back as `ClientError::Agent { kind: Timeout, .. }`.
    pub fn next_event(&mut self) -> Result<Event, ClientError> {
        self.client.event(self.id)
    }

    /// Bounds each wait for the next event (`None`: for a program that may
    /// be silent for as long as it likes).
    pub fn set_read_timeout(&mut self, timeout: Option<Duration>) -> Result<(), ClientError> {
        self.client.set_read_timeout(timeout)
    }
}

/// A directory watch started by [`AgentClient::watch`].
#[derive(Debug)]
pub struct Watch<'a> {
    client: &'a mut AgentClient,
    id: u64,
}

impl Watch<'_> {
    /// The next batch of changes (waits for one).
    pub fn next_events(&mut self) -> Result<Vec<FsEvent>, ClientError> {
        match self.client.reply(self.id)? {
            Body::FsEvents(events) => Ok(events),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Waits up to `timeout` for the next batch to begin arriving; false
    /// if none did (see [`Following::wait`]).
    pub fn wait(&mut self, timeout: Duration) -> Result<bool, ClientError> {
        self.client.wait_readable(timeout)
    }

    /// Ends the watch; changes reported meanwhile are returned.
    pub fn cancel(self) -> Result<Vec<FsEvent>, ClientError> {
        self.client.sender.send_as(self.id, Body::Cancel)?;
        let mut rest = Vec::new();
        loop {
            match self.client.reply(self.id)? {
                Body::FsEvents(events) => rest.extend(events),
                Body::Done => return Ok(rest),
                other => return Err(ClientError::Unexpected(Box::new(other))),
            }
        }
    }
}

/// What a guest must have done before any request of its users reaches
/// it, shared by every connection to it: its wall clock set after it was
/// woken, and the shared directories of its create mounted.
///
/// A parked clone is handed out as soon as its vCPUs run again and its
/// create's shares are served: its clock, which stood still while it was
/// parked, is set, and the shares are mounted, by the first request that
/// reaches it instead of by round trips of their own. Each connection
/// given the gate ([`AgentClient::carry`]) while it is pending sends
/// `SetClock(now)` and each `MountShare` ahead of its next request; the
/// agent answers them before it reads that request (and a share already
/// mounted at its place is acknowledged again), so nothing runs in the
/// guest on the old clock or without its mounts, and the request's answer
/// is only returned once theirs are read. The first acknowledgement of
/// them all opens the gate; a refusal closes it for good (the request
/// fails with [`ClientError::NotReady`], and so does every later one: the
/// guest is never used with a wrong clock or without its shares).
#[derive(Debug, Default)]
pub struct Gate {
    clock: bool,
    shares: Vec<Share>,
    /// None while pending; then done, or why not.
    outcome: Mutex<Option<Result<(), String>>>,
}

/// A shared directory a [`Gate`] mounts: virtio-fs device `tag` at
/// `target`, read-only if `readonly`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    pub tag: String,
    pub target: String,
    pub readonly: bool,
}

impl Gate {
    /// A gate whose clock is still to be set.
    pub fn clock() -> Arc<Self> {
        Self::new(true, Vec::new())
    }

    /// A gate that sets the clock if `clock` and mounts `shares`.
    pub fn new(clock: bool, shares: Vec<Share>) -> Arc<Self> {
        Arc::new(Gate {
            clock,
            shares,
            outcome: Mutex::default(),
        })
    }

    /// The shares it mounts (to carry on into a new gate).
    pub fn shares(&self) -> &[Share] {
        &self.shares
    }

    fn outcome(&self) -> std::sync::MutexGuard<'_, Option<Result<(), String>>> {
        self.outcome.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the guest has done all of it.
    pub fn is_set(&self) -> bool {
        matches!(*self.outcome(), Some(Ok(())))
    }

    /// Why the guest could not do it, once it could not.
    pub fn failure(&self) -> Option<String> {
        match &*self.outcome() {
            Some(Err(why)) => Some(why.clone()),
            _ => None,
        }
    }

    fn acknowledged(&self) {
        self.outcome().get_or_insert(Ok(()));
    }

    fn refused(&self, why: &str) {
        *self.outcome() = Some(Err(why.to_owned()));
    }

    /// What goes ahead of a request (the clock's time is taken now).
    fn preludes(&self) -> Result<Vec<Body>, ClientError> {
        let mut out = Vec::with_capacity(self.shares.len() + 1);
        if self.clock {
            let unix_ns = unix_ns(SystemTime::now())?;
            out.push(Body::SetClock { unix_ns });
        }
        out.extend(self.shares.iter().map(|s| Body::MountShare {
            tag: s.tag.clone(),
            target: s.target.clone(),
            readonly: s.readonly,
        }));
        Ok(out)
    }
}

/// The gate a connection carries: to go ahead of its next request, or
/// sent (the request ids) and the answers not read yet.
#[derive(Debug)]
enum Carried {
    ToSend(Arc<Gate>),
    Sent(Vec<u64>, Arc<Gate>),
}

/// A connection to the agent of one VM.
#[derive(Debug)]
pub struct AgentClient {
    reader: BufReader<UnixStream>,
    sender: Arc<Sender>,
    gate: Option<Carried>,
    /// Whatever its holder ties to its being in use (see `set_lease`).
    lease: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl AgentClient {
    /// Connects through the VMM's vsock socket `uds` and shakes hands.
    /// `timeout` bounds each read (see `set_read_timeout`).
    pub fn connect(uds: &Path, timeout: Duration) -> Result<Self, ClientError> {
        let stream = UnixStream::connect(uds)
            .map_err(|e| ClientError::Connect(uds.display().to_string(), e))?;
        // A guest that does not answer the connection at all (no agent, a
        // stopped guest) fails fast; requests then get `timeout`.
        let handshake = timeout.min(HANDSHAKE_TIMEOUT);
        Self::handshake(stream, timeout, |stream| {
            stream.set_read_timeout(Some(handshake))?;
            Ok(true)
        })
    }

    /// Sends `CONNECT`, reads the VMM's `OK`, then exchanges `Hello`;
    /// `ready(stream)` is asked before each read whether to go on waiting
    /// (it sets the read timeout, or returns false to give up).
    fn handshake(
        mut stream: UnixStream,
        timeout: Duration,
        mut ready: impl FnMut(&UnixStream) -> Result<bool, ClientError>,
    ) -> Result<Self, ClientError> {
        let unanswered = || ClientError::Io(std::io::ErrorKind::TimedOut.into());
        stream.write_all(format!("CONNECT {AGENT_PORT}\n").as_bytes())?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut line = String::new();
        if !ready(&stream)? {
            return Err(unanswered());
        }
        reader.read_line(&mut line)?;
        if !line.starts_with("OK ") {
            return Err(ClientError::Refused(line.trim().to_owned()));
        }
        let mut client = AgentClient {
            reader,
            sender: Arc::new(Sender {
                stream: Mutex::new(stream),
                next_id: AtomicU64::new(1),
            }),
            gate: None,
            lease: None,
        };
        let id = client.send(Body::Hello { version: VERSION })?;
        if !ready(client.reader.get_ref())? {
            return Err(unanswered());
        }
        match client.reply(id)? {
            Body::Hello { version: VERSION } => {
                client.set_read_timeout(Some(timeout))?;
                Ok(client)
            }
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Connects once the agent answers, waiting up to `budget` (seconds on
    /// a quiet host, stretched by the host's load: see [`WaitBudget`]).
    /// See [`AgentClient::connect_patiently`].
    pub fn connect_when_ready(
        uds: &Path,
        budget: Duration,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        Self::connect_patiently(uds, &mut WaitBudget::new(budget), &mut || Ok(()), timeout)
    }

    /// Connects once the agent answers, for a guest that is booting (no
    /// socket yet, then no listener: the guest resets the connection) or
    /// restoring (the VMM holds the connection until the guest has handled
    /// its transport reset). A connection the guest has not refused is not
    /// abandoned while it is young: each one is given twice the patience
    /// of the one before (from 2 s), so a slow guest finishes a handshake
    /// it has started instead of being handed a new one. Refusals are
    /// retried with a backoff that grows from 1 ms (a restore's socket
    /// appears within milliseconds) to half a second. `alive` is
    /// asked at every wake-up (e.g. whether the VMM still runs); its error
    /// ends the wait. Gives up when `wait` expires.
    pub fn connect_patiently(
        uds: &Path,
        wait: &mut WaitBudget,
        alive: &mut dyn FnMut() -> Result<(), ClientError>,
        timeout: Duration,
    ) -> Result<Self, ClientError> {
        /// How often a waiting handshake wakes to check `alive` and `wait`.
        const TICK: Duration = Duration::from_millis(250);
        let mut patience = Duration::from_secs(2);
        let mut backoff = Duration::from_millis(1);
        loop {
            alive()?;
            let failure = match UnixStream::connect(uds) {
                Err(e) => ClientError::Connect(uds.display().to_string(), e),
                Ok(stream) => {
                    let started = std::time::Instant::now();
                    let attempt = Self::handshake(stream, timeout, |stream| {
                        while !readable(stream, TICK)? {
                            alive()?;
                            if wait.expired() || started.elapsed() >= patience {
                                return Ok(false);
                            }
                        }
                        // The answer has begun: read it whole.
                        stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
                        Ok(true)
                    });
                    match attempt {
                        Ok(client) => return Ok(client),
                        // A version mismatch will not go away, nor a VMM
                        // that has exited.
                        Err(e @ (ClientError::Unexpected(_) | ClientError::VmmGone(_))) => {
                            return Err(e)
                        }
                        Err(e) => {
                            if started.elapsed() >= patience {
                                tracing::debug!(
                                    "no answer in {patience:?} from the agent at {}; \
                                     trying a new connection",
                                    uds.display()
                                );
                                patience *= 2;
                            }
                            e
                        }
                    }
                }
            };
            if wait.expired() {
                return Err(failure);
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    /// Ties `lease` to this connection: it is dropped with the connection,
    /// or when replaced (None drops it now). A host uses it to know which
    /// sandboxes have requests in flight.
    pub fn set_lease(&mut self, lease: Option<Arc<dyn std::any::Any + Send + Sync>>) {
        self.lease = lease;
    }

    /// Bounds each read from the agent (`None`: wait for ever, e.g. for a
    /// silent program that has its own timeout).
    pub fn set_read_timeout(&mut self, timeout: Option<Duration>) -> Result<(), ClientError> {
        self.reader.get_ref().set_read_timeout(timeout)?;
        Ok(())
    }

    /// Makes the next request on this connection carry what `gate` asks
    /// of the guest ahead of it while `gate` is pending (see [`Gate`]).
    pub fn carry(&mut self, gate: Arc<Gate>) -> Result<(), ClientError> {
        if let Some(why) = gate.failure() {
            return Err(ClientError::NotReady(why));
        }
        if !gate.is_set() {
            self.gate = Some(Carried::ToSend(gate));
        }
        Ok(())
    }

    /// Waits up to `timeout` for a frame to begin arriving (buffered, or
    /// readable on the socket); false if none did.
    fn wait_readable(&self, timeout: Duration) -> Result<bool, ClientError> {
        if !self.reader.buffer().is_empty() {
            return Ok(true);
        }
        let mut pfd = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(self.reader.get_ref()),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        match unsafe { libc::poll(&mut pfd, 1, ms) } {
            n if n < 0 => {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    Ok(false)
                } else {
                    Err(e.into())
                }
            }
            n => Ok(n > 0),
        }
    }

    /// Whether the peer closed this connection (checked without waiting:
    /// for a connection kept while its guest was parked).
    pub fn is_closed(&self) -> bool {
        let mut byte = 0u8;
        // SAFETY: a one-byte peek into a live buffer; MSG_DONTWAIT never
        // blocks.
        let n = unsafe {
            libc::recv(
                std::os::fd::AsRawFd::as_raw_fd(self.reader.get_ref()),
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        n == 0
            || (n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock)
    }

    fn send(&mut self, body: Body) -> Result<u64, ClientError> {
        if let Some(Carried::ToSend(gate)) = self.gate.take() {
            if !gate.is_set() {
                let ids = gate
                    .preludes()?
                    .into_iter()
                    .map(|prelude| self.sender.send(prelude))
                    .collect::<Result<Vec<u64>, ClientError>>()?;
                self.gate = Some(Carried::Sent(ids, gate));
            }
        }
        self.sender.send(body)
    }

    /// Reads the answers to what was sent ahead of a request, if they are
    /// due: they come before anything of the request's.
    fn gate_answers(&mut self) -> Result<(), ClientError> {
        let Some(Carried::Sent(ids, gate)) = self.gate.take() else {
            return Ok(());
        };
        for id in ids {
            let why = match read_frame(&mut self.reader) {
                Ok(Frame {
                    id: got,
                    body: Body::Done,
                }) if got == id => continue,
                Ok(Frame {
                    body: Body::Error { message, .. },
                    ..
                }) => message,
                Ok(other) => format!("unexpected answer {:?}", other.body),
                // The connection failed, not the guest: another connection
                // may still get it done.
                Err(e) => return Err(ClientError::NotReady(e.to_string())),
            };
            gate.refused(&why);
            return Err(ClientError::NotReady(why));
        }
        gate.acknowledged();
        Ok(())
    }

    /// Reads the next frame of request `id`; an agent error ends the request.
    fn reply(&mut self, id: u64) -> Result<Body, ClientError> {
        self.gate_answers()?;
        let frame = read_frame(&mut self.reader)?;
        match frame.body {
            Body::Error { kind, message } => Err(ClientError::Agent { kind, message }),
            body if frame.id == id => Ok(body),
            body => Err(ClientError::Unexpected(Box::new(body))),
        }
    }

    /// Sends one request and waits for its single reply.
    fn call(&mut self, body: Body) -> Result<Body, ClientError> {
        let id = self.send(body)?;
        self.reply(id)
    }

    fn expect_done(&mut self, body: Body) -> Result<(), ClientError> {
        match self.call(body)? {
            Body::Done => Ok(()),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    fn event(&mut self, id: u64) -> Result<Event, ClientError> {
        match self.reply(id)? {
            Body::Output { stream, data } => Ok(Event::Output(stream, data)),
            Body::Lost { bytes } => Ok(Event::Lost(bytes)),
            Body::Exited(report) => Ok(Event::Exited(report)),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Checks the agent is alive; returns the guest's uptime in ms.
    pub fn ping(&mut self) -> Result<u64, ClientError> {
        match self.call(Body::Ping)? {
            Body::Pong { uptime_ms } => Ok(uptime_ms),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// The guest's clocks, memory, load and process count.
    pub fn health(&mut self) -> Result<Health, ClientError> {
        match self.call(Body::Health)? {
            Body::HealthInfo(health) => Ok(health),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Asks the guest to give memory back (`Body::Reclaim`): the page
    /// cache dropped, free memory compacted for free page reporting.
    /// Returns its free memory before and after, in KiB.
    pub fn reclaim(&mut self) -> Result<(u64, u64), ClientError> {
        match self.call(Body::Reclaim)? {
            Body::Reclaimed {
                free_before_kib,
                free_after_kib,
            } => Ok((free_before_kib, free_after_kib)),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Sets the guest's wall clock.
    pub fn set_clock(&mut self, time: SystemTime) -> Result<(), ClientError> {
        let unix_ns = unix_ns(time)?;
        self.expect_done(Body::SetClock { unix_ns })
    }

    /// A clone's post-restore step: sets its wall clock to now, gives it
    /// `hostname`, and fresh randomness from the host, so clones of one
    /// snapshot share neither time, name nor random state.
    pub fn restored(&mut self, hostname: &str, mac: Option<[u8; 6]>) -> Result<(), ClientError> {
        let mut entropy = vec![0u8; 64];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut entropy)?;
        let unix_ns = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i64);
        self.expect_done(Body::Restored {
            unix_ns,
            hostname: hostname.to_owned(),
            entropy,
            mac,
        })
    }

    /// Starts a foreground program; read its output with `next_event`.
    /// The program is killed if this connection closes before it ends.
    pub fn start(&mut self, req: ExecRequest) -> Result<Running<'_>, ClientError> {
        let req = ExecRequest {
            background: false,
            ..req
        };
        self.started(Body::Exec(req))
    }

    /// Starts a foreground program with `root` as its root directory in a
    /// mount namespace of its own (a container of a pod); read its output
    /// with `next_event`.
    pub fn start_in(&mut self, root: &str, req: ExecRequest) -> Result<Running<'_>, ClientError> {
        let request = ExecRequest {
            background: false,
            ..req
        };
        self.started(Body::ExecIn {
            root: root.to_owned(),
            request,
        })
    }

    /// Sends an `Exec` or `ExecIn`; the program, once the agent says it
    /// started.
    fn started(&mut self, exec: Body) -> Result<Running<'_>, ClientError> {
        let id = self.send(exec)?;
        match self.reply(id)? {
            Body::Started { pid } => Ok(Running {
                client: self,
                id,
                pid,
            }),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Runs a program, calling `on_output` for each chunk as it comes.
    pub fn exec_streaming(
        &mut self,
        req: ExecRequest,
        mut on_output: impl FnMut(Stream, &[u8]),
    ) -> Result<ExitReport, ClientError> {
        let mut running = self.start(req)?;
        loop {
            match running.next_event()? {
                Event::Output(stream, data) => on_output(stream, &data),
                Event::Lost(_) => {}
                Event::Exited(report) => return Ok(report),
            }
        }
    }

    /// Runs a program in the guest and collects its output. Output is kept
    /// in memory here: bound it with `timeout_ms`, or use `exec_streaming`.
    pub fn exec(&mut self, req: ExecRequest) -> Result<ExecOutput, ClientError> {
        let mut running = self.start(req)?;
        let pid = running.pid;
        Self::collect(pid, || running.next_event())
    }

    fn collect(
        pid: i32,
        mut next: impl FnMut() -> Result<Event, ClientError>,
    ) -> Result<ExecOutput, ClientError> {
        let (mut stdout, mut stderr, mut lost) = (Vec::new(), Vec::new(), 0);
        loop {
            match next()? {
                Event::Output(Stream::Stdout, data) => stdout.extend(data),
                Event::Output(Stream::Stderr, data) => stderr.extend(data),
                Event::Lost(bytes) => lost += bytes,
                Event::Exited(report) => {
                    return Ok(ExecOutput {
                        pid,
                        stdout,
                        stderr,
                        lost,
                        report,
                    })
                }
            }
        }
    }

    /// Starts a background program; returns its pid. It keeps running when
    /// this connection closes; its output waits in the guest for `attach`.
    pub fn spawn(&mut self, req: ExecRequest) -> Result<i32, ClientError> {
        let req = ExecRequest {
            background: true,
            ..req
        };
        match self.call(Body::Exec(req))? {
            Body::Started { pid } => Ok(pid),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Attaches to a background program: its buffered output, then live
    /// output until it ends (the program is then collected).
    pub fn attach(&mut self, pid: i32) -> Result<ExecOutput, ClientError> {
        let id = self.send(Body::Attach { pid })?;
        Self::collect(pid, || self.event(id))
    }

    /// Like `attach`, calling `on_event` for each chunk as it comes.
    pub fn attach_streaming(
        &mut self,
        pid: i32,
        mut on_event: impl FnMut(&Event),
    ) -> Result<ExitReport, ClientError> {
        let id = self.send(Body::Attach { pid })?;
        loop {
            let event = self.event(id)?;
            on_event(&event);
            if let Event::Exited(report) = event {
                return Ok(report);
            }
        }
    }

    /// Starts a background program kept in the agent's table with `tag`
    /// and an output ring of `ring` bytes (the agent's default if none);
    /// returns its pid. Read its output with `follow`; `forget` it once it
    /// ended.
    pub fn spawn_kept(
        &mut self,
        req: ExecRequest,
        tag: Option<String>,
        ring: Option<u32>,
    ) -> Result<i32, ClientError> {
        let request = ExecRequest {
            background: true,
            ..req
        };
        match self.call(Body::Spawn { request, tag, ring })? {
            Body::Started { pid } => Ok(pid),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Reads program `pid`'s output from byte `from` of all it wrote: the
    /// reader knows where it starts; its events are the output kept from
    /// there on, then live output, then how the program ended (a timeout
    /// or the output limit: `ClientError::Agent { kind: Timeout | Limit }`).
    /// Nothing is collected. A reader stopped early leaves the request
    /// running: drop the connection. With `hold`, the program waits for
    /// this reader rather than lose output it has not read (`FollowHeld`).
    pub fn follow(
        &mut self,
        pid: i32,
        from: u64,
        hold: bool,
    ) -> Result<Following<'_>, ClientError> {
        let id = self.send(match hold {
            true => Body::FollowHeld { pid, from },
            false => Body::Follow { pid, from },
        })?;
        match self.reply(id)? {
            Body::Replay { offset, dropped } => Ok(Following {
                client: self,
                id,
                offset,
                dropped,
            }),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Every program in the agent's table, with how it was started.
    pub fn programs(&mut self) -> Result<Vec<husk_protocol::Program>, ClientError> {
        match self.call(Body::Table)? {
            Body::Programs(list) => Ok(list),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Forgets an ended program and its kept output.
    pub fn forget(&mut self, pid: i32) -> Result<(), ClientError> {
        self.expect_done(Body::Forget { pid })
    }

    /// Waits for a background program to end and collects it (its
    /// remaining output is discarded).
    pub fn wait(&mut self, pid: i32) -> Result<ExitReport, ClientError> {
        match self.call(Body::Wait { pid })? {
            Body::Exited(report) => Ok(report),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Sends `signal` to a program's process group (SIGKILL: to everything
    /// it started).
    pub fn signal(&mut self, pid: i32, signal: i32) -> Result<(), ClientError> {
        self.expect_done(Body::Signal { pid, signal })
    }

    /// SIGKILLs everything the sandbox's user started (every program and
    /// what it left behind, detached or not) and returns once it is gone,
    /// with how many tasks there were. The agent keeps running. The reply
    /// is awaited for as long as the agent lets the tasks take to exit
    /// ([`husk_protocol::KILL_ALL_DRAIN`]) and a minute more.
    pub fn kill_all(&mut self) -> Result<u64, ClientError> {
        let previous = self.reader.get_ref().read_timeout()?;
        let patience = husk_protocol::KILL_ALL_DRAIN + Duration::from_secs(60);
        self.set_read_timeout(previous.map(|p| p.max(patience)))?;
        let reply = self.call(Body::KillAll);
        self.set_read_timeout(previous)?;
        match reply? {
            Body::KilledAll { tasks } => Ok(tasks),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Programs the agent started that were not collected yet.
    pub fn processes(&mut self) -> Result<Vec<ProcessInfo>, ClientError> {
        match self.call(Body::Processes)? {
            Body::ProcessList(list) => Ok(list),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Input for any program started with `stdin_open` (or a PTY), by pid.
    pub fn input(&self, pid: i32) -> ProgramInput {
        ProgramInput {
            sender: self.sender.clone(),
            pid,
        }
    }

    /// Watches a guest directory (and, if `recursive`, all below it).
    /// Changes made after this returns are reported.
    pub fn watch(&mut self, path: &str, recursive: bool) -> Result<Watch<'_>, ClientError> {
        let id = self.send(Body::Watch {
            path: path.to_owned(),
            recursive,
        })?;
        match self.reply(id)? {
            Body::Watching => Ok(Watch { client: self, id }),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Writes `content` to `path` in the guest with permission bits `mode`.
    /// The file appears whole or not at all (temporary file + rename).
    pub fn write_file(
        &mut self,
        path: &str,
        mode: u32,
        mut content: impl Read,
    ) -> Result<u64, ClientError> {
        let id = self.send(Body::WriteFile {
            path: path.to_owned(),
            mode,
        })?;
        let mut buf = vec![0u8; FILE_CHUNK];
        loop {
            let n = content.read(&mut buf)?;
            if n == 0 {
                break;
            }
            let data = buf[..n].to_vec();
            self.sender.send_as(id, Body::FileChunk { data })?;
        }
        self.sender.send_as(id, Body::FileCommit)?;
        match self.reply(id)? {
            Body::Written { size } => Ok(size),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Copies the host tree `tree` (owners, modes, links) to the new guest
    /// directory `dir`, as a cpio stream, with host `files` put in at their
    /// names (see [`husk_protocol::cpio::write_tree_with`]); returns the
    /// stream's size.
    pub fn unpack(
        &mut self,
        dir: &str,
        tree: &std::path::Path,
        files: &[(String, std::path::PathBuf)],
    ) -> Result<u64, ClientError> {
        self.unpack_archive(dir, |chunks| {
            husk_protocol::cpio::write_tree_with(tree, files, chunks)
        })
    }

    /// Lays out host `files` (each with its name below `dir`, relative)
    /// under the new guest directory `dir`; returns the archive's size.
    pub fn unpack_files(
        &mut self,
        dir: &str,
        files: &[(String, std::path::PathBuf)],
    ) -> Result<u64, ClientError> {
        self.unpack_archive(dir, |chunks| {
            husk_protocol::cpio::write_files(files, chunks)
        })
    }

    /// `Unpack` of the archive `write` streams, under the new guest
    /// directory `dir`.
    fn unpack_archive(
        &mut self,
        dir: &str,
        write: impl for<'a> FnOnce(Chunks<'a>) -> std::io::Result<Chunks<'a>>,
    ) -> Result<u64, ClientError> {
        let id = self.send(Body::Unpack {
            dir: dir.to_owned(),
        })?;
        let chunks = Chunks {
            sender: &self.sender,
            id,
            buf: Vec::with_capacity(FILE_CHUNK),
        };
        write(chunks)?;
        self.sender.send_as(id, Body::FileCommit)?;
        match self.reply(id)? {
            Body::Written { size } => Ok(size),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Declares the container rooted at guest directory `root` before its
    /// first program: its programs together may use at most `memory_max`
    /// bytes; with `own_pids` they have a PID namespace of their own.
    pub fn container(
        &mut self,
        root: &str,
        memory_max: Option<u64>,
        own_pids: bool,
    ) -> Result<(), ClientError> {
        self.expect_done(Body::Container {
            root: root.to_owned(),
            memory_max,
            own_pids,
        })
    }

    /// Sets the memory limit of the declared container rooted at `root`
    /// anew (bytes; `None`: unbounded).
    pub fn container_memory_max(
        &mut self,
        root: &str,
        memory_max: Option<u64>,
    ) -> Result<(), ClientError> {
        self.expect_done(Body::ContainerLimits {
            root: root.to_owned(),
            memory_max,
        })
    }

    /// Sets the CPU limit of the declared container rooted at `root`:
    /// `quota_us` of CPU time in every `period_us` microseconds (`None`:
    /// unbounded).
    pub fn container_cpu_max(
        &mut self,
        root: &str,
        quota_us: Option<u64>,
        period_us: u64,
    ) -> Result<(), ClientError> {
        self.expect_done(Body::ContainerCpu {
            root: root.to_owned(),
            quota_us,
            period_us,
        })
    }

    /// Binds guest directory (or regular file) `source` at `target`
    /// inside the container root `root` (resolved there), read-only with
    /// `readonly`: a pod's volume or one of the CRI's files, before the
    /// container's first program.
    pub fn mount(
        &mut self,
        root: &str,
        source: &str,
        target: &str,
        readonly: bool,
    ) -> Result<(), ClientError> {
        self.expect_done(Body::Mount {
            root: root.to_owned(),
            source: source.to_owned(),
            target: target.to_owned(),
            readonly,
        })
    }

    /// Mounts the ext4 file system on the drive with serial `serial`, to
    /// which the host has just given a medium of `size` bytes, at the new
    /// guest directory `root` (a container's root file system).
    pub fn mount_medium(&mut self, serial: &str, size: u64, root: &str) -> Result<(), ClientError> {
        self.expect_done(Body::MountMedium {
            serial: serial.to_owned(),
            size,
            root: root.to_owned(),
        })
    }

    /// Mounts the host directory virtio-fs device `tag` serves at guest
    /// directory `target` (made if missing), read-only if `readonly`.
    pub fn mount_share(
        &mut self,
        tag: &str,
        target: &str,
        readonly: bool,
    ) -> Result<(), ClientError> {
        self.expect_done(Body::MountShare {
            tag: tag.to_owned(),
            target: target.to_owned(),
            readonly,
        })
    }

    /// Gives the guest's network interface `config` (a pod's network),
    /// replacing what it had.
    pub fn configure_network(
        &mut self,
        config: &husk_protocol::NetConfig,
    ) -> Result<(), ClientError> {
        self.expect_done(Body::Network(config.clone()))
    }

    /// What the declared container rooted at guest directory `root` uses
    /// now.
    pub fn container_stats(
        &mut self,
        root: &str,
    ) -> Result<husk_protocol::ContainerUsage, ClientError> {
        match self.call(Body::ContainerStats {
            root: root.to_owned(),
        })? {
            Body::ContainerUsage(usage) => Ok(usage),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Sets the `user.` extended attributes `set` (names without the
    /// prefix) of guest path `path`, then returns all of them.
    pub fn user_attrs(
        &mut self,
        path: &str,
        set: &[(String, String)],
    ) -> Result<husk_protocol::Attributes, ClientError> {
        match self.call(Body::UserAttrs {
            path: path.to_owned(),
            set: set.to_vec(),
        })? {
            Body::Attrs(attrs) => Ok(attrs),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// The entries of guest directory `path` that have `user.` extended
    /// attributes, with them.
    pub fn dir_user_attrs(
        &mut self,
        path: &str,
    ) -> Result<Vec<(String, husk_protocol::Attributes)>, ClientError> {
        match self.call(Body::DirUserAttrs {
            path: path.to_owned(),
        })? {
            Body::DirAttrs(entries) => Ok(entries),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// Streams the guest file `path` into `sink`; returns its size.
    pub fn read_file(&mut self, path: &str, mut sink: impl Write) -> Result<u64, ClientError> {
        let id = self.send(Body::ReadFile {
            path: path.to_owned(),
        })?;
        loop {
            match self.reply(id)? {
                Body::FileChunk { data } => sink.write_all(&data)?,
                Body::FileEnd { size } => return Ok(size),
                other => return Err(ClientError::Unexpected(Box::new(other))),
            }
        }
    }

    /// Metadata of a guest path (a final symlink is not followed).
    pub fn stat(&mut self, path: &str) -> Result<FileStat, ClientError> {
        match self.call(Body::Stat {
            path: path.to_owned(),
        })? {
            Body::StatInfo(stat) => Ok(stat),
            other => Err(ClientError::Unexpected(Box::new(other))),
        }
    }

    /// The entries of a guest directory.
    pub fn list(&mut self, path: &str) -> Result<Vec<DirEntry>, ClientError> {
        let id = self.send(Body::List {
            path: path.to_owned(),
        })?;
        let mut all = Vec::new();
        loop {
            match self.reply(id)? {
                Body::Entries { entries, more } => {
                    all.extend(entries);
                    if !more {
                        return Ok(all);
                    }
                }
                other => return Err(ClientError::Unexpected(Box::new(other))),
            }
        }
    }

    /// `mkdir -p` in the guest.
    pub fn mkdir(&mut self, path: &str) -> Result<(), ClientError> {
        self.expect_done(Body::Mkdir {
            path: path.to_owned(),
        })
    }

    /// `mkdir -p` in the guest, the directories it creates owned by `user`.
    pub fn mkdir_as(&mut self, path: &str, user: User) -> Result<(), ClientError> {
        self.expect_done(Body::MkdirAs {
            path: path.to_owned(),
            user,
        })
    }

    /// Gives a file, directory or link (not what it points to) to `user`.
    pub fn chown(&mut self, path: &str, user: User) -> Result<(), ClientError> {
        self.expect_done(Body::Chown {
            path: path.to_owned(),
            user,
        })
    }

    /// Removes a file, an empty directory, or (with `recursive`) a tree.
    pub fn remove(&mut self, path: &str, recursive: bool) -> Result<(), ClientError> {
        self.expect_done(Body::Remove {
            path: path.to_owned(),
            recursive,
        })
    }

    /// Renames within the guest.
    pub fn rename(&mut self, from: &str, to: &str) -> Result<(), ClientError> {
        self.expect_done(Body::Rename {
            from: from.to_owned(),
            to: to.to_owned(),
        })
    }

    /// Sends raw bytes, for tests that must misbehave on purpose.
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        let mut stream = self.sender.stream.lock().unwrap_or_else(|e| e.into_inner());
        stream.write_all(bytes)?;
        Ok(())
    }

    /// Reads the next frame whatever it is, for tests.
    pub fn read_raw(&mut self) -> Result<Frame, ClientError> {
        Ok(read_frame(&mut self.reader)?)
    }
}

/// A `Write` that sends what it is given as `FileChunk`s of request `id`.
struct Chunks<'a> {
    sender: &'a Sender,
    id: u64,
    buf: Vec<u8>,
}

impl Write for Chunks<'_> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let n = data.len().min(FILE_CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == FILE_CHUNK {
            self.flush()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if !self.buf.is_empty() {
            let data = std::mem::replace(&mut self.buf, Vec::with_capacity(FILE_CHUNK));
            self.sender
                .send_as(self.id, Body::FileChunk { data })
                .map_err(|e| std::io::Error::other(e.to_string()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client connected to a scripted agent: `agent` gets the agent's
    /// end after the VMM's `OK` and the `Hello` exchange.
    fn scripted(
        agent: impl FnOnce(&mut BufReader<UnixStream>, &mut UnixStream) + Send + 'static,
    ) -> AgentClient {
        let (ours, theirs) = UnixStream::pair().expect("socketpair");
        std::thread::spawn(move || {
            let mut out = theirs.try_clone().expect("clone");
            let mut input = BufReader::new(theirs);
            let mut line = String::new();
            input.read_line(&mut line).expect("CONNECT");
            out.write_all(b"OK 1\n").expect("OK");
            let hello = read_frame(&mut input).expect("hello");
            write_frame(&mut out, &hello).expect("hello back");
            agent(&mut input, &mut out);
        });
        AgentClient::handshake(ours, Duration::from_secs(10), |_| Ok(true)).expect("handshake")
    }

    fn answer_with(out: &mut UnixStream, id: u64, body: Body) {
        write_frame(out, &Frame { id, body }).expect("answer");
    }

    #[test]
    fn the_clock_goes_ahead_of_the_first_request_only_and_is_answered_first() {
        let (seen_tx, seen_rx) = std::sync::mpsc::channel();
        let mut client = scripted(move |input, out| {
            for _ in 0..3 {
                let frame = read_frame(input).expect("frame");
                let answer = match &frame.body {
                    Body::SetClock { .. } => Body::Done,
                    _ => Body::Pong { uptime_ms: 7 },
                };
                seen_tx.send(frame.body.clone()).expect("seen");
                answer_with(out, frame.id, answer);
            }
        });
        let gate = Gate::clock();
        client.carry(gate.clone()).expect("pending gate");
        let before = unix_ns(SystemTime::now()).expect("now");

        assert_eq!(client.ping().expect("ping"), 7);
        assert!(gate.is_set());
        client.carry(gate.clone()).expect("set gate");
        assert_eq!(client.ping().expect("second ping"), 7);

        let seen: Vec<Body> = seen_rx.try_iter().collect();
        assert!(
            matches!(seen[0], Body::SetClock { unix_ns } if unix_ns >= before),
            "{seen:?}"
        );
        assert!(matches!(seen[1..], [Body::Ping, Body::Ping]), "{seen:?}");
    }

    #[test]
    fn a_refused_clock_fails_the_request_and_every_later_one() {
        let mut client = scripted(|input, out| {
            let clock = read_frame(input).expect("clock");
            let _ping = read_frame(input).expect("ping");
            let refusal = Body::Error {
                kind: ErrorKind::Invalid,
                message: "no clock for you".into(),
            };
            answer_with(out, clock.id, refusal);
        });
        let gate = Gate::clock();
        client.carry(gate.clone()).expect("pending gate");

        let err = client.ping().expect_err("the clock was refused");

        assert!(
            matches!(&err, ClientError::NotReady(m) if m.contains("no clock for you")),
            "{err}"
        );
        assert_eq!(gate.failure().as_deref(), Some("no clock for you"));
        assert!(matches!(client.carry(gate), Err(ClientError::NotReady(_))));
    }

    fn share(tag: &str, target: &str) -> Share {
        Share {
            tag: tag.into(),
            target: target.into(),
            readonly: false,
        }
    }

    #[test]
    fn shares_are_mounted_after_the_clock_and_before_the_request() {
        let (seen_tx, seen_rx) = std::sync::mpsc::channel();
        let mut client = scripted(move |input, out| {
            for _ in 0..4 {
                let frame = read_frame(input).expect("frame");
                let answer = match &frame.body {
                    Body::Ping => Body::Pong { uptime_ms: 7 },
                    _ => Body::Done,
                };
                seen_tx.send(frame.body.clone()).expect("seen");
                answer_with(out, frame.id, answer);
            }
        });
        let gate = Gate::new(true, vec![share("fs0", "/mnt/a"), share("fs1", "/mnt/b")]);
        client.carry(gate.clone()).expect("pending gate");

        assert_eq!(client.ping().expect("ping"), 7);

        assert!(gate.is_set());
        let seen: Vec<Body> = seen_rx.try_iter().collect();
        assert!(
            matches!(
                &seen[..],
                [
                    Body::SetClock { .. },
                    Body::MountShare { tag: a, .. },
                    Body::MountShare { tag: b, .. },
                    Body::Ping
                ] if a == "fs0" && b == "fs1"
            ),
            "{seen:?}"
        );
    }

    #[test]
    fn a_refused_mount_fails_the_request_and_closes_the_gate() {
        let mut client = scripted(|input, out| {
            let mount = read_frame(input).expect("mount");
            let _ping = read_frame(input).expect("ping");
            let refusal = Body::Error {
                kind: ErrorKind::Invalid,
                message: "mounting shared directory \"fs0\" at /proc/x: no".into(),
            };
            answer_with(out, mount.id, refusal);
        });
        let gate = Gate::new(false, vec![share("fs0", "/proc/x")]);
        client.carry(gate.clone()).expect("pending gate");

        let err = client.ping().expect_err("the mount was refused");

        assert!(
            matches!(&err, ClientError::NotReady(m) if m.contains("/proc/x")),
            "{err}"
        );
        assert!(gate.failure().is_some_and(|m| m.contains("fs0")));
    }
}
