//! The Linux x86 64-bit boot protocol: kernel and initramfs loading, the zero
//! page with its e820 map, the boot GDT and the identity-mapped page tables.
//! See Documentation/x86/boot.rst in the kernel tree.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};

use crate::vstate::memory::GuestMemoryMmap;
use linux_loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::{self, BzImage, Elf, KernelLoader};
use vm_memory::{Address, Bytes, GuestAddress};

use super::layout::*;

const E820_RAM: u32 = 1;
const E820_RESERVED: u32 = 2;
/// `setup_header.boot_flag`.
const BOOT_FLAG_MAGIC: u16 = 0xaa55;
/// `setup_header.header`: "HdrS".
const HDRS_MAGIC: u32 = 0x5372_6448;
/// `type_of_loader`: undefined loader.
const LOADER_UNDEFINED: u8 = 0xff;
/// Alignment the kernel expects when it is loaded as an ELF (16 MiB).
const ELF_KERNEL_ALIGNMENT: u32 = 0x0100_0000;
/// `xloadflags` bit: the kernel has a 64-bit entry point at +0x200.
const XLF_KERNEL_64: u16 = 1 << 0;
/// First protocol version with `xloadflags`.
const BOOT_PROTOCOL_2_12: u16 = 0x020c;

/// Errors while placing the kernel and its boot data in guest memory.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot read the kernel image: {0}")]
    ReadKernel(#[source] std::io::Error),
    #[error("the kernel image is neither a vmlinux ELF nor a bzImage ({0}); pass an uncompressed vmlinux or a bzImage")]
    NotAKernel(loader::Error),
    #[error("the kernel image is a bzImage without a 64-bit entry point (boot protocol {0:#x}); use a 64-bit kernel built with boot protocol 2.12 or later")]
    NoLongModeEntry(u16),
    #[error("the kernel needs guest memory up to {needed:#x} but the guest has only {available:#x} bytes below the MMIO gap; give the guest more memory")]
    KernelDoesNotFit { needed: u64, available: u64 },
    #[error("cannot load the kernel into guest memory: {0}")]
    LoadKernel(loader::Error),
    #[error("cannot read the initramfs: {0}")]
    ReadInitramfs(#[source] std::io::Error),
    #[error("the initramfs ({size} bytes) does not fit in guest memory between the kernel end {kernel_end:#x} and {low_end:#x}; give the guest more memory")]
    InitramfsDoesNotFit {
        size: u64,
        kernel_end: u64,
        low_end: u64,
    },
    #[error("cannot write boot data to guest memory: {0}")]
    WriteGuestMemory(#[from] vm_memory::GuestMemoryError),
}

/// Where a loaded kernel starts executing and what the zero page needs from it.
#[derive(Debug, Clone, Copy)]
pub struct LoadedKernel {
    /// 64-bit entry point.
    pub entry: GuestAddress,
    /// First byte after the kernel image (including its bss).
    pub end: u64,
    /// The bzImage setup header, `None` for an ELF vmlinux.
    pub setup_header: Option<linux_loader::bootparam::setup_header>,
}

/// Loads a vmlinux ELF (preferred: nothing runs in the guest to decompress
/// it) or, failing that, a bzImage. `low_end` is the end of RAM below the
/// MMIO gap.
pub fn load_kernel(
    mem: &GuestMemoryMmap,
    kernel: &mut File,
    low_end: u64,
) -> Result<LoadedKernel, BootError> {
    if let Some(needed) = elf_memory_end(kernel).map_err(BootError::ReadKernel)? {
        if needed > low_end {
            return Err(BootError::KernelDoesNotFit {
                needed,
                available: low_end,
            });
        }
    }
    match Elf::load(mem, None, kernel, Some(GuestAddress(HIMEM_START))) {
        Ok(result) => Ok(LoadedKernel {
            entry: result.kernel_load,
            end: result.kernel_end,
            setup_header: None,
        }),
        Err(loader::Error::Elf(loader::elf::Error::InvalidElfMagicNumber)) => {
            load_bzimage(mem, kernel, low_end)
        }
        Err(e) => Err(BootError::LoadKernel(e)),
    }
}

fn load_bzimage(
    mem: &GuestMemoryMmap,
    kernel: &mut File,
    low_end: u64,
) -> Result<LoadedKernel, BootError> {
    let size = kernel.metadata().map_err(BootError::ReadKernel)?.len();
    if HIMEM_START + size > low_end {
        return Err(BootError::KernelDoesNotFit {
            needed: HIMEM_START + size,
            available: low_end,
        });
    }
    let result = BzImage::load(mem, None, kernel, Some(GuestAddress(HIMEM_START)))
        .map_err(BootError::NotAKernel)?;
    // The loader checked the magic; a bzImage always has a setup header.
    let hdr = result.setup_header.ok_or(BootError::NoLongModeEntry(0))?;
    if hdr.version < BOOT_PROTOCOL_2_12 || hdr.xloadflags & XLF_KERNEL_64 == 0 {
        return Err(BootError::NoLongModeEntry(hdr.version));
    }
    Ok(LoadedKernel {
        // The 64-bit entry point is 0x200 past the start of the protected-mode code.
        entry: result.kernel_load.unchecked_add(0x200),
        end: result.kernel_end,
        setup_header: Some(hdr),
    })
}

/// For an ELF image, the end of its highest loadable segment; `None` if the
/// file is not an ELF (it may be a bzImage).
fn elf_memory_end(file: &mut File) -> std::io::Result<Option<u64>> {
    const EHDR_LEN: usize = 64;
    const PHDR_LEN: usize = 56;
    const PT_LOAD: u32 = 1;
    const MAX_PHDRS: u16 = 256;
    let mut ehdr = [0u8; EHDR_LEN];
    file.seek(SeekFrom::Start(0))?;
    if file.read(&mut ehdr)? < EHDR_LEN || &ehdr[..4] != b"\x7fELF" {
        return Ok(None);
    }
    let phoff = u64::from_le_bytes(ehdr[32..40].try_into().unwrap_or_default());
    let phnum = u16::from_le_bytes([ehdr[56], ehdr[57]]).min(MAX_PHDRS);
    let mut end = 0u64;
    for i in 0..u64::from(phnum) {
        let mut phdr = [0u8; PHDR_LEN];
        file.seek(SeekFrom::Start(phoff.saturating_add(i * PHDR_LEN as u64)))?;
        if file.read(&mut phdr)? < PHDR_LEN {
            break;
        }
        let p_type = u32::from_le_bytes(phdr[0..4].try_into().unwrap_or_default());
        let paddr = u64::from_le_bytes(phdr[24..32].try_into().unwrap_or_default());
        let memsz = u64::from_le_bytes(phdr[40..48].try_into().unwrap_or_default());
        if p_type == PT_LOAD {
            end = end.max(paddr.saturating_add(memsz));
        }
    }
    file.seek(SeekFrom::Start(0))?;
    Ok(Some(end))
}

/// Places the initramfs page-aligned at the top of low memory, as high as
/// possible so the kernel's own early allocations do not collide with it.
/// Returns its guest address and size.
pub fn load_initramfs(
    mem: &GuestMemoryMmap,
    initramfs: &mut File,
    kernel_end: u64,
    low_end: u64,
) -> Result<(GuestAddress, u64), BootError> {
    let size = initramfs
        .metadata()
        .map_err(BootError::ReadInitramfs)?
        .len();
    let too_big = BootError::InitramfsDoesNotFit {
        size,
        kernel_end,
        low_end,
    };
    let start = low_end.checked_sub(size).ok_or(too_big)? & !(PAGE_SIZE - 1);
    if start < kernel_end {
        return Err(BootError::InitramfsDoesNotFit {
            size,
            kernel_end,
            low_end,
        });
    }
    let addr = GuestAddress(start);
    initramfs
        .seek(SeekFrom::Start(0))
        .map_err(BootError::ReadInitramfs)?;
    mem.read_exact_volatile_from(addr, initramfs, size as usize)
        .map_err(|e| match e {
            vm_memory::GuestMemoryError::IOError(io) => BootError::ReadInitramfs(io),
            other => BootError::WriteGuestMemory(other),
        })?;
    Ok((addr, size))
}

/// One e820 entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E820Entry {
    pub addr: u64,
    pub size: u64,
    pub kind: u32,
}

/// The e820 map for a guest whose RAM is `regions` (start, size): base memory
/// up to the EBDA, the EBDA and BIOS area reserved, then RAM from 1 MiB on.
pub fn e820_map(regions: &[(u64, u64)]) -> Vec<E820Entry> {
    let mut map = vec![
        E820Entry {
            addr: 0,
            size: EBDA_START,
            kind: E820_RAM,
        },
        E820Entry {
            addr: EBDA_START,
            size: HIMEM_START - EBDA_START,
            kind: E820_RESERVED,
        },
    ];
    for &(start, size) in regions {
        let (from, end) = (start.max(HIMEM_START), start + size);
        if end > from {
            map.push(E820Entry {
                addr: from,
                size: end - from,
                kind: E820_RAM,
            });
        }
    }
    map
}

/// Inputs of the zero page.
#[derive(Debug)]
pub struct ZeroPage<'a> {
    pub kernel: &'a LoadedKernel,
    pub cmdline_len: usize,
    pub initramfs: Option<(GuestAddress, u64)>,
    pub e820: &'a [E820Entry],
    /// Address of the first `setup_data` entry, if any.
    pub setup_data: Option<u64>,
}

