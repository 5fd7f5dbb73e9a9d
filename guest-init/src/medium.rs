//! `MountShare`: a host directory a virtio-fs device serves.
//!
//! `MountMedium`: a container's root file system on a drive the host has
//! just given a new medium (an ext4 image under a copy-on-write overlay
//! of the host's). The guest learns of the medium from virtio-block's
//! configuration change interrupt, which a kernel worker handles: the
//! drive's size in sysfs turning to the new medium's is the sign that it
//! has been read.

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

/// How long the kernel may take to read the new capacity (a worker on a
/// busy, emulated guest).
const WAIT: Duration = Duration::from_secs(60);
/// Between looks at the drive's size.
const POLL: Duration = Duration::from_millis(20);
/// At most this many bytes of a serial reach the guest (virtio-block's
/// `VIRTIO_BLK_ID_BYTES`).
const SERIAL_MAX: usize = 20;
/// `BLKFLSBUF` (<linux/fs.h>: `_IO(0x12, 97)`): write back and drop a
/// block device's cached blocks.
const BLKFLSBUF: u32 = 0x1261;

/// Mounts the ext4 file system on the drive with serial `serial` at the
/// new directory `root`, once the drive has `size` bytes.
pub fn mount(serial: &str, size: u64, root: &str) -> io::Result<()> {
    let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidInput, what);
    if size == 0 || size % 512 != 0 {
        return Err(invalid(format!("a medium of {size} bytes")));
    }
    let name = drive_named(serial)?;
    let dev = format!("/dev/{name}");
    if let Some(at) = mounted_at(&dev) {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{dev} is still mounted at {at}: remove what used its last medium first"),
        ));
    }
    wait_for_sectors(&name, size / 512)?;
    // The last medium's blocks may be cached: they are not this one's.
    let device = std::fs::File::open(&dev)?;
    // SAFETY: an ioctl without an argument on a descriptor we own.
    if unsafe { libc::ioctl(device.as_raw_fd(), BLKFLSBUF as _, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    drop(device);
    if let Some(parent) = Path::new(root).parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::create_dir(root)?;
    let c = |s: &str| std::ffi::CString::new(s).map_err(|_| invalid(format!("{s:?}")));
    let (dev_c, root_c) = (c(&dev)?, c(root)?);
    // noinit_itable: no kernel thread zeroing inode tables behind the
    // container's back (the host's image has them as mkfs left them).
    // SAFETY: NUL-terminated strings.
    let rc = unsafe {
        libc::mount(
            dev_c.as_ptr(),
            root_c.as_ptr(),
            c"ext4".as_ptr(),
            libc::MS_NOATIME,
            c"noinit_itable".as_ptr().cast(),
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        let _ = std::fs::remove_dir(root);
        return Err(io::Error::new(e.kind(), format!("mounting {dev}: {e}")));
    }
    crate::container::track_mount(root);
    Ok(())
}

/// Mounts the directory virtio-fs device `tag` serves at `target` (made
/// if missing), nosuid and nodev, read-only if `readonly`. A share mounted
/// at `target` already is left as it is: the host sends a create's shares
/// ahead of the first request on every connection that may be first, and
/// again after its daemon restarted; one mounted elsewhere is refused.
pub fn mount_share(tag: &str, target: &str, readonly: bool) -> io::Result<()> {
    static MOUNTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidInput, what);
    if !target.starts_with('/') {
        return Err(invalid(format!("{target:?} is not an absolute path")));
    }
    // One at a time: two connections carrying the same share must not
    // both find it unmounted.
    let _one = MOUNTING.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(at) = mounted_at(tag) {
        let here = std::fs::canonicalize(target).is_ok_and(|t| t == Path::new(&unescape(&at)));
        if here {
            return Ok(());
        }
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("it is mounted at {at} already"),
        ));
    }
    std::fs::create_dir_all(target)?;
    let c = |s: &str| std::ffi::CString::new(s).map_err(|_| invalid(format!("{s:?}")));
    let (tag_c, target_c) = (c(tag)?, c(target)?);
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
    if readonly {
        flags |= libc::MS_RDONLY;
    }
    // SAFETY: NUL-terminated strings; no data.
    let rc = unsafe {
        libc::mount(
            tag_c.as_ptr(),
            target_c.as_ptr(),
            c"virtiofs".as_ptr(),
            flags,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The block device (`vdb`) whose serial is `serial`.
fn drive_named(serial: &str) -> io::Result<String> {
    let wanted = &serial.as_bytes()[..serial.len().min(SERIAL_MAX)];
    for entry in std::fs::read_dir("/sys/block")?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("vd") {
            continue;
        }
        let found = std::fs::read(entry.path().join("serial")).unwrap_or_default();
        if found.trim_ascii_end() == wanted {
            return Ok(name);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("no drive has serial {serial:?} (the sandbox's template has no such slot)"),
    ))
}

/// Where `dev` is mounted, if it is.
fn mounted_at(dev: &str) -> Option<String> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    mounts.lines().find_map(|line| {
        let mut fields = line.split(' ');
        (fields.next() == Some(dev)).then(|| fields.next().unwrap_or("?").to_owned())
    })
}

/// A path as /proc/self/mounts writes it (space, tab, newline and
/// backslash as three octal digits after a backslash), as it is.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push(d.iter().fold(0u8, |n, c| n.wrapping_mul(8) + (c - b'0')));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Waits until drive `name` has `sectors` (the kernel has read the new
/// medium's capacity).
fn wait_for_sectors(name: &str, sectors: u64) -> io::Result<()> {
    let path = format!("/sys/block/{name}/size");
    let started = Instant::now();
    loop {
        let now: Option<u64> = std::fs::read_to_string(&path)?.trim().parse().ok();
        if now == Some(sectors) {
            return Ok(());
        }
        if started.elapsed() > WAIT {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "/dev/{name} still has {} sectors after {}s, not the new medium's {sectors}",
                    now.unwrap_or(0),
                    WAIT.as_secs()
                ),
            ));
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_are_read_back_as_they_are() {
        assert_eq!(unescape("/mnt/my\\040work"), "/mnt/my work");
        assert_eq!(unescape("/a\\134b\\011c"), "/a\\b\tc");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape("/short\\04"), "/short\\04");
    }
}
