//! The daemon's state in an embedded SQLite database
//! (`<state dir>/husk.db`): templates, sandboxes (pooled ones included),
//! pool targets and the append-only audit log. Every change is one
//! transaction, so a daemon killed at any point restarts from a state that
//! was true at some moment; what it cannot know (did a VMM survive?) it
//! checks against the host when it starts (see `daemon`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use husk_types::{AuditEntry, ExpiryPolicy, SandboxState, TemplateRecord};
use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

/// Errors reading or writing the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the state database {path}: {source}")]
    /// The database file cannot be opened.
    Open {
        /// The database file.
        path: PathBuf,
        #[source]
        /// Why.
        source: rusqlite::Error,
    },
    #[error("the state database: {0}")]
    /// A query failed.
    Sql(#[from] rusqlite::Error),
    #[error("a record in the state database does not decode: {0}")]
    /// A record does not decode.
    Decode(#[from] serde_json::Error),
}

/// The schema; `user_version` says which one a database has.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS templates (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    template TEXT NOT NULL,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS volumes (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    created_unix_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS secrets (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS pools (
    template TEXT PRIMARY KEY,
    target INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    unix_ms INTEGER NOT NULL,
    who TEXT NOT NULL,
    action TEXT NOT NULL,
    sandbox TEXT,
    template TEXT,
    detail TEXT NOT NULL
);
-- The audit log is append-only: the database itself refuses edits.
CREATE TRIGGER IF NOT EXISTS audit_no_update BEFORE UPDATE ON audit
    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
CREATE TRIGGER IF NOT EXISTS audit_no_delete BEFORE DELETE ON audit
    BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
PRAGMA user_version = 1;
";

/// A sandbox as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    /// Its id (`sb-...`).
    pub id: String,
    /// The id of its template.
    pub template: String,
    /// Where it is in its life.
    pub state: SandboxState,
    /// Its husk-vmm, and that process's start time (field 22 of
    /// /proc/PID/stat), so that a reused pid is not taken for it.
    pub pid: u32,
    /// Its VMM's start time (field 22 of /proc/PID/stat).
    pub pid_start: u64,
    /// Its sockets, console, log and overlays.
    pub run_dir: PathBuf,
    /// Its guest memory, in MiB.
    pub mem_mib: u32,
    /// When it was created, in ms since the epoch.
    pub created_unix_ms: u64,
    /// When it expires (ms since the epoch), if it has a time to live.
    pub expires_unix_ms: Option<u64>,
    /// What happens when its time to live runs out.
    pub on_expiry: ExpiryPolicy,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Why it failed.
    pub error: Option<String>,
    /// Its TAP device and the guest's MAC, for a template with a network.
    #[serde(default)]
    pub tap: Option<String>,
    #[serde(default)]
    /// Its guest's MAC address.
    pub mac: Option<String>,
    /// The uid its VMM's jail runs as (0: not jailed).
    #[serde(default)]
    pub uid: u32,
    /// Where its egress proxy lets it connect (`egress::Allowlist` entries).
    #[serde(default)]
    pub egress_allow: Vec<String>,
    /// Credentials its egress proxy adds (kept on the host only).
    #[serde(default)]
    pub egress_secrets: Vec<husk_types::SecretSpec>,
    /// Its last hibernation's directory (what a wake restores).
    #[serde(default)]
    pub hibernation: Option<PathBuf>,
    /// The bytes its hibernation takes on disk while it is hibernated.
    #[serde(default)]
    pub hibernated_bytes: Option<u64>,
    /// The token requests to its ports must carry, when they are private.
    #[serde(default)]
    pub traffic_token: Option<String>,
    /// What happens when nobody uses it for a while.
    #[serde(default)]
    pub on_idle: Option<husk_types::IdlePolicy>,
    /// The pod network namespace its TAP was moved to (see
    /// `Daemon::attach_pod_network`).
    #[serde(default)]
    pub pod_netns: Option<PathBuf>,
    /// Its drives that hold a medium in use: drive id -> the image's
    /// SHA-256 (see `Daemon::insert_medium`).
    #[serde(default)]
    pub media: BTreeMap<String, String>,
    /// Its host directories (the host paths as resolved).
    #[serde(default)]
    pub mounts: Vec<husk_types::MountSpec>,
    /// The fs slot each of `mounts` is in (a create's are in 0, 1, ...;
    /// one added later in the next slot not used).
    #[serde(default)]
    pub mount_slots: Vec<u8>,
    /// How many of its template's fs slots it has used: its mounts' and
    /// any whose mount failed (the VMM may hold that share).
    #[serde(default)]
    pub fs_slots_used: u8,
}

