//! The husk snapshot file format and the [`Persist`] trait that VM parts
//! implement. No KVM dependency: this crate only frames and checks bytes
//! and names the contract.
//!
//! ```text
//! offset  size  field
//! 0       8     magic "HUSKSNAP"
//! 8       2     major version (little endian); other majors are refused
//! 10      2     minor version; newer minors of the same major are readable
//! 12      8     length N of the state that follows
//! 20      N     state (serialized by the VMM)
//! 20+N    8     CRC-64/XZ of bytes 0..20+N
//! ```
//!
//! A file that is truncated, longer than its header says, corrupt, or of
//! another major version is refused with an error naming the problem.

use std::io::{Read, Write};

/// A part of a VM that saves to a serializable state and is rebuilt from
/// that state plus what cannot be serialized: file descriptors, guest
/// memory, the device a transport drives (Firecracker's
/// `snapshot::Persist`).
///
/// `restore` treats the state as untrusted input: a state that does not
/// fit the constructor arguments (another queue count, a queue outside
/// guest memory) is an error, never a panic.
pub trait Persist: Sized {
    /// What is saved.
    type State: serde::Serialize + serde::de::DeserializeOwned;
    /// What a restore needs besides the state.
    type ConstructorArgs;
    /// Why a state cannot be restored.
    type Error: std::fmt::Display;

    /// The part's state. The part must be quiet (its VM paused).
    fn save(&self) -> Self::State;

    /// Rebuilds the part from `state`.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error>;
}

/// File magic.
pub const MAGIC: [u8; 8] = *b"HUSKSNAP";
/// Major version written by this build; files of other majors are refused.
/// 2: the VM state has no PIT (husk-vmm creates none).
/// 3: each vCPU's TSC and the VM's clock carry the host time they were read at.
pub const MAJOR: u16 = 3;
/// Minor version written by this build.
pub const MINOR: u16 = 0;
const HEADER_LEN: usize = 20;
const CRC_LEN: usize = 8;
/// Largest state accepted, so a corrupt length cannot make us allocate
/// without bound.
pub const MAX_STATE_LEN: u64 = 1 << 30;

/// Errors reading or writing a snapshot file.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("not a husk snapshot (bad magic)")]
    BadMagic,
    #[error("snapshot format {found}.x is not supported by this husk (it reads {MAJOR}.x)")]
    UnsupportedVersion { found: u16 },
    #[error("snapshot is truncated: {0}")]
    Truncated(&'static str),
    #[error("snapshot state claims {0} bytes, more than the {MAX_STATE_LEN} allowed")]
    TooLarge(u64),
    #[error(
        "snapshot is corrupt: CRC64 {found:#018x} does not match the computed {computed:#018x}"
    )]
    Crc { found: u64, computed: u64 },
    #[error("snapshot has {0} unexpected bytes after its checksum")]
    TrailingBytes(usize),
    #[error("snapshot I/O failed: {0}")]
    Io(#[from] std::io::Error),
}

/// The parsed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotHeader {
    pub major: u16,
    pub minor: u16,
    pub state_len: u64,
}

/// CRC-64/XZ (ECMA-182 polynomial, reflected), as used by xz.
pub fn crc64(bytes: &[u8]) -> u64 {
    let mut crc = Crc64::new();
    crc.update(bytes);
    crc.finish()
}

/// CRC-64/XZ over data that comes in pieces ([`crc64`] of their
/// concatenation).
#[derive(Debug, Clone, Copy)]
pub struct Crc64(u64);

impl Default for Crc64 {
    fn default() -> Self {
        Self::new()
    }
}

impl Crc64 {
    /// Slicing-by-8 tables: `TABLES[0]` is the bytewise table, `TABLES[k]`
    /// the CRC of a byte followed by `k` zero bytes (8 bytes a step).
    const TABLES: [[u64; 256]; 8] = {
        const POLY: u64 = 0xc96c_5795_d787_0f42;
        let mut tables = [[0u64; 256]; 8];
        let mut i = 0;
        while i < 256 {
            let mut crc = i as u64;
            let mut bit = 0;
            while bit < 8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ POLY
                } else {
                    crc >> 1
                };
                bit += 1;
            }
            tables[0][i] = crc;
            i += 1;
        }
        let mut k = 1;
        while k < 8 {
            let mut i = 0;
            while i < 256 {
                let prev = tables[k - 1][i];
                tables[k][i] = tables[0][(prev & 0xff) as usize] ^ (prev >> 8);
                i += 1;
            }
            k += 1;
        }
        tables
    };

    pub fn new() -> Self {
        Crc64(!0)
    }

    pub fn update(&mut self, bytes: &[u8]) {
        let t = &Self::TABLES;
        let mut crc = self.0;
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            let v = crc ^ u64::from_le_bytes(word);
            crc = t[7][(v & 0xff) as usize]
                ^ t[6][((v >> 8) & 0xff) as usize]
                ^ t[5][((v >> 16) & 0xff) as usize]
                ^ t[4][((v >> 24) & 0xff) as usize]
                ^ t[3][((v >> 32) & 0xff) as usize]
                ^ t[2][((v >> 40) & 0xff) as usize]
                ^ t[1][((v >> 48) & 0xff) as usize]
                ^ t[0][(v >> 56) as usize];
        }
        for &b in chunks.remainder() {
            crc = t[0][((crc ^ u64::from(b)) & 0xff) as usize] ^ (crc >> 8);
        }
        self.0 = crc;
    }

    pub fn finish(self) -> u64 {
        !self.0
    }
}

