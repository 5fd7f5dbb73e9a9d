#![no_main]
//! The virtio-vsock TX packet reader and RX packet writer.

mod common;

use husk_vmm::devices::virtio::vsock::packet::{read_tx, rx_capacity, write_rx};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((mem, descriptors)) = common::guest(data) else {
        return;
    };
    if let Ok((header, payload)) = read_tx(&mem, &descriptors) {
        if let Ok(capacity) = rx_capacity(&descriptors) {
            let n = payload.len().min(capacity);
            let _ = write_rx(&mem, &descriptors, &header, &payload[..n]);
        }
    }
});
