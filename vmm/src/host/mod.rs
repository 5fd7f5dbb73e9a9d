//! The thin host layer: clients of the guest agent (and, later, sandbox
//! lifecycle, pools and the API).

pub mod agent_client;
pub mod readiness;
