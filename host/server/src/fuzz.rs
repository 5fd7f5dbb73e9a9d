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
    let _ = serde_json::from_slice::<husk_types::CreateRequest>(data).map(|r| {
        let _ = husk_core::egress::Allowlist::parse(&r.egress.allow);
    });
    let _ = serde_json::from_slice::<husk_types::TemplateSpec>(data);
    let _ = serde_json::from_slice::<husk_types::ExecSpec>(data);
    let _ = serde_json::from_slice::<husk_types::SandboxUpdate>(data);
    if let Ok(query) = std::str::from_utf8(data) {
        let _ = crate::api::form_pairs(query);
        let _ = crate::api::list_filter(Some(query));
        let _ = husk_vmm_api::limits::parse_limits(query);
    }
}

/// What a guest sends its egress proxy (husk-core's).
pub use husk_core::fuzz::egress_requests;
