//! One process of a task, run in the guest by its agent: the task's own
//! (the OCI process) or an exec's. containerd's FIFOs are bridged to it:
//! stdin is forwarded as it comes, output is written to the stdout and
//! stderr FIFOs (a terminal's all to stdout) before the exit is recorded,
//! so a client that sees the exit has seen all the output.
//!
//! Each process has its own agent connection; the agent kills a program
//! whose connection closes, so a shim that dies takes its workload with it.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use husk_protocol::{ExecRequest, Stream, Termination};

use super::ShimError;
use husk_agent_client::{AgentClient, Event, ProgramInput};

/// Bounds a request to the agent (not a program's run).
const AGENT_TIMEOUT: Duration = Duration::from_secs(120);

/// containerd's FIFOs for a process (empty: none).
#[derive(Debug, Clone, Default)]
pub struct Stdio {
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
    pub terminal: bool,
}

impl Stdio {
    /// A request's FIFOs (a task's or an exec's).
    pub fn of(stdin: &str, stdout: &str, stderr: &str, terminal: bool) -> Stdio {
        Stdio {
            stdin: stdin.to_owned(),
            stdout: stdout.to_owned(),
            stderr: stderr.to_owned(),
            terminal,
        }
    }
}

/// How a process ended: its status as a shell reports it (128 + the
/// signal for a killed one) and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    pub status: u32,
    pub at: SystemTime,
}

/// Called once a process has ended and its output is written: its pid (0
/// if it never started) and exit.
pub type OnExit = Box<dyn FnOnce(i32, Exit) + Send>;

#[derive(Debug)]
enum Phase {
    Created,
    Running {
        pid: i32,
        input: ProgramInput,
    },
    /// A pod's pause process: nothing runs; it holds until signalled.
    Holding,
    Exited {
        pid: i32,
        exit: Exit,
    },
}

/// Where a process runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// In the guest's own root file system.
    Guest,
    /// In a pod's container: this guest directory is its root.
    Container(String),
    /// Nowhere: a pod's sandbox (pause) container, which holds the pod
    /// until it is signalled and costs no guest process.
    Holder,
}

/// A process of a task.
pub struct GuestProcess {
    request: ExecRequest,
    place: Place,
    pub stdio: Stdio,
    phase: Mutex<Phase>,
    ended: Condvar,
    on_exit: Mutex<Option<OnExit>>,
}

impl std::fmt::Debug for GuestProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestProcess")
            .field("argv", &self.request.argv)
            .field("phase", &*self.lock())
            .finish()
    }
}

/// The status a shell gives a program that ended this way.
pub fn status_of(termination: Termination) -> u32 {
    match termination {
        Termination::Code(c) => c as u32,
        Termination::Signal(s) => 128 + s as u32,
    }
}

