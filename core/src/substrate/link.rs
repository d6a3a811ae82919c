//! A peer's machine bound to its current link, sans-IO: the handshake, the frame codec and
//! the [`Machine`], so that a shell only moves bytes, time and persistence results.
//!
//! ```text
//!   link_up ──▶ Handshaking ──(both proofs verify)──▶ Up ──▶ link_down ──▶ Down
//!                   │                                  │
//!                   └──── failure: poll_close ◀────────┘ fatal decode error, dead link
//! ```
//!
//! While the handshake runs, frames go to it and nothing of the machine is transmitted; once
//! it is ready the negotiated window is applied and the machine learns the link is up (and
//! resends every un-acked op). A failed handshake, a fatal decode error or a dead link asks
//! the shell to drop the connection through [`PeerLink::poll_close`], with a typed reason.

use bytes::Bytes;

use super::handshake::{
    Auth, Capabilities, Channel, Handshake, HandshakeError, Limits, Negotiated, Progress, Role,
};
use super::machine::{Event, Machine};
use crate::limits::{ENVELOPE_FRAME_BYTES_MAX, ENVELOPE_INLINE_BODY_BYTES_MAX};
use crate::time::Time;
use crate::wire::envelope::{EnvelopeDecoder, EnvelopeError, FrameSink};
use crate::wire::{FormatError, StreamDecoder};

/// Why the shell must drop the current connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LinkClose {
    /// The handshake failed; `code` is its close code (docs/spec/substrate.md §8).
    #[error("handshake failed ({code}): {error}")]
    Handshake {
        /// The close code.
        code: &'static str,
        /// What failed.
        error: HandshakeError,
    },
    /// The byte stream cannot be framed any more (oversized frame, truncated stream).
    #[error("undecodable stream: {0}")]
    Decode(EnvelopeError),
    /// Nothing was heard for the dead-after interval.
    #[error("no traffic for the dead-after interval")]
    Dead,
    /// The peer sent a frame no honest peer sends ([`Event::Violation`]).
    #[error("protocol violation: {0}")]
    Violation(&'static str),
}

enum State {
    Down,
    Handshaking(Box<Handshake>),
    Up,
}

/// One remote peer: its [`Machine`] and the state of the link currently bound to it.
pub struct PeerLink {
    machine: Machine,
    auth: Auth,
    features: Vec<String>,
    state: State,
    decoder: StreamDecoder<EnvelopeDecoder>,
    negotiated: Option<Negotiated>,
    close: Option<LinkClose>,
}

impl std::fmt::Debug for PeerLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            State::Down => "down",
            State::Handshaking(_) => "handshaking",
            State::Up => "up",
        };
        f.debug_struct("PeerLink")
            .field("machine", &self.machine)
            .field("auth", &self.auth)
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

impl PeerLink {
    /// Binds `machine` to links authenticated with `auth`, offering `features`.
    pub fn new(machine: Machine, auth: Auth, features: Vec<String>) -> Self {
        Self {
            machine,
            auth,
            features,
            state: State::Down,
            decoder: StreamDecoder::new(EnvelopeDecoder),
            negotiated: None,
            close: None,
        }
    }

    /// The machine, for app commands and outputs other than frames.
    pub fn machine(&self) -> &Machine {
        &self.machine
    }

    /// The machine, for app commands (`open`, `send`, ...) and draining persist batches and
    /// events. Frames must be drained through [`PeerLink::poll_transmit`].
    pub fn machine_mut(&mut self) -> &mut Machine {
        &mut self.machine
    }

    /// Whether a link is bound and authenticated.
    pub fn is_up(&self) -> bool {
        matches!(self.state, State::Up)
    }

    /// The tuple the current link negotiated, once it is up.
    pub fn negotiated(&self) -> Option<&Negotiated> {
        self.negotiated.as_ref()
    }

    /// A new connection to the peer: starts the handshake. Any previous link is taken down
    /// first. `nonce` must be fresh random bytes (at least 16).
    pub fn link_up(&mut self, now: Time, role: Role, channel: Channel, nonce: Vec<u8>) {
        self.link_down(now);
        let caps = capabilities(
            &self.auth,
            self.features.clone(),
            self.machine.receive_window(),
        );
        let handshake = Handshake::start(now, role, self.auth.clone(), caps, channel, nonce);
        self.state = State::Handshaking(Box::new(handshake));
        self.decoder = StreamDecoder::new(EnvelopeDecoder);
        self.close = None;
    }

    /// A new connection whose handshake the shell already ran and verified (an inbound link
    /// is proven before it touches the peer's state: see [`capabilities`]): it is up at once,
    /// with `negotiated`, replacing any previous link. The shell then hands over any bytes
    /// that followed the handshake with [`PeerLink::handle_bytes`].
    pub fn adopt(&mut self, now: Time, negotiated: Negotiated) {
        self.link_down(now);
        self.decoder = StreamDecoder::new(EnvelopeDecoder);
        self.close = None;
        self.machine.set_initial_credit(negotiated.limits.window);
        self.negotiated = Some(negotiated);
        self.state = State::Up;
        self.machine.handle_link_up_with(now, Vec::new());
    }

    /// The connection is gone (closed by either side or failed). Idempotent.
    pub fn link_down(&mut self, now: Time) {
        if matches!(self.state, State::Up) {
            self.machine.handle_link_down(now);
        }
        self.state = State::Down;
        self.negotiated = None;
    }

