//! The live cap graph: caps are edges from their input media to their output media
//! (docs/spec/switch.md §10.1: reachable targets and paths for the planner).
//!
//! A cap can take media `m` when `m` conforms to the cap's input (input is contravariant).
//! Both walks are bounded whatever the graph: reachability visits each cap at most once per
//! round and stops when a round adds nothing; path search keeps at most
//! [`PATH_FRONTIER_MAX`] partial paths, [`SWITCH_PATH_CAPS_MAX`] caps a path and
//! [`SWITCH_PATHS_MAX`] results.

use std::collections::BTreeSet;

use crate::cap::{CapUrn, MediaUrn};
use crate::limits::{SWITCH_PATHS_MAX, SWITCH_PATH_CAPS_MAX};

/// Most partial paths one round of the search keeps.
const PATH_FRONTIER_MAX: usize = 1024;

/// Every output medium some chain of `caps` produces from `input`, sorted.
pub(super) fn reachable(caps: &[&CapUrn], input: &MediaUrn) -> Vec<MediaUrn> {
    let mut known: Vec<MediaUrn> = vec![input.clone()];
    let mut reached: BTreeSet<MediaUrn> = BTreeSet::new();
    let mut used = vec![false; caps.len()];
    loop {
        let mut grew = false;
        for (index, cap) in caps.iter().enumerate() {
            if used[index] || !known.iter().any(|media| media.conforms_to(cap.input())) {
                continue;
            }
            used[index] = true;
            if reached.insert(cap.output().clone()) {
                known.push(cap.output().clone());
                grew = true;
            }
        }
        if !grew {
            return reached.into_iter().collect();
        }
    }
}

/// Chains of `caps` from `input` to something conforming to `output`, fewest caps first, no
/// cap twice in a chain.
pub(super) fn paths(caps: &[&CapUrn], input: &MediaUrn, output: &MediaUrn) -> Vec<Vec<CapUrn>> {
    let mut found: Vec<Vec<CapUrn>> = Vec::new();
    // Partial paths as indices into `caps`, with the medium each ends at.
    let mut frontier: Vec<(Vec<usize>, MediaUrn)> = vec![(Vec::new(), input.clone())];
    for _ in 0..SWITCH_PATH_CAPS_MAX {
        let mut next = Vec::new();
        for (path, media) in &frontier {
            for (index, cap) in caps.iter().enumerate() {
                if path.contains(&index) || !media.conforms_to(cap.input()) {
                    continue;
                }
                let mut longer = path.clone();
                longer.push(index);
                if cap.output().conforms_to(output) {
                    found.push(longer.iter().map(|i| caps[*i].clone()).collect());
                    if found.len() >= SWITCH_PATHS_MAX {
                        return found;
                    }
                } else if next.len() < PATH_FRONTIER_MAX {
                    next.push((longer, cap.output().clone()));
                }
            }
        }
        if next.is_empty() {
            break;
        }
        frontier = next;
    }
    found
}
