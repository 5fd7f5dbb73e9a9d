//! husk's host layer. It never links KVM code: it starts `husk-vmm`
//! processes and talks to them through their control socket
//! (`husk-vmm-api`) and to their guests through guest-init's agent.
//!
//! - [`agent_client`]: a typed client of the guest agent over the VMM's
//!   vsock socket;
//! - [`readiness`]: how long to wait for a guest that boots or restores,
//!   counted in the CPU share the host can give it.
//!
//! The `husk` command line is `src/bin/husk.rs`.

pub mod agent_client;
pub mod readiness;
