//! `PeerLink`: two machines over a byte pipe, handshake first, then ops.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use tether_core::substrate::handshake::{Auth, Channel, HandshakeError, Role};
use tether_core::substrate::{
    AllowAll, Authorizer, Config, Event, LinkClose, Machine, PeerId, PeerLink,
};
use tether_core::time::Time;
use tether_core::wire::envelope::ObjKind;

/// A link whose machine offers receive window `window`.
fn peer(name: &str, auth: Auth, window: u64, boot: u64) -> PeerLink {
    let config = Config {
        receive_window: window,
        ..Config::default()
    };
    let machine = Machine::new(
        PeerId::new(name),
        config,
        Arc::new(Authorizer::new(AllowAll)),
        boot,
    );
    PeerLink::new(machine, auth, vec!["dedupe".to_owned()])
}

fn channel(conn: &[u8]) -> Channel {
    Channel {
        conn_id: conn.to_vec(),
        binding: b"binding".to_vec(),
    }
}

/// Moves every frame each side has, and commits every persist batch, until quiet.
fn pump(now: Time, a: &mut PeerLink, b: &mut PeerLink) {
    while step(now, a, b) | step(now, b, a) {}
}

/// Commits `from`'s batches and moves its frames to `to`; whether anything moved.
fn step(now: Time, from: &mut PeerLink, to: &mut PeerLink) -> bool {
    let mut moved = false;
    while let Some(batch) = from.machine_mut().poll_persist() {
        from.machine_mut().handle_persisted(now, batch.id);
        moved = true;
    }
    let mut out = BytesMut::new();
    while from.poll_transmit(&mut out) {}
    if !out.is_empty() {
        // Split the bytes at an odd place to exercise reassembly.
        let bytes = out.freeze();
        let cut = bytes.len() / 3;
        to.handle_bytes(now, bytes.slice(..cut));
        to.handle_bytes(now, bytes.slice(cut..));
        moved = true;
    }
    moved
}

fn events(link: &mut PeerLink) -> Vec<Event> {
    std::iter::from_fn(|| link.poll_event()).collect()
}

#[test]
fn shared_key_handshake_then_exactly_once_delivery() {
    let now = Time::ZERO;
    let key = Auth::SharedKey(b"correct horse".to_vec());
    let mut a = peer("b", key.clone(), 32, 1);
    let mut b = peer("a", key, 4, 2);
    a.link_up(now, Role::Dialer, channel(b"conn-1"), vec![1; 16]);
    b.link_up(now, Role::Listener, channel(b"conn-1"), vec![2; 16]);
    pump(now, &mut a, &mut b);
    assert!(a.is_up() && b.is_up());
    let negotiated = a.negotiated().expect("up").clone();
    assert_eq!(
        negotiated.limits.window, 4,
        "minimum of the two receive windows"
    );
    assert_eq!(b.negotiated(), Some(&negotiated));

    a.machine_mut()
        .open(now, ObjKind::Queue, "jobs", None)
        .expect("open");
    pump(now, &mut a, &mut b);
    assert!(matches!(
        events(&mut b).as_slice(),
        [Event::OpenRequested { obj, .. }] if obj == "jobs"
    ));
    b.machine_mut().accept(now, "jobs").expect("accept");
    for i in 0..10u8 {
        a.machine_mut()
            .send(now, "jobs", Bytes::from(vec![i]))
            .expect("send");
    }
    // B's app consumes what it is given; B's window of 4 paces A (credit flow control).
    let mut bodies = Vec::new();
    for _ in 0..10 {
        pump(now, &mut a, &mut b);
        let delivered: Vec<_> = events(&mut b)
            .into_iter()
            .filter_map(|event| match event {
                Event::Delivered(op) => Some(op),
                _ => None,
            })
            .collect();
        assert!(delivered.len() <= 4, "never more than B's window at once");
        for op in delivered {
            bodies.push(op.body.expect("body")[0]);
            b.machine_mut().consume(now, &op.obj, op.seq);
        }
    }
    assert_eq!(bodies, (0..10).collect::<Vec<u8>>());
    let acked = events(&mut a)
        .iter()
        .filter(|event| matches!(event, Event::Acked { .. }))
        .count();
    assert_eq!(acked, 11, "the open and ten sends");
}

