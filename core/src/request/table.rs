//! The request table (docs/spec/switch.md §6; docs/conformance/README.md#table).
//!
//! Every per-request fact lives in one entry keyed by (XID, RID): caller data (routing, origin,
//! response channel), phase, times, per-stream flow stats and cancel-cascade children, plus a
//! RID → XID index for continuation frames that carry only a RID.
//!
//! Laws (replayed against the model in `tether-formal-replay`):
//! - a request is registered once: a RID live under any XID is refused;
//! - a request is terminated once, and termination removes every trace of it at once, handing
//!   the state back so the caller forwards the terminal with exactly that state;
//! - a frame with no routing state is classified by [`RequestTable::account_unrouted`] (the one
//!   accounting function): a straggler when its RID ended within the ring's horizon (benign,
//!   counted per frame type), otherwise a `no_route` drop (counted per site).

use std::collections::{BTreeMap, VecDeque};
use std::num::NonZeroUsize;
use std::time::Duration;

use serde::Serialize;

use crate::limits::{
    CHILDREN_PER_REQUEST_COUNT_MAX, LIVE_REQUESTS_COUNT_DEFAULT, STREAMS_PER_REQUEST_COUNT_MAX,
    STREAM_ID_BYTES_MAX, TERMINATED_RING_COUNT_CEILING, TERMINATED_RING_COUNT_DEFAULT,
    TERMINATION_MESSAGE_BYTES_MAX,
};
use crate::time::Time;
use crate::wire::bifaci::{FrameType, MessageId};

use super::{dispose, is_flow, ledger, Credits, Disposition};

/// A request's key: its routing id (XID, assigned by the switch) and request id (RID).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct RequestKey {
    /// Routing id.
    pub xid: MessageId,
    /// Request id.
    pub rid: MessageId,
}

/// Table settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestTableConfig {
    /// Terminations remembered in the ring (the straggler horizon). At least 1, at most
    /// [`TERMINATED_RING_COUNT_CEILING`].
    pub ring_capacity: NonZeroUsize,
    /// Most live requests; registration beyond it is refused with [`RegisterError::TableFull`].
    pub live_max: usize,
}

impl Default for RequestTableConfig {
    fn default() -> Self {
        Self {
            ring_capacity: NonZeroUsize::new(TERMINATED_RING_COUNT_DEFAULT)
                .expect("the default ring capacity is a positive constant"),
            live_max: LIVE_REQUESTS_COUNT_DEFAULT,
        }
    }
}

/// Why [`RequestTable::register`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// The RID is live already (under this XID or another): a protocol violation.
    #[error("request id is already live")]
    RidLive {
        /// The key it is live under.
        existing: RequestKey,
    },
    /// The table holds its `live_max` requests.
    #[error("request table is full")]
    TableFull,
}

/// The cancel codes (docs/spec/switch.md §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum CancelCode {
    /// An operator cancel (class `user`), the default.
    Cancelled,
    /// Cancelled because something else failed; carries that failure's class.
    AbortedCollateral,
    /// A host decision.
    Aborted,
}

/// Error classes (docs/spec/switch.md §8): `input` is permanent; the others are retryable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// The operator asked (the class of a plain cancel).
    User,
    /// Bad input: permanent.
    Input,
    /// A resource ran out.
    Resource,
    /// The environment failed.
    Environment,
    /// A bug.
    Internal,
}

impl ErrorClass {
    /// Every class.
    pub const ALL: [ErrorClass; 5] = [
        Self::User,
        Self::Input,
        Self::Resource,
        Self::Environment,
        Self::Internal,
    ];

    /// The word on the wire (`meta.attribution_class`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::User => "user",
            Self::Input => "input",
            Self::Resource => "resource",
            Self::Environment => "environment",
            Self::Internal => "internal",
        }
    }

    /// The class a word names.
    pub fn parse(word: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|class| class.as_str() == word)
    }
}

/// The attribution a cancelled request carries: code, class and message.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct CancelReason {
    /// The terminal code.
    pub code: CancelCode,
    /// The failure class, `None` for an unattributed reason.
    pub class: Option<ErrorClass>,
    /// Why, in the canceller's words (cut to [`TERMINATION_MESSAGE_BYTES_MAX`] on the summary).
    pub message: String,
}

