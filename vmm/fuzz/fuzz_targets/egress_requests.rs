#![no_main]
//! What a guest sends its egress proxy. (`husk_server::fuzz::egress_requests`)

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| husk_server::fuzz::egress_requests(data));
