//! The host side of the switch from the outside: a host that changes its handlers while it
//! serves re-advertises its manifest, and a host whose switch stops reading drops the
//! connection at its queue's bound instead of growing memory.

use tether::switch::host::{Host, HostServeError};
use tether::switch::{Switch, SwitchError};
use tether_core::limits::SWITCH_HOST_WRITER_FRAMES_MAX;
use tether_core::switch::{EngineError, Hello, Limits};
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
        Err(SwitchError::Engine(EngineError::NoHandler(LOWER.into())))
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
        Err(SwitchError::Engine(EngineError::NoHandler(LOWER.into())))
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
    let mut hello = Frame::new(FrameType::Hello, MessageId::Uint(0));
    hello.meta = Some(
        Hello {
            limits: Limits::default(),
            manifest: None,
        }
        .to_meta(),
    );
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
