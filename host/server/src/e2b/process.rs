//! envd's `process.Process` service, translated onto husk-core's process
//! table (`Daemon::start_process` and its kin), as every front-end's
//! programs are: E2B's commands and terminals are listed by `husk ps`, the
//! REST API and MCP alike, count against `--max-processes`, and keep their
//! output in the guest's ring for a client that comes back.
//!
//! E2B's protocol has no word for lost output, so its readers hold their
//! program (`Reading::Held`): a client slow to read slows the program
//! instead of missing bytes, as envd does. How far E2B's clients have had
//! each program's output is kept (`E2b::relayed`), so a `Connect` after a
//! disconnect goes on from there: what the program wrote meanwhile, as far
//! as its ring kept it, then what comes. A program whose end was relayed is
//! removed from the table.

use husk_core::daemon::{ProcessOutput, Reading};
use husk_protocol::Stream;
use husk_types::{ProcessExit, ProcessSpec, TerminalSize};

use super::*;

/// `StreamInput` (client streaming): a `start` naming the process, then
/// `data` messages whose input goes to its stdin (or terminal) as each
/// arrives, and `keepalive`s; the end of the request body ends it. Answered
/// with the end-of-stream envelope, or one that carries the error.
pub(super) async fn stream_input(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    use tokio_stream::StreamExt;
    let id = match envd_sandbox(&e2b, &headers) {
        Ok(id) => id,
        Err(r) => return r.into_response(),
    };
    let mut chunks = body.into_data_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut input = None;
    let outcome: Result<(), RpcError> = async {
        loop {
            // Whole envelopes first; then more of the body.
            while let Some((json, taken)) = envelope_in(&buf)? {
                let msg: Value = serde_json::from_slice(json)
                    .map_err(|e| RpcError("invalid_argument", format!("a message: {e}")))?;
                buf.drain(..taken);
                if let Some(start) = msg.get("start") {
                    let (e, id, start) = (e2b.clone(), id.clone(), start.clone());
                    input = Some(
                        blocking(move || {
                            let pid = pid_of(&e, &id, &start)?;
                            Ok::<_, RpcError>(e.daemon.process_input(&id, pid)?)
                        })
                        .await?,
                    );
                } else if let Some(data) = msg.get("data") {
                    let input = input.as_ref().ok_or_else(|| {
                        RpcError("failed_precondition", "data before `start`".into())
                    })?;
                    let bytes = input_bytes(&data["input"]);
                    // A write to the agent's socket: short, but it may wait
                    // for a slow guest.
                    tokio::task::block_in_place(|| input.write(&bytes))?;
                }
            }
            match chunks.next().await {
                Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
                Some(Err(e)) => return Err(RpcError("canceled", format!("the request: {e}"))),
                None if buf.is_empty() => return Ok(()),
                None => return Err(RpcError("invalid_argument", "a cut message".into())),
            }
        }
    }
    .await;
    // A client stream's answer: its one (empty) message, then the end of
    // the stream; or only the end, carrying the error.
    let mut answer = Vec::new();
    match outcome {
        Ok(()) => {
            answer.extend_from_slice(&envelope(0, &json!({})));
            answer.extend_from_slice(&envelope(2, &json!({})));
        }
        Err(e) => answer.extend_from_slice(&envelope(2, &json!({ "error": e.json() }))),
    }
    ([(header::CONTENT_TYPE, "application/connect+json")], answer).into_response()
}

/// The bytes of a `ProcessInput` (`{stdin}` or `{pty}`, base64).
fn input_bytes(input: &Value) -> Vec<u8> {
    input["stdin"]
        .as_str()
        .or_else(|| input["pty"].as_str())
        .map(decode_b64)
        .unwrap_or_default()
}

/// The pid a `ProcessSelector` (`{process: {pid}}` or `{process: {tag}}`)
/// names in sandbox `id`: a tag names its running program.
fn pid_of(e2b: &E2b, id: &str, msg: &Value) -> Result<i32, RpcError> {
    let selector = &msg["process"];
    let pid = selector["pid"]
        .as_i64()
        .or_else(|| selector["pid"].as_str().and_then(|s| s.parse().ok()));
    if let Some(pid) = pid {
        return i32::try_from(pid).map_err(|_| RpcError("invalid_argument", format!("pid {pid}")));
    }
    let Some(tag) = selector["tag"].as_str() else {
        return Err(RpcError(
            "invalid_argument",
            "`process.pid` or `process.tag` is required".into(),
        ));
    };
    e2b.daemon
        .processes(id)?
        .into_iter()
        .find(|p| p.exit.is_none() && p.tag.as_deref() == Some(tag))
        .map(|p| p.pid)
        .ok_or_else(|| RpcError("not_found", format!("no running process tagged `{tag}`")))
}

