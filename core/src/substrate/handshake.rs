//! The substrate handshake (docs/spec/substrate.md §8): capabilities exchange,
//! negotiation, then a proof bound to the whole negotiated tuple and the connection id.
//!
//! ```text
//! dialer                                   listener
//!   hello{caps, nonce_d}  ───────────────▶
//!                         ◀───────────────  hello{caps, nonce_l}
//!   both negotiate the same tuple from the two hellos
//!   proof_d = MAC(transcript("dialer"))  ─▶
//!                         ◀───────────────  proof_l = MAC(transcript("listener"))
//!   each verifies the other's proof → ready(negotiated)
//! ```
//!
//! The transcript is length-framed: a domain label, the prover's role, both hellos exactly as
//! sent (so both nonces), the negotiated tuple and the connection id. Changing any of them,
//! or the key, breaks the proof. Each side's nonce is fresh for this handshake (≥ 16 bytes, a
//! seed the shell passes in) and the peer's proof must arrive within 5 s of our hello, so a
//! proof can neither be replayed nor held back.
//!
//! Auth methods: `shared-key` (HMAC-SHA256 keyed by SHA-256 of the raw key) and
//! `transport-identity` (the peer id the transport authenticated, and HMAC-SHA256 keyed by
//! SHA-256 of channel-binding bytes both ends derive from their secure channel, e.g. TLS
//! keying material: a relay in the middle sees two channels and cannot produce the proof).
//! `none` is an explicit choice and is reported in [`Negotiated::auth`].
//!
//! Frames: control frames of the envelope format with verb `ack` (a neutral verb) and the
//! message, postcard-encoded, as the body: type `0x04` hello, `0x05` proof.

use std::time::Duration;

use bytes::Bytes;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::time::Time;
use crate::wire::envelope::{Env, Envelope, Verb};

/// Type byte of a hello frame.
pub const TYPE_HELLO: u8 = 0x04;
/// Type byte of a proof frame.
pub const TYPE_PROOF: u8 = 0x05;
/// The protocol versions this build speaks.
pub const VERSIONS: [u32; 1] = [1];
/// Shortest nonce accepted.
pub const NONCE_BYTES_MIN: usize = 16;
/// Time a peer has to prove itself after our hello.
pub const PROOF_BUDGET: Duration = Duration::from_secs(5);
/// Domain label of the transcript.
const DOMAIN: &[u8] = b"tether/substrate/handshake/v1";
/// Most entries in any capability list (bounds a hostile hello).
const LIST_MAX: usize = 32;

/// How this side authenticates. A required choice: there is no default.
#[derive(Clone, PartialEq, Eq)]
pub enum Auth {
    /// HMAC-SHA256 keyed by SHA-256 of this raw key, which both sides hold. One key for every
    /// peer: any peer that holds it can claim to be any other.
    SharedKey(Vec<u8>),
    /// A key record per peer (`peerRecordFor` in docs/spec/substrate.md §8): the link with a peer
    /// is proven with the key the two of them hold (on the wire, as `shared-key`), so a peer can
    /// only be itself. A link claiming a peer without a record is refused before anything else.
    PeerKeys(PeerKeys),
    /// The transport authenticated the peer; bind the proof to the channel.
    TransportIdentity,
    /// No authentication, chosen explicitly (shells log it at warn).
    None,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.write_str(self.method().as_str())
    }
}

/// Each peer's key, by peer id ([`Auth::PeerKeys`]).
#[derive(Clone, PartialEq, Eq, Default)]
pub struct PeerKeys(std::sync::Arc<std::collections::BTreeMap<String, Vec<u8>>>);

impl PeerKeys {
    /// The records: each peer id and the raw key this side and that peer hold.
    pub fn new<I, P, K>(records: I) -> Self
    where
        I: IntoIterator<Item = (P, K)>,
        P: Into<String>,
        K: Into<Vec<u8>>,
    {
        Self(std::sync::Arc::new(
            records
                .into_iter()
                .map(|(peer, key)| (peer.into(), key.into()))
                .collect(),
        ))
    }

    /// The key for `peer`, if it has a record.
    pub fn key(&self, peer: &str) -> Option<&[u8]> {
        self.0.get(peer).map(Vec::as_slice)
    }
}

impl Auth {
    /// What this side proves a link with `peer` with: the peer's own key under
    /// [`Auth::PeerKeys`] (`None` when it has no record: refuse the link), this choice as it
    /// is otherwise.
    pub fn for_peer(&self, peer: &str) -> Option<Auth> {
        match self {
            Auth::PeerKeys(keys) => keys.key(peer).map(|key| Auth::SharedKey(key.to_vec())),
            other => Some(other.clone()),
        }
    }

