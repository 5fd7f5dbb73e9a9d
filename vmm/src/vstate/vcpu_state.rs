//! A vCPU's architectural state for snapshots, in the order KVM needs it
//! saved and restored (see the comments on each step).
//!
//! The guest's TSC and its kvmclock must stand in the restored guest as they
//! stood when the snapshot was taken: a guest that watches its TSC against
//! kvmclock marks the TSC unstable when they drift apart by more than about
//! 0.4 ms. They cannot be read (or written) at one instant: the clock is a
//! VM ioctl, each TSC a vCPU's, on different threads, with milliseconds of
//! device work between them at a restore. So each is stamped with the host's
//! CLOCK_MONOTONIC when it was read or written, and the TSC written at a
//! restore is the saved one moved by the time that passed between the two on
//! each side ([`TscSync`]). That is exact to the latency of an ioctl; where
//! KVM can say more (a host whose clocksource is the TSC: KVM_GET_CLOCK
//! then reports the host TSC of its reading, and Linux 5.16+ has the vCPUs'
//! TSC offset attribute), the saved TSC is the guest's at the clock's very
//! reading ([`pin_to_clock`]) and a restore sets each vCPU's offset against
//! the clock it set ([`settle_tsc`]): no user-space timing at all.

use kvm_bindings::{
    kvm_clock_data, kvm_device_attr, KVM_CLOCK_HOST_TSC, KVM_VCPU_TSC_CTRL, KVM_VCPU_TSC_OFFSET,
};
use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};
use vmm_sys_util::ioctl::ioctl_with_ref;
use vmm_sys_util::ioctl_iow_nr;

use crate::vstate::vm::VmState;

use crate::timeline::monotonic_ns;

/// Everything KVM holds for one vCPU.
#[derive(Debug, Serialize, Deserialize)]
pub struct VcpuState {
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub debug_regs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    /// Every MSR KVM lists but MSR_IA32_TSC, which is `tsc`.
    pub msrs: Vec<kvm_msr_entry>,
    pub vcpu_events: kvm_vcpu_events,
    pub tsc_khz: Option<u32>,
    /// The guest's TSC, and the host's CLOCK_MONOTONIC (ns) when it was read.
    pub tsc: u64,
    pub tsc_read_ns: u64,
    /// The vCPU's TSC offset where KVM has the attribute (see
    /// [`pin_to_clock`]); not needed by a restore.
    #[serde(skip)]
    pub tsc_offset: Option<u64>,
}

/// Where a restored guest's TSC stands against its kvmclock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TscSync {
    /// CLOCK_MONOTONIC (ns) when the saved VM's clock was read.
    pub clock_read_ns: u64,
    /// CLOCK_MONOTONIC (ns) when this VM's clock was set to it.
    pub clock_set_ns: u64,
}

/// MSR_IA32_TSC.
const MSR_IA32_TSC: u32 = 0x10;
const KVMIO: u32 = 0xAE;
ioctl_iow_nr!(KVM_HAS_DEVICE_ATTR, KVMIO, 0xe3, kvm_device_attr);

/// `tsc` moved by `ns` nanoseconds (either way) of a TSC running at `khz`.
fn moved(tsc: u64, ns: i128, khz: u32) -> u64 {
    let tsc = i128::from(tsc) + ns * i128::from(khz) / 1_000_000;
    u64::try_from(tsc.max(0)).unwrap_or(u64::MAX)
}

impl TscSync {
    /// The TSC to write at host time `now_ns` for a vCPU whose TSC read
    /// `tsc` at host time `read_ns` (on the saving host): the saved value,
    /// plus the time from its read to the clock's read on that host, plus
    /// the time from the clock's set to `now_ns` on this one.
    pub fn tsc_at(&self, tsc: u64, read_ns: u64, khz: u32, now_ns: u64) -> u64 {
        let before = i128::from(self.clock_read_ns) - i128::from(read_ns);
        let after = i128::from(now_ns) - i128::from(self.clock_set_ns);
        moved(tsc, before + after, khz)
    }
}

/// A failed KVM call while saving or restoring a vCPU.
#[derive(Debug, thiserror::Error)]
#[error("{op} failed: {source}")]
pub struct StateError {
    pub op: &'static str,
    pub source: kvm_ioctls::Error,
}

fn op<T>(op: &'static str, r: Result<T, kvm_ioctls::Error>) -> Result<T, StateError> {
    r.map_err(|source| StateError { op, source })
}

/// MSRs KVM lists that are not guest state, or cannot be read back and
/// written again as they are.
fn skip_msr(index: u32) -> bool {
    matches!(
        index,
        // MSR_IA32_FEATURE_CONTROL, machine check banks and control.
        0x3a | 0x179..=0x17b | 0x400..=0x47f
    )
}

