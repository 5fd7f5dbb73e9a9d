#![no_main]
//! Agent protocol frames, as either end reads them. (`husk_server::fuzz::agent_frames`)

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| husk_server::fuzz::agent_frames(data));