/// Writes `state` framed with the header and checksum.
pub fn write_snapshot<W: Write>(out: &mut W, state: &[u8]) -> Result<(), SnapshotError> {
    let mut buf = Vec::with_capacity(HEADER_LEN + state.len() + CRC_LEN);
    buf.extend(MAGIC);
    buf.extend(MAJOR.to_le_bytes());
    buf.extend(MINOR.to_le_bytes());
    buf.extend((state.len() as u64).to_le_bytes());
    buf.extend(state);
    let crc = crc64(&buf);
    buf.extend(crc.to_le_bytes());
    out.write_all(&buf)?;
    Ok(())
}

/// Reads a whole snapshot file and returns its header and verified state.
pub fn read_snapshot<R: Read>(input: &mut R) -> Result<(SnapshotHeader, Vec<u8>), SnapshotError> {
    let mut bytes = Vec::new();
    input
        .take(MAX_STATE_LEN + (HEADER_LEN + CRC_LEN) as u64 + 1)
        .read_to_end(&mut bytes)?;
    let header = parse_header(&bytes)?;
    let end = HEADER_LEN + header.state_len as usize;
    let crc_bytes = bytes
        .get(end..end + CRC_LEN)
        .ok_or(SnapshotError::Truncated("state or checksum missing"))?;
    if bytes.len() > end + CRC_LEN {
        return Err(SnapshotError::TrailingBytes(bytes.len() - end - CRC_LEN));
    }
    let found = u64::from_le_bytes(crc_bytes.try_into().unwrap_or_default());
    let computed = crc64(&bytes[..end]);
    if found != computed {
        return Err(SnapshotError::Crc { found, computed });
    }
    bytes.truncate(end);
    Ok((header, bytes.split_off(HEADER_LEN)))
}

fn parse_header(bytes: &[u8]) -> Result<SnapshotHeader, SnapshotError> {
    let header = bytes
        .get(..HEADER_LEN)
        .ok_or(SnapshotError::Truncated("header missing"))?;
    if header[..8] != MAGIC {
        return Err(SnapshotError::BadMagic);
    }
    let major = u16::from_le_bytes([header[8], header[9]]);
    let minor = u16::from_le_bytes([header[10], header[11]]);
    if major != MAJOR {
        return Err(SnapshotError::UnsupportedVersion { found: major });
    }
    let state_len = u64::from_le_bytes(header[12..20].try_into().unwrap_or_default());
    if state_len > MAX_STATE_LEN {
        return Err(SnapshotError::TooLarge(state_len));
    }
    Ok(SnapshotHeader {
        major,
        minor,
        state_len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(state: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        write_snapshot(&mut out, state).expect("write");
        out
    }

    #[test]
    fn crc64_matches_the_xz_check_value() {
        assert_eq!(crc64(b"123456789"), 0x995d_c9bb_df19_39fa);
    }

    #[test]
    fn round_trip() {
        let bytes = snapshot(b"vcpu and device state");

        let (header, state) = read_snapshot(&mut bytes.as_slice()).expect("read");

        assert_eq!(
            header,
            SnapshotHeader {
                major: MAJOR,
                minor: MINOR,
                state_len: 21
            }
        );
        assert_eq!(state, b"vcpu and device state");
    }

    #[test]
    fn truncated_file_is_refused() {
        let bytes = snapshot(b"state");

        let err = read_snapshot(&mut &bytes[..bytes.len() - 1]).expect_err("truncated");

        assert!(matches!(err, SnapshotError::Truncated(_)));
    }

    #[test]
    fn corrupt_state_is_refused() {
        let mut bytes = snapshot(b"state");
        bytes[HEADER_LEN + 2] ^= 0x01;

        let err = read_snapshot(&mut bytes.as_slice()).expect_err("corrupt");

        assert!(matches!(err, SnapshotError::Crc { .. }));
    }

    #[test]
    fn crc64_is_crc64_xz_in_pieces_or_whole() {
        // The CRC catalogue's check value for CRC-64/XZ.
        assert_eq!(crc64(b"123456789"), 0x995d_c9bb_df19_39fa);
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut pieces = Crc64::new();
        for piece in data.chunks(13) {
            pieces.update(piece);
        }
        assert_eq!(pieces.finish(), crc64(&data));
    }

    #[test]
    fn other_major_version_is_refused() {
        let mut bytes = snapshot(b"state");
        bytes[8] = 1;

        let err = read_snapshot(&mut bytes.as_slice()).expect_err("version");

        assert!(matches!(
            err,
            SnapshotError::UnsupportedVersion { found: 1 }
        ));
    }

    #[test]
    fn bad_magic_is_refused() {
        let mut bytes = snapshot(b"state");
        bytes[0] = b'X';

        let err = read_snapshot(&mut bytes.as_slice()).expect_err("magic");

        assert!(matches!(err, SnapshotError::BadMagic));
    }

    #[test]
    fn huge_claimed_length_is_refused_without_allocating() {
        let mut bytes = snapshot(b"state");
        bytes[12..20].copy_from_slice(&u64::MAX.to_le_bytes());

        let err = read_snapshot(&mut bytes.as_slice()).expect_err("length");

        assert!(matches!(err, SnapshotError::TooLarge(_)));
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let mut bytes = snapshot(b"state");
        bytes.push(0);

        let err = read_snapshot(&mut bytes.as_slice()).expect_err("trailing");

        assert!(matches!(err, SnapshotError::TrailingBytes(1)));
    }
}
