//! Golden vectors for `tether_core::cap`, checked in as JSON under `tests/data/cap/`: the capdag
//! docs/04 §2.5 truth table, parsing to canonical text and specificity, parse errors with kind and
//! byte offset, the four predicates, dispatch and ranking. Each vector names its source (capdag
//! docs, tagged-urn RULES.md, or docs/spec/switch.md §4 where capdag's code and docs differ).

use serde::Deserialize;
use tether_core::cap::{
    is_dispatchable, rank, CapUrn, Constraint, MediaUrn, ParseError, TaggedUrn,
};

#[derive(Deserialize)]
struct File<T> {
    cases: Vec<T>,
}

fn cases<T: for<'de> Deserialize<'de>>(json: &str) -> Vec<T> {
    let file: File<T> = serde_json::from_str(json).expect("a well-formed vector file");
    assert!(!file.cases.is_empty());
    file.cases
}

fn tagged(text: &str) -> TaggedUrn {
    TaggedUrn::parse(text).unwrap_or_else(|error| panic!("{text}: {error}"))
}

fn cap(text: &str) -> CapUrn {
    CapUrn::parse(text).unwrap_or_else(|error| panic!("{text}: {error}"))
}

#[derive(Deserialize)]
struct TruthCase {
    cell: String,
    instance: String,
    pattern: String,
    accepts: bool,
}

#[test]
fn truth_table() {
    let all: Vec<TruthCase> = cases(include_str!("data/cap/truth_table.json"));
    assert_eq!(
        all.len(),
        7 * 7 + 9,
        "every cell, both value cases where both sides carry one"
    );
    for case in all {
        let (instance, pattern) = (tagged(&case.instance), tagged(&case.pattern));
        assert_eq!(pattern.accepts(&instance), case.accepts, "{}", case.cell);
        assert_eq!(
            instance.conforms_to(&pattern),
            case.accepts,
            "{}",
            case.cell
        );
        let per_key = Constraint::matches(instance.constraint("x"), pattern.constraint("x"));
        assert_eq!(per_key, case.accepts, "{}", case.cell);
    }
}

#[derive(Deserialize)]
struct ParseCase {
    r#type: String,
    input: String,
    canonical: String,
    specificity: u64,
}

/// Parses `text` with the parser `kind` names, giving its canonical text and specificity.
fn parse_as(kind: &str, text: &str) -> Result<(String, u64), ParseError> {
    Ok(match kind {
        "tagged" => TaggedUrn::parse(text).map(|u| (u.to_string(), u.specificity()))?,
        "media" => MediaUrn::parse(text).map(|u| (u.to_string(), u.specificity()))?,
        "cap" => CapUrn::parse(text).map(|u| (u.to_string(), u.specificity()))?,
        other => panic!("unknown vector type {other}"),
    })
}

