//! Entry points for fuzzing what a guest or an API client controls on the
//! host: each takes arbitrary bytes and must neither panic nor hang.
//! `tests/fuzz.rs` runs them over `vmm/fuzz/corpus/` and mutations of it on
//! every test run; `cargo fuzz` (nightly, `vmm/fuzz`) can drive them too.

/// Agent protocol frames as either end reads them from its peer: a stream
/// of length-prefixed postcard frames, read until it ends or breaks.
pub fn agent_frames(data: &[u8]) {
    let mut stream = data;
    for _ in 0..1024 {
        match husk_protocol::read_frame(&mut stream) {
            Ok(frame) => {
                // What the client does with a reply: name and re-encode it.
                let _ = format!("{:?}", frame.body);
                let _ = husk_protocol::write_frame(&mut std::io::sink(), &frame);
            }
            Err(husk_protocol::ProtocolError::Closed) => return,
            // A frame that does not decode is answered and the stream goes
            // on, unless its length cannot be trusted.
            Err(husk_protocol::ProtocolError::Malformed(_)) => {}
            Err(_) => return,
        }
    }
}

/// The daemon's request bodies and query strings.
pub fn api_requests(data: &[u8]) {
    let _ = serde_json::from_slice::<crate::daemon::CreateRequest>(data).map(|r| {
        let _ = crate::egress::Allowlist::parse(&r.egress.allow);
    });
    let _ = serde_json::from_slice::<crate::template::TemplateSpec>(data);
    let _ = serde_json::from_slice::<crate::api::ExecSpec>(data);
    let _ = serde_json::from_slice::<crate::daemon::SandboxUpdate>(data);
    if let Ok(query) = std::str::from_utf8(data) {
        let _ = crate::api::form_pairs(query);
        let _ = crate::api::list_filter(Some(query));
        let _ = husk_vmm_api::limits::parse_limits(query);
    }
}

/// What a guest sends its egress proxy: a request head (and the TLS
/// ClientHello after a CONNECT), and allowlist entries as an operator
/// writes them.
pub fn egress_requests(data: &[u8]) {
    let _ = crate::egress::parse(data);
    let _ = crate::egress::sni(data);
    // The same bytes as a request inside a tunnel the proxy opens.
    let _ = crate::intercept::parse_inner(data, "api.example.com", 443);
    if let Ok(text) = std::str::from_utf8(data) {
        let entries: Vec<String> = text.lines().map(str::to_owned).collect();
        if let Ok(list) = crate::egress::Allowlist::parse(&entries) {
            for host in text.split_whitespace() {
                let _ = list.allows(host, 443);
            }
        }
    }
}
