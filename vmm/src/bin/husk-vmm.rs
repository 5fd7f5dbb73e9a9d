//! husk-vmm: boots one microVM (or restores one from a snapshot) and exits
//! when it ends.
//!
//! Exit status: 0 when the guest shut down (or SIGTERM/SIGINT stopped it),
//! 1 when the guest failed (kernel panic, triple fault, KVM error),
//! 2 when the VM could not be built (bad input, no KVM).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use clap::Parser;
use husk_vmm::builder::{build_vm, restore_vm, RestoreConfig};
use husk_vmm::config::{
    DeviceLimits, DriveConfig, FsConfig, NetConfig, SerialOutput, VmConfig, VsockConfig,
};
use husk_vmm::rate_limiter::{parse_limits, Limits};
use husk_vmm::seccomp::{SeccompPolicy, ThreadKind};
use husk_vmm::timeline::Timeline;
use husk_vmm::vstate::memory::MemoryConfig;
use husk_vmm::Outcome;

#[derive(Debug, Parser)]
#[command(name = "husk-vmm", version, about = "Boot one husk microVM")]
struct Args {
    /// Guest kernel: an uncompressed vmlinux ELF (fastest) or a bzImage.
    #[arg(long, required_unless_present = "restore")]
    kernel: Option<PathBuf>,
    /// Restore the snapshot in this directory instead of booting. The
    /// clone's identity comes from --id, --vsock, --net, --overlay and
    /// --serial; the machine (memory, vCPUs, devices) from the snapshot.
    #[arg(long, conflicts_with_all = ["kernel", "initramfs", "cmdline", "drives", "hugepages"])]
    restore: Option<PathBuf>,
    /// With --restore: `NAME=FILE`, the clone's own overlay for the
    /// snapshot's writable drive NAME. FILE must not exist yet; the clone's
    /// writes go there, over the snapshot's copy of the drive. Repeatable.
    #[arg(long = "overlay", requires = "restore", value_parser = parse_overlay)]
    overlays: Vec<(String, PathBuf)>,
    /// With --restore: create the overlay of each writable drive not given
    /// by --overlay in DIR, as `<id>.<drive>.overlay`.
    #[arg(long, requires = "restore")]
    overlay_dir: Option<PathBuf>,
    /// With --restore: track the pages the clone writes (KVM dirty log)
    /// from its first instruction, so that its first snapshot can be a diff
    /// against the one it was restored from. Off by default, as only such a
    /// clone needs it: on hardware KVM it makes the first write to each page
    /// a fault. Without it the clone's diff snapshots are refused until it
    /// has taken a full one.
    #[arg(long, requires = "restore")]
    dirty_log: bool,
    /// With --restore: check what the snapshot itself wrote (a diff's
    /// pages, its drive layers) against the checksums written with them
    /// before any guest runs. Reads them: the cost grows with what the
    /// snapshot holds, not with the guest's size (the daemon wakes
    /// hibernated sandboxes so).
    #[arg(long, requires = "restore")]
    verify: bool,
    /// Serve the control socket here (status, pause, resume, snapshot: see
    /// the husk-vmm-api crate).
    #[arg(long)]
    api_sock: Option<PathBuf>,
    /// initramfs (newc cpio) to unpack as the root file system.
    #[arg(long)]
    initramfs: Option<PathBuf>,
    /// Extra kernel parameters, appended to the base command line. Anything
    /// after ` -- ` is passed to guest-init, which runs it once ready.
    #[arg(long, allow_hyphen_values = true)]
    cmdline: Option<String>,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 128)]
    mem_mib: u32,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// Offer the host's hardware virtualization (VMX or SVM) to the guest.
    /// Off by default: a guest that runs a hypervisor of its own reaches
    /// the host kernel's nested-virtualization code. Snapshots keep it.
    #[arg(long, conflicts_with = "restore")]
    nested_virt: bool,
    /// Serial console destination: `stdout`, `null`, or a file path.
    #[arg(long, default_value = "stdout")]
    serial: String,
    /// Back guest memory with 2 MiB huge pages.
    #[arg(long)]
    hugepages: bool,
    /// Do not touch guest memory up front (faster start, slower guest).
    #[arg(long)]
    no_prefault: bool,
    /// A virtio-block drive: `path=FILE[,readonly][,overlay=FILE][,id=NAME]`.
    /// `overlay` makes the image a read-only base shared by many VMs, with
    /// this VM's writes going to the sparse overlay file. Repeatable; drives
    /// are /dev/vda, /dev/vdb, ... in order.
    #[arg(long = "drive")]
    drives: Vec<DriveConfig>,
    /// A shared host directory (virtio-fs): `tag=TAG[,path=DIR][,ro][,owner=UID:GID]`.
    /// The guest mounts it with `mount -t virtiofs TAG DIR`; it follows the
    /// host live. Without a path, an empty slot that a restore fills (give
    /// `--fs tag=TAG,path=DIR` with --restore). `owner`: the host owner of
    /// what the guest creates (else the creating guest user's ids, when the
    /// VMM may set them). Repeatable.
    #[arg(long = "fs")]
    shares: Vec<FsConfig>,
    /// A virtio-vsock device: `cid=N,path=SOCKET`. Host programs connect to
    /// SOCKET and write `CONNECT <port>\n`; guest connections to host port P
    /// reach SOCKET_P.
    #[arg(long)]
    vsock: Option<VsockConfig>,
    /// A virtio-net device on a TAP: `tap=NAME[,mac=XX:XX:XX:XX:XX:XX]`. An
    /// existing TAP is attached to; a missing one is created (and goes away
    /// with the VMM).
    #[arg(long)]
    net: Option<NetConfig>,
    /// A virtio-balloon device with free page reporting: blocks of memory
    /// the guest frees go back to the host (a clone's fall back to its
    /// snapshot's shared pages). Kept by snapshots (not given with
    /// --restore).
    #[arg(long)]
    balloon: bool,
    /// Rate limit for every drive: `bytes=N[K|M|G],ops=N` per second (either
    /// may be left out). Host policy: also given with --restore.
    #[arg(long, value_parser = parse_limits)]
    block_limit: Option<Limits>,
    /// Rate limit for the network device, each way: `bytes=N[K|M|G],ops=N`
    /// (frames) per second. Also given with --restore.
    #[arg(long, value_parser = parse_limits)]
    net_limit: Option<Limits>,
    /// The KVM device.
    #[arg(long, default_value = "/dev/kvm")]
    kvm_device: PathBuf,
    /// Sandbox id, shown on every log line.
    #[arg(long)]
    id: Option<String>,
    /// Write the boot timeline as JSON to this file when the VM ends.
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Run without the per-thread seccomp filters (for debugging only:
    /// every syscall is then open to a guest that takes over the VMM).
    #[arg(long)]
    no_seccomp: bool,
    /// Tests only: make one kind of thread (control, devices, vcpu) try a
    /// forbidden syscall once filtered; the VMM must die by SIGSYS.
    #[arg(long, hide = true, value_parser = parse_thread_kind)]
    seccomp_selftest: Option<ThreadKind>,
}

