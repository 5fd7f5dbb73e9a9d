//! Entry points for fuzzing what a guest controls in the core (see
//! `husk_server::fuzz` and `tests/fuzz.rs`): each takes arbitrary bytes and
//! must neither panic nor hang.

/// What a guest sends its egress proxy: a request head (and the TLS
/// ClientHello after a CONNECT), and allowlist entries as an operator
/// writes them.
pub fn egress_requests(data: &[u8]) {
    let _ = crate::egress::parse(data);
    let _ = crate::egress::read_hello(data);
    // The same bytes as a request inside a tunnel the proxy opens.
    let _ = crate::egress::intercept::parse_inner(data, "api.example.com", 443);
    if let Ok(text) = std::str::from_utf8(data) {
        let entries: Vec<String> = text.lines().map(str::to_owned).collect();
        if let Ok(list) = crate::egress::Allowlist::parse(&entries) {
            for host in text.split_whitespace() {
                let _ = list.allows(host, 443);
            }
        }
    }
}
