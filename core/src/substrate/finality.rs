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

#[cfg(test)]
mod tests {
    use super::*;

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
