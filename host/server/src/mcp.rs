//! The Model Context Protocol, so an agent reaches sandboxes as tools: on
//! stdio (`husk mcp`) and over streamable HTTP at the daemon's `/mcp`.
//!
//! The protocol (JSON-RPC, version negotiation, both transports, HTTP
//! sessions) is the official Rust SDK's, `rmcp`; this module is the tools:
//! create a sandbox from a template, run a command, read, write and list
//! files, destroy the sandbox. They reach sandboxes through a [`Backend`]:
//! the daemon's `/mcp` calls `husk-core` in process ([`InProcess`], which
//! keeps a [`Sandbox`] handle, and so an agent connection, per sandbox and
//! audits each call as `mcp <session> (<peer>)`); `husk mcp` drives a
//! daemon through its API.
//!
//! One client (one `husk mcp` process, one HTTP session) has limits of its
//! own ([`Limits`]): how many sandboxes it holds at once, how many calls it
//! makes, how long a command may run and how much output it returns. A
//! client reaches only the sandboxes it created (labelled `mcp=<session>`),
//! and they are destroyed when it goes (its stdin ends, its HTTP session is
//! deleted or idle for [`HTTP_IDLE`]). A refused call is a tool error
//! (`isError`) that says what was refused and why, which an agent can act
//! on; an unknown tool is a JSON-RPC error.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ErrorData,
    Implementation, InitializeResult, JsonObject, ListToolsResult, PaginatedRequestParams,
    ProtocolVersion, ServerCapabilities, Tool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{RoleServer, ServerHandler, ServiceExt};
use serde_json::{json, Value};

use husk_core::daemon::{Daemon, DaemonError, Reading};
use husk_core::sandbox::Sandbox;
use husk_protocol::{DirEntry, ErrorKind, FileKind, Stream, Termination};
use husk_types::{CreateRequest, ExecSpec, ProcessEvent, ProcessExit, ProcessSpec};

use crate::peer::Peer;

/// Largest message a client may send.
const MAX_MESSAGE: usize = 8 << 20;
/// Calls running at once in one session.
const MAX_IN_FLIGHT: usize = 16;
/// Sessions the daemon's `/mcp` holds open at once.
pub const MAX_HTTP_SESSIONS: usize = 64;
/// A session unused this long is closed (its sandboxes destroyed).
pub const HTTP_IDLE: Duration = Duration::from_secs(3600);

/// What one client may do.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Sandboxes held at once.
    pub sandboxes: usize,
    /// Tool calls in the session.
    pub calls: u64,
    /// Longest a command may run, in seconds.
    pub command_s: u64,
    /// Most bytes of output (stdout and stderr together) or of a file
    /// returned by one call.
    pub output: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            sandboxes: 4,
            calls: 1000,
            command_s: 300,
            output: 1 << 20,
        }
    }
}

/// A tool's failure, shown to the agent as it is.
#[derive(Debug)]
pub struct Refusal(pub String);

impl<E: std::fmt::Display> From<E> for Refusal {
    fn from(e: E) -> Self {
        Refusal(e.to_string())
    }
}

/// How a command ended that did not exit: the agent's error kind (a
/// timeout, an output limit) and its message.
pub type ExecFailure = (Option<ErrorKind>, String);

/// How the tools reach sandboxes. Calls block (the tools run them off the
/// async runtime); `who` is the caller the audit log should name.
pub trait Backend: Send + Sync + 'static {
    /// Creates a sandbox as `req` says; its id.
    fn create(&self, req: CreateRequest, who: &str) -> Result<String, Refusal>;
    /// Runs `spec` in sandbox `id`, handing its output to `output` as it
    /// comes.
    fn exec(
        &self,
        id: &str,
        spec: ExecSpec,
        output: &mut dyn FnMut(Stream, &[u8]),
    ) -> Result<Termination, ExecFailure>;
    /// The file `path`, refused (with [`too_long`]) past `max` bytes.
    fn read(&self, id: &str, path: &str, max: u64) -> Result<Vec<u8>, Refusal>;
    /// Writes the file `path` whole.
    fn write(&self, id: &str, path: &str, data: &[u8]) -> Result<(), Refusal>;
    /// The entries of the directory `path`.
    fn list(&self, id: &str, path: &str) -> Result<Vec<DirEntry>, Refusal>;
    /// Destroys sandbox `id`.
    fn destroy(&self, id: &str) -> Result<(), Refusal>;
    /// Starts `spec` in the background in sandbox `id`; its pid.
    fn start(&self, id: &str, spec: ProcessSpec, who: &str) -> Result<i32, Refusal>;
    /// Program `pid`'s output from offset `from`, as far as it was
    /// written, at most `max` bytes of it.
    fn output(&self, id: &str, pid: i32, from: u64, max: u64) -> Result<CommandOutput, Refusal>;
    /// Writes `data` to program `pid`'s stdin; with `close`, then ends it.
    fn input(&self, id: &str, pid: i32, data: &[u8], close: bool) -> Result<(), Refusal>;
    /// Sends `signal` to program `pid`.
    fn signal(&self, id: &str, pid: i32, signal: i32, who: &str) -> Result<(), Refusal>;
}

/// What a background command wrote, read from an offset.
#[derive(Debug, Default)]
pub struct CommandOutput {
    /// Bytes from the offset asked for that the guest no longer keeps.
    pub dropped: u64,
    /// Where `data` starts.
    pub offset: u64,
    /// Its output (stdout and stderr as written).
    pub data: Vec<u8>,
    /// Bytes that went before they were read, within `data`'s range.
    pub lost: u64,
    /// How it ended, once it has and all its output was read.
    pub exit: Option<ProcessExit>,
    /// More output is kept than `max` allowed in one call.
    pub more: bool,
}

