//! The daemon (`husk serve`) with real guests: one daemon per test binary,
//! one template booted once ("base"); every sandbox is a restore of it (or
//! of a template made from one of its sandboxes). Tests talk HTTP to the
//! daemon's Unix socket, as any client would, and check the host side
//! (processes, files) themselves.
//!
//! Tests that restart the daemon take the write side of `DAEMON_LOCK`;
//! the others hold its read side while they run.

mod common;
#[path = "common/oci.rs"]
mod oci;
use oci::{image_layer, LayerEntry};

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use base64::Engine;
use husk_client::{ApiClient, ApiClientError, Endpoint, Payload, Response};
use husk_types::{
    AuditEntry, Created, ExecEvent, MediumInfo, PoolInfo, ProcessEvent, ProcessExit, ProcessSpec,
    SandboxInfo, SandboxState, TemplateRecord, TerminalSize, VolumeInfo,
};
use serde_json::{json, Value};

/// The domain of the test daemon's front door.
const FRONT_DOMAIN: &str = "sbx.test";

/// How long a guest-side step may take here before a test gives up.
const PATIENCE: Duration = Duration::from_secs(300);

/// [`PATIENCE`] stretched by the host's load now, for a deadline set once
/// (a request's timeout): on a loaded host a guest program's fork and exec
/// take minutes of emulated work.
fn patience() -> Duration {
    husk_agent_client::readiness::stretched(PATIENCE)
}

struct TestDaemon {
    state_dir: PathBuf,
    tcp: String,
    /// Where it serves the E2B API.
    e2b: String,
    /// Where its front door serves sandboxes' ports (domain FRONT_DOMAIN).
    expose: String,
    token: String,
    child: Mutex<Option<Child>>,
}

static DAEMON_LOCK: RwLock<()> = RwLock::new(());

/// Whether a test has panicked (its daemon's log is then kept).
static FAILED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn guest_init() -> PathBuf {
    if let Some(p) = std::env::var_os("HUSK_GUEST_INIT") {
        return PathBuf::from(p);
    }
    common::initramfs(); // builds guest-init if it is not built
    let p = common::repo_root().join("target/x86_64-unknown-linux-musl/guest/guest-init");
    assert!(
        p.exists(),
        "{} is missing: run guest-init/build-rootfs.sh",
        p.display()
    );
    p
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

impl TestDaemon {
    /// Starts `husk serve` on the state dir with `extra` arguments and
    /// waits for it to answer.
    fn start(&self, extra: &[&str]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.state_dir.with_extension("log"))
            .expect("daemon log");
        let child = Command::new(common::husk_binary())
            .arg("serve")
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--kernel")
            .arg(common::kernel())
            .arg("--initramfs")
            .arg(common::initramfs())
            .arg("--guest-init")
            .arg(guest_init())
            .arg("--vmm")
            .arg(common::vmm_binary())
            .args(["--tcp", &self.tcp])
            .arg("--template-source")
            .arg(template_sources(self))
            .arg("--mount-root")
            .arg(mount_root(self))
            .args(["--mcp-max-sandboxes", "1", "--mcp-max-command-s", "60"])
            .args(["--max-processes", "3"])
            .args(["--expose", &self.expose, "--expose-domain", FRONT_DOMAIN])
            .args(["--e2b", &self.e2b, "--e2b-api-key-file"])
            .arg(self.state_dir.with_extension("e2bkeys"))
            .args(
                egress_net()
                    .map(|ns| {
                        vec![
                            "--egress-netns".to_owned(),
                            ns.path(),
                            "--egress-upstream-ca".to_owned(),
                            upstream_ca().pem_file.display().to_string(),
                        ]
                    })
                    .unwrap_or_default(),
            )
            .arg("--token-file")
            .arg(self.state_dir.with_extension("token"))
            // An emulated guest's reclaim (its page cache dropped, its
            // memory compacted) takes about 40 s of a host core here:
            // off, but where a test asks for it.
            .args(if extra.contains(&"--reclaim-idle-s") {
                &[][..]
            } else {
                &["--reclaim-idle-s", "0"][..]
            })
            .args(extra)
            // The jail needs root; without it the tests that need the jail
            // say they are skipped.
            // SAFETY: getuid cannot fail.
            .args(if unsafe { libc::getuid() } == 0 {
                &[][..]
            } else {
                &["--no-jail"][..]
            })
            .env("RUST_LOG", "husk_core=debug,husk_server=debug,info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("husk serve");
        *self.child.lock().expect("lock") = Some(child);
        let deadline = Instant::now() + patience();
        loop {
            if api().call::<Value>("GET", "/v1/info", None).is_ok() {
                return;
            }
            assert!(Instant::now() < deadline, "the daemon did not come up");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Kills the daemon (SIGKILL: no goodbye); its sandboxes run on.
    fn kill(&self) {
        if let Some(mut child) = self.child.lock().expect("lock").take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The network the daemon's egress proxy uses in these tests: a network
/// namespace of the test's own with only loopback, which also carries the
/// test server's address (198.51.100.1, a documentation range): no route
/// leads anywhere else.
/// Whatever the proxy does, no packet of it leaves this machine. Root only
/// (the daemon then runs without it, and the egress test is skipped).
struct EgressNet {
    name: String,
}

impl EgressNet {
    fn path(&self) -> String {
        format!("/run/netns/{}", self.name)
    }
}

/// The addresses the egress tests' servers listen on, inside `EgressNet`.
const EGRESS_SERVER_IP: &str = "198.51.100.1";
const EGRESS_OTHER_IP: &str = "198.51.100.2";

static EGRESS_NET: OnceLock<Option<EgressNet>> = OnceLock::new();

fn egress_net() -> Option<&'static EgressNet> {
    EGRESS_NET
        .get_or_init(|| {
            // SAFETY: getuid cannot fail.
            if unsafe { libc::getuid() } != 0 {
                return None;
            }
            let name = format!("husk-egress-{}", std::process::id());
            let ip = |args: &[&str]| {
                let out = Command::new("ip")
                    .args(args)
                    .output()
                    .expect("ip (iproute2)");
                if !out.status.success() {
                    // Nothing half made is left behind.
                    let _ = Command::new("ip").args(["netns", "delete", &name]).output();
                    panic!("ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
                }
            };
            ip(&["netns", "add", &name]);
            ip(&["-n", &name, "link", "set", "lo", "up"]);
            // The test server's address lives on loopback: no interface
            // leads anywhere, so there is no route but to it and to 127/8.
            for addr in [EGRESS_SERVER_IP, EGRESS_OTHER_IP] {
                ip(&[
                    "-n",
                    &name,
                    "addr",
                    "add",
                    &format!("{addr}/32"),
                    "dev",
                    "lo",
                ]);
            }
            Some(EgressNet { name })
        })
        .as_ref()
}

fn daemon() -> &'static TestDaemon {
    static DAEMON: OnceLock<TestDaemon> = OnceLock::new();
    DAEMON.get_or_init(|| {
        extern "C" fn cleanup() {
            let dir = std::env::temp_dir().join(format!("husk-daemon-test-{}", std::process::id()));
            common::kill_everything_under(&dir);
            common::remove_cgroups_of(&dir);
            if let Some(Some(ns)) = EGRESS_NET.get() {
                let _ = Command::new("ip")
                    .args(["netns", "delete", &ns.name])
                    .status();
            }
            let _ = std::fs::remove_dir_all(&dir);
            let _ = std::fs::remove_file(dir.with_extension("token"));
            let _ = std::fs::remove_file(dir.with_extension("e2bkeys"));
            let _ = std::fs::remove_file(dir.with_extension("upstream-ca.pem"));
            let log = dir.with_extension("log");
            if FAILED.load(std::sync::atomic::Ordering::SeqCst) {
                eprintln!(
                    "a test failed: the daemon's log is kept in {}",
                    log.display()
                );
            } else {
                let _ = std::fs::remove_file(log);
            }
        }
        // A failed test keeps the daemon's log for its diagnosis.
        let default_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            FAILED.store(true, std::sync::atomic::Ordering::SeqCst);
            default_hook(info);
        }));
        let state_dir =
            std::env::temp_dir().join(format!("husk-daemon-test-{}", std::process::id()));
        std::fs::create_dir_all(state_dir.join("sources")).expect("state dir");
        std::fs::create_dir_all(state_dir.join("shared")).expect("mount root");
        // SAFETY: registers a plain function to run at exit.
        unsafe { libc::atexit(cleanup) };
        let token = "test-token-0123456789abcdef".to_owned();
        std::fs::write(state_dir.with_extension("token"), &token).expect("token");
        std::fs::write(state_dir.with_extension("e2bkeys"), format!("{E2B_KEY}\n"))
            .expect("E2B keys");
        let d = TestDaemon {
            state_dir,
            tcp: format!("127.0.0.1:{}", free_port()),
            e2b: format!("127.0.0.1:{}", free_port()),
            expose: format!("127.0.0.1:{}", free_port()),
            token,
            child: Mutex::new(None),
        };
        d.start(&[]);
        // One empty drive and two empty file-system slots: every test's
        // sandboxes (forks and hibernations too) carry them; one test puts
        // media in the drive, one mounts host directories in the slots.
        build_template(
            "base",
            json!({
                "name": "base",
                "warmup": [["/bin/sh", "-c", "echo warm > /etc/warm"]],
                "drive_slots": 1,
                "fs_slots": 2,
            }),
        )
        .expect("the base template builds");
        d
    })
}

/// The shared daemon, held for one test (a restart waits for it).
fn shared() -> (&'static TestDaemon, RwLockReadGuard<'static, ()>) {
    let d = daemon();
    (d, DAEMON_LOCK.read().unwrap_or_else(|e| e.into_inner()))
}

/// The shared daemon, held by one test alone (for a restart, or a count
/// that concurrent tests would change).
fn exclusive() -> (&'static TestDaemon, RwLockWriteGuard<'static, ()>) {
    let d = daemon();
    (d, DAEMON_LOCK.write().unwrap_or_else(|e| e.into_inner()))
}

fn api() -> ApiClient {
    let dir = std::env::temp_dir().join(format!("husk-daemon-test-{}", std::process::id()));
    ApiClient::new(Endpoint::Unix(dir.join("husk.sock"))).with_timeout(patience())
}

/// The HTTP status of a failed call.
fn status<T: std::fmt::Debug>(result: Result<T, ApiClientError>) -> (u16, String) {
    match result {
        Err(ApiClientError::Status { status, message }) => (status, message),
        other => panic!("expected an HTTP error, got {other:?}"),
    }
}

/// Builds a template through the API, following its progress stream.
fn build_template(name: &str, spec: Value) -> Result<TemplateRecord, (u16, String)> {
    let mut resp = api()
        .send(
            "POST",
            "/v1/templates",
            Payload::Json(serde_json::to_vec(&spec).expect("json")),
        )
        .map_err(|e| status::<()>(Err(e)))?;
    while let Some(event) = resp.next_line::<Value>().expect("progress line") {
        match event["type"].as_str() {
            Some("progress") => {}
            Some("done") => {
                return Ok(serde_json::from_value(event["template"].clone()).expect("template"))
            }
            Some("error") => {
                return Err((
                    event["status"].as_u64().unwrap_or(0) as u16,
                    event["error"].as_str().unwrap_or("").to_owned(),
                ))
            }
            other => panic!("{name}: unexpected build event {other:?}"),
        }
    }
    panic!("{name}: the build stream ended without a result")
}

fn create(template: &str) -> Created {
    create_with(json!({ "template": template })).expect("create")
}

fn create_with(body: Value) -> Result<Created, ApiClientError> {
    api().call("POST", "/v1/sandboxes", Some(&body))
}

fn get(id: &str) -> Result<SandboxInfo, ApiClientError> {
    api().call("GET", &format!("/v1/sandboxes/{id}"), None)
}

fn get_template(name: &str) -> TemplateRecord {
    api()
        .call("GET", &format!("/v1/templates/{name}"), None)
        .expect("template")
}

fn destroy(id: &str) {
    api()
        .send("DELETE", &format!("/v1/sandboxes/{id}"), Payload::None)
        .expect("destroy");
}

/// What an exec printed and how it ended.
#[derive(Debug)]
struct Ran {
    stdout: String,
    stderr: String,
    code: Option<i32>,
}

/// Starts a program; its events are read from the answer as they come.
fn exec_stream(id: &str, argv: &[&str]) -> Result<Response, ApiClientError> {
    exec_stream_with(id, json!({ "argv": argv }))
}

/// Starts a program described by `spec` (the API's exec body).
fn exec_stream_with(id: &str, spec: Value) -> Result<Response, ApiClientError> {
    api().send(
        "POST",
        &format!("/v1/sandboxes/{id}/exec"),
        Payload::Json(serde_json::to_vec(&spec).expect("json")),
    )
}

fn exec(id: &str, argv: &[&str]) -> Result<Ran, ApiClientError> {
    exec_with(id, json!({ "argv": argv }))
}

/// Runs `argv` with `stdin` as its input, straight (no shell: each guest
/// process costs seconds of emulated kernel here).
fn exec_stdin(id: &str, argv: &[&str], stdin: &str) -> Ran {
    exec_with(id, json!({ "argv": argv, "stdin": stdin })).expect("exec")
}

fn exec_with(id: &str, spec: Value) -> Result<Ran, ApiClientError> {
    let mut resp = exec_stream_with(id, spec)?;
    let b64 = |d: &str| {
        String::from_utf8_lossy(
            &base64::engine::general_purpose::STANDARD
                .decode(d)
                .expect("base64"),
        )
        .into_owned()
    };
    let mut ran = Ran {
        stdout: String::new(),
        stderr: String::new(),
        code: None,
    };
    while let Some(event) = resp.next_line::<ExecEvent>()? {
        match event {
            ExecEvent::Stdout { data } => ran.stdout += &b64(&data),
            ExecEvent::Stderr { data } => ran.stderr += &b64(&data),
            ExecEvent::Exit { code, .. } => ran.code = code,
            ExecEvent::Error { error, .. } => ran.stderr += &error,
            _ => {}
        }
    }
    Ok(ran)
}

fn sh(id: &str, script: &str) -> Ran {
    exec(id, &["/bin/sh", "-c", script]).expect("exec")
}

fn upload(id: &str, path: &str, content: &[u8]) -> Result<(), ApiClientError> {
    let mut reader: &[u8] = content;
    api().send(
        "PUT",
        &format!("/v1/sandboxes/{id}/files?path={path}"),
        Payload::Stream(&mut reader),
    )?;
    Ok(())
}

fn download(id: &str, path: &str) -> Result<Vec<u8>, ApiClientError> {
    let mut resp = api().send(
        "GET",
        &format!("/v1/sandboxes/{id}/files?path={path}"),
        Payload::None,
    )?;
    let mut out = Vec::new();
    resp.read_to_end(&mut out)?;
    Ok(out)
}

/// Waits (polling every 200 ms) until `check` holds; panics with `what`.
/// The wait is [`PATIENCE`] of the CPU a quiet host gives, stretched by
/// the host's load (`WaitBudget`): on a loaded 2-core host a guest program
/// took five minutes to start listening.
fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    let mut budget = husk_agent_client::readiness::WaitBudget::new(PATIENCE);
    while !check() {
        assert!(
            !budget.expired(),
            "timed out waiting for {what} ({:?}, CPU share {:.2})",
            budget.elapsed(),
            budget.last_share()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn pool(template: &str) -> PoolInfo {
    let pools: Vec<PoolInfo> = api().call("GET", "/v1/pools", None).expect("pools");
    pools
        .into_iter()
        .find(|p| p.template_name == template)
        .unwrap_or_else(|| panic!("no pool for {template}"))
}

/// A template of its own for a test: a snapshot of a fresh base sandbox.
fn own_template(name: &str) -> TemplateRecord {
    let s = create("base");
    let t: TemplateRecord = api()
        .call(
            "POST",
            &format!("/v1/sandboxes/{}/snapshot", s.sandbox.id),
            Some(&json!({ "name": name })),
        )
        .expect("snapshot into a template");
    destroy(&s.sandbox.id);
    t
}

/// A process's v1 `cpu.shares` (None where the cpu controller is not v1).
fn cpu_shares(pid: u32) -> Option<u64> {
    let membership = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let rel = membership
        .lines()
        .find(|l| {
            l.split(':')
                .nth(1)
                .is_some_and(|c| c.split(',').any(|x| x == "cpu"))
        })?
        .rsplit(':')
        .next()?
        .trim_start_matches('/')
        .to_owned();
    let shares =
        std::fs::read_to_string(Path::new("/sys/fs/cgroup/cpu").join(rel).join("cpu.shares"))
            .ok()?;
    shares.trim().parse().ok()
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn a_sandbox_runs_commands_and_moves_files_both_ways() {
    let (_d, _g) = shared();
    let s = create("base").sandbox;

    let ran = sh(&s.id, "cat /etc/warm; hostname; echo oops >&2; exit 3");
    let content: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    upload(&s.id, "/tmp/blob", &content).expect("upload");
    let back = download(&s.id, "/tmp/blob").expect("download");

    assert_eq!(ran.stdout, format!("warm\n{}\n", s.id), "{ran:?}");
    assert_eq!(ran.stderr, "oops\n");
    assert_eq!(ran.code, Some(3));
    assert!(back == content, "the file came back different");
    destroy(&s.id);
}

#[test]
fn husk_run_rm_gives_the_command_its_streams_and_exit_code_and_removes_the_sandbox() {
    let (d, _g) = shared();

    let out = Command::new(common::husk_binary())
        .args(["run", "--rm", "base", "--", "/bin/sh", "-c"])
        .arg("echo out; echo err >&2; exit 7")
        .env("HUSK_HOST", d.state_dir.join("husk.sock"))
        .output()
        .expect("husk run");

    let (stdout, stderr) = (common::text(&out.stdout), common::text(&out.stderr));
    // stdout is the command's alone: no sandbox id after it.
    assert_eq!(stdout, "out\n", "{stderr}");
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    assert!(stderr.ends_with("err\n"), "{stderr}");
    let id = stderr.split(':').next().expect("the created line");
    assert!(id.starts_with("sb-"), "{stderr}");
    assert_eq!(status(get(id)).0, 404, "{id} is still there");
}

#[test]
fn a_pooled_create_hands_out_a_parked_clone_with_its_own_identity() {
    let (_d, _g) = shared();
    let t = own_template("pooled");
    let p: PoolInfo = api()
        .call("PUT", "/v1/pools/pooled", Some(&json!({ "size": 2 })))
        .expect("set pool");
    assert_eq!(p.target, 2);
    wait_until("the pool to fill", || pool("pooled").ready == 2);
    // Parked clones' clocks stand still: long enough parked that a clock
    // left unset would show.
    std::thread::sleep(CLOCK_LAG);

    let a = create("pooled");
    let b = create("pooled");
    // The first request after the claim set the clock before it ran.
    assert_clock_is_now(&a.sandbox.id);
    let hostnames = (
        sh(&a.sandbox.id, "hostname").stdout,
        sh(&b.sandbox.id, "hostname").stdout,
    );
    let randoms = (
        sh(&a.sandbox.id, "head -c 16 /dev/urandom | od -An -tx1").stdout,
        sh(&b.sandbox.id, "head -c 16 /dev/urandom | od -An -tx1").stdout,
    );

    assert!(a.pooled && b.pooled, "{a:?} {b:?}");
    // Parked clones yield the CPU; a claimed one gets its full share.
    if let Some(shares) = cpu_shares(a.sandbox.pid) {
        assert_eq!(shares, 1024);
    }
    assert_eq!(hostnames.0.trim(), a.sandbox.id);
    assert_eq!(hostnames.1.trim(), b.sandbox.id);
    assert_ne!(randoms.0, randoms.1, "two clones share random state");
    wait_until("the pool to refill", || pool("pooled").ready == 2);
    api()
        .call::<PoolInfo>("PUT", "/v1/pools/pooled", Some(&json!({ "size": 0 })))
        .expect("pool off");
    destroy(&a.sandbox.id);
    destroy(&b.sandbox.id);
    api()
        .send("DELETE", &format!("/v1/templates/{}", t.id), Payload::None)
        .expect("remove template");
}

#[test]
fn eight_concurrent_creates_against_a_pool_of_four_all_succeed() {
    let (_d, _g) = shared();
    own_template("pool4");
    api()
        .call::<PoolInfo>("PUT", "/v1/pools/pool4", Some(&json!({ "size": 4 })))
        .expect("set pool");
    wait_until("the pool to fill", || pool("pool4").ready == 4);

    // Four of the eight restore, at most two at a time on two cores, while
    // the pool refills behind them: each create may wait for the others.
    let create = || -> Created {
        api()
            .with_timeout(patience() * 2)
            .call(
                "POST",
                "/v1/sandboxes",
                Some(&json!({ "template": "pool4" })),
            )
            .expect("create")
    };
    let created: Vec<Created> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8).map(|_| s.spawn(create)).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("create"))
            .collect()
    });
    // No more refills while the guests run their commands.
    api()
        .call::<PoolInfo>("PUT", "/v1/pools/pool4", Some(&json!({ "size": 0 })))
        .expect("pool off");
    let ids: std::collections::BTreeSet<&str> =
        created.iter().map(|c| c.sandbox.id.as_str()).collect();
    let hostnames: Vec<(String, String)> = std::thread::scope(|s| {
        let handles: Vec<_> = created
            .iter()
            .map(|c| s.spawn(|| (c.sandbox.id.clone(), sh(&c.sandbox.id, "hostname").stdout)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("exec"))
            .collect()
    });

    assert_eq!(ids.len(), 8);
    assert!(
        created.iter().filter(|c| c.pooled).count() >= 4,
        "{created:?}"
    );
    for (id, hostname) in hostnames {
        assert_eq!(hostname.trim(), id);
    }
    for c in &created {
        destroy(&c.sandbox.id);
    }
    api()
        .send("DELETE", "/v1/templates/pool4", Payload::None)
        .expect("remove template");
}

#[test]
fn a_fork_copies_a_running_sandbox_and_its_template_creates_more() {
    let (_d, _g) = shared();
    let parent = create("base").sandbox;
    upload(&parent.id, "/root/state", b"parent's work").expect("upload");

    #[derive(serde::Deserialize)]
    struct Forked {
        template: TemplateRecord,
        sandboxes: Vec<Created>,
    }
    let forked: Forked = api()
        .call(
            "POST",
            &format!("/v1/sandboxes/{}/fork", parent.id),
            Some(&json!({ "name": "forked", "count": 2 })),
        )
        .expect("fork");
    let later = create("forked").sandbox;

    assert_eq!(forked.sandboxes.len(), 2);
    for id in forked
        .sandboxes
        .iter()
        .map(|c| c.sandbox.id.as_str())
        .chain([later.id.as_str()])
    {
        let content = download(id, "/root/state")
            .unwrap_or_else(|e| panic!("download from fork {id}: {e:?}"));
        assert_eq!(content, b"parent's work");
    }
    assert_eq!(forked.template.source, format!("sandbox:{}", parent.id));
    // The parent runs on after its fork.
    assert_eq!(sh(&parent.id, "cat /root/state").stdout, "parent's work");
    let (code, msg) = status(api().send("DELETE", "/v1/templates/forked", Payload::None));
    assert_eq!(code, 409, "{msg}");
    for c in &forked.sandboxes {
        destroy(&c.sandbox.id);
    }
    destroy(&later.id);
    destroy(&parent.id);
    api()
        .send("DELETE", "/v1/templates/forked", Payload::None)
        .expect("remove template");
}

/// Longer than [`assert_clock_is_now`] allows: a guest clock that stood
/// still this long and was not set fails it.
const CLOCK_LAG: Duration = Duration::from_secs(4);

/// The guest's wall clock, read by the sandbox's next command, lies
/// between the host's clock before and after that command (to the second).
fn assert_clock_is_now(id: &str) {
    let unix_s = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs()
    };
    let before = unix_s();
    let ran = sh(id, "date +%s");
    let after = unix_s();
    let guest: u64 = ran.stdout.trim().parse().expect("date +%s");
    assert!(
        (before.saturating_sub(1)..=after + 1).contains(&guest),
        "guest clock {guest}, host {before}..{after}: {ran:?}"
    );
}

