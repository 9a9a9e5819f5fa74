//! Which address a process tells the job's other processes to reach it at
//! (its control links and TCP receive server), and which one it listens on.
//!
//! What matters is the address advertised: binding every interface does not
//! help a peer that was told 127.0.0.1. In order:
//!
//! 1. `advertise_address` (an IP or a host name, resolved here);
//! 2. `tcp_bind`, when it names one address (not a wildcard);
//! 3. a single-process client: loopback (nothing else reaches it);
//! 4. the local address of this host's route to the job's store (JAX's
//!    coordination service, named by `coordinator_address`, which
//!    `jax_plugins.crosshost` fills in; with etcd, its endpoints): the
//!    address the kernel would use to talk to the store, which every peer
//!    also reaches. A route to the store over loopback says nothing about
//!    other hosts, so it is skipped;
//! 5. this host's name, when it resolves to an address of one of its own
//!    interfaces other than loopback (Debian maps the host name to
//!    127.0.1.1, which is skipped);
//! 6. the address of the interface that holds the default route, else of
//!    the first interface that is up, IPv4 first;
//! 7. loopback (logged: only processes on this host can reach it).
//!
//! The route lookup is a UDP `connect`, which sends nothing.
use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};

use crate::status::{invalid_argument, Result};

/// The chosen addresses and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Advertised {
    /// Where listeners bind.
    pub bind: IpAddr,
    /// What peers are told.
    pub address: IpAddr,
    /// How `address` was chosen, for logs and errors.
    pub source: String,
}

/// What the choice is made from.
#[derive(Clone, Debug, Default)]
pub struct AddressHints<'a> {
    pub advertise_address: Option<&'a str>,
    pub tcp_bind: Option<IpAddr>,
    /// `host:port` of the job's store(s).
    pub store_addresses: Vec<String>,
    /// Whether other processes will connect to this one.
    pub multi_process: bool,
}

pub fn choose(hints: &AddressHints<'_>) -> Result<Advertised> {
    let bind_for = |address: IpAddr| match hints.tcp_bind {
        Some(bind) => bind,
        None => address,
    };
    if let Some(text) = hints.advertise_address {
        let address = resolve_host(text).ok_or_else(|| {
            invalid_argument(format!(
                "PJRT_Client_Create: advertise_address {text:?} is neither an IP address nor a host name that resolves"
            ))
        })?;
        return Ok(Advertised {
            bind: bind_for(address),
            address,
            source: format!("advertise_address={text}"),
        });
    }
    if let Some(bind) = hints.tcp_bind.filter(|b| !b.is_unspecified()) {
        return Ok(Advertised {
            bind,
            address: bind,
            source: format!("tcp_bind={bind}"),
        });
    }
    let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    if !hints.multi_process {
        return Ok(Advertised {
            bind: bind_for(loopback),
            address: loopback,
            source: "single process: loopback".into(),
        });
    }
    let local = interface_addresses();
    let found = hints
        .store_addresses
        .iter()
        .find_map(|store| {
            route_to(store)
                .filter(|ip| !ip.is_loopback())
                .map(|ip| (ip, format!("the route to the job's store at {store}")))
        })
        .or_else(|| {
            let name = hostname()?;
            let ip = resolve_all(&name)
                .into_iter()
                .find(|ip| !ip.is_loopback() && local.iter().any(|i| i.address == *ip))?;
            Some((ip, format!("the host name {name}")))
        })
        .or_else(|| {
            let default_interface = default_route_interface();
            let usable = |i: &&Interface| !i.address.is_loopback() && !is_link_local(&i.address);
            local
                .iter()
                .filter(usable)
                .find(|i| Some(&i.name) == default_interface.as_ref())
                .or_else(|| local.iter().filter(usable).find(|i| i.address.is_ipv4()))
                .or_else(|| local.iter().find(usable))
                .map(|i| (i.address, format!("interface {}", i.name)))
        });
    Ok(match found {
        Some((address, source)) => Advertised {
            bind: bind_for(address),
            address,
            source,
        },
        None => {
            log::warn!(
                "no network interface but loopback: advertising 127.0.0.1, which only processes \
                 on this host can reach (set advertise_address)"
            );
            Advertised {
                bind: bind_for(loopback),
                address: loopback,
                source: "no other interface: loopback".into(),
            }
        }
    })
}

/// An IP address, or the first address a host name resolves to.
pub fn resolve_host(text: &str) -> Option<IpAddr> {
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(ip);
    }
    let all = resolve_all(text);
    all.iter()
        .find(|ip| ip.is_ipv4())
        .or_else(|| all.first())
        .copied()
}

fn resolve_all(name: &str) -> Vec<IpAddr> {
    (name, 0)
        .to_socket_addrs()
        .map(|addrs| addrs.map(|a| a.ip()).collect())
        .unwrap_or_default()
}

