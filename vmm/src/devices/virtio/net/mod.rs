//! virtio-net (virtio 1.2, section 5.1) backed by a Linux TAP device.

pub mod device;
pub mod tap;

pub use device::NetDevice;
pub use tap::{Tap, TapError};
