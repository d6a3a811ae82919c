//! The world's opens: connections dialed and cached, opens placed, waited and abandoned, and the checks that every open ends once and shares its dial.

use super::*;

impl World {
    /// Node `from` reaches `peer` over a new connection: the peer must admit it (on the actor
    /// ALPN). `None` when it does not answer or refuses.
    pub(super) fn connect(&mut self, from: usize, peer: NodeId) -> Result<Option<u64>, String> {
        self.connect_on(from, peer, Channel::Actor)
    }

    /// As [`World::connect`], on `channel`'s ALPN.
    pub(super) fn connect_on(
        &mut self,
        from: usize,
        peer: NodeId,
        channel: Channel,
    ) -> Result<Option<u64>, String> {
        let Some(to) = index_of(&peer) else {
            return Ok(None);
        };
        if self.sims[to].closed {
            return Ok(None);
        }
        let conn = self.next_conn;
        self.next_conn += 1;
        let now = self.time();
        let alpn = match channel {
            Channel::Actor => ACTOR,
            Channel::Switch => SWITCH,
            Channel::Telemetry => TELEMETRY,
            Channel::Protocol(_) => PROTOCOL,
            Channel::Substrate => SUBSTRATE,
        };
        self.sims[to]
            .driver
            .handle_accepted(now, id(from), alpn, conn);
        let dispatch = self.sims[to]
            .driver
            .take_dispatch()
            .ok_or_else(|| format!("node {to}: an accept queued no dispatch"))?;
        match (channel, dispatch) {
            (Channel::Actor, Dispatch::Actor(generation))
            | (Channel::Switch, Dispatch::Switch(generation))
            | (Channel::Telemetry, Dispatch::Telemetry(generation))
            | (Channel::Protocol(0), Dispatch::Protocol(0, generation))
            | (Channel::Substrate, Dispatch::Substrate(generation)) => {
                if !serves(to, channel) {
                    return Err(format!(
                        "node {to} took {channel:?}, which it does not serve"
                    ));
                }
                if !self.auths[to].permits(&id(from)) {
                    return Err(format!("node {to} admitted {from}, who is off its list"));
                }
                self.conns.insert(
                    conn,
                    Conn {
                        ends: [from, to],
                        alive: true,
                    },
                );
                self.cached.push((to, conn, id(from), channel, generation));
                self.actions(to)?;
                Ok(Some(conn))
            }
            (_, Dispatch::NoAdapter) if serves(to, channel) => Err(format!(
                "node {to} has no adapter for {channel:?}, which it serves"
            )),
            (_, Dispatch::Refused(_)) if self.auths[to].permits(&id(from)) => Err(format!(
                "node {to} refused {from} on {channel:?}, who is on its list"
            )),
            (_, dispatch @ (Dispatch::Refused(_) | Dispatch::NoAdapter)) => {
                if dispatch == Dispatch::NoAdapter {
                    self.opens.no_adapter += 1;
                }
                self.actions(to)?;
                Ok(None)
            }
            (channel, other) => Err(format!("{channel:?} ALPN dispatched as {other:?}")),
        }
    }

    /// Node `n` opens a stream to `peer` on `channel`: the allow-list, then where the
    /// machine places it.
    pub(super) fn open(&mut self, n: usize, peer: NodeId, channel: Channel) -> Result<(), String> {
        let now = self.time();
        let verdict = self.sims[n]
            .driver
            .ask_open(now, peer, channel.path(), channel);
        let permitted = self.auths[n].permits(&peer);
        if self.sims[n].closed {
            // A closed node still judges the peer first, then opens nothing and orders
            // nothing.
            return match verdict {
                Ok(Open::Closed) if permitted => {
                    self.opens.closed += 1;
                    self.nothing_ordered(n)
                }
                Err(_) if !permitted => self.nothing_ordered(n),
                other => Err(format!(
                    "closed node {n}: an open to {} answered {other:?}",
                    peer.0[0]
                )),
            };
        }
        match verdict {
            Ok(_) if !permitted => Err(format!("node {n} opened to {}, off its list", peer.0[0])),
            Err(_) if permitted => Err(format!("node {n} refused an open to {}", peer.0[0])),
            Err(_) => self.actions(n),
            Ok(verdict) => {
                self.opens.asked += 1;
                self.place(n, peer, channel, verdict, None)
            }
        }
    }

