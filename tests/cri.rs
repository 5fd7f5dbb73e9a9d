//! Kubernetes pods on husk, driven through containerd's CRI plugin the way
//! the kubelet drives it (a CRI client over containerd's socket: no `ctr`
//! for the pod's life): a private containerd configured for the `husk`
//! runtime handler, images the test makes and imports itself (a busybox
//! tree, and a pause image), one pod whose sandbox container becomes one
//! husk VM and whose two containers run inside that VM, each with its own
//! root file system, sharing localhost. The pods are on a pod network
//! that Debian's CNI plugins make in a node network namespace of the
//! test's own: each has its pod IP, reached from the node, from the other
//! pod and through a hostPort.

mod common;
#[path = "common/cri.rs"]
mod cri;
#[path = "common/oci.rs"]
mod oci;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use common::containerd::{
    processes_with, shim_socket_in, Containerd, CRI_NAMESPACE, PAUSE_IMAGE, POD_GATEWAY,
};
use cri::{
    connect, container_config, container_status, exec_sync, images, import, in_pod_network,
    on_pod_network, pod_config, remove_container, remove_pod, run_pod, start_container,
    stop_container, Stream, BUSYBOX, CLUSTER_DNS, SEARCH,
};
use husk_bench::density::vmms_below;
use husk_cri_api::image_service_client::ImageServiceClient;
use husk_cri_api::runtime_service_client::RuntimeServiceClient;
use husk_cri_api::{
    AttachRequest, ContainerState, ContainerStatsRequest, ExecRequest, ImageSpec,
    ImageStatusRequest, LinuxContainerResources, Mount, NamespaceMode, PodSandboxConfig,
    PodSandboxStatusRequest, UpdateContainerResourcesRequest, VersionRequest,
};

/// The husk sandboxes the daemon has, by id.
fn husk_sandboxes(ctrd: &Containerd) -> Vec<String> {
    sandbox_list(ctrd)
        .iter()
        .filter_map(|s| s["id"].as_str().map(str::to_owned))
        .collect()
}

/// `husk ps --json`.
fn sandbox_list(ctrd: &Containerd) -> Vec<serde_json::Value> {
    serde_json::from_slice(&ctrd.husk(&["ps", "--json"]).stdout).expect("husk ps")
}

/// The husk sandboxes the daemon has, with the name of the template each
/// is a clone of.
fn husk_vms(ctrd: &Containerd) -> Vec<(String, String)> {
    let templates: Vec<serde_json::Value> =
        serde_json::from_slice(&ctrd.husk(&["template", "ls", "--json"]).stdout)
            .expect("husk template ls");
    let name_of = |id: &str| {
        templates
            .iter()
            .find(|t| t["id"] == id)
            .and_then(|t| t["name"].as_str())
            .unwrap_or(id)
            .to_owned()
    };
    sandbox_list(ctrd)
        .iter()
        .filter_map(|s| {
            Some((
                s["id"].as_str()?.to_owned(),
                name_of(s["template"].as_str()?),
            ))
        })
        .collect()
}

/// The pod's containers' limits, summed into its config as the kubelet
/// does (`LinuxPodSandboxConfig.resources`).
fn with_limits(mut config: PodSandboxConfig, limits: &LinuxContainerResources) -> PodSandboxConfig {
    if let Some(linux) = config.linux.as_mut() {
        linux.resources = Some(limits.clone());
    }
    config
}

/// The web pod's hostPort for its server's port 8080.
const HOST_PORT: u16 = 18080;

/// `GET http://{addr}/` over HTTP/1.0 from the calling thread's network
/// namespace: the body, or why not.
fn http_get(addr: &str) -> Result<String, String> {
    use std::io::{Read, Write};
    let addr: std::net::SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let mut conn = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(30))
        .map_err(|e| format!("connect {addr}: {e}"))?;
    conn.set_read_timeout(Some(Duration::from_secs(120)))
        .map_err(|e| e.to_string())?;
    conn.write_all(b"GET / HTTP/1.0\r\n\r\n")
        .map_err(|e| format!("{addr}: {e}"))?;
    let mut reply = String::new();
    conn.read_to_string(&mut reply)
        .map_err(|e| format!("{addr}: {e}"))?;
    match reply.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.") && head.contains(" 200 ") => {
            Ok(body.to_owned())
        }
        _ => Err(format!("{addr} answered {reply:?}")),
    }
}

