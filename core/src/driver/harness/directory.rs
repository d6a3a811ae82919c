//! The world's directory: host claims announced, handed off and delivered, telemetry subscriptions and their publishers, and their checks.

use super::*;

impl World {
    /// Node `n` announces `claim` to `peer`: only a claim it holds (the newest it registered
    /// for the actor), only over an actor connection it has cached.
    pub(super) fn announced(
        &mut self,
        n: usize,
        peer: NodeId,
        claim: HostClaim,
    ) -> Result<(), String> {
        if self.claims.local.get(&(n, claim.actor)) != Some(&claim.generation)
            || claim.host != self.claims.hosts[n]
        {
            return Err(format!(
                "node {n} announced a claim it does not hold: {claim:?}"
            ));
        }
        let Some((_, conn)) = self.sims[n].driver.connection(&peer, Channel::Actor) else {
            return Err(format!(
                "node {n} announced to {}, with no connection",
                peer.0[0]
            ));
        };
        // Written on a connection that already died (its close not yet reported): lost.
        let alive = self.conns.get(&conn).is_some_and(|c| c.alive);
        if let (Some(to), true) = (index_of(&peer), alive) {
            self.claims.pending.push((n, to, conn, claim));
        }
        Ok(())
    }

    /// A claim op, chosen by `a`: node `n` registers an actor at a generation (stale ones
    /// included), or hands an actor it hosts off to another node (which registers it with the
    /// consent), or an announcement in flight arrives (possibly again later, possibly with a
    /// byte flipped on the way, possibly carried by a node that is not its host).
    pub(super) fn claim_op(&mut self, n: usize, a: u8, b: u8) -> Result<(), String> {
        if a & 1 == 0 {
            if self.sims[n].closed {
                return Ok(());
            }
            let actor = ACTORS[usize::from(a >> 1) % ACTORS.len()];
            if b & 0x18 == 0x10 {
                // An actor this node hosts, if it hosts one (else refused).
                let actor = ACTORS
                    .into_iter()
                    .find(|actor| self.claims.local.contains_key(&(n, *actor)))
                    .unwrap_or(actor);
                let to = (n + 1 + usize::from(b >> 7)) % NODES;
                return self.hand_off(n, to, actor);
            }
            let generation = u64::from(b % 6) + 1;
            let mut claim = HostClaim::sign(&secret(n), actor, generation);
            // Now and then a claim whose signature does not match it (one bit of it
            // changed): refused before anything else, whatever the node holds.
            let bad = b & 0xf8 == 0xf8;
            if bad {
                claim.signature[usize::from(a) % 64] ^= 1 << (b & 7);
            }
            let now = self.time();
            let result = self.sims[n].driver.ask_register(now, claim);
            let held = self.claims.local.get(&(n, actor)).copied();
            let expected = match held {
                _ if bad => Err(RegisterError::BadSignature),
                Some(held) if held >= generation => Err(RegisterError::Stale),
                _ => Ok(()),
            };
            if result != expected {
                return Err(format!(
                    "node {n} registered {:x} at {generation} holding {held:?}: {result:?}",
                    actor.0[0]
                ));
            }
            match result {
                Ok(()) => self.claims.register(n, &claim),
                Err(RegisterError::BadSignature) => self.claims.unsigned += 1,
                Err(_) => self.claims.refused += 1,
            }
            return self.actions(n);
        }
        if self.claims.pending.is_empty() {
            return Ok(());
        }
        let pick = usize::from(b) % self.claims.pending.len();
        // A copy with a byte changed (a forger's; QUIC itself corrupts nothing), a replay, or
        // a copy another node carries, leaves the announcement in flight; otherwise it arrives.
        let (forged, replayed) = (b & 0x80 != 0, b & 0x40 != 0);
        let relayed = !forged && b & 0x20 != 0;
        let (from, to, _, claim) = if forged || replayed || relayed {
            self.claims.pending[pick]
        } else {
            self.claims.pending.remove(pick)
        };
        if relayed {
            let carrier = (from + 1 + usize::from(a >> 7)) % NODES;
            return self.deliver_claim(carrier, to, claim, None);
        }
        // The byte a forger changes: anywhere in the claim.
        let flip = forged.then(|| usize::from(a >> 1) * 9 + usize::from(b & 0x3f));
        self.deliver_claim(from, to, claim, flip)
    }

