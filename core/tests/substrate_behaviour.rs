//! Substrate behaviours, each proven from the outside in the deterministic in-memory harness:
//! two machines, a faulty link, a crash switch and virtual time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tether_core::limits::SUBSTRATE_SEQ_RESERVE;
use tether_core::substrate::finality;
use tether_core::substrate::harness::{Faults, Harness, Party};
use tether_core::substrate::{
    AllowAll, AuthorizeContext, Authorizer, BatchId, Config, Denial, Event, Machine, ObjectState,
    PeerId, PersistBatch, ScopeAuthorizer,
};
use tether_core::time::Time;
use tether_core::wire::envelope::{Address, Env, Envelope, ObjKind, OpId, Verb};

fn harness(window: usize) -> Harness {
    let config = Config {
        in_flight_max: window,
        ..Config::default()
    };
    Harness::allowing_all(config, 7)
}

fn body(i: u64) -> Bytes {
    Bytes::from(i.to_be_bytes().to_vec())
}

/// The address `text` (a test's own, valid).
fn addr(text: &str) -> Address {
    Address::parse(text).expect("a valid address")
}

/// Opens queue `q` from A and sends `count` messages; returns their op ids.
fn open_and_send(h: &mut Harness, count: u64) -> Vec<OpId> {
    h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
        .unwrap();
    (0..count)
        .map(|i| {
            h.with(Party::A, |m, now| m.send(now, "q", body(i)))
                .unwrap()
        })
        .collect()
}

/// B's app consumed exactly the bodies 0..count, once each, in order.
fn assert_exactly_once_in_order(h: &Harness, count: u64) {
    let bodies: Vec<Bytes> =
        h.b.consumed
            .iter()
            .filter_map(|op| op.body.clone())
            .collect();
    let expected: Vec<Bytes> = (0..count).map(body).collect();
    assert_eq!(
        bodies, expected,
        "B consumed every message exactly once, in order"
    );
}

/// The counters of the ids a machine mints rise with each one, and only its own ids have one:
/// an id of the same counter under another boot (a peer's, or one a peer made up) has none, so
/// a table of this side's ops by counter never takes a reply naming another id for its own.
#[test]
fn only_the_ids_a_machine_minted_have_its_counters() {
    let mut h = harness(32);
    let ids = open_and_send(&mut h, 3);
    let counters: Vec<u64> = ids
        .iter()
        .map(|id| h.a.machine.minted_counter(id).expect("A minted it"))
        .collect();
    assert!(counters.windows(2).all(|w| w[0] < w[1]), "{counters:?}");
    let (boot, counter) = ids[0].words().expect("a minted id has words");
    assert_eq!(counter, counters[0]);
    let forged = OpId::from_words(boot ^ 1, counter);
    assert_eq!(h.a.machine.minted_counter(&forged), None);
    assert_eq!(
        h.b.machine.minted_counter(&ids[0]),
        None,
        "B's boot differs"
    );
    let upper = OpId::new(&ids[0].as_str().to_uppercase());
    assert_eq!(h.a.machine.minted_counter(&upper), None);
}

#[test]
fn queue_messages_are_delivered_once_in_order_and_acked() {
    for window in [1, 32] {
        let mut h = harness(window);
        h.connect();
        let ids = open_and_send(&mut h, 50);
        h.run();
        assert_exactly_once_in_order(&h, 50);
        let acked: Vec<&OpId> =
            h.a.events
                .iter()
                .filter_map(|e| match e {
                    Event::Acked { op_id, .. } => Some(op_id),
                    _ => None,
                })
                .collect();
        assert_eq!(acked.len(), 51, "the open and every send are hop-acked");
        assert!(ids.iter().all(|id| acked.contains(&id)));
        assert_eq!(h.a.machine.outbox_len(), 0);
        assert!(h.a.events.contains(&Event::Opened { obj: addr("q") }));
    }
}

#[test]
fn exactly_once_across_a_forced_disconnect() {
    for window in [1, 4, 32] {
        let mut h = harness(window);
        h.connect();
        open_and_send(&mut h, 40);
        // Let some frames through, then cut the link with acks and ops in flight.
        for _ in 0..7 {
            h.advance(Duration::ZERO);
        }
        h.faults = Faults {
            drop_per_mille: 300,
            ..Faults::default()
        };
        h.run();
        h.disconnect();
        h.faults = Faults::default();
        h.connect();
        h.run();
        assert_exactly_once_in_order(&h, 40);
        assert_eq!(
            h.a.machine.outbox_len(),
            0,
            "window {window}: everything acked"
        );
    }
}

#[test]
fn exactly_once_across_a_crash_at_every_persist_boundary() {
    // A clean run counts the commits; then each commit of each node is replaced by a crash.
    let mut clean = harness(4);
    clean.connect();
    open_and_send(&mut clean, 8);
    let mut commits = 0;
    clean.run_with(|_| {
        commits += 1;
        false
    });
    for crashing in [Party::A, Party::B] {
        for boundary in 0..commits {
            let mut h = harness(4);
            h.connect();
            open_and_send(&mut h, 8);
            let mut seen = 0;
            h.run_with(|id| {
                seen += 1;
                id == crashing && seen == boundary + 1
            });
            // The crash may have cut the link mid-flight: reconnect and settle.
            h.connect();
            h.run();
            // A crash before A committed an enqueue loses that op (its send never resolved);
            // every op A committed is consumed by B exactly once, in order.
            let promised: Vec<Bytes> =
                h.a.enqueued
                    .iter()
                    .filter(|op| op.verb == Verb::Send)
                    .filter_map(|op| op.body.clone())
                    .collect();
            let crashed_before_enqueue = crashing == Party::A && promised.len() < 8;
            if !crashed_before_enqueue {
                assert_exactly_once_in_order(&h, 8);
            }
            // A send A never committed travels while its commit runs: it is delivered once, if
            // it reached B before the crash, or not at all (README, the hop ack). So B has
            // every promised send and perhaps some of the others, each once, in send order.
            let consumed = consumed_bodies(&h);
            let sent: Vec<Bytes> = (0..8).map(body).collect();
            let mut rest = sent.iter();
            assert!(
                consumed.iter().all(|b| rest.any(|s| s == b)),
                "{crashing:?} crash at commit {boundary}: B consumed {consumed:?}, once each, \
                 in send order"
            );
            assert!(
                promised.iter().all(|p| consumed.contains(p)),
                "{crashing:?} crash at commit {boundary}: every committed send is consumed"
            );
            assert_eq!(
                h.a.machine.outbox_len(),
                0,
                "{crashing:?} crash at commit {boundary}"
            );
        }
    }
}

#[test]
fn lossy_duplicating_reordering_link_still_delivers_exactly_once_in_order() {
    for seed in 0..20 {
        let config = Config {
            in_flight_max: 8,
            ..Config::default()
        };
        let mut h = Harness::allowing_all(config, seed);
        h.faults = Faults {
            drop_per_mille: 100,
            duplicate_per_mille: 100,
            reorder_per_mille: 100,
        };
        h.connect();
        open_and_send(&mut h, 30);
        for _ in 0..40 {
            h.run();
            if h.a.machine.outbox_len() == 0 {
                break;
            }
            // Lost frames are recovered by reconnecting (resend) or by the gap resync.
            h.disconnect();
            h.connect();
        }
        h.faults = Faults::default();
        h.run();
        assert_exactly_once_in_order(&h, 30);
    }
}