    /// The method name this choice advertises.
    pub fn method(&self) -> AuthMethod {
        match self {
            Auth::SharedKey(_) | Auth::PeerKeys(_) => AuthMethod::SharedKey,
            Auth::TransportIdentity => AuthMethod::TransportIdentity,
            Auth::None => AuthMethod::None,
        }
    }
}

/// An auth method name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum AuthMethod {
    /// `shared-key`.
    SharedKey,
    /// `transport-identity`.
    TransportIdentity,
    /// `none`.
    None,
}

impl AuthMethod {
    /// The name on the wire and in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            AuthMethod::SharedKey => "shared-key",
            AuthMethod::TransportIdentity => "transport-identity",
            AuthMethod::None => "none",
        }
    }
}

/// Limits each side proposes; the minimum of each is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Largest frame.
    pub frame_bytes_max: u64,
    /// Largest inline body.
    pub body_bytes_max: u64,
    /// Receive window: ops per object a side holds for its app (its peer's starting credit).
    pub window: u64,
}

/// What one side offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// Protocol versions spoken.
    pub versions: Vec<u32>,
    /// Auth methods accepted (exactly the one chosen, derived from [`Auth`]).
    pub auth_methods: Vec<AuthMethod>,
    /// Body encodings understood.
    pub encodings: Vec<String>,
    /// Optional features (including the dedupe scope token).
    pub features: Vec<String>,
    /// Proposed limits.
    pub limits: Limits,
}

impl Capabilities {
    /// This build's capabilities for `auth`, with `features` and `limits`.
    pub fn new(auth: &Auth, features: Vec<String>, limits: Limits) -> Self {
        Self {
            versions: VERSIONS.to_vec(),
            auth_methods: vec![auth.method()],
            encodings: vec!["cbor".to_owned()],
            features,
            limits,
        }
    }
}

/// The tuple both sides agree on and the proofs bind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Negotiated {
    /// Highest common version.
    pub version: u32,
    /// The auth method in force.
    pub auth: AuthMethod,
    /// The first of our encodings the peer also speaks.
    pub encoding: String,
    /// Common features, sorted.
    pub features: Vec<String>,
    /// Minimum of each limit.
    pub limits: Limits,
}

/// Why a handshake failed; each closes the connection with [`HandshakeError::code`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// No common version.
    #[error("no common protocol version")]
    VersionMismatch,
    /// The peer does not accept our auth method.
    #[error("no common auth method")]
    AuthMismatch,
    /// No common body encoding.
    #[error("no common encoding")]
    EncodingMismatch,
    /// A limit of zero.
    #[error("a negotiated limit is zero")]
    ZeroLimit,
    /// The peer's nonce is shorter than 16 bytes.
    #[error("nonce shorter than {NONCE_BYTES_MIN} bytes")]
    NonceTooShort,
    /// The proof does not verify (wrong key, tampered tuple, other connection).
    #[error("the peer's proof does not verify")]
    BadProof,
    /// No proof within the budget.
    #[error("no proof within {PROOF_BUDGET:?}")]
    Timeout,
    /// A frame out of order or undecodable.
    #[error("unexpected or malformed handshake frame")]
    Malformed,
}

impl HandshakeError {
    /// The close code (docs/spec/substrate.md §7.1 codes; the mapping is §8).
    pub fn code(&self) -> &'static str {
        match self {
            HandshakeError::VersionMismatch => super::finality::UPGRADE_REQUIRED,
            HandshakeError::EncodingMismatch | HandshakeError::ZeroLimit => {
                super::finality::UNSUPPORTED_SERVICE
            }
            _ => super::finality::AUTH_FAILED,
        }
    }
}

/// Which end of the connection this side is (the prover role in the transcript).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Opened the connection.
    Dialer,
    /// Accepted it.
    Listener,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Dialer => b"dialer",
            Role::Listener => b"listener",
        }
    }

    fn other(self) -> Role {
        match self {
            Role::Dialer => Role::Listener,
            Role::Listener => Role::Dialer,
        }
    }
}

/// What the connection gives the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Channel {
    /// The link's id: both peers' ids, the link's dialer first (over iroh, links opened the
    /// same way on one QUIC connection share it; each handshake's fresh nonces tell them
    /// apart).
    pub conn_id: Vec<u8>,
    /// Bytes both ends derive from the secure channel (TLS keying material); used by
    /// `transport-identity`.
    pub binding: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Hello {
    caps: Capabilities,
    nonce: Vec<u8>,
}

