//! The master side of a switch connection, for programs that serve caps (docs/spec/switch.md
//! §1: the host runtime behind a relay master), as a sans-IO machine. Its handshake is capdag
//! 1.524.58's (docs/spec/capdag-v6.md §11): the host speaks first.
//!
//! [`Host`] opens with a RELAY_NOTIFY (its limits and manifest), takes the switch's POLICY
//! (which must come first), echoes the identity check (connect-time and runtime probe) and
//! HEARTBEATs by itself, and hands the application every request for
//! one of its caps as [`HostEvent::Request`] followed by that request's input frames in order
//! ([`HostEvent::Input`]). The application answers through [`Host::write`] (credit-gated per
//! stream) and consumes input with [`Host::consume`] (batched CREDIT back). CANCEL and
//! CLOSE_STREAM arrive as events. Peer requests to other masters' caps go out with
//! [`Host::peer_request`]; their answers come back as [`HostEvent::PeerAnswer`].
//!
//! Drain `poll_transmit` (frames to write to the switch, in order) and `poll_event` after every
//! input, and call [`Host::handle_timeout`] at [`Host::poll_timeout`]. A [`HostError`] from
//! [`Host::handle_frame`] or [`Host::handle_timeout`] means the switch broke the protocol (or
//! never finished the handshake, or went silent): close the connection.
//!
//! Every request the machine reports ends exactly once, with [`HostEvent::Ended`] (the host
//! wrote END or ERR) or [`HostEvent::Cancelled`] (the switch cancelled it): the shell's state
//! for a request lives from its [`HostEvent::Request`] to one of those. A REQ whose key is
//! live already is a protocol error (it would orphan the request it replaces).

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use bytes::Bytes;

use super::hello::{manifest_json, HandshakeError, Limits, RelayNotify};
use super::side::{delivered, pass_logs, ReadError, RequestSide, Role, WriteError};
use super::{error_meta, IDENTITY_ECHO_STREAM};
use crate::cap::{CapUrn, CAP_IDENTITY};
use crate::limits::{
    SWITCH_HANDSHAKE_TIMEOUT_MS, SWITCH_HEARTBEAT_INTERVAL_MS, SWITCH_HEARTBEAT_TIMEOUT_MS,
    SWITCH_HOST_REORDER_HELD_BYTES_MAX, SWITCH_IDENTITY_ECHO_BYTES_MAX, SWITCH_SERVED_REQUESTS_MAX,
};
use crate::request::{Credits, ErrorClass, RefusalKind, RequestKey};
use crate::time::Time;
use crate::wire::bifaci::{Frame, FrameType, MessageId, Meta, NetworkPolicy};

/// What the application must know.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HostEvent {
    /// The handshake is done (the switch's first POLICY came) with these limits.
    Ready {
        /// The limits this host proposed, which the switch meets.
        limits: Limits,
    },
    /// The switch's policy (first before anything else, then on every change).
    Policy(NetworkPolicy),
    /// A request for one of this host's caps.
    Request {
        /// Its key (the switch's XID and the requester's RID).
        key: RequestKey,
        /// The cap asked for.
        cap: String,
        /// Which of [`HostConfig::caps`] serves it (the best ranked; a request none of them
        /// can serve is answered `NO_HANDLER` by the machine and never reported).
        serves: usize,
        /// The REQ's meta, if any.
        meta: Option<Meta>,
    },
    /// The next input frame of a request, in order (STREAM_START, CHUNK, STREAM_END, LOG, END
    /// or ERR). Call [`Host::consume`] for each CHUNK once processed.
    Input {
        /// The request.
        key: RequestKey,
        /// The frame.
        frame: Frame,
    },
    /// The switch cancelled a request: stop serving it (its state is gone).
    Cancelled {
        /// The request.
        key: RequestKey,
        /// Kill the work at once rather than wind it down.
        force_kill: bool,
    },
    /// Stop the request's feeds; the request should then end on its own.
    CloseStream {
        /// The request.
        key: RequestKey,
    },
    /// The host wrote the request's END or ERR: it is done here (its state is gone).
    Ended {
        /// The request.
        key: RequestKey,
    },
    /// The next frame of the answer to a peer request this host made, in order.
    PeerAnswer {
        /// The peer request's id.
        rid: MessageId,
        /// The frame.
        frame: Frame,
    },
}

