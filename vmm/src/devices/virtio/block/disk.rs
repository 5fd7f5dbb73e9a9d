//! Disk backends: a raw image read-write or read-only, or a copy-on-write
//! view of a read-only base image whose writes go to a sparse overlay file.
//!
//! The overlay has the base's size and holds written data at the same
//! offsets. Which 4 KiB clusters it holds is tracked in memory, rebuilt from
//! the overlay's allocated extents (SEEK_DATA) when it is reopened. A write
//! that covers part of a cluster first copies the base's cluster, so a
//! cluster in the overlay is always complete.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// Granularity of the copy-on-write overlay.
pub const CLUSTER_SIZE: u64 = 4096;

/// How an image is used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiskMode {
    ReadWrite,
    ReadOnly,
    /// Writes go to the overlay at this path (created sparse if missing).
    CopyOnWrite {
        overlay: PathBuf,
    },
}

/// Errors opening or using a disk.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("cannot open disk image {0}: {1}")]
    Open(PathBuf, #[source] std::io::Error),
    #[error("disk image {0} is {1} bytes, not a multiple of 512")]
    Size(PathBuf, u64),
    #[error(
        "overlay {path} is {found} bytes but its base is {expected}; it belongs to another image"
    )]
    OverlaySize {
        path: PathBuf,
        found: u64,
        expected: u64,
    },
    #[error("the disk is read-only")]
    ReadOnly,
    #[error("access at {offset:#x}+{len:#x} is beyond the end of the disk ({size:#x})")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("disk I/O failed: {0}")]
    Io(#[from] std::io::Error),
}

struct Overlay {
    file: File,
    /// One bit per cluster: the cluster's data is in the overlay.
    present: Vec<u64>,
}

impl Overlay {
    fn has(&self, cluster: u64) -> bool {
        self.present[(cluster / 64) as usize] & (1 << (cluster % 64)) != 0
    }

    fn mark(&mut self, cluster: u64) {
        self.present[(cluster / 64) as usize] |= 1 << (cluster % 64);
    }
}

/// An open disk.
pub struct Disk {
    base: File,
    overlay: Option<Overlay>,
    read_only: bool,
    size: u64,
}

impl std::fmt::Debug for Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disk")
            .field("size", &self.size)
            .field("read_only", &self.read_only)
            .field("cow", &self.overlay.is_some())
            .finish()
    }
}

impl Disk {
    /// Opens `path` in `mode`. In read-only and copy-on-write modes the base
    /// is opened read-only, so it cannot change whatever the guest does.
    pub fn open(path: &Path, mode: &DiskMode) -> Result<Self, DiskError> {
        let writable = *mode == DiskMode::ReadWrite;
        let base = OpenOptions::new()
            .read(true)
            .write(writable)
            .open(path)
            .map_err(|e| DiskError::Open(path.to_owned(), e))?;
        let size = base
            .metadata()
            .map_err(|e| DiskError::Open(path.to_owned(), e))?
            .len();
        if size % super::SECTOR_SIZE != 0 {
            return Err(DiskError::Size(path.to_owned(), size));
        }
        let overlay = match mode {
            DiskMode::CopyOnWrite { overlay } => Some(open_overlay(overlay, size)?),
            _ => None,
        };
        Ok(Disk {
            base,
            overlay,
            read_only: *mode == DiskMode::ReadOnly,
            size,
        })
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), DiskError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(DiskError::OutOfRange {
                offset,
                len,
                size: self.size,
            }),
        }
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DiskError> {
        self.check_range(offset, buf.len() as u64)?;
        let Some(overlay) = &self.overlay else {
            return Ok(self.base.read_exact_at(buf, offset)?);
        };
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let cluster = pos / CLUSTER_SIZE;
            let in_cluster = ((cluster + 1) * CLUSTER_SIZE - pos).min((buf.len() - done) as u64);
            let chunk = &mut buf[done..done + in_cluster as usize];
            if overlay.has(cluster) {
                overlay.file.read_exact_at(chunk, pos)?;
            } else {
                self.base.read_exact_at(chunk, pos)?;
            }
            done += in_cluster as usize;
        }
        Ok(())
    }

    /// Writes `buf` at `offset`.
    pub fn write_at(&mut self, buf: &[u8], offset: u64) -> Result<(), DiskError> {
        if self.read_only {
            return Err(DiskError::ReadOnly);
        }
        self.check_range(offset, buf.len() as u64)?;
        let Some(overlay) = &mut self.overlay else {
            return Ok(self.base.write_all_at(buf, offset)?);
        };
        let mut done = 0usize;
        let mut cluster_buf = vec![0u8; CLUSTER_SIZE as usize];
        while done < buf.len() {
            let pos = offset + done as u64;
            let cluster = pos / CLUSTER_SIZE;
            let cluster_start = cluster * CLUSTER_SIZE;
            let in_cluster = (cluster_start + CLUSTER_SIZE - pos).min((buf.len() - done) as u64);
            let chunk = &buf[done..done + in_cluster as usize];
            if !overlay.has(cluster) && in_cluster < CLUSTER_SIZE {
                // Complete the cluster from the base before the partial write.
                let len = CLUSTER_SIZE.min(self.size - cluster_start) as usize;
                self.base
                    .read_exact_at(&mut cluster_buf[..len], cluster_start)?;
                let at = (pos - cluster_start) as usize;
                cluster_buf[at..at + chunk.len()].copy_from_slice(chunk);
                overlay
                    .file
                    .write_all_at(&cluster_buf[..len], cluster_start)?;
            } else {
                overlay.file.write_all_at(chunk, pos)?;
            }
            overlay.mark(cluster);
            done += in_cluster as usize;
        }
        Ok(())
    }

    /// Makes written data durable.
    pub fn flush(&self) -> Result<(), DiskError> {
        match &self.overlay {
            Some(overlay) => overlay.file.sync_data()?,
            None if !self.read_only => self.base.sync_data()?,
            None => {}
        }
        Ok(())
    }
}

