//! The virtio-net device: one RX and one TX queue over a TAP device, served
//! in the event loop. No offloads are offered, so every frame fits a
//! guest buffer of MTU size.

use std::os::fd::AsRawFd;

use crate::vstate::memory::GuestMemoryMmap;
use event_manager::{EventOps, EventSet, Events, MutEventSubscriber};
use vm_memory::Bytes;
use vmm_sys_util::eventfd::EventFd;

use super::tap::{Tap, VNET_HDR_LEN};
use crate::devices::virtio::queue::{pop_chain, return_chain, QueueBroken};
use crate::devices::virtio::{
    read_config_bytes, watch_queues, ActivateError, ActiveQueues, VirtioDevice, INT_VRING,
    TYPE_NET, VIRTIO_F_VERSION_1,
};

const RX: usize = 0;
const TX: usize = 1;
const QUEUE_SIZE: u16 = 256;
/// VIRTIO_NET_F_MAC: the device has a MAC address in its config.
const VIRTIO_NET_F_MAC: u64 = 1 << 5;
/// Largest frame with its header (64 KiB of GSO data plus headers).
const MAX_FRAME: usize = 65562;
/// Event tokens: the queues use their index.
const TOKEN_TAP: u32 = 2;

/// A virtio-net device.
#[derive(Debug)]
pub struct NetDevice {
    tap: Tap,
    queue_evts: [EventFd; 2],
    /// Configuration space: mac[6].
    config: [u8; 6],
    active: Option<ActiveQueues>,
    /// A frame read from the TAP that is waiting for a guest RX buffer.
    pending_rx: Option<Vec<u8>>,
    watching_tap: bool,
    /// Frames dropped because the TAP or the guest could not take them.
    pub dropped: u64,
}

impl NetDevice {
    pub fn new(tap: Tap, mac: [u8; 6]) -> std::io::Result<Self> {
        let evt = || EventFd::new(libc::EFD_NONBLOCK);
        Ok(NetDevice {
            tap,
            queue_evts: [evt()?, evt()?],
            config: mac,
            active: None,
            pending_rx: None,
            watching_tap: false,
            dropped: 0,
        })
    }

    /// The MAC address the device offers.
    pub fn mac(&self) -> [u8; 6] {
        self.config
    }

    fn watch_tap(&mut self, on: bool, ops: &mut EventOps) {
        if on == self.watching_tap {
            return;
        }
        let events = Events::with_data(&self.tap, TOKEN_TAP, EventSet::IN);
        let result = if on {
            ops.add(events)
        } else {
            ops.remove(events)
        };
        if let Err(e) = result {
            tracing::warn!("virtio-net: cannot change TAP events: {e:?}");
        }
        self.watching_tap = on;
    }

    /// Sends every frame the guest queued, then delivers frames from the TAP
    /// while the guest has buffers for them.
    fn process(&mut self, ops: &mut EventOps) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let mem = active.mem.clone();
        let result = (|| -> Result<(bool, bool), QueueBroken> {
            let mut used = false;
            let mut frame = Vec::with_capacity(MAX_FRAME);
            while let Some((head, descriptors)) = pop_chain(&mut active.queues[TX], &mem)? {
                frame.clear();
                if gather(&mem, &descriptors, &mut frame) && frame.len() > VNET_HDR_LEN {
                    if let Err(e) = self.tap.write_frame(&frame) {
                        tracing::debug!("virtio-net: TAP dropped a frame: {e}");
                        self.dropped += 1;
                    }
                } else {
                    tracing::warn!("virtio-net: dropping a malformed TX chain");
                    self.dropped += 1;
                }
                return_chain(&mut active.queues[TX], &mem, head, 0)?;
                used = true;
            }
            let mut starved = false;
            loop {
                if self.pending_rx.is_none() {
                    let mut buf = vec![0u8; MAX_FRAME];
                    match self.tap.read_frame(&mut buf) {
                        Ok(n) if n > VNET_HDR_LEN => {
                            buf.truncate(n);
                            self.pending_rx = Some(buf);
                        }
                        Ok(_) => continue,
                        Err(_) => break, // WouldBlock, or the TAP went away
                    }
                }
                let Some((head, descriptors)) = pop_chain(&mut active.queues[RX], &mem)? else {
                    starved = true;
                    break;
                };
                let frame = self.pending_rx.take().unwrap_or_default();
                let written = scatter(&mem, &descriptors, &frame).unwrap_or_else(|| {
                    self.dropped += 1;
                    0
                });
                return_chain(&mut active.queues[RX], &mem, head, written)?;
                used = true;
            }
            Ok((used, starved))
        })();
        match result {
            Ok((used, starved)) => {
                if used {
                    active.interrupt.trigger(INT_VRING);
                }
                // Out of guest buffers: stop reading the TAP until the
                // guest posts more (an RX queue notification).
                self.watch_tap(!starved, ops);
            }
            Err(e) => {
                tracing::warn!("virtio-net: {e}; the device needs a reset");
                active.interrupt.fail_device();
                self.active = None;
                self.watch_tap(false, ops);
            }
        }
    }
}

