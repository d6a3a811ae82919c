//! Error codes and their class (docs/spec/substrate.md §7.1; law 1 of §7.2).
//!
//! There is no "final" flag on the wire: the receiver of an `err` derives whether it is
//! terminal from the code. Unknown codes are terminal, the safe reading: a sender that retries
//! an op the peer meant to end would retry forever.

/// Whether an error ends its op (terminal) or may be retried (transient).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// The op is over: purge it and report it futile.
    Terminal,
    /// Try again later.
    Transient,
}

/// The object was closed.
pub const CLOSED: &str = "closed";
/// No endpoint answers for the address.
pub const UNKNOWN_ENDPOINT: &str = "unknown_endpoint";
/// The op names an object this side does not know (the bounce).
pub const NO_SUCH_OBJECT: &str = "no_such_object";
/// The acceptor refused the open.
pub const APPROVAL_DENIED: &str = "approval_denied";
/// The authorize chain refused the op (the default denial code).
pub const SCOPE_DENIED: &str = "scope_denied";
/// The service is not offered.
pub const UNSUPPORTED_SERVICE: &str = "unsupported_service";
/// The address contains `@`: routing through a peer is not supported.
pub const ROUTING_NOT_SUPPORTED: &str = "routing_not_supported";
/// A body above its bound.
pub const PAYLOAD_TOO_LARGE: &str = "payload_too_large";
/// The direction is not granted.
pub const DIRECTION_NOT_GRANTED: &str = "direction_not_granted";
/// The peer must upgrade.
pub const UPGRADE_REQUIRED: &str = "upgrade_required";
/// Authentication failed.
pub const AUTH_FAILED: &str = "auth_failed";
/// A seq outside the receiver's window.
pub const OUT_OF_SEQ: &str = "out_of_seq";
/// A content digest did not match.
pub const SHA256_MISMATCH: &str = "sha256_mismatch";
/// Slow down (transient).
pub const RATE_LIMITED: &str = "rate_limited";
/// The object's queue is full (transient).
pub const QUEUE_FULL: &str = "queue_full";
/// A quota is exhausted, e.g. objects per peer (transient).
pub const QUOTA: &str = "quota";
/// Busy (transient).
pub const BUSY: &str = "busy";
/// The op waited longer than the queue TTL before it could be sent (tether's own code;
/// terminal, as every code outside the table).
pub const TTL_EXPIRED: &str = "ttl_expired";

/// Both sides opened the same address at once and this open lost the tie-break (tether's
/// own code; terminal).
pub const OPEN_CONFLICT: &str = "open_conflict";

/// Codes docs/spec/substrate.md §7.1 lists as terminal.
pub const TERMINAL_CODES: [&str; 13] = [
    CLOSED,
    UNKNOWN_ENDPOINT,
    NO_SUCH_OBJECT,
    APPROVAL_DENIED,
    SCOPE_DENIED,
    UNSUPPORTED_SERVICE,
    ROUTING_NOT_SUPPORTED,
    PAYLOAD_TOO_LARGE,
    DIRECTION_NOT_GRANTED,
    UPGRADE_REQUIRED,
    AUTH_FAILED,
    OUT_OF_SEQ,
    SHA256_MISMATCH,
];

/// Codes docs/spec/substrate.md §7.1 lists as transient.
pub const TRANSIENT_CODES: [&str; 4] = [RATE_LIMITED, QUEUE_FULL, QUOTA, BUSY];

/// The class the receiver derives from `code`: transient for the four retryable codes,
/// terminal for everything else (listed or unknown).
pub fn class_of(code: &str) -> Class {
    if TRANSIENT_CODES.contains(&code) {
        Class::Transient
    } else {
        Class::Terminal
    }
}

/// A code an op, an open or a request ended with, typed: every code of the table and tether's
/// own are variants; a code the application or the peer made up is [`Code::Other`], as
/// written. [`Code::class`] is the class the receiver derives (unknown codes are terminal).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Code {
    /// [`CLOSED`].
    Closed,
    /// [`UNKNOWN_ENDPOINT`].
    UnknownEndpoint,
    /// [`NO_SUCH_OBJECT`].
    NoSuchObject,
    /// [`APPROVAL_DENIED`].
    ApprovalDenied,
    /// [`SCOPE_DENIED`].
    ScopeDenied,
    /// [`UNSUPPORTED_SERVICE`].
    UnsupportedService,
    /// [`ROUTING_NOT_SUPPORTED`].
    RoutingNotSupported,
    /// [`PAYLOAD_TOO_LARGE`].
    PayloadTooLarge,
    /// [`DIRECTION_NOT_GRANTED`].
    DirectionNotGranted,
    /// [`UPGRADE_REQUIRED`].
    UpgradeRequired,
    /// [`AUTH_FAILED`].
    AuthFailed,
    /// [`OUT_OF_SEQ`].
    OutOfSeq,
    /// [`SHA256_MISMATCH`].
    Sha256Mismatch,
    /// [`RATE_LIMITED`] (transient).
    RateLimited,
    /// [`QUEUE_FULL`] (transient).
    QueueFull,
    /// [`QUOTA`] (transient).
    Quota,
    /// [`BUSY`] (transient).
    Busy,
    /// [`TTL_EXPIRED`].
    TtlExpired,
    /// [`OPEN_CONFLICT`].
    OpenConflict,
    /// No code was given (an open rejected, a request failed or an object closed without
    /// one).
    None,
    /// A code outside the table, as written.
    Other(String),
}

