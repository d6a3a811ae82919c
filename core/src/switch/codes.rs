//! The codes an ERR names its cause with (`meta.code`), typed.

use std::fmt;

/// Why a request ended with ERR: the `code` of the ERR's `meta`. The codes capdag 1.524.58's
/// switch, relay and hosts write are variants of their own; a code no part of tether or capdag
/// writes (a host's own) is [`ErrCode::Other`], carried as the wire had it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrCode {
    /// No healthy master (or no handler of a host) serves the request's cap: `NO_HANDLER`.
    NoHandler,
    /// The destination master died with the request live: `MASTER_DIED`.
    MasterDied,
    /// The request was cancelled: `CANCELLED`.
    Cancelled,
    /// The request was aborted: `ABORTED`.
    Aborted,
    /// A request this one depended on was aborted: `ABORTED_COLLATERAL`.
    AbortedCollateral,
    /// A side broke the protocol: `PROTOCOL_VIOLATION`.
    ProtocolViolation,
    /// A frame could not be handled: `PROTOCOL_ERROR`.
    ProtocolError,
    /// The request is not one the host can serve as written: `INVALID_REQUEST`.
    InvalidRequest,
    /// The handler failed: `HANDLER_ERROR`.
    HandlerError,
    /// The cartridge serving the request died: `CARTRIDGE_DIED`.
    CartridgeDied,
    /// The cartridge serving the request was retired: `CARTRIDGE_RETIRED`.
    CartridgeRetired,
    /// The cartridge could not be started: `SPAWN_FAILED`.
    SpawnFailed,
    /// The network policy forbids the request: `NETWORK_POLICY`.
    NetworkPolicy,
    /// The host has no network policy yet: `NETWORK_POLICY_UNSET`.
    NetworkPolicyUnset,
    /// The request names a pool the host does not have: `UNKNOWN_POOL`.
    UnknownPool,
    /// The ERR names no cause: `UNKNOWN`.
    Unknown,
    /// The ERR's `meta` has no `code` at all.
    Absent,
    /// Any other code, as the wire carried it.
    Other(String),
}

/// Every variant without data, with its wire word.
const WORDS: [(ErrCode, &str); 16] = [
    (ErrCode::NoHandler, "NO_HANDLER"),
    (ErrCode::MasterDied, "MASTER_DIED"),
    (ErrCode::Cancelled, "CANCELLED"),
    (ErrCode::Aborted, "ABORTED"),
    (ErrCode::AbortedCollateral, "ABORTED_COLLATERAL"),
    (ErrCode::ProtocolViolation, "PROTOCOL_VIOLATION"),
    (ErrCode::ProtocolError, "PROTOCOL_ERROR"),
    (ErrCode::InvalidRequest, "INVALID_REQUEST"),
    (ErrCode::HandlerError, "HANDLER_ERROR"),
    (ErrCode::CartridgeDied, "CARTRIDGE_DIED"),
    (ErrCode::CartridgeRetired, "CARTRIDGE_RETIRED"),
    (ErrCode::SpawnFailed, "SPAWN_FAILED"),
    (ErrCode::NetworkPolicy, "NETWORK_POLICY"),
    (ErrCode::NetworkPolicyUnset, "NETWORK_POLICY_UNSET"),
    (ErrCode::UnknownPool, "UNKNOWN_POOL"),
    (ErrCode::Unknown, "UNKNOWN"),
];

impl ErrCode {
    /// The code a wire word names (an unknown word is [`ErrCode::Other`]).
    pub fn parse(word: &str) -> Self {
        WORDS
            .iter()
            .find(|(_, known)| *known == word)
            .map_or_else(|| Self::Other(word.to_owned()), |(code, _)| code.clone())
    }

    /// The code of an ERR's `meta` (`None`: no code in it).
    pub fn of_meta(code: Option<&str>) -> Self {
        code.map_or(Self::Absent, Self::parse)
    }

    /// The wire word (empty for [`ErrCode::Absent`]).
    pub fn as_str(&self) -> &str {
        match self {
            Self::Other(word) => word,
            Self::Absent => "",
            known => WORDS
                .iter()
                .find(|(code, _)| code == known)
                .map_or("", |(_, word)| word),
        }
    }
}

impl fmt::Display for ErrCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Absent => f.write_str("(no code)"),
            code => f.write_str(code.as_str()),
        }
    }
}

impl PartialEq<&str> for ErrCode {
    fn eq(&self, word: &&str) -> bool {
        !matches!(self, Self::Absent) && self.as_str() == *word
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_word_names_its_code_and_back_and_others_are_kept_as_written() {
        for (code, word) in WORDS.iter() {
            assert_eq!(ErrCode::parse(word), *code);
            assert_eq!(code.as_str(), *word);
            assert_eq!(code.to_string(), *word);
        }
        let other = ErrCode::parse("MY_HOSTS_OWN");
        assert_eq!(other, ErrCode::Other("MY_HOSTS_OWN".into()));
        assert_eq!(other.as_str(), "MY_HOSTS_OWN");
        assert_eq!(
            ErrCode::parse("no_handler"),
            ErrCode::Other("no_handler".into())
        );
        assert_eq!(ErrCode::of_meta(None), ErrCode::Absent);
        assert_ne!(ErrCode::Absent, "");
        assert_eq!(ErrCode::MasterDied, "MASTER_DIED");
    }
}