impl CancelReason {
    /// An operator cancel: `CANCELLED`, class `user`.
    pub fn operator(message: impl Into<String>) -> Self {
        Self {
            code: CancelCode::Cancelled,
            class: Some(ErrorClass::User),
            message: message.into(),
        }
    }
}

/// How a request ended, without attribution (the counters' view).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TerminationKind {
    /// END.
    End,
    /// ERR.
    Err,
    /// Its master died.
    MasterDied,
    /// Cancelled.
    Cancelled,
}

/// How a request ended, with a cancel's attribution.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Termination {
    /// END.
    End,
    /// ERR.
    Err,
    /// Its master died.
    MasterDied,
    /// Cancelled with this attribution.
    Cancelled(CancelReason),
}

impl Termination {
    /// The kind, without attribution.
    pub fn kind(&self) -> TerminationKind {
        match self {
            Termination::End => TerminationKind::End,
            Termination::Err => TerminationKind::Err,
            Termination::MasterDied => TerminationKind::MasterDied,
            Termination::Cancelled(_) => TerminationKind::Cancelled,
        }
    }
}

/// A request's phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Registered; no stream data yet.
    Created,
    /// A stream started or a chunk passed.
    Streaming,
}

/// Which way an observed frame travelled, seen from the table's owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Towards the owner (from the request's master or origin).
    In,
    /// Away from the owner.
    Out,
}

/// Flow statistics of one stream of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct StreamStats {
    /// Frames observed travelling in.
    pub frames_in: u64,
    /// Frames observed travelling out.
    pub frames_out: u64,
    /// Payload bytes in.
    pub bytes_in: u64,
    /// Payload bytes out.
    pub bytes_out: u64,
    /// CHUNKs in.
    pub chunks_in: u64,
    /// CHUNKs out.
    pub chunks_out: u64,
    /// The stream's diagnostic credit ledger (see [`super::ledger`]): seeded with the
    /// negotiated window, negative when the producer over-ran it.
    pub credit_outstanding: i64,
}

/// Flow totals of a request over all its streams (kept on its summary).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct FlowTotals {
    /// Frames observed, both ways.
    pub frames: u64,
    /// Payload bytes observed, both ways.
    pub bytes: u64,
    /// CHUNKs in.
    pub chunks_in: u64,
    /// CHUNKs out.
    pub chunks_out: u64,
}

/// One frame observed on a live request, for its flow stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observed<'a> {
    /// The frame's stream id (`None`: frames without one).
    pub stream: Option<&'a str>,
    /// The frame's type.
    pub frame_type: FrameType,
    /// Which way it travelled.
    pub direction: Direction,
    /// Its payload length.
    pub payload_bytes: u64,
    /// The credit a CREDIT frame carries (ignored for other types).
    pub granted: u64,
}

/// Everything the table keeps about a live request. Handed back whole on termination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestState<T> {
    /// The key.
    pub key: RequestKey,
    /// The caller's data (routing, origin, response channel, ...).
    pub data: T,
    /// Phase.
    pub phase: Phase,
    /// When it was registered.
    pub created_at: Time,
    /// When a frame of it was last observed (or it was registered).
    pub last_activity: Time,
    /// The negotiated per-stream window that seeds each stream's ledger.
    pub window: Credits,
    /// Per-stream flow stats, by stream id (`None`: frames without one).
    pub streams: BTreeMap<Option<String>, StreamStats>,
    /// Observations of streams beyond [`STREAMS_PER_REQUEST_COUNT_MAX`] (or with over-long
    /// ids), counted here instead of growing the map.
    pub untracked_observations: u64,
    /// Child requests cancelled with this one (peer calls made on its behalf). A child that
    /// ends leaves this list, so a later request under the same key is never cascaded.
    pub children: Vec<RequestKey>,
    /// The request this one was made on behalf of, if any.
    pub parent: Option<RequestKey>,
}

impl<T> RequestState<T> {
    fn totals(&self) -> FlowTotals {
        let mut totals = FlowTotals::default();
        for stats in self.streams.values() {
            totals.frames += stats.frames_in + stats.frames_out;
            totals.bytes += stats.bytes_in + stats.bytes_out;
            totals.chunks_in += stats.chunks_in;
            totals.chunks_out += stats.chunks_out;
        }
        totals
    }
}

