//! husk-vmm: one KVM microVM per process.
//!
//! [`builder::build_vm`] turns a [`config::VmConfig`] into a [`Vmm`] ready to
//! boot; [`Vmm::run`] starts the vCPUs and serves events until the guest
//! powers off, fails, or the process is told to stop.

pub mod api;
pub mod arch;
pub mod builder;
pub mod config;
pub mod device_manager;
pub mod devices;
#[doc(hidden)]
pub mod fuzz;
pub mod log_budget;
pub mod persist;
pub mod rate_limiter;
pub mod resident;
pub mod seccomp;
pub mod timeline;
pub mod vstate;

use std::fmt;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};

use crate::vstate::memory::GuestMemoryMmap;
use event_manager::{EventOps, EventSet, Events, MutEventSubscriber, SubscriberOps};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use device_manager::{DeviceHandle, EventLoop};
use devices::serial::ConsoleFacts;
use husk_snapshot::Persist;
use resident::ResidentMemory;
use timeline::{Phase, Timeline};
use vstate::vcpu::{StopReporter, Vcpu, VcpuError, VcpuHandle, VcpuStop};
use vstate::vm::Vm;

/// How a VM ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The guest reset or powered off through the i8042 (guest-init's clean
    /// shutdown path with `reboot=k`).
    GuestShutdown,
    /// The guest kernel panicked; the first panic line.
    GuestPanic(String),
    /// A vCPU stopped for a reason that is a guest or KVM failure.
    VcpuStopped { index: u8, stop: VcpuStop },
    /// The VMM received SIGTERM or SIGINT and stopped the VM.
    Signal(i32),
}

impl Outcome {
    /// The process exit status: 0 for a clean end, 1 for a guest failure.
    pub fn exit_code(&self) -> i32 {
        match self {
            Outcome::GuestShutdown | Outcome::Signal(_) => 0,
            Outcome::GuestPanic(_) | Outcome::VcpuStopped { .. } => 1,
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::GuestShutdown => write!(f, "the guest shut down"),
            Outcome::GuestPanic(line) => write!(f, "the guest kernel panicked: {line}"),
            Outcome::VcpuStopped { index, stop } => write!(f, "vCPU {index} stopped: {stop}"),
            Outcome::Signal(sig) => write!(f, "stopped by signal {sig}"),
        }
    }
}

