//! The 8250 UART at COM1 (vm-superio), interrupting through an irqfd, with
//! its output written to stdout or a file and watched line by line for the
//! two things the VMM must know: guest-init's readiness line and a kernel
//! panic.

use std::io::{self, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vm_superio::serial::{NoEvents, SerialState};
use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use super::bus::BusDevice;
use crate::timeline::{Phase, Timeline};

/// The readiness line guest-init prints, followed by ` key=value` fields.
pub const READY_PREFIX: &str = "husk-guest-init: ready";
/// How every Linux panic message starts.
const PANIC_PREFIX: &str = "Kernel panic - not syncing";
/// Longest line kept for matching; the rest of a longer line is still output.
const MAX_LINE: usize = 512;

/// Raises the serial interrupt by writing to an eventfd registered as an irqfd.
#[derive(Debug)]
pub struct EventFdTrigger(pub EventFd);

impl Trigger for EventFdTrigger {
    type E = io::Error;

    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}

/// What the console has told the VMM about the guest.
#[derive(Debug, Default)]
pub struct ConsoleFacts {
    /// The first line of a kernel panic, if one was printed.
    pub panic: Option<String>,
    /// guest-init's own uptime when it became ready, in milliseconds.
    pub guest_uptime_ms: Option<u64>,
}

/// Serial output sink that also scans complete lines.
pub struct ConsoleWriter {
    out: Box<dyn Write + Send>,
    line: Vec<u8>,
    facts: Arc<Mutex<ConsoleFacts>>,
    timeline: Arc<Timeline>,
}

impl std::fmt::Debug for ConsoleWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleWriter").finish_non_exhaustive()
    }
}

impl ConsoleWriter {
    pub fn new(
        out: Box<dyn Write + Send>,
        facts: Arc<Mutex<ConsoleFacts>>,
        timeline: Arc<Timeline>,
    ) -> Self {
        ConsoleWriter {
            out,
            line: Vec::with_capacity(MAX_LINE),
            facts,
            timeline,
        }
    }

    fn scan_line(&mut self) {
        let line = String::from_utf8_lossy(&self.line);
        let line = line.trim_end_matches('\r');
        if let Some(fields) = line.strip_prefix(READY_PREFIX) {
            let now = Instant::now();
            self.timeline.mark(Phase::GuestReady);
            let field = |key: &str| -> Option<u64> {
                fields
                    .split_whitespace()
                    .find_map(|f| f.strip_prefix(key))
                    .and_then(|v| v.parse().ok())
            };
            let uptime = field("uptime_ms=");
            // guest-init's own time to readiness, on the guest's clock
            // (which runs at the host's rate), counted back from now.
            if let Some(took) = uptime
                .zip(field("init_ms="))
                .and_then(|(u, i)| u.checked_sub(i))
            {
                if let Some(at) = now.checked_sub(Duration::from_millis(took)) {
                    self.timeline.mark_at(Phase::InitStarted, at);
                }
            }
            lock(&self.facts).guest_uptime_ms = uptime;
        } else if let Some(at) = line.find(PANIC_PREFIX) {
            let mut facts = lock(&self.facts);
            if facts.panic.is_none() {
                facts.panic = Some(line[at..].to_owned());
            }
        }
        self.line.clear();
    }
}

impl Write for ConsoleWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        for &b in buf {
            if b == b'\n' {
                self.scan_line();
            } else if self.line.len() < MAX_LINE {
                self.line.push(b);
            }
        }
        // Console output is best effort: a closed stdout must not stop the guest.
        let _ = self.out.write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

/// A console file of bounded size that keeps the newest output: once it
/// would pass `max` bytes, its last `max / 2` bytes (from a line start) move
/// to the front behind a line that counts what was dropped. A guest that
/// writes without end costs the host `max` bytes of disk, and whoever reads
/// the file still finds the guest's last words at its end.
#[derive(Debug)]
pub struct ConsoleFile {
    file: std::fs::File,
    len: u64,
    max: u64,
    dropped: u64,
    /// Length of our own "dropped" line at the front (not guest output).
    marker: u64,
}

