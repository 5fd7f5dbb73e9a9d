//! Sandboxes: what a create asks for, what the API shows, what a change
//! sets, and a sandbox's way out (its egress policy).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A create request.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateRequest {
    /// Template id or name.
    pub template: String,
    /// Seconds to live; none: until destroyed.
    #[serde(default)]
    pub ttl_s: Option<u64>,
    #[serde(default)]
    /// What happens when the time to live runs out.
    pub on_expiry: ExpiryPolicy,
    #[serde(default)]
    /// Labels (`key=value`), to find it by.
    pub labels: BTreeMap<String, String>,
    /// What the sandbox may reach through its egress proxy; nothing when
    /// absent.
    #[serde(default)]
    pub egress: EgressSpec,
    /// Its ports answer only requests that carry its traffic token (the
    /// `e2b-traffic-access-token` header; E2B's `allow_public_traffic:
    /// false`); by default they are open to whoever reaches the front door.
    #[serde(default)]
    pub private_ports: bool,
    /// What happens when nobody has used it for a while.
    #[serde(default)]
    pub on_idle: Option<IdlePolicy>,
    /// Host directories it sees live (virtio-fs), each in one of its
    /// template's fs slots.
    #[serde(default)]
    pub mounts: Vec<MountSpec>,
}

/// A host directory a sandbox sees live, both ways: its writes reach the
/// host at once and the host's reach it. What the guest creates there
/// belongs on the host to the directory's owner (never root), whichever
/// guest user made it; the owner's files are the guest `user`'s (uid
/// 1000) inside.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MountSpec {
    /// The host directory: beneath one of the daemon's mount roots
    /// (`husk serve --mount-root DIR`). Empty for a volume's mount (the
    /// daemon shows its directory).
    #[serde(default)]
    pub host: String,
    /// Instead of `host`: a named volume's id or name (see
    /// [`crate::VolumeInfo`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<String>,
    /// Where the guest sees it (an absolute path, made if missing).
    pub guest: String,
    /// The guest may read, not write (EROFS).
    #[serde(default)]
    pub readonly: bool,
    /// What the guest must not see there (`.env`, `*.pem`, `.git/hooks`):
    /// a pattern without `/` matches a name at any depth, one with `/` a
    /// path from the directory; `*` and `?` match within a name. Hidden
    /// entries are absent to the guest.
    #[serde(default)]
    pub hide: Vec<String>,
}

impl MountSpec {
    /// `HOST_DIR:GUEST_DIR[:ro]`, as `husk run --mount` takes it.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let (rest, readonly) = match spec.strip_suffix(":ro") {
            Some(rest) => (rest, true),
            None => (spec.strip_suffix(":rw").unwrap_or(spec), false),
        };
        match rest.split_once(':') {
            Some((host, guest)) if !host.is_empty() && guest.starts_with('/') => Ok(MountSpec {
                host: host.to_owned(),
                guest: guest.to_owned(),
                volume: None,
                readonly,
                hide: Vec::new(),
            }),
            _ => Err(format!("`{spec}` is not HOST_DIR:GUEST_DIR[:ro]")),
        }
    }

    /// `VOLUME:GUEST_DIR[:ro]`, as `husk run --volume` takes it.
    pub fn parse_volume(spec: &str) -> Result<Self, String> {
        match Self::parse(spec) {
            Ok(m) if !m.host.contains('/') => Ok(MountSpec {
                host: String::new(),
                volume: Some(m.host),
                ..m
            }),
            _ => Err(format!("`{spec}` is not VOLUME:GUEST_DIR[:ro]")),
        }
    }
}

/// Joins a sandbox to a Kubernetes pod's network (`POST
/// /v1/sandboxes/{id}/network`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodNetworkRequest {
    /// The pod's network namespace (a CRI-made bind mount such as
    /// `/var/run/netns/cni-...`, beneath one of the daemon's
    /// `--pod-netns-dir`s), whose `eth0` its CNI plugins configured.
    pub netns: String,
}

/// What the guest's interface took from the pod's `eth0`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodNetworkInfo {
    /// Its MAC address.
    pub mac: String,
    /// Its MTU.
    pub mtu: u32,
    /// Its IPv4 address, `A.B.C.D/N`.
    pub address: String,
    /// Its routes besides its subnet's (`A.B.C.D/N [via A.B.C.D]`).
    pub routes: Vec<String>,
}

/// What happens to a running sandbox nobody uses: no request reached it
/// (exec, files, any agent call) and no connection to its ports was open
/// for `after_s` seconds. A request in flight (a long exec, a watch, a
/// port connection) keeps it in use; what runs inside it does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdlePolicy {
    /// Seconds without use.
    pub after_s: u64,
    /// Then this.
    pub action: IdleAction,
}

/// See [`IdlePolicy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IdleAction {
    /// Hibernate it (any use wakes it).
    Hibernate,
    /// Destroy it.
    Destroy,
}

/// A sandbox's way out (see `egress`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressSpec {
    /// Hosts it may connect to: `api.example.com`, `*.example.com`,
    /// `203.0.113.7:8080`, `*:443`; private, loopback and link-local
    /// addresses are refused whatever the list says.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Credentials the proxy adds to requests to the hosts they are bound
    /// to; never written into the guest. Shown with their values redacted.
    #[serde(default)]
    pub secrets: Vec<SecretSpec>,
}

/// A credential bound to hosts (see `egress::Secret`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretSpec {
    /// The hosts it is for, as one allowlist entry (`api.example.com`,
    /// `*.example.com:443`).
    pub host: String,
    /// The header it goes in, e.g. `Authorization`.
    pub header: String,
    /// The header's value (kept on the host; shown redacted).
    pub value: String,
}

