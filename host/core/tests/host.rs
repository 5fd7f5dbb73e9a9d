//! The host as a library: it starts, stops (its background work joined)
//! and is gone when its last user lets it go, so a program that embeds it
//! can start another on the same state directory. No guest runs here.

use std::sync::Arc;

use husk_core::config::DaemonConfig;
use husk_core::daemon::Daemon;

#[test]
fn a_host_starts_stops_and_starts_again_on_one_state_dir_in_one_process() {
    let dir = std::env::temp_dir().join(format!("husk-core-host-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cfg = DaemonConfig::new(&dir);
    cfg.cgroups = None;
    cfg.jail = None;

    let first = Daemon::start(cfg.clone()).expect("the first host starts");
    let gone = Arc::downgrade(&first);
    first.stop();
    drop(first);
    let second = Daemon::start(cfg).expect("a second host starts on the same state dir");
    let templates = second.templates().expect("its store answers");
    second.stop();

    assert!(
        gone.upgrade().is_none(),
        "a stopped host is still referenced"
    );
    assert!(templates.is_empty());
    drop(second);
    std::fs::remove_dir_all(&dir).expect("cleanup");
}
