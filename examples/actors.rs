//! The actor plane over iroh on 127.0.0.1: length-delimited actor frames to a peer's actor
//! through its bridge (never blocking the sender; one writer per peer drains its queue), and
//! an actor addressed without naming its node, through a signed host claim.
//!
//! Run with `cargo run -p tether --example actors`.

use std::sync::Arc;

use bytes::Bytes;
use tether::node::{ActorAddr, ActorBridge, DeliveryError, Node, OutFrame};
use tokio::sync::mpsc;

const PRINTER: ActorAddr = ActorAddr::new([7; 32]);

/// Where B's node hands the frames addressed to its actors.
struct Printer(mpsc::UnboundedSender<String>);

impl ActorBridge for Printer {
    fn deliver_raw(&self, dest: ActorAddr, tag: &str, payload: Bytes) -> Result<(), DeliveryError> {
        let line = format!(
            "actor {:02x}.. got {tag}: {}",
            dest.as_bytes()[0],
            String::from_utf8_lossy(&payload)
        );
        self.0
            .send(line)
            .map_err(|_| DeliveryError("closed".into()))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (tx, mut printed) = mpsc::unbounded_channel();
    let b = Node::builder()
        .bridge(Arc::new(Printer(tx)))
        .know_tag("Note") // tags this node accepts for its actors
        .bind()
        .await?;
    let a = Node::builder().bind().await?;

    // B hosts the actor and signs a claim for it (generation 1); A, once connected, verifies
    // the claim and can address the actor alone.
    b.register_actor(PRINTER, 1)?;
    a.connect(b.endpoint_addr()).await?;
    let mut changes = a.changes();
    while a.directory_route_count() == 0 {
        changes.changed().await?;
    }

    // To a node and actor by name: queued, never blocks.
    for n in 0..3 {
        a.send(OutFrame {
            to: b.node_id(),
            dest: PRINTER,
            type_tag: "Note".into(),
            payload: Bytes::from(format!("frame {n}")),
        });
    }
    // To the actor wherever its newest claim says it lives.
    a.send_to_actor(
        PRINTER,
        "Note",
        Bytes::from_static(b"found through the route view"),
    )?;
    for _ in 0..4 {
        println!("b: {}", printed.recv().await.expect("delivered"));
    }
    let snapshot = a.snapshot();
    println!(
        "a: {} frames enqueued, {} routes known, {} location cache entries",
        snapshot.frames_enqueued,
        a.directory_route_count(),
        a.location_cache_entries()
    );
    a.close().await;
    b.close().await;
    Ok(())
}
