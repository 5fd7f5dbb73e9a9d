//! Emulated devices and the buses vCPU exits are dispatched on.

pub mod bus;
pub mod i8042;
pub mod serial;
pub mod virtio;
