//! `husk mcp`: the Model Context Protocol over stdio, so an agent reaches
//! sandboxes as tools.
//!
//! JSON-RPC 2.0, one message per line (MCP's stdio transport): `initialize`,
//! `ping`, `tools/list` and `tools/call`. The tools drive the daemon through
//! its API, as the CLI does: create a sandbox from a template, run a
//! command, read, write and list files, destroy the sandbox.
//!
//! One client (one `husk mcp` process) is one session with limits of its
//! own ([`Limits`]): how many sandboxes it holds at once, how many calls it
//! makes, how long a command may run and how much output it returns. A
//! session reaches only the sandboxes it created (labelled `mcp=<session>`),
//! and destroys them when the client goes (its stdin ends). A refused call
//! is a tool error (`isError`) that says what was refused and why, which an
//! agent can act on; a malformed message is a JSON-RPC error.

use std::collections::BTreeSet;
use std::io::{BufRead, Read, Write};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use base64::Engine;
use serde_json::{json, Value};

use husk_client::{encode, ApiClient, ApiClientError, Payload};
use husk_types::{Created, ExecEvent, ExecSpec};

/// Protocol versions this server speaks (its tools are the same in each).
const VERSIONS: &[&str] = &["2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"];
/// Largest message read from the client.
const MAX_MESSAGE: usize = 8 << 20;
/// Calls running at once in one session.
const MAX_IN_FLIGHT: usize = 16;

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

/// One client's session.
#[derive(Debug)]
pub struct Session {
    api: ApiClient,
    limits: Limits,
    /// The label that marks this session's sandboxes.
    id: String,
    owned: Mutex<BTreeSet<String>>,
    calls: AtomicU64,
    in_flight: AtomicUsize,
}

/// A tool's failure, shown to the agent.
struct Refusal(String);

impl From<ApiClientError> for Refusal {
    fn from(e: ApiClientError) -> Self {
        Refusal(e.to_string())
    }
}

type ToolResult = Result<String, Refusal>;

fn arg_str<'a>(args: &'a Value, name: &str) -> Result<&'a str, Refusal> {
    args.get(name)
        .and_then(Value::as_str)
        .ok_or_else(|| Refusal(format!("`{name}` (a string) is required")))
}

fn arg_u64(args: &Value, name: &str) -> Result<Option<u64>, Refusal> {
    match args.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| Refusal(format!("`{name}` must be a whole number"))),
    }
}

/// The tools, as `tools/list` shows them.
fn tools() -> Value {
    let sandbox =
        json!({ "type": "string", "description": "The sandbox id create_sandbox returned" });
    let path = json!({ "type": "string", "description": "An absolute path in the sandbox" });
    json!([
        {
            "name": "create_sandbox",
            "description": "Create a sandbox (a microVM with its own Linux kernel) from a template; returns its id.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "template": { "type": "string", "description": "Template name (default: base)" },
                    "ttl_s": { "type": "integer", "minimum": 1, "description": "Destroy it after this many seconds" }
                }
            }
        },
        {
            "name": "run_command",
            "description": "Run a shell command (/bin/sh -c) in a sandbox; returns its exit code, stdout and stderr.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "sandbox": sandbox,
                    "command": { "type": "string" },
                    "cwd": { "type": "string", "description": "Working directory (default /)" },
                    "timeout_s": { "type": "integer", "minimum": 1, "description": "Kill it after this many seconds" }
                },
                "required": ["sandbox", "command"]
            }
        },
        {
            "name": "read_file",
            "description": "Read a text file in a sandbox.",
            "inputSchema": {
                "type": "object",
                "properties": { "sandbox": sandbox, "path": path },
                "required": ["sandbox", "path"]
            }
        },
        {
            "name": "write_file",
            "description": "Write a text file in a sandbox (replacing it whole).",
            "inputSchema": {
                "type": "object",
                "properties": { "sandbox": sandbox, "path": path, "content": { "type": "string" } },
                "required": ["sandbox", "path", "content"]
            }
        },
        {
            "name": "list_files",
            "description": "List a directory in a sandbox: one entry per line, kind (d, f, l, other), size, name.",
            "inputSchema": {
                "type": "object",
                "properties": { "sandbox": sandbox, "path": path },
                "required": ["sandbox", "path"]
            }
        },
        {
            "name": "destroy_sandbox",
            "description": "Destroy a sandbox this client created.",
            "inputSchema": {
                "type": "object",
                "properties": { "sandbox": sandbox },
                "required": ["sandbox"]
            }
        }
    ])
}

