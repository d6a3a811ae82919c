//! [`LogStore`]: the substrate's durable state as one append-only file
//! ([`tether_core::wire::log`]), synced at every commit, compacted to a snapshot of what is live.
//!
//! A commit appends its records once (a `Begin` for the peer, each record a row would have
//! taken, a `Commit`) with one write and one `fdatasync`: a message's body is written to disk
//! once per side, where SQLite writes it to its WAL, rewrites the page when the row is
//! deleted and copies both to the database at checkpoints. Removals are small entries, not
//! page rewrites.
//!
//! A commit costs no more than its bytes: the store keeps no copy of the state in memory.
//! Opening replays the file and hands each peer's state to its first [`Store::load`]; a later
//! load of the same peer, a compaction and [`LogStore::gc`] replay the file again. Once the
//! file has grown past [`LOG_COMPACT_BYTES_MIN`] and past [`LOG_COMPACT_GROWTH`] times its
//! last snapshot, a thread compacts it while commits go on: it replays the file up to where
//! it stood and writes the live state to a new file, then (holding commits back only for
//! this) appends the commits made meanwhile, syncs it and renames it over the old one.
//!
//! Opening replays the file. Its tail after the last complete commit (a commit cut short by a
//! crash, or an entry that fails its checksum) was never acknowledged, since a commit is
//! reported durable only after its sync; it is cut off, as SQLite's WAL recovery stops at the
//! first frame that fails its checksum. A file of another format or version is refused.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use tether_core::limits::LOG_ENTRY_BYTES_MAX;
use tether_core::substrate::{effective_records, DurableState, PeerId, PersistBatch, Record};
use tether_core::time::Time;
use tether_core::wire::log::{
    decode_entry, decode_header, encode_begin, encode_commit, encode_header, encode_record, Entry,
    LogError, LOG_ENTRY_HEADER_BYTES, LOG_HEADER_BYTES,
};

use super::{Store, StoreError};

/// A log is never compacted below this size: a small file costs nothing to replay.
pub const LOG_COMPACT_BYTES_MIN: u64 = 64 * 1024 * 1024;

/// A log is compacted once it is this many times the size of its last snapshot.
pub const LOG_COMPACT_GROWTH: u64 = 4;

/// When a [`LogStore`] compacts its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogOptions {
    /// Never below this size ([`LOG_COMPACT_BYTES_MIN`]).
    pub compact_bytes_min: u64,
    /// Once this many times the size of the last snapshot ([`LOG_COMPACT_GROWTH`]).
    pub compact_growth: u64,
}

impl Default for LogOptions {
    fn default() -> Self {
        Self {
            compact_bytes_min: LOG_COMPACT_BYTES_MIN,
            compact_growth: LOG_COMPACT_GROWTH,
        }
    }
}

/// The substrate's durable state in one append-only file.
#[derive(Debug, Clone)]
pub struct LogStore {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    inner: Mutex<Inner>,
    /// Signalled when a compaction ends.
    compacted: Condvar,
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    file: File,
    /// The end of the last complete commit: where the next one is written.
    end: u64,
    /// A failed commit may have left bytes past `end`: cut them before the next write.
    torn: bool,
    /// The size of the file right after its last compaction (or at open).
    snapshot_bytes: u64,
    /// Every peer that has committed.
    peers: BTreeSet<PeerId>,
    /// Each peer's state as replayed at open, until its first load takes it.
    replayed: BTreeMap<PeerId, DurableState>,
    /// Bytes cut off the tail when the file was opened.
    recovered_tail: u64,
    /// Compactions since open.
    compactions: u64,
    options: LogOptions,
    /// A compaction is running (at most one at a time).
    compacting: bool,
    /// A compaction renamed its file over the log but the directory is not synced yet: synced
    /// before the next commit.
    rename_unsynced: bool,
    /// The size at which the next compaction starts.
    compact_at: u64,
}

/// What a [`LogStore`] has done since it was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogStats {
    /// The file's size (the end of its last complete commit).
    pub bytes: u64,
    /// Bytes of an incomplete or damaged tail cut off at open (never acknowledged).
    pub recovered_tail_bytes: u64,
    /// Compactions since open.
    pub compactions: u64,
}