impl CommandOutput {
    /// Takes one event of a program's output stream; false once this call
    /// has what it can return.
    pub fn take(&mut self, event: ProcessEvent, max: u64) -> bool {
        match event {
            ProcessEvent::Replay { offset, dropped } => {
                self.offset = offset;
                self.dropped = dropped;
            }
            ProcessEvent::Stdout { data, .. } | ProcessEvent::Stderr { data, .. } => {
                use base64::Engine as _;
                let data = base64::engine::general_purpose::STANDARD
                    .decode(data)
                    .unwrap_or_default();
                let room = max.saturating_sub(self.data.len() as u64) as usize;
                self.more = data.len() > room;
                self.data.extend_from_slice(&data[..data.len().min(room)]);
                return !self.more;
            }
            ProcessEvent::Lost { bytes, .. } => self.lost += bytes,
            ProcessEvent::Exit { exit, .. } => {
                self.exit = Some(exit);
                return false;
            }
            ProcessEvent::Caught { .. }
            | ProcessEvent::Matched { .. }
            | ProcessEvent::Error { .. } => return false,
        }
        true
    }

    /// The offset to read from next.
    pub fn next(&self) -> u64 {
        self.offset + self.lost + self.data.len() as u64
    }
}

/// The refusal of a file longer than a client's limit (`size` when known).
pub fn too_long(path: &str, size: Option<u64>, max: u64) -> Refusal {
    Refusal(match size {
        Some(size) => {
            format!("refused: {path} has {size} bytes, more than this client's limit of {max}")
        }
        None => format!("refused: {path} is longer than this client's limit of {max} bytes"),
    })
}

fn arg_str<'a>(args: &'a JsonObject, name: &str) -> Result<&'a str, Refusal> {
    args.get(name)
        .and_then(Value::as_str)
        .ok_or_else(|| Refusal(format!("`{name}` (a string) is required")))
}

fn arg_opt_str<'a>(args: &'a JsonObject, name: &str) -> Result<Option<&'a str>, Refusal> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => arg_str(args, name).map(Some),
    }
}

fn arg_pid(args: &JsonObject) -> Result<i32, Refusal> {
    arg_u64(args, "pid")?
        .and_then(|p| i32::try_from(p).ok())
        .filter(|p| *p > 0)
        .ok_or_else(|| Refusal("`pid` (the number start_command returned) is required".into()))
}

fn arg_u64(args: &JsonObject, name: &str) -> Result<Option<u64>, Refusal> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| Refusal(format!("`{name}` must be a whole number"))),
    }
}

/// The tools, as `tools/list` shows them.
fn tools() -> Vec<Tool> {
    let sandbox =
        json!({ "type": "string", "description": "The sandbox id create_sandbox returned" });
    let path = json!({ "type": "string", "description": "An absolute path in the sandbox" });
    let tool = |name: &'static str, description: &'static str, schema: Value| {
        let Value::Object(schema) = schema else {
            unreachable!("a tool's schema is an object")
        };
        Tool::new(name, description, schema)
    };
    vec![
        tool(
            "create_sandbox",
            "Create a sandbox (a microVM with its own Linux kernel) from a template; returns its id.",
            json!({
                "type": "object",
                "properties": {
                    "template": { "type": "string", "description": "Template name (default: base)" },
                    "ttl_s": { "type": "integer", "minimum": 1, "description": "Destroy it after this many seconds" }
                }
            }),
        ),
        tool(
            "run_command",
            "Run a shell command (/bin/sh -c) in a sandbox; returns its exit code, stdout and stderr.",
            json!({
                "type": "object",
                "properties": {
                    "sandbox": sandbox,
                    "command": { "type": "string" },
                    "cwd": { "type": "string", "description": "Working directory (default /)" },
                    "timeout_s": { "type": "integer", "minimum": 1, "description": "Kill it after this many seconds" }
                },
                "required": ["sandbox", "command"]
            }),
        ),
        tool(
            "start_command",
            "Start a shell command (/bin/sh -c) in the background in a sandbox (a server, a long build); returns its pid. It runs on after this call; read its output with command_output.",
            json!({
                "type": "object",
                "properties": {
                    "sandbox": sandbox,
                    "command": { "type": "string" },
                    "cwd": { "type": "string", "description": "Working directory (default /)" },
                    "timeout_s": { "type": "integer", "minimum": 1, "description": "Kill it after this many seconds (default: this client's longest)" }
                },
                "required": ["sandbox", "command"]
            }),
        ),
        tool(
            "command_output",
            "A background command's output from an offset (0: from its start, as far as the sandbox kept it) up to now, whether it still runs or how it ended, and the offset to read from next.",
            json!({
                "type": "object",
                "properties": {
                    "sandbox": sandbox,
                    "pid": { "type": "integer" },
                    "offset": { "type": "integer", "minimum": 0, "description": "Where to read from (default 0)" }
                },
                "required": ["sandbox", "pid"]
            }),
        ),
        tool(
            "send_input",
            "Write text to a background command's stdin; with close, then end its input.",
            json!({
                "type": "object",
                "properties": {
                    "sandbox": sandbox,
                    "pid": { "type": "integer" },
                    "input": { "type": "string" },
                    "close": { "type": "boolean" }
                },
                "required": ["sandbox", "pid", "input"]
            }),
        ),
        tool(
            "kill_command",
            "Send a signal to a background command (default TERM; KILL ends it and all it started).",
            json!({
                "type": "object",
                "properties": {
                    "sandbox": sandbox,
                    "pid": { "type": "integer" },
                    "signal": { "type": "string", "description": "TERM, INT, KILL, HUP... (default TERM)" }
                },
                "required": ["sandbox", "pid"]
            }),
        ),
        tool(
            "read_file",
            "Read a text file in a sandbox.",
            json!({
                "type": "object",
                "properties": { "sandbox": sandbox, "path": path },
                "required": ["sandbox", "path"]
            }),
        ),
        tool(
            "write_file",
            "Write a text file in a sandbox (replacing it whole).",
            json!({
                "type": "object",
                "properties": { "sandbox": sandbox, "path": path, "content": { "type": "string" } },
                "required": ["sandbox", "path", "content"]
            }),
        ),
        tool(
            "list_files",
            "List a directory in a sandbox: one entry per line, kind (d, f, l, other), size, name.",
            json!({
                "type": "object",
                "properties": { "sandbox": sandbox, "path": path },
                "required": ["sandbox", "path"]
            }),
        ),
        tool(
            "destroy_sandbox",
            "Destroy a sandbox this client created.",
            json!({
                "type": "object",
                "properties": { "sandbox": sandbox },
                "required": ["sandbox"]
            }),
        ),
    ]
}

