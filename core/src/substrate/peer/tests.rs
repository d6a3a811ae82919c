//! The peer machine from its inputs: loads, dials, commits, their retries, and commands
//! waiting for room.

use super::*;
use crate::substrate::handshake::{Auth, Channel};
use crate::substrate::{AllowAll, Authorizer, Config, Seq};
use crate::wire::envelope::ObjKind;
use bytes::BytesMut;

const T0: Time = Time::from_millis(1_000);

fn link(id: &str) -> PeerLink {
    let authorizer = Arc::new(Authorizer::new(AllowAll));
    let machine = Machine::new(PeerId::new(id), Config::default(), authorizer, 7);
    PeerLink::new(machine, Auth::None, Vec::new())
}

fn outputs(peer: &mut Peer) -> Vec<Output> {
    std::iter::from_fn(|| peer.poll_output()).collect()
}

fn without_stats(outputs: Vec<Output>) -> Vec<Output> {
    outputs
        .into_iter()
        .filter(|output| *output != Output::PublishStats)
        .collect()
}

fn loaded(named: bool, dialable: bool) -> Peer {
    let mut peer = Peer::new(PeerId::new("b"), named, dialable, 42);
    assert_eq!(outputs(&mut peer), [Output::Load]);
    peer.handle_loaded(T0, Ok(link("b")));
    peer
}

fn channel() -> Channel {
    Channel {
        conn_id: b"a-b".to_vec(),
        binding: Vec::new(),
    }
}

fn open(obj: &str) -> Command {
    Command::Open {
        kind: ObjKind::Queue,
        obj: obj.into(),
        cap: None,
    }
}

fn dials(outputs: &[Output]) -> Vec<u32> {
    outputs
        .iter()
        .filter_map(|output| match output {
            Output::Dial { attempt } => Some(*attempt),
            _ => None,
        })
        .collect()
}

/// Moves frames both ways between `peer` (bound under `generation`) and a listener's
/// link until neither has more.
fn pump(peer: &mut Peer, listener: &mut PeerLink, now: Time, generation: u64) {
    loop {
        let (mut out, mut back) = (BytesMut::new(), BytesMut::new());
        while peer.poll_transmit(&mut out) {}
        if !out.is_empty() {
            listener.handle_bytes(now, out.freeze());
        }
        while listener.poll_transmit(&mut back) {}
        if back.is_empty() {
            return;
        }
        peer.handle_link_bytes(now, generation, back.freeze());
    }
}

#[test]
fn a_failing_load_is_retried_with_backoff_and_commands_fail_meanwhile() {
    let mut peer = Peer::new(PeerId::new("b"), true, true, 42);
    assert_eq!(outputs(&mut peer), [Output::Load]);
    assert!(!peer.finished(), "a peer loading is not idle");
    assert!(
        !peer.hears_commands(),
        "commands wait for the load in flight"
    );
    let mut now = T0;
    for failures in 1..=5 {
        peer.handle_loaded(now, Err(StoreFault));
        let failed = Output::StoreFailed {
            call: StoreCall::Load,
            failures,
        };
        assert_eq!(outputs(&mut peer), [failed]);
        assert!(
            peer.hears_commands(),
            "while the retry waits, commands are refused"
        );
        peer.handle_command(now, 9, open("q"));
        let refused = Output::Reply {
            ticket: 9,
            reply: Reply::Failed(Failure::StoreUnavailable),
        };
        assert_eq!(outputs(&mut peer), [refused]);
        let due = peer.poll_timeout().expect("a load retry is scheduled");
        let ceiling = STORE_RETRY.ceiling(failures - 1);
        let wait = due.saturating_since(now);
        assert!(
            wait >= ceiling / 2 && wait <= ceiling,
            "{wait:?} vs {ceiling:?}"
        );
        peer.handle_timeout(Time::from_millis(due.as_millis() - 1));
        assert!(outputs(&mut peer).is_empty(), "not before it is due");
        peer.handle_timeout(due);
        assert_eq!(outputs(&mut peer), [Output::Load]);
        assert_eq!(peer.poll_timeout(), None, "one load at a time");
        now = due;
    }
    peer.handle_loaded(now, Ok(link("b")));
    let out = outputs(&mut peer);
    assert_eq!(
        out[0],
        Output::StoreRecovered {
            call: StoreCall::Load
        }
    );
    // Loaded with an address known: it dials at once.
    assert_eq!(peer.poll_timeout(), Some(now));
    peer.handle_timeout(now);
    assert_eq!(dials(&outputs(&mut peer)), [0]);
}

