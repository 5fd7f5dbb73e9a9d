//! The E2B API on husk: E2B's SDKs, unchanged, create and drive husk
//! sandboxes (`husk serve --e2b HOST:PORT`).
//!
//! One address serves both of E2B's planes; point the SDK at it with
//! `E2B_API_URL` and `E2B_SANDBOX_URL` (and `E2B_API_KEY`):
//! - the control plane (REST, `X-API-KEY`): create, connect/resume, kill,
//!   set timeout, pause, list, get info, metrics, in both the v2 paths of the
//!   current Python SDK and the v1 paths of older and JS SDKs;
//! - the data plane (envd, routed by the `E2b-Sandbox-Id` header, checked
//!   against the sandbox's `X-Access-Token`): Connect RPC with the JSON
//!   codec for `process.Process` and `filesystem.Filesystem`, and
//!   `/files`, `/health`; mapped onto husk's agent protocol.
//!
//! The message types are written here from the wire facts (field names,
//! JSON mapping, enums) in shared/notes/e2b-protocol.md. What E2B templates
//! assume: programs run as `user` (home `/home/user`, relative paths
//! resolve there) unless the SDK names another user, as `/bin/bash -l -c`
//! (husk's root file system carries bash and the user).
//!
//! File metadata (envd 0.6.2: `X-Metadata-*` upload headers, `metadata`
//! in entries) are the file's `user.e2b.*` extended attributes, as envd
//! keeps them. The SDK is told envd [`ENVD_VERSION`], the lowest version
//! whose features these are (0.6.3's watch entries are not served).
//!
//! By concern: this file holds the control plane (sandboxes, their
//! lifecycle, fork, network, metrics) and envd's shared plumbing (access,
//! the guest's users, Connect RPC framing); [`process`] envd's processes,
//! [`filesystem`] its file system RPC and `/files`, [`snapshots`],
//! [`secrets`] and [`volumes`] their routes. `host/e2b-openapi.json` lists
//! every route.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::Router;
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use husk_agent_client::{AgentClient, ClientError};
use husk_core::daemon::{Daemon, DaemonError};
use husk_types::{
    CreateRequest, EgressSpec, ExpiryPolicy, MountSpec, SandboxInfo, SandboxState, SandboxUpdate,
    SecretSpec, VolumeInfo, VolumeRequest,
};

mod filesystem;
mod process;
mod secrets;
mod snapshots;
mod volumes;

/// What husk's envd speaks (see the module docs).
pub const ENVD_VERSION: &str = "0.6.2";
/// E2B's default sandbox timeout, seconds.
const DEFAULT_TIMEOUT_S: u64 = 300;
/// Largest file upload.
const MAX_UPLOAD: usize = 256 << 20;
/// Largest RPC request.
const MAX_RPC: usize = 4 << 20;
/// Watchers one sandbox may have.
const MAX_WATCHERS: usize = 32;
/// How often a stream says it is alive while a program is quiet.
const KEEPALIVE: Duration = Duration::from_secs(30);
/// The label that marks a metadata entry.
const META: &str = "e2b.meta/";

/// Who the audit log names for what comes through envd (its callers hold
/// the sandbox's access token, not an API key).
const ENVD_WHO: &str = "e2b envd";

/// The gateway's state.
pub struct E2b {
    daemon: Arc<Daemon>,
    api_keys: Vec<String>,
    /// Makes each sandbox's access token (never stored).
    secret: [u8; 32],
    /// Environment variables given at create, by sandbox.
    envs: Mutex<HashMap<String, BTreeMap<String, String>>>,
    watchers: Mutex<HashMap<String, Watcher>>,
    next_watcher: AtomicU64,
    /// Each sandbox's /etc/passwd, read once (a guest round trip saved on
    /// every command).
    passwd: Mutex<HashMap<String, Arc<String>>>,
    /// How far E2B's clients have had each program's output: (sandbox,
    /// pid) -> offset, where a `Connect` goes on from (see `process`).
    relayed: Mutex<HashMap<(String, i32), u64>>,
}

impl std::fmt::Debug for E2b {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("E2b").finish_non_exhaustive()
    }
}

struct Watcher {
    sandbox: String,
    events: Arc<Mutex<Vec<Value>>>,
    stop: Arc<AtomicBool>,
}

type Shared = Arc<E2b>;

