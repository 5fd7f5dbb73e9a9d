//! Ids of the host's objects: a prefix and random hex digits from the
//! kernel's randomness.

use std::io::Read;

/// `prefix`, a dash, and `bytes` random bytes in lowercase hex.
pub fn random_id(prefix: &str, bytes: usize) -> std::io::Result<String> {
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    let hex: String = buf.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("{prefix}-{hex}"))
}