#[test]
fn failed_dials_back_off_and_a_link_that_comes_up_resets_the_backoff() {
    let mut peer = loaded(true, true);
    for attempt in 0..6 {
        let now = peer.poll_timeout().expect("a dial is scheduled");
        peer.handle_timeout(now);
        assert_eq!(dials(&outputs(&mut peer)), [attempt]);
        peer.handle_timeout(now);
        assert!(dials(&outputs(&mut peer)).is_empty(), "one dial at a time");
        assert_eq!(peer.poll_timeout(), None, "nothing due while it dials");
        peer.handle_dialed(now, Err(DialFailed));
        let ceiling = REDIAL.ceiling(attempt);
        let wait = peer.poll_timeout().expect("redial").saturating_since(now);
        assert!(
            wait >= ceiling / 2 && wait <= ceiling,
            "{wait:?} vs {ceiling:?}"
        );
    }
    let due = peer.poll_timeout().expect("a dial is scheduled");
    peer.handle_timeout(due);
    assert_eq!(dials(&outputs(&mut peer)), [6]);
    let dialed = Dialed {
        channel: channel(),
        nonce: vec![1; 16],
    };
    peer.handle_dialed(due, Ok(dialed));
    let generation = peer.generation();
    assert!(outputs(&mut peer).contains(&Output::Bind { generation }));
    let mut listener = link("a");
    listener.link_up(due, Role::Listener, channel(), vec![2; 16]);
    pump(&mut peer, &mut listener, due, generation);
    assert!(listener.is_up());
    assert!(outputs(&mut peer)
        .iter()
        .any(|output| matches!(output, Output::LinkUp(_))));
    // Bytes of an older connection are not this link's.
    peer.handle_link_bytes(due, generation - 1, Bytes::from_static(b"\xff\xff\xff"));
    assert!(peer.link().is_some_and(PeerLink::is_up));

    // The link is lost: the redial starts from the base again.
    peer.handle_link_closed(due, generation);
    assert_eq!(without_stats(outputs(&mut peer)), [Output::Unbind]);
    let wait = peer.poll_timeout().expect("redial").saturating_since(due);
    assert!(wait <= REDIAL.ceiling(0));
    // Its end reported twice changes nothing.
    peer.handle_link_closed(due, generation);
    assert!(without_stats(outputs(&mut peer)).is_empty());
}

#[test]
fn a_failed_commit_goes_again_first_after_a_backoff_and_commits_take_turns() {
    let mut peer = loaded(true, false);
    let _ = outputs(&mut peer);
    let commits = |outputs: &[Output]| -> Vec<Vec<BatchIdOf>> {
        outputs
            .iter()
            .filter_map(|output| match output {
                Output::Commit(batches) => Some(batches.iter().map(|b| b.id).collect()),
                _ => None,
            })
            .collect()
    };
    peer.handle_command(T0, 1, open("q"));
    let first = commits(&outputs(&mut peer));
    assert_eq!(first.len(), 1, "the open is persisted before it is sent");
    // While that commit is in flight, the next batch waits for it.
    peer.handle_command(T0, 2, open("r"));
    assert_eq!(commits(&outputs(&mut peer)), Vec::<Vec<BatchIdOf>>::new());
    assert!(!peer.finished());

    peer.handle_committed(T0, Err(StoreFault));
    let failed = Output::StoreFailed {
        call: StoreCall::Commit,
        failures: 1,
    };
    assert_eq!(without_stats(outputs(&mut peer)), [failed]);
    let due = peer.poll_timeout().expect("a store retry");
    let wait = due.saturating_since(T0);
    assert!(wait <= STORE_RETRY.ceiling(0) && wait >= STORE_RETRY.ceiling(0) / 2);
    peer.handle_timeout(due);
    let again = commits(&outputs(&mut peer));
    assert_eq!(again.len(), 1);
    assert_eq!(
        again[0][..first[0].len()],
        first[0][..],
        "the failed batches first"
    );
    assert!(again[0].len() > first[0].len(), "then the ones that waited");
    peer.handle_committed(due, Ok(()));
    let recovered = Output::StoreRecovered {
        call: StoreCall::Commit,
    };
    assert!(outputs(&mut peer).contains(&recovered));
}

