//! Boots the real guest kernel from kernel-config/ with the real guest-init.
//! Each test is one boot; on an emulating host that is 30 to 90 seconds.

mod common;

use std::io::Write;
use std::time::Duration;

use common::*;

#[test]
fn guest_init_reports_ready_runs_a_command_and_powers_off() {
    let timeline = vmm_sys_util::tempfile::TempFile::new().expect("tempfile");
    let cmd = guest_command(&[
        "--timeline",
        timeline.as_path().to_str().expect("utf-8"),
        "--cmdline",
        "husk.hostname=sandbox-1 -- /bin/busybox echo hello-from-the-guest",
    ]);

    let run = run(cmd, BOOT_TIMEOUT);

    assert_eq!(run.status.code(), Some(0), "{}", run.dump());
    let ready = run
        .serial
        .lines()
        .find(|l| l.starts_with("husk-guest-init: ready "))
        .unwrap_or_else(|| panic!("no readiness line\n{}", run.dump()));
    assert!(ready.contains(" hostname=sandbox-1"), "{ready}");
    assert!(ready.contains(" uptime_ms="), "{ready}");
    assert!(ready.contains(" init_ms="), "{ready}");
    assert!(
        run.serial.contains("\nhello-from-the-guest"),
        "{}",
        run.dump()
    );
    assert!(
        run.serial.contains("husk-guest-init: exit status=0"),
        "{}",
        run.dump()
    );
    assert!(run.stderr.contains("the guest shut down"), "{}", run.dump());
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(timeline.as_path()).expect("timeline file"))
            .expect("timeline JSON");
    for phase in [
        "vm_created",
        "memory_ready",
        "kernel_loaded",
        "vcpus_ready",
        "first_kvm_run",
        "init_started",
        "guest_ready",
        "guest_exit",
    ] {
        assert!(
            report["phases_us"][phase].is_u64(),
            "missing {phase}: {report}"
        );
    }
}

/// The hardware virtualization this host's CPU shows (`svm`, `vmx`), if any.
fn host_virtualization() -> Option<String> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
    let flags = cpuinfo.lines().find(|l| l.starts_with("flags"))?.to_owned();
    flags
        .split_whitespace()
        .find(|f| *f == "svm" || *f == "vmx")
        .map(str::to_owned)
}

#[test]
fn two_vcpus_come_up_console_goes_to_a_file_and_poweroff_ends_the_vm() {
    // busybox poweroff signals PID 1 (SIGUSR2); the trailing sleep would keep
    // the guest up if guest-init ignored it. The guest is offered nested
    // virtualization (off by default: tests/snapshot.rs checks a clone has
    // none): it sees the host's VMX or SVM where the host has one (kvm_amd:
    // svm; a PVM host has neither to offer).
    let console = vmm_sys_util::tempfile::TempFile::new().expect("tempfile");
    let cmd = guest_command(&[
        "--vcpus",
        "2",
        "--nested-virt",
        "--serial",
        console.as_path().to_str().expect("utf-8"),
        "--cmdline",
        "-- /bin/sh -c \"echo cpus=$(grep -c ^processor /proc/cpuinfo) virt=$(grep -m1 -o -w -e svm -e vmx /proc/cpuinfo).; poweroff; sleep 100000\"",
    ]);

    let run = run(cmd, BOOT_TIMEOUT);

    let serial = std::fs::read_to_string(console.as_path()).expect("console file");
    assert_eq!(run.status.code(), Some(0), "{}\n{serial}", run.dump());
    assert!(
        run.serial.is_empty(),
        "console went to stdout: {}",
        run.serial
    );
    assert!(serial.contains("cpus=2"), "{serial}");
    let virt = host_virtualization().unwrap_or_default();
    assert!(
        serial.contains(&format!("virt={virt}.")),
        "host: {virt:?}\n{serial}"
    );
    assert!(serial.contains("husk-guest-init: shutdown"), "{serial}");
}

