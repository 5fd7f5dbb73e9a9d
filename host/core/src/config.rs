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
    /// The default root file system (an initramfs) of template builds.
    pub initramfs: Option<PathBuf>,
    /// guest-init (static), put into root file systems built from a
    /// directory or a tar archive.
    pub guest_init: Option<PathBuf>,
    /// Most sandboxes on this host, pooled ones included.
    pub max_sandboxes: u32,
    /// Most hibernated sandboxes (they hold disk, not memory, and do not
    /// count against `max_sandboxes`).
    pub max_hibernated: u32,
    /// Disk all hibernated sandboxes together may take, in bytes.
    pub max_hibernated_bytes: u64,
    /// After how long unused a running sandbox's guest is asked, once per
    /// idle period, to drop its page cache and compact free memory for
    /// free page reporting (None: never).
    pub reclaim_idle: Option<Duration>,
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
    /// The only host directories whose trees sandboxes may be given live
    /// (`mounts`; real paths). None: no sandbox sees a host directory.
    pub mount_roots: Vec<PathBuf>,
    /// The only directories whose network namespaces (real paths) a
    /// sandbox may be joined to as a pod's (the CRI's; see
    /// `Daemon::attach_pod_network`). Empty: none.
    pub pod_netns_dirs: Vec<PathBuf>,
    /// Largest upload (`POST /v1/uploads`), in bytes.
    pub max_upload_bytes: u64,
    /// Most background programs (the process API's) running at once in
    /// one sandbox.
    pub max_processes: u32,
    /// Destroy every sandbox (pooled ones included) when the host stops;
    /// otherwise they run on for the next host on this state directory.
    pub destroy_on_stop: bool,
    /// Where the host publishes sandboxes' ports (its front door), for the
    /// API to name their addresses; None: no front door.
    pub front_door: Option<FrontDoorAddr>,
}

/// A front door: `PORT-SANDBOXID.DOMAIN` reaches `PORT` inside sandbox
/// `SANDBOXID`, over HTTP or HTTPS on `port` (E2B's host format, so its
/// SDK's `get_host(port)` names it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrontDoorAddr {
    /// The domain under which sandboxes' hosts are named.
    pub domain: String,
    /// The TCP port it listens on.
    pub port: u16,
    /// Whether it speaks HTTPS (with the operator's certificate).
    pub https: bool,
}

impl FrontDoorAddr {
    /// The host name that reaches `port` in sandbox `id`.
    pub fn host(&self, id: &str, port: u16) -> String {
        format!("{port}-{id}.{}", self.domain)
    }

    /// Its URL (the front door's port written unless it is the scheme's).
    pub fn url(&self, id: &str, port: u16) -> String {
        let host = self.host(id, port);
        match (self.https, self.port) {
            (false, 80) => format!("http://{host}/"),
            (true, 443) => format!("https://{host}/"),
            (false, p) => format!("http://{host}:{p}/"),
            (true, p) => format!("https://{host}:{p}/"),
        }
    }

    /// The sandbox and port a request's `Host` names, if it is one of ours
    /// (`PORT-SANDBOXID.DOMAIN`, any case, with or without `:PORT`).
    pub fn route(&self, host: &str) -> Option<(String, u16)> {
        let host = host.to_ascii_lowercase();
        let name = match host.rsplit_once(':') {
            Some((name, p)) if p.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => host.as_str(),
        };
        let label = name.strip_suffix(self.domain.as_str())?.strip_suffix('.')?;
        let (port, id) = label.split_once('-')?;
        if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) || id.is_empty() {
            return None;
        }
        let port = port.parse::<u16>().ok().filter(|&p| p != 0)?;
        (!id.contains('.')).then(|| (id.to_owned(), port))
    }
}

