//! [`Ring`]: entries by an increasing number, for tables whose keys are handed out in order and
//! mostly taken back in about that order: a peer task's answers by ticket, a peer's sends and
//! reqs in flight by the counter of their op ids.
//!
//! The entries lie in a ring indexed by `key - base`: an entry is found at its offset, beside
//! those inserted just before it, where a hash table scattered them and its lookups missed the
//! cache with thousands in flight. The ring spans the keys from the oldest entry waiting, so
//! one that waits long would hold it open: once the span would pass `slots_max`, the oldest
//! entries still waiting move to a table of late ones, and so does every entry when keys jump
//! more than `gap_max` ahead (numbers handed out without an entry fill the ring with holes).

use std::collections::VecDeque;

/// The late entries: looked up by key only, never iterated where the order could show (a
/// [`Ring::drain`] caller that cares sorts), so the random seed changes nothing observed.
#[allow(clippy::disallowed_types)]
type Late<T> = std::collections::HashMap<u64, T, foldhash::fast::RandomState>;

/// Entries by increasing key. See the module docs.
#[derive(Debug, Clone)]
pub struct Ring<T> {
    /// The key of `ring[0]`.
    base: u64,
    /// Entries by `key - base`; `None` for one taken or never made. Never starts with `None`.
    ring: VecDeque<Option<T>>,
    /// Entries older than the ring.
    late: Late<T>,
    /// Entries held, in the ring and late.
    len: usize,
    /// Most slots the ring spans.
    slots_max: usize,
    /// Most keys without an entry the ring fills in to reach a new one.
    gap_max: u64,
}

