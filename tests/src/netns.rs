//! Separated hosts for tests: network namespaces on this machine, joined by veth pairs, with
//! addresses from the benchmarking range 198.18.0.0/15 that only these namespaces use. Every
//! namespace is deleted when its [`Topology`] drops (its interfaces go with it). Needs root
//! (`CAP_NET_ADMIN`); [`unavailable`] says why not, for a test to skip loudly.
//!
//! The topology: host A (`198.18.1.2`) and host B (`198.18.2.2`) each hang off a router R
//! (`198.18.1.1`, `198.18.2.1`), which also holds the relay's address `198.19.0.1`. A and B
//! reach the relay; they reach each other only while R forwards
//! ([`Topology::set_forwarding`]), so with forwarding off the relay is their only path.

use std::net::Ipv4Addr;
use std::process::Command;

/// Host A's address.
pub const A_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 2);
/// Host B's address.
pub const B_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 2);
/// The relay's address, on the router.
pub const RELAY_ADDR: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 1);

/// Runs `ip <args>`; an error names the command and what it printed.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let output = Command::new("ip")
        .args(args)
        .output()
        .map_err(|error| format!("ip {}: {error}", args.join(" ")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// Runs `<program> <args>` inside namespace `ns`.
pub fn exec(ns: &str, program: &str, args: &[&str]) -> Result<(), String> {
    let mut all = vec!["netns", "exec", ns, program];
    all.extend_from_slice(args);
    ip(&all)
}

/// Why namespaces cannot be made here, or `None` when they can.
pub fn unavailable() -> Option<String> {
    let probe = format!("ttprobe{}", std::process::id());
    match ip(&["netns", "add", &probe]) {
        Ok(()) => {
            let _ = ip(&["netns", "del", &probe]);
            None
        }
        Err(error) => Some(format!(
            "network namespaces cannot be made here (needs root and iproute2): {error}"
        )),
    }
}

/// Hosts A and B and router R (see the module docs).
#[derive(Debug)]
pub struct Topology {
    /// Host A's namespace.
    pub a: String,
    /// Host B's namespace.
    pub b: String,
    /// The router's namespace (the relay runs here).
    pub r: String,
}

impl Topology {
    /// Builds the namespaces, links and addresses, forwarding off.
    pub fn build() -> Result<Self, String> {
        let id = std::process::id();
        let topology = Self {
            a: format!("tt{id}a"),
            b: format!("tt{id}b"),
            r: format!("tt{id}r"),
        };
        for ns in [&topology.a, &topology.b, &topology.r] {
            ip(&["netns", "add", ns])?;
            exec(ns, "ip", &["link", "set", "lo", "up"])?;
        }
        let r = topology.r.clone();
        for (host, side, host_addr, router_addr) in [
            (&topology.a, "a", A_ADDR, "198.18.1.1"),
            (&topology.b, "b", B_ADDR, "198.18.2.1"),
        ] {
            let (host_if, router_if) = (format!("h{side}{id}"), format!("r{side}{id}"));
            ip(&[
                "link", "add", &host_if, "netns", host, "type", "veth", "peer", "name", &router_if,
                "netns", &r,
            ])?;
            exec(
                host,
                "ip",
                &["addr", "add", &format!("{host_addr}/24"), "dev", &host_if],
            )?;
            exec(host, "ip", &["link", "set", &host_if, "up"])?;
            exec(host, "ip", &["route", "add", "default", "via", router_addr])?;
            exec(
                &r,
                "ip",
                &[
                    "addr",
                    "add",
                    &format!("{router_addr}/24"),
                    "dev",
                    &router_if,
                ],
            )?;
            exec(&r, "ip", &["link", "set", &router_if, "up"])?;
        }
        exec(
            &r,
            "ip",
            &["addr", "add", &format!("{RELAY_ADDR}/32"), "dev", "lo"],
        )?;
        topology.set_forwarding(false)?;
        Ok(topology)
    }

    /// Whether R forwards between A and B (their direct path); the relay stays reachable
    /// either way.
    pub fn set_forwarding(&self, on: bool) -> Result<(), String> {
        let value = format!("net.ipv4.ip_forward={}", u8::from(on));
        exec(&self.r, "sysctl", &["-qw", &value])
    }

    /// The command line prefix that runs a program inside namespace `ns`.
    pub fn inside(ns: &str) -> [&str; 4] {
        ["ip", "netns", "exec", ns]
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b, &self.r] {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}
