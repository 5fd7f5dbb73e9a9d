//! guest-init's agent over a real vsock: handshake, ping, and recovery from
//! malformed, unknown and oversized frames. One boot for the whole file.

mod common;

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use husk_protocol::{read_frame, Body, ErrorKind, ExecRequest, Termination, MAX_FRAME};
use husk_vmm::host::agent_client::{AgentClient, ClientError};
use vmm_sys_util::tempdir::TempDir;

const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Connects once the guest is up (the agent listens before readiness).
fn connect_when_ready(uds: &Path) -> AgentClient {
    let deadline = Instant::now() + BOOT_TIMEOUT;
    loop {
        match AgentClient::connect(uds, READ_TIMEOUT) {
            Ok(client) => return client,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(500));
            }
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
