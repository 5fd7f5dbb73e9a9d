//! `/v1/sandboxes/{id}/processes`: the sandbox's programs (see
//! `husk_core::daemon` `start_process` and its neighbours): start one in
//! the background, list them, read one's output from an offset as NDJSON,
//! write its stdin, signal it, resize its terminal, remove it.

use super::*;
use husk_types::{ProcessEvent, ProcessSpec, SignalRequest, TerminalSize};

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
}

pub(super) async fn output(
    State(d): State<Shared>,
    Path((id, pid)): Path<(String, String)>,
    q: Result<Query<OutputQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Response> {
    let pid = pid_of(&pid)?;
    let Query(q) = q.map_err(|e| bad(format!("bad query: {e}")))?;
    let (from, follow) = (q.from.unwrap_or(0), q.follow.unwrap_or(true));
    let (started_tx, started_rx) = oneshot::channel::<Result<(), DaemonError>>();
    let (tx, rx) = mpsc::channel(32);
    tokio::task::spawn_blocking(move || {
        let mut started = Some(started_tx);
        let read = d.read_process(&id, pid, from, follow, |event| {
            if let Some(s) = started.take() {
                let _ = s.send(Ok(()));
            }
            tx.blocking_send(Ok(line(&event))).is_ok()
        });
        match (read, started) {
            (Err(e), Some(s)) => drop(s.send(Err(e))),
            (Err(e), None) => {
                let event = ProcessEvent::Error {
                    kind: match &e {
                        DaemonError::Agent(c) => c.kind(),
                        _ => None,
                    },
                    error: e.to_string(),
                };
                let _ = tx.blocking_send(Ok(line(&event)));
            }
            _ => {}
        }
    });
    match started_rx.await {
        Ok(Ok(())) => Ok(ndjson(rx)),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            "output worker ended".into(),
        )),
    }
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
