//! capdag's own switch↔master conversation, replayed against tether's switch machine.
//!
//! `tests/data/capdag/handshake_trace*.json` hold every frame capdag 1.524.58's `RelaySwitch`
//! and a capdag master exchanged, in order (`tests/capdag/trace_handshake.py`). Here tether's
//! [`Switch`] takes the switch's place: the master's frames are fed to it as they were sent,
//! and what tether sends the master must be what capdag's switch sent, frame for frame, with
//! two differences that are not on the master's side of the protocol: the identity check's
//! request id (capdag's is a fresh UUID; tether's names the connection) and the seq of the
//! engine's frames (tether's engine numbers its flow, and the switch forwards that numbering;
//! capdag's engine writes every frame at seq 0, which its masters do not check). The
//! identity nonce is the trace's, given to `handle_attach` as the shell would give its random one.
//! The trace's last step (a HEARTBEAT the engine sends through the switch) has no counterpart:
//! tether's engine cannot send one, and tether's switch sends its own on a timer.

use std::collections::BTreeMap;

use bytes::Bytes;
use tether_core::switch::ask::Ask;
use tether_core::switch::{Event, NetworkPolicy, Peer, Switch, SwitchConfig};
use tether_core::time::Time;
use tether_core::wire::bifaci::{BifaciDecoder, Frame, FrameType, MessageId};
use tether_core::wire::StreamDecoder;

struct Traced {
    step: String,
    from_master: bool,
    frame: Frame,
}

fn trace(json: &str) -> Vec<Traced> {
    let file: serde_json::Value = serde_json::from_str(json).expect("the trace is JSON");
    file["frames"]
        .as_array()
        .expect("frames")
        .iter()
        .map(|entry| {
            let bytes = hex::decode(entry["hex"].as_str().expect("hex")).expect("hex");
            let mut decoder = StreamDecoder::new(BifaciDecoder::default());
            decoder.push(&bytes);
            let frame = decoder
                .pop()
                .expect("every frame capdag wrote decodes")
                .expect("one whole frame");
            Traced {
                step: entry["step"].as_str().expect("step").to_owned(),
                from_master: entry["dir"] == "master->switch",
                frame,
            }
        })
        .collect()
}

/// Replays `json`: returns how many frames tether's switch sent the master that matched.
fn replay(json: &str) -> usize {
    let frames = trace(json);
    // The nonce of the connect-time check, when there is one (the CBOR byte string's content).
    let nonce = frames
        .iter()
        .find(|t| {
            !t.from_master && t.frame.frame_type == FrameType::Chunk && t.frame.routing_id.is_none()
        })
        .map_or([0; 32], |t| {
            let payload = t.frame.payload.as_ref().expect("a nonce");
            payload[2..].try_into().expect("32 bytes after `58 20`")
        });
    let config = SwitchConfig {
        policy: NetworkPolicy::NoTelemetry,
        ..SwitchConfig::default()
    };
    let now = Time::from_millis(1);
    let mut switch = Switch::new(config, &[]);
    let conn = switch.ask_attach(now, "capdag", nonce).expect("a new slot");
    // capdag's ids for tether's, learnt from what tether sends.
    let mut ids: BTreeMap<MessageId, MessageId> = BTreeMap::new();
    let mut engine_seq = 0;
    let mut matched = 0;
    for traced in frames {
        if traced.step == "engine_heartbeat" || traced.step == "close" {
            break;
        }
        let mut frame = traced.frame;
        if traced.from_master {
            if let Some(ours) = ids.get(&frame.id) {
                frame.id = *ours;
            }
            switch.handle_master_frame(now, conn, frame);
            continue;
        }
        // What capdag's switch sent: a step tether's engine takes, then what tether's switch
        // sent must match it.
        if traced.step == "request" {
            let mut from_engine = frame.clone();
            from_engine.routing_id = None;
            from_engine.seq = engine_seq;
            engine_seq += 1;
            if from_engine.frame_type == FrameType::Req {
                switch
                    .ask_engine_request(now, from_engine, None)
                    .expect("routed to the capdag master");
            } else {
                switch
                    .ask_engine_frame(now, from_engine)
                    .expect("forwarded");
            }
        } else if traced.step == "set_policy" {
            switch.set_policy(NetworkPolicy::from_meta(frame.meta.as_ref()).expect("a policy"));
        }
        let sent = loop {
            let transmit = switch
                .poll_transmit()
                .unwrap_or_else(|| panic!("tether sent nothing where capdag sent {frame:?}"));
            if transmit.to == Peer::Master(conn.slot) {
                break transmit.frame;
            }
        };
        if sent.id != frame.id {
            assert!(
                ids.insert(frame.id, sent.id)
                    .is_none_or(|ours| ours == sent.id),
                "one id of tether's per id of capdag's"
            );
        }
        let mut expected = frame.clone();
        expected.id = sent.id;
        if traced.step == "request" {
            expected.seq = sent.seq;
        }
        // As it goes on the wire (the encoder writes a CHUNK's checksum).
        let wire = Bytes::from(sent.encode_body());
        assert_eq!(
            Frame::decode_body(&wire).as_ref(),
            Ok(&expected),
            "tether's switch where capdag's sent {frame:?}"
        );
        assert_eq!(wire, Bytes::from(expected.encode_body()), "the same bytes");
        matched += 1;
    }
    let mut ready = false;
    while let Some(event) = switch.poll_event() {
        ready |= matches!(event, Event::MasterReady { .. });
    }
    assert!(ready, "the capdag master passed tether's identity check");
    assert_eq!(
        switch.live_requests(),
        0,
        "the request ended and left nothing"
    );
    matched
}

#[test]
fn capdag_masters_connect_as_capdags_switch_connects_them() {
    // POLICY, the identity check (5), the request (5), the new POLICY.
    assert_eq!(
        replay(include_str!("../../tests/data/capdag/handshake_trace.json")),
        12
    );
}

#[test]
fn a_capless_capdag_master_is_probed_as_capdags_switch_probes_it() {
    // POLICY, the runtime probe (5), the request (5), the new POLICY.
    assert_eq!(
        replay(include_str!(
            "../../tests/data/capdag/handshake_trace_deferred.json"
        )),
        12
    );
}
