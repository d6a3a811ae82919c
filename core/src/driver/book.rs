//! [`PeerBook`]: what a node remembers per peer (relay hints, addresses), bounded: past its
//! bound the peer recorded longest ago is forgotten, so peers the node stopped hearing of
//! cannot grow it without end.

use std::collections::BTreeMap;

use super::routing::NodeId;

/// A value per peer, at most `max` peers, the one recorded longest ago forgotten first.
/// Recording and forgetting are `O(log n)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerBook<V> {
    max: usize,
    /// Each peer's value and the stamp of its last record.
    by_peer: BTreeMap<NodeId, (u64, V)>,
    /// Peers by the stamp of their last record, oldest first.
    by_age: BTreeMap<u64, NodeId>,
    next_stamp: u64,
}

impl<V> PeerBook<V> {
    /// An empty book of at most `max` peers.
    pub fn new(max: usize) -> Self {
        Self {
            max,
            by_peer: BTreeMap::new(),
            by_age: BTreeMap::new(),
            next_stamp: 0,
        }
    }

    /// Records `value` for `peer`, which becomes the newest; past the bound the oldest peer is
    /// forgotten.
    pub fn record(&mut self, peer: NodeId, value: V) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        if let Some((old, _)) = self.by_peer.insert(peer, (stamp, value)) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(stamp, peer);
        while self.by_peer.len() > self.max {
            let Some((_, oldest)) = self.by_age.pop_first() else {
                break;
            };
            self.by_peer.remove(&oldest);
        }
    }

    /// The value last recorded for `peer`.
    pub fn get(&self, peer: &NodeId) -> Option<&V> {
        self.by_peer.get(peer).map(|(_, value)| value)
    }

    /// Each peer recorded and its value, by peer.
    pub fn iter(&self) -> impl Iterator<Item = (&NodeId, &V)> {
        self.by_peer.iter().map(|(peer, (_, value))| (peer, value))
    }

    /// Peers recorded.
    pub fn len(&self) -> usize {
        self.by_peer.len()
    }

    /// Whether no peer is recorded.
    pub fn is_empty(&self) -> bool {
        self.by_peer.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(n: u64) -> NodeId {
        let mut id = [0u8; 32];
        id[..8].copy_from_slice(&n.to_be_bytes());
        NodeId(id)
    }

    #[test]
    fn the_peer_recorded_longest_ago_is_forgotten_past_the_bound() {
        let mut book = PeerBook::new(3);
        for n in 0..3 {
            book.record(peer(n), n);
        }
        // Peer 0 recorded again: it becomes the newest, so 1 and then 2 go first.
        book.record(peer(0), 10);
        book.record(peer(3), 3);
        assert_eq!(book.len(), 3);
        assert_eq!(book.get(&peer(1)), None);
        assert_eq!(book.get(&peer(0)), Some(&10));
        book.record(peer(4), 4);
        assert_eq!(book.get(&peer(2)), None);
        assert_eq!(
            [0, 3, 4].map(|n| book.get(&peer(n)).copied()),
            [Some(10), Some(3), Some(4)]
        );
    }

    mod model {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Against a list kept oldest first: the same peers, the same values, never more
            /// than the bound.
            #[test]
            fn matches_a_list_oldest_first(
                max in 1usize..6,
                records in prop::collection::vec((0u64..8, any::<u16>()), 0..64),
            ) {
                let mut book = PeerBook::new(max);
                let mut list: Vec<(u64, u16)> = Vec::new();
                for (n, value) in records {
                    book.record(peer(n), value);
                    list.retain(|(known, _)| *known != n);
                    list.push((n, value));
                    if list.len() > max {
                        list.remove(0);
                    }
                    prop_assert_eq!(book.len(), list.len());
                }
                for n in 0..8 {
                    let expected = list.iter().find(|(known, _)| *known == n).map(|(_, v)| v);
                    prop_assert_eq!(book.get(&peer(n)), expected);
                }
            }
        }
    }
}
