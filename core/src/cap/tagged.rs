//! Tagged URNs: `prefix:tag;tag;...`, the grammar under every media and cap URN
//! (docs/spec/switch.md §4.1; capdag docs/03 and docs/04).
//!
//! A tag puts one of six constraints on its key; a key the URN does not mention is unconstrained.
//! Parsing normalises (prefix, keys and unquoted values lowercased, tags sorted, aliases folded)
//! so that two texts meaning the same thing parse to equal values, and printing writes the one
//! canonical text of a value. `parse(print(u)) == u` and printing is stable.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use crate::limits::{CAP_URN_BYTES_MAX, CAP_URN_TAGS_MAX};

/// What one tag says about its key. Each form has a specificity (docs/spec/switch.md §4.1,
/// capdag docs/05 §2.2); a key a URN does not mention scores 0 like [`Constraint::Unconstrained`].
///
/// | Form | Canonical text | Aliases accepted by the parser | Specificity |
/// |---|---|---|---|
/// | [`Unconstrained`](Self::Unconstrained) | `?x` | `x?`, `x=?` | 0 |
/// | [`AbsentOrNot`](Self::AbsentOrNot) | `x?=v` | `?x=v` | 1 |
/// | [`Present`](Self::Present) | `x` | `x=*`, `x="*"` | 2 |
/// | [`PresentNot`](Self::PresentNot) | `x!=v` | `!x=v` | 3 |
/// | [`Exact`](Self::Exact) | `x=v` | | 4 |
/// | [`Absent`](Self::Absent) | `!x` | `x!`, `x=!` | 5 |
///
/// `x=?v` and `x=!v` are the exact values `?v` and `!v`, not aliases (docs/spec/switch.md §4.5:
/// capdag's code differs from its docs here, and the code is what peers run).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Constraint {
    /// `?x`: no constraint on the key.
    Unconstrained,
    /// `x?=v`: the key is absent, or present with a value other than `v`.
    AbsentOrNot(String),
    /// `x`: the key is present, with any value.
    Present,
    /// `x!=v`: the key is present, with a value other than `v`.
    PresentNot(String),
    /// `x=v`: the key is present with exactly the value `v` (compared byte for byte).
    Exact(String),
    /// `!x`: the key is absent.
    Absent,
}

impl Constraint {
    /// The form's specificity: 0 for `?x`, 1 `x?=v`, 2 `x`, 3 `x!=v`, 4 `x=v`, 5 `!x`.
    pub fn specificity(&self) -> u64 {
        match self {
            Self::Unconstrained => 0,
            Self::AbsentOrNot(_) => 1,
            Self::Present => 2,
            Self::PresentNot(_) => 3,
            Self::Exact(_) => 4,
            Self::Absent => 5,
        }
    }

    /// Whether an instance whose tag for some key is `instance` satisfies a pattern whose tag
    /// for that key is `pattern` (`None`: the URN does not mention the key). This is the
    /// per-key truth table of capdag docs/04 §2.5, which docs/spec/switch.md §4.1 names as the
    /// rule:
    ///
    /// - a pattern that is missing or `?x` accepts every instance;
    /// - an instance `?x` satisfies every pattern (it defers to the pattern);
    /// - an instance that is missing, `x?=v` or `!x` may lack the key, so it satisfies only
    ///   the patterns that allow absence: `x?=p` and `!x`;
    /// - an instance `x` or `x!=v` satisfies every pattern except `!x`, except that `x!=v`
    ///   fails `x=v` (it forbids the very value asked for);
    /// - an instance `x=v` satisfies `x`, satisfies `x=p` when `v == p` and `x?=p` / `x!=p`
    ///   when `v != p`, and fails `!x`.
    pub fn matches(instance: Option<&Constraint>, pattern: Option<&Constraint>) -> bool {
        use Constraint::*;
        let Some(pattern) = pattern else { return true };
        match (instance, pattern) {
            (_, Unconstrained) | (Some(Unconstrained), _) => true,
            (None | Some(AbsentOrNot(_) | Absent), _) => matches!(pattern, AbsentOrNot(_) | Absent),
            (Some(Present), _) => *pattern != Absent,
            (Some(PresentNot(value)), Exact(wanted)) => value != wanted,
            (Some(PresentNot(_)), _) => *pattern != Absent,
            (Some(Exact(value)), AbsentOrNot(refused) | PresentNot(refused)) => value != refused,
            (Some(Exact(value)), Exact(wanted)) => value == wanted,
            (Some(Exact(_)), Present) => true,
            (Some(Exact(_)), Absent) => false,
        }
    }

