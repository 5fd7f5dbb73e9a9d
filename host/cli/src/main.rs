//! husk: the command line for husk sandboxes.
//!
//! With the daemon (`husk serve`, reached at `$HUSK_HOST` or the default
//! state directory's socket), sandboxes are named by id:
//!
//!     husk serve [--state-dir DIR] [--kernel K] [--initramfs I] [--tcp ADDR --token-file F]
//!     husk template build NAME [--dir DIR | --tar FILE | --image FILE] [--warmup CMD]... [--vcpus N] [--mem-mib N]
//!     husk template ls|inspect|rm|verify [NAME]
//!     husk pool set TEMPLATE SIZE | husk pool ls
//!     husk run TEMPLATE [--ttl-s N] [--label K=V]... [--rm] [-- CMD [ARGS]...]
//!     husk ps [--label K=V]... [--state S] [--json]
//!     husk exec|cp|pause|resume|logs|inspect|rm|fork SANDBOX ...
//!     husk snapshot SANDBOX TEMPLATE_NAME
//!     husk audit [--sandbox ID]
//!     husk bench [-n N] [--clones K] [--json FILE] [--svg FILE] [--no-qemu] [--no-pooled]
//!
//! Without it, one VM is driven through its own sockets (a target with a
//! `/` is a socket path):
//!
//!     husk exec <vm> [-i] [-t] [-d] [--timeout-ms N] [--cwd DIR] [--env K=V]...
//!                    [--user UID[:GID]] [--pids-max N] -- CMD [ARGS]...
//!     husk ps <vm>
//!     husk attach <vm> <pid>
//!     husk wait <vm> <pid>
//!     husk kill <vm> <pid> [--signal N]
//!     husk watch <vm> <dir> [--recursive]
//!     husk cp <vm>:<guest path> <host path>
//!     husk cp <host path> <vm>:<guest path>
//!     husk ping <vm> [--wait-s N]
//!     husk health <vm>
//!     husk pause|resume <api>
//!     husk snapshot <api> <dir> [--diff]
//!     husk restore <dir> [--clones N] [--run-dir DIR] [--name NAME] [--tap NAME{n}]
//!                  [--wait-s N] [--dirty-log] [--parallel N]
//!
//! `<api>` is the VM's control socket (husk-vmm --api-sock). `restore`
//! starts each clone as its own background husk-vmm (with its own vsock
//! CID, a new overlay per writable drive in the run directory, and with
//! `--tap` its own TAP and a random MAC), at most `--parallel` (the CPU
//! count) restoring at once, waits for each agent (the wait stretches with
//! the host's load, see `WaitBudget`), gives each its post-restore identity
//! (clock, hostname `NAME-i`, fresh randomness, MAC), and prints one line
//! per clone with its sockets and timings. A clone that exits or does not
//! answer is stopped and the files its start created are removed.
//!
//! `<vm>` is the VM's vsock socket (husk-vmm --vsock cid=N,path=<vm>).
//! `exec` streams the program's stdout and stderr to its own as they come
//! and exits with the program's exit code (128 + N when killed by signal
//! N), as `docker exec` does; `-i` forwards this process's stdin, `-t` runs
//! the program on a terminal (raw mode here, resized with this one), `-d`
//! starts it in the background and prints its pid for `attach`/`wait`.
//! husk's own failures exit like docker's: for `exec`, 127 program not
//! found and 126 not executable; 124 timed out; 125 anything else; the
//! agent's error kind is on stderr.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use husk_agent_client::readiness::WaitBudget;
use husk_agent_client::{AgentClient, ClientError, Event, ProgramInput};
use husk_protocol::{ErrorKind, ExecRequest, ExitReport, Stream, Termination, User, WindowSize};
use husk_types::ExecSpec;
use husk_vmm_api::{Reply, Request};
use sandboxes::Lifecycle;

mod bench;
mod mcp;
mod processes;
mod sandboxes;
mod serve;

