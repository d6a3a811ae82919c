//! [`SimStore`]: a disk that survives host crashes. A commit is atomic and durable when it
//! returns; anything the machine had not committed lives only in the host's memory and is
//! lost when turmoil crashes the host.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};

use tether::store::{Store, StoreError};
use tether_core::substrate::{DurableState, PeerId, PersistBatch, Record};

/// What a simulated disk holds, shared with the checkers.
#[derive(Debug, Default)]
pub struct Disk {
    /// Durable state per peer.
    pub peers: BTreeMap<PeerId, DurableState>,
    /// Every op id that was ever durably received here (held or delivered): a hop ack for an
    /// op id not in this set is an acknowledged-but-not-durable violation.
    pub ever_received: BTreeSet<String>,
    /// Commits so far.
    pub commits: u64,
    /// Sabotage: every N-th commit is reported durable but dropped.
    pub lies_every: Option<u64>,
    /// The disk fails every load and commit while set (a disk fault), then heals.
    pub failing: bool,
    /// Loads refused while failing.
    pub failed_loads: u64,
    /// Commits refused while failing.
    pub failed_commits: u64,
    /// Most ops of one object the host may hold for its app (its receive window); a commit
    /// past it is recorded in `bound_violations`.
    pub window_max: Option<u64>,
    /// Most un-acked ops one object's outbox may hold (`outbox_ops_max`, plus the open and
    /// the close, which are never refused for room); a commit past it is recorded too.
    pub outbox_max: Option<u64>,
    /// Objects seen over `window_max` (held plus unconsumed) or over `outbox_max`.
    pub bound_violations: Vec<String>,
}

/// A store over a shared [`Disk`].
#[derive(Debug, Clone, Default)]
pub struct SimStore {
    disk: Arc<Mutex<Disk>>,
}

impl SimStore {
    /// A store on `disk`.
    pub fn new(disk: Arc<Mutex<Disk>>) -> Self {
        Self { disk }
    }
}

impl Store for SimStore {
    fn load(&self, peer: &PeerId) -> Result<DurableState, StoreError> {
        let mut disk = self.disk.lock().unwrap_or_else(PoisonError::into_inner);
        if disk.failing {
            disk.failed_loads += 1;
            return Err(StoreError::Injected("simulated disk fault"));
        }
        Ok(disk.peers.get(peer).cloned().unwrap_or_default())
    }

    fn commit(&self, peer: &PeerId, batches: &[PersistBatch]) -> Result<(), StoreError> {
        let mut disk = self.disk.lock().unwrap_or_else(PoisonError::into_inner);
        if disk.failing {
            disk.failed_commits += 1;
            return Err(StoreError::Injected("simulated disk fault"));
        }
        disk.commits += 1;
        if disk
            .lies_every
            .is_some_and(|n| disk.commits.is_multiple_of(n))
        {
            return Ok(());
        }
        for batch in batches {
            for record in &batch.records {
                if let Record::Held(op) | Record::Inbox(op) = record {
                    disk.ever_received.insert(op.id.to_string());
                }
            }
        }
        let state = disk.peers.entry(peer.clone()).or_default();
        for batch in batches {
            state.apply(batch);
        }
        let (window_max, outbox_max) = (disk.window_max, disk.outbox_max);
        let state = disk.peers.get(peer).expect("inserted above");
        let mut over: Vec<String> = Vec::new();
        if let Some(max) = outbox_max {
            let mut depth: BTreeMap<&str, u64> = BTreeMap::new();
            for (obj, _) in state.outbox.keys() {
                *depth.entry(obj.as_str()).or_default() += 1;
            }
            over.extend(
                depth
                    .into_iter()
                    .filter(|(_, n)| *n > max)
                    .map(|(obj, n)| format!("{obj}'s outbox holds {n} ops, above {max}")),
            );
        }
        if let Some(max) = window_max {
            let mut held_for_app: BTreeMap<&str, u64> = BTreeMap::new();
            for (obj, _) in state.inbox.keys().chain(state.held.keys()) {
                *held_for_app.entry(obj.as_str()).or_default() += 1;
            }
            over.extend(
                held_for_app
                    .into_iter()
                    .filter(|(_, n)| *n > max)
                    .map(|(obj, n)| format!("{obj} holds {n} ops for its app, above W = {max}")),
            );
        }
        disk.bound_violations.extend(over);
        Ok(())
    }

    fn peers(&self) -> Result<Vec<PeerId>, StoreError> {
        let disk = self.disk.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(disk.peers.keys().cloned().collect())
    }
}
