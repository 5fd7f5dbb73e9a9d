#![no_main]
//! The snapshot state file's framing and decoder. (`husk_vmm::fuzz::snapshot_state`)

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| husk_vmm::fuzz::snapshot_state(data));
