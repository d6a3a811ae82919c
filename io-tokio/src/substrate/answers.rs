//! Where a peer task sends each command's answers, by ticket.
//!
//! The task issues tickets in increasing order, and most answers come back in about that
//! order (a queue's sends are acked in order), so the entries lie in a ring indexed by
//! ticket: an answer finds its entry at its offset, beside those answered just before it.
//! A hash table by ticket scattered them, and its lookups missed the cache with thousands of
//! sends in flight (1.4% of the CPU of 16 queues in `tether-bench`'s profile). The ring spans
//! the tickets from the oldest one waiting, so an entry that waits long would hold it open: at
//! [`RING_MAX`] slots the oldest entries still waiting move to a table of late ones, and so
//! does every entry when tickets jump far ahead (commands without answers, such as consumes,
//! take tickets too).

use std::collections::{HashMap, VecDeque};

use tether_core::limits::{SUBSTRATE_ANSWER_RING_GAP_MAX, SUBSTRATE_ANSWER_RING_SLOTS_MAX};
use tether_core::substrate::peer::Ticket;

use super::commands::Answer;

/// Most slots the ring spans ([`SUBSTRATE_ANSWER_RING_SLOTS_MAX`]).
pub(super) const RING_MAX: usize = SUBSTRATE_ANSWER_RING_SLOTS_MAX;

#[derive(Default)]
pub(super) struct Answers {
    /// The ticket of `ring[0]`.
    base: Ticket,
    /// Entries by `ticket - base`; `None` for an entry answered or never made. Never starts
    /// with `None`.
    ring: VecDeque<Option<Answer>>,
    /// Entries older than the ring.
    #[allow(clippy::disallowed_types)] // looked up by key only, never iterated
    late: HashMap<Ticket, Answer, foldhash::fast::RandomState>,
}

impl Answers {
    /// Where the answers to `ticket` go; `ticket` is above every ticket given before.
    pub(super) fn insert(&mut self, ticket: Ticket, answer: Answer) {
        let end = self.end();
        debug_assert!(ticket >= end, "tickets increase: {ticket} after {end}");
        if self.ring.is_empty() || ticket.saturating_sub(end) > SUBSTRATE_ANSWER_RING_GAP_MAX {
            self.spill(self.ring.len());
            self.base = ticket;
        }
        // Room for the gap and the entry within the bound, made before the ring grows.
        let span = usize::try_from(ticket - self.base).map_or(usize::MAX, |gap| gap + 1);
        if span > RING_MAX {
            self.spill((span - RING_MAX).min(self.ring.len()));
            if self.ring.is_empty() {
                self.base = ticket;
            }
        }
        while self.end() < ticket {
            self.ring.push_back(None);
        }
        self.ring.push_back(Some(answer));
    }

    /// The entry of `ticket`, if it waits.
    pub(super) fn get_mut(&mut self, ticket: Ticket) -> Option<&mut Answer> {
        match ticket.checked_sub(self.base) {
            Some(offset) => self.ring.get_mut(usize::try_from(offset).ok()?)?.as_mut(),
            None => self.late.get_mut(&ticket),
        }
    }

    /// Takes the entry of `ticket`, if it waits.
    pub(super) fn remove(&mut self, ticket: Ticket) -> Option<Answer> {
        let Some(offset) = ticket.checked_sub(self.base) else {
            return self.late.remove(&ticket);
        };
        let answer = self.ring.get_mut(usize::try_from(offset).ok()?)?.take();
        self.trim();
        answer
    }

    /// Drops every entry (their callers see the task end).
    pub(super) fn clear(&mut self) {
        self.ring.clear();
        self.late.clear();
    }

