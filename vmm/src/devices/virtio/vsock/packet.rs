//! virtio-vsock packets (virtio 1.2, section 5.10.6): a 44-byte little-endian
//! header followed by `len` bytes of payload, gathered from or scattered to
//! a descriptor chain. Every field comes from the guest and is checked.

use crate::vstate::memory::GuestMemoryMmap;
use virtio_queue::desc::split::Descriptor;
use vm_memory::Bytes;

pub const HEADER_LEN: usize = 44;
/// Largest payload accepted from or sent to the guest (Linux uses 64 KiB).
pub const MAX_PAYLOAD: usize = 64 << 10;

pub const TYPE_STREAM: u16 = 1;
pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;
/// SHUTDOWN flags: the sender will receive no more / send no more.
pub const SHUTDOWN_RCV: u32 = 1;
pub const SHUTDOWN_SEND: u32 = 2;
/// The host's CID.
pub const HOST_CID: u64 = 2;

/// A packet header.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl Header {
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    pub fn from_bytes(b: &[u8; HEADER_LEN]) -> Self {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        Header {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }
}

/// A malformed packet from the guest.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PacketError {
    #[error("a TX descriptor is device-writable")]
    WritableTx,
    #[error("an RX descriptor is not device-writable")]
    ReadableRx,
    #[error("the chain is shorter than a packet header")]
    ShortHeader,
    #[error("the header announces {0} payload bytes, more than {MAX_PAYLOAD}")]
    TooLong(u32),
    #[error("the header announces {announced} payload bytes, the chain holds {found}")]
    Truncated { announced: u32, found: usize },
    #[error("a descriptor is outside guest memory")]
    Memory,
}

/// Reads a packet the guest put on the TX queue.
pub fn read_tx(
    mem: &GuestMemoryMmap,
    descriptors: &[Descriptor],
) -> Result<(Header, Vec<u8>), PacketError> {
    let mut bytes = Vec::new();
    for d in descriptors {
        if d.is_write_only() {
            return Err(PacketError::WritableTx);
        }
        let room = (HEADER_LEN + MAX_PAYLOAD).saturating_sub(bytes.len());
        let take = (d.len() as usize).min(room);
        let start = bytes.len();
        bytes.resize(start + take, 0);
        mem.read_slice(&mut bytes[start..], d.addr())
            .map_err(|_| PacketError::Memory)?;
        if take == 0 {
            break;
        }
    }
    let header_bytes: &[u8; HEADER_LEN] = bytes
        .get(..HEADER_LEN)
        .and_then(|h| h.try_into().ok())
        .ok_or(PacketError::ShortHeader)?;
    let header = Header::from_bytes(header_bytes);
    if header.len as usize > MAX_PAYLOAD {
        return Err(PacketError::TooLong(header.len));
    }
    let found = bytes.len() - HEADER_LEN;
    if found < header.len as usize {
        return Err(PacketError::Truncated {
            announced: header.len,
            found,
        });
    }
    bytes.truncate(HEADER_LEN + header.len as usize);
    Ok((header, bytes.split_off(HEADER_LEN)))
}

/// How many payload bytes an RX chain can take, after the header.
pub fn rx_capacity(descriptors: &[Descriptor]) -> Result<usize, PacketError> {
    let mut total = 0usize;
    for d in descriptors {
        if !d.is_write_only() {
            return Err(PacketError::ReadableRx);
        }
        total = total.saturating_add(d.len() as usize);
    }
    total
        .checked_sub(HEADER_LEN)
        .map(|n| n.min(MAX_PAYLOAD))
        .ok_or(PacketError::ShortHeader)
}

