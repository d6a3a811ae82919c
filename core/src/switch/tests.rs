use std::time::Duration;

use super::ask::Ask;
use super::harness::{chunk, response, stream, Harness, Identity};
use super::*;
use crate::request::{ErrorClass, TerminationKind};

const UPPER: &str = "cap:in=media:text;out=media:upper";
const LOWER: &str = "cap:in=media:text;out=media:lower";

fn window_of(chunks: u64) -> SwitchConfig {
    SwitchConfig {
        limits: Limits {
            initial_credit: chunks,
            ..Limits::default()
        },
        ..SwitchConfig::default()
    }
}

#[test]
fn a_master_proposing_another_window_than_the_switch_is_refused() {
    let mut h = Harness::new(SwitchConfig::default(), &[]);
    let small = Limits {
        initial_credit: 4,
        ..Limits::default()
    };
    let conn = h.connect_with("a", &[UPPER], small, Identity::Echo);
    assert_eq!(
        h.disconnected,
        [(
            conn,
            CutReason::Handshake(HandshakeError::WindowMismatch {
                theirs: 4,
                ours: 32
            })
        )]
    );
    let large = Limits {
        initial_credit: 64,
        ..Limits::default()
    };
    let conn = h.connect_with("b", &[UPPER], large, Identity::Echo);
    assert_eq!(
        h.disconnected[1],
        (
            conn,
            CutReason::Handshake(HandshakeError::WindowMismatch {
                theirs: 64,
                ours: 32
            })
        )
    );
}

fn ready(masters: &[(&str, &[&str])]) -> (Harness, Vec<ConnId>) {
    let ids: Vec<&str> = masters.iter().map(|(id, _)| *id).collect();
    let mut h = Harness::new(SwitchConfig::default(), &ids);
    let conns = masters
        .iter()
        .map(|(id, caps)| h.connect(id, caps))
        .collect();
    assert!(h.switch.is_routing());
    (h, conns)
}

fn types(frames: &[Frame]) -> Vec<FrameType> {
    frames.iter().map(|f| f.frame_type).collect()
}

fn request_frames(h: &mut Harness, slot: SlotId) -> Vec<Frame> {
    h.take_master(slot)
        .into_iter()
        .filter(|f| !matches!(f.frame_type, FrameType::Policy | FrameType::Heartbeat))
        .filter(|f| {
            (1..=2).all(|generation| {
                f.id != identity_rid(generation, slot, false)
                    && f.id != identity_rid(generation, slot, true)
            })
        })
        .collect()
}

#[test]
fn routing_starts_only_once_every_initial_master_is_verified() {
    let mut h = Harness::new(SwitchConfig::default(), &["a", "b"]);
    assert!(!h.switch.is_routing());
    h.connect("a", &[UPPER]);
    assert_eq!(h.engine_request(1, UPPER), Err(EngineError::NotReady));
    h.connect("b", &[LOWER]);
    assert!(h.switch.is_routing());
    assert!(h.events.contains(&Event::RoutingStarted));
    assert!(h.engine_request(1, UPPER).is_ok());
}

#[test]
fn a_failed_initial_master_does_not_hold_routing_back() {
    let mut h = Harness::new(SwitchConfig::default(), &["a", "b"]);
    h.connect("a", &[UPPER]);
    h.connect_with("b", &[LOWER], Limits::default(), Identity::Wrong);
    assert!(h.switch.is_routing());
    assert_eq!(
        h.engine_request(1, LOWER),
        Err(EngineError::NoHandler(Box::new(
            crate::cap::CapUrn::parse(LOWER).expect("a cap")
        )))
    );
}

#[test]
fn an_attach_is_answered_once_and_a_master_frame_answers_nothing() {
    let mut h = Harness::new(SwitchConfig::default(), &[]);
    h.switch.handle_attach(h.now, "a", [7; 32]);
    let conn = match h.switch.poll_answer() {
        Some(Answer::Attached(Ok(conn))) => conn,
        other => panic!("{other:?}"),
    };
    assert_eq!(h.switch.poll_answer(), None, "an answer is taken once");
    h.switch.handle_attach(h.now, "a", [7; 32]);
    assert_eq!(
        h.switch.poll_answer(),
        Some(Answer::Attached(Err(AttachError::AlreadyAttached(
            conn.slot
        ))))
    );
    h.switch.handle_master_frame(
        h.now,
        conn,
        Frame::new(FrameType::Heartbeat, MessageId::Uint(1)),
    );
    assert_eq!(
        h.switch.poll_answer(),
        None,
        "inputs nobody waits on answer nothing"
    );
    h.switch.handle_stop_feeds(h.now, MessageId::Uint(9));
    assert_eq!(h.switch.poll_answer(), Some(Answer::FeedsStopped(false)));
}