/// Every variant without data, with its wire word.
const WORDS: [(Code, &str); 19] = [
    (Code::Closed, CLOSED),
    (Code::UnknownEndpoint, UNKNOWN_ENDPOINT),
    (Code::NoSuchObject, NO_SUCH_OBJECT),
    (Code::ApprovalDenied, APPROVAL_DENIED),
    (Code::ScopeDenied, SCOPE_DENIED),
    (Code::UnsupportedService, UNSUPPORTED_SERVICE),
    (Code::RoutingNotSupported, ROUTING_NOT_SUPPORTED),
    (Code::PayloadTooLarge, PAYLOAD_TOO_LARGE),
    (Code::DirectionNotGranted, DIRECTION_NOT_GRANTED),
    (Code::UpgradeRequired, UPGRADE_REQUIRED),
    (Code::AuthFailed, AUTH_FAILED),
    (Code::OutOfSeq, OUT_OF_SEQ),
    (Code::Sha256Mismatch, SHA256_MISMATCH),
    (Code::RateLimited, RATE_LIMITED),
    (Code::QueueFull, QUEUE_FULL),
    (Code::Quota, QUOTA),
    (Code::Busy, BUSY),
    (Code::TtlExpired, TTL_EXPIRED),
    (Code::OpenConflict, OPEN_CONFLICT),
];

impl Code {
    /// The code a word names (empty: [`Code::None`]; outside the table: [`Code::Other`]).
    pub fn parse(word: &str) -> Self {
        if word.is_empty() {
            return Self::None;
        }
        WORDS
            .iter()
            .find(|(_, known)| *known == word)
            .map_or_else(|| Self::Other(word.to_owned()), |(code, _)| code.clone())
    }

    /// The code of an optional word (absent: [`Code::None`]).
    pub fn of(word: Option<&str>) -> Self {
        word.map_or(Self::None, Self::parse)
    }

    /// The wire word (empty for [`Code::None`]).
    pub fn as_str(&self) -> &str {
        match self {
            Self::Other(word) => word,
            Self::None => "",
            known => WORDS
                .iter()
                .find(|(code, _)| code == known)
                .map_or("", |(_, word)| word),
        }
    }

    /// The class the receiver derives from it ([`class_of`]).
    pub fn class(&self) -> Class {
        class_of(self.as_str())
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::None => f.write_str("(no code)"),
            code => f.write_str(code.as_str()),
        }
    }
}

impl PartialEq<&str> for Code {
    fn eq(&self, word: &&str) -> bool {
        self.as_str() == *word
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_word_of_the_table_is_a_code_of_its_own_and_others_are_kept_as_written() {
        for word in TERMINAL_CODES.iter().chain(&TRANSIENT_CODES) {
            let code = Code::parse(word);
            assert!(!matches!(code, Code::Other(_)), "{word}");
            assert_eq!(code.as_str(), *word);
            assert_eq!(code.class(), class_of(word));
        }
        assert_eq!(Code::parse(TTL_EXPIRED), Code::TtlExpired);
        assert_eq!(Code::parse(OPEN_CONFLICT), Code::OpenConflict);
        assert_eq!(Code::parse("mine"), Code::Other("mine".into()));
        assert_eq!(Code::parse("mine").class(), Class::Terminal);
        assert_eq!(Code::parse(""), Code::None);
        assert_eq!(Code::of(None), Code::None);
        assert_eq!(Code::QueueFull, "queue_full");
        assert_eq!(Code::None.to_string(), "(no code)");
    }

    #[test]
    fn the_code_table_classifies_every_listed_code_and_defaults_to_terminal() {
        assert!(TERMINAL_CODES
            .iter()
            .all(|code| class_of(code) == Class::Terminal));
        assert!(TRANSIENT_CODES
            .iter()
            .all(|code| class_of(code) == Class::Transient));
        assert_eq!(class_of("something_new"), Class::Terminal);
        assert_eq!(class_of(TTL_EXPIRED), Class::Terminal);
    }
}
