//! The steps every input shares: deciding opens, minting and enqueueing ops, releasing what
//! a persisted batch covers, and transmitting what the credit allows.

use super::*;

impl Machine {
    /// Marks `obj` touched; it must exist and be live or opening (an open in flight still
    /// takes ops, which wait behind it).
    /// Returns the object's name as the machine holds it.
    pub(super) fn touch_open(&mut self, obj: &str) -> Result<Address, CommandError> {
        let (name, object) = self
            .objects
            .get_key_value_text(obj)
            .ok_or_else(|| no_such(obj))?;
        let (name, state) = (name.clone(), object.record.state);
        self.touched.insert(name.clone());
        if !matches!(state, ObjectState::Live | ObjectState::Opening) {
            return Err(CommandError::WrongState(obj.to_owned()));
        }
        Ok(name)
    }

    /// The name the machine holds for `obj`, if it holds the object: records and frames share
    /// it instead of copying the app's text.
    pub(super) fn interned(&self, obj: &str) -> Option<Address> {
        self.objects
            .get_key_value_text(obj)
            .map(|(name, _)| name.clone())
    }

    pub(super) fn decide(
        &mut self,
        now: Time,
        obj: &str,
        reject: Option<&str>,
    ) -> Result<(), CommandError> {
        let name = self.interned(obj).ok_or_else(|| no_such(obj))?;
        self.touched.insert(name.clone());
        let object = self.objects.get_mut(&name).ok_or_else(|| no_such(obj))?;
        if object.record.state != ObjectState::AwaitingAccept {
            return Err(CommandError::WrongState(obj.to_owned()));
        }
        object.record.state = match reject {
            None => ObjectState::Live,
            Some(_) => ObjectState::Rejected(now),
        };
        let open_id = object.record.open_id.clone();
        let verb = if reject.is_some() {
            Verb::Reject
        } else {
            Verb::Accept
        };
        let mut op = self.op(now, &name, verb, open_id);
        op.code = reject.map(str::to_owned);
        self.enqueue(op);
        self.end_step(now);
        Ok(())
    }

    /// [`Machine::send`] (`verb` Send) or [`Machine::req`] (`verb` Req), handing a refused
    /// body back: the peer parks a send its outbox has no room for, and keeps the body
    /// without a second reference to it.
    pub(crate) fn message(
        &mut self,
        now: Time,
        obj: &str,
        verb: Verb,
        body: Bytes,
    ) -> Result<OpId, Refused<Bytes>> {
        debug_assert!(matches!(verb, Verb::Send | Verb::Req));
        let checked = check_body(Some(&body)).and_then(|()| {
            let name = self.touch_open(obj)?;
            self.check_room(&name)?;
            Ok(name)
        });
        let name = match checked {
            Ok(name) => name,
            Err(error) => return Err(Refused { error, body }),
        };
        let id = self.mint();
        let mut op = self.op(now, &name, verb, id.clone());
        op.body = Some(body);
        self.enqueue(op);
        self.end_step(now);
        Ok(id)
    }

    /// Both sides opened `obj` at once and the peer's open (`theirs`) has the lower id: the
    /// object becomes the peer's, awaiting this side's decision, and this side's open and
    /// everything queued behind it end futile with `open_conflict` (only the open can have
    /// left: nothing follows an open on the wire before it is accepted).
    pub(super) fn lose_open_race(&mut self, obj: &Address, theirs: Op) {
        let ours = self.objects[obj].record.open_id.clone();
        let open_pending = self.objects[obj].outbox.seq_of(&ours).is_some();
        self.purge_outbox(obj, finality::OPEN_CONFLICT, |_| true);
        if !open_pending {
            // The open was hop-acked already (the winner consumed it): it still ends here.
            *self
                .stats
                .futile
                .entry(finality::OPEN_CONFLICT.to_owned())
                .or_default() += 1;
            let event = Event::Futile {
                obj: obj.clone(),
                op_id: ours,
                code: finality::OPEN_CONFLICT.to_owned(),
            };
            self.staged_outputs.push(Deferred::Event(event));
        }
        let object = self.objects.get_mut(obj).expect("the caller holds it");
        object.record.opened_by = Side::Remote;
        object.record.open_id = theirs.id;
        object.record.state = ObjectState::AwaitingAccept;
        if let Some(kind) = theirs.obj_kind {
            object.record.kind = kind;
        }
        self.staged.push(Record::Object(object.durable_record()));
        let event = open_requested(&object.record, theirs.cap);
        self.staged_outputs.push(Deferred::Event(event));
    }

