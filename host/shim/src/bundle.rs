//! What a containerd bundle asks for, in husk's terms: the workload (the
//! OCI process: argv, environment, working directory, user, terminal), the
//! VM's size (from the spec's memory and CPU limits), and where its file
//! system comes from: a husk template named by the `io.husk.template`
//! annotation (a pooled clone, no boot), or the bundle's root file system,
//! made into a template of its own that is cached by the tree's content
//! hash (its first task boots it once; later tasks restore it).
//!
//! The bundle is input from containerd's client: a workload that cannot
//! run (no argv, a program the root file system does not have) is refused
//! here, before any VM exists.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use husk_protocol::{ExecRequest, User, WindowSize};
use oci_spec::runtime::{Process, Spec};
use sha2::{Digest, Sha256};

use super::ShimError;

/// The annotation that names a husk template to clone instead of the
/// bundle's root file system (`ctr run --annotation io.husk.template=NAME`).
pub const TEMPLATE_ANNOTATION: &str = "io.husk.template";

/// The PATH a workload gets when its spec sets none (runc's default).
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The smallest VM a memory limit may ask for: the guest kernel and agent
/// need about 40 MiB before any workload runs.
pub const MIN_MEM_MIB: u32 = 64;

/// Most vCPUs a CPU limit may ask for.
pub const MAX_VCPUS: u8 = 32;

/// The CRI's annotation saying whether a container is a pod's sandbox
/// (`sandbox`) or one of its containers (`container`).
pub const CONTAINER_TYPE_ANNOTATION: &str = "io.kubernetes.cri.container-type";
/// The CRI's annotation naming the pod sandbox a container belongs to.
pub const SANDBOX_ID_ANNOTATION: &str = "io.kubernetes.cri.sandbox-id";

/// The template a pod's VM is a clone of when the pod names none.
pub const DEFAULT_POD_TEMPLATE: &str = "base";

/// The CRI's annotations on a pod's sandbox container with the sum of its
/// containers' limits (the kubelet's `LinuxPodSandboxConfig.resources`):
/// memory in bytes, and the CPU quota per period (both 0 when unset).
pub const SANDBOX_MEMORY_ANNOTATION: &str = "io.kubernetes.cri.sandbox-memory";
pub const SANDBOX_CPU_QUOTA_ANNOTATION: &str = "io.kubernetes.cri.sandbox-cpu-quota";
pub const SANDBOX_CPU_PERIOD_ANNOTATION: &str = "io.kubernetes.cri.sandbox-cpu-period";

/// What a pod's VM holds beside its containers' limits: the guest kernel,
/// the agent, and the containers' root file systems (unpacked into the
/// guest's memory).
pub const POD_OVERHEAD_MIB: u32 = 64;

/// A pod's VM grows in steps of this many MiB, so that pods of about the
/// same size share a template.
const POD_MEM_STEP_MIB: u32 = 64;

/// What a pod's containers are limited to, together (from the CRI's
/// sandbox annotations).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PodResources {
    /// The sum of the containers' memory limits, in bytes.
    pub memory: Option<u64>,
    /// The sum of their CPU limits, as vCPUs (rounded up).
    pub vcpus: Option<u8>,
    /// Whether the VM may be a larger copy of its template (the pod named
    /// none: the base template is built again at the pod's size); a
    /// template the pod names is used as it is, or refused if too small.
    pub may_grow: bool,
}

impl PodResources {
    fn from_annotations(
        annotations: &std::collections::HashMap<String, String>,
        may_grow: bool,
    ) -> Result<PodResources, ShimError> {
        let number = |key: &str| -> Result<i64, ShimError> {
            annotations.get(key).map_or(Ok(0), |v| {
                v.trim().parse().map_err(|_| {
                    ShimError::Invalid(format!("annotation `{key}`: `{v}` is not a number"))
                })
            })
        };
        let memory = number(SANDBOX_MEMORY_ANNOTATION)?;
        let (quota, period) = (
            number(SANDBOX_CPU_QUOTA_ANNOTATION)?,
            number(SANDBOX_CPU_PERIOD_ANNOTATION)?,
        );
        Ok(PodResources {
            memory: u64::try_from(memory).ok().filter(|m| *m > 0),
            vcpus: (quota > 0 && period > 0).then(|| vcpus_for(quota as u64, period as u64)),
            may_grow,
        })
    }

