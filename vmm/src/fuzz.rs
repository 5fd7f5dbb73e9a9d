//! Entry points for fuzzing what a guest controls: each takes arbitrary
//! bytes and must neither panic nor hang, whatever they are. `cargo fuzz`
//! (nightly, `vmm/fuzz`) drives them with coverage; `tests/fuzz.rs` runs
//! them over the corpus in `vmm/fuzz/corpus/` and random mutations of it for
//! a bounded time on every test run, so a regression shows in CI.

use std::sync::{Arc, Mutex};

use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::bus::BusDevice;
use crate::devices::virtio::block::request::{execute, parse, ID_LEN};
use crate::devices::virtio::block::{BlockDevice, Disk, DiskMode};
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::vsock::packet::{read_tx, rx_capacity, write_rx};
use crate::devices::virtio::VirtioInterrupt;
use crate::vstate::memory::GuestMemoryMmap;

/// Guest memory of the targets that build one.
pub const MEM_SIZE: usize = 1 << 16;

/// Guest memory plus a descriptor chain: the first byte says how many
/// descriptors (up to 16) follow as 14-byte records (addr u64, len u32,
/// flags u16); the rest fills guest memory from 0.
pub fn guest(data: &[u8]) -> Option<(GuestMemoryMmap, Vec<Descriptor>)> {
    let (&count, rest) = data.split_first()?;
    let count = usize::from(count % 17);
    let table = rest.get(..count * 14)?;
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).ok()?;
    let fill = &rest[count * 14..];
    mem.write_slice(&fill[..fill.len().min(MEM_SIZE)], GuestAddress(0))
        .ok()?;
    let descriptors = table
        .chunks_exact(14)
        .map(|r| {
            let addr = u64::from_le_bytes(r[0..8].try_into().unwrap_or_default());
            let len = u32::from_le_bytes(r[8..12].try_into().unwrap_or_default());
            let flags = u16::from_le_bytes([r[12], r[13]]);
            // Mostly inside guest memory, sometimes far outside it.
            let addr = if addr & 1 == 0 {
                addr % (MEM_SIZE as u64)
            } else {
                addr
            };
            Descriptor::new(addr, len, flags, 0)
        })
        .collect();
    Some((mem, descriptors))
}

/// A small disk image of its own (per process), reused across inputs.
fn scratch_disk(name: &str, size: usize) -> Disk {
    let path = std::env::temp_dir().join(format!("husk-fuzz-{name}-{}", std::process::id()));
    std::fs::write(&path, vec![0u8; size]).expect("scratch disk image");
    let disk = Disk::open(&path, &DiskMode::ReadWrite).expect("scratch disk");
    let _ = std::fs::remove_file(&path);
    disk
}

/// The virtio-block request parser and executor, against a 64 KiB disk.
pub fn block_request(data: &[u8]) {
    static DISK: Mutex<Option<Disk>> = Mutex::new(None);
    let Some((mem, descriptors)) = guest(data) else {
        return;
    };
    let mut disk = DISK.lock().unwrap_or_else(|e| e.into_inner());
    let disk = disk.get_or_insert_with(|| scratch_disk("block", 64 << 10));
    if let Ok(request) = parse(&mem, &descriptors) {
        let _ = execute(&request, disk, &mem, &[0; ID_LEN]);
    }
}

/// The virtio-vsock TX packet reader and RX packet writer.
pub fn vsock_packet(data: &[u8]) {
    let Some((mem, descriptors)) = guest(data) else {
        return;
    };
    if let Ok((header, payload)) = read_tx(&mem, &descriptors) {
        if let Ok(capacity) = rx_capacity(&descriptors) {
            let n = payload.len().min(capacity);
            let _ = write_rx(&mem, &descriptors, &header, &payload[..n]);
        }
    }
}

/// virtio-net frames: a TX chain gathered into a frame, and that frame (or
/// the raw input) scattered into the same chain as an RX buffer.
pub fn net_frame(data: &[u8]) {
    use crate::devices::virtio::net::device::{gather, scatter};
    let Some((mem, descriptors)) = guest(data) else {
        return;
    };
    let mut frame = Vec::new();
    if !gather(&mem, &descriptors, &mut frame) || frame.len() < 12 {
        frame = data.to_vec();
    }
    if frame.len() >= 12 {
        let _ = scatter(&mem, &descriptors, &frame);
    }
}

/// virtio-balloon chains: the same chain as a free page report (ranges to
/// drop) and as an inflate buffer (page frame numbers), against 64 KiB of
/// guest memory.
pub fn balloon_chain(data: &[u8]) {
    use crate::devices::virtio::balloon::{inflate, report};
    let Some((mem, descriptors)) = guest(data) else {
        return;
    };
    let _ = report(&mem, &descriptors);
    let _ = inflate(&mem, &descriptors);
}