    /// Bytes read from the connection, in order.
    pub fn handle_bytes(&mut self, now: Time, bytes: Bytes) {
        if matches!(self.state, State::Down) {
            return;
        }
        self.decoder.push_bytes(bytes);
        loop {
            if matches!(self.state, State::Up) {
                // Every whole frame the decoder holds is one step of the machine, up to a
                // frame that fails to decode; one at a time while handshaking (below).
                match self.machine.handle_decoded(now, &mut self.decoder) {
                    None => break,
                    Some(error) if error.error.is_fatal() => {
                        self.fail(now, LinkClose::Decode(error.error));
                        break;
                    }
                    Some(error) => {
                        self.machine.handle_bad_frame(now, &error.error);
                        continue;
                    }
                }
            }
            match self.decoder.pop() {
                Ok(Some(frame)) => self.handle_frame(now, frame),
                Ok(None) => break,
                Err(error) if error.error.is_fatal() => {
                    self.fail(now, LinkClose::Decode(error.error));
                    break;
                }
                Err(_) => {
                    // Still handshaking (the machine takes the frames once the link is up).
                    self.fail(
                        now,
                        LinkClose::Handshake {
                            code: HandshakeError::Malformed.code(),
                            error: HandshakeError::Malformed,
                        },
                    );
                    break;
                }
            }
            if matches!(self.state, State::Down) {
                break;
            }
        }
    }

    /// The connection reached end of stream: a truncated tail is reported, then the link is
    /// down.
    pub fn handle_eof(&mut self, now: Time) {
        if let Err(error) = self.decoder.finish() {
            self.close.get_or_insert(LinkClose::Decode(error.error));
        }
        self.link_down(now);
    }

    /// Time passed.
    pub fn handle_timeout(&mut self, now: Time) {
        if let State::Handshaking(handshake) = &mut self.state {
            if let Err(error) = handshake.handle_timeout(now) {
                self.fail(now, handshake_close(error));
            }
        }
        self.machine.handle_timeout(now);
    }

    /// When [`PeerLink::handle_timeout`] is due.
    pub fn poll_timeout(&self) -> Option<Time> {
        let handshake = match &self.state {
            State::Handshaking(handshake) => handshake.poll_timeout(),
            _ => None,
        };
        match (handshake, self.machine.poll_timeout()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Appends the next frame to send to `out`; false when there is none. Handshake frames
    /// first; the machine's only once the link is up.
    pub fn poll_transmit(&mut self, out: &mut impl FrameSink) -> bool {
        let frame = match &mut self.state {
            State::Down => None,
            State::Handshaking(handshake) => handshake.poll_transmit(),
            State::Up => self.machine.poll_transmit(),
        };
        match frame {
            Some(frame) => {
                out.put_frame(&frame)
                    .expect("the machine and the handshake only build encodable frames");
                true
            }
            None => false,
        }
    }

    /// The next app event of the machine. [`Event::LinkDead`] and [`Event::Violation`] also
    /// ask the shell to close the link through [`PeerLink::poll_close`].
    pub fn poll_event(&mut self) -> Option<Event> {
        let event = self.machine.poll_event()?;
        let close = match &event {
            Event::LinkDead => Some(LinkClose::Dead),
            Event::Violation { what } => Some(LinkClose::Violation(what)),
            _ => None,
        };
        if let Some(close) = close {
            self.close.get_or_insert(close);
            self.state = State::Down;
            self.negotiated = None;
        }
        Some(event)
    }

    /// Whether the shell must drop the connection, and why. Taken once.
    pub fn poll_close(&mut self) -> Option<LinkClose> {
        self.close.take()
    }

    fn handle_frame(&mut self, now: Time, frame: crate::wire::envelope::Envelope) {
        match &mut self.state {
            State::Down => {}
            State::Up => self.machine.handle_frame(now, frame),
            State::Handshaking(handshake) => match handshake.handle_frame(now, &frame) {
                Ok(Progress::Pending) => {}
                Ok(Progress::Ready(negotiated)) => {
                    // Our proof may still be queued: the handshake's last frames go first.
                    let mut pending = Vec::new();
                    while let Some(frame) = handshake.poll_transmit() {
                        pending.push(frame);
                    }
                    self.machine.set_initial_credit(negotiated.limits.window);
                    self.negotiated = Some(negotiated);
                    self.state = State::Up;
                    self.machine.handle_link_up_with(now, pending);
                }
                Err(error) => self.fail(now, handshake_close(error)),
            },
        }
    }

    fn fail(&mut self, now: Time, close: LinkClose) {
        self.close.get_or_insert(close);
        self.link_down(now);
    }
}

/// What this side offers in a link's handshake: `auth`'s method, `features`, the envelope
/// bounds and a receive `window` ([`Machine::receive_window`]). A handshake the shell runs
/// itself before [`PeerLink::adopt`] offers exactly what [`PeerLink::link_up`] would.
pub fn capabilities(auth: &Auth, features: Vec<String>, window: u64) -> Capabilities {
    let limits = Limits {
        frame_bytes_max: ENVELOPE_FRAME_BYTES_MAX as u64,
        body_bytes_max: ENVELOPE_INLINE_BODY_BYTES_MAX as u64,
        window,
    };
    Capabilities::new(auth, features, limits)
}

fn handshake_close(error: HandshakeError) -> LinkClose {
    LinkClose::Handshake {
        code: error.code(),
        error,
    }
}
