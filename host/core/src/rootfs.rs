//! Root file system images for templates built from a directory, a tar
//! archive (an exported container file system) or a container image: the
//! tree is staged, given guest-init as `/init` and the mount points it
//! needs, and turned into an ext4 image with `mkfs.ext4 -d` (no root
//! privileges, no loop device). Archives are unpacked under the rules of
//! `archive` (hostile input); images by `oci`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::archive::{unpack, ArchiveError};
use crate::config::DaemonConfig;
use husk_types::{ImageConfig, RootfsSource};

/// Errors making a root file system image.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    #[error("{0}")]
    /// The source is unusable (a hostile archive entry, a missing directory).
    Invalid(String),
    #[error("{0}")]
    /// A tool that makes the image failed.
    Build(String),
    #[error("I/O error on {0}: {1}")]
    /// A file operation failed.
    Io(PathBuf, #[source] std::io::Error),
}

/// Directories guest-init mounts on or expects.
const MOUNT_POINTS: &[&str] = &["dev", "proc", "sys", "tmp", "run", "root", "etc"];

impl From<ArchiveError> for RootfsError {
    fn from(e: ArchiveError) -> Self {
        match e {
            ArchiveError::Invalid(why) => RootfsError::Invalid(why),
            ArchiveError::Io(path, e) => RootfsError::Io(path, e),
        }
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RootfsError + '_ {
    move |e| RootfsError::Io(path.to_owned(), e)
}

/// Makes `image` from `source`, staging the tree in `stage` (removed
/// after). Returns how the source is recorded (`dir:PATH`, `tar:PATH`,
/// `image:PATH`) and, for a container image, its config.
pub fn make_image(
    cfg: &DaemonConfig,
    source: &RootfsSource,
    image: &Path,
    stage: &Path,
) -> Result<(String, Option<ImageConfig>), RootfsError> {
    let guest_init = cfg.guest_init.as_ref().ok_or_else(|| {
        RootfsError::Invalid(
            "no guest-init binary to put in the root file system: start the daemon with \
             --guest-init"
                .into(),
        )
    })?;
    let _ = std::fs::remove_dir_all(stage);
    std::fs::create_dir_all(stage).map_err(io(stage))?;
    let result = stage_and_make(guest_init, source, image, stage);
    let _ = std::fs::remove_dir_all(stage);
    result
}

fn stage_and_make(
    guest_init: &Path,
    source: &RootfsSource,
    image: &Path,
    stage: &Path,
) -> Result<(String, Option<ImageConfig>), RootfsError> {
    let mut config = None;
    let recorded = match source {
        RootfsSource::Default | RootfsSource::Upload { .. } | RootfsSource::ImageUpload { .. } => {
            return Err(RootfsError::Invalid(
                "the default root file system and uploads are not images to stage".into(),
            ))
        }
        RootfsSource::Dir { path } => {
            if !path.is_dir() {
                return Err(RootfsError::Invalid(format!(
                    "root file system directory {} does not exist",
                    path.display()
                )));
            }
            let mut from = path.clone().into_os_string();
            from.push("/.");
            run(Command::new("cp").arg("-a").arg(from).arg(stage))?;
            format!("dir:{}", path.display())
        }
        RootfsSource::Tar { path } => {
            unpack(path, stage)?;
            format!("tar:{}", path.display())
        }
        RootfsSource::Image { path } => {
            let c = crate::oci::unpack_image(path, stage, &stage.with_extension("image"))?;
            std::fs::write(
                stage.join(crate::oci::GUEST_CONFIG),
                guest_config(stage, &c)?,
            )
            .map_err(io(stage))?;
            config = Some(c);
            format!("image:{}", path.display())
        }
    };
    for dir in MOUNT_POINTS {
        let p = stage.join(dir);
        if p.symlink_metadata().is_err() {
            std::fs::create_dir_all(&p).map_err(io(&p))?;
        }
    }
    let init = stage.join("init");
    let _ = std::fs::remove_file(&init);
    std::fs::copy(guest_init, &init).map_err(io(guest_init))?;
    let size_mib = tree_size(stage).file_bytes / (1 << 20) * 3 / 2 + 64;
    let tmp = image.with_extension("tmp");
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-L", "husk-root", "-E", "root_owner=0:0", "-d"])
        .arg(stage)
        .arg(&tmp)
        .arg(format!("{size_mib}M")))?;
    // The console and null device nodes the kernel opens before init runs
    // (devtmpfs is mounted over /dev later), made inside the image.
    let script = "cd /dev\nmknod console c 5 1\nsif console mode 020600\n\
                  mknod null c 1 3\nsif null mode 020666\n";
    let mut debugfs = Command::new("debugfs")
        .args(["-w", "-f", "-"])
        .arg(&tmp)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| RootfsError::Build(format!("debugfs (from e2fsprogs): {e}")))?;
    if let Some(mut stdin) = debugfs.stdin.take() {
        use std::io::Write;
        stdin.write_all(script.as_bytes()).map_err(io(&tmp))?;
    }
    debugfs.wait().map_err(io(&tmp))?;
    std::fs::rename(&tmp, image).map_err(io(image))?;
    Ok((recorded, config))
}

