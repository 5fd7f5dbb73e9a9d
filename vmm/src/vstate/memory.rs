//! Guest memory: anonymous mappings, prefaulted by default so the guest never
//! waits on the host's page allocator, optionally backed by huge pages.

use std::fs::File;

use vm_memory::bitmap::{AtomicBitmap, NewBitmap};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

/// Guest memory as the VMM holds it. Every write the VMM makes through it
/// (used rings, received packets, block reads) is recorded in a bitmap, so
/// a diff snapshot includes the pages devices wrote as well as those KVM's
/// dirty log reports for the guest.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<AtomicBitmap>;
type GuestRegionMmap = vm_memory::GuestRegionMmap<AtomicBitmap>;

const PAGE: u64 = 4096;

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
        let mapping =
            MmapRegionBuilder::new_with_bitmap(len as usize, AtomicBitmap::with_len(len as usize))
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
/// (the layout `map_snapshot_file` expects), leaving pages that are all
/// zero as holes: memory the guest never used costs neither write time nor
/// disk, and reads back as zeros. The vCPUs must be paused.
pub fn dump(mem: &GuestMemoryMmap, file: &File) -> std::io::Result<()> {
    write_runs(mem, file, &nonzero_runs(mem), |_| {})
}

/// The runs (file offset, length) of pages holding anything but zeros.
fn nonzero_runs(mem: &GuestMemoryMmap) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut file_start = 0u64;
    for region in mem.iter() {
        let base = region.as_ptr();
        for page in 0..region.len() / PAGE {
            // SAFETY: the page lies inside the region's live mapping, which
            // is page-aligned (so u64-aligned); the vCPUs are paused and the
            // devices parked, so nothing writes it meanwhile.
            let words = unsafe {
                std::slice::from_raw_parts(
                    base.add((page * PAGE) as usize).cast::<u64>(),
                    (PAGE / 8) as usize,
                )
            };
            if words.iter().all(|&w| w == 0) {
                continue;
            }
            let offset = file_start + page * PAGE;
            match runs.last_mut() {
                Some((start, len)) if *start + *len == offset => *len += PAGE,
                _ => runs.push((offset, PAGE)),
            }
        }
        file_start += region.len();
    }
    runs
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
        let mapping =
            MmapRegionBuilder::new_with_bitmap(len as usize, AtomicBitmap::with_len(len as usize))
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