    /// The constraint of a tag written `key=value`, after the value's quotes and escapes are
    /// taken off, with `qualifier` the `?` or `!` written before the key or before the `=`.
    ///
    /// Quoting protects characters and case, not meaning: `x="*"` is `x` (docs/spec/switch.md
    /// §4.5), and likewise every value text means what it means unquoted, which is how capdag's
    /// code stores tags. That keeps an exact value from ever being a sigil (`*`, `?`, `!`) or
    /// starting with `?=` / `!=`, so every constraint has exactly one canonical text.
    fn from_value(qualifier: Option<char>, value: String) -> Result<Self, ParseErrorKind> {
        match qualifier {
            Some(qualifier) => Self::qualified(qualifier, value),
            None => match value.as_str() {
                "*" => Ok(Self::Present),
                "?" => Ok(Self::Unconstrained),
                "!" => Ok(Self::Absent),
                text if text.starts_with("?=") || text.starts_with("!=") => {
                    let qualifier = if text.starts_with('?') { '?' } else { '!' };
                    Self::qualified(qualifier, text[2..].to_owned())
                }
                _ => Ok(Self::Exact(value)),
            },
        }
    }

    /// `x?=value` or `x!=value`. A qualifier on a sigil would mix two meanings (capdag docs/03
    /// §4.2), so `?x=*`, `x!=?` and the like are refused.
    fn qualified(qualifier: char, value: String) -> Result<Self, ParseErrorKind> {
        if value.is_empty() {
            return Err(ParseErrorKind::EmptyValue);
        }
        if matches!(value.as_str(), "*" | "?" | "!") {
            return Err(ParseErrorKind::QualifiedSigil);
        }
        Ok(if qualifier == '?' {
            Self::AbsentOrNot(value)
        } else {
            Self::PresentNot(value)
        })
    }
}

/// A parsed, normalised tagged URN: a lowercase prefix and its tags, sorted by key.
///
/// Equality, ordering and hashing are structural and so agree with the canonical text
/// ([`Display`](fmt::Display)). Semantic equivalence under the truth table is
/// [`is_equivalent`](Self::is_equivalent), which is weaker.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaggedUrn {
    prefix: String,
    tags: BTreeMap<String, Constraint>,
}

impl TaggedUrn {
    /// Parses `text`. Never panics; refuses text longer than [`CAP_URN_BYTES_MAX`] bytes or with
    /// more than [`CAP_URN_TAGS_MAX`] tags. The error's offset is the byte of `text` where the
    /// problem is (at most `text.len()`).
    ///
    /// Grammar (docs/spec/switch.md §4.1; capdag docs/03): `prefix:tag;tag;...` where the prefix
    /// and keys are `[a-z][a-z0-9-]*` after lowercasing, a tag is one of the forms of
    /// [`Constraint`], values are unquoted (letters, digits and `-_./:*?!`, lowercased) or
    /// double-quoted (any text, case kept, escapes `\"` and `\\` only), empty segments (`;;`, a
    /// trailing `;`) are skipped and a key may appear once.
    pub fn parse(text: &str) -> Result<Self, ParseError> {
        parse_spanned(text).map(|(urn, _)| urn)
    }

    /// The URN `prefix:` with no tags: the top of its prefix, accepting every URN with that
    /// prefix. `prefix` must already be lowercase and valid (an internal, static name).
    pub(crate) fn empty(prefix: &str) -> Self {
        debug_assert!(parse_prefix(prefix).is_ok_and(|parsed| parsed == prefix));
        Self {
            prefix: prefix.to_owned(),
            tags: BTreeMap::new(),
        }
    }

    /// The lowercase prefix (the part before the first `:`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The constraint the URN puts on `key`, if it mentions `key`.
    pub fn constraint(&self, key: &str) -> Option<&Constraint> {
        self.tags.get(key)
    }

