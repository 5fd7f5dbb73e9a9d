//! `husk serve`: the daemon.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use husk_core::daemon::{Daemon, DaemonConfig};
use husk_server::api::{self, Peer};

/// The daemon's options.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// State directory: database, templates, sandboxes' files (default
    /// $HUSK_STATE_DIR, else /var/lib/husk for root, else
    /// ~/.local/share/husk).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// The API's Unix socket (default <state dir>/husk.sock, mode 0660:
    /// who may open it may use the API).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Also listen on this TCP address (HOST:PORT); requests there need
    /// the bearer token in --token-file.
    #[arg(long, requires = "token_file")]
    pub tcp: Option<String>,
    /// File holding the TCP API's bearer token.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Default guest kernel of template builds.
    #[arg(long, env = "HUSK_KERNEL")]
    pub kernel: Option<PathBuf>,
    /// Default root file system (initramfs) of template builds.
    #[arg(long, env = "HUSK_INITRAMFS")]
    pub initramfs: Option<PathBuf>,
    /// Static guest-init, put into root file systems built from a
    /// directory or tar archive.
    #[arg(long, env = "HUSK_GUEST_INIT")]
    pub guest_init: Option<PathBuf>,
    /// The husk-vmm binary (default: next to this one).
    #[arg(long, env = "HUSK_VMM")]
    pub vmm: Option<PathBuf>,
    /// Most sandboxes on this host, pooled clones included (default 64).
    #[arg(long)]
    pub max_sandboxes: Option<u32>,
    /// Most hibernated sandboxes (default 4096; they do not count against
    /// --max-sandboxes).
    #[arg(long)]
    pub max_hibernated: Option<u32>,
    /// Disk the hibernated sandboxes may take together, in MiB (default:
    /// half the state directory's file system); a hibernation past it is
    /// refused with 429 and the sandbox left as it was.
    #[arg(long)]
    pub hibernated_disk_mib: Option<u64>,
    /// After how many seconds unused a running sandbox's guest is asked,
    /// once per idle period, to drop its page cache and compact its free
    /// memory, which free page reporting then gives back to the host
    /// (default 60; 0: never).
    #[arg(long)]
    pub reclaim_idle_s: Option<u64>,
    /// Guest memory all sandboxes together may have, in MiB (default:
    /// three quarters of the host's memory).
    #[arg(long)]
    pub memory_mib: Option<u64>,
    /// Most restores at once (default: the CPU count).
    #[arg(long)]
    pub restore_parallel: Option<u32>,
    /// Seconds a restored clone may take to answer on a quiet host
    /// (stretched by load; default 120).
    #[arg(long)]
    pub restore_wait_s: Option<u64>,
    /// Seconds a template's boot may take on a quiet host (default 900).
    #[arg(long)]
    pub boot_wait_s: Option<u64>,
    /// Run VMMs without cgroup limits (by default each gets memory, CPU
    /// and pid limits when this host's cgroups can be managed).
    #[arg(long)]
    pub no_cgroups: bool,
    /// Run VMMs without their jail (own namespaces, root, uid): for
    /// debugging only; each VMM then has the daemon's privileges and sees
    /// the host's files. The jail needs root.
    #[arg(long)]
    pub no_jail: bool,
    /// Network namespace (a file such as /run/netns/NAME) in which the
    /// egress proxy resolves names and opens its connections; default: the
    /// daemon's own. The proxy's allowlists and address checks apply
    /// either way.
    #[arg(long)]
    pub egress_netns: Option<PathBuf>,
    /// Certificates (PEM) the egress proxy trusts besides the public roots
    /// when it opens TLS to a host a sandbox holds credentials for (a
    /// private API's CA, a test server's).
    #[arg(long)]
    pub egress_upstream_ca: Option<PathBuf>,
    /// Serve the E2B API (control plane and envd) on this TCP address, so
    /// E2B's SDKs drive husk sandboxes (E2B_API_URL=E2B_SANDBOX_URL=http://ADDR).
    #[arg(long, requires = "e2b_api_key_file")]
    pub e2b: Option<String>,
    /// The API keys E2B clients must send (X-API-KEY), one per line.
    #[arg(long)]
    pub e2b_api_key_file: Option<PathBuf>,
    /// Serve sandboxes' ports over HTTP on this address (the front door;
    /// `--expose` alone: 127.0.0.1:8080): a request for
    /// PORT-SANDBOXID.DOMAIN reaches TCP PORT inside that sandbox
    /// (WebSockets too). Open to whoever reaches the address, except the
    /// ports of sandboxes created with private ports.
    #[arg(long, num_args = 0..=1, default_missing_value = "127.0.0.1:8080")]
    pub expose: Option<String>,
    /// The domain of the front door's host names (default `localhost`:
    /// browsers take *.localhost to be this machine).
    #[arg(long, default_value = "localhost", requires = "expose")]
    pub expose_domain: String,
    /// Serve the front door over HTTPS with this certificate chain (PEM;
    /// a certificate for `*.DOMAIN`), with --expose-tls-key.
    #[arg(long, requires_all = ["expose", "expose_tls_key"])]
    pub expose_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --expose-tls-cert.
    #[arg(long, requires = "expose_tls_cert")]
    pub expose_tls_key: Option<PathBuf>,
    /// Sandboxes one MCP client (a session on `/mcp`) may hold at once.
    #[arg(long, default_value_t = 4)]
    pub mcp_max_sandboxes: usize,
    /// Longest a command an MCP client runs may take, in seconds.
    #[arg(long, default_value_t = 300)]
    pub mcp_max_command_s: u64,
    /// A host directory API clients may build templates from by path (a
    /// root file system directory or tar, a kernel) (repeatable). Without
    /// one, every such file comes as an upload (the CLI's default): the
    /// daemon runs as root and reads no other host path for a client.
    #[arg(long = "template-source")]
    pub template_sources: Vec<PathBuf>,
    /// A host directory beneath which sandboxes may be given directories
    /// live (`husk run --mount`, a create's `mounts`) (repeatable).
    /// Without one, no sandbox sees a host directory.
    #[arg(long = "mount-root")]
    pub mount_roots: Vec<PathBuf>,
    /// A directory of Kubernetes pods' network namespaces (the CRI's)
    /// whose pods' sandboxes may join them (`POST
    /// /v1/sandboxes/{id}/network`, the containerd shim) (repeatable).
    /// Default: /var/run/netns, containerd's.
    #[arg(long = "pod-netns-dir")]
    pub pod_netns_dirs: Vec<PathBuf>,
    /// Largest upload for a template build, in MiB (default 8192).
    #[arg(long)]
    pub max_upload_mib: Option<u64>,
    /// Most background programs (the process API's: `husk exec -d`, `POST
    /// /v1/sandboxes/{id}/processes`) running at once in one sandbox
    /// (default 32).
    #[arg(long)]
    pub max_processes: Option<u32>,
}