/// Progress of a handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// More frames needed.
    Pending,
    /// Done: the tuple both sides proved.
    Ready(Negotiated),
}

/// One side of one handshake, sans-IO: feed the peer's frames, drain frames to send.
pub struct Handshake {
    role: Role,
    auth: Auth,
    channel: Channel,
    our_hello: Bytes,
    their_hello: Option<Bytes>,
    negotiated: Option<Negotiated>,
    sent_at: Time,
    outbox: Vec<Envelope>,
    done: bool,
}

impl std::fmt::Debug for Handshake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handshake")
            .field("role", &self.role)
            .field("auth", &self.auth)
            .field("negotiated", &self.negotiated)
            .finish_non_exhaustive()
    }
}

impl Handshake {
    /// Starts a handshake and queues our hello. `nonce` must be fresh (≥ 16 random bytes).
    pub fn start(
        now: Time,
        role: Role,
        auth: Auth,
        caps: Capabilities,
        channel: Channel,
        nonce: Vec<u8>,
    ) -> Self {
        assert!(
            nonce.len() >= NONCE_BYTES_MIN,
            "the shell passes a fresh nonce of 16+ bytes"
        );
        let hello = Hello { caps, nonce };
        let our_hello: Bytes = postcard::to_allocvec(&hello)
            .expect("a hello always serializes")
            .into();
        let mut handshake = Self {
            role,
            auth,
            channel,
            our_hello: our_hello.clone(),
            their_hello: None,
            negotiated: None,
            sent_at: now,
            outbox: Vec::new(),
            done: false,
        };
        handshake.outbox.push(control(TYPE_HELLO, our_hello));
        handshake
    }

    /// The next frame to send.
    pub fn poll_transmit(&mut self) -> Option<Envelope> {
        (!self.outbox.is_empty()).then(|| self.outbox.remove(0))
    }

    /// When [`Handshake::handle_timeout`] is due.
    pub fn poll_timeout(&self) -> Option<Time> {
        (!self.done).then(|| self.sent_at.saturating_add(PROOF_BUDGET))
    }

    /// Fails the handshake once the proof budget is spent.
    pub fn handle_timeout(&mut self, now: Time) -> Result<(), HandshakeError> {
        if !self.done && now.saturating_since(self.sent_at) >= PROOF_BUDGET {
            return Err(HandshakeError::Timeout);
        }
        Ok(())
    }

    /// One frame from the peer.
    pub fn handle_frame(
        &mut self,
        now: Time,
        frame: &Envelope,
    ) -> Result<Progress, HandshakeError> {
        self.handle_timeout(now)?;
        let body = frame.body.as_ref().ok_or(HandshakeError::Malformed)?;
        match (frame.type_byte, &self.negotiated) {
            (TYPE_HELLO, None) => {
                let hello: Hello =
                    postcard::from_bytes(body).map_err(|_| HandshakeError::Malformed)?;
                if hello.nonce.len() < NONCE_BYTES_MIN {
                    return Err(HandshakeError::NonceTooShort);
                }
                let ours: Hello =
                    postcard::from_bytes(&self.our_hello).expect("we encoded it ourselves");
                let negotiated = negotiate(&ours.caps, &hello.caps)?;
                self.their_hello = Some(body.clone());
                let proof = self.mac(self.role, &negotiated)?;
                self.negotiated = Some(negotiated);
                self.outbox.push(control(TYPE_PROOF, Bytes::from(proof)));
                Ok(Progress::Pending)
            }
            (TYPE_PROOF, Some(negotiated)) => {
                let negotiated = negotiated.clone();
                let expected = self.mac(self.role.other(), &negotiated)?;
                // Compare in constant time: no early exit on the first differing byte.
                if !constant_time_eq(&expected, body) {
                    return Err(HandshakeError::BadProof);
                }
                self.done = true;
                Ok(Progress::Ready(negotiated))
            }
            _ => Err(HandshakeError::Malformed),
        }
    }

