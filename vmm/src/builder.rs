//! The one place a VM's parts are wired together.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::vstate::memory::GuestMemoryMmap;
use crate::CowOrigin;
use linux_loader::cmdline::Cmdline;
use linux_loader::loader::load_cmdline;
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::EventFd;

use crate::arch::x86_64::boot::{self, BootError, ZeroPage};
use crate::arch::x86_64::cpuid::{self, CpuidPolicy};
use crate::arch::x86_64::layout::{
    CMDLINE_MAX_SIZE, CMDLINE_START, I8042_DATA_PORT, SERIAL_IRQ, SERIAL_PORT,
};
use crate::arch::x86_64::mptable::{self, MptableError};
use crate::config::{ConfigError, VmConfig};
use crate::device_manager::{
    AttachedDevice, DeviceHandle, DeviceManagerError, EventLoop, MmioDeviceManager,
};
use crate::devices::bus::{Bus, BusError};
use crate::devices::i8042::I8042;
use crate::devices::serial::{ConsoleFacts, ConsoleWriter, SerialDevice, SerialSnapshot};
use crate::devices::virtio::balloon::BalloonDevice;
use crate::devices::virtio::block::{BlockDevice, Disk, DiskError};
use crate::devices::virtio::fs::{FsDevice, Share};
use crate::devices::virtio::net::{NetDevice, Tap, TapError};
use crate::devices::virtio::vsock::muxer::MuxerError;
use crate::devices::virtio::vsock::VsockDevice;
use crate::persist::{self, PersistError, SavedDevice};
use crate::rate_limiter::{Limits, RateLimiter};
use crate::seccomp::Filters;
use crate::timeline::{Phase, Timeline};
use crate::vstate::kvm::{self, KvmError};
use crate::vstate::memory::{self, MemoryError};
use crate::vstate::vcpu::{Vcpu, VcpuError, VcpuThread};
use crate::vstate::vcpu_state::{msrs_to_save, settle_tsc, MicrovmTsc, VcpuState};
use crate::vstate::vm::{Vm, VmError};
use crate::Vmm;
use husk_snapshot::Persist;

