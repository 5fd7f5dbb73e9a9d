//! The virtio-mmio transport (virtio 1.2, section 4.2): register decoding and
//! the device status state machine. Device logic lives in the devices.
//!
//! A driver that misbehaves (bad register width, queue setup at the wrong
//! time, an invalid queue, features the device never offered) gets a warning
//! and, where the spec says so, a failed device: never a VMM panic.

use std::sync::{Arc, Mutex};

use crate::vstate::memory::GuestMemoryMmap;
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::GuestAddress;

use super::{ActiveQueues, VirtioDevice, VirtioInterrupt, VIRTIO_F_VERSION_1};
use crate::devices::bus::BusDevice;
use husk_snapshot::Persist;

/// "virt" in little endian.
const MAGIC: u32 = 0x7472_6976;
/// Version 2: the modern (non-legacy) interface.
const VERSION: u32 = 2;
/// Reported vendor id.
const VENDOR: u32 = 0x4b53_5548; // "HUSK"
/// Size of one device's MMIO window.
pub const MMIO_LEN: u64 = 0x1000;

// Register offsets, section 4.2.2.
const REG_MAGIC: u64 = 0x000;
const REG_VERSION: u64 = 0x004;
const REG_DEVICE_ID: u64 = 0x008;
const REG_VENDOR_ID: u64 = 0x00c;
const REG_DEVICE_FEATURES: u64 = 0x010;
const REG_DEVICE_FEATURES_SEL: u64 = 0x014;
const REG_DRIVER_FEATURES: u64 = 0x020;
const REG_DRIVER_FEATURES_SEL: u64 = 0x024;
const REG_QUEUE_SEL: u64 = 0x030;
const REG_QUEUE_NUM_MAX: u64 = 0x034;
const REG_QUEUE_NUM: u64 = 0x038;
const REG_QUEUE_READY: u64 = 0x044;
const REG_QUEUE_NOTIFY: u64 = 0x050;
const REG_INTERRUPT_STATUS: u64 = 0x060;
const REG_INTERRUPT_ACK: u64 = 0x064;
const REG_STATUS: u64 = 0x070;
const REG_QUEUE_DESC_LOW: u64 = 0x080;
const REG_QUEUE_DESC_HIGH: u64 = 0x084;
const REG_QUEUE_DRIVER_LOW: u64 = 0x090;
const REG_QUEUE_DRIVER_HIGH: u64 = 0x094;
const REG_QUEUE_DEVICE_LOW: u64 = 0x0a0;
const REG_QUEUE_DEVICE_HIGH: u64 = 0x0a4;
const REG_CONFIG_GENERATION: u64 = 0x0fc;
const CONFIG_SPACE: u64 = 0x100;

// Device status bits, section 2.1.
pub const STATUS_ACKNOWLEDGE: u32 = 1;
pub const STATUS_DRIVER: u32 = 2;
pub const STATUS_DRIVER_OK: u32 = 4;
pub const STATUS_FEATURES_OK: u32 = 8;
pub const STATUS_DEVICE_NEEDS_RESET: u32 = 64;
pub const STATUS_FAILED: u32 = 128;

/// One virtio device on the MMIO bus.
pub struct MmioTransport {
    device: Arc<Mutex<dyn VirtioDevice>>,
    mem: GuestMemoryMmap,
    interrupt: Arc<VirtioInterrupt>,
    queues: Vec<Queue>,
    /// Kicks a queue when a notify write reaches us instead of its ioeventfd.
    queue_evts: Vec<vmm_sys_util::eventfd::EventFd>,
    queue_select: u32,
    device_features_select: u32,
    driver_features_select: u32,
    driver_features: u64,
    status: u32,
    config_generation: u32,
}

impl std::fmt::Debug for MmioTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MmioTransport")
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}

