//! The virtio-vsock device: RX, TX and event queues, served in the event
//! loop together with the Unix sockets of its connections.

use std::path::Path;
use std::sync::Arc;

use event_manager::{EventOps, Events, MutEventSubscriber};
use virtio_queue::QueueOwnedT;
use vmm_sys_util::eventfd::EventFd;

use super::muxer::{Muxer, MuxerError};
use super::packet;
use crate::devices::virtio::queue::{pop_chain, return_chain, QueueBroken};
use crate::devices::virtio::{
    read_config_bytes, watch_queues, ActivateError, ActiveQueues, VirtioDevice, INT_VRING,
    TYPE_VSOCK, VIRTIO_F_VERSION_1,
};
use crate::timeline::{Phase, Timeline};

const RX: usize = 0;
const TX: usize = 1;
const EVENT: usize = 2;
/// virtio_vsock_event id: the transport was reset (virtio 1.2, 5.10.6.7).
const EVENT_TRANSPORT_RESET: u32 = 0;
const QUEUE_SIZE: u16 = 256;
/// Guest CIDs 0-2 are reserved (hypervisor, loopback, host).
pub const MIN_GUEST_CID: u64 = 3;

/// A virtio-vsock device.
#[derive(Debug)]
pub struct VsockDevice {
    muxer: Muxer,
    queue_evts: [EventFd; 3],
    /// Configuration space: guest_cid (le64).
    config: [u8; 8],
    active: Option<ActiveQueues>,
    /// After a restore: the transport reset was sent and the guest has not
    /// yet handed its event buffer back. Until it does, nothing goes to the
    /// guest: it would drop new connections along with the old ones.
    awaiting_reset: bool,
    /// Where the reset and the first connection are marked, if anywhere.
    timeline: Option<Arc<Timeline>>,
}

impl VsockDevice {
    /// The guest's CID.
    pub fn cid(&self) -> u64 {
        u64::from_le_bytes(self.config)
    }

    /// Removes the host-side socket file (see [`Muxer::remove_socket_file`]).
    pub fn remove_socket_file(&self) {
        self.muxer.remove_socket_file();
    }

    /// A device for guest `cid` whose host side listens on `uds_path`.
    pub fn new(cid: u64, uds_path: &Path) -> Result<Self, MuxerError> {
        let evt = || EventFd::new(libc::EFD_NONBLOCK).map_err(MuxerError::EventFd);
        let queue_evts = [evt()?, evt()?, evt()?];
        Ok(VsockDevice {
            muxer: Muxer::new(cid, uds_path)?,
            queue_evts,
            config: cid.to_le_bytes(),
            active: None,
            awaiting_reset: false,
            timeline: None,
        })
    }

    /// Marks the transport reset and the first connection on `timeline`
    /// (the restore-to-answer phases that benchmarks report).
    pub fn with_timeline(mut self, timeline: Arc<Timeline>) -> Self {
        self.muxer.set_timeline(timeline.clone());
        self.timeline = Some(timeline);
        self
    }

    fn mark(&self, phase: Phase) {
        if let Some(timeline) = &self.timeline {
            timeline.mark(phase);
        }
    }

    /// Takes every packet the guest sent, then fills RX buffers with what
    /// is waiting for the guest.
    fn process(&mut self, ops: &mut EventOps) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let mem = active.mem.clone();
        let result = (|| -> Result<bool, QueueBroken> {
            let mut used = false;
            while let Some((head, descriptors)) = pop_chain(&mut active.queues[TX], &mem)? {
                match packet::read_tx(&mem, &descriptors) {
                    Ok((header, payload)) => self.muxer.on_guest_packet(&header, &payload, ops),
                    Err(e) => tracing::warn!("vsock: dropping a bad packet from the guest: {e}"),
                }
                return_chain(&mut active.queues[TX], &mem, head, 0)?;
                used = true;
            }
            while self.muxer.has_rx() && !self.awaiting_reset {
                let Some((head, descriptors)) = pop_chain(&mut active.queues[RX], &mem)? else {
                    break;
                };
                let written = match packet::rx_capacity(&descriptors) {
                    Ok(capacity) => match self.muxer.next_rx(capacity, ops) {
                        Some((header, payload)) => {
                            packet::write_rx(&mem, &descriptors, &header, &payload).unwrap_or(0)
                        }
                        None => {
                            active.queues[RX].go_to_previous_position();
                            break;
                        }
                    },
                    Err(e) => {
                        tracing::warn!("vsock: unusable RX buffer from the guest: {e}");
                        0
                    }
                };
                return_chain(&mut active.queues[RX], &mem, head, written)?;
                used = true;
            }
            Ok(used)
        })();
        match result {
            Ok(true) => active.interrupt.trigger(INT_VRING),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!("vsock: {e}; the device needs a reset");
                active.interrupt.fail_device();
                self.active = None;
                self.muxer.reset(ops);
            }
        }
    }
}

impl VirtioDevice for VsockDevice {
    fn device_type(&self) -> u32 {
        TYPE_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; 3]
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evts
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::warn!("vsock: the driver wrote read-only config at {offset:#x}");
    }

    fn activate(&mut self, active: ActiveQueues) -> Result<(), ActivateError> {
        active.expect_queues(3)?;
        self.active = Some(active);
        // Packets waiting for the guest are sent on the next RX kick.
        let _ = self.queue_evts[RX].write(1);
        Ok(())
    }

    fn reset(&mut self) {
        self.active = None;
        self.awaiting_reset = false;
    }

    /// After a restore the guest's connections point at host sockets that
    /// no longer exist, and its CID may have changed: a transport reset
    /// makes the driver drop every connection and read the CID again.
    fn restored(&mut self) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let mem = active.mem.clone();
        let queue = &mut active.queues[EVENT];
        let sent = match pop_chain(queue, &mem) {
            Ok(Some((head, descriptors))) => {
                let event = EVENT_TRANSPORT_RESET.to_le_bytes();
                let written = descriptors
                    .iter()
                    .find(|d| d.is_write_only() && d.len() >= 4)
                    .and_then(|d| vm_memory::Bytes::write_slice(&mem, &event, d.addr()).ok())
                    .map_or(0, |()| 4);
                return_chain(queue, &mem, head, written).is_ok() && written == 4
            }
            _ => false,
        };
        if sent {
            self.awaiting_reset = true;
            active.interrupt.trigger(INT_VRING);
            self.mark(Phase::VsockResetSent);
        } else {
            tracing::warn!("vsock: no event buffer from the guest; its old connections stay");
        }
    }

    fn queue_states(&self) -> Vec<virtio_queue::QueueState> {
        crate::devices::virtio::active_queue_states(self.active.as_ref())
    }
}

impl MutEventSubscriber for VsockDevice {
    fn init(&mut self, ops: &mut EventOps) {
        watch_queues(&self.queue_evts, ops, "vsock");
        self.muxer.init(ops);
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let token = events.data();
        match self.queue_evts.get(token as usize) {
            Some(evt) => {
                let _ = evt.read();
                // The guest refills the event queue once it has handled
                // the transport reset (reset its sockets, read the CID).
                if token as usize == EVENT && self.awaiting_reset {
                    self.awaiting_reset = false;
                    self.mark(Phase::VsockResetHandled);
                }
            }
            None => self.muxer.on_event(token, events.event_set(), ops),
        }
        // Before activation, host connections wait; the guest sees them once
        // its driver is up (`process` does nothing without queues).
        VsockDevice::process(self, ops);
    }
}
