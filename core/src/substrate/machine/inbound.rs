//! What the remote sends: ops sequenced per object (delivered in order, early ones held,
//! duplicates re-acked), acks, credit, resyncs and terminal errors.

use super::*;

impl Machine {
    pub(super) fn on_op(&mut self, now: Time, env: Env, body: Option<Bytes>) {
        let (Some(obj), Some(id), Some(seq)) = (env.obj.clone(), env.id.clone(), env.seq.map(Seq))
        else {
            self.stats.malformed += 1;
            return;
        };
        // The name the machine holds, when it holds the object: the decoded copy is dropped.
        let obj = self.interned(&obj).unwrap_or(obj);
        let initiating = matches!(env.kind, Verb::Open | Verb::Send | Verb::Req | Verb::Close);
        if initiating {
            let ctx = AuthorizeContext {
                peer: &self.remote,
                verb: env.kind,
                obj: &obj,
                obj_kind: env.obj_kind,
                cap: env.cap.as_deref(),
            };
            if let Err(denial) = self.authorizer.check(&ctx) {
                let key = format!("{}:{}", env.kind.as_str(), denial.code);
                *self.stats.denials.entry(key).or_default() += 1;
                self.send_now(now, substrate_err(&obj, &id, &denial.code));
                return;
            }
        }
        let op = Op {
            obj: obj.clone(),
            seq,
            id,
            verb: env.kind,
            obj_kind: env.obj_kind,
            body,
            code: env.code,
            reason: env.reason,
            cap: env.cap,
            at: now,
        };
        let receipt = env.receipt.unwrap_or(1);
        let known = self.objects.get(&obj).is_some_and(|object| {
            !(op.verb == Verb::Open
                && object.record.state.is_terminal()
                && object.record.open_id != op.id)
        });
        if !known {
            self.on_unknown_object(now, op, receipt);
            return;
        }
        let object = self.objects.get(&obj).expect("known");
        let killing = matches!(op.verb, Verb::Close | Verb::Err);
        if killing && !object.remote_is_participant() && op.seq >= object.record.rx_next {
            // Law 2: finality only from a participant, refused before the frontier moves.
            self.stats.finality_rejected += 1;
            return;
        }
        self.sequence(now, op, receipt, Seq(env.floor.unwrap_or(0)));
    }

    /// An op for an object this side does not know.
    pub(super) fn on_unknown_object(&mut self, now: Time, op: Op, receipt: u64) {
        match op.verb {
            Verb::Open => {
                if self.live_object_count() >= self.config.objects_max {
                    self.send_now(now, substrate_err(&op.obj, &op.id, finality::QUOTA));
                    return;
                }
                self.bound_retained_objects();
                let record = ObjectRecord {
                    obj: op.obj.clone(),
                    kind: op.obj_kind.unwrap_or(ObjKind::Session),
                    opened_by: Side::Remote,
                    open_id: op.id.clone(),
                    state: ObjectState::AwaitingAccept,
                    tx_next: Seq::ZERO,
                    rx_next: Seq::ZERO,
                };
                self.put_object(op.obj.clone(), Object::new(record));
                self.sequence(now, op, receipt, Seq::ZERO);
            }
            // Laws 2 and 4: a killing verb or an err to an unknown object is never bounced.
            Verb::Close | Verb::Err => self.stats.finality_rejected += 1,
            _ => self.bounce(now, &op),
        }
    }

