//! The request switch with hosts over iroh (relay disabled, 127.0.0.1) beside hosts over Unix
//! sockets: the switch's node dials each iroh host with ALPN `tether/switch/1`.

use tether::node::Node;
use tether::switch::host::Host;
use tether::switch::Switch;
use tether_tests::socket_pair;

const UPPER: &str = "cap:in=media:text;out=media:upper";
const REVERSE: &str = "cap:in=media:text;out=media:reversed";
const COUNT: &str = "cap:in=media:text;out=media:count";

fn host(name: &'static str, cap: &str, answer: fn(Vec<u8>) -> Vec<u8>) -> Host {
    Host::new(name).handler(cap, move |mut request| async move {
        let input = request.read_all().await;
        let _ = request.respond("out", "media:text", [answer(input)]).await;
        let _ = request.end().await;
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_routes_to_three_hosts_two_over_unix_one_over_iroh() {
    let host_node = Node::builder()
        .switch_host()
        .bind()
        .await
        .expect("bind host");
    let engine_node = Node::builder().bind().await.expect("bind engine");
    let mut connections = host_node.switch_connections().expect("switch host");
    assert!(host_node.switch_connections().is_none(), "taken once");
    tokio::spawn(async move {
        while let Some((_switch_node, stream)) = connections.recv().await {
            tokio::spawn(
                host("iroh", COUNT, |input| input.len().to_string().into_bytes()).serve(stream),
            );
        }
    });

    let switch = Switch::builder().start();
    let (s1, h1) = socket_pair();
    let (s2, h2) = socket_pair();
    tokio::spawn(host("upper", UPPER, |input| input.to_ascii_uppercase()).serve(h1));
    tokio::spawn(
        host("reverse", REVERSE, |mut input| {
            input.reverse();
            input
        })
        .serve(h2),
    );
    switch.add_master("upper", s1).await.expect("verified");
    switch.add_master("reverse", s2).await.expect("verified");
    let stream = engine_node
        .dial_switch_host(host_node.endpoint_addr())
        .await
        .expect("dialled over iroh");
    switch
        .add_master("iroh", stream)
        .await
        .expect("verified over iroh");

    for (cap, want) in [(UPPER, &b"ABC"[..]), (REVERSE, b"cba"), (COUNT, b"3")] {
        let call = switch.request(cap).await.expect("routed");
        call.send_stream("in", "media:text", [b"abc".to_vec()])
            .await
            .expect("input");
        call.finish().await.expect("input ends");
        assert_eq!(call.collect().await.expect("answered"), want, "{cap}");
    }
    let stats = switch.protocol_stats().await.expect("stats");
    assert_eq!(stats.masters.len(), 3);
    assert!(stats.masters.iter().all(|master| master.healthy));
    assert!(stats.requests.is_empty());
    switch.close().await;
    engine_node.close().await;
    host_node.close().await;
}
