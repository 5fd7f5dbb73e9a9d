//! Snapshots: what a paused VM is made of, written to a directory, and read
//! back with every check done before a guest runs.
//!
//! A snapshot directory holds:
//! - `state`: the [`MicrovmState`] (postcard) in the husk-snapshot framing
//!   (magic, format version, CRC-64), so a truncated, corrupt or foreign
//!   file is refused;
//! - `memory`: guest RAM, region after region, with all-zero pages left as
//!   holes, mapped copy-on-write by every restore (so it must never be
//!   rewritten while clones run);
//! - `drive-N`: the contents of writable drive N as a read-only layer (see
//!   `devices::virtio::block::disk`).
//!
//! Both are written under temporary names, fsynced, then renamed, `state`
//! last: a VMM killed mid-snapshot leaves no directory that restores as if
//! it were complete.
//!
//! A diff snapshot's `memory` holds only the pages written since the
//! snapshot it names as its base (KVM's dirty log for the guest's writes,
//! the VMM's bitmap for its own), at their offsets in an otherwise sparse
//! file. A restore maps the base's memory (itself possibly a diff, up to
//! [`MAX_CHAIN`] deep) and the diff's pages over it.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::vstate::memory::GuestMemoryMmap;
use serde::{Deserialize, Serialize};

use crate::devices::serial::SerialSnapshot;
use crate::devices::virtio::block::DiskSnapshot;
use crate::devices::virtio::mmio::TransportSnapshot;
use crate::vstate::vcpu_state::VcpuState;
use crate::vstate::vm::VmState;

pub const STATE_FILE: &str = "state";
pub const MEMORY_FILE: &str = "memory";
/// Longest chain of diff snapshots a restore follows.
pub const MAX_CHAIN: usize = 16;

/// What a snapshot's memory file holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemoryLayout {
    /// All of guest RAM.
    Full,
    /// Only `runs` (file offset, length): the pages written since the
    /// snapshot in `base` (an absolute path), which holds the rest.
    /// `crc64` is the runs' bytes' CRC-64, in order ([`write`] fills it in):
    /// a restore asked to verify (husk-vmm --verify) checks it.
    Diff {
        base: PathBuf,
        runs: Vec<(u64, u64)>,
        crc64: u64,
    },
}

/// One memory file of a restore, base first: all of it (`runs: None`) or
/// only its runs over what came before.
#[derive(Debug)]
pub struct MemoryLayer {
    pub file: File,
    pub runs: Option<Vec<(u64, u64)>>,
}

/// Which device a transport carried.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SavedDevice {
    /// virtio-vsock; the CID is the snapshotted VM's (a clone gets its own).
    Vsock { cid: u64 },
    /// virtio-block: the drive's name and the files its contents are in.
    Block { id: String, disk: DiskSnapshot },
    /// virtio-net; the MAC is the snapshotted VM's (a clone gets its own,
    /// and its own TAP).
    Net { mac: [u8; 6] },
    /// virtio-fs: the share's tag. Its directory is the clone's to give
    /// (the guest had none mounted: a mounted share does not snapshot).
    Fs { tag: String },
    /// virtio-balloon (free page reporting), with the pages its driver
    /// said it held.
    Balloon { actual: u32 },
}

#[derive(Debug, Serialize, Deserialize)]
pub struct DeviceSnapshot {
    pub device: SavedDevice,
    pub transport: TransportSnapshot,
}

/// Everything but guest RAM.
#[derive(Debug, Serialize, Deserialize)]
pub struct MicrovmState {
    pub id: String,
    pub mem_size_mib: u32,
    /// Whether the guest was set up for an emulating (PVM) host; a
    /// snapshot only restores on the same kind of host.
    pub pvm: bool,
    pub vm: VmState,
    pub vcpus: Vec<VcpuState>,
    pub serial: SerialSnapshot,
    pub memory: MemoryLayout,
    /// In MMIO slot order.
    pub devices: Vec<DeviceSnapshot>,
}

/// Errors writing or reading a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error(
        "{0} already holds a snapshot (snapshots are never overwritten: clones may map its memory)"
    )]
    Exists(PathBuf),
    #[error("{0} holds no snapshot state file ({STATE_FILE})")]
    NoState(PathBuf),
    #[error("cannot {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("snapshot state {path}: {source}")]
    Format {
        path: PathBuf,
        source: husk_snapshot::SnapshotError,
    },
    #[error("snapshot state {0} does not decode (written by another husk?): {1}")]
    Decode(PathBuf, postcard::Error),
    #[error("cannot encode the snapshot state: {0}")]
    Encode(postcard::Error),
    #[error("snapshot memory {path} holds {found} bytes, the state says {expected}")]
    MemorySize {
        path: PathBuf,
        found: u64,
        expected: u64,
    },
    #[error("diff snapshot {dir}: its base {base} {problem}")]
    Base {
        dir: PathBuf,
        base: PathBuf,
        problem: String,
    },
    #[error(
        "the snapshot's guest was offered CPU features this host cannot offer ({0}): restore it on \
         a host that has them"
    )]
    CpuFeatures(String),
    #[error(
        "snapshot memory {0} does not hold what was written there (its pages' CRC-64 differs): \
         the snapshot is corrupt and cannot restore"
    )]
    MemoryChecksum(PathBuf),
    #[error("the snapshot was taken on {taken} and cannot restore on {here}")]
    HostKind {
        taken: &'static str,
        here: &'static str,
    },
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> PersistError + 'a {
    move |source| PersistError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// How long each part of writing a snapshot took.
