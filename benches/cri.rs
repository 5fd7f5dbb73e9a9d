//! Kubernetes pods through containerd's CRI, as the kubelet starts them:
//! RunPodSandbox + CreateContainer + StartContainer to the container's
//! first line in its log (containerd's FIFOs to the CRI log file), for
//! - runc (the pause container and the container are processes on the
//!   host);
//! - husk, not pooled: the pod's VM is a restore of `base`'s snapshot,
//!   and the container's root file system a medium in one of its empty
//!   drives (an ext4 image the daemon makes once per tree);
//! - husk, pooled: the pod names `base` (`io.husk.template`), whose warm
//!   pool holds a parked clone;
//! - husk, not pooled, tree copied: the pod names `copied`, a template
//!   without empty drives, so the container's tree is copied into the
//!   VM's memory;
//! - runc and husk (restored, pooled) on the pod network: the pod gets a
//!   network namespace that Debian's CNI plugins configure (a bridge,
//!   host-local addresses) and husk's VM joins it (TAP moved in, tc
//!   mirred both ways, the guest's interface configured by its agent).
//!
//! And the pod VM's memory (PSS of its VMM) with 1 and with 3 containers.
//!
//! Run:
//!
//!     cargo build --release -p husk-cli -p husk-jailer -p husk-shim && cargo bench --bench cri
//!     HUSK_BENCH_RUNS=5   runs per path
//!
//! Needs root, containerd and runc (it says so and stops otherwise). Guest
//! steps on an emulating (PVM) host are ~1000x slower than on hardware KVM;
//! the numbers are this host's.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/cri.rs"]
mod cri;
#[path = "../tests/common/oci.rs"]
mod oci;

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::containerd::{Containerd, PAUSE_IMAGE};
use cri::{
    connect, container_config, images, import, in_pod_network, on_pod_network, pod_config,
    remove_pod, run_pod, start_container, BUSYBOX,
};
use husk_bench::density::vmms_below;
use husk_bench::report::Memory;
use husk_cri_api::runtime_service_client::RuntimeServiceClient;
use tonic::transport::Channel;

