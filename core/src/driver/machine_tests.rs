//! Tests of the driver machine (`machine.rs`).

use super::*;
use crate::driver::ask::Ask;

const PEER: NodeId = NodeId([1; 32]);
const STRANGER: NodeId = NodeId([2; 32]);

fn at(millis: u64) -> Time {
    Time::from_millis(millis)
}

/// The dial an open is given (the default dial timeout).
fn dial(ticket: DialTicket) -> Open<&'static str> {
    Open::Dial {
        ticket,
        timeout: Config::default().dial_attempt_timeout,
    }
}

fn driver() -> Driver<&'static str> {
    Driver::new(Config {
        auth: PeerAuth::allow_list([PEER]),
        ..Config::default()
    })
}

#[test]
fn an_input_a_caller_waits_on_is_answered_once_and_no_other_input_answers() {
    let mut d = driver();
    let channel = Channel::Protocol(0);
    d.handle_open(at(0), PEER, Path::Protocol, channel);
    assert_eq!(d.poll_answer(), Some(Answer::Open(Ok(dial(DialTicket(1))))));
    assert_eq!(d.poll_answer(), None, "an answer is taken once");
    d.handle_open(at(0), STRANGER, Path::Protocol, channel);
    assert!(matches!(d.poll_answer(), Some(Answer::Open(Err(_)))));
    d.handle_send(at(0), PEER);
    // The next input's answer replaces one nobody took.
    d.handle_batch(at(0), PEER, 1, false, None);
    assert_eq!(d.poll_answer(), Some(Answer::Batch(None)));
    d.handle_timeout(at(1));
    d.handle_connection_closed(at(1), PEER, channel, Generation::new(7).expect("not 0"));
    assert_eq!(
        d.poll_answer(),
        None,
        "inputs nobody waits on answer nothing"
    );
    d.handle_connected(at(1), PEER, channel, "conn");
    let answer = d.poll_answer().and_then(Answer::cached);
    assert!(matches!(answer, Some(Some(_))), "{answer:?}");
}

#[test]
fn open_dials_a_peer_with_no_connection_and_reuses_a_cached_one() {
    let mut d = driver();
    let channel = Channel::Protocol(0);
    assert_eq!(
        d.ask_open(at(0), PEER, Path::Protocol, channel),
        Ok(dial(DialTicket(1)))
    );
    let generation = d
        .ask_connected(at(0), PEER, channel, "first")
        .expect("cached");
    assert_eq!(
        d.ask_open(at(0), PEER, Path::Protocol, channel),
        Ok(Open::Cached(generation, "first"))
    );
    // Another channel to the same peer has its own connection.
    assert_eq!(
        d.ask_open(at(0), PEER, Path::Actor, Channel::Actor),
        Ok(dial(DialTicket(2)))
    );
}

#[test]
fn open_refuses_a_peer_off_the_list_and_changes_nothing_else() {
    let mut d = driver();
    let refused = d.ask_open(at(0), STRANGER, Path::Protocol, Channel::Protocol(0));
    assert!(refused.is_err());
    assert_eq!(d.refusals().get(Path::Protocol, Direction::Outbound), 1);
    assert!(d.connection(&STRANGER, Channel::Protocol(0)).is_none());
    assert!(d.poll_action().is_none(), "no dial, no stream");
}

#[test]
fn a_malformed_stream_stops_unless_an_actor_stream_can_skip_the_record() {
    let mut d = driver();
    assert_eq!(
        d.ask_stream_fault(at(0), PEER, Channel::Actor, false),
        StreamVerdict::Continue
    );
    assert_eq!(
        d.ask_stream_fault(at(0), PEER, Channel::Actor, true),
        StreamVerdict::Stop(STOP_MALFORMED)
    );
    assert_eq!(d.drops().get(DropReason::MalformedStream), 2);
    // Telemetry and protocol streams have no record to skip to, and carry no frames to
    // count as dropped.
    for channel in [Channel::Telemetry, Channel::Protocol(0)] {
        assert_eq!(
            d.ask_stream_fault(at(1), PEER, channel, false),
            StreamVerdict::Stop(STOP_MALFORMED)
        );
    }
    assert_eq!(d.drops().get(DropReason::MalformedStream), 2);
}

