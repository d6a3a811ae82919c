//! [`LogStore`]: the substrate's durable state as one append-only file
//! ([`tether_core::substrate::log`]), synced at every commit, compacted to a snapshot of what is live.
//!
//! A commit appends its records once (a `Begin` for the peer, each record a row would have
//! taken, a `Commit`) with one write and one `fdatasync`: a message's body is written to disk
//! once per side, where SQLite writes it to its WAL, rewrites the page when the row is
//! deleted and copies both to the database at checkpoints. Removals are small entries, not
//! page rewrites.
//!
//! The store keeps no copy of the state in memory, only an index of where each live row's
//! last record lies in the file ([`LogIndex`]: a key and a byte range per row, never a body,
//! so smaller than the state a replay at open holds, and bounded by the same rows). Opening
//! replays the file and hands each peer's state to its first [`Store::load`]; a later load of
//! the same peer and [`LogStore::gc`] replay the file again. Once the file has grown past
//! [`LOG_COMPACT_BYTES_MIN`] and past [`LOG_COMPACT_GROWTH`] times its last snapshot, a thread
//! compacts it while commits go on: it copies the live rows' entries as the index places them
//! (each verified as its row's record first; read together where they lie close) into a new
//! file, one commit per peer, then (holding commits back only for this) appends the commits
//! made meanwhile, syncs it and renames it over the old one. A compaction reads the live
//! rows, not the file: its cost follows what is live, not what was written. A live row whose
//! bytes no longer verify fails it with [`StoreError::Damaged`] and the log stays as it was;
//! damage where no live row lies (a record removed since) stays behind with the old file.
//!
//! A commit that grows the file costs more than its bytes: on ext4 its `fdatasync` also
//! commits the filesystem's journal (the file's size and blocks changed), and two stores on
//! one disk wait on each other's journal commits. Measured here with two writers syncing
//! 16 KiB each: 700–1,000 µs per sync appending, 370–400 µs overwriting blocks the file
//! already has. So a thread of the store's own keeps [`LogOptions::prepare_bytes`] of zeros
//! written and synced past the last commit, as PostgreSQL zero-fills a new WAL segment
//! before use: commits overwrite them, and their syncs write the data alone. The zeros' whole
//! blocks are written with direct I/O where the file system allows it (Linux), so they cost
//! no copy into the page cache that the commits would then copy over; each commit pads its
//! last block with zeros, so the next one never starts in a block the page cache lacks (which
//! the kernel would read from the disk first). While commits go on, a preparation writes its
//! zeros from half of `prepare_bytes` past the end, so the commits need not wait for it; when
//! that leaves whole blocks between the prepared space and the new zeros (after the file was
//! cut back to its last commit, or commits outran the zeros), the file grows over them without
//! writing them, a hole. The new zeros then count as prepared only once the commits reach
//! them: a commit into the hole would pay for its blocks' allocation at its sync. Opening
//! finds such a hole again (`SEEK_HOLE`) in the zeros past the last commit.
//!
//! A commit that lies wholly in prepared space (and is at most
//! [`LOG_DIRECT_COMMIT_BYTES_MAX`]) goes to the disk with direct I/O too, as one write of whole
//! blocks: what earlier commits wrote in the block it starts in (kept from the last direct
//! commit, read back after anything else wrote there), the commit, and zeros to the end of its
//! last block, where the file holds zeros already. The commit is sized first and encoded
//! straight into the aligned buffer that write goes from, so each body is copied once on its
//! way to the disk. It costs no copy into the page cache and leaves the sync no pages to
//! write back: the sync only flushes the disk. A handle the file system refuses, or a direct
//! write that fails, sends every later commit through the page cache, as before.
//!
//! Opening replays the file ([`tether_core::substrate::log::scan`]). Its tail after the last
//! complete commit (a commit cut short by a crash) was never acknowledged, since a commit is
//! reported durable only after its sync; it is cut off, as SQLite's WAL recovery stops at the
//! first frame that fails its checksum. A tail of zeros only is prepared space and is kept.
//! Bytes that fail their checksums **before** a commit that verifies are another matter:
//! they were part of acknowledged commits, so the file is damaged and [`LogStore::open`]
//! refuses it with [`StoreError::Damaged`], naming the offset, and changes nothing. A repair
//! ([`LogOptions::repair`], [`LogStore::repair`], `tether store repair`) keeps every commit
//! that verifies, before and after the damage, drops the rest and says what it dropped;
//! [`LogStore::check`] (`tether store check`) reports without changing anything. A file of
//! another format or version is refused.
//!
//! A file of version 1 (checksums over payloads only) is read and rewritten in version 2 at
//! open. One store at a time: opening takes an exclusive lock on `<path>.lock`, held until the
//! last handle is dropped, so a second open of the same path (another process, or a restarted
//! one while the old one still runs) fails at once with [`StoreError::Locked`].
//!
//! Dropping the last handle of a store stops its background work and waits for it, so a store
//! reopened on the same path never races a compaction or preparation of the one before.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, OpenOptions};
use std::io::{IoSlice, Read, Seek, SeekFrom, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use tether_core::limits::{
    LOG_BLOCK_BYTES, LOG_COMPACT_READ_BYTES, LOG_DIRECT_COMMIT_BYTES_MAX, LOG_ENTRY_BYTES_MAX,
    LOG_PREPARE_CHUNK_BYTES,
};

use tether_core::substrate::log::{
    encode_begin, encode_commit, encode_header, encode_record, encoded_begin_len,
    encoded_commit_len, encoded_record_len, scan, scan_shared, verify_entry, IndexError, LogError,
    LogFormat, LogIndex, LogScan, LOG_ENTRY_HEADER_BYTES, LOG_VERSION,
};
use tether_core::substrate::{
    effective_records, DurableState, PeerId, PersistBatch, Record, RowKey,
};
use tether_core::time::Time;

use super::{lock_path, resolved, Store, StoreError};

pub use tether_core::limits::LOG_COMPACT_BYTES_MIN;

pub use tether_core::limits::LOG_COMPACT_GROWTH;

pub use tether_core::limits::LOG_PREPARE_BYTES;

/// When a [`LogStore`] compacts its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogOptions {
    /// Never below this size ([`LOG_COMPACT_BYTES_MIN`]).
    pub compact_bytes_min: u64,
    /// Once this many times the size of the last snapshot ([`LOG_COMPACT_GROWTH`]).
    pub compact_growth: u64,
    /// Bytes of zeros written and synced past the last commit ([`LOG_PREPARE_BYTES`]; 0 for
    /// none). A thread tops them up once fewer than half remain. Unix only: elsewhere the
    /// file grows with its commits.
    pub prepare_bytes: u64,
    /// A damaged file is repaired at open instead of refused: every commit that verifies is
    /// kept, the damaged bytes are dropped ([`LogStats::repaired_bytes`] says how many). Off by
    /// default: a repair loses whatever the damaged commits held, so it is asked for.
    pub repair: bool,
}

impl Default for LogOptions {
    fn default() -> Self {
        Self {
            compact_bytes_min: LOG_COMPACT_BYTES_MIN,
            compact_growth: LOG_COMPACT_GROWTH,
            prepare_bytes: LOG_PREPARE_BYTES,
            repair: false,
        }
    }
}

/// The substrate's durable state in one append-only file.
#[derive(Debug, Clone)]
pub struct LogStore {
    shared: Arc<Shared>,
    /// How the file spells its entries (the same across compactions).
    format: LogFormat,
    /// Dropped with the last handle: stops and waits for the background work.
    _open: Arc<Open>,
}

#[derive(Debug)]
struct Shared {
    inner: Mutex<Inner>,
    /// Signalled when a compaction or a preparation ends.
    idle: Condvar,
    /// The last handle is gone: background work stops at its next check.
    closing: AtomicBool,
    /// The direct commits' refusal ([`DirectCommits::refused`]), read without the lock.
    direct_refused: Arc<AtomicBool>,
    /// Tests hold compactions between their snapshot and their swap, to commit meanwhile.
    #[cfg(test)]
    held: (Mutex<bool>, Condvar),
}

/// Held by every [`LogStore`] handle (not by its threads).
#[derive(Debug)]
struct Open {
    shared: Arc<Shared>,
    /// The exclusive lock on `<path>.lock`, released after the background work has stopped.
    _lock: File,
}

impl Drop for Open {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        let mut inner = self.shared.lock();
        while inner.compacting || inner.preparing {
            inner = self.shared.wait(inner);
        }
        if inner.torn {
            // A commit reported failed left bytes past the end: cut now, or a reopen would
            // replay a commit its caller was told did not happen (a crash leaves them to
            // chance, and replay's cut).
            if let Err(error) = inner.cut_tail() {
                tracing::warn!(%error, "the log's failed commit was not cut at close");
            }
        }
    }
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    /// How the file spells its entries.
    format: LogFormat,
    file: File,
    /// The end of the last complete commit: where the next one is written.
    end: u64,
    /// A failed commit may have left bytes past `end`: cut them before the next write.
    torn: bool,
    /// The size of the file right after its last compaction (or at open).
    snapshot_bytes: u64,
    /// Every peer that has committed.
    peers: BTreeSet<PeerId>,
    /// Where each live row's record lies in the file: what a compaction copies.
    index: LogIndex,
    /// Each peer's state as replayed at open, until its first load takes it.
    replayed: BTreeMap<PeerId, DurableState>,
    /// Bytes cut off the tail when the file was opened.
    recovered_tail: u64,
    /// What a repair at open found and dropped.
    repaired: Option<LogCheck>,
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
    /// The file's bytes from `end` to here are zeros, written and synced: commits overwrite
    /// them.
    prepared: u64,
    /// Zeros a preparation beside commits wrote and synced past `prepared`, not yet joined to it:
    /// the bytes between were never written (a hole the file system has not allocated), so
    /// commits grow the file through them as past any end, and the zeros count as prepared
    /// once the end reaches them.
    ahead: Option<Range<u64>>,
    /// A thread is writing zeros past `prepared` (at most one at a time).
    preparing: bool,
    /// Where the running preparation's zeros start: commits stay below it.
    preparing_from: u64,
    /// After a preparation failed, the next waits until the log has grown past this.
    prepare_after: u64,
    /// Bumped whenever `file` is replaced or cut: a preparation of an earlier one is void.
    generation: u64,
    /// Zeros the preparations wrote with direct I/O since open.
    prepared_direct: u64,
    /// Commits written with direct I/O.
    direct: DirectCommits,
    /// Tests: this many of the next commits' syncs fail after they ran (the commit's bytes
    /// are then on disk, and the commit is reported failed).
    #[cfg(test)]
    failing_syncs: u32,
}

/// Commits that lie wholly in prepared space go to the disk with direct I/O (Linux, where the
/// file system takes it): no copy into the page cache, and no writeback for the sync, which
/// then only flushes the disk. Each such write covers whole blocks: what earlier commits wrote
/// in the block the commit starts in (kept from the last direct commit, read back otherwise),
/// the commit, and zeros to the end of its last block (the file's zeros there already).
#[derive(Debug, Default)]
struct DirectCommits {
    /// The direct handle and the generation of the file it opened.
    file: Option<(u64, File)>,
    /// Refused once (by the file system, or a failed write): commits go through the page
    /// cache from then on. Shared with the store's handles, which then encode commits before
    /// taking the lock (none will be encoded in place).
    refused: Arc<AtomicBool>,
    /// The file's bytes from the block boundary before `tail_at` up to it.
    tail: Vec<u8>,
    /// Where `tail` ends, in the file of which generation: it is the block the next commit
    /// starts in only when that is the end then.
    tail_at: Option<(u64, u64)>,
    /// Where each write is put together: aligned within, as direct I/O wants; at most
    /// [`LOG_DIRECT_COMMIT_BYTES_MAX`] and a block for its alignment.
    buffer: Vec<u8>,
    /// Commit bytes written this way since open.
    bytes: u64,
}

impl DirectCommits {
    /// The file it wrote is no longer the log (a compaction renamed another over it, or the
    /// tail was cut): its handle goes (so the old file's space is freed with the last
    /// handle), and so does the block kept from it.
    fn forget_file(&mut self) {
        self.file = None;
        self.tail_at = None;
    }

    /// Direct commits stop for good; the handle goes with them.
    fn refuse(&mut self) {
        self.refused.store(true, Ordering::Relaxed);
        self.forget_file();
        self.buffer = Vec::new();
    }
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
    /// Zeros written and synced past the end, for the next commits to overwrite.
    pub prepared_bytes: u64,
    /// Zeros written since open around the page cache (direct I/O, where the file system
    /// allows it): they cost no copy into memory the commits would then copy over again.
    pub prepared_direct_bytes: u64,
    /// Commit bytes written since open around the page cache (direct I/O: commits that lie
    /// in prepared space, where the file system allows it).
    pub committed_direct_bytes: u64,
    /// Damaged bytes a repair at open dropped ([`LogOptions::repair`]; 0 when none).
    pub repaired_bytes: u64,
}

/// What [`LogStore::check`] found in a log file (and [`LogStore::repair`] before it repaired).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogCheck {
    /// The file's format version (1 is rewritten in the current one at open).
    pub version: u32,
    /// Commits that verify.
    pub commits: u64,
    /// Peers with at least one commit that verifies.
    pub peers: usize,
    /// The end of the last commit that verifies.
    pub end: u64,
    /// Byte ranges before `end` that belong to no commit that verifies: damage (each was part
    /// of an acknowledged commit). Empty for a sound file.
    pub damaged: Vec<std::ops::Range<u64>>,
    /// Bytes after `end` that are not zeros: a commit a crash cut short (never acknowledged),
    /// cut at open.
    pub torn_tail: u64,
    /// Zeros after `end`: space prepared for commits, kept.
    pub prepared: u64,
}

impl LogCheck {
    /// No damage: the file opens as it is.
    pub fn is_sound(&self) -> bool {
        self.damaged.is_empty()
    }

    /// Bytes of damage in all.
    pub fn damaged_bytes(&self) -> u64 {
        tether_core::substrate::log::bytes_in(&self.damaged)
    }

    fn new(scan: &LogScan, peers: usize) -> Self {
        Self {
            version: scan.format.version(),
            commits: scan.commits,
            peers,
            end: scan.end,
            damaged: scan.damaged.clone(),
            torn_tail: if scan.tail_zeros { 0 } else { scan.tail },
            prepared: if scan.tail_zeros { scan.tail } else { 0 },
        }
    }
}