#[test]
fn a_reply_the_app_leaves_unread_past_its_bound_fails_and_the_rest_is_dropped() {
    let mut peer = loaded(true, false);
    let _ = outputs(&mut peer);
    // A req of this side's: its id is one the machine mints.
    let boot = peer.machine().expect("loaded").boot();
    let answered = |verb: Verb, body: &[u8]| Event::Answered {
        obj: Address::parse("s").expect("an address"),
        req_id: OpId::from_words(boot, 1),
        verb,
        body: Some(Bytes::copy_from_slice(body)),
        code: None,
    };
    let replies = |peer: &mut Peer| -> Vec<Reply> {
        outputs(peer)
            .into_iter()
            .filter_map(|output| match output {
                Output::Reply { ticket: 7, reply } => Some(reply),
                _ => None,
            })
            .collect()
    };
    peer.waiters.insert(1, Waiter::Req(7));
    let part = vec![0u8; 64 * 1024];
    let size = part.len() + SUBSTRATE_REPLY_PART_OVERHEAD_BYTES;
    let fit = SUBSTRATE_REPLY_BYTES_MAX / size;
    // A reader that keeps up is never cut off, however long the answer.
    for _ in 0..fit * 3 {
        peer.event(answered(Verb::Res, &part));
        assert_eq!(replies(&mut peer), [Reply::Res(Bytes::from(part.clone()))]);
        peer.handle_reply_read(7, part.len());
        assert_eq!(peer.reply_unread(7), 0);
    }
    // The reader stops: parts are handed out up to the bound, and the one past it ends
    // the request with a typed failure.
    for held in 1..=fit {
        peer.event(answered(Verb::Res, &part));
        assert_eq!(replies(&mut peer).len(), 1);
        assert_eq!(peer.reply_unread(7), held * size);
    }
    peer.event(answered(Verb::Res, &part));
    assert_eq!(
        replies(&mut peer),
        [Reply::Failed(Failure::ReplyTooLarge(
            SUBSTRATE_REPLY_BYTES_MAX
        ))]
    );
    assert_eq!(peer.reply_unread(7), 0, "nothing is held for it any more");
    // The rest of that answer, its end included, reaches nobody.
    peer.event(answered(Verb::Res, &part));
    peer.event(answered(Verb::End, b"end"));
    assert!(replies(&mut peer).is_empty());
    // A late read of a part the app had already taken changes nothing.
    peer.handle_reply_read(7, part.len());
    assert_eq!(peer.reply_unread(7), 0);
}

#[test]
fn links_from_peers_nobody_named_start_work_only_under_the_cap_and_never_while_closing() {
    use Admission::{Refused, Running, Start};
    // (origin, closing, running, peers, max) -> admission
    let cases = [
        (Origin::Link, false, false, 3, 4, Start),
        (Origin::Link, false, false, 4, 4, Refused(Refusal::PeerCap)),
        (Origin::Link, false, false, 9, 4, Refused(Refusal::PeerCap)),
        (Origin::Link, false, true, 4, 4, Running),
        (Origin::Link, true, true, 1, 4, Refused(Refusal::Closing)),
        (Origin::Link, true, false, 0, 4, Refused(Refusal::Closing)),
        (Origin::App, false, false, 4, 4, Start),
        (Origin::App, true, false, 9, 4, Start),
        (Origin::App, false, true, 4, 4, Running),
        (Origin::Link, false, false, 0, 0, Refused(Refusal::PeerCap)),
    ];
    for (origin, closing, running, peers, max, want) in cases {
        assert_eq!(
            admit(origin, closing, running, peers, max),
            want,
            "{origin:?} closing={closing} running={running} {peers}/{max}"
        );
    }
}

#[test]
fn a_peer_started_for_a_link_waits_for_it_after_loading_and_ends_if_it_never_comes() {
    let mut peer = Peer::new(PeerId::new("b"), false, false, 42).awaiting_link();
    assert_eq!(outputs(&mut peer), [Output::Load]);
    peer.handle_loaded(T0, Ok(link("b")));
    assert!(
        !peer.finished(),
        "loaded and idle, but the link it was started for is on its way"
    );
    let by = T0.saturating_add(Duration::from_millis(SUBSTRATE_ADOPT_WAIT_MS));
    assert_eq!(peer.timers().adopt, Some(by));
    assert_eq!(peer.poll_timeout(), Some(by));
    peer.handle_timeout(Time::from_millis(by.as_millis() - 1));
    assert!(!peer.finished(), "not before the wait ends");
    peer.handle_timeout(by);
    assert!(peer.finished(), "the link never came: the peer is idle");
    assert_eq!(peer.timers().adopt, None);
    // A peer the app started (or one the shell did not mark) is idle once loaded.
    assert!(loaded(false, false).finished());
}

type BatchIdOf = crate::substrate::BatchId;

