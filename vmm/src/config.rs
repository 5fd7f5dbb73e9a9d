//! What one VM is made of, validated before anything touches KVM.

use std::fs::File;
use std::io::Write;
use std::path::PathBuf;

use linux_loader::cmdline::Cmdline;

use crate::arch::x86_64::layout::CMDLINE_MAX_SIZE;
use crate::devices::virtio::block::DiskMode;
use crate::devices::virtio::vsock::device::MIN_GUEST_CID;
use crate::vstate::memory::MemoryConfig;

pub use husk_vmm_api::cmdline::{BASE_CMDLINE, PVM_CMDLINE};

/// Largest vCPU count the MP table and 8-bit APIC ids allow.
pub const MAX_VCPUS: u8 = 254;
/// Smallest guest memory accepted: the boot structures and 1 MiB of legacy
/// space must fit. Whether the kernel fits is checked when it is loaded.
pub const MIN_MEM_MIB: u32 = 4;
/// Largest guest memory accepted (1 TiB).
pub const MAX_MEM_MIB: u32 = 1 << 20;

/// Most bytes a console file holds: past this it keeps the newer half.
pub const CONSOLE_FILE_MAX: u64 = 4 << 20;

/// Where the guest's serial console goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SerialOutput {
    Stdout,
    File(PathBuf),
    Null,
}

/// A virtio-block drive. Drives appear in the guest as /dev/vda, /dev/vdb, ...
/// in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriveConfig {
    pub path: PathBuf,
    pub mode: DiskMode,
    /// Serial number the guest reads (at most 20 bytes are used).
    pub id: String,
}

impl std::str::FromStr for DriveConfig {
    type Err = ConfigError;

    /// `path=FILE[,readonly][,overlay=FILE][,id=NAME]`; a bare `FILE` works too.
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| ConfigError::Drive(spec.to_owned(), why.to_owned());
        let mut path = None;
        let mut readonly = false;
        let mut overlay = None;
        let mut id = None;
        for (i, part) in spec.split(',').enumerate() {
            match part.split_once('=') {
                Some(("path", v)) => path = Some(PathBuf::from(v)),
                Some(("overlay", v)) => overlay = Some(PathBuf::from(v)),
                Some(("id", v)) => id = Some(v.to_owned()),
                None if part == "readonly" => readonly = true,
                None if i == 0 && !part.is_empty() => path = Some(PathBuf::from(part)),
                _ => return Err(bad(&format!("unknown option `{part}`"))),
            }
        }
        let path = path.ok_or_else(|| bad("no path"))?;
        let mode = match (readonly, overlay) {
            (true, Some(_)) => return Err(bad("readonly and overlay exclude each other")),
            (true, None) => DiskMode::ReadOnly,
            (false, Some(overlay)) => DiskMode::CopyOnWrite { overlay },
            (false, None) => DiskMode::ReadWrite,
        };
        let id = id.unwrap_or_else(|| {
            path.file_name()
                .map_or_else(|| "disk".to_owned(), |n| n.to_string_lossy().into_owned())
        });
        Ok(DriveConfig { path, mode, id })
    }
}

/// A shared host directory (virtio-fs), or an empty slot for one, as given
/// on the command line.
pub use crate::devices::virtio::fs::Share as FsConfig;

impl std::str::FromStr for FsConfig {
    type Err = ConfigError;

    /// `tag=TAG[,path=DIR][,ro][,owner=UID:GID[,guest-owner=UID:GID]][,hide=PATTERN]...`:
    /// without a path, an empty slot (a restore gives it a directory by its
    /// tag).
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let bad = |why: String| ConfigError::Fs(spec.to_owned(), why);
        let (mut tag, mut path, mut read_only, mut owner) = (None, None, false, None);
        let (mut guest_owner, mut hidden) = (None, Vec::new());
        for part in spec.split(',') {
            match part.split_once('=') {
                Some(("tag", v)) => tag = Some(v.to_owned()),
                Some(("path", v)) if !v.is_empty() => path = Some(PathBuf::from(v)),
                Some((key @ ("owner" | "guest-owner"), v)) => {
                    let ids = v
                        .split_once(':')
                        .and_then(|(u, g)| Some((u.parse().ok()?, g.parse().ok()?)))
                        .ok_or_else(|| bad(format!("{key} `{v}` is not UID:GID")))?;
                    match key {
                        "owner" => owner = Some(ids),
                        _ => guest_owner = Some(ids),
                    }
                }
                Some(("hide", v)) if !v.is_empty() => hidden.push(v.to_owned()),
                None if part == "ro" || part == "readonly" => read_only = true,
                _ => return Err(bad(format!("unknown option `{part}`"))),
            }
        }
        let tag = tag.ok_or_else(|| bad("no tag".into()))?;
        if guest_owner.is_some() && owner.is_none() {
            return Err(bad(
                "guest-owner is how the guest sees owner: give owner too".into(),
            ));
        }
        crate::devices::virtio::fs::check_tag(&tag).map_err(bad)?;
        Ok(FsConfig {
            tag,
            path,
            options: crate::devices::virtio::fs::ShareOptions {
                read_only,
                owner,
                guest_owner,
                hidden,
            },
        })
    }
}

