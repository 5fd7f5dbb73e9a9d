//! envd's file system: the `filesystem.Filesystem` Connect RPC (stat,
//! listings, make, move, remove, watches) and `/files` (download and
//! multipart upload, signed URLs too), on the agent's file calls. File
//! metadata are the file's `user.e2b.*` extended attributes.

use super::*;

/// Where E2B's file metadata are among a file's `user.` extended
/// attributes: key `k` is `user.e2b.k`.
const METADATA: &str = "e2b.";
/// The upload headers that carry file metadata.
const METADATA_HEADER: &str = "x-metadata-";

/// E2B's metadata among a file's `user.` attributes.
fn metadata_of(attrs: husk_protocol::Attributes) -> serde_json::Map<String, Value> {
    attrs
        .into_iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(METADATA)?.to_owned(), Value::String(v))))
        .collect()
}

/// A path's metadata; none where the agent cannot tell (an older agent,
/// a file gone meanwhile).
fn metadata_at(agent: &mut AgentClient, path: &str) -> serde_json::Map<String, Value> {
    agent
        .user_attrs(path, &[])
        .map(metadata_of)
        .unwrap_or_default()
}

/// An upload's metadata from its `X-Metadata-KEY` headers, keys lowercased
/// as envd does; values must be printable ASCII (as the SDK checks).
fn upload_metadata(headers: &HeaderMap) -> Result<husk_protocol::Attributes, String> {
    let mut meta = Vec::new();
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix(METADATA_HEADER) else {
            continue;
        };
        let value = value
            .to_str()
            .ok()
            .filter(|v| v.bytes().all(|b| (0x20..0x7f).contains(&b)))
            .ok_or_else(|| format!("metadata `{key}`: a value must be printable ASCII"))?;
        meta.push((format!("{METADATA}{key}"), value.to_owned()));
    }
    Ok(meta)
}

