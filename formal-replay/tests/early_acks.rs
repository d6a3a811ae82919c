//! When the sender reports a hop ack: as soon as it arrives when the peer applied the op in
//! order (this side's forgetting of the op is committed after, off the path), and only after
//! that commit when the peer acked it while holding it out of order (a close there may still
//! discard it, and after a crash here its resend would be answered `closed`).

use tether_core::substrate::harness::{Harness, Party};
use tether_core::substrate::Event;
use tether_formal_replay::substrate::{apply, start, Action, Promises};

fn acked(h: &Harness) -> usize {
    h.a.events
        .iter()
        .filter(|event| matches!(event, Event::Acked { .. }))
        .count()
}

/// Commits everything on both sides and delivers nothing: the opens settle.
fn settled(window: usize) -> Harness {
    let mut h = start(window);
    while h.commit(Party::A) | h.commit(Party::B) {
        h.run();
    }
    h
}

#[test]
fn an_ack_of_an_op_applied_in_order_is_reported_before_its_removal_commits() {
    let mut h = settled(2);
    let (before, early) = (acked(&h), h.a.machine.stats().acks_reported_early);
    for action in [
        Action::Send(0),
        Action::Commit(Party::A),
        Action::Deliver(Party::B, 0),
        Action::Commit(Party::B),
        Action::Deliver(Party::A, 0),
    ] {
        assert!(apply(&mut h, action), "{action:?} applies");
    }
    assert_eq!(acked(&h), before + 1, "reported on arrival");
    assert!(
        !h.a.uncommitted.is_empty(),
        "the removal is not committed yet"
    );
    assert_eq!(h.a.machine.stats().acks_reported_early, early + 1);
    // Dying now brings the op back; it goes out again and is acked again, and nothing
    // else is ever said of it.
    apply(&mut h, Action::Crash(Party::A));
    Promises::judge(&h).expect("promises hold after the crash");
    Promises::judge_healed(&h).expect("and once healed");
}

#[test]
fn an_ack_of_an_op_held_out_of_order_waits_for_its_removal_to_commit() {
    let mut h = settled(2);
    let (before, early) = (acked(&h), h.a.machine.stats().acks_reported_early);
    for action in [
        Action::Send(0),
        Action::Commit(Party::A),
        Action::Send(0),
        Action::Commit(Party::A),
        // The second send arrives first: the peer holds it and acks it.
        Action::Deliver(Party::B, 1),
        Action::Commit(Party::B),
        Action::Deliver(Party::A, 0),
    ] {
        assert!(apply(&mut h, action), "{action:?} applies");
    }
    assert_eq!(
        acked(&h),
        before,
        "not reported while its removal is uncommitted"
    );
    assert_eq!(h.a.machine.stats().acks_reported_early, early);
    while h.commit(Party::A) {}
    assert_eq!(acked(&h), before + 1, "reported once the removal committed");
    // The peer closes, discarding what it held; this side dies; healed, the op has one
    // outcome.
    apply(&mut h, Action::Close);
    apply(&mut h, Action::Crash(Party::A));
    Promises::judge(&h).expect("promises hold");
    Promises::judge_healed(&h).expect("and once healed");
}