    /// The VM size (vCPUs, MiB) the pod needs when a template of
    /// `template` (vCPUs, MiB) is too small for it: its limits plus
    /// [`POD_OVERHEAD_MIB`], rounded up to [`POD_MEM_STEP_MIB`]. `None`
    /// when the template holds it.
    pub fn larger_than(&self, template: (u8, u32)) -> Option<(u8, u32)> {
        let mem = self.memory.map_or(0, |bytes| {
            let mib = u32::try_from(bytes.div_ceil(1 << 20)).unwrap_or(u32::MAX);
            mib.saturating_add(POD_OVERHEAD_MIB)
                .div_ceil(POD_MEM_STEP_MIB)
                .saturating_mul(POD_MEM_STEP_MIB)
        });
        let vcpus = self.vcpus.unwrap_or(0);
        (mem > template.1 || vcpus > template.0)
            .then(|| (vcpus.max(template.0), mem.max(template.1)))
    }
}

/// A task's place in a Kubernetes pod (from the CRI's annotations).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pod {
    /// The pod's sandbox (pause) container: its task is the pod's VM.
    Sandbox,
    /// A container of the pod whose sandbox is `sandbox`: it runs in that
    /// VM with its own root file system.
    Container { sandbox: String },
}

/// The pod role the annotations give, if any.
pub fn pod_of(annotations: &std::collections::HashMap<String, String>) -> Option<Pod> {
    match annotations
        .get(CONTAINER_TYPE_ANNOTATION)
        .map(String::as_str)
    {
        Some("sandbox") => Some(Pod::Sandbox),
        Some("container") => annotations
            .get(SANDBOX_ID_ANNOTATION)
            .map(|id| Pod::Container {
                sandbox: id.clone(),
            }),
        _ => None,
    }
}

/// The shim a task is served by: its pod's (the sandbox id) or its own.
/// Read from `config.json` in the bundle `dir`.
pub fn grouping(dir: &Path, id: &str) -> String {
    Spec::load(dir.join("config.json"))
        .ok()
        .and_then(|spec| spec.annotations().clone())
        .and_then(|a| a.get(SANDBOX_ID_ANNOTATION).cloned())
        .filter(|sandbox| !sandbox.is_empty())
        .unwrap_or_else(|| id.to_owned())
}

/// Where a task's file system comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A husk template (by annotation): a clone of its snapshot.
    Template(String),
    /// The bundle's root file system directory.
    Rootfs(PathBuf),
}

/// A bundle, read and checked.
#[derive(Debug, Clone)]
pub struct Bundle {
    pub workload: ExecRequest,
    pub source: Source,
    /// From `linux.resources.memory.limit`; the template's size if unset.
    pub mem_mib: Option<u32>,
    /// From `linux.resources.cpu` quota / period, rounded up.
    pub vcpus: Option<u8>,
    /// Its place in a pod, when the CRI runs it.
    pub pod: Option<Pod>,
    /// A pod container's memory limit, in bytes (a cgroup in the pod's
    /// VM).
    pub container_memory: Option<u64>,
    /// A pod container's CPU limit: microseconds of CPU time per period
    /// (its cgroup's `cpu.max` in the pod's VM).
    pub container_cpu: Option<(u64, u64)>,
    /// Whether a pod container has a PID namespace of its own (the spec
    /// asks for a new one: Kubernetes' default), rather than the pod's.
    pub own_pids: bool,
    /// The spec's bind mounts of single files (the CRI's `/etc/hosts`,
    /// `/etc/resolv.conf`, `/etc/hostname`), as (name in the root, host
    /// file): a pod's container gets copies as it is created.
    pub files: Vec<(String, PathBuf)>,
    /// The spec's directory bind mounts (a pod's container's volumes).
    pub volumes: Vec<Volume>,
    /// A pod's sandbox: its containers' limits, which size its VM.
    pub pod_resources: Option<PodResources>,
    /// A pod's sandbox: the pod's network namespace, which the CRI made
    /// and its CNI plugins configured (none: the pod is on the node's
    /// network, `hostNetwork`).
    pub netns: Option<PathBuf>,
}

