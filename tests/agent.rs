//! guest-init's agent over a real vsock: handshake, ping, and recovery from
//! malformed, unknown and oversized frames. One boot for the whole file.

mod common;

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use husk_protocol::{read_frame, Body, ErrorKind, MAX_FRAME};
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
