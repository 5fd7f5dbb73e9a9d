//! CPUID as each vCPU sees it: what KVM supports, normalized the way
//! Firecracker's templates do it. A guest is told it runs under a
//! hypervisor, sees a topology that matches its vCPU count (one thread per
//! core, one package), no nested virtualization unless its operator asked
//! for it, no performance counters, and no power-management or thermal
//! features of the host.
//!
//! A snapshot keeps each vCPU's CPUID; [`missing_features`] says what a
//! restoring host cannot offer of it, so such a restore is refused before a
//! guest runs instead of faulting later on an instruction the host lacks.
//!
//! Note: on a PVM host the guest sees the host's CPUID whatever KVM_SET_CPUID2
//! says (see shared/platform.md), which is why the kernel command line there
//! also carries `clearcpuid=`.

use kvm_bindings::{kvm_cpuid_entry2, CpuId};

const LEAF_FEATURES: u32 = 1;
const LEAF_CACHE_PARAMS: u32 = 4;
const LEAF_MONITOR: u32 = 5;
const LEAF_POWER: u32 = 6;
const LEAF_EXT_FEATURES: u32 = 7;
const LEAF_PMU: u32 = 0xa;
const LEAF_EXT_TOPOLOGY: u32 = 0xb;
const LEAF_XSAVE: u32 = 0xd;
const LEAF_EXT_TOPOLOGY_V2: u32 = 0x1f;
const LEAF_AMD_FEATURES: u32 = 0x8000_0001;
const LEAF_AMD_POWER: u32 = 0x8000_0007;
const LEAF_AMD_SIZES: u32 = 0x8000_0008;
const LEAF_AMD_SVM: u32 = 0x8000_000a;
const LEAF_AMD_CACHE_TOPOLOGY: u32 = 0x8000_001d;
const LEAF_AMD_EXT_APIC: u32 = 0x8000_001e;

/// CPUID.1:ECX bit 5: VMX (Intel's hardware virtualization).
const ECX_VMX: u32 = 1 << 5;
/// CPUID.1:ECX bits 3 (MONITOR), 7 (EST), 8 (TM2): not a guest's business.
const ECX_POWER: u32 = (1 << 3) | (1 << 7) | (1 << 8);
/// CPUID.1:ECX bit 27: OSXSAVE, which KVM sets from the guest's CR4.
const ECX_OSXSAVE: u32 = 1 << 27;
/// CPUID.1:ECX bit 31: running under a hypervisor.
const ECX_HYPERVISOR: u32 = 1 << 31;
/// CPUID.1:EDX bits 22 (ACPI thermal), 29 (TM), 31 (PBE).
const EDX_POWER: u32 = (1 << 22) | (1 << 29) | (1 << 31);
/// CPUID.1:EDX bit 9: APIC, which KVM clears while the guest has its APIC off.
const EDX_APIC: u32 = 1 << 9;
/// CPUID.1:EDX bit 28: HTT (the logical-processor count in EBX is valid).
const EDX_HTT: u32 = 1 << 28;
/// CPUID.7.0:ECX bit 4: OSPKE, which KVM sets from the guest's CR4.
const ECX7_OSPKE: u32 = 1 << 4;
/// CPUID.6:EAX bit 2: ARAT (the APIC timer runs in deep C-states): kept.
const EAX6_ARAT: u32 = 1 << 2;
/// CPUID.80000001h:ECX bit 2: SVM (AMD's hardware virtualization).
const ECX_SVM: u32 = 1 << 2;
/// CPUID.80000007h:EDX bit 8: invariant TSC (the guest may use the TSC as
/// its clocksource): the one power-management bit kept.
const EDX_INVARIANT_TSC: u32 = 1 << 8;
/// KVM's paravirtual feature leaf.
const LEAF_KVM_FEATURES: u32 = 0x4000_0001;
/// KVM_FEATURE_PV_UNHALT, KVM_FEATURE_PV_SEND_IPI, KVM_FEATURE_PV_SCHED_YIELD:
/// the paravirtual features a guest uses through the VMCALL hypercall.
const KVM_HYPERCALL_FEATURES: u32 = (1 << 7) | (1 << 11) | (1 << 13);

/// What a VM's CPUID is normalized for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuidPolicy {
    /// How many vCPUs the VM has.
    pub vcpus: u8,
    /// An emulating (PVM) host: see [`normalize`].
    pub pvm: bool,
    /// Offer the host's VMX or SVM to the guest (nested virtualization).
    pub nested: bool,
}