#[test]
fn requests_get_their_end_to_end_answer() {
    let mut h = harness(8);
    h.connect();
    h.with(Party::A, |m, now| {
        m.open(now, ObjKind::Session, "svc", Some("token-1"))
    })
    .unwrap();
    h.run();
    let req_id = h
        .with(Party::A, |m, now| {
            m.req(now, "svc", Bytes::from_static(b"ping"))
        })
        .unwrap();
    h.run();
    let delivered = h.b.events.iter().find_map(|e| match e {
        Event::Delivered(op) if op.verb == Verb::Req => Some(op.id.clone()),
        _ => None,
    });
    assert_eq!(delivered, Some(req_id.clone()));
    assert!(
        h.b.consumed.is_empty(),
        "a req stays delivered until it is answered"
    );
    h.with(Party::B, |m, now| {
        m.answer(
            now,
            "svc",
            &req_id,
            Verb::End,
            Some(Bytes::from_static(b"pong")),
            None,
        )
    })
    .unwrap();
    h.run();
    let answered = h.a.events.iter().find_map(|e| match e {
        Event::Answered {
            req_id: id,
            verb,
            body,
            ..
        } => Some((id.clone(), *verb, body.clone())),
        _ => None,
    });
    assert_eq!(h.b.consumed.len(), 1, "the final answer consumed the req");
    assert_eq!(
        answered,
        Some((req_id, Verb::End, Some(Bytes::from_static(b"pong"))))
    );
    let opened = h.b.events.iter().find_map(|e| match e {
        Event::OpenRequested { cap, kind, .. } => Some((cap.clone(), *kind)),
        _ => None,
    });
    assert_eq!(opened, Some((Some("token-1".to_owned()), ObjKind::Session)));
}

#[test]
fn unknown_object_bounces_once_then_the_op_id_is_tombstoned() {
    let mut h = harness(1);
    h.connect();
    let mut env = Env::new(Verb::Send);
    env.obj = Some(Address::parse("nowhere").unwrap());
    env.id = Some("op-1".into());
    env.seq = Some(3);
    env.receipt = Some(1);
    let stray = Envelope::new(env);
    h.inject(Party::A, &stray);
    h.run();
    h.inject(Party::A, &stray);
    h.run();
    let stats = h.b.machine.stats();
    assert_eq!(
        (stats.bounces, stats.bounces_reserved),
        (1, 1),
        "one bounce, then re-served"
    );
    assert!(
        h.b.store.bounces.contains_key("op-1"),
        "the tombstone is durable"
    );
    assert!(
        h.b.machine.object_state("nowhere").is_none(),
        "no object was created"
    );
    // The name was never tombstoned: a later legitimate open works.
    h.with(Party::A, |m, now| {
        m.open(now, ObjKind::Queue, "nowhere", None)
    })
    .unwrap();
    h.run();
    assert_eq!(h.b.machine.object_state("nowhere"), Some(ObjectState::Live));
}

#[test]
fn an_err_is_never_bounced_and_close_from_a_non_participant_is_dropped() {
    let mut h = harness(1);
    h.set_auto_accept(Party::A, false);
    h.connect();
    // B opens "mine"; A never accepts, so A is not a participant of it yet.
    h.with(Party::B, |m, now| {
        m.open(now, ObjKind::Session, "mine", None)
    })
    .unwrap();
    h.run();
    let mut close = Env::new(Verb::Close);
    close.obj = Some(Address::parse("mine").unwrap());
    close.id = Some("rogue-close".into());
    close.seq = Some(0);
    close.receipt = Some(1);
    h.inject(Party::A, &Envelope::new(close));
    let mut err = Env::new(Verb::Err);
    err.obj = Some(Address::parse("elsewhere").unwrap());
    err.id = Some("rogue-err".into());
    err.code = Some("closed".into());
    h.inject(Party::A, &Envelope::new(err));
    h.run();
    let stats = h.b.machine.stats();
    assert_eq!(stats.finality_rejected, 2);
    assert_eq!(stats.bounces, 0, "an err never begets an err");
    assert_eq!(h.b.machine.object_state("mine"), Some(ObjectState::Opening));
}

#[test]
fn an_authorize_denial_answers_the_op_and_leaves_no_state() {
    let deny_opens = ScopeAuthorizer::new(
        |_| Some(vec!["producer".to_owned()]),
        [("producer".to_owned(), vec!["send".to_owned()])],
    );
    let mut h = Harness::new(
        Config::default(),
        Authorizer::new(AllowAll),
        Authorizer::new(deny_opens),
        1,
    );
    h.connect();
    let open_id = h
        .with(Party::A, |m, now| m.open(now, ObjKind::Queue, "jobs", None))
        .unwrap();
    h.run();
    assert!(
        h.b.store.objects.is_empty() && h.b.store.row_count() == 0,
        "nothing persisted"
    );
    assert!(h.b.machine.object_state("jobs").is_none());
    assert_eq!(
        h.b.machine.stats().denials.get("open:scope_denied"),
        Some(&1)
    );
    assert!(h.a.events.contains(&Event::Rejected {
        obj: addr("jobs"),
        code: Some(finality::SCOPE_DENIED.into())
    }));
    assert!(!h
        .a
        .events
        .iter()
        .any(|e| matches!(e, Event::Acked { op_id, .. } if *op_id == open_id)));
}

#[test]
fn an_op_denied_in_the_middle_does_not_stall_the_object() {
    // B denies the second send only: A's third send must still arrive (floor skips the gap).
    let sends = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&sends);
    let deny_second = move |ctx: &AuthorizeContext<'_>| {
        if ctx.verb == Verb::Send && counter.fetch_add(1, Ordering::SeqCst) == 1 {
            Err(Denial::with_code("unauthorized"))
        } else {
            Ok(())
        }
    };
    for window in [1, 8] {
        sends.store(0, Ordering::SeqCst);
        let config = Config {
            in_flight_max: window,
            ..Config::default()
        };
        let mut h = Harness::new(
            config,
            Authorizer::new(AllowAll),
            Authorizer::new(deny_second.clone()),
            3,
        );
        h.connect();
        let ids = open_and_send(&mut h, 3);
        h.run();
        let bodies: Vec<Bytes> =
            h.b.consumed
                .iter()
                .filter_map(|op| op.body.clone())
                .collect();
        assert_eq!(bodies, [body(0), body(2)], "window {window}");
        assert!(h.a.events.contains(&Event::Futile {
            obj: addr("q"),
            op_id: ids[1].clone(),
            code: "unauthorized".into()
        }));
        assert_eq!(h.a.machine.outbox_len(), 0);
    }
}

#[test]
fn a_stale_receipt_is_ignored_and_counted() {
    let mut h = harness(1);
    h.connect();
    h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
        .unwrap();
    h.run();
    h.with(Party::A, |m, now| m.send(now, "q", body(1)))
        .unwrap();
    // Before B answers, an ack citing an older attempt arrives.
    let mut ack = Env::new(Verb::Ack);
    ack.obj = Some(Address::parse("q").unwrap());
    ack.id = Some("whatever".into());
    ack.seq = Some(1);
    ack.receipt = Some(99);
    h.inject(Party::B, &ack_envelope(ack));
    h.run();
    assert_eq!(h.a.machine.stats().stale_receipts, 1);
    assert_exactly_once_in_order_of(&h, &[body(1)]);
}

fn ack_envelope(env: Env) -> Envelope {
    Envelope::new(env)
}

fn assert_exactly_once_in_order_of(h: &Harness, expected: &[Bytes]) {
    assert_eq!(consumed_bodies(h), expected);
}

/// The bodies B's app consumed, in order.
fn consumed_bodies(h: &Harness) -> Vec<Bytes> {
    h.b.consumed
        .iter()
        .filter_map(|op| op.body.clone())
        .collect()
}