/// One client's tools, limits and sandboxes.
struct Tools {
    backend: Arc<dyn Backend>,
    limits: Limits,
    /// The label that marks this session's sandboxes.
    label: String,
    owned: Mutex<BTreeSet<String>>,
    calls: AtomicU64,
    in_flight: AtomicUsize,
    /// The HTTP sessions alive (this one among them), if it is one.
    sessions: Option<Arc<AtomicUsize>>,
}

impl Tools {
    fn new(backend: Arc<dyn Backend>, limits: Limits, sessions: Option<Arc<AtomicUsize>>) -> Self {
        static SESSIONS: AtomicU64 = AtomicU64::new(0);
        if let Some(live) = &sessions {
            live.fetch_add(1, Ordering::SeqCst);
        }
        Tools {
            backend,
            limits,
            label: format!(
                "{}-{}",
                std::process::id(),
                SESSIONS.fetch_add(1, Ordering::Relaxed)
            ),
            owned: Mutex::new(BTreeSet::new()),
            calls: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            sessions,
        }
    }

    fn owned(&self) -> MutexGuard<'_, BTreeSet<String>> {
        self.owned.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A sandbox argument, checked to be this session's.
    fn sandbox<'a>(&self, args: &'a JsonObject) -> Result<&'a str, Refusal> {
        let id = arg_str(args, "sandbox")?;
        if !self.owned().contains(id) {
            return Err(Refusal(format!(
                "refused: sandbox `{id}` was not created by this MCP client \
                 (a client reaches only the sandboxes it created)"
            )));
        }
        Ok(id)
    }

    fn path(args: &JsonObject) -> Result<&str, Refusal> {
        let path = arg_str(args, "path")?;
        if !path.starts_with('/') {
            return Err(Refusal(format!("path `{path}` is not absolute")));
        }
        Ok(path)
    }

    /// Runs tool `name` (a known one) for caller `who`.
    fn call(&self, name: &str, args: &JsonObject, who: &str) -> Result<String, Refusal> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if n >= self.limits.calls {
            return Err(Refusal(format!(
                "refused: this MCP client has made its {} calls (husk mcp --max-calls)",
                self.limits.calls
            )));
        }
        match name {
            "create_sandbox" => self.create(args, who),
            "run_command" => self.run(args),
            "start_command" => self.start(args, who),
            "command_output" => self.output(args),
            "send_input" => self.input(args),
            "kill_command" => self.kill(args, who),
            "read_file" => self.read(args),
            "write_file" => self.write(args),
            "list_files" => self.list(args),
            "destroy_sandbox" => self.destroy(args),
            other => Err(Refusal(format!("no tool `{other}` (see tools/list)"))),
        }
    }

    fn create(&self, args: &JsonObject, who: &str) -> Result<String, Refusal> {
        let template = arg_opt_str(args, "template")?.unwrap_or("base");
        let ttl_s = arg_u64(args, "ttl_s")?;
        {
            let mut owned = self.owned();
            if owned.len() >= self.limits.sandboxes {
                return Err(Refusal(format!(
                    "refused: this MCP client already has {} sandboxes, its limit \
                     (destroy one first, or husk mcp --max-sandboxes)",
                    owned.len()
                )));
            }
            // Held while the sandbox is made, so concurrent creates cannot
            // pass the limit together.
            owned.insert(String::new());
        }
        let req = CreateRequest {
            template: template.to_owned(),
            ttl_s,
            labels: [("mcp".to_owned(), self.label.clone())].into(),
            ..Default::default()
        };
        let created = self.backend.create(req, who);
        let mut owned = self.owned();
        owned.remove("");
        let id = created?;
        owned.insert(id.clone());
        Ok(format!("created sandbox {id} from template {template}"))
    }

    fn run(&self, args: &JsonObject) -> Result<String, Refusal> {
        let id = self.sandbox(args)?;
        let command = arg_str(args, "command")?;
        let timeout_s = arg_u64(args, "timeout_s")?.unwrap_or(60);
        if timeout_s == 0 || timeout_s > self.limits.command_s {
            return Err(Refusal(format!(
                "refused: timeout_s must be 1-{} for this MCP client",
                self.limits.command_s
            )));
        }
        let spec = ExecSpec {
            argv: vec!["/bin/sh".into(), "-c".into(), command.to_owned()],
            cwd: arg_opt_str(args, "cwd")?.map(str::to_owned),
            timeout_ms: Some(timeout_s * 1000),
            output_max: Some(self.limits.output),
            ..Default::default()
        };
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let ended = self
            .backend
            .exec(id, spec, &mut |stream, data| match stream {
                Stream::Stdout => out.extend_from_slice(data),
                Stream::Stderr => err.extend_from_slice(data),
            });
        let shown = format!(
            "stdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&err)
        );
        match ended {
            Ok(Termination::Code(c)) => Ok(format!("exit code {c}\n{shown}")),
            Ok(Termination::Signal(s)) => Ok(format!("killed by signal {s}\n{shown}")),
            Err((kind, error)) => {
                let why = match kind {
                    Some(ErrorKind::Timeout) => {
                        format!("the command timed out after {timeout_s} s and was killed")
                    }
                    Some(ErrorKind::Limit) => format!(
                        "the command's output passed this client's limit of {} bytes \
                         and it was killed",
                        self.limits.output
                    ),
                    _ => format!("the command failed: {error}"),
                };
                Err(Refusal(format!("{why}\n{shown}")))
            }
        }
    }

    fn start(&self, args: &JsonObject, who: &str) -> Result<String, Refusal> {
        let id = self.sandbox(args)?;
        let command = arg_str(args, "command")?;
        let timeout_s = arg_u64(args, "timeout_s")?.unwrap_or(self.limits.command_s);
        if timeout_s == 0 || timeout_s > self.limits.command_s {
            return Err(Refusal(format!(
                "refused: timeout_s must be 1-{} for this MCP client",
                self.limits.command_s
            )));
        }
        let spec = ProcessSpec {
            argv: vec!["/bin/sh".into(), "-c".into(), command.to_owned()],
            cwd: arg_opt_str(args, "cwd")?.map(str::to_owned),
            timeout_ms: Some(timeout_s * 1000),
            stdin: true,
            tag: Some("mcp".into()),
            ..Default::default()
        };
        let pid = self.backend.start(id, spec, who)?;
        Ok(format!(
            "started pid {pid}; it runs for up to {timeout_s} s. Read its output with \
             command_output (offset 0 for all of it)"
        ))
    }

    fn output(&self, args: &JsonObject) -> Result<String, Refusal> {
        let id = self.sandbox(args)?;
        let pid = arg_pid(args)?;
        let from = arg_u64(args, "offset")?.unwrap_or(0);
        let out = self.backend.output(id, pid, from, self.limits.output)?;
        let state = match &out.exit {
            None => "still running".to_owned(),
            Some(e) if e.timed_out => "timed out and was killed".to_owned(),
            Some(ProcessExit { code: Some(c), .. }) => format!("exited with code {c}"),
            Some(ProcessExit {
                signal: Some(s), ..
            }) => format!("killed by signal {s}"),
            Some(_) => "ended".to_owned(),
        };
        let mut text = format!("pid {pid} {state}\n");
        if out.dropped > 0 {
            text.push_str(&format!(
                "({} bytes before offset {} are no longer kept)\n",
                out.dropped, out.offset
            ));
        }
        if out.lost > 0 {
            text.push_str(&format!(
                "({} bytes went before they were read)\n",
                out.lost
            ));
        }
        text.push_str(&format!(
            "output from offset {} to {}{}:\n{}\n",
            out.offset,
            out.next(),
            if out.more {
                " (more is kept: this client's limit per call)"
            } else {
                ""
            },
            String::from_utf8_lossy(&out.data)
        ));
        text.push_str(&format!("next offset: {}", out.next()));
        Ok(text)
    }

    fn input(&self, args: &JsonObject) -> Result<String, Refusal> {
        let id = self.sandbox(args)?;
        let pid = arg_pid(args)?;
        let input = arg_str(args, "input")?;
        let close = args.get("close").and_then(Value::as_bool).unwrap_or(false);
        self.backend.input(id, pid, input.as_bytes(), close)?;
        Ok(format!(
            "wrote {} bytes to pid {pid}{}",
            input.len(),
            if close { " and closed its input" } else { "" }
        ))
    }

    fn kill(&self, args: &JsonObject, who: &str) -> Result<String, Refusal> {
        let id = self.sandbox(args)?;
        let pid = arg_pid(args)?;
        let name = arg_opt_str(args, "signal")?.unwrap_or("TERM");
        let signal = husk_types::signal_number(name)
            .ok_or_else(|| Refusal(format!("`{name}` is not a signal (TERM, INT, KILL...)")))?;
        self.backend.signal(id, pid, signal, who)?;
        Ok(format!("sent {name} to pid {pid}"))
    }

    fn read(&self, args: &JsonObject) -> Result<String, Refusal> {
        let id = self.sandbox(args)?;
        let path = Self::path(args)?;
        let data = self.backend.read(id, path, self.limits.output)?;
        if data.len() as u64 > self.limits.output {
            return Err(too_long(path, None, self.limits.output));
        }
        String::from_utf8(data)
            .map_err(|_| Refusal(format!("{path} is not UTF-8 text (read_file returns text)")))
    }

    fn write(&self, args: &JsonObject) -> Result<String, Refusal> {
        let id = self.sandbox(args)?;
        let path = Self::path(args)?;
        let content = arg_str(args, "content")?;
        self.backend.write(id, path, content.as_bytes())?;
        Ok(format!("wrote {} bytes to {path}", content.len()))
    }

    fn list(&self, args: &JsonObject) -> Result<String, Refusal> {
        let id = self.sandbox(args)?;
        let path = Self::path(args)?;
        let mut text = String::new();
        for e in self.backend.list(id, path)? {
            let kind = match e.stat.kind {
                FileKind::Dir => "d",
                FileKind::File => "f",
                FileKind::Symlink => "l",
                _ => "other",
            };
            text.push_str(&format!("{kind} {} {}\n", e.stat.size, e.name));
        }
        Ok(text)
    }

    fn destroy(&self, args: &JsonObject) -> Result<String, Refusal> {
        let id = self.sandbox(args)?.to_owned();
        self.backend.destroy(&id)?;
        self.owned().remove(&id);
        Ok(format!("destroyed sandbox {id}"))
    }

    /// Destroys what the session still holds (the client went).
    fn close(&self) {
        destroy_all(&*self.backend, std::mem::take(&mut *self.owned()));
    }
}

