//! Admission: the one allow-list check every way in and out of a node goes through
//! (docs/spec/driver.md §2.4: a peer off the list is refused before any state is touched),
//! counted by the way it came.
//!
//! The shell asks [`admit`] at the first step of every path (an actor frame or connect, a
//! join, a telemetry publish, a protocol stream, a switch dial, a substrate link, and every
//! inbound connection whatever its ALPN) and does nothing else for a refused peer.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::Serialize;

use super::routing::{NodeId, PeerAuth};

/// The way a peer is reached, or reaches this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Path {
    /// Actor frames (and `connect`), on the actor ALPN.
    Actor,
    /// A join through a seed (outbound; inbound, a join arrives on the actor ALPN).
    Join,
    /// A telemetry stream.
    Telemetry,
    /// A ring-backed protocol stream.
    Protocol,
    /// The request switch's host connection.
    Switch,
    /// A substrate link.
    Substrate,
    /// An inbound connection on an ALPN this node does not serve.
    Unknown,
}

impl Path {
    /// Its name in counters.
    pub fn as_str(self) -> &'static str {
        match self {
            Path::Actor => "actor",
            Path::Join => "join",
            Path::Telemetry => "telemetry",
            Path::Protocol => "protocol",
            Path::Switch => "switch",
            Path::Substrate => "substrate",
            Path::Unknown => "unknown",
        }
    }
}

/// Which side opened the path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// A peer reaching this node.
    Inbound,
    /// This node reaching a peer.
    Outbound,
}

impl Direction {
    /// Its name in counters.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Inbound => "inbound",
            Direction::Outbound => "outbound",
        }
    }
}

/// A peer refused by the allow-list on `path`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("peer not allowed ({direction:?} {path:?})")]
pub struct Refused {
    /// The way it came or was asked for.
    pub path: Path,
    /// Which side opened it.
    pub direction: Direction,
}

/// The check: `Ok` when `auth` admits `peer`, else the refusal to count.
pub fn admit(
    auth: &PeerAuth,
    peer: &NodeId,
    path: Path,
    direction: Direction,
) -> Result<(), Refused> {
    if auth.permits(peer) {
        Ok(())
    } else {
        Err(Refused { path, direction })
    }
}

/// Refusals counted by path and direction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Refusals(BTreeMap<(Path, Direction), u64>);

impl Refusals {
    /// Counts one.
    pub fn count(&mut self, refused: Refused) {
        *self.0.entry((refused.path, refused.direction)).or_default() += 1;
    }

    /// How many on `path` in `direction`.
    pub fn get(&self, path: Path, direction: Direction) -> u64 {
        self.0.get(&(path, direction)).copied().unwrap_or(0)
    }

    /// All refusals in `direction`.
    pub fn total(&self, direction: Direction) -> u64 {
        self.0
            .iter()
            .filter(|((_, d), _)| *d == direction)
            .map(|(_, n)| n)
            .sum()
    }

    /// Every count, keyed `path/direction`.
    pub fn iter(&self) -> impl Iterator<Item = (Path, Direction, u64)> + '_ {
        self.0
            .iter()
            .map(|((path, direction), n)| (*path, *direction, *n))
    }
}

