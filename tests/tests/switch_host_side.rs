//! The host side of the switch from the outside: a host that changes its handlers while it
//! serves re-advertises its manifest, and a host whose switch stops reading drops the
//! connection at its queue's bound instead of growing memory.

use tether::switch::host::{Host, HostServeError, ProtocolFault};
use tether::switch::{Switch, SwitchError};
use tether_core::limits::SWITCH_HOST_WRITER_FRAMES_MAX;
use tether_core::switch::{EngineError, Limits, NetworkPolicy};
use tether_core::wire::bifaci::{Frame, FrameType, MessageId};
use tether_tests::socket_pair;
use tokio::io::AsyncWriteExt;

const UPPER: &str = "cap:in=media:text;out=media:upper";
const LOWER: &str = "cap:in=media:text;out=media:lower";

async fn answer(switch: &Switch, cap: &str, input: &[u8]) -> Result<Vec<u8>, SwitchError> {
    let call = switch
        .call(
            cap,
            [tether::switch::Input::new(
                "input",
                "media:text",
                [input.to_vec()],
            )],
        )
        .await?;
    call.collect().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_gains_or_loses_a_handler_re_advertises_its_caps() {
    let switch = Switch::builder().start();
    let (s1, h1) = socket_pair();
    let host = Host::new("letters").handler(UPPER, |mut request| async move {
        let input = request.read_all().await;
        let _ = request
            .respond("output", "media:upper", [input.to_ascii_uppercase()])
            .await;
        let _ = request.end().await;
    });
    let handle = host.handle();
    tokio::spawn(host.serve(h1));
    switch.add_master("letters", s1).await.expect("verified");
    assert_eq!(
        answer(&switch, LOWER, b"X").await,
        Err(SwitchError::Engine(EngineError::NoHandler(Box::new(
            tether_core::cap::CapUrn::parse(LOWER).expect("a cap")
        ))))
    );

    handle
        .add_handler(LOWER, |mut request| async move {
            let input = request.read_all().await;
            let _ = request
                .respond("output", "media:lower", [input.to_ascii_lowercase()])
                .await;
            let _ = request.end().await;
        })
        .await
        .expect("added");
    // The new manifest went out before anything the host writes later: once an answer from
    // this host is back, the switch has read the manifest too.
    assert_eq!(answer(&switch, UPPER, b"a").await.expect("answered"), b"A");
    let caps = switch.capabilities().await;
    assert!(caps.iter().any(|cap| cap == LOWER), "{caps:?}");
    assert_eq!(
        answer(&switch, LOWER, b"QUIET").await.expect("routed"),
        b"quiet"
    );

    assert!(handle.remove_handler(LOWER).await.expect("removed"));
    assert!(!handle
        .remove_handler(LOWER)
        .await
        .expect("nothing to remove"));
    assert_eq!(answer(&switch, UPPER, b"b").await.expect("answered"), b"B");
    assert_eq!(
        answer(&switch, LOWER, b"X").await,
        Err(SwitchError::Engine(EngineError::NoHandler(Box::new(
            tether_core::cap::CapUrn::parse(LOWER).expect("a cap")
        ))))
    );
    assert!(matches!(
        handle.add_handler("not a cap", |_| async {}).await,
        Err(HostServeError::BadCap(_))
    ));
    switch.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_whose_switch_stops_reading_drops_the_connection_at_its_queue_bound() {
    let (mut fake_switch, h1) = socket_pair();
    let serving = tokio::spawn(Host::new("echo").serve(h1));
    // A switch that says HELLO, then sends heartbeats (each one the host must echo) and never
    // reads a byte: the echoes back up past the socket into the host's queue.
    let hello = hello();
    let mut out = Vec::new();
    hello.encode(1 << 20, &mut out).expect("encodes");
    for id in 0..(SWITCH_HOST_WRITER_FRAMES_MAX as u64 + 50_000) {
        Frame::new(FrameType::Heartbeat, MessageId::Uint(id))
            .encode(1 << 20, &mut out)
            .expect("encodes");
    }
    // The host hangs up once its queue is full, so this write may fail part way.
    let _ = fake_switch.write_all(&out).await;
    assert_eq!(
        serving.await.expect("serve returned"),
        Err(HostServeError::Backlogged)
    );
}

/// Every request a host serves leaves nothing behind once it ends, however it ends: the
/// handler answered, returned without answering (the host ends it `HANDLER_GONE`), or
/// panicked. Before, the host kept an entry for every request that ended normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_holds_no_state_for_requests_that_ended_however_they_ended() {
    const SILENT: &str = "cap:in=media:text;out=media:silent";
    const PANICS: &str = "cap:in=media:text;out=media:panics";
    const REQUESTS: usize = 3_000;
    let switch = Switch::builder().start();
    let (s1, h1) = socket_pair();
    let host = Host::new("enders")
        .handler(UPPER, |mut request| async move {
            let input = request.read_all().await;
            let _ = request
                .respond("output", "media:upper", [input.to_ascii_uppercase()])
                .await;
            let _ = request.end().await;
        })
        .handler(SILENT, |mut request| async move {
            let _ = request.read_all().await;
        })
        .handler(PANICS, |_request| async move {
            panic!("a handler that panics (expected in this test)");
        });
    let handle = host.handle();
    let serving = tokio::spawn(host.serve(h1));
    switch.add_master("enders", s1).await.expect("verified");
    for i in 0..REQUESTS {
        let cap = [UPPER, SILENT, PANICS][i % 3];
        let answered = answer(&switch, cap, b"abc").await;
        match cap {
            UPPER => assert_eq!(answered.expect("answered"), b"ABC"),
            _ => assert!(answered.is_err(), "{cap}: ended with an error"),
        }
    }
    let state = handle.state().await.expect("serving");
    assert_eq!(state.machine_requests, 0, "{state:?}");
    assert_eq!(state.handlers_running, 0, "{state:?}");
    assert_eq!(state.stats.requests, REQUESTS as u64, "{state:?}");
    assert_eq!(state.stats.ended, REQUESTS as u64, "{state:?}");
    assert_eq!(state.stats.abandoned, 2 * REQUESTS as u64 / 3, "{state:?}");
    switch.close().await;
    let _ = serving.await;
}

/// What a switch says first: its POLICY.
fn hello() -> Frame {
    NetworkPolicy::Full.to_frame()
}

fn encoded(frames: &[Frame]) -> Vec<u8> {
    let mut out = Vec::new();
    for frame in frames {
        frame.encode(1 << 20, &mut out).expect("encodes");
    }
    out
}

/// A REQ that repeats the key of a live request would orphan it (its handler and its input):
/// the host refuses it as a protocol error, counted, and hangs up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_req_key_is_refused_and_the_connection_cut() {
    let (mut fake, h1) = socket_pair();
    let host = Host::new("waits").handler(UPPER, |mut request| async move {
        // Never answers while its input is open.
        let _ = request.read_all().await;
        std::future::pending::<()>().await;
    });
    let serving = tokio::spawn(host.serve(h1));
    let mut req = Frame::new(FrameType::Req, MessageId::Uint(7));
    req.routing_id = Some(MessageId::Uint(1));
    req.cap = Some(UPPER.to_owned());
    fake.write_all(&encoded(&[hello(), req.clone(), req]))
        .await
        .expect("write");
    match serving.await.expect("serve returned") {
        Err(HostServeError::Protocol(why)) => {
            assert!(why.to_string().contains("repeats the key"), "{why}");
        }
        other => panic!("{other:?}"),
    }
}

