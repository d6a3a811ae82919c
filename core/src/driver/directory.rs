//! Signed actor host claims, the route view they feed, and the location cache of the egress
//! path (docs/spec/driver.md §3.2, §3.6, §6.3).
//!
//! A node that hosts an actor signs a claim `(actor, host, generation)` with its endpoint key
//! (`register_actor`) and announces it to its peers. Frames to an actor hosted elsewhere go to
//! `route_view[actor]`; the location cache keeps the peers resolved for the egress path and
//! forgets an actor whenever a claim moves it.
//!
//! # Ownership
//!
//! A route belongs to the node that holds it. A received claim is taken only when:
//!
//! 1. its signature is its host's (else `forged`), and the peer that sent it is that host
//!    (else `relayed`: hosts announce their own claims, nobody carries another's);
//! 2. it is newer than the generation held for the actor (else `stale`), at most
//!    [`CLAIM_GENERATION_MAX`] and at most [`CLAIM_GENERATION_STEP_MAX`] past the held one
//!    (else `jump`);
//! 3. it renews the holder's own route, or takes an actor nobody holds, or moves an actor
//!    with the consent of the node holding it: a [`Handoff`] that node signed for this host and
//!    generation. An application [`ClaimAuthorizer`], when configured, decides every first
//!    claim and every move without consent (`refused` when it says no); without one, first
//!    claims are taken and moves without consent are refused (`held`);
//! 4. its host's routes stay within [`DIRECTORY_ROUTES_PER_HOST_MAX`] and the view within
//!    [`DIRECTORY_ROUTES_MAX`] (else `full`).
//!
//! An actor this node hosts is its own: its route names this node whatever peers claim.
//!
//! # Wire
//!
//! A claim travels as an actor record tagged [`HOST_CLAIM_TAG`] to the peer's mailbox; its
//! payload is exactly [`CLAIM_BYTES`] bytes: actor (32), host (32), generation (8, big
//! endian), Ed25519 signature (64) over [`CLAIM_DOMAIN`] ‖ actor ‖ host ‖ generation; or
//! [`CLAIM_WITH_HANDOFF_BYTES`]: those, then the previous host (32) and its Ed25519 signature
//! (64) over [`HANDOFF_DOMAIN`] ‖ actor ‖ host ‖ generation.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::sync::Arc;

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};

use super::routing::{ActorAddr, NodeId};
use crate::limits::{
    CLAIM_GENERATION_MAX, CLAIM_GENERATION_STEP_MAX, DIRECTORY_ROUTES_MAX,
    DIRECTORY_ROUTES_PER_HOST_MAX, LOCATION_CACHE_ENTRIES_MAX,
};

/// The actor tag of a host claim.
pub use super::routing::HOST_CLAIM_TAG;
/// Bytes of an encoded claim without a handoff.
pub const CLAIM_BYTES: usize = 32 + 32 + 8 + 64;
/// Bytes of an encoded claim carrying its previous host's [`Handoff`].
pub const CLAIM_WITH_HANDOFF_BYTES: usize = CLAIM_BYTES + 32 + 64;
/// What a claim's signature covers first (domain separation).
pub const CLAIM_DOMAIN: &[u8] = b"tether/host-claim/1";
/// What a handoff's signature covers first (domain separation).
pub const HANDOFF_DOMAIN: &[u8] = b"tether/host-handoff/1";

/// A claim that `host` hosts `actor`, at `generation`, signed by `host`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostClaim {
    /// The actor.
    pub actor: ActorAddr,
    /// The node hosting it (its key signs the claim).
    pub host: NodeId,
    /// Higher generations replace lower ones.
    pub generation: u64,
    /// Ed25519 over [`CLAIM_DOMAIN`] ‖ actor ‖ host ‖ generation (big endian).
    pub signature: [u8; 64],
    /// The consent of the node that held the actor before, when the claim moves it.
    pub handoff: Option<Handoff>,
}

/// The consent of the node holding an actor that it move to another host at a generation:
/// `from` signs [`HANDOFF_DOMAIN`] ‖ actor ‖ new host ‖ generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handoff {
    /// The node that held the actor (its key signs the consent).
    pub from: NodeId,
    /// Ed25519 over [`HANDOFF_DOMAIN`] ‖ actor ‖ new host ‖ generation (big endian).
    pub signature: [u8; 64],
}

/// Why claim bytes were refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    /// Neither [`CLAIM_BYTES`] nor [`CLAIM_WITH_HANDOFF_BYTES`] bytes.
    #[error("a host claim is {CLAIM_BYTES} or {CLAIM_WITH_HANDOFF_BYTES} bytes, got {0}")]
    Length(usize),
}