impl Serialize for Refusals {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(
            self.iter().map(|(path, direction, n)| {
                (format!("{}/{}", path.as_str(), direction.as_str()), n)
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_listed_peers_are_admitted_and_refusals_count_by_path() {
        let auth = PeerAuth::allow_list([NodeId([1; 32])]);
        assert_eq!(
            admit(&auth, &NodeId([1; 32]), Path::Join, Direction::Outbound),
            Ok(())
        );
        let refused = admit(&auth, &NodeId([2; 32]), Path::Switch, Direction::Inbound).unwrap_err();
        assert_eq!(
            refused,
            Refused {
                path: Path::Switch,
                direction: Direction::Inbound
            }
        );
        let mut refusals = Refusals::default();
        refusals.count(refused);
        refusals.count(refused);
        assert_eq!(refusals.get(Path::Switch, Direction::Inbound), 2);
        assert_eq!(refusals.get(Path::Switch, Direction::Outbound), 0);
        assert_eq!(refusals.total(Direction::Inbound), 2);
        assert_eq!(
            serde_json::to_string(&refusals).unwrap(),
            r#"{"switch/inbound":2}"#
        );
        // An open node admits everyone.
        assert!(admit(
            &PeerAuth::open(),
            &NodeId([2; 32]),
            Path::Actor,
            Direction::Inbound
        )
        .is_ok());
    }
}

/// Inbound handshakes in progress, under a bound and a per-source share: the shell asks
/// [`Handshakes::begin_from`] for every incoming connection before anything is spent on it
/// (no task, no TLS) and refuses it when the answer is no; [`Handshakes::end_from`] when a
/// begun handshake ends, however it ends. No one source (an IP address) holds more than its
/// share, so a flood from one place leaves room for everyone else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handshakes {
    in_progress: usize,
    max: usize,
    per_source_max: usize,
    per_source: BTreeMap<IpAddr, usize>,
    refused: u64,
}

impl Handshakes {
    /// At most `max` at once, at most a quarter of them (at least 1) from one source.
    pub fn new(max: usize) -> Self {
        Self::with_share(max, (max / 4).max(1))
    }

    /// At most `max` at once, at most `per_source_max` from one source.
    pub fn with_share(max: usize, per_source_max: usize) -> Self {
        Self {
            in_progress: 0,
            max,
            per_source_max,
            per_source: BTreeMap::new(),
            refused: 0,
        }
    }

    /// [`Handshakes::begin_from`] of a handshake whose source is not known.
    pub fn begin(&mut self) -> bool {
        self.begin_from(None)
    }

    /// Whether a new handshake from `source` may start (then it counts as in progress); a
    /// refusal is counted.
    pub fn begin_from(&mut self, source: Option<IpAddr>) -> bool {
        let from_source = source.map_or(0, |ip| self.per_source.get(&ip).copied().unwrap_or(0));
        if self.in_progress >= self.max || from_source >= self.per_source_max {
            self.refused += 1;
            return false;
        }
        self.in_progress += 1;
        if let Some(ip) = source {
            *self.per_source.entry(ip).or_default() += 1;
        }
        true
    }

    /// [`Handshakes::end_from`] of a handshake begun without a source.
    pub fn end(&mut self) {
        self.end_from(None);
    }

    /// A handshake begun from `source` ended (done, failed or timed out).
    pub fn end_from(&mut self, source: Option<IpAddr>) {
        self.in_progress = self.in_progress.saturating_sub(1);
        if let Some(ip) = source {
            if let Some(n) = self.per_source.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    self.per_source.remove(&ip);
                }
            }
        }
    }

    /// Handshakes in progress now.
    pub fn in_progress(&self) -> usize {
        self.in_progress
    }

    /// Handshakes in progress now from `source`.
    pub fn in_progress_from(&self, source: IpAddr) -> usize {
        self.per_source.get(&source).copied().unwrap_or(0)
    }

    /// Incoming connections refused: `max` were in progress, or their source's share.
    pub fn refused(&self) -> u64 {
        self.refused
    }
}

#[cfg(test)]
mod handshake_tests {
    use super::{Handshakes, IpAddr};

    #[test]
    fn handshakes_past_the_bound_are_refused_and_counted_until_one_ends() {
        let mut gate = Handshakes::new(2);
        assert!(gate.begin() && gate.begin());
        assert!(!gate.begin());
        assert!(!gate.begin());
        assert_eq!((gate.in_progress(), gate.refused()), (2, 2));
        gate.end();
        assert!(gate.begin());
        gate.end();
        gate.end();
        gate.end();
        assert_eq!(gate.in_progress(), 0, "never below zero");
    }

    #[test]
    fn one_source_holds_at_most_its_share() {
        let (a, b) = (IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 2]));
        let mut gate = Handshakes::new(8);
        for _ in 0..2 {
            assert!(gate.begin_from(Some(a)));
        }
        // A's share (a quarter of 8) is taken: A waits, B and unknown sources do not.
        assert!(!gate.begin_from(Some(a)));
        assert!(gate.begin_from(Some(b)));
        assert!(gate.begin());
        assert_eq!((gate.in_progress(), gate.in_progress_from(a)), (4, 2));
        gate.end_from(Some(a));
        assert!(gate.begin_from(Some(a)));
        assert_eq!(gate.refused(), 1);
        for source in [Some(a), Some(a), Some(b), None] {
            gate.end_from(source);
        }
        assert_eq!((gate.in_progress(), gate.in_progress_from(a)), (0, 0));
        // Nothing is kept for a source with nothing in progress.
        assert!(gate.per_source.is_empty());
    }
}
