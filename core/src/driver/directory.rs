//! Signed actor host claims, the route view they feed, and the location cache of the egress
//! path (seed 000 §2.2, §3.5, §4.6).
//!
//! A node that hosts an actor signs a claim `(actor, host, generation)` with its endpoint key
//! (`register_actor`). Peers verify the signature against the host's id, keep the highest
//! generation per actor, and ignore forged and stale claims. Frames to an actor hosted
//! elsewhere go to `route_view[actor]`; the location cache keeps the peers resolved for the
//! egress path and forgets an actor whenever a newer claim moves it.
//!
//! # Wire
//!
//! A claim travels as an actor record tagged [`HOST_CLAIM_TAG`] to the peer's mailbox; its
//! payload is exactly [`CLAIM_BYTES`] bytes: actor (32), host (32), generation (8, big
//! endian), Ed25519 signature (64) over [`CLAIM_DOMAIN`] ‖ actor ‖ host ‖ generation.

use std::collections::{BTreeMap, VecDeque};

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};

use super::routing::{ActorAddr, NodeId};
use crate::limits::{DIRECTORY_ROUTES_MAX, LOCATION_CACHE_ENTRIES_MAX};

/// The actor tag of a host claim.
pub const HOST_CLAIM_TAG: &str = "tether.HostClaim";
/// Bytes of an encoded claim.
pub const CLAIM_BYTES: usize = 32 + 32 + 8 + 64;
/// What a claim's signature covers first (domain separation).
pub const CLAIM_DOMAIN: &[u8] = b"tether/host-claim/1";

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
}

/// Why claim bytes were refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    /// Not exactly [`CLAIM_BYTES`] bytes.
    #[error("a host claim is {CLAIM_BYTES} bytes, got {0}")]
    Length(usize),
}

fn signed_bytes(actor: &ActorAddr, host: &NodeId, generation: u64) -> Vec<u8> {
    let mut message = Vec::with_capacity(CLAIM_DOMAIN.len() + 72);
    message.extend_from_slice(CLAIM_DOMAIN);
    message.extend_from_slice(actor);
    message.extend_from_slice(host);
    message.extend_from_slice(&generation.to_be_bytes());
    message
}

impl HostClaim {
    /// Signs a claim for `actor` at `generation` with the host's 32-byte secret key (the
    /// host is the key's public half).
    pub fn sign(secret: &[u8; 32], actor: ActorAddr, generation: u64) -> Self {
        let key = SigningKey::from_bytes(secret);
        let host = key.verifying_key().to_bytes();
        let signature = key.sign(&signed_bytes(&actor, &host, generation));
        Self {
            actor,
            host,
            generation,
            signature: signature.to_bytes(),
        }
    }

    /// Whether the signature is the host's over this claim (strict Ed25519: no malleable or
    /// small-order forms).
    pub fn verify(&self) -> bool {
        let Ok(key) = VerifyingKey::from_bytes(&self.host) else {
            return false;
        };
        let signature = Signature::from_bytes(&self.signature);
        key.verify_strict(
            &signed_bytes(&self.actor, &self.host, self.generation),
            &signature,
        )
        .is_ok()
    }

    /// The wire bytes.
    pub fn encode(&self) -> [u8; CLAIM_BYTES] {
        let mut out = [0u8; CLAIM_BYTES];
        out[..32].copy_from_slice(&self.actor);
        out[32..64].copy_from_slice(&self.host);
        out[64..72].copy_from_slice(&self.generation.to_be_bytes());
        out[72..].copy_from_slice(&self.signature);
        out
    }

