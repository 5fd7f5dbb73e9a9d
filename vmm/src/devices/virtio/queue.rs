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

/// How serving a queue ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    /// Chains were returned: the driver may need an interrupt.
    pub used_any: bool,
    /// The driver broke the queue: the device must fail until reset.
    pub broken: bool,
}

/// Serves every chain the driver has made available, with notifications
/// off while serving and a last look after turning them back on. `serve`
/// answers a chain's used length, or None to leave it available and stop
/// (a rate limiter's timer brings the device back). A pass that finds
/// more but serves nothing means the ring is unusable: broken.
pub fn serve_queue(
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    device: &str,
    mut serve: impl FnMut(&[Descriptor]) -> Option<u32>,
) -> Served {
    let mut used_any = false;
    let broken = loop {
        if queue.disable_notification(mem).is_err() {
            break true;
        }
        let mut served = 0;
        let mut throttled = false;
        let pass = loop {
            match pop_chain(queue, mem) {
                Ok(Some((head, descriptors))) => {
                    let Some(used) = serve(&descriptors) else {
                        queue.go_to_previous_position();
                        throttled = true;
                        break Ok(());
                    };
                    if let Err(e) = return_chain(queue, mem, head, used) {
                        break Err(e);
                    }
                    used_any = true;
                    served += 1;
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        if let Err(e) = pass {
            tracing::warn!("{device}: {e}");
            break true;
        }
        if throttled {
            // No kicks are needed until the timer fires.
            break false;
        }
        match queue.enable_notification(mem) {
            // More arrived while we were serving: go again, unless this
            // pass made no progress, which means the ring is unusable.
            Ok(true) if served > 0 => continue,
            Ok(true) | Err(_) => break true,
            Ok(false) => break false,
        }
    };
    Served { used_any, broken }
}
