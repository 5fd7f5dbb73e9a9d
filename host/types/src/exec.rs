//! Commands run in a sandbox: the request and the events of its stream.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use husk_protocol::{ErrorKind, User};

/// An exec request.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecSpec {
    /// The program and its arguments (the program by path, or looked up in `PATH`).
    pub argv: Vec<String>,
    #[serde(default)]
    /// Environment variables, besides the guest's defaults (and the
    /// image's, which these override).
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    /// Working directory (default `/`, or the image's for a template built
    /// from a container image).
    pub cwd: Option<String>,
    #[serde(default)]
    /// Who it runs as (default root, or the image's user).
    pub user: Option<User>,
    /// Given to the program's stdin (UTF-8), which is then closed.
    #[serde(default)]
    pub stdin: String,
    #[serde(default)]
    /// Killed after this long, in ms.
    pub timeout_ms: Option<u64>,
    #[serde(default)]
    /// Most processes it may have at once (its own cgroup's `pids.max`).
    pub pids_max: Option<u32>,
    /// Most bytes of output (stdout and stderr together); past it the
    /// program is killed and the stream ends with a `limit` error.
    #[serde(default)]
    pub output_max: Option<u64>,
}

impl From<ExecSpec> for husk_protocol::ExecRequest {
    /// The agent's request for a spec (stdin closed after `stdin`, in the
    /// foreground, without a terminal).
    fn from(spec: ExecSpec) -> Self {
        husk_protocol::ExecRequest {
            argv: spec.argv,
            env: spec.env.into_iter().collect(),
            cwd: spec.cwd,
            user: spec.user,
            stdin: spec.stdin.into_bytes(),
            timeout_ms: spec.timeout_ms,
            pids_max: spec.pids_max,
            output_max: spec.output_max,
            ..Default::default()
        }
    }
}

/// One line of an exec's stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum ExecEvent {
    /// It started.
    Started {
        /// Its pid in the guest.
        pid: i32,
    },
    /// Output, base64 (it may not be text).
    Stdout {
        /// Base64 of the bytes.
        data: String,
    },
    /// Output on stderr, base64.
    Stderr {
        /// Base64 of the bytes.
        data: String,
    },
    /// Output the guest dropped.
    Lost {
        /// How many.
        bytes: u64,
    },
    /// The end: `code` for an exit, `signal` for a kill.
    Exit {
        /// Its exit code, if it exited.
        code: Option<i32>,
        /// The signal that killed it, if one did.
        signal: Option<i32>,
        /// CPU time in user mode, in microseconds.
        user_us: u64,
        /// CPU time in the kernel, in microseconds.
        system_us: u64,
    },
    /// The program could not run to its end (timeout, agent gone...).
    Error {
        /// The agent's kind of error, when the guest gave one.
        kind: Option<ErrorKind>,
        /// What went wrong.
        error: String,
    },
}
