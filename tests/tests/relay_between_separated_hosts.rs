//! Two `tether node` processes on separated hosts (network namespaces this test builds, see
//! `tether_tests::netns`) that can reach each other only through `tether relay`, iroh's relay
//! server, running on the router between them. The substrate's queue and session, the request
//! switch and a telemetry subscription work over the relayed path; then the router starts
//! forwarding and the connection moves to the direct path; then it stops and the connection
//! goes back to the relay; then the relay is killed and restarted. Across all of it the queue
//! loses, duplicates and reorders nothing. Needs root: elsewhere it says so and skips.

use std::path::Path;

use tether_tests::netns::{self, Pair, Topology};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_relay_then_direct_then_the_relay_again_nothing_lost() {
    if let Some(why) = netns::unavailable() {
        eprintln!("SKIPPED relay_between_separated_hosts: {why}");
        return;
    }
    let topology = Topology::build().expect("the namespaces");
    let dir = std::env::temp_dir().join(format!("tether-netns-relay-{}", std::process::id()));
    let tether = Path::new(env!("CARGO_BIN_EXE_tether-under-test"));
    let mut run = Pair::start(tether, topology, dir).await;

    // 1. The relay is the only path: every plane works over it.
    run.send(50).await;
    run.settle().await;
    assert_eq!(run.via().await, "relay", "no direct path exists yet");
    run.write_b("req s ping\nroute hello\nsubscribe\n").await;
    let answers = run
        .expect_each("b", &["reply", "routed", "subscribed", "telemetry_opened"])
        .await;
    assert_eq!(answers[0].value["answer"].as_str(), Some("re:ping"));
    assert_eq!(answers[1].value["answer"].as_str(), Some("HELLO"));
    let relayed = run.sent();

    // 2. The router starts forwarding: the connection moves to the direct path.
    run.topology().set_forwarding(true).expect("forwarding on");
    let to_direct = run.until_via("direct").await;

    // 3. It stops: the connection goes back to the relay, and nothing is lost meanwhile.
    run.topology()
        .set_forwarding(false)
        .expect("forwarding off");
    let to_relay = run.until_via("relay").await;

    // 4. The relay dies with messages in flight and comes back on the same address.
    run.kill_relay().await;
    run.send(20).await;
    run.start_relay().await;
    run.settle().await;

    // Exactly once, in order, across every path change.
    run.assert_exactly_once_in_order();
    eprintln!(
        "relay_between_separated_hosts: {} messages ({relayed} relayed only; {to_direct} until \
         the direct path, {to_relay} until the relay again, 20 across a relay restart), \
         nothing lost, duplicated or reordered",
        run.sent()
    );
    run.stop().await;
}
