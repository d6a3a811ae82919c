//! The request switch end to end: an engine and hosts over Unix sockets, each host a real
//! `tether::switch::host::Host` serving caps with handler tasks.

use tether::switch::host::Host;
use tether::switch::{Input, Switch, SwitchError};
use tether_core::request::CancelReason;
use tether_core::switch::EngineError;
use tether_tests::socket_pair;
use tokio::net::UnixListener;

const UPPER: &str = "cap:in=media:text;out=media:upper";
const GENERIC_UPPER: &str = "cap:in=media:;out=media:upper";
const LOWER: &str = "cap:in=media:text;out=media:lower";
const SLOW: &str = "cap:in=media:text;out=media:slow";

fn upper_host(name: &str, cap: &str) -> Host {
    Host::new(name).handler(cap, |mut request| async move {
        let input = request.read_all().await;
        let _ = request
            .respond("output", "media:upper", [input.to_ascii_uppercase()])
            .await;
        let _ = request.end().await;
    })
}

/// A host that answers with its name, to tell which one served.
fn naming_host(name: &'static str, cap: &str) -> Host {
    Host::new(name).handler(cap, move |mut request| async move {
        let _ = request.read_all().await;
        let _ = request
            .respond("output", "media:upper", [name.as_bytes().to_vec()])
            .await;
        let _ = request.end().await;
    })
}