/// Largest file a bind mount brings into a pod's container.
const MAX_MOUNTED_FILE: u64 = 1 << 20;

/// A directory bind mount of a pod's container (a volume: emptyDir,
/// configMap, secret, the service account token): its host directory is
/// copied into the pod's VM once, and bound into each container that
/// mounts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    pub source: PathBuf,
    /// Where in the container's root, relative to it.
    pub target: String,
    pub readonly: bool,
}

/// The spec's bind mounts: regular files of at most [`MAX_MOUNTED_FILE`]
/// bytes, named relative to the root, and directories (volumes); what the
/// guest provides (`/proc`, `/dev`, `/sys`) is left out, and what is
/// neither is logged.
fn bind_mounts(spec: &Spec) -> (Vec<(String, PathBuf)>, Vec<Volume>) {
    let (mut files, mut volumes) = (Vec::new(), Vec::new());
    for m in spec.mounts().as_deref().unwrap_or_default() {
        let options = m.options().as_deref().unwrap_or_default();
        let bind = m.typ().as_deref() == Some("bind")
            || options.iter().any(|o| o == "bind" || o == "rbind");
        let Some(source) = m.source().as_ref().filter(|_| bind) else {
            continue;
        };
        let parts: Option<Vec<&str>> = m
            .destination()
            .components()
            .filter(|c| *c != Component::RootDir)
            .map(|c| match c {
                Component::Normal(p) => p.to_str(),
                _ => None,
            })
            .collect();
        let Some(parts) = parts.filter(|p| !p.is_empty()) else {
            continue;
        };
        if ["proc", "dev", "sys"].contains(&parts[0]) {
            continue;
        }
        match std::fs::metadata(source) {
            Ok(meta) if meta.is_file() && meta.len() <= MAX_MOUNTED_FILE => {
                files.push((parts.join("/"), source.clone()));
            }
            Ok(meta) if meta.is_dir() => volumes.push(Volume {
                source: source.clone(),
                target: parts.join("/"),
                readonly: options.iter().any(|o| o == "ro"),
            }),
            _ => tracing::warn!(
                source = %source.display(),
                destination = %m.destination().display(),
                "a bind mount that is neither a directory nor a file of at most 1 MiB is not carried into the pod's VM"
            ),
        }
    }
    (files, volumes)
}

/// The network namespace the spec joins (`linux.namespaces`, type
/// `network` with a path): a CRI pod's. None for a new one or none.
fn network_namespace(spec: &Spec) -> Option<PathBuf> {
    spec.linux()
        .as_ref()?
        .namespaces()
        .as_ref()?
        .iter()
        .find(|ns| ns.typ() == oci_spec::runtime::LinuxNamespaceType::Network)?
        .path()
        .clone()
}