#[test]
fn an_address_learned_while_loading_is_dialed_once_loaded_and_a_reach_dials_now() {
    // Started for a peer found in the store: nobody named it, no address yet.
    let mut peer = Peer::new(PeerId::new("b"), false, false, 42);
    assert_eq!(outputs(&mut peer), [Output::Load]);
    // The app adds the address and names the peer while the load is in flight.
    peer.handle_reachability(true, true);
    peer.handle_loaded(T0, Ok(link("b")));
    assert_eq!(peer.timers().redial, Some(T0));
    peer.handle_timeout(T0);
    assert_eq!(dials(&outputs(&mut peer)), [0]);

    // Loaded first, the address learned after: the app's reach dials at once.
    let mut peer = loaded(false, false);
    assert_eq!(peer.timers().redial, None);
    peer.handle_reachability(true, true);
    peer.handle_reach(T0);
    assert_eq!(peer.timers().redial, Some(T0));
}

#[test]
fn a_peer_ends_when_idle_and_shutdown_commits_once_then_fails_what_waits() {
    // Named by nobody, no address, nothing to do: its work is over.
    let peer = loaded(false, false);
    assert!(peer.finished());
    let mut peer = loaded(true, false);
    assert!(!peer.finished(), "the app named it");
    peer.handle_reachability(false, true);
    assert!(!peer.finished(), "it can be dialed");
    peer.handle_reachability(false, false);
    assert!(peer.finished());

    let mut peer = loaded(true, false);
    let _ = outputs(&mut peer);
    peer.handle_command(T0, 1, open("q"));
    let _ = outputs(&mut peer);
    peer.handle_command(T0, 2, open("r"));
    peer.handle_shutdown(T0);
    assert!(!peer.accepts_commands());
    assert!(!peer.finished(), "a commit is in flight");
    peer.handle_command(T0, 3, open("s"));
    let refused = Output::Reply {
        ticket: 3,
        reply: Reply::Failed(Failure::Shutdown),
    };
    assert!(outputs(&mut peer).contains(&refused));
    peer.handle_committed(T0, Ok(()));
    let next = outputs(&mut peer);
    assert!(
        next.iter().any(|o| matches!(o, Output::Commit(_))),
        "what waited"
    );
    peer.handle_committed(T0, Err(StoreFault));
    assert!(peer.finished(), "a failure at shutdown is not retried");
    peer.finish(T0);
    let out = outputs(&mut peer);
    for ticket in [1, 2] {
        let failed = Output::Reply {
            ticket,
            reply: Reply::Failed(Failure::Shutdown),
        };
        assert!(out.contains(&failed), "open {ticket} fails: {out:?}");
    }
}

/// Answers every commit the peer asks for with success; how many it asked for.
fn commit_all(peer: &mut Peer, now: Time) -> usize {
    let mut commits = 0;
    loop {
        let asked = outputs(peer)
            .iter()
            .any(|output| matches!(output, Output::Commit(_)));
        if !asked {
            return commits;
        }
        commits += 1;
        peer.handle_committed(now, Ok(()));
    }
}

/// The listener's store commits everything it was given.
fn listener_commits(listener: &mut PeerLink, now: Time) {
    let machine = listener.machine_mut();
    if let Some(last) = std::iter::from_fn(|| machine.poll_persist()).last() {
        machine.handle_persisted(now, last.id);
    }
}

/// Moves frames both ways, the listener committing as it goes and the peer's commits
/// answered at once.
fn settle(peer: &mut Peer, listener: &mut PeerLink, now: Time, generation: u64) -> usize {
    let mut commits = 0;
    loop {
        let (mut out, mut back) = (BytesMut::new(), BytesMut::new());
        commits += commit_all(peer, now);
        while peer.poll_transmit(&mut out) {}
        let sent = !out.is_empty();
        if sent {
            listener.handle_bytes(now, out.freeze());
        }
        listener_commits(listener, now);
        while listener.poll_transmit(&mut back) {}
        if back.is_empty() && !sent {
            return commits;
        }
        peer.handle_link_bytes(now, generation, back.freeze());
    }
}

/// The seqs of queue `q` the peer delivered and its app has not consumed, in order.
fn pending_seqs(peer: &Peer) -> Vec<Seq> {
    let machine = peer.machine().expect("loaded");
    machine
        .pending_deliveries()
        .iter()
        .map(|op| op.seq)
        .collect()
}

/// The peer's app consumes delivery `seq` of queue `q`.
fn consume(peer: &mut Peer, now: Time, seq: Seq) {
    let obj = Address::parse("q").expect("an address");
    peer.handle_command(now, 2, Command::Consume { obj, seq });
}

/// The listener's app sends `n` messages on queue `q`.
fn send_on_q(listener: &mut PeerLink, n: usize) {
    for _ in 0..n {
        listener
            .machine_mut()
            .send(T0, "q", Bytes::from_static(b"m"))
            .expect("outbox room");
    }
}

