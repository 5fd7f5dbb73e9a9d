//! A sandbox's programs: what starts one in the background, how it is
//! shown, and the events of its output read from an offset.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use husk_protocol::{ErrorKind, User};

/// A terminal's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TerminalSize {
    /// Rows.
    pub rows: u16,
    /// Columns.
    pub cols: u16,
}

/// A program to start in the background
/// (`POST /v1/sandboxes/{id}/processes`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessSpec {
    /// The program and its arguments (the program by path, or looked up in `PATH`).
    pub argv: Vec<String>,
    /// Environment variables, besides the guest's defaults (and the
    /// image's, which these override).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory (default `/`, or the image's).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Who it runs as (default root, or the image's user).
    #[serde(default)]
    pub user: Option<User>,
    /// Run it on a terminal of this size (its stdin, stdout and stderr;
    /// all output comes back as `stdout`).
    #[serde(default)]
    pub terminal: Option<TerminalSize>,
    /// Keep its stdin open for writes until closed (always open on a
    /// terminal).
    #[serde(default)]
    pub stdin: bool,
    /// Killed, with all it started, after this long, in ms.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Most processes it may have at once.
    #[serde(default)]
    pub pids_max: Option<u32>,
    /// Most bytes of output; past it the program is killed.
    #[serde(default)]
    pub output_max: Option<u64>,
    /// The caller's name for it, shown in listings.
    #[serde(default)]
    pub tag: Option<String>,
    /// How many bytes of its latest output the guest keeps for readers
    /// (default 1 MiB, 4 KiB to 16 MiB).
    #[serde(default)]
    pub keep_bytes: Option<u32>,
}

/// How a program ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessExit {
    /// Its exit code, if it exited.
    pub code: Option<i32>,
    /// The signal that killed it, if one did.
    pub signal: Option<i32>,
    /// Killed at its `timeout_ms`.
    pub timed_out: bool,
    /// Killed past its `output_max`.
    pub over_limit: bool,
}

/// A program in a sandbox's table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    /// Its pid in the guest.
    pub pid: i32,
    /// The program and its arguments.
    pub argv: Vec<String>,
    /// The caller's name for it.
    pub tag: Option<String>,
    /// `running` or `exited`.
    pub state: String,
    /// It runs on a terminal.
    pub terminal: bool,
    /// Its stdin takes writes.
    pub stdin_open: bool,
    /// When it started, Unix ms (the guest's clock).
    pub started_unix_ms: u64,
    /// How it ended.
    pub exit: Option<ProcessExit>,
    /// The offset of the oldest output byte still kept.
    pub kept_from: u64,
    /// All the output it wrote so far, bytes (the offset after the last).
    pub written: u64,
    /// How much of its output is kept, bytes.
    pub keep_bytes: u64,
    /// Started in the background by the process API (kept until removed);
    /// false for an `exec` or a front-end's own program.
    pub kept: bool,
}

/// One line of a program's output stream
/// (`GET /v1/sandboxes/{id}/processes/{pid}/output`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum ProcessEvent {
    /// The first line: the offset the output follows from, and how many
    /// bytes from the one asked for are no longer kept.
    Replay {
        /// Offset of the next byte.
        offset: u64,
        /// Bytes asked for that the guest no longer keeps.
        dropped: u64,
    },
    /// Output, base64, starting at `offset`.
    Stdout {
        /// Offset of its first byte.
        offset: u64,
        /// Base64 of the bytes.
        data: String,
    },
    /// Output on stderr, base64, starting at `offset`.
    Stderr {
        /// Offset of its first byte.
        offset: u64,
        /// Base64 of the bytes.
        data: String,
    },
    /// The reader fell behind: these bytes went before it read them.
    Lost {
        /// Offset of the first one.
        offset: u64,
        /// How many.
        bytes: u64,
    },
    /// The end of what was kept, for a reader that does not follow: the
    /// program runs on.
    Caught {
        /// Offset of the next byte to come.
        offset: u64,
    },
    /// The text a reader waited for (`until`) was written: it ends at
    /// `offset`, and the stream ends here.
    Matched {
        /// Offset after the text's last byte.
        offset: u64,
    },
    /// The program ended, and all its output was sent.
    Exit {
        /// Offset after its last byte.
        offset: u64,
        /// How it ended.
        #[serde(flatten)]
        exit: ProcessExit,
    },
    /// Reading failed.
    Error {
        /// The agent's kind of error, when the guest gave one.
        kind: Option<ErrorKind>,
        /// What went wrong.
        error: String,
    },
}

