//! [`SqliteStore`]: the substrate's durable state in SQLite (bundled), WAL journal,
//! `synchronous=FULL`, one transaction per group commit.
//!
//! Tables (each name behind an optional prefix; every key starts with the peer's number, which
//! `peers` gives each peer id once, so rows and keys carry 8 bytes instead of the id's 64):
//!
//! | table | key | holds |
//! |---|---|---|
//! | `meta` | key | `schema`: the version of these tables ([`SCHEMA_VERSION`]) |
//! | `peers` | id (the peer's number) | the peer id; that the peer has state (machines are recovered at start) |
//! | `objects` | peer, obj | kind, opener, open op id, state (+ since), next seq out, frontier in |
//! | `outbox` | peer, obj, seq | un-acked ops of this side |
//! | `inbox` | peer, place, obj, seq | ops of the remote held above the frontier (`held`) or delivered and not yet consumed (`delivered`) |
//! | `dedupe` | peer, op id | the stored outcome of a bounced op id (tombstone) and when |
//!
//! Everything below an object's frontier is answered by the frontier itself, so the tables
//! hold rows only for objects, in-flight ops and tombstones, never one per op ever exchanged.
//!
//! Opening a database written by an earlier tether migrates it in one transaction: version 1
//! (no `meta` table, the peer id in every row) becomes version 2, the rows the same. A
//! database of a newer version is refused ([`StoreError::Schema`]).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use rusqlite::{params, CachedStatement, Connection, OptionalExtension, Row, Transaction};
use tether_core::substrate::{
    effective_records, DurableState, ObjectRecord, ObjectState, Op, PeerId, PersistBatch, Record,
    Seq, Side,
};
use tether_core::time::Time;
use tether_core::wire::envelope::{Address, ObjKind, OpId, Verb};

use super::{lock_path, resolved, Store, StoreError};

/// The page size of a database [`SqliteStore::open`] creates. In-flight op rows carry whole
/// bodies and churn (inserted, then deleted an acknowledgement later), and every page a commit
/// dirties goes to the WAL whole, then to the database at the checkpoint:
/// - large pages let a large commit dirty and rebalance fewer pages (on an earlier machine,
///   16 KiB against SQLite's 4 KiB default: 27.5k against 24.0k msg/s on 16 queues);
/// - small pages make a small commit's fixed pages (the object row, the tree's right edge, the
///   index) cheaper: on 1 queue (window 32, about 16 messages per commit) 16 KiB pages wrote
///   17 KB per message, 4 KiB pages 9.3 KB.
///
/// 8 KiB is best at both ends. Measured with `tether-bench` over iroh, 1 KiB bodies, eight
/// alternating runs each, medians (16 KiB / 8 KiB): 1 queue 16.4k / 18.0k and 16.4k / 18.7k
/// msg/s with 17.0 / 11.6 KB written per message; 16 queues 30.5k / 30.3k and 31.8k / 31.2k
/// msg/s (the same within this disk's noise) with 8.8 / 7.7 KB written per message.
pub const PAGE_SIZE: i64 = 8 * 1024;

/// The version of the tables this tether writes, kept under `schema` in the `meta` table (a
/// table of its own, not `PRAGMA user_version`, which belongs to the host when it shares the
/// connection). Version 1 had no `meta` table.
pub const SCHEMA_VERSION: i64 = 2;

/// The substrate's durable state in one SQLite database.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    tables: Arc<Tables>,
    /// The numbers of the peers this store committed for, read from `peers` once (its rows
    /// are never deleted, so a number stays a peer's for good): a commit then runs no
    /// statement to find it.
    numbers: Arc<Mutex<HashMap<PeerId, i64>>>,
    /// The exclusive lock on `<path>.lock` of a store that opened its own file (none for a
    /// host's connection): held until the last clone is dropped.
    _lock: Option<Arc<std::fs::File>>,
}

#[derive(Debug)]
struct Tables {
    meta: String,
    peers: String,
    objects: String,
    outbox: String,
    inbox: String,
    dedupe: String,
    /// The statements a commit runs, written once (each is prepared once per connection).
    sql: Statements,
}

#[derive(Debug)]
struct Statements {
    peer: String,
    peer_number: String,
    object: String,
    object_removed: String,
    outbox: String,
    outbox_removed: String,
    inbox: String,
    inbox_removed: String,
    bounce: String,
    bounce_removed: String,
}

impl Tables {
    fn new(prefix: &str) -> Self {
        let meta = format!("{prefix}meta");
        let peers = format!("{prefix}peers");
        let objects = format!("{prefix}objects");
        let outbox = format!("{prefix}outbox");
        let inbox = format!("{prefix}inbox");
        let dedupe = format!("{prefix}dedupe");
        let sql = Statements {
            peer: format!("INSERT OR IGNORE INTO {peers} (peer) VALUES (?1)"),
            peer_number: format!("SELECT id FROM {peers} WHERE peer = ?1"),
            // An object's row is written at most once per commit but in most commits (its
            // frontiers move): an upsert updates it in place, where a replace would delete it
            // and insert it again under a new rowid, dirtying the primary key's index page too.
            object: format!(
                "INSERT INTO {objects} (peer, obj, kind, opened_by, open_id, state, state_at, \
                 tx_next, rx_next) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) \
                 ON CONFLICT (peer, obj) DO UPDATE SET kind = excluded.kind, \
                 opened_by = excluded.opened_by, open_id = excluded.open_id, \
                 state = excluded.state, state_at = excluded.state_at, \
                 tx_next = excluded.tx_next, rx_next = excluded.rx_next"
            ),
            object_removed: format!("DELETE FROM {objects} WHERE peer = ?1 AND obj = ?2"),
            outbox: format!(
                "INSERT OR REPLACE INTO {outbox} (peer, {OP_COLUMNS}) VALUES (?1, ?2, ?3, ?4, \
                 ?5, ?6, ?7, ?8, ?9, ?10, ?11)"
            ),
            outbox_removed: format!(
                "DELETE FROM {outbox} WHERE peer = ?1 AND obj = ?2 AND seq BETWEEN ?3 AND ?4"
            ),
            inbox: format!(
                "INSERT OR REPLACE INTO {inbox} (peer, place, {OP_COLUMNS}) VALUES (?1, ?12, \
                 ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)"
            ),
            inbox_removed: format!(
                "DELETE FROM {inbox} WHERE peer = ?1 AND place = ?2 AND obj = ?3 AND seq \
                 BETWEEN ?4 AND ?5"
            ),
            bounce: format!(
                "INSERT OR REPLACE INTO {dedupe} (peer, op_id, code, at) VALUES (?1, ?2, ?3, ?4)"
            ),
            bounce_removed: format!("DELETE FROM {dedupe} WHERE peer = ?1 AND op_id = ?2"),
        };
        Self {
            meta,
            peers,
            objects,
            outbox,
            inbox,
            dedupe,
            sql,
        }
    }
}

