//! CPUID as each vCPU sees it: what KVM supports, with the topology fields
//! set per vCPU and the hypervisor bit on.
//!
//! Note: on a PVM host the guest sees the host's CPUID whatever KVM_SET_CPUID2
//! says (see shared/platform.md), which is why the kernel command line there
//! also carries `clearcpuid=`.

use kvm_bindings::CpuId;

const LEAF_FEATURES: u32 = 1;
const LEAF_EXT_TOPOLOGY: u32 = 0xb;
/// CPUID.1:ECX bit 31: running under a hypervisor.
const ECX_HYPERVISOR: u32 = 1 << 31;
/// CPUID.1:EDX bit 28: HTT (the logical-processor count in EBX is valid).
const EDX_HTT: u32 = 1 << 28;
/// KVM's paravirtual feature leaf.
const LEAF_KVM_FEATURES: u32 = 0x4000_0001;
/// KVM_FEATURE_PV_UNHALT, KVM_FEATURE_PV_SEND_IPI, KVM_FEATURE_PV_SCHED_YIELD:
/// the paravirtual features a guest uses through the VMCALL hypercall.
const KVM_HYPERCALL_FEATURES: u32 = (1 << 7) | (1 << 11) | (1 << 13);

/// Adjusts the supported CPUID for vCPU `index` of `count`. On a PVM host
/// (`pvm`) the KVM features that make the guest issue hypercalls are hidden:
/// there, a VMCALL from the emulated guest kernel is retried forever at the
/// same instruction (seen as an SMP boot that hangs in `kvm_send_ipi_mask`).
pub fn patch_cpuid(cpuid: &mut CpuId, index: u8, count: u8, pvm: bool) {
    for entry in cpuid.as_mut_slice() {
        match entry.function {
            LEAF_FEATURES => {
                entry.ebx =
                    (entry.ebx & 0x0000_ffff) | (u32::from(index) << 24) | (u32::from(count) << 16);
                entry.ecx |= ECX_HYPERVISOR;
                if count > 1 {
                    entry.edx |= EDX_HTT;
                }
            }
            LEAF_EXT_TOPOLOGY => {
                // x2APIC id of this vCPU.
                entry.edx = u32::from(index);
            }
            LEAF_KVM_FEATURES if pvm => entry.eax &= !KVM_HYPERCALL_FEATURES,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    #[test]
    fn sets_apic_id_and_hypervisor_bit() {
        let mut cpuid = CpuId::from_entries(&[kvm_cpuid_entry2 {
            function: 1,
            ebx: 0xff00_0800,
            ..Default::default()
        }])
        .expect("cpuid");

        patch_cpuid(&mut cpuid, 3, 4, false);

        let e = cpuid.as_slice()[0];
        assert_eq!(e.ebx >> 24, 3);
        assert_eq!((e.ebx >> 16) & 0xff, 4);
        assert_eq!(e.ebx & 0xffff, 0x0800);
        assert_ne!(e.ecx & ECX_HYPERVISOR, 0);
    }

    #[test]
    fn hides_hypercall_features_on_pvm_only() {
        let leaf = kvm_cpuid_entry2 {
            function: LEAF_KVM_FEATURES,
            eax: 0xffff,
            ..Default::default()
        };
        let mut hw = CpuId::from_entries(&[leaf]).expect("cpuid");
        let mut pvm = CpuId::from_entries(&[leaf]).expect("cpuid");

        patch_cpuid(&mut hw, 0, 2, false);
        patch_cpuid(&mut pvm, 0, 2, true);

        assert_eq!(hw.as_slice()[0].eax, 0xffff);
        assert_eq!(pvm.as_slice()[0].eax, 0xffff & !KVM_HYPERCALL_FEATURES);
    }
}
