//! The virtio-block device: one request queue, served in the event loop.

use std::os::fd::AsRawFd;

use crate::vstate::memory::GuestMemoryMmap;
use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::QueueT;
use vm_memory::Bytes;
use vmm_sys_util::eventfd::EventFd;

use super::disk::{Disk, DiskError, DiskSnapshot};
use super::request::{self, ID_LEN};
use super::SECTOR_SIZE;
use crate::devices::virtio::queue::{serve_queue, Served};
use crate::devices::virtio::{
    read_config_bytes, ActivateError, ActiveQueues, VirtioDevice, INT_VRING, TYPE_BLOCK,
    VIRTIO_F_VERSION_1,
};
use crate::rate_limiter::RateLimiter;

/// VIRTIO_BLK_F_SEG_MAX: the driver may put up to `seg_max` data
/// buffers in one request (without it Linux sends one page per request).
const VIRTIO_BLK_F_SEG_MAX: u64 = 1 << 2;
/// Data buffers per request offered (`seg_max`): a request's chain is
/// these, its header and its status, within the queue.
const SEG_MAX: u32 = 128;
/// VIRTIO_BLK_F_RO: the device is read-only.
const VIRTIO_BLK_F_RO: u64 = 1 << 5;
/// VIRTIO_BLK_F_FLUSH: the device takes flush requests.
const VIRTIO_BLK_F_FLUSH: u64 = 1 << 9;
/// Queue size offered to the driver.
const QUEUE_SIZE: u16 = 256;

/// A virtio-block device.
#[derive(Debug)]
pub struct BlockDevice {
    disk: Disk,
    /// The drive's name (snapshots match clones' overlays by it).
    name: String,
    /// What the guest reads as the serial.
    id: [u8; ID_LEN],
    queue_evt: [EventFd; 1],
    /// Configuration space (5.2.4): capacity in sectors (le64), size_max
    /// (le32, not offered) and seg_max (le32).
    config: [u8; 16],
    active: Option<ActiveQueues>,
    /// Bytes and requests per second the guest may have (None: no limit).
    limiter: Option<RateLimiter>,
}

impl BlockDevice {
    /// A device serving `disk`, notified through `queue_evt`. `id` is what
    /// the guest reads as the serial (truncated to 20 bytes).
    pub fn new(disk: Disk, id: &str, queue_evt: EventFd) -> Self {
        let mut id_bytes = [0u8; ID_LEN];
        let n = id.len().min(ID_LEN);
        id_bytes[..n].copy_from_slice(&id.as_bytes()[..n]);
        let mut config = [0u8; 16];
        config[..8].copy_from_slice(&(disk.size() / SECTOR_SIZE).to_le_bytes());
        config[12..].copy_from_slice(&SEG_MAX.to_le_bytes());
        BlockDevice {
            disk,
            name: id.to_owned(),
            id: id_bytes,
            queue_evt: [queue_evt],
            config,
            active: None,
            limiter: None,
        }
    }

    /// Limits the guest's bytes and requests per second.
    pub fn with_limiter(mut self, limiter: Option<RateLimiter>) -> Self {
        self.limiter = limiter;
        self
    }

    /// The device's disk, giving the device up.
    pub fn into_disk(self) -> Disk {
        self.disk
    }

    /// Puts `disk` in the drive in place of its medium, which is returned;
    /// the capacity the driver reads is the new one. The transport must
    /// tell the driver ([`MmioTransport::config_changed`]). Requests are
    /// served whole between events, so none is half done with the old
    /// medium.
    ///
    /// [`MmioTransport::config_changed`]: crate::devices::virtio::mmio::MmioTransport::config_changed
    pub fn replace_disk(&mut self, disk: Disk) -> Disk {
        self.config[..8].copy_from_slice(&(disk.size() / SECTOR_SIZE).to_le_bytes());
        std::mem::replace(&mut self.disk, disk)
    }

    /// The drive's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Saves the disk's contents into snapshot directory `dir` (see
    /// [`Disk::save`]); the device must be quiet.
    pub fn save_disk(&self, dir: &std::path::Path, file: &str) -> Result<DiskSnapshot, DiskError> {
        self.disk.flush()?;
        self.disk.save(dir, file)
    }

