//! One object's outbox: its durable ops in seq order and their transmission state
//! (memory only): when each went out, its retry and expiry deadlines.

use super::*;
use std::collections::btree_map;

/// One outbox entry: the durable op and its transmission state (memory only).
#[derive(Debug, Clone, Hash)]
pub(super) struct Outgoing {
    pub(super) op: Op,
    /// The batch that made it durable; it may go on the wire once that batch is persisted.
    pub(super) batch: BatchId,
    /// Attempts so far; the receipt of the latest transmission.
    pub(super) receipt: u64,
    /// On the wire and not yet acked.
    pub(super) in_flight: bool,
    /// A transient error asked to wait until then.
    pub(super) retry_at: Option<Time>,
    /// Rebuilt by [`Machine::recover`]: it may have been transmitted before the restart.
    pub(super) recovered: bool,
    /// Transient answers in a row: the next retry backs off from this.
    pub(super) transient_failures: u32,
}

impl Outgoing {
    /// Certainly never on the wire, so certainly not delivered: only such an op may end
    /// without the peer's word (peer close, TTL).
    pub(super) fn never_sent(&self) -> bool {
        self.receipt == 0 && !self.recovered
    }

    /// Whether the queue TTL applies: opens, sends and reqs that never left. Answers,
    /// decisions and closes answer something the peer holds and wait for the link however
    /// long it takes (the outbox bound still applies).
    pub(super) fn expires(&self) -> bool {
        self.never_sent() && matches!(self.op.verb, Verb::Open | Verb::Send | Verb::Req)
    }
}

/// One object's outbox: entries by seq, with the count of those in flight kept exact so that
/// the window check is O(1), and indexes that keep every per-wake question O(log n): which
/// entries may expire (never sent), which wait on a transient retry, and where transmission
/// resumes.
///
/// The entries lie in `slots`, in no order, and `order` gives each seq its slot: the B-tree
/// that keeps seq order moves 16-byte pairs as it splits, shifts and merges its nodes, where
/// whole entries (an op and its state, some 250 bytes) moved before. A removal moves the last
/// slot into the gap and repoints its seq.
#[derive(Clone, Default)]
pub(super) struct Outbox {
    /// Slot by seq; each slot's entry has that seq.
    order: BTreeMap<Seq, usize>,
    slots: Vec<Outgoing>,
    pub(super) in_flight: usize,
    /// Seqs of entries the queue TTL applies to (never sent), in seq order, which is also
    /// the order of their enqueue times within a boot.
    pub(super) expirable: BTreeSet<Seq>,
    /// Entries waiting on a transient retry, by when.
    pub(super) retrying: BTreeSet<(Time, Seq)>,
    /// No entry below this seq needs transmitting (they are in flight or waiting).
    pub(super) cursor: Seq,
    /// Seqs by op id (answers share the id of the req they answer), so that finding the op
    /// an answer or an err names costs a lookup, not a scan.
    pub(super) by_id: BTreeMap<OpId, Seqs>,
}

/// The seqs one op id names in an outbox: almost always one (an id names one op; answers
/// share the id of the req they answer), held inline so that an op costs no set of its own.
#[derive(Clone, Debug)]
pub(super) enum Seqs {
    One(Seq),
    Many(BTreeSet<Seq>),
}

impl Seqs {
    fn insert(&mut self, seq: Seq) {
        match self {
            Self::One(one) if *one == seq => {}
            Self::One(one) => *self = Self::Many(BTreeSet::from([*one, seq])),
            Self::Many(many) => {
                many.insert(seq);
            }
        }
    }

    /// Removes `seq`; true when none is left.
    fn remove(&mut self, seq: Seq) -> bool {
        match self {
            Self::One(one) => *one == seq,
            Self::Many(many) => {
                many.remove(&seq);
                many.is_empty()
            }
        }
    }

    /// In seq order.
    fn iter(&self) -> impl Iterator<Item = Seq> + '_ {
        let (one, many) = match self {
            Self::One(one) => (Some(*one), None),
            Self::Many(many) => (None, Some(many.iter().copied())),
        };
        one.into_iter().chain(many.into_iter().flatten())
    }
}

/// The entries alone: the indexes and the cursor follow from them (a fingerprint that
/// printed them would tell apart machines that behave alike).
impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("entries", &Entries(self))
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

/// The same entries alone, for the same reason.
impl std::hash::Hash for Outbox {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        Entries(self).hash(state);
        self.in_flight.hash(state);
    }
}

