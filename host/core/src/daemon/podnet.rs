//! A Kubernetes pod's network for its sandbox (`POST
//! /v1/sandboxes/{id}/network`): the CRI made the pod a network namespace
//! and its CNI plugins gave it an interface, `eth0` (a veth with the pod's
//! IP, routes, a MAC the pod network expects), before the pod's sandbox
//! was asked for. The sandbox's TAP moves from its jail's network namespace
//! into the pod's, the TAP and `eth0` are joined by tc's mirred both ways
//! (Kata's tcfilter model: every frame that reaches one leaves by the
//! other; `eth0` keeps its address, its own stack never sees a frame), and
//! the guest's interface takes `eth0`'s MAC, MTU, address and routes (the
//! agent's `Network`). This works for a pooled clone as for a fresh one:
//! nothing of the pod is in a snapshot.
//!
//! The VMM needs no change: its TAP descriptor works wherever the device
//! is, and the VMM itself stays in its jail's namespace, which now has no
//! interface but loopback. For the pod's traffic the CNI and the cluster's
//! network policy decide; the sandbox's own egress policy still governs
//! what goes through its proxy. Only namespaces beneath the daemon's pod
//! namespace directories (`--pod-netns-dir`, the CRI's) are joined, and
//! never the daemon's own.
//!
//! Commands run in a namespace (`ip`, `tc` of iproute2) are spawned into
//! it (`setns` between fork and exec): no thread of the daemon changes
//! namespace, and no descriptor of the pod's namespace is kept, so that it
//! goes when the CRI removes it. The TAP is deleted from it when the
//! sandbox goes (it is persistent, owned by the jail's uid).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::process::Command;

use husk_protocol::{NetConfig, Route};
use husk_types::{PodNetworkInfo, PodNetworkRequest};

use super::*;

/// The pod's interface, as the CRI names it for its CNI plugins.
const POD_INTERFACE: &str = "eth0";

impl Daemon {
    /// Joins running sandbox `id` to the pod network namespace
    /// `req.netns`: see the module's documentation.
    pub fn attach_pod_network(
        &self,
        id: &str,
        req: PodNetworkRequest,
        who: &str,
    ) -> Result<PodNetworkInfo, DaemonError> {
        let rec = self.in_state(
            id,
            SandboxState::Running,
            "a running sandbox joins a pod's network",
        )?;
        let (netns, ns) = self.check_pod_netns(&req.netns)?;
        let tap = rec.tap.clone().ok_or_else(|| {
            DaemonError::Invalid(format!(
                "sandbox `{id}` has no network device: its template `{}` was built without one \
                 (husk template build --network)",
                rec.template
            ))
        })?;
        // Recorded before the TAP moves, so that the sandbox's destroy
        // finds it there whatever step fails below.
        let ((), rec) = self.change_record(id, |rec| match &rec.pod_netns {
            Some(already) => Err(DaemonError::Conflict(format!(
                "sandbox `{id}` is on the pod network of {} already",
                already.display()
            ))),
            None => {
                rec.pod_netns = Some(netns.clone());
                Ok(())
            }
        })?;
        self.store.put_sandbox(&rec)?;
        let config = pod_interface(&ns, &netns)?;
        join(rec.pid, &tap, (&ns, &netns), config.mtu)?;
        self.agent(id)?.configure_network(&config)?;
        let info = PodNetworkInfo {
            mac: crate::vmm_process::mac_text(&config.mac),
            mtu: config.mtu,
            address: format!(
                "{}/{}",
                std::net::Ipv4Addr::from(config.addr.0),
                config.addr.1
            ),
            routes: config.routes.iter().map(route_text).collect(),
        };
        let what = format!("{} {} via {tap}", netns.display(), info.address);
        self.store
            .audit(who, "pod-network", Some(id), None, &what)?;
        Ok(info)
    }