/// Copies a TX chain (device-readable descriptors only) into `frame`.
fn gather(
    mem: &GuestMemoryMmap,
    descriptors: &[virtio_queue::desc::split::Descriptor],
    frame: &mut Vec<u8>,
) -> bool {
    for d in descriptors {
        let start = frame.len();
        let len = d.len() as usize;
        if d.is_write_only() || start + len > MAX_FRAME {
            return false;
        }
        frame.resize(start + len, 0);
        if mem.read_slice(&mut frame[start..], d.addr()).is_err() {
            return false;
        }
    }
    true
}

/// Copies `frame` into an RX chain; `None` if the chain is unusable or too
/// small. Sets num_buffers to 1 (no mergeable buffers).
fn scatter(
    mem: &GuestMemoryMmap,
    descriptors: &[virtio_queue::desc::split::Descriptor],
    frame: &[u8],
) -> Option<u32> {
    let capacity: usize = descriptors.iter().map(|d| d.len() as usize).sum();
    if descriptors.iter().any(|d| !d.is_write_only()) || capacity < frame.len() {
        return None;
    }
    let mut frame = frame.to_vec();
    frame[10..12].copy_from_slice(&1u16.to_le_bytes());
    let mut rest = &frame[..];
    for d in descriptors {
        let n = rest.len().min(d.len() as usize);
        mem.write_slice(&rest[..n], d.addr()).ok()?;
        rest = &rest[n..];
        if rest.is_empty() {
            break;
        }
    }
    Some(frame.len() as u32)
}

impl VirtioDevice for NetDevice {
    fn device_type(&self) -> u32 {
        TYPE_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; 2]
    }

    fn features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | VIRTIO_NET_F_MAC
    }

    fn queue_events(&self) -> &[EventFd] {
        &self.queue_evts
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::warn!("virtio-net: the driver wrote read-only config at {offset:#x}");
    }

    fn activate(&mut self, active: ActiveQueues) -> Result<(), ActivateError> {
        active.expect_queues(2)?;
        self.active = Some(active);
        // Start reading the TAP from the event loop.
        let _ = self.queue_evts[RX].write(1);
        Ok(())
    }

    fn reset(&mut self) {
        self.active = None;
        self.pending_rx = None;
    }

    fn queue_states(&self) -> Vec<virtio_queue::QueueState> {
        crate::devices::virtio::active_queue_states(self.active.as_ref())
    }
}

impl MutEventSubscriber for NetDevice {
    fn init(&mut self, ops: &mut EventOps) {
        watch_queues(&self.queue_evts, ops, "virtio-net");
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        if let Some(evt) = self.queue_evts.get(events.data() as usize) {
            let _ = evt.read();
        }
        if self.active.is_none() {
            if events.fd() == self.tap.as_raw_fd() {
                self.watch_tap(false, ops);
            }
            return;
        }
        NetDevice::process(self, ops);
    }
}