#[test]
fn a_gap_older_than_thirty_seconds_is_resynced() {
    let mut h = harness(4);
    h.connect();
    h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
        .unwrap();
    h.run();
    // The first send is lost on the wire; the second arrives and is held.
    h.faults = Faults {
        drop_per_mille: 1000,
        ..Faults::default()
    };
    h.with(Party::A, |m, now| m.send(now, "q", body(0)))
        .unwrap();
    h.run();
    h.faults = Faults::default();
    h.with(Party::A, |m, now| m.send(now, "q", body(1)))
        .unwrap();
    h.run();
    assert!(h.b.consumed.is_empty(), "seq 2 waits for seq 1");
    assert_eq!(h.b.store.held.len(), 1, "the early op is held durably");
    h.advance(Duration::from_secs(29));
    h.run();
    assert_eq!(h.b.machine.stats().resyncs_sent, 0);
    h.advance(Duration::from_secs(2));
    h.run();
    assert_eq!(h.b.machine.stats().resyncs_sent, 1);
    assert_exactly_once_in_order_of(&h, &[body(0), body(1)]);
}

#[test]
fn durable_state_does_not_grow_with_ops_exchanged() {
    let mut h = harness(32);
    h.connect();
    open_and_send(&mut h, 500);
    h.run();
    assert_exactly_once_in_order(&h, 500);
    // One object row per side; no per-op rows once ops are acked and consumed.
    assert_eq!(h.a.store.row_count(), 1);
    assert_eq!(h.b.store.row_count(), 1);
}

#[test]
fn close_ends_the_object_on_both_sides_and_later_ops_are_futile() {
    let mut h = harness(4);
    h.connect();
    open_and_send(&mut h, 2);
    h.run();
    h.with(Party::B, |m, now| m.close(now, "q", "done"))
        .unwrap();
    let late = h
        .with(Party::A, |m, now| m.send(now, "q", body(9)))
        .unwrap();
    h.run();
    assert!(matches!(
        h.a.machine.object_state("q"),
        Some(ObjectState::Closed(_))
    ));
    assert!(h.a.events.iter().any(|e| matches!(
        e,
        Event::Closed {
            by_remote: true,
            ..
        }
    )));
    assert!(h
        .a
        .events
        .iter()
        .any(|e| matches!(e, Event::Futile { op_id, .. } if *op_id == late)));
    assert_exactly_once_in_order(&h, 2);
}

/// Virtual seconds to move `ops` 1 KiB sends over one object with `window` ops in flight and a
/// 5 ms one-way delay.
fn virtual_seconds(window: usize, ops: u64) -> f64 {
    let mut h = harness(window);
    h.latency = Duration::from_millis(5);
    h.connect();
    h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
        .unwrap();
    h.run();
    let start = h.now;
    for _ in 0..ops {
        h.with(Party::A, |m, now| {
            m.send(now, "q", Bytes::from(vec![7u8; 1024]))
        })
        .unwrap();
    }
    h.run();
    assert_eq!(h.b.consumed.len() as u64, ops);
    h.now.saturating_since(start).as_secs_f64()
}

#[test]
fn a_window_of_32_moves_at_least_ten_times_the_ops_of_stop_and_wait_under_delay() {
    let stop_and_wait = virtual_seconds(1, 320);
    let windowed = virtual_seconds(32, 320);
    assert!(
        stop_and_wait >= 10.0 * windowed,
        "window 1: {stop_and_wait} s, window 32: {windowed} s"
    );
}

#[test]
fn an_address_with_an_at_sign_is_answered_routing_not_supported() {
    let mut h = harness(1);
    h.connect();
    let mut env = Env::new(Verb::Send);
    env.obj = Some(Address::parse("userxhost").unwrap());
    env.id = Some("routed-op".into());
    env.seq = Some(0);
    env.receipt = Some(1);
    let mut bytes = bytes::BytesMut::new();
    Envelope::new(env).encode(&mut bytes).unwrap();
    // Same length, so the frame stays well formed apart from the address.
    let at = bytes.windows(9).position(|w| w == b"userxhost").unwrap();
    bytes[at + 4] = b'@';
    h.inject_bytes(Party::A, bytes.freeze());
    h.run();
    assert_eq!(h.b.machine.stats().malformed, 1);
    // A never sent `routed-op`, so the answer is about nothing of A's: dropped, not answered.
    assert_eq!(h.a.machine.stats().finality_rejected, 1);
    assert_eq!(h.a.machine.stats().bounces, 0);
}

#[test]
fn keepalives_keep_a_quiet_link_and_silence_kills_it() {
    let mut h = harness(1);
    h.connect();
    for _ in 0..6 {
        h.advance(Duration::from_secs(31));
        h.run();
    }
    assert!(!h.a.events.contains(&Event::LinkDead), "keepalives flowed");
    h.faults = Faults {
        drop_per_mille: 1000,
        ..Faults::default()
    };
    for _ in 0..4 {
        h.advance(Duration::from_secs(31));
        h.run();
    }
    assert!(h.a.events.contains(&Event::LinkDead));
    assert!(h.b.events.contains(&Event::LinkDead));
}

#[test]
fn an_op_that_cannot_be_sent_within_the_ttl_is_futile() {
    let mut h = harness(1);
    h.connect();
    h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
        .unwrap();
    h.run();
    h.disconnect();
    let id = h
        .with(Party::A, |m, now| m.send(now, "q", body(1)))
        .unwrap();
    h.run();
    h.advance(Duration::from_secs(24 * 3600));
    h.run();
    assert!(h.a.events.contains(&Event::Futile {
        obj: addr("q"),
        op_id: id,
        code: finality::TTL_EXPIRED.into()
    }));
    assert_eq!(h.a.machine.outbox_len(), 0);
    h.connect();
    h.run();
    assert!(h.b.consumed.is_empty(), "an expired op is never delivered");
}

#[test]
fn the_stats_snapshot_serializes() {
    let mut h = harness(4);
    h.connect();
    open_and_send(&mut h, 3);
    h.run();
    let stats = h.a.machine.stats();
    assert_eq!((stats.ops_enqueued, stats.ops_acked), (4, 4));
    let json = serde_json::to_value(&stats).unwrap();
    assert_eq!(json["ops_acked"], 4);
    assert_eq!(json["link_ups"], 1);
}

/// Ops of `obj` B holds for its app: delivered and unconsumed, plus held above the frontier.
fn held_for_app(h: &Harness, obj: &str) -> usize {
    let inbox =
        h.b.machine
            .pending_deliveries()
            .iter()
            .filter(|op| op.obj == obj)
            .count();
    let held = h.b.store.held.keys().filter(|(o, _)| o == obj).count();
    inbox + held
}

#[test]
fn a_consumer_stalled_past_the_window_and_the_inbox_bound_loses_nothing() {
    // The issue's case: window 32, B's app reads nothing while A keeps ~1,200 sends coming.
    let mut h = harness(32);
    let window = h.b.machine.receive_window() as usize;
    h.set_auto_consume(Party::B, false);
    h.connect();
    h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
        .unwrap();
    let total = 1_200u64;
    let (mut sent, mut refused) = (0u64, 0u64);
    let mut stalled_steps = 0;
    while sent < total {
        // A's app sends until its outbox is full: the machine refuses with QueueFull, the
        // shell's `send` waits, `try_send` reports `Full`.
        match h.with(Party::A, |m, now| m.send(now, "q", body(sent))) {
            Ok(_) => sent += 1,
            Err(tether_core::substrate::CommandError::QueueFull) => {
                refused += 1;
                h.run();
                assert!(held_for_app(&h, "q") <= window, "B never holds more than W");
                // The consumer stays stopped for a long stretch, then creeps.
                stalled_steps += 1;
                if stalled_steps > 3 {
                    h.consume_some(Party::B, 7);
                }
                h.advance(Duration::from_secs(1));
            }
            Err(other) => panic!("unexpected refusal {other}"),
        }
    }
    h.run();
    assert!(
        refused > 0,
        "the producer outran the consumer and was pushed back"
    );
    assert!(held_for_app(&h, "q") <= window);
    h.set_auto_consume(Party::B, true);
    h.consume_all(Party::B);
    for _ in 0..10 {
        h.run();
        h.advance(Duration::from_secs(1));
    }
    assert_exactly_once_in_order(&h, total);
    let futile: Vec<&Event> =
        h.a.events
            .iter()
            .filter(|e| matches!(e, Event::Futile { .. }))
            .collect();
    assert!(
        futile.is_empty(),
        "nothing ends futile for a slow app: {futile:?}"
    );
    let (a, b) = (h.a.machine.stats(), h.b.machine.stats());
    assert_eq!(b.out_of_seq, 0, "a correct sender never passes its credit");
    assert!(a.transient.is_empty(), "no op is refused for want of room");
    assert!(b.credits_sent > 0, "consumption reopened the window");
}

