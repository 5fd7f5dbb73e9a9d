//! x86_64 guest setup: the physical address map, the Linux boot protocol
//! structures, the MP table, CPUID and the boot-time register state.

pub mod boot;
pub mod cpuid;
pub mod layout;
pub mod mptable;
pub mod regs;
