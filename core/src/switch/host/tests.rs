//! The host machine from the switch's side: handshakes, requests, credit, cuts and
//! deadlines.

use super::*;
use crate::limits::{SWITCH_HOST_LOG_UNREAD_BYTES_MAX, SWITCH_LOG_UNREAD_BYTES_PER_REQUEST_MAX};
use crate::switch::ask::{Ask, HostAsk};
use crate::switch::{ConnId, Peer, Switch, SwitchConfig};

const UPPER: &str = "cap:in=media:text;out=media:upper";

/// A switch and real hosts wired back to back in memory.
struct World {
    switch: Switch,
    hosts: Vec<(ConnId, Host)>,
    engine: Vec<Frame>,
    host_events: Vec<Vec<HostEvent>>,
    now: Time,
}

impl World {
    fn new(hosts: &[(&str, &[&str])]) -> Self {
        let mut world = World {
            switch: Switch::new(SwitchConfig::default(), &[]),
            hosts: Vec::new(),
            engine: Vec::new(),
            host_events: Vec::new(),
            now: Time::from_millis(5),
        };
        for (index, (name, caps)) in hosts.iter().enumerate() {
            let conn = world
                .switch
                .ask_attach(world.now, name, [index as u8; 32])
                .expect("attach");
            let caps = caps.iter().map(|c| (*c).to_owned()).collect();
            let host = Host::new(HostConfig::new(name, caps, [index as u8; 8]), world.now);
            world.hosts.push((conn, host));
            world.host_events.push(Vec::new());
        }
        world.pump();
        world
    }

    fn pump(&mut self) {
        loop {
            let mut moved = false;
            while let Some(transmit) = self.switch.poll_transmit() {
                moved = true;
                match transmit.to {
                    Peer::Engine => self.engine.push(transmit.frame),
                    Peer::Master(slot) => {
                        let (_, host) = self
                            .hosts
                            .iter_mut()
                            .find(|(conn, _)| conn.slot == slot)
                            .expect("a host per slot");
                        host.ask_frame(self.now, transmit.frame).expect("valid");
                    }
                }
            }
            while self.switch.poll_event().is_some() {}
            for (index, (conn, host)) in self.hosts.iter_mut().enumerate() {
                while let Some(frame) = host.poll_transmit() {
                    moved = true;
                    self.switch.handle_master_frame(self.now, *conn, frame);
                }
                while let Some(event) = host.poll_event() {
                    self.host_events[index].push(event);
                }
            }
            if !moved {
                return;
            }
        }
    }
}

#[test]
fn a_host_passes_the_handshake_and_serves_a_streamed_request() {
    let mut w = World::new(&[("a", &[UPPER])]);
    assert!(w.switch.is_routing());
    assert!(matches!(w.host_events[0][0], HostEvent::Ready { .. }));
    let mut req = Frame::new(FrameType::Req, MessageId::Uint(1));
    req.cap = Some(UPPER.into());
    w.switch
        .ask_engine_request(w.now, req, None)
        .expect("routed to the host");
    w.pump();
    let key = w.host_events[0]
        .iter()
        .find_map(|event| match event {
            HostEvent::Request { key, cap, .. } if cap == UPPER => Some(*key),
            _ => None,
        })
        .expect("the host got the request");
    let (_, host) = &mut w.hosts[0];
    let mut start = Frame::new(FrameType::StreamStart, key.rid);
    start.stream_id = Some("out".into());
    host.write(key, start).expect("flow");
    for index in 0..3 {
        let mut chunk = Frame::new(FrameType::Chunk, key.rid);
        chunk.stream_id = Some("out".into());
        chunk.chunk_index = Some(index);
        chunk.payload = Some(Bytes::from_static(b"HELLO"));
        host.write(key, chunk).expect("within the window");
    }
    let mut end_stream = Frame::new(FrameType::StreamEnd, key.rid);
    end_stream.stream_id = Some("out".into());
    end_stream.chunk_count = Some(3);
    host.write(key, end_stream).expect("flow");
    host.write(key, Frame::new(FrameType::End, key.rid))
        .expect("end");
    assert_eq!(host.served_len(), 0);
    w.pump();
    let types: Vec<FrameType> = w.engine.iter().map(|f| f.frame_type).collect();
    assert_eq!(
        types,
        [
            FrameType::StreamStart,
            FrameType::Chunk,
            FrameType::Chunk,
            FrameType::Chunk,
            FrameType::StreamEnd,
            FrameType::End
        ]
    );
    assert_eq!(w.switch.live_requests(), 0);
}

