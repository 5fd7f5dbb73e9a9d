//! The daemon's HTTP/JSON API (`husk serve`), described by
//! `host/openapi.json` (a test checks the two agree). On the Unix socket
//! the socket's permissions are the access control; on TCP every request
//! needs `Authorization: Bearer <token>`.
//!
//! Long answers stream as they come: exec output and template build
//! progress as NDJSON (one JSON object per line), file contents as raw
//! bytes; an upload is written to the guest as it arrives. No request
//! holds a whole file in the daemon's memory.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::connect_info::ConnectInfo;
use axum::extract::{DefaultBodyLimit, Path, Query, RawQuery, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, patch, post, put};
use axum::{Extension, Router};
use base64::Engine;
use husk_protocol::{ErrorKind, ExecRequest, Stream, Termination};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;

use husk_agent_client::{AgentClient, ClientError, Event};
use husk_core::daemon::{Daemon, DaemonError};
use husk_core::template::TemplateError;
use husk_core::upload::UploadError;
use husk_types::{
    BuildEvent, CreateRequest, ExecEvent, ExecSpec, ForkRequest, Forked, Killed, PoolSize,
    SandboxState, SandboxUpdate, SnapshotRequest, TemplateSpec, VolumeRequest,
};

use crate::mcp::HttpService;
pub use crate::peer::Peer;

mod guest;
mod processes;

/// Largest JSON request body.
pub const MAX_JSON: usize = 1 << 20;
/// Most bytes of a console `logs` returns (its end).
const MAX_LOGS: u64 = 256 << 10;

type Shared = Arc<Daemon>;

/// An API error: a status and `{"error": message}`.
#[derive(Debug)]
pub struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        #[derive(Serialize)]
        struct Body<'a> {
            error: &'a str,
        }
        (self.0, axum::Json(Body { error: &self.1 })).into_response()
    }
}

impl From<DaemonError> for ApiError {
    fn from(e: DaemonError) -> Self {
        ApiError(daemon_status(&e), e.to_string())
    }
}

/// The HTTP status of a daemon error, the same on every API it serves.
pub(crate) fn daemon_status(e: &DaemonError) -> StatusCode {
    match e {
        DaemonError::NotFound(_) => StatusCode::NOT_FOUND,
        DaemonError::Invalid(_) => StatusCode::BAD_REQUEST,
        DaemonError::Conflict(_) => StatusCode::CONFLICT,
        DaemonError::Limit(_) => StatusCode::TOO_MANY_REQUESTS,
        DaemonError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        DaemonError::Template(TemplateError::Invalid(_)) => StatusCode::BAD_REQUEST,
        DaemonError::Template(TemplateError::Corrupt(_)) => StatusCode::CONFLICT,
        DaemonError::Template(TemplateError::Forbidden(_)) => StatusCode::FORBIDDEN,
        DaemonError::Template(TemplateError::Upload(UploadError::NotFound(_)))
        | DaemonError::Upload(UploadError::NotFound(_)) => StatusCode::NOT_FOUND,
        DaemonError::Upload(UploadError::TooLarge(_)) => StatusCode::PAYLOAD_TOO_LARGE,
        DaemonError::Upload(UploadError::Body(_)) => StatusCode::BAD_REQUEST,
        DaemonError::Agent(c) => agent_status(c),
        DaemonError::Unreachable(_) => StatusCode::BAD_GATEWAY,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn agent_status(e: &ClientError) -> StatusCode {
    match e.kind() {
        Some(ErrorKind::NotFound) => StatusCode::NOT_FOUND,
        Some(ErrorKind::PermissionDenied) => StatusCode::FORBIDDEN,
        Some(ErrorKind::Invalid | ErrorKind::Malformed | ErrorKind::TooLarge) => {
            StatusCode::BAD_REQUEST
        }
        Some(ErrorKind::Conflict) => StatusCode::CONFLICT,
        Some(ErrorKind::Limit) => StatusCode::TOO_MANY_REQUESTS,
        Some(ErrorKind::Timeout) => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::BAD_GATEWAY,
    }
}

type ApiResult<T> = Result<T, ApiError>;

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, msg.into())
}

/// Parses a JSON body with an error that says what is wrong.
fn json<T: serde::de::DeserializeOwned>(body: &Bytes) -> ApiResult<T> {
    serde_json::from_slice(body).map_err(|e| bad(format!("malformed JSON request: {e}")))
}

/// Runs blocking daemon work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, DaemonError> + Send + 'static,
) -> ApiResult<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(ApiError::from),
        Err(e) => Err(ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("internal error: {e}"),
        )),
    }
}

