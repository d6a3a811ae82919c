//! A 64 MiB answer streamed from a host through the switch to the engine, under credit, with
//! the process's peak memory measured: credit bounds what is in flight, so the peak grows by a
//! few windows of chunks, not by the answer. (Alone in its own test binary, so the process's
//! peak is this test's.)

use tether::switch::host::Host;
use tether::switch::Switch;
use tether_core::limits::{BIFACI_CHUNK_BYTES_DEFAULT, CREDIT_WINDOW_CHUNKS_DEFAULT};
use tether_core::wire::bifaci::FrameType;
use tether_tests::socket_pair;

const BIG: &str = "cap:in=media:text;out=media:big";
const ANSWER_BYTES: usize = 64 * 1024 * 1024;
const CHUNK_BYTES: usize = BIFACI_CHUNK_BYTES_DEFAULT;

/// The process's peak resident set so far (Linux `VmHWM`), in bytes.
fn peak_rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("procfs");
    let line = status
        .lines()
        .find(|line| line.starts_with("VmHWM:"))
        .expect("VmHWM");
    let kib: usize = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .expect("a number of kB");
    kib * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_64_mib_answer_streams_through_the_switch_in_bounded_memory() {
    let switch = Switch::builder().start();
    let (s1, h1) = socket_pair();
    let host = Host::new("big").handler(BIG, |mut request| async move {
        let _ = request.read_all().await;
        // Made one chunk at a time as credit lets each go.
        let chunks = (0..ANSWER_BYTES / CHUNK_BYTES).map(|n| vec![(n % 251) as u8; CHUNK_BYTES]);
        let _ = request.respond("output", "media:big", chunks).await;
        let _ = request.end().await;
    });
    tokio::spawn(host.serve(h1));
    switch.add_master("big", s1).await.expect("verified");
    let before = peak_rss();

    let mut call = switch.call(BIG, []).await.expect("routed");
    let (mut bytes, mut chunks, mut ended) = (0usize, 0usize, false);
    while let Some(frame) = call.next().await {
        match frame.frame_type {
            FrameType::Chunk => {
                let payload = frame.payload.expect("a chunk carries bytes");
                assert!(
                    payload.iter().all(|b| *b == (chunks % 251) as u8),
                    "chunk {chunks} arrived in order and intact"
                );
                bytes += payload.len();
                chunks += 1;
            }
            FrameType::End => ended = true,
            FrameType::Err => panic!("the answer failed: {frame:?}"),
            _ => {}
        }
    }
    assert!(ended);
    assert_eq!(bytes, ANSWER_BYTES);

    let grown = peak_rss().saturating_sub(before);
    // In flight at once, at most: a window of chunks on each leg (host → switch → engine),
    // the frames being encoded or decoded, and the sockets' buffers.
    let window = CREDIT_WINDOW_CHUNKS_DEFAULT as usize * CHUNK_BYTES;
    println!(
        "peak RSS grew {:.1} MiB streaming {} MiB (window {:.1} MiB)",
        grown as f64 / 1048576.0,
        ANSWER_BYTES / 1048576,
        window as f64 / 1048576.0
    );
    assert!(
        grown < 4 * window,
        "peak memory grew {grown} bytes for a {ANSWER_BYTES}-byte answer (window {window})"
    );
    let stats = switch.protocol_stats().await.expect("stats");
    assert!(stats.requests.is_empty(), "no request state left");
    switch.close().await;
}
