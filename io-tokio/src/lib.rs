//! tether: reliable, authenticated messaging between peers over iroh.
pub mod inspect;