fn signed_bytes(domain: &[u8], actor: &ActorAddr, host: &NodeId, generation: u64) -> Vec<u8> {
    let mut message = Vec::with_capacity(domain.len() + 72);
    message.extend_from_slice(domain);
    message.extend_from_slice(actor.as_bytes());
    message.extend_from_slice(host.as_bytes());
    message.extend_from_slice(&generation.to_be_bytes());
    message
}

/// Strict Ed25519 (no malleable or small-order forms) of `key` over `message`.
fn verify_strict(key: &NodeId, message: &[u8], signature: &[u8; 64]) -> bool {
    let Ok(key) = VerifyingKey::from_bytes(key.as_bytes()) else {
        return false;
    };
    key.verify_strict(message, &Signature::from_bytes(signature))
        .is_ok()
}

impl Handoff {
    /// The holder's consent (its 32-byte secret key; `from` is the key's public half) that
    /// `actor` move to `to` at `generation`.
    pub fn sign(secret: &[u8; 32], actor: &ActorAddr, to: &NodeId, generation: u64) -> Self {
        let key = SigningKey::from_bytes(secret);
        let signature = key.sign(&signed_bytes(HANDOFF_DOMAIN, actor, to, generation));
        Self {
            from: NodeId(key.verifying_key().to_bytes()),
            signature: signature.to_bytes(),
        }
    }

    /// Whether `from` consented to `actor` moving to `to` at `generation`.
    pub fn verify(&self, actor: &ActorAddr, to: &NodeId, generation: u64) -> bool {
        verify_strict(
            &self.from,
            &signed_bytes(HANDOFF_DOMAIN, actor, to, generation),
            &self.signature,
        )
    }
}

impl HostClaim {
    /// Signs a claim for `actor` at `generation` with the host's 32-byte secret key (the
    /// host is the key's public half).
    pub fn sign(secret: &[u8; 32], actor: ActorAddr, generation: u64) -> Self {
        let key = SigningKey::from_bytes(secret);
        let host = NodeId(key.verifying_key().to_bytes());
        let signature = key.sign(&signed_bytes(CLAIM_DOMAIN, &actor, &host, generation));
        Self {
            actor,
            host,
            generation,
            signature: signature.to_bytes(),
            handoff: None,
        }
    }

    /// This claim, carrying the previous holder's consent.
    pub fn with_handoff(self, handoff: Handoff) -> Self {
        Self {
            handoff: Some(handoff),
            ..self
        }
    }

    /// Whether the signature is the host's over this claim and a handoff it carries is its
    /// signer's consent to this very move (strict Ed25519: no malleable or small-order forms).
    pub fn verify(&self) -> bool {
        verify_strict(
            &self.host,
            &signed_bytes(CLAIM_DOMAIN, &self.actor, &self.host, self.generation),
            &self.signature,
        ) && self
            .handoff
            .is_none_or(|handoff| handoff.verify(&self.actor, &self.host, self.generation))
    }

    /// The wire bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(CLAIM_WITH_HANDOFF_BYTES);
        out.extend_from_slice(self.actor.as_bytes());
        out.extend_from_slice(self.host.as_bytes());
        out.extend_from_slice(&self.generation.to_be_bytes());
        out.extend_from_slice(&self.signature);
        if let Some(handoff) = &self.handoff {
            out.extend_from_slice(handoff.from.as_bytes());
            out.extend_from_slice(&handoff.signature);
        }
        out
    }

    /// Parses wire bytes (exactly [`CLAIM_BYTES`] or [`CLAIM_WITH_HANDOFF_BYTES`]; never
    /// allocates). The signatures are not checked here: see [`HostClaim::verify`].
    pub fn decode(bytes: &[u8]) -> Result<Self, ClaimError> {
        if bytes.len() != CLAIM_BYTES && bytes.len() != CLAIM_WITH_HANDOFF_BYTES {
            return Err(ClaimError::Length(bytes.len()));
        }
        let array = |range: std::ops::Range<usize>| -> [u8; 32] {
            let mut out = [0u8; 32];
            out.copy_from_slice(&bytes[range]);
            out
        };
        let signature = |at: usize| -> [u8; 64] {
            let mut out = [0u8; 64];
            out.copy_from_slice(&bytes[at..at + 64]);
            out
        };
        let mut generation = [0u8; 8];
        generation.copy_from_slice(&bytes[64..72]);
        Ok(Self {
            actor: ActorAddr(array(0..32)),
            host: NodeId(array(32..64)),
            generation: u64::from_be_bytes(generation),
            signature: signature(72),
            handoff: (bytes.len() == CLAIM_WITH_HANDOFF_BYTES).then(|| Handoff {
                from: NodeId(array(CLAIM_BYTES..CLAIM_BYTES + 32)),
                signature: signature(CLAIM_BYTES + 32),
            }),
        })
    }
}

