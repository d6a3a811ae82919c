//! The TCP substrate under a preamble flood, over real sockets on 127.0.0.1. A preamble names
//! who the dialer claims to be; nothing it claims is trusted before the link's proof verifies.
//! Before, each preamble created a peer task and detached the claimed peer's live link: one
//! every 100 ms kept A and B apart without the key, and 1,100 with fresh ids filled the peer
//! table so genuine peers were locked out.

use std::net::SocketAddr;

use tether::substrate::transport::write_preamble;
use tether::substrate::{
    AllowAll, Auth, Authorizer, Inbound, PeerId, PeerKeys, Substrate, TcpTransport,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const FRESH_IDS: usize = 1_100;
const CLAIMS_OF_ALICE: usize = 50;

async fn node(name: &str, keys: &[(&str, &[u8])]) -> (Substrate, TcpTransport) {
    let transport = TcpTransport::bind(PeerId::new(name), "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind");
    let keys = PeerKeys::new(keys.iter().map(|(peer, key)| (*peer, key.to_vec())));
    let substrate = Substrate::builder(PeerId::new(name), transport.clone())
        .auth(Auth::PeerKeys(keys))
        .authorize(Authorizer::new(AllowAll))
        .max_peers(16)
        .start()
        .expect("start");
    (substrate, transport)
}

/// Accepts every open and consumes every message of `substrate`'s inbound.
fn serve(substrate: &Substrate) {
    let mut inbound = substrate.inbound().expect("inbound");
    tokio::spawn(async move {
        while let Some(item) = inbound.recv().await {
            match item {
                Inbound::Open(open) => open.accept().await.expect("accept"),
                Inbound::Message(message) => message.done(),
                _ => {}
            }
        }
    });
}

/// A dialer that claims `claimed` and then sends `after`; returns once bob hung up.
async fn claim(bob: SocketAddr, claimed: &str, after: &[u8]) {
    let mut stream = TcpStream::connect(bob).await.expect("connect");
    write_preamble(
        &mut stream,
        &PeerId::new(claimed),
        &PeerId::new("bob"),
        [7; 16],
    )
    .await
    .expect("preamble");
    let _ = stream.write_all(after).await;
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest).await;
}

/// Carol, a genuine peer with bob's key record, opens a queue to bob and has one message acked.
async fn carol_sends_to(bob: SocketAddr) -> Substrate {
    let (carol, carol_transport) = node("carol", &[("bob", b"carol and bob")]).await;
    carol_transport.add_peer(PeerId::new("bob"), bob);
    carol
        .peer(&PeerId::new("bob"))
        .open_queue("work")
        .await
        .expect("opened")
        .send(b"hello".to_vec())
        .await
        .expect("acked");
    carol
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preamble_flood_leaves_the_live_link_up_and_a_genuine_peer_admitted() {
    let (bob, bob_transport) = node(
        "bob",
        &[("alice", b"alice and bob"), ("carol", b"carol and bob")],
    )
    .await;
    serve(&bob);
    let bob_addr = bob_transport.local_addr();
    let (alice, alice_transport) = node("alice", &[("bob", b"alice and bob")]).await;
    alice_transport.add_peer(PeerId::new("bob"), bob_addr);
    let queue = alice
        .peer(&PeerId::new("bob"))
        .open_queue("jobs")
        .await
        .expect("opened");
    for n in 0..10u32 {
        queue.send(n.to_be_bytes().to_vec()).await.expect("acked");
    }
    assert_eq!(bob.link_counts().verified, 1);

    // Without alice's key: claims of alice followed by bytes that are no proof.
    for _ in 0..CLAIMS_OF_ALICE {
        claim(bob_addr, "alice", b"garbage, not a handshake frame").await;
    }
    // Fresh ids without a key record, each dropped before any handshake.
    for i in 0..FRESH_IDS {
        claim(bob_addr, &format!("mallory-{i}"), b"").await;
    }
    let counts = bob.link_counts();
    assert_eq!(counts.failed, CLAIMS_OF_ALICE as u64, "{counts:?}");
    assert_eq!(counts.unknown_peer, FRESH_IDS as u64, "{counts:?}");

    // Alice's link never went down: her next sends are acked on it, no new link verified.
    for n in 10..20u32 {
        queue.send(n.to_be_bytes().to_vec()).await.expect("acked");
    }
    assert_eq!(
        bob.link_counts().verified,
        1,
        "alice never had to reconnect"
    );
    assert_eq!(
        bob.peers(),
        vec![PeerId::new("alice")],
        "no task for a claim"
    );

    // A genuine new peer is admitted.
    let carol = carol_sends_to(bob_addr).await;
    assert_eq!(bob.link_counts().verified, 2);
    let mut peers = bob.peers();
    peers.sort();
    assert_eq!(peers, vec![PeerId::new("alice"), PeerId::new("carol")]);
    for node in [alice, bob, carol] {
        node.shutdown().await;
    }
}

/// Connects to `bob` from 127.0.0.2 (another loopback address: another source), claims
/// `claimed`, and stays silent: the returned stream keeps the handshake in progress.
async fn silent_claim_from_elsewhere(bob: SocketAddr, claimed: &str) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.2:0".parse().expect("addr"))
        .expect("bind 127.0.0.2");
    let mut stream = socket.connect(bob).await.expect("connect");
    write_preamble(
        &mut stream,
        &PeerId::new(claimed),
        &PeerId::new("bob"),
        [9; 16],
    )
    .await
    .expect("preamble");
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_links_from_one_source_leave_handshake_slots_for_everyone_else() {
    use tether::substrate::SUBSTRATE_HANDSHAKES_IN_PROGRESS_MAX;
    const SILENT: usize = 100;
    let share = SUBSTRATE_HANDSHAKES_IN_PROGRESS_MAX / 4;
    let (bob, bob_transport) = node(
        "bob",
        &[("alice", b"alice and bob"), ("carol", b"carol and bob")],
    )
    .await;
    serve(&bob);
    let bob_addr = bob_transport.local_addr();
    // Claims of a peer bob knows, then silence: each would hold a handshake slot for the
    // whole proof budget. One source gets its share; the rest are refused at once.
    let mut silent = Vec::new();
    for _ in 0..SILENT {
        silent.push(silent_claim_from_elsewhere(bob_addr, "alice").await);
    }
    // Every one judged: refused (settled at once), in progress, or (on a slow machine) out
    // of its proof budget already.
    let mut settled = bob.links_settled();
    settled
        .wait_for(|_| {
            let counts = bob.link_counts();
            counts.busy as usize + counts.in_progress + counts.failed as usize == SILENT
        })
        .await
        .expect("alive");
    let counts = bob.link_counts();
    assert_eq!(
        (counts.in_progress + counts.failed as usize, counts.busy),
        (share, (SILENT - share) as u64),
        "one source holds its share, no more: {counts:?}"
    );
    // Carol, from another source, is admitted while every silent link is still open.
    let carol = carol_sends_to(bob_addr).await;
    let counts = bob.link_counts();
    assert_eq!(counts.verified, 1, "{counts:?}");
    assert_eq!(
        counts.busy,
        (SILENT - share) as u64,
        "carol was never refused: {counts:?}"
    );
    drop(silent);
    for node in [bob, carol] {
        node.shutdown().await;
    }
}
