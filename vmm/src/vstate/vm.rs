//! The KVM VM: address-space layout, in-kernel interrupt controllers, and
//! guest memory registration.

use crate::vstate::memory::GuestMemoryMmap;
use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_userspace_memory_region, KVM_IRQCHIP_IOAPIC,
    KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_MEM_LOG_DIRTY_PAGES,
};
use kvm_ioctls::{Kvm, VmFd};
use serde::{Deserialize, Serialize};
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryRegion};

use crate::arch::x86_64::layout::KVM_TSS_ADDRESS;
use crate::timeline::monotonic_ns;
use crate::vstate::vcpu_state::TscSync;

/// Errors creating and configuring the VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("KVM_CREATE_VM failed: {0}")]
    Create(kvm_ioctls::Error),
    #[error("KVM_SET_TSS_ADDR failed: {0}")]
    TssAddress(kvm_ioctls::Error),
    #[error("KVM_CREATE_IRQCHIP failed: {0}")]
    Irqchip(kvm_ioctls::Error),
    #[error("KVM_SET_USER_MEMORY_REGION for slot {slot} failed: {source}")]
    MemoryRegion {
        slot: u32,
        source: kvm_ioctls::Error,
    },
    #[error("KVM_GET_DIRTY_LOG failed: {0}")]
    DirtyLog(kvm_ioctls::Error),
    #[error("guest memory has more regions ({0}) than KVM has memory slots ({1})")]
    TooManyRegions(usize, usize),
}

/// The VM-wide state KVM holds: interrupt controllers and kvmclock.
#[derive(Debug, Serialize, Deserialize)]
pub struct VmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    /// kvmclock when saved: restored as is, so the guest's clock continues
    /// from the snapshot rather than jumping by the snapshot's age.
    pub clock: kvm_clock_data,
    /// The host's CLOCK_MONOTONIC (ns) when `clock` was read (see
    /// `vcpu_state::TscSync`).
    pub clock_read_ns: u64,
}

/// A failed KVM call while saving or restoring the VM.
#[derive(Debug, thiserror::Error)]
#[error("{op} failed: {source}")]
pub struct VmStateError {
    pub op: &'static str,
    pub source: kvm_ioctls::Error,
}

/// A VM with its interrupt controllers.
#[derive(Debug)]
pub struct Vm {
    fd: VmFd,
}

impl Vm {
    /// Creates the VM. Its interrupt controllers come after its memory
    /// (`create_devices`): KVM registers a memory slot ~60x faster on a VM
    /// without them (0.1 ms instead of 6-7 ms for 128 MiB, measured on the
    /// PVM build hosts), which is most of a restore's host time.
    pub fn new(kvm: &Kvm) -> Result<Self, VmError> {
        let fd = kvm.create_vm().map_err(VmError::Create)?;
        Ok(Vm { fd })
    }

    /// Creates the IOAPIC/PIC/LAPICs (after the memory).
    ///
    /// No PIT, as in Cloud Hypervisor: the guest keeps time with kvmclock
    /// and the LAPIC's TSC-deadline timer (`clocksource=kvm-clock
    /// no_timer_check` on its command line; IRQ 0 never fires in it) and
    /// reads the TSC frequency from kvmclock, not by calibrating against
    /// the PIT. KVM_CREATE_PIT2 starts a kernel thread (`kvm-pit/PID`) per
    /// VM and waits until kthreadd has created it and it has run: 0.15 ms
    /// on a quiet host, 2-13 ms with both cores of a PVM host busy, where
    /// it was most of a restore's variance, and one more thread per parked
    /// sandbox. Ports 0x40-0x43 read as an empty ISA bus.
    pub fn create_devices(&self) -> Result<(), VmError> {
        self.fd
            .set_tss_address(KVM_TSS_ADDRESS as usize)
            .map_err(VmError::TssAddress)?;
        self.fd.create_irq_chip().map_err(VmError::Irqchip)?;
        Ok(())
    }