impl ConsoleFile {
    /// Opens (or creates) `path`, appending to what it holds.
    pub fn open(path: &std::path::Path, max: u64) -> io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .read(true)
            .write(true)
            .truncate(false)
            .open(path)?;
        let len = file.metadata()?.len();
        let mut console = ConsoleFile {
            file,
            len,
            max: max.max(1024),
            dropped: 0,
            marker: 0,
        };
        if console.len > console.max {
            console.keep_tail()?;
        }
        Ok(console)
    }

    /// Moves the newest half of the file to its front.
    fn keep_tail(&mut self) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let keep = (self.len - self.marker).min(self.max / 2);
        let mut tail = vec![0u8; keep as usize];
        self.file.read_exact_at(&mut tail, self.len - keep)?;
        // Start at a line: the cut line would only confuse a reader.
        let start = tail.iter().position(|b| *b == b'\n').map_or(0, |nl| nl + 1);
        let tail = &tail[start..];
        self.dropped += self.len - self.marker - tail.len() as u64;
        let mut front = format!(
            "[husk: {} earlier bytes of console output dropped]\n",
            self.dropped
        )
        .into_bytes();
        self.marker = front.len() as u64;
        front.extend_from_slice(tail);
        self.file.write_all_at(&front, 0)?;
        self.file.set_len(front.len() as u64)?;
        self.len = front.len() as u64;
        Ok(())
    }
}

impl Write for ConsoleFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        use std::os::unix::fs::FileExt;
        // Only the newest half fits anyway.
        let skip = buf.len().saturating_sub((self.max / 2) as usize);
        self.dropped += skip as u64;
        let data = &buf[skip..];
        if self.len + data.len() as u64 > self.max {
            self.keep_tail()?;
        }
        self.file.write_all_at(data, self.len)?;
        self.len += data.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The UART's registers and unread input, for snapshots: vm-superio's
/// `SerialState`, serialized through [`SerialStateDef`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SerialSnapshot(#[serde(with = "SerialStateDef")] pub SerialState);

/// `SerialState`'s fields for serde (the type is not serializable itself).
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(remote = "SerialState")]
struct SerialStateDef {
    baud_divisor_low: u8,
    baud_divisor_high: u8,
    interrupt_enable: u8,
    interrupt_identification: u8,
    line_control: u8,
    line_status: u8,
    modem_control: u8,
    modem_status: u8,
    scratch: u8,
    in_buffer: Vec<u8>,
}

/// COM1 on the port-I/O bus.
#[derive(Debug)]
pub struct SerialDevice {
    serial: Serial<EventFdTrigger, NoEvents, ConsoleWriter>,
}

impl SerialDevice {
    pub fn new(irq: EventFd, out: ConsoleWriter) -> Self {
        SerialDevice {
            serial: Serial::new(EventFdTrigger(irq), out),
        }
    }
}

impl husk_snapshot::Persist for SerialDevice {
    type State = SerialSnapshot;
    /// Its interrupt and where its output goes.
    type ConstructorArgs = (EventFd, ConsoleWriter);
    type Error = io::Error;

    fn save(&self) -> SerialSnapshot {
        SerialSnapshot(self.serial.state())
    }