/// Errors while running a built VM.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    #[error("cannot set up the event loop: {0}")]
    EventLoop(String),
    #[error("cannot set up signal handling: {0}")]
    Signals(#[source] std::io::Error),
    #[error("cannot create an eventfd: {0}")]
    EventFd(#[source] std::io::Error),
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error("the VM must be paused first")]
    NotPaused,
    #[error("cannot start a thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("{0}")]
    Unsupported(String),
    #[error(transparent)]
    Persist(#[from] persist::PersistError),
    #[error("drive {0}: {1}")]
    Disk(String, #[source] devices::virtio::block::DiskError),
    #[error(transparent)]
    Seccomp(#[from] seccomp::SeccompError),
}

/// Where a restored VM's memory came from: the full memory file mapped
/// copy-on-write (its snapshot directory) and the diff runs laid over it.
#[derive(Debug, Clone)]
pub(crate) struct CowOrigin {
    pub(crate) root: std::path::PathBuf,
    pub(crate) overlaid: Vec<(u64, u64)>,
}

/// What a diff snapshot is relative to.
enum DiffBase {
    /// The last snapshot, by KVM's dirty log and the VMM's bitmap.
    Dirty(std::path::PathBuf),
    /// The memory file a restore mapped, by the pages no longer its own.
    Cow(CowOrigin),
}

/// A built VM: its memory, vCPUs, devices and the events that end it.
pub struct Vmm {
    pub(crate) id: String,
    // Kept alive for as long as KVM may touch the memory it registered.
    #[allow(dead_code)]
    pub(crate) vm: Vm,
    pub(crate) mem: GuestMemoryMmap,
    /// The snapshot the next diff is relative to: the last one taken, or
    /// the one this VM was restored from.
    pub(crate) last_snapshot: Option<std::path::PathBuf>,
    /// KVM logs dirty pages (on from the first snapshot, or from a restore).
    pub(crate) dirty_logging: bool,
    /// A restored VM's memory file, mapped copy-on-write, and the diff
    /// pages laid over it: what a diff without dirty logging is relative to
    /// (until a snapshot is taken).
    pub(crate) cow: Option<CowOrigin>,
    pub(crate) mem_size_mib: u32,
    pub(crate) pvm: bool,
    /// Built, not yet started.
    pub(crate) vcpus: Vec<Vcpu>,
    /// Their threads, started during the build with their filters on.
    pub(crate) vcpu_threads: Vec<vstate::vcpu::VcpuThread>,
    /// The seccomp filters of every thread kind.
    pub(crate) filters: Arc<seccomp::Filters>,
    /// Started.
    pub(crate) handles: Vec<VcpuHandle>,
    pub(crate) paused: bool,
    pub(crate) msr_indices: Arc<Vec<u32>>,
    pub(crate) serial: Arc<Mutex<devices::serial::SerialDevice>>,
    pub(crate) devices: Vec<device_manager::AttachedDevice>,
    pub(crate) reset_evt: EventFd,
    pub(crate) facts: Arc<Mutex<ConsoleFacts>>,
    pub(crate) timeline: Arc<Timeline>,
    /// Every device's event subscription; run on the VMM's main thread.
    pub(crate) events: EventLoop,
    // The MMIO bus owns the transports; kept here so devices live as long as the VM.
    #[allow(dead_code)]
    pub(crate) buses: (Arc<devices::bus::Bus>, Arc<devices::bus::Bus>),
    /// Requests from the control socket, if there is one.
    pub(crate) api: Option<api::Pending>,
    pub(crate) api_server: Option<Arc<Mutex<api::ApiServer>>>,
    /// The devices' event loop once the VM runs (see [`DeviceThread`]).
    pub(crate) device_thread: Option<DeviceThread>,
    /// The shared directories' event loop, if the VM has any: their file
    /// system calls run on a thread of their own, under a filter of its
    /// own ([`seccomp::ThreadKind::Fs`]), so the devices thread's stays small.
    pub(crate) fs_events: Option<EventLoop>,
    pub(crate) fs_thread: Option<DeviceThread>,
}

impl Drop for Vmm {
    /// A VM that has ended leaves no socket file behind: the vsock socket
    /// is removed here (the control socket with its server), whichever way
    /// the VM ended, a signal included.
    fn drop(&mut self) {
        for attached in &self.devices {
            if let DeviceHandle::Vsock(vsock) = &attached.device {
                lock(vsock).remove_socket_file();
            }
        }
    }
}

impl fmt::Debug for Vmm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Vmm")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Vmm {
    /// The sandbox id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The boot timeline.
    pub fn timeline(&self) -> &Arc<Timeline> {
        &self.timeline
    }

    /// guest-init's uptime at readiness, as it reported it on the console.
    pub fn guest_uptime_ms(&self) -> Option<u64> {
        lock(&self.facts).guest_uptime_ms
    }

    /// Resident memory of this process, guest RAM and VMM apart.
    pub fn resident_memory(&self) -> std::io::Result<ResidentMemory> {
        let guest: Vec<_> = self
            .mem
            .iter()
            .map(|r| {
                let start = r.as_ptr() as usize;
                start..start + r.len() as usize
            })
            .collect();
        resident::measure(&guest)
    }

    /// Serves a control socket at `path` (see [`api`]).
    pub fn listen_api(&mut self, path: &std::path::Path) -> std::io::Result<()> {
        let (server, pending) = api::ApiServer::bind(path)?;
        self.api_server = Some(Arc::new(Mutex::new(server)));
        self.api = Some(pending);
        Ok(())
    }

    /// Stops every vCPU outside KVM_RUN, then the devices: while paused
    /// nothing touches guest memory and host I/O for the guest waits.
    pub fn pause(&mut self) -> Result<(), VmmError> {
        if !self.paused {
            for handle in &self.handles {
                handle.pause()?;
            }
            if let Some(devices) = &self.device_thread {
                devices.stop()?;
            }
            if let Some(fs) = &self.fs_thread {
                if let Err(e) = fs.stop() {
                    if let Some(devices) = &self.device_thread {
                        devices.go();
                    }
                    return Err(e);
                }
            }
            self.paused = true;
        }
        Ok(())
    }

    pub fn resume(&mut self) -> Result<(), VmmError> {
        if self.paused {
            if let Some(devices) = &self.device_thread {
                devices.go();
            }
            if let Some(fs) = &self.fs_thread {
                fs.go();
            }
            for handle in &self.handles {
                handle.resume()?;
            }
            self.paused = false;
        }
        Ok(())
    }

    /// Writes a snapshot of the paused VM to `dir`: all of its memory, or
    /// (`diff`) only the pages written since the last snapshot. With
    /// `keep_base`, the snapshot is taken for elsewhere (a template, a
    /// hibernation that may be discarded): the VM's next diff stays
    /// against what it diffed against before, and none of its written
    /// pages are consumed (so a diff against a dirty log is refused).
    pub fn snapshot(
        &mut self,
        dir: &std::path::Path,
        diff: bool,
        keep_base: bool,
    ) -> Result<persist::WriteTimes, VmmError> {
        if !self.paused {
            return Err(VmmError::NotPaused);
        }
        let diff_base = match (diff, &self.last_snapshot, &self.cow) {
            (false, ..) => None,
            (true, Some(_), _) if self.dirty_logging && keep_base => {
                return Err(VmmError::Unsupported(
                    "a diff against the dirty log consumes it: it cannot keep its base".into(),
                ))
            }
            (true, Some(base), _) if self.dirty_logging => Some(DiffBase::Dirty(base.clone())),
            // Restored and not snapshotted since: the pages that are no
            // longer the memory file's are the diff against it.
            (true, _, Some(cow)) if !self.dirty_logging => Some(DiffBase::Cow(cow.clone())),
            (true, ..) => {
                return Err(VmmError::Unsupported(
                    "a diff snapshot needs an earlier snapshot of this VM, or a restored VM".into(),
                ))
            }
        };
        // A mounted share's FUSE session (the guest's inodes and open
        // files) is not saved: refused before anything is written.
        for attached in &self.devices {
            if let DeviceHandle::Fs(d) = &attached.device {
                if let Some(why) = lock(d).session_blocks_snapshot() {
                    return Err(VmmError::Unsupported(why));
                }
            }
        }
        persist::prepare(dir)?;
        let mut devices = Vec::with_capacity(self.devices.len());
        for (index, attached) in self.devices.iter().enumerate() {
            let device = match &attached.device {
                DeviceHandle::Vsock(d) => persist::SavedDevice::Vsock { cid: lock(d).cid() },
                DeviceHandle::Net(d) => persist::SavedDevice::Net { mac: lock(d).mac() },
                DeviceHandle::Fs(d) => persist::SavedDevice::Fs {
                    tag: lock(d).tag().to_owned(),
                },
                DeviceHandle::Balloon(d) => persist::SavedDevice::Balloon {
                    actual: lock(d).actual(),
                },
                DeviceHandle::Block(d) => {
                    let d = lock(d);
                    let disk = d
                        .save_disk(dir, &format!("drive-{index}"))
                        .map_err(|e| VmmError::Disk(d.name().to_owned(), e))?
                        .relative_to(dir);
                    persist::SavedDevice::Block {
                        id: d.name().to_owned(),
                        disk,
                    }
                }
            };
            let transport = lock(&attached.transport).save();
            devices.push(persist::DeviceSnapshot { device, transport });
        }
        let memory = match diff_base {
            Some(DiffBase::Dirty(base)) => {
                let kvm_dirty = self.vm.dirty_log(&self.mem).map_err(dirty_error)?;
                persist::MemoryLayout::Diff {
                    base,
                    runs: vstate::memory::take_dirty(&self.mem, &kvm_dirty),
                    crc64: 0,
                }
            }
            Some(DiffBase::Cow(cow)) => {
                let written = vstate::memory::written_since_mapped(&self.mem)
                    .map_err(|e| VmmError::Unsupported(format!("/proc/self/pagemap: {e}")))?;
                if !keep_base {
                    vstate::memory::clear_dirty(&self.mem);
                }
                persist::MemoryLayout::Diff {
                    base: std::fs::canonicalize(&cow.root).map_err(|e| {
                        VmmError::Unsupported(format!("{}: {e}", cow.root.display()))
                    })?,
                    runs: vstate::memory::merge_runs(&written, &cow.overlaid),
                    crc64: 0,
                }
            }
            None => {
                if !keep_base {
                    if self.dirty_logging {
                        // Everything is in this one: start the next diff
                        // afresh.
                        self.vm.dirty_log(&self.mem).map_err(dirty_error)?;
                    }
                    vstate::memory::clear_dirty(&self.mem);
                }
                persist::MemoryLayout::Full
            }
        };
        let mut vcpus = self
            .handles
            .iter()
            .map(|h| h.save())
            .collect::<Result<Vec<_>, _>>()?;
        let vm = self
            .vm
            .save_state()
            .map_err(|e| VmmError::Unsupported(e.to_string()))?;
        vstate::vcpu_state::pin_to_clock(&mut vcpus, &vm);
        let mut state = persist::MicrovmState {
            id: self.id.clone(),
            mem_size_mib: self.mem_size_mib,
            pvm: self.pvm,
            vm,
            vcpus,
            serial: lock(&self.serial).save(),
            memory,
            devices,
        };
        // (write fills in a diff's checksum as it writes the pages.)
        match persist::write(dir, &mut state, &self.mem) {
            Ok(times) if keep_base => Ok(times),
            Ok(times) => {
                self.last_snapshot = std::fs::canonicalize(dir).ok();
                self.cow = None;
                if !self.dirty_logging {
                    self.vm
                        .set_dirty_logging(&self.mem, true)
                        .map_err(dirty_error)?;
                    self.dirty_logging = true;
                }
                Ok(times)
            }
            Err(e) => {
                // The dirty pages were consumed: only a full snapshot is
                // complete now.
                if !keep_base {
                    self.last_snapshot = None;
                }
                Err(e.into())
            }
        }
    }

    /// Puts a new medium in drive `drive`: `path`, copy-on-write into
    /// `overlay` (which must not exist yet), or read-only without one.
    /// Returns its size. The guest learns its capacity from a
    /// configuration change interrupt; it must have stopped using the old
    /// medium (unmounted it), which is closed.
    fn change_medium(
        &mut self,
        drive: &str,
        path: &std::path::Path,
        overlay: Option<&std::path::Path>,
    ) -> Result<u64, VmmError> {
        use devices::virtio::block::{Disk, DiskError, DiskMode};
        let disk_error = |e| VmmError::Disk(drive.to_owned(), e);
        let (device, transport) = self
            .devices
            .iter()
            .find_map(|a| match &a.device {
                DeviceHandle::Block(d) if lock(d).name() == drive => Some((d, &a.transport)),
                _ => None,
            })
            .ok_or_else(|| VmmError::Unsupported(format!("this VM has no drive `{drive}`")))?;
        let mode = match overlay {
            Some(o) if std::fs::symlink_metadata(o).is_ok() => {
                return Err(disk_error(DiskError::OverlayExists(o.to_owned())))
            }
            Some(o) => DiskMode::CopyOnWrite {
                overlay: o.to_owned(),
            },
            None => DiskMode::ReadOnly,
        };
        let disk = Disk::open(path, &mode).map_err(disk_error)?;
        let size = disk.size();
        drop(lock(device).replace_disk(disk));
        lock(transport).config_changed();
        tracing::info!(drive, path = %path.display(), size, "drive: a new medium");
        Ok(size)
    }

    /// Has the virtio-fs device `spec` names serve the directory it
    /// names (`--fs` syntax), or `dir` (a descriptor passed with the
    /// request: a detached mount the daemon made for a jailed VMM); returns
    /// the tag.
    fn share(&mut self, spec: &str, dir: Option<OwnedFd>) -> Result<String, VmmError> {
        let share: config::FsConfig = spec
            .parse()
            .map_err(|e: config::ConfigError| VmmError::Unsupported(e.to_string()))?;
        let device = self
            .devices
            .iter()
            .find_map(|a| match &a.device {
                DeviceHandle::Fs(d) if lock(d).tag() == share.tag => Some(d),
                _ => None,
            })
            .ok_or_else(|| {
                VmmError::Unsupported(format!("this VM has no shared directory `{}`", share.tag))
            })?;
        lock(device)
            .serve_dir(&share, dir)
            .map_err(VmmError::Unsupported)?;
        tracing::info!(tag = %share.tag, path = ?share.path, "virtio-fs: a new directory");
        Ok(share.tag)
    }

    /// Carries out one control request; returns the reply.
    /// `fd`: the descriptor that came with it (only a share takes one).
    fn serve_request(&mut self, request: api::Request, fd: Option<OwnedFd>) -> api::Reply {
        use std::time::Instant;
        let started = Instant::now();
        let id = self.id.clone();
        let result = match request {
            api::Request::Status => Ok(api::Reply::Status {
                id,
                state: if self.paused {
                    api::RunState::Paused
                } else {
                    api::RunState::Running
                },
                phases_us: self
                    .timeline
                    .report()
                    .into_iter()
                    .map(|(name, us)| (name.to_owned(), us))
                    .collect(),
                main_monotonic_ns: self.timeline.start_monotonic_ns(),
            }),
            api::Request::Pause => self.pause().map(|()| api::Reply::Paused {
                id,
                pause_us: started.elapsed().as_micros() as u64,
            }),
            api::Request::Resume => self.resume().map(|()| api::Reply::Resumed { id }),
            api::Request::Medium {
                drive,
                path,
                overlay,
            } => self
                .change_medium(&drive, &path, overlay.as_deref())
                .map(|size| api::Reply::Medium { id, drive, size }),
            api::Request::Share { spec } => self
                .share(&spec, fd)
                .map(|tag| api::Reply::Share { id, tag }),
            api::Request::Snapshot {
                dir,
                diff,
                keep_base,
            } => {
                let was_running = !self.paused;
                let result = self.pause().and_then(|()| {
                    let paused = started.elapsed();
                    Ok((paused, self.snapshot(&dir, diff, keep_base)?))
                });
                if was_running {
                    if let Err(e) = self.resume() {
                        tracing::error!("cannot resume after the snapshot: {e}");
                    }
                }
                result.map(|(paused, times)| api::Reply::Snapshot {
                    id,
                    report: api::SnapshotReport {
                        dir,
                        diff,
                        memory_bytes: times.memory_bytes,
                        state_bytes: times.state_bytes as u64,
                        pause_us: paused.as_micros() as u64,
                        memory_write_us: times.memory.as_micros() as u64,
                        state_write_us: times.state.as_micros() as u64,
                        total_us: started.elapsed().as_micros() as u64,
                    },
                })
            }
        };
        result.unwrap_or_else(|e| api::Reply::Error {
            message: e.to_string(),
        })
    }

    /// Boots the guest and serves events until it ends. SIGTERM and SIGINT
    /// stop the VM; they are blocked in every thread and read from a signalfd.
    pub fn run(&mut self) -> Result<Outcome, VmmError> {
        let filters = self.filters.clone();
        let signals = SignalFd::new(&STOP_SIGNALS).map_err(VmmError::Signals)?;
        let stop_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(VmmError::EventFd)?;
        let (tx, rx) = mpsc::channel();
        let threads = std::mem::take(&mut self.vcpu_threads);
        for (vcpu, thread) in self.vcpus.drain(..).zip(threads) {
            let reporter = StopReporter {
                tx: tx.clone(),
                evt: stop_evt.try_clone().map_err(VmmError::EventFd)?,
            };
            // vCPU threads are never joined: they sit in KVM_RUN until the
            // process exits, which tears the VM down with them.
            let handle = vcpu.start(
                thread,
                reporter,
                self.timeline.clone(),
                self.msr_indices.clone(),
            )?;
            self.handles.push(handle);
        }

        // Devices get their own thread; this one keeps the control loop.
        let control = EventLoop::new().map_err(|e| VmmError::EventLoop(format!("{e:?}")))?;
        let devices = std::mem::replace(&mut self.events, control);
        self.device_thread = Some(DeviceThread::start(
            devices,
            filters.clone(),
            seccomp::ThreadKind::Devices,
        )?);
        if let Some(fs) = self.fs_events.take() {
            self.fs_thread = Some(DeviceThread::start(
                fs,
                filters.clone(),
                seccomp::ThreadKind::Fs,
            )?);
        }
        // Last: threads inherit their creator's filter.
        filters.enter(seccomp::ThreadKind::Control);
        if let Some(server) = self.api_server.take() {
            self.events.add_subscriber(server);
        }
        let watcher = Arc::new(Mutex::new(ExitWatcher {
            signals,
            stop_evt,
            stops: rx,
            reset_evt: self.reset_evt.try_clone().map_err(VmmError::EventFd)?,
            facts: self.facts.clone(),
            outcome: None,
        }));
        self.events.add_subscriber(watcher.clone());
        loop {
            self.events
                .run()
                .map_err(|e| VmmError::EventLoop(format!("{e:?}")))?;
            if let Some(outcome) = lock(&watcher).outcome.take() {
                if matches!(outcome, Outcome::GuestShutdown | Outcome::GuestPanic(_)) {
                    self.timeline.mark(Phase::GuestExit);
                }
                return Ok(outcome);
            }
            let requests = self
                .api
                .as_ref()
                .map(|p| std::mem::take(&mut *lock(p)))
                .unwrap_or_default();
            for api::Taken {
                request,
                fd,
                stream,
            } in requests
            {
                let reply = self.serve_request(request, fd);
                api::reply(stream, &reply);
            }
        }
    }
}

/// The devices' event loop, on its own thread so that a pause can stop it
/// between events: a snapshot then sees every device and queue at rest.
#[derive(Debug)]
pub(crate) struct DeviceThread {
    gate: Arc<(Mutex<Gate>, std::sync::Condvar)>,
    wake: EventFd,
}

#[derive(Debug, Default)]
struct Gate {
    stop_requested: bool,
    stopped: bool,
}

/// Wakes the device loop out of its wait so it can see a stop request.
struct Waker(EventFd);

impl MutEventSubscriber for Waker {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.0, EventSet::IN)) {
            tracing::error!("cannot watch the device loop's wake eventfd: {e:?}");
        }
    }

    fn process(&mut self, _events: Events, _ops: &mut EventOps) {
        let _ = self.0.read();
    }
}

