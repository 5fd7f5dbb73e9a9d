//! virtio-block (virtio 1.2, section 5.2) backed by a raw image file, read
//! only, or copy-on-write over a shared read-only base.

pub mod device;
pub mod disk;
pub mod request;

pub use device::BlockDevice;
pub use disk::{Disk, DiskError, DiskMode, DiskSnapshot};

/// Bytes per sector, as the virtio-block protocol counts.
pub const SECTOR_SIZE: u64 = 512;