impl Bundle {
    /// Reads `config.json` in `dir`. `rootfs` is where the root file system
    /// is (the spec's `root.path`, or where the shim mounted containerd's
    /// rootfs mounts).
    pub fn load(dir: &Path, rootfs: Option<&Path>) -> Result<Bundle, ShimError> {
        let config = dir.join("config.json");
        let spec = Spec::load(&config)
            .map_err(|e| ShimError::Invalid(format!("{}: {e}", config.display())))?;
        let process = spec
            .process()
            .as_ref()
            .ok_or_else(|| ShimError::Invalid("the spec has no `process` to run".into()))?;
        let workload = workload(process)?;
        let annotations = spec.annotations().clone().unwrap_or_default();
        let pod = pod_of(&annotations);
        let pod_resources = match &pod {
            Some(Pod::Sandbox) => Some(PodResources::from_annotations(
                &annotations,
                !annotations.contains_key(TEMPLATE_ANNOTATION),
            )?),
            _ => None,
        };
        let template = match (&pod, annotations.get(TEMPLATE_ANNOTATION)) {
            // A pod's VM: the pod's template, or the base one; the pause
            // image is not used.
            (Some(Pod::Sandbox), None) => Some(DEFAULT_POD_TEMPLATE.to_owned()),
            // A container of a pod: its own root file system, always.
            (Some(Pod::Container { .. }), _) => None,
            (_, named) => named.cloned(),
        };
        let source = match template {
            Some(name) if name.is_empty() => {
                return Err(ShimError::Invalid(format!(
                    "the `{TEMPLATE_ANNOTATION}` annotation is empty: name a husk template"
                )))
            }
            Some(name) => Source::Template(name),
            None => {
                let root =
                    match rootfs {
                        Some(r) => r.to_owned(),
                        None => {
                            let path = spec.root().as_ref().map(|r| r.path().clone()).ok_or_else(
                                || ShimError::Invalid("the spec has no `root` file system".into()),
                            )?;
                            if path.is_absolute() {
                                path
                            } else {
                                dir.join(path)
                            }
                        }
                    };
                check_executable(&root, &workload)?;
                Source::Rootfs(root)
            }
        };
        let resources = spec.linux().as_ref().and_then(|l| l.resources().clone());
        // A pod's container runs in the pod's VM: its limits do not size
        // one.
        let sizes_a_vm = !matches!(pod, Some(Pod::Container { .. }));
        let memory_limit = resources.as_ref().and_then(memory_limit);
        let mem_mib = memory_limit
            .filter(|_| sizes_a_vm)
            .map(mem_mib_for)
            .transpose()?;
        let cpu_limit = resources.as_ref().and_then(cpu_limit);
        // A pod's container: the spec's mounts come into the pod's VM.
        let netns = match pod {
            Some(Pod::Sandbox) => network_namespace(&spec),
            _ => None,
        };
        let (files, volumes) = match sizes_a_vm {
            true => Default::default(),
            false => bind_mounts(&spec),
        };
        Ok(Bundle {
            workload,
            source,
            mem_mib,
            vcpus: cpu_limit
                .filter(|_| sizes_a_vm)
                .map(|(quota, period)| vcpus_for(quota, period)),
            own_pids: !sizes_a_vm
                && spec
                    .linux()
                    .as_ref()
                    .and_then(|l| l.namespaces().as_ref())
                    .is_some_and(|n| {
                        n.iter().any(|ns| {
                            ns.typ() == oci_spec::runtime::LinuxNamespaceType::Pid
                                && ns.path().is_none()
                        })
                    }),
            container_memory: memory_limit.filter(|_| !sizes_a_vm),
            container_cpu: cpu_limit.filter(|_| !sizes_a_vm),
            files,
            volumes,
            pod,
            pod_resources,
            netns,
        })
    }
}

/// A pod's container's memory limit in bytes, where `resources` set one.
pub fn memory_limit(resources: &oci_spec::runtime::LinuxResources) -> Option<u64> {
    resources
        .memory()
        .as_ref()
        .and_then(|m| m.limit())
        .and_then(|l| u64::try_from(l).ok())
        .filter(|l| *l > 0)
}

/// A pod's container's CPU limit (quota and period, in microseconds),
/// where `resources` set one.
pub fn cpu_limit(resources: &oci_spec::runtime::LinuxResources) -> Option<(u64, u64)> {
    let cpu = resources.cpu().as_ref()?;
    let quota = u64::try_from(cpu.quota()?).ok().filter(|q| *q > 0)?;
    Some((quota, cpu.period().filter(|p| *p > 0)?))
}