/// A switch that never sends its POLICY, or sends it and then goes silent, holds the host only until
/// the machine's deadline (virtual time: no test waits for it).
#[tokio::test(start_paused = true)]
async fn a_switch_that_never_sends_its_policy_or_goes_silent_is_given_up() {
    let (_quiet, h1) = socket_pair();
    let started = tokio::time::Instant::now();
    match Host::new("waits").serve(h1).await {
        Err(HostServeError::Protocol(ProtocolFault::Broken(why))) => {
            assert!(why.to_string().contains("POLICY"), "{why}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        started.elapsed().as_millis(),
        u128::from(tether_core::limits::SWITCH_HANDSHAKE_TIMEOUT_MS)
    );

    // A switch that heartbeats is held to silence (one that never does, as capdag's, is not).
    let (mut silent, h2) = socket_pair();
    let beat = Frame::new(FrameType::Heartbeat, MessageId::Uint(1));
    silent
        .write_all(&encoded(&[hello(), beat]))
        .await
        .expect("write");
    let started = tokio::time::Instant::now();
    match Host::new("waits").serve(h2).await {
        Err(HostServeError::Protocol(ProtocolFault::Broken(why))) => {
            assert!(why.to_string().contains("silent"), "{why}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        started.elapsed().as_millis(),
        u128::from(
            tether_core::limits::SWITCH_HEARTBEAT_INTERVAL_MS
                + tether_core::limits::SWITCH_HEARTBEAT_TIMEOUT_MS
        )
    );
}

/// A write waiting for credit when the switch cancels its request is answered `Gone` and not
/// kept (before, it stayed parked and its handler waited on it for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_waiting_for_credit_is_released_when_its_request_is_cancelled() {
    let (mut fake, h1) = socket_pair();
    let (outcome_tx, outcome) = tokio::sync::oneshot::channel();
    let outcome_tx = std::sync::Mutex::new(Some(outcome_tx));
    let window = Limits {
        initial_credit: 1,
        ..Limits::default()
    };
    let host = Host::new("parks")
        .limits(window)
        .handler(UPPER, move |request| {
            let outcome_tx = outcome_tx.lock().expect("lock").take();
            async move {
                // One chunk of credit: the second chunk waits for more, which never comes.
                let written = request
                    .respond("output", "media:upper", [b"a".to_vec(), b"b".to_vec()])
                    .await;
                if let Some(tx) = outcome_tx {
                    let _ = tx.send(written);
                }
            }
        });
    let handle = host.handle();
    let serving = tokio::spawn(host.serve(h1));
    let hello = hello();
    let mut req = Frame::new(FrameType::Req, MessageId::Uint(7));
    req.routing_id = Some(MessageId::Uint(1));
    req.cap = Some(UPPER.to_owned());
    let mut end = Frame::new(FrameType::End, MessageId::Uint(7));
    end.routing_id = Some(MessageId::Uint(1));
    end.seq = 1;
    fake.write_all(&encoded(&[hello, req, end]))
        .await
        .expect("write");
    // The handler's first chunk went out and its second waits; then the switch cancels,
    // asking for a wind-down rather than a kill.
    // Each look at the host's state is a command the host answers in turn, after what it
    // was already doing: the loop ends once the second chunk waits.
    let state = loop {
        let state = handle.state().await.expect("serving");
        if state.parked_writes == 1 {
            break state;
        }
        tokio::task::yield_now().await;
    };
    assert_eq!(state.machine_requests, 1);
    let mut cancel = Frame::new(FrameType::Cancel, MessageId::Uint(7));
    cancel.routing_id = Some(MessageId::Uint(1));
    cancel.force_kill = Some(false);
    fake.write_all(&encoded(&[cancel])).await.expect("write");
    assert_eq!(
        outcome.await.expect("the handler finished"),
        Err(HostServeError::Gone)
    );
    let state = handle.state().await.expect("serving");
    assert_eq!(
        (
            state.machine_requests,
            state.handlers_running,
            state.parked_writes
        ),
        (0, 0, 0),
        "{state:?}"
    );
    drop(fake);
    let _ = serving.await;
}

/// A master that floods LOG frames to an engine call that reads none: the switch hands the
/// call at most its share of unread LOG bytes and drops the rest, counted; what passed arrives
/// in order with the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_frames_an_engine_does_not_read_are_bounded_in_bytes() {
    use tether_core::limits::SWITCH_LOG_UNREAD_BYTES_PER_REQUEST_MAX;
    const LOGS: usize = 200;
    let switch = Switch::builder().start();
    let (s1, h1) = socket_pair();
    let host = Host::new("chatty").handler(UPPER, |mut request| async move {
        let _ = request.read_all().await;
        for n in 0..LOGS {
            let mut log = Frame::new(FrameType::Log, MessageId::Uint(0));
            log.payload = Some(vec![b'x'; 4096].into());
            log.meta = None;
            log.seq = n as u64;
            let _ = request.write(log).await;
        }
        let _ = request.end().await;
    });
    let serving = tokio::spawn(host.serve(h1));
    switch.add_master("chatty", s1).await.expect("verified");
    let mut call = switch.request(UPPER).await.expect("routed");
    call.finish().await.expect("input ends");
    // The request ends at the switch (its END forwarded to the call) before the call reads.
    loop {
        let stats = switch.protocol_stats().await.expect("stats");
        if stats.requests.is_empty() && stats.table.registered > 0 {
            break;
        }
        tokio::task::yield_now().await;
    }
    let dropped = switch
        .protocol_stats()
        .await
        .expect("stats")
        .switch
        .engine_logs_dropped as usize;
    let mut passed = 0;
    while let Some(frame) = call.next().await {
        if frame.frame_type == FrameType::Log {
            passed += 1;
        }
    }
    assert_eq!(passed + dropped, LOGS, "{passed} passed, {dropped} dropped");
    assert!(dropped > 0, "the flood passed its bound");
    let bytes = 4096 + std::mem::size_of::<Frame>();
    assert!(
        passed * bytes <= SWITCH_LOG_UNREAD_BYTES_PER_REQUEST_MAX,
        "{passed}"
    );
    assert!(
        (passed + 1) * bytes > SWITCH_LOG_UNREAD_BYTES_PER_REQUEST_MAX,
        "{passed}"
    );
    switch.close().await;
    let _ = serving.await;
}