impl<T> Ring<T> {
    /// An empty ring of at most `slots_max` slots (at least 1) that fills in at most `gap_max`
    /// missing keys.
    pub fn new(slots_max: usize, gap_max: u64) -> Self {
        Self {
            base: 0,
            ring: VecDeque::new(),
            late: Late::default(),
            len: 0,
            slots_max: slots_max.max(1),
            gap_max,
        }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Holds `value` under `key`, which is above every key given before.
    pub fn insert(&mut self, key: u64, value: T) {
        let end = self.end();
        if !self.ring.is_empty() && key < end {
            // Not above the keys before it (callers never do this): held where it is looked
            // up, in its slot or in the late table.
            debug_assert!(false, "keys increase: {key} after {end}");
            let held = match key.checked_sub(self.base) {
                Some(offset) => self.ring[offset as usize].replace(value),
                None => self.late.insert(key, value),
            };
            self.len += usize::from(held.is_none());
            return;
        }
        if self.ring.is_empty() || key.saturating_sub(end) > self.gap_max {
            self.spill(self.ring.len());
            self.base = key;
        }
        // Room for the gap and the entry within the bound, made before the ring grows.
        let span = usize::try_from(key - self.base).map_or(usize::MAX, |gap| gap.saturating_add(1));
        if span > self.slots_max {
            self.spill((span - self.slots_max).min(self.ring.len()));
            if self.ring.is_empty() {
                self.base = key;
            }
        }
        while self.end() < key {
            self.ring.push_back(None);
        }
        self.ring.push_back(Some(value));
        self.len += 1;
    }

    /// The entry under `key`, if held.
    pub fn get(&self, key: u64) -> Option<&T> {
        match key.checked_sub(self.base) {
            Some(offset) => self.ring.get(usize::try_from(offset).ok()?)?.as_ref(),
            None => self.late.get(&key),
        }
    }

    /// The entry under `key`, if held.
    pub fn get_mut(&mut self, key: u64) -> Option<&mut T> {
        match key.checked_sub(self.base) {
            Some(offset) => self.ring.get_mut(usize::try_from(offset).ok()?)?.as_mut(),
            None => self.late.get_mut(&key),
        }
    }

    /// Takes the entry under `key`, if held.
    pub fn remove(&mut self, key: u64) -> Option<T> {
        let value = match key.checked_sub(self.base) {
            None => self.late.remove(&key),
            Some(offset) => {
                let value = self.ring.get_mut(usize::try_from(offset).ok()?)?.take();
                self.trim();
                value
            }
        };
        self.len -= usize::from(value.is_some());
        value
    }

    /// Drops every entry.
    pub fn clear(&mut self) {
        self.ring.clear();
        self.late.clear();
        self.len = 0;
    }

    /// Takes every entry, in no particular order.
    pub fn drain(&mut self) -> impl Iterator<Item = T> {
        self.len = 0;
        let ring = std::mem::take(&mut self.ring);
        let late = std::mem::take(&mut self.late);
        ring.into_iter().flatten().chain(late.into_values())
    }

    /// Room the ring has for slots (for bounds tests).
    pub fn capacity(&self) -> usize {
        self.ring.capacity()
    }

    /// Slots the ring spans (for bounds tests).
    pub fn span(&self) -> usize {
        self.ring.len()
    }

    fn end(&self) -> u64 {
        self.base.saturating_add(self.ring.len() as u64)
    }

    /// Moves the first `count` slots' entries to the late table.
    fn spill(&mut self, count: usize) {
        for slot in self.ring.drain(..count) {
            if let Some(value) = slot {
                self.late.insert(self.base, value);
            }
            self.base += 1;
        }
        self.trim();
    }

    /// Drops the empty slots at the front, and gives back the room of a burst once most of it
    /// is free.
    fn trim(&mut self) {
        while matches!(self.ring.front(), Some(None)) {
            self.ring.pop_front();
            self.base += 1;
        }
        // A power of two, so that growing by doubling never takes room past `slots_max`.
        let floor = self.ring.len().max(1024);
        if self.ring.capacity() > 4 * floor {
            self.ring.shrink_to((2 * floor).next_power_of_two());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SLOTS: usize = 16 * 1024;

    fn ring() -> Ring<u64> {
        Ring::new(SLOTS, 1024)
    }

    /// Each entry is found under its own key, in any order of removal, and nothing is left
    /// behind.
    #[test]
    fn entries_are_found_under_their_keys_in_any_order() {
        let mut ring = ring();
        // Keys with gaps (numbers handed out without entries), taken out of order.
        for key in [3, 4, 7, 8, 9, 20] {
            ring.insert(key, key * 10);
        }
        assert_eq!(ring.len(), 6);
        for key in [8, 3, 20, 7, 4, 9] {
            assert_eq!(ring.get(key), Some(&(key * 10)));
            assert_eq!(ring.remove(key), Some(key * 10), "key {key}");
            assert_eq!(ring.remove(key), None, "taken once");
        }
        assert!(ring.is_empty());
        assert_eq!(ring.span(), 0);
        assert!(ring.get_mut(5).is_none() && ring.remove(100).is_none());
    }

    /// One entry that waits while many after it are taken moves to the late table: the ring
    /// never spans, nor takes room for, more than its bound, and the late entry is still found.
    #[test]
    fn an_entry_taken_late_does_not_hold_the_ring_open() {
        let mut ring = ring();
        ring.insert(0, 0);
        for key in 1..(3 * SLOTS as u64) {
            ring.insert(key, key);
            assert_eq!(ring.remove(key), Some(key));
            assert!(ring.span() <= SLOTS);
            assert!(ring.capacity() <= SLOTS, "the room stays within the bound");
        }
        assert_eq!(ring.len(), 1);
        assert_eq!(ring.span(), 0, "only the late entry waits");
        assert!(ring.capacity() <= 4 * 1024, "the ring gave its room back");
        assert_eq!(ring.get(0), Some(&0));
        assert_eq!(ring.remove(0), Some(0), "the late entry is found");
        assert!(ring.is_empty());
    }

    /// Keys far ahead do not fill the ring with empty slots: the waiting entries move to the
    /// late table and the ring starts again.
    #[test]
    fn a_jump_in_keys_starts_the_ring_again() {
        let mut ring = ring();
        ring.insert(10, 1);
        ring.insert(10 + 1_000_000, 2);
        assert_eq!(ring.span(), 1);
        assert_eq!(ring.len(), 2);
        assert_eq!(ring.get(10), Some(&1));
        assert_eq!(ring.get(1_000_010), Some(&2));
        let mut all: Vec<u64> = ring.drain().collect();
        all.sort_unstable();
        assert_eq!(all, [1, 2]);
        assert!(ring.is_empty() && ring.get(10).is_none());
    }

    #[derive(Debug, Clone)]
    enum Step {
        /// Insert under the next key, this far past the last one.
        Insert(u64),
        /// Remove the `n`-th key inserted (modulo those inserted).
        Remove(usize),
        Get(usize),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => prop_oneof![8 => 1u64..4, 1 => 4u64..40, 1 => 1_000u64..3_000].prop_map(Step::Insert),
            2 => any::<usize>().prop_map(Step::Remove),
            1 => any::<usize>().prop_map(Step::Get),
        ]
    }

    proptest! {
        /// The ring holds exactly what a map by key would, under any inserts with gaps of any
        /// size, removals from anywhere and lookups, with a small bound so that entries spill,
        /// and never spans more than its bound.
        #[test]
        fn the_ring_behaves_as_a_map_by_key(steps in proptest::collection::vec(step(), 1..300)) {
            let mut ring = Ring::new(64, 16);
            let mut model = std::collections::BTreeMap::new();
            let mut keys = Vec::new();
            let mut next = 0u64;
            for step in steps {
                match step {
                    Step::Insert(gap) => {
                        next += gap;
                        ring.insert(next, next);
                        model.insert(next, next);
                        keys.push(next);
                    }
                    Step::Remove(n) if !keys.is_empty() => {
                        let key = keys[n % keys.len()];
                        prop_assert_eq!(ring.remove(key), model.remove(&key));
                    }
                    Step::Get(n) if !keys.is_empty() => {
                        let key = keys[n % keys.len()];
                        prop_assert_eq!(ring.get(key), model.get(&key));
                    }
                    _ => {}
                }
                prop_assert_eq!(ring.len(), model.len());
                prop_assert!(ring.span() <= 64);
            }
            let mut all: Vec<u64> = ring.drain().collect();
            all.sort_unstable();
            prop_assert_eq!(all, model.into_values().collect::<Vec<_>>());
        }
    }
}
