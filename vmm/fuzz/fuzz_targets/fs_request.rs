#![no_main]
//! The virtio-fs transport and FUSE server. (`husk_vmm::fuzz::fs_request`)

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| husk_vmm::fuzz::fs_request(data));
