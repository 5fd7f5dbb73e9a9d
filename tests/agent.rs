//! guest-init's agent over a real vsock: handshake, ping, and recovery from
//! malformed, unknown and oversized frames. One boot for the whole file.

mod common;

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use husk_protocol::{read_frame, Body, ErrorKind, ExecRequest, FileKind, Termination, MAX_FRAME};
use husk_vmm::host::agent_client::{AgentClient, ClientError};
use vmm_sys_util::tempdir::TempDir;

const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Connects once the guest is up (the agent listens before readiness).
fn connect_when_ready(uds: &Path) -> AgentClient {
    let deadline = Instant::now() + BOOT_TIMEOUT;
    loop {
        match AgentClient::connect(uds, READ_TIMEOUT) {
            Ok(client) => return client,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(500)),
            Err(e) => panic!("the agent never answered: {e}"),
        }
    }
}

fn argv(args: &[&str]) -> ExecRequest {
    ExecRequest {
        argv: args.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    }
}

fn agent_error(result: Result<husk_vmm::host::agent_client::ExecOutput, ClientError>) -> ErrorKind {
    match result {
        Err(ClientError::Agent { kind, .. }) => kind,
        other => panic!("expected an agent error, got {other:?}"),
    }
}

#[test]
fn agent_runs_programs_and_reports_errors_an_agent_can_act_on() {
    let dir = TempDir::new().expect("tempdir");
    let uds = dir.as_path().join("vsock.sock");
    let child = spawn(guest_command(&[
        "--vsock",
        &format!("cid=4,path={}", uds.display()),
    ]));
    let mut client = connect_when_ready(&uds);

    let echo = client
        .exec(argv(&["echo", "hello", "world"]))
        .expect("echo");
    let both = client
        .exec(argv(&[
            "/bin/sh",
            "-c",
            "echo to-out; echo to-err >&2; exit 3",
        ]))
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
            ..argv(&["/bin/sh", "-c", "echo $GREETING $(pwd)"])
        })
        .expect("env and cwd");
    let timeout = client.exec(ExecRequest {
        timeout_ms: Some(1500),
        ..argv(&["sleep", "1000"])
    });
    let missing = client.exec(argv(&["/no/such/program"]));
    let not_executable = client.exec(argv(&["/dev/null"]));
    let empty = client.exec(argv(&[]));
    let alive = client.ping();
    // The CLI mirrors the guest program: streams and exit code.
    let husk = env!("CARGO_BIN_EXE_husk");
    let cli = std::process::Command::new(husk)
        .arg("exec")
        .arg(&uds)
        .args(["--", "/bin/sh", "-c", "echo out; echo err >&2; exit 7"])
        .output()
        .expect("husk exec");
    let cli_missing = std::process::Command::new(husk)
        .arg("exec")
        .arg(&uds)
        .args(["--", "/no/such/program"])
        .output()
        .expect("husk exec");
    let host_file = dir.as_path().join("in.txt");
    std::fs::write(&host_file, b"copied through husk cp\n").expect("host file");
    let guest_spec = format!("{}:/tmp/cp.txt", uds.display());
    let back_file = dir.as_path().join("back.txt");
    let cp_in = std::process::Command::new(husk)
        .arg("cp")
        .arg(&host_file)
        .arg(&guest_spec)
        .status()
        .expect("husk cp in");
    let cp_out = std::process::Command::new(husk)
        .arg("cp")
        .arg(&guest_spec)
        .arg(&back_file)
        .status()
        .expect("husk cp out");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let run = wait(child, Duration::from_secs(60));

    assert_eq!(echo.stdout, b"hello world\n");
    assert_eq!(echo.report.termination, Termination::Code(0));
    assert_eq!(
        (both.stdout.as_slice(), both.stderr.as_slice()),
        (&b"to-out\n"[..], &b"to-err\n"[..])
    );
    assert_eq!(both.report.termination, Termination::Code(3));
    assert_eq!(stdin.stdout, b"piped input");
    assert_eq!(env_cwd.stdout, b"hi /proc\n");
    assert_eq!(agent_error(timeout), ErrorKind::Timeout);
    assert_eq!(agent_error(missing), ErrorKind::NotFound);
    assert_eq!(agent_error(not_executable), ErrorKind::PermissionDenied);
    assert_eq!(agent_error(empty), ErrorKind::Invalid);
    assert!(alive.is_ok(), "{alive:?}");
    assert_eq!(
        (cli.stdout.as_slice(), cli.stderr.as_slice()),
        (&b"out\n"[..], &b"err\n"[..])
    );
    assert_eq!(cli.status.code(), Some(7));
    assert_eq!(cli_missing.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&cli_missing.stderr).contains("NotFound"));
    assert!(cp_in.success() && cp_out.success());
    assert_eq!(
        std::fs::read(&back_file).expect("copied back"),
        b"copied through husk cp\n"
    );
    assert_eq!(run.status.code(), Some(0), "{}", run.dump());
}

