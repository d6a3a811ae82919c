//! The transport driver's decisions (docs/spec/driver.md), with no I/O: the connection cache with
//! generation-scoped eviction, dial and join schedules, peer admission, inbound routing,
//! egress resolution and SWIM send-failure feedback. The iroh shell in `tether::node` runs
//! them.

pub mod admission;
#[cfg(any(test, feature = "harness"))]
pub mod ask;
pub mod book;
pub mod cache;
pub mod directory;
#[cfg(any(test, feature = "harness"))]
pub mod harness;
pub mod machine;
pub mod relay;
pub mod routing;
pub mod schedule;
pub mod subscriptions;

pub use admission::{admit, Direction, Path, Refusals, Refused};
pub use book::PeerBook;
pub use cache::{ConnectionCache, Entry, Eviction, Generation};
pub use directory::{
    CheckedClaim, ClaimAuthorizer, ClaimRequest, ClaimVerdict, Directory, Handoff, HostClaim,
    HOST_CLAIM_TAG,
};
pub use machine::{
    Action, Alpns, Answer, Batch, Channel, Config as DriverConfig, ConnEndCause, ConnEvent,
    DialEnd, DialFailure, DialTicket, Dispatch, Driver, DriverRecord, Open, RegisterError,
    SendVerdict, StreamVerdict,
};
pub use relay::RelayHints;
pub use routing::{
    join_request, resolve_egress, ActorAddr, DropReason, Drops, Egress, Inbound, NodeId, PeerAuth,
    RouteMemo, Routes, JOIN_REQUEST, SWIM_TAGS,
};
pub use schedule::{
    dial_retry_after, join_retry_after, DialTracker, Join, JoinNext, JoinPhase, JoinStatus,
};
pub use subscriptions::{Control, ControlVerdict, Publisher, Subscription, TELEMETRY_CONTROL_TAG};