#[test]
fn a_paused_sandbox_refuses_exec_until_resumed() {
    let (_d, _g) = shared();
    let s = create("base").sandbox;

    let paused: SandboxInfo = api()
        .call("POST", &format!("/v1/sandboxes/{}/pause", s.id), None)
        .expect("pause");
    let refused = status(exec(&s.id, &["true"]));
    std::thread::sleep(CLOCK_LAG);
    let resumed: SandboxInfo = api()
        .call("POST", &format!("/v1/sandboxes/{}/resume", s.id), None)
        .expect("resume");
    assert_clock_is_now(&s.id);
    let ran = sh(&s.id, "echo back");

    assert_eq!(paused.state, SandboxState::Paused);
    assert_eq!(refused.0, 409, "{}", refused.1);
    assert!(refused.1.contains("paused"), "{}", refused.1);
    assert_eq!(resumed.state, SandboxState::Running);
    assert_eq!(ran.stdout, "back\n");
    destroy(&s.id);
}

#[test]
fn time_to_live_destroys_or_pauses_by_policy() {
    let (d, _g) = shared();
    let doomed = create_with(json!({ "template": "base", "ttl_s": 1 }))
        .expect("create")
        .sandbox;
    let sleeper = create_with(json!({ "template": "base", "ttl_s": 3600, "on_expiry": "pause" }))
        .expect("create")
        .sandbox;
    let extended: SandboxInfo = api()
        .call(
            "PATCH",
            &format!("/v1/sandboxes/{}", sleeper.id),
            Some(&json!({ "ttl_s": 1, "labels": { "kept": "yes" } })),
        )
        .expect("patch");

    wait_until("the first sandbox's expiry", || get(&doomed.id).is_err());
    wait_until("the second sandbox's pause", || {
        get(&sleeper.id).expect("kept").state == SandboxState::Paused
    });

    assert_eq!(status(get(&doomed.id)).0, 404);
    assert!(!d.state_dir.join("sandboxes").join(&doomed.id).exists());
    assert!(!pid_alive(doomed.pid));
    assert_eq!(extended.labels.get("kept").map(String::as_str), Some("yes"));
    destroy(&sleeper.id);
}

/// The VMM a jailer started (its only child).
fn vmm_of(jailer: u32) -> u32 {
    let children = std::fs::read_to_string(format!("/proc/{jailer}/task/{jailer}/children"))
        .expect("the jailer's children");
    children
        .split_whitespace()
        .next()
        .and_then(|c| c.parse().ok())
        .expect("a VMM under the jailer")
}

/// A field of /proc/PID/status, e.g. `Uid`.
fn proc_status(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default()
}

#[test]
fn every_vmm_runs_in_a_jail_of_its_own() {
    let (d, _g) = shared();
    // SAFETY: getuid cannot fail.
    if unsafe { libc::getuid() } != 0 {
        common::skip("the jail needs root");
        return;
    }
    let a = create("base").sandbox;
    let b = create("base").sandbox;
    let (vmm_a, vmm_b) = (vmm_of(a.pid), vmm_of(b.pid));
    let ns = |pid: &str, kind: &str| std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).ok();
    let root = PathBuf::from(format!("/proc/{vmm_a}/root"));
    let template = get_template("base").snapshot_dir;
    let write_to_template = std::fs::OpenOptions::new()
        .append(true)
        .open(root.join(template.join("memory").strip_prefix("/").expect("absolute")));
    let own_run_dir = d.state_dir.join("sandboxes").join(&a.id);
    let in_jail = |p: &Path| root.join(p.strip_prefix("/").expect("absolute")).exists();

    let uid_a = proc_status(vmm_a, "Uid");
    let uid_b = proc_status(vmm_b, "Uid");
    assert!(!uid_a.starts_with("0\t"), "the VMM runs as root: {uid_a}");
    assert_ne!(uid_a, uid_b, "two VMMs share a uid");
    assert_eq!(proc_status(vmm_a, "Gid"), uid_a, "its gid is its uid");
    assert_eq!(proc_status(vmm_a, "Groups"), "");
    assert_eq!(proc_status(vmm_a, "NoNewPrivs"), "1");
    assert_eq!(proc_status(vmm_a, "Seccomp"), "2", "no seccomp filter");
    assert_eq!(proc_status(vmm_a, "CapEff"), "0000000000000000");
    assert_eq!(proc_status(vmm_a, "CapBnd"), "0000000000000000");
    assert!(
        proc_status(vmm_a, "NSpid").ends_with("\t1"),
        "PID 1 of its own PID namespace"
    );
    // The jailer that stays beside it (the sandbox's pid) keeps nothing
    // either, and may only wait and pass signals on.
    let jailer = a.pid;
    assert_eq!(proc_status(jailer, "Uid"), uid_a, "the jailer keeps root");
    assert_eq!(proc_status(jailer, "NoNewPrivs"), "1");
    assert_eq!(
        proc_status(jailer, "Seccomp"),
        "2",
        "the jailer has no filter"
    );
    assert_eq!(proc_status(jailer, "CapEff"), "0000000000000000");
    assert_eq!(proc_status(jailer, "CapBnd"), "0000000000000000");
    for kind in ["mnt", "pid", "net", "ipc", "uts"] {
        let own = ns(&vmm_a.to_string(), kind);
        assert!(own.is_some(), "no {kind} namespace");
        assert_ne!(
            own,
            ns("self", kind),
            "{kind} namespace shared with the host"
        );
        assert_ne!(own, ns(&vmm_b.to_string(), kind), "{kind} namespace shared");
    }
    assert!(
        in_jail(&own_run_dir.join("vsock")),
        "its own files are there"
    );
    assert!(in_jail(Path::new("/dev/kvm")));
    assert!(
        !in_jail(Path::new("/dev/net/tun")),
        "a TAP device without a NIC"
    );
    assert!(
        !in_jail(Path::new("/etc/passwd")),
        "the host's files are visible"
    );
    assert!(
        !in_jail(&d.state_dir.join("husk.db")),
        "the daemon's store is visible"
    );
    assert!(
        !in_jail(&d.state_dir.join("sandboxes").join(&b.id)),
        "another sandbox's files are visible"
    );
    let refused = write_to_template.expect_err("the template is writable from the jail");
    assert_eq!(refused.raw_os_error(), Some(libc::EROFS), "{refused}");
    assert_eq!(sh(&a.id, "echo jailed").stdout, "jailed\n");
    destroy(&a.id);
    destroy(&b.id);
}

/// A tar archive of one file, `../escape`, that leaves the tree.
fn escaping_tar() -> Vec<u8> {
    let mut header = tar::Header::new_gnu();
    header.set_size(1);
    header.set_mode(0o644);
    header.set_entry_type(tar::EntryType::Regular);
    let name = b"../escape";
    header.as_old_mut().name[..name.len()].copy_from_slice(name);
    header.set_cksum();
    let mut out = Vec::new();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&[b'x'; 512]);
    out.extend_from_slice(&[0; 1024]);
    out
}

#[test]
fn a_sandbox_drive_takes_an_uploaded_tree_as_a_medium_the_guest_mounts() {
    let (d, _g) = shared();
    let s = create("base").sandbox;
    let tree = vmm_sys_util::tempdir::TempDir::new().expect("tree");
    std::fs::create_dir(tree.as_path().join("etc")).expect("etc");
    std::fs::write(tree.as_path().join("etc/motd"), "from-the-medium\n").expect("motd");
    let media_dir = d.state_dir.join("media");
    let hostile = api()
        .upload(&mut escaping_tar().as_slice())
        .expect("upload");
    let medium = |upload: &str| -> Result<MediumInfo, ApiClientError> {
        api().call(
            "POST",
            &format!("/v1/sandboxes/{}/media", s.id),
            Some(&json!({ "upload": upload })),
        )
    };
    let mount = |m: &MediumInfo, at: &str| {
        let agent = s.agent_socket.as_deref().expect("the agent's socket");
        husk_agent_client::AgentClient::connect(Path::new(agent), patience())
            .and_then(|mut a| a.mount_medium(&m.drive, m.size, at))
    };

    let refused = status(medium(&hostile));
    let malformed = status(api().send(
        "POST",
        &format!("/v1/sandboxes/{}/media", s.id),
        Payload::Json(br#"{"upload":"up-x","path":"/etc"}"#.to_vec()),
    ));
    let first = api()
        .insert_medium(&s.id, tree.as_path())
        .expect("a medium");
    let mounted = mount(&first, "/mnt/m");
    let read = sh(
        &s.id,
        "cat /mnt/m/etc/motd && echo changed > /mnt/m/etc/motd",
    );
    let full = status(api().insert_medium(&s.id, tree.as_path()));
    let no_snapshot = status(api().snapshot(&s.id, "with-media"));
    let unmounted = sh(&s.id, "umount /mnt/m && rmdir /mnt/m");
    let released = api().release_drive(&s.id, &first.drive);
    let released_again = status(api().release_drive(&s.id, &first.drive));
    let second = api()
        .insert_medium(&s.id, tree.as_path())
        .expect("the same tree again");
    let mounted_again = mount(&second, "/mnt/again");
    let read_again = sh(&s.id, "cat /mnt/again/etc/motd");
    let images: Vec<_> = std::fs::read_dir(&media_dir)
        .expect("media dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    destroy(&s.id);

    assert_eq!(refused.0, 400, "{refused:?}");
    assert!(refused.1.contains("../escape"), "{refused:?}");
    assert_eq!(malformed.0, 400, "{malformed:?}");
    // The refusals left the drive free.
    assert_eq!(first.drive, "slot0");
    assert!(mounted.is_ok(), "{mounted:?}");
    assert_eq!(read.stdout, "from-the-medium\n", "{read:?}");
    assert_eq!(full.0, 429, "{full:?}");
    assert_eq!(no_snapshot.0, 409, "{no_snapshot:?}");
    assert!(no_snapshot.1.contains("slot0"), "{no_snapshot:?}");
    assert_eq!(unmounted.code, Some(0), "{unmounted:?}");
    assert!(released.is_ok(), "{released:?}");
    assert_eq!(released_again.0, 404, "{released_again:?}");
    // The same tree: the same image, made once; the sandbox's writes
    // went to its overlay, not the image.
    assert_eq!(second.image, first.image);
    assert!(mounted_again.is_ok(), "{mounted_again:?}");
    assert_eq!(read_again.stdout, "from-the-medium\n", "{read_again:?}");
    assert_eq!(images, [format!("{}.ext4", first.image)]);
}

/// Host directories mounted at create: live both ways, the directory
/// owner's on the host whoever writes in the guest, read-only where asked,
/// hidden names absent; a clone claimed from the pool takes them as a
/// restored one does; such a sandbox pauses and resumes with them but
/// neither hibernates nor snapshots, and destroying it leaves the
/// directories.
#[test]
fn host_directories_mounted_at_create_are_live_both_ways_even_from_the_pool() {
    let (d, _g) = shared();
    // SAFETY: getuid cannot fail.
    let root = unsafe { libc::getuid() } == 0;
    let dir = |name: &str, files: &[(&str, &str)]| {
        let path = mount_root(d).join(name);
        std::fs::create_dir(&path).expect("a host directory");
        for (file, text) in files {
            std::fs::write(path.join(file), text).expect("a host file");
        }
        if root {
            // An owner who is neither root nor the guest's user: the
            // mapping shows.
            for entry in std::fs::read_dir(&path).expect("list").flatten() {
                std::os::unix::fs::chown(entry.path(), Some(4242), Some(4242)).expect("chown");
            }
            std::os::unix::fs::chown(&path, Some(4242), Some(4242)).expect("chown");
        }
        path
    };
    let work = dir(
        "work",
        &[
            ("note", "from-the-host\n"),
            (".env", "TOKEN=secret\n"),
            ("id.key", "PRIVATE\n"),
            (".sandboxignore", "# keys stay on the host\n\n*.key\n"),
        ],
    );
    let docs = dir("docs", &[("readme", "read-me\n")]);
    let mounts = json!([
        { "host": work, "guest": "/home/user/work", "hide": [".env"] },
        { "host": docs, "guest": "/mnt/docs", "readonly": true },
    ]);
    let t = own_template("mounting");
    api()
        .call::<PoolInfo>("PUT", "/v1/pools/mounting", Some(&json!({ "size": 1 })))
        .expect("set pool");
    wait_until("the pool to fill", || pool("mounting").ready == 1);
    let owner_of = |path: &Path| {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).expect("stat");
        (meta.uid(), meta.gid())
    };

    let created = create_with(json!({ "template": "mounting", "mounts": mounts }))
        .expect("create with mounts");
    let id = created.sandbox.id.clone();
    let as_user = exec_with(
        &id,
        json!({
            "argv": ["/bin/sh", "-c", "cd /home/user/work && cat note && ls -A && \
                stat -c %u:%g note && echo from-the-guest > made && mkdir sub && \
                cat /mnt/docs/readme && (echo x > /mnt/docs/new) 2>&1; ls /mnt/docs"],
            "user": { "uid": 1000, "gid": 1000 },
        }),
    )
    .expect("exec as the user");
    let as_root = sh(&id, "echo by-root > /home/user/work/root-made");
    std::fs::write(work.join("later"), "written-on-the-host\n").expect("a host write");
    let live = sh(&id, "cat /home/user/work/later /home/user/work/made");
    let hidden = sh(
        &id,
        "cd /home/user/work && (cat .env || cat id.key || cat .sandboxignore || \
         echo x > .sandboxignore)",
    );
    let no_hibernation = status(api().hibernate(&id));
    let no_snapshot = status(api().snapshot(&id, "with-mounts"));
    api().pause(&id).expect("pause");
    api().resume(&id).expect("resume");
    let still = sh(&id, "cat /home/user/work/note");
    destroy(&id);
    api()
        .call::<PoolInfo>("PUT", "/v1/pools/mounting", Some(&json!({ "size": 0 })))
        .expect("pool off");
    api()
        .send("DELETE", &format!("/v1/templates/{}", t.id), Payload::None)
        .expect("remove template");

    assert!(created.pooled, "{created:?}");
    let guests: Vec<&str> = created
        .sandbox
        .mounts
        .iter()
        .map(|m| m.guest.as_str())
        .collect();
    assert_eq!(guests, ["/home/user/work", "/mnt/docs"]);
    assert_eq!(
        created.sandbox.mounts[0].hide,
        [".env", ".sandboxignore", "*.key"]
    );
    let lines: Vec<&str> = as_user.stdout.lines().collect();
    assert_eq!(
        lines[..4],
        ["from-the-host", "note", "1000:1000", "read-me"],
        "{as_user:?}"
    );
    assert!(lines[4].contains("Read-only file system"), "{as_user:?}");
    assert_eq!(lines[5..], ["readme"], "{as_user:?}");
    assert_eq!(as_root.code, Some(0), "{as_root:?}");
    assert_eq!(
        live.stdout, "written-on-the-host\nfrom-the-guest\n",
        "{live:?}"
    );
    assert_ne!(hidden.code, Some(0), "{hidden:?}");
    assert_eq!(no_hibernation.0, 409, "{no_hibernation:?}");
    assert!(
        no_hibernation.1.contains("/home/user/work"),
        "{no_hibernation:?}"
    );
    assert_eq!(no_snapshot.0, 409, "{no_snapshot:?}");
    assert_eq!(still.stdout, "from-the-host\n", "{still:?}");
    // Destroy left the host's files, the guest's among them.
    assert_eq!(
        std::fs::read_to_string(work.join("made")).expect("made"),
        "from-the-guest\n"
    );
    assert!(work.join("sub").is_dir());
    assert_eq!(
        std::fs::read_to_string(work.join(".env")).expect(".env"),
        "TOKEN=secret\n"
    );
    assert_eq!(
        std::fs::read_to_string(work.join(".sandboxignore")).expect(".sandboxignore"),
        "# keys stay on the host\n\n*.key\n"
    );
    assert!(!docs.join("new").exists());
    if root {
        for made in ["made", "sub", "root-made"] {
            assert_eq!(owner_of(&work.join(made)), (4242, 4242), "{made}");
        }
    }
}

/// A named volume: written by one sandbox, seen by another mounting it at
/// the same time and by one after, kept when they go, refused deletion
/// while mounted, and gone with its files when deleted.
#[test]
fn a_named_volume_outlives_its_sandboxes_and_goes_only_unmounted() {
    let (d, _g) = shared();
    let volume = |body: Value| -> Result<VolumeInfo, ApiClientError> {
        api().call("POST", "/v1/volumes", Some(&body))
    };
    let at_data =
        |v: &str| json!({ "template": "base", "mounts": [{ "volume": v, "guest": "/data" }] });

    let made = volume(json!({ "name": "cache" })).expect("a volume");
    let again = status(volume(json!({ "name": "cache" })));
    let badly_named = status(volume(json!({ "name": "../x" })));
    let unknown = status(create_with(at_data("nope")));
    let a = create_with(at_data("cache")).expect("a sandbox with the volume");
    let wrote = exec_with(
        &a.sandbox.id,
        json!({
            "argv": ["/bin/sh", "-c", "echo from-a > /data/f && mkdir /data/d"],
            "user": { "uid": 1000, "gid": 1000 },
        }),
    )
    .expect("exec");
    let b = create_with(at_data(&made.id)).expect("a second sandbox with the volume");
    let both = sh(&b.sandbox.id, "cat /data/f && echo from-b > /data/d/g");
    // A running sandbox takes one more mount in its free slot (as a pod's
    // volume comes): a host directory of someone's, and a root's one
    // read-only (root's files root's in the guest); a root's one written,
    // a repeated guest path, a third slot and no sandbox are refused.
    // SAFETY: getuid cannot fail.
    let root = unsafe { libc::getuid() } == 0;
    let late = mount_root(d).join("late");
    std::fs::create_dir_all(&late).expect("a host directory");
    std::fs::write(late.join("x"), "late-file\n").expect("a host file");
    if root {
        std::os::unix::fs::chown(&late, Some(4242), Some(4242)).expect("chown");
    }
    let roots = mount_root(d).join("roots");
    std::fs::create_dir_all(&roots).expect("a host directory");
    let add = |id: &str, body: Value| {
        api().call::<SandboxInfo>("POST", &format!("/v1/sandboxes/{id}/mounts"), Some(&body))
    };
    let added = add(&b.sandbox.id, json!({ "host": late, "guest": "/late" }));
    let seen_late = sh(&b.sandbox.id, "cat /late/x && echo from-b > /late/y");
    let roots_written = status(add(&a.sandbox.id, json!({ "host": roots, "guest": "/r" })));
    let same_place = status(add(
        &a.sandbox.id,
        json!({ "host": late, "guest": "/data" }),
    ));
    let roots_read = add(
        &a.sandbox.id,
        json!({ "host": roots, "guest": "/r", "readonly": true }),
    );
    let seen_roots = sh(&a.sandbox.id, "stat -c %u:%g /r; touch /r/z 2>&1");
    let no_slot = status(add(
        &b.sandbox.id,
        json!({ "host": late, "guest": "/third" }),
    ));
    let nobody = status(add("sb-nope", json!({ "host": late, "guest": "/late" })));
    let listed: VolumeInfo = api()
        .call("GET", "/v1/volumes/cache", None)
        .expect("the volume");
    let busy = status(api().send("DELETE", "/v1/volumes/cache", Payload::None));
    destroy(&a.sandbox.id);
    destroy(&b.sandbox.id);
    let dir = d.state_dir.join("volumes").join(&made.id);
    let kept = std::fs::read_to_string(dir.join("d/g"));
    let owner = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(dir.join("f")).map(|m| (m.uid(), m.gid()))
    };
    let deleted = api().send("DELETE", "/v1/volumes/cache", Payload::None);
    let after = status(api().call::<VolumeInfo>("GET", "/v1/volumes/cache", None));

    assert_eq!(made.name, "cache");
    assert!(made.mounted_by.is_empty());
    assert_eq!(again.0, 409, "{again:?}");
    assert_eq!(badly_named.0, 400, "{badly_named:?}");
    assert!(badly_named.1.contains("volume name"), "{badly_named:?}");
    assert_eq!(unknown.0, 400, "{unknown:?}");
    assert!(unknown.1.contains("no volume `nope`"), "{unknown:?}");
    assert_eq!(wrote.code, Some(0), "{wrote:?}");
    assert_eq!(both.stdout, "from-a\n", "{both:?}");
    let added = added.expect("a mount added");
    let guests: Vec<&str> = added.mounts.iter().map(|m| m.guest.as_str()).collect();
    assert_eq!(guests, ["/data", "/late"]);
    assert_eq!(seen_late.stdout, "late-file\n", "{seen_late:?}");
    assert_eq!(
        std::fs::read_to_string(late.join("y")).expect("the guest's file on the host"),
        "from-b\n"
    );
    if root {
        assert_eq!(roots_written.0, 400, "{roots_written:?}");
        assert!(
            roots_written.1.contains("owned by root"),
            "{roots_written:?}"
        );
    }
    roots_read.expect("root's directory, read-only");
    let seen: Vec<&str> = seen_roots.stdout.lines().collect();
    assert_eq!(
        seen[0],
        if root { "0:0" } else { "1000:1000" },
        "{seen_roots:?}"
    );
    assert!(seen[1].contains("Read-only"), "{seen_roots:?}");
    assert_eq!(same_place.0, 409, "{same_place:?}");
    assert!(same_place.1.contains("/data"), "{same_place:?}");
    assert_eq!(no_slot.0, 409, "{no_slot:?}");
    assert!(no_slot.1.contains("all taken"), "{no_slot:?}");
    assert_eq!(nobody.0, 404, "{nobody:?}");
    let mut users = vec![a.sandbox.id.clone(), b.sandbox.id.clone()];
    users.sort();
    assert_eq!(listed.mounted_by, users);
    assert_eq!(busy.0, 409, "{busy:?}");
    assert!(busy.1.contains(&a.sandbox.id), "{busy:?}");
    assert_eq!(
        kept.expect("the volume's file after its sandboxes"),
        "from-b\n"
    );
    // SAFETY: getuid cannot fail.
    if unsafe { libc::getuid() } == 0 {
        // Neither root's nor a jail's: the volumes' own owner.
        assert_eq!(owner.expect("stat"), (199_999, 199_999));
    }
    assert!(deleted.is_ok(), "{deleted:?}");
    assert!(!dir.exists());
    assert_eq!(after.0, 404, "{after:?}");
}

