//! Bad input from a master over a real socket: it is cut off with a typed reason and counted,
//! and nothing it sends touches another master's requests.

use tether::switch::host::Host;
use tether::switch::Switch;
use tether_core::switch::host::{Host as HostMachine, HostConfig};
use tether_core::switch::Limits;
use tether_core::time::Time;
use tether_core::wire::bifaci::{BifaciDecoder, Frame, FrameType, MessageId};
use tether_core::wire::StreamDecoder;
use tether_tests::socket_pair;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const SLOW: &str = "cap:in=media:text;out=media:slow";
const OTHER: &str = "cap:in=media:text;out=media:other";

/// A master that passes the handshake with core's host machine, then is the test's to abuse.
async fn raw_master(mut stream: UnixStream, cap: &str) -> UnixStream {
    let mut machine = HostMachine::new(HostConfig {
        name: "raw".into(),
        caps: vec![cap.into()],
        limits: Limits::default(),
        rid_prefix: [9; 8],
    });
    let mut decoder = StreamDecoder::new(BifaciDecoder::default());
    let mut buf = vec![0u8; 64 * 1024];
    let mut echoed_identity = false;
    while !echoed_identity {
        let n = stream.read(&mut buf).await.expect("read");
        assert!(n > 0, "the switch hung up during the handshake");
        decoder.push(&buf[..n]);
        while let Some(frame) = decoder.pop().expect("frames") {
            machine
                .handle_frame(Time::ZERO, frame)
                .expect("a valid switch");
        }
        let mut out = Vec::new();
        while let Some(frame) = machine.poll_transmit() {
            echoed_identity |= frame.frame_type == FrameType::End;
            frame.encode(1 << 20, &mut out).expect("encodes");
        }
        stream.write_all(&out).await.expect("write");
    }
    stream
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