/// How the switch broke the protocol (close the connection).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HostError {
    /// The handshake failed.
    #[error("handshake: {0}")]
    Handshake(#[from] HandshakeError),
    /// A request's flow was broken.
    #[error("request {0:?}: {1}")]
    Flow(MessageId, ReadError),
    /// More concurrent requests than [`SWITCH_SERVED_REQUESTS_MAX`].
    #[error("too many concurrent requests")]
    TooManyRequests,
    /// A frame the switch may not send now.
    #[error("unexpected {0} frame")]
    Unexpected(&'static str),
    /// The switch stopped reading: the frames queued for it reached
    /// [`crate::limits::SWITCH_HOST_WRITER_FRAMES_MAX`].
    #[error("the switch stopped reading")]
    Backlogged,
    /// A REQ with the key of a request that is live here.
    #[error("a REQ repeats the key of live request {0:?}")]
    RepeatedKey(MessageId),
    /// No POLICY within [`HostConfig::handshake_timeout`].
    #[error("no POLICY within the handshake timeout")]
    HandshakeTimeout,
    /// Nothing heard from a switch that heartbeats for [`HostConfig::silence_timeout`].
    #[error("the switch went silent")]
    Silent,
}

/// Why a write by the application was refused (nothing changed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HostWriteError {
    /// No such live request.
    #[error("no live request with this key")]
    NotLive,
    /// The handshake is not done.
    #[error("not connected yet")]
    NotReady,
    /// Credit or flow state refused it.
    #[error(transparent)]
    Flow(#[from] WriteError),
}

/// The caps of `caps` that parse, beside their indices.
fn parse_caps(caps: &[String]) -> (Vec<usize>, Vec<CapUrn>) {
    caps.iter()
        .enumerate()
        .filter_map(|(index, text)| Some((index, CapUrn::parse(text).ok()?)))
        .unzip()
}

/// Host settings.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Its name in the manifest.
    pub name: String,
    /// The caps it serves (the identity cap is added).
    pub caps: Vec<String>,
    /// The limits it proposes.
    pub limits: Limits,
    /// Eight bytes that make this host's peer request ids unique (e.g. random per process).
    pub rid_prefix: [u8; 8],
    /// The switch's POLICY must come within this of the machine's start
    /// ([`SWITCH_HANDSHAKE_TIMEOUT_MS`]).
    pub handshake_timeout: Duration,
    /// Once the switch has sent a HEARTBEAT, the connection is given up after this long
    /// without a frame from it (default: a heartbeat interval and its echo budget,
    /// [`SWITCH_HEARTBEAT_INTERVAL_MS`] + [`SWITCH_HEARTBEAT_TIMEOUT_MS`]: a switch that
    /// heartbeats does so within it); `None` for never. A switch that never heartbeats (as
    /// capdag's does not) is not held to it.
    pub silence_timeout: Option<Duration>,
}

impl HostConfig {
    /// Default limits and timeouts for a host `name` serving `caps`.
    pub fn new(name: &str, caps: Vec<String>, rid_prefix: [u8; 8]) -> Self {
        Self {
            name: name.to_owned(),
            caps,
            limits: Limits::default(),
            rid_prefix,
            handshake_timeout: Duration::from_millis(SWITCH_HANDSHAKE_TIMEOUT_MS),
            silence_timeout: Some(Duration::from_millis(
                SWITCH_HEARTBEAT_INTERVAL_MS + SWITCH_HEARTBEAT_TIMEOUT_MS,
            )),
        }
    }
}

