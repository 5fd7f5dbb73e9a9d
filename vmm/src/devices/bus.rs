//! A port-I/O or MMIO bus: non-overlapping address ranges, each owned by one
//! device. Lookups are a B-tree search; devices are locked only while one
//! access is served.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

/// A device on a bus. `offset` is relative to the start of its range.
pub trait BusDevice: Send {
    /// Serves a read; `data` arrives zeroed.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Serves a write.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Errors adding a device to a bus.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("bus range {base:#x}+{len:#x} is empty or wraps around")]
    InvalidRange { base: u64, len: u64 },
    #[error("bus range {base:#x}+{len:#x} overlaps the device at {other:#x}")]
    Overlap { base: u64, len: u64, other: u64 },
}

struct Slot {
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
}

/// The bus.
#[derive(Default)]
pub struct Bus {
    slots: BTreeMap<u64, Slot>,
}

impl fmt::Debug for Bus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.slots.iter().map(|(b, s)| (b, s.len)))
            .finish()
    }
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `device` at `[base, base + len)`; refuses overlapping ranges.
    pub fn insert(
        &mut self,
        base: u64,
        len: u64,
        device: Arc<Mutex<dyn BusDevice>>,
    ) -> Result<(), BusError> {
        let end = base
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or(BusError::InvalidRange { base, len })?;
        let before = self.slots.range(..end).next_back();
        if let Some((&other, slot)) = before {
            if other + slot.len > base {
                return Err(BusError::Overlap { base, len, other });
            }
        }
        self.slots.insert(base, Slot { len, device });
        Ok(())
    }

    fn find(&self, addr: u64, size: usize) -> Option<(u64, &Slot)> {
        let (&base, slot) = self.slots.range(..=addr).next_back()?;
        let offset = addr - base;
        (offset.checked_add(size as u64)? <= slot.len).then_some((offset, slot))
    }

    /// Reads from the device at `addr`; false if no device covers the access.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        let Some((offset, slot)) = self.find(addr, data.len()) else {
            return false;
        };
        data.fill(0);
        lock(&slot.device).read(offset, data);
        true
    }

    /// Writes to the device at `addr`; false if no device covers the access.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        let Some((offset, slot)) = self.find(addr, data.len()) else {
            return false;
        };
        lock(&slot.device).write(offset, data);
        true
    }
}

/// Locks a device. A device whose lock was poisoned by a panic keeps serving:
/// with `panic = "abort"` in release builds this cannot happen, and in tests
/// the panic itself is the failure worth seeing.
fn lock<'a>(
    device: &'a Mutex<dyn BusDevice + 'static>,
) -> std::sync::MutexGuard<'a, dyn BusDevice + 'static> {
    device.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder {
        last_write: Vec<(u64, Vec<u8>)>,
    }

    impl BusDevice for Recorder {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.last_write.push((offset, data.to_vec()));
        }
    }

    fn device() -> Arc<Mutex<Recorder>> {
        Arc::new(Mutex::new(Recorder::default()))
    }

    #[test]
    fn dispatches_with_offsets() {
        let mut bus = Bus::new();
        let dev = device();
        bus.insert(0x3f8, 8, dev.clone()).expect("insert");
        let mut data = [0u8; 1];

        assert!(bus.read(0x3fd, &mut data));
        assert!(bus.write(0x3f9, &[7]));

        assert_eq!(data, [5]);
        assert_eq!(dev.lock().expect("lock").last_write, vec![(1, vec![7])]);
    }

    #[test]
    fn misses_outside_and_across_ranges() {
        let mut bus = Bus::new();
        bus.insert(0x100, 0x10, device()).expect("insert");
        let mut data = [0u8; 4];

        assert!(!bus.read(0xff, &mut data[..1]));
        assert!(!bus.read(0x110, &mut data[..1]));
        assert!(!bus.read(0x10e, &mut data));
    }

    #[test]
    fn refuses_overlaps_and_empty_ranges() {
        let mut bus = Bus::new();
        bus.insert(0x100, 0x10, device()).expect("insert");

        assert!(matches!(
            bus.insert(0x10f, 1, device()),
            Err(BusError::Overlap { .. })
        ));
        assert!(matches!(
            bus.insert(0xf8, 0x10, device()),
            Err(BusError::Overlap { .. })
        ));
        assert!(matches!(
            bus.insert(0x200, 0, device()),
            Err(BusError::InvalidRange { .. })
        ));
        assert!(matches!(
            bus.insert(u64::MAX, 2, device()),
            Err(BusError::InvalidRange { .. })
        ));
        assert!(bus.insert(0x110, 0x10, device()).is_ok());
    }
}