/// The vsock device: the guest's CID and the host Unix socket it is
/// bridged to (see `devices::virtio::vsock::muxer`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockConfig {
    pub cid: u64,
    pub uds_path: PathBuf,
}

impl std::str::FromStr for VsockConfig {
    type Err = ConfigError;

    /// `cid=N,path=SOCKET`.
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let bad = |why: String| ConfigError::Vsock(spec.to_owned(), why);
        let (mut cid, mut path) = (None, None);
        for part in spec.split(',') {
            match part.split_once('=') {
                Some(("cid", v)) => {
                    cid = Some(
                        v.parse::<u64>()
                            .map_err(|_| bad(format!("`{v}` is not a number")))?,
                    )
                }
                Some(("path", v)) if !v.is_empty() => path = Some(PathBuf::from(v)),
                _ => return Err(bad(format!("unknown option `{part}`"))),
            }
        }
        let cid = cid.ok_or_else(|| bad("no cid".into()))?;
        if !(MIN_GUEST_CID..u64::from(u32::MAX)).contains(&cid) {
            return Err(bad(format!(
                "cid {cid} is reserved; use {MIN_GUEST_CID} to {}",
                u32::MAX - 1
            )));
        }
        let uds_path = path.ok_or_else(|| bad("no path".into()))?;
        Ok(VsockConfig { cid, uds_path })
    }
}

/// The virtio-net device: a TAP device and the guest's MAC address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    pub tap: String,
    pub mac: [u8; 6],
}

/// Locally administered, unicast: 06:00:48:55:53:4b ("HUSK").
pub const DEFAULT_MAC: [u8; 6] = [0x06, 0x00, 0x48, 0x55, 0x53, 0x4b];

impl std::str::FromStr for NetConfig {
    type Err = ConfigError;

    /// `tap=NAME[,mac=XX:XX:XX:XX:XX:XX]`.
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let bad = |why: String| ConfigError::Net(spec.to_owned(), why);
        let (mut tap, mut mac) = (None, DEFAULT_MAC);
        for part in spec.split(',') {
            match part.split_once('=') {
                Some(("tap", v)) if !v.is_empty() => tap = Some(v.to_owned()),
                Some(("mac", v)) => {
                    mac = parse_mac(v).ok_or_else(|| bad(format!("bad MAC `{v}`")))?
                }
                _ => return Err(bad(format!("unknown option `{part}`"))),
            }
        }
        if mac[0] & 1 != 0 {
            return Err(bad("the MAC is a multicast address".into()));
        }
        let tap = tap.ok_or_else(|| bad("no tap".into()))?;
        Ok(NetConfig { tap, mac })
    }
}

fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next()?;
        if part.len() != 2 {
            return None;
        }
        *byte = u8::from_str_radix(part, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// A VM's configuration.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// Sandbox id, on every log line.
    pub id: String,
    /// vmlinux ELF or bzImage.
    pub kernel: PathBuf,
    pub initramfs: Option<PathBuf>,
    /// Appended to the base command line; later parameters win.
    pub extra_cmdline: Option<String>,
    pub memory: MemoryConfig,
    pub vcpus: u8,
    /// Offer the host's VMX or SVM to the guest (hidden by default: a
    /// sandbox that runs its own hypervisor reaches the host's
    /// nested-virtualization code).
    pub nested_virt: bool,
    pub serial: SerialOutput,
    pub kvm_device: PathBuf,
    pub drives: Vec<DriveConfig>,
    /// Shared directories (and empty slots for them), in order.
    pub shares: Vec<FsConfig>,
    pub vsock: Option<VsockConfig>,
    pub net: Option<NetConfig>,
    /// A virtio-balloon device with free page reporting: memory the guest
    /// frees goes back to the host.
    pub balloon: bool,
    pub limits: DeviceLimits,
}

