//! The directory's inputs: host claims registered and handed off, records to the node (claims, telemetry control), and frames addressed to actors.

use super::*;

impl<C: Clone> Driver<C> {
    /// This node hosts `claim.actor` (a claim it signed with its key; a [`Handoff`] it
    /// carries is the previous holder's consent): the claim is announced to every peer with an
    /// actor connection now, and to every peer connected later.
    ///
    /// Answered by [`Answer::Registered`] ([`Driver::poll_answer`]).
    pub fn handle_register(&mut self, now: Time, claim: HostClaim) {
        let answer = self.answer_register(now, claim);
        self.answer = Some(Answer::Registered(answer));
    }

    /// What [`Driver::handle_register`] answers.
    pub(super) fn answer_register(
        &mut self,
        _now: Time,
        claim: HostClaim,
    ) -> Result<(), RegisterError> {
        if !claim.verify() {
            return Err(RegisterError::BadSignature);
        }
        let held = self.local_claims.get(&claim.actor).map(|c| c.generation);
        match held {
            Some(held) if held >= claim.generation => return Err(RegisterError::Stale),
            None if self.local_claims.len() >= LOCAL_CLAIMS_MAX => return Err(RegisterError::Full),
            _ => {}
        }
        if jumps(held, claim.generation) {
            return Err(RegisterError::Jump);
        }
        self.local_claims.insert(claim.actor, claim);
        self.directory.apply_local(&claim);
        let peers: Vec<NodeId> = self
            .cache
            .generations()
            .filter(|((_, channel), _)| *channel == Channel::Actor)
            .map(|((peer, _), _)| *peer)
            .collect();
        for peer in peers {
            self.actions.push_back(Action::Announce { peer, claim });
        }
        self.bump();
        Ok(())
    }

    /// This node consents (`handoff`, signed with its key) that `actor`, which it hosts, move
    /// to `to` at `generation`: it hosts the actor no more (nothing more is announced for it)
    /// and its own route names `to`. `to` registers the actor with the handoff attached; peers
    /// that hold this node's route take it.
    ///
    /// Answered by [`Answer::Registered`] ([`Driver::poll_answer`]).
    pub fn handle_hand_off(
        &mut self,
        now: Time,
        actor: ActorAddr,
        to: NodeId,
        generation: u64,
        handoff: Handoff,
    ) {
        let answer = self.answer_hand_off(now, actor, to, generation, handoff);
        self.answer = Some(Answer::Registered(answer));
    }

    /// What [`Driver::handle_hand_off`] answers.
    pub(super) fn answer_hand_off(
        &mut self,
        _now: Time,
        actor: ActorAddr,
        to: NodeId,
        generation: u64,
        handoff: Handoff,
    ) -> Result<(), RegisterError> {
        let Some(held) = self.local_claims.get(&actor) else {
            return Err(RegisterError::NotHosted);
        };
        if handoff.from != held.host || !handoff.verify(&actor, &to, generation) {
            return Err(RegisterError::BadSignature);
        }
        if generation <= held.generation {
            return Err(RegisterError::Stale);
        }
        if jumps(Some(held.generation), generation) {
            return Err(RegisterError::Jump);
        }
        self.local_claims.remove(&actor);
        self.directory.hand_off(actor, to, generation);
        self.bump();
        Ok(())
    }

    /// A record the driver owns arrived from `peer` (routing said
    /// [`crate::driver::Inbound::Driver`]): a host claim or a telemetry subscription control.
    pub fn handle_record(&mut self, now: Time, peer: NodeId, tag: &str, payload: &[u8]) {
        self.handle_checked_record(now, peer, DriverRecord::check(tag, payload));
    }

    /// [`Driver::handle_record`] on a record the shell checked before taking its lock.
    pub fn handle_checked_record(&mut self, now: Time, peer: NodeId, record: DriverRecord<'_>) {
        match record {
            DriverRecord::Claim(claim) => {
                self.answer_checked_claim(now, peer, claim);
            }
            DriverRecord::Control(payload) => {
                self.answer_telemetry_control(now, peer, payload);
            }
            DriverRecord::Other => {}
        }
    }

    /// This node publishes telemetry stream `name` (collectors may subscribe to it).
    pub fn handle_telemetry_stream(&mut self, _now: Time, name: &str) {
        self.subscriptions.add_stream(name);
    }

    /// A subscription control record from `collector`: a publisher starts or stops. The
    /// collector must be admitted on the telemetry path (the publisher dials it).
    ///
    /// Answered by [`Answer::Control`] ([`Driver::poll_answer`]).
    pub fn handle_telemetry_control(&mut self, now: Time, collector: NodeId, payload: &[u8]) {
        let answer = self.answer_telemetry_control(now, collector, payload);
        self.answer = Some(Answer::Control(answer));
    }