/// virtio-mmio register traffic from a driver that may be hostile: the
/// input is a memory image (first 4 KiB) and then 7-byte operations (kind,
/// offset u16, value u32) against a block device's transport. A started
/// device serves whatever queues the driver described in that memory.
pub fn mmio_registers(data: &[u8]) {
    static DISK: Mutex<Option<Disk>> = Mutex::new(None);
    let Ok(mem) = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]) else {
        return;
    };
    let (image, ops) = data.split_at(data.len().min(4096));
    if mem.write_slice(image, GuestAddress(0x8000)).is_err() {
        return;
    }
    let disk = {
        let mut shared = DISK.lock().unwrap_or_else(|e| e.into_inner());
        match shared.take() {
            Some(d) => d,
            None => scratch_disk("mmio", 16 << 10),
        }
    };
    let Ok(evt) = EventFd::new(libc::EFD_NONBLOCK) else {
        return;
    };
    let Ok(irq) = EventFd::new(libc::EFD_NONBLOCK) else {
        return;
    };
    let device = Arc::new(Mutex::new(BlockDevice::new(disk, "fuzz", evt)));
    let interrupt = Arc::new(VirtioInterrupt::new(irq));
    let mut transport = MmioTransport::new(device.clone(), mem, interrupt, vec![]);
    for op in ops.chunks_exact(7) {
        let offset = u64::from(u16::from_le_bytes([op[1], op[2]]) % 0x200);
        let value = [op[3], op[4], op[5], op[6]];
        match op[0] % 4 {
            0 => {
                let mut out = [0u8; 4];
                transport.read(offset, &mut out);
            }
            1 => {
                let mut out = [0u8; 2];
                transport.read(offset, &mut out);
            }
            2 => transport.write(offset, &value[..usize::from(op[0] >> 6) + 1]),
            _ => transport.write(offset, &value),
        }
    }
    drop(transport);
    // The disk goes back for the next input (when nothing else holds it).
    if let Ok(device) = Arc::try_unwrap(device) {
        let device = device.into_inner().unwrap_or_else(|e| e.into_inner());
        *DISK.lock().unwrap_or_else(|e| e.into_inner()) = Some(device.into_disk());
    }
}

/// A virtio-fs request chain (the `guest` format) served by the FUSE server
/// over a scratch directory of its own (per process, mounted once: INIT
/// done), whose tables carry over from input to input as a guest's would.
/// Whatever a request names, nothing outside that directory is touched.
pub fn fs_request(data: &[u8]) {
    use crate::devices::virtio::fs::{abi, serve, server::Server, ShareOptions};
    static SERVER: Mutex<Option<Server>> = Mutex::new(None);
    let Some((mem, descriptors)) = guest(data) else {
        return;
    };
    let mut server = SERVER.lock().unwrap_or_else(|e| e.into_inner());
    let server = server.get_or_insert_with(|| {
        extern "C" fn remove_share() {
            let _ = std::fs::remove_dir_all(fs_scratch());
        }
        let dir = fs_scratch();
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).expect("scratch share");
        std::fs::write(dir.join("file"), b"fuzz").expect("scratch file");
        // SAFETY: registers a plain function to run at exit.
        unsafe { libc::atexit(remove_share) };
        let options = ShareOptions {
            hidden: vec!["hidden".into()],
            ..Default::default()
        };
        let mut server = Server::new(Some(&dir), options).expect("scratch server");
        let mut init = vec![0u8; 56];
        init[..4].copy_from_slice(&56u32.to_le_bytes());
        init[4..8].copy_from_slice(&abi::op::INIT.to_le_bytes());
        init[40..44].copy_from_slice(&7u32.to_le_bytes());
        init[44..48].copy_from_slice(&38u32.to_le_bytes());
        let _ = server.handle(&init);
        server
    });
    if grows_big(&mem, &descriptors) {
        return;
    }
    let _ = serve(&mem, &descriptors, server);
}

/// Whether a request would make a file in the scratch share larger than
/// 1 MiB (a write, truncate or fallocate far out): the disk under the
/// share is the host's, and a guest's quota is the operator's (the jail's
/// file size limit), not the fuzzer's to find.
fn grows_big(mem: &GuestMemoryMmap, descriptors: &[Descriptor]) -> bool {
    use crate::devices::virtio::fs::abi::op;
    const LIMIT: u64 = 1 << 20;
    let mut request = Vec::new();
    for d in descriptors.iter().take_while(|d| !d.is_write_only()) {
        let mut buf = vec![0u8; (d.len() as usize).min(4096)];
        if mem.read_slice(&mut buf, d.addr()).is_err() {
            return false;
        }
        request.extend_from_slice(&buf);
        if request.len() >= 64 {
            break;
        }
    }
    let word = |at: usize| -> u64 {
        request
            .get(at..at + 8)
            .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
    };
    let opcode = request
        .get(4..8)
        .map_or(0, |b| u32::from_le_bytes(b.try_into().unwrap_or_default()));
    match opcode {
        op::WRITE => word(48).saturating_add(word(56) & 0xffff_ffff) > LIMIT,
        op::SETATTR => word(56) > LIMIT,
        op::FALLOCATE => word(48).saturating_add(word(56)) > LIMIT,
        _ => false,
    }
}

fn fs_scratch() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("husk-fuzz-fs-{}", std::process::id()))
}

/// The snapshot state file: its framing (magic, version, length, CRC) and
/// the state inside, decoded as a restore would.
pub fn snapshot_state(data: &[u8]) {
    if let Ok((_, bytes)) = husk_snapshot::read_snapshot(&mut &data[..]) {
        let _ = postcard::from_bytes::<crate::persist::MicrovmState>(&bytes);
    }
    // And the state bytes alone, as if the framing had let them through.
    let _ = postcard::from_bytes::<crate::persist::MicrovmState>(data);
}
