//! The guest's network interfaces, set through the classic interface
//! ioctls (the guest has no iproute2, and IPv4 needs nothing more):
//! loopback up for the egress forwarder, a clone's own MAC after a
//! restore, and a pod's network (`Network`).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use husk_protocol::NetConfig;

const SIOCADDRT: libc::c_ulong = 0x890B;
const SIOCGIFFLAGS: libc::c_ulong = 0x8913;
const SIOCSIFFLAGS: libc::c_ulong = 0x8914;
const SIOCSIFADDR: libc::c_ulong = 0x8916;
const SIOCSIFNETMASK: libc::c_ulong = 0x891C;
const SIOCSIFMTU: libc::c_ulong = 0x8922;
const SIOCSIFHWADDR: libc::c_ulong = 0x8924;
const ARPHRD_ETHER: u16 = 1;

/// `struct ifreq`: an interface name and 24 bytes of request (40 bytes on
/// 64-bit), which each ioctl reads as its own member of the union.
#[repr(C)]
struct Ifreq {
    name: [u8; libc::IFNAMSIZ],
    data: [u8; 24],
}

/// A socket to issue interface ioctls on, and the interface they are for.
struct Interface {
    sock: OwnedFd,
    name: [u8; libc::IFNAMSIZ],
}

impl Interface {
    fn named(name: &[u8]) -> io::Result<Self> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "bad interface name",
            ));
        }
        // SAFETY: a plain socket call; its descriptor is owned below.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut padded = [0; libc::IFNAMSIZ];
        padded[..name.len()].copy_from_slice(name);
        Ok(Interface {
            // SAFETY: `fd` is a fresh descriptor nobody else owns.
            sock: unsafe { OwnedFd::from_raw_fd(fd) },
            name: padded,
        })
    }

    /// The virtio-net device's interface (there is at most one).
    fn virtio_net() -> io::Result<Self> {
        let name = std::fs::read_dir("/sys/class/net")?
            .filter_map(Result::ok)
            .find(|entry| {
                std::fs::read_link(entry.path().join("device/driver"))
                    .is_ok_and(|driver| driver.ends_with("virtio_net"))
            })
            .map(|entry| entry.file_name())
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no virtio-net interface"))?;
        Self::named(name.as_encoded_bytes())
    }

    fn name(&self) -> &str {
        let len = self.name.iter().position(|&b| b == 0).unwrap_or(0);
        std::str::from_utf8(&self.name[..len]).unwrap_or("?")
    }

    /// Issues interface ioctl `request` with `data` as its ifreq's union;
    /// returns what the kernel left there.
    fn ioctl(&self, request: libc::c_ulong, data: [u8; 24]) -> io::Result<[u8; 24]> {
        let mut req = Ifreq {
            name: self.name,
            data,
        };
        // SAFETY: every interface ioctl used here reads (and SIOCGIF*
        // writes) a struct ifreq; `req` is one, laid out as the kernel's,
        // and lives across the call.
        let rc = unsafe { libc::ioctl(self.sock.as_raw_fd(), request as _, &mut req) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(req.data)
    }

    fn flags(&self) -> io::Result<libc::c_short> {
        let data = self.ioctl(SIOCGIFFLAGS, [0; 24])?;
        Ok(libc::c_short::from_ne_bytes([data[0], data[1]]))
    }

    fn set_flags(&self, flags: libc::c_short) -> io::Result<()> {
        let mut data = [0; 24];
        data[..2].copy_from_slice(&flags.to_ne_bytes());
        self.ioctl(SIOCSIFFLAGS, data).map(drop)
    }

    fn set_up(&self, up: bool) -> io::Result<()> {
        let flags = self.flags()?;
        let up_flag = libc::IFF_UP as libc::c_short;
        self.set_flags(if up {
            flags | up_flag
        } else {
            flags & !up_flag
        })
    }

    fn set_mac(&self, mac: &[u8; 6]) -> io::Result<()> {
        // struct sockaddr: family, then the address.
        let mut data = [0; 24];
        data[..2].copy_from_slice(&ARPHRD_ETHER.to_ne_bytes());
        data[2..8].copy_from_slice(mac);
        self.ioctl(SIOCSIFHWADDR, data).map(drop)
    }

    fn set_mtu(&self, mtu: u32) -> io::Result<()> {
        let mtu = libc::c_int::try_from(mtu)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "MTU out of range"))?;
        let mut data = [0; 24];
        data[..4].copy_from_slice(&mtu.to_ne_bytes());
        self.ioctl(SIOCSIFMTU, data).map(drop)
    }

    /// SIOCSIFADDR / SIOCSIFNETMASK with `addr` as a sockaddr_in.
    fn set_inet(&self, request: libc::c_ulong, addr: [u8; 4]) -> io::Result<()> {
        let mut data = [0; 24];
        data[..16].copy_from_slice(&sockaddr_in(addr));
        self.ioctl(request, data).map(drop)
    }
}

