//! Templates: what a build is given, what it records, how its progress is
//! told, and the uploads it may be given.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Names are 1-63 characters of `[a-z0-9._-]`, starting with a letter or
/// digit.
pub fn check_template_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "template name `{name}`: use 1-63 characters of [a-z0-9._-], starting with a letter or digit"
        ))
    }
}

/// Where a template's root file system comes from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum RootfsSource {
    /// husk's own: busybox and guest-init, as an initramfs.
    #[default]
    Default,
    /// A directory on the daemon's host, copied into an ext4 image.
    Dir {
        /// A directory on the daemon's host (in a `--template-source` directory).
        path: PathBuf,
    },
    /// A tar archive on the daemon's host (an exported container file
    /// system), unpacked into an ext4 image.
    Tar {
        /// A tar archive on the daemon's host (in a `--template-source` directory).
        path: PathBuf,
    },
    /// A tar archive the client uploaded (`POST /v1/uploads`), unpacked
    /// into an ext4 image; the build uses the upload up.
    Upload {
        /// The upload's id.
        upload: String,
    },
    /// A container image on the daemon's host (in a `--template-source`
    /// directory): a `docker save` archive, or an OCI image layout (a
    /// directory or a tar of one). Its layers are applied in order and its
    /// config (env, working directory, user) holds for every exec.
    Image {
        /// The archive or layout directory.
        path: PathBuf,
    },
    /// A container image archive the client uploaded (as `Image`).
    ImageUpload {
        /// The upload's id.
        upload: String,
    },
}

/// What a container image says about the programs run from it (its
/// config's `Env`, `WorkingDir`, `User`, `Entrypoint` and `Cmd`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    /// `KEY=VALUE` entries every program gets (a request's own win).
    #[serde(default)]
    pub env: Vec<String>,
    /// The working directory of a program that names none.
    #[serde(default)]
    pub working_dir: Option<String>,
    /// The image's user (`name`, `uid`, `name:group`, `uid:gid`), as the
    /// image gives it; programs that name no user run as it.
    #[serde(default)]
    pub user: Option<String>,
    /// What `husk run` without a command runs: the entrypoint, then the
    /// command.
    #[serde(default)]
    pub entrypoint: Vec<String>,
    /// See `entrypoint`.
    #[serde(default)]
    pub cmd: Vec<String>,
}

/// Where a template's guest kernel comes from, when not the daemon's: a
/// path on the daemon's host (under a `--template-source` directory) or
/// an upload (`{"upload": ID}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum KernelSource {
    /// A path on the daemon's host (in a `--template-source` directory).
    Path(PathBuf),
    /// An upload.
    Upload {
        /// The upload's id.
        upload: String,
    },
}

/// What to build.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateSpec {
    /// Its name (see [`check_template_name`]).
    pub name: String,
    #[serde(default = "default_vcpus")]
    /// vCPUs of its VMs.
    pub vcpus: u8,
    #[serde(default = "default_mem_mib")]
    /// Guest memory of its VMs, in MiB.
    pub mem_mib: u32,
    #[serde(default)]
    /// Its root file system.
    pub rootfs: RootfsSource,
    /// Commands run once the guest is up, before the snapshot; each must
    /// exit 0.
    #[serde(default)]
    pub warmup: Vec<Vec<String>>,
    /// A guest kernel other than the daemon's.
    #[serde(default)]
    pub kernel: Option<KernelSource>,
    /// Give its VMs a virtio-net device (each sandbox its own TAP, created
    /// by its VMM and gone with it, and its own MAC). The TAP is left
    /// unconfigured: where it leads is the host's (or an egress policy's)
    /// business.
    #[serde(default)]
    pub network: bool,
    /// Rate limit of each of its sandboxes' drives: `bytes=N[K|M|G],ops=N`
    /// per second (either may be left out).
    #[serde(default)]
    pub block_limit: Option<String>,
    /// Rate limit of its sandboxes' network device, each way (frames for
    /// `ops`).
    #[serde(default)]
    pub net_limit: Option<String>,
    /// Empty drives its VMs have, each of which a sandbox can be given a
    /// medium in at run time (a pod's container root file systems, see
    /// `POST /v1/sandboxes/{id}/media`); at most [`MAX_DRIVE_SLOTS`].
    #[serde(default)]
    pub drive_slots: u8,
    /// Empty shared-directory devices (virtio-fs) its VMs have, each of
    /// which a sandbox can be given a host directory in when it is created
    /// (`mounts`), pooled clones too; at most [`MAX_FS_SLOTS`].
    #[serde(default)]
    pub fs_slots: u8,
    /// Offer the host's hardware virtualization (VMX or SVM) to its VMs,
    /// so they can run hypervisors of their own. Off by default: a guest
    /// with it reaches the host kernel's nested-virtualization code. The
    /// template's snapshot keeps it for every sandbox.
    #[serde(default)]
    pub nested_virt: bool,
}