/// What a [`Host`] has counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostStats {
    /// Requests reported ([`HostEvent::Request`]).
    pub requests: u64,
    /// Requests that ended here ([`HostEvent::Ended`]).
    pub ended: u64,
    /// Requests the switch cancelled ([`HostEvent::Cancelled`]).
    pub cancelled: u64,
    /// Requests ended with `HANDLER_GONE` because the application stopped serving them
    /// ([`Host::abandon`]; also counted in `ended`).
    pub abandoned: u64,
    /// REQs refused for repeating a live key ([`HostError::RepeatedKey`]).
    pub repeated_keys: u64,
    /// Connections given up on a timer ([`HostError::HandshakeTimeout`], [`HostError::Silent`]).
    pub timeouts: u64,
    /// LOG frames dropped because their readers had not read as many LOG bytes as the bounds
    /// allow ([`crate::limits::SWITCH_LOG_UNREAD_BYTES_PER_REQUEST_MAX`],
    /// [`crate::limits::SWITCH_HOST_LOG_UNREAD_BYTES_MAX`]).
    pub logs_dropped: u64,
}

#[derive(Debug)]
enum Stage {
    AwaitPolicy,
    Live(Limits),
}

/// An identity request's key: its id and XID (none for the connect-time check).
type IdentityKey = (MessageId, Option<MessageId>);

#[derive(Debug)]
struct Identity {
    side: RequestSide,
    echo: Vec<u8>,
}

/// The master side of one switch connection.
#[derive(Debug)]
pub struct Host {
    config: HostConfig,
    /// The caps of `config` that parse, parsed once, beside their index in `config.caps`.
    parsed: (Vec<usize>, Vec<CapUrn>),
    stage: Stage,
    served: BTreeMap<RequestKey, RequestSide>,
    identity: BTreeMap<IdentityKey, Identity>,
    calls: BTreeMap<MessageId, RequestSide>,
    next_call: u64,
    transmits: VecDeque<Frame>,
    events: VecDeque<HostEvent>,
    /// Why the connection is over, until [`Host::poll_failure`] takes it.
    failure: Option<HostError>,
    /// The POLICY must come before this.
    policy_by: Time,
    /// When the switch was last heard from.
    last_heard: Time,
    /// Whether the switch has sent a HEARTBEAT (and so is held to the silence timeout).
    switch_heartbeats: bool,
    /// The switch's policy, once told.
    policy: Option<NetworkPolicy>,
    /// Bytes of early flow frames held over every request's side.
    held_total: usize,
    /// Bytes of LOG frames handed to readers and not read yet, over every request.
    log_unread_total: usize,
    stats: HostStats,
}

impl Host {
    /// A host that has queued its RELAY_NOTIFY and waits for the switch's POLICY, from `now`.
    pub fn new(config: HostConfig, now: Time) -> Self {
        let mut host = Self {
            parsed: parse_caps(&config.caps),
            policy_by: now.saturating_add(config.handshake_timeout),
            last_heard: now,
            switch_heartbeats: false,
            policy: None,
            held_total: 0,
            log_unread_total: 0,
            stats: HostStats::default(),
            config,
            stage: Stage::AwaitPolicy,
            served: BTreeMap::new(),
            identity: BTreeMap::new(),
            calls: BTreeMap::new(),
            next_call: 0,
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            failure: None,
        };
        host.transmits.push_back(host.notify());
        host
    }

    /// The RELAY_NOTIFY advertising this host's limits and caps.
    fn notify(&self) -> Frame {
        RelayNotify {
            limits: self.config.limits,
            manifest: Bytes::from(self.manifest()),
        }
        .to_frame()
    }

    /// The switch's policy, once it told it.
    pub fn policy(&self) -> Option<NetworkPolicy> {
        self.policy
    }

    /// A frame from the switch. A frame no honest switch sends ends the connection: the error
    /// is the output [`Host::poll_failure`].
    pub fn handle_frame(&mut self, now: Time, frame: Frame) {
        if let Err(error) = self.on_frame(now, frame) {
            self.fail(error);
        }
    }