/// A mutex's guard, whether or not a holder panicked (the maps it guards
/// stay consistent entry by entry).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl E2b {
    /// `api_keys`: the keys clients must send (`X-API-KEY`); the secret that
    /// makes access tokens is kept in `<state dir>/e2b.secret`.
    pub fn new(daemon: Arc<Daemon>, api_keys: Vec<String>) -> std::io::Result<Arc<E2b>> {
        use std::os::unix::fs::OpenOptionsExt;
        let path = daemon.config().state_dir.join("e2b.secret");
        let mut secret = [0u8; 32];
        match std::fs::read(&path) {
            Ok(b) if b.len() == 32 => secret.copy_from_slice(&b),
            _ => {
                std::fs::File::open("/dev/urandom")?.read_exact(&mut secret)?;
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(&path)?;
                std::io::Write::write_all(&mut f, &secret)?;
            }
        }
        Ok(Arc::new(E2b {
            daemon,
            api_keys,
            secret,
            envs: Mutex::new(HashMap::new()),
            watchers: Mutex::new(HashMap::new()),
            next_watcher: AtomicU64::new(1),
            passwd: Mutex::new(HashMap::new()),
            relayed: Mutex::new(HashMap::new()),
        }))
    }

    /// Drops what the gateway keeps for sandboxes that are gone since (their
    /// time to live ran out, or another API destroyed them).
    fn forget_gone(&self) {
        // One lock at a time: no order to keep with the handlers.
        let mut ids: HashSet<String> = lock(&self.envs).keys().cloned().collect();
        ids.extend(lock(&self.passwd).keys().cloned());
        ids.extend(lock(&self.relayed).keys().map(|(s, _)| s.clone()));
        ids.extend(lock(&self.watchers).values().map(|w| w.sandbox.clone()));
        if !ids.is_empty() {
            self.forget(&self.daemon.missing(ids));
        }
    }

    /// Drops what the gateway keeps for the `gone` sandboxes (their
    /// environment, cached users, terminals), and stops their watches.
    fn forget(&self, gone: &HashSet<String>) {
        if gone.is_empty() {
            return;
        }
        lock(&self.envs).retain(|id, _| !gone.contains(id));
        lock(&self.passwd).retain(|id, _| !gone.contains(id));
        lock(&self.relayed).retain(|(id, _), _| !gone.contains(id));
        lock(&self.watchers).retain(|_, w| {
            let keep = !gone.contains(&w.sandbox);
            if !keep {
                w.stop.store(true, Ordering::SeqCst);
            }
            keep
        });
    }

    /// The sandbox's envd access token.
    fn token(&self, id: &str) -> String {
        let mut h = Sha256::new();
        h.update(self.secret);
        h.update(id.as_bytes());
        h.finalize()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

// ---- errors ----

/// A control-plane error: `{"code": status, "message": ...}`.
struct RestError(StatusCode, String);

impl IntoResponse for RestError {
    fn into_response(self) -> Response {
        let body = json!({ "code": self.0.as_u16(), "message": self.1 });
        (self.0, axum::Json(body)).into_response()
    }
}

impl From<DaemonError> for RestError {
    fn from(e: DaemonError) -> Self {
        RestError(crate::api::daemon_status(&e), e.to_string())
    }
}

/// A Connect error: `{"code": "not_found", "message": ...}`.
#[derive(Debug)]
struct RpcError(&'static str, String);

impl RpcError {
    fn status(&self) -> StatusCode {
        match self.0 {
            "not_found" => StatusCode::NOT_FOUND,
            "already_exists" => StatusCode::CONFLICT,
            "invalid_argument" | "failed_precondition" => StatusCode::BAD_REQUEST,
            "unauthenticated" => StatusCode::UNAUTHORIZED,
            "permission_denied" => StatusCode::FORBIDDEN,
            "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
            "unimplemented" => StatusCode::NOT_IMPLEMENTED,
            "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
            "deadline_exceeded" => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn json(&self) -> Value {
        json!({ "code": self.0, "message": self.1 })
    }
}

impl IntoResponse for RpcError {
    fn into_response(self) -> Response {
        (self.status(), axum::Json(self.json())).into_response()
    }
}

impl From<ClientError> for RpcError {
    fn from(e: ClientError) -> Self {
        use husk_protocol::ErrorKind as K;
        let code = match e.kind() {
            Some(K::NotFound) => "not_found",
            Some(K::PermissionDenied) => "permission_denied",
            Some(K::Invalid | K::Malformed | K::TooLarge) => "invalid_argument",
            Some(K::Conflict) => "already_exists",
            Some(K::Limit) => "resource_exhausted",
            Some(K::Timeout) => "deadline_exceeded",
            _ => "unavailable",
        };
        RpcError(code, e.to_string())
    }
}

impl From<DaemonError> for RpcError {
    fn from(e: DaemonError) -> Self {
        match e {
            DaemonError::Agent(c) => c.into(),
            DaemonError::NotFound(m) => RpcError("not_found", m),
            DaemonError::Invalid(m) => RpcError("invalid_argument", m),
            DaemonError::Conflict(m) => RpcError("failed_precondition", m),
            DaemonError::Limit(m) => RpcError("resource_exhausted", m),
            other => RpcError("unavailable", other.to_string()),
        }
    }
}

async fn blocking<T: Send + 'static, E: Send + 'static + From<String>>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, E> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(E::from(format!("internal error: {e}"))))
}

impl From<String> for RestError {
    fn from(m: String) -> Self {
        RestError(StatusCode::INTERNAL_SERVER_ERROR, m)
    }
}

impl From<String> for RpcError {
    fn from(m: String) -> Self {
        RpcError("internal", m)
    }
}

// ---- the router ----

/// The gateway's routes (both planes on one address).
pub fn router(e2b: Shared) -> Router {
    Router::new()
        .route("/sandboxes", post(create).get(list))
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/resume", post(connect))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/network", put(update_network))
        .route(
            "/sandboxes/{id}/snapshots",
            post(snapshots::create_snapshot),
        )
        .route("/snapshots", get(snapshots::list_snapshots))
        .route("/templates/{id}", delete(snapshots::delete_template))
        .route(
            "/volumes",
            post(volumes::create_volume).get(volumes::list_volumes),
        )
        .route(
            "/volumes/{id}",
            get(volumes::volume).delete(volumes::delete_volume),
        )
        .route(
            "/secrets",
            post(secrets::create_secret).get(secrets::list_secrets),
        )
        .route(
            "/secrets/{id}",
            get(secrets::secret)
                .post(secrets::update_secret)
                .delete(secrets::delete_secret),
        )
        .route("/health", get(health))
        .route("/files", get(filesystem::download).post(filesystem::upload))
        .route("/process.Process/StreamInput", post(process::stream_input))
        .route("/process.Process/{method}", post(process::process_rpc))
        .route(
            "/filesystem.Filesystem/{method}",
            post(filesystem::filesystem_rpc),
        )
        .route("/{*rest}", delete(not_found).get(not_found).post(not_found))
        .layer(DefaultBodyLimit::max(MAX_UPLOAD))
        .with_state(e2b)
}

/// A control-plane request's JSON body; `what` names it in the 400.
fn rest_json<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> Result<T, RestError> {
    serde_json::from_slice(body)
        .map_err(|e| RestError(StatusCode::BAD_REQUEST, format!("malformed {what}: {e}")))
}

/// As [`rest_json`], where an empty body means every field's default.
fn rest_json_or_default<T: serde::de::DeserializeOwned + Default>(
    body: &[u8],
    what: &str,
) -> Result<T, RestError> {
    match body.is_empty() {
        true => Ok(T::default()),
        false => rest_json(body, what),
    }
}

async fn not_found() -> RestError {
    RestError(StatusCode::NOT_FOUND, "no such route".into())
}

fn check_key(e2b: &E2b, headers: &HeaderMap) -> Result<(), RestError> {
    let key = headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    // Each key compared in full, whichever matches (no early exit).
    let ok = e2b.api_keys.iter().fold(false, |found, k| {
        found | crate::api::constant_time_eq(key.as_bytes(), k.as_bytes())
    });
    if ok {
        Ok(())
    } else {
        Err(RestError(
            StatusCode::UNAUTHORIZED,
            "invalid API key (X-API-KEY)".into(),
        ))
    }
}

/// RFC 3339 (UTC) of a Unix time in ms.
fn rfc3339(unix_ms: u64) -> String {
    let secs = (unix_ms / 1000) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        unix_ms % 1000
    )
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn metadata(info: &SandboxInfo) -> BTreeMap<String, String> {
    info.labels
        .iter()
        .filter_map(|(k, v)| k.strip_prefix(META).map(|k| (k.to_owned(), v.clone())))
        .collect()
}

/// `Sandbox` as the SDK reads it after create and connect.
fn sandbox_json(e2b: &E2b, info: &SandboxInfo, alias: &str) -> Value {
    json!({
        "templateID": info.template,
        "alias": alias,
        "sandboxID": info.id,
        "clientID": "husk",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": e2b.token(&info.id),
        "trafficAccessToken": info.traffic_token,
        // The front door's: `get_host(port)` then names it.
        "domain": e2b.daemon.config().front_door.as_ref().map(|d| d.domain.clone()),
    })
}

/// `ListedSandbox` / `SandboxDetail`.
fn detail_json(e2b: &E2b, info: &SandboxInfo) -> Value {
    let alias = e2b
        .daemon
        .template(&info.template)
        .map(|t| t.name)
        .unwrap_or_default();
    let end = info
        .expires_unix_ms
        .unwrap_or(info.created_unix_ms + 100 * 365 * 86_400_000);
    json!({
        "templateID": info.template,
        "alias": alias,
        "sandboxID": info.id,
        "clientID": "husk",
        "startedAt": rfc3339(info.created_unix_ms),
        "endAt": rfc3339(end),
        "cpuCount": 1,
        "memoryMB": info.mem_mib,
        "diskSizeMB": 0,
        "state": match info.state {
            SandboxState::Paused | SandboxState::Hibernated => "paused",
            _ => "running",
        },
        "metadata": metadata(info),
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": e2b.token(&info.id),
    })
}

// ---- control plane ----

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CreateBody {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u64>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    #[serde(default)]
    env_vars: BTreeMap<String, String>,
    #[serde(default)]
    network: Network,
    /// false: as `denyOut: ["0.0.0.0/0"]` (the one snake_case field).
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    /// At its timeout: pause (`lifecycle.on_timeout: pause`), else kill.
    #[serde(default)]
    auto_pause: bool,
    /// With `autoPause`: keep its memory (`mode: full`, the default), or
    /// not (`mode: filesystem`), which husk does as a hibernation.
    auto_pause_memory: Option<bool>,
    auto_resume: Option<AutoResume>,
    /// Named volumes it mounts (read-write), by name.
    #[serde(default)]
    volume_mounts: Vec<VolumeMount>,
    /// Workload identity tokens: refused when it names any.
    iam: Option<Value>,
}

/// One of a create's `volumeMounts`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct VolumeMount {
    name: String,
    path: String,
}