    /// Follows an open's `verdict` (`waited`: the dial it waited on and asked again about),
    /// checking each: a stream goes on a live cached connection (a dead one is reported and
    /// the machine asked again); a dial is the only one in flight for the pair; a wait is on
    /// the dial in flight; a failure follows a failed dial the open waited on.
    pub(super) fn place(
        &mut self,
        n: usize,
        peer: NodeId,
        channel: Channel,
        mut verdict: Open<u64>,
        waited: Option<DialTicket>,
    ) -> Result<(), String> {
        let now = self.time();
        loop {
            verdict = match verdict {
                Open::Cached(generation, conn) => {
                    // The pair's own connection: one between the two nodes, cached on the
                    // channel under that generation (or, once dead, one between the two).
                    let ends = self.conns.get(&conn).map(|c| c.ends);
                    let between = index_of(&peer)
                        .is_some_and(|m| ends.is_some_and(|ends| ends == [n, m] || ends == [m, n]));
                    let cached = self.cached.iter().any(|(m, c, p, ch, g)| {
                        (*m, *c, *p, *ch, *g) == (n, conn, peer, channel, generation)
                    });
                    let alive = self.conns.get(&conn).is_some_and(|c| c.alive);
                    if !between || (alive && !cached) {
                        return Err(format!(
                            "node {n}: an open to {} on {channel:?} was placed on connection \
                             {conn} (generation {}), not the pair's",
                            peer.0[0],
                            generation.get()
                        ));
                    }
                    if alive {
                        self.opens.placed(channel);
                        break;
                    }
                    self.opens.dead_cached += 1;
                    self.sims[n]
                        .driver
                        .ask_open_failed(now, peer, channel, generation)
                }
                Open::Dial { ticket, .. } => {
                    if self
                        .opens
                        .dials
                        .iter()
                        .any(|(m, p, c, _)| (*m, *p, *c) == (n, peer, channel))
                    {
                        return Err(format!(
                            "node {n}: a second open dial to {} on {channel:?}",
                            peer.0[0]
                        ));
                    }
                    self.opens.dials.push((n, peer, channel, ticket));
                    break;
                }
                Open::Wait(ticket) => {
                    if !self.opens.dials.contains(&(n, peer, channel, ticket)) {
                        return Err(format!(
                            "node {n}: an open to {} waits on dial {} not in flight",
                            peer.0[0],
                            ticket.get()
                        ));
                    }
                    self.opens.waits += 1;
                    let version = self.sims[n].driver.version();
                    self.opens.waiters.push(Waiter {
                        node: n,
                        peer,
                        channel,
                        ticket,
                        version,
                    });
                    break;
                }
                Open::Failed => {
                    if !waited.is_some_and(|ticket| self.opens.failed.contains(&(n, ticket))) {
                        return Err(format!(
                            "node {n}: an open to {} failed, waiting on {waited:?}, which did \
                             not fail",
                            peer.0[0]
                        ));
                    }
                    self.opens.failed_waiters += 1;
                    break;
                }
                Open::Closed => {
                    if !self.sims[n].closed {
                        return Err(format!("node {n}: an open answered closed"));
                    }
                    break;
                }
            };
        }
        self.actions(n)
    }

