//! Disk backends: a raw image read-write or read-only, or a copy-on-write
//! view of a read-only base image whose writes go to a sparse overlay file.
//!
//! The overlay has the base's size and holds written data at the same
//! offsets. Which 4 KiB clusters it holds is tracked in memory, rebuilt from
//! the overlay's allocated extents (SEEK_DATA) when it is reopened. A write
//! that covers part of a cluster first copies the cluster from below, so a
//! cluster in the overlay is always complete.
//!
//! Snapshots add read-only *layers* between the base and the overlay: a
//! snapshot copies the overlay's clusters into a layer file in its
//! directory, and each clone restored from it stacks its own new overlay
//! on top. Clones never share a writable file, and none can change what
//! another (or the snapshot) sees.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Granularity of the copy-on-write overlay.
pub const CLUSTER_SIZE: u64 = 4096;
/// Most read-only layers under a disk's overlay; a snapshot that would
/// stack more merges them into one.
pub const MAX_LAYERS: usize = husk_vmm_api::MAX_DRIVE_LAYERS;

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
    #[error("{path} is {found} bytes but the snapshot's drive is {expected}")]
    SnapshotSize {
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
    #[error("cannot write the disk's snapshot layer {0}: {1}")]
    Save(PathBuf, #[source] std::io::Error),
    #[error("{path} changed since the snapshot was taken ({what}); clones of it would see a corrupt disk")]
    Changed { path: PathBuf, what: String },
    #[error("{0} does not hold what its snapshot wrote there (its clusters' CRC-64 differs): the snapshot is corrupt")]
    Checksum(PathBuf),
    #[error("overlay {0} already exists: each clone needs a new overlay of its own")]
    OverlayExists(PathBuf),
    #[error("the drive is writable: give the clone its own overlay file")]
    NoOverlay,
    #[error("the drive is read-only in the snapshot and takes no overlay")]
    UnwantedOverlay,
}

/// A file a snapshot refers to, with what identifies its contents: a
/// restore refuses a file whose size or modification time moved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStamp {
    /// Absolute.
    pub path: PathBuf,
    pub len: u64,
    pub mtime_ns: i128,
    /// For a layer a snapshot wrote: the CRC-64 of its clusters (see
    /// `Layer::crc64`), which a restore asked to verify checks.
    pub crc64: Option<u64>,
}

impl FileStamp {
    fn of(path: &Path, file: &File) -> std::io::Result<Self> {
        let (len, mtime_ns) = len_and_mtime(file)?;
        Ok(FileStamp {
            path: std::fs::canonicalize(path)?,
            len,
            mtime_ns,
            crc64: None,
        })
    }

    /// Opens the file read-only and checks it is the one stamped.
    fn open_unchanged(&self) -> Result<File, DiskError> {
        let open_err = |e| DiskError::Open(self.path.clone(), e);
        let file = File::open(&self.path).map_err(open_err)?;
        let (len, mtime_ns) = len_and_mtime(&file).map_err(open_err)?;
        let what = if len != self.len {
            format!("{len} bytes, {} then", self.len)
        } else if mtime_ns != self.mtime_ns {
            "modified since".to_owned()
        } else {
            return Ok(file);
        };
        Err(DiskError::Changed {
            path: self.path.clone(),
            what,
        })
    }
}

/// What identifies a file's contents: its size and modification time (ns).
fn len_and_mtime(file: &File) -> std::io::Result<(u64, i128)> {
    let meta = file.metadata()?;
    let mtime_ns = i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec());
    Ok((meta.len(), mtime_ns))
}

/// A disk in a snapshot: the files its contents are made of. The clone's
/// overlay is not part of it (each clone brings a new one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskSnapshot {
    pub size: u64,
    pub read_only: bool,
    pub base: FileStamp,
    /// Read-only layers over the base, lowest first.
    pub layers: Vec<FileStamp>,
}

