//! The CLI as a client of the daemon (`husk serve`): sandboxes by id,
//! templates and pools by name. Like docker's: `run`, `ps`, `exec`, `cp`,
//! `logs`, `pause`, `resume`, `snapshot`, `fork`, `rm`, `template ...`,
//! `pool ...`; `--json` on list and inspect commands.

use std::path::PathBuf;

use husk_client::{ApiClient, ApiClientError};
use husk_protocol::Stream;
use husk_types::{
    CreateRequest, Created, EgressSpec, ExecEvent, ExecSpec, ExpiryPolicy, ForkRequest,
    KernelSource, RootfsSource, TemplateSpec,
};

/// Exit status for husk's own failures (as docker uses 125).
const HUSK_FAILED: u8 = 125;

/// The daemon: `$HUSK_HOST` (a socket path, or `tcp://HOST:PORT` with the
/// token in `$HUSK_TOKEN`), else the default state directory's socket.
pub fn client() -> ApiClient {
    husk_client::from_env()
}

/// A sandbox id (as the daemon makes them) rather than a VM socket path.
pub fn is_sandbox_id(target: &str) -> bool {
    !target.contains('/') && !target.is_empty()
}

pub type CliResult = Result<u8, ApiClientError>;

/// `--json` output: the daemon's answer, pretty-printed.
fn print_json<T: serde::Serialize>(value: &T) {
    println!(
        "{}",
        serde_json::to_string_pretty(value).unwrap_or_default()
    );
}

/// Runs a program in a sandbox, streaming its output; returns its exit
/// status (128 + N when killed by signal N).
pub fn exec(id: &str, spec: &ExecSpec) -> CliResult {
    let mut events = client().exec(id, spec)?;
    while let Some(event) = events.next_event()? {
        match event {
            ExecEvent::Started { .. } => {}
            ExecEvent::Stdout { data } => crate::write_base64(Stream::Stdout, &data),
            ExecEvent::Stderr { data } => crate::write_base64(Stream::Stderr, &data),
            ExecEvent::Lost { bytes } => eprintln!("husk: {bytes} bytes of output were lost"),
            ExecEvent::Exit { code, signal, .. } => {
                return Ok(match (code, signal) {
                    (Some(c), _) => c as u8,
                    (None, Some(s)) => 128u8.wrapping_add(s as u8),
                    _ => 0,
                })
            }
            ExecEvent::Error { kind, error } => {
                eprintln!("husk: {error}");
                return Ok(match kind {
                    Some(husk_protocol::ErrorKind::Timeout) => 124,
                    _ => HUSK_FAILED,
                });
            }
        }
    }
    eprintln!("husk: the daemon ended the output before the program's exit");
    Ok(HUSK_FAILED)
}

/// What `husk run` asks of the daemon, besides its template.
#[derive(Debug, Default)]
pub struct RunArgs {
    pub ttl_s: Option<u64>,
    pub labels: Vec<(String, String)>,
    pub pause_on_expiry: bool,
    pub allow: Vec<String>,
    pub private_ports: bool,
    pub on_idle: Option<husk_types::IdlePolicy>,
    pub mounts: Vec<husk_types::MountSpec>,
}

pub fn create(template: &str, a: RunArgs) -> Result<Created, ApiClientError> {
    client().create_sandbox(&CreateRequest {
        template: template.to_owned(),
        ttl_s: a.ttl_s,
        labels: a.labels.into_iter().collect(),
        on_expiry: if a.pause_on_expiry {
            ExpiryPolicy::Pause
        } else {
            ExpiryPolicy::Destroy
        },
        egress: EgressSpec {
            allow: a.allow,
            ..Default::default()
        },
        private_ports: a.private_ports,
        on_idle: a.on_idle,
        mounts: a.mounts,
    })
}

/// `husk port`: the port's address at the front door, and whether a
/// program listens on it (exit 1 when none does).
pub fn port(id: &str, port: u16, wait_s: u64) -> CliResult {
    let p = client().wait_for_port(id, port, wait_s)?;
    match &p.url {
        Some(url) => println!("{url}"),
        None => eprintln!(
            "husk: the daemon has no front door (start it with husk serve --expose [ADDR])"
        ),
    }
    if p.private {
        eprintln!("private: requests need the e2b-traffic-access-token header (husk inspect {id})");
    }
    match &p.reason {
        None => Ok(0),
        Some(why) => {
            eprintln!("husk: {why}");
            Ok(1)
        }
    }
}

