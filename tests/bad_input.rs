//! Bad input gets a clear error and exit status 2, never a panic or a hang.
//! None of these boots a guest.

mod common;

use std::io::Write;
use std::process::Command;
use std::time::Duration;

use common::*;

const QUICK: Duration = Duration::from_secs(60);

fn vmm(args: &[&str]) -> Command {
    let mut cmd = Command::new(vmm_binary());
    cmd.args(args);
    cmd
}

fn assert_refused(run: &VmmRun, message: &str) {
    assert_eq!(run.status.code(), Some(2), "{}", run.dump());
    assert!(
        run.stderr.contains(message),
        "expected {message:?}\n{}",
        run.dump()
    );
    assert!(!run.stderr.contains("panicked"), "{}", run.dump());
}

fn temp_file(bytes: &[u8]) -> vmm_sys_util::tempfile::TempFile {
    let file = vmm_sys_util::tempfile::TempFile::new().expect("tempfile");
    file.as_file().write_all(bytes).expect("write");
    file
}

#[test]
fn missing_kernel() {
    let run = run(vmm(&["--kernel", "/nonexistent/vmlinux"]), QUICK);

    assert_refused(&run, "cannot open the kernel /nonexistent/vmlinux");
}

#[test]
fn unreadable_kernel() {
    let run = run(vmm(&["--kernel", "/"]), QUICK);

    assert_refused(&run, "cannot read the kernel image");
}

#[test]
fn kernel_unreadable_for_the_user() {
    // root can read anything, so drop to nobody; the file is root's, mode 0600.
    let kernel = temp_file(b"secret");
    std::fs::set_permissions(
        kernel.as_path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .expect("chmod");
    let (_dir, binary) = vmm_binary_for_anyone();
    let mut cmd = as_nobody(&binary);
    cmd.arg("--kernel").arg(kernel.as_path());

    let run = run(cmd, QUICK);

    assert_refused(&run, "Permission denied");
}

#[test]
fn file_that_is_not_a_kernel() {
    let junk = temp_file(&[0x5a; 64 * 1024]);

    let run = run(
        vmm(&["--kernel", junk.as_path().to_str().expect("utf-8")]),
        QUICK,
    );

    assert_refused(&run, "neither a vmlinux ELF nor a bzImage");
}

#[test]
fn memory_too_small_for_the_kernel() {
    let mut cmd = vmm(&["--mem-mib", "8", "--kernel"]);
    cmd.arg(kernel());

    let run = run(cmd, QUICK);

    assert_refused(&run, "give the guest more memory");
}

#[test]
fn memory_below_the_minimum() {
    let mut cmd = vmm(&["--mem-mib", "0", "--kernel"]);
    cmd.arg(kernel());

    let run = run(cmd, QUICK);

    assert_refused(&run, "at least 4 MiB are needed");
}

#[test]
fn initramfs_too_large_for_memory() {
    let big = temp_file(&vec![0u8; 24 << 20]);
    let mut cmd = vmm(&[
        "--mem-mib",
        "32",
        "--initramfs",
        big.as_path().to_str().expect("utf-8"),
        "--kernel",
    ]);
    cmd.arg(kernel());

    let run = run(cmd, QUICK);

    assert_refused(&run, "initramfs");
}

#[test]
fn zero_vcpus() {
    let mut cmd = vmm(&["--vcpus", "0", "--kernel"]);
    cmd.arg(kernel());

    let run = run(cmd, QUICK);

    assert_refused(&run, "at least 1 vCPU");
}

#[test]
fn overlong_command_line() {
    let long = "x".repeat(3000);
    let mut cmd = vmm(&["--cmdline", &long, "--kernel"]);
    cmd.arg(kernel());

    let run = run(cmd, QUICK);

    assert_refused(&run, "kernel command line would be");
}

#[test]
fn no_kvm_device() {
    let mut cmd = vmm(&["--kvm-device", "/nonexistent/kvm", "--kernel"]);
    cmd.arg(kernel());

    let run = run(cmd, QUICK);

    assert_refused(&run, "/nonexistent/kvm does not exist");
}

#[test]
fn no_permission_on_kvm_device() {
    let (_dir, binary) = vmm_binary_for_anyone();
    let mut cmd = as_nobody(&binary);
    // Any file nobody can open will do: KVM is checked before the kernel is read.
    cmd.arg("--kernel").arg(&binary);

    let run = run(cmd, QUICK);

    assert_refused(&run, "permission denied opening /dev/kvm");
}
