//! husk-types: the serde types every party to husk's API shares: the
//! daemon's core and front-ends, and every client (the CLI, the containerd
//! shim, the bench, an embedding program). No I/O, no policy: what goes
//! over the wire, and its JSON shape.

#![deny(missing_docs)]

mod audit;
mod exec;
mod process;
mod sandbox;
mod secret;
mod template;
mod volume;

pub use audit::AuditEntry;
pub use exec::{ExecEvent, ExecSpec};
/// A guest file's metadata and a directory's entries, as the agent gives them.
pub use husk_protocol::{DirEntry, FileKind, FileStat};
/// A guest's health and a watched directory's changes, as the agent gives them.
pub use husk_protocol::{FsEvent, FsEventKind, Health};
pub use process::{
    signal_number, OutputMatch, ProcessEvent, ProcessExit, ProcessInfo, ProcessSpec, SignalName,
    SignalRequest, TerminalSize, SIGNALS,
};
pub use sandbox::{
    CreateRequest, Created, EgressSpec, ExpiryPolicy, ForkRequest, Forked, IdleAction, IdlePolicy,
    Killed, MountSpec, PodNetworkInfo, PodNetworkRequest, PoolInfo, PoolSize, PortInfo,
    SandboxInfo, SandboxState, SandboxUpdate, SecretSpec, SnapshotRequest,
};
pub use secret::{
    check_secret_name, check_secret_value, SecretInfo, SecretRequest, MAX_SECRET_VALUE,
    SECRET_PLACEHOLDER,
};
pub use template::{
    check_template_name, drive_slot_id, fs_slot_id, BuildEvent, ImageConfig, KernelSource,
    MediumInfo, MediumRequest, RootfsSource, TemplateRecord, TemplateSpec, UploadInfo,
    MAX_DRIVE_SLOTS, MAX_FS_SLOTS,
};
pub use volume::{check_volume_name, VolumeInfo, VolumeRequest, VOLUME_OWNER};