/// The peer's dial ends in a connection to `listener` (nonces `nonce` and `nonce + 1`):
/// bound under the generation returned, its handshake not run yet.
fn dialed_to(peer: &mut Peer, listener: &mut PeerLink, now: Time, nonce: u8) -> u64 {
    peer.handle_dialed(
        now,
        Ok(Dialed {
            channel: channel(),
            nonce: vec![nonce; 16],
        }),
    );
    listener.link_up(now, Role::Listener, channel(), vec![nonce + 1; 16]);
    peer.generation()
}

/// A peer (receive window `window`) whose dial is bound to a listener, which opened queue `q`
/// and saw it accepted; the peer's commits answered and the listener's made at once.
fn queue_from_listener(window: u64) -> (Peer, PeerLink, u64) {
    let link = |id: &str| {
        let config = Config {
            receive_window: window,
            ..Config::default()
        };
        let machine = Machine::new(
            PeerId::new(id),
            config,
            Arc::new(Authorizer::new(AllowAll)),
            7,
        );
        PeerLink::new(machine, Auth::None, Vec::new())
    };
    let mut peer = Peer::new(PeerId::new("b"), true, true, 42);
    assert_eq!(outputs(&mut peer), [Output::Load]);
    peer.handle_loaded(T0, Ok(link("b")));
    let _ = outputs(&mut peer);
    let mut listener = link("a");
    let generation = dialed_to(&mut peer, &mut listener, T0, 1);
    settle(&mut peer, &mut listener, T0, generation);
    assert!(listener.is_up());
    listener
        .machine_mut()
        .open(T0, ObjKind::Queue, "q", None)
        .expect("opens");
    settle(&mut peer, &mut listener, T0, generation);
    peer.handle_command(
        T0,
        1,
        Command::Decide {
            obj: Address::parse("q").expect("an address"),
            reject: None,
        },
    );
    settle(&mut peer, &mut listener, T0, generation);
    (peer, listener, generation)
}

#[test]
fn consumption_nothing_waits_on_is_held_back_until_an_urgent_commit_a_pile_or_its_deadline() {
    // A window wide enough for a pile of held consumptions.
    let (mut peer, mut listener, generation) =
        queue_from_listener(4 * SUBSTRATE_LAZY_COMMIT_BATCHES_MAX as u64);
    // Arrivals are committed at once: their acks wait for it.
    send_on_q(&mut listener, 3);
    assert!(settle(&mut peer, &mut listener, T0, generation) >= 1);
    let seqs = pending_seqs(&peer);
    assert_eq!(seqs.len(), 3);
    // One more arrives and is committed, but its ack is lost with the connection.
    send_on_q(&mut listener, 1);
    listener_commits(&mut listener, T0);
    let mut out = BytesMut::new();
    while listener.poll_transmit(&mut out) {}
    peer.handle_link_bytes(T0, generation, out.freeze());
    assert_eq!(commit_all(&mut peer, T0), 1);
    // A consumption is held back, with its deadline as a timer.
    let now = T0.saturating_add(Duration::from_millis(1));
    consume(&mut peer, now, seqs[0]);
    assert_eq!(commit_all(&mut peer, now), 0, "nothing waits on it");
    let deadline = now.saturating_add(LAZY_COMMIT);
    assert_eq!(peer.timers().commit, Some(deadline));
    assert_eq!(peer.poll_timeout(), Some(deadline));
    assert!(!peer.finished());
    // An ack re-served for a duplicate waits for the held batch: that makes it urgent.
    listener.link_down(now);
    peer.handle_link_closed(now, generation);
    let _ = outputs(&mut peer);
    let generation = dialed_to(&mut peer, &mut listener, now, 3);
    assert_eq!(
        settle(&mut peer, &mut listener, now, generation),
        1,
        "the resent op is acked again after the held batch, so that is committed"
    );
    assert_eq!(peer.timers().commit, None);
    // Alone, it goes at its deadline, not before.
    consume(&mut peer, now, seqs[1]);
    assert_eq!(commit_all(&mut peer, now), 0);
    peer.handle_timeout(Time::from_millis(deadline.as_millis() - 1));
    assert_eq!(commit_all(&mut peer, now), 0, "not before its deadline");
    peer.handle_timeout(deadline);
    assert_eq!(commit_all(&mut peer, deadline), 1);
    // An arrival takes what is held along in its own commit.
    consume(&mut peer, deadline, seqs[2]);
    assert_eq!(commit_all(&mut peer, deadline), 0);
    send_on_q(&mut listener, 1);
    assert_eq!(settle(&mut peer, &mut listener, deadline, generation), 1);
    assert_eq!(peer.timers().commit, None);
    // A pile of held batches goes at once.
    send_on_q(&mut listener, SUBSTRATE_LAZY_COMMIT_BATCHES_MAX);
    settle(&mut peer, &mut listener, deadline, generation);
    let pending = pending_seqs(&peer);
    assert!(pending.len() > SUBSTRATE_LAZY_COMMIT_BATCHES_MAX);
    let (last, pile) = pending.split_last().expect("deliveries");
    for (n, seq) in pile.iter().enumerate() {
        consume(&mut peer, deadline, *seq);
        let commits = commit_all(&mut peer, deadline);
        let expected = usize::from(n + 1 == SUBSTRATE_LAZY_COMMIT_BATCHES_MAX);
        assert_eq!(commits, expected, "consumption {n}");
    }
    let later = deadline.saturating_add(LAZY_COMMIT);
    peer.handle_timeout(later);
    commit_all(&mut peer, later);
    // Shutting down commits what is held at once.
    consume(&mut peer, later, *last);
    assert_eq!(commit_all(&mut peer, later), 0);
    peer.handle_shutdown(later);
    assert_eq!(commit_all(&mut peer, later), 1);
    assert!(peer.finished());
}

