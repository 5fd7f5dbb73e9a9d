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
use crate::rate_limiter::RateLimiter;
use virtio_queue::QueueOwnedT;

const RX: usize = 0;
const TX: usize = 1;
const QUEUE_SIZE: u16 = 256;
/// VIRTIO_NET_F_MAC: the device has a MAC address in its config.
const VIRTIO_NET_F_MAC: u64 = 1 << 5;
/// Largest frame with its header (64 KiB of GSO data plus headers).
const MAX_FRAME: usize = 65562;
/// Event tokens: the queues use their index.
const TOKEN_TAP: u32 = 2;
/// Event data of the TX and RX rate limiters' timers.
const TOKEN_TX_LIMIT: u32 = 3;
const TOKEN_RX_LIMIT: u32 = 4;

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
    /// Bytes and frames per second the guest may send and receive.
    tx_limiter: Option<RateLimiter>,
    rx_limiter: Option<RateLimiter>,
    /// The pending RX frame has been counted by the RX limiter.
    rx_paid: bool,
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
            tx_limiter: None,
            rx_limiter: None,
            rx_paid: false,
        })
    }

    /// Limits what the guest sends (`tx`) and receives (`rx`) per second.
    pub fn with_limiters(mut self, tx: Option<RateLimiter>, rx: Option<RateLimiter>) -> Self {
        self.tx_limiter = tx;
        self.rx_limiter = rx;
        self
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
                let whole = gather(&mem, &descriptors, &mut frame);
                if let Some(limiter) = self.tx_limiter.as_mut() {
                    if !limiter.consume(frame.len() as u64) {
                        // The frame waits in the queue for the timer.
                        active.queues[TX].go_to_previous_position();
                        break;
                    }
                }
                if whole && frame.len() > VNET_HDR_LEN {
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
                if let (Some(limiter), Some(frame)) = (self.rx_limiter.as_mut(), &self.pending_rx) {
                    if !self.rx_paid {
                        if !limiter.consume(frame.len() as u64) {
                            // Stop reading the TAP (its queue holds the
                            // rest) until the timer fires.
                            starved = true;
                            break;
                        }
                        self.rx_paid = true;
                    }
                }
                let Some((head, descriptors)) = pop_chain(&mut active.queues[RX], &mem)? else {
                    starved = true;
                    break;
                };
                let frame = self.pending_rx.take().unwrap_or_default();
                self.rx_paid = false;
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
pub fn gather(
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
pub fn scatter(
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
        self.rx_paid = false;
    }

    fn queue_states(&self) -> Vec<virtio_queue::QueueState> {
        crate::devices::virtio::active_queue_states(self.active.as_ref())
    }
}

impl MutEventSubscriber for NetDevice {
    fn init(&mut self, ops: &mut EventOps) {
        watch_queues(&self.queue_evts, ops, "virtio-net");
        for (limiter, token) in [
            (&self.tx_limiter, TOKEN_TX_LIMIT),
            (&self.rx_limiter, TOKEN_RX_LIMIT),
        ] {
            if let Some(l) = limiter {
                if let Err(e) = ops.add(Events::with_data(l, token, EventSet::IN)) {
                    tracing::error!("virtio-net: cannot watch a rate limiter: {e:?}");
                }
            }
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        match events.data() {
            TOKEN_TX_LIMIT => self.tx_limiter.as_mut().map_or((), RateLimiter::on_timer),
            TOKEN_RX_LIMIT => self.rx_limiter.as_mut().map_or((), RateLimiter::on_timer),
            i => {
                if let Some(evt) = self.queue_evts.get(i as usize) {
                    let _ = evt.read();
                }
            }
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