    /// The proof `prover` must produce: empty for `none`.
    fn mac(&self, prover: Role, negotiated: &Negotiated) -> Result<Vec<u8>, HandshakeError> {
        let key = match &self.auth {
            Auth::SharedKey(raw) => Sha256::digest(raw),
            // Unresolved ([`Auth::for_peer`]): no key, so no proof can be made or checked.
            Auth::PeerKeys(_) => return Err(HandshakeError::BadProof),
            Auth::TransportIdentity => Sha256::digest(&self.channel.binding),
            Auth::None => return Ok(Vec::new()),
        };
        let their_hello = self.their_hello.as_ref().ok_or(HandshakeError::Malformed)?;
        let (dialer_hello, listener_hello) = match self.role {
            Role::Dialer => (&self.our_hello, their_hello),
            Role::Listener => (their_hello, &self.our_hello),
        };
        let tuple = postcard::to_allocvec(negotiated).expect("a tuple always serializes");
        let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("HMAC takes keys of any length");
        for part in [
            DOMAIN,
            prover.label(),
            dialer_hello,
            listener_hello,
            &tuple,
            &self.channel.conn_id,
        ] {
            mac.update(&(part.len() as u64).to_be_bytes());
            mac.update(part);
        }
        Ok(mac.finalize().into_bytes().to_vec())
    }
}

/// Negotiates from two capability sets: highest common version, our auth method if the peer
/// accepts it, our first encoding the peer speaks, common features, minimum of limits.
pub fn negotiate(ours: &Capabilities, theirs: &Capabilities) -> Result<Negotiated, HandshakeError> {
    let bounded = |caps: &Capabilities| {
        caps.versions.len() <= LIST_MAX
            && caps.auth_methods.len() <= LIST_MAX
            && caps.encodings.len() <= LIST_MAX
            && caps.features.len() <= LIST_MAX
    };
    if !bounded(theirs) {
        return Err(HandshakeError::Malformed);
    }
    let version = ours
        .versions
        .iter()
        .filter(|v| theirs.versions.contains(v))
        .max()
        .copied()
        .ok_or(HandshakeError::VersionMismatch)?;
    let auth = ours
        .auth_methods
        .iter()
        .find(|m| theirs.auth_methods.contains(m))
        .copied()
        .ok_or(HandshakeError::AuthMismatch)?;
    let encoding = ours
        .encodings
        .iter()
        .find(|e| theirs.encodings.contains(e))
        .cloned()
        .ok_or(HandshakeError::EncodingMismatch)?;
    let mut features: Vec<String> = ours
        .features
        .iter()
        .filter(|f| theirs.features.contains(f))
        .cloned()
        .collect();
    features.sort();
    features.dedup();
    let limits = Limits {
        frame_bytes_max: ours
            .limits
            .frame_bytes_max
            .min(theirs.limits.frame_bytes_max),
        body_bytes_max: ours.limits.body_bytes_max.min(theirs.limits.body_bytes_max),
        window: ours.limits.window.min(theirs.limits.window),
    };
    if limits.frame_bytes_max == 0 || limits.body_bytes_max == 0 || limits.window == 0 {
        return Err(HandshakeError::ZeroLimit);
    }
    Ok(Negotiated {
        version,
        auth,
        encoding,
        features,
        limits,
    })
}

fn control(type_byte: u8, body: Bytes) -> Envelope {
    Envelope {
        type_byte,
        env: Env::new(Verb::Ack),
        body: Some(body),
    }
}

