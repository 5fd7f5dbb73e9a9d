//! Boot-time register state of a vCPU entering the 64-bit Linux kernel.

use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_sregs, Msrs};
use kvm_ioctls::VcpuFd;

use super::boot::{segment_from_gdt, BOOT_GDT};
use super::layout::*;

const X86_CR0_PE: u64 = 1 << 0;
const X86_CR0_PG: u64 = 1 << 31;
const X86_CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_IA32_MISC_ENABLE_FAST_STRING: u64 = 1;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// MTRRs enabled, default memory type write-back.
const MTRR_ENABLE_WB: u64 = (1 << 11) | 6;

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

/// Errors programming a vCPU's boot state.
#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    #[error("KVM_SET_REGS failed: {0}")]
    SetRegs(kvm_ioctls::Error),
    #[error("KVM_GET_SREGS failed: {0}")]
    GetSregs(kvm_ioctls::Error),
    #[error("KVM_SET_SREGS failed: {0}")]
    SetSregs(kvm_ioctls::Error),
    #[error("KVM_SET_FPU failed: {0}")]
    SetFpu(kvm_ioctls::Error),
    #[error("KVM_SET_MSRS failed: {0}")]
    SetMsrs(kvm_ioctls::Error),
    #[error("KVM_SET_MSRS set only {set} of {wanted} boot MSRs")]
    PartialMsrs { set: usize, wanted: usize },
    #[error("KVM_GET_LAPIC/KVM_SET_LAPIC failed: {0}")]
    Lapic(kvm_ioctls::Error),
    #[error("cannot build the MSR list: {0}")]
    MsrList(vmm_sys_util::fam::Error),
}

/// General-purpose registers at the 64-bit entry point: RSI points at the
/// zero page.
pub fn boot_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rflags: 0x2,
        rip: entry,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE_START,
        ..Default::default()
    }
}

/// Special registers: long mode with paging on the identity map.
pub fn boot_sregs(mut sregs: kvm_sregs) -> kvm_sregs {
    let code = segment_from_gdt(BOOT_GDT[1], 1);
    let data = segment_from_gdt(BOOT_GDT[2], 2);
    let tss = segment_from_gdt(BOOT_GDT[3], 3);
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = (std::mem::size_of_val(&BOOT_GDT) - 1) as u16;
    sregs.idt.base = BOOT_IDT_START;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    sregs.cr0 |= X86_CR0_PE | X86_CR0_PG;
    sregs.cr3 = PML4_START;
    sregs.cr4 |= X86_CR4_PAE;
    sregs.efer |= EFER_LME | EFER_LMA;
    sregs
}

/// The MSRs Linux expects a boot loader to leave in a known state.
pub fn boot_msr_entries() -> Vec<kvm_msr_entry> {
    let msr = |index, data| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    vec![
        msr(MSR_IA32_SYSENTER_CS, 0),
        msr(MSR_IA32_SYSENTER_ESP, 0),
        msr(MSR_IA32_SYSENTER_EIP, 0),
        msr(MSR_STAR, 0),
        msr(MSR_CSTAR, 0),
        msr(MSR_KERNEL_GS_BASE, 0),
        msr(MSR_SYSCALL_MASK, 0),
        msr(MSR_LSTAR, 0),
        msr(MSR_IA32_TSC, 0),
        msr(MSR_IA32_MISC_ENABLE, MSR_IA32_MISC_ENABLE_FAST_STRING),
        msr(MSR_MTRR_DEF_TYPE, MTRR_ENABLE_WB),
    ]
}

/// Programs the boot state of a vCPU: registers, special registers, FPU,
/// MSRs and the local APIC's LINT pins (ExtINT on LINT0, NMI on LINT1, as the
/// MP table says).
pub fn setup_boot_vcpu(vcpu: &VcpuFd, entry: u64) -> Result<(), RegsError> {
    let msrs = Msrs::from_entries(&boot_msr_entries()).map_err(RegsError::MsrList)?;
    let set = vcpu.set_msrs(&msrs).map_err(RegsError::SetMsrs)?;
    if set != msrs.as_slice().len() {
        return Err(RegsError::PartialMsrs {
            set,
            wanted: msrs.as_slice().len(),
        });
    }
    vcpu.set_regs(&boot_regs(entry))
        .map_err(RegsError::SetRegs)?;
    let sregs = vcpu.get_sregs().map_err(RegsError::GetSregs)?;
    vcpu.set_sregs(&boot_sregs(sregs))
        .map_err(RegsError::SetSregs)?;
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(RegsError::SetFpu)?;
    set_lint(vcpu)
}

fn set_lint(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let mut lapic = vcpu.get_lapic().map_err(RegsError::Lapic)?;
    for (reg, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
        let bytes: [u8; 4] = std::array::from_fn(|i| lapic.regs[reg + i] as u8);
        let value = u32::from_le_bytes(bytes);
        // Delivery mode is bits 8..10.
        let value = (value & !0x700) | (mode << 8);
        for (i, b) in value.to_le_bytes().iter().enumerate() {
            lapic.regs[reg + i] = *b as std::os::raw::c_char;
        }
    }
    vcpu.set_lapic(&lapic).map_err(RegsError::Lapic)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_registers_point_at_zero_page() {
        let regs = boot_regs(0x100_0000);

        assert_eq!(regs.rip, 0x100_0000);
        assert_eq!(regs.rsi, ZERO_PAGE_START);
        assert_eq!(regs.rflags, 2);
    }

    #[test]
    fn special_registers_enable_long_mode_paging() {
        let sregs = boot_sregs(kvm_sregs::default());

        assert_eq!(sregs.cr3, PML4_START);
        assert_eq!(
            sregs.cr0 & (X86_CR0_PE | X86_CR0_PG),
            X86_CR0_PE | X86_CR0_PG
        );
        assert_ne!(sregs.cr4 & X86_CR4_PAE, 0);
        assert_eq!(sregs.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        assert_eq!(sregs.cs.selector, 0x8);
        assert_eq!(sregs.ss.selector, 0x10);
        assert_eq!(sregs.tr.selector, 0x18);
        assert_eq!(sregs.gdt.limit, 31);
    }
}
