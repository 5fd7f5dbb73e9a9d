#![no_main]
//! virtio-net TX gather and RX scatter. (`husk_vmm::fuzz::net_frame`)

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| husk_vmm::fuzz::net_frame(data));
