//! Cap URNs: tagged URNs with the prefix `cap` naming a capability by what it consumes (`in`),
//! what it produces (`out`), its effect on runtime media identity (`effect`) and any other tags
//! (docs/spec/switch.md §4.2; capdag docs/06).

use std::fmt;
use std::str::FromStr;

use super::media::MediaUrn;
use super::tagged::{parse_spanned, Constraint, ParseError, ParseErrorKind, TagSpan, TaggedUrn};

/// The identity cap every master must advertise in its HELLO manifest (docs/spec/switch.md
/// §3.3–§3.4): any input to the same output, no effect on media identity.
pub const CAP_IDENTITY: &str = "cap:effect=none";

/// The identity cap, [`CAP_IDENTITY`], parsed.
pub fn identity() -> CapUrn {
    CapUrn {
        input: MediaUrn::top(),
        output: MediaUrn::top(),
        effect: Effect::None,
        tags: TaggedUrn::empty(CapUrn::PREFIX),
    }
}

/// A cap's effect on runtime media/type identity (capdag docs/06 §2.2). Not part of
/// specificity: dispatch compares it exactly unless the request leaves it open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Effect {
    /// The output media is what `out` declares. The default when `effect` is not written.
    Declared,
    /// `effect=none`: the output is the input, unchanged in type.
    None,
    /// `effect=patch`: the output is the input with the declared change applied.
    Patch,
    /// `?effect` (also `effect`, `effect=*`): a request that accepts any effect.
    Any,
}

impl Effect {
    /// The value as written in a cap URN; `?` for [`Effect::Any`].
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Declared => "declared",
            Self::None => "none",
            Self::Patch => "patch",
            Self::Any => "?",
        }
    }
}

/// A parsed, normalised cap URN: input and output media URNs, effect, and the other tags.
///
/// Equality and hashing are structural and agree with the canonical text (`Display`).
/// [`CapUrn::is_equivalent`] is the semantic relation used to match a preferred cap.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CapUrn {
    input: MediaUrn,
    output: MediaUrn,
    effect: Effect,
    /// The tags other than `in`, `out` and `effect`, with the prefix `cap`.
    tags: TaggedUrn,
}

impl CapUrn {
    /// The prefix every cap URN has.
    pub const PREFIX: &'static str = "cap";

    /// Weight of the output's specificity in the cap's (capdag docs/05 §3.2).
    pub const SPECIFICITY_WEIGHT_OUT: u64 = 10_000;

    /// Weight of the input's specificity in the cap's (capdag docs/05 §3.2).
    pub const SPECIFICITY_WEIGHT_IN: u64 = 100;

    /// Parses `text`. Never panics. On top of [`TaggedUrn::parse`]:
    ///
    /// - the prefix must be `cap` ([`ParseErrorKind::WrongPrefix`]);
    /// - `in` and `out` default to `media:`; value-less, `*` or `"*"` mean `media:`; any other
    ///   value is parsed again as a media URN, so a quoted one has its unquoted parts
    ///   lowercased, and its errors point into the quotes (docs/spec/switch.md §4.5). Unquoted,
    ///   `in=media:bytes;ext=pdf` is `in=media:bytes` plus the cap tag `ext=pdf`. Other forms
    ///   (`?in`, `in!=v`, ...) are [`ParseErrorKind::InvalidDirection`];
    /// - `effect` defaults to declared; `declared`, `none`, `patch`, `?effect`, `effect` and
    ///   `effect=*` are accepted, anything else is [`ParseErrorKind::InvalidEffect`];
    /// - the bare top form (`cap:`, `cap:in=media:;out=media:`) is
    ///   [`ParseErrorKind::BareTopCap`]: identity is written `cap:effect=none`;
    /// - `effect=none` needs the input to conform to the output
    ///   ([`ParseErrorKind::InadmissibleEffect`]). (`effect=patch` is accepted as written.)
    pub fn parse(text: &str) -> Result<CapUrn, ParseError> {
        let (mut tags, spans) = parse_spanned(text)?;
        if tags.prefix() != Self::PREFIX {
            return Err(ParseError::new(ParseErrorKind::WrongPrefix, 0));
        }
        let input = direction(text, tags.remove("in"), span_of(&spans, "in"))?;
        let output = direction(text, tags.remove("out"), span_of(&spans, "out"))?;
        let effect_span = span_of(&spans, "effect");
        let effect = effect(tags.remove("effect"), effect_span)?;
        if input.is_top() && output.is_top() && tags.is_empty() && effect == Effect::Declared {
            return Err(ParseError::new(ParseErrorKind::BareTopCap, 0));
        }
        if effect == Effect::None && !input.conforms_to(&output) {
            let offset = effect_span.map_or(0, |span| span.start);
            return Err(ParseError::new(ParseErrorKind::InadmissibleEffect, offset));
        }
        Ok(CapUrn {
            input,
            output,
            effect,
            tags,
        })
    }

