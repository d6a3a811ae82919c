//! The authorize gate (docs/spec/substrate.md §9).
//!
//! A chain of interceptors over an [`AuthorizeContext`]. Every inbound op that initiates
//! something (open, send, req, close, chunk) is offered to the chain after address and verb
//! validation and before object lookup, the sequencer, dedupe, persistence and the hop ack. The
//! first denial answers that op with a terminal `err` and nothing else changes: no object is
//! created, no frontier moves, nothing is acked. Answers to this side's own ops (accept,
//! reject, res, end, err) and control (ack, resync) are not offered: they are matched to ops
//! this side sent.
//!
//! There is no default: a caller picks a [`ScopeAuthorizer`] (deny by default), its own
//! [`Interceptor`]s, or the explicit opt-out [`AllowAll`].

use std::collections::BTreeMap;
use std::fmt;

use crate::wire::envelope::{ObjKind, Verb};

use super::finality::SCOPE_DENIED;
use super::PeerId;

/// What an interceptor sees of one inbound op.
#[derive(Debug, Clone, Copy)]
pub struct AuthorizeContext<'a> {
    /// The authenticated peer.
    pub peer: &'a PeerId,
    /// The verb.
    pub verb: Verb,
    /// The object's address.
    pub obj: &'a str,
    /// The object kind the op declares (opens carry it; later ops may not).
    pub obj_kind: Option<ObjKind>,
    /// The capability token presented with an open, never parsed by the substrate.
    pub cap: Option<&'a str>,
}

/// A refusal, with the code the op is answered with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    /// The terminal code (default [`SCOPE_DENIED`]).
    pub code: String,
}

impl Denial {
    /// A refusal with the default code `scope_denied`.
    pub fn scope_denied() -> Self {
        Self {
            code: SCOPE_DENIED.to_owned(),
        }
    }

    /// A refusal with `code`.
    pub fn with_code(code: impl Into<String>) -> Self {
        Self { code: code.into() }
    }
}

/// One member of the chain: returns `Ok(())` to allow (or merely observe), `Err` to deny.
pub trait Interceptor: Send + Sync {
    /// Judges one inbound op.
    fn check(&self, ctx: &AuthorizeContext<'_>) -> Result<(), Denial>;
}

impl<F> Interceptor for F
where
    F: Fn(&AuthorizeContext<'_>) -> Result<(), Denial> + Send + Sync,
{
    fn check(&self, ctx: &AuthorizeContext<'_>) -> Result<(), Denial> {
        self(ctx)
    }
}

/// The explicit opt-out: any authenticated peer may do anything. Shells log it at warn.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllowAll;

impl Interceptor for AllowAll {
    fn check(&self, _: &AuthorizeContext<'_>) -> Result<(), Denial> {
        Ok(())
    }
}

/// Names a peer's scopes; `None` for a peer the policy does not know.
type ScopesOf = Box<dyn Fn(&PeerId) -> Option<Vec<String>> + Send + Sync>;

/// Deny-by-default scope policy: a peer's scopes (unknown peer → refused) each allow a set of
/// verbs (`"*"` allows every verb).
pub struct ScopeAuthorizer {
    scopes_of: ScopesOf,
    matrix: BTreeMap<String, Vec<String>>,
}

impl ScopeAuthorizer {
    /// `scopes_of` names a peer's scopes (`None`: unknown peer); `matrix` maps each scope to
    /// the verbs it allows.
    pub fn new(
        scopes_of: impl Fn(&PeerId) -> Option<Vec<String>> + Send + Sync + 'static,
        matrix: impl IntoIterator<Item = (String, Vec<String>)>,
    ) -> Self {
        Self {
            scopes_of: Box::new(scopes_of),
            matrix: matrix.into_iter().collect(),
        }
    }
}

impl fmt::Debug for ScopeAuthorizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScopeAuthorizer")
            .field("matrix", &self.matrix)
            .finish_non_exhaustive()
    }
}

impl Interceptor for ScopeAuthorizer {
    fn check(&self, ctx: &AuthorizeContext<'_>) -> Result<(), Denial> {
        let scopes = (self.scopes_of)(ctx.peer).ok_or_else(Denial::scope_denied)?;
        let allowed = scopes.iter().any(|scope| {
            self.matrix.get(scope).is_some_and(|verbs| {
                verbs
                    .iter()
                    .any(|verb| verb == "*" || verb == ctx.verb.as_str())
            })
        });
        if allowed {
            Ok(())
        } else {
            Err(Denial::scope_denied())
        }
    }
}

/// The chain: interceptors in order; the first denial stops the rest. An empty chain cannot
/// be built: authorization is a required choice.
pub struct Authorizer {
    chain: Vec<Box<dyn Interceptor>>,
}

impl Authorizer {
    /// A chain of one interceptor.
    pub fn new(first: impl Interceptor + 'static) -> Self {
        Self {
            chain: vec![Box::new(first)],
        }
    }

    /// Appends an interceptor, run after the ones before it.
    pub fn then(mut self, next: impl Interceptor + 'static) -> Self {
        self.chain.push(Box::new(next));
        self
    }

    /// Runs the chain.
    pub fn check(&self, ctx: &AuthorizeContext<'_>) -> Result<(), Denial> {
        self.chain
            .iter()
            .try_for_each(|interceptor| interceptor.check(ctx))
    }
}

impl fmt::Debug for Authorizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Authorizer")
            .field("interceptors", &self.chain.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx<'a>(peer: &'a PeerId, verb: Verb) -> AuthorizeContext<'a> {
        AuthorizeContext {
            peer,
            verb,
            obj: "jobs",
            obj_kind: None,
            cap: None,
        }
    }

    #[test]
    fn scopes_deny_by_default_and_allow_listed_verbs() {
        let policy = ScopeAuthorizer::new(
            |peer: &PeerId| (peer.as_str() == "producer").then(|| vec!["producer".to_owned()]),
            [(
                "producer".to_owned(),
                vec!["open".to_owned(), "send".to_owned()],
            )],
        );
        let producer = PeerId::new("producer");
        let stranger = PeerId::new("stranger");
        assert_eq!(policy.check(&ctx(&producer, Verb::Send)), Ok(()));
        assert_eq!(
            policy.check(&ctx(&producer, Verb::Req)),
            Err(Denial::scope_denied())
        );
        assert_eq!(
            policy.check(&ctx(&stranger, Verb::Open)),
            Err(Denial::scope_denied())
        );
    }

    #[test]
    fn the_first_denial_stops_the_chain() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        let seen = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&seen);
        let chain = Authorizer::new(move |_: &AuthorizeContext<'_>| {
            counter.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
        .then(|ctx: &AuthorizeContext<'_>| {
            if ctx.obj.starts_with("admin/") {
                Err(Denial::with_code("unauthorized"))
            } else {
                Ok(())
            }
        })
        .then(|_: &AuthorizeContext<'_>| Err(Denial::scope_denied()));
        let peer = PeerId::new("p");
        let mut admin = ctx(&peer, Verb::Open);
        admin.obj = "admin/x";
        assert_eq!(chain.check(&admin), Err(Denial::with_code("unauthorized")));
        assert_eq!(
            chain.check(&ctx(&peer, Verb::Open)),
            Err(Denial::scope_denied())
        );
        assert_eq!(seen.load(Ordering::Relaxed), 2, "observers see every op");
        assert_eq!(
            Authorizer::new(AllowAll).check(&ctx(&peer, Verb::Close)),
            Ok(())
        );
    }
}
