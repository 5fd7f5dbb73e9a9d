//! guest-init's agent over a real vsock. The file boots one guest and
//! snapshots it; each test restores its own clone of it (see
//! `common::sandbox`), so tests run concurrently without sharing a guest.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use common::*;
use husk_agent_client::readiness::WaitBudget;
use husk_agent_client::{ClientError, Event, ExecOutput};
use husk_protocol::{
    write_frame, Body, ErrorKind, ExecRequest, FileKind, Frame, FsEventKind, Stream, Termination,
    User, WindowSize, MAX_FRAME,
};

fn argv(args: &[&str]) -> ExecRequest {
    ExecRequest {
        argv: args.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    }
}

fn kind<T: std::fmt::Debug>(result: Result<T, ClientError>) -> ErrorKind {
    match result {
        Err(ClientError::Agent { kind, .. }) => kind,
        other => panic!("expected an agent error, got {other:?}"),
    }
}

fn husk() -> Command {
    let mut cmd = Command::new(common::husk_binary());
    cmd.stdin(Stdio::null());
    cmd
}

#[test]
fn exec_streams_output_and_reports_how_programs_end() {
    let vm = sandbox("exec");
    let mut client = vm.client();

    let echo = client
        .exec(argv(&["echo", "hello", "world"]))
        .expect("echo");
    let both = client
        .exec(sh("echo to-out; echo to-err >&2; exit 3"))
        .expect("sh");
    let stdin = client
        .exec(ExecRequest {
            stdin: b"piped input".to_vec(),
            ..argv(&["cat"])
        })
        .expect("cat");
    let env_cwd = client
        .exec(ExecRequest {
            env: vec![("GREETING".into(), "hi".into())],
            cwd: Some("/proc".into()),
            ..sh("echo $GREETING $(pwd)")
        })
        .expect("env and cwd");
    let as_user = client
        .exec(ExecRequest {
            user: Some(User {
                uid: 1000,
                gid: 1001,
            }),
            ..sh("id -u; id -g; echo x > /root-owned 2>/dev/null || echo refused")
        })
        .expect("as user 1000");
    let signalled = client.exec(sh("kill -9 $$")).expect("killed");
    let timeout = client.exec(ExecRequest {
        timeout_ms: Some(1500),
        ..sh("sleep 1000 & sleep 1000")
    });
    // A timeout is reported once everything the program started is gone.
    let leftovers = client
        .exec(sh("ps -o comm | grep -c '^sleep' || true"))
        .expect("ps");
    let missing = client.exec(argv(&["/no/such/program"]));
    let not_in_path = client.exec(argv(&["no-such-program"]));
    let not_executable = client.exec(argv(&["/dev/null"]));
    let no_cwd = client.exec(ExecRequest {
        cwd: Some("/no/such/dir".into()),
        ..argv(&["true"])
    });
    let empty = client.exec(argv(&[]));
    let alive = client.ping();

    assert_eq!(echo.stdout, b"hello world\n");
    assert_eq!(echo.report.termination, Termination::Code(0));
    assert!(echo.pid > 1);
    assert_eq!(
        (text(&both.stdout), text(&both.stderr)),
        ("to-out\n".into(), "to-err\n".into())
    );
    assert_eq!(both.report.termination, Termination::Code(3));
    assert_eq!(stdin.stdout, b"piped input");
    assert_eq!(env_cwd.stdout, b"hi /proc\n");
    assert_eq!(text(&as_user.stdout), "1000\n1001\nrefused\n");
    assert_eq!(signalled.report.termination, Termination::Signal(9));
    assert_eq!(kind(timeout), ErrorKind::Timeout);
    // Both sleeps, the one that left for the background included, are gone.
    assert_eq!(
        (text(&leftovers.stdout), text(&leftovers.stderr)),
        ("0\n".into(), String::new())
    );
    assert_eq!(kind(missing), ErrorKind::NotFound);
    assert_eq!(kind(not_in_path), ErrorKind::NotFound);
    assert_eq!(kind(not_executable), ErrorKind::PermissionDenied);
    assert_eq!(kind(no_cwd), ErrorKind::NotFound);
    assert_eq!(kind(empty), ErrorKind::Invalid);
    assert!(alive.is_ok(), "{alive:?}");
}

/// An ext4 image of `size_mib` MiB holding `/hello` with `text`.
fn ext4_with_hello(path: &std::path::Path, size_mib: u64, text: &str) {
    ext4_with(path, size_mib, "hello", format!("{text}\n").as_bytes());
}

/// An ext4 image of `size_mib` MiB holding file `/name` with `contents`.
fn ext4_with(path: &std::path::Path, size_mib: u64, name: &str, contents: &[u8]) {
    let tree = path.with_extension("tree");
    std::fs::create_dir_all(&tree).expect("tree");
    std::fs::write(tree.join(name), contents).expect("file");
    std::fs::File::create(path)
        .and_then(|f| f.set_len(size_mib << 20))
        .expect("image");
    let made = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-O", "^has_journal", "-d"])
        .arg(&tree)
        .arg(path)
        .status()
        .expect("run mkfs.ext4");
    assert!(made.success(), "mkfs.ext4 failed");
}

#[test]
fn a_drive_takes_a_new_medium_that_becomes_a_container_root() {
    use husk_vmm_api::{Reply, Request};
    let vm = sandbox("medium");
    let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
    let (a, b) = (dir.as_path().join("a.ext4"), dir.as_path().join("b.ext4"));
    ext4_with_hello(&a, 8, "from-a");
    ext4_with_hello(&b, 16, "from-b");
    let hosts = dir.as_path().join("hosts");
    std::fs::write(&hosts, "10.0.0.7 pod\n").expect("hosts");
    let a_before = std::fs::read(&a).expect("read a");
    let (a_overlay, b_overlay) = (dir.as_path().join("a.ov"), dir.as_path().join("b.ov"));
    let medium = |path: &std::path::Path, overlay: Option<&std::path::Path>| Request::Medium {
        drive: SLOT.into(),
        path: path.to_owned(),
        overlay: overlay.map(|o| o.to_owned()),
    };
    let mut client = vm.client();

    let put_a = control(&vm.api, &medium(&a, Some(&a_overlay)));
    let mounted_a = client.mount_medium(SLOT, 8 << 20, "/ctr/a/root");
    let files = client.unpack_files("/ctr/a/files", &[("etc/hosts".into(), hosts.clone())]);
    let bound = client.mount("/ctr/a/root", "/ctr/a/files/etc/hosts", "etc/hosts", false);
    let on_a = client
        .exec(sh(
            "cd /ctr/a/root && cat hello etc/hosts && ls && echo written > new",
        ))
        .expect("exec on a");
    let busy = client.mount_medium(SLOT, 8 << 20, "/ctr/again/root");
    let removed_a = client.remove("/ctr/a", true);
    let put_b = control(&vm.api, &medium(&b, Some(&b_overlay)));
    let mounted_b = client.mount_medium(SLOT, 16 << 20, "/ctr/b/root");
    let on_b = client
        .exec(sh("cd /ctr/b/root && cat hello && ls"))
        .expect("exec on b");
    let reused_overlay = control(&vm.api, &medium(&a, Some(&b_overlay)));
    let no_drive = control(
        &vm.api,
        &Request::Medium {
            drive: "nope".into(),
            path: a.clone(),
            overlay: None,
        },
    );
    let no_file = control(&vm.api, &medium(&dir.as_path().join("none"), None));
    let no_serial = client.mount_medium("nope", 8 << 20, "/ctr/c/root");
    let still_b = client.exec(sh("cat /ctr/b/root/hello")).expect("b again");

    assert!(
        matches!(put_a, Ok(Reply::Medium { size, .. }) if size == 8 << 20),
        "{put_a:?}"
    );
    assert!(mounted_a.is_ok(), "{mounted_a:?}");
    assert!(files.is_ok() && bound.is_ok(), "{files:?} {bound:?}");
    assert_eq!(
        text(&on_a.stdout),
        "from-a\n10.0.0.7 pod\netc\nhello\nlost+found\n",
        "{on_a:?}"
    );
    assert_eq!(kind(busy), ErrorKind::Conflict);
    assert!(removed_a.is_ok(), "{removed_a:?}");
    assert!(matches!(put_b, Ok(Reply::Medium { .. })), "{put_b:?}");
    assert!(mounted_b.is_ok(), "{mounted_b:?}");
    // A new medium: nothing of the old one's cache or the guest's writes.
    assert_eq!(
        text(&on_b.stdout),
        "from-b\nhello\nlost+found\n",
        "{on_b:?}"
    );
    assert!(
        reused_overlay
            .as_ref()
            .is_err_and(|e| e.contains("already exists")),
        "{reused_overlay:?}"
    );
    assert!(
        no_drive
            .as_ref()
            .is_err_and(|e| e.contains("no drive `nope`")),
        "{no_drive:?}"
    );
    assert!(no_file.is_err(), "{no_file:?}");
    assert_eq!(kind(no_serial), ErrorKind::NotFound);
    // Refusals leave the drive with its medium.
    assert_eq!(text(&still_b.stdout), "from-b\n", "{still_b:?}");
    assert!(
        std::fs::read(&a).expect("read a") == a_before,
        "image a changed"
    );
    assert_eq!(merged_file(&a, &a_overlay, "/new"), "written\n");
}

