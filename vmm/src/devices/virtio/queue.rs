//! Taking chains off a virtqueue without trusting the driver.

use crate::vstate::memory::GuestMemoryMmap;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueOwnedT, QueueT};

/// The driver corrupted the queue (for example an available index that runs
/// past the ring); the device must stop using it until reset.
#[derive(Debug, thiserror::Error)]
#[error("the driver corrupted the queue: {0}")]
pub struct QueueBroken(pub String);

/// Pops the next available chain as (head index, descriptors). The chain's
/// length is bounded by the queue size, so a descriptor loop ends.
pub fn pop_chain(
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
) -> Result<Option<(u16, Vec<Descriptor>)>, QueueBroken> {
    let mut avail = queue.iter(mem).map_err(|e| QueueBroken(format!("{e:?}")))?;
    Ok(avail
        .next()
        .map(|chain| (chain.head_index(), chain.collect())))
}

/// Returns a used buffer of `len` bytes to the driver.
pub fn return_chain(
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    head: u16,
    len: u32,
) -> Result<(), QueueBroken> {
    queue
        .add_used(mem, head, len)
        .map_err(|e| QueueBroken(format!("{e:?}")))
}