impl Session {
    pub fn new(api: ApiClient, limits: Limits) -> Session {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        Session {
            api,
            limits,
            id: format!("{}-{nanos:08x}", std::process::id()),
            owned: Mutex::new(BTreeSet::new()),
            calls: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
        }
    }

    fn owned(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.owned.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A sandbox argument, checked to be this session's.
    fn sandbox<'a>(&self, args: &'a Value) -> Result<&'a str, Refusal> {
        let id = arg_str(args, "sandbox")?;
        if !self.owned().contains(id) {
            return Err(Refusal(format!(
                "refused: sandbox `{id}` was not created by this MCP client \
                 (a client reaches only the sandboxes it created)"
            )));
        }
        Ok(id)
    }

    fn path(args: &Value) -> Result<&str, Refusal> {
        let path = arg_str(args, "path")?;
        if !path.starts_with('/') {
            return Err(Refusal(format!("path `{path}` is not absolute")));
        }
        Ok(path)
    }

    fn call_tool(&self, name: &str, args: &Value) -> ToolResult {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        if n >= self.limits.calls {
            return Err(Refusal(format!(
                "refused: this MCP client has made its {} calls (husk mcp --max-calls)",
                self.limits.calls
            )));
        }
        match name {
            "create_sandbox" => self.create(args),
            "run_command" => self.run(args),
            "read_file" => self.read(args),
            "write_file" => self.write(args),
            "list_files" => self.list(args),
            "destroy_sandbox" => self.destroy(args),
            other => Err(Refusal(format!("no tool `{other}` (see tools/list)"))),
        }
    }

    fn create(&self, args: &Value) -> ToolResult {
        let template = match args.get("template") {
            None | Some(Value::Null) => "base",
            Some(_) => arg_str(args, "template")?,
        };
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
            // Held while the daemon creates it, so concurrent creates
            // cannot pass the limit together.
            owned.insert(String::new());
        }
        let mut body = json!({ "template": template, "labels": { "mcp": self.id } });
        if let Some(ttl) = ttl_s {
            body["ttl_s"] = json!(ttl);
        }
        let created: Result<Created, _> = self.api.call("POST", "/v1/sandboxes", Some(&body));
        let mut owned = self.owned();
        owned.remove("");
        let created = created?;
        owned.insert(created.sandbox.id.clone());
        Ok(format!(
            "created sandbox {} from template {template}",
            created.sandbox.id
        ))
    }

    fn run(&self, args: &Value) -> ToolResult {
        let id = self.sandbox(args)?;
        let command = arg_str(args, "command")?;
        let timeout_s = arg_u64(args, "timeout_s")?.unwrap_or(60);
        if timeout_s == 0 || timeout_s > self.limits.command_s {
            return Err(Refusal(format!(
                "refused: timeout_s must be 1-{} for this MCP client",
                self.limits.command_s
            )));
        }
        let cwd = match args.get("cwd") {
            None | Some(Value::Null) => None,
            Some(_) => Some(arg_str(args, "cwd")?.to_owned()),
        };
        let spec = ExecSpec {
            argv: vec!["/bin/sh".into(), "-c".into(), command.to_owned()],
            env: Default::default(),
            cwd,
            user: None,
            stdin: String::new(),
            timeout_ms: Some(timeout_s * 1000),
            pids_max: None,
            output_max: Some(self.limits.output),
        };
        let body = serde_json::to_vec(&spec).unwrap_or_default();
        let mut resp = self.api.send(
            "POST",
            &format!("/v1/sandboxes/{}/exec", encode(id)),
            Payload::Json(body),
        )?;
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let decode = |d: &str| {
            base64::engine::general_purpose::STANDARD
                .decode(d)
                .unwrap_or_default()
        };
        let show = |out: &[u8], err: &[u8]| {
            format!(
                "stdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(out),
                String::from_utf8_lossy(err)
            )
        };
        while let Some(event) = resp.next_line::<ExecEvent>()? {
            match event {
                ExecEvent::Started { .. } => {}
                ExecEvent::Stdout { data } => out.extend(decode(&data)),
                ExecEvent::Stderr { data } => err.extend(decode(&data)),
                ExecEvent::Lost { bytes } => {
                    err.extend(format!("[husk: {bytes} bytes of output lost]\n").bytes())
                }
                ExecEvent::Exit { code, signal, .. } => {
                    let how = match (code, signal) {
                        (Some(c), _) => format!("exit code {c}"),
                        (None, Some(s)) => format!("killed by signal {s}"),
                        _ => "ended".to_owned(),
                    };
                    return Ok(format!("{how}\n{}", show(&out, &err)));
                }
                ExecEvent::Error { kind, error } => {
                    let why = match kind {
                        Some(husk_protocol::ErrorKind::Timeout) => {
                            format!("the command timed out after {timeout_s} s and was killed")
                        }
                        Some(husk_protocol::ErrorKind::Limit) => format!(
                            "the command's output passed this client's limit of {} bytes \
                             and it was killed",
                            self.limits.output
                        ),
                        _ => format!("the command failed: {error}"),
                    };
                    return Err(Refusal(format!("{why}\n{}", show(&out, &err))));
                }
            }
        }
        Err(Refusal(format!(
            "the command's output ended without an exit status\n{}",
            show(&out, &err)
        )))
    }

    fn read(&self, args: &Value) -> ToolResult {
        let id = self.sandbox(args)?;
        let path = Self::path(args)?;
        let resp = self.api.send(
            "GET",
            &format!("/v1/sandboxes/{}/files?path={}", encode(id), encode(path)),
            Payload::None,
        )?;
        let size: Option<u64> = resp.header("content-length").and_then(|v| v.parse().ok());
        if size.is_some_and(|s| s > self.limits.output) {
            return Err(Refusal(format!(
                "refused: {path} has {} bytes, more than this client's limit of {}",
                size.unwrap_or(0),
                self.limits.output
            )));
        }
        let mut data = Vec::new();
        resp.take(self.limits.output + 1)
            .read_to_end(&mut data)
            .map_err(|e| Refusal(format!("reading {path}: {e}")))?;
        if data.len() as u64 > self.limits.output {
            return Err(Refusal(format!(
                "refused: {path} is longer than this client's limit of {} bytes",
                self.limits.output
            )));
        }
        String::from_utf8(data)
            .map_err(|_| Refusal(format!("{path} is not UTF-8 text (read_file returns text)")))
    }

    fn write(&self, args: &Value) -> ToolResult {
        let id = self.sandbox(args)?;
        let path = Self::path(args)?;
        let content = arg_str(args, "content")?;
        let mut reader = content.as_bytes();
        self.api.send(
            "PUT",
            &format!("/v1/sandboxes/{}/files?path={}", encode(id), encode(path)),
            Payload::Stream(&mut reader),
        )?;
        Ok(format!("wrote {} bytes to {path}", content.len()))
    }

    fn list(&self, args: &Value) -> ToolResult {
        let id = self.sandbox(args)?;
        let path = Self::path(args)?;
        let entries: Vec<husk_protocol::DirEntry> = self.api.call(
            "GET",
            &format!("/v1/sandboxes/{}/dir?path={}", encode(id), encode(path)),
            None,
        )?;
        let mut text = String::new();
        for e in entries {
            let kind = match e.stat.kind {
                husk_protocol::FileKind::Dir => "d",
                husk_protocol::FileKind::File => "f",
                husk_protocol::FileKind::Symlink => "l",
                _ => "other",
            };
            text.push_str(&format!("{kind} {} {}\n", e.stat.size, e.name));
        }
        Ok(text)
    }

    fn destroy(&self, args: &Value) -> ToolResult {
        let id = self.sandbox(args)?.to_owned();
        self.api.send(
            "DELETE",
            &format!("/v1/sandboxes/{}", encode(&id)),
            Payload::None,
        )?;
        self.owned().remove(&id);
        Ok(format!("destroyed sandbox {id}"))
    }

    /// Destroys what the session still holds (the client went).
    pub fn close(&self) {
        let ids: Vec<String> = std::mem::take(&mut *self.owned()).into_iter().collect();
        for id in ids.iter().filter(|id| !id.is_empty()) {
            if let Err(e) = self.api.send(
                "DELETE",
                &format!("/v1/sandboxes/{}", encode(id)),
                Payload::None,
            ) {
                tracing::warn!("mcp: destroying {id} at the end of the session: {e}");
            }
        }
    }

    /// Answers one JSON-RPC message (None for a notification).
    pub fn handle(&self, msg: &Value) -> Option<Value> {
        let id = msg.get("id").cloned();
        let reply = |result: Result<Value, (i64, String)>| {
            let id = id.clone()?;
            Some(match result {
                Ok(r) => json!({ "jsonrpc": "2.0", "id": id, "result": r }),
                Err((code, message)) => {
                    json!({ "jsonrpc": "2.0", "id": id, "error": { "code": code, "message": message } })
                }
            })
        };
        if msg.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
            return Some(json!({
                "jsonrpc": "2.0", "id": id.unwrap_or(Value::Null),
                "error": { "code": -32600, "message": "not a JSON-RPC 2.0 message" }
            }));
        }
        let Some(method) = msg.get("method").and_then(Value::as_str) else {
            return None; // a response to us: we send no requests
        };
        let params = msg.get("params").cloned().unwrap_or(Value::Null);
        match method {
            "initialize" => {
                let asked = params.get("protocolVersion").and_then(Value::as_str);
                let version = asked
                    .filter(|v| VERSIONS.contains(v))
                    .unwrap_or(VERSIONS[0]);
                reply(Ok(json!({
                    "protocolVersion": version,
                    "capabilities": { "tools": { "listChanged": false } },
                    "serverInfo": { "name": "husk", "version": env!("CARGO_PKG_VERSION") },
                    "instructions": "Each sandbox is a microVM. Create one, run commands and move files in it, destroy it when done. This client may hold a limited number of sandboxes; they are destroyed when it disconnects."
                })))
            }
            "ping" => reply(Ok(json!({}))),
            "tools/list" => reply(Ok(json!({ "tools": tools() }))),
            "tools/call" => {
                let Some(name) = params.get("name").and_then(Value::as_str) else {
                    return reply(Err((-32602, "tools/call needs a tool `name`".into())));
                };
                let args = params.get("arguments").cloned().unwrap_or(json!({}));
                if !args.is_object() {
                    return reply(Err((-32602, "`arguments` must be an object".into())));
                }
                if !tools()
                    .as_array()
                    .is_some_and(|t| t.iter().any(|t| t["name"] == name))
                {
                    return reply(Err((-32602, format!("no tool `{name}` (see tools/list)"))));
                }
                let (text, is_error) = match self.call_tool(name, &args) {
                    Ok(text) => (text, false),
                    Err(Refusal(text)) => (text, true),
                };
                reply(Ok(json!({
                    "content": [{ "type": "text", "text": text }],
                    "isError": is_error
                })))
            }
            m if m.starts_with("notifications/") => None,
            other => reply(Err((-32601, format!("no method `{other}`")))),
        }
    }
}

