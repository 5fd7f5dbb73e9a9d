//! The virtio-fs device (virtio 1.2, section 5.11): a host directory the
//! guest mounts with `mount -t virtiofs TAG DIR`, served in the VMM process
//! (a clone's memory is a private copy-on-write mapping no separate
//! virtiofsd could see) by the FUSE server in [`server`]. Two queues: the
//! high-priority one (FORGET, INTERRUPT) and one request queue. No DAX.
//!
//! A device without a directory is an empty slot: a template boots with
//! slots, its clones are given directories when they are restored or,
//! running, by the control socket's `share` request. The
//! guest's FUSE session (its mount) is not saved, so a VM with a mounted
//! share does not snapshot ([`FsDevice::session_blocks_snapshot`]).

pub mod abi;
pub mod server;

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;

use event_manager::{EventOps, Events, MutEventSubscriber};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::virtio::queue::{serve_queue, Served};
use crate::devices::virtio::{
    read_config_bytes, watch_queues, ActivateError, ActiveQueues, VirtioDevice, INT_VRING, TYPE_FS,
    VIRTIO_F_VERSION_1,
};
use crate::vstate::memory::GuestMemoryMmap;
pub use server::ShareOptions;
use server::{Server, MAX_IO};

/// Queue sizes: high priority, then requests.
const QUEUE_SIZES: [u16; 2] = [128, 256];
/// The longest tag the guest reads (`virtio_fs_config.tag`).
pub const TAG_MAX: usize = 36;
/// The largest request taken from the guest: a WRITE of [`MAX_IO`] bytes
/// and its headers.
const MAX_REQUEST: usize = MAX_IO as usize + 4096;

/// A share as configured: its tag and, unless an empty slot, its directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    pub tag: String,
    pub path: Option<PathBuf>,
    pub options: ShareOptions,
}

/// Why a tag is refused (the guest's driver refuses the same).
pub fn check_tag(tag: &str) -> Result<(), String> {
    if tag.is_empty() || tag.len() > TAG_MAX {
        return Err(format!("a tag is 1 to {TAG_MAX} bytes"));
    }
    if tag.bytes().any(|b| b == b'\n' || b == 0 || b == b',') {
        return Err("a tag has no newline, NUL or comma".into());
    }
    Ok(())
}

/// A virtio-fs device.
#[derive(Debug)]
pub struct FsDevice {
    tag: String,
    /// `virtio_fs_config`: the tag (NUL-padded) and one request queue.
    config: [u8; TAG_MAX + 4],
    server: Server,
    queue_evts: [EventFd; 2],
    active: Option<ActiveQueues>,
}

impl FsDevice {
    /// A device for `share` (its directory opened now: a missing one fails
    /// here, before any guest runs).
    pub fn new(share: &Share) -> std::io::Result<Self> {
        check_tag(&share.tag)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let mut config = [0u8; TAG_MAX + 4];
        config[..share.tag.len()].copy_from_slice(share.tag.as_bytes());
        config[TAG_MAX..].copy_from_slice(&1u32.to_le_bytes());
        let evt = || EventFd::new(libc::EFD_NONBLOCK);
        Ok(FsDevice {
            tag: share.tag.clone(),
            config,
            server: Server::new(share.path.as_deref(), share.options.clone())?,
            queue_evts: [evt()?, evt()?],
            active: None,
        })
    }

    /// The tag the guest mounts by.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// Serves `share`'s directory from now on (a clone's empty slot
    /// taking its share after the restore): `share.path`, or `dir` (a
    /// descriptor of it) with no path. Refused while the guest has
    /// this device mounted: its session's inodes are the old directory's.
    pub fn serve_dir(&mut self, share: &Share, dir: Option<OwnedFd>) -> Result<(), String> {
        if share.tag != self.tag {
            return Err(format!(
                "this is device `{}`, not `{}`",
                self.tag, share.tag
            ));
        }
        if self.server.has_session() {
            return Err(format!(
                "the guest has `{}` mounted: unmount it before it serves another directory",
                self.tag
            ));
        }
        let server = match (dir, share.path.as_deref()) {
            (Some(_), Some(_)) => {
                return Err(format!(
                    "share `{}`: a directory is passed, and path= names another",
                    share.tag
                ))
            }
            (Some(fd), None) => Server::with_root(fd, share.options.clone())
                .map_err(|e| format!("share `{}`: the directory passed: {e}", share.tag))?,
            (None, Some(path)) => Server::new(Some(path), share.options.clone())
                .map_err(|e| format!("share `{}`: {}: {e}", share.tag, path.display()))?,
            (None, None) => {
                return Err(format!(
                    "share `{}`: no directory given (path=DIR)",
                    share.tag
                ))
            }
        };
        self.server = server;
        Ok(())
    }

    /// Why this device cannot be in a snapshot now, if it cannot: the
    /// guest has it mounted, and its FUSE session (inodes, open files)
    /// would not exist in a clone.
    pub fn session_blocks_snapshot(&self) -> Option<String> {
        self.server.has_session().then(|| {
            format!(
                "the guest has the shared directory `{}` mounted (a virtio-fs session is not saved): unmount it first",
                self.tag
            )
        })
    }

