//! Routing decisions of the actor plane (docs/spec/driver.md §2.4, §3.2–§3.5): peer admission,
//! inbound routing of actor records, egress resolution and SWIM send-failure feedback. Every
//! drop has a reason, counted by [`Drops`].

use std::collections::{BTreeMap, BTreeSet};

/// The actor tag of a host claim (see `directory`): a record the driver itself reads.
pub const HOST_CLAIM_TAG: &str = "tether.HostClaim";

/// The actor tag of a subscription control record (see `subscriptions`): a record the driver
/// itself reads.
pub const TELEMETRY_CONTROL_TAG: &str = "tether.TelemetryControl";

/// A node id: the 32-byte endpoint public key, a type of its own so that no other 32 bytes
/// (an actor's address, a key, a hash) are taken for one. A peer's mailbox address is its node
/// id ([`ActorAddr::mailbox`]).
///
/// ```compile_fail
/// let bytes = [1u8; 32];
/// let node: tether_core::driver::NodeId = bytes; // 32 bytes are not a node id until named one
/// ```
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct NodeId(pub [u8; 32]);

impl NodeId {
    /// The node id with these bytes (an endpoint's public key).
    pub const fn new(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// Its bytes, as the wire and iroh carry them.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl AsRef<[u8]> for NodeId {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl From<[u8; 32]> for NodeId {
    fn from(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }
}

impl std::fmt::Debug for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NodeId(")?;
        for byte in &self.0[..4] {
            write!(f, "{byte:02x}")?;
        }
        write!(f, "…)")
    }
}

impl std::fmt::Display for NodeId {
    /// The whole id in lowercase hex.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for byte in &self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

/// An actor's address: 32 bytes on the wire, a type of its own so that it is never taken for
/// a [`NodeId`] (a frame names both: the node it goes to and the actor it is for).
///
/// ```compile_fail
/// let node = tether_core::driver::NodeId::new([1; 32]);
/// let actor: tether_core::driver::ActorAddr = node; // a node id is not an actor's address
/// ```
///
/// ```
/// use tether_core::driver::{ActorAddr, NodeId};
/// let node = NodeId::new([1; 32]);
/// // A peer's mailbox is the one actor address made from a node id, and says so.
/// assert_eq!(ActorAddr::mailbox(node).as_bytes(), node.as_bytes());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ActorAddr(pub [u8; 32]);

impl ActorAddr {
    /// The address with these bytes.
    pub const fn new(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// Its bytes, as the wire carries them.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// A peer's mailbox: the actor address that is the node's own id.
    pub const fn mailbox(node: NodeId) -> Self {
        Self(node.0)
    }
}

impl From<[u8; 32]> for ActorAddr {
    fn from(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }
}

impl std::fmt::Debug for ActorAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ActorAddr(")?;
        for byte in &self.0[..4] {
            write!(f, "{byte:02x}")?;
        }
        write!(f, "…)")
    }
}

impl serde::Serialize for ActorAddr {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

/// The tag of the record a join attempt writes to the seed's mailbox ([`join_request`]).
pub const JOIN_REQUEST: &str = "JoinRequest";
const _: () = assert!(JOIN_REQUEST.len() <= crate::limits::ACTOR_TAG_BYTES_MAX);

/// The SWIM tags whose write failure is reported as `SendFailed { to }` (the default set).
pub const SWIM_TAGS: [&str; 6] = [
    "Ping",
    "Ack",
    "PingReq",
    "IndirectAck",
    JOIN_REQUEST,
    "JoinResponse",
];

/// The record a join attempt writes (`Action::JoinAttempt`): addressed to the seed's mailbox
/// (its node id), tagged [`JOIN_REQUEST`], its payload the joining node's id.
pub fn join_request(seed: NodeId, local: NodeId) -> crate::wire::actor::ActorRecord {
    crate::wire::actor::ActorRecord::from_parts(
        seed.0,
        bytes::Bytes::from_static(JOIN_REQUEST.as_bytes()),
        bytes::Bytes::copy_from_slice(local.as_bytes()),
    )
}

/// Why a frame was dropped (docs/spec/driver.md §3.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DropReason {
    /// The target is not a valid node id.
    InvalidNodeId,
    /// Peer authorization rejected the peer.
    Unauthorized,
    /// No cached connection; a background dial runs.
    CacheMiss,
    /// An inbound frame's type tag is not known to the codec registry.
    UnknownTag,
    /// An inbound gossip tag has no local route.
    NoLocalRoute,
    /// An inbound application destination is not hosted here.
    NotLocal,
    /// Raw delivery into the actor runtime failed.
    DeliveryFailed,
    /// An egress destination has no entry in the route view.
    NoRoute,
    /// A malformed inbound actor stream was dropped (the connection stays).
    MalformedStream,
    /// The write to the peer failed.
    WriteFailed,
    /// The peer's egress queue was full: its ring and its spillover, bounded by
    /// [`crate::limits::EGRESS_SPILL_FRAMES_MAX`].
    EgressFull,
}

impl DropReason {
    /// The reason's name as metrics labels and JSON spell it (`snake_case`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidNodeId => "invalid_node_id",
            Self::Unauthorized => "unauthorized",
            Self::CacheMiss => "cache_miss",
            Self::UnknownTag => "unknown_tag",
            Self::NoLocalRoute => "no_local_route",
            Self::NotLocal => "not_local",
            Self::DeliveryFailed => "delivery_failed",
            Self::NoRoute => "no_route",
            Self::MalformedStream => "malformed_stream",
            Self::WriteFailed => "write_failed",
            Self::EgressFull => "egress_full",
        }
    }
}

