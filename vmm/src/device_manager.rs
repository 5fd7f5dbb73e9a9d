//! Placement of MMIO devices: each virtio device gets a 4 KiB window in the
//! MMIO gap, an interrupt line (GSI 5 upwards) served by an irqfd, an
//! ioeventfd per queue on its notify register, and a
//! `virtio_mmio.device=` entry on the kernel command line.

use std::sync::{Arc, Mutex};

use crate::vstate::memory::GuestMemoryMmap;
use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use kvm_ioctls::{IoEventAddress, VmFd};
use linux_loader::cmdline::Cmdline;
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::EventFd;

use crate::arch::x86_64::layout::{IRQ_MAX, VIRTIO_MMIO_START};
use crate::devices::bus::{Bus, BusError};
use crate::devices::virtio::balloon::BalloonDevice;
use crate::devices::virtio::block::BlockDevice;
use crate::devices::virtio::fs::FsDevice;
use crate::devices::virtio::mmio::{MmioTransport, TransportArgs, TransportSnapshot, MMIO_LEN};
use crate::devices::virtio::net::NetDevice;
use crate::devices::virtio::vsock::VsockDevice;
use crate::devices::virtio::{VirtioDevice, VirtioInterrupt};
use husk_snapshot::Persist;

/// First GSI for virtio devices: 0-4 are the PIT, keyboard, cascade and COMs.
const FIRST_VIRTIO_IRQ: u32 = 5;
/// Offset of the queue notify register in a virtio-mmio window.
const NOTIFY_OFFSET: u64 = 0x50;

/// The VMM's event loop, shared by every device.
pub type EventLoop = EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>>;

/// Errors attaching a device.
#[derive(Debug, thiserror::Error)]
pub enum DeviceManagerError {
    #[error("no interrupt lines left for another virtio device (at most {} devices)", IRQ_MAX as u32 - FIRST_VIRTIO_IRQ + 1)]
    NoIrq,
    #[error("cannot create an eventfd: {0}")]
    EventFd(#[source] std::io::Error),
    #[error("cannot register an irqfd or ioeventfd with KVM: {0}")]
    Kvm(kvm_ioctls::Error),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("the saved device does not restore: {0}")]
    Restore(String),
    #[error("the kernel command line has no room for another device: {0}")]
    Cmdline(linux_loader::cmdline::Error),
}

/// A virtio device of each kind husk has: what snapshots save, by kind,
/// without downcasting.
#[derive(Debug, Clone)]
pub enum DeviceHandle {
    Block(Arc<Mutex<BlockDevice>>),
    Net(Arc<Mutex<NetDevice>>),
    Vsock(Arc<Mutex<VsockDevice>>),
    Fs(Arc<Mutex<FsDevice>>),
    Balloon(Arc<Mutex<BalloonDevice>>),
}

impl DeviceHandle {
    fn virtio(&self) -> Arc<Mutex<dyn VirtioDevice>> {
        match self {
            DeviceHandle::Block(d) => d.clone(),
            DeviceHandle::Net(d) => d.clone(),
            DeviceHandle::Vsock(d) => d.clone(),
            DeviceHandle::Fs(d) => d.clone(),
            DeviceHandle::Balloon(d) => d.clone(),
        }
    }

    fn subscriber(&self) -> Arc<Mutex<dyn MutEventSubscriber + Send>> {
        match self {
            DeviceHandle::Block(d) => d.clone(),
            DeviceHandle::Net(d) => d.clone(),
            DeviceHandle::Vsock(d) => d.clone(),
            DeviceHandle::Fs(d) => d.clone(),
            DeviceHandle::Balloon(d) => d.clone(),
        }
    }
}

/// One attached virtio device and its transport.
#[derive(Debug)]
pub struct AttachedDevice {
    pub device: DeviceHandle,
    pub transport: Arc<Mutex<MmioTransport>>,
}

/// Hands out MMIO windows and interrupt lines, in order.
#[derive(Debug, Default)]
pub struct MmioDeviceManager {
    pub bus: Bus,
    pub devices: Vec<AttachedDevice>,
    next_index: u32,
}

impl MmioDeviceManager {
    pub fn new() -> Self {
        Self::default()
    }

    /// Attaches a virtio device: MMIO window, irqfd, ioeventfds, event-loop
    /// subscription and command-line entry (none on restore: the guest
    /// found its devices when it booted). Slots are handed out in order, so
    /// a restore that attaches the same devices in the same order gives
    /// each the window and interrupt the guest knows; its transport is
    /// rebuilt from `restore`, the saved transport state. Returns the
    /// transport.
    pub fn attach_virtio(
        &mut self,
        (vm, mem, events): (&VmFd, &GuestMemoryMmap, &mut EventLoop),
        cmdline: Option<&mut Cmdline>,
        handle: DeviceHandle,
        restore: Option<&TransportSnapshot>,
    ) -> Result<Arc<Mutex<MmioTransport>>, DeviceManagerError> {
        let device = handle.virtio();
        let irq = FIRST_VIRTIO_IRQ + self.next_index;
        if irq > u32::from(IRQ_MAX) {
            return Err(DeviceManagerError::NoIrq);
        }
        let base = VIRTIO_MMIO_START + u64::from(self.next_index) * MMIO_LEN;
        let irqfd = EventFd::new(libc::EFD_NONBLOCK).map_err(DeviceManagerError::EventFd)?;
        vm.register_irqfd(&irqfd, irq)
            .map_err(DeviceManagerError::Kvm)?;
        let mut queue_evts = Vec::new();
        {
            let dev = device.lock().unwrap_or_else(|e| e.into_inner());
            for (i, evt) in dev.queue_events().iter().enumerate() {
                let notify = IoEventAddress::Mmio(base + NOTIFY_OFFSET);
                vm.register_ioevent(evt, &notify, i as u32)
                    .map_err(DeviceManagerError::Kvm)?;
                queue_evts.push(evt.try_clone().map_err(DeviceManagerError::EventFd)?);
            }
        }
        let interrupt = Arc::new(VirtioInterrupt::new(irqfd));
        let transport = match restore {
            None => MmioTransport::new(device.clone(), mem.clone(), interrupt, queue_evts),
            Some(state) => {
                let args = TransportArgs {
                    device: device.clone(),
                    mem: mem.clone(),
                    interrupt,
                    queue_evts,
                };
                MmioTransport::restore(args, state).map_err(DeviceManagerError::Restore)?
            }
        };
        let transport = Arc::new(Mutex::new(transport));
        self.bus.insert(base, MMIO_LEN, transport.clone())?;
        events.add_subscriber(handle.subscriber());
        if let Some(cmdline) = cmdline {
            cmdline
                .add_virtio_mmio_device(MMIO_LEN, GuestAddress(base), irq, None)
                .map_err(DeviceManagerError::Cmdline)?;
        }
        self.next_index += 1;
        self.devices.push(AttachedDevice {
            device: handle,
            transport: transport.clone(),
        });
        Ok(transport)
    }
}
