//! The containerd runtime, `containerd-shim-husk-v2`, driven as an operator
//! would: a private containerd (its own root, state and socket) and a husk
//! daemon, and `ctr run --runtime io.containerd.husk.v2 --rootfs DIR`.
//!
//! One guest boot for the whole file: the first task's root file system
//! becomes a template (booted and snapshotted); later tasks with the same
//! tree restore it, and the tasks that name it by annotation take warm
//! pool clones. Needs root and Debian's `containerd` (which brings `ctr`);
//! without them the tests say so and skip.

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use common::containerd::{processes_with, shim_socket, Containerd, NAMESPACE, RUNTIME};
use husk_agent_client::readiness::WaitBudget;

/// The private containerd and husk daemon, and what the first task built.
struct Env {
    containerd: Containerd,
    rootfs: PathBuf,
    /// The template the first task's root file system became.
    template: String,
    /// The first task's output and exit status.
    first: Output,
}

impl std::ops::Deref for Env {
    type Target = Containerd;
    fn deref(&self) -> &Containerd {
        &self.containerd
    }
}

/// The environment, or why the tests skip.
fn env() -> Result<&'static Env, String> {
    static ENV: OnceLock<Result<Env, String>> = OnceLock::new();
    ENV.get_or_init(|| match common::containerd::missing() {
        Some(why) => Err(why),
        None => Ok(start()),
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Skips a test (with the reason on stderr) where the environment is missing.
macro_rules! env_or_skip {
    () => {
        match env() {
            Ok(env) => env,
            Err(why) => {
                common::skip(&why);
                return;
            }
        }
    };
}

fn start() -> Env {
    common::initramfs(); // builds guest-init if it is not built
    let containerd = Containerd::start("test");
    let rootfs = common::containerd::busybox_rootfs(&containerd.dir.join("rootfs"), "test");
    // The boot path: a root file system no template has yet.
    let first = containerd.ctr(&[
        "run",
        "--rm",
        "--runtime",
        RUNTIME,
        "--rootfs",
        rootfs.to_str().expect("utf-8"),
        "first",
        "/bin/sh",
        "-c",
        "echo hello from a husk task; echo to stderr >&2; exit 3",
    ]);
    let template = containerd
        .templates()
        .into_iter()
        .find(|n| n.starts_with("oci-"))
        .unwrap_or_default();
    Env {
        containerd,
        rootfs,
        template,
        first,
    }
}

impl Env {
    /// The daemon's sandboxes carrying task `id`'s label.
    fn sandboxes_of(&self, id: &str) -> Vec<serde_json::Value> {
        let out = self.husk(&[
            "ps",
            "--json",
            "--label",
            &format!("io.containerd.task={NAMESPACE}/{id}"),
        ]);
        serde_json::from_slice(&out.stdout).expect("sandbox list")
    }

    /// The shim processes serving task `id` of this containerd.
    fn shims_of(&self, id: &str) -> Vec<i32> {
        let address = self.dir.join("containerd.sock").display().to_string();
        processes_with(&["containerd-shim-husk-v2", "-id", id, &address])
    }

    /// Asserts that task `id` left nothing: no sandbox (so no VMM, overlay
    /// or run directory: the daemon's destroy removes them), no shim
    /// process and no shim socket, no task in containerd.
    fn assert_nothing_left(&self, id: &str, vmm_pid: Option<i32>) {
        assert_eq!(
            self.sandboxes_of(id),
            Vec::<serde_json::Value>::new(),
            "sandboxes of {id}"
        );
        if let Some(pid) = vmm_pid {
            assert!(
                !std::path::Path::new(&format!("/proc/{pid}")).exists(),
                "VMM {pid} of {id} still runs"
            );
        }
        // The shim exits once containerd has deleted the task.
        let mut wait = WaitBudget::new(Duration::from_secs(60));
        while !self.shims_of(id).is_empty() && !wait.expired() {
            std::thread::sleep(Duration::from_millis(200));
        }
        assert_eq!(self.shims_of(id), Vec::<i32>::new(), "shim of {id}");
        assert!(
            !shim_socket(&self.dir, id).exists(),
            "the shim socket of {id}"
        );
        let tasks = text(&self.ctr(&["task", "ls", "-q"]).stdout);
        assert!(
            !tasks.lines().any(|l| l.trim() == id),
            "task {id} in {tasks}"
        );
    }

    /// The host pid containerd knows task `id` by (its VMM's).
    fn task_pid(&self, id: &str) -> Option<i32> {
        self.task_column(id, 1).and_then(|p| p.parse().ok())
    }

    fn task_status(&self, id: &str) -> String {
        self.task_column(id, 2).unwrap_or_default()
    }

    fn task_column(&self, id: &str, column: usize) -> Option<String> {
        let out = text(&self.ctr(&["task", "ls"]).stdout);
        out.lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|cols| cols.first() == Some(&id))
            .and_then(|cols| cols.get(column).map(|s| (*s).to_owned()))
    }

    /// `ctr run --runtime husk FLAGS --rootfs ROOTFS ID` (the command to
    /// follow).
    fn husk_run<'a>(&'a self, flags: &[&'a str], id: &'a str) -> Vec<&'a str> {
        let mut args = vec!["run", "--runtime", RUNTIME];
        args.extend(flags);
        args.extend(["--rootfs", self.rootfs.to_str().expect("utf-8"), id]);
        args
    }

    /// `ctr run` arguments for a task of the first task's template, by
    /// annotation (a pooled clone).
    fn pooled_run<'a>(&'a self, annotation: &'a str, id: &'a str) -> Vec<&'a str> {
        self.husk_run(&["--annotation", annotation], id)
    }

    /// Keeps `n` warm clones of the first task's template.
    fn pool(&self, n: u32) {
        assert!(
            !self.template.is_empty(),
            "the first task built no template"
        );
        self.containerd.pool(&self.template, n);
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Reads `child`'s stdout lines until one contains `what`.
fn read_until(lines: &mut impl Iterator<Item = std::io::Result<String>>, what: &str) -> String {
    let mut seen = String::new();
    for line in lines.by_ref() {
        let line = line.expect("output");
        seen.push_str(&line);
        seen.push('\n');
        if line.contains(what) {
            return seen;
        }
    }
    panic!("no `{what}` in the output: {seen}");
}

#[test]
fn a_task_boots_from_its_rootfs_and_its_output_and_exit_status_come_back() {
    let env = env_or_skip!();
    let out = &env.first;
    assert_eq!(out.status.code(), Some(3), "ctr run: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "hello from a husk task\n");
    assert!(
        text(&out.stderr).contains("to stderr"),
        "{}",
        text(&out.stderr)
    );
    // The root file system became one template, named by its content.
    assert!(
        env.template.starts_with("oci-") && env.template.ends_with("-128m-1c"),
        "{}",
        env.template
    );
    env.assert_nothing_left("first", None);

    // The same tree again: its template is restored, not booted anew.
    let mut args = env.husk_run(&["--rm"], "again");
    args.extend(["/bin/sh", "-c", "echo restored; exit 0"]);
    let again = env.ctr(&args);
    assert_eq!(again.status.code(), Some(0), "{}", text(&again.stderr));
    assert_eq!(text(&again.stdout), "restored\n");
    let templates = text(&env.husk(&["template", "ls"]).stdout);
    assert_eq!(templates.matches("oci-").count(), 1, "{templates}");
    env.assert_nothing_left("again", None);
}

#[test]
fn a_running_task_takes_execs_signals_pause_and_resume_and_leaves_nothing() {
    let env = env_or_skip!();
    env.pool(2);
    let annotation = format!("io.husk.template={}", env.template);
    let id = "worker";
    let mut args = env.pooled_run(&annotation, id);
    args.extend([
        "/bin/sh",
        "-c",
        "trap 'echo got TERM; exit 7' TERM; echo ready; while true; do sleep 1; done",
    ]);
    let mut run = env
        .ctr_command(&args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("ctr run");
    let mut lines = BufReader::new(run.stdout.take().expect("stdout")).lines();
    read_until(&mut lines, "ready");
    let vmm = env.task_pid(id).expect("the task's pid");
    assert_eq!(env.task_status(id), "RUNNING");
    // Its run directory: sockets, console, its drive's copy-on-write overlay.
    let sandbox = env.sandboxes_of(id).pop().expect("the task's sandbox");
    let run_dir = PathBuf::from(sandbox["agent_socket"].as_str().expect("agent socket"))
        .parent()
        .expect("run dir")
        .to_owned();
    assert!(run_dir.is_dir(), "{}", run_dir.display());

    // An extra process, with its own output and status.
    let exec = env.ctr(&[
        "task",
        "exec",
        "--exec-id",
        "e1",
        id,
        "/bin/sh",
        "-c",
        "echo from exec; exit 5",
    ]);
    assert_eq!(exec.status.code(), Some(5), "{}", text(&exec.stderr));
    assert_eq!(text(&exec.stdout), "from exec\n");

    // Paused: its vCPUs stop; resumed, it answers again.
    let paused = env.ctr(&["task", "pause", id]);
    assert!(paused.status.success(), "{}", text(&paused.stderr));
    assert_eq!(env.task_status(id), "PAUSED");
    let resumed = env.ctr(&["task", "resume", id]);
    assert!(resumed.status.success(), "{}", text(&resumed.stderr));
    assert_eq!(env.task_status(id), "RUNNING");
    let after = env.ctr(&["task", "exec", "--exec-id", "e2", id, "/bin/echo", "awake"]);
    assert_eq!(text(&after.stdout), "awake\n", "{}", text(&after.stderr));

    // Its processes and its metrics (the VMM's cgroup, the guest's memory).
    let ps = env.ctr(&["task", "ps", id]);
    assert!(
        text(&ps.stdout).contains(&vmm.to_string()),
        "{}",
        text(&ps.stdout)
    );
    let metrics = env.ctr(&["task", "metrics", "--format", "json", id]);
    assert!(metrics.status.success(), "{}", text(&metrics.stderr));
    let metrics: serde_json::Value = serde_json::from_slice(&metrics.stdout).expect("metrics");
    assert!(
        metrics["memory"]["usage"]["usage"].as_u64().unwrap_or(0) > 0,
        "{metrics}"
    );
    assert!(
        metrics["memory"]["rss"].as_u64().unwrap_or(0) > 0,
        "{metrics}"
    );

    // A signal the workload handles.
    let kill = env.ctr(&["task", "kill", "--signal", "SIGTERM", id]);
    assert!(kill.status.success(), "{}", text(&kill.stderr));
    read_until(&mut lines, "got TERM");
    let status = run.wait().expect("ctr run");
    assert_eq!(status.code(), Some(7));

    // `ctr run` deleted the task when it ended; the container is left.
    let rm = env.ctr(&["container", "rm", id]);
    assert!(rm.status.success(), "{}", text(&rm.stderr));
    env.assert_nothing_left(id, Some(vmm));
    assert!(!run_dir.exists(), "{} is left", run_dir.display());
}

#[test]
fn two_tasks_run_at_once_each_in_its_own_sandbox() {
    let env = env_or_skip!();
    env.pool(2);
    let annotation = format!("io.husk.template={}", env.template);
    let runs: Vec<(String, Child)> = ["twin-a", "twin-b"]
        .iter()
        .map(|id| {
            let mut args = env.pooled_run(&annotation, id);
            args.insert(1, "--rm");
            args.extend(["/bin/sh", "-c", "echo I am $(hostname)"]);
            let child = env
                .ctr_command(&args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("ctr run");
            ((*id).to_owned(), child)
        })
        .collect();
    let mut hostnames = Vec::new();
    for (id, child) in runs {
        let out = child.wait_with_output().expect("ctr run");
        assert!(out.status.success(), "{id}: {}", text(&out.stderr));
        let line = text(&out.stdout);
        assert!(line.starts_with("I am "), "{id}: {line}");
        hostnames.push(line);
        env.assert_nothing_left(&id, None);
    }
    assert_ne!(hostnames[0], hostnames[1], "two tasks, one sandbox?");
}

#[test]
fn a_task_can_run_on_a_terminal() {
    let env = env_or_skip!();
    env.pool(2);
    // `ctr run -t` needs a terminal of its own: `script` gives it one.
    let annotation = format!("io.husk.template={}", env.template);
    let mut args = env.pooled_run(&annotation, "tty");
    args.insert(1, "--rm");
    args.insert(1, "-t");
    args.extend(["/bin/sh", "-c", "tty; echo done"]);
    let quote = |a: &str| format!("'{}'", a.replace('\'', "'\\''"));
    let ctr = format!(
        "ctr --address {} --namespace {NAMESPACE} {}",
        quote(&env.dir.join("containerd.sock").display().to_string()),
        args.iter().map(|a| quote(a)).collect::<Vec<_>>().join(" ")
    );
    let out = std::process::Command::new("script")
        .args(["-q", "-e", "-c", &ctr, "/dev/null"])
        .stdin(Stdio::null())
        .output()
        .expect("script (util-linux)");
    let printed = text(&out.stdout);
    assert!(out.status.success(), "{printed} {}", text(&out.stderr));
    // The workload's stdio is a terminal in the guest, which turns its
    // newlines into CRLF (and `script`'s own terminal adds another CR).
    assert!(printed.contains("/dev/pts/"), "{printed}");
    assert!(printed.contains("done\r"), "{printed:?}");
    env.assert_nothing_left("tty", None);
}

#[test]
fn bad_bundles_fail_at_create_with_the_reason() {
    let env = env_or_skip!();
    assert_refused(
        env,
        &[],
        ("no-program", "/bin/no-such-program"),
        "has no executable `/bin/no-such-program`",
    );
    assert_refused(
        env,
        &["--annotation", "io.husk.template=no-such-template"],
        ("no-template", "/bin/true"),
        "no template `no-such-template`",
    );
}

/// Asserts that `ctr run` with `flags` of task `(id, program)` fails
/// saying `reason`, and leaves nothing.
fn assert_refused(env: &Env, flags: &[&str], (id, program): (&str, &str), reason: &str) {
    let mut flags = flags.to_vec();
    flags.push("--rm");
    let mut args = env.husk_run(&flags, id);
    args.push(program);
    let out = env.ctr(&args);
    assert!(!out.status.success(), "ctr {args:?} succeeded");
    assert!(text(&out.stderr).contains(reason), "{}", text(&out.stderr));
    env.assert_nothing_left(id, None);
    let _ = env.ctr(&["container", "rm", id]);
}

#[test]
fn a_shim_killed_during_create_leaves_no_sandbox() {
    let env = env_or_skip!();
    let id = "killed";
    // Not pooled: the restore takes long enough here to be caught.
    let mut args = env.husk_run(&["--rm"], id);
    args.extend(["/bin/sleep", "600"]);
    let mut run = env
        .ctr_command(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ctr run");
    // Killed as soon as it has asked the daemon for the sandbox (its log
    // line in containerd's log says so): the daemon then restores one for
    // a shim that is gone.
    let log = env.dir.join("containerd.log");
    let asked = format!("creating the task's sandbox task={id} ");
    let mut wait = WaitBudget::new(Duration::from_secs(300));
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains(&asked)
    {
        assert!(!wait.expired(), "the shim never asked for its sandbox");
        assert!(
            run.try_wait().expect("ctr").is_none(),
            "ctr run ended before the kill"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for pid in env.shims_of(id) {
        // SAFETY: kill(2) on a pid read from /proc.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let out = run.wait_with_output().expect("ctr run");
    assert!(!out.status.success(), "ctr run succeeded without its shim");
    // (A restore takes seconds here: a sandbox for it appears within 30 s.)
    // A sandbox the daemon finished for the dead shim is destroyed by the
    // shim's `delete` (containerd runs it) or, if it was labelled after
    // that, when its creation lease ends.
    let mut made = false;
    let mut wait = WaitBudget::new(Duration::from_secs(300));
    loop {
        let left = env.sandboxes_of(id);
        made |= !left.is_empty();
        if left.is_empty() && wait.elapsed() > Duration::from_secs(30) || wait.expired() {
            break;
        }
        std::thread::sleep(Duration::from_secs(2));
    }
    eprintln!(
        "ctr run without its shim: {}; a sandbox was {}made for it",
        text(&out.stderr).trim(),
        if made { "" } else { "not " }
    );
    let _ = env.ctr(&["task", "rm", "-f", id]);
    let _ = env.ctr(&["container", "rm", id]);
    env.assert_nothing_left(id, None);
}