#[test]
fn concurrent_opens_share_one_dial() {
    let mut d = driver();
    let channel = Channel::Telemetry;
    let open = |d: &mut Driver<&'static str>| d.ask_open(at(0), PEER, Path::Telemetry, channel);
    let first = DialTicket(1);
    assert_eq!(open(&mut d), Ok(dial(first)));
    assert_eq!(
        open(&mut d),
        Ok(Open::Wait(first)),
        "the first open's dial is in flight"
    );
    // Its caller went away: the waiter asks again and dials itself.
    let version = d.version();
    d.handle_open_dial_failed(at(1), PEER, channel, first, DialEnd::Abandoned);
    assert_ne!(d.version(), version);
    let second = DialTicket(2);
    assert_eq!(d.ask_open_waited(at(1), PEER, channel, first), dial(second));
    assert_eq!(
        d.ask_open_waited(at(1), PEER, channel, second),
        Open::Wait(second),
        "asked again while its dial is in flight, it waits on"
    );
    let generation = d
        .ask_connected(at(2), PEER, channel, "one")
        .expect("cached");
    assert_eq!(open(&mut d), Ok(Open::Cached(generation, "one")));
    // Its connection is dead: one open dials again, the others wait for it.
    assert_eq!(
        d.ask_open_failed(at(3), PEER, channel, generation),
        dial(DialTicket(3))
    );
    assert_eq!(open(&mut d), Ok(Open::Wait(DialTicket(3))));
    // Another channel, or another peer, has its own dial.
    assert_eq!(
        d.ask_open(at(3), PEER, Path::Protocol, Channel::Protocol(0)),
        Ok(dial(DialTicket(4)))
    );
    d.handle_close(at(4));
    assert_eq!(open(&mut d), Ok(Open::Closed), "nothing opens once closed");
    assert_eq!(
        d.ask_open_waited(at(4), PEER, channel, DialTicket(3)),
        Open::Closed
    );
    assert_eq!(d.opening().count(), 0, "closing forgets dials in flight");
}

#[test]
fn a_failed_dial_fails_each_open_that_waited_on_it_once() {
    let mut d = driver();
    let channel = Channel::Switch;
    let open = |d: &mut Driver<&'static str>| d.ask_open(at(0), PEER, Path::Switch, channel);
    let ticket = DialTicket(1);
    assert_eq!(open(&mut d), Ok(dial(ticket)));
    assert_eq!(open(&mut d), Ok(Open::Wait(ticket)));
    assert_eq!(open(&mut d), Ok(Open::Wait(ticket)));
    // A stale report (another ticket) ends nothing.
    d.handle_open_dial_failed(at(1), PEER, channel, DialTicket(7), DialEnd::Failed);
    assert_eq!(
        d.opening().collect::<Vec<_>>(),
        [(PEER, channel, ticket, 2)]
    );

    d.handle_open_dial_failed(at(2), PEER, channel, ticket, DialEnd::Failed);
    assert_eq!(d.opening().count(), 0);
    assert_eq!(
        d.failed_opens().collect::<Vec<_>>(),
        [(PEER, channel, ticket, 2)]
    );
    // Each waiter hears the failure once, and then nothing of it is left.
    assert_eq!(
        d.ask_open_waited(at(3), PEER, channel, ticket),
        Open::Failed
    );
    assert_eq!(
        d.ask_open_waited(at(3), PEER, channel, ticket),
        Open::Failed
    );
    assert_eq!(d.failed_opens().count(), 0);
    // A new open dials afresh.
    assert_eq!(open(&mut d), Ok(dial(DialTicket(2))));
    // A failed dial nobody waited on is not remembered.
    d.handle_open_dial_failed(at(4), PEER, channel, DialTicket(2), DialEnd::Failed);
    assert_eq!(d.failed_opens().count(), 0);
}