/// A memory limit in bytes as a VM size in MiB (rounded up).
fn mem_mib_for(limit: u64) -> Result<u32, ShimError> {
    let mib = u32::try_from(limit.div_ceil(1 << 20)).unwrap_or(u32::MAX);
    if mib < MIN_MEM_MIB {
        return Err(ShimError::Invalid(format!(
            "a memory limit of {mib} MiB is below the {MIN_MEM_MIB} MiB a husk VM needs"
        )));
    }
    Ok(mib)
}

/// A CPU quota per period as vCPUs (rounded up, at most [`MAX_VCPUS`]).
fn vcpus_for(quota: u64, period: u64) -> u8 {
    u8::try_from(quota.div_ceil(period)).map_or(MAX_VCPUS, |n| n.clamp(1, MAX_VCPUS))
}

/// The agent's request for an OCI process (the task's or an exec's).
pub fn workload(process: &Process) -> Result<ExecRequest, ShimError> {
    let argv = process.args().clone().unwrap_or_default();
    if argv.is_empty() || argv[0].is_empty() {
        return Err(ShimError::Invalid(
            "the process has no `args`: name the program to run".into(),
        ));
    }
    let env = process
        .env()
        .iter()
        .flatten()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let user = process.user();
    let pty = process.terminal().unwrap_or(false).then(|| {
        let size = process.console_size();
        WindowSize {
            rows: size.as_ref().map_or(24, |s| s.height() as u16),
            cols: size.as_ref().map_or(80, |s| s.width() as u16),
        }
    });
    Ok(ExecRequest {
        argv,
        env,
        cwd: Some(process.cwd().display().to_string()),
        user: Some(User {
            uid: user.uid(),
            gid: user.gid(),
        }),
        stdin_open: true,
        pty,
        ..ExecRequest::default()
    })
}

