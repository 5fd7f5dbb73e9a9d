//! Templates: a kernel, a root file system and a VM shape, booted once,
//! warmed up and snapshotted. Every sandbox of a template restores that
//! snapshot.
//!
//! A template lives in `<state dir>/templates/<id>/`: `snapshot/` (what
//! clones restore), `rootfs.ext4` when its root file system was built from
//! a directory or a tar archive, and `build.console` (the boot's console).
//! Each file of the snapshot has a SHA-256 in the store, checked by
//! [`verify`]: a restore maps the memory file as it is, so a flipped byte
//! there would otherwise restore silently.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use husk_types::{KernelSource, RootfsSource, TemplateRecord, TemplateSpec};
use sha2::{Digest, Sha256};

use crate::cgroup::{Cgroup, Limits};
use crate::config::{DaemonConfig, AGENT_TIMEOUT};
use crate::store::{now_unix_ms, SandboxRecord};
use crate::vmm_process::{self, Launch};
use husk_agent_client::readiness::WaitBudget;
use husk_agent_client::{AgentClient, ClientError};

impl From<crate::rootfs::RootfsError> for TemplateError {
    fn from(e: crate::rootfs::RootfsError) -> Self {
        use crate::rootfs::RootfsError;
        match e {
            RootfsError::Invalid(m) => TemplateError::Invalid(m),
            RootfsError::Build(m) => TemplateError::Build(m),
            RootfsError::Io(p, e) => TemplateError::Io(p, e),
        }
    }
}