#[test]
fn a_credit_update_the_sender_does_not_wait_for_is_held_back_and_one_it_waits_for_is_not() {
    let (mut peer, mut listener, generation) = queue_from_listener(8);
    // Seven of the eight seqs of credit used: the sender still has one.
    send_on_q(&mut listener, 7);
    settle(&mut peer, &mut listener, T0, generation);
    let held = pending_seqs(&peer);
    assert_eq!(held.len(), 7);
    // Consuming four is news worth half a window, but nobody waits on it: held back.
    let credits = peer.machine().expect("loaded").stats().credits_sent;
    for seq in &held[..4] {
        consume(&mut peer, T0, *seq);
    }
    assert_eq!(
        peer.machine().expect("loaded").stats().credits_sent,
        credits + 1
    );
    assert_eq!(
        commit_all(&mut peer, T0),
        0,
        "a lazy credit does not make its batch urgent"
    );
    assert!(peer.timers().commit.is_some());
    // The sender's next op is committed at once, and the credit goes with it: the sender,
    // told of four more seqs, sends them without any timer firing.
    send_on_q(&mut listener, 5);
    settle(&mut peer, &mut listener, T0, generation);
    assert_eq!(
        pending_seqs(&peer).len(),
        3 + 5,
        "all five arrived on the credit"
    );
    assert_eq!(peer.timers().commit, None);
    // Now every seq it was told is used: a consumption's credit is waited for, so it is
    // committed at once.
    send_on_q(&mut listener, 1);
    settle(&mut peer, &mut listener, T0, generation);
    assert_eq!(pending_seqs(&peer).len(), 8, "the sender is out of credit");
    let first = pending_seqs(&peer)[0];
    consume(&mut peer, T0, first);
    assert_eq!(
        commit_all(&mut peer, T0),
        1,
        "the peer waits for this credit"
    );
    settle(&mut peer, &mut listener, T0, generation);
    assert_eq!(pending_seqs(&peer).len(), 8, "the ninth op came on it");
}

#[test]
fn committed_batches_hand_their_buffers_back_while_more_are_outstanding() {
    let (mut peer, mut listener, generation) = queue_from_listener(128);
    // The list of each commit's batches (where it lies in memory).
    // One op at a time: the frames of one read are one step, and a step of a few ops stages
    // more records than a kept buffer may have room for.
    let arrive = |peer: &mut Peer, listener: &mut PeerLink| {
        send_on_q(listener, 1);
        listener_commits(listener, T0);
        let mut out = BytesMut::new();
        while listener.poll_transmit(&mut out) {}
        peer.handle_link_bytes(T0, generation, out.freeze());
        commit_lists(peer)
    };
    let first = arrive(&mut peer, &mut listener);
    assert_eq!(first.len(), 1, "the arrivals' commit");
    // More arrive while it runs: their batches wait for the next commit.
    assert_eq!(arrive(&mut peer, &mut listener), []);
    let spares = |peer: &Peer| peer.machine().expect("loaded").spare_buffers();
    assert_eq!(spares(&peer), (0, 0));
    peer.handle_committed(T0, Ok(()));
    assert!(
        spares(&peer).0 > 0,
        "the committed batches' buffers are kept"
    );
    // So is their list: the batches that waited go to the store at once, and those that
    // arrive meanwhile gather in it (no list grows from nothing again).
    let second = commit_lists(&mut peer);
    assert_eq!(second.len(), 1);
    assert_ne!(second, first);
    assert_eq!(arrive(&mut peer, &mut listener), []);
    peer.handle_committed(T0, Ok(()));
    assert_eq!(commit_lists(&mut peer), first);
    peer.handle_committed(T0, Ok(()));
    commit_all(&mut peer, T0);
    assert!(spares(&peer).0 > 0, "the link is up: more may come");
    assert!(peer.spare_batches.capacity() > 0);
    // The keepalive's timeout finds nothing outstanding and frees them.
    let quiet = peer.poll_timeout().expect("the link's timers");
    peer.handle_timeout(quiet);
    assert_eq!(spares(&peer), (0, 0));
    assert_eq!(peer.spare_batches.capacity(), 0);
}