    /// Serves every request the driver has made available. A queue the
    /// driver has corrupted (an available index that runs past the ring, an
    /// unreadable ring) fails the device rather than spinning on it.
    fn process_queue(&mut self) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let mem = active.mem.clone();
        let queue = &mut active.queues[0];
        let (limiter, disk, id) = (&mut self.limiter, &mut self.disk, &self.id);
        let Served { used_any, broken } = serve_queue(queue, &mem, "virtio-block", |descriptors| {
            if let Some(limiter) = limiter.as_mut() {
                // What the request moves: its descriptors but the 16-byte
                // header and the status byte. Over the limit it stays
                // available; the limiter's timer brings the device back.
                let bytes = descriptors
                    .iter()
                    .map(|d| u64::from(d.len()))
                    .sum::<u64>()
                    .saturating_sub(17);
                if !limiter.consume(bytes) {
                    return None;
                }
            }
            Some(serve(&mem, descriptors, disk, id))
        });
        if used_any && queue.needs_notification(&mem).unwrap_or(true) {
            active.interrupt.trigger(INT_VRING);
        }
        if broken {
            tracing::warn!(
                "virtio-block: the driver broke the request queue; the device needs a reset"
            );
            active.interrupt.fail_device();
            self.active = None;
        }
    }
}

/// Serves one chain; returns the used length (bytes written to the guest).
fn serve(
    mem: &GuestMemoryMmap,
    descriptors: &[Descriptor],
    disk: &mut Disk,
    id: &[u8; ID_LEN],
) -> u32 {
    match request::parse(mem, descriptors) {
        Ok(req) => {
            let (status, written) = request::execute(&req, disk, mem, id);
            match mem.write_obj(status, req.status) {
                Ok(()) => written + 1,
                Err(_) => 0,
            }
        }
        Err((e, status)) => {
            tracing::warn!("virtio-block: bad request: {e}");
            status
                .and_then(|s| mem.write_obj(request::VIRTIO_BLK_S_IOERR, s).ok())
                .map_or(0, |()| 1)
        }
    }
}

impl VirtioDevice for BlockDevice {
    fn device_type(&self) -> u32 {
        TYPE_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        let ro = if self.disk.is_read_only() {
            VIRTIO_BLK_F_RO
        } else {
            0
        };
        VIRTIO_F_VERSION_1 | VIRTIO_BLK_F_FLUSH | VIRTIO_BLK_F_SEG_MAX | ro
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evt
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::warn!("virtio-block: the driver wrote read-only config at {offset:#x}");
    }

    fn activate(&mut self, active: ActiveQueues) -> Result<(), ActivateError> {
        active.expect_queues(1)?;
        self.active = Some(active);
        // Requests made before activation would otherwise wait for the next kick.
        self.process_queue();
        Ok(())
    }

    fn reset(&mut self) {
        self.active = None;
    }

    fn restored(&mut self) {
        // Requests the guest queued before the snapshot: serve them, and
        // raise the line in case activation served some before the vCPUs'
        // interrupt controllers existed (a spurious interrupt is harmless).
        self.process_queue();
        if let Some(active) = &self.active {
            active.interrupt.trigger(INT_VRING);
        }
    }

    fn queue_states(&self) -> Vec<virtio_queue::QueueState> {
        crate::devices::virtio::active_queue_states(self.active.as_ref())
    }
}