    /// Node `n` hands `actor` off to node `to` at the next generation; `to` registers it with
    /// the handoff (unless it already holds a newer claim of its own).
    pub(super) fn hand_off(&mut self, n: usize, to: usize, actor: ActorAddr) -> Result<(), String> {
        let now = self.time();
        let held = self.claims.local.get(&(n, actor)).copied();
        let generation = held.unwrap_or(0) + 1;
        let new_host = self.claims.hosts[to];
        let handoff = Handoff::sign(&secret(n), &actor, &new_host, generation);
        let result = self.sims[n]
            .driver
            .ask_hand_off(now, actor, new_host, generation, handoff);
        let expected = match held {
            None => Err(RegisterError::NotHosted),
            Some(_) => Ok(()),
        };
        if result != expected {
            return Err(format!(
                "node {n} handed {:x} off holding {held:?}: {result:?}",
                actor.0[0]
            ));
        }
        if result.is_err() {
            self.claims.handoffs_refused += 1;
            return self.actions(n);
        }
        self.claims.handed_off += 1;
        self.claims.local.remove(&(n, actor));
        self.claims
            .routes
            .insert((n, actor), (new_host, generation));
        self.actions(n)?;
        if self.sims[to].closed {
            return Ok(());
        }
        let claim = HostClaim::sign(&secret(to), actor, generation).with_handoff(handoff);
        let result = self.sims[to].driver.ask_register(now, claim);
        let mine = self.claims.local.get(&(to, actor)).copied();
        let expected = match mine {
            Some(mine) if mine >= generation => Err(RegisterError::Stale),
            _ => Ok(()),
        };
        if result != expected {
            return Err(format!(
                "node {to} registered {:x} handed off at {generation} holding {mine:?}: {result:?}",
                actor.0[0]
            ));
        }
        match result {
            Ok(()) => self.claims.register(to, &claim),
            Err(_) => self.claims.refused += 1,
        }
        self.actions(to)
    }

    /// `claim` reaches node `to`, sent by node `from` (its host, or a node carrying it);
    /// `flip`: the byte a forger changed in it.
    pub(super) fn deliver_claim(
        &mut self,
        from: usize,
        to: usize,
        claim: HostClaim,
        flip: Option<usize>,
    ) -> Result<(), String> {
        if self.sims[to].closed {
            return Ok(());
        }
        let mut bytes = claim.encode();
        let sender = self.claims.hosts[from];
        let expected = if let Some(at) = flip {
            // Any byte: actor, host, generation, signature or handoff.
            let at = at % bytes.len();
            bytes[at] ^= 0x10;
            ClaimVerdict::Forged
        } else if sender != claim.host {
            ClaimVerdict::Relayed
        } else {
            self.claims.apply(to, &claim)
        };
        let now = self.time();
        let verdict = self.sims[to].driver.ask_claim(now, sender, &bytes);
        *self.claims.verdicts.entry(verdict).or_default() += 1;
        if verdict != expected {
            return Err(format!(
                "node {to}: a claim from {from} ({claim:?}, byte changed {flip:?}) judged {verdict:?}, \
                 not {expected:?}"
            ));
        }
        self.actions(to)
    }