/// Mounts the daemon cannot give are refused, each with its reason.
#[test]
fn mounts_outside_the_roots_or_beyond_the_slots_are_refused() {
    let (d, _g) = shared();
    let inside = mount_root(d).join("refusals");
    std::fs::create_dir_all(&inside).expect("a host directory");
    // SAFETY: getuid cannot fail.
    if unsafe { libc::getuid() } == 0 {
        // A jailed daemon refuses root's directories.
        std::os::unix::fs::chown(&inside, Some(4242), Some(4242)).expect("chown");
    }
    let outside = d.state_dir.join("sources");
    let refused =
        |mounts: Value| status(create_with(json!({ "template": "base", "mounts": mounts })));

    let escaping = refused(json!([{ "host": outside, "guest": "/mnt/x" }]));
    let dotted = refused(json!([{ "host": inside.join("../../sources"), "guest": "/mnt/x" }]));
    let relative = refused(json!([{ "host": inside, "guest": "mnt/x" }]));
    let missing = refused(json!([{ "host": inside.join("nope"), "guest": "/mnt/x" }]));
    let three = refused(json!([
        { "host": inside, "guest": "/mnt/a" },
        { "host": inside, "guest": "/mnt/b" },
        { "host": inside, "guest": "/mnt/c" },
    ]));
    let twice = refused(json!([
        { "host": inside, "guest": "/mnt/a" },
        { "host": inside, "guest": "/mnt/a" },
    ]));
    let unknown = refused(json!([{ "host": inside, "guest": "/mnt/x", "mode": "rw" }]));
    // A .sandboxignore the daemon will not read: through a link (to a file
    // the directory's owner may not read), or one that would show again.
    let ignoring = |name: &str, make: &dyn Fn(&Path)| {
        let dir = inside.join(name);
        std::fs::create_dir(&dir).expect("a host directory");
        make(&dir.join(".sandboxignore"));
        // SAFETY: getuid cannot fail.
        if unsafe { libc::getuid() } == 0 {
            std::os::unix::fs::lchown(&dir, Some(4242), Some(4242)).expect("chown");
        }
        refused(json!([{ "host": dir, "guest": "/mnt/x" }]))
    };
    let linked = ignoring("linked", &|at| {
        std::os::unix::fs::symlink("/etc/shadow", at).expect("symlink")
    });
    let negated = ignoring("negated", &|at| {
        std::fs::write(at, "*.pem\n!public.pem\n").expect("write")
    });

    for (what, got, says) in [
        ("outside the roots", &escaping, "mount root"),
        ("dotted out of them", &dotted, "mount root"),
        ("a relative guest path", &relative, "absolute"),
        ("a missing directory", &missing, "No such file"),
        ("more than the slots", &three, "fs slots"),
        ("one guest path twice", &twice, "two mounts at /mnt/a"),
        ("an unknown field", &unknown, "mode"),
        ("a linked .sandboxignore", &linked, "symbolic link"),
        ("a negation in .sandboxignore", &negated, "line 2"),
    ] {
        assert_eq!(got.0, 400, "{what}: {got:?}");
        assert!(got.1.contains(says), "{what}: {got:?}");
    }

    // Where the guest cannot mount (a file): the create answers once the
    // host serves the share, and the guest's refusal, met ahead of the
    // sandbox's first request, fails it with the reason before any use.
    let unmountable = create_with(json!({
        "template": "base",
        "mounts": [{ "host": inside, "guest": "/proc/version" }],
    }))
    .expect("served by the host");
    let id = unmountable.sandbox.id;
    wait_until("the guest's refusal to fail the sandbox", || {
        get(&id).expect("still listed").state == SandboxState::Failed
    });
    let failed = get(&id).expect("failed sandbox");
    let refused = status(exec(&id, &["true"]));
    destroy(&id);

    let error = failed.error.unwrap_or_default();
    assert!(
        error.contains("/proc/version") && error.contains("fs0"),
        "{error}"
    );
    assert_eq!(refused.0, 409, "{refused:?}");
}

#[test]
fn destroy_leaves_no_process_socket_or_file() {
    let (d, _g) = shared();
    let s = create("base").sandbox;
    let run_dir = d.state_dir.join("sandboxes").join(&s.id);
    assert!(run_dir.join("vsock").exists() && pid_alive(s.pid));

    destroy(&s.id);

    assert!(!pid_alive(s.pid), "VMM {} still runs", s.pid);
    assert!(!run_dir.exists(), "{} is left", run_dir.display());
    assert_eq!(status(get(&s.id)).0, 404);
    assert_eq!(status(exec(&s.id, &["true"])).0, 404);
    assert_eq!(status(download(&s.id, "/etc/hostname")).0, 404);
    let (code, msg) =
        status(api().send("DELETE", &format!("/v1/sandboxes/{}", s.id), Payload::None));
    assert_eq!(code, 404, "{msg}");
}

#[test]
fn a_killed_vmm_is_reported_failed_and_the_others_carry_on() {
    let (d, _g) = shared();
    let victim = create("base").sandbox;
    let bystander = create("base").sandbox;

    // SAFETY: kill(2) on the VMM's pid, which the daemon reported.
    unsafe { libc::kill(victim.pid as i32, libc::SIGKILL) };
    wait_until("the daemon to notice", || {
        get(&victim.id).expect("still listed").state == SandboxState::Failed
    });
    let failed = get(&victim.id).expect("failed sandbox");
    let refused = status(exec(&victim.id, &["true"]));

    assert!(
        failed.error.as_deref().unwrap_or("").contains("SIGKILL"),
        "{failed:?}"
    );
    assert_eq!(refused.0, 409);
    assert_eq!(sh(&bystander.id, "echo fine").stdout, "fine\n");
    destroy(&victim.id);
    assert!(!d.state_dir.join("sandboxes").join(&victim.id).exists());
    destroy(&bystander.id);
}

#[test]
fn a_restarted_daemon_finds_its_sandboxes_and_reports_the_vanished() {
    let d = daemon();
    let _exclusive = DAEMON_LOCK.write().unwrap_or_else(|e| e.into_inner());
    let survivor = create("base").sandbox;
    let vanished = create("base").sandbox;
    upload(&survivor.id, "/tmp/note", b"still here").expect("upload");

    d.kill();
    // SAFETY: kill(2) on a VMM's pid while its daemon is down.
    unsafe { libc::kill(vanished.pid as i32, libc::SIGKILL) };
    wait_until("the VMM to go", || {
        !pid_alive(vanished.pid) || {
            let stat =
                std::fs::read_to_string(format!("/proc/{}/stat", vanished.pid)).unwrap_or_default();
            stat.contains(") Z ")
        }
    });
    d.start(&[]);

    let found = get(&survivor.id).expect("the survivor is listed");
    let lost = get(&vanished.id).expect("the vanished one is listed");

    assert_eq!(found.state, SandboxState::Running);
    assert_eq!(
        download(&survivor.id, "/tmp/note").expect("download"),
        b"still here"
    );
    assert_eq!(lost.state, SandboxState::Failed);
    assert!(
        lost.error
            .as_deref()
            .unwrap_or("")
            .contains("gone when the daemon started"),
        "{lost:?}"
    );
    destroy(&survivor.id);
    destroy(&vanished.id);
}

/// The hibernations in a sandbox's run directory that still hold memory.
fn hibernations_with_memory(d: &TestDaemon, id: &str) -> Vec<PathBuf> {
    std::fs::read_dir(d.state_dir.join("sandboxes").join(id))
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("hibernation-"))
                        && p.join("memory").exists()
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The count a background program in the sandbox keeps in /tmp/count.
fn count(id: &str) -> u64 {
    let text = download(id, "/tmp/count").unwrap_or_default();
    String::from_utf8_lossy(&text).trim().parse().unwrap_or(0)
}

#[test]
fn a_hibernated_sandbox_wakes_on_use_with_its_files_programs_and_clock_across_a_daemon_restart() {
    let d = daemon();
    let _exclusive = DAEMON_LOCK.write().unwrap_or_else(|e| e.into_inner());
    let s = create("base").sandbox;
    upload(&s.id, "/tmp/kept", b"kept while it slept").expect("upload");
    // A program that keeps counting, detached from the exec that starts it.
    sh(
        &s.id,
        "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 1; done' \
         </dev/null >/dev/null 2>&1 &",
    );
    wait_until("the counter to count", || count(&s.id) > 0);
    // Its TSC against its clock before it sleeps.
    let tool =
        std::fs::read(common::cpucheck_tool()).expect("husk-cpucheck (built with guest-init)");
    upload(&s.id, "/tmp/husk-cpucheck", &tool).expect("upload husk-cpucheck");
    let (awake, _) = clock_of(&s.id);
    // A background program of the process API, waiting for its input.
    let waiting = start_process(
        &s.id,
        ProcessSpec {
            argv: argv(&["/bin/sh", "-c", "echo before; read x; echo after $x"]),
            stdin: true,
            ..Default::default()
        },
    );
    wait_until("the program to write", || {
        api()
            .process(&s.id, waiting.pid)
            .is_ok_and(|p| p.written > 0)
    });

    let slept = api().hibernate(&s.id).expect("hibernate");
    let listed = get(&s.id).expect("listed");
    let vmm_gone = !pid_alive(s.pid);
    let refused_pause = status(api().pause(&s.id).map(drop));
    // Down and up again: the hibernated sandbox is in the store.
    d.kill();
    d.start(&[]);
    let after_restart = get(&s.id).expect("listed after a restart");
    std::thread::sleep(CLOCK_LAG);
    // Any use wakes it: a download.
    let kept = download(&s.id, "/tmp/kept").expect("download");
    let woken = get(&s.id).expect("listed");
    assert_clock_is_now(&s.id);
    let (first_wake, first_log) = clock_of(&s.id);
    let counted = count(&s.id);
    wait_until("the counter to go on", || count(&s.id) > counted);
    // The program and what it wrote outlived the hibernation and the
    // daemon: its kept output, then its answer to new input.
    let kept_output = read_output(&s.id, waiting.pid, 0, false);
    api()
        .write_process_stdin(&s.id, waiting.pid, b"waking\n", true)
        .expect("stdin after the wake");
    let answered = read_output(&s.id, waiting.pid, 0, true);
    // A second cycle, woken explicitly: only its last hibernation keeps
    // memory on disk.
    api().hibernate(&s.id).expect("hibernate again");
    let hibernations = hibernations_with_memory(d, &s.id);
    let again = api().wake(&s.id).expect("wake");
    let kept_again = download(&s.id, "/tmp/kept").expect("download");
    let (second_wake, second_log) = clock_of(&s.id);
    let audit = api().audit(Some(&s.id)).expect("audit");
    // Each wake restores its TSC with its clock, as they stood awake.
    let drifts: Vec<f64> = [first_wake, second_wake]
        .iter()
        .flatten()
        .map(|&sample| common::tsc_drift_ns(awake, sample))
        .collect();
    eprintln!("woken: TSC against the awake guest's clock (ns): {drifts:?}");

    assert_eq!(slept.state, SandboxState::Hibernated);
    let bytes = slept.disk_bytes.expect("its size on disk");
    assert!(
        bytes > 0 && bytes < u64::from(s.mem_mib) << 20,
        "{bytes} bytes on disk for {} MiB of memory",
        s.mem_mib
    );
    assert_eq!((listed.state, listed.pid), (SandboxState::Hibernated, 0));
    assert!(vmm_gone, "its VMM (pid {}) is still there", s.pid);
    assert_eq!(refused_pause.0, 409, "{}", refused_pause.1);
    assert_eq!(after_restart.state, SandboxState::Hibernated);
    assert_eq!(kept, b"kept while it slept");
    assert_eq!(woken.state, SandboxState::Running);
    assert_eq!(kept_output.output, b"before\n");
    assert_eq!(kept_output.end, ProcessEvent::Caught { offset: 7 });
    assert_eq!(answered.output, b"before\nafter waking\n");
    assert_eq!(exit_code(&answered.end), Some(0));
    assert!(woken.pid != 0 && woken.pid != s.pid, "{woken:?}");
    assert_eq!(hibernations.len(), 1, "{hibernations:?}");
    assert_eq!(again.state, SandboxState::Running);
    assert_eq!(kept_again, b"kept while it slept");
    for action in ["hibernate", "wake"] {
        assert!(
            audit.iter().any(|e| e.action == action),
            "no {action} in {audit:?}"
        );
    }
    common::assert_tsc_kept(&drifts, common::TSC_DRIFT_BOUND_NS, "a woken sandbox");
    for log in [&first_log, &second_log] {
        common::assert_tsc_stable(log);
    }
    destroy(&s.id);
    assert!(!d.state_dir.join("sandboxes").join(&s.id).exists());
}

/// What a reader of program `pid`'s output from `from` got: the replay's
/// dropped bytes, the output (offsets checked to follow on), and the end.
struct ReadBack {
    dropped: u64,
    output: Vec<u8>,
    end: ProcessEvent,
}

fn read_output(id: &str, pid: i32, from: u64, follow: bool) -> ReadBack {
    let mut events = api()
        .process_output(id, pid, from, follow, None)
        .expect("output");
    let Some(ProcessEvent::Replay { offset, dropped }) = events.next_event().expect("replay")
    else {
        panic!("no replay first");
    };
    let mut at = offset;
    let mut output = Vec::new();
    loop {
        match events.next_event().expect("event").expect("an end") {
            ProcessEvent::Stdout { offset, data } | ProcessEvent::Stderr { offset, data } => {
                assert_eq!(offset, at, "output at {offset}, expected {at}");
                let data = base64::engine::general_purpose::STANDARD
                    .decode(data)
                    .expect("base64");
                at += data.len() as u64;
                output.extend(data);
            }
            end => {
                return ReadBack {
                    dropped,
                    output,
                    end,
                }
            }
        }
    }
}

fn exit_code(end: &ProcessEvent) -> Option<i32> {
    match end {
        ProcessEvent::Exit {
            exit: ProcessExit { code, .. },
            ..
        } => *code,
        other => panic!("not an exit: {other:?}"),
    }
}

fn start_process(id: &str, spec: ProcessSpec) -> husk_types::ProcessInfo {
    api().start_process(id, &spec).expect("start a process")
}

fn argv(words: &[&str]) -> Vec<String> {
    words.iter().map(|w| (*w).to_owned()).collect()
}

#[test]
fn background_programs_keep_their_output_for_readers_from_any_offset() {
    let (_d, _g) = shared();
    let s = create("base").sandbox;
    let counter = start_process(
        &s.id,
        ProcessSpec {
            argv: argv(&[
                "/bin/sh",
                "-c",
                "for i in 1 2 3 4 5; do echo line $i; sleep 1; done",
            ]),
            tag: Some("counter".into()),
            ..Default::default()
        },
    );
    assert_eq!((counter.state.as_str(), counter.kept), ("running", true));
    assert_eq!(counter.tag.as_deref(), Some("counter"));
    // Two lines, then this reader goes away.
    let mut first = api()
        .process_output(&s.id, counter.pid, 0, true, None)
        .expect("output");
    let mut seen = Vec::new();
    while seen.iter().filter(|b| **b == b'\n').count() < 2 {
        match first.next_event().expect("event").expect("more") {
            ProcessEvent::Replay { offset, dropped } => assert_eq!((offset, dropped), (0, 0)),
            ProcessEvent::Stdout { offset, data } => {
                assert_eq!(offset, seen.len() as u64);
                seen.extend(
                    base64::engine::general_purpose::STANDARD
                        .decode(data)
                        .expect("base64"),
                );
            }
            other => panic!("{other:?}"),
        }
    }
    drop(first);
    // From where it stopped: the rest; from 0: everything.
    let rest = read_output(&s.id, counter.pid, seen.len() as u64, true);
    let all = read_output(&s.id, counter.pid, 0, true);
    let listed = api().processes(&s.id).expect("list");

    assert_eq!(
        String::from_utf8_lossy(&all.output),
        "line 1\nline 2\nline 3\nline 4\nline 5\n"
    );
    assert_eq!([seen, rest.output].concat(), all.output);
    assert_eq!(
        (exit_code(&rest.end), exit_code(&all.end)),
        (Some(0), Some(0))
    );
    let listed = listed
        .iter()
        .find(|p| p.pid == counter.pid)
        .expect("still listed once it ended");
    assert_eq!(listed.state, "exited");
    assert_eq!(listed.written, all.output.len() as u64);

    // Its stdin, written and closed.
    let cat = start_process(
        &s.id,
        ProcessSpec {
            argv: argv(&["cat"]),
            stdin: true,
            ..Default::default()
        },
    );
    api()
        .write_process_stdin(&s.id, cat.pid, b"to cat\n", true)
        .expect("stdin");
    let catted = read_output(&s.id, cat.pid, 0, true);
    assert_eq!(catted.output, b"to cat\n");
    assert_eq!(exit_code(&catted.end), Some(0));

    // A flood nobody reads runs to its end; a reader learns what went.
    let flood = start_process(
        &s.id,
        ProcessSpec {
            argv: argv(&["/bin/sh", "-c", "yes | head -c 1000000; echo end"]),
            keep_bytes: Some(65536),
            ..Default::default()
        },
    );
    wait_until("the flood to end", || {
        api()
            .process(&s.id, flood.pid)
            .is_ok_and(|p| p.state == "exited")
    });
    let flooded = read_output(&s.id, flood.pid, 0, true);
    assert!(
        flooded.dropped > 900_000 && flooded.output.ends_with(b"y\ny\nend\n"),
        "dropped {}, kept {} bytes",
        flooded.dropped,
        flooded.output.len()
    );
    assert_eq!(flooded.dropped + flooded.output.len() as u64, 1_000_004);

    // On a terminal of the size asked for.
    let tty = start_process(
        &s.id,
        ProcessSpec {
            argv: argv(&["stty", "size"]),
            terminal: Some(TerminalSize { rows: 33, cols: 77 }),
            ..Default::default()
        },
    );
    let sized = read_output(&s.id, tty.pid, 0, true);
    assert_eq!(String::from_utf8_lossy(&sized.output).trim(), "33 77");

    // Signals, and what is refused.
    let sleeper = start_process(
        &s.id,
        ProcessSpec {
            argv: argv(&["sleep", "1000"]),
            ..Default::default()
        },
    );
    let caught = read_output(&s.id, sleeper.pid, 0, false);
    assert_eq!(caught.end, ProcessEvent::Caught { offset: 0 });
    let running_removed = status(api().remove_process(&s.id, sleeper.pid));
    let unknown = status(api().process(&s.id, 999_999));
    let stdin_gone = status(api().write_process_stdin(&s.id, cat.pid, b"x", false));
    let no_terminal =
        status(api().resize_process(&s.id, sleeper.pid, TerminalSize { rows: 10, cols: 10 }));
    let bad_signal = status(api().signal_process(&s.id, sleeper.pid, "NOPE"));
    // Three running is the test daemon's --max-processes.
    let more: Vec<i32> = (0..2)
        .map(|_| {
            start_process(
                &s.id,
                ProcessSpec {
                    argv: argv(&["sleep", "1000"]),
                    ..Default::default()
                },
            )
            .pid
        })
        .collect();
    let over = status(api().start_process(
        &s.id,
        &ProcessSpec {
            argv: argv(&["true"]),
            ..Default::default()
        },
    ));
    api()
        .signal_process(&s.id, sleeper.pid, "KILL")
        .expect("kill");
    let killed = read_output(&s.id, sleeper.pid, 0, true);
    api()
        .remove_process(&s.id, sleeper.pid)
        .expect("remove an ended one");
    let removed = status(api().process(&s.id, sleeper.pid));

    assert_eq!(running_removed.0, 409, "{}", running_removed.1);
    assert_eq!(unknown.0, 404, "{}", unknown.1);
    assert_eq!(stdin_gone.0, 409, "{}", stdin_gone.1);
    assert_eq!(no_terminal.0, 400, "{}", no_terminal.1);
    assert_eq!(bad_signal.0, 400, "{}", bad_signal.1);
    assert_eq!(more.len(), 2);
    assert_eq!(over.0, 429, "{}", over.1);
    assert!(over.1.contains("--max-processes 3"), "{}", over.1);
    match killed.end {
        ProcessEvent::Exit { exit, .. } => assert_eq!(exit.signal, Some(9)),
        other => panic!("{other:?}"),
    }
    assert_eq!(removed.0, 404, "{}", removed.1);
    destroy(&s.id);
}

