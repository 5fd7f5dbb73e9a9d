//! A rate limit on the VMM's log. Many warnings are a guest's doing (a bad
//! packet, a misused register), and a guest must not be able to fill the
//! host's disk or keep a host core busy formatting them: lines below ERROR
//! pass at a bounded rate, and the rest are counted and reported when lines
//! pass again.

use std::io::{self, Write};
use std::sync::Mutex;
use std::time::Instant;

use tracing_subscriber::fmt::MakeWriter;

/// Lines per second let through on average.
const LINES_PER_S: f64 = 20.0;
/// Lines let through at once after a quiet spell.
const BURST: f64 = 200.0;

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    last: Instant,
    dropped: u64,
}

/// Hands out stderr writers while the budget lasts, and sinks after.
#[derive(Debug)]
pub struct LogBudget {
    bucket: Mutex<Bucket>,
    lines_per_s: f64,
    burst: f64,
}

impl Default for LogBudget {
    fn default() -> Self {
        Self::new(LINES_PER_S, BURST)
    }
}

impl LogBudget {
    pub fn new(lines_per_s: f64, burst: f64) -> Self {
        LogBudget {
            bucket: Mutex::new(Bucket {
                tokens: burst,
                last: Instant::now(),
                dropped: 0,
            }),
            lines_per_s,
            burst,
        }
    }

    /// Takes one line from the budget: `Some(lines dropped before it)` if it
    /// may be written, None if it is dropped.
    fn take(&self, always: bool) -> Option<u64> {
        let mut b = self.bucket.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let refill = now.duration_since(b.last).as_secs_f64() * self.lines_per_s;
        b.tokens = (b.tokens + refill).min(self.burst);
        b.last = now;
        if b.tokens >= 1.0 || always {
            b.tokens = (b.tokens - 1.0).max(0.0);
            Some(std::mem::take(&mut b.dropped))
        } else {
            b.dropped += 1;
            None
        }
    }
}

/// One log line's destination.
#[derive(Debug)]
pub enum LineWriter {
    Stderr(io::Stderr),
    Dropped,
}

impl Write for LineWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            LineWriter::Stderr(e) => e.write(buf),
            LineWriter::Dropped => Ok(buf.len()),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            LineWriter::Stderr(e) => e.flush(),
            LineWriter::Dropped => Ok(()),
        }
    }
}

impl LineWriter {
    fn stderr(dropped: u64) -> Self {
        let mut e = io::stderr();
        if dropped > 0 {
            let _ = writeln!(e, "husk-vmm: {dropped} log lines dropped (rate limit)");
        }
        LineWriter::Stderr(e)
    }
}

impl<'a> MakeWriter<'a> for LogBudget {
    type Writer = LineWriter;

    fn make_writer(&'a self) -> LineWriter {
        match self.take(false) {
            Some(dropped) => LineWriter::stderr(dropped),
            None => LineWriter::Dropped,
        }
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> LineWriter {
        let always = *meta.level() == tracing::Level::ERROR;
        match self.take(always) {
            Some(dropped) => LineWriter::stderr(dropped),
            None => LineWriter::Dropped,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_past_the_burst_are_dropped_and_counted() {
        let budget = LogBudget::new(0.0, 10.0);

        let passed = (0..1000).filter(|_| budget.take(false).is_some()).count();
        let errors_pass = budget.take(true);

        assert_eq!(passed, 10);
        assert_eq!(errors_pass, Some(990));
    }

    #[test]
    fn the_budget_refills_with_time() {
        let budget = LogBudget::new(1000.0, 1.0);
        assert!(budget.take(false).is_some());

        std::thread::sleep(std::time::Duration::from_millis(20));

        assert!(budget.take(false).is_some());
    }
}