    /// What [`Driver::handle_telemetry_control`] answers.
    pub(super) fn answer_telemetry_control(
        &mut self,
        now: Time,
        collector: NodeId,
        payload: &[u8],
    ) -> Option<ControlVerdict> {
        self.answer_admit(now, &collector, Path::Telemetry, Direction::Outbound)
            .ok()?;
        let (verdict, subscription) = self.subscriptions.apply(collector, payload);
        if let Some(((collector, stream, flow_id), publisher)) = subscription {
            self.actions.push_back(match verdict {
                ControlVerdict::Started => Action::StartPublisher {
                    collector,
                    stream,
                    flow_id,
                    publisher,
                },
                _ => Action::StopPublisher {
                    collector,
                    stream,
                    flow_id,
                    publisher,
                },
            });
        }
        self.bump();
        Some(verdict)
    }

    /// Publisher `publisher` of `subscription` ended (stopped, or its collector went away):
    /// the subscription is gone, unless it was stopped and started again under a newer
    /// publisher meanwhile (which goes on).
    pub fn handle_publisher_ended(
        &mut self,
        _now: Time,
        subscription: &Subscription,
        publisher: Publisher,
    ) {
        if self.subscriptions.ended(subscription, publisher) {
            self.bump();
        }
    }

    /// A host claim arrived from `peer` (the payload of a record tagged
    /// [`crate::driver::directory::HOST_CLAIM_TAG`] to this node's mailbox): the ownership rule of
    /// [`crate::driver::directory`] says whether it is taken.
    ///
    /// Answered by [`Answer::Claim`] ([`Driver::poll_answer`]).
    pub fn handle_claim(&mut self, now: Time, peer: NodeId, bytes: &[u8]) {
        let answer = self.answer_claim(now, peer, bytes);
        self.answer = Some(Answer::Claim(answer));
    }

    /// What [`Driver::handle_claim`] answers.
    pub(super) fn answer_claim(&mut self, now: Time, peer: NodeId, bytes: &[u8]) -> ClaimVerdict {
        self.answer_checked_claim(now, peer, CheckedClaim::check(bytes))
    }

    /// [`Driver::handle_claim`] on claim bytes the shell checked before taking its lock.
    ///
    /// Answered by [`Answer::Claim`] ([`Driver::poll_answer`]).
    pub fn handle_checked_claim(&mut self, now: Time, peer: NodeId, claim: CheckedClaim) {
        let answer = self.answer_checked_claim(now, peer, claim);
        self.answer = Some(Answer::Claim(answer));
    }

    /// What [`Driver::handle_checked_claim`] answers.
    pub(super) fn answer_checked_claim(
        &mut self,
        _now: Time,
        peer: NodeId,
        claim: CheckedClaim,
    ) -> ClaimVerdict {
        let verdict = self.directory.apply_checked(&peer, claim);
        // Every verdict is counted, so every one is a change.
        self.bump();
        verdict
    }

    /// Where a frame for `actor` (hosted elsewhere) goes: the peer the route view names
    /// (through the location cache), admitted; else dropped, counted (`no_route` or
    /// `unauthorized`).
    ///
    /// Answered by [`Answer::Route`] ([`Driver::poll_answer`]).
    pub fn handle_send_to_actor(&mut self, now: Time, actor: ActorAddr) {
        let answer = self.answer_send_to_actor(now, actor);
        self.answer = Some(Answer::Route(answer));
    }

    /// What [`Driver::handle_send_to_actor`] answers.
    pub(super) fn answer_send_to_actor(
        &mut self,
        _now: Time,
        actor: ActorAddr,
    ) -> Result<NodeId, DropReason> {
        let directory = &mut self.directory;
        let resolved = resolve_egress(
            Egress::Actor(actor),
            |a| directory.locate(a),
            &self.config.auth,
        );
        if let Err(reason) = resolved {
            if reason == DropReason::Unauthorized {
                self.refusals.count(Refused {
                    path: Path::Actor,
                    direction: Direction::Outbound,
                });
            }
            self.dropped(reason);
        }
        resolved
    }

    /// The next batch of this node's claims for `peer` (by actor, after the last announced),
    /// over its cached actor connection; a batch shorter than [`Config::announce_batch`] is
    /// the last. Nothing once the peer has no actor connection.
    pub(super) fn announce_more(&mut self, peer: NodeId) {
        let Some(&after) = self.announcing.get(&peer) else {
            return;
        };
        if self.cache.peek(&(peer, Channel::Actor)).is_none() {
            self.announcing.remove(&peer);
            return;
        }
        let batch_max = self.config.announce_batch.max(1);
        let from = match after {
            None => std::ops::Bound::Unbounded,
            Some(actor) => std::ops::Bound::Excluded(actor),
        };
        let batch: Vec<HostClaim> = self
            .local_claims
            .range((from, std::ops::Bound::Unbounded))
            .take(batch_max)
            .map(|(_, claim)| *claim)
            .collect();
        match batch.last() {
            Some(last) if batch.len() == batch_max => {
                self.announcing.insert(peer, Some(last.actor));
            }
            _ => {
                self.announcing.remove(&peer);
            }
        }
        for claim in batch {
            self.actions.push_back(Action::Announce { peer, claim });
        }
    }
}
