//! Embedding husk in a program: a host in this process, a template booted
//! once and snapshotted, a warm pool of one, a sandbox claimed from it, a
//! command run in it, and everything gone at the end.
//!
//! ```text
//! HUSK_KERNEL=$(kernel-config/build.sh) HUSK_INITRAMFS=$(guest-init/build-rootfs.sh) \
//!     HUSK_VMM=target/debug/husk-vmm cargo run -p husk-core --example embed
//! ```
//!
//! `tests/embed.rs` runs this file against a real guest.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use husk_core::config::DaemonConfig;
use husk_core::daemon::Daemon;
use husk_types::{CreateRequest, TemplateSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let state_dir = std::env::temp_dir().join(format!("husk-embed-{}", std::process::id()));
    let out = run(&state_dir);
    let _ = std::fs::remove_dir_all(&state_dir);
    print!("{}", out?);
    Ok(())
}

/// Runs the example with its state in `state_dir`; returns what the
/// guest's command printed.
pub fn run(state_dir: &std::path::Path) -> Result<String, Box<dyn std::error::Error>> {
    // The defaults `husk serve` runs with; then this program's choices.
    let mut cfg = DaemonConfig::new(state_dir);
    cfg.kernel = Some(path_from_env("HUSK_KERNEL")?);
    cfg.initramfs = Some(path_from_env("HUSK_INITRAMFS")?);
    if let Some(vmm) = std::env::var_os("HUSK_VMM") {
        cfg.set_vmm(vmm.into());
    }
    // What this program started goes with it, whatever fails on the way.
    cfg.destroy_on_stop = true;
    let host = Daemon::start(cfg)?;
    let result = claim_and_run(&host);
    host.stop();
    result
}

fn claim_and_run(host: &std::sync::Arc<Daemon>) -> Result<String, Box<dyn std::error::Error>> {
    // One boot, then a snapshot: every sandbox of "base" restores it.
    let spec = TemplateSpec::new("base");
    host.build_template(spec, "embed-example", &mut |step| {
        eprintln!("build: {step}")
    })?;

    // A warm pool of one: a clone restored and parked before anyone asks.
    host.set_pool("base", 1, "embed-example")?;
    let deadline = Instant::now() + Duration::from_secs(600);
    while !host
        .pools()?
        .iter()
        .any(|p| p.template_name == "base" && p.ready == 1)
    {
        if Instant::now() > deadline {
            return Err("the pool did not fill in 10 minutes".into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    let req = CreateRequest {
        template: "base".into(),
        ..Default::default()
    };
    let sandbox = host.create_sandbox(req, "embed-example")?;
    let ran = sandbox.exec(&["/bin/busybox", "echo", "hello from", sandbox.id()])?;
    sandbox.destroy()?;
    Ok(String::from_utf8(ran.stdout)?)
}

fn path_from_env(name: &str) -> Result<PathBuf, String> {
    std::env::var_os(name)
        .map(PathBuf::from)
        .ok_or_else(|| format!("set {name} (see this example's header)"))
}
