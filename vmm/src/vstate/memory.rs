//! Guest memory: anonymous mappings, prefaulted by default so the guest never
//! waits on the host's page allocator, optionally backed by huge pages.

use std::fs::File;

use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionMmap, WriteVolatile,
};

use crate::arch::x86_64::layout::{MMIO_GAP_END, MMIO_GAP_START};

/// How guest memory is backed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryConfig {
    pub size_mib: u32,
    /// Touch every page at allocation (MAP_POPULATE).
    pub prefault: bool,
    /// Back with 2 MiB huge pages (MAP_HUGETLB).
    pub hugepages: bool,
}

/// Errors creating guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot map {size_mib} MiB of guest memory: {source}{hint}")]
    Map {
        size_mib: u32,
        source: vm_memory::mmap::MmapRegionError,
        hint: &'static str,
    },
    #[error("guest memory region at {0:#x} overflows the address space")]
    Region(u64),
    #[error("cannot assemble guest memory: {0}")]
    Assemble(#[from] vm_memory::GuestRegionCollectionError),
    #[error("guest memory file: {0}")]
    File(String),
}

/// The guest RAM regions (start, size) for `size` bytes: below the MMIO gap
/// first, the rest above 4 GiB.
pub fn ram_regions(size: u64) -> Vec<(u64, u64)> {
    let low = size.min(MMIO_GAP_START);
    let mut regions = vec![(0, low)];
    if size > low {
        regions.push((MMIO_GAP_END, size - low));
    }
    regions
}

/// Allocates guest memory as configured.
pub fn create_guest_memory(config: &MemoryConfig) -> Result<GuestMemoryMmap, MemoryError> {
    let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    if config.prefault {
        flags |= libc::MAP_POPULATE;
    }
    if config.hugepages {
        flags |= libc::MAP_HUGETLB;
    }
    let hint = if config.hugepages {
        " (are enough 2 MiB huge pages reserved? see /proc/sys/vm/nr_hugepages)"
    } else {
        ""
    };
    let size = u64::from(config.size_mib) << 20;
    let mut regions = Vec::new();
    for (start, len) in ram_regions(size) {
        let mapping = MmapRegionBuilder::new(len as usize)
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(flags)
            .with_hugetlbfs(config.hugepages)
            .build()
            .map_err(|source| MemoryError::Map {
                size_mib: config.size_mib,
                source,
                hint,
            })?;
        let region =
            GuestRegionMmap::new(mapping, GuestAddress(start)).ok_or(MemoryError::Region(start))?;
        regions.push(region);
    }
    Ok(GuestMemoryMmap::from_regions(regions)?)
}

/// Writes every region of guest memory to `file`, one after the other
/// (the layout `map_snapshot_file` expects). The vCPUs must be paused.
pub fn dump(mem: &GuestMemoryMmap, file: &mut File) -> std::io::Result<()> {
    for region in mem.iter() {
        let slice = region
            .as_volatile_slice()
            .map_err(|e| std::io::Error::other(format!("guest memory region: {e}")))?;
        file.write_all_volatile(&slice)
            .map_err(|e| std::io::Error::other(format!("writing guest memory: {e}")))?;
    }
    Ok(())
}

/// Maps a snapshot's memory file as guest memory of `size_mib`, private
/// and copy-on-write: pages load from the page cache when the guest first
/// touches them, writes stay in this process, and every clone of one
/// snapshot shares the file's clean pages. Nothing here is proportional
/// to the memory size.
pub fn map_snapshot_file(file: &File, size_mib: u32) -> Result<GuestMemoryMmap, MemoryError> {
    let size = u64::from(size_mib) << 20;
    let mut regions = Vec::new();
    let mut offset = 0u64;
    for (start, len) in ram_regions(size) {
        let handle = file
            .try_clone()
            .map_err(|e| MemoryError::File(e.to_string()))?;
        let mapping = MmapRegionBuilder::new(len as usize)
            .with_file_offset(FileOffset::new(handle, offset))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
            .build()
            .map_err(|source| MemoryError::Map {
                size_mib,
                source,
                hint: "",
            })?;
        let region =
            GuestRegionMmap::new(mapping, GuestAddress(start)).ok_or(MemoryError::Region(start))?;
        regions.push(region);
        offset += len;
    }
    Ok(GuestMemoryMmap::from_regions(regions)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestMemoryBackend, GuestMemoryRegion};

    #[test]
    fn small_guest_is_one_region() {
        assert_eq!(ram_regions(128 << 20), vec![(0, 128 << 20)]);
    }

    #[test]
    fn large_guest_skips_the_mmio_gap() {
        assert_eq!(
            ram_regions(4 << 30),
            vec![
                (0, MMIO_GAP_START),
                (MMIO_GAP_END, (4 << 30) - MMIO_GAP_START)
            ]
        );
    }

    #[test]
    fn prefaulted_memory_is_usable() {
        let mem = create_guest_memory(&MemoryConfig {
            size_mib: 8,
            prefault: true,
            hugepages: false,
        })
        .expect("memory");

        mem.write_obj(0xdead_beefu32, GuestAddress(0x1000))
            .expect("write");

        assert_eq!(
            mem.read_obj::<u32>(GuestAddress(0x1000)).expect("read"),
            0xdead_beef
        );
        assert_eq!(mem.iter().map(|r| r.len()).sum::<u64>(), 8 << 20);
    }
}