/// `path` in the ext4 file system that `image` under `overlay` holds,
/// read with debugfs from the merged bytes.
fn merged_file(image: &std::path::Path, overlay: &std::path::Path, path: &str) -> String {
    use husk_vmm::devices::virtio::block::{Disk, DiskMode};
    let disk = Disk::open(
        image,
        &DiskMode::CopyOnWrite {
            overlay: overlay.to_owned(),
        },
    )
    .expect("open the image under its overlay");
    let merged = overlay.with_extension("merged");
    let mut bytes = vec![0u8; disk.size() as usize];
    disk.read_at(&mut bytes, 0).expect("read merged");
    std::fs::write(&merged, bytes).expect("write merged");
    let out = Command::new("debugfs")
        .args(["-R", &format!("cat {path}")])
        .arg(&merged)
        .output()
        .expect("run debugfs");
    text(&out.stdout)
}

#[test]
fn stdin_can_be_streamed_and_programs_can_run_on_a_terminal() {
    let vm = sandbox("stdin-pty");
    let mut client = vm.client();

    // Streamed stdin: the program sees each piece, then the end.
    let mut running = client
        .start(ExecRequest {
            stdin_open: true,
            ..sh("while read line; do echo got:$line; done; echo eof")
        })
        .expect("start");
    let input = running.input();
    input.write(b"one\n").expect("stdin");
    input.write(b"two\n").expect("stdin");
    input.close().expect("close stdin");
    let mut streamed = Vec::new();
    let streamed_exit = loop {
        match running.next_event().expect("event") {
            Event::Output(Stream::Stdout, data) => streamed.extend(data),
            Event::Exited(report) => break report,
            other => panic!("unexpected {other:?}"),
        }
    };

    // A terminal of the asked size, resized while the program runs.
    let mut running = client
        .start(ExecRequest {
            pty: Some(WindowSize { rows: 24, cols: 80 }),
            stdin_open: true,
            ..sh("test -t 0 && test -t 1 && echo on-a-tty; stty size; read go; stty size")
        })
        .expect("start on a pty");
    let input = running.input();
    let mut tty_out = Vec::new();
    let mut resized = false;
    let tty_exit = loop {
        match running.next_event().expect("event") {
            Event::Output(_, data) => {
                tty_out.extend(data);
                if !resized && text(&tty_out).contains("24 80") {
                    input.resize(50, 132).expect("resize");
                    input.write(b"go\n").expect("input");
                    resized = true;
                }
            }
            Event::Exited(report) => break report,
            other => panic!("unexpected {other:?}"),
        }
    };
    let no_tty = client.start(ExecRequest {
        stdin_open: true,
        ..argv(&["cat"])
    });
    let no_tty_resize = match no_tty {
        Ok(running) => {
            let input = running.input();
            input.resize(10, 10).expect("send");
            input.close().expect("close");
            let mut running = running;
            running.next_event()
        }
        Err(e) => Err(e),
    };
    // husk exec -i forwards its stdin.
    let mut cli = husk()
        .args(["exec", "-i"])
        .arg(&vm.uds)
        .args(["--", "tr", "a-z", "A-Z"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("husk exec -i");
    cli.stdin
        .take()
        .expect("stdin")
        .write_all(b"shout\n")
        .expect("write");
    let cli = cli.wait_with_output().expect("husk exec -i");

    assert_eq!(text(&streamed), "got:one\ngot:two\neof\n");
    assert_eq!(streamed_exit.termination, Termination::Code(0));
    let tty = text(&tty_out);
    assert!(tty.contains("on-a-tty"), "{tty:?}");
    assert!(tty.contains("24 80") && tty.contains("50 132"), "{tty:?}");
    assert_eq!(tty_exit.termination, Termination::Code(0));
    assert_eq!(kind(no_tty_resize), ErrorKind::Invalid);
    assert_eq!(text(&cli.stdout), "SHOUT\n");
    assert_eq!(cli.status.code(), Some(0));
}

#[test]
fn background_programs_survive_a_reconnect_and_keep_their_output() {
    let vm = sandbox("background");
    let pid = {
        let mut first = vm.client();
        first
            .spawn(sh("echo first; echo err >&2; sleep 4; echo second; exit 4"))
            .expect("spawn")
    };
    // The first connection is gone; a new one finds the program and its output.
    let mut client = vm.client();
    let listed = client.processes().expect("ps");
    let attached = client.attach(pid).expect("attach");
    let collected = client.processes().expect("ps after");
    let again = client.attach(pid);

    // Signals, and wait.
    let sleeper = client.spawn(argv(&["sleep", "1000"])).expect("spawn sleep");
    client.signal(sleeper, libc::SIGTERM).expect("signal");
    let terminated = client.wait(sleeper).expect("wait");
    let unknown = client.signal(99999, libc::SIGTERM);

    // Output nobody reads is bounded: the oldest is dropped and counted.
    let total: u64 = 1536 << 10;
    let flood = client
        .spawn(argv(&["head", "-c", &total.to_string(), "/dev/zero"]))
        .expect("spawn flood");
    let deadline = Instant::now() + Duration::from_secs(300);
    while Instant::now() < deadline {
        let info = client.processes().expect("ps");
        if info.iter().any(|p| p.pid == flood && p.exit.is_some()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let flood_info = client.processes().expect("ps");
    let flooded = client.attach(flood).expect("attach flood");
    // husk ps / attach from the command line.
    let bg = client.spawn(sh("echo from-cli; exit 6")).expect("spawn");
    let ps = husk().arg("ps").arg(&vm.uds).output().expect("husk ps");
    let cli_attach = husk()
        .arg("attach")
        .arg(&vm.uds)
        .arg(bg.to_string())
        .output()
        .expect("husk attach");

    let mine = listed.iter().find(|p| p.pid == pid).expect("listed");
    assert!(mine.background && mine.exit.is_none(), "{mine:?}");
    assert_eq!(text(&attached.stdout), "first\nsecond\n");
    assert_eq!(text(&attached.stderr), "err\n");
    assert_eq!(attached.report.termination, Termination::Code(4));
    assert!(collected.iter().all(|p| p.pid != pid), "{collected:?}");
    assert_eq!(kind(again), ErrorKind::NotFound);
    assert_eq!(terminated.termination, Termination::Signal(libc::SIGTERM));
    assert_eq!(kind(unknown), ErrorKind::NotFound);
    let info = flood_info.iter().find(|p| p.pid == flood).expect("listed");
    assert!(
        info.buffered <= husk_protocol::OUTPUT_BUFFER as u64,
        "{info:?}"
    );
    assert!(info.lost > 0, "{info:?}");
    assert!(flooded.lost > 0, "{:?}", flooded.lost);
    assert_eq!(flooded.stdout.len() as u64 + flooded.lost, total);
    assert!(flooded.stdout.iter().all(|&b| b == 0));
    let ps = text(&ps.stdout);
    assert!(
        ps.lines()
            .any(|l| l.contains(&bg.to_string()) && l.contains("echo from-cli")),
        "{ps}"
    );
    assert_eq!(text(&cli_attach.stdout), "from-cli\n");
    assert_eq!(cli_attach.status.code(), Some(6));
}

#[test]
fn a_directory_watch_sees_what_another_exec_does() {
    let vm = sandbox("watch");
    let mut setup = vm.client();
    setup.mkdir("/tmp/watched").expect("mkdir");
    let mut watcher = vm.client();
    let mut watch = watcher.watch("/tmp/watched", true).expect("watch");

    let mut other = vm.client();
    other
        .exec(sh(
            "echo hi > /tmp/watched/new.txt; mkdir /tmp/watched/sub; \
             echo deep > /tmp/watched/sub/deep.txt; rm /tmp/watched/new.txt",
        ))
        .expect("exec");
    let wanted: Vec<(FsEventKind, &str)> = vec![
        (FsEventKind::Created, "/tmp/watched/new.txt"),
        (FsEventKind::Closed, "/tmp/watched/new.txt"),
        (FsEventKind::Created, "/tmp/watched/sub"),
        (FsEventKind::Created, "/tmp/watched/sub/deep.txt"),
        (FsEventKind::Removed, "/tmp/watched/new.txt"),
    ];
    let mut seen = Vec::new();
    while !wanted.iter().all(|(k, p)| {
        seen.iter()
            .any(|(sk, sp): &(FsEventKind, String)| sk == k && sp == p)
    }) {
        let events = watch.next_events().expect("events");
        seen.extend(events.into_iter().map(|e| (e.kind, e.path)));
    }
    let rest = watch.cancel().expect("cancel");
    let missing = watcher.watch("/tmp/not-there", false).map(|_| ());
    let after = watcher.ping();

    // Every wanted event was seen (the loop above), in order for one file.
    let pos = |k: FsEventKind, p: &str| seen.iter().position(|(sk, sp)| *sk == k && sp == p);
    assert!(
        pos(FsEventKind::Created, "/tmp/watched/new.txt")
            < pos(FsEventKind::Removed, "/tmp/watched/new.txt"),
        "{seen:?}"
    );
    assert!(rest.len() < 1000);
    assert_eq!(kind(missing), ErrorKind::NotFound);
    assert!(after.is_ok());
}

/// Bytes in the round-tripped file: four full chunks and a partial one
/// (each MiB through the guest's emulated vsock stack costs seconds here).
const TEST_FILE_BYTES: usize = 4 * husk_protocol::FILE_CHUNK + 4321;

/// Bytes that are not all alike: a xorshift stream.
fn test_content() -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..TEST_FILE_BYTES)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn files_round_trip_atomically_and_directories_can_be_managed() {
    let vm = sandbox("files");
    let mut client = vm.client();
    let content = test_content();

    let written = client
        .write_file("/tmp/big.bin", 0o640, content.as_slice())
        .expect("write");
    let mut back = Vec::new();
    let read = client.read_file("/tmp/big.bin", &mut back).expect("read");
    let seen_by_exec = client
        .exec(sh(
            "wc -c < /tmp/big.bin; ls -a /tmp | grep -c husk || true",
        ))
        .expect("wc");
    let missing = client.read_file("/tmp/nope", &mut Vec::new());
    client.mkdir("/tmp/a/b/c").expect("mkdir -p");
    client
        .write_file("/tmp/a/b/c/f", 0o600, &b"12345"[..])
        .expect("small write");
    let listing = client.list("/tmp/a/b/c").expect("list");
    let stat = client.stat("/tmp/a/b/c/f").expect("stat");
    client.rename("/tmp/a/b/c/f", "/tmp/a/b/g").expect("rename");
    let renamed = client.stat("/tmp/a/b/g").expect("stat renamed");
    let not_empty = client.remove("/tmp/a", false);
    client.remove("/tmp/a", true).expect("remove the tree");
    let gone = client.stat("/tmp/a");
    let no_dir = client.write_file("/no/such/dir/file", 0o644, &b"x"[..]);
    // husk cp both ways.
    let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
    let host_file = dir.as_path().join("in.txt");
    std::fs::write(&host_file, b"copied through husk cp\n").expect("host file");
    let guest_spec = format!("{}:/tmp/cp.txt", vm.uds.display());
    let back_file = dir.as_path().join("back.txt");
    let cp_in = husk()
        .arg("cp")
        .arg(&host_file)
        .arg(&guest_spec)
        .status()
        .expect("husk cp in");
    let cp_out = husk()
        .arg("cp")
        .arg(&guest_spec)
        .arg(&back_file)
        .status()
        .expect("husk cp out");
    // User extended attributes (E2B's file metadata), on the guest's
    // tmpfs (its root file system is one too).
    client
        .write_file("/tmp/attrs", 0o644, &b"a"[..])
        .expect("write");
    let pair = |k: &str, v: &str| (k.to_owned(), v.to_owned());
    let mut set = client
        .user_attrs(
            "/tmp/attrs",
            &[pair("e2b.owner", "alice"), pair("other", "x")],
        )
        .expect("set attributes");
    set.sort();
    let mut read_back = client
        .user_attrs("/tmp/attrs", &[])
        .expect("read attributes");
    read_back.sort();
    client
        .write_file("/attrs-on-root", 0o644, &b"b"[..])
        .expect("write on the root");
    let on_root = client.user_attrs("/attrs-on-root", &[pair("k", "v")]);
    let in_dir = client
        .dir_user_attrs("/tmp")
        .expect("a directory's attributes");
    let no_file = client.user_attrs("/tmp/nope", &[pair("k", "v")]);
    client
        .exec(sh("ln -s /tmp/attrs /tmp/attrs-link"))
        .expect("ln");
    let on_link = client.user_attrs("/tmp/attrs-link", &[pair("k", "v")]);
    let after = client.ping();

    assert_eq!(set, [pair("e2b.owner", "alice"), pair("other", "x")]);
    assert_eq!(read_back, set);
    assert_eq!(on_root.expect("attributes on the root"), [pair("k", "v")]);
    let listed: Vec<&str> = in_dir.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(listed, ["attrs"], "{in_dir:?}");
    assert_eq!(kind(no_file), ErrorKind::NotFound);
    // The kernel allows user attributes on files and directories only.
    assert_eq!(kind(on_link), ErrorKind::PermissionDenied);

    assert_eq!(written, content.len() as u64);
    assert_eq!(read, content.len() as u64);
    assert!(
        back == content,
        "the file read back differs from what was written"
    );
    // No temporary file was left behind: it was renamed into place.
    assert_eq!(
        text(&seen_by_exec.stdout),
        format!("{TEST_FILE_BYTES}\n0\n")
    );
    assert_eq!(kind(missing), ErrorKind::NotFound);
    let names: Vec<&str> = listing.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, vec!["f"]);
    assert_eq!(
        (stat.kind, stat.size, stat.mode),
        (FileKind::File, 5, 0o600)
    );
    assert_eq!(renamed.size, 5);
    assert_eq!(kind(not_empty), ErrorKind::Conflict);
    assert_eq!(kind(gone), ErrorKind::NotFound);
    assert_eq!(kind(no_dir), ErrorKind::NotFound);
    assert!(cp_in.success() && cp_out.success());
    assert_eq!(
        std::fs::read(&back_file).expect("copied back"),
        b"copied through husk cp\n"
    );
    assert!(after.is_ok(), "{after:?}");
}

#[test]
fn health_reports_the_guest_and_its_clock_can_be_set() {
    let vm = sandbox("health");
    let mut client = vm.client();
    let before = client.health().expect("health");
    let target = SystemTime::UNIX_EPOCH + Duration::from_secs(1_900_000_000); // 2030
    client.set_clock(target).expect("set clock");
    let after = client.health().expect("health");
    let year = client.exec(argv(&["date", "-u", "+%Y"])).expect("date");
    let bad = client.set_clock(SystemTime::UNIX_EPOCH - Duration::from_secs(1));
    client
        .set_clock(SystemTime::now())
        .expect("restore the clock");
    let cli = husk()
        .arg("health")
        .arg(&vm.uds)
        .output()
        .expect("husk health");

    assert!(before.uptime_ms > 0);
    assert!(before.mem_total_kib > 64 << 10, "{before:?}");
    assert!(
        before.mem_available_kib > 0 && before.mem_available_kib < before.mem_total_kib,
        "{before:?}"
    );
    assert!(before.procs >= 2, "{before:?}");
    let set_ns = 1_900_000_000_i64 * 1_000_000_000;
    assert!(
        after.unix_ns >= set_ns && after.unix_ns < set_ns + 120_000_000_000,
        "{after:?}"
    );
    assert_eq!(text(&year.stdout), "2030\n");
    assert!(bad.is_err());
    assert!(text(&cli.stdout).contains("mem_total_kib="), "{cli:?}");
}

/// The host kernel's release as (major, minor).
fn host_kernel() -> (u32, u32) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// On an emulating host a vCPU thread asks for long scheduler slices: with
/// the default ones, guests that outnumber the cores all but stop.
#[test]
fn vcpu_threads_ask_for_long_slices_on_an_emulating_host() {
    let vm = sandbox("slices");
    let slices: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", vm.pid()))
        .expect("the VMM's threads")
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with("vcpu"))
        })
        .map(|t| {
            // `se.slice : 100000000` (ns), where the host shows it.
            std::fs::read_to_string(t.path().join("sched"))
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix("se.slice"))
                .map(|v| v.trim_start_matches([' ', ':']).trim().to_owned())
                .unwrap_or_default()
        })
        .collect();

    assert_eq!(slices.len(), 1, "one vCPU thread: {slices:?}");
    let want =
        husk_vmm::vstate::kvm::is_pvm_host().then_some(husk_vmm::vstate::vcpu::PVM_VCPU_SLICE);
    match want {
        Some(slice) if host_kernel() >= (6, 12) && !slices[0].is_empty() => {
            assert_eq!(slices[0], slice.as_nanos().to_string());
        }
        Some(_) => eprintln!(
            "not checked: this host (Linux {:?}) does not show or take custom slices",
            host_kernel()
        ),
        None => eprintln!("not checked: hardware KVM keeps the scheduler's slices"),
    }
}

