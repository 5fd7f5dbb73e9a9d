//! virtio-vsock (virtio 1.2, section 5.10): stream sockets between the guest
//! and host programs, bridged to Unix sockets by [`muxer::Muxer`].

pub mod device;
pub mod muxer;
pub mod packet;

pub use device::VsockDevice;
