//! The virtio-balloon device (virtio 1.2, section 5.5), for one thing:
//! **free page reporting** (`VIRTIO_BALLOON_F_PAGE_REPORTING`). The guest
//! reports blocks of free memory (of its `page_reporting_order`) and the
//! device drops them with `MADV_DONTNEED`: an anonymous page goes back to
//! the host, a clone's private copy of a snapshot page goes and the page
//! reads the shared snapshot file again (never `MADV_REMOVE` or a hole
//! punched in that file, which every clone maps). The guest assumes
//! nothing of a reported page's contents, as no `PAGE_POISON` is offered
//! (a guest that poisons or zeroes freed pages turns reporting off).
//!
//! The balloon itself stays empty (`num_pages` is 0): the inflate queue is
//! served all the same, its pages dropped, and the deflate queue returned.
//! Queues: inflate, deflate, then reporting (no stats or hinting queue is
//! offered, so the guest's indices close up).

use std::os::fd::AsRawFd;

use event_manager::{EventOps, Events, MutEventSubscriber};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::QueueT;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, MemoryRegionAddress};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::virtio::queue::{serve_queue, Served};
use crate::devices::virtio::{
    read_config_bytes, watch_queues, ActivateError, ActiveQueues, VirtioDevice, INT_VRING,
    TYPE_BALLOON, VIRTIO_F_VERSION_1,
};
use crate::vstate::memory::GuestMemoryMmap;

/// `VIRTIO_BALLOON_F_REPORTING`.
const F_REPORTING: u64 = 1 << 5;
/// Queue sizes: inflate, deflate, reporting (the guest reports up to 32
/// ranges a chain, and needs room for them).
const QUEUE_SIZES: [u16; 3] = [64, 64, 64];
const INFLATE: usize = 0;
const REPORTING: usize = 2;
/// The balloon's page size: inflate queues hold 4 KiB page frame numbers.
const PAGE: u64 = 4096;
/// `virtio_balloon_config`: num_pages, actual, free_page_hint_cmd_id,
/// poison_val.
const CONFIG_LEN: usize = 16;
/// Where the driver writes `actual`.
const ACTUAL: u64 = 4;

/// A virtio-balloon device with free page reporting.
#[derive(Debug)]
pub struct BalloonDevice {
    /// The pages the driver says the balloon holds (`actual`).
    actual: u32,
    queue_evts: [EventFd; 3],
    active: Option<ActiveQueues>,
}

impl BalloonDevice {
    pub fn new() -> std::io::Result<Self> {
        let evt = || EventFd::new(libc::EFD_NONBLOCK);
        Ok(BalloonDevice {
            actual: 0,
            queue_evts: [evt()?, evt()?, evt()?],
            active: None,
        })
    }

    /// A restored device, with the `actual` its driver last wrote.
    pub fn restored_with(actual: u32) -> std::io::Result<Self> {
        let mut device = Self::new()?;
        device.actual = actual;
        Ok(device)
    }

    /// The pages the driver says the balloon holds (for snapshots).
    pub fn actual(&self) -> u32 {
        self.actual
    }

    /// Has the device loop look at every queue.
    fn kick(&self) {
        for evt in &self.queue_evts {
            if let Err(e) = evt.write(1) {
                tracing::error!("virtio-balloon: cannot wake its loop: {e}");
            }
        }
    }

    /// Serves what the driver made available on queue `index`; a queue it
    /// broke fails the device.
    fn process_queue(&mut self, index: usize) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let mem = active.mem.clone();
        let Some(queue) = active.queues.get_mut(index) else {
            return;
        };
        let Served { used_any, broken } = serve_queue(queue, &mem, "virtio-balloon", |chain| {
            match index {
                INFLATE => {
                    inflate(&mem, chain);
                }
                REPORTING => {
                    report(&mem, chain);
                }
                // Pages the guest takes back (DEFLATE) need nothing here.
                _ => {}
            }
            Some(0)
        });
        if used_any && queue.needs_notification(&mem).unwrap_or(true) {
            active.interrupt.trigger(INT_VRING);
        }
        if broken {
            tracing::warn!("virtio-balloon: the driver broke a queue; the device needs a reset");
            active.interrupt.fail_device();
            self.active = None;
        }
    }
}

/// Drops guest memory `[addr, addr + len)` back to the host; the bytes
/// dropped (0 for a range that is not whole pages within one region of
/// guest memory: a driver's mistake, or a hostile guest's, costs nothing).
fn drop_range(mem: &GuestMemoryMmap, addr: u64, len: u64) -> u64 {
    if len == 0 || addr % PAGE != 0 || len % PAGE != 0 {
        return 0;
    }
    let Some(region) = mem.find_region(GuestAddress(addr)) else {
        return 0;
    };
    let start = addr - region.start_addr().0;
    let fits = start
        .checked_add(len)
        .is_some_and(|end| end <= region.len());
    let Some(host) = fits
        .then(|| region.get_host_address(MemoryRegionAddress(start)).ok())
        .flatten()
    else {
        return 0;
    };
    // SAFETY: `[host, host + len)` lies within one mapping of guest
    // memory (checked above); MADV_DONTNEED only drops its pages (the
    // guest's next touch reads zeros, or the snapshot file's page), which
    // the guest gave up.
    let dropped = unsafe { libc::madvise(host.cast(), len as usize, libc::MADV_DONTNEED) };
    if dropped != 0 {
        tracing::warn!(
            "virtio-balloon: cannot drop {len} bytes at {addr:#x}: {}",
            std::io::Error::last_os_error()
        );
        return 0;
    }
    len
}