/// Drops by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Drops(pub BTreeMap<DropReason, u64>);

impl Drops {
    /// Counts one drop.
    pub fn count(&mut self, reason: DropReason) {
        self.add(reason, 1);
    }

    /// Counts `n` drops.
    pub fn add(&mut self, reason: DropReason, n: u64) {
        if n > 0 {
            *self.0.entry(reason).or_default() += n;
        }
    }

    /// Drops for `reason`.
    pub fn get(&self, reason: DropReason) -> u64 {
        self.0.get(&reason).copied().unwrap_or(0)
    }
}

/// Transport admission (docs/spec/driver.md §2.4): `None` admits every peer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerAuth {
    allowed: Option<BTreeSet<NodeId>>,
}

impl PeerAuth {
    /// Every peer admitted.
    pub fn open() -> Self {
        Self { allowed: None }
    }

    /// Only `peers` admitted, inbound and outbound.
    pub fn allow_list(peers: impl IntoIterator<Item = NodeId>) -> Self {
        Self {
            allowed: Some(peers.into_iter().collect()),
        }
    }

    /// Whether `peer` is admitted.
    pub fn permits(&self, peer: &NodeId) -> bool {
        self.allowed.as_ref().is_none_or(|set| set.contains(peer))
    }
}

/// Where an inbound actor record goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inbound<R> {
    /// Gossip to this node's mailbox: to the local protocol actor owning the tag.
    Protocol(R),
    /// To the local actor at this address.
    Actor(ActorAddr),
    /// A record the driver itself owns (a host claim or a telemetry subscription control, to
    /// this node's mailbox): hand it to [`super::Driver::handle_record`].
    Driver,
    /// Dropped.
    Drop(DropReason),
}

/// The local routing tables: known tags, gossip routes by tag, and which actors are local.
#[derive(Debug, Clone)]
pub struct Routes<R> {
    mailbox: NodeId,
    known_tags: BTreeSet<String>,
    gossip: BTreeMap<String, R>,
    local_actors: BTreeSet<ActorAddr>,
    swim_tags: BTreeSet<String>,
}

impl<R: Clone> Routes<R> {
    /// Routes of the node whose mailbox (node id) is `mailbox`, with the default SWIM tags.
    pub fn new(mailbox: NodeId) -> Self {
        Self {
            mailbox,
            known_tags: BTreeSet::new(),
            gossip: BTreeMap::new(),
            local_actors: BTreeSet::new(),
            swim_tags: SWIM_TAGS.iter().map(|t| (*t).to_owned()).collect(),
        }
    }

    /// Declares `tag` known to the codec registry.
    pub fn know_tag(&mut self, tag: &str) {
        self.known_tags.insert(tag.to_owned());
    }

    /// Routes gossip tagged `tag` to the local protocol actor `route` (the tag becomes known).
    pub fn route_tag(&mut self, tag: &str, route: R) {
        self.know_tag(tag);
        self.gossip.insert(tag.to_owned(), route);
    }

    /// `actor` is hosted here.
    pub fn host(&mut self, actor: ActorAddr) {
        self.local_actors.insert(actor);
    }

    /// `actor` is no longer hosted here.
    pub fn unhost(&mut self, actor: &ActorAddr) {
        self.local_actors.remove(actor);
    }

    /// Replaces the SWIM tag set.
    pub fn set_swim_tags(&mut self, tags: impl IntoIterator<Item = String>) {
        self.swim_tags = tags.into_iter().collect();
    }

    /// Where an inbound record for `dest` with `tag` goes: to the mailbox → by tag to the
    /// owning protocol actor; otherwise to the addressed actor if it is local.
    pub fn inbound(&self, dest: &ActorAddr, tag: &str) -> Inbound<R> {
        if *dest == ActorAddr::mailbox(self.mailbox)
            && (tag == HOST_CLAIM_TAG || tag == TELEMETRY_CONTROL_TAG)
        {
            return Inbound::Driver;
        }
        if !self.known_tags.contains(tag) {
            return Inbound::Drop(DropReason::UnknownTag);
        }
        if *dest == ActorAddr::mailbox(self.mailbox) {
            return match self.gossip.get(tag) {
                Some(route) => Inbound::Protocol(route.clone()),
                None => Inbound::Drop(DropReason::NoLocalRoute),
            };
        }
        if self.local_actors.contains(dest) {
            Inbound::Actor(*dest)
        } else {
            Inbound::Drop(DropReason::NotLocal)
        }
    }

