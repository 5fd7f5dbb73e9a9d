#![no_main]
//! The virtio-vsock TX packet reader and RX packet writer. (`husk_vmm::fuzz::vsock_packet`)

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| husk_vmm::fuzz::vsock_packet(data));