/// Claim bytes as received, their signatures checked: what the shell hands the machine, so
/// the Ed25519 work happens before the node's lock is taken ([`CheckedClaim::check`] is a
/// pure function).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckedClaim {
    /// Well formed, every signature verified.
    Verified(Box<HostClaim>),
    /// Malformed, or a signature that is not its signer's.
    Forged,
}

impl CheckedClaim {
    /// Decodes and verifies claim bytes.
    pub fn check(bytes: &[u8]) -> Self {
        match HostClaim::decode(bytes) {
            Ok(claim) if claim.verify() => Self::Verified(Box::new(claim)),
            _ => Self::Forged,
        }
    }
}

/// What a received claim did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClaimVerdict {
    /// Taken: the route view now sends the actor's frames to the host.
    Accepted,
    /// Not newer than the generation held (a replay, a late or an equal claim): ignored.
    Stale,
    /// Malformed bytes, or a signature that is not its signer's: ignored.
    Forged,
    /// Past its host's share ([`DIRECTORY_ROUTES_PER_HOST_MAX`]) or the view's bound
    /// ([`DIRECTORY_ROUTES_MAX`]): ignored.
    Full,
    /// Sent by a peer that is not the claim's host: ignored.
    Relayed,
    /// Would move an actor another node holds, without that node's handoff (and no
    /// authorizer is configured): ignored.
    Held,
    /// A generation past [`CLAIM_GENERATION_MAX`], or more than
    /// [`CLAIM_GENERATION_STEP_MAX`] past the one held: ignored.
    Jump,
    /// The application's [`ClaimAuthorizer`] said no: ignored.
    Refused,
}

/// Where an actor is hosted, as the claims taken say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// The host.
    pub host: NodeId,
    /// The claim's generation.
    pub generation: u64,
}

/// A claim the application's [`ClaimAuthorizer`] is asked about: one that would take an
/// actor nobody holds here (`held` is `None`), or move it from its holder without a handoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimRequest {
    /// The actor.
    pub actor: ActorAddr,
    /// The node claiming it (the peer that sent the claim).
    pub host: NodeId,
    /// The claim's generation.
    pub generation: u64,
    /// The route held for the actor, if any.
    pub held: Option<Route>,
}

/// The application's rule for first claims and moves without consent (for example: actors
/// whose addresses derive from their owner's key, or a membership service that says a host
/// is gone). A pure function of the request: it must answer the same way every time.
#[derive(Clone)]
pub struct ClaimAuthorizer(Arc<dyn Fn(&ClaimRequest) -> bool + Send + Sync>);

impl ClaimAuthorizer {
    /// An authorizer from a function.
    pub fn new(rule: impl Fn(&ClaimRequest) -> bool + Send + Sync + 'static) -> Self {
        Self(Arc::new(rule))
    }

    /// Whether `request` may be taken.
    pub fn allows(&self, request: &ClaimRequest) -> bool {
        (self.0)(request)
    }
}

impl fmt::Debug for ClaimAuthorizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClaimAuthorizer(..)")
    }
}

/// The route view (directory of verified claims) and the location cache of egress.
#[derive(Debug, Clone, Default)]
pub struct Directory {
    routes: BTreeMap<ActorAddr, Route>,
    /// Routes held per host (each within [`DIRECTORY_ROUTES_PER_HOST_MAX`] for claims
    /// received).
    per_host: BTreeMap<NodeId, usize>,
    locations: BTreeMap<ActorAddr, NodeId>,
    /// Cached locations, oldest first.
    order: VecDeque<ActorAddr>,
    verdicts: BTreeMap<ClaimVerdict, u64>,
    authorizer: Option<ClaimAuthorizer>,
    /// Actors this node hosts: their routes are this node's, whatever peers claim.
    local: BTreeSet<ActorAddr>,
}

impl Directory {
    /// An empty directory whose first claims and moves without consent `authorizer` decides
    /// (`None`: first claims taken, such moves refused).
    pub fn new(authorizer: Option<ClaimAuthorizer>) -> Self {
        Self {
            authorizer,
            ..Self::default()
        }
    }

