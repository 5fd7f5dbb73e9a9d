//! vCPUs: creation, boot configuration and the run loop, one thread each.

use std::fmt;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::thread::JoinHandle;

use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};
use vmm_sys_util::eventfd::EventFd;

use crate::arch::x86_64::{cpuid, regs};
use crate::devices::bus::Bus;
use crate::timeline::{Phase, Timeline};
use crate::vstate::vm::Vm;

/// VM exits that reached the VMM (KVM_RUN returned), over all vCPUs. One VM
/// per process, so a process-wide counter is the VM's.
pub static USERSPACE_EXITS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

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
    /// Creates vCPU `index` of `count` with its CPUID, derived from what KVM
    /// supports (fetched once per VM by the caller; `pvm`: see
    /// [`cpuid::patch_cpuid`]).
    pub fn new(
        supported: &CpuId,
        vm: &Vm,
        (index, count, pvm): (u8, u8, bool),
        (pio, mmio): (Arc<Bus>, Arc<Bus>),
    ) -> Result<Self, VcpuError> {
        let fd = vm
            .fd()
            .create_vcpu(u64::from(index))
            .map_err(|source| VcpuError::Create { index, source })?;
        let mut cpuid = supported.clone();
        cpuid::patch_cpuid(&mut cpuid, index, count, pvm);
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

    /// Starts the vCPU on its own thread. The thread runs until the guest
    /// stops this vCPU, then reports why.
    pub fn start(
        mut self,
        reporter: StopReporter,
        timeline: Arc<Timeline>,
    ) -> Result<JoinHandle<()>, VcpuError> {
        let index = self.index;
        std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || {
                if index == 0 {
                    timeline.mark(Phase::FirstKvmRun);
                }
                let stop = self.run_until_stop();
                // The receiver only disappears when the VMM is exiting anyway.
                let _ = reporter.tx.send((index, stop));
                let _ = reporter.evt.write(1);
            })
            .map_err(|source| VcpuError::Spawn { index, source })
    }

    fn run_until_stop(&mut self) -> VcpuStop {
        loop {
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
