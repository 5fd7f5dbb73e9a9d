//! A sandbox's programs, one model for every front-end: started in the
//! background, listed, read from any byte offset of their output (what
//! the guest kept, then live), written to, signalled, resized, removed.
//!
//! The guest's agent keeps the table and each program's output ring
//! (`husk_protocol::Body::Spawn`), so programs and what they wrote outlive
//! any client, a pause, a hibernation and the daemon itself: nothing here
//! holds state between calls.

use base64::Engine as _;
use husk_agent_client::Event;
use husk_protocol::{Program, Stream, Termination};
use husk_types::{ProcessEvent, ProcessExit, ProcessInfo, ProcessSpec};

use super::*;

/// How [`Daemon::read_process`] reads a program's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    /// What is kept, to its end now.
    Kept,
    /// What is kept, then what comes, until the program ends; a reader
    /// that falls behind the ring is told what it lost.
    Follow,
    /// As `Follow`, but the program waits for this reader rather than
    /// lose output it has not read (a front-end that must relay every
    /// byte, as E2B's protocol has no word for lost output).
    Held,
}

impl Daemon {
    /// Starts `spec` in sandbox `id` in the background, for `who`.
    pub fn start_process(
        &self,
        id: &str,
        who: &str,
        spec: ProcessSpec,
    ) -> Result<ProcessInfo, DaemonError> {
        let Some(program) = spec.argv.first() else {
            return Err(DaemonError::Invalid(
                "`argv` is empty: name the program to run".into(),
            ));
        };
        if spec.tag.as_ref().is_some_and(|t| t.len() > 256) {
            return Err(DaemonError::Invalid(
                "`tag` is longer than 256 bytes".into(),
            ));
        }
        if let Some(keep) = spec.keep_bytes {
            let (min, max) = (husk_protocol::MIN_RING, husk_protocol::MAX_RING);
            if !(min..=max).contains(&keep) {
                return Err(DaemonError::Invalid(format!(
                    "`keep_bytes` {keep} is outside {min}..={max}"
                )));
            }
        }
        let mut agent = self.agent_for(id, who, "process-start", &spec.argv.join(" "))?;
        let running = agent
            .programs()
            .map_err(older_agent)?
            .iter()
            .filter(|p| p.kept && p.end.is_none())
            .count();
        let max = self.cfg.max_processes as usize;
        if running >= max {
            return Err(DaemonError::Limit(format!(
                "{running} background programs run in sandbox {id} already, its limit \
                 (the daemon's --max-processes {max}): wait for or kill one"
            )));
        }
        let req = husk_protocol::ExecRequest {
            argv: spec.argv.clone(),
            env: spec.env.into_iter().collect(),
            cwd: spec.cwd,
            user: spec.user,
            // A terminal's input is always open (keys go through it).
            stdin_open: spec.stdin || spec.terminal.is_some(),
            pty: spec.terminal.map(|t| husk_protocol::WindowSize {
                rows: t.rows.clamp(1, 1000),
                cols: t.cols.clamp(1, 1000),
            }),
            timeout_ms: spec.timeout_ms,
            pids_max: spec.pids_max,
            output_max: spec.output_max,
            background: true,
            ..Default::default()
        };
        let pid = agent
            .spawn_kept(req, spec.tag, spec.keep_bytes)
            .map_err(|e| started_error(program, e))?;
        let found = agent.programs()?.into_iter().find(|p| p.pid == pid);
        self.give_back(id, agent);
        found.map(info).ok_or_else(|| {
            DaemonError::Failed(format!("pid {pid} left the agent's table as it started"))
        })
    }

    /// The programs of sandbox `id`, by pid.
    pub fn processes(&self, id: &str) -> Result<Vec<ProcessInfo>, DaemonError> {
        let mut agent = self.agent(id)?;
        let list = agent.programs().map_err(older_agent)?;
        self.give_back(id, agent);
        Ok(list.into_iter().map(info).collect())
    }

    /// Program `pid` of sandbox `id`.
    pub fn process(&self, id: &str, pid: i32) -> Result<ProcessInfo, DaemonError> {
        self.program(id, pid).map(info)
    }

    fn program(&self, id: &str, pid: i32) -> Result<Program, DaemonError> {
        let mut agent = self.agent(id)?;
        let program = program_on(&mut agent, id, pid)?;
        self.give_back(id, agent);
        Ok(program)
    }