/// 10 MiB that are not all alike: a xorshift stream.
fn test_content() -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..10 << 20)
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
    let dir = TempDir::new().expect("tempdir");
    let uds = dir.as_path().join("vsock.sock");
    let child = spawn(guest_command(&[
        "--vsock",
        &format!("cid=5,path={}", uds.display()),
    ]));
    let mut client = connect_when_ready(&uds);
    let content = test_content();

    let written = client
        .write_file("/tmp/big.bin", 0o640, content.as_slice())
        .expect("write");
    let mut back = Vec::new();
    let read = client.read_file("/tmp/big.bin", &mut back).expect("read");
    let seen_by_exec = client
        .exec(argv(&["/bin/sh", "-c", "wc -c < /tmp/big.bin; ls /tmp"]))
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
    let after = client.ping();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let run = wait(child, Duration::from_secs(60));

    assert_eq!(written, content.len() as u64);
    assert_eq!(read, content.len() as u64);
    assert!(
        back == content,
        "the file read back differs from what was written"
    );
    // Only the file itself: the temporary file was renamed, not left behind.
    assert_eq!(
        String::from_utf8_lossy(&seen_by_exec.stdout),
        "10485760\nbig.bin\n"
    );
    assert!(
        matches!(
            missing,
            Err(ClientError::Agent {
                kind: ErrorKind::NotFound,
                ..
            })
        ),
        "{missing:?}"
    );
    let names: Vec<&str> = listing.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, vec!["f"]);
    assert_eq!(
        (stat.kind, stat.size, stat.mode),
        (FileKind::File, 5, 0o600)
    );
    assert_eq!(renamed.size, 5);
    let conflict = matches!(
        not_empty,
        Err(ClientError::Agent {
            kind: ErrorKind::Conflict,
            ..
        })
    );
    assert!(conflict, "{not_empty:?}");
    let not_found = matches!(
        gone,
        Err(ClientError::Agent {
            kind: ErrorKind::NotFound,
            ..
        })
    );
    assert!(not_found, "{gone:?}");
    assert!(
        matches!(
            no_dir,
            Err(ClientError::Agent {
                kind: ErrorKind::NotFound,
                ..
            })
        ),
        "{no_dir:?}"
    );
    assert!(after.is_ok(), "{after:?}");
    assert_eq!(run.status.code(), Some(0), "{}", run.dump());
}

#[test]
fn agent_answers_pings_and_survives_bad_frames() {
    let dir = TempDir::new().expect("tempdir");
    let uds = dir.as_path().join("vsock.sock");
    let child = spawn(guest_command(&[
        "--vsock",
        &format!("cid=3,path={}", uds.display()),
    ]));

    let mut client = connect_when_ready(&uds);
    let first = client.ping().expect("ping");
    let second = client.ping().expect("ping again");
    // A well-delimited frame that does not decode (an unknown message type).
    {
        let (_, writer) = client.stream();
        writer
            .write_all(&[2, 0, 0, 0, 0x05, 0x63])
            .expect("write garbage");
    }
    let garbage_reply = {
        let (reader, _) = client.stream();
        read_frame(reader).expect("reply to garbage")
    };
    let after_garbage = client.ping().expect("ping after garbage");
    // An oversized frame: refused with an error, then the connection closes.
    {
        let (_, writer) = client.stream();
        writer
            .write_all(&((MAX_FRAME as u32) + 1).to_le_bytes())
            .expect("write length");
    }
    let oversize_reply = {
        let (reader, _) = client.stream();
        read_frame(reader).expect("reply to oversized frame")
    };
    let after_oversize = client.ping();
    let mut fresh = AgentClient::connect(&uds, READ_TIMEOUT).expect("new connection");
    let fresh_ping = fresh.ping().expect("ping on a new connection");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let run = wait(child, Duration::from_secs(60));

    assert!(first > 0 && second >= first, "uptimes {first} {second}");
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
    assert!(after_garbage >= second);
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
    assert_eq!(run.status.code(), Some(0), "{}", run.dump());
    assert!(run.serial.contains(" agent_port=1024"), "{}", run.dump());
}