#[derive(Debug, Deserialize)]
struct AutoResume {
    #[serde(default)]
    enabled: bool,
}

/// The label of a sandbox that any envd request resumes when paused.
const AUTO_RESUME: &str = "e2b.auto-resume";

/// The create request's `network` options.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Network {
    /// false: the sandbox's ports want its traffic access token.
    allow_public_traffic: Option<bool>,
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    /// Per host, header transforms of its outbound requests.
    #[serde(default)]
    rules: BTreeMap<String, Vec<NetRule>>,
    /// DNS servers the guest may reach: none is needed (the egress proxy
    /// resolves names on the host) and none can be (no UDP leaves a
    /// sandbox), so a non-empty list is refused.
    dns_servers: Option<Vec<String>>,
    /// Options husk does not map: refused by name when given.
    egress_proxy: Option<Value>,
    mask_request_host: Option<Value>,
    https_ports: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct NetRule {
    #[serde(default)]
    transform: Option<Transform>,
}

#[derive(Debug, Deserialize)]
struct Transform {
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

/// E2B's egress options as husk's egress policy. E2B lets a sandbox out
/// by default: that is `*` here (any public address; private, loopback
/// and link-local ones stay refused by the proxy). `allow_internet_access:
/// false` or `denyOut: ["0.0.0.0/0"]` leave only `allowOut` (names,
/// `*.` wildcards, addresses, `/32` blocks); `rules` become the proxy's
/// credentials (headers added on the host, never seen by the guest).
/// What husk cannot do is refused with a message, never dropped: other
/// `denyOut` blocks, wider `allowOut` blocks, DNS servers, a SOCKS proxy,
/// host masks, HTTPS ports.
fn egress_of(body: &CreateBody) -> Result<EgressSpec, String> {
    let tokens = body.iam.as_ref().and_then(|i| i["tokens"].as_object());
    if tokens.is_some_and(|t| !t.is_empty()) {
        return Err(
            "iam.tokens: workload identity tokens are not supported by husk; a rule's header \
             may name a secret instead (Secret.fill(NAME), resolved by husk's egress proxy)"
                .into(),
        );
    }
    network_egress(&body.network, body.allow_internet_access)
}

/// [`egress_of`] for a `network` and an `allow_internet_access` (a
/// create's, or `PUT /sandboxes/{id}/network`'s).
fn network_egress(n: &Network, allow_internet_access: Option<bool>) -> Result<EgressSpec, String> {
    for (given, name) in [
        (&n.egress_proxy, "egressProxy"),
        (&n.mask_request_host, "maskRequestHost"),
        (&n.https_ports, "httpsPorts"),
    ] {
        if given.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(format!("network.{name} is not supported by husk"));
        }
    }
    if n.dns_servers.as_ref().is_some_and(|d| !d.is_empty()) {
        return Err(
            "network.dnsServers: a husk sandbox reaches no DNS server (no UDP leaves \
                    it); its egress proxy resolves allowOut names on the host, so they work \
                    without one: leave dnsServers out"
                .into(),
        );
    }
    let everything = |e: &String| matches!(e.as_str(), "0.0.0.0/0" | "::/0");
    let deny = n.deny_out.as_deref().unwrap_or_default();
    if let Some(other) = deny.iter().find(|e| !everything(e)) {
        return Err(format!(
            "network.denyOut `{other}`: husk denies only everything (0.0.0.0/0) and \
             allows by allowOut"
        ));
    }
    let closed = allow_internet_access == Some(false) || !deny.is_empty();
    let mut allow: Vec<String> = if closed { Vec::new() } else { vec!["*".into()] };
    for entry in n.allow_out.as_deref().unwrap_or_default() {
        allow.push(match entry.split_once('/') {
            None => entry.clone(),
            Some((ip, "32" | "128")) => ip.to_owned(),
            Some(_) if everything(entry) => "*".to_owned(),
            Some(_) => {
                return Err(format!(
                    "network.allowOut `{entry}`: husk allows names, addresses and /32 \
                     blocks, not wider ranges"
                ))
            }
        });
    }
    let secrets = n
        .rules
        .iter()
        .flat_map(|(host, rules)| {
            rules
                .iter()
                .filter_map(|r| r.transform.as_ref())
                .flat_map(move |t| {
                    t.headers.iter().map(move |(header, value)| {
                        Ok(SecretSpec {
                            host: host.clone(),
                            header: header.clone(),
                            value: secrets::placeholders(value)?,
                        })
                    })
                })
        })
        .collect::<Result<_, String>>()?;
    Ok(EgressSpec { allow, secrets })
}

