//! A vCPU's architectural state for snapshots, in the order KVM needs it
//! saved and restored (see the comments on each step).

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs,
};
use kvm_ioctls::{Kvm, VcpuFd};
use serde::{Deserialize, Serialize};

/// Everything KVM holds for one vCPU.
#[derive(Debug, Serialize, Deserialize)]
pub struct VcpuState {
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub debug_regs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    /// Includes MSR_IA32_TSC: restoring it continues the guest's TSC (and
    /// so its clocksource) from the snapshot instead of from host time.
    pub msrs: Vec<kvm_msr_entry>,
    pub vcpu_events: kvm_vcpu_events,
    pub tsc_khz: Option<u32>,
}

/// A failed KVM call while saving or restoring a vCPU.
#[derive(Debug, thiserror::Error)]
#[error("{op} failed: {source}")]
pub struct StateError {
    pub op: &'static str,
    pub source: kvm_ioctls::Error,
}

fn op<T>(op: &'static str, r: Result<T, kvm_ioctls::Error>) -> Result<T, StateError> {
    r.map_err(|source| StateError { op, source })
}

/// MSRs KVM lists that are not guest state, or cannot be read back and
/// written again as they are.
fn skip_msr(index: u32) -> bool {
    matches!(
        index,
        // MSR_IA32_FEATURE_CONTROL, machine check banks and control.
        0x3a | 0x179..=0x17b | 0x400..=0x47f
    )
}

/// The MSRs to save: KVM's list, less the ones above.
pub fn msrs_to_save(kvm: &Kvm) -> Result<Vec<u32>, StateError> {
    let list = op("KVM_GET_MSR_INDEX_LIST", kvm.get_msr_index_list())?;
    Ok(list
        .as_slice()
        .iter()
        .copied()
        .filter(|&i| !skip_msr(i))
        .collect())
}

/// Reads the MSRs in `indices`. KVM stops at the first it cannot read;
/// that one is left out and the rest read again.
fn get_msrs(fd: &VcpuFd, indices: &[u32]) -> Result<Vec<kvm_msr_entry>, StateError> {
    let mut saved = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(kvm_bindings::KVM_MAX_MSR_ENTRIES)];
        let entries: Vec<kvm_msr_entry> = chunk
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(|_| StateError {
            op: "building the MSR list",
            source: kvm_ioctls::Error::new(libc::EINVAL),
        })?;
        let n = op("KVM_GET_MSRS", fd.get_msrs(&mut msrs))?;
        saved.extend_from_slice(&msrs.as_slice()[..n]);
        // Entry n (if any) could not be read: skip it.
        let consumed = if n < chunk.len() { n + 1 } else { n };
        rest = &rest[consumed..];
    }
    Ok(saved)
}

impl VcpuState {
    /// Saves a paused vCPU (not in KVM_RUN).
    pub fn save(fd: &VcpuFd, msr_indices: &[u32]) -> Result<Self, StateError> {
        // MP state first: reading it can flush LAPIC state KVM keeps elsewhere.
        let mp_state = op("KVM_GET_MP_STATE", fd.get_mp_state())?;
        let regs = op("KVM_GET_REGS", fd.get_regs())?;
        let sregs = op("KVM_GET_SREGS", fd.get_sregs())?;
        let xsave = op("KVM_GET_XSAVE", fd.get_xsave())?;
        let xcrs = op("KVM_GET_XCRS", fd.get_xcrs())?;
        let debug_regs = op("KVM_GET_DEBUGREGS", fd.get_debug_regs())?;
        let lapic = op("KVM_GET_LAPIC", fd.get_lapic())?;
        let tsc_khz = fd.get_tsc_khz().ok();
        let cpuid = op(
            "KVM_GET_CPUID2",
            fd.get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES),
        )?
        .as_slice()
        .to_vec();
        let msrs = get_msrs(fd, msr_indices)?;
        // Events last: the other reads do not disturb pending exceptions.
        let vcpu_events = op("KVM_GET_VCPU_EVENTS", fd.get_vcpu_events())?;
        Ok(VcpuState {
            cpuid,
            mp_state,
            regs,
            sregs,
            xsave,
            xcrs,
            debug_regs,
            lapic,
            msrs,
            vcpu_events,
            tsc_khz,
        })
    }

    /// Restores onto a fresh vCPU of a VM whose irqchip exists.
    pub fn restore(&self, fd: &VcpuFd) -> Result<(), StateError> {
        let cpuid = CpuId::from_entries(&self.cpuid).map_err(|_| StateError {
            op: "building the CPUID",
            source: kvm_ioctls::Error::new(libc::EINVAL),
        })?;
        op("KVM_SET_CPUID2", fd.set_cpuid2(&cpuid))?;
        if let Some(khz) = self.tsc_khz {
            // Same frequency as when saved, or the guest's clock runs wrong.
            if fd.get_tsc_khz().ok() != Some(khz) {
                op("KVM_SET_TSC_KHZ", fd.set_tsc_khz(khz))?;
            }
        }
        op("KVM_SET_MP_STATE", fd.set_mp_state(self.mp_state))?;
        op("KVM_SET_REGS", fd.set_regs(&self.regs))?;
        op("KVM_SET_SREGS", fd.set_sregs(&self.sregs))?;
        op("KVM_SET_XSAVE", {
            // SAFETY: the buffer came from KVM_GET_XSAVE of the same size.
            unsafe { fd.set_xsave(&self.xsave) }
        })?;
        op("KVM_SET_XCRS", fd.set_xcrs(&self.xcrs))?;
        op("KVM_SET_DEBUGREGS", fd.set_debug_regs(&self.debug_regs))?;
        // After the sregs (APIC base), before the MSRs (TSC deadline).
        op("KVM_SET_LAPIC", fd.set_lapic(&self.lapic))?;
        for chunk in self.msrs.chunks(kvm_bindings::KVM_MAX_MSR_ENTRIES) {
            let msrs = Msrs::from_entries(chunk).map_err(|_| StateError {
                op: "building the MSR list",
                source: kvm_ioctls::Error::new(libc::EINVAL),
            })?;
            let n = op("KVM_SET_MSRS", fd.set_msrs(&msrs))?;
            if n != chunk.len() {
                return Err(StateError {
                    op: "KVM_SET_MSRS (MSR refused)",
                    source: kvm_ioctls::Error::new(libc::EINVAL),
                });
            }
        }
        // Last: setting the registers clears pending exceptions.
        op("KVM_SET_VCPU_EVENTS", fd.set_vcpu_events(&self.vcpu_events))?;
        Ok(())
    }
}
