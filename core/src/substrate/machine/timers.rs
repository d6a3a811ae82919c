//! Per-object deadlines: gaps older than the resync age, retransmits, TTL expiry, and
//! retiring idle objects.

use super::*;

impl Machine {
    pub(super) fn object_timers(&mut self, now: Time, name: &Address) {
        let config = self.config.clone();
        let link_up = self.link_up;
        let object = self.objects.get_mut(name).expect("listed by the caller");
        if let Some(since) = object.gap_since {
            let due = now.saturating_since(since) >= config.gap_resync_after;
            let allowed = object
                .last_resync
                .is_none_or(|last| now.saturating_since(last) >= config.gap_resync_after);
            if due && allowed && link_up {
                object.last_resync = Some(now);
                let mut env = Env::new(Verb::Resync);
                env.obj = Some(name.clone());
                env.from_seq = Some(object.record.rx_next.get());
                self.stats.resyncs_sent += 1;
                self.send_now(now, Envelope::new(env));
            }
        }
        let object = self.objects.get_mut(name).expect("still there");
        object.outbox.clear_due_retries(now);
        let expired = object.outbox.expired(now, config.queue_ttl);
        if let (Some(&first), Some(&last)) = (expired.first(), expired.last()) {
            // Expirable seqs expire in order: the expired ones are one run of them.
            self.purge_outbox(name, finality::TTL_EXPIRED, |e| {
                (first..=last).contains(&e.op.seq) && e.expires()
            });
        }
        let object = self.objects.get(name).expect("still there");
        let retired = match object.record.state {
            ObjectState::Closed(at) | ObjectState::Rejected(at) => {
                now.saturating_since(at) >= config.dedupe_retention
                    && object.outbox.is_empty()
                    && object.inbox.is_empty()
            }
            _ => false,
        };
        if retired {
            self.remove_object(name);
        }
    }

    /// Forgets `obj` (retired or evicted), its timer with it.
    pub(super) fn remove_object(&mut self, obj: &Address) {
        if let Some(at) = self.objects.remove(obj).and_then(|object| object.armed) {
            self.timers.remove(&(at, obj.to_owned()));
        }
        self.touched.remove(obj);
        self.staged.push(Record::ObjectRemoved {
            obj: obj.to_owned(),
        });
    }

    /// The step in progress concerns `obj`.
    pub(super) fn touch(&mut self, obj: &Address) {
        self.touched.insert(obj.to_owned());
    }

    /// The step concerns every object (a link change).
    pub(super) fn touch_all(&mut self) {
        self.touched.extend(self.objects.keys().cloned());
    }

    /// Sets `obj`'s entry in the timer table to its next deadline (or none).
    pub(super) fn rearm(&mut self, obj: &Address) {
        // An object that is gone took its entry with it (`remove_object`).
        if let Some(object) = self.objects.get_mut(obj) {
            arm(&mut self.timers, &self.config, self.link_up, obj, object);
        }
    }

    /// Puts `object` in the table under `obj`: one that replaces an object of the same name
    /// (a closed one opened again) keeps its entry in the timer table, which `rearm` then
    /// moves or removes.
    pub(super) fn put_object(&mut self, obj: Address, mut object: Object) {
        if let Some(before) = self.objects.get(&obj) {
            object.armed = before.armed;
        }
        self.objects.insert(obj, object);
    }
}

/// Moves `obj`'s entry in the timer table (`timers`) to its next deadline, or removes it
/// when it has none: what [`Machine::rearm`] does, for a caller already holding the object.
pub(super) fn arm(
    timers: &mut BTreeSet<(Time, Address)>,
    config: &Config,
    link_up: bool,
    obj: &Address,
    object: &mut Object,
) {
    let next = next_deadline(config, link_up, object);
    if object.armed == next {
        return;
    }
    if let Some(at) = object.armed {
        timers.remove(&(at, obj.clone()));
    }
    if let Some(at) = next {
        timers.insert((at, obj.clone()));
    }
    object.armed = next;
}