/// What the ring remembers of one termination.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Summary {
    /// Routing id.
    pub xid: MessageId,
    /// Request id.
    pub rid: MessageId,
    /// How it ended, with cancel attribution.
    pub termination: Termination,
    /// When it was registered.
    pub created_at: Time,
    /// When it ended.
    pub ended_at: Time,
    /// `ended_at − created_at` in milliseconds.
    pub lifetime_ms: u64,
    /// Flow totals over its streams.
    pub totals: FlowTotals,
}

/// A terminated request: its whole state and the summary now in the ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Terminated<T> {
    /// Everything the table held for it.
    pub state: RequestState<T>,
    /// The summary pushed into the ring.
    pub summary: Summary,
}

/// The three sites where a frame can find no routing state (docs/spec/switch.md §6.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NoRouteSite {
    /// A second terminal for a released request.
    DuplicateTerminal,
    /// A response frame from a master.
    Response,
    /// A continuation frame towards a master.
    Continuation,
}

/// The table's counters.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Counters {
    /// Successful registrations.
    pub registered: u64,
    /// Registrations refused.
    pub register_refused: u64,
    /// Terminations by kind.
    pub terminated: BTreeMap<TerminationKind, u64>,
    /// Benign stragglers by frame type name.
    pub stragglers: BTreeMap<&'static str, u64>,
    /// `no_route` drops by site.
    pub no_route: BTreeMap<NoRouteSite, u64>,
}

/// One live request in a [`TableSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RequestSnapshot {
    /// The key.
    pub key: RequestKey,
    /// Phase.
    pub phase: Phase,
    /// Registration time.
    pub created_at: Time,
    /// Last activity.
    pub last_activity: Time,
    /// Per-stream stats, `null` naming the no-stream entry.
    pub streams: Vec<(Option<String>, StreamStats)>,
    /// Children keys.
    pub children: Vec<RequestKey>,
    /// Parent key.
    pub parent: Option<RequestKey>,
}

/// A serializable view of the whole table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TableSnapshot {
    /// Live requests sorted by RID.
    pub active: Vec<RequestSnapshot>,
    /// The ring, oldest first.
    pub recently_terminated: Vec<Summary>,
    /// Live requests.
    pub live: usize,
    /// Terminations ever.
    pub terminated_total: u64,
    /// Counters.
    pub counters: Counters,
}

/// The request table. `T` is the caller's per-request data.
#[derive(Debug, Clone)]
pub struct RequestTable<T> {
    config: RequestTableConfig,
    live: BTreeMap<RequestKey, RequestState<T>>,
    /// RID → XID of every live request.
    rid_index: BTreeMap<MessageId, MessageId>,
    ring: VecDeque<Summary>,
    /// How many ring entries each RID has (for O(log n) dispositions).
    ring_rids: BTreeMap<MessageId, u32>,
    counters: Counters,
}

impl<T> RequestTable<T> {
    /// An empty table.
    ///
    /// # Panics
    /// When `config.ring_capacity` exceeds [`TERMINATED_RING_COUNT_CEILING`] (a configuration
    /// bug).
    pub fn new(config: RequestTableConfig) -> Self {
        assert!(config.ring_capacity.get() <= TERMINATED_RING_COUNT_CEILING);
        Self {
            config,
            live: BTreeMap::new(),
            rid_index: BTreeMap::new(),
            ring: VecDeque::with_capacity(config.ring_capacity.get()),
            ring_rids: BTreeMap::new(),
            counters: Counters::default(),
        }
    }