#[test]
fn a_replaced_connection_is_closed_when_dialed_the_same_way_only() {
    let mut d = Driver::new(Config {
        alpns: Alpns {
            switch: Some(b"s".to_vec()),
            substrate: Some(b"u".to_vec()),
            ..Alpns::default()
        },
        ..Config::default()
    });
    let channel = Channel::Switch;
    let alpn = b"s";
    // The peer dials again and again: each older inbound connection is closed.
    assert!(matches!(
        accept(&mut d, at(0), PEER, alpn, "in-1"),
        Dispatch::Switch(_)
    ));
    assert!(d.poll_action().is_none());
    accept(&mut d, at(1), PEER, alpn, "in-2");
    assert_eq!(
        d.poll_action(),
        Some(Action::Close {
            conn: "in-1",
            code: CLOSE_REPLACED
        })
    );
    // Both sides dialed at once: the inbound one is uncached but left open (the peer may
    // have cached it), and the outbound one does not close it either way.
    let out = d
        .ask_connected(at(2), PEER, channel, "out-1")
        .expect("cached");
    assert!(d.poll_action().is_none());
    assert_eq!(d.connection(&PEER, channel), Some((out, "out-1")));
    accept(&mut d, at(3), PEER, alpn, "in-3");
    assert!(d.poll_action().is_none());
    // Another channel is another entry: nothing replaced.
    accept(&mut d, at(4), PEER, b"u", "sub-1");
    assert!(d.poll_action().is_none());
}

#[test]
fn a_liveness_cut_evicts_and_closes_its_generation_only() {
    let mut d = driver();
    let channel = Channel::Switch;
    let old = d
        .ask_connected(at(0), PEER, channel, "old")
        .expect("cached");
    let new = d
        .ask_connected(at(1), PEER, channel, "new")
        .expect("cached");
    // The replaced connection (dialed the same way) is closed.
    assert_eq!(
        d.poll_action(),
        Some(Action::Close {
            conn: "old",
            code: CLOSE_REPLACED
        })
    );
    // A cut on the replaced generation leaves the newer connection alone.
    d.handle_unresponsive(at(2), PEER, channel, old);
    assert_eq!(d.connection(&PEER, channel), Some((new, "new")));
    assert!(d.poll_action().is_none());
    d.handle_unresponsive(at(3), PEER, channel, new);
    assert_eq!(d.connection(&PEER, channel), None);
    assert_eq!(
        d.poll_action(),
        Some(Action::Close {
            conn: "new",
            code: CLOSE_UNRESPONSIVE
        })
    );
    assert_eq!(d.counters().evictions, 1);
    // The next open dials afresh.
    assert!(matches!(
        d.ask_open(at(4), PEER, Path::Switch, channel),
        Ok(Open::Dial { .. })
    ));
}