impl LogStore {
    /// Opens (creating if needed) the log at `path`, replaying it.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with(path, LogOptions::default())
    }

    /// [`LogStore::open`], compacting (and repairing) as `options` say.
    ///
    /// Fails with [`StoreError::Locked`] while another store has the path open, with
    /// [`StoreError::Damaged`] when bytes before the last complete commit fail their checksums
    /// (unless `options.repair`), and with [`StoreError::Corrupt`] or [`StoreError::Schema`]
    /// for a file that is not a tether log of a version this tether reads. A refused file is
    /// left as it was.
    pub fn open_with(path: impl AsRef<Path>, options: LogOptions) -> Result<Self, StoreError> {
        let path = resolved(path.as_ref())?;
        if path
            .extension()
            .is_some_and(|extension| extension == "compact")
        {
            return Err(StoreError::ReservedName { path });
        }
        let lock = lock_path(&path)?;
        // A compaction killed before its rename left its file behind: never the log (the
        // rename is what makes it one), so it goes, under the lock, before it can pile up.
        match std::fs::remove_file(compaction_path(&path)) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => return Err(error.into()),
            _ => {}
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let replayed = replay(&path, &bytes, options.repair)?;
        if let Some(replayed) = &replayed {
            let scan = &replayed.scan;
            if scan.tail > 0 && !scan.tail_zeros {
                // A commit a crash cut short is never acknowledged, but bytes that failed their
                // checksums at the end cannot be told from a last commit damaged in place: they
                // are kept beside the log before they are cut, never destroyed in silence.
                keep_tail(
                    &path,
                    scan.end,
                    &bytes[usize::try_from(scan.end).unwrap_or(usize::MAX)..],
                )?;
            }
        }
        let mut inner = match replayed {
            Some(replayed)
                if replayed.scan.format.version() == LOG_VERSION && replayed.scan.is_sound() =>
            {
                let scan = replayed.scan;
                let found = LogCheck::new(&scan, replayed.states.len());
                let mut inner = Inner::opened(
                    path,
                    scan.format,
                    file,
                    options,
                    scan.end,
                    replayed.states,
                    replayed.index,
                );
                // Anything but zeros after the last commit is a commit that never completed;
                // zeros are space a preparation left.
                inner.torn = !scan.tail_zeros;
                inner.prepared = scan.end + found.prepared;
                inner.find_hole();
                // How much of it is live is not known until a compaction: the next one is due
                // once it is past `compact_bytes_min`.
                inner.snapshot_bytes = scan.format.header_bytes() as u64;
                inner.recovered_tail = found.torn_tail;
                inner
            }
            Some(replayed) => {
                // Version 1, or damage a repair was asked for: every commit that verified is
                // written to a new file in the current format, which replaces the old one.
                let scan = &replayed.scan;
                let found = LogCheck::new(scan, replayed.states.len());
                let format = if scan.format.version() == LOG_VERSION {
                    scan.format
                } else {
                    LogFormat::new(random_salt())
                };
                if !found.is_sound() {
                    tracing::warn!(
                        path = %path.display(),
                        damaged = ?found.damaged,
                        commits_kept = found.commits,
                        "log repaired: damaged bytes dropped, every commit that verifies kept"
                    );
                }
                let fresh = compaction_path(&path);
                let (file, end, index) = write_snapshot(format, &replayed.states, &fresh)?;
                file.sync_all()?;
                std::fs::rename(&fresh, &path)?;
                sync_parent(&path)?;
                let mut inner =
                    Inner::opened(path, format, file, options, end, replayed.states, index);
                inner.recovered_tail = found.torn_tail;
                inner.repaired = (!found.is_sound()).then_some(found);
                inner
            }
            None => {
                // A new file, or one whose header never made it to disk (nothing was
                // committed to it): written from the start.
                let format = LogFormat::new(random_salt());
                let mut header = Vec::new();
                encode_header(format, &mut header);
                file.set_len(0)?;
                file.seek(SeekFrom::Start(0))?;
                file.write_all(&header)?;
                file.sync_all()?;
                sync_parent(&path)?;
                let end = header.len() as u64;
                let mut inner = Inner::opened(
                    path,
                    format,
                    file,
                    options,
                    end,
                    BTreeMap::new(),
                    LogIndex::new(),
                );
                inner.recovered_tail = bytes.len() as u64;
                inner
            }
        };
        let format = inner.format;
        if inner.torn {
            inner.cut_tail()?;
        }
        inner.prepare_at_open();
        inner.compact_at = inner.next_compaction();
        let direct_refused = inner.direct.refused.clone();
        let shared = Arc::new(Shared {
            inner: Mutex::new(inner),
            idle: Condvar::new(),
            closing: AtomicBool::new(false),
            direct_refused,
            #[cfg(test)]
            held: Default::default(),
        });
        Ok(Self {
            _open: Arc::new(Open {
                shared: shared.clone(),
                _lock: lock,
            }),
            shared,
            format,
        })
    }

    /// Reads the log at `path` and reports what it holds without changing it: commits that
    /// verify, damage, a torn tail, prepared space. Fails with [`StoreError::Locked`] while a
    /// store has the path open.
    pub fn check(path: impl AsRef<Path>) -> Result<LogCheck, StoreError> {
        let path = &resolved(path.as_ref())?;
        let _lock = lock_path(path)?;
        let bytes = std::fs::read(path)?;
        Ok(match replay(path, &bytes, true)? {
            Some(replayed) => LogCheck::new(&replayed.scan, replayed.states.len()),
            None => LogCheck {
                version: LOG_VERSION,
                commits: 0,
                peers: 0,
                end: bytes.len() as u64,
                damaged: Vec::new(),
                torn_tail: 0,
                prepared: 0,
            },
        })
    }

    /// Repairs the log at `path` (as an open with [`LogOptions::repair`] does): keeps every
    /// commit that verifies and drops the damaged bytes. Returns what it found before.
    pub fn repair(path: impl AsRef<Path>) -> Result<LogCheck, StoreError> {
        let found = Self::check(&path)?;
        if !found.is_sound() || found.torn_tail > 0 || found.version != LOG_VERSION {
            let options = LogOptions {
                prepare_bytes: 0,
                repair: true,
                ..LogOptions::default()
            };
            drop(Self::open_with(&path, options)?);
        }
        Ok(found)
    }

    /// The file's size, the tail cut at open, and compactions since.
    ///
    /// Takes the store's lock, which a commit holds for its write and sync and a compaction's
    /// swap for its copy, sync and rename: from async code, call it off the workers
    /// (`tokio::task::spawn_blocking`), as the `tether` CLI's `stats` does.
    pub fn stats(&self) -> LogStats {
        let inner = self.lock();
        LogStats {
            bytes: inner.end,
            recovered_tail_bytes: inner.recovered_tail,
            compactions: inner.compactions,
            prepared_bytes: inner.prepared - inner.end,
            prepared_direct_bytes: inner.prepared_direct,
            committed_direct_bytes: inner.direct.bytes,
            repaired_bytes: inner.repaired.as_ref().map_or(0, LogCheck::damaged_bytes),
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
        self.shared.idle.notify_all();
        result
    }

    /// Waits until no compaction is running.
    pub fn wait_compaction(&self) {
        let mut inner = self.lock();
        while inner.compacting {
            inner = self.wait(inner);
        }
    }

    /// Waits until no preparation is running.
    pub fn wait_preparation(&self) {
        let mut inner = self.lock();
        while inner.preparing {
            inner = self.wait(inner);
        }
    }

    fn wait<'a>(&self, inner: MutexGuard<'a, Inner>) -> MutexGuard<'a, Inner> {
        self.shared.wait(inner)
    }

    /// Deletes tombstones and closed objects whose retention ended before `cutoff`, for every
    /// peer (including peers that never reconnect), in one commit per peer that has any.
    /// Returns the records removed.
    pub fn gc(&self, cutoff: Time) -> Result<usize, StoreError> {
        let mut inner = self.lock();
        let mut removed = 0;
        for (peer, state) in inner.state_on_disk(true)? {
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
            let commit = Commit::new(self.format, &peer, records.iter(), self.direct())?;
            inner = self.shared.room(inner, commit.len);
            inner.append(&commit)?;
        }
        drop(inner);
        self.after_commit();
        Ok(removed)
    }

    /// Whether commits may still be written with direct I/O.
    fn direct(&self) -> bool {
        !self.shared.direct_refused.load(Ordering::Relaxed)
    }

    /// Starts what a commit may have made due: a preparation, a compaction.
    fn after_commit(&self) {
        self.prepare_if_due();
        self.compact_if_due();
    }

    /// Starts a preparation on a thread of its own when fewer than half of
    /// [`LogOptions::prepare_bytes`] remain past the end and none runs.
    fn prepare_if_due(&self) {
        let Some(job) = self.lock().prepare_job(true) else {
            return;
        };
        let shared = self.shared.clone();
        let spawned = std::thread::Builder::new()
            .name("tether-log-prepare".to_owned())
            .spawn(move || {
                let result = job.run(&shared.closing);
                shared.lock().prepared(&job, result);
                shared.idle.notify_all();
            });
        if let Err(error) = spawned {
            let mut inner = self.lock();
            inner.preparing = false;
            inner.preparation_failed(&error);
            self.shared.idle.notify_all();
        }
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
                shared.idle.notify_all();
            });
        if let Err(error) = spawned {
            let mut inner = self.lock();
            inner.compacting = false;
            inner.compaction_failed(&error.into());
            self.shared.idle.notify_all();
        }
    }
}

/// Compactions stay held while it lives ([`Shared::hold_compactions`]).
#[cfg(test)]
struct HeldCompactions<'a>(&'a Shared);

#[cfg(test)]
impl Drop for HeldCompactions<'_> {
    fn drop(&mut self) {
        self.0.set_held(false);
    }
}

/// What a compaction took under the lock: the file up to `upto` (whole commits), read
/// through a handle of its own while commits go on, and where every peer's live rows lie in it.
struct Prefix {
    path: PathBuf,
    format: LogFormat,
    reader: File,
    upto: u64,
    live: Vec<(PeerId, LiveRows)>,
}

/// A peer's live rows and where their entries lie, in file order.
type LiveRows = Vec<(RowKey, Range<u64>)>;

/// Where each entry a compaction copied moved: (old start, new start), by old start.
type Moves = Vec<(u64, u64)>;

/// Zeros to write past the end of the file `generation` names, through a handle of their own.
struct Prepare {
    file: File,
    /// The same file opened for direct I/O, when the file system allows it: the whole blocks
    /// among the zeros go to the disk without passing through the page cache.
    direct: Option<File>,
    from: u64,
    to: u64,
    generation: u64,
    /// Zeros written through `direct`.
    direct_bytes: std::cell::Cell<u64>,
}

/// The zeros a preparation writes: block-aligned, as direct I/O needs, and never written, so
/// the process shares one zero page for all of it instead of allocating and clearing a chunk
/// for every preparation.
#[repr(C, align(4096))]
struct Zeros([u8; LOG_PREPARE_CHUNK_BYTES]);

static ZEROS: Zeros = Zeros([0; LOG_PREPARE_CHUNK_BYTES]);

const _: () = assert!(std::mem::align_of::<Zeros>() as u64 == LOG_BLOCK_BYTES);

impl Prepare {
    /// Writes and syncs the zeros: `Ok(false)` when the store closed first. Whole aligned
    /// blocks go through the direct handle while it takes them; the bytes before the first
    /// block boundary and after the last, and everything once a direct write fails, through
    /// the page cache.
    fn run(&self, closing: &AtomicBool) -> std::io::Result<bool> {
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileExt;
            let zeros = &ZEROS.0[..];
            let mut direct = self.direct.as_ref();
            let mut at = self.from;
            while at < self.to {
                if closing.load(Ordering::Acquire) {
                    return Ok(false);
                }
                let left = self.to - at;
                let (chunk, through) = if !at.is_multiple_of(LOG_BLOCK_BYTES) {
                    ((LOG_BLOCK_BYTES - at % LOG_BLOCK_BYTES).min(left), None)
                } else if left < LOG_BLOCK_BYTES {
                    (left, None)
                } else {
                    let whole = left - left % LOG_BLOCK_BYTES;
                    (whole.min(LOG_PREPARE_CHUNK_BYTES as u64), direct)
                };
                let chunk_bytes = usize::try_from(chunk).unwrap_or(LOG_PREPARE_CHUNK_BYTES);
                match through {
                    Some(file) => {
                        if let Err(error) = file.write_all_at(&zeros[..chunk_bytes], at) {
                            // The same zeros go through the page cache instead.
                            tracing::debug!(%error, "direct log preparation refused");
                            direct = None;
                            continue;
                        }
                        self.direct_bytes.set(self.direct_bytes.get() + chunk);
                    }
                    None => self.file.write_all_at(&zeros[..chunk_bytes], at)?,
                }
                at += chunk;
            }
            self.file.sync_data()?;
            Ok(true)
        }
        #[cfg(not(unix))]
        {
            let _ = closing;
            Ok(false)
        }
    }
}

/// `path` opened for writing with direct I/O (Linux), or none where that is refused (tmpfs,
/// say) or not offered.
fn open_direct(path: &Path) -> Option<File> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = path;
        None
    }
}

/// [`open_direct`], only when what `path` names is `log` itself (the same device and inode):
/// never a file renamed over the log from outside.
fn open_direct_on(path: &Path, log: &File) -> Option<File> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let inode = |file: &File| file.metadata().map(|m| (m.dev(), m.ino())).ok();
        let direct = open_direct(path)?;
        (inode(&direct).is_some() && inode(&direct) == inode(log)).then_some(direct)
    }
    #[cfg(not(unix))]
    {
        let _ = (path, log);
        None
    }
}

/// Where a run of whole blocks may start in `buffer` so that its memory is aligned as direct
/// I/O wants (the buffer holds a block more than the run).
fn block_aligned(buffer: &[u8]) -> usize {
    buffer
        .as_ptr()
        .align_offset(LOG_BLOCK_BYTES as usize)
        .min(LOG_BLOCK_BYTES as usize)
}