impl MmioTransport {
    /// A transport for `device`, whose queue `i` is notified through
    /// `queue_evts[i]` (also registered with KVM as an ioeventfd).
    pub fn new(
        device: Arc<Mutex<dyn VirtioDevice>>,
        mem: GuestMemoryMmap,
        interrupt: Arc<VirtioInterrupt>,
        queue_evts: Vec<vmm_sys_util::eventfd::EventFd>,
    ) -> Self {
        let queues = lock(&device)
            .queue_max_sizes()
            .iter()
            .map(|&max| Queue::new(max).unwrap_or_else(|_| Queue::new(1).expect("size 1 is valid")))
            .collect();
        MmioTransport {
            device,
            mem,
            interrupt,
            queues,
            queue_evts,
            queue_select: 0,
            device_features_select: 0,
            driver_features_select: 0,
            driver_features: 0,
            status: 0,
            config_generation: 0,
        }
    }

    /// The device status register.
    pub fn status(&self) -> u32 {
        self.status
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_select as usize)
    }

    /// Queue registers are writable only between FEATURES_OK and DRIVER_OK
    /// (4.2.3.2).
    fn queue_setup_allowed(&self) -> bool {
        self.status & (STATUS_FEATURES_OK | STATUS_DRIVER_OK | STATUS_FAILED) == STATUS_FEATURES_OK
    }

    fn read_register(&self, offset: u64) -> u32 {
        let device = lock(&self.device);
        match offset {
            REG_MAGIC => MAGIC,
            REG_VERSION => VERSION,
            REG_DEVICE_ID => device.device_type(),
            REG_VENDOR_ID => VENDOR,
            REG_DEVICE_FEATURES => match self.device_features_select {
                0 => device.features() as u32,
                1 => (device.features() >> 32) as u32,
                _ => 0,
            },
            REG_QUEUE_NUM_MAX => self
                .queues
                .get(self.queue_select as usize)
                .map_or(0, |q| u32::from(q.max_size())),
            REG_QUEUE_READY => self
                .queues
                .get(self.queue_select as usize)
                .map_or(0, |q| u32::from(q.ready())),
            REG_INTERRUPT_STATUS => self.interrupt.status(),
            REG_STATUS if self.interrupt.device_failed() => self.status | STATUS_DEVICE_NEEDS_RESET,
            REG_STATUS => self.status,
            REG_CONFIG_GENERATION => self.config_generation,
            _ => {
                tracing::warn!("virtio-mmio: read of unknown register {offset:#x}");
                0
            }
        }
    }

    fn write_register(&mut self, offset: u64, value: u32) {
        match offset {
            REG_DEVICE_FEATURES_SEL => self.device_features_select = value,
            REG_DRIVER_FEATURES_SEL => self.driver_features_select = value,
            REG_DRIVER_FEATURES => self.write_driver_features(value),
            REG_QUEUE_SEL => self.queue_select = value,
            REG_QUEUE_NOTIFY => self.notify(value),
            REG_INTERRUPT_ACK => self.interrupt.ack(value),
            REG_STATUS => self.write_status(value),
            REG_QUEUE_NUM
            | REG_QUEUE_READY
            | REG_QUEUE_DESC_LOW
            | REG_QUEUE_DESC_HIGH
            | REG_QUEUE_DRIVER_LOW
            | REG_QUEUE_DRIVER_HIGH
            | REG_QUEUE_DEVICE_LOW
            | REG_QUEUE_DEVICE_HIGH => self.write_queue_register(offset, value),
            _ => tracing::warn!("virtio-mmio: write of unknown register {offset:#x}"),
        }
    }

    fn write_driver_features(&mut self, value: u32) {
        // Features may be written after DRIVER and before FEATURES_OK (3.1.1).
        if self.status & (STATUS_DRIVER | STATUS_FEATURES_OK) != STATUS_DRIVER {
            tracing::warn!(
                "virtio-mmio: driver features written in status {:#x}",
                self.status
            );
            return;
        }
        match self.driver_features_select {
            0 => self.driver_features = (self.driver_features & !0xffff_ffff) | u64::from(value),
            1 => {
                self.driver_features =
                    (self.driver_features & 0xffff_ffff) | (u64::from(value) << 32)
            }
            sel => tracing::warn!("virtio-mmio: driver features select {sel} is out of range"),
        }
    }

    fn write_queue_register(&mut self, offset: u64, value: u32) {
        if !self.queue_setup_allowed() {
            tracing::warn!(
                "virtio-mmio: queue register {offset:#x} written in status {:#x}",
                self.status
            );
            return;
        }
        let Some(queue) = self.selected_queue() else {
            tracing::warn!(
                "virtio-mmio: queue register {offset:#x} written for a queue that does not exist"
            );
            return;
        };
        let result = match offset {
            REG_QUEUE_NUM => queue
                .try_set_size(value.try_into().unwrap_or(0))
                .map_err(|e| format!("queue size {value}: {e:?}")),
            REG_QUEUE_READY => {
                queue.set_ready(value == 1);
                Ok(())
            }
            REG_QUEUE_DESC_LOW => set_address(queue, Ring::Desc, Some(value), None),
            REG_QUEUE_DESC_HIGH => set_address(queue, Ring::Desc, None, Some(value)),
            REG_QUEUE_DRIVER_LOW => set_address(queue, Ring::Avail, Some(value), None),
            REG_QUEUE_DRIVER_HIGH => set_address(queue, Ring::Avail, None, Some(value)),
            REG_QUEUE_DEVICE_LOW => set_address(queue, Ring::Used, Some(value), None),
            REG_QUEUE_DEVICE_HIGH => set_address(queue, Ring::Used, None, Some(value)),
            _ => Ok(()),
        };
        if let Err(e) = result {
            tracing::warn!("virtio-mmio: invalid {e}; failing the device");
            self.fail();
        }
    }

    fn notify(&mut self, queue: u32) {
        if let Some(evt) = self.queue_evts.get(queue as usize) {
            let _ = evt.write(1);
        }
    }

    fn write_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        // The driver may only add bits (3.1.1), except by resetting.
        if value & self.status != self.status {
            tracing::warn!(
                "virtio-mmio: status {:#x} -> {value:#x} clears bits",
                self.status
            );
            return;
        }
        let added = value & !self.status;
        if added & STATUS_FEATURES_OK != 0 && !self.features_acceptable() {
            // Leave FEATURES_OK clear: the driver reads it back and gives up.
            self.status = value & !STATUS_FEATURES_OK;
            return;
        }
        if added & STATUS_DRIVER_OK != 0 {
            self.status = value;
            self.activate();
            return;
        }
        self.status = value;
    }

    fn features_acceptable(&self) -> bool {
        let offered = lock(&self.device).features();
        let extra = self.driver_features & !offered;
        if extra != 0 {
            tracing::warn!(
                "virtio-mmio: driver accepted features {extra:#x} that were not offered"
            );
            return false;
        }
        if self.driver_features & VIRTIO_F_VERSION_1 == 0 {
            tracing::warn!("virtio-mmio: driver did not accept VIRTIO_F_VERSION_1 (legacy drivers are not supported)");
            return false;
        }
        true
    }

    fn activate(&mut self) {
        if self.status & STATUS_FEATURES_OK == 0 {
            tracing::warn!("virtio-mmio: DRIVER_OK without FEATURES_OK");
            self.fail();
            return;
        }
        for (i, q) in self.queues.iter().enumerate() {
            if !q.is_valid(&self.mem) {
                tracing::warn!("virtio-mmio: queue {i} is not ready or not inside guest memory");
                self.fail();
                return;
            }
        }
        let event_idx = self.driver_features
            & (1 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX)
            != 0;
        let mut queues = Vec::with_capacity(self.queues.len());
        for q in &self.queues {
            // The device gets its own copy; the transport keeps the
            // driver-visible registers.
            match Queue::try_from(q.state()) {
                Ok(mut queue) => {
                    queue.set_event_idx(event_idx);
                    queues.push(queue);
                }
                Err(e) => {
                    tracing::warn!("virtio-mmio: invalid queue: {e:?}");
                    self.fail();
                    return;
                }
            }
        }
        let active = ActiveQueues {
            mem: self.mem.clone(),
            queues,
            interrupt: self.interrupt.clone(),
            features: self.driver_features,
        };
        let result = lock(&self.device).activate(active);
        if let Err(e) = result {
            tracing::warn!("virtio-mmio: device activation failed: {e}");
            self.fail();
        }
    }

    /// The device's configuration space changed (a drive took a new
    /// medium): a new generation, and a configuration change interrupt
    /// (4.2.2.1) so the driver reads it again.
    pub fn config_changed(&mut self) {
        self.config_generation = self.config_generation.wrapping_add(1);
        self.interrupt.trigger(super::INT_CONFIG);
    }

    /// Marks the device as needing a reset and tells the driver (2.1.2).
    fn fail(&mut self) {
        self.status |= STATUS_DEVICE_NEEDS_RESET;
        self.interrupt.trigger(super::INT_CONFIG);
    }

    fn reset(&mut self) {
        lock(&self.device).reset();
        for q in &mut self.queues {
            q.reset();
        }
        self.status = 0;
        self.driver_features = 0;
        self.queue_select = 0;
        self.device_features_select = 0;
        self.driver_features_select = 0;
        self.interrupt.ack(u32::MAX);
        self.interrupt.clear_failure();
    }
}

