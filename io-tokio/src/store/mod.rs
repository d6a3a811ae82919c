//! Where the substrate's durable state lives: [`SqliteStore`] (one SQLite file, or tables in
//! the host's own database), [`LogStore`] (one append-only file: each body written to disk
//! once, the faster of the two), [`MemoryStore`] for tests and processes that accept losing
//! everything on restart.
//!
//! A store applies [`PersistBatch`]es exactly as [`DurableState::apply`] defines them. The
//! shell hands it every batch a machine emitted up to a commit point in one call to
//! [`Store::commit`] (group commit); the store makes them durable in one transaction and only
//! then does the shell report them persisted to the machine. A failure leaves no batch
//! partially applied.

mod log;
mod sqlite;

use std::collections::HashMap;
use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use tether_core::substrate::{DurableState, PeerId, PersistBatch};

pub use log::{
    LogCheck, LogOptions, LogStats, LogStore, LOG_COMPACT_BYTES_MIN, LOG_COMPACT_GROWTH,
    LOG_PREPARE_BYTES,
};
pub use sqlite::{SqliteStore, PAGE_SIZE, SCHEMA_VERSION};

/// A store's error as callers of the substrate see it ([`crate::substrate::Error::Store`],
/// [`crate::substrate::Inbound::Store`]): the [`StoreError`] itself, shared so that those stay
/// `Clone`. Two are equal when they are the same failure.
#[derive(Debug, Clone)]
pub struct StoreFailure(std::sync::Arc<StoreError>);

impl StoreFailure {
    /// The store's error.
    pub fn error(&self) -> &StoreError {
        &self.0
    }
}

impl From<StoreError> for StoreFailure {
    fn from(error: StoreError) -> Self {
        Self(std::sync::Arc::new(error))
    }
}

impl std::fmt::Display for StoreFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for StoreFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

impl PartialEq for StoreFailure {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for StoreFailure {}

/// Why a store could not load or commit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// SQLite refused.
    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// A stored row does not decode (written by another program or corrupted).
    #[error("corrupt row in {table}: {detail}")]
    Corrupt {
        /// The table.
        table: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// The database's tether tables, or the log, are of a version this tether cannot read
    /// (written by a newer tether).
    #[error(
        "{store} of version {found}; this tether reads version {reads} (and migrates older ones)"
    )]
    Schema {
        /// What holds it: `"sqlite tables"` or `"log"`.
        store: &'static str,
        /// The version found.
        found: i64,
        /// The version this tether writes.
        reads: i64,
    },
    /// The file system refused (the log store's file).
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// A fault injected on purpose (the simulator's disk faults, a test's broken disk).
    #[error("a fault injected on purpose: {0}")]
    Injected(&'static str),
    /// The task running the store call panicked or was cancelled.
    #[error("the store call's task failed")]
    TaskFailed,
    /// A SQLite table prefix that is not at most 32 of `[A-Za-z0-9_]`.
    #[error("table prefix {0:?} must be at most 32 of [A-Za-z0-9_]")]
    BadTablePrefix(String),
    /// A log store's path that ends in `.compact`: the log at the path without it writes its
    /// compactions there (and drops what it finds there when it opens), so the two would
    /// destroy each other.
    #[error("{} ends in `.compact`, the name a log store's compactions write", path.display())]
    ReservedName {
        /// The path asked for.
        path: PathBuf,
    },
    /// Another store (in this process or another) has the path open: one store at a time.
    #[error("{} is already open by another store (its lock {} is held)", path.display(), lock_file(path).display())]
    Locked {
        /// The store's path.
        path: PathBuf,
    },
    /// The log store's file has bytes that fail their checksums before a commit that
    /// verifies: part of an acknowledged commit changed on disk. Nothing was changed; a repair
    /// ([`LogOptions::repair`], [`LogStore::repair`], `tether store repair`) keeps every commit
    /// that verifies and drops the damaged ones.
    #[error(
        "{} is damaged at byte {offset} ({bytes} bytes fail their checksums before a commit \
         that verifies); `tether store check` reports it, `tether store repair` keeps every \
         commit that verifies",
        path.display()
    )]
    Damaged {
        /// The log's path.
        path: PathBuf,
        /// The first damaged byte.
        offset: u64,
        /// Damaged bytes in all.
        bytes: u64,
    },
}

/// `path` with every symbolic link resolved (its directory's, when the file does not exist
/// yet): two paths to one file name one store, one lock, and a compaction's rename replaces
/// the file, not a link to it.
pub(crate) fn resolved(path: &Path) -> Result<PathBuf, StoreError> {
    if let Ok(real) = std::fs::canonicalize(path) {
        return Ok(real);
    }
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a store path names a file",
        )
    })?;
    let parent = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    Ok(std::fs::canonicalize(parent)?.join(name))
}

/// The file whose exclusive lock marks the store at `path` open: `<path>.lock`.
pub fn lock_file(path: &Path) -> PathBuf {
    let mut lock = path.as_os_str().to_owned();
    lock.push(".lock");
    PathBuf::from(lock)
}

/// Takes the exclusive lock of the store at `path` (held while the returned file is open), or
/// fails at once with [`StoreError::Locked`]. The lock is the file system's (`flock` on Unix):
/// it is released when the process dies, however it dies.
pub(crate) fn lock_path(path: &Path) -> Result<File, StoreError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(lock_file(path))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(TryLockError::WouldBlock) => Err(StoreError::Locked {
            path: path.to_owned(),
        }),
        Err(TryLockError::Error(error)) => Err(error.into()),
    }
}

/// Durable state for every peer of one node, every key scoped by peer id.
pub trait Store: Send + Sync + 'static {
    /// Everything persisted for `peer` (empty when nothing is).
    fn load(&self, peer: &PeerId) -> Result<DurableState, StoreError>;

    /// Applies `batches`, in order, atomically: all of them or none.
    fn commit(&self, peer: &PeerId, batches: &[PersistBatch]) -> Result<(), StoreError>;

    /// Peers with anything persisted (their machines are recovered at start).
    fn peers(&self) -> Result<Vec<PeerId>, StoreError>;

    /// Whether calls block on disk (the shell then runs them off the async workers).
    fn is_blocking(&self) -> bool {
        false
    }

    /// [`Store::commit`] on the caller's thread, an async worker, for a commit that waits on
    /// nothing but its own write and sync: `None`, having done nothing, when it would wait on
    /// anything else (a lock another commit or a compaction holds, background work); the
    /// shell then runs [`Store::commit`] off the workers. The shell asks only for a small
    /// commit when nothing else waits for the peer, where the two thread wakes of running it
    /// elsewhere cost more than the sync. By default a store is never asked to block a worker.
    fn commit_in_place(
        &self,
        peer: &PeerId,
        batches: &[PersistBatch],
    ) -> Option<Result<(), StoreError>> {
        let _ = (peer, batches);
        None
    }
}

/// Keeps everything in memory: durable for the life of the process only.
#[derive(Debug, Default)]
pub struct MemoryStore {
    peers: Mutex<HashMap<PeerId, DurableState>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Store for MemoryStore {
    fn load(&self, peer: &PeerId) -> Result<DurableState, StoreError> {
        let peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(peers.get(peer).cloned().unwrap_or_default())
    }

    fn commit(&self, peer: &PeerId, batches: &[PersistBatch]) -> Result<(), StoreError> {
        let mut peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        let state = peers.entry(peer.clone()).or_default();
        for batch in batches {
            state.apply(batch);
        }
        Ok(())
    }

    fn peers(&self) -> Result<Vec<PeerId>, StoreError> {
        let peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(peers.keys().cloned().collect())
    }
}
