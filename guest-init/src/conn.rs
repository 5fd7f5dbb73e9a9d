//! One client connection of the agent, shared by the threads serving its
//! requests: its frames out (never interleaved), the foreground programs
//! and watches that end with it.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use husk_protocol::{write_frame_with, Frame, ProtocolError};

/// One client connection, shared by the threads serving its requests.
#[derive(Debug)]
pub struct Conn {
    /// The connection, and the buffer frames are encoded in (kept: a
    /// stream of large frames allocates it once).
    out: Mutex<(File, Vec<u8>)>,
    closed: AtomicBool,
    /// Long requests running for it (the agent bounds them).
    pub in_flight: AtomicUsize,
    /// Foreground programs started here: they end when the client leaves.
    pub foreground: Mutex<HashSet<i32>>,
    /// Watches in progress, by request id.
    pub watches: Mutex<HashMap<u64, Arc<Cancel>>>,
}

pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Conn {
    /// A connection whose frames go to `out`.
    pub fn new(out: File) -> Self {
        Conn {
            out: Mutex::new((out, Vec::new())),
            closed: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            foreground: Mutex::new(HashSet::new()),
            watches: Mutex::new(HashMap::new()),
        }
    }

    /// Sends one frame; frames of concurrent requests never interleave.
    pub fn send(&self, frame: &Frame) -> Result<(), ProtocolError> {
        if self.is_closed() {
            return Err(ProtocolError::Closed);
        }
        let result = {
            let (file, buf) = &mut *lock(&self.out);
            write_frame_with(file, frame, buf)
        };
        if result.is_err() {
            self.close();
        }
        result
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    pub fn adopt(&self, pid: i32) {
        lock(&self.foreground).insert(pid);
    }

    pub fn disown(&self, pid: i32) {
        lock(&self.foreground).remove(&pid);
    }

    /// The client is gone: stop its watches, wake its foreground streams.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        for cancel in lock(&self.watches).drain().map(|(_, c)| c) {
            cancel.cancel();
        }
        let pids: Vec<i32> = lock(&self.foreground).iter().copied().collect();
        for pid in pids {
            if let Some(p) = crate::process::find(pid) {
                let _out = p.output();
                p.changed.notify_all();
            }
        }
    }
}

/// Wakes a watch thread to end it (an eventfd).
#[derive(Debug)]
pub struct Cancel(OwnedFd);

impl Cancel {
    pub fn new() -> std::io::Result<Self> {
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a new descriptor nothing else owns.
        Ok(Cancel(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// The eventfd a watch thread polls.
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }

    pub fn cancel(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a valid buffer to our eventfd.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}
