//! Two nodes over iroh on 127.0.0.1, each with its SQLite store: a queue and a session from
//! A to B. Every `send` resolves once the message is durable at B (the hop ack); B's app sees
//! each message once, in order, and calls `done()` when it has consumed it; a request on the
//! session gets B's answer. Then A cuts the link: nothing is lost, the link comes back.
//!
//! Run with `cargo run -p tether --example substrate`.

use std::sync::Arc;

use tether::node::Node;
use tether::store::SqliteStore;
use tether::substrate::{AllowAll, Authorizer, Inbound};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("tether-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;

    // B: a node with the substrate enabled, its state in SQLite, an app that consumes
    // messages and answers requests.
    let b = Node::builder().substrate().bind().await?;
    let b_substrate = b
        .substrate_builder()?
        .store(Arc::new(SqliteStore::open(dir.join("b.sqlite3"))?))
        .authorize(Authorizer::new(AllowAll)) // deny-by-default is the default: say who may
        .start()?;
    let mut inbound = b_substrate.inbound().expect("taken once");
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(item) = inbound.recv().await {
            match item {
                Inbound::Open(open) => {
                    println!(
                        "b: {} opens {:?} {}",
                        &open.peer.as_str()[..8],
                        open.kind,
                        open.obj
                    );
                    let _ = open.accept().await;
                }
                Inbound::Message(message) => {
                    let text = String::from_utf8_lossy(&message.body).into_owned();
                    let _ = seen_tx.send(format!("{} #{}: {text}", message.obj, message.seq));
                    message.done(); // consumed: until this, a restart delivers it again
                }
                Inbound::Request(request) => {
                    let answer = format!("{} bytes", request.body.len());
                    let _ = request.end(answer).await;
                }
                _ => {}
            }
        }
    });

    // A: the same, and it names B by B's address (the transport identity authenticates it).
    let a = Node::builder().substrate().bind().await?;
    let a_substrate = a
        .substrate_builder()?
        .store(Arc::new(SqliteStore::open(dir.join("a.sqlite3"))?))
        .authorize(Authorizer::new(AllowAll))
        .start()?;
    let to_b = a.add_substrate_peer(b.endpoint_addr())?;
    let peer = a_substrate.peer(&to_b);

    let jobs = peer.open_queue("jobs").await?;
    for n in 0..5 {
        let op = jobs.send(format!("job {n}")).await?; // durable at B when this resolves
        println!("a: job {n} durable at b (op {op})");
    }
    let rpc = peer.open_session("rpc").await?;
    let reply = rpc.req("how long is this?").await?;
    println!(
        "a: b answered {:?}",
        String::from_utf8_lossy(reply.end.as_deref().unwrap_or_default())
    );

    // A cut link loses nothing: the next sends wait for the link to come back.
    peer.disconnect();
    for n in 5..8 {
        jobs.send(format!("job {n}")).await?;
    }
    for _ in 0..8 {
        println!("b: {}", seen.recv().await.expect("delivered"));
    }

    a_substrate.shutdown().await;
    b_substrate.shutdown().await;
    a.close().await;
    b.close().await;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