    /// Law 3: one bounce per op id; a duplicate is re-served the stored outcome.
    pub(super) fn bounce(&mut self, now: Time, op: &Op) {
        if let Some((code, _)) = self.bounces.get(&op.id) {
            self.stats.bounces_reserved += 1;
            let frame = substrate_err(&op.obj, &op.id, &code.clone());
            self.staged_outputs.push(Deferred::Transmit(frame));
            return;
        }
        if self.bounces.len() >= crate::limits::SUBSTRATE_BOUNCES_MAX {
            let (_, oldest) = self
                .bounce_order
                .pop_first()
                .expect("the map is full, so not empty");
            self.bounces.remove(&oldest);
            self.staged.push(Record::BounceRemoved { op_id: oldest });
            self.stats.bounces_evicted += 1;
        }
        let code = finality::NO_SUCH_OBJECT.to_owned();
        self.bounces.insert(op.id.clone(), (code.clone(), now));
        self.bounce_order.insert((now, op.id.clone()));
        self.staged.push(Record::Bounce {
            op_id: op.id.clone(),
            code: code.clone(),
            at: now,
        });
        self.stats.bounces += 1;
        self.staged_outputs
            .push(Deferred::Transmit(substrate_err(&op.obj, &op.id, &code)));
    }

    /// The receiving half of per-object FIFO.
    pub(super) fn sequence(&mut self, now: Time, op: Op, receipt: u64, floor: Seq) {
        let obj = op.obj.clone();
        self.advance_to_floor(now, &obj, floor);
        let window = self.config.receive_window;
        let object = self
            .objects
            .get_mut(&obj)
            .expect("callers create the object");
        let next = object.record.rx_next;
        if op.seq < next || object.held.contains_key(&op.seq) {
            self.stats.duplicates += 1;
            // Waits for the latest unpersisted batch: the original may still be in it.
            self.stage_ack(&obj, &op.id, op.seq, receipt);
            return;
        }
        if op.seq >= object.receive_limit(window) {
            // Past the credit this side gave: only a misbehaving peer sends this.
            self.stats.out_of_seq += 1;
            self.send_now(now, substrate_err(&obj, &op.id, finality::OUT_OF_SEQ));
            return;
        }
        if op.seq > next {
            self.stats.deferred += 1;
            object.gap_since.get_or_insert(now);
            self.staged.push(Record::Held(op.clone()));
            let (id, seq) = (op.id.clone(), op.seq);
            object.held.insert(op.seq, op);
            self.stage_ack(&obj, &id, seq, receipt);
            return;
        }
        object.record.rx_next = next + 1;
        let (id, seq) = (op.id.clone(), op.seq);
        self.apply(now, op);
        self.deliver_held(now, &obj);
        self.stage_ack(&obj, &id, seq, receipt);
    }

    /// The peer's floor: every seq of its direction below `floor` ended there or was acked.
    /// The acked ones are held here (durably): they are delivered, in order. Only the seqs
    /// never received are skipped.
    pub(super) fn advance_to_floor(&mut self, now: Time, obj: &Address, floor: Seq) {
        let Some(object) = self.objects.get_mut(obj) else {
            return;
        };
        let from = object.record.rx_next;
        if floor <= from {
            return;
        }
        let held_below = object.held.range(..floor).count() as u64;
        self.stats.skipped_below_floor += floor - from - held_below;
        while let Some(object) = self.objects.get_mut(obj) {
            let Some(entry) = object.held.first_entry().filter(|e| *e.key() < floor) else {
                break;
            };
            let op = entry.remove();
            object.record.rx_next = op.seq + 1;
            self.staged.push(Record::HeldRemoved {
                obj: obj.clone(),
                seq: op.seq,
            });
            self.apply(now, op);
        }
        if let Some(object) = self.objects.get_mut(obj) {
            object.record.rx_next = object.record.rx_next.max(floor);
        }
        self.deliver_held(now, obj);
    }

    /// A hop ack of the peer's op `seq`, with news of this side's credit when there is any,
    /// released with the batch that made the op durable.
    pub(super) fn stage_ack(&mut self, obj: &Address, id: &OpId, seq: Seq, receipt: u64) {
        let limit = self.credit_news(obj).map(|(limit, _)| limit);
        let frame = ack_frame(obj, id, seq, receipt, limit);
        self.staged_outputs.push(Deferred::Transmit(frame));
    }

