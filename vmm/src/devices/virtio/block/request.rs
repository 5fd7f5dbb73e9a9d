//! Parsing and executing one virtio-block request (5.2.6). The guest controls
//! every descriptor, so each is checked: direction, length, and that it lies
//! inside guest memory, before any byte moves.

use crate::vstate::memory::GuestMemoryMmap;
use virtio_queue::desc::split::Descriptor;
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, Permissions};

use super::disk::{Disk, DiskError};
use super::SECTOR_SIZE;

pub const VIRTIO_BLK_T_IN: u32 = 0;
pub const VIRTIO_BLK_T_OUT: u32 = 1;
pub const VIRTIO_BLK_T_FLUSH: u32 = 4;
pub const VIRTIO_BLK_T_GET_ID: u32 = 8;
pub const VIRTIO_BLK_S_OK: u8 = 0;
pub const VIRTIO_BLK_S_IOERR: u8 = 1;
pub const VIRTIO_BLK_S_UNSUPP: u8 = 2;
/// Length of the request header: type, reserved, sector.
const HEADER_LEN: u32 = 16;
/// Length of the device id returned by GET_ID.
pub const ID_LEN: usize = 20;
/// Largest data payload of one request. Linux sends at most a few hundred KiB.
pub const MAX_DATA_LEN: u64 = 16 << 20;
/// Bounce buffer size for moving data between the disk and guest memory.
const CHUNK: usize = 64 << 10;

/// Why a request is malformed. The status byte, when it can be written,
/// says IOERR; the reason goes to the log.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RequestError {
    #[error("the chain has no descriptors")]
    Empty,
    #[error("the header descriptor is write-only or shorter than 16 bytes")]
    BadHeader,
    #[error("the chain has no writable status byte at its end")]
    NoStatus,
    #[error("descriptor {addr:#x}+{len:#x} is outside guest memory")]
    OutOfMemory { addr: u64, len: u32 },
    #[error("a data descriptor has the wrong direction for this request")]
    WrongDirection,
    #[error("the data length {0} is not a multiple of 512")]
    Unaligned(u64),
    #[error("the data length {0} exceeds the {MAX_DATA_LEN}-byte limit")]
    TooLong(u64),
}

/// A parsed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub kind: u32,
    pub sector: u64,
    /// Data buffers in chain order.
    pub data: Vec<(GuestAddress, u32)>,
    /// Where the status byte goes.
    pub status: GuestAddress,
}

impl Request {
    /// Total data length.
    pub fn data_len(&self) -> u64 {
        self.data.iter().map(|(_, len)| u64::from(*len)).sum()
    }
}

/// Parses the descriptors of one chain. On error, returns the status
/// address if the chain has a usable one, so the guest can be told.
pub fn parse(
    mem: &GuestMemoryMmap,
    descriptors: &[Descriptor],
) -> Result<Request, (RequestError, Option<GuestAddress>)> {
    let (first, rest) = descriptors
        .split_first()
        .ok_or((RequestError::Empty, None))?;
    let status_desc = rest.last().filter(|d| d.is_write_only() && d.len() >= 1);
    let status = status_desc.map(|d| d.addr());
    let fail = |e| (e, status);
    for d in descriptors {
        let access = if d.is_write_only() {
            Permissions::Write
        } else {
            Permissions::Read
        };
        if !mem.check_range(d.addr(), d.len() as usize, access) {
            return Err((
                RequestError::OutOfMemory {
                    addr: d.addr().0,
                    len: d.len(),
                },
                None,
            ));
        }
    }
    if first.is_write_only() || first.len() < HEADER_LEN {
        return Err(fail(RequestError::BadHeader));
    }
    let status = status.ok_or((RequestError::NoStatus, None))?;
    let kind: u32 = mem
        .read_obj(first.addr())
        .map_err(|_| fail(RequestError::BadHeader))?;
    let sector: u64 = mem
        .read_obj(first.addr().unchecked_add(8))
        .map_err(|_| fail(RequestError::BadHeader))?;
    let data_descs = &rest[..rest.len() - 1];
    let device_writes = matches!(kind, VIRTIO_BLK_T_IN | VIRTIO_BLK_T_GET_ID);
    let mut data = Vec::with_capacity(data_descs.len());
    for d in data_descs {
        if d.is_write_only() != device_writes {
            return Err(fail(RequestError::WrongDirection));
        }
        // Zero-length buffers carry nothing; skip them.
        if d.len() > 0 {
            data.push((d.addr(), d.len()));
        }
    }
    let request = Request {
        kind,
        sector,
        data,
        status,
    };
    let len = request.data_len();
    if len > MAX_DATA_LEN {
        return Err(fail(RequestError::TooLong(len)));
    }
    if matches!(kind, VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT) && len % SECTOR_SIZE != 0 {
        return Err(fail(RequestError::Unaligned(len)));
    }
    Ok(request)
}

