//! What an operator sees: `tether node --metrics ADDR` serves the node's metrics in
//! Prometheus text format. After a node sent durable messages and a request to its peer, a
//! scrape shows the hop-ack and answer latency histograms with a count per op, the store's
//! commit histogram, the link that came up, the substrate's and the node's counters.

use std::collections::BTreeMap;

use tether_tests::procs::{next, NodeProc};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

/// A free TCP port on 127.0.0.1.
fn free_tcp_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// `GET /metrics` on `port`: the body.
async fn scrape(port: u16) -> String {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("the metrics endpoint listens");
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .await
        .expect("response");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
}

/// The value of each sample line whose name (labels stripped) is `name`, summed.
fn sum(body: &str, name: &str) -> f64 {
    body.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let metric = series.split('{').next()?;
            (metric == name).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrape_shows_latency_histograms_link_events_and_counters() {
    let tether = std::path::Path::new(env!("CARGO_BIN_EXE_tether-under-test"));
    let dir = std::env::temp_dir().join(format!("tether-metrics-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let data = |who: &str| dir.join(who).display().to_string();
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let a = NodeProc::spawn(
        tether,
        "a",
        1,
        &["--data".into(), data("a")],
        events_tx.clone(),
    )
    .expect("a starts");
    let ticket = loop {
        let event = next(&mut events, "a ready").await;
        if event.kind() == "ready" {
            break event.text("ticket");
        }
    };
    let port = free_tcp_port();
    let b_args = vec![
        "--data".into(),
        data("b"),
        "--metrics".into(),
        format!("127.0.0.1:{port}"),
        "--connect".into(),
        ticket,
    ];
    let mut b = NodeProc::spawn(tether, "b", 1, &b_args, events_tx).expect("b starts");
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    let mut commands = "open queue q\nopen session s\n".to_owned();
    for i in 0..20 {
        commands.push_str(&format!("send q m{i}\n"));
    }
    commands.push_str("req s ping\n");
    b.write(&commands).await.expect("commands");
    while seen.get("acked").copied().unwrap_or(0) < 20 || !seen.contains_key("reply") {
        let event = next(&mut events, "acks and the reply").await;
        assert_ne!(event.kind(), "error", "{:?}", event.value);
        if event.from == "b" {
            *seen.entry(event.kind().to_owned()).or_default() += 1;
        }
    }
    assert_eq!(
        seen.get("metrics"),
        Some(&1),
        "b said where its metrics are"
    );

    let body = scrape(port).await;
    assert_eq!(
        sum(&body, "tether_substrate_ack_latency_ms_count"),
        20.0,
        "one hop-ack latency per message\n{body}"
    );
    assert!(sum(&body, "tether_substrate_ack_latency_ms_sum") > 0.0);
    assert_eq!(sum(&body, "tether_substrate_answer_latency_ms_count"), 1.0);
    assert!(sum(&body, "tether_store_commit_ms_count") >= 1.0);
    assert!(sum(&body, "tether_substrate_conn_ready") >= 1.0, "{body}");
    // The node's own QUIC connection events (the substrate's connection to a, cached).
    assert!(
        body.contains("tether_node_conn_ready{channel=\"substrate\"}"),
        "{body}"
    );
    assert!(
        body.contains("tether_node_frames_enqueued"),
        "the node's counters\n{body}"
    );
    assert!(body.contains("# TYPE tether_substrate_ack_latency_ms histogram"));
    a.quit().await;
    b.quit().await;
    let _ = std::fs::remove_dir_all(&dir);
}