    /// The app freed room in `obj`: a credit update if there is news worth one. It waits for
    /// the batch that freed the room.
    /// An update given only because the news is worth half a window (the peer still has
    /// credit) goes whenever its batch is committed: nothing waits on it, so it does not make
    /// the batch urgent ([`Deferred::Lazily`]). The peer's next op, whose arrival is committed
    /// at once, takes it along; should the peer stop first, it had credit left.
    pub(super) fn stage_credit(&mut self, obj: &Address) {
        if let Some((limit, peer_may_wait)) = self.credit_news(obj) {
            self.stats.credits_sent += 1;
            let frame = credit_frame(obj, limit);
            self.staged_outputs.push(if peer_may_wait {
                Deferred::Transmit(frame)
            } else {
                Deferred::Lazily(frame)
            });
        }
    }

    /// The credit to tell the peer now, if any: more than it was told, and either it may be
    /// waiting for it (it used every seq it was told) or the news is worth half a window.
    /// Telling less often keeps acks small and identical across histories. With it, whether
    /// the peer may be waiting for it.
    pub(super) fn credit_news(&mut self, obj: &Address) -> Option<(Seq, bool)> {
        let window = self.config.receive_window;
        let initial = self.initial_credit;
        let object = self.objects.get_mut(obj)?;
        let limit = object.receive_limit(window);
        let told = object.limit_sent.max(initial);
        if limit <= told {
            return None;
        }
        let peer_may_wait = object.seen_end() >= told;
        if peer_may_wait || limit - told >= (window / 2).max(1) {
            object.limit_sent = limit;
            return Some((limit, peer_may_wait));
        }
        None
    }

    /// Delivers every held op the frontier has reached, then records the frontier.
    pub(super) fn deliver_held(&mut self, now: Time, obj: &Address) {
        loop {
            let Some(object) = self.objects.get_mut(obj) else {
                return;
            };
            let next = object.record.rx_next;
            let Some(op) = object.held.remove(&next) else {
                if object.held.is_empty() {
                    object.gap_since = None;
                } else {
                    object.gap_since.get_or_insert(now);
                }
                self.staged.push(Record::Object(object.durable_record()));
                return;
            };
            object.record.rx_next = next + 1;
            self.staged.push(Record::HeldRemoved {
                obj: obj.clone(),
                seq: next,
            });
            self.apply(now, op);
        }
    }

    /// Applies one op of the remote, in order.
    pub(super) fn apply(&mut self, now: Time, op: Op) {
        let object = self
            .objects
            .get_mut(&op.obj)
            .expect("sequenced ops have an object");
        let obj = op.obj.clone();
        match op.verb {
            Verb::Open => {
                let record = &object.record;
                if record.opened_by == Side::Remote && record.open_id == op.id {
                    self.staged_outputs
                        .push(Deferred::Event(open_requested(record, op.cap)));
                } else if record.opened_by == Side::Local && record.state == ObjectState::Opening {
                    // Both sides opened this address at once: the lower open id wins, on
                    // both sides alike. The winner says nothing more: the loser learns from
                    // the winner's open, which is on the wire before anything it sends next.
                    self.stats.open_conflicts += 1;
                    if op.id < record.open_id {
                        self.lose_open_race(&obj, op);
                    }
                } else {
                    // An open of an address that exists already here.
                    self.stats.open_conflicts += 1;
                    let frame = substrate_err(&obj, &op.id, finality::OPEN_CONFLICT);
                    self.staged_outputs.push(Deferred::Transmit(frame));
                }
            }
            Verb::Send | Verb::Req | Verb::Chunk => {
                if object.record.state != ObjectState::Live {
                    let code = finality::CLOSED;
                    self.staged_outputs
                        .push(Deferred::Transmit(substrate_err(&obj, &op.id, code)));
                    return;
                }
                self.staged.push(Record::Inbox(op.clone()));
                object.inbox.insert(op.seq, op.clone());
                self.staged_outputs
                    .push(Deferred::Event(Event::Delivered(op)));
            }
            Verb::Close => {
                object.record.state = ObjectState::Closed(now);
                let event = Event::Closed {
                    obj: obj.clone(),
                    reason: op.reason,
                    by_remote: true,
                };
                self.staged_outputs.push(Deferred::Event(event));
                // Only ops never transmitted are certainly undelivered. One already on the
                // wire may have been delivered before the close: it keeps its place and gets
                // its own outcome (a re-ack, or `closed` from the peer's closed object).
                self.purge_outbox(&obj, finality::CLOSED, Outgoing::never_sent);
                self.drop_unanswerable_reqs(&obj);
            }
            Verb::Accept => {
                if object.record.state == ObjectState::Opening {
                    object.record.state = ObjectState::Live;
                    self.staged_outputs
                        .push(Deferred::Event(Event::Opened { obj: obj.clone() }));
                }
                self.end_answered(&obj, &op.id);
            }
            Verb::Reject => {
                if object.record.state == ObjectState::Opening {
                    object.record.state = ObjectState::Rejected(now);
                    let event = Event::Rejected {
                        obj: obj.clone(),
                        code: op.code.clone(),
                    };
                    self.staged_outputs.push(Deferred::Event(event));
                }
                self.end_answered(&obj, &op.id);
                let code = op
                    .code
                    .as_deref()
                    .unwrap_or(finality::APPROVAL_DENIED)
                    .to_owned();
                self.purge_outbox(&obj, &code, |_| true);
            }
            Verb::Res | Verb::End | Verb::Err => {
                self.end_answered(&obj, &op.id);
                let event = Event::Answered {
                    obj,
                    req_id: op.id,
                    verb: op.verb,
                    body: op.body,
                    code: op.code,
                };
                self.staged_outputs.push(Deferred::Event(event));
            }
            Verb::Ack | Verb::Resync => self.stats.malformed += 1,
        }
    }

