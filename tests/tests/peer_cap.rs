//! Inbound links are bounded: a dialer claiming ever new peer ids gets at most `max_peers`
//! tasks, and a task whose link ended with nothing durable goes away. Also: the builder
//! refuses to start without an auth or an authorize choice.

use std::io;

use tether::substrate::transport::{AcceptQueue, BoxFuture};
use tether::substrate::{
    AllowAll, Auth, Authorizer, BuildError, Link, PeerId, Substrate, Transport,
};
use tether_core::substrate::handshake::Channel;
use tokio::io::{AsyncReadExt, DuplexStream};
use tokio::sync::mpsc;

/// Links handed in by the test.
struct MemTransport {
    inbound: AcceptQueue,
}

impl Transport for MemTransport {
    fn can_dial(&self, _: &PeerId) -> bool {
        false
    }

    fn dial<'a>(&'a self, _: &'a PeerId, _: [u8; 16]) -> BoxFuture<'a, io::Result<Link>> {
        Box::pin(async { Err(io::Error::other("this transport only accepts")) })
    }

    fn accept(&self) -> BoxFuture<'_, io::Result<(PeerId, Link)>> {
        Box::pin(self.inbound.next())
    }
}

fn substrate(max_peers: usize) -> (Substrate, mpsc::Sender<(PeerId, Link)>) {
    let (tx, inbound) = AcceptQueue::new(64);
    let transport = MemTransport { inbound };
    let substrate = Substrate::builder(PeerId::new("me"), transport)
        .auth(Auth::SharedKey(b"k".to_vec()))
        .authorize(Authorizer::new(AllowAll))
        .max_peers(max_peers)
        .seed(1)
        .start()
        .expect("start");
    (substrate, tx)
}

/// Hands the substrate a link claiming `id`; returns the test's end of it.
fn link(tx: &mpsc::Sender<(PeerId, Link)>, id: &str) -> DuplexStream {
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    let link = Link {
        stream: Box::new(theirs),
        channel: Channel {
            conn_id: id.as_bytes().to_vec(),
            binding: Vec::new(),
        },
    };
    tx.try_send((PeerId::new(id), link)).expect("accepting");
    ours
}

/// Whether the substrate served the link (sent its hello) rather than dropping it.
async fn served(stream: &mut DuplexStream) -> bool {
    let mut byte = [0u8; 1];
    stream.read(&mut byte).await.expect("read") == 1
}

#[tokio::test]
async fn a_flood_of_made_up_ids_gets_at_most_max_peers_tasks() {
    let (substrate, tx) = substrate(4);
    let mut streams = Vec::new();
    for i in 0..20 {
        streams.push(link(&tx, &format!("evil-{i}")));
    }
    let mut served_count = 0;
    for stream in &mut streams {
        if served(stream).await {
            served_count += 1;
        }
    }
    assert_eq!(
        served_count, 4,
        "the first four are served, the rest refused"
    );
    assert_eq!(substrate.peers().len(), 4);

    // Their links end with nothing durable: the four tasks go, and a new link is served
    // again.
    let mut ended = substrate.peer_tasks_ended();
    drop(streams);
    ended
        .wait_for(|ended| *ended >= 4)
        .await
        .expect("the substrate is running");
    assert!(substrate.peers().is_empty(), "{:?}", substrate.peers());
    let mut fresh = link(&tx, "later");
    assert!(served(&mut fresh).await, "a link after the tasks ended");
    assert!(substrate.peers().contains(&PeerId::new("later")));
    substrate.shutdown().await;
}

#[tokio::test]
async fn auth_and_authorize_are_required_choices() {
    let transport = || MemTransport {
        inbound: AcceptQueue::new(1).1,
    };
    let no_auth = Substrate::builder(PeerId::new("me"), transport())
        .authorize(Authorizer::new(AllowAll))
        .start();
    assert!(matches!(no_auth, Err(BuildError::AuthRequired)));
    let no_authorize = Substrate::builder(PeerId::new("me"), transport())
        .auth(Auth::None)
        .start();
    assert!(matches!(no_authorize, Err(BuildError::AuthorizeRequired)));
}