impl LogStore {
    /// Opens (creating if needed) the log at `path`, replaying it.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with(path, LogOptions::default())
    }

    /// [`LogStore::open`], compacting as `options` say.
    pub fn open_with(path: impl AsRef<Path>, options: LogOptions) -> Result<Self, StoreError> {
        let path = path.as_ref().to_owned();
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let mut inner = match replay(&bytes)? {
            Some((replayed, end)) => Inner {
                path,
                file,
                end,
                torn: end < bytes.len() as u64,
                // How much of it is live is not known until a compaction: the next one is
                // due once it is past `compact_bytes_min`.
                snapshot_bytes: LOG_HEADER_BYTES as u64,
                peers: replayed.keys().cloned().collect(),
                replayed,
                recovered_tail: bytes.len() as u64 - end,
                compactions: 0,
                options,
                compacting: false,
                rename_unsynced: false,
                compact_at: 0,
            },
            None => {
                // A new file, or one whose header never made it to disk (nothing was
                // committed to it): written from the start.
                let mut header = Vec::new();
                encode_header(&mut header);
                file.set_len(0)?;
                file.seek(SeekFrom::Start(0))?;
                file.write_all(&header)?;
                file.sync_all()?;
                sync_parent(&path)?;
                Inner {
                    path,
                    file,
                    end: header.len() as u64,
                    torn: false,
                    snapshot_bytes: header.len() as u64,
                    peers: BTreeSet::new(),
                    replayed: BTreeMap::new(),
                    recovered_tail: bytes.len() as u64,
                    compactions: 0,
                    options,
                    compacting: false,
                    rename_unsynced: false,
                    compact_at: 0,
                }
            }
        };
        if inner.torn {
            inner.cut_tail()?;
        }
        inner.compact_at = inner.next_compaction();
        Ok(Self {
            shared: Arc::new(Shared {
                inner: Mutex::new(inner),
                compacted: Condvar::new(),
            }),
        })
    }

    /// The file's size, the tail cut at open, and compactions since.
    pub fn stats(&self) -> LogStats {
        let inner = self.lock();
        LogStats {
            bytes: inner.end,
            recovered_tail_bytes: inner.recovered_tail,
            compactions: inner.compactions,
        }
    }

    /// Writes the live state to a new file and renames it over the log now, after any
    /// compaction already running (a commit starts one on its own once the file has grown
    /// enough).
    pub fn compact(&self) -> Result<(), StoreError> {
        let prefix = {
            let mut inner = self.lock();
            while inner.compacting {
                inner = self.wait(inner);
            }
            inner.begin_compaction()?
        };
        let result = self.shared.finish_compaction(prefix);
        self.shared.compacted.notify_all();
        result
    }

    /// Waits until no compaction is running.
    pub fn wait_compaction(&self) {
        let mut inner = self.lock();
        while inner.compacting {
            inner = self.wait(inner);
        }
    }

    fn wait<'a>(&self, inner: MutexGuard<'a, Inner>) -> MutexGuard<'a, Inner> {
        self.shared
            .compacted
            .wait(inner)
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Deletes tombstones and closed objects whose retention ended before `cutoff`, for every
    /// peer (including peers that never reconnect), in one commit per peer that has any.
    /// Returns the records removed.
    pub fn gc(&self, cutoff: Time) -> Result<usize, StoreError> {
        let mut inner = self.lock();
        let mut removed = 0;
        for (peer, state) in inner.state_on_disk()? {
            let mut records: Vec<Record> = state
                .bounces
                .iter()
                .filter(|(_, (_, at))| *at < cutoff)
                .map(|(op_id, _)| Record::BounceRemoved {
                    op_id: op_id.clone(),
                })
                .collect();
            records.extend(
                state
                    .objects
                    .values()
                    .filter(|object| match object.state {
                        tether_core::substrate::ObjectState::Closed(at)
                        | tether_core::substrate::ObjectState::Rejected(at) => at < cutoff,
                        _ => false,
                    })
                    .map(|object| Record::ObjectRemoved {
                        obj: object.obj.clone(),
                    }),
            );
            if records.is_empty() {
                continue;
            }
            removed += records.len();
            inner.append(&peer, records.iter())?;
        }
        drop(inner);
        self.compact_if_due();
        Ok(removed)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.shared.lock()
    }

    /// Starts a compaction on a thread of its own when the file has grown enough and none
    /// runs; a compaction that fails is logged and tried again once the file has grown by
    /// another [`LogOptions::compact_bytes_min`].
    fn compact_if_due(&self) {
        let prefix = {
            let mut inner = self.lock();
            if inner.compacting || inner.end < inner.compact_at {
                return;
            }
            match inner.begin_compaction() {
                Ok(prefix) => prefix,
                Err(error) => {
                    inner.compaction_failed(&error);
                    return;
                }
            }
        };
        let shared = self.shared.clone();
        let spawned = std::thread::Builder::new()
            .name("tether-log-compact".to_owned())
            .spawn(move || {
                // Its failure is logged where it happens; the log stays as it was.
                let _ = shared.finish_compaction(prefix);
                shared.compacted.notify_all();
            });
        if let Err(error) = spawned {
            let mut inner = self.lock();
            inner.compacting = false;
            inner.compaction_failed(&error.into());
            self.shared.compacted.notify_all();
        }
    }
}