/// The earliest time `object` needs [`Machine::handle_timeout`]: a resync (only with a link
/// (`link_up`) to send it on), a transient retry, a TTL expiry, or retirement (only once
/// nothing is left in it). O(log n).
pub(super) fn next_deadline(config: &Config, link_up: bool, object: &Object) -> Option<Time> {
    let gap = object.gap_since.filter(|_| link_up).map(|since| {
        let due = since.saturating_add(config.gap_resync_after);
        let allowed = object
            .last_resync
            .map_or(due, |last| last.saturating_add(config.gap_resync_after));
        due.max(allowed)
    });
    let retry = object.outbox.retrying.first().map(|(at, _)| *at);
    let expiry = object.outbox.next_expiry(config.queue_ttl);
    let retire = match object.record.state {
        ObjectState::Closed(at) | ObjectState::Rejected(at)
            if object.outbox.is_empty() && object.inbox.is_empty() =>
        {
            Some(at.saturating_add(config.dedupe_retention))
        }
        _ => None,
    };
    [gap, retry, expiry, retire].into_iter().flatten().min()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::substrate::harness::{Harness, Party};
    use std::time::Duration;

    /// The timer table holds exactly the entries the objects' `armed` name, one per armed
    /// object and none for an object that is gone.
    fn table_matches_objects(machine: &Machine) {
        let armed: BTreeSet<(Time, Address)> = machine
            .objects
            .iter()
            .filter_map(|(name, object)| object.armed.map(|at| (at, name.clone())))
            .collect();
        assert_eq!(machine.timers, armed);
        for (name, object) in &machine.objects {
            assert_eq!(
                object.armed,
                next_deadline(&machine.config, machine.link_up, object),
                "{name} is armed for its next deadline"
            );
        }
    }

    /// A closed object holds a retirement timer; opened again under the same name before it
    /// retires, the new object takes that entry over (moved to its own deadline), so no entry
    /// is left behind that would fire for the old one; after its own close the new object
    /// retires once its retention is over, taking its entry with it.
    #[test]
    fn an_object_opened_again_takes_over_its_timer_entry() {
        let config = Config {
            dedupe_retention: Duration::from_secs(60),
            queue_ttl: Duration::from_secs(30),
            ..Config::default()
        };
        let mut h = Harness::allowing_all(config, 7);
        h.connect();
        let open = |h: &mut Harness| {
            h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
                .expect("opens");
            h.run();
        };
        open(&mut h);
        h.with(Party::A, |m, now| {
            m.send(now, "q", Bytes::from_static(b"x"))
        })
        .expect("sends");
        h.run();
        table_matches_objects(&h.a.machine);
        h.with(Party::A, |m, now| m.close(now, "q", "done"))
            .expect("closes");
        h.run();
        let q = Address::parse("q").expect("an address");
        let retires = h.a.machine.objects[&q].armed;
        assert!(retires.is_some(), "a closed object waits to retire");
        table_matches_objects(&h.a.machine);
        h.advance(Duration::from_secs(10));
        open(&mut h);
        table_matches_objects(&h.a.machine);
        assert!(
            h.a.machine
                .timers
                .iter()
                .all(|(at, _)| Some(*at) != retires),
            "the old object's retirement is not left in the table"
        );
        // Past the old object's retirement the new one is still there.
        h.advance(Duration::from_secs(55));
        h.run();
        assert!(h.a.machine.objects.contains_key(&q));
        table_matches_objects(&h.a.machine);
        h.with(Party::A, |m, now| m.close(now, "q", "done"))
            .expect("closes");
        h.run();
        h.advance(Duration::from_secs(61));
        h.run();
        assert!(!h.a.machine.objects.contains_key(&q), "retired");
        table_matches_objects(&h.a.machine);
        assert!(h.a.machine.timers.is_empty());
    }
}