/// The state directory when none is given.
pub use husk_client::default_state_dir;

pub fn serve(args: ServeArgs) -> Result<u8, String> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    // Before any thread starts (they inherit it): a claim is host work of
    // a few hundred microseconds spread over several threads, and on a
    // busy host each of them otherwise waits out a neighbour's slice.
    if let Err(e) = husk_vmm_api::sched::set_slice(Some(husk_vmm_api::sched::SHORT_SLICE)) {
        tracing::debug!("the host refused a short slice: {e}");
    }
    let state_dir = args.state_dir.unwrap_or_else(default_state_dir);
    std::fs::create_dir_all(&state_dir).map_err(|e| {
        format!(
            "cannot create the state directory {}: {e}",
            state_dir.display()
        )
    })?;
    let state_dir = std::fs::canonicalize(&state_dir).map_err(|e| e.to_string())?;
    // The defaults are the core's (one place); the flags change them.
    let mut cfg = DaemonConfig::new(&state_dir);
    if let Some(vmm) = args.vmm {
        cfg.set_vmm(vmm);
    }
    if !cfg.vmm.is_file() {
        return Err(format!(
            "the VMM binary {} does not exist: build it (cargo build --release -p husk-vmm) or \
             pass --vmm",
            cfg.vmm.display()
        ));
    }
    if args.no_jail {
        tracing::warn!(
            "THE JAIL IS OFF (--no-jail): every VMM runs with this daemon's privileges and sees the host's files"
        );
        cfg.jail = None;
    } else {
        // The defaults jail every VMM when this runs as root.
        let Some(jail) = &cfg.jail else {
            return Err(
                "each VMM runs in a jail, which needs root: run husk serve as root (or, to debug \
                 without the jail, pass --no-jail)"
                    .into(),
            );
        };
        if !jail.jailer.is_file() {
            return Err(format!(
                "the jailer {} does not exist: build it (cargo build --release -p husk-jailer)",
                jail.jailer.display()
            ));
        }
    }
    let real_dirs = |flag: &str, dirs: &[PathBuf]| {
        dirs.iter()
            .map(|dir| match std::fs::canonicalize(dir) {
                Ok(real) if real.is_dir() => Ok(real),
                Ok(_) => Err(format!("{flag} {}: not a directory", dir.display())),
                Err(e) => Err(format!("{flag} {}: {e}", dir.display())),
            })
            .collect::<Result<Vec<_>, _>>()
    };
    cfg.template_sources = real_dirs("--template-source", &args.template_sources)?;
    cfg.mount_roots = real_dirs("--mount-root", &args.mount_roots)?;
    if !args.pod_netns_dirs.is_empty() {
        cfg.pod_netns_dirs = real_dirs("--pod-netns-dir", &args.pod_netns_dirs)?;
    }
    // Real paths: builds run in jails that bind them by absolute path, and
    // the daemon's working directory is nobody's business.
    let real = |flag: &str, path: Option<PathBuf>| {
        path.map(|p| std::fs::canonicalize(&p).map_err(|e| format!("{flag} {}: {e}", p.display())))
            .transpose()
    };
    cfg.kernel = real("--kernel", args.kernel)?;
    cfg.initramfs = real("--initramfs", args.initramfs)?;
    cfg.guest_init = real("--guest-init", args.guest_init)?;
    cfg.max_sandboxes = args.max_sandboxes.unwrap_or(cfg.max_sandboxes);
    cfg.max_hibernated = args.max_hibernated.unwrap_or(cfg.max_hibernated);
    if let Some(mib) = args.hibernated_disk_mib {
        cfg.max_hibernated_bytes = mib.saturating_mul(1 << 20);
    }
    if let Some(s) = args.reclaim_idle_s {
        cfg.reclaim_idle = (s > 0).then(|| Duration::from_secs(s));
    }
    cfg.memory_mib = args.memory_mib.unwrap_or(cfg.memory_mib);
    cfg.restore_parallel = args.restore_parallel.unwrap_or(cfg.restore_parallel);
    if let Some(s) = args.restore_wait_s {
        cfg.restore_wait = Duration::from_secs(s);
    }
    if let Some(s) = args.boot_wait_s {
        cfg.boot_wait = Duration::from_secs(s);
    }
    if args.no_cgroups {
        cfg.cgroups = None;
    }
    match &cfg.cgroups {
        Some(h) => tracing::info!("VMMs get cgroup {} limits", h.name()),
        None if args.no_cgroups => {}
        None => tracing::warn!(
            "no writable cgroup hierarchy with memory, cpu and pids: VMMs run without limits"
        ),
    }
    cfg.egress_netns = args.egress_netns;
    cfg.egress_upstream_ca = args.egress_upstream_ca;
    if let Some(mib) = args.max_upload_mib {
        cfg.max_upload_bytes = mib.saturating_mul(1 << 20);
    }
    if let Some(max) = args.max_processes {
        if max == 0 || max as usize > husk_protocol::MAX_PROCESSES {
            return Err(format!(
                "--max-processes {max}: give 1 to {}",
                husk_protocol::MAX_PROCESSES
            ));
        }
        cfg.max_processes = max;
    }
    let expose = match &args.expose {
        Some(addr) => {
            let listener = std::net::TcpListener::bind(addr)
                .map_err(|e| format!("--expose {addr}: cannot listen: {e}"))?;
            let port = listener.local_addr().map_err(|e| e.to_string())?.port();
            let domain = args.expose_domain.trim_matches('.').to_ascii_lowercase();
            if domain.is_empty() || domain.contains(['/', ':', ' ']) {
                return Err(format!("--expose-domain {domain:?}: not a domain"));
            }
            let tls = match (&args.expose_tls_cert, &args.expose_tls_key) {
                (Some(cert), Some(key)) => Some(husk_server::front::tls_config(cert, key)?),
                _ => None,
            };
            cfg.front_door = Some(husk_core::daemon::FrontDoorAddr {
                domain,
                port,
                https: tls.is_some(),
            });
            Some((listener, tls))
        }
        None => None,
    };
    let token = match &args.token_file {
        Some(f) => Some(
            std::fs::read_to_string(f)
                .map_err(|e| format!("cannot read the token file {}: {e}", f.display()))?
                .trim()
                .to_owned(),
        )
        .filter(|t| t.len() >= 16)
        .ok_or("the bearer token must be at least 16 characters")?
        .into(),
        None => None,
    };
    let socket = args.socket.unwrap_or_else(|| state_dir.join("husk.sock"));
    let daemon = Daemon::start(cfg).map_err(|e| e.to_string())?;
    // MCP sessions on `/mcp` call the daemon in process.
    let mcp = husk_server::mcp::HttpService::new(
        daemon.clone(),
        husk_server::mcp::Limits {
            sandboxes: args.mcp_max_sandboxes,
            command_s: args.mcp_max_command_s,
            ..Default::default()
        },
    );
    let e2b = match (&args.e2b, &args.e2b_api_key_file) {
        (Some(addr), Some(file)) => {
            let keys: Vec<String> = std::fs::read_to_string(file)
                .map_err(|e| format!("cannot read the E2B key file {}: {e}", file.display()))?
                .lines()
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .map(str::to_owned)
                .collect();
            if keys.iter().any(|k| k.len() < 16) || keys.is_empty() {
                return Err(format!(
                    "{}: give one or more API keys of at least 16 characters",
                    file.display()
                ));
            }
            let gateway = husk_server::e2b::E2b::new(daemon.clone(), keys)
                .map_err(|e| format!("the E2B API: {e}"))?;
            Some((addr.clone(), gateway))
        }
        _ => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let front = expose
        .zip(daemon.config().front_door.clone())
        .map(|((listener, tls), addr)| {
            (
                listener,
                husk_server::front::FrontDoor::new(daemon.clone(), addr, tls),
            )
        });
    let result = runtime.block_on(listen(
        daemon.clone(),
        mcp,
        &socket,
        Listeners {
            tcp: args.tcp,
            token,
            e2b,
            front,
        },
    ));
    daemon.stop();
    let _ = std::fs::remove_file(&socket);
    result.map(|()| 0)
}