    /// Whether a failed write of a frame tagged `tag` is reported as `SendFailed`.
    pub fn is_swim(&self, tag: &str) -> bool {
        self.swim_tags.contains(tag)
    }

    /// [`Routes::inbound`] through `memo`, for a tag as received: a record with the
    /// destination and tag of the one before it takes that record's decision without a table
    /// lookup or a UTF-8 check. A tag that is not UTF-8 is unknown (and not remembered). After
    /// any other decision, [`RouteMemo::tag`] is this record's tag as text. A memo is valid
    /// only while these tables stay unchanged; clear it whenever they may have changed.
    #[inline]
    pub fn inbound_memo(
        &self,
        memo: &mut RouteMemo<R>,
        dest: &ActorAddr,
        tag: &[u8],
    ) -> Inbound<R> {
        if let Some((last_dest, last_tag, decision)) = &memo.last {
            if last_dest == dest && same_short(last_tag.as_bytes(), tag) {
                return decision.clone();
            }
        }
        self.inbound_remembered(memo, dest, tag)
    }

    /// [`Routes::inbound_memo`] past its memo: decides and remembers.
    fn inbound_remembered(
        &self,
        memo: &mut RouteMemo<R>,
        dest: &ActorAddr,
        tag: &[u8],
    ) -> Inbound<R> {
        let Ok(text) = std::str::from_utf8(tag) else {
            return Inbound::Drop(DropReason::UnknownTag);
        };
        let decision = self.inbound(dest, text);
        match &mut memo.last {
            Some((last_dest, last_tag, last)) => {
                *last_dest = *dest;
                last_tag.clear();
                last_tag.push_str(text);
                *last = decision.clone();
            }
            None => memo.last = Some((*dest, text.to_owned(), decision.clone())),
        }
        decision
    }
}

/// Whether two tags are the same bytes, compared in place: a tag is a few bytes, and the call
/// to `bcmp` a slice compare makes cost more than the compare (per inbound record).
#[inline]
fn same_short(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

/// The last inbound decision, for [`Routes::inbound_memo`]: records come in runs between one
/// pair of actors, and a run needs its tables looked up once.
#[derive(Debug, Clone)]
pub struct RouteMemo<R> {
    last: Option<(ActorAddr, String, Inbound<R>)>,
}

impl<R> RouteMemo<R> {
    /// A memo that remembers nothing.
    pub fn new() -> Self {
        Self { last: None }
    }

    /// Forgets the remembered decision (the tables may have changed).
    pub fn clear(&mut self) {
        self.last = None;
    }

    /// The tag of the remembered decision.
    #[inline]
    pub fn tag(&self) -> Option<&str> {
        self.last.as_ref().map(|(_, tag, _)| tag.as_str())
    }
}

impl<R> Default for RouteMemo<R> {
    fn default() -> Self {
        Self::new()
    }
}

/// An egress destination as the actor runtime names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Egress {
    /// A peer's mailbox: the peer is the address itself.
    Mailbox(NodeId),
    /// An actor hosted elsewhere: the route view names its peer.
    Actor(ActorAddr),
}