/// Executes `request` against `disk`; returns the status byte and how many
/// bytes were written into guest buffers (for the used ring).
pub fn execute(
    request: &Request,
    disk: &mut Disk,
    mem: &GuestMemoryMmap,
    id: &[u8; ID_LEN],
) -> (u8, u32) {
    let result = match request.kind {
        VIRTIO_BLK_T_IN => {
            transfer(request, disk, mem, Direction::ToGuest).map(|_| request.data_len())
        }
        VIRTIO_BLK_T_OUT => transfer(request, disk, mem, Direction::ToDisk).map(|_| 0),
        VIRTIO_BLK_T_FLUSH => disk.flush().map(|_| 0),
        VIRTIO_BLK_T_GET_ID => write_id(request, mem, id),
        kind => {
            tracing::debug!("virtio-block: unsupported request type {kind}");
            return (VIRTIO_BLK_S_UNSUPP, 0);
        }
    };
    match result {
        Ok(written) => (VIRTIO_BLK_S_OK, written as u32),
        Err(e) => {
            tracing::warn!(
                "virtio-block: request type {} at sector {} failed: {e}",
                request.kind,
                request.sector
            );
            (VIRTIO_BLK_S_IOERR, 0)
        }
    }
}

enum Direction {
    ToGuest,
    ToDisk,
}

fn transfer(
    request: &Request,
    disk: &mut Disk,
    mem: &GuestMemoryMmap,
    dir: Direction,
) -> Result<(), DiskError> {
    let mut offset = request
        .sector
        .checked_mul(SECTOR_SIZE)
        .ok_or(DiskError::OutOfRange {
            offset: u64::MAX,
            len: 0,
            size: disk.size(),
        })?;
    // Check the whole request first so a failing request changes nothing.
    if offset
        .checked_add(request.data_len())
        .is_none_or(|end| end > disk.size())
    {
        return Err(DiskError::OutOfRange {
            offset,
            len: request.data_len(),
            size: disk.size(),
        });
    }
    let mut buf = vec![0u8; CHUNK];
    for &(addr, len) in &request.data {
        let mut done = 0u64;
        while done < u64::from(len) {
            let n = (u64::from(len) - done).min(CHUNK as u64) as usize;
            let guest = addr.unchecked_add(done);
            match dir {
                Direction::ToGuest => {
                    disk.read_at(&mut buf[..n], offset)?;
                    mem.write_slice(&buf[..n], guest).map_err(io_error)?;
                }
                Direction::ToDisk => {
                    mem.read_slice(&mut buf[..n], guest).map_err(io_error)?;
                    disk.write_at(&buf[..n], offset)?;
                }
            }
            done += n as u64;
            offset += n as u64;
        }
    }
    Ok(())
}

fn write_id(request: &Request, mem: &GuestMemoryMmap, id: &[u8; ID_LEN]) -> Result<u64, DiskError> {
    let mut remaining: &[u8] = id;
    let mut written = 0u64;
    for &(addr, len) in &request.data {
        let n = remaining.len().min(len as usize);
        mem.write_slice(&remaining[..n], addr).map_err(io_error)?;
        remaining = &remaining[n..];
        written += n as u64;
    }
    Ok(written)
}