/// Writes every byte of `slices`, in order, with as few calls as the kernel allows (one for
/// the whole, as a rule).
fn write_all_vectored(file: &mut File, mut slices: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match file.write_vectored(slices) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(written) => IoSlice::advance_slices(&mut slices, written),
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// Whether a file written up to `written` and again from `from` on has no hole between: every
/// byte between lies in a block one of the two writes touched (the file system allocated it,
/// and it reads as zeros past what was written).
fn no_hole_between(written: u64, from: u64) -> bool {
    from - from % LOG_BLOCK_BYTES <= block_end(written)
}

/// `at` rounded up to a whole [`LOG_BLOCK_BYTES`].
fn block_end(at: u64) -> u64 {
    at.div_ceil(LOG_BLOCK_BYTES).saturating_mul(LOG_BLOCK_BYTES)
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, inner: MutexGuard<'a, Inner>) -> MutexGuard<'a, Inner> {
        self.idle
            .wait(inner)
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Holds compactions at the point between their snapshot and their swap until the guard
    /// is dropped (also when a test panics, so the store's drop never waits on a held one).
    #[cfg(test)]
    fn hold_compactions(&self) -> HeldCompactions<'_> {
        self.set_held(true);
        HeldCompactions(self)
    }

    #[cfg(test)]
    fn set_held(&self, hold: bool) {
        let (held, changed) = &self.held;
        *held.lock().unwrap_or_else(PoisonError::into_inner) = hold;
        changed.notify_all();
    }

    #[cfg(test)]
    fn wait_while_held(&self) {
        let (held, changed) = &self.held;
        let mut held = held.lock().unwrap_or_else(PoisonError::into_inner);
        while *held {
            held = changed.wait(held).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Waits until `commit` can be written without racing a preparation: while one runs, a
    /// commit stays below where its zeros start, and a torn tail is not cut.
    fn room<'a>(&self, mut inner: MutexGuard<'a, Inner>, commit: usize) -> MutexGuard<'a, Inner> {
        while self.in_the_way(&inner, commit) {
            inner = self.wait(inner);
        }
        inner
    }

    /// A running preparation is in the way of `commit`: it would write where the zeros go,
    /// or cut a torn tail they lie behind.
    fn in_the_way(&self, inner: &Inner, commit: usize) -> bool {
        inner.preparing && (inner.torn || inner.end + commit as u64 > inner.preparing_from)
    }

    /// Copies the live rows' entries of `prefix` (each verified) to `<path>.compact` without
    /// the lock, then under it appends the commits made meanwhile, syncs, and renames the file
    /// over the log.
    fn finish_compaction(&self, prefix: Prefix) -> Result<(), StoreError> {
        let fresh = compaction_path(&prefix.path);
        let result = write_file(&[], &fresh)
            .and_then(|file| {
                copy_live(&prefix, &file).map(|(snapshot, moved)| (file, snapshot, moved))
            })
            .and_then(|(file, snapshot, moved)| {
                #[cfg(test)]
                self.wait_while_held();
                let mut inner = self.lock();
                if self.closing.load(Ordering::Acquire) {
                    // The store is closing (and may be reopened): the log stays as it is.
                    return Err(StoreError::Io(std::io::Error::other(
                        "the log store closed",
                    )));
                }
                inner.swap_in(file, &fresh, prefix.upto, snapshot, &moved)
            });
        let mut inner = self.lock();
        inner.compacting = false;
        if let Err(error) = &result {
            let _ = std::fs::remove_file(&fresh);
            inner.compaction_failed(error);
        }
        result
    }
}

/// `states` as a file of one commit per peer in `format`, written to `fresh` (not yet synced);
/// the file, its size and where its rows lie.
fn write_snapshot(
    format: LogFormat,
    states: &BTreeMap<PeerId, DurableState>,
    fresh: &Path,
) -> Result<(File, u64, LogIndex), StoreError> {
    let mut out = Vec::new();
    let mut index = LogIndex::new();
    encode_header(format, &mut out);
    for (peer, state) in states {
        encode_begin(format, peer.as_str(), &mut out);
        index.known(peer);
        for record in snapshot_records(state) {
            let start = out.len() as u64;
            encode_record(format, &record, &mut out);
            index.record(peer, &record, start..out.len() as u64);
        }
        encode_commit(format, &mut out);
    }
    let file = write_file(&out, fresh)?;
    Ok((file, out.len() as u64, index))
}

/// A new file at `path` (replacing any there) holding `bytes`, not yet synced.
fn write_file(bytes: &[u8], path: &Path) -> Result<File, StoreError> {
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    file.write_all(bytes)?;
    Ok(file)
}

/// Writes the compacted file to `out`: the header, then one commit per peer of `prefix`
/// holding its live rows' entries copied from the old file in file order, each verified as
/// its row's record first. Every entry's place in the new file follows from the index alone
/// (each peer's entries lie between its begin and commit, in file order), so the entries of all
/// peers are read in one pass in file order, those lying close together at once (the old file
/// is read at most once whatever the peers' rows interleave), and each is written where it
/// goes, gathered in runs per peer of at most [`LOG_COMPACT_READ_BYTES`] together
/// ([`PlacedWrites`]): a compaction holds those and one read window, never the live rows'
/// bytes whole. The new file's length, and where each entry moved (old start, new start), by
/// old start.
fn copy_live(prefix: &Prefix, out: &File) -> Result<(u64, Moves), StoreError> {
    let mut rows: Vec<(&Range<u64>, usize, &RowKey)> = prefix
        .live
        .iter()
        .enumerate()
        .flat_map(|(peer, (_, rows))| rows.iter().map(move |(key, at)| (at, peer, key)))
        .collect();
    rows.sort_unstable_by_key(|(at, _, _)| at.start);
    // The frames around the entries, where they go, and where each peer's entries start.
    let mut framing = Vec::with_capacity(1 + 2 * prefix.live.len());
    let mut length = 0u64;
    // Each frame goes where the file has reached, and the file goes on after it.
    let mut place = |frame: Vec<u8>, length: &mut u64| {
        let at = *length;
        *length += frame.len() as u64;
        framing.push((at, frame));
    };
    let mut frame = Vec::new();
    encode_header(prefix.format, &mut frame);
    place(std::mem::take(&mut frame), &mut length);
    let mut next = Vec::with_capacity(prefix.live.len());
    for (peer, live) in &prefix.live {
        encode_begin(prefix.format, peer.as_str(), &mut frame);
        place(std::mem::take(&mut frame), &mut length);
        next.push(length);
        for (_, at) in live {
            length = at
                .end
                .checked_sub(at.start)
                .and_then(|bytes| length.checked_add(bytes))
                .ok_or_else(|| {
                    index_error(&prefix.path, IndexError::Unplaced { at: at.clone() })
                })?;
        }
        encode_commit(prefix.format, &mut frame);
        place(std::mem::take(&mut frame), &mut length);
    }
    let mut moved = Vec::with_capacity(rows.len());
    let mut window = Window::default();
    let mut writer = PlacedWrites::new(out, prefix.live.len());
    for (position, (at, peer, key)) in rows.iter().enumerate() {
        if at.end > prefix.upto {
            return Err(index_error(
                &prefix.path,
                IndexError::Unplaced { at: (*at).clone() },
            ));
        }
        let ends = rows[position..].iter().map(|(at, _, _)| at.end);
        let bytes = window.read(&prefix.reader, at, ends)?;
        verify_entry(prefix.format, key, at, bytes)
            .map_err(|error| index_error(&prefix.path, error))?;
        let to = next[*peer];
        next[*peer] += bytes.len() as u64;
        moved.push((at.start, to));
        writer.write_at(*peer, to, bytes)?;
    }
    writer.flush()?;
    for (at, bytes) in framing {
        write_all_at(out, &bytes, at)?;
    }
    debug_assert!(moved.is_sorted(), "rows are copied in file order");
    Ok((length, moved))
}

/// Writes at given places in a file, each peer's bytes gathered while they follow one another
/// in its region: a run is written when the next bytes do not follow it, and every run once
/// they hold more than [`LOG_COMPACT_READ_BYTES`] together (so at most that, plus one entry of
/// at most [`LOG_ENTRY_BYTES_MAX`]). Peers whose rows interleave in the old file then still
/// cost a write per run, not per row.
struct PlacedWrites<'a> {
    file: &'a File,
    /// Per peer: where its run goes, and the run.
    runs: Vec<(u64, Vec<u8>)>,
    /// Bytes held in all runs.
    held: usize,
}

impl<'a> PlacedWrites<'a> {
    fn new(file: &'a File, peers: usize) -> Self {
        Self {
            file,
            runs: vec![(0, Vec::new()); peers],
            held: 0,
        }
    }

    /// `bytes` at `at`, in `peer`'s region.
    fn write_at(&mut self, peer: usize, at: u64, bytes: &[u8]) -> std::io::Result<()> {
        let (start, run) = &self.runs[peer];
        if !run.is_empty() && start + run.len() as u64 != at {
            self.write_run(peer)?;
        }
        let (start, run) = &mut self.runs[peer];
        if run.is_empty() {
            *start = at;
        }
        run.extend_from_slice(bytes);
        self.held += bytes.len();
        if self.held > LOG_COMPACT_READ_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    /// Writes every run held.
    fn flush(&mut self) -> std::io::Result<()> {
        for peer in 0..self.runs.len() {
            self.write_run(peer)?;
        }
        Ok(())
    }

    fn write_run(&mut self, peer: usize) -> std::io::Result<()> {
        let (start, run) = &mut self.runs[peer];
        if !run.is_empty() {
            write_all_at(self.file, run, *start)?;
            self.held -= run.len();
            // Its room goes too: held bytes stay within the bound whatever the peers.
            *run = Vec::new();
        }
        Ok(())
    }

    /// The bytes held now (at most [`LOG_COMPACT_READ_BYTES`] plus one entry).
    #[cfg(test)]
    fn held(&self) -> usize {
        self.held
    }
}

/// Writes all of `bytes` at `at`.
fn write_all_at(file: &File, bytes: &[u8], at: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::write_all_at(file, bytes, at)
    }
    #[cfg(not(unix))]
    {
        let mut file = file;
        file.seek(SeekFrom::Start(at))?;
        file.write_all(bytes)
    }
}

/// A read of the old file that serves entries lying close together from one read.
#[derive(Default)]
struct Window {
    /// Where `bytes` start in the file.
    start: u64,
    bytes: Vec<u8>,
}

impl Window {
    /// The bytes at `at`, read (with the entries whose `ends`, in file order from `at`'s on,
    /// lie within [`LOG_COMPACT_READ_BYTES`] of it) unless the last read holds them.
    fn read(
        &mut self,
        mut file: &File,
        at: &Range<u64>,
        ends: impl Iterator<Item = u64>,
    ) -> Result<&[u8], StoreError> {
        let held = self.start..self.start + self.bytes.len() as u64;
        if !(held.start <= at.start && at.end <= held.end) {
            let reach = at.start.saturating_add(LOG_COMPACT_READ_BYTES as u64);
            let end = ends
                .take_while(|end| *end <= reach)
                .last()
                .unwrap_or(at.end)
                .max(at.end);
            self.bytes
                .resize(usize::try_from(end - at.start).unwrap_or(usize::MAX), 0);
            file.seek(SeekFrom::Start(at.start))?;
            file.read_exact(&mut self.bytes)?;
            self.start = at.start;
        }
        let from = usize::try_from(at.start - self.start).unwrap_or(usize::MAX);
        let to = usize::try_from(at.end - self.start).unwrap_or(usize::MAX);
        Ok(&self.bytes[from..to])
    }
}

/// What a compaction that found its index wrong (or the file damaged where a live row lies)
/// fails with: the log stays as it was.
fn index_error(path: &Path, error: IndexError) -> StoreError {
    match error {
        IndexError::Entry { at, .. } => StoreError::Damaged {
            path: path.to_owned(),
            offset: at.start,
            bytes: at.end - at.start,
        },
        other => StoreError::Corrupt {
            table: "log",
            detail: other.to_string(),
        },
    }
}

/// Writes the tail a replay cuts (from byte `end` of the log) to `<path>.torn-<end>`, synced,
/// and warns: what the store cuts at open can still be read by hand.
fn keep_tail(path: &Path, end: u64, tail: &[u8]) -> Result<(), StoreError> {
    let mut kept = path.as_os_str().to_owned();
    kept.push(format!(".torn-{end}"));
    let kept = PathBuf::from(kept);
    let mut file = File::create(&kept)?;
    file.write_all(tail)?;
    file.sync_all()?;
    sync_parent(&kept)?;
    tracing::warn!(
        path = %path.display(),
        kept = %kept.display(),
        bytes = tail.len(),
        "the log's tail after its last complete commit was cut (a commit a crash cut short); its bytes are kept"
    );
    Ok(())
}

/// A salt for a new file (the OS's randomness).
fn random_salt() -> u64 {
    use rand::TryRng;
    let mut bytes = [0u8; 8];
    rand::rngs::SysRng
        .try_fill_bytes(&mut bytes)
        .expect("the OS provides randomness");
    u64::from_le_bytes(bytes)
}

/// One commit of `records` for `peer`, sized before a byte of it is encoded: its length,
/// where each record's entry lies in it, and every record checked against the entry bound.
/// Sized first, the direct path lays the write out and encodes the commit straight into the
/// aligned buffer it writes from, so a body is copied once between the peer and the disk.
struct Commit<'a, R> {
    format: LogFormat,
    peer: &'a PeerId,
    records: R,
    len: usize,
    spans: Vec<Range<u64>>,
    /// The bytes, encoded before the store's lock, of a commit that cannot go direct (over
    /// [`LOG_DIRECT_COMMIT_BYTES_MAX`], or where there is no direct I/O): it would gain no
    /// copy from being encoded under the lock and would hold the lock while it is.
    encoded: Option<Vec<u8>>,
}

