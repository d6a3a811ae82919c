//! Short text held in place: the representation under [`Address`](super::envelope::Address)
//! and [`OpId`](super::envelope::OpId).
//!
//! Text of up to `N` bytes is kept inline, so making, cloning, dropping and comparing it touch
//! no allocator and no shared counter (a reference count that two threads move in turn costs a
//! cache line crossing cores each time); longer text is shared behind an `Arc`. Both forms
//! compare, order and hash as their text, so which one a value took never shows.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Text of any length, inline up to `N` bytes (`N` < 256).
#[derive(Clone)]
pub(crate) struct Text<const N: usize>(Repr<N>);

#[derive(Clone)]
enum Repr<const N: usize> {
    Inline { len: u8, bytes: [u8; N] },
    Shared(Arc<str>),
}

impl<const N: usize> Text<N> {
    /// `text`, inline when it fits.
    pub(crate) fn new(text: &str) -> Self {
        match Self::inline(text) {
            Some(inline) => inline,
            None => Self(Repr::Shared(Arc::from(text))),
        }
    }

    /// `text` inline, when it fits.
    pub(crate) fn inline(text: &str) -> Option<Self> {
        let len = u8::try_from(text.len()).ok().filter(|_| text.len() <= N)?;
        let mut bytes = [0u8; N];
        bytes[..text.len()].copy_from_slice(text.as_bytes());
        Some(Self(Repr::Inline { len, bytes }))
    }

    /// ASCII `bytes`, inline when they fit (ASCII is UTF-8 as it stands, so no other check).
    pub(crate) fn ascii(bytes: &[u8]) -> Option<Self> {
        if !bytes.is_ascii() {
            return None;
        }
        Some(
            match u8::try_from(bytes.len()).ok().filter(|_| bytes.len() <= N) {
                Some(len) => {
                    let mut inline = [0u8; N];
                    inline[..bytes.len()].copy_from_slice(bytes);
                    Self(Repr::Inline { len, bytes: inline })
                }
                None => Self::new(std::str::from_utf8(bytes).ok()?),
            },
        )
    }

    /// The text.
    #[inline]
    pub(crate) fn as_str(&self) -> &str {
        match &self.0 {
            Repr::Inline { len, bytes } => std::str::from_utf8(&bytes[..usize::from(*len)])
                .expect("inline text is copied whole from a str"),
            Repr::Shared(text) => text,
        }
    }

    /// Whether the text is held in place.
    #[cfg(test)]
    pub(crate) fn is_inline(&self) -> bool {
        matches!(self.0, Repr::Inline { .. })
    }

    /// The text's bytes (UTF-8), without the check [`Text::as_str`] makes: bytes order as
    /// their text does, and tables keyed by text compare on every lookup.
    #[inline]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Repr::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Repr::Shared(text) => text.as_bytes(),
        }
    }
}

impl<const N: usize> PartialEq for Text<N> {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        match (&self.0, &other.0) {
            // Inline bytes past the text are zero (`Text::inline`), so equal texts have equal
            // arrays: one fixed-size comparison.
            (Repr::Inline { len: a, bytes: x }, Repr::Inline { len: b, bytes: y }) => {
                a == b && x == y
            }
            _ => self.as_bytes() == other.as_bytes(),
        }
    }
}

impl<const N: usize> Eq for Text<N> {}

impl<const N: usize> PartialOrd for Text<N> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl<const N: usize> Ord for Text<N> {
    #[inline]
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // Byte order is the text's order (as `str` compares), so lookups by `&str` agree.
        match (&self.0, &other.0) {
            (Repr::Inline { len: a, bytes: x }, Repr::Inline { len: b, bytes: y }) => {
                padded_cmp(x, y).then(a.cmp(b))
            }
            _ => self.as_bytes().cmp(other.as_bytes()),
        }
    }
}

/// Two zero-padded texts in byte order, eight bytes at a time as big-endian words (tables
/// keyed by text compare on every lookup, and tether's ids share long prefixes). Where the
/// arrays first differ inside both texts, that byte orders them as the texts; where it lies
/// past the end of one, that one is a prefix of the other and orders first, as its zero does;
/// arrays that do not differ hold texts one of which is the other followed by zeros, and the
/// shorter is first: the caller compares lengths then.
#[inline]
fn padded_cmp<const N: usize>(x: &[u8; N], y: &[u8; N]) -> std::cmp::Ordering {
    let mut at = 0;
    while at < N {
        let (a, b) = (word(x, at), word(y, at));
        if a != b {
            return a.cmp(&b);
        }
        at += 8;
    }
    std::cmp::Ordering::Equal
}

/// The eight bytes of `bytes` from `at` (below `N`) as a big-endian word, zeros past the end.
#[inline]
fn word<const N: usize>(bytes: &[u8; N], at: usize) -> u64 {
    if at + 8 <= N {
        let mut eight = [0u8; 8];
        eight.copy_from_slice(&bytes[at..at + 8]);
        u64::from_be_bytes(eight)
    } else {
        let mut word = [0u8; 8];
        word[..N - at].copy_from_slice(&bytes[at..]);
        u64::from_be_bytes(word)
    }
}

impl<const N: usize> std::hash::Hash for Text<N> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // As `str` hashes, so maps keyed by text are looked up with a `&str`.
        self.as_str().hash(state);
    }
}

