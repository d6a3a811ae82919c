//! Properties of `tether_core::cap`, over generated URNs written in every accepted spelling
//! (aliases, key and prefix case, quoting, tag order, empty segments) and over arbitrary text:
//!
//! - a generated URN parses to exactly the model it was written from;
//! - `parse(print(x)) == x` and printing is stable;
//! - arbitrary text never panics, and an error's offset is within the text;
//! - `accepts` and `is_dispatchable` are reflexive, `is_equivalent` reflexive and symmetric
//!   (not transitive: see `relations.json`), `media:` accepts everything;
//! - `rank` lists each dispatchable candidate exactly once, in distance order, preferred first.

use std::collections::BTreeMap;

use proptest::prelude::*;
use tether_core::cap::{
    is_dispatchable, rank, CapUrn, Constraint, Effect, MediaUrn, ParseErrorKind, TaggedUrn,
};

/// Values an exact or qualified tag may carry: some unquotable as they are, some that must be
/// quoted (case, space, `;`, `=`, quote, backslash, non-letters), some that look like sigils.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "a",
            "pdf",
            "utf-8",
            "2.0",
            "x/y",
            "a:b",
            "media:pdf",
            "?v",
            "!v",
            "*a",
            "v*",
            "é",
            "A",
            "Has Upper",
            "a;b",
            "a=b",
            "q\"t",
            "b\\s",
            "€",
            "É",
            " ",
            "\"",
        ])
        .prop_map(str::to_owned),
        "[a-z0-9]{1,4}",
        "[ -~]{1,6}",
    ]
    .prop_filter("not a sigil", |v| {
        !matches!(v.as_str(), "*" | "?" | "!") && !v.starts_with("?=") && !v.starts_with("!=")
    })
}

fn constraint() -> impl Strategy<Value = Constraint> {
    prop_oneof![
        Just(Constraint::Unconstrained),
        value().prop_map(Constraint::AbsentOrNot),
        Just(Constraint::Present),
        value().prop_map(Constraint::PresentNot),
        value().prop_map(Constraint::Exact),
        Just(Constraint::Absent),
    ]
}

/// Whether `value` can be written unquoted and read back as itself.
fn unquotable(value: &str) -> bool {
    !value.is_empty()
        && value.chars().all(|c| {
            (c.is_ascii_alphanumeric() && !c.is_ascii_uppercase())
                || "-_./:*?!".contains(c)
                || (!c.is_ascii() && c.is_alphanumeric() && !c.is_uppercase())
        })
}

fn quoted(value: &str) -> String {
    format!("\"{}\"", value.replace('\\', "\\\\").replace('"', "\\\""))
}

/// Writes `value` quoted, or unquoted with random ASCII case when that reads back the same.
fn write_value(value: &str, choice: u8) -> String {
    if unquotable(value) && !choice.is_multiple_of(3) {
        if choice % 3 == 1 {
            value.to_ascii_uppercase()
        } else {
            value.to_owned()
        }
    } else {
        quoted(value)
    }
}

/// Writes a key with random ASCII case.
fn write_key(key: &str, choice: u8) -> String {
    if choice.is_multiple_of(2) {
        key.to_ascii_uppercase()
    } else {
        key.to_owned()
    }
}