/// Destroys a session's sandboxes (`ids`; the empty one is a create in
/// flight).
fn destroy_all(backend: &dyn Backend, ids: BTreeSet<String>) {
    for id in ids.iter().filter(|id| !id.is_empty()) {
        if let Err(Refusal(e)) = backend.destroy(id) {
            tracing::warn!("mcp: destroying {id} at the end of the session: {e}");
        }
    }
}

impl Drop for Tools {
    fn drop(&mut self) {
        if let Some(live) = &self.sessions {
            live.fetch_sub(1, Ordering::SeqCst);
        }
        // An HTTP session that ended (deleted, idle, the daemon stopping):
        // its sandboxes go, off the runtime that dropped it.
        let ids = std::mem::take(&mut *self.owned());
        if ids.iter().any(|id| !id.is_empty()) {
            let backend = self.backend.clone();
            std::thread::spawn(move || destroy_all(&*backend, ids));
        }
    }
}

/// One MCP session, as rmcp serves it.
#[derive(Clone)]
struct McpSession(Arc<Tools>);

impl std::fmt::Debug for McpSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpSession")
            .field("label", &self.0.label)
            .finish_non_exhaustive()
    }
}

impl ServerHandler for McpSession {
    fn get_info(&self) -> InitializeResult {
        InitializeResult::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("husk", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Each sandbox is a microVM. Create one, run commands and move files in it, \
                 destroy it when done. This client may hold a limited number of sandboxes; \
                 they are destroyed when it disconnects.",
            )
    }