/// Makes `image`, an ext4 file system holding the tree in tar archive
/// `archive` as it is (a container's root file system: no guest-init, no
/// mount points added) and `spare_mib` MiB of free space, staging the
/// tree in `stage` (removed after). No journal: the file system lives as
/// long as its sandbox, under an overlay of the sandbox's own. The image
/// appears whole or not at all (made under a name of its own, renamed).
pub fn make_medium(
    archive: &Path,
    image: &Path,
    stage: &Path,
    spare_mib: u64,
) -> Result<(), RootfsError> {
    let _ = std::fs::remove_dir_all(stage);
    std::fs::create_dir_all(stage).map_err(io(stage))?;
    let tmp = stage.with_extension("ext4");
    let result = unpack(archive, stage)
        .map_err(RootfsError::from)
        .and_then(|()| {
            // Every file and directory takes whole 4 KiB blocks and an
            // inode; a quarter more for the file system's own blocks.
            let tree = tree_size(stage);
            let size_mib = (tree.blocks * 4096 * 5 / 4) >> 20;
            run(Command::new("mkfs.ext4")
                .args(["-q", "-F", "-O", "^has_journal", "-L", "husk-medium"])
                .args(["-N", &(tree.entries + 65536).to_string(), "-d"])
                .arg(stage)
                .arg(&tmp)
                .arg(format!("{}M", size_mib + spare_mib)))
        })
        .and_then(|()| {
            use std::os::unix::fs::PermissionsExt;
            // A jailed VMM reads it as its own uid.
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))
                .and_then(|()| std::fs::rename(&tmp, image))
                .map_err(io(image))
        });
    let _ = std::fs::remove_dir_all(stage);
    let _ = std::fs::remove_file(&tmp);
    result
}

/// The image config as guest-init reads it at boot, one setting a line:
/// `user UID GID`, `cwd DIR`, `env KEY=VALUE`. The image's user is
/// resolved here against its own /etc/passwd and /etc/group, and its
/// home becomes HOME unless the image sets one.
fn guest_config(stage: &Path, c: &ImageConfig) -> Result<String, RootfsError> {
    let settings = c.env.iter().chain(&c.working_dir).chain(&c.user);
    if let Some(bad) = settings.into_iter().find(|v| v.contains(['\n', '\0'])) {
        return Err(RootfsError::Invalid(format!(
            "image: the setting {bad:?} has a line break or a NUL in it"
        )));
    }
    let mut out = String::new();
    let mut env = c.env.clone();
    if let Some(user) = &c.user {
        let (uid, gid, home) = image_user(stage, user)?;
        out += &format!("user {uid} {gid}\n");
        if let Some(home) = home.filter(|_| !env.iter().any(|e| e.starts_with("HOME="))) {
            env.push(format!("HOME={home}"));
        }
    }
    if let Some(dir) = &c.working_dir {
        out += &format!("cwd {dir}\n");
    }
    for e in &env {
        if !e.contains('=') {
            return Err(RootfsError::Invalid(format!(
                "image: env entry `{e}` is not KEY=VALUE"
            )));
        }
        out += &format!("env {e}\n");
    }
    Ok(out)
}

/// `user` (`name`, `uid`, `name:group`, `uid:gid`) as numbers, with the
/// user's home when /etc/passwd has one.
fn image_user(stage: &Path, user: &str) -> Result<(u32, u32, Option<String>), RootfsError> {
    let table = |name: &str| -> Vec<Vec<String>> {
        let path = stage.join("etc").join(name);
        // The image's own file, not one a link points at.
        if !path.symlink_metadata().is_ok_and(|m| m.is_file()) {
            return Vec::new();
        }
        std::fs::read_to_string(&path)
            .unwrap_or_default()
            .lines()
            .map(|l| l.split(':').map(str::to_owned).collect())
            .collect()
    };
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let passwd = table("passwd");
    let entry = passwd
        .iter()
        .find(|f| f.len() >= 6 && (f[0] == u || f[2] == u));
    let uid = match (u.parse::<u32>(), entry) {
        (Ok(uid), _) => uid,
        (Err(_), Some(f)) => f[2].parse().unwrap_or(0),
        (Err(_), None) => {
            return Err(RootfsError::Invalid(format!(
                "image: its user `{u}` is not in its /etc/passwd"
            )))
        }
    };
    let gid = match g {
        None => entry.and_then(|f| f[3].parse().ok()).unwrap_or(0),
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => table("group")
                .iter()
                .find(|f| f.len() >= 3 && f[0] == g)
                .and_then(|f| f[2].parse().ok())
                .ok_or_else(|| {
                    RootfsError::Invalid(format!("image: its group `{g}` is not in its /etc/group"))
                })?,
        },
    };
    Ok((uid, gid, entry.map(|f| f[5].clone())))
}

fn run(cmd: &mut Command) -> Result<(), RootfsError> {
    let out = cmd
        .output()
        .map_err(|e| RootfsError::Build(format!("{cmd:?}: {e} (is e2fsprogs installed?)")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(RootfsError::Build(format!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// What the tree under `dir` holds: bytes in regular files, the 4 KiB
/// blocks its files, links and directories take at least, and how many
/// entries there are.
#[derive(Debug, Default, Clone, Copy)]
struct TreeSize {
    file_bytes: u64,
    blocks: u64,
    entries: u64,
}

fn tree_size(dir: &Path) -> TreeSize {
    let mut size = TreeSize {
        blocks: 1,
        entries: 1,
        ..TreeSize::default()
    };
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let len = entry.metadata().map_or(0, |m| m.len());
            size.entries += 1;
            size.blocks += len.div_ceil(4096).max(1);
            match entry.file_type() {
                Ok(t) if t.is_dir() => stack.push(entry.path()),
                Ok(t) if t.is_file() => size.file_bytes += len,
                _ => {}
            }
        }
    }
    size
}