/// Rate limits for the devices (host policy, the same at boot and restore).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Each drive.
    pub block: crate::rate_limiter::Limits,
    /// The network device, each way.
    pub net: crate::rate_limiter::Limits,
}

/// Invalid configurations. The messages say what is accepted.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("the VM needs at least 1 vCPU")]
    ZeroVcpus,
    #[error("{0} vCPUs requested, at most {MAX_VCPUS} are supported")]
    TooManyVcpus(u8),
    #[error("{0} MiB of guest memory requested, at least {MIN_MEM_MIB} MiB are needed")]
    MemoryTooSmall(u32),
    #[error("{0} MiB of guest memory requested, at most {MAX_MEM_MIB} MiB are supported")]
    MemoryTooLarge(u32),
    #[error("the kernel command line would be {len} bytes, the limit is {} (COMMAND_LINE_SIZE); shorten --cmdline", CMDLINE_MAX_SIZE - 1)]
    CmdlineTooLong { len: usize },
    #[error("invalid kernel command line: {0}")]
    CmdlineInvalid(linux_loader::cmdline::Error),
    #[error("cannot open the kernel {0}: {1}")]
    Kernel(PathBuf, #[source] std::io::Error),
    #[error("cannot open the initramfs {0}: {1}")]
    Initramfs(PathBuf, #[source] std::io::Error),
    #[error("invalid drive `{0}`: {1}; expected path=FILE[,readonly][,overlay=FILE][,id=NAME]")]
    Drive(String, String),
    #[error("two drives are named `{0}`; give each its own id=NAME")]
    DuplicateDrive(String),
    #[error(
        "invalid shared directory `{0}`: {1}; expected tag=TAG[,path=DIR][,ro][,owner=UID:GID[,guest-owner=UID:GID]][,hide=PATTERN]..."
    )]
    Fs(String, String),
    #[error("two shared directories are tagged `{0}`")]
    DuplicateShare(String),
    #[error("invalid vsock `{0}`: {1}; expected cid=N,path=SOCKET")]
    Vsock(String, String),
    #[error("invalid net `{0}`: {1}; expected tap=NAME[,mac=XX:XX:XX:XX:XX:XX]")]
    Net(String, String),
    #[error("cannot open the serial output file {0}: {1}")]
    SerialFile(PathBuf, #[source] std::io::Error),
}

impl VmConfig {
    /// Checks the numbers; files are checked when they are opened.
    pub fn validate(&self) -> Result<(), ConfigError> {
        match self.vcpus {
            0 => return Err(ConfigError::ZeroVcpus),
            n if n > MAX_VCPUS => return Err(ConfigError::TooManyVcpus(n)),
            _ => {}
        }
        for (i, drive) in self.drives.iter().enumerate() {
            if self.drives[..i].iter().any(|d| d.id == drive.id) {
                return Err(ConfigError::DuplicateDrive(drive.id.clone()));
            }
        }
        for (i, share) in self.shares.iter().enumerate() {
            if self.shares[..i].iter().any(|s| s.tag == share.tag) {
                return Err(ConfigError::DuplicateShare(share.tag.clone()));
            }
        }
        match self.memory.size_mib {
            n if n < MIN_MEM_MIB => Err(ConfigError::MemoryTooSmall(n)),
            n if n > MAX_MEM_MIB => Err(ConfigError::MemoryTooLarge(n)),
            _ => Ok(()),
        }
    }

    /// The full kernel command line; `pvm` adds the PVM host flags. What
    /// follows ` -- ` in the extra arguments is kept as init's arguments, so
    /// devices added later still land before it.
    pub fn kernel_cmdline(&self, pvm: bool) -> Result<Cmdline, ConfigError> {
        let extra = self.extra_cmdline.as_deref().unwrap_or("").trim();
        let (boot_extra, init_args) = match extra.strip_prefix("--") {
            Some(rest) if rest.is_empty() || rest.starts_with(' ') => ("", rest.trim()),
            _ => extra
                .split_once(" -- ")
                .map_or((extra, ""), |(b, i)| (b.trim(), i.trim())),
        };
        let mut boot = vec![BASE_CMDLINE];
        if pvm {
            boot.push(PVM_CMDLINE);
        }
        if !boot_extra.is_empty() {
            boot.push(boot_extra);
        }
        let boot = boot.join(" ");
        let len = boot.len()
            + if init_args.is_empty() {
                0
            } else {
                init_args.len() + 4
            };
        if len >= CMDLINE_MAX_SIZE {
            return Err(ConfigError::CmdlineTooLong { len });
        }
        let mut cmdline = Cmdline::new(CMDLINE_MAX_SIZE).map_err(ConfigError::CmdlineInvalid)?;
        cmdline
            .insert_str(&boot)
            .map_err(ConfigError::CmdlineInvalid)?;
        if !init_args.is_empty() {
            cmdline
                .insert_init_args(init_args)
                .map_err(ConfigError::CmdlineInvalid)?;
        }
        Ok(cmdline)
    }

