//! Connections from the outside world, as an attacker makes them, over real iroh on
//! 127.0.0.1: a flood of connections from a key off the allow-list is refused (before its
//! handshake when as many as the bound are in progress, after it otherwise: which of the two
//! depends on the machine's speed, core's `Handshakes` proves the bound itself) and leaves
//! nothing behind; every refusal is counted once.

mod support;

use tether::node::{Node, ACTOR_ALPN};
use tether_core::limits::QUIC_HANDSHAKES_IN_PROGRESS_MAX;

const CONNECTIONS: usize = 1_000;
/// Attempts in flight at once: past the handshake bound.
const WAVE: usize = 2 * QUIC_HANDSHAKES_IN_PROGRESS_MAX;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_unlisted_connections_is_refused_counted_and_leaves_nothing() {
    let friend = tether::iroh::SecretKey::generate().public();
    let node = Node::builder()
        .allow([*friend.as_bytes()])
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