#[test]
fn the_rng_is_ready_before_init_and_each_clone_reseeds() {
    let (first, second) = (sandbox("rng-a"), sandbox("rng-b"));
    // The kernel log came with the snapshot: it is the boot's.
    let boot_log = first.client().exec(argv(&["dmesg"])).expect("dmesg");
    let random = |vm: &Sandbox| {
        let out = vm
            .client()
            .exec(sh("head -c 32 /dev/urandom | od -An -tx1"))
            .expect("read /dev/urandom");
        text(&out.stdout)
    };
    let (a, b) = (random(&first), random(&second));

    let log = text(&boot_log.stdout);
    let ready = log.find("crng init done");
    let init = log.find("Run /init as init process");
    assert!(
        ready.is_some() && init.is_some() && ready < init,
        "the RNG was not ready before /init:\n{log}"
    );
    // Clones of one snapshot start with the same RNG state; the
    // post-restore step's entropy and reseed make their output differ.
    assert_eq!(a.split_whitespace().count(), 32, "{a}");
    assert_ne!(a, b, "two clones read the same random bytes");
}

/// Encodes one frame, for writing raw.
fn encoded(id: u64, body: Body) -> Vec<u8> {
    let mut out = Vec::new();
    write_frame(&mut out, &Frame { id, body }).expect("encode");
    out
}

