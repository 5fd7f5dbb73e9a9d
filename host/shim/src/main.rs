//! `containerd-shim-husk-v2`: the containerd runtime `io.containerd.husk.v2`.
//! containerd starts it (`start`, `delete`, then as the task's server);
//! it runs each task in a sandbox of the husk daemon at `$HUSK_HOST` (or
//! the default socket). See `husk_shim` and docs/containerd.md.

fn main() {
    containerd_shim::run::<husk_shim::HuskShim>(husk_shim::RUNTIME_ID, None);
}
