//! A sandbox's programs through the daemon's process API: `husk exec -d`,
//! `husk exec -t` (an interactive terminal), `husk attach`, `husk wait`,
//! `husk kill` and `husk ps <id>` by sandbox id, as they work on a VM
//! socket.

use husk_protocol::Stream;
use husk_types::{ProcessEvent, ProcessExit, ProcessSpec, TerminalSize};

use crate::sandboxes::{client, CliResult};
use crate::{terminal_size, RawMode, HUSK_FAILED};

/// `husk exec -d <id>`: starts the program in the background, prints its pid.
pub fn detach(id: &str, spec: &ProcessSpec) -> CliResult {
    let p = client().start_process(id, spec)?;
    println!("{}", p.pid);
    Ok(0)
}

/// `husk exec -t [-i] <id>`: the program on a terminal, over its
/// WebSocket: this one's keys (Ctrl-C included: the terminal is raw) go to
/// it with `interactive`, this one's size follows; exits like it. The
/// program is removed from the table once it ended.
pub fn terminal(id: &str, mut spec: ProcessSpec, interactive: bool) -> CliResult {
    crate::block_sigwinch();
    let size = terminal_size().unwrap_or(husk_protocol::WindowSize { rows: 24, cols: 80 });
    spec.terminal = Some(TerminalSize {
        rows: size.rows,
        cols: size.cols,
    });
    spec.tag.get_or_insert_with(|| "husk exec -t".into());
    let api = client();
    let pid = api.start_process(id, &spec)?.pid;
    let code = {
        let _raw = RawMode::enable();
        on_terminal(&api, id, pid, interactive)
    };
    let _ = api.remove_process(id, pid);
    code
}

/// Serves the terminal of program `pid` until it ends: one thread polls
/// the WebSocket, stdin and a pipe that SIGWINCH writes to.
fn on_terminal(api: &husk_client::ApiClient, id: &str, pid: i32, interactive: bool) -> CliResult {
    use std::os::fd::AsRawFd;
    use tungstenite::client::IntoClientRequest;
    use tungstenite::{Error as WsError, Message};

    let (stream, token) = api.connect_stream()?;
    let url = format!(
        "ws://husk/v1/sandboxes/{}/processes/{pid}/terminal",
        husk_client::encode(id)
    );
    let mut request = url
        .into_client_request()
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    if let Some(token) = token {
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| std::io::Error::other("a token that is not a header value"))?;
        request.headers_mut().insert("authorization", value);
    }
    let (mut ws, _) = tungstenite::client::client(request, stream)
        .map_err(|e| std::io::Error::other(format!("the terminal's WebSocket: {e}")))?;
    ws.get_ref().set_nonblocking(true)?;
    // Resizes: the signal thread writes a byte to this pipe.
    let [winch_r, winch_w] = {
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills two descriptors.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        fds
    };
    std::thread::spawn(move || {
        while crate::next_sigwinch() {
            // SAFETY: a one-byte write to the pipe's write end.
            unsafe { libc::write(winch_w, [0u8].as_ptr().cast(), 1) };
        }
    });
    let decode = |text: &str| serde_json::from_str::<ProcessEvent>(text).ok();
    let mut stdin_open = interactive;
    let mut unsent = false;
    loop {
        let mut fds = [
            libc::pollfd {
                fd: ws.get_ref().as_raw_fd(),
                events: libc::POLLIN | if unsent { libc::POLLOUT } else { 0 },
                revents: 0,
            },
            libc::pollfd {
                fd: if stdin_open { 0 } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: winch_r,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: three valid pollfds (a negative fd is skipped).
        if unsafe { libc::poll(fds.as_mut_ptr(), 3, -1) } < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e.into());
        }
        let mut outgoing = Vec::new();
        if fds[1].revents != 0 {
            let mut buf = [0u8; 4096];
            // SAFETY: reads into a live buffer.
            let n = unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
            if n > 0 {
                outgoing.push(Message::binary(buf[..n as usize].to_vec()));
            } else {
                stdin_open = false;
                outgoing.push(Message::text(r#"{"close_stdin": true}"#));
            }
        }
        if fds[2].revents != 0 {
            let mut drain = [0u8; 64];
            // SAFETY: reads into a live buffer; the pipe does not block.
            unsafe { libc::read(winch_r, drain.as_mut_ptr().cast(), drain.len()) };
            if let Some(s) = terminal_size() {
                outgoing.push(Message::text(format!(
                    r#"{{"resize": {{"rows": {}, "cols": {}}}}}"#,
                    s.rows, s.cols
                )));
            }
        }
        for message in outgoing {
            match ws.send(message) {
                Ok(()) => {}
                Err(WsError::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock => unsent = true,
                Err(e) => return Err(std::io::Error::other(e.to_string()).into()),
            }
        }
        if unsent && fds[0].revents & libc::POLLOUT != 0 {
            match ws.flush() {
                Ok(()) => unsent = false,
                Err(WsError::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(std::io::Error::other(e.to_string()).into()),
            }
        }
        // Everything the socket has now.
        loop {
            match ws.read() {
                Ok(Message::Binary(data)) => crate::write_out(Stream::Stdout, &data),
                Ok(Message::Text(text)) => match decode(text.as_str()) {
                    Some(ProcessEvent::Stderr { data, .. }) => {
                        crate::write_base64(Stream::Stderr, &data)
                    }
                    Some(event @ (ProcessEvent::Exit { .. } | ProcessEvent::Error { .. })) => {
                        if let Some(code) = end(event) {
                            return Ok(code);
                        }
                    }
                    _ => {}
                },
                Ok(Message::Close(_)) | Err(WsError::ConnectionClosed | WsError::AlreadyClosed) => {
                    eprintln!("husk: the terminal closed before the program's exit");
                    return Ok(HUSK_FAILED);
                }
                Ok(_) => {}
                Err(WsError::Io(e)) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(std::io::Error::other(e.to_string()).into()),
            }
        }
    }
}

/// `husk attach <id> <pid> [--from N] [--until TEXT]`: its output from
/// offset `from` (what the guest kept, then live) until it ends (exits
/// like it), or until it wrote TEXT (exits 0).
pub fn attach(id: &str, pid: i32, from: u64, until: Option<&str>) -> CliResult {
    follow(id, pid, from, until)
}

/// `husk wait <id> <pid>`: until it ends (its output is not shown); exits
/// like it.
pub fn wait(id: &str, pid: i32) -> CliResult {
    let mut events = client().process_output(id, pid, u64::MAX, true, None)?;
    while let Some(event) = events.next_event()? {
        if let Some(code) = end(event) {
            return Ok(code);
        }
    }
    eprintln!("husk: the daemon ended the stream before the program's exit");
    Ok(HUSK_FAILED)
}

/// `husk ping <id> [--wait-s N]`: the guest's uptime once its agent
/// answers (waiting up to `wait_s` for a sandbox that is still starting).
pub fn ping(id: &str, wait_s: u64) -> CliResult {
    let mut budget =
        husk_agent_client::readiness::WaitBudget::new(std::time::Duration::from_secs(wait_s));
    loop {
        match client().guest_health(id) {
            Ok(h) => {
                println!("guest uptime {} ms", h.uptime_ms);
                return Ok(0);
            }
            Err(e) if budget.expired() => return Err(e),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(500)),
        }
    }
}

/// `husk watch <id> /dir [-r]`: changes as they happen, until interrupted.
pub fn watch(id: &str, dir: &str, recursive: bool) -> CliResult {
    let mut lines = client().watch(id, dir, recursive)?;
    while let Some(e) = lines.next_line::<serde_json::Value>()? {
        if let Some(err) = e["error"].as_str() {
            eprintln!("husk: {err}");
            return Ok(HUSK_FAILED);
        }
        if let (Some(kind), Some(path)) = (e["kind"].as_str(), e["path"].as_str()) {
            let slash = if e["is_dir"] == true { "/" } else { "" };
            println!("{kind} {path}{slash}");
        }
    }
    Ok(0)
}

/// `husk kill <id> <pid> [-s SIG]`.
pub fn kill(id: &str, pid: i32, signal: i32) -> CliResult {
    client().signal_process(id, pid, &signal.to_string())?;
    Ok(0)
}

/// `husk ps <id>`: the sandbox's programs.
pub fn ps(id: &str, json: bool) -> CliResult {
    let list = client().processes(id)?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&list).unwrap_or_default()
        );
        return Ok(0);
    }
    println!(
        "{:>7}  {:<10}  {:>10}  {:<12}  COMMAND",
        "PID", "STATE", "OUTPUT", "TAG"
    );
    for p in list {
        let state = match &p.exit {
            None => "running".to_owned(),
            Some(e) => exit_text(e),
        };
        println!(
            "{:>7}  {:<10}  {:>10}  {:<12}  {}",
            p.pid,
            state,
            p.written,
            p.tag.as_deref().unwrap_or("-"),
            p.argv.join(" ")
        );
    }
    Ok(0)
}