/// The MSRs to save: KVM's list, less the ones above.
pub fn msrs_to_save(kvm: &Kvm) -> Result<Vec<u32>, StateError> {
    let list = op("KVM_GET_MSR_INDEX_LIST", kvm.get_msr_index_list())?;
    Ok(list
        .as_slice()
        .iter()
        .copied()
        .filter(|&i| !skip_msr(i) && i != MSR_IA32_TSC)
        .collect())
}

/// Reads the MSRs in `indices`. KVM stops at the first it cannot read;
/// that one is left out and the rest read again.
fn get_msrs(fd: &VcpuFd, indices: &[u32]) -> Result<Vec<kvm_msr_entry>, StateError> {
    let mut saved = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(kvm_bindings::KVM_MAX_MSR_ENTRIES)];
        let entries: Vec<kvm_msr_entry> = chunk
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(|_| StateError {
            op: "building the MSR list",
            source: kvm_ioctls::Error::new(libc::EINVAL),
        })?;
        let n = op("KVM_GET_MSRS", fd.get_msrs(&mut msrs))?;
        saved.extend_from_slice(&msrs.as_slice()[..n]);
        // Entry n (if any) could not be read: skip it.
        let consumed = if n < chunk.len() { n + 1 } else { n };
        rest = &rest[consumed..];
    }
    Ok(saved)
}

/// Reads the guest's TSC with the host time it was read at (the middle of
/// the call).
fn read_tsc(fd: &VcpuFd) -> Result<(u64, u64), StateError> {
    let mut msrs = tsc_msr(0)?;
    let before = monotonic_ns();
    let n = op("KVM_GET_MSRS", fd.get_msrs(&mut msrs))?;
    let after = monotonic_ns();
    if n != 1 {
        return Err(StateError {
            op: "KVM_GET_MSRS (MSR_IA32_TSC unreadable)",
            source: kvm_ioctls::Error::new(libc::EINVAL),
        });
    }
    Ok((msrs.as_slice()[0].data, before + (after - before) / 2))
}

/// Writes the guest's TSC: `value(now)` for the host time of the write.
fn write_tsc(fd: &VcpuFd, value: impl Fn(u64) -> u64) -> Result<(), StateError> {
    let msrs = tsc_msr(value(monotonic_ns()))?;
    match op("KVM_SET_MSRS", fd.set_msrs(&msrs))? {
        1 => Ok(()),
        _ => Err(StateError {
            op: "KVM_SET_MSRS (MSR_IA32_TSC refused)",
            source: kvm_ioctls::Error::new(libc::EINVAL),
        }),
    }
}

fn tsc_msr(data: u64) -> Result<Msrs, StateError> {
    Msrs::from_entries(&[kvm_msr_entry {
        index: MSR_IA32_TSC,
        data,
        ..Default::default()
    }])
    .map_err(|_| StateError {
        op: "building the MSR list",
        source: kvm_ioctls::Error::new(libc::EINVAL),
    })
}

ioctl_iow_nr!(KVM_SET_DEVICE_ATTR, KVMIO, 0xe1, kvm_device_attr);
ioctl_iow_nr!(KVM_GET_DEVICE_ATTR, KVMIO, 0xe2, kvm_device_attr);

/// The vCPU's TSC offset attribute (guest TSC = host TSC + offset, where the
/// guest's TSC runs at the host's rate), pointing at `value`.
fn tsc_offset_attr(value: &mut u64) -> kvm_device_attr {
    kvm_device_attr {
        group: KVM_VCPU_TSC_CTRL,
        attr: u64::from(KVM_VCPU_TSC_OFFSET),
        addr: value as *mut u64 as u64,
        flags: 0,
    }
}

/// The vCPU's TSC offset, where KVM has the attribute (Linux 5.16+).
fn tsc_offset(fd: &VcpuFd) -> Option<u64> {
    let mut offset = 0;
    let attr = tsc_offset_attr(&mut offset);
    // SAFETY: a vCPU fd and a valid kvm_device_attr whose `addr` points to
    // a u64 that lives across the call; KVM writes only that u64.
    let rc = unsafe { ioctl_with_ref(fd, KVM_GET_DEVICE_ATTR(), &attr) };
    (rc == 0).then_some(offset)
}

/// The guest's TSCs at the instant `vm`'s clock was read, where KVM gave
/// the host TSC of that reading and each vCPU's TSC offset: exact, where
/// the saved TSC reads were only close to it in time.
pub fn pin_to_clock(vcpus: &mut [VcpuState], vm: &VmState) {
    let offsets: Option<Vec<u64>> = vcpus.iter().map(|v| v.tsc_offset).collect();
    let (true, Some(offsets)) = (vm.clock.flags & KVM_CLOCK_HOST_TSC != 0, offsets) else {
        tracing::debug!(
            clock_flags = vm.clock.flags,
            "TSC saved by timed reads (KVM gave no host TSC with its clock)"
        );
        return;
    };
    tracing::debug!(?offsets, "TSC saved at the clock's reading");
    for (vcpu, offset) in vcpus.iter_mut().zip(offsets) {
        vcpu.tsc = vm.clock.host_tsc.wrapping_add(offset);
        vcpu.tsc_read_ns = vm.clock_read_ns;
    }
}

