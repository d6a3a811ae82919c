//! The substrate against the model over long random traces: 10,000 traces of up to 60
//! environment actions (sends, commits, reordered, duplicated and lost frames, reconnects,
//! crashes, waits, stray ops), each judged after every step and once healed.

use proptest::prelude::*;
use tether_core::substrate::harness::Party;
use tether_formal_replay::substrate::{replay, Action};

fn node() -> impl Strategy<Value = Party> {
    prop_oneof![Just(Party::A), Just(Party::B)]
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        4 => (0u8..2).prop_map(Action::Send),
        2 => Just(Action::Answer),
        6 => node().prop_map(Action::Commit),
        8 => (node(), 0u8..3).prop_map(|(n, i)| Action::Deliver(n, i)),
        2 => node().prop_map(Action::DeliverAll),
        1 => (node(), 0u8..3).prop_map(|(n, i)| Action::Duplicate(n, i)),
        1 => (node(), 0u8..3).prop_map(|(n, i)| Action::Drop(n, i)),
        1 => Just(Action::Reconnect),
        1 => node().prop_map(Action::Crash),
        1 => Just(Action::Wait),
        1 => Just(Action::Stray),
        1 => Just(Action::Close),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10_000))]

    #[test]
    fn random_traces_keep_every_promise(
        window in prop_oneof![Just(1usize), Just(2), Just(8)],
        actions in prop::collection::vec(action(), 0..60),
    ) {
        if let Err(broken) = replay(window, &actions) {
            return Err(TestCaseError::fail(broken));
        }
    }
}