#[test]
fn a_receiver_restarted_without_consuming_keeps_its_window_and_loses_nothing() {
    let mut h = harness(4);
    let window = h.b.machine.receive_window() as usize;
    h.set_auto_consume(Party::B, false);
    h.connect();
    open_and_send(&mut h, 3 * window as u64);
    h.run();
    assert_eq!(
        held_for_app(&h, "q"),
        window,
        "B filled its window and no more"
    );
    // B restarts without having consumed anything, twice.
    h.crash(Party::B);
    h.run();
    h.crash(Party::B);
    h.run();
    assert!(held_for_app(&h, "q") <= window);
    h.set_auto_consume(Party::B, true);
    h.consume_all(Party::B);
    h.run();
    assert_exactly_once_in_order(&h, 3 * window as u64);
    assert_eq!(h.b.machine.stats().out_of_seq, 0);
}

#[test]
fn ops_acked_above_a_gap_of_expired_ops_are_delivered_not_skipped() {
    // Seeds 20002814 and 20002116: recovered ops below a gap of TTL-expired ops travel with
    // ops above it; the floor they carry is below the gap, so the ops above are held and
    // acked. The floor that later passes the gap must deliver them, and must reach B even
    // when A has nothing left to send.
    let mut h = harness(32);
    h.connect();
    h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
        .unwrap();
    h.run();
    h.disconnect();
    for i in 0..2 {
        h.with(Party::A, |m, now| m.send(now, "q", body(i)))
            .unwrap();
    }
    h.run();
    h.crash(Party::A); // m0 and m1 are recovered: maybe sent, so they never expire
    for i in 2..5 {
        h.with(Party::A, |m, now| m.send(now, "q", body(i)))
            .unwrap();
    }
    h.run();
    h.advance(Config::default().queue_ttl + Duration::from_secs(1));
    h.run();
    let expired =
        h.a.events
            .iter()
            .filter(|e| matches!(e, Event::Futile { code, .. } if code == finality::TTL_EXPIRED));
    assert_eq!(expired.count(), 3, "m2..m4 expired unsent");
    for i in 5..7 {
        h.with(Party::A, |m, now| m.send(now, "q", body(i)))
            .unwrap();
    }
    h.connect();
    h.run();
    assert_eq!(h.a.machine.outbox_len(), 0, "everything was acked");
    assert_eq!(consumed_bodies(&h), [body(0), body(1), body(5), body(6)]);
    assert!(h.b.store.held.is_empty(), "no op is left above a gap");
    h.with(Party::A, |m, now| m.send(now, "q", body(7)))
        .unwrap();
    h.run();
    assert_eq!(
        consumed_bodies(&h),
        [body(0), body(1), body(5), body(6), body(7)]
    );
    // The open (seq 0) reserved seqs below 1 + the reservation; the first boot used 1 and 2,
    // and the restart resumed at the reservation's end. B skips the reservation's unused rest
    // (from 3 on) and the three expired ops above it.
    let unused = SUBSTRATE_SEQ_RESERVE + 1 - 3;
    assert_eq!(h.b.machine.stats().skipped_below_floor, unused + 3);
}

#[test]
fn a_floor_the_sender_forgot_in_a_crash_goes_ahead_of_the_op_past_its_reservation() {
    let mut h = harness(32);
    h.connect();
    h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
        .unwrap();
    h.run();
    h.disconnect();
    h.with(Party::A, |m, now| m.send(now, "q", body(0)))
        .unwrap();
    h.run();
    h.crash(Party::A);
    h.with(Party::A, |m, now| m.send(now, "q", body(1)))
        .unwrap();
    h.run();
    h.advance(Config::default().queue_ttl + Duration::from_secs(1));
    h.run();
    // A crashes again: what ended (m1) is no longer in its memory. m2 takes a seq past the
    // reservation, so past the credit B gave: the floor goes ahead of it on its own, and B
    // delivers m2 without waiting for a gap resync.
    h.crash(Party::A);
    h.with(Party::A, |m, now| m.send(now, "q", body(2)))
        .unwrap();
    h.connect();
    h.run();
    assert_eq!(consumed_bodies(&h), [body(0), body(2)]);
    assert_eq!(h.a.machine.outbox_len(), 0);
    assert_eq!(h.b.machine.stats().resyncs_sent, 0);
    assert!(h.b.store.held.is_empty());
}

#[test]
fn closed_objects_are_retained_up_to_a_bound() {
    let mut h = harness(1);
    h.connect();
    let bound = tether_core::limits::SUBSTRATE_RETAINED_OBJECTS_MAX;
    for i in 0..bound + 3 {
        let name = format!("o{i}");
        h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, &name, None))
            .unwrap();
        h.run();
        h.with(Party::A, |m, now| m.close(now, &name, "done"))
            .unwrap();
        h.run();
    }
    assert_eq!(h.a.machine.stats().objects_evicted, 3);
    assert_eq!(h.b.machine.stats().objects_evicted, 3);
    assert!(h.b.store.objects.len() <= bound + 1);
}

#[test]
fn a_machine_corrects_its_settings_window_and_retention() {
    let config = Config {
        dedupe_retention: Duration::from_secs(60),
        queue_ttl: Duration::from_secs(3600),
        in_flight_max: 0,
        ..Config::default()
    };
    assert_eq!(
        config.clone().checked().dedupe_retention,
        Duration::from_secs(3600)
    );
    // A window of 0 would never send anything; the machine uses 1.
    let mut machine = Machine::new(
        PeerId::new("b"),
        config,
        Arc::new(Authorizer::new(AllowAll)),
        1,
    );
    let now = Time::from_millis(1);
    machine.handle_link_up(now);
    machine.open(now, ObjKind::Queue, "q", None).unwrap();
    let batch = machine.poll_persist().unwrap();
    assert_eq!(batch.id, BatchId(1));
    machine.handle_persisted(now, batch.id);
    assert_eq!(
        machine.poll_transmit().map(|frame| frame.env.kind),
        Some(Verb::Open)
    );
}

#[test]
fn a_close_never_reports_futile_an_op_the_closer_already_delivered() {
    // Found by the model check: A's op reaches B and is consumed, B closes before A sees the
    // ack. A must learn the op was delivered (acked), not futile; the later op is futile.
    let mut h = harness(2);
    h.connect();
    h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
        .unwrap();
    h.run();
    let first = h
        .with(Party::A, |m, now| m.send(now, "q", body(0)))
        .unwrap();
    let second = h
        .with(Party::A, |m, now| m.send(now, "q", body(1)))
        .unwrap();
    assert!(h.commit(Party::A) && h.commit(Party::A));
    assert!(h.deliver_at(Party::B, 0, false), "the first send reaches B");
    h.with(Party::B, |m, now| m.close(now, "q", "done"))
        .unwrap();
    h.disconnect();
    h.connect();
    h.run();
    assert_exactly_once_in_order_of(&h, &[body(0)]);
    assert!(h
        .a
        .events
        .iter()
        .any(|e| matches!(e, Event::Acked { op_id, .. } if *op_id == first)));
    assert!(!h
        .a
        .events
        .iter()
        .any(|e| matches!(e, Event::Futile { op_id, .. } if *op_id == first)));
    assert!(h
        .a
        .events
        .iter()
        .any(|e| matches!(e, Event::Futile { op_id, .. } if *op_id == second)));
    assert_eq!(h.a.machine.outbox_len(), 0);
}

