//! `husk mcp`: MCP on stdio, its tools reaching sandboxes through a
//! daemon's API (the daemon's `/mcp` runs the same tools in process).

use std::io::Read;

use base64::Engine;
use husk_client::{ApiClient, ApiClientError};
use husk_protocol::{Stream, Termination};
use husk_server::mcp::{too_long, Backend, CommandOutput, ExecFailure, Refusal};
use husk_types::{CreateRequest, DirEntry, ExecEvent, ExecSpec, ProcessSpec};

/// The tools' backend: the daemon's REST API.
#[derive(Debug)]
pub struct Remote(pub ApiClient);

impl Backend for Remote {
    fn create(&self, req: CreateRequest, _who: &str) -> Result<String, Refusal> {
        Ok(self.0.create_sandbox(&req)?.sandbox.id)
    }

    fn exec(
        &self,
        id: &str,
        spec: ExecSpec,
        output: &mut dyn FnMut(Stream, &[u8]),
    ) -> Result<Termination, ExecFailure> {
        let failed = |e: ApiClientError| (None, e.to_string());
        let mut events = self.0.exec(id, &spec).map_err(failed)?;
        let decode = |d: &str| {
            base64::engine::general_purpose::STANDARD
                .decode(d)
                .unwrap_or_default()
        };
        while let Some(event) = events.next_event().map_err(failed)? {
            match event {
                ExecEvent::Started { .. } => {}
                ExecEvent::Stdout { data } => output(Stream::Stdout, &decode(&data)),
                ExecEvent::Stderr { data } => output(Stream::Stderr, &decode(&data)),
                ExecEvent::Lost { bytes } => output(
                    Stream::Stderr,
                    format!("[husk: {bytes} bytes of output lost]\n").as_bytes(),
                ),
                ExecEvent::Exit { code, signal, .. } => {
                    return match (code, signal) {
                        (Some(c), _) => Ok(Termination::Code(c)),
                        (None, Some(s)) => Ok(Termination::Signal(s)),
                        _ => Err((None, "it ended without a status".into())),
                    }
                }
                ExecEvent::Error { kind, error } => return Err((kind, error)),
            }
        }
        Err((None, "its output ended without an exit status".into()))
    }

    fn read(&self, id: &str, path: &str, max: u64) -> Result<Vec<u8>, Refusal> {
        let resp = self.0.read_file(id, path)?;
        let size: Option<u64> = resp.header("content-length").and_then(|v| v.parse().ok());
        if size.is_some_and(|s| s > max) {
            return Err(too_long(path, size, max));
        }
        let mut data = Vec::new();
        resp.take(max + 1)
            .read_to_end(&mut data)
            .map_err(|e| Refusal(format!("reading {path}: {e}")))?;
        Ok(data)
    }

    fn write(&self, id: &str, path: &str, mut data: &[u8]) -> Result<(), Refusal> {
        Ok(self.0.write_file(id, path, None, &mut data)?)
    }

    fn list(&self, id: &str, path: &str) -> Result<Vec<DirEntry>, Refusal> {
        Ok(self.0.list_dir(id, path)?)
    }

    fn destroy(&self, id: &str) -> Result<(), Refusal> {
        Ok(self.0.destroy_sandbox(id)?)
    }

    fn start(&self, id: &str, spec: ProcessSpec, _who: &str) -> Result<i32, Refusal> {
        Ok(self.0.start_process(id, &spec)?.pid)
    }

    fn output(&self, id: &str, pid: i32, from: u64, max: u64) -> Result<CommandOutput, Refusal> {
        let mut events = self.0.process_output(id, pid, from, false, None)?;
        let mut out = CommandOutput::default();
        while let Some(event) = events.next_event()? {
            if !out.take(event, max) {
                break;
            }
        }
        Ok(out)
    }

    fn input(&self, id: &str, pid: i32, data: &[u8], close: bool) -> Result<(), Refusal> {
        Ok(self.0.write_process_stdin(id, pid, data, close)?)
    }

    fn signal(&self, id: &str, pid: i32, signal: i32, _who: &str) -> Result<(), Refusal> {
        Ok(self.0.signal_process(id, pid, &signal.to_string())?)
    }
}