    /// Program `pid`'s output from byte `from`: `on_event` gets a `Replay`,
    /// the output kept from there on, then (following, see [`Reading`])
    /// what comes, and the `Exit` once it ended; reading what is kept, a
    /// `Caught` at the end of what was there if it still runs. Returns when
    /// it ended, when `on_event` answers false, or, while the program is
    /// silent, within a second of `wanted` answering false (a client that
    /// went away).
    pub fn read_process(
        &self,
        id: &str,
        pid: i32,
        (from, how): (u64, Reading),
        mut on_event: impl FnMut(ProcessOutput) -> bool,
        wanted: impl Fn() -> bool,
    ) -> Result<(), DaemonError> {
        let mut agent = self.agent(id)?;
        let program = program_on(&mut agent, id, pid)?;
        // Where a reader that does not follow stops.
        let until = (how == Reading::Kept && program.end.is_none()).then_some(program.written);
        // Nothing bounds how long a program takes to write.
        agent.set_read_timeout(None)?;
        let hold = how == Reading::Held;
        let mut reader = agent.follow(pid, from, hold).map_err(|e| match e.kind() {
            Some(husk_protocol::ErrorKind::NotFound) => no_program(id, pid),
            _ => older_agent(e),
        })?;
        let mut at = reader.offset;
        if !on_event(ProcessOutput::Replay {
            offset: at,
            dropped: reader.dropped,
        }) {
            return Ok(());
        }
        loop {
            if let Some(u) = until.filter(|u| at >= *u) {
                // The agent's stream is cut with the connection.
                on_event(ProcessOutput::Caught { offset: u });
                return Ok(());
            }
            // Silent: is anyone still reading? (The agent's stream is
            // cut with the connection.)
            while !reader.wait(Duration::from_secs(1))? {
                if !wanted() {
                    return Ok(());
                }
            }
            let line = match reader.next_event() {
                Ok(Event::Output(stream, data)) => {
                    let offset = at;
                    at += data.len() as u64;
                    ProcessOutput::Data {
                        offset,
                        stream,
                        data,
                    }
                }
                Ok(Event::Lost(bytes)) => {
                    let offset = at;
                    at += bytes;
                    ProcessOutput::Lost { offset, bytes }
                }
                Ok(Event::Exited(report)) => {
                    self.give_back(id, agent);
                    on_event(self.exit_event(id, pid, at, Some(report.termination)));
                    return Ok(());
                }
                // Killed at its timeout or past its output limit: the end
                // of its stream is the agent's error.
                Err(e)
                    if matches!(
                        e.kind(),
                        Some(husk_protocol::ErrorKind::Timeout | husk_protocol::ErrorKind::Limit)
                    ) =>
                {
                    on_event(self.exit_event(id, pid, at, None));
                    return Ok(());
                }
                Err(e) => return Err(e.into()),
            };
            if !on_event(line) {
                return Ok(());
            }
        }
    }

    /// How program `pid` ended, by the agent's table (`seen`: the end its
    /// stream reported, if the table no longer has it), as the event after
    /// its last byte (a reader from past its end stops at its end).
    fn exit_event(&self, id: &str, pid: i32, at: u64, seen: Option<Termination>) -> ProcessOutput {
        let program = self.program(id, pid).ok();
        let offset = program.as_ref().map_or(at, |p| at.min(p.written));
        let exit = match program.and_then(|p| p.end) {
            Some(end) => ProcessExit {
                timed_out: end.timed_out,
                over_limit: end.over_limit,
                ..exit_of(end.report.termination)
            },
            None => exit_of(seen.unwrap_or(Termination::Signal(libc::SIGKILL))),
        };
        ProcessOutput::Exit { offset, exit }
    }

    /// Program `pid`'s input on an agent connection of its own, for a
    /// terminal's keys and resizes: each is sent without waiting for the
    /// guest (a failure ends the program's input, which its reader sees).
    pub fn process_input(&self, id: &str, pid: i32) -> Result<ProcessInput, DaemonError> {
        let mut agent = self.agent(id)?;
        let program = program_on(&mut agent, id, pid)?;
        takes_input(&program)?;
        Ok(ProcessInput {
            input: agent.input(pid),
            terminal: program.terminal,
            _agent: agent,
        })
    }