async fn call(switch: &Switch, cap: &str, input: &[u8]) -> Result<Vec<u8>, SwitchError> {
    let call = switch.request(cap).await?;
    call.send_stream("input", "media:text", [input.to_vec()])
        .await?;
    call.finish().await?;
    call.collect().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_reach_the_most_specific_host_and_their_answers_come_back() {
    let switch = Switch::builder().start();
    let (s1, h1) = socket_pair();
    let (s2, h2) = socket_pair();
    tokio::spawn(naming_host("generic", GENERIC_UPPER).serve(h1));
    tokio::spawn(naming_host("exact", UPPER).serve(h2));
    switch.add_master("generic", s1).await.expect("verified");
    switch.add_master("exact", s2).await.expect("verified");
    // The most specific cap wins although the generic host registered first...
    assert_eq!(
        call(&switch, UPPER, b"hello").await.expect("answered"),
        b"exact"
    );
    // ...unless the engine prefers the generic one.
    let preferred = switch
        .request_preferring(UPPER, Some(GENERIC_UPPER))
        .await
        .expect("routed");
    preferred.finish().await.expect("input ends");
    assert_eq!(preferred.collect().await.expect("answered"), b"generic");
    let stats = switch.protocol_stats().await.expect("stats");
    assert_eq!(stats.recently_terminated.len(), 2);
    assert!(stats.requests.is_empty(), "no request state is left");
    assert_eq!(
        switch.request(LOWER).await.err(),
        Some(SwitchError::Engine(
            tether_core::switch::EngineError::NoHandler(Box::new(
                tether_core::cap::CapUrn::parse(LOWER).expect("a cap")
            ))
        ))
    );
    switch.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_calls_another_hosts_cap_through_the_switch() {
    let switch = Switch::builder().start();
    let (s1, h1) = socket_pair();
    let (s2, h2) = socket_pair();
    // `lower` answers by asking `upper` (on the other host) and lowercasing its answer again.
    let lower = Host::new("lower").handler(LOWER, |mut request| async move {
        let input = request.read_all().await;
        let peer = request.peer_request(UPPER).await.expect("routed");
        let _ = peer
            .send_stream("input", "media:text", [input.clone()])
            .await;
        let _ = peer.finish().await;
        let shouted = peer.collect().await.unwrap_or_default();
        let answer = [input, b"/".to_vec(), shouted].concat();
        let _ = request.respond("output", "media:lower", [answer]).await;
        let _ = request.end().await;
    });
    tokio::spawn(lower.serve(h1));
    tokio::spawn(upper_host("upper", UPPER).serve(h2));
    switch.add_master("lower", s1).await.expect("verified");
    switch.add_master("upper", s2).await.expect("verified");
    let answer = call(&switch, LOWER, b"abc").await.expect("answered");
    assert_eq!(
        answer, b"abc/ABC",
        "the peer's answer came back through the switch"
    );
    let stats = switch.protocol_stats().await.expect("stats");
    assert_eq!(
        stats.table.registered, 2,
        "the engine's request and the peer request"
    );
    assert!(stats.requests.is_empty());
    switch.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_reaches_the_host_and_a_killed_host_ends_its_requests() {
    let switch = Switch::builder().start();
    let (s1, h1) = socket_pair();
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel();
    let slow = Host::new("slow").handler(SLOW, move |mut request| {
        let started_tx = started_tx.clone();
        async move {
            let _ = started_tx.send(request.id());
            // Never answers on its own.
            while request.next_input().await.is_some() {}
            std::future::pending::<()>().await;
        }
    });
    let host = tokio::spawn(slow.serve(h1));
    switch.add_master("slow", s1).await.expect("verified");
    let first = switch.request(SLOW).await.expect("routed");
    started.recv().await.expect("the handler started");
    assert!(
        switch
            .cancel_request(first.id(), CancelReason::operator("enough"))
            .await
    );
    assert_eq!(
        first.collect().await,
        Err(SwitchError::Failed(tether::switch::ErrCode::Cancelled))
    );
    // A second request, then the host dies: the request ends MASTER_DIED.
    let mut second = switch.request(SLOW).await.expect("routed");
    started.recv().await.expect("the handler started");
    host.abort();
    let mut last = None;
    while let Some(frame) = second.next().await {
        last = Some(frame);
    }
    let last = last.expect("the request ended with a frame");
    assert_eq!(
        tether_core::switch::error_code(&last).as_deref(),
        Some("MASTER_DIED")
    );
    // The engine's END after that is a straggler: refused, counted, and nothing else.
    assert_eq!(
        second.finish().await,
        Err(SwitchError::Engine(EngineError::NotLive))
    );
    let stats = switch.protocol_stats().await.expect("stats");
    assert_eq!(stats.table.stragglers.get("END"), Some(&1));
    assert!(
        stats.table.no_route.is_empty(),
        "a straggler, not a no-route"
    );
    assert!(stats.requests.is_empty(), "zero request state left");
    assert!(!stats.masters[0].healthy);
    // The same host comes back on a new connection: reattached in place.
    let (s2, h2) = socket_pair();
    tokio::spawn(upper_host("slow", SLOW).serve(h2));
    assert!(switch.slot_accepts_attach("slow").await);
    switch.add_master("slow", s2).await.expect("reattached");
    assert_eq!(call(&switch, SLOW, b"x").await.expect("answered"), b"X");
    switch.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_answer_streams_under_credit() {
    let switch = Switch::builder().start();
    let (s1, h1) = socket_pair();
    const CHUNKS: usize = 2_000;
    let big = Host::new("big").handler(UPPER, |mut request| async move {
        let _ = request.read_all().await;
        let chunks = (0..CHUNKS).map(|n| vec![(n % 251) as u8; 4096]);
        let _ = request.respond("output", "media:upper", chunks).await;
        let _ = request.end().await;
    });
    tokio::spawn(big.serve(h1));
    switch.add_master("big", s1).await.expect("verified");
    let answer = call(&switch, UPPER, b"go").await.expect("answered");
    assert_eq!(answer.len(), CHUNKS * 4096);
    assert!(answer
        .chunks(4096)
        .enumerate()
        .all(|(n, chunk)| chunk.iter().all(|b| *b == (n % 251) as u8)));
    switch.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_with_its_whole_input_writes_it_under_credit_in_order() {
    let switch = Switch::builder().start();
    let (s1, h1) = socket_pair();
    tokio::spawn(upper_host("upper", UPPER).serve(h1));
    switch.add_master("upper", s1).await.expect("verified");
    // Far past the credit window (32 chunks per stream), over two streams: the switch holds
    // what credit does not allow yet and writes it as the host consumes.
    let window = tether_core::limits::CREDIT_WINDOW_CHUNKS_DEFAULT as usize;
    let first: Vec<Vec<u8>> = (0..window * 5)
        .map(|n| vec![b'a' + (n % 26) as u8; 100])
        .collect();
    let second: Vec<Vec<u8>> = (0..window * 3)
        .map(|n| vec![b'a' + (n % 7) as u8; 10])
        .collect();
    let expected: Vec<u8> = first
        .iter()
        .chain(&second)
        .flatten()
        .map(u8::to_ascii_uppercase)
        .collect();
    let call = switch
        .call(
            UPPER,
            [
                Input::new("first", "media:text", first),
                Input::new("second", "media:text", second),
            ],
        )
        .await
        .expect("routed");
    // The input is already ended: the call only reads. (When the whole exchange is over by
    // now, the request is not live at all: refused either way.)
    assert!(matches!(
        call.finish().await,
        Err(SwitchError::Write(_) | SwitchError::Engine(EngineError::NotLive))
    ));
    assert_eq!(call.collect().await.expect("answered"), expected);
    // And with no input at all.
    let call = switch.call(UPPER, []).await.expect("routed");
    assert_eq!(call.collect().await.expect("answered"), b"");
    let stats = switch.protocol_stats().await.expect("stats");
    assert!(stats.requests.is_empty(), "no request state is left");
    switch.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_that_fails_the_handshake_is_refused_with_a_reason() {
    let switch = Switch::builder().start();
    let (s1, mut h1) = socket_pair();
    // Garbage instead of a HELLO.
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        let _ = h1.write_all(&[0, 0, 0, 3, 0xff, 0xff, 0xff]).await;
        // Holds the socket open until the runtime ends.
        std::future::pending::<()>().await;
    });
    let refused = switch.add_master("garbage", s1).await;
    assert!(matches!(refused, Err(SwitchError::Cut(_))), "{refused:?}");
    // Over a real listener too: a host that never answers is refused at the budget's end is
    // covered in core; here, a host serving over a Unix listener is attached by path.
    let dir = std::env::temp_dir().join(format!("tether-switch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("host.sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).expect("bind");
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.expect("accept");
        let _ = upper_host("listening", UPPER).serve(stream).await;
    });
    switch
        .connect_unix("listening", &path)
        .await
        .expect("verified");
    assert_eq!(call(&switch, UPPER, b"ok").await.expect("answered"), b"OK");
    switch.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_a_requests_feeds_lets_it_end_on_its_own() {
    let switch = Switch::builder().start();
    let (s1, h1) = socket_pair();
    let (fed_tx, mut fed) = tokio::sync::mpsc::unbounded_channel();
    // A tap: counts input chunks until its feed is closed, then answers with the count.
    let tap = Host::new("tap").handler(SLOW, move |mut request| {
        let fed_tx = fed_tx.clone();
        async move {
            let mut chunks = 0u32;
            while let Some(frame) = request.next_input().await {
                if frame.frame_type == tether_core::wire::bifaci::FrameType::Chunk {
                    chunks += 1;
                    let _ = fed_tx.send(chunks);
                }
            }
            let _ = request
                .respond("out", "media:text", [chunks.to_string().into_bytes()])
                .await;
            let _ = request.end().await;
        }
    });
    tokio::spawn(tap.serve(h1));
    switch.add_master("tap", s1).await.expect("verified");
    let call = switch.request(SLOW).await.expect("routed");
    let mut start = tether_core::wire::bifaci::Frame::new(
        tether_core::wire::bifaci::FrameType::StreamStart,
        call.id(),
    );
    start.stream_id = Some("feed".into());
    call.send(start).await.expect("sent");
    for index in 0..3 {
        let mut chunk = tether_core::wire::bifaci::Frame::new(
            tether_core::wire::bifaci::FrameType::Chunk,
            call.id(),
        );
        chunk.stream_id = Some("feed".into());
        chunk.chunk_index = Some(index);
        call.send(chunk).await.expect("sent");
    }
    while fed.recv().await.expect("the tap counts") < 3 {}
    assert!(switch.stop_request_feeds(call.id()).await, "it was live");
    assert_eq!(call.collect().await.expect("ended naturally"), b"3");
    let stats = switch.protocol_stats().await.expect("stats");
    assert_eq!(
        stats
            .table
            .terminated
            .get(&tether_core::request::TerminationKind::End),
        Some(&1),
        "ended by its END, not cancelled"
    );
    assert!(!switch.stop_request_feeds(call_id_after_end()).await);
    switch.close().await;
}

/// An id no request has: stopping it reports `false`.
fn call_id_after_end() -> tether_core::wire::bifaci::MessageId {
    tether_core::wire::bifaci::MessageId::Uint(9_999)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_request_nobody_serves_is_answered_no_handler() {
    let switch = Switch::builder().start();
    let (s1, h1) = socket_pair();
    let asking = Host::new("asking").handler(UPPER, |mut request| async move {
        let _ = request.read_all().await;
        let peer = request
            .peer_request("cap:in=media:text;out=media:nobody")
            .await
            .expect("sent");
        let _ = peer.finish().await;
        // The switch answers the peer request itself: nobody serves that cap.
        let code = match peer.collect().await {
            Err(tether::switch::host::HostServeError::Failed(code)) => code.to_string(),
            other => format!("not an ERR: {other:?}"),
        };
        let _ = request
            .respond("out", "media:text", [code.into_bytes()])
            .await;
        let _ = request.end().await;
    });
    tokio::spawn(asking.serve(h1));
    switch.add_master("asking", s1).await.expect("verified");
    assert_eq!(
        call(&switch, UPPER, b"?").await.expect("answered"),
        b"NO_HANDLER"
    );
    let stats = switch.protocol_stats().await.expect("stats");
    assert_eq!(stats.switch.no_handler, 1);
    assert!(stats.requests.is_empty());
    switch.close().await;
}