    /// Opens the kernel image.
    pub fn open_kernel(&self) -> Result<File, ConfigError> {
        File::open(&self.kernel).map_err(|e| ConfigError::Kernel(self.kernel.clone(), e))
    }

    /// Opens the initramfs, if there is one.
    pub fn open_initramfs(&self) -> Result<Option<File>, ConfigError> {
        self.initramfs
            .as_ref()
            .map(|p| File::open(p).map_err(|e| ConfigError::Initramfs(p.clone(), e)))
            .transpose()
    }

    /// Opens the serial console's destination.
    pub fn open_serial(&self) -> Result<Box<dyn Write + Send>, ConfigError> {
        self.serial.open()
    }
}

impl SerialOutput {
    /// Opens the destination.
    pub fn open(&self) -> Result<Box<dyn Write + Send>, ConfigError> {
        Ok(match self {
            SerialOutput::Stdout => Box::new(std::io::stdout()),
            SerialOutput::Null => Box::new(std::io::sink()),
            SerialOutput::File(path) => Box::new(
                crate::devices::serial::ConsoleFile::open(path, CONSOLE_FILE_MAX)
                    .map_err(|e| ConfigError::SerialFile(path.clone(), e))?,
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> VmConfig {
        VmConfig {
            id: "t".into(),
            kernel: "/k".into(),
            initramfs: None,
            extra_cmdline: None,
            memory: MemoryConfig {
                size_mib: 128,
                prefault: true,
                hugepages: false,
            },
            vcpus: 1,
            nested_virt: false,
            serial: SerialOutput::Null,
            kvm_device: "/dev/kvm".into(),
            drives: vec![],
            shares: vec![],
            vsock: None,
            net: None,
            balloon: false,
            limits: DeviceLimits::default(),
        }
    }

    #[test]
    fn net_specs_parse() {
        let n: NetConfig = "tap=tap0,mac=02:00:00:00:00:07".parse().expect("valid");
        let d: NetConfig = "tap=tap1".parse().expect("valid");

        assert_eq!(
            n,
            NetConfig {
                tap: "tap0".into(),
                mac: [2, 0, 0, 0, 0, 7]
            }
        );
        assert_eq!(d.mac, DEFAULT_MAC);
        for spec in [
            "",
            "tap=",
            "tap=t,mac=01:00:00:00:00:00",
            "tap=t,mac=zz:00:00:00:00:00",
            "tap=t,mac=02:00:00:00:00",
            "mac=02:00:00:00:00:01",
        ] {
            assert!(
                matches!(spec.parse::<NetConfig>(), Err(ConfigError::Net(..))),
                "{spec}"
            );
        }
    }

    #[test]
    fn vsock_specs_parse_and_reserved_cids_are_refused() {
        let v: VsockConfig = "cid=3,path=/run/v.sock".parse().expect("valid");

        assert_eq!(
            v,
            VsockConfig {
                cid: 3,
                uds_path: "/run/v.sock".into()
            }
        );
        for spec in [
            "cid=2,path=/x",
            "cid=4294967295,path=/x",
            "cid=x,path=/x",
            "cid=5",
            "path=/x",
            "cid=5,path=/x,z=1",
        ] {
            assert!(
                matches!(spec.parse::<VsockConfig>(), Err(ConfigError::Vsock(..))),
                "{spec}"
            );
        }
    }

    #[test]
    fn drive_specs_parse() {
        let rw: DriveConfig = "/img/root.ext4".parse().expect("bare path");
        let ro: DriveConfig = "path=/img/a,readonly,id=data".parse().expect("readonly");
        let cow: DriveConfig = "path=/img/base,overlay=/run/o".parse().expect("cow");

        assert_eq!(
            rw,
            DriveConfig {
                path: "/img/root.ext4".into(),
                mode: DiskMode::ReadWrite,
                id: "root.ext4".into()
            }
        );
        assert_eq!(ro.mode, DiskMode::ReadOnly);
        assert_eq!(ro.id, "data");
        assert_eq!(
            cow.mode,
            DiskMode::CopyOnWrite {
                overlay: "/run/o".into()
            }
        );
    }

    #[test]
    fn share_specs_parse_and_bad_ones_are_refused() {
        let share: FsConfig =
            "tag=work,path=/srv/w,ro,owner=1000:100,guest-owner=0:0,hide=.env,hide=.git/hooks"
                .parse()
                .expect("a share");
        assert_eq!(share.tag, "work");
        assert_eq!(share.path.as_deref(), Some(std::path::Path::new("/srv/w")));
        assert!(share.options.read_only);
        assert_eq!(share.options.owner, Some((1000, 100)));
        assert_eq!(share.options.guest_owner, Some((0, 0)));
        assert_eq!(share.options.hidden, [".env", ".git/hooks"]);
        let slot: FsConfig = "tag=fs0".parse().expect("a slot");
        assert_eq!(slot.path, None);
        for bad in [
            "path=/srv",
            "tag=",
            "tag=a-tag-that-is-longer-than-thirty-six-bytes",
            "tag=w,owner=me",
            "tag=w,rw",
            "tag=w,guest-owner=1000:1000",
        ] {
            assert!(bad.parse::<FsConfig>().is_err(), "{bad}");
        }
        let mut config = config();
        config.shares = vec![slot.clone(), slot];
        assert!(matches!(
            config.validate(),
            Err(ConfigError::DuplicateShare(_))
        ));
    }

    #[test]
    fn bad_drive_specs_are_refused() {
        for spec in [
            "",
            "path=/a,readonly,overlay=/b",
            "path=/a,bogus",
            "readonly",
        ] {
            assert!(
                matches!(spec.parse::<DriveConfig>(), Err(ConfigError::Drive(..))),
                "{spec}"
            );
        }
    }

    #[test]
    fn zero_vcpus_is_refused() {
        let c = VmConfig {
            vcpus: 0,
            ..config()
        };

        assert!(matches!(c.validate(), Err(ConfigError::ZeroVcpus)));
    }

    #[test]
    fn too_many_vcpus_is_refused() {
        let c = VmConfig {
            vcpus: 255,
            ..config()
        };

        assert!(matches!(c.validate(), Err(ConfigError::TooManyVcpus(255))));
    }

    #[test]
    fn tiny_memory_is_refused() {
        let c = VmConfig {
            memory: MemoryConfig {
                size_mib: 1,
                ..config().memory
            },
            ..config()
        };

        assert!(matches!(c.validate(), Err(ConfigError::MemoryTooSmall(1))));
    }

    #[test]
    fn pvm_flags_only_on_pvm_hosts() {
        let c = VmConfig {
            extra_cmdline: Some("loglevel=8".into()),
            ..config()
        };

        let plain = c
            .kernel_cmdline(false)
            .expect("cmdline")
            .as_cstring()
            .expect("cstr");
        let pvm = c
            .kernel_cmdline(true)
            .expect("cmdline")
            .as_cstring()
            .expect("cstr");

        assert_eq!(
            plain.to_str().expect("utf8"),
            format!("{BASE_CMDLINE} loglevel=8")
        );
        assert_eq!(
            pvm.to_str().expect("utf8"),
            format!("{BASE_CMDLINE} {PVM_CMDLINE} loglevel=8")
        );
    }

    #[test]
    fn init_arguments_stay_last() {
        let with_boot = VmConfig {
            extra_cmdline: Some("root=/dev/vda -- /bin/sh -c x".into()),
            ..config()
        };
        let init_only = VmConfig {
            extra_cmdline: Some("-- /bin/true".into()),
            ..config()
        };

        let mut a = with_boot.kernel_cmdline(false).expect("cmdline");
        a.add_virtio_mmio_device(0x1000, vm_memory::GuestAddress(0xc000_0000), 5, None)
            .expect("device");
        let b = init_only.kernel_cmdline(false).expect("cmdline");

        assert_eq!(
            a.as_cstring().expect("cstr").to_str().expect("utf8"),
            format!(
                "{BASE_CMDLINE} root=/dev/vda virtio_mmio.device=4K@0xc0000000:5 -- /bin/sh -c x"
            )
        );
        assert_eq!(
            b.as_cstring().expect("cstr").to_str().expect("utf8"),
            format!("{BASE_CMDLINE} -- /bin/true")
        );
    }

    #[test]
    fn overlong_cmdline_is_refused() {
        let c = VmConfig {
            extra_cmdline: Some("x".repeat(3000)),
            ..config()
        };

        assert!(matches!(
            c.kernel_cmdline(false),
            Err(ConfigError::CmdlineTooLong { .. })
        ));
    }
}
