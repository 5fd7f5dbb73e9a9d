#![no_main]
//! The daemon's request bodies and query strings. (`husk_server::fuzz::api_requests`)

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| husk_server::fuzz::api_requests(data));