    /// The tags, sorted by key.
    pub fn tags(&self) -> impl Iterator<Item = (&str, &Constraint)> + '_ {
        self.tags
            .iter()
            .map(|(key, constraint)| (key.as_str(), constraint))
    }

    /// How many tags the URN has.
    pub fn len(&self) -> usize {
        self.tags.len()
    }

    /// Whether the URN has no tags (it is the top of its prefix).
    pub fn is_empty(&self) -> bool {
        self.tags.is_empty()
    }

    /// The sum of the specificity of every tag (capdag docs/05 §2).
    pub fn specificity(&self) -> u64 {
        self.tags.values().map(Constraint::specificity).sum()
    }

    /// Whether `self`, as a pattern, accepts `instance`: same prefix, and every key passes
    /// [`Constraint::matches`]. A key only the instance mentions always passes (the pattern
    /// does not constrain it), so only the pattern's keys are checked.
    pub fn accepts(&self, instance: &TaggedUrn) -> bool {
        self.prefix == instance.prefix
            && self
                .tags
                .iter()
                .all(|(key, pattern)| Constraint::matches(instance.tags.get(key), Some(pattern)))
    }

    /// Whether `self`, as an instance, satisfies `pattern`: `pattern.accepts(self)`.
    pub fn conforms_to(&self, pattern: &TaggedUrn) -> bool {
        pattern.accepts(self)
    }

    /// Whether either URN accepts the other.
    pub fn is_comparable(&self, other: &TaggedUrn) -> bool {
        self.accepts(other) || other.accepts(self)
    }

    /// Whether each URN accepts the other. Reflexive and symmetric, but not transitive under
    /// the docs/04 truth table: `x=a` and `x=b` are each equivalent to `x` (an instance `x`
    /// defers its value) yet not to each other.
    pub fn is_equivalent(&self, other: &TaggedUrn) -> bool {
        self.accepts(other) && other.accepts(self)
    }

    /// Takes the tag of `key` out (the cap parser lifts `in`, `out` and `effect` out this way).
    pub(crate) fn remove(&mut self, key: &str) -> Option<Constraint> {
        self.tags.remove(key)
    }

    /// Sets the tag of `key`; `key` must be a valid, lowercase key. The cap printer uses it to
    /// put `in`, `out` and `effect` back for printing.
    pub(crate) fn insert(&mut self, key: &str, constraint: Constraint) {
        debug_assert!(check_key(key, 0).is_ok_and(|checked| checked == key));
        self.tags.insert(key.to_owned(), constraint);
    }
}

impl fmt::Display for TaggedUrn {
    /// The canonical text: `prefix:` then the tags in key order, each in its canonical form,
    /// separated by `;`, values quoted only when they must be.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:", self.prefix)?;
        for (index, (key, constraint)) in self.tags.iter().enumerate() {
            if index > 0 {
                f.write_str(";")?;
            }
            write_tag(f, key, constraint)?;
        }
        Ok(())
    }
}

impl FromStr for TaggedUrn {
    type Err = ParseError;

    fn from_str(text: &str) -> Result<Self, ParseError> {
        Self::parse(text)
    }
}

/// Why a URN text was refused, and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[error("{kind} at byte {offset}")]
pub struct ParseError {
    /// What is wrong.
    pub kind: ParseErrorKind,
    /// The byte offset in the input of the problem; never past the input's end.
    pub offset: usize,
}

impl ParseError {
    pub(crate) fn new(kind: ParseErrorKind, offset: usize) -> Self {
        Self { kind, offset }
    }
}

