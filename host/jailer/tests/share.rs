//! A share through the real jailer (as root): the jail's uid works on the
//! owner's files as its own, what it creates is the owner's on the host,
//! files of anyone else are not its to write, and a read-only share is;
//! root's files are shared read-only only.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

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

#[test]
fn a_running_jail_takes_a_share_under_shares_and_nothing_else() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return skip("the jailer runs as root");
    }
    if !Path::new("/bin/busybox").exists() {
        return skip("no /bin/busybox (busybox-static) to run in the jail");
    }
    let base = std::env::temp_dir().join(format!("husk-jailer-enter-{}", std::process::id()));
    let late = base.join("late");
    std::fs::create_dir_all(&late).expect("mkdir");
    std::os::unix::fs::chown(&late, Some(1000), Some(1000)).expect("chown");
    std::fs::write(late.join("note"), "late\n").expect("write");
    std::os::unix::fs::chown(late.join("note"), Some(1000), Some(1000)).expect("chown");
    // The jail waits (bounded) for its share, uses it, and waits to be
    // let go.
    let script =
        "(mkdir /shares/mine) 2>/dev/null && echo shares-writable || echo shares-refused; \
         i=0; while [ ! -e /shares/late/note ]; do i=$((i+1)); [ $i -gt 1200 ] && exit 9; \
         sleep 0.1; done; cat /shares/late/note; stat -c %u /shares/late/note; \
         echo jail > /shares/late/new; \
         i=0; while [ ! -e /shares/late/stop ]; do i=$((i+1)); [ $i -gt 1200 ] && exit 9; \
         sleep 0.1; done";
    let jail = Command::new(env!("CARGO_BIN_EXE_husk-jailer"))
        .args(["--id", "enter-test", "--uid", "200098", "--gid", "200098"])
        .args(["--", "/bin/busybox", "sh", "-c", script])
        .current_dir(&base)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("husk-jailer");
    let enter = |at: &str, owner: &str| {
        Command::new(env!("CARGO_BIN_EXE_husk-jailer"))
            .arg("--enter")
            .arg(jail.id().to_string())
            .args(["--uid", "200098", "--gid", "200098", "--at", at, "--share"])
            .arg(format!("{owner}:{}", late.display()))
            .output()
            .expect("husk-jailer --enter")
    };
    // The jail's namespaces exist once its program runs: until then the
    // entry finds the host's and refuses.
    let started = std::time::Instant::now();
    let entered = loop {
        let out = enter("/shares/late", "1000:1000");
        if out.status.success() || started.elapsed() > std::time::Duration::from_secs(60) {
            break out;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let twice = enter("/shares/late", "1000:1000");
    let escape = enter("/shares/../etc", "1000:1000");
    let as_root = enter("/shares/other", "0:0");
    std::fs::write(late.join("stop"), "").expect("write");
    let done = jail.wait_with_output().expect("the jail");
    let new_owner = std::fs::metadata(late.join("new")).map(|m| (m.uid(), m.gid()));
    let _ = std::fs::remove_dir_all(&base);

    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert!(entered.status.success(), "{}", text(&entered.stderr));
    assert!(
        done.status.success(),
        "{}{}",
        text(&done.stdout),
        text(&done.stderr)
    );
    assert_eq!(
        text(&done.stdout).lines().collect::<Vec<_>>(),
        ["shares-refused", "late", "200098"]
    );
    assert_eq!(new_owner.expect("the jail's new file"), (1000, 1000));
    assert!(
        text(&twice.stderr).contains("taken"),
        "{}",
        text(&twice.stderr)
    );
    assert!(text(&escape.stderr).contains("not a name under /shares"));
    assert!(text(&as_root.stderr).contains("must not be root"));
    assert!(!Path::new("/shares/late").exists(), "a mount on the host");
}