/// Builds `struct boot_params` (the "zero page").
pub fn build_zero_page(zp: &ZeroPage) -> boot_params {
    let mut params = boot_params::default();
    if let Some(hdr) = zp.kernel.setup_header {
        params.hdr = hdr;
    } else {
        params.hdr.kernel_alignment = ELF_KERNEL_ALIGNMENT;
    }
    params.hdr.type_of_loader = LOADER_UNDEFINED;
    params.hdr.boot_flag = BOOT_FLAG_MAGIC;
    params.hdr.header = HDRS_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = zp.cmdline_len as u32;
    if let Some((addr, size)) = zp.initramfs {
        params.hdr.ramdisk_image = addr.raw_value() as u32;
        params.hdr.ramdisk_size = size as u32;
    }
    for (slot, entry) in params.e820_table.iter_mut().zip(zp.e820) {
        *slot = boot_e820_entry {
            addr: entry.addr,
            size: entry.size,
            r#type: entry.kind,
        };
    }
    params.e820_entries = zp.e820.len().min(params.e820_table.len()) as u8;
    params.hdr.setup_data = zp.setup_data.unwrap_or(0);
    params
}

/// `setup_data` type of a random seed for the kernel's RNG.
const SETUP_RNG_SEED: u32 = 9;
/// Bytes of seed handed to the guest at boot.
pub const RNG_SEED_LEN: usize = 32;

