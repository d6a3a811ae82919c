//! tether's end-to-end tests, one binary: every file beside this one is a module of it, so the
//! workspace links these tests once (each test binary carries iroh, the relay server and the
//! CLI: a binary per file cost gigabytes of disk and minutes of linking).
//!
//! Run one file's tests with its module path as the filter, e.g.
//! `cargo test -p tether-tests --test end_to_end relay::`.

mod common;
mod support;

mod actor_host_claims;
mod allow_list_guards_every_path;
mod backpressure;
mod capdag_interop;
mod commit_pipeline;
mod crash_truth;
mod demo;
mod embedding_in_an_iroh_router;
mod hostile_connections;
mod idle_peers_and_full_queues;
mod kernel_made_faults;
mod metrics_scrape;
mod node;
mod node_settings_and_state;
mod peer_cap;
mod protocol_stream;
mod relay;
mod relay_between_separated_hosts;
mod restart_redials;
mod store_damage_and_locks;
mod store_faults;
mod substrate_iroh;
mod substrate_preamble_flood;
mod switch_and_substrate_in_the_cache;
mod switch_cuts_misbehaving_masters;
mod switch_host_side;
mod switch_over_iroh;
mod switch_routes_requests_between_hosts;
mod switch_streams_64_mib_in_bounded_memory;
mod tcp_exactly_once;
mod telemetry;
mod telemetry_subscriptions;
