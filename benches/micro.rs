//! Criterion micro-benchmarks of the host's hot paths, no guest needed:
//!
//!     cargo bench --bench micro              (-- <filter> to pick some)
//!
//! - descriptor-chain processing per device: a virtio-block 4 KiB read
//!   (parse and execute against a disk file), a virtio-vsock TX packet read
//!   and RX packet write, a virtio-net TX gather and RX scatter of a
//!   1500-byte frame;
//! - the snapshot state of a real guest (the fuzz corpus's `agent-guest`):
//!   encode (postcard and the framed file) and decode as a restore does;
//! - mapping a snapshot memory file of 128 MiB and of 4 GiB (the mapping
//!   only: pages come in on the guest's faults).
//!
//! A pooled claim needs a daemon and a guest: `husk bench` measures it end
//! to end (the `pooled_create` series).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use husk_vmm::devices::virtio::block::disk::Disk;
use husk_vmm::devices::virtio::block::request::{execute, parse, ID_LEN};
use husk_vmm::devices::virtio::block::DiskMode;
use husk_vmm::devices::virtio::net::device::{gather, scatter};
use husk_vmm::devices::virtio::vsock::packet::{read_tx, write_rx, Header, HEADER_LEN};
use husk_vmm::persist::MicrovmState;
use husk_vmm::vstate::memory::{map_snapshot_file, GuestMemoryMmap};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Bytes, GuestAddress};

const NEXT: u16 = 1;
const WRITE: u16 = 2;

fn guest_memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("guest memory")
}

fn block(c: &mut Criterion) {
    let mem = guest_memory();
    let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
    let image = dir.as_path().join("disk.img");
    std::fs::write(&image, vec![0x5a; 1 << 20]).expect("image");
    let mut disk = Disk::open(&image, &DiskMode::ReadOnly).expect("disk");
    // virtio_blk_outhdr: type IN (0), reserved, sector 8.
    let mut header = [0u8; 16];
    header[8..16].copy_from_slice(&8u64.to_le_bytes());
    mem.write_slice(&header, GuestAddress(0x1000))
        .expect("header");
    let chain = [
        Descriptor::new(0x1000, 16, NEXT, 1),
        Descriptor::new(0x2000, 4096, NEXT | WRITE, 2),
        Descriptor::new(0x4000, 1, WRITE, 0),
    ];
    let mut group = c.benchmark_group("block");
    group.throughput(Throughput::Bytes(4096));
    group.bench_function("read_4k_chain", |b| {
        b.iter(|| {
            let request = parse(&mem, black_box(&chain)).expect("request");
            execute(&request, &mut disk, &mem, &[0; ID_LEN])
        })
    });
    group.finish();
}

fn vsock(c: &mut Criterion) {
    let mem = guest_memory();
    let header = Header {
        src_cid: 3,
        dst_cid: 2,
        src_port: 1024,
        dst_port: 50000,
        len: 4096,
        type_: 1,
        op: 5,
        flags: 0,
        buf_alloc: 256 << 10,
        fwd_cnt: 0,
    };
    mem.write_slice(&header.to_bytes(), GuestAddress(0x1000))
        .expect("header");
    mem.write_slice(&[7u8; 4096], GuestAddress(0x2000))
        .expect("payload");
    let tx = [
        Descriptor::new(0x1000, HEADER_LEN as u32, NEXT, 1),
        Descriptor::new(0x2000, 4096, 0, 0),
    ];
    let rx = [
        Descriptor::new(0x10000, HEADER_LEN as u32, NEXT | WRITE, 1),
        Descriptor::new(0x11000, 4096, WRITE, 0),
    ];
    let payload = vec![9u8; 4096];
    let mut group = c.benchmark_group("vsock");
    group.throughput(Throughput::Bytes(4096));
    group.bench_function("tx_read_4k_packet", |b| {
        b.iter(|| read_tx(&mem, black_box(&tx)).expect("packet"))
    });
    group.bench_function("rx_write_4k_packet", |b| {
        b.iter(|| write_rx(&mem, black_box(&rx), &header, &payload).expect("written"))
    });
    group.finish();
}

fn net(c: &mut Criterion) {
    let mem = guest_memory();
    // virtio_net_hdr_v1 (12 bytes) and a 1500-byte frame.
    mem.write_slice(&[0u8; 12], GuestAddress(0x1000))
        .expect("header");
    mem.write_slice(&[3u8; 1500], GuestAddress(0x2000))
        .expect("frame");
    let tx = [
        Descriptor::new(0x1000, 12, NEXT, 1),
        Descriptor::new(0x2000, 1500, 0, 0),
    ];
    let rx = [Descriptor::new(0x10000, 2048, WRITE, 0)];
    let frame = vec![4u8; 12 + 1500];
    let mut group = c.benchmark_group("net");
    group.throughput(Throughput::Bytes(1500));
    group.bench_function("tx_gather_1500", |b| {
        let mut out = Vec::with_capacity(2048);
        b.iter(|| {
            out.clear();
            assert!(gather(&mem, black_box(&tx), &mut out));
        })
    });
    group.bench_function("rx_scatter_1500", |b| {
        b.iter(|| scatter(&mem, black_box(&rx), &frame).expect("scattered"))
    });
    group.finish();
}

fn snapshot_state(c: &mut Criterion) {
    let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus/snapshot_state/agent-guest");
    let file = std::fs::read(&corpus).expect("a real guest's state file in the fuzz corpus");
    let mut group = c.benchmark_group("snapshot_state");
    group.throughput(Throughput::Bytes(file.len() as u64));
    group.bench_function("decode", |b| {
        b.iter(|| {
            let (_, bytes) =
                husk_snapshot::read_snapshot(&mut black_box(&file[..])).expect("frame");
            postcard::from_bytes::<MicrovmState>(&bytes).expect("state")
        })
    });
    let (_, bytes) = husk_snapshot::read_snapshot(&mut &file[..]).expect("frame");
    let state: MicrovmState = postcard::from_bytes(&bytes).expect("state");
    group.bench_function("encode", |b| {
        b.iter(|| {
            let bytes = postcard::to_allocvec(black_box(&state)).expect("encode");
            let mut out = Vec::with_capacity(bytes.len() + 64);
            husk_snapshot::write_snapshot(&mut out, &bytes).expect("frame");
            out
        })
    });
    group.finish();
}

fn memory_file(c: &mut Criterion) {
    let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
    let mut group = c.benchmark_group("map_memory_file");
    for mib in [128u32, 4096] {
        let path = dir.as_path().join(format!("memory-{mib}"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .expect("memory file");
        // Sparse: mapping does not read it.
        file.set_len(u64::from(mib) << 20).expect("size");
        group.bench_function(format!("{mib}_mib"), |b| {
            b.iter_batched(
                || (),
                |()| map_snapshot_file(&file, mib).expect("mapped"),
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, block, vsock, net, snapshot_state, memory_file);
criterion_main!(benches);
