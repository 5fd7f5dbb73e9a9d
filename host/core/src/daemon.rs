//! The daemon's core, without HTTP: templates, sandboxes and warm pools,
//! their limits and their state in the store. `api` puts HTTP in front of
//! it; everything here is synchronous and safe to call from many threads.
//!
//! Each sandbox is its own `husk-vmm` process restored from its template's
//! snapshot. A warm pool keeps clones restored, answered and then paused
//! (a paused VMM uses no CPU), so a create from a pool is a resume and one
//! guest round trip that gives the clone its identity.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use husk_types::{
    CreateRequest, Created, EgressSpec, ExpiryPolicy, IdleAction, PoolInfo, SandboxInfo,
    SandboxState, SandboxUpdate, SecretSpec, TemplateRecord, TemplateSpec,
};

use crate::cgroup::{Cgroup, Limits, Priority};
pub use crate::config::{DaemonConfig, FrontDoorAddr, AGENT_TIMEOUT};
use crate::egress::{Allowlist, Decision, Egress, Proxy, Secret};
use crate::metrics::{Gauges, Metrics};
use crate::store::{now_unix_ms, SandboxRecord, Store, StoreError};
use crate::template::{self, TemplateError};
use crate::vmm_process::{self, Launch};
use husk_agent_client::readiness::WaitBudget;
use husk_agent_client::{AgentClient, ClientError, Gate};

mod guest;
mod hibernate;
mod media;
mod podnet;
mod ports;
mod processes;
mod reclaim;
mod secrets;
pub use processes::{ProcessInput, ProcessOutput, Reading};
mod shares;
mod volumes;
pub use ports::{PortStream, MAX_PORT_CONNS};
use shares::shares_of;

/// Egress decisions waiting for the audit log.
const EGRESS_AUDIT_QUEUE: usize = 4096;