    /// The versions whose sessions outlive a request (a client's
    /// sandboxes belong to its session).
    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        Cow::Borrowed(ProtocolVersion::known_up_to(&ProtocolVersion::V_2025_11_25))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let name = request.name.to_string();
        if !tools().iter().any(|t| t.name == name) {
            return Err(ErrorData::invalid_params(
                format!("no tool `{name}` (see tools/list)"),
                None,
            ));
        }
        let tools = self.0.clone();
        if tools.in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {
            tools.in_flight.fetch_sub(1, Ordering::SeqCst);
            return Err(ErrorData::internal_error(
                format!("refused: at most {MAX_IN_FLIGHT} calls at once"),
                None,
            ));
        }
        let peer = context
            .extensions
            .get::<axum::http::request::Parts>()
            .and_then(|p| p.extensions.get::<ConnectInfo<Peer>>())
            .map(|ConnectInfo(Peer(p))| format!(" ({p})"))
            .unwrap_or_default();
        let who = format!("mcp {}{peer}", tools.label);
        let args = request.arguments.unwrap_or_default();
        let done = tokio::task::spawn_blocking(move || {
            let result = tools.call(&name, &args, &who);
            tools.in_flight.fetch_sub(1, Ordering::SeqCst);
            result
        })
        .await
        .map_err(|e| ErrorData::internal_error(format!("the call failed: {e}"), None))?;
        Ok(match done {
            Ok(text) => CallToolResult::success(vec![ContentBlock::text(text)]),
            Err(Refusal(text)) => CallToolResult::error(vec![ContentBlock::text(text)]),
        }
        .into())
    }
}

/// Serves one client on stdin/stdout until its input ends, then destroys
/// the sandboxes it left.
pub async fn serve_stdio(backend: Arc<dyn Backend>, limits: Limits) -> std::io::Result<()> {
    serve_on(backend, limits, (tokio::io::stdin(), tokio::io::stdout())).await
}

async fn serve_on<R, W>(
    backend: Arc<dyn Backend>,
    limits: Limits,
    (input, output): (R, W),
) -> std::io::Result<()>
where
    R: tokio::io::AsyncRead + Send + Unpin + 'static,
    W: tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let tools = Arc::new(Tools::new(backend, limits, None));
    let result = match McpSession(tools.clone()).serve((input, output)).await {
        Ok(running) => running
            .waiting()
            .await
            .map(drop)
            .map_err(std::io::Error::other),
        // A client that went before initializing.
        Err(e) => {
            tracing::debug!("mcp: the session did not start: {e}");
            Ok(())
        }
    };
    let closing = tools.clone();
    let _ = tokio::task::spawn_blocking(move || closing.close()).await;
    result
}

/// MCP over streamable HTTP (the daemon's `/mcp`): a session per client,
/// named by the `Mcp-Session-Id` header of the answer to `initialize`,
/// whose tools call the daemon in process.
pub struct HttpService {
    service: StreamableHttpService<McpSession, LocalSessionManager>,
    sessions: Arc<AtomicUsize>,
    stop: tokio_util::sync::CancellationToken,
}