/// A type that is its text (an address, an op id), held in place when short, whose tables are
/// looked up by a `&str` without checking every key passed as UTF-8 (see [`ByText`]).
pub(crate) trait TextKey: Ord + Borrow<str> + Sized {
    /// `text` as a key, when it fits in place (unchecked: only compared, never stored).
    fn probe(text: &str) -> Option<Self>;
}

/// Lookups by text in an ordered table keyed by a [`TextKey`]. A lookup by `&str` turns every
/// key it passes into a `&str`, which checks it as UTF-8 (core has no `unsafe` to skip it);
/// text that fits in place is looked up as the key type instead, compared word by word, and
/// only longer text by `str`.
pub(crate) trait ByText<K, V> {
    /// The entry for `text`.
    fn get_text(&self, text: &str) -> Option<&V>;
    /// The key and entry for `text`.
    fn get_key_value_text(&self, text: &str) -> Option<(&K, &V)>;
}

impl<K: TextKey, V> ByText<K, V> for BTreeMap<K, V> {
    #[inline]
    fn get_text(&self, text: &str) -> Option<&V> {
        match K::probe(text) {
            Some(key) => self.get::<K>(&key),
            None => self.get::<str>(text),
        }
    }

    #[inline]
    fn get_key_value_text(&self, text: &str) -> Option<(&K, &V)> {
        match K::probe(text) {
            Some(key) => self.get_key_value::<K>(&key),
            None => self.get_key_value::<str>(text),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Text;
    use proptest::prelude::*;
    use std::collections::hash_map::DefaultHasher;
    use std::hash::{Hash, Hasher};

    fn hash_of(value: &impl Hash) -> u64 {
        let mut hasher = DefaultHasher::new();
        value.hash(&mut hasher);
        hasher.finish()
    }

    #[test]
    fn text_up_to_n_bytes_is_inline_and_longer_text_is_shared() {
        assert!(matches!(
            Text::<4>::new("abcd").0,
            super::Repr::Inline { len: 4, .. }
        ));
        assert!(matches!(Text::<4>::new("abcde").0, super::Repr::Shared(_)));
        assert!(matches!(
            Text::<4>::new("").0,
            super::Repr::Inline { len: 0, .. }
        ));
        assert!(Text::<4>::inline("abcde").is_none());
    }

    proptest! {
        /// Whichever form each side took, text compares, orders and hashes as `str` does.
        #[test]
        fn both_forms_compare_order_and_hash_as_their_text(a in "[a-z/é]{0,12}", b in "[a-z/é]{0,12}") {
            let (x, y) = (Text::<6>::new(&a), Text::<6>::new(&b));
            prop_assert_eq!(x.as_str(), a.as_str());
            prop_assert_eq!(x.as_bytes(), a.as_bytes());
            prop_assert_eq!(x == y, a == b);
            prop_assert_eq!(x.cmp(&y), a.as_str().cmp(b.as_str()));
            prop_assert_eq!(hash_of(&x), hash_of(&a.as_str()));
            prop_assert_eq!(x.clone() == x, true);
        }

        /// Inline texts compare word by word over their zero padding: texts that end in
        /// zeros, that are prefixes of each other, that differ in a high byte or only in the
        /// last, partial word still order and compare as `str` does (12 bytes: a whole word
        /// and a partial one; 30, an address's room; 32, an op id's).
        #[test]
        fn inline_texts_order_as_their_bytes(a in "[\\x00a\u{7f}\u{e9}]{0,14}", b in "[\\x00a\u{7f}\u{e9}]{0,14}") {
            let (x, y) = (Text::<12>::new(&a), Text::<12>::new(&b));
            prop_assert_eq!(x.cmp(&y), a.as_str().cmp(b.as_str()));
            prop_assert_eq!(x == y, a == b);
            let (x, y) = (Text::<30>::new(&a), Text::<30>::new(&b));
            prop_assert!(x.is_inline() && y.is_inline());
            prop_assert_eq!(x.cmp(&y), a.as_str().cmp(b.as_str()));
            prop_assert_eq!(x == y, a == b);
            let (x, y) = (Text::<32>::new(&a), Text::<32>::new(&b));
            prop_assert_eq!(x.cmp(&y), a.as_str().cmp(b.as_str()));
        }
    }

    /// The cases the word comparison must get right, written out.
    #[test]
    fn zeros_at_the_end_and_prefixes_order_as_text() {
        let cases = [
            ("ab", "ab\0"),
            ("ab\0", "ab\0\0"),
            ("", "\0"),
            ("abcdefgh", "abcdefgh\0"),
            ("abcdefgh", "abcdefghi"),
            ("abcdefghijk", "abcdefghijl"),
            ("a\u{7f}", "a\u{e9}"),
            ("zzzzzzzz", "zzzzzzzz\u{e9}"),
        ];
        for (lower, higher) in cases {
            let (x, y) = (Text::<12>::new(lower), Text::<12>::new(higher));
            assert!(x.is_inline() && y.is_inline());
            assert_eq!(lower.cmp(higher), std::cmp::Ordering::Less, "{lower:?}");
            assert_eq!(
                x.cmp(&y),
                std::cmp::Ordering::Less,
                "{lower:?} < {higher:?}"
            );
            assert_eq!(y.cmp(&x), std::cmp::Ordering::Greater);
            assert!(x != y);
            assert_eq!(x.cmp(&x.clone()), std::cmp::Ordering::Equal);
        }
    }
}