/// What a compaction took under the lock: the file up to `upto` (whole commits), read
/// through a handle of its own while commits go on.
struct Prefix {
    path: PathBuf,
    reader: File,
    upto: u64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Replays `prefix` and writes the live state to `<path>.compact` without the lock, then
    /// under it appends the commits made meanwhile, syncs, and renames the file over the log.
    fn finish_compaction(&self, prefix: Prefix) -> Result<(), StoreError> {
        let fresh = compaction_path(&prefix.path);
        let result = Self::write_snapshot(&prefix, &fresh).and_then(|(file, snapshot)| {
            let mut inner = self.lock();
            inner.swap_in(file, &fresh, prefix.upto, snapshot)
        });
        let mut inner = self.lock();
        inner.compacting = false;
        if let Err(error) = &result {
            let _ = std::fs::remove_file(&fresh);
            inner.compaction_failed(error);
        }
        result
    }

    /// The live state of the file's first `prefix.upto` bytes, written to `fresh` (not yet
    /// synced); its size.
    fn write_snapshot(prefix: &Prefix, fresh: &Path) -> Result<(File, u64), StoreError> {
        let states = replay_prefix(&prefix.reader, prefix.upto)?;
        let mut out = Vec::new();
        encode_header(&mut out);
        for (peer, state) in &states {
            encode_begin(peer.as_str(), &mut out);
            for record in snapshot_records(state) {
                encode_record(&record, &mut out);
            }
            encode_commit(&mut out);
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(fresh)?;
        file.write_all(&out)?;
        Ok((file, out.len() as u64))
    }
}

impl Inner {
    /// Appends one commit of `records` for `peer`, syncs it, then applies it to the state.
    fn append<'a>(
        &mut self,
        peer: &PeerId,
        records: impl Iterator<Item = &'a Record> + Clone,
    ) -> Result<(), StoreError> {
        self.sync_rename()?;
        if self.torn {
            self.cut_tail()?;
        }
        let mut out = Vec::new();
        encode_begin(peer.as_str(), &mut out);
        for record in records.clone() {
            let start = out.len();
            encode_record(record, &mut out);
            if out.len() - start - LOG_ENTRY_HEADER_BYTES > LOG_ENTRY_BYTES_MAX {
                return Err(StoreError::Corrupt {
                    table: "log",
                    detail: format!(
                        "a record of {} bytes is over the log's entry bound",
                        out.len() - start
                    ),
                });
            }
        }
        encode_commit(&mut out);
        // From here until the sync returns, bytes past `end` may be on disk: a failure leaves
        // them to be cut before the next write (and a crash leaves them to replay's cut).
        self.torn = true;
        self.file.seek(SeekFrom::Start(self.end))?;
        self.file.write_all(&out)?;
        self.file.sync_data()?;
        self.torn = false;
        self.end += out.len() as u64;
        if !self.peers.contains(peer) {
            self.peers.insert(peer.clone());
        }
        if let Some(state) = self.replayed.get_mut(peer) {
            // Only before the peer's first load (its machine loads before it commits).
            state.apply_records(records);
        }
        Ok(())
    }

    /// The size at which the compaction after the last snapshot starts.
    fn next_compaction(&self) -> u64 {
        self.options.compact_bytes_min.max(
            self.options
                .compact_growth
                .saturating_mul(self.snapshot_bytes),
        )
    }

    /// Marks a compaction running and hands out what it reads: the file up to `end`.
    fn begin_compaction(&mut self) -> Result<Prefix, StoreError> {
        let reader = File::open(&self.path)?;
        self.compacting = true;
        Ok(Prefix {
            path: self.path.clone(),
            reader,
            upto: self.end,
        })
    }