/// Errors building a VM. Each wraps the failing part's own error.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Kvm(#[from] KvmError),
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Boot(#[from] BootError),
    #[error("cannot write the kernel command line: {0}")]
    Cmdline(linux_loader::loader::Error),
    #[error("{0}")]
    Share(String),
    #[error(transparent)]
    Mptable(#[from] MptableError),
    #[error("cannot create an eventfd: {0}")]
    EventFd(#[source] std::io::Error),
    #[error("cannot register the serial interrupt: {0}")]
    Irqfd(kvm_ioctls::Error),
    #[error("cannot place a device: {0}")]
    Bus(#[from] BusError),
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error(transparent)]
    Disk(#[from] DiskError),
    #[error(transparent)]
    DeviceManager(#[from] DeviceManagerError),
    #[error(transparent)]
    Vsock(#[from] MuxerError),
    #[error(transparent)]
    Tap(#[from] TapError),
    #[error("cannot create the event loop: {0}")]
    EventLoop(String),
    #[error("cannot list the MSRs to snapshot: {0}")]
    VcpuState(crate::vstate::vcpu_state::StateError),
    #[error(transparent)]
    Persist(#[from] PersistError),
    #[error("cannot restore the snapshot: {0}")]
    Restore(String),
}

/// Builds a VM ready to boot `config.kernel`, marking host phases on
/// `timeline`; its threads will run under `filters`.
pub fn build_vm(
    config: &VmConfig,
    timeline: Arc<Timeline>,
    filters: Arc<Filters>,
) -> Result<Vmm, BuildError> {
    config.validate()?;
    let pvm = kvm::is_pvm_host();
    let threads = vcpu_threads(config.vcpus, &filters, pvm)?;
    let mut cmdline = config.kernel_cmdline(pvm)?;
    let mut kernel = config.open_kernel()?;
    let mut initramfs = config.open_initramfs()?;
    let console_out = config.open_serial()?;
    let kvm = kvm::open_kvm(&config.kvm_device)?;
    kvm::check_vcpu_count(&kvm, config.vcpus)?;
    let vm = Vm::new(&kvm)?;
    timeline.mark(Phase::VmCreated);

    let mem = memory::create_guest_memory(&config.memory)?;
    vm.register_memory(&kvm, &mem, false)?;
    vm.create_devices()?;
    timeline.mark(Phase::MemoryReady);

    let regions = memory::ram_regions(u64::from(config.memory.size_mib) << 20);
    let low_end = regions[0].1;
    let loaded = boot::load_kernel(&mem, &mut kernel, low_end)?;
    let initramfs = initramfs
        .as_mut()
        .map(|f| boot::load_initramfs(&mem, f, loaded.end, low_end))
        .transpose()?;
    boot::write_boot_tables(&mem)?;
    mptable::setup_mptable(&mem, config.vcpus)?;
    timeline.mark(Phase::KernelLoaded);

    let (mut platform, pio) = platform(&vm, console_out, &timeline, None)?;
    let mut mmio = MmioDeviceManager::new();
    for drive in &config.drives {
        let disk = Disk::open(&drive.path, &drive.mode)?;
        let queue_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(BuildError::EventFd)?;
        let block = BlockDevice::new(disk, &drive.id, queue_evt)
            .with_limiter(RateLimiter::new(config.limits.block).map_err(BuildError::EventFd)?);
        let block = Arc::new(Mutex::new(block));
        let parts = (vm.fd(), &mem, &mut platform.events);
        mmio.attach_virtio(parts, Some(&mut cmdline), DeviceHandle::Block(block), None)?;
    }
    for share in &config.shares {
        let device = FsDevice::new(share).map_err(|e| share_error(share, e))?;
        let device = DeviceHandle::Fs(Arc::new(Mutex::new(device)));
        let parts = (vm.fd(), &mem, platform.fs_events()?);
        mmio.attach_virtio(parts, Some(&mut cmdline), device, None)?;
    }
    if let Some(vsock) = &config.vsock {
        let device = VsockDevice::new(vsock.cid, &vsock.uds_path)?.with_timeline(timeline.clone());
        let device = Arc::new(Mutex::new(device));
        let parts = (vm.fd(), &mem, &mut platform.events);
        mmio.attach_virtio(parts, Some(&mut cmdline), DeviceHandle::Vsock(device), None)?;
    }
    if let Some(net) = &config.net {
        let tap = Tap::open(&net.tap)?;
        let device = net_device(tap, net.mac, config.limits.net)?;
        let device = Arc::new(Mutex::new(device));
        let parts = (vm.fd(), &mem, &mut platform.events);
        mmio.attach_virtio(parts, Some(&mut cmdline), DeviceHandle::Net(device), None)?;
    }
    if config.balloon {
        let device = BalloonDevice::new().map_err(BuildError::EventFd)?;
        let device = DeviceHandle::Balloon(Arc::new(Mutex::new(device)));
        let parts = (vm.fd(), &mem, &mut platform.events);
        mmio.attach_virtio(parts, Some(&mut cmdline), device, None)?;
    }
    write_cmdline_and_zero_page(&mem, &cmdline, &loaded, initramfs, &regions)?;
    let devices = std::mem::take(&mut mmio.devices);
    let buses = (Arc::new(pio), Arc::new(mmio.bus));
    timeline.mark(Phase::DevicesReady);

    let supported = Vcpu::supported_cpuid(&kvm)?;
    let mut vcpus = Vec::with_capacity(usize::from(config.vcpus));
    for index in 0..config.vcpus {
        let policy = CpuidPolicy {
            vcpus: config.vcpus,
            pvm,
            nested: config.nested_virt,
        };
        let vcpu = Vcpu::new(&supported, &vm, (index, policy), buses.clone())?;
        vcpu.configure_boot(loaded.entry.0)?;
        vcpus.push(vcpu);
    }
    timeline.mark(Phase::VcpusReady);
    let msr_indices = Arc::new(msrs_to_save(&kvm).map_err(BuildError::VcpuState)?);

    let machine = Machine {
        id: config.id.clone(),
        vm,
        mem,
        mem_size_mib: config.memory.size_mib,
        pvm,
        vcpus,
        devices,
        buses,
        msr_indices,
        timeline,
        threads,
        filters,
    };
    Ok(machine.into_vmm(platform, None, false))
}

/// What a restored VM needs besides its snapshot: its own identity.
#[derive(Debug, Clone)]
pub struct RestoreConfig {
    pub id: String,
    pub snapshot: std::path::PathBuf,
    /// The clone's own vsock (CID and socket); required when the snapshot
    /// has a vsock device.
    pub vsock: Option<crate::config::VsockConfig>,
    /// The clone's own TAP and MAC; required when the snapshot has
    /// virtio-net.
    pub net: Option<crate::config::NetConfig>,
    /// The clone's own new overlay for each writable drive, by drive name.
    pub overlays: Vec<(String, PathBuf)>,
    /// Where to create an overlay for each writable drive not in
    /// `overlays`: `DIR/<id>.<drive>.overlay` (the drive name made
    /// file-safe), so a caller need not know the snapshot's drives.
    pub overlay_dir: Option<PathBuf>,
    /// Directories for the snapshot's empty shared-directory slots, by tag
    /// (a slot not given one stays empty).
    pub shares: Vec<crate::config::FsConfig>,
    /// Track the pages the clone writes (KVM dirty log), so its snapshots
    /// can be diffs against the one it came from.
    pub dirty_log: bool,
    /// Check what the snapshot itself wrote (a diff's pages, its drive
    /// layers) against the checksums it wrote with them: reads them, so
    /// the cost grows with what the snapshot holds (a hibernation's wake).
    pub verify: bool,
    pub serial: crate::config::SerialOutput,
    pub kvm_device: std::path::PathBuf,
    pub limits: crate::config::DeviceLimits,
}

/// A drive name as part of a file name: anything but ASCII letters, digits
/// and `-` becomes `_`.
pub fn file_safe(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Files a restore created, removed again unless the restore succeeds.
struct CreatedFiles(Vec<PathBuf>);

impl CreatedFiles {
    fn keep(mut self) {
        self.0.clear();
    }
}

impl Drop for CreatedFiles {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Opens a restored VM's devices, in the snapshot's order, each with the
/// clone's own identity: CID, TAP and MAC, drive overlays. Checks the
/// device set against what the clone was given.
fn restore_devices(
    config: &RestoreConfig,
    saved: &[persist::DeviceSnapshot],
    created: &mut CreatedFiles,
    timeline: &Arc<Timeline>,
) -> Result<Vec<DeviceHandle>, BuildError> {
    let restore_err = |m: String| BuildError::Restore(m);
    let has = |f: fn(&SavedDevice) -> bool| saved.iter().any(|d| f(&d.device));
    let identities = [
        (
            has(|d| matches!(d, SavedDevice::Vsock { .. })),
            config.vsock.is_some(),
            "vsock device",
            "--vsock cid=N,path=SOCKET",
        ),
        (
            has(|d| matches!(d, SavedDevice::Net { .. })),
            config.net.is_some(),
            "network device",
            "--net tap=NAME,mac=MAC",
        ),
    ];
    for (in_snapshot, given, device, flag) in identities {
        match (in_snapshot, given) {
            (false, true) => {
                return Err(restore_err(format!(
                    "the snapshot has no {device}; a restored VM cannot gain one"
                )))
            }
            (true, false) => {
                return Err(restore_err(format!(
                    "the snapshot has a {device}: give this clone its own with {flag}"
                )))
            }
            _ => {}
        }
    }
    for share in &config.shares {
        let slot = saved
            .iter()
            .any(|d| matches!(&d.device, SavedDevice::Fs { tag } if *tag == share.tag));
        if !slot {
            return Err(restore_err(format!(
                "the snapshot has no shared-directory slot tagged `{}`",
                share.tag
            )));
        }
    }
    for (name, _) in &config.overlays {
        let writable = saved.iter().any(|d| {
            matches!(&d.device, SavedDevice::Block { id, disk } if id == name && !disk.read_only)
        });
        if !writable {
            return Err(restore_err(format!(
                "the snapshot has no writable drive `{name}` to give an overlay"
            )));
        }
    }
    let mut devices = Vec::with_capacity(saved.len());
    for device in saved {
        let handle = match &device.device {
            SavedDevice::Vsock { .. } => {
                let vsock = config
                    .vsock
                    .as_ref()
                    .ok_or_else(|| restore_err("no vsock".into()))?;
                let device =
                    VsockDevice::new(vsock.cid, &vsock.uds_path)?.with_timeline(timeline.clone());
                DeviceHandle::Vsock(Arc::new(Mutex::new(device)))
            }
            SavedDevice::Net { .. } => {
                let net = config
                    .net
                    .as_ref()
                    .ok_or_else(|| restore_err("no net".into()))?;
                let tap = Tap::open(&net.tap)?;
                let device = net_device(tap, net.mac, config.limits.net)?;
                DeviceHandle::Net(Arc::new(Mutex::new(device)))
            }
            SavedDevice::Fs { tag } => {
                let share = config
                    .shares
                    .iter()
                    .find(|s| s.tag == *tag)
                    .cloned()
                    .unwrap_or_else(|| Share {
                        tag: tag.clone(),
                        path: None,
                        options: Default::default(),
                    });
                let device = FsDevice::new(&share).map_err(|e| share_error(&share, e))?;
                DeviceHandle::Fs(Arc::new(Mutex::new(device)))
            }
            SavedDevice::Balloon { actual } => {
                let device = BalloonDevice::restored_with(*actual).map_err(BuildError::EventFd)?;
                DeviceHandle::Balloon(Arc::new(Mutex::new(device)))
            }
            SavedDevice::Block { id, disk } => {
                let overlay = config
                    .overlays
                    .iter()
                    .find(|(name, _)| name == id)
                    .map(|(_, path)| path.clone())
                    .or_else(|| {
                        let dir = config.overlay_dir.as_ref().filter(|_| !disk.read_only)?;
                        Some(dir.join(format!("{}.{}.overlay", config.id, file_safe(id))))
                    });
                if overlay.is_none() && !disk.read_only {
                    return Err(restore_err(format!(
                        "drive `{id}` is writable: give this clone its own new overlay with --overlay {id}=FILE or --overlay-dir DIR"
                    )));
                }
                let disk = disk.clone().resolved(&config.snapshot);
                let verify_in = config.verify.then_some(config.snapshot.as_path());
                let opened = Disk::restore(&disk, overlay.as_deref(), verify_in)
                    .map_err(|e| restore_err(format!("drive `{id}`: {e}")))?;
                created.0.extend(overlay);
                let queue_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(BuildError::EventFd)?;
                let limiter = RateLimiter::new(config.limits.block).map_err(BuildError::EventFd)?;
                let block = BlockDevice::new(opened, id, queue_evt).with_limiter(limiter);
                DeviceHandle::Block(Arc::new(Mutex::new(block)))
            }
        };
        devices.push(handle);
    }
    Ok(devices)
}

/// Why a shared directory cannot be served.
fn share_error(share: &Share, e: std::io::Error) -> BuildError {
    let what = share
        .path
        .as_ref()
        .map_or_else(|| "an empty slot".to_owned(), |p| p.display().to_string());
    BuildError::Share(format!("shared directory `{}` ({what}): {e}", share.tag))
}

/// A net device with its TX and RX limiters (`limits` each way).
fn net_device(tap: Tap, mac: [u8; 6], limits: Limits) -> Result<NetDevice, BuildError> {
    let limiter = || RateLimiter::new(limits).map_err(BuildError::EventFd);
    Ok(NetDevice::new(tap, mac)
        .map_err(BuildError::EventFd)?
        .with_limiters(limiter()?, limiter()?))
}

/// Builds a VM from a snapshot: memory mapped copy-on-write from its file,
/// KVM, device and vCPU state restored, ready to resume where it paused.
/// Every check (format, checksum, memory size, device set, host kind) is
/// done before a vCPU exists.
pub fn restore_vm(
    config: &RestoreConfig,
    timeline: Arc<Timeline>,
    filters: Arc<Filters>,
) -> Result<Vmm, BuildError> {
    let restorable = persist::read(&config.snapshot)?;
    if config.verify {
        persist::verify_memory(&config.snapshot, &restorable)?;
    }
    let persist::Restorable {
        state,
        layers,
        root,
    } = restorable;
    let pvm = kvm::is_pvm_host();
    if state.pvm != pvm {
        let kind = |p| {
            if p {
                "an emulating (PVM) host"
            } else {
                "a hardware KVM host"
            }
        };
        return Err(PersistError::HostKind {
            taken: kind(state.pvm),
            here: kind(pvm),
        }
        .into());
    }
    let kvm = kvm::open_kvm(&config.kvm_device)?;
    let vcpu_count = u8::try_from(state.vcpus.len())
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            BuildError::Restore(format!("the snapshot has {} vCPUs", state.vcpus.len()))
        })?;
    kvm::check_vcpu_count(&kvm, vcpu_count)?;
    check_cpu_features(&kvm, &state.vcpus, pvm)?;
    let mut created = CreatedFiles(Vec::new());
    let restored_devices = restore_devices(config, &state.devices, &mut created, &timeline)?;
    let console_out = config.serial.open()?;
    timeline.mark(Phase::StateLoaded);

    let threads = vcpu_threads(vcpu_count, &filters, pvm)?;
    let vm = Vm::new(&kvm)?;
    timeline.mark(Phase::VmCreated);

    let mem = memory::map_snapshot_file(&layers[0].file, state.mem_size_mib)?;
    for layer in &layers[1..] {
        memory::overlay(&mem, &layer.file, layer.runs.as_deref().unwrap_or_default())?;
    }
    // What differs from the root's memory file: the diffs' pages, and from
    // now on what is written (see `Vmm::snapshot`).
    // (Its path is made canonical if a diff is ever taken, not here.)
    let cow = Some(CowOrigin {
        root,
        overlaid: layers[1..]
            .iter()
            .flat_map(|l| l.runs.iter().flatten().copied())
            .collect(),
    });
    // Diffs of this clone are relative to the snapshot it came from, so
    // KVM logs dirty pages from the first instruction.
    vm.register_memory(&kvm, &mem, config.dirty_log)?;
    vm.create_devices()?;
    timeline.mark(Phase::MemoryReady);

    let tsc_sync = vm
        .restore_state(&state.vm)
        .map_err(|e| BuildError::Restore(e.to_string()))?;
    let (mut platform, pio) = platform(&vm, console_out, &timeline, Some(&state.serial))?;
    let mut mmio = MmioDeviceManager::new();
    for (saved, handle) in state.devices.iter().zip(restored_devices) {
        let events = match handle {
            DeviceHandle::Fs(_) => platform.fs_events()?,
            _ => &mut platform.events,
        };
        let parts = (vm.fd(), &mem, events);
        mmio.attach_virtio(parts, None, handle, Some(&saved.transport))
            .map_err(|e| BuildError::Restore(format!("{:?}: {e}", saved.device)))?;
    }
    let devices = std::mem::take(&mut mmio.devices);
    let buses = (Arc::new(pio), Arc::new(mmio.bus));
    timeline.mark(Phase::DevicesReady);
    // All vCPUs first, then their states (see Vcpu::restore).
    let vcpus = (0..state.vcpus.len())
        .map(|index| Vcpu::create(&vm, index as u8, buses.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut scaled = false;
    for (vcpu, vcpu_state) in vcpus.iter().zip(&state.vcpus) {
        scaled |= vcpu.restore(tsc_sync, vcpu_state)?;
    }
    if let Some(tsc) = MicrovmTsc::of(&state.vm, &state.vcpus, scaled) {
        let fds: Vec<_> = vcpus.iter().map(Vcpu::fd).collect();
        settle_tsc(vm.fd(), &fds, &tsc).map_err(BuildError::VcpuState)?;
    }
    for attached in &devices {
        attached
            .transport
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .restored();
    }
    timeline.mark(Phase::VcpusReady);
    let msr_indices = Arc::new(msrs_to_save(&kvm).map_err(BuildError::VcpuState)?);

    let last_snapshot = config
        .dirty_log
        .then(|| std::fs::canonicalize(&config.snapshot).ok())
        .flatten();
    created.keep();
    let machine = Machine {
        id: config.id.clone(),
        vm,
        mem,
        mem_size_mib: state.mem_size_mib,
        pvm,
        vcpus,
        devices,
        buses,
        msr_indices,
        timeline,
        threads,
        filters,
    };
    let mut vmm = machine.into_vmm(platform, last_snapshot, config.dirty_log);
    vmm.cow = cow;
    Ok(vmm)
}

/// Refuses a snapshot whose vCPUs were offered CPU features that this host
/// cannot offer (a guest would fault on them later, or its XSAVE state not
/// load), naming them. On a PVM host a guest sees the host's own CPUID
/// whatever KVM is told, so that is what it is checked against there.
fn check_cpu_features(
    kvm: &kvm_ioctls::Kvm,
    saved: &[VcpuState],
    pvm: bool,
) -> Result<(), BuildError> {
    // On PVM the CPU's own CPUID is what the guest sees; elsewhere KVM's
    // list, normalized as a new vCPU's would be.
    let (supported, native) = if pvm {
        (None, cpuid::native_features())
    } else {
        (Some(Vcpu::supported_cpuid(kvm)?), Vec::new())
    };
    let policy = CpuidPolicy {
        vcpus: saved.len() as u8,
        pvm,
        // What the host has, not what a default guest gets.
        nested: true,
    };
    let mut missing = Vec::new();
    for (index, vcpu) in saved.iter().enumerate() {
        let offered = match &supported {
            None => native.clone(),
            Some(supported) => {
                let mut offered = supported.clone();
                cpuid::normalize(&mut offered, index as u8, policy);
                offered.as_slice().to_vec()
            }
        };
        for name in cpuid::missing_features(&vcpu.cpuid, &offered) {
            if !missing.contains(&name) {
                missing.push(name);
            }
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    Err(PersistError::CpuFeatures(missing.join(", ")).into())
}

/// The threads of `count` vCPUs, started now so that each installs its
/// seccomp filter while the VM is built (see [`VcpuThread`]).
fn vcpu_threads(
    count: u8,
    filters: &Arc<Filters>,
    pvm: bool,
) -> Result<Vec<VcpuThread>, BuildError> {
    let slice = pvm.then_some(crate::vstate::vcpu::PVM_VCPU_SLICE);
    (0..count)
        .map(|index| VcpuThread::spawn(index, filters.clone(), slice).map_err(BuildError::from))
        .collect()
}

/// What every VM has besides its memory, vCPUs and virtio devices.
struct Platform {
    /// Every device's event subscription but the shared directories'.
    events: EventLoop,
    /// The shared directories' (their own thread, see `Vmm::run`), made
    /// for the first.
    fs_events: Option<EventLoop>,
    /// Signalled by the i8042 when the guest resets.
    reset_evt: EventFd,
    facts: Arc<Mutex<ConsoleFacts>>,
    serial: Arc<Mutex<SerialDevice>>,
}

/// The event loop, the reset line and COM1 (new, or in its `saved` state),
/// with the port-I/O bus that holds COM1 and the i8042.
fn platform(
    vm: &Vm,
    console_out: Box<dyn std::io::Write + Send>,
    timeline: &Arc<Timeline>,
    saved: Option<&SerialSnapshot>,
) -> Result<(Platform, Bus), BuildError> {
    let events = EventLoop::new().map_err(|e| BuildError::EventLoop(format!("{e:?}")))?;
    let reset_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(BuildError::EventFd)?;
    let facts = Arc::new(Mutex::new(ConsoleFacts::default()));
    let console = ConsoleWriter::new(console_out, facts.clone(), timeline.clone());
    let irq = serial_irq(vm)?;
    let serial = match saved {
        None => SerialDevice::new(irq, console),
        Some(state) => SerialDevice::restore((irq, console), state)
            .map_err(|e| BuildError::Restore(e.to_string()))?,
    };
    let serial = Arc::new(Mutex::new(serial));
    let pio = legacy_devices(serial.clone(), &reset_evt)?;
    let platform = Platform {
        events,
        fs_events: None,
        reset_evt,
        facts,
        serial,
    };
    Ok((platform, pio))
}

impl Platform {
    /// The shared directories' event loop (made for the first).
    fn fs_events(&mut self) -> Result<&mut EventLoop, BuildError> {
        if self.fs_events.is_none() {
            let events = EventLoop::new().map_err(|e| BuildError::EventLoop(format!("{e:?}")))?;
            self.fs_events = Some(events);
        }
        Ok(self.fs_events.as_mut().expect("made above"))
    }
}

/// A VM's wired parts, before it runs.
struct Machine {
    id: String,
    vm: Vm,
    mem: GuestMemoryMmap,
    mem_size_mib: u32,
    pvm: bool,
    vcpus: Vec<Vcpu>,
    devices: Vec<AttachedDevice>,
    buses: (Arc<Bus>, Arc<Bus>),
    msr_indices: Arc<Vec<u32>>,
    timeline: Arc<Timeline>,
    threads: Vec<VcpuThread>,
    filters: Arc<Filters>,
}

impl Machine {
    /// The VMM of these parts. `last_snapshot` is what its next diff
    /// snapshot is relative to; `dirty_logging` whether KVM logs its
    /// writes already.
    fn into_vmm(
        self,
        platform: Platform,
        last_snapshot: Option<PathBuf>,
        dirty_logging: bool,
    ) -> Vmm {
        Vmm {
            id: self.id,
            vm: self.vm,
            mem: self.mem,
            last_snapshot,
            dirty_logging,
            mem_size_mib: self.mem_size_mib,
            pvm: self.pvm,
            vcpus: self.vcpus,
            handles: Vec::new(),
            paused: false,
            msr_indices: self.msr_indices,
            vcpu_threads: self.threads,
            filters: self.filters,
            serial: platform.serial,
            devices: self.devices,
            reset_evt: platform.reset_evt,
            facts: platform.facts,
            timeline: self.timeline,
            events: platform.events,
            fs_events: platform.fs_events,
            buses: self.buses,
            api: None,
            api_server: None,
            device_thread: None,
            fs_thread: None,
            cow: None,
        }
    }
}

/// The serial port's interrupt: an irqfd on IRQ 4.
fn serial_irq(vm: &Vm) -> Result<EventFd, BuildError> {
    let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(BuildError::EventFd)?;
    vm.fd()
        .register_irqfd(&irq, SERIAL_IRQ)
        .map_err(BuildError::Irqfd)?;
    Ok(irq)
}

/// The port-I/O devices: COM1 and the i8042 whose reset line signals
/// `reset_evt`.
fn legacy_devices(
    serial: Arc<Mutex<SerialDevice>>,
    reset_evt: &EventFd,
) -> Result<Bus, BuildError> {
    let mut pio = Bus::new();
    pio.insert(u64::from(SERIAL_PORT), 8, serial)?;
    let i8042_evt = reset_evt.try_clone().map_err(BuildError::EventFd)?;
    pio.insert(
        u64::from(I8042_DATA_PORT),
        5,
        Arc::new(Mutex::new(I8042::new(i8042_evt))),
    )?;
    Ok(pio)
}

/// Writes the final command line (with every device on it) and the zero page.
fn write_cmdline_and_zero_page(
    mem: &GuestMemoryMmap,
    cmdline: &Cmdline,
    kernel: &boot::LoadedKernel,
    initramfs: Option<(GuestAddress, u64)>,
    regions: &[(u64, u64)],
) -> Result<(), BuildError> {
    let cmdline_len = cmdline
        .as_cstring()
        .map_err(|e| BuildError::Config(ConfigError::CmdlineInvalid(e)))?
        .as_bytes()
        .len();
    if cmdline_len >= CMDLINE_MAX_SIZE {
        return Err(BuildError::Config(ConfigError::CmdlineTooLong {
            len: cmdline_len,
        }));
    }
    load_cmdline(mem, GuestAddress(CMDLINE_START), cmdline).map_err(BuildError::Cmdline)?;
    let e820 = boot::e820_map(regions);
    let mut seed = [0u8; boot::RNG_SEED_LEN];
    // A VM without a seed still boots; its RNG becomes ready later (or
    // when the host seeds it through the agent).
    let setup_data = match crate::getrandom(&mut seed) {
        Ok(()) => Some(boot::write_rng_seed(mem, &seed)?),
        Err(e) => {
            tracing::warn!("no RNG seed for the guest: {e}");
            None
        }
    };
    let zero_page = boot::build_zero_page(&ZeroPage {
        kernel,
        cmdline_len,
        initramfs,
        e820: &e820,
        setup_data,
    });
    boot::write_zero_page(mem, &zero_page)?;
    Ok(())
}