    /// A closed object's reqs can never be answered: their deliveries leave the inbox (and
    /// are not delivered again after a restart). Sends stay until the app consumes them.
    pub(super) fn drop_unanswerable_reqs(&mut self, obj: &Address) {
        let Some(object) = self.objects.get_mut(obj) else {
            return;
        };
        let reqs: Vec<Seq> = object
            .inbox
            .iter()
            .filter(|(_, op)| op.verb == Verb::Req)
            .map(|(seq, _)| *seq)
            .collect();
        let freed = !reqs.is_empty();
        for seq in reqs {
            object.inbox.remove(&seq);
            self.staged.push(Record::InboxRemoved {
                obj: obj.clone(),
                seq,
            });
        }
        if freed {
            self.stage_credit(obj);
        }
    }

    pub(super) fn live_for_app(&self, obj: &str) -> Result<(), CommandError> {
        match self.objects.get_text(obj).map(|object| object.record.state) {
            Some(ObjectState::Live) => Ok(()),
            Some(_) => Err(CommandError::WrongState(obj.to_owned())),
            None => Err(no_such(obj)),
        }
    }

    /// Sends, reqs and answers are refused with `queue_full` at the outbox bound. The open,
    /// the accept or reject, and the close are never refused for room (each happens once per
    /// object), so an outbox holds at most `outbox_ops_max + 2` ops.
    pub(super) fn check_room(&self, obj: &Address) -> Result<(), CommandError> {
        let object = self.objects.get(obj).ok_or_else(|| no_such(obj))?;
        if object.outbox.len() >= self.config.outbox_ops_max {
            return Err(CommandError::QueueFull);
        }
        Ok(())
    }

    /// Keeps at most [`crate::limits::SUBSTRATE_RETAINED_OBJECTS_MAX`] closed or rejected
    /// objects: before another object is created, the oldest idle one is forgotten.
    pub(super) fn bound_retained_objects(&mut self) {
        let retained = self
            .objects
            .values()
            .filter(|o| o.record.state.is_terminal())
            .count();
        if retained < crate::limits::SUBSTRATE_RETAINED_OBJECTS_MAX {
            return;
        }
        let oldest = self
            .objects
            .iter()
            .filter(|(_, o)| o.outbox.is_empty() && o.inbox.is_empty() && o.held.is_empty())
            .filter_map(|(name, o)| match o.record.state {
                ObjectState::Closed(at) | ObjectState::Rejected(at) => Some((at, name.clone())),
                _ => None,
            })
            .min();
        if let Some((_, name)) = oldest {
            self.remove_object(&name);
            self.stats.objects_evicted += 1;
        }
    }

    pub(super) fn live_object_count(&self) -> usize {
        self.objects
            .values()
            .filter(|object| !object.record.state.is_terminal())
            .count()
    }

    /// The counter of an op id this machine minted in this boot ([`Machine::mint`]), or `None`
    /// for any other id: a number that rises with every id minted, for tables of this side's
    /// ops in flight kept in order.
    pub fn minted_counter(&self, id: &OpId) -> Option<u64> {
        id.words()
            .filter(|(boot, _)| *boot == self.boot)
            .map(|(_, counter)| counter)
    }

    /// The boot its ids are minted under (tests make ids of it).
    #[cfg(test)]
    pub(crate) fn boot(&self) -> u64 {
        self.boot
    }

    pub(super) fn mint(&mut self) -> OpId {
        self.minted += 1;
        OpId::from_words(self.boot, self.minted)
    }

    pub(super) fn op(&self, now: Time, obj: &Address, verb: Verb, id: OpId) -> Op {
        Op {
            obj: obj.clone(),
            seq: Seq::ZERO,
            id,
            verb,
            obj_kind: None,
            body: None,
            code: None,
            reason: None,
            cap: None,
            at: now,
        }
    }

    /// Gives `op` the object's next seq and puts it in the outbox, durably. The seq is always
    /// below the object's durable reservation (renewed in the same batch when half of it is
    /// used), so the insert alone records it.
    pub(super) fn enqueue(&mut self, mut op: Op) {
        let batch = self.next_batch;
        let object = self
            .objects
            .get_mut(&op.obj)
            .expect("commands check the object");
        op.seq = object.record.tx_next;
        object.record.tx_next += 1;
        // A send below the committed reservation goes on the wire before its insert is
        // committed; while the link is up nothing waits for that commit but a crash, so it is
        // lazy: the hop ack usually comes first and the insert and its removal are committed
        // together (or not at all) with the next batch something waits on.
        let travels = op.verb == Verb::Send
            && self.link_up
            && op.seq < object.reserved_through(self.persisted_through);
        let op_obj = op.obj.clone();
        let reserve = self.config.seq_reserve;
        let renews = object.reserved < object.record.tx_next.saturating_add(reserve / 2);
        if renews {
            object.reserved = object.record.tx_next.saturating_add(reserve);
            object.reserved_batch = batch;
            self.staged.push(Record::Object(object.durable_record()));
        }
        self.staged.push(Record::Outbox(op.clone()));
        let entry = Outgoing {
            op,
            batch,
            receipt: 0,
            in_flight: false,
            retry_at: None,
            recovered: false,
            transient_failures: 0,
        };
        object.outbox.insert(entry);
        self.stats.ops_enqueued += 1;
        // A renewal is waited on: the sends past the old reservation go once it is committed.
        if (renews || !travels) && self.awaiting_persist.back() != Some(&(batch, op_obj.clone())) {
            self.awaiting_persist.push_back((batch, op_obj));
        }
    }

