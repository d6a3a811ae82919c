//! Dispatch (which registered caps can handle a request) and ranking (which of them to pick),
//! per docs/spec/switch.md §4.3–§4.4; capdag docs/07 and docs/08.

use std::cmp::Ordering;

use super::urn::{CapUrn, Effect};

/// Whether `candidate` (a registered cap) can handle `request`. All four must hold:
///
/// - input, contravariant: the request's input is `media:`, or it conforms to the candidate's
///   input (the candidate accepts at least what the request sends);
/// - output, covariant: the request's output is `media:`, or the candidate's output is not
///   `media:` and conforms to the request's (a candidate that promises nothing in particular
///   fails a request that wants something specific);
/// - effect: the request says `?effect`, or both effects are equal. A candidate with
///   `?effect` therefore matches only requests that also leave the effect open;
/// - other tags: the request's tags, as the pattern, accept the candidate's, as the instance
///   (docs/spec/switch.md §4.5: capdag's code; its docs/07 §2.1 writes the relation the
///   other way round).
pub fn is_dispatchable(candidate: &CapUrn, request: &CapUrn) -> bool {
    let input = request.input().is_top() || request.input().conforms_to(candidate.input());
    let output = request.output().is_top()
        || (!candidate.output().is_top() && candidate.output().conforms_to(request.output()));
    let effect = request.effect() == Effect::Any || candidate.effect() == request.effect();
    input && output && effect && request.tags().accepts(candidate.tags())
}

/// Indices into `candidates` of the dispatchable ones, best first.
///
/// The order is by distance = `spec(candidate) − spec(request)` (capdag docs/08 §4): 0 first,
/// then positive distances ascending, then negative ones by ascending |distance|; equal
/// distances keep registration order (the order of `candidates`). When `preferred` is given
/// and some dispatchable candidate [`is_equivalent`](CapUrn::is_equivalent) to it, the first
/// such candidate in registration order comes first regardless of distance; the rest follow
/// in the order above. Each index appears at most once. Deterministic; never panics.
pub fn rank(request: &CapUrn, candidates: &[CapUrn], preferred: Option<&CapUrn>) -> Vec<usize> {
    rank_among(request, candidates, 0..candidates.len(), preferred)
}

/// [`rank`] over only the candidates at indices `among` (ascending, each in range), for a
/// caller that has already ruled the others out (e.g. by an index on output tags). Returns
/// indices into `candidates`, exactly as [`rank`] would when the excluded ones are not
/// dispatchable.
pub fn rank_among(
    request: &CapUrn,
    candidates: &[CapUrn],
    among: impl IntoIterator<Item = usize>,
    preferred: Option<&CapUrn>,
) -> Vec<usize> {
    let request_spec = i128::from(request.specificity());
    let mut ranked: Vec<(usize, i128)> = among
        .into_iter()
        .filter_map(|index| candidates.get(index).map(|candidate| (index, candidate)))
        .filter(|(_, candidate)| is_dispatchable(candidate, request))
        .map(|(index, candidate)| (index, i128::from(candidate.specificity()) - request_spec))
        .collect();
    ranked.sort_by(|a, b| closer(a.1, b.1).then(a.0.cmp(&b.0)));
    let mut order: Vec<usize> = ranked.into_iter().map(|(index, _)| index).collect();
    // The first registered, not the best ranked, of the candidates equivalent to the preferred.
    let favourite = preferred.and_then(|preferred| {
        let is_equivalent = |index: &usize| candidates[*index].is_equivalent(preferred);
        order.iter().copied().filter(is_equivalent).min()
    });
    if let Some(favourite) = favourite {
        order.retain(|&index| index != favourite);
        order.insert(0, favourite);
    }
    order
}

/// Orders two distances, the better first: non-negative before negative, then by |distance|.
fn closer(a: i128, b: i128) -> Ordering {
    (a < 0)
        .cmp(&(b < 0))
        .then(a.unsigned_abs().cmp(&b.unsigned_abs()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cap(text: &str) -> CapUrn {
        CapUrn::parse(text).unwrap()
    }

    fn caps(texts: &[&str]) -> Vec<CapUrn> {
        texts.iter().map(|text| cap(text)).collect()
    }

    #[test]
    fn distance_order() {
        let mut distances = vec![-3, 5, 0, -1, 2, 0, -7];
        distances.sort_by(|&a, &b| closer(a, b));
        assert_eq!(distances, vec![0, 0, 2, 5, -1, -3, -7]);
    }

    #[test]
    fn input_is_contravariant_and_output_covariant() {
        let candidate = cap("cap:extract;in=media:bytes;out=\"media:fmt=json;record\"");
        let request = cap("cap:extract;in=\"media:bytes;ext=pdf\";out=media:record");
        assert!(is_dispatchable(&candidate, &request));
        assert!(!is_dispatchable(&request, &candidate));
    }

    #[test]
    fn candidate_with_top_output_fails_a_specific_request() {
        let candidate = cap("cap:extract;in=media:bytes");
        assert!(!is_dispatchable(
            &candidate,
            &cap("cap:extract;out=media:!void")
        ));
        assert!(is_dispatchable(&candidate, &cap("cap:extract")));
    }

    #[test]
    fn effect_is_exact_unless_the_request_leaves_it_open() {
        let any = cap("cap:?effect;x");
        let none = cap("cap:effect=none;x");
        let declared = cap("cap:x");
        assert!(is_dispatchable(&none, &any) && is_dispatchable(&declared, &any));
        assert!(is_dispatchable(&any, &any));
        assert!(!is_dispatchable(&any, &declared) && !is_dispatchable(&any, &none));
        assert!(!is_dispatchable(&none, &declared));
    }

    #[test]
    fn request_tags_are_the_pattern() {
        let (plain, refined) = (cap("cap:extract"), cap("cap:extract;target=metadata"));
        assert!(is_dispatchable(&refined, &plain));
        assert!(!is_dispatchable(&plain, &refined));
    }

    #[test]
    fn ranking_and_preference() {
        let request = cap("cap:convert");
        let candidates = caps(&[
            "cap:convert;in=media:pdf;out=media:html",
            "cap:convert;in=media:image;out=media:png",
            "cap:convert",
            "cap:other",
        ]);
        assert_eq!(rank(&request, &candidates, None), vec![2, 0, 1]);
        let preferred = cap("cap:convert;in=media:image;out=media:png");
        assert_eq!(rank(&request, &candidates, Some(&preferred)), vec![1, 2, 0]);
        let stranger = cap("cap:other");
        assert_eq!(rank(&request, &candidates, Some(&stranger)), vec![2, 0, 1]);
        assert_eq!(rank(&request, &[], Some(&stranger)), Vec::<usize>::new());
    }
}
