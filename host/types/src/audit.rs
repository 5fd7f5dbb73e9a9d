//! The audit log.

use serde::{Deserialize, Serialize};

/// One entry of the audit log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// Its place in the log (gapless, increasing).
    pub seq: i64,
    /// When, in ms since the epoch.
    pub unix_ms: u64,
    /// Who asked: the caller identity the front-end passed (peer uid and pid, TCP address, E2B key, MCP session).
    pub who: String,
    /// What was done (`create`, `exec`, `upload`, `template-build`...).
    pub action: String,
    /// The sandbox it was done to, if any.
    pub sandbox: Option<String>,
    /// The template it was done to, if any.
    pub template: Option<String>,
    /// What else says what was done (a command line, a path).
    pub detail: String,
}