#[test]
fn waiters_are_counted_out_as_they_leave_and_take_a_connection_that_came_meanwhile() {
    let mut d = Driver::new(Config {
        alpns: Alpns {
            switch: Some(b"s".to_vec()),
            ..Alpns::default()
        },
        ..Config::default()
    });
    let channel = Channel::Switch;
    let open = |d: &mut Driver<&'static str>| d.ask_open(at(0), PEER, Path::Switch, channel);
    let ticket = DialTicket(1);
    assert_eq!(open(&mut d), Ok(dial(ticket)));
    for _ in 0..3 {
        assert_eq!(open(&mut d), Ok(Open::Wait(ticket)));
    }
    // One waiter goes away; a stale ticket's report changes nothing.
    d.handle_open_wait_abandoned(at(1), PEER, channel, ticket);
    d.handle_open_wait_abandoned(at(1), PEER, channel, DialTicket(9));
    assert_eq!(
        d.opening().collect::<Vec<_>>(),
        [(PEER, channel, ticket, 2)]
    );
    // The peer dials us meanwhile: a waiter asking again takes that connection.
    let Dispatch::Switch(generation) = accept(&mut d, at(2), PEER, b"s", "theirs") else {
        panic!("cached");
    };
    assert_eq!(
        d.ask_open_waited(at(3), PEER, channel, ticket),
        Open::Cached(generation, "theirs")
    );
    assert_eq!(
        d.opening().collect::<Vec<_>>(),
        [(PEER, channel, ticket, 1)]
    );
    // Our dial fails: with a connection there, no failure is kept for the last waiter.
    d.handle_open_dial_failed(at(4), PEER, channel, ticket, DialEnd::Failed);
    assert_eq!(d.failed_opens().count(), 0);
    assert_eq!(
        d.ask_open_waited(at(5), PEER, channel, ticket),
        Open::Cached(generation, "theirs")
    );

    // A failure kept for two waiters: one leaves, the other hears it, nothing stays.
    d.handle_connection_closed(at(6), PEER, channel, generation);
    let ticket = DialTicket(2);
    assert_eq!(open(&mut d), Ok(dial(ticket)));
    assert_eq!(open(&mut d), Ok(Open::Wait(ticket)));
    assert_eq!(open(&mut d), Ok(Open::Wait(ticket)));
    d.handle_open_dial_failed(at(7), PEER, channel, ticket, DialEnd::Failed);
    d.handle_open_wait_abandoned(at(8), PEER, channel, ticket);
    assert_eq!(
        d.failed_opens().collect::<Vec<_>>(),
        [(PEER, channel, ticket, 1)]
    );
    assert_eq!(
        d.ask_open_waited(at(9), PEER, channel, ticket),
        Open::Failed
    );
    assert_eq!(d.failed_opens().count(), 0);
    assert_eq!(d.opening().count(), 0);
}

#[test]
fn failed_opens_are_bounded_and_a_connection_clears_them() {
    let mut d: Driver<&'static str> = Driver::new(Config {
        failed_opens_max: 2,
        ..Config::default()
    });
    let peers = [NodeId([1u8; 32]), NodeId([2; 32]), NodeId([3; 32])];
    let channel = Channel::Protocol(0);
    for (n, peer) in peers.iter().enumerate() {
        let ticket = DialTicket(n as u64 + 1);
        assert_eq!(
            d.ask_open(at(0), *peer, Path::Protocol, channel),
            Ok(dial(ticket))
        );
        assert_eq!(
            d.ask_open(at(0), *peer, Path::Protocol, channel),
            Ok(Open::Wait(ticket))
        );
        d.handle_open_dial_failed(at(1), *peer, channel, ticket, DialEnd::Failed);
    }
    // The oldest failure was forgotten: its waiter dials afresh.
    let kept: Vec<_> = d.failed_opens().map(|(peer, ..)| peer).collect();
    assert_eq!(kept, [peers[1], peers[2]]);
    assert_eq!(
        d.ask_open_waited(at(2), peers[0], channel, DialTicket(1)),
        dial(DialTicket(4))
    );
    // A connection to a peer clears its failure: the waiter takes the connection.
    let generation = d
        .ask_connected(at(3), peers[1], channel, "up")
        .expect("cached");
    assert_eq!(
        d.ask_open_waited(at(3), peers[1], channel, DialTicket(2)),
        Open::Cached(generation, "up")
    );
    assert_eq!(d.failed_opens().count(), 1);
}

