//! PID 1 reaps every child (orphans included) from its main loop. Programs
//! the agent starts are "watched": their exit is kept here for the agent,
//! and every other exit is dropped, so nothing accumulates.

use std::collections::{HashMap, HashSet};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// How a child ended, from wait4.
#[derive(Debug, Clone, Copy)]
pub struct Exit {
    pub status: libc::c_int,
    pub rusage: libc::rusage,
}

#[derive(Default)]
struct State {
    watched: HashSet<libc::pid_t>,
    exited: HashMap<libc::pid_t, Exit>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);
static EXITED: Condvar = Condvar::new();

fn state() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `spawn` and watches the pid it returns. The lock is held across
/// the spawn, so the main loop cannot drop the child's exit before it is
/// watched, however fast the child is.
pub fn spawn_watched<T, E>(
    spawn: impl FnOnce() -> Result<(libc::pid_t, T), E>,
) -> Result<(libc::pid_t, T), E> {
    let mut guard = state();
    let (pid, value) = spawn()?;
    guard.get_or_insert_with(State::default).watched.insert(pid);
    Ok((pid, value))
}

/// Records exits the main loop reaped; wakes their waiters.
pub fn record(exits: &[(libc::pid_t, Exit)]) {
    let mut guard = state();
    let state = guard.get_or_insert_with(State::default);
    for (pid, exit) in exits {
        if state.watched.remove(pid) {
            state.exited.insert(*pid, *exit);
        }
    }
    EXITED.notify_all();
}

/// Waits until the main loop reaps any child, or `limit` passes.
pub fn wait_any(limit: std::time::Duration) {
    let guard = state();
    drop(EXITED.wait_timeout(guard, limit));
}

/// Waits for watched `pid` to exit, until `deadline` if there is one.
pub fn wait(pid: libc::pid_t, deadline: Option<Instant>) -> Option<Exit> {
    let mut guard = state();
    loop {
        if let Some(exit) = guard.as_mut().and_then(|s| s.exited.remove(&pid)) {
            return Some(exit);
        }
        guard = match deadline {
            None => EXITED.wait(guard).unwrap_or_else(|e| e.into_inner()),
            Some(deadline) => {
                let left = deadline.checked_duration_since(Instant::now())?;
                EXITED
                    .wait_timeout(guard, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
        };
    }
}