    /// Registers `key` with the caller's `data` and the negotiated per-stream `window`.
    /// Refused when `key.rid` is live under any XID or the table is full; the ring is neither
    /// consulted nor changed, so a RID that ended may be registered again.
    pub fn register(
        &mut self,
        key: RequestKey,
        data: T,
        window: Credits,
        now: Time,
    ) -> Result<(), RegisterError> {
        if let Some(xid) = self.rid_index.get(&key.rid) {
            self.counters.register_refused += 1;
            return Err(RegisterError::RidLive {
                existing: RequestKey {
                    xid: *xid,
                    rid: key.rid,
                },
            });
        }
        if self.live.len() >= self.config.live_max {
            self.counters.register_refused += 1;
            return Err(RegisterError::TableFull);
        }
        let state = RequestState {
            key,
            data,
            phase: Phase::Created,
            created_at: now,
            last_activity: now,
            window,
            streams: BTreeMap::new(),
            untracked_observations: 0,
            children: Vec::new(),
            parent: None,
        };
        self.live.insert(key, state);
        self.rid_index.insert(key.rid, key.xid);
        self.counters.registered += 1;
        debug_assert_eq!(self.live.len(), self.rid_index.len());
        Ok(())
    }

    /// Terminates `key` as END, ERR or master death. `None` (nothing changes, nothing enters
    /// the ring) when `key` is not live: termination happens once.
    pub fn terminate(
        &mut self,
        key: RequestKey,
        kind: TerminationKind,
        now: Time,
    ) -> Option<Terminated<T>> {
        let termination = match kind {
            TerminationKind::End => Termination::End,
            TerminationKind::Err => Termination::Err,
            TerminationKind::MasterDied => Termination::MasterDied,
            TerminationKind::Cancelled => Termination::Cancelled(CancelReason {
                code: CancelCode::Cancelled,
                class: None,
                message: String::new(),
            }),
        };
        self.end(key, termination, now)
    }

    /// Terminates `key` as cancelled with `reason`'s attribution.
    pub fn terminate_cancelled(
        &mut self,
        key: RequestKey,
        mut reason: CancelReason,
        now: Time,
    ) -> Option<Terminated<T>> {
        truncate_on_char_boundary(&mut reason.message, TERMINATION_MESSAGE_BYTES_MAX);
        self.end(key, Termination::Cancelled(reason), now)
    }

    /// Cancels `key` and, depth first, every live descendant recorded with
    /// [`RequestTable::add_child`], all under the same reason. Returns the terminated
    /// requests, `key` first; empty when `key` is not live.
    pub fn cancel_cascade(
        &mut self,
        key: RequestKey,
        reason: &CancelReason,
        now: Time,
    ) -> Vec<Terminated<T>> {
        let mut ended = Vec::new();
        let mut stack = vec![key];
        while let Some(next) = stack.pop() {
            if let Some(terminated) = self.terminate_cancelled(next, reason.clone(), now) {
                stack.extend(terminated.state.children.iter().rev().copied());
                ended.push(terminated);
            }
        }
        ended
    }

    /// Records `child` as a peer request made on behalf of `parent`, cancelled with it. Both
    /// must be live and distinct, `child` must not have a parent yet, and `parent` must have
    /// fewer than [`CHILDREN_PER_REQUEST_COUNT_MAX`] children; otherwise returns `false` and
    /// records nothing.
    pub fn add_child(&mut self, parent: RequestKey, child: RequestKey) -> bool {
        let parent_has_room = self
            .live
            .get(&parent)
            .is_some_and(|state| state.children.len() < CHILDREN_PER_REQUEST_COUNT_MAX);
        let Some(child_state) = self.live.get_mut(&child) else {
            return false;
        };
        if parent == child || !parent_has_room || child_state.parent.is_some() {
            return false;
        }
        child_state.parent = Some(parent);
        let parent_state = self.live.get_mut(&parent).expect("checked live above");
        parent_state.children.push(child);
        true
    }

    /// The live request of `key`.
    pub fn get(&self, key: RequestKey) -> Option<&RequestState<T>> {
        self.live.get(&key)
    }

    /// The live request of `key`, mutably (for the caller's data).
    pub fn get_mut(&mut self, key: RequestKey) -> Option<&mut RequestState<T>> {
        self.live.get_mut(&key)
    }

    /// The key `rid` is live under (the RID → XID index).
    pub fn key_of(&self, rid: MessageId) -> Option<RequestKey> {
        self.rid_index
            .get(&rid)
            .map(|xid| RequestKey { xid: *xid, rid })
    }

    /// Where a frame for `rid` goes: route while live, straggler while it is in the ring,
    /// otherwise no route. Only the RID is consulted.
    pub fn disposition(&self, rid: MessageId) -> Disposition {
        dispose(
            self.rid_index.contains_key(&rid),
            self.recently_terminated(rid),
        )
    }

