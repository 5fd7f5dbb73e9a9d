//! A TAP interface carrying whole Ethernet frames, each prefixed with the
//! 12-byte virtio-net header, which the device passes through unchanged.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

/// Size of `struct virtio_net_hdr_v1` (with num_buffers), the header of
/// every frame in both directions.
pub const VNET_HDR_LEN: usize = 12;

const IFNAMSIZ: usize = 16;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
// _IOW('T', 202, int), _IOW('T', 208, unsigned int), _IOW('T', 216, int)
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;

/// Errors opening a TAP device.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("TAP name `{0}` is empty or longer than 15 bytes")]
    Name(String),
    #[error("cannot open /dev/net/tun: {0} (is the tun module loaded? does the user have CAP_NET_ADMIN or own the TAP?)")]
    OpenTun(#[source] std::io::Error),
    #[error("cannot attach to TAP `{0}`: {1}")]
    Attach(String, #[source] std::io::Error),
}

#[repr(C)]
struct IfReq {
    name: [u8; IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// An open TAP device.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

impl Tap {
    /// Attaches to the TAP called `name`, creating it if it does not exist
    /// (a TAP created here disappears when the VMM exits).
    pub fn open(name: &str) -> Result<Self, TapError> {
        if name.is_empty() || name.len() >= IFNAMSIZ || name.contains('\0') {
            return Err(TapError::Name(name.to_owned()));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(TapError::OpenTun)?;
        let mut req = IfReq {
            name: [0; IFNAMSIZ],
            flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        let attach = |e| TapError::Attach(name.to_owned(), e);
        let fd = file.as_raw_fd();
        // SAFETY: TUNSETIFF reads and writes an ifreq we own.
        check(unsafe { libc::ioctl(fd, TUNSETIFF, &mut req) }).map_err(attach)?;
        let hdr_len = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads an int we own.
        check(unsafe { libc::ioctl(fd, TUNSETVNETHDRSZ, &hdr_len) }).map_err(attach)?;
        // No offloads: the guest is offered none, so frames stay whole.
        // SAFETY: TUNSETOFFLOAD takes its argument by value.
        check(unsafe { libc::ioctl(fd, TUNSETOFFLOAD, 0 as libc::c_ulong) }).map_err(attach)?;
        Ok(Tap {
            file,
            name: name.to_owned(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Reads one frame (with its header); `WouldBlock` when none is waiting.
    pub fn read_frame(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.file.read(buf)
    }

    /// Writes one frame (with its header).
    pub fn write_frame(&mut self, frame: &[u8]) -> std::io::Result<usize> {
        self.file.write(frame)
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

fn check(rc: libc::c_int) -> std::io::Result<()> {
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_names_are_refused() {
        assert!(matches!(Tap::open(""), Err(TapError::Name(_))));
        assert!(matches!(
            Tap::open("a-name-far-too-long"),
            Err(TapError::Name(_))
        ));
    }
}