/// A pseudo-terminal pair: what the test types into and reads from
/// (`master`) and what a program runs on (`slave`), `rows` x `cols`.
fn open_pty(rows: u16, cols: u16) -> (std::fs::File, std::fs::File) {
    use std::os::fd::FromRawFd;
    let (mut master, mut slave) = (0, 0);
    let size = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty fills two descriptors; the name and termios may be null.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &size,
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors are fresh and owned here from now on.
    unsafe {
        (
            std::fs::File::from_raw_fd(master),
            std::fs::File::from_raw_fd(slave),
        )
    }
}

#[test]
fn husk_exec_it_is_a_terminal_through_the_daemon_with_keys_resizes_and_the_exit_code() {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let (d, _g) = shared();
    let s = create("base").sandbox;
    let (mut master, slave) = open_pty(30, 90);
    let mut cmd = Command::new(common::husk_binary());
    cmd.args(["exec", "-it", &s.id, "--", "/bin/sh"])
        .env("HUSK_HOST", d.state_dir.join("husk.sock"))
        .stdin(slave.try_clone().expect("slave"))
        .stdout(slave.try_clone().expect("slave"))
        .stderr(slave.try_clone().expect("slave"));
    // SAFETY: in the child before exec: a session of its own, with the
    // terminal as its controlling one (so a resize signals it).
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut husk = cmd.spawn().expect("husk exec -it");
    // Only husk keeps the terminal open: the reader below ends with it.
    drop(cmd);
    drop(slave);
    // What the terminal shows, read as it comes.
    let screen = std::sync::Arc::new(Mutex::new(Vec::<u8>::new()));
    let reader = {
        let screen = screen.clone();
        let mut master = master.try_clone().expect("master");
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // EIO once the last user of the terminal is gone.
            while let Ok(n @ 1..) = master.read(&mut buf) {
                screen.lock().expect("screen").extend_from_slice(&buf[..n]);
            }
        })
    };
    let shown =
        |what: &str| String::from_utf8_lossy(&screen.lock().expect("screen")).contains(what);
    // Each command echoes a mark the typed line does not contain.
    let mut mark = 0;
    let mut run = |master: &mut std::fs::File, command: &str| -> String {
        mark += 1;
        let start = screen.lock().expect("screen").len();
        write!(master, "{command}; echo M$((1000+{mark}))\r").expect("type");
        let want = format!("M{}", 1000 + mark);
        wait_until(&want, || shown(&want));
        String::from_utf8_lossy(&screen.lock().expect("screen")[start..]).into_owned()
    };
    let first = run(&mut master, "stty size");
    // The host terminal resized: the program's follows.
    let bigger = libc::winsize {
        ws_row: 40,
        ws_col: 100,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize.
    unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &bigger) };
    let mut resized = String::new();
    wait_until("the resize to reach the program", || {
        resized = run(&mut master, "stty size");
        resized.contains("40 100")
    });
    // Ctrl-C reaches the program (the terminal is raw here): it ends a
    // sleep that would outlast the test.
    write!(master, "sleep 1000\r").expect("type");
    wait_until("the sleep to start", || {
        sh(&s.id, "pidof sleep").code == Some(0)
    });
    master.write_all(b"\x03").expect("type ^C");
    let interrupted = run(&mut master, "echo interrupted");
    write!(master, "echo hi; exit 3\r").expect("type");
    let mut budget = husk_agent_client::readiness::WaitBudget::new(PATIENCE);
    let code = loop {
        if let Some(status) = husk.try_wait().expect("wait") {
            break status.code();
        }
        assert!(!budget.expired(), "husk exec -it did not exit");
        std::thread::sleep(Duration::from_millis(200));
    };
    drop(master);
    let _ = reader.join();
    let listed = api().processes(&s.id).expect("list");

    assert!(first.contains("30 90"), "{first:?}");
    assert!(resized.contains("40 100"), "{resized:?}");
    assert!(interrupted.contains("interrupted"), "{interrupted:?}");
    assert!(
        shown("hi"),
        "{:?}",
        String::from_utf8_lossy(&screen.lock().expect("screen"))
    );
    assert_eq!(code, Some(3));
    // The program it ran is gone from the sandbox's table with it.
    assert!(
        listed
            .iter()
            .all(|p| p.tag.as_deref() != Some("husk exec -t")),
        "{listed:?}"
    );
    destroy(&s.id);
}

#[test]
fn a_programs_websocket_carries_keys_resizes_and_its_end() {
    use tungstenite::Message;
    let (d, _g) = shared();
    let s = create("base").sandbox;
    let shell = start_process(
        &s.id,
        ProcessSpec {
            argv: argv(&["/bin/sh"]),
            terminal: Some(TerminalSize { rows: 24, cols: 80 }),
            ..Default::default()
        },
    );
    let uds =
        std::os::unix::net::UnixStream::connect(d.state_dir.join("husk.sock")).expect("connect");
    uds.set_read_timeout(Some(patience())).expect("timeout");
    let url = format!(
        "ws://husk/v1/sandboxes/{}/processes/{}/terminal",
        s.id, shell.pid
    );
    let (mut ws, _) = tungstenite::client::client(url.as_str(), uds).expect("upgrade");
    // What the terminal shows; text frames are events.
    let mut screen = Vec::new();
    let mut events = Vec::new();
    let mut until = |ws: &mut tungstenite::WebSocket<_>, want: &str| -> bool {
        loop {
            if String::from_utf8_lossy(&screen).contains(want) {
                return true;
            }
            match ws.read() {
                Ok(Message::Binary(b)) => screen.extend_from_slice(&b),
                Ok(Message::Text(t)) => {
                    events.push(serde_json::from_str::<Value>(t.as_str()).expect("an event"))
                }
                Ok(Message::Close(_)) | Err(_) => return false,
                Ok(_) => {}
            }
        }
    };
    ws.send(Message::binary(&b"echo $((6*7))\r"[..]))
        .expect("keys");
    let answered = until(&mut ws, "42");
    ws.send(Message::text(r#"{"resize": {"rows": 50, "cols": 120}}"#))
        .expect("resize");
    ws.send(Message::text("not control")).expect("text");
    ws.send(Message::binary(&b"stty size\r"[..])).expect("keys");
    let resized = until(&mut ws, "50 120");
    ws.send(Message::binary(&b"exit 5\r"[..])).expect("keys");
    let closed = !until(&mut ws, "never printed");
    // Refused before any upgrade: a program that ended.
    let ended = status(api().call::<Value>(
        "GET",
        &format!("/v1/sandboxes/{}/processes/{}/terminal", s.id, shell.pid),
        None,
    ));

    assert!(
        answered && resized && closed,
        "{}",
        String::from_utf8_lossy(&screen)
    );
    assert_eq!(
        events.first().map(|e| e["type"].clone()),
        Some(json!("replay")),
        "{events:?}"
    );
    assert!(
        events
            .iter()
            .any(|e| e["type"] == "error" && e["error"].as_str().unwrap_or("").contains("control")),
        "{events:?}"
    );
    let exit = events.last().expect("an exit");
    assert_eq!(
        (exit["type"].clone(), exit["code"].clone()),
        (json!("exit"), json!(5)),
        "{events:?}"
    );
    assert_eq!(ended.0, 409, "{}", ended.1);
    destroy(&s.id);
}

#[test]
fn the_cli_reaches_a_sandboxs_programs_and_guest_by_its_id() {
    let (d, _g) = shared();
    let s = create("base").sandbox;
    let husk = |args: &[&str]| {
        Command::new(common::husk_binary())
            .args(args)
            .env("HUSK_HOST", d.state_dir.join("husk.sock"))
            .stdin(Stdio::null())
            .output()
            .expect("husk")
    };
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let ping = husk(&["ping", &s.id]);
    let health = husk(&["health", &s.id]);
    // `husk exec -d`: what it printed, and the pid in it.
    let detach = |argv: &[&str]| {
        let mut args = vec!["exec", "-d", &s.id, "--"];
        args.extend(argv);
        let out = husk(&args);
        let pid = text(&out.stdout).trim().to_owned();
        (out, pid)
    };
    // A background program: its pid, its output from an offset, its end.
    let (started, pid) = detach(&["/bin/sh", "-c", "echo one; echo two; exit 6"]);
    let attached = husk(&["attach", &s.id, &pid, "--from", "4"]);
    let waited = husk(&["wait", &s.id, &pid]);
    let (_, spid) = detach(&["sleep", "1000"]);
    let ps = husk(&["ps", &s.id]);
    let killed = husk(&["kill", &s.id, &spid, "-s", "9"]);
    let after_kill = husk(&["wait", &s.id, &spid]);
    // Waiting for a log line, and for a server's port.
    let (_, lpid) = detach(&[
        "/bin/sh",
        "-c",
        "echo starting; sleep 1; echo Listening on 8123; sleep 1000",
    ]);
    let logged = husk(&["attach", &s.id, &lpid, "--until", "Listening on"]);
    let tool = common::repo_root().join("target/x86_64-unknown-linux-musl/guest/husk-testsrv");
    upload(
        &s.id,
        "/tmp/husk-testsrv",
        &std::fs::read(&tool).expect("husk-testsrv"),
    )
    .expect("upload the test server");
    sh(&s.id, "chmod +x /tmp/husk-testsrv");
    let (server, _) = detach(&["/tmp/husk-testsrv", "8123"]);
    let wait_s = patience().as_secs().min(600).to_string();
    let waited_port = husk(&["port", &s.id, "8123", "--wait-s", &wait_s]);
    let closed_port = husk(&["port", &s.id, "8124"]);
    // Changes under a directory, as they happen.
    sh(&s.id, "mkdir -p /tmp/watched");
    let mut watch = Command::new(common::husk_binary())
        .args(["watch", &format!("{}:/tmp/watched", s.id)])
        .env("HUSK_HOST", d.state_dir.join("husk.sock"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("husk watch");
    let seen = std::sync::Arc::new(Mutex::new(String::new()));
    {
        let seen = seen.clone();
        let out = watch.stdout.take().expect("stdout");
        std::thread::spawn(move || {
            use std::io::BufRead;
            for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                seen.lock().expect("seen").push_str(&(l + "\n"));
            }
        });
    }
    // A new file each time until the watch (which may still be starting)
    // sees one made.
    let mut made = 0;
    wait_until("husk watch to see a new file", || {
        made += 1;
        sh(&s.id, &format!("echo x > /tmp/watched/new-{made}"));
        std::thread::sleep(Duration::from_millis(500));
        seen.lock()
            .expect("seen")
            .contains("Created /tmp/watched/new-")
    });
    let _ = watch.kill();
    let _ = watch.wait();

    assert!(
        ping.status.success() && text(&ping.stdout).starts_with("guest uptime "),
        "{ping:?}"
    );
    assert!(
        text(&health.stdout).contains("mem_total_kib="),
        "{health:?}"
    );
    assert!(pid.parse::<i32>().is_ok(), "{started:?}");
    // From offset 4: "one\n" is skipped.
    assert_eq!(text(&attached.stdout), "two\n", "{attached:?}");
    assert_eq!(
        (attached.status.code(), waited.status.code()),
        (Some(6), Some(6))
    );
    assert!(
        text(&ps.stdout)
            .lines()
            .any(|l| l.contains(&spid) && l.contains("sleep 1000")),
        "{ps:?}"
    );
    assert!(killed.status.success(), "{killed:?}");
    assert_eq!(after_kill.status.code(), Some(128 + 9), "{after_kill:?}");
    assert!(seen
        .lock()
        .expect("seen")
        .contains("Created /tmp/watched/new-"));
    assert_eq!(logged.status.code(), Some(0), "{logged:?}");
    assert!(
        text(&logged.stdout).contains("starting\nListening on"),
        "{logged:?}"
    );
    assert!(server.status.success(), "{server:?}");
    assert_eq!(waited_port.status.code(), Some(0), "{waited_port:?}");
    assert_ne!(closed_port.status.code(), Some(0), "{closed_port:?}");
    destroy(&s.id);
}

/// `husk-cpucheck clock` (uploaded to /tmp) in sandbox `id`: its TSC
/// against its CLOCK_MONOTONIC, and its clocksource log lines.
fn clock_of(id: &str) -> ([(u64, u64); 2], Vec<String>) {
    let ran = sh(
        id,
        "chmod 755 /tmp/husk-cpucheck && /tmp/husk-cpucheck clock 500",
    );
    assert_eq!(ran.code, Some(0), "husk-cpucheck clock: {ran:?}");
    common::clock_report(&ran.stdout)
}

/// The daemon's open descriptors.
fn daemon_fds(d: &TestDaemon) -> usize {
    let pid = d
        .child
        .lock()
        .expect("lock")
        .as_ref()
        .expect("running")
        .id();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(Iterator::count)
        .unwrap_or(0)
}

/// Every file and directory under `dir`.
fn entries_under(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| {
                    1 + if e.path().is_dir() {
                        entries_under(&e.path())
                    } else {
                        0
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}

#[test]
fn twenty_hibernations_leak_nothing_and_the_hibernated_have_a_limit_of_their_own() {
    let d = daemon();
    let _exclusive = DAEMON_LOCK.write().unwrap_or_else(|e| e.into_inner());
    let s = create("base").sandbox;
    let run_dir = d.state_dir.join("sandboxes").join(&s.id);
    let vmms = || {
        let out = Command::new("pgrep")
            .args(["-f", &format!("id {}", s.id)])
            .output()
            .expect("pgrep");
        String::from_utf8_lossy(&out.stdout).lines().count()
    };
    api().hibernate(&s.id).expect("hibernate");
    api().wake(&s.id).expect("wake");
    let (fds, files, processes) = (daemon_fds(d), entries_under(&run_dir), vmms());
    for _ in 0..20 {
        api().hibernate(&s.id).expect("hibernate");
        api().wake(&s.id).expect("wake");
    }
    let after = (daemon_fds(d), entries_under(&run_dir), vmms());
    let ran = sh(&s.id, "echo still here");
    // Hibernation has a limit of its own.
    d.kill();
    d.start(&["--max-hibernated", "0"]);
    let refused = status(api().hibernate(&s.id));
    let running = get(&s.id).expect("listed");
    // And a disk budget, which hibernations share with the snapshots made
    // from sandboxes (other tests' too, on this daemon). A snapshot is
    // refused before it is written, as it may take its memory's size: the
    // refusal says what is taken.
    let templates = || {
        let dirs = std::fs::read_dir(d.state_dir.join("templates")).expect("templates");
        (api().templates().expect("templates").len(), dirs.count())
    };
    d.kill();
    d.start(&["--hibernated-disk-mib", "1"]);
    let templates_before = templates();
    let snapshot_over = status(api().snapshot(&s.id, "over-the-budget"));
    let templates_after = templates();
    let taken: u64 = snapshot_over
        .1
        .split(" MiB are taken")
        .next()
        .and_then(|before| before.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("the refusal says what is taken");
    // 2 MiB more than that is less than a hibernation of a sandbox holding
    // a 6.9 MB file takes, which is found once it is written; it goes, and
    // the sandbox runs on.
    let filled = sh(
        &s.id,
        // Pages of their own (a hibernation leaves zeros out).
        "seq 1 1000000 > /tmp/six && echo filled",
    );
    d.kill();
    d.start(&["--hibernated-disk-mib", &(taken + 2).to_string()]);
    let over = status(api().hibernate(&s.id));
    let after_over = get(&s.id).expect("listed");
    let entries_after_over = entries_under(&run_dir);
    let ran_after_over = sh(&s.id, "echo on");
    d.kill();
    d.start(&[]);
    // The refused hibernation's directory is gone: the next one is whole,
    // and wakes with the file.
    api().hibernate(&s.id).expect("hibernate after a refusal");
    let kept_after_over = sh(&s.id, "tail -n 1 /tmp/six");

    // Idle agent connections come and go (at most a few per sandbox).
    assert!(
        after.0 <= fds + 4,
        "daemon descriptors {fds} -> {}",
        after.0
    );
    assert_eq!(after.1, files, "entries under {}", run_dir.display());
    assert_eq!(after.2, processes, "processes with its id");
    assert_eq!(ran.stdout, "still here\n");
    assert_eq!(refused.0, 429, "{}", refused.1);
    assert!(refused.1.contains("--max-hibernated"), "{}", refused.1);
    assert_eq!(running.state, SandboxState::Running);
    assert_eq!(filled.stdout, "filled\n", "{filled:?}");
    assert_eq!(over.0, 429, "{}", over.1);
    assert!(
        over.1.contains("--hibernated-disk-mib") && over.1.contains("this one needs"),
        "{}",
        over.1
    );
    assert_eq!(snapshot_over.0, 429, "{}", snapshot_over.1);
    assert!(
        snapshot_over.1.contains("--hibernated-disk-mib"),
        "{}",
        snapshot_over.1
    );
    assert_eq!(templates_after, templates_before, "a refused snapshot");
    assert_eq!(after_over.state, SandboxState::Running);
    assert_eq!(
        entries_after_over, files,
        "a refused hibernation and snapshot leave nothing"
    );
    assert_eq!(ran_after_over.stdout, "on\n");
    assert_eq!(kept_after_over.stdout, "1000000\n", "{kept_after_over:?}");
    destroy(&s.id);
}

#[test]
fn a_snapshotted_sandbox_hibernates_and_wakes_with_its_files() {
    let (_d, _g) = shared();
    let s = create("base").sandbox;
    let wrote = sh(&s.id, "echo before > /tmp/a && echo ok");
    // Its snapshot is moved into a template once written: the sandbox's
    // own hibernation must not diff against where it was written.
    let t = api()
        .snapshot(&s.id, &format!("snap-{}", s.id))
        .expect("snapshot");
    let after = sh(&s.id, "echo after > /tmp/b && echo ok");
    api().hibernate(&s.id).expect("hibernate");
    let woke = sh(&s.id, "cat /tmp/a /tmp/b");
    destroy(&s.id);
    let _ = api().send("DELETE", &format!("/v1/templates/{}", t.id), Payload::None);

    assert_eq!(
        (wrote.stdout.as_str(), after.stdout.as_str()),
        ("ok\n", "ok\n")
    );
    assert_eq!(woke.stdout, "before\nafter\n", "{woke:?}");
}

#[test]
fn several_sandboxes_hibernate_and_wake_at_once_within_the_disk_budget() {
    let (d, _exclusive) = exclusive();
    // 2 MiB: about one hibernation after a small change (1.3-1.5 MiB), so
    // hibernations in flight together must be counted against it.
    d.kill();
    d.start(&["--hibernated-disk-mib", "2"]);
    const BUDGET: u64 = 2 << 20;
    let ids: Vec<String> = (0..3).map(|_| create("base").sandbox.id).collect();
    for id in &ids {
        upload(id, "/tmp/mine", id.as_bytes()).expect("upload");
    }
    let hibernated: Vec<(String, Result<SandboxInfo, ApiClientError>)> = std::thread::scope(|s| {
        let each: Vec<_> = ids
            .iter()
            .map(|id| s.spawn(move || (id.clone(), api().hibernate(id))))
            .collect();
        each.into_iter().map(|h| h.join().expect("join")).collect()
    });
    let asleep: Vec<&SandboxInfo> = hibernated
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok())
        .collect();
    let on_disk: u64 = asleep.iter().map(|i| i.disk_bytes.unwrap_or(0)).sum();
    let refused: Vec<(String, (u16, String), SandboxState)> = hibernated
        .iter()
        .filter(|(_, r)| r.is_err())
        .map(|(id, r)| {
            let why = match r {
                Err(ApiClientError::Status { status, message }) => (*status, message.clone()),
                other => panic!("{id}: {other:?}"),
            };
            (id.clone(), why, get(id).expect("listed").state)
        })
        .collect();
    // Every one woken at once by its use: each its own.
    let woken: Vec<(String, String)> = std::thread::scope(|s| {
        let each: Vec<_> = ids
            .iter()
            .map(|id| {
                s.spawn(move || {
                    let mine = download(id, "/tmp/mine").expect("download");
                    (id.clone(), String::from_utf8_lossy(&mine).into_owned())
                })
            })
            .collect();
        each.into_iter().map(|h| h.join().expect("join")).collect()
    });
    let states: Vec<SandboxState> = ids
        .iter()
        .map(|id| get(id).expect("listed").state)
        .collect();
    for id in &ids {
        destroy(id);
    }
    d.kill();
    d.start(&[]);

    eprintln!(
        "{} of {} hibernated at once, {on_disk} bytes on disk; refused: {refused:?}",
        asleep.len(),
        ids.len()
    );
    assert!(!asleep.is_empty(), "none hibernated: {refused:?}");
    assert!(
        on_disk <= BUDGET,
        "{} hibernated at once took {on_disk} bytes of a {BUDGET}-byte budget",
        asleep.len()
    );
    for (id, (code, message), state) in &refused {
        assert_eq!(*code, 429, "{id}: {message}");
        assert!(message.contains("--hibernated-disk-mib"), "{id}: {message}");
        assert_eq!(*state, SandboxState::Running, "{id}: refused, it runs on");
    }
    for (id, mine) in &woken {
        assert_eq!(mine, id, "{id}'s own file");
    }
    assert!(
        states.iter().all(|s| *s == SandboxState::Running),
        "{states:?}"
    );
}

#[test]
fn a_corrupt_hibernation_fails_the_sandbox_with_the_reason_and_runs_no_guest() {
    let (d, _g) = shared();
    let s = create("base").sandbox;
    api().hibernate(&s.id).expect("hibernate");
    let dir = hibernations_with_memory(d, &s.id)
        .pop()
        .expect("its hibernation");
    let state = dir.join("state");
    let mut bytes = std::fs::read(&state).expect("state");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&state, bytes).expect("corrupt the state");

    let refused = status(exec(&s.id, &["true"]));
    let failed = get(&s.id).expect("listed");
    let running = Command::new("pgrep")
        .args(["-f", &format!("id {}", s.id)])
        .output()
        .expect("pgrep");

    assert_eq!(refused.0, 500, "{}", refused.1);
    assert!(refused.1.contains("wake failed"), "{}", refused.1);
    assert_eq!(failed.state, SandboxState::Failed);
    assert!(
        failed
            .error
            .as_deref()
            .unwrap_or("")
            .contains("wake failed"),
        "{failed:?}"
    );
    assert!(running.stdout.is_empty(), "a VMM is left: {:?}", running);
    destroy(&s.id);
}

#[test]
fn a_flipped_byte_in_a_hibernations_memory_fails_its_wake_with_the_reason() {
    // The middle byte of the diff's pages: the state is intact, so only the
    // checksum written with the pages can tell (issue 41).
    let (d, _g) = shared();
    let s = create("base").sandbox;
    api().hibernate(&s.id).expect("hibernate");
    let memory = hibernations_with_memory(d, &s.id)
        .pop()
        .expect("its hibernation")
        .join("memory");
    let extents = common::data_extents(&memory);
    let data: u64 = extents.iter().map(|e| e.1).sum();
    let mut middle = data / 2;
    let (offset, _) = extents
        .iter()
        .find(|&&(_, len)| {
            let here = middle < len;
            if !here {
                middle -= len;
            }
            here
        })
        .copied()
        .expect("the diff holds pages");
    common::flip_byte(&memory, offset + middle);

    let refused = status(exec(&s.id, &["true"]));
    let failed = get(&s.id).expect("listed");

    assert_eq!(refused.0, 500, "{}", refused.1);
    assert!(refused.1.contains("wake failed"), "{}", refused.1);
    assert!(
        refused.1.contains("does not hold what was written there"),
        "{}",
        refused.1
    );
    assert_eq!(failed.state, SandboxState::Failed);
    destroy(&s.id);
}

/// The guest-side test server (built with guest-init, not in the root
/// file system), started in sandbox `id` on `port`.
fn start_test_server(id: &str, port: u16) {
    let tool = common::repo_root().join("target/x86_64-unknown-linux-musl/guest/husk-testsrv");
    let server = std::fs::read(&tool)
        .unwrap_or_else(|e| panic!("{} (built with guest-init): {e}", tool.display()));
    upload(id, "/tmp/husk-testsrv", &server).expect("upload the test server");
    sh(
        id,
        &format!(
            "chmod +x /tmp/husk-testsrv; setsid /tmp/husk-testsrv {port} \
             </dev/null >/tmp/testsrv.log 2>&1 &"
        ),
    );
    wait_until("the test server to listen", || {
        api().port(id, port).is_ok_and(|p| p.listening)
    });
}

/// An HTTP client whose every name resolves to the front door: what DNS
/// with a wildcard record for the front door's domain would do.
/// With `tls`, HTTPS clients trust what it says.
fn front_door_client(d: &TestDaemon, tls: Option<rustls::ClientConfig>) -> ureq::Agent {
    let door: std::net::SocketAddr = d.expose.parse().expect("front door address");
    let agent = ureq::AgentBuilder::new()
        .resolver(move |_: &str| Ok(vec![door]))
        .timeout(patience());
    match tls {
        Some(tls) => agent.tls_config(std::sync::Arc::new(tls)).build(),
        None => agent.build(),
    }
}

/// `url` fetched through the front door: its status and body (errors are
/// answers too).
fn front_get(agent: &ureq::Agent, url: &str, token: Option<&str>) -> (u16, String) {
    let mut req = agent.get(url);
    if let Some(t) = token {
        req = req.set("e2b-traffic-access-token", t);
    }
    match req.call() {
        Ok(r) => (r.status(), r.into_string().expect("body")),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().expect("body")),
        Err(e) => panic!("GET {url}: {e}"),
    }
}

#[test]
fn a_sandbox_port_is_served_at_the_front_door_with_streams_websockets_and_private_tokens() {
    let (d, _g) = shared();
    let open = create("base").sandbox;
    let private = create_with(json!({ "template": "base", "private_ports": true }))
        .expect("create")
        .sandbox;
    let door_port = d.expose.rsplit_once(':').expect("port").1;
    let url = |s: &SandboxInfo, port: u16, path: &str| {
        format!("http://{port}-{}.{FRONT_DOMAIN}:{door_port}{path}", s.id)
    };
    let agent = front_door_client(d, None);
    // Nothing listens yet.
    let before = api().port(&open.id, 8000).expect("port");
    let nobody = front_get(&agent, &url(&open, 8000, "/hello"), None);
    start_test_server(&open.id, 8000);
    start_test_server(&private.id, 8000);
    let published = api().port(&open.id, 8000).expect("port");

    let hello = front_get(&agent, &url(&open, 8000, "/hello"), None);
    let streamed = agent
        .get(&url(&open, 8000, "/stream"))
        .call()
        .expect("stream");
    let chunked = streamed.header("transfer-encoding").map(str::to_owned);
    let ticks = streamed.into_string().expect("ticks");
    let sent: Vec<u8> = (0..1u32 << 20).map(|i| (i * 7 + i / 251) as u8).collect();
    let mut echoed = Vec::new();
    agent
        .post(&url(&open, 8000, "/echo"))
        .send_bytes(&sent)
        .expect("echo")
        .into_reader()
        .read_to_end(&mut echoed)
        .expect("echo body");
    // A WebSocket, with a client that checks the handshake.
    let tcp = std::net::TcpStream::connect(&d.expose).expect("connect to the front door");
    tcp.set_read_timeout(Some(patience())).expect("timeout");
    let ws_url = url(&open, 8000, "/ws").replacen("http", "ws", 1);
    let (mut ws, upgraded) = tungstenite::client::client(ws_url.as_str(), tcp).expect("upgrade");
    let text = "through the front door and back";
    ws.send(tungstenite::Message::text(text)).expect("send");
    let text_back = ws.read().expect("read");
    let blob: Vec<u8> = (0..100_000u32).map(|i| (i % 253) as u8).collect();
    ws.send(tungstenite::Message::binary(blob.clone()))
        .expect("send");
    let blob_back = ws.read().expect("read");
    ws.close(None).expect("close");
    while ws.read().is_ok() {}

    // What is not there, and what is private.
    let not_ours = front_get(&agent, &format!("http://example.com:{door_port}/"), None);
    let no_sandbox = front_get(
        &agent,
        &url(
            &SandboxInfo {
                id: "sb-00000000".into(),
                ..open.clone()
            },
            8000,
            "/hello",
        ),
        None,
    );
    let no_port = front_get(&agent, &url(&open, 8001, "/hello"), None);
    let token = private
        .traffic_token
        .clone()
        .expect("a private sandbox has a token");
    let without = front_get(&agent, &url(&private, 8000, "/hello"), None);
    let wrong = front_get(&agent, &url(&private, 8000, "/hello"), Some("tt-wrong"));
    let with = front_get(&agent, &url(&private, 8000, "/hello"), Some(&token));
    let private_port = api().port(&private.id, 8000).expect("port");
    // Paused, hibernated (woken by the request), destroyed.
    api().pause(&open.id).expect("pause");
    let paused = front_get(&agent, &url(&open, 8000, "/hello"), None);
    api().resume(&open.id).expect("resume");
    api().hibernate(&open.id).expect("hibernate");
    let woken = front_get(&agent, &url(&open, 8000, "/hello"), None);
    let after_wake = get(&open.id).expect("listed");
    destroy(&open.id);
    destroy(&private.id);
    let destroyed = front_get(&agent, &url(&open, 8000, "/hello"), None);

    assert!(!before.listening, "{before:?}");
    assert!(
        before.reason.as_deref().unwrap_or("").contains("port 8000"),
        "{before:?}"
    );
    assert_eq!(nobody.0, 502, "{}", nobody.1);
    assert!(nobody.1.contains("port 8000"), "{}", nobody.1);
    let host = format!("8000-{}.{FRONT_DOMAIN}", open.id);
    assert_eq!(published.host.as_deref(), Some(host.as_str()));
    assert_eq!(
        published.url.as_deref(),
        Some(format!("http://{host}:{door_port}/").as_str())
    );
    assert!(published.listening && !published.private, "{published:?}");
    assert_eq!(hello.0, 200, "{}", hello.1);
    assert!(
        hello.1.starts_with("hello from ")
            && hello.1.contains(&format!("host={host}:{door_port} "))
            && hello.1.contains("forwarded-for=127.0.0.1 ")
            && hello.1.contains(&format!(
                "forwarded-host={host}:{door_port} forwarded-proto=http\n"
            )),
        "{}",
        hello.1
    );
    assert_eq!(chunked.as_deref(), Some("chunked"));
    assert_eq!(ticks, "tick 0\ntick 1\ntick 2\n");
    assert!(
        echoed == sent,
        "{} bytes back for {}",
        echoed.len(),
        sent.len()
    );
    assert_eq!(upgraded.status(), 101);
    assert_eq!(text_back, tungstenite::Message::text(text));
    assert_eq!(blob_back, tungstenite::Message::binary(blob));
    assert_eq!(not_ours.0, 404, "{}", not_ours.1);
    assert!(not_ours.1.contains(FRONT_DOMAIN), "{}", not_ours.1);
    assert_eq!(no_sandbox.0, 404, "{}", no_sandbox.1);
    assert_eq!(no_port.0, 502, "{}", no_port.1);
    assert!(no_port.1.contains("port 8001"), "{}", no_port.1);
    assert_eq!(without.0, 403, "{}", without.1);
    assert!(
        without.1.contains("e2b-traffic-access-token"),
        "{}",
        without.1
    );
    assert_eq!(wrong.0, 403, "{}", wrong.1);
    assert_eq!(with.0, 200, "{}", with.1);
    assert!(private_port.private, "{private_port:?}");
    assert_eq!(paused.0, 409, "{}", paused.1);
    assert!(paused.1.contains("paused"), "{}", paused.1);
    assert_eq!(woken.0, 200, "{}", woken.1);
    assert_eq!(after_wake.state, SandboxState::Running);
    assert_eq!(destroyed.0, 404, "{}", destroyed.1);
}

#[test]
fn the_front_door_speaks_https_with_the_operators_certificate() {
    let (d, _exclusive) = exclusive();
    // The operator's certificate for every sandbox host under the domain.
    let ca = upstream_ca();
    let key = rcgen::KeyPair::generate().expect("key");
    let leaf = rcgen::CertificateParams::new(vec![format!("*.{FRONT_DOMAIN}")])
        .expect("params")
        .signed_by(&key, &ca.cert, &ca.key)
        .expect("leaf");
    let (cert_file, key_file) = (
        d.state_dir.join("front-door.crt"),
        d.state_dir.join("front-door.key"),
    );
    std::fs::write(&cert_file, leaf.pem()).expect("cert");
    std::fs::write(&key_file, key.serialize_pem()).expect("key");
    let flags = |cert: &Path, key: &Path| {
        vec![
            "--expose-tls-cert".to_owned(),
            cert.display().to_string(),
            "--expose-tls-key".to_owned(),
            key.display().to_string(),
        ]
    };
    // A key that is not the certificate's: refused at start, saying so.
    let other = d.state_dir.join("other.key");
    std::fs::write(
        &other,
        rcgen::KeyPair::generate().expect("key").serialize_pem(),
    )
    .expect("other key");
    let wrong = Command::new(common::husk_binary())
        .args(["serve", "--state-dir"])
        .arg(d.state_dir.join("unused"))
        .args(["--expose", "127.0.0.1:0"])
        .args(flags(&cert_file, &other))
        .output()
        .expect("husk serve");
    d.kill();
    d.start(
        &flags(&cert_file, &key_file)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    let s = create("base").sandbox;
    start_test_server(&s.id, 8000);
    let published = api().port(&s.id, 8000).expect("port");
    let door_port = d.expose.rsplit_once(':').expect("port").1;
    let host = format!("8000-{}.{FRONT_DOMAIN}", s.id);
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.cert.der().clone()).expect("CA");
    let client = rustls::ClientConfig::builder_with_provider(tls_provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let agent = front_door_client(d, Some(client));
    let hello = front_get(&agent, &format!("https://{host}:{door_port}/hello"), None);
    // Plain HTTP gets no answer from it.
    let plain = front_door_client(d, None)
        .get(&format!("http://{host}:{door_port}/hello"))
        .call();
    destroy(&s.id);
    d.kill();
    d.start(&[]);

    assert!(!wrong.status.success());
    let why = String::from_utf8_lossy(&wrong.stderr);
    assert!(why.contains("not a certificate and its key"), "{why}");
    assert_eq!(
        published.url.as_deref(),
        Some(format!("https://{host}:{door_port}/").as_str())
    );
    assert_eq!(hello.0, 200, "{}", hello.1);
    assert!(
        hello.1.starts_with(&format!("hello from {}", s.id))
            && hello.1.ends_with("forwarded-proto=https\n"),
        "{}",
        hello.1
    );
    assert!(
        !matches!(plain, Ok(_) | Err(ureq::Error::Status(..))),
        "plain HTTP was answered: {plain:?}"
    );
}

/// A two-layer OCI image layout, as a tar archive, made here from the
/// host's static busybox: layer one a small system with a user `app`
/// (uid 1000) and files under /opt; layer two (gzip) whites out
/// /opt/old, makes /opt/dir opaque and adds files; layer three (zstd, in
/// two frames) adds one more. Its config sets env, working directory,
/// user, entrypoint and command.
fn busybox_image() -> Vec<u8> {
    let busybox = std::fs::read("/bin/busybox").expect("/bin/busybox (busybox-static)");
    let mut lower: Vec<LayerEntry<'_>> = vec![
        ("bin", None, None, 0o755, 0),
        ("bin/busybox", Some(&busybox), None, 0o755, 0),
    ];
    let applets = [
        "sh", "id", "pwd", "ls", "cat", "echo", "env", "sleep", "mkdir",
    ];
    let links: Vec<String> = applets.iter().map(|a| format!("bin/{a}")).collect();
    for l in &links {
        lower.push((l, None, Some("busybox"), 0o777, 0));
    }
    let passwd = b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n";
    let group = b"root:x:0:\napp:x:1000:\n";
    lower.extend_from_slice(&[
        ("etc", None, None, 0o755, 0),
        ("etc/passwd", Some(&passwd[..]), None, 0o644, 0),
        ("etc/group", Some(&group[..]), None, 0o644, 0),
        ("home", None, None, 0o755, 0),
        ("home/app", None, None, 0o755, 1000),
        ("opt", None, None, 0o755, 0),
        ("opt/old", None, None, 0o755, 0),
        ("opt/old/gone.txt", Some(b"gone"), None, 0o644, 0),
        ("opt/dir", None, None, 0o755, 0),
        ("opt/dir/lower.txt", Some(b"lower"), None, 0o644, 0),
        ("opt/keep.txt", Some(b"kept"), None, 0o644, 0),
    ]);
    let lower = image_layer(&lower);
    let upper = image_layer(&[
        ("opt/.wh.old", Some(b""), None, 0o644, 0),
        ("opt/dir/.wh..wh..opq", Some(b""), None, 0o644, 0),
        ("opt/dir/upper.txt", Some(b"upper"), None, 0o644, 0),
        ("app", None, None, 0o755, 1000),
        (
            "app/hello.txt",
            Some(b"hello from the image's second layer\n"),
            None,
            0o644,
            0,
        ),
    ]);
    let upper = {
        use std::io::Write;
        let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        z.write_all(&upper).expect("gzip");
        z.finish().expect("gzip")
    };
    let third = image_layer(&[(
        "app/third.txt",
        Some(b"and from its zstd layer\n"),
        None,
        0o644,
        0,
    )]);
    let third: Vec<u8> = third
        .chunks(third.len() / 2 + 1)
        .flat_map(|c| {
            ruzstd::encoding::compress_to_vec(c, ruzstd::encoding::CompressionLevel::Fastest)
        })
        .collect();
    let config = json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/bin", "GREETING=hello from the image config"],
            "WorkingDir": "/app",
            "User": "app",
            "Entrypoint": ["/bin/sh", "-c"],
            "Cmd": ["echo \"entry: $GREETING in $(pwd) as $(id -u):$(id -g) home $HOME\""]
        },
        "rootfs": { "type": "layers", "diff_ids": [] }
    });
    oci::image(
        None,
        &config,
        &[
            (&lower, "application/vnd.oci.image.layer.v1.tar"),
            (&upper, "application/vnd.oci.image.layer.v1.tar+gzip"),
            (&third, "application/vnd.oci.image.layer.v1.tar+zstd"),
        ],
    )
}