/// Errors building or checking a template.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("{0}")]
    /// The spec or the name is unusable.
    Invalid(String),
    #[error("the template's build failed: {0}")]
    /// The build failed (the guest did not boot, warm up or snapshot).
    Build(String),
    #[error("{0}")]
    /// A template's files are not what was built.
    Corrupt(String),
    /// A host path the daemon may not read for a template.
    #[error("{0}")]
    Forbidden(String),
    #[error(transparent)]
    /// Its upload is missing or unusable.
    Upload(#[from] crate::upload::UploadError),
    #[error("I/O error on {0}: {1}")]
    /// A file operation failed.
    Io(PathBuf, #[source] std::io::Error),
}

/// A limit as given, checked and written the way husk-vmm reads it.
fn checked_limit(what: &str, text: Option<&str>) -> Result<Option<String>, TemplateError> {
    text.map(|t| {
        husk_vmm_api::limits::parse_limits(t)
            .map(|l| l.to_string())
            .map_err(|e| TemplateError::Invalid(format!("`{what}`: {e}")))
    })
    .transpose()
}

/// Checks a template name (see [`husk_types::check_template_name`]).
pub fn check_name(name: &str) -> Result<(), TemplateError> {
    husk_types::check_template_name(name).map_err(TemplateError::Invalid)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TemplateError + '_ {
    move |e| TemplateError::Io(path.to_owned(), e)
}

/// Builds template `id` from `spec`: the files go in
/// `<state dir>/templates/<id>/`; on failure nothing is left there.
pub fn build(
    cfg: &DaemonConfig,
    id: &str,
    spec: TemplateSpec,
    progress: &mut dyn FnMut(&str),
) -> Result<TemplateRecord, TemplateError> {
    if !(1..=32).contains(&spec.vcpus) || !(32..=65536).contains(&spec.mem_mib) {
        return Err(TemplateError::Invalid(
            "a template has 1-32 vCPUs and 32-65536 MiB of memory".into(),
        ));
    }
    let mut spec = spec;
    spec.block_limit = checked_limit("block_limit", spec.block_limit.as_deref())?;
    spec.net_limit = checked_limit("net_limit", spec.net_limit.as_deref())?;
    let dir = cfg.state_dir.join("templates").join(id);
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let result = build_in(cfg, id, &dir, spec, progress);
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn build_in(
    cfg: &DaemonConfig,
    id: &str,
    dir: &Path,
    spec: TemplateSpec,
    progress: &mut dyn FnMut(&str),
) -> Result<TemplateRecord, TemplateError> {
    let mut phases = BTreeMap::new();
    let kernel = match &spec.kernel {
        Some(KernelSource::Path(path)) => path.clone(),
        Some(KernelSource::Upload { upload }) => {
            let kernel = dir.join("vmlinux");
            crate::upload::take(&cfg.state_dir, upload, &kernel)?;
            // A jailed VMM reads it as its own uid.
            std::fs::set_permissions(&kernel, std::fs::Permissions::from_mode(0o644))
                .map_err(io(&kernel))?;
            kernel
        }
        None => cfg.kernel.clone().ok_or_else(|| {
            TemplateError::Invalid("no guest kernel: start the daemon with --kernel".into())
        })?,
    };
    let phase = Instant::now();
    let (initramfs, drives, cmdline, source, image_config) = match &spec.rootfs {
        RootfsSource::Default => {
            let initramfs = cfg.initramfs.clone().ok_or_else(|| {
                TemplateError::Invalid(
                    "no default root file system: start the daemon with --initramfs".into(),
                )
            })?;
            (Some(initramfs), vec![], None, "default".to_owned(), None)
        }
        from => {
            progress("making the root file system image");
            let image = dir.join("rootfs.ext4");
            let stage = dir.join("stage");
            let (source, config) = match from {
                RootfsSource::Upload { upload } | RootfsSource::ImageUpload { upload } => {
                    let archive = dir.join("rootfs.tar");
                    crate::upload::take(&cfg.state_dir, upload, &archive)?;
                    let from = match from {
                        RootfsSource::Upload { .. } => RootfsSource::Tar {
                            path: archive.clone(),
                        },
                        _ => RootfsSource::Image {
                            path: archive.clone(),
                        },
                    };
                    let (_, config) = crate::rootfs::make_image(cfg, &from, &image, &stage)?;
                    std::fs::remove_file(&archive).map_err(io(&archive))?;
                    (format!("upload:{upload}"), config)
                }
                from => crate::rootfs::make_image(cfg, from, &image, &stage)?,
            };
            phases.insert("rootfs".to_owned(), ms(phase));
            (
                None,
                vec![format!("path={}", image.display())],
                Some("root=/dev/vda rw rootfstype=ext4 init=/init".to_owned()),
                source,
                config,
            )
        }
    };
    let mut drives = drives;
    if spec.drive_slots > husk_types::MAX_DRIVE_SLOTS {
        return Err(TemplateError::Invalid(format!(
            "{} drive slots: at most {}",
            spec.drive_slots,
            husk_types::MAX_DRIVE_SLOTS
        )));
    }
    // Its empty drives: raw images of no bytes, which the snapshot copies
    // (as nothing) and each clone puts its own overlay over.
    for index in 0..spec.drive_slots {
        let slot = dir.join(format!("{}.img", husk_types::drive_slot_id(index)));
        std::fs::File::create(&slot).map_err(io(&slot))?;
        drives.push(format!(
            "path={},id={}",
            slot.display(),
            husk_types::drive_slot_id(index)
        ));
    }
    if spec.fs_slots > husk_types::MAX_FS_SLOTS {
        return Err(TemplateError::Invalid(format!(
            "{} fs slots: at most {}",
            spec.fs_slots,
            husk_types::MAX_FS_SLOTS
        )));
    }
    // Its empty shared-directory devices: each clone's to fill.
    let shares = (0..spec.fs_slots)
        .map(|index| format!("tag={}", husk_types::fs_slot_id(index)))
        .collect();
    let run = dir.join("build");
    std::fs::create_dir_all(&run).map_err(io(&run))?;
    progress(&format!(
        "booting {} ({} vCPU, {} MiB)",
        kernel.display(),
        spec.vcpus,
        spec.mem_mib
    ));
    let drives_written: Vec<PathBuf> = drives
        .iter()
        .filter_map(|d| d.strip_prefix("path="))
        .map(PathBuf::from)
        .collect();
    let launch = Launch::Boot {
        kernel,
        initramfs,
        drives,
        shares,
        cmdline,
        vcpus: spec.vcpus,
        mem_mib: spec.mem_mib,
        nested_virt: spec.nested_virt,
    };
    let cgroup = match &cfg.cgroups {
        Some(h) => Some(
            Cgroup::create(h, id, Limits::for_vm(spec.vcpus, spec.mem_mib))
                .map_err(|e| TemplateError::Build(e.to_string()))?,
        ),
        None => None,
    };
    let nic = if spec.network {
        Some(vmm_process::Nic::for_vm("hb", id).map_err(io(Path::new("/dev/urandom")))?)
    } else {
        None
    };
    let jailing = match &cfg.jail {
        Some(j) => Some(vmm_process::Jailing {
            jailer: j.jailer.clone(),
            uid: j
                .uids
                .take()
                .ok_or_else(|| TemplateError::Build("no free jail uid".into()))?,
            reads: Vec::new(),
        }),
        None => None,
    };
    let spawned = vmm_process::spawn(&vmm_process::VmSpawn {
        vmm: &cfg.vmm,
        id,
        run_dir: &run,
        launch: &launch,
        cgroup: cgroup.as_ref(),
        nic: nic.as_ref(),
        jail: jailing.as_ref(),
        // The build itself runs unlimited: it is the operator's.
        limits: (None, None),
    });
    let outcome = match spawned {
        Ok(mut child) => {
            let outcome =
                boot_and_snapshot(cfg, &run, dir, &mut child, &spec, &mut phases, progress);
            vmm_process::stop(&mut child);
            outcome
        }
        Err(e) => Err(format!("cannot start {}: {e}", cfg.vmm.display())),
    };
    if let Some(cg) = cgroup {
        cg.remove();
    }
    if let (Some(j), Some(jailing)) = (&cfg.jail, &jailing) {
        // The image the jail wrote is root's again before its uid is.
        for drive in &drives_written {
            let _ = std::os::unix::fs::chown(drive, Some(0), Some(0));
        }
        j.uids.give(jailing.uid);
    }
    let console = run.join(vmm_process::CONSOLE);
    if let Err(e) = outcome {
        let last = vmm_process::last_words(&run.join(vmm_process::LOG), &console, 15);
        return Err(TemplateError::Build(format!("{e}\n{last}")));
    }
    let _ = std::fs::rename(&console, dir.join("build.console"));
    let _ = std::fs::remove_dir_all(&run);
    let _ = std::fs::remove_dir_all(dir.join("stage"));
    progress("checksumming the snapshot");
    let phase = Instant::now();
    let snapshot_dir = dir.join("snapshot");
    let checksums = checksum_dir(&snapshot_dir)?;
    phases.insert("checksum".to_owned(), ms(phase));
    Ok(TemplateRecord {
        id: id.to_owned(),
        name: spec.name,
        created_unix_ms: now_unix_ms(),
        snapshot_dir,
        vcpus: spec.vcpus,
        mem_mib: spec.mem_mib,
        source,
        checksums,
        build_ms: phases,
        network: spec.network,
        reads: Vec::new(),
        block_limit: spec.block_limit,
        net_limit: spec.net_limit,
        image: image_config,
        drive_slots: spec.drive_slots,
        fs_slots: spec.fs_slots,
    })
}

fn ms(since: Instant) -> f64 {
    (since.elapsed().as_secs_f64() * 1000.0 * 10.0).round() / 10.0
}

/// Where a guest finds the egress proxy's CA certificate.
pub const GUEST_CA: &str = "/etc/husk/egress-ca.pem";

/// Certificate bundles of the common distributions; the CA is added to
/// those the guest has.
const GUEST_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
];

/// Makes the guest trust the egress proxy's CA (the hosts whose TLS the
/// proxy opens to add credentials): the certificate at [`GUEST_CA`], and
/// appended to each certificate bundle the guest has.
fn trust_ca(client: &mut AgentClient, pem: &str) -> Result<(), ClientError> {
    client.mkdir("/etc/husk")?;
    client.write_file(GUEST_CA, 0o644, pem.as_bytes())?;
    for bundle in GUEST_BUNDLES {
        let mut have = Vec::new();
        if client.read_file(bundle, &mut have).is_err() {
            continue; // none there
        }
        if have.windows(pem.len()).any(|w| w == pem.as_bytes()) {
            continue;
        }
        if !have.is_empty() && !have.ends_with(b"\n") {
            have.push(b'\n');
        }
        have.extend_from_slice(pem.as_bytes());
        client.write_file(bundle, 0o644, &have[..])?;
    }
    Ok(())
}

/// Waits for the booting guest's agent, runs the warm-up commands and
/// snapshots the guest into `dir/snapshot`.
fn boot_and_snapshot(
    cfg: &DaemonConfig,
    run: &Path,
    dir: &Path,
    child: &mut std::process::Child,
    spec: &TemplateSpec,
    phases: &mut BTreeMap<String, f64>,
    progress: &mut dyn FnMut(&str),
) -> Result<(), String> {
    let phase = Instant::now();
    let mut wait = WaitBudget::new(cfg.boot_wait);
    let mut alive = || match child.try_wait() {
        Ok(None) => Ok(()),
        Ok(Some(status)) => Err(ClientError::VmmGone(format!(
            "husk-vmm exited during the boot ({status})"
        ))),
        Err(e) => Err(e.into()),
    };
    let mut client = AgentClient::connect_patiently(
        &run.join(vmm_process::VSOCK),
        &mut wait,
        &mut alive,
        AGENT_TIMEOUT,
    )
    .map_err(|e| format!("the guest's agent did not come up: {e}"))?;
    phases.insert("boot".to_owned(), ms(phase));
    progress(&format!(
        "guest agent answered after {:.1} s",
        phase.elapsed().as_secs_f64()
    ));
    let phase = Instant::now();
    if let Some(pem) = crate::egress::intercept::stored_ca_pem(&cfg.state_dir) {
        progress("trusting the egress proxy's CA");
        trust_ca(&mut client, &pem).map_err(|e| format!("installing the egress CA: {e}"))?;
    }
    for (i, argv) in spec.warmup.iter().enumerate() {
        progress(&format!("warm-up {}: {}", i + 1, argv.join(" ")));
        let out = client
            .exec(husk_protocol::ExecRequest {
                argv: argv.clone(),
                timeout_ms: Some(AGENT_TIMEOUT.as_millis() as u64),
                ..Default::default()
            })
            .map_err(|e| format!("warm-up command {:?}: {e}", argv))?;
        if out.report.termination != husk_protocol::Termination::Code(0) {
            let stderr = String::from_utf8_lossy(&out.stderr);
            return Err(format!(
                "warm-up command {:?} ended with {:?}: {}",
                argv,
                out.report.termination,
                stderr
                    .chars()
                    .rev()
                    .take(2000)
                    .collect::<String>()
                    .chars()
                    .rev()
                    .collect::<String>()
            ));
        }
    }
    if !spec.warmup.is_empty() {
        phases.insert("warmup".to_owned(), ms(phase));
    }
    drop(client);
    progress("snapshotting");
    let phase = Instant::now();
    // Written where a jailed VMM can write, then moved into place (the
    // snapshot names its own files relative to its directory).
    let written = run.join("snapshot");
    let request = husk_vmm_api::Request::Snapshot {
        dir: written.clone(),
        diff: false,
        keep_base: false,
    };
    match husk_vmm_api::call(&run.join(vmm_process::API), &request, AGENT_TIMEOUT) {
        Ok(husk_vmm_api::Reply::Snapshot { .. }) => {}
        Ok(other) => return Err(format!("the snapshot was refused: {other:?}")),
        Err(e) => return Err(format!("the snapshot failed: {e}")),
    }
    take_snapshot_dir(&written, &dir.join("snapshot")).map_err(|e| e.to_string())?;
    phases.insert("snapshot".to_owned(), ms(phase));
    Ok(())
}

/// How the source of a template made from a sandbox starts (then the
/// sandbox's id).
pub const FROM_SANDBOX: &str = "sandbox:";

/// Snapshots running sandbox `rec` into template `id` named `name`.
pub fn from_sandbox(
    cfg: &DaemonConfig,
    id: &str,
    name: &str,
    rec: &SandboxRecord,
    parent: Option<&TemplateRecord>,
) -> Result<TemplateRecord, TemplateError> {
    let dir = cfg.state_dir.join("templates").join(id);
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let snapshot_dir = dir.join("snapshot");
    let started = Instant::now();
    // Written where a jailed VMM can write, then moved into place.
    let written = rec.run_dir.join(format!("snapshot-{id}"));
    // Moved away once written: the sandbox's own hibernations must not
    // diff against it.
    let request = husk_vmm_api::Request::Snapshot {
        dir: written.clone(),
        diff: false,
        keep_base: true,
    };
    let reply = husk_vmm_api::call(&rec.run_dir.join(vmm_process::API), &request, AGENT_TIMEOUT);
    let checked = match reply {
        Ok(husk_vmm_api::Reply::Snapshot { .. }) => {
            take_snapshot_dir(&written, &snapshot_dir).and_then(|()| checksum_dir(&snapshot_dir))
        }
        Ok(other) => Err(TemplateError::Build(format!(
            "the VMM refused the snapshot: {other:?}"
        ))),
        Err(e) => Err(TemplateError::Build(format!("the snapshot failed: {e}"))),
    };
    let checksums = match checked {
        Ok(c) => c,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            let _ = std::fs::remove_dir_all(&written);
            return Err(e);
        }
    };
    // Its clones read the snapshots its drives' layers are in.
    let reads = parent
        .map(|p| {
            let mut reads = p.reads.clone();
            reads.push(p.snapshot_dir.clone());
            reads
        })
        .unwrap_or_default();
    Ok(TemplateRecord {
        id: id.to_owned(),
        name: name.to_owned(),
        created_unix_ms: now_unix_ms(),
        snapshot_dir,
        vcpus: parent.map_or(1, |p| p.vcpus),
        mem_mib: rec.mem_mib,
        source: format!("{FROM_SANDBOX}{}", rec.id),
        checksums,
        build_ms: BTreeMap::from([("snapshot".to_owned(), ms(started))]),
        network: rec.tap.is_some(),
        reads,
        block_limit: parent.and_then(|p| p.block_limit.clone()),
        net_limit: parent.and_then(|p| p.net_limit.clone()),
        image: parent.and_then(|p| p.image.clone()),
        drive_slots: parent.map_or(0, |p| p.drive_slots),
        fs_slots: parent.map_or(0, |p| p.fs_slots),
    })
}

