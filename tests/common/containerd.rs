//! A private containerd (its own root, state and sockets) with a husk
//! daemon behind `containerd-shim-husk-v2`, for the containerd tests and
//! benchmark: everything lives under one directory, and everything started
//! is killed and removed at exit.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use husk_agent_client::readiness::WaitBudget;

pub const RUNTIME: &str = "io.containerd.husk.v2";
pub const NAMESPACE: &str = "default";
/// The namespace the CRI plugin keeps Kubernetes' images and containers in.
pub const CRI_NAMESPACE: &str = "k8s.io";
/// The pause image the CRI plugin is configured with (the tests import it).
pub const PAUSE_IMAGE: &str = "husk.test/pause:1";

/// Where Debian's containernetworking-plugins are.
const CNI_BIN: &str = "/usr/lib/cni";
/// The pod network's subnet and its bridge's (the pods' gateway's) address,
/// in the node's network namespace (see [`Containerd::start_cri`]).
pub const POD_SUBNET: &str = "10.88.7.0/24";
pub const POD_GATEWAY: &str = "10.88.7.1";

/// containerd and `husk serve`, running.
pub struct Containerd {
    pub dir: PathBuf,
    /// With the CRI: the node's network namespace containerd (and so every
    /// CNI plugin) runs in.
    pub node_netns: Option<PathBuf>,
    /// `husk serve`, then containerd.
    children: Vec<Child>,
}

fn which(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Why containerd cannot run here, if it cannot.
pub fn missing() -> Option<String> {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("containerd and husk's VMM jail need root".into());
    }
    if !which("containerd") || !which("ctr") || !which("runc") {
        return Some("containerd is not installed (apt-get install containerd runc)".into());
    }
    None
}

/// For a containerd benchmark's `main`: the runs per path
/// (`HUSK_BENCH_RUNS`, default 5), or None when it should not run (cargo
/// listing benchmarks, or no containerd here: it says why).
pub fn bench_runs(name: &str) -> Option<usize> {
    if std::env::args().any(|a| a == "--list") {
        return None;
    }
    if let Some(why) = missing() {
        eprintln!("{name} benchmark skipped: {why}");
        return None;
    }
    super::initramfs();
    Some(
        std::env::var("HUSK_BENCH_RUNS")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(5),
    )
}

/// Why the CRI's pod network cannot be made here, if it cannot.
pub fn missing_cni() -> Option<String> {
    let plugins = ["bridge", "host-local", "loopback", "portmap"];
    if plugins.iter().any(|p| !Path::new(CNI_BIN).join(p).exists()) || !which("iptables") {
        return Some(format!(
            "the CNI plugins ({CNI_BIN}: {}) or iptables are missing \
             (apt-get install containernetworking-plugins iptables)",
            plugins.join(", ")
        ));
    }
    None
}

/// The node network namespace of this process's CRI containerd.
fn node_netns_name() -> String {
    format!("husk-node-{}", std::process::id())
}

/// The directory of this process's containerd (`kind`: test or bench).
fn dir_of(kind: &str) -> PathBuf {
    std::env::temp_dir().join(format!("husk-ctr-{kind}-{}", std::process::id()))
}

static KIND: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

