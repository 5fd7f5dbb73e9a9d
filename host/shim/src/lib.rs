//! `containerd-shim-husk-v2`: the containerd runtime `io.containerd.husk.v2`
//! (shim v2), so containerd, and Kubernetes through a RuntimeClass, run
//! each task in a husk sandbox.
//!
//! One shim per task, one sandbox per task; a Kubernetes pod (the CRI's
//! annotations) is one shim and one sandbox, its containers inside it with
//! root file systems of their own (see `host/containerd.md`). The shim is a
//! client of the
//! husk daemon (`husk serve`, at `$HUSK_HOST` or the default socket), which
//! applies the jail, cgroup and egress policy as it does for every sandbox;
//! the shim reaches the task's guest agent directly for its processes.
//!
//! - Create: the bundle's root file system becomes a template of its own
//!   (an ext4 image, booted once and snapshotted, cached by the tree's
//!   content hash and shared read-only by its clones, each with its own
//!   copy-on-write layer), or the `io.husk.template` annotation names a
//!   template; the task's sandbox is a clone of it (pooled when the daemon
//!   keeps a pool). The OCI memory and CPU limits size the VM; a pod's
//!   VM is sized by its containers' limits (the CRI's sandbox
//!   annotations, see [`bundle::PodResources`]).
//! - Start runs the OCI process (args, env, cwd, user, terminal) through
//!   the agent, with the FIFOs bridged ([`process`]); Exec adds processes.
//! - Kill, Wait, State, Pids, ResizePty, CloseIO, Pause and Resume (the
//!   vCPUs), Stats (the VMM's cgroup and the guest's memory), Delete (the
//!   sandbox is destroyed), and the task events.
//!
//! A sandbox is created with the task's label and a time to live that the
//! shim removes once containerd has it, so a shim killed during Create
//! leaves nothing behind: `delete` (run by containerd after a dead shim)
//! destroys what carries the label, and the lease ends what is not yet
//! labelled.

pub mod bundle;
pub mod process;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use containerd_shim as shim;
use containerd_shim::protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskIO, TaskPaused,
    TaskResumed, TaskStart,
};
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::protobuf::{MessageDyn, MessageField};
use containerd_shim::protos::ttrpc;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{api, ExitSignal, TtrpcContext, TtrpcResult};

use self::bundle::{Bundle, Source};
use self::process::{Exit, GuestProcess, Place, Stdio};
use husk_client::{ApiClient, ApiClientError};
use husk_types::{CreateRequest, SandboxInfo, SandboxUpdate};

/// The runtime's name in containerd.
pub const RUNTIME_ID: &str = "io.containerd.husk.v2";

/// How long a new sandbox lives unless the shim confirms it (a shim killed
/// during Create leaves one that ends by itself).
const CREATE_LEASE_S: u64 = 120;

/// The longest a Create waits for another shim's build of the same root
/// file system (stretched on a loaded host).
const BUILD_WAIT: Duration = Duration::from_secs(1800);

#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("husk daemon: {0}")]
    Daemon(#[from] ApiClientError),
    #[error("guest agent: {0}")]
    Agent(String),
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
}

impl From<husk_agent_client::ClientError> for ShimError {
    fn from(e: husk_agent_client::ClientError) -> Self {
        ShimError::Agent(e.to_string())
    }
}

impl From<ShimError> for ttrpc::Error {
    fn from(e: ShimError) -> Self {
        let code = match &e {
            ShimError::Invalid(_) => ttrpc::Code::INVALID_ARGUMENT,
            ShimError::NotFound(_)
            | ShimError::Daemon(ApiClientError::Status { status: 404, .. }) => {
                ttrpc::Code::NOT_FOUND
            }
            ShimError::Daemon(ApiClientError::Status { status: 400, .. }) => {
                ttrpc::Code::INVALID_ARGUMENT
            }
            ShimError::Conflict(_)
            | ShimError::Daemon(ApiClientError::Status { status: 409, .. }) => {
                ttrpc::Code::FAILED_PRECONDITION
            }
            _ => ttrpc::Code::INTERNAL,
        };
        ttrpc::Error::RpcStatus(ttrpc::get_status(code, e.to_string()))
    }
}

/// The shim binary's side of containerd's protocol (`start`, `delete`, and
/// serving the task service).
pub struct HuskShim {
    exit: Arc<ExitSignal>,
    namespace: String,
    id: String,
    bundle: PathBuf,
    /// containerd's address.
    containerd: String,
    /// The socket this shim serves on (`unix://PATH`; empty before `start`).
    socket: String,
}

impl std::fmt::Debug for HuskShim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HuskShim")
            .field("namespace", &self.namespace)
            .field("id", &self.id)
            .field("bundle", &self.bundle)
            .finish()
    }
}

impl shim::Shim for HuskShim {
    type T = TaskService;

    fn new(_runtime_id: &str, args: &shim::Flags, _config: &mut shim::Config) -> Self {
        let bundle = if args.bundle.is_empty() {
            std::env::current_dir().unwrap_or_default()
        } else {
            PathBuf::from(&args.bundle)
        };
        // The shim crate hands SIGPIPE to signal-hook, whose handler wakes
        // its iterator with a `send` that has no MSG_NOSIGNAL: once that
        // iterator's end is closed (a shim on its way out), each wake
        // raises SIGPIPE again, a storm that held a core for as long as the
        // process lived. SIGPIPE is ignored, as Rust's runtime had it
        // before the crate: a closed peer is an EPIPE error to whoever
        // wrote. Nothing reads SIGPIPE from the iterator but a debug log.
        // SAFETY: sets a signal's disposition, touching no memory.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        HuskShim {
            exit: Arc::new(ExitSignal::default()),
            namespace: args.namespace.clone(),
            id: args.id.clone(),
            bundle,
            containerd: args.address.clone(),
            socket: args.socket.clone(),
        }
    }

    fn start_shim(&mut self, opts: shim::StartOpts) -> Result<String, shim::Error> {
        // A pod's containers share its shim (containerd runs `start` in
        // the bundle): a second shim process finds the pod's socket serving
        // and exits, answering its address.
        let grouping = bundle::grouping(&std::env::current_dir().unwrap_or_default(), &opts.id);
        let (_pid, address) = shim::spawn(opts, &grouping, Vec::new())?;
        // In the bundle: the served shim removes its socket on the way out,
        // and `delete` after a killed one.
        shim::synchronous::util::write_address(&address)?;
        Ok(address)
    }

    /// After a shim that died (or a failed Create): destroys the task's
    /// sandboxes and unmounts its root file system.
    fn delete_shim(&mut self) -> Result<api::DeleteResponse, shim::Error> {
        let daemon = husk_client::from_env();
        let labels = bundle::task_labels(&self.namespace, &self.id, &self.containerd);
        if let Err(e) = destroy_labelled(&daemon, &labels) {
            tracing::warn!(task = %self.id, "could not destroy the task's sandboxes: {e}");
        }
        unmount_rootfs(&self.bundle);
        remove_socket(&self.bundle);
        Ok(api::DeleteResponse {
            exit_status: 128 + libc::SIGKILL as u32,
            exited_at: MessageField::some(timestamp(SystemTime::now())),
            ..Default::default()
        })
    }

    fn wait(&mut self) {
        self.exit.wait();
        // The shim crate removes the socket after its server stops, by the
        // `address` file in the bundle; containerd removes the bundle as
        // soon as Shutdown returns, so on a busy host the file can be gone
        // first and the socket left behind. Unlinking the path now refuses
        // only new connections: the server's listener and containerd's
        // connection are open files.
        if let Some(path) = self.socket.strip_prefix("unix://") {
            let _ = std::fs::remove_file(path);
        }
    }

    fn create_task_service(&self, publisher: RemotePublisher) -> TaskService {
        TaskService {
            inner: Arc::new(Inner {
                namespace: self.namespace.clone(),
                exit: self.exit.clone(),
                publisher,
                daemon: husk_client::from_env(),
                containerd: self.containerd.clone(),
                tasks: Mutex::new(HashMap::new()),
            }),
        }
    }
}

