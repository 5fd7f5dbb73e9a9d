#![no_main]
//! virtio-mmio register traffic from a hostile driver. (`husk_vmm::fuzz::mmio_registers`)

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| husk_vmm::fuzz::mmio_registers(data));
