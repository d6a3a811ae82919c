//! Real `tether node` processes for end-to-end tests: the `tether-under-test` binary of this
//! crate (the `tether` program, built with the tests' own features; a test names it with
//! `env!("CARGO_BIN_EXE_tether-under-test")`), driven through [`tether_cli::procs`], each
//! process's `--json` events on one channel tagged with the process's name and incarnation.

use std::time::Duration;

use tokio::sync::mpsc;

pub use tether_cli::procs::{Event, NodeProc};

/// A free UDP port on 127.0.0.1 (a node restarted on it is found where it was).
pub fn free_port() -> u16 {
    tether_cli::procs::free_port().expect("probe socket")
}

/// How long a test waits for the next event before it fails (a hang, not a timing
/// assertion: every wait is for an event).
pub const EVENT_WAIT: Duration = Duration::from_secs(120);

/// The next event.
pub async fn next(events: &mut mpsc::UnboundedReceiver<Event>, waiting_for: &str) -> Event {
    tokio::time::timeout(EVENT_WAIT, events.recv())
        .await
        .unwrap_or_else(|_| panic!("no event for {EVENT_WAIT:?} while waiting for {waiting_for}"))
        .expect("event senders alive")
}