    /// The input media URN (`in`); `media:` when the cap accepts any input.
    pub fn input(&self) -> &MediaUrn {
        &self.input
    }

    /// The output media URN (`out`); `media:` when the cap may produce anything.
    pub fn output(&self) -> &MediaUrn {
        &self.output
    }

    /// The effect coordinate.
    pub fn effect(&self) -> Effect {
        self.effect
    }

    /// The tags other than `in`, `out` and `effect` (prefix `cap`, sorted by key).
    pub fn tags(&self) -> &TaggedUrn {
        &self.tags
    }

    /// `10000·spec(out) + 100·spec(in) + spec(other tags)` (docs/spec/switch.md §4.4, capdag
    /// docs/05 §3.2). The effect is not scored.
    pub fn specificity(&self) -> u64 {
        Self::SPECIFICITY_WEIGHT_OUT * self.output.specificity()
            + Self::SPECIFICITY_WEIGHT_IN * self.input.specificity()
            + self.tags.specificity()
    }

    /// Whether the two caps sit at the same place in the order: equivalent inputs, equivalent
    /// outputs, the same effect and equivalent other tags (each "equivalent" being mutual
    /// acceptance under the docs/04 truth table). Reflexive and symmetric; like
    /// [`TaggedUrn::is_equivalent`] not transitive.
    pub fn is_equivalent(&self, other: &CapUrn) -> bool {
        self.effect == other.effect
            && self.input.is_equivalent(&other.input)
            && self.output.is_equivalent(&other.output)
            && self.tags.is_equivalent(&other.tags)
    }
}

impl fmt::Display for CapUrn {
    /// The canonical text: all tags, `in`/`out`/`effect` included, in key order; `in` and
    /// `out` left out when `media:`, `effect` when declared (capdag docs/06 §3.2). A media URN
    /// is quoted when its text needs it (`in="media:bytes;ext=pdf"`, but `out=media:record`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut all = self.tags.clone();
        if !self.input.is_top() {
            all.insert("in", Constraint::Exact(self.input.to_string()));
        }
        if !self.output.is_top() {
            all.insert("out", Constraint::Exact(self.output.to_string()));
        }
        match self.effect {
            Effect::Declared => {}
            Effect::Any => all.insert("effect", Constraint::Unconstrained),
            effect => all.insert("effect", Constraint::Exact(effect.as_str().to_owned())),
        }
        all.fmt(f)
    }
}

impl FromStr for CapUrn {
    type Err = ParseError;

    fn from_str(text: &str) -> Result<Self, ParseError> {
        Self::parse(text)
    }
}

/// Where the tag of `key` sat in the text, if the URN has one.
fn span_of<'a>(spans: &'a [TagSpan], key: &str) -> Option<&'a TagSpan> {
    spans.iter().find(|span| span.key == key)
}

/// The media URN of an `in` or `out` tag; `span` locates the tag in `text`.
fn direction(
    text: &str,
    tag: Option<Constraint>,
    span: Option<&TagSpan>,
) -> Result<MediaUrn, ParseError> {
    let tag_start = span.map_or(0, |span| span.start);
    match tag {
        None | Some(Constraint::Present) => Ok(MediaUrn::top()),
        Some(Constraint::Exact(media)) => MediaUrn::parse(&media).map_err(|error| {
            let value = span.and_then(|span| span.value);
            debug_assert!(value.is_some(), "an exact tag was written with a value");
            let offset = value.map_or(tag_start, |value| value.outer_offset(text, error.offset));
            ParseError::new(error.kind, offset)
        }),
        Some(_) => Err(ParseError::new(ParseErrorKind::InvalidDirection, tag_start)),
    }
}