/// The entries as a map by seq, printed and hashed as a `BTreeMap<Seq, Outgoing>` of them
/// would be (fingerprints do not depend on where entries lie).
struct Entries<'a>(&'a Outbox);

impl std::fmt::Debug for Entries<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.0.iter()).finish()
    }
}

impl std::hash::Hash for Entries<'_> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_usize(self.0.len());
        for pair in self.0.iter() {
            pair.hash(state);
        }
    }
}

impl Outbox {
    pub(super) fn insert(&mut self, entry: Outgoing) {
        debug_assert!(
            !entry.in_flight,
            "entries enter the outbox before any transmission"
        );
        if entry.expires() {
            self.expirable.insert(entry.op.seq);
        }
        self.cursor = self.cursor.min(entry.op.seq);
        // One search each (an id is almost always new here, and leaves with its op).
        match self.by_id.entry(entry.op.id.clone()) {
            btree_map::Entry::Occupied(mut seqs) => seqs.get_mut().insert(entry.op.seq),
            btree_map::Entry::Vacant(seqs) => {
                seqs.insert(Seqs::One(entry.op.seq));
            }
        }
        match self.order.entry(entry.op.seq) {
            btree_map::Entry::Occupied(at) => self.slots[*at.get()] = entry,
            btree_map::Entry::Vacant(at) => {
                at.insert(self.slots.len());
                self.slots.push(entry);
            }
        }
    }

    pub(super) fn remove(&mut self, seq: Seq) -> Option<Outgoing> {
        let slot = self.order.remove(&seq)?;
        let entry = self.slots.swap_remove(slot);
        if let Some(moved) = self.slots.get(slot) {
            *self
                .order
                .get_mut(&moved.op.seq)
                .expect("every slot has its seq") = slot;
        }
        // The slots of a burst are given back once most of them are free (halving keeps a
        // steady outbox from allocating at all).
        if self.slots.capacity() > 4 * self.slots.len().max(16) {
            self.slots.shrink_to(2 * self.slots.len().max(16));
        }
        self.in_flight -= usize::from(entry.in_flight);
        self.expirable.remove(&seq);
        if let Some(at) = entry.retry_at {
            self.retrying.remove(&(at, seq));
        }
        if let btree_map::Entry::Occupied(mut seqs) = self.by_id.entry(entry.op.id.clone()) {
            if seqs.get_mut().remove(seq) {
                seqs.remove();
            }
        }
        Some(entry)
    }

    pub(super) fn get(&self, seq: Seq) -> Option<&Outgoing> {
        self.order.get(&seq).map(|&slot| &self.slots[slot])
    }

    fn get_mut(&mut self, seq: Seq) -> Option<&mut Outgoing> {
        self.order.get(&seq).map(|&slot| &mut self.slots[slot])
    }

    /// The entry `seq`, which the caller knows is here.
    fn entry(&self, seq: Seq) -> &Outgoing {
        self.get(seq).expect("an entry of the outbox")
    }