impl std::fmt::Debug for HttpService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpService")
            .field("sessions", &self.sessions.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl HttpService {
    /// Sessions on `daemon`, each with `limits`.
    pub fn new(daemon: Arc<Daemon>, limits: Limits) -> Arc<Self> {
        let sessions = Arc::new(AtomicUsize::new(0));
        let stop = tokio_util::sync::CancellationToken::new();
        let mut manager = LocalSessionManager::default();
        manager.session_config.keep_alive = Some(HTTP_IDLE);
        // The API's own access control stands in front of it (the Unix
        // socket's permissions, TCP's bearer token), so any Host is taken.
        let config = StreamableHttpServerConfig::default()
            .disable_allowed_hosts()
            .with_cancellation_token(stop.clone())
            .with_max_request_body_bytes(MAX_MESSAGE);
        let live = sessions.clone();
        let factory = move || {
            let backend = Arc::new(InProcess::new(daemon.clone()));
            Ok(McpSession(Arc::new(Tools::new(
                backend,
                limits.clone(),
                Some(live.clone()),
            ))))
        };
        Arc::new(HttpService {
            service: StreamableHttpService::new(factory, Arc::new(manager), config),
            sessions,
            stop,
        })
    }

    /// Answers one request on `/mcp`.
    pub async fn handle(&self, req: Request) -> Response {
        let opens = req.method() == axum::http::Method::POST
            && !req.headers().contains_key("mcp-session-id");
        if opens && self.sessions.load(Ordering::SeqCst) >= MAX_HTTP_SESSIONS {
            let refusal = json!({ "jsonrpc": "2.0", "id": null, "error": { "code": -32000,
                "message": format!("refused: this daemon holds {MAX_HTTP_SESSIONS} MCP sessions, its limit") } });
            return (StatusCode::TOO_MANY_REQUESTS, axum::Json(refusal)).into_response();
        }
        self.service.handle(req).await.map(Body::new)
    }

    /// Ends every session (their sandboxes are destroyed) and refuses new
    /// ones; for a daemon that stops.
    pub fn shutdown(&self) {
        self.stop.cancel();
    }
}

/// The tools' backend inside the daemon: `husk-core` in process, a
/// [`Sandbox`] handle (and its agent connection) kept per sandbox.
pub struct InProcess {
    daemon: Arc<Daemon>,
    handles: Mutex<HashMap<String, Arc<Sandbox>>>,
}

impl std::fmt::Debug for InProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcess").finish_non_exhaustive()
    }
}

impl InProcess {
    /// Tools on `daemon`.
    pub fn new(daemon: Arc<Daemon>) -> Self {
        InProcess {
            daemon,
            handles: Mutex::new(HashMap::new()),
        }
    }

    fn handles(&self) -> MutexGuard<'_, HashMap<String, Arc<Sandbox>>> {
        self.handles.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn handle(&self, id: &str) -> Result<Arc<Sandbox>, Refusal> {
        self.handles()
            .get(id)
            .cloned()
            .ok_or_else(|| Refusal(format!("no sandbox {id}")))
    }
}

/// A sink that takes at most `max + 1` bytes, then fails the copy.
struct Capped {
    data: Vec<u8>,
    max: u64,
}