/// The effect of an `effect` tag.
fn effect(tag: Option<Constraint>, span: Option<&TagSpan>) -> Result<Effect, ParseError> {
    let invalid = || ParseError::new(ParseErrorKind::InvalidEffect, span.map_or(0, |s| s.start));
    match tag {
        None => Ok(Effect::Declared),
        Some(Constraint::Unconstrained | Constraint::Present) => Ok(Effect::Any),
        Some(Constraint::Exact(value)) => match value.as_str() {
            "declared" => Ok(Effect::Declared),
            "none" => Ok(Effect::None),
            "patch" => Ok(Effect::Patch),
            _ => Err(invalid()),
        },
        Some(_) => Err(invalid()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cap(text: &str) -> CapUrn {
        CapUrn::parse(text).unwrap()
    }

    fn error(text: &str) -> (&'static str, usize) {
        let error = CapUrn::parse(text).unwrap_err();
        (error.kind.as_str(), error.offset)
    }

    #[test]
    fn identity_is_the_constant() {
        assert_eq!(identity(), cap(CAP_IDENTITY));
        assert_eq!(identity().to_string(), CAP_IDENTITY);
        assert_eq!(identity().specificity(), 0);
    }

    #[test]
    fn canonical_forms_from_docs() {
        let pairs = [
            ("cap:test", "cap:test"),
            ("cap:in=media:;test;out=media:", "cap:test"),
            ("cap:in=*;test;out=*", "cap:test"),
            ("cap:in;test;out", "cap:test"),
            (
                "cap:in=media:pdf;extract;out=media:record",
                "cap:extract;in=media:pdf;out=media:record",
            ),
            ("cap:in=media:;out=media:;effect=none", "cap:effect=none"),
            ("cap:effect=declared;x", "cap:x"),
            ("cap:effect;x", "cap:?effect;x"),
            (
                "cap:in=\"media:bytes;ext=pdf\";extract",
                "cap:extract;in=\"media:bytes;ext=pdf\"",
            ),
            ("cap:in=media:bytes;ext=pdf", "cap:ext=pdf;in=media:bytes"),
            ("cap:in=\"media:PDF\";x", "cap:in=media:pdf;x"),
        ];
        for (text, canonical) in pairs {
            assert_eq!(cap(text).to_string(), canonical, "{text}");
        }
    }

    #[test]
    fn specificity_examples_from_docs() {
        assert_eq!(cap("cap:extract").specificity(), 2);
        assert_eq!(
            cap("cap:extract;in=media:pdf;out=media:record").specificity(),
            20202
        );
        let text = "cap:in=\"media:bytes;ext=pdf\";extract;out=\"media:numeric;record\"";
        // docs/05 §3.5 prints 40402 reading `ext=pdf` as a marker; an exact value scores 4.
        assert_eq!(cap(text).specificity(), 40602);
        assert_eq!(cap("cap:extract;target=metadata").specificity(), 6);
        assert_eq!(cap("cap:extract;!constrained").specificity(), 7);
        assert_eq!(cap("cap:?effect").specificity(), 0);
    }

    #[test]
    fn errors() {
        assert_eq!(error("cap:"), ("bare_top_cap", 0));
        assert_eq!(error("cap:in=media:;out=media:"), ("bare_top_cap", 0));
        assert_eq!(error("media:x"), ("wrong_prefix", 0));
        assert_eq!(error("cap:?in;x"), ("invalid_direction", 4));
        assert_eq!(error("cap:x;effect=big"), ("invalid_effect", 6));
        assert_eq!(error("cap:x;!effect"), ("invalid_effect", 6));
        assert_eq!(error("cap:in=pdf;x"), ("missing_prefix", 7));
        assert_eq!(error("cap:x;in=\"media:a;1\""), ("invalid_key", 18));
        assert_eq!(
            error("cap:x;in=\"media:x=\\\"A\\\";1\""),
            ("invalid_key", 24)
        );
        assert_eq!(
            error("cap:in=media:void;text;out=\"media:void;text\""),
            ("void_not_atomic", 39)
        );
        assert_eq!(
            error("cap:effect=none;out=media:pdf"),
            ("inadmissible_effect", 4)
        );
    }

    #[test]
    fn quoted_media_keeps_quoted_case() {
        let parsed = cap("cap:x;in=\"media:t=\\\"PDF\\\"\"");
        assert_eq!(parsed.input().to_string(), "media:t=\"PDF\"");
        assert_eq!(parsed.to_string(), "cap:in=\"media:t=\\\"PDF\\\"\";x");
        assert_eq!(cap(&parsed.to_string()), parsed);
    }
}