#[test]
fn early_frames_are_held_within_their_bytes_per_request_and_per_host() {
    let mut w = World::new(&[("a", &[UPPER])]);
    let mut keys = Vec::new();
    for id in 1..=10u64 {
        let mut req = Frame::new(FrameType::Req, MessageId::Uint(id));
        req.cap = Some(UPPER.into());
        w.switch
            .ask_engine_request(w.now, req, None)
            .expect("routed");
        w.pump();
    }
    for event in &w.host_events[0] {
        if let HostEvent::Request { key, .. } = event {
            keys.push(*key);
        }
    }
    assert_eq!(keys.len(), 10);
    let early = |key: RequestKey, seq: u64, bytes: usize| {
        let mut chunk = Frame::new(FrameType::Chunk, key.rid);
        chunk.routing_id = Some(key.xid);
        chunk.seq = seq;
        chunk.stream_id = Some("in".into());
        chunk.payload = Some(Bytes::from(vec![0u8; bytes]));
        chunk
    };
    let host = &mut w.hosts[0].1;
    let now = w.now;
    // One request: 600 KiB early is held; 600 KiB more passes the request's bytes.
    host.ask_frame(now, early(keys[0], 5, 600 << 10))
        .expect("held");
    let refused = host.ask_frame(now, early(keys[0], 6, 600 << 10));
    assert!(
        matches!(
            refused,
            Err(HostError::Flow(
                _,
                ReadError::Reorder(RefusalKind::Overflow)
            ))
        ),
        "{refused:?}"
    );
    // Over requests: 900 KiB each is within each request's bytes; the host's bound (8
    // MiB) is passed at the tenth.
    let mut host = Host::new(HostConfig::new("b", vec![UPPER.into()], [9; 8]), now);
    host.ask_frame(now, NetworkPolicy::Full.to_frame())
        .expect("policy");
    let mut outcome = Ok(());
    for (n, key) in keys.iter().enumerate() {
        let mut req = Frame::new(FrameType::Req, key.rid);
        req.routing_id = Some(key.xid);
        req.cap = Some(UPPER.into());
        host.ask_frame(now, req).expect("request");
        outcome = host.ask_frame(now, early(*key, 3, 900 << 10));
        if n < 9 {
            assert!(outcome.is_ok(), "request {n}: {outcome:?}");
        }
    }
    assert!(
        matches!(
            outcome,
            Err(HostError::Flow(
                _,
                ReadError::Reorder(RefusalKind::Overflow)
            ))
        ),
        "{outcome:?}"
    );
}