#[test]
fn switch_and_substrate_connections_are_cached_and_evicted_by_generation() {
    let mut d = Driver::new(Config {
        auth: PeerAuth::allow_list([PEER]),
        alpns: Alpns {
            switch: Some(b"s".to_vec()),
            substrate: Some(b"u".to_vec()),
            ..Alpns::default()
        },
        ..Config::default()
    });
    for (alpn, channel, path) in [
        (&b"s"[..], Channel::Switch, Path::Switch),
        (b"u", Channel::Substrate, Path::Substrate),
    ] {
        let Dispatch::Refused(_) = accept(&mut d, at(0), STRANGER, alpn, "stranger") else {
            panic!("a peer off the list is refused on {channel:?}");
        };
        let accepted = match accept(&mut d, at(0), PEER, alpn, "accepted") {
            Dispatch::Switch(generation) | Dispatch::Substrate(generation) => generation,
            other => panic!("{other:?}"),
        };
        assert_eq!(channel.path(), path);
        // Either side's streams ride the accepted connection.
        assert_eq!(
            d.ask_open(at(1), PEER, path, channel),
            Ok(Open::Cached(accepted, "accepted"))
        );
        // It dies: a fresh one is dialed and cached; the old one's close report is stale.
        assert!(matches!(
            d.ask_open_failed(at(2), PEER, channel, accepted),
            Open::Dial { .. }
        ));
        let dialed = d
            .ask_connected(at(3), PEER, channel, "dialed")
            .expect("cached");
        d.handle_connection_closed(at(4), PEER, channel, accepted);
        assert_eq!(d.connection(&PEER, channel), Some((dialed, "dialed")));
        d.handle_connection_closed(at(5), PEER, channel, dialed);
        assert_eq!(d.connection(&PEER, channel), None);
    }
    assert!(
        !std::iter::from_fn(|| d.poll_action())
            .any(|action| matches!(action, Action::KickWriter { .. })),
        "only actor connections kick a writer"
    );
}

#[test]
fn a_stream_nobody_reads_stops_with_its_own_code_and_keeps_the_connection() {
    let mut d = driver();
    let generation = d
        .ask_connected(at(0), PEER, Channel::Protocol(0), "one")
        .expect("cached");
    let version = d.version();
    for channel in [Channel::Actor, Channel::Telemetry, Channel::Protocol(0)] {
        assert_eq!(
            d.ask_stream_unread(at(1), PEER, channel),
            StreamVerdict::Stop(STOP_UNREAD)
        );
    }
    assert_ne!(
        STOP_UNREAD, STOP_MALFORMED,
        "the peer can tell the two apart"
    );
    assert_eq!(d.drops().get(DropReason::MalformedStream), 0);
    assert_eq!(d.version(), version, "nothing observable changed");
    assert_eq!(
        d.connection(&PEER, Channel::Protocol(0)),
        Some((generation, "one"))
    );
    assert!(d.poll_action().is_none());
}

#[test]
fn a_switch_stream_is_taken_only_when_its_first_bytes_announce_it() {
    use crate::wire::bifaci::QUIC_STREAM_OPENER;
    let mut d = driver();
    let opener = &QUIC_STREAM_OPENER[..];
    assert_eq!(
        d.ask_stream_opener(at(0), PEER, Channel::Switch, Some(opener)),
        StreamVerdict::Continue
    );
    for first in [None, Some(&b"bifaci5\n"[..]), Some(&b"GET / HT"[..])] {
        assert_eq!(
            d.ask_stream_opener(at(0), PEER, Channel::Switch, first),
            StreamVerdict::Stop(STOP_UNREAD),
            "{first:?}"
        );
    }
    assert_eq!(
        d.ask_stream_opener(at(0), PEER, Channel::Substrate, None),
        StreamVerdict::Continue,
        "only switch streams are announced"
    );
    assert!(d.poll_action().is_none());
}