fn io_error(e: vm_memory::GuestMemoryError) -> DiskError {
    DiskError::Io(std::io::Error::other(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};

    const MIB: usize = 1 << 20;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MIB)]).expect("memory")
    }

    fn desc(addr: u64, len: u32, write: bool) -> Descriptor {
        let flags = if write { VRING_DESC_F_WRITE as u16 } else { 0 };
        Descriptor::from(RawDescriptor::from(Descriptor::new(addr, len, flags, 0)))
    }

    fn header(mem: &GuestMemoryMmap, at: u64, kind: u32, sector: u64) {
        mem.write_obj(kind, GuestAddress(at)).expect("write");
        mem.write_obj(sector, GuestAddress(at + 8)).expect("write");
    }

    #[test]
    fn parses_a_read() {
        let m = mem();
        header(&m, 0x1000, VIRTIO_BLK_T_IN, 8);

        let req = parse(
            &m,
            &[
                desc(0x1000, 16, false),
                desc(0x2000, 1024, true),
                desc(0x3000, 1, true),
            ],
        )
        .expect("valid");

        assert_eq!(req.kind, VIRTIO_BLK_T_IN);
        assert_eq!(req.sector, 8);
        assert_eq!(req.data, vec![(GuestAddress(0x2000), 1024)]);
        assert_eq!(req.status, GuestAddress(0x3000));
    }

    #[test]
    fn descriptor_outside_guest_memory_is_refused() {
        let m = mem();
        header(&m, 0x1000, VIRTIO_BLK_T_IN, 0);

        let err = parse(
            &m,
            &[
                desc(0x1000, 16, false),
                desc(MIB as u64 - 100, 512, true),
                desc(0x3000, 1, true),
            ],
        )
        .expect_err("outside");

        assert!(matches!(err.0, RequestError::OutOfMemory { .. }));
    }

    #[test]
    fn wrong_direction_is_refused_with_status() {
        let m = mem();
        header(&m, 0x1000, VIRTIO_BLK_T_OUT, 0);

        let err = parse(
            &m,
            &[
                desc(0x1000, 16, false),
                desc(0x2000, 512, true),
                desc(0x3000, 1, true),
            ],
        )
        .expect_err("direction");

        assert_eq!(
            err,
            (RequestError::WrongDirection, Some(GuestAddress(0x3000)))
        );
    }

    #[test]
    fn writable_header_and_missing_status_are_refused() {
        let m = mem();

        let bad_header =
            parse(&m, &[desc(0x1000, 16, true), desc(0x3000, 1, true)]).expect_err("header");
        let no_status =
            parse(&m, &[desc(0x1000, 16, false), desc(0x2000, 512, false)]).expect_err("status");
        let empty = parse(&m, &[]).expect_err("empty");

        assert_eq!(bad_header.0, RequestError::BadHeader);
        assert_eq!(no_status, (RequestError::NoStatus, None));
        assert_eq!(empty, (RequestError::Empty, None));
    }

    #[test]
    fn unaligned_and_oversized_data_are_refused() {
        let m = mem();
        header(&m, 0x1000, VIRTIO_BLK_T_IN, 0);
        let many: Vec<Descriptor> = std::iter::once(desc(0x1000, 16, false))
            .chain((0..20).map(|_| desc(0x2000, 1 << 20, true)))
            .chain(std::iter::once(desc(0x3000, 1, true)))
            .collect();

        let unaligned = parse(
            &m,
            &[
                desc(0x1000, 16, false),
                desc(0x2000, 100, true),
                desc(0x3000, 1, true),
            ],
        );
        let huge = parse(
            &GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 * MIB)]).expect("mem"),
            &many,
        );

        assert_eq!(
            unaligned.expect_err("unaligned").0,
            RequestError::Unaligned(100)
        );
        assert!(matches!(
            huge.expect_err("huge").0,
            RequestError::TooLong(_)
        ));
    }

    #[test]
    fn zero_length_buffers_are_skipped() {
        let m = mem();
        header(&m, 0x1000, VIRTIO_BLK_T_IN, 0);

        let req = parse(
            &m,
            &[
                desc(0x1000, 16, false),
                desc(0x2000, 0, true),
                desc(0x3000, 1, true),
            ],
        )
        .expect("valid");

        assert!(req.data.is_empty());
    }

    #[test]
    fn read_beyond_the_end_of_the_disk_fails_and_touches_nothing() {
        let m = mem();
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let path = dir.as_path().join("disk");
        std::fs::write(&path, [7u8; 4096]).expect("image");
        let mut disk = Disk::open(&path, &super::super::DiskMode::ReadWrite).expect("open");
        let req = Request {
            kind: VIRTIO_BLK_T_IN,
            sector: 7,
            data: vec![(GuestAddress(0x2000), 1024)],
            status: GuestAddress(0x3000),
        };

        let (status, written) = execute(&req, &mut disk, &m, &[0; ID_LEN]);

        assert_eq!((status, written), (VIRTIO_BLK_S_IOERR, 0));
        assert_eq!(m.read_obj::<u8>(GuestAddress(0x2000)).expect("read"), 0);
    }

    #[test]
    fn read_and_write_move_the_right_bytes() {
        let m = mem();
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let path = dir.as_path().join("disk");
        std::fs::write(&path, [0u8; 8192]).expect("image");
        let mut disk = Disk::open(&path, &super::super::DiskMode::ReadWrite).expect("open");
        m.write_slice(&[0xab; 512], GuestAddress(0x4000))
            .expect("fill");
        let write = Request {
            kind: VIRTIO_BLK_T_OUT,
            sector: 3,
            data: vec![(GuestAddress(0x4000), 512)],
            status: GuestAddress(0x3000),
        };
        let read = Request {
            kind: VIRTIO_BLK_T_IN,
            sector: 3,
            data: vec![(GuestAddress(0x5000), 512)],
            status: GuestAddress(0x3000),
        };

        assert_eq!(
            execute(&write, &mut disk, &m, &[0; ID_LEN]),
            (VIRTIO_BLK_S_OK, 0)
        );
        assert_eq!(
            execute(&read, &mut disk, &m, &[0; ID_LEN]),
            (VIRTIO_BLK_S_OK, 512)
        );

        let mut back = [0u8; 512];
        m.read_slice(&mut back, GuestAddress(0x5000)).expect("read");
        assert_eq!(back, [0xab; 512]);
        assert_eq!(std::fs::read(&path).expect("image")[3 * 512], 0xab);
    }

    #[test]
    fn unknown_request_type_is_unsupported() {
        let m = mem();
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let path = dir.as_path().join("disk");
        std::fs::write(&path, [0u8; 4096]).expect("image");
        let mut disk = Disk::open(&path, &super::super::DiskMode::ReadWrite).expect("open");
        let req = Request {
            kind: 0xdead,
            sector: 0,
            data: vec![],
            status: GuestAddress(0x3000),
        };

        assert_eq!(
            execute(&req, &mut disk, &m, &[0; ID_LEN]).0,
            VIRTIO_BLK_S_UNSUPP
        );
    }
}