#[test]
fn log_frames_wait_for_their_reader_within_their_bytes() {
    let now = Time::ZERO;
    let mut host = Host::new(HostConfig::new("h", vec![UPPER.into()], [3; 8]), now);
    host.ask_frame(now, NetworkPolicy::Full.to_frame())
        .expect("policy");
    let request = |host: &mut Host, n: u64| {
        let key = RequestKey {
            xid: MessageId::Uint(1000 + n),
            rid: MessageId::Uint(n),
        };
        let mut req = Frame::new(FrameType::Req, key.rid);
        req.routing_id = Some(key.xid);
        req.cap = Some(UPPER.into());
        host.ask_frame(now, req).expect("request");
        key
    };
    let log = |key: RequestKey, seq: u64| {
        let mut log = Frame::new(FrameType::Log, key.rid);
        log.routing_id = Some(key.xid);
        log.seq = seq;
        log.payload = Some(Bytes::from(vec![b'x'; 4096]));
        log
    };
    let inputs = |host: &mut Host| {
        std::iter::from_fn(|| host.poll_event())
            .filter(|event| matches!(event, HostEvent::Input { .. }))
            .count()
    };
    let bytes = log(request(&mut host, 0), 0).held_bytes();
    let per_request = SWITCH_LOG_UNREAD_BYTES_PER_REQUEST_MAX / bytes;
    // A reader that reads nothing: LOG frames pass up to the request's bound, then drop.
    let key = request(&mut host, 1);
    for seq in 1..=(per_request as u64 + 10) {
        host.ask_frame(now, log(key, seq)).expect("in order");
    }
    assert_eq!(inputs(&mut host), per_request);
    assert_eq!(host.stats().logs_dropped, 10);
    // The reader reads them: room comes back.
    host.consume_log(key, per_request * bytes);
    host.ask_frame(now, log(key, per_request as u64 + 11))
        .expect("in order");
    assert_eq!(inputs(&mut host), 1);
    // Many requests whose readers read nothing: the host's bound holds over them all.
    let mut passed = 0;
    for n in 2..40 {
        let key = request(&mut host, n);
        for seq in 1..=per_request as u64 {
            host.ask_frame(now, log(key, seq)).expect("in order");
        }
        passed += inputs(&mut host);
    }
    // Unread now: those, and the one of request 1 read after the room came back. The
    // host stops within one frame of its bound.
    let unread = (passed + 1) * bytes;
    assert!(unread <= SWITCH_HOST_LOG_UNREAD_BYTES_MAX, "{passed}");
    assert!(
        unread + bytes > SWITCH_HOST_LOG_UNREAD_BYTES_MAX,
        "{passed}"
    );
}

#[test]
fn a_peer_request_reaches_another_host_and_its_answer_comes_back() {
    let lower = "cap:in=media:text;out=media:lower";
    let mut w = World::new(&[("a", &[UPPER]), ("b", &[lower])]);
    let rid = w.hosts[0].1.peer_request(lower, None).expect("ready");
    w.hosts[0]
        .1
        .peer_write(rid, Frame::new(FrameType::End, rid))
        .expect("input ends");
    w.pump();
    let key = w.host_events[1]
        .iter()
        .find_map(|event| match event {
            HostEvent::Request { key, .. } => Some(*key),
            _ => None,
        })
        .expect("b serves it");
    w.hosts[1]
        .1
        .write(key, Frame::new(FrameType::End, key.rid))
        .expect("answer");
    w.pump();
    assert!(w.host_events[0]
        .iter()
        .any(|event| matches!(event, HostEvent::PeerAnswer { frame, .. } if frame.frame_type == FrameType::End)));
    assert_eq!(w.hosts[0].1.calls_len(), 0);
    assert_eq!(w.switch.live_requests(), 0);
}

#[test]
fn a_request_no_cap_of_the_host_serves_is_answered_no_handler() {
    let mut w = World::new(&[("a", &[UPPER])]);
    // Routed by its identity cap, which the host serves only for the handshake.
    let mut req = Frame::new(FrameType::Req, MessageId::Uint(1));
    req.cap = Some("cap:in=media:pdf;out=media:text".into());
    let key = RequestKey {
        xid: MessageId::Uint(77),
        rid: MessageId::Uint(1),
    };
    req.routing_id = Some(key.xid);
    let host = &mut w.hosts[0].1;
    host.ask_frame(w.now, req).expect("valid");
    let answer = host.poll_transmit().expect("answered");
    assert_eq!(answer.frame_type, FrameType::Err);
    assert_eq!(
        crate::switch::error_code(&answer).as_deref(),
        Some("NO_HANDLER")
    );
    assert_eq!(host.served_len(), 0);
    assert!(host.poll_event().is_none());
}

