//! The `husk` command line without a guest: what it says and how it exits
//! when there is nothing to talk to. (Guest tests drive it in agent.rs and
//! snapshot.rs.)

use std::process::{Command, Stdio};

fn husk(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_husk"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run husk")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn a_missing_vm_socket_is_named_and_exits_125() {
    let out = husk(&["exec", "/nonexistent/vm.vsock", "--", "true"]);

    assert_eq!(out.status.code(), Some(125));
    let err = text(&out.stderr);
    assert!(err.contains("/nonexistent/vm.vsock"), "{err}");
}

#[test]
fn a_missing_control_socket_says_what_to_start() {
    let out = husk(&["pause", "/nonexistent/vm.api"]);

    assert_eq!(out.status.code(), Some(125));
    let err = text(&out.stderr);
    assert!(err.contains("--api-sock"), "{err}");
}

#[test]
fn a_restore_of_a_directory_without_a_snapshot_fails_and_leaves_nothing() {
    let dir = std::env::temp_dir().join(format!("husk-cli-test-{}", std::process::id()));
    let run = dir.join("run");
    std::fs::create_dir_all(&dir).expect("dir");

    let out = Command::new(env!("CARGO_BIN_EXE_husk"))
        .arg("restore")
        .arg(&dir)
        .args(["--name", "none", "--run-dir"])
        .arg(&run)
        // A husk-vmm that fails at once, as one given a bad snapshot does.
        .env("HUSK_VMM", "/bin/false")
        .stdin(Stdio::null())
        .output()
        .expect("husk restore");
    let left: Vec<_> = std::fs::read_dir(&run)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);

    assert_eq!(out.status.code(), Some(125));
    assert!(
        text(&out.stderr).contains("husk-vmm exited"),
        "{}",
        text(&out.stderr)
    );
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn serve_without_a_vmm_binary_says_what_to_build() {
    let dir = std::env::temp_dir().join(format!("husk-cli-serve-{}", std::process::id()));

    let out = husk(&[
        "serve",
        "--state-dir",
        dir.to_str().expect("utf-8"),
        "--vmm",
        "/nonexistent/husk-vmm",
    ]);

    assert_eq!(out.status.code(), Some(125));
    let err = text(&out.stderr);
    assert!(
        err.contains("/nonexistent/husk-vmm") && err.contains("--vmm"),
        "{err}"
    );
    assert!(!dir.join("husk.sock").exists());
    std::fs::remove_dir_all(dir).expect("cleanup");
}

#[test]
fn a_sandbox_command_without_a_daemon_says_to_start_one() {
    let out = Command::new(env!("CARGO_BIN_EXE_husk"))
        .args(["ps"])
        .env("HUSK_HOST", "/nonexistent/husk.sock")
        .stdin(Stdio::null())
        .output()
        .expect("run husk");

    assert_eq!(out.status.code(), Some(125));
    let err = text(&out.stderr);
    assert!(err.contains("husk serve"), "{err}");
}

#[test]
fn a_template_from_a_file_that_is_not_here_says_so_before_the_daemon_is_asked() {
    // No daemon at HUSK_HOST: the check comes first.
    let build = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_husk"))
            .args(["template", "build", "t"])
            .args(args)
            .env("HUSK_HOST", "/nonexistent/husk.sock")
            .stdin(Stdio::null())
            .output()
            .expect("run husk")
    };
    let reference = build(&["--image", "python:3.12-slim"]);
    let tar = build(&["--tar", "/nonexistent/root.tar"]);

    assert_eq!(reference.status.code(), Some(2));
    let err = text(&reference.stderr);
    assert!(
        err.contains("--image python:3.12-slim")
            && err.contains("does not pull images from registries")
            && !err.contains("daemon at"),
        "{err}"
    );
    assert_eq!(tar.status.code(), Some(2));
    let err = text(&tar.stderr);
    assert!(
        err.contains("/nonexistent/root.tar") && err.contains("no such file"),
        "{err}"
    );
}