#[derive(Debug, Clone, Copy, Default)]
pub struct WriteTimes {
    pub memory: Duration,
    /// Guest memory bytes written (all of it, or a diff's pages).
    pub memory_bytes: u64,
    pub state: Duration,
    pub state_bytes: usize,
}

/// Creates `dir` if missing and checks it holds no snapshot yet (devices
/// write their own files into it before [`write`]).
pub fn prepare(dir: &Path) -> Result<(), PersistError> {
    std::fs::create_dir_all(dir).map_err(io("create", dir))?;
    if dir.join(STATE_FILE).exists() || dir.join(MEMORY_FILE).exists() {
        return Err(PersistError::Exists(dir.to_path_buf()));
    }
    Ok(())
}

/// Writes `state` and `mem` to `dir` (created if missing).
pub fn write(
    dir: &Path,
    state: &mut MicrovmState,
    mem: &GuestMemoryMmap,
) -> Result<WriteTimes, PersistError> {
    prepare(dir)?;
    let state_path = dir.join(STATE_FILE);
    let memory_path = dir.join(MEMORY_FILE);
    let tag = std::process::id();
    let memory_tmp = dir.join(format!(".{MEMORY_FILE}.{tag}.tmp"));
    let state_tmp = dir.join(format!(".{STATE_FILE}.{tag}.tmp"));
    let result = (|| {
        let started = Instant::now();
        let file = File::create(&memory_tmp).map_err(io("create", &memory_tmp))?;
        match &mut state.memory {
            MemoryLayout::Full => crate::vstate::memory::dump(mem, &file),
            MemoryLayout::Diff { runs, crc64, .. } => {
                crate::vstate::memory::dump_runs(mem, &file, runs).map(|crc| *crc64 = crc)
            }
        }
        .map_err(io("write", &memory_tmp))?;
        file.sync_all().map_err(io("sync", &memory_tmp))?;
        let memory = started.elapsed();

        let started = Instant::now();
        let bytes = postcard::to_stdvec(state).map_err(PersistError::Encode)?;
        let mut file = File::create(&state_tmp).map_err(io("create", &state_tmp))?;
        husk_snapshot::write_snapshot(&mut file, &bytes).map_err(|source| {
            PersistError::Format {
                path: state_tmp.clone(),
                source,
            }
        })?;
        file.flush().map_err(io("write", &state_tmp))?;
        file.sync_all().map_err(io("sync", &state_tmp))?;
        std::fs::rename(&memory_tmp, &memory_path).map_err(io("rename", &memory_tmp))?;
        std::fs::rename(&state_tmp, &state_path).map_err(io("rename", &state_tmp))?;
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io("sync", dir))?;
        let memory_bytes = match &state.memory {
            MemoryLayout::Full => u64::from(state.mem_size_mib) << 20,
            MemoryLayout::Diff { runs, .. } => runs.iter().map(|r| r.1).sum(),
        };
        Ok(WriteTimes {
            memory,
            memory_bytes,
            state: started.elapsed(),
            state_bytes: bytes.len(),
        })
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&memory_tmp);
        let _ = std::fs::remove_file(&state_tmp);
    }
    result
}

/// A snapshot as a restore reads it.
#[derive(Debug)]
pub struct Restorable {
    pub state: MicrovmState,
    /// Its memory files, base first.
    pub layers: Vec<MemoryLayer>,
    /// The directory of the full memory file the chain starts from (`dir`
    /// itself for a full snapshot).
    pub root: PathBuf,
}

