//! The KVM VM: address-space layout, in-kernel interrupt controllers and the
//! PIT, and guest memory registration.

use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::arch::x86_64::layout::KVM_TSS_ADDRESS;

/// Errors creating and configuring the VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("KVM_CREATE_VM failed: {0}")]
    Create(kvm_ioctls::Error),
    #[error("KVM_SET_TSS_ADDR failed: {0}")]
    TssAddress(kvm_ioctls::Error),
    #[error("KVM_CREATE_IRQCHIP failed: {0}")]
    Irqchip(kvm_ioctls::Error),
    #[error("KVM_CREATE_PIT2 failed: {0}")]
    Pit(kvm_ioctls::Error),
    #[error("KVM_SET_USER_MEMORY_REGION for slot {slot} failed: {source}")]
    MemoryRegion {
        slot: u32,
        source: kvm_ioctls::Error,
    },
    #[error("guest memory has more regions ({0}) than KVM has memory slots ({1})")]
    TooManyRegions(usize, usize),
}

/// A VM with its interrupt controllers.
#[derive(Debug)]
pub struct Vm {
    fd: VmFd,
}

impl Vm {
    /// Creates the VM, its IOAPIC/PIC/LAPICs and the PIT.
    pub fn new(kvm: &Kvm) -> Result<Self, VmError> {
        let fd = kvm.create_vm().map_err(VmError::Create)?;
        fd.set_tss_address(KVM_TSS_ADDRESS as usize)
            .map_err(VmError::TssAddress)?;
        fd.create_irq_chip().map_err(VmError::Irqchip)?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        fd.create_pit2(pit).map_err(VmError::Pit)?;
        Ok(Vm { fd })
    }

    /// Registers every guest memory region with KVM, one slot each.
    pub fn register_memory(&self, kvm: &Kvm, mem: &GuestMemoryMmap) -> Result<(), VmError> {
        let slots = kvm.get_nr_memslots();
        if mem.num_regions() > slots {
            return Err(VmError::TooManyRegions(mem.num_regions(), slots));
        }
        for (slot, region) in mem.iter().enumerate() {
            let slot = slot as u32;
            let region = kvm_userspace_memory_region {
                slot,
                flags: 0,
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

    /// The KVM VM file descriptor.
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }
}