    /// Whether `rid` ended within the ring's horizon.
    pub fn recently_terminated(&self, rid: MessageId) -> bool {
        self.ring_rids.contains_key(&rid)
    }

    /// The summary of `rid`'s latest termination still in the ring.
    pub fn recent_terminal_of(&self, rid: MessageId) -> Option<&Summary> {
        if !self.recently_terminated(rid) {
            return None;
        }
        self.ring.iter().rev().find(|summary| summary.rid == rid)
    }

    /// Accounts one frame that found no routing state at `site`, and says what it was: a
    /// straggler (its RID ended lately: benign, counted per frame type) or a `no_route` drop
    /// (counted per site). The one place every unroutable frame is counted.
    pub fn account_unrouted(
        &mut self,
        rid: MessageId,
        frame_type: FrameType,
        site: NoRouteSite,
    ) -> Disposition {
        if self.recently_terminated(rid) {
            *self
                .counters
                .stragglers
                .entry(frame_type.name())
                .or_default() += 1;
            Disposition::Straggler
        } else {
            *self.counters.no_route.entry(site).or_default() += 1;
            Disposition::NoRoute
        }
    }

    /// Counts a frame of a live request that its sender wrote after its own terminal while
    /// that terminal is still held on its way (the switch holds a master's answer past its
    /// credit window): the straggler it would be had the terminal gone through at once.
    pub fn account_straggler(&mut self, frame_type: FrameType) {
        *self
            .counters
            .stragglers
            .entry(frame_type.name())
            .or_default() += 1;
    }

    /// Records one frame of a live request in its flow stats and ledger. Returns `false` when
    /// `key` is not live (the caller then accounts the frame with
    /// [`RequestTable::account_unrouted`]).
    pub fn observe(&mut self, key: RequestKey, frame: Observed<'_>, now: Time) -> bool {
        let Some(state) = self.live.get_mut(&key) else {
            return false;
        };
        state.last_activity = state.last_activity.max(now);
        if matches!(frame.frame_type, FrameType::Chunk | FrameType::StreamStart) {
            state.phase = Phase::Streaming;
        }
        let trackable = frame
            .stream
            .is_none_or(|id| id.len() <= STREAM_ID_BYTES_MAX);
        let stream = frame.stream.map(str::to_owned);
        let known = state.streams.contains_key(&stream);
        if !trackable || (!known && state.streams.len() >= STREAMS_PER_REQUEST_COUNT_MAX) {
            state.untracked_observations += 1;
            return true;
        }
        let window = i64::try_from(state.window.get()).unwrap_or(i64::MAX);
        let stats = state.streams.entry(stream).or_insert_with(|| StreamStats {
            credit_outstanding: window,
            ..StreamStats::default()
        });
        let chunk = u64::from(frame.frame_type == FrameType::Chunk);
        match frame.direction {
            Direction::In => {
                stats.frames_in += 1;
                stats.bytes_in = stats.bytes_in.saturating_add(frame.payload_bytes);
                stats.chunks_in += chunk;
            }
            Direction::Out => {
                stats.frames_out += 1;
                stats.bytes_out = stats.bytes_out.saturating_add(frame.payload_bytes);
                stats.chunks_out += chunk;
            }
        }
        stats.credit_outstanding =
            ledger(stats.credit_outstanding, frame.frame_type, frame.granted);
        debug_assert!(is_flow(frame.frame_type) || chunk == 0);
        true
    }

    /// Live requests.
    pub fn live_len(&self) -> usize {
        self.live.len()
    }

