//! A share through the real jailer (as root): the jail's uid works on the
//! owner's files as its own, what it creates is the owner's on the host,
//! files of anyone else are not its to write, and a read-only share is;
//! root's files are shared read-only only. A running jail's share is a
//! detached idmapped mount, mounted nowhere.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

use husk_jailer::{share_tree, Share};

/// Why this machine cannot run the test; with `HUSK_REQUIRE_ALL=1` (CI)
/// that is a failure.
fn skip(why: &str) {
    if std::env::var_os("HUSK_REQUIRE_ALL").is_some() {
        panic!("cannot run here: {why}");
    }
    eprintln!("skipped: {why}");
}

/// Runs `script` in a jail; whether it succeeded, its stdout, its stderr.
fn jailed(
    dir: &Path,
    name: &str,
    shares: &[(&str, &str, &Path)],
    script: &str,
) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_husk-jailer"));
    cmd.args([
        "--id", name, "--uid", "200097", "--gid", "200097", "--nofile", "64",
    ]);
    for (flag, owner, path) in shares {
        cmd.arg(flag).arg(format!("{owner}:{}", path.display()));
    }
    let out = cmd
        .args(["--", "/bin/busybox", "sh", "-c", script])
        .current_dir(dir)
        .output()
        .expect("husk-jailer");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_share_is_its_owners_on_the_host_and_the_jails_inside() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip("the jailer runs as root");
    }
    if !Path::new("/bin/busybox").exists() {
        return skip("no /bin/busybox (busybox-static) to run in the jail");
    }
    let base = std::env::temp_dir().join(format!("husk-jailer-share-{}", std::process::id()));
    let (work, src, cfg) = (base.join("work"), base.join("src"), base.join("cfg"));
    std::fs::create_dir_all(&cfg).expect("mkdir");
    // Root's, read by root only: a pod's secret volume.
    std::fs::write(cfg.join("key"), "root-only\n").expect("write");
    std::fs::set_permissions(cfg.join("key"), std::fs::Permissions::from_mode(0o600))
        .expect("chmod");
    for dir in [&work, &src] {
        std::fs::create_dir_all(dir).expect("mkdir");
        std::os::unix::fs::chown(dir, Some(1000), Some(1000)).expect("chown");
    }
    std::fs::write(work.join("owned"), "host\n").expect("write");
    std::os::unix::fs::chown(work.join("owned"), Some(1000), Some(1000)).expect("chown");
    std::fs::write(work.join("roots"), "root\n").expect("write");
    std::fs::write(src.join("code"), "code\n").expect("write");
    std::os::unix::fs::chown(src.join("code"), Some(1000), Some(1000)).expect("chown");

    let script = format!(
        "set -e; id -u; stat -c %u {w}/owned; echo jail >> {w}/owned; echo new > {w}/new; \
         mkdir {w}/dir; (echo no >> {w}/roots) && echo roots-written || echo roots-refused; \
         (echo no > {s}/new) && echo ro-written || echo ro-refused; cat {s}/code; \
         cat {c}/key; (echo no > {c}/key) && echo cfg-written || echo cfg-refused",
        w = work.display(),
        s = src.display(),
        c = cfg.display()
    );
    let (ok, out, err) = jailed(
        &base,
        "share-test",
        &[
            ("--share", "1000:1000", &work),
            ("--share-ro", "1000:1000", &src),
            ("--share-ro", "0:0", &cfg),
        ],
        &script,
    );
    let owner = |p: &Path| {
        let m = std::fs::metadata(p).expect("metadata");
        (m.uid(), m.gid())
    };
    let results = (
        std::fs::read_to_string(work.join("owned")).expect("owned"),
        owner(&work.join("new")),
        owner(&work.join("dir")),
        std::fs::read_to_string(work.join("roots")).expect("roots"),
        src.join("new").exists(),
    );
    // A share owned by root is refused before any jail is made.
    let (root_ok, _, root_err) = jailed(&base, "share-root", &[], "true");
    let refused = Command::new(env!("CARGO_BIN_EXE_husk-jailer"))
        .args(["--id", "share-bad", "--uid", "200097", "--gid", "200097"])
        .arg("--share")
        .arg(format!("0:0:{}", work.display()))
        .args(["--", "/bin/busybox", "true"])
        .output()
        .expect("husk-jailer");
    let key = std::fs::read_to_string(cfg.join("key"));
    let _ = std::fs::remove_dir_all(&base);

    assert!(ok, "{out}{err}");
    assert_eq!(key.expect("key"), "root-only\n");
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "200097",
            "200097",
            "roots-refused",
            "ro-refused",
            "code",
            "root-only",
            "cfg-refused"
        ],
        "{err}"
    );
    assert!(
        err.contains("Permission denied") && err.contains("Read-only"),
        "{err}"
    );
    assert_eq!(results.0, "host\njail\n");
    assert_eq!(results.1, (1000, 1000), "a file the jail made");
    assert_eq!(results.2, (1000, 1000), "a directory the jail made");
    assert_eq!(results.3, "root\n");
    assert!(!results.4, "the read-only share was written");
    assert!(root_ok, "{root_err}");
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("must not be root"));
}