/// Writes a packet into an RX chain (checked with `rx_capacity`); returns
/// the bytes written.
pub fn write_rx(
    mem: &GuestMemoryMmap,
    descriptors: &[Descriptor],
    header: &Header,
    payload: &[u8],
) -> Result<u32, PacketError> {
    let header_bytes = header.to_bytes();
    let mut sources = [&header_bytes[..], payload];
    let mut written = 0u32;
    for d in descriptors {
        let mut offset = 0usize;
        while offset < d.len() as usize {
            let Some(src) = sources.iter_mut().find(|s| !s.is_empty()) else {
                return Ok(written);
            };
            let n = src.len().min(d.len() as usize - offset);
            mem.write_slice(&src[..n], d.addr().unchecked_add(offset as u64))
                .map_err(|_| PacketError::Memory)?;
            *src = &src[n..];
            offset += n;
            written += n as u32;
        }
    }
    if sources.iter().any(|s| !s.is_empty()) {
        return Err(PacketError::Truncated {
            announced: payload.len() as u32,
            found: written as usize,
        });
    }
    Ok(written)
}

use vm_memory::Address;

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
    use vm_memory::GuestAddress;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("memory")
    }

    fn desc(addr: u64, len: u32, write: bool) -> Descriptor {
        Descriptor::new(
            addr,
            len,
            if write { VRING_DESC_F_WRITE as u16 } else { 0 },
            0,
        )
    }

    fn header(len: u32) -> Header {
        Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 1,
            dst_port: 2,
            len,
            type_: TYPE_STREAM,
            op: OP_RW,
            ..Default::default()
        }
    }

    #[test]
    fn header_round_trips() {
        let h = Header {
            flags: 3,
            buf_alloc: 7,
            fwd_cnt: 9,
            ..header(5)
        };

        assert_eq!(Header::from_bytes(&h.to_bytes()), h);
    }

    #[test]
    fn reads_header_and_payload_from_separate_descriptors() {
        let m = mem();
        m.write_slice(&header(5).to_bytes(), GuestAddress(0x1000))
            .expect("write");
        m.write_slice(b"hello", GuestAddress(0x2000))
            .expect("write");

        let (h, payload) =
            read_tx(&m, &[desc(0x1000, 44, false), desc(0x2000, 5, false)]).expect("packet");

        assert_eq!(h, header(5));
        assert_eq!(payload, b"hello");
    }

    #[test]
    fn garbage_headers_are_refused() {
        let m = mem();
        m.write_slice(&header(1 << 20).to_bytes(), GuestAddress(0x1000))
            .expect("write");
        m.write_slice(&header(100).to_bytes(), GuestAddress(0x3000))
            .expect("write");

        assert_eq!(
            read_tx(&m, &[desc(0x1000, 44, false)]),
            Err(PacketError::TooLong(1 << 20))
        );
        assert_eq!(
            read_tx(&m, &[desc(0x3000, 44, false)]),
            Err(PacketError::Truncated {
                announced: 100,
                found: 0
            })
        );
        assert_eq!(
            read_tx(&m, &[desc(0x1000, 20, false)]),
            Err(PacketError::ShortHeader)
        );
        assert_eq!(
            read_tx(&m, &[desc(0x1000, 44, true)]),
            Err(PacketError::WritableTx)
        );
        assert_eq!(
            read_tx(&m, &[desc(0xfff00, 0x200, false)]),
            Err(PacketError::Memory)
        );
    }

    #[test]
    fn rx_scatter_spans_descriptors() {
        let m = mem();
        let chain = [desc(0x1000, 40, true), desc(0x2000, 4096, true)];

        let written = write_rx(&m, &chain, &header(3), b"abc").expect("write");

        let mut h = [0u8; HEADER_LEN];
        m.read_slice(&mut h[..40], GuestAddress(0x1000))
            .expect("read");
        m.read_slice(&mut h[40..], GuestAddress(0x2000))
            .expect("read");
        let mut p = [0u8; 3];
        m.read_slice(&mut p, GuestAddress(0x2004)).expect("read");
        assert_eq!(written, 47);
        assert_eq!(Header::from_bytes(&h), header(3));
        assert_eq!(&p, b"abc");
        assert_eq!(rx_capacity(&chain), Ok(4092));
    }

    #[test]
    fn readable_rx_buffers_are_refused() {
        assert_eq!(
            rx_capacity(&[desc(0x1000, 4096, false)]),
            Err(PacketError::ReadableRx)
        );
        assert_eq!(
            rx_capacity(&[desc(0x1000, 10, true)]),
            Err(PacketError::ShortHeader)
        );
    }
}