#[test]
fn requests_run_concurrently_and_bad_frames_are_survived() {
    let vm = sandbox("frames");
    let mut client = vm.client();
    let first = client.ping().expect("ping");
    // A long exec does not hold up a ping sent after it on the same connection.
    let mut both = encoded(100, Body::Exec(argv(&["sleep", "3"])));
    both.extend(encoded(101, Body::Ping));
    client.send_raw(&both).expect("send");
    let mut order = Vec::new();
    while !order
        .iter()
        .any(|(id, body)| *id == 100 && matches!(body, Body::Exited(_)))
    {
        let frame = client.read_raw().expect("frame");
        order.push((frame.id, frame.body));
    }
    // A well-delimited frame that does not decode (an unknown message type).
    client.send_raw(&[2, 0, 0, 0, 0x7f, 0x63]).expect("garbage");
    let garbage_reply = client.read_raw().expect("reply to garbage");
    let after_garbage = client.ping().expect("ping after garbage");
    // An oversized frame: refused with an error, then the connection closes.
    client
        .send_raw(&((MAX_FRAME as u32) + 1).to_le_bytes())
        .expect("write length");
    let oversize_reply = client.read_raw().expect("reply to oversized frame");
    let after_oversize = client.ping();
    let fresh_ping = vm.client().ping().expect("ping on a new connection");
    let serial = vm.serial();

    let pong = order.iter().position(|(id, _)| *id == 101);
    let exited = order
        .iter()
        .position(|(id, body)| *id == 100 && matches!(body, Body::Exited(_)));
    assert!(
        pong.is_some() && exited.is_some() && pong < exited,
        "{order:?}"
    );
    assert!(first > 0);
    assert!(
        matches!(
            garbage_reply.body,
            Body::Error {
                kind: ErrorKind::Malformed,
                ..
            }
        ),
        "{garbage_reply:?}"
    );
    assert!(after_garbage >= first);
    assert!(
        matches!(
            oversize_reply.body,
            Body::Error {
                kind: ErrorKind::TooLarge,
                ..
            }
        ),
        "{oversize_reply:?}"
    );
    assert!(
        matches!(after_oversize, Err(ClientError::Protocol(_))),
        "{after_oversize:?}"
    );
    assert!(fresh_ping >= after_garbage);
    // guest-init's console carries any panic of the agent.
    assert!(!serial.contains("panicked"), "{serial}");
}

/// A guest file read by the agent itself: no guest program runs for it
/// (a fork+exec costs seconds of emulated guest kernel here, and polling
/// with programs would take the vCPU from what the test waits for).
fn guest_file(client: &mut husk_agent_client::AgentClient, path: &str) -> String {
    try_guest_file(client, path).unwrap_or_else(|e| panic!("read {path}: {e:?}"))
}

fn try_guest_file(
    client: &mut husk_agent_client::AgentClient,
    path: &str,
) -> Result<String, ClientError> {
    let mut out = Vec::new();
    client.read_file(path, &mut out)?;
    Ok(text(&out))
}

/// The guest's sandbox cgroup (every program the agent started is below it).
const SANDBOX_CGROUP: &str = "/sys/fs/cgroup/sandbox";

/// Forks the pids controller refused in the programs' cgroups so far
/// (`pids.events` counts them in the cgroup of the process that forked).
fn refused_forks(client: &mut husk_agent_client::AgentClient) -> u64 {
    let programs = client
        .list(SANDBOX_CGROUP)
        .expect("list the sandbox cgroup");
    programs
        .iter()
        .filter(|e| e.stat.kind == FileKind::Dir)
        .filter_map(|e| {
            // A program's cgroup may go while we look.
            try_guest_file(client, &format!("{SANDBOX_CGROUP}/{}/pids.events", e.name))
                .ok()?
                .lines()
                .find_map(|l| l.strip_prefix("max ")?.trim().parse::<u64>().ok())
        })
        .sum()
}

/// Tasks in the sandbox cgroup: everything the agent's programs started.
fn sandbox_tasks(client: &mut husk_agent_client::AgentClient) -> u64 {
    guest_file(client, &format!("{SANDBOX_CGROUP}/pids.current"))
        .trim()
        .parse()
        .expect("pids.current")
}