/// Where the lists of the commits `peer` asks for lie in memory.
fn commit_lists(peer: &mut Peer) -> Vec<*const PersistBatch> {
    outputs(peer)
        .iter()
        .filter_map(|output| match output {
            Output::Commit(batches) => Some(batches.as_ptr()),
            _ => None,
        })
        .collect()
}

/// A peer packing each read with small stray ops (each bounced, each staging records) while
/// this side's store never finishes a commit: reading stops once the waiting batches hold
/// [`SUBSTRATE_UNCOMMITTED_RECORDS_MAX`] records, a read's worth past it at most, long before
/// the batch bound (a read is one batch) would have stopped it.
#[test]
fn a_peer_packing_reads_with_strays_during_an_outage_is_stopped_by_records_held() {
    use crate::limits::{
        SUBSTRATE_READ_CHUNK_BYTES, SUBSTRATE_UNCOMMITTED_BATCHES_MAX,
        SUBSTRATE_UNCOMMITTED_RECORDS_MAX,
    };
    use crate::wire::envelope::{Env, Envelope, Verb};
    let (mut peer, _listener, generation) = queue_from_listener(32);
    let mut next = 0u64;
    let mut stray_read = || {
        let mut read = BytesMut::new();
        while read.len() < SUBSTRATE_READ_CHUNK_BYTES - 256 {
            let mut env = Env::new(Verb::Send);
            env.obj = Some(Address::parse("nowhere").expect("an address"));
            env.id = Some(format!("stray-{next}").as_str().into());
            env.seq = Some(1);
            env.receipt = Some(1);
            Envelope::new(env).encode(&mut read).expect("encodes");
            next += 1;
        }
        read.freeze()
    };
    let held = |peer: &Peer| -> usize {
        peer.uncommitted
            .iter()
            .map(|batch| batch.records.len())
            .sum()
    };
    let mut reads = 0;
    let mut most_in_a_read = 0;
    while peer.reads_link() {
        let before = held(&peer);
        peer.handle_link_bytes(T0, generation, stray_read());
        // The first read's commit is asked for and never answered: the store is stuck.
        let _ = outputs(&mut peer);
        most_in_a_read = most_in_a_read.max(held(&peer).saturating_sub(before));
        reads += 1;
        assert!(
            reads < SUBSTRATE_UNCOMMITTED_BATCHES_MAX,
            "reading never stopped"
        );
    }
    assert!(
        most_in_a_read > 100,
        "a read stages many records: {most_in_a_read}"
    );
    assert!(
        held(&peer) < SUBSTRATE_UNCOMMITTED_RECORDS_MAX + most_in_a_read,
        "{} records held",
        held(&peer)
    );
    assert!(reads < 32, "stopped after {reads} reads");
}

#[test]
fn sends_in_flight_at_shutdown_fail_in_the_order_they_were_issued() {
    let (mut peer, mut listener, generation) = queue_from_listener(64);
    peer.handle_command(T0, 3, open("mine"));
    settle(&mut peer, &mut listener, T0, generation);
    listener.machine_mut().accept(T0, "mine").expect("asked");
    settle(&mut peer, &mut listener, T0, generation);
    // Twelve sends the listener never acks: they wait in the peer's table of sends.
    let tickets: Vec<Ticket> = (100..112).collect();
    for &ticket in &tickets {
        let send = Command::Send {
            obj: ObjName::from(&Address::parse("mine").expect("an address")),
            body: Bytes::from_static(b"m"),
            wait: true,
        };
        peer.handle_command(T0, ticket, send);
    }
    let _ = outputs(&mut peer);
    peer.handle_shutdown(T0);
    commit_all(&mut peer, T0);
    peer.finish(T0);
    let failed: Vec<Ticket> = outputs(&mut peer)
        .into_iter()
        .filter_map(|output| match output {
            Output::Reply {
                ticket,
                reply: Reply::Failed(Failure::Shutdown),
            } => Some(ticket),
            _ => None,
        })
        .collect();
    assert_eq!(failed, tickets);
}