/// The daemon's listeners besides its Unix socket.
struct Listeners {
    /// The API on TCP, and the bearer token it wants.
    tcp: Option<String>,
    token: Option<String>,
    /// The E2B API's address and gateway.
    e2b: Option<(String, Arc<husk_server::e2b::E2b>)>,
    /// The front door to sandboxes' ports (bound already).
    front: Option<(std::net::TcpListener, Arc<husk_server::front::FrontDoor>)>,
}

async fn listen(
    daemon: Arc<Daemon>,
    mcp: Arc<husk_server::mcp::HttpService>,
    socket: &std::path::Path,
    Listeners {
        tcp,
        token,
        e2b,
        front,
    }: Listeners,
) -> Result<(), String> {
    // A socket left by a daemon that died is replaced; one that answers
    // belongs to a running daemon.
    if std::os::unix::net::UnixStream::connect(socket).is_ok() {
        return Err(format!(
            "another husk daemon is listening on {}",
            socket.display()
        ));
    }
    let _ = std::fs::remove_file(socket);
    let unix = tokio::net::UnixListener::bind(socket)
        .map_err(|e| format!("cannot listen on {}: {e}", socket.display()))?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o660))
            .map_err(|e| e.to_string())?;
    }
    tracing::info!("listening on {}", socket.display());
    let stop = shutdown_signal();
    tokio::pin!(stop);
    let unix_app = api::router(daemon.clone(), mcp.clone(), None)
        .into_make_service_with_connect_info::<Peer>();
    let (stop_tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let mut stop_unix = stop_tx.subscribe();
    let unix_server = tokio::spawn(async move {
        axum::serve(unix, unix_app)
            .with_graceful_shutdown(async move {
                let _ = stop_unix.recv().await;
            })
            .await
    });
    let tcp_server = match tcp {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(&addr)
                .await
                .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
            tracing::info!("listening on tcp {addr} (bearer token required)");
            let app = api::router(daemon, mcp.clone(), token)
                .into_make_service_with_connect_info::<Peer>();
            let mut stop_tcp = stop_tx.subscribe();
            Some(tokio::spawn(async move {
                axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stop_tcp.recv().await;
                    })
                    .await
            }))
        }
        None => None,
    };
    let e2b_server = match e2b {
        Some((addr, gateway)) => {
            let listener = tokio::net::TcpListener::bind(&addr)
                .await
                .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
            tracing::info!("E2B API on tcp {addr}");
            let app = husk_server::e2b::router(gateway);
            let mut stop_e2b = stop_tx.subscribe();
            Some(tokio::spawn(async move {
                axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stop_e2b.recv().await;
                    })
                    .await
            }))
        }
        None => None,
    };
    let front_server = match front {
        Some((listener, door)) => {
            let addr = listener.local_addr().map_err(|e| e.to_string())?;
            let listener = listener
                .set_nonblocking(true)
                .and_then(|()| tokio::net::TcpListener::from_std(listener))
                .map_err(|e| format!("the front door on {addr}: {e}"))?;
            tracing::info!("front door on tcp {addr}");
            let mut stop_front = stop_tx.subscribe();
            Some(tokio::spawn(async move {
                husk_server::front::serve(door, listener, async move {
                    let _ = stop_front.recv().await;
                })
                .await;
                Ok(())
            }))
        }
        None => None,
    };
    stop.await;
    tracing::info!("stopping; sandboxes keep running for the next daemon");
    let _ = stop_tx.send(());
    // MCP sessions end (their sandboxes go), and their event streams with
    // them.
    mcp.shutdown();
    // Streams in flight (a long exec) are not waited for past a moment.
    let _ = tokio::time::timeout(Duration::from_secs(5), unix_server).await;
    for t in [tcp_server, e2b_server, front_server].into_iter().flatten() {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
