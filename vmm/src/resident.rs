//! Resident memory of this process, split into guest RAM and the VMM's own.

use std::ops::Range;

/// Resident set sizes in KiB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResidentMemory {
    /// Everything that is not guest RAM: code, heap, stacks, kvm_run pages.
    pub vmm_kib: u64,
    /// Pages of guest RAM that are resident.
    pub guest_kib: u64,
}

/// Splits `/proc/self/smaps` into guest and VMM resident memory; a mapping
/// counts as guest memory if it lies inside one of `guest` (host addresses).
pub fn measure(guest: &[Range<usize>]) -> std::io::Result<ResidentMemory> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    Ok(split_smaps(&smaps, guest))
}

fn split_smaps(smaps: &str, guest: &[Range<usize>]) -> ResidentMemory {
    let mut usage = ResidentMemory::default();
    let mut in_guest = false;
    for line in smaps.lines() {
        if let Some(kib) = line.strip_prefix("Rss:") {
            let kib: u64 = kib
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(0);
            if in_guest {
                usage.guest_kib += kib;
            } else {
                usage.vmm_kib += kib;
            }
        } else if let Some((range, _)) = line.split_once(' ') {
            if let Some((start, _)) = range.split_once('-') {
                if let Ok(start) = usize::from_str_radix(start, 16) {
                    in_guest = guest.iter().any(|r| r.contains(&start));
                }
            }
        }
    }
    usage
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_guest_and_vmm_mappings() {
        let smaps = "\
7f0000000000-7f0008000000 rw-p 00000000 00:00 0
Size:             131072 kB
Rss:              130000 kB
55d000000000-55d000100000 r-xp 00000000 08:01 123 /usr/bin/husk-vmm
Size:               1024 kB
Rss:                 900 kB
";
        let guest: Range<usize> = 0x7f00_0000_0000..0x7f00_0800_0000;

        let usage = split_smaps(smaps, std::slice::from_ref(&guest));

        assert_eq!(
            usage,
            ResidentMemory {
                vmm_kib: 900,
                guest_kib: 130_000
            }
        );
    }
}