/// The local address the kernel would use to reach `host:port`.
fn route_to(store: &str) -> Option<IpAddr> {
    let target: SocketAddr = store.to_socket_addrs().ok()?.next()?;
    let any: SocketAddr = match target {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(any).ok()?;
    socket.connect(target).ok()?;
    Some(socket.local_addr().ok()?.ip())
}

fn hostname() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let name = name.trim();
    (!name.is_empty()).then(|| name.to_string())
}

fn is_link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// An address of an interface that is up.
#[derive(Clone, Debug)]
pub struct Interface {
    pub name: String,
    pub address: IpAddr,
}

/// Every address of every interface that is up (getifaddrs).
pub fn interface_addresses() -> Vec<Interface> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the list is freed below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Vec::new();
    }
    let mut found = Vec::new();
    let mut cursor = list;
    while !cursor.is_null() {
        // SAFETY: `cursor` walks the list getifaddrs returned, every entry
        // valid until freeifaddrs.
        let entry = unsafe { &*cursor };
        cursor = entry.ifa_next;
        if entry.ifa_addr.is_null() || entry.ifa_flags & libc::IFF_UP as u32 == 0 {
            continue;
        }
        // SAFETY: a non-null sockaddr whose family says which struct it is.
        let address = unsafe {
            match i32::from((*entry.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let v4 = &*(entry.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let v6 = &*(entry.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::V6(std::net::Ipv6Addr::from(v6.sin6_addr.s6_addr))
                }
                _ => continue,
            }
        };
        // SAFETY: ifa_name is a NUL-terminated string of the entry.
        let name = unsafe { CStr::from_ptr(entry.ifa_name) }
            .to_string_lossy()
            .into_owned();
        found.push(Interface { name, address });
    }
    // SAFETY: the list from getifaddrs, freed once.
    unsafe { libc::freeifaddrs(list) };
    found
}

/// The interface of the IPv4 default route (/proc/net/route), if any.
fn default_route_interface() -> Option<String> {
    let table = std::fs::read_to_string("/proc/net/route").ok()?;
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.len() > 2 && fields[1] == "00000000").then(|| fields[0].to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_explicit_address_wins_and_binds_there_unless_tcp_bind_says_otherwise() {
        let chosen = choose(&AddressHints {
            advertise_address: Some("127.0.0.1"),
            multi_process: true,
            ..AddressHints::default()
        })
        .unwrap();
        assert_eq!(chosen.address, IpAddr::from([127, 0, 0, 1]));
        assert_eq!(chosen.bind, chosen.address);
        let wildcard = choose(&AddressHints {
            advertise_address: Some("localhost"),
            tcp_bind: Some(IpAddr::from([0, 0, 0, 0])),
            multi_process: true,
            ..AddressHints::default()
        })
        .unwrap();
        assert!(wildcard.address.is_loopback());
        assert!(wildcard.bind.is_unspecified());
        let bad = choose(&AddressHints {
            advertise_address: Some("no-such-host.invalid"),
            multi_process: true,
            ..AddressHints::default()
        })
        .unwrap_err();
        assert!(bad.message.contains("advertise_address"), "{bad}");
    }

    #[test]
    fn a_specific_tcp_bind_is_advertised_and_one_process_keeps_loopback() {
        let bound = choose(&AddressHints {
            tcp_bind: Some(IpAddr::from([127, 0, 0, 2])),
            multi_process: true,
            ..AddressHints::default()
        })
        .unwrap();
        assert_eq!(bound.address, IpAddr::from([127, 0, 0, 2]));
        let single = choose(&AddressHints::default()).unwrap();
        assert!(single.address.is_loopback());
    }

    #[test]
    fn a_multi_process_client_never_advertises_loopback_when_it_has_an_interface() {
        let chosen = choose(&AddressHints {
            // A store on loopback says nothing about other hosts.
            store_addresses: vec!["127.0.0.1:2379".into()],
            multi_process: true,
            ..AddressHints::default()
        })
        .unwrap();
        let others: Vec<Interface> = interface_addresses()
            .into_iter()
            .filter(|i| !i.address.is_loopback() && !is_link_local(&i.address))
            .collect();
        if others.is_empty() {
            assert!(chosen.address.is_loopback());
        } else {
            assert!(
                others.iter().any(|i| i.address == chosen.address),
                "{chosen:?} is not one of {others:?}"
            );
        }
    }

    #[test]
    fn the_route_to_the_store_names_the_local_address_that_reaches_it() {
        assert_eq!(route_to("127.0.0.1:9"), Some(IpAddr::from([127, 0, 0, 1])));
        assert_eq!(route_to("not a host:1"), None);
    }
}