/// Reads and checks `dir`'s state and opens its memory files (its own and,
/// for a diff, its bases'). Nothing here reads guest memory: the cost does
/// not grow with the guest's size.
pub fn read(dir: &Path) -> Result<Restorable, PersistError> {
    let (state, file) = read_one(dir)?;
    let mut layers = Vec::new();
    let mut layout = state.memory.clone();
    let mut current = dir.to_path_buf();
    let mut top = Some(file);
    loop {
        match layout {
            MemoryLayout::Full => {
                layers.push(MemoryLayer {
                    file: top
                        .take()
                        .map_or_else(|| read_one(&current).map(|(_, f)| f), Ok)?,
                    runs: None,
                });
                break;
            }
            MemoryLayout::Diff { base, runs, .. } => {
                let file = top
                    .take()
                    .map_or_else(|| read_one(&current).map(|(_, f)| f), Ok)?;
                layers.push(MemoryLayer {
                    file,
                    runs: Some(runs),
                });
                let problem = |problem: String| PersistError::Base {
                    dir: current.clone(),
                    base: base.clone(),
                    problem,
                };
                if layers.len() >= MAX_CHAIN {
                    return Err(problem(format!("makes a chain longer than {MAX_CHAIN}")));
                }
                let (base_state, base_file) =
                    read_one(&base).map_err(|e| problem(format!("cannot be used: {e}")))?;
                if base_state.mem_size_mib != state.mem_size_mib {
                    return Err(problem(format!(
                        "has {} MiB of memory, the diff {}",
                        base_state.mem_size_mib, state.mem_size_mib
                    )));
                }
                current = base;
                layout = base_state.memory;
                top = Some(base_file);
            }
        }
    }
    layers.reverse();
    Ok(Restorable {
        state,
        layers,
        root: current,
    })
}

/// Checks a diff snapshot's own pages against the checksum written with
/// them (reads them: the cost grows with what the diff holds, not with the
/// guest's size). A full snapshot's memory is not checked here (a
/// template's files have their own checksums in the host layer).
pub fn verify_memory(dir: &Path, restorable: &Restorable) -> Result<(), PersistError> {
    let (MemoryLayout::Diff { runs, crc64, .. }, Some(top)) =
        (&restorable.state.memory, restorable.layers.last())
    else {
        return Ok(());
    };
    let path = dir.join(MEMORY_FILE);
    let found = crate::vstate::memory::runs_crc(&top.file, runs).map_err(io("read", &path))?;
    if found != *crc64 {
        return Err(PersistError::MemoryChecksum(path));
    }
    Ok(())
}

/// Reads one directory's state and opens its memory file.
fn read_one(dir: &Path) -> Result<(MicrovmState, File), PersistError> {
    let state_path = dir.join(STATE_FILE);
    let memory_path = dir.join(MEMORY_FILE);
    let mut file = match File::open(&state_path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(PersistError::NoState(dir.to_path_buf()))
        }
        other => other.map_err(io("open", &state_path))?,
    };
    let (_, bytes) =
        husk_snapshot::read_snapshot(&mut file).map_err(|source| PersistError::Format {
            path: state_path.clone(),
            source,
        })?;
    let state: MicrovmState =
        postcard::from_bytes(&bytes).map_err(|e| PersistError::Decode(state_path.clone(), e))?;
    let memory = File::open(&memory_path).map_err(io("open", &memory_path))?;
    let found = memory.metadata().map_err(io("stat", &memory_path))?.len();
    let expected = u64::from(state.mem_size_mib) << 20;
    if found != expected {
        return Err(PersistError::MemorySize {
            path: memory_path,
            found,
            expected,
        });
    }
    if let MemoryLayout::Diff { runs, .. } = &state.memory {
        let page = 4096;
        let bad = runs.iter().any(|&(off, len)| {
            off % page != 0
                || len % page != 0
                || len == 0
                || off.checked_add(len).is_none_or(|end| end > expected)
        });
        if bad {
            return Err(PersistError::Format {
                path: state_path,
                source: husk_snapshot::SnapshotError::Truncated(
                    "a diff run lies outside guest memory",
                ),
            });
        }
    }
    Ok((state, memory))
}

/// Saves `part`, encodes and decodes the state as a snapshot does, restores
/// a new part from it with `args` and saves that: returns both states.
#[cfg(test)]
pub(crate) fn round_trip<P>(part: &P, args: P::ConstructorArgs) -> (P::State, P::State)
where
    P: husk_snapshot::Persist,
    P::Error: std::fmt::Debug,
{
    let state = part.save();
    let bytes = postcard::to_stdvec(&state).expect("encode");
    let decoded: P::State = postcard::from_bytes(&bytes).expect("decode");
    let restored = P::restore(args, &decoded).expect("restore");
    (state, restored.save())
}

/// The snapshot conformance test every [`husk_snapshot::Persist`] part
/// runs (crosvm's shared suspendable test): `$part` saved, encoded,
/// decoded and restored into a new part built from `$args` saves the same
/// state again.
#[cfg(test)]
macro_rules! persist_conformance {
    ($test:ident, $part:expr, $args:expr) => {
        #[test]
        fn $test() {
            let part = $part;

            let (saved, resaved) = crate::persist::round_trip(&part, $args);

            assert_eq!(saved, resaved);
        }
    };
}
#[cfg(test)]
pub(crate) use persist_conformance;