/// Resolves `dest` to the peer to send to (docs/spec/driver.md §3.2): a mailbox is its own peer; an
/// actor is looked up in the route view (`locate`). The peer must also be admitted.
pub fn resolve_egress(
    dest: Egress,
    mut locate: impl FnMut(&ActorAddr) -> Option<NodeId>,
    auth: &PeerAuth,
) -> Result<NodeId, DropReason> {
    let peer = match dest {
        Egress::Mailbox(peer) => peer,
        Egress::Actor(actor) => locate(&actor).ok_or(DropReason::NoRoute)?,
    };
    if auth.permits(&peer) {
        Ok(peer)
    } else {
        Err(DropReason::Unauthorized)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> NodeId {
        NodeId([n; 32])
    }

    fn actor(n: u8) -> ActorAddr {
        ActorAddr([n; 32])
    }

    #[test]
    fn inbound_routing_covers_every_case() {
        let mut routes: Routes<&str> = Routes::new(id(1));
        routes.route_tag("Ping", "swim");
        routes.know_tag("Chat");
        routes.know_tag("Orphan");
        routes.host(actor(9));
        assert_eq!(routes.inbound(&actor(1), "Ping"), Inbound::Protocol("swim"));
        assert_eq!(
            routes.inbound(&actor(1), "Orphan"),
            Inbound::Drop(DropReason::NoLocalRoute)
        );
        assert_eq!(
            routes.inbound(&actor(1), "Nope"),
            Inbound::Drop(DropReason::UnknownTag)
        );
        assert_eq!(routes.inbound(&actor(9), "Chat"), Inbound::Actor(actor(9)));
        assert_eq!(
            routes.inbound(&actor(8), "Chat"),
            Inbound::Drop(DropReason::NotLocal)
        );
        routes.unhost(&actor(9));
        assert_eq!(
            routes.inbound(&actor(9), "Chat"),
            Inbound::Drop(DropReason::NotLocal)
        );
        assert!(routes.is_swim(JOIN_REQUEST) && !routes.is_swim("Chat"));
    }

    proptest::proptest! {
        /// Through a memo, any run of records gets exactly the decisions of the tables; a
        /// cleared memo forgets decisions the tables no longer make.
        #[test]
        fn memo_decides_as_the_tables_do(
            records in proptest::collection::vec((0u8..4, 0usize..4), 0..64),
            unhost_at in 0usize..64,
        ) {
            let tags: [&[u8]; 4] = [b"Ping", b"Chat", b"Nope", b"\xff\xfe"];
            let mut routes: Routes<&str> = Routes::new(id(1));
            routes.route_tag("Ping", "swim");
            routes.know_tag("Chat");
            routes.host(actor(2));
            let mut memo = RouteMemo::new();
            for (at, (dest, tag)) in records.into_iter().enumerate() {
                if at == unhost_at {
                    routes.unhost(&actor(2));
                    memo.clear();
                }
                let expected = match std::str::from_utf8(tags[tag]) {
                    Ok(text) => routes.inbound(&actor(dest), text),
                    Err(_) => Inbound::Drop(DropReason::UnknownTag),
                };
                proptest::prop_assert_eq!(
                    routes.inbound_memo(&mut memo, &actor(dest), tags[tag]),
                    expected
                );
                if let Ok(text) = std::str::from_utf8(tags[tag]) {
                    proptest::prop_assert_eq!(memo.tag(), Some(text));
                }
            }
        }
    }

    #[test]
    fn egress_resolves_mailboxes_and_routed_actors_and_checks_admission() {
        let view: BTreeMap<ActorAddr, NodeId> = [(actor(9), id(2))].into_iter().collect();
        let open = PeerAuth::open();
        assert_eq!(
            resolve_egress(Egress::Mailbox(id(3)), |a| view.get(a).copied(), &open),
            Ok(id(3))
        );
        assert_eq!(
            resolve_egress(Egress::Actor(actor(9)), |a| view.get(a).copied(), &open),
            Ok(id(2))
        );
        assert_eq!(
            resolve_egress(Egress::Actor(actor(7)), |a| view.get(a).copied(), &open),
            Err(DropReason::NoRoute)
        );
        let only_two = PeerAuth::allow_list([id(2)]);
        assert_eq!(
            resolve_egress(Egress::Actor(actor(9)), |a| view.get(a).copied(), &only_two),
            Ok(id(2))
        );
        assert_eq!(
            resolve_egress(Egress::Mailbox(id(3)), |a| view.get(a).copied(), &only_two),
            Err(DropReason::Unauthorized)
        );
    }

    #[test]
    fn reason_names_are_their_json_names() {
        use DropReason::*;
        for reason in [
            InvalidNodeId,
            Unauthorized,
            CacheMiss,
            UnknownTag,
            NoLocalRoute,
            NotLocal,
            DeliveryFailed,
            NoRoute,
            MalformedStream,
            WriteFailed,
        ] {
            assert_eq!(
                serde_json::to_value(reason).expect("serializes"),
                reason.as_str()
            );
        }
    }

    #[test]
    fn drops_are_counted_by_reason() {
        let mut drops = Drops::default();
        drops.count(DropReason::CacheMiss);
        drops.count(DropReason::CacheMiss);
        drops.count(DropReason::UnknownTag);
        assert_eq!(drops.get(DropReason::CacheMiss), 2);
        assert_eq!(drops.get(DropReason::NotLocal), 0);
        let json = serde_json::to_string(&drops).expect("serializes");
        assert_eq!(json, r#"{"cache_miss":2,"unknown_tag":1}"#);
    }

    #[test]
    fn a_join_request_is_addressed_to_the_seed_and_carries_the_joining_node() {
        let (seed, local) = (NodeId([7u8; 32]), NodeId([9u8; 32]));
        let record = join_request(seed, local);
        assert_eq!(record.dest(), seed.as_bytes());
        assert_eq!(record.tag(), "JoinRequest");
        assert_eq!(record.payload(), &local.as_bytes()[..]);
    }
}
