#![no_main]
//! The virtio-block request parser and executor against a 64 KiB disk.

mod common;

use std::sync::Mutex;

use husk_vmm::devices::virtio::block::request::{execute, parse, ID_LEN};
use husk_vmm::devices::virtio::block::{Disk, DiskMode};
use libfuzzer_sys::fuzz_target;

static DISK: Mutex<Option<Disk>> = Mutex::new(None);

fuzz_target!(|data: &[u8]| {
    let Some((mem, descriptors)) = common::guest(data) else {
        return;
    };
    let mut disk = DISK.lock().unwrap_or_else(|e| e.into_inner());
    let disk = disk.get_or_insert_with(|| {
        let path = std::env::temp_dir().join(format!("husk-fuzz-disk-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; 64 << 10]).expect("disk image");
        Disk::open(&path, &DiskMode::ReadWrite).expect("disk")
    });
    if let Ok(request) = parse(&mem, &descriptors) {
        let _ = execute(&request, disk, &mem, &[0; ID_LEN]);
    }
});