/// `EntryInfo` of a guest path, with its metadata.
fn entry_info(
    path: &str,
    stat: &husk_protocol::FileStat,
    metadata: serde_json::Map<String, Value>,
) -> Value {
    use husk_protocol::FileKind as K;
    let kind = match stat.kind {
        K::File => "FILE_TYPE_FILE",
        K::Dir => "FILE_TYPE_DIRECTORY",
        _ => "FILE_TYPE_UNSPECIFIED",
    };
    let name = path.rsplit('/').next().unwrap_or(path);
    let mut perms = String::with_capacity(10);
    perms.push(match stat.kind {
        K::Dir => 'd',
        K::Symlink => 'l',
        _ => '-',
    });
    for shift in [6, 3, 0] {
        let bits = (stat.mode >> shift) & 7;
        perms.push(if bits & 4 != 0 { 'r' } else { '-' });
        perms.push(if bits & 2 != 0 { 'w' } else { '-' });
        perms.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    let mut entry = json!({
        "name": name,
        "type": kind,
        "path": path,
        "size": stat.size.to_string(),
        "mode": stat.mode,
        "permissions": perms,
        "owner": "",
        "group": "",
        "modifiedTime": rfc3339(stat.mtime_s.max(0) as u64 * 1000),
    });
    if !metadata.is_empty() {
        entry["metadata"] = Value::Object(metadata);
    }
    entry
}

pub(super) async fn filesystem_rpc(
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
    let name = user_name(&headers, None);
    if method == "WatchDir" {
        let (tx, rx) = mpsc::channel(64);
        let e = e2b.clone();
        std::thread::spawn(move || watch_stream(&e, &id, &name, &msg, tx));
        // WatchDirResponse has its oneof at the top.
        return stream_response(rx, json!({ "keepalive": {} }));
    }
    let e = e2b.clone();
    unary(
        blocking(move || {
            let mut agent = e.daemon.agent(&id).map_err(RpcError::from)?;
            let user = e.user(&id, &mut agent, &name)?;
            let path = |field: &str| -> Result<String, RpcError> {
                msg[field]
                    .as_str()
                    .map(|p| resolve(&user, p))
                    .ok_or_else(|| RpcError("invalid_argument", format!("`{field}` is required")))
            };
            match method.as_str() {
                "Stat" => {
                    let p = path("path")?;
                    let st = agent.stat(&p).map_err(RpcError::from)?;
                    let meta = metadata_at(&mut agent, &p);
                    Ok(json!({ "entry": entry_info(&p, &st, meta) }))
                }
                "MakeDir" => {
                    let p = path("path")?;
                    e.daemon.audit(ENVD_WHO, "mkdir", &id, &p)?;
                    if agent.stat(&p).is_ok() {
                        return Err(RpcError("already_exists", format!("{p} already exists")));
                    }
                    user.mkdir(&mut agent, &p)?;
                    let st = agent.stat(&p).map_err(RpcError::from)?;
                    Ok(json!({ "entry": entry_info(&p, &st, Default::default()) }))
                }
                "ListDir" => {
                    let p = path("path")?;
                    e.daemon.audit(ENVD_WHO, "list", &id, &p)?;
                    let depth = msg["depth"].as_u64().unwrap_or(1).clamp(1, 16);
                    let mut entries = Vec::new();
                    let mut todo = vec![(p.trim_end_matches('/').to_owned(), 1)];
                    if agent.stat(&p).map_err(RpcError::from)?.kind != husk_protocol::FileKind::Dir
                    {
                        return Err(RpcError(
                            "invalid_argument",
                            format!("{p} is not a directory"),
                        ));
                    }
                    while let Some((dir, level)) = todo.pop() {
                        // The metadata of the directory's entries, in one
                        // request (none from an older agent).
                        let mut meta: HashMap<String, husk_protocol::Attributes> = agent
                            .dir_user_attrs(&dir)
                            .map(|e| e.into_iter().collect())
                            .unwrap_or_default();
                        for ent in agent.list(&dir).map_err(RpcError::from)? {
                            let full = format!("{dir}/{}", ent.name);
                            if ent.stat.kind == husk_protocol::FileKind::Dir && level < depth {
                                todo.push((full.clone(), level + 1));
                            }
                            let m = metadata_of(meta.remove(&ent.name).unwrap_or_default());
                            entries.push(entry_info(&full, &ent.stat, m));
                        }
                        if entries.len() > 100_000 {
                            return Err(RpcError(
                                "resource_exhausted",
                                "more than 100000 entries".into(),
                            ));
                        }
                    }
                    Ok(json!({ "entries": entries }))
                }
                "Move" => {
                    let (from, to) = (path("source")?, path("destination")?);
                    e.daemon
                        .audit(ENVD_WHO, "rename", &id, &format!("{from} -> {to}"))?;
                    agent.rename(&from, &to).map_err(RpcError::from)?;
                    let st = agent.stat(&to).map_err(RpcError::from)?;
                    let meta = metadata_at(&mut agent, &to);
                    Ok(json!({ "entry": entry_info(&to, &st, meta) }))
                }
                "Remove" => {
                    let p = path("path")?;
                    e.daemon.audit(ENVD_WHO, "remove", &id, &p)?;
                    agent.remove(&p, true).map_err(RpcError::from)?;
                    Ok(json!({}))
                }
                "CreateWatcher" => {
                    let p = path("path")?;
                    let recursive = msg["recursive"].as_bool().unwrap_or(false);
                    create_watcher(&e, &id, agent, &p, recursive)
                }
                "GetWatcherEvents" => {
                    let w = msg["watcherId"].as_str().unwrap_or_default();
                    let watchers = lock(&e.watchers);
                    let Some(watcher) = watchers.get(w).filter(|x| x.sandbox == id) else {
                        return Err(RpcError("not_found", format!("no watcher `{w}`")));
                    };
                    let events = std::mem::take(&mut *lock(&watcher.events));
                    Ok(json!({ "events": events }))
                }
                "RemoveWatcher" => {
                    let w = msg["watcherId"].as_str().unwrap_or_default();
                    let mut watchers = lock(&e.watchers);
                    match watchers.get(w) {
                        Some(x) if x.sandbox == id => {
                            x.stop.store(true, Ordering::SeqCst);
                            watchers.remove(w);
                            Ok(json!({}))
                        }
                        _ => Err(RpcError("not_found", format!("no watcher `{w}`"))),
                    }
                }
                other => Err(RpcError(
                    "unimplemented",
                    format!("filesystem.Filesystem/{other} is not served by husk"),
                )),
            }
        })
        .await,
    )
}

/// An envd filesystem event for an agent's change under `dir`.
fn fs_event(dir: &str, e: &husk_protocol::FsEvent) -> Option<Value> {
    use husk_protocol::FsEventKind as K;
    let kind = match e.kind {
        K::Created | K::MovedTo => "EVENT_TYPE_CREATE",
        K::Modified | K::Closed => "EVENT_TYPE_WRITE",
        K::Removed => "EVENT_TYPE_REMOVE",
        K::MovedFrom => "EVENT_TYPE_RENAME",
        _ => return None,
    };
    let name = e
        .path
        .strip_prefix(&format!("{}/", dir.trim_end_matches('/')))
        .unwrap_or(&e.path)
        .to_owned();
    Some(json!({ "name": name, "type": kind }))
}

/// `WatchDir`: a stream of the changes under a directory, until the client
/// goes (noticed at the next change) or the sandbox does.
fn watch_stream(
    e2b: &E2b,
    sandbox: &str,
    user: &str,
    msg: &Value,
    tx: mpsc::Sender<Result<Value, RpcError>>,
) {
    let watched = (|| {
        let mut agent = e2b.daemon.agent(sandbox).map_err(RpcError::from)?;
        let user = e2b.user(sandbox, &mut agent, user)?;
        let dir = msg["path"]
            .as_str()
            .map(|p| resolve(&user, p))
            .ok_or_else(|| RpcError("invalid_argument", "`path` is required".into()))?;
        Ok::<_, RpcError>((agent, dir))
    })();
    let (mut agent, dir) = match watched {
        Ok(v) => v,
        Err(e) => return drop(tx.blocking_send(Err(e))),
    };
    let recursive = msg["recursive"].as_bool().unwrap_or(false);
    let mut watch = match agent.watch(&dir, recursive) {
        Ok(w) => w,
        Err(e) => return drop(tx.blocking_send(Err(e.into()))),
    };
    if tx.blocking_send(Ok(json!({ "start": {} }))).is_err() {
        return;
    }
    while let Ok(batch) = watch.next_events() {
        for e in batch.iter().filter_map(|e| fs_event(&dir, e)) {
            if tx.blocking_send(Ok(json!({ "filesystem": e }))).is_err() {
                return;
            }
        }
    }
}

/// Starts a watcher whose events wait for `GetWatcherEvents`.
fn create_watcher(
    e2b: &Arc<E2b>,
    sandbox: &str,
    agent: AgentClient,
    path: &str,
    recursive: bool,
) -> Result<Value, RpcError> {
    let count = lock(&e2b.watchers)
        .values()
        .filter(|w| w.sandbox == sandbox)
        .count();
    if count >= MAX_WATCHERS {
        return Err(RpcError(
            "resource_exhausted",
            format!("at most {MAX_WATCHERS} watchers per sandbox"),
        ));
    }
    let events = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (ev, st, dir) = (events.clone(), stop.clone(), path.to_owned());
    std::thread::spawn(move || {
        let mut agent = agent;
        let mut watch = match agent.watch(&dir, recursive) {
            Ok(w) => {
                let _ = ready_tx.send(Ok(()));
                w
            }
            Err(e) => return drop(ready_tx.send(Err(RpcError::from(e)))),
        };
        // Ends with the sandbox (the connection closes) or at the first
        // batch after the watcher is removed.
        while let Ok(batch) = watch.next_events() {
            if st.load(Ordering::SeqCst) {
                break;
            }
            let mut held = lock(&ev);
            for e in batch {
                let Some(event) = fs_event(&dir, &e) else {
                    continue;
                };
                if held.len() < 10_000 {
                    held.push(event);
                }
            }
        }
    });
    ready_rx
        .recv()
        .map_err(|_| RpcError("internal", "the watcher did not start".into()))??;
    let id = format!("w{}", e2b.next_watcher.fetch_add(1, Ordering::SeqCst));
    lock(&e2b.watchers).insert(
        id.clone(),
        Watcher {
            sandbox: sandbox.to_owned(),
            events,
            stop,
        },
    );
    Ok(json!({ "watcherId": id }))
}

#[derive(Debug, Deserialize)]
pub(super) struct FileQuery {
    path: Option<String>,
    username: Option<String>,
    /// A signed URL's signature (the SDK's `download_url`/`upload_url`).
    signature: Option<String>,
    signature_expiration: Option<u64>,
}

/// The sandbox a `/files` request is for: by its `E2b-Sandbox-Id` and
/// access token, or, for a signed URL (which carries neither: it is made
/// to be handed to a browser or `curl`), by its signature, which only the
/// sandbox's access token makes (E2B's v1: base64 of the SHA-256 of
/// `path:operation:username:token[:expiration]`).
fn file_sandbox(
    e2b: &E2b,
    headers: &HeaderMap,
    q: &FileQuery,
    operation: &str,
) -> Result<String, Unreachable> {
    let Some(signature) = q
        .signature
        .as_deref()
        .filter(|_| !headers.contains_key("e2b-sandbox-id"))
    else {
        return envd_sandbox(e2b, headers);
    };
    let refused = |msg: &str| {
        let e = RpcError("unauthenticated", msg.to_owned());
        Unreachable(e.status(), e.json())
    };
    if let Some(expiry) = q.signature_expiration {
        if expiry.saturating_mul(1000) < now_ms() {
            return Err(refused("the signed URL has expired"));
        }
    }
    let path = q.path.as_deref().unwrap_or_default();
    let user = q.username.as_deref().unwrap_or_default();
    let expected = |token: &str| {
        let raw = match q.signature_expiration {
            Some(exp) => format!("{path}:{operation}:{user}:{token}:{exp}"),
            None => format!("{path}:{operation}:{user}:{token}"),
        };
        let digest = Sha256::digest(raw.as_bytes());
        format!(
            "v1_{}",
            base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
        )
    };
    let labels = BTreeMap::from([("e2b".to_owned(), "1".to_owned())]);
    // Each candidate compared in full (no early exit on a match).
    let found = e2b
        .daemon
        .list(&labels, Some(SandboxState::Running))
        .into_iter()
        .fold(None, |found, info| {
            let same = crate::api::constant_time_eq(
                signature.as_bytes(),
                expected(&e2b.token(&info.id)).as_bytes(),
            );
            found.or(same.then_some(info.id))
        });
    found.ok_or_else(|| refused("the URL's signature is not valid for any running sandbox"))
}

fn file_error(status: StatusCode, message: String) -> Response {
    (
        status,
        axum::Json(json!({ "code": status.as_u16(), "message": message })),
    )
        .into_response()
}

pub(super) async fn download(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<FileQuery>,
) -> Response {
    let id = match file_sandbox(&e2b, &headers, &q, "read") {
        Ok(id) => id,
        Err(r) => return r.into_response(),
    };
    let name = user_name(&headers, q.username.as_deref());
    let e = e2b.clone();
    let opened = crate::api::stream_guest_file(
        move || {
            let mut agent = e.daemon.agent(&id).map_err(RpcError::from)?;
            let user = e.user(&id, &mut agent, &name)?;
            let path = resolve(&user, q.path.as_deref().unwrap_or_default());
            e.daemon.audit(ENVD_WHO, "download", &id, &path)?;
            let st = agent.stat(&path).map_err(RpcError::from)?;
            if st.kind != husk_protocol::FileKind::File {
                return Err(RpcError(
                    "invalid_argument",
                    format!("{path} is not a file"),
                ));
            }
            Ok((agent, path, st.size))
        },
        || RpcError("internal", "the file worker ended".into()),
    )
    .await;
    match opened {
        // Chunked, not sized: a file that changes while it is read must not
        // break the framing; a read that fails cuts the body short.
        Ok((_, body)) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/octet-stream")],
            body,
        )
            .into_response(),
        Err(e) => file_error(e.status(), e.1),
    }
}

