//! Guest physical address map.
//!
//! ```text
//! 0x0000_0500  GDT (4 entries)            0x0000_7000  zero page (boot_params)
//! 0x0000_0520  IDT (empty, limit 7)        0x0000_8ff0  boot stack pointer
//! 0x0000_9000  PML4 -> 0xa000 PDPT -> 0xb000 PD (identity map of the first 1 GiB)
//! 0x0002_0000  kernel command line (2 KiB)
//! 0x0009_fc00  MP table, in the last KiB of base memory where Linux scans for it
//! 0x0010_0000  high memory: the kernel (vmlinux loads at its own p_paddr, 16 MiB)
//! ...          initramfs at the top of low memory
//! 0xc000_0000  MMIO gap up to 4 GiB: virtio-mmio slots, IOAPIC, LAPIC
//! 0x1_0000_0000  RAM above the gap, when the guest has more than 3 GiB
//! ```

/// Global descriptor table used while entering the 64-bit kernel.
pub const BOOT_GDT_START: u64 = 0x500;
/// An empty interrupt descriptor table: any exception before the kernel
/// installs its own one is a triple fault, which the VMM reports.
pub const BOOT_IDT_START: u64 = 0x520;
/// The zero page (`struct boot_params`), pointed to by RSI at entry.
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer of the boot vCPU.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Page-map level 4 of the boot page tables.
pub const PML4_START: u64 = 0x9000;
/// Page-directory-pointer table of the boot page tables.
pub const PDPTE_START: u64 = 0xa000;
/// Page directory of the boot page tables (512 x 2 MiB pages).
pub const PDE_START: u64 = 0xb000;
/// Where the kernel command line is written.
pub const CMDLINE_START: u64 = 0x20000;
/// x86 `COMMAND_LINE_SIZE`, including the terminating NUL.
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// The boot-time `setup_data` list (an RNG seed), right after the command line.
pub const SETUP_DATA_START: u64 = CMDLINE_START + CMDLINE_MAX_SIZE as u64;
/// Start of the extended BIOS data area; base memory ends here.
pub const EBDA_START: u64 = 0x9fc00;
/// The MP floating pointer and configuration table.
pub const MPTABLE_START: u64 = EBDA_START;
/// First byte above the legacy 1 MiB area.
pub const HIMEM_START: u64 = 0x10_0000;
/// Three pages KVM needs for the TSS on Intel hosts, inside the MMIO gap.
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;
/// Start of the MMIO gap below 4 GiB.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
/// End of the MMIO gap (4 GiB).
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// Base of the first virtio-mmio slot.
pub const VIRTIO_MMIO_START: u64 = MMIO_GAP_START;
/// The IOAPIC's MMIO base.
pub const IOAPIC_ADDR: u32 = 0xfec0_0000;
/// The local APIC's MMIO base.
pub const APIC_ADDR: u32 = 0xfee0_0000;
/// Highest IOAPIC pin (24 pins).
pub const IRQ_MAX: u8 = 23;
/// The 8250 serial port (COM1) and its interrupt line.
pub const SERIAL_PORT: u16 = 0x3f8;
/// Legacy IRQ of COM1.
pub const SERIAL_IRQ: u32 = 4;
/// i8042 keyboard controller data and command ports.
pub const I8042_DATA_PORT: u16 = 0x60;
/// Alignment of the initramfs and of memory region sizes.
pub const PAGE_SIZE: u64 = 0x1000;