#[test]
fn the_master_speaks_first_then_the_policy_then_the_identity_request() {
    let config = SwitchConfig {
        policy: NetworkPolicy::NoTelemetry,
        ..SwitchConfig::default()
    };
    let mut h = Harness::new(config, &[]);
    let conn = h.switch.ask_attach(h.now, "a", [7; 32]).expect("new slot");
    h.drain();
    assert!(h.take_master(conn.slot).is_empty(), "the switch waits");
    let notify = RelayNotify {
        limits: Limits::default(),
        manifest: Bytes::from(manifest_json(
            "a",
            &[UPPER.into(), crate::cap::CAP_IDENTITY.into()],
        )),
    };
    // Outside the harness's drain, which would answer the identity check at once.
    h.switch.handle_master_frame(h.now, conn, notify.to_frame());
    let frames: Vec<Frame> = std::iter::from_fn(|| h.switch.poll_transmit())
        .map(|transmit| transmit.frame)
        .collect();
    assert_eq!(
        types(&frames),
        [
            FrameType::Policy,
            FrameType::Req,
            FrameType::StreamStart,
            FrameType::Chunk,
            FrameType::StreamEnd,
            FrameType::End
        ]
    );
    assert_eq!(
        NetworkPolicy::from_meta(frames[0].meta.as_ref()),
        Some(NetworkPolicy::NoTelemetry)
    );
    assert_eq!(frames[1].cap.as_deref(), Some(crate::cap::CAP_IDENTITY));
    // As capdag writes it: no XID, every frame at seq 0, the nonce a CBOR byte string.
    assert!(frames.iter().all(|f| f.routing_id.is_none() && f.seq == 0));
    let mut nonce = vec![0x58, 0x20];
    nonce.extend([7; 32]);
    assert_eq!(frames[3].payload.as_deref(), Some(&nonce[..]));
    let upper = CapUrn::parse(UPPER).unwrap();
    assert_eq!(
        h.switch.route_for(&upper, None),
        None,
        "not routable before the echo"
    );
    // The echo, as capdag's host writes it.
    let rid = frames[1].id;
    let mut start = Frame::new(FrameType::StreamStart, rid);
    start.stream_id = Some(IDENTITY_ECHO_STREAM.into());
    let mut chunk = Frame::new(FrameType::Chunk, rid);
    chunk.payload = Some(Bytes::from(nonce));
    chunk.chunk_index = Some(0);
    chunk.seq = 1;
    let mut end_stream = Frame::new(FrameType::StreamEnd, rid);
    end_stream.seq = 2;
    let mut end = Frame::new(FrameType::End, rid);
    end.seq = 3;
    for frame in [start, chunk, end_stream, end] {
        h.from_master(conn, frame);
    }
    assert!(h.events.contains(&Event::MasterReady { slot: conn.slot }));
    assert_eq!(h.switch.route_for(&upper, None), Some(conn.slot));
}