/// A `struct sockaddr_in` for `addr`, port 0, as bytes.
fn sockaddr_in(addr: [u8; 4]) -> [u8; 16] {
    let mut sa = [0; 16];
    sa[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
    sa[4..8].copy_from_slice(&addr);
    sa
}

/// The netmask of a prefix length (at most 32).
fn netmask(prefix: u8) -> [u8; 4] {
    let bits = u32::MAX
        .checked_shl(32 - u32::from(prefix.min(32)))
        .unwrap_or(0);
    bits.to_be_bytes()
}

/// Brings up the loopback interface (the egress forwarder listens on it).
pub fn loopback_up() -> io::Result<()> {
    Interface::named(b"lo")?.set_up(true)
}

/// Gives the virtio-net interface the MAC address `mac` (a clone's own;
/// the driver takes it while the link is up).
pub fn set_mac(mac: &[u8; 6]) -> io::Result<()> {
    Interface::virtio_net()?.set_mac(mac)
}

/// Gives the virtio-net interface `config`: down, its MAC and MTU, its
/// address (which brings the subnet's route), announcing itself when it
/// comes up (a gratuitous ARP: the pod network learns where the address
/// is now), then its other routes. The interface's earlier address is
/// replaced and its routes go with the link's down, so a second
/// `Network` replaces the first.
pub fn configure(config: &NetConfig) -> io::Result<()> {
    let (addr, prefix) = config.addr;
    if prefix > 32 || config.routes.iter().any(|r| r.dst.1 > 32) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "an IPv4 prefix longer than 32 bits",
        ));
    }
    let nic = Interface::virtio_net()?;
    let step = |what: &str, result: io::Result<()>| {
        result.map_err(|e| io::Error::new(e.kind(), format!("{} {what}: {e}", nic.name())))
    };
    step("down", nic.set_up(false))?;
    step("MAC address", nic.set_mac(&config.mac))?;
    step("MTU", nic.set_mtu(config.mtu))?;
    step("address", nic.set_inet(SIOCSIFADDR, addr))?;
    step("netmask", nic.set_inet(SIOCSIFNETMASK, netmask(prefix)))?;
    let arp_notify = format!("/proc/sys/net/ipv4/conf/{}/arp_notify", nic.name());
    step("arp_notify", std::fs::write(arp_notify, "1"))?;
    step("up", nic.set_up(true))?;
    for route in &config.routes {
        let (dst, len) = route.dst;
        let what = format!(
            "route to {}/{len}{}",
            std::net::Ipv4Addr::from(dst),
            route
                .via
                .map(|v| format!(" via {}", std::net::Ipv4Addr::from(v)))
                .unwrap_or_default()
        );
        step(&what, add_route(&nic, dst, len, route.via))?;
    }
    Ok(())
}

/// SIOCADDRT: a route to `dst/len` through `nic`, via `gateway` if given.
fn add_route(nic: &Interface, dst: [u8; 4], len: u8, gateway: Option<[u8; 4]>) -> io::Result<()> {
    let mask = netmask(len);
    let dst: [u8; 4] = std::array::from_fn(|i| dst[i] & mask[i]);
    // SAFETY: rtentry is plain data; all zeroes is a valid empty one.
    let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
    let sockaddr = |addr: [u8; 4]| {
        // SAFETY: sockaddr and the 16 bytes of a sockaddr_in have the
        // same size; every bit pattern is a valid sockaddr.
        unsafe { std::mem::transmute::<[u8; 16], libc::sockaddr>(sockaddr_in(addr)) }
    };
    rt.rt_dst = sockaddr(dst);
    rt.rt_genmask = sockaddr(mask);
    rt.rt_flags = libc::RTF_UP;
    if let Some(gateway) = gateway {
        rt.rt_gateway = sockaddr(gateway);
        rt.rt_flags |= libc::RTF_GATEWAY;
    }
    if len == 32 {
        rt.rt_flags |= libc::RTF_HOST;
    }
    // The device by name: a NUL-terminated copy that outlives the call.
    let mut dev = nic.name;
    rt.rt_dev = dev.as_mut_ptr().cast();
    // SAFETY: SIOCADDRT reads an rtentry (and the name rt_dev points to),
    // both of which live across the call.
    let rc = unsafe { libc::ioctl(nic.sock.as_raw_fd(), SIOCADDRT as _, &rt) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        // The same route already there is what was asked for.
        if e.raw_os_error() != Some(libc::EEXIST) {
            return Err(e);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netmasks_of_prefixes() {
        assert_eq!(netmask(0), [0, 0, 0, 0]);
        assert_eq!(netmask(8), [255, 0, 0, 0]);
        assert_eq!(netmask(24), [255, 255, 255, 0]);
        assert_eq!(netmask(31), [255, 255, 255, 254]);
        assert_eq!(netmask(32), [255, 255, 255, 255]);
    }

    #[test]
    fn sockaddr_in_is_family_port_address() {
        let sa = sockaddr_in([10, 88, 7, 2]);
        assert_eq!(u16::from_ne_bytes([sa[0], sa[1]]), libc::AF_INET as u16);
        assert_eq!(&sa[2..8], &[0, 0, 10, 88, 7, 2]);
        assert_eq!(std::mem::size_of::<Ifreq>(), 40);
    }
}