fn exit_text(e: &ProcessExit) -> String {
    match (e.code, e.signal, e.timed_out) {
        (_, _, true) => "timed out".into(),
        (Some(c), _, _) => format!("exit {c}"),
        (None, Some(s), _) => format!("signal {s}"),
        _ => "exited".into(),
    }
}

/// Prints program `pid`'s output from `from` until it ends; its exit code.
fn follow(id: &str, pid: i32, from: u64, until: Option<&str>) -> CliResult {
    let mut events = client().process_output(id, pid, from, true, until)?;
    while let Some(event) = events.next_event()? {
        match event {
            ProcessEvent::Replay { dropped: 0, .. } => {}
            ProcessEvent::Replay { dropped, offset } => {
                eprintln!("husk: {dropped} bytes before offset {offset} are no longer kept")
            }
            ProcessEvent::Stdout { data, .. } => crate::write_base64(Stream::Stdout, &data),
            ProcessEvent::Stderr { data, .. } => crate::write_base64(Stream::Stderr, &data),
            ProcessEvent::Lost { bytes, .. } => {
                eprintln!("husk: {bytes} bytes of output went before they were read")
            }
            other => {
                if let Some(code) = end(other) {
                    return Ok(code);
                }
            }
        }
    }
    eprintln!("husk: the daemon ended the output before the program's exit");
    Ok(HUSK_FAILED)
}

/// The exit status an ending event stands for (as a shell's: 128 + N for
/// signal N, 124 for a timeout).
fn end(event: ProcessEvent) -> Option<u8> {
    match event {
        ProcessEvent::Exit { exit, .. } => Some(match exit {
            ProcessExit {
                timed_out: true, ..
            } => 124,
            ProcessExit { code: Some(c), .. } => c as u8,
            ProcessExit {
                signal: Some(s), ..
            } => 128u8.wrapping_add(s as u8),
            _ => 0,
        }),
        ProcessEvent::Error { error, kind } => {
            eprintln!("husk: {error}");
            Some(match kind {
                Some(husk_protocol::ErrorKind::Timeout) => 124,
                _ => HUSK_FAILED,
            })
        }
        ProcessEvent::Caught { .. } | ProcessEvent::Matched { .. } => Some(0),
        _ => None,
    }
}
