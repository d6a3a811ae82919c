//! Inbound links are bounded: a dialer proving ever new peer ids gets at most `max_peers`
//! tasks (a link is judged only once its proof verifies; one that does not is dropped before
//! any task), and a task whose link ended with nothing durable goes away. Also: the builder
//! refuses to start without an auth or an authorize choice.

use std::io;

use bytes::BytesMut;
use tether::substrate::transport::{AcceptQueue, BoxFuture};
use tether::substrate::{
    AllowAll, Auth, Authorizer, BuildError, Link, PeerId, Substrate, Transport,
};
use tether_core::substrate::handshake::{Channel, Handshake, Progress, Role};
use tether_core::substrate::{capabilities, Config};
use tether_core::time::Time;
use tether_core::wire::envelope::EnvelopeDecoder;
use tether_core::wire::StreamDecoder;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
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
        source: None,
    };
    tx.try_send((PeerId::new(id), link)).expect("accepting");
    ours
}

/// Runs the dialer's side of the handshake as `id` with the substrate's key, until both
/// proofs are through (or the substrate hung up).
async fn prove(stream: &mut DuplexStream, id: &str) {
    let auth = Auth::SharedKey(b"k".to_vec());
    let caps = capabilities(&auth, Vec::new(), Config::default().receive_window);
    let channel = Channel {
        conn_id: id.as_bytes().to_vec(),
        binding: Vec::new(),
    };
    let mut handshake =
        Handshake::start(Time::ZERO, Role::Dialer, auth, caps, channel, vec![1; 16]);
    let mut decoder = StreamDecoder::new(EnvelopeDecoder);
    loop {
        let mut out = BytesMut::new();
        while let Some(frame) = handshake.poll_transmit() {
            frame.encode(&mut out).expect("encodes");
        }
        if stream.write_all(&out).await.is_err() {
            return;
        }
        let mut buf = BytesMut::with_capacity(4096);
        if stream.read_buf(&mut buf).await.unwrap_or(0) == 0 {
            return;
        }
        decoder.push(&buf);
        while let Some(frame) = decoder.pop().expect("the substrate's frames") {
            if let Progress::Ready(_) = handshake.handle_frame(Time::ZERO, &frame).expect("valid") {
                // Our proof may still be queued behind theirs.
                let mut out = BytesMut::new();
                while let Some(frame) = handshake.poll_transmit() {
                    frame.encode(&mut out).expect("encodes");
                }
                let _ = stream.write_all(&out).await;
                return;
            }
        }
    }
}

/// Waits until the substrate has judged `count` inbound links in all.
async fn settled(substrate: &Substrate, count: u64) {
    substrate
        .links_settled()
        .wait_for(|settled| *settled >= count)
        .await
        .expect("the substrate is running");
}

#[tokio::test]
async fn a_flood_of_made_up_ids_gets_at_most_max_peers_tasks() {
    let (substrate, tx) = substrate(4);
    let mut streams = Vec::new();
    for i in 0..20 {
        let id = format!("evil-{i}");
        let mut stream = link(&tx, &id);
        prove(&mut stream, &id).await;
        streams.push(stream);
    }
    settled(&substrate, 20).await;
    let counts = substrate.link_counts();
    assert_eq!(
        (counts.verified, counts.bound, counts.at_cap),
        (20, 4, 16),
        "{counts:?}"
    );
    assert_eq!(substrate.peers().len(), 4);

    // A link that proves nothing is dropped before any task, whatever id it claims.
    let mut liar = link(&tx, "evil-0");
    liar.write_all(&[0xff; 64]).await.expect("write");
    settled(&substrate, 21).await;
    assert_eq!(substrate.link_counts().failed, 1);
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
    prove(&mut fresh, "later").await;
    settled(&substrate, 22).await;
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