/// One spelling, picked by `choice`, of the tag `key` with constraint `constraint`.
fn write_tag(key: &str, constraint: &Constraint, choice: u8) -> String {
    let k = write_key(key, choice >> 4);
    let pick = choice % 4;
    match constraint {
        Constraint::Unconstrained => [
            format!("?{k}"),
            format!("{k}?"),
            format!("{k}=?"),
            format!("{k}=\"?\""),
        ][pick as usize]
            .clone(),
        Constraint::AbsentOrNot(v) => match pick {
            0 => format!("{k}?={}", write_value(v, choice >> 2)),
            1 => format!("?{k}={}", write_value(v, choice >> 2)),
            _ => format!("{k}={}", quoted(&format!("?={v}"))),
        },
        Constraint::Present => {
            [k.clone(), format!("{k}=*"), format!("{k}=\"*\"")][(pick % 3) as usize].clone()
        }
        Constraint::PresentNot(v) => match pick {
            0 => format!("{k}!={}", write_value(v, choice >> 2)),
            1 => format!("!{k}={}", write_value(v, choice >> 2)),
            _ => format!("{k}={}", quoted(&format!("!={v}"))),
        },
        Constraint::Exact(v) => format!("{k}={}", write_value(v, choice >> 2)),
        Constraint::Absent => [
            format!("!{k}"),
            format!("{k}!"),
            format!("{k}=!"),
            format!("{k}=\"!\""),
        ][pick as usize]
            .clone(),
        other => unreachable!("the generator makes no {other:?}"),
    }
}

/// Tags as a model: keys (from `keys`) to constraints.
fn tags(keys: &'static [&'static str], max: usize) -> impl Strategy<Value = Model> {
    prop::collection::btree_map(prop::sample::select(keys), constraint(), 0..=max)
        .prop_map(|tags| tags.into_iter().map(|(k, c)| (k.to_owned(), c)).collect())
}

type Model = BTreeMap<String, Constraint>;