#[test]
fn an_oci_image_becomes_a_template_with_its_layers_whiteouts_and_config() {
    let (d, _g) = shared();
    let image = d.state_dir.with_extension("image.tar");
    std::fs::write(&image, busybox_image()).expect("image archive");
    let husk = |args: &[&str]| {
        Command::new(common::husk_binary())
            .args(args)
            .env("HUSK_HOST", d.state_dir.join("husk.sock"))
            .output()
            .expect("husk")
    };
    let built = husk(&[
        "template",
        "build",
        "busybox-image",
        "--image",
        image.to_str().expect("utf-8"),
    ]);
    let _ = std::fs::remove_file(&image);
    assert!(built.status.success(), "{}", common::text(&built.stderr));
    let template = get_template("busybox-image");
    let s = create("busybox-image").sandbox;
    let ran = exec(
        &s.id,
        &[
            "/bin/sh",
            "-c",
            "echo $GREETING; pwd; id -u; id -g; echo $HOME; ls /opt; ls /opt/dir; cat hello.txt third.txt",
        ],
    )
    .expect("exec");
    // A request's own user, directory and environment win.
    let as_root = exec_with(
        &s.id,
        json!({ "argv": ["/bin/sh", "-c", "id -u; pwd; echo $GREETING"],
                "user": { "uid": 0, "gid": 0 }, "cwd": "/opt", "env": { "GREETING": "mine" } }),
    )
    .expect("exec");
    destroy(&s.id);
    // `husk run` without a command runs the entrypoint and command.
    let run = husk(&["run", "--rm", "busybox-image"]);
    let removed = husk(&["template", "rm", "busybox-image"]);

    let image = template
        .image
        .expect("the template keeps the image's config");
    assert_eq!(image.user.as_deref(), Some("app"));
    assert_eq!(image.working_dir.as_deref(), Some("/app"));
    assert_eq!(image.entrypoint, ["/bin/sh", "-c"]);
    assert_eq!(
        ran.stdout,
        "hello from the image config\n/app\n1000\n1000\n/home/app\ndir\nkeep.txt\n\
         upper.txt\nhello from the image's second layer\nand from its zstd layer\n",
        "{}",
        ran.stderr
    );
    assert_eq!(as_root.stdout, "0\n/opt\nmine\n", "{}", as_root.stderr);
    assert_eq!(
        common::text(&run.stdout),
        "entry: hello from the image config in /app as 1000:1000 home /home/app\n",
        "{}",
        common::text(&run.stderr)
    );
    assert_eq!(run.status.code(), Some(0));
    assert!(
        removed.status.success(),
        "{}",
        common::text(&removed.stderr)
    );
}

#[test]
fn an_idle_sandbox_hibernates_or_goes_but_not_while_a_request_is_in_flight() {
    let (_d, _g) = shared();
    // Its own template: that a hibernated sandbox keeps it is seen alone.
    let t = own_template("idle-own");
    let gone = create_with(json!({
        "template": "base", "on_idle": { "after_s": 2, "action": "destroy" }
    }))
    .expect("create")
    .sandbox;
    let s = create_with(json!({
        "template": "idle-own", "on_idle": { "after_s": 3, "action": "hibernate" }
    }))
    .expect("create")
    .sandbox;
    // A request in flight for longer than the idle time is a use. (On a
    // host slow enough that the sandbox hibernates before it starts, the
    // request waits for the hibernation and wakes it.)
    let long = exec(&s.id, &["/bin/sh", "-c", "sleep 8; echo done"]).expect("exec");
    let after_long = get(&s.id).expect("listed");
    // Unused from then on: it hibernates; the other is destroyed.
    wait_until("the idle sandbox to hibernate", || {
        get(&s.id).is_ok_and(|i| i.state == SandboxState::Hibernated)
    });
    wait_until("the idle sandbox to be destroyed", || {
        status(get(&gone.id)).0 == 404
    });
    // A hibernated sandbox keeps its template.
    let kept_template = status(api().remove_template(&t.name));
    // Any use wakes it, with its policy kept.
    let back = exec(&s.id, &["echo", "back"]).expect("exec");
    let woken = get(&s.id).expect("listed");
    // Requests at moments around its idle time: each either comes before
    // the hibernation looks for uses (which then leaves it running) or
    // waits for the hibernation and wakes it; none is cut with the VMM.
    let around: Vec<_> = [2800, 3000, 3200, 3400]
        .into_iter()
        .map(|ms| {
            std::thread::sleep(Duration::from_millis(ms));
            exec(&s.id, &["echo", "around"]).map(|r| r.stdout)
        })
        .collect();
    let audit = api().audit(Some(&s.id)).expect("audit");
    destroy(&s.id);
    let removed = api().remove_template(&t.name);

    assert_eq!(long.stdout, "done\n", "{}", long.stderr);
    assert_eq!(kept_template.0, 409, "{}", kept_template.1);
    assert!(kept_template.1.contains("sandbox"), "{}", kept_template.1);
    assert!(removed.is_ok(), "{removed:?}");
    assert_eq!(after_long.state, SandboxState::Running);
    assert_eq!(back.stdout, "back\n", "{}", back.stderr);
    assert!(
        around
            .iter()
            .all(|r| r.as_ref().is_ok_and(|o| o == "around\n")),
        "{around:?}"
    );
    assert_eq!(woken.state, SandboxState::Running);
    assert_eq!(
        woken.on_idle.map(|p| p.after_s),
        Some(3),
        "the policy is kept: {woken:?}"
    );
    assert!(
        audit
            .iter()
            .any(|e| e.who == "idle" && e.action == "hibernate"),
        "{audit:?}"
    );
}

