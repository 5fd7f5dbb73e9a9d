//! The kernel command line husk-vmm gives every guest, shared with the
//! host layer so that a peer VMM (QEMU in `husk bench`) boots the very same
//! guest.

/// Kernel parameters every husk guest gets: console on COM1, reset through
/// the i8042 on reboot (the VMM's "guest is done" signal), reboot at once on
/// panic (the VMM sees the panic line and exits non-zero), a quiet console
/// (each byte is a VM exit) and no IO-APIC timer check (a busy-wait).
/// `clocksource=kvm-clock`: the guest reads time through kvmclock, which a
/// restore puts back with KVM_SET_CLOCK, so a clone's clock continues from
/// its snapshot. With the TSC clocksource (the kernel's choice when the TSC
/// is invariant) the clock of a restored guest jumps by the snapshot's age
/// on the PVM hosts we build on, where restoring IA32_TSC does not move
/// what the guest reads.
///
/// The RNG seed the VMM passes in `setup_data` is credited by the kernel's
/// `CONFIG_RANDOM_TRUST_BOOTLOADER`: Linux 6.1 reads setup_data before it
/// parses the command line, so `random.trust_bootloader=on` would be late.
pub const BASE_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=-1 quiet no_timer_check clocksource=kvm-clock";

/// Extra parameters on a PVM host, where the guest kernel runs through KVM's
/// instruction emulator: turn off CPU features the emulator cannot execute.
/// See shared/platform.md and kernel-config/README.md.
pub const PVM_CMDLINE: &str = "clearcpuid=popcnt,cx16,xsave,avx,avx2,avx512f,bmi1,bmi2,erms,fsrm,smap,smep,ibt,fsgsbase,rdrand,rdseed,movbe,pku,umip mitigations=off nopcid";

/// The command line of a husk guest on this host: [`BASE_CMDLINE`], and
/// [`PVM_CMDLINE`] on a PVM host. Peer VMMs (`husk bench`) give it to the
/// same guest.
pub fn guest_cmdline() -> String {
    if is_pvm_host() {
        format!("{BASE_CMDLINE} {PVM_CMDLINE}")
    } else {
        BASE_CMDLINE.to_owned()
    }
}

/// Where a PVM host shows its KVM module.
pub const PVM_MODULE: &str = "/sys/module/kvm_pvm";

/// Whether this host's KVM is PVM (the guest kernel runs through KVM's
/// instruction emulator), whose guests need [`PVM_CMDLINE`].
pub fn is_pvm_host() -> bool {
    std::path::Path::new(PVM_MODULE).exists()
}