/// A sandbox as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxInfo {
    /// Its id (`sb-...`).
    pub id: String,
    /// The id of the template it was restored from.
    pub template: String,
    /// Where it is in its life.
    pub state: SandboxState,
    /// Its VMM's pid on the host (the jailer's, when jailed).
    pub pid: u32,
    /// Its guest memory, in MiB.
    pub mem_mib: u32,
    /// When it was created, in ms since the epoch.
    pub created_unix_ms: u64,
    /// When its time to live runs out, in ms since the epoch.
    pub expires_unix_ms: Option<u64>,
    /// What happens then.
    pub on_expiry: ExpiryPolicy,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// Its TAP device and the guest's MAC address, if it has a network.
    #[serde(default)]
    pub tap: Option<String>,
    #[serde(default)]
    /// Its guest's MAC address, if it has a network.
    pub mac: Option<String>,
    /// What its egress proxy lets it reach.
    #[serde(default)]
    pub egress: EgressSpec,
    /// Its guest agent's socket on the daemon's host (for programs there
    /// that drive the agent themselves, such as the containerd shim; the
    /// socket is root's).
    #[serde(default)]
    pub agent_socket: Option<String>,
    /// While hibernated: the bytes its hibernation takes on disk.
    #[serde(default)]
    pub disk_bytes: Option<u64>,
    /// The token its ports want, when they are private.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traffic_token: Option<String>,
    /// What happens when nobody uses it for a while.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_idle: Option<IdlePolicy>,
    /// The host directories it sees (the host paths as resolved).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<MountSpec>,
}

/// What a create did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Created {
    /// The sandbox.
    pub sandbox: SandboxInfo,
    /// Whether a warm pool's clone was handed out.
    pub pooled: bool,
    /// From the request to a sandbox whose agent answered, in ms.
    pub create_ms: f64,
}

/// A pool as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PoolInfo {
    /// The template's id.
    pub template: String,
    /// The template's name.
    pub template_name: String,
    /// How many clones it keeps ready.
    pub target: u32,
    /// Clones parked and ready to hand out.
    pub ready: u32,
    /// Clones being restored for it.
    pub restoring: u32,
    /// Creates it served.
    pub hits: u64,
    /// Creates it could not serve (restored on demand).
    pub misses: u64,
}

/// A change to a sandbox (PATCH).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxUpdate {
    /// New time to live from now; 0 removes it.
    #[serde(default)]
    pub ttl_s: Option<u64>,
    #[serde(default)]
    /// A new policy for when the time to live runs out.
    pub on_expiry: Option<ExpiryPolicy>,
    /// Labels to set (an empty value removes the label).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// Where a sandbox is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SandboxState {
    /// Its VMM is restoring; not handed out yet.
    Starting,
    /// Restored, parked (paused) in its template's pool.
    Pooled,
    /// Handed out and running.
    Running,
    /// Its vCPUs stopped; its memory kept.
    Paused,
    /// Its VMM died; `error` says how. Destroy it to free its files.
    Failed,
    /// Its memory, vCPU and device state on disk, its VMM gone; any use
    /// wakes it.
    Hibernated,
}

impl SandboxState {
    /// Its name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            SandboxState::Starting => "starting",
            SandboxState::Pooled => "pooled",
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
            SandboxState::Failed => "failed",
            SandboxState::Hibernated => "hibernated",
        }
    }

    /// Every state.
    pub const ALL: [SandboxState; 6] = [
        SandboxState::Starting,
        SandboxState::Pooled,
        SandboxState::Running,
        SandboxState::Paused,
        SandboxState::Failed,
        SandboxState::Hibernated,
    ];
}

/// What happens to a sandbox whose time to live runs out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExpiryPolicy {
    #[default]
    /// Destroy it.
    Destroy,
    /// Pause it (its memory kept; resume brings it back).
    Pause,
    /// Hibernate it (its state written to disk, its memory freed; any use
    /// wakes it).
    Hibernate,
}

/// A snapshot of a running sandbox into a new template
/// (`POST /v1/sandboxes/{id}/snapshot`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    /// The new template's name.
    pub name: String,
}

/// A fork of a running sandbox (`POST /v1/sandboxes/{id}/fork`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// The template the fork makes (default `fork-<sandbox id>-<ms>`).
    #[serde(default)]
    pub name: Option<String>,
    /// How many sandboxes to make from it (default 1).
    #[serde(default = "one")]
    pub count: u32,
}

fn one() -> u32 {
    1
}

/// What a fork made.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Forked {
    /// The template the sandbox was snapshotted into.
    pub template: crate::TemplateRecord,
    /// The sandboxes made from it.
    pub sandboxes: Vec<Created>,
}

/// What `kill-all` did.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Killed {
    /// Tasks (processes and threads) killed.
    pub killed_tasks: u64,
}

/// A warm pool's target size (`PUT /v1/pools/{template}`).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSize {
    /// Parked clones to keep ready.
    pub size: u32,
}

/// A port inside a sandbox, as the front door publishes it
/// (`GET /v1/sandboxes/{id}/ports/{port}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortInfo {
    /// The sandbox's id.
    pub sandbox: String,
    /// The TCP port inside it.
    pub port: u16,
    /// Whether a guest program accepted a connection on it just now.
    pub listening: bool,
    /// Why not, when it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The host name that reaches it through the daemon's front door
    /// (`PORT-SANDBOXID.DOMAIN`); none without a front door.
    pub host: Option<String>,
    /// Its URL at the front door.
    pub url: Option<String>,
    /// Requests must carry the sandbox's traffic token (in the
    /// `e2b-traffic-access-token` header).
    pub private: bool,
}