impl Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let room = (self.max + 1).saturating_sub(self.data.len() as u64);
        if room == 0 {
            return Err(std::io::Error::other("past the limit"));
        }
        let n = buf.len().min(room as usize);
        self.data.extend_from_slice(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Backend for InProcess {
    fn create(&self, req: CreateRequest, who: &str) -> Result<String, Refusal> {
        let sandbox = self.daemon.create_sandbox(req, who)?;
        let id = sandbox.id().to_owned();
        self.handles().insert(id.clone(), Arc::new(sandbox));
        Ok(id)
    }

    fn exec(
        &self,
        id: &str,
        spec: ExecSpec,
        output: &mut dyn FnMut(Stream, &[u8]),
    ) -> Result<Termination, ExecFailure> {
        let sandbox = self.handle(id).map_err(|Refusal(e)| (None, e))?;
        match sandbox.exec_streaming(spec.into(), output) {
            Ok(report) => Ok(report.termination),
            Err(DaemonError::Agent(e)) => Err((e.kind(), e.to_string())),
            Err(e) => Err((None, e.to_string())),
        }
    }

    fn read(&self, id: &str, path: &str, max: u64) -> Result<Vec<u8>, Refusal> {
        let mut sink = Capped {
            data: Vec::new(),
            max,
        };
        match self.handle(id)?.read_file(path, &mut sink) {
            Ok(_) => Ok(sink.data),
            Err(_) if sink.data.len() as u64 > max => Err(too_long(path, None, max)),
            Err(e) => Err(e.into()),
        }
    }

    fn write(&self, id: &str, path: &str, data: &[u8]) -> Result<(), Refusal> {
        self.handle(id)?.write_file(path, 0o644, data)?;
        Ok(())
    }

    fn list(&self, id: &str, path: &str) -> Result<Vec<DirEntry>, Refusal> {
        Ok(self.handle(id)?.list(path)?)
    }

    fn destroy(&self, id: &str) -> Result<(), Refusal> {
        let sandbox = self.handle(id)?;
        self.handles().remove(id);
        sandbox.destroy()?;
        Ok(())
    }

    fn start(&self, id: &str, spec: ProcessSpec, who: &str) -> Result<i32, Refusal> {
        Ok(self.daemon.start_process(id, who, spec)?.pid)
    }

    fn output(&self, id: &str, pid: i32, from: u64, max: u64) -> Result<CommandOutput, Refusal> {
        let mut out = CommandOutput::default();
        self.daemon.read_process(
            id,
            pid,
            (from, Reading::Kept),
            |o| out.take(o.event(), max),
            || true,
        )?;
        Ok(out)
    }

    fn input(&self, id: &str, pid: i32, data: &[u8], close: bool) -> Result<(), Refusal> {
        Ok(self.daemon.write_process_stdin(id, pid, data, close)?)
    }

    fn signal(&self, id: &str, pid: i32, signal: i32, who: &str) -> Result<(), Refusal> {
        Ok(self.daemon.signal_process(id, who, pid, signal)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

    /// A backend with one sandbox whose commands print their own text.
    #[derive(Default)]
    struct Fake {
        destroyed: Mutex<Vec<String>>,
    }

    impl Backend for Fake {
        fn create(&self, req: CreateRequest, _: &str) -> Result<String, Refusal> {
            assert!(req.labels.get("mcp").is_some_and(|l| !l.is_empty()));
            Ok("sb-fake".to_owned())
        }
        fn exec(
            &self,
            _: &str,
            spec: ExecSpec,
            output: &mut dyn FnMut(Stream, &[u8]),
        ) -> Result<Termination, ExecFailure> {
            output(Stream::Stdout, spec.argv[2].as_bytes());
            Ok(Termination::Code(3))
        }
        fn read(&self, _: &str, _: &str, max: u64) -> Result<Vec<u8>, Refusal> {
            Ok(vec![b'x'; max as usize + 1])
        }
        fn write(&self, _: &str, _: &str, _: &[u8]) -> Result<(), Refusal> {
            Ok(())
        }
        fn list(&self, _: &str, _: &str) -> Result<Vec<DirEntry>, Refusal> {
            Ok(Vec::new())
        }
        fn destroy(&self, id: &str) -> Result<(), Refusal> {
            self.destroyed.lock().expect("lock").push(id.to_owned());
            Ok(())
        }
        fn start(&self, _: &str, spec: ProcessSpec, _: &str) -> Result<i32, Refusal> {
            assert_eq!(spec.timeout_ms, Some(60_000));
            Ok(42)
        }
        fn output(&self, _: &str, pid: i32, from: u64, max: u64) -> Result<CommandOutput, Refusal> {
            assert_eq!(pid, 42);
            // A program that wrote "0123456789" and exited 0, of which the
            // first 2 bytes are no longer kept.
            let mut out = CommandOutput::default();
            let kept = from.max(2);
            let events = [
                ProcessEvent::Replay {
                    offset: kept,
                    dropped: kept - from,
                },
                ProcessEvent::Stdout {
                    offset: kept,
                    data: b64(&b"0123456789"[kept as usize..]),
                },
                ProcessEvent::Exit {
                    offset: 10,
                    exit: ProcessExit {
                        code: Some(0),
                        signal: None,
                        timed_out: false,
                        over_limit: false,
                    },
                },
            ];
            for e in events {
                if !out.take(e, max) {
                    break;
                }
            }
            Ok(out)
        }
        fn input(&self, _: &str, _: i32, _: &[u8], _: bool) -> Result<(), Refusal> {
            Ok(())
        }
        fn signal(&self, _: &str, _: i32, signal: i32, _: &str) -> Result<(), Refusal> {
            assert_eq!(signal, 9);
            Ok(())
        }
    }

    fn b64(data: &[u8]) -> String {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(data)
    }

    /// Runs a stdio session with `requests` (one JSON-RPC message each),
    /// waiting for each request's answer; returns the answers by id.
    async fn session(fake: Arc<Fake>, limits: Limits, requests: &[Value]) -> Vec<Value> {
        let (client, server) = tokio::io::duplex(1 << 16);
        let (server_in, server_out) = tokio::io::split(server);
        let served = tokio::spawn(serve_on(fake, limits, (server_in, server_out)));
        let (client_in, mut client_out) = tokio::io::split(client);
        let mut lines = BufReader::new(client_in).lines();
        let mut answers = Vec::new();
        for request in requests {
            let mut line = serde_json::to_vec(request).expect("json");
            line.push(b'\n');
            client_out.write_all(&line).await.expect("write");
            if request.get("id").is_none() {
                continue;
            }
            loop {
                let line = lines.next_line().await.expect("read").expect("an answer");
                let answer: Value = serde_json::from_str(&line).expect("json");
                if answer.get("id") == request.get("id") {
                    answers.push(answer);
                    break;
                }
            }
        }
        drop(client_out);
        drop(lines);
        served.await.expect("join").expect("served");
        answers
    }

    fn initialize(version: &str) -> Value {
        json!({ "jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": version, "capabilities": {},
            "clientInfo": { "name": "t", "version": "0" } } })
    }

    fn initialized() -> Value {
        json!({ "jsonrpc": "2.0", "method": "notifications/initialized" })
    }

    fn call(id: u64, tool: &str, args: Value) -> Value {
        json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": { "name": tool, "arguments": args } })
    }

    fn text(answer: &Value) -> (&str, bool) {
        let r = &answer["result"];
        (
            r["content"][0]["text"].as_str().unwrap_or_default(),
            r["isError"].as_bool().expect("isError"),
        )
    }

    #[tokio::test]
    async fn tools_answer_refuse_and_the_session_cleans_up() {
        let fake = Arc::new(Fake::default());
        let limits = Limits {
            sandboxes: 1,
            calls: 8,
            output: 16,
            ..Limits::default()
        };
        let answers = session(
            fake.clone(),
            limits,
            &[
                initialize("2025-03-26"),
                initialized(),
                json!({ "jsonrpc": "2.0", "id": 1, "method": "tools/list" }),
                call(2, "create_sandbox", json!({})),
                call(3, "create_sandbox", json!({ "ttl_s": -1 })),
                call(
                    4,
                    "run_command",
                    json!({ "sandbox": "sb-else", "command": "id" }),
                ),
                call(5, "format_disk", json!({})),
                call(6, "read_file", json!({ "path": "/etc/passwd" })),
                json!({ "jsonrpc": "2.0", "id": 7, "method": "ping" }),
            ],
        )
        .await;
        let init = &answers[0]["result"];
        assert_eq!(init["protocolVersion"], "2025-03-26");
        assert_eq!(init["serverInfo"]["name"], "husk");
        assert_eq!(
            answers[1]["result"]["tools"].as_array().map(Vec::len),
            Some(10)
        );
        let (created, err) = text(&answers[2]);
        assert!(
            !err && created.starts_with("created sandbox sb-"),
            "{created}"
        );
        let (ttl, err) = text(&answers[3]);
        assert!(err && ttl.contains("`ttl_s`"), "{ttl}");
        let (other, err) = text(&answers[4]);
        assert!(
            err && other.contains("not created by this MCP client"),
            "{other}"
        );
        assert_eq!(answers[5]["error"]["code"], -32602, "{}", answers[5]);
        assert!(answers[5]["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("format_disk")));
        let (no_sandbox, err) = text(&answers[6]);
        assert!(err && no_sandbox.contains("`sandbox`"), "{no_sandbox}");
        assert_eq!(answers[7]["result"], json!({}));
        // The client went: its sandbox was destroyed.
        let id = created.split_whitespace().nth(2).expect("an id");
        assert_eq!(*fake.destroyed.lock().expect("lock"), vec![id.to_owned()]);
    }

    #[tokio::test]
    async fn background_commands_start_and_are_read_from_an_offset() {
        let fake = Arc::new(Fake::default());
        let limits = Limits {
            command_s: 60,
            output: 5,
            ..Limits::default()
        };
        let id = "sb-fake";
        let requests = [
            initialize("2025-11-25"),
            initialized(),
            call(1, "create_sandbox", json!({})),
            call(2, "start_command", json!({ "sandbox": id, "command": "x" })),
            call(3, "command_output", json!({ "sandbox": id, "pid": 42 })),
            call(
                4,
                "command_output",
                json!({ "sandbox": id, "pid": 42, "offset": 7 }),
            ),
            call(
                5,
                "kill_command",
                json!({ "sandbox": id, "pid": 42, "signal": "KILL" }),
            ),
            call(
                6,
                "kill_command",
                json!({ "sandbox": id, "pid": 42, "signal": "NOPE" }),
            ),
            call(
                7,
                "command_output",
                json!({ "sandbox": "sb-other", "pid": 42 }),
            ),
        ];
        let answers = session(fake, limits, &requests).await;
        let (started, err) = text(&answers[2]);
        assert!(!err && started.starts_with("started pid 42"), "{started}");
        // The first call: 2 bytes gone, 5 of the rest (this client's
        // limit), and where to go on.
        let (first, err) = text(&answers[3]);
        assert!(!err, "{first}");
        assert!(first.contains("still running"), "{first}");
        assert!(first.contains("2 bytes before offset 2"), "{first}");
        assert!(first.contains(":\n23456\n"), "{first}");
        assert!(first.ends_with("next offset: 7"), "{first}");
        let (last, err) = text(&answers[4]);
        assert!(!err && last.contains("exited with code 0"), "{last}");
        assert!(
            last.contains(":\n789\n") && last.ends_with("next offset: 10"),
            "{last}"
        );
        let (killed, err) = text(&answers[5]);
        assert!(!err && killed.contains("sent KILL"), "{killed}");
        let (bad, err) = text(&answers[6]);
        assert!(err && bad.contains("not a signal"), "{bad}");
        let (other, err) = text(&answers[7]);
        assert!(
            err && other.contains("not created by this MCP client"),
            "{other}"
        );
    }

    #[tokio::test]
    async fn limits_hold_output_files_and_calls() {
        let fake = Arc::new(Fake::default());
        let limits = Limits {
            sandboxes: 2,
            calls: 5,
            command_s: 60,
            output: 16,
        };
        let id = "sb-fake";
        let requests = [
            initialize("2025-11-25"),
            initialized(),
            call(1, "create_sandbox", json!({ "template": "base" })),
            call(
                2,
                "run_command",
                json!({ "sandbox": id, "command": "echo hi" }),
            ),
            call(
                3,
                "run_command",
                json!({ "sandbox": id, "command": "x", "timeout_s": 61 }),
            ),
            call(4, "read_file", json!({ "sandbox": id, "path": "/big" })),
            call(5, "read_file", json!({ "sandbox": id, "path": "relative" })),
            call(6, "list_files", json!({ "sandbox": id, "path": "/" })),
        ];
        let answers = session(fake, limits, &requests).await;
        assert_eq!(answers[0]["result"]["protocolVersion"], "2025-11-25");
        let (ran, err) = text(&answers[2]);
        assert!(
            !err && ran.starts_with("exit code 3\nstdout:\necho hi"),
            "{ran}"
        );
        let (timeout, err) = text(&answers[3]);
        assert!(
            err && timeout.contains("timeout_s must be 1-60"),
            "{timeout}"
        );
        let (big, err) = text(&answers[4]);
        assert!(err && big.contains("limit of 16 bytes"), "{big}");
        let (relative, err) = text(&answers[5]);
        assert!(err && relative.contains("not absolute"), "{relative}");
        let (spent, err) = text(&answers[6]);
        assert!(err && spent.contains("its 5 calls"), "{spent}");
    }
}
