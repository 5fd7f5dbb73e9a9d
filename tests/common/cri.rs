//! A CRI client as the kubelet uses one, and the images and pod and
//! container configurations the pod tests and benchmark share. Included by
//! them (`#[path = "common/cri.rs"] mod cri;`, with `common/oci.rs` as
//! `oci`).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::common::containerd::{Containerd, CRI_NAMESPACE, PAUSE_IMAGE};
use super::oci;
use husk_agent_client::readiness::WaitBudget;
use husk_cri_api::runtime_service_client::RuntimeServiceClient;
use husk_cri_api::{
    ContainerConfig, ContainerMetadata, ContainerStatus, ContainerStatusRequest,
    CreateContainerRequest, DnsConfig, ExecSyncRequest, ExecSyncResponse, ImageSpec,
    LinuxContainerConfig, LinuxContainerSecurityContext, LinuxPodSandboxConfig,
    LinuxSandboxSecurityContext, NamespaceMode, NamespaceOption, PodSandboxConfig,
    PodSandboxMetadata, PortMapping, Protocol, RemoveContainerRequest, RemovePodSandboxRequest,
    RunPodSandboxRequest, StartContainerRequest, StopContainerRequest, StopPodSandboxRequest,
};
use serde_json::json;
use tonic::transport::{Channel, Endpoint};

pub const BUSYBOX: &str = "husk.test/busybox:1";

/// A CRI connection to containerd's socket, as the kubelet makes one.
pub async fn connect(socket: PathBuf) -> Channel {
    Endpoint::try_from("http://localhost")
        .expect("endpoint")
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .expect("containerd's CRI socket")
}

/// The busybox image: the host's static busybox with the applets the pods
/// use, and a pause image whose program only sleeps (husk runs no pause
/// process: the pod's VM is its sandbox).
pub fn images() -> (Vec<u8>, Vec<u8>) {
    let busybox = std::fs::read("/bin/busybox").expect("/bin/busybox (busybox-static)");
    let applets = [
        "sh", "cat", "echo", "sleep", "mkdir", "httpd", "wget", "hostname", "ls", "id", "tr", "seq",
    ];
    let links: Vec<String> = applets.iter().map(|a| format!("bin/{a}")).collect();
    let mut tree: Vec<oci::LayerEntry<'_>> = vec![
        ("bin", None, None, 0o755, 0),
        ("bin/busybox", Some(&busybox), None, 0o755, 0),
    ];
    for l in &links {
        tree.push((l, None, Some("busybox"), 0o777, 0));
    }
    tree.extend_from_slice(&[
        ("etc", None, None, 0o755, 0),
        (
            "etc/os-release",
            Some(b"ID=husk-test-busybox\n"),
            None,
            0o644,
            0,
        ),
        ("tmp", None, None, 0o1777, 0),
        // A link out of the root, were it followed outside it (a volume
        // mounted through it must land in the container's own /etc).
        ("escape", None, Some("/etc"), 0o777, 0),
    ]);
    let env = json!(["PATH=/bin"]);
    let image = oci::single_layer(BUSYBOX, &tree, json!({ "Env": env, "Cmd": ["/bin/sh"] }));
    let pause = oci::single_layer(
        PAUSE_IMAGE,
        &tree[..2],
        json!({ "Env": env, "Entrypoint": ["/bin/busybox", "sleep", "2147483647"] }),
    );
    (image, pause)
}