/// One part of a multipart body: field name, file name, bytes.
type Part = (String, Option<String>, Vec<u8>);

/// The parts of a multipart body.
fn multipart(content_type: &str, body: &[u8]) -> Result<Vec<Part>, String> {
    let boundary = content_type
        .split(';')
        .find_map(|p| p.trim().strip_prefix("boundary="))
        .map(|b| b.trim_matches('"'))
        .ok_or("multipart without a boundary")?;
    let delim = format!("--{boundary}").into_bytes();
    let find = |hay: &[u8], needle: &[u8], from: usize| {
        hay.get(from..)?
            .windows(needle.len())
            .position(|w| w == needle)
            .map(|p| p + from)
    };
    let mut parts = Vec::new();
    let mut at = find(body, &delim, 0).ok_or("no multipart boundary in the body")?;
    loop {
        at += delim.len();
        if body.get(at..at + 2) == Some(b"--") {
            break;
        }
        at += 2; // CRLF
        let head_end = find(body, b"\r\n\r\n", at).ok_or("a multipart part without headers")?;
        let head = String::from_utf8_lossy(&body[at..head_end]).into_owned();
        let data_start = head_end + 4;
        let mut end_delim = b"\r\n".to_vec();
        end_delim.extend_from_slice(&delim);
        let next = find(body, &end_delim, data_start).ok_or("an unterminated multipart part")?;
        let disposition = head
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("content-disposition:"))
            .unwrap_or_default();
        let param = |name: &str| {
            disposition.split(';').find_map(|p| {
                p.trim()
                    .strip_prefix(&format!("{name}="))
                    .map(|v| v.trim_matches('"').to_owned())
            })
        };
        parts.push((
            param("name").unwrap_or_default(),
            param("filename"),
            body[data_start..next].to_vec(),
        ));
        at = next + 2;
    }
    Ok(parts)
}