    /// The dial an open ordered ends: connected (when the peer answers and `outcome` says
    /// so), failed, or abandoned by its caller.
    pub(super) fn complete_open_dial(&mut self, pick: usize, outcome: u8) -> Result<(), String> {
        if self.opens.dials.is_empty() {
            return Ok(());
        }
        let (n, peer, channel, ticket) = self.opens.dials.remove(pick % self.opens.dials.len());
        let now = self.time();
        if outcome % 4 == 3 {
            self.opens.abandoned += 1;
            self.sims[n].driver.handle_open_dial_failed(
                now,
                peer,
                channel,
                ticket,
                DialEnd::Abandoned,
            );
            return self.actions(n);
        }
        let conn = if outcome % 4 < 2 {
            self.connect_on(n, peer, channel)?
        } else {
            None
        };
        match conn {
            Some(conn) => {
                let generation = self.sims[n].driver.ask_connected(now, peer, channel, conn);
                self.cached_by(n, conn, peer, channel, generation);
                self.opens.placed(channel);
            }
            None => {
                self.opens.dials_failed += 1;
                self.opens.failed.insert((n, ticket));
                self.sims[n].driver.handle_open_dial_failed(
                    now,
                    peer,
                    channel,
                    ticket,
                    DialEnd::Failed,
                );
            }
        }
        self.actions(n)
    }

    /// Waiters whose machine's state moved since they were told to wait (the shell's watch
    /// wakes those).
    pub(super) fn woken(&self) -> Vec<usize> {
        (0..self.opens.waiters.len())
            .filter(|i| {
                let waiter = &self.opens.waiters[*i];
                self.sims[waiter.node].driver.version() != waiter.version
            })
            .collect()
    }

    /// A woken waiter asks again (`pick` among the woken).
    pub(super) fn wake(&mut self, pick: usize) -> Result<(), String> {
        let woken = self.woken();
        if woken.is_empty() {
            return Ok(());
        }
        let waiter = self.opens.waiters.remove(woken[pick % woken.len()]);
        let now = self.time();
        let verdict = self.sims[waiter.node].driver.ask_open_waited(
            now,
            waiter.peer,
            waiter.channel,
            waiter.ticket,
        );
        self.place(
            waiter.node,
            waiter.peer,
            waiter.channel,
            verdict,
            Some(waiter.ticket),
        )
    }

    /// A waiter's caller goes away.
    pub(super) fn abandon_wait(&mut self, pick: usize) -> Result<(), String> {
        if self.opens.waiters.is_empty() {
            return Ok(());
        }
        let waiter = self.opens.waiters.remove(pick % self.opens.waiters.len());
        let now = self.time();
        self.opens.abandoned_waits += 1;
        self.sims[waiter.node].driver.handle_open_wait_abandoned(
            now,
            waiter.peer,
            waiter.channel,
            waiter.ticket,
        );
        self.actions(waiter.node)
    }

    /// An open op of the schedule, chosen by `a`, on node `n`.
    pub(super) fn open_op(
        &mut self,
        n: usize,
        a: u8,
        b: u8,
        peers: &[NodeId],
    ) -> Result<(), String> {
        match a % 8 {
            0 | 1 => {
                let channel = OPEN_CHANNELS[usize::from(a >> 3) % OPEN_CHANNELS.len()];
                self.open(n, peers[usize::from(b) % peers.len()], channel)
            }
            2 if b & 0x40 != 0 => {
                // A connection node `n` opened streams on dies, and an open comes before
                // its close is reported.
                let cached: Vec<(u64, NodeId, Channel)> = self
                    .cached
                    .iter()
                    .filter(|(m, _, _, c, _)| *m == n && *c != Channel::Actor)
                    .map(|(_, conn, peer, channel, _)| (*conn, *peer, *channel))
                    .collect();
                let Some(&(conn, peer, channel)) = cached.get(usize::from(b) % cached.len().max(1))
                else {
                    return Ok(());
                };
                self.kill(conn);
                self.open(n, peer, channel)
            }
            2 => match self
                .opens
                .dials
                .get(usize::from(b) % self.opens.dials.len().max(1))
            {
                // Another open behind a dial in flight (opens race on one pair).
                Some(&(m, peer, channel, _)) => self.open(m, peer, channel),
                None => self.open(n, peers[usize::from(b) % peers.len()], Channel::Switch),
            },
            3 | 4 => self.complete_open_dial(usize::from(b), b >> 4),
            5 | 6 => self.wake(usize::from(b)),
            _ => self.abandon_wait(usize::from(b)),
        }
    }