#[test]
fn a_writer_opens_a_stream_on_each_connection_it_writes_to_and_keeps_it() {
    let mut d = driver();
    let first = d
        .ask_connected(at(0), PEER, Channel::Actor, "one")
        .expect("cached");
    let batch = d.ask_batch(at(1), PEER, 3, false, None).expect("cached");
    assert_eq!(
        (batch.generation, batch.conn, batch.open_stream),
        (first, "one", true)
    );
    let batch = d
        .ask_batch(at(2), PEER, 1, false, Some(first))
        .expect("cached");
    assert!(
        !batch.open_stream,
        "the stream on this connection carries on"
    );
    // A newer connection: the stream on the old one is left, a new one opened.
    let second = d
        .ask_connected(at(3), PEER, Channel::Actor, "two")
        .expect("cached");
    let batch = d
        .ask_batch(at(4), PEER, 1, false, Some(first))
        .expect("cached");
    assert_eq!((batch.generation, batch.open_stream), (second, true));
    // No connection: the batch drops and a dial starts.
    d.handle_connection_closed(at(5), PEER, Channel::Actor, second);
    assert!(d.ask_batch(at(6), PEER, 2, false, Some(second)).is_none());
    assert_eq!(d.drops().get(DropReason::CacheMiss), 2);
    assert!(std::iter::from_fn(|| d.poll_action()).any(|a| matches!(a, Action::Dial { .. })));
}

#[test]
fn a_stream_stopped_while_idle_fails_its_generation_and_reports_a_swim_batch() {
    let mut d = driver();
    let generation = d
        .ask_connected(at(0), PEER, Channel::Actor, "one")
        .expect("cached");
    d.ask_batch(at(1), PEER, 2, true, None).expect("cached");
    d.handle_writer_idle(at(2), PEER);
    while d.poll_action().is_some() {}
    d.handle_stream_stopped(at(3), PEER, generation);
    assert!(d.connection(&PEER, Channel::Actor).is_none(), "evicted");
    assert_eq!(d.counters().evictions, 1);
    assert_eq!(
        d.drops().get(DropReason::WriteFailed),
        0,
        "no frame counted again"
    );
    let actions: Vec<_> = std::iter::from_fn(|| d.poll_action()).collect();
    assert!(
        actions.contains(&Action::SendFailed { peer: PEER }),
        "{actions:?}"
    );
    assert!(actions.iter().any(|a| matches!(a, Action::Dial { .. })));

    // After a batch without SWIM frames, a stop of a stale generation only counts.
    let newer = d
        .ask_connected(at(4), PEER, Channel::Actor, "two")
        .expect("cached");
    d.ask_batch(at(5), PEER, 1, false, None).expect("cached");
    while d.poll_action().is_some() {}
    d.handle_stream_stopped(at(6), PEER, generation);
    assert_eq!(
        d.connection(&PEER, Channel::Actor),
        Some((newer, "two")),
        "the newer connection stays"
    );
    assert_eq!(d.counters().stale_failures, 1);
    assert!(d.poll_action().is_none(), "nothing to report");
}

#[test]
fn a_failed_open_evicts_its_generation_only_and_dials_at_most_once() {
    let mut d = driver();
    let channel = Channel::Protocol(3);
    let old = d
        .ask_connected(at(0), PEER, channel, "old")
        .expect("cached");
    assert_eq!(
        d.ask_open_failed(at(1), PEER, channel, old),
        dial(DialTicket(1))
    );
    assert!(
        d.connection(&PEER, channel).is_none(),
        "the dead one is gone"
    );
    assert_eq!(
        d.ask_open(at(2), PEER, Path::Protocol, channel),
        Ok(Open::Wait(DialTicket(1))),
        "the failed open's dial is in flight"
    );

    // A failure seen on an older generation leaves the newer connection cached, and the
    // stream goes there instead.
    let stale = d.ask_connected(at(3), PEER, channel, "a").expect("cached");
    let fresh = d.ask_connected(at(4), PEER, channel, "b").expect("cached");
    assert_ne!(stale, fresh);
    assert_eq!(
        d.ask_open_failed(at(5), PEER, channel, stale),
        Open::Cached(fresh, "b")
    );
    assert_eq!(
        d.ask_open(at(6), PEER, Path::Protocol, channel),
        Ok(Open::Cached(fresh, "b"))
    );
}