fn parse_thread_kind(name: &str) -> Result<ThreadKind, String> {
    ThreadKind::parse(name).ok_or_else(|| format!("`{name}`: control, devices, vcpu or fs"))
}

/// What to start: a boot or a restore.
enum Start {
    Boot(Box<VmConfig>),
    Restore(Box<RestoreConfig>),
}

impl Args {
    fn into_config(self) -> (Start, Option<PathBuf>, Option<PathBuf>) {
        let serial = match self.serial.as_str() {
            "stdout" => SerialOutput::Stdout,
            "null" => SerialOutput::Null,
            path => SerialOutput::File(path.into()),
        };
        let id = self
            .id
            .unwrap_or_else(|| format!("vm-{}", std::process::id()));
        if let Some(snapshot) = self.restore {
            let config = RestoreConfig {
                id,
                snapshot,
                vsock: self.vsock,
                net: self.net,
                overlays: self.overlays,
                overlay_dir: self.overlay_dir,
                shares: self.shares,
                dirty_log: self.dirty_log,
                verify: self.verify,
                serial,
                kvm_device: self.kvm_device,
                limits: DeviceLimits {
                    block: self.block_limit.unwrap_or_default(),
                    net: self.net_limit.unwrap_or_default(),
                },
            };
            return (
                Start::Restore(Box::new(config)),
                self.timeline,
                self.api_sock,
            );
        }
        let config = VmConfig {
            id,
            kernel: self.kernel.unwrap_or_default(),
            initramfs: self.initramfs,
            extra_cmdline: self.cmdline,
            memory: MemoryConfig {
                size_mib: self.mem_mib,
                prefault: !self.no_prefault,
                hugepages: self.hugepages,
            },
            vcpus: self.vcpus,
            nested_virt: self.nested_virt,
            serial,
            kvm_device: self.kvm_device,
            drives: self.drives,
            shares: self.shares,
            vsock: self.vsock,
            net: self.net,
            balloon: self.balloon,
            limits: DeviceLimits {
                block: self.block_limit.unwrap_or_default(),
                net: self.net_limit.unwrap_or_default(),
            },
        };
        (Start::Boot(Box::new(config)), self.timeline, self.api_sock)
    }
}

/// `NAME=FILE`.
fn parse_overlay(spec: &str) -> Result<(String, PathBuf), String> {
    match spec.split_once('=') {
        Some((name, file)) if !name.is_empty() && !file.is_empty() => {
            Ok((name.to_owned(), PathBuf::from(file)))
        }
        _ => Err(format!("`{spec}` is not NAME=FILE")),
    }
}