/// Destroys every sandbox labelled as this task's.
fn destroy_labelled(
    daemon: &ApiClient,
    labels: &std::collections::BTreeMap<String, String>,
) -> Result<(), ShimError> {
    for s in daemon.sandboxes(labels, None)? {
        tracing::info!(sandbox = %s.id, "destroying the task's sandbox");
        match daemon.destroy_sandbox(&s.id) {
            Ok(()) | Err(ApiClientError::Status { status: 404, .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Removes the socket a shim that died served on (the `address` file in
/// its bundle names it), unless a shim serves it: containerd runs `delete`
/// in the bundle of every task it deletes, and a pod's containers share
/// the pod's shim and socket (removing it would make the pod's next
/// container start a shim that does not know the pod).
fn remove_socket(bundle: &Path) {
    let Ok(address) = std::fs::read_to_string(bundle.join("address")) else {
        return;
    };
    if let Some(path) = address.trim().strip_prefix("unix://") {
        if std::os::unix::net::UnixStream::connect(path).is_err() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Where the shim mounts containerd's rootfs mounts (an image's layers).
fn rootfs_mountpoint(bundle: &Path) -> PathBuf {
    bundle.join("rootfs")
}

fn unmount_rootfs(bundle: &Path) {
    let target = rootfs_mountpoint(bundle);
    if bundle.join(MOUNTED_MARK).exists() {
        if let Err(e) = nix::mount::umount2(&target, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!("unmounting {}: {e}", target.display());
        }
        let _ = std::fs::remove_file(bundle.join(MOUNTED_MARK));
    }
}

/// A file in the bundle saying the shim mounted the rootfs (so that
/// `delete` unmounts only what the shim mounted).
const MOUNTED_MARK: &str = "husk-rootfs-mounted";

/// The task service containerd calls.
#[derive(Clone)]
pub struct TaskService {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TaskService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskService")
            .field("namespace", &self.inner.namespace)
            .finish()
    }
}

struct Inner {
    namespace: String,
    /// containerd's address.
    containerd: String,
    exit: Arc<ExitSignal>,
    publisher: RemotePublisher,
    daemon: ApiClient,
    /// The shim's tasks: one, or a pod's sandbox and its containers.
    tasks: Mutex<HashMap<String, Task>>,
}

/// A husk sandbox a shim's tasks run in: a task's own, or a pod's.
#[derive(Debug)]
struct Vm {
    sandbox: SandboxInfo,
    agent: PathBuf,
    /// Its template's empty drives, which its containers' root file
    /// systems take as media (none: they are copied into its memory).
    drive_slots: u8,
    /// Its template's empty fs slots, which its containers' volumes take
    /// as live shares (none left, or a volume that cannot be shared: it is
    /// copied into its memory).
    fs_slots: u8,
    paused: std::sync::atomic::AtomicBool,
    /// A pod's volumes in its VM so far, by host directory: where in the
    /// guest (held while one is placed, so that two containers place it
    /// once).
    volumes: Mutex<HashMap<PathBuf, String>>,
}

/// A task: a container with its own VM, a pod's sandbox (whose task is the
/// pod's VM), or a container of a pod (in the pod's VM).
struct Task {
    bundle: PathBuf,
    vm: Arc<Vm>,
    /// A pod's container: where it is in the pod's VM. Without it the
    /// task owns its VM (deleting it destroys the VM).
    guest_dir: Option<GuestDir>,
    init: Arc<GuestProcess>,
    execs: HashMap<String, Arc<GuestProcess>>,
}

impl Task {
    fn paused(&self) -> bool {
        self.vm.paused.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn owns_vm(&self) -> bool {
        self.guest_dir.is_none()
    }

    /// Where its processes run.
    fn place(&self) -> Place {
        match &self.guest_dir {
            Some(dir) => Place::Container(container_root(&dir.path)),
            None => Place::Guest,
        }
    }
}

/// A pod's container's place in the pod's VM.
#[derive(Debug, Clone)]
struct GuestDir {
    /// The guest directory that holds its root file system (and what the
    /// shim put in the VM for it).
    path: String,
    /// The VM's drive whose medium is its root file system, if it has
    /// one: freed once its files are gone.
    drive: Option<String>,
}

/// Binds the CRI's single files (`/etc/hosts`, ...) into a container's
/// root on a medium: copied into the VM under `dir/files`, each bound at
/// its place in `root` (the medium is shared by the pods of an image).
fn bind_files(
    agent: &mut husk_agent_client::AgentClient,
    dir: &str,
    root: &str,
    files: &[(String, PathBuf)],
) -> Result<(), husk_agent_client::ClientError> {
    if files.is_empty() {
        return Ok(());
    }
    let at = format!("{dir}/files");
    agent.unpack_files(&at, files)?;
    for (name, _) in files {
        agent.mount(root, &format!("{at}/{name}"), name, false)?;
    }
    Ok(())
}

/// The root file system of the pod's container whose guest directory is
/// `dir`.
fn container_root(dir: &str) -> String {
    format!("{dir}/rootfs")
}

/// Where a pod's container's root file system goes in the guest.
const CONTAINERS_DIR: &str = "/run/husk/containers";
/// Where a pod's volumes go in the guest.
const VOLUMES_DIR: &str = "/run/husk/volumes";

/// Where a pod's shared volumes go in the guest.
const SHARES_DIR: &str = "/run/husk/shares";

/// Binds `bundle`'s volumes into the container root `root`, placing each
/// in the pod's VM on its first use: a live share in one of its template's
/// fs slots (writes reach the host, the host's changes, a configMap's
/// update among them, reach the pod), or where that cannot be (no slot
/// left, no mount root of the daemon's above it, root's and written), a
/// copy at that time. The pod's containers share either.
fn bind_volumes(
    vm: &Vm,
    daemon: &ApiClient,
    agent: &mut husk_agent_client::AgentClient,
    root: &str,
    volumes: &[bundle::Volume],
) -> Result<(), husk_agent_client::ClientError> {
    use sha2::{Digest, Sha256};
    for v in volumes {
        let mut placed = vm.volumes.lock().unwrap_or_else(|e| e.into_inner());
        let dir = match placed.get(&v.source) {
            Some(dir) => dir.clone(),
            None => {
                let key = Sha256::digest(v.source.as_os_str().as_encoded_bytes());
                let key = bundle::hex(&key[..8]);
                let dir = match share_volume(vm, daemon, v, &format!("{SHARES_DIR}/{key}")) {
                    Some(dir) => dir,
                    None => copy_volume(agent, v, &format!("{VOLUMES_DIR}/{key}"))?,
                };
                placed.insert(v.source.clone(), dir.clone());
                dir
            }
        };
        drop(placed);
        agent.mount(root, &dir, &v.target, v.readonly)?;
    }
    Ok(())
}

/// Volume `v` as a live share at `dir` in the pod's VM, if it can be one
/// (why not is logged).
fn share_volume(vm: &Vm, daemon: &ApiClient, v: &bundle::Volume, dir: &str) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    if vm.fs_slots == 0 {
        return None;
    }
    let mut meta = std::fs::metadata(&v.source).ok()?;
    // Root's files are shared read-only only (the daemon's rule). An
    // emptyDir the kubelet has just made (root's, empty) is given to the
    // owner of what husk gives sandboxes to write, so it is shared; any
    // other root directory a container writes is copied.
    if !v.readonly && (meta.uid() == 0 || meta.gid() == 0) {
        match take_empty_dir(&v.source) {
            Ok(true) => meta = std::fs::metadata(&v.source).ok()?,
            Ok(false) => {
                tracing::info!(
                    source = %v.source.display(),
                    "a written volume of root's is copied into the pod's VM, not shared"
                );
                return None;
            }
            Err(e) => {
                tracing::warn!(
                    source = %v.source.display(),
                    "an emptyDir could not be given to the volumes' owner, so it is copied: {e}"
                );
                return None;
            }
        }
    }
    let roots = meta.uid() == 0 || meta.gid() == 0;
    let mount = husk_types::MountSpec {
        host: v.source.to_string_lossy().into_owned(),
        volume: None,
        guest: dir.to_owned(),
        readonly: roots,
        hide: Vec::new(),
    };
    let started = std::time::Instant::now();
    match daemon.add_mount(&vm.sandbox.id, &mount) {
        Ok(_) => {
            tracing::info!(
                source = %v.source.display(), guest = %dir, readonly = roots,
                ms = started.elapsed().as_millis() as u64, "a volume shared with the pod's VM"
            );
            Some(dir.to_owned())
        }
        Err(e) => {
            tracing::warn!(
                source = %v.source.display(),
                "a volume the daemon did not share is copied into the pod's VM: {e}"
            );
            None
        }
    }
}

/// Whether `dir` is an emptyDir volume as the kubelet makes one
/// (`.../volumes/kubernetes.io~empty-dir/NAME`) that is still empty: then
/// it is given to [`husk_types::VOLUME_OWNER`], its mode kept, and true.
/// Its pod is the only user of it, and nothing is in it yet, so no file of
/// root's becomes the guest's to write.
fn take_empty_dir(dir: &std::path::Path) -> std::io::Result<bool> {
    let parent = dir.parent();
    let kind = parent.and_then(|p| p.file_name());
    let volumes = parent.and_then(|p| p.parent()).and_then(|p| p.file_name());
    if kind != Some("kubernetes.io~empty-dir".as_ref()) || volumes != Some("volumes".as_ref()) {
        return Ok(false);
    }
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() || std::fs::read_dir(dir)?.next().is_some() {
        return Ok(false);
    }
    let owner = husk_types::VOLUME_OWNER;
    std::os::unix::fs::lchown(dir, Some(owner), Some(owner))?;
    tracing::info!(dir = %dir.display(), owner, "an empty emptyDir given to the volumes' owner");
    Ok(true)
}

/// Volume `v` copied into the pod's VM at `dir` (a copy at this time:
/// later changes on the host do not follow).
fn copy_volume(
    agent: &mut husk_agent_client::AgentClient,
    v: &bundle::Volume,
    dir: &str,
) -> Result<String, husk_agent_client::ClientError> {
    let started = std::time::Instant::now();
    let size = agent.unpack(dir, &v.source, &[]).inspect_err(|_| {
        // What came of it goes: the next container copies it again.
        let _ = agent.remove(dir, true);
    })?;
    tracing::info!(
        source = %v.source.display(), guest = %dir, bytes = size,
        ms = started.elapsed().as_millis() as u64, "a volume copied into the pod's VM"
    );
    Ok(dir.to_owned())
}

fn timestamp(t: SystemTime) -> Timestamp {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
        ..Default::default()
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Task>> {
        self.tasks.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) {
        if let Err(e) =
            self.publisher
                .publish(shim::Context::default(), topic, &self.namespace, event)
        {
            tracing::warn!("publishing {topic}: {e}");
        }
    }

    /// `f` of task `id` (under the lock), or NotFound.
    fn with_task<R>(
        &self,
        id: &str,
        f: impl FnOnce(&mut Task) -> Result<R, ShimError>,
    ) -> Result<R, ShimError> {
        match self.lock().get_mut(id) {
            Some(task) => f(task),
            None => Err(ShimError::NotFound(format!("no task `{id}`"))),
        }
    }

    /// The task's process `exec_id` ("" for the task's own) and the agent.
    fn process(&self, id: &str, exec_id: &str) -> Result<(Arc<GuestProcess>, PathBuf), ShimError> {
        self.with_task(id, |task| {
            let process = if exec_id.is_empty() {
                task.init.clone()
            } else {
                task.execs.get(exec_id).cloned().ok_or_else(|| {
                    ShimError::NotFound(format!("no process `{exec_id}` in `{id}`"))
                })?
            };
            Ok((process, task.vm.agent.clone()))
        })
    }

    /// The template for a bundle: the annotation's (for a pod, one of its
    /// size), or its root file system's (built now if no shim built it
    /// before).
    fn template_for(&self, bundle: &Bundle) -> Result<String, ShimError> {
        let dir = match &bundle.source {
            Source::Template(name) => {
                // Unknown: fail now, with the daemon's word for it.
                let record = self.daemon.template(name)?;
                return match bundle.pod_resources {
                    Some(pod) => self.pod_template(record, &pod),
                    None => Ok(name.clone()),
                };
            }
            Source::Rootfs(dir) => dir,
        };
        let digest = bundle::rootfs_digest(dir)?;
        let mem_mib = bundle.mem_mib.unwrap_or(128);
        let vcpus = bundle.vcpus.unwrap_or(1);
        let name = bundle::template_name(&digest, mem_mib, vcpus);
        self.built(&name, || {
            Ok(husk_types::TemplateSpec {
                vcpus,
                mem_mib,
                // The daemon reads no host path a client names: the
                // bundle's root file system travels as an upload.
                rootfs: husk_types::RootfsSource::Upload {
                    upload: self.daemon.upload_dir(dir)?,
                },
                ..husk_types::TemplateSpec::new(name.clone())
            })
        })
    }

    /// A pod's template: `record`'s, if its VMs hold the pod's limits;
    /// else, for the base template, a copy of it at the pod's size (built
    /// once per size); a template the pod names that is too small is
    /// refused, saying what the pod needs.
    fn pod_template(
        &self,
        record: husk_types::TemplateRecord,
        pod: &bundle::PodResources,
    ) -> Result<String, ShimError> {
        let Some((vcpus, mem_mib)) = pod.larger_than((record.vcpus, record.mem_mib)) else {
            return Ok(record.name);
        };
        // Only husk's own root file system is built again from its name:
        // another template's source (an upload, warm-up commands) is not
        // on record.
        if !pod.may_grow || record.source != "default" {
            return Err(ShimError::Invalid(format!(
                "the pod needs {vcpus} vCPU and {mem_mib} MiB (its containers' limits and \
                 {} MiB for the guest); template `{}` has {} vCPU and {} MiB: name a larger \
                 one ({})",
                bundle::POD_OVERHEAD_MIB,
                record.name,
                record.vcpus,
                record.mem_mib,
                bundle::TEMPLATE_ANNOTATION
            )));
        }
        let name = format!("{}-{mem_mib}m-{vcpus}c", record.name);
        self.built(&name, || {
            Ok(husk_types::TemplateSpec {
                vcpus,
                mem_mib,
                network: record.network,
                block_limit: record.block_limit.clone(),
                net_limit: record.net_limit.clone(),
                drive_slots: record.drive_slots,
                fs_slots: record.fs_slots,
                ..husk_types::TemplateSpec::new(name.clone())
            })
        })
    }

    /// `name`, built from `spec()` unless it exists; waits for another
    /// shim's build of it.
    fn built(
        &self,
        name: &str,
        spec: impl Fn() -> Result<husk_types::TemplateSpec, ShimError>,
    ) -> Result<String, ShimError> {
        let mut wait = husk_agent_client::readiness::WaitBudget::new(BUILD_WAIT);
        loop {
            if self.template_exists(name)? {
                return Ok(name.to_owned());
            }
            let spec = spec()?;
            tracing::info!(
                template = %name, vcpus = spec.vcpus, mem_mib = spec.mem_mib,
                "building the task's template"
            );
            match self.build(&spec) {
                Ok(()) => return Ok(name.to_owned()),
                // Another shim is building it: wait for that build (or, if
                // it fails, try again).
                Err(ShimError::Daemon(ApiClientError::Status { status: 409, .. })) => {}
                Err(e) => return Err(e),
            }
            if wait.expired() {
                return Err(ShimError::Conflict(format!(
                    "template `{name}` is still being built by another task"
                )));
            }
            std::thread::sleep(Duration::from_secs(2));
        }
    }

    fn template_exists(&self, name: &str) -> Result<bool, ShimError> {
        match self.daemon.template(name) {
            Ok(_) => Ok(true),
            Err(ApiClientError::Status { status: 404, .. }) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    fn build(&self, spec: &husk_types::TemplateSpec) -> Result<(), ShimError> {
        self.daemon
            .build_template(spec)?
            .finish(|message| tracing::info!(template = %spec.name, "{message}"))?;
        Ok(())
    }

    fn create(self: &Arc<Self>, req: &api::CreateTaskRequest) -> Result<u32, ShimError> {
        if self.lock().contains_key(&req.id) {
            return Err(ShimError::Conflict(format!("task `{}` exists", req.id)));
        }
        if [&req.stdout, &req.stderr]
            .iter()
            .any(|p| p.contains("://") && !p.starts_with("file://"))
        {
            return Err(ShimError::Invalid(
                "only FIFOs and file:// log URIs are supported for output (no binary:// loggers)"
                    .into(),
            ));
        }
        let bundle_dir = PathBuf::from(&req.bundle);
        let mounted = if req.rootfs.is_empty() {
            None
        } else {
            Some(mount_rootfs(&bundle_dir, &req.rootfs)?)
        };
        let result = self.create_sandbox(req, &bundle_dir, mounted.as_deref());
        if result.is_err() {
            unmount_rootfs(&bundle_dir);
        }
        result
    }

    fn create_sandbox(
        self: &Arc<Self>,
        req: &api::CreateTaskRequest,
        bundle_dir: &Path,
        rootfs: Option<&Path>,
    ) -> Result<u32, ShimError> {
        let bundle = Bundle::load(bundle_dir, rootfs)?;
        if let Some(bundle::Pod::Container { sandbox }) = &bundle.pod {
            return self.create_container(req, bundle_dir, &bundle, sandbox);
        }
        let template = self.template_for(&bundle)?;
        tracing::info!(task = %req.id, template = %template, "creating the task's sandbox");
        let created = self.daemon.create_sandbox(&CreateRequest {
            template: template.clone(),
            ttl_s: Some(CREATE_LEASE_S),
            labels: bundle::task_labels(&self.namespace, &req.id, &self.containerd),
            ..Default::default()
        })?;
        let sandbox = created.sandbox;
        // containerd has it now: it lives until the task is deleted.
        let confirmed = self.daemon.update_sandbox(
            &sandbox.id,
            &SandboxUpdate {
                ttl_s: Some(0),
                ..Default::default()
            },
        );
        // A pod on the cluster's network: its VM joins the pod's network
        // namespace (CNI ran before this Create).
        let joined = match (&bundle.netns, confirmed) {
            (Some(netns), Ok(_)) => self
                .daemon
                .attach_pod_network(&sandbox.id, &netns.to_string_lossy())
                .map(|net| {
                    tracing::info!(
                        task = %req.id, sandbox = %sandbox.id, address = %net.address,
                        mac = %net.mac, "on the pod's network"
                    )
                }),
            (_, confirmed) => confirmed.map(drop),
        };
        let agent = match (joined, &sandbox.agent_socket) {
            (Ok(()), Some(agent)) => PathBuf::from(agent),
            (Ok(()), None) => {
                self.destroy(&sandbox.id);
                return Err(ShimError::Agent(
                    "the daemon did not say where the sandbox's agent is (an older daemon?)".into(),
                ));
            }
            (Err(e), _) => {
                self.destroy(&sandbox.id);
                return Err(e.into());
            }
        };
        tracing::info!(
            task = %req.id, sandbox = %sandbox.id, template = %template,
            pooled = created.pooled, create_ms = created.create_ms, "task created"
        );
        let stdio = Stdio::of(&req.stdin, &req.stdout, &req.stderr, req.terminal);
        let pid = sandbox.pid;
        let is_pod = matches!(bundle.pod, Some(bundle::Pod::Sandbox));
        let place = if is_pod { Place::Holder } else { Place::Guest };
        let init = GuestProcess::new(
            bundle.workload,
            place,
            stdio,
            self.on_exit(&req.id, &req.id, Some(pid)),
        );
        // A pod's containers take its template's empty drives, its
        // volumes the empty fs slots.
        let (drive_slots, fs_slots) = match is_pod {
            true => self
                .daemon
                .template(&template)
                .map_or((0, 0), |t| (t.drive_slots, t.fs_slots)),
            false => (0, 0),
        };
        let vm = Arc::new(Vm {
            sandbox,
            agent,
            drive_slots,
            fs_slots,
            paused: Default::default(),
            volumes: Default::default(),
        });
        self.add(req, bundle_dir, vm, None, init);
        Ok(pid)
    }

    /// A container of a pod: its root file system is copied into the pod's
    /// VM, where its processes run with it as their root.
    fn create_container(
        self: &Arc<Self>,
        req: &api::CreateTaskRequest,
        bundle_dir: &Path,
        bundle: &Bundle,
        sandbox: &str,
    ) -> Result<u32, ShimError> {
        let vm = self
            .lock()
            .get(sandbox)
            .filter(|t| t.owns_vm())
            .map(|t| t.vm.clone())
            .ok_or_else(|| {
                ShimError::NotFound(format!(
                    "pod sandbox `{sandbox}` is not served by this shim"
                ))
            })?;
        let Source::Rootfs(rootfs) = &bundle.source else {
            return Err(ShimError::Invalid(
                "a pod's container needs a root file system".into(),
            ));
        };
        if !req
            .id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            || req.id.starts_with('.')
        {
            return Err(ShimError::Invalid(format!("container id `{}`", req.id)));
        }
        let dir = format!("{CONTAINERS_DIR}/{}", req.id);
        let root = container_root(&dir);
        let started = std::time::Instant::now();
        let medium = self.medium_for(&vm, rootfs, &req.id)?;
        let mut placed_ms = 0;
        let made = husk_agent_client::AgentClient::connect(&vm.agent, Duration::from_secs(120))
            .and_then(|mut agent| {
                // Its root: the medium mounted, the CRI's files bound in;
                // or its tree copied in, the files with it.
                let size = match &medium {
                    Some(m) => agent
                        .mount_medium(&m.drive, m.size, &root)
                        .and_then(|()| bind_files(&mut agent, &dir, &root, &bundle.files))
                        .map(|()| m.size),
                    None => agent.unpack(&root, rootfs, &bundle.files),
                }?;
                placed_ms = started.elapsed().as_millis() as u64;
                // Its volumes, its memory and CPU limits (a cgroup of its
                // own in the pod's VM) and its PID namespace.
                bind_volumes(&vm, &self.daemon, &mut agent, &root, &bundle.volumes)?;
                let asked = bundle.container_memory.is_some()
                    || bundle.container_cpu.is_some()
                    || bundle.own_pids;
                match agent.container(&root, bundle.container_memory, bundle.own_pids) {
                    // Only its stats need the declaration: without it
                    // they are the pod's.
                    Err(e) if !asked => {
                        tracing::warn!(task = %req.id, "the pod's VM keeps no cgroup for it: {e}");
                        Ok(size)
                    }
                    Ok(()) => bundle.container_cpu.map_or(Ok(size), |(quota, period)| {
                        agent
                            .container_cpu_max(&root, Some(quota), period)
                            .map(|()| size)
                    }),
                    Err(e) => Err(e),
                }
            });
        let guest_dir = GuestDir {
            path: dir,
            drive: medium.map(|m| m.drive),
        };
        let size = match made {
            Ok(size) => size,
            Err(e) => {
                self.remove_from_vm(&vm, &guest_dir);
                return Err(e.into());
            }
        };
        tracing::info!(
            task = %req.id, pod = %sandbox, bytes = size, drive = ?guest_dir.drive,
            root_ms = placed_ms, ms = started.elapsed().as_millis() as u64,
            "container root file system in the pod's VM"
        );
        let stdio = Stdio::of(&req.stdin, &req.stdout, &req.stderr, req.terminal);
        let pid = vm.sandbox.pid;
        let init = GuestProcess::new(
            bundle.workload.clone(),
            Place::Container(root),
            stdio,
            self.on_exit(&req.id, &req.id, Some(pid)),
        );
        self.add(req, bundle_dir, vm, Some(guest_dir), init);
        Ok(pid)
    }

    /// A medium holding `rootfs` in a free drive of the pod's VM, or None
    /// where its template has no empty drives or all hold media (the tree
    /// is then copied into the VM's memory).
    fn medium_for(
        &self,
        vm: &Vm,
        rootfs: &Path,
        task: &str,
    ) -> Result<Option<husk_types::MediumInfo>, ShimError> {
        if vm.drive_slots == 0 {
            return Ok(None);
        }
        match self.daemon.insert_medium(&vm.sandbox.id, rootfs) {
            Ok(m) => {
                tracing::info!(
                    task, drive = %m.drive, image = %m.image, build_ms = m.build_ms,
                    "the container's root file system is a medium"
                );
                Ok(Some(m))
            }
            Err(ApiClientError::Status { status: 429, .. }) => {
                tracing::warn!(
                    task,
                    slots = vm.drive_slots,
                    "every drive of the pod's VM holds a medium: the container's tree is copied \
                     into the VM's memory (give its template more --drive-slots)"
                );
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Removes what the shim put in the pod's VM for a container (its
    /// root, unmounted first, its files and volumes' binds) and frees its
    /// drive. A drive whose file system may still be mounted is kept.
    fn remove_from_vm(&self, vm: &Vm, dir: &GuestDir) {
        let removed = husk_agent_client::AgentClient::connect(&vm.agent, Duration::from_secs(60))
            .and_then(|mut agent| match agent.remove(&dir.path, true) {
                Err(husk_agent_client::ClientError::Agent {
                    kind: husk_protocol::ErrorKind::NotFound,
                    ..
                }) => Ok(()),
                other => other,
            });
        if let Err(e) = removed {
            tracing::warn!(sandbox = %vm.sandbox.id, "removing {} from the pod's VM: {e}", dir.path);
            return;
        }
        if let Some(drive) = &dir.drive {
            if let Err(e) = self.daemon.release_drive(&vm.sandbox.id, drive) {
                tracing::warn!(sandbox = %vm.sandbox.id, drive, "freeing the drive: {e}");
            }
        }
    }

    /// Records a created task and tells containerd.
    fn add(
        &self,
        req: &api::CreateTaskRequest,
        bundle_dir: &Path,
        vm: Arc<Vm>,
        guest_dir: Option<GuestDir>,
        init: Arc<GuestProcess>,
    ) {
        let pid = vm.sandbox.pid;
        self.lock().insert(
            req.id.clone(),
            Task {
                bundle: bundle_dir.to_owned(),
                vm,
                guest_dir,
                init,
                execs: HashMap::new(),
            },
        );
        self.publish(
            shim::protos::topics::TASK_CREATE_EVENT_TOPIC,
            Box::new(TaskCreate {
                container_id: req.id.clone(),
                bundle: req.bundle.clone(),
                rootfs: req.rootfs.clone(),
                io: MessageField::some(TaskIO {
                    stdin: req.stdin.clone(),
                    stdout: req.stdout.clone(),
                    stderr: req.stderr.clone(),
                    terminal: req.terminal,
                    ..Default::default()
                }),
                pid,
                ..Default::default()
            }),
        );
    }

    /// Publishes a process's exit event. `host_pid`: the pid containerd
    /// knows the task's own process by (the VMM's).
    fn on_exit(self: &Arc<Self>, task: &str, id: &str, host_pid: Option<u32>) -> process::OnExit {
        let me = Arc::downgrade(self);
        let (task, id) = (task.to_owned(), id.to_owned());
        Box::new(move |pid, exit: Exit| {
            if let Some(me) = me.upgrade() {
                me.publish(
                    shim::protos::topics::TASK_EXIT_EVENT_TOPIC,
                    Box::new(TaskExit {
                        container_id: task,
                        id,
                        pid: host_pid.unwrap_or(pid as u32),
                        exit_status: exit.status,
                        exited_at: MessageField::some(timestamp(exit.at)),
                        ..Default::default()
                    }),
                );
            }
        })
    }

    fn destroy(&self, sandbox: &str) {
        if let Err(e) = self.daemon.destroy_sandbox(sandbox) {
            tracing::warn!(sandbox, "destroying: {e}");
        }
    }

    fn delete(&self, id: &str, exec_id: &str) -> Result<api::DeleteResponse, ShimError> {
        let (process, _) = self.process(id, exec_id)?;
        let (started, exit) = process.state();
        if started && exit.is_none() {
            return Err(ShimError::Conflict(format!(
                "`{}` is still running: kill it first",
                if exec_id.is_empty() { id } else { exec_id }
            )));
        }
        let exit = exit.unwrap_or(Exit {
            status: 0,
            at: SystemTime::now(),
        });
        if !exec_id.is_empty() {
            if let Some(task) = self.lock().get_mut(id) {
                task.execs.remove(exec_id);
            }
            return Ok(api::DeleteResponse {
                pid: process.pid() as u32,
                exit_status: exit.status,
                exited_at: MessageField::some(timestamp(exit.at)),
                ..Default::default()
            });
        }
        let task = self.lock().remove(id);
        let Some(task) = task else {
            return Err(ShimError::NotFound(format!("no task `{id}`")));
        };
        match &task.guest_dir {
            None => self.destroy(&task.vm.sandbox.id),
            // A pod's container: its files go from the pod's VM.
            Some(dir) => self.remove_from_vm(&task.vm, dir),
        }
        unmount_rootfs(&task.bundle);
        let pid = task.vm.sandbox.pid;
        self.publish(
            shim::protos::topics::TASK_DELETE_EVENT_TOPIC,
            Box::new(TaskDelete {
                container_id: id.to_owned(),
                id: id.to_owned(),
                pid,
                exit_status: exit.status,
                exited_at: MessageField::some(timestamp(exit.at)),
                ..Default::default()
            }),
        );
        Ok(api::DeleteResponse {
            pid,
            exit_status: exit.status,
            exited_at: MessageField::some(timestamp(exit.at)),
            ..Default::default()
        })
    }

    fn pause(&self, id: &str, pause: bool) -> Result<(), ShimError> {
        let vm = self.with_task(id, |t| match t.owns_vm() {
            true => Ok(t.vm.clone()),
            false => Err(ShimError::Invalid(
                "a pod's container pauses with its pod (pause the pod's sandbox)".into(),
            )),
        })?;
        if pause {
            self.daemon.pause(&vm.sandbox.id)?;
        } else {
            self.daemon.resume(&vm.sandbox.id)?;
        }
        vm.paused.store(pause, std::sync::atomic::Ordering::SeqCst);
        if pause {
            self.publish(
                shim::protos::topics::TASK_PAUSED_EVENT_TOPIC,
                Box::new(TaskPaused {
                    container_id: id.to_owned(),
                    ..Default::default()
                }),
            );
        } else {
            self.publish(
                shim::protos::topics::TASK_RESUMED_EVENT_TOPIC,
                Box::new(TaskResumed {
                    container_id: id.to_owned(),
                    ..Default::default()
                }),
            );
        }
        Ok(())
    }

    /// New limits for a pod's container (the CRI's
    /// UpdateContainerResources): its memory limit and, where the update
    /// has a CPU section, its CPU limit: its cgroup's in the pod's VM. A
    /// VM's own size is set when it starts.
    fn update(&self, id: &str, resources: Option<&Any>) -> Result<(), ShimError> {
        let (agent, root) =
            self.with_task(id, |t| Ok((t.vm.agent.clone(), t.guest_dir.clone())))?;
        let Some(root) = root.map(|dir| container_root(&dir.path)) else {
            return Err(ShimError::Conflict(format!(
                "`{id}` is a VM, whose size is set when it starts: only a pod's container's \
                 memory limit changes"
            )));
        };
        let Some(resources) = resources else {
            return Ok(());
        };
        let resources: oci_spec::runtime::LinuxResources = serde_json::from_slice(&resources.value)
            .map_err(|e| ShimError::Invalid(format!("the update's resources: {e}")))?;
        let memory_max = bundle::memory_limit(&resources);
        let mut client = husk_agent_client::AgentClient::connect(&agent, Duration::from_secs(60))?;
        client.container_memory_max(&root, memory_max)?;
        tracing::info!(task = %id, ?memory_max, "the container's memory limit changed");
        if let Some(cpu) = resources.cpu() {
            let limit = bundle::cpu_limit(&resources);
            // Without a period, the kernel's default.
            let period = cpu.period().filter(|p| *p > 0).unwrap_or(100_000);
            client.container_cpu_max(&root, limit.map(|(quota, _)| quota), period)?;
            tracing::info!(task = %id, ?limit, "the container's CPU limit changed");
        }
        Ok(())
    }

    fn stats(&self, id: &str) -> Result<Any, ShimError> {
        let (pid, agent, root) = self.with_task(id, |t| {
            let root = t.guest_dir.as_ref().map(|dir| container_root(&dir.path));
            Ok((t.vm.sandbox.pid, t.vm.agent.clone(), root))
        })?;
        let mut client = husk_agent_client::AgentClient::connect(&agent, Duration::from_secs(60));
        // A pod's container: its cgroup in the pod's VM, when it has one;
        // else (and for a VM's task) the VM.
        let own = root.and_then(|root| match client.as_mut().ok()?.container_stats(&root) {
            Ok(usage) => Some(usage),
            Err(e) => {
                tracing::debug!(task = %id, "the pod's stats stand in for the container's: {e}");
                None
            }
        });
        let metrics = match own {
            Some(usage) => stats::container_metrics(&usage),
            None => {
                let guest = client.and_then(|mut c| c.health()).ok();
                stats::metrics(pid, guest.as_ref())
            }
        };
        shim::util::convert_to_any(Box::new(metrics))
            .map_err(|e| ShimError::Agent(format!("encoding the stats: {e}")))
    }
}

mod stats;

/// Mounts containerd's rootfs mounts (an image's snapshot) at the bundle's
/// `rootfs`.
fn mount_rootfs(
    bundle: &Path,
    mounts: &[shim::protos::types::mount::Mount],
) -> Result<PathBuf, ShimError> {
    let target = rootfs_mountpoint(bundle);
    std::fs::create_dir_all(&target).map_err(|e| ShimError::Io(target.display().to_string(), e))?;
    for m in mounts {
        shim::mount::mount_rootfs(
            Some(m.type_.as_str()),
            Some(m.source.as_str()),
            &m.options,
            &target,
        )
        .map_err(|e| ShimError::Invalid(format!("mounting the rootfs ({}): {e}", m.type_)))?;
    }
    let _ = std::fs::write(bundle.join(MOUNTED_MARK), b"");
    Ok(target)
}

fn status(started: bool, exit: Option<Exit>, paused: bool) -> api::Status {
    match (started, exit, paused) {
        (_, Some(_), _) => api::Status::STOPPED,
        (_, None, true) => api::Status::PAUSED,
        (true, None, false) => api::Status::RUNNING,
        (false, None, false) => api::Status::CREATED,
    }
}

impl shim::Task for TaskService {
    fn connect(
        &self,
        _ctx: &TtrpcContext,
        _req: api::ConnectRequest,
    ) -> TtrpcResult<api::ConnectResponse> {
        let task_pid = self
            .inner
            .lock()
            .values()
            .next()
            .map_or(0, |t| t.vm.sandbox.pid);
        Ok(api::ConnectResponse {
            shim_pid: std::process::id(),
            task_pid,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            ..Default::default()
        })
    }

    fn create(
        &self,
        _ctx: &TtrpcContext,
        req: api::CreateTaskRequest,
    ) -> TtrpcResult<api::CreateTaskResponse> {
        let pid = self.inner.create(&req).map_err(|e| {
            tracing::warn!(task = %req.id, "create failed: {e}");
            e
        })?;
        Ok(api::CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    fn start(
        &self,
        _ctx: &TtrpcContext,
        req: api::StartRequest,
    ) -> TtrpcResult<api::StartResponse> {
        let (process, agent) = self.inner.process(&req.id, &req.exec_id)?;
        let guest_pid = process.start(&agent)?;
        let pid = if req.exec_id.is_empty() {
            let pid = self
                .inner
                .lock()
                .get(&req.id)
                .map_or(0, |t| t.vm.sandbox.pid);
            self.inner.publish(
                shim::protos::topics::TASK_START_EVENT_TOPIC,
                Box::new(TaskStart {
                    container_id: req.id.clone(),
                    pid,
                    ..Default::default()
                }),
            );
            pid
        } else {
            self.inner.publish(
                shim::protos::topics::TASK_EXEC_STARTED_EVENT_TOPIC,
                Box::new(TaskExecStarted {
                    container_id: req.id.clone(),
                    exec_id: req.exec_id.clone(),
                    pid: guest_pid as u32,
                    ..Default::default()
                }),
            );
            guest_pid as u32
        };
        Ok(api::StartResponse {
            pid,
            ..Default::default()
        })
    }

    fn state(
        &self,
        _ctx: &TtrpcContext,
        req: api::StateRequest,
    ) -> TtrpcResult<api::StateResponse> {
        let (process, _) = self.inner.process(&req.id, &req.exec_id)?;
        let tasks = self.inner.lock();
        let Some(task) = tasks.get(&req.id) else {
            return Err(ShimError::NotFound(format!("no task `{}`", req.id)).into());
        };
        let (started, exit) = process.state();
        let pid = if req.exec_id.is_empty() {
            task.vm.sandbox.pid
        } else {
            process.pid() as u32
        };
        Ok(api::StateResponse {
            id: req.id.clone(),
            bundle: task.bundle.display().to_string(),
            pid,
            status: status(started, exit, task.paused()).into(),
            stdin: process.stdio.stdin.clone(),
            stdout: process.stdio.stdout.clone(),
            stderr: process.stdio.stderr.clone(),
            terminal: process.stdio.terminal,
            exit_status: exit.map_or(0, |e| e.status),
            exited_at: exit.map_or(MessageField::none(), |e| {
                MessageField::some(timestamp(e.at))
            }),
            exec_id: req.exec_id.clone(),
            ..Default::default()
        })
    }

    fn wait(&self, _ctx: &TtrpcContext, req: api::WaitRequest) -> TtrpcResult<api::WaitResponse> {
        let (process, _) = self.inner.process(&req.id, &req.exec_id)?;
        let exit = process.wait();
        Ok(api::WaitResponse {
            exit_status: exit.status,
            exited_at: MessageField::some(timestamp(exit.at)),
            ..Default::default()
        })
    }

    fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        let (process, agent) = self.inner.process(&req.id, &req.exec_id)?;
        if req.all && req.signal == libc::SIGKILL as u32 && req.exec_id.is_empty() {
            // Everything the task started, detached or not (a task with a VM
            // of its own; a pod's container ends with its own process's
            // cgroup).
            let owned = self
                .inner
                .lock()
                .get(&req.id)
                .filter(|t| t.owns_vm())
                .map(|t| t.vm.sandbox.id.clone());
            if let Some(sandbox) = owned {
                self.inner
                    .daemon
                    .kill_all(&sandbox)
                    .map_err(ShimError::from)?;
            }
        }
        match process.signal(&agent, req.signal) {
            // A kill of everything may have ended it already.
            Err(ShimError::NotFound(_)) if req.all => {}
            other => other?,
        }
        Ok(api::Empty::default())
    }

    fn exec(&self, _ctx: &TtrpcContext, req: api::ExecProcessRequest) -> TtrpcResult<api::Empty> {
        let spec = req.spec.as_ref().map(|a| a.value.as_slice()).unwrap_or(&[]);
        let process: oci_spec::runtime::Process = serde_json::from_slice(spec)
            .map_err(|e| ShimError::Invalid(format!("the exec's process spec: {e}")))?;
        let request = bundle::workload(&process)?;
        let on_exit = self.inner.on_exit(&req.id, &req.exec_id, None);
        let stdio = Stdio::of(&req.stdin, &req.stdout, &req.stderr, req.terminal);
        self.inner.with_task(&req.id, |task| {
            if task.execs.contains_key(&req.exec_id) {
                return Err(ShimError::Conflict(format!(
                    "exec `{}` exists",
                    req.exec_id
                )));
            }
            let place = task.place();
            task.execs.insert(
                req.exec_id.clone(),
                GuestProcess::new(request, place, stdio, on_exit),
            );
            Ok(())
        })?;
        self.inner.publish(
            shim::protos::topics::TASK_EXEC_ADDED_EVENT_TOPIC,
            Box::new(TaskExecAdded {
                container_id: req.id.clone(),
                exec_id: req.exec_id.clone(),
                ..Default::default()
            }),
        );
        Ok(api::Empty::default())
    }

    fn resize_pty(
        &self,
        _ctx: &TtrpcContext,
        req: api::ResizePtyRequest,
    ) -> TtrpcResult<api::Empty> {
        let (process, _) = self.inner.process(&req.id, &req.exec_id)?;
        let clamp = |n: u32| u16::try_from(n).unwrap_or(u16::MAX);
        process.resize(clamp(req.height), clamp(req.width))?;
        Ok(api::Empty::default())
    }

    fn close_io(&self, _ctx: &TtrpcContext, req: api::CloseIORequest) -> TtrpcResult<api::Empty> {
        let (process, _) = self.inner.process(&req.id, &req.exec_id)?;
        if req.stdin {
            process.close_stdin()?;
        }
        Ok(api::Empty::default())
    }

    fn pause(&self, _ctx: &TtrpcContext, req: api::PauseRequest) -> TtrpcResult<api::Empty> {
        self.inner.pause(&req.id, true)?;
        Ok(api::Empty::default())
    }

    fn resume(&self, _ctx: &TtrpcContext, req: api::ResumeRequest) -> TtrpcResult<api::Empty> {
        self.inner.pause(&req.id, false)?;
        Ok(api::Empty::default())
    }

    fn pids(&self, _ctx: &TtrpcContext, req: api::PidsRequest) -> TtrpcResult<api::PidsResponse> {
        let pids: Vec<u32> = self.inner.with_task(&req.id, |task| {
            Ok(std::iter::once(task.vm.sandbox.pid)
                .chain(task.execs.values().map(|p| p.pid() as u32))
                .filter(|p| *p != 0)
                .collect())
        })?;
        let processes = pids
            .into_iter()
            .map(|pid| shim::protos::types::task::ProcessInfo {
                pid,
                ..Default::default()
            })
            .collect();
        Ok(api::PidsResponse {
            processes,
            ..Default::default()
        })
    }

    fn stats(
        &self,
        _ctx: &TtrpcContext,
        req: api::StatsRequest,
    ) -> TtrpcResult<api::StatsResponse> {
        let stats = self.inner.stats(&req.id)?;
        Ok(api::StatsResponse {
            stats: MessageField::some(stats),
            ..Default::default()
        })
    }

    fn update(&self, _ctx: &TtrpcContext, req: api::UpdateTaskRequest) -> TtrpcResult<api::Empty> {
        self.inner.update(&req.id, req.resources.as_ref())?;
        Ok(api::Empty::default())
    }

    fn delete(
        &self,
        _ctx: &TtrpcContext,
        req: api::DeleteRequest,
    ) -> TtrpcResult<api::DeleteResponse> {
        Ok(self.inner.delete(&req.id, &req.exec_id)?)
    }

    fn shutdown(&self, _ctx: &TtrpcContext, _req: api::ShutdownRequest) -> TtrpcResult<api::Empty> {
        if self.inner.lock().is_empty() {
            self.inner.exit.signal();
        }
        Ok(api::Empty::default())
    }
}
