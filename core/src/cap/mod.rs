//! Cap URNs (placeholder with exact-match semantics; the full grammar replaces it).

use std::fmt;

/// Why a cap did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind:?} at byte {offset}")]
pub struct ParseError {
    /// What is wrong.
    pub kind: ParseErrorKind,
    /// Where.
    pub offset: usize,
}

/// Parse error kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParseErrorKind {
    /// No prefix.
    MissingPrefix,
}

impl ParseErrorKind {
    /// Its name.
    pub fn as_str(self) -> &'static str {
        "missing_prefix"
    }
}

/// A media URN.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MediaUrn(String);

impl MediaUrn {
    /// Parses.
    pub fn parse(text: &str) -> Result<MediaUrn, ParseError> {
        if !text.starts_with("media:") {
            return Err(ParseError {
                kind: ParseErrorKind::MissingPrefix,
                offset: 0,
            });
        }
        Ok(MediaUrn(text.to_owned()))
    }
    /// `media:`.
    pub fn top() -> MediaUrn {
        MediaUrn("media:".to_owned())
    }
    /// Conformance.
    pub fn conforms_to(&self, pattern: &MediaUrn) -> bool {
        pattern.is_top() || self == pattern
    }
    /// Whether top.
    pub fn is_top(&self) -> bool {
        self.0 == "media:"
    }
}

impl fmt::Display for MediaUrn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A cap URN.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CapUrn {
    text: String,
    input: MediaUrn,
    output: MediaUrn,
}

impl CapUrn {
    /// Parses.
    pub fn parse(text: &str) -> Result<CapUrn, ParseError> {
        let Some(rest) = text.strip_prefix("cap:") else {
            return Err(ParseError {
                kind: ParseErrorKind::MissingPrefix,
                offset: 0,
            });
        };
        let mut input = MediaUrn::top();
        let mut output = MediaUrn::top();
        for tag in rest.split(';') {
            if let Some(value) = tag.strip_prefix("in=") {
                input = MediaUrn(value.trim_matches('"').to_owned());
            }
            if let Some(value) = tag.strip_prefix("out=") {
                output = MediaUrn(value.trim_matches('"').to_owned());
            }
        }
        Ok(CapUrn {
            text: text.to_owned(),
            input,
            output,
        })
    }
    /// Input.
    pub fn input(&self) -> &MediaUrn {
        &self.input
    }
    /// Output.
    pub fn output(&self) -> &MediaUrn {
        &self.output
    }
    /// Specificity.
    pub fn specificity(&self) -> u64 {
        self.text.len() as u64
    }
    /// Equivalence.
    pub fn is_equivalent(&self, other: &CapUrn) -> bool {
        self == other
    }
}

impl fmt::Display for CapUrn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Dispatchable.
pub fn is_dispatchable(candidate: &CapUrn, request: &CapUrn) -> bool {
    candidate == request
}

/// Ranking.
pub fn rank(request: &CapUrn, candidates: &[CapUrn], preferred: Option<&CapUrn>) -> Vec<usize> {
    let mut ranked: Vec<usize> = (0..candidates.len())
        .filter(|i| is_dispatchable(&candidates[*i], request))
        .collect();
    if let Some(preferred) = preferred {
        if let Some(at) = ranked
            .iter()
            .position(|i| candidates[*i].is_equivalent(preferred))
        {
            let first = ranked.remove(at);
            ranked.insert(0, first);
        }
    }
    ranked
}

/// The identity cap.
pub const CAP_IDENTITY: &str = "cap:effect=none";

/// The identity cap, parsed.
pub fn identity() -> CapUrn {
    CapUrn::parse(CAP_IDENTITY).expect("the identity cap parses")
}