#[test]
fn a_connection_that_is_not_kept_is_closed_with_the_code_the_machine_names() {
    let mut d = Driver::new(Config {
        auth: PeerAuth::allow_list([PEER]),
        alpns: Alpns {
            switch: Some(b"s".to_vec()),
            ..Alpns::default()
        },
        ..Config::default()
    });
    let refused = accept(&mut d, at(0), STRANGER, b"s", "stranger");
    assert!(matches!(refused, Dispatch::Refused(_)));
    assert_eq!(
        refused.close(),
        Some((CLOSE_UNAUTHORIZED, &b"unauthorized"[..]))
    );
    let kept = accept(&mut d, at(0), PEER, b"s", "peer");
    assert!(matches!(kept, Dispatch::Switch(_)));
    assert_eq!(kept.close(), None);
    let unknown = accept(&mut d, at(0), PEER, b"no/such/alpn", "peer");
    assert_eq!(unknown, Dispatch::NoAdapter);
    assert_eq!(unknown.close(), Some((CLOSE_SHUTDOWN, &b"no adapter"[..])));
    assert_eq!(Dispatch::Full.close(), Some((CLOSE_FULL, &b"full"[..])));
}

#[test]
fn every_cached_connection_reports_ready_once_and_ended_once_with_its_cause() {
    let mut d = driver();
    let events = |d: &mut Driver<&'static str>| {
        std::iter::from_fn(|| d.poll_conn_event()).collect::<Vec<_>>()
    };
    let ready = |channel, generation, inbound| ConnEvent::Ready {
        peer: PEER,
        channel,
        generation,
        inbound,
    };
    let ended = |channel, generation, cause| ConnEvent::Ended {
        peer: PEER,
        channel,
        generation,
        cause,
    };
    let (switch, actor) = (Channel::Switch, Channel::Actor);
    let first = d.ask_connected(at(0), PEER, switch, "s1").expect("cached");
    assert_eq!(events(&mut d), [ready(switch, first, false)]);
    // A newer connection replaces it; a failure reported for the old one changes nothing.
    let second = d.ask_connected(at(1), PEER, switch, "s2").expect("cached");
    assert_eq!(
        events(&mut d),
        [
            ended(switch, first, ConnEndCause::Replaced),
            ready(switch, second, false)
        ]
    );
    d.handle_connection_closed(at(2), PEER, switch, first);
    assert_eq!(events(&mut d), []);
    d.handle_unresponsive(at(2), PEER, switch, second);
    assert_eq!(
        events(&mut d),
        [ended(switch, second, ConnEndCause::Unresponsive)]
    );
    let third = d.ask_connected(at(3), PEER, switch, "s3").expect("cached");
    d.handle_connection_closed(at(4), PEER, switch, third);
    assert_eq!(
        events(&mut d),
        [
            ready(switch, third, false),
            ended(switch, third, ConnEndCause::Closed)
        ]
    );
    let fourth = d.ask_connected(at(5), PEER, switch, "s4").expect("cached");
    d.handle_disconnect(at(6), PEER, switch);
    assert_eq!(
        events(&mut d),
        [
            ready(switch, fourth, false),
            ended(switch, fourth, ConnEndCause::Disconnected)
        ]
    );
    let a1 = d.ask_connected(at(7), PEER, actor, "a1").expect("cached");
    d.handle_write_failed(at(8), PEER, a1, 1, false);
    assert_eq!(
        events(&mut d),
        [
            ready(actor, a1, false),
            ended(actor, a1, ConnEndCause::WriteFailed)
        ]
    );
    let a2 = d.ask_connected(at(9), PEER, actor, "a2").expect("cached");
    d.handle_close(at(10));
    assert_eq!(
        events(&mut d),
        [
            ready(actor, a2, false),
            ended(actor, a2, ConnEndCause::Shutdown)
        ]
    );
    assert_eq!(d.conn_events_dropped(), 0);
}