    /// Appends the commits after `upto` to the snapshot in `file` (of `snapshot` bytes),
    /// syncs it and renames it over the log, which it then is.
    fn swap_in(
        &mut self,
        mut file: File,
        fresh: &Path,
        upto: u64,
        snapshot: u64,
    ) -> Result<(), StoreError> {
        let mut since = vec![0; usize::try_from(self.end - upto).unwrap_or(usize::MAX)];
        self.file.seek(SeekFrom::Start(upto))?;
        self.file.read_exact(&mut since)?;
        file.seek(SeekFrom::Start(snapshot))?;
        file.write_all(&since)?;
        file.sync_all()?;
        std::fs::rename(fresh, &self.path)?;
        // The path now names the new file: commits go there from here on, whatever follows.
        self.file = file;
        self.end = snapshot + since.len() as u64;
        self.snapshot_bytes = snapshot;
        // Whatever a failed commit left past the old file's end stays there.
        self.torn = false;
        self.compactions += 1;
        self.compact_at = self.next_compaction();
        // Until the rename is durable, a crash could bring the old file back without the
        // commits made to the new one: no commit is reported durable before it is.
        self.rename_unsynced = true;
        self.sync_rename()
    }

    /// Makes the last compaction's rename durable, if it is not yet.
    fn sync_rename(&mut self) -> Result<(), StoreError> {
        if self.rename_unsynced {
            sync_parent(&self.path)?;
            self.rename_unsynced = false;
        }
        Ok(())
    }

    /// A compaction failed: the log stays as it was; the next is tried once the file has grown
    /// by another `compact_bytes_min`.
    fn compaction_failed(&mut self, error: &StoreError) {
        tracing::warn!(%error, path = %self.path.display(), "log compaction failed");
        self.compact_at = self.end.saturating_add(self.options.compact_bytes_min);
    }

    /// Cuts the file back to the end of its last complete commit.
    fn cut_tail(&mut self) -> Result<(), StoreError> {
        self.file.set_len(self.end)?;
        self.file.sync_all()?;
        self.torn = false;
        Ok(())
    }

    /// Every peer's state as the file holds it (replayed from its bytes).
    fn state_on_disk(&mut self) -> Result<BTreeMap<PeerId, DurableState>, StoreError> {
        replay_prefix(&self.file, self.end)
    }
}

/// The records that rebuild `state` from nothing.
fn snapshot_records(state: &DurableState) -> impl Iterator<Item = Record> + '_ {
    let objects = state.objects.values().cloned().map(Record::Object);
    let outbox = state.outbox.values().cloned().map(Record::Outbox);
    let held = state.held.values().cloned().map(Record::Held);
    let inbox = state.inbox.values().cloned().map(Record::Inbox);
    let bounces = state
        .bounces
        .iter()
        .map(|(op_id, (code, at))| Record::Bounce {
            op_id: op_id.clone(),
            code: code.clone(),
            at: *at,
        });
    objects
        .chain(outbox)
        .chain(held)
        .chain(inbox)
        .chain(bounces)
}

/// Every peer's state from a log's bytes, and the end of its last complete commit; `None` when
/// the bytes are empty or the start of a header. A header of another format or version is an
/// error; a damaged or incomplete tail ends the replay.
#[allow(clippy::type_complexity)]
fn replay(bytes: &[u8]) -> Result<Option<(BTreeMap<PeerId, DurableState>, u64)>, StoreError> {
    let corrupt = |error: LogError| StoreError::Corrupt {
        table: "log",
        detail: error.to_string(),
    };
    let start = match decode_header(bytes) {
        Ok(Some(start)) => start,
        Ok(None) if could_be_header(bytes) => return Ok(None),
        Ok(None) => return Err(corrupt(LogError::BadMagic)),
        Err(LogError::Version(version)) => {
            return Err(StoreError::Schema(format!(
                "the log is of version {version}; this tether reads version {}",
                tether_core::wire::log::LOG_VERSION
            )))
        }
        Err(error) => return Err(corrupt(error)),
    };
    let mut peers: BTreeMap<PeerId, DurableState> = BTreeMap::new();
    let mut at = start;
    let mut committed = start;
    let mut open: Option<(PeerId, Vec<Record>)> = None;
    while let Ok(Some((entry, used))) = decode_entry(&bytes[at..]) {
        at += used;
        match (entry, open.take()) {
            (Entry::Begin { peer }, None) => open = Some((PeerId::new(peer), Vec::new())),
            (Entry::Record(record), Some((peer, mut records))) => {
                records.push(record);
                open = Some((peer, records));
            }
            (Entry::Commit, Some((peer, records))) => {
                peers.entry(peer).or_default().apply_records(&records);
                committed = at;
            }
            // Entries out of place: only a damaged tail can hold them (this store writes
            // whole commits and cuts what a failed one left).
            _ => break,
        }
    }
    Ok(Some((peers, committed as u64)))
}