/// Bits in `log2(n)` rounded up: the width of an APIC id field for `n`.
fn id_bits(n: u8) -> u32 {
    u32::from(n).next_power_of_two().trailing_zeros()
}

/// Normalizes the supported CPUID for vCPU `index` under `policy`. On a
/// PVM host the KVM features that make the guest issue hypercalls are also
/// hidden: there, a VMCALL from the emulated guest kernel is retried forever
/// at the same instruction (seen as an SMP boot that hangs in
/// `kvm_send_ipi_mask`).
pub fn normalize(cpuid: &mut CpuId, index: u8, policy: CpuidPolicy) {
    let count = policy.vcpus.max(1);
    let apic_id = u32::from(index);
    let others = u32::from(count - 1);
    for entry in cpuid.as_mut_slice() {
        match entry.function {
            LEAF_FEATURES => {
                entry.ebx = (entry.ebx & 0x0000_ffff) | (apic_id << 24) | (u32::from(count) << 16);
                entry.ecx |= ECX_HYPERVISOR;
                entry.ecx &= !ECX_POWER;
                if !policy.nested {
                    entry.ecx &= !ECX_VMX;
                }
                entry.edx &= !EDX_POWER;
                if count > 1 {
                    entry.edx |= EDX_HTT;
                }
            }
            LEAF_CACHE_PARAMS => {
                // EAX[31:26]: cores in the package - 1; EAX[25:14]: logical
                // processors sharing this cache - 1 (L1 and L2 per core, L3
                // shared by all).
                let level = (entry.eax >> 5) & 0x7;
                let sharing = if level >= 3 { others } else { 0 };
                entry.eax =
                    (entry.eax & 0x3fff) | (others.min(63) << 26) | (sharing.min(0xfff) << 14);
            }
            LEAF_MONITOR | LEAF_PMU => {
                (entry.eax, entry.ebx, entry.ecx, entry.edx) = (0, 0, 0, 0);
            }
            LEAF_POWER => {
                entry.eax &= EAX6_ARAT;
                (entry.ebx, entry.ecx, entry.edx) = (0, 0, 0);
            }
            LEAF_EXT_TOPOLOGY | LEAF_EXT_TOPOLOGY_V2 => {
                // Level 0: threads (one per core); level 1: cores (all of
                // them in one package); then none.
                let level = entry.index;
                (entry.eax, entry.ebx, entry.ecx) = match level {
                    0 => (0, 1, 1 << 8),
                    1 => (id_bits(count), u32::from(count), (2 << 8) | 1),
                    _ => (0, 0, level & 0xff),
                };
                entry.edx = apic_id;
            }
            LEAF_AMD_FEATURES if !policy.nested => entry.ecx &= !ECX_SVM,
            LEAF_AMD_POWER => {
                entry.edx &= EDX_INVARIANT_TSC;
                (entry.eax, entry.ebx, entry.ecx) = (0, 0, 0);
            }
            LEAF_AMD_SIZES => {
                // ECX[15:12]: APIC id bits for cores; ECX[7:0]: cores - 1.
                entry.ecx = (id_bits(count) << 12) | others;
            }
            LEAF_AMD_SVM if !policy.nested => {
                (entry.eax, entry.ebx, entry.ecx, entry.edx) = (0, 0, 0, 0);
            }
            LEAF_AMD_CACHE_TOPOLOGY => {
                let level = (entry.eax >> 5) & 0x7;
                let sharing = if level >= 3 { others } else { 0 };
                entry.eax = (entry.eax & !(0xfff << 14)) | (sharing.min(0xfff) << 14);
            }
            LEAF_AMD_EXT_APIC => {
                // One thread per compute unit, one node.
                (entry.eax, entry.ebx, entry.ecx) = (apic_id, apic_id & 0xff, 0);
            }
            LEAF_KVM_FEATURES if policy.pvm => entry.eax &= !KVM_HYPERCALL_FEATURES,
            _ => {}
        }
    }
}

/// One word of feature bits: leaf, subleaf, register, and names for its bits.
struct FeatureWord {
    leaf: u32,
    subleaf: u32,
    reg: Reg,
    /// Bits KVM changes at run time from the guest's own settings: a saved
    /// CPUID may have them where the supported one does not.
    runtime: u32,
    names: &'static [(u32, &'static str)],
}