    /// Accounting of opens: the machine's dials in flight for opens are the world's, each
    /// counting exactly the world's opens waiting on it; a failure kept for waiters counts
    /// exactly those that have not asked again.
    pub(super) fn check_opens(&self) -> Result<(), String> {
        for (n, sim) in self.sims.iter().enumerate() {
            if sim.closed {
                continue;
            }
            let waiting = |peer: NodeId, channel: Channel, ticket: DialTicket| {
                self.opens
                    .waiters
                    .iter()
                    .filter(|w| (w.node, w.peer, w.channel, w.ticket) == (n, peer, channel, ticket))
                    .count() as u64
            };
            let mut opening: Vec<(NodeId, Channel, DialTicket, u64)> =
                sim.driver.opening().collect();
            let mut world: Vec<(NodeId, Channel, DialTicket, u64)> = self
                .opens
                .dials
                .iter()
                .filter(|(m, _, _, _)| *m == n)
                .map(|(_, peer, channel, ticket)| {
                    (*peer, *channel, *ticket, waiting(*peer, *channel, *ticket))
                })
                .collect();
            opening.sort();
            world.sort();
            if opening != world {
                return Err(format!(
                    "node {n}: the machine's open dials {opening:?} are not the world's {world:?}"
                ));
            }
            for (peer, channel, ticket, waiters) in sim.driver.failed_opens() {
                if waiters != waiting(peer, channel, ticket) || waiters == 0 {
                    return Err(format!(
                        "node {n}: failed dial {} to {} on {channel:?} keeps {waiters} waiters, \
                         the world has {}",
                        ticket.get(),
                        peer.0[0],
                        waiting(peer, channel, ticket)
                    ));
                }
            }
        }
        Ok(())
    }

    /// Ends every open: dials complete (connected where the peer answers), woken waiters ask
    /// again, until none is left. An open still waiting then was never woken (a lost wake-up);
    /// a dial or failure the machine still keeps is state left behind.
    pub(super) fn settle_opens(&mut self) -> Result<(), String> {
        // Each round ends a dial or wakes a waiter, and a waiter dials at most once more:
        // this bounds the rounds opens can take to settle.
        let rounds = 4 * (self.opens.dials.len() + self.opens.waiters.len()) + 64;
        for _round in 0..rounds {
            while !self.closes.is_empty() {
                self.report_close()?;
            }
            if !self.opens.dials.is_empty() {
                self.complete_open_dial(0, 0)?;
            } else if !self.woken().is_empty() {
                self.wake(0)?;
            } else {
                break;
            }
            self.check_opens()?;
        }
        if let Some(waiter) = self.opens.waiters.first() {
            return Err(format!(
                "node {}: an open to {} waits on dial {} and is never woken",
                waiter.node,
                waiter.peer.0[0],
                waiter.ticket.get()
            ));
        }
        for (n, sim) in self.sims.iter().enumerate() {
            if sim.driver.opening().count() > 0 || sim.driver.failed_opens().count() > 0 {
                return Err(format!(
                    "node {n}: opens settled, state left: {:?} {:?}",
                    sim.driver.opening().collect::<Vec<_>>(),
                    sim.driver.failed_opens().collect::<Vec<_>>()
                ));
            }
        }
        Ok(())
    }

    /// Records what node `n` cached for `peer` on `conn` (on `channel`).
    pub(super) fn cached_by(
        &mut self,
        n: usize,
        conn: u64,
        peer: NodeId,
        channel: Channel,
        generation: Option<crate::driver::Generation>,
    ) {
        match generation {
            Some(generation) if self.conns.get(&conn).is_some_and(|c| c.alive) => {
                self.cached.push((n, conn, peer, channel, generation));
            }
            // Cached a connection that already died: its close report is due.
            Some(generation) => self.closes.push_back((n, peer, channel, generation)),
            None => {}
        }
    }
}
