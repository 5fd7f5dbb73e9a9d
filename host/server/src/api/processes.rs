//! `/v1/sandboxes/{id}/processes`: the sandbox's programs (see
//! `husk_core::daemon` `start_process` and its neighbours): start one in
//! the background, list them, read one's output from an offset as NDJSON,
//! write its stdin, signal it, resize its terminal, remove it; and a
//! WebSocket per program for interactive use (`terminal`).

use super::*;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use husk_core::daemon::{ProcessOutput, Reading};
use husk_types::{ProcessEvent, ProcessSpec, SignalName, SignalRequest, TerminalSize};

pub(super) async fn start(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let spec: ProcessSpec = json(&body)?;
    let p = blocking(move || d.start_process(&id, &who.0, spec)).await?;
    Ok(ok(StatusCode::CREATED, p))
}

pub(super) async fn list(State(d): State<Shared>, Path(id): Path<String>) -> ApiResult<Response> {
    let list = blocking(move || d.processes(&id)).await?;
    Ok(ok(StatusCode::OK, list))
}

/// A pid in a path: a number, or a clear refusal.
fn pid_of(pid: &str) -> ApiResult<i32> {
    pid.parse::<i32>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| bad(format!("`{pid}` is not a pid")))
}

pub(super) async fn get(
    State(d): State<Shared>,
    Path((id, pid)): Path<(String, String)>,
) -> ApiResult<Response> {
    let pid = pid_of(&pid)?;
    let p = blocking(move || d.process(&id, pid)).await?;
    Ok(ok(StatusCode::OK, p))
}