/// Waits for the first line of a CRI log file; when it came.
async fn first_line(log: &Path) -> Instant {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        if std::fs::read_to_string(log).is_ok_and(|t| t.contains("first output")) {
            return Instant::now();
        }
        assert!(Instant::now() < deadline, "no output in {}", log.display());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One pod of `containers` containers under `handler`: the time from
/// RunPodSandbox to the first container's first line, and the VMM's PSS
/// (KiB) once all have started (husk only). The pod is removed after.
async fn pod(
    runtime: &mut RuntimeServiceClient<Channel>,
    handler: &str,
    annotations: &HashMap<String, String>,
    (run, containers, network): (usize, usize, bool),
    ctrd: &Containerd,
) -> (Duration, Option<u64>) {
    let net = if network { "-net" } else { "" };
    let name = format!("{handler}-{run}-{containers}{net}");
    let dir = ctrd.dir.join("pod-logs").join(&name);
    std::fs::create_dir_all(&dir).expect("log dir");
    let mut config = husk_cri_api::PodSandboxConfig {
        annotations: annotations.clone(),
        ..pod_config(&name, &dir)
    };
    if network {
        config = on_pod_network(config, &[]);
    }
    let started = Instant::now();
    let id = run_pod(runtime, &config, handler).await;
    let mut first = None;
    for c in 0..containers {
        let command = if c == 0 {
            vec!["/bin/sh", "-c", "echo first output; exec sleep 100000"]
        } else {
            vec!["/bin/sleep", "100000"]
        };
        let mut container = container_config(&format!("c{c}"), &command);
        if network {
            container = in_pod_network(container);
        }
        start_container(runtime, (&id, &config), container).await;
        if c == 0 {
            first = Some(first_line(&dir.join("c0.log")).await - started);
        }
    }
    // The pod's VMM, below the daemon (none for runc).
    let pss = vmms_below(ctrd.daemon_pid())
        .first()
        .and_then(|&pid| Memory::of(pid))
        .map(|m| m.pss_kib);
    remove_pod(runtime, &id).await;
    (first.expect("a container"), pss)
}

fn report(label: &str, runs: &[Duration]) {
    let ms: Vec<f64> = runs.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    println!(
        "{label:<26} n={:<2} to the first output p50 {:>9.1} ms (min {:>9.1}, max {:>9.1})",
        runs.len(),
        common::percentile(&ms, 0.5),
        common::percentile(&ms, 0.0),
        common::percentile(&ms, 1.0),
    );
}

fn main() {
    let Some(runs) = common::containerd::bench_runs("CRI") else {
        return;
    };
    let ctrd = Containerd::start_cri("bench");
    ctrd.husk(&[
        "template",
        "build",
        "base",
        "--drive-slots",
        "3",
        "--network",
    ]);
    ctrd.husk(&["template", "build", "copied"]);
    let (image, pause) = images();
    import(&ctrd, &image, BUSYBOX);
    import(&ctrd, &pause, PAUSE_IMAGE);
    let logs = ctrd.dir.join("pod-logs");
    let pooled = HashMap::from([("io.husk.template".to_owned(), "base".to_owned())]);
    let copied = HashMap::from([("io.husk.template".to_owned(), "copied".to_owned())]);
    let none = HashMap::new();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let mut runtime =
            RuntimeServiceClient::new(connect(ctrd.dir.join("containerd.sock")).await);
        let (mut runc, mut restored, mut claimed) = (Vec::new(), Vec::new(), Vec::new());
        let mut restored_copy = Vec::new();
        let (mut runc_net, mut restored_net, mut claimed_net) =
            (Vec::new(), Vec::new(), Vec::new());
        let mut pss = Vec::new();
        // runc's pods need what the host's runc can do with the CRI's spec
        // (namespaces, cgroups): said and left out where it cannot.
        let probe = runtime
            .run_pod_sandbox(husk_cri_api::RunPodSandboxRequest {
                config: Some(pod_config("runc-probe", &logs)),
                runtime_handler: "runc".into(),
            })
            .await;
        let runc_works = match probe {
            Ok(reply) => {
                remove_pod(&mut runtime, &reply.into_inner().pod_sandbox_id).await;
                true
            }
            Err(e) => {
                println!("runc: no pod runs here, left out: {}", e.message());
                false
            }
        };
        for run in 0..runs {
            for (network, runc, restored, claimed) in [
                (false, &mut runc, &mut restored, &mut claimed),
                (true, &mut runc_net, &mut restored_net, &mut claimed_net),
            ] {
                if runc_works {
                    runc.push(
                        pod(&mut runtime, "runc", &none, (run, 1, network), &ctrd)
                            .await
                            .0,
                    );
                }
                ctrd.pool("base", 0);
                let (t, m) = pod(&mut runtime, "husk", &none, (run, 1, network), &ctrd).await;
                restored.push(t);
                if !network {
                    pss.extend(m.map(|m| (1, m)));
                }
                ctrd.pool("base", 1);
                ctrd.wait_for_pool("base", 1);
                claimed.push(
                    pod(&mut runtime, "husk", &pooled, (run, 1, network), &ctrd)
                        .await
                        .0,
                );
            }
            ctrd.pool("base", 0);
            restored_copy.push(
                pod(&mut runtime, "husk", &copied, (run, 1, false), &ctrd)
                    .await
                    .0,
            );
        }
        ctrd.pool("base", 0);
        let (_, three) = pod(&mut runtime, "husk", &none, (runs, 3, false), &ctrd).await;
        let version = std::process::Command::new("containerd")
            .arg("--version")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default();
        println!(
            "{version}: RunPodSandbox + CreateContainer + StartContainer to the container's \
             first line in its log"
        );
        if runc_works {
            report("runc", &runc);
        }
        report("husk, not pooled (restore)", &restored);
        report("husk, pooled", &claimed);
        report("husk, not pooled, copied", &restored_copy);
        if runc_works {
            report("runc, pod network", &runc_net);
        }
        report("husk, restore, pod network", &restored_net);
        report("husk, pooled, pod network", &claimed_net);
        let one: Vec<f64> = pss.iter().map(|(_, m)| *m as f64).collect();
        println!(
            "husk pod VM PSS: 1 container p50 {:.0} KiB; 3 containers {} KiB",
            common::percentile(&one, 0.5),
            three.map_or("?".into(), |m| m.to_string())
        );
    });
}