impl GuestProcess {
    pub fn new(request: ExecRequest, place: Place, stdio: Stdio, on_exit: OnExit) -> Arc<Self> {
        Arc::new(GuestProcess {
            request,
            place,
            stdio,
            phase: Mutex::new(Phase::Created),
            ended: Condvar::new(),
            on_exit: Mutex::new(Some(on_exit)),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Its guest pid once started (0 before).
    pub fn pid(&self) -> i32 {
        match *self.lock() {
            Phase::Created | Phase::Holding => 0,
            Phase::Running { pid, .. } | Phase::Exited { pid, .. } => pid,
        }
    }

    /// Whether it has started, and how it ended.
    pub fn state(&self) -> (bool, Option<Exit>) {
        match *self.lock() {
            Phase::Created => (false, None),
            Phase::Running { .. } | Phase::Holding => (true, None),
            Phase::Exited { exit, .. } => (true, Some(exit)),
        }
    }

    /// Starts it through the agent socket `agent`; returns its guest pid.
    pub fn start(self: &Arc<Self>, agent: &Path) -> Result<i32, ShimError> {
        if !matches!(*self.lock(), Phase::Created) {
            return Err(ShimError::Conflict(
                "the process was already started".into(),
            ));
        }
        if self.place == Place::Holder {
            *self.lock() = Phase::Holding;
            return Ok(0);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let me = self.clone();
        let agent = agent.to_owned();
        std::thread::Builder::new()
            .name("guest-process".into())
            .spawn(move || me.run(&agent, tx))
            .map_err(|e| ShimError::Io("a thread".into(), e))?;
        rx.recv()
            .map_err(|_| ShimError::Agent("the process's thread ended early".into()))?
    }

    /// The process's life, on its own thread: start, bridge, record the end.
    fn run(&self, agent: &Path, started: std::sync::mpsc::Sender<Result<i32, ShimError>>) {
        let mut client = match AgentClient::connect(agent, AGENT_TIMEOUT) {
            Ok(c) => c,
            Err(e) => return drop(started.send(Err(e.into()))),
        };
        let started_in = match &self.place {
            Place::Container(root) => client.start_in(root, self.request.clone()),
            _ => client.start(self.request.clone()),
        };
        let mut running = match started_in {
            Ok(r) => r,
            Err(e) => return drop(started.send(Err(e.into()))),
        };
        // The program may be silent for as long as it likes.
        let _ = running.set_read_timeout(None);
        let pid = running.pid;
        let input = running.input();
        // Opened before the first output is read, so none is lost.
        let mut stdout = open_output(&self.stdio.stdout);
        let mut stderr = if self.stdio.terminal {
            None
        } else {
            open_output(&self.stdio.stderr)
        };
        *self.lock() = Phase::Running {
            pid,
            input: input.clone(),
        };
        if !self.stdio.stdin.is_empty() {
            let path = PathBuf::from(&self.stdio.stdin);
            let _ = std::thread::Builder::new()
                .name("guest-stdin".into())
                .spawn(move || forward_stdin(&path, &input));
        } else {
            let _ = input.close();
        }
        let _ = started.send(Ok(pid));
        let status = loop {
            match running.next_event() {
                Ok(Event::Output(Stream::Stdout, data)) => write_output(&mut stdout, &data),
                Ok(Event::Output(Stream::Stderr, data)) => write_output(&mut stderr, &data),
                Ok(Event::Lost(bytes)) => {
                    tracing::warn!(pid, bytes, "output lost in the guest")
                }
                Ok(Event::Exited(report)) => break status_of(report.termination),
                Err(e) => {
                    // The VM is gone (destroyed, or its VMM died).
                    tracing::warn!(pid, "lost the process: {e}");
                    break 255;
                }
            }
        };
        drop((stdout, stderr));
        self.finish(pid, status);
    }

    /// Records the end (once) and tells the waiters and `on_exit`.
    fn finish(&self, pid: i32, status: u32) {
        let exit = Exit {
            status,
            at: SystemTime::now(),
        };
        {
            let mut phase = self.lock();
            if matches!(*phase, Phase::Exited { .. }) {
                return;
            }
            *phase = Phase::Exited { pid, exit };
        }
        self.ended.notify_all();
        let on_exit = self
            .on_exit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(f) = on_exit {
            f(pid, exit);
        }
    }

    /// Waits for it to end.
    pub fn wait(&self) -> Exit {
        let mut phase = self.lock();
        loop {
            if let Phase::Exited { exit, .. } = *phase {
                return exit;
            }
            phase = self.ended.wait(phase).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Sends `signal` to it (its process group). A process that never
    /// started ends there, as killed by the signal.
    pub fn signal(&self, agent: &Path, signal: u32) -> Result<(), ShimError> {
        let pid = match *self.lock() {
            // A holder ends at any signal, as the pause program does at
            // the ones it is sent.
            Phase::Created | Phase::Holding => None,
            Phase::Running { pid, .. } => Some(pid),
            Phase::Exited { .. } => {
                return Err(ShimError::NotFound("the process has already exited".into()))
            }
        };
        match pid {
            None => {
                self.finish(0, 128 + signal);
                Ok(())
            }
            Some(pid) => {
                let signal = i32::try_from(signal)
                    .map_err(|_| ShimError::Invalid(format!("no signal {signal}")))?;
                AgentClient::connect(agent, AGENT_TIMEOUT)?.signal(pid, signal)?;
                Ok(())
            }
        }
    }

    /// Resizes its terminal.
    pub fn resize(&self, rows: u16, cols: u16) -> Result<(), ShimError> {
        match &*self.lock() {
            Phase::Running { input, .. } => Ok(input.resize(rows, cols)?),
            _ => Err(ShimError::NotFound("the process is not running".into())),
        }
    }

    /// Ends its input (EOF).
    pub fn close_stdin(&self) -> Result<(), ShimError> {
        match &*self.lock() {
            Phase::Running { input, .. } => Ok(input.close()?),
            _ => Ok(()),
        }
    }
}

/// Opens where output goes: a `file://` log URI (appended to), or a
/// FIFO's writing end if a reader has it open (a detached client has none:
/// its output is dropped), for blocking writes.
fn open_output(path: &str) -> Option<File> {
    if path.is_empty() {
        return None;
    }
    if let Some(file) = path.strip_prefix("file://") {
        return std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(file)
            .map_err(|e| tracing::warn!("log file {file}: {e}"))
            .ok();
    }
    let file = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path);
    match file {
        Ok(f) => {
            use std::os::fd::AsRawFd;
            let _ = nix::fcntl::fcntl(
                f.as_raw_fd(),
                nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
            );
            Some(f)
        }
        Err(e) => {
            tracing::info!("output to {path} is dropped: {e}");
            None
        }
    }
}

/// Writes output; a reader that went away stops the writing, not the process.
fn write_output(out: &mut Option<File>, data: &[u8]) {
    if let Some(f) = out {
        if let Err(e) = f.write_all(data) {
            tracing::info!("an output reader went away: {e}");
            *out = None;
        }
    }
}

/// Forwards a stdin FIFO to the program until EOF, then closes its input.
fn forward_stdin(path: &Path, input: &ProgramInput) {
    let mut fifo = match File::open(path) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!("stdin {}: {e}", path.display());
            let _ = input.close();
            return;
        }
    };
    let mut buf = vec![0u8; 32 << 10];
    loop {
        match fifo.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if input.write(&buf[..n]).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = input.close();
}