impl DaemonConfig {
    /// The defaults `husk serve` runs with, for a host whose state lives in
    /// `state_dir`: husk-vmm (and husk-jailer) next to this program; at most
    /// 64 sandboxes and three quarters of the host's memory for guests; 4096
    /// hibernated ones in half the state directory's file system;
    /// restores at once as many as CPUs; a clone's agent 120 s and a
    /// template boot 900 s to answer on a quiet host; cgroup limits where
    /// a writable hierarchy exists; each VMM in its jail when running as
    /// root; no template sources (files come as uploads), the CRI's pod
    /// network namespaces in `/var/run/netns` (where it exists), uploads up to
    /// 8 GiB; sandboxes left running when the host stops.
    pub fn new(state_dir: impl Into<PathBuf>) -> Self {
        let vmm = std::env::current_exe()
            .map(|exe| exe.with_file_name("husk-vmm"))
            .unwrap_or_else(|_| PathBuf::from("husk-vmm"));
        // SAFETY: geteuid cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        let state_dir = state_dir.into();
        let mut cfg = DaemonConfig {
            max_hibernated_bytes: half_the_disk(&state_dir),
            state_dir,
            vmm: PathBuf::new(),
            kernel: None,
            initramfs: None,
            guest_init: None,
            max_sandboxes: 64,
            max_hibernated: 4096,
            reclaim_idle: Some(Duration::from_secs(60)),
            memory_mib: host_memory_mib() * 3 / 4,
            restore_parallel: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            restore_wait: Duration::from_secs(120),
            boot_wait: Duration::from_secs(900),
            cgroups: Hierarchy::detect(),
            jail: root.then(|| husk_jailer::JailConfig {
                jailer: PathBuf::new(),
                uids: Default::default(),
            }),
            egress_netns: None,
            egress_upstream_ca: None,
            template_sources: Vec::new(),
            mount_roots: Vec::new(),
            pod_netns_dirs: std::fs::canonicalize("/var/run/netns")
                .into_iter()
                .collect(),
            max_upload_bytes: 8 << 30,
            max_processes: 32,
            destroy_on_stop: false,
            front_door: None,
        };
        cfg.set_vmm(vmm);
        cfg
    }

    /// Runs VMMs from `vmm` (its real path when it has one), each through
    /// the `husk-jailer` beside it when jailed.
    pub fn set_vmm(&mut self, vmm: PathBuf) {
        self.vmm = std::fs::canonicalize(&vmm).unwrap_or(vmm);
        if let Some(jail) = &mut self.jail {
            jail.jailer = self.vmm.with_file_name("husk-jailer");
        }
    }
}

/// Half the size of the file system `dir` is on (or will be: its nearest
/// existing parent); 64 GiB if that cannot be told.
fn half_the_disk(dir: &std::path::Path) -> u64 {
    let existing = dir.ancestors().find(|p| p.exists()).unwrap_or(dir);
    nix::sys::statvfs::statvfs(existing)
        .map(|s| s.blocks() * s.fragment_size() / 2)
        .unwrap_or(64 << 30)
}

/// The host's memory in MiB (4096 if /proc/meminfo cannot say).
fn host_memory_mib() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(4096, |kib| kib / 1024)
}

#[cfg(test)]
mod tests {
    use super::FrontDoorAddr;

    #[test]
    fn a_host_names_a_sandbox_and_a_port_under_the_domain() {
        let door = FrontDoorAddr {
            domain: "sbx.example.com".into(),
            port: 8080,
            https: false,
        };
        let host = door.host("sb-00ff", 3000);
        assert_eq!(host, "3000-sb-00ff.sbx.example.com");
        assert_eq!(
            door.url("sb-00ff", 3000),
            "http://3000-sb-00ff.sbx.example.com:8080/"
        );
        assert_eq!(door.route(&host), Some(("sb-00ff".into(), 3000)));
        let https = |port| FrontDoorAddr {
            https: true,
            port,
            ..door.clone()
        };
        assert_eq!(
            https(443).url("sb-00ff", 3000),
            "https://3000-sb-00ff.sbx.example.com/"
        );
        assert_eq!(
            https(8443).url("sb-00ff", 3000),
            "https://3000-sb-00ff.sbx.example.com:8443/"
        );
        assert_eq!(
            door.route("3000-SB-00FF.Sbx.Example.com:8080"),
            Some(("sb-00ff".into(), 3000))
        );
        for other in [
            "sbx.example.com",
            "3000-sb-00ff.example.com",
            "3000-sb-00ff.evilsbx.example.com",
            "x3000-sb-00ff.sbx.example.com",
            "0-sb-00ff.sbx.example.com",
            "70000-sb-00ff.sbx.example.com",
            "3000-.sbx.example.com",
            "3000-a.b.sbx.example.com",
            "-sb.sbx.example.com",
            "",
        ] {
            assert_eq!(door.route(other), None, "{other}");
        }
    }
}
