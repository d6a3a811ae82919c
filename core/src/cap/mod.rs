//! Cap URNs: naming what a peer can do, and choosing who handles a request (docs/spec/switch.md
//! §4; the facts come from the public capdag docs 03–08 and 11, and where those differ from
//! capdag's code, from the code, which is what peers run).
//!
//! - [`TaggedUrn`]: the grammar under everything, `prefix:tag;tag;...`, where each tag is one
//!   of six [`Constraint`] forms, and the per-key truth table that decides whether an instance
//!   satisfies a pattern ([`Constraint::matches`]);
//! - [`MediaUrn`]: `media:...`, the type of data on one side of a cap; `media:` is the top;
//! - [`CapUrn`]: `cap:...`, a capability's input, output, [`Effect`] and other tags, with its
//!   specificity;
//! - [`is_dispatchable`] and [`rank`]: which registered caps can handle a request, best first.
//!
//! Guarantees: every function here is total (no input makes it panic), deterministic and free
//! of I/O. Parsing is bounded by [`crate::limits::CAP_URN_BYTES_MAX`] and
//! [`crate::limits::CAP_URN_TAGS_MAX`] and reports a typed [`ParseError`] with the byte offset
//! of the problem. Printing ([`std::fmt::Display`]) writes the canonical text:
//! `parse(print(x)) == x`, and printing the result again gives the same text.
//!
//! The matching relation follows the capdag docs/04 §2.5 table, in which an instance's `x` or
//! `?x` defers its value to the pattern. That makes "each accepts the other"
//! (`is_equivalent`) reflexive and symmetric but not transitive: `x=a` and `x=b` are each
//! equivalent to `x`.

mod dispatch;
mod media;
mod tagged;
mod urn;

pub use dispatch::{is_dispatchable, rank, rank_among};
pub use media::MediaUrn;
pub use tagged::{Constraint, ParseError, ParseErrorKind, TaggedUrn};
pub use urn::{identity, CapUrn, Effect, CAP_IDENTITY};
