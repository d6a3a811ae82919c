//! Core's [`Handshakes`] bound behind a lock, shared by the tasks that run inbound handshakes
//! (the node's QUIC accept loop, the substrate's link accept loop).

use std::sync::{Mutex, MutexGuard, PoisonError};

use tether_core::driver::admission::Handshakes;

/// Inbound handshakes in progress, under a bound core's [`Handshakes`] keeps.
#[derive(Debug)]
pub(crate) struct SharedHandshakes(Mutex<Handshakes>);

impl SharedHandshakes {
    /// At most `max` at once.
    pub(crate) fn new(max: usize) -> Self {
        Self(Mutex::new(Handshakes::new(max)))
    }

    /// The bound's state (begin, end, counts).
    pub(crate) fn lock(&self) -> MutexGuard<'_, Handshakes> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