/// Refuses a workload whose program `root` does not have as an executable
/// file (looked up in the workload's PATH when it names no directory), so
/// that `ctr run` fails at once with the reason instead of after a boot.
pub fn check_executable(root: &Path, workload: &ExecRequest) -> Result<(), ShimError> {
    if !root.is_dir() {
        return Err(ShimError::Invalid(format!(
            "the root file system {} is not a directory",
            root.display()
        )));
    }
    let program = &workload.argv[0];
    let candidates: Vec<String> = if program.contains('/') {
        let cwd = workload.cwd.as_deref().unwrap_or("/");
        vec![if program.starts_with('/') {
            program.clone()
        } else {
            format!("{cwd}/{program}")
        }]
    } else {
        let path = workload
            .env
            .iter()
            .find(|(k, _)| k == "PATH")
            .map_or(DEFAULT_PATH, |(_, v)| v.as_str());
        path.split(':')
            .filter(|d| !d.is_empty())
            .map(|d| format!("{d}/{program}"))
            .collect()
    };
    let found = candidates.iter().any(|c| {
        resolve_in(root, c).is_some_and(|p| {
            std::fs::metadata(&p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    });
    if found {
        Ok(())
    } else {
        Err(ShimError::Invalid(format!(
            "the root file system {} has no executable `{program}` (looked for {})",
            root.display(),
            candidates.join(", ")
        )))
    }
}

/// Where guest path `path` is under `root`, following symbolic links as
/// the guest would (an absolute target is relative to `root`; `..` stops
/// at `root`). None for a dangling path or a loop.
fn resolve_in(root: &Path, path: &str) -> Option<PathBuf> {
    let mut todo: Vec<String> = path
        .split('/')
        .rev()
        .filter(|c| !c.is_empty())
        .map(str::to_owned)
        .collect();
    let mut at: Vec<String> = Vec::new();
    let mut links = 0;
    while let Some(part) = todo.pop() {
        match part.as_str() {
            "." => continue,
            ".." => {
                at.pop();
                continue;
            }
            _ => {}
        }
        let host = root.join(at.join("/")).join(&part);
        let meta = std::fs::symlink_metadata(&host).ok()?;
        if meta.file_type().is_symlink() {
            links += 1;
            if links > 40 {
                return None;
            }
            let target = std::fs::read_link(&host).ok()?;
            if target.is_absolute() {
                at.clear();
            }
            todo.extend(target.components().rev().filter_map(|c| match c {
                Component::Normal(n) => Some(n.to_string_lossy().into_owned()),
                Component::ParentDir => Some("..".to_owned()),
                _ => None,
            }));
        } else {
            at.push(part);
        }
    }
    Some(root.join(at.join("/")))
}

/// A digest of the tree under `root`: every entry's path, type, mode,
/// owner and content (a link's target), in name order. Two bundles with
/// the same digest get the same template.
pub fn rootfs_digest(root: &Path) -> Result<String, ShimError> {
    let mut hash = Sha256::new();
    digest_dir(root, Path::new(""), &mut hash)?;
    Ok(hex(&hash.finalize()))
}

/// `bytes` in lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn digest_dir(root: &Path, rel: &Path, hash: &mut Sha256) -> Result<(), ShimError> {
    let dir = root.join(rel);
    let io = |e| ShimError::Io(dir.display().to_string(), e);
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .map_err(io)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .map_err(io)?;
    names.sort();
    for name in names {
        let rel = rel.join(&name);
        let path = root.join(&rel);
        let io = |e| ShimError::Io(path.display().to_string(), e);
        let meta = std::fs::symlink_metadata(&path).map_err(io)?;
        hash.update(rel.as_os_str().as_encoded_bytes());
        hash.update([0]);
        hash.update(meta.mode().to_le_bytes());
        hash.update(meta.uid().to_le_bytes());
        hash.update(meta.gid().to_le_bytes());
        let kind = meta.file_type();
        if kind.is_symlink() {
            let target = std::fs::read_link(&path).map_err(io)?;
            hash.update(target.as_os_str().as_encoded_bytes());
        } else if kind.is_dir() {
            digest_dir(root, &rel, hash)?;
        } else if kind.is_file() {
            hash.update(meta.len().to_le_bytes());
            let mut file = std::fs::File::open(&path).map_err(io)?;
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let n = file.read(&mut buf).map_err(io)?;
                if n == 0 {
                    break;
                }
                hash.update(&buf[..n]);
            }
        } else {
            hash.update(meta.rdev().to_le_bytes());
        }
        hash.update([0xff]);
    }
    Ok(())
}

/// The template a root file system of `digest` becomes, for a VM of this
/// size: `oci-<16 hex>-<mem>m-<vcpus>c`.
pub fn template_name(digest: &str, mem_mib: u32, vcpus: u8) -> String {
    format!(
        "oci-{}-{mem_mib}m-{vcpus}c",
        &digest[..16.min(digest.len())]
    )
}

/// The labels a task's sandbox carries, so that the shim's `delete` (run
/// after a shim died) finds it: `io.containerd.task=<namespace>/<id>`, and
/// the containerd it belongs to (`io.containerd.address`: two containerds
/// may share one husk daemon and a task id).
pub fn task_labels(namespace: &str, id: &str, containerd: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (TASK_LABEL.to_owned(), format!("{namespace}/{id}")),
        (CONTAINERD_LABEL.to_owned(), containerd.to_owned()),
    ])
}

/// See [`task_labels`].
pub const TASK_LABEL: &str = "io.containerd.task";
/// See [`task_labels`].
pub const CONTAINERD_LABEL: &str = "io.containerd.address";

#[cfg(test)]
mod tests {
    use super::*;