pub fn import(ctrd: &Containerd, archive: &[u8], name: &str) {
    let file = ctrd
        .dir
        .join(format!("{}.tar", name.replace(['/', ':'], "_")));
    std::fs::write(&file, archive).expect("image archive");
    let out = ctrd
        .ctr_in(CRI_NAMESPACE, &["images", "import"])
        .arg(&file)
        .output()
        .expect("ctr images import");
    assert!(
        out.status.success(),
        "importing {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Host network, as a pod without CNI has (a husk pod's network is its VM).
pub fn namespaces() -> Option<NamespaceOption> {
    Some(NamespaceOption {
        network: NamespaceMode::Node as i32,
        pid: NamespaceMode::Pod as i32,
        ipc: NamespaceMode::Pod as i32,
        ..Default::default()
    })
}

/// The pod's DNS server and search domain, as the kubelet sets them.
pub const CLUSTER_DNS: &str = "10.96.0.10";
pub const SEARCH: &str = "default.svc.cluster.local";

/// `config` on the pod network (the kubelet's default: no hostNetwork),
/// with the cluster's DNS ([`CLUSTER_DNS`], [`SEARCH`]) and `ports` as
/// hostPort -> containerPort.
pub fn on_pod_network(mut config: PodSandboxConfig, ports: &[(u16, u16)]) -> PodSandboxConfig {
    config.hostname = config
        .metadata
        .as_ref()
        .map_or_else(String::new, |m| m.name.clone());
    config.dns_config = Some(DnsConfig {
        servers: vec![CLUSTER_DNS.into()],
        searches: vec![SEARCH.into()],
        options: vec!["ndots:5".into()],
    });
    config.port_mappings = ports
        .iter()
        .map(|&(host, container)| PortMapping {
            protocol: Protocol::Tcp as i32,
            container_port: container.into(),
            host_port: host.into(),
            host_ip: String::new(),
        })
        .collect();
    let ns = config
        .linux
        .as_mut()
        .and_then(|l| l.security_context.as_mut())
        .and_then(|c| c.namespace_options.as_mut())
        .expect("namespace options");
    ns.network = NamespaceMode::Pod as i32;
    config
}

/// A container of a pod on the pod network, as the kubelet asks for it.
pub fn in_pod_network(mut config: ContainerConfig) -> ContainerConfig {
    if let Some(ns) = config
        .linux
        .as_mut()
        .and_then(|l| l.security_context.as_mut())
        .and_then(|c| c.namespace_options.as_mut())
    {
        ns.network = NamespaceMode::Pod as i32;
    }
    config
}

pub fn pod_config(name: &str, logs: &Path) -> PodSandboxConfig {
    PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: name.into(),
            uid: format!("uid-{name}"),
            namespace: "default".into(),
            attempt: 0,
        }),
        // The node's network namespace: the kubelet sets no hostname then
        // (runc refuses one without a UTS namespace of its own).
        hostname: String::new(),
        log_directory: logs.display().to_string(),
        linux: Some(LinuxPodSandboxConfig {
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: namespaces(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub fn container_config(name: &str, command: &[&str]) -> ContainerConfig {
    ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(ImageSpec {
            image: BUSYBOX.into(),
            ..Default::default()
        }),
        command: command.iter().map(|s| (*s).to_owned()).collect(),
        log_path: format!("{name}.log"),
        linux: Some(LinuxContainerConfig {
            security_context: Some(LinuxContainerSecurityContext {
                namespace_options: namespaces(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// RunPodSandbox of `config` under `handler`; the pod's id.
pub async fn run_pod(
    runtime: &mut RuntimeServiceClient<Channel>,
    config: &PodSandboxConfig,
    handler: &str,
) -> String {
    runtime
        .run_pod_sandbox(RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: handler.into(),
        })
        .await
        .expect("RunPodSandbox")
        .into_inner()
        .pod_sandbox_id
}

/// StopPodSandbox and RemovePodSandbox, as the kubelet ends a pod.
pub async fn remove_pod(runtime: &mut RuntimeServiceClient<Channel>, id: &str) {
    runtime
        .stop_pod_sandbox(StopPodSandboxRequest {
            pod_sandbox_id: id.to_owned(),
        })
        .await
        .expect("StopPodSandbox");
    runtime
        .remove_pod_sandbox(RemovePodSandboxRequest {
            pod_sandbox_id: id.to_owned(),
        })
        .await
        .expect("RemovePodSandbox");
}

/// CreateContainer of `config` in pod `pod` (made with `pod_config`), then
/// StartContainer; the container's id.
pub async fn start_container(
    runtime: &mut RuntimeServiceClient<Channel>,
    (pod, pod_config): (&str, &PodSandboxConfig),
    config: ContainerConfig,
) -> String {
    let id = runtime
        .create_container(CreateContainerRequest {
            pod_sandbox_id: pod.to_owned(),
            config: Some(config),
            sandbox_config: Some(pod_config.clone()),
        })
        .await
        .expect("CreateContainer")
        .into_inner()
        .container_id;
    runtime
        .start_container(StartContainerRequest {
            container_id: id.clone(),
        })
        .await
        .expect("StartContainer");
    id
}

/// ExecSync of `cmd` in container `id`, within 300 s of a quiet host's CPU
/// (a `WaitBudget`, stretched by the host's load): containerd's own exec
/// timeout is a fixed wall-clock one, so none is passed to it.
pub async fn exec_sync(
    runtime: &mut RuntimeServiceClient<Channel>,
    id: &str,
    cmd: &[&str],
) -> ExecSyncResponse {
    let exec = runtime.exec_sync(ExecSyncRequest {
        container_id: id.to_owned(),
        cmd: cmd.iter().map(|s| (*s).to_owned()).collect(),
        timeout: 0,
    });
    let mut budget = WaitBudget::new(Duration::from_secs(300));
    let spent = async {
        while !budget.expired() {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        (budget.elapsed(), budget.last_share())
    };
    tokio::select! {
        reply = exec => reply.expect("ExecSync").into_inner(),
        (waited, share) = spent => panic!(
            "ExecSync of {cmd:?} in {id}: no answer after {waited:?} (the host's CPU share {share:.2})"
        ),
    }
}

/// StopContainer of `id`, killed after `timeout` seconds.
pub async fn stop_container(runtime: &mut RuntimeServiceClient<Channel>, id: &str, timeout: i64) {
    runtime
        .stop_container(StopContainerRequest {
            container_id: id.to_owned(),
            timeout,
        })
        .await
        .expect("StopContainer");
}

/// RemoveContainer of `id`.
pub async fn remove_container(runtime: &mut RuntimeServiceClient<Channel>, id: &str) {
    runtime
        .remove_container(RemoveContainerRequest {
            container_id: id.to_owned(),
        })
        .await
        .expect("RemoveContainer");
}

/// ContainerStatus of `id`.
pub async fn container_status(
    runtime: &mut RuntimeServiceClient<Channel>,
    id: &str,
) -> ContainerStatus {
    runtime
        .container_status(ContainerStatusRequest {
            container_id: id.to_owned(),
            verbose: false,
        })
        .await
        .expect("ContainerStatus")
        .into_inner()
        .status
        .expect("a status")
}

/// What a CRI streaming session (Exec or Attach) gave back: its output
/// and, for an exec, its status (the `v4.channel.k8s.io` error channel's
/// JSON).
#[derive(Debug, Default)]
pub struct Streamed {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub status: Option<serde_json::Value>,
}

/// A session with the CRI's streaming server, at the URL Exec or Attach
/// answered, over a WebSocket as `kubectl exec`/`attach` make one
/// (protocol `v4.channel.k8s.io`: each message's first byte is its
/// channel, 0 stdin, 1 stdout, 2 stderr, 3 the status).
pub struct Stream(tungstenite::WebSocket<std::net::TcpStream>);

impl Stream {
    pub fn open(url: &str) -> Stream {
        use tungstenite::client::IntoClientRequest;
        let address = url
            .split_once("://")
            .and_then(|(_, rest)| rest.split('/').next())
            .unwrap_or_else(|| panic!("the streaming URL `{url}`"));
        let tcp = std::net::TcpStream::connect(address).expect("the CRI's streaming server");
        // The guest is slow here: no read waits for ever.
        tcp.set_read_timeout(Some(super::common::BOOT_TIMEOUT))
            .expect("timeout");
        let mut request = url
            .replacen("http", "ws", 1)
            .into_client_request()
            .expect("the streaming URL");
        request.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            tungstenite::http::HeaderValue::from_static("v4.channel.k8s.io"),
        );
        let (ws, _) = tungstenite::client::client(request, tcp).expect("WebSocket upgrade");
        Stream(ws)
    }

    pub fn stdin(&mut self, data: &[u8]) {
        let mut message = vec![0];
        message.extend_from_slice(data);
        self.0
            .send(tungstenite::Message::binary(message))
            .expect("stdin");
    }

    /// Reads until `done` holds for what came, or the server ends the
    /// session.
    pub fn read_until(&mut self, done: impl Fn(&Streamed) -> bool) -> Streamed {
        let mut got = Streamed::default();
        while !done(&got) {
            match self.0.read() {
                Ok(tungstenite::Message::Binary(data)) if !data.is_empty() => match data[0] {
                    1 => got.stdout.extend_from_slice(&data[1..]),
                    2 => got.stderr.extend_from_slice(&data[1..]),
                    3 => got.status = Some(serde_json::from_slice(&data[1..]).expect("status")),
                    _ => {}
                },
                Ok(tungstenite::Message::Close(_))
                | Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => {
                    break
                }
                Ok(_) => {}
                Err(e) => panic!("the streaming session: {e} (so far: {got:?})"),
            }
        }
        got
    }

    pub fn close(mut self) {
        let _ = self.0.close(None);
        while self.0.read().is_ok() {}
    }
}