    /// The connection is over, with `error` (the first one is kept until polled).
    fn fail(&mut self, error: HostError) {
        self.failure.get_or_insert(error);
    }

    fn on_frame(&mut self, now: Time, frame: Frame) -> Result<(), HostError> {
        self.last_heard = now;
        let limits = match self.stage {
            Stage::AwaitPolicy => return self.on_first_policy(&frame),
            Stage::Live(limits) => limits,
        };
        match frame.frame_type {
            FrameType::Hello | FrameType::RelayNotify => {
                Err(HostError::Unexpected(frame.frame_type.name()))
            }
            FrameType::Heartbeat => {
                self.switch_heartbeats = true;
                // Echoed by its id alone: whatever else the switch put in it is not sent back
                // (a heartbeat is no way to make this host write bytes of the switch's choice).
                self.transmits
                    .push_back(Frame::new(FrameType::Heartbeat, frame.id));
                Ok(())
            }
            FrameType::Policy => {
                let policy = NetworkPolicy::from_meta(frame.meta.as_ref())
                    .ok_or(HostError::Unexpected("POLICY without a network"))?;
                self.policy = Some(policy);
                self.events.push_back(HostEvent::Policy(policy));
                Ok(())
            }
            // Opaque state from the switch (capdag never sends it): nothing to act on.
            FrameType::RelayState => Ok(()),
            FrameType::Req => self.on_request(limits, frame),
            _ => self.on_request_frame(frame),
        }
    }

    /// Writes a frame of served request `key` (STREAM_START, CHUNK, STREAM_END, LOG, END,
    /// ERR): numbered and credit-gated. After END or ERR the request is done here.
    pub fn write(&mut self, key: RequestKey, mut frame: Frame) -> Result<(), HostWriteError> {
        let side = self.served.get_mut(&key).ok_or(HostWriteError::NotLive)?;
        side.write(&mut frame)?;
        let ended = side.wrote_end();
        self.transmits.push_back(frame);
        if ended {
            self.drop_served(&key);
            self.stats.ended += 1;
            self.events.push_back(HostEvent::Ended { key });
        }
        Ok(())
    }

    /// The application stopped serving request `key` without ending it (its handler returned
    /// or panicked): when it is still live here, an ERR (`HANDLER_GONE`) ends it, so that the
    /// switch and the requester are not left waiting and nothing of it is kept.
    pub fn abandon(&mut self, key: RequestKey) {
        let Some(mut side) = self.drop_served(&key) else {
            return;
        };
        let mut err = side.frame(FrameType::Err);
        err.meta = Some(error_meta(
            "HANDLER_GONE",
            ErrorClass::Internal,
            "the handler ended without answering",
        ));
        if side.write(&mut err).is_ok() {
            self.transmits.push_back(err);
        }
        self.stats.ended += 1;
        self.stats.abandoned += 1;
        self.events.push_back(HostEvent::Ended { key });
    }

    /// Whether a CHUNK on `stream` of request `key` could be written now.
    pub fn has_credit(&self, key: RequestKey, stream: Option<&str>) -> bool {
        self.served
            .get(&key)
            .is_some_and(|side| side.has_credit(stream))
    }

    /// The application read `bytes` of request `key`'s LOG frames (as
    /// [`Frame::held_bytes`] counts them): that much room for LOG frames comes back.
    pub fn consume_log(&mut self, key: RequestKey, bytes: usize) {
        if let Some(side) = self.served.get_mut(&key) {
            self.log_unread_total -= side.log_read(bytes);
        }
    }

    /// [`Host::consume_log`] of peer request `rid`'s answer.
    pub fn peer_consume_log(&mut self, rid: MessageId, bytes: usize) {
        if let Some(side) = self.calls.get_mut(&rid) {
            self.log_unread_total -= side.log_read(bytes);
        }
    }