fn signal_number(name: &str) -> Option<i32> {
    match name {
        "SIGNAL_SIGKILL" | "SIGKILL" | "9" => Some(libc::SIGKILL),
        "SIGNAL_SIGTERM" | "SIGTERM" | "15" => Some(libc::SIGTERM),
        _ => None,
    }
}

/// The message a program's end becomes: its `end` event, or the error
/// envd ends the stream with where the program was killed at its timeout
/// or past its output limit.
fn end_message(exit: &ProcessExit) -> Result<Value, RpcError> {
    if exit.timed_out {
        return Err(RpcError(
            "deadline_exceeded",
            "the program ran past its timeout and was killed".into(),
        ));
    }
    if exit.over_limit {
        return Err(RpcError(
            "resource_exhausted",
            "the program wrote past its output limit and was killed".into(),
        ));
    }
    Ok(match (exit.code, exit.signal) {
        (Some(c), _) => json!({ "event": { "end": {
            "exitCode": c, "exited": true, "status": format!("exit status {c}") } } }),
        (None, s) => json!({ "event": { "end": {
            "exitCode": -1, "exited": false,
            "status": format!("signal: {}", s.unwrap_or(libc::SIGKILL)) } } }),
    })
}

/// Relays program `pid`'s output, from where E2B's clients last had it,
/// and its end, to `tx` (after a `start` event), holding the program while
/// `tx`'s client reads; the program is removed once its end is relayed.
fn relay(e2b: &E2b, id: &str, pid: i32, pty: bool, tx: mpsc::Sender<Result<Value, RpcError>>) {
    let key = (id.to_owned(), pid);
    let from = lock(&e2b.relayed).get(&key).copied().unwrap_or(0);
    let _ = tx.blocking_send(Ok(json!({ "event": { "start": { "pid": pid } } })));
    let mut ended = false;
    let read = e2b.daemon.read_process(
        id,
        pid,
        (from, Reading::Held),
        |output| {
            let msg = match output {
                ProcessOutput::Data {
                    offset,
                    stream,
                    data,
                } => {
                    lock(&e2b.relayed).insert(key.clone(), offset + data.len() as u64);
                    let kind = match (pty, stream) {
                        (true, _) => "pty",
                        (false, Stream::Stdout) => "stdout",
                        (false, Stream::Stderr) => "stderr",
                    };
                    Ok(json!({ "event": { "data": { kind: b64(&data) } } }))
                }
                ProcessOutput::Exit { exit, .. } => {
                    ended = true;
                    end_message(&exit)
                }
                // A held reader loses nothing after it starts; what a
                // client that went away missed beyond the ring is gone
                // (E2B cannot say so).
                ProcessOutput::Replay { .. }
                | ProcessOutput::Lost { .. }
                | ProcessOutput::Caught { .. } => return true,
            };
            tx.blocking_send(msg).is_ok()
        },
        || !tx.is_closed(),
    );
    match read {
        Err(e) => {
            let _ = tx.blocking_send(Err(e.into()));
        }
        Ok(()) if ended => {
            lock(&e2b.relayed).remove(&key);
            if let Err(e) = e2b.daemon.remove_process(id, pid) {
                tracing::debug!(sandbox = %id, pid, "an E2B program ended but stays listed: {e}");
            }
        }
        Ok(()) => {}
    }
}

