//! `SqliteStore` group commit (issue "Tokio shell"): persisted ops/s for 1 KiB sends, beside
//! raw rusqlite inserts of the same rows in one transaction, same run, same settings (file
//! database, WAL, `synchronous=FULL`). Target: at least 50% of the raw rate.
//!
//! The store's workload is exactly what a machine emits for 1,000 sends on one queue: per
//! op an outbox row and the object's seq bump, in per-command batches, all committed in one
//! transaction (group commit).

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use criterion::{criterion_main, Criterion, Throughput};
use rusqlite::{params, Connection};
use tether::store::{SqliteStore, Store};
use tether_core::substrate::{AllowAll, Authorizer, Config, Machine, PeerId, PersistBatch, Record};
use tether_core::time::Time;
use tether_core::wire::envelope::ObjKind;

const OPS: usize = 1_000;

fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tether-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    path
}

/// The batches a machine emits for `OPS` 1 KiB sends on one open queue.
fn machine_batches() -> Vec<PersistBatch> {
    let config = Config {
        outbox_ops_max: OPS + 10,
        ..Config::default()
    };
    let mut machine = Machine::new(
        PeerId::new("peer"),
        config,
        Arc::new(Authorizer::new(AllowAll)),
        1,
    );
    machine
        .open(Time::ZERO, ObjKind::Queue, "q", None)
        .expect("open");
    while machine.poll_persist().is_some() {}
    let body = Bytes::from(vec![7u8; 1024]);
    for _ in 0..OPS {
        machine.send(Time::ZERO, "q", body.clone()).expect("send");
    }
    std::iter::from_fn(|| machine.poll_persist()).collect()
}

fn group_commit(c: &mut Criterion) {
    let batches = machine_batches();
    let outbox_rows = batches
        .iter()
        .flat_map(|b| &b.records)
        .filter(|r| matches!(r, Record::Outbox(_)))
        .count();
    assert_eq!(outbox_rows, OPS);
    let mut group = c.benchmark_group("store/1KiB_sends");
    group.throughput(Throughput::Elements(OPS as u64));
    group.sample_size(20);

    let store = SqliteStore::open(temp_path("store.db")).expect("store");
    let peer = PeerId::new("peer");
    group.bench_function("sqlite_store_group_commit", |b| {
        b.iter(|| store.commit(&peer, &batches).expect("commit"));
    });

    // Baseline: the same outbox rows, inserted raw with one prepared statement in one
    // transaction, no seq bumps, no record dispatch.
    let mut conn = Connection::open(temp_path("raw.db")).expect("raw db");
    conn.pragma_update(None, "journal_mode", "WAL")
        .expect("wal");
    conn.pragma_update(None, "synchronous", "FULL")
        .expect("full");
    conn.execute_batch(
        "CREATE TABLE outbox (peer TEXT NOT NULL, obj TEXT NOT NULL, seq INTEGER NOT NULL,
         op_id TEXT NOT NULL, verb TEXT NOT NULL, obj_kind TEXT, body BLOB, code TEXT,
         reason TEXT, cap TEXT, at INTEGER NOT NULL, PRIMARY KEY (peer, obj, seq))",
    )
    .expect("schema");
    let ops: Vec<_> = batches
        .iter()
        .flat_map(|b| &b.records)
        .filter_map(|r| match r {
            Record::Outbox(op) => Some(op.clone()),
            _ => None,
        })
        .collect();
    group.bench_function("raw_rusqlite_one_transaction", |b| {
        b.iter(|| {
            let tx = conn.transaction().expect("tx");
            {
                let mut insert = tx
                    .prepare_cached(
                        "INSERT OR REPLACE INTO outbox (peer, obj, seq, op_id, verb, obj_kind, \
                         body, code, reason, cap, at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, \
                         ?9, ?10, ?11)",
                    )
                    .expect("prepare");
                for op in &ops {
                    insert
                        .execute(params![
                            "peer",
                            op.obj.as_str(),
                            op.seq.get() as i64,
                            op.id.as_str(),
                            op.verb.as_str(),
                            Option::<&str>::None,
                            op.body.as_deref(),
                            op.code,
                            op.reason,
                            op.cap,
                            op.at.as_millis() as i64,
                        ])
                        .expect("insert");
                }
            }
            tx.commit().expect("commit");
        });
    });
    group.finish();
}

fn benches() {
    let mut criterion = Criterion::default().configure_from_args();
    group_commit(&mut criterion);
}

criterion_main!(benches);