#[test]
fn a_full_host_refuses_creates_with_429() {
    let d = daemon();
    let _exclusive = DAEMON_LOCK.write().unwrap_or_else(|e| e.into_inner());
    let live: Vec<SandboxInfo> = api().call("GET", "/v1/sandboxes", None).expect("list");
    let max = (live.len() + 1).to_string();
    d.kill();
    d.start(&["--max-sandboxes", &max]);

    let fits = create("base").sandbox;
    let refused = status(create_with(json!({ "template": "base" })));
    destroy(&fits.id);
    let fits_again = create("base").sandbox;
    d.kill();
    d.start(&[]);

    assert_eq!(refused.0, 429, "{}", refused.1);
    assert!(refused.1.contains("maximum"), "{}", refused.1);
    destroy(&fits_again.id);
}

#[test]
fn creates_succeed_with_both_cores_busy() {
    let (_d, _g) = shared();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let created: Vec<Created> = std::thread::scope(|s| {
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        for _ in 0..cpus {
            s.spawn(|| {
                let mut x = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                }
            });
        }
        let made = (0..3).map(|_| create("base")).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        made
    });

    for c in &created {
        assert_eq!(sh(&c.sandbox.id, "hostname").stdout.trim(), c.sandbox.id);
        destroy(&c.sandbox.id);
    }
}

#[test]
fn bad_requests_get_clear_errors_and_change_nothing() {
    // Alone: it counts the template directories, which a concurrent build
    // would change.
    let (d, _g) = exclusive();
    let templates_before = std::fs::read_dir(d.state_dir.join("templates"))
        .expect("templates dir")
        .count();
    let raw = |method: &str, path: &str, body: &[u8]| {
        status(api().send(method, path, Payload::Json(body.to_vec())))
    };
    let s = create("base").sandbox;
    let listed = || {
        api()
            .call::<Vec<SandboxInfo>>("GET", "/v1/sandboxes", None)
            .expect("list")
            .len()
    };
    let sandboxes_before = listed();

    let cases = [
        (raw("POST", "/v1/sandboxes", b"{bad"), 400, "malformed JSON"),
        (
            raw("POST", "/v1/sandboxes", br#"{"template":"base","x":1}"#),
            400,
            "unknown field",
        ),
        (
            raw("POST", "/v1/sandboxes", br#"{"template":"nope"}"#),
            404,
            "no template",
        ),
        (
            raw(
                "POST",
                "/v1/sandboxes",
                br#"{"template":"base","labels":{"a b":"c"}}"#,
            ),
            400,
            "label",
        ),
        (
            raw("POST", "/v1/sandboxes", &vec![b' '; 2 << 20]),
            413,
            "limit",
        ),
        (
            raw("GET", "/v1/sandboxes?state=weird", b""),
            400,
            "unknown state",
        ),
        (
            raw(
                "POST",
                "/v1/sandboxes",
                br#"{"template":"base","on_idle":{"after_s":0,"action":"hibernate"}}"#,
            ),
            400,
            "after_s",
        ),
        (
            raw("GET", &format!("/v1/sandboxes/{}/ports/70000", s.id), b""),
            400,
            "not a TCP port",
        ),
        // A pod network is a CRI's namespace, never the host's.
        (
            raw(
                "POST",
                &format!("/v1/sandboxes/{}/network", s.id),
                br#"{"netns":"/proc/self/ns/net"}"#,
            ),
            400,
            "pod netns `/proc/self/ns/net`",
        ),
        // An egress policy replaced with a bad entry, or a mount without
        // a guest path, changes nothing.
        (
            raw(
                "PUT",
                &format!("/v1/sandboxes/{}/egress", s.id),
                br#"{"allow":["http://x/y"]}"#,
            ),
            400,
            "`egress.allow`",
        ),
        (
            raw("PUT", "/v1/sandboxes/sb-nope/egress", br#"{"allow":[]}"#),
            404,
            "no sandbox",
        ),
        (
            raw(
                "POST",
                &format!("/v1/sandboxes/{}/mounts", s.id),
                br#"{"host":"/tmp"}"#,
            ),
            400,
            "missing field `guest`",
        ),
        (
            raw(
                "POST",
                &format!("/v1/sandboxes/{}/exec", s.id),
                br#"{"argv":[]}"#,
            ),
            400,
            "argv",
        ),
        (
            raw(
                "GET",
                &format!("/v1/sandboxes/{}/files?path=relative", s.id),
                b"",
            ),
            400,
            "absolute",
        ),
        (
            raw(
                "GET",
                &format!("/v1/sandboxes/{}/files?path=/nonexistent", s.id),
                b"",
            ),
            404,
            "No such file",
        ),
        (
            raw(
                "POST",
                &format!("/v1/sandboxes/{}/exec", s.id),
                br#"{"argv":["/nonexistent"]}"#,
            ),
            404,
            "cannot run",
        ),
        (
            raw("PUT", "/v1/pools/nope", br#"{"size":1}"#),
            404,
            "no template",
        ),
        (
            raw("POST", "/v1/templates", br#"{"name":"Bad Name"}"#),
            400,
            "template name",
        ),
        (
            raw("POST", "/v1/templates", br#"{"name":"base"}"#),
            409,
            "exists",
        ),
        (raw("POST", "/v1/nowhere", b""), 404, "no such route"),
    ];
    let hostile = api()
        .upload(&mut &hostile_tar_bytes()[..])
        .expect("upload the hostile tar");
    let tar_build = build_template(
        "hostile",
        json!({ "name": "hostile", "rootfs": { "kind": "upload", "upload": hostile } }),
    );
    let not_a_kernel = api()
        .upload(&mut &b"not a kernel"[..])
        .expect("upload a kernel");
    let boot_failure = build_template(
        "noboot",
        json!({ "name": "noboot", "kernel": { "upload": not_a_kernel } }),
    );

    let sandboxes_after = listed();
    for ((code, message), want, says) in cases {
        assert_eq!(code, want, "{message}");
        assert!(message.contains(says), "{message} (wanted `{says}`)");
    }
    assert_eq!(
        sandboxes_before, sandboxes_after,
        "a refused create left a sandbox"
    );
    let (code, message) = tar_build.expect_err("hostile tar");
    assert_eq!(code, 400, "{message}");
    assert!(message.contains("absolute"), "{message}");
    let (_, message) = boot_failure.expect_err("boot failure");
    assert!(message.contains("build failed"), "{message}");
    let templates_after = std::fs::read_dir(d.state_dir.join("templates"))
        .expect("templates dir")
        .count();
    assert_eq!(
        templates_before, templates_after,
        "a failed build left files"
    );
    // The daemon and the sandbox are unharmed.
    assert_eq!(sh(&s.id, "echo ok").stdout, "ok\n");
    destroy(&s.id);
}

/// The daemon (root) reads no host path an API client names for a
/// template, unless it lies in a `--template-source` directory; symbolic
/// links do not lead out of one. No case here boots a guest: each is
/// refused, or reaches the unpacking of a hostile archive, before that.
#[test]
fn template_sources_are_the_operators_and_everything_else_comes_as_an_upload() {
    // Alone: it counts the template directories.
    let (d, _g) = exclusive();
    let sources = template_sources(d);
    let outside = d.state_dir.join("outside.tar");
    std::fs::write(&outside, hostile_tar_bytes()).expect("tar outside");
    std::fs::write(sources.join("hostile.tar"), hostile_tar_bytes()).expect("tar inside");
    let link = sources.join("link-out");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&outside, &link).expect("symlink");
    let templates_before = std::fs::read_dir(d.state_dir.join("templates"))
        .expect("templates dir")
        .count();
    let spec = |name: &str, rootfs: Value| json!({ "name": name, "rootfs": rootfs });

    let refused = [
        build_template("etc", spec("etc", json!({ "kind": "dir", "path": "/etc" }))),
        build_template(
            "out",
            spec("out", json!({ "kind": "tar", "path": outside })),
        ),
        build_template("link", spec("link", json!({ "kind": "tar", "path": link }))),
        build_template(
            "dots",
            spec(
                "dots",
                json!({ "kind": "tar", "path": sources.join("../outside.tar") }),
            ),
        ),
        build_template("knl", json!({ "name": "knl", "kernel": "/etc/passwd" })),
    ];
    let inside = build_template(
        "inside",
        spec(
            "inside",
            json!({ "kind": "tar", "path": sources.join("hostile.tar") }),
        ),
    );
    let upload = api().upload(&mut &b"x"[..]).expect("upload");
    let used_up = (
        build_template(
            "used1",
            json!({ "name": "used1", "kernel": { "upload": upload } }),
        ),
        build_template(
            "used2",
            json!({ "name": "used2", "kernel": { "upload": upload } }),
        ),
    );
    let no_upload = build_template(
        "noup",
        spec("noup", json!({ "kind": "upload", "upload": "../../etc" })),
    );

    for result in refused {
        let (code, message) = result.expect_err("a path outside the sources");
        assert_eq!(code, 403, "{message}");
        assert!(message.contains("--template-source"), "{message}");
        assert!(message.contains("upload"), "{message}");
    }
    let (code, message) = inside.expect_err("the hostile tar");
    assert_eq!(code, 400, "{message}");
    assert!(message.contains("absolute"), "{message}");
    used_up.0.expect_err("not a kernel");
    let (code, message) = used_up.1.expect_err("an upload used twice");
    assert_eq!(code, 404, "{message}");
    assert!(message.contains("used by one build"), "{message}");
    let (code, message) = no_upload.expect_err("no such upload");
    assert_eq!(code, 404, "{message}");
    let templates_after = std::fs::read_dir(d.state_dir.join("templates"))
        .expect("templates dir")
        .count();
    assert_eq!(
        templates_before, templates_after,
        "a refused build left files"
    );
    let _ = std::fs::remove_file(outside);
}

/// The directory the test daemon lets API clients build templates from.
fn template_sources(d: &TestDaemon) -> PathBuf {
    d.state_dir.join("sources")
}

/// The directory beneath which the test daemon mounts host directories.
fn mount_root(d: &TestDaemon) -> PathBuf {
    d.state_dir.join("shared")
}

/// A tar whose one entry has an absolute path.
fn hostile_tar_bytes() -> Vec<u8> {
    let mut h = [0u8; 512];
    let name = b"/etc/shadow";
    h[..name.len()].copy_from_slice(name);
    h[100..108].copy_from_slice(b"0000644\0");
    h[108..116].copy_from_slice(b"0000000\0");
    h[116..124].copy_from_slice(b"0000000\0");
    h[124..136].copy_from_slice(b"00000000000\0");
    h[136..148].copy_from_slice(b"00000000000\0");
    h[156] = b'0';
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    let mut out = h.to_vec();
    out.extend_from_slice(&[0u8; 1024]);
    out
}

#[test]
fn destroy_racing_exec_ends_the_stream_and_leaves_the_daemon_whole() {
    let (_d, _g) = shared();
    let s = create("base").sandbox;
    let other = create("base").sandbox;
    let mut resp = exec_stream(&s.id, &["/bin/sh", "-c", "echo started; sleep 600"]).expect("exec");
    while !matches!(
        resp.next_line::<ExecEvent>().expect("line"),
        Some(ExecEvent::Stdout { .. })
    ) {}

    destroy(&s.id);
    // The stream ends (an error event, or a body cut short), it does not
    // hang until the program's sleep is over.
    let mut ended_well = false;
    loop {
        match resp.next_line::<ExecEvent>() {
            Ok(Some(ExecEvent::Exit { .. })) => ended_well = true,
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }

    assert!(!ended_well, "the program cannot have exited on its own");
    assert_eq!(status(get(&s.id)).0, 404);
    assert!(!pid_alive(s.pid));
    assert_eq!(sh(&other.id, "echo ok").stdout, "ok\n");
    destroy(&other.id);
}

#[test]
fn a_client_that_leaves_mid_stream_gets_its_program_killed() {
    let (d, _g) = shared();
    let s = create("base").sandbox;
    let mut resp =
        exec_stream(&s.id, &["/bin/sh", "-c", "while true; do echo flood; done"]).expect("exec");
    let mut seen = 0;
    while seen < 3 {
        if let Some(ExecEvent::Stdout { .. }) = resp.next_line::<ExecEvent>().expect("line") {
            seen += 1;
        }
    }
    drop(resp);

    // The guest's agent, asked directly: nothing of the flood is left.
    let vsock = d.state_dir.join("sandboxes").join(&s.id).join("vsock");
    wait_until("the flood to be killed", || {
        let mut agent = husk_agent_client::AgentClient::connect(&vsock, patience()).expect("agent");
        agent
            .processes()
            .expect("processes")
            .iter()
            .all(|p| p.exit.is_some() || !p.argv.join(" ").contains("flood"))
    });
    assert_eq!(sh(&s.id, "echo ok").stdout, "ok\n");
    destroy(&s.id);
}

#[test]
fn a_flipped_byte_in_a_template_fails_verification() {
    let (_d, _g) = shared();
    let t = own_template("corrupt-me");
    let ok: Value = api()
        .call("POST", "/v1/templates/corrupt-me/verify", None)
        .expect("verify");
    let memory = t.snapshot_dir.join("memory");
    let mut bytes = std::fs::read(&memory).expect("memory file");
    bytes[4096 * 7 + 3] ^= 0x40;
    std::fs::write(&memory, bytes).expect("flip");

    let (code, message) =
        status(api().call::<Value>("POST", "/v1/templates/corrupt-me/verify", None));

    assert_eq!(ok["ok"], true);
    assert_eq!(code, 409);
    assert!(message.contains("memory: checksum mismatch"), "{message}");
    api()
        .send("DELETE", "/v1/templates/corrupt-me", Payload::None)
        .expect("remove");
}

#[test]
fn every_documented_route_is_served() {
    let (_d, _g) = shared();
    let doc: Value =
        serde_json::from_str(include_str!("../host/openapi.json")).expect("openapi.json");

    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in item.as_object().expect("item").keys() {
            let concrete = path
                .replace("{id}", "sb-000000000000")
                .replace("{template}", "nope")
                .replace("{pid}", "1");
            let result = api().send(
                &method.to_uppercase(),
                &format!("{concrete}?path=/x"),
                Payload::Json(b"{}".to_vec()),
            );
            // A route may document 405 as its answer (GET /mcp: no
            // server-sent events); any other 405 means it is not served.
            let documented_405 = item[method]["responses"].get("405").is_some();
            if let Err(ApiClientError::Status { status, message }) = result {
                assert!(
                    (status != 405 || documented_405) && !message.contains("no such route"),
                    "{method} {path}: {status} {message}"
                );
            }
        }
    }
}

#[test]
fn every_documented_e2b_route_is_served() {
    let (d, _g) = shared();
    let doc: Value =
        serde_json::from_str(include_str!("../host/e2b-openapi.json")).expect("e2b-openapi.json");
    // A connection per request: a route that answers before it reads a
    // body may close its connection.
    let agent = ureq::AgentBuilder::new()
        .timeout(patience())
        .max_idle_connections(0)
        .build();
    // Each route with a sandbox, template, volume or secret that is not
    // there, and an empty body: nothing is made; an answer other than the
    // route's own (405, or the fallback's "no such route") means it is
    // not served.
    let answer = |method: &str, path: &str| {
        let url = format!("http://{}{}", d.e2b, path.replace("{id}", "nope"));
        let request = agent
            .request(method, &url)
            .set("X-API-Key", E2B_KEY)
            .set("E2b-Sandbox-Id", "nope")
            .set("X-Access-Token", "nope");
        let result = match method {
            "POST" | "PUT" => request
                .set("Content-Type", "application/json")
                .send_bytes(b"{}"),
            _ => request.call(),
        };
        match result {
            Ok(r) => (r.status(), r.into_string().expect("body")),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().expect("body")),
            Err(e) => panic!("{method} {path}: {e}"),
        }
    };
    let mut routes = 0;
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in item.as_object().expect("item").keys() {
            let (status, body) = answer(&method.to_uppercase(), path);
            assert!(
                status != 405 && !body.contains("no such route"),
                "{method} {path}: {status} {body}"
            );
            routes += 1;
        }
    }
    // One the document says is not served answers as such.
    let logs = answer("GET", "/sandboxes/{id}/logs");

    assert!(routes >= 40, "{routes} routes documented");
    assert_eq!(logs.0, 404);
    assert!(logs.1.contains("no such route"), "{}", logs.1);
}

#[test]
fn the_tcp_api_wants_the_bearer_token() {
    let (d, _g) = shared();
    let anonymous = ApiClient::new(Endpoint::Tcp(d.tcp.clone(), String::new()));
    let wrong = ApiClient::new(Endpoint::Tcp(d.tcp.clone(), "x".repeat(26)));
    let right = ApiClient::new(Endpoint::Tcp(d.tcp.clone(), d.token.clone()));

    assert_eq!(
        status(anonymous.call::<Value>("GET", "/v1/info", None)).0,
        401
    );
    assert_eq!(
        status(wrong.call::<Value>("GET", "/v1/sandboxes", None)).0,
        401
    );
    assert!(right.call::<Value>("GET", "/v1/info", None).is_ok());
}

/// The daemon's /metrics text.
fn metrics_text() -> String {
    let mut text = String::new();
    api()
        .send("GET", "/metrics", Payload::None)
        .expect("metrics")
        .read_to_string(&mut text)
        .expect("text");
    text
}

/// The `husk_idle_reclaims` counter at /metrics.
fn idle_reclaims() -> u64 {
    let text = metrics_text();
    text.lines()
        .find_map(|l| l.strip_prefix("husk_idle_reclaims_total "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no husk_idle_reclaims_total in {text}"))
}

#[test]
fn an_idle_sandbox_is_asked_for_memory_back_once_per_idle_period() {
    let d = daemon();
    let _exclusive = DAEMON_LOCK.write().unwrap_or_else(|e| e.into_inner());
    d.kill();
    d.start(&["--reclaim-idle-s", "2"]);
    let s = create("base").sandbox;
    // The daemon's log says which sandbox gave memory back (other tests'
    // sandboxes, idle meanwhile, are asked too).
    let log = d.state_dir.with_extension("log");
    let logged_before = std::fs::read_to_string(&log).unwrap_or_default().len();
    let reclaims = || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.get(logged_before..)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("idle: memory reclaimed") && l.contains(&s.id))
            .count()
    };
    let counted = |at_least: usize| {
        let deadline = Instant::now() + patience();
        while reclaims() < at_least && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(500));
        }
        reclaims()
    };
    // Idle for 2 s: asked once, however long it stays idle.
    let first = counted(1);
    std::thread::sleep(Duration::from_secs(6));
    let still = reclaims();
    // Used again: a new idle period, asked again; the guest is whole.
    let ran = sh(&s.id, "echo after");
    let second = counted(first + 1);
    let counter = idle_reclaims();
    let info = get(&s.id).expect("listed");
    destroy(&s.id);
    d.kill();
    d.start(&[]);

    assert_eq!(first, 1, "asked once");
    assert_eq!(still, first, "asked again without a use between");
    assert_eq!(ran.stdout, "after\n", "{ran:?}");
    assert_eq!(second, first + 1, "asked after its next use");
    assert!(counter >= 2, "husk_idle_reclaims_total {counter}");
    assert_eq!(info.state, SandboxState::Running);
}

#[test]
fn metrics_and_the_audit_log_record_the_work() {
    let (_d, _g) = shared();
    let s = create_with(json!({ "template": "base", "labels": { "suite": "metrics" } }))
        .expect("create")
        .sandbox;
    sh(&s.id, "true");
    let listed: Vec<SandboxInfo> = api()
        .call("GET", "/v1/sandboxes?label=suite%3Dmetrics", None)
        .expect("filtered list");
    destroy(&s.id);

    let text = metrics_text();
    let audit: Vec<AuditEntry> = api()
        .call("GET", &format!("/v1/audit?sandbox={}", s.id), None)
        .expect("audit");
    let actions: Vec<&str> = audit.iter().map(|e| e.action.as_str()).collect();

    assert_eq!(
        listed.iter().map(|l| l.id.as_str()).collect::<Vec<_>>(),
        [s.id.as_str()]
    );
    assert!(
        text.contains("husk_create_seconds_count{pooled=\"false\"}"),
        "{text}"
    );
    assert!(text.contains("husk_sandboxes{state=\"running\"}"), "{text}");
    assert!(text.contains("husk_daemon_resident_bytes"), "{text}");
    assert_eq!(actions, ["create", "exec", "destroy"]);
    assert!(audit[0].who.starts_with("uid="), "{:?}", audit[0]);
}

#[test]
fn labels_filter_the_list() {
    let (_d, _g) = shared();
    let a = create_with(json!({ "template": "base", "labels": { "team": "red", "tier": "x" } }))
        .expect("a")
        .sandbox;
    let b = create_with(json!({ "template": "base", "labels": { "team": "blue" } }))
        .expect("b")
        .sandbox;

    let red: Vec<SandboxInfo> = api()
        .call("GET", "/v1/sandboxes?label=team%3Dred&label=tier%3Dx", None)
        .expect("list");
    let blue: Vec<SandboxInfo> = api()
        .call("GET", "/v1/sandboxes?label=team%3Dblue&state=running", None)
        .expect("list");

    assert_eq!(red.iter().map(|s| &s.id).collect::<Vec<_>>(), [&a.id]);
    assert_eq!(blue.iter().map(|s| &s.id).collect::<Vec<_>>(), [&b.id]);
    destroy(&a.id);
    destroy(&b.id);
}

#[test]
fn each_vmm_runs_in_its_own_limited_cgroup() {
    let (_d, _g) = shared();
    let info: Value = api().call("GET", "/v1/info", None).expect("info");
    if info["cgroups"] == "none" {
        common::skip("the daemon has no cgroup hierarchy it may manage here (not root?)");
        return;
    }
    let s = create("base").sandbox;

    let membership = std::fs::read_to_string(format!("/proc/{}/cgroup", s.pid)).expect("cgroup");
    let memory_line = membership
        .lines()
        .find(|l| l.contains(":memory:") || l.starts_with("0::"))
        .expect("a memory cgroup");
    let rel = memory_line.rsplit(':').next().expect("path");
    let (limit_file, mount) = if info["cgroups"] == "v1" {
        ("memory.limit_in_bytes", "/sys/fs/cgroup/memory")
    } else {
        ("memory.max", "/sys/fs/cgroup")
    };
    let dir = Path::new(mount).join(rel.trim_start_matches('/'));
    let limit = std::fs::read_to_string(dir.join(limit_file)).expect("limit");
    destroy(&s.id);

    assert!(rel.ends_with(&format!("husk/{}", s.id)), "{membership}");
    assert_eq!(limit.trim(), ((128u64 + 128) << 20).to_string());
    assert!(!dir.exists(), "{} is left after destroy", dir.display());
}

/// A reader that gives `n` bytes, then fails (a client that dies).
struct BreaksAfter(usize);

impl Read for BreaksAfter {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.0 == 0 {
            return Err(std::io::Error::other("the client died"));
        }
        let n = buf.len().min(self.0);
        buf[..n].fill(b'x');
        self.0 -= n;
        Ok(n)
    }
}

