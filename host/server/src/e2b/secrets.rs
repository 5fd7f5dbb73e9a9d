//! E2B's secrets (SDK 2.63's `Secret`): `GET|POST /secrets`, `GET|POST|
//! DELETE /secrets/{id}`, on husk-core's named secrets. A network rule's
//! header naming `${e2b.secrets.NAME}` becomes a credential naming husk's
//! `${husk.secrets.NAME}` (see [`placeholders`]), which the egress proxy
//! resolves per request on the host: the value never enters the guest, an
//! update is used from the next request on, and a request whose rule names
//! a secret that does not exist is refused with the reason.

use husk_types::{SecretInfo, SecretRequest};

use super::*;

/// E2B's placeholder for a secret; husk's is `husk_types::SECRET_PLACEHOLDER`.
const E2B_PLACEHOLDER: &str = "${e2b.secrets.";
/// E2B's placeholder for a workload identity token, which husk has not.
const E2B_IDENTITY: &str = "${e2b.identity.";

/// A rule header's value with E2B's secret placeholders as husk's; a
/// workload identity token (`iam`) is refused with the reason.
pub(super) fn placeholders(value: &str) -> Result<String, String> {
    if value.contains(E2B_IDENTITY) {
        return Err(
            "network.rules: workload identity tokens (${e2b.identity...}) are not supported \
             by husk: use a secret (${e2b.secrets.NAME})"
                .into(),
        );
    }
    Ok(value.replace(E2B_PLACEHOLDER, husk_types::SECRET_PLACEHOLDER))
}

/// A secret as the SDK reads it (never its value).
fn secret_json(s: &SecretInfo) -> Value {
    json!({
        "secretID": s.id,
        "name": s.name,
        "currentVersion": s.version,
        "metadata": s.metadata,
        "createdAt": rfc3339(s.created_unix_ms),
        "updatedAt": rfc3339(s.updated_unix_ms),
    })
}

/// `NewSecret` and `SecretUpdate`, as the SDK sends them.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SecretBody {
    name: Option<String>,
    value: String,
    metadata: Option<BTreeMap<String, String>>,
}

impl SecretBody {
    fn request(self) -> SecretRequest {
        SecretRequest {
            name: self.name,
            value: self.value,
            metadata: self.metadata,
        }
    }
}

/// `POST /secrets`: 201 with the secret, version 1.
pub(super) async fn create_secret(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let body: SecretBody = rest_json(&body, "secret")?;
    let e = e2b.clone();
    let s = blocking(move || Ok::<_, RestError>(e.daemon.create_secret(body.request(), "e2b")?))
        .await?;
    Ok((StatusCode::CREATED, axum::Json(secret_json(&s))).into_response())
}

/// `POST /secrets/{id}`: the secret's next version.
pub(super) async fn update_secret(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let body: SecretBody = rest_json(&body, "secret update")?;
    let e = e2b.clone();
    let s =
        blocking(move || Ok::<_, RestError>(e.daemon.update_secret(&id, body.request(), "e2b")?))
            .await?;
    Ok(axum::Json(secret_json(&s)).into_response())
}

/// `GET /secrets/{id}`.
pub(super) async fn secret(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let e = e2b.clone();
    let s = blocking(move || Ok::<_, RestError>(e.daemon.secret(&id)?)).await?;
    Ok(axum::Json(secret_json(&s)).into_response())
}

/// `DELETE /secrets/{id}`: 204.
pub(super) async fn delete_secret(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let e = e2b.clone();
    blocking(move || Ok::<_, RestError>(e.daemon.delete_secret(&id, "e2b")?)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct SecretsQuery {
    limit: Option<usize>,
    next_token: Option<String>,
}

/// `GET /secrets`: by name, paged by `limit` with `x-next-token`.
pub(super) async fn list_secrets(
    State(e2b): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<SecretsQuery>,
) -> Result<Response, RestError> {
    check_key(&e2b, &headers)?;
    let e = e2b.clone();
    let all = blocking(move || Ok::<_, RestError>(e.daemon.secrets()?)).await?;
    paged(
        all.iter().map(secret_json).collect(),
        q.limit,
        q.next_token.as_deref(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2b_placeholders_become_husks_and_identity_tokens_are_refused() {
        assert_eq!(
            placeholders("Bearer ${e2b.secrets.tok}").as_deref(),
            Ok("Bearer ${husk.secrets.tok}")
        );
        assert_eq!(placeholders("plain").as_deref(), Ok("plain"));
        assert!(placeholders("Bearer ${e2b.identity.tokens.aws}").is_err());
    }
}