/// Why a daemon request failed; `api` maps each kind to an HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("{0}")]
    /// No such sandbox, template or pool.
    NotFound(String),
    #[error("{0}")]
    /// The request is malformed or asks for what cannot be.
    Invalid(String),
    #[error("{0}")]
    /// The request conflicts with the state (a paused sandbox, a name in use).
    Conflict(String),
    /// The host is full (sandboxes or memory).
    #[error("{0}")]
    Limit(String),
    /// The daemon cannot do it now (shutting down, no kernel configured).
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    /// It was tried and failed.
    Failed(String),
    #[error("{0}")]
    /// Nothing answers where the request was to go (a sandbox's port).
    Unreachable(String),
    #[error(transparent)]
    /// A template build or check failed.
    Template(#[from] TemplateError),
    #[error(transparent)]
    /// The store failed.
    Store(#[from] StoreError),
    #[error("the sandbox's agent: {0}")]
    /// The sandbox's agent failed or refused.
    Agent(#[from] ClientError),
    #[error(transparent)]
    /// An upload failed.
    Upload(#[from] crate::upload::UploadError),
    #[error("I/O error: {0}")]
    /// A host file operation failed.
    Io(#[from] std::io::Error),
}

/// What the API shows of a secret's value.
const REDACTED: &str = "(redacted)";
/// Idle agent connections kept per sandbox (each holds a thread in the
/// guest's agent).
const MAX_IDLE_AGENTS: usize = 4;

/// Most allowlist entries per sandbox.
const MAX_EGRESS_RULES: usize = 256;

/// A live sandbox: its record, and its process when this daemon started it.
#[derive(Debug)]
struct Live {
    rec: SandboxRecord,
    child: Option<Child>,
    /// Its egress proxy, while it is handed out (not while pooled).
    proxy: Option<Proxy>,
    /// Agent connections between requests: the one kept from its pool
    /// days, and those front-ends gave back ([`Daemon::give_back`]).
    idle: Vec<AgentClient>,
    /// Set while its guest has something to do before the next request
    /// (see [`Gate`]): its clock set (it was woken from a pool or a pause,
    /// or adopted by this daemon), its create's shares mounted.
    gate: Option<Arc<Gate>>,
    /// Whether the monitor has made the request that carries its gate's
    /// shares (see [`Daemon::make_ready`]).
    readying: bool,
    /// Connections to its ports open now (see [`Daemon::connect_port`]).
    ports: Arc<std::sync::atomic::AtomicUsize>,
    /// When it was last used, and (its other holders) what uses it now.
    activity: Arc<Activity>,
    /// The last use after which its idle guest was asked to give memory
    /// back (see [`Daemon::reclaim_idle`]): once per idle period.
    reclaimed: Option<Instant>,
}

/// When a sandbox was last used; each [`InUse`] holding it is a request or
/// a port connection in flight.
#[derive(Debug)]
struct Activity {
    last: Mutex<Instant>,
}

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Activity {
            last: Mutex::new(Instant::now()),
        })
    }

    fn touch(&self) {
        *self.last.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    /// When its last use ended (or began, for one in flight).
    fn last(&self) -> Instant {
        *self.last.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How long nothing has used it (zero while something does).
    fn idle_for(self: &Arc<Self>) -> Duration {
        if Arc::strong_count(self) > 1 {
            return Duration::ZERO;
        }
        self.last
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed()
    }
}

/// A use of a sandbox in flight; its end counts as the last use.
#[derive(Debug)]
struct InUse(Arc<Activity>);

impl InUse {
    fn of(activity: &Arc<Activity>) -> Self {
        activity.touch();
        InUse(activity.clone())
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        self.0.touch();
    }
}

impl Live {
    /// One of its idle agent connections, if any is still open (one the
    /// guest closed, its agent restarted, is dropped).
    fn kept_connection(&mut self) -> Option<AgentClient> {
        std::iter::from_fn(|| self.idle.pop()).find(|c| !c.is_closed())
    }

    fn new(rec: SandboxRecord, child: Option<Child>) -> Self {
        Live {
            rec,
            child,
            proxy: None,
            idle: Vec::new(),
            gate: None,
            readying: false,
            ports: Arc::default(),
            activity: Activity::new(),
            reclaimed: None,
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    sandboxes: HashMap<String, Live>,
    /// Parked clones per template id, oldest first.
    parked: HashMap<String, VecDeque<String>>,
    /// A parked clone's agent connection, opened before it was paused: a
    /// claim then costs one guest round trip, not a new handshake with a
    /// guest that has just woken.
    parked_agents: HashMap<String, AgentClient>,
    /// Pool restores in flight per template id.
    restoring: HashMap<String, u32>,
    /// Pool hits and misses per template id.
    hits: HashMap<String, (u64, u64)>,
    /// Template names being built.
    building: Vec<String>,
    /// Room promised to creates whose restore has not registered its
    /// sandbox yet: (guest MiB, sandboxes).
    reserved: (u64, u32),
}

/// A counting semaphore for restore slots. A create (a client waiting)
/// goes before a pool refill (nobody waiting): a refill takes a free slot
/// only when no create waits for one.
#[derive(Debug)]
struct Slots {
    state: Mutex<SlotState>,
    freed: Condvar,
}

#[derive(Debug)]
struct SlotState {
    free: u32,
    creates_waiting: u32,
}

struct SlotGuard<'a>(&'a Slots);

impl Slots {
    fn new(n: u32) -> Self {
        Slots {
            state: Mutex::new(SlotState {
                free: n.max(1),
                creates_waiting: 0,
            }),
            freed: Condvar::new(),
        }
    }

    fn acquire(&self, priority: Priority) -> SlotGuard<'_> {
        let create = priority != Priority::Background;
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if create {
            s.creates_waiting += 1;
        }
        while s.free == 0 || (!create && s.creates_waiting > 0) {
            s = self.freed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.free -= 1;
        if create {
            s.creates_waiting -= 1;
        }
        SlotGuard(self)
    }
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        self.0.state.lock().unwrap_or_else(|e| e.into_inner()).free += 1;
        // Creates and refills wait on one condition: wake them all, each
        // checks whether it may go.
        self.0.freed.notify_all();
    }
}

/// The daemon.
#[derive(Debug)]
pub struct Daemon {
    cfg: DaemonConfig,
    store: Store,
    inner: Mutex<Inner>,
    /// Signalled when pools may need refilling (or the daemon stops).
    pool_wakeup: Condvar,
    slots: Slots,
    /// Its counters and histograms (rendered at /metrics).
    pub metrics: Metrics,
    stopping: AtomicBool,
    egress: Arc<Egress>,
    /// The background threads, joined by [`Daemon::stop`].
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// The sandboxes that are hibernating or waking (one change at a time
    /// each, many sandboxes at once); a hibernation's counted bytes (0
    /// until written), counted against the host's limits until its record
    /// says so.
    changing: Mutex<HashMap<String, Option<u64>>>,
    /// Signalled when a sandbox's change ends.
    changed: Condvar,
    /// Set while idle sandboxes are being asked for memory back (one
    /// worker at a time).
    reclaiming: AtomicBool,
}

/// Writes the egress proxy's decisions to the audit log until the daemon
/// stops or is gone.
fn audit_egress(daemon: &std::sync::Weak<Daemon>, decided: &std::sync::mpsc::Receiver<Decision>) {
    loop {
        let decision = match decided.recv_timeout(Duration::from_millis(250)) {
            Ok(d) => d,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => match daemon.upgrade() {
                Some(d) if !d.stopping.load(Ordering::SeqCst) => continue,
                _ => return,
            },
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
        };
        let Some(d) = daemon.upgrade() else { return };
        d.metrics.egress(decision.allowed);
        let action = if decision.allowed {
            "egress-allow"
        } else {
            "egress-deny"
        };
        let audited = d.store.audit(
            "proxy",
            action,
            Some(&decision.sandbox),
            None,
            &decision.detail,
        );
        if let Err(e) = audited {
            tracing::error!(sandbox = %decision.sandbox, "egress audit: {e}");
        }
    }
}

/// A new id: `prefix` and 12 hex digits from the kernel's randomness.
fn new_id(prefix: &str) -> String {
    crate::ids::random_id(prefix, 6).unwrap_or_else(|_| format!("{prefix}-000000000000"))
}

fn info(rec: &SandboxRecord) -> SandboxInfo {
    SandboxInfo {
        id: rec.id.clone(),
        template: rec.template.clone(),
        state: rec.state,
        pid: rec.pid,
        mem_mib: rec.mem_mib,
        created_unix_ms: rec.created_unix_ms,
        expires_unix_ms: rec.expires_unix_ms,
        on_expiry: rec.on_expiry,
        labels: rec.labels.clone(),
        error: rec.error.clone(),
        tap: rec.tap.clone(),
        mac: rec.mac.clone(),
        egress: EgressSpec {
            allow: rec.egress_allow.clone(),
            secrets: rec
                .egress_secrets
                .iter()
                .map(|s| SecretSpec {
                    value: REDACTED.to_owned(),
                    ..s.clone()
                })
                .collect(),
        },
        agent_socket: Some(rec.run_dir.join(vmm_process::VSOCK).display().to_string()),
        disk_bytes: rec.hibernated_bytes,
        traffic_token: rec.traffic_token.clone(),
        on_idle: rec.on_idle,
        mounts: rec.mounts.clone(),
    }
}

/// The gate of a guest whose clock stood still (paused, parked): it keeps
/// the shares `last` had not mounted yet.
fn clock_gate(last: Option<&Arc<Gate>>) -> Arc<Gate> {
    let shares = last
        .filter(|g| !g.is_set())
        .map(|g| g.shares().to_vec())
        .unwrap_or_default();
    Gate::new(true, shares)
}

/// Why a sandbox that neither runs nor hibernates cannot be used.
fn unusable(rec: &SandboxRecord) -> DaemonError {
    let id = &rec.id;
    DaemonError::Conflict(match rec.state {
        SandboxState::Paused => format!("sandbox `{id}` is paused: resume it first"),
        SandboxState::Failed => format!(
            "sandbox `{id}` has failed: {}",
            rec.error.as_deref().unwrap_or_default()
        ),
        _ => format!("sandbox `{id}` is not ready"),
    })
}

/// The credentials of a create request, checked.
fn secrets(spec: &EgressSpec) -> Result<Vec<Secret>, DaemonError> {
    if spec.secrets.len() > MAX_EGRESS_RULES {
        return Err(DaemonError::Invalid(format!(
            "`egress.secrets` has {} entries; at most {MAX_EGRESS_RULES}",
            spec.secrets.len()
        )));
    }
    spec.secrets
        .iter()
        .map(|s| {
            Secret::new(&s.host, &s.header, &s.value)
                .map_err(|e| DaemonError::Invalid(format!("`egress.secrets`: {e}")))
        })
        .collect()
}

/// The allowlist of a create request, checked.
fn allowlist(spec: &EgressSpec) -> Result<Allowlist, DaemonError> {
    if spec.allow.len() > MAX_EGRESS_RULES {
        return Err(DaemonError::Invalid(format!(
            "`egress.allow` has {} entries; at most {MAX_EGRESS_RULES}",
            spec.allow.len()
        )));
    }
    Allowlist::parse(&spec.allow).map_err(|e| DaemonError::Invalid(format!("`egress.allow`: {e}")))
}

/// A label key or value the API accepts.
fn check_labels(labels: &BTreeMap<String, String>) -> Result<(), DaemonError> {
    if labels.len() > 64 {
        return Err(DaemonError::Invalid("at most 64 labels".into()));
    }
    for (k, v) in labels {
        let ok = !k.is_empty()
            && k.len() <= 63
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-/".contains(&b))
            && v.len() <= 256;
        if !ok {
            return Err(DaemonError::Invalid(format!(
                "label `{k}`: keys are 1-63 characters of [A-Za-z0-9._-/], values at most 256 bytes"
            )));
        }
    }
    Ok(())
}

impl Daemon {
    /// Opens the state directory, finds the sandboxes a previous daemon
    /// left running (and marks failed those that vanished), and starts the
    /// background work: the monitor (VMM exits, time to live) and the pool
    /// manager.
    pub fn start(cfg: DaemonConfig) -> Result<Arc<Self>, DaemonError> {
        for sub in ["templates", "sandboxes"] {
            std::fs::create_dir_all(cfg.state_dir.join(sub))?;
        }
        let store = Store::open(&cfg.state_dir.join("husk.db"))?;
        let (decisions, decided) = std::sync::mpsc::sync_channel(EGRESS_AUDIT_QUEUE);
        // The CA that lets the proxy carry credentials into TLS: made once,
        // kept with the state (templates trust it).
        let tls = crate::egress::Tls {
            ca: crate::egress::intercept::Ca::load_or_create(
                &cfg.state_dir.join(crate::egress::intercept::CA_DIR),
            )?,
            upstream: crate::egress::intercept::upstream_config(cfg.egress_upstream_ca.as_deref())?,
        };
        // The named secrets credentials may name, from the store.
        let vault = crate::egress::Vault::default();
        for secret in store.secrets()? {
            vault.set(&secret.name, &secret.value);
        }
        let egress = Arc::new(Egress::new(
            cfg.egress_netns.as_deref(),
            decisions,
            Some(tls),
            vault,
        )?);
        let daemon = Arc::new(Daemon {
            slots: Slots::new(cfg.restore_parallel),
            cfg,
            store,
            inner: Mutex::new(Inner::default()),
            pool_wakeup: Condvar::new(),
            metrics: Metrics::default(),
            stopping: AtomicBool::new(false),
            egress,
            threads: Mutex::new(Vec::new()),
            changing: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            reclaiming: AtomicBool::new(false),
        });
        daemon.recover()?;
        // The audit thread holds no strong reference: the daemon is dropped
        // when its last user lets it go (the sender lives in `egress`).
        let weak = Arc::downgrade(&daemon);
        let audit = std::thread::Builder::new()
            .name("egress-audit".into())
            .spawn(move || audit_egress(&weak, &decided))?;
        let d = daemon.clone();
        let monitor = std::thread::Builder::new()
            .name("monitor".into())
            .spawn(move || d.monitor())?;
        let d = daemon.clone();
        let pools = std::thread::Builder::new()
            .name("pools".into())
            .spawn(move || d.manage_pools())?;
        daemon
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend([audit, monitor, pools]);
        Ok(daemon)
    }

    /// Stops background work and waits for it to end (restores in flight
    /// are abandoned and cleaned up). Running sandboxes are left running
    /// for the next host on this state directory, or destroyed with
    /// [`DaemonConfig::destroy_on_stop`]. Once its last `Arc` is dropped
    /// the host is gone (its store closed): a new one may start on the
    /// same state directory in the same process.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.pool_wakeup.notify_all();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        let me = std::thread::current().id();
        for t in threads {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
        if self.cfg.destroy_on_stop {
            for rec in self.store.sandboxes().unwrap_or_default() {
                let _ = self.audit("host", "destroy", &rec.id, "the host stopped");
                self.destroy_quietly(&rec.id);
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The store: records and the audit log.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The CA certificate (PEM) that sandboxes trust for the hosts their
    /// egress proxy opens TLS to.
    pub fn egress_ca(&self) -> Option<&str> {
        self.egress.ca_pem()
    }

    /// What it was started with.
    pub fn config(&self) -> &DaemonConfig {
        &self.cfg
    }

    /// Takes back the sandboxes in the store: those whose VMM still runs
    /// are live again (pooled ones go back to their pool); the others are
    /// failed, with why.
    fn recover(&self) -> Result<(), DaemonError> {
        let mut inner = self.lock();
        let mut handed_out = Vec::new();
        for mut rec in self.store.sandboxes()? {
            let alive = vmm_process::is_alive(rec.pid, rec.pid_start);
            match rec.state {
                // A restore the last daemon did not finish, or a failed
                // sandbox's process: nothing to keep.
                SandboxState::Starting => {
                    vmm_process::kill(rec.pid, rec.pid_start);
                    let _ = std::fs::remove_dir_all(&rec.run_dir);
                    self.store.remove_sandbox(&rec.id)?;
                    continue;
                }
                // Its files are checked when it wakes.
                SandboxState::Failed | SandboxState::Hibernated => {}
                _ if alive => {
                    tracing::info!(sandbox = %rec.id, pid = rec.pid, "found running");
                    if rec.state == SandboxState::Pooled {
                        inner
                            .parked
                            .entry(rec.template.clone())
                            .or_default()
                            .push_back(rec.id.clone());
                    }
                }
                _ => {
                    rec.state = SandboxState::Failed;
                    rec.error = Some(format!(
                        "its VMM (pid {}) was gone when the daemon started; last console lines:\n{}",
                        rec.pid,
                        vmm_process::tail(&rec.run_dir.join(vmm_process::CONSOLE), 10)
                    ));
                    tracing::warn!(sandbox = %rec.id, "VMM vanished while the daemon was down");
                    self.store.put_sandbox(&rec)?;
                    self.store
                        .audit("daemon", "failed", Some(&rec.id), None, "vanished")?;
                }
            }
            // Its uid stays taken until it is destroyed.
            if let (Some(j), true) = (&self.cfg.jail, rec.uid != 0) {
                j.uids.mark(rec.uid);
            }
            if alive && matches!(rec.state, SandboxState::Running | SandboxState::Paused) {
                handed_out.push(rec.clone());
            }
            // Whether its clock was set before the last daemon stopped is
            // not known, nor whether its guest mounted its shares: the
            // next request sets it again and mounts what is not mounted.
            let shares = shares_of(&rec);
            let mut live = Live::new(rec, None);
            live.gate = Some(Gate::new(true, shares));
            inner.sandboxes.insert(live.rec.id.clone(), live);
        }
        drop(inner);
        for rec in handed_out {
            if let Err(e) = self.start_proxy(&rec) {
                tracing::error!(sandbox = %rec.id, "its egress proxy did not start again: {e}");
            }
        }
        Ok(())
    }

    /// Starts the egress proxy of a sandbox that is handed out.
    fn start_proxy(&self, rec: &SandboxRecord) -> Result<(), DaemonError> {
        let allow = Allowlist::parse(&rec.egress_allow).map_err(DaemonError::Invalid)?;
        let secrets = secrets(&EgressSpec {
            allow: Vec::new(),
            secrets: rec.egress_secrets.clone(),
        })?;
        let vsock = rec.run_dir.join(vmm_process::VSOCK);
        let socket = PathBuf::from(format!(
            "{}_{}",
            vsock.display(),
            husk_protocol::EGRESS_VSOCK_PORT
        ));
        let proxy = self
            .egress
            .serve(&rec.id, allow, secrets, socket, rec.uid)?;
        if let Some(live) = self.lock().sandboxes.get_mut(&rec.id) {
            live.proxy = Some(proxy);
        }
        Ok(())
    }

    // ---- templates ----

    /// Builds a template: boots it, runs its warm-up commands, snapshots
    /// it. `progress` gets one line per phase.
    /// Refuses a spec that names host paths outside the template sources,
    /// and puts the real paths in it (see [`template::check_sources`]).
    pub fn check_template_sources(&self, spec: &mut TemplateSpec) -> Result<(), DaemonError> {
        Ok(template::check_sources(&self.cfg.template_sources, spec)?)
    }

    /// Receives an upload for a later template build.
    pub fn upload(
        &self,
        body: &mut dyn std::io::Read,
        who: &str,
    ) -> Result<husk_types::UploadInfo, DaemonError> {
        let up = crate::upload::receive(&self.cfg.state_dir, body, self.cfg.max_upload_bytes)?;
        self.store.audit(
            who,
            "template-upload",
            None,
            None,
            &format!("{} ({} bytes, sha256 {})", up.id, up.bytes, up.sha256),
        )?;
        Ok(up)
    }

    /// Builds a template: boots `spec`'s guest once, warms it up and snapshots it; `progress` hears
    /// each step; audited as `who`.
    pub fn build_template(
        &self,
        mut spec: TemplateSpec,
        who: &str,
        progress: &mut dyn FnMut(&str),
    ) -> Result<TemplateRecord, DaemonError> {
        self.check_template_sources(&mut spec)?;
        let name = spec.name.clone();
        self.reserve_name(&name)?;
        let result = template::build(&self.cfg, &new_id("tpl"), spec, progress);
        self.lock().building.retain(|n| *n != name);
        let record = result?;
        self.store.put_template(&record)?;
        self.store
            .audit(who, "template-build", None, Some(&record.id), &record.name)?;
        Ok(record)
    }

    /// Holds a new template's name while it is made (release it by
    /// removing it from `building`); refused if a template has it.
    fn reserve_name(&self, name: &str) -> Result<(), DaemonError> {
        template::check_name(name)?;
        let mut inner = self.lock();
        if self.store.template(name)?.is_some() || inner.building.iter().any(|n| n == name) {
            return Err(DaemonError::Conflict(format!(
                "a template named `{name}` exists: remove it or pick another name"
            )));
        }
        inner.building.push(name.to_owned());
        Ok(())
    }

    /// Every template.
    pub fn templates(&self) -> Result<Vec<TemplateRecord>, DaemonError> {
        Ok(self.store.templates()?)
    }

    /// A template by id or name.
    pub fn template(&self, id_or_name: &str) -> Result<TemplateRecord, DaemonError> {
        self.store.template(id_or_name)?.ok_or_else(|| {
            DaemonError::NotFound(format!(
                "no template `{id_or_name}` (see GET /v1/templates)"
            ))
        })
    }

    /// Removes a template no sandbox or pool uses.
    pub fn remove_template(&self, id_or_name: &str, who: &str) -> Result<(), DaemonError> {
        let t = self.template(id_or_name)?;
        {
            let inner = self.lock();
            let users: Vec<&str> = inner
                .sandboxes
                .values()
                .filter(|l| l.rec.template == t.id && l.rec.state != SandboxState::Pooled)
                .map(|l| l.rec.id.as_str())
                .collect();
            if !users.is_empty() {
                return Err(DaemonError::Conflict(format!(
                    "template `{}` is used by sandboxes {}: destroy them first",
                    t.name,
                    users.join(", ")
                )));
            }
            if self.store.pools()?.contains_key(&t.id) {
                return Err(DaemonError::Conflict(format!(
                    "template `{}` has a warm pool: set its size to 0 first",
                    t.name
                )));
            }
            if inner.restoring.get(&t.id).copied().unwrap_or(0) > 0 {
                return Err(DaemonError::Conflict(format!(
                    "template `{}`'s pool is still restoring clones: try again shortly",
                    t.name
                )));
            }
        }
        // Parked clones of a pool set to 0 go with it.
        let parked: Vec<String> = self.lock().parked.remove(&t.id).unwrap_or_default().into();
        for id in parked {
            self.destroy_quietly(&id);
        }
        self.store.remove_template(&t.id)?;
        let dir = t.snapshot_dir.parent().unwrap_or(&t.snapshot_dir);
        std::fs::remove_dir_all(dir)?;
        self.store
            .audit(who, "template-remove", None, Some(&t.id), &t.name)?;
        Ok(())
    }

    /// Checks a template's files against their checksums.
    pub fn verify_template(&self, id_or_name: &str) -> Result<Vec<String>, DaemonError> {
        let t = self.template(id_or_name)?;
        Ok(template::verify(&t)?)
    }

    // ---- sandboxes ----

    /// Creates a sandbox: a pool's clone if one is ready, else a restore.
    pub fn create(&self, req: CreateRequest, who: &str) -> Result<Created, DaemonError> {
        let started = Instant::now();
        check_labels(&req.labels)?;
        if self.stopping.load(Ordering::SeqCst) {
            return Err(DaemonError::Unavailable("the daemon is stopping".into()));
        }
        allowlist(&req.egress)?;
        secrets(&req.egress)?;
        if req.on_idle.is_some_and(|p| p.after_s == 0) {
            return Err(DaemonError::Invalid(
                "on_idle.after_s must be at least 1".into(),
            ));
        }
        // Before a clone is taken: nothing below may fail and leave it.
        let traffic_token = match req.private_ports {
            true => Some(crate::ids::random_id("tt", 24)?),
            false => None,
        };
        let t = self.template(&req.template)?;
        let mounts = self.check_mounts(&t, &req.mounts)?;
        if !mounts.is_empty()
            && req
                .on_idle
                .is_some_and(|p| p.action == IdleAction::Hibernate)
        {
            return Err(DaemonError::Invalid(
                "a sandbox with mounts does not hibernate (a live share is not saved): \
                 give on_idle the action destroy"
                    .into(),
            ));
        }
        let expires = req.ttl_s.map(|s| now_unix_ms() + s * 1000);
        let (mut rec, pooled) = match self.claim(&t)? {
            Some(rec) => (rec, true),
            None => {
                let room = self.make_room(&t)?;
                let _slot = self.slots.acquire(Priority::Normal);
                let restored = self.restore(&t, Priority::Normal, Some(room))?;
                (restored.0, false)
            }
        };
        // The host serves the mounts now; the guest mounts them ahead of
        // the first request that reaches it (its gate, set with the state
        // under one lock: no request comes before it).
        let (shares, mounts_ms) = match self.serve_mounts(&rec, &mounts) {
            Ok(served) => served,
            Err(e) => {
                self.destroy_quietly(&rec.id);
                return Err(e);
            }
        };
        rec.expires_unix_ms = expires;
        rec.on_expiry = req.on_expiry;
        rec.labels = req.labels;
        rec.egress_allow = req.egress.allow;
        rec.egress_secrets = req.egress.secrets;
        rec.traffic_token = traffic_token;
        rec.on_idle = req.on_idle;
        rec.mounts = mounts.iter().map(|m| m.spec.clone()).collect();
        rec.mount_slots = (0..mounts.len() as u8).collect();
        rec.fs_slots_used = mounts.len() as u8;
        rec.state = SandboxState::Running;
        self.store.put_sandbox(&rec)?;
        if let Some(live) = self.lock().sandboxes.get_mut(&rec.id) {
            live.rec = rec.clone();
            // Idle from now, not from when it was parked.
            live.activity.touch();
            if !shares.is_empty() {
                let clock = live.gate.as_ref().is_some_and(|g| !g.is_set());
                live.gate = Some(Gate::new(clock, shares));
            }
        }
        if let Err(e) = self.start_proxy(&rec) {
            self.destroy_quietly(&rec.id);
            return Err(e);
        }
        self.pool_wakeup.notify_all();
        let create_ms = started.elapsed().as_secs_f64() * 1000.0;
        self.metrics.observe_create(pooled, create_ms / 1000.0);
        self.store.audit(
            who,
            "create",
            Some(&rec.id),
            Some(&t.id),
            &format!("pooled={pooled} create_ms={create_ms:.1}{mounts_ms}"),
        )?;
        tracing::info!(sandbox = %rec.id, template = %t.name, pooled, create_ms, "created");
        Ok(Created {
            sandbox: info(&rec),
            pooled,
            create_ms,
        })
    }

    /// Hands out a parked clone of `t`, if there is one that wakes up.
    fn claim(&self, t: &TemplateRecord) -> Result<Option<SandboxRecord>, DaemonError> {
        loop {
            let (id, rec) = {
                let mut inner = self.lock();
                let Some(id) = inner.parked.get_mut(&t.id).and_then(|q| q.pop_front()) else {
                    inner.hits.entry(t.id.clone()).or_default().1 += 1;
                    self.metrics.pool_miss();
                    return Ok(None);
                };
                let Some(live) = inner.sandboxes.get_mut(&id) else {
                    continue;
                };
                // Claimed: no longer the pool's (nor the monitor's to reap
                // as a pool clone).
                live.rec.state = SandboxState::Starting;
                let rec = live.rec.clone();
                let agent = inner.parked_agents.remove(&id);
                (id.clone(), (rec, agent))
            };
            let (rec, agent) = rec;
            match self.wake_parked(&rec, agent) {
                Ok(()) => {
                    self.lock().hits.entry(t.id.clone()).or_default().0 += 1;
                    self.metrics.pool_hit();
                    return Ok(Some(rec));
                }
                Err(e) => {
                    tracing::warn!(sandbox = %id, "a parked clone did not wake: {e}; destroying it");
                    self.destroy_quietly(&id);
                }
            }
        }
    }

    /// Resumes a parked clone: host work only. Its hostname and randomness
    /// are its own since the refill; its clock, which stood still while it
    /// was parked, is set by the first request that reaches it (see
    /// [`Gate`]), on the agent connection kept from the refill when
    /// that is still open.
    fn wake_parked(
        &self,
        rec: &SandboxRecord,
        agent: Option<AgentClient>,
    ) -> Result<(), DaemonError> {
        let t0 = Instant::now();
        if let Some(h) = &self.cfg.cgroups {
            if let Err(e) = Cgroup::existing(h, &rec.id).set_priority(Priority::Normal) {
                tracing::warn!(sandbox = %rec.id, "{e}");
            }
        }
        control(&rec.run_dir, &husk_vmm_api::Request::Resume)?;
        if let Some(live) = self.lock().sandboxes.get_mut(&rec.id) {
            live.idle.extend(agent);
            live.gate = Some(Gate::clock());
        }
        tracing::debug!(
            sandbox = %rec.id,
            resume_ms = t0.elapsed().as_secs_f64() * 1000.0,
            "woke a pool clone"
        );
        Ok(())
    }

    /// Guest memory of all live sandboxes, and how many there are.
    fn usage(inner: &Inner) -> (u64, u32) {
        let live = inner
            .sandboxes
            .values()
            .filter(|l| !matches!(l.rec.state, SandboxState::Failed | SandboxState::Hibernated));
        live.fold(inner.reserved, |(m, n), l| {
            (m + u64::from(l.rec.mem_mib), n + 1)
        })
    }

    /// Makes room for one more sandbox of `t`: parked clones go first
    /// (oldest first); refused if that is not enough. The room is held
    /// for the caller until the guard drops (concurrent creates cannot
    /// both take the last room).
    fn make_room(&self, t: &TemplateRecord) -> Result<Reservation<'_>, DaemonError> {
        loop {
            let victim = {
                let mut inner = self.lock();
                let (mem, count) = Self::usage(&inner);
                let fits = count < self.cfg.max_sandboxes
                    && mem + u64::from(t.mem_mib) <= self.cfg.memory_mib;
                if fits {
                    inner.reserved.0 += u64::from(t.mem_mib);
                    inner.reserved.1 += 1;
                    return Ok(Reservation {
                        daemon: self,
                        mem_mib: u64::from(t.mem_mib),
                    });
                }
                let victim = inner.parked.values_mut().find_map(|q| q.pop_front());
                match victim {
                    Some(v) => v,
                    None if count >= self.cfg.max_sandboxes => {
                        return Err(DaemonError::Limit(format!(
                            "the host has its maximum of {} sandboxes: destroy some first",
                            self.cfg.max_sandboxes
                        )))
                    }
                    None => {
                        return Err(DaemonError::Limit(format!(
                            "the host's sandbox memory ({} MiB) is taken: {mem} MiB in use, \
                             {} MiB asked: destroy sandboxes first",
                            self.cfg.memory_mib, t.mem_mib
                        )))
                    }
                }
            };
            tracing::info!(sandbox = %victim, "pool clone evicted to make room");
            self.destroy_quietly(&victim);
        }
    }

    /// Restores a new clone of `t`, waits for its agent and gives it its
    /// identity: hostname (its id), clock and fresh randomness, so that no
    /// two clones share random state (a pool clone's clock is set again
    /// when it is claimed). It is returned `starting` (the caller gives it
    /// its state); a pool's clone restores at background CPU priority. On
    /// failure nothing is left.
    fn restore(
        &self,
        t: &TemplateRecord,
        priority: Priority,
        room: Option<Reservation<'_>>,
    ) -> Result<(SandboxRecord, AgentClient), DaemonError> {
        let started = Instant::now();
        let id = new_id("sb");
        let run_dir = self.cfg.state_dir.join("sandboxes").join(&id);
        std::fs::create_dir_all(&run_dir)?;
        let launch = Launch::Restore {
            snapshot: t.snapshot_dir.clone(),
            verify: false,
        };
        let cgroup = match &self.cfg.cgroups {
            Some(h) => match Cgroup::create(h, &id, Limits::for_vm(t.vcpus, t.mem_mib)) {
                Ok(cg) => {
                    // A pool clone yields the CPU to sandboxes in use
                    // until it is claimed.
                    if priority == Priority::Background {
                        if let Err(e) = cg.set_priority(priority) {
                            tracing::warn!(sandbox = %id, "{e}");
                        }
                    }
                    Some(cg)
                }
                Err(e) => {
                    Cgroup::existing(h, &id).remove();
                    let _ = std::fs::remove_dir_all(&run_dir);
                    return Err(DaemonError::Failed(e.to_string()));
                }
            },
            None => None,
        };
        let nic = if t.network {
            Some(vmm_process::Nic::for_vm("hk", &id)?)
        } else {
            None
        };
        let jailing = match &self.cfg.jail {
            Some(j) => match j.uids.take() {
                Some(uid) => Some(vmm_process::Jailing {
                    jailer: j.jailer.clone(),
                    uid,
                    reads: t.reads.clone(),
                }),
                None => {
                    let _ = std::fs::remove_dir_all(&run_dir);
                    if let Some(cg) = cgroup {
                        cg.remove();
                    }
                    return Err(DaemonError::Limit("no free jail uid".into()));
                }
            },
            None => None,
        };
        let uid = jailing.as_ref().map_or(0, |j| j.uid);
        let spawned = vmm_process::spawn(&vmm_process::VmSpawn {
            vmm: &self.cfg.vmm,
            id: &id,
            run_dir: &run_dir,
            launch: &launch,
            cgroup: cgroup.as_ref(),
            nic: nic.as_ref(),
            jail: jailing.as_ref(),
            limits: (t.block_limit.as_deref(), t.net_limit.as_deref()),
        });
        let child = match spawned {
            Ok(child) => child,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&run_dir);
                if let Some(cg) = cgroup {
                    cg.remove();
                }
                self.give_uid(uid);
                return Err(DaemonError::Failed(format!(
                    "cannot start {}: {e}",
                    self.cfg.vmm.display()
                )));
            }
        };
        let pid = child.id();
        let rec = SandboxRecord {
            id: id.clone(),
            template: t.id.clone(),
            state: SandboxState::Starting,
            pid,
            pid_start: vmm_process::start_time(pid).unwrap_or(0),
            run_dir: run_dir.clone(),
            mem_mib: t.mem_mib,
            created_unix_ms: now_unix_ms(),
            expires_unix_ms: None,
            on_expiry: ExpiryPolicy::Destroy,
            labels: BTreeMap::new(),
            error: None,
            tap: nic.as_ref().map(|n| n.tap.clone()),
            mac: nic.as_ref().map(vmm_process::Nic::mac_text),
            uid,
            egress_allow: Vec::new(),
            egress_secrets: Vec::new(),
            hibernation: None,
            hibernated_bytes: None,
            traffic_token: None,
            on_idle: None,
            pod_netns: None,
            media: BTreeMap::new(),
            mounts: Vec::new(),
            fs_slots_used: 0,
            mount_slots: Vec::new(),
        };
        // In the store before it can answer: a daemon killed now finds it
        // and cleans it up.
        self.store.put_sandbox(&rec)?;
        self.lock()
            .sandboxes
            .insert(id.clone(), Live::new(rec.clone(), Some(child)));
        // The sandbox now counts itself.
        drop(room);
        let result = self.bring_up(&rec, nic.map(|n| n.mac));
        match result {
            Ok(client) => {
                self.metrics
                    .observe_restore(started.elapsed().as_secs_f64());
                Ok((rec, client))
            }
            Err(e) => {
                let report = format!(
                    "{e}\n{}",
                    vmm_process::last_words(
                        &run_dir.join(vmm_process::LOG),
                        &run_dir.join(vmm_process::CONSOLE),
                        10
                    )
                );
                self.destroy_quietly(&id);
                Err(DaemonError::Failed(format!(
                    "the restore of template `{}` failed: {report}",
                    t.name
                )))
            }
        }
    }

    /// Waits for a restored clone's agent (its VMM exiting ends the wait).
    fn bring_up(
        &self,
        rec: &SandboxRecord,
        mac: Option<[u8; 6]>,
    ) -> Result<AgentClient, DaemonError> {
        let mut wait = WaitBudget::new(self.cfg.restore_wait);
        let mut alive = || {
            if self.stopping.load(Ordering::SeqCst) {
                return Err(ClientError::VmmGone("the daemon is stopping".into()));
            }
            let mut inner = self.lock();
            let Some(live) = inner.sandboxes.get_mut(&rec.id) else {
                return Err(ClientError::VmmGone("the sandbox was destroyed".into()));
            };
            match live.child.as_mut().map(|c| c.try_wait()) {
                Some(Ok(Some(status))) => {
                    Err(ClientError::VmmGone(format!("husk-vmm exited ({status})")))
                }
                _ => Ok(()),
            }
        };
        let vsock = rec.run_dir.join(vmm_process::VSOCK);
        let mut client =
            AgentClient::connect_patiently(&vsock, &mut wait, &mut alive, AGENT_TIMEOUT).map_err(
                |e| match e {
                    ClientError::VmmGone(_) => DaemonError::Failed(e.to_string()),
                    _ => DaemonError::Failed(format!(
                    "the agent did not answer in {:.0} s (a budget of {} s on a quiet host): {e}",
                    wait.elapsed().as_secs_f64(),
                    wait.budget().as_secs()
                )),
                },
            )?;
        client.restored(&rec.id, mac)?;
        Ok(client)
    }

    /// A live sandbox's record.
    pub fn sandbox(&self, id: &str) -> Result<SandboxInfo, DaemonError> {
        self.record(id).map(|r| info(&r))
    }

    fn record(&self, id: &str) -> Result<SandboxRecord, DaemonError> {
        let inner = self.lock();
        match inner.sandboxes.get(id) {
            Some(live) if live.rec.state != SandboxState::Pooled => Ok(live.rec.clone()),
            _ => Err(DaemonError::NotFound(format!(
                "no sandbox `{id}` (it may have been destroyed; see GET /v1/sandboxes)"
            ))),
        }
    }

    /// Which of `ids` name no sandbox (any more): one look under one lock,
    /// for front-ends that keep state per sandbox.
    pub fn missing(&self, ids: impl IntoIterator<Item = String>) -> HashSet<String> {
        let inner = self.lock();
        ids.into_iter()
            .filter(|id| {
                !inner
                    .sandboxes
                    .get(id)
                    .is_some_and(|live| live.rec.state != SandboxState::Pooled)
            })
            .collect()
    }

    /// Sandboxes (not pool clones) whose labels include all of `labels`,
    /// in `state` if given.
    pub fn list(
        &self,
        labels: &BTreeMap<String, String>,
        state: Option<SandboxState>,
    ) -> Vec<SandboxInfo> {
        let inner = self.lock();
        let mut out: Vec<SandboxInfo> = inner
            .sandboxes
            .values()
            .map(|l| &l.rec)
            .filter(|r| !matches!(r.state, SandboxState::Pooled | SandboxState::Starting))
            .filter(|r| state.is_none_or(|s| r.state == s))
            .filter(|r| labels.iter().all(|(k, v)| r.labels.get(k) == Some(v)))
            .map(info)
            .collect();
        out.sort_by_key(|s| s.created_unix_ms);
        out
    }

    /// A connection to a running sandbox's agent. The first after a wake
    /// carries the guest's clock ahead of its request, and the first after
    /// a create its shares' mounts (see [`Gate`]); a sandbox whose clock
    /// could not be set or whose shares could not be mounted is marked
    /// failed, never used.
    pub fn agent(&self, id: &str) -> Result<AgentClient, DaemonError> {
        let (rec, kept, gate, lease) = {
            let mut inner = self.lock();
            let live = inner
                .sandboxes
                .get_mut(id)
                .ok_or_else(|| DaemonError::NotFound(format!("no sandbox `{id}`")))?;
            let kept = match live.rec.state {
                SandboxState::Running => live.kept_connection(),
                _ => None,
            };
            (
                live.rec.clone(),
                kept,
                live.gate.clone(),
                // In use from here on, while the caller holds the client.
                Arc::new(InUse::of(&live.activity)),
            )
        };
        // A hibernation or wake in progress ends first. An idle
        // hibernation checks for uses once the sandbox is paused: one that
        // checked before this use began goes on and would cut this
        // connection, so this waits for it (and wakes the sandbox after);
        // one that checks later sees this use and leaves the sandbox be.
        if self.changing(id) {
            drop((kept, lease));
            self.wait_for_change(id);
            return self.agent(id);
        }
        match rec.state {
            SandboxState::Running => {}
            // Any use wakes it (one lock on the way for a running one).
            SandboxState::Hibernated => {
                self.wake_if_hibernated(id, "daemon (on use)")?;
                return self.agent(id);
            }
            _ => return Err(unusable(&rec)),
        }
        let mut client = match kept {
            Some(client) => client,
            None => {
                match AgentClient::connect(&rec.run_dir.join(vmm_process::VSOCK), AGENT_TIMEOUT) {
                    Ok(client) => client,
                    // Hibernated while this connected (its idle policy): wake it.
                    Err(_) if self.state_of(id) == Some(SandboxState::Hibernated) => {
                        return self.agent(id)
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        };
        // In use while the caller holds it (see `on_idle`).
        client.set_lease(Some(lease));
        if let Some(gate) = gate {
            if let Err(e) = client.carry(gate) {
                self.fail(id, &e.to_string());
                return Err(DaemonError::Conflict(format!(
                    "sandbox `{id}` has failed: {e}"
                )));
            }
        }
        Ok(client)
    }

    /// Where sandbox `id` is in its life now, if it exists.
    fn state_of(&self, id: &str) -> Option<SandboxState> {
        self.lock().sandboxes.get(id).map(|l| l.rec.state)
    }

    /// Runs `op` for `who` on a connection to sandbox `id`'s agent (an
    /// idle one, or a new one), audited as [`Daemon::agent_for`] does; the
    /// connection is given back after unless the call failed (the guest's
    /// own refusal, such as no such file, leaves it usable).
    pub fn with_agent<T>(
        &self,
        id: &str,
        who: &str,
        (action, detail): (&str, &str),
        op: impl FnOnce(&mut AgentClient) -> Result<T, ClientError>,
    ) -> Result<T, DaemonError> {
        let mut client = self.agent_for(id, who, action, detail)?;
        let result = op(&mut client);
        if result
            .as_ref()
            .map_or_else(|e| e.kind().is_some(), |_| true)
        {
            self.give_back(id, client);
        }
        Ok(result?)
    }

    /// Gives back a connection [`Daemon::agent`] handed out, for the next
    /// request to sandbox `id` to use instead of connecting anew. Only a
    /// connection between requests (the last one answered whole) may come
    /// back; one that failed or was cut mid-answer is dropped instead.
    pub fn give_back(&self, id: &str, mut client: AgentClient) {
        // As a new connection would be (a caller may have changed it).
        if client.set_read_timeout(Some(AGENT_TIMEOUT)).is_err() {
            return;
        }
        // Kept, it is no use of the sandbox.
        client.set_lease(None);
        let mut inner = self.lock();
        if let Some(live) = inner.sandboxes.get_mut(id) {
            if live.rec.state == SandboxState::Running && live.idle.len() < MAX_IDLE_AGENTS {
                live.idle.push(client);
            }
        }
    }

    /// Marks a handed-out sandbox failed with `why` (its VMM is left to
    /// the caller's destroy).
    fn fail(&self, id: &str, why: &str) {
        tracing::warn!(sandbox = %id, "sandbox failed: {why}");
        self.mark_failed(id, why, why);
    }

    /// Records sandbox `id` as failed with `error`, in memory and in the
    /// store, and audits it with `detail`.
    fn mark_failed(&self, id: &str, error: &str, detail: &str) {
        let rec = {
            let mut inner = self.lock();
            let Some(live) = inner.sandboxes.get_mut(id) else {
                return;
            };
            live.rec.state = SandboxState::Failed;
            live.rec.error = Some(error.to_owned());
            live.rec.clone()
        };
        let _ = self.store.put_sandbox(&rec);
        let _ = self.store.audit("daemon", "failed", Some(id), None, detail);
    }

    /// A connection to a running sandbox's agent for one operation of
    /// `who`'s, audited (`action`, `detail`) as it is made: how front-ends
    /// reach a guest for a caller, so that every front-end's operations
    /// are in the audit log alike.
    pub fn agent_for(
        &self,
        id: &str,
        who: &str,
        action: &str,
        detail: &str,
    ) -> Result<AgentClient, DaemonError> {
        let client = self.agent(id)?;
        self.audit(who, action, id, detail)?;
        Ok(client)
    }

    /// Records in the audit log that `who` did `action` to sandbox `id`
    /// (for an operation on a connection a front-end already holds).
    pub fn audit(
        &self,
        who: &str,
        action: &str,
        id: &str,
        detail: &str,
    ) -> Result<(), DaemonError> {
        Ok(self.store.audit(who, action, Some(id), None, detail)?)
    }

    /// Where a sandbox's console is.
    pub fn console_path(&self, id: &str) -> Result<PathBuf, DaemonError> {
        Ok(self.record(id)?.run_dir.join(vmm_process::CONSOLE))
    }

    fn set_state(&self, id: &str, from: SandboxState, to: SandboxState) -> Result<(), DaemonError> {
        let rec = {
            let mut inner = self.lock();
            let Some(live) = inner.sandboxes.get_mut(id) else {
                return Err(DaemonError::NotFound(format!("no sandbox `{id}`")));
            };
            if live.rec.state != from {
                return Err(DaemonError::Conflict(format!(
                    "sandbox `{id}` is {}, not {}",
                    live.rec.state.name(),
                    from.name()
                )));
            }
            live.rec.state = to;
            if to == SandboxState::Running {
                // Resumed: a fresh idle period.
                live.activity.touch();
            }
            live.rec.clone()
        };
        self.store.put_sandbox(&rec)?;
        Ok(())
    }

    /// A sandbox's record if it is in `state`; else a conflict that says
    /// "only {what}".
    fn in_state(
        &self,
        id: &str,
        state: SandboxState,
        what: &str,
    ) -> Result<SandboxRecord, DaemonError> {
        let rec = self.record(id)?;
        if rec.state != state {
            return Err(DaemonError::Conflict(format!(
                "sandbox `{id}` is {}: only {what}",
                rec.state.name()
            )));
        }
        Ok(rec)
    }

    /// Stops a sandbox's vCPUs; it keeps its memory.
    pub fn pause(&self, id: &str, who: &str) -> Result<SandboxInfo, DaemonError> {
        let rec = self.in_state(id, SandboxState::Running, "a running sandbox pauses")?;
        control(&rec.run_dir, &husk_vmm_api::Request::Pause)?;
        self.set_state(id, SandboxState::Running, SandboxState::Paused)?;
        self.store.audit(who, "pause", Some(id), None, "")?;
        self.sandbox(id)
    }

    /// Lets a paused sandbox run again, with its clock set to now.
    pub fn resume(&self, id: &str, who: &str) -> Result<SandboxInfo, DaemonError> {
        if self.record(id)?.state == SandboxState::Hibernated {
            return self.wake(id, who);
        }
        let rec = self.in_state(id, SandboxState::Paused, "a paused sandbox resumes")?;
        control(&rec.run_dir, &husk_vmm_api::Request::Resume)?;
        // Its clock stood still while it was paused: the next request sets
        // it before it runs.
        if let Some(live) = self.lock().sandboxes.get_mut(&rec.id) {
            live.gate = Some(clock_gate(live.gate.as_ref()));
        }
        self.set_state(id, SandboxState::Paused, SandboxState::Running)?;
        self.store.audit(who, "resume", Some(id), None, "")?;
        self.sandbox(id)
    }

    /// Kills everything the sandbox's user started inside the guest and
    /// hands back a responsive sandbox: the guest, its agent, its files
    /// and its network stay. Returns how many tasks were killed.
    pub fn kill_all(&self, id: &str, who: &str) -> Result<u64, DaemonError> {
        let tasks = self.agent(id)?.kill_all()?;
        self.store
            .audit(who, "kill-all", Some(id), None, &format!("{tasks} tasks"))?;
        Ok(tasks)
    }

    /// Changes sandbox `id`'s record with `f` under the lock; returns what
    /// `f` returned and the changed record (for the store).
    fn change_record<T>(
        &self,
        id: &str,
        f: impl FnOnce(&mut SandboxRecord) -> Result<T, DaemonError>,
    ) -> Result<(T, SandboxRecord), DaemonError> {
        let mut inner = self.lock();
        let live = inner
            .sandboxes
            .get_mut(id)
            .ok_or_else(|| DaemonError::NotFound(format!("no sandbox `{id}`")))?;
        let done = f(&mut live.rec)?;
        Ok((done, live.rec.clone()))
    }

    /// Replaces a sandbox's egress policy (where it may connect, what its
    /// proxy adds): connections made from now on follow it, those open
    /// keep theirs. A hibernated sandbox takes it at its wake.
    pub fn set_egress(
        &self,
        id: &str,
        egress: EgressSpec,
        who: &str,
    ) -> Result<SandboxInfo, DaemonError> {
        let allow = allowlist(&egress)?;
        let bound = secrets(&egress)?;
        let hosts: Vec<&str> = egress.secrets.iter().map(|s| s.host.as_str()).collect();
        let detail = format!(
            "allow [{}] credentials for [{}]",
            egress.allow.join(", "),
            hosts.join(", ")
        );
        let rec = {
            let mut inner = self.lock();
            let live = inner
                .sandboxes
                .get_mut(id)
                .ok_or_else(|| DaemonError::NotFound(format!("no sandbox `{id}`")))?;
            if matches!(
                live.rec.state,
                SandboxState::Starting | SandboxState::Pooled | SandboxState::Failed
            ) {
                return Err(DaemonError::Conflict(format!(
                    "sandbox `{id}` is {}: its egress policy cannot change",
                    live.rec.state.name()
                )));
            }
            live.rec.egress_allow = egress.allow;
            live.rec.egress_secrets = egress.secrets;
            if let Some(proxy) = &live.proxy {
                proxy.set_policy(allow, bound);
            }
            live.rec.clone()
        };
        self.store.put_sandbox(&rec)?;
        self.store.audit(who, "egress", Some(id), None, &detail)?;
        Ok(info(&rec))
    }

    /// Changes a sandbox's time to live, expiry policy or labels.
    pub fn update(
        &self,
        id: &str,
        update: SandboxUpdate,
        who: &str,
    ) -> Result<SandboxInfo, DaemonError> {
        check_labels(&update.labels)?;
        self.record(id)?;
        let ((), rec) = self.change_record(id, |rec| {
            match update.ttl_s {
                Some(0) => rec.expires_unix_ms = None,
                Some(s) => rec.expires_unix_ms = Some(now_unix_ms() + s * 1000),
                None => {}
            }
            if let Some(policy) = update.on_expiry {
                rec.on_expiry = policy;
            }
            for (k, v) in &update.labels {
                if v.is_empty() {
                    rec.labels.remove(k);
                } else {
                    rec.labels.insert(k.clone(), v.clone());
                }
            }
            Ok(())
        })?;
        self.store.put_sandbox(&rec)?;
        self.store.audit(who, "update", Some(id), None, "")?;
        Ok(info(&rec))
    }

    /// Snapshots a sandbox into a new template named `name`. The sandbox
    /// is paused while its memory is written, then runs on.
    pub fn snapshot(&self, id: &str, name: &str, who: &str) -> Result<TemplateRecord, DaemonError> {
        self.wake_if_hibernated(id, who)?;
        let rec = self.record(id)?;
        media::refuse_with_media(&rec, "snapshotted (or forked)")?;
        if !matches!(rec.state, SandboxState::Running | SandboxState::Paused) {
            return Err(DaemonError::Conflict(format!(
                "sandbox `{id}` is {}: it cannot be snapshotted",
                rec.state.name()
            )));
        }
        self.reserve_name(name)?;
        let parent = self.store.template(&rec.template)?;
        let result = self
            .reserve_snapshot(id, u64::from(rec.mem_mib) << 20)
            .and_then(|reserved| {
                let t =
                    template::from_sandbox(&self.cfg, &new_id("tpl"), name, &rec, parent.as_ref())?;
                self.store.put_template(&t)?;
                drop(reserved);
                Ok(t)
            });
        self.lock().building.retain(|n| n != name);
        let t = result?;
        self.store
            .audit(who, "snapshot", Some(id), Some(&t.id), name)?;
        Ok(t)
    }

    /// Forks a sandbox: snapshots it into template `name` and creates
    /// `count` sandboxes from that template, at once (as many restores run
    /// together as the daemon's `restore_parallel`), each with the
    /// parent's labels, egress policy, port privacy and idle policy. All
    /// or nothing: when one create fails, those made go and the first
    /// failure is the answer.
    pub fn fork(
        &self,
        id: &str,
        name: &str,
        count: u32,
        who: &str,
    ) -> Result<(TemplateRecord, Vec<Created>), DaemonError> {
        if !(1..=64).contains(&count) {
            return Err(DaemonError::Invalid(
                "a fork makes 1 to 64 sandboxes".into(),
            ));
        }
        let parent = self.record(id)?;
        let t = self.snapshot(id, name, who)?;
        let req = CreateRequest {
            template: t.id.clone(),
            labels: parent.labels.clone(),
            egress: EgressSpec {
                allow: parent.egress_allow.clone(),
                secrets: parent.egress_secrets.clone(),
            },
            private_ports: parent.traffic_token.is_some(),
            on_idle: parent.on_idle,
            ..CreateRequest::default()
        };
        let results: Vec<Result<Created, DaemonError>> = std::thread::scope(|s| {
            let creates: Vec<_> = (0..count)
                .map(|_| s.spawn(|| self.create(req.clone(), who)))
                .collect();
            creates
                .into_iter()
                .map(|c| {
                    c.join().unwrap_or_else(|_| {
                        Err(DaemonError::Failed("a fork's create panicked".into()))
                    })
                })
                .collect()
        });
        let (made, failed): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
        let made: Vec<Created> = made.into_iter().flatten().collect();
        if let Some(Err(e)) = failed.into_iter().next() {
            for c in &made {
                let _ = self.destroy(&c.sandbox.id, who);
            }
            return Err(e);
        }
        Ok((t, made))
    }

    /// Destroys a sandbox: its VMM is killed and its run directory removed.
    pub fn destroy(&self, id: &str, who: &str) -> Result<(), DaemonError> {
        self.record(id)?;
        // Audited before it goes: whoever sees it gone finds the entry (it
        // goes even when the entry cannot be written).
        let audited = self.store.audit(who, "destroy", Some(id), None, "");
        self.destroy_quietly(id);
        audited?;
        tracing::info!(sandbox = %id, "destroyed");
        self.pool_wakeup.notify_all();
        Ok(())
    }

    /// Kills a sandbox's VMM and removes everything of it (no checks).
    fn destroy_quietly(&self, id: &str) {
        let live = {
            let mut inner = self.lock();
            for q in inner.parked.values_mut() {
                q.retain(|p| p != id);
            }
            inner.parked_agents.remove(id);
            inner.sandboxes.remove(id)
        };
        let Some(mut live) = live else {
            return;
        };
        match live.child.as_mut() {
            Some(child) => vmm_process::stop(child),
            None => {
                vmm_process::kill(live.rec.pid, live.rec.pid_start);
                // Not our child: wait for it to be gone before its files go.
                let deadline = Instant::now() + Duration::from_secs(10);
                while vmm_process::is_alive(live.rec.pid, live.rec.pid_start)
                    && Instant::now() < deadline
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        podnet::leave_pod_network(&live.rec);
        let _ = std::fs::remove_dir_all(&live.rec.run_dir);
        self.remove_cgroup(id);
        self.give_uid(live.rec.uid);
        if let Err(e) = self.store.remove_sandbox(id) {
            tracing::error!(sandbox = %id, "cannot remove it from the store: {e}");
        }
    }

    // ---- pools ----

    /// Sets a template's pool size (0: no pool; its parked clones go).
    pub fn set_pool(&self, template: &str, size: u32, who: &str) -> Result<PoolInfo, DaemonError> {
        let t = self.template(template)?;
        if size > self.cfg.max_sandboxes {
            return Err(DaemonError::Invalid(format!(
                "a pool of {size} is larger than the host's maximum of {} sandboxes",
                self.cfg.max_sandboxes
            )));
        }
        self.store.set_pool(&t.id, size)?;
        // A shrink waits for the refills in flight (each parks its clone
        // only if the pool still wants it), so that when it returns the
        // pool has no more than `size` clones.
        {
            let mut inner = self.lock();
            let give_up =
                Instant::now() + self.cfg.restore_wait * husk_agent_client::readiness::MAX_STRETCH;
            while inner.restoring.get(&t.id).copied().unwrap_or(0) > 0
                && inner.parked.get(&t.id).map_or(0, VecDeque::len) as u32
                    + inner.restoring.get(&t.id).copied().unwrap_or(0)
                    > size
                && Instant::now() < give_up
            {
                inner = self
                    .pool_wakeup
                    .wait_timeout(inner, Duration::from_secs(1))
                    .map_or_else(|e| e.into_inner().0, |(g, _)| g);
            }
        }
        // Shrink at once; growing is the pool manager's.
        loop {
            let extra = {
                let mut inner = self.lock();
                let q = inner.parked.entry(t.id.clone()).or_default();
                if q.len() > size as usize {
                    q.pop_back()
                } else {
                    None
                }
            };
            match extra {
                Some(id) => self.destroy_quietly(&id),
                None => break,
            }
        }
        self.store
            .audit(who, "pool-set", None, Some(&t.id), &format!("size={size}"))?;
        self.pool_wakeup.notify_all();
        self.pool(&t)
    }

    fn pool(&self, t: &TemplateRecord) -> Result<PoolInfo, DaemonError> {
        let target = self.store.pools()?.get(&t.id).copied().unwrap_or(0);
        let inner = self.lock();
        let (hits, misses) = inner.hits.get(&t.id).copied().unwrap_or_default();
        Ok(PoolInfo {
            template: t.id.clone(),
            template_name: t.name.clone(),
            target,
            ready: inner.parked.get(&t.id).map_or(0, |q| q.len() as u32),
            restoring: inner.restoring.get(&t.id).copied().unwrap_or(0),
            hits,
            misses,
        })
    }

    /// The warm pools that keep, hold or are restoring clones.
    pub fn pools(&self) -> Result<Vec<PoolInfo>, DaemonError> {
        let mut out = Vec::new();
        for t in self.store.templates()? {
            let p = self.pool(&t)?;
            if p.target > 0 || p.ready > 0 || p.restoring > 0 {
                out.push(p);
            }
        }
        Ok(out)
    }

    /// Keeps every pool at its target: starts a refill whenever a pool is
    /// short and the host has room, at most `restore_parallel` at once.
    fn manage_pools(self: Arc<Self>) {
        let mut refills: Vec<std::thread::JoinHandle<()>> = Vec::new();
        while !self.stopping.load(Ordering::SeqCst) {
            refills.retain(|h| !h.is_finished());
            let wanted = self.short_pool(refills.len() as u32);
            match wanted {
                Some(t) => {
                    *self.lock().restoring.entry(t.id.clone()).or_default() += 1;
                    let d = self.clone();
                    let spawned = std::thread::Builder::new()
                        .name("refill".into())
                        .spawn(move || d.refill(t));
                    match spawned {
                        Ok(h) => refills.push(h),
                        Err(e) => tracing::error!("cannot start a pool refill: {e}"),
                    }
                }
                None => {
                    let inner = self.lock();
                    // Woken by creates, destroys, pool changes and refills;
                    // the timeout only bounds how late a missed wake-up is.
                    let _ = self.pool_wakeup.wait_timeout(inner, Duration::from_secs(1));
                }
            }
        }
        for h in refills {
            let _ = h.join();
        }
    }

    /// A template whose pool is short and that fits on the host now.
    fn short_pool(&self, in_flight: u32) -> Option<TemplateRecord> {
        if in_flight >= self.cfg.restore_parallel.max(1) {
            return None;
        }
        let pools = self.store.pools().ok()?;
        let inner = self.lock();
        let (mut mem, mut count) = Self::usage(&inner);
        for (tid, target) in pools {
            let have = inner.parked.get(&tid).map_or(0, |q| q.len() as u32)
                + inner.restoring.get(&tid).copied().unwrap_or(0);
            if have >= target {
                continue;
            }
            let t = self.store.template(&tid).ok().flatten()?;
            // A pool never takes the last room a create would need.
            mem += u64::from(t.mem_mib);
            count += 1;
            if count > self.cfg.max_sandboxes || mem > self.cfg.memory_mib {
                return None;
            }
            return Some(t);
        }
        None
    }

    /// Restores one clone for `t`'s pool and parks it.
    fn refill(&self, t: TemplateRecord) {
        let result = {
            let _slot = self.slots.acquire(Priority::Background);
            self.restore(&t, Priority::Background, None)
        };
        let parked = result.and_then(|(rec, agent)| {
            control(&rec.run_dir, &husk_vmm_api::Request::Pause)?;
            Ok((rec, agent))
        });
        let target = self
            .store
            .pools()
            .ok()
            .and_then(|p| p.get(&t.id).copied())
            .unwrap_or(0);
        let mut inner = self.lock();
        if let Some(n) = inner.restoring.get_mut(&t.id) {
            *n = n.saturating_sub(1);
        }
        let wanted = (inner.parked.get(&t.id).map_or(0, VecDeque::len) as u32) < target;
        match parked {
            Ok((rec, _)) if !wanted => {
                // The pool shrank while this clone restored.
                drop(inner);
                let _ = self.audit("host", "destroy", &rec.id, "the pool shrank");
                self.destroy_quietly(&rec.id);
            }
            Ok((mut rec, agent)) => {
                rec.state = SandboxState::Pooled;
                if let Some(live) = inner.sandboxes.get_mut(&rec.id) {
                    live.rec.state = SandboxState::Pooled;
                    inner.parked_agents.insert(rec.id.clone(), agent);
                    inner
                        .parked
                        .entry(t.id.clone())
                        .or_default()
                        .push_back(rec.id.clone());
                    drop(inner);
                    if let Err(e) = self.store.put_sandbox(&rec) {
                        tracing::error!(sandbox = %rec.id, "store: {e}");
                    }
                }
            }
            Err(e) => {
                drop(inner);
                tracing::warn!(template = %t.name, "pool refill failed: {e}");
                // A template that does not restore must not spin: wait
                // before the manager tries again.
                std::thread::sleep(Duration::from_secs(2));
            }
        }
        self.pool_wakeup.notify_all();
    }

    // ---- the monitor ----

    /// Notices VMMs that exit and sandboxes whose time is up.
    fn monitor(self: Arc<Self>) {
        while !self.stopping.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(250));
            self.reap();
            self.make_ready();
            self.expire();
            self.idle();
            self.reclaim_idle();
        }
    }

    /// Mounts the shares of new sandboxes that no request has reached
    /// yet (a thread each, with a request of the daemon's own that carries
    /// their [`Gate`]), so that a guest that cannot mount them is failed
    /// now, with the reason, not at its first use.
    fn make_ready(self: &Arc<Self>) {
        let due: Vec<String> = {
            let mut inner = self.lock();
            inner
                .sandboxes
                .values_mut()
                .filter(|live| live.rec.state == SandboxState::Running && !live.readying)
                .filter(|live| {
                    live.gate
                        .as_ref()
                        .is_some_and(|g| !g.shares().is_empty() && !g.is_set())
                })
                .map(|live| {
                    live.readying = true;
                    live.rec.id.clone()
                })
                .collect()
        };
        for id in due {
            let (d, sandbox) = (self.clone(), id.clone());
            let spawned = std::thread::Builder::new()
                .name("mount".into())
                .spawn(move || {
                    let made = d.with_agent(&id, "daemon", ("mount", "the create's shares"), |c| {
                        c.ping()
                    });
                    if let Err(e) = made {
                        tracing::warn!(sandbox = %id, "its shares were not mounted: {e}");
                        if d.state_of(&id) == Some(SandboxState::Running) {
                            d.fail(&id, &e.to_string());
                        }
                    }
                });
            if let Err(e) = spawned {
                tracing::error!(sandbox = %sandbox, "cannot start mounting its shares: {e}");
            }
        }
    }

    /// Marks failed the sandboxes whose VMM exited (pool clones are simply
    /// removed: the pool replaces them).
    fn reap(&self) {
        let mut died = Vec::new();
        {
            let mut inner = self.lock();
            for live in inner.sandboxes.values_mut() {
                // A hibernated one has no VMM (or, while it wakes, one
                // its wake watches).
                if matches!(
                    live.rec.state,
                    SandboxState::Failed | SandboxState::Starting | SandboxState::Hibernated
                ) {
                    continue;
                }
                let status = match live.child.as_mut() {
                    Some(child) => match child.try_wait() {
                        Ok(Some(status)) => Some(status.to_string()),
                        _ => None,
                    },
                    None => (!vmm_process::is_alive(live.rec.pid, live.rec.pid_start))
                        .then(|| "unknown status: not this daemon's child".to_owned()),
                };
                if let Some(status) = status {
                    died.push((live.rec.id.clone(), live.rec.state, status));
                }
            }
        }
        for (id, state, status) in died {
            if state == SandboxState::Pooled {
                tracing::warn!(sandbox = %id, "a pool clone's VMM exited ({status})");
                self.destroy_quietly(&id);
                continue;
            }
            let why = {
                let inner = self.lock();
                let Some(live) = inner.sandboxes.get(&id) else {
                    continue;
                };
                format!(
                    "its VMM exited ({status}); last console lines:\n{}\nlast VMM log lines:\n{}",
                    vmm_process::tail(&live.rec.run_dir.join(vmm_process::CONSOLE), 10),
                    vmm_process::tail(&live.rec.run_dir.join(vmm_process::LOG), 5),
                )
            };
            self.mark_failed(&id, &why, &status);
            tracing::warn!(sandbox = %id, "VMM exited ({status}): sandbox failed");
            self.remove_cgroup(&id);
            self.metrics.vmm_failed();
            self.pool_wakeup.notify_all();
        }
    }

    /// Destroys or pauses the sandboxes whose time to live ran out.
    fn expire(&self) {
        let now = now_unix_ms();
        let due: Vec<(String, ExpiryPolicy)> = {
            let inner = self.lock();
            inner
                .sandboxes
                .values()
                .filter(|l| {
                    matches!(
                        l.rec.state,
                        SandboxState::Running | SandboxState::Paused | SandboxState::Hibernated
                    )
                })
                .filter(|l| l.rec.expires_unix_ms.is_some_and(|e| e <= now))
                .map(|l| (l.rec.id.clone(), l.rec.on_expiry))
                .collect()
        };
        for (id, policy) in due {
            let result = match policy {
                ExpiryPolicy::Destroy => self.destroy(&id, "ttl"),
                // It stays: without a time to live from now on.
                ExpiryPolicy::Pause | ExpiryPolicy::Hibernate => self
                    .update(
                        &id,
                        SandboxUpdate {
                            ttl_s: Some(0),
                            ..SandboxUpdate::default()
                        },
                        "ttl",
                    )
                    .and_then(|s| match (policy, s.state) {
                        (ExpiryPolicy::Pause, SandboxState::Running) => {
                            self.pause(&id, "ttl").map(drop)
                        }
                        (ExpiryPolicy::Hibernate, SandboxState::Running | SandboxState::Paused) => {
                            self.hibernate(&id, "ttl").map(drop)
                        }
                        _ => Ok(()),
                    }),
            };
            match result {
                Ok(()) => tracing::info!(sandbox = %id, ?policy, "time to live ran out"),
                Err(e) => tracing::warn!(sandbox = %id, "expiry failed: {e}"),
            }
        }
    }

    /// Hibernates or destroys the running sandboxes nobody has used for
    /// their `on_idle.after_s`.
    fn idle(&self) {
        let due: Vec<(String, IdleAction, Duration)> = {
            let inner = self.lock();
            inner
                .sandboxes
                .values()
                .filter(|l| l.rec.state == SandboxState::Running)
                .filter_map(|l| {
                    // An open port connection holds a use too.
                    let p = l.rec.on_idle?;
                    let after = Duration::from_secs(p.after_s);
                    (l.activity.idle_for() >= after).then(|| (l.rec.id.clone(), p.action, after))
                })
                .collect()
        };
        for (id, action, after) in due {
            let result = match action {
                IdleAction::Destroy => self.destroy(&id, "idle"),
                IdleAction::Hibernate => self.hibernate_idle(&id, after),
            };
            match result {
                Ok(()) => tracing::info!(sandbox = %id, ?action, "idle"),
                Err(e) => {
                    tracing::warn!(sandbox = %id, "idle {action:?} failed: {e}");
                    // Not again at once: a full idle period from now.
                    if let Some(l) = self.lock().sandboxes.get(&id) {
                        l.activity.touch();
                    }
                }
            }
        }
    }

    /// Gives a destroyed sandbox's jail uid back.
    fn give_uid(&self, uid: u32) {
        if let (Some(j), true) = (&self.cfg.jail, uid != 0) {
            j.uids.give(uid);
        }
    }

    fn remove_cgroup(&self, id: &str) {
        if let Some(h) = &self.cfg.cgroups {
            Cgroup::existing(h, id).remove();
        }
    }

    /// Per-state counts and the memory of live VMMs, for /metrics.
    pub fn gauges(&self) -> Gauges {
        let inner = self.lock();
        let mut by_state = BTreeMap::new();
        for s in SandboxState::ALL {
            by_state.insert(s.name(), 0u64);
        }
        let mut rss_bytes = 0u64;
        for live in inner.sandboxes.values() {
            *by_state.entry(live.rec.state.name()).or_default() += 1;
            if live.rec.state != SandboxState::Failed {
                rss_bytes += vm_rss(live.rec.pid);
            }
        }
        let (mem, _) = Self::usage(&inner);
        Gauges {
            by_state,
            vmm_rss_bytes: rss_bytes,
            guest_mem_mib: mem,
            memory_budget_mib: self.cfg.memory_mib,
        }
    }
}

/// Room held for one create (see `Daemon::make_room`).
struct Reservation<'a> {
    daemon: &'a Daemon,
    mem_mib: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut inner = self.daemon.lock();
        inner.reserved.0 -= self.mem_mib;
        inner.reserved.1 -= 1;
    }
}

/// A process's resident memory in bytes (VmRSS), or 0.
pub fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// The resident memory of sandbox process `pid`'s VMM (a jailer's child,
/// not the jailer) in bytes, or 0.
pub fn vm_rss(pid: u32) -> u64 {
    rss(vmm_process::vmm_of(pid))
}

/// The CPU use (user and system) of sandbox process `pid`'s VMM (a
/// jailer's child, not the jailer) over `sample`, as a percentage of
/// `cpus` CPUs; None if it cannot be read (the process is gone). Sleeps
/// for `sample`.
pub fn vm_cpu_used_pct(pid: u32, sample: Duration, cpus: u32) -> Option<f64> {
    let pid = vmm_process::vmm_of(pid);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let (before, started) = (vmm_process::cpu_ticks(pid)?, Instant::now());
    std::thread::sleep(sample);
    let used = vmm_process::cpu_ticks(pid)?.saturating_sub(before) as f64 / hz;
    let elapsed = started.elapsed().as_secs_f64().max(1e-3);
    Some((used / elapsed / f64::from(cpus.max(1)) * 100.0).min(100.0))
}

/// One control request to the VMM whose run directory is `run_dir`.
fn control(
    run_dir: &Path,
    request: &husk_vmm_api::Request,
) -> Result<husk_vmm_api::Reply, DaemonError> {
    control_with_fd(run_dir, request, None)
}

/// As [`control`], passing descriptor `fd` (if any) with the request.
fn control_with_fd(
    run_dir: &Path,
    request: &husk_vmm_api::Request,
    fd: Option<std::os::fd::BorrowedFd<'_>>,
) -> Result<husk_vmm_api::Reply, DaemonError> {
    let socket = run_dir.join(vmm_process::API);
    match fd {
        Some(fd) => husk_vmm_api::call_with_fd(&socket, request, fd, AGENT_TIMEOUT),
        None => husk_vmm_api::call(&socket, request, AGENT_TIMEOUT),
    }
    .map_err(|e| DaemonError::Failed(format!("the VMM's control socket: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiting_create_gets_the_next_slot_before_a_refill() {
        let slots = Arc::new(Slots::new(1));
        let held = slots.acquire(Priority::Normal);
        let order = Arc::new(Mutex::new(Vec::new()));
        let waiter = |priority, name: &'static str| {
            let (slots, order) = (slots.clone(), order.clone());
            std::thread::spawn(move || {
                let _slot = slots.acquire(priority);
                order.lock().expect("lock").push(name);
            })
        };
        // The refill asks first; the create comes while it waits.
        let refill = waiter(Priority::Background, "refill");
        std::thread::sleep(Duration::from_millis(50));
        let create = waiter(Priority::Normal, "create");
        while slots.state.lock().expect("lock").creates_waiting == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(held);
        create.join().expect("create");
        refill.join().expect("refill");
        assert_eq!(*order.lock().expect("lock"), ["create", "refill"]);
    }

    #[test]
    fn labels_are_checked() {
        let ok = BTreeMap::from([("team/a".to_owned(), "x".to_owned())]);
        let bad = BTreeMap::from([("a b".to_owned(), "x".to_owned())]);

        assert!(check_labels(&ok).is_ok());
        assert!(matches!(check_labels(&bad), Err(DaemonError::Invalid(_))));
    }

    #[test]
    fn ids_are_distinct() {
        assert_ne!(new_id("sb"), new_id("sb"));
    }
}