    /// Entries waiting.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.ring.iter().flatten().count() + self.late.len()
    }

    fn end(&self) -> Ticket {
        self.base + self.ring.len() as Ticket
    }

    /// Moves the first `count` slots' entries to the late table.
    fn spill(&mut self, count: usize) {
        for slot in self.ring.drain(..count) {
            if let Some(answer) = slot {
                self.late.insert(self.base, answer);
            }
            self.base += 1;
        }
        self.trim();
    }

    /// Drops the answered slots at the front, and gives back the room of a burst once most
    /// of it is free.
    fn trim(&mut self) {
        while matches!(self.ring.front(), Some(None)) {
            self.ring.pop_front();
            self.base += 1;
        }
        // A power of two, so that growing by doubling never takes room past `RING_MAX`.
        let floor = self.ring.len().max(1024);
        if self.ring.capacity() > 4 * floor {
            self.ring.shrink_to((2 * floor).next_power_of_two());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot;

    fn unit() -> (
        Answer,
        oneshot::Receiver<Result<(), crate::substrate::Error>>,
    ) {
        let (tx, rx) = oneshot::channel();
        (Answer::Unit(tx), rx)
    }

    /// Each answer reaches its own caller, in any order, and nothing is left behind.
    #[test]
    fn answers_reach_their_callers_in_any_order() {
        let mut answers = Answers::default();
        let mut callers = Vec::new();
        // Tickets with gaps (commands without answers), answered out of order.
        for ticket in [3, 4, 7, 8, 9, 20] {
            let (answer, rx) = unit();
            answers.insert(ticket, answer);
            callers.push((ticket, rx));
        }
        for &ticket in &[8, 3, 20, 7, 4, 9] {
            let Some(Answer::Unit(tx)) = answers.remove(ticket) else {
                panic!("ticket {ticket} waits");
            };
            tx.send(Ok(())).expect("its caller waits");
            assert!(answers.remove(ticket).is_none(), "answered once");
        }
        for (ticket, mut rx) in callers {
            assert_eq!(rx.try_recv(), Ok(Ok(())), "ticket {ticket}");
        }
        assert_eq!(answers.len(), 0);
        assert!(answers.ring.is_empty());
        assert!(answers.get_mut(5).is_none() && answers.remove(100).is_none());
    }

    /// One entry that waits while many after it are answered moves to the late table: the
    /// ring never spans, nor takes room for, more than its bound, and the late entry is still
    /// found.
    #[test]
    fn an_entry_answered_late_does_not_hold_the_ring_open() {
        let mut answers = Answers::default();
        let (late, mut late_rx) = unit();
        answers.insert(0, late);
        for ticket in 1..(3 * RING_MAX as Ticket) {
            answers.insert(ticket, unit().0);
            assert!(answers.remove(ticket).is_some());
            assert!(answers.ring.len() <= RING_MAX);
            assert!(
                answers.ring.capacity() <= RING_MAX,
                "the room stays within the bound"
            );
        }
        assert_eq!(answers.len(), 1);
        assert!(answers.ring.is_empty(), "only the late entry waits");
        assert!(
            answers.ring.capacity() <= 4 * 1024,
            "the ring gave its room back"
        );
        let Some(Answer::Unit(tx)) = answers.remove(0) else {
            panic!("the late entry is found");
        };
        tx.send(Ok(())).expect("its caller waits");
        assert_eq!(late_rx.try_recv(), Ok(Ok(())));
        assert_eq!(answers.len(), 0);
    }

    /// Tickets far ahead (many consumes between two sends) do not fill the ring with empty
    /// slots: the waiting entries move to the late table and the ring starts again.
    #[test]
    fn a_jump_in_tickets_starts_the_ring_again() {
        let mut answers = Answers::default();
        answers.insert(10, unit().0);
        answers.insert(10 + 1_000_000, unit().0);
        assert_eq!(answers.ring.len(), 1);
        assert_eq!(answers.len(), 2);
        assert!(answers.get_mut(10).is_some() && answers.get_mut(1_000_010).is_some());
        assert!(answers.remove(10).is_some() && answers.remove(1_000_010).is_some());
        assert_eq!(answers.len(), 0);
    }
}
