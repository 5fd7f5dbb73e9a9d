//! vCPUs: creation, boot configuration and the run loop, one thread each.

use std::fmt;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};
use vmm_sys_util::eventfd::EventFd;

use crate::arch::x86_64::{cpuid, regs};
use crate::devices::bus::Bus;
use crate::timeline::{Phase, Timeline};
use crate::vstate::vcpu_state::{TscSync, VcpuState};
use crate::vstate::vm::Vm;

/// VM exits that reached the VMM (KVM_RUN returned), over all vCPUs. One VM
/// per process, so a process-wide counter is the VM's.
pub static USERSPACE_EXITS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The CPU slice a vCPU thread asks the host scheduler for on an emulating
/// (PVM) host, where the guest kernel runs through KVM's instruction
/// emulator. There, vCPUs of several VMs sharing a core with the default
/// slices (a few ms) make next to no progress: four busy guests on two
/// cores took 192 s for what took 16 s alone, 52 s with 10 ms slices,
/// 32 s with 20 ms and 22 s with 100 ms. Longer slices also make a guest
/// that waits on its devices wait longer behind a busy neighbour (a guest
/// opening vsock connections beside busy ones managed 0.4 a second with
/// 100 ms slices), so 20 ms. Hardware KVM keeps the scheduler's default.
pub const PVM_VCPU_SLICE: Duration = Duration::from_millis(20);

/// Errors creating or configuring a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("KVM_CREATE_VCPU {index} failed: {source}")]
    Create {
        index: u8,
        source: kvm_ioctls::Error,
    },
    #[error("KVM_GET_SUPPORTED_CPUID failed: {0}")]
    SupportedCpuid(kvm_ioctls::Error),
    #[error("KVM_SET_CPUID2 failed: {0}")]
    SetCpuid(kvm_ioctls::Error),
    #[error("cannot set vCPU {index} boot registers: {source}")]
    Regs { index: u8, source: regs::RegsError },
    #[error("cannot spawn the thread of vCPU {index}: {source}")]
    Spawn { index: u8, source: std::io::Error },
    #[error("cannot restore vCPU {index}: {source}")]
    State {
        index: u8,
        source: crate::vstate::vcpu_state::StateError,
    },
    #[error("vCPU {index} did not answer (it stopped, or is stuck): {what}")]
    NoAnswer { index: u8, what: &'static str },
    #[error("cannot save vCPU {index}: {message}")]
    Save { index: u8, message: String },
}

/// What the VMM asks of a running vCPU thread.
#[derive(Debug)]
enum VcpuCommand {
    Pause,
    Resume,
    Save,
}

#[derive(Debug)]
enum VcpuReply {
    Paused,
    Resumed,
    State(Box<Result<VcpuState, String>>),
}

/// The vCPU thread's side of the command channel.
struct Control {
    commands: Receiver<VcpuCommand>,
    replies: Sender<VcpuReply>,
    msr_indices: Arc<Vec<u32>>,
}

/// Signal that kicks a vCPU thread out of KVM_RUN (EINTR).
fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// Installs the (empty) kick handler once per process: without a handler
/// the signal would kill the process.
fn install_kick_handler() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Err(e) = vmm_sys_util::signal::register_signal_handler(kick_signal(), on_kick) {
            tracing::error!("cannot install the vCPU kick handler: {e}");
        }
    });
}

/// What a started vCPU's thread is handed.
struct Launch {
    vcpu: Vcpu,
    reporter: StopReporter,
    timeline: Arc<Timeline>,
    control: Control,
}

/// A vCPU's thread, started before its vCPU exists: it takes its slice and
/// installs its seccomp filter while the VM is still being built, then
/// waits for its vCPU. Installing a filter took 0.4 ms on the PVM build
/// hosts (the kernel checks and compiles it); started here, that is done
/// on another core instead of between the VM being ready and its first
/// KVM_RUN. Dropped without a vCPU (the build failed), it ends.
#[derive(Debug)]
pub struct VcpuThread {
    launch: mpsc::Sender<Box<Launch>>,
    thread: JoinHandle<()>,
}

impl std::fmt::Debug for Launch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launch")
            .field("vcpu", &self.vcpu.index)
            .finish()
    }
}

