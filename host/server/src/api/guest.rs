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
    stream_lines(
        move |send, wanted| {
            let mut first = true;
            d.watch_dir(
                &id,
                &q.path,
                q.recursive.unwrap_or(false),
                |events| {
                    if std::mem::take(&mut first) {
                        return send(line(&serde_json::json!({ "watching": q.path })));
                    }
                    events.iter().all(|e| send(line(e)))
                },
                wanted,
            )
        },
        |e| line(&serde_json::json!({ "error": e.to_string() })),
    )
    .await
}