/// A reporting chain: each device-writable buffer is a range of free
/// guest memory.
pub(crate) fn report(mem: &GuestMemoryMmap, chain: &[Descriptor]) -> u64 {
    chain
        .iter()
        .filter(|d| d.is_write_only())
        .map(|d| drop_range(mem, d.addr().0, u64::from(d.len())))
        .sum()
}

/// Most page frame numbers an inflate chain is read for (Linux sends at
/// most 256 a chain): a guest cannot keep the device loop, which other
/// devices share, busy for longer with one chain.
const MAX_PFNS: usize = 256;

/// An inflate chain: its device-readable buffers are arrays of 4 KiB page
/// frame numbers the guest gave up (at most [`MAX_PFNS`] are read).
pub(crate) fn inflate(mem: &GuestMemoryMmap, chain: &[Descriptor]) -> u64 {
    let addresses = chain
        .iter()
        .filter(|d| !d.is_write_only())
        .flat_map(|d| (0..u64::from(d.len()) / 4).map(move |i| d.addr().0.checked_add(i * 4)))
        .take(MAX_PFNS);
    let mut dropped = 0;
    for at in addresses {
        let Some(Ok(pfn)) = at.map(|at| mem.read_obj::<u32>(GuestAddress(at))) else {
            break;
        };
        dropped += drop_range(mem, u64::from(pfn) * PAGE, PAGE);
    }
    dropped
}

impl VirtioDevice for BalloonDevice {
    fn device_type(&self) -> u32 {
        TYPE_BALLOON
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | F_REPORTING
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut config = [0u8; CONFIG_LEN];
        config[ACTUAL as usize..ACTUAL as usize + 4].copy_from_slice(&self.actual.to_le_bytes());
        read_config_bytes(&config, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        match (offset, <[u8; 4]>::try_from(data)) {
            (ACTUAL, Ok(bytes)) => self.actual = u32::from_le_bytes(bytes),
            _ => tracing::warn!(
                "virtio-balloon: the driver wrote {} bytes of config at {offset:#x}",
                data.len()
            ),
        }
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evts
    }

    fn activate(&mut self, active: ActiveQueues) -> Result<(), ActivateError> {
        // Without reporting the driver sets up inflate and deflate only.
        let expected = match active.features & F_REPORTING {
            0 => 2,
            _ => QUEUE_SIZES.len(),
        };
        active.expect_queues(expected)?;
        self.active = Some(active);
        Ok(())
    }

    fn reset(&mut self) {
        self.active = None;
    }

    fn queue_states(&self) -> Vec<virtio_queue::QueueState> {
        crate::devices::virtio::active_queue_states(self.active.as_ref())
    }

    fn restored(&mut self) {
        self.kick();
    }
}

impl MutEventSubscriber for BalloonDevice {
    fn init(&mut self, ops: &mut EventOps) {
        watch_queues(&self.queue_evts, ops, "virtio-balloon");
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_pages_within_guest_memory_are_dropped() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("memory");
        mem.write_slice(&[7u8; 8192], GuestAddress(0x4000))
            .expect("write");

        assert_eq!(drop_range(&mem, 0x4000, 8192), 8192);
        let mut back = [1u8; 8192];
        mem.read_slice(&mut back, GuestAddress(0x4000))
            .expect("read");
        assert!(back.iter().all(|&b| b == 0), "an anonymous page reads 0");
        for (addr, len) in [
            (0x4001, 4096),
            (0x4000, 100),
            (0, 0),
            ((1 << 20) - 4096, 8192),
            (1 << 30, 4096),
            (u64::MAX - 4095, 4096),
        ] {
            assert_eq!(drop_range(&mem, addr, len), 0, "{addr:#x}+{len}");
        }
    }

    #[test]
    fn an_inflate_chain_drops_its_pages_and_no_more_than_256() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 4 << 20)]).expect("memory");
        // 1000 page numbers, all of page 0x100 (in memory), at 0x1000.
        for i in 0..1000u64 {
            mem.write_obj(0x100u32, GuestAddress(0x1000 + i * 4))
                .expect("pfn");
        }
        let chain = [Descriptor::new(0x1000, 4000, 0, 0)];
        // Out of memory, and writable (not an inflate buffer): nothing.
        let outside = [Descriptor::new(8 << 20, 4000, 0, 0)];
        let writable = [Descriptor::new(0x1000, 4000, 2, 0)];

        assert_eq!(inflate(&mem, &chain), 256 * PAGE);
        assert_eq!(inflate(&mem, &outside), 0);
        assert_eq!(inflate(&mem, &writable), 0);
        assert_eq!(report(&mem, &writable), 4000 - 4000 % PAGE);
    }

    #[test]
    fn config_reads_an_empty_balloon_and_keeps_what_the_driver_writes() {
        let mut b = BalloonDevice::new().expect("device");
        b.write_config(ACTUAL, &5u32.to_le_bytes());
        b.write_config(0, &9u32.to_le_bytes());
        let mut config = [0xffu8; CONFIG_LEN];
        b.read_config(0, &mut config);

        assert_eq!(&config[..4], &0u32.to_le_bytes(), "num_pages stays 0");
        assert_eq!(&config[4..8], &5u32.to_le_bytes());
        assert_eq!(b.features() & F_REPORTING, F_REPORTING);
    }
}
