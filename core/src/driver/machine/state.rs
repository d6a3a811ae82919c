//! Read-only views of the machine's state, for the shell, metrics and tests.

use super::*;

impl<C: Clone> Driver<C> {
    /// Drops by reason.
    pub fn drops(&self) -> &Drops {
        &self.drops
    }

    /// Refusals by path and direction.
    pub fn refusals(&self) -> &Refusals {
        &self.refusals
    }

    /// The counters.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Bumped whenever connection state moves (cache, dials, an open's dial ending, joins,
    /// drops, refusals): the shell waits on it (an [`Open::Wait`] asks again then).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Every cached connection: (peer, channel, generation).
    pub fn connections(&self) -> impl Iterator<Item = (NodeId, Channel, Generation)> + '_ {
        self.cache
            .generations()
            .map(|((peer, channel), generation)| (*peer, *channel, generation))
    }

    /// Each join's status, by seed.
    pub fn join_statuses(&self) -> impl Iterator<Item = (&NodeId, &JoinStatus)> {
        self.joins
            .iter()
            .map(|(peer, state)| (peer, state.join.status()))
    }

    /// Whether a dial to `peer` is in progress (in flight or waiting to retry).
    pub fn is_dialing(&self, peer: &NodeId) -> bool {
        self.dials.contains_key(peer)
    }

    /// Writers the machine knows of (reported a batch or idleness, not retired).
    pub fn writers(&self) -> usize {
        self.writers.len()
    }

    /// The relays to reach `peer` by: those `given`, or else the last seen.
    pub fn relays_for(&self, peer: &NodeId, given: &[String]) -> Vec<String> {
        self.relay_hints.normalize(peer, given)
    }

    /// Every peer with a relay hint and the relays last seen for it, by peer.
    pub fn relay_hints(&self) -> impl Iterator<Item = (&NodeId, &[String])> {
        self.relay_hints.iter()
    }

    /// Where the route view sends `actor`'s frames: the host and generation of the newest
    /// valid claim received (or registered here).
    pub fn route(&self, actor: &ActorAddr) -> Option<crate::driver::directory::Route> {
        self.directory.route(actor)
    }

    /// Actors in the route view.
    pub fn directory_route_count(&self) -> usize {
        self.directory.route_count()
    }

    /// Locations cached for egress.
    pub fn location_cache_entries(&self) -> usize {
        self.directory.location_cache_entries()
    }

    /// Live telemetry subscriptions this node publishes to.
    pub fn telemetry_subscriptions(&self) -> usize {
        self.subscriptions.live()
    }

    /// The live telemetry subscriptions: (collector, stream, flow), in that order.
    pub fn subscriptions(&self) -> impl Iterator<Item = &Subscription> {
        self.subscriptions.iter()
    }

    /// The live telemetry subscriptions with the number of the publisher started for each.
    pub fn publishers(&self) -> impl Iterator<Item = (&Subscription, Publisher)> {
        self.subscriptions.publishers()
    }

    /// This node's own host claims, by actor.
    pub fn local_claims(&self) -> impl Iterator<Item = &HostClaim> {
        self.local_claims.values()
    }

    /// Subscription control records by verdict.
    pub fn control_verdicts(&self) -> &BTreeMap<ControlVerdict, u64> {
        self.subscriptions.verdicts()
    }

    /// Received claims by verdict.
    pub fn claim_verdicts(&self) -> &BTreeMap<ClaimVerdict, u64> {
        self.directory.verdicts()
    }

    /// The opens' dials in flight: peer, channel, ticket and the opens waiting on it.
    pub fn opening(&self) -> impl Iterator<Item = (NodeId, Channel, DialTicket, u64)> + '_ {
        self.opening
            .iter()
            .map(|((peer, channel), opening)| (*peer, *channel, opening.ticket, opening.waiters))
    }

    /// Failed dials whose waiting opens have not all heard it: peer, channel, ticket and the
    /// waiters still to ask.
    pub fn failed_opens(&self) -> impl Iterator<Item = (NodeId, Channel, DialTicket, u64)> + '_ {
        self.failed_opens
            .iter()
            .map(|((peer, channel), failed)| (*peer, *channel, failed.ticket, failed.waiters))
    }

    /// Whether the node is closed.
    pub fn is_closed(&self) -> bool {
        self.closed
    }
}