    /// A telemetry op, chosen by `a` and `b`: node `n` (a collector) sends a control record
    /// to a source (subscribe or unsubscribe, a stream it may not publish, one of two flows,
    /// now and then malformed); or a running publisher's collector subscribes again or
    /// unsubscribes; or a running publisher ends on its own.
    pub(super) fn telemetry_op(&mut self, n: usize, a: u8, b: u8) -> Result<(), String> {
        if a & 3 == 1 {
            return self.publisher_ends(usize::from(b));
        }
        // Subscriptions with a publisher running, or stopped and still ending.
        let running: Vec<(usize, Subscription)> = self
            .publishers
            .running
            .keys()
            .cloned()
            .chain(
                self.publishers
                    .stopping
                    .iter()
                    .map(|(source, subscription, _)| (*source, subscription.clone())),
            )
            .collect();
        let (source, from, control) = match running.get(usize::from(b) % running.len().max(1)) {
            // Its collector subscribes again (a replay, or a new publisher while the stopped
            // one still ends), or unsubscribes.
            Some((source, (collector, name, flow_id))) if a & 2 == 2 => {
                let (source, name, flow_id) = (*source, name.clone(), *flow_id);
                let from = index_of(collector).ok_or("a publisher to a collector elsewhere")?;
                if a & 1 == 1 && a & 4 == 4 {
                    // It toggles: unsubscribes and subscribes at once (its stopped publisher
                    // ends after the new one started).
                    let unsubscribe = Control::Unsubscribe {
                        name: name.clone(),
                        flow_id,
                    };
                    self.control(source, from, unsubscribe, false)?;
                    return self.control(source, from, Control::Subscribe { name, flow_id }, false);
                }
                let control = if a & 1 == 0 {
                    Control::Subscribe { name, flow_id }
                } else {
                    Control::Unsubscribe { name, flow_id }
                };
                (source, from, control)
            }
            _ => {
                let name = STREAMS[usize::from((a >> 2) & 3) % STREAMS.len()].to_owned();
                let flow_id = [(b >> 5) & 1; 16];
                let control = if a & 0x10 == 0 {
                    Control::Subscribe { name, flow_id }
                } else {
                    Control::Unsubscribe { name, flow_id }
                };
                (usize::from(b >> 1) % NODES, n, control)
            }
        };
        self.control(source, from, control, b & 0xc0 == 0xc0)
    }

    /// Node `from` sends `control` to node `source` (`malformed`: with a byte too many).
    pub(super) fn control(
        &mut self,
        source: usize,
        from: usize,
        control: Control,
        malformed: bool,
    ) -> Result<(), String> {
        if self.sims[source].closed {
            return Ok(());
        }
        let mut bytes = control.encode().ok_or("a control that does not encode")?;
        if malformed {
            bytes.push(0);
        }
        let collector = id(from);
        let key = |name: &str, flow_id| (source, (collector, name.to_owned(), flow_id));
        let expected = if !self.auths[source].permits(&collector) {
            None
        } else if malformed {
            Some(ControlVerdict::Malformed)
        } else {
            Some(match &control {
                Control::Subscribe { name, .. } if !publishes(source, name) => {
                    ControlVerdict::UnknownStream
                }
                Control::Subscribe { name, flow_id } => {
                    if self.publishers.running.contains_key(&key(name, *flow_id)) {
                        ControlVerdict::Ignored
                    } else {
                        ControlVerdict::Started
                    }
                }
                Control::Unsubscribe { name, flow_id } => {
                    if self.publishers.running.contains_key(&key(name, *flow_id)) {
                        ControlVerdict::Stopped
                    } else {
                        ControlVerdict::Ignored
                    }
                }
            })
        };
        let now = self.time();
        let verdict = self.sims[source]
            .driver
            .ask_telemetry_control(now, collector, &bytes);
        if verdict != expected {
            return Err(format!(
                "node {source}: {control:?} from {from} (malformed {malformed}) judged {verdict:?}, \
                 not {expected:?}"
            ));
        }
        match verdict {
            Some(verdict) => *self.publishers.verdicts.entry(verdict).or_default() += 1,
            None => self.publishers.refused += 1,
        }
        self.actions(source)
    }

