//! Named secrets: values the daemon keeps (in its store, as it keeps the
//! credentials of sandboxes' egress) for the egress proxy to put into
//! requests where a credential's value names them
//! (`${husk.secrets.NAME}`). Their values are write-only: no call answers
//! them, and they never reach a guest. The proxy reads them per request
//! (see [`crate::egress::Vault`]), so an update is used from the next
//! request on, and a request whose credential names a deleted secret is
//! refused (502) rather than sent without it.

use husk_types::{check_secret_name, check_secret_value, SecretInfo, SecretRequest};

use crate::store::SecretRecord;

use super::*;

fn info(rec: SecretRecord) -> SecretInfo {
    SecretInfo {
        id: rec.id,
        name: rec.name,
        version: rec.version,
        metadata: rec.metadata,
        created_unix_ms: rec.created_unix_ms,
        updated_unix_ms: rec.updated_unix_ms,
    }
}

/// Most metadata entries of a secret, and bytes of each key and value.
const MAX_METADATA: usize = 64;
const MAX_METADATA_BYTES: usize = 1024;

fn check_metadata(metadata: &BTreeMap<String, String>) -> Result<(), DaemonError> {
    if metadata.len() > MAX_METADATA {
        return Err(DaemonError::Invalid(format!(
            "{} metadata entries, at most {MAX_METADATA}",
            metadata.len()
        )));
    }
    match metadata
        .iter()
        .find(|(k, v)| k.is_empty() || k.len() > MAX_METADATA_BYTES || v.len() > MAX_METADATA_BYTES)
    {
        Some((k, _)) => Err(DaemonError::Invalid(format!(
            "metadata `{}`: keys have 1 to {MAX_METADATA_BYTES} bytes, values at most as many",
            k.escape_debug()
        ))),
        None => Ok(()),
    }
}

impl Daemon {
    /// Makes secret `req.name` with `req.value`, version 1.
    pub fn create_secret(&self, req: SecretRequest, who: &str) -> Result<SecretInfo, DaemonError> {
        let name = req
            .name
            .ok_or_else(|| DaemonError::Invalid("a secret needs a `name`".into()))?;
        check_secret_name(&name).map_err(DaemonError::Invalid)?;
        check_secret_value(&req.value).map_err(DaemonError::Invalid)?;
        let metadata = req.metadata.unwrap_or_default();
        check_metadata(&metadata)?;
        let now = now_unix_ms();
        let rec = SecretRecord {
            id: crate::ids::random_id("sec", 12)?,
            name,
            value: req.value,
            version: 1,
            metadata,
            created_unix_ms: now,
            updated_unix_ms: now,
        };
        if !self.store.put_secret(&rec)? {
            return Err(DaemonError::Conflict(format!(
                "a secret named `{}` exists already: update it instead",
                rec.name
            )));
        }
        self.egress.vault().set(&rec.name, &rec.value);
        self.store.audit(
            who,
            "secret-create",
            None,
            None,
            &format!("{} {}", rec.id, rec.name),
        )?;
        Ok(info(rec))
    }

    /// Gives secret `id_or_name` a new value (its next version), and new
    /// metadata if `req` has some.
    pub fn update_secret(
        &self,
        id_or_name: &str,
        req: SecretRequest,
        who: &str,
    ) -> Result<SecretInfo, DaemonError> {
        check_secret_value(&req.value).map_err(DaemonError::Invalid)?;
        if let Some(metadata) = &req.metadata {
            check_metadata(metadata)?;
        }
        let mut rec = self.secret_record(id_or_name)?;
        if req.name.as_ref().is_some_and(|n| *n != rec.name) {
            return Err(DaemonError::Invalid(
                "a secret's name does not change: make a new one".into(),
            ));
        }
        rec.value = req.value;
        rec.version += 1;
        if let Some(metadata) = req.metadata {
            rec.metadata = metadata;
        }
        rec.updated_unix_ms = now_unix_ms();
        self.store.put_secret(&rec)?;
        self.egress.vault().set(&rec.name, &rec.value);
        self.store.audit(
            who,
            "secret-update",
            None,
            None,
            &format!("{} {} version {}", rec.id, rec.name, rec.version),
        )?;
        Ok(info(rec))
    }

    /// Secret `id_or_name` (never its value).
    pub fn secret(&self, id_or_name: &str) -> Result<SecretInfo, DaemonError> {
        self.secret_record(id_or_name).map(info)
    }

    fn secret_record(&self, id_or_name: &str) -> Result<SecretRecord, DaemonError> {
        self.store
            .secret(id_or_name)?
            .ok_or_else(|| DaemonError::NotFound(format!("no secret `{id_or_name}`")))
    }

    /// Every secret, by name (never their values).
    pub fn secrets(&self) -> Result<Vec<SecretInfo>, DaemonError> {
        Ok(self.store.secrets()?.into_iter().map(info).collect())
    }

    /// Deletes secret `id_or_name`: credentials that name it are refused
    /// from the next request on.
    pub fn delete_secret(&self, id_or_name: &str, who: &str) -> Result<(), DaemonError> {
        let rec = self.secret_record(id_or_name)?;
        self.store.remove_secret(&rec.id)?;
        self.egress.vault().remove(&rec.name);
        self.store.audit(
            who,
            "secret-delete",
            None,
            None,
            &format!("{} {}", rec.id, rec.name),
        )?;
        Ok(())
    }
}
