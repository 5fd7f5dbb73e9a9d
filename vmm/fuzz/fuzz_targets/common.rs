//! Turns fuzz input into guest memory plus a descriptor chain: the first
//! byte says how many descriptors (up to 16) follow as 14-byte records
//! (addr u64, len u32, flags u16); the rest fills guest memory from 0.

use virtio_queue::desc::split::Descriptor;
use husk_vmm::vstate::memory::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};

pub const MEM_SIZE: usize = 1 << 16;

pub fn guest(data: &[u8]) -> Option<(GuestMemoryMmap, Vec<Descriptor>)> {
    let (&count, rest) = data.split_first()?;
    let count = usize::from(count % 17);
    let table_len = count * 14;
    let table = rest.get(..table_len)?;
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).ok()?;
    let fill = &rest[table_len..];
    mem.write_slice(&fill[..fill.len().min(MEM_SIZE)], GuestAddress(0)).ok()?;
    let descriptors = table
        .chunks_exact(14)
        .map(|r| {
            let addr = u64::from_le_bytes(r[0..8].try_into().unwrap_or_default());
            let len = u32::from_le_bytes(r[8..12].try_into().unwrap_or_default());
            let flags = u16::from_le_bytes([r[12], r[13]]);
            // Mostly inside guest memory, sometimes far outside it.
            let addr = if addr & 1 == 0 { addr % (MEM_SIZE as u64) } else { addr };
            Descriptor::new(addr, len, flags, 0)
        })
        .collect();
    Some((mem, descriptors))
}