/// Reads the sandbox's task count every `every` until `done` holds, `budget`
/// passes or `stop` says to give up; returns the last count. Checked rarely:
/// the agent's work, at full CPU weight, takes the CPU from the sandbox's
/// programs, which have the lowest.
fn watch_sandbox_tasks(
    client: &mut husk_agent_client::AgentClient,
    budget: Duration,
    every: Duration,
    done: impl Fn(u64) -> bool,
    stop: impl Fn() -> bool,
) -> u64 {
    let mut wait = WaitBudget::new(budget);
    loop {
        let tasks = sandbox_tasks(client);
        if done(tasks) || wait.expired() || stop() {
            return tasks;
        }
        std::thread::sleep(every);
    }
}

/// Waits (reading every 5 s, within `budget` or until `stop`) for the pids
/// controller to refuse a fork in the sandbox since `before` refusals. A
/// full sandbox refuses the bomb's next fork, but on a loaded emulating
/// host that fork may come many seconds after the sandbox filled.
fn watch_refused_forks(
    client: &mut husk_agent_client::AgentClient,
    before: u64,
    budget: Duration,
    stop: impl Fn() -> bool,
) -> bool {
    let mut wait = WaitBudget::new(budget);
    loop {
        if refused_forks(client) > before {
            return true;
        }
        if wait.expired() || stop() {
            return false;
        }
        std::thread::sleep(Duration::from_secs(5));
    }
}

#[test]
#[ignore = "hostile tier: minutes of emulated guest work each on a PVM host; `make test-hostile` runs it, and CI when its time allows"]
fn floods_fork_bombs_and_vanishing_clients_leave_the_agent_working() {
    let vm = sandbox("floods");
    // A client that reads some of an endless flood and then vanishes: the
    // foreground program dies with it.
    {
        let mut flooder = vm.client();
        let mut running = flooder.start(argv(&["yes", "flood"])).expect("yes");
        let mut got = 0;
        while got < (256 << 10) {
            if let Event::Output(_, data) = running.next_event().expect("output") {
                got += data.len();
            }
        }
    }
    let mut client = vm.client();
    // The agent kills it when it sees the connection end: wait until the
    // sandbox cgroup is empty.
    let yes_left = watch_sandbox_tasks(
        &mut client,
        Duration::from_secs(120),
        Duration::from_secs(2),
        |n| n == 0,
        || false,
    );
    // A flood with a timeout: output streams until the kill.
    let mut flood_bytes = 0usize;
    let timed = client.exec_streaming(
        ExecRequest {
            timeout_ms: Some(3000),
            ..argv(&["yes"])
        },
        |_, data| flood_bytes += data.len(),
    );
    // A fork bomb bounded by its pids limit; the timeout ends all of it.
    // Its first process forks once, then becomes `sleep`: it never needs a
    // fork the limit would refuse, so only the timeout ends it.
    let refused_before = refused_forks(&mut client);
    let mut bomber = vm.client();
    let bomb = std::thread::spawn(move || {
        bomber.exec(ExecRequest {
            pids_max: Some(16),
            // Long enough for a slow guest to fill its 16 pids and be
            // refused a fork first.
            timeout_ms: Some(180_000),
            ..sh("bomb() { bomb | bomb & }; bomb; exec sleep 1000")
        })
    });
    // Wait until the bomb has hit its limit, then check the agent still
    // serves requests while it runs. Nothing else runs in the sandbox, and
    // the bomb's cgroup can never hold more than 16: 16 tasks is the limit
    // reached.
    let tasks = watch_sandbox_tasks(
        &mut client,
        Duration::from_secs(300),
        Duration::from_secs(5),
        |n| n >= 16,
        || bomb.is_finished(),
    );
    let during = client.exec(argv(&["echo", "still here"]));
    let hit_limit = watch_refused_forks(
        &mut client,
        refused_before,
        Duration::from_secs(120),
        || bomb.is_finished(),
    );
    let bombed: Result<ExecOutput, ClientError> = bomb.join().expect("bomb thread");
    // The timeout is reported once every process of the bomb is gone.
    let left = sandbox_tasks(&mut client);

    assert_eq!(yes_left, 0, "the vanished client's program runs on");
    assert_eq!(kind(timed), ErrorKind::Timeout);
    assert!(flood_bytes > 0);
    assert_eq!(
        during.as_ref().map(|o| text(&o.stdout)).ok(),
        Some("still here\n".to_owned()),
        "{during:?}"
    );
    assert_eq!(tasks, 16, "the bomb never reached its pids limit");
    assert!(hit_limit, "no fork was refused");
    assert_eq!(kind(bombed), ErrorKind::Timeout);
    assert_eq!(left, 0, "processes of the bomb left");
}

#[test]
#[ignore = "hostile tier: minutes of emulated guest work each on a PVM host; `make test-hostile` runs it, and CI when its time allows"]
fn a_detached_fork_bomb_and_memory_hog_leave_the_agent_answering_until_kill_all() {
    let vm = sandbox("hostile");
    let mut client = vm.client();
    // The boundaries inside the guest: programs share the lowest CPU weight,
    // PID 1 (and so the agent) is exempt from the OOM killer, programs not.
    let weight = guest_file(&mut client, &format!("{SANDBOX_CGROUP}/cpu.weight"));
    let init_oom = guest_file(&mut client, "/proc/1/oom_score_adj");
    let program_oom = client.exec(argv(&["cat", "/proc/self/oom_score_adj"]));

    // Output past `output_max` ends the program with a limit error; the
    // client got exactly the allowance.
    let mut capped = 0usize;
    let over = client.exec_streaming(
        ExecRequest {
            output_max: Some(100_000),
            ..argv(&["yes"])
        },
        |_, data| capped += data.len(),
    );

    // A memory hog that leaves its exec (which returns at once, so its
    // timeout never applies): `dd` with a 96 MiB buffer in a 128 MiB guest,
    // again and again. Here every page it touches is a fault served by the
    // emulated guest kernel (about 200 KiB/s), so the test does not wait for
    // the OOM killer (minutes); it waits until the hog has taken 4 MiB,
    // which is kernel work that competes with the agent's.
    let available = |client: &mut husk_agent_client::AgentClient| -> u64 {
        guest_file(client, "/proc/meminfo")
            .lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("MemAvailable")
    };
    let available_before = available(&mut client);
    let started = Instant::now();
    let hog = client.exec(sh(
        "(while :; do dd if=/dev/zero of=/dev/null bs=96M count=1; done) >/dev/null 2>&1 &",
    ));
    let mut hog_kib = 0;
    let mut wait = WaitBudget::new(Duration::from_secs(300));
    while hog_kib < 4096 && !wait.expired() {
        std::thread::sleep(Duration::from_secs(3));
        hog_kib = available_before.saturating_sub(available(&mut client));
    }
    eprintln!("{:?}: the hog holds {hog_kib} KiB", started.elapsed());
    // Then a fork bomb, also detached, in a sandbox made small enough for it
    // to fill here in a minute (the default limit is three quarters of the
    // guest's threads).
    let refused_before = refused_forks(&mut client);
    let small = client.exec(sh("echo 32 > /sys/fs/cgroup/sandbox/pids.max"));
    let bomb = client.exec(sh("b() { b | b & }; b >/dev/null 2>&1"));
    // Generous: a full sandbox took up to ten minutes on a loaded emulating
    // host when this was watched with guest programs.
    let tasks = watch_sandbox_tasks(
        &mut client,
        Duration::from_secs(600),
        Duration::from_secs(5),
        |n| n >= 32,
        || false,
    );
    let full = watch_refused_forks(
        &mut client,
        refused_before,
        Duration::from_secs(120),
        || false,
    );
    eprintln!(
        "{:?}: {tasks} tasks in the sandbox, forks refused: {full}",
        started.elapsed()
    );
    // With both running: the agent answers, and a new program runs.
    let mut pings = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let pong = client.ping();
        pings.push((t.elapsed(), pong.is_ok()));
    }
    let during = client.exec(argv(&["echo", "still here"]));
    let t = Instant::now();
    let killed = client.kill_all();
    eprintln!(
        "pings with both running: {pings:?}; kill-all took {:?}: {killed:?}",
        t.elapsed()
    );
    let left = sandbox_tasks(&mut client);
    let after = client.exec(argv(&["echo", "back"]));
    let survivors: Vec<String> =
        text(&client.exec(argv(&["ps", "-o", "comm"])).expect("ps").stdout)
            .lines()
            .filter(|c| matches!(c.trim(), "sh" | "dd"))
            .map(str::to_owned)
            .collect();
    let health = client.health().expect("health");

    assert_eq!(weight, "1\n");
    assert_eq!(init_oom, "-1000\n");
    assert_eq!(
        program_oom.map(|o| text(&o.stdout)).ok().as_deref(),
        Some("0\n")
    );
    assert_eq!(kind(over), ErrorKind::Limit);
    assert_eq!(capped, 100_000);
    assert!(
        hog.is_ok() && small.is_ok() && bomb.is_ok(),
        "{hog:?} {small:?} {bomb:?}"
    );
    assert!(hog_kib >= 4096, "the memory hog never grew ({hog_kib} KiB)");
    assert_eq!(tasks, 32, "the bomb never filled the sandbox");
    assert!(full, "no fork was refused in a full sandbox");
    assert!(pings.iter().all(|(_, ok)| *ok), "{pings:?}");
    assert_eq!(
        during.as_ref().map(|o| text(&o.stdout)).ok(),
        Some("still here\n".to_owned()),
        "{during:?}"
    );
    let killed = killed.expect("kill-all");
    assert!(killed >= 16, "killed only {killed} tasks of a full sandbox");
    assert_eq!(left, 0, "tasks left in the sandbox after kill-all");
    assert_eq!(
        after.as_ref().map(|o| text(&o.stdout)).ok(),
        Some("back\n".to_owned()),
        "{after:?}"
    );
    assert!(survivors.is_empty(), "{survivors:?}");
    // The memory the hog held is back.
    assert!(
        health.mem_available_kib * 2 > health.mem_total_kib,
        "{health:?}"
    );
}