pub(super) async fn process_rpc(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(method): Path<String>,
    body: Bytes,
) -> Response {
    let id = match envd_sandbox(&e2b, &headers) {
        Ok(id) => id,
        Err(r) => return r.into_response(),
    };
    let msg = match request_message(&headers, &body) {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    let e = e2b.clone();
    match method.as_str() {
        "Start" => {
            let timeout_ms: Option<u64> = headers
                .get("connect-timeout-ms")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .filter(|t| *t > 0);
            let name = user_name(&headers, None);
            let (tx, rx) = mpsc::channel(64);
            std::thread::spawn(move || {
                let started = e
                    .user_of(&id, &name)
                    .and_then(|user| start(&e, &id, &msg, &user, timeout_ms));
                match started {
                    Ok((pid, pty)) => relay(&e, &id, pid, pty, tx),
                    Err(e) => {
                        let _ = tx.blocking_send(Err(e));
                    }
                }
            });
            stream_response(rx, json!({ "event": { "keepalive": {} } }))
        }
        "Connect" => {
            let (tx, rx) = mpsc::channel(64);
            std::thread::spawn(move || {
                let found = pid_of(&e, &id, &msg).and_then(|pid| {
                    let p = e.daemon.process(&id, pid)?;
                    Ok((pid, p.terminal))
                });
                match found {
                    Ok((pid, pty)) => relay(&e, &id, pid, pty, tx),
                    Err(e) => {
                        let _ = tx.blocking_send(Err(e));
                    }
                }
            });
            stream_response(rx, json!({ "event": { "keepalive": {} } }))
        }
        "List" => unary(
            blocking(move || {
                let processes: Vec<Value> = e
                    .daemon
                    .processes(&id)?
                    .iter()
                    .filter(|p| p.exit.is_none())
                    .map(|p| {
                        let mut info = json!({ "pid": p.pid, "config": {
                            "cmd": p.argv.first().cloned().unwrap_or_default(),
                            "args": p.argv.get(1..).unwrap_or_default(),
                            "envs": {} } });
                        if let Some(tag) = &p.tag {
                            info["tag"] = json!(tag);
                        }
                        info
                    })
                    .collect();
                Ok(json!({ "processes": processes }))
            })
            .await,
        ),
        "SendSignal" => unary(
            blocking(move || {
                let pid = pid_of(&e, &id, &msg)?;
                let sig = msg["signal"].as_str().unwrap_or_default();
                let sig = signal_number(sig)
                    .ok_or_else(|| RpcError("invalid_argument", format!("signal `{sig}`")))?;
                // envd forgets a program as it ends: an ended one is not
                // found (the SDK's kill then answers false).
                e.daemon
                    .signal_process(&id, ENVD_WHO, pid, sig)
                    .map_err(|err| match err {
                        DaemonError::Conflict(m) => RpcError("not_found", m),
                        other => other.into(),
                    })?;
                Ok(json!({}))
            })
            .await,
        ),
        "SendInput" => unary(
            blocking(move || {
                let pid = pid_of(&e, &id, &msg)?;
                let data = input_bytes(&msg["input"]);
                e.daemon.write_process_stdin(&id, pid, &data, false)?;
                Ok(json!({}))
            })
            .await,
        ),
        "Update" => unary(
            blocking(move || {
                let pid = pid_of(&e, &id, &msg)?;
                let size = &msg["pty"]["size"];
                let dim = |k: &str| {
                    size[k]
                        .as_u64()
                        .map(|v| v.clamp(1, 1000) as u16)
                        .ok_or_else(|| RpcError("invalid_argument", format!("`pty.size.{k}`")))
                };
                e.daemon
                    .resize_process(&id, pid, dim("rows")?, dim("cols")?)?;
                Ok(json!({}))
            })
            .await,
        ),
        "CloseStdin" => unary(
            blocking(move || {
                let pid = pid_of(&e, &id, &msg)?;
                e.daemon.write_process_stdin(&id, pid, &[], true)?;
                Ok(json!({}))
            })
            .await,
        ),
        other => RpcError(
            "unimplemented",
            format!("process.Process/{other} is not served by husk"),
        )
        .into_response(),
    }
}

/// Starts a `Start` request's program in sandbox `id` as `user`, in the
/// process table: its pid, and whether it runs on a terminal.
fn start(
    e2b: &E2b,
    id: &str,
    msg: &Value,
    user: &GuestUser,
    timeout_ms: Option<u64>,
) -> Result<(i32, bool), RpcError> {
    let p = &msg["process"];
    let terminal = if msg["pty"].is_null() {
        None
    } else {
        let size = &msg["pty"]["size"];
        let dim = |k: &str, default| {
            size[k]
                .as_u64()
                .map_or(default, |v| v.clamp(1, 1000) as u16)
        };
        Some(TerminalSize {
            rows: dim("rows", 24),
            cols: dim("cols", 80),
        })
    };
    let cmd = p["cmd"]
        .as_str()
        .ok_or_else(|| RpcError("invalid_argument", "`process.cmd` is required".into()))?;
    let mut argv = vec![cmd.to_owned()];
    if let Some(args) = p["args"].as_array() {
        argv.extend(args.iter().filter_map(|a| a.as_str().map(str::to_owned)));
    }
    let mut env = lock(&e2b.envs).get(id).cloned().unwrap_or_default();
    env.insert("HOME".into(), user.home.clone());
    env.insert("USER".into(), user.name.clone());
    env.insert("LOGNAME".into(), user.name.clone());
    env.insert(
        "PATH".into(),
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
    );
    if let Some(envs) = p["envs"].as_object() {
        for (k, v) in envs {
            if let Some(v) = v.as_str() {
                env.insert(k.clone(), v.to_owned());
            }
        }
    }
    let cwd = p["cwd"]
        .as_str()
        .map(|c| resolve(user, c))
        .unwrap_or_else(|| user.home.clone());
    let spec = ProcessSpec {
        argv,
        env,
        cwd: Some(cwd),
        user: Some(husk_protocol::User {
            uid: user.uid,
            gid: user.gid,
        }),
        stdin: msg["stdin"].as_bool().unwrap_or(false),
        terminal,
        timeout_ms,
        tag: msg["tag"].as_str().map(str::to_owned),
        ..Default::default()
    };
    let started = e2b.daemon.start_process(id, ENVD_WHO, spec)?;
    Ok((started.pid, started.terminal))
}
