//! Rate limits for a VM's devices, as `husk-vmm --block-limit` and
//! `--net-limit` take them (`bytes=N[K|M|G],ops=N`, per second): shared with
//! the host layer, which checks a template's limits when it is built and
//! passes them to every VMM of the template.

/// The limits a device is given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    pub bytes_per_s: Option<u64>,
    pub ops_per_s: Option<u64>,
}

impl Limits {
    pub fn is_unlimited(&self) -> bool {
        self.bytes_per_s.is_none() && self.ops_per_s.is_none()
    }
}

impl std::fmt::Display for Limits {
    /// The form [`parse_limits`] reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = [("bytes", self.bytes_per_s), ("ops", self.ops_per_s)]
            .iter()
            .filter_map(|(k, v)| v.map(|v| format!("{k}={v}")))
            .collect();
        f.write_str(&parts.join(","))
    }
}

/// Parses `bytes=N[K|M|G],ops=N` (per second; either may be left out).
pub fn parse_limits(text: &str) -> Result<Limits, String> {
    let mut limits = Limits::default();
    for part in text.split(',').filter(|p| !p.is_empty()) {
        let (key, value) = part
            .split_once('=')
            .ok_or_else(|| format!("`{part}`: expected bytes=N or ops=N"))?;
        let (digits, unit) = match value.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
            Some((i, _)) => value.split_at(i),
            None => (value, ""),
        };
        let n: u64 = digits
            .parse()
            .map_err(|_| format!("`{part}`: `{value}` is not a number"))?;
        let scale: u64 = match unit {
            "" => 1,
            "K" | "k" => 1 << 10,
            "M" | "m" => 1 << 20,
            "G" | "g" => 1 << 30,
            _ => return Err(format!("`{part}`: unknown unit `{unit}` (K, M or G)")),
        };
        let n = n
            .checked_mul(scale)
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("`{part}`: must be between 1 and 2^64"))?;
        match key {
            "bytes" => limits.bytes_per_s = Some(n),
            "ops" if unit.is_empty() => limits.ops_per_s = Some(n),
            _ => return Err(format!("`{part}`: expected bytes=N[K|M|G] or ops=N")),
        }
    }
    if limits.is_unlimited() {
        return Err(format!("`{text}`: give bytes=N, ops=N or both"));
    }
    Ok(limits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_parse_with_units_and_bad_ones_are_named() {
        assert_eq!(
            parse_limits("bytes=10M,ops=500"),
            Ok(Limits {
                bytes_per_s: Some(10 << 20),
                ops_per_s: Some(500)
            })
        );
        assert_eq!(
            parse_limits("bytes=4096"),
            Ok(Limits {
                bytes_per_s: Some(4096),
                ops_per_s: None
            })
        );
        for bad in [
            "",
            "bytes=0",
            "bytes=10X",
            "ops=5K",
            "speed=1",
            "bytes",
            "bytes=99999999999G",
        ] {
            assert!(parse_limits(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn limits_print_as_they_parse() {
        for text in ["bytes=1048576,ops=10", "ops=3", "bytes=7"] {
            assert_eq!(
                parse_limits(text).map(|l| l.to_string()).as_deref(),
                Ok(text)
            );
        }
    }
}