    /// Parses wire bytes (exactly [`CLAIM_BYTES`]; never allocates). The signature is not
    /// checked here: see [`HostClaim::verify`].
    pub fn decode(bytes: &[u8]) -> Result<Self, ClaimError> {
        let bytes: &[u8; CLAIM_BYTES] = bytes
            .try_into()
            .map_err(|_| ClaimError::Length(bytes.len()))?;
        let mut claim = Self {
            actor: [0; 32],
            host: [0; 32],
            generation: 0,
            signature: [0; 64],
        };
        claim.actor.copy_from_slice(&bytes[..32]);
        claim.host.copy_from_slice(&bytes[32..64]);
        let mut generation = [0u8; 8];
        generation.copy_from_slice(&bytes[64..72]);
        claim.generation = u64::from_be_bytes(generation);
        claim.signature.copy_from_slice(&bytes[72..]);
        Ok(claim)
    }
}

/// What a received claim did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClaimVerdict {
    /// New or newer: the route view now sends the actor's frames to the host.
    Accepted,
    /// Not newer than the generation held (a replay, a late or an equal claim): ignored.
    Stale,
    /// Malformed bytes, or a signature that is not the host's: ignored.
    Forged,
    /// A new actor past [`DIRECTORY_ROUTES_MAX`]: ignored.
    Full,
}

/// Where an actor is hosted, as the newest valid claim says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// The host.
    pub host: NodeId,
    /// The claim's generation.
    pub generation: u64,
}

/// The route view (directory of verified claims) and the location cache of egress.
#[derive(Debug, Clone, Default)]
pub struct Directory {
    routes: BTreeMap<ActorAddr, Route>,
    locations: BTreeMap<ActorAddr, NodeId>,
    /// Cached locations, oldest first.
    order: VecDeque<ActorAddr>,
    verdicts: BTreeMap<ClaimVerdict, u64>,
}

impl Directory {
    /// Applies claim bytes received from a peer.
    pub fn apply_bytes(&mut self, bytes: &[u8]) -> ClaimVerdict {
        let verdict = match HostClaim::decode(bytes) {
            Ok(claim) if claim.verify() => self.apply_verified(&claim),
            _ => ClaimVerdict::Forged,
        };
        *self.verdicts.entry(verdict).or_default() += 1;
        verdict
    }