    fn tree() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "husk-bundle-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("bin")).expect("test setup");
        std::fs::create_dir_all(dir.join("usr/bin")).expect("test setup");
        std::fs::write(dir.join("bin/busybox"), b"\x7fELF").expect("test setup");
        std::fs::set_permissions(dir.join("bin/busybox"), PermissionsExt::from_mode(0o755))
            .expect("test setup");
        std::fs::write(dir.join("bin/data"), b"not a program").expect("test setup");
        std::os::unix::fs::symlink("/bin/busybox", dir.join("usr/bin/sh")).expect("test setup");
        std::os::unix::fs::symlink("../../bin/busybox", dir.join("usr/bin/ls"))
            .expect("test setup");
        std::os::unix::fs::symlink("/nowhere", dir.join("usr/bin/gone")).expect("test setup");
        std::os::unix::fs::symlink("/usr/bin/loop", dir.join("usr/bin/loop")).expect("test setup");
        dir
    }

    fn run(argv: &[&str]) -> ExecRequest {
        ExecRequest {
            argv: argv.iter().map(|s| (*s).to_owned()).collect(),
            cwd: Some("/".into()),
            ..ExecRequest::default()
        }
    }

    #[test]
    fn programs_are_found_through_path_and_links_inside_the_root() {
        let root = tree();
        for ok in ["busybox", "/bin/busybox", "sh", "ls", "/usr/bin/sh"] {
            check_executable(&root, &run(&[ok])).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in [
            "data",
            "/bin/data",
            "gone",
            "loop",
            "missing",
            "/etc/passwd",
        ] {
            let err = check_executable(&root, &run(&[bad]))
                .expect_err("refused")
                .to_string();
            assert!(err.contains("has no executable"), "{bad}: {err}");
        }
        std::fs::remove_dir_all(root).expect("test setup");
    }

    #[test]
    fn a_link_cannot_lead_out_of_the_root() {
        let root = tree();
        // `/bin/true` exists on the host, but not under the root.
        std::os::unix::fs::symlink("../../../../../../bin/true", root.join("bin/out"))
            .expect("test setup");
        let err = check_executable(&root, &run(&["/bin/out"])).expect_err("refused");
        assert!(err.to_string().contains("has no executable"), "{err}");
        std::fs::remove_dir_all(root).expect("test setup");
    }

    #[test]
    fn the_digest_follows_content_names_and_modes() {
        let root = tree();
        let first = rootfs_digest(&root).expect("test setup");
        assert_eq!(first, rootfs_digest(&root).expect("test setup"));
        std::fs::write(root.join("bin/data"), b"not a program!").expect("test setup");
        let second = rootfs_digest(&root).expect("test setup");
        assert_ne!(first, second);
        std::fs::set_permissions(root.join("bin/data"), PermissionsExt::from_mode(0o600))
            .expect("test setup");
        assert_ne!(second, rootfs_digest(&root).expect("test setup"));
        std::fs::remove_dir_all(root).expect("test setup");
        let name = template_name(&first, 128, 1);
        assert!(
            name.starts_with("oci-") && name.ends_with("-128m-1c"),
            "{name}"
        );
        husk_types::check_template_name(&name).expect("test setup");
    }

    #[test]
    fn limits_become_the_vm_size() {
        assert_eq!(mem_mib_for(256 << 20).expect("test setup"), 256);
        assert_eq!(mem_mib_for((256 << 20) + 1).expect("test setup"), 257);
        assert!(mem_mib_for(32 << 20)
            .expect_err("refused")
            .to_string()
            .contains("below"));
        assert_eq!(vcpus_for(150_000, 100_000), 2);
        assert_eq!(vcpus_for(50_000, 100_000), 1);
        assert_eq!(vcpus_for(u64::MAX, 1), MAX_VCPUS);
    }

    #[test]
    fn a_cpu_limit_needs_a_quota_and_a_period() {
        let resources = |quota: Option<i64>, period: Option<u64>| {
            let mut cpu = oci_spec::runtime::LinuxCpu::default();
            cpu.set_quota(quota).set_period(period);
            let mut r = oci_spec::runtime::LinuxResources::default();
            r.set_cpu(Some(cpu));
            r
        };
        assert_eq!(
            cpu_limit(&resources(Some(80_000), Some(100_000))),
            Some((80_000, 100_000))
        );
        // The CRI's "no limit": a quota of 0 or -1.
        assert_eq!(cpu_limit(&resources(Some(0), Some(100_000))), None);
        assert_eq!(cpu_limit(&resources(Some(-1), Some(100_000))), None);
        assert_eq!(cpu_limit(&resources(Some(80_000), None)), None);
        assert_eq!(
            cpu_limit(&oci_spec::runtime::LinuxResources::default()),
            None
        );
    }

    #[test]
    fn a_pods_limits_and_overhead_size_its_vm_when_the_template_is_smaller() {
        let annotations = |memory: &str, quota: &str| {
            [
                (SANDBOX_MEMORY_ANNOTATION, memory),
                (SANDBOX_CPU_QUOTA_ANNOTATION, quota),
                (SANDBOX_CPU_PERIOD_ANNOTATION, "100000"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
        };
        let pod = |memory, quota| {
            PodResources::from_annotations(&annotations(memory, quota), true).expect("test setup")
        };
        // No limits (the kubelet's zeros): the template as it is.
        assert_eq!(
            pod("0", "0"),
            PodResources {
                may_grow: true,
                ..Default::default()
            }
        );
        assert_eq!(pod("0", "0").larger_than((1, 128)), None);
        // 8 MiB + 64 fits in 128 MiB; 160 MiB + 64 is 224, rounded to 256.
        assert_eq!(pod("8388608", "0").larger_than((1, 128)), None);
        assert_eq!(pod("167772160", "0").larger_than((1, 128)), Some((1, 256)));
        assert_eq!(pod("167772160", "0").larger_than((2, 512)), None);
        // 1.5 CPUs: 2 vCPUs; the template's memory is kept.
        assert_eq!(pod("0", "150000").larger_than((1, 128)), Some((2, 128)));
        assert_eq!(pod("0", "150000").larger_than((4, 128)), None);
        // Not from the kubelet: said so.
        let err =
            PodResources::from_annotations(&annotations("lots", "0"), true).expect_err("refused");
        assert!(err.to_string().contains(SANDBOX_MEMORY_ANNOTATION), "{err}");
    }

    #[test]
    fn bind_mounts_are_files_or_volumes() {
        let host = tree();
        let bind = |dest: &str, source: &Path, options: &[&str]| {
            serde_json::json!({
                "destination": dest,
                "type": "bind",
                "source": source,
                "options": options,
            })
        };
        let spec: Spec = serde_json::from_value(serde_json::json!({
            "ociVersion": "1.0.2",
            "mounts": [
                bind("/etc/hostname", &host.join("bin/data"), &["rbind", "rw"]),
                bind("/data", &host.join("usr"), &["rbind", "rprivate", "rw"]),
                bind("/config/", &host.join("bin"), &["rbind", "ro"]),
                // What the guest provides, something neither, and a path
                // that climbs.
                bind("/dev/shm", &host.join("usr"), &["rbind"]),
                bind("/gone", &host.join("nowhere"), &["rbind"]),
                bind("/a/../b", &host.join("usr"), &["rbind"]),
                { "destination": "/proc", "type": "proc", "source": "proc" },
            ],
        }))
        .expect("test setup");
        let (files, volumes) = bind_mounts(&spec);
        assert_eq!(files, [("etc/hostname".to_owned(), host.join("bin/data"))]);
        assert_eq!(
            volumes,
            [
                Volume {
                    source: host.join("usr"),
                    target: "data".into(),
                    readonly: false,
                },
                Volume {
                    source: host.join("bin"),
                    target: "config".into(),
                    readonly: true,
                },
            ]
        );
        std::fs::remove_dir_all(host).expect("test setup");
    }
}