impl DiskSnapshot {
    /// The same snapshot with the files inside `dir` named relative to it,
    /// so that the snapshot directory can be moved (a jailed VMM writes
    /// snapshots where it can, and the host moves them into place).
    pub fn relative_to(mut self, dir: &Path) -> Self {
        let Ok(dir) = std::fs::canonicalize(dir) else {
            return self;
        };
        for stamp in std::iter::once(&mut self.base).chain(&mut self.layers) {
            if let Ok(inside) = stamp.path.strip_prefix(&dir) {
                stamp.path = inside.to_path_buf();
            }
        }
        self
    }

    /// The same snapshot with relative file names resolved against `dir`,
    /// the snapshot directory it was read from.
    pub fn resolved(mut self, dir: &Path) -> Self {
        for stamp in std::iter::once(&mut self.base).chain(&mut self.layers) {
            if stamp.path.is_relative() {
                stamp.path = dir.join(&stamp.path);
            }
        }
        self
    }
}

/// A sparse file holding some clusters of the disk at their own offsets.
struct Layer {
    file: File,
    /// One bit per cluster: the cluster's data is in this file.
    present: Vec<u64>,
}

impl Layer {
    /// Indexes `file`'s clusters from its allocated extents.
    fn index(file: File, size: u64) -> std::io::Result<Layer> {
        let mut layer = Layer::empty(file, size);
        for (start, end) in data_extents(&layer.file, size)? {
            for cluster in start / CLUSTER_SIZE..end.div_ceil(CLUSTER_SIZE) {
                layer.mark(cluster);
            }
        }
        Ok(layer)
    }

    /// A layer that holds nothing yet.
    fn empty(file: File, size: u64) -> Layer {
        let clusters = size.div_ceil(CLUSTER_SIZE);
        Layer {
            present: vec![0; clusters.div_ceil(64) as usize],
            file,
        }
    }

    /// CRC-64 of the layer's clusters, run after run, each run's offset
    /// (8 bytes, little-endian) before its bytes: what it holds and where.
    fn crc64(&self, size: u64) -> std::io::Result<u64> {
        let mut crc = husk_snapshot::Crc64::new();
        let mut buf = Vec::new();
        copy_clusters(
            size,
            |c| self.has(c),
            |at, len| {
                buf.resize(len as usize, 0);
                self.file.read_exact_at(&mut buf, at)?;
                crc.update(&at.to_le_bytes());
                crc.update(&buf);
                Ok(())
            },
        )?;
        Ok(crc.finish())
    }

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
    base_path: PathBuf,
    /// Read-only layers from snapshots, lowest first, with their stamps.
    layers: Vec<(FileStamp, Layer)>,
    overlay: Option<Layer>,
    read_only: bool,
    size: u64,
}