    /// An answer arrived for op `id`: it was received, so it leaves the outbox (its ack may
    /// have been lost with a connection).
    pub(super) fn end_answered(&mut self, obj: &Address, id: &str) {
        let Some(object) = self.objects.get_mut(obj) else {
            return;
        };
        if let Some(seq) = object.outbox.seq_of(id) {
            object.outbox.remove(seq);
            self.staged.push(Record::OutboxRemoved {
                obj: obj.clone(),
                seq,
            });
        }
    }

    /// Ends every outbox op of `obj` matching `filter` as futile with `code` (law 5).
    pub(super) fn purge_outbox(
        &mut self,
        obj: &Address,
        code: &str,
        filter: impl Fn(&Outgoing) -> bool,
    ) {
        let Some(object) = self.objects.get_mut(obj) else {
            return;
        };
        let seqs: Vec<Seq> = object
            .outbox
            .values()
            .filter(|e| filter(e))
            .map(|e| e.op.seq)
            .collect();
        for seq in seqs {
            let entry = object.outbox.remove(seq).expect("listed above");
            object.ended_max = object.ended_max.max(Some(seq));
            self.staged.push(Record::OutboxRemoved {
                obj: obj.clone(),
                seq,
            });
            *self.stats.futile.entry(code.to_owned()).or_default() += 1;
            let event = Event::Futile {
                obj: obj.clone(),
                op_id: entry.op.id,
                code: code.to_owned(),
            };
            self.staged_outputs.push(Deferred::Event(event));
        }
        self.staged.push(Record::Object(object.durable_record()));
    }