    /// `path`, resolved and open, if it is a network namespace beneath one
    /// of the daemon's pod namespace directories and not the daemon's own.
    fn check_pod_netns(&self, path: &str) -> Result<(PathBuf, File), DaemonError> {
        let bad = |why: String| Err(DaemonError::Invalid(format!("pod netns `{path}`: {why}")));
        if self.cfg.pod_netns_dirs.is_empty() {
            return bad(
                "this daemon joins no pod networks: start it with --pod-netns-dir DIR (the \
                 CRI's network namespaces, /var/run/netns by default)"
                    .into(),
            );
        }
        let real = match std::fs::canonicalize(path) {
            Ok(real) => real,
            Err(e) => return bad(e.to_string()),
        };
        if !self.cfg.pod_netns_dirs.iter().any(|d| real.starts_with(d)) {
            return bad(format!(
                "not beneath the pod namespace directories ({})",
                self.cfg
                    .pod_netns_dirs
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        let file = File::open(&real).map_err(|e| DaemonError::Invalid(format!("{path}: {e}")))?;
        if !is_netns(&file) {
            return bad("not a network namespace".into());
        }
        let own = std::fs::metadata("/proc/self/ns/net").map_err(DaemonError::Io)?;
        let its = file.metadata().map_err(DaemonError::Io)?;
        if (its.dev(), its.ino()) == (own.dev(), own.ino()) {
            return bad("the host's own network namespace".into());
        }
        Ok((real, file))
    }
}

/// Removes sandbox `rec`'s TAP from the pod network namespace it was moved
/// to, if that namespace is still there (the CRI removes it after the
/// pod's sandbox, along with `eth0` and its filters).
pub(super) fn leave_pod_network(rec: &SandboxRecord) {
    let (Some(netns), Some(tap)) = (&rec.pod_netns, &rec.tap) else {
        return;
    };
    let Ok(ns) = File::open(netns) else {
        return;
    };
    if !is_netns(&ns) {
        return;
    }
    if let Err(e) = run_in(&ns, "ip", &["link", "delete", "dev", tap]) {
        // Gone already (with the namespace's last user) is what was asked.
        if !e.contains("Cannot find device") {
            tracing::warn!(sandbox = %rec.id, "removing its TAP from the pod network: {e}");
        }
    }
}

/// Whether `file` is a network namespace (a bind mount of one, or a
/// `/proc/PID/ns/net`).
fn is_netns(file: &File) -> bool {
    const NS_GET_NSTYPE: libc::c_ulong = 0xb703;
    // SAFETY: NS_GET_NSTYPE takes no argument and returns the type; on a
    // file that is not a namespace it fails with ENOTTY.
    let kind = unsafe { libc::ioctl(file.as_raw_fd(), NS_GET_NSTYPE as _) };
    kind == libc::CLONE_NEWNET
}

/// Runs `program args` in network namespace `ns`; its stdout, or why it
/// failed (its stderr).
fn run_in(ns: &File, program: &str, args: &[&str]) -> Result<String, String> {
    let fd = ns.as_raw_fd();
    // iproute2's, where Debian puts it whatever the daemon's PATH.
    let path = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .map(|dir| Path::new(dir).join(program))
        .find(|p| p.exists())
        .ok_or_else(|| {
            format!("no `{program}` (iproute2) in /usr/sbin, /sbin, /usr/bin or /bin")
        })?;
    let mut cmd = Command::new(path);
    cmd.args(args).stdin(std::process::Stdio::null());
    // SAFETY: only setns(2), async-signal-safe, runs between fork and
    // exec; `fd` stays open in the child (the parent holds `ns` across
    // the spawn).
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd
        .output()
        .map_err(|e| format!("{program} {}: {e}", args.join(" ")))?;
    if !out.status.success() {
        return Err(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn open_netns(path: &Path) -> Result<File, DaemonError> {
    File::open(path)
        .map_err(|e| DaemonError::Failed(format!("network namespace {}: {e}", path.display())))
}

fn failed(step: &str) -> impl FnOnce(String) -> DaemonError + '_ {
    move |e| DaemonError::Failed(format!("{step}: {e}"))
}

/// What the pod's interface has (a netlink dump through `ip -j`): its MAC
/// and MTU, its IPv4 address, and the routes through it other than its
/// subnet's (which the guest's address brings).
fn pod_interface(ns: &File, netns: &Path) -> Result<NetConfig, DaemonError> {
    let json = |args: &[&str]| -> Result<serde_json::Value, DaemonError> {
        let out = run_in(ns, "ip", args).map_err(failed("reading the pod's interface"))?;
        serde_json::from_str(&out).map_err(|e| {
            DaemonError::Failed(format!(
                "`ip {}` said something else than JSON: {e}",
                args.join(" ")
            ))
        })
    };
    let missing = |what: &str| {
        DaemonError::Invalid(format!(
            "the pod network's {POD_INTERFACE} in {} has no {what} (did its CNI plugins run?)",
            netns.display()
        ))
    };
    let link = json(&["-j", "link", "show", "dev", POD_INTERFACE])?;
    let link = &link[0];
    let mac = link["address"]
        .as_str()
        .and_then(parse_mac)
        .ok_or_else(|| missing("MAC address"))?;
    let mtu = link["mtu"]
        .as_u64()
        .and_then(|m| u32::try_from(m).ok())
        .ok_or_else(|| missing("MTU"))?;
    let addrs = json(&["-j", "-4", "addr", "show", "dev", POD_INTERFACE])?;
    let addr = addrs[0]["addr_info"]
        .as_array()
        .and_then(|a| a.iter().find(|a| a["family"] == "inet"))
        .and_then(|a| {
            let ip: std::net::Ipv4Addr = a["local"].as_str()?.parse().ok()?;
            Some((ip.octets(), u8::try_from(a["prefixlen"].as_u64()?).ok()?))
        })
        .ok_or_else(|| missing("IPv4 address"))?;
    let routes = json(&["-j", "-4", "route", "show", "dev", POD_INTERFACE])?;
    let routes = routes
        .as_array()
        .into_iter()
        .flatten()
        // The subnet's own route comes with the guest's address.
        .filter(|r| r["protocol"] != "kernel")
        .map(|r| parse_route(r).ok_or_else(|| missing(&format!("route it can carry ({r})"))))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(NetConfig {
        mac,
        mtu,
        addr,
        routes,
    })
}

/// A route of `ip -j route`: `dst` (`default`, `A.B.C.D` or
/// `A.B.C.D/N`) and `gateway`, if any.
fn parse_route(r: &serde_json::Value) -> Option<Route> {
    let dst = match r["dst"].as_str()? {
        "default" => ([0; 4], 0),
        dst => {
            let (ip, len) = dst.split_once('/').unwrap_or((dst, "32"));
            let ip: std::net::Ipv4Addr = ip.parse().ok()?;
            (ip.octets(), len.parse().ok().filter(|&l| l <= 32)?)
        }
    };
    let via = match r.get("gateway") {
        None => None,
        Some(g) => Some(g.as_str()?.parse::<std::net::Ipv4Addr>().ok()?.octets()),
    };
    Some(Route { dst, via })
}

fn route_text(r: &Route) -> String {
    let dst = format!("{}/{}", std::net::Ipv4Addr::from(r.dst.0), r.dst.1);
    match r.via {
        Some(via) => format!("{dst} via {}", std::net::Ipv4Addr::from(via)),
        None => dst,
    }
}

fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let bytes: Vec<u8> = text
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).ok())
        .collect::<Option<_>>()?;
    <[u8; 6]>::try_from(bytes).ok()
}

/// Moves TAP `tap` from the network namespace of process `pid` (the
/// sandbox's jail) into `netns` (open as `ns`), and joins it to the pod's
/// interface.
fn join(pid: u32, tap: &str, (ns, netns): (&File, &Path), mtu: u32) -> Result<(), DaemonError> {
    let jail = open_netns(Path::new(&format!("/proc/{pid}/ns/net")))?;
    let target = netns.display().to_string();
    run_in(&jail, "ip", &["link", "set", "dev", tap, "netns", &target]).map_err(failed(
        "moving the sandbox's TAP into the pod's network namespace",
    ))?;
    let mtu = mtu.to_string();
    let steps: [(&str, &[&str]); 5] = [
        ("ip", &["link", "set", "dev", tap, "mtu", &mtu, "up"]),
        ("tc", &["qdisc", "add", "dev", POD_INTERFACE, "ingress"]),
        ("tc", &["qdisc", "add", "dev", tap, "ingress"]),
        ("tc", &redirect(POD_INTERFACE, tap)),
        ("tc", &redirect(tap, POD_INTERFACE)),
    ];
    for (program, args) in steps {
        run_in(ns, program, args).map_err(failed("joining the TAP to the pod's interface"))?;
    }
    Ok(())
}

/// tc's arguments that send every frame arriving at `from` out of `to`.
fn redirect<'a>(from: &'a str, to: &'a str) -> [&'a str; 19] {
    [
        "filter", "add", "dev", from, "parent", "ffff:", "protocol", "all", "u32", "match", "u8",
        "0", "0", "action", "mirred", "egress", "redirect", "dev", to,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_are_read_as_ip_prints_them() {
        let default = serde_json::json!({"dst": "default", "gateway": "10.88.7.1", "flags": []});
        let host = serde_json::json!({"dst": "10.96.0.10", "scope": "link", "flags": []});
        let net = serde_json::json!({"dst": "10.1.0.0/16", "gateway": "10.88.7.254"});
        assert_eq!(
            parse_route(&default),
            Some(Route {
                dst: ([0; 4], 0),
                via: Some([10, 88, 7, 1])
            })
        );
        assert_eq!(
            parse_route(&host),
            Some(Route {
                dst: ([10, 96, 0, 10], 32),
                via: None
            })
        );
        assert_eq!(
            route_text(&parse_route(&net).expect("a route")),
            "10.1.0.0/16 via 10.88.7.254"
        );
        for bad in [
            serde_json::json!({"dst": "fe80::/64"}),
            serde_json::json!({"dst": "10.0.0.0/33"}),
            serde_json::json!({"dst": "default", "gateway": "nowhere"}),
            serde_json::json!({"gateway": "10.0.0.1"}),
        ] {
            assert_eq!(parse_route(&bad), None, "{bad}");
        }
    }

    #[test]
    fn macs_are_six_hex_bytes() {
        assert_eq!(parse_mac("0a:58:0A:58:07:02"), Some([10, 88, 10, 88, 7, 2]));
        assert_eq!(parse_mac("0a:58:0a:58:07"), None);
        assert_eq!(parse_mac("0a:58:0a:58:07:zz"), None);
    }

    #[test]
    fn a_regular_file_is_no_network_namespace_and_procs_is() {
        let file = File::open("/proc/self/status").expect("a file");
        assert!(!is_netns(&file));
        let own = File::open("/proc/self/ns/net").expect("own netns");
        assert!(is_netns(&own));
    }
}