extern "C" fn cleanup() {
    let Some(kind) = KIND.get() else { return };
    let dir = dir_of(kind);
    super::kill_everything_under(&dir);
    // The node's namespace, and with it the pod bridge, the CNI's
    // iptables rules and every pod interface left in it.
    let _ = Command::new("ip")
        .args(["netns", "delete", &node_netns_name()])
        .stderr(Stdio::null())
        .status();
    super::remove_cgroups_of(&dir.join("husk"));
    // The sockets of shims killed just now (each bundle names its shim's).
    let tasks = dir.join("state/io.containerd.runtime.v2.task");
    for ns in std::fs::read_dir(tasks).into_iter().flatten().flatten() {
        for bundle in std::fs::read_dir(ns.path()).into_iter().flatten().flatten() {
            let address =
                std::fs::read_to_string(bundle.path().join("address")).unwrap_or_default();
            if let Some(socket) = address.trim().strip_prefix("unix://") {
                let _ = std::fs::remove_file(socket);
            }
        }
    }
    // Whatever is mounted below the directory (the shims' root file
    // systems, the CRI's shm mounts), deepest first.
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut below: Vec<&str> = mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|m| Path::new(m).starts_with(&dir))
        .collect();
    below.sort_by_key(|m| std::cmp::Reverse(m.len()));
    for m in below {
        if let Ok(path) = std::ffi::CString::new(m) {
            // SAFETY: umount2 reads a NUL-terminated path.
            unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

impl Containerd {
    /// Starts containerd and a husk daemon under a new directory and waits
    /// for both to answer. `kind` names the directory (one per process).
    pub fn start(kind: &'static str) -> Containerd {
        Containerd::start_with(kind, false)
    }

    /// Like [`Containerd::start`], with containerd's CRI plugin serving on
    /// `containerd.sock` as the kubelet reaches it: runtime handlers `husk`
    /// (the default) and `runc`, images unpacked with overlayfs, the pause
    /// image [`PAUSE_IMAGE`], and a pod network made by Debian's CNI
    /// plugins (a bridge with [`POD_GATEWAY`] on [`POD_SUBNET`],
    /// host-local addresses, portmap for hostPorts). containerd runs in a
    /// network namespace of the test's own (the node's: see
    /// [`Containerd::in_node`]), so the bridge, the forwarding and the
    /// CNI's iptables rules are there and go with it, and no pod has a
    /// route off the machine. Pods on the node's network
    /// ([`super::cri::namespaces`]) share that namespace.
    pub fn start_cri(kind: &'static str) -> Containerd {
        Containerd::start_with(kind, true)
    }

    fn start_with(kind: &'static str, cri: bool) -> Containerd {
        assert!(KIND.set(kind).is_ok(), "one containerd per process");
        let dir = dir_of(kind);
        // SAFETY: registers a plain function to run at exit.
        unsafe { libc::atexit(cleanup) };
        let husk_dir = dir.join("husk");
        std::fs::create_dir_all(&husk_dir).expect("state dir");
        // The CRI's pod network namespaces are made under its state
        // directory (`netns_mounts_under_state_dir`), which the daemon may
        // join pods' sandboxes to.
        let state = dir.join("state");
        std::fs::create_dir_all(&state).expect("containerd state dir");
        let node_netns = cri.then(|| {
            let name = node_netns_name();
            for args in [
                &["netns", "add", &name][..],
                &["-n", &name, "link", "set", "lo", "up"],
            ] {
                let out = Command::new("ip")
                    .args(args)
                    .output()
                    .expect("ip (iproute2)");
                assert!(
                    out.status.success(),
                    "ip {args:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            Path::new("/run/netns").join(name)
        });
        let mut daemon = Command::new(super::husk_binary());
        daemon.arg("serve");
        // An emulated guest's reclaim of an idle pod's memory takes about
        // 40 s of a host core here (tests/daemon.rs tests it).
        daemon.args(["--reclaim-idle-s", "0"]);
        if cri {
            // The pods' network namespaces, and their volumes (the test's
            // directories) as shares.
            daemon.arg("--pod-netns-dir").arg(&state);
            daemon.arg("--mount-root").arg(&dir);
        }
        let daemon = daemon
            .arg("--state-dir")
            .arg(&husk_dir)
            .arg("--kernel")
            .arg(super::kernel())
            .arg("--initramfs")
            .arg(super::initramfs())
            .arg("--guest-init")
            .arg(super::repo_root().join("target/x86_64-unknown-linux-musl/guest/guest-init"))
            .arg("--vmm")
            .arg(super::vmm_binary())
            .stdout(Stdio::null())
            .stderr(log_file(&dir.join("daemon.log")))
            .spawn()
            .expect("husk serve");
        let config = dir.join("containerd.toml");
        let d = dir.display();
        let mut text = format!(
            "version = 2\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n\
             disabled_plugins = [{}\
             \"io.containerd.snapshotter.v1.btrfs\", \"io.containerd.snapshotter.v1.zfs\", \
             \"io.containerd.snapshotter.v1.devmapper\", \"io.containerd.snapshotter.v1.aufs\"]\n\
             [grpc]\n  address = \"{d}/containerd.sock\"\n\
             [ttrpc]\n  address = \"{d}/containerd.sock.ttrpc\"\n",
            if cri {
                ""
            } else {
                "\"io.containerd.grpc.v1.cri\", "
            }
        );
        if cri {
            std::fs::create_dir_all(dir.join("cni/conf")).expect("cni dir");
            let conflist = serde_json::json!({
                "cniVersion": "1.0.0",
                "name": "husk-test",
                "plugins": [
                    {
                        "type": "bridge",
                        "bridge": "hkbr0",
                        "isGateway": true,
                        "ipMasq": false,
                        "hairpinMode": true,
                        "ipam": {
                            "type": "host-local",
                            "ranges": [[{"subnet": POD_SUBNET, "gateway": POD_GATEWAY}]],
                            "routes": [{"dst": "0.0.0.0/0"}],
                            "dataDir": dir.join("cni/ipam"),
                        },
                    },
                    {"type": "portmap", "capabilities": {"portMappings": true}},
                ],
            });
            std::fs::write(
                dir.join("cni/conf/10-husk.conflist"),
                serde_json::to_vec_pretty(&conflist).expect("conflist"),
            )
            .expect("CNI config");
            // `restrict_oom_score_adj`: no OOM score below containerd's
            // own, as for a containerd in a user namespace. runc's pods
            // need it where even root may not lower a score (this host:
            // the pause container's -998 fails runc's init).
            text.push_str(&format!(
                "[plugins.\"io.containerd.grpc.v1.cri\"]\n\
                 \x20 sandbox_image = \"{PAUSE_IMAGE}\"\n\
                 \x20 restrict_oom_score_adj = true\n\
                 \x20 netns_mounts_under_state_dir = true\n\
                 \x20 stream_server_address = \"127.0.0.1\"\n\
                 \x20 stream_server_port = \"0\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd]\n\
                 \x20 snapshotter = \"overlayfs\"\n\
                 \x20 default_runtime_name = \"husk\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.husk]\n\
                 \x20 runtime_type = \"{RUNTIME}\"\n\
                 \x20 pod_annotations = [\"io.husk.template\"]\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n\
                 \x20 runtime_type = \"io.containerd.runc.v2\"\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".cni]\n\
                 \x20 bin_dir = \"{CNI_BIN}\"\n\
                 \x20 conf_dir = \"{d}/cni/conf\"\n"
            ));
        }
        std::fs::write(&config, text).expect("containerd config");
        // containerd finds the shim on its PATH and passes its environment
        // (the daemon's socket) on to it.
        let bin_dir = Path::new(super::vmm_binary()).parent().expect("target dir");
        let shim = bin_dir.join("containerd-shim-husk-v2");
        assert!(
            shim.exists(),
            "{} is missing: build it (`cargo build -p husk-shim`; make test builds every binary)",
            shim.display()
        );
        let mut containerd = Command::new("containerd");
        // Open until containerd is spawned (below).
        let node_ns = node_netns
            .as_ref()
            .map(|netns| std::fs::File::open(netns).expect("the node's network namespace"));
        if let Some(ns) = &node_ns {
            let fd = std::os::fd::AsRawFd::as_raw_fd(ns);
            // SAFETY: only setns(2) runs between fork and exec, on a
            // descriptor open across the spawn.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut containerd, move || {
                    if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let containerd = containerd
            .arg("--config")
            .arg(&config)
            .env(
                "PATH",
                format!(
                    "{}:{}",
                    bin_dir.display(),
                    std::env::var("PATH").unwrap_or_default()
                ),
            )
            .env("HUSK_HOST", husk_dir.join("husk.sock"))
            .stdout(Stdio::null())
            .stderr(log_file(&dir.join("containerd.log")))
            .spawn()
            .expect("containerd");
        drop(node_ns);
        let mut wait = WaitBudget::new(Duration::from_secs(60));
        while !(dir.join("containerd.sock").exists() && husk_dir.join("husk.sock").exists()) {
            assert!(
                !wait.expired(),
                "containerd or husk serve did not start: see {}",
                dir.display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Containerd {
            dir,
            node_netns,
            children: vec![daemon, containerd],
        }
    }

    /// Runs `f` on a thread in the node's network namespace (where the
    /// pod network is, as on a Kubernetes node).
    pub fn in_node<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let netns = self.node_netns.as_ref().expect("a CRI containerd");
        let ns = std::fs::File::open(netns).expect("the node's network namespace");
        std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: moves only this thread into the namespace; it
                // ends with `f`.
                let rc = unsafe {
                    libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET)
                };
                assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
                f()
            })
            .join()
            .expect("the node's thread")
        })
    }

    /// The husk daemon's pid (its VMMs run below it).
    pub fn daemon_pid(&self) -> u32 {
        self.children[0].id()
    }

    pub fn ctr_command(&self, args: &[&str]) -> Command {
        self.ctr_in(NAMESPACE, args)
    }

    /// `ctr` in namespace `ns`.
    pub fn ctr_in(&self, ns: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address")
            .arg(self.dir.join("containerd.sock"))
            .args(["--namespace", ns])
            .args(args)
            .stdin(Stdio::null());
        cmd
    }

    pub fn ctr(&self, args: &[&str]) -> Output {
        self.ctr_command(args).output().expect("ctr")
    }

    /// The `husk` CLI against this daemon; fails on failure.
    pub fn husk(&self, args: &[&str]) -> Output {
        let out = self.husk_output(args);
        assert!(
            out.status.success(),
            "husk {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// `husk ARGS` against the test's daemon, however it ends.
    pub fn husk_output(&self, args: &[&str]) -> Output {
        Command::new(super::husk_binary())
            .args(args)
            .env("HUSK_HOST", self.dir.join("husk/husk.sock"))
            .output()
            .expect("husk")
    }

    /// The names of the daemon's templates.
    pub fn templates(&self) -> Vec<String> {
        let list: Vec<serde_json::Value> =
            serde_json::from_slice(&self.husk(&["template", "ls", "--json"]).stdout)
                .expect("template list");
        list.iter()
            .filter_map(|t| t["name"].as_str().map(str::to_owned))
            .collect()
    }

    /// Keeps `n` warm clones of `template`.
    pub fn pool(&self, template: &str, n: u32) {
        self.husk(&["pool", "set", template, &n.to_string()]);
    }

    /// Waits until `template`'s pool has `n` clones ready.
    pub fn wait_for_pool(&self, template: &str, n: u32) {
        let mut wait = WaitBudget::new(Duration::from_secs(600));
        loop {
            let pools: Vec<serde_json::Value> =
                serde_json::from_slice(&self.husk(&["pool", "ls", "--json"]).stdout)
                    .expect("pool list");
            let ready = pools
                .iter()
                .find(|p| p["template_name"] == template)
                .and_then(|p| p["ready"].as_u64())
                .unwrap_or(0);
            if ready >= u64::from(n) {
                return;
            }
            assert!(!wait.expired(), "the pool of {template} did not fill");
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

fn log_file(path: &Path) -> std::fs::File {
    std::fs::File::create(path).expect("log file")
}

/// A root file system of busybox and its applets (plus `marker`, an empty
/// file whose name makes the tree, and so its template, distinct).
pub fn busybox_rootfs(dir: &Path, marker: &str) -> PathBuf {
    std::fs::create_dir_all(dir.join("bin")).expect("rootfs");
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("busybox (apt-get install busybox-static)");
    std::fs::copy(busybox, dir.join("bin/busybox")).expect("copy busybox");
    for applet in [
        "sh", "echo", "cat", "sleep", "true", "ls", "ps", "hostname", "tty",
    ] {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(applet)).expect("applet");
    }
    std::fs::write(dir.join(marker), b"").expect("marker");
    dir.to_owned()
}

/// The socket containerd-shim 0.11 serves a task on (it removes it when
/// it exits).
pub fn shim_socket(dir: &Path, id: &str) -> PathBuf {
    shim_socket_in(dir, NAMESPACE, id)
}

/// [`shim_socket`] in namespace `ns`.
pub fn shim_socket_in(dir: &Path, ns: &str, id: &str) -> PathBuf {
    use sha2::Digest;
    let address = dir.join("containerd.sock").join(ns).join(id);
    let hash = sha2::Sha256::digest(address.display().to_string().as_bytes());
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    PathBuf::from("/run/containerd/s").join(hex)
}

/// Processes whose command line has all of `words` (as whole arguments,
/// or a path ending in one).
pub fn processes_with(words: &[&str]) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if words
            .iter()
            .all(|w| args.iter().any(|a| a == w || a.ends_with(&format!("/{w}"))))
        {
            found.push(pid);
        }
    }
    found
}