fn ok<T: Serialize>(status: StatusCode, value: T) -> Response {
    (status, axum::Json(value)).into_response()
}

/// One NDJSON line.
fn line<T: Serialize>(value: &T) -> Bytes {
    let mut v = serde_json::to_vec(value).unwrap_or_default();
    v.push(b'\n');
    Bytes::from(v)
}

fn ndjson(rx: mpsc::Receiver<Result<Bytes, std::io::Error>>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(ReceiverStream::new(rx)),
    )
        .into_response()
}

/// Streams NDJSON from blocking daemon work: `work` gets `send` (a line to
/// the client; false once the client went) and `wanted` (whether the
/// client is still there). A failure before the first line is the
/// answer's status; after it, `error_line(e)` is the last line.
async fn stream_lines(
    work: impl FnOnce(&mut dyn FnMut(Bytes) -> bool, &dyn Fn() -> bool) -> Result<(), DaemonError>
        + Send
        + 'static,
    error_line: impl FnOnce(DaemonError) -> Bytes + Send + 'static,
) -> ApiResult<Response> {
    let (started_tx, started_rx) = oneshot::channel::<Result<(), DaemonError>>();
    let (tx, rx) = mpsc::channel(32);
    tokio::task::spawn_blocking(move || {
        let mut started = Some(started_tx);
        let result = {
            let mut send = |line: Bytes| {
                if let Some(s) = started.take() {
                    let _ = s.send(Ok(()));
                }
                tx.blocking_send(Ok(line)).is_ok()
            };
            work(&mut send, &|| !tx.is_closed())
        };
        match (result, started) {
            (Err(e), Some(s)) => drop(s.send(Err(e))),
            (Err(e), None) => drop(tx.blocking_send(Ok(error_line(e)))),
            _ => {}
        }
    });
    match started_rx.await {
        Ok(Ok(())) => Ok(ndjson(rx)),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the stream's worker ended".into(),
        )),
    }
}

/// Declares the routes once: the router and [`ROUTES`] (which the OpenAPI
/// test compares with `openapi.json`) come from the same list.
macro_rules! routes {
    ($($method:ident $path:literal => $handler:expr),* $(,)?) => {
        /// Every route: (method, path).
        pub const ROUTES: &[(&str, &str)] = &[$((stringify!($method), $path)),*];

        fn routes() -> Router<Shared> {
            Router::new()$(.route($path, $method($handler)))*
        }
    };
}

routes! {
    get "/v1/info" => info,
    get "/v1/templates" => list_templates,
    post "/v1/templates" => build_template,
    get "/v1/templates/{id}" => get_template,
    delete "/v1/templates/{id}" => remove_template,
    post "/v1/templates/{id}/verify" => verify_template,
    post "/v1/uploads" => receive_upload,
    get "/v1/volumes" => list_volumes,
    post "/v1/volumes" => create_volume,
    get "/v1/volumes/{id}" => get_volume,
    delete "/v1/volumes/{id}" => delete_volume,
    get "/v1/secrets" => list_secrets,
    post "/v1/secrets" => create_secret,
    get "/v1/secrets/{id}" => get_secret,
    put "/v1/secrets/{id}" => update_secret,
    delete "/v1/secrets/{id}" => delete_secret,
    get "/v1/pools" => list_pools,
    put "/v1/pools/{template}" => set_pool,
    get "/v1/sandboxes" => list_sandboxes,
    post "/v1/sandboxes" => create_sandbox,
    get "/v1/sandboxes/{id}" => get_sandbox,
    patch "/v1/sandboxes/{id}" => update_sandbox,
    delete "/v1/sandboxes/{id}" => destroy_sandbox,
    post "/v1/sandboxes/{id}/exec" => exec,
    get "/v1/sandboxes/{id}/processes" => processes::list,
    post "/v1/sandboxes/{id}/processes" => processes::start,
    get "/v1/sandboxes/{id}/processes/{pid}" => processes::get,
    delete "/v1/sandboxes/{id}/processes/{pid}" => processes::remove,
    get "/v1/sandboxes/{id}/processes/{pid}/output" => processes::output,
    post "/v1/sandboxes/{id}/processes/{pid}/stdin" => processes::stdin,
    post "/v1/sandboxes/{id}/processes/{pid}/signal" => processes::signal,
    post "/v1/sandboxes/{id}/processes/{pid}/resize" => processes::resize,
    get "/v1/sandboxes/{id}/processes/{pid}/terminal" => processes::terminal,
    get "/v1/sandboxes/{id}/health" => guest::health,
    get "/v1/sandboxes/{id}/watch" => guest::watch,
    get "/v1/sandboxes/{id}/files" => download,
    put "/v1/sandboxes/{id}/files" => upload,
    get "/v1/sandboxes/{id}/dir" => list_dir,
    post "/v1/sandboxes/{id}/pause" => pause,
    post "/v1/sandboxes/{id}/resume" => resume,
    post "/v1/sandboxes/{id}/hibernate" => hibernate,
    post "/v1/sandboxes/{id}/wake" => wake,
    post "/v1/sandboxes/{id}/kill-all" => kill_all,
    post "/v1/sandboxes/{id}/media" => insert_medium,
    delete "/v1/sandboxes/{id}/media/{drive}" => release_drive,
    post "/v1/sandboxes/{id}/network" => attach_pod_network,
    post "/v1/sandboxes/{id}/mounts" => add_mount,
    put "/v1/sandboxes/{id}/egress" => set_egress,
    get "/v1/sandboxes/{id}/ports/{port}" => port,
    post "/v1/sandboxes/{id}/snapshot" => snapshot,
    post "/v1/sandboxes/{id}/fork" => fork,
    get "/v1/sandboxes/{id}/logs" => logs,
    get "/v1/audit" => audit,
    get "/v1/egress/ca" => egress_ca,
    post "/mcp" => mcp,
    delete "/mcp" => mcp,
    get "/mcp" => mcp,
    get "/metrics" => metrics,
}