#[test]
fn connection_events_nobody_polls_are_bounded() {
    let mut d = driver();
    for n in 0..DRIVER_CONN_EVENTS_QUEUED_MAX as u64 {
        d.ask_connected(at(n), PEER, Channel::Switch, "c")
            .expect("cached");
    }
    // Each connect after the first queued an end (replaced) and a ready.
    assert_eq!(
        d.conn_events_dropped(),
        DRIVER_CONN_EVENTS_QUEUED_MAX as u64 - 1
    );
    assert_eq!(
        std::iter::from_fn(|| d.poll_conn_event()).count(),
        DRIVER_CONN_EVENTS_QUEUED_MAX
    );
}

#[test]
fn a_fresh_connection_that_cannot_open_the_stream_is_evicted_and_not_redialed() {
    let mut d = driver();
    let channel = Channel::Switch;
    assert_eq!(
        d.ask_open(at(0), PEER, Path::Switch, channel),
        Ok(dial(DialTicket(1)))
    );
    let fresh = d
        .ask_connected(at(1), PEER, channel, "fresh")
        .expect("cached");
    let _ = std::iter::from_fn(|| d.poll_conn_event()).count();
    d.handle_fresh_open_failed(at(2), PEER, channel, fresh);
    assert!(d.connection(&PEER, channel).is_none(), "evicted");
    assert!(d.poll_action().is_none(), "no dial of its own");
    assert_eq!(
        std::iter::from_fn(|| d.poll_conn_event()).collect::<Vec<_>>(),
        [ConnEvent::Ended {
            peer: PEER,
            channel,
            generation: fresh,
            cause: ConnEndCause::OpenFailed
        }]
    );
    // The next open dials afresh.
    assert_eq!(
        d.ask_open(at(3), PEER, Path::Switch, channel),
        Ok(dial(DialTicket(2)))
    );
}

/// An accept and its answer (the [`Action::Dispatch`] it queued, taken out of the actions).
fn accept<C: Clone>(d: &mut Driver<C>, now: Time, peer: NodeId, alpn: &[u8], conn: C) -> Dispatch {
    d.handle_accepted(now, peer, alpn, conn);
    d.take_dispatch()
        .expect("an accept is answered with a dispatch")
}

#[test]
fn an_accept_is_answered_by_a_dispatch_action_after_what_its_caching_displaced() {
    let mut d = Driver::new(Config {
        auth: PeerAuth::allow_list([PEER]),
        alpns: Alpns {
            switch: Some(b"s".to_vec()),
            ..Alpns::default()
        },
        ..Config::default()
    });
    d.handle_accepted(at(0), PEER, b"s", "in-1");
    let Some(Action::Dispatch {
        peer,
        conn: "in-1",
        dispatch: Dispatch::Switch(first),
    }) = d.poll_action()
    else {
        panic!("the accept's answer");
    };
    assert_eq!(peer, PEER);
    assert!(d.poll_action().is_none());
    d.handle_accepted(at(1), PEER, b"s", "in-2");
    assert_eq!(
        d.poll_action(),
        Some(Action::Close {
            conn: "in-1",
            code: CLOSE_REPLACED
        })
    );
    let Some(Action::Dispatch {
        conn: "in-2",
        dispatch: Dispatch::Switch(second),
        ..
    }) = d.poll_action()
    else {
        panic!("the second accept's answer, after the close it caused");
    };
    assert!(second > first);
    d.handle_accepted(at(2), STRANGER, b"s", "stranger");
    assert!(matches!(
        d.poll_action(),
        Some(Action::Dispatch {
            conn: "stranger",
            dispatch: Dispatch::Refused(_),
            ..
        })
    ));
}
