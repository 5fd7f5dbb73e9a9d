//! virtio 1.x devices over the MMIO transport.
//!
//! [`mmio::MmioTransport`] decodes registers and runs the device status state
//! machine; each device implements [`VirtioDevice`] and does its queue work in
//! the VMM's event loop (it is also an event-manager subscriber). Queue
//! notifications arrive through ioeventfds, interrupts leave through irqfds.

pub mod balloon;
pub mod block;
pub mod fs;
pub mod mmio;
pub mod net;
pub mod queue;
pub mod vsock;

use std::sync::atomic::{AtomicU32, Ordering};

use crate::vstate::memory::GuestMemoryMmap;
use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

/// VIRTIO_F_VERSION_1: a modern (1.x) device. husk offers only modern devices.
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
/// Device ids (virtio 1.2, section 5).
pub const TYPE_NET: u32 = 1;
pub const TYPE_BLOCK: u32 = 2;
pub const TYPE_BALLOON: u32 = 5;
pub const TYPE_VSOCK: u32 = 19;
pub const TYPE_FS: u32 = 26;
/// Interrupt status bits (4.2.2): a used buffer, a configuration change.
pub const INT_VRING: u32 = 1;
pub const INT_CONFIG: u32 = 2;

/// The interrupt line of one device: the status bits the driver reads and
/// acknowledges, and the irqfd that raises the line.
#[derive(Debug)]
pub struct VirtioInterrupt {
    status: AtomicU32,
    irqfd: EventFd,
    /// Set by the device when the driver broke it (DEVICE_NEEDS_RESET).
    needs_reset: std::sync::atomic::AtomicBool,
}

impl VirtioInterrupt {
    pub fn new(irqfd: EventFd) -> Self {
        VirtioInterrupt {
            status: AtomicU32::new(0),
            irqfd,
            needs_reset: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Sets `bits` in the interrupt status and raises the line.
    pub fn trigger(&self, bits: u32) {
        self.status.fetch_or(bits, Ordering::SeqCst);
        if let Err(e) = self.irqfd.write(1) {
            tracing::error!("cannot raise a virtio interrupt: {e}");
        }
    }

    /// The device gave up on the driver: the transport reports
    /// DEVICE_NEEDS_RESET and the driver is told by a config interrupt (2.1.2).
    pub fn fail_device(&self) {
        self.needs_reset.store(true, Ordering::SeqCst);
        self.trigger(INT_CONFIG);
    }

    /// Whether the device asked for a reset.
    pub fn device_failed(&self) -> bool {
        self.needs_reset.load(Ordering::SeqCst)
    }

    /// Clears the device's reset request (the driver reset the device).
    pub fn clear_failure(&self) {
        self.needs_reset.store(false, Ordering::SeqCst);
    }

    /// The interrupt status register.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// Sets the status bits without raising the line (restore: the line's
    /// state is part of the interrupt controller's).
    pub fn set_status(&self, bits: u32) {
        self.status.fetch_or(bits, Ordering::SeqCst);
    }

    /// The driver acknowledged `bits`.
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// The irqfd, for registration with KVM.
    pub fn irqfd(&self) -> &EventFd {
        &self.irqfd
    }
}

/// What a device gets when the driver sets DRIVER_OK.
#[derive(Debug)]
pub struct ActiveQueues {
    pub mem: GuestMemoryMmap,
    pub queues: Vec<Queue>,
    pub interrupt: std::sync::Arc<VirtioInterrupt>,
    /// Features both sides agreed on.
    pub features: u64,
}

impl ActiveQueues {
    /// Checks the driver set up exactly the `expected` queues.
    pub fn expect_queues(&self, expected: usize) -> Result<(), ActivateError> {
        match self.queues.len() {
            n if n == expected => Ok(()),
            found => Err(ActivateError::QueueCount { expected, found }),
        }
    }
}

/// Watches each queue eventfd in the event loop, with the queue index as
/// the event data.
pub fn watch_queues(evts: &[EventFd], ops: &mut event_manager::EventOps, device: &str) {
    for (i, evt) in evts.iter().enumerate() {
        let events = event_manager::Events::with_data(evt, i as u32, event_manager::EventSet::IN);
        if let Err(e) = ops.add(events) {
            tracing::error!("{device}: cannot watch queue {i}: {e:?}");
        }
    }
}

/// Why a device refused to start.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("the driver set up {found} queues, the device needs {expected}")]
    QueueCount { expected: usize, found: usize },
    #[error("the device cannot start: {0}")]
    Backend(String),
}

/// A virtio device behind a transport.
pub trait VirtioDevice: Send {
    /// Device id (virtio 1.2, section 5).
    fn device_type(&self) -> u32;
    /// The largest size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Feature bits the device offers.
    fn features(&self) -> u64;
    /// Reads device configuration space at `offset`.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes device configuration space at `offset`.
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// One eventfd per queue, signalled when the driver notifies the queue
    /// (registered with KVM as ioeventfds on the notify register).
    fn queue_events(&self) -> &[EventFd];
    /// Starts the device with the queues the driver set up.
    fn activate(&mut self, active: ActiveQueues) -> Result<(), ActivateError>;
    /// Stops the device and forgets its queues (the driver wrote status 0).
    fn reset(&mut self);
    /// The device's own copies of its queues while active, with their ring
    /// positions (for snapshots); empty when not active.
    fn queue_states(&self) -> Vec<virtio_queue::QueueState>;
    /// A restored device was activated with its saved queues: tell the
    /// driver whatever it must know (vsock: its connections are gone).
    fn restored(&mut self) {}
}

/// The saved queue states of `active`, if any.
pub fn active_queue_states(active: Option<&ActiveQueues>) -> Vec<virtio_queue::QueueState> {
    active.map_or_else(Vec::new, |a| a.queues.iter().map(|q| q.state()).collect())
}

/// Copies `config[offset..]` into `data`; bytes beyond the config read as 0.
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Ok(offset) = usize::try_from(offset) else {
        return;
    };
    if let Some(src) = config.get(offset..) {
        let n = src.len().min(data.len());
        data[..n].copy_from_slice(&src[..n]);
    }
}