/// Opens session `svc` from A and delivers one req to B's app (unanswered). Returns its id.
fn session_with_one_request(h: &mut Harness) -> OpId {
    h.connect();
    h.with(Party::A, |m, now| {
        m.open(now, ObjKind::Session, "svc", None)
    })
    .unwrap();
    h.run();
    let req_id = h
        .with(Party::A, |m, now| {
            m.req(now, "svc", Bytes::from_static(b"q"))
        })
        .unwrap();
    h.run();
    assert_eq!(h.b.machine.pending_deliveries().len(), 1);
    req_id
}

#[test]
fn a_closed_session_drops_requests_it_can_no_longer_answer() {
    let mut h = harness(4);
    let req_id = session_with_one_request(&mut h);
    h.with(Party::A, |m, now| m.close(now, "svc", "bye"))
        .unwrap();
    h.run();
    assert_eq!(
        h.b.machine.object_state("svc").map(|s| s.is_terminal()),
        Some(true)
    );
    assert!(h.b.machine.pending_deliveries().is_empty());
    assert!(
        h.b.store.inbox.is_empty(),
        "nothing unanswerable is kept durably"
    );
    let answer = h.with(Party::B, |m, now| {
        m.answer(now, "svc", &req_id, Verb::End, None, None)
    });
    assert!(answer.is_err(), "a closed session takes no answer");
    // After a restart the req is not delivered again.
    let before = h.b.events.len();
    h.crash(Party::B);
    h.run();
    assert!(!h.b.events[before..]
        .iter()
        .any(|e| matches!(e, Event::Delivered(op) if op.id == req_id)));
}

#[test]
fn an_answer_waits_for_the_link_however_long_it_takes() {
    let mut h = harness(4);
    let req_id = session_with_one_request(&mut h);
    h.disconnect();
    h.with(Party::B, |m, now| {
        m.answer(now, "svc", &req_id, Verb::End, Some(body(9)), None)
    })
    .unwrap();
    h.run();
    h.advance(Duration::from_secs(25 * 3600));
    h.run();
    assert!(!h.b.events.iter().any(|e| matches!(e, Event::Futile { .. })));
    h.connect();
    h.run();
    assert!(h.a.events.iter().any(|e| matches!(
        e,
        Event::Answered { req_id: id, verb: Verb::End, .. } if *id == req_id
    )));
}

#[test]
fn an_op_recovered_after_a_crash_is_never_expired_as_unsent() {
    let mut h = harness(4);
    h.connect();
    h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
        .unwrap();
    h.run();
    let id = h
        .with(Party::A, |m, now| m.send(now, "q", body(1)))
        .unwrap();
    // The send reaches B and is made durable there; B's ack is lost.
    assert!(h.commit(Party::A));
    assert!(h.deliver_at(Party::B, 0, false));
    while h.commit(Party::B) {}
    while h.drop_at(Party::A, 0) {}
    // A restarts without knowing whether the op left: it may have been delivered (it was).
    h.disconnect();
    h.crash(Party::A);
    h.advance(Duration::from_secs(25 * 3600));
    h.run();
    assert!(
        !h.a.events
            .iter()
            .any(|e| matches!(e, Event::Futile { op_id, .. } if *op_id == id)),
        "a possibly delivered op is never reported futile"
    );
    h.connect();
    h.run();
    assert!(h
        .a
        .events
        .iter()
        .any(|e| matches!(e, Event::Acked { op_id, .. } if *op_id == id)));
    assert_exactly_once_in_order_of(&h, &[body(1)]);
}

#[test]
fn simultaneous_opens_of_one_address_resolve_to_the_lower_open_id() {
    for window in [1, 32] {
        let mut h = harness(window);
        h.connect();
        let a_open = h
            .with(Party::A, |m, now| m.open(now, ObjKind::Queue, "x", None))
            .unwrap();
        let b_open = h
            .with(Party::B, |m, now| m.open(now, ObjKind::Queue, "x", None))
            .unwrap();
        // Each side queues a send behind its own open.
        h.with(Party::A, |m, now| m.send(now, "x", body(1)))
            .unwrap();
        h.with(Party::B, |m, now| m.send(now, "x", body(2)))
            .unwrap();
        h.run();
        let (winner, loser, losing_open) = if a_open < b_open {
            (Party::A, Party::B, b_open.clone())
        } else {
            (Party::B, Party::A, a_open.clone())
        };
        let node = |h: &mut Harness, id| h.node(id).clone();
        let (w, l) = (node(&mut h, winner), node(&mut h, loser));
        assert!(
            w.events.contains(&Event::Opened { obj: addr("x") }),
            "the winner's open is accepted"
        );
        assert!(
            l.events.contains(&Event::Futile {
                obj: addr("x"),
                op_id: losing_open,
                code: finality::OPEN_CONFLICT.into()
            }),
            "the loser's open ends futile"
        );
        assert_eq!(w.machine.object_state("x"), Some(ObjectState::Live));
        assert_eq!(l.machine.object_state("x"), Some(ObjectState::Live));
        // The send queued behind the losing open ended with it; the winner's was delivered.
        let futile_sends = l
            .events
            .iter()
            .filter(|e| matches!(e, Event::Futile { code, .. } if code == finality::OPEN_CONFLICT))
            .count();
        assert_eq!(
            futile_sends, 2,
            "window {window}: the open and the send behind it"
        );
        assert_eq!(l.consumed.len(), 1, "the loser got the winner's send");
        assert!(w.consumed.is_empty());
        // Both directions work afterwards.
        h.with(loser, |m, now| m.send(now, "x", body(3))).unwrap();
        h.run();
        assert_eq!(h.node(winner).consumed.len(), 1);
        assert_eq!(h.node(winner).machine.stats().open_conflicts, 1);
    }
}

#[test]
fn simultaneous_opens_resolve_once_over_a_faulty_link_with_crashes() {
    for seed in 0..40 {
        let mut h = Harness::allowing_all(harness_config(4), seed);
        h.faults = Faults {
            drop_per_mille: 150,
            duplicate_per_mille: 150,
            reorder_per_mille: 150,
        };
        h.connect();
        let a_open = h
            .with(Party::A, |m, now| m.open(now, ObjKind::Session, "x", None))
            .unwrap();
        let b_open = h
            .with(Party::B, |m, now| m.open(now, ObjKind::Session, "x", None))
            .unwrap();
        let mut crashed = false;
        for round in 0..40 {
            h.run_with(|id| {
                // One crash of one side, somewhere in the first rounds.
                let crash = !crashed && round == (seed % 3) as usize && id == Party::B;
                crashed |= crash;
                crash
            });
            let live = |h: &Harness, id| {
                h.node_ref(id).machine.object_state("x") == Some(ObjectState::Live)
            };
            if live(&h, Party::A)
                && live(&h, Party::B)
                && h.a.machine.outbox_len() == 0
                && h.b.machine.outbox_len() == 0
            {
                break;
            }
            h.disconnect();
            h.connect();
        }
        h.faults = Faults::default();
        h.run();
        let (winner, loser, losing_open) = if a_open < b_open {
            (&h.a, &h.b, b_open.clone())
        } else {
            (&h.b, &h.a, a_open.clone())
        };
        assert_eq!(
            winner.machine.object_state("x"),
            Some(ObjectState::Live),
            "seed {seed}"
        );
        assert_eq!(
            loser.machine.object_state("x"),
            Some(ObjectState::Live),
            "seed {seed}"
        );
        let opened = |n: &tether_core::substrate::harness::Node| {
            n.events
                .iter()
                .filter(|e| matches!(e, Event::Opened { .. }))
                .count()
        };
        assert_eq!(
            opened(winner),
            1,
            "seed {seed}: the winner's open is accepted once"
        );
        assert_eq!(opened(loser), 0, "seed {seed}");
        let loser_futile = loser
            .events
            .iter()
            .filter(|e| matches!(e, Event::Futile { op_id, code, .. } if *op_id == losing_open && code == finality::OPEN_CONFLICT))
            .count();
        // A crash of the loser between committing the outcome and reporting it loses the
        // report with the process (its app is gone too); otherwise it is reported once.
        let loser_crashed = crashed && std::ptr::eq(loser, &h.b);
        if loser_crashed {
            assert!(loser_futile <= 1, "seed {seed}: at most once");
        } else {
            assert_eq!(
                loser_futile, 1,
                "seed {seed}: the losing open ends exactly once"
            );
        }
    }
}

