//! E2B's snapshots (SDK 2.63): `POST /sandboxes/{id}/snapshots`,
//! `GET /snapshots` and `DELETE /templates/{id}`. A snapshot is a husk
//! template made from the running sandbox (its memory, disk and running
//! programs; the source runs on), so `Sandbox.create(<snapshot id>)`
//! restores it as any template, and it outlives its sandbox and the
//! daemon's restarts as templates do. The forks' own templates (see
//! [`super::FORK_TEMPLATE`]) are not listed.

use super::*;

/// A snapshot request, as the SDK sends it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotBody {
    /// The template's name (made up when absent).
    name: Option<String>,
    /// Whether memory is kept (E2B's default: yes).
    memory: Option<bool>,
}

/// `POST /sandboxes/{id}/snapshots`.
pub(super) async fn create_snapshot(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let body: SnapshotBody = rest_json_or_default(&body, "snapshot request")?;
    memory_kept(body.memory, "snapshot")?;
    let name = body
        .name
        .unwrap_or_else(|| format!("snapshot-{id}-{}", husk_core::store::now_unix_ms()));
    if name.starts_with(FORK_TEMPLATE) {
        return Err(RestError(
            StatusCode::BAD_REQUEST,
            format!("a snapshot's name may not begin with `{FORK_TEMPLATE}` (forks' templates)"),
        ));
    }
    let e = e2b.clone();
    let t = blocking(move || Ok::<_, RestError>(e.daemon.snapshot(&id, &name, "e2b")?)).await?;
    Ok((StatusCode::CREATED, axum::Json(snapshot_json(&t))).into_response())
}

/// How the SDK reads a snapshot.
fn snapshot_json(t: &husk_types::TemplateRecord) -> Value {
    json!({ "snapshotID": t.id, "names": [t.name] })
}

/// `GET /snapshots` query.
#[derive(Debug, Default, Deserialize)]
pub(super) struct SnapshotQuery {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
    name: Option<String>,
    limit: Option<usize>,
    #[serde(rename = "nextToken")]
    next_token: Option<String>,
}

/// `GET /snapshots`: the templates made from sandboxes, oldest first,
/// those of one sandbox or by one name or id when asked; paged by
/// `limit` with `x-next-token`.
pub(super) async fn list_snapshots(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<SnapshotQuery>,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let e = e2b.clone();
    let mut snapshots: Vec<husk_types::TemplateRecord> =
        blocking(move || Ok::<_, RestError>(e.daemon.templates()?)).await?;
    snapshots.retain(|t| {
        t.source.starts_with(husk_core::template::FROM_SANDBOX)
            && !t.name.starts_with(FORK_TEMPLATE)
            && q.sandbox_id
                .as_ref()
                .is_none_or(|s| t.source == format!("{}{s}", husk_core::template::FROM_SANDBOX))
            && q.name.as_ref().is_none_or(|n| t.name == *n || t.id == *n)
    });
    snapshots.sort_by_key(|t| t.created_unix_ms);
    paged(
        snapshots.iter().map(snapshot_json).collect(),
        q.limit,
        q.next_token.as_deref(),
    )
}

/// `DELETE /templates/{id}` (the SDK's `delete_snapshot`): refused while
/// a sandbox is restored from it.
pub(super) async fn delete_template(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let e = e2b.clone();
    blocking(move || Ok::<_, RestError>(e.daemon.remove_template(&id, "e2b")?)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