impl std::fmt::Debug for Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disk")
            .field("size", &self.size)
            .field("read_only", &self.read_only)
            .field("layers", &self.layers.len())
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
            base_path: path.to_owned(),
            layers: Vec::new(),
            overlay,
            read_only: *mode == DiskMode::ReadOnly,
            size,
        })
    }

    /// Opens a snapshot's disk: its base and layers, each checked against
    /// its stamp, under a new `overlay` (which must not exist yet) when the
    /// disk is writable. The layers inside `verify_in` (a snapshot's own,
    /// when a restore is asked to verify) are checked against their
    /// checksums too, which reads them.
    pub fn restore(
        snapshot: &DiskSnapshot,
        overlay: Option<&Path>,
        verify_in: Option<&Path>,
    ) -> Result<Self, DiskError> {
        let base = snapshot.base.open_unchanged()?;
        if snapshot.size % super::SECTOR_SIZE != 0 {
            return Err(DiskError::Size(snapshot.base.path.clone(), snapshot.size));
        }
        if snapshot.base.len != snapshot.size {
            return Err(DiskError::SnapshotSize {
                path: snapshot.base.path.clone(),
                found: snapshot.base.len,
                expected: snapshot.size,
            });
        }
        let mut layers = Vec::with_capacity(snapshot.layers.len());
        for stamp in &snapshot.layers {
            let file = stamp.open_unchanged()?;
            if stamp.len != snapshot.size {
                return Err(DiskError::SnapshotSize {
                    path: stamp.path.clone(),
                    found: stamp.len,
                    expected: snapshot.size,
                });
            }
            let layer = Layer::index(file, snapshot.size)
                .map_err(|e| DiskError::Open(stamp.path.clone(), e))?;
            if let (Some(want), Some(dir)) = (stamp.crc64, verify_in) {
                if stamp.path.starts_with(dir) {
                    let found = layer
                        .crc64(snapshot.size)
                        .map_err(|e| DiskError::Open(stamp.path.clone(), e))?;
                    if found != want {
                        return Err(DiskError::Checksum(stamp.path.clone()));
                    }
                }
            }
            layers.push((stamp.clone(), layer));
        }
        let overlay = match (snapshot.read_only, overlay) {
            (true, None) => None,
            (true, Some(_)) => return Err(DiskError::UnwantedOverlay),
            (false, None) => return Err(DiskError::NoOverlay),
            (false, Some(path)) => {
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .open(path)
                    .map_err(|e| match e.kind() {
                        std::io::ErrorKind::AlreadyExists => {
                            DiskError::OverlayExists(path.to_owned())
                        }
                        _ => DiskError::Open(path.to_owned(), e),
                    })?;
                file.set_len(snapshot.size)
                    .map_err(|e| DiskError::Open(path.to_owned(), e))?;
                Some(Layer::empty(file, snapshot.size))
            }
        };
        Ok(Disk {
            base,
            base_path: snapshot.base.path.clone(),
            layers,
            overlay,
            read_only: snapshot.read_only,
            size: snapshot.size,
        })
    }

    /// Makes the disk's current contents part of a snapshot in `dir`: the
    /// overlay's clusters (or, for a raw read-write image, the image) are
    /// copied to `dir/name`, which becomes a read-only layer of the
    /// snapshot. The disk itself goes on as before. The guest must not be
    /// running (its requests are served synchronously, so none is in
    /// flight).
    pub fn save(&self, dir: &Path, name: &str) -> Result<DiskSnapshot, DiskError> {
        let path = dir.join(name);
        let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
        let save_err = |e| DiskError::Save(path.clone(), e);
        let stamps =
            |layers: &[(FileStamp, Layer)]| layers.iter().map(|(s, _)| s.clone()).collect();
        let base_stamp = || FileStamp::of(&self.base_path, &self.base).map_err(save_err);
        let unwritten = self
            .overlay
            .as_ref()
            .is_some_and(|o| o.present.iter().all(|bits| *bits == 0));
        let (base, layers) = if self.read_only || unwritten {
            // Nothing above its layers: they are the snapshot's as they are.
            (base_stamp()?, stamps(&self.layers))
        } else {
            // Read too: its checksum is taken from what it holds.
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&tmp)
                .map_err(save_err)?;
            let result = match &self.overlay {
                Some(overlay) if self.layers.len() < MAX_LAYERS => copy_clusters(
                    self.size,
                    |c| overlay.has(c),
                    |at, len| copy_range(&overlay.file, &file, at, len),
                ),
                // Too deep: one layer with every cluster above the base.
                Some(_) => copy_clusters(
                    self.size,
                    |c| self.above_base(c),
                    |at, len| {
                        let mut buf = vec![0u8; len as usize];
                        self.read_at(&mut buf, at).map_err(std::io::Error::other)?;
                        file.write_all_at(&buf, at)
                    },
                ),
                // A raw image: its allocated extents.
                None => self
                    .base
                    .try_clone()
                    .and_then(|f| Layer::index(f, self.size))
                    .and_then(|image| {
                        copy_clusters(
                            self.size,
                            |c| image.has(c),
                            |at, len| copy_range(&self.base, &file, at, len),
                        )
                    }),
            }
            .and_then(|()| file.set_len(self.size))
            .and_then(|()| file.sync_all())
            .and_then(|()| std::fs::rename(&tmp, &path));
            if let Err(e) = result {
                let _ = std::fs::remove_file(&tmp);
                return Err(save_err(e));
            }
            let mut stamp = FileStamp::of(&path, &file).map_err(save_err)?;
            let written = file
                .try_clone()
                .and_then(|f| Layer::index(f, self.size))
                .and_then(|layer| layer.crc64(self.size))
                .map_err(save_err)?;
            stamp.crc64 = Some(written);
            match &self.overlay {
                Some(_) if self.layers.len() < MAX_LAYERS => {
                    let mut layers: Vec<_> = stamps(&self.layers);
                    layers.push(stamp);
                    (base_stamp()?, layers)
                }
                Some(_) => (base_stamp()?, vec![stamp]),
                // The copy of the image is the clones' base.
                None => (stamp, Vec::new()),
            }
        };
        Ok(DiskSnapshot {
            size: self.size,
            read_only: self.read_only,
            base,
            layers,
        })
    }

    /// Whether `cluster` is held above the base (in a layer or the overlay).
    fn above_base(&self, cluster: u64) -> bool {
        self.overlay.as_ref().is_some_and(|o| o.has(cluster))
            || self.layers.iter().any(|(_, l)| l.has(cluster))
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

    /// The file that holds `cluster`, ignoring the overlay.
    fn below_overlay(&self, cluster: u64) -> &File {
        self.layers
            .iter()
            .rev()
            .find(|(_, l)| l.has(cluster))
            .map_or(&self.base, |(_, l)| &l.file)
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DiskError> {
        self.check_range(offset, buf.len() as u64)?;
        if self.overlay.is_none() && self.layers.is_empty() {
            return Ok(self.base.read_exact_at(buf, offset)?);
        }
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let cluster = pos / CLUSTER_SIZE;
            let in_cluster = ((cluster + 1) * CLUSTER_SIZE - pos).min((buf.len() - done) as u64);
            let chunk = &mut buf[done..done + in_cluster as usize];
            match &self.overlay {
                Some(overlay) if overlay.has(cluster) => overlay.file.read_exact_at(chunk, pos)?,
                _ => self.below_overlay(cluster).read_exact_at(chunk, pos)?,
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
        if self.overlay.is_none() {
            return Ok(self.base.write_all_at(buf, offset)?);
        }
        let mut done = 0usize;
        let mut cluster_buf = vec![0u8; CLUSTER_SIZE as usize];
        while done < buf.len() {
            let pos = offset + done as u64;
            let cluster = pos / CLUSTER_SIZE;
            let cluster_start = cluster * CLUSTER_SIZE;
            let in_cluster = (cluster_start + CLUSTER_SIZE - pos).min((buf.len() - done) as u64);
            let chunk = &buf[done..done + in_cluster as usize];
            let present = self.overlay.as_ref().is_some_and(|o| o.has(cluster));
            if !present && in_cluster < CLUSTER_SIZE {
                // Complete the cluster from below before the partial write.
                let len = CLUSTER_SIZE.min(self.size - cluster_start) as usize;
                self.below_overlay(cluster)
                    .read_exact_at(&mut cluster_buf[..len], cluster_start)?;
                let at = (pos - cluster_start) as usize;
                cluster_buf[at..at + chunk.len()].copy_from_slice(chunk);
                self.overlay_mut()
                    .file
                    .write_all_at(&cluster_buf[..len], cluster_start)?;
            } else {
                self.overlay_mut().file.write_all_at(chunk, pos)?;
            }
            self.overlay_mut().mark(cluster);
            done += in_cluster as usize;
        }
        Ok(())
    }

    fn overlay_mut(&mut self) -> &mut Layer {
        self.overlay
            .as_mut()
            .expect("write_at checked the overlay exists")
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

fn open_overlay(path: &Path, size: u64) -> Result<Layer, DiskError> {
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
    Ok(Layer::index(file, size)?)
}

/// Calls `copy(offset, len)` for each run of clusters for which `wanted`
/// holds (at most 1 MiB at a time); what is not copied stays a hole.
fn copy_clusters(
    size: u64,
    wanted: impl Fn(u64) -> bool,
    mut copy: impl FnMut(u64, u64) -> std::io::Result<()>,
) -> std::io::Result<()> {
    const RUN: u64 = 256; // clusters per copy (1 MiB)
    let clusters = size.div_ceil(CLUSTER_SIZE);
    let mut cluster = 0;
    while cluster < clusters {
        if !wanted(cluster) {
            cluster += 1;
            continue;
        }
        let mut end = cluster + 1;
        while end < clusters && end - cluster < RUN && wanted(end) {
            end += 1;
        }
        let start = cluster * CLUSTER_SIZE;
        copy(start, (end * CLUSTER_SIZE).min(size) - start)?;
        cluster = end;
    }
    Ok(())
}

/// Copies `len` bytes at `offset` from `src` to the same offset in `dst`
/// inside the kernel (copy_file_range: a reflink where the file system
/// shares extents), through a buffer where the kernel cannot.
fn copy_range(src: &File, dst: &File, offset: u64, len: u64) -> std::io::Result<()> {
    let (mut off_in, mut off_out) = (offset as libc::loff_t, offset as libc::loff_t);
    let mut left = len as usize;
    while left > 0 {
        // SAFETY: both descriptors are open; the offsets are ours and the
        // kernel only updates them.
        let n = unsafe {
            libc::copy_file_range(
                src.as_raw_fd(),
                &mut off_in,
                dst.as_raw_fd(),
                &mut off_out,
                left,
                0,
            )
        };
        match n {
            n if n > 0 => left -= n as usize,
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            _ => {
                let err = std::io::Error::last_os_error();
                match err.raw_os_error() {
                    Some(libc::EXDEV | libc::ENOSYS | libc::EINVAL | libc::EOPNOTSUPP) => break,
                    _ => return Err(err),
                }
            }
        }
    }
    if left > 0 {
        let at = offset + (len - left as u64);
        let mut buf = vec![0u8; left];
        src.read_exact_at(&mut buf, at)?;
        dst.write_all_at(&buf, at)?;
    }
    Ok(())
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

    fn read_all(disk: &Disk) -> Vec<u8> {
        let mut all = vec![0u8; disk.size() as usize];
        disk.read_at(&mut all, 0).expect("read");
        all
    }

    /// A copy-on-write disk over a patterned 16-cluster base with `written`
    /// at cluster 3 (and half of cluster 5), saved into `dir/snap`.
    fn saved_cow_disk(dir: &TempDir) -> (Disk, DiskSnapshot, Vec<u8>) {
        let base = image(dir, "base", &pattern(16 * 4096));
        let mode = DiskMode::CopyOnWrite {
            overlay: dir.as_path().join("overlay"),
        };
        let mut disk = Disk::open(&base, &mode).expect("open");
        disk.write_at(&[7; 4096], 3 * 4096).expect("write");
        disk.write_at(&[8; 2048], 5 * 4096).expect("write");
        let snap_dir = dir.as_path().join("snap");
        std::fs::create_dir(&snap_dir).expect("snapshot dir");
        let snapshot = disk.save(&snap_dir, "drive-0").expect("save");
        let contents = read_all(&disk);
        (disk, snapshot, contents)
    }

    #[test]
    fn clones_of_a_saved_disk_see_its_contents_and_only_their_own_writes() {
        let dir = TempDir::new().expect("tempdir");
        let (mut original, snapshot, at_snapshot) = saved_cow_disk(&dir);
        let layer_bytes = std::fs::read(&snapshot.layers[0].path).expect("layer");
        let mut a =
            Disk::restore(&snapshot, Some(&dir.as_path().join("a")), None).expect("clone a");
        let mut b =
            Disk::restore(&snapshot, Some(&dir.as_path().join("b")), None).expect("clone b");

        original.write_at(&[1; 512], 0).expect("write original");
        a.write_at(&[0xaa; 100], 5 * 4096 + 4000).expect("write a");
        b.write_at(&[0xbb; 4096], 9 * 4096).expect("write b");

        let mut expect_a = at_snapshot.clone();
        expect_a[5 * 4096 + 4000..5 * 4096 + 4100].fill(0xaa);
        let mut expect_b = at_snapshot.clone();
        expect_b[9 * 4096..10 * 4096].fill(0xbb);
        assert_eq!(read_all(&a), expect_a);
        assert_eq!(read_all(&b), expect_b);
        assert_eq!(
            std::fs::read(&snapshot.layers[0].path).expect("layer"),
            layer_bytes
        );
        assert_eq!(snapshot.layers.len(), 1);
        assert!(!a.is_read_only());
    }

    #[test]
    fn a_clone_that_wrote_nothing_is_saved_with_its_layers_alone() {
        let dir = TempDir::new().expect("tempdir");
        let (_, snapshot, at_snapshot) = saved_cow_disk(&dir);
        let clone = Disk::restore(&snapshot, Some(&dir.as_path().join("a")), None).expect("clone");
        let again = dir.as_path().join("again");
        std::fs::create_dir(&again).expect("snapshot dir");

        let resaved = clone.save(&again, "drive-0").expect("save");
        let restored =
            Disk::restore(&resaved, Some(&dir.as_path().join("b")), None).expect("restore");

        assert_eq!(resaved, snapshot);
        assert!(!again.join("drive-0").exists());
        assert_eq!(read_all(&restored), at_snapshot);
    }

    #[test]
    fn a_saved_raw_image_becomes_the_clones_sparse_base() {
        let dir = TempDir::new().expect("tempdir");
        let path = dir.as_path().join("raw");
        let file = File::create(&path).expect("create");
        file.set_len(64 << 20).expect("size");
        file.write_all_at(b"raw-image-data", 40 << 20)
            .expect("write");
        let disk = Disk::open(&path, &DiskMode::ReadWrite).expect("open");
        let snap_dir = dir.as_path().join("snap");
        std::fs::create_dir(&snap_dir).expect("snapshot dir");

        let snapshot = disk.save(&snap_dir, "drive-0").expect("save");
        let clone = Disk::restore(&snapshot, Some(&dir.as_path().join("o")), None).expect("clone");

        let mut back = [0u8; 14];
        clone.read_at(&mut back, 40 << 20).expect("read");
        assert_eq!(&back, b"raw-image-data");
        assert_eq!(
            snapshot.base.path,
            snap_dir.join("drive-0").canonicalize().expect("path")
        );
        let used = std::fs::metadata(&snapshot.base.path)
            .expect("meta")
            .blocks()
            * 512;
        assert!(used < 1 << 20, "the copy is not sparse: {used} bytes");
    }

    #[test]
    fn a_read_only_disk_is_saved_by_reference_and_restores_without_an_overlay() {
        let dir = TempDir::new().expect("tempdir");
        let path = image(&dir, "ro", &pattern(4096));
        let disk = Disk::open(&path, &DiskMode::ReadOnly).expect("open");

        let snapshot = disk.save(dir.as_path(), "unused").expect("save");
        let clone = Disk::restore(&snapshot, None, None).expect("clone");

        assert!(clone.is_read_only());
        assert_eq!(read_all(&clone), pattern(4096));
        assert!(!dir.as_path().join("unused").exists());
        assert!(matches!(
            Disk::restore(&snapshot, Some(&dir.as_path().join("o")), None),
            Err(DiskError::UnwantedOverlay)
        ));
    }

    #[test]
    fn a_saved_disk_names_its_own_files_relative_to_its_directory_and_moves_with_it() {
        let dir = TempDir::new().expect("tempdir");
        let (_original, snapshot, contents) = saved_cow_disk(&dir);
        let base = snapshot.base.path.clone();

        let portable = snapshot.relative_to(&dir.as_path().join("snap"));
        std::fs::rename(dir.as_path().join("snap"), dir.as_path().join("moved")).expect("move");
        let resolved = portable.clone().resolved(&dir.as_path().join("moved"));
        let clone = Disk::restore(&resolved, Some(&dir.as_path().join("o")), None).expect("clone");

        assert_eq!(portable.layers[0].path, Path::new("drive-0"));
        assert_eq!(portable.base.path, base, "files outside stay absolute");
        assert_eq!(read_all(&clone), contents);
    }

    #[test]
    fn restore_refuses_changed_files_and_shared_or_missing_overlays() {
        let dir = TempDir::new().expect("tempdir");
        let (_original, snapshot, _) = saved_cow_disk(&dir);
        let taken = dir.as_path().join("taken");
        std::fs::write(&taken, b"").expect("existing overlay");

        let existing = Disk::restore(&snapshot, Some(&taken), None);
        let missing = Disk::restore(&snapshot, None, None);
        let layer = OpenOptions::new()
            .write(true)
            .open(&snapshot.layers[0].path)
            .expect("open layer");
        layer.write_all_at(b"x", 0).expect("tamper");
        // mtime ticks coarsely: make the change visible whatever the clock.
        let past = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000);
        layer.set_modified(past).expect("set mtime");
        let tampered = Disk::restore(&snapshot, Some(&dir.as_path().join("c")), None);

        assert!(matches!(existing, Err(DiskError::OverlayExists(_))));
        assert!(matches!(missing, Err(DiskError::NoOverlay)));
        assert!(
            matches!(tampered, Err(DiskError::Changed { .. })),
            "{tampered:?}"
        );
        assert!(!dir.as_path().join("c").exists());
    }

    #[test]
    fn a_verified_restore_refuses_a_layer_whose_bytes_changed_under_its_stamp() {
        let dir = TempDir::new().expect("tempdir");
        let (_original, snapshot, _) = saved_cow_disk(&dir);
        let path = snapshot.layers[0].path.clone();
        let snapshot_dir = path.parent().expect("the snapshot's directory").to_owned();
        let intact = Disk::restore(
            &snapshot,
            Some(&dir.as_path().join("a")),
            Some(&snapshot_dir),
        );
        // A byte flipped inside a cluster the layer holds, its length and
        // modification time as they were (what a stamp cannot see).
        let layer = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .expect("open layer");
        let mut byte = [0u8];
        layer.read_exact_at(&mut byte, 3 * 4096 + 10).expect("read");
        layer
            .write_all_at(&[byte[0] ^ 0x20], 3 * 4096 + 10)
            .expect("flip");
        let stamped = std::time::UNIX_EPOCH + std::time::Duration::new(0, 0);
        let mtime = snapshot.layers[0].mtime_ns;
        layer
            .set_modified(stamped + std::time::Duration::from_nanos(mtime as u64))
            .expect("mtime back");
        let unverified = Disk::restore(&snapshot, Some(&dir.as_path().join("b")), None);
        let verified = Disk::restore(
            &snapshot,
            Some(&dir.as_path().join("c")),
            Some(&snapshot_dir),
        );

        assert!(snapshot.layers[0].crc64.is_some());
        assert!(intact.is_ok(), "{intact:?}");
        assert!(unverified.is_ok(), "{unverified:?}");
        assert!(
            matches!(&verified, Err(DiskError::Checksum(p)) if *p == path),
            "{verified:?}"
        );
    }

    #[test]
    fn generations_of_snapshots_merge_layers_beyond_the_limit() {
        let dir = TempDir::new().expect("tempdir");
        let (_original, mut snapshot, mut expected) = saved_cow_disk(&dir);

        for generation in 0..(MAX_LAYERS as u64 + 3) {
            let overlay = dir.as_path().join(format!("overlay-{generation}"));
            let mut disk = Disk::restore(&snapshot, Some(&overlay), None).expect("restore");
            let at = (generation % 16) * 4096 + generation;
            disk.write_at(&[generation as u8 + 100; 10], at)
                .expect("write");
            expected[at as usize..at as usize + 10].fill(generation as u8 + 100);
            assert_eq!(read_all(&disk), expected, "generation {generation}");
            let snap_dir = dir.as_path().join(format!("gen-{generation}"));
            std::fs::create_dir(&snap_dir).expect("dir");
            snapshot = disk.save(&snap_dir, "drive-0").expect("save");
            assert!(snapshot.layers.len() <= MAX_LAYERS);
        }

        let last =
            Disk::restore(&snapshot, Some(&dir.as_path().join("last")), None).expect("restore");
        assert_eq!(read_all(&last), expected);
    }
}