fn harness_config(window: usize) -> Config {
    Config {
        in_flight_max: window,
        ..Config::default()
    }
}

#[test]
fn a_floor_past_a_gap_wider_than_the_window_frees_the_credit_behind_it() {
    // The gap of expired ops is wider than B's window: the op after it lies beyond the credit
    // B gave, so only the floor announcement can move B's frontier, and B must then say
    // that its credit grew (nothing else would).
    let config = Config {
        receive_window: 4,
        ..harness_config(32)
    };
    let mut h = Harness::allowing_all(config, 7);
    h.connect();
    h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
        .unwrap();
    h.run();
    h.disconnect();
    h.with(Party::A, |m, now| m.send(now, "q", body(0)))
        .unwrap();
    h.run();
    h.crash(Party::A); // m0 is recovered and never expires
    for i in 1..7 {
        h.with(Party::A, |m, now| m.send(now, "q", body(i)))
            .unwrap();
    }
    h.run();
    h.advance(Config::default().queue_ttl + Duration::from_secs(1));
    h.run();
    for i in 7..10 {
        h.with(Party::A, |m, now| m.send(now, "q", body(i)))
            .unwrap();
    }
    h.connect();
    h.run();
    assert_eq!(consumed_bodies(&h), [body(0), body(7), body(8), body(9)]);
    assert_eq!(h.a.machine.outbox_len(), 0);
    assert!(h.a.machine.stats().floors_sent >= 1);
    assert_eq!(h.b.machine.stats().out_of_seq, 0);
}

#[test]
fn a_sender_that_forgot_what_ended_still_announces_the_floor_its_next_op_waits_on() {
    // Seed 20001102: every message past B's frontier expired, A restarted (forgetting which
    // seqs ended), and A's close lies beyond B's credit. B holds nothing, so it has no gap to
    // resync; only A can move things, by sending its floor alone.
    let config = Config {
        receive_window: 4,
        ..harness_config(32)
    };
    let mut h = Harness::allowing_all(config, 11);
    h.connect();
    h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
        .unwrap();
    h.run();
    h.disconnect();
    for i in 0..6 {
        h.with(Party::A, |m, now| m.send(now, "q", body(i)))
            .unwrap();
    }
    h.run();
    h.advance(Config::default().queue_ttl + Duration::from_secs(1));
    h.run();
    h.crash(Party::A);
    h.with(Party::A, |m, now| m.close(now, "q", "done"))
        .unwrap();
    h.connect();
    h.run();
    assert_eq!(
        h.a.machine.outbox_len(),
        0,
        "the close was delivered and acked"
    );
    assert!(matches!(
        h.b.machine.object_state("q"),
        Some(ObjectState::Closed(_))
    ));
    // The open (seq 0) reserved seqs below 1 + the reservation and the restart resumed
    // there: B skips every seq from 1 on below it, the six expired sends and the unused rest.
    assert_eq!(
        h.b.machine.stats().skipped_below_floor,
        SUBSTRATE_SEQ_RESERVE
    );
}

/// A peer that sends a number no honest peer can (a floor of `u64::MAX`, say: before, it moved
/// the receive frontier there, overflowed `rx_next + window`, and every later op was acked as
/// a duplicate and dropped) is a counted violation: the frame moves nothing, the link is cut,
/// and on the next link the object keeps working, exactly once and in order.
#[test]
fn a_number_past_the_bound_is_a_counted_violation_and_the_object_keeps_working() {
    use tether_core::limits::SUBSTRATE_SEQ_MAX;
    type Set = fn(&mut Env, u64);
    let fields: [(&str, Set, Verb); 5] = [
        ("floor", |env, v| env.floor = Some(v), Verb::Send),
        ("seq", |env, v| env.seq = Some(v), Verb::Send),
        (
            "floor on a resync",
            |env, v| env.floor = Some(v),
            Verb::Resync,
        ),
        (
            "resync point",
            |env, v| env.from_seq = Some(v),
            Verb::Resync,
        ),
        ("credit limit", |env, v| env.limit = Some(v), Verb::Ack),
    ];
    for (name, set, verb) in fields {
        for value in [u64::MAX, SUBSTRATE_SEQ_MAX] {
            let mut h = harness(4);
            h.connect();
            open_and_send(&mut h, 3);
            h.run();
            let mut env = Env::new(verb);
            env.obj = Some(Address::parse("q").unwrap());
            if verb == Verb::Send {
                env.id = Some("rogue".into());
                env.seq = Some(3);
                env.receipt = Some(1);
                env.floor = Some(0);
            }
            set(&mut env, value);
            h.inject(Party::A, &Envelope::new(env));
            h.run();
            let stats = h.b.machine.stats();
            assert_eq!(stats.violations, 1, "{name} = {value}");
            assert!(
                h.b.events
                    .iter()
                    .any(|e| matches!(e, Event::Violation { .. })),
                "{name}: the shell is told to cut the link"
            );
            h.disconnect();
            h.connect();
            for i in 3..6 {
                h.with(Party::A, |m, now| m.send(now, "q", body(i)))
                    .unwrap();
            }
            h.run();
            assert_exactly_once_in_order(&h, 6);
            assert_eq!(h.b.machine.stats().violations, 1);
        }
    }
    // One below the bound is honest (ops that ended at the sender can move a floor far).
    let mut h = harness(4);
    h.connect();
    open_and_send(&mut h, 1);
    h.run();
    let mut env = Env::new(Verb::Resync);
    env.obj = Some(Address::parse("q").unwrap());
    env.floor = Some(SUBSTRATE_SEQ_MAX - 1);
    h.inject(Party::A, &Envelope::new(env));
    h.run();
    assert_eq!(h.b.machine.stats().violations, 0);
}