/// Exit status for husk's own failures (as docker uses 125).
const HUSK_FAILED: u8 = 125;
/// How long a short request may take.
const READ_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, Parser)]
#[command(
    name = "husk",
    version,
    about = "Run commands and copy files in husk sandboxes"
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a program in the guest; stdout, stderr and the exit code mirror it.
    Exec {
        /// A sandbox id, or a VM's vsock socket (a path).
        vm: String,
        /// Forward this process's stdin to the program.
        #[arg(short, long)]
        interactive: bool,
        /// Run the program on a terminal.
        #[arg(short, long)]
        tty: bool,
        /// Start it in the background; print its pid.
        #[arg(short, long)]
        detach: bool,
        /// Kill the program and all it started after this many milliseconds.
        #[arg(long)]
        timeout_ms: Option<u64>,
        /// Working directory in the guest.
        #[arg(long)]
        cwd: Option<String>,
        /// Environment variable KEY=VALUE (repeatable).
        #[arg(long = "env", value_parser = parse_env)]
        env: Vec<(String, String)>,
        /// Run as UID[:GID] (default root).
        #[arg(long, value_parser = parse_user)]
        user: Option<User>,
        /// Most processes the program may have at once.
        #[arg(long)]
        pids_max: Option<u32>,
        /// Kill the program and all it started once it has written this many
        /// bytes of output (stdout and stderr together).
        #[arg(long)]
        output_max: Option<u64>,
        /// The program and its arguments.
        #[arg(last = true, required = true)]
        argv: Vec<String>,
    },
    /// List the daemon's sandboxes; with a sandbox id, its programs; with
    /// a VM socket, the programs its agent started that were not collected
    /// yet.
    Ps {
        vm: Option<String>,
        /// Only sandboxes with this label (repeatable).
        #[arg(long = "label", value_parser = parse_env)]
        labels: Vec<(String, String)>,
        /// Only sandboxes in this state (running, paused, failed).
        #[arg(long)]
        state: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Stream a background program's output until it ends; exit like it.
    Attach {
        /// A sandbox id, or a VM's vsock socket (a path).
        vm: String,
        pid: i32,
        /// With a sandbox id: the offset of its output to start from (0:
        /// all the guest kept; what is no longer kept is reported).
        #[arg(long, default_value_t = 0)]
        from: u64,
        /// With a sandbox id: stop (exit 0) once the program wrote this
        /// text: wait for a log line.
        #[arg(long)]
        until: Option<String>,
    },
    /// Wait for a background program to end; exit like it.
    Wait {
        /// A sandbox id, or a VM's vsock socket (a path).
        vm: String,
        pid: i32,
    },
    /// Send a signal to a program's process group (default SIGTERM).
    Kill {
        /// A sandbox id, or a VM's vsock socket (a path).
        vm: String,
        pid: i32,
        #[arg(long, short, default_value_t = libc::SIGTERM)]
        signal: i32,
    },
    /// Print changes under a guest directory until interrupted
    /// (`husk watch SANDBOX /dir` or `husk watch SANDBOX:/dir`).
    Watch {
        /// A sandbox id (or SANDBOX:/dir), or a VM's vsock socket (a path).
        vm: String,
        dir: Option<String>,
        #[arg(long, short)]
        recursive: bool,
    },
    /// Copy a file into or out of the guest: one side is <vm>:<guest path>.
    Cp { from: String, to: String },
    /// Check the guest agent answers; prints the guest's uptime.
    Ping {
        /// A sandbox id, or a VM's vsock socket (a path).
        vm: String,
        /// Wait up to this many seconds for the agent to come up (a booting
        /// or restoring guest) instead of failing at once.
        #[arg(long, default_value_t = 0)]
        wait_s: u64,
    },
    /// Print the guest's clock, memory, load and process count.
    Health {
        /// A sandbox id, or a VM's vsock socket (a path).
        vm: String,
    },
    /// Stop a sandbox's vCPUs (or a VM's, by its control socket).
    Pause { target: String },
    /// Let a paused sandbox (or VM) run again.
    Resume { target: String },
    /// Write a sandbox to disk and free its memory (its VMM exits); any
    /// use of it (exec, files, resume) wakes it.
    Hibernate { id: String },
    /// Bring a hibernated sandbox back.
    Wake { id: String },
    /// Kill everything started inside a sandbox (programs and what they
    /// left running, a fork bomb included); the sandbox stays usable.
    KillAll { id: String },
    /// Snapshot a sandbox into a new template named DEST; or write a
    /// snapshot of the VM whose control socket is TARGET to the directory
    /// DEST (a running VM is paused for it).
    Snapshot {
        target: String,
        dest: String,
        /// Only the pages written since the VM's last snapshot (or restore).
        #[arg(long)]
        diff: bool,
    },
    /// Run the daemon: templates, sandboxes, pools, the HTTP API.
    Serve(Box<serve::ServeArgs>),
    /// Create a sandbox from a template (a warm pool's clone when one is
    /// ready); with a command, run it there.
    Run {
        template: String,
        /// Seconds to live.
        #[arg(long)]
        ttl_s: Option<u64>,
        /// Pause it, not destroy it, when its time runs out.
        #[arg(long)]
        pause_on_expiry: bool,
        #[arg(long = "label", value_parser = parse_env)]
        labels: Vec<(String, String)>,
        /// Destroy the sandbox when the command ends.
        #[arg(long)]
        rm: bool,
        /// A host its programs may reach through the egress proxy
        /// (repeatable): api.example.com, *.example.com, 203.0.113.7:8080,
        /// *:443. Without any, nothing leaves the sandbox.
        #[arg(long = "allow")]
        allow: Vec<String>,
        /// Its ports answer at the front door only requests that carry its
        /// traffic token (header e2b-traffic-access-token; `husk inspect`
        /// shows it).
        #[arg(long)]
        private_ports: bool,
        /// After this many seconds without use (no request, no connection
        /// to its ports), hibernate it (or --on-idle destroy).
        #[arg(long)]
        idle_s: Option<u64>,
        /// What --idle-s does: hibernate (any use wakes it) or destroy.
        #[arg(long, value_enum, default_value = "hibernate", requires = "idle_s")]
        on_idle: IdleChoice,
        /// A host directory it sees live, `HOST_DIR:GUEST_DIR[:ro]`
        /// (repeatable): beneath a --mount-root of the daemon, in one of
        /// the template's --fs-slots; what the guest creates there is the
        /// directory owner's on the host.
        #[arg(long = "mount", value_parser = husk_types::MountSpec::parse)]
        mounts: Vec<husk_types::MountSpec>,
        /// A named volume it sees live, `VOLUME:GUEST_DIR[:ro]`
        /// (repeatable; `husk volume create`), in one of the template's
        /// --fs-slots after the --mount directories.
        #[arg(long = "volume", value_parser = husk_types::MountSpec::parse_volume)]
        volumes: Vec<husk_types::MountSpec>,
        /// With --mount: a path the guest must not see in the mounted
        /// host directories (`.env`, `*.pem`, `.git/hooks`; repeatable).
        #[arg(long = "hide", requires = "mounts")]
        hide: Vec<String>,
        #[arg(last = true)]
        argv: Vec<String>,
    },
    /// Where a TCP port inside a sandbox is published (the daemon's front
    /// door, `husk serve --expose`), and whether a program listens on it.
    Port {
        id: String,
        port: u16,
        /// Wait up to this many seconds for a program to listen on it.
        #[arg(long, default_value_t = 0)]
        wait_s: u64,
    },
    /// Show a sandbox as JSON.
    Inspect { id: String },
    /// Print a sandbox's console.
    Logs { id: String },
    /// Destroy sandboxes.
    Rm {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Fork a running sandbox into COUNT new ones (through a template).
    Fork {
        id: String,
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// Name of the template the fork makes.
        #[arg(long)]
        name: Option<String>,
    },
    /// Templates: build, list, inspect, remove, verify.
    #[command(subcommand)]
    Template(TemplateCommand),
    /// Warm pools: set a template's size, list.
    #[command(subcommand)]
    Pool(PoolCommand),
    /// Named secrets: values the egress proxy puts into sandboxes'
    /// requests where a credential names them (`${husk.secrets.NAME}`),
    /// never shown and never in a guest.
    #[command(subcommand)]
    Secret(SecretCommand),
    /// Named volumes: directories the daemon keeps, mounted by name
    /// (`husk run --volume NAME:GUEST_DIR`), which outlive sandboxes.
    #[command(subcommand)]
    Volume(VolumeCommand),
    /// The daemon's audit log.
    Audit {
        #[arg(long)]
        sandbox: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Benchmark cold boot, snapshot restore and pooled create of one guest,
    /// next to QEMU's microvm; per phase, as a table, JSON and SVG.
    Bench(bench::BenchArgs),
    /// Serve the Model Context Protocol on stdin/stdout: tools to create a
    /// sandbox, run commands, read, write and list files, and destroy it.
    /// The client's sandboxes are destroyed when it disconnects.
    Mcp {
        /// Sandboxes the client may hold at once.
        #[arg(long, default_value_t = 4)]
        max_sandboxes: usize,
        /// Tool calls the client may make.
        #[arg(long, default_value_t = 1000)]
        max_calls: u64,
        /// Longest a command may run, in seconds.
        #[arg(long, default_value_t = 300)]
        max_command_s: u64,
        /// Most bytes of output or file content one call returns.
        #[arg(long, default_value_t = 1 << 20)]
        max_output: u64,
    },
    /// Start clones of the snapshot in DIR, each its own husk-vmm.
    Restore {
        dir: PathBuf,
        #[arg(long, default_value_t = 1)]
        clones: u32,
        /// Where each clone's sockets, console and log go (default: DIR).
        #[arg(long)]
        run_dir: Option<PathBuf>,
        /// Clone names (and hostnames) are NAME-0, NAME-1, ...
        #[arg(long, default_value = "clone")]
        name: String,
        /// For a snapshot with a network device: each clone's TAP, `{n}`
        /// standing for its index (`--tap husk{n}`). Each clone also gets
        /// its own random MAC address.
        #[arg(long)]
        tap: Option<String>,
        /// Give up on a clone whose agent has not answered after this many
        /// seconds on a quiet host; the wait stretches with the host's load
        /// (up to 10x). A clone given up on is stopped and its files removed.
        #[arg(long, default_value_t = 120)]
        wait_s: u64,
        /// Track each clone's writes from the start (husk-vmm --dirty-log),
        /// so its first snapshot can be a diff.
        #[arg(long)]
        dirty_log: bool,
        /// Most clones restoring at once (default: the host's CPU count);
        /// a restoring guest needs CPU, and more at once only share it.
        #[arg(long)]
        parallel: Option<u32>,
    },
}

/// `husk run --on-idle`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum IdleChoice {
    Hibernate,
    Destroy,
}

#[derive(Debug, Subcommand)]
enum TemplateCommand {
    /// Boot a template once, warm it up and snapshot it.
    Build {
        name: String,
        /// Root file system from this directory (default: husk's own).
        #[arg(long, conflicts_with = "tar")]
        dir: Option<PathBuf>,
        /// Root file system from this tar archive (an exported container).
        #[arg(long, conflicts_with = "image")]
        tar: Option<PathBuf>,
        /// Root file system from this container image: a `docker save`
        /// archive, or an OCI image layout (a directory or a tar). Its env,
        /// working directory and user hold for every exec; `husk run`
        /// without a command runs its entrypoint and command.
        #[arg(long, conflicts_with = "dir")]
        image: Option<PathBuf>,
        /// Boot this guest kernel (an uncompressed vmlinux) instead of the
        /// daemon's.
        #[arg(long)]
        kernel: Option<PathBuf>,
        /// --dir, --tar, --image and --kernel name files on the daemon's host, in a
        /// directory it was started with (--template-source), instead of
        /// local files to upload.
        #[arg(long)]
        on_host: bool,
        /// A shell command to run before the snapshot (repeatable).
        #[arg(long)]
        warmup: Vec<String>,
        #[arg(long, default_value_t = 1)]
        vcpus: u8,
        #[arg(long, default_value_t = 128)]
        mem_mib: u32,
        /// Give its sandboxes a network device (each its own TAP and MAC).
        #[arg(long)]
        network: bool,
        /// Rate limit of each sandbox's drives: bytes=N[K|M|G],ops=N per second.
        #[arg(long)]
        block_limit: Option<String>,
        /// Rate limit of each sandbox's network device, each way.
        #[arg(long)]
        net_limit: Option<String>,
        /// Empty drives in its sandboxes, for container root file systems
        /// put in at run time (a pod's containers; at most 8).
        #[arg(long, default_value_t = 0)]
        drive_slots: u8,
        /// Empty shared-directory devices in its sandboxes, each of which
        /// takes a host directory when a sandbox is created (`husk run
        /// --mount`; at most 8).
        #[arg(long, default_value_t = 0)]
        fs_slots: u8,
        /// Offer the host's hardware virtualization (VMX/SVM) to its
        /// sandboxes, so they can run hypervisors of their own (off by
        /// default: it exposes the host's nested-virtualization code).
        #[arg(long)]
        nested_virt: bool,
    },
    Ls {
        #[arg(long)]
        json: bool,
    },
    Inspect {
        name: String,
    },
    /// Remove a template no sandbox or pool uses.
    Rm {
        name: String,
    },
    /// Check a template's files against their checksums.
    Verify {
        name: String,
    },
}

#[derive(Debug, Subcommand)]
enum VolumeCommand {
    /// Make an empty volume.
    Create { name: String },
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Delete volumes and their files (refused while mounted).
    Rm {
        #[arg(required = true)]
        names: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
enum SecretCommand {
    /// Make secret NAME, or give it a new value (its next version): the
    /// value is read from standard input (one line; never an argument,
    /// which other users' `ps` would show).
    Set { name: String },
    /// Every secret (names, versions, times; never a value).
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Delete secrets: requests whose credentials name them are refused.
    Rm {
        #[arg(required = true)]
        names: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
enum PoolCommand {
    /// Keep SIZE clones of TEMPLATE restored and parked (0: no pool).
    Set { template: String, size: u32 },
    Ls {
        #[arg(long)]
        json: bool,
    },
}

/// What `husk restore` starts.
#[derive(Debug)]
struct Clones {
    dir: PathBuf,
    count: u32,
    run_dir: PathBuf,
    name: String,
    tap: Option<String>,
    /// How long each clone's agent may take to answer on a quiet host.
    wait: Duration,
    dirty_log: bool,
    /// Most clones restoring (not yet ready) at once.
    parallel: u32,
}

/// Sends one control request; prints the reply (one JSON line); fails if
/// the VMM refused.
fn control(api: &std::path::Path, request: &Request) -> Result<u8, ClientError> {
    match husk_vmm_api::call(api, request, READ_TIMEOUT) {
        Ok(reply) => {
            print!("{}", husk_vmm_api::to_line(&reply));
            Ok(0)
        }
        Err(e @ husk_vmm_api::ControlError::Refused(_)) => {
            eprintln!("husk: {e}");
            Ok(HUSK_FAILED)
        }
        Err(e) => Err(std::io::Error::other(e.to_string()).into()),
    }
}

/// One clone being started. Its files are `<run_dir>/<name>.*`: vsock,
/// api, log, console, and the overlays husk-vmm makes.
struct Starting {
    name: String,
    run_dir: PathBuf,
    mac: Option<[u8; 6]>,
    child: std::process::Child,
    started: std::time::Instant,
    /// CLOCK_MONOTONIC just before the spawn.
    spawned_ns: u64,
}

/// A clone's name, and the clone ready or why it is not.
type CloneOutcome = (String, Result<(Starting, Ready), String>);

/// When a clone's agent first answered, and when it had its identity,
/// since its husk-vmm was spawned.
struct Ready {
    answered: Duration,
    ready: Duration,
}

/// Clone `name`'s file `<name>.<kind>` in `run_dir`.
fn clone_file(run_dir: &std::path::Path, name: &str, kind: &str) -> PathBuf {
    run_dir.join(format!("{name}.{kind}"))
}

impl Starting {
    fn file(&self, kind: &str) -> PathBuf {
        clone_file(&self.run_dir, &self.name, kind)
    }

    /// Waits for the clone's agent and gives it its identity.
    fn bring_up(&mut self, budget: Duration) -> Result<Ready, String> {
        let mut wait = WaitBudget::new(budget);
        let vsock = self.file("vsock");
        let child = &mut self.child;
        let mut alive = || match child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(ClientError::VmmGone(format!("husk-vmm exited ({status})"))),
            Err(e) => Err(e.into()),
        };
        let mut client =
            AgentClient::connect_patiently(&vsock, &mut wait, &mut alive, READ_TIMEOUT).map_err(
                |e| match e {
                    ClientError::VmmGone(_) => e.to_string(),
                    _ => format!(
                        "the agent did not answer in {:.0} s (a budget of {} s on a quiet host; \
                         host CPU share at the end {:.2}): {e}",
                        wait.elapsed().as_secs_f64(),
                        wait.budget().as_secs(),
                        wait.last_share()
                    ),
                },
            )?;
        let answered = self.started.elapsed();
        client
            .restored(&self.name, self.mac)
            .map_err(|e| format!("the post-restore step failed: {e}"))?;
        Ok(Ready {
            answered,
            ready: self.started.elapsed(),
        })
    }

    /// Stops a clone that failed and removes what its start created;
    /// returns the last lines of its log and console for the error.
    fn abandon(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let report =
            husk_core::vmm_process::last_words(&self.file("log"), &self.file("console"), 10);
        let prefix = format!("{}.", self.name);
        if let Ok(entries) = std::fs::read_dir(&self.run_dir) {
            for entry in entries.flatten() {
                if entry.file_name().to_string_lossy().starts_with(&prefix) {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        report
    }
}

/// From the spawn of the VMM at `api` (CLOCK_MONOTONIC `spawned_ns`) to
/// its first KVM_RUN, in ms (from its `status`), or `?`: the endpoint
/// `husk bench` calls "spawn to the guest running".
fn spawn_to_first_kvm_run_ms(api: &std::path::Path, spawned_ns: u64) -> String {
    match husk_vmm_api::call(api, &Request::Status, READ_TIMEOUT) {
        Ok(Reply::Status {
            phases_us,
            main_monotonic_ns,
            ..
        }) if main_monotonic_ns >= spawned_ns => phases_us.get("first_kvm_run").map_or_else(
            || "?".to_owned(),
            |us| {
                let ns = main_monotonic_ns - spawned_ns + us * 1000;
                format!("{:.2}", ns as f64 / 1e6)
            },
        ),
        _ => "?".to_owned(),
    }
}

/// Starts clone `i` of the snapshot as a background husk-vmm.
fn start_clone(spec: &Clones, vmm: &std::path::Path, i: u32) -> Result<Starting, ClientError> {
    use std::os::unix::process::CommandExt;
    let name = format!("{}-{i}", spec.name);
    let run_dir = &spec.run_dir;
    let file = |kind| clone_file(run_dir, &name, kind);
    let log = file("log");
    let mut cmd = std::process::Command::new(vmm);
    // husk-vmm makes `<name>.<drive>.overlay` here for each writable drive.
    cmd.arg("--overlay-dir").arg(run_dir);
    let mac = match &spec.tap {
        Some(tap) => {
            let mac = husk_core::vmm_process::random_mac()?;
            let tap = tap.replace("{n}", &i.to_string());
            cmd.arg("--net").arg(format!(
                "tap={tap},mac={}",
                husk_core::vmm_process::mac_text(&mac)
            ));
            Some(mac)
        }
        None => None,
    };
    if spec.dirty_log {
        cmd.arg("--dirty-log");
    }
    let (started, spawned_ns) = (std::time::Instant::now(), husk_bench::monotonic_ns());
    let child = cmd
        .arg("--restore")
        .arg(&spec.dir)
        .args(["--id", &name])
        .arg("--vsock")
        .arg(format!("cid={},path={}", 3 + i, file("vsock").display()))
        .arg("--api-sock")
        .arg(file("api"))
        .arg("--serial")
        .arg(file("console"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        // Its own process group: the clone outlives this command.
        .process_group(0)
        .spawn();
    match child {
        Ok(child) => Ok(Starting {
            name,
            run_dir: run_dir.clone(),
            mac,
            child,
            started,
            spawned_ns,
        }),
        Err(e) => {
            let _ = std::fs::remove_file(&log);
            Err(e.into())
        }
    }
}

/// Starts the clones, at most `parallel` restoring at once, and waits for
/// each with its own budget: a clone that fails or does not answer is
/// killed and its files removed; the others go on. Prints them in order.
fn restore(spec: &Clones) -> Result<u8, ClientError> {
    let vmm = std::env::var_os("HUSK_VMM").map_or_else(
        || std::env::current_exe().map(|e| e.with_file_name("husk-vmm")),
        |p| Ok(PathBuf::from(p)),
    )?;
    std::fs::create_dir_all(&spec.run_dir)?;
    // `parallel` workers take the clones in turn.
    let next = std::sync::atomic::AtomicU32::new(0);
    let mut results: Vec<(u32, CloneOutcome)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..spec.parallel.clamp(1, spec.count.max(1)))
            .map(|_| {
                let (next, vmm) = (&next, &vmm);
                scope.spawn(move || {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= spec.count {
                            return done;
                        }
                        done.push((i, bring_up_clone(spec, vmm, i)));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a clone's worker does not panic"))
            .collect()
    });
    results.sort_by_key(|(i, _)| *i);
    let mut failed = false;
    for (_, (name, result)) in results {
        match result {
            Ok((clone, ready)) => println!(
                "{name} pid={} vsock={} api={} spawn_to_first_kvm_run_ms={} agent_ms={:.1} ready_ms={:.1}",
                clone.child.id(),
                clone.file("vsock").display(),
                clone.file("api").display(),
                spawn_to_first_kvm_run_ms(&clone.file("api"), clone.spawned_ns),
                ready.answered.as_secs_f64() * 1000.0,
                ready.ready.as_secs_f64() * 1000.0
            ),
            Err(e) => {
                failed = true;
                eprintln!("husk: {name}: {e}");
            }
        }
    }
    Ok(if failed { HUSK_FAILED } else { 0 })
}

/// Starts clone `i` and brings it up; a clone that fails is stopped and
/// its files removed.
fn bring_up_clone(spec: &Clones, vmm: &std::path::Path, i: u32) -> CloneOutcome {
    let mut clone = match start_clone(spec, vmm, i) {
        Ok(clone) => clone,
        Err(e) => return (format!("{}-{i}", spec.name), Err(e.to_string())),
    };
    match clone.bring_up(spec.wait) {
        Ok(ready) => (clone.name.clone(), Ok((clone, ready))),
        Err(e) => {
            let name = clone.name.clone();
            let report = clone.abandon();
            (
                name,
                Err(format!("{e}; stopped it and removed its files\n{report}")),
            )
        }
    }
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("`{s}` is not KEY=VALUE"))
}

fn parse_user(s: &str) -> Result<User, String> {
    let (uid, gid) = s.split_once(':').unwrap_or((s, s));
    let num = |v: &str| {
        v.parse::<u32>()
            .map_err(|_| format!("`{s}` is not UID[:GID]"))
    };
    Ok(User {
        uid: num(uid)?,
        gid: num(gid)?,
    })
}

/// Splits `<vm socket>:<guest path>`; a plain host path has no `:`.
fn guest_side(arg: &str) -> Option<(PathBuf, &str)> {
    let (vm, path) = arg.split_once(':')?;
    path.starts_with('/').then(|| (PathBuf::from(vm), path))
}

fn print_health(h: &husk_protocol::Health) {
    let load = h
        .load_milli
        .map(|l| format!("{}.{:02}", l / 1000, l % 1000 / 10));
    println!(
        "uptime_ms={} unix_ns={} mem_total_kib={} mem_available_kib={} load={} procs={}",
        h.uptime_ms,
        h.unix_ns,
        h.mem_total_kib,
        h.mem_available_kib,
        load.join(","),
        h.procs
    );
}

fn exit_code(report: &ExitReport) -> u8 {
    match report.termination {
        Termination::Code(code) => code as u8,
        Termination::Signal(sig) => 128u8.wrapping_add(sig as u8),
    }
}

/// [`write_out`] for output as the daemon's API sends it (base64).
fn write_base64(stream: Stream, data: &str) {
    use base64::Engine;
    write_out(
        stream,
        &base64::engine::general_purpose::STANDARD
            .decode(data)
            .unwrap_or_default(),
    );
}

fn write_out(stream: Stream, data: &[u8]) {
    // A closed stdout (husk exec ... | head) is not husk's failure.
    let _ = match stream {
        Stream::Stdout => {
            let mut out = std::io::stdout().lock();
            out.write_all(data).and_then(|()| out.flush())
        }
        Stream::Stderr => std::io::stderr().write_all(data),
    };
}

/// The host terminal's size, if stdin is one.
fn terminal_size() -> Option<WindowSize> {
    // SAFETY: winsize is plain data.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ fills a winsize.
    let ok = unsafe { libc::ioctl(0, libc::TIOCGWINSZ, &mut ws) } == 0;
    (ok && ws.ws_row > 0).then_some(WindowSize {
        rows: ws.ws_row,
        cols: ws.ws_col,
    })
}

/// Puts the host terminal in raw mode until dropped.
struct RawMode(Option<libc::termios>);

impl RawMode {
    fn enable() -> Self {
        // SAFETY: termios is plain data; tcgetattr fills it.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: valid termios pointer; fd 0 may not be a terminal (then -1).
        if unsafe { libc::tcgetattr(0, &mut saved) } != 0 {
            return RawMode(None);
        }
        let mut raw = saved;
        // SAFETY: `raw` is a valid termios.
        unsafe {
            libc::cfmakeraw(&mut raw);
            libc::tcsetattr(0, libc::TCSANOW, &raw);
        }
        RawMode(Some(saved))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if let Some(saved) = &self.0 {
            // SAFETY: restores the attributes read in `enable`.
            unsafe { libc::tcsetattr(0, libc::TCSANOW, saved) };
        }
    }
}

/// Forwards this process's stdin to the program, then closes its input.
fn forward_stdin(input: ProgramInput) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 32 << 10];
        let mut stdin = std::io::stdin().lock();
        while let Ok(n @ 1..) = stdin.read(&mut buf) {
            if input.write(&buf[..n]).is_err() {
                return;
            }
        }
        let _ = input.close();
    });
}

/// Resizes the program's terminal when this one is resized (SIGWINCH is
/// blocked in every thread and taken here with sigwait).
fn forward_resizes(input: ProgramInput) {
    std::thread::spawn(move || {
        while next_sigwinch() {
            if let Some(size) = terminal_size() {
                if input.resize(size.rows, size.cols).is_err() {
                    return;
                }
            }
        }
    });
}

/// Waits for this terminal's next resize (SIGWINCH, blocked in every
/// thread by [`block_sigwinch`]); false if it cannot.
fn next_sigwinch() -> bool {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is valid.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGWINCH);
    }
    let mut sig = 0;
    // SAFETY: valid set and output pointer.
    unsafe { libc::sigwait(&set, &mut sig) == 0 }
}

fn block_sigwinch() {
    // SAFETY: as in forward_resizes; blocks SIGWINCH for this thread and
    // the threads it starts.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGWINCH);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// The commands that go through the daemon, or None for the others.
fn through_daemon(command: &Command) -> bool {
    match command {
        Command::Exec { vm, .. } => sandboxes::is_sandbox_id(vm),
        Command::Ps { vm, .. } => vm.as_deref().is_none_or(sandboxes::is_sandbox_id),
        Command::Attach { vm, .. }
        | Command::Wait { vm, .. }
        | Command::Kill { vm, .. }
        | Command::Ping { vm, .. }
        | Command::Health { vm } => sandboxes::is_sandbox_id(vm),
        // SANDBOX:/dir names the sandbox before its colon.
        Command::Watch { vm, .. } => {
            sandboxes::is_sandbox_id(vm.split_once(':').map_or(vm.as_str(), |(id, _)| id))
        }
        Command::Pause { target } | Command::Resume { target } => sandboxes::is_sandbox_id(target),
        Command::Hibernate { .. } | Command::Wake { .. } => true,
        Command::Snapshot { target, .. } => sandboxes::is_sandbox_id(target),
        Command::Cp { from, to } => [from, to].iter().any(|side| {
            side.split_once(':')
                .is_some_and(|(t, p)| p.starts_with('/') && sandboxes::is_sandbox_id(t))
        }),
        Command::Run { .. }
        | Command::Inspect { .. }
        | Command::Logs { .. }
        | Command::Rm { .. }
        | Command::Fork { .. }
        | Command::KillAll { .. }
        | Command::Port { .. }
        | Command::Template(_)
        | Command::Pool(_)
        | Command::Secret(_)
        | Command::Volume(_)
        | Command::Audit { .. } => true,
        _ => false,
    }
}

/// A daemon command; its errors are the daemon's messages.
fn run_daemon(command: Command) -> sandboxes::CliResult {
    match command {
        Command::Exec {
            vm,
            interactive,
            tty,
            detach,
            timeout_ms,
            cwd,
            env,
            user,
            pids_max,
            output_max,
            argv,
        } => {
            if tty || detach {
                let spec = husk_types::ProcessSpec {
                    argv,
                    env: env.into_iter().collect(),
                    cwd,
                    user,
                    timeout_ms,
                    pids_max,
                    output_max,
                    ..Default::default()
                };
                return if detach {
                    processes::detach(&vm, &spec)
                } else {
                    processes::terminal(&vm, spec, interactive)
                };
            }
            let mut stdin = String::new();
            if interactive {
                std::io::stdin().read_to_string(&mut stdin)?;
            }
            sandboxes::exec(
                &vm,
                &ExecSpec {
                    argv,
                    env: env.into_iter().collect(),
                    cwd,
                    user,
                    stdin,
                    timeout_ms,
                    pids_max,
                    output_max,
                },
            )
        }
        Command::Ps {
            vm: Some(id), json, ..
        } => processes::ps(&id, json),
        Command::Ps {
            labels,
            state,
            json,
            ..
        } => sandboxes::ps(&labels, state.as_deref(), json),
        Command::Attach {
            vm,
            pid,
            from,
            until,
        } => processes::attach(&vm, pid, from, until.as_deref()),
        Command::Wait { vm, pid } => processes::wait(&vm, pid),
        Command::Kill { vm, pid, signal } => processes::kill(&vm, pid, signal),
        Command::Ping { vm, wait_s } => processes::ping(&vm, wait_s),
        Command::Health { vm } => {
            print_health(&sandboxes::client().guest_health(&vm)?);
            Ok(0)
        }
        Command::Watch { vm, dir, recursive } => {
            let (id, dir) = match (vm.split_once(':'), dir) {
                (_, Some(dir)) => (vm.as_str(), dir),
                (Some((id, dir)), None) => (id, dir.to_owned()),
                (None, None) => {
                    eprintln!("husk watch: name the directory: husk watch SANDBOX /dir");
                    return Ok(HUSK_FAILED);
                }
            };
            processes::watch(id, &dir, recursive)
        }
        Command::Pause { target } => sandboxes::lifecycle(&target, Lifecycle::Pause),
        Command::Resume { target } => sandboxes::lifecycle(&target, Lifecycle::Resume),
        Command::Hibernate { id } => sandboxes::lifecycle(&id, Lifecycle::Hibernate),
        Command::Port { id, port, wait_s } => sandboxes::port(&id, port, wait_s),
        Command::Wake { id } => sandboxes::lifecycle(&id, Lifecycle::Wake),
        Command::KillAll { id } => sandboxes::kill_all(&id),
        Command::Snapshot { target, dest, .. } => sandboxes::snapshot(&target, &dest),
        Command::Cp { from, to } => match (from.split_once(':'), to.split_once(':')) {
            (Some((id, path)), None) if path.starts_with('/') => sandboxes::cp_from(id, path, &to),
            (None, Some((id, path))) if path.starts_with('/') => sandboxes::cp_to(&from, id, path),
            _ => {
                eprintln!("husk cp: exactly one side must be <sandbox>:<absolute guest path>");
                Ok(HUSK_FAILED)
            }
        },
        Command::Run {
            template,
            ttl_s,
            pause_on_expiry,
            labels,
            rm,
            allow,
            private_ports,
            idle_s,
            on_idle,
            mounts,
            volumes,
            hide,
            argv,
        } => {
            let on_idle = idle_s.map(|after_s| husk_types::IdlePolicy {
                after_s,
                action: match on_idle {
                    IdleChoice::Hibernate => husk_types::IdleAction::Hibernate,
                    IdleChoice::Destroy => husk_types::IdleAction::Destroy,
                },
            });
            let mounts = mounts
                .into_iter()
                .map(|m| husk_types::MountSpec {
                    // The daemon resolves paths in its own directory.
                    host: std::path::absolute(&m.host).map_or(m.host, |p| p.display().to_string()),
                    hide: hide.clone(),
                    ..m
                })
                .chain(volumes)
                .collect();
            let created = sandboxes::create(
                &template,
                sandboxes::RunArgs {
                    ttl_s,
                    labels,
                    pause_on_expiry,
                    allow,
                    private_ports,
                    on_idle,
                    mounts,
                },
            )?;
            let id = created.sandbox.id;
            eprintln!(
                "{id}: created in {:.1} ms ({})",
                created.create_ms,
                if created.pooled {
                    "from the warm pool"
                } else {
                    "restored"
                }
            );
            // Without a command: the image's entrypoint and command, if
            // the template came from an image that has them.
            let argv = match argv.is_empty() {
                true => sandboxes::image_command(&created.sandbox.template)?,
                false => argv,
            };
            if argv.is_empty() {
                println!("{id}");
                return Ok(0);
            }
            let code = sandboxes::exec(
                &id,
                &ExecSpec {
                    argv,
                    ..ExecSpec::default()
                },
            );
            // Quietly: stdout is the command's alone.
            if rm {
                if let Err(e) = sandboxes::destroy(&id) {
                    eprintln!("husk: {id} was not removed: {e}");
                }
            }
            code
        }
        Command::Inspect { id } => sandboxes::inspect(&id),
        Command::Logs { id } => sandboxes::logs(&id),
        Command::Rm { ids } => sandboxes::rm(&ids),
        Command::Fork { id, count, name } => sandboxes::fork(&id, count, name.as_deref()),
        Command::Template(TemplateCommand::Build {
            name,
            dir,
            tar,
            image,
            kernel,
            on_host,
            warmup,
            vcpus,
            mem_mib,
            network,
            block_limit,
            net_limit,
            drive_slots,
            fs_slots,
            nested_virt,
        }) => sandboxes::template_build(sandboxes::BuildArgs {
            fs_slots,
            nested_virt,
            image,
            network,
            block_limit,
            net_limit,
            drive_slots,
            name,
            vcpus,
            mem_mib,
            dir,
            tar,
            kernel,
            on_host,
            warmup,
        }),
        Command::Template(TemplateCommand::Ls { json }) => sandboxes::template_ls(json),
        Command::Template(TemplateCommand::Inspect { name }) => sandboxes::template_inspect(&name),
        Command::Template(TemplateCommand::Rm { name }) => sandboxes::template_rm(&name),
        Command::Template(TemplateCommand::Verify { name }) => sandboxes::template_verify(&name),
        Command::Pool(PoolCommand::Set { template, size }) => sandboxes::pool_set(&template, size),
        Command::Pool(PoolCommand::Ls { json }) => sandboxes::pool_ls(json),
        Command::Secret(SecretCommand::Set { name }) => sandboxes::secret_set(&name),
        Command::Secret(SecretCommand::Ls { json }) => sandboxes::secret_ls(json),
        Command::Secret(SecretCommand::Rm { names }) => sandboxes::secret_rm(&names),
        Command::Volume(VolumeCommand::Create { name }) => sandboxes::volume_create(&name),
        Command::Volume(VolumeCommand::Ls { json }) => sandboxes::volume_ls(json),
        Command::Volume(VolumeCommand::Rm { names }) => sandboxes::volume_rm(&names),
        Command::Audit { sandbox, json } => sandboxes::audit(sandbox.as_deref(), json),
        _ => unreachable!("through_daemon() chose this command"),
    }
}

fn run(command: Command) -> Result<u8, ClientError> {
    match command {
        Command::Ping { vm, wait_s } => {
            let vm = PathBuf::from(vm);
            let mut client = if wait_s == 0 {
                AgentClient::connect(&vm, READ_TIMEOUT)?
            } else {
                AgentClient::connect_when_ready(&vm, Duration::from_secs(wait_s), READ_TIMEOUT)?
            };
            let uptime = client.ping()?;
            println!("guest uptime {uptime} ms");
            Ok(0)
        }
        Command::Health { vm } => {
            print_health(&AgentClient::connect(vm.as_ref(), READ_TIMEOUT)?.health()?);
            Ok(0)
        }
        Command::Exec {
            vm,
            interactive,
            tty,
            detach,
            timeout_ms,
            cwd,
            env,
            user,
            pids_max,
            output_max,
            argv,
        } => {
            if tty {
                block_sigwinch();
            }
            let vm = PathBuf::from(vm);
            let mut client = AgentClient::connect(&vm, READ_TIMEOUT)?;
            let req = ExecRequest {
                argv,
                env,
                cwd,
                user,
                stdin_open: interactive,
                pty: tty.then(|| terminal_size().unwrap_or(WindowSize { rows: 24, cols: 80 })),
                timeout_ms,
                pids_max,
                output_max,
                ..ExecRequest::default()
            };
            if detach {
                println!("{}", client.spawn(req)?);
                return Ok(0);
            }
            client.set_read_timeout(None)?;
            let _raw = tty.then(RawMode::enable);
            let mut running = client.start(req)?;
            if interactive {
                forward_stdin(running.input());
            }
            if tty {
                forward_resizes(running.input());
            }
            loop {
                match running.next_event()? {
                    Event::Output(stream, data) => write_out(stream, &data),
                    Event::Lost(_) => {}
                    Event::Exited(report) => return Ok(exit_code(&report)),
                }
            }
        }
        Command::Ps { vm: Some(vm), .. } => {
            let list = AgentClient::connect(vm.as_ref(), READ_TIMEOUT)?.processes()?;
            println!(
                "{:>7}  {:<10}  {:>9}  {:>9}  COMMAND",
                "PID", "STATE", "BUFFERED", "LOST"
            );
            for p in list {
                let state = match (p.exit, p.background) {
                    (None, true) => "running".to_owned(),
                    (None, false) => "running-fg".to_owned(),
                    (Some(Termination::Code(c)), _) => format!("exit {c}"),
                    (Some(Termination::Signal(s)), _) => format!("signal {s}"),
                };
                println!(
                    "{:>7}  {:<10}  {:>9}  {:>9}  {}",
                    p.pid,
                    state,
                    p.buffered,
                    p.lost,
                    p.argv.join(" ")
                );
            }
            Ok(0)
        }
        Command::Attach { vm, pid, .. } => {
            let mut client = AgentClient::connect(vm.as_ref(), READ_TIMEOUT)?;
            client.set_read_timeout(None)?;
            let report = client.attach_streaming(pid, |event| match event {
                Event::Output(stream, data) => write_out(*stream, data),
                Event::Lost(bytes) => eprintln!("husk: {bytes} bytes of output were lost"),
                Event::Exited(_) => {}
            })?;
            Ok(exit_code(&report))
        }
        Command::Wait { vm, pid } => {
            let mut client = AgentClient::connect(vm.as_ref(), READ_TIMEOUT)?;
            client.set_read_timeout(None)?;
            Ok(exit_code(&client.wait(pid)?))
        }
        Command::Kill { vm, pid, signal } => {
            AgentClient::connect(vm.as_ref(), READ_TIMEOUT)?.signal(pid, signal)?;
            Ok(0)
        }
        Command::Watch { vm, dir, recursive } => {
            let Some(dir) = dir else {
                eprintln!("husk watch: name the directory: husk watch <vm.sock> /dir");
                return Ok(HUSK_FAILED);
            };
            let mut client = AgentClient::connect(vm.as_ref(), READ_TIMEOUT)?;
            client.set_read_timeout(None)?;
            let mut watch = client.watch(&dir, recursive)?;
            loop {
                for e in watch.next_events()? {
                    let slash = if e.is_dir { "/" } else { "" };
                    println!("{:?} {}{slash}", e.kind, e.path);
                }
            }
        }
        Command::Pause { target } => control(target.as_ref(), &Request::Pause),
        Command::Resume { target } => control(target.as_ref(), &Request::Resume),
        Command::Snapshot { target, dest, diff } => {
            let dir = std::path::absolute(&dest)?;
            control(
                target.as_ref(),
                &Request::Snapshot {
                    dir,
                    diff,
                    keep_base: false,
                },
            )
        }
        Command::Restore {
            dir,
            clones,
            run_dir,
            name,
            tap,
            wait_s,
            dirty_log,
            parallel,
        } => {
            let run_dir = run_dir.unwrap_or_else(|| dir.clone());
            restore(&Clones {
                dir,
                count: clones,
                run_dir,
                name,
                tap,
                wait: Duration::from_secs(wait_s),
                dirty_log,
                parallel: parallel.unwrap_or_else(|| {
                    std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
                }),
            })
        }
        Command::Cp { from, to } => match (guest_side(&from), guest_side(&to)) {
            (Some((vm, path)), None) => {
                let file = std::fs::File::create(&to)?;
                AgentClient::connect(&vm, READ_TIMEOUT)?
                    .read_file(path, std::io::BufWriter::new(file))?;
                Ok(0)
            }
            (None, Some((vm, path))) => {
                let file = std::fs::File::open(&from)?;
                let mode = {
                    use std::os::unix::fs::PermissionsExt;
                    file.metadata()?.permissions().mode() & 0o7777
                };
                AgentClient::connect(&vm, READ_TIMEOUT)?.write_file(
                    path,
                    mode,
                    std::io::BufReader::new(file),
                )?;
                Ok(0)
            }
            _ => {
                eprintln!("husk cp: exactly one side must be <vm socket>:<absolute guest path>");
                Ok(HUSK_FAILED)
            }
        },
        _ => unreachable!("through_daemon() took this command"),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Command::Serve(serve_args) = args.command {
        return match serve::serve(*serve_args) {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                eprintln!("husk serve: {e}");
                ExitCode::from(HUSK_FAILED)
            }
        };
    }
    if let Command::Bench(bench_args) = args.command {
        return match bench::bench(bench_args) {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                eprintln!("husk bench: {e}");
                ExitCode::from(HUSK_FAILED)
            }
        };
    }
    if let Command::Mcp {
        max_sandboxes,
        max_calls,
        max_command_s,
        max_output,
    } = args.command
    {
        let limits = husk_server::mcp::Limits {
            sandboxes: max_sandboxes,
            calls: max_calls,
            command_s: max_command_s,
            output: max_output,
        };
        let backend = std::sync::Arc::new(mcp::Remote(sandboxes::client()));
        let served = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .and_then(|rt| rt.block_on(husk_server::mcp::serve_stdio(backend, limits)));
        return match served {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("husk mcp: {e}");
                ExitCode::from(HUSK_FAILED)
            }
        };
    }
    let exec = matches!(args.command, Command::Exec { .. });
    if through_daemon(&args.command) {
        return match run_daemon(args.command) {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                eprintln!("husk: {e}");
                ExitCode::from(match &e {
                    // The program was not found (404 from the agent) or
                    // may not run (403), as docker exec exits.
                    husk_client::ApiClientError::Status {
                        status: 404,
                        message,
                    } if exec && message.contains("agent") => 127,
                    husk_client::ApiClientError::Status { status: 403, .. } if exec => 126,
                    husk_client::ApiClientError::Status { status: 504, .. } => 124,
                    _ => HUSK_FAILED,
                })
            }
        };
    }
    match run(args.command) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("husk: {e}");
            ExitCode::from(match e.kind() {
                Some(ErrorKind::NotFound) if exec => 127,
                Some(ErrorKind::PermissionDenied) if exec => 126,
                Some(ErrorKind::Timeout) => 124,
                _ => HUSK_FAILED,
            })
        }
    }
}