#[test]
fn wrong_key_closes_both_sides_with_auth_failed_and_sends_no_op() {
    let now = Time::ZERO;
    let mut a = peer("b", Auth::SharedKey(b"one".to_vec()), 32, 1);
    let mut b = peer("a", Auth::SharedKey(b"two".to_vec()), 32, 2);
    a.machine_mut()
        .open(now, ObjKind::Queue, "jobs", None)
        .expect("open");
    a.link_up(now, Role::Dialer, channel(b"c"), vec![1; 16]);
    b.link_up(now, Role::Listener, channel(b"c"), vec![2; 16]);
    pump(now, &mut a, &mut b);
    // The first side to check a proof closes; the other never sees a valid proof and is
    // never up (its shell sees the connection end).
    assert!(!a.is_up() && !b.is_up());
    let closes = [a.poll_close(), b.poll_close()];
    assert!(closes.contains(&Some(LinkClose::Handshake {
        code: "auth_failed",
        error: HandshakeError::BadProof
    })));
    assert!(
        events(&mut b).is_empty(),
        "no op crossed an unauthenticated link"
    );
}

#[test]
fn different_connection_ids_break_the_proof() {
    let now = Time::ZERO;
    let mut a = peer("b", Auth::TransportIdentity, 32, 1);
    let mut b = peer("a", Auth::TransportIdentity, 32, 2);
    a.link_up(now, Role::Dialer, channel(b"conn-a"), vec![1; 16]);
    b.link_up(now, Role::Listener, channel(b"conn-b"), vec![2; 16]);
    pump(now, &mut a, &mut b);
    assert!(!a.is_up() && !b.is_up());
    assert!(matches!(a.poll_close(), Some(LinkClose::Handshake { .. })));
}

#[test]
fn a_silent_peer_fails_the_handshake_after_its_budget() {
    let mut a = peer("b", Auth::None, 32, 1);
    a.link_up(Time::ZERO, Role::Dialer, channel(b"c"), vec![1; 16]);
    let due = a.poll_timeout().expect("the proof budget");
    assert_eq!(due, Time::from_millis(5_000));
    a.handle_timeout(due);
    assert!(matches!(
        a.poll_close(),
        Some(LinkClose::Handshake {
            error: HandshakeError::Timeout,
            ..
        })
    ));
}

#[test]
fn garbage_during_the_handshake_closes_the_link() {
    let mut a = peer("b", Auth::None, 32, 1);
    a.link_up(Time::ZERO, Role::Dialer, channel(b"c"), vec![1; 16]);
    // A frame header declaring 16 MiB: over the frame bound, fatal.
    a.handle_bytes(Time::ZERO, Bytes::from_static(&[1, 0, 0, 0, 1]));
    assert!(matches!(a.poll_close(), Some(LinkClose::Decode(_))));
    assert!(!a.is_up());
}

#[test]
fn reconnect_resends_unacked_ops_after_a_new_handshake() {
    let now = Time::ZERO;
    let auth = Auth::SharedKey(b"k".to_vec());
    let mut a = peer("b", auth.clone(), 32, 1);
    let mut b = peer("a", auth, 32, 2);
    a.link_up(now, Role::Dialer, channel(b"1"), vec![1; 16]);
    b.link_up(now, Role::Listener, channel(b"1"), vec![2; 16]);
    pump(now, &mut a, &mut b);
    a.machine_mut()
        .open(now, ObjKind::Queue, "q", None)
        .expect("open");
    pump(now, &mut a, &mut b);
    b.machine_mut().accept(now, "q").expect("accept");
    pump(now, &mut a, &mut b);
    // The link drops with a send in flight: b never sees it.
    a.machine_mut()
        .send(now, "q", Bytes::from_static(b"x"))
        .expect("send");
    while let Some(batch) = a.machine_mut().poll_persist() {
        a.machine_mut().handle_persisted(now, batch.id);
    }
    let mut lost = BytesMut::new();
    while a.poll_transmit(&mut lost) {}
    assert!(!lost.is_empty());
    a.link_down(now);
    b.link_down(now);
    a.link_up(now, Role::Dialer, channel(b"2"), vec![3; 16]);
    b.link_up(now, Role::Listener, channel(b"2"), vec![4; 16]);
    pump(now, &mut a, &mut b);
    let delivered: Vec<_> = events(&mut b)
        .into_iter()
        .filter(|event| matches!(event, Event::Delivered(_)))
        .collect();
    assert_eq!(delivered.len(), 1);
}