/// The API's router; `mcp`: the sessions of MCP over HTTP (one set for
/// every listener); `token`: every request must carry it (TCP).
pub fn router(daemon: Shared, mcp: Arc<HttpService>, token: Option<String>) -> Router {
    let mut r = routes()
        .fallback(|| async {
            ApiError(
                StatusCode::NOT_FOUND,
                "no such route (see host/openapi.json)".into(),
            )
        })
        .method_not_allowed_fallback(|| async {
            ApiError(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed on this route".into(),
            )
        })
        .layer(DefaultBodyLimit::max(MAX_JSON))
        .layer(Extension(mcp))
        .layer(axum::middleware::from_fn(json_refusals))
        .layer(axum::middleware::from_fn_with_state(daemon.clone(), count));
    if let Some(token) = token {
        let token = Arc::new(token);
        r = r.layer(axum::middleware::from_fn(
            move |req: Request, next: Next| {
                let token = token.clone();
                async move {
                    let given = req
                        .headers()
                        .get(header::AUTHORIZATION)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.strip_prefix("Bearer "));
                    if given.is_some_and(|g| constant_time_eq(g.as_bytes(), token.as_bytes())) {
                        next.run(req).await
                    } else {
                        ApiError(
                            StatusCode::UNAUTHORIZED,
                            "missing or wrong bearer token (Authorization: Bearer <token>)".into(),
                        )
                        .into_response()
                    }
                }
            },
        ));
    }
    r.with_state(daemon)
}

async fn count(State(d): State<Shared>, req: Request, next: Next) -> Response {
    d.metrics.request();
    next.run(req).await
}

/// Gives axum's own plain-text refusal of a body over the limit the API's
/// JSON error shape (every other error is an [`ApiError`] already).
async fn json_refusals(req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    if resp.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is over the {MAX_JSON}-byte limit of JSON requests"),
        )
        .into_response();
    }
    resp
}

/// Whether a secret a client sent (a bearer token, an API key, an access
/// token) is the expected one, in time that does not depend on where they
/// differ.
pub(crate) fn constant_time_eq(given: &[u8], expected: &[u8]) -> bool {
    subtle::ConstantTimeEq::ct_eq(given, expected).into()
}

// ---- handlers ----

#[derive(Serialize)]
struct Info {
    version: &'static str,
    max_sandboxes: u32,
    memory_mib: u64,
    restore_parallel: u32,
    /// Which cgroup hierarchy limits VMMs ("v1", "v2"), or "none".
    cgroups: &'static str,
    /// Whether each VMM runs in its jail.
    jail: bool,
}

async fn info(State(d): State<Shared>) -> Response {
    let cfg = d.config();
    ok(
        StatusCode::OK,
        Info {
            version: env!("CARGO_PKG_VERSION"),
            max_sandboxes: cfg.max_sandboxes,
            memory_mib: cfg.memory_mib,
            restore_parallel: cfg.restore_parallel,
            cgroups: cfg.cgroups.as_ref().map_or("none", |h| h.name()),
            jail: cfg.jail.is_some(),
        },
    )
}

