//! A broken disk or a second process cannot make a store lose acknowledged commits in
//! silence: a flipped byte in the middle of a log refuses to open (naming the offset) and
//! `tether store repair` keeps every commit before and after it that verifies; a second
//! opener of either store, in this process or another, fails at once.

use std::path::{Path, PathBuf};
use std::process::Command;

use tether::store::{LogOptions, LogStore, SqliteStore, Store, StoreError};
use tether_core::substrate::{Address, BatchId, Op, PeerId, PersistBatch, Record};
use tether_core::time::Time;
use tether_core::wire::envelope::Verb;

/// The `tether` program (this crate's build of it).
const TETHER: &str = env!("CARGO_BIN_EXE_tether-under-test");

/// The tests of this file run one at a time: a child process forked by one shares, until it
/// execs, the open files of the other (a store's lock among them), so a store dropped in one
/// test could still be locked for an instant by the other's child.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tether-damage-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn send(seq: u64) -> Record {
    Record::Outbox(Op {
        obj: Address::parse("q").expect("an address"),
        seq: seq.into(),
        id: format!("m-{seq}").into(),
        verb: Verb::Send,
        obj_kind: None,
        body: Some(bytes::Bytes::from(format!("message {seq}"))),
        code: None,
        reason: None,
        cap: None,
        at: Time::from_millis(seq),
    })
}

/// `tether store <verb> <path>`: its exit code and its JSON report (when it printed one).
fn store_command(verb: &str, path: &Path) -> (i32, Option<serde_json::Value>, String) {
    let output = Command::new(TETHER)
        .args(["store", verb])
        .arg(path)
        .output()
        .expect("run tether");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report = serde_json::from_str(stdout.trim()).ok();
    (
        output.status.code().expect("exited"),
        report,
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn seqs(store: &LogStore, peer: &PeerId) -> Vec<u64> {
    let state = store.load(peer).expect("load");
    state.outbox.values().map(|op| op.seq.get()).collect()
}

#[test]
fn a_flipped_byte_mid_log_refuses_to_open_and_repair_keeps_every_commit_around_it() {
    let _serial = one_at_a_time();
    let dir = temp_dir("flip");
    let path = dir.join("store.log");
    let peer = PeerId::new("peer");
    let options = LogOptions {
        prepare_bytes: 0,
        ..LogOptions::default()
    };
    // 30 commits of one send each; where the 15th lies.
    let store = LogStore::open_with(&path, options).expect("open");
    let mut middle = 0..0;
    for seq in 0..30 {
        let start = store.stats().bytes;
        let batch = PersistBatch {
            id: BatchId(seq + 1),
            records: vec![send(seq)],
        };
        store.commit(&peer, &[batch]).expect("commit");
        if seq == 15 {
            middle = start..store.stats().bytes;
        }
    }
    drop(store);
    let mut bytes = std::fs::read(&path).expect("read");
    let flipped = (middle.start + middle.end) / 2;
    bytes[flipped as usize] ^= 0x20;
    std::fs::write(&path, &bytes).expect("write");

    match LogStore::open(&path) {
        Err(StoreError::Damaged { offset, .. }) => assert_eq!(offset, middle.start),
        other => panic!("a damaged log opened: {other:?}"),
    }
    assert_eq!(
        std::fs::read(&path).expect("read"),
        bytes,
        "the refused file is untouched"
    );

    // The command reports the damage (exit 1) and changes nothing; the data directory works
    // as the path too.
    let (code, report, _) = store_command("check", &dir);
    let report = report.expect("a JSON report");
    assert_eq!(code, 1, "{report}");
    assert_eq!(report["sound"], false);
    assert_eq!(report["commits"], 29);
    assert_eq!(report["damaged"][0][0], middle.start);
    assert_eq!(std::fs::read(&path).expect("read"), bytes);

    let (code, report, stderr) = store_command("repair", &path);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(report.expect("a JSON report")["repaired"], true);
    let (code, report, _) = store_command("check", &path);
    assert_eq!(
        (code, report.expect("report")["sound"].clone()),
        (0, true.into())
    );

    let store = LogStore::open(&path).expect("opens once repaired");
    let expected: Vec<u64> = (0..30).filter(|seq| *seq != 15).collect();
    assert_eq!(
        seqs(&store, &peer),
        expected,
        "every commit before and after it"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A store open in this process: a second open here fails at once, and so does another
/// process (`tether store check`), until the store is dropped.
#[test]
fn a_second_open_of_either_store_fails_at_once_in_any_process() {
    let _serial = one_at_a_time();
    let dir = temp_dir("locks");
    let log = dir.join("store.log");
    let store = LogStore::open(&log).expect("open");
    assert!(matches!(
        LogStore::open(&log),
        Err(StoreError::Locked { .. })
    ));
    let (code, _, stderr) = store_command("check", &log);
    assert_eq!(code, 2);
    assert!(stderr.contains("already open"), "{stderr}");
    drop(store);
    let (code, report, stderr) = store_command("check", &log);
    assert_eq!((code, report.is_some()), (0, true), "{stderr}");

    // Another path to the same file is the same store: one lock.
    let store = LogStore::open(&log).expect("open");
    let link = dir.join("link.log");
    std::os::unix::fs::symlink(&log, &link).expect("symlink");
    assert!(matches!(
        LogStore::open(&link),
        Err(StoreError::Locked { .. })
    ));
    drop(store);
    drop(LogStore::open(&link).expect("through the link once free"));
    assert!(
        std::fs::symlink_metadata(&link)
            .expect("link")
            .file_type()
            .is_symlink(),
        "opening through a link never replaces the link"
    );

    let db = dir.join("store.sqlite3");
    let store = SqliteStore::open(&db).expect("open");
    assert!(matches!(
        SqliteStore::open(&db),
        Err(StoreError::Locked { .. })
    ));
    drop(store);
    SqliteStore::open(&db).expect("free once dropped");
    let _ = std::fs::remove_dir_all(&dir);
}
