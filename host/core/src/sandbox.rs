//! A handle on one sandbox, for programs that embed the host: its calls
//! reuse the host's idle connections to the guest's agent (one per call
//! running at once; a connection that breaks is dropped), and every call on
//! it is audited with the caller it was opened for.
//!
//! ```no_run
//! # fn main() -> Result<(), husk_core::daemon::DaemonError> {
//! use husk_core::{config::DaemonConfig, daemon::Daemon};
//! use husk_types::CreateRequest;
//!
//! let mut cfg = DaemonConfig::new("/var/lib/husk");
//! cfg.kernel = Some("/path/to/vmlinux".into());
//! cfg.initramfs = Some("/path/to/initramfs.cpio".into());
//! let host = Daemon::start(cfg)?;
//! let req = CreateRequest {
//!     template: "base".into(),
//!     ..Default::default()
//! };
//! let sandbox = host.create_sandbox(req, "my-service")?;
//! let out = sandbox.exec(&["/bin/busybox", "echo", "hi"])?;
//! assert_eq!(out.stdout, b"hi\n");
//! sandbox.destroy()?;
//! host.stop();
//! # Ok(())
//! # }
//! ```

use std::io::{Read, Write};
use std::sync::Arc;

use husk_agent_client::{AgentClient, ClientError, ExecOutput};
use husk_protocol::{DirEntry, ExecRequest, ExitReport, FileStat, Stream};
use husk_types::{CreateRequest, SandboxInfo, TemplateRecord};

use crate::daemon::{Daemon, DaemonError};

/// One sandbox of a host, and the caller that uses it (for the audit log).
pub struct Sandbox {
    host: Arc<Daemon>,
    id: String,
    who: String,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox")
            .field("id", &self.id)
            .field("who", &self.who)
            .finish_non_exhaustive()
    }
}

impl Daemon {
    /// Creates a sandbox (a warm pool's clone when its template has one
    /// ready) and gives a handle on it; `who` is the caller the audit log
    /// names.
    pub fn create_sandbox(
        self: &Arc<Self>,
        req: CreateRequest,
        who: &str,
    ) -> Result<Sandbox, DaemonError> {
        let created = self.create(req, who)?;
        Ok(Sandbox::new(self, created.sandbox.id, who))
    }

    /// A handle on sandbox `id`, for caller `who`.
    pub fn open_sandbox(self: &Arc<Self>, id: &str, who: &str) -> Result<Sandbox, DaemonError> {
        let info = self.sandbox(id)?;
        Ok(Sandbox::new(self, info.id, who))
    }
}

impl Sandbox {
    fn new(host: &Arc<Daemon>, id: String, who: &str) -> Self {
        Sandbox {
            host: host.clone(),
            id,
            who: who.to_owned(),
        }
    }

    /// Its id (`sb-...`).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// What the host shows of it now.
    pub fn info(&self) -> Result<SandboxInfo, DaemonError> {
        self.host.sandbox(&self.id)
    }

    /// Runs `argv` as root in `/` and collects its output (keep it small,
    /// or use [`Sandbox::exec_streaming`]).
    pub fn exec(&self, argv: &[&str]) -> Result<ExecOutput, DaemonError> {
        self.exec_with(ExecRequest {
            argv: argv.iter().map(|a| (*a).to_owned()).collect(),
            ..Default::default()
        })
    }

    /// Runs a program as `req` says and collects its output.
    pub fn exec_with(&self, req: ExecRequest) -> Result<ExecOutput, DaemonError> {
        let detail = req.argv.join(" ");
        self.audited("exec", &detail, |agent| agent.exec(req))
    }

    /// Runs a program, handing each chunk of its output to `on_output` as
    /// it comes; returns how it ended.
    pub fn exec_streaming(
        &self,
        req: ExecRequest,
        on_output: impl FnMut(Stream, &[u8]),
    ) -> Result<ExitReport, DaemonError> {
        let detail = req.argv.join(" ");
        self.audited("exec", &detail, |agent| {
            agent.exec_streaming(req, on_output)
        })
    }

    /// Writes the guest file `path` (mode `mode`) from `data`, whole or not
    /// at all; returns its size.
    pub fn write_file(&self, path: &str, mode: u32, data: impl Read) -> Result<u64, DaemonError> {
        self.audited("upload", path, |agent| agent.write_file(path, mode, data))
    }

    /// Copies the guest file `path` into `sink`; returns its size.
    pub fn read_file(&self, path: &str, sink: impl Write) -> Result<u64, DaemonError> {
        self.audited("download", path, |agent| agent.read_file(path, sink))
    }

    /// The entries of the guest directory `path`.
    pub fn list(&self, path: &str) -> Result<Vec<DirEntry>, DaemonError> {
        self.audited("list", path, |agent| agent.list(path))
    }

    /// What the guest says of `path`.
    pub fn stat(&self, path: &str) -> Result<FileStat, DaemonError> {
        self.audited("stat", path, |agent| agent.stat(path))
    }

    /// Removes the guest file or directory `path` (a directory's content
    /// too with `recursive`).
    pub fn remove(&self, path: &str, recursive: bool) -> Result<(), DaemonError> {
        self.audited("remove", path, |agent| agent.remove(path, recursive))
    }

    /// Stops its vCPUs; it keeps its memory.
    pub fn pause(&self) -> Result<SandboxInfo, DaemonError> {
        self.host.pause(&self.id, &self.who)
    }

    /// Starts its vCPUs again.
    pub fn resume(&self) -> Result<SandboxInfo, DaemonError> {
        self.host.resume(&self.id, &self.who)
    }

    /// Writes it to disk and frees its memory (its VMM exits); any call
    /// on it after wakes it.
    pub fn hibernate(&self) -> Result<SandboxInfo, DaemonError> {
        self.host.hibernate(&self.id, &self.who)
    }

    /// Brings a hibernated sandbox back (as any other call on it does).
    pub fn wake(&self) -> Result<SandboxInfo, DaemonError> {
        self.host.wake(&self.id, &self.who)
    }

    /// Snapshots it into a new template named `name` (it runs on).
    pub fn snapshot(&self, name: &str) -> Result<TemplateRecord, DaemonError> {
        self.host.snapshot(&self.id, name, &self.who)
    }

    /// Snapshots it into template `name` and makes `count` copies of it,
    /// each a sandbox of its own.
    pub fn fork(
        &self,
        name: &str,
        count: u32,
    ) -> Result<(TemplateRecord, Vec<Sandbox>), DaemonError> {
        let (template, made) = self.host.fork(&self.id, name, count, &self.who)?;
        let copies = made
            .into_iter()
            .map(|c| Sandbox::new(&self.host, c.sandbox.id, &self.who))
            .collect();
        Ok((template, copies))
    }

    /// Destroys it: its VMM, files and records (calls on the handle fail
    /// after).
    pub fn destroy(&self) -> Result<(), DaemonError> {
        self.host.destroy(&self.id, &self.who)
    }

    fn audited<T>(
        &self,
        action: &str,
        detail: &str,
        op: impl FnOnce(&mut AgentClient) -> Result<T, ClientError>,
    ) -> Result<T, DaemonError> {
        self.host
            .with_agent(&self.id, &self.who, (action, detail), op)
    }
}