/// A send travels while its sender commits it (its seq is below the reservation the open
/// committed): B commits and acks it and A's app hears the hop ack, all before A's own commit.
/// A then dies without that commit. B has the send once, and A, resuming at its reservation,
/// reuses no seq: its next send is delivered after the first, and nothing waits on the seqs
/// the restart skipped.
#[test]
fn a_send_travels_while_its_sender_commits_it_and_a_crash_before_that_commit_reuses_no_seq() {
    let mut h = harness(32);
    h.connect();
    h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
        .unwrap();
    h.run();
    assert_eq!((h.in_flight(Party::A), h.in_flight(Party::B)), (0, 0));
    let first = h
        .with(Party::A, |m, now| m.send(now, "q", body(0)))
        .unwrap();
    assert_eq!(
        h.uncommitted(Party::A),
        1,
        "the send's batch is not committed"
    );
    assert_eq!(h.in_flight(Party::B), 1, "the send is on the wire already");
    assert_eq!(h.a.machine.stats().sent_before_commit, 1);
    assert!(h.deliver_at(Party::B, 0, false));
    assert!(h.commit(Party::B));
    assert!(h.deliver_at(Party::A, 0, false), "B's ack");
    let acked = |h: &Harness| {
        h.a.events
            .iter()
            .any(|e| matches!(e, Event::Acked { op_id, .. } if *op_id == first))
    };
    assert!(acked(&h), "the hop ack reports B's commit");
    assert!(
        h.uncommitted(Party::A) >= 1,
        "A has still not committed the send"
    );
    h.crash(Party::A);
    assert!(h.a.store.outbox.is_empty(), "A never committed the send");
    h.with(Party::A, |m, now| m.send(now, "q", body(1)))
        .unwrap();
    h.run();
    assert_eq!(consumed_bodies(&h), [body(0), body(1)]);
    let seqs: Vec<u64> = h.b.consumed.iter().map(|op| op.seq.get()).collect();
    assert_eq!(
        seqs,
        [1, 1 + SUBSTRATE_SEQ_RESERVE],
        "the restart resumed past its reservation"
    );
    assert_eq!(h.b.machine.stats().duplicates, 0);
    assert!(h.b.store.held.is_empty());
    assert_eq!(h.a.machine.outbox_len(), 0);
}

/// A send whose seq is not below a committed reservation waits for the commit that renews it;
/// requests never go before their own commit.
/// A connected pair with queue `q` and session `s` open from A, committed, under a seq
/// reservation of `seq_reserve`.
fn queue_and_session(seq_reserve: u64) -> Harness {
    let config = Config {
        seq_reserve,
        ..harness_config(32)
    };
    let mut h = Harness::allowing_all(config, 7);
    h.connect();
    h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
        .unwrap();
    h.with(Party::A, |m, now| m.open(now, ObjKind::Session, "s", None))
        .unwrap();
    h.run();
    h
}

/// Whether anything in A's uncommitted batches waits for their commit.
fn a_awaits_a_commit(h: &Harness) -> bool {
    h.a.machine
        .awaits_persist_from(tether_core::substrate::BatchId(0))
}

/// A send that goes on the wire before its commit makes no batch urgent while the link is up:
/// nothing but a crash waits for that insert, and its hop ack, reported as it arrives, usually
/// comes first, so the insert and its removal are committed together later (or within the
/// lazy commit's deadline). A renewal of the seq reservation, a req, and a send while the
/// link is down are waited on.
#[test]
fn a_send_that_travels_before_its_commit_makes_no_batch_urgent() {
    let mut h = queue_and_session(4);
    assert!(!a_awaits_a_commit(&h));
    // The open (seq 0) reserved seqs below 5: seq 1 travels and nothing waits for its batch.
    let sent = h
        .with(Party::A, |m, now| m.send(now, "q", body(1)))
        .unwrap();
    assert_eq!(h.uncommitted(Party::A), 1);
    assert_eq!(h.in_flight(Party::B), 1, "it travels before its commit");
    assert!(!a_awaits_a_commit(&h), "a travelling send is lazy");
    // B persists it and acks: A reports the ack with its own insert still uncommitted.
    assert!(h.deliver_at(Party::B, 0, false));
    while h.commit(Party::B) {}
    while h.in_flight(Party::A) > 0 {
        assert!(h.deliver_at(Party::A, 0, false));
    }
    assert!(
        h.a.events
            .iter()
            .any(|event| matches!(event, Event::Acked { op_id, .. } if *op_id == sent)),
        "acked before A committed its insert"
    );
    assert!(h.uncommitted(Party::A) >= 1);
    assert!(!a_awaits_a_commit(&h), "its removal is lazy too");
    while h.commit(Party::A) {}
    assert!(
        h.a.store.outbox.is_empty(),
        "the insert and its removal together"
    );
    // Seq 2 travels lazily; seq 3 renews the reservation, which the sends past it wait for.
    h.with(Party::A, |m, now| m.send(now, "q", body(2)))
        .unwrap();
    assert!(!a_awaits_a_commit(&h));
    h.with(Party::A, |m, now| m.send(now, "q", body(3)))
        .unwrap();
    assert!(a_awaits_a_commit(&h), "a renewal is waited on");
    while h.commit(Party::A) {}
    // A req waits for its own commit, so its batch is waited on.
    h.with(Party::A, |m, now| m.req(now, "s", body(9))).unwrap();
    assert!(a_awaits_a_commit(&h), "a req is waited on");
    while h.commit(Party::A) {}
    // With the link down a send cannot travel: its commit is waited on.
    h.disconnect();
    h.with(Party::A, |m, now| m.send(now, "q", body(4)))
        .unwrap();
    assert!(
        a_awaits_a_commit(&h),
        "a send that cannot travel is waited on"
    );
    while h.commit(Party::A) {}
    h.connect();
    h.run();
    assert_eq!(
        consumed_bodies(&h),
        [body(1), body(2), body(3), body(4)],
        "every send delivered once, in order"
    );
}

#[test]
fn only_sends_below_the_committed_reservation_go_before_their_commit() {
    let mut h = queue_and_session(2);
    // The open (seq 0) reserved seqs below 3. Seq 1 goes at once; seq 2 renews the
    // reservation (to 5, in its own batch) and goes too; seq 3 waits for that renewal.
    for i in 0..3 {
        h.with(Party::A, |m, now| m.send(now, "q", body(i)))
            .unwrap();
    }
    h.with(Party::A, |m, now| m.req(now, "s", body(9))).unwrap();
    assert_eq!(h.uncommitted(Party::A), 4);
    assert_eq!(h.in_flight(Party::B), 2, "seqs 1 and 2 only");
    assert!(h.commit(Party::A), "seq 1's batch");
    assert_eq!(h.in_flight(Party::B), 2, "the renewal is not committed yet");
    assert!(h.commit(Party::A), "seq 2's batch, with the renewal");
    assert_eq!(h.in_flight(Party::B), 3, "seq 3 goes before its own commit");
    assert_eq!(h.a.machine.stats().sent_before_commit, 3);
    assert!(h.commit(Party::A), "seq 3's batch");
    assert_eq!(h.in_flight(Party::B), 3, "the req waits for its own commit");
    assert!(h.commit(Party::A), "the req's batch");
    assert_eq!(h.in_flight(Party::B), 4);
    assert_eq!(h.a.machine.stats().sent_before_commit, 3);
    h.run();
    assert_eq!(consumed_bodies(&h), [body(0), body(1), body(2)]);
}

fn machine_with_link() -> (Machine, Time) {
    let mut machine = Machine::new(
        PeerId::new("b"),
        Config::default(),
        Arc::new(Authorizer::new(AllowAll)),
        1,
    );
    let now = Time::from_millis(1);
    machine.handle_link_up(now);
    (machine, now)
}

#[test]
fn a_step_stages_into_the_buffer_a_committed_batch_handed_back() {
    let (mut machine, now) = machine_with_link();
    machine.open(now, ObjKind::Queue, "q", None).unwrap();
    let first = machine.poll_persist().expect("the open's batch");
    let buffer = first.records.as_ptr();
    // A second batch is outstanding when the first is persisted and handed back.
    machine.open(now, ObjKind::Queue, "p", None).unwrap();
    let _second = machine.poll_persist().expect("the second open's batch");
    machine.handle_persisted(now, first.id);
    machine.recycle(first);
    assert_eq!(machine.spare_buffers().0, 1);
    // A step stages into the buffer the step before it took from the spares.
    machine.open(now, ObjKind::Queue, "r", None).unwrap();
    assert_eq!(machine.spare_buffers().0, 0);
    let third = machine.poll_persist().expect("the third open's batch");
    machine.open(now, ObjKind::Queue, "s", None).unwrap();
    let fourth = machine.poll_persist().expect("the fourth open's batch");
    assert_ne!(third.records.as_ptr(), buffer);
    assert_eq!(fourth.records.as_ptr(), buffer, "the spare was not reused");
}

