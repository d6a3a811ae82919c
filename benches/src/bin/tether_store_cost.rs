//! A deterministic workload of the log store's own work per commit, for instruction counts:
//! the commits two busy peers' log stores take for `--ops` 1 KiB messages over 16 queues,
//! 128 messages a commit. A receiver's commit holds each message's inbox row and its object's
//! record (once per message, as a machine stages them), and the removals of the messages the
//! commit before delivered; a sender's commit the outbox rows, their objects' records and the
//! removals of the ops the commit before sent. Each commit goes through
//! [`Store::commit`](tether::store::Store::commit) of a [`LogStore`] with no prepared space, in
//! a directory given by `--dir` (a tmpfs such as `/dev/shm` keeps the disk out of it), so the
//! instructions counted are the store's: the commit's effective records, their encoding and
//! checksums, and the index of where each live row lies. Judge a change to that path by
//! `valgrind --tool=callgrind target/release/tether-store-cost --dir /dev/shm` before and after.

use bytes::Bytes;
use tether::store::{LogOptions, LogStore, Store};
use tether_core::substrate::{
    Address, BatchId, ObjectRecord, ObjectState, Op, PeerId, PersistBatch, Record, Seq, Side,
};
use tether_core::time::Time;
use tether_core::wire::envelope::{ObjKind, OpId, Verb};

const OBJECTS: usize = 16;
const PER_COMMIT: usize = 128;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let ops = tether_benches::arg(&args, "--ops", 20_000);
    let dir = args
        .iter()
        .position(|arg| arg == "--dir")
        .and_then(|at| args.get(at + 1))
        .map_or_else(std::env::temp_dir, std::path::PathBuf::from)
        .join(format!("tether-store-cost-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("the directory");
    let options = LogOptions {
        prepare_bytes: 0,
        ..LogOptions::default()
    };
    let peer = PeerId::new("peer");
    let body = Bytes::from(vec![7u8; 1024]);
    let addresses: Vec<Address> = (0..OBJECTS)
        .map(|n| Address::parse(&format!("q{n}")).expect("an address"))
        .collect();
    for (side, name) in [(Side::Remote, "receiver.log"), (Side::Local, "sender.log")] {
        let store = LogStore::open_with(dir.join(name), options).expect("open");
        let mut seqs = [0u64; OBJECTS];
        let mut before: Vec<(usize, Seq)> = Vec::new();
        let mut batch = 0;
        let mut sent = 0;
        while sent < ops {
            let mut batches = Vec::new();
            let mut this = Vec::new();
            for _ in 0..PER_COMMIT.min(ops - sent) {
                let object = sent % OBJECTS;
                let seq = Seq(seqs[object]);
                seqs[object] += 1;
                let op = Op {
                    obj: addresses[object].clone(),
                    seq,
                    id: OpId::new(&format!("op-{sent:08}")),
                    verb: Verb::Send,
                    obj_kind: None,
                    body: Some(body.clone()),
                    code: None,
                    reason: None,
                    cap: None,
                    at: Time::from_millis(sent as u64),
                };
                let record = ObjectRecord {
                    obj: addresses[object].clone(),
                    kind: ObjKind::Queue,
                    opened_by: Side::Local,
                    open_id: OpId::new(&format!("open-{object}")),
                    state: ObjectState::Live,
                    tx_next: Seq(if side == Side::Local { seqs[object] } else { 0 }),
                    rx_next: Seq(if side == Side::Remote {
                        seqs[object]
                    } else {
                        0
                    }),
                };
                let row = match side {
                    Side::Remote => Record::Inbox(op),
                    Side::Local => Record::Outbox(op),
                };
                batch += 1;
                batches.push(PersistBatch {
                    id: BatchId(batch),
                    records: vec![row, Record::Object(record)],
                });
                this.push((object, seq));
                sent += 1;
            }
            let removals = before
                .drain(..)
                .map(|(object, seq)| {
                    let obj = addresses[object].clone();
                    match side {
                        Side::Remote => Record::InboxRemoved { obj, seq },
                        Side::Local => Record::OutboxRemoved { obj, seq },
                    }
                })
                .collect();
            batch += 1;
            batches.push(PersistBatch {
                id: BatchId(batch),
                records: removals,
            });
            store.commit(&peer, &batches).expect("commit");
            before = this;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("{ops} messages over {OBJECTS} queues committed on both sides");
}