impl MutEventSubscriber for BlockDevice {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.queue_evt[0], EventSet::IN)) {
            tracing::error!("virtio-block: cannot watch the queue: {e:?}");
        }
        if let Some(limiter) = &self.limiter {
            if let Err(e) = ops.add(Events::new(limiter, EventSet::IN)) {
                tracing::error!("virtio-block: cannot watch the rate limiter: {e:?}");
            }
        }
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        if events.fd() == self.queue_evt[0].as_raw_fd() {
            let _ = self.queue_evt[0].read();
            self.process_queue();
        } else if let Some(limiter) = self
            .limiter
            .as_mut()
            .filter(|l| events.fd() == l.as_raw_fd())
        {
            limiter.on_timer();
            self.process_queue();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::block::request::{
        VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_T_IN,
    };
    use crate::devices::virtio::block::DiskMode;
    use crate::devices::virtio::VirtioInterrupt;
    use crate::vstate::memory::GuestMemoryMmap;
    use std::sync::Arc;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::split::Descriptor as SplitDescriptor;
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::Queue;
    use vm_memory::GuestAddress;
    use vmm_sys_util::tempdir::TempDir;

    const HEADER: u64 = 0x10_0000;
    const DATA: u64 = 0x10_1000;
    const STATUS: u64 = 0x10_3000;
    const W: u16 = VRING_DESC_F_WRITE as u16;
    const N: u16 = VRING_DESC_F_NEXT as u16;

    struct Rig {
        mem: GuestMemoryMmap,
        device: BlockDevice,
        _dir: TempDir,
    }

    /// A device over a 4 KiB disk filled with 0x5a, and a 16-entry queue at
    /// 0 holding `descs`, none of them available yet.
    fn rig(descs: &[(u64, u32, u16, u16)]) -> Rig {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).expect("memory");
        let dir = TempDir::new().expect("tempdir");
        let path = dir.as_path().join("disk");
        std::fs::write(&path, [0x5a; 4096]).expect("image");
        let disk = Disk::open(&path, &DiskMode::ReadWrite).expect("disk");
        let mock = MockSplitQueue::new(&mem, 16);
        for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
            let d = RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next));
            mock.desc_table()
                .store(i as u16, d)
                .expect("store descriptor");
        }
        mock.avail().ring().ref_at(0).expect("ring slot").store(0);
        mock.avail().idx().store(0);
        let queue: Queue = mock.create_queue().expect("queue");
        let mut device = BlockDevice::new(disk, "test", EventFd::new(0).expect("eventfd"));
        let interrupt = Arc::new(VirtioInterrupt::new(EventFd::new(0).expect("eventfd")));
        let active = ActiveQueues {
            mem: mem.clone(),
            queues: vec![queue],
            interrupt,
            features: VIRTIO_F_VERSION_1,
        };
        device.activate(active).expect("activate");
        Rig {
            mem,
            device,
            _dir: dir,
        }
    }

    /// Sets the available ring's index, as a driver does to publish chains.
    fn make_available(rig: &Rig, idx: u16) {
        rig.mem
            .write_obj(idx, GuestAddress(16 * 16 + 2))
            .expect("avail idx");
    }

    fn used_idx(rig: &Rig) -> u16 {
        let q = &rig.device.active.as_ref().expect("active").queues[0];
        rig.mem
            .read_obj::<u16>(GuestAddress(q.used_ring() + 2))
            .expect("used idx")
    }

    fn header(mem: &GuestMemoryMmap, kind: u32, sector: u64) {
        mem.write_obj(kind, GuestAddress(HEADER)).expect("header");
        mem.write_obj(sector, GuestAddress(HEADER + 8))
            .expect("header");
    }

    #[test]
    fn a_read_returns_disk_data() {
        let mut rig = rig(&[(HEADER, 16, N, 1), (DATA, 512, W | N, 2), (STATUS, 1, W, 0)]);
        header(&rig.mem, VIRTIO_BLK_T_IN, 1);
        make_available(&rig, 1);

        rig.device.process_queue();

        assert_eq!(used_idx(&rig), 1);
        assert_eq!(
            rig.mem
                .read_obj::<u8>(GuestAddress(STATUS))
                .expect("status"),
            VIRTIO_BLK_S_OK
        );
        assert_eq!(
            rig.mem
                .read_obj::<u8>(GuestAddress(DATA + 511))
                .expect("data"),
            0x5a
        );
    }

    #[test]
    fn a_read_fills_each_of_the_buffers_seg_max_lets_it_carry() {
        let mut rig = rig(&[
            (HEADER, 16, N, 1),
            (DATA, 512, W | N, 2),
            (DATA + 0x1000, 1024, W | N, 3),
            (STATUS, 1, W, 0),
        ]);
        header(&rig.mem, VIRTIO_BLK_T_IN, 0);
        make_available(&rig, 1);

        rig.device.process_queue();

        let mut seg_max = [0u8; 4];
        rig.device.read_config(12, &mut seg_max);
        assert_ne!(rig.device.features() & VIRTIO_BLK_F_SEG_MAX, 0);
        assert_eq!(u32::from_le_bytes(seg_max), SEG_MAX);
        assert_eq!(byte_at(&rig, STATUS), VIRTIO_BLK_S_OK);
        for at in [DATA, DATA + 511, DATA + 0x1000, DATA + 0x1000 + 1023] {
            assert_eq!(byte_at(&rig, at), 0x5a);
        }
    }

    #[test]
    fn a_new_medium_changes_the_capacity_and_what_reads_return() {
        let mut rig = rig(&[(HEADER, 16, N, 1), (DATA, 512, W | N, 2), (STATUS, 1, W, 0)]);
        let path = rig._dir.as_path().join("medium");
        std::fs::write(&path, [0xa5; 8192]).expect("medium");
        let medium = Disk::open(&path, &DiskMode::ReadOnly).expect("medium");
        header(&rig.mem, VIRTIO_BLK_T_IN, 9);
        make_available(&rig, 1);

        let old = rig.device.replace_disk(medium);
        rig.device.process_queue();

        assert_eq!(old.size(), 4096);
        let mut capacity = [0u8; 8];
        rig.device.read_config(0, &mut capacity);
        assert_eq!(u64::from_le_bytes(capacity), 16);
        assert_ne!(rig.device.features() & VIRTIO_BLK_F_RO, 0);
        assert_eq!(byte_at(&rig, STATUS), VIRTIO_BLK_S_OK);
        assert_eq!(byte_at(&rig, DATA), 0xa5);
    }

    /// The byte at guest address `at`.
    fn byte_at(rig: &Rig, at: u64) -> u8 {
        rig.mem
            .read_obj::<u8>(GuestAddress(at))
            .expect("guest byte")
    }

    #[test]
    fn a_descriptor_loop_ends_in_an_error_not_a_hang() {
        let mut rig = rig(&[(HEADER, 16, N, 1), (DATA, 512, W | N, 0)]);
        header(&rig.mem, VIRTIO_BLK_T_IN, 0);
        make_available(&rig, 1);

        rig.device.process_queue();

        assert_eq!(used_idx(&rig), 1);
        assert_eq!(
            rig.mem.read_obj::<u8>(GuestAddress(DATA)).expect("status"),
            VIRTIO_BLK_S_IOERR
        );
    }

    #[test]
    fn a_request_beyond_the_disk_gets_an_io_error() {
        let mut rig = rig(&[(HEADER, 16, N, 1), (DATA, 512, W | N, 2), (STATUS, 1, W, 0)]);
        header(&rig.mem, VIRTIO_BLK_T_IN, 8);
        make_available(&rig, 1);

        rig.device.process_queue();

        assert_eq!(
            rig.mem
                .read_obj::<u8>(GuestAddress(STATUS))
                .expect("status"),
            VIRTIO_BLK_S_IOERR
        );
        assert_eq!(rig.mem.read_obj::<u8>(GuestAddress(DATA)).expect("data"), 0);
    }

    #[test]
    fn a_garbage_available_index_is_not_served() {
        let mut rig = rig(&[(HEADER, 16, N, 1), (DATA, 512, W | N, 2), (STATUS, 1, W, 0)]);
        header(&rig.mem, VIRTIO_BLK_T_IN, 0);
        make_available(&rig, 1000);
        let queue_used_ring = rig.device.active.as_ref().expect("active").queues[0].used_ring();

        rig.device.process_queue();

        let used = rig
            .mem
            .read_obj::<u16>(GuestAddress(queue_used_ring + 2))
            .expect("used idx");
        assert_eq!(used, 0);
        assert!(
            rig.device.active.is_none(),
            "a broken queue must stop the device"
        );
    }

    #[test]
    fn a_descriptor_index_beyond_the_table_is_refused() {
        let mut rig = rig(&[(HEADER, 16, N, 200), (STATUS, 1, W, 0)]);
        header(&rig.mem, VIRTIO_BLK_T_IN, 0);
        make_available(&rig, 1);

        rig.device.process_queue();

        // The chain stops at the bad index; no status descriptor, used length 0.
        assert_eq!(used_idx(&rig), 1);
    }

    #[test]
    fn a_rate_limited_device_leaves_requests_queued_until_its_timer() {
        let request = [(HEADER, 16, N, 1), (DATA, 512, W | N, 2), (STATUS, 1, W, 0)];
        let chained: Vec<(u64, u32, u16, u16)> = (0..3u16)
            .flat_map(|i| {
                request
                    .iter()
                    .map(move |&(a, l, f, n)| (a, l, f, if f & N != 0 { n + 3 * i } else { 0 }))
            })
            .collect();
        let mut rig = rig(&chained);
        rig.device.limiter = RateLimiter::new(crate::rate_limiter::Limits {
            bytes_per_s: None,
            ops_per_s: Some(2),
        })
        .expect("timer");
        header(&rig.mem, VIRTIO_BLK_T_IN, 0);
        for (slot, head) in [0u16, 3, 6].iter().enumerate() {
            rig.mem
                .write_obj(*head, GuestAddress(16 * 16 + 4 + 2 * slot as u64))
                .expect("avail ring");
        }
        make_available(&rig, 3);

        rig.device.process_queue();
        let after_burst = used_idx(&rig);
        let limiter = rig.device.limiter.as_ref().expect("limiter");
        let blocked = limiter.is_blocked();
        // The timer fires once an operation has refilled (half a second).
        let mut fd = libc::pollfd {
            fd: limiter.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polls one valid descriptor.
        let fired = unsafe { libc::poll(&mut fd, 1, 10_000) };
        rig.device.limiter.as_mut().expect("limiter").on_timer();
        rig.device.process_queue();

        assert_eq!(
            after_burst, 2,
            "two operations per second: two served at once"
        );
        assert!(blocked);
        assert!(
            rig.device.active.is_some(),
            "throttling is not a broken queue"
        );
        assert_eq!(fired, 1);
        assert_eq!(used_idx(&rig), 3);
    }
}