/// What is wrong with a URN text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[non_exhaustive]
pub enum ParseErrorKind {
    /// The text is longer than [`CAP_URN_BYTES_MAX`]; the offset is that limit.
    #[error("longer than {CAP_URN_BYTES_MAX} bytes")]
    TooLong,
    /// The text has no `:`; the offset is 0.
    #[error("no prefix (no ':')")]
    MissingPrefix,
    /// The text starts with `:`.
    #[error("empty prefix")]
    EmptyPrefix,
    /// The prefix is not `[a-z][a-z0-9-]*` (case-insensitive); the offset is the bad byte.
    #[error("invalid prefix")]
    InvalidPrefix,
    /// The prefix is not the one expected (`media` for a media URN, `cap` for a cap URN).
    #[error("wrong prefix")]
    WrongPrefix,
    /// A tag has no key (`p:=v`, a bare `?` or `!`).
    #[error("empty key")]
    EmptyKey,
    /// A key is not `[a-z][a-z0-9-]*` (case-insensitive); the offset is the bad byte.
    #[error("invalid key")]
    InvalidKey,
    /// A key appears twice; the offset is the second one.
    #[error("duplicate key")]
    DuplicateKey,
    /// A tag has two qualifiers (`?x?`, `!x!=v`, `?!x`).
    #[error("more than one qualifier on a key")]
    DuplicateQualifier,
    /// A qualifier with a sigil value (`?x=*`, `x!=?`, `x?=!`).
    #[error("a qualifier with a sigil value")]
    QualifiedSigil,
    /// `x=`, `x=""` or a qualified empty value.
    #[error("empty value")]
    EmptyValue,
    /// A byte an unquoted value may not hold (space, `"`, `=`, `\`, punctuation...).
    #[error("invalid character in an unquoted value")]
    InvalidCharacter,
    /// Something other than `;` or the end after a closing quote, or other than `=`, `;` or
    /// the end after a qualifier following a key.
    #[error("unexpected character")]
    UnexpectedCharacter,
    /// A quoted value is not closed; the offset is its opening quote.
    #[error("unterminated quote")]
    UnterminatedQuote,
    /// A backslash in a quoted value not followed by `"` or `\`; the offset is the backslash.
    #[error("invalid escape")]
    InvalidEscape,
    /// More than [`CAP_URN_TAGS_MAX`] tags; the offset is the first tag past the limit.
    #[error("more than {CAP_URN_TAGS_MAX} tags")]
    TooManyTags,
    /// A media URN combines `void` with another tag (capdag docs/11 §2.2: the unit type is
    /// atomic); the offset is the first other tag.
    #[error("media:void combined with another tag")]
    VoidNotAtomic,
    /// A cap's `in` or `out` is not a media URN, `*` or value-less.
    #[error("in/out is not a media URN")]
    InvalidDirection,
    /// A cap's `effect` is not `declared`, `none`, `patch`, `?`/`*` or value-less.
    #[error("invalid effect")]
    InvalidEffect,
    /// The cap is the illegal bare top form (`cap:`, `cap:in=media:;out=media:`): declared
    /// effect, both sides `media:` and no tags (capdag docs/06 §4.2).
    #[error("bare top cap (use cap:effect=none for identity)")]
    BareTopCap,
    /// `effect=none` on a cap whose input does not conform to its output.
    #[error("effect=none with an input that does not conform to the output")]
    InadmissibleEffect,
}

impl ParseErrorKind {
    /// A stable snake_case name, for logs, metrics and golden vectors.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TooLong => "too_long",
            Self::MissingPrefix => "missing_prefix",
            Self::EmptyPrefix => "empty_prefix",
            Self::InvalidPrefix => "invalid_prefix",
            Self::WrongPrefix => "wrong_prefix",
            Self::EmptyKey => "empty_key",
            Self::InvalidKey => "invalid_key",
            Self::DuplicateKey => "duplicate_key",
            Self::DuplicateQualifier => "duplicate_qualifier",
            Self::QualifiedSigil => "qualified_sigil",
            Self::EmptyValue => "empty_value",
            Self::InvalidCharacter => "invalid_character",
            Self::UnexpectedCharacter => "unexpected_character",
            Self::UnterminatedQuote => "unterminated_quote",
            Self::InvalidEscape => "invalid_escape",
            Self::TooManyTags => "too_many_tags",
            Self::VoidNotAtomic => "void_not_atomic",
            Self::InvalidDirection => "invalid_direction",
            Self::InvalidEffect => "invalid_effect",
            Self::BareTopCap => "bare_top_cap",
            Self::InadmissibleEffect => "inadmissible_effect",
        }
    }
}

/// Where one tag sat in the text it was parsed from. The media and cap parsers use it to point
/// their own errors at the right byte, including errors inside a quoted media URN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TagSpan {
    /// The tag's (lowercase) key.
    pub(crate) key: String,
    /// The tag's first byte (its qualifier or key).
    pub(crate) start: usize,
    /// The value, when the tag was written with `=`.
    pub(crate) value: Option<ValueSpan>,
}