/// Finds a text in output as it comes, across chunk boundaries.
#[derive(Debug, Clone)]
pub struct OutputMatch {
    text: Vec<u8>,
    /// The end of what was seen: the last `text.len() - 1` bytes.
    tail: Vec<u8>,
}

impl OutputMatch {
    /// Looks for `text` (not empty).
    pub fn new(text: &[u8]) -> OutputMatch {
        OutputMatch {
            text: text.to_vec(),
            tail: Vec::new(),
        }
    }

    /// Output went missing (a reader that fell behind): a text cannot
    /// span the gap.
    pub fn gap(&mut self) {
        self.tail.clear();
    }

    /// Takes the next `data`, which starts at `offset`; the offset after
    /// the first match, if `text` ends within it.
    pub fn feed(&mut self, offset: u64, data: &[u8]) -> Option<u64> {
        let n = self.text.len();
        let mut window = std::mem::take(&mut self.tail);
        let before = window.len() as u64;
        window.extend_from_slice(data);
        if let Some(at) = window.windows(n).position(|w| w == self.text.as_slice()) {
            return Some(offset - before + (at + n) as u64);
        }
        let keep = window.len().min(n.saturating_sub(1));
        self.tail = window[window.len() - keep..].to_vec();
        None
    }
}

/// A signal for a program (`POST .../processes/{pid}/signal`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    /// A name (`TERM`, `SIGINT`...) or a number.
    pub signal: SignalName,
}

/// A signal, by name or number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SignalName {
    /// Its number.
    Number(i32),
    /// Its name, with or without `SIG`.
    Name(String),
}

impl SignalName {
    /// Its number, if it names one (1 to 64).
    pub fn number(&self) -> Option<i32> {
        match self {
            SignalName::Number(n) => (1..=64).contains(n).then_some(*n),
            SignalName::Name(name) => signal_number(name),
        }
    }
}

/// The signals by name, without `SIG`.
pub const SIGNALS: &[(&str, i32)] = &[
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("KILL", 9),
    ("USR1", 10),
    ("USR2", 12),
    ("TERM", 15),
    ("CONT", 18),
    ("STOP", 19),
    ("TSTP", 20),
    ("WINCH", 28),
];

/// A signal's number from its name (`TERM`, `SIGTERM`, `sigterm`) or its
/// number (`15`, 1 to 64).
pub fn signal_number(name: &str) -> Option<i32> {
    if let Ok(n) = name.parse::<i32>() {
        return (1..=64).contains(&n).then_some(n);
    }
    let upper = name.to_ascii_uppercase();
    let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
    SIGNALS.iter().find(|(n, _)| *n == bare).map(|(_, s)| *s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_is_found_across_chunks() {
        let mut m = OutputMatch::new(b"Listening");
        assert_eq!(m.feed(0, b"booting\nListe"), None);
        assert_eq!(m.feed(13, b"ning on 80\n"), Some(17));
        let mut m = OutputMatch::new(b"ab");
        assert_eq!(m.feed(0, b"xa"), None);
        assert_eq!(m.feed(2, b"b"), Some(3));
        let mut m = OutputMatch::new(b"x");
        assert_eq!(m.feed(5, b"abx"), Some(8));
    }

    #[test]
    fn signals_are_named_or_numbered() {
        assert_eq!(signal_number("TERM"), Some(15));
        assert_eq!(signal_number("sigint"), Some(2));
        assert_eq!(signal_number("9"), Some(9));
        assert_eq!(signal_number("0"), None);
        assert_eq!(signal_number("65"), None);
        assert_eq!(signal_number("NOPE"), None);
    }

    #[test]
    fn events_are_tagged_lines() {
        let e = ProcessEvent::Exit {
            offset: 5,
            exit: ProcessExit {
                code: Some(3),
                signal: None,
                timed_out: false,
                over_limit: false,
            },
        };
        let json = serde_json::to_value(&e).expect("json");
        assert_eq!(json["type"], "exit");
        assert_eq!(json["code"], 3);
        assert_eq!(json["offset"], 5);
        let back: ProcessEvent = serde_json::from_value(json).expect("back");
        assert_eq!(back, e);
    }
}