/// At its time to live: kill, pause in memory, or (a pause without its
/// memory kept, in E2B's words) hibernate.
fn expiry_of(body: &CreateBody) -> ExpiryPolicy {
    match (body.auto_pause, body.auto_pause_memory) {
        (false, _) => ExpiryPolicy::Destroy,
        (true, Some(false)) => ExpiryPolicy::Hibernate,
        (true, _) => ExpiryPolicy::Pause,
    }
}

async fn create(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let body: CreateBody = rest_json(&body, "create request")?;
    let mut labels: BTreeMap<String, String> = body
        .metadata
        .iter()
        .map(|(k, v)| (format!("{META}{k}"), v.clone()))
        .collect();
    labels.insert("e2b".into(), "1".into());
    if body.auto_resume.as_ref().is_some_and(|a| a.enabled) {
        labels.insert(AUTO_RESUME.into(), "1".into());
    }
    let egress = egress_of(&body).map_err(|e| RestError(StatusCode::BAD_REQUEST, e))?;
    let req = CreateRequest {
        template: body.template_id.clone(),
        ttl_s: Some(body.timeout.unwrap_or(DEFAULT_TIMEOUT_S).max(1)),
        on_expiry: expiry_of(&body),
        labels,
        egress,
        private_ports: body.network.allow_public_traffic == Some(false),
        on_idle: None,
        mounts: body
            .volume_mounts
            .iter()
            .map(|v| MountSpec {
                host: String::new(),
                volume: Some(v.name.clone()),
                guest: v.path.clone(),
                readonly: false,
                hide: Vec::new(),
            })
            .collect(),
    };
    let e = e2b.clone();
    let (created, alias) = blocking(move || {
        // What the gateway kept for sandboxes gone since (their time to
        // live ran out, or another API destroyed them) goes now: its
        // maps hold no more than the live sandboxes and those of one
        // create's interval.
        e.forget_gone();
        e.sweep_fork_templates();
        let t = e.daemon.template(&req.template)?;
        let created = e.daemon.create(req, "e2b")?;
        Ok::<_, RestError>((created, t.name))
    })
    .await?;
    lock(&e2b.envs).insert(created.sandbox.id.clone(), body.env_vars);
    Ok((
        StatusCode::CREATED,
        axum::Json(sandbox_json(&e2b, &created.sandbox, &alias)),
    )
        .into_response())
}

#[derive(Debug, Deserialize)]
struct ListQuery {
    metadata: Option<String>,
    state: Option<String>,
    limit: Option<usize>,
    #[serde(rename = "nextToken")]
    next_token: Option<String>,
}

/// Decodes `a%3Db` style query parts (the SDK encodes metadata twice).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => match b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                Some(v) => {
                    out.push(v);
                    i += 3;
                }
                None => {
                    out.push(b'%');
                    i += 1;
                }
            },
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn list(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let mut want: BTreeMap<String, String> = BTreeMap::new();
    if let Some(m) = q.metadata.as_deref().filter(|m| !m.is_empty()) {
        for pair in unescape(m).split('&') {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            want.insert(format!("{META}{}", unescape(k)), unescape(v));
        }
    }
    let states: Vec<&str> = q
        .state
        .as_deref()
        .map(|s| s.split(',').collect())
        .unwrap_or_else(|| vec!["running", "paused"]);
    let all = e2b.daemon.list(&want, None);
    let matching: Vec<Value> = all
        .iter()
        .filter(|s| match s.state {
            SandboxState::Running => states.contains(&"running"),
            SandboxState::Paused | SandboxState::Hibernated => states.contains(&"paused"),
            _ => false,
        })
        .map(|s| detail_json(&e2b, s))
        .collect();
    paged(matching, q.limit, q.next_token.as_deref())
}

