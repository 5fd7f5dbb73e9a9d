//! `/v1/sandboxes/{id}/health` and `/v1/sandboxes/{id}/watch`: a sandbox's
//! guest as its agent reports it.

use super::*;

pub(super) async fn health(State(d): State<Shared>, Path(id): Path<String>) -> ApiResult<Response> {
    let h = blocking(move || d.guest_health(&id)).await?;
    Ok(ok(StatusCode::OK, h))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct WatchQuery {
    path: String,
    recursive: Option<bool>,
}

/// Changes under a guest directory as NDJSON: `{"watching": PATH}` first,
/// then one `{"kind", "path", "is_dir"}` per change (`Overflow`: some were
/// dropped, list the directory again), until the client goes.
pub(super) async fn watch(
    State(d): State<Shared>,
    Path(id): Path<String>,
    q: Result<Query<WatchQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Response> {
    let Query(q) = q.map_err(|e| bad(format!("bad query: {e} (path=/dir[&recursive=true])")))?;
    let (started_tx, started_rx) = oneshot::channel::<Result<(), DaemonError>>();
    let (tx, rx) = mpsc::channel(32);
    tokio::task::spawn_blocking(move || {
        let mut started = Some(started_tx);
        let gone = tx.clone();
        let watched = d.watch_dir(
            &id,
            &q.path,
            q.recursive.unwrap_or(false),
            |events| {
                if let Some(s) = started.take() {
                    let _ = s.send(Ok(()));
                    return tx
                        .blocking_send(Ok(line(&serde_json::json!({ "watching": q.path }))))
                        .is_ok();
                }
                events.iter().all(|e| tx.blocking_send(Ok(line(e))).is_ok())
            },
            move || !gone.is_closed(),
        );
        match (watched, started) {
            (Err(e), Some(s)) => drop(s.send(Err(e))),
            (Err(e), None) => {
                let _ = tx.blocking_send(Ok(line(&serde_json::json!({ "error": e.to_string() }))));
            }
            _ => {}
        }
    });
    match started_rx.await {
        Ok(Ok(())) => Ok(ndjson(rx)),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            "watch worker ended".into(),
        )),
    }
}
