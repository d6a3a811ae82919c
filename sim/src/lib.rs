//! tether-sim: runs the real tether shell over a turmoil transport, injects partitions,
//! reconnects, crashes and stragglers from a seed, and checks delivery invariants on every run.
//!
//! Nothing is here yet: the simulator arrives with the substrate shell.