    /// The entries in seq order.
    pub(super) fn values(&self) -> impl Iterator<Item = &Outgoing> + '_ {
        self.order.values().map(|&slot| &self.slots[slot])
    }

    /// The entries by seq, in seq order.
    fn iter(&self) -> impl Iterator<Item = (&Seq, &Outgoing)> + '_ {
        self.order
            .iter()
            .map(|(seq, &slot)| (seq, &self.slots[slot]))
    }

    pub(super) fn len(&self) -> usize {
        self.order.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    pub(super) fn first_seq(&self) -> Option<Seq> {
        self.order.keys().next().copied()
    }

    /// The seq of the op with id `id`, if it was ever transmitted (only such ops can be
    /// answered by the peer's substrate).
    pub(super) fn transmitted_seq_of(&self, id: &str) -> Option<Seq> {
        self.by_id
            .get_text(id)?
            .iter()
            .find(|&seq| self.get(seq).is_some_and(|e| e.receipt > 0))
    }

    pub(super) fn seq_of(&self, id: &str) -> Option<Seq> {
        self.by_id.get_text(id)?.iter().next()
    }

    /// Marks entries from `from` on as not in flight: they go out again with new receipts.
    pub(super) fn land_from(&mut self, from: Seq) {
        for &slot in self.order.range(from..).map(|(_, slot)| slot) {
            let entry = &mut self.slots[slot];
            self.in_flight -= usize::from(std::mem::replace(&mut entry.in_flight, false));
        }
        self.cursor = self.cursor.min(from);
    }

    /// Counts a transient answer to entry `seq`; returns the count before it (the backoff
    /// attempt).
    pub(super) fn note_transient(&mut self, seq: Seq) -> u32 {
        let Some(entry) = self.get_mut(seq) else {
            return 0;
        };
        let before = entry.transient_failures;
        entry.transient_failures = before.saturating_add(1);
        before
    }

    /// A transient error: the entry waits until `at`, then goes out again.
    pub(super) fn retry_at(&mut self, seq: Seq, at: Time) {
        if let Some(slot) = self.order.get(&seq) {
            let entry = &mut self.slots[*slot];
            self.in_flight -= usize::from(std::mem::replace(&mut entry.in_flight, false));
            if let Some(before) = entry.retry_at.replace(at) {
                self.retrying.remove(&(before, seq));
            }
            self.retrying.insert((at, seq));
        }
    }

    pub(super) fn clear_due_retries(&mut self, now: Time) {
        while let Some(&(at, seq)) = self.retrying.first() {
            if at > now {
                break;
            }
            self.retrying.pop_first();
            if let Some(entry) = self.get_mut(seq) {
                entry.retry_at = None;
            }
            self.cursor = self.cursor.min(seq);
        }
    }

    /// Seqs of never-sent entries enqueued `ttl` or more before `now`.
    pub(super) fn expired(&self, now: Time, ttl: std::time::Duration) -> Vec<Seq> {
        self.expirable
            .iter()
            .copied()
            .take_while(|&seq| now.saturating_since(self.entry(seq).op.at) >= ttl)
            .collect()
    }

    /// When the next entry expires, if one can.
    pub(super) fn next_expiry(&self, ttl: std::time::Duration) -> Option<Time> {
        let seq = self.expirable.first()?;
        Some(self.entry(*seq).op.at.saturating_add(ttl))
    }

    /// Transmits, in seq order, every entry that may go: not waiting on a retry, within
    /// `window` in flight and below the receiver's credit `limit`, and persisted, or a send
    /// whose seq is below the committed reservation `reserved` (its commit runs while it
    /// travels); while `opening` only the open may go.
    pub(super) fn transmit(
        &mut self,
        (persisted, reserved): (BatchId, Seq),
        opening: bool,
        window: usize,
        (floor, limit): (Seq, Seq),
        out: &mut VecDeque<Envelope>,
        stats: &mut Stats,
    ) -> bool {
        let mut sent = false;
        let mut resume = None;
        for &slot in self.order.range(self.cursor..).map(|(_, slot)| slot) {
            let entry = &mut self.slots[slot];
            let seq = entry.op.seq;
            if self.in_flight >= window || seq >= limit {
                resume = Some(seq);
                break;
            }
            if entry.in_flight || entry.retry_at.is_some() {
                continue;
            }
            if opening && entry.op.verb != Verb::Open {
                resume = Some(seq);
                break;
            }
            // Seqs are assigned in batch order: everything after an unpersisted op is too. Only
            // a send may go ahead of its commit: should this side die first, the peer may
            // deliver it, and nothing here is lost or repeated (its seq is never reused).
            // Opens, decisions, answers and closes change what this side must remember.
            if entry.batch > persisted {
                if entry.op.verb != Verb::Send || seq >= reserved {
                    resume = Some(seq);
                    break;
                }
                stats.sent_before_commit += 1;
            }
            entry.receipt += 1;
            entry.in_flight = true;
            self.in_flight += 1;
            self.expirable.remove(&seq);
            out.push_back(op_frame(&entry.op, entry.receipt, floor));
            sent = true;
        }
        // Everything before `resume` is in flight or waiting on a retry (which lowers the
        // cursor again when it ends).
        self.cursor =
            resume.unwrap_or_else(|| self.order.keys().next_back().map_or(Seq::ZERO, |s| *s + 1));
        debug_assert_eq!(
            self.in_flight,
            self.slots.iter().filter(|e| e.in_flight).count()
        );
        sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::hash::Hash;

    fn entry(seq: u64, id: u8, sent: bool) -> Outgoing {
        Outgoing {
            op: Op {
                obj: Address::parse("q").expect("an address"),
                seq: Seq(seq),
                id: OpId::new(&format!("id-{id}")),
                verb: Verb::Send,
                obj_kind: None,
                body: None,
                code: None,
                reason: None,
                cap: None,
                at: Time::from_millis(seq),
            },
            batch: BatchId(seq),
            receipt: u64::from(sent),
            in_flight: false,
            retry_at: None,
            recovered: false,
            transient_failures: 0,
        }
    }

    #[derive(Debug, Clone)]
    enum Step {
        Insert { seq: u64, id: u8 },
        Remove(u64),
        Transmit,
        LandFrom(u64),
        Retry(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0u64..64, 0u8..8).prop_map(|(seq, id)| Step::Insert { seq, id }),
            4 => (0u64..64).prop_map(Step::Remove),
            1 => Just(Step::Transmit),
            1 => (0u64..64).prop_map(Step::LandFrom),
            1 => (0u64..64).prop_map(Step::Retry),
        ]
    }

    proptest! {
        /// Entries kept in slots behave as the map by seq they stand for: in any order of
        /// inserts (new seqs and replaced ones), removals from anywhere, transmissions,
        /// landings and retries, every seq finds its own entry, they iterate in seq order,
        /// the in-flight count is exact, ids find their seqs, and the fingerprint is the
        /// map's.
        #[test]
        fn slots_behave_as_the_map_by_seq(steps in proptest::collection::vec(step(), 1..200)) {
            let mut outbox = Outbox::default();
            let mut model: BTreeMap<Seq, Outgoing> = BTreeMap::new();
            let mut out = VecDeque::new();
            let mut stats = Stats::default();
            for step in steps {
                match step {
                    Step::Insert { seq, id } => {
                        // A replaced entry is replaced whole, as the map would (only ones not
                        // in flight, as the machine does).
                        if model.get(&Seq(seq)).is_some_and(|e| e.in_flight) {
                            continue;
                        }
                        outbox.insert(entry(seq, id, false));
                        model.insert(Seq(seq), entry(seq, id, false));
                    }
                    Step::Remove(seq) => {
                        let removed = outbox.remove(Seq(seq)).map(|e| e.op.seq);
                        prop_assert_eq!(removed, model.remove(&Seq(seq)).map(|e| e.op.seq));
                    }
                    Step::Transmit => {
                        outbox.transmit(
                            (BatchId(u64::MAX), Seq(0)),
                            false,
                            8,
                            (Seq(0), Seq(u64::MAX)),
                            &mut out,
                            &mut stats,
                        );
                        for frame in out.drain(..) {
                            let seq = Seq(frame.env.seq.expect("an op frame has a seq"));
                            let modelled = model.get_mut(&seq).expect("a modelled entry");
                            modelled.in_flight = true;
                            modelled.receipt += 1;
                        }
                    }
                    Step::LandFrom(from) => {
                        outbox.land_from(Seq(from));
                        for (_, e) in model.range_mut(Seq(from)..) {
                            e.in_flight = false;
                        }
                    }
                    Step::Retry(seq) => {
                        outbox.retry_at(Seq(seq), Time::from_millis(1_000));
                        if let Some(e) = model.get_mut(&Seq(seq)) {
                            e.in_flight = false;
                            e.retry_at = Some(Time::from_millis(1_000));
                        }
                    }
                }
                prop_assert_eq!(outbox.len(), model.len());
                let seqs: Vec<Seq> = outbox.values().map(|e| e.op.seq).collect();
                prop_assert_eq!(&seqs, &model.keys().copied().collect::<Vec<_>>());
                for (seq, e) in &model {
                    let got = outbox.get(*seq).expect("every modelled seq is here");
                    prop_assert_eq!(got.op.seq, *seq);
                    prop_assert_eq!(&got.op.id, &e.op.id);
                    prop_assert_eq!(got.in_flight, e.in_flight);
                    prop_assert_eq!(got.receipt, e.receipt);
                    prop_assert_eq!(got.retry_at, e.retry_at);
                    prop_assert!(outbox.seq_of(e.op.id.as_str()).is_some());
                }
                prop_assert_eq!(outbox.in_flight, model.values().filter(|e| e.in_flight).count());
                prop_assert_eq!(outbox.first_seq(), model.keys().next().copied());
                prop_assert_eq!(
                    format!("{:?}", Entries(&outbox)),
                    format!("{model:?}")
                );
                let hash = |value: &dyn Fn(&mut std::collections::hash_map::DefaultHasher)| {
                    let mut hasher = std::collections::hash_map::DefaultHasher::new();
                    value(&mut hasher);
                    std::hash::Hasher::finish(&hasher)
                };
                prop_assert_eq!(
                    hash(&|h| Entries(&outbox).hash(h)),
                    hash(&|h| model.hash(h))
                );
                prop_assert!(outbox.slots.capacity() <= 4 * outbox.slots.len().max(16));
            }
        }
    }
}
