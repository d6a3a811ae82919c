//! The connection cache (docs/spec/driver.md §4.1): one entry per peer, each insert under a fresh
//! generation, failures scoped to the generation they were seen on.
//!
//! A writer that fails on generation `g` reports `(peer, g)`; the entry is evicted only if `g`
//! is still current, so a late failure of a replaced connection never evicts its replacement.
//! Closed entries are dropped before reuse.

use std::collections::BTreeMap;

/// A connection generation; never 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct Generation(u64);

impl Generation {
    /// The generation numbered `raw` (`None` for 0, which is never issued). Only replay and
    /// tests name generations by number; the cache issues them.
    pub fn new(raw: u64) -> Option<Self> {
        (raw != 0).then_some(Self(raw))
    }

    /// The raw value (≥ 1).
    pub fn get(self) -> u64 {
        self.0
    }
}

/// What a reported failure did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eviction {
    /// The failed generation was current: the entry is gone; redial the peer.
    Evicted,
    /// The entry had already been replaced (or removed): nothing changed.
    Stale,
}

/// A cached connection and its generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry<C> {
    /// The connection (a handle in the shell; anything in tests).
    pub conn: C,
    /// Its generation.
    pub generation: Generation,
    /// Whether the peer dialed it (accepted here) rather than this node.
    pub inbound: bool,
}

/// Connections by peer.
#[derive(Debug, Clone)]
pub struct ConnectionCache<P, C> {
    entries: BTreeMap<P, Entry<C>>,
    last: u64,
}

impl<P: Ord + Clone, C> Default for ConnectionCache<P, C> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P: Ord + Clone, C> ConnectionCache<P, C> {
    /// An empty cache.
    pub fn new() -> Self {
        Self {
            entries: BTreeMap::new(),
            last: 0,
        }
    }

    /// Caches `conn` for `peer` (`inbound`: the peer dialed it) under a fresh generation,
    /// replacing any entry: the generation, and the entry replaced.
    pub fn insert(&mut self, peer: P, conn: C, inbound: bool) -> (Generation, Option<Entry<C>>) {
        // The counter starts at 1 and wraps past 0, so no generation is ever 0.
        self.last = self.last.checked_add(1).unwrap_or(1);
        let generation = Generation(self.last);
        let replaced = self.entries.insert(
            peer,
            Entry {
                conn,
                generation,
                inbound,
            },
        );
        (generation, replaced)
    }

    /// The live entry of `peer`; an entry `is_closed` says is closed is dropped first.
    pub fn get(&mut self, peer: &P, is_closed: impl Fn(&C) -> bool) -> Option<&Entry<C>> {
        if self
            .entries
            .get(peer)
            .is_some_and(|entry| is_closed(&entry.conn))
        {
            self.entries.remove(peer);
        }
        self.entries.get(peer)
    }

    /// The entry of `peer`, as it stands.
    pub fn peek(&self, peer: &P) -> Option<&Entry<C>> {
        self.entries.get(peer)
    }

    /// A write on `peer`'s connection of `generation` failed.
    pub fn fail(&mut self, peer: &P, generation: Generation) -> Eviction {
        match self.evict(peer, generation) {
            Some(_) => Eviction::Evicted,
            None => Eviction::Stale,
        }
    }

    /// Removes `peer`'s entry if it has `generation` (a newer one stays): the entry removed.
    pub fn evict(&mut self, peer: &P, generation: Generation) -> Option<Entry<C>> {
        if self.entries.get(peer)?.generation != generation {
            return None;
        }
        self.entries.remove(peer)
    }

    /// Removes `peer`'s entry whatever its generation (e.g. the peer is no longer allowed).
    pub fn remove(&mut self, peer: &P) -> Option<Entry<C>> {
        self.entries.remove(peer)
    }

    /// Entries: (peer, generation), for snapshots.
    pub fn generations(&self) -> impl Iterator<Item = (&P, Generation)> {
        self.entries
            .iter()
            .map(|(peer, entry)| (peer, entry.generation))
    }

    /// Entries the peer dialed (accepted here).
    pub fn inbound(&self) -> usize {
        self.entries.values().filter(|entry| entry.inbound).count()
    }

    /// Whether `peer` has an entry.
    pub fn contains(&self, peer: &P) -> bool {
        self.entries.contains_key(peer)
    }

    /// Cached peers.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Takes every entry (shutdown).
    pub fn take_all(&mut self) -> BTreeMap<P, Entry<C>> {
        std::mem::take(&mut self.entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        Insert(u8),
        Fail(u8, u8),
        Close(u8),
        Get(u8),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0..3u8).prop_map(Step::Insert),
            (0..3u8, 0..12u8).prop_map(|(p, g)| Step::Fail(p, g)),
            (0..3u8).prop_map(Step::Close),
            (0..3u8).prop_map(Step::Get),
        ]
    }

    proptest! {
        /// Random interleavings of inserts, failures of any generation (current or stale),
        /// closes and lookups: a failure evicts exactly when its generation is current, a
        /// stale failure never evicts a replacement, generations are unique and never 0.
        #[test]
        fn only_the_current_generation_is_ever_evicted(steps in proptest::collection::vec(step(), 0..60)) {
            let mut cache: ConnectionCache<u8, (u64, bool)> = ConnectionCache::new();
            // The model: current generation per peer, and whether it is closed.
            let mut model: BTreeMap<u8, (u64, bool)> = BTreeMap::new();
            let mut issued: Vec<u64> = Vec::new();
            for step in steps {
                match step {
                    Step::Insert(p) => {
                        let (generation, replaced) = cache.insert(p, (0, false), p == 0);
                        prop_assert_eq!(replaced.map(|e| e.generation.get()), model.get(&p).map(|(g, _)| *g));
                        let generation = generation.get();
                        prop_assert!(generation != 0);
                        prop_assert!(!issued.contains(&generation));
                        issued.push(generation);
                        model.insert(p, (generation, false));
                    }
                    Step::Fail(p, pick) => {
                        let generation = issued.get(usize::from(pick)).copied().unwrap_or(u64::MAX);
                        let current = model.get(&p).map(|(g, _)| *g);
                        let outcome = cache.fail(&p, Generation(generation));
                        if current == Some(generation) {
                            prop_assert_eq!(outcome, Eviction::Evicted);
                            model.remove(&p);
                        } else {
                            prop_assert_eq!(outcome, Eviction::Stale);
                        }
                    }
                    Step::Close(p) => {
                        if let Some(entry) = model.get_mut(&p) {
                            entry.1 = true;
                        }
                        // The shell learns of a close through the connection; here the
                        // cache's copy carries the flag.
                        if let Some(entry) = cache.entries.get_mut(&p) {
                            entry.conn.1 = true;
                        }
                    }
                    Step::Get(p) => {
                        let got = cache.get(&p, |conn| conn.1).map(|e| e.generation.get());
                        match model.get(&p) {
                            Some((_, true)) => {
                                prop_assert_eq!(got, None);
                                model.remove(&p);
                            }
                            Some((g, false)) => prop_assert_eq!(got, Some(*g)),
                            None => prop_assert_eq!(got, None),
                        }
                    }
                }
                prop_assert_eq!(cache.len(), model.len());
            }
        }
    }
}
