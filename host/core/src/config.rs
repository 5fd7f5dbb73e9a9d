//! What a host is given when it starts.

use std::path::PathBuf;
use std::time::Duration;

use crate::cgroup::Hierarchy;

/// How long one agent request may take before the daemon gives up on it.
pub const AGENT_TIMEOUT: Duration = Duration::from_secs(600);

/// What the daemon is given when it starts.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// Database, templates and sandboxes' run directories.
    pub state_dir: PathBuf,
    /// The husk-vmm binary.
    pub vmm: PathBuf,
    /// The default guest kernel and initramfs of template builds.
    pub kernel: Option<PathBuf>,
    pub initramfs: Option<PathBuf>,
    /// guest-init (static), put into root file systems built from a
    /// directory or a tar archive.
    pub guest_init: Option<PathBuf>,
    /// Most sandboxes on this host, pooled ones included.
    pub max_sandboxes: u32,
    /// Guest memory all sandboxes together may have, in MiB.
    pub memory_mib: u64,
    /// Most restores at once (pool refills and creates together).
    pub restore_parallel: u32,
    /// How long a restored clone's agent may take to answer, on a quiet
    /// host (stretched by load, see `WaitBudget`).
    pub restore_wait: Duration,
    /// How long a template's boot may take, on a quiet host.
    pub boot_wait: Duration,
    /// Where each VMM's cgroup goes (None: no limits, a warning).
    pub cgroups: Option<Hierarchy>,
    /// How each VMM is jailed (None: it runs as the daemon's user, with
    /// the host's file system; a warning).
    pub jail: Option<husk_jailer::JailConfig>,
    /// The network namespace the egress proxy resolves and connects in
    /// (None: the daemon's own).
    pub egress_netns: Option<PathBuf>,
    /// Certificates (PEM) the egress proxy trusts, besides the public
    /// roots, when it opens TLS to hosts with credentials.
    pub egress_upstream_ca: Option<PathBuf>,
    /// The only host directories a template build may read a root file
    /// system or kernel from (real paths); every other file comes as an
    /// upload.
    pub template_sources: Vec<PathBuf>,
    /// Largest upload (`POST /v1/uploads`), in bytes.
    pub max_upload_bytes: u64,
}