    /// Whether nothing is live.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Live keys, ascending.
    pub fn live_keys(&self) -> impl Iterator<Item = RequestKey> + '_ {
        self.live.keys().copied()
    }

    /// The ring, oldest first.
    pub fn ring(&self) -> impl Iterator<Item = &Summary> + '_ {
        self.ring.iter()
    }

    /// The counters.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Requests idle since before `now − idle`, by key (for a caller's idle sweep).
    pub fn idle_since(&self, now: Time, idle: Duration) -> Vec<RequestKey> {
        self.live
            .values()
            .filter(|state| now.saturating_since(state.last_activity) >= idle)
            .map(|state| state.key)
            .collect()
    }

    /// A serializable view: live requests sorted by RID, the ring, totals and counters.
    pub fn snapshot(&self) -> TableSnapshot {
        let mut active: Vec<RequestSnapshot> = self
            .live
            .values()
            .map(|state| RequestSnapshot {
                key: state.key,
                phase: state.phase,
                created_at: state.created_at,
                last_activity: state.last_activity,
                streams: state
                    .streams
                    .iter()
                    .map(|(id, stats)| (id.clone(), *stats))
                    .collect(),
                children: state.children.clone(),
                parent: state.parent,
            })
            .collect();
        active.sort_by_key(|request| (request.key.rid, request.key.xid));
        TableSnapshot {
            active,
            recently_terminated: self.ring.iter().cloned().collect(),
            live: self.live.len(),
            terminated_total: self.counters.terminated.values().sum(),
            counters: self.counters.clone(),
        }
    }

    fn end(
        &mut self,
        key: RequestKey,
        termination: Termination,
        now: Time,
    ) -> Option<Terminated<T>> {
        let state = self.live.remove(&key)?;
        if let Some(parent) = state.parent.and_then(|parent| self.live.get_mut(&parent)) {
            parent.children.retain(|child| *child != key);
        }
        let indexed = self.rid_index.remove(&key.rid);
        debug_assert_eq!(indexed, Some(key.xid), "the rid index names every live key");
        let summary = Summary {
            xid: key.xid,
            rid: key.rid,
            created_at: state.created_at,
            ended_at: now,
            lifetime_ms: now.saturating_since(state.created_at).as_millis() as u64,
            totals: state.totals(),
            termination,
        };
        *self
            .counters
            .terminated
            .entry(summary.termination.kind())
            .or_default() += 1;
        self.push_ring(summary.clone());
        debug_assert!(!self.live.contains_key(&key) && !self.rid_index.contains_key(&key.rid));
        Some(Terminated { state, summary })
    }

    fn push_ring(&mut self, summary: Summary) {
        *self.ring_rids.entry(summary.rid).or_default() += 1;
        self.ring.push_back(summary);
        if self.ring.len() > self.config.ring_capacity.get() {
            let evicted = self
                .ring
                .pop_front()
                .expect("the ring is over capacity, so not empty");
            match self.ring_rids.get_mut(&evicted.rid) {
                Some(count) if *count > 1 => *count -= 1,
                _ => {
                    self.ring_rids.remove(&evicted.rid);
                }
            }
        }
        debug_assert!(self.ring.len() <= self.config.ring_capacity.get());
    }
}