/// Memory the VMM process holds itself, in KiB: the resident set of every
/// mapping but guest memory (the snapshot's memory file, which the guest's
/// own activity pages in).
fn vmm_own_rss_kib(pid: u32) -> u64 {
    common::smaps_kib(pid, "Rss:", false)
}

#[test]
fn memory_a_clone_frees_goes_back_to_the_host_through_the_balloon() {
    const FILL_MIB: u64 = 16;
    let vm = sandbox("balloon");
    let mut client = vm.client();
    let pid = vm.pid();
    let private = || common::guest_private_kib(pid);
    let run = |client: &mut husk_agent_client::AgentClient, script: &str| {
        let out = client.exec(common::sh(script)).expect("exec");
        assert_eq!(
            out.report.termination,
            Termination::Code(0),
            "{script}: {out:?}"
        );
        text(&out.stdout)
    };
    // The guest's tmpfs takes FILL_MIB of fresh pages: private copies.
    let before = private();
    run(
        &mut client,
        &format!("dd if=/dev/zero of=/tmp/fill bs=1M count={FILL_MIB} 2>/dev/null"),
    );
    let filled = private();
    // Freed, they are reported (about 2 s later, in free blocks of 2 MiB:
    // pages freed among others that stay in use are not) and dropped: the
    // clone falls back to its snapshot's pages. At least a quarter.
    run(&mut client, "rm /tmp/fill");
    let back = FILL_MIB * 1024 / 4;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut after = private();
    while after + back > filled && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        after = private();
    }
    // The memory it got back is the guest's to use again, intact.
    let reused = run(
        &mut client,
        "seq 1 100000 > /tmp/again; cp /tmp/again /tmp/copy; \
         cmp /tmp/again /tmp/copy && tail -n 1 /tmp/copy",
    );

    assert!(
        filled >= before + FILL_MIB * 1024 * 3 / 4,
        "the fill made {} KiB of private copies ({before} -> {filled})",
        filled.saturating_sub(before)
    );
    assert!(
        after + back <= filled,
        "{} KiB of {FILL_MIB} MiB came back ({before} -> {filled} -> {after} KiB)",
        filled.saturating_sub(after)
    );
    assert_eq!(reused, "100000\n");
}

#[test]
fn memory_an_idle_guest_caches_goes_back_when_it_is_asked_to_reclaim() {
    use husk_vmm_api::{Reply, Request};
    const FILE_MIB: u64 = 24;
    let vm = sandbox("reclaim");
    let mut client = vm.client();
    let pid = vm.pid();
    let private = || common::guest_private_kib(pid);
    // A file of FILE_MIB on a mounted medium, read whole: the guest's
    // page cache holds it, in pages the device wrote (private copies on
    // the host).
    let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
    let image = dir.as_path().join("disk.ext4");
    const IMAGE_MIB: u64 = FILE_MIB + 8;
    ext4_with(
        &image,
        IMAGE_MIB,
        "big",
        &vec![0x5a_u8; (FILE_MIB << 20) as usize],
    );
    let put = control(
        &vm.api,
        &Request::Medium {
            drive: SLOT.into(),
            path: image.clone(),
            overlay: Some(dir.as_path().join("disk.overlay")),
        },
    );
    assert!(matches!(put, Ok(Reply::Medium { .. })), "{put:?}");
    client
        .mount_medium(SLOT, IMAGE_MIB << 20, "/ctr/r/root")
        .expect("mount the medium");
    // The page cache of files (tmpfs pages are counted in it too).
    let cached = |client: &mut husk_agent_client::AgentClient| {
        let out = client.exec(sh("cat /proc/meminfo")).expect("meminfo");
        let field = |name: &str| {
            text(&out.stdout)
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
                .expect(name)
        };
        field("Cached:").saturating_sub(field("Shmem:"))
    };
    let before = private();
    let read = client
        .exec(sh(
            "cat /ctr/r/root/big > /dev/null && busybox od -An -tx1 -N2 /ctr/r/root/big",
        ))
        .expect("read the file");
    let cached_read = cached(&mut client);
    let filled = private();
    // Asked to reclaim, it drops them; free page reporting (about 2 s
    // later) hands them back. At least a quarter.
    let reclaimed = client.reclaim();
    let cached_after = cached(&mut client);
    let back = FILE_MIB * 1024 / 4;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut after = private();
    while after + back > filled && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        after = private();
    }
    // What it reads again comes from the disk, intact.
    let again = client
        .exec(sh("busybox od -An -tx1 -N2 -j 12345678 /ctr/r/root/big"))
        .expect("read again");

    assert_eq!(text(&read.stdout).trim(), "5a 5a", "{read:?}");
    assert!(
        cached_read >= FILE_MIB * 1024 * 3 / 4,
        "the guest cached {cached_read} KiB"
    );
    assert!(
        filled >= before + FILE_MIB * 1024 / 2,
        "reading made {} KiB of private copies ({before} -> {filled})",
        filled.saturating_sub(before)
    );
    let (free_before, free_after) = reclaimed.expect("reclaim");
    assert!(
        free_after >= free_before + FILE_MIB * 1024 / 2,
        "the guest freed {} KiB ({free_before} -> {free_after})",
        free_after.saturating_sub(free_before)
    );
    assert!(
        cached_after + FILE_MIB * 1024 / 2 <= cached_read,
        "{cached_after} KiB still cached (was {cached_read})"
    );
    assert!(
        after + back <= filled,
        "{} KiB of the {FILE_MIB} MiB came back ({before} -> {filled} -> {after} KiB)",
        filled.saturating_sub(after)
    );
    assert_eq!(text(&again.stdout).trim(), "5a 5a", "{again:?}");
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// What a hostile-guest test sees of the VMM and the agents during attacks.
struct Watch {
    pid: u32,
    max_fds: usize,
    max_own: u64,
    /// (sent, answered)
    pings: (usize, usize),
    bystander_pings: (usize, usize),
}