pub fn ps(labels: &[(String, String)], state: Option<&str>, as_json: bool) -> CliResult {
    let list = client().sandboxes(&labels.iter().cloned().collect(), state)?;
    if as_json {
        print_json(&list);
        return Ok(0);
    }
    println!(
        "{:<16}  {:<16}  {:<10}  {:>8}  {:>7}  {:>8}  LABELS",
        "SANDBOX", "TEMPLATE", "STATE", "PID", "TTL_S", "DISK_MIB"
    );
    let now = husk_core::store::now_unix_ms();
    for s in list {
        let ttl = s.expires_unix_ms.map_or("-".to_owned(), |e| {
            (e.saturating_sub(now) / 1000).to_string()
        });
        let labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        // What a hibernated sandbox takes on disk.
        let disk = s.disk_bytes.map_or("-".to_owned(), |b| {
            format!("{:.1}", b as f64 / f64::from(1 << 20))
        });
        println!(
            "{:<16}  {:<16}  {:<10}  {:>8}  {:>7}  {:>8}  {}",
            s.id,
            s.template,
            s.state.name(),
            s.pid,
            ttl,
            disk,
            labels.join(",")
        );
    }
    Ok(0)
}

pub fn inspect(id: &str) -> CliResult {
    print_json(&client().sandbox(id)?);
    Ok(0)
}

pub fn logs(id: &str) -> CliResult {
    let mut console = client().logs(id)?;
    std::io::copy(&mut console, &mut std::io::stdout().lock())?;
    Ok(0)
}

/// Destroys one sandbox.
pub fn destroy(id: &str) -> Result<(), ApiClientError> {
    client().destroy_sandbox(id)
}

pub fn rm(ids: &[String]) -> CliResult {
    let mut failed = false;
    for id in ids {
        match destroy(id) {
            Ok(()) => println!("{id}"),
            Err(e) => {
                eprintln!("husk: {id}: {e}");
                failed = true;
            }
        }
    }
    Ok(if failed { HUSK_FAILED } else { 0 })
}

/// A change of a sandbox's state.
#[derive(Debug, Clone, Copy)]
pub enum Lifecycle {
    Pause,
    Resume,
    Hibernate,
    Wake,
}

pub fn lifecycle(id: &str, change: Lifecycle) -> CliResult {
    let api = client();
    let s = match change {
        Lifecycle::Pause => api.pause(id)?,
        Lifecycle::Resume => api.resume(id)?,
        Lifecycle::Hibernate => api.hibernate(id)?,
        Lifecycle::Wake => api.wake(id)?,
    };
    println!("{} {}", s.id, s.state.name());
    Ok(0)
}

pub fn kill_all(id: &str) -> CliResult {
    let k = client().kill_all(id)?;
    println!("{id} killed {} tasks", k.killed_tasks);
    Ok(0)
}

pub fn snapshot(id: &str, name: &str) -> CliResult {
    let t = client().snapshot(id, name)?;
    println!("{} {}", t.name, t.id);
    Ok(0)
}

pub fn fork(id: &str, count: u32, name: Option<&str>) -> CliResult {
    let f = client().fork(
        id,
        &ForkRequest {
            name: name.map(str::to_owned),
            count,
        },
    )?;
    eprintln!("template {} ({})", f.template.name, f.template.id);
    for c in f.sandboxes {
        println!("{}", c.sandbox.id);
    }
    Ok(0)
}

/// `husk cp`: one side is `<sandbox>:<absolute guest path>`.
pub fn cp_from(id: &str, guest: &str, host: &str) -> CliResult {
    let mut resp = client().read_file(id, guest)?;
    // Written beside, then renamed: a broken download leaves no half file.
    let tmp = format!("{host}.husk-partial");
    let mut file = std::fs::File::create(&tmp)?;
    let copied = std::io::copy(&mut resp, &mut file).and_then(|_| file.sync_all());
    if let Err(e) = copied {
        let _ = std::fs::remove_file(&tmp);
        return Err(e.into());
    }
    std::fs::rename(&tmp, host)?;
    Ok(0)
}

pub fn cp_to(host: &str, id: &str, guest: &str) -> CliResult {
    let mut file = std::fs::File::open(host)?;
    let mode = {
        use std::os::unix::fs::PermissionsExt;
        file.metadata()?.permissions().mode() & 0o7777
    };
    client().write_file(id, guest, Some(mode), &mut file)?;
    Ok(0)
}

pub struct BuildArgs {
    pub name: String,
    pub vcpus: u8,
    pub mem_mib: u32,
    pub dir: Option<PathBuf>,
    pub tar: Option<PathBuf>,
    /// A container image (docker save archive, OCI layout dir or tar).
    pub image: Option<PathBuf>,
    pub kernel: Option<PathBuf>,
    /// The paths are the daemon host's, in its --template-source
    /// directories: sent as they are, not uploaded.
    pub on_host: bool,
    pub warmup: Vec<String>,
    pub network: bool,
    pub block_limit: Option<String>,
    pub net_limit: Option<String>,
    pub drive_slots: u8,
    pub fs_slots: u8,
    pub nested_virt: bool,
}

