//! Media URNs: tagged URNs with the prefix `media` that type the data flowing into and out of a
//! cap (capdag docs/11).
//!
//! `media:` (no tags) is the top: every media URN conforms to it, and as a cap's side it means
//! "any data". `media:void` is the unit: no data flows on that side. `void` is atomic: a media
//! URN that combines it with any other tag is refused (capdag docs/11 §2.2, and its code).

use std::fmt;
use std::str::FromStr;

use super::tagged::{parse_spanned, Constraint, ParseError, ParseErrorKind, TagSpan, TaggedUrn};

/// A parsed, normalised media URN. Equality, ordering and hashing are structural (they agree
/// with the canonical text); [`MediaUrn::is_equivalent`] is the semantic relation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MediaUrn(TaggedUrn);

impl MediaUrn {
    /// The prefix every media URN has.
    pub const PREFIX: &'static str = "media";

    /// Parses `text` as a tagged URN (see [`TaggedUrn::parse`]) that must have the prefix
    /// `media` (else [`ParseErrorKind::WrongPrefix`] at byte 0) and must not combine `void`
    /// with another tag (else [`ParseErrorKind::VoidNotAtomic`] at the first other tag).
    /// Never panics.
    pub fn parse(text: &str) -> Result<MediaUrn, ParseError> {
        let (urn, spans) = parse_spanned(text)?;
        Self::from_parsed(urn, &spans)
    }

    /// `media:`, the top: accepts every media URN.
    pub fn top() -> MediaUrn {
        MediaUrn(TaggedUrn::empty(Self::PREFIX))
    }

    /// Whether `self`, as an instance, satisfies `pattern` (the docs/04 truth table on every
    /// key). Everything conforms to `media:`; `media:ext=pdf` does not conform to
    /// `media:bytes`, since it has no `bytes` tag (docs/spec/switch.md §4.5).
    pub fn conforms_to(&self, pattern: &MediaUrn) -> bool {
        self.0.conforms_to(&pattern.0)
    }

    /// Whether `self`, as a pattern, accepts `instance`: `instance.conforms_to(self)`.
    pub fn accepts(&self, instance: &MediaUrn) -> bool {
        self.0.accepts(&instance.0)
    }

    /// Whether each conforms to the other (reflexive and symmetric; see
    /// [`TaggedUrn::is_equivalent`] for why it is not transitive).
    pub fn is_equivalent(&self, other: &MediaUrn) -> bool {
        self.0.is_equivalent(&other.0)
    }

    /// Whether either conforms to the other.
    pub fn is_comparable(&self, other: &MediaUrn) -> bool {
        self.0.is_comparable(&other.0)
    }

    /// Whether this is `media:`, the top (no tags).
    pub fn is_top(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether this is `media:void`, the unit type.
    pub fn is_void(&self) -> bool {
        self.0.len() == 1 && self.0.constraint("void") == Some(&Constraint::Present)
    }

    /// The sum of the tags' specificity (capdag docs/05 §3.3): 0 for `media:`, 2 for
    /// `media:void`.
    pub fn specificity(&self) -> u64 {
        self.0.specificity()
    }

    /// The underlying tagged URN.
    pub fn as_tagged(&self) -> &TaggedUrn {
        &self.0
    }

    /// Checks a parsed tagged URN is a media URN; `spans` locate its tags in the parsed text.
    fn from_parsed(urn: TaggedUrn, spans: &[TagSpan]) -> Result<MediaUrn, ParseError> {
        if urn.prefix() != Self::PREFIX {
            return Err(ParseError::new(ParseErrorKind::WrongPrefix, 0));
        }
        if urn.constraint("void").is_some() && urn.len() > 1 {
            let other = spans.iter().find(|span| span.key != "void");
            debug_assert!(
                other.is_some(),
                "a URN with two tags has a tag other than void"
            );
            let offset = other.map_or(0, |span| span.start);
            return Err(ParseError::new(ParseErrorKind::VoidNotAtomic, offset));
        }
        Ok(MediaUrn(urn))
    }
}

impl fmt::Display for MediaUrn {
    /// The canonical text (see [`TaggedUrn`]'s `Display`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for MediaUrn {
    type Err = ParseError;

    fn from_str(text: &str) -> Result<Self, ParseError> {
        Self::parse(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn media(text: &str) -> MediaUrn {
        MediaUrn::parse(text).unwrap()
    }

    #[test]
    fn top_and_void() {
        assert_eq!(MediaUrn::top(), media("media:"));
        assert_eq!(MediaUrn::top().to_string(), "media:");
        assert!(media("MEDIA:").is_top());
        assert!(media("media:void").is_void() && !media("media:void").is_top());
        assert_eq!(media("media:void").specificity(), 2);
        assert!(media("media:void").conforms_to(&MediaUrn::top()));
    }

    #[test]
    fn conformance_examples_from_docs() {
        let (bytes, pdf) = (media("media:bytes"), media("media:bytes;ext=pdf"));
        assert!(pdf.conforms_to(&bytes) && !bytes.conforms_to(&pdf));
        assert!(bytes.accepts(&pdf));
        assert!(!media("media:ext=pdf").conforms_to(&bytes));
        assert!(!media("media:ext=pdf").is_comparable(&media("media:image")));
        assert!(media("media:bytes;ext=pdf").is_equivalent(&media("media:ext=pdf;bytes")));
    }

    #[test]
    fn void_is_atomic() {
        let error = MediaUrn::parse("media:void;text").unwrap_err();
        assert_eq!(
            (error.kind, error.offset),
            (ParseErrorKind::VoidNotAtomic, 11)
        );
        let error = MediaUrn::parse("media:pdf;!void").unwrap_err();
        assert_eq!(
            (error.kind, error.offset),
            (ParseErrorKind::VoidNotAtomic, 6)
        );
        assert!(MediaUrn::parse("media:!void").is_ok());
    }

    #[test]
    fn wrong_prefix() {
        let error = MediaUrn::parse("cap:pdf").unwrap_err();
        assert_eq!((error.kind, error.offset), (ParseErrorKind::WrongPrefix, 0));
    }
}