/// Maps a diff snapshot's pages over memory mapped from its base: each run
/// (file offset, length) of `file` replaces the same range, still private
/// and copy-on-write. Work is proportional to the number of runs, not to
/// the memory size.
pub fn overlay(mem: &GuestMemoryMmap, file: &File, runs: &[(u64, u64)]) -> Result<(), MemoryError> {
    use std::os::fd::AsRawFd;
    for &(offset, len) in runs {
        if len == 0 || offset % PAGE != 0 || len % PAGE != 0 {
            return Err(MemoryError::File(format!(
                "run {offset:#x}+{len:#x} is not whole pages"
            )));
        }
        let (host, _) = host_range(mem, offset, len).ok_or_else(|| {
            MemoryError::File(format!("run {offset:#x}+{len:#x} is outside guest memory"))
        })?;
        // SAFETY: `host..host+len` lies inside one region's mapping, which
        // `mem` owns; MAP_FIXED replaces those pages with the same kind of
        // private mapping, so the region stays valid for its whole length.
        let addr = unsafe {
            libc::mmap(
                host.cast(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(MemoryError::File(format!(
                "cannot map run {offset:#x}+{len:#x}: {}",
                std::io::Error::last_os_error()
            )));
        }
    }
    Ok(())
}

/// The host address of `len` bytes at memory-file `offset` (regions are
/// laid out one after the other in the file), if they sit in one region.
fn host_range(mem: &GuestMemoryMmap, offset: u64, len: u64) -> Option<(*mut u8, u64)> {
    let mut start = 0u64;
    for region in mem.iter() {
        let size = region.len();
        let end = offset.checked_add(len)?;
        if offset >= start && end <= start + size {
            // SAFETY: the offset is inside this region's mapping.
            return Some((
                unsafe { region.as_ptr().add((offset - start) as usize) },
                offset - start,
            ));
        }
        start += size;
    }
    None
}

/// The pages written since the last call, as memory-file runs (offset,
/// length): KVM's dirty log for the guest's writes (`kvm_dirty`, one
/// bitmap per region, as KVM_GET_DIRTY_LOG returns it) merged with the
/// VMM's own bitmap, which is cleared.
pub fn take_dirty(mem: &GuestMemoryMmap, kvm_dirty: &[Vec<u64>]) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut file_start = 0u64;
    for (i, region) in mem.iter().enumerate() {
        let bitmap = std::ops::Deref::deref(region).bitmap();
        let kvm = kvm_dirty.get(i);
        let pages = region.len() / PAGE;
        for page in 0..pages {
            let by_kvm = kvm
                .and_then(|b| b.get((page / 64) as usize))
                .is_some_and(|w| w & (1 << (page % 64)) != 0);
            if by_kvm || bitmap.is_bit_set(page as usize) {
                let offset = file_start + page * PAGE;
                match runs.last_mut() {
                    Some((start, len)) if *start + *len == offset => *len += PAGE,
                    _ => runs.push((offset, PAGE)),
                }
            }
        }
        bitmap.reset();
        file_start += region.len();
    }
    runs
}

/// The pages of memory mapped from a file (copy-on-write, see
/// [`map_snapshot_file`]) that are no longer the file's: written since (by
/// the guest, KVM or the VMM: each write made the page a private copy), as
/// memory-file runs. Read from `/proc/self/pagemap` (a page is a private
/// copy when it is present and not a file page, or swapped out), so no
/// dirty tracking has to run meanwhile. The diff runs laid over the mapping
/// are file pages of their own file: see [`merge_runs`].
pub fn written_since_mapped(mem: &GuestMemoryMmap) -> std::io::Result<Vec<(u64, u64)>> {
    use std::os::unix::fs::FileExt;
    const PRESENT: u64 = 1 << 63;
    const SWAPPED: u64 = 1 << 62;
    const FILE_OR_SHARED: u64 = 1 << 61;
    /// Entries read at once (512 KiB).
    const BATCH: usize = 1 << 16;
    let pagemap = File::open("/proc/self/pagemap")?;
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut file_start = 0u64;
    let mut entries = vec![0u8; BATCH * 8];
    for region in mem.iter() {
        let first = region.as_ptr() as u64 / PAGE;
        let pages = region.len() / PAGE;
        let mut done = 0u64;
        while done < pages {
            let n = (pages - done).min(BATCH as u64) as usize;
            let buf = &mut entries[..n * 8];
            pagemap.read_exact_at(buf, (first + done) * 8)?;
            for (i, entry) in buf.chunks_exact(8).enumerate() {
                let e = u64::from_ne_bytes(entry.try_into().expect("8 bytes"));
                let private = (e & PRESENT != 0 && e & FILE_OR_SHARED == 0) || e & SWAPPED != 0;
                if private {
                    let offset = file_start + (done + i as u64) * PAGE;
                    match runs.last_mut() {
                        Some((start, len)) if *start + *len == offset => *len += PAGE,
                        _ => runs.push((offset, PAGE)),
                    }
                }
            }
            done += n as u64;
        }
        file_start += region.len();
    }
    Ok(runs)
}

/// The union of two lists of page runs (offset, length), sorted and
/// merged.
pub fn merge_runs(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut all: Vec<(u64, u64)> = a.iter().chain(b).copied().collect();
    all.sort_unstable();
    let mut runs: Vec<(u64, u64)> = Vec::with_capacity(all.len());
    for (offset, len) in all {
        match runs.last_mut() {
            Some((start, l)) if offset <= *start + *l => {
                *l = (*l).max(offset + len - *start);
            }
            _ => runs.push((offset, len)),
        }
    }
    runs
}

/// Forgets what the VMM wrote so far (a full snapshot has it all).
pub fn clear_dirty(mem: &GuestMemoryMmap) {
    for region in mem.iter() {
        std::ops::Deref::deref(region).bitmap().reset();
    }
}

/// Writes the runs of guest memory into `file` at their offsets (the file
/// is sized to the whole memory; everything else stays a hole); returns
/// their bytes' CRC-64, in order.
pub fn dump_runs(mem: &GuestMemoryMmap, file: &File, runs: &[(u64, u64)]) -> std::io::Result<u64> {
    let mut crc = husk_snapshot::Crc64::new();
    write_runs(mem, file, runs, |bytes| crc.update(bytes))?;
    Ok(crc.finish())
}

/// Writes `runs` of guest memory at their offsets in `file` (sized to the
/// whole memory), showing each run's bytes to `each`.
fn write_runs(
    mem: &GuestMemoryMmap,
    file: &File,
    runs: &[(u64, u64)],
    mut each: impl FnMut(&[u8]),
) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let total: u64 = mem.iter().map(|r| r.len()).sum();
    file.set_len(total)?;
    for &(offset, len) in runs {
        let (host, _) = host_range(mem, offset, len)
            .ok_or_else(|| std::io::Error::other(format!("run {offset:#x} is outside memory")))?;
        // SAFETY: the range is inside a live region; the vCPUs are paused
        // and the devices parked, so nothing writes it meanwhile.
        let bytes = unsafe { std::slice::from_raw_parts(host, len as usize) };
        file.write_all_at(bytes, offset)?;
        each(bytes);
    }
    Ok(())
}

