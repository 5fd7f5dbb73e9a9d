//! husk-server: husk's front-ends, each a translation of its protocol onto
//! `husk-core` calls in the same process:
//!
//! - [`api`]: the REST API (`husk serve`), described by `host/openapi.json`;
//! - [`e2b`]: E2B's control plane and envd, so E2B's SDKs drive husk;
//! - [`mcp`]: the Model Context Protocol, on stdio (`husk mcp`) and over
//!   streamable HTTP at `/mcp`.

pub mod api;
pub mod e2b;
pub mod front;
#[doc(hidden)]
pub mod fuzz;
pub mod mcp;
pub mod peer;