fn main() -> ExitCode {
    let timeline = Arc::new(Timeline::new());
    // Before any thread starts: they inherit it (vCPU threads set their own).
    let short_slice = husk_vmm_api::sched::set_slice(Some(husk_vmm_api::sched::SHORT_SLICE));
    // `HUSK_LOG` as targets and levels (`info`, `husk_vmm=debug,warn`):
    // EnvFilter's span and field matching would link a regex engine, and
    // its Unicode tables' relocations, into every VMM (about 180 KiB of
    // private memory each).
    let filter: tracing_subscriber::filter::Targets = std::env::var("HUSK_LOG")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            tracing_subscriber::filter::Targets::new().with_default(tracing::Level::INFO)
        });
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(husk_vmm::log_budget::LogBudget::default())
                .with_target(false)
                .with_ansi(std::io::stderr().is_terminal()),
        )
        .with(filter)
        .init();
    if let Err(e) = short_slice {
        tracing::debug!("the host refused a short slice: {e}");
    }
    let args = Args::parse();
    let seccomp = SeccompPolicy {
        enabled: !args.no_seccomp,
        selftest: args.seccomp_selftest,
    };
    if seccomp.enabled {
        husk_vmm::seccomp::install_report();
    }
    let (start, timeline_path, api_sock) = args.into_config();
    let id = match &start {
        Start::Boot(c) => c.id.clone(),
        Start::Restore(c) => c.id.clone(),
    };
    let span = tracing::info_span!("vm", id = %id);
    let _entered = span.enter();

    // Compiled at build time; vCPU threads started during the build install
    // theirs.
    let filters = Arc::new(husk_vmm::seccomp::Filters::new(seccomp));
    timeline.mark(husk_vmm::timeline::Phase::FiltersReady);
    let built = match &start {
        Start::Boot(config) => build_vm(config, timeline.clone(), filters),
        Start::Restore(config) => restore_vm(config, timeline.clone(), filters),
    };
    let mut vmm = match built {
        Ok(vmm) => vmm,
        Err(e) => {
            tracing::error!("cannot start the VM: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(path) = api_sock {
        if let Err(e) = vmm.listen_api(&path) {
            tracing::error!("cannot listen on {}: {e}", path.display());
            return ExitCode::from(2);
        }
    }
    if !seccomp.enabled {
        tracing::warn!(
            "SECCOMP IS OFF (--no-seccomp): a guest that takes over this VMM can make any syscall"
        );
    }
    let outcome = match vmm.run() {
        Ok(outcome) => outcome,
        Err(e) => {
            tracing::error!("the VM failed: {e}");
            return ExitCode::from(1);
        }
    };
    match &outcome {
        Outcome::GuestShutdown | Outcome::Signal(_) => tracing::info!("{outcome}"),
        _ => tracing::error!("{outcome}"),
    }
    let report = timeline_json(&vmm, &outcome);
    eprint!("{}", timeline_table(&report));
    if let Some(path) = timeline_path {
        if let Err(e) = std::fs::write(&path, format!("{report}\n")) {
            tracing::error!("cannot write the timeline to {}: {e}", path.display());
        }
    }
    ExitCode::from(outcome.exit_code() as u8)
}

/// The report as a table for people: host phases, then guest phases.
fn timeline_table(report: &serde_json::Value) -> String {
    let phases = &report["phases_us"];
    let mut out = String::from("boot timeline (ms since husk-vmm started)\n");
    let mut previous = 0u64;
    for (side, name) in [
        ("host", "filters_ready"),
        ("host", "state_loaded"),
        ("host", "vm_created"),
        ("host", "memory_ready"),
        ("host", "kernel_loaded"),
        ("host", "devices_ready"),
        ("host", "vcpus_ready"),
        ("host", "first_kvm_run"),
        ("guest", "init_started"),
        ("guest", "guest_ready"),
        ("guest", "guest_exit"),
    ] {
        if let Some(us) = phases[name].as_u64() {
            out += &format!(
                "  {side:<5} {name:<14} {:>10.1}  (+{:.1})\n",
                us as f64 / 1000.0,
                us.saturating_sub(previous) as f64 / 1000.0
            );
            previous = us;
        }
    }
    if let Some(uptime) = report["guest_uptime_ms"].as_u64() {
        out += &format!("  guest-init reported guest uptime {uptime} ms at readiness\n");
    }
    out += &format!(
        "  VMM resident memory excluding guest RAM: {} KiB (guest RAM resident: {} KiB)\n",
        report["vmm_rss_kib"], report["guest_rss_kib"]
    );
    out
}

fn timeline_json(vmm: &husk_vmm::Vmm, outcome: &Outcome) -> serde_json::Value {
    let phases: serde_json::Map<String, serde_json::Value> = vmm
        .timeline()
        .report()
        .into_iter()
        .map(|(name, us)| (name.to_owned(), us.into()))
        .collect();
    let resident = vmm.resident_memory().unwrap_or_default();
    serde_json::json!({
        "id": vmm.id(),
        "phases_us": phases,
        "main_monotonic_ns": vmm.timeline().start_monotonic_ns(),
        "guest_uptime_ms": vmm.guest_uptime_ms(),
        "vmm_rss_kib": resident.vmm_kib,
        "vcpu_exits": husk_vmm::vstate::vcpu::USERSPACE_EXITS.load(std::sync::atomic::Ordering::Relaxed),
        "guest_rss_kib": resident.guest_kib,
        "outcome": outcome.to_string(),
        "exit_code": outcome.exit_code(),
    })
}