/// CRC-64 of `runs` of `file`, in order: what [`dump_runs`] returned for
/// the memory it wrote there.
pub fn runs_crc(file: &File, runs: &[(u64, u64)]) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let mut crc = husk_snapshot::Crc64::new();
    let mut buf = vec![0u8; 1 << 20];
    for &(offset, len) in runs {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(buf.len() as u64) as usize;
            file.read_exact_at(&mut buf[..n], offset + done)?;
            crc.update(&buf[..n]);
            done += n as u64;
        }
    }
    Ok(crc.finish())
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

    fn memory(mib: u32) -> GuestMemoryMmap {
        create_guest_memory(&MemoryConfig {
            size_mib: mib,
            prefault: false,
            hugepages: false,
        })
        .expect("memory")
    }

    #[test]
    fn dirty_pages_merge_the_vmm_bitmap_with_kvm_and_reset() {
        let mem = memory(4);
        mem.write_obj(1u8, GuestAddress(3 * PAGE + 7))
            .expect("write");
        mem.write_slice(&[2u8; 5000], GuestAddress(5 * PAGE))
            .expect("write");
        let kvm = vec![vec![1u64 << 9 | 1 << 10]];

        let runs = take_dirty(&mem, &kvm);
        let again = take_dirty(&mem, &[]);

        assert_eq!(
            runs,
            vec![(3 * PAGE, PAGE), (5 * PAGE, 2 * PAGE), (9 * PAGE, 2 * PAGE)]
        );
        assert!(again.is_empty(), "{again:?}");
    }

    #[test]
    fn a_full_dump_leaves_zero_pages_as_holes_and_maps_back_the_same() {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let path = dir.as_path().join("memory");
        let source = memory(4);
        source.write_obj(0x11u8, GuestAddress(5)).expect("write");
        source
            .write_obj(0x22u64, GuestAddress(3 * PAGE + PAGE - 8))
            .expect("write");
        source
            .write_obj(0x33u8, GuestAddress(4 * PAGE))
            .expect("write");

        dump(&source, &File::create(&path).expect("create")).expect("dump");

        let file = File::open(&path).expect("open");
        assert_eq!(file.metadata().expect("stat").len(), 4 << 20);
        assert_eq!(nonzero_runs(&source), vec![(0, PAGE), (3 * PAGE, 2 * PAGE)]);
        let restored = map_snapshot_file(&file, 4).expect("map");
        let mut back = vec![0u8; 4 << 20];
        let mut expected = vec![0u8; 4 << 20];
        restored
            .read_slice(&mut back, GuestAddress(0))
            .expect("read");
        source
            .read_slice(&mut expected, GuestAddress(0))
            .expect("read");
        assert!(back == expected, "the restored memory differs");
    }

    #[test]
    fn a_diff_overlays_its_pages_on_the_base() {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let base_file = File::create(dir.as_path().join("base")).expect("base");
        let source = memory(4);
        source
            .write_slice(&[0xaa; 8192], GuestAddress(0))
            .expect("write");
        dump(&source, &base_file).expect("dump");
        clear_dirty(&source);
        source
            .write_obj(0x55u8, GuestAddress(PAGE + 1))
            .expect("write");
        let runs = take_dirty(&source, &[]);
        let diff_path = dir.as_path().join("diff");
        let diff_file = File::create(&diff_path).expect("diff");
        dump_runs(&source, &diff_file, &runs).expect("dump runs");

        let base = File::open(dir.as_path().join("base")).expect("open");
        let restored = map_snapshot_file(&base, 4).expect("map");
        overlay(&restored, &File::open(&diff_path).expect("open"), &runs).expect("overlay");

        let read = |addr| restored.read_obj::<u8>(GuestAddress(addr)).expect("read");
        assert_eq!(
            (read(0), read(PAGE), read(PAGE + 1), read(2 * PAGE)),
            (0xaa, 0xaa, 0x55, 0)
        );
        assert_eq!(runs, vec![(PAGE, PAGE)]);
    }

    #[test]
    fn pages_written_since_a_file_was_mapped_are_found_in_pagemap() {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let path = dir.as_path().join("memory");
        let source = memory(4);
        source
            .write_slice(&[0xaa; 3 * 4096], GuestAddress(0))
            .expect("write");
        dump(&source, &File::create(&path).expect("create")).expect("dump");
        let file = File::open(&path).expect("open");
        let mapped = map_snapshot_file(&file, 4).expect("map");
        // Read pages (file pages, or the zero page over a hole) are not
        // written ones.
        for page in [0, 1, 5, 9] {
            mapped
                .read_obj::<u8>(GuestAddress(page * PAGE))
                .expect("read");
        }
        assert_eq!(written_since_mapped(&mapped).expect("pagemap"), vec![]);
        for page in [1, 2, 9, 900] {
            mapped
                .write_obj(0x55u8, GuestAddress(page * PAGE + 7))
                .expect("write");
        }
        assert_eq!(
            written_since_mapped(&mapped).expect("pagemap"),
            vec![(PAGE, 2 * PAGE), (9 * PAGE, PAGE), (900 * PAGE, PAGE)]
        );
    }

    #[test]
    fn runs_merge_into_their_union() {
        assert_eq!(
            merge_runs(
                &[(0, PAGE), (4 * PAGE, PAGE)],
                &[(PAGE, PAGE), (3 * PAGE, 3 * PAGE), (10 * PAGE, PAGE)]
            ),
            vec![(0, 2 * PAGE), (3 * PAGE, 3 * PAGE), (10 * PAGE, PAGE)]
        );
        assert_eq!(merge_runs(&[], &[]), vec![]);
    }

    #[test]
    fn diff_runs_that_are_not_whole_pages_inside_memory_are_refused() {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let path = dir.as_path().join("base");
        dump(&memory(4), &File::create(&path).expect("base")).expect("dump");
        let file = File::open(&path).expect("open");
        let restored = map_snapshot_file(&file, 4).expect("map");

        for run in [
            (PAGE, u64::MAX - PAGE + 1),
            (4 << 20, PAGE),
            (PAGE + 1, PAGE),
            (PAGE, 0),
        ] {
            let result = overlay(&restored, &file, &[run]);
            assert!(result.is_err(), "{run:x?} was mapped");
        }
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