#[test]
fn guest_kernel_panic_ends_the_vmm_with_an_error() {
    // PID 1 exiting is a kernel panic: "Attempted to kill init!".
    let cmd = guest_command(&["--cmdline", "rdinit=/bin/false"]);

    let run = run(cmd, BOOT_TIMEOUT);

    assert_eq!(run.status.code(), Some(1), "{}", run.dump());
    assert!(
        run.stderr.contains("the guest kernel panicked"),
        "{}",
        run.dump()
    );
    assert!(
        run.stderr.contains("Attempted to kill init"),
        "{}",
        run.dump()
    );
}

#[test]
fn triple_fault_ends_the_vmm_with_an_error() {
    // A "kernel" whose first instruction is ud2: with the boot IDT empty, the
    // #UD escalates to a triple fault.
    let kernel = write_temp(&tiny_elf(&[0x0f, 0x0b]));
    let mut cmd = std::process::Command::new(vmm_binary());
    cmd.args(["--mem-mib", "16", "--kernel"])
        .arg(kernel.as_path());

    let run = run(cmd, Duration::from_secs(120));

    assert_eq!(run.status.code(), Some(1), "{}", run.dump());
    assert!(run.stderr.contains("triple-faulted"), "{}", run.dump());
}

#[test]
fn sigterm_stops_a_booting_vm_cleanly_and_leaves_no_socket() {
    let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
    let (uds, api) = (dir.as_path().join("vm.vsock"), dir.as_path().join("vm.api"));
    let child = spawn(guest_command(&[
        "--serial",
        "null",
        "--vsock",
        &format!("cid=3,path={}", uds.display()),
        "--api-sock",
        &api.display().to_string(),
    ]));
    // Running: its control socket answers.
    let mut status = None;
    while status.is_none() {
        status = std::os::unix::net::UnixStream::connect(&api).ok();
        std::thread::sleep(Duration::from_millis(20));
    }

    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let run = wait(child, Duration::from_secs(30));

    assert_eq!(run.status.code(), Some(0), "{}", run.dump());
    assert!(
        run.stderr.contains("stopped by signal 15"),
        "{}",
        run.dump()
    );
    assert!(!uds.exists(), "the vsock socket is left behind");
    assert!(!api.exists(), "the control socket is left behind");
}

/// A minimal x86_64 ELF executable loading `code` at 1 MiB and entering there.
fn tiny_elf(code: &[u8]) -> Vec<u8> {
    const ENTRY: u64 = 0x10_0000;
    const CODE_OFFSET: u64 = 64 + 56;
    let mut elf = Vec::new();
    elf.extend(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0");
    elf.extend(2u16.to_le_bytes()); // ET_EXEC
    elf.extend(0x3eu16.to_le_bytes()); // EM_X86_64
    elf.extend(1u32.to_le_bytes());
    elf.extend(ENTRY.to_le_bytes());
    elf.extend(64u64.to_le_bytes()); // program headers right after this header
    elf.extend(0u64.to_le_bytes()); // no section headers
    elf.extend(0u32.to_le_bytes());
    elf.extend(64u16.to_le_bytes());
    elf.extend(56u16.to_le_bytes());
    elf.extend(1u16.to_le_bytes());
    elf.extend([0u8; 6]);
    elf.extend(1u32.to_le_bytes()); // PT_LOAD
    elf.extend(5u32.to_le_bytes()); // R+X
    elf.extend(CODE_OFFSET.to_le_bytes());
    elf.extend(ENTRY.to_le_bytes()); // vaddr
    elf.extend(ENTRY.to_le_bytes()); // paddr
    elf.extend((code.len() as u64).to_le_bytes());
    elf.extend((code.len() as u64).to_le_bytes());
    elf.extend(0x1000u64.to_le_bytes());
    elf.extend(code);
    elf
}

fn write_temp(bytes: &[u8]) -> vmm_sys_util::tempfile::TempFile {
    let file = vmm_sys_util::tempfile::TempFile::new().expect("tempfile");
    file.as_file().write_all(bytes).expect("write");
    file
}