/// Serves one client on `input`/`output` until its input ends, then
/// destroys the sandboxes it left.
pub fn serve(
    session: Arc<Session>,
    input: impl BufRead,
    output: impl Write + Send + 'static,
) -> std::io::Result<()> {
    let output = Arc::new(Mutex::new(output));
    let send = {
        let output = output.clone();
        move |v: &Value| {
            let mut line = serde_json::to_vec(v).unwrap_or_default();
            line.push(b'\n');
            let mut out = output.lock().unwrap_or_else(|e| e.into_inner());
            let _ = out.write_all(&line).and_then(|()| out.flush());
        }
    };
    let send = Arc::new(send);
    let mut workers = Vec::new();
    let mut input = input;
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = input
            .by_ref()
            .take(MAX_MESSAGE as u64 + 1)
            .read_until(b'\n', &mut line)?;
        if n == 0 {
            break;
        }
        if line.len() > MAX_MESSAGE {
            send(&json!({ "jsonrpc": "2.0", "id": null,
                "error": { "code": -32600, "message": format!("a message longer than {MAX_MESSAGE} bytes") } }));
            // Skip the rest of that line.
            let mut rest = Vec::new();
            while !line.ends_with(b"\n") {
                rest.clear();
                if input.read_until(b'\n', &mut rest)? == 0 {
                    break;
                }
                line = rest.clone();
            }
            continue;
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let msg: Value = match serde_json::from_slice(&line) {
            Ok(v) => v,
            Err(e) => {
                send(&json!({ "jsonrpc": "2.0", "id": null,
                    "error": { "code": -32700, "message": format!("parse error: {e}") } }));
                continue;
            }
        };
        let messages = match msg {
            Value::Array(batch) => batch,
            single => vec![single],
        };
        for msg in messages {
            // Calls run beside each other, so a long command does not hold
            // up a ping; at most MAX_IN_FLIGHT at once.
            if session.in_flight.fetch_add(1, Ordering::SeqCst) >= MAX_IN_FLIGHT {
                session.in_flight.fetch_sub(1, Ordering::SeqCst);
                if let Some(id) = msg.get("id") {
                    send(&json!({ "jsonrpc": "2.0", "id": id,
                        "error": { "code": -32000, "message": format!("refused: at most {MAX_IN_FLIGHT} calls at once") } }));
                }
                continue;
            }
            let (s, send) = (session.clone(), send.clone());
            workers.push(std::thread::spawn(move || {
                if let Some(reply) = s.handle(&msg) {
                    send(&reply);
                }
                s.in_flight.fetch_sub(1, Ordering::SeqCst);
            }));
            workers.retain(|w| !w.is_finished());
        }
    }
    for w in workers {
        let _ = w.join();
    }
    session.close();
    Ok(())
}

