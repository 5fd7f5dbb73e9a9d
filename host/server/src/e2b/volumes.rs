//! E2B's named volumes (`/volumes`): husk-core's named volumes; E2B's
//! volume-content API (files of an unmounted volume) is not served.

use super::*;

/// A volume as E2B shows it. Its `token` is for E2B's volume-content API
/// (files of an unmounted volume), which husk does not serve: empty.
fn volume_json(v: &VolumeInfo) -> Value {
    json!({ "volumeID": v.id, "name": v.name, "token": "" })
}

pub(super) async fn create_volume(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let req: VolumeRequest = rest_json(&body, "volume request")?;
    let v = blocking(move || {
        e2b.daemon
            .create_volume(&req.name, "e2b")
            .map_err(RestError::from)
    })
    .await?;
    Ok((StatusCode::CREATED, axum::Json(volume_json(&v))).into_response())
}

pub(super) async fn list_volumes(
    State(e2b): State<Shared>,
    headers: HeaderMap,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let list = blocking(move || e2b.daemon.volumes().map_err(RestError::from)).await?;
    let list: Vec<Value> = list
        .iter()
        .map(|v| json!({ "volumeID": v.id, "name": v.name }))
        .collect();
    Ok(axum::Json(list).into_response())
}

pub(super) async fn volume(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let v = blocking(move || e2b.daemon.volume(&id).map_err(RestError::from)).await?;
    Ok(axum::Json(volume_json(&v)).into_response())
}

pub(super) async fn delete_volume(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    blocking(move || {
        e2b.daemon
            .delete_volume(&id, "e2b")
            .map_err(RestError::from)
    })
    .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