    /// An unsequenced `err` from the substrate of the peer (bounce, denial, out_of_seq, ...)
    /// about one of this side's ops.
    pub(super) fn on_substrate_err(&mut self, now: Time, env: &Env) {
        let Some(id) = env.id.as_deref() else {
            self.stats.malformed += 1;
            return;
        };
        let code = env
            .code
            .clone()
            .unwrap_or_else(|| finality::CLOSED.to_owned());
        // The object names where to look; an answer to an address the peer could not parse
        // (`routing_not_supported`) names none, so every object is searched.
        let found = self.objects.iter().find_map(|(name, object)| {
            let named = env.obj.as_ref().is_none_or(|obj| obj == name);
            let seq = object.outbox.transmitted_seq_of(id).filter(|_| named)?;
            Some((name.clone(), seq))
        });
        let Some((obj, seq)) = found else {
            // Not an op of ours in flight: dropped and counted, never answered (law 4).
            self.stats.finality_rejected += 1;
            return;
        };
        let obj = &obj;
        self.touch(obj);
        let object = self.objects.get_mut(obj).expect("found above");
        match class_of(&code) {
            Class::Transient => {
                let policy =
                    Backoff::new(self.config.transient_retry, self.config.transient_retry_cap);
                let failures = object.outbox.note_transient(seq);
                let at = now.saturating_add(policy.delay(failures, self.jitter.next_u64()));
                object.outbox.retry_at(seq, at);
                *self.stats.transient.entry(code).or_default() += 1;
            }
            Class::Terminal => {
                let is_open = seq == Seq::ZERO && object.record.opened_by == Side::Local;
                if is_open && object.record.state == ObjectState::Opening {
                    object.record.state = ObjectState::Rejected(now);
                    let event = Event::Rejected {
                        obj: obj.clone(),
                        code: Some(code.clone()),
                    };
                    self.staged_outputs.push(Deferred::Event(event));
                    self.purge_outbox(obj, &code, |_| true);
                } else {
                    self.purge_outbox(obj, &code, |e| e.op.seq == seq);
                }
            }
        }
    }

    pub(super) fn on_ack(&mut self, env: &Env) {
        let Some(obj) = env.obj.as_ref() else {
            self.stats.malformed += 1;
            return;
        };
        if let (Some(limit), Some(object)) = (env.limit, self.objects.get_mut(obj)) {
            object.tx_limit = object.tx_limit.max(Seq(limit));
        }
        let (Some(seq), Some(receipt)) = (env.seq.map(Seq), env.receipt) else {
            // A credit update carries only the object and its limit.
            if env.limit.is_none() {
                self.stats.malformed += 1;
            }
            return;
        };
        let Some(object) = self.objects.get_mut(obj) else {
            self.stats.stale_receipts += 1;
            return;
        };
        match object.outbox.get(seq) {
            Some(entry) if entry.in_flight && entry.receipt == receipt => {
                let entry = object.outbox.remove(seq).expect("matched above");
                self.staged.push(Record::OutboxRemoved {
                    obj: obj.clone(),
                    seq,
                });
                self.stats.ops_acked += 1;
                let event = Event::Acked {
                    obj: obj.clone(),
                    op_id: entry.op.id,
                };
                // The ack reports the peer's commit; this side's forgetting of the op adds
                // nothing to it when the peer applied the op in order (see
                // `Object::acked_in_order`), so the report does not wait for it.
                if object.acked_in_order(seq) {
                    self.stats.acks_reported_early += 1;
                    self.events.push_back(event);
                } else {
                    self.staged_outputs.push(Deferred::Event(event));
                }
            }
            _ => self.stats.stale_receipts += 1,
        }
    }

    /// A `resync` asks this side (as sender) to resend from `fromSeq` and to say its floor; one
    /// carrying `floor` instead is the peer (as sender) announcing its floor.
    pub(super) fn on_resync(&mut self, now: Time, env: &Env) {
        let Some(obj) = env.obj.as_ref() else {
            self.stats.malformed += 1;
            return;
        };
        match (env.from_seq.map(Seq), env.floor.map(Seq)) {
            (Some(from), _) => {
                self.stats.resyncs_received += 1;
                let Some(object) = self.objects.get_mut(obj) else {
                    return;
                };
                // Entries from `from` go out again; first the floor, which tells the peer
                // which seqs below it to stop waiting for.
                object.outbox.land_from(from);
                let floor = object.floor();
                if floor > from {
                    object.floor_sent = object.floor_sent.max(floor);
                    self.stats.floors_sent += 1;
                    self.send_now(now, floor_frame(obj, floor));
                }
            }
            (None, Some(floor)) => {
                // Skipped seqs free credit, and nothing else would tell the peer.
                self.advance_to_floor(now, obj, floor);
                self.stage_credit(obj);
            }
            (None, None) => self.stats.malformed += 1,
        }
    }
}