/// One page of a listing's `items`: `limit` of them (100 if not given, at
/// most 1000) from `next_token` (an offset this server gave), with
/// `x-next-token` when more are left.
fn paged(
    mut items: Vec<Value>,
    limit: Option<usize>,
    next_token: Option<&str>,
) -> Result<Response, RestError> {
    let start: usize = match next_token {
        Some(token) => token.parse().map_err(|_| {
            RestError(
                StatusCode::BAD_REQUEST,
                format!("nextToken `{token}` is not one this server gave"),
            )
        })?,
        None => 0,
    };
    let limit = limit.unwrap_or(100).clamp(1, 1000);
    let rest = items.split_off(start.min(items.len()));
    let more = rest.len() > limit;
    let page: Vec<Value> = rest.into_iter().take(limit).collect();
    let mut resp = (StatusCode::OK, axum::Json(page)).into_response();
    if more {
        if let Ok(v) = (start + limit).to_string().parse() {
            resp.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(resp)
}

async fn detail(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let info = e2b.daemon.sandbox(&id)?;
    Ok((StatusCode::OK, axum::Json(detail_json(&e2b, &info))).into_response())
}

async fn kill(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let e = e2b.clone();
    let sid = id.clone();
    blocking(move || e.daemon.destroy(&sid, "e2b").map_err(RestError::from)).await?;
    e2b.forget(&HashSet::from([id]));
    Ok(StatusCode::NO_CONTENT.into_response())
}

// ---- fork ----

/// The name prefix of the templates E2B forks are made from (each fork
/// call's snapshot of its source): E2B's API has no such thing, so the
/// gateway removes each once it is old and no sandbox uses it.
const FORK_TEMPLATE: &str = "e2b-fork-";

/// How old a fork's template must be before it may go (its forks are
/// made from it within a create's time of its snapshot).
const FORK_TEMPLATE_GRACE_MS: u64 = 10 * 60 * 1000;

/// A fork request, as the SDK sends it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ForkBody {
    /// The forks' time to live in seconds (E2B's default: 15).
    timeout: Option<u64>,
    /// How many (default 1).
    count: Option<u32>,
}

/// The most forks one request makes (E2B's limit).
const MAX_FORKS: u32 = 20;

/// E2B's default time to live of a fork.
const FORK_TIMEOUT_S: u64 = 15;

/// `PUT /sandboxes/{id}/network` as the SDK's `update_network` sends it:
/// the whole egress policy, replaced (what is left out is cleared).
#[derive(Debug, Default, Deserialize)]
struct NetworkUpdate {
    #[serde(flatten)]
    network: Network,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
}

/// `PUT /sandboxes/{id}/network`: the sandbox's egress policy replaced
/// while it runs (husk's `set_egress`): connections made from now on
/// follow it.
async fn update_network(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let body: NetworkUpdate = rest_json_or_default(&body, "network update")?;
    if body.network.allow_public_traffic.is_some() {
        return Err(RestError(
            StatusCode::BAD_REQUEST,
            "network.allowPublicTraffic is set at create, not updated".into(),
        ));
    }
    let egress = network_egress(&body.network, body.allow_internet_access)
        .map_err(|e| RestError(StatusCode::BAD_REQUEST, e))?;
    let e = e2b.clone();
    blocking(move || Ok::<_, RestError>(e.daemon.set_egress(&id, egress, "e2b")?)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `POST /sandboxes/{id}/fork`: husk's fork (the running sandbox
/// snapshotted copy-on-write, then resumed; each fork a clone of that
/// snapshot with its own identity), one result per fork. husk's fork is
/// all or nothing, so the results are all sandboxes or the request fails.
async fn fork(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let body: ForkBody = rest_json_or_default(&body, "fork request")?;
    let count = body.count.unwrap_or(1);
    if !(1..=MAX_FORKS).contains(&count) {
        return Err(RestError(
            StatusCode::BAD_REQUEST,
            format!("a fork makes 1 to {MAX_FORKS} sandboxes, not {count}"),
        ));
    }
    let timeout = body.timeout.unwrap_or(FORK_TIMEOUT_S);
    let e = e2b.clone();
    let (forks, alias) = blocking(move || {
        e.forget_gone();
        let source = e.daemon.sandbox(&id)?;
        let alias = e
            .daemon
            .template(&source.template)
            .map(|t| t.name)
            .unwrap_or_default();
        let name = format!("{FORK_TEMPLATE}{id}-{}", husk_core::store::now_unix_ms());
        let (_, made) = e.daemon.fork(&id, &name, count, "e2b")?;
        let mut forks = Vec::with_capacity(made.len());
        for c in made {
            forks.push(set_ttl(&e, &c.sandbox.id, timeout)?);
        }
        // Each fork runs with its source's environment.
        let env = lock(&e.envs).get(&id).cloned().unwrap_or_default();
        for f in &forks {
            lock(&e.envs).insert(f.id.clone(), env.clone());
        }
        Ok::<_, RestError>((forks, alias))
    })
    .await?;
    let results: Vec<Value> = forks
        .iter()
        .map(|f| json!({ "sandbox": sandbox_json(&e2b, f, &alias) }))
        .collect();
    Ok((StatusCode::CREATED, axum::Json(results)).into_response())
}

impl E2b {
    /// Removes the templates of earlier forks that no sandbox uses any
    /// more (see [`FORK_TEMPLATE`]).
    fn sweep_fork_templates(&self) {
        let Ok(templates) = self.daemon.templates() else {
            return;
        };
        let now = husk_core::store::now_unix_ms();
        for t in templates {
            if t.name.starts_with(FORK_TEMPLATE)
                && now.saturating_sub(t.created_unix_ms) > FORK_TEMPLATE_GRACE_MS
            {
                // Refused while a sandbox uses it: it goes on a later sweep.
                let _ = self.daemon.remove_template(&t.id, "e2b");
            }
        }
    }
}

// ---- volumes ----

#[derive(Debug, Deserialize, Default)]
struct TimeoutBody {
    timeout: Option<u64>,
}

/// `POST /sandboxes/{id}/pause` as SDK 2.63 sends it (`pause(mode=,
/// strict=)`).
#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct PauseBody {
    /// `false` (mode "filesystem"): only the disk kept, the next resume a
    /// cold boot. husk's pause keeps memory: refused.
    memory: Option<bool>,
    /// Refuse the pause (503, the sandbox runs on) while the guest's agent
    /// does not answer, rather than keep an unresponsive guest's memory.
    require_healthy_guest: Option<bool>,
}

/// `POST /sandboxes/{id}/connect` (and `/v2/...`): a timeout, and
/// `memory: false` to resume a paused sandbox by a cold boot.
#[derive(Debug, Deserialize, Default)]
struct ConnectBody {
    timeout: Option<u64>,
    memory: Option<bool>,
}

/// Refuses `memory: false` (E2B's mode "filesystem": only the disk kept, a
/// cold boot after) for `what`: husk keeps a sandbox's memory.
fn memory_kept(memory: Option<bool>, what: &str) -> Result<(), RestError> {
    match memory {
        Some(false) => Err(RestError(
            StatusCode::BAD_REQUEST,
            format!(
                "a file-system-only {what} (memory: false, mode \"filesystem\") is not offered: \
                 husk keeps the sandbox's memory and running programs (mode \"full\")"
            ),
        )),
        _ => Ok(()),
    }
}

fn set_ttl(e2b: &E2b, id: &str, timeout: u64) -> Result<SandboxInfo, RestError> {
    Ok(e2b.daemon.update(
        id,
        SandboxUpdate {
            ttl_s: Some(timeout.max(1)),
            ..Default::default()
        },
        "e2b",
    )?)
}

async fn set_timeout(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let body: TimeoutBody = rest_json(&body, "request")?;
    let timeout = body
        .timeout
        .ok_or_else(|| RestError(StatusCode::BAD_REQUEST, "`timeout` is required".into()))?;
    let e = e2b.clone();
    blocking(move || set_ttl(&e, &id, timeout)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn pause(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let body: PauseBody = rest_json_or_default(&body, "request")?;
    memory_kept(body.memory, "pause")?;
    let e = e2b.clone();
    blocking(move || {
        let info = e.daemon.sandbox(&id)?;
        if matches!(info.state, SandboxState::Paused | SandboxState::Hibernated) {
            return Err(RestError(
                StatusCode::CONFLICT,
                format!("sandbox {id} is already paused"),
            ));
        }
        if body.require_healthy_guest == Some(true) {
            e.daemon
                .with_agent(&id, "e2b", ("ping", "before a pause"), |c| c.ping())
                .map_err(|err| {
                    RestError(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("sandbox {id}'s agent does not answer ({err}): not paused"),
                    )
                })?;
        }
        // E2B's pause persists the sandbox: here, a hibernation (its
        // memory on disk, its VMM gone; connect or auto-resume wakes it).
        e.daemon.hibernate(&id, "e2b")?;
        Ok(())
    })
    .await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn connect(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let body: ConnectBody = rest_json_or_default(&body, "request")?;
    let e = e2b.clone();
    let (status, info, alias) = blocking(move || {
        let info = e.daemon.sandbox(&id)?;
        let status = match info.state {
            // A hibernated one wakes (only a paused one is resumed, so
            // only there does a cold boot come into it).
            SandboxState::Paused | SandboxState::Hibernated => {
                memory_kept(body.memory, "resume")?;
                e.daemon.resume(&id, "e2b")?;
                StatusCode::CREATED
            }
            SandboxState::Running => StatusCode::OK,
            other => {
                return Err(RestError(
                    StatusCode::NOT_FOUND,
                    format!("sandbox {id} is {other:?}, not running or paused"),
                ))
            }
        };
        if let Some(t) = body.timeout {
            set_ttl(&e, &id, t)?;
        }
        let info = e.daemon.sandbox(&id)?;
        let alias = e
            .daemon
            .template(&info.template)
            .map(|t| t.name)
            .unwrap_or_default();
        Ok::<_, RestError>((status, info, alias))
    })
    .await?;
    Ok((status, axum::Json(sandbox_json(&e2b, &info, &alias))).into_response())
}

async fn metrics(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let e = e2b.clone();
    let metric = blocking(move || {
        let info = e.daemon.sandbox(&id)?;
        let cpus = e
            .daemon
            .template(&info.template)
            .map_or(1, |t| u32::from(t.vcpus));
        // The VM's process: its vCPUs and devices, as the host counts them
        // (none while hibernated: no process).
        let cpu = match info.state {
            SandboxState::Hibernated => 0.0,
            _ => husk_core::daemon::vm_cpu_used_pct(info.pid, METRICS_SAMPLE, cpus).unwrap_or(0.0),
        };
        // Memory as the guest counts it, where it runs (asking a paused
        // or hibernated one would wake it); else what the VM holds.
        let mem_total = u64::from(info.mem_mib) << 20;
        let (used, total) = match info.state {
            SandboxState::Running => match e.daemon.guest_health(&id) {
                Ok(h) => (
                    h.mem_total_kib.saturating_sub(h.mem_available_kib) << 10,
                    h.mem_total_kib << 10,
                ),
                Err(_) => (
                    husk_core::daemon::vm_rss(info.pid).min(mem_total),
                    mem_total,
                ),
            },
            _ => (
                husk_core::daemon::vm_rss(info.pid).min(mem_total),
                mem_total,
            ),
        };
        let now = now_ms();
        // The page cache and the disk are not measured: 0.
        Ok::<_, RestError>(json!({
            "timestamp": rfc3339(now),
            "timestampUnix": now / 1000,
            "cpuCount": cpus,
            "cpuUsedPct": (cpu * 10.0).round() / 10.0,
            "memUsed": used,
            "memTotal": total,
            "memCache": 0,
            "diskUsed": 0,
            "diskTotal": 0,
        }))
    })
    .await?;
    Ok((StatusCode::OK, axum::Json(vec![metric])).into_response())
}

/// How long `GET /sandboxes/{id}/metrics` samples the VM's CPU use.
const METRICS_SAMPLE: Duration = Duration::from_millis(200);

// ---- data plane ----

/// Why an envd request is not for a sandbox it may reach.
struct Unreachable(StatusCode, Value);

impl IntoResponse for Unreachable {
    fn into_response(self) -> Response {
        (self.0, axum::Json(self.1)).into_response()
    }
}

/// The sandbox an envd request is for, its token checked.
fn envd_sandbox(e2b: &E2b, headers: &HeaderMap) -> Result<String, Unreachable> {
    let gone = |msg: String| {
        Unreachable(
            StatusCode::BAD_GATEWAY,
            json!({ "code": 502, "message": msg }),
        )
    };
    let Some(id) = headers.get("e2b-sandbox-id").and_then(|v| v.to_str().ok()) else {
        return Err(gone(
            "no E2b-Sandbox-Id header: the sandbox was not found".into(),
        ));
    };
    match e2b.daemon.sandbox(id) {
        Ok(info) if info.state == SandboxState::Running => {}
        // Created with `lifecycle.auto_resume`: a request resumes it.
        Ok(info)
            if matches!(info.state, SandboxState::Paused | SandboxState::Hibernated)
                && info.labels.contains_key(AUTO_RESUME) =>
        {
            tokio::task::block_in_place(|| e2b.daemon.resume(id, "e2b (auto-resume)"))
                .map_err(|e| gone(format!("sandbox {id} could not be resumed: {e}")))?;
        }
        Ok(info) => {
            return Err(gone(format!(
                "sandbox {id} is {:?}: it was not found running",
                info.state
            )))
        }
        Err(_) => return Err(gone(format!("sandbox {id} was not found"))),
    }
    let token = headers
        .get("x-access-token")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if !crate::api::constant_time_eq(token.as_bytes(), e2b.token(id).as_bytes()) {
        let e = RpcError(
            "unauthenticated",
            "invalid access token (X-Access-Token)".into(),
        );
        return Err(Unreachable(e.status(), e.json()));
    }
    Ok(id.to_owned())
}

async fn health(State(e2b): State<Shared>, headers: HeaderMap) -> Response {
    match envd_sandbox(&e2b, &headers) {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(r) => r.into_response(),
    }
}

/// A guest user as the agent takes it, with its home.
#[derive(Debug, Clone)]
struct GuestUser {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
}

impl GuestUser {
    fn id(&self) -> husk_protocol::User {
        husk_protocol::User {
            uid: self.uid,
            gid: self.gid,
        }
    }

    /// `mkdir -p` as envd does it, running as the user: what it creates is
    /// the user's. (An agent older than `MkdirAs` makes them root's.)
    fn mkdir(&self, agent: &mut AgentClient, dir: &str) -> Result<(), RpcError> {
        if self.uid == 0 {
            return agent.mkdir(dir).map_err(RpcError::from);
        }
        match agent.mkdir_as(dir, self.id()) {
            Err(e) if e.kind() == Some(husk_protocol::ErrorKind::Malformed) => {
                agent.mkdir(dir).map_err(RpcError::from)
            }
            other => other.map_err(RpcError::from),
        }
    }

    /// A file written for the user becomes the user's, as one envd wrote.
    fn own(&self, agent: &mut AgentClient, path: &str) -> Result<(), RpcError> {
        if self.uid == 0 {
            return Ok(());
        }
        match agent.chown(path, self.id()) {
            Err(e) if e.kind() == Some(husk_protocol::ErrorKind::Malformed) => {
                tracing::warn!("{path} stays root's: this sandbox's agent predates Chown");
                Ok(())
            }
            other => other.map_err(RpcError::from),
        }
    }
}

/// The user a request names (Basic auth `user:`), else `user`.
fn user_name(headers: &HeaderMap, query: Option<&str>) -> String {
    if let Some(q) = query.filter(|q| !q.is_empty()) {
        return q.to_owned();
    }
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .and_then(|b| String::from_utf8(b).ok())
        .map(|s| s.split(':').next().unwrap_or_default().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "user".to_owned())
}

impl E2b {
    /// [`E2b::user`], on an agent connection of its own only if the
    /// sandbox's /etc/passwd is not known yet.
    fn user_of(&self, id: &str, name: &str) -> Result<GuestUser, RpcError> {
        if let Some(text) = lock(&self.passwd).get(id).cloned() {
            return guest_user(&text, name);
        }
        let mut agent = self.daemon.agent(id)?;
        let user = self.user(id, &mut agent, name)?;
        self.daemon.give_back(id, agent);
        Ok(user)
    }

    /// Looks `name` up in sandbox `id`'s /etc/passwd.
    fn user(&self, id: &str, agent: &mut AgentClient, name: &str) -> Result<GuestUser, RpcError> {
        let cached = lock(&self.passwd).get(id).cloned();
        let text = match cached {
            Some(t) => t,
            None => {
                // A guest without the file has root only; one that cannot
                // be read now (its agent gone mid-request) is not cached.
                let mut passwd = Vec::new();
                match agent.read_file("/etc/passwd", &mut passwd) {
                    Err(e) if e.kind() == Some(husk_protocol::ErrorKind::NotFound) => {
                        passwd.clear()
                    }
                    read => {
                        read.map_err(RpcError::from)?;
                    }
                }
                let t = Arc::new(String::from_utf8_lossy(&passwd).into_owned());
                lock(&self.passwd).insert(id.to_owned(), t.clone());
                t
            }
        };
        guest_user(&text, name)
    }
}

/// Looks `name` up in the text of an /etc/passwd.
fn guest_user(text: &str, name: &str) -> Result<GuestUser, RpcError> {
    for line in text.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() >= 6 && f[0] == name {
            if let (Ok(uid), Ok(gid)) = (f[2].parse(), f[3].parse()) {
                return Ok(GuestUser {
                    name: name.to_owned(),
                    uid,
                    gid,
                    home: f[5].to_owned(),
                });
            }
        }
    }
    if name == "root" {
        return Ok(GuestUser {
            name: "root".into(),
            uid: 0,
            gid: 0,
            home: "/root".into(),
        });
    }
    Err(RpcError(
        "invalid_argument",
        format!("user `{name}` does not exist in the sandbox"),
    ))
}

/// A path as envd resolves it: relative to the user's home.
fn resolve(user: &GuestUser, path: &str) -> String {
    if path.starts_with('/') {
        path.to_owned()
    } else if path.is_empty() {
        user.home.clone()
    } else {
        format!("{}/{path}", user.home.trim_end_matches('/'))
    }
}

fn decode_b64(s: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .unwrap_or_default()
}

fn b64(b: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(b)
}

// Connect framing.

fn envelope(flags: u8, msg: &Value) -> Bytes {
    let body = serde_json::to_vec(msg).unwrap_or_default();
    let mut out = Vec::with_capacity(5 + body.len());
    out.push(flags);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    Bytes::from(out)
}

/// The one message of a streaming request (an envelope), or of a unary
/// one (the body).
fn request_message(headers: &HeaderMap, body: &[u8]) -> Result<Value, RpcError> {
    let streaming = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("application/connect+"));
    let json = if streaming {
        envelope_in(body)?
            .map(|(json, _)| json)
            .ok_or_else(|| RpcError("invalid_argument", "no whole request envelope".into()))?
    } else {
        body
    };
    if json.len() > MAX_RPC {
        return Err(RpcError("resource_exhausted", "request too large".into()));
    }
    if json.is_empty() {
        return Ok(json!({}));
    }
    serde_json::from_slice(json)
        .map_err(|e| RpcError("invalid_argument", format!("malformed message: {e}")))
}

/// The first envelope in `buf`: its message and the bytes it takes; None
/// while it has not all arrived.
fn envelope_in(buf: &[u8]) -> Result<Option<(&[u8], usize)>, RpcError> {
    let Some(head) = buf.get(..5) else {
        return Ok(None);
    };
    if head[0] & 1 != 0 {
        return Err(RpcError(
            "unimplemented",
            "compressed messages are not supported".into(),
        ));
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_RPC {
        return Err(RpcError("resource_exhausted", "request too large".into()));
    }
    Ok(buf.get(5..5 + len).map(|json| (json, 5 + len)))
}

fn unary(result: Result<Value, RpcError>) -> Response {
    match result {
        Ok(v) => (StatusCode::OK, axum::Json(v)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// A server stream: envelopes from `rx`, `keepalive` when it is quiet,
/// then the end-of-stream envelope.
fn stream_response(mut rx: mpsc::Receiver<Result<Value, RpcError>>, keepalive: Value) -> Response {
    let (tx, out) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(KEEPALIVE);
        ticker.tick().await;
        // Keepalives only after the first event: the SDK takes the first
        // for the stream's `start` (a program slow to start on a busy
        // guest must not be answered with a keepalive first).
        let mut started = false;
        let end = loop {
            tokio::select! {
                msg = rx.recv() => match msg {
                    Some(Ok(v)) => {
                        started = true;
                        if tx.send(Ok(envelope(0, &v))).await.is_err() {
                            return;
                        }
                    }
                    Some(Err(e)) => break json!({ "error": e.json() }),
                    None => break json!({}),
                },
                _ = ticker.tick(), if started => {
                    if tx.send(Ok(envelope(0, &keepalive))).await.is_err() {
                        return;
                    }
                }
            }
        };
        let _ = tx.send(Ok(envelope(2, &end))).await;
    });
    (
        [(header::CONTENT_TYPE, "application/connect+json")],
        Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(out)),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(json: Value) -> CreateBody {
        serde_json::from_value(json).expect("a create body")
    }

    #[test]
    fn network_options_become_the_egress_policy_or_are_refused_by_name() {
        let open = egress_of(&body(json!({ "templateID": "t" }))).expect("default");
        assert_eq!(open.allow, ["*"]);
        let closed = egress_of(&body(json!({
            "templateID": "t",
            "allow_internet_access": false,
            "network": {
                "allowOut": ["api.example.com", "*.pypi.org", "203.0.113.7/32", "198.51.100.1"],
                "rules": { "api.example.com": [
                    { "transform": { "headers": { "Authorization": "Bearer k", "X-Team": "a" } } }
                ] }
            }
        })))
        .expect("closed");
        assert_eq!(
            closed.allow,
            [
                "api.example.com",
                "*.pypi.org",
                "203.0.113.7",
                "198.51.100.1"
            ]
        );
        assert_eq!(closed.secrets.len(), 2);
        assert_eq!(
            (
                closed.secrets[0].host.as_str(),
                closed.secrets[0].header.as_str()
            ),
            ("api.example.com", "Authorization")
        );
        assert_eq!(closed.secrets[0].value, "Bearer k");
        let denied = egress_of(&body(json!({
            "templateID": "t", "network": { "denyOut": ["0.0.0.0/0"], "allowOut": ["a.example"] }
        })))
        .expect("deny all");
        assert_eq!(denied.allow, ["a.example"]);
        // No servers is what a husk sandbox has.
        egress_of(&body(
            json!({ "templateID": "t", "network": { "dnsServers": [] } }),
        ))
        .expect("no DNS servers");
        for (network, named) in [
            (json!({ "denyOut": ["10.0.0.0/8"] }), "denyOut `10.0.0.0/8`"),
            (
                json!({ "allowOut": ["203.0.113.0/24"] }),
                "allowOut `203.0.113.0/24`",
            ),
            (json!({ "egressProxy": { "address": "x" } }), "egressProxy"),
            (json!({ "httpsPorts": [8443] }), "httpsPorts"),
            (json!({ "dnsServers": ["1.1.1.1"] }), "dnsServers"),
        ] {
            let err = egress_of(&body(json!({ "templateID": "t", "network": network })))
                .expect_err(named);
            assert!(err.contains(named), "{err}");
        }
    }

    #[test]
    fn lifecycle_options_become_the_expiry_policy() {
        let expiry = |json: Value| expiry_of(&body(json));
        assert_eq!(expiry(json!({ "templateID": "t" })), ExpiryPolicy::Destroy);
        assert_eq!(
            expiry(json!({ "templateID": "t", "autoPause": true })),
            ExpiryPolicy::Pause
        );
        assert_eq!(
            expiry(json!({ "templateID": "t", "autoPause": true, "autoPauseMemory": false })),
            ExpiryPolicy::Hibernate
        );
    }

    #[test]
    fn times_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339(1_796_083_200_000), "2026-12-01T00:00:00.000Z");
    }

    #[test]
    fn envelopes_frame_json() {
        let e = envelope(2, &json!({}));
        assert_eq!(&e[..], b"\x02\x00\x00\x00\x02{}");
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            "application/connect+json".parse().expect("value"),
        );
        let msg = request_message(&h, b"\x00\x00\x00\x00\x07{\"a\":1}").expect("message");
        assert_eq!(msg, json!({ "a": 1 }));
        assert!(request_message(&h, b"\x01\x00\x00\x00\x02{}").is_err());
        assert!(request_message(&h, b"\x00\x00\x00\x00\x09{}").is_err());
        assert_eq!(unescape("a%3Db%26c%3Dd"), "a=b&c=d");
    }
}
