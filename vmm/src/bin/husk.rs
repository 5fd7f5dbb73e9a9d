//! husk: the command line for running sandboxes' guests.
//!
//!     husk exec <vm> [--timeout-ms N] [--cwd DIR] [--env K=V]... -- CMD [ARGS]...
//!     husk cp <vm>:<guest path> <host path>
//!     husk cp <host path> <vm>:<guest path>
//!     husk ping <vm>
//!
//! `<vm>` is the VM's vsock socket (husk-vmm --vsock cid=N,path=<vm>). `exec`
//! prints the program's stdout and stderr to its own and exits with the
//! program's exit code (128 + N when killed by signal N), as `docker exec`
//! does; husk's own failures exit 125 with the agent's error kind.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use husk_protocol::{ExecRequest, Termination};
use husk_vmm::host::agent_client::{AgentClient, ClientError};

/// Exit status for husk's own failures (as docker uses 125).
const HUSK_FAILED: u8 = 125;
/// How long one read from the agent may take.
const READ_TIMEOUT: Duration = Duration::from_secs(3600);

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
        /// The VM's vsock socket.
        vm: PathBuf,
        /// Kill the program's process group after this many milliseconds.
        #[arg(long)]
        timeout_ms: Option<u64>,
        /// Working directory in the guest.
        #[arg(long)]
        cwd: Option<String>,
        /// Environment variable KEY=VALUE (repeatable).
        #[arg(long = "env", value_parser = parse_env)]
        env: Vec<(String, String)>,
        /// The program and its arguments.
        #[arg(last = true, required = true)]
        argv: Vec<String>,
    },
    /// Copy a file into or out of the guest: one side is <vm>:<guest path>.
    Cp { from: String, to: String },
    /// Check the guest agent answers; prints the guest's uptime.
    Ping { vm: PathBuf },
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("`{s}` is not KEY=VALUE"))
}

/// Splits `<vm socket>:<guest path>`; a plain host path has no `:`.
fn guest_side(arg: &str) -> Option<(PathBuf, &str)> {
    let (vm, path) = arg.split_once(':')?;
    path.starts_with('/').then(|| (PathBuf::from(vm), path))
}

fn run(args: Args) -> Result<u8, ClientError> {
    match args.command {
        Command::Ping { vm } => {
            let uptime = AgentClient::connect(&vm, READ_TIMEOUT)?.ping()?;
            println!("guest uptime {uptime} ms");
            Ok(0)
        }
        Command::Exec {
            vm,
            timeout_ms,
            cwd,
            env,
            argv,
        } => {
            let mut client = AgentClient::connect(&vm, READ_TIMEOUT)?;
            let req = ExecRequest {
                argv,
                env,
                cwd,
                stdin: Vec::new(),
                timeout_ms,
            };
            let out = client.exec(req)?;
            std::io::stdout().write_all(&out.stdout)?;
            std::io::stderr().write_all(&out.stderr)?;
            Ok(match out.report.termination {
                Termination::Code(code) => code as u8,
                Termination::Signal(sig) => 128u8.wrapping_add(sig as u8),
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
    }
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("husk: {e}");
            ExitCode::from(HUSK_FAILED)
        }
    }
}
