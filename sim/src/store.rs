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
        let disk = self.disk.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(disk.peers.get(peer).cloned().unwrap_or_default())
    }

    fn commit(&self, peer: &PeerId, batches: &[PersistBatch]) -> Result<(), StoreError> {
        let mut disk = self.disk.lock().unwrap_or_else(PoisonError::into_inner);
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
                    disk.ever_received.insert(op.id.clone());
                }
            }
        }
        let state = disk.peers.entry(peer.clone()).or_default();
        for batch in batches {
            state.apply(batch);
        }
        Ok(())
    }

    fn peers(&self) -> Result<Vec<PeerId>, StoreError> {
        let disk = self.disk.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(disk.peers.keys().cloned().collect())
    }
}
