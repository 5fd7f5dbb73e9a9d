//! The way in to a sandbox's ports: a stream to a TCP port inside the
//! guest, through the VMM's vsock socket and guest-init's port forwarder
//! (`husk_protocol::PORTS_VSOCK_PORT`). Front-ends (the daemon's front
//! door, an embedder) carry HTTP, WebSockets or anything else over it;
//! who may connect is theirs to decide, with the sandbox's traffic token.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicUsize;

use husk_protocol::{port_request, PORTS_VSOCK_PORT, PORT_LINE_MAX};
use husk_types::PortInfo;

use super::*;

/// Connections to one sandbox's ports open at once; more are refused. The
/// VMM serves 128 host connections per guest and the forwarder 96: this
/// leaves room for the agent's.
pub const MAX_PORT_CONNS: usize = 64;
/// How long the VMM and the guest's forwarder may take to answer a new
/// connection (generous: a busy host's guest may take seconds).
const PORT_ANSWER: Duration = Duration::from_secs(60);

/// An open connection to a port inside a sandbox; the guest program sees a
/// connection from its loopback. Counted against [`MAX_PORT_CONNS`] until
/// dropped.
#[derive(Debug)]
pub struct PortStream {
    /// The connection: bytes written reach the guest program.
    pub stream: UnixStream,
    _held: PortHeld,
}

/// Counted against the sandbox's port connections, and a use of it (see
/// `on_idle`) while it lasts.
#[derive(Debug)]
struct PortHeld {
    count: Arc<AtomicUsize>,
    _in_use: InUse,
}

impl Drop for PortHeld {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::SeqCst);
    }
}

impl PortStream {
    /// The stream and what keeps it counted (drop both together).
    pub fn into_parts(self) -> (UnixStream, impl Send + Sync + std::fmt::Debug) {
        (self.stream, self._held)
    }
}

impl Daemon {
    /// Where port `port` of sandbox `id` is published, and whether a guest
    /// program listens on it now (a connection is made and closed).
    pub fn port(&self, id: &str, port: u16) -> Result<PortInfo, DaemonError> {
        let reason = match self.connect_port(id, port) {
            Ok(_) => None,
            Err(DaemonError::Unreachable(why)) => Some(why),
            Err(e) => return Err(e),
        };
        let rec = self.record(id)?;
        let door = self.cfg.front_door.as_ref();
        Ok(PortInfo {
            sandbox: id.to_owned(),
            port,
            listening: reason.is_none(),
            reason,
            host: door.map(|d| d.host(id, port)),
            url: door.map(|d| d.url(id, port)),
            private: rec.traffic_token.is_some(),
        })
    }

    /// [`Daemon::port`] once a program listens on it, or after `wait` (then
    /// as it stands): a server that is still starting.
    pub fn wait_for_port(
        &self,
        id: &str,
        port: u16,
        wait: Duration,
    ) -> Result<PortInfo, DaemonError> {
        let deadline = Instant::now() + wait;
        loop {
            let info = self.port(id, port)?;
            if info.listening || Instant::now() >= deadline {
                return Ok(info);
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Connects to TCP `port` on the loopback of sandbox `id`. A
    /// hibernated sandbox is woken first, and a sandbox whose clock is
    /// still to be set after a wake or a claim gets it first. A paused or
    /// failed one is refused (`Conflict`); nothing listening on the port is
    /// `Unreachable`.
    pub fn connect_port(&self, id: &str, port: u16) -> Result<PortStream, DaemonError> {
        if port == 0 {
            return Err(DaemonError::Invalid("port 0 is not a port".into()));
        }
        let (rec, gate, count, activity) = {
            let inner = self.lock();
            match inner.sandboxes.get(id) {
                Some(live) if live.rec.state != SandboxState::Pooled => (
                    live.rec.clone(),
                    live.gate.clone(),
                    live.ports.clone(),
                    live.activity.clone(),
                ),
                _ => return Err(DaemonError::NotFound(format!("no sandbox `{id}`"))),
            }
        };
        match rec.state {
            SandboxState::Running => {}
            SandboxState::Hibernated => {
                self.wake_if_hibernated(id, "daemon (on use)")?;
                return self.connect_port(id, port);
            }
            _ => return Err(unusable(&rec)),
        }
        if gate.is_some_and(|gate| !gate.is_set()) {
            // The guest's clock is set, and its shares mounted, by its next
            // agent request: make one.
            self.with_agent(id, "daemon", ("ready", "before a port connection"), |c| {
                c.ping()
            })?;
        }
        if count.fetch_add(1, Ordering::SeqCst) >= MAX_PORT_CONNS {
            count.fetch_sub(1, Ordering::SeqCst);
            return Err(DaemonError::Limit(format!(
                "{MAX_PORT_CONNS} connections to sandbox `{id}`'s ports are open already"
            )));
        }
        let held = PortHeld {
            count,
            _in_use: InUse::of(&activity),
        };
        let uds = rec.run_dir.join(vmm_process::VSOCK);
        let mut stream = UnixStream::connect(&uds).map_err(|e| {
            DaemonError::Unreachable(format!("sandbox `{id}`'s VMM does not answer: {e}"))
        })?;
        stream.set_read_timeout(Some(PORT_ANSWER))?;
        stream.write_all(format!("CONNECT {PORTS_VSOCK_PORT}\n").as_bytes())?;
        let vmm = read_line(&mut stream);
        if !vmm.as_deref().is_ok_and(|l| l.starts_with("OK ")) {
            return Err(DaemonError::Unreachable(format!(
                "sandbox `{id}` has no port forwarder (a template built before husk \
                 forwarded ports: rebuild it){}",
                vmm.err().map(|e| format!(": {e}")).unwrap_or_default()
            )));
        }
        stream.write_all(port_request(port).as_bytes())?;
        match read_line(&mut stream) {
            Ok(line) if line == "OK" => {}
            Ok(line) => {
                let why = line.strip_prefix("ERR ").unwrap_or(&line);
                return Err(DaemonError::Unreachable(format!(
                    "nothing answers on port {port} in sandbox `{id}`: {why}"
                )));
            }
            Err(e) => {
                return Err(DaemonError::Unreachable(format!(
                    "sandbox `{id}`'s port forwarder did not answer: {e}"
                )))
            }
        }
        stream.set_read_timeout(None)?;
        Ok(PortStream {
            stream,
            _held: held,
        })
    }
}

/// One line, read a byte at a time: what follows it is the guest
/// program's.
fn read_line(stream: &mut UnixStream) -> std::io::Result<String> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < PORT_LINE_MAX {
        match stream.read(&mut byte)? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            _ if byte[0] == b'\n' => return Ok(String::from_utf8_lossy(&line).into_owned()),
            _ => line.push(byte[0]),
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        "an answer line over the limit",
    ))
}