/// What a process with the jail's ids (200098) can do on detached mounts
/// `rw` and `ro` of one directory: each check's failure is its own exit
/// code. Runs in a forked child of this (threaded) test: raw calls only.
fn as_the_jail(rw: &OwnedFd, ro: &OwnedFd) -> i32 {
    // SAFETY: the child makes only async-signal-safe calls and _exits.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork");
    if child == 0 {
        // SAFETY: plain syscalls on descriptors this process holds, C
        // string literals and stack buffers.
        let code = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            let mut root: libc::stat = std::mem::zeroed();
            let errno = || *libc::__errno_location();
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(200098) != 0
                || libc::setuid(200098) != 0
            {
                10
            } else if libc::openat(rw.as_raw_fd(), c"note".as_ptr(), libc::O_RDONLY) < 0 {
                11
            } else if libc::fstatat(rw.as_raw_fd(), c"note".as_ptr(), &mut st, 0) != 0
                || st.st_uid != 200098
            {
                12
            } else if libc::openat(
                rw.as_raw_fd(),
                c"new".as_ptr(),
                libc::O_CREAT | libc::O_WRONLY | libc::O_EXCL,
                0o644,
            ) < 0
            {
                13
            } else if libc::openat(
                ro.as_raw_fd(),
                c"ro-new".as_ptr(),
                libc::O_CREAT | libc::O_WRONLY,
                0o644,
            ) >= 0
                || errno() != libc::EROFS
            {
                14
            } else if libc::fstatat(rw.as_raw_fd(), c"../..".as_ptr(), &mut st, 0) != 0
                || libc::fstatat(rw.as_raw_fd(), c"".as_ptr(), &mut root, libc::AT_EMPTY_PATH) != 0
                || (st.st_dev, st.st_ino) != (root.st_dev, root.st_ino)
            {
                15
            } else {
                0
            }
        };
        // SAFETY: ends the child without the test harness's handlers.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: the child forked above.
    unsafe { libc::waitpid(child, &mut status, 0) };
    libc::WEXITSTATUS(status)
}

#[test]
fn a_running_jails_share_is_a_detached_idmapped_mount() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip("idmapped mounts are made as root");
    }
    let base = std::env::temp_dir().join(format!("husk-jailer-tree-{}", std::process::id()));
    let late = base.join("late");
    std::fs::create_dir_all(&late).expect("mkdir");
    std::os::unix::fs::chown(&late, Some(1000), Some(1000)).expect("chown");
    std::fs::write(late.join("note"), "late\n").expect("write");
    std::os::unix::fs::chown(late.join("note"), Some(1000), Some(1000)).expect("chown");
    let mounts = || std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let before = mounts();
    let share = |owner: (u32, u32), writable: bool, path: &Path| Share {
        path: path.to_owned(),
        owner,
        writable,
    };
    let rw = share_tree(&share((1000, 1000), true, &late), (200098, 200098)).expect("rw");
    let ro = share_tree(&share((1000, 1000), false, &late), (200098, 200098)).expect("ro");
    let code = as_the_jail(&rw, &ro);
    let during = mounts();
    let as_root = share_tree(&share((0, 0), true, &late), (200098, 200098));
    let relative = share_tree(
        &share((1000, 1000), true, Path::new("late")),
        (200098, 200098),
    );
    let for_root = share_tree(&share((1000, 1000), true, &late), (0, 0));
    let not_dir = share_tree(
        &share((1000, 1000), true, &late.join("note")),
        (200098, 200098),
    );
    let new_owner = std::fs::metadata(late.join("new")).map(|m| (m.uid(), m.gid()));
    let ro_new = late.join("ro-new").exists();
    drop((rw, ro));
    let _ = std::fs::remove_dir_all(&base);

    assert_eq!(code, 0, "the jail's checks (see as_the_jail)");
    assert_eq!(new_owner.expect("the jail's new file"), (1000, 1000));
    assert!(!ro_new);
    assert_eq!(before, during, "a detached mount is mounted nowhere");
    let refused = |r: Result<OwnedFd, husk_jailer::JailError>| r.err().map(|e| e.to_string());
    assert!(refused(as_root).is_some_and(|e| e.contains("must not be root")));
    assert!(refused(relative).is_some_and(|e| e.contains("absolute path")));
    assert!(refused(for_root).is_some_and(|e| e.contains("not root's")));
    assert!(refused(not_dir).is_some_and(|e| e.contains("not a directory")));
}