#[test]
fn a_host_waits_for_credit_past_its_window() {
    let mut w = World::new(&[("a", &[UPPER])]);
    let mut req = Frame::new(FrameType::Req, MessageId::Uint(1));
    req.cap = Some(UPPER.into());
    w.switch
        .ask_engine_request(w.now, req, None)
        .expect("routed");
    w.pump();
    let key = w.host_events[0]
        .iter()
        .find_map(|event| match event {
            HostEvent::Request { key, .. } => Some(*key),
            _ => None,
        })
        .expect("request");
    let host = &mut w.hosts[0].1;
    let mut start = Frame::new(FrameType::StreamStart, key.rid);
    start.stream_id = Some("out".into());
    host.write(key, start).expect("flow");
    let window = Limits::default().initial_credit;
    for index in 0..window {
        let mut chunk = Frame::new(FrameType::Chunk, key.rid);
        chunk.stream_id = Some("out".into());
        chunk.chunk_index = Some(index);
        host.write(key, chunk).expect("within the window");
    }
    assert!(!host.has_credit(key, Some("out")));
    let mut over = Frame::new(FrameType::Chunk, key.rid);
    over.stream_id = Some("out".into());
    over.chunk_index = Some(window);
    assert_eq!(
        host.write(key, over.clone()),
        Err(HostWriteError::Flow(WriteError::NoCredit(Some(
            "out".into()
        ))))
    );
    w.pump();
    // The engine grants; the switch forwards it; the host may send again.
    let mut credit = Frame::new(FrameType::Credit, MessageId::Uint(1));
    credit.stream_id = Some("out".into());
    credit.credit = Some(1);
    w.switch.ask_engine_frame(w.now, credit).expect("live");
    w.pump();
    w.hosts[0].1.write(key, over).expect("granted");
}

/// A live host echoes a HEARTBEAT by its id alone (a megabyte the switch put in one is
/// not written back), refuses a REQ that repeats a live key, and gives up on a switch that
/// goes silent past its deadline, keeping nothing.
#[test]
fn heartbeats_echo_ids_only_repeated_keys_are_refused_and_silence_ends_it() {
    let config = HostConfig::new("h", vec![UPPER.to_owned()], [1; 8]);
    let mut host = Host::new(config, Time::ZERO);
    assert_eq!(
        host.poll_timeout(),
        Some(Time::from_millis(
            crate::limits::SWITCH_HANDSHAKE_TIMEOUT_MS
        ))
    );
    host.ask_frame(Time::ZERO, NetworkPolicy::Full.to_frame())
        .expect("policy");
    while host.poll_transmit().is_some() {}
    let mut beat = Frame::new(FrameType::Heartbeat, MessageId::Uint(42));
    beat.payload = Some(Bytes::from(vec![7; 1 << 20]));
    beat.meta = Some(error_meta("X", ErrorClass::Internal, "y"));
    let at = Time::from_millis(1_000);
    host.ask_frame(at, beat).expect("heartbeat");
    let echo = host.poll_transmit().expect("echoed");
    assert_eq!(echo, Frame::new(FrameType::Heartbeat, MessageId::Uint(42)));

    let mut req = Frame::new(FrameType::Req, MessageId::Uint(5));
    req.routing_id = Some(MessageId::Uint(9));
    req.cap = Some(UPPER.to_owned());
    host.ask_frame(at, req.clone()).expect("a request");
    assert_eq!(
        host.ask_frame(at, req),
        Err(HostError::RepeatedKey(MessageId::Uint(5)))
    );
    assert_eq!(host.stats().repeated_keys, 1);

    let silence = host.poll_timeout().expect("a silence deadline");
    assert_eq!(silence.saturating_since(at).as_millis() as u64, 40_000);
    assert_eq!(host.ask_timeout(Time::from_millis(2_000)), Ok(()));
    assert_eq!(host.ask_timeout(silence), Err(HostError::Silent));
    assert_eq!((host.served_len(), host.stats().timeouts), (0, 1));
}
