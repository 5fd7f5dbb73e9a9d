//! Named secrets: values the daemon keeps for the egress proxy to put into
//! sandboxes' requests (`${husk.secrets.NAME}` in a credential's value),
//! resolved per request, never shown and never written into a guest.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// How a credential's value names a secret: `${husk.secrets.NAME}`.
pub const SECRET_PLACEHOLDER: &str = "${husk.secrets.";
/// Most bytes of a secret's value.
pub const MAX_SECRET_VALUE: usize = 16 << 10;

/// A secret create or update request. Its value is write-only.
#[derive(Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretRequest {
    /// Its name (a create's; unique among the daemon's secrets).
    #[serde(default)]
    pub name: Option<String>,
    /// Its value: one line of at most 16 KiB.
    pub value: String,
    /// The caller's metadata (replaced whole when given).
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
}

impl std::fmt::Debug for SecretRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretRequest")
            .field("name", &self.name)
            .field("metadata", &self.metadata)
            .finish_non_exhaustive()
    }
}

/// A secret as the API shows it: never its value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretInfo {
    /// Its id (`sec-...`).
    pub id: String,
    /// Its name.
    pub name: String,
    /// Its value's version: 1 when made, one more at each update.
    pub version: u32,
    /// The caller's metadata.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// When it was made, in ms since the epoch.
    pub created_unix_ms: u64,
    /// When its value or metadata last changed, in ms since the epoch.
    pub updated_unix_ms: u64,
}

/// Checks a secret's name: 1-128 bytes, no `{`, `}`, `/` or control
/// characters (it goes inside a placeholder).
pub fn check_secret_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 128 {
        return Err(format!(
            "a secret's name has 1 to 128 bytes, not {}",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| matches!(c, '{' | '}' | '/') || c.is_control() || c.is_whitespace())
    {
        return Err(format!(
            "the secret name `{}` has {c:?}, which a placeholder cannot carry",
            name.escape_debug()
        ));
    }
    Ok(())
}

/// Checks a secret's value: one non-empty line of at most
/// [`MAX_SECRET_VALUE`] bytes (it goes into a header).
pub fn check_secret_value(value: &str) -> Result<(), String> {
    if value.is_empty() || value.len() > MAX_SECRET_VALUE {
        return Err(format!(
            "a secret's value has 1 to {MAX_SECRET_VALUE} bytes, not {}",
            value.len()
        ));
    }
    if value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
        return Err("a secret's value is one line (it goes into a request header)".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_values_that_cannot_be_placed_are_refused() {
        assert!(check_secret_name("openai-api-key").is_ok());
        for bad in ["", "a}b", "a{b", "a/b", "a\nb", "a b", &"x".repeat(129)] {
            assert!(check_secret_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_secret_value("sk-123").is_ok());
        for bad in ["", "a\r\nX-Evil: 1", "a\0"] {
            assert!(check_secret_value(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_request_never_prints_its_value() {
        let req = SecretRequest {
            name: Some("k".into()),
            value: "very-secret".into(),
            metadata: None,
        };
        assert!(!format!("{req:?}").contains("very-secret"));
    }
}