impl DeviceThread {
    fn start(
        mut events: EventLoop,
        filters: Arc<seccomp::Filters>,
        kind: seccomp::ThreadKind,
    ) -> Result<Self, VmmError> {
        let wake = EventFd::new(libc::EFD_NONBLOCK).map_err(VmmError::EventFd)?;
        let waker = Waker(wake.try_clone().map_err(VmmError::EventFd)?);
        events.add_subscriber(Arc::new(Mutex::new(waker)));
        let gate = Arc::new((Mutex::new(Gate::default()), std::sync::Condvar::new()));
        let thread_gate = gate.clone();
        std::thread::Builder::new()
            .name(kind.name().into())
            .spawn(move || {
                filters.enter(kind);
                loop {
                    {
                        let (state, changed) = &*thread_gate;
                        let mut state = lock(state);
                        if state.stop_requested {
                            state.stopped = true;
                            changed.notify_all();
                            while state.stop_requested {
                                state = changed.wait(state).unwrap_or_else(|e| e.into_inner());
                            }
                            state.stopped = false;
                        }
                    }
                    if let Err(e) = events.run() {
                        tracing::error!("the device event loop failed: {e:?}");
                        return;
                    }
                }
            })
            .map_err(VmmError::Thread)?;
        Ok(DeviceThread { gate, wake })
    }