#[derive(Clone, Copy)]
enum Reg {
    Eax,
    Ebx,
    Ecx,
    Edx,
}

impl Reg {
    fn of(self, e: &kvm_cpuid_entry2) -> u32 {
        match self {
            Reg::Eax => e.eax,
            Reg::Ebx => e.ebx,
            Reg::Ecx => e.ecx,
            Reg::Edx => e.edx,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Reg::Eax => "EAX",
            Reg::Ebx => "EBX",
            Reg::Ecx => "ECX",
            Reg::Edx => "EDX",
        }
    }
}

/// The feature words a restore checks, with Linux's names for the bits a
/// guest is most likely to depend on.
const FEATURE_WORDS: &[FeatureWord] = &[
    FeatureWord {
        leaf: LEAF_FEATURES,
        subleaf: 0,
        reg: Reg::Ecx,
        runtime: ECX_OSXSAVE,
        names: &[
            (0, "pni"),
            (1, "pclmulqdq"),
            (5, "vmx"),
            (9, "ssse3"),
            (12, "fma"),
            (13, "cx16"),
            (19, "sse4_1"),
            (20, "sse4_2"),
            (21, "x2apic"),
            (22, "movbe"),
            (23, "popcnt"),
            (25, "aes"),
            (26, "xsave"),
            (28, "avx"),
            (29, "f16c"),
            (30, "rdrand"),
        ],
    },
    FeatureWord {
        leaf: LEAF_FEATURES,
        subleaf: 0,
        reg: Reg::Edx,
        runtime: EDX_APIC,
        names: &[(4, "tsc"), (25, "sse"), (26, "sse2")],
    },
    FeatureWord {
        leaf: LEAF_EXT_FEATURES,
        subleaf: 0,
        reg: Reg::Ebx,
        runtime: 0,
        names: &[
            (0, "fsgsbase"),
            (3, "bmi1"),
            (5, "avx2"),
            (8, "bmi2"),
            (9, "erms"),
            (16, "avx512f"),
            (17, "avx512dq"),
            (18, "rdseed"),
            (19, "adx"),
            (26, "avx512pf"),
            (27, "avx512er"),
            (29, "sha_ni"),
            (30, "avx512bw"),
            (31, "avx512vl"),
        ],
    },
    FeatureWord {
        leaf: LEAF_EXT_FEATURES,
        subleaf: 0,
        reg: Reg::Ecx,
        runtime: ECX7_OSPKE,
        names: &[
            (1, "avx512vbmi"),
            (3, "pku"),
            (8, "gfni"),
            (9, "vaes"),
            (10, "vpclmulqdq"),
            (11, "avx512_vnni"),
        ],
    },
    FeatureWord {
        leaf: LEAF_EXT_FEATURES,
        subleaf: 0,
        reg: Reg::Edx,
        runtime: 0,
        names: &[
            (2, "avx512_4vnniw"),
            (3, "avx512_4fmaps"),
            (4, "fsrm"),
            (24, "amx_tile"),
            (25, "amx_int8"),
        ],
    },
    FeatureWord {
        leaf: LEAF_EXT_FEATURES,
        subleaf: 1,
        reg: Reg::Eax,
        runtime: 0,
        names: &[(4, "avx_vnni"), (5, "avx512_bf16")],
    },
    FeatureWord {
        leaf: LEAF_XSAVE,
        subleaf: 0,
        reg: Reg::Eax,
        runtime: 0,
        names: &[
            (2, "xstate avx"),
            (5, "xstate avx512 opmask"),
            (6, "xstate avx512 zmm_hi256"),
            (7, "xstate avx512 hi16_zmm"),
            (9, "xstate pkru"),
            (17, "xstate amx tilecfg"),
            (18, "xstate amx tiledata"),
        ],
    },
    FeatureWord {
        leaf: LEAF_XSAVE,
        subleaf: 1,
        reg: Reg::Eax,
        runtime: 0,
        names: &[(0, "xsaveopt"), (1, "xsavec"), (3, "xsaves")],
    },
    FeatureWord {
        leaf: LEAF_AMD_FEATURES,
        subleaf: 0,
        reg: Reg::Ecx,
        runtime: 0,
        names: &[(0, "lahf_lm"), (2, "svm"), (5, "abm"), (6, "sse4a")],
    },
    FeatureWord {
        leaf: LEAF_AMD_FEATURES,
        subleaf: 0,
        reg: Reg::Edx,
        runtime: EDX_APIC,
        names: &[(11, "syscall"), (20, "nx"), (27, "rdtscp"), (29, "lm")],
    },
];

