//! The switch against its reference model over random op sequences: every op is applied to
//! core (through its harness) and to the model in lockstep, and every observation, the laws
//! (zero state after termination, terminate once, straggler iff ended within the ring, nothing
//! routed to a master that is not attached and healthy) and the final counters must agree.
//!
//! Two sources: raw op sequences (shrinkable; the ops outside the section's domain are dropped
//! before the run) and the seeded walks `generate` uses, which reach deeper states.

use proptest::prelude::*;

use tether_formal_replay::generate::switch_walk_case;
use tether_formal_replay::script::{
    SwitchCancelCode, SwitchCase, SwitchFrame, SwitchIdentity, SwitchMaster, SwitchOp,
};
use tether_formal_replay::switch::{in_domain, lockstep};

const X: &str = "cap:in=media:x;out=media:y";
const Y: &str = "cap:in=media:y;out=media:z";

fn master(id: &str, caps: &[&str], initial_credit: u64) -> SwitchMaster {
    SwitchMaster {
        id: id.into(),
        caps: caps.iter().map(|c| (*c).to_owned()).collect(),
        initial_credit,
        identity: SwitchIdentity::Echo,
    }
}

fn world() -> impl Strategy<Value = (u64, Vec<SwitchMaster>)> {
    let credit = prop::sample::select(vec![1u64, 2, 32]);
    (
        prop::sample::select(vec![1u64, 2, 64]),
        credit.clone(),
        credit.clone(),
        credit,
        any::<bool>(),
    )
        .prop_map(|(ring, a, b, c, third)| {
            let mut masters = vec![master("a", &[X], a), master("b", &[X, Y], b)];
            if third {
                masters.push(master("c", &[Y], c));
            }
            (ring, masters)
        })
}

fn frame() -> impl Strategy<Value = (SwitchFrame, Option<String>)> {
    let stream = prop::sample::select(vec!["s", "t"]).prop_map(str::to_owned);
    prop_oneof![
        2 => stream.clone().prop_map(|s| (SwitchFrame::StreamStart, Some(s))),
        4 => stream.clone().prop_map(|s| (SwitchFrame::Chunk, Some(s))),
        1 => stream.prop_map(|s| (SwitchFrame::StreamEnd, Some(s))),
        2 => Just((SwitchFrame::End, None)),
        1 => Just((SwitchFrame::Err, None)),
        1 => Just((SwitchFrame::Log, None)),
    ]
}

fn op() -> impl Strategy<Value = SwitchOp> {
    let rid = 1u64..4;
    let master = prop::sample::select(vec!["a", "b", "c"]).prop_map(str::to_owned);
    let party = prop::sample::select(vec!["engine", "a", "b", "c"]).prop_map(str::to_owned);
    let cap = prop::sample::select(vec![X, Y, "cap:in=media:q;out=media:q", "nocap"])
        .prop_map(str::to_owned);
    prop_oneof![
        3 => (rid.clone(), cap.clone()).prop_map(|(rid, cap)| SwitchOp::Request { rid, cap, preferred: None }),
        2 => (master.clone(), rid.clone(), cap, prop::option::of(rid.clone()))
            .prop_map(|(from, rid, cap, parent)| SwitchOp::PeerRequest { from, rid, cap, parent }),
        8 => (master.clone(), rid.clone(), frame())
            .prop_map(|(from, rid, (frame, stream))| SwitchOp::Respond { from, rid, frame, stream }),
        3 => (party.clone(), rid.clone(), frame())
            .prop_map(|(from, rid, (frame, stream))| SwitchOp::Continue { from, rid, frame, stream }),
        2 => (party, rid.clone(), prop::sample::select(vec!["s", "t"]), 1u64..3)
            .prop_map(|(from, rid, stream, n)| SwitchOp::Credit { from, rid, stream: stream.into(), n }),
        1 => (rid.clone(), prop::sample::select(vec![
                SwitchCancelCode::Cancelled,
                SwitchCancelCode::Aborted,
                SwitchCancelCode::AbortedCollateral,
            ]))
            .prop_map(|(rid, code)| SwitchOp::Cancel { rid, code }),
        1 => rid.prop_map(|rid| SwitchOp::StopFeeds { rid }),
        1 => master.clone().prop_map(|master| SwitchOp::Close { master }),
        1 => master.prop_map(|master| SwitchOp::Reattach { master }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn core_and_model_agree_on_random_ops(
        (ring, masters) in world(),
        ops in prop::collection::vec(op(), 0..60),
    ) {
        let ops = in_domain(ring, &masters, &ops).expect("the worlds are well formed");
        lockstep(ring, &masters, &ops).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn core_and_model_agree_on_generated_walks(seed in any::<u64>()) {
        let case: SwitchCase = serde_json::from_value(switch_walk_case(seed, 40))
            .expect("walks are switch cases");
        lockstep(case.ring, &case.masters, &case.ops).map_err(TestCaseError::fail)?;
    }
}
