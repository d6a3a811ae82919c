//! Helpers shared by the integration tests.

use tether::node::Node;

/// Waits until `condition` holds, checking it again each time `node`'s connection state moves
/// ([`Node::changes`]): driven by the node's events, never by a timer or a spin.
pub(crate) async fn until_changed(node: &Node, mut condition: impl FnMut() -> bool) {
    let mut changes = node.changes();
    while !condition() {
        changes.changed().await.expect("the node is alive");
    }
}