    /// Applies a claim whose signature was checked (a local registration, or after
    /// [`HostClaim::verify`]).
    pub fn apply_verified(&mut self, claim: &HostClaim) -> ClaimVerdict {
        match self.routes.get(&claim.actor) {
            Some(route) if route.generation >= claim.generation => return ClaimVerdict::Stale,
            None if self.routes.len() >= DIRECTORY_ROUTES_MAX => return ClaimVerdict::Full,
            _ => {}
        }
        self.routes.insert(
            claim.actor,
            Route {
                host: claim.host,
                generation: claim.generation,
            },
        );
        // The actor may have moved: resolve it afresh.
        if self.locations.remove(&claim.actor).is_some() {
            self.order.retain(|actor| *actor != claim.actor);
        }
        ClaimVerdict::Accepted
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

    #[test]
    fn a_claim_signed_by_its_host_verifies_and_round_trips() {
        let claim = HostClaim::sign(&SECRET_A, [1; 32], 3);
        assert!(claim.verify());
        let bytes = claim.encode();
        assert_eq!(HostClaim::decode(&bytes), Ok(claim));
        // Golden bytes: the layout is actor, host, generation (big endian), signature.
        assert_eq!(&bytes[..32], &[1; 32]);
        assert_eq!(&bytes[32..64], &claim.host);
        assert_eq!(&bytes[64..72], &[0, 0, 0, 0, 0, 0, 0, 3]);
        assert_eq!(
            hex::encode(claim.host),
            hex::encode(SigningKey::from_bytes(&SECRET_A).verifying_key().to_bytes())
        );
        // Ed25519 is deterministic: the same claim is the same bytes on every machine.
        let golden = "0101010101010101010101010101010101010101010101010101010101010101\
            ea4a6c63e29c520abef5507b132ec5f9954776aebebe7b92421eea691446d22c\
            0000000000000003\
            bc7005a5c035fe12d0a443fcaad123cdd96b6e6d38777128d5d90d77eb3c509f\
            7f36ac0ddecd05e58be95afba229cfb3a16f80bcc5180b5954dbc492e12b8109";
        assert_eq!(hex::encode(bytes), golden);
    }

    #[test]
    fn forged_stale_and_newer_claims() {
        let mut directory = Directory::default();
        let a1 = HostClaim::sign(&SECRET_A, [1; 32], 1);
        assert_eq!(directory.apply_bytes(&a1.encode()), ClaimVerdict::Accepted);
        assert_eq!(directory.locate(&[1; 32]), Some(a1.host));
        assert_eq!(directory.location_cache_entries(), 1);
        // B claims the actor under A's name: the signature is not A's.
        let mut forged = HostClaim::sign(&SECRET_B, [1; 32], 9);
        forged.host = a1.host;
        assert_eq!(
            directory.apply_bytes(&forged.encode()),
            ClaimVerdict::Forged
        );
        // A flipped generation breaks the signature too.
        let mut bumped = a1;
        bumped.generation = 5;
        assert_eq!(
            directory.apply_bytes(&bumped.encode()),
            ClaimVerdict::Forged
        );
        // Truncated bytes.
        assert_eq!(
            directory.apply_bytes(&a1.encode()[..100]),
            ClaimVerdict::Forged
        );
        // A replay and an equal generation from another host are stale.
        assert_eq!(directory.apply_bytes(&a1.encode()), ClaimVerdict::Stale);
        let b1 = HostClaim::sign(&SECRET_B, [1; 32], 1);
        assert_eq!(directory.apply_bytes(&b1.encode()), ClaimVerdict::Stale);
        assert_eq!(directory.locate(&[1; 32]), Some(a1.host));
        // A newer claim moves the actor and drops its cached location.
        let b2 = HostClaim::sign(&SECRET_B, [1; 32], 2);
        assert_eq!(directory.apply_bytes(&b2.encode()), ClaimVerdict::Accepted);
        assert_eq!(directory.location_cache_entries(), 0);
        assert_eq!(directory.locate(&[1; 32]), Some(b2.host));
        assert_eq!(directory.route_count(), 1);
        assert_eq!(directory.verdicts()[&ClaimVerdict::Forged], 3);
        assert_eq!(directory.verdicts()[&ClaimVerdict::Stale], 2);
        assert_eq!(directory.verdicts()[&ClaimVerdict::Accepted], 2);
    }

    #[test]
    fn the_location_cache_is_bounded() {
        let mut directory = Directory::default();
        for n in 0..(LOCATION_CACHE_ENTRIES_MAX as u32 + 10) {
            let mut actor = [0u8; 32];
            actor[..4].copy_from_slice(&n.to_be_bytes());
            directory.routes.insert(
                actor,
                Route {
                    host: [1; 32],
                    generation: 1,
                },
            );
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
                    prop_assert_eq!(bytes.len(), CLAIM_BYTES);
                    prop_assert_eq!(&claim.encode()[..], &bytes[..]);
                    prop_assert!(!claim.verify(), "random bytes are not a signature");
                }
                Err(ClaimError::Length(n)) => prop_assert_eq!(n, bytes.len()),
            }
        }

        /// The view keeps the highest generation per actor whatever order claims arrive in.
        #[test]
        fn the_highest_generation_wins(claims in proptest::collection::vec((0u8..3, any::<bool>(), 0u64..6), 0..16)) {
            let mut directory = Directory::default();
            let mut best: BTreeMap<u8, u64> = BTreeMap::new();
            for (actor, by_a, generation) in claims {
                let secret = if by_a { &SECRET_A } else { &SECRET_B };
                let claim = HostClaim::sign(secret, [actor; 32], generation);
                let verdict = directory.apply_bytes(&claim.encode());
                let newer = best.get(&actor).is_none_or(|held| generation > *held);
                prop_assert_eq!(verdict == ClaimVerdict::Accepted, newer);
                if newer {
                    best.insert(actor, generation);
                }
                prop_assert_eq!(directory.route(&[actor; 32]).map(|r| r.generation), best.get(&actor).copied());
            }
        }
    }
}