    /// Writes `data` to program `pid`'s stdin; with `close`, then ends it.
    pub fn write_process_stdin(
        &self,
        id: &str,
        pid: i32,
        data: &[u8],
        close: bool,
    ) -> Result<(), DaemonError> {
        let mut agent = self.agent(id)?;
        takes_input(&program_on(&mut agent, id, pid)?)?;
        let input = agent.input(pid);
        for chunk in data.chunks(32 << 10) {
            input.write(chunk)?;
        }
        if close {
            input.close()?;
        }
        // The agent answers input only when it fails: a ping after it
        // brings any failure back, in order.
        agent.ping()?;
        self.give_back(id, agent);
        Ok(())
    }

    /// Sends `signal` to program `pid`'s process group (SIGKILL: to all
    /// it started).
    pub fn signal_process(
        &self,
        id: &str,
        who: &str,
        pid: i32,
        signal: i32,
    ) -> Result<(), DaemonError> {
        let mut agent = self.agent(id)?;
        running(&program_on(&mut agent, id, pid)?)?;
        self.audit(who, "process-signal", id, &format!("{pid} {signal}"))?;
        agent.signal(pid, signal)?;
        self.give_back(id, agent);
        Ok(())
    }

    /// Resizes program `pid`'s terminal.
    pub fn resize_process(
        &self,
        id: &str,
        pid: i32,
        rows: u16,
        cols: u16,
    ) -> Result<(), DaemonError> {
        let mut agent = self.agent(id)?;
        let program = program_on(&mut agent, id, pid)?;
        if !program.terminal {
            return Err(DaemonError::Invalid(format!(
                "pid {pid} has no terminal to resize (start it with `terminal`)"
            )));
        }
        running(&program)?;
        agent
            .input(pid)
            .resize(rows.clamp(1, 1000), cols.clamp(1, 1000))?;
        agent.ping()?;
        self.give_back(id, agent);
        Ok(())
    }

    /// Removes ended program `pid` and its kept output from the table.
    pub fn remove_process(&self, id: &str, pid: i32) -> Result<(), DaemonError> {
        let mut agent = self.agent(id)?;
        match agent.forget(pid) {
            Ok(()) => {}
            Err(e) if e.kind() == Some(husk_protocol::ErrorKind::NotFound) => {
                return Err(no_program(id, pid))
            }
            Err(e) => return Err(older_agent(e)),
        }
        self.give_back(id, agent);
        Ok(())
    }
}

/// A program's input on a connection of its own ([`Daemon::process_input`]).
#[derive(Debug)]
pub struct ProcessInput {
    input: husk_agent_client::ProgramInput,
    terminal: bool,
    /// The connection (a use of the sandbox while the input is held).
    _agent: AgentClient,
}

impl ProcessInput {
    /// Sends `data` to the program's stdin.
    pub fn write(&self, data: &[u8]) -> Result<(), DaemonError> {
        Ok(self.input.write(data)?)
    }

    /// Resizes the program's terminal.
    pub fn resize(&self, rows: u16, cols: u16) -> Result<(), DaemonError> {
        if !self.terminal {
            return Err(DaemonError::Invalid(
                "the program has no terminal to resize".into(),
            ));
        }
        Ok(self
            .input
            .resize(rows.clamp(1, 1000), cols.clamp(1, 1000))?)
    }

    /// Ends the program's input (^D on a terminal).
    pub fn close(&self) -> Result<(), DaemonError> {
        Ok(self.input.close()?)
    }
}

/// A program's output as husk-core reads it, the bytes themselves
/// ([`ProcessOutput::event`] is its wire form).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessOutput {
    /// Where reading starts.
    Replay {
        /// Offset of the next byte.
        offset: u64,
        /// Bytes asked for that are no longer kept.
        dropped: u64,
    },
    /// Output.
    Data {
        /// Offset of its first byte.
        offset: u64,
        /// Which stream it was written to.
        stream: Stream,
        /// The bytes.
        data: Vec<u8>,
    },
    /// Bytes that went before the reader had them.
    Lost {
        /// Offset of the first one.
        offset: u64,
        /// How many.
        bytes: u64,
    },
    /// The end of what was written, for a reader that does not follow.
    Caught {
        /// Offset of the next byte to come.
        offset: u64,
    },
    /// How the program ended, after its last byte.
    Exit {
        /// Offset after its last byte.
        offset: u64,
        /// How it ended.
        exit: ProcessExit,
    },
}