/// The pod's IP, as the CRI reports it (from its CNI's result).
async fn pod_ip(
    runtime: &mut RuntimeServiceClient<tonic::transport::Channel>,
    pod: &str,
) -> String {
    runtime
        .pod_sandbox_status(PodSandboxStatusRequest {
            pod_sandbox_id: pod.to_owned(),
            verbose: false,
        })
        .await
        .expect("PodSandboxStatus")
        .into_inner()
        .status
        .and_then(|s| s.network)
        .map(|n| n.ip)
        .unwrap_or_default()
}

/// The client's request to the server, on the pod's localhost.
const FETCH: &[&str] = &fetch("http://127.0.0.1:8080/");

/// A container's command that prints what `url` serves (no proxy).
const fn fetch(url: &str) -> [&str; 7] {
    ["wget", "-Y", "off", "-q", "-O", "-", url]
}

/// Where the guest of pod VM `vm` has ext4 file systems mounted (the
/// drives' media).
fn media_roots(ctrd: &Containerd, vm: &str) -> std::collections::BTreeSet<String> {
    let mounts = ctrd.husk(&["exec", vm, "--", "/bin/cat", "/proc/mounts"]);
    String::from_utf8_lossy(&mounts.stdout)
        .lines()
        .filter(|l| l.split(' ').nth(2) == Some("ext4"))
        .filter_map(|l| l.split(' ').nth(1).map(str::to_owned))
        .collect()
}

/// The root file system of pod container `id` in its pod's VM.
fn container_root(id: &str) -> String {
    format!("/run/husk/containers/{id}/rootfs")
}

/// The shim processes serving this containerd (others may run on the
/// host: another test binary's, another containerd's).
fn shims(ctrd: &Containerd) -> usize {
    let address = ctrd.dir.join("containerd.sock").display().to_string();
    processes_with(&["containerd-shim-husk-v2", &address]).len()
}

