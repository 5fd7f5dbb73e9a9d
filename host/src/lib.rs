//! husk's host layer. It never links KVM code: it starts `husk-vmm`
//! processes and talks to them through their control socket
//! (`husk-vmm-api`) and to their guests through guest-init's agent.
//!
//! - [`daemon`]: templates, sandboxes and warm pools, their limits, and
//!   the background work (VMM exits, time to live, pool refills);
//! - [`api`]: the daemon's HTTP API (`husk serve`), and [`api_client`] a
//!   small blocking client of it (the CLI's);
//! - [`store`]: the daemon's state in SQLite, with the audit log;
//! - [`template`], [`rootfs`]: template builds, checksums, root file
//!   system images from a directory or a tar archive; [`upload`]: files
//!   a client streams in for a build (no client names a host path);
//! - [`vmm_process`]: one husk-vmm process (start, find again, stop);
//!   [`cgroup`]: its memory, CPU and pid limits (cgroup v2 or v1);
//!   [`jail`]: the namespaces, root, ids and rlimits it runs in
//!   (`husk-jailer`);
//! - [`egress`]: the per-sandbox egress proxy, and [`intercept`] its TLS
//!   for hosts a sandbox holds credentials for;
//! - [`mcp`]: `husk mcp`, the Model Context Protocol over stdio;
//! - [`metrics`]: Prometheus text at /metrics;
//! - [`agent_client`]: a typed client of the guest agent over the VMM's
//!   vsock socket;
//! - [`bench`]: `husk bench`, cold boot, restore and pooled create next to
//!   QEMU, per phase;
//! - [`shim`]: `containerd-shim-husk-v2`, the containerd runtime that runs
//!   each task in a sandbox of the daemon's;
//! - [`readiness`]: how long to wait for a guest that boots or restores,
//!   counted in the CPU share the host can give it.
//!
//! The `husk` command line is `src/bin/husk.rs`.

pub mod agent_client;
pub mod api;
pub mod api_client;
pub mod bench;
pub mod cgroup;
pub mod daemon;
pub mod e2b;
pub mod egress;
#[doc(hidden)]
pub mod fuzz;
pub mod intercept;
pub mod jail;
pub mod mcp;
pub mod metrics;
pub mod readiness;
pub mod rootfs;
pub mod shim;
pub mod store;
pub mod template;
pub mod upload;
pub mod vmm_process;