    /// Applies claim bytes received from peer `from`.
    pub fn apply_bytes(&mut self, from: &NodeId, bytes: &[u8]) -> ClaimVerdict {
        self.apply_checked(from, CheckedClaim::check(bytes))
    }

    /// Applies a received claim whose bytes were checked, by the ownership rule (module
    /// doc); counts the verdict.
    pub fn apply_checked(&mut self, from: &NodeId, claim: CheckedClaim) -> ClaimVerdict {
        let verdict = match claim {
            CheckedClaim::Forged => ClaimVerdict::Forged,
            CheckedClaim::Verified(claim) => self.apply_received(from, &claim),
        };
        *self.verdicts.entry(verdict).or_default() += 1;
        verdict
    }

    fn apply_received(&mut self, from: &NodeId, claim: &HostClaim) -> ClaimVerdict {
        if claim.host != *from {
            return ClaimVerdict::Relayed;
        }
        let held = self.routes.get(&claim.actor).copied();
        if self.local.contains(&claim.actor) {
            return ClaimVerdict::Held;
        }
        if held.is_some_and(|route| claim.generation <= route.generation) {
            return ClaimVerdict::Stale;
        }
        let step = held.map_or(0, |route| claim.generation - route.generation);
        if claim.generation > CLAIM_GENERATION_MAX || step > CLAIM_GENERATION_STEP_MAX {
            return ClaimVerdict::Jump;
        }
        let renewal = held.is_some_and(|route| route.host == claim.host);
        let consented = held.is_some_and(|route| {
            claim
                .handoff
                .is_some_and(|handoff| handoff.from == route.host)
        });
        if !renewal && !consented {
            let request = ClaimRequest {
                actor: claim.actor,
                host: claim.host,
                generation: claim.generation,
                held,
            };
            match &self.authorizer {
                Some(authorizer) if !authorizer.allows(&request) => return ClaimVerdict::Refused,
                None if held.is_some() => return ClaimVerdict::Held,
                _ => {}
            }
        }
        if !renewal {
            let share = self.per_host.get(&claim.host).copied().unwrap_or(0);
            if share >= DIRECTORY_ROUTES_PER_HOST_MAX
                || (held.is_none() && self.routes.len() >= DIRECTORY_ROUTES_MAX)
            {
                return ClaimVerdict::Full;
            }
        }
        self.set(claim.actor, claim.host, claim.generation);
        ClaimVerdict::Accepted
    }

    /// This node hosts `claim.actor` (its own claim, signature checked by the caller): the
    /// route names this node whatever peers claimed, outside every share (local claims have
    /// their own bound).
    pub fn apply_local(&mut self, claim: &HostClaim) {
        self.local.insert(claim.actor);
        self.set(claim.actor, claim.host, claim.generation);
    }

    /// This node handed `actor` off to `to` at `generation`: it hosts the actor no more, and
    /// its route follows.
    pub fn hand_off(&mut self, actor: ActorAddr, to: NodeId, generation: u64) {
        self.local.remove(&actor);
        self.set(actor, to, generation);
    }

    fn set(&mut self, actor: ActorAddr, host: NodeId, generation: u64) {
        if let Some(old) = self.routes.insert(actor, Route { host, generation }) {
            if let Some(n) = self.per_host.get_mut(&old.host) {
                *n -= 1;
                if *n == 0 {
                    self.per_host.remove(&old.host);
                }
            }
        }
        *self.per_host.entry(host).or_default() += 1;
        // The actor may have moved: resolve it afresh.
        if self.locations.remove(&actor).is_some() {
            self.order.retain(|cached| *cached != actor);
        }
    }

    /// The peer hosting `actor`: the location cache, else the route view (then cached).
    pub fn locate(&mut self, actor: &ActorAddr) -> Option<NodeId> {
        if let Some(peer) = self.locations.get(actor) {
            return Some(*peer);
        }
        let host = self.routes.get(actor)?.host;
        self.locations.insert(*actor, host);
        self.order.push_back(*actor);
        while self.order.len() > LOCATION_CACHE_ENTRIES_MAX {
            if let Some(oldest) = self.order.pop_front() {
                self.locations.remove(&oldest);
            }
        }
        Some(host)
    }

    /// The route of `actor`, if a claim named one.
    pub fn route(&self, actor: &ActorAddr) -> Option<Route> {
        self.routes.get(actor).copied()
    }

    /// Actors in the route view.
    pub fn route_count(&self) -> usize {
        self.routes.len()
    }