/// The statements of one commit, each taken from the connection's cache at its first use and
/// kept for the rest of the commit. Taking one from rusqlite's cache hashes, compares and
/// copies its SQL text; a commit runs a handful of statements hundreds of times.
struct Prepared<'c> {
    tx: &'c Transaction<'c>,
    sql: &'c Statements,
    taken: [Option<CachedStatement<'c>>; 8],
}

/// Which statement of [`Statements`] a commit runs.
#[derive(Clone, Copy)]
enum Statement {
    Object,
    ObjectRemoved,
    Outbox,
    OutboxRemoved,
    Inbox,
    InboxRemoved,
    Bounce,
    BounceRemoved,
}

impl<'c> Prepared<'c> {
    fn new(tx: &'c Transaction<'c>, sql: &'c Statements) -> Self {
        Self {
            tx,
            sql,
            taken: Default::default(),
        }
    }

    fn get(&mut self, which: Statement) -> rusqlite::Result<&mut CachedStatement<'c>> {
        let sql = match which {
            Statement::Object => &self.sql.object,
            Statement::ObjectRemoved => &self.sql.object_removed,
            Statement::Outbox => &self.sql.outbox,
            Statement::OutboxRemoved => &self.sql.outbox_removed,
            Statement::Inbox => &self.sql.inbox,
            Statement::InboxRemoved => &self.sql.inbox_removed,
            Statement::Bounce => &self.sql.bounce,
            Statement::BounceRemoved => &self.sql.bounce_removed,
        };
        let slot = &mut self.taken[which as usize];
        if slot.is_none() {
            *slot = Some(self.tx.prepare_cached(sql)?);
        }
        Ok(slot.as_mut().expect("taken above"))
    }
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path`, in WAL mode with
    /// `synchronous=FULL`. The store closes it when the last clone is dropped.
    ///
    /// A database it creates has 8 KiB pages ([`PAGE_SIZE`]); one that exists keeps its own.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with_prefix(path, "")
    }

    /// [`SqliteStore::open`] with every table name prefixed by `prefix` (e.g. `tether_`).
    ///
    /// One store at a time: opening takes an exclusive lock on `<path>.lock` (held until the
    /// last clone is dropped), so a second open of the same path, in this process or another,
    /// fails at once with [`StoreError::Locked`].
    pub fn open_with_prefix(path: impl AsRef<Path>, prefix: &str) -> Result<Self, StoreError> {
        let path = &resolved(path.as_ref())?;
        let lock = lock_path(path)?;
        let conn = Connection::open(path)?;
        // Only takes on a database without tables yet (and before WAL mode is set).
        conn.pragma_update(None, "page_size", PAGE_SIZE)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        let mut store = Self::with_connection(Arc::new(Mutex::new(conn)), prefix)?;
        store._lock = Some(Arc::new(lock));
        Ok(store)
    }

    /// Uses a connection the host owns and keeps using; the store never closes it and does
    /// not change its settings (the host chooses journal mode and synchronous level).
    ///
    /// Creates the tables, or migrates those an earlier tether wrote (see the module docs);
    /// refuses tables of a newer schema with [`StoreError::Schema`].
    pub fn with_connection(conn: Arc<Mutex<Connection>>, prefix: &str) -> Result<Self, StoreError> {
        check_prefix(prefix)?;
        let tables = Tables::new(prefix);
        {
            let mut conn = conn.lock().unwrap_or_else(PoisonError::into_inner);
            prepare_schema(&mut conn, &tables)?;
        }
        Ok(Self {
            conn,
            tables: Arc::new(tables),
            numbers: Arc::default(),
            _lock: None,
        })
    }

    /// Deletes tombstones and closed objects whose retention ended before `cutoff`, for every
    /// peer (including peers that never reconnect). Returns the rows deleted.
    pub fn gc(&self, cutoff: Time) -> Result<usize, StoreError> {
        let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        let tx = conn.transaction()?;
        let t = &self.tables;
        let cutoff = to_sql_time(cutoff);
        let mut deleted = tx.execute(
            &format!("DELETE FROM {} WHERE at < ?1", t.dedupe),
            params![cutoff],
        )?;
        deleted += tx.execute(
            &format!(
                "DELETE FROM {} WHERE state IN ('closed', 'rejected') AND state_at < ?1",
                t.objects
            ),
            params![cutoff],
        )?;
        tx.commit()?;
        Ok(deleted)
    }

    /// The number `peer` was given in `peers`, if a commit of this store already read it.
    fn numbered(&self, peer: &PeerId) -> Option<i64> {
        let numbers = self.numbers.lock().unwrap_or_else(PoisonError::into_inner);
        numbers.get(peer).copied()
    }

    /// Writes `record`, except a removal of an op row: that joins `removals`, deleted in runs
    /// once every other record of the commit is written.
    fn apply<'a>(
        prepared: &mut Prepared<'_>,
        peer: i64,
        record: &'a Record,
        removals: &mut Removals<'a>,
    ) -> rusqlite::Result<()> {
        match record {
            Record::Object(object) => {
                let (state, at) = state_to_sql(object.state);
                prepared.get(Statement::Object)?.execute(params![
                    peer,
                    object.obj.as_str(),
                    object.kind.as_str(),
                    side_to_sql(object.opened_by),
                    object.open_id.as_str(),
                    state,
                    at,
                    to_sql_u64(object.tx_next.get()),
                    to_sql_u64(object.rx_next.get()),
                ])?;
            }
            Record::ObjectRemoved { obj } => {
                prepared
                    .get(Statement::ObjectRemoved)?
                    .execute(params![peer, obj.as_str()])?;
            }
            Record::Outbox(op) => insert_op(prepared.get(Statement::Outbox)?, peer, None, op)?,
            Record::Held(op) => insert_op(prepared.get(Statement::Inbox)?, peer, Some("held"), op)?,
            Record::Inbox(op) => {
                insert_op(prepared.get(Statement::Inbox)?, peer, Some("delivered"), op)?;
            }
            Record::OutboxRemoved { obj, seq } => removals.add(None, obj, seq.get()),
            Record::HeldRemoved { obj, seq } => removals.add(Some("held"), obj, seq.get()),
            Record::InboxRemoved { obj, seq } => removals.add(Some("delivered"), obj, seq.get()),
            Record::Bounce { op_id, code, at } => {
                prepared.get(Statement::Bounce)?.execute(params![
                    peer,
                    op_id.as_str(),
                    code,
                    to_sql_time(*at)
                ])?;
            }
            Record::BounceRemoved { op_id } => {
                prepared
                    .get(Statement::BounceRemoved)?
                    .execute(params![peer, op_id.as_str()])?;
            }
        }
        Ok(())
    }

    /// Deletes the op rows of `obj` with seqs `first..=last` from the outbox (`place` `None`)
    /// or the inbox's `place`: one statement for a run of removals.
    fn remove_ops(
        prepared: &mut Prepared<'_>,
        peer: i64,
        place: Option<&str>,
        obj: &str,
        (first, last): (u64, u64),
    ) -> rusqlite::Result<()> {
        let (first, last) = (to_sql_u64(first), to_sql_u64(last));
        match place {
            None => prepared
                .get(Statement::OutboxRemoved)?
                .execute(params![peer, obj, first, last])?,
            Some(place) => prepared
                .get(Statement::InboxRemoved)?
                .execute(params![peer, place, obj, first, last])?,
        };
        Ok(())
    }
}

/// The op-row removals of one commit, by table and object, to be deleted in runs.
#[derive(Default)]
struct Removals<'a> {
    runs: BTreeMap<(Option<&'static str>, &'a str), Vec<u64>>,
}

impl<'a> Removals<'a> {
    /// Op `seq` of `obj` leaves the outbox (`place` `None`) or the inbox's `place`.
    fn add(&mut self, place: Option<&'static str>, obj: &'a str, seq: u64) {
        self.runs.entry((place, obj)).or_default().push(seq);
    }

    /// Each table's and object's removed seqs as maximal runs `(first, last)` of consecutive
    /// seqs that SQLite orders as Rust does (a run never crosses from `i64::MAX` to
    /// `i64::MAX + 1`, which SQLite stores as a negative integer).
    fn runs(self) -> impl Iterator<Item = (Option<&'static str>, &'a str, (u64, u64))> {
        self.runs.into_iter().flat_map(|((place, obj), mut seqs)| {
            seqs.sort_unstable();
            seqs.dedup();
            let mut runs: Vec<(u64, u64)> = Vec::new();
            for seq in seqs {
                match runs.last_mut() {
                    Some((_, last)) if *last + 1 == seq && to_sql_u64(seq) > to_sql_u64(*last) => {
                        *last = seq;
                    }
                    _ => runs.push((seq, seq)),
                }
            }
            runs.into_iter().map(move |run| (place, obj, run))
        })
    }
}

impl Store for SqliteStore {
    fn load(&self, peer: &PeerId) -> Result<DurableState, StoreError> {
        let conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        let t = &self.tables;
        let mut state = DurableState::default();
        let Some(peer) = conn
            .prepare_cached(&t.sql.peer_number)?
            .query_row(params![peer.as_str()], |row| row.get::<_, i64>(0))
            .optional()?
        else {
            return Ok(state);
        };
        let mut objects = conn.prepare(&format!(
            "SELECT obj, kind, opened_by, open_id, state, state_at, tx_next, rx_next FROM {} \
             WHERE peer = ?1",
            t.objects
        ))?;
        let mut rows = objects.query(params![peer])?;
        while let Some(row) = rows.next()? {
            let object = object_from_row(row)?;
            state.objects.insert(object.obj.clone(), object);
        }
        let mut outbox = conn.prepare(&format!(
            "SELECT {OP_COLUMNS} FROM {} WHERE peer = ?1",
            t.outbox
        ))?;
        let mut rows = outbox.query(params![peer])?;
        while let Some(row) = rows.next()? {
            let op = op_from_row(row)?;
            state.outbox.insert((op.obj.clone(), op.seq), op);
        }
        let mut inbox = conn.prepare(&format!(
            "SELECT {OP_COLUMNS}, place FROM {} WHERE peer = ?1",
            t.inbox
        ))?;
        let mut rows = inbox.query(params![peer])?;
        while let Some(row) = rows.next()? {
            let op = op_from_row(row)?;
            let place: String = row.get(10)?;
            let map = match place.as_str() {
                "held" => &mut state.held,
                "delivered" => &mut state.inbox,
                other => return Err(corrupt("inbox", format!("place {other:?}"))),
            };
            map.insert((op.obj.clone(), op.seq), op);
        }
        let mut dedupe = conn.prepare(&format!(
            "SELECT op_id, code, at FROM {} WHERE peer = ?1",
            t.dedupe
        ))?;
        let mut rows = dedupe.query(params![peer])?;
        while let Some(row) = rows.next()? {
            let op_id: String = row.get(0)?;
            let code: String = row.get(1)?;
            let at = from_sql_time(row.get(2)?);
            state.bounces.insert(OpId::from(op_id), (code, at));
        }
        Ok(state)
    }

    fn commit(&self, peer: &PeerId, batches: &[PersistBatch]) -> Result<(), StoreError> {
        let mut conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let sql = &self.tables.sql;
        let known = self.numbered(peer);
        let number: i64 = match known {
            Some(number) => number,
            None => {
                tx.prepare_cached(&sql.peer)?
                    .execute(params![peer.as_str()])?;
                tx.prepare_cached(&sql.peer_number)?
                    .query_row(params![peer.as_str()], |row| row.get(0))?
            }
        };
        // One transaction: only the last write of each row is visible after it, so only the
        // last is made (an object's frontier once per group instead of once per op). Those
        // writes touch distinct rows, so their order is free: op-row removals go last, one
        // range delete per run of consecutive seqs of an object.
        let mut removals = Removals::default();
        {
            let mut prepared = Prepared::new(&tx, sql);
            for record in effective_records(batches) {
                Self::apply(&mut prepared, number, record, &mut removals)?;
            }
            for (place, obj, run) in removals.runs() {
                Self::remove_ops(&mut prepared, number, place, obj, run)?;
            }
        }
        tx.commit()?;
        if known.is_none() {
            // Only once its row is durable: a number read inside a transaction that rolled
            // back could be given to another peer.
            let mut numbers = self.numbers.lock().unwrap_or_else(PoisonError::into_inner);
            numbers.insert(peer.clone(), number);
        }
        Ok(())
    }

    fn peers(&self) -> Result<Vec<PeerId>, StoreError> {
        let conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        let mut statement = conn.prepare(&format!("SELECT peer FROM {}", self.tables.peers))?;
        let peers = statement
            .query_map([], |row| row.get::<_, String>(0))?
            .map(|peer| peer.map(PeerId::new))
            .collect::<Result<_, _>>()?;
        Ok(peers)
    }

    fn is_blocking(&self) -> bool {
        true
    }
}

const OP_COLUMNS: &str = "obj, seq, op_id, verb, obj_kind, body, code, reason, cap, at";

/// The columns of an op row (outbox and inbox), after the peer (and the inbox's place).
const OP_SCHEMA: &str = "obj TEXT NOT NULL, seq INTEGER NOT NULL, op_id TEXT NOT NULL, \
                         verb TEXT NOT NULL, obj_kind TEXT, body BLOB, code TEXT, reason TEXT, \
                         cap TEXT, at INTEGER NOT NULL";

/// The tables of [`SCHEMA_VERSION`].
fn schema(t: &Tables) -> String {
    format!(
        "CREATE TABLE {peers} (id INTEGER PRIMARY KEY, peer TEXT NOT NULL UNIQUE);
         CREATE TABLE {objects} (peer INTEGER NOT NULL, obj TEXT NOT NULL,
             kind TEXT NOT NULL, opened_by TEXT NOT NULL, open_id TEXT NOT NULL,
             state TEXT NOT NULL, state_at INTEGER, tx_next INTEGER NOT NULL,
             rx_next INTEGER NOT NULL, PRIMARY KEY (peer, obj));
         CREATE TABLE {outbox} (peer INTEGER NOT NULL, {OP_SCHEMA},
             PRIMARY KEY (peer, obj, seq));
         CREATE TABLE {inbox} (peer INTEGER NOT NULL, place TEXT NOT NULL,
             {OP_SCHEMA}, PRIMARY KEY (peer, place, obj, seq));
         CREATE TABLE {dedupe} (peer INTEGER NOT NULL, op_id TEXT NOT NULL,
             code TEXT NOT NULL, at INTEGER NOT NULL, PRIMARY KEY (peer, op_id));",
        peers = t.peers,
        objects = t.objects,
        outbox = t.outbox,
        inbox = t.inbox,
        dedupe = t.dedupe,
    )
}

/// Brings the tables to [`SCHEMA_VERSION`] in one transaction: creates them in a database
/// without any, migrates version 1, leaves the current version alone, refuses a newer one.
fn prepare_schema(conn: &mut Connection, t: &Tables) -> Result<(), StoreError> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    tx.execute_batch(&format!(
        "CREATE TABLE IF NOT EXISTS {} (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
        t.meta
    ))?;
    let version: Option<i64> = tx
        .query_row(
            &format!("SELECT value FROM {} WHERE key = 'schema'", t.meta),
            [],
            |row| row.get(0),
        )
        .optional()?;
    match version {
        Some(SCHEMA_VERSION) => return Ok(()),
        Some(version) => {
            return Err(StoreError::Schema {
                store: "sqlite tables",
                found: version,
                reads: SCHEMA_VERSION,
            })
        }
        None if table_exists(&tx, &t.peers)? => migrate_from_v1(&tx, t)?,
        None => tx.execute_batch(&schema(t))?,
    }
    tx.execute(
        &format!("INSERT INTO {} (key, value) VALUES ('schema', ?1)", t.meta),
        params![SCHEMA_VERSION],
    )?;
    tx.commit()?;
    Ok(())
}

fn table_exists(tx: &Transaction<'_>, name: &str) -> rusqlite::Result<bool> {
    tx.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)",
        params![name],
        |row| row.get(0),
    )
}

/// Version 1 to 2, inside the caller's transaction: the old tables are renamed aside, the new
/// ones created, every row copied with its peer id replaced by the peer's number, and the old
/// tables dropped.
fn migrate_from_v1(tx: &Transaction<'_>, t: &Tables) -> rusqlite::Result<()> {
    let old = |table: &str| format!("{table}_v1");
    // Version 1 created its tables one statement at a time: any it did not get to are made
    // (empty) so that every copy below has its source.
    tx.execute_batch(&format!(
        "CREATE TABLE IF NOT EXISTS {objects} (peer TEXT NOT NULL, obj TEXT NOT NULL,
             kind TEXT NOT NULL, opened_by TEXT NOT NULL, open_id TEXT NOT NULL,
             state TEXT NOT NULL, state_at INTEGER, tx_next INTEGER NOT NULL,
             rx_next INTEGER NOT NULL, PRIMARY KEY (peer, obj));
         CREATE TABLE IF NOT EXISTS {outbox} (peer TEXT NOT NULL, {OP_SCHEMA},
             PRIMARY KEY (peer, obj, seq));
         CREATE TABLE IF NOT EXISTS {inbox} (peer TEXT NOT NULL, place TEXT NOT NULL,
             {OP_SCHEMA}, PRIMARY KEY (peer, place, obj, seq));
         CREATE TABLE IF NOT EXISTS {dedupe} (peer TEXT NOT NULL, op_id TEXT NOT NULL,
             code TEXT NOT NULL, at INTEGER NOT NULL, PRIMARY KEY (peer, op_id));",
        objects = t.objects,
        outbox = t.outbox,
        inbox = t.inbox,
        dedupe = t.dedupe,
    ))?;
    for table in [&t.peers, &t.objects, &t.outbox, &t.inbox, &t.dedupe] {
        tx.execute_batch(&format!("ALTER TABLE {table} RENAME TO {}", old(table)))?;
    }
    tx.execute_batch(&schema(t))?;
    // Every peer with a row anywhere gets a number (version 1 wrote `peers` with every
    // commit, so this is the same set; the union makes the copy below lose nothing if not).
    tx.execute_batch(&format!(
        "INSERT INTO {peers} (peer) SELECT peer FROM {peers_v1} UNION SELECT peer FROM \
         {objects_v1} UNION SELECT peer FROM {outbox_v1} UNION SELECT peer FROM {inbox_v1} \
         UNION SELECT peer FROM {dedupe_v1} ORDER BY 1;
         INSERT INTO {objects} SELECT p.id, o.obj, o.kind, o.opened_by, o.open_id, o.state,
             o.state_at, o.tx_next, o.rx_next FROM {objects_v1} o JOIN {peers} p USING (peer);
         INSERT INTO {outbox} (peer, {OP_COLUMNS}) SELECT p.id, {o_columns}
             FROM {outbox_v1} o JOIN {peers} p USING (peer);
         INSERT INTO {inbox} (peer, place, {OP_COLUMNS}) SELECT p.id, o.place, {o_columns}
             FROM {inbox_v1} o JOIN {peers} p USING (peer);
         INSERT INTO {dedupe} SELECT p.id, o.op_id, o.code, o.at
             FROM {dedupe_v1} o JOIN {peers} p USING (peer);",
        peers = t.peers,
        objects = t.objects,
        outbox = t.outbox,
        inbox = t.inbox,
        dedupe = t.dedupe,
        peers_v1 = old(&t.peers),
        objects_v1 = old(&t.objects),
        outbox_v1 = old(&t.outbox),
        inbox_v1 = old(&t.inbox),
        dedupe_v1 = old(&t.dedupe),
        o_columns = OP_COLUMNS
            .split(", ")
            .map(|column| format!("o.{column}"))
            .collect::<Vec<_>>()
            .join(", "),
    ))?;
    for table in [&t.peers, &t.objects, &t.outbox, &t.inbox, &t.dedupe] {
        tx.execute_batch(&format!("DROP TABLE {}", old(table)))?;
    }
    Ok(())
}

/// Table prefixes are spliced into SQL: only `[A-Za-z0-9_]` is allowed.
fn check_prefix(prefix: &str) -> Result<(), StoreError> {
    if prefix.len() <= 32
        && prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_')
    {
        Ok(())
    } else {
        Err(StoreError::BadTablePrefix(prefix.to_owned()))
    }
}

/// Runs `statement` (an op insert; `?12` is the inbox's place, bound only when `place` is given).
fn insert_op(
    statement: &mut CachedStatement<'_>,
    peer: i64,
    place: Option<&str>,
    op: &Op,
) -> rusqlite::Result<()> {
    let values = params![
        peer,
        op.obj.as_str(),
        to_sql_u64(op.seq.get()),
        op.id.as_str(),
        op.verb.as_str(),
        op.obj_kind.map(ObjKind::as_str),
        op.body.as_deref(),
        op.code,
        op.reason,
        op.cap,
        to_sql_time(op.at),
        place,
    ];
    match place {
        Some(_) => statement.execute(values)?,
        None => statement.execute(&values[..11])?,
    };
    Ok(())
}

fn op_from_row(row: &Row<'_>) -> Result<Op, StoreError> {
    let verb: String = row.get(3)?;
    let obj_kind: Option<String> = row.get(4)?;
    let body: Option<Vec<u8>> = row.get(5)?;
    let obj: String = row.get(0)?;
    let id: String = row.get(2)?;
    Ok(Op {
        obj: address_from_sql("ops", &obj)?,
        seq: Seq(from_sql_u64(row.get(1)?)),
        id: OpId::from(id),
        verb: Verb::parse(&verb).ok_or_else(|| corrupt("ops", format!("verb {verb:?}")))?,
        obj_kind: obj_kind.as_deref().map(kind_from_sql).transpose()?,
        body: body.map(Bytes::from),
        code: row.get(6)?,
        reason: row.get(7)?,
        cap: row.get(8)?,
        at: from_sql_time(row.get(9)?),
    })
}

fn object_from_row(row: &Row<'_>) -> Result<ObjectRecord, StoreError> {
    let kind: String = row.get(1)?;
    let opened_by: String = row.get(2)?;
    let state: String = row.get(4)?;
    let at: Option<i64> = row.get(5)?;
    let obj: String = row.get(0)?;
    let open_id: String = row.get(3)?;
    Ok(ObjectRecord {
        obj: address_from_sql("objects", &obj)?,
        kind: kind_from_sql(&kind)?,
        opened_by: match opened_by.as_str() {
            "local" => Side::Local,
            "remote" => Side::Remote,
            other => return Err(corrupt("objects", format!("opened_by {other:?}"))),
        },
        open_id: OpId::from(open_id),
        state: state_from_sql(&state, at)?,
        tx_next: Seq(from_sql_u64(row.get(6)?)),
        rx_next: Seq(from_sql_u64(row.get(7)?)),
    })
}

/// An object's address as stored: refused (corrupt) unless the machine could have made it.
fn address_from_sql(table: &'static str, obj: &str) -> Result<Address, StoreError> {
    Address::parse(obj).map_err(|_| corrupt(table, format!("address {obj:?}")))
}

fn kind_from_sql(kind: &str) -> Result<ObjKind, StoreError> {
    ObjKind::parse(kind).ok_or_else(|| corrupt("objects", format!("kind {kind:?}")))
}

fn side_to_sql(side: Side) -> &'static str {
    match side {
        Side::Local => "local",
        Side::Remote => "remote",
    }
}

fn state_to_sql(state: ObjectState) -> (&'static str, Option<i64>) {
    match state {
        ObjectState::Opening => ("opening", None),
        ObjectState::AwaitingAccept => ("awaiting_accept", None),
        ObjectState::Live => ("live", None),
        ObjectState::Closed(at) => ("closed", Some(to_sql_time(at))),
        ObjectState::Rejected(at) => ("rejected", Some(to_sql_time(at))),
    }
}

fn state_from_sql(state: &str, at: Option<i64>) -> Result<ObjectState, StoreError> {
    let at = || {
        at.map(from_sql_time)
            .ok_or_else(|| corrupt("objects", format!("{state} without state_at")))
    };
    Ok(match state {
        "opening" => ObjectState::Opening,
        "awaiting_accept" => ObjectState::AwaitingAccept,
        "live" => ObjectState::Live,
        "closed" => ObjectState::Closed(at()?),
        "rejected" => ObjectState::Rejected(at()?),
        other => return Err(corrupt("objects", format!("state {other:?}"))),
    })
}

fn corrupt(table: &'static str, detail: String) -> StoreError {
    StoreError::Corrupt { table, detail }
}

/// SQLite integers are i64; u64 values are stored bit-for-bit.
fn to_sql_u64(value: u64) -> i64 {
    value as i64
}

fn from_sql_u64(value: i64) -> u64 {
    value as u64
}

fn to_sql_time(time: Time) -> i64 {
    to_sql_u64(time.as_millis())
}

fn from_sql_time(value: i64) -> Time {
    Time::from_millis(from_sql_u64(value))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tether_core::substrate::BatchId;

    fn op(obj: &str, seq: u64, verb: Verb) -> Op {
        Op {
            obj: Address::parse(obj).expect("an address"),
            seq: Seq(seq),
            id: format!("id-{seq}").into(),
            verb,
            obj_kind: (verb == Verb::Open).then_some(ObjKind::Session),
            body: Some(Bytes::from(vec![seq as u8; 3])),
            code: None,
            reason: None,
            cap: Some("cap".to_owned()),
            at: Time::from_millis(seq * 10),
        }
    }

    fn object(obj: &str, state: ObjectState) -> ObjectRecord {
        ObjectRecord {
            obj: Address::parse(obj).expect("an address"),
            kind: ObjKind::Queue,
            opened_by: Side::Remote,
            open_id: "open-1".into(),
            state,
            tx_next: Seq(7),
            rx_next: Seq(u64::MAX),
        }
    }

    pub(crate) fn batches() -> Vec<PersistBatch> {
        vec![
            PersistBatch {
                id: BatchId(1),
                records: vec![
                    Record::Object(object("a", ObjectState::Live)),
                    Record::Object(object("b", ObjectState::Closed(Time::from_millis(5)))),
                    Record::Outbox(op("a", 0, Verb::Open)),
                    Record::Outbox(op("a", 1, Verb::Send)),
                    Record::Held(op("a", 4, Verb::Send)),
                    Record::Inbox(op("a", 2, Verb::Req)),
                    Record::Bounce {
                        op_id: "x".into(),
                        code: "no_such_object".to_owned(),
                        at: Time::from_millis(3),
                    },
                ],
            },
            PersistBatch {
                id: BatchId(2),
                records: vec![
                    Record::OutboxRemoved {
                        obj: Address::parse("a").expect("an address"),
                        seq: Seq::ZERO,
                    },
                    Record::Inbox(op("a", 4, Verb::Send)),
                    Record::HeldRemoved {
                        obj: Address::parse("a").expect("an address"),
                        seq: Seq(4),
                    },
                ],
            },
        ]
    }

    /// One store per file: a second open while the first (any clone of it) lives fails at
    /// once with `Locked`, whatever SQLite's own busy timeout; after it is dropped it opens.
    #[test]
    fn a_second_open_of_the_same_database_fails_at_once() {
        let dir = std::env::temp_dir().join(format!("tether-sqlite-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("locked.db");
        let _ = std::fs::remove_file(&path);
        let store = SqliteStore::open(&path).expect("open");
        let peer = PeerId::new("p");
        store.commit(&peer, &batches()[..1]).expect("commit");
        let clone = store.clone();
        drop(store);
        match SqliteStore::open(&path) {
            Err(StoreError::Locked { path: locked }) => assert_eq!(locked, path),
            other => panic!("{other:?}"),
        }
        clone
            .commit(&peer, &batches()[1..])
            .expect("still the owner");
        drop(clone);
        let store = SqliteStore::open(&path).expect("free again");
        assert_eq!(store.load(&peer).expect("load").outbox.len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn round_trips_the_reference_state_and_scopes_by_peer() {
        let dir = std::env::temp_dir().join(format!("tether-sqlite-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("rt.db");
        let _ = std::fs::remove_file(&path);
        let store = SqliteStore::open_with_prefix(&path, "t_").expect("open");
        let page_size: i64 = store
            .conn
            .lock()
            .expect("lock")
            .pragma_query_value(None, "page_size", |row| row.get(0))
            .expect("page size");
        assert_eq!(page_size, PAGE_SIZE);
        let (a, b) = (PeerId::new("peer-a"), PeerId::new("peer-b"));
        store.commit(&a, &batches()).expect("commit");
        let mut reference = DurableState::default();
        for batch in batches() {
            reference.apply(&batch);
        }
        assert_eq!(store.load(&a).expect("load"), reference);
        assert_eq!(store.load(&b).expect("load"), DurableState::default());
        drop(store);
        // Reopened from the file: the same state.
        let store = SqliteStore::open_with_prefix(&path, "t_").expect("reopen");
        assert_eq!(store.load(&a).expect("load"), reference);
        assert_eq!(store.peers().expect("peers"), vec![a.clone()]);
        // GC drops the tombstone and the closed object older than the cutoff.
        assert_eq!(store.gc(Time::from_millis(6)).expect("gc"), 2);
        let state = store.load(&a).expect("load");
        assert!(state.bounces.is_empty() && !state.objects.contains_key("b"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failed_commit_leaves_no_partial_batch() {
        let conn = Arc::new(Mutex::new(Connection::open_in_memory().expect("memory db")));
        let store = SqliteStore::with_connection(conn.clone(), "").expect("store");
        let peer = PeerId::new("p");
        store.commit(&peer, &batches()[..1]).expect("first");
        let before = store.load(&peer).expect("load");
        // Break the inbox table so the second batch fails after its first statement.
        conn.lock()
            .expect("lock")
            .execute_batch("DROP TABLE inbox")
            .expect("drop");
        assert!(store.commit(&peer, &batches()[1..]).is_err());
        conn.lock()
            .expect("lock")
            .execute_batch(
                "CREATE TABLE inbox (peer INTEGER NOT NULL, place TEXT NOT NULL, \
                 obj TEXT NOT NULL, seq INTEGER NOT NULL, op_id TEXT NOT NULL, \
                 verb TEXT NOT NULL, obj_kind TEXT, body BLOB, code TEXT, reason TEXT, \
                 cap TEXT, at INTEGER NOT NULL, PRIMARY KEY (peer, place, obj, seq))",
            )
            .expect("recreate");
        let after = store.load(&peer).expect("load");
        assert_eq!(
            after.outbox, before.outbox,
            "the outbox delete was rolled back"
        );
        // The host's connection is still usable: the store never closed it.
        drop(store);
        conn.lock()
            .expect("lock")
            .execute_batch("SELECT 1")
            .expect("open");
    }

    /// A peer's number is read once and kept only after its commit: a first commit that
    /// rolled back leaves no number behind, so the peer who commits next takes that number
    /// and the first, committing again, gets its own.
    #[test]
    fn a_peer_number_is_kept_only_once_its_commit_is_durable() {
        let conn = Arc::new(Mutex::new(Connection::open_in_memory().expect("memory db")));
        let store = SqliteStore::with_connection(conn.clone(), "").expect("store");
        let (a, b) = (PeerId::new("a"), PeerId::new("b"));
        let inbox_sql: String = conn
            .lock()
            .expect("lock")
            .query_row(
                "SELECT sql FROM sqlite_master WHERE name = 'inbox'",
                [],
                |row| row.get(0),
            )
            .expect("inbox schema");
        conn.lock()
            .expect("lock")
            .execute_batch("DROP TABLE inbox")
            .expect("drop");
        assert!(store.commit(&a, &batches()).is_err());
        assert!(store.numbered(&a).is_none());
        conn.lock()
            .expect("lock")
            .execute_batch(&inbox_sql)
            .expect("recreate");
        store.commit(&b, &batches()).expect("b");
        store.commit(&a, &batches()[..1]).expect("a");
        let (number_a, number_b) = (store.numbered(&a), store.numbered(&b));
        assert!(number_a.is_some() && number_b.is_some() && number_a != number_b);
        let numbered: Vec<(String, i64)> = conn
            .lock()
            .expect("lock")
            .prepare("SELECT peer, id FROM peers ORDER BY id")
            .expect("peers")
            .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))
            .expect("rows")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(
            numbered,
            vec![
                ("b".to_owned(), number_b.expect("b")),
                ("a".to_owned(), number_a.expect("a"))
            ]
        );
        // Each peer's rows under its own number: b's whole state, a's first batch.
        let mut reference = DurableState::default();
        for batch in batches() {
            reference.apply(&batch);
        }
        assert_eq!(store.load(&b).expect("load b"), reference);
        let mut first = DurableState::default();
        first.apply(&batches()[0]);
        assert_eq!(store.load(&a).expect("load a"), first);
        // A second commit of a finds its number without reading `peers`.
        conn.lock()
            .expect("lock")
            .execute_batch("UPDATE peers SET peer = 'renamed' WHERE peer = 'a'")
            .expect("rename");
        store.commit(&a, &batches()[1..]).expect("a again");
        let count: i64 = conn
            .lock()
            .expect("lock")
            .query_row("SELECT count(*) FROM peers", [], |row| row.get(0))
            .expect("count");
        assert_eq!(count, 2, "no row inserted for a number already known");
    }

    /// The tables tether wrote before [`SCHEMA_VERSION`] 2 (prefix `t_`), as it created them.
    const SCHEMA_V1: &str = "
        CREATE TABLE t_peers (peer TEXT PRIMARY KEY);
        CREATE TABLE t_objects (peer TEXT NOT NULL, obj TEXT NOT NULL,
            kind TEXT NOT NULL, opened_by TEXT NOT NULL, open_id TEXT NOT NULL,
            state TEXT NOT NULL, state_at INTEGER, tx_next INTEGER NOT NULL,
            rx_next INTEGER NOT NULL, PRIMARY KEY (peer, obj));
        CREATE TABLE t_outbox (peer TEXT NOT NULL, obj TEXT NOT NULL, seq INTEGER NOT NULL,
            op_id TEXT NOT NULL, verb TEXT NOT NULL, obj_kind TEXT, body BLOB, code TEXT,
            reason TEXT, cap TEXT, at INTEGER NOT NULL, PRIMARY KEY (peer, obj, seq));
        CREATE TABLE t_inbox (peer TEXT NOT NULL, place TEXT NOT NULL, obj TEXT NOT NULL,
            seq INTEGER NOT NULL, op_id TEXT NOT NULL, verb TEXT NOT NULL, obj_kind TEXT,
            body BLOB, code TEXT, reason TEXT, cap TEXT, at INTEGER NOT NULL,
            PRIMARY KEY (peer, place, obj, seq));
        CREATE TABLE t_dedupe (peer TEXT NOT NULL, op_id TEXT NOT NULL,
            code TEXT NOT NULL, at INTEGER NOT NULL, PRIMARY KEY (peer, op_id));";

    /// A database of version 1 is migrated on open: every peer's state loads as it was
    /// written, the old tables are gone, and the store goes on committing. The version-1 rows
    /// come from real commits: written at version 2, then copied into the version-1 tables
    /// with each peer number put back to its id.
    #[test]
    fn a_version_1_database_is_migrated_with_every_row() {
        let (a, b) = (PeerId::new("peer-a"), PeerId::new("peer-b"));
        let written = Connection::open_in_memory().expect("memory db");
        let source = SqliteStore::with_connection(Arc::new(Mutex::new(written)), "").expect("v2");
        source.commit(&a, &batches()).expect("commit a");
        source.commit(&b, &batches()[..1]).expect("commit b");
        let expected = [
            source.load(&a).expect("load"),
            source.load(&b).expect("load"),
        ];
        assert!(!expected[0].outbox.is_empty() && !expected[0].inbox.is_empty());
        assert!(!expected[1].held.is_empty() && !expected[1].bounces.is_empty());

        let conn = Arc::new(Mutex::new(Connection::open_in_memory().expect("memory db")));
        {
            let v1 = conn.lock().expect("lock");
            v1.execute_batch(SCHEMA_V1).expect("v1 tables");
            let source = source.conn.lock().expect("lock");
            let mut ids = source.prepare("SELECT id, peer FROM peers").expect("peers");
            let ids: BTreeMap<i64, String> = ids
                .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))
                .expect("query")
                .collect::<Result<_, _>>()
                .expect("rows");
            for peer in ids.values() {
                v1.execute("INSERT INTO t_peers VALUES (?1)", params![peer])
                    .expect("peer");
            }
            for table in ["objects", "outbox", "inbox", "dedupe"] {
                let mut rows = source
                    .prepare(&format!("SELECT * FROM {table}"))
                    .expect("select");
                let width = rows.column_count();
                let mut rows = rows.query([]).expect("query");
                let mut copied = 0;
                while let Some(row) = rows.next().expect("row") {
                    let mut values: Vec<rusqlite::types::Value> =
                        (0..width).map(|i| row.get(i).expect("value")).collect();
                    let rusqlite::types::Value::Integer(number) = values[0] else {
                        panic!("peer numbers are integers");
                    };
                    values[0] = rusqlite::types::Value::Text(ids[&number].clone());
                    let marks = vec!["?"; width].join(", ");
                    v1.execute(
                        &format!("INSERT INTO t_{table} VALUES ({marks})"),
                        rusqlite::params_from_iter(values),
                    )
                    .expect("insert");
                    copied += 1;
                }
                assert!(copied > 0, "{table} has rows to migrate");
            }
        }

        let store = SqliteStore::with_connection(conn.clone(), "t_").expect("migrated");
        assert_eq!(store.load(&a).expect("load"), expected[0]);
        assert_eq!(store.load(&b).expect("load"), expected[1]);
        let mut peers = store.peers().expect("peers");
        peers.sort();
        assert_eq!(peers, vec![a.clone(), b.clone()]);
        let tables: Vec<String> = conn
            .lock()
            .expect("lock")
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
            .expect("tables")
            .query_map([], |row| row.get(0))
            .expect("query")
            .collect::<Result<_, _>>()
            .expect("rows");
        assert_eq!(
            tables,
            [
                "t_dedupe",
                "t_inbox",
                "t_meta",
                "t_objects",
                "t_outbox",
                "t_peers"
            ]
        );
        // Opening again is a no-op, and the migrated store goes on committing.
        let store = SqliteStore::with_connection(conn, "t_").expect("reopen");
        store.commit(&b, &batches()[1..]).expect("commit after");
        assert_eq!(store.load(&b).expect("load"), expected[0]);
    }

    /// Version 1 made its tables one statement at a time; a database with only the first of
    /// them is migrated too.
    #[test]
    fn a_version_1_database_cut_short_is_migrated() {
        let conn = Arc::new(Mutex::new(Connection::open_in_memory().expect("memory db")));
        conn.lock()
            .expect("lock")
            .execute_batch(
                "CREATE TABLE t_peers (peer TEXT PRIMARY KEY); INSERT INTO t_peers VALUES ('p');",
            )
            .expect("v1 peers");
        let store = SqliteStore::with_connection(conn, "t_").expect("migrated");
        let peer = PeerId::new("p");
        assert_eq!(store.peers().expect("peers"), vec![peer.clone()]);
        assert_eq!(store.load(&peer).expect("load"), DurableState::default());
        store.commit(&peer, &batches()).expect("commit");
        let mut reference = DurableState::default();
        for batch in batches() {
            reference.apply(&batch);
        }
        assert_eq!(store.load(&peer).expect("load"), reference);
    }

    #[test]
    fn a_stored_address_the_machine_could_not_have_made_is_refused_as_corrupt() {
        for (table, bad) in [("objects", "Q"), ("outbox", "a@b"), ("inbox", "")] {
            let conn = Arc::new(Mutex::new(Connection::open_in_memory().expect("memory db")));
            let store = SqliteStore::with_connection(conn.clone(), "").expect("create");
            let peer = PeerId::new("peer-a");
            store.commit(&peer, &batches()).expect("commit");
            let rows = conn
                .lock()
                .expect("lock")
                .execute(
                    &format!(
                        "UPDATE {table} SET obj = ?1 WHERE rowid = (SELECT min(rowid) FROM {table})"
                    ),
                    params![bad],
                )
                .expect("tamper");
            assert!(rows > 0, "{table} holds rows to tamper with");
            let error = store.load(&peer).expect_err("refused");
            // Ops of either place are read by one reader, which names them `ops`.
            let named = if table == "objects" { "objects" } else { "ops" };
            assert!(
                matches!(&error, StoreError::Corrupt { table: t, .. } if *t == named),
                "{table}: {error}"
            );
        }
    }

    #[test]
    fn a_newer_schema_is_refused_and_left_alone() {
        let conn = Arc::new(Mutex::new(Connection::open_in_memory().expect("memory db")));
        SqliteStore::with_connection(conn.clone(), "").expect("create");
        conn.lock()
            .expect("lock")
            .execute("UPDATE meta SET value = ?1", params![SCHEMA_VERSION + 1])
            .expect("bump");
        let error = SqliteStore::with_connection(conn.clone(), "").expect_err("refused");
        assert!(
            matches!(
                &error,
                StoreError::Schema {
                    found: 3,
                    reads: 2,
                    ..
                }
            ),
            "{error}"
        );
        let version: i64 = conn
            .lock()
            .expect("lock")
            .query_row("SELECT value FROM meta WHERE key = 'schema'", [], |row| {
                row.get(0)
            })
            .expect("meta");
        assert_eq!(version, SCHEMA_VERSION + 1);
    }

    pub(crate) mod equivalence {
        use super::*;
        use proptest::prelude::*;

        pub(crate) fn record() -> impl Strategy<Value = Record> {
            let obj = prop::sample::select(vec!["a", "b/c", "q.1"]);
            let seq = 0u64..6;
            let state = prop_oneof![
                Just(ObjectState::Opening),
                Just(ObjectState::AwaitingAccept),
                Just(ObjectState::Live),
                (0u64..100).prop_map(|t| ObjectState::Closed(Time::from_millis(t))),
                (0u64..100).prop_map(|t| ObjectState::Rejected(Time::from_millis(t))),
            ];
            let verb = prop::sample::select(vec![
                Verb::Open,
                Verb::Send,
                Verb::Req,
                Verb::End,
                Verb::Close,
            ]);
            let op = (
                obj.clone(),
                seq.clone(),
                verb,
                prop::option::of(prop::collection::vec(any::<u8>(), 0..8)),
            )
                .prop_map(|(obj, seq, verb, body)| Op {
                    obj: Address::parse(obj).expect("an address"),
                    seq: Seq(seq),
                    id: format!("id{seq}").into(),
                    verb,
                    obj_kind: (verb == Verb::Open).then_some(ObjKind::Queue),
                    body: body.map(Bytes::from),
                    code: (verb == Verb::End).then(|| "x".to_owned()),
                    reason: None,
                    cap: None,
                    at: Time::from_millis(seq),
                });
            prop_oneof![
                // Every column varies, so a rewrite of an object's row that kept any old value
                // would end away from the reference.
                (
                    obj.clone(),
                    prop::sample::select(vec![ObjKind::Session, ObjKind::Queue]),
                    prop::sample::select(vec![Side::Local, Side::Remote]),
                    prop::sample::select(vec!["o", "p"]),
                    state,
                    (0u64..9, any::<u64>()),
                )
                    .prop_map(
                        |(obj, kind, opened_by, open_id, state, (tx, rx))| {
                            Record::Object(ObjectRecord {
                                obj: Address::parse(obj).expect("an address"),
                                kind,
                                opened_by,
                                open_id: open_id.into(),
                                state,
                                tx_next: Seq(tx),
                                rx_next: Seq(rx),
                            })
                        }
                    ),
                obj.clone().prop_map(|obj| Record::ObjectRemoved {
                    obj: Address::parse(obj).expect("an address")
                }),
                op.clone().prop_map(Record::Outbox),
                op.clone().prop_map(Record::Held),
                op.prop_map(Record::Inbox),
                (obj.clone(), seq.clone()).prop_map(|(obj, seq)| Record::OutboxRemoved {
                    obj: Address::parse(obj).expect("an address"),
                    seq: Seq(seq)
                }),
                (obj.clone(), seq.clone()).prop_map(|(obj, seq)| Record::HeldRemoved {
                    obj: Address::parse(obj).expect("an address"),
                    seq: Seq(seq)
                }),
                (obj, seq).prop_map(|(obj, seq)| Record::InboxRemoved {
                    obj: Address::parse(obj).expect("an address"),
                    seq: Seq(seq)
                }),
                (0u8..4, 0u64..50).prop_map(|(n, at)| Record::Bounce {
                    op_id: format!("b{n}").into(),
                    code: "no_such_object".to_owned(),
                    at: Time::from_millis(at),
                }),
                (0u8..4).prop_map(|n| Record::BounceRemoved {
                    op_id: format!("b{n}").into()
                }),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(200))]

            /// Any sequence of batches, committed in groups of any size, leaves exactly the
            /// state `DurableState::apply` defines, for each peer separately.
            #[test]
            fn sqlite_ends_where_the_reference_ends(
                batches in prop::collection::vec(prop::collection::vec(record(), 0..6), 0..12),
                group in 1usize..4,
            ) {
                let conn = Arc::new(Mutex::new(Connection::open_in_memory().expect("memory db")));
                let store = SqliteStore::with_connection(conn, "p_").expect("store");
                let (peer, other) = (PeerId::new("peer"), PeerId::new("other"));
                let batches: Vec<PersistBatch> = batches
                    .into_iter()
                    .enumerate()
                    .map(|(i, records)| PersistBatch { id: BatchId(i as u64 + 1), records })
                    .collect();
                let mut reference = DurableState::default();
                for chunk in batches.chunks(group) {
                    store.commit(&peer, chunk).expect("commit");
                    for batch in chunk {
                        reference.apply(batch);
                    }
                }
                prop_assert_eq!(store.load(&peer).expect("load"), reference);
                prop_assert_eq!(store.load(&other).expect("load"), DurableState::default());
            }
        }
    }

    #[test]
    fn removals_are_deleted_in_runs_that_never_cross_the_sign_of_a_stored_seq() {
        let removed = |seq| Record::OutboxRemoved {
            obj: Address::parse("a").expect("an address"),
            seq: Seq(seq),
        };
        let edge = i64::MAX as u64;
        let records = [
            removed(7),
            removed(5),
            removed(6),
            removed(9),
            removed(edge - 1),
            removed(edge),
            removed(edge + 1),
            removed(edge + 2),
            Record::InboxRemoved {
                obj: Address::parse("a").expect("an address"),
                seq: Seq(6),
            },
        ];
        let conn = Arc::new(Mutex::new(Connection::open_in_memory().expect("memory db")));
        let store = SqliteStore::with_connection(conn.clone(), "").expect("store");
        let mut removals = Removals::default();
        {
            let mut conn = conn.lock().expect("lock");
            let tx = conn.transaction().expect("transaction");
            let mut prepared = Prepared::new(&tx, &store.tables.sql);
            for record in &records {
                SqliteStore::apply(&mut prepared, 1, record, &mut removals)
                    .expect("a removal waits for its run");
            }
        }
        let runs: Vec<_> = removals.runs().collect();
        assert_eq!(
            runs,
            vec![
                (None, "a", (5, 7)),
                (None, "a", (9, 9)),
                (None, "a", (edge - 1, edge)),
                (None, "a", (edge + 1, edge + 2)),
                (Some("delivered"), "a", (6, 6)),
            ]
        );
        // And in a database: rows on both sides of the edge go, their neighbours stay.
        let peer = PeerId::new("p");
        let seqs = [
            4,
            5,
            6,
            7,
            8,
            9,
            edge - 2,
            edge - 1,
            edge,
            edge + 1,
            edge + 2,
            edge + 3,
        ];
        let inserts = seqs.iter().map(|seq| {
            Record::Outbox(Op {
                seq: Seq(*seq),
                id: format!("id-{seq}").into(),
                ..op("a", 0, Verb::Send)
            })
        });
        let batch = |id, records: Vec<Record>| PersistBatch {
            id: BatchId(id),
            records,
        };
        store
            .commit(&peer, &[batch(1, inserts.collect())])
            .expect("insert");
        store
            .commit(&peer, &[batch(2, records[..8].to_vec())])
            .expect("remove");
        let left: Vec<u64> = store
            .load(&peer)
            .expect("load")
            .outbox
            .keys()
            .map(|(_, seq)| seq.get())
            .collect();
        assert_eq!(left, vec![4, 8, edge - 2, edge + 3]);
    }

    #[test]
    fn rejects_a_prefix_that_is_not_an_identifier() {
        let conn = Arc::new(Mutex::new(Connection::open_in_memory().expect("memory db")));
        assert!(SqliteStore::with_connection(conn, "x; DROP TABLE y").is_err());
    }
}