impl Watch {
    /// Starts `attacks` in the guest and, every 2 s until all have ended or
    /// `budget` has passed (then SIGKILLed, their reports cut short), notes
    /// the VMM's descriptors and memory and pings this guest's agent and a
    /// neighbour's. Returns each attacker's report.
    fn attack(
        &mut self,
        client: &mut husk_agent_client::AgentClient,
        bystander: &common::Sandbox,
        attacks: &[&[&str]],
        budget: Duration,
    ) -> Vec<String> {
        let attackers: Vec<i32> = attacks
            .iter()
            .map(|args| client.spawn(argv(args)).expect("start an attacker"))
            .collect();
        let mut wait = WaitBudget::new(budget);
        while !wait.expired() {
            self.max_fds = self.max_fds.max(open_fds(self.pid));
            self.max_own = self.max_own.max(vmm_own_rss_kib(self.pid));
            self.pings.0 += 1;
            self.pings.1 += usize::from(client.ping().is_ok());
            self.bystander_pings.0 += 1;
            self.bystander_pings.1 += usize::from(bystander.client().ping().is_ok());
            let running = client.processes().expect("ps");
            if attackers
                .iter()
                .all(|a| running.iter().any(|p| p.pid == *a && p.exit.is_some()))
            {
                break;
            }
            std::thread::sleep(Duration::from_secs(2));
        }
        if wait.expired() {
            for &a in &attackers {
                let _ = client.signal(a, libc::SIGKILL);
            }
        }
        attackers
            .iter()
            .map(|&a| {
                let out = client.attach(a).expect("an attacker's report");
                format!("{}{}", text(&out.stdout), text(&out.stderr))
            })
            .collect()
    }
}

#[test]
#[ignore = "hostile tier: minutes of emulated guest work each on a PVM host; `make test-hostile` runs it, and CI when its time allows"]
fn a_guest_flooding_vsock_and_its_console_leaves_its_vmm_bounded() {
    use std::os::unix::net::UnixListener;
    let vm = sandbox("hostile-io");
    let bystander = sandbox("bystander");
    // Host port 5000 accepts every connection and never reads from it;
    // host port 5001 has nobody listening.
    let sink = UnixListener::bind(format!("{}_5000", vm.uds.display())).expect("sink");
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in sink.incoming() {
            held.extend(conn.ok());
        }
    });
    let tool = repo_root().join("target/x86_64-unknown-linux-musl/guest/husk-hostile");
    let mut client = vm.client();
    client
        .write_file(
            "/tmp/husk-hostile",
            0o755,
            std::fs::File::open(&tool).expect("husk-hostile (built with guest-init)"),
        )
        .expect("upload");
    let pid = vm.pid();
    let (fds_before, own_before) = (open_fds(pid), vmm_own_rss_kib(pid));
    // Started straight by the agent, no shell, and watched through the
    // agent's process list: a fork+exec costs seconds of emulated guest
    // kernel here, and polling with `cat` would take the vCPU the attack needs.
    let tool_path = "/tmp/husk-hostile";
    let mut watch = Watch {
        pid,
        max_fds: fds_before,
        max_own: own_before,
        pings: (0, 0),
        bystander_pings: (0, 0),
    };
    // First, alone on the guest's vCPU (on an emulating host three busy
    // programs share it and each makes about one connection a second): more
    // connections to the never-reading port than the VMM may hold at once,
    // however long the guest takes to make them (at most 900 s).
    let sink_attack = [tool_path, "vsock", "5000", "10", "160", "900"];
    let to_sink = watch.attack(
        &mut client,
        &bystander,
        &[&sink_attack],
        Duration::from_secs(900 + 300),
    );
    // Then connections to a port nobody listens on, and the console flood,
    // together for 30 s of guest time (a busy guest takes longer to notice
    // the time is up).
    let attack_s = "30";
    let to_nobody_and_console = watch.attack(
        &mut client,
        &bystander,
        &[
            &[tool_path, "vsock", "5001", attack_s],
            &[tool_path, "console", attack_s],
        ],
        Duration::from_secs(30 * 20 + 120),
    );
    let reports: Vec<String> = to_sink.into_iter().chain(to_nobody_and_console).collect();
    let [to_sink, to_nobody, console] = &reports[..] else {
        panic!("no reports: {reports:?}");
    };
    let console_file = std::fs::metadata(&vm.console).map_or(0, |m| m.len());
    let Watch {
        max_fds,
        max_own,
        pings,
        bystander_pings,
        ..
    } = watch;
    eprintln!(
        "hostile guest: {to_sink} / {to_nobody} / {console}; VMM fds {fds_before} -> max {max_fds}, \
         own memory {own_before} -> max {max_own} KiB, console file {console_file} bytes"
    );

    let connected = |line: &str| -> u64 {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix("connected="))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    // The attack happened: more connections to the never-reading port than
    // the VMM may hold at once.
    assert!(connected(to_sink) > 128, "{to_sink} {to_nobody}");
    // 128 guest connections at most, each with one host socket.
    assert!(
        max_fds <= fds_before + 128 + 8,
        "{fds_before} -> {max_fds} descriptors"
    );
    assert!(
        max_own <= own_before + 64 * 1024,
        "{own_before} -> {max_own} KiB"
    );
    assert!(
        console_file <= (4 << 20) + 4096,
        "console file of {console_file} bytes"
    );
    assert_eq!(pings.1, pings.0, "the agent missed pings during the attack");
    assert_eq!(
        bystander_pings.1, bystander_pings.0,
        "the neighbour missed pings"
    );
}

/// `script` in the guest as `user` (root if None): its stdout, or its
/// stderr as the error.
fn run_as(
    client: &mut husk_agent_client::AgentClient,
    user: Option<(u32, u32)>,
    script: &str,
) -> Result<String, String> {
    let out = client
        .exec(ExecRequest {
            user: user.map(|(uid, gid)| User { uid, gid }),
            ..sh(script)
        })
        .expect("exec");
    match out.report.termination {
        Termination::Code(0) => Ok(text(&out.stdout)),
        other => Err(format!("{other:?}: {}", text(&out.stderr))),
    }
}

