//! tether-formal-replay: reference models of tether's state machines, written independently of
//! `tether-core`, model checking of their laws, and step-by-step replay of conformance scripts
//! (`CONFORMANCE.md`) against core.
//!
//! Nothing is here yet: the models arrive with the request lifecycle.