pub(super) async fn remove(
    State(d): State<Shared>,
    Path((id, pid)): Path<(String, String)>,
) -> ApiResult<Response> {
    let pid = pid_of(&pid)?;
    blocking(move || d.remove_process(&id, pid)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct OutputQuery {
    /// The offset to read from (default 0: all that is kept).
    from: Option<u64>,
    /// Go on with live output until the program ends (default true).
    follow: Option<bool>,
    /// End the stream once this text was written (a `matched` event): wait
    /// for a log line.
    until: Option<String>,
}

pub(super) async fn output(
    State(d): State<Shared>,
    Path((id, pid)): Path<(String, String)>,
    q: Result<Query<OutputQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Response> {
    let pid = pid_of(&pid)?;
    let Query(q) = q.map_err(|e| bad(format!("bad query: {e}")))?;
    let (from, follow) = (q.from.unwrap_or(0), q.follow.unwrap_or(true));
    let mut until = match q.until.as_deref() {
        Some("") => return Err(bad("`until` is empty: name the text to wait for")),
        Some(text) => Some(husk_types::OutputMatch::new(text.as_bytes())),
        None => None,
    };
    stream_lines(
        move |send, wanted| {
            let how = match follow {
                true => Reading::Follow,
                false => Reading::Kept,
            };
            d.read_process(
                &id,
                pid,
                (from, how),
                |output| {
                    let matched = match (&mut until, &output) {
                        (Some(m), ProcessOutput::Data { offset, data, .. }) => {
                            m.feed(*offset, data)
                        }
                        (Some(m), ProcessOutput::Lost { .. }) => {
                            m.gap();
                            None
                        }
                        _ => None,
                    };
                    if !send(line(&output.event())) {
                        return false;
                    }
                    match matched {
                        Some(offset) => {
                            send(line(&ProcessEvent::Matched { offset }));
                            false
                        }
                        None => true,
                    }
                },
                wanted,
            )
        },
        |e| {
            line(&ProcessEvent::Error {
                kind: match &e {
                    DaemonError::Agent(c) => c.kind(),
                    _ => None,
                },
                error: e.to_string(),
            })
        },
    )
    .await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct StdinQuery {
    /// End the input after these bytes.
    close: Option<bool>,
}

pub(super) async fn stdin(
    State(d): State<Shared>,
    Path((id, pid)): Path<(String, String)>,
    q: Result<Query<StdinQuery>, axum::extract::rejection::QueryRejection>,
    body: Bytes,
) -> ApiResult<Response> {
    let pid = pid_of(&pid)?;
    let Query(q) = q.map_err(|e| bad(format!("bad query: {e}")))?;
    let close = q.close.unwrap_or(false);
    blocking(move || d.write_process_stdin(&id, pid, &body, close)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub(super) async fn signal(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path((id, pid)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<Response> {
    let pid = pid_of(&pid)?;
    let SignalRequest { signal } = json(&body)?;
    let number = signal.number().ok_or_else(|| {
        bad(format!(
            "`{signal:?}` is not a signal: name one (TERM, INT, KILL, HUP...) or give its number"
        ))
    })?;
    blocking(move || d.signal_process(&id, &who.0, pid, number)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub(super) async fn resize(
    State(d): State<Shared>,
    Path((id, pid)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<Response> {
    let pid = pid_of(&pid)?;
    let TerminalSize { rows, cols } = json(&body)?;
    if rows == 0 || cols == 0 {
        return Err(bad("`rows` and `cols` must be at least 1"));
    }
    blocking(move || d.resize_process(&id, pid, rows, cols)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TerminalQuery {
    /// The offset of its output to start from (default 0).
    from: Option<u64>,
}

/// What a terminal's client sends as text: control, not input.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
enum Control {
    Resize(TerminalSize),
    Signal(SignalName),
    CloseStdin(bool),
}

/// An output event other than stdout, as a terminal's text frame.
fn text_frame(event: &ProcessEvent) -> Message {
    Message::Text(serde_json::to_string(event).unwrap_or_default().into())
}

/// A program's input, as the WebSocket's reader hands it to the thread
/// that writes it.
enum Input {
    Data(Vec<u8>),
    Resize(TerminalSize),
    Close,
}

/// `GET .../processes/{pid}/terminal`: a WebSocket for interactive use.
/// Binary frames both ways are the program's stdin and its output (its
/// terminal's, or its stdout); text frames from the client are control
/// (`{"resize": {"rows", "cols"}}`, `{"signal": "INT"}`, `{"close_stdin":
/// true}`); text frames from husk are the output stream's other events
/// (`replay` first, `stderr`, `lost`, then `exit` and a close).
pub(super) async fn terminal(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path((id, pid)): Path<(String, String)>,
    q: Result<Query<TerminalQuery>, axum::extract::rejection::QueryRejection>,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> ApiResult<Response> {
    let pid = pid_of(&pid)?;
    let Query(q) = q.map_err(|e| bad(format!("bad query: {e}")))?;
    // Refused before the upgrade: no program, or one without input.
    let input = {
        let (d, id) = (d.clone(), id.clone());
        blocking(move || d.process_input(&id, pid)).await?
    };
    let ws = ws.map_err(|e| bad(format!("not a WebSocket upgrade: {e}")))?;
    let from = q.from.unwrap_or(0);
    Ok(ws.on_upgrade(move |socket| serve_terminal(d, id, who.0, pid, from, input, socket)))
}

async fn serve_terminal(
    d: Shared,
    id: String,
    who: String,
    pid: i32,
    from: u64,
    input: husk_core::daemon::ProcessInput,
    mut socket: WebSocket,
) {
    // Output: read by a thread, handed over as frames.
    let (out_tx, mut out_rx) = mpsc::channel::<Message>(64);
    {
        let (d, id) = (d.clone(), id.clone());
        let gone = out_tx.clone();
        tokio::task::spawn_blocking(move || {
            let read = d.read_process(
                &id,
                pid,
                (from, Reading::Follow),
                |output| {
                    let frame = match output {
                        ProcessOutput::Data {
                            stream: Stream::Stdout,
                            data,
                            ..
                        } => Message::Binary(data.into()),
                        other => text_frame(&other.event()),
                    };
                    out_tx.blocking_send(frame).is_ok()
                },
                move || !gone.is_closed(),
            );
            if let Err(e) = read {
                let event = ProcessEvent::Error {
                    kind: None,
                    error: e.to_string(),
                };
                let _ = out_tx.blocking_send(text_frame(&event));
            }
        });
    }
    // Input: written by a thread (a slow guest blocks it, not the runtime).
    let (in_tx, mut in_rx) = mpsc::channel::<Input>(64);
    std::thread::spawn(move || {
        while let Some(i) = in_rx.blocking_recv() {
            let sent = match i {
                Input::Data(data) => input.write(&data),
                Input::Resize(s) => input.resize(s.rows, s.cols),
                Input::Close => input.close(),
            };
            if let Err(e) = sent {
                tracing::debug!(pid, "terminal input: {e}");
            }
        }
    });
    loop {
        tokio::select! {
            out = out_rx.recv() => match out {
                Some(frame) => {
                    if socket.send(frame).await.is_err() {
                        break;
                    }
                }
                // The program ended and all its output went.
                None => {
                    let _ = socket.send(Message::Close(None)).await;
                    break;
                }
            },
            msg = socket.recv() => match msg {
                Some(Ok(Message::Binary(data))) => {
                    if in_tx.send(Input::Data(data.to_vec())).await.is_err() {
                        break;
                    }
                }
                Some(Ok(Message::Text(text))) => {
                    let control = match serde_json::from_str::<Control>(text.as_str()) {
                        Ok(c) => c,
                        Err(e) => {
                            let event = ProcessEvent::Error {
                                kind: None,
                                error: format!(
                                    "a text frame is control: {{\"resize\": {{\"rows\", \"cols\"}}}}, \
                                     {{\"signal\": \"INT\"}} or {{\"close_stdin\": true}} ({e}); \
                                     input goes in binary frames"
                                ),
                            };
                            let _ = socket.send(text_frame(&event)).await;
                            continue;
                        }
                    };
                    let sent = match control {
                        Control::Resize(size) => in_tx.send(Input::Resize(size)).await.is_ok(),
                        Control::CloseStdin(true) => in_tx.send(Input::Close).await.is_ok(),
                        Control::CloseStdin(false) => true,
                        Control::Signal(signal) => {
                            if let Some(n) = signal.number() {
                                let (d, id, who) = (d.clone(), id.clone(), who.clone());
                                let _ = blocking(move || d.signal_process(&id, &who, pid, n)).await;
                            }
                            true
                        }
                    };
                    if !sent {
                        break;
                    }
                }
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => {}
            },
        }
    }
}