#[test]
fn an_upload_broken_off_leaves_no_file() {
    let (_d, _g) = shared();
    let s = create("base").sandbox;

    let broken = api().send(
        "PUT",
        &format!("/v1/sandboxes/{}/files?path=/tmp/partial", s.id),
        Payload::Stream(&mut BreaksAfter(200_000)),
    );
    // The daemon sees the body end early and drops the agent connection;
    // the agent removes its temporary file and never renames it into
    // place. A committed partial file would stay, and this would time out.
    wait_until("no trace of the broken upload in the guest", || {
        !sh(&s.id, "ls -a /tmp").stdout.contains("partial")
    });

    assert!(broken.is_err());
    assert_eq!(status(download(&s.id, "/tmp/partial")).0, 404);
    destroy(&s.id);
}

/// A root file system tree: busybox and the applets the tests run, and a
/// file of its own.
fn rootfs_tree(d: &TestDaemon) -> PathBuf {
    let tree = d.state_dir.join("ctr");
    let _ = std::fs::remove_dir_all(&tree);
    std::fs::create_dir_all(tree.join("bin")).expect("bin");
    std::fs::create_dir_all(tree.join("etc")).expect("etc");
    std::fs::copy("/bin/busybox", tree.join("bin/busybox")).expect("busybox");
    for applet in ["sh", "cat", "grep", "nc", "ifconfig"] {
        std::os::unix::fs::symlink("busybox", tree.join("bin").join(applet)).expect("applet");
    }
    std::fs::write(tree.join("etc/motd"), "from the archive\n").expect("motd");
    tree
}

/// One template (one boot) for two features: its root file system comes
/// from a local directory (which the CLI uploads as a tar archive), and it has a network device (where the host allows
/// one: root and nftables), which gives each sandbox its own TAP, MAC,
/// network namespace and firewall.
#[test]
fn a_template_from_a_local_directory_boots_with_its_files_and_gives_each_sandbox_its_own_tap_and_mac(
) {
    let (d, _g) = shared();
    // SAFETY: getuid cannot fail.
    let network = if unsafe { libc::getuid() } != 0 {
        common::skip("the network part: creating TAP devices needs root (CAP_NET_ADMIN)");
        false
    } else if Command::new("nft").arg("--version").output().is_err() {
        common::skip(
            "the network part: a sandbox with a NIC gets a firewall, which needs nftables (`nft`)",
        );
        false
    } else {
        true
    };
    let tree = rootfs_tree(d);
    let built = Command::new(common::husk_binary())
        .args(["template", "build", "fromtar", "--dir"])
        .arg(&tree)
        .args(if network { &["--network"][..] } else { &[][..] })
        .env("HUSK_HOST", d.state_dir.join("husk.sock"))
        .output()
        .expect("husk template build");
    assert!(built.status.success(), "{}", common::text(&built.stderr));
    let t = get_template("fromtar");
    let a = create("fromtar").sandbox;
    let files = sh(&a.id, "cat /etc/motd; cat /proc/mounts | grep ' / '");

    // The CLI sent the directory as a tar archive: the daemon read no
    // host path of the client's.
    assert!(t.source.starts_with("upload:up-"), "{}", t.source);
    assert_eq!(t.network, network);
    assert!(files.stdout.starts_with("from the archive\n"), "{files:?}");
    assert!(files.stdout.contains(" / ext4 rw"), "{files:?}");
    if network {
        let b = create("fromtar").sandbox;
        each_sandbox_has_its_own_tap_and_mac(&a, &b);
        destroy(&b.id);
    } else {
        destroy(&a.id);
    }
    api()
        .send("DELETE", "/v1/templates/fromtar", Payload::None)
        .expect("remove");
    let _ = std::fs::remove_dir_all(tree);
}

/// Two sandboxes of a network template: each TAP in its own sandbox's
/// network namespace, MACs of their own, and a firewall that drops what
/// the guest sends; destroys `a`.
fn each_sandbox_has_its_own_tap_and_mac(a: &SandboxInfo, b: &SandboxInfo) {
    let tap_a = a.tap.clone().expect("a TAP");
    let tap_exists = |tap: &str| {
        Command::new("ip")
            .args(["link", "show", tap])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("ip")
            .success()
    };

    // Each TAP lives in its sandbox's own network namespace.
    let in_sandbox_netns = |pid: u32, tap: &str| {
        Command::new("nsenter")
            .args(["-t", &pid.to_string(), "-n", "ip", "link", "show", tap])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("nsenter")
            .success()
    };

    let mac_a = sh(&a.id, "cat /sys/class/net/eth0/address").stdout;
    let mac_b = sh(&b.id, "cat /sys/class/net/eth0/address").stdout;
    let up_while_running = in_sandbox_netns(a.pid, &tap_a);
    let in_host_netns = tap_exists(&tap_a);
    let in_neighbours_netns = in_sandbox_netns(b.pid, &tap_a);

    // The firewall in the sandbox's namespace: a listener on the TAP's side
    // of the link gets nothing from the guest, until the rules are flushed
    // (which shows the path itself works).
    let in_netns = |args: &[&str]| {
        let out = Command::new("nsenter")
            .args(["-t", &a.pid.to_string(), "-n"])
            .args(args)
            .output()
            .expect("nsenter");
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let rules = in_netns(&["nft", "list", "ruleset"]);
    in_netns(&["ip", "addr", "add", "10.200.0.1/24", "dev", &tap_a]);
    let (port, heard, stop) = listen_in_netns(a.pid, "10.200.0.1");
    sh(&a.id, "ifconfig eth0 10.200.0.2 netmask 255.255.255.0 up");
    let try_connect = || {
        sh(
            &a.id,
            &format!("echo through | nc -w 5 10.200.0.1 {port}; echo rc=$?"),
        )
        .stdout
    };
    let firewalled = try_connect();
    let heard_firewalled = heard.lock().expect("lock").clone();
    in_netns(&["nft", "flush", "ruleset"]);
    let open = try_connect();
    wait_until("the guest's message through the open path", || {
        !heard.lock().expect("lock").is_empty()
    });
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    destroy(&a.id);

    assert_eq!(mac_a.trim(), a.mac.as_deref().expect("a MAC"));
    assert_eq!(mac_b.trim(), b.mac.as_deref().expect("a MAC"));
    assert_ne!(a.mac, b.mac);
    assert!(up_while_running, "{tap_a} missing while its sandbox runs");
    assert!(!in_host_netns, "{tap_a} is in the host's network namespace");
    assert!(
        !in_neighbours_netns,
        "{tap_a} is in another sandbox's namespace"
    );
    assert!(!tap_exists(&tap_a), "{tap_a} is left after destroy");
    for chain in ["input", "forward", "output"] {
        assert!(
            rules.contains(&format!("chain {chain} {{")),
            "no {chain} chain: {rules}"
        );
    }
    assert_eq!(rules.matches("policy drop;").count(), 3, "{rules}");
    assert!(!firewalled.contains("rc=0"), "{firewalled}");
    assert!(heard_firewalled.is_empty(), "{heard_firewalled:?}");
    assert!(open.contains("rc=0"), "{open}");
    assert_eq!(heard.lock().expect("lock")[0], "through\n");
}

/// The API key the E2B SDK is given in these tests.
const E2B_KEY: &str = "e2b_00112233445566778899aabbccddeeff";

/// The client `var` names (`make test` sets it up), or `None` after saying
/// that the test is skipped and why.
fn client_from_env(var: &str, what: &str) -> Option<std::ffi::OsString> {
    let value = std::env::var_os(var).filter(|v| !v.is_empty());
    if value.is_none() {
        common::skip(&format!("{var} ({what}; `make test` sets it up)"));
    }
    value
}

const PYTHON_CLIENTS: &str = "a python with the pinned clients of tests/py/requirements.txt";

/// `program` with the environment an E2B SDK reads, aimed at the test
/// daemon's E2B API.
fn e2b_client(program: impl AsRef<std::ffi::OsStr>, d: &TestDaemon) -> Command {
    let url = format!("http://{}", d.e2b);
    let mut cmd = Command::new(program);
    cmd.env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("E2B_API_KEY", E2B_KEY)
        .env("HUSK_E2B_TEMPLATE", "base")
        .env("HUSK_FRONT_DOOR", &d.expose)
        .env("HUSK_FRONT_DOMAIN", FRONT_DOMAIN)
        // The clients' request timeouts: patience() as the client starts.
        .env("HUSK_PATIENCE_S", patience().as_secs().to_string());
    cmd
}

/// Runs a client program to its end: its standard output, once it has
/// succeeded (the test fails with both of its streams otherwise).
fn run_client(mut cmd: Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn the_e2b_python_sdk_drives_husk_unchanged() {
    let (d, _g) = shared();
    let Some(python) = client_from_env("HUSK_TEST_PYTHON", PYTHON_CLIENTS) else {
        return;
    };
    let tests = common::repo_root().join("tests/py/test_e2b.py");
    let mut cmd = e2b_client(python, d);
    cmd.args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(tests);
    eprintln!("{}", run_client(cmd, "the E2B SDK's tests"));
    // Nothing the SDK made is left.
    let left: Vec<SandboxInfo> = api()
        .call("GET", "/v1/sandboxes?label=e2b%3D1", None)
        .expect("list");
    let audit: Vec<AuditEntry> = api()
        .call("GET", "/v1/audit?limit=10000", None)
        .expect("audit");
    let by_envd = |action: &str| {
        audit
            .iter()
            .any(|e| e.who == "e2b envd" && e.action == action)
    };

    assert!(left.is_empty(), "{left:?}");
    // What the SDK did in its sandboxes is audited as the REST API's is
    // (its commands are the process table's programs).
    for action in ["process-start", "process-signal", "upload", "download"] {
        assert!(
            by_envd(action),
            "no `{action}` through envd in the audit log"
        );
    }
}

#[test]
fn the_e2b_js_sdk_drives_husk_unchanged() {
    let (d, _g) = shared();
    let Some(dir) = client_from_env(
        "HUSK_TEST_JS",
        "node 20.18+ with the pinned clients of tests/js/package.json",
    ) else {
        return;
    };
    let mut cmd = e2b_client("node", d);
    cmd.arg("e2b_client.mjs").current_dir(&dir);
    let stdout = run_client(cmd, "the E2B JS SDK");
    assert!(stdout.contains("e2b js sdk: ok"), "{stdout}");
}

#[test]
fn the_official_mcp_client_lists_and_calls_every_tool() {
    let (d, _g) = shared();
    let Some(python) = client_from_env("HUSK_TEST_PYTHON", PYTHON_CLIENTS) else {
        return;
    };
    let script = common::repo_root().join("tests/py/mcp_client.py");
    let mut cmd = Command::new(python);
    cmd.arg(script)
        .env("HUSK_BIN", common::husk_binary())
        .env("HUSK_HOST", d.state_dir.join("husk.sock"))
        .env("HUSK_MCP_URL", format!("http://{}/mcp", d.tcp))
        .env("HUSK_TOKEN", &d.token);
    let stdout = run_client(cmd, "the MCP client");
    let summary: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .expect("the client's summary");
    // What the client destroyed, and what it left when it went, are gone,
    // on either transport.
    for (transport, key) in [
        ("stdio", "destroyed"),
        ("stdio", "left"),
        ("http", "destroyed"),
        ("http", "left"),
    ] {
        let id = summary[transport][key].as_str().expect("a sandbox id");
        wait_until(&format!("{id} to be gone"), || {
            matches!(get(id), Err(ApiClientError::Status { status: 404, .. }))
        });
    }
    // The daemon's /mcp calls the core in process: what its session did is
    // audited under the session and the client's TCP address (not as the
    // daemon calling itself), and so is the end of the session.
    let id = summary["http"]["destroyed"].as_str().expect("an id");
    let left = summary["http"]["left"].as_str().expect("an id");
    let audit: Vec<AuditEntry> = api()
        .call("GET", "/v1/audit?limit=10000", None)
        .expect("audit");
    let by_session = |sandbox: &str, action: &str| {
        audit.iter().any(|e| {
            e.sandbox.as_deref() == Some(sandbox)
                && e.action == action
                && e.who.starts_with("mcp ")
                && e.who.contains("127.0.0.1")
        })
    };
    for action in ["create", "exec", "upload", "download", "list", "destroy"] {
        assert!(
            by_session(id, action),
            "no `{action}` of {id} by the MCP session: {audit:?}"
        );
    }
    assert!(
        by_session(left, "destroy"),
        "{left} not destroyed by its session"
    );
}

/// A TCP listener on `ip` in the network namespace of process `pid`:
/// returns its port, what each connection sent, and a flag that stops it
/// (so its socket does not keep the namespace alive).
fn listen_in_netns(
    pid: u32,
    ip: &'static str,
) -> (
    u16,
    std::sync::Arc<Mutex<Vec<String>>>,
    std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    use std::os::fd::AsRawFd;
    use std::sync::atomic::{AtomicBool, Ordering};
    let heard = std::sync::Arc::new(Mutex::new(Vec::new()));
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let (log, stopped) = (heard.clone(), stop.clone());
    std::thread::spawn(move || {
        let netns = std::fs::File::open(format!("/proc/{pid}/ns/net")).expect("netns");
        // SAFETY: moves this thread (only) into the sandbox's namespace.
        let entered = unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(entered, 0, "setns: {}", std::io::Error::last_os_error());
        let listener = std::net::TcpListener::bind((ip, 0)).expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        tx.send(listener.local_addr().expect("addr").port())
            .expect("send");
        while !stopped.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((mut conn, _)) => {
                    let _ = conn.set_nonblocking(false);
                    let _ = conn.set_read_timeout(Some(patience()));
                    let mut got = String::new();
                    let _ = conn.read_to_string(&mut got);
                    log.lock().expect("lock").push(got);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    });
    (rx.recv().expect("port"), heard, stop)
}

/// A server inside the egress test network: answers a plain HTTP GET with
/// a greeting, a TLS ClientHello with a note, anything else with `pong`
/// and what came. Returns its address and everything it received.
fn egress_server(
    ns: &EgressNet,
    ip: &'static str,
) -> (std::net::SocketAddr, std::sync::Arc<Mutex<Vec<Vec<u8>>>>) {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let seen = std::sync::Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let (path, log) = (ns.path(), seen.clone());
    std::thread::spawn(move || {
        let netns = std::fs::File::open(&path).expect("netns");
        // SAFETY: moves this thread (only) into the test's namespace.
        let entered = unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(entered, 0, "setns: {}", std::io::Error::last_os_error());
        let listener = std::net::TcpListener::bind((ip, 0)).expect("bind");
        tx.send(listener.local_addr().expect("addr")).expect("send");
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let _ = conn.set_read_timeout(Some(patience()));
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = conn.read(&mut buf) {
                got.extend_from_slice(&buf[..n]);
                let tls_done = got.first() == Some(&0x16)
                    && got.len() >= 5
                    && got.len() >= 5 + usize::from(u16::from_be_bytes([got[3], got[4]]));
                if got.windows(4).any(|w| w == b"\r\n\r\n") || got.ends_with(b"\n") || tls_done {
                    break;
                }
            }
            let reply = if got.starts_with(b"GET ") {
                let body = "hello from the allowed host\n";
                format!(
                    "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                )
            } else if got.first() == Some(&0x16) {
                "tls hello received\n".to_owned()
            } else {
                format!("pong {}", String::from_utf8_lossy(&got))
            };
            let _ = conn.write_all(reply.as_bytes());
            log.lock().expect("lock").push(got);
        }
    });
    (rx.recv().expect("server address"), seen)
}

/// The CA of the egress tests' TLS servers: the daemon trusts it for the
/// hosts whose TLS its proxy opens (`--egress-upstream-ca`), as it trusts
/// the public roots for real hosts.
struct UpstreamCa {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
    pem_file: PathBuf,
}

fn upstream_ca() -> &'static UpstreamCa {
    static CA: OnceLock<UpstreamCa> = OnceLock::new();
    CA.get_or_init(|| {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::default();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "husk test upstream CA");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).expect("CA");
        let pem_file = std::env::temp_dir().join(format!(
            "husk-daemon-test-{}.upstream-ca.pem",
            std::process::id()
        ));
        std::fs::write(&pem_file, cert.pem()).expect("CA file");
        UpstreamCa {
            cert,
            key,
            pem_file,
        }
    })
}

fn tls_provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}

/// An HTTPS server inside the egress test network, with a certificate for
/// its address from [`upstream_ca`]: answers each request (head and
/// `Content-Length` body) with a greeting. Returns its address and each
/// request as it read it, decrypted.
fn tls_server(
    ns: &EgressNet,
    ip: &'static str,
) -> (std::net::SocketAddr, std::sync::Arc<Mutex<Vec<String>>>) {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let ca = upstream_ca();
    let key = rcgen::KeyPair::generate().expect("key");
    let leaf = rcgen::CertificateParams::new(vec![ip.to_owned()])
        .expect("params")
        .signed_by(&key, &ca.cert, &ca.key)
        .expect("leaf");
    let cfg = std::sync::Arc::new(
        rustls::ServerConfig::builder_with_provider(tls_provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .expect("server config"),
    );
    let seen = std::sync::Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let (path, log) = (ns.path(), seen.clone());
    std::thread::spawn(move || {
        let netns = std::fs::File::open(&path).expect("netns");
        // SAFETY: moves this thread (only) into the test's namespace.
        let entered = unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(entered, 0, "setns: {}", std::io::Error::last_os_error());
        let listener = std::net::TcpListener::bind((ip, 0)).expect("bind");
        tx.send(listener.local_addr().expect("addr")).expect("send");
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let _ = conn.set_read_timeout(Some(patience()));
            let Ok(server) = rustls::ServerConnection::new(cfg.clone()) else {
                continue;
            };
            let mut tls = rustls::StreamOwned::new(server, conn);
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            let complete = |got: &[u8]| {
                let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
                    return false;
                };
                let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                let body: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                got.len() >= end + 4 + body
            };
            while !complete(&got) {
                match tls.read(&mut buf) {
                    Ok(n @ 1..) => got.extend_from_slice(&buf[..n]),
                    _ => break,
                }
            }
            if got.is_empty() {
                continue;
            }
            let body = "hello over tls\n";
            let reply = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = tls.write_all(reply.as_bytes());
            tls.conn.send_close_notify();
            let _ = tls.flush();
            log.lock()
                .expect("lock")
                .push(String::from_utf8_lossy(&got).into_owned());
        }
    });
    (rx.recv().expect("server address"), seen)
}

/// A byte pipe through a guest's egress path: `nc 127.0.0.1 3128` in the
/// guest, its stdin and stdout carried by the agent. What is written here
/// leaves the guest as a program's traffic does (its loopback, guest-init's
/// forwarder, vsock, the daemon's proxy); the guest has no TLS client of
/// its own, so the test speaks TLS over this pipe.
struct GuestPipe<'a> {
    running: husk_agent_client::Running<'a>,
    input: husk_agent_client::ProgramInput,
    pending: Vec<u8>,
}

impl<'a> GuestPipe<'a> {
    fn open(agent: &'a mut husk_agent_client::AgentClient) -> Self {
        let running = agent
            .start(husk_protocol::ExecRequest {
                argv: vec!["nc".into(), "127.0.0.1".into(), "3128".into()],
                stdin_open: true,
                timeout_ms: Some(patience().as_millis() as u64),
                ..Default::default()
            })
            .expect("nc in the guest");
        let input = running.input();
        GuestPipe {
            running,
            input,
            pending: Vec::new(),
        }
    }

    /// Reads the proxy's answer head to a CONNECT.
    fn answer_head(&mut self) -> String {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match self.read(&mut byte) {
                Ok(1) => head.push(byte[0]),
                _ => break,
            }
        }
        String::from_utf8_lossy(&head).into_owned()
    }
}

impl Read for GuestPipe<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use husk_agent_client::Event;
        while self.pending.is_empty() {
            match self.running.next_event().map_err(std::io::Error::other)? {
                Event::Output(husk_protocol::Stream::Stdout, data) => self.pending = data,
                Event::Output(..) | Event::Lost(_) => {}
                Event::Exited(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.pending.len());
        buf[..n].copy_from_slice(&self.pending[..n]);
        self.pending.drain(..n);
        Ok(n)
    }
}

