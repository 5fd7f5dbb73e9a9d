//! A sandbox's guest as its agent reports it: whether it answers, its
//! clock, memory and load, and changes under a directory as they happen.

use husk_protocol::{FsEvent, Health};

use super::*;

impl Daemon {
    /// The guest's uptime, clock, memory, load and process count (its
    /// agent answering).
    pub fn guest_health(&self, id: &str) -> Result<Health, DaemonError> {
        let mut agent = self.agent(id)?;
        let health = agent.health()?;
        self.give_back(id, agent);
        Ok(health)
    }

    /// Streams the changes under guest directory `dir` (and below it with
    /// `recursive`) to `on_events` until it answers false, or, while
    /// nothing changes, within a second of `wanted` answering false.
    pub fn watch_dir(
        &self,
        id: &str,
        dir: &str,
        recursive: bool,
        mut on_events: impl FnMut(&[FsEvent]) -> bool,
        wanted: impl Fn() -> bool,
    ) -> Result<(), DaemonError> {
        if !dir.starts_with('/') {
            return Err(DaemonError::Invalid(format!(
                "`{dir}` is not an absolute guest path"
            )));
        }
        let mut agent = self.agent(id)?;
        // Nothing bounds how long a directory stays quiet.
        agent.set_read_timeout(None)?;
        let mut watch = agent.watch(dir, recursive)?;
        if !on_events(&[]) {
            return Ok(());
        }
        loop {
            // Quiet: is anyone still watching? (The agent's watch ends
            // with the connection.)
            while !watch.wait(Duration::from_secs(1))? {
                if !wanted() {
                    return Ok(());
                }
            }
            if !on_events(&watch.next_events()?) {
                return Ok(());
            }
        }
    }
}
