//! Bad input from a master over a real socket (garbage, an oversized frame, another protocol
//! version, frames for another master's request, more CHUNKs past its credit than its share):
//! it is cut off with a typed reason and counted, and nothing it sends touches another master's
//! requests. CHUNKs past its credit within its share are held, not cut.

use tether::switch::host::Host;
use tether::switch::{Switch, SwitchError};
use tether_core::limits::{CREDIT_WINDOW_CHUNKS_DEFAULT, SWITCH_PEER_OVERRUN_HELD_BYTES_MAX};
use tether_core::request::RequestKey;
use tether_core::switch::host::{Host as HostMachine, HostConfig, HostEvent};
use tether_core::switch::side::stream_frames;
use tether_core::time::Time;
use tether_core::wire::bifaci::{BifaciDecoder, Frame, FrameType, MessageId};
use tether_core::wire::StreamDecoder;
use tether_tests::socket_pair;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const SLOW: &str = "cap:in=media:text;out=media:slow";
const OTHER: &str = "cap:in=media:text;out=media:other";

/// Core's host machine serving `cap`, named `name` (its peer request ids start `prefix`).
fn host_machine(name: &str, cap: &str, prefix: u8) -> HostMachine {
    HostMachine::new(
        HostConfig::new(name, vec![cap.into()], [prefix; 8]),
        tether_core::time::Time::ZERO,
    )
}

/// A master that passes the handshake with core's host machine, then is the test's to abuse.
async fn raw_master(stream: UnixStream, cap: &str) -> UnixStream {
    let mut machine = host_machine("raw", cap, 9);
    handshake(stream, &mut machine).await
}