#[test]
fn parse_to_canonical() {
    for case in cases::<ParseCase>(include_str!("data/cap/parse.json")) {
        let (kind, input) = (case.r#type.as_str(), case.input.as_str());
        let (canonical, specificity) =
            parse_as(kind, input).unwrap_or_else(|error| panic!("{input}: {error}"));
        assert_eq!(canonical, case.canonical, "{kind} {input}");
        assert_eq!(specificity, case.specificity, "{kind} {input}");
        let again = parse_as(kind, &canonical).expect("canonical text parses");
        assert_eq!(
            again,
            (canonical, specificity),
            "{kind} {input}: canonical is stable"
        );
    }
}

#[derive(Deserialize)]
struct ErrorCase {
    r#type: String,
    input: String,
    kind: String,
    offset: usize,
}

#[test]
fn parse_errors() {
    for case in cases::<ErrorCase>(include_str!("data/cap/parse_errors.json")) {
        let error = match parse_as(&case.r#type, &case.input) {
            Ok(parsed) => panic!("{} {:?} parsed as {parsed:?}", case.r#type, case.input),
            Err(error) => error,
        };
        assert_eq!(
            error.kind.as_str(),
            case.kind,
            "{} {:?}",
            case.r#type,
            case.input
        );
        assert_eq!(
            error.offset, case.offset,
            "{} {:?}",
            case.r#type, case.input
        );
    }
}

#[derive(Deserialize)]
struct RelationCase {
    a: String,
    b: String,
    a_accepts_b: bool,
    a_conforms_to_b: bool,
    comparable: bool,
    equivalent: bool,
}

#[test]
fn relations() {
    for case in cases::<RelationCase>(include_str!("data/cap/relations.json")) {
        let (a, b) = (tagged(&case.a), tagged(&case.b));
        let name = format!("{} / {}", case.a, case.b);
        assert_eq!(a.accepts(&b), case.a_accepts_b, "accepts {name}");
        assert_eq!(
            a.conforms_to(&b),
            case.a_conforms_to_b,
            "conforms_to {name}"
        );
        assert_eq!(a.is_comparable(&b), case.comparable, "is_comparable {name}");
        assert_eq!(
            b.is_comparable(&a),
            case.comparable,
            "is_comparable reversed {name}"
        );
        assert_eq!(a.is_equivalent(&b), case.equivalent, "is_equivalent {name}");
        assert_eq!(
            b.is_equivalent(&a),
            case.equivalent,
            "is_equivalent reversed {name}"
        );
        if let (Ok(a), Ok(b)) = (MediaUrn::parse(&case.a), MediaUrn::parse(&case.b)) {
            assert_eq!(a.accepts(&b), case.a_accepts_b, "media accepts {name}");
            assert_eq!(
                a.conforms_to(&b),
                case.a_conforms_to_b,
                "media conforms_to {name}"
            );
            assert_eq!(
                a.is_equivalent(&b),
                case.equivalent,
                "media is_equivalent {name}"
            );
        }
    }
}

#[derive(Deserialize)]
struct DispatchCase {
    candidate: String,
    request: String,
    dispatchable: bool,
}

#[test]
fn dispatch() {
    for case in cases::<DispatchCase>(include_str!("data/cap/dispatch.json")) {
        let (candidate, request) = (cap(&case.candidate), cap(&case.request));
        assert_eq!(
            is_dispatchable(&candidate, &request),
            case.dispatchable,
            "candidate {} request {}",
            case.candidate,
            case.request
        );
    }
}

#[derive(Deserialize)]
struct RankingCase {
    request: String,
    candidates: Vec<String>,
    preferred: Option<String>,
    expected: Vec<usize>,
}

#[test]
fn ranking() {
    for case in cases::<RankingCase>(include_str!("data/cap/ranking.json")) {
        let request = cap(&case.request);
        let candidates: Vec<CapUrn> = case.candidates.iter().map(|text| cap(text)).collect();
        let preferred = case.preferred.as_deref().map(cap);
        let ranked = rank(&request, &candidates, preferred.as_ref());
        assert_eq!(
            ranked, case.expected,
            "request {} over {:?}",
            case.request, case.candidates
        );
    }
}

#[derive(Deserialize)]
struct FormsCase {
    candidate: String,
    request: String,
    capdag: bool,
    tether_differs: bool,
}

/// capdag 1.524.58's own matcher over the optional and negated tag forms (144 pairs,
/// `tests/capdag/dispatch_forms.py`): tether, keeping the seed's truth table, agrees with it
/// everywhere but the pairs marked `tether_differs`, each explained in docs/spec/switch.md §4.6.
#[test]
fn capdag_dispatch_forms() {
    let mut differ = Vec::new();
    for case in cases::<FormsCase>(include_str!("data/cap/capdag_dispatch_forms.json")) {
        let tether = is_dispatchable(&cap(&case.candidate), &cap(&case.request));
        if (tether != case.capdag) != case.tether_differs {
            differ.push(format!(
                "candidate {} request {}: tether {tether}, capdag {}",
                case.candidate, case.request, case.capdag
            ));
        }
    }
    assert!(differ.is_empty(), "{}", differ.join("\n"));
}