    /// Has the fs thread look at every queue.
    fn kick(&self) {
        for evt in &self.queue_evts {
            if let Err(e) = evt.write(1) {
                tracing::error!("virtio-fs {}: cannot wake its thread: {e}", self.tag);
            }
        }
    }

    /// Serves what the driver made available on queue `index`. A chain the
    /// driver garbled gets an error reply or none; a queue it broke fails
    /// the device.
    fn process_queue(&mut self, index: usize) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let mem = active.mem.clone();
        let Some(queue) = active.queues.get_mut(index) else {
            return;
        };
        let server = &mut self.server;
        let Served { used_any, broken } = serve_queue(queue, &mem, "virtio-fs", |descriptors| {
            Some(serve(&mem, descriptors, server))
        });
        if used_any && queue.needs_notification(&mem).unwrap_or(true) {
            active.interrupt.trigger(INT_VRING);
        }
        if broken {
            tracing::warn!(
                "virtio-fs {}: the driver broke a queue; the device needs a reset",
                self.tag
            );
            active.interrupt.fail_device();
            self.active = None;
            self.server.reset();
        }
    }
}

/// Serves one chain: the request from its device-readable descriptors, the
/// reply into its device-writable ones (which follow them). Returns the
/// bytes written.
pub fn serve(mem: &GuestMemoryMmap, descriptors: &[Descriptor], server: &mut Server) -> u32 {
    let split = descriptors
        .iter()
        .position(Descriptor::is_write_only)
        .unwrap_or(descriptors.len());
    let (readable, writable) = descriptors.split_at(split);
    if writable.iter().any(|d| !d.is_write_only()) {
        tracing::warn!("virtio-fs: a request's readable buffers follow its writable ones");
        return 0;
    }
    let length: usize = readable.iter().map(|d| d.len() as usize).sum();
    if length > MAX_REQUEST {
        tracing::warn!("virtio-fs: a request of {length} bytes (at most {MAX_REQUEST})");
        return 0;
    }
    let mut request = vec![0u8; length];
    let mut at = 0;
    for d in readable {
        let len = d.len() as usize;
        if mem
            .read_slice(&mut request[at..at + len], d.addr())
            .is_err()
        {
            tracing::warn!("virtio-fs: a request buffer outside guest memory");
            return 0;
        }
        at += len;
    }
    let Some(reply) = server.handle(&request) else {
        return 0;
    };
    write_reply(mem, writable, &reply)
}

/// Writes `reply` across the writable descriptors. A reply that does not
/// fit becomes an EIO header alone (nothing if even that does not fit).
fn write_reply(mem: &GuestMemoryMmap, writable: &[Descriptor], reply: &[u8]) -> u32 {
    let room: usize = writable.iter().map(|d| d.len() as usize).sum();
    let header = std::mem::size_of::<abi::OutHeader>();
    let eio;
    let reply = if reply.len() <= room {
        reply
    } else if header <= room {
        tracing::warn!(
            "virtio-fs: a reply of {} bytes for {room} bytes of buffers",
            reply.len()
        );
        let mut out = [0u8; 16];
        out[..4].copy_from_slice(&(header as u32).to_le_bytes());
        out[4..8].copy_from_slice(&(-libc::EIO).to_le_bytes());
        out[8..].copy_from_slice(&reply[8..16]);
        eio = out;
        &eio[..]
    } else {
        return 0;
    };
    let mut at = 0;
    for d in writable {
        if at == reply.len() {
            break;
        }
        let n = (d.len() as usize).min(reply.len() - at);
        if mem
            .write_slice(&reply[at..at + n], GuestAddress(d.addr().0))
            .is_err()
        {
            tracing::warn!("virtio-fs: a reply buffer outside guest memory");
            return 0;
        }
        at += n;
    }
    at as u32
}

impl VirtioDevice for FsDevice {
    fn device_type(&self) -> u32 {
        TYPE_FS
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::warn!("virtio-fs: the driver wrote read-only config at {offset:#x}");
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evts
    }

    fn activate(&mut self, active: ActiveQueues) -> Result<(), ActivateError> {
        active.expect_queues(QUEUE_SIZES.len())?;
        self.active = Some(active);
        // Requests made before activation: served on the fs thread (this is
        // a vCPU's, whose filter has no file system calls).
        self.kick();
        Ok(())
    }

    fn reset(&mut self) {
        self.active = None;
        self.server.reset();
    }

    fn queue_states(&self) -> Vec<virtio_queue::QueueState> {
        crate::devices::virtio::active_queue_states(self.active.as_ref())
    }

    fn restored(&mut self) {
        self.kick();
    }
}

impl MutEventSubscriber for FsDevice {
    fn init(&mut self, ops: &mut EventOps) {
        watch_queues(&self.queue_evts, ops, "virtio-fs");
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        let index = events.data() as usize;
        if let Some(evt) = self.queue_evts.get(index) {
            debug_assert_eq!(evt.as_raw_fd(), events.fd());
            let _ = evt.read();
            self.process_queue(index);
        }
    }
}