/// Writes a `setup_data` entry carrying `seed` (SETUP_RNG_SEED) at
/// SETUP_DATA_START and returns its address for the zero page. A kernel
/// built with `CONFIG_RANDOM_TRUST_BOOTLOADER` (kernel-config/) credits it,
/// so the guest's RNG is ready at boot (getrandom never blocks) although it
/// has no entropy source.
pub fn write_rng_seed(mem: &GuestMemoryMmap, seed: &[u8; RNG_SEED_LEN]) -> Result<u64, BootError> {
    let mut entry = Vec::with_capacity(16 + RNG_SEED_LEN);
    entry.extend(0u64.to_le_bytes()); // next: none
    entry.extend(SETUP_RNG_SEED.to_le_bytes());
    entry.extend((RNG_SEED_LEN as u32).to_le_bytes());
    entry.extend(seed);
    mem.write_slice(&entry, GuestAddress(SETUP_DATA_START))?;
    Ok(SETUP_DATA_START)
}

/// Writes the zero page to its fixed address.
pub fn write_zero_page(mem: &GuestMemoryMmap, params: &boot_params) -> Result<(), BootError> {
    mem.write_obj(*params, GuestAddress(ZERO_PAGE_START))?;
    Ok(())
}

/// Encodes a GDT entry from its flags (access byte and granularity nibble),
/// base and limit.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << (56 - 24))
        | ((flags as u64 & 0x0000_f0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << (48 - 16))
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
}