fn open_overlay(path: &Path, size: u64) -> Result<Overlay, DiskError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| DiskError::Open(path.to_owned(), e))?;
    let found = file
        .metadata()
        .map_err(|e| DiskError::Open(path.to_owned(), e))?
        .len();
    match found {
        0 => file
            .set_len(size)
            .map_err(|e| DiskError::Open(path.to_owned(), e))?,
        n if n == size => {}
        n => {
            return Err(DiskError::OverlaySize {
                path: path.to_owned(),
                found: n,
                expected: size,
            })
        }
    }
    let clusters = size.div_ceil(CLUSTER_SIZE);
    let mut overlay = Overlay {
        present: vec![0; clusters.div_ceil(64) as usize],
        file,
    };
    for (start, end) in data_extents(&overlay.file, size)? {
        for cluster in start / CLUSTER_SIZE..end.div_ceil(CLUSTER_SIZE) {
            overlay.mark(cluster);
        }
    }
    Ok(overlay)
}

/// The allocated (start, end) extents of `file`, from SEEK_DATA/SEEK_HOLE.
fn data_extents(file: &File, size: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let fd = file.as_raw_fd();
    let mut extents = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < size {
        // SAFETY: lseek on a valid descriptor; no memory is touched.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENXIO) {
                break; // no data after pos
            }
            return Err(err);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        extents.push((data as u64, (hole as u64).min(size)));
        pos = hole;
    }
    Ok(extents)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::tempdir::TempDir;

    fn image(dir: &TempDir, name: &str, bytes: &[u8]) -> PathBuf {
        let path = dir.as_path().join(name);
        std::fs::write(&path, bytes).expect("write image");
        path
    }

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    #[test]
    fn read_write_image_round_trip() {
        let dir = TempDir::new().expect("tempdir");
        let path = image(&dir, "disk", &[0u8; 8192]);
        let mut disk = Disk::open(&path, &DiskMode::ReadWrite).expect("open");

        disk.write_at(b"hello", 1000).expect("write");
        let mut back = [0u8; 5];
        disk.read_at(&mut back, 1000).expect("read");

        assert_eq!(&back, b"hello");
        assert_eq!(
            &std::fs::read(&path).expect("read image")[1000..1005],
            b"hello"
        );
    }

    #[test]
    fn read_only_refuses_writes() {
        let dir = TempDir::new().expect("tempdir");
        let path = image(&dir, "disk", &[0u8; 4096]);
        let mut disk = Disk::open(&path, &DiskMode::ReadOnly).expect("open");

        assert!(matches!(disk.write_at(b"x", 0), Err(DiskError::ReadOnly)));
    }

    #[test]
    fn accesses_beyond_the_end_are_refused() {
        let dir = TempDir::new().expect("tempdir");
        let path = image(&dir, "disk", &[0u8; 4096]);
        let mut disk = Disk::open(&path, &DiskMode::ReadWrite).expect("open");
        let mut buf = [0u8; 512];

        assert!(matches!(
            disk.read_at(&mut buf, 4096 - 511),
            Err(DiskError::OutOfRange { .. })
        ));
        assert!(matches!(
            disk.write_at(&buf, u64::MAX - 10),
            Err(DiskError::OutOfRange { .. })
        ));
    }

    #[test]
    fn copy_on_write_keeps_the_base_and_merges_partial_clusters() {
        let dir = TempDir::new().expect("tempdir");
        let base_bytes = pattern(3 * 4096);
        let base = image(&dir, "base", &base_bytes);
        let overlay = dir.as_path().join("overlay");
        let mode = DiskMode::CopyOnWrite {
            overlay: overlay.clone(),
        };
        let mut disk = Disk::open(&base, &mode).expect("open");

        disk.write_at(&[0xee; 100], 4096 + 50).expect("write");
        let mut all = vec![0u8; 3 * 4096];
        disk.read_at(&mut all, 0).expect("read");

        let mut expected = base_bytes.clone();
        expected[4096 + 50..4096 + 150].fill(0xee);
        assert_eq!(all, expected);
        assert_eq!(std::fs::read(&base).expect("base"), base_bytes);
    }

    #[test]
    fn reopened_overlay_remembers_written_clusters() {
        let dir = TempDir::new().expect("tempdir");
        let base_bytes = pattern(4 * 4096);
        let base = image(&dir, "base", &base_bytes);
        let mode = DiskMode::CopyOnWrite {
            overlay: dir.as_path().join("overlay"),
        };
        Disk::open(&base, &mode)
            .expect("open")
            .write_at(&[1; 4096], 2 * 4096)
            .expect("write");

        let disk = Disk::open(&base, &mode).expect("reopen");
        let mut back = vec![0u8; 4 * 4096];
        disk.read_at(&mut back, 0).expect("read");

        assert_eq!(&back[2 * 4096..3 * 4096], &[1u8; 4096][..]);
        assert_eq!(&back[..2 * 4096], &base_bytes[..2 * 4096]);
        assert_eq!(&back[3 * 4096..], &base_bytes[3 * 4096..]);
    }

    #[test]
    fn overlay_of_another_size_is_refused() {
        let dir = TempDir::new().expect("tempdir");
        let base = image(&dir, "base", &[0u8; 8192]);
        let overlay = image(&dir, "overlay", &[0u8; 4096]);

        let err = Disk::open(&base, &DiskMode::CopyOnWrite { overlay }).expect_err("size");

        assert!(matches!(err, DiskError::OverlaySize { .. }));
    }
}