impl VcpuThread {
    /// Starts vCPU `index`'s thread with `slice` (None: the scheduler's
    /// default) and its seccomp filter from `filters`.
    pub fn spawn(
        index: u8,
        filters: Arc<crate::seccomp::Filters>,
        slice: Option<Duration>,
    ) -> Result<Self, VcpuError> {
        install_kick_handler();
        let (tx, rx) = mpsc::channel::<Box<Launch>>();
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || {
                // Started before the VMM's main thread blocks SIGTERM and
                // SIGINT for its signalfd: they are not this thread's.
                if let Err(e) = crate::block_signals(&crate::STOP_SIGNALS) {
                    tracing::warn!("vCPU {index}: cannot block SIGTERM and SIGINT: {e}");
                }
                // Not the VMM's short slice this thread inherited: a vCPU
                // runs long.
                if let Err(e) = husk_vmm_api::sched::set_slice(slice) {
                    tracing::debug!("the host refused a {slice:?} vCPU slice: {e}");
                }
                // Before the guest runs a single instruction on this vCPU.
                filters.enter(crate::seccomp::ThreadKind::Vcpu);
                let Ok(launch) = rx.recv() else {
                    return;
                };
                let Launch {
                    mut vcpu,
                    reporter,
                    timeline,
                    control,
                } = *launch;
                if index == 0 {
                    timeline.mark(Phase::FirstKvmRun);
                }
                let stop = vcpu.run_until_stop(&control);
                // The receiver only disappears when the VMM is exiting anyway.
                let _ = reporter.tx.send((index, stop));
                let _ = reporter.evt.write(1);
            })
            .map_err(|source| VcpuError::Spawn { index, source })?;
        Ok(VcpuThread { launch: tx, thread })
    }
}

/// The VMM's side of a running vCPU.
#[derive(Debug)]
pub struct VcpuHandle {
    index: u8,
    commands: Sender<VcpuCommand>,
    replies: Receiver<VcpuReply>,
    thread: JoinHandle<()>,
}

/// How long a vCPU may take to answer, once kicked.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

impl VcpuHandle {
    fn no_answer(&self, what: &'static str) -> VcpuError {
        VcpuError::NoAnswer {
            index: self.index,
            what,
        }
    }

    /// Stops the vCPU outside KVM_RUN. The signal is sent again until the
    /// thread answers: one that arrives just before KVM_RUN is entered is
    /// not lost for good that way.
    pub fn pause(&self) -> Result<(), VcpuError> {
        use vmm_sys_util::signal::Killable;
        self.commands
            .send(VcpuCommand::Pause)
            .map_err(|_| self.no_answer("pause"))?;
        let deadline = Instant::now() + ANSWER_TIMEOUT;
        while Instant::now() < deadline {
            let _ = self.thread.kill(kick_signal());
            match self.replies.recv_timeout(Duration::from_millis(10)) {
                Ok(VcpuReply::Paused) => return Ok(()),
                Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        Err(self.no_answer("pause"))
    }

    pub fn resume(&self) -> Result<(), VcpuError> {
        self.commands
            .send(VcpuCommand::Resume)
            .map_err(|_| self.no_answer("resume"))?;
        match self.replies.recv_timeout(ANSWER_TIMEOUT) {
            Ok(VcpuReply::Resumed) => Ok(()),
            _ => Err(self.no_answer("resume")),
        }
    }

    /// The state of a paused vCPU.
    pub fn save(&self) -> Result<VcpuState, VcpuError> {
        self.commands
            .send(VcpuCommand::Save)
            .map_err(|_| self.no_answer("save"))?;
        match self.replies.recv_timeout(ANSWER_TIMEOUT) {
            Ok(VcpuReply::State(state)) => (*state).map_err(|message| VcpuError::Save {
                index: self.index,
                message,
            }),
            _ => Err(self.no_answer("save")),
        }
    }
}

/// Why a vCPU stopped running guest code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VcpuStop {
    /// KVM_EXIT_SHUTDOWN: the guest triple-faulted.
    TripleFault { rip: u64 },
    /// KVM_EXIT_INTERNAL_ERROR, for example an instruction KVM cannot emulate.
    InternalError { suberror: u32, rip: u64 },
    /// KVM_EXIT_FAIL_ENTRY: the hardware refused to enter the guest.
    FailEntry { reason: u64 },
    /// HLT reached user space (it should not, with the in-kernel irqchip).
    Halted,
    /// KVM_EXIT_SYSTEM_EVENT (shutdown, reset, crash).
    SystemEvent { kind: u32 },
    /// An exit husk does not handle.
    Unexpected(String),
    /// KVM_RUN itself failed.
    RunFailed(String),
}

impl fmt::Display for VcpuStop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VcpuStop::TripleFault { rip } => {
                write!(f, "the guest triple-faulted (KVM_EXIT_SHUTDOWN) at rip {rip:#x}")
            }
            VcpuStop::InternalError { suberror, rip } => write!(
                f,
                "KVM internal error, suberror {suberror}{} at rip {rip:#x}; map rip to a kernel symbol with `nm vmlinux`",
                if *suberror == 1 { " (instruction emulation failed)" } else { "" }
            ),
            VcpuStop::FailEntry { reason } => {
                write!(f, "KVM could not enter the guest (hardware reason {reason:#x})")
            }
            VcpuStop::Halted => write!(f, "the guest halted"),
            VcpuStop::SystemEvent { kind } => write!(f, "guest system event {kind}"),
            VcpuStop::Unexpected(exit) => write!(f, "unhandled VM exit {exit}"),
            VcpuStop::RunFailed(e) => write!(f, "KVM_RUN failed: {e}"),
        }
    }
}