    /// A publisher ends (`pick` among the running and the stopped): one running ends on its
    /// own (its collector went away); a stopped one's end is reported late, perhaps after its
    /// subscription started again under a newer publisher, which must go on.
    pub(super) fn publisher_ends(&mut self, pick: usize) -> Result<(), String> {
        let running = self.publishers.running.len();
        let total = running + self.publishers.stopping.len();
        if total == 0 {
            return Ok(());
        }
        // Half the picks go to a stopped publisher when there is one.
        let pick = if pick & 1 == 1 && running < total {
            running + (pick >> 1) % (total - running)
        } else {
            pick % total
        };
        let (source, subscription, publisher) = if pick < running {
            let Some(((source, subscription), publisher)) =
                self.publishers.running.iter().nth(pick)
            else {
                return Ok(());
            };
            let ended = (*source, subscription.clone(), *publisher);
            self.publishers.running.remove(&(ended.0, ended.1.clone()));
            ended
        } else {
            let ended = self.publishers.stopping.remove(pick - running);
            if self
                .publishers
                .running
                .contains_key(&(ended.0, ended.1.clone()))
            {
                self.publishers.late_ends += 1;
            }
            ended
        };
        self.publishers.ended += 1;
        let now = self.time();
        self.sims[source]
            .driver
            .handle_publisher_ended(now, &subscription, publisher);
        self.actions(source)
    }

    /// Every node's live subscriptions are exactly the publishers it runs, number for number.
    pub(super) fn check_publishers(&self) -> Result<(), String> {
        for (n, sim) in self.sims.iter().enumerate() {
            if sim.closed {
                continue;
            }
            let running: Vec<(&Subscription, Publisher)> = self
                .publishers
                .running
                .iter()
                .filter(|((m, _), _)| *m == n)
                .map(|((_, subscription), publisher)| (subscription, *publisher))
                .collect();
            let live: Vec<(&Subscription, Publisher)> = sim.driver.publishers().collect();
            if live != running {
                return Err(format!(
                    "node {n}: subscriptions live {live:?}, publishers running {running:?}"
                ));
            }
        }
        Ok(())
    }

    /// Every node's route view is what the claims it took say.
    pub(super) fn check_claims(&self) -> Result<(), String> {
        for (n, sim) in self.sims.iter().enumerate() {
            for actor in ACTORS {
                let route = sim.driver.route(&actor).map(|r| (r.host, r.generation));
                let expected = self.claims.routes.get(&(n, actor)).copied();
                if route != expected {
                    return Err(format!(
                        "node {n}: route of {:x} is {route:?}, the claims say {expected:?}",
                        actor.0[0]
                    ));
                }
            }
        }
        Ok(())
    }

    /// Once healed, every announcement in flight arrives; then each node knows a route for
    /// every actor a peer it reaches hosts, and where that route is the peer's, at the peer's
    /// generation or newer (another node may have taken the actor first, or been handed it).
    pub(super) fn settle_claims(&mut self) -> Result<(), String> {
        while let Some((from, to, _, claim)) = self.claims.pending.pop() {
            self.deliver_claim(from, to, claim, None)?;
        }
        // Among the nodes still open: a closed node announces nothing more, and what reaches
        // it after its close is not asked of it.
        for ((holder, actor), generation) in &self.claims.local {
            for to in 0..NODES {
                if to == *holder
                    || self.sims[*holder].closed
                    || self.sims[to].closed
                    || !self.auths[*holder].permits(&id(to))
                    || !self.auths[to].permits(&id(*holder))
                {
                    continue;
                }
                let known = self.sims[to].driver.route(actor);
                let behind = match known {
                    None => true,
                    Some(route) => {
                        route.host == self.claims.hosts[*holder] && route.generation < *generation
                    }
                };
                if behind {
                    return Err(format!(
                        "node {to} knows {:x} as {known:?}; node {holder} hosts it at \
                         {generation} and is connected",
                        actor.0[0]
                    ));
                }
            }
        }
        Ok(())
    }
}