/// Runs `machine` over `stream` until it echoed the switch's identity check. The master speaks
/// first (its RELAY_NOTIFY), then answers the switch's POLICY and identity check.
async fn handshake(mut stream: UnixStream, machine: &mut HostMachine) -> UnixStream {
    let mut decoder = StreamDecoder::new(BifaciDecoder::default());
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let mut out = Vec::new();
        let mut echoed_identity = false;
        while let Some(frame) = machine.poll_transmit() {
            echoed_identity |= frame.frame_type == FrameType::End;
            frame.encode(1 << 20, &mut out).expect("encodes");
        }
        stream.write_all(&out).await.expect("write");
        if echoed_identity {
            return stream;
        }
        let n = stream.read(&mut buf).await.expect("read");
        assert!(n > 0, "the switch hung up during the handshake");
        decoder.push(&buf[..n]);
        while let Some(frame) = decoder.pop().expect("frames") {
            machine.handle_frame(Time::ZERO, frame);
            assert_eq!(machine.poll_failure(), None, "a valid switch");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_frame_cuts_the_master_with_a_typed_reason() {
    let switch = Switch::builder().start();
    let (s1, h1) = socket_pair();
    let raw = tokio::spawn(raw_master(h1, OTHER));
    switch.add_master("raw", s1).await.expect("verified");
    let mut raw = raw.await.expect("handshake done");
    // A length prefix past the hard cap (16 MiB): refused before anything is buffered.
    raw.write_all(&0x0100_0001u32.to_be_bytes())
        .await
        .expect("write");
    let mut rest = Vec::new();
    let _ = raw.read_to_end(&mut rest).await; // the switch closes the connection
    let stats = switch.protocol_stats().await.expect("stats");
    assert_eq!(
        stats.switch.cuts.get("undecodable"),
        Some(&1),
        "{:?}",
        stats.switch
    );
    assert!(!stats.masters[0].healthy);
    assert!(stats.masters[0]
        .last_error
        .as_deref()
        .is_some_and(|error| error.contains("undecodable")));
    switch.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_for_another_masters_request_cut_the_sender_and_nothing_else() {
    let switch = Switch::builder().start();
    let (s1, h1) = socket_pair();
    let (s2, h2) = socket_pair();
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel();
    let (go_tx, go) = tokio::sync::watch::channel(false);
    let honest = Host::new("honest").handler(SLOW, move |mut request| {
        let (started_tx, mut go) = (started_tx.clone(), go.clone());
        async move {
            let _ = request.read_all().await;
            let _ = started_tx.send(request.id());
            let _ = go.wait_for(|go| *go).await;
            let _ = request
                .respond("out", "media:text", [b"honest".to_vec()])
                .await;
            let _ = request.end().await;
        }
    });
    tokio::spawn(honest.serve(h1));
    switch.add_master("honest", s1).await.expect("verified");
    let raw = tokio::spawn(raw_master(h2, OTHER));
    switch.add_master("hostile", s2).await.expect("verified");
    let mut hostile = raw.await.expect("handshake done");

    let call = switch.request(SLOW).await.expect("routed to honest");
    call.finish().await.expect("input ends");
    started.recv().await.expect("honest is serving it");
    // The hostile master guesses the request's XID and RID and sends its END.
    let mut forged = Frame::new(FrameType::End, call.id());
    forged.routing_id = Some(MessageId::Uint(1));
    let mut out = Vec::new();
    forged.encode(1 << 20, &mut out).expect("encodes");
    hostile.write_all(&out).await.expect("write");
    let mut rest = Vec::new();
    let _ = hostile.read_to_end(&mut rest).await; // cut: the switch closes it
    let stats = switch.protocol_stats().await.expect("stats");
    assert_eq!(stats.switch.violations.get("foreign_request"), Some(&1));
    assert_eq!(stats.requests.len(), 1, "the honest request is untouched");
    go_tx.send(true).expect("release");
    assert_eq!(call.collect().await.expect("answered"), b"honest");
    switch.close().await;
}

/// Reads frames from the switch into `machine` until one of its events matches `until`.
async fn serve_until(
    stream: &mut UnixStream,
    machine: &mut HostMachine,
    until: impl Fn(&HostEvent) -> bool,
) -> HostEvent {
    let mut decoder = StreamDecoder::new(BifaciDecoder::default());
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        while let Some(event) = machine.poll_event() {
            if until(&event) {
                return event;
            }
        }
        let n = stream.read(&mut buf).await.expect("read");
        assert!(n > 0, "the switch hung up");
        decoder.push(&buf[..n]);
        while let Some(frame) = decoder.pop().expect("frames") {
            machine.handle_frame(Time::ZERO, frame);
            assert_eq!(machine.poll_failure(), None, "a valid switch");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_speaking_another_protocol_version_is_refused_with_a_reason() {
    let switch = Switch::builder().start();
    let (s1, mut h1) = socket_pair();
    let master = tokio::spawn(async move {
        // Core's host opens with its RELAY_NOTIFY; the test changes the protocol version its
        // frame declares (key 0: the switch link has no version exchange of its own).
        let mut machine = host_machine("future", OTHER, 7);
        let notify = machine.poll_transmit().expect("the host's RELAY_NOTIFY");
        let body = notify.encode_body();
        assert_eq!(
            body[1..3],
            [0x00, 0x06],
            "key 0, version 6, first in the map"
        );
        let mut patched = vec![body[0], 0x00, 0x18, 99]; // version 99
        patched.extend_from_slice(&body[3..]);
        let mut out = (patched.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(&patched);
        h1.write_all(&out).await.expect("write");
        let mut rest = Vec::new();
        let _ = h1.read_to_end(&mut rest).await; // refused: the switch closes it
    });
    let refused = switch.add_master("future", s1).await;
    assert!(
        matches!(&refused, Err(SwitchError::Cut(reason)) if reason.to_string().contains("version 99")),
        "{refused:?}"
    );
    master.await.expect("the master saw the connection close");
    let stats = switch.protocol_stats().await.expect("stats");
    // The version is a frame's (key 0): a frame of another version does not decode.
    assert_eq!(stats.switch.cuts.get("undecodable"), Some(&1));
    switch.close().await;
}

/// A whole answer to `key` as a master that never waits for credit writes it: STREAM_START,
/// a CHUNK per payload, STREAM_END and END, numbered 0, 1, 2, … on the answer's flow.
fn answer_ignoring_credit(key: RequestKey, payloads: Vec<Vec<u8>>) -> Vec<u8> {
    let mut frames: Vec<Frame> = stream_frames(key.rid, "out", "media:text", payloads).collect();
    frames.push(Frame::new(FrameType::End, key.rid));
    let mut out = Vec::new();
    for (seq, mut frame) in frames.into_iter().enumerate() {
        frame.seq = seq as u64;
        frame.routing_id = Some(key.xid);
        frame.encode(1 << 20, &mut out).expect("encodes");
    }
    out
}

/// Waits until the switch counted `held` frames written past their window.
async fn until_held(switch: &Switch, held: u64) {
    loop {
        let stats = switch.protocol_stats().await.expect("stats");
        if stats.switch.overrun_held >= held {
            return;
        }
        tokio::task::yield_now().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_writing_past_its_credit_is_held_to_the_window_then_cut_past_its_share() {
    let switch = Switch::builder().start();
    let (s1, h1) = socket_pair();
    let (s2, h2) = socket_pair();
    tokio::spawn(
        Host::new("honest")
            .handler(SLOW, |request| async move {
                let _ = request
                    .respond("out", "media:text", [b"fine".to_vec()])
                    .await;
                let _ = request.end().await;
            })
            .serve(h1),
    );
    switch.add_master("honest", s1).await.expect("verified");
    let (mut greedy, mut machine) = {
        let raw = tokio::spawn(async move {
            let mut machine = host_machine("greedy", OTHER, 5);
            let stream = handshake(h2, &mut machine).await;
            (stream, machine)
        });
        switch.add_master("greedy", s2).await.expect("verified");
        raw.await.expect("handshake done")
    };
    let window = CREDIT_WINDOW_CHUNKS_DEFAULT as usize;
    let is_request = |event: &HostEvent| matches!(event, HostEvent::Request { .. });

    // An answer 8 CHUNKs past the window, written at once (as capdag's in-process host
    // does): the switch holds the excess until the caller reads, and the caller gets all of
    // it, in order. Nobody is cut.
    let call = switch.request(OTHER).await.expect("routed to greedy");
    let HostEvent::Request { key, .. } = serve_until(&mut greedy, &mut machine, is_request).await
    else {
        unreachable!("waited for a request");
    };
    let payloads: Vec<Vec<u8>> = (0..window + 8).map(|i| vec![i as u8; 16]).collect();
    greedy
        .write_all(&answer_ignoring_credit(key, payloads.clone()))
        .await
        .expect("write");
    // 8 CHUNKs, STREAM_END and END wait: the caller has read nothing, so granted nothing.
    until_held(&switch, 10).await;
    assert_eq!(call.collect().await.expect("answered"), payloads.concat());
    let stats = switch.protocol_stats().await.expect("stats");
    assert_eq!(stats.switch.overrun_held, 10);
    assert!(stats.switch.violations.is_empty(), "{:?}", stats.switch);
    assert!(stats.requests.is_empty(), "zero request state left");

    // An answer more than the master's share (8 MiB) past the window, to a caller that does
    // not read: the master is cut and its request ends.
    let call = switch.request(OTHER).await.expect("routed to greedy");
    let HostEvent::Request { key, .. } = serve_until(&mut greedy, &mut machine, is_request).await
    else {
        unreachable!("waited for a request");
    };
    let chunk = 64 * 1024;
    let past = SWITCH_PEER_OVERRUN_HELD_BYTES_MAX / chunk + 8;
    let payloads: Vec<Vec<u8>> = (0..window + past).map(|_| vec![1u8; chunk]).collect();
    // The write may fail part way: the switch cuts the master as soon as it is past its share.
    let _ = greedy
        .write_all(&answer_ignoring_credit(key, payloads))
        .await;
    let mut rest = Vec::new();
    let _ = greedy.read_to_end(&mut rest).await; // cut: the switch closes it
    assert_eq!(
        call.collect().await,
        Err(SwitchError::Failed(tether::switch::ErrCode::MasterDied))
    );
    let stats = switch.protocol_stats().await.expect("stats");
    assert_eq!(stats.switch.violations.get("credit_violation"), Some(&1));
    assert!(stats.requests.is_empty(), "zero request state left");
    // The other master serves on.
    let fine = switch.request(SLOW).await.expect("routed to honest");
    fine.finish().await.ok();
    assert_eq!(fine.collect().await.expect("answered"), b"fine");
    switch.close().await;
}