/// Where a tag's value sat in the text it was parsed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ValueSpan {
    /// The value's first byte: its opening quote when quoted.
    pub(crate) start: usize,
    /// Whether the value was quoted.
    pub(crate) quoted: bool,
}

impl ValueSpan {
    /// The byte of the original `text` that byte `inner` of the value's unquoted, unescaped
    /// content came from. Unquoted values keep their length (only ASCII is lowercased); in a
    /// quoted value each escape is two bytes of text for one byte of content.
    pub(crate) fn outer_offset(&self, text: &str, inner: usize) -> usize {
        if !self.quoted {
            return (self.start + inner).min(text.len());
        }
        let bytes = text.as_bytes();
        let (mut raw, mut cooked) = (self.start + 1, 0);
        while cooked < inner && raw < bytes.len() {
            raw += if bytes[raw] == b'\\' { 2 } else { 1 };
            cooked += 1;
        }
        raw.min(text.len())
    }
}

/// Parses `text` as a tagged URN and also returns where each tag sat, in text order.
pub(crate) fn parse_spanned(text: &str) -> Result<(TaggedUrn, Vec<TagSpan>), ParseError> {
    if text.len() > CAP_URN_BYTES_MAX {
        return Err(ParseError::new(ParseErrorKind::TooLong, CAP_URN_BYTES_MAX));
    }
    let Some(colon) = text.find(':') else {
        return Err(ParseError::new(ParseErrorKind::MissingPrefix, 0));
    };
    let prefix = parse_prefix(&text[..colon])?;
    let mut cursor = Cursor {
        text,
        pos: colon + 1,
    };
    let mut tags = BTreeMap::new();
    let mut spans = Vec::new();
    while let Some(c) = cursor.peek() {
        if c == ';' {
            cursor.bump();
            continue;
        }
        if tags.len() == CAP_URN_TAGS_MAX {
            return Err(ParseError::new(ParseErrorKind::TooManyTags, cursor.pos));
        }
        let tag = parse_tag(&mut cursor)?;
        debug_assert!(
            matches!(cursor.peek(), None | Some(';')),
            "a tag ends at ';' or the end"
        );
        if tags.contains_key(&tag.span.key) {
            return Err(ParseError::new(ParseErrorKind::DuplicateKey, tag.key_start));
        }
        tags.insert(tag.span.key.clone(), tag.constraint);
        spans.push(tag.span);
    }
    Ok((TaggedUrn { prefix, tags }, spans))
}

/// One parsed tag.
struct ParsedTag {
    span: TagSpan,
    key_start: usize,
    constraint: Constraint,
}

/// A read position in the text being parsed. `pos` is always on a char boundary.
struct Cursor<'a> {
    text: &'a str,
    pos: usize,
}

impl Cursor<'_> {
    fn peek(&self) -> Option<char> {
        self.text[self.pos..].chars().next()
    }

    fn bump(&mut self) {
        if let Some(c) = self.peek() {
            self.pos += c.len_utf8();
        }
    }

    fn error(&self, kind: ParseErrorKind) -> ParseError {
        ParseError::new(kind, self.pos)
    }
}

/// Checks and lowercases a prefix (the text before the first `:`).
fn parse_prefix(raw: &str) -> Result<String, ParseError> {
    if raw.is_empty() {
        return Err(ParseError::new(ParseErrorKind::EmptyPrefix, 0));
    }
    check_identifier(raw, 0, ParseErrorKind::InvalidPrefix)
}

/// Checks and lowercases a key starting at byte `start` of the text.
fn check_key(raw: &str, start: usize) -> Result<String, ParseError> {
    check_identifier(raw, start, ParseErrorKind::InvalidKey)
}

/// `raw` lowercased, if it is `[a-zA-Z][a-zA-Z0-9-]*`; else `kind` at its first bad byte.
fn check_identifier(raw: &str, start: usize, kind: ParseErrorKind) -> Result<String, ParseError> {
    for (index, c) in raw.char_indices() {
        let valid = if index == 0 {
            c.is_ascii_alphabetic()
        } else {
            c.is_ascii_alphanumeric() || c == '-'
        };
        if !valid {
            return Err(ParseError::new(kind, start + index));
        }
    }
    Ok(raw.to_ascii_lowercase())
}