/// What this CPU's own CPUID instruction returns for the leaves
/// [`missing_features`] checks: what a guest sees on a PVM host, where
/// KVM_SET_CPUID2 filters nothing (and KVM_GET_CPUID2 reports the host's
/// CPUID, not the one set). Only those leaves: each CPUID traps to the
/// hypervisor below a PVM host (tens of microseconds on a restore's path).
pub fn native_features() -> Vec<kvm_cpuid_entry2> {
    let mut entries: Vec<kvm_cpuid_entry2> = Vec::new();
    for word in FEATURE_WORDS {
        if find(&entries, word.leaf, word.subleaf).is_some() {
            continue;
        }
        let r = std::arch::x86_64::__cpuid_count(word.leaf, word.subleaf);
        entries.push(kvm_cpuid_entry2 {
            function: word.leaf,
            index: word.subleaf,
            eax: r.eax,
            ebx: r.ebx,
            ecx: r.ecx,
            edx: r.edx,
            ..Default::default()
        });
    }
    entries
}

fn find(entries: &[kvm_cpuid_entry2], leaf: u32, subleaf: u32) -> Option<&kvm_cpuid_entry2> {
    // Leaves without subleaves have index 0 in KVM's list.
    entries
        .iter()
        .find(|e| e.function == leaf && e.index == subleaf)
}