/// One queue's registers and ring positions, for snapshots: virtio-queue's
/// `QueueState`, serialized through [`QueueStateDef`]. Untrusted on
/// restore, like any `QueueState` (`Queue::try_from` checks it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QueueSnapshot(#[serde(with = "QueueStateDef")] pub QueueState);

/// `QueueState`'s fields for serde (the type is not serializable itself).
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(remote = "QueueState")]
struct QueueStateDef {
    max_size: u16,
    size: u16,
    ready: bool,
    desc_table: u64,
    avail_ring: u64,
    used_ring: u64,
    next_avail: u16,
    next_used: u16,
    event_idx_enabled: bool,
}

/// A transport's registers, and the device's queues if it is running.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TransportSnapshot {
    pub status: u32,
    pub driver_features: u64,
    pub queue_select: u32,
    pub device_features_select: u32,
    pub driver_features_select: u32,
    pub config_generation: u32,
    pub interrupt_status: u32,
    pub device_failed: bool,
    /// The driver-visible queue registers.
    pub queues: Vec<QueueSnapshot>,
    /// The device's working copies (with ring positions) after DRIVER_OK.
    pub active_queues: Vec<QueueSnapshot>,
}

/// What a restored transport is built from besides its state: the same
/// parts as [`MmioTransport::new`].
#[allow(missing_debug_implementations)]
pub struct TransportArgs {
    pub device: Arc<Mutex<dyn VirtioDevice>>,
    pub mem: GuestMemoryMmap,
    pub interrupt: Arc<VirtioInterrupt>,
    pub queue_evts: Vec<vmm_sys_util::eventfd::EventFd>,
}