    /// Waits until the device loop is parked between events.
    fn stop(&self) -> Result<(), VmmError> {
        let (state, changed) = &*self.gate;
        let mut state = lock(state);
        state.stop_requested = true;
        let _ = self.wake.write(1);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !state.stopped {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                state.stop_requested = false;
                return Err(VmmError::Unsupported(
                    "the device loop did not stop within 5 s".into(),
                ));
            }
            state = changed
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    fn go(&self) {
        let (state, changed) = &*self.gate;
        lock(state).stop_requested = false;
        changed.notify_all();
    }
}

fn dirty_error(e: vstate::vm::VmError) -> VmmError {
    VmmError::Unsupported(format!("dirty page tracking: {e}"))
}

/// Fills `buf` from the host kernel's RNG (a jailed VMM has `/dev/urandom`).
pub(crate) fn getrandom(buf: &mut [u8]) -> std::io::Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")?.read_exact(buf)
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Decides how the VM ends from the events that can end it.
struct ExitWatcher {
    signals: SignalFd,
    stop_evt: EventFd,
    stops: Receiver<(u8, VcpuStop)>,
    reset_evt: EventFd,
    facts: Arc<Mutex<ConsoleFacts>>,
    outcome: Option<Outcome>,
}

impl MutEventSubscriber for ExitWatcher {
    fn init(&mut self, ops: &mut EventOps) {
        for fd in [
            self.signals.as_raw_fd(),
            self.stop_evt.as_raw_fd(),
            self.reset_evt.as_raw_fd(),
        ] {
            if let Err(e) = ops.add(Events::new_raw(fd, EventSet::IN)) {
                tracing::error!("cannot watch fd {fd}: {e:?}");
            }
        }
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.reset_evt.as_raw_fd() {
            let _ = self.reset_evt.read();
            // With panic=-1 a panicking kernel resets at once; the console
            // tells a panic from a requested shutdown.
            self.outcome = Some(match lock(&self.facts).panic.clone() {
                Some(line) => Outcome::GuestPanic(line),
                None => Outcome::GuestShutdown,
            });
        } else if fd == self.stop_evt.as_raw_fd() {
            let _ = self.stop_evt.read();
            if let Ok((index, stop)) = self.stops.try_recv() {
                self.outcome = Some(Outcome::VcpuStopped { index, stop });
            }
        } else if fd == self.signals.as_raw_fd() {
            if let Some(sig) = self.signals.read() {
                self.outcome = Some(Outcome::Signal(sig));
            }
        }
    }
}

/// The signals that stop the VM: read from a signalfd on the main thread,
/// blocked on every other.
pub(crate) const STOP_SIGNALS: [i32; 2] = [libc::SIGTERM, libc::SIGINT];

/// Blocks `signals` for the calling thread (and the threads it starts
/// afterwards); returns their set.
pub(crate) fn block_signals(signals: &[i32]) -> std::io::Result<libc::sigset_t> {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t and the signal numbers are valid.
    unsafe {
        libc::sigemptyset(&mut set);
        for &s in signals {
            libc::sigaddset(&mut set, s);
        }
    }
    // SAFETY: `set` is initialised; the old mask is not needed.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    Ok(set)
}

/// A signalfd for a set of signals, which are blocked for the calling thread
/// and every thread it spawns afterwards.
struct SignalFd {
    fd: OwnedFd,
}

impl SignalFd {
    fn new(signals: &[i32]) -> std::io::Result<Self> {
        let set = block_signals(signals)?;
        // SAFETY: `set` is initialised; -1 asks for a new descriptor.
        let fd = unsafe { libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: signalfd returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(SignalFd { fd })
    }

    fn read(&self) -> Option<i32> {
        // SAFETY: signalfd_siginfo is plain data.
        let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
        let len = std::mem::size_of::<libc::signalfd_siginfo>();
        // SAFETY: `info` is a writable buffer of `len` bytes.
        let n = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut info as *mut libc::signalfd_siginfo).cast(),
                len,
            )
        };
        (n as usize == len).then_some(info.ssi_signo as i32)
    }
}

impl AsRawFd for SignalFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}