async fn list_templates(State(d): State<Shared>) -> ApiResult<Response> {
    let t = blocking(move || d.templates()).await?;
    Ok(ok(StatusCode::OK, t))
}

async fn get_template(State(d): State<Shared>, Path(id): Path<String>) -> ApiResult<Response> {
    let t = blocking(move || d.template(&id)).await?;
    Ok(ok(StatusCode::OK, t))
}

async fn remove_template(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    blocking(move || d.remove_template(&id, &who.0)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn list_volumes(State(d): State<Shared>) -> ApiResult<Response> {
    let v = blocking(move || d.volumes()).await?;
    Ok(ok(StatusCode::OK, v))
}

async fn create_volume(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    body: Bytes,
) -> ApiResult<Response> {
    let req: VolumeRequest = json(&body)?;
    let v = blocking(move || d.create_volume(&req.name, &who.0)).await?;
    Ok(ok(StatusCode::CREATED, v))
}

async fn get_volume(State(d): State<Shared>, Path(id): Path<String>) -> ApiResult<Response> {
    let v = blocking(move || d.volume(&id)).await?;
    Ok(ok(StatusCode::OK, v))
}

async fn delete_volume(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    blocking(move || d.delete_volume(&id, &who.0)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn list_secrets(State(d): State<Shared>) -> ApiResult<Response> {
    let v = blocking(move || d.secrets()).await?;
    Ok(ok(StatusCode::OK, v))
}

async fn create_secret(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    body: Bytes,
) -> ApiResult<Response> {
    let req: husk_types::SecretRequest = json(&body)?;
    let v = blocking(move || d.create_secret(req, &who.0)).await?;
    Ok(ok(StatusCode::CREATED, v))
}

async fn get_secret(State(d): State<Shared>, Path(id): Path<String>) -> ApiResult<Response> {
    let v = blocking(move || d.secret(&id)).await?;
    Ok(ok(StatusCode::OK, v))
}

async fn update_secret(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let req: husk_types::SecretRequest = json(&body)?;
    let v = blocking(move || d.update_secret(&id, req, &who.0)).await?;
    Ok(ok(StatusCode::OK, v))
}

async fn delete_secret(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    blocking(move || d.delete_secret(&id, &who.0)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn verify_template(State(d): State<Shared>, Path(id): Path<String>) -> ApiResult<Response> {
    let files = blocking(move || d.verify_template(&id)).await?;
    Ok(ok(
        StatusCode::OK,
        serde_json::json!({ "ok": true, "files": files }),
    ))
}

async fn build_template(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    body: Bytes,
) -> ApiResult<Response> {
    let mut spec: TemplateSpec = json(&body)?;
    husk_core::template::check_name(&spec.name).map_err(DaemonError::from)?;
    d.check_template_sources(&mut spec)?;
    let name = spec.name.clone();
    let d2 = d.clone();
    if blocking(move || Ok(d2.store().template(&name)?))
        .await?
        .is_some()
    {
        return Err(ApiError(
            StatusCode::CONFLICT,
            format!(
                "a template named `{}` exists: remove it or pick another name",
                spec.name
            ),
        ));
    }
    let (tx, rx) = mpsc::channel(16);
    tokio::task::spawn_blocking(move || {
        let mut progress = |message: &str| {
            let _ = tx.blocking_send(Ok(line(&BuildEvent::Progress {
                message: message.to_owned(),
            })));
        };
        let event = match d.build_template(spec, &who.0, &mut progress) {
            Ok(template) => BuildEvent::Done {
                template: Box::new(template),
            },
            Err(e) => {
                let e = ApiError::from(e);
                BuildEvent::Error {
                    status: e.0.as_u16(),
                    error: e.1,
                }
            }
        };
        let _ = tx.blocking_send(Ok(line(&event)));
    });
    Ok(ndjson(rx))
}

async fn list_pools(State(d): State<Shared>) -> ApiResult<Response> {
    let p = blocking(move || d.pools()).await?;
    Ok(ok(StatusCode::OK, p))
}

async fn set_pool(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(template): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let PoolSize { size } = json(&body)?;
    let p = blocking(move || d.set_pool(&template, size, &who.0)).await?;
    Ok(ok(StatusCode::OK, p))
}

/// `?label=k=v` (repeatable) and `?state=running`.
pub(crate) fn list_filter(
    query: Option<&str>,
) -> ApiResult<(BTreeMap<String, String>, Option<SandboxState>)> {
    let mut labels = BTreeMap::new();
    let mut state = None;
    for (k, v) in form_pairs(query.unwrap_or("")) {
        match k.as_str() {
            "label" => {
                let (lk, lv) = v
                    .split_once('=')
                    .ok_or_else(|| bad(format!("label filter `{v}` is not KEY=VALUE")))?;
                labels.insert(lk.to_owned(), lv.to_owned());
            }
            "state" => {
                state = Some(
                    serde_json::from_value(serde_json::Value::String(v.clone()))
                        .map_err(|_| bad(format!("unknown state `{v}`")))?,
                )
            }
            other => return Err(bad(format!("unknown query parameter `{other}`"))),
        }
    }
    Ok((labels, state))
}

/// Decodes `a=b&c=d` (percent-encoding and `+`).
pub(crate) fn form_pairs(query: &str) -> Vec<(String, String)> {
    fn decode(s: &str) -> String {
        let bytes = s.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            match (bytes[i], hex) {
                (b'+', _) => out.push(b' '),
                (b'%', Some(b)) => {
                    out.push(b);
                    i += 2;
                }
                (b, _) => out.push(b),
            }
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    }
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

async fn list_sandboxes(State(d): State<Shared>, RawQuery(q): RawQuery) -> ApiResult<Response> {
    let (labels, state) = list_filter(q.as_deref())?;
    let list = blocking(move || Ok(d.list(&labels, state))).await?;
    Ok(ok(StatusCode::OK, list))
}

async fn create_sandbox(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    body: Bytes,
) -> ApiResult<Response> {
    let req: CreateRequest = json(&body)?;
    let created = blocking(move || d.create(req, &who.0)).await?;
    Ok(ok(StatusCode::CREATED, created))
}

async fn get_sandbox(State(d): State<Shared>, Path(id): Path<String>) -> ApiResult<Response> {
    let s = blocking(move || d.sandbox(&id)).await?;
    Ok(ok(StatusCode::OK, s))
}

async fn update_sandbox(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let update: SandboxUpdate = json(&body)?;
    let s = blocking(move || d.update(&id, update, &who.0)).await?;
    Ok(ok(StatusCode::OK, s))
}

async fn destroy_sandbox(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    blocking(move || d.destroy(&id, &who.0)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn pause(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let s = blocking(move || d.pause(&id, &who.0)).await?;
    Ok(ok(StatusCode::OK, s))
}

async fn hibernate(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let s = blocking(move || d.hibernate(&id, &who.0)).await?;
    Ok(ok(StatusCode::OK, s))
}

async fn wake(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let s = blocking(move || d.wake(&id, &who.0)).await?;
    Ok(ok(StatusCode::OK, s))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PortQuery {
    /// Wait up to this many seconds for a program to listen on it.
    wait_s: Option<u64>,
}

async fn port(
    State(d): State<Shared>,
    Path((id, port)): Path<(String, String)>,
    q: Result<Query<PortQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Response> {
    let Query(q) = q.map_err(|e| bad(format!("bad query: {e}")))?;
    let wait_s = q.wait_s.unwrap_or(0);
    if wait_s > 600 {
        return Err(bad("`wait_s` is at most 600"));
    }
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|&p| p != 0)
        .ok_or_else(|| {
            ApiError(
                StatusCode::BAD_REQUEST,
                format!("`{port}` is not a TCP port"),
            )
        })?;
    let wait = std::time::Duration::from_secs(wait_s);
    let p = blocking(move || d.wait_for_port(&id, port, wait)).await?;
    Ok(ok(StatusCode::OK, p))
}

async fn resume(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let s = blocking(move || d.resume(&id, &who.0)).await?;
    Ok(ok(StatusCode::OK, s))
}

async fn insert_medium(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let req: husk_types::MediumRequest = json(&body)?;
    let m = blocking(move || d.insert_medium(&id, req, &who.0)).await?;
    Ok(ok(StatusCode::OK, m))
}

async fn release_drive(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path((id, drive)): Path<(String, String)>,
) -> ApiResult<Response> {
    blocking(move || d.release_drive(&id, &drive, &who.0)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn attach_pod_network(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let req: husk_types::PodNetworkRequest = json(&body)?;
    let info = blocking(move || d.attach_pod_network(&id, req, &who.0)).await?;
    Ok(ok(StatusCode::OK, info))
}

async fn add_mount(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let mount: husk_types::MountSpec = json(&body)?;
    let info = blocking(move || d.add_mount(&id, mount, &who.0)).await?;
    Ok(ok(StatusCode::OK, info))
}

async fn set_egress(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let egress: husk_types::EgressSpec = json(&body)?;
    let info = blocking(move || d.set_egress(&id, egress, &who.0)).await?;
    Ok(ok(StatusCode::OK, info))
}

async fn kill_all(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let tasks = blocking(move || d.kill_all(&id, &who.0)).await?;
    Ok(ok(
        StatusCode::OK,
        Killed {
            killed_tasks: tasks,
        },
    ))
}

async fn snapshot(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let SnapshotRequest { name } = json(&body)?;
    let t = blocking(move || d.snapshot(&id, &name, &who.0)).await?;
    Ok(ok(StatusCode::CREATED, t))
}

async fn fork(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let req: ForkRequest = json(&body)?;
    let name = req
        .name
        .unwrap_or_else(|| format!("fork-{id}-{}", husk_core::store::now_unix_ms()));
    let (template, sandboxes) = blocking(move || d.fork(&id, &name, req.count, &who.0)).await?;
    Ok(ok(
        StatusCode::CREATED,
        Forked {
            template,
            sandboxes,
        },
    ))
}

async fn logs(State(d): State<Shared>, Path(id): Path<String>) -> ApiResult<Response> {
    let text = blocking(move || {
        use std::io::{Read, Seek, SeekFrom};
        let path = d.console_path(&id)?;
        let mut f = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        let len = f.metadata()?.len();
        f.seek(SeekFrom::Start(len.saturating_sub(MAX_LOGS)))?;
        let mut out = Vec::new();
        f.read_to_end(&mut out)?;
        Ok(out)
    })
    .await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditQuery {
    sandbox: Option<String>,
    #[serde(default)]
    after: i64,
    limit: Option<u32>,
}

async fn audit(
    State(d): State<Shared>,
    q: Result<Query<AuditQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Response> {
    let Query(q) = q.map_err(|e| bad(format!("bad query: {e}")))?;
    let limit = q.limit.unwrap_or(1000).min(10_000);
    let log =
        blocking(move || Ok(d.store().audit_log(q.sandbox.as_deref(), q.after, limit)?)).await?;
    Ok(ok(StatusCode::OK, log))
}

/// MCP over streamable HTTP (rmcp's service: sessions, JSON-RPC,
/// server-sent events).
async fn mcp(Extension(mcp): Extension<Arc<HttpService>>, req: Request) -> Response {
    mcp.handle(req).await
}

async fn egress_ca(State(d): State<Shared>) -> ApiResult<Response> {
    match d.egress_ca() {
        Some(pem) => Ok((
            [(header::CONTENT_TYPE, "application/x-pem-file")],
            pem.to_owned(),
        )
            .into_response()),
        None => Err(ApiError(
            StatusCode::NOT_FOUND,
            "this daemon's egress proxy has no CA".into(),
        )),
    }
}

async fn metrics(State(d): State<Shared>) -> ApiResult<Response> {
    let text = blocking(move || {
        let pools = d.pools()?;
        Ok(d.metrics.render(
            &d.gauges(),
            &pools,
            husk_core::daemon::rss(std::process::id()),
        ))
    })
    .await?;
    Ok((
        [(header::CONTENT_TYPE, husk_core::metrics::CONTENT_TYPE)],
        text,
    )
        .into_response())
}

// ---- exec ----

async fn exec(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let spec: ExecSpec = json(&body)?;
    if spec.argv.is_empty() {
        return Err(bad("`argv` is empty: name the program to run"));
    }
    let detail = spec.argv.join(" ");
    let req = ExecRequest::from(spec);
    let (started_tx, started_rx) = oneshot::channel::<Result<i32, DaemonError>>();
    let (tx, rx) = mpsc::channel(32);
    tokio::task::spawn_blocking(move || {
        let mut client = match d.agent_for(&id, &who.0, "exec", &detail) {
            Ok(c) => c,
            Err(e) => return drop(started_tx.send(Err(e))),
        };
        let mut running = match client.start(req) {
            Ok(r) => r,
            Err(e) => return drop(started_tx.send(Err(e.into()))),
        };
        let _ = started_tx.send(Ok(running.pid));
        let b64 = |data: &[u8]| base64::engine::general_purpose::STANDARD.encode(data);
        loop {
            let event = match running.next_event() {
                Ok(Event::Output(Stream::Stdout, data)) => ExecEvent::Stdout { data: b64(&data) },
                Ok(Event::Output(Stream::Stderr, data)) => ExecEvent::Stderr { data: b64(&data) },
                Ok(Event::Lost(bytes)) => ExecEvent::Lost { bytes },
                Ok(Event::Exited(r)) => {
                    let (code, signal) = match r.termination {
                        Termination::Code(c) => (Some(c), None),
                        Termination::Signal(s) => (None, Some(s)),
                    };
                    ExecEvent::Exit {
                        code,
                        signal,
                        user_us: r.user_us,
                        system_us: r.system_us,
                    }
                }
                Err(e) => ExecEvent::Error {
                    kind: e.kind(),
                    error: e.to_string(),
                },
            };
            // Ended at a frame boundary (an exit, the guest's own error):
            // the connection can serve the next request.
            let whole = matches!(
                event,
                ExecEvent::Exit { .. } | ExecEvent::Error { kind: Some(_), .. }
            );
            let last = whole || matches!(event, ExecEvent::Error { .. });
            // A client that went away: dropping `running` closes the
            // agent connection, and the agent kills the program.
            if tx.blocking_send(Ok(line(&event))).is_err() || last {
                if whole {
                    d.give_back(&id, client);
                }
                return;
            }
        }
    });
    let pid = match started_rx.await {
        Ok(Ok(pid)) => pid,
        Ok(Err(e)) => return Err(e.into()),
        Err(_) => {
            return Err(ApiError(
                StatusCode::INTERNAL_SERVER_ERROR,
                "exec worker ended".into(),
            ))
        }
    };
    let first = line(&ExecEvent::Started { pid });
    let stream = tokio_stream::StreamExt::chain(
        tokio_stream::once(Ok::<_, std::io::Error>(first)),
        ReceiverStream::new(rx),
    );
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(stream),
    )
        .into_response())
}

// ---- files ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileQuery {
    path: String,
    /// Permission bits of an uploaded file, octal (default 644).
    mode: Option<String>,
}

fn file_query(
    q: Result<Query<FileQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<FileQuery> {
    let Query(q) = q.map_err(|e| bad(format!("bad query (want ?path=/abs/path): {e}")))?;
    if !q.path.starts_with('/') {
        return Err(bad(format!("path `{}` is not absolute", q.path)));
    }
    Ok(q)
}

/// A `Write` that sends what it is given to an HTTP body.
struct ChannelWriter(mpsc::Sender<Result<Bytes, std::io::Error>>);

impl std::io::Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "client went away"))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The entries of a guest directory.
async fn list_dir(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
    q: Result<Query<FileQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Response> {
    let q = file_query(q)?;
    let entries =
        blocking(move || d.with_agent(&id, &who.0, ("list", &q.path), |agent| agent.list(&q.path)))
            .await?;
    Ok(ok(StatusCode::OK, entries))
}

async fn download(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
    q: Result<Query<FileQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Response> {
    let q = file_query(q)?;
    let (size, body) = stream_guest_file(
        move || {
            let mut client = d.agent_for(&id, &who.0, "download", &q.path)?;
            // Not found, or not a file: an HTTP error before any byte.
            let st = client.stat(&q.path)?;
            if st.kind != husk_protocol::FileKind::File {
                return Err(DaemonError::Invalid(format!(
                    "`{}` is not a regular file",
                    q.path
                )));
            }
            Ok((client, q.path, st.size))
        },
        || DaemonError::Failed("the file worker ended".into()),
    )
    .await?;
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        "application/octet-stream".parse().expect("static header"),
    );
    headers.insert("x-husk-file-size", size.into());
    Ok((headers, body).into_response())
}

/// Streams a guest file as an HTTP body: `open` runs on a blocking thread
/// and gives the agent connection, the file's path and its size, or an
/// error answered before any byte; the bytes then flow as the guest sends
/// them (no whole file in the daemon's memory). An error mid-stream cuts
/// the body short, so the client never takes a partial file for a whole.
pub(crate) async fn stream_guest_file<E: Send + 'static>(
    open: impl FnOnce() -> Result<(AgentClient, String, u64), E> + Send + 'static,
    gone: impl FnOnce() -> E,
) -> Result<(u64, Body), E> {
    let (ready_tx, ready_rx) = oneshot::channel::<Result<u64, E>>();
    let (tx, rx) = mpsc::channel(8);
    tokio::task::spawn_blocking(move || {
        let (mut client, path, size) = match open() {
            Ok(opened) => opened,
            Err(e) => return drop(ready_tx.send(Err(e))),
        };
        let _ = ready_tx.send(Ok(size));
        if let Err(e) = client.read_file(&path, ChannelWriter(tx.clone())) {
            let _ = tx.blocking_send(Err(std::io::Error::other(e.to_string())));
        }
    });
    match ready_rx.await {
        Ok(Ok(size)) => Ok((size, Body::from_stream(ReceiverStream::new(rx)))),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(gone()),
    }
}

/// A `Read` over an HTTP body's chunks, fed from the async side.
struct ChannelReader {
    rx: std::sync::mpsc::Receiver<Result<Bytes, String>>,
    chunk: Bytes,
}

impl std::io::Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.chunk.is_empty() {
            match self.rx.recv() {
                Ok(Ok(chunk)) => self.chunk = chunk,
                Ok(Err(e)) => return Err(std::io::Error::other(e)),
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len());
        buf[..n].copy_from_slice(&self.chunk.split_to(n));
        Ok(n)
    }
}

/// Runs `work` on a blocking thread, reading `body` as it arrives; the
/// body stops being read when `work` ends (its answer says why).
async fn with_body<T: Send + 'static>(
    body: Body,
    work: impl FnOnce(ChannelReader) -> Result<T, DaemonError> + Send + 'static,
) -> ApiResult<T> {
    let (chunks_tx, chunks_rx) = std::sync::mpsc::sync_channel::<Result<Bytes, String>>(8);
    let worker = tokio::task::spawn_blocking(move || {
        work(ChannelReader {
            rx: chunks_rx,
            chunk: Bytes::new(),
        })
    });
    let mut stream = body.into_data_stream();
    while let Some(chunk) = tokio_stream::StreamExt::next(&mut stream).await {
        let item = chunk.map_err(|e| format!("the upload broke off: {e}"));
        let failed = item.is_err();
        // The worker may have ended (an error): its answer says why.
        let tx = chunks_tx.clone();
        let sent = tokio::task::spawn_blocking(move || tx.send(item).is_ok())
            .await
            .unwrap_or(false);
        if !sent || failed {
            break;
        }
    }
    drop(chunks_tx);
    match worker.await {
        Ok(r) => Ok(r?),
        Err(e) => Err(ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())),
    }
}

/// Receives a file for a later template build (a root file system tar, a
/// kernel): the client's way to give the daemon a file without naming a
/// path on its host.
async fn receive_upload(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    body: Body,
) -> ApiResult<Response> {
    let up = with_body(body, move |mut reader| d.upload(&mut reader, &who.0)).await?;
    Ok(ok(StatusCode::CREATED, up))
}

async fn upload(
    State(d): State<Shared>,
    ConnectInfo(who): ConnectInfo<Peer>,
    Path(id): Path<String>,
    q: Result<Query<FileQuery>, axum::extract::rejection::QueryRejection>,
    body: Body,
) -> ApiResult<Response> {
    let q = file_query(q)?;
    let mode = match &q.mode {
        Some(m) => u32::from_str_radix(m, 8)
            .ok()
            .filter(|m| *m <= 0o7777)
            .ok_or_else(|| bad(format!("mode `{m}` is not octal permission bits")))?,
        None => 0o644,
    };
    let path = q.path.clone();
    let size = with_body(body, move |reader| {
        d.with_agent(&id, &who.0, ("upload", &path), |agent| {
            agent.write_file(&path, mode, reader)
        })
    })
    .await?;
    Ok(ok(
        StatusCode::CREATED,
        serde_json::json!({ "path": q.path, "size": size }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_pairs_are_decoded() {
        assert_eq!(
            form_pairs("label=a%3Db&state=running&x=%2"),
            vec![
                ("label".to_owned(), "a=b".to_owned()),
                ("state".to_owned(), "running".to_owned()),
                ("x".to_owned(), "%2".to_owned()),
            ]
        );
    }

    /// Every route is in openapi.json and every path there is a route.
    #[test]
    fn the_openapi_document_describes_exactly_the_routes() {
        let doc: serde_json::Value =
            serde_json::from_str(include_str!("../../openapi.json")).expect("openapi.json parses");
        let mut documented: Vec<(String, String)> = Vec::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for method in item.as_object().expect("path item").keys() {
                if ["get", "post", "put", "patch", "delete"].contains(&method.as_str()) {
                    documented.push((method.clone(), path.clone()));
                }
            }
        }
        let mut routed: Vec<(String, String)> = ROUTES
            .iter()
            .map(|(m, p)| ((*m).to_owned(), (*p).to_owned()))
            .collect();
        documented.sort();
        routed.sort();

        assert_eq!(documented, routed);
    }
}