#[test]
fn a_pod_is_one_vm_whose_containers_share_localhost_with_roots_of_their_own() {
    if let Some(why) = common::containerd::missing().or_else(common::containerd::missing_cni) {
        common::skip(&why);
        return;
    }
    let ctrd = Containerd::start_cri("cri");
    // The pods' VMs are clones of `base` (its first build boots it), with
    // a network device for the pod network. Its two empty drives take two
    // containers' root file systems as media; a third container's tree is
    // copied into the VM. Its three empty fs slots take volumes as shares.
    ctrd.husk(&[
        "template",
        "build",
        "base",
        "--drive-slots",
        "2",
        "--fs-slots",
        "3",
        "--network",
    ]);
    let (image, pause) = images();
    import(&ctrd, &image, BUSYBOX);
    import(&ctrd, &pause, PAUSE_IMAGE);
    let logs = ctrd.dir.join("pod-logs");
    std::fs::create_dir_all(&logs).expect("log dir");
    let shims_before = shims(&ctrd);

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let pod = rt.block_on(async {
        let channel = connect(ctrd.dir.join("containerd.sock")).await;
        let mut runtime = RuntimeServiceClient::new(channel.clone());
        let mut images = ImageServiceClient::new(channel);
        let version = runtime
            .version(VersionRequest::default())
            .await
            .expect("Version")
            .into_inner();
        assert_eq!(version.runtime_name, "containerd", "{version:?}");
        let status = images
            .image_status(ImageStatusRequest {
                image: Some(ImageSpec {
                    image: BUSYBOX.into(),
                    ..Default::default()
                }),
                verbose: false,
            })
            .await
            .expect("ImageStatus")
            .into_inner();
        assert!(
            status.image.is_some(),
            "the imported image is not seen by the CRI"
        );

        // RunPodSandbox: one husk VM, and no VM for the pause container.
        // The pod's limits (the loner's 8 MiB and 0.8 CPU, below) fit in
        // `base`: its VM is a clone of it.
        let loner_limits = LinuxContainerResources {
            memory_limit_in_bytes: 8 << 20,
            cpu_quota: 80_000,
            cpu_period: 100_000,
            ..Default::default()
        };
        let config = on_pod_network(
            with_limits(pod_config("web", &logs), &loner_limits),
            &[(HOST_PORT, 8080)],
        );
        let pod = run_pod(&mut runtime, &config, "husk").await;
        let vms = husk_vms(&ctrd);
        assert_eq!(vms.len(), 1, "one VM for the pod: {vms:?}");
        assert_eq!(vms[0].1, "base", "{vms:?}");

        // Two containers: one serves on localhost, the other reaches it.
        let server = start_container(
            &mut runtime,
            (&pod, &config),
            in_pod_network(container_config(
                "server",
                &[
                    "/bin/sh",
                    "-c",
                    "mkdir -p /www && echo hello-from-the-server > /www/index.html && \
                     echo serving && exec httpd -f -p 8080 -h /www",
                ],
            )),
        )
        .await;
        let client = start_container(
            &mut runtime,
            (&pod, &config),
            in_pod_network(container_config("client", &["/bin/sleep", "100000"])),
        )
        .await;
        assert_eq!(husk_sandboxes(&ctrd).len(), 1, "the containers made VMs");
        assert_eq!(shims(&ctrd), shims_before + 1, "one shim for the pod");

        // The client reaches the server on localhost (it may still be
        // starting: the guest is slow here).
        let mut fetched = None;
        for _ in 0..30 {
            let reply = exec_sync(&mut runtime, &client, FETCH).await;
            if reply.exit_code == 0 {
                fetched = Some(String::from_utf8_lossy(&reply.stdout).into_owned());
                break;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        assert_eq!(
            fetched.as_deref().map(str::trim),
            Some("hello-from-the-server")
        );
        // The pod has its IP on the pod network: the node reaches the
        // server there (as a Service's traffic does), and through the
        // pod's hostPort on the node's address (portmap's DNAT).
        let web_ip = pod_ip(&mut runtime, &pod).await;
        assert!(web_ip.starts_with("10.88.7."), "the pod's IP: {web_ip:?}");
        let (direct, host_port) = ctrd.in_node(|| {
            (
                http_get(&format!("{web_ip}:8080")),
                http_get(&format!("{POD_GATEWAY}:{HOST_PORT}")),
            )
        });
        assert_eq!(
            direct.as_deref().map(str::trim),
            Ok("hello-from-the-server")
        );
        assert_eq!(
            host_port.as_deref().map(str::trim),
            Ok("hello-from-the-server")
        );
        // The guest's interface took the pod interface's MAC (the one the
        // pod network expects its frames from).
        let web_vm = husk_sandboxes(&ctrd).pop().expect("the pod's VM");
        let (pod_netns, pod_mac) = netns_of(&mut runtime, &pod).await;
        assert_eq!(guest_mac(&ctrd, &web_vm), pod_mac, "the guest's MAC");
        // Exit codes come back; each container has its own root: the
        // server's /www is not in the client's.
        let code = exec_sync(&mut runtime, &client, &["sh", "-c", "exit 3"]).await;
        assert_eq!(code.exit_code, 3);
        let own_root = exec_sync(
            &mut runtime,
            &client,
            &["sh", "-c", "cat /etc/os-release; ls /www"],
        )
        .await;
        assert!(
            String::from_utf8_lossy(&own_root.stdout).contains("husk-test-busybox"),
            "{own_root:?}"
        );
        assert_ne!(own_root.exit_code, 0, "the client sees the server's /www");
        // The CRI's files for the pod (hosts, resolver, hostname) are in
        // each container, as containerd wrote them.
        let files = exec_sync(
            &mut runtime,
            &client,
            &[
                "sh",
                "-c",
                "cat /etc/hosts; echo @; cat /etc/resolv.conf; echo @; cat /etc/hostname",
            ],
        )
        .await;
        let pod_dir = ctrd
            .dir
            .join("root/io.containerd.grpc.v1.cri/sandboxes")
            .join(&pod);
        let expected: Vec<String> = ["hosts", "resolv.conf", "hostname"]
            .iter()
            .map(|f| std::fs::read_to_string(pod_dir.join(f)).expect("containerd's pod file"))
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&files.stdout),
            expected.join("@\n"),
            "{files:?}"
        );
        assert!(
            expected[1].contains(&format!("nameserver {CLUSTER_DNS}"))
                && expected[1].contains(SEARCH),
            "the pod's DNS: {}",
            expected[1]
        );

        // A container with a PID namespace of its own (Kubernetes'
        // default; the two above share the pod's, as with
        // shareProcessNamespace) and a memory limit.
        let mut loner = container_config("loner", &["/bin/sleep", "100000"]);
        if let Some(linux) = loner.linux.as_mut() {
            if let Some(ns) = linux
                .security_context
                .as_mut()
                .and_then(|c| c.namespace_options.as_mut())
            {
                ns.pid = NamespaceMode::Container as i32;
            }
            linux.resources = Some(loner_limits);
        }
        // A volume (a host directory, as a hostPath or an emptyDir of a
        // pod with an fsGroup: not root's): a live share in one of the
        // VM's fs slots. The loner writes to it, the host sees that, the
        // client (below) reads it.
        let volume = ctrd.dir.join("volume");
        std::fs::create_dir_all(volume.join("sub")).expect("volume");
        std::fs::write(volume.join("sub/seed.txt"), "seeded\n").expect("volume file");
        for path in [&volume, &volume.join("sub"), &volume.join("sub/seed.txt")] {
            std::os::unix::fs::chown(path, Some(4242), Some(4242)).expect("chown");
        }
        // A configMap as the kubelet writes one (root's, read-only, each
        // key a link through `..data` to a timestamped directory that an
        // update replaces): shared read-only, its update seen in the pod.
        let config_map = ctrd.dir.join("config-map");
        let kubelet_writes = |version: &str| {
            let dated = format!("..{version}");
            std::fs::create_dir_all(config_map.join(&dated)).expect("configMap");
            std::fs::write(config_map.join(&dated).join("key"), version).expect("key");
            let link = config_map.join("..data_tmp");
            std::os::unix::fs::symlink(&dated, &link).expect("..data_tmp");
            std::fs::rename(&link, config_map.join("..data")).expect("..data");
        };
        kubelet_writes("v1");
        std::os::unix::fs::symlink("..data/key", config_map.join("key")).expect("key link");
        // An emptyDir as the kubelet makes one (root's, mode 0777, empty):
        // given to the volumes' owner and shared, so what the pod writes
        // there is on the host.
        let empty_dir = ctrd
            .dir
            .join("pods/0a1b/volumes/kubernetes.io~empty-dir/cache");
        std::fs::create_dir_all(&empty_dir).expect("emptyDir");
        std::fs::set_permissions(&empty_dir, std::fs::Permissions::from_mode(0o777))
            .expect("chmod");
        let mount = |at: &str, dir: &Path, readonly: bool| Mount {
            container_path: at.into(),
            host_path: dir.to_string_lossy().into_owned(),
            readonly,
            ..Default::default()
        };
        loner.mounts = vec![
            mount("/data", &volume, false),
            mount("/escape/volume", &volume, true),
            mount("/etc/config", &config_map, true),
            mount("/cache", &empty_dir, false),
        ];
        let loner = start_container(&mut runtime, (&pod, &config), loner).await;
        let wrote = exec_sync(
            &mut runtime,
            &loner,
            &[
                "sh",
                "-c",
                "cat /data/sub/seed.txt /etc/volume/sub/seed.txt && \
                     echo from-the-loner > /data/note && echo cached > /cache/made && \
                     cat /etc/config/key",
            ],
        )
        .await;
        assert_eq!(
            (
                wrote.exit_code,
                String::from_utf8_lossy(&wrote.stdout).as_ref()
            ),
            (0, "seeded\nseeded\nv1"),
            "{wrote:?}"
        );
        {
            use std::os::unix::fs::MetadataExt;
            let note =
                std::fs::metadata(volume.join("note")).expect("the loner's note on the host");
            assert_eq!(
                std::fs::read_to_string(volume.join("note")).expect("note"),
                "from-the-loner\n"
            );
            assert_eq!((note.uid(), note.gid()), (4242, 4242), "the note's owner");
            let made = std::fs::metadata(empty_dir.join("made")).expect("the emptyDir's file");
            assert_eq!(
                std::fs::read_to_string(empty_dir.join("made")).expect("made"),
                "cached\n"
            );
            let owner = husk_types::VOLUME_OWNER;
            assert_eq!(
                (made.uid(), made.gid()),
                (owner, owner),
                "the emptyDir file's owner"
            );
        }
        kubelet_writes("v2");
        let updated = exec_sync(
            &mut runtime,
            &loner,
            &[
                "sh",
                "-c",
                "cat /etc/config/key; (echo x > /etc/config/key) 2>&1",
            ],
        )
        .await;
        let updated = String::from_utf8_lossy(&updated.stdout).into_owned();
        assert!(
            updated.starts_with("v2") && updated.contains("Read-only"),
            "the configMap's update in the pod: {updated:?}"
        );
        // The link was followed inside the container's root, not the VM's.
        let vm = husk_sandboxes(&ctrd).pop().expect("the pod's VM");
        let outside = ctrd.husk_output(&["exec", &vm, "--", "/bin/sh", "-c", "ls /etc/volume"]);
        assert!(
            !outside.status.success()
                && String::from_utf8_lossy(&outside.stderr).contains("No such file"),
            "a volume was bound outside the root: {outside:?}"
        );
        // The server's and the client's roots are the drives' media (the
        // first two), the loner's a copy in the VM's memory.
        assert_eq!(
            media_roots(&ctrd, &vm),
            [container_root(&client), container_root(&server)]
                .into_iter()
                .collect::<std::collections::BTreeSet<_>>(),
        );
        let processes =
            "for p in /proc/[0-9]*; do echo \"${p#/proc/} $(tr '\\0' ' ' < $p/cmdline)\"; done";
        let seen_alone = exec_sync(&mut runtime, &loner, &["sh", "-c", processes]).await;
        let seen_shared = exec_sync(&mut runtime, &client, &["sh", "-c", processes]).await;
        let alone = String::from_utf8_lossy(&seen_alone.stdout).into_owned();
        let shared = String::from_utf8_lossy(&seen_shared.stdout).into_owned();
        assert!(
            alone.lines().any(|l| l.trim() == "1 /bin/sleep 100000"),
            "{alone}"
        );
        assert!(
            !alone.contains("httpd"),
            "the loner sees the pod's processes: {alone}"
        );
        assert!(
            shared.contains("httpd"),
            "the shared namespace lacks the server: {shared}"
        );
        // Its memory and CPU limits are its cgroup's in the pod's VM (each
        // of the three containers has one; the other two are unbounded),
        // and the memory limit holds: a program that takes more is killed.
        let limits = |file: &str| {
            let limit = ctrd.husk(&[
                "exec",
                &vm,
                "--",
                "/bin/sh",
                "-c",
                &format!("cat /sys/fs/cgroup/sandbox/c*/{file}"),
            ]);
            let mut limits: Vec<String> = String::from_utf8_lossy(&limit.stdout)
                .lines()
                .map(str::to_owned)
                .collect();
            limits.sort();
            limits
        };
        assert_eq!(limits("memory.max"), ["8388608", "max", "max"]);
        assert_eq!(
            limits("cpu.max"),
            ["80000 100000", "max 100000", "max 100000"]
        );
        let hog = exec_sync(
            &mut runtime,
            &loner,
            &[
                "sh",
                "-c",
                // 32 MiB in the shell's memory (no pipe: the guest
                // kernel's copies are slow here).
                "x=a; for i in $(seq 25); do x=$x$x; done; echo survived",
            ],
        )
        .await;
        assert_eq!(hog.exit_code, 137, "{hog:?}");
        assert!(!String::from_utf8_lossy(&hog.stdout).contains("survived"));
        // Its stats are its own cgroup's in the pod's VM: within its
        // limit, with the CPU time the hog spent.
        let stats = runtime
            .container_stats(ContainerStatsRequest {
                container_id: loner.clone(),
            })
            .await
            .expect("ContainerStats")
            .into_inner()
            .stats
            .expect("the loner's stats");
        let memory = stats
            .memory
            .and_then(|m| m.working_set_bytes)
            .map(|v| v.value);
        let cpu = stats
            .cpu
            .and_then(|c| c.usage_core_nano_seconds)
            .map(|v| v.value);
        assert!(
            memory.is_some_and(|m| m > 0 && m <= 8 << 20),
            "the loner's memory: {memory:?}"
        );
        assert!(cpu.is_some_and(|c| c > 0), "the loner's CPU time: {cpu:?}");
        // UpdateContainerResources (the kubelet's in-place resize): its
        // cgroup's limits change, the others' stay.
        runtime
            .update_container_resources(UpdateContainerResourcesRequest {
                container_id: loner.clone(),
                linux: Some(LinuxContainerResources {
                    memory_limit_in_bytes: 24 << 20,
                    cpu_quota: 20_000,
                    cpu_period: 100_000,
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .expect("UpdateContainerResources");
        assert_eq!(limits("memory.max"), ["25165824", "max", "max"]);
        assert_eq!(
            limits("cpu.max"),
            ["20000 100000", "max 100000", "max 100000"]
        );
        stop_container(&mut runtime, &loner, 2).await;
        remove_container(&mut runtime, &loner).await;

        // The client restarts as the kubelet restarts a container (a new
        // one of the same name); the server runs on untouched.
        let server_started = container_status(&mut runtime, &server).await.started_at;
        stop_container(&mut runtime, &client, 10).await;
        remove_container(&mut runtime, &client).await;
        // It reads its stdin this time (kept open between attaches).
        let mut again = container_config(
            "client",
            &["/bin/sh", "-c", "while read l; do echo \"got:$l\"; done"],
        );
        if let Some(m) = again.metadata.as_mut() {
            m.attempt = 1;
        }
        again.stdin = true;
        again.mounts = vec![mount("/shared", &volume, true)];
        let client = start_container(&mut runtime, (&pod, &config), again).await;
        // The restarted client's root is a medium again, in the drive the
        // first one's removal freed.
        assert_eq!(
            media_roots(&ctrd, &vm),
            [container_root(&client), container_root(&server)]
                .into_iter()
                .collect::<std::collections::BTreeSet<_>>(),
        );
        // The volume is the pod's: what the loner wrote outlived its
        // removal, and comes read-only here.
        let read = exec_sync(
            &mut runtime,
            &client,
            &[
                "sh",
                "-c",
                "cat /shared/sub/seed.txt /shared/note; echo x > /shared/other",
            ],
        )
        .await;
        assert_eq!(
            String::from_utf8_lossy(&read.stdout),
            "seeded\nfrom-the-loner\n",
            "{read:?}"
        );
        assert_ne!(read.exit_code, 0, "a read-only volume took a write");
        assert!(
            String::from_utf8_lossy(&read.stderr).contains("Read-only"),
            "{read:?}"
        );
        // Attach (`kubectl attach -i`): what goes in reaches the
        // container's program, and what it says comes back.
        let url = runtime
            .attach(AttachRequest {
                container_id: client.clone(),
                stdin: true,
                stdout: true,
                stderr: true,
                tty: false,
            })
            .await
            .expect("Attach")
            .into_inner()
            .url;
        // The streaming server listens in the node's network namespace.
        let mut attached = ctrd.in_node(|| Stream::open(&url));
        attached.stdin(b"through-attach\n");
        let said = attached.read_until(|s| s.stdout.ends_with(b"got:through-attach\n"));
        assert_eq!(
            String::from_utf8_lossy(&said.stdout).trim(),
            "got:through-attach",
            "{said:?}"
        );
        attached.close();
        // Exec (`kubectl exec -i`): stdin in, both outputs and the exit
        // code back.
        let url = runtime
            .exec(ExecRequest {
                container_id: client.clone(),
                cmd: ["sh", "-c", "read l; echo \"in:$l\"; echo oops >&2; exit 5"]
                    .map(str::to_owned)
                    .to_vec(),
                stdin: true,
                stdout: true,
                stderr: true,
                tty: false,
            })
            .await
            .expect("Exec")
            .into_inner()
            .url;
        let mut exec = ctrd.in_node(|| Stream::open(&url));
        exec.stdin(b"through-exec\n");
        let done = exec.read_until(|s| s.status.is_some());
        exec.close();
        assert_eq!(
            (
                String::from_utf8_lossy(&done.stdout).as_ref(),
                String::from_utf8_lossy(&done.stderr).as_ref()
            ),
            ("in:through-exec\n", "oops\n"),
            "{done:?}"
        );
        let status = done.status.unwrap_or_default();
        assert_eq!(status["reason"], "NonZeroExitCode", "{status}");
        assert_eq!(status["details"]["causes"][0]["message"], "5", "{status}");

        let refetched = exec_sync(&mut runtime, &client, FETCH).await;
        assert_eq!(
            String::from_utf8_lossy(&refetched.stdout).trim(),
            "hello-from-the-server",
            "{refetched:?}"
        );
        let server_now = container_status(&mut runtime, &server).await;
        assert_eq!(server_now.state, ContainerState::ContainerRunning as i32);
        assert_eq!(server_now.started_at, server_started);

        let served = exec_sync(&mut runtime, &server, &["cat", "/www/index.html"]).await;
        assert_eq!(
            String::from_utf8_lossy(&served.stdout).trim(),
            "hello-from-the-server"
        );

        // The server's output went through containerd's FIFOs to its log.
        let log = logs.join("server.log");
        let mut logged = String::new();
        for _ in 0..30 {
            logged = std::fs::read_to_string(&log).unwrap_or_default();
            if logged.contains("serving") {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        assert!(logged.contains("serving"), "{}: {logged:?}", log.display());

        let stats = runtime
            .container_stats(ContainerStatsRequest {
                container_id: server.clone(),
            })
            .await
            .expect("ContainerStats")
            .into_inner();
        let memory = stats
            .stats
            .and_then(|s| s.memory)
            .and_then(|m| m.working_set_bytes);
        assert!(memory.is_some_and(|m| m.value > 0), "no memory figure");

        // A pod whose limits (160 MiB, 1.5 CPUs) `base` cannot hold: its
        // VM is a copy of `base` at the pod's size (the limits and 64 MiB
        // for the guest, in 64 MiB steps: 256 MiB; 2 vCPUs).
        let limits = LinuxContainerResources {
            memory_limit_in_bytes: 160 << 20,
            cpu_quota: 150_000,
            cpu_period: 100_000,
            ..Default::default()
        };
        let doomed_config = on_pod_network(with_limits(pod_config("doomed", &logs), &limits), &[]);
        let doomed = run_pod(&mut runtime, &doomed_config, "husk").await;
        let vms = husk_vms(&ctrd);
        assert_eq!(
            vms.iter()
                .filter(|(id, _)| *id != web_vm)
                .map(|(_, t)| t.as_str())
                .collect::<Vec<_>>(),
            ["base-256m-2c"],
            "{vms:?}"
        );
        let mut sleeper = in_pod_network(container_config("sleeper", &["/bin/sleep", "100000"]));
        if let Some(linux) = sleeper.linux.as_mut() {
            linux.resources = Some(limits);
        }
        let sleeper = start_container(&mut runtime, (&doomed, &doomed_config), sleeper).await;
        let size = exec_sync(
            &mut runtime,
            &sleeper,
            &[
                "sh",
                "-c",
                "grep -c ^processor /proc/cpuinfo; grep MemTotal /proc/meminfo",
            ],
        )
        .await;
        let size = String::from_utf8_lossy(&size.stdout).into_owned();
        let mut lines = size.lines();
        assert_eq!(lines.next(), Some("2"), "the pod VM's vCPUs: {size}");
        let kib: u64 = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or_else(|| panic!("no MemTotal: {size}"));
        // More than `base`'s 128 MiB could give (the kernel keeps some of
        // the 256).
        assert!(kib > 200 << 10, "the pod VM's memory: {kib} KiB");
        // One pod reaches the other by its pod IP.
        let doomed_ip = pod_ip(&mut runtime, &doomed).await;
        assert!(
            doomed_ip.starts_with("10.88.7.") && doomed_ip != web_ip,
            "the second pod's IP: {doomed_ip:?}"
        );
        let across = exec_sync(
            &mut runtime,
            &sleeper,
            &fetch(&format!("http://{web_ip}:8080/")),
        )
        .await;
        assert_eq!(
            String::from_utf8_lossy(&across.stdout).trim(),
            "hello-from-the-server",
            "pod to pod: {across:?}"
        );

        // Stop and remove the web pod's containers, then the pod.
        for id in [&client, &server] {
            stop_container(&mut runtime, id, 10).await;
            let state = container_status(&mut runtime, id).await;
            assert_eq!(state.state, ContainerState::ContainerExited as i32);
            remove_container(&mut runtime, id).await;
        }
        assert!(
            husk_sandboxes(&ctrd).contains(&web_vm),
            "the pod's VM went with a container"
        );
        remove_pod(&mut runtime, &pod).await;
        assert!(
            !Path::new(&pod_netns).exists(),
            "the web pod's network namespace is left"
        );

        // It dies: its container is reported exited, with a failing
        // status.
        let vmms = vmms_below(ctrd.daemon_pid());
        assert_eq!(vmms.len(), 1, "the doomed pod's VMM");
        // SAFETY: signalling a process by pid.
        unsafe { libc::kill(vmms[0] as i32, libc::SIGKILL) };
        let mut status = None;
        for _ in 0..60 {
            let s = container_status(&mut runtime, &sleeper).await;
            if s.state == ContainerState::ContainerExited as i32 {
                status = Some(s);
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let status = status.expect("the container of a dead VM is reported exited");
        assert_ne!(status.exit_code, 0, "{status:?}");
        assert!(!status.reason.is_empty(), "{status:?}");
        let (doomed_netns, _) = netns_of(&mut runtime, &doomed).await;
        remove_container(&mut runtime, &sleeper).await;
        remove_pod(&mut runtime, &doomed).await;
        assert!(
            !Path::new(&doomed_netns).exists(),
            "the second pod's network namespace is left"
        );
        pod
    });

    // Nothing left: no VM, no VMM, no shim, no socket of the pod's shim.
    let socket = shim_socket_in(&ctrd.dir, CRI_NAMESPACE, &pod);
    let left = || {
        (
            husk_sandboxes(&ctrd),
            vmms_below(ctrd.daemon_pid()).len(),
            shims(&ctrd),
            socket.exists(),
        )
    };
    let mut now = left();
    for _ in 0..60 {
        if now == (Vec::new(), 0, shims_before, false) {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
        now = left();
    }
    let (vms, vmms, shims_after, socket_left) = now;
    assert!(vms.is_empty(), "VMs left: {vms:?}");
    assert_eq!(vmms, 0, "VMMs left");
    assert_eq!(shims_after, shims_before, "a shim was left");
    assert!(!socket_left, "the pod's shim socket is left");
    // Nothing of the pods is left on the node's network: no pod interface
    // (the CNI's veths) or TAP beside the bridge, no per-pod iptables
    // chain (portmap's hostPort), no address held by the IPAM.
    let (links, nat) = ctrd.in_node(|| {
        (
            output("ip", &["-o", "link", "show"]),
            output("iptables", &["-t", "nat", "-S"]),
        )
    });
    let links: Vec<&str> = links
        .lines()
        .filter_map(|l| l.split(": ").nth(1)?.split('@').next())
        .collect();
    assert_eq!(links, ["lo", "hkbr0"], "links left in the node's namespace");
    assert!(
        !nat.contains("CNI-DN-"),
        "a pod's hostPort chain is left:\n{nat}"
    );
    let held: Vec<String> = std::fs::read_dir(ctrd.dir.join("cni/ipam/husk-test"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("10.88.7."))
        .collect();
    assert!(held.is_empty(), "pod IPs still held: {held:?}");
}

/// The stdout of `program args` run here; fails unless it succeeds.
fn output(program: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Pod `pod`'s network namespace and the MAC of its interface `eth0`, from
/// the CRI's verbose status (the sandbox's spec, its CNI result).
async fn netns_of(
    runtime: &mut RuntimeServiceClient<tonic::transport::Channel>,
    pod: &str,
) -> (String, String) {
    let info = runtime
        .pod_sandbox_status(PodSandboxStatusRequest {
            pod_sandbox_id: pod.to_owned(),
            verbose: true,
        })
        .await
        .expect("PodSandboxStatus")
        .into_inner()
        .info;
    let info: serde_json::Value =
        serde_json::from_str(info.get("info").map_or("{}", String::as_str)).expect("status info");
    let netns = info["runtimeSpec"]["linux"]["namespaces"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|ns| ns["type"] == "network")
        .and_then(|ns| ns["path"].as_str())
        .unwrap_or_else(|| panic!("no network namespace in the pod's spec: {info}"));
    let mac = info["cniResult"]["Interfaces"]["eth0"]["Mac"]
        .as_str()
        .unwrap_or_else(|| panic!("no eth0 in the pod's CNI result: {info}"));
    (netns.to_owned(), mac.to_owned())
}

/// The MAC address of the guest's network interface in VM `vm`.
fn guest_mac(ctrd: &Containerd, vm: &str) -> String {
    let out = ctrd.husk(&["exec", vm, "--", "/bin/cat", "/sys/class/net/eth0/address"]);
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}