impl ProcessOutput {
    /// The event as the API sends it (output in base64).
    pub fn event(&self) -> ProcessEvent {
        let b64 = |d: &[u8]| base64::engine::general_purpose::STANDARD.encode(d);
        match self {
            ProcessOutput::Replay { offset, dropped } => ProcessEvent::Replay {
                offset: *offset,
                dropped: *dropped,
            },
            ProcessOutput::Data {
                offset,
                stream: Stream::Stdout,
                data,
            } => ProcessEvent::Stdout {
                offset: *offset,
                data: b64(data),
            },
            ProcessOutput::Data {
                offset,
                stream: Stream::Stderr,
                data,
            } => ProcessEvent::Stderr {
                offset: *offset,
                data: b64(data),
            },
            ProcessOutput::Lost { offset, bytes } => ProcessEvent::Lost {
                offset: *offset,
                bytes: *bytes,
            },
            ProcessOutput::Caught { offset } => ProcessEvent::Caught { offset: *offset },
            ProcessOutput::Exit { offset, exit } => ProcessEvent::Exit {
                offset: *offset,
                exit: exit.clone(),
            },
        }
    }
}

/// Program `pid` of sandbox `id` by the table of `agent`, a connection to it.
fn program_on(agent: &mut AgentClient, id: &str, pid: i32) -> Result<Program, DaemonError> {
    agent
        .programs()
        .map_err(older_agent)?
        .into_iter()
        .find(|p| p.pid == pid)
        .ok_or_else(|| no_program(id, pid))
}

/// Refuses a program that has exited.
fn running(p: &Program) -> Result<(), DaemonError> {
    match p.end {
        Some(_) => Err(DaemonError::Conflict(format!(
            "pid {} has exited already",
            p.pid
        ))),
        None => Ok(()),
    }
}

/// Refuses a program whose stdin takes nothing more.
fn takes_input(p: &Program) -> Result<(), DaemonError> {
    let pid = p.pid;
    if p.end.is_some() {
        return Err(DaemonError::Conflict(format!(
            "pid {pid} has exited: its stdin is gone"
        )));
    }
    if !p.stdin_open {
        return Err(DaemonError::Conflict(format!(
            "pid {pid}'s stdin is closed (or was never open: start it with `stdin: true`)"
        )));
    }
    Ok(())
}

fn no_program(id: &str, pid: i32) -> DaemonError {
    DaemonError::NotFound(format!("no program with pid {pid} in sandbox {id}"))
}

/// An agent too old for the process table answers `Malformed`.
fn older_agent(e: ClientError) -> DaemonError {
    if e.kind() == Some(husk_protocol::ErrorKind::Malformed) {
        return DaemonError::Unavailable(format!(
            "this sandbox's agent has no process table (its template was built with an older \
             guest-init; rebuild the template): {e}"
        ));
    }
    e.into()
}

fn started_error(program: &str, e: ClientError) -> DaemonError {
    match e.kind() {
        Some(husk_protocol::ErrorKind::Limit) => {
            DaemonError::Limit(format!("cannot start {program}: {e}"))
        }
        _ => older_agent(e),
    }
}

fn exit_of(t: Termination) -> ProcessExit {
    let (code, signal) = match t {
        Termination::Code(c) => (Some(c), None),
        Termination::Signal(s) => (None, Some(s)),
    };
    ProcessExit {
        code,
        signal,
        timed_out: false,
        over_limit: false,
    }
}

fn info(p: Program) -> ProcessInfo {
    ProcessInfo {
        pid: p.pid,
        argv: p.argv,
        tag: p.tag,
        state: if p.end.is_some() { "exited" } else { "running" }.into(),
        terminal: p.terminal,
        stdin_open: p.stdin_open,
        started_unix_ms: p.started_unix_ms,
        exit: p.end.map(|e| ProcessExit {
            timed_out: e.timed_out,
            over_limit: e.over_limit,
            ..exit_of(e.report.termination)
        }),
        kept_from: p.kept_from,
        written: p.written,
        keep_bytes: p.ring,
        kept: p.kept,
    }
}