/// A named secret as stored: with its value (see [`crate::egress::Vault`]).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretRecord {
    /// Its id (`sec-...`).
    pub id: String,
    /// Its name, unique.
    pub name: String,
    /// Its value (never shown).
    pub value: String,
    /// 1 when made, one more at each update.
    pub version: u32,
    /// The caller's metadata.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// When it was made, in ms since the epoch.
    pub created_unix_ms: u64,
    /// When it last changed, in ms since the epoch.
    pub updated_unix_ms: u64,
}

impl std::fmt::Debug for SecretRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretRecord")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

/// The store: one connection, used under a lock (every use is short).
#[derive(Debug)]
pub struct Store {
    conn: Mutex<Connection>,
}

/// Milliseconds since the epoch.
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Store {
    /// Opens (creating if needed) the database at `path`.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let open = |source| StoreError::Open {
            path: path.to_owned(),
            source,
        };
        let conn = Connection::open(path).map_err(open)?;
        // WAL: readers never wait for the writer; NORMAL sync is durable
        // across a daemon crash (not a power cut, which the VMMs do not
        // survive either).
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(open)?;
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(open)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))
            .map_err(open)?;
        conn.execute_batch(SCHEMA).map_err(open)?;
        Ok(Store {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds or replaces a template.
    pub fn put_template(&self, t: &TemplateRecord) -> Result<(), StoreError> {
        self.conn().execute(
            "INSERT OR REPLACE INTO templates (id, name, record) VALUES (?1, ?2, ?3)",
            params![t.id, t.name, serde_json::to_string(t)?],
        )?;
        Ok(())
    }

    /// Every template.
    pub fn templates(&self) -> Result<Vec<TemplateRecord>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare("SELECT record FROM templates ORDER BY name")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        let mut out = Vec::new();
        for row in rows {
            out.push(serde_json::from_str(&row?)?);
        }
        Ok(out)
    }

    /// The template with this id or name.
    pub fn template(&self, id_or_name: &str) -> Result<Option<TemplateRecord>, StoreError> {
        let record: Option<String> = self
            .conn()
            .query_row(
                "SELECT record FROM templates WHERE id = ?1 OR name = ?1",
                params![id_or_name],
                |r| r.get(0),
            )
            .optional()?;
        Ok(record.map(|r| serde_json::from_str(&r)).transpose()?)
    }

    /// Removes a template's record.
    pub fn remove_template(&self, id: &str) -> Result<(), StoreError> {
        let conn = self.conn();
        conn.execute("DELETE FROM pools WHERE template = ?1", params![id])?;
        conn.execute("DELETE FROM templates WHERE id = ?1", params![id])?;
        Ok(())
    }

    /// Adds or replaces a sandbox.
    pub fn put_sandbox(&self, s: &SandboxRecord) -> Result<(), StoreError> {
        self.conn().execute(
            "INSERT OR REPLACE INTO sandboxes (id, template, record) VALUES (?1, ?2, ?3)",
            params![s.id, s.template, serde_json::to_string(s)?],
        )?;
        Ok(())
    }

    /// Removes a sandbox's record.
    pub fn remove_sandbox(&self, id: &str) -> Result<(), StoreError> {
        self.conn()
            .execute("DELETE FROM sandboxes WHERE id = ?1", params![id])?;
        Ok(())
    }

    /// Every sandbox.
    pub fn sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare("SELECT record FROM sandboxes ORDER BY id")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        let mut out = Vec::new();
        for row in rows {
            out.push(serde_json::from_str(&row?)?);
        }
        Ok(out)
    }

    /// Adds a volume; false if one has that name already.
    pub fn add_volume(
        &self,
        id: &str,
        name: &str,
        created_unix_ms: u64,
    ) -> Result<bool, StoreError> {
        let added = self.conn().execute(
            "INSERT OR IGNORE INTO volumes (id, name, created_unix_ms) VALUES (?1, ?2, ?3)",
            params![id, name, created_unix_ms as i64],
        )?;
        Ok(added == 1)
    }

    /// Every volume: (id, name, created), by name.
    pub fn volumes(&self) -> Result<Vec<(String, String, u64)>, StoreError> {
        let conn = self.conn();
        let mut stmt =
            conn.prepare("SELECT id, name, created_unix_ms FROM volumes ORDER BY name")?;
        let rows = stmt.query_map([], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get::<_, i64>(2)? as u64))
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// The volume with this id or name: (id, name, created).
    pub fn volume(&self, id_or_name: &str) -> Result<Option<(String, String, u64)>, StoreError> {
        Ok(self
            .conn()
            .query_row(
                "SELECT id, name, created_unix_ms FROM volumes WHERE id = ?1 OR name = ?1",
                params![id_or_name],
                |r| Ok((r.get(0)?, r.get(1)?, r.get::<_, i64>(2)? as u64)),
            )
            .optional()?)
    }

    /// Removes a volume's record.
    pub fn remove_volume(&self, id: &str) -> Result<(), StoreError> {
        self.conn()
            .execute("DELETE FROM volumes WHERE id = ?1", params![id])?;
        Ok(())
    }

    /// Adds or replaces a secret (by id); false if another has its name.
    pub fn put_secret(&self, rec: &SecretRecord) -> Result<bool, StoreError> {
        let json = serde_json::to_string(rec)?;
        let changed = self.conn().execute(
            "INSERT INTO secrets (id, name, record) VALUES (?1, ?2, ?3)
             ON CONFLICT(id) DO UPDATE SET record = excluded.record
             ON CONFLICT(name) DO NOTHING",
            params![rec.id, rec.name, json],
        )?;
        Ok(changed == 1)
    }

    /// Every secret, by name.
    pub fn secrets(&self) -> Result<Vec<SecretRecord>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare("SELECT record FROM secrets ORDER BY name")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        let mut out = Vec::new();
        for row in rows {
            out.push(serde_json::from_str(&row?)?);
        }
        Ok(out)
    }

    /// The secret with this id or name.
    pub fn secret(&self, id_or_name: &str) -> Result<Option<SecretRecord>, StoreError> {
        let json: Option<String> = self
            .conn()
            .query_row(
                "SELECT record FROM secrets WHERE id = ?1 OR name = ?1",
                params![id_or_name],
                |r| r.get(0),
            )
            .optional()?;
        Ok(json.map(|j| serde_json::from_str(&j)).transpose()?)
    }

    /// Removes a secret's record.
    pub fn remove_secret(&self, id: &str) -> Result<(), StoreError> {
        self.conn()
            .execute("DELETE FROM secrets WHERE id = ?1", params![id])?;
        Ok(())
    }

    /// Sets a template's pool size (0 removes the pool).
    pub fn set_pool(&self, template: &str, target: u32) -> Result<(), StoreError> {
        let conn = self.conn();
        if target == 0 {
            conn.execute("DELETE FROM pools WHERE template = ?1", params![template])?;
        } else {
            conn.execute(
                "INSERT OR REPLACE INTO pools (template, target) VALUES (?1, ?2)",
                params![template, target],
            )?;
        }
        Ok(())
    }

    /// Every pool's size, by template id.
    pub fn pools(&self) -> Result<BTreeMap<String, u32>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare("SELECT template, target FROM pools")?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, u32>(1)?)))?;
        let mut out = BTreeMap::new();
        for row in rows {
            let (t, n) = row?;
            out.insert(t, n);
        }
        Ok(out)
    }

    /// Appends to the audit log.
    pub fn audit(
        &self,
        who: &str,
        action: &str,
        sandbox: Option<&str>,
        template: Option<&str>,
        detail: &str,
    ) -> Result<(), StoreError> {
        self.conn().execute(
            "INSERT INTO audit (unix_ms, who, action, sandbox, template, detail)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![now_unix_ms() as i64, who, action, sandbox, template, detail],
        )?;
        Ok(())
    }

    /// The audit log, oldest first, optionally for one sandbox, at most
    /// `limit` entries after `after`.
    pub fn audit_log(
        &self,
        sandbox: Option<&str>,
        after: i64,
        limit: u32,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT seq, unix_ms, who, action, sandbox, template, detail FROM audit
             WHERE seq > ?1 AND (?2 IS NULL OR sandbox = ?2) ORDER BY seq LIMIT ?3",
        )?;
        let rows = stmt.query_map(params![after, sandbox, limit], |r| {
            Ok(AuditEntry {
                seq: r.get(0)?,
                unix_ms: r.get::<_, i64>(1)? as u64,
                who: r.get(2)?,
                action: r.get(3)?,
                sandbox: r.get(4)?,
                template: r.get(5)?,
                detail: r.get(6)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}

/// A sandbox record for tests.
#[cfg(test)]
pub(crate) fn test_record(id: &str) -> SandboxRecord {
    SandboxRecord {
        id: id.to_owned(),
        template: "t1".to_owned(),
        state: SandboxState::Running,
        pid: 42,
        pid_start: 7,
        run_dir: PathBuf::from("/run/x"),
        mem_mib: 128,
        created_unix_ms: 1,
        expires_unix_ms: Some(5),
        on_expiry: ExpiryPolicy::Pause,
        labels: BTreeMap::from([("team".to_owned(), "a".to_owned())]),
        uid: 0,
        error: None,
        tap: None,
        mac: None,
        egress_allow: vec!["*.example.com:443".to_owned()],
        egress_secrets: Vec::new(),
        hibernation: None,
        hibernated_bytes: None,
        traffic_token: None,
        on_idle: None,
        pod_netns: None,
        media: BTreeMap::new(),
        mounts: vec![husk_types::MountSpec {
            host: "/srv/work".to_owned(),
            volume: None,
            guest: "/home/user/work".to_owned(),
            readonly: false,
            hide: vec![".env".to_owned()],
        }],
        mount_slots: vec![0],
        fs_slots_used: 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_store() -> (Store, PathBuf) {
        let dir = std::env::temp_dir().join(format!(
            "husk-store-{}-{}",
            std::process::id(),
            now_unix_ms() ^ rand_suffix()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        (Store::open(&dir.join("husk.db")).expect("open"), dir)
    }

    fn rand_suffix() -> u64 {
        use std::hash::{BuildHasher, RandomState};
        RandomState::new().hash_one(0u8)
    }

    fn sandbox(id: &str) -> SandboxRecord {
        test_record(id)
    }

    #[test]
    fn secrets_are_unique_by_name_and_updated_in_place() {
        let (store, dir) = temp_store();
        let secret = |id: &str, name: &str, value: &str| SecretRecord {
            id: id.into(),
            name: name.into(),
            value: value.into(),
            version: 1,
            metadata: BTreeMap::new(),
            created_unix_ms: 1,
            updated_unix_ms: 1,
        };
        assert!(store.put_secret(&secret("sec-1", "tok", "a")).expect("put"));
        let same_name = store.put_secret(&secret("sec-2", "tok", "b")).expect("put");
        let updated = store
            .put_secret(&SecretRecord {
                version: 2,
                ..secret("sec-1", "tok", "c")
            })
            .expect("update");
        drop(store);
        let store = Store::open(&dir.join("husk.db")).expect("reopen");

        assert!(!same_name, "a second secret of that name");
        assert!(updated);
        let kept = store.secret("tok").expect("get").expect("found");
        assert_eq!(
            (kept.id.as_str(), kept.value.as_str(), kept.version),
            ("sec-1", "c", 2)
        );
        assert_eq!(store.secret("sec-1").expect("get"), Some(kept));
        assert_eq!(store.secrets().expect("list").len(), 1);
        store.remove_secret("sec-1").expect("remove");
        assert_eq!(store.secret("tok").expect("get"), None);
        std::fs::remove_dir_all(dir).expect("clean up");
    }

    #[test]
    fn sandboxes_round_trip_and_survive_reopening() {
        let (store, dir) = temp_store();
        store.put_sandbox(&sandbox("sb-1")).expect("put");
        drop(store);

        let store = Store::open(&dir.join("husk.db")).expect("reopen");

        assert_eq!(store.sandboxes().expect("list"), vec![sandbox("sb-1")]);
        std::fs::remove_dir_all(dir).expect("cleanup");
    }

    #[test]
    fn the_audit_log_refuses_edits() {
        let (store, dir) = temp_store();
        store
            .audit("uid=0", "create", Some("sb-1"), None, "")
            .expect("append");

        let edit = store.conn().execute("UPDATE audit SET who = 'x'", []);
        let delete = store.conn().execute("DELETE FROM audit", []);

        assert!(edit.is_err() && delete.is_err());
        assert_eq!(store.audit_log(Some("sb-1"), 0, 10).expect("read").len(), 1);
        std::fs::remove_dir_all(dir).expect("cleanup");
    }

    #[test]
    fn a_volume_is_found_by_id_or_name_and_its_name_is_unique() {
        let (store, dir) = temp_store();

        let first = store.add_volume("vol-1", "cache", 5).expect("add");
        let same_name = store.add_volume("vol-2", "cache", 6).expect("add");
        let by_name = store.volume("cache").expect("get");
        let by_id = store.volume("vol-1").expect("get");
        store.remove_volume("vol-1").expect("remove");

        assert!(first && !same_name);
        assert_eq!(by_name, Some(("vol-1".into(), "cache".into(), 5)));
        assert_eq!(by_id, by_name);
        assert!(store.volumes().expect("list").is_empty());
        std::fs::remove_dir_all(dir).expect("cleanup");
    }

    #[test]
    fn a_template_is_found_by_id_or_name() {
        let (store, dir) = temp_store();
        let t = TemplateRecord {
            id: "tpl-1".to_owned(),
            name: "base".to_owned(),
            created_unix_ms: 1,
            snapshot_dir: PathBuf::from("/x"),
            vcpus: 1,
            mem_mib: 128,
            source: "default".to_owned(),
            checksums: BTreeMap::new(),
            build_ms: BTreeMap::new(),
            network: false,
            reads: Vec::new(),
            block_limit: Some("bytes=1048576".to_owned()),
            net_limit: None,
            image: None,
            drive_slots: 0,
            fs_slots: 2,
        };
        store.put_template(&t).expect("put");

        assert_eq!(store.template("base").expect("get"), Some(t.clone()));
        assert_eq!(store.template("tpl-1").expect("get"), Some(t));
        assert_eq!(store.template("nope").expect("get"), None);
        std::fs::remove_dir_all(dir).expect("cleanup");
    }
}