fn constant_time_eq(left: &[u8], right: &[u8]) -> bool {
    left.len() == right.len()
        && left
            .iter()
            .zip(right)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        frame_bytes_max: 1 << 20,
        body_bytes_max: 1 << 16,
        window: 32,
    };

    fn side(role: Role, auth: Auth, conn: &[u8], binding: &[u8], nonce: u8) -> Handshake {
        let caps = Capabilities::new(&auth, vec!["dedupe:peer".into()], LIMITS);
        let channel = Channel {
            conn_id: conn.to_vec(),
            binding: binding.to_vec(),
        };
        Handshake::start(Time::ZERO, role, auth, caps, channel, vec![nonce; 16])
    }

    /// Runs both sides to completion, letting `tamper` edit frames in flight.
    fn run(
        mut dialer: Handshake,
        mut listener: Handshake,
        tamper: impl Fn(&mut Envelope),
    ) -> (
        Result<Progress, HandshakeError>,
        Result<Progress, HandshakeError>,
    ) {
        let now = Time::from_millis(10);
        let mut results = (Ok(Progress::Pending), Ok(Progress::Pending));
        for _ in 0..3 {
            while let Some(mut frame) = dialer.poll_transmit() {
                tamper(&mut frame);
                results.1 = listener.handle_frame(now, &frame);
            }
            while let Some(frame) = listener.poll_transmit() {
                results.0 = dialer.handle_frame(now, &frame);
            }
        }
        results
    }

    #[test]
    fn shared_key_handshake_negotiates_and_proves_both_ways() {
        let key = Auth::SharedKey(b"correct horse".to_vec());
        let (d, l) = run(
            side(Role::Dialer, key.clone(), b"c1", b"", 1),
            side(Role::Listener, key, b"c1", b"", 2),
            |_| {},
        );
        let Ok(Progress::Ready(negotiated)) = d else {
            panic!("dialer: {d:?}")
        };
        assert_eq!(l, Ok(Progress::Ready(negotiated.clone())));
        assert_eq!(negotiated.auth, AuthMethod::SharedKey);
        assert_eq!(negotiated.features, ["dedupe:peer"]);
    }

    #[test]
    fn a_wrong_key_fails() {
        let (_, l) = run(
            side(
                Role::Dialer,
                Auth::SharedKey(b"one".to_vec()),
                b"c1",
                b"",
                1,
            ),
            side(
                Role::Listener,
                Auth::SharedKey(b"two".to_vec()),
                b"c1",
                b"",
                2,
            ),
            |_| {},
        );
        assert_eq!(l, Err(HandshakeError::BadProof));
    }

    #[test]
    fn a_different_connection_id_or_channel_breaks_the_proof() {
        let key = Auth::SharedKey(b"k".to_vec());
        let (_, l) = run(
            side(Role::Dialer, key.clone(), b"c1", b"", 1),
            side(Role::Listener, key, b"c2", b"", 2),
            |_| {},
        );
        assert_eq!(l, Err(HandshakeError::BadProof));
        let (_, l) = run(
            side(Role::Dialer, Auth::TransportIdentity, b"c", b"tls-a", 1),
            side(Role::Listener, Auth::TransportIdentity, b"c", b"tls-b", 2),
            |_| {},
        );
        assert_eq!(l, Err(HandshakeError::BadProof));
        let (d, _) = run(
            side(Role::Dialer, Auth::TransportIdentity, b"c", b"tls", 1),
            side(Role::Listener, Auth::TransportIdentity, b"c", b"tls", 2),
            |_| {},
        );
        assert!(matches!(d, Ok(Progress::Ready(_))));
    }

    #[test]
    fn a_tampered_hello_breaks_the_proof() {
        let key = Auth::SharedKey(b"k".to_vec());
        // A middlebox strips a feature from the dialer's hello (a downgrade).
        let (_, l) = run(
            side(Role::Dialer, key.clone(), b"c", b"", 1),
            side(Role::Listener, key, b"c", b"", 2),
            |frame| {
                if frame.type_byte == TYPE_HELLO {
                    let mut hello: Hello =
                        postcard::from_bytes(frame.body.as_ref().unwrap()).unwrap();
                    hello.caps.features.clear();
                    frame.body = Some(postcard::to_allocvec(&hello).unwrap().into());
                }
            },
        );
        assert_eq!(l, Err(HandshakeError::BadProof));
    }

    #[test]
    fn mismatches_are_typed_and_carry_a_close_code() {
        let (_, l) = run(
            side(Role::Dialer, Auth::SharedKey(b"k".to_vec()), b"c", b"", 1),
            side(Role::Listener, Auth::TransportIdentity, b"c", b"", 2),
            |_| {},
        );
        assert_eq!(l, Err(HandshakeError::AuthMismatch));
        assert_eq!(HandshakeError::AuthMismatch.code(), "auth_failed");
        let mut old = Capabilities::new(&Auth::None, vec![], LIMITS);
        old.versions = vec![0];
        let ours = Capabilities::new(&Auth::None, vec![], LIMITS);
        assert_eq!(negotiate(&ours, &old), Err(HandshakeError::VersionMismatch));
        assert_eq!(HandshakeError::VersionMismatch.code(), "upgrade_required");
    }

    #[test]
    fn none_is_explicit_and_reported() {
        let (d, _) = run(
            side(Role::Dialer, Auth::None, b"c", b"", 1),
            side(Role::Listener, Auth::None, b"c", b"", 2),
            |_| {},
        );
        let Ok(Progress::Ready(negotiated)) = d else {
            panic!("{d:?}")
        };
        assert_eq!(negotiated.auth, AuthMethod::None);
    }

    #[test]
    fn a_proof_after_five_seconds_is_refused() {
        let key = Auth::SharedKey(b"k".to_vec());
        let mut dialer = side(Role::Dialer, key.clone(), b"c", b"", 1);
        let mut listener = side(Role::Listener, key, b"c", b"", 2);
        let hello = dialer.poll_transmit().unwrap();
        assert_eq!(
            listener.handle_frame(Time::from_millis(1), &hello),
            Ok(Progress::Pending)
        );
        let late = Time::from_millis(5_001);
        let proof = listener.poll_transmit().unwrap();
        assert_eq!(
            dialer.handle_frame(late, &proof),
            Err(HandshakeError::Timeout)
        );
    }
}