impl<'a, R: Iterator<Item = &'a Record> + Clone> Commit<'a, R> {
    /// `direct`: whether a direct write may still take it (else it is encoded at once).
    fn new(
        format: LogFormat,
        peer: &'a PeerId,
        records: R,
        direct: bool,
    ) -> Result<Self, StoreError> {
        let mut spans = Vec::with_capacity(records.size_hint().0);
        let mut at = encoded_begin_len(peer.as_str());
        for record in records.clone() {
            let len = encoded_record_len(record);
            if len - LOG_ENTRY_HEADER_BYTES > LOG_ENTRY_BYTES_MAX {
                return Err(StoreError::Corrupt {
                    table: "log",
                    detail: format!("a record of {len} bytes is over the log's entry bound"),
                });
            }
            spans.push(at as u64..(at + len) as u64);
            at += len;
        }
        let mut commit = Self {
            format,
            peer,
            records,
            len: at + encoded_commit_len(),
            spans,
            encoded: None,
        };
        if !direct || !cfg!(target_os = "linux") || commit.len > LOG_DIRECT_COMMIT_BYTES_MAX {
            commit.encoded = Some(commit.encode()?);
        }
        Ok(commit)
    }

    /// Appends the commit's bytes to `out`: exactly [`Commit::len`] of them, or an error
    /// before anything is written (sizing and encoding run the same code in core).
    fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), StoreError> {
        let start = out.len();
        encode_begin(self.format, self.peer.as_str(), out);
        for record in self.records.clone() {
            encode_record(self.format, record, out);
        }
        encode_commit(self.format, out);
        if out.len() - start != self.len {
            return Err(StoreError::Corrupt {
                table: "log",
                detail: format!(
                    "a commit sized at {} bytes encoded to {}",
                    self.len,
                    out.len() - start
                ),
            });
        }
        Ok(())
    }

    /// The commit's bytes on their own.
    fn encode(&self) -> Result<Vec<u8>, StoreError> {
        let mut out = Vec::with_capacity(self.len);
        self.encode_into(&mut out)?;
        Ok(out)
    }

    /// The commit's bytes for the page cache: as encoded before the lock, or encoded now.
    fn bytes(&self) -> Result<std::borrow::Cow<'_, [u8]>, StoreError> {
        match &self.encoded {
            Some(bytes) => Ok(std::borrow::Cow::Borrowed(bytes)),
            None => self.encode().map(std::borrow::Cow::Owned),
        }
    }
}

/// How a commit goes to the file: laid out in the direct buffer from an offset, or as bytes
/// through the page cache.
enum Staged<'c> {
    Direct(usize),
    Cached(std::borrow::Cow<'c, [u8]>),
}

/// One commit of `records` for `peer`, as the log's bytes, with where each record's entry lies
/// in them.
#[cfg(test)]
fn encode<'a>(
    format: LogFormat,
    peer: &'a PeerId,
    records: impl Iterator<Item = &'a Record> + Clone,
) -> Result<(Vec<u8>, Vec<Range<u64>>), StoreError> {
    let commit = Commit::new(format, peer, records, true)?;
    Ok((commit.bytes()?.into_owned(), commit.spans))
}

impl Inner {
    /// A log just opened: the next commit goes at `end`, the file holds `states` and nothing
    /// past `end`; no background work has started.
    fn opened(
        path: PathBuf,
        format: LogFormat,
        file: File,
        options: LogOptions,
        end: u64,
        states: BTreeMap<PeerId, DurableState>,
        index: LogIndex,
    ) -> Self {
        Self {
            path,
            format,
            file,
            end,
            torn: false,
            snapshot_bytes: end,
            peers: states.keys().cloned().collect(),
            index,
            replayed: states,
            recovered_tail: 0,
            repaired: None,
            compactions: 0,
            options,
            compacting: false,
            rename_unsynced: false,
            compact_at: 0,
            prepared: end,
            ahead: None,
            preparing: false,
            preparing_from: 0,
            prepare_after: 0,
            generation: 0,
            prepared_direct: 0,
            direct: DirectCommits::default(),
            #[cfg(test)]
            failing_syncs: 0,
        }
    }

    /// The zeros found past the end at open are prepared space up to the first hole in them
    /// (a store closed or crashed while zeros it prepared lay past a hole); the zeros after
    /// the hole wait as zeros ahead, as before the close. A file system that reports no holes
    /// (or a platform that cannot ask) leaves them all prepared.
    fn find_hole(&mut self) {
        #[cfg(unix)]
        {
            use rustix::fs::{seek, SeekFrom};
            let Ok(hole) = seek(&self.file, SeekFrom::Hole(self.end)) else {
                return;
            };
            if hole >= self.prepared {
                return;
            }
            // The hole starts at the end or after it, and before the zeros' end.
            let zeros_end = self.prepared;
            self.prepared = hole;
            // Data after the hole and before the zeros' end: the zeros ahead (none when the
            // rest is a hole, which the file system reports as an error).
            if let Ok(data) = seek(&self.file, SeekFrom::Data(hole)) {
                if data < zeros_end {
                    self.ahead = Some(data..zeros_end);
                }
            }
        }
    }

    /// Syncs a commit just written.
    fn sync_commit(&mut self) -> std::io::Result<()> {
        self.file.sync_data()?;
        #[cfg(test)]
        if self.failing_syncs > 0 {
            self.failing_syncs -= 1;
            return Err(std::io::Error::other("a sync failed (injected)"));
        }
        Ok(())
    }

