//! Named volumes: directories the daemon keeps, which sandboxes mount
//! (one or several at once, one after another) and which outlive them.

use serde::{Deserialize, Serialize};

/// The owner (uid and gid) of the host directories husk itself gives
/// sandboxes to write (named volumes, a pod's emptyDir) and of everything
/// guests make in them: the id just below the jails' range
/// (`husk_jailer::UID_BASE`), neither root nor any jail's uid, so a jailed
/// VMM gets them, idmapped, as its own.
pub const VOLUME_OWNER: u32 = 199_999;

/// A volume create request.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeRequest {
    /// Its name: 1-63 characters of `[a-z0-9._-]`, starting with a letter
    /// or digit, unique among the daemon's volumes.
    pub name: String,
}

/// A volume, as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeInfo {
    /// Its id (`vol-...`).
    pub id: String,
    /// Its name.
    pub name: String,
    /// When it was made, in ms since the epoch.
    pub created_unix_ms: u64,
    /// The sandboxes that have it mounted now (a volume is deleted only
    /// when none has).
    #[serde(default)]
    pub mounted_by: Vec<String>,
}

/// Checks a volume's name (the rule template names follow).
pub fn check_volume_name(name: &str) -> Result<(), String> {
    crate::check_template_name(name).map_err(|_| {
        format!(
            "volume name `{name}`: use 1-63 characters of [a-z0-9._-], starting with a letter or digit"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MountSpec;

    #[test]
    fn volume_names_follow_the_template_rule() {
        assert!(check_volume_name("cache-1.v2").is_ok());
        for bad in ["", "-x", "Big", "a/b", &"x".repeat(64)] {
            let err = check_volume_name(bad).expect_err(bad);
            assert!(err.starts_with("volume name"), "{err}");
        }
    }

    #[test]
    fn a_volume_mount_names_the_volume_not_a_host_path() {
        let m = MountSpec::parse_volume("cache:/home/user/.cache:ro").expect("parse");

        assert_eq!(m.volume.as_deref(), Some("cache"));
        assert_eq!(
            (m.host.as_str(), m.guest.as_str()),
            ("", "/home/user/.cache")
        );
        assert!(m.readonly);
        assert!(MountSpec::parse_volume("/srv/x:/mnt").is_err());
        assert!(MountSpec::parse_volume("cache:relative").is_err());
    }
}
