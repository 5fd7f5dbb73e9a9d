#![no_main]
//! The virtio-block request parser and executor. (`husk_vmm::fuzz::block_request`)

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| husk_vmm::fuzz::block_request(data));