    /// A UART in the saved state, interrupting through `irq`.
    fn restore((irq, out): (EventFd, ConsoleWriter), s: &SerialSnapshot) -> io::Result<Self> {
        let serial = Serial::from_state(&s.0, EventFdTrigger(irq), NoEvents, out)
            .map_err(|e| io::Error::other(format!("serial state: {e:?}")))?;
        Ok(SerialDevice { serial })
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let (Ok(offset), [byte]) = (u8::try_from(offset), data) {
            *byte = self.serial.read(offset);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Ok(offset), [byte]) = (u8::try_from(offset), data) {
            if let Err(e) = self.serial.write(offset, *byte) {
                tracing::warn!("serial write failed: {e:?}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn writer() -> (ConsoleWriter, Arc<Mutex<ConsoleFacts>>, Arc<Timeline>) {
        let facts = Arc::new(Mutex::new(ConsoleFacts::default()));
        let timeline = Arc::new(Timeline::new());
        let w = ConsoleWriter::new(Box::new(io::sink()), facts.clone(), timeline.clone());
        (w, facts, timeline)
    }

    #[test]
    fn readiness_line_marks_the_timeline() {
        let (mut w, facts, timeline) = writer();

        w.write_all(b"noise\r\nhusk-guest-init: ready uptime_ms=1234 pid=1\r\n")
            .expect("write");

        assert_eq!(lock(&facts).guest_uptime_ms, Some(1234));
        assert!(timeline.elapsed_us(Phase::GuestReady).is_some());
        assert_eq!(timeline.elapsed_us(Phase::InitStarted), None);
    }

    #[test]
    fn guest_inits_start_is_counted_back_from_its_readiness() {
        let (mut w, _, timeline) = writer();
        std::thread::sleep(Duration::from_millis(30));

        w.write_all(b"husk-guest-init: ready uptime_ms=5020 init_ms=5000 hostname=h\n")
            .expect("write");

        let ready = timeline.elapsed_us(Phase::GuestReady).expect("ready");
        let started = timeline.elapsed_us(Phase::InitStarted).expect("init");
        assert!(started < ready);
        assert!(ready - started >= 20_000, "{started} {ready}");
    }

    #[test]
    fn panic_line_is_recorded_once() {
        let (mut w, facts, _) = writer();

        w.write_all(b"[ 1.0] Kernel panic - not syncing: Attempted to kill init!\n")
            .expect("write");
        w.write_all(b"Kernel panic - not syncing: second\n")
            .expect("write");

        assert_eq!(
            lock(&facts).panic.as_deref(),
            Some("Kernel panic - not syncing: Attempted to kill init!")
        );
    }

    #[test]
    fn long_lines_do_not_grow_the_buffer() {
        let (mut w, _, _) = writer();

        w.write_all(&vec![b'x'; 100_000]).expect("write");

        assert_eq!(w.line.len(), MAX_LINE);
    }

    #[test]
    fn a_console_file_keeps_its_newest_output_within_its_bound() {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let path = dir.as_path().join("console");
        let mut console = ConsoleFile::open(&path, 4096).expect("open");

        for i in 0..10_000 {
            console
                .write_all(format!("line {i}\n").as_bytes())
                .expect("write");
        }

        let text = std::fs::read_to_string(&path).expect("read");
        assert!(text.len() <= 4096, "{} bytes", text.len());
        assert!(text.starts_with("[husk: "), "{}", &text[..40]);
        assert!(text.contains(" earlier bytes of console output dropped]\nline "));
        assert!(text.ends_with("line 9998\nline 9999\n"));
        let lines: Vec<&str> = text.lines().skip(1).collect();
        assert!(lines.windows(2).all(|w| {
            let n = |l: &str| l["line ".len()..].parse::<u32>().expect("number");
            n(w[1]) == n(w[0]) + 1
        }));
    }

    #[test]
    fn a_console_file_counts_everything_it_dropped() {
        let dir = vmm_sys_util::tempdir::TempDir::new().expect("tempdir");
        let path = dir.as_path().join("console");
        let mut console = ConsoleFile::open(&path, 1024).expect("open");

        let written = 100_000u64;
        for _ in 0..written / 10 {
            console.write_all(b"123456789\n").expect("write");
        }

        let text = std::fs::read_to_string(&path).expect("read");
        let (first, rest) = text.split_once('\n').expect("marker line");
        let dropped: u64 = first["[husk: ".len()..]
            .split(' ')
            .next()
            .and_then(|n| n.parse().ok())
            .expect("count");
        assert_eq!(dropped + rest.len() as u64, written);
    }

    /// A UART the driver has set up (8N1, a divisor, a scratch byte) with
    /// unread input.
    fn configured_uart() -> SerialDevice {
        let mut uart = SerialDevice::new(EventFd::new(0).expect("eventfd"), writer().0);
        for (offset, value) in [
            (3u64, 0x83u8),
            (0, 0x0c),
            (1, 0),
            (3, 0x03),
            (7, 0x5a),
            (1, 0x01),
        ] {
            uart.write(offset, &[value]);
        }
        uart.serial.enqueue_raw_bytes(b"typed").expect("input");
        uart
    }

    crate::persist::persist_conformance!(
        serial_state_survives_a_snapshot,
        configured_uart(),
        (EventFd::new(0).expect("eventfd"), writer().0)
    );
}