/// Parses one tag, leaving the cursor on the `;` after it or at the end.
fn parse_tag(cursor: &mut Cursor<'_>) -> Result<ParsedTag, ParseError> {
    let start = cursor.pos;
    let mut qualifier = None;
    if let Some(q @ ('?' | '!')) = cursor.peek() {
        qualifier = Some(q);
        cursor.bump();
        if let Some('?' | '!') = cursor.peek() {
            return Err(cursor.error(ParseErrorKind::DuplicateQualifier));
        }
    }
    let key_start = cursor.pos;
    while cursor
        .peek()
        .is_some_and(|c| !matches!(c, '?' | '!' | '=' | ';'))
    {
        cursor.bump();
    }
    let raw_key = &cursor.text[key_start..cursor.pos];
    if raw_key.is_empty() {
        return Err(cursor.error(ParseErrorKind::EmptyKey));
    }
    let key = check_key(raw_key, key_start)?;
    if let Some(q @ ('?' | '!')) = cursor.peek() {
        if qualifier.is_some() {
            return Err(cursor.error(ParseErrorKind::DuplicateQualifier));
        }
        qualifier = Some(q);
        cursor.bump();
        match cursor.peek() {
            None | Some(';' | '=') => {}
            Some('?' | '!') => return Err(cursor.error(ParseErrorKind::DuplicateQualifier)),
            Some(_) => return Err(cursor.error(ParseErrorKind::UnexpectedCharacter)),
        }
    }
    if cursor.peek() != Some('=') {
        let constraint = match qualifier {
            None => Constraint::Present,
            Some('?') => Constraint::Unconstrained,
            Some(_) => Constraint::Absent,
        };
        let span = TagSpan {
            key,
            start,
            value: None,
        };
        return Ok(ParsedTag {
            span,
            key_start,
            constraint,
        });
    }
    cursor.bump();
    let value_start = cursor.pos;
    let (value, quoted) = parse_value(cursor)?;
    let constraint = Constraint::from_value(qualifier, value)
        .map_err(|kind| ParseError::new(kind, value_start))?;
    let value = Some(ValueSpan {
        start: value_start,
        quoted,
    });
    Ok(ParsedTag {
        span: TagSpan { key, start, value },
        key_start,
        constraint,
    })
}

/// Parses a value after its `=`: the content and whether it was quoted. Leaves the cursor on
/// the `;` after it or at the end.
fn parse_value(cursor: &mut Cursor<'_>) -> Result<(String, bool), ParseError> {
    match cursor.peek() {
        None | Some(';') => Err(cursor.error(ParseErrorKind::EmptyValue)),
        Some('"') => parse_quoted(cursor).map(|value| (value, true)),
        Some(_) => parse_unquoted(cursor).map(|value| (value, false)),
    }
}

/// A quoted value: any text, case kept, with `\"` and `\\` the only escapes.
fn parse_quoted(cursor: &mut Cursor<'_>) -> Result<String, ParseError> {
    let open = cursor.pos;
    cursor.bump();
    let mut value = String::new();
    loop {
        match cursor.peek() {
            None => return Err(ParseError::new(ParseErrorKind::UnterminatedQuote, open)),
            Some('"') => break,
            Some('\\') => {
                let backslash = cursor.pos;
                cursor.bump();
                match cursor.peek() {
                    Some(c @ ('"' | '\\')) => value.push(c),
                    None => return Err(ParseError::new(ParseErrorKind::UnterminatedQuote, open)),
                    Some(_) => {
                        return Err(ParseError::new(ParseErrorKind::InvalidEscape, backslash))
                    }
                }
            }
            Some(c) => value.push(c),
        }
        cursor.bump();
    }
    cursor.bump();
    if !matches!(cursor.peek(), None | Some(';')) {
        return Err(cursor.error(ParseErrorKind::UnexpectedCharacter));
    }
    if value.is_empty() {
        return Err(ParseError::new(ParseErrorKind::EmptyValue, open));
    }
    Ok(value)
}

/// An unquoted value, ASCII-lowercased.
fn parse_unquoted(cursor: &mut Cursor<'_>) -> Result<String, ParseError> {
    let mut value = String::new();
    while let Some(c) = cursor.peek() {
        if c == ';' {
            break;
        }
        if !is_unquoted_char(c) {
            return Err(cursor.error(ParseErrorKind::InvalidCharacter));
        }
        value.push(c.to_ascii_lowercase());
        cursor.bump();
    }
    Ok(value)
}