/// Sets each restored vCPU's TSC offset against the clock `vm` now reads,
/// so that guest TSC and kvmclock stand as they did in `saved`: where KVM
/// reports the host TSC of a clock reading and has the offset attribute.
/// Elsewhere (or on a TSC running at another rate than the host's) the TSC
/// written by [`VcpuState::restore`] stands. Before any vCPU runs.
pub fn settle_tsc(vm: &VmFd, vcpus: &[&VcpuFd], saved: &MicrovmTsc) -> Result<(), StateError> {
    let mut probe = 0;
    let probe_attr = tsc_offset_attr(&mut probe);
    let usable = vcpus.iter().all(|fd| {
        // SAFETY: as in `tsc_offset`; KVM_HAS_DEVICE_ATTR reads only the attr.
        unsafe { ioctl_with_ref(*fd, KVM_HAS_DEVICE_ATTR(), &probe_attr) == 0 }
    });
    if !usable || saved.scaled {
        return Ok(());
    }
    // Setting the clock again, now that the vCPUs exist, lets KVM use its
    // master clock (a clock tied to the host TSC), which it reports with
    // the host TSC of the reading.
    let now = op("KVM_GET_CLOCK", vm.get_clock())?;
    let again = kvm_clock_data {
        clock: now.clock,
        ..Default::default()
    };
    op("KVM_SET_CLOCK", vm.set_clock(&again))?;
    let now = op("KVM_GET_CLOCK", vm.get_clock())?;
    if now.flags & KVM_CLOCK_HOST_TSC == 0 {
        tracing::debug!(
            clock_flags = now.flags,
            "TSC restored by timed writes (KVM gave no host TSC with its clock)"
        );
        return Ok(());
    }
    let elapsed_ns = i128::from(now.clock) - i128::from(saved.clock);
    for (index, (fd, &(tsc_at_clock, khz))) in vcpus.iter().zip(&saved.vcpus).enumerate() {
        let mut offset = moved(tsc_at_clock, elapsed_ns, khz).wrapping_sub(now.host_tsc);
        tracing::debug!(
            index,
            offset,
            elapsed_ns,
            "TSC offset set against the clock"
        );
        let attr = tsc_offset_attr(&mut offset);
        // SAFETY: as in `tsc_offset`; KVM reads only the u64.
        let rc = unsafe { ioctl_with_ref(*fd, KVM_SET_DEVICE_ATTR(), &attr) };
        if rc != 0 {
            return Err(StateError {
                op: "KVM_SET_DEVICE_ATTR (TSC offset)",
                source: kvm_ioctls::Error::last(),
            });
        }
    }
    Ok(())
}

/// What [`settle_tsc`] needs of a snapshot: the clock it read, and each
/// vCPU's TSC at that reading with its rate.
#[derive(Debug)]
pub struct MicrovmTsc {
    pub clock: u64,
    pub vcpus: Vec<(u64, u32)>,
    /// A vCPU's TSC runs at another rate than this host's.
    pub scaled: bool,
}