/// Moves a snapshot a VMM wrote into its template's place, owned by root
/// and read-only to others (the jailed VMM that wrote it may be gone, and
/// its uid given to another).
fn take_snapshot_dir(written: &Path, place: &Path) -> Result<(), TemplateError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::rename(written, place).map_err(io(place))?;
    std::os::unix::fs::chown(place, Some(0), Some(0)).map_err(io(place))?;
    std::fs::set_permissions(place, std::fs::Permissions::from_mode(0o755)).map_err(io(place))?;
    for entry in std::fs::read_dir(place).map_err(io(place))? {
        let path = entry.map_err(io(place))?.path();
        std::os::unix::fs::chown(&path, Some(0), Some(0)).map_err(io(&path))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))
            .map_err(io(&path))?;
    }
    Ok(())
}

/// SHA-256 of each regular file in `dir`.
fn checksum_dir(dir: &Path) -> Result<BTreeMap<String, String>, TemplateError> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let path = entry.path();
        if entry.file_type().map_err(io(&path))?.is_file() {
            out.insert(
                entry.file_name().to_string_lossy().into_owned(),
                sha256(&path)?,
            );
        }
    }
    Ok(out)
}

fn sha256(path: &Path) -> Result<String, TemplateError> {
    let mut file = std::fs::File::open(path).map_err(io(path))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Checks every file of a template's snapshot against its checksum;
/// returns the files checked.
pub fn verify(t: &TemplateRecord) -> Result<Vec<String>, TemplateError> {
    let mut bad = Vec::new();
    for (file, want) in &t.checksums {
        let path = t.snapshot_dir.join(file);
        match sha256(&path) {
            Ok(got) if got == *want => {}
            Ok(_) => bad.push(format!("{file}: checksum mismatch")),
            Err(e) => bad.push(format!("{file}: {e}")),
        }
    }
    if bad.is_empty() {
        Ok(t.checksums.keys().cloned().collect())
    } else {
        Err(TemplateError::Corrupt(format!(
            "template `{}` is corrupt ({}): remove it and build it again",
            t.name,
            bad.join("; ")
        )))
    }
}

/// Checks the host paths `spec` names against the operator's template
/// sources, and puts each one's real path (symbolic links resolved) in its
/// place, so that the build reads what was checked. Uploads and the
/// daemon's defaults need no check.
pub fn check_sources(sources: &[PathBuf], spec: &mut TemplateSpec) -> Result<(), TemplateError> {
    match &mut spec.rootfs {
        RootfsSource::Dir { path } | RootfsSource::Tar { path } | RootfsSource::Image { path } => {
            *path = allowed_source(sources, path, "root file system")?
        }
        RootfsSource::Default | RootfsSource::Upload { .. } | RootfsSource::ImageUpload { .. } => {}
    }
    if let Some(KernelSource::Path(path)) = &mut spec.kernel {
        *path = allowed_source(sources, path, "kernel")?;
    }
    Ok(())
}

/// `path`'s real path, if it lies in one of `sources` (real paths too).
/// A path outside them is refused whether or not it exists, so the answer
/// tells a client nothing about the rest of the host.
fn allowed_source(sources: &[PathBuf], path: &Path, what: &str) -> Result<PathBuf, TemplateError> {
    let refused = || {
        TemplateError::Forbidden(format!(
            "{what} {}: the daemon reads no host path for a template outside the directories \
             its operator allowed (husk serve --template-source DIR{}); upload the file instead \
             (POST /v1/uploads, then {{\"upload\": ID}}; the CLI uploads by default)",
            path.display(),
            if sources.is_empty() {
                ", none now".to_owned()
            } else {
                format!(
                    ": now {}",
                    sources
                        .iter()
                        .map(|s| s.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        ))
    };
    let inside = |p: &Path| sources.iter().any(|s| p.starts_with(s));
    if !path.is_absolute() || !inside(path) {
        return Err(refused());
    }
    let real = std::fs::canonicalize(path)
        .map_err(|e| TemplateError::Invalid(format!("{what} {}: {e}", path.display())))?;
    if inside(&real) {
        Ok(real)
    } else {
        Err(refused())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(check_name("py-3.12").is_ok());
        for bad in ["", "-x", "A", "a/b", "a b", &"x".repeat(64)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_paths_in_the_template_sources_are_read_and_links_do_not_lead_out() {
        let root = std::env::temp_dir().join(format!("husk-sources-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let src = root.join("src");
        std::fs::create_dir_all(src.join("tree")).expect("dirs");
        std::fs::write(root.join("secret"), b"x").expect("secret");
        std::os::unix::fs::symlink(root.join("secret"), src.join("out")).expect("link");
        std::os::unix::fs::symlink("tree", src.join("in")).expect("link");
        let sources = [std::fs::canonicalize(&src).expect("real")];
        let check = |rootfs: RootfsSource, kernel: Option<KernelSource>| {
            let mut spec: TemplateSpec =
                serde_json::from_value(serde_json::json!({ "name": "t" })).expect("spec");
            spec.rootfs = rootfs;
            spec.kernel = kernel;
            check_sources(&sources, &mut spec).map(|()| spec)
        };
        let dir = |p: PathBuf| RootfsSource::Dir { path: p };

        let allowed = check(dir(src.join("in")), None).expect("a link inside");
        let refused = [
            check(dir(root.join("secret")), None),
            check(dir(src.join("out")), None),
            check(dir(src.join("../secret")), None),
            check(dir(PathBuf::from("src/tree")), None),
            check(
                RootfsSource::Default,
                Some(KernelSource::Path(root.join("secret"))),
            ),
        ];
        let missing = check(dir(src.join("nope")), None);

        assert_eq!(allowed.rootfs, dir(sources[0].join("tree")));
        for r in refused {
            assert!(matches!(r, Err(TemplateError::Forbidden(_))), "{r:?}");
        }
        assert!(
            matches!(missing, Err(TemplateError::Invalid(_))),
            "{missing:?}"
        );
        std::fs::remove_dir_all(&root).expect("cleanup");
    }

    #[test]
    fn a_flipped_byte_fails_verification() {
        let dir = std::env::temp_dir().join(format!("husk-verify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join("memory"), vec![7u8; 4096]).expect("write");
        let mut t = TemplateRecord {
            id: "tpl-x".into(),
            name: "x".into(),
            created_unix_ms: 0,
            snapshot_dir: dir.clone(),
            vcpus: 1,
            mem_mib: 128,
            source: "default".into(),
            checksums: checksum_dir(&dir).expect("checksums"),
            build_ms: BTreeMap::new(),
            network: false,
            reads: Vec::new(),
            block_limit: None,
            net_limit: None,
            image: None,
            drive_slots: 0,
            fs_slots: 0,
        };
        assert!(verify(&t).is_ok());

        let mut bytes = std::fs::read(dir.join("memory")).expect("read");
        bytes[100] ^= 1;
        std::fs::write(dir.join("memory"), bytes).expect("write");

        let err = verify(&t).expect_err("corrupt").to_string();
        assert!(err.contains("memory: checksum mismatch"), "{err}");
        t.checksums.clear();
        std::fs::remove_dir_all(dir).expect("cleanup");
    }
}
