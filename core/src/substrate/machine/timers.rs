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
        self.objects.remove(obj);
        if let Some(at) = self.deadlines.remove(obj) {
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
        let next = self.objects.get(obj).and_then(|o| self.next_deadline(o));
        let before = self.deadlines.get(obj).copied();
        if before == next {
            return;
        }
        if let Some(at) = before {
            self.timers.remove(&(at, obj.to_owned()));
            self.deadlines.remove(obj);
        }
        if let Some(at) = next {
            self.timers.insert((at, obj.to_owned()));
            self.deadlines.insert(obj.to_owned(), at);
        }
    }

    /// The earliest time `object` needs [`Machine::handle_timeout`]: a resync (only with a
    /// link to send it on), a transient retry, a TTL expiry, or retirement (only once nothing
    /// is left in it). O(log n).
    pub(super) fn next_deadline(&self, object: &Object) -> Option<Time> {
        let config = &self.config;
        let gap = object.gap_since.filter(|_| self.link_up).map(|since| {
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
}