    /// Sends a frame that needs no durability (keepalive, resync, denial, out_of_seq).
    pub(super) fn send_now(&mut self, now: Time, frame: Envelope) {
        if self.link_up {
            self.last_sent = now;
            self.transmit.push_back(frame);
        }
    }

    pub(super) fn release(&mut self, mut outputs: Vec<Deferred>) {
        for output in outputs.drain(..) {
            match output {
                Deferred::Transmit(frame) | Deferred::Lazily(frame) => {
                    if self.link_up {
                        self.transmit.push_back(frame);
                    }
                }
                Deferred::Event(event) => self.events.push_back(event),
            }
        }
        self.spares.outputs.keep(outputs);
    }

    /// Ends every input: staged records become one batch, and the outputs staged with them
    /// wait for it; outputs staged without records wait for the latest unpersisted batch.
    pub(super) fn end_step(&mut self, now: Time) {
        if !self.staged.is_empty() {
            let id = self.next_batch;
            self.next_batch = BatchId(id.0 + 1);
            let records = std::mem::replace(&mut self.staged, self.spares.records.take());
            let outputs = std::mem::replace(&mut self.staged_outputs, self.spares.outputs.take());
            self.persist.push_back(PersistBatch { id, records });
            self.waiting.push_back((id, outputs));
        } else if !self.staged_outputs.is_empty() {
            match self.waiting.back_mut() {
                Some((_, waiting)) => {
                    waiting.append(&mut self.staged_outputs);
                }
                None => {
                    let outputs =
                        std::mem::replace(&mut self.staged_outputs, self.spares.outputs.take());
                    self.release(outputs);
                }
            }
        }
        // The room of a large step (or of a read that moved its step into a large spare and
        // staged nothing there) goes back to the spares, not to the next step.
        self.spares.records.shed(&mut self.staged);
        self.spares.outputs.shed(&mut self.staged_outputs);
        let touched = self.touched.take();
        self.transmit_ready(now, &touched);
        self.touched.restore(touched);
    }

    /// Puts every persisted, transmittable outbox op of the `touched` objects on the wire
    /// while the link is up, within each object's window and credit (an object no input
    /// touched has nothing new to send: what unblocks an object is an input about it), and
    /// re-arms each one's timer ([`Machine::rearm`], in the same lookup of the object). An
    /// object that is gone took its timer with it (`remove_object`).
    pub(super) fn transmit_ready(&mut self, now: Time, touched: &[Address]) {
        let window = self.window;
        let persisted = self.persisted_through;
        let initial_credit = self.initial_credit;
        for name in touched {
            let Some(object) = self.objects.get_mut(name) else {
                continue;
            };
            if self.link_up {
                Self::transmit_object(
                    now,
                    name,
                    object,
                    &mut self.transmit,
                    &mut self.stats,
                    &mut self.last_sent,
                    (window, persisted, initial_credit),
                );
            }
            super::timers::arm(&mut self.timers, &self.config, self.link_up, name, object);
        }
    }

    /// [`Machine::transmit_ready`] of one object.
    fn transmit_object(
        now: Time,
        name: &Address,
        object: &mut Object,
        transmit: &mut VecDeque<Envelope>,
        stats: &mut Stats,
        last_sent: &mut Time,
        (window, persisted, initial_credit): (usize, BatchId, Seq),
    ) {
        let floor = object.floor();
        let opening = object.record.state == ObjectState::Opening;
        let limit = object.tx_limit.max(initial_credit);
        let reserved = object.reserved_through(persisted);
        if object.outbox.transmit(
            (persisted, reserved),
            opening,
            window,
            (floor, limit),
            transmit,
            stats,
        ) {
            object.floor_sent = object.floor_sent.max(floor);
            *last_sent = now;
        }
        // The first op waits for credit the peer may only give once it knows the floor
        // (a restart forgot what ended below it): the floor goes alone.
        let credit_blocked = object
            .outbox
            .first_seq()
            .is_some_and(|first| first >= limit);
        if object.floor_unannounced() || (credit_blocked && floor > object.floor_sent) {
            object.floor_sent = floor;
            stats.floors_sent += 1;
            transmit.push_back(floor_frame(name, floor));
            *last_sent = now;
        }
    }
}
