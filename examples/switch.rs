//! An engine and two hosts in one process, joined by a request switch over Unix sockets.
//!
//! `upper` serves `cap:in=media:text;out=media:upper`; `shout` serves
//! `cap:in=media:text;out=media:shout` by calling `upper` through the switch (a peer request)
//! and adding an exclamation mark. The engine asks for both.
//!
//! Run with `cargo run -p tether --example switch`.

use tether::switch::host::Host;
use tether::switch::{ErrorClass, Switch};
use tokio::net::UnixStream;

const UPPER: &str = "cap:in=media:text;out=media:upper";
const SHOUT: &str = "cap:in=media:text;out=media:shout";

fn socket_pair() -> std::io::Result<(UnixStream, UnixStream)> {
    let (a, b) = std::os::unix::net::UnixStream::pair()?;
    a.set_nonblocking(true)?;
    b.set_nonblocking(true)?;
    Ok((UnixStream::from_std(a)?, UnixStream::from_std(b)?))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let upper = Host::new("upper").handler(UPPER, |mut request| async move {
        let text = request.read_all().await;
        let _ = request
            .respond("out", "media:upper", [text.to_ascii_uppercase()])
            .await;
        let _ = request.end().await;
    });
    let shout = Host::new("shout").handler(SHOUT, |mut request| async move {
        let text = request.read_all().await;
        // A peer request: the switch routes it to whichever host serves `upper`.
        let Ok(call) = request.peer_request(UPPER).await else {
            let _ = request
                .fail("NO_UPPER", ErrorClass::Environment, "no host serves upper")
                .await;
            return;
        };
        let _ = call.send_stream("in", "media:text", [text]).await;
        let _ = call.finish().await;
        let mut loud = call.collect().await.unwrap_or_default();
        loud.push(b'!');
        let _ = request.respond("out", "media:shout", [loud]).await;
        let _ = request.end().await;
    });

    let switch = Switch::builder().start();
    let (switch_side, host_side) = socket_pair()?;
    tokio::spawn(upper.serve(host_side));
    switch.add_master("upper", switch_side).await?;
    let (switch_side, host_side) = socket_pair()?;
    tokio::spawn(shout.serve(host_side));
    switch.add_master("shout", switch_side).await?;
    println!("caps: {:?}", switch.capabilities().await);

    for (cap, text) in [(UPPER, "hello"), (SHOUT, "hello")] {
        let call = switch.request(cap).await?;
        call.send_stream("in", "media:text", [text.as_bytes().to_vec()])
            .await?;
        call.finish().await?;
        let answer = call.collect().await?;
        println!("{cap} {text:?} -> {:?}", String::from_utf8_lossy(&answer));
    }
    let stats = switch.protocol_stats().await?;
    println!(
        "requests registered: {}, live now: {}",
        stats.table.registered,
        stats.requests.len()
    );
    switch.close().await;
    Ok(())
}
