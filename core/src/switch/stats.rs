//! [`Switch::protocol_stats`]: one serializable snapshot of the switch (docs/spec/switch.md
//! §10.2): live requests with phase, age, idle time, per-stream counters and children; the
//! terminated ring; registration and termination totals; stragglers and drops by reason;
//! per-master health, limits and the host stats each master advertised.

use std::collections::BTreeMap;

use serde::Serialize;

use super::{Limits, Peer, SlotId, Switch, SwitchCounters};
use crate::request::{Counters, Phase, RequestKey, StreamStats, Summary};
use crate::time::Time;

/// A whole snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SwitchStats {
    /// Whether routing has started.
    pub routing: bool,
    /// Live requests, by request id.
    pub requests: Vec<RequestView>,
    /// The most recent terminations, oldest first.
    pub recently_terminated: Vec<Summary>,
    /// The request table's totals: registrations, terminations by kind, stragglers by frame
    /// type, `no_route` drops by site.
    pub table: Counters,
    /// The switch's own counts: no handler, violations, cuts, policies, heartbeats.
    pub switch: SwitchCounters,
    /// Every master slot.
    pub masters: Vec<MasterHealth>,
}

/// One live request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RequestView {
    /// Its key.
    pub key: RequestKey,
    /// Who made it.
    pub origin: Peer,
    /// The master serving it.
    pub dest: SlotId,
    /// Created or streaming.
    pub phase: Phase,
    /// Milliseconds since it was registered.
    pub age_ms: u64,
    /// Milliseconds since its last frame.
    pub idle_ms: u64,
    /// Per-stream counters, `null` naming frames without a stream.
    pub streams: BTreeMap<String, StreamStats>,
    /// Peer requests cancelled with it.
    pub children: Vec<RequestKey>,
}

/// One master slot's health (docs/spec/switch.md §9.2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MasterHealth {
    /// The slot index.
    pub index: SlotId,
    /// Its caller-chosen id.
    pub id: String,
    /// Routable (verified and connected).
    pub healthy: bool,
    /// A connection is attached (healthy or still in its handshake).
    pub attached: bool,
    /// `detached`, `hello`, `identity` or `live`.
    pub stage: &'static str,
    /// Caps it advertises.
    pub cap_count: usize,
    /// Seconds since its connection was attached.
    pub connected_seconds: u64,
    /// Why it last failed.
    pub last_error: Option<String>,
    /// The negotiated limits.
    pub limits: Option<Limits>,
    /// The host stats it last advertised (JSON text, as sent).
    pub host_stats: Option<String>,
    /// Whether it has echoed a HEARTBEAT on this connection (from then on it is held to
    /// echoing each in time).
    pub answers_heartbeats: bool,
}

pub(super) fn snapshot(switch: &Switch, now: Time) -> SwitchStats {
    let mut requests: Vec<RequestView> = switch
        .table
        .live_keys()
        .filter_map(|key| switch.table.get(key))
        .map(|state| RequestView {
            key: state.key,
            origin: state.data.origin,
            dest: state.data.dest,
            phase: state.phase,
            age_ms: now.saturating_since(state.created_at).as_millis() as u64,
            idle_ms: now.saturating_since(state.last_activity).as_millis() as u64,
            streams: state
                .streams
                .iter()
                .map(|(id, stats)| (id.clone().unwrap_or_else(|| "null".to_owned()), *stats))
                .collect(),
            children: state.children.clone(),
        })
        .collect();
    requests.sort_by_key(|view| view.key.rid);
    let masters = switch
        .masters
        .iter()
        .enumerate()
        .map(|(index, master)| MasterHealth {
            index: SlotId(index as u32),
            id: master.id.clone(),
            healthy: master.routable(),
            attached: master.attached(),
            stage: master.stage.name(),
            cap_count: master.caps.len(),
            connected_seconds: if master.attached() {
                now.saturating_since(master.connected_at).as_secs()
            } else {
                0
            },
            last_error: master.last_error.clone(),
            limits: master.limits,
            host_stats: master.host_stats.clone(),
            answers_heartbeats: master.echoes_heartbeats,
        })
        .collect();
    SwitchStats {
        routing: switch.routing,
        requests,
        recently_terminated: switch.table.ring().cloned().collect(),
        table: switch.table.counters().clone(),
        switch: switch.counters.clone(),
        masters,
    }
}