/// Where a vCPU thread reports that it stopped: a channel with the reason,
/// and an eventfd that wakes the VMM's event loop.
#[derive(Debug)]
pub struct StopReporter {
    pub tx: Sender<(u8, VcpuStop)>,
    pub evt: EventFd,
}

/// One vCPU and the buses its exits are dispatched to.
#[derive(Debug)]
pub struct Vcpu {
    index: u8,
    fd: VcpuFd,
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
}

impl Vcpu {
    /// Creates vCPU `index` with its CPUID, what KVM supports (fetched once
    /// per VM by the caller) normalized under `policy` (see
    /// [`cpuid::normalize`]).
    pub fn new(
        supported: &CpuId,
        vm: &Vm,
        (index, policy): (u8, cpuid::CpuidPolicy),
        (pio, mmio): (Arc<Bus>, Arc<Bus>),
    ) -> Result<Self, VcpuError> {
        let fd = vm
            .fd()
            .create_vcpu(u64::from(index))
            .map_err(|source| VcpuError::Create { index, source })?;
        let mut cpuid = supported.clone();
        cpuid::normalize(&mut cpuid, index, policy);
        fd.set_cpuid2(&cpuid).map_err(VcpuError::SetCpuid)?;
        Ok(Vcpu {
            index,
            fd,
            pio,
            mmio,
        })
    }

    /// What KVM supports, the base of every vCPU's CPUID.
    pub fn supported_cpuid(kvm: &Kvm) -> Result<CpuId, VcpuError> {
        kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(VcpuError::SupportedCpuid)
    }

    /// Sets the 64-bit boot state with `entry` as the instruction pointer.
    /// Application processors are held in wait-for-SIPI by KVM regardless.
    pub fn configure_boot(&self, entry: u64) -> Result<(), VcpuError> {
        regs::setup_boot_vcpu(&self.fd, entry).map_err(|source| VcpuError::Regs {
            index: self.index,
            source,
        })
    }

    /// Creates vCPU `index` for a restore, without state yet: every vCPU
    /// of a VM is created before any is restored ([`Vcpu::restore`]).
    pub fn create(
        vm: &Vm,
        index: u8,
        (pio, mmio): (Arc<Bus>, Arc<Bus>),
    ) -> Result<Self, VcpuError> {
        let fd = vm
            .fd()
            .create_vcpu(u64::from(index))
            .map_err(|source| VcpuError::Create { index, source })?;
        Ok(Vcpu {
            index,
            fd,
            pio,
            mmio,
        })
    }

    /// Restores the vCPU's state from `state`, its TSC set against the VM's
    /// clock as `sync` says; returns whether its TSC runs at another rate
    /// than this host's. Only once every vCPU of the VM exists: KVM takes a
    /// vCPU's TSC write for a synchronization (keeping one TSC offset for
    /// the VM, and its master clock) only when it lands within a second of
    /// the last one written, and the creation of a vCPU writes 0.
    pub fn restore(&self, sync: TscSync, state: &VcpuState) -> Result<bool, VcpuError> {
        state
            .restore(&self.fd, sync)
            .map_err(|source| VcpuError::State {
                index: self.index,
                source,
            })
    }

    /// The vCPU's KVM file descriptor (before it runs).
    pub fn fd(&self) -> &VcpuFd {
        &self.fd
    }

