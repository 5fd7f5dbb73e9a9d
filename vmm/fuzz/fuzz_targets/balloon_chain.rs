#![no_main]
//! virtio-balloon report and inflate chains. (`husk_vmm::fuzz::balloon_chain`)

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| husk_vmm::fuzz::balloon_chain(data));