fn truncate_on_char_boundary(text: &mut String, max_bytes: usize) {
    if text.len() > max_bytes {
        let mut cut = max_bytes;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(xid: u64, rid: u64) -> RequestKey {
        RequestKey {
            xid: MessageId::Uint(xid),
            rid: MessageId::Uint(rid),
        }
    }

    fn table(keep: usize) -> RequestTable<()> {
        let ring_capacity = NonZeroUsize::new(keep).unwrap();
        RequestTable::new(RequestTableConfig {
            ring_capacity,
            ..RequestTableConfig::default()
        })
    }

    #[test]
    fn register_once_terminate_once_and_classify_late_frames() {
        let mut table = table(1);
        let now = Time::from_millis(5);
        table
            .register(key(1, 101), (), Credits::new(32), now)
            .unwrap();
        assert!(matches!(
            table.register(key(2, 101), (), Credits::new(32), now),
            Err(RegisterError::RidLive { .. })
        ));
        assert_eq!(table.disposition(MessageId::Uint(101)), Disposition::Route);
        let ended = table.terminate(key(1, 101), TerminationKind::End, Time::from_millis(9));
        assert_eq!(ended.unwrap().summary.lifetime_ms, 4);
        assert!(table
            .terminate(key(1, 101), TerminationKind::End, now)
            .is_none());
        assert_eq!(
            table.disposition(MessageId::Uint(101)),
            Disposition::Straggler
        );
        let site = NoRouteSite::Continuation;
        assert_eq!(
            table.account_unrouted(MessageId::Uint(101), FrameType::Chunk, site),
            Disposition::Straggler
        );
        table
            .register(key(1, 102), (), Credits::new(32), now)
            .unwrap();
        table
            .terminate(key(1, 102), TerminationKind::Err, now)
            .unwrap();
        assert_eq!(
            table.disposition(MessageId::Uint(101)),
            Disposition::NoRoute
        );
        assert_eq!(
            table.account_unrouted(MessageId::Uint(101), FrameType::Chunk, site),
            Disposition::NoRoute
        );
        assert_eq!(table.counters().stragglers.get("CHUNK"), Some(&1));
        assert_eq!(table.counters().no_route.get(&site), Some(&1));
        assert!(table.is_empty());
    }

    #[test]
    fn cancel_cascades_to_children_with_the_same_reason() {
        let mut table = table(8);
        let now = Time::ZERO;
        for rid in 1..=3 {
            table
                .register(key(1, rid), (), Credits::new(4), now)
                .unwrap();
        }
        assert!(table.add_child(key(1, 1), key(1, 2)));
        assert!(table.add_child(key(1, 2), key(1, 3)));
        let reason = CancelReason::operator("stop");
        let ended = table.cancel_cascade(key(1, 1), &reason, now);
        let rids: Vec<MessageId> = ended.iter().map(|t| t.summary.rid).collect();
        assert_eq!(
            rids,
            [MessageId::Uint(1), MessageId::Uint(2), MessageId::Uint(3)]
        );
        assert!(ended
            .iter()
            .all(|t| t.summary.termination == Termination::Cancelled(reason.clone())));
        assert!(table.is_empty());
    }

    #[test]
    fn observe_keeps_the_ledger_and_stats() {
        let mut table = table(1);
        table
            .register(key(1, 1), (), Credits::new(2), Time::ZERO)
            .unwrap();
        let chunk = Observed {
            stream: Some("in"),
            frame_type: FrameType::Chunk,
            direction: Direction::Out,
            payload_bytes: 10,
            granted: 0,
        };
        for _ in 0..3 {
            assert!(table.observe(key(1, 1), chunk, Time::from_millis(3)));
        }
        let credit = Observed {
            frame_type: FrameType::Credit,
            direction: Direction::In,
            granted: 2,
            payload_bytes: 0,
            ..chunk
        };
        assert!(table.observe(key(1, 1), credit, Time::from_millis(4)));
        let state = table.get(key(1, 1)).unwrap();
        let stats = state.streams[&Some("in".to_owned())];
        assert_eq!(
            (stats.chunks_out, stats.bytes_out, stats.credit_outstanding),
            (3, 30, 1)
        );
        assert_eq!(state.phase, Phase::Streaming);
        let snapshot = serde_json::to_string(&table.snapshot());
        assert!(snapshot.is_ok());
    }

    /// Operations on a table of small ids, including everything the conformance model does
    /// not cover: children, cascades, cancellations, observations, unroutable frames.
    #[derive(Debug, Clone)]
    enum Op {
        Register(u64, u64),
        Terminate(u64, u64, u8),
        Cancel(u64, u64),
        Child(u64, u64, u64, u64),
        Cascade(u64, u64),
        Observe(u64, u64, u8),
        Unrouted(u64, u8),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let id = || 0u64..4;
        prop_oneof![
            3 => (id(), id()).prop_map(|(x, r)| Op::Register(x, r)),
            2 => (id(), id(), 0u8..3).prop_map(|(x, r, k)| Op::Terminate(x, r, k)),
            1 => (id(), id()).prop_map(|(x, r)| Op::Cancel(x, r)),
            2 => (id(), id(), id(), id()).prop_map(|(a, b, c, d)| Op::Child(a, b, c, d)),
            1 => (id(), id()).prop_map(|(x, r)| Op::Cascade(x, r)),
            2 => (id(), id(), 0u8..15).prop_map(|(x, r, t)| Op::Observe(x, r, t)),
            1 => (id(), 0u8..15).prop_map(|(r, t)| Op::Unrouted(r, t)),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2_000))]

        #[test]
        fn every_request_ends_once_and_leaves_nothing_behind(
            keep in 1usize..6,
            ops in proptest::collection::vec(op(), 0..120),
        ) {
            let mut table: RequestTable<u64> = table_with(keep);
            let mut ended = 0u64;
            let mut unrouted = 0u64;
            for (step, op) in ops.into_iter().enumerate() {
                let now = Time::from_millis(step as u64);
                match op {
                    Op::Register(x, r) => {
                        let was_live = table.key_of(MessageId::Uint(r)).is_some();
                        let result = table.register(key(x, r), r, Credits::new(4), now);
                        assert_eq!(result.is_ok(), !was_live);
                    }
                    Op::Terminate(x, r, kind) => {
                        let kind = [TerminationKind::End, TerminationKind::Err, TerminationKind::MasterDied][usize::from(kind)];
                        if let Some(done) = table.terminate(key(x, r), kind, now) {
                            assert_eq!(done.state.key, key(x, r));
                            assert_eq!(done.state.data, r, "the caller's data comes back whole");
                            ended += 1;
                        }
                    }
                    Op::Cancel(x, r) => {
                        let reason = CancelReason::operator("x".repeat(2000));
                        if let Some(done) = table.terminate_cancelled(key(x, r), reason, now) {
                            let Termination::Cancelled(reason) = &done.summary.termination else {
                                panic!("a cancel ends as cancelled");
                            };
                            assert_eq!(reason.message.len(), TERMINATION_MESSAGE_BYTES_MAX);
                            ended += 1;
                        }
                    }
                    Op::Child(a, b, c, d) => {
                        let both = table.get(key(a, b)).is_some() && table.get(key(c, d)).is_some();
                        let added = table.add_child(key(a, b), key(c, d));
                        assert!(!added || both);
                    }
                    Op::Cascade(x, r) => {
                        let done = table.cancel_cascade(key(x, r), &CancelReason::operator("stop"), now);
                        let mut keys: Vec<RequestKey> = done.iter().map(|t| t.state.key).collect();
                        for terminated in &done {
                            assert!(table.get(terminated.state.key).is_none());
                            for child in &terminated.state.children {
                                assert!(table.get(*child).is_none(), "children end with the parent");
                            }
                        }
                        let before = keys.len();
                        keys.sort();
                        keys.dedup();
                        assert_eq!(before, keys.len(), "a cascade ends each request once");
                        ended += keys.len() as u64;
                    }
                    Op::Observe(x, r, code) => {
                        let Some(frame_type) = FrameType::from_code(u64::from(code)) else { continue };
                        let live = table.get(key(x, r)).is_some();
                        let observed = Observed { stream: Some("s"), frame_type, direction: Direction::In, payload_bytes: 3, granted: 1 };
                        assert_eq!(table.observe(key(x, r), observed, now), live);
                    }
                    Op::Unrouted(r, code) => {
                        let Some(frame_type) = FrameType::from_code(u64::from(code)) else { continue };
                        let expected = if table.recently_terminated(MessageId::Uint(r)) { Disposition::Straggler } else { Disposition::NoRoute };
                        assert_eq!(table.account_unrouted(MessageId::Uint(r), frame_type, NoRouteSite::Response), expected);
                        unrouted += 1;
                    }
                }
                // Zero state: every live key is indexed, nothing else is, and every recorded
                // child is live and names its parent.
                let live: Vec<RequestKey> = table.live_keys().collect();
                for k in &live {
                    assert_eq!(table.key_of(k.rid), Some(*k));
                    for child in &table.get(*k).unwrap().children {
                        assert_eq!(table.get(*child).map(|c| c.parent), Some(Some(*k)));
                    }
                }
                let counters = table.counters();
                assert_eq!(counters.registered, live.len() as u64 + ended);
                assert_eq!(counters.terminated.values().sum::<u64>(), ended);
                let accounted: u64 = counters.stragglers.values().sum::<u64>() + counters.no_route.values().sum::<u64>();
                assert_eq!(accounted, unrouted);
                assert!(table.ring().count() <= keep);
                let snapshot = table.snapshot();
                assert!(snapshot.active.windows(2).all(|w| w[0].key.rid <= w[1].key.rid));
                assert_eq!(snapshot.live, live.len());
            }
        }
    }

    fn table_with(keep: usize) -> RequestTable<u64> {
        let ring_capacity = NonZeroUsize::new(keep).unwrap();
        RequestTable::new(RequestTableConfig {
            ring_capacity,
            ..RequestTableConfig::default()
        })
    }
}