/// Most empty drives a template's VMs may have.
pub const MAX_DRIVE_SLOTS: u8 = 8;

/// Most shared-directory slots a template's VMs may have.
pub const MAX_FS_SLOTS: u8 = 8;

/// The virtio-fs tag of a template's shared-directory slot `index`.
pub fn fs_slot_id(index: u8) -> String {
    format!("fs{index}")
}

/// The id (and serial, which the guest finds it by) of a template's
/// empty drive `index`.
pub fn drive_slot_id(index: u8) -> String {
    format!("slot{index}")
}

impl TemplateSpec {
    /// A template named `name` with the defaults a build request gets:
    /// 1 vCPU, 128 MiB, husk's own root file system, the daemon's kernel,
    /// no warm-up, no network, no rate limits.
    pub fn new(name: impl Into<String>) -> Self {
        TemplateSpec {
            name: name.into(),
            vcpus: default_vcpus(),
            mem_mib: default_mem_mib(),
            rootfs: RootfsSource::Default,
            warmup: Vec::new(),
            kernel: None,
            network: false,
            block_limit: None,
            net_limit: None,
            drive_slots: 0,
            fs_slots: 0,
            nested_virt: false,
        }
    }
}

fn default_vcpus() -> u8 {
    1
}

fn default_mem_mib() -> u32 {
    128
}

/// A template as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateRecord {
    /// Its id (`tpl-...`).
    pub id: String,
    /// Its name.
    pub name: String,
    /// When it was built, in ms since the epoch.
    pub created_unix_ms: u64,
    /// The snapshot every sandbox of this template restores.
    pub snapshot_dir: PathBuf,
    /// vCPUs of its VMs.
    pub vcpus: u8,
    /// Guest memory of its VMs, in MiB.
    pub mem_mib: u32,
    /// Where its root file system came from (`default`, `dir:PATH`,
    /// `tar:PATH`, `sandbox:ID`).
    pub source: String,
    /// SHA-256 of each file of the snapshot, by file name.
    pub checksums: BTreeMap<String, String>,
    /// How long the build took, by phase, in ms.
    pub build_ms: BTreeMap<String, f64>,
    /// Whether its VMs have a network device (each sandbox its own TAP
    /// and MAC).
    #[serde(default)]
    pub network: bool,
    /// Other snapshot directories its restores read (those of the
    /// templates it was snapshotted from), for the jail.
    #[serde(default)]
    pub reads: Vec<PathBuf>,
    /// Rate limits of its sandboxes' drives and network device, as
    /// husk-vmm's `--block-limit` and `--net-limit` take them.
    #[serde(default)]
    pub block_limit: Option<String>,
    #[serde(default)]
    /// Rate limit of its sandboxes' network device.
    pub net_limit: Option<String>,
    /// The config of the container image it was built from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageConfig>,
    /// Its VMs' empty drives (see [`TemplateSpec::drive_slots`]).
    #[serde(default)]
    pub drive_slots: u8,
    /// Its VMs' shared-directory slots (see [`TemplateSpec::fs_slots`]).
    #[serde(default)]
    pub fs_slots: u8,
}

/// One line of a template build's progress stream.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum BuildEvent {
    /// A step of the build.
    Progress {
        /// What it is doing.
        message: String,
    },
    /// The build is done.
    Done {
        /// The template it made.
        template: Box<TemplateRecord>,
    },
    /// The build failed.
    Error {
        /// The HTTP status the failure would have had.
        status: u16,
        /// Why it failed.
        error: String,
    },
}

/// A medium for one of a sandbox's empty drives (`POST
/// /v1/sandboxes/{id}/media`): an upload of a tar archive of a file tree
/// (a container's root file system), made into an ext4 image (kept by the
/// archive's hash, so the same tree is made once) and put in a free drive
/// under a copy-on-write overlay of the sandbox's own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MediumRequest {
    /// The upload (`POST /v1/uploads`); it is used up.
    pub upload: String,
}

/// A drive's medium.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MediumInfo {
    /// The drive's id, which is also the serial the guest finds it by.
    pub drive: String,
    /// The medium's size in bytes.
    pub size: u64,
    /// SHA-256 of the archive it was made from, in hex.
    pub image: String,
    /// How long making the image took (0: it was made before).
    pub build_ms: u64,
}

/// A received upload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadInfo {
    /// What a template spec names it by (`{"kind": "upload", "upload": ID}`).
    pub id: String,
    /// Its size.
    pub bytes: u64,
    /// SHA-256 of its content, in hex.
    pub sha256: String,
}