impl Persist for MmioTransport {
    type State = TransportSnapshot;
    type ConstructorArgs = TransportArgs;
    type Error = String;

    /// Saves the transport; the device must be quiet (the VMM's event loop
    /// is not running it).
    fn save(&self) -> TransportSnapshot {
        TransportSnapshot {
            status: self.status,
            driver_features: self.driver_features,
            queue_select: self.queue_select,
            device_features_select: self.device_features_select,
            driver_features_select: self.driver_features_select,
            config_generation: self.config_generation,
            interrupt_status: self.interrupt.status(),
            device_failed: self.interrupt.device_failed(),
            queues: self
                .queues
                .iter()
                .map(|q| QueueSnapshot(q.state()))
                .collect(),
            active_queues: lock(&self.device)
                .queue_states()
                .into_iter()
                .map(QueueSnapshot)
                .collect(),
        }
    }

    /// A transport for a new device in the saved state; a running device
    /// is activated with its saved queues.
    fn restore(args: TransportArgs, state: &TransportSnapshot) -> Result<Self, String> {
        let mut transport =
            MmioTransport::new(args.device, args.mem, args.interrupt, args.queue_evts);
        transport.load(state)?;
        Ok(transport)
    }
}

impl MmioTransport {
    /// Puts a new transport (and its device) in the saved state. Every
    /// queue is checked against guest memory as if the driver had just set
    /// it up: a snapshot cannot point a device outside the guest.
    fn load(&mut self, s: &TransportSnapshot) -> Result<(), String> {
        if s.queues.len() != self.queues.len() {
            return Err(format!(
                "the device has {} queues, the snapshot {}",
                self.queues.len(),
                s.queues.len()
            ));
        }
        let to_queue =
            |q: &QueueSnapshot| Queue::try_from(q.0).map_err(|e| format!("invalid queue: {e:?}"));
        let queues = s
            .queues
            .iter()
            .map(to_queue)
            .collect::<Result<Vec<_>, _>>()?;
        let running = s.status & STATUS_DRIVER_OK != 0 && !s.device_failed;
        let active = s
            .active_queues
            .iter()
            .map(to_queue)
            .collect::<Result<Vec<_>, _>>()?;
        if running {
            if active.len() != queues.len() {
                return Err("a running device without its queues".into());
            }
            if let Some(i) = active.iter().position(|q| !q.is_valid(&self.mem)) {
                return Err(format!("queue {i} is not inside guest memory"));
            }
        }
        self.queues = queues;
        self.status = s.status;
        self.driver_features = s.driver_features;
        self.queue_select = s.queue_select;
        self.device_features_select = s.device_features_select;
        self.driver_features_select = s.driver_features_select;
        self.config_generation = s.config_generation;
        self.interrupt.ack(u32::MAX);
        self.interrupt.set_status(s.interrupt_status);
        if s.device_failed {
            self.interrupt.fail_device();
        }
        if running {
            let active = ActiveQueues {
                mem: self.mem.clone(),
                queues: active,
                interrupt: self.interrupt.clone(),
                features: self.driver_features,
            };
            lock(&self.device)
                .activate(active)
                .map_err(|e| format!("the device refused its saved queues: {e}"))?;
        }
        Ok(())
    }

