//! The virtio-block device: one request queue, served in the event loop.

use std::os::fd::AsRawFd;

use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use virtio_queue::QueueT;
use vm_memory::Bytes;
use vmm_sys_util::eventfd::EventFd;

use super::disk::Disk;
use super::request::{self, ID_LEN};
use super::SECTOR_SIZE;
use crate::devices::virtio::{
    read_config_bytes, ActivateError, ActiveQueues, VirtioDevice, INT_VRING, TYPE_BLOCK,
    VIRTIO_F_VERSION_1,
};

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
    id: [u8; ID_LEN],
    queue_evt: [EventFd; 1],
    /// Configuration space: capacity in sectors (le64).
    config: [u8; 8],
    active: Option<ActiveQueues>,
}

impl BlockDevice {
    /// A device serving `disk`, notified through `queue_evt`. `id` is what
    /// the guest reads as the serial (truncated to 20 bytes).
    pub fn new(disk: Disk, id: &str, queue_evt: EventFd) -> Self {
        let mut id_bytes = [0u8; ID_LEN];
        let n = id.len().min(ID_LEN);
        id_bytes[..n].copy_from_slice(&id.as_bytes()[..n]);
        let config = (disk.size() / SECTOR_SIZE).to_le_bytes();
        BlockDevice {
            disk,
            id: id_bytes,
            queue_evt: [queue_evt],
            config,
            active: None,
        }
    }

    /// Serves every request the driver has made available.
    fn process_queue(&mut self) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let mem = active.mem.clone();
        let queue = &mut active.queues[0];
        let mut used_any = false;
        loop {
            if let Err(e) = queue.disable_notification(&mem) {
                tracing::warn!("virtio-block: queue is broken: {e:?}");
                return;
            }
            while let Some(chain) = queue.pop_descriptor_chain(&mem) {
                let head = chain.head_index();
                let descriptors: Vec<_> = chain.collect();
                let used = match request::parse(&mem, &descriptors) {
                    Ok(req) => {
                        let (status, written) =
                            request::execute(&req, &mut self.disk, &mem, &self.id);
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
                };
                if let Err(e) = queue.add_used(&mem, head, used) {
                    tracing::warn!("virtio-block: cannot return a buffer: {e:?}");
                    return;
                }
                used_any = true;
            }
            match queue.enable_notification(&mem) {
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => {
                    tracing::warn!("virtio-block: queue is broken: {e:?}");
                    return;
                }
            }
        }
        if used_any && queue.needs_notification(&mem).unwrap_or(true) {
            active.interrupt.trigger(INT_VRING);
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
        VIRTIO_F_VERSION_1 | VIRTIO_BLK_F_FLUSH | ro
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
        if active.queues.len() != 1 {
            return Err(ActivateError::QueueCount {
                expected: 1,
                found: active.queues.len(),
            });
        }
        self.active = Some(active);
        // Requests made before activation would otherwise wait for the next kick.
        self.process_queue();
        Ok(())
    }

    fn reset(&mut self) {
        self.active = None;
    }
}

impl MutEventSubscriber for BlockDevice {
    fn init(&mut self, ops: &mut EventOps) {
        if let Err(e) = ops.add(Events::new(&self.queue_evt[0], EventSet::IN)) {
            tracing::error!("virtio-block: cannot watch the queue: {e:?}");
        }
    }

    fn process(&mut self, events: Events, _ops: &mut EventOps) {
        if events.fd() == self.queue_evt[0].as_raw_fd() {
            let _ = self.queue_evt[0].read();
            self.process_queue();
        }
    }
}