/// The features in `saved` (a snapshot's CPUID) that `offered` (what this
/// host would give the same vCPU, normalized alike) lacks, by name (or by
/// leaf, register and bit where the bit has no name here).
pub fn missing_features(saved: &[kvm_cpuid_entry2], offered: &[kvm_cpuid_entry2]) -> Vec<String> {
    let mut missing = Vec::new();
    for word in FEATURE_WORDS {
        let Some(had) = find(saved, word.leaf, word.subleaf).map(|e| word.reg.of(e)) else {
            continue;
        };
        let has = find(offered, word.leaf, word.subleaf).map_or(0, |e| word.reg.of(e));
        let lacking = had & !has & !word.runtime;
        for bit in (0..32).filter(|b| lacking & (1 << b) != 0) {
            missing.push(match word.names.iter().find(|(b, _)| *b == bit) {
                Some((_, name)) => (*name).to_owned(),
                None => format!(
                    "CPUID.{:#x}.{}:{} bit {bit}",
                    word.leaf,
                    word.subleaf,
                    word.reg.name()
                ),
            });
        }
    }
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    const HW: CpuidPolicy = CpuidPolicy {
        vcpus: 4,
        pvm: false,
        nested: false,
    };

    fn leaf(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            ..Default::default()
        }
    }

    fn normalized(
        entries: &[kvm_cpuid_entry2],
        index: u8,
        policy: CpuidPolicy,
    ) -> Vec<kvm_cpuid_entry2> {
        let mut cpuid = CpuId::from_entries(entries).expect("cpuid");
        normalize(&mut cpuid, index, policy);
        cpuid.as_slice().to_vec()
    }

    #[test]
    fn sets_apic_id_count_and_hypervisor_bit() {
        let e = kvm_cpuid_entry2 {
            ebx: 0xff00_0800,
            ..leaf(LEAF_FEATURES, 0)
        };

        let e = normalized(&[e], 3, HW)[0];

        assert_eq!(e.ebx >> 24, 3);
        assert_eq!((e.ebx >> 16) & 0xff, 4);
        assert_eq!(e.ebx & 0xffff, 0x0800);
        assert_ne!(e.ecx & ECX_HYPERVISOR, 0);
        assert_ne!(e.edx & EDX_HTT, 0);
    }

    #[test]
    fn hides_vmx_and_svm_unless_nested_is_asked_for() {
        let entries = [
            kvm_cpuid_entry2 {
                ecx: ECX_VMX,
                ..leaf(LEAF_FEATURES, 0)
            },
            kvm_cpuid_entry2 {
                ecx: ECX_SVM,
                ..leaf(LEAF_AMD_FEATURES, 0)
            },
            kvm_cpuid_entry2 {
                eax: 1,
                ebx: 0x8000,
                edx: 0x1ff,
                ..leaf(LEAF_AMD_SVM, 0)
            },
        ];
        let nested = CpuidPolicy { nested: true, ..HW };

        let plain = normalized(&entries, 0, HW);
        let with = normalized(&entries, 0, nested);

        assert_eq!(plain[0].ecx & ECX_VMX, 0);
        assert_eq!(plain[1].ecx & ECX_SVM, 0);
        assert_eq!((plain[2].eax, plain[2].ebx, plain[2].edx), (0, 0, 0));
        assert_eq!(with[0].ecx & ECX_VMX, ECX_VMX);
        assert_eq!(with[1].ecx & ECX_SVM, ECX_SVM);
        assert_eq!(with[2].edx, 0x1ff);
    }

    #[test]
    fn topology_matches_the_vcpu_count() {
        let entries = [
            kvm_cpuid_entry2 {
                eax: 0xffff_ffff,
                ebx: 0xffff_ffff,
                ecx: 0xffff_ffff,
                ..leaf(LEAF_EXT_TOPOLOGY, 0)
            },
            leaf(LEAF_EXT_TOPOLOGY, 1),
            leaf(LEAF_EXT_TOPOLOGY, 2),
            kvm_cpuid_entry2 {
                eax: (3 << 5) | 0xfc00_0000,
                ..leaf(LEAF_CACHE_PARAMS, 3)
            },
            kvm_cpuid_entry2 {
                ecx: 0xffff,
                ..leaf(LEAF_AMD_SIZES, 0)
            },
        ];

        let e = normalized(&entries, 2, CpuidPolicy { vcpus: 3, ..HW });

        assert_eq!((e[0].eax, e[0].ebx, e[0].ecx, e[0].edx), (0, 1, 0x100, 2));
        assert_eq!((e[1].eax, e[1].ebx, e[1].ecx, e[1].edx), (2, 3, 0x201, 2));
        assert_eq!((e[2].eax, e[2].ebx, e[2].ecx), (0, 0, 2));
        assert_eq!(e[3].eax >> 26, 2);
        assert_eq!((e[3].eax >> 14) & 0xfff, 2);
        assert_eq!(e[4].ecx, (2 << 12) | 2);
    }

    #[test]
    fn power_management_is_hidden_but_the_invariant_tsc_kept() {
        let entries = [
            kvm_cpuid_entry2 {
                eax: 0xffff_ffff,
                ecx: 1,
                ..leaf(LEAF_POWER, 0)
            },
            kvm_cpuid_entry2 {
                eax: 0xff,
                edx: 0xffff,
                ..leaf(LEAF_AMD_POWER, 0)
            },
            kvm_cpuid_entry2 {
                eax: 0x0704_0802,
                ..leaf(LEAF_PMU, 0)
            },
        ];

        let e = normalized(&entries, 0, HW);

        assert_eq!((e[0].eax, e[0].ecx), (EAX6_ARAT, 0));
        assert_eq!((e[1].eax, e[1].edx), (0, EDX_INVARIANT_TSC));
        assert_eq!(e[2].eax, 0);
    }

    #[test]
    fn hides_hypercall_features_on_pvm_only() {
        let l = kvm_cpuid_entry2 {
            eax: 0xffff,
            ..leaf(LEAF_KVM_FEATURES, 0)
        };

        let hw = normalized(&[l], 0, HW);
        let pvm = normalized(&[l], 0, CpuidPolicy { pvm: true, ..HW });

        assert_eq!(hw[0].eax, 0xffff);
        assert_eq!(pvm[0].eax, 0xffff & !KVM_HYPERCALL_FEATURES);
    }

    #[test]
    fn a_feature_the_host_lacks_is_named() {
        let saved = [
            kvm_cpuid_entry2 {
                ebx: (1 << 5) | (1 << 16) | (1 << 1),
                ..leaf(LEAF_EXT_FEATURES, 0)
            },
            kvm_cpuid_entry2 {
                ecx: ECX_OSXSAVE | (1 << 28),
                ..leaf(LEAF_FEATURES, 0)
            },
        ];
        let offered = [
            kvm_cpuid_entry2 {
                ebx: 1 << 5,
                ..leaf(LEAF_EXT_FEATURES, 0)
            },
            kvm_cpuid_entry2 {
                ecx: 1 << 28,
                ..leaf(LEAF_FEATURES, 0)
            },
        ];

        let missing = missing_features(&saved, &offered);

        assert_eq!(missing, ["CPUID.0x7.0:EBX bit 1", "avx512f"]);
        assert!(missing_features(&offered, &offered).is_empty());
    }
}