/// A send the outbox has no room for waits in the peer's task with its body, and a `try_send`
/// behind it is refused: the machine hands a refused body back rather than the task keeping a
/// second reference to it. Once acks free room, the waiting send goes, body intact and in
/// order, and is acknowledged.
#[test]
fn a_send_refused_for_room_waits_with_its_body_and_goes_when_acks_free_room() {
    let machine = |id: &str, outbox_ops_max: usize| {
        let config = Config {
            outbox_ops_max,
            ..Config::default()
        };
        Machine::new(
            PeerId::new(id),
            config,
            Arc::new(Authorizer::new(AllowAll)),
            7,
        )
    };
    let mut peer = Peer::new(PeerId::new("b"), true, true, 42);
    assert_eq!(outputs(&mut peer), [Output::Load]);
    peer.handle_loaded(
        T0,
        Ok(PeerLink::new(machine("b", 2), Auth::None, Vec::new())),
    );
    let _ = outputs(&mut peer);
    let mut listener = PeerLink::new(machine("a", 1000), Auth::None, Vec::new());
    let generation = dialed_to(&mut peer, &mut listener, T0, 1);
    settle(&mut peer, &mut listener, T0, generation);
    peer.handle_command(T0, 3, open("mine"));
    settle(&mut peer, &mut listener, T0, generation);
    listener.machine_mut().accept(T0, "mine").expect("asked");
    settle(&mut peer, &mut listener, T0, generation);

    let send = |body: &'static [u8], wait: bool| Command::Send {
        obj: ObjName::from(&Address::parse("mine").expect("an address")),
        body: Bytes::from_static(body),
        wait,
    };
    // Two sends fill the outbox of 2; the third waits for room; a try behind it is refused.
    peer.handle_command(T0, 10, send(b"one", true));
    peer.handle_command(T0, 11, send(b"two", true));
    peer.handle_command(T0, 12, send(b"three", true));
    peer.handle_command(T0, 13, send(b"four", false));
    let replies: Vec<(Ticket, Reply)> = outputs(&mut peer)
        .into_iter()
        .filter_map(|output| match output {
            Output::Reply { ticket, reply } => Some((ticket, reply)),
            _ => None,
        })
        .collect();
    assert_eq!(
        replies,
        [(13, Reply::Failed(CommandError::QueueFull.into()))],
        "only the try is answered yet"
    );

    settle(&mut peer, &mut listener, T0, generation);
    let delivered: Vec<Bytes> = listener
        .machine()
        .pending_deliveries()
        .iter()
        .filter(|op| op.obj.as_str() == "mine" && op.verb == Verb::Send)
        .map(|op| op.body.clone().expect("a body"))
        .collect();
    assert_eq!(delivered, [&b"one"[..], b"two", b"three"]);
    assert!(peer.parked.is_empty(), "nothing waits for room");
}

/// The records of a read of many frames (a window of 32 sends) are staged into the room a
/// committed read of many frames handed back, not into a small buffer grown entry by entry.
#[test]
fn a_read_of_many_frames_stages_into_the_room_an_earlier_one_handed_back() {
    use crate::limits::SUBSTRATE_SPARE_STEP_BUFFER_ENTRIES_MAX;
    let (mut peer, mut listener, generation) = queue_from_listener(128);
    // Where the record buffers of the batches the peer commits lie, and their room.
    let arrive = |peer: &mut Peer, listener: &mut PeerLink| {
        send_on_q(listener, 32);
        listener_commits(listener, T0);
        let mut out = BytesMut::new();
        while listener.poll_transmit(&mut out) {}
        peer.handle_link_bytes(T0, generation, out.freeze());
        let mut buffers = Vec::new();
        for output in outputs(peer) {
            if let Output::Commit(batches) = output {
                let room =
                    |batch: &PersistBatch| (batch.records.as_ptr(), batch.records.capacity());
                buffers.extend(batches.iter().map(room));
            }
        }
        // The read's own batch (others may ride with it: a credit update, say).
        buffers.retain(|&(_, room)| room > SUBSTRATE_SPARE_STEP_BUFFER_ENTRIES_MAX);
        peer.handle_committed(T0, Ok(()));
        buffers
    };
    let first = arrive(&mut peer, &mut listener);
    assert_eq!(first.len(), 1, "one read of many frames: {first:?}");
    settle(&mut peer, &mut listener, T0, generation);
    let second = arrive(&mut peer, &mut listener);
    assert_eq!(second, first, "the read staged into the same room");
}