/// What `husk run` runs without a command: the entrypoint and command of
/// the image template `template` was built from (none otherwise).
pub fn image_command(template: &str) -> Result<Vec<String>, ApiClientError> {
    Ok(client()
        .template(template)?
        .image
        .map(|i| i.entrypoint.into_iter().chain(i.cmd).collect())
        .unwrap_or_default())
}

/// Why `path`, given with `flag`, cannot be used: it is not on this
/// machine; an image named like a registry reference is told how to get
/// one onto it.
fn missing(flag: &str, path: &std::path::Path) -> String {
    let text = path.to_string_lossy();
    let reference = flag == "--image"
        && !text.starts_with(['/', '.'])
        && (text.contains(':') || text.contains('/'));
    match reference {
        true => format!(
            "no such file or directory here; husk does not pull images from registries \
             yet: give a `docker save` archive or an OCI image layout of it (for example \
             `docker save {text} -o image.tar`, or `skopeo copy docker://{text} oci:DIR`)"
        ),
        false => "no such file or directory on this machine (the CLI uploads it; \
                  with --on-host the daemon reads it on its own)"
            .to_owned(),
    }
}

/// Builds a template, showing its progress.
pub fn template_build(a: BuildArgs) -> CliResult {
    let abs = |p: PathBuf| std::path::absolute(&p).unwrap_or(p);
    let upload_file = |path: &std::path::Path| -> Result<String, ApiClientError> {
        let mut file = std::fs::File::open(path).map_err(|e| {
            ApiClientError::Io(std::io::Error::new(
                e.kind(),
                format!("{}: {e}", path.display()),
            ))
        })?;
        eprintln!("uploading {}", path.display());
        client().upload(&mut file)
    };
    // Files this machine uploads: one that is not here is said to be so,
    // before the daemon is asked anything.
    if !a.on_host {
        let named = [
            ("--dir", &a.dir),
            ("--tar", &a.tar),
            ("--kernel", &a.kernel),
        ];
        if let Some((flag, path)) = named
            .into_iter()
            .chain([("--image", &a.image)])
            .find_map(|(flag, p)| p.as_ref().filter(|p| !p.exists()).map(|p| (flag, p)))
        {
            eprintln!("husk: {flag} {}: {}", path.display(), missing(flag, path));
            return Ok(2);
        }
    }
    // clap lets at most one of --dir, --tar and --image through.
    let rootfs = match (a.dir, a.tar, a.image, a.on_host) {
        (Some(path), _, _, true) => RootfsSource::Dir { path: abs(path) },
        (_, Some(path), _, true) => RootfsSource::Tar { path: abs(path) },
        (_, _, Some(path), true) => RootfsSource::Image { path: abs(path) },
        (Some(path), _, _, false) => {
            eprintln!("uploading {} as a tar archive", path.display());
            RootfsSource::Upload {
                upload: client().upload_dir(&path)?,
            }
        }
        (_, Some(path), _, false) => RootfsSource::Upload {
            upload: upload_file(&path)?,
        },
        (_, _, Some(path), false) if path.is_dir() => {
            eprintln!(
                "uploading the image layout {} as a tar archive",
                path.display()
            );
            RootfsSource::ImageUpload {
                upload: client().upload_dir(&path)?,
            }
        }
        (_, _, Some(path), false) => RootfsSource::ImageUpload {
            upload: upload_file(&path)?,
        },
        (None, None, None, _) => RootfsSource::Default,
    };
    let kernel = match (a.kernel, a.on_host) {
        (Some(path), true) => Some(KernelSource::Path(abs(path))),
        (Some(path), false) => Some(KernelSource::Upload {
            upload: upload_file(&path)?,
        }),
        (None, _) => None,
    };
    let spec = TemplateSpec {
        name: a.name,
        vcpus: a.vcpus,
        mem_mib: a.mem_mib,
        rootfs,
        warmup: a
            .warmup
            .into_iter()
            .map(|c| vec!["/bin/sh".to_owned(), "-c".to_owned(), c])
            .collect(),
        kernel,
        network: a.network,
        block_limit: a.block_limit,
        net_limit: a.net_limit,
        drive_slots: a.drive_slots,
        fs_slots: a.fs_slots,
        nested_virt: a.nested_virt,
    };
    let started = std::time::Instant::now();
    let template = client()
        .build_template(&spec)?
        .finish(|message| eprintln!("[{:>6.1} s] {message}", started.elapsed().as_secs_f64()))?;
    eprintln!(
        "[{:>6.1} s] built: {}",
        started.elapsed().as_secs_f64(),
        template
            .build_ms
            .iter()
            .map(|(k, v)| format!("{k} {v:.0} ms"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("{} {}", template.name, template.id);
    Ok(0)
}

pub fn template_ls(as_json: bool) -> CliResult {
    let list = client().templates()?;
    if as_json {
        print_json(&list);
        return Ok(0);
    }
    println!(
        "{:<24}  {:<17}  {:>5}  {:>8}  SOURCE",
        "NAME", "ID", "VCPUS", "MEM_MIB"
    );
    for t in list {
        println!(
            "{:<24}  {:<17}  {:>5}  {:>8}  {}",
            t.name, t.id, t.vcpus, t.mem_mib, t.source
        );
    }
    Ok(0)
}

pub fn template_inspect(name: &str) -> CliResult {
    print_json(&client().template(name)?);
    Ok(0)
}

pub fn template_rm(name: &str) -> CliResult {
    client().remove_template(name)?;
    println!("{name}");
    Ok(0)
}

pub fn template_verify(name: &str) -> CliResult {
    let v = client().verify_template(name)?;
    println!(
        "{name}: ok ({} files)",
        v["files"].as_array().map_or(0, Vec::len)
    );
    Ok(0)
}

pub fn pool_set(template: &str, size: u32) -> CliResult {
    let p = client().set_pool(template, size)?;
    println!("{} target={} ready={}", p.template_name, p.target, p.ready);
    Ok(0)
}

pub fn pool_ls(as_json: bool) -> CliResult {
    let list = client().pools()?;
    if as_json {
        print_json(&list);
        return Ok(0);
    }
    println!(
        "{:<24}  {:>6}  {:>5}  {:>9}  {:>6}  {:>6}",
        "TEMPLATE", "TARGET", "READY", "RESTORING", "HITS", "MISSES"
    );
    for p in list {
        println!(
            "{:<24}  {:>6}  {:>5}  {:>9}  {:>6}  {:>6}",
            p.template_name, p.target, p.ready, p.restoring, p.hits, p.misses
        );
    }
    Ok(0)
}

pub fn volume_create(name: &str) -> CliResult {
    let v = client().create_volume(name)?;
    println!("{}", v.id);
    Ok(0)
}

pub fn volume_ls(as_json: bool) -> CliResult {
    let list = client().volumes()?;
    if as_json {
        print_json(&list);
        return Ok(0);
    }
    println!("{:<20}  {:<24}  MOUNTED BY", "ID", "NAME");
    for v in list {
        println!("{:<20}  {:<24}  {}", v.id, v.name, v.mounted_by.join(","));
    }
    Ok(0)
}

/// Deletes each volume; the first refusal stops it.
pub fn volume_rm(names: &[String]) -> CliResult {
    let c = client();
    for name in names {
        c.delete_volume(name)?;
    }
    Ok(0)
}

/// Makes secret `name`, or updates it where it exists, with the one line
/// standard input holds.
pub fn secret_set(name: &str) -> CliResult {
    use std::io::Read;
    let mut value = String::new();
    if let Err(e) = std::io::stdin()
        .take(husk_types::MAX_SECRET_VALUE as u64 + 2)
        .read_to_string(&mut value)
    {
        eprintln!("husk: cannot read the secret's value from standard input: {e}");
        return Ok(2);
    }
    let value = value.strip_suffix('\n').unwrap_or(&value);
    let value = value.strip_suffix('\r').unwrap_or(value);
    let c = client();
    let exists = c.secrets()?.iter().any(|s| s.name == name);
    let s = match exists {
        true => c.update_secret(name, value)?,
        false => c.create_secret(name, value)?,
    };
    println!("{} {} version {}", s.id, s.name, s.version);
    Ok(0)
}

pub fn secret_ls(as_json: bool) -> CliResult {
    let list = client().secrets()?;
    if as_json {
        print_json(&list);
        return Ok(0);
    }
    println!("{:<20}  {:<32}  VERSION", "ID", "NAME");
    for s in list {
        println!("{:<20}  {:<32}  {}", s.id, s.name, s.version);
    }
    Ok(0)
}

/// Deletes each secret; the first refusal stops it.
pub fn secret_rm(names: &[String]) -> CliResult {
    let c = client();
    for name in names {
        c.delete_secret(name)?;
    }
    Ok(0)
}

pub fn audit(sandbox: Option<&str>, as_json: bool) -> CliResult {
    let log = client().audit(sandbox)?;
    if as_json {
        print_json(&log);
        return Ok(0);
    }
    for e in log {
        println!(
            "{} {:<16} {:<16} {} {} {}",
            e.unix_ms,
            e.who,
            e.action,
            e.sandbox.unwrap_or_else(|| "-".into()),
            e.template.unwrap_or_else(|| "-".into()),
            e.detail
        );
    }
    Ok(0)
}