/// Sessions the daemon's `/mcp` holds open at once.
pub const MAX_HTTP_SESSIONS: usize = 64;
/// A session unused this long is closed (its sandboxes destroyed).
pub const HTTP_IDLE: std::time::Duration = std::time::Duration::from_secs(3600);

/// MCP over streamable HTTP (`POST /mcp` on the daemon's API): a session per
/// client, named by the `Mcp-Session-Id` header the answer to `initialize`
/// carries, with the same tools and limits as `husk mcp`. Answers are JSON
/// (no server-sent events: the server sends no requests of its own).
#[derive(Debug, Default)]
pub struct HttpSessions {
    /// How sessions reach the daemon (its own socket), and their limits.
    config: std::sync::OnceLock<(ApiClient, Limits)>,
    sessions: Mutex<std::collections::HashMap<String, (Arc<Session>, std::time::Instant)>>,
}

/// An answer to a `POST /mcp`.
#[derive(Debug)]
pub struct HttpAnswer {
    pub status: u16,
    /// A new session's id (after `initialize`).
    pub session: Option<String>,
    pub body: Option<Value>,
}

fn rpc_error(code: i64, message: &str) -> Value {
    json!({ "jsonrpc": "2.0", "id": null, "error": { "code": code, "message": message } })
}

impl HttpSessions {
    /// Sets how sessions reach the daemon; until then `/mcp` is refused.
    pub fn configure(&self, api: ApiClient, limits: Limits) {
        let _ = self.config.set((api, limits));
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<
        '_,
        std::collections::HashMap<String, (Arc<Session>, std::time::Instant)>,
    > {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Closes sessions idle past [`HTTP_IDLE`] (in the background).
    fn sweep(&self) {
        let idle: Vec<Arc<Session>> = {
            let mut sessions = self.lock();
            let old: Vec<String> = sessions
                .iter()
                .filter(|(_, (_, used))| used.elapsed() > HTTP_IDLE)
                .map(|(id, _)| id.clone())
                .collect();
            old.iter()
                .filter_map(|id| sessions.remove(id).map(|(s, _)| s))
                .collect()
        };
        if !idle.is_empty() {
            std::thread::spawn(move || idle.iter().for_each(|s| s.close()));
        }
    }

    /// Answers one POST (blocking: tools call the daemon).
    pub fn post(&self, session: Option<&str>, body: &[u8]) -> HttpAnswer {
        let answer = |status: u16, body: Option<Value>| HttpAnswer {
            status,
            session: None,
            body,
        };
        let Some((api, limits)) = self.config.get() else {
            return answer(
                503,
                Some(rpc_error(-32000, "MCP is not served by this daemon")),
            );
        };
        let msg: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return answer(400, Some(rpc_error(-32700, &format!("parse error: {e}")))),
        };
        let batch = msg.is_array();
        let messages = match msg {
            Value::Array(m) => m,
            one => vec![one],
        };
        let initialize = messages
            .iter()
            .any(|m| m.get("method").and_then(Value::as_str) == Some("initialize"));
        let (session, new) = if initialize {
            if messages.len() != 1 {
                return answer(
                    400,
                    Some(rpc_error(-32600, "initialize must be sent alone")),
                );
            }
            self.sweep();
            let mut sessions = self.lock();
            if sessions.len() >= MAX_HTTP_SESSIONS {
                return answer(
                    429,
                    Some(rpc_error(
                        -32000,
                        &format!("refused: this daemon holds {MAX_HTTP_SESSIONS} MCP sessions, its limit"),
                    )),
                );
            }
            let s = Arc::new(Session::new(api.clone(), limits.clone()));
            let id = format!("mcp-{}-{}", s.id, sessions.len());
            sessions.insert(id.clone(), (s.clone(), std::time::Instant::now()));
            (s, Some(id))
        } else {
            let Some(id) = session else {
                return answer(
                    400,
                    Some(rpc_error(
                        -32000,
                        "Bad Request: the Mcp-Session-Id header is required",
                    )),
                );
            };
            let mut sessions = self.lock();
            let Some((s, used)) = sessions.get_mut(id) else {
                return answer(
                    404,
                    Some(rpc_error(-32001, "no such MCP session (initialize again)")),
                );
            };
            *used = std::time::Instant::now();
            (s.clone(), None)
        };
        let replies: Vec<Value> = messages.iter().filter_map(|m| session.handle(m)).collect();
        let body = match (replies.len(), batch) {
            (0, _) => None,
            (_, true) => Some(Value::Array(replies)),
            (_, false) => replies.into_iter().next(),
        };
        HttpAnswer {
            status: if body.is_some() { 200 } else { 202 },
            session: new,
            body,
        }
    }

    /// Ends a session (`DELETE /mcp`): its sandboxes are destroyed.
    pub fn delete(&self, session: Option<&str>) -> u16 {
        let Some(id) = session else { return 400 };
        let Some((s, _)) = self.lock().remove(id) else {
            return 404;
        };
        s.close();
        204
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(limits: Limits) -> Session {
        // No daemon: these answers come before any API call.
        let api = ApiClient::new(husk_client::Endpoint::Unix("/nonexistent/husk.sock".into()));
        Session::new(api, limits)
    }

    fn call(s: &Session, tool: &str, args: Value) -> (String, bool) {
        let reply = s
            .handle(&json!({ "jsonrpc": "2.0", "id": 7, "method": "tools/call",
                "params": { "name": tool, "arguments": args } }))
            .expect("a reply");
        let r = &reply["result"];
        (
            r["content"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            r["isError"].as_bool().expect("isError"),
        )
    }

    #[test]
    fn the_protocol_is_answered_and_versions_are_negotiated() {
        let s = session(Limits::default());
        let init = |v: &str| {
            s.handle(&json!({ "jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": { "protocolVersion": v, "capabilities": {}, "clientInfo": { "name": "t", "version": "0" } } }))
                .expect("reply")
        };
        assert_eq!(
            init("2025-03-26")["result"]["protocolVersion"],
            "2025-03-26"
        );
        assert_eq!(init("1999-01-01")["result"]["protocolVersion"], VERSIONS[0]);
        assert_eq!(init("2025-06-18")["result"]["serverInfo"]["name"], "husk");
        let none = s.handle(&json!({ "jsonrpc": "2.0", "method": "notifications/initialized" }));
        assert!(none.is_none());
        let ping = s
            .handle(&json!({ "jsonrpc": "2.0", "id": "p", "method": "ping" }))
            .expect("pong");
        assert_eq!(ping, json!({ "jsonrpc": "2.0", "id": "p", "result": {} }));
        let list = s
            .handle(&json!({ "jsonrpc": "2.0", "id": 2, "method": "tools/list" }))
            .expect("tools");
        assert_eq!(list["result"]["tools"].as_array().map(Vec::len), Some(6));
        let unknown = s
            .handle(&json!({ "jsonrpc": "2.0", "id": 3, "method": "resources/list" }))
            .expect("error");
        assert_eq!(unknown["error"]["code"], -32601);
        let old = s
            .handle(&json!({ "jsonrpc": "1.0", "id": 4, "method": "ping" }))
            .expect("error");
        assert_eq!(old["error"]["code"], -32600);
        let no_tool = s
            .handle(&json!({ "jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": { "name": "rm_rf" } }))
            .expect("error");
        assert_eq!(no_tool["error"]["code"], -32602);
    }

    #[test]
    fn refusals_say_what_and_why() {
        let s = session(Limits {
            calls: 4,
            ..Limits::default()
        });
        let (text, err) = call(
            &s,
            "run_command",
            json!({ "sandbox": "sb-x", "command": "id" }),
        );
        assert!(
            err && text.contains("not created by this MCP client"),
            "{text}"
        );
        let (text, err) = call(&s, "read_file", json!({ "path": "/etc/passwd" }));
        assert!(err && text.contains("`sandbox`"), "{text}");
        let (text, err) = call(&s, "create_sandbox", json!({ "ttl_s": -1 }));
        assert!(err && text.contains("`ttl_s`"), "{text}");
        let (text, err) = call(&s, "create_sandbox", json!({}));
        assert!(
            err && text.contains("cannot reach the husk daemon"),
            "{text}"
        );
        assert!(s.owned().is_empty(), "a failed create holds nothing");
        let (text, err) = call(&s, "destroy_sandbox", json!({ "sandbox": "sb-x" }));
        assert!(err && text.contains("its 4 calls"), "{text}");
    }

    #[test]
    fn the_stdio_loop_answers_garbage_and_batches() {
        let s = Arc::new(session(Limits::default()));
        let input = b"not json\n\n[{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\"},{\"jsonrpc\":\"2.0\",\"method\":\"notifications/x\"}]\n";
        let out = Arc::new(Mutex::new(Vec::new()));
        struct Sink(Arc<Mutex<Vec<u8>>>);
        impl Write for Sink {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().expect("lock").extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        serve(s, &input[..], Sink(out.clone())).expect("serve");
        let text = String::from_utf8(out.lock().expect("lock").clone()).expect("utf-8");
        let replies: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect();
        assert_eq!(replies.len(), 2, "{text}");
        assert!(replies.iter().any(|r| r["error"]["code"] == -32700));
        assert!(replies
            .iter()
            .any(|r| r["id"] == 1 && r["result"] == json!({})));
    }
}