    /// Lays out a direct write of `commit` at `end`, when every block it touches is prepared
    /// space and it is at most [`LOG_DIRECT_COMMIT_BYTES_MAX`]: the direct buffer then holds,
    /// from an aligned start, the bytes of the block `end` lies in before it, the commit
    /// encoded in place, and zeros to the end of its last block. Where the write starts in the
    /// buffer, or `None` (nothing is encoded: the commit goes through the page cache). Nothing
    /// touches the file.
    fn stage_direct<'a, R: Iterator<Item = &'a Record> + Clone>(
        &mut self,
        commit: &Commit<'a, R>,
    ) -> Result<Option<usize>, StoreError> {
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::fs::FileExt;
            let block = LOG_BLOCK_BYTES as usize;
            let written = self.end + commit.len as u64;
            let start = self.end - self.end % LOG_BLOCK_BYTES;
            let stop = block_end(written);
            let direct = &mut self.direct;
            if direct.refused.load(Ordering::Relaxed)
                || stop > self.prepared
                || commit.len > LOG_DIRECT_COMMIT_BYTES_MAX
            {
                return Ok(None);
            }
            if direct
                .file
                .as_ref()
                .is_none_or(|(generation, _)| *generation != self.generation)
            {
                // Under the store's lock, where the path names the file written.
                let Some(file) = open_direct_on(&self.path, &self.file) else {
                    direct.refuse();
                    return Ok(None);
                };
                direct.file = Some((self.generation, file));
            }
            let head = usize::try_from(self.end - start).unwrap_or(0);
            if direct.tail_at != Some((self.generation, self.end)) {
                direct.tail.resize(head, 0);
                if let Err(error) = self.file.read_exact_at(&mut direct.tail, start) {
                    tracing::debug!(%error, "the log's last block did not read back");
                    direct.tail_at = None;
                    return Ok(None);
                }
            }
            let len = usize::try_from(stop - start).unwrap_or(usize::MAX);
            // Room for the write and its alignment first, so that nothing below moves it.
            debug_assert_eq!(direct.tail.len(), head, "the block's head is kept whole");
            let buffer = &mut direct.buffer;
            buffer.clear();
            buffer.reserve_exact(len + block);
            let skip = block_aligned(buffer);
            buffer.resize(skip, 0);
            buffer.extend_from_slice(&direct.tail);
            commit.encode_into(buffer)?;
            buffer.resize(skip + len, 0);
            Ok(Some(skip))
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = commit;
            Ok(None)
        }
    }

    /// Writes the direct write laid out from `skip` in the direct buffer, for a commit of
    /// `len` bytes at `end`. On a refusal the buffer is handed back, so that the commit it
    /// holds goes through the page cache instead (which the refused write may have left at
    /// either the zeros or the same bytes).
    fn write_staged(&mut self, skip: usize, len: usize) -> Result<(), Vec<u8>> {
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::fs::FileExt;
            let written = self.end + len as u64;
            let start = self.end - self.end % LOG_BLOCK_BYTES;
            let direct = &mut self.direct;
            direct.tail_at = None;
            let Some((_, file)) = direct.file.as_ref() else {
                return Err(std::mem::take(&mut direct.buffer));
            };
            if let Err(error) = file.write_all_at(&direct.buffer[skip..], start) {
                tracing::debug!(%error, "direct log commit refused");
                let buffer = std::mem::take(&mut direct.buffer);
                direct.refuse();
                return Err(buffer);
            }
            // The block the next commit starts in, as just written.
            let next = written - written % LOG_BLOCK_BYTES;
            let from = skip + usize::try_from(next - start).unwrap_or(0);
            let to = skip + usize::try_from(written - start).unwrap_or(0);
            direct.tail.clear();
            direct.tail.extend_from_slice(&direct.buffer[from..to]);
            direct.tail_at = Some((self.generation, written));
            Ok(())
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = (skip, len);
            Err(Vec::new())
        }
    }

    /// Writes `commit` at the end and syncs it, then notes where its rows lie (each record's
    /// entry at its span) and applies it to the state replayed at open if its peer has not
    /// loaded that yet.
    fn append<'a, R: Iterator<Item = &'a Record> + Clone>(
        &mut self,
        commit: &Commit<'a, R>,
    ) -> Result<(), StoreError> {
        self.sync_rename()?;
        if self.torn {
            self.cut_tail()?;
        }
        // Encoded in place for a direct write, or on its own for the page cache, before
        // anything is written: an encoding that fails leaves the file and `torn` as they were.
        let staged = match self.stage_direct(commit)? {
            Some(skip) => Staged::Direct(skip),
            None => Staged::Cached(commit.bytes()?),
        };
        // From here until the sync returns, bytes past `end` may be on disk: a failure leaves
        // them to be cut before the next write (and a crash leaves them to replay's cut).
        self.torn = true;
        let direct = match staged {
            Staged::Direct(skip) => match self.write_staged(skip, commit.len) {
                Ok(()) => true,
                Err(buffer) => {
                    // The commit as encoded there, after the head of the block it starts in.
                    let at = skip + usize::try_from(self.end % LOG_BLOCK_BYTES).unwrap_or(0);
                    self.write_cached(&buffer[at..at + commit.len])?;
                    false
                }
            },
            Staged::Cached(bytes) => {
                self.write_cached(&bytes)?;
                false
            }
        };
        self.sync_commit()?;
        let len = commit.len as u64;
        if direct {
            self.direct.bytes += len;
        }
        self.torn = false;
        let at = self.end;
        for (record, span) in commit.records.clone().zip(&commit.spans) {
            self.index
                .record(commit.peer, record, at + span.start..at + span.end);
        }
        self.end += len;
        self.prepared = self.prepared.max(self.end);
        if let Some(ahead) = self
            .ahead
            .take_if(|ahead| no_hole_between(self.prepared, ahead.start))
        {
            self.prepared = self.prepared.max(ahead.end);
        }
        if !self.peers.contains(commit.peer) {
            self.peers.insert(commit.peer.clone());
        }
        if let Some(state) = self.replayed.get_mut(commit.peer) {
            // Only before the peer's first load (its machine loads before it commits).
            state.apply_records(commit.records.clone());
        }
        Ok(())
    }

    /// Writes `bytes` at `end` through the page cache.
    fn write_cached(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        self.file.seek(SeekFrom::Start(self.end))?;
        // Within prepared space, zeros to the end of the last block the commit writes (the
        // file holds zeros there already), in the same write: a block the page cache lacks
        // (zeros written with direct I/O are not in it) is then written whole, never read
        // from the disk first to fill in the rest, and the next commit starts in a block the
        // page cache holds. Past the prepared space the file grows: nothing there to read.
        let written = self.end + bytes.len() as u64;
        let padded = block_end(written).min(self.prepared.max(written));
        const ZEROS: [u8; LOG_BLOCK_BYTES as usize] = [0; LOG_BLOCK_BYTES as usize];
        let pad = &ZEROS[..usize::try_from(padded - written).unwrap_or(0)];
        write_all_vectored(
            &mut self.file,
            &mut [IoSlice::new(bytes), IoSlice::new(pad)],
        )?;
        Ok(())
    }

    /// Zeros to write when fewer than half of `prepare_bytes` remain past the end and no
    /// preparation runs; marks one running. Beside commits (`beside_commits`) they start at
    /// least half of `prepare_bytes` past the end, so commits go on below them (growing the
    /// file until they reach the zeros) instead of waiting for them; at open, right after the
    /// zeros already there.
    fn prepare_job(&mut self, beside_commits: bool) -> Option<Prepare> {
        let want = self.options.prepare_bytes;
        let gap = if beside_commits { want / 2 } else { 0 };
        if !cfg!(unix)
            || want == 0
            || self.preparing
            || self.ahead.is_some()
            || self.end < self.prepare_after
            || self.prepared - self.end >= want / 2
        {
            return None;
        }
        let file = match self.file.try_clone() {
            Ok(file) => file,
            Err(error) => {
                self.preparation_failed(&error);
                return None;
            }
        };
        self.preparing = true;
        self.preparing_from = self.prepared.max(self.end + gap);
        Some(Prepare {
            file,
            // Opened under the lock, so that it is the file `generation` names.
            direct: open_direct_on(&self.path, &self.file),
            from: self.preparing_from,
            to: self.end + want,
            generation: self.generation,
            direct_bytes: std::cell::Cell::new(0),
        })
    }

    /// Prepares the whole of `prepare_bytes` before the first commit (a failure is logged and
    /// left to the commits' own preparations).
    fn prepare_at_open(&mut self) {
        if let Some(job) = self.prepare_job(false) {
            let result = job.run(&AtomicBool::new(false));
            self.prepared(&job, result);
        }
    }

    /// A preparation ended: its zeros count if they are in the file the store still writes.
    fn prepared(&mut self, job: &Prepare, result: std::io::Result<bool>) {
        self.preparing = false;
        self.prepared_direct += job.direct_bytes.get();
        match result {
            // Zeros that start blocks past the prepared space leave a hole before them (the
            // file grew over it without writing it): they wait until the commits reach them.
            Ok(true)
                if job.generation == self.generation
                    && !no_hole_between(self.prepared, job.from) =>
            {
                self.ahead = Some(job.from..job.to);
            }
            Ok(true) if job.generation == self.generation => {
                self.prepared = self.prepared.max(job.to);
            }
            Ok(_) => {}
            Err(error) => self.preparation_failed(&error),
        }
    }

    /// A preparation failed (a full disk, say): commits grow the file as they would without
    /// one, and the next is tried once the log has grown by another `prepare_bytes`.
    fn preparation_failed(&mut self, error: &std::io::Error) {
        tracing::warn!(%error, path = %self.path.display(), "log preparation failed");
        self.prepare_after = self.end.saturating_add(self.options.prepare_bytes);
    }

    /// The size at which the compaction after the last snapshot starts.
    fn next_compaction(&self) -> u64 {
        self.options.compact_bytes_min.max(
            self.options
                .compact_growth
                .saturating_mul(self.snapshot_bytes),
        )
    }

    /// Marks a compaction running and hands out what it reads: the file up to `end`, and
    /// where every peer's live rows lie in it.
    fn begin_compaction(&mut self) -> Result<Prefix, StoreError> {
        let reader = File::open(&self.path)?;
        self.compacting = true;
        Ok(Prefix {
            path: self.path.clone(),
            format: self.format,
            reader,
            upto: self.end,
            live: self
                .peers
                .iter()
                .map(|peer| (peer.clone(), self.index.entries(peer)))
                .collect(),
        })
    }

    /// Appends the commits after `upto` to the snapshot in `file` (of `snapshot` bytes, the
    /// live rows before `upto` moved as `moved` says), syncs it and renames it over the log,
    /// which it then is.
    fn swap_in(
        &mut self,
        mut file: File,
        fresh: &Path,
        upto: u64,
        snapshot: u64,
        moved: &[(u64, u64)],
    ) -> Result<(), StoreError> {
        let index = self
            .index
            .relocated(upto, snapshot, moved)
            .map_err(|error| index_error(&self.path, error))?;
        // The commits made meanwhile, copied file to file (by the kernel where it can).
        let since = self.end - upto;
        self.file.seek(SeekFrom::Start(upto))?;
        file.seek(SeekFrom::Start(snapshot))?;
        if std::io::copy(&mut (&self.file).take(since), &mut file)? != since {
            return Err(StoreError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        file.sync_all()?;
        std::fs::rename(fresh, &self.path)?;
        // The path now names the new file: commits go there from here on, whatever follows.
        self.file = file;
        self.index = index;
        self.generation += 1;
        self.direct.forget_file();
        self.end = snapshot + since;
        self.prepared = self.end;
        self.ahead = None;
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
        self.generation += 1;
        self.direct.forget_file();
        self.prepared = self.end;
        self.ahead = None;
        self.file.set_len(self.end)?;
        self.file.sync_all()?;
        self.torn = false;
        Ok(())
    }

    /// Every peer's state as the file holds it (replayed from its bytes).
    /// Every peer's state as the file holds it; `transient` as [`replay_prefix`] takes it.
    fn state_on_disk(
        &mut self,
        transient: bool,
    ) -> Result<BTreeMap<PeerId, DurableState>, StoreError> {
        replay_prefix(&self.path, &self.file, self.end, transient)
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

/// What a log's bytes hold: every peer's state from the commits that verify, where their
/// live rows lie, and the scan.
struct Replayed {
    states: BTreeMap<PeerId, DurableState>,
    index: LogIndex,
    scan: LogScan,
}

/// Replays a log's bytes; `None` when they are empty or the start of a header. A header of
/// another format or version is an error, and so is damage before the last complete commit
/// unless `repair` (then every commit that verifies is applied, in file order). A torn or
/// zeroed tail ends the replay.
fn replay(path: &Path, bytes: &[u8], repair: bool) -> Result<Option<Replayed>, StoreError> {
    replay_in(path, bytes, None, repair)
}

/// [`replay`]; with `shared` (the buffer `bytes` is), the states' bodies are slices of it.
fn replay_in(
    path: &Path,
    bytes: &[u8],
    shared: Option<&bytes::Bytes>,
    repair: bool,
) -> Result<Option<Replayed>, StoreError> {
    let mut states: BTreeMap<PeerId, DurableState> = BTreeMap::new();
    let mut index = LogIndex::new();
    let on_commit = |commit: tether_core::substrate::log::ScannedCommit| {
        index.scanned(&commit);
        states
            .entry(PeerId::new(commit.peer))
            .or_default()
            .apply_records(&commit.records);
    };
    let scanned = match shared {
        Some(shared) => scan_shared(shared, on_commit),
        None => scan(bytes, on_commit),
    };
    let scan = match scanned {
        Ok(Some(scan)) => scan,
        Ok(None) => return Ok(None),
        Err(LogError::Version(version)) => {
            return Err(StoreError::Schema {
                store: "log",
                found: i64::from(version),
                reads: i64::from(LOG_VERSION),
            })
        }
        Err(error) => {
            return Err(StoreError::Corrupt {
                table: "log",
                detail: error.to_string(),
            })
        }
    };
    if let Some(first) = scan.damaged.first() {
        if !repair {
            return Err(StoreError::Damaged {
                path: path.to_owned(),
                offset: first.start,
                bytes: scan.damaged_bytes(),
            });
        }
    }
    Ok(Some(Replayed {
        states,
        index,
        scan,
    }))
}

/// Every peer's state in the first `upto` bytes of `file` (whole commits, all acknowledged:
/// any byte of them that fails its checksum is damage). `transient` when the states are
/// dropped soon (a compaction, a gc): their bodies are then slices of the bytes read, not
/// copies (a slice keeps all of them alive, which a state a peer keeps must not).
fn replay_prefix(
    path: &Path,
    mut file: &File,
    upto: u64,
    transient: bool,
) -> Result<BTreeMap<PeerId, DurableState>, StoreError> {
    let mut bytes = vec![0; usize::try_from(upto).unwrap_or(usize::MAX)];
    file.seek(SeekFrom::Start(0))?;
    file.read_exact(&mut bytes)?;
    let replayed = if transient {
        let shared = bytes::Bytes::from(bytes);
        replay_in(path, &shared, Some(&shared), false)?
    } else {
        replay(path, &bytes, false)?
    };
    let Some(replayed) = replayed else {
        return Ok(BTreeMap::new());
    };
    if replayed.scan.end != upto {
        return Err(StoreError::Damaged {
            path: path.to_owned(),
            offset: replayed.scan.end,
            bytes: upto - replayed.scan.end,
        });
    }
    Ok(replayed.states)
}

/// Where a compaction writes the new file: the log's path with `.compact` appended (never the
/// log itself, whatever its name).
fn compaction_path(path: &Path) -> PathBuf {
    let mut fresh = path.as_os_str().to_owned();
    fresh.push(".compact");
    PathBuf::from(fresh)
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
        Ok(inner.state_on_disk(false)?.remove(peer).unwrap_or_default())
    }

    fn commit(&self, peer: &PeerId, batches: &[PersistBatch]) -> Result<(), StoreError> {
        let records = effective_records(batches);
        // Sized and checked before the lock; encoded under it, into the buffer it is written
        // from (a commit's encoding is a copy of its bodies, short beside its sync).
        let commit = Commit::new(self.format, peer, records.iter().copied(), self.direct())?;
        let mut inner = self.shared.room(self.lock(), commit.len);
        inner.append(&commit)?;
        drop(inner);
        self.after_commit();
        Ok(())
    }

    /// Only when the lock is free at once and no preparation is in the commit's way (so it
    /// waits on its own write and sync alone, never behind a compaction's swap or zeros).
    fn commit_in_place(
        &self,
        peer: &PeerId,
        batches: &[PersistBatch],
    ) -> Option<Result<(), StoreError>> {
        let records = effective_records(batches);
        let commit = match Commit::new(self.format, peer, records.iter().copied(), self.direct()) {
            Ok(commit) => commit,
            Err(error) => return Some(Err(error)),
        };
        let mut inner = match self.shared.inner.try_lock() {
            Ok(inner) => inner,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        if self.shared.in_the_way(&inner, commit.len) {
            return None;
        }
        let appended = inner.append(&commit);
        drop(inner);
        if appended.is_ok() {
            self.after_commit();
        }
        Some(appended)
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
    use tether_core::substrate::{Address, BatchId, Seq};

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

    /// Peers whose live rows interleave in the file and outweigh a compaction's buffer many
    /// times over: each row lands between its own peer's begin and commit, in file order, the
    /// file is exactly the frames and the rows, and loads, commits after it and a reopen all
    /// see the state as before.
    #[test]
    fn a_compaction_places_interleaved_peers_rows_through_a_bounded_buffer() {
        let path = temp_log("interleave");
        let store = LogStore::open_with(&path, unprepared()).expect("open");
        let peers: Vec<PeerId> = (0..3).map(|p| PeerId::new(format!("peer-{p}"))).collect();
        let mut expected = vec![DurableState::default(); peers.len()];
        let body = |seq: u64, peer: usize| vec![peer as u8 + seq as u8; 60 * 1024 + peer * 7];
        for seq in 0..40u64 {
            for (p, peer) in peers.iter().enumerate() {
                let mut op = send(seq);
                op.body = Some(bytes::Bytes::from(body(seq, p)));
                let mut records = vec![Record::Outbox(op)];
                if seq % 3 == 1 {
                    // Some rows die, so the copy has gaps to skip.
                    records.push(Record::OutboxRemoved {
                        obj: Address::parse("q").expect("an address"),
                        seq: Seq(seq - 1),
                    });
                }
                let batch = PersistBatch {
                    id: BatchId(seq + 1),
                    records,
                };
                store
                    .commit(peer, std::slice::from_ref(&batch))
                    .expect("commit");
                expected[p].apply(&batch);
            }
        }
        let live: usize = expected
            .iter()
            .flat_map(|state| state.outbox.values())
            .filter_map(|op| op.body.as_ref().map(|body| body.len()))
            .sum();
        assert!(live > 4 * LOG_COMPACT_READ_BYTES, "{live} live bytes");
        store.compact().expect("compact");
        let stats = store.stats();
        assert_eq!(stats.compactions, 1);
        assert_eq!(
            std::fs::metadata(&path).expect("the log").len(),
            stats.bytes,
            "the file is its frames and rows, nothing between"
        );
        for (p, peer) in peers.iter().enumerate() {
            assert_eq!(store.load(peer).expect("load"), expected[p], "{peer:?}");
        }
        let batch = outbox_batch(100);
        store
            .commit(&peers[1], std::slice::from_ref(&batch))
            .expect("a commit after the compaction");
        expected[1].apply(&batch);
        drop(store);
        let store = LogStore::open_with(&path, unprepared()).expect("reopen");
        for (p, peer) in peers.iter().enumerate() {
            assert_eq!(store.load(peer).expect("load"), expected[p], "{peer:?}");
        }
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// Two peers' bytes arriving interleaved, each run in its own region, several times what
    /// the writer may hold: it never holds more than its bound plus one write, and every byte
    /// lands where it was placed.
    #[test]
    fn placed_writes_hold_at_most_their_bound_and_land_in_place() {
        let path = temp_log("placed");
        let file = write_file(&[], &path).expect("a file");
        let chunk = 40_000usize;
        let per_peer = 3 * LOG_COMPACT_READ_BYTES / chunk * chunk;
        let mut expected = vec![0u8; 2 * per_peer];
        let mut writer = PlacedWrites::new(&file, 2);
        for i in 0..per_peer / chunk {
            for peer in 0..2 {
                let at = peer * per_peer + i * chunk;
                let bytes = vec![(i * 2 + peer) as u8 | 1; chunk];
                expected[at..at + chunk].copy_from_slice(&bytes);
                writer.write_at(peer, at as u64, &bytes).expect("write");
                assert!(writer.held() <= LOG_COMPACT_READ_BYTES + chunk);
            }
        }
        // A write that does not follow its peer's run starts a new one.
        writer.write_at(0, 7, b"xyz").expect("write");
        expected[7..10].copy_from_slice(b"xyz");
        writer.flush().expect("flush");
        assert_eq!(writer.held(), 0);
        assert_eq!(std::fs::read(&path).expect("read"), expected);
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// A log named as another log's compaction is refused: the two would destroy each other.
    #[test]
    fn a_log_named_as_a_compaction_is_refused() {
        let path = compaction_path(&temp_log("reserved"));
        assert!(matches!(
            LogStore::open(&path),
            Err(StoreError::ReservedName { .. })
        ));
        assert!(!path.exists());
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// A compaction killed before its rename leaves its file: the next open drops it and keeps
    /// the log whole.
    #[test]
    fn an_open_drops_the_file_of_a_compaction_killed_before_its_rename() {
        let path = temp_log("stale");
        let peer = PeerId::new("p");
        let store = LogStore::open_with(&path, unprepared()).expect("open");
        let batch = outbox_batch(0);
        store
            .commit(&peer, std::slice::from_ref(&batch))
            .expect("commit");
        drop(store);
        std::fs::write(compaction_path(&path), vec![9; 4096]).expect("a half-written compaction");
        let store = LogStore::open_with(&path, unprepared()).expect("open");
        assert!(!compaction_path(&path).exists());
        assert_eq!(store.load(&peer).expect("load"), reference(&[batch]));
        drop(store);
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// Options that never prepare: the file is exactly its commits.
    fn unprepared() -> LogOptions {
        LogOptions {
            prepare_bytes: 0,
            ..LogOptions::default()
        }
    }

    /// A crash at any byte of a commit leaves the state before it: the cut commit was never
    /// acknowledged. A damaged byte in the last commit does the same, and so does either
    /// followed by prepared zeros (a commit torn inside prepared space). The store then
    /// appends where the last complete commit ended; zeros alone after it are kept.
    #[test]
    fn a_commit_cut_or_damaged_anywhere_is_dropped_whole() {
        let path = temp_log("cut");
        let peer = PeerId::new("p");
        let store = LogStore::open_with(&path, unprepared()).expect("open");
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
        let zeros_after: Vec<Vec<u8>> = damaged_files
            .iter()
            .map(|bytes| [bytes.as_slice(), &[0; 300]].concat())
            .collect();
        damaged_files.extend(zeros_after);
        for bytes in damaged_files {
            std::fs::write(&path, &bytes).expect("write");
            let store = LogStore::open_with(&path, unprepared()).expect("reopen");
            assert_eq!(store.load(&peer).expect("load"), after_first);
            let zeros_only = bytes[first_end..].iter().all(|byte| *byte == 0);
            let (cut, kept) = if zeros_only {
                (0, bytes.len())
            } else {
                (bytes.len() - first_end, first_end)
            };
            assert_eq!(store.stats().recovered_tail_bytes, cut as u64);
            assert_eq!(
                store.stats().prepared_bytes,
                (kept - first_end) as u64,
                "zeros alone are prepared space"
            );
            assert_eq!(std::fs::metadata(&path).expect("meta").len(), kept as u64);
            let torn = PathBuf::from(format!("{}.torn-{first_end}", path.display()));
            if cut > 0 {
                // What was cut is kept beside the log, byte for byte.
                assert_eq!(std::fs::read(&torn).expect("kept"), &bytes[first_end..]);
                std::fs::remove_file(&torn).expect("remove");
            } else {
                assert!(!torn.exists(), "zeros are prepared space, nothing is cut");
            }
            store.commit(&peer, &batches()[1..]).expect("again");
            drop(store);
            let store = LogStore::open_with(&path, unprepared()).expect("reopen");
            assert_eq!(store.load(&peer).expect("load"), reference(&batches()));
            assert_eq!(store.stats().recovered_tail_bytes, 0);
        }
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    #[test]
    fn a_header_cut_short_starts_afresh_and_another_format_is_refused() {
        let path = temp_log("header");
        let mut header = Vec::new();
        encode_header(LogFormat::new(7), &mut header);
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
        newer[8] = 3;
        std::fs::write(&path, &newer).expect("write");
        assert!(matches!(
            LogStore::open(&path),
            Err(StoreError::Schema { store: "log", .. })
        ));
        assert_eq!(std::fs::read(&path).expect("read"), newer, "left alone");
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// Three commits of one send each, for peers "a", "b", "c", and where each lies.
    fn three_commits(path: &Path) -> Vec<std::ops::Range<u64>> {
        let store = LogStore::open_with(path, unprepared()).expect("open");
        let mut at = Vec::new();
        for (i, peer) in ["a", "b", "c"].into_iter().enumerate() {
            let start = store.stats().bytes;
            let batch = PersistBatch {
                id: BatchId(1),
                records: vec![Record::Outbox(send(i as u64))],
            };
            store.commit(&PeerId::new(peer), &[batch]).expect("commit");
            at.push(start..store.stats().bytes);
        }
        at
    }

    /// A flipped byte in a commit followed by another is damage to an acknowledged commit:
    /// open refuses, naming the offset, and leaves the file as it was; `check` reports it;
    /// a repair keeps every commit before and after it, and the file then opens as it is.
    #[test]
    fn a_flipped_byte_mid_file_refuses_to_open_and_repair_keeps_every_commit_that_verifies() {
        let path = temp_log("damaged");
        let at = three_commits(&path);
        let whole = std::fs::read(&path).expect("read");
        for byte in [
            at[1].start,
            at[1].start + 3,
            (at[1].start + at[1].end) / 2,
            at[1].end - 1,
        ] {
            let mut damaged = whole.clone();
            damaged[byte as usize] ^= 0x04;
            std::fs::write(&path, &damaged).expect("write");
            match LogStore::open(&path) {
                Err(StoreError::Damaged { offset, bytes, .. }) => {
                    assert_eq!((offset, bytes), (at[1].start, at[1].end - at[1].start));
                }
                other => panic!("byte {byte}: {other:?}"),
            }
            assert_eq!(std::fs::read(&path).expect("read"), damaged, "left alone");
            let found = LogStore::check(&path).expect("check");
            assert_eq!(found.damaged, vec![at[1].clone()]);
            assert_eq!((found.commits, found.peers, found.torn_tail), (2, 2, 0));
            assert_eq!(found.end, at[2].end);
            assert_eq!(LogStore::repair(&path).expect("repair"), found);
            let store = LogStore::open(&path).expect("opens once repaired");
            assert_eq!(
                store.peers().expect("peers"),
                vec![PeerId::new("a"), PeerId::new("c")]
            );
            for (peer, seq) in [("a", 0), ("c", 2)] {
                let state = store.load(&PeerId::new(peer)).expect("load");
                assert_eq!(
                    state
                        .outbox
                        .values()
                        .map(|op| op.seq.get())
                        .collect::<Vec<_>>(),
                    [seq]
                );
            }
            drop(store);
            assert!(LogStore::check(&path).expect("check").is_sound());
            // The same repair, asked for at open.
            std::fs::write(&path, &damaged).expect("write");
            let options = LogOptions {
                repair: true,
                ..unprepared()
            };
            let store = LogStore::open_with(&path, options).expect("repairs");
            assert_eq!(store.stats().repaired_bytes, at[1].end - at[1].start);
            assert_eq!(store.peers().expect("peers").len(), 2);
        }
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// Compaction and loads replay the same way: damage that appears under a running store
    /// fails them with the typed error, never with a silently shorter state.
    #[test]
    fn damage_under_a_running_store_fails_its_loads_and_compactions() {
        let path = temp_log("damaged-live");
        let at = three_commits(&path);
        let store = LogStore::open_with(&path, unprepared()).expect("open");
        let a = PeerId::new("a");
        store.load(&a).expect("the replayed state");
        // A byte of the one record of the first commit (after its 14-byte `Begin`): a live row.
        let record = at[0].start + 14;
        flip(&path, record + 12);
        assert!(
            matches!(store.load(&a), Err(StoreError::Damaged { offset, .. }) if offset == at[0].start)
        );
        assert!(matches!(
            store.compact(),
            Err(StoreError::Damaged { offset, .. }) if offset == record
        ));
        assert_eq!(store.stats().compactions, 0);
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// Records of every kind over a few rows of three peers, so rows are written again and
    /// removed often.
    fn row_record() -> impl proptest::strategy::Strategy<Value = (u8, Record)> {
        use proptest::prelude::*;
        let q = || Address::parse("q").expect("an address");
        let put = (0u64..4).prop_map(|seq| Record::Outbox(send(seq)));
        let inbox = (0u64..4).prop_map(|seq| Record::Inbox(send(seq)));
        let removed = (0u64..4).prop_map(move |seq| Record::OutboxRemoved {
            obj: q(),
            seq: Seq(seq),
        });
        let consumed = (0u64..4).prop_map(move |seq| Record::InboxRemoved {
            obj: Address::parse("q").expect("an address"),
            seq: Seq(seq),
        });
        let bounce = (0u8..2).prop_map(|n| Record::Bounce {
            op_id: format!("x{n}").into(),
            code: "no_such_object".to_owned(),
            at: Time::from_millis(1),
        });
        let unbounced = (0u8..2).prop_map(|n| Record::BounceRemoved {
            op_id: format!("x{n}").into(),
        });
        let held = (0u64..4).prop_map(|seq| Record::Held(send(seq)));
        let delivered = (0u64..4).prop_map(move |seq| Record::HeldRemoved {
            obj: q(),
            seq: Seq(seq),
        });
        let object = (0u64..9).prop_map(move |next| {
            Record::Object(tether_core::substrate::ObjectRecord {
                obj: q(),
                kind: tether_core::wire::envelope::ObjKind::Queue,
                opened_by: tether_core::substrate::Side::Local,
                open_id: "open-q".into(),
                state: tether_core::substrate::ObjectState::Live,
                tx_next: Seq(next),
                rx_next: Seq(0),
            })
        });
        let forgotten = Just(Record::ObjectRemoved { obj: q() });
        (
            0u8..3,
            prop_oneof![
                put, inbox, removed, consumed, bounce, unbounced, held, delivered, object,
                forgotten
            ],
        )
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Commits of three peers with compactions (the index's copies) and reopens between
        /// them at any point, with or without zeros prepared ahead: every load (a replay of
        /// the file, which shares nothing with the index) holds exactly what the commits left,
        /// before and after a reopen.
        #[test]
        fn compactions_from_the_index_keep_every_peers_state(
            steps in proptest::collection::vec((proptest::collection::vec(row_record(), 1..4), 0u8..8), 1..24),
            prepare in proptest::prelude::any::<bool>(),
        ) {
            let path = temp_log("index");
            // Prepared or not: a small preparation is topped up (with direct I/O where the
            // file system takes it) many times over, across compactions and reopens.
            let options = LogOptions {
                prepare_bytes: if prepare { 16 * 1024 } else { 0 },
                ..unprepared()
            };
            let mut store = LogStore::open_with(&path, options).expect("open");
            let mut expected: BTreeMap<PeerId, DurableState> = BTreeMap::new();
            for (round, (records, then)) in steps.into_iter().enumerate() {
                for (peer, record) in records {
                    let peer = PeerId::new(format!("p{peer}"));
                    let batch = PersistBatch { id: BatchId(round as u64 + 1), records: vec![record] };
                    store.commit(&peer, std::slice::from_ref(&batch)).expect("commit");
                    expected.entry(peer).or_default().apply(&batch);
                }
                match then {
                    0 | 1 => store.compact().expect("compact"),
                    2 => {
                        drop(store);
                        store = LogStore::open_with(&path, options).expect("reopen");
                    }
                    _ => {}
                }
                for (peer, state) in &expected {
                    proptest::prop_assert_eq!(&store.load(peer).expect("load"), state);
                }
            }
            store.compact().expect("compact");
            drop(store);
            let store = LogStore::open_with(&path, options).expect("reopen");
            for (peer, state) in &expected {
                proptest::prop_assert_eq!(&store.load(peer).expect("load"), state);
            }
            let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
        }
    }

    /// A commit in place runs only when it would wait on nothing but its own write and sync:
    /// it declines (doing nothing) while the lock is held or a preparation is in its way, and
    /// otherwise commits as `commit` does.
    #[test]
    fn a_commit_in_place_declines_whatever_it_would_wait_on() {
        let path = temp_log("in-place");
        let store = LogStore::open_with(&path, unprepared()).expect("open");
        let peer = PeerId::new("p");
        let batch = outbox_batch;
        let held = store.lock();
        assert!(store
            .commit_in_place(&peer, std::slice::from_ref(&batch(0)))
            .is_none());
        drop(held);
        {
            let mut inner = store.lock();
            inner.preparing = true;
            inner.preparing_from = inner.end;
        }
        assert!(store
            .commit_in_place(&peer, std::slice::from_ref(&batch(0)))
            .is_none());
        assert_eq!(store.load(&peer).expect("load"), DurableState::default());
        store.lock().preparing = false;
        let batches = [batch(0), batch(1)];
        assert!(matches!(
            store.commit_in_place(&peer, &batches),
            Some(Ok(()))
        ));
        drop(store);
        let store = LogStore::open_with(&path, unprepared()).expect("reopen");
        assert_eq!(store.load(&peer).expect("load"), reference(&batches));
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// Flips one byte of the file at `at` (under a running store, as a failing disk would).
    fn flip(path: &Path, at: u64) {
        use std::os::unix::fs::FileExt;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .expect("open");
        let mut byte = [0];
        file.read_exact_at(&mut byte, at).expect("read");
        file.write_all_at(&[byte[0] ^ 0xff], at).expect("flip");
    }

    /// A compaction reads only the entries of live rows (each verified): damage under a
    /// running store where no live row lies (a record removed since, a commit's `Begin`) is
    /// left behind with the old file, and the new one holds every live row whole.
    #[test]
    fn a_compaction_keeps_every_live_row_when_damage_lies_elsewhere() {
        let path = temp_log("damaged-dead");
        let store = LogStore::open_with(&path, unprepared()).expect("open");
        let peer = PeerId::new("p");
        let mut commits = Vec::new();
        let mut batches = Vec::new();
        for seq in 0..4 {
            let start = store.stats().bytes;
            let batch = outbox_batch(seq);
            store
                .commit(&peer, std::slice::from_ref(&batch))
                .expect("commit");
            batches.push(batch);
            commits.push(start..store.stats().bytes);
        }
        let removed = PersistBatch {
            id: BatchId(9),
            records: vec![Record::OutboxRemoved {
                obj: Address::parse("q").expect("an address"),
                seq: Seq(1),
            }],
        };
        store
            .commit(&peer, std::slice::from_ref(&removed))
            .expect("commit");
        batches.push(removed);
        // The removed op's record, and the `Begin` of a commit whose row is still live.
        flip(&path, commits[1].start + 14 + 20);
        flip(&path, commits[2].start + 9);
        store.compact().expect("nothing live is damaged");
        assert_eq!(store.stats().compactions, 1);
        drop(store);
        let store = LogStore::open_with(&path, unprepared()).expect("sound again");
        assert_eq!(store.load(&peer).expect("load"), reference(&batches));
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// One store per path: a second open, while the first is open, fails at once with
    /// `Locked` and changes nothing; once the first is dropped (every clone) it opens.
    #[test]
    fn a_second_open_of_the_same_log_fails_at_once() {
        let path = temp_log("locked");
        let store = LogStore::open_with(&path, unprepared()).expect("open");
        store
            .commit(&PeerId::new("p"), &batches()[..1])
            .expect("commit");
        let clone = store.clone();
        drop(store);
        let before = std::fs::read(&path).expect("read");
        for _ in 0..2 {
            match LogStore::open(&path) {
                Err(StoreError::Locked { path: locked }) => assert_eq!(locked, path),
                other => panic!("{other:?}"),
            }
            assert!(matches!(
                LogStore::check(&path),
                Err(StoreError::Locked { .. })
            ));
        }
        assert_eq!(std::fs::read(&path).expect("read"), before);
        clone
            .commit(&PeerId::new("p"), &batches()[1..])
            .expect("still the owner");
        drop(clone);
        let store = LogStore::open(&path).expect("free again");
        assert_eq!(
            store.load(&PeerId::new("p")).expect("load"),
            reference(&batches())
        );
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// A file of version 1 (checksums over payloads only) still reads, and is rewritten in
    /// the current version at open.
    #[test]
    fn a_version_1_file_reads_and_is_rewritten_in_version_2() {
        let path = temp_log("v1");
        let peer = PeerId::new("p");
        let mut bytes = Vec::new();
        encode_header(LogFormat::V1, &mut bytes);
        for batch in batches() {
            bytes.extend(
                encode(LogFormat::V1, &peer, batch.records.iter())
                    .expect("encode")
                    .0,
            );
        }
        std::fs::write(&path, &bytes).expect("write");
        assert_eq!(LogStore::check(&path).expect("check").version, 1);
        let store = LogStore::open_with(&path, unprepared()).expect("open");
        assert_eq!(store.load(&peer).expect("load"), reference(&batches()));
        store.commit(&peer, &batches()[..1]).expect("commit");
        drop(store);
        let found = LogStore::check(&path).expect("check");
        assert_eq!((found.version, found.commits), (LOG_VERSION, 2));
        let mut expected = reference(&batches());
        expected.apply(&batches()[0]);
        let store = LogStore::open(&path).expect("reopen");
        assert_eq!(store.load(&peer).expect("load"), expected);
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// Compactions run on their own thread while commits go on: every commit made during one
    /// is carried into the new file. The first compaction is held between its snapshot and
    /// its swap while 20 commits go on; the rest run as they fall.
    #[test]
    fn commits_go_on_while_the_file_is_compacted() {
        let path = temp_log("background");
        let options = LogOptions {
            compact_bytes_min: 2048,
            compact_growth: 2,
            ..unprepared()
        };
        let store = LogStore::open_with(&path, options).expect("open");
        let peer = PeerId::new("p");
        let mut expected = DurableState::default();
        let commit = |round: u64, expected: &mut DurableState| {
            // A send, and the removal of the one before it: the live state stays small.
            let mut records = vec![Record::Outbox(send(round))];
            if let Some(before) = round.checked_sub(1) {
                records.push(Record::OutboxRemoved {
                    obj: Address::parse("q").expect("an address"),
                    seq: Seq(before),
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
        };
        let held = store.shared.hold_compactions();
        let mut round = 0;
        while !store.shared.lock().compacting {
            assert!(round < 200, "no compaction started");
            commit(round, &mut expected);
            round += 1;
        }
        for _ in 0..20 {
            commit(round, &mut expected);
            round += 1;
        }
        let before = store.stats().bytes;
        drop(held);
        store.wait_compaction();
        let after = store.stats();
        assert_eq!(after.compactions, 1, "{after:?}");
        assert!(after.bytes < before, "{before} -> {after:?}");
        assert_eq!(store.load(&peer).expect("load"), expected);
        while round < 200 {
            commit(round, &mut expected);
            round += 1;
        }
        store.wait_compaction();
        let stats = store.stats();
        assert!(stats.compactions >= 2, "{stats:?}");
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
            ..unprepared()
        };
        let peer = PeerId::new("p");
        let store = LogStore::open_with(&path, unprepared()).expect("open");
        for seq in 0..40 {
            let batch = outbox_batch(seq);
            store.commit(&peer, &[batch]).expect("commit");
        }
        assert!(store.stats().bytes > 4096);
        drop(store);
        let store = LogStore::open_with(&path, options).expect("reopen");
        let removal = PersistBatch {
            id: BatchId(41),
            records: vec![Record::OutboxRemoved {
                obj: Address::parse("q").expect("an address"),
                seq: Seq::ZERO,
            }],
        };
        store.commit(&peer, &[removal]).expect("commit");
        store.wait_compaction();
        assert_eq!(store.stats().compactions, 1);
        assert_eq!(store.load(&peer).expect("load").outbox.len(), 39);
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// Opening prepares zeros past the end, commits overwrite them (the file does not grow),
    /// a thread tops them up once fewer than half remain, and a reopen keeps them.
    #[test]
    fn commits_overwrite_the_zeros_prepared_ahead_of_them() {
        let (path, want, options, store) = prepared_store("prepared");
        let peer = PeerId::new("p");
        let file_len = || std::fs::metadata(&path).expect("meta").len();
        let opened = store.stats();
        assert_eq!(opened.prepared_bytes, want, "{opened:?}");
        assert_eq!(file_len(), opened.bytes + want);
        let bytes = std::fs::read(&path).expect("read");
        assert!(bytes[opened.bytes as usize..].iter().all(|byte| *byte == 0));
        // Commits land in the prepared space: the file keeps its length until fewer than
        // half the zeros remain.
        let mut expected = DurableState::default();
        let mut seq = 0;
        let mut commit = |store: &LogStore| {
            let batch = outbox_batch(seq);
            store
                .commit(&peer, std::slice::from_ref(&batch))
                .expect("commit");
            expected.apply(&batch);
            seq += 1;
        };
        while store.stats().prepared_bytes >= want / 2 {
            commit(&store);
            if store.stats().prepared_bytes >= want / 2 {
                assert_eq!(file_len(), opened.bytes + want, "overwritten, not grown");
            }
        }
        // The commit that left fewer than half started a preparation.
        store.wait_preparation();
        let topped = store.stats();
        assert!(topped.prepared_bytes >= want / 2, "{topped:?}");
        assert_eq!(file_len(), topped.bytes + topped.prepared_bytes);
        commit(&store);
        drop(store);
        let store = LogStore::open_with(&path, options).expect("reopen");
        assert_eq!(store.load(&peer).expect("load"), expected);
        let reopened = store.stats();
        assert_eq!(reopened.recovered_tail_bytes, 0);
        assert_eq!(file_len(), reopened.bytes + reopened.prepared_bytes);
        assert_eq!(
            reopened.prepared_bytes,
            topped.prepared_bytes - (reopened.bytes - topped.bytes),
            "the zeros are kept"
        );
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// A preparation writes the zeros' whole blocks through its direct handle and the bytes
    /// around them through the page cache; a direct handle that refuses a write (here one
    /// opened read-only) hands the rest to the page cache. Either way the file holds exactly
    /// zeros from `from` to `to`, and what lay before `from` is untouched.
    #[test]
    fn a_preparation_writes_whole_blocks_directly_and_falls_back_on_a_refusal() {
        let path = temp_log("prepare-direct");
        let block = LOG_BLOCK_BYTES;
        let (from, to) = (100, 3 * block + 50);
        for refusing in [false, true] {
            std::fs::write(&path, vec![0xab; from as usize]).expect("write");
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .expect("open");
            let direct = if refusing {
                Some(File::open(&path).expect("read-only"))
            } else {
                open_direct(&path)
            };
            let direct_allowed = direct.is_some();
            let job = Prepare {
                file,
                direct,
                from,
                to,
                generation: 0,
                direct_bytes: std::cell::Cell::new(0),
            };
            assert!(job.run(&AtomicBool::new(false)).expect("run"));
            let bytes = std::fs::read(&path).expect("read");
            assert_eq!(bytes.len() as u64, to);
            assert!(bytes[..from as usize].iter().all(|b| *b == 0xab));
            assert!(bytes[from as usize..].iter().all(|b| *b == 0));
            let expected = if refusing {
                0
            } else if direct_allowed {
                // Blocks 1 and 2 are whole; block 0 starts before `from`, block 3 ends after `to`.
                2 * block
            } else {
                eprintln!(
                    "*** direct I/O is refused under {}: only the page-cache path ran ***",
                    path.display()
                );
                0
            };
            assert_eq!(job.direct_bytes.get(), expected, "refusing: {refusing}");
        }
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// Commits over zeros a preparation wrote around the page cache (each padding its last
    /// block with zeros) leave the file its commits and then zeros alone, the direct zeros are
    /// counted, and after commits across several preparations a reopen finds every commit.
    #[test]
    fn commits_over_zeros_written_around_the_page_cache_read_back_whole() {
        let (path, want, options, store) = prepared_store("pad");
        let peer = PeerId::new("p");
        let mut expected = DurableState::default();
        for seq in 0..1500 {
            let batch = outbox_batch(seq);
            store
                .commit(&peer, std::slice::from_ref(&batch))
                .expect("commit");
            expected.apply(&batch);
            if seq % 100 == 0 {
                store.wait_preparation();
                let stats = store.stats();
                let bytes = std::fs::read(&path).expect("read");
                assert_eq!(bytes.len() as u64, stats.bytes + stats.prepared_bytes);
                assert!(
                    bytes[stats.bytes as usize..].iter().all(|b| *b == 0),
                    "at {seq}"
                );
            }
        }
        store.wait_preparation();
        let stats = store.stats();
        assert!(
            stats.bytes > 2 * want,
            "several preparations ran: {stats:?}"
        );
        if open_direct(&path).is_some() {
            assert!(stats.prepared_direct_bytes > want, "{stats:?}");
            // Most commits lie in prepared space: they went around the page cache too.
            assert!(stats.committed_direct_bytes > stats.bytes / 2, "{stats:?}");
        }
        drop(store);
        reopens_to(&path, options, &peer, &expected);
    }

    /// A direct commit rewrites the block it starts in from what the file holds there: kept
    /// from the last direct commit, or read back after a commit went through the page cache
    /// (commits that grew the file past the prepared space), after a reopen, after a
    /// compaction, and after the direct handle refused a write (every later commit then goes
    /// through the page cache). Whatever the mix, the file is its commits and then zeros, and
    /// a reopen finds every commit.
    #[test]
    fn direct_commits_start_from_the_blocks_the_file_holds_whatever_wrote_them() {
        let (path, want, options, store) = prepared_store("direct-mix");
        let peer = PeerId::new("p");
        let mut expected = DurableState::default();
        let mut seq = 0;
        let sound = |store: &LogStore, at: &str| commits_then_zeros(store, &path, at);
        let direct = direct_io_at(&path);
        for _ in 0..20 {
            commit_body(&store, &mut expected, &mut seq, 300);
        }
        let before = sound(&store, "small commits").committed_direct_bytes;
        assert_eq!(before > 0, direct);
        assert_eq!(
            store.direct(),
            direct,
            "encoded in place while direct I/O serves"
        );
        // Two large commits in a row past the prepared space, each a whole number of blocks
        // (the next commit starts where the last direct one ended in its block, but in a block
        // the large one wrote), then small ones.
        let format = store.lock().format;
        let encoded = |body: usize| {
            let mut op = send(seq);
            op.body = Some(bytes::Bytes::from(vec![0; body]));
            let (bytes, _) = encode(format, &peer, [Record::Outbox(op)].iter()).expect("encode");
            bytes.len() as u64
        };
        let body = LOG_DIRECT_COMMIT_BYTES_MAX - 1000;
        let whole = body
            + usize::try_from(
                (LOG_BLOCK_BYTES - encoded(body) % LOG_BLOCK_BYTES) % LOG_BLOCK_BYTES,
            )
            .expect("small");
        assert_eq!(encoded(whole) % LOG_BLOCK_BYTES, 0);
        commit_body(&store, &mut expected, &mut seq, whole);
        commit_body(&store, &mut expected, &mut seq, whole);
        let after_large = sound(&store, "large commits").committed_direct_bytes;
        assert!(after_large < before + LOG_DIRECT_COMMIT_BYTES_MAX as u64);
        // The large commits outran the zeros: the next ones lie past a hole until the commits
        // reach them.
        while store.lock().ahead.is_some() {
            commit_body(&store, &mut expected, &mut seq, 700);
        }
        for _ in 0..40 {
            commit_body(&store, &mut expected, &mut seq, 700);
        }
        let stats = sound(&store, "after the large commits");
        assert_eq!(
            stats.committed_direct_bytes > after_large,
            direct,
            "{stats:?}"
        );
        drop(store);
        let store = LogStore::open_with(&path, options).expect("reopen");
        assert_eq!(store.load(&peer).expect("load"), expected);
        for _ in 0..40 {
            commit_body(&store, &mut expected, &mut seq, 500);
        }
        store.compact().expect("compact");
        // The old file's handle went with the rename (its space is freed with it).
        assert!(store.lock().direct.file.is_none());
        for _ in 0..40 {
            commit_body(&store, &mut expected, &mut seq, 900);
        }
        sound(&store, "after the reopen and a compaction");
        // A direct handle that refuses (read only): the commit goes through the page cache,
        // and so does every one after it.
        {
            let mut inner = store.lock();
            let generation = inner.generation;
            inner.direct.file = Some((generation, File::open(&path).expect("open")));
        }
        let refused = store.stats().committed_direct_bytes;
        for _ in 0..20 {
            commit_body(&store, &mut expected, &mut seq, 400);
        }
        let stats = sound(&store, "after a refusal");
        assert_eq!(stats.committed_direct_bytes, refused);
        assert!(store.lock().direct.refused.load(Ordering::Relaxed));
        // And commits are encoded before the lock from then on.
        assert!(!store.direct());
        assert!(store.lock().direct.file.is_none());
        assert!(stats.bytes > want);
        drop(store);
        reopens_to(&path, options, &peer, &expected);
    }

    /// A commit larger than [`LOG_DIRECT_COMMIT_BYTES_MAX`] goes through the page cache even
    /// inside prepared space (the direct buffer stays within its bound), and the next small
    /// commit goes direct again from the block the large one ended in.
    #[test]
    fn a_commit_over_the_direct_bound_goes_through_the_page_cache() {
        let path = temp_log("direct-bound");
        let options = LogOptions {
            prepare_bytes: 4 * LOG_DIRECT_COMMIT_BYTES_MAX as u64,
            ..LogOptions::default()
        };
        let store = LogStore::open_with(&path, options).expect("open");
        if open_direct(&path).is_none() {
            eprintln!(
                "*** direct I/O is refused under {}: skipped ***",
                path.display()
            );
            let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
            return;
        }
        let peer = PeerId::new("p");
        let mut expected = DurableState::default();
        // Ops `seqs` of `body` bytes each, in one commit.
        let mut commit = |seqs: std::ops::Range<u64>, body: usize| {
            let records = seqs
                .clone()
                .map(|seq| Record::Outbox(body_op(seq, body)))
                .collect();
            let batch = PersistBatch {
                id: BatchId(seqs.end),
                records,
            };
            store
                .commit(&peer, std::slice::from_ref(&batch))
                .expect("commit");
            expected.apply(&batch);
            store.stats()
        };
        let small = commit(0..1, 300).committed_direct_bytes;
        assert!(small > 0);
        // Two ops of 60% of the bound each: one commit over it, of entries within theirs.
        let large = commit(1..3, LOG_DIRECT_COMMIT_BYTES_MAX * 3 / 5).committed_direct_bytes;
        assert_eq!(large, small, "the large commit went through the page cache");
        assert!(store.stats().prepared_bytes > 0, "inside prepared space");
        assert!(store.lock().direct.buffer.capacity() <= 4 * LOG_BLOCK_BYTES as usize);
        assert!(commit(3..4, 300).committed_direct_bytes > large);
        drop(store);
        reopens_to(&path, options, &peer, &expected);
    }

    /// A direct handle is the file the store writes or none: when the path names another
    /// file (renamed over it from outside), commits go through the page cache into the
    /// store's own file.
    #[test]
    fn direct_commits_never_go_to_a_file_renamed_over_the_log() {
        let (path, _, _, store) = prepared_store("direct-renamed");
        let peer = PeerId::new("p");
        store
            .commit(&peer, std::slice::from_ref(&outbox_batch(0)))
            .expect("commit");
        let stranger = path.with_extension("stranger");
        std::fs::write(&stranger, vec![0u8; 64 * 1024]).expect("write");
        std::fs::rename(&stranger, &path).expect("rename");
        store.lock().direct.file = None;
        let before = store.stats().committed_direct_bytes;
        store
            .commit(&peer, std::slice::from_ref(&outbox_batch(1)))
            .expect("commit");
        assert_eq!(store.stats().committed_direct_bytes, before);
        assert!(store.lock().direct.refused.load(Ordering::Relaxed));
        assert!(
            std::fs::read(&path).expect("read").iter().all(|b| *b == 0),
            "the stranger is untouched"
        );
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// Dropping the last handle stops and waits for the background work: a store reopened
    /// right away on the same path sees every commit, whatever was running, and no
    /// compaction renames its file over the new store's afterwards.
    #[test]
    fn a_store_reopened_at_once_never_races_the_last_ones_threads() {
        let path = temp_log("reopen-at-once");
        let options = LogOptions {
            compact_bytes_min: 1024,
            compact_growth: 2,
            prepare_bytes: 8 * 1024 * 1024,
            ..LogOptions::default()
        };
        let peer = PeerId::new("p");
        let mut expected = DurableState::default();
        let mut seq = 0;
        for _ in 0..20 {
            let store = LogStore::open_with(&path, options).expect("open");
            assert_eq!(store.load(&peer).expect("load"), expected);
            for _ in 0..10 {
                let mut records = vec![Record::Outbox(send(seq))];
                if let Some(before) = seq.checked_sub(1) {
                    records.push(Record::OutboxRemoved {
                        obj: Address::parse("q").expect("an address"),
                        seq: Seq(before),
                    });
                }
                let batch = PersistBatch {
                    id: BatchId(seq + 1),
                    records,
                };
                store
                    .commit(&peer, std::slice::from_ref(&batch))
                    .expect("commit");
                expected.apply(&batch);
                seq += 1;
            }
            let clone = store.clone();
            drop(store);
            // A clone keeps the store open.
            assert_eq!(clone.load(&peer).expect("load"), expected);
            drop(clone);
            assert!(
                !compaction_path(&path).exists(),
                "an abandoned compaction is removed"
            );
        }
        let store = LogStore::open_with(&path, options).expect("open");
        assert_eq!(store.load(&peer).expect("load"), expected);
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// Commits one send of `body` bytes as op `seq` for peer "p" (applied to `expected`), then
    /// the next seq.
    fn commit_body(store: &LogStore, expected: &mut DurableState, seq: &mut u64, body: usize) {
        let batch = body_batch(*seq, body);
        *seq += 1;
        store
            .commit(&PeerId::new("p"), std::slice::from_ref(&batch))
            .expect("commit");
        expected.apply(&batch);
    }

    /// One send of `body` bytes as op `seq`, in a batch of its own.
    fn body_batch(seq: u64, body: usize) -> PersistBatch {
        PersistBatch {
            id: BatchId(seq + 1),
            records: vec![Record::Outbox(body_op(seq, body))],
        }
    }

    /// [`send`] with `body` bytes (their value follows `seq`).
    fn body_op(seq: u64, body: usize) -> tether_core::substrate::Op {
        let mut op = send(seq);
        op.body = Some(bytes::Bytes::from(vec![(seq % 251) as u8 + 1; body]));
        op
    }

    /// Whether the file system under `path` takes direct I/O; when it does not, says so
    /// (the test then checks the page-cache path alone).
    fn direct_io_at(path: &Path) -> bool {
        let direct = open_direct(path).is_some();
        if !direct {
            eprintln!(
                "*** direct I/O is refused under {}: only the page-cache path ran ***",
                path.display()
            );
        }
        direct
    }

    /// Once the preparation running ended: the file at `path` is its commits, then prepared
    /// zeros (and zeros ahead of them, past a hole that reads as zeros) and nothing else.
    fn commits_then_zeros(store: &LogStore, path: &Path, at: &str) -> LogStats {
        store.wait_preparation();
        let stats = store.stats();
        let ahead = store.lock().ahead.clone();
        let bytes = std::fs::read(path).expect("read");
        assert_eq!(
            bytes.len() as u64,
            ahead.map_or(stats.bytes + stats.prepared_bytes, |ahead| ahead.end),
            "{at}"
        );
        assert!(
            bytes[stats.bytes as usize..].iter().all(|b| *b == 0),
            "{at}"
        );
        stats
    }

    /// After a cut (here, of a failed commit) the file ends at the last commit, and the
    /// preparation the next commit starts writes its zeros half of `prepare_bytes` past the
    /// end: the file grows over the bytes between without writing them, a hole the file system
    /// has not allocated. Those zeros count as prepared only once the commits reach them, so
    /// every byte counted as prepared is written, and no commit goes direct into the hole
    /// (where its sync would pay for the allocation); past the zeros' start direct commits
    /// resume, and a reopen finds every commit. A store closed (or crashed) meanwhile finds
    /// the hole again when it reopens.
    #[cfg(unix)]
    #[test]
    fn zeros_prepared_past_a_hole_count_once_the_commits_reach_them() {
        let (path, want, options, store) = prepared_store("hole");
        let peer = PeerId::new("p");
        let direct = direct_io_at(&path);
        let (mut expected, mut seq) = (DurableState::default(), 0);
        for _ in 0..4 {
            commit_body(&store, &mut expected, &mut seq, 300);
        }
        fail_commit(&store, seq, 300);
        commit_body(&store, &mut expected, &mut seq, 300);
        let cut = commits_then_zeros(&store, &path, "after the cut");
        // Every byte counted as prepared is written.
        let hole = first_hole(&path, cut.bytes);
        assert!(hole >= cut.bytes + cut.prepared_bytes);
        let ahead = store
            .lock()
            .ahead
            .clone()
            .expect("zeros ahead, past the hole");
        assert_eq!(ahead, cut.bytes + want / 2..cut.bytes + want);
        assert_eq!(cut.prepared_bytes, 0, "{cut:?}");
        if hole >= ahead.start {
            eprintln!(
                "*** the file system under {} shows no hole: only the accounting is checked ***",
                path.display()
            );
        }
        // Closed with zeros ahead: the reopened store counts no byte of the hole as prepared,
        // and waits for the zeros after it as before.
        drop(store);
        let store = LogStore::open_with(&path, options).expect("reopen");
        let reopened = store.stats();
        assert_eq!(reopened.bytes, cut.bytes);
        assert!(
            first_hole(&path, reopened.bytes) >= reopened.bytes + reopened.prepared_bytes,
            "{reopened:?}"
        );
        if hole < ahead.start {
            let found = store
                .lock()
                .ahead
                .clone()
                .expect("the zeros ahead, found again");
            assert_eq!(found.end, ahead.end);
            assert!(found.start <= ahead.start && ahead.start - found.start < LOG_BLOCK_BYTES);
        }
        // Commits below the zeros grow the file through the hole: none that runs past the
        // prepared space (the written blocks before the hole) goes direct.
        while store.lock().ahead.is_some() {
            let before = store.stats();
            commit_body(&store, &mut expected, &mut seq, 300);
            let stats = commits_then_zeros(&store, &path, "below the zeros ahead");
            if stats.bytes > before.bytes + before.prepared_bytes {
                assert_eq!(
                    stats.committed_direct_bytes, before.committed_direct_bytes,
                    "{stats:?}"
                );
            }
            assert!(first_hole(&path, stats.bytes) >= stats.bytes + stats.prepared_bytes);
        }
        // The end reached their block: they are prepared space, with no hole in it.
        let joined = commits_then_zeros(&store, &path, "the zeros joined");
        assert!(joined.bytes + LOG_BLOCK_BYTES > ahead.start - ahead.start % LOG_BLOCK_BYTES);
        assert_eq!(
            joined.bytes + joined.prepared_bytes,
            ahead.end,
            "{joined:?}"
        );
        assert!(first_hole(&path, joined.bytes) >= ahead.end);
        for _ in 0..4 {
            commit_body(&store, &mut expected, &mut seq, 300);
        }
        let after = commits_then_zeros(&store, &path, "after more commits");
        assert_eq!(
            after.committed_direct_bytes > joined.committed_direct_bytes,
            direct,
            "{after:?}"
        );
        drop(store);
        reopens_to(&path, options, &peer, &expected);
    }

    /// Commits one send of `body` bytes as op `seq` for peer "p" with its sync failing after
    /// it ran (the commit is reported failed); the batch that failed.
    fn fail_commit(store: &LogStore, seq: u64, body: usize) -> PersistBatch {
        let failing = body_batch(seq, body);
        store.lock().failing_syncs = 1;
        let committed = store.commit(&PeerId::new("p"), std::slice::from_ref(&failing));
        assert!(committed.is_err());
        failing
    }

    /// Where the first hole at or after `from` starts in the file at `path` (its length when
    /// it has none, or when the file system does not report holes).
    #[cfg(unix)]
    fn first_hole(path: &Path, from: u64) -> u64 {
        let file = File::open(path).expect("open");
        rustix::fs::seek(&file, rustix::fs::SeekFrom::Hole(from)).expect("seek a hole")
    }

    /// A commit whose sync fails after it was written (the seam fails it once the sync ran, so
    /// its bytes are all on disk; it is reported failed) leaves them past the end only until
    /// the next write, which cuts them first: a shorter commit after it leaves nothing of it
    /// behind, direct commits resume once space is prepared again, and a reopen finds
    /// exactly the commits reported durable. Closing the store cuts them too. A crash before
    /// either may keep the failed commit whole, as a commit that happened (its caller was
    /// told nothing durable and retries it, which a reload makes moot); a real failed sync
    /// may also leave it in part, which replay cuts.
    #[test]
    fn a_commit_whose_sync_failed_is_cut_before_the_next_write() {
        let (path, _, options, store) = prepared_store("sync-fails");
        let peer = PeerId::new("p");
        let direct = direct_io_at(&path);
        let (mut expected, mut seq) = (DurableState::default(), 0);
        for _ in 0..10 {
            commit_body(&store, &mut expected, &mut seq, 300);
        }
        let before = commits_then_zeros(&store, &path, "before the failure");
        assert_eq!(before.committed_direct_bytes > 0, direct);
        // Three blocks of body, far longer than the commit after it.
        let failing = fail_commit(&store, seq, 3 * LOG_BLOCK_BYTES as usize);
        if direct {
            // It went direct: the block kept for the next commit ends where it ended.
            let inner = store.lock();
            let ended = inner.direct.tail_at.map(|(_, at)| at);
            assert!(ended.is_some_and(|at| at > before.bytes + 3 * LOG_BLOCK_BYTES));
        }
        assert_eq!(store.stats().bytes, before.bytes);
        assert_eq!(
            store.stats().committed_direct_bytes,
            before.committed_direct_bytes
        );
        let on_disk = std::fs::read(&path).expect("read");
        assert!(on_disk[before.bytes as usize..].iter().any(|b| *b != 0));
        // A crash now: the failed commit's bytes are whole, so it replays.
        {
            let copy = path.with_extension("crashed");
            std::fs::write(&copy, &on_disk).expect("copy");
            let crashed = LogStore::open_with(&copy, options).expect("open the copy");
            let mut with_failed = expected.clone();
            with_failed.apply(&failing);
            assert_eq!(crashed.load(&peer).expect("load"), with_failed);
        }
        // No crash: the next commit (a different, shorter one at the same seq) cuts it first.
        commit_body(&store, &mut expected, &mut seq, 200);
        commits_then_zeros(&store, &path, "after the commit that followed the failure");
        // The zeros prepared after the cut lie past a hole until the commits reach them.
        while store.lock().ahead.is_some() {
            commit_body(&store, &mut expected, &mut seq, 300);
        }
        for _ in 0..4 {
            commit_body(&store, &mut expected, &mut seq, 300);
        }
        let after = commits_then_zeros(&store, &path, "after more commits");
        assert_eq!(
            after.committed_direct_bytes > before.committed_direct_bytes,
            direct,
            "{after:?}"
        );
        // A failed commit, then the store closed: closing cuts it.
        fail_commit(&store, seq, 2 * LOG_BLOCK_BYTES as usize);
        drop(store);
        let _ = std::fs::remove_file(path.with_extension("crashed"));
        reopens_to(&path, options, &peer, &expected);
    }

    /// The log at `path`, reopened, holds `expected` for `peer` and cut no tail; then its
    /// directory goes.
    fn reopens_to(path: &Path, options: LogOptions, peer: &PeerId, expected: &DurableState) {
        let store = LogStore::open_with(path, options).expect("reopen");
        assert_eq!(&store.load(peer).expect("load"), expected);
        assert_eq!(store.stats().recovered_tail_bytes, 0);
        drop(store);
        let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
    }

    /// A batch that puts `send(seq)` in the outbox.
    fn outbox_batch(seq: u64) -> PersistBatch {
        PersistBatch {
            id: BatchId(seq + 1),
            records: vec![Record::Outbox(send(seq))],
        }
    }

    /// A fresh log named `name` that keeps 64 KiB of zeros prepared, with that size and the
    /// options that reopen it.
    fn prepared_store(name: &str) -> (PathBuf, u64, LogOptions, LogStore) {
        let path = temp_log(name);
        let want = 64 * 1024;
        let options = LogOptions {
            prepare_bytes: want,
            ..LogOptions::default()
        };
        let store = LogStore::open_with(&path, options).expect("open");
        (path, want, options, store)
    }

    fn send(seq: u64) -> tether_core::substrate::Op {
        tether_core::substrate::Op {
            obj: Address::parse("q").expect("an address"),
            seq: Seq(seq),
            id: format!("m-{seq}").into(),
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

            /// Any sequence of batches, committed in groups of any size while compactions and
            /// preparations run beside the commits (a file of a few hundred bytes is compacted,
            /// a few thousand zeros are prepared ahead), leaves exactly
            /// the state `DurableState::apply` defines: loaded, after a reopen, and after a
            /// compaction and another reopen.
            #[test]
            fn the_log_ends_where_the_reference_ends(
                batches in prop::collection::vec(prop::collection::vec(record(), 0..6), 0..12),
                group in 1usize..4,
                compact_bytes_min in 64u64..1024,
                prepare_bytes in prop_oneof![Just(0u64), 1u64..4096],
            ) {
                let path = temp_log("prop");
                let options = LogOptions { compact_bytes_min, compact_growth: 2, prepare_bytes, repair: false };
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
                let store = LogStore::open_with(&path, options).expect("reopen");
                prop_assert_eq!(store.load(&peer).expect("load"), expected.clone());
                store.compact().expect("compact");
                drop(store);
                let store = LogStore::open_with(&path, options).expect("reopen");
                prop_assert_eq!(store.load(&peer).expect("load"), expected);
                let _ = std::fs::remove_dir_all(path.parent().expect("dir"));
            }
        }
    }
}
