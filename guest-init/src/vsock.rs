//! AF_VSOCK stream sockets (the libc crate has the types, std has no API).

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// The host's CID.
pub const HOST_CID: u32 = 2;
/// Any local CID, for listening.
const CID_ANY: u32 = u32::MAX;

fn addr(cid: u32, port: u32) -> libc::sockaddr_vm {
    // SAFETY: sockaddr_vm is plain data; all-zero is a valid value.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = cid;
    addr.svm_port = port;
    addr
}

const ADDR_LEN: libc::socklen_t = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call.
    let fd =
        check(unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A listening vsock socket.
#[derive(Debug)]
pub struct Listener(OwnedFd);

impl Listener {
    pub fn bind(port: u32) -> io::Result<Self> {
        let sock = socket()?;
        let a = addr(CID_ANY, port);
        // SAFETY: `a` is a valid sockaddr_vm of ADDR_LEN bytes.
        check(unsafe {
            libc::bind(
                sock.as_raw_fd(),
                (&a as *const libc::sockaddr_vm).cast(),
                ADDR_LEN,
            )
        })?;
        // SAFETY: listen on a bound socket.
        check(unsafe { libc::listen(sock.as_raw_fd(), 16) })?;
        Ok(Listener(sock))
    }

    /// Waits for a connection; the stream is a File (read/write).
    pub fn accept(&self) -> io::Result<File> {
        // SAFETY: accept without the peer address.
        let fd = check(unsafe {
            libc::accept4(
                self.0.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        })?;
        // SAFETY: a new descriptor nothing else owns.
        Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
    }
}

/// Connects to `port` on the host.
pub fn connect_host(port: u32) -> io::Result<File> {
    let sock = socket()?;
    let a = addr(HOST_CID, port);
    // SAFETY: `a` is a valid sockaddr_vm of ADDR_LEN bytes.
    check(unsafe {
        libc::connect(
            sock.as_raw_fd(),
            (&a as *const libc::sockaddr_vm).cast(),
            ADDR_LEN,
        )
    })?;
    Ok(File::from(sock))
}

/// Half-closes the write side.
pub fn shutdown_write(stream: &File) -> io::Result<()> {
    // SAFETY: shutdown on a socket we own.
    check(unsafe { libc::shutdown(stream.as_raw_fd(), libc::SHUT_WR) }).map(|_| ())
}

/// Half-closes the read side.
pub fn shutdown_read(stream: &File) -> io::Result<()> {
    // SAFETY: shutdown on a socket we own.
    check(unsafe { libc::shutdown(stream.as_raw_fd(), libc::SHUT_RD) }).map(|_| ())
}

/// Bounds each read (`None`: no bound).
pub fn set_read_timeout(stream: &File, timeout: Option<std::time::Duration>) -> io::Result<()> {
    let tv = timeout.map_or(
        libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        },
        |t| libc::timeval {
            tv_sec: t.as_secs() as _,
            tv_usec: t.subsec_micros() as _,
        },
    );
    // SAFETY: setsockopt with a valid timeval of the right size.
    check(unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}