pub(super) async fn upload(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<FileQuery>,
    body: Bytes,
) -> Response {
    let id = match file_sandbox(&e2b, &headers, &q, "write") {
        Ok(id) => id,
        Err(r) => return r.into_response(),
    };
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let files: Vec<(Option<String>, Vec<u8>)> = if content_type.starts_with("multipart/") {
        match multipart(&content_type, &body) {
            Ok(parts) => parts
                .into_iter()
                .filter(|(field, _, _)| field == "file")
                .map(|(_, name, data)| (q.path.clone().or(name), data))
                .collect(),
            Err(e) => return file_error(StatusCode::BAD_REQUEST, e),
        }
    } else {
        if headers
            .get(header::CONTENT_ENCODING)
            .is_some_and(|v| v != "identity")
        {
            return file_error(
                StatusCode::BAD_REQUEST,
                "compressed uploads are not supported".into(),
            );
        }
        vec![(q.path.clone(), body.to_vec())]
    };
    if files.is_empty() {
        return file_error(StatusCode::BAD_REQUEST, "no `file` in the upload".into());
    }
    let metadata = match upload_metadata(&headers) {
        Ok(m) => m,
        Err(e) => return file_error(StatusCode::BAD_REQUEST, e),
    };
    let name = user_name(&headers, q.username.as_deref());
    let e = e2b.clone();
    let written = blocking(move || {
        let mut agent = e.daemon.agent(&id).map_err(RpcError::from)?;
        let user = e.user(&id, &mut agent, &name)?;
        let mut out = Vec::new();
        for (path, data) in files {
            let path =
                path.ok_or_else(|| RpcError("invalid_argument", "no path for the file".into()))?;
            let path = resolve(&user, &path);
            e.daemon.audit(ENVD_WHO, "upload", &id, &path)?;
            if let Some((dir, _)) = path.rsplit_once('/').filter(|(d, _)| !d.is_empty()) {
                user.mkdir(&mut agent, dir)?;
            }
            agent
                .write_file(&path, 0o644, &data[..])
                .map_err(RpcError::from)?;
            user.own(&mut agent, &path)?;
            let file = path.rsplit('/').next().unwrap_or_default().to_owned();
            let mut entry = json!({ "name": file, "type": "file", "path": path });
            if !metadata.is_empty() {
                let attrs = agent.user_attrs(&path, &metadata).map_err(|e| {
                    let why = RpcError::from(e);
                    RpcError(why.0, format!("the metadata of {path}: {}", why.1))
                })?;
                entry["metadata"] = Value::Object(metadata_of(attrs));
            }
            out.push(entry);
        }
        Ok::<_, RpcError>(out)
    })
    .await;
    match written {
        Ok(v) => (StatusCode::OK, axum::Json(v)).into_response(),
        Err(e) => file_error(e.status(), e.1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multipart_bodies_are_split() {
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/tmp/a.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\n--XyZ--\r\n";
        let parts = multipart("multipart/form-data; boundary=XyZ", body).expect("parts");
        assert_eq!(
            parts,
            [(
                "file".to_owned(),
                Some("/tmp/a.txt".to_owned()),
                b"hello".to_vec()
            )]
        );
        assert!(multipart("multipart/form-data", body).is_err());
        assert!(multipart("multipart/form-data; boundary=XyZ", b"--XyZ\r\nno end").is_err());
    }
}