/// Every peer's state in the first `upto` bytes of `file` (whole commits).
fn replay_prefix(mut file: &File, upto: u64) -> Result<BTreeMap<PeerId, DurableState>, StoreError> {
    let mut bytes = vec![0; usize::try_from(upto).unwrap_or(usize::MAX)];
    file.seek(SeekFrom::Start(0))?;
    file.read_exact(&mut bytes)?;
    Ok(replay(&bytes)?
        .map(|(states, _)| states)
        .unwrap_or_default())
}

/// Where a compaction writes the new file: the log's path with `.compact` appended (never the
/// log itself, whatever its name).
fn compaction_path(path: &Path) -> PathBuf {
    let mut fresh = path.as_os_str().to_owned();
    fresh.push(".compact");
    PathBuf::from(fresh)
}

/// Whether `bytes` (shorter than a header) could be the start of one.
fn could_be_header(bytes: &[u8]) -> bool {
    let mut header = Vec::new();
    encode_header(&mut header);
    header.starts_with(bytes)
}

/// Makes a file's creation or rename in its directory durable (a no-op where directories
/// cannot be opened).
fn sync_parent(path: &Path) -> Result<(), StoreError> {
    #[cfg(unix)]
    {
        let parent = match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        File::open(parent)?.sync_all()?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

impl Store for LogStore {
    fn load(&self, peer: &PeerId) -> Result<DurableState, StoreError> {
        let mut inner = self.lock();
        if let Some(state) = inner.replayed.remove(peer) {
            return Ok(state);
        }
        if !inner.peers.contains(peer) {
            return Ok(DurableState::default());
        }
        Ok(inner.state_on_disk()?.remove(peer).unwrap_or_default())
    }

    fn commit(&self, peer: &PeerId, batches: &[PersistBatch]) -> Result<(), StoreError> {
        let records = effective_records(batches);
        self.lock().append(peer, records.iter().copied())?;
        self.compact_if_due();
        Ok(())
    }

    fn peers(&self) -> Result<Vec<PeerId>, StoreError> {
        Ok(self.lock().peers.iter().cloned().collect())
    }

    fn is_blocking(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sqlite::tests::batches;
    use tether_core::substrate::BatchId;

    #[test]
    fn a_compaction_never_writes_over_the_log_whatever_its_name() {
        for name in ["state.log", "state.compact", "state"] {
            let path = PathBuf::from("/data").join(name);
            assert_ne!(compaction_path(&path), path);
            assert_eq!(
                compaction_path(&path),
                PathBuf::from(format!("/data/{name}.compact"))
            );
        }
    }

    fn temp_log(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tether-log-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir.join("state.log")
    }

    fn reference(batches: &[PersistBatch]) -> DurableState {
        let mut state = DurableState::default();
        for batch in batches {
            state.apply(batch);
        }
        state
    }

    #[test]
    fn round_trips_the_reference_state_across_reopen_and_compaction() {
        let path = temp_log("rt");
        let (a, b) = (PeerId::new("peer-a"), PeerId::new("peer-b"));
        let store = LogStore::open(&path).expect("open");
        store.commit(&a, &batches()).expect("commit");
        store.commit(&b, &batches()[..1]).expect("commit");
        let (expected_a, expected_b) = (reference(&batches()), reference(&batches()[..1]));
        assert_eq!(store.load(&a).expect("load"), expected_a);
        assert_eq!(
            store.load(&PeerId::new("c")).expect("load"),
            DurableState::default()
        );
        drop(store);
        let store = LogStore::open(&path).expect("reopen");
        // The first load takes the state replayed at open; a second replays the file.
        assert_eq!(store.load(&a).expect("load"), expected_a);
        assert_eq!(store.load(&a).expect("load again"), expected_a);
        assert_eq!(store.load(&b).expect("load"), expected_b);
        assert_eq!(store.peers().expect("peers"), vec![a.clone(), b.clone()]);
        let before = store.stats().bytes;
        store.compact().expect("compact");
        assert!(store.stats().bytes < before, "the removed rows are gone");
        assert_eq!(store.stats().compactions, 1);
        // Commits go on after a compaction, and a reopen sees both.
        store.commit(&b, &batches()[1..]).expect("commit");
        drop(store);
        let store = LogStore::open(&path).expect("reopen");
        assert_eq!(store.load(&a).expect("load"), expected_a);
        assert_eq!(store.load(&b).expect("load"), expected_a);
        // A commit before a peer's first load lands in the state that load hands out.
        drop(store);
        let store = LogStore::open(&path).expect("reopen");
        store.commit(&a, &batches()[..1]).expect("commit");
        let mut again = expected_a.clone();
        again.apply(&batches()[0]);
        assert_eq!(store.load(&a).expect("load"), again);
        assert_eq!(store.load(&a).expect("load again"), again);
        // GC drops the tombstone and the closed object older than the cutoff, for each peer.
        assert_eq!(store.gc(Time::from_millis(6)).expect("gc"), 4);
        drop(store);
        let store = LogStore::open(&path).expect("reopen");
        for peer in [&a, &b] {
            let state = store.load(peer).expect("load");
            assert!(state.bounces.is_empty() && !state.objects.contains_key("b"));
        }
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// A crash at any byte of a commit leaves the state before it: the cut commit was never
    /// acknowledged. A damaged byte in the last commit does the same. The store then
    /// appends where the last complete commit ended.
    #[test]
    fn a_commit_cut_or_damaged_anywhere_is_dropped_whole() {
        let path = temp_log("cut");
        let peer = PeerId::new("p");
        let store = LogStore::open(&path).expect("open");
        store.commit(&peer, &batches()[..1]).expect("first");
        let first_end = store.stats().bytes as usize;
        store.commit(&peer, &batches()[1..]).expect("second");
        drop(store);
        let whole = std::fs::read(&path).expect("read");
        let after_first = reference(&batches()[..1]);
        let mut damaged_files: Vec<Vec<u8>> = (first_end..whole.len())
            .map(|cut| whole[..cut].to_vec())
            .collect();
        damaged_files.extend((first_end..whole.len()).map(|at| {
            let mut bytes = whole.clone();
            bytes[at] ^= 0x10;
            bytes
        }));
        for bytes in damaged_files {
            std::fs::write(&path, &bytes).expect("write");
            let store = LogStore::open(&path).expect("reopen");
            assert_eq!(store.load(&peer).expect("load"), after_first);
            assert_eq!(
                store.stats().recovered_tail_bytes,
                (bytes.len() - first_end) as u64
            );
            assert_eq!(
                std::fs::metadata(&path).expect("meta").len(),
                first_end as u64
            );
            store.commit(&peer, &batches()[1..]).expect("again");
            drop(store);
            let store = LogStore::open(&path).expect("reopen");
            assert_eq!(store.load(&peer).expect("load"), reference(&batches()));
            assert_eq!(store.stats().recovered_tail_bytes, 0);
        }
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    #[test]
    fn a_header_cut_short_starts_afresh_and_another_format_is_refused() {
        let path = temp_log("header");
        let mut header = Vec::new();
        encode_header(&mut header);
        std::fs::write(&path, &header[..5]).expect("write");
        let store = LogStore::open(&path).expect("a header cut short");
        assert!(store.peers().expect("peers").is_empty());
        store.commit(&PeerId::new("p"), &batches()).expect("commit");
        drop(store);
        assert!(
            LogStore::open(&path)
                .expect("reopen")
                .peers()
                .expect("peers")
                .len()
                == 1
        );
        std::fs::write(&path, b"SQLite format 3\0").expect("write");
        assert!(matches!(
            LogStore::open(&path),
            Err(StoreError::Corrupt { table: "log", .. })
        ));
        let mut newer = header.clone();
        newer[8] = 2;
        std::fs::write(&path, &newer).expect("write");
        assert!(matches!(LogStore::open(&path), Err(StoreError::Schema(_))));
        assert_eq!(std::fs::read(&path).expect("read"), newer, "left alone");
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// Compactions run on their own thread while commits go on: every commit made during one
    /// is carried into the new file.
    #[test]
    fn commits_go_on_while_the_file_is_compacted() {
        let path = temp_log("background");
        let options = LogOptions {
            compact_bytes_min: 2048,
            compact_growth: 2,
        };
        let store = LogStore::open_with(&path, options).expect("open");
        let peer = PeerId::new("p");
        let mut expected = DurableState::default();
        for round in 0..200u64 {
            // A send, and the removal of the one before it: the live state stays small.
            let mut records = vec![Record::Outbox(send(round))];
            if let Some(before) = round.checked_sub(1) {
                records.push(Record::OutboxRemoved {
                    obj: "q".to_owned(),
                    seq: before,
                });
            }
            let batch = PersistBatch {
                id: BatchId(round + 1),
                records,
            };
            store
                .commit(&peer, std::slice::from_ref(&batch))
                .expect("commit");
            expected.apply(&batch);
        }
        store.wait_compaction();
        let stats = store.stats();
        assert!(stats.compactions >= 10, "{stats:?}");
        assert!(stats.bytes < 4096, "{stats:?}");
        assert_eq!(store.load(&peer).expect("load"), expected);
        drop(store);
        let store = LogStore::open(&path).expect("reopen");
        assert_eq!(store.load(&peer).expect("load"), expected);
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// A file found past `compact_bytes_min` at open is compacted after its first commit: how
    /// much of it is live is not known, so its size is no snapshot to grow from.
    #[test]
    fn a_large_file_found_at_open_is_compacted_after_the_first_commit() {
        let path = temp_log("reopened");
        let options = LogOptions {
            compact_bytes_min: 4096,
            compact_growth: 2,
        };
        let peer = PeerId::new("p");
        let store = LogStore::open(&path).expect("open");
        for seq in 0..40 {
            let batch = PersistBatch {
                id: BatchId(seq + 1),
                records: vec![Record::Outbox(send(seq))],
            };
            store.commit(&peer, &[batch]).expect("commit");
        }
        assert!(store.stats().bytes > 4096);
        drop(store);
        let store = LogStore::open_with(&path, options).expect("reopen");
        let removal = PersistBatch {
            id: BatchId(41),
            records: vec![Record::OutboxRemoved {
                obj: "q".to_owned(),
                seq: 0,
            }],
        };
        store.commit(&peer, &[removal]).expect("commit");
        store.wait_compaction();
        assert_eq!(store.stats().compactions, 1);
        assert_eq!(store.load(&peer).expect("load").outbox.len(), 39);
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    fn send(seq: u64) -> tether_core::substrate::Op {
        tether_core::substrate::Op {
            obj: "q".to_owned(),
            seq,
            id: format!("m-{seq}"),
            verb: tether_core::wire::envelope::Verb::Send,
            obj_kind: None,
            body: Some(bytes::Bytes::from(vec![7; 100])),
            code: None,
            reason: None,
            cap: None,
            at: Time::from_millis(seq),
        }
    }

    mod equivalence {
        use super::*;
        use crate::store::sqlite::tests::equivalence::record;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(64))]

            /// Any sequence of batches, committed in groups of any size while compactions run
            /// beside the commits (a file of a few hundred bytes is compacted), leaves exactly
            /// the state `DurableState::apply` defines: loaded, after a reopen, and after a
            /// compaction and another reopen.
            #[test]
            fn the_log_ends_where_the_reference_ends(
                batches in prop::collection::vec(prop::collection::vec(record(), 0..6), 0..12),
                group in 1usize..4,
                compact_bytes_min in 64u64..1024,
            ) {
                let path = temp_log("prop");
                let options = LogOptions { compact_bytes_min, compact_growth: 2 };
                let store = LogStore::open_with(&path, options).expect("open");
                let peer = PeerId::new("peer");
                let batches: Vec<PersistBatch> = batches
                    .into_iter()
                    .enumerate()
                    .map(|(i, records)| PersistBatch { id: BatchId(i as u64 + 1), records })
                    .collect();
                for chunk in batches.chunks(group) {
                    store.commit(&peer, chunk).expect("commit");
                }
                let expected = reference(&batches);
                prop_assert_eq!(store.load(&peer).expect("load"), expected.clone());
                store.wait_compaction();
                drop(store);
                let store = LogStore::open(&path).expect("reopen");
                prop_assert_eq!(store.load(&peer).expect("load"), expected.clone());
                store.compact().expect("compact");
                drop(store);
                let store = LogStore::open(&path).expect("reopen");
                prop_assert_eq!(store.load(&peer).expect("load"), expected);
                let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
            }
        }
    }
}