/// Whether `c` may appear in an unquoted value: ASCII letters and digits, `-_./:*?!`, and
/// non-ASCII letters and digits (capdag's code accepts these; only ASCII is lowercased).
fn is_unquoted_char(c: char) -> bool {
    c.is_ascii_alphanumeric()
        || matches!(c, '-' | '_' | '.' | '/' | ':' | '*' | '?' | '!')
        || (!c.is_ascii() && c.is_alphanumeric())
}

/// Whether `value` must be quoted to read back as itself: it holds a character an unquoted
/// value may not, or an uppercase letter (which unquoted text would lose).
fn needs_quotes(value: &str) -> bool {
    value.is_empty()
        || value
            .chars()
            .any(|c| !is_unquoted_char(c) || c.is_uppercase())
}

/// Writes `value`, quoted and escaped when it must be.
pub(crate) fn write_value(f: &mut fmt::Formatter<'_>, value: &str) -> fmt::Result {
    if !needs_quotes(value) {
        return f.write_str(value);
    }
    f.write_str("\"")?;
    for c in value.chars() {
        if matches!(c, '"' | '\\') {
            f.write_str("\\")?;
        }
        write!(f, "{c}")?;
    }
    f.write_str("\"")
}

/// Writes one tag in its canonical form.
fn write_tag(f: &mut fmt::Formatter<'_>, key: &str, constraint: &Constraint) -> fmt::Result {
    let (before, after, value) = match constraint {
        Constraint::Unconstrained => ("?", "", None),
        Constraint::AbsentOrNot(value) => ("", "?=", Some(value)),
        Constraint::Present => ("", "", None),
        Constraint::PresentNot(value) => ("", "!=", Some(value)),
        Constraint::Exact(value) => ("", "=", Some(value)),
        Constraint::Absent => ("!", "", None),
    };
    write!(f, "{before}{key}{after}")?;
    match value {
        Some(value) => write_value(f, value),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canonical(text: &str) -> String {
        TaggedUrn::parse(text).unwrap().to_string()
    }

    fn error(text: &str) -> (&'static str, usize) {
        let error = TaggedUrn::parse(text).unwrap_err();
        (error.kind.as_str(), error.offset)
    }

    fn tag(text: &str, key: &str) -> Constraint {
        TaggedUrn::parse(text)
            .unwrap()
            .constraint(key)
            .cloned()
            .unwrap()
    }

    #[test]
    fn aliases_fold_to_six_forms() {
        use Constraint::*;
        for text in ["p:?x", "p:x?", "p:x=?", "p:x=\"?\""] {
            assert_eq!(tag(text, "x"), Unconstrained, "{text}");
        }
        for text in ["p:x?=v", "p:?x=v", "p:x=\"?=v\""] {
            assert_eq!(tag(text, "x"), AbsentOrNot("v".into()), "{text}");
        }
        for text in ["p:x", "p:x=*", "p:X=\"*\""] {
            assert_eq!(tag(text, "x"), Present, "{text}");
        }
        for text in ["p:x!=v", "p:!x=v", "p:x=\"!=v\""] {
            assert_eq!(tag(text, "x"), PresentNot("v".into()), "{text}");
        }
        for text in ["p:!x", "p:x!", "p:x=!", "p:x=\"!\""] {
            assert_eq!(tag(text, "x"), Absent, "{text}");
        }
        assert_eq!(tag("p:x=?v", "x"), Exact("?v".into()));
        assert_eq!(tag("p:x=!v", "x"), Exact("!v".into()));
        assert_eq!(tag("p:x=V", "x"), Exact("v".into()));
        assert_eq!(tag("p:x=\"V\"", "x"), Exact("V".into()));
    }

    #[test]
    fn canonical_text_is_sorted_lowercase_and_minimally_quoted() {
        assert_eq!(canonical("MEDIA:PDF;Bytes"), "media:bytes;pdf");
        assert_eq!(canonical("p:b=1;a;"), "p:a;b=1");
        assert_eq!(canonical("p:;;a;;"), "p:a");
        assert_eq!(canonical("p:x=\"simple\""), "p:x=simple");
        assert_eq!(canonical("p:x=\"Has Upper\""), "p:x=\"Has Upper\"");
        assert_eq!(canonical("p:x=\"a;b=c\""), "p:x=\"a;b=c\"");
        assert_eq!(canonical(r#"p:x="q\"b\\s""#), r#"p:x="q\"b\\s""#);
        assert_eq!(canonical("p:x=?;y!;?z=v;!w=v"), "p:w!=v;?x;!y;z?=v");
        assert_eq!(canonical("p:x!=\"A\""), "p:x!=\"A\"");
    }

    #[test]
    fn errors_name_kind_and_byte() {
        assert_eq!(error(""), ("missing_prefix", 0));
        assert_eq!(error("extract"), ("missing_prefix", 0));
        assert_eq!(error(":x"), ("empty_prefix", 0));
        assert_eq!(error("c p:x"), ("invalid_prefix", 1));
        assert_eq!(error("p:=v"), ("empty_key", 2));
        assert_eq!(error("p:?"), ("empty_key", 3));
        assert_eq!(error("p:a;1b"), ("invalid_key", 4));
        assert_eq!(error("p:a_b"), ("invalid_key", 3));
        assert_eq!(error("p:a;b;A=1"), ("duplicate_key", 6));
        assert_eq!(error("p:?x?"), ("duplicate_qualifier", 4));
        assert_eq!(error("p:?!x"), ("duplicate_qualifier", 3));
        assert_eq!(error("p:x?y"), ("unexpected_character", 4));
        assert_eq!(error("p:?x=*"), ("qualified_sigil", 5));
        assert_eq!(error("p:x="), ("empty_value", 4));
        assert_eq!(error("p:x=\"\""), ("empty_value", 4));
        assert_eq!(error("p:x=a b"), ("invalid_character", 5));
        assert_eq!(error("p:x=\"a\"b"), ("unexpected_character", 7));
        assert_eq!(error("p:x=\"abc"), ("unterminated_quote", 4));
        assert_eq!(error("p:x=\"a\\nb\""), ("invalid_escape", 6));
        let long = format!("p:x={}", "a".repeat(CAP_URN_BYTES_MAX));
        assert_eq!(error(&long), ("too_long", CAP_URN_BYTES_MAX));
    }

    #[test]
    fn tag_count_is_bounded() {
        let keys: Vec<String> = (0..=CAP_URN_TAGS_MAX).map(|i| format!("k{i}")).collect();
        let at_limit = format!("p:{}", keys[..CAP_URN_TAGS_MAX].join(";"));
        assert_eq!(TaggedUrn::parse(&at_limit).unwrap().len(), CAP_URN_TAGS_MAX);
        let past = format!("p:{}", keys.join(";"));
        let offset = past.len() - keys[CAP_URN_TAGS_MAX].len();
        assert_eq!(error(&past), ("too_many_tags", offset));
    }

    #[test]
    fn outer_offset_counts_escapes() {
        let text = r#"p:x="a\"b";y"#;
        let span = ValueSpan {
            start: 4,
            quoted: true,
        };
        assert_eq!(span.outer_offset(text, 0), 5);
        assert_eq!(span.outer_offset(text, 1), 6);
        assert_eq!(span.outer_offset(text, 2), 8);
        assert_eq!(span.outer_offset(text, 99), text.len());
    }

    #[test]
    fn specificity_per_form() {
        let urn = TaggedUrn::parse("p:a;b=1;?c;d?=1;e!=1;!f").unwrap();
        assert_eq!(urn.specificity(), 2 + 4 + 1 + 3 + 5);
    }

    #[test]
    fn equivalence_is_not_transitive_under_the_table() {
        let (a, any, b) = (
            canonical_urn("p:x=a"),
            canonical_urn("p:x"),
            canonical_urn("p:x=b"),
        );
        assert!(a.is_equivalent(&any) && any.is_equivalent(&b));
        assert!(!a.is_equivalent(&b));
    }

    fn canonical_urn(text: &str) -> TaggedUrn {
        TaggedUrn::parse(text).unwrap()
    }

    #[test]
    fn different_prefixes_never_match() {
        let (a, b) = (canonical_urn("a:"), canonical_urn("b:"));
        assert!(!a.accepts(&b) && !a.is_comparable(&b));
    }
}