    /// Registers every guest memory region with KVM, one slot each, with
    /// dirty-page logging on if asked (a restored VM logs from the start).
    pub fn register_memory(
        &self,
        kvm: &Kvm,
        mem: &GuestMemoryMmap,
        dirty_logging: bool,
    ) -> Result<(), VmError> {
        let slots = kvm.get_nr_memslots();
        if mem.num_regions() > slots {
            return Err(VmError::TooManyRegions(mem.num_regions(), slots));
        }
        self.set_dirty_logging(mem, dirty_logging)
    }

    /// Turns KVM's dirty-page logging on or off for every memory slot.
    pub fn set_dirty_logging(&self, mem: &GuestMemoryMmap, on: bool) -> Result<(), VmError> {
        self.set_slots(mem, if on { KVM_MEM_LOG_DIRTY_PAGES } else { 0 })
    }

    /// Sets slot i to region i of `mem` with `flags` (a slot that exists
    /// keeps its mapping; only its flags change).
    fn set_slots(&self, mem: &GuestMemoryMmap, flags: u32) -> Result<(), VmError> {
        for (slot, region) in mem.iter().enumerate() {
            let slot = slot as u32;
            let region = kvm_userspace_memory_region {
                slot,
                flags,
                guest_phys_addr: region.start_addr().raw_value(),
                memory_size: region.len(),
                userspace_addr: region.as_ptr() as u64,
            };
            // SAFETY: the region is a live mapping owned by `mem`, which the
            // Vmm keeps alive for as long as the VM (and so KVM's use of it) exists.
            unsafe { self.fd.set_user_memory_region(region) }
                .map_err(|source| VmError::MemoryRegion { slot, source })?;
        }
        Ok(())
    }

    /// The pages the guest wrote since the last call, one bitmap per slot
    /// (KVM clears its log as it returns it).
    pub fn dirty_log(&self, mem: &GuestMemoryMmap) -> Result<Vec<Vec<u64>>, VmError> {
        mem.iter()
            .enumerate()
            .map(|(slot, region)| {
                self.fd
                    .get_dirty_log(slot as u32, region.len() as usize)
                    .map_err(VmError::DirtyLog)
            })
            .collect()
    }

    /// Saves the VM-wide state (vCPUs paused).
    pub fn save_state(&self) -> Result<VmState, VmStateError> {
        let chip = |id| {
            let mut chip = kvm_irqchip {
                chip_id: id,
                ..Default::default()
            };
            self.fd.get_irqchip(&mut chip).map(|()| chip)
        };
        let op = |op, source| VmStateError { op, source };
        let before = monotonic_ns();
        let clock = self.fd.get_clock().map_err(|e| op("KVM_GET_CLOCK", e))?;
        let after = monotonic_ns();
        Ok(VmState {
            pic_master: chip(KVM_IRQCHIP_PIC_MASTER).map_err(|e| op("KVM_GET_IRQCHIP", e))?,
            pic_slave: chip(KVM_IRQCHIP_PIC_SLAVE).map_err(|e| op("KVM_GET_IRQCHIP", e))?,
            ioapic: chip(KVM_IRQCHIP_IOAPIC).map_err(|e| op("KVM_GET_IRQCHIP", e))?,
            clock,
            clock_read_ns: before + (after - before) / 2,
        })
    }

    /// Restores the VM-wide state onto this (new) VM; returns where the
    /// vCPUs' TSCs stand against the clock it set.
    pub fn restore_state(&self, state: &VmState) -> Result<TscSync, VmStateError> {
        let op = |op, source| VmStateError { op, source };
        // Only the clock value: flags such as KVM_CLOCK_TSC_STABLE are
        // KVM's to report, not ours to set.
        let clock = kvm_clock_data {
            clock: state.clock.clock,
            ..Default::default()
        };
        let before = monotonic_ns();
        self.fd
            .set_clock(&clock)
            .map_err(|e| op("KVM_SET_CLOCK", e))?;
        let after = monotonic_ns();
        for chip in [&state.pic_master, &state.pic_slave, &state.ioapic] {
            self.fd
                .set_irqchip(chip)
                .map_err(|e| op("KVM_SET_IRQCHIP", e))?;
        }
        Ok(TscSync {
            clock_read_ns: state.clock_read_ns,
            clock_set_ns: before + (after - before) / 2,
        })
    }

    /// The KVM VM file descriptor.
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }
}
