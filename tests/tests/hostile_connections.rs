//! Connections from the outside world, as an attacker makes them, over real iroh on
//! 127.0.0.1: a flood of connections from a key off the allow-list is refused (before its
//! handshake when as many as the bound are in progress, after it otherwise: which of the two
//! depends on the machine's speed, core's `Handshakes` proves the bound itself) and leaves
//! nothing behind; every refusal is counted once. A listed peer that dials again and again
//! holds one connection: each one it replaces is closed.

use crate::support;

use tether::node::{node_id_of, Node, ACTOR_ALPN};
use tether_core::limits::QUIC_HANDSHAKES_IN_PROGRESS_MAX;

const CONNECTIONS: usize = 1_000;
/// Attempts in flight at once: past the handshake bound.
const WAVE: usize = 2 * QUIC_HANDSHAKES_IN_PROGRESS_MAX;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_unlisted_connections_is_refused_counted_and_leaves_nothing() {
    let friend = tether::iroh::SecretKey::generate().public();
    let node = Node::builder()
        .allow([node_id_of(&friend)])
        .bind()
        .await
        .expect("bind");
    let attacker = support::loopback_endpoint().await;
    let target = node.endpoint_addr();
    let mut admitted_by_quic = 0;
    for wave in (0..CONNECTIONS).step_by(WAVE) {
        let attempts: Vec<_> = (wave..(wave + WAVE).min(CONNECTIONS))
            .map(|_| {
                let (attacker, target) = (attacker.clone(), target.clone());
                tokio::spawn(async move {
                    let Ok(conn) = attacker.connect(target, ACTOR_ALPN).await else {
                        return false;
                    };
                    // Past the handshake: the node closes it as soon as it judges the key.
                    let _ = conn.closed().await;
                    true
                })
            })
            .collect();
        for attempt in attempts {
            admitted_by_quic += usize::from(attempt.await.expect("attempt"));
        }
    }
    let snapshot = node.snapshot();
    // Nothing of any of them was admitted or kept.
    assert_eq!(snapshot.accepted, 0, "{snapshot:?}");
    assert_eq!(
        snapshot.cache.len() + snapshot.connections.len(),
        0,
        "{snapshot:?}"
    );
    // Every connection that got through its handshake was refused by the allow-list, once.
    assert_eq!(snapshot.refused, admitted_by_quic as u64, "{snapshot:?}");
    // Every attempt was refused, by the bound or by the allow-list. An attempt refused
    // before its handshake can be counted again: the client's retransmitted first packet
    // arrives as a new incoming connection.
    assert!(
        snapshot.refused + snapshot.handshakes_refused >= CONNECTIONS as u64,
        "{snapshot:?}"
    );
    // Never more handshakes at once than the bound. One whose client already gave up (its
    // retransmission was refused) stays in progress until its deadline, so a few may remain.
    assert!(
        snapshot.handshakes_in_progress <= QUIC_HANDSHAKES_IN_PROGRESS_MAX,
        "{snapshot:?}"
    );
    attacker.close().await;
    node.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_dials_again_and_again_keeps_one_connection_per_channel() {
    let attacker = support::loopback_endpoint().await;
    let node = Node::builder()
        .allow([node_id_of(&attacker.id())])
        .bind()
        .await
        .expect("bind");
    let target = node.endpoint_addr();
    const DIALS: u64 = 64;
    let mut previous: Option<tether::iroh::endpoint::Connection> = None;
    for dial in 1..=DIALS {
        let conn = attacker
            .connect(target.clone(), ACTOR_ALPN)
            .await
            .expect("a listed peer connects");
        // The dialer's handshake can end before the node's: the node takes each connection
        // before the next is dialed, so that they reach it in the order they were made (a late
        // older one would replace a newer one, and the newer one would be closed instead).
        let mut changes = node.changes();
        while node.snapshot().accepted < dial {
            changes.changed().await.expect("alive");
        }
        // The node caches the new connection and closes the one it replaces, as "replaced".
        if let Some(old) = previous.replace(conn) {
            match old.closed().await {
                tether::iroh::endpoint::ConnectionError::ApplicationClosed(close) => {
                    assert_eq!(
                        close.error_code,
                        tether::iroh::endpoint::VarInt::from_u32(
                            tether_core::driver::machine::CLOSE_REPLACED
                        )
                    );
                }
                other => panic!("the replaced connection ended otherwise: {other:?}"),
            }
        }
    }
    let last = previous.expect("connected");
    assert!(last.close_reason().is_none(), "the newest stays open");
    let snapshot = node.snapshot();
    assert_eq!(snapshot.accepted, DIALS, "{snapshot:?}");
    assert_eq!(snapshot.connections.len(), 1, "{snapshot:?}");
    attacker.close().await;
    node.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_inbound_bound_are_refused_and_counted() {
    const KEPT: usize = 4;
    let node = Node::builder()
        .inbound_connections_max(KEPT)
        .bind()
        .await
        .expect("bind");
    let target = node.endpoint_addr();
    let mut peers = Vec::new();
    for _ in 0..2 * KEPT {
        peers.push(support::loopback_endpoint().await);
    }
    let mut kept = Vec::new();
    for (i, peer) in peers.iter().enumerate() {
        let conn = peer
            .connect(target.clone(), ACTOR_ALPN)
            .await
            .expect("handshake");
        if i < KEPT {
            kept.push(conn);
            // Accepted and cached before the next one arrives.
            let mut changes = node.changes();
            while node.snapshot().accepted < (i + 1) as u64 {
                changes.changed().await.expect("alive");
            }
            continue;
        }
        match conn.closed().await {
            tether::iroh::endpoint::ConnectionError::ApplicationClosed(close) => assert_eq!(
                close.error_code,
                tether::iroh::endpoint::VarInt::from_u32(tether_core::driver::machine::CLOSE_FULL)
            ),
            other => panic!("refused otherwise: {other:?}"),
        }
    }
    let snapshot = node.snapshot();
    assert_eq!(snapshot.accepted, KEPT as u64, "{snapshot:?}");
    assert_eq!(snapshot.refused_full, KEPT as u64, "{snapshot:?}");
    assert_eq!(snapshot.connections.len(), KEPT, "{snapshot:?}");
    // A peer that holds a place dials again: its new connection replaces its old one.
    let again = peers[0]
        .connect(target.clone(), ACTOR_ALPN)
        .await
        .expect("handshake");
    assert!(matches!(
        kept[0].closed().await,
        tether::iroh::endpoint::ConnectionError::ApplicationClosed(_)
    ));
    assert!(again.close_reason().is_none());
    assert_eq!(node.snapshot().refused_full, KEPT as u64);
    for peer in peers {
        peer.close().await;
    }
    node.close().await;
}