/// The boot GDT: null, 64-bit code, data, TSS. Selectors are index * 8.
pub const BOOT_GDT: [u64; 4] = [
    gdt_entry(0, 0, 0),
    gdt_entry(0xa09b, 0, 0xfffff),
    gdt_entry(0xc093, 0, 0xfffff),
    gdt_entry(0x808b, 0, 0xfffff),
];

/// Decodes a GDT entry into the segment register form KVM expects.
pub fn segment_from_gdt(entry: u64, table_index: u8) -> kvm_bindings::kvm_segment {
    let base = ((entry >> 16) & 0x00ff_ffff) | ((entry >> 32) & 0xff00_0000);
    let mut limit = ((entry & 0xffff) | ((entry >> 32) & 0x000f_0000)) as u32;
    let g = ((entry >> 55) & 1) as u8;
    if g == 1 {
        // With 4 KiB granularity the limit covers whole pages.
        limit = (limit << 12) | 0xfff;
    }
    kvm_bindings::kvm_segment {
        base,
        limit,
        selector: u16::from(table_index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        padding: 0,
        unusable: u8::from(((entry >> 47) & 1) == 0),
    }
}

/// Present + writable (+ page size for the leaf level).
const PTE_PRESENT_RW: u64 = 0x03;
const PTE_HUGE: u64 = 0x80;

/// The identity map of the first 1 GiB with 2 MiB pages: one PML4 entry, one
/// PDPT entry, 512 PD entries.
pub fn boot_page_tables() -> (u64, u64, [u64; 512]) {
    let pml4e = PDPTE_START | PTE_PRESENT_RW;
    let pdpte = PDE_START | PTE_PRESENT_RW;
    let mut pd = [0u64; 512];
    for (i, e) in pd.iter_mut().enumerate() {
        *e = ((i as u64) << 21) | PTE_HUGE | PTE_PRESENT_RW;
    }
    (pml4e, pdpte, pd)
}

/// Writes the GDT, the empty IDT and the page tables to guest memory.
pub fn write_boot_tables(mem: &GuestMemoryMmap) -> Result<(), BootError> {
    for (i, entry) in BOOT_GDT.iter().enumerate() {
        mem.write_obj(*entry, GuestAddress(BOOT_GDT_START + 8 * i as u64))?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT_START))?;
    let (pml4e, pdpte, pd) = boot_page_tables();
    mem.write_obj(pml4e, GuestAddress(PML4_START))?;
    mem.write_obj(pdpte, GuestAddress(PDPTE_START))?;
    for (i, e) in pd.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(PDE_START + 8 * i as u64))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn e820_map_of_small_guest() {
        let map = e820_map(&[(0, 128 * MIB)]);

        assert_eq!(
            map,
            vec![
                E820Entry {
                    addr: 0,
                    size: 0x9fc00,
                    kind: E820_RAM
                },
                E820Entry {
                    addr: 0x9fc00,
                    size: 0x60400,
                    kind: E820_RESERVED
                },
                E820Entry {
                    addr: MIB,
                    size: 127 * MIB,
                    kind: E820_RAM
                },
            ]
        );
    }

    #[test]
    fn e820_map_of_guest_above_the_mmio_gap() {
        let map = e820_map(&[(0, MMIO_GAP_START), (MMIO_GAP_END, 1 << 30)]);

        assert_eq!(map.len(), 4);
        assert_eq!(
            map[2],
            E820Entry {
                addr: MIB,
                size: MMIO_GAP_START - MIB,
                kind: E820_RAM
            }
        );
        assert_eq!(
            map[3],
            E820Entry {
                addr: MMIO_GAP_END,
                size: 1 << 30,
                kind: E820_RAM
            }
        );
    }

    #[test]
    fn zero_page_fields_for_elf_kernel() {
        let kernel = LoadedKernel {
            entry: GuestAddress(0x100_0000),
            end: 0x200_0000,
            setup_header: None,
        };
        let e820 = e820_map(&[(0, 128 * MIB)]);

        let params = build_zero_page(&ZeroPage {
            kernel: &kernel,
            cmdline_len: 42,
            initramfs: Some((GuestAddress(0x700_0000), 0x1234)),
            e820: &e820,
            setup_data: Some(SETUP_DATA_START),
        });

        assert_eq!({ params.hdr.boot_flag }, 0xaa55);
        assert_eq!({ params.hdr.header }, 0x5372_6448);
        assert_eq!({ params.hdr.type_of_loader }, 0xff);
        assert_eq!({ params.hdr.kernel_alignment }, 0x0100_0000);
        assert_eq!({ params.hdr.cmd_line_ptr }, 0x20000);
        assert_eq!({ params.hdr.cmdline_size }, 42);
        assert_eq!({ params.hdr.ramdisk_image }, 0x700_0000);
        assert_eq!({ params.hdr.ramdisk_size }, 0x1234);
        assert_eq!(params.e820_entries, 3);
        assert_eq!({ params.e820_table[2].addr }, MIB);
        assert_eq!({ params.e820_table[2].size }, 127 * MIB);
        assert_eq!({ params.hdr.setup_data }, SETUP_DATA_START);
    }

    #[test]
    fn rng_seed_is_a_setup_data_entry() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("memory");

        let addr = write_rng_seed(&mem, &[7; RNG_SEED_LEN]).expect("write");

        let mut entry = [0u8; 16 + RNG_SEED_LEN];
        mem.read_slice(&mut entry, GuestAddress(addr))
            .expect("read");
        assert_eq!(&entry[..8], &[0; 8], "no next entry");
        assert_eq!(u32::from_le_bytes(entry[8..12].try_into().expect("4")), 9);
        assert_eq!(u32::from_le_bytes(entry[12..16].try_into().expect("4")), 32);
        assert_eq!(&entry[16..], &[7; RNG_SEED_LEN]);
        // Clear of the command line it follows.
        assert!(addr >= CMDLINE_START + CMDLINE_MAX_SIZE as u64);
    }

    #[test]
    fn gdt_entries_match_the_reference_encoding() {
        // Values from the Linux boot protocol examples and Firecracker's gdt.rs.
        assert_eq!(BOOT_GDT[0], 0);
        assert_eq!(BOOT_GDT[1], 0x00af_9b00_0000_ffff);
        assert_eq!(BOOT_GDT[2], 0x00cf_9300_0000_ffff);
        assert_eq!(BOOT_GDT[3], 0x008f_8b00_0000_ffff);
    }

    #[test]
    fn code_segment_decodes_as_present_long_mode() {
        let cs = segment_from_gdt(BOOT_GDT[1], 1);

        assert_eq!(cs.selector, 8);
        assert_eq!(cs.l, 1);
        assert_eq!(cs.present, 1);
        assert_eq!(cs.type_, 0xb);
        assert_eq!(cs.limit, 0xffff_ffff);
        assert_eq!(cs.unusable, 0);
    }

    #[test]
    fn page_tables_identity_map_first_gib() {
        let (pml4e, pdpte, pd) = boot_page_tables();

        assert_eq!(pml4e, 0xa003);
        assert_eq!(pdpte, 0xb003);
        assert_eq!(pd[0], 0x83);
        assert_eq!(pd[1], 0x20_0083);
        assert_eq!(pd[511], (511 << 21) | 0x83);
    }

    #[test]
    fn initramfs_goes_to_top_of_low_memory() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), (64 * MIB) as usize)])
            .expect("guest memory");
        let mut file = tempfile_with(&[7u8; 5000]);

        let (addr, size) = load_initramfs(&mem, &mut file, 32 * MIB, 64 * MIB).expect("load");

        assert_eq!(size, 5000);
        assert_eq!(addr.raw_value(), (64 * MIB - 5000) & !0xfff);
        assert_eq!(mem.read_obj::<u8>(addr).expect("read"), 7);
    }

    #[test]
    fn initramfs_overlapping_the_kernel_is_refused() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), (64 * MIB) as usize)])
            .expect("guest memory");
        let mut file = tempfile_with(&vec![0u8; (8 * MIB) as usize]);

        let err = load_initramfs(&mem, &mut file, 60 * MIB, 64 * MIB).expect_err("must not fit");

        assert!(matches!(err, BootError::InitramfsDoesNotFit { .. }));
    }

    /// A bzImage with one setup sector and 512 bytes of "kernel".
    fn fake_bzimage(version: u16, xloadflags: u16) -> Vec<u8> {
        let mut image = vec![0u8; 1024 + 512];
        image[0x1f1] = 1; // setup_sects
        image[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
        image[0x202..0x206].copy_from_slice(b"HdrS");
        image[0x206..0x208].copy_from_slice(&version.to_le_bytes());
        image[0x211] = 1; // loadflags: LOADED_HIGH
        image[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes()); // code32_start
        image[0x236..0x238].copy_from_slice(&xloadflags.to_le_bytes());
        image[1024..].fill(0x90);
        image
    }

    #[test]
    fn bzimage_enters_at_its_64_bit_entry_point() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), (16 * MIB) as usize)])
            .expect("guest memory");
        let mut file = tempfile_with(&fake_bzimage(0x020f, XLF_KERNEL_64));

        let kernel = load_kernel(&mem, &mut file, 16 * MIB).expect("load");

        assert_eq!(kernel.entry, GuestAddress(0x10_0200));
        assert_eq!(kernel.end, 0x10_0200);
        assert!(kernel.setup_header.is_some());
        assert_eq!(
            mem.read_obj::<u8>(GuestAddress(0x10_0000)).expect("read"),
            0x90
        );
    }

    #[test]
    fn bzimage_without_64_bit_entry_is_refused() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), (16 * MIB) as usize)])
            .expect("guest memory");
        let mut file = tempfile_with(&fake_bzimage(0x020f, 0));

        let err = load_kernel(&mem, &mut file, 16 * MIB).expect_err("32-bit only");

        assert!(matches!(err, BootError::NoLongModeEntry(0x020f)));
    }

    #[test]
    fn garbage_is_not_a_kernel() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), (16 * MIB) as usize)])
            .expect("guest memory");
        let mut file = tempfile_with(&[0x5a; 4096]);

        let err = load_kernel(&mem, &mut file, 16 * MIB).expect_err("garbage");

        assert!(matches!(err, BootError::NotAKernel(_)));
    }

    fn tempfile_with(bytes: &[u8]) -> File {
        let file = vmm_sys_util::tempfile::TempFile::new()
            .expect("tempfile")
            .into_file();
        std::io::Write::write_all(&mut &file, bytes).expect("write");
        (&file).seek(SeekFrom::Start(0)).expect("rewind");
        file
    }
}