#[test]
fn spare_buffers_are_bounded_in_count_and_room_and_freed_once_the_peer_is_quiet() {
    use tether_core::limits::{
        SUBSTRATE_SPARE_LARGE_STEP_BUFFERS_MAX, SUBSTRATE_SPARE_LARGE_STEP_BUFFER_ENTRIES_MAX,
        SUBSTRATE_SPARE_STEP_BUFFERS_MAX, SUBSTRATE_SPARE_STEP_BUFFER_ENTRIES_MAX,
    };
    let small = |id: u64| PersistBatch {
        id: BatchId(id),
        records: Vec::with_capacity(1),
    };
    let sized = |room: usize| PersistBatch {
        id: BatchId(1),
        records: Vec::with_capacity(room),
    };
    let (mut machine, now) = machine_with_link();
    // A buffer grown past the large bound is freed, not kept.
    machine.recycle(sized(SUBSTRATE_SPARE_LARGE_STEP_BUFFER_ENTRIES_MAX + 1));
    assert_eq!(machine.spare_buffers().0, 0);
    // Larger than a small one and within the large bound: kept, as many as the large bound.
    for _ in 0..SUBSTRATE_SPARE_LARGE_STEP_BUFFERS_MAX + 3 {
        machine.recycle(sized(SUBSTRATE_SPARE_STEP_BUFFER_ENTRIES_MAX + 1));
    }
    assert_eq!(
        machine.spare_buffers().0,
        SUBSTRATE_SPARE_LARGE_STEP_BUFFERS_MAX
    );
    machine.handle_timeout(Time::from_millis(2));
    assert_eq!(machine.spare_buffers(), (0, 0), "nothing is outstanding");
    for id in 0..SUBSTRATE_SPARE_STEP_BUFFERS_MAX + 10 {
        machine.recycle(small(id as u64));
    }
    assert_eq!(machine.spare_buffers().0, SUBSTRATE_SPARE_STEP_BUFFERS_MAX);
    // A timeout with a batch outstanding keeps them; one with nothing outstanding (the
    // keepalive's, with the link up) frees them.
    machine.open(now, ObjKind::Queue, "q", None).unwrap();
    let batch = machine.poll_persist().expect("the open's batch");
    machine.handle_timeout(Time::from_millis(2));
    assert_eq!(
        machine.spare_buffers().0,
        SUBSTRATE_SPARE_STEP_BUFFERS_MAX - 1
    );
    machine.handle_persisted(now, batch.id);
    assert!(
        machine.spare_buffers().0 > 0,
        "the link is up: more may come"
    );
    machine.handle_timeout(Time::from_millis(3));
    assert_eq!(machine.spare_buffers(), (0, 0));
    // With no link, the commit that leaves nothing outstanding frees them at once.
    machine.open(now, ObjKind::Queue, "r", None).unwrap();
    let batch = machine.poll_persist().expect("the second open's batch");
    machine.recycle(small(1));
    machine.handle_link_down(now);
    assert_eq!(machine.spare_buffers().0, 1, "a batch is still outstanding");
    machine.handle_persisted(now, batch.id);
    assert_eq!(machine.spare_buffers(), (0, 0));
}

/// A read of several frames moves its step into a large spare buffer at its second frame; a
/// read that then stages nothing (keepalives) gives that room back to the spares rather than
/// keeping it for its next steps, where no bound or timeout would reach it.
#[test]
fn a_read_that_stages_nothing_gives_a_large_spare_back() {
    use tether_core::limits::SUBSTRATE_SPARE_STEP_BUFFER_ENTRIES_MAX;
    use tether_core::substrate::TYPE_KEEPALIVE;
    let (mut machine, now) = machine_with_link();
    machine.recycle(PersistBatch {
        id: BatchId(1),
        records: Vec::with_capacity(SUBSTRATE_SPARE_STEP_BUFFER_ENTRIES_MAX + 1),
    });
    assert_eq!(machine.spare_buffers().0, 1);
    let keepalive = || {
        let mut frame = Envelope::new(Env::new(Verb::Ack));
        frame.type_byte = TYPE_KEEPALIVE;
        frame
    };
    machine.handle_frames(now, [keepalive(), keepalive()]);
    assert_eq!(machine.spare_buffers().0, 1, "the large spare is back");
}

/// Eight sends read together by B are one step of its machine: one batch, committed once,
/// after which all eight are acked. Read one at a time, they are eight batches. Either way B's
/// app has each once, in order.
#[test]
fn frames_read_together_are_one_step_and_one_batch() {
    let mut batches = Vec::new();
    for together in [true, false] {
        let mut h = harness(32);
        h.connect();
        h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, "q", None))
            .unwrap();
        h.run();
        for i in 0..8 {
            h.with(Party::A, |m, now| m.send(now, "q", body(i)))
                .unwrap();
        }
        assert_eq!(h.in_flight(Party::B), 8, "the sends are on the wire");
        if together {
            assert!(h.deliver_all(Party::B));
        } else {
            while h.deliver_at(Party::B, 0, false) {}
        }
        assert_eq!(h.in_flight(Party::B), 0);
        assert_eq!(h.in_flight(Party::A), 0, "no ack before B's commit");
        batches.push(h.uncommitted(Party::B));
        while h.commit(Party::B) {}
        assert!(h.in_flight(Party::A) > 0, "B's acks follow its commit");
        h.run();
        assert_exactly_once_in_order(&h, 8);
        assert_eq!(h.a.machine.outbox_len(), 0, "every send was acked");
        assert_eq!(h.b.machine.stats().duplicates, 0);
    }
    assert_eq!(
        batches,
        [1, 8],
        "one batch for the read, one per frame read alone"
    );
}

/// A frame that breaks a bound cuts the link in the middle of a read: the frames read with it
/// after it are not taken (the op behind it is not delivered), the violation is counted once,
/// and after a new connection the object carries on exactly once.
#[test]
fn a_frame_that_cuts_the_link_ends_its_read() {
    use tether_core::limits::SUBSTRATE_SEQ_MAX;
    let mut h = harness(4);
    h.connect();
    open_and_send(&mut h, 2);
    h.run();
    let send = |id: &str, seq: u64| {
        let mut env = Env::new(Verb::Send);
        env.obj = Some(addr("q"));
        env.id = Some(id.into());
        env.seq = Some(seq);
        env.receipt = Some(1);
        env.floor = Some(0);
        Envelope::new(env)
    };
    // Both in flight towards B, read together.
    h.inject(Party::A, &send("rogue", SUBSTRATE_SEQ_MAX));
    h.inject(Party::A, &send("behind", 3));
    assert_eq!(h.in_flight(Party::B), 2);
    assert!(h.deliver_all(Party::B));
    let stats = h.b.machine.stats();
    assert_eq!(stats.violations, 1);
    assert!(
        h.b.events
            .iter()
            .any(|e| matches!(e, Event::Violation { .. })),
        "the shell is told to cut the link"
    );
    let behind_taken = h.b.store.held.values().any(|op| op.id.as_str() == "behind")
        || h.b
            .machine
            .pending_deliveries()
            .iter()
            .any(|op| op.id.as_str() == "behind");
    assert!(!behind_taken, "the op read behind the cut is not taken");
    h.disconnect();
    h.connect();
    for i in 2..4 {
        h.with(Party::A, |m, now| m.send(now, "q", body(i)))
            .unwrap();
    }
    h.run();
    assert_exactly_once_in_order(&h, 4);
    assert_eq!(h.b.machine.stats().violations, 1);
}