    /// Routes `host` holds in the view.
    pub fn routes_held_by(&self, host: &NodeId) -> usize {
        self.per_host.get(host).copied().unwrap_or(0)
    }

    /// Locations cached for egress.
    pub fn location_cache_entries(&self) -> usize {
        self.locations.len()
    }

    /// Received claims by verdict.
    pub fn verdicts(&self) -> &BTreeMap<ClaimVerdict, u64> {
        &self.verdicts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SECRET_A: [u8; 32] = [7; 32];
    const SECRET_B: [u8; 32] = [8; 32];
    const SECRET_C: [u8; 32] = [9; 32];

    fn id(secret: &[u8; 32]) -> NodeId {
        NodeId(SigningKey::from_bytes(secret).verifying_key().to_bytes())
    }

    #[test]
    fn a_claim_signed_by_its_host_verifies_and_round_trips() {
        let claim = HostClaim::sign(&SECRET_A, ActorAddr([1; 32]), 3);
        assert!(claim.verify());
        let bytes = claim.encode();
        assert_eq!(HostClaim::decode(&bytes), Ok(claim));
        // Golden bytes: the layout is actor, host, generation (big endian), signature.
        assert_eq!(&bytes[..32], &[1; 32]);
        assert_eq!(&bytes[32..64], claim.host.as_bytes());
        assert_eq!(&bytes[64..72], &[0, 0, 0, 0, 0, 0, 0, 3]);
        assert_eq!(hex::encode(claim.host), hex::encode(id(&SECRET_A)));
        // Ed25519 is deterministic: the same claim is the same bytes on every machine.
        let golden = "0101010101010101010101010101010101010101010101010101010101010101\
            ea4a6c63e29c520abef5507b132ec5f9954776aebebe7b92421eea691446d22c\
            0000000000000003\
            bc7005a5c035fe12d0a443fcaad123cdd96b6e6d38777128d5d90d77eb3c509f\
            7f36ac0ddecd05e58be95afba229cfb3a16f80bcc5180b5954dbc492e12b8109";
        assert_eq!(hex::encode(&bytes), golden);
    }

    #[test]
    fn a_handoff_travels_after_the_claim_and_binds_actor_host_and_generation() {
        let to = id(&SECRET_B);
        let handoff = Handoff::sign(&SECRET_A, &ActorAddr([1; 32]), &to, 4);
        let claim = HostClaim::sign(&SECRET_B, ActorAddr([1; 32]), 4).with_handoff(handoff);
        assert!(claim.verify());
        let bytes = claim.encode();
        assert_eq!(bytes.len(), CLAIM_WITH_HANDOFF_BYTES);
        assert_eq!(HostClaim::decode(&bytes), Ok(claim));
        assert_eq!(
            &bytes[CLAIM_BYTES..CLAIM_BYTES + 32],
            id(&SECRET_A).as_bytes()
        );
        // Golden: the consent's signature is deterministic too.
        assert_eq!(
            hex::encode(&bytes[CLAIM_BYTES + 32..]),
            hex::encode(handoff.signature)
        );
        // Consent to another generation, host or actor is no consent to this claim.
        for other in [
            Handoff::sign(&SECRET_A, &ActorAddr([1; 32]), &to, 5),
            Handoff::sign(&SECRET_A, &ActorAddr([1; 32]), &id(&SECRET_C), 4),
            Handoff::sign(&SECRET_A, &ActorAddr([2; 32]), &to, 4),
        ] {
            assert!(!HostClaim::sign(&SECRET_B, ActorAddr([1; 32]), 4)
                .with_handoff(other)
                .verify());
        }
        // One bit of the consent changed, or a length between the two forms.
        let mut flipped = bytes.clone();
        flipped[CLAIM_WITH_HANDOFF_BYTES - 1] ^= 1;
        assert_eq!(CheckedClaim::check(&flipped), CheckedClaim::Forged);
        assert_eq!(
            HostClaim::decode(&bytes[..CLAIM_BYTES + 1]),
            Err(ClaimError::Length(CLAIM_BYTES + 1))
        );
    }

    #[test]
    fn forged_relayed_stale_and_renewed_claims() {
        let (a, b) = (id(&SECRET_A), id(&SECRET_B));
        let mut directory = Directory::default();
        let a1 = HostClaim::sign(&SECRET_A, ActorAddr([1; 32]), 1);
        assert_eq!(
            directory.apply_bytes(&a, &a1.encode()),
            ClaimVerdict::Accepted
        );
        assert_eq!(directory.locate(&ActorAddr([1; 32])), Some(a));
        assert_eq!(directory.location_cache_entries(), 1);
        // B claims the actor under A's name: the signature is not A's.
        let mut forged = HostClaim::sign(&SECRET_B, ActorAddr([1; 32]), 9);
        forged.host = a;
        assert_eq!(
            directory.apply_bytes(&b, &forged.encode()),
            ClaimVerdict::Forged
        );
        // A flipped generation breaks the signature too.
        let mut bumped = a1;
        bumped.generation = 5;
        assert_eq!(
            directory.apply_bytes(&a, &bumped.encode()),
            ClaimVerdict::Forged
        );
        // Truncated bytes.
        assert_eq!(
            directory.apply_bytes(&a, &a1.encode()[..100]),
            ClaimVerdict::Forged
        );
        // A's own newer claim, carried by B: nobody carries another's claim.
        let a2 = HostClaim::sign(&SECRET_A, ActorAddr([1; 32]), 2);
        assert_eq!(
            directory.apply_bytes(&b, &a2.encode()),
            ClaimVerdict::Relayed
        );
        // A replay is stale.
        assert_eq!(directory.apply_bytes(&a, &a1.encode()), ClaimVerdict::Stale);
        // A renews: taken, the cached location dropped.
        assert_eq!(
            directory.apply_bytes(&a, &a2.encode()),
            ClaimVerdict::Accepted
        );
        assert_eq!(directory.location_cache_entries(), 0);
        assert_eq!(
            directory.route(&ActorAddr([1; 32])),
            Some(Route {
                host: a,
                generation: 2
            })
        );
        assert_eq!(directory.verdicts()[&ClaimVerdict::Forged], 3);
        assert_eq!(directory.verdicts()[&ClaimVerdict::Relayed], 1);
        assert_eq!(directory.verdicts()[&ClaimVerdict::Stale], 1);
        assert_eq!(directory.verdicts()[&ClaimVerdict::Accepted], 2);
    }

    #[test]
    fn a_held_actor_moves_only_with_its_holders_consent() {
        let (a, b, c) = (id(&SECRET_A), id(&SECRET_B), id(&SECRET_C));
        let mut directory = Directory::default();
        let a1 = HostClaim::sign(&SECRET_A, ActorAddr([1; 32]), 1);
        assert_eq!(
            directory.apply_bytes(&a, &a1.encode()),
            ClaimVerdict::Accepted
        );
        // B takes the actor at a higher generation on its own say: refused, A's route holds.
        let b9 = HostClaim::sign(&SECRET_B, ActorAddr([1; 32]), 9);
        assert_eq!(directory.apply_bytes(&b, &b9.encode()), ClaimVerdict::Held);
        // C's consent is not A's.
        let by_c = b9.with_handoff(Handoff::sign(&SECRET_C, &ActorAddr([1; 32]), &b, 9));
        assert_eq!(
            directory.apply_bytes(&b, &by_c.encode()),
            ClaimVerdict::Held
        );
        // A consents: the actor moves to B.
        let by_a = b9.with_handoff(Handoff::sign(&SECRET_A, &ActorAddr([1; 32]), &b, 9));
        assert_eq!(
            directory.apply_bytes(&b, &by_a.encode()),
            ClaimVerdict::Accepted
        );
        assert_eq!(directory.locate(&ActorAddr([1; 32])), Some(b));
        assert_eq!(
            (directory.routes_held_by(&a), directory.routes_held_by(&b)),
            (0, 1)
        );
        // A cannot take it back on its old say-so (the consent it gave is B's to use).
        let a10 = HostClaim::sign(&SECRET_A, ActorAddr([1; 32]), 10);
        assert_eq!(directory.apply_bytes(&a, &a10.encode()), ClaimVerdict::Held);
        // An actor hosted here is this node's, whatever consent a peer shows.
        directory.apply_local(&HostClaim::sign(&SECRET_C, ActorAddr([2; 32]), 1));
        let b2 = HostClaim::sign(&SECRET_B, ActorAddr([2; 32]), 5).with_handoff(Handoff::sign(
            &SECRET_C,
            &ActorAddr([2; 32]),
            &b,
            5,
        ));
        assert_eq!(directory.apply_bytes(&b, &b2.encode()), ClaimVerdict::Held);
        assert_eq!(
            directory.route(&ActorAddr([2; 32])).map(|r| r.host),
            Some(c)
        );
        // Once this node hands it off, the new host's claim is taken.
        directory.hand_off(ActorAddr([2; 32]), b, 5);
        let b6 = HostClaim::sign(&SECRET_B, ActorAddr([2; 32]), 6);
        assert_eq!(
            directory.apply_bytes(&b, &b6.encode()),
            ClaimVerdict::Accepted
        );
    }

    #[test]
    fn generations_cannot_jump_out_of_reach() {
        let a = id(&SECRET_A);
        let mut directory = Directory::default();
        // A first claim at the largest generation, or past the ceiling: refused.
        for generation in [u64::MAX, CLAIM_GENERATION_MAX + 1] {
            let claim = HostClaim::sign(&SECRET_A, ActorAddr([1; 32]), generation);
            assert_eq!(
                directory.apply_bytes(&a, &claim.encode()),
                ClaimVerdict::Jump
            );
        }
        let at = HostClaim::sign(&SECRET_A, ActorAddr([1; 32]), 10);
        assert_eq!(
            directory.apply_bytes(&a, &at.encode()),
            ClaimVerdict::Accepted
        );
        // A renewal more than the step ahead: refused; exactly the step: taken.
        let far = HostClaim::sign(
            &SECRET_A,
            ActorAddr([1; 32]),
            10 + CLAIM_GENERATION_STEP_MAX + 1,
        );
        assert_eq!(directory.apply_bytes(&a, &far.encode()), ClaimVerdict::Jump);
        let step = HostClaim::sign(
            &SECRET_A,
            ActorAddr([1; 32]),
            10 + CLAIM_GENERATION_STEP_MAX,
        );
        assert_eq!(
            directory.apply_bytes(&a, &step.encode()),
            ClaimVerdict::Accepted
        );
        // The ceiling itself is a generation like any other.
        let top = HostClaim::sign(&SECRET_A, ActorAddr([2; 32]), CLAIM_GENERATION_MAX);
        assert_eq!(
            directory.apply_bytes(&a, &top.encode()),
            ClaimVerdict::Accepted
        );
        assert_eq!(directory.verdicts()[&ClaimVerdict::Jump], 3);
    }

    #[test]
    fn an_authorizer_decides_first_claims_and_moves_without_consent() {
        let (a, b) = (id(&SECRET_A), id(&SECRET_B));
        // Actor n may be hosted by A when n is odd, by anyone when n ≥ 100.
        let authorizer = ClaimAuthorizer::new(move |request: &ClaimRequest| {
            request.actor.0[0] >= 100 || (request.actor.0[0] % 2 == 1 && request.host == a)
        });
        let mut directory = Directory::new(Some(authorizer));
        let claim = |secret, actor: u8, generation| {
            HostClaim::sign(secret, ActorAddr([actor; 32]), generation)
        };
        assert_eq!(
            directory.apply_bytes(&b, &claim(&SECRET_B, 1, 1).encode()),
            ClaimVerdict::Refused
        );
        assert_eq!(
            directory.apply_bytes(&a, &claim(&SECRET_A, 2, 1).encode()),
            ClaimVerdict::Refused
        );
        assert_eq!(
            directory.apply_bytes(&a, &claim(&SECRET_A, 1, 1).encode()),
            ClaimVerdict::Accepted
        );
        // Renewals are the holder's: not asked.
        assert_eq!(
            directory.apply_bytes(&a, &claim(&SECRET_A, 1, 2).encode()),
            ClaimVerdict::Accepted
        );
        // A move the authorizer allows needs no consent; one it refuses is refused.
        assert_eq!(
            directory.apply_bytes(&b, &claim(&SECRET_A, 100, 1).encode()),
            ClaimVerdict::Relayed
        );
        assert_eq!(
            directory.apply_bytes(&a, &claim(&SECRET_A, 100, 1).encode()),
            ClaimVerdict::Accepted
        );
        assert_eq!(
            directory.apply_bytes(&b, &claim(&SECRET_B, 100, 2).encode()),
            ClaimVerdict::Accepted
        );
        assert_eq!(
            directory.route(&ActorAddr([100; 32])).map(|r| r.host),
            Some(b)
        );
        assert_eq!(
            directory.apply_bytes(&b, &claim(&SECRET_B, 1, 3).encode()),
            ClaimVerdict::Refused
        );
        // A handoff by the holder is consent enough, whatever the authorizer would say.
        let moved = claim(&SECRET_B, 1, 3).with_handoff(Handoff::sign(
            &SECRET_A,
            &ActorAddr([1; 32]),
            &b,
            3,
        ));
        assert_eq!(
            directory.apply_bytes(&b, &moved.encode()),
            ClaimVerdict::Accepted
        );
    }

    #[test]
    fn one_host_cannot_fill_the_directory() {
        let (a, b) = (id(&SECRET_A), id(&SECRET_B));
        let mut directory = Directory::default();
        // A's share, filled.
        // (Signatures are not the point here: claims as the shell's check passed them.)
        let verified = |host: NodeId, n: u32, generation| {
            let mut actor = [0u8; 32];
            actor[..4].copy_from_slice(&n.to_be_bytes());
            CheckedClaim::Verified(Box::new(HostClaim {
                actor: ActorAddr(actor),
                host,
                generation,
                signature: [0; 64],
                handoff: None,
            }))
        };
        for n in 0..DIRECTORY_ROUTES_PER_HOST_MAX as u32 {
            assert_eq!(
                directory.apply_checked(&a, verified(a, n, 1)),
                ClaimVerdict::Accepted
            );
        }
        let over = DIRECTORY_ROUTES_PER_HOST_MAX as u32;
        assert_eq!(
            directory.apply_checked(&a, verified(a, over, 1)),
            ClaimVerdict::Full
        );
        // A may still renew what it holds; B is unaffected.
        assert_eq!(
            directory.apply_checked(&a, verified(a, 0, 2)),
            ClaimVerdict::Accepted
        );
        assert_eq!(
            directory.apply_checked(&b, verified(b, over, 1)),
            ClaimVerdict::Accepted
        );
        assert_eq!(directory.routes_held_by(&a), DIRECTORY_ROUTES_PER_HOST_MAX);
        assert_eq!(directory.route_count(), DIRECTORY_ROUTES_PER_HOST_MAX + 1);
    }

    #[test]
    fn the_location_cache_is_bounded() {
        let mut directory = Directory::default();
        for n in 0..(LOCATION_CACHE_ENTRIES_MAX as u32 + 10) {
            let mut actor = [0u8; 32];
            actor[..4].copy_from_slice(&n.to_be_bytes());
            let actor = ActorAddr(actor);
            directory.set(actor, NodeId([1; 32]), 1);
            assert!(directory.locate(&actor).is_some());
        }
        assert_eq!(
            directory.location_cache_entries(),
            LOCATION_CACHE_ENTRIES_MAX
        );
    }

    proptest! {
        // Signing and verifying are slow in debug builds: fewer, shorter cases.
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        /// Any bytes: decoding never panics and is exact; whatever decodes encodes back to
        /// the same bytes; only the host's own signature is accepted.
        #[test]
        fn decoding_is_total_and_exact(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            match HostClaim::decode(&bytes) {
                Ok(claim) => {
                    prop_assert!(bytes.len() == CLAIM_BYTES || bytes.len() == CLAIM_WITH_HANDOFF_BYTES);
                    prop_assert_eq!(&claim.encode()[..], &bytes[..]);
                    prop_assert!(!claim.verify(), "random bytes are not a signature");
                }
                Err(ClaimError::Length(n)) => prop_assert_eq!(n, bytes.len()),
            }
        }

        /// Each host's own claims: the view keeps the first host's highest generation per
        /// actor whatever order claims arrive in; another host's claim never moves it.
        #[test]
        fn the_first_holder_keeps_its_route_at_its_highest_generation(
            claims in proptest::collection::vec((0u8..3, any::<bool>(), 0u64..6), 0..16)
        ) {
            let mut directory = Directory::default();
            let mut best: BTreeMap<u8, (bool, u64)> = BTreeMap::new();
            for (actor, by_a, generation) in claims {
                let secret = if by_a { &SECRET_A } else { &SECRET_B };
                let claim = HostClaim::sign(secret, ActorAddr([actor; 32]), generation);
                let verdict = directory.apply_bytes(&claim.host, &claim.encode());
                let expected = match best.get(&actor) {
                    None => ClaimVerdict::Accepted,
                    Some(&(_, held)) if generation <= held => ClaimVerdict::Stale,
                    Some(&(holder, _)) if holder != by_a => ClaimVerdict::Held,
                    Some(_) => ClaimVerdict::Accepted,
                };
                prop_assert_eq!(verdict, expected);
                if verdict == ClaimVerdict::Accepted {
                    best.insert(actor, (by_a, generation));
                }
                let want = best.get(&actor).map(|&(a, g)| (id(if a { &SECRET_A } else { &SECRET_B }), g));
                prop_assert_eq!(directory.route(&ActorAddr([actor; 32])).map(|r| (r.host, r.generation)), want);
            }
        }
    }
}
