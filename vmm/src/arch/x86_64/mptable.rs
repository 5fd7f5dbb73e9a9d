//! The Intel MultiProcessor Specification 1.4 table. Without ACPI, this is
//! how Linux finds the vCPUs, the IOAPIC and how the ISA IRQs are routed.

use crate::vstate::memory::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};

use super::layout::{APIC_ADDR, IOAPIC_ADDR, IRQ_MAX, MPTABLE_START};

const MPC_SPEC: u8 = 4;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const CPU_ENABLED: u8 = 1;
const CPU_BOOTPROCESSOR: u8 = 2;
/// Family 6 signature; Linux only prints it.
const CPU_SIGNATURE: u32 = 0x600;
/// CPUID.1:EDX FPU | APIC.
const CPU_FEATURES: u32 = 0x201;
const ENTRY_PROCESSOR: u8 = 0;
const ENTRY_BUS: u8 = 1;
const ENTRY_IOAPIC: u8 = 2;
const ENTRY_IOINTSRC: u8 = 3;
const ENTRY_LINTSRC: u8 = 4;
const INT_TYPE_INT: u8 = 0;
const INT_TYPE_NMI: u8 = 1;
const INT_TYPE_EXTINT: u8 = 3;
const BUS_ISA: u8 = 0;

/// Errors building the MP table.
#[derive(Debug, thiserror::Error)]
pub enum MptableError {
    #[error("{0} vCPUs do not fit in an MP table (at most 254)")]
    TooManyCpus(u8),
    #[error("cannot write the MP table to guest memory: {0}")]
    Write(#[from] vm_memory::GuestMemoryError),
}

fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |acc, b| acc.wrapping_add(*b))
        .wrapping_neg()
}

/// Builds the floating pointer structure followed by the configuration table
/// for `num_cpus` vCPUs, as bytes to place at `MPTABLE_START`.
pub fn build_mptable(num_cpus: u8) -> Result<Vec<u8>, MptableError> {
    if num_cpus == 0 || num_cpus > 254 {
        return Err(MptableError::TooManyCpus(num_cpus));
    }
    let ioapic_id = num_cpus;
    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;

    for cpu in 0..num_cpus {
        let flags = CPU_ENABLED | if cpu == 0 { CPU_BOOTPROCESSOR } else { 0 };
        entries.extend([ENTRY_PROCESSOR, cpu, APIC_VERSION, flags]);
        entries.extend(CPU_SIGNATURE.to_le_bytes());
        entries.extend(CPU_FEATURES.to_le_bytes());
        entries.extend([0u8; 8]);
        count += 1;
    }
    entries.extend([ENTRY_BUS, BUS_ISA]);
    entries.extend(*b"ISA   ");
    count += 1;
    entries.extend([ENTRY_IOAPIC, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend(IOAPIC_ADDR.to_le_bytes());
    count += 1;
    for irq in 0..=IRQ_MAX {
        // Conforming polarity and trigger (flags 0): edge, active high for ISA.
        entries.extend([
            ENTRY_IOINTSRC,
            INT_TYPE_INT,
            0,
            0,
            BUS_ISA,
            irq,
            ioapic_id,
            irq,
        ]);
        count += 1;
    }
    entries.extend([ENTRY_LINTSRC, INT_TYPE_EXTINT, 0, 0, BUS_ISA, 0, 0, 0]);
    entries.extend([ENTRY_LINTSRC, INT_TYPE_NMI, 0, 0, BUS_ISA, 0, 0xff, 1]);
    count += 2;

    let header_len = 44u16;
    let table_len = header_len + entries.len() as u16;
    let mut table = Vec::with_capacity(table_len as usize);
    table.extend(*b"PCMP");
    table.extend(table_len.to_le_bytes());
    table.extend([MPC_SPEC, 0]); // checksum filled below
    table.extend(*b"HUSK    ");
    table.extend(*b"MICROVM     ");
    table.extend(0u32.to_le_bytes()); // OEM table pointer
    table.extend(0u16.to_le_bytes()); // OEM table size
    table.extend(count.to_le_bytes());
    table.extend(APIC_ADDR.to_le_bytes());
    table.extend([0u8; 4]); // extended table length, checksum, reserved
    table.extend(entries);
    table[7] = checksum(&table);

    let table_addr = (MPTABLE_START + 16) as u32;
    let mut mpf = Vec::with_capacity(16);
    mpf.extend(*b"_MP_");
    mpf.extend(table_addr.to_le_bytes());
    mpf.extend([1, MPC_SPEC, 0, 0, 0, 0, 0, 0]); // length in paragraphs, spec, checksum, features
    mpf[10] = checksum(&mpf);

    mpf.extend(table);
    Ok(mpf)
}

/// Writes the MP table for `num_cpus` vCPUs into guest memory.
pub fn setup_mptable(mem: &GuestMemoryMmap, num_cpus: u8) -> Result<(), MptableError> {
    let bytes = build_mptable(num_cpus)?;
    mem.write_slice(&bytes, GuestAddress(MPTABLE_START))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b))
    }

    #[test]
    fn floating_pointer_is_valid() {
        let t = build_mptable(2).expect("table");

        assert_eq!(&t[..4], b"_MP_");
        assert_eq!(
            u32::from_le_bytes(t[4..8].try_into().expect("4 bytes")),
            0x9fc10
        );
        assert_eq!(sum(&t[..16]), 0);
    }

    #[test]
    fn config_table_checksums_and_counts_entries() {
        let t = build_mptable(3).expect("table");
        let table = &t[16..];
        let len = u16::from_le_bytes([table[4], table[5]]) as usize;
        let count = u16::from_le_bytes([table[34], table[35]]);

        assert_eq!(&table[..4], b"PCMP");
        assert_eq!(len, table.len());
        assert_eq!(sum(&table[..len]), 0);
        // 3 CPUs, 1 bus, 1 IOAPIC, 24 IRQs, 2 local interrupts.
        assert_eq!(count, 3 + 1 + 1 + 24 + 2);
    }

    #[test]
    fn only_first_cpu_is_bootstrap_processor() {
        let t = build_mptable(2).expect("table");
        let entries = &t[16 + 44..];

        assert_eq!(entries[3], CPU_ENABLED | CPU_BOOTPROCESSOR);
        assert_eq!(entries[20 + 1], 1);
        assert_eq!(entries[20 + 3], CPU_ENABLED);
    }

    #[test]
    fn zero_cpus_is_refused() {
        assert!(matches!(
            build_mptable(0),
            Err(MptableError::TooManyCpus(0))
        ));
    }
}