#[test]
fn a_capless_master_joins_at_once_and_is_probed_when_caps_appear() {
    let mut h = Harness::new(SwitchConfig::default(), &[]);
    let conn = h.switch.ask_attach(h.now, "a", [1; 32]).expect("new slot");
    let empty = RelayNotify {
        limits: Limits::default(),
        manifest: Bytes::from_static(br#"{"installed_cartridges": []}"#),
    };
    h.from_master(conn, empty.to_frame());
    assert_eq!(types(&h.take_master(conn.slot)), [FrameType::Policy]);
    assert!(h.events.contains(&Event::MasterReady { slot: conn.slot }));
    // Caps appear: the runtime probe goes out, with an XID and the `bifaci` nonce.
    let mut update = Frame::new(FrameType::RelayNotify, MessageId::Uint(0));
    update.meta = Some(notify_meta(
        Some(&manifest_json(
            "a",
            &[UPPER.into(), crate::cap::CAP_IDENTITY.into()],
        )),
        None,
    ));
    // Outside the harness's drain, which would answer the probe at once.
    let upper = CapUrn::parse(UPPER).unwrap();
    h.switch.handle_master_frame(h.now, conn, update);
    let mut probe = Vec::new();
    while let Some(transmit) = h.switch.poll_transmit() {
        probe.push(transmit.frame);
    }
    assert_eq!(probe.len(), 5);
    assert!(probe.iter().all(|f| f.routing_id.is_some() && f.seq == 0));
    assert_eq!(probe[2].stream_id.as_deref(), Some(IDENTITY_PROBE_STREAM));
    assert_eq!(probe[2].payload.as_deref(), Some(IDENTITY_PROBE_NONCE));
    assert_eq!(
        h.switch.route_for(&upper, None),
        None,
        "unroutable while probed"
    );
    // The echo passes.
    let rid = probe[0].id;
    let xid = probe[0].routing_id;
    let mut frames = vec![
        Frame::new(FrameType::StreamStart, rid),
        Frame::new(FrameType::Chunk, rid),
        Frame::new(FrameType::StreamEnd, rid),
        Frame::new(FrameType::End, rid),
    ];
    frames[1].payload = Some(Bytes::from_static(IDENTITY_PROBE_NONCE));
    frames[1].chunk_index = Some(0);
    for (seq, mut frame) in frames.into_iter().enumerate() {
        frame.seq = seq as u64;
        frame.routing_id = xid;
        h.from_master(conn, frame);
    }
    assert_eq!(h.switch.route_for(&upper, None), Some(conn.slot));
}

#[test]
fn a_master_that_never_echoes_heartbeats_is_not_cut_for_it_but_one_that_did_is() {
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    for _ in 0..3 {
        h.advance(Duration::from_millis(
            SWITCH_HEARTBEAT_INTERVAL_MS + SWITCH_HEARTBEAT_TIMEOUT_MS,
        ));
    }
    assert!(h.disconnected.is_empty(), "capdag's hosts may never echo");
    let beats: Vec<Frame> = h
        .take_master(conns[0].slot)
        .into_iter()
        .filter(|f| f.frame_type == FrameType::Heartbeat)
        .collect();
    assert!(beats.len() >= 2);
    h.advance(Duration::from_millis(SWITCH_HEARTBEAT_INTERVAL_MS));
    let beat = h.take_master(conns[0].slot).pop().expect("a heartbeat");
    h.from_master(conns[0], beat);
    h.advance(Duration::from_millis(
        SWITCH_HEARTBEAT_INTERVAL_MS + SWITCH_HEARTBEAT_TIMEOUT_MS,
    ));
    assert_eq!(h.disconnected.len(), 1, "once it echoed, it is held to it");
    assert_eq!(h.disconnected[0].1, CutReason::HeartbeatTimeout);
}

#[test]
fn a_request_is_routed_to_its_master_answered_and_leaves_no_state() {
    let (mut h, conns) = ready(&[("a", &[UPPER]), ("b", &[LOWER])]);
    let key = h.engine_request(7, LOWER).expect("routed");
    assert_eq!(key.rid, MessageId::Uint(7));
    let sent = request_frames(&mut h, conns[1].slot);
    assert_eq!(types(&sent), [FrameType::Req]);
    assert_eq!(
        sent[0].routing_id,
        Some(key.xid),
        "the switch assigns the XID"
    );
    assert!(request_frames(&mut h, conns[0].slot).is_empty());
    // The engine streams its input; the master answers with a stream and END.
    let mut input = Frame::new(FrameType::StreamStart, MessageId::Uint(7));
    input.stream_id = Some("in".into());
    input.seq = 1;
    h.from_engine(input).expect("live");
    h.from_master(conns[1], stream(key, FrameType::StreamStart, "out", 0));
    h.from_master(conns[1], chunk(key, "out", 0, 1, b"hello"));
    h.from_master(conns[1], stream(key, FrameType::StreamEnd, "out", 2));
    h.from_master(conns[1], response(key, FrameType::End, 3));
    let answer = h.take_engine();
    assert_eq!(
        types(&answer),
        [
            FrameType::StreamStart,
            FrameType::Chunk,
            FrameType::StreamEnd,
            FrameType::End
        ]
    );
    assert!(
        answer.iter().all(|f| f.routing_id.is_none()),
        "the engine never sees XIDs"
    );
    assert_eq!(
        answer.iter().map(|f| f.seq).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    assert_eq!(h.switch.live_requests(), 0);
    assert_eq!(
        h.switch.table_counters().terminated[&TerminationKind::End],
        1
    );
}

#[test]
fn flow_frames_from_a_master_are_reordered_by_seq() {
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    let key = h.engine_request(1, UPPER).expect("routed");
    h.from_master(conns[0], chunk(key, "out", 0, 1, b"x"));
    h.from_master(conns[0], stream(key, FrameType::StreamEnd, "out", 2));
    assert!(h.take_engine().is_empty(), "held until seq 0 arrives");
    h.from_master(conns[0], stream(key, FrameType::StreamStart, "out", 0));
    assert_eq!(
        types(&h.take_engine()),
        [
            FrameType::StreamStart,
            FrameType::Chunk,
            FrameType::StreamEnd
        ]
    );
}

#[test]
fn no_handler_is_answered_never_dropped() {
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    assert_eq!(
        h.engine_request(1, LOWER),
        Err(EngineError::NoHandler(Box::new(
            crate::cap::CapUrn::parse(LOWER).expect("a cap")
        )))
    );
    // A peer request for a cap nobody serves is answered with an ERR NO_HANDLER.
    let mut req = Frame::new(FrameType::Req, MessageId::Uint(50));
    req.cap = Some(LOWER.into());
    h.from_master(conns[0], req);
    let answer = request_frames(&mut h, conns[0].slot);
    assert_eq!(types(&answer), [FrameType::Err]);
    assert_eq!(error_code(&answer[0]).as_deref(), Some("NO_HANDLER"));
    assert_eq!(h.switch.counters().no_handler, 2);
}

#[test]
fn a_peer_request_goes_to_the_serving_master_and_its_answer_back_to_the_asker() {
    let (mut h, conns) = ready(&[("a", &[UPPER]), ("b", &[LOWER])]);
    let parent = h.engine_request(1, UPPER).expect("routed to a");
    let mut req = Frame::new(FrameType::Req, MessageId::Uint(90));
    req.cap = Some(LOWER.into());
    req.meta = Some(parent_meta(MessageId::Uint(1)));
    h.from_master(conns[0], req);
    let at_b = request_frames(&mut h, conns[1].slot);
    assert_eq!(types(&at_b), [FrameType::Req]);
    let child = RequestKey {
        xid: at_b[0].routing_id.expect("xid"),
        rid: MessageId::Uint(90),
    };
    h.from_master(conns[1], response(child, FrameType::End, 0));
    let back = request_frames(&mut h, conns[0].slot);
    assert_eq!(types(&back), [FrameType::Req, FrameType::End]);
    assert_eq!(back[1].routing_id, Some(child.xid));
    assert_eq!(h.switch.live_requests(), 1, "only the parent is left");
    let _ = parent;
}

/// A master's peer request that routes back to the same master (capdag's shout handler calling
/// its own host's uppercase): its continuation (no XID) goes to the destination side, its
/// answer (with the XID) back to the asker, as capdag tells them apart.
#[test]
fn a_peer_request_a_master_makes_to_itself_is_told_apart_by_its_xid() {
    let (mut h, conns) = ready(&[("a", &[UPPER, LOWER])]);
    h.engine_request(1, UPPER).expect("routed to a");
    let mut req = Frame::new(FrameType::Req, MessageId::Uint(90));
    req.cap = Some(LOWER.into());
    h.from_master(conns[0], req);
    let routed = request_frames(&mut h, conns[0].slot);
    let req = routed.last().expect("the peer REQ came back to a");
    let child = RequestKey {
        xid: req.routing_id.expect("xid"),
        rid: MessageId::Uint(90),
    };
    // The asker's input, without the XID: forwarded to the serving side (with it).
    let mut input = Frame::new(FrameType::End, MessageId::Uint(90));
    input.seq = 1;
    h.from_master(conns[0], input);
    let forwarded = request_frames(&mut h, conns[0].slot);
    assert_eq!(types(&forwarded), [FrameType::End]);
    assert_eq!(forwarded[0].routing_id, Some(child.xid));
    assert!(h.disconnected.is_empty(), "{:?}", h.disconnected);
    // The answer, with the XID: back to the asker, and the request is over.
    h.from_master(conns[0], response(child, FrameType::End, 0));
    let back = request_frames(&mut h, conns[0].slot);
    assert_eq!(types(&back), [FrameType::End]);
    assert_eq!(h.switch.live_requests(), 1, "only the parent is left");
}

#[test]
fn a_req_from_a_master_carrying_an_xid_is_a_counted_violation() {
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    let mut req = Frame::new(FrameType::Req, MessageId::Uint(5));
    req.cap = Some(UPPER.into());
    req.routing_id = Some(MessageId::Uint(77));
    h.from_master(conns[0], req);
    let answer = request_frames(&mut h, conns[0].slot);
    assert_eq!(
        error_code(&answer[0]).as_deref(),
        Some("PROTOCOL_VIOLATION")
    );
    assert_eq!(h.switch.counters().violations["xid_on_req"], 1);
    assert_eq!(h.switch.live_requests(), 0);
}

#[test]
fn cancel_cascades_to_children_under_the_same_reason() {
    let (mut h, conns) = ready(&[("a", &[UPPER]), ("b", &[LOWER])]);
    h.engine_request(1, UPPER).expect("routed to a");
    let mut req = Frame::new(FrameType::Req, MessageId::Uint(90));
    req.cap = Some(LOWER.into());
    req.meta = Some(parent_meta(MessageId::Uint(1)));
    h.from_master(conns[0], req);
    h.take_master(conns[0].slot);
    h.take_master(conns[1].slot);
    let reason = CancelReason::operator("stop it");
    assert!(h.switch.ask_cancel(h.now, MessageId::Uint(1), &reason));
    h.drain();
    assert_eq!(h.switch.live_requests(), 0);
    let at_a = h.take_master(conns[0].slot);
    let at_b = h.take_master(conns[1].slot);
    assert_eq!(
        types(&at_a),
        [FrameType::Cancel, FrameType::Err],
        "cancel, and the child's ERR"
    );
    assert_eq!(at_a[0].force_kill, Some(true));
    assert_eq!(types(&at_b), [FrameType::Cancel]);
    let engine = h.take_engine();
    assert_eq!(types(&engine), [FrameType::Err]);
    assert_eq!(error_code(&engine[0]).as_deref(), Some("CANCELLED"));
    let ring: Vec<_> = h.switch.protocol_stats(h.now).recently_terminated;
    assert!(ring
        .iter()
        .all(|summary| summary.termination == Termination::Cancelled(reason.clone())));
    // Frames crossing the cancel are stragglers, not drops.
    let key = RequestKey {
        xid: MessageId::Uint(1),
        rid: MessageId::Uint(1),
    };
    h.from_master(conns[0], chunk(key, "out", 0, 0, b"late"));
    let counters = h.switch.table_counters();
    assert_eq!(counters.stragglers["CHUNK"], 1);
    assert!(counters.no_route.is_empty());
    assert!(
        !h.switch.ask_cancel(h.now, MessageId::Uint(1), &reason),
        "once"
    );
}

#[test]
fn a_collateral_abort_never_force_kills() {
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    h.engine_request(1, UPPER).expect("routed");
    h.take_master(conns[0].slot);
    let reason = CancelReason {
        code: CancelCode::AbortedCollateral,
        class: Some(ErrorClass::Resource),
        message: "a sibling ran out of memory".into(),
    };
    h.switch.ask_cancel(h.now, MessageId::Uint(1), &reason);
    h.drain();
    let at_a = h.take_master(conns[0].slot);
    assert_eq!(at_a[0].force_kill, Some(false));
    assert_eq!(
        error_code(&h.take_engine()[0]).as_deref(),
        Some("ABORTED_COLLATERAL")
    );
}

#[test]
fn stop_feeds_sends_close_stream_and_leaves_the_request_live() {
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    let key = h.engine_request(1, UPPER).expect("routed");
    h.take_master(conns[0].slot);
    assert!(h.switch.ask_stop_feeds(h.now, MessageId::Uint(1)));
    assert!(
        !h.switch.ask_stop_feeds(h.now, MessageId::Uint(2)),
        "an unknown request is not stopped"
    );
    h.drain();
    let at_a = h.take_master(conns[0].slot);
    assert_eq!(types(&at_a), [FrameType::CloseStream]);
    assert_eq!(at_a[0].routing_id, Some(key.xid));
    assert_eq!(h.switch.live_requests(), 1);
    h.from_master(conns[0], response(key, FrameType::End, 0));
    assert_eq!(h.switch.live_requests(), 0);
}

#[test]
fn the_policy_reaches_every_master_once_per_change() {
    let (mut h, conns) = ready(&[("a", &[UPPER]), ("b", &[LOWER])]);
    h.take_master(conns[0].slot);
    h.take_master(conns[1].slot);
    h.switch.set_policy(NetworkPolicy::default());
    h.drain();
    assert!(
        h.take_master(conns[0].slot).is_empty(),
        "unchanged: nothing sent"
    );
    h.switch.set_policy(NetworkPolicy::Offline);
    h.switch.set_policy(NetworkPolicy::Offline);
    h.drain();
    for conn in &conns {
        let frames = h.take_master(conn.slot);
        assert_eq!(types(&frames), [FrameType::Policy]);
        assert_eq!(
            NetworkPolicy::from_meta(frames[0].meta.as_ref()),
            Some(NetworkPolicy::Offline)
        );
    }
}

#[test]
fn attaching_an_attached_slot_is_refused_and_a_detached_one_reattaches_in_place() {
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    assert!(!h.switch.slot_accepts_attach("a"));
    assert_eq!(
        h.switch.ask_attach(h.now, "a", [0; 32]),
        Err(AttachError::AlreadyAttached(SlotId(0)))
    );
    h.close(conns[0]);
    assert!(h.switch.slot_accepts_attach("a"));
    let again = h.connect("a", &[UPPER]);
    assert_eq!(again.slot, conns[0].slot, "same slot index");
    assert_eq!(again.generation, conns[0].generation + 1);
    // The old connection's frames and close are ignored.
    h.close(conns[0]);
    assert!(h.engine_request(3, UPPER).is_ok());
}

#[test]
fn a_dead_master_ends_its_requests_and_its_late_frames_are_stragglers() {
    let (mut h, conns) = ready(&[("a", &[UPPER]), ("b", &[LOWER])]);
    let key = h.engine_request(1, UPPER).expect("routed");
    h.engine_request(2, LOWER).expect("routed");
    h.close(conns[0]);
    let engine = h.take_engine();
    assert_eq!(types(&engine), [FrameType::Err]);
    assert_eq!(error_code(&engine[0]).as_deref(), Some("MASTER_DIED"));
    assert_eq!(h.switch.live_requests(), 1, "b's request lives on");
    assert_eq!(
        h.switch.table_counters().terminated[&TerminationKind::MasterDied],
        1
    );
    assert_eq!(
        h.engine_request(3, UPPER),
        Err(EngineError::NoHandler(Box::new(
            crate::cap::CapUrn::parse(UPPER).expect("a cap")
        )))
    );
    let again = h.connect("a", &[UPPER]);
    h.from_master(again, response(key, FrameType::End, 0));
    assert_eq!(h.switch.table_counters().stragglers["END"], 1);
}

fn engine_credit(h: &mut Harness, rid: u64, stream: &str, n: u64) {
    let mut credit = Frame::new(FrameType::Credit, MessageId::Uint(rid));
    credit.stream_id = Some(stream.into());
    credit.credit = Some(n);
    h.from_engine(credit).expect("live");
}

#[test]
fn a_master_past_its_credit_window_is_held_in_order_and_let_go_as_credit_comes() {
    // capdag's in-process cartridge host writes its whole answer without waiting for CREDIT.
    let mut h = Harness::new(window_of(2), &[]);
    let conn = h.connect("a", &[UPPER]);
    let master = Peer::Master(conn.slot);
    let key = h.engine_request(1, UPPER).expect("routed");
    h.from_master(conn, stream(key, FrameType::StreamStart, "out", 0));
    for index in 0..6u64 {
        h.from_master(conn, chunk(key, "out", index, index + 1, b"xyz"));
    }
    h.from_master(conn, stream(key, FrameType::StreamEnd, "out", 7));
    h.from_master(conn, response(key, FrameType::End, 8));
    assert!(h.disconnected.is_empty(), "not cut");
    let engine = h.take_engine();
    assert_eq!(
        types(&engine),
        [FrameType::StreamStart, FrameType::Chunk, FrameType::Chunk],
        "the engine gets its window and no more"
    );
    assert_eq!(
        h.switch.counters().overrun_held,
        6,
        "4 chunks, STREAM_END, END"
    );
    assert!(h.switch.overrun_bytes_of(master) > 4 * 3);
    assert!(h.switch.held_bytes_balance());
    assert_eq!(h.switch.live_requests(), 1);

    // Each grant lets exactly that many chunks go, in the order they came.
    engine_credit(&mut h, 1, "out", 1);
    let engine = h.take_engine();
    assert_eq!(types(&engine), [FrameType::Chunk]);
    assert_eq!(engine[0].chunk_index, Some(2));
    assert_eq!(engine[0].seq, 3, "numbered on the engine's flow");
    engine_credit(&mut h, 1, "out", 2);
    assert_eq!(
        types(&h.take_engine()),
        [FrameType::Chunk, FrameType::Chunk]
    );
    assert_eq!(
        h.switch.live_requests(),
        1,
        "END waits behind the last chunk"
    );
    // The last grant lets the chunk, STREAM_END and END go: the request ends, nothing is held.
    engine_credit(&mut h, 1, "out", 5);
    let engine = h.take_engine();
    assert_eq!(
        types(&engine),
        [FrameType::Chunk, FrameType::StreamEnd, FrameType::End]
    );
    assert_eq!(engine.iter().map(|f| f.seq).collect::<Vec<_>>(), [6, 7, 8]);
    assert_eq!(h.switch.live_requests(), 0);
    assert_eq!(h.switch.overrun_bytes_of(master), 0);
    assert!(h.switch.held_bytes_balance());
    // The master heard every grant (credit is end to end).
    let at_a = request_frames(&mut h, conn.slot);
    assert_eq!(
        at_a.iter()
            .filter(|f| f.frame_type == FrameType::Credit)
            .count(),
        3
    );
}

#[test]
fn a_master_past_its_credit_window_is_cut_past_its_share_over_all_its_requests() {
    use crate::limits::SWITCH_PEER_OVERRUN_HELD_BYTES_MAX as SHARE;
    let mut h = Harness::new(window_of(1), &[]);
    let conn = h.connect("a", &[UPPER]);
    let master = Peer::Master(conn.slot);
    let payload = vec![9u8; 256 * 1024];
    // Each request's answer runs one chunk past its window.
    let over = |h: &mut Harness, rid: u64| {
        let key = h.engine_request(rid, UPPER).expect("routed");
        h.from_master(conn, stream(key, FrameType::StreamStart, "out", 0));
        h.from_master(conn, chunk(key, "out", 0, 1, &payload));
        h.from_master(conn, chunk(key, "out", 1, 2, &payload));
        key
    };
    let first = over(&mut h, 1);
    let per = h.switch.overrun_bytes_of(master);
    assert!(per >= payload.len());
    let fits = SHARE / per;
    let mut keys = vec![first];
    for rid in 2..=fits as u64 {
        keys.push(over(&mut h, rid));
    }
    assert!(h.disconnected.is_empty());
    assert_eq!(h.switch.overrun_bytes_of(master), fits * per);
    // A cancel ends a request and what it held comes back; so does a grant.
    let reason = CancelReason {
        code: CancelCode::Cancelled,
        class: None,
        message: "no longer wanted".into(),
    };
    assert!(h.switch.ask_cancel(h.now, keys[0].rid, &reason));
    h.drain();
    engine_credit(&mut h, 2, "out", 1);
    assert_eq!(h.switch.overrun_bytes_of(master), (fits - 2) * per);
    assert!(h.switch.held_bytes_balance());
    over(&mut h, 1_001);
    over(&mut h, 1_002);
    assert!(h.disconnected.is_empty());
    over(&mut h, 1_003);
    assert_eq!(
        h.disconnected,
        [(
            conn,
            CutReason::Violation(ProtocolViolation::CreditViolation {
                stream: Some("out".into())
            })
        )]
    );
    assert_eq!(h.switch.overrun_bytes_of(master), 0);
    assert_eq!(h.switch.live_requests(), 0);
    assert!(h.switch.held_bytes_balance());
}

#[test]
fn credit_from_the_engine_is_forwarded_and_opens_the_window() {
    let mut h = Harness::new(window_of(1), &[]);
    let conn = h.connect("a", &[UPPER]);
    let key = h.engine_request(1, UPPER).expect("routed");
    h.from_master(conn, stream(key, FrameType::StreamStart, "out", 0));
    h.from_master(conn, chunk(key, "out", 0, 1, b"1"));
    let mut credit = Frame::new(FrameType::Credit, MessageId::Uint(1));
    credit.stream_id = Some("out".into());
    credit.credit = Some(1);
    h.from_engine(credit).expect("live");
    let at_a = request_frames(&mut h, conn.slot);
    assert_eq!(
        types(&at_a),
        [FrameType::Req, FrameType::Credit],
        "forwarded, not absorbed"
    );
    h.from_master(conn, chunk(key, "out", 1, 2, b"2"));
    assert!(h.disconnected.is_empty(), "the grant opened one more chunk");
}

#[test]
fn frames_for_another_masters_request_cut_the_sender_and_touch_nothing() {
    let (mut h, conns) = ready(&[("a", &[UPPER]), ("b", &[LOWER])]);
    let key = h.engine_request(1, UPPER).expect("routed to a");
    h.from_master(conns[1], response(key, FrameType::End, 0));
    assert_eq!(
        h.disconnected,
        [(
            conns[1],
            CutReason::Violation(ProtocolViolation::ForeignRequest)
        )]
    );
    assert_eq!(h.switch.live_requests(), 1, "a's request is untouched");
    h.from_master(conns[0], response(key, FrameType::End, 0));
    assert_eq!(types(&h.take_engine()), [FrameType::End]);
}

#[test]
fn an_emission_order_violation_cuts_the_master() {
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    let key = h.engine_request(1, UPPER).expect("routed");
    h.from_master(conns[0], chunk(key, "never-started", 0, 0, b"x"));
    assert!(matches!(
        h.disconnected[0].1,
        CutReason::Violation(ProtocolViolation::Emission(_))
    ));
    assert!(h
        .take_engine()
        .iter()
        .all(|f| f.frame_type != FrameType::Chunk));
}

#[test]
fn a_master_failing_the_identity_check_stays_attached_but_is_never_routed_to() {
    let mut h = Harness::new(SwitchConfig::default(), &[]);
    let conn = h.connect_with("a", &[UPPER], Limits::default(), Identity::Wrong);
    assert!(h.disconnected.is_empty(), "its socket stays open");
    assert!(h.events.contains(&Event::MasterUnhealthy {
        slot: conn.slot,
        reason: HandshakeError::Identity("wrong echo")
    }));
    assert!(
        !h.switch.slot_accepts_attach("a"),
        "attached, though unhealthy"
    );
    assert_eq!(
        h.engine_request(1, UPPER),
        Err(EngineError::NoHandler(Box::new(
            crate::cap::CapUrn::parse(UPPER).expect("a cap")
        )))
    );
    let stats = h.switch.protocol_stats(h.now);
    assert_eq!(stats.masters[0].stage, "failed");
    assert!(!stats.masters[0].healthy);
    // Once its connection goes, the slot takes a new attach.
    h.close(conn);
    assert!(h.switch.slot_accepts_attach("a"));
    let silent = h.connect_with("b", &[UPPER], Limits::default(), Identity::Silent);
    h.advance(Duration::from_millis(SWITCH_HANDSHAKE_TIMEOUT_MS));
    assert!(
        h.events.contains(&Event::MasterUnhealthy {
            slot: silent.slot,
            reason: HandshakeError::Identity("no echo in time")
        }),
        "{:?}",
        h.events
    );
}

#[test]
fn a_zero_chunk_limit_or_a_missing_relay_notify_is_refused() {
    let mut h = Harness::new(SwitchConfig::default(), &[]);
    let zero = Limits {
        max_chunk: 0,
        ..Limits::default()
    };
    let conn = h.connect_with("a", &[UPPER], zero, Identity::Echo);
    assert_eq!(
        h.disconnected,
        [(
            conn,
            CutReason::Handshake(HandshakeError::ZeroLimit("max_chunk"))
        )]
    );
    let quiet = h.switch.ask_attach(h.now, "b", [0; 32]).expect("new slot");
    h.advance(Duration::from_millis(SWITCH_HANDSHAKE_TIMEOUT_MS));
    assert_eq!(
        h.disconnected[1],
        (quiet, CutReason::Handshake(HandshakeError::Timeout))
    );
}

#[test]
fn heartbeats_go_out_every_interval_and_an_unanswered_one_cuts_the_master() {
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    h.take_master(conns[0].slot);
    h.advance(Duration::from_millis(SWITCH_HEARTBEAT_INTERVAL_MS));
    let beat = h.take_master(conns[0].slot);
    assert_eq!(types(&beat), [FrameType::Heartbeat]);
    h.from_master(conns[0], beat[0].clone());
    h.advance(Duration::from_millis(SWITCH_HEARTBEAT_INTERVAL_MS));
    assert_eq!(types(&h.take_master(conns[0].slot)), [FrameType::Heartbeat]);
    assert!(h.disconnected.is_empty());
    h.advance(Duration::from_millis(SWITCH_HEARTBEAT_TIMEOUT_MS));
    assert_eq!(h.disconnected, [(conns[0], CutReason::HeartbeatTimeout)]);
}

#[test]
fn a_masters_own_heartbeat_is_echoed() {
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    h.take_master(conns[0].slot);
    h.from_master(
        conns[0],
        Frame::new(FrameType::Heartbeat, MessageId::Uint(999)),
    );
    let echo = h.take_master(conns[0].slot);
    assert_eq!(
        echo,
        [Frame::new(FrameType::Heartbeat, MessageId::Uint(999))]
    );
}

#[test]
fn a_manifest_update_rebuilds_the_cap_table() {
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    assert_eq!(
        h.engine_request(1, LOWER),
        Err(EngineError::NoHandler(Box::new(
            crate::cap::CapUrn::parse(LOWER).expect("a cap")
        )))
    );
    let manifest = manifest_json("a", &[LOWER.into(), crate::cap::CAP_IDENTITY.into()]);
    let mut notify = Frame::new(FrameType::RelayNotify, MessageId::Uint(0));
    notify.meta = Some(notify_meta(Some(&manifest), Some(br#"{"cartridges":2}"#)));
    h.from_master(conns[0], notify);
    assert!(h.events.contains(&Event::CapsChanged));
    assert!(h.engine_request(2, LOWER).is_ok());
    assert_eq!(
        h.engine_request(3, UPPER),
        Err(EngineError::NoHandler(Box::new(
            crate::cap::CapUrn::parse(UPPER).expect("a cap")
        )))
    );
    let stats = h.switch.protocol_stats(h.now);
    assert_eq!(
        stats.masters[0].host_stats.as_deref(),
        Some(r#"{"cartridges":2}"#)
    );
}

#[test]
fn protocol_stats_serialize_live_requests_masters_and_totals() {
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    let key = h.engine_request(1, UPPER).expect("routed");
    h.from_master(conns[0], stream(key, FrameType::StreamStart, "out", 0));
    h.advance(Duration::from_millis(1_500));
    let stats = h.switch.protocol_stats(h.now);
    assert_eq!(stats.requests.len(), 1);
    assert_eq!(stats.requests[0].idle_ms, 1_500);
    assert_eq!(stats.masters[0].stage, "live");
    let json = serde_json::to_value(&stats).expect("serializes");
    assert_eq!(json["masters"][0]["healthy"], true);
    assert_eq!(json["table"]["registered"], 1);
}

#[test]
fn the_cap_graph_finds_reachable_media_and_paths() {
    let to_upper = "cap:in=media:text;out=media:upper";
    let to_pdf = "cap:in=media:upper;out=media:pdf";
    let (h, _) = ready(&[("a", &[to_upper]), ("b", &[to_pdf])]);
    let text = MediaUrn::parse("media:text").expect("parses");
    let pdf = MediaUrn::parse("media:pdf").expect("parses");
    let reachable = h.switch.reachable_targets(&text);
    assert!(reachable.contains(&pdf));
    let paths = h.switch.paths_to(&text, &pdf);
    assert_eq!(paths.len(), 1);
    assert_eq!(
        paths[0].iter().map(ToString::to_string).collect::<Vec<_>>(),
        [to_upper, to_pdf]
    );
}

#[test]
fn anything_but_a_relay_notify_first_cuts_the_connection() {
    let mut h = Harness::new(SwitchConfig::default(), &[]);
    let conn = h.switch.ask_attach(h.now, "a", [0; 32]).expect("new");
    h.from_master(conn, Frame::new(FrameType::Chunk, MessageId::Uint(1)));
    assert!(matches!(h.disconnected[0].1, CutReason::Handshake(_)));
    assert!(h.switch.slot_accepts_attach("a"));
}

mod properties {
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn arbitrary_op_sequences_keep_the_switch_laws(data in proptest::collection::vec(any::<u8>(), 0..400)) {
            if let Err(law) = super::super::harness::run_ops(&data) {
                prop_assert!(false, "{}", law);
            }
        }
    }
}

mod routing_index {
    use super::*;
    use proptest::prelude::*;

    const MEDIA: [&str; 8] = [
        "media:",
        "media:text",
        "media:upper",
        "media:text;lang=en",
        "\"media:text;lang=fr\"",
        "media:pdf",
        "\"media:text;?lang\"",
        "\"media:text;!lang\"",
    ];

    fn cap(input: usize, output: usize, tag: usize) -> String {
        let tag = ["", ";op=a", ";op", ";?op", ";!op"][tag % 5];
        format!("cap:in={};out={}{tag}", MEDIA[input % 8], MEDIA[output % 8])
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// The output-key index never changes a routing decision: the switch routes exactly
        /// where ranking every routable cap would.
        #[test]
        fn the_output_index_routes_as_ranking_every_cap_would(
            table in proptest::collection::vec((0usize..8, 0usize..8, 0usize..5), 1..24),
            requests in proptest::collection::vec((0usize..8, 0usize..8, 0usize..5), 1..16),
        ) {
            let mut h = Harness::new(SwitchConfig::default(), &[]);
            for (index, chunk) in table.chunks(4).enumerate() {
                let caps: Vec<String> = chunk
                    .iter()
                    .map(|(i, o, t)| cap(*i, *o, *t))
                    .filter(|text| CapUrn::parse(text).is_ok())
                    .collect();
                let refs: Vec<&str> = caps.iter().map(String::as_str).collect();
                h.connect(&format!("m{index}"), &refs);
            }
            for (i, o, t) in requests {
                let Ok(request) = CapUrn::parse(&cap(i, o, t)) else { continue };
                let expected = crate::cap::rank(&request, &h.switch.cap_table, None)
                    .first()
                    .map(|index| h.switch.cap_slots[*index]);
                prop_assert_eq!(h.switch.route_for(&request, None), expected, "{}", request);
            }
        }
    }
}

#[test]
fn undecodable_bytes_cut_the_master_with_a_typed_reason() {
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    let error = crate::wire::DecodeError {
        offset: 7,
        error: crate::wire::bifaci::BifaciError::FrameTooLarge { len: 9, max: 8 },
    };
    h.switch.handle_undecodable(h.now, conns[0], error.clone());
    h.drain();
    assert_eq!(h.disconnected, [(conns[0], CutReason::Undecodable(error))]);
    assert_eq!(h.switch.counters().cuts["undecodable"], 1);
}

#[test]
fn an_err_the_switch_writes_itself_continues_the_flows_numbering() {
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    let key = h.engine_request(1, UPPER).expect("routed");
    h.from_master(conns[0], stream(key, FrameType::StreamStart, "out", 0));
    h.from_master(conns[0], chunk(key, "out", 0, 1, b"x"));
    h.close(conns[0]);
    let engine = h.take_engine();
    assert_eq!(
        engine
            .iter()
            .map(|f| (f.frame_type, f.seq))
            .collect::<Vec<_>>(),
        [
            (FrameType::StreamStart, 0),
            (FrameType::Chunk, 1),
            (FrameType::Err, 2)
        ],
        "a receiver's reorder buffer would refuse a restarted seq"
    );
}

#[test]
fn a_master_that_stops_reading_is_cut_off_as_backlogged() {
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    h.engine_request(1, UPPER).expect("routed");
    h.switch.handle_backlogged(h.now, conns[0]);
    h.drain();
    assert_eq!(h.disconnected, [(conns[0], CutReason::Backlogged)]);
    assert_eq!(h.switch.counters().cuts["backlogged"], 1);
    assert_eq!(h.switch.live_requests(), 0, "its requests ended MasterDied");
}

/// One master flooding peer requests gets its share of the table and no more: past it each
/// REQ is answered `QUOTA` (counted), the engine's requests are still routed, and the share
/// frees as its requests end, however they end (here: answered, and the serving master's
/// death).
#[test]
fn a_master_gets_its_share_of_peer_requests_and_the_share_frees_as_they_end() {
    use crate::limits::SWITCH_PEER_REQUESTS_PER_MASTER_MAX as SHARE;
    let (mut h, conns) = ready(&[("a", &[UPPER]), ("b", &[LOWER])]);
    let flood = |h: &mut Harness, from: u64, count: u64| {
        for rid in from..from + count {
            let mut req = Frame::new(FrameType::Req, MessageId::Uint(rid));
            req.cap = Some(LOWER.into());
            h.from_master(conns[0], req);
        }
    };
    flood(&mut h, 1_000, SHARE as u64 + 10);
    let answers = request_frames(&mut h, conns[0].slot);
    let quota = answers
        .iter()
        .filter(|frame| error_code(frame).as_deref() == Some("QUOTA"))
        .count();
    assert_eq!(quota, 10);
    assert_eq!(h.switch.counters().quota_refused, 10);
    assert_eq!(h.switch.peer_requests_of(conns[0].slot), SHARE);
    assert!(
        h.engine_request(1, LOWER).is_ok(),
        "the engine is not locked out"
    );

    // One answered: its place is free again.
    let at_b = request_frames(&mut h, conns[1].slot);
    let first = at_b
        .iter()
        .find(|f| f.frame_type == FrameType::Req)
        .expect("a REQ");
    let key = RequestKey {
        xid: first.routing_id.expect("xid"),
        rid: first.id,
    };
    h.from_master(conns[1], response(key, FrameType::End, 0));
    assert_eq!(h.switch.peer_requests_of(conns[0].slot), SHARE - 1);
    // The serving master dies: every one of a's peer requests ends, and its share is whole.
    h.close(conns[1]);
    assert_eq!(h.switch.peer_requests_of(conns[0].slot), 0);
    let _ = h.take_engine();
    let _ = request_frames(&mut h, conns[0].slot);
}

#[test]
fn early_frames_are_held_within_their_bytes_per_sender_over_all_its_requests() {
    use crate::limits::{
        SWITCH_PEER_REORDER_HELD_BYTES_MAX as SHARE, SWITCH_REORDER_HELD_BYTES_MAX as LEG,
    };
    let (mut h, conns) = ready(&[("a", &[UPPER])]);
    let conn = conns[0];
    let master = Peer::Master(conn.slot);
    let payload = vec![7u8; LEG / 2];
    // Each request gets one chunk early (seq 1 before seq 0): within the leg's own bound, so
    // only the total over the master's requests can stop it.
    let early = |h: &mut Harness, rid: u64| {
        let key = h.engine_request(rid, UPPER).expect("routed");
        h.from_master(conn, chunk(key, "out", 0, 1, &payload));
        key
    };
    let first = early(&mut h, 1);
    let per = h.switch.held_bytes_of(master);
    assert!(per >= payload.len() && per <= LEG);
    let fits = SHARE / per;
    let mut keys = vec![first];
    for rid in 2..=fits as u64 {
        keys.push(early(&mut h, rid));
    }
    assert!(h.disconnected.is_empty());
    assert_eq!(h.switch.held_bytes_of(master), fits * per);
    assert!(h.take_engine().is_empty(), "nothing delivered out of order");

    // The gap fills on one request: its frames go on, and what it held comes back.
    h.from_master(conn, stream(keys[0], FrameType::StreamStart, "out", 0));
    assert_eq!(
        types(&h.take_engine()),
        [FrameType::StreamStart, FrameType::Chunk]
    );
    assert_eq!(h.switch.held_bytes_of(master), (fits - 1) * per);
    // The engine cancels another: it ends, and what it held comes back.
    let reason = CancelReason {
        code: CancelCode::Cancelled,
        class: None,
        message: "no longer wanted".into(),
    };
    assert!(h.switch.ask_cancel(h.now, keys[1].rid, &reason));
    h.drain();
    assert_eq!(h.switch.held_bytes_of(master), (fits - 2) * per);

    // Two places were freed: two more requests fit, the one after them does not.
    early(&mut h, 1_001);
    early(&mut h, 1_002);
    assert!(h.disconnected.is_empty());
    early(&mut h, 1_003);
    assert_eq!(
        h.disconnected,
        [(
            conn,
            CutReason::Violation(ProtocolViolation::Reorder(RefusalKind::Overflow))
        )]
    );
    // Cutting the master ends its requests and releases everything they held.
    assert_eq!(h.switch.held_bytes_of(master), 0);
    assert_eq!(h.switch.held_bytes_of(Peer::Engine), 0);
    assert_eq!(
        h.switch.live_requests(),
        0,
        "every request a served ended with it"
    );
}