    /// Tells a restored, running device that the guest is about to run
    /// again. Called once the vCPUs exist: an interrupt raised before
    /// their local APICs are restored would be lost.
    pub fn restored(&self) {
        if self.status & STATUS_DRIVER_OK != 0 && !self.interrupt.device_failed() {
            lock(&self.device).restored();
        }
    }
}

enum Ring {
    Desc,
    Avail,
    Used,
}

fn set_address(
    queue: &mut Queue,
    ring: Ring,
    low: Option<u32>,
    high: Option<u32>,
) -> Result<(), String> {
    let current = match ring {
        Ring::Desc => queue.desc_table(),
        Ring::Avail => queue.avail_ring(),
        Ring::Used => queue.used_ring(),
    };
    let low = u64::from(low.unwrap_or(current as u32));
    let high = u64::from(high.unwrap_or((current >> 32) as u32));
    let addr = GuestAddress((high << 32) | low);
    let result = match ring {
        Ring::Desc => queue.try_set_desc_table_address(addr),
        Ring::Avail => queue.try_set_avail_ring_address(addr),
        Ring::Used => queue.try_set_used_ring_address(addr),
    };
    result.map_err(|e| format!("ring address {:#x}: {e:?}", addr.0))
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_SPACE {
            lock(&self.device).read_config(offset - CONFIG_SPACE, data);
            return;
        }
        // Registers are 32 bits wide and aligned (4.2.2.2).
        if data.len() != 4 || offset % 4 != 0 {
            tracing::warn!("virtio-mmio: {}-byte read at {offset:#x}", data.len());
            return;
        }
        data.copy_from_slice(&self.read_register(offset).to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_SPACE {
            lock(&self.device).write_config(offset - CONFIG_SPACE, data);
            self.config_generation = self.config_generation.wrapping_add(1);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            tracing::warn!("virtio-mmio: {}-byte write at {offset:#x}", data.len());
            return;
        };
        if offset % 4 != 0 {
            tracing::warn!("virtio-mmio: unaligned write at {offset:#x}");
            return;
        }
        self.write_register(offset, u32::from_le_bytes(bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::{ActivateError, ActiveQueues, INT_CONFIG};
    use vmm_sys_util::eventfd::EventFd;

    #[derive(Default)]
    struct FakeDevice {
        activated: Option<usize>,
        resets: u32,
        evts: Vec<EventFd>,
        queues: Vec<virtio_queue::QueueState>,
    }

    impl VirtioDevice for FakeDevice {
        fn device_type(&self) -> u32 {
            42
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16, 16]
        }
        fn features(&self) -> u64 {
            VIRTIO_F_VERSION_1 | 1
        }
        fn queue_events(&self) -> &[EventFd] {
            &self.evts
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
        fn activate(&mut self, active: ActiveQueues) -> Result<(), ActivateError> {
            self.activated = Some(active.queues.len());
            self.queues = active.queues.iter().map(|q| q.state()).collect();
            Ok(())
        }
        fn reset(&mut self) {
            self.activated = None;
            self.resets += 1;
        }
        fn queue_states(&self) -> Vec<virtio_queue::QueueState> {
            self.queues.clone()
        }
    }

    /// What a transport over a new fake device in 1 MiB of memory is made of.
    fn parts() -> (TransportArgs, Arc<Mutex<FakeDevice>>) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("memory");
        let device = Arc::new(Mutex::new(FakeDevice::default()));
        let interrupt = Arc::new(VirtioInterrupt::new(EventFd::new(0).expect("eventfd")));
        let args = TransportArgs {
            device: device.clone(),
            mem,
            interrupt,
            queue_evts: vec![],
        };
        (args, device)
    }

    fn transport() -> (MmioTransport, Arc<Mutex<FakeDevice>>) {
        let (a, device) = parts();
        (
            MmioTransport::new(a.device, a.mem, a.interrupt, a.queue_evts),
            device,
        )
    }

    fn read(t: &mut MmioTransport, offset: u64) -> u32 {
        let mut data = [0u8; 4];
        t.read(offset, &mut data);
        u32::from_le_bytes(data)
    }

    fn write(t: &mut MmioTransport, offset: u64, value: u32) {
        t.write(offset, &value.to_le_bytes());
    }

    /// Drives the status machine up to FEATURES_OK with `features`.
    fn negotiate(t: &mut MmioTransport, features: u64) {
        write(t, REG_STATUS, STATUS_ACKNOWLEDGE);
        write(t, REG_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        write(t, REG_DRIVER_FEATURES_SEL, 0);
        write(t, REG_DRIVER_FEATURES, features as u32);
        write(t, REG_DRIVER_FEATURES_SEL, 1);
        write(t, REG_DRIVER_FEATURES, (features >> 32) as u32);
        write(
            t,
            REG_STATUS,
            STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK,
        );
    }

    /// Sets up queue `index` at `base` with `size` entries.
    fn setup_queue(t: &mut MmioTransport, index: u32, base: u64, size: u32) {
        write(t, REG_QUEUE_SEL, index);
        write(t, REG_QUEUE_NUM, size);
        write(t, REG_QUEUE_DESC_LOW, base as u32);
        write(t, REG_QUEUE_DESC_HIGH, (base >> 32) as u32);
        write(t, REG_QUEUE_DRIVER_LOW, (base + 0x1000) as u32);
        write(t, REG_QUEUE_DRIVER_HIGH, 0);
        write(t, REG_QUEUE_DEVICE_LOW, (base + 0x2000) as u32);
        write(t, REG_QUEUE_DEVICE_HIGH, 0);
        write(t, REG_QUEUE_READY, 1);
    }

    #[test]
    fn identification_registers() {
        let (mut t, _) = transport();

        assert_eq!(read(&mut t, REG_MAGIC), MAGIC);
        assert_eq!(read(&mut t, REG_VERSION), 2);
        assert_eq!(read(&mut t, REG_DEVICE_ID), 42);
        write(&mut t, REG_DEVICE_FEATURES_SEL, 1);
        assert_eq!(read(&mut t, REG_DEVICE_FEATURES), 1);
        write(&mut t, REG_QUEUE_SEL, 1);
        assert_eq!(read(&mut t, REG_QUEUE_NUM_MAX), 16);
        write(&mut t, REG_QUEUE_SEL, 7);
        assert_eq!(read(&mut t, REG_QUEUE_NUM_MAX), 0);
    }

    #[test]
    fn full_initialisation_activates_the_device() {
        let (mut t, device) = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        setup_queue(&mut t, 0, 0x10000, 16);
        setup_queue(&mut t, 1, 0x20000, 8);

        write(&mut t, REG_STATUS, 0xf);

        assert_eq!(t.status(), 0xf);
        assert_eq!(device.lock().expect("lock").activated, Some(2));
    }

    fn running_transport() -> (MmioTransport, Arc<Mutex<FakeDevice>>) {
        let (mut t, device) = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        setup_queue(&mut t, 0, 0x10000, 16);
        setup_queue(&mut t, 1, 0x20000, 8);
        write(&mut t, REG_STATUS, 0xf);
        (t, device)
    }

    #[test]
    fn a_saved_transport_restores_running_with_its_queues() {
        let (t, _) = running_transport();
        let saved = t.save();
        let (args, device) = parts();

        let fresh = MmioTransport::restore(args, &saved).expect("restore");

        assert_eq!(fresh.save(), saved);
        assert_eq!(device.lock().expect("lock").activated, Some(2));
        assert_eq!(fresh.status(), 0xf);
    }

    #[test]
    fn a_snapshot_cannot_point_a_queue_outside_guest_memory() {
        let (t, _) = running_transport();
        let mut saved = t.save();
        saved.active_queues[1].0.desc_table = 1 << 40;
        let (args, device) = parts();

        let err = MmioTransport::restore(args, &saved).expect_err("outside memory");

        assert!(err.contains("queue 1"), "{err}");
        assert_eq!(device.lock().expect("lock").activated, None);
    }

    #[test]
    fn a_snapshot_with_another_queue_count_is_refused() {
        let (t, _) = running_transport();
        let mut saved = t.save();
        saved.queues.pop();
        let (args, _) = parts();

        let err = MmioTransport::restore(args, &saved).expect_err("queue count");

        assert!(err.contains("2 queues"), "{err}");
    }

    #[test]
    fn features_never_offered_are_refused() {
        let (mut t, _) = transport();

        negotiate(&mut t, VIRTIO_F_VERSION_1 | (1 << 5));

        assert_eq!(t.status() & STATUS_FEATURES_OK, 0);
    }

    #[test]
    fn legacy_drivers_are_refused() {
        let (mut t, _) = transport();

        negotiate(&mut t, 1);

        assert_eq!(t.status() & STATUS_FEATURES_OK, 0);
    }

    #[test]
    fn queue_size_not_a_power_of_two_fails_the_device() {
        let (mut t, _) = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);

        write(&mut t, REG_QUEUE_NUM, 12);

        assert_ne!(t.status() & STATUS_DEVICE_NEEDS_RESET, 0);
        assert_ne!(t.interrupt.status() & INT_CONFIG, 0);
    }

    #[test]
    fn queue_setup_before_features_ok_is_ignored() {
        let (mut t, _) = transport();

        write(&mut t, REG_QUEUE_NUM, 8);
        write(&mut t, REG_QUEUE_READY, 1);

        assert_eq!(read(&mut t, REG_QUEUE_READY), 0);
    }

    #[test]
    fn queue_outside_guest_memory_is_not_activated() {
        let (mut t, device) = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        setup_queue(&mut t, 0, 0x10000, 16);
        setup_queue(&mut t, 1, 0xfff_0000, 16);

        write(&mut t, REG_STATUS, 0xf);

        assert_eq!(device.lock().expect("lock").activated, None);
        assert_ne!(t.status() & STATUS_DEVICE_NEEDS_RESET, 0);
    }

    #[test]
    fn driver_ok_with_an_unready_queue_is_not_activated() {
        let (mut t, device) = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        setup_queue(&mut t, 0, 0x10000, 16);

        write(&mut t, REG_STATUS, 0xf);

        assert_eq!(device.lock().expect("lock").activated, None);
    }

    #[test]
    fn writing_zero_resets() {
        let (mut t, device) = transport();
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        setup_queue(&mut t, 0, 0x10000, 16);

        write(&mut t, REG_STATUS, 0);

        assert_eq!(t.status(), 0);
        assert_eq!(read(&mut t, REG_QUEUE_READY), 0);
        assert_eq!(device.lock().expect("lock").resets, 1);
    }

    #[test]
    fn odd_width_and_unaligned_accesses_are_ignored() {
        let (mut t, _) = transport();
        let mut byte = [0xaau8; 1];

        t.read(REG_MAGIC, &mut byte);
        t.write(REG_STATUS, &[1]);
        t.write(REG_STATUS + 1, &1u32.to_le_bytes());

        assert_eq!(byte, [0xaa]);
        assert_eq!(t.status(), 0);
    }

    #[test]
    fn config_space_goes_to_the_device() {
        let (mut t, _) = transport();
        let mut data = [0u8; 2];

        t.read(CONFIG_SPACE + 3, &mut data);

        assert_eq!(data, [3, 3]);
    }

    /// What a transport over `device` in 1 MiB of memory is made of.
    fn args_for<D: VirtioDevice + 'static>(device: D) -> TransportArgs {
        TransportArgs {
            device: Arc::new(Mutex::new(device)),
            mem: GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).expect("memory"),
            interrupt: Arc::new(VirtioInterrupt::new(EventFd::new(0).expect("eventfd"))),
            queue_evts: vec![],
        }
    }

    /// A transport whose driver has set up every queue of `device` and
    /// started it.
    fn running<D: VirtioDevice + 'static>(device: D) -> MmioTransport {
        let queues = device.queue_max_sizes().len() as u32;
        let a = args_for(device);
        let mut t = MmioTransport::new(a.device, a.mem, a.interrupt, a.queue_evts);
        negotiate(&mut t, VIRTIO_F_VERSION_1);
        for q in 0..queues {
            setup_queue(&mut t, q, 0x10000 * u64::from(q + 1), 16);
        }
        write(&mut t, REG_STATUS, 0xf);
        assert_eq!(t.status(), 0xf, "the device started");
        t
    }

    fn block_device() -> crate::devices::virtio::block::BlockDevice {
        use crate::devices::virtio::block::{BlockDevice, Disk, DiskMode};
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let path = dir.as_path().join("disk");
        std::fs::write(&path, [0u8; 4096]).expect("image");
        let disk = Disk::open(&path, &DiskMode::ReadWrite).expect("disk");
        BlockDevice::new(disk, "disk", EventFd::new(0).expect("eventfd"))
    }

    /// A net device on a TAP of its own (needs CAP_NET_ADMIN, as the
    /// integration tests do).
    fn net_device() -> crate::devices::virtio::net::NetDevice {
        use crate::devices::virtio::net::{NetDevice, Tap};
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tap = Tap::open(&format!("hkp{}x{n}", std::process::id())).expect("TAP");
        NetDevice::new(tap, [6, 0, 0, 0, 0, 1]).expect("net device")
    }

    fn vsock_device() -> crate::devices::virtio::vsock::VsockDevice {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let uds = dir.as_path().join("v.sock");
        let device = crate::devices::virtio::vsock::VsockDevice::new(3, &uds).expect("vsock");
        // The device keeps its listening socket; the path may go.
        drop(dir);
        device
    }

    crate::persist::persist_conformance!(
        block_transport_survives_a_snapshot,
        running(block_device()),
        args_for(block_device())
    );
    crate::persist::persist_conformance!(
        net_transport_survives_a_snapshot,
        running(net_device()),
        args_for(net_device())
    );
    crate::persist::persist_conformance!(
        vsock_transport_survives_a_snapshot,
        running(vsock_device()),
        args_for(vsock_device())
    );

    /// Saved states with bytes flipped at random (a deterministic
    /// xorshift), restored over fresh devices and told they were restored:
    /// each is refused or restored, and nothing panics.
    #[test]
    fn corrupted_saved_states_are_refused_or_restored_never_a_panic() {
        type NewArgs = fn() -> TransportArgs;
        let saved: [(Vec<u8>, NewArgs); 2] = [
            (
                postcard::to_stdvec(&running(block_device()).save()).expect("encode"),
                || args_for(block_device()),
            ),
            (
                postcard::to_stdvec(&running(vsock_device()).save()).expect("encode"),
                || args_for(vsock_device()),
            ),
        ];
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let (mut refused, mut restored) = (0, 0);
        for (bytes, args) in &saved {
            for _ in 0..500 {
                let mut mutated = bytes.clone();
                for _ in 0..1 + next() % 3 {
                    let at = (next() % mutated.len() as u64) as usize;
                    mutated[at] ^= 1 << (next() % 8);
                }
                let Ok(state) = postcard::from_bytes::<TransportSnapshot>(&mutated) else {
                    refused += 1;
                    continue;
                };
                match MmioTransport::restore(args(), &state) {
                    Ok(t) => {
                        t.restored();
                        restored += 1;
                    }
                    Err(_) => refused += 1,
                }
            }
        }

        assert!(
            refused > 0 && restored > 0,
            "{refused} refused, {restored} restored"
        );
    }
}