impl std::io::Write for GuestPipe<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.input.write(buf).map_err(std::io::Error::other)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One HTTPS request from inside sandbox `vsock` (its agent's socket)
/// through its egress proxy: CONNECT to `to`, TLS trusting only `roots`
/// (PEM), then `request`. Returns the proxy's answer to the CONNECT and
/// the decrypted answer (or the TLS error).
fn https_from_guest(
    vsock: &Path,
    to: std::net::SocketAddr,
    roots: &str,
    request: &str,
) -> (String, Result<String, String>) {
    use rustls::pki_types::pem::PemObject;
    use std::io::Write;
    let mut agent = husk_agent_client::AgentClient::connect(vsock, patience()).expect("agent");
    let mut pipe = GuestPipe::open(&mut agent);
    pipe.write_all(format!("CONNECT {to} HTTP/1.1\r\nHost: {to}\r\n\r\n").as_bytes())
        .expect("CONNECT");
    let connected = pipe.answer_head();
    if !connected.starts_with("HTTP/1.1 200") {
        return (connected, Err("no tunnel".into()));
    }
    let mut store = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(roots.as_bytes()) {
        store.add(cert.expect("pem")).expect("root");
    }
    let cfg = rustls::ClientConfig::builder_with_provider(tls_provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(store)
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::from(to.ip());
    let client = rustls::ClientConnection::new(std::sync::Arc::new(cfg), name).expect("client");
    let mut tls = rustls::StreamOwned::new(client, pipe);
    let mut answer = Vec::new();
    let result = tls
        .write_all(request.as_bytes())
        .and_then(|()| tls.read_to_end(&mut answer));
    let answer = String::from_utf8_lossy(&answer).into_owned();
    match result {
        Ok(_) => (connected, Ok(answer)),
        // A server that closes without TLS's goodbye: what came is the answer.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !answer.is_empty() => {
            (connected, Ok(answer))
        }
        Err(e) => (connected, Err(format!("{e} (after {answer:?})"))),
    }
}

/// The first flight of a real TLS client (rustls) for `server`: its
/// ClientHello, which the proxy reads as a TLS server would.
fn client_hello(server: &str) -> Vec<u8> {
    let cfg = rustls::ClientConfig::builder_with_provider(tls_provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(server.to_owned()).expect("name");
    let mut client =
        rustls::ClientConnection::new(std::sync::Arc::new(cfg), name).expect("a TLS client");
    let mut hello = Vec::new();
    client.write_tls(&mut hello).expect("its ClientHello");
    hello
}

#[test]
fn egress_goes_only_through_the_proxy_and_only_where_allowed() {
    let (d, _g) = shared();
    let Some(ns) = egress_net() else {
        common::skip("the egress test network (a network namespace) needs root");
        return;
    };
    let (server, seen) = egress_server(ns, EGRESS_SERVER_IP);
    let port = server.port();
    let allowed = format!("{EGRESS_SERVER_IP}:{port}");
    // Private, metadata and loopback destinations are on the list, to show
    // that the address check refuses them whatever the list says.
    let s = create_with(json!({
        "template": "base",
        "egress": { "allow": [allowed, "good.test", "10.1.2.3", "169.254.169.254", "localhost"] },
    }))
    .expect("create with an allowlist")
    .sandbox;
    let id = s.id.as_str();
    assert_eq!(s.egress.allow.len(), 5);
    // Through the proxy with a plain `wget`: HTTP_PROXY is set for it.
    // Programs run straight, not through a shell: each guest process costs
    // seconds of emulated guest kernel here.
    let wget = |url: &str, extra: &[&str]| {
        let argv: Vec<&str> = ["wget", "-q", "-O", "-"]
            .iter()
            .chain(extra)
            .copied()
            .chain([url])
            .collect();
        exec(id, &argv).expect("wget")
    };
    let fetched = wget(&format!("http://{allowed}/hello"), &[]);
    let via_proxy = |request: &str| exec_stdin(id, &["nc", "127.0.0.1", "3128"], request).stdout;
    let tunnel = via_proxy(&format!("CONNECT {allowed} HTTP/1.1\r\n\r\nping\n"));
    let unlisted = via_proxy("GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n");
    let other_port = wget(&format!("http://{EGRESS_SERVER_IP}:{}/", port ^ 1), &[]);
    let private = via_proxy("GET http://10.1.2.3/ HTTP/1.1\r\n\r\n");
    let metadata = via_proxy("GET http://169.254.169.254/latest/meta-data/ HTTP/1.1\r\n\r\n");
    let loopback = via_proxy("CONNECT localhost:22 HTTP/1.1\r\n\r\n");
    // A tunnel is checked again on the TLS server name the guest sends.
    let tls = |server: &str| {
        let mut request = format!("CONNECT {allowed} HTTP/1.1\r\n\r\n").into_bytes();
        request.extend(client_hello(server));
        let file = format!("/tmp/{server}.request");
        upload(id, &file, &request).expect("upload");
        // `sh -c` execs its last command: one process.
        sh(id, &format!("nc 127.0.0.1 3128 < {file}")).stdout
    };
    let (evil, good) = (tls("evil.test"), tls("good.test"));
    // Around the proxy there is no way: the guest has no route.
    let direct = wget(&format!("http://{allowed}/hello"), &["-Y", "off"]);
    // With the proxy gone, nothing leaves either, and programs are told.
    let socket = d
        .state_dir
        .join("sandboxes")
        .join(id)
        .join(format!("vsock_{}", husk_protocol::EGRESS_VSOCK_PORT));
    let had_socket = socket.exists();
    std::fs::remove_file(&socket).ok();
    let down = via_proxy(&format!("GET http://{allowed}/hello HTTP/1.1\r\n\r\n"));
    let audit: Vec<AuditEntry> = api()
        .call("GET", &format!("/v1/audit?sandbox={id}"), None)
        .expect("audit");
    let bad = create_with(json!({ "template": "base", "egress": { "allow": ["bad host!"] } }));
    destroy(id);

    assert_eq!(
        fetched.stdout, "hello from the allowed host\n",
        "{fetched:?}"
    );
    assert!(
        tunnel.starts_with("HTTP/1.1 200 Connection established\r\n\r\n"),
        "{tunnel}"
    );
    assert!(tunnel.ends_with("pong ping\n"), "{tunnel}");
    let blocked = |out: &str, says: &str| {
        assert!(out.starts_with("HTTP/1.1 403 Forbidden\r\n"), "{out}");
        assert!(out.contains(says), "{out}");
    };
    blocked(
        &unlisted,
        "blocked by sandbox policy: example.com:80 is not in this sandbox's allowlist",
    );
    assert_ne!(other_port.code, Some(0), "{other_port:?}");
    assert!(other_port.stderr.contains("403"), "{other_port:?}");
    blocked(
        &private,
        "blocked by sandbox policy: 10.1.2.3 is a private address",
    );
    blocked(
        &metadata,
        "blocked by sandbox policy: 169.254.169.254 is the cloud metadata address",
    );
    blocked(
        &loopback,
        "blocked by sandbox policy: localhost resolves to",
    );
    assert!(loopback.contains("a loopback address"), "{loopback}");
    assert_eq!(evil, "HTTP/1.1 200 Connection established\r\n\r\n");
    assert!(good.ends_with("tls hello received\n"), "{good}");
    assert_ne!(direct.code, Some(0), "{direct:?}");
    assert!(had_socket, "no proxy socket at {}", socket.display());
    assert!(down.starts_with("HTTP/1.1 502 Bad Gateway\r\n"), "{down}");
    assert!(down.contains("egress proxy is not reachable"), "{down}");
    // The server saw the allowed requests and nothing else (the tunnel with
    // the refused server name was opened, then closed with nothing sent).
    let seen: Vec<String> = seen
        .lock()
        .expect("lock")
        .iter()
        .filter(|b| !b.is_empty())
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .collect();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(seen[0].starts_with("GET /hello HTTP/1.1\r\n"), "{seen:?}");
    assert!(
        seen[0].contains(&format!("Host: {allowed}\r\n")),
        "{seen:?}"
    );
    assert_eq!(seen[1], "ping\n");
    assert!(seen[2].as_bytes().starts_with(&[0x16, 3, 1]), "{seen:?}");
    // Every decision is in the audit log.
    let decisions: Vec<(&str, &str)> = audit
        .iter()
        .filter(|e| e.action.starts_with("egress-"))
        .map(|e| (e.action.as_str(), e.detail.as_str()))
        .collect();
    let count = |action: &str| decisions.iter().filter(|(a, _)| *a == action).count();
    assert_eq!(count("egress-allow"), 3, "{decisions:?}");
    assert_eq!(count("egress-deny"), 6, "{decisions:?}");
    assert!(
        decisions
            .iter()
            .any(|(a, d)| *a == "egress-deny" && d.contains("TLS server name evil.test")),
        "{decisions:?}"
    );
    let (code, message) = status(bad);
    assert_eq!(code, 400);
    assert!(message.contains("bad host!"), "{message}");
}

/// A named secret: a credential names it (`${husk.secrets.NAME}`), the
/// proxy puts its value into each request as it is then (an update shows
/// at the next request; a deleted one refuses the request), and no call,
/// audit entry or sandbox file shows it.
#[test]
fn a_named_secret_is_resolved_per_request_and_never_shown() {
    let (d, _g) = shared();
    let Some(ns) = egress_net() else {
        common::skip("the egress test network (a network namespace) needs root");
        return;
    };
    let (server, seen) = egress_server(ns, EGRESS_SERVER_IP);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |t| t.as_nanos());
    let (name, first, second, third) = (
        format!("tok-{nanos:x}"),
        format!("sk-first-{nanos:x}"),
        format!("sk-second-{nanos:x}"),
        format!("sk-third-{nanos:x}"),
    );
    // `husk secret`: its value on standard input, never an argument.
    let husk = |args: &[&str], stdin: &str| {
        let mut child = Command::new(common::husk_binary())
            .args(args)
            .env("HUSK_HOST", d.state_dir.join("husk.sock"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("husk");
        let mut input = child.stdin.take().expect("stdin");
        std::io::Write::write_all(&mut input, stdin.as_bytes()).expect("write the value");
        drop(input);
        let out = child.wait_with_output().expect("husk");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let made: husk_types::SecretInfo = api()
        .call(
            "POST",
            "/v1/secrets",
            Some(&json!({ "name": name, "value": first })),
        )
        .expect("create a secret");
    let s = create_with(json!({
        "template": "base",
        "egress": {
            "allow": [server.to_string()],
            "secrets": [{
                "host": server.to_string(),
                "header": "Authorization",
                "value": format!("Bearer ${{husk.secrets.{name}}}"),
            }],
        },
    }))
    .expect("create naming the secret")
    .sandbox;
    let id = s.id.as_str();
    let get = || sh(id, &format!("wget -q -O - http://{server}/x 2>&1"));
    let with_first = get();
    let updated: husk_types::SecretInfo = api()
        .call(
            "PUT",
            &format!("/v1/secrets/{name}"),
            Some(&json!({ "value": second, "metadata": { "team": "a" } })),
        )
        .expect("update the secret");
    let with_second = get();
    let cli_set = husk(&["secret", "set", &name], &format!("{third}\n"));
    let with_third = get();
    let cli_ls = husk(&["secret", "ls", "--json"], "");
    let listed = api()
        .call::<Value>("GET", "/v1/secrets", None)
        .expect("list")
        .to_string();
    let shown = api()
        .call::<Value>("GET", &format!("/v1/secrets/{}", made.id), None)
        .expect("get")
        .to_string();
    let cli_rm = husk(&["secret", "rm", &name], "");
    let without = get();
    let refusals: Vec<(u16, String)> = [
        json!({ "name": "a}b", "value": "x" }),
        json!({ "name": "fine", "value": "a\r\nX-Injected: 1" }),
        json!({ "value": "no name" }),
    ]
    .iter()
    .map(|body| status(api().call::<Value>("POST", "/v1/secrets", Some(body))))
    .collect();
    let twice = {
        let body = json!({ "name": format!("{name}-2"), "value": "x" });
        let _ = api().call::<Value>("POST", "/v1/secrets", Some(&body));
        let again = status(api().call::<Value>("POST", "/v1/secrets", Some(&body)));
        let _ = api().send("DELETE", &format!("/v1/secrets/{name}-2"), Payload::None);
        again
    };
    let gone = status(api().call::<Value>("GET", &format!("/v1/secrets/{name}"), None));
    let audit = api()
        .call::<Value>("GET", "/v1/audit?limit=10000", None)
        .expect("audit")
        .to_string();
    let holders = Command::new("grep")
        .args(["-rlaF", &first])
        .arg(d.state_dir.join("sandboxes").join(id))
        .output()
        .expect("grep");
    destroy(id);

    let seen: Vec<String> = seen
        .lock()
        .expect("lock")
        .iter()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .collect();
    assert_eq!((made.version, updated.version), (1, 2));
    assert_eq!(updated.metadata.get("team").map(String::as_str), Some("a"));
    assert_eq!(
        with_first.stdout, "hello from the allowed host\n",
        "{with_first:?}"
    );
    assert_eq!(
        with_second.stdout, "hello from the allowed host\n",
        "{with_second:?}"
    );
    assert!(cli_set.0 && cli_set.1.contains("version 3"), "{cli_set:?}");
    assert_eq!(
        with_third.stdout, "hello from the allowed host\n",
        "{with_third:?}"
    );
    assert!(cli_ls.0 && cli_ls.1.contains(&name), "{cli_ls:?}");
    assert!(cli_rm.0, "{cli_rm:?}");
    assert_eq!(
        seen.len(),
        3,
        "the deleted secret's request reached the host: {seen:?}"
    );
    assert!(
        seen[2].contains(&format!("\r\nAuthorization: Bearer {third}\r\n")),
        "{seen:?}"
    );
    assert!(
        seen[0].contains(&format!("\r\nAuthorization: Bearer {first}\r\n")),
        "{seen:?}"
    );
    assert!(
        seen[1].contains(&format!("\r\nAuthorization: Bearer {second}\r\n")),
        "{seen:?}"
    );
    assert_ne!(without.code, Some(0), "{without:?}");
    assert!(without.stdout.contains("502"), "{without:?}");
    assert!(
        audit.contains(&format!("names secret `{name}`, which does not exist")),
        "no refusal in the audit log"
    );
    for (what, text) in [
        ("list", &listed),
        ("get", &shown),
        ("audit", &audit),
        ("husk secret ls", &cli_ls.1),
        ("husk secret set", &cli_set.1),
    ] {
        assert!(
            [&first, &second, &third]
                .iter()
                .all(|v| !text.contains(v.as_str())),
            "{what} shows a value"
        );
    }
    assert!(shown.contains(&name), "{shown}");
    assert!(
        holders.stdout.is_empty(),
        "in the sandbox's files: {holders:?}"
    );
    for (got, says) in refusals.iter().zip(["placeholder", "one line", "`name`"]) {
        assert_eq!(got.0, 400, "{got:?}");
        assert!(got.1.contains(says), "{got:?} should say {says}");
    }
    assert_eq!(twice.0, 409, "{twice:?}");
    assert_eq!(gone.0, 404, "{gone:?}");
}

#[test]
fn credentials_are_added_by_the_proxy_and_never_reach_the_guest() {
    let (d, _g) = shared();
    let Some(ns) = egress_net() else {
        common::skip("the egress test network (a network namespace) needs root");
        return;
    };
    let (bound, bound_seen) = egress_server(ns, EGRESS_SERVER_IP);
    let (other, other_seen) = egress_server(ns, EGRESS_OTHER_IP);
    let (bound_tls, bound_tls_seen) = tls_server(ns, EGRESS_SERVER_IP);
    let (other_tls, other_tls_seen) = tls_server(ns, EGRESS_OTHER_IP);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |t| t.as_nanos());
    let secret = format!("sk-husk-test-{nanos:x}");
    let s = create_with(json!({
        "template": "base",
        "egress": {
            "allow": [bound.to_string(), other.to_string(), bound_tls.to_string(), other_tls.to_string()],
            "secrets": [
                { "host": bound.to_string(), "header": "Authorization", "value": format!("Bearer {secret}") },
                { "host": bound_tls.to_string(), "header": "Authorization", "value": format!("Bearer {secret}") },
            ],
        },
    }))
    .expect("create with a secret")
    .sandbox;
    let id = s.id.as_str();
    // The guest sends a placeholder of its own to both hosts.
    let get = |addr: std::net::SocketAddr| {
        sh(
            id,
            &format!("wget -q -O - --header 'Authorization: Bearer placeholder' http://{addr}/x"),
        )
    };
    let (to_bound, to_other) = (get(bound), get(other));
    // Inside TLS: the guest trusts the CA its template installed, and the
    // proxy is the TLS server for the host the secret is bound to.
    let guest_ca = download(id, "/etc/husk/egress-ca.pem").expect("the guest's copy of the CA");
    let mut daemon_ca = Vec::new();
    api()
        .send("GET", "/v1/egress/ca", Payload::None)
        .expect("the daemon's CA")
        .read_to_end(&mut daemon_ca)
        .expect("read");
    let guest_ca = String::from_utf8(guest_ca).expect("PEM");
    let post = |to: std::net::SocketAddr| {
        format!(
            "POST /tls HTTP/1.1\r\nHost: {to}\r\nAuthorization: Bearer placeholder\r\n\
             Content-Length: 11\r\n\r\npayload-123"
        )
    };
    let vsock = d.state_dir.join("sandboxes").join(id).join("vsock");
    let (tunnel, via_tls) = https_from_guest(&vsock, bound_tls, &guest_ca, &post(bound_tls));
    // To a host with no credential, the tunnel is the guest's own TLS, to
    // the server's own certificate.
    let server_ca = std::fs::read_to_string(&upstream_ca().pem_file).expect("CA");
    let (_, other_via_tls) = https_from_guest(&vsock, other_tls, &server_ca, &post(other_tls));
    // Inside the tunnel, a request for another host is refused.
    let (_, wrong_host) = https_from_guest(
        &vsock,
        bound_tls,
        &guest_ca,
        "GET / HTTP/1.1\r\nHost: evil.test\r\n\r\n",
    );
    let shown: Value = api()
        .call("GET", &format!("/v1/sandboxes/{id}"), None)
        .expect("get");
    let audit: Vec<AuditEntry> = api()
        .call("GET", &format!("/v1/audit?sandbox={id}"), None)
        .expect("audit");
    // Its memory and files, as a snapshot keeps them.
    let snap: TemplateRecord = api()
        .call(
            "POST",
            &format!("/v1/sandboxes/{id}/snapshot"),
            Some(&json!({ "name": "secret-check" })),
        )
        .expect("snapshot");
    let holders = |dir: &Path| {
        let out = Command::new("grep")
            .args(["-rlaF", &secret])
            .arg(dir)
            .output()
            .expect("grep");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let in_snapshot = holders(&snap.snapshot_dir);
    let in_run_dir = holders(&d.state_dir.join("sandboxes").join(id));
    let bad = create_with(json!({
        "template": "base",
        "egress": { "secrets": [{ "host": "x.test", "header": "Authorization", "value": "a\r\nX-Injected: 1" }] },
    }));
    destroy(id);
    let _ = api().call::<Value>("DELETE", "/v1/templates/secret-check", None);

    let text = |seen: &Mutex<Vec<Vec<u8>>>| {
        seen.lock()
            .expect("lock")
            .iter()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect::<Vec<_>>()
    };
    let (bound_seen, other_seen) = (text(&bound_seen), text(&other_seen));
    let bound_tls_seen = bound_tls_seen.lock().expect("lock").clone();
    let other_tls_seen = other_tls_seen.lock().expect("lock").clone();
    assert_eq!(
        guest_ca.as_bytes(),
        daemon_ca,
        "the guest trusts another CA"
    );
    assert!(tunnel.starts_with("HTTP/1.1 200 "), "{tunnel}");
    let via_tls = via_tls.expect("HTTPS through the proxy");
    assert!(via_tls.starts_with("HTTP/1.1 200 OK\r\n"), "{via_tls}");
    assert!(via_tls.ends_with("hello over tls\n"), "{via_tls}");
    assert_eq!(bound_tls_seen.len(), 1, "{bound_tls_seen:?}");
    assert!(
        bound_tls_seen[0].starts_with("POST /tls HTTP/1.1\r\n"),
        "{bound_tls_seen:?}"
    );
    assert!(
        bound_tls_seen[0].contains(&format!("\r\nAuthorization: Bearer {secret}\r\n")),
        "{bound_tls_seen:?}"
    );
    assert!(
        !bound_tls_seen[0].contains("placeholder"),
        "{bound_tls_seen:?}"
    );
    assert!(
        bound_tls_seen[0].ends_with("\r\n\r\npayload-123"),
        "{bound_tls_seen:?}"
    );
    let other_via_tls = other_via_tls.expect("HTTPS to the other host");
    assert!(
        other_via_tls.ends_with("hello over tls\n"),
        "{other_via_tls}"
    );
    assert_eq!(other_tls_seen.len(), 1, "{other_tls_seen:?}");
    assert!(
        other_tls_seen[0].contains("\r\nAuthorization: Bearer placeholder\r\n"),
        "{other_tls_seen:?}"
    );
    assert!(!other_tls_seen[0].contains(&secret), "{other_tls_seen:?}");
    let wrong_host = wrong_host.expect("an answer inside TLS");
    assert!(
        wrong_host.starts_with("HTTP/1.1 403 Forbidden\r\n"),
        "{wrong_host}"
    );
    assert!(
        wrong_host.contains("blocked by sandbox policy: a request for evil.test"),
        "{wrong_host}"
    );
    assert_eq!(
        to_bound.stdout, "hello from the allowed host\n",
        "{to_bound:?}"
    );
    assert_eq!(
        to_other.stdout, "hello from the allowed host\n",
        "{to_other:?}"
    );
    assert_eq!(bound_seen.len(), 1, "{bound_seen:?}");
    assert!(
        bound_seen[0].contains(&format!("\r\nAuthorization: Bearer {secret}\r\n")),
        "{bound_seen:?}"
    );
    assert!(!bound_seen[0].contains("placeholder"), "{bound_seen:?}");
    assert_eq!(other_seen.len(), 1, "{other_seen:?}");
    assert!(
        other_seen[0].contains("\r\nAuthorization: Bearer placeholder\r\n"),
        "{other_seen:?}"
    );
    assert!(!other_seen[0].contains(&secret), "{other_seen:?}");
    // The API, the audit log, the snapshot and the sandbox's files never
    // show it.
    assert_eq!(shown["egress"]["secrets"][0]["value"], "(redacted)");
    assert!(!shown.to_string().contains(&secret));
    assert!(audit.iter().all(|e| !e.detail.contains(&secret)));
    assert!(
        audit
            .iter()
            .any(|e| e.action == "egress-allow"
                && e.detail.contains("with the host's Authorization")),
        "{audit:?}"
    );
    assert!(
        audit
            .iter()
            .any(|e| e.action == "egress-allow" && e.detail.contains("TLS opened by the proxy")),
        "{audit:?}"
    );
    assert_eq!(in_snapshot, "", "the secret is in the snapshot");
    assert_eq!(in_run_dir, "", "the secret is in the sandbox's files");
    let (code, message) = status(bad);
    assert_eq!(code, 400);
    assert!(message.contains("one non-empty line"), "{message}");
}
