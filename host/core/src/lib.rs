//! husk-core: the embeddable host layer. It never links KVM code: it starts
//! `husk-vmm` processes (each in its jail, see `husk-jailer`) and talks to
//! them through their control socket (`husk-vmm-api`) and to their guests
//! through guest-init's agent (`husk-agent-client`). No HTTP: the REST, E2B
//! and MCP front-ends (`husk-server`) are translations onto its calls.
//!
//! - [`daemon`]: templates, sandboxes and warm pools, their limits, and
//!   the background work (VMM exits, time to live, pool refills), given a
//!   [`config::DaemonConfig`];
//! - [`store`]: the state in SQLite, with the audit log;
//! - [`template`], [`rootfs`]: template builds, checksums, root file
//!   system images from a directory or a tar archive; [`upload`]: files
//!   a client streams in for a build (no client names a host path);
//! - [`vmm_process`]: one husk-vmm process (start, find again, stop);
//!   [`cgroup`]: its memory, CPU and pid limits (cgroup v2 or v1);
//! - [`egress`]: the per-sandbox egress proxy, and its TLS interception
//!   for hosts a sandbox holds credentials for;
//! - [`sandbox`]: a handle on one sandbox (exec, files, pause, snapshot,
//!   fork, destroy) that keeps its agent connection and audits each call;
//! - [`metrics`]: counters and histograms, rendered as Prometheus text.
//!
//! The wire types (create requests, sandbox and template records, exec
//! events) are `husk-types`'.

#![deny(missing_docs)]

pub mod archive;
pub mod cgroup;
pub mod config;
pub mod daemon;
pub mod egress;
#[doc(hidden)]
pub mod fuzz;
mod ids;
pub mod metrics;
pub mod oci;
pub mod rootfs;
pub mod sandbox;
pub mod store;
pub mod template;
pub mod upload;
pub mod vmm_process;