impl MicrovmTsc {
    /// From a snapshot's VM and vCPU states (`None` where a vCPU's TSC rate
    /// is unknown), `scaled` if the restore set another TSC rate.
    pub fn of(vm: &VmState, vcpus: &[VcpuState], scaled: bool) -> Option<Self> {
        let vcpus = vcpus
            .iter()
            .map(|v| {
                let khz = v.tsc_khz?;
                let before = i128::from(vm.clock_read_ns) - i128::from(v.tsc_read_ns);
                Some((moved(v.tsc, before, khz), khz))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(MicrovmTsc {
            clock: vm.clock.clock,
            vcpus,
            scaled,
        })
    }
}

impl VcpuState {
    /// Saves a paused vCPU (not in KVM_RUN).
    pub fn save(fd: &VcpuFd, msr_indices: &[u32]) -> Result<Self, StateError> {
        // MP state first: reading it can flush LAPIC state KVM keeps elsewhere.
        let mp_state = op("KVM_GET_MP_STATE", fd.get_mp_state())?;
        let regs = op("KVM_GET_REGS", fd.get_regs())?;
        let sregs = op("KVM_GET_SREGS", fd.get_sregs())?;
        let xsave = op("KVM_GET_XSAVE", fd.get_xsave())?;
        let xcrs = op("KVM_GET_XCRS", fd.get_xcrs())?;
        let debug_regs = op("KVM_GET_DEBUGREGS", fd.get_debug_regs())?;
        let lapic = op("KVM_GET_LAPIC", fd.get_lapic())?;
        let tsc_khz = fd.get_tsc_khz().ok();
        let cpuid = op(
            "KVM_GET_CPUID2",
            fd.get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES),
        )?
        .as_slice()
        .to_vec();
        let msrs = get_msrs(fd, msr_indices)?;
        let (tsc, tsc_read_ns) = read_tsc(fd)?;
        let tsc_offset = tsc_offset(fd);
        // Events last: the other reads do not disturb pending exceptions.
        let vcpu_events = op("KVM_GET_VCPU_EVENTS", fd.get_vcpu_events())?;
        Ok(VcpuState {
            cpuid,
            mp_state,
            regs,
            sregs,
            xsave,
            xcrs,
            debug_regs,
            lapic,
            msrs,
            vcpu_events,
            tsc_khz,
            tsc,
            tsc_read_ns,
            tsc_offset,
        })
    }

    /// Restores onto a fresh vCPU of a VM whose irqchip exists and whose
    /// clock was set as `sync` says. Returns whether the guest's TSC now runs
    /// at another rate than this host's (KVM scales it).
    pub fn restore(&self, fd: &VcpuFd, sync: TscSync) -> Result<bool, StateError> {
        let cpuid = CpuId::from_entries(&self.cpuid).map_err(|_| StateError {
            op: "building the CPUID",
            source: kvm_ioctls::Error::new(libc::EINVAL),
        })?;
        op("KVM_SET_CPUID2", fd.set_cpuid2(&cpuid))?;
        let mut scaled = false;
        if let Some(khz) = self.tsc_khz {
            // Same frequency as when saved, or the guest's clock runs wrong.
            if fd.get_tsc_khz().ok() != Some(khz) {
                op("KVM_SET_TSC_KHZ", fd.set_tsc_khz(khz))?;
                scaled = true;
            }
        }
        op("KVM_SET_MP_STATE", fd.set_mp_state(self.mp_state))?;
        op("KVM_SET_REGS", fd.set_regs(&self.regs))?;
        op("KVM_SET_SREGS", fd.set_sregs(&self.sregs))?;
        op("KVM_SET_XSAVE", {
            // SAFETY: the buffer came from KVM_GET_XSAVE of the same size.
            unsafe { fd.set_xsave(&self.xsave) }
        })?;
        op("KVM_SET_XCRS", fd.set_xcrs(&self.xcrs))?;
        op("KVM_SET_DEBUGREGS", fd.set_debug_regs(&self.debug_regs))?;
        // After the sregs (APIC base), before the MSRs (TSC deadline).
        op("KVM_SET_LAPIC", fd.set_lapic(&self.lapic))?;
        // Before the other MSRs: the TSC deadline is armed against it.
        match self.tsc_khz {
            Some(khz) => write_tsc(fd, |now| sync.tsc_at(self.tsc, self.tsc_read_ns, khz, now))?,
            None => write_tsc(fd, |_| self.tsc)?,
        }
        for chunk in self.msrs.chunks(kvm_bindings::KVM_MAX_MSR_ENTRIES) {
            let msrs = Msrs::from_entries(chunk).map_err(|_| StateError {
                op: "building the MSR list",
                source: kvm_ioctls::Error::new(libc::EINVAL),
            })?;
            let n = op("KVM_SET_MSRS", fd.set_msrs(&msrs))?;
            if n != chunk.len() {
                return Err(StateError {
                    op: "KVM_SET_MSRS (MSR refused)",
                    source: kvm_ioctls::Error::new(libc::EINVAL),
                });
            }
        }
        // Last: setting the registers clears pending exceptions.
        op("KVM_SET_VCPU_EVENTS", fd.set_vcpu_events(&self.vcpu_events))?;
        Ok(scaled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tsc_moves_by_the_gaps_on_both_hosts() {
        // Saved: TSC read at 1_000 ns, clock read 2 ms later. Restored: the
        // clock set at 50 s, the TSC written 3 ms after that. At 1 GHz the
        // TSC moves 5 ms of cycles.
        let sync = TscSync {
            clock_read_ns: 2_001_000,
            clock_set_ns: 50_000_000_000,
        };

        let tsc = sync.tsc_at(7_000_000, 1_000, 1_000_000, 50_003_000_000);

        assert_eq!(tsc, 7_000_000 + 5_000_000);
    }

    #[test]
    fn a_tsc_read_after_the_clock_moves_back() {
        let sync = TscSync {
            clock_read_ns: 1_000,
            clock_set_ns: 1_000,
        };

        assert_eq!(sync.tsc_at(10_000, 3_000, 2_000_000, 1_000), 6_000);
        assert_eq!(sync.tsc_at(1, 3_000, 2_000_000, 1_000), 0);
    }
}