#[test]
fn shared_directories_follow_the_host_both_ways_and_keep_the_guest_beneath_them() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let host = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
    let (work, src, outside) = (
        host.as_path().join("work"),
        host.as_path().join("src"),
        host.as_path().join("outside"),
    );
    for dir in [&work, &src, &outside] {
        std::fs::create_dir(dir).expect("mkdir");
    }
    std::fs::write(work.join("from-host"), "one").expect("write");
    std::fs::write(src.join("code.rs"), "fn main() {}").expect("write");
    std::fs::write(outside.join("secret"), "host only").expect("write");
    std::fs::write(work.join(".env"), "TOKEN=host-only").expect("write");
    std::os::unix::fs::symlink("/", work.join("to-root")).expect("symlink");
    std::os::unix::fs::symlink("../outside/secret", work.join("to-secret")).expect("symlink");
    // The workspace belongs to uid 1000 (the guest's `user`, too); what
    // the guest creates there is 1000's on the host, whoever creates it.
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if root {
        std::os::unix::fs::chown(&work, Some(1000), Some(1000)).expect("chown");
    } else {
        std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    }
    let work_spec = format!(
        "tag={},path={},owner=1000:1000,hide=.env",
        FS_SLOTS[0],
        work.display()
    );
    let src_spec = format!("tag={},path={},ro", FS_SLOTS[1], src.display());
    let vm = sandbox_with("shares", &["--fs", &work_spec, "--fs", &src_spec]);
    let mut client = vm.client();
    let user = Some((1000, 1000));

    let mounted = run_as(
        &mut client,
        None,
        &format!(
            "mkdir -p /mnt/work /mnt/src && mount -t virtiofs {} /mnt/work && \
             mount -t virtiofs {} /mnt/src && cat /mnt/work/from-host",
            FS_SLOTS[0], FS_SLOTS[1]
        ),
    );
    // Guest to host: root and `user` create and change files.
    let by_root = run_as(
        &mut client,
        None,
        "echo made-by-root > /mnt/work/by-root && \
                                              mkdir /mnt/work/dir && echo inner > /mnt/work/dir/f",
    );
    let by_user = run_as(
        &mut client,
        user,
        "echo made-by-user > /mnt/work/by-user && \
                                              echo more >> /mnt/work/by-user && \
                                              mv /mnt/work/by-user /mnt/work/dir/moved && \
                                              rm /mnt/work/dir/f && id -u",
    );
    // Host to guest: an edit and a new file show at once.
    std::fs::write(work.join("from-host"), "two, longer").expect("edit");
    std::fs::write(work.join("later"), "new on the host").expect("write");
    let seen = run_as(
        &mut client,
        user,
        "cat /mnt/work/from-host; echo; cat /mnt/work/later; \
                                           echo; ls /mnt/work | sort | tr '\\n' ' '",
    );
    // Read-only is refused as such; reading works. Symlinks resolve in the
    // guest's own tree, never the host's; links and renames out of the
    // share stay in the guest. One exec, a line each: `name=status:output`.
    let checks = [
        ("ro_write", "echo x > /mnt/src/new"),
        ("ro_rm", "rm /mnt/src/code.rs"),
        ("ro_read", "cat /mnt/src/code.rs"),
        ("via_root", "cat /mnt/work/to-root/proc/sys/kernel/hostname"),
        ("via_secret", "cat /mnt/work/to-secret"),
        ("link_out", "ln /mnt/work/from-host /tmp/hard"),
        (
            "moved_out",
            "mv /mnt/work/later /tmp/later && cat /tmp/later",
        ),
        // A hidden name is absent: not read, listed or written.
        ("env_read", "cat /mnt/work/.env"),
        ("env_listed", "ls -a /mnt/work | grep -c '^.env$'"),
        ("env_write", "echo TOKEN=guest > /mnt/work/.env"),
    ];
    let script: String = checks
        .iter()
        .map(|(name, cmd)| format!("o=$( ({cmd}) 2>&1 ); echo \"{name}=$?:$o\"\n"))
        .collect();
    let checked = run_as(&mut client, None, &script).expect("the checks");
    let check = |name: &str| -> (bool, String) {
        let line = checked
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("no {name} in {checked}"));
        let (status, out) = line.split_once(':').unwrap_or((line, ""));
        (status == "0", out.to_owned())
    };
    // A mounted share is not in a snapshot: refused with the reason.
    let paused = control(&vm.api, &husk_vmm_api::Request::Pause);
    let snapshot_dir = host.as_path().join("snap");
    let refused = common::snapshot(&vm.api, &snapshot_dir, false);
    let resumed = control(&vm.api, &husk_vmm_api::Request::Resume);
    // A running VM's device takes another directory (a pooled clone's
    // share): not while the guest has it mounted, nor one it lacks.
    let next = host.as_path().join("next");
    std::fs::create_dir(&next).expect("mkdir");
    std::fs::write(next.join("note"), "next share").expect("write");
    let share = |tag: &str| husk_vmm_api::Request::Share {
        spec: format!("tag={tag},path={},ro", next.display()),
    };
    let busy = control(&vm.api, &share(FS_SLOTS[0]));
    let unknown = control(&vm.api, &share("nope"));
    let unmounted = run_as(
        &mut client,
        None,
        "umount /mnt/work && umount /mnt/src && echo ok",
    );
    // Unmounted, the session is over (the guest said DESTROY): it snapshots.
    let paused_again = control(&vm.api, &husk_vmm_api::Request::Pause);
    let after = common::snapshot(&vm.api, &host.as_path().join("snap-after"), false);
    let _ = control(&vm.api, &husk_vmm_api::Request::Resume);
    let taken = control(&vm.api, &share(FS_SLOTS[0]));
    let mount_next = client.mount_share(FS_SLOTS[0], "/mnt/next/deeper", false);
    let mount_twice = client.mount_share(FS_SLOTS[0], "/mnt/again", false);
    // At its own place again (the host sends a create's shares on every
    // connection that may be first): acknowledged, not stacked.
    let mount_same = client.mount_share(FS_SLOTS[0], "/mnt/next//deeper/", false);
    let stacked = run_as(
        &mut client,
        None,
        "grep -c ' /mnt/next/deeper ' /proc/mounts",
    );
    // Root, whom the guest's permissions do not stop: the share's `ro` does.
    let next_seen = run_as(
        &mut client,
        None,
        "cat /mnt/next/deeper/note; echo; (echo x > /mnt/next/deeper/new) 2>&1 || true",
    );

    assert_eq!(mounted.as_deref(), Ok("one"), "{}", vm.serial());
    by_root.expect("root writes the workspace");
    assert_eq!(by_user.as_deref(), Ok("1000\n"));
    assert_eq!(
        std::fs::read_to_string(work.join("dir/moved")).expect("moved file"),
        "made-by-user\nmore\n"
    );
    assert!(!work.join("dir/f").exists() && !work.join("by-user").exists());
    assert_eq!(
        std::fs::read_to_string(work.join("by-root")).expect("by-root"),
        "made-by-root\n"
    );
    if root {
        for file in ["by-root", "dir", "dir/moved"] {
            let meta = std::fs::symlink_metadata(work.join(file)).expect("metadata");
            assert_eq!((meta.uid(), meta.gid()), (1000, 1000), "{file}");
        }
    }
    assert_eq!(
        seen.as_deref(),
        Ok("two, longer\nnew on the host\nby-root dir from-host later to-root to-secret ")
    );
    for name in ["ro_write", "ro_rm"] {
        let (ok, out) = check(name);
        assert!(!ok && out.contains("Read-only"), "{name}: {out}");
    }
    assert_eq!(check("ro_read"), (true, "fn main() {}".to_owned()));
    assert_eq!(std::fs::read_dir(&src).expect("src").count(), 1);
    // The guest's own hostname, not the host's.
    assert_eq!(check("via_root"), (true, "shares".to_owned()));
    assert!(!check("via_secret").0, "{checked}");
    assert!(!check("link_out").0, "{checked}");
    assert_eq!(check("moved_out"), (true, "new on the host".to_owned()));
    assert!(!check("env_read").0, "{checked}");
    assert_eq!(check("env_listed"), (false, "0".to_owned()));
    assert!(!check("env_write").0, "{checked}");
    assert_eq!(
        std::fs::read_to_string(work.join(".env")).expect(".env"),
        "TOKEN=host-only"
    );
    assert!(!work.join("later").exists());
    assert_eq!(
        std::fs::read_to_string(outside.join("secret")).expect("the secret"),
        "host only"
    );
    assert!(
        matches!(paused, Ok(husk_vmm_api::Reply::Paused { .. })),
        "{paused:?}"
    );
    assert!(
        refused.as_ref().is_err_and(|e| e.contains("mounted")),
        "{refused:?}"
    );
    assert!(!snapshot_dir.join("state").exists());
    assert!(
        matches!(resumed, Ok(husk_vmm_api::Reply::Resumed { .. })),
        "{resumed:?}"
    );
    assert_eq!(unmounted.as_deref(), Ok("ok\n"));
    assert!(paused_again.is_ok(), "{paused_again:?}");
    after.expect("a snapshot once the shares are unmounted");
    let error_of = |reply: Result<husk_vmm_api::Reply, String>| match reply {
        Err(message) => message,
        other => panic!("not refused: {other:?}"),
    };
    assert!(error_of(busy).contains("mounted"));
    assert!(error_of(unknown).contains("no shared directory `nope`"));
    assert!(
        matches!(&taken, Ok(husk_vmm_api::Reply::Share { tag, .. }) if tag == FS_SLOTS[0]),
        "{taken:?}"
    );
    mount_next.expect("the agent mounts the new share");
    mount_same.expect("the same share at its own place is acknowledged");
    assert_eq!(stacked.as_deref(), Ok("1\n"), "mounted once");
    let twice = mount_twice.expect_err("one mount per share").to_string();
    assert!(twice.contains("/mnt/next/deeper"), "{twice}");
    let next_seen = next_seen.expect("read the new share");
    assert!(
        next_seen.starts_with("next share\n") && next_seen.contains("Read-only"),
        "{next_seen}"
    );
    assert_eq!(std::fs::read_dir(&next).expect("next").count(), 1);
}