    /// The application processed one input CHUNK of `stream`: CREDIT goes back in batches.
    pub fn consume(&mut self, key: RequestKey, stream: Option<&str>) {
        if let Some(credit) = self.served.get_mut(&key).and_then(|s| s.consume(stream)) {
            self.transmits.push_back(credit);
        }
    }

    /// Starts a peer request for `cap` (on behalf of served request `parent`, so that
    /// cancelling the parent cancels it): returns its id; write its input with
    /// [`Host::peer_write`].
    pub fn peer_request(
        &mut self,
        cap: &str,
        parent: Option<MessageId>,
    ) -> Result<MessageId, HostWriteError> {
        let Stage::Live(limits) = self.stage else {
            return Err(HostWriteError::NotReady);
        };
        self.next_call += 1;
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&self.config.rid_prefix);
        id[8..].copy_from_slice(&self.next_call.to_be_bytes());
        let rid = MessageId::Uuid(id);
        let mut side = RequestSide::new(
            rid,
            None,
            Credits::new(limits.initial_credit),
            limits.max_reorder_buffer,
        )
        .accepting_unnumbered();
        let mut req = side.frame(FrameType::Req);
        req.cap = Some(cap.to_owned());
        req.meta = parent.map(super::parent_meta);
        side.write(&mut req)?;
        self.transmits.push_back(req);
        self.calls.insert(rid, side);
        Ok(rid)
    }

    /// Writes an input frame of peer request `rid`.
    pub fn peer_write(&mut self, rid: MessageId, mut frame: Frame) -> Result<(), HostWriteError> {
        let side = self.calls.get_mut(&rid).ok_or(HostWriteError::NotLive)?;
        side.write(&mut frame)?;
        self.transmits.push_back(frame);
        Ok(())
    }

    /// The application processed one answer CHUNK of peer request `rid`.
    pub fn peer_consume(&mut self, rid: MessageId, stream: Option<&str>) {
        if let Some(credit) = self.calls.get_mut(&rid).and_then(|s| s.consume(stream)) {
            self.transmits.push_back(credit);
        }
    }

    /// Cancels peer request `rid` (CANCEL to the switch; its state here is dropped).
    pub fn peer_cancel(&mut self, rid: MessageId) {
        if self.drop_call(&rid).is_some() {
            self.transmits.push_back(Frame::new(FrameType::Cancel, rid));
        }
    }

    /// Advertises a new cap list (a RELAY_NOTIFY with the manifest and limits).
    pub fn set_caps(&mut self, caps: Vec<String>) {
        self.parsed = parse_caps(&caps);
        self.config.caps = caps;
        let notify = self.notify();
        self.transmits.push_back(notify);
    }

    /// The shell could not queue a frame for the switch: its queue
    /// ([`crate::limits::SWITCH_HOST_WRITER_FRAMES_MAX`]) is full because the switch stopped
    /// reading. The connection is useless: close it (every request served here ends with it;
    /// [`Host::poll_failure`] says [`HostError::Backlogged`]).
    pub fn handle_backlogged(&mut self, _now: Time) {
        self.give_up();
        self.fail(HostError::Backlogged);
    }

    /// When [`Host::handle_timeout`] is next due: the POLICY's deadline, then the silence
    /// deadline (none when [`HostConfig::silence_timeout`] is `None` or the switch has never
    /// sent a HEARTBEAT).
    pub fn poll_timeout(&self) -> Option<Time> {
        match self.stage {
            Stage::AwaitPolicy => Some(self.policy_by),
            Stage::Live(_) => self
                .config
                .silence_timeout
                .filter(|_| self.switch_heartbeats)
                .map(|silence| self.last_heard.saturating_add(silence)),
        }
    }

    /// Time passed: when the POLICY is overdue or the switch went silent the connection is
    /// over (every request served here ends with it; [`Host::poll_failure`] says why). A
    /// spurious call does nothing.
    pub fn handle_timeout(&mut self, now: Time) {
        if let Err(error) = self.timed_out(now) {
            self.fail(error);
        }
    }

    fn timed_out(&mut self, now: Time) -> Result<(), HostError> {
        let error = match self.stage {
            Stage::AwaitPolicy if now >= self.policy_by => HostError::HandshakeTimeout,
            Stage::Live(_)
                if self.switch_heartbeats
                    && self
                        .config
                        .silence_timeout
                        .is_some_and(|silence| now >= self.last_heard.saturating_add(silence)) =>
            {
                HostError::Silent
            }
            _ => return Ok(()),
        };
        self.stats.timeouts += 1;
        self.give_up();
        Err(error)
    }

    /// What the machine has counted.
    pub fn stats(&self) -> HostStats {
        self.stats
    }

    /// The connection is over: nothing of it is kept.
    fn give_up(&mut self) {
        self.served.clear();
        self.identity.clear();
        self.calls.clear();
        self.held_total = 0;
        self.log_unread_total = 0;
        self.transmits.clear();
    }

    /// The next frame to write to the switch.
    pub fn poll_transmit(&mut self) -> Option<Frame> {
        self.transmits.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<HostEvent> {
        self.events.pop_front()
    }

    /// Why the connection is over, once an input ended it: close it (the shell drops it and
    /// reports the error). Poll it after every input.
    pub fn poll_failure(&mut self) -> Option<HostError> {
        self.failure.take()
    }

    /// Requests being served.
    pub fn served_len(&self) -> usize {
        self.served.len()
    }

    /// Peer requests waiting for their answer.
    pub fn calls_len(&self) -> usize {
        self.calls.len()
    }

    fn manifest(&self) -> Vec<u8> {
        let mut caps = self.config.caps.clone();
        caps.push(CAP_IDENTITY.to_owned());
        manifest_json(&self.config.name, &caps)
    }

    /// The switch's first frame, which must be its POLICY: the host is live.
    fn on_first_policy(&mut self, frame: &Frame) -> Result<(), HostError> {
        if frame.frame_type != FrameType::Policy {
            return Err(HandshakeError::Malformed("the first frame must be POLICY").into());
        }
        let policy = NetworkPolicy::from_meta(frame.meta.as_ref())
            .ok_or(HandshakeError::Malformed("POLICY without a network"))?;
        let limits = self.config.limits;
        self.stage = Stage::Live(limits);
        self.policy = Some(policy);
        self.events.push_back(HostEvent::Ready { limits });
        self.events.push_back(HostEvent::Policy(policy));
        Ok(())
    }

    /// A REQ: the identity check (with an XID or, at connect, without), or a routed request
    /// for one of this host's caps (which always carries the switch's XID).
    fn on_request(&mut self, limits: Limits, frame: Frame) -> Result<(), HostError> {
        let cap = frame.cap.clone().unwrap_or_default();
        let identity = cap == CAP_IDENTITY;
        if frame.routing_id.is_none() && !identity {
            return Err(HostError::Unexpected("REQ without an XID"));
        }
        let id_key = (frame.id, frame.routing_id);
        let key = frame
            .routing_id
            .map(|xid| RequestKey { xid, rid: frame.id });
        if self.identity.contains_key(&id_key)
            || key.is_some_and(|key| self.served.contains_key(&key))
        {
            self.stats.repeated_keys += 1;
            return Err(HostError::RepeatedKey(frame.id));
        }
        if self.served.len() + self.identity.len() >= SWITCH_SERVED_REQUESTS_MAX {
            return Err(HostError::TooManyRequests);
        }
        let mut side = RequestSide::new(
            frame.id,
            frame.routing_id,
            Credits::new(limits.initial_credit),
            limits.max_reorder_buffer,
        )
        .with_role(Role::Handler)
        .accepting_unnumbered();
        let meta = frame.meta.clone();
        let mut delivered = delivered();
        side.read(frame, |frame| delivered.push(frame))
            .map_err(|error| HostError::Flow(id_key.0, error))?;
        if identity {
            self.identity.insert(
                id_key,
                Identity {
                    side,
                    echo: Vec::new(),
                },
            );
            return Ok(());
        }
        let key = key.expect("checked: a routed request has an XID");
        let Some(serves) = self.best_cap(&cap) else {
            let mut err = side.frame(FrameType::Err);
            err.meta = Some(error_meta(
                "NO_HANDLER",
                ErrorClass::Input,
                "no handler on this host",
            ));
            if side.write(&mut err).is_ok() {
                self.transmits.push_back(err);
            }
            return Ok(());
        };
        self.served.insert(key, side);
        self.stats.requests += 1;
        self.events.push_back(HostEvent::Request {
            key,
            cap,
            serves,
            meta,
        });
        Ok(())
    }

    /// The index in [`HostConfig::caps`] of the cap that serves a request for `cap` best.
    fn best_cap(&self, cap: &str) -> Option<usize> {
        let request = CapUrn::parse(cap).ok()?;
        let (indices, caps) = &self.parsed;
        crate::cap::rank(&request, caps, None)
            .first()
            .map(|best| indices[*best])
    }

    fn on_request_frame(&mut self, frame: Frame) -> Result<(), HostError> {
        let rid = frame.id;
        let id_key = (rid, frame.routing_id);
        if self.identity.contains_key(&id_key) {
            return self.on_identity_frame(id_key, frame);
        }
        if let Some(xid) = frame.routing_id {
            let key = RequestKey { xid, rid };
            match frame.frame_type {
                FrameType::Cancel => {
                    if self.drop_served(&key).is_some() {
                        self.stats.cancelled += 1;
                        let force_kill = frame.force_kill.unwrap_or(true);
                        self.events
                            .push_back(HostEvent::Cancelled { key, force_kill });
                    } else if self.drop_call(&rid).is_some() {
                        // The switch cancelled our peer request (its destination died, or the
                        // parent was cancelled).
                        let mut err = Frame::new(FrameType::Err, rid);
                        err.meta = frame.meta;
                        self.events
                            .push_back(HostEvent::PeerAnswer { rid, frame: err });
                    }
                    return Ok(());
                }
                FrameType::CloseStream => {
                    if self.served.contains_key(&key) {
                        self.events.push_back(HostEvent::CloseStream { key });
                    }
                    return Ok(());
                }
                _ => {}
            }
            if let Some(side) = self.served.get_mut(&key) {
                let mut delivered = delivered();
                let before = side.held_bytes();
                side.read(frame, |frame| delivered.push(frame))
                    .map_err(|error| HostError::Flow(rid, error))?;
                let after = side.held_bytes();
                let passed = pass_logs(
                    side,
                    delivered,
                    &mut self.log_unread_total,
                    &mut self.stats.logs_dropped,
                );
                self.account_held(rid, before, after)?;
                self.events.extend(
                    passed
                        .into_iter()
                        .map(|frame| HostEvent::Input { key, frame }),
                );
                return Ok(());
            }
        }
        // An answer to one of this host's peer requests (with an XID once routed, without one
        // when the switch refused it at once).
        if let Some(side) = self.calls.get_mut(&rid) {
            let mut delivered = delivered();
            let before = side.held_bytes();
            side.read(frame, |frame| delivered.push(frame))
                .map_err(|error| HostError::Flow(rid, error))?;
            let (ended, after) = (side.read_end(), side.held_bytes());
            let passed = pass_logs(
                side,
                delivered,
                &mut self.log_unread_total,
                &mut self.stats.logs_dropped,
            );
            self.account_held(rid, before, after)?;
            self.events.extend(
                passed
                    .into_iter()
                    .map(|frame| HostEvent::PeerAnswer { rid, frame }),
            );
            if ended {
                self.drop_call(&rid);
            }
        }
        // Anything else is a straggler for a request that ended here.
        Ok(())
    }

    /// A read on request `rid`'s side moved its early frames held from `before` to `after`
    /// bytes: past [`SWITCH_HOST_REORDER_HELD_BYTES_MAX`] over every request, the switch broke
    /// the protocol (an honest one never sends a frame early).
    fn account_held(
        &mut self,
        rid: MessageId,
        before: usize,
        after: usize,
    ) -> Result<(), HostError> {
        self.held_total = self.held_total - before + after;
        if self.held_total > SWITCH_HOST_REORDER_HELD_BYTES_MAX {
            return Err(HostError::Flow(
                rid,
                ReadError::Reorder(RefusalKind::Overflow),
            ));
        }
        Ok(())
    }

    /// Removes a served request's side, and what it held from the host's total.
    fn drop_served(&mut self, key: &RequestKey) -> Option<RequestSide> {
        let side = self.served.remove(key)?;
        self.held_total -= side.held_bytes();
        self.log_unread_total -= side.log_unread();
        Some(side)
    }

    /// Removes a peer request's side, and what it held from the host's total.
    fn drop_call(&mut self, rid: &MessageId) -> Option<RequestSide> {
        let side = self.calls.remove(rid)?;
        self.held_total -= side.held_bytes();
        self.log_unread_total -= side.log_unread();
        Some(side)
    }

    /// The identity check: gather the nonce, echo it back once the request ends.
    fn on_identity_frame(&mut self, key: IdentityKey, frame: Frame) -> Result<(), HostError> {
        let identity = self.identity.get_mut(&key).expect("checked by the caller");
        let mut delivered = delivered();
        let before = identity.side.held_bytes();
        identity
            .side
            .read(frame, |frame| delivered.push(frame))
            .map_err(|error| HostError::Flow(key.0, error))?;
        let after = identity.side.held_bytes();
        self.account_held(key.0, before, after)?;
        let identity = self.identity.get_mut(&key).expect("checked by the caller");
        for frame in delivered {
            match frame.frame_type {
                FrameType::Chunk => {
                    let payload = frame.payload.unwrap_or_default();
                    if identity.echo.len() + payload.len() <= SWITCH_IDENTITY_ECHO_BYTES_MAX {
                        identity.echo.extend_from_slice(&payload);
                    }
                    identity.side.consume(frame.stream_id.as_deref());
                }
                FrameType::End => {
                    let mut identity = self.identity.remove(&key).expect("present");
                    self.held_total -= identity.side.held_bytes();
                    let echo = Bytes::from(std::mem::take(&mut identity.echo));
                    for mut reply in echo_frames(&identity.side, echo) {
                        match identity.side.write(&mut reply) {
                            Ok(()) => self.transmits.push_back(reply),
                            Err(_) => {
                                let mut err = identity.side.frame(FrameType::Err);
                                err.meta = Some(error_meta(
                                    "IDENTITY",
                                    ErrorClass::Internal,
                                    "echo refused",
                                ));
                                let _ = identity.side.write(&mut err);
                                self.transmits.push_back(err);
                                break;
                            }
                        }
                    }
                    return Ok(());
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// The echo, as capdag's in-process host answers (docs/spec/capdag-v6.md §11.3): the payload
/// bytes back unchanged on stream `identity`, then END with `exit_code` 0.
fn echo_frames(side: &RequestSide, echo: Bytes) -> [Frame; 4] {
    let mut start = side.frame(FrameType::StreamStart);
    start.stream_id = Some(IDENTITY_ECHO_STREAM.to_owned());
    start.media_urn = Some("media:".to_owned());
    let mut chunk = side.frame(FrameType::Chunk);
    chunk.stream_id = Some(IDENTITY_ECHO_STREAM.to_owned());
    chunk.chunk_index = Some(0);
    chunk.payload = Some(echo);
    let mut end_stream = side.frame(FrameType::StreamEnd);
    end_stream.stream_id = Some(IDENTITY_ECHO_STREAM.to_owned());
    end_stream.chunk_count = Some(1);
    let mut end = side.frame(FrameType::End);
    end.eof = Some(true);
    end.meta = Some(super::end_ok_meta());
    [start, chunk, end_stream, end]
}

#[cfg(test)]
mod tests;
