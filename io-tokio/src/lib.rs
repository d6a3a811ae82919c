//! tether: reliable, authenticated messaging between peers over iroh.
//!
//! tether unites three planes, each a sans-IO state machine in `tether-core` driven by a thin
//! shell here: a transport driver (one iroh endpoint per node, ALPN dispatch, a per-peer
//! egress queue), a request switch (cap-aware routing with credit flow control) and a
//! substrate (named sessions and queues with exactly-once delivery across restarts).
//!
//! What is here today:
//! - [`substrate`]: the substrate from async Rust (queues and sessions with exactly-once,
//!   per-object FIFO delivery across disconnects and restarts), over a [`substrate::Transport`];
//! - [`store`]: where its durable state lives (an append-only log file or SQLite, each with
//!   group commit, or memory);
//! - [`switch`]: the request switch from async Rust (masters over any byte stream, Unix
//!   sockets, TCP or iroh; engine calls under credit) and its serving side, `switch::host::Host`;
//! - `node` (feature `iroh`, on by default): the iroh transport driver's actor plane;
//! - [`inspect`]: decodes captured wire bytes of tether's four formats into JSON lines (the
//!   `tether inspect` command);
//! - [`tether_core`] and [`iroh`]: the crates whose types tether's signatures use, re-exported so an
//!   application needs no second, possibly different, version of either.

/// The sans-IO core, for the types tether's signatures use (telemetry headers and frames,
/// actor addresses, claim verdicts, substrate settings): the same version tether runs.
pub use tether_core;
mod handshakes;
pub mod inspect;
/// The iroh tether is built on, for types its signatures use (`Endpoint`, `EndpointAddr`,
/// `protocol::Router`): the same version, whatever else the application depends on.
#[cfg(feature = "iroh")]
pub use iroh;
#[cfg(feature = "iroh")]
pub mod node;
pub mod store;
pub mod substrate;
pub mod switch;
