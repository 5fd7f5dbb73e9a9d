//! The embedding example (`examples/embed.rs`) against a real guest: a
//! template built, a pool filled, a sandbox claimed, a command run, all
//! destroyed, through husk-core's API alone.

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "../examples/embed.rs"]
#[allow(dead_code)]
mod embed;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `$NAME`, else what `script` (from the repository root) prints.
fn artifact(name: &str, script: &str) {
    if std::env::var_os(name).is_some() {
        return;
    }
    let out = Command::new(repo_root().join(script))
        .output()
        .unwrap_or_else(|e| panic!("{script}: {e}"));
    assert!(out.status.success(), "{script} failed");
    let path = String::from_utf8(out.stdout).expect("a path");
    // SAFETY: set before this test starts any thread of its own.
    unsafe { std::env::set_var(name, path.trim()) };
}

#[test]
fn the_embedding_example_runs_a_command_in_a_pooled_sandbox() {
    artifact("HUSK_KERNEL", "kernel-config/build.sh");
    artifact("HUSK_INITRAMFS", "guest-init/build-rootfs.sh");
    // husk-vmm is built beside this test's binary (make test builds every binary).
    let target = std::env::current_exe().expect("exe");
    let vmm = target
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join("husk-vmm");
    assert!(
        vmm.exists(),
        "{} is missing: build every binary first (`cargo build --workspace --bins`, as make test does)",
        vmm.display()
    );
    // SAFETY: as above.
    unsafe { std::env::set_var("HUSK_VMM", &vmm) };
    let state = std::env::temp_dir().join(format!("husk-embed-test-{}", std::process::id()));

    let out = embed::run(&state);

    let _ = std::fs::remove_dir_all(&state);
    let out = out.expect("the example runs");
    assert!(out.starts_with("hello from sb-"), "{out:?}");
}

/// The README's embedding example is this example's code, line for line.
#[test]
fn the_readme_shows_the_examples_code() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let example = include_str!("../examples/embed.rs");
    let block = readme
        .split("```rust\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a rust block in the README");

    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        assert!(
            example.lines().any(|e| e.trim() == line.trim()),
            "a README line that examples/embed.rs does not have: {line}"
        );
    }
}