    /// Starts the vCPU on `thread`. The thread runs until the guest stops
    /// this vCPU, then reports why; meanwhile the returned handle can pause
    /// it, save its state and resume it.
    pub fn start(
        self,
        thread: VcpuThread,
        reporter: StopReporter,
        timeline: Arc<Timeline>,
        msr_indices: Arc<Vec<u32>>,
    ) -> Result<VcpuHandle, VcpuError> {
        let index = self.index;
        let (cmd_tx, cmd_rx) = mpsc::channel();
        let (reply_tx, reply_rx) = mpsc::channel();
        let launch = Launch {
            vcpu: self,
            reporter,
            timeline,
            control: Control {
                commands: cmd_rx,
                replies: reply_tx,
                msr_indices,
            },
        };
        thread
            .launch
            .send(Box::new(launch))
            .map_err(|_| VcpuError::Spawn {
                index,
                source: std::io::Error::other("its thread ended before its vCPU came"),
            })?;
        Ok(VcpuHandle {
            index,
            commands: cmd_tx,
            replies: reply_rx,
            thread: thread.thread,
        })
    }

    /// Serves commands while paused; returns when resumed (or when the VMM
    /// dropped the handle, which only happens as it exits).
    fn paused(&mut self, control: &Control) {
        let _ = control.replies.send(VcpuReply::Paused);
        // Tell the guest's kvmclock it was stopped (no soft-lockup reports).
        let _ = self.fd.kvmclock_ctrl();
        while let Ok(command) = control.commands.recv() {
            match command {
                VcpuCommand::Pause => {
                    let _ = control.replies.send(VcpuReply::Paused);
                }
                VcpuCommand::Save => {
                    let state =
                        VcpuState::save(&self.fd, &control.msr_indices).map_err(|e| e.to_string());
                    let _ = control.replies.send(VcpuReply::State(Box::new(state)));
                }
                VcpuCommand::Resume => {
                    let _ = control.replies.send(VcpuReply::Resumed);
                    return;
                }
            }
        }
    }

    fn run_until_stop(&mut self, control: &Control) -> VcpuStop {
        loop {
            while let Ok(command) = control.commands.try_recv() {
                match command {
                    VcpuCommand::Pause => self.paused(control),
                    // Only meaningful while paused.
                    VcpuCommand::Resume => {
                        let _ = control.replies.send(VcpuReply::Resumed);
                    }
                    VcpuCommand::Save => {
                        let refused = Err("the vCPU is running; pause it first".to_owned());
                        let _ = control.replies.send(VcpuReply::State(Box::new(refused)));
                    }
                }
            }
            let exit = self.fd.run();
            USERSPACE_EXITS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            match exit {
                Ok(VcpuExit::IoIn(port, data)) => {
                    if !self.pio.read(u64::from(port), data) {
                        // Nothing there: an open ISA bus reads as all ones.
                        data.fill(0xff);
                    }
                }
                Ok(VcpuExit::IoOut(port, data)) => {
                    self.pio.write(u64::from(port), data);
                }
                Ok(VcpuExit::MmioRead(addr, data)) => {
                    if !self.mmio.read(addr, data) {
                        data.fill(0xff);
                    }
                }
                Ok(VcpuExit::MmioWrite(addr, data)) => {
                    self.mmio.write(addr, data);
                }
                Ok(VcpuExit::Intr) => {}
                Ok(VcpuExit::Hlt) => return VcpuStop::Halted,
                Ok(VcpuExit::Shutdown) => return VcpuStop::TripleFault { rip: self.rip() },
                Ok(VcpuExit::InternalError) => {
                    let run = self.fd.get_kvm_run();
                    // SAFETY: KVM filled the `internal` member of the union
                    // because the exit reason is KVM_EXIT_INTERNAL_ERROR.
                    let suberror = unsafe { run.__bindgen_anon_1.internal.suberror };
                    return VcpuStop::InternalError {
                        suberror,
                        rip: self.rip(),
                    };
                }
                Ok(VcpuExit::FailEntry(reason, _)) => return VcpuStop::FailEntry { reason },
                Ok(VcpuExit::SystemEvent(kind, _)) => return VcpuStop::SystemEvent { kind },
                Ok(other) => return VcpuStop::Unexpected(format!("{other:?}")),
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {}
                Err(e) => return VcpuStop::RunFailed(e.to_string()),
            }
        }
    }

    fn rip(&self) -> u64 {
        self.fd.get_regs().map(|r| r.rip).unwrap_or(u64::MAX)
    }
}