/// Writes `prefix:` and the tags in a shuffled order with random spellings, empty segments and
/// an optional trailing `;`.
fn write_urn(prefix: &str, tags: &Model) -> impl Strategy<Value = String> {
    let tags: Vec<(String, Constraint)> = tags.clone().into_iter().collect();
    let count = tags.len();
    let prefix = prefix.to_owned();
    (
        Just(tags).prop_shuffle(),
        prop::collection::vec(any::<u8>(), count),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(move |(tags, choices, upper, doubled, trailing)| {
            let written: Vec<String> = tags
                .iter()
                .zip(&choices)
                .map(|((key, constraint), &choice)| write_tag(key, constraint, choice))
                .collect();
            let separator = if doubled { ";;" } else { ";" };
            let prefix = if upper {
                prefix.to_ascii_uppercase()
            } else {
                prefix.clone()
            };
            let trailing = if trailing { ";" } else { "" };
            format!("{prefix}:{}{trailing}", written.join(separator))
        })
}

fn model_of(urn: &TaggedUrn) -> Model {
    urn.tags()
        .map(|(key, constraint)| (key.to_owned(), constraint.clone()))
        .collect()
}

const KEYS: &[&str] = &["a", "b", "ext", "v", "x-y", "k9", "void", "in"];
const MEDIA_KEYS: &[&str] = &["a", "b", "ext", "v", "x-y", "k9", "bytes", "pdf"];
const CAP_KEYS: &[&str] = &["a", "b", "extract", "target", "x-y", "k9"];

/// A generated tagged URN: (text, prefix, model).
fn tagged_case() -> impl Strategy<Value = (String, String, Model)> {
    ("[a-z][a-z0-9-]{0,5}", tags(KEYS, 6)).prop_flat_map(|(prefix, model)| {
        write_urn(&prefix, &model).prop_map(move |text| (text, prefix.clone(), model.clone()))
    })
}

/// A generated media URN model: `media:void`, or tags without `void`.
fn media_model() -> impl Strategy<Value = Model> {
    prop_oneof![
        1 => Just(Model::from([("void".to_owned(), Constraint::Present)])),
        6 => tags(MEDIA_KEYS, 4),
    ]
}

fn media_case() -> impl Strategy<Value = (String, Model)> {
    media_model().prop_flat_map(|model| {
        write_urn("media", &model).prop_map(move |text| (text, model.clone()))
    })
}

/// A cap as a model: the texts of its input and output media URNs (each checked against its
/// own model by `media_parses_to_its_model_and_round_trips`), the effect, and the other tags.
#[derive(Debug, Clone)]
struct CapModel {
    input: String,
    output: String,
    effect: (&'static str, Effect),
    tags: Model,
}

fn cap_case() -> impl Strategy<Value = (String, CapModel)> {
    let effect = prop::sample::select(vec![
        ("", Effect::Declared),
        ("effect=declared", Effect::Declared),
        ("effect=none", Effect::None),
        ("EFFECT=patch", Effect::Patch),
        ("?effect", Effect::Any),
        ("effect", Effect::Any),
        ("effect=*", Effect::Any),
    ]);
    (
        media_case(),
        media_case(),
        effect,
        tags(CAP_KEYS, 4),
        any::<[u8; 2]>(),
    )
        .prop_flat_map(
            |((in_text, input), (out_text, output), effect, tags, [in_choice, out_choice])| {
                let mut structural = Vec::new();
                structural.extend(write_side("in", &in_text, &input, in_choice));
                structural.extend(write_side("out", &out_text, &output, out_choice));
                let model = CapModel {
                    input: in_text,
                    output: out_text,
                    effect,
                    tags: tags.clone(),
                };
                if !effect.0.is_empty() {
                    structural.push(effect.0.to_owned());
                }
                (write_urn("cap", &tags), Just(structural).prop_shuffle()).prop_map(
                    move |(text, structural)| {
                        let mut text = text;
                        let mut separate = !text.ends_with(':') && !text.ends_with(';');
                        for tag in &structural {
                            if separate {
                                text.push(';');
                            }
                            text.push_str(tag);
                            separate = true;
                        }
                        (text, model.clone())
                    },
                )
            },
        )
}

/// The `in`/`out` tag for a side written `media` (parsing to `model`), or nothing for `media:`
/// some of the time.
fn write_side(key: &str, media: &str, model: &Model, choice: u8) -> Option<String> {
    if model.is_empty() {
        return [
            None,
            Some(key.to_owned()),
            Some(format!("{key}=*")),
            Some(format!("{key}=media:")),
        ][(choice % 4) as usize]
            .clone();
    }
    let unquoted = !media.contains([';', '"', '=', ' ', '\\']) && media.is_ascii();
    if unquoted && choice.is_multiple_of(2) {
        Some(format!("{key}={media}"))
    } else {
        Some(format!("{key}={}", quoted(media)))
    }
}

/// Parses and checks `parse(print(x)) == x` and that printing again is identical.
fn round_trip<T, E>(parse: impl Fn(&str) -> Result<T, E>, value: &T) -> Result<(), TestCaseError>
where
    T: std::fmt::Display + PartialEq + std::fmt::Debug,
    E: std::fmt::Debug,
{
    let printed = value.to_string();
    let again = parse(&printed).map_err(|e| TestCaseError::fail(format!("{printed}: {e:?}")))?;
    prop_assert_eq!(&again, value, "{}", printed);
    prop_assert_eq!(again.to_string(), printed);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn tagged_parses_to_its_model_and_round_trips((text, prefix, model) in tagged_case()) {
        let urn = TaggedUrn::parse(&text).map_err(|e| TestCaseError::fail(format!("{text}: {e}")))?;
        prop_assert_eq!(urn.prefix(), prefix.as_str());
        prop_assert_eq!(&model_of(&urn), &model, "{}", text);
        let score: u64 = model.values().map(Constraint::specificity).sum();
        prop_assert_eq!(urn.specificity(), score);
        round_trip(TaggedUrn::parse, &urn)?;
        prop_assert!(urn.accepts(&urn));
        prop_assert!(urn.is_equivalent(&urn));
        let top = TaggedUrn::parse(&(prefix.clone() + ":")).unwrap();
        prop_assert!(top.accepts(&urn));
    }

    #[test]
    fn media_parses_to_its_model_and_round_trips((text, model) in media_case()) {
        let urn = MediaUrn::parse(&text).map_err(|e| TestCaseError::fail(format!("{text}: {e}")))?;
        prop_assert_eq!(&model_of(urn.as_tagged()), &model, "{}", text);
        prop_assert_eq!(urn.is_top(), model.is_empty());
        round_trip(MediaUrn::parse, &urn)?;
        prop_assert!(MediaUrn::top().accepts(&urn));
        prop_assert!(urn.conforms_to(&urn));
    }

    #[test]
    fn cap_parses_to_its_model_and_round_trips((text, model) in cap_case()) {
        let parsed = CapUrn::parse(&text);
        let input = MediaUrn::parse(&model.input).unwrap();
        let output = MediaUrn::parse(&model.output).unwrap();
        let effect = model.effect.1;
        if input.is_top() && output.is_top() && model.tags.is_empty() && effect == Effect::Declared {
            prop_assert_eq!(parsed.map_err(|e| e.kind), Err(ParseErrorKind::BareTopCap), "{}", text);
            return Ok(());
        }
        if effect == Effect::None && !input.conforms_to(&output) {
            let kind = parsed.map_err(|e| e.kind);
            prop_assert_eq!(kind, Err(ParseErrorKind::InadmissibleEffect), "{}", text);
            return Ok(());
        }
        let cap = parsed.map_err(|e| TestCaseError::fail(format!("{text}: {e}")))?;
        prop_assert_eq!(cap.input(), &input, "{}", text);
        prop_assert_eq!(cap.output(), &output, "{}", text);
        prop_assert_eq!(cap.effect(), effect, "{}", text);
        prop_assert_eq!(&model_of(cap.tags()), &model.tags, "{}", text);
        let spec = 10_000 * output.specificity() + 100 * input.specificity()
            + cap.tags().specificity();
        prop_assert_eq!(cap.specificity(), spec);
        round_trip(CapUrn::parse, &cap)?;
        prop_assert!(cap.is_equivalent(&cap));
        prop_assert!(is_dispatchable(&cap, &cap));
    }

    #[test]
    fn arbitrary_text_never_panics(text in prop_oneof![
        any::<String>(),
        "(cap|media|p|CAP|Media):[a-zA-Z0-9:;=?!*\"\\\\ ._-]{0,40}",
        "cap:(in|out|effect|x)=[a-zA-Z0-9:;=?!*\"\\\\ ._-]{0,30}",
    ]) {
        check_arbitrary(&text)?;
    }

    #[test]
    fn mutated_urns_never_panic((text, _) in cap_case(), at in any::<usize>(), c in any::<char>(),
                                insert in any::<bool>()) {
        let mut chars: Vec<char> = text.chars().collect();
        let at = at % (chars.len() + 1);
        if insert || at == chars.len() {
            chars.insert(at, c);
        } else {
            chars.remove(at);
        }
        check_arbitrary(&chars.into_iter().collect::<String>())?;
    }

    #[test]
    fn relations_are_reflexive_and_symmetric((a, _) in media_case(), (b, _) in media_case()) {
        let (a, b) = (MediaUrn::parse(&a).unwrap(), MediaUrn::parse(&b).unwrap());
        prop_assert_eq!(a.accepts(&b), b.conforms_to(&a));
        prop_assert_eq!(a.is_equivalent(&b), b.is_equivalent(&a));
        prop_assert_eq!(a.is_comparable(&b), b.is_comparable(&a));
        prop_assert_eq!(a.is_equivalent(&b), a.accepts(&b) && b.accepts(&a));
        prop_assert!(!a.is_equivalent(&b) || a.is_comparable(&b));
        if a == b {
            prop_assert!(a.is_equivalent(&b));
        }
    }

    #[test]
    fn rank_lists_dispatchable_candidates_best_first(
        request in small_cap(4),
        candidates in prop::collection::vec(small_cap(1), 0..10),
        stranger in small_cap(1),
        pick in prop::option::of(any::<prop::sample::Index>()),
        prefer_a_candidate in any::<bool>(),
    ) {
        // The preferred cap is often one of the candidates, so that it often has an equivalent.
        let preferred = pick.map(|pick| match prefer_a_candidate && !candidates.is_empty() {
            true => candidates[pick.index(candidates.len())].clone(),
            false => stranger.clone(),
        });
        check_rank(&request, &candidates, preferred.as_ref())?;
    }
}

/// Parses `text` with every parser: no panic; an error's offset is within the text; a success
/// round-trips.
fn check_arbitrary(text: &str) -> Result<(), TestCaseError> {
    match TaggedUrn::parse(text) {
        Ok(urn) => round_trip(TaggedUrn::parse, &urn)?,
        Err(error) => prop_assert!(error.offset <= text.len(), "{text:?}: {error}"),
    }
    match MediaUrn::parse(text) {
        Ok(urn) => round_trip(MediaUrn::parse, &urn)?,
        Err(error) => prop_assert!(error.offset <= text.len(), "{text:?}: {error}"),
    }
    match CapUrn::parse(text) {
        Ok(cap) => round_trip(CapUrn::parse, &cap)?,
        Err(error) => prop_assert!(error.offset <= text.len(), "{text:?}: {error}"),
    }
    Ok(())
}

/// Caps from a small universe, so that requests and candidates often dispatch to each other.
fn small_cap(tops: usize) -> impl Strategy<Value = CapUrn> {
    // A request (`tops` > 1) more often leaves a side open, so that more candidates dispatch.
    let mut sides = vec![""; tops];
    sides.extend([
        "media:pdf",
        "\"media:pdf;v=1\"",
        "media:image",
        "media:bytes",
        "\"media:bytes;pdf\"",
        "\"media:pdf;v!=2\"",
    ]);
    let media = prop::sample::select(sides);
    let effect = prop::sample::select(vec!["", "", "", "", "?effect", "effect=none"]);
    let tag = prop::sample::select(vec![
        "op", "op=x", "op=y", "!op", "?op", "z", "z?=1", "z!=1",
    ]);
    (
        media.clone(),
        media,
        effect,
        prop::collection::btree_set(tag, 0..2),
    )
        .prop_filter_map("a legal cap", |(input, output, effect, tags)| {
            let mut parts: Vec<String> = tags.into_iter().map(str::to_owned).collect();
            if !input.is_empty() {
                parts.push(format!("in={input}"));
            }
            if !output.is_empty() {
                parts.push(format!("out={output}"));
            }
            if !effect.is_empty() {
                parts.push(effect.to_owned());
            }
            CapUrn::parse(&format!("cap:{}", parts.join(";"))).ok()
        })
}

fn distance(request: &CapUrn, candidate: &CapUrn) -> i128 {
    i128::from(candidate.specificity()) - i128::from(request.specificity())
}

fn check_rank(
    request: &CapUrn,
    candidates: &[CapUrn],
    preferred: Option<&CapUrn>,
) -> Result<(), TestCaseError> {
    let ranked = rank(request, candidates, preferred);
    prop_assert_eq!(
        &rank(request, candidates, preferred),
        &ranked,
        "deterministic"
    );
    let dispatchable: Vec<usize> = (0..candidates.len())
        .filter(|&i| is_dispatchable(&candidates[i], request))
        .collect();
    let mut listed = ranked.clone();
    listed.sort_unstable();
    prop_assert_eq!(
        &listed,
        &dispatchable,
        "each dispatchable candidate exactly once"
    );
    let favourite = preferred.and_then(|preferred| {
        dispatchable
            .iter()
            .copied()
            .find(|&i| candidates[i].is_equivalent(preferred))
    });
    let rest = match favourite {
        Some(favourite) => {
            prop_assert_eq!(
                ranked.first(),
                Some(&favourite),
                "the preferred's equivalent first"
            );
            &ranked[1..]
        }
        None => &ranked[..],
    };
    let key = |&i: &usize| {
        let d = distance(request, &candidates[i]);
        (d < 0, d.unsigned_abs(), i)
    };
    for pair in rest.windows(2) {
        prop_assert!(
            key(&pair[0]) < key(&pair[1]),
            "order {:?} then {:?}",
            key(&pair[0]),
            key(&pair[1])
        );
    }
    Ok(())
}
