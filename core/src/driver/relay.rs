//! Relay hints (docs/spec/driver.md §4.3): what a node learns of each peer's relays from the
//! addresses it is given (joins, connects), so that an address given later without a relay (a seed
//! known only by key and direct sockets) is normalized with the relay last seen for that peer.
//! Bounded by [`RELAY_HINT_PEERS_MAX`]: past it the peer recorded longest ago is forgotten.

use super::book::PeerBook;
use super::routing::NodeId;
use crate::limits::RELAY_HINT_PEERS_MAX;

/// Each peer's relay URLs as last seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayHints {
    book: PeerBook<Vec<String>>,
}

impl Default for RelayHints {
    fn default() -> Self {
        Self::with_bound(RELAY_HINT_PEERS_MAX)
    }
}

impl RelayHints {
    /// Hints for at most `peers` peers.
    pub fn with_bound(peers: usize) -> Self {
        Self {
            book: PeerBook::new(peers),
        }
    }

    /// Each peer with a hint and its relays, by peer.
    pub fn iter(&self) -> impl Iterator<Item = (&NodeId, &[String])> {
        self.book
            .iter()
            .map(|(peer, relays)| (peer, relays.as_slice()))
    }

    /// Records `relays` for `peer` (an empty list records nothing: it is no hint).
    pub fn record(&mut self, peer: NodeId, relays: Vec<String>) {
        if !relays.is_empty() {
            self.book.record(peer, relays);
        }
    }

    /// The relays last seen for `peer`.
    pub fn get(&self, peer: &NodeId) -> &[String] {
        self.book.get(peer).map_or(&[], Vec::as_slice)
    }

    /// The relays to reach `peer` by: those `given` with its address, or else the hint.
    pub fn normalize(&self, peer: &NodeId, given: &[String]) -> Vec<String> {
        if given.is_empty() {
            self.get(peer).to_vec()
        } else {
            given.to_vec()
        }
    }

    /// Peers with a hint.
    pub fn len(&self) -> usize {
        self.book.len()
    }

    /// Whether no peer has a hint.
    pub fn is_empty(&self) -> bool {
        self.book.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_without_a_relay_gets_the_one_last_seen() {
        let mut hints = RelayHints::default();
        let relay = vec!["https://relay.example/".to_owned()];
        hints.record(NodeId([1; 32]), Vec::new());
        assert!(hints.is_empty(), "an empty list is no hint");
        hints.record(NodeId([1; 32]), relay.clone());
        assert_eq!(hints.normalize(&NodeId([1; 32]), &[]), relay);
        let given = vec!["https://other.example/".to_owned()];
        assert_eq!(
            hints.normalize(&NodeId([1; 32]), &given),
            given,
            "a given relay wins"
        );
        assert!(
            hints.normalize(&NodeId([2; 32]), &[]).is_empty(),
            "no hint for a stranger"
        );
    }

    #[test]
    fn the_peer_recorded_longest_ago_is_forgotten_past_the_bound() {
        let mut hints = RelayHints::default();
        let peer = |n: usize| {
            let mut id = [0u8; 32];
            id[..8].copy_from_slice(&(n as u64).to_be_bytes());
            NodeId(id)
        };
        for n in 0..=RELAY_HINT_PEERS_MAX {
            hints.record(peer(n), vec![format!("https://r{n}.example/")]);
        }
        // Peer 1 seen again: it becomes the newest, so 0 and then 2 go first.
        hints.record(peer(1), vec!["https://again.example/".to_owned()]);
        hints.record(
            peer(RELAY_HINT_PEERS_MAX + 1),
            vec!["https://new.example/".to_owned()],
        );
        assert_eq!(hints.len(), RELAY_HINT_PEERS_MAX);
        assert!(hints.get(&peer(0)).is_empty());
        assert!(hints.get(&peer(2)).is_empty());
        assert_eq!(hints.get(&peer(1)), ["https://again.example/".to_owned()]);
    }
}
