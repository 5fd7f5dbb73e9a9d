//! virtio-block with the real guest: an ext4 root on a raw image, and the
//! read-only and copy-on-write modes that clones will use.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use husk_vmm::devices::virtio::block::{Disk, DiskMode};
use vmm_sys_util::tempdir::TempDir;

/// `debugfs -R "cat PATH"` on an ext4 image: reads a file without mounting.
fn ext4_cat(image: &Path, path: &str) -> String {
    let out = Command::new("debugfs")
        .args(["-R", &format!("cat {path}")])
        .arg(image)
        .output()
        .expect("run debugfs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `e2fsck -fn`: exit status 0 means the file system is clean.
fn ext4_is_clean(image: &Path) -> bool {
    Command::new("e2fsck")
        .arg("-fn")
        .arg(image)
        .output()
        .expect("run e2fsck")
        .status
        .success()
}

#[test]
fn ext4_root_on_virtio_block_keeps_a_file_written_by_the_guest() {
    let dir = TempDir::new().expect("tempdir");
    let image = dir.as_path().join("root.ext4");
    std::fs::copy(rootfs_ext4(), &image).expect("copy rootfs");
    let cmd = disk_guest_command(
        image.to_str().expect("utf-8"),
        &[],
        "-- /bin/sh -c \"echo written-by-the-guest > /hello.txt && sync\"",
    );

    let run = run(cmd, BOOT_TIMEOUT);

    assert_eq!(run.status.code(), Some(0), "{}", run.dump());
    assert!(
        run.serial.contains("husk-guest-init: exit status=0"),
        "{}",
        run.dump()
    );
    assert_eq!(ext4_cat(&image, "/hello.txt"), "written-by-the-guest\n");
    assert!(
        ext4_is_clean(&image),
        "file system not clean after shutdown"
    );
}

#[test]
fn read_only_and_copy_on_write_drives_leave_their_images_untouched() {
    let dir = TempDir::new().expect("tempdir");
    let base = dir.as_path().join("base.ext4");
    std::fs::copy(rootfs_ext4(), &base).expect("copy rootfs");
    let overlay = dir.as_path().join("overlay");
    let data = dir.as_path().join("data.img");
    let mut data_bytes = b"husk-read-only-data".to_vec();
    data_bytes.resize(1 << 20, 0);
    std::fs::write(&data, &data_bytes).expect("data image");
    let base_before = std::fs::read(&base).expect("read base");
    let root = format!("path={},overlay={}", base.display(), overlay.display());
    let ro = format!("path={},readonly", data.display());
    // vdb is read-only: reading works, writing must fail.
    let script = "head -c 19 /dev/vdb; echo; \
                  echo cow-write > /cow.txt && sync && echo root-write-ok; \
                  if echo x | dd of=/dev/vdb 2>/dev/null; then echo vdb-write-ok; else echo vdb-write-refused; fi";
    let cmd = disk_guest_command(&root, &[&ro], &format!("-- /bin/sh -c \"{script}\""));

    let run = run(cmd, BOOT_TIMEOUT);

    assert_eq!(run.status.code(), Some(0), "{}", run.dump());
    assert!(run.has_line("husk-read-only-data"), "{}", run.dump());
    assert!(run.has_line("root-write-ok"), "{}", run.dump());
    assert!(run.has_line("vdb-write-refused"), "{}", run.dump());
    assert!(
        std::fs::read(&base).expect("read base") == base_before,
        "base image changed"
    );
    assert!(
        std::fs::read(&data).expect("read data") == data_bytes,
        "read-only image changed"
    );
    // The guest's view: base plus overlay, read back through the same backend.
    let merged = dir.as_path().join("merged.ext4");
    let disk = Disk::open(&base, &DiskMode::CopyOnWrite { overlay }).expect("open cow");
    let mut bytes = vec![0u8; disk.size() as usize];
    disk.read_at(&mut bytes, 0).expect("read merged");
    std::fs::write(&merged, bytes).expect("write merged");
    assert_eq!(ext4_cat(&merged, "/cow.txt"), "cow-write\n");
    assert_eq!(ext4_cat(&base, "/cow.txt"), "");
}
