//! Faults made by the kernel: two `tether node` processes on separated hosts (network
//! namespaces this test builds, `tether_tests::netns`) whose links the kernel shapes and cuts
//! while B's queue to A carries traffic. Under each fault every message is delivered exactly
//! once and in order:
//!
//! - each host cut off (its link down at the router, the relay included) for seconds, with
//!   messages sent into the partition;
//! - a token bucket (`tc tbf`) far below the offered load, which queues and drops;
//! - delay with jitter, loss, reordering, duplication, and all of them at once: with `tc
//!   netem` where the kernel has `sch_netem`, and with netfilter in the router where it does
//!   not (`netns::Impairment`: nftables drops and duplicates, NFQUEUE holds packets for
//!   `tether-impair` to delay and reorder), so that every kernel runs every fault.
//!
//! Needs root: elsewhere it says so and skips; a kernel with neither netem nor netfilter's
//! queue skips that part loudly.

use std::path::Path;
use std::time::{Duration, Instant};

use tether_tests::netns::{self, Impairment, Pair, Topology};

/// How long a partition lasts: the fault's own length, not a wait for an event.
const PARTITION: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_is_exactly_once_and_in_order_under_kernel_made_faults() {
    if let Some(why) = netns::unavailable() {
        eprintln!("SKIPPED kernel_made_faults: {why}");
        return;
    }
    let topology = Topology::build().expect("the namespaces");
    topology.set_forwarding(true).expect("a direct path");
    let dir = std::env::temp_dir().join(format!("tether-netns-faults-{}", std::process::id()));
    let tether = Path::new(env!("CARGO_BIN_EXE_tether-under-test"));
    let mut run = Pair::start(tether, topology, dir).await;
    run.until_via("direct").await;
    let mut figures = Vec::new();

    for (host, name) in [(0, "A"), (1, "B")] {
        run.topology().set_link(host, false).expect("link down");
        let start = Instant::now();
        run.send(50).await;
        tokio::time::sleep(PARTITION).await;
        run.topology().set_link(host, true).expect("link up");
        run.settle().await;
        figures.push(format!(
            "{name} cut off for {PARTITION:?}: 50 sent into it, all delivered {:?} after",
            start.elapsed()
        ));
    }

    let mut faults = vec![("tbf rate 1mbit burst 32kbit latency 30ms", 300)];
    let netem = netns::netem_unavailable();
    match &netem {
        Some(why) => {
            eprintln!("kernel_made_faults: no netem ({why}): netfilter makes those faults")
        }
        None => faults.extend([
            ("netem delay 50ms 20ms distribution normal", 100),
            ("netem loss 3%", 200),
            ("netem delay 10ms reorder 25% 50%", 200),
            ("netem duplicate 5%", 200),
            (
                "netem delay 20ms 10ms loss 2% duplicate 2% reorder 10% 50%",
                200,
            ),
        ]),
    }
    for (fault, messages) in faults {
        run.topology().shape(fault).expect("shaped");
        let start = Instant::now();
        run.send(messages).await;
        run.settle().await;
        figures.push(format!("{fault}: {messages} in {:?}", start.elapsed()));
        run.topology().shape("").expect("unshaped");
    }

    if netem.is_some() {
        let impair = Path::new(env!("CARGO_BIN_EXE_tether-impair"));
        match netns::impairment_unavailable(impair) {
            Some(why) => eprintln!(
                "SKIPPED kernel_made_faults, delay, loss, reordering and duplication: {why}"
            ),
            None => {
                let none = Impairment::default();
                for (impairment, messages) in [
                    (
                        Impairment {
                            delay_ms: 50,
                            jitter_ms: 20,
                            ..none
                        },
                        100,
                    ),
                    (
                        Impairment {
                            loss_permille: 30,
                            ..none
                        },
                        500,
                    ),
                    (
                        Impairment {
                            delay_ms: 10,
                            reorder_percent: 25,
                            ..none
                        },
                        200,
                    ),
                    (
                        Impairment {
                            duplicate_percent: 5,
                            ..none
                        },
                        1000,
                    ),
                    (
                        Impairment {
                            delay_ms: 20,
                            jitter_ms: 10,
                            loss_permille: 20,
                            duplicate_percent: 2,
                            reorder_percent: 10,
                        },
                        1000,
                    ),
                ] {
                    run.topology_mut()
                        .impair(impair, Some(impairment))
                        .expect("impaired");
                    let start = Instant::now();
                    run.send(messages).await;
                    run.settle().await;
                    let elapsed = start.elapsed();
                    // The fault hit real packets (netfilter's own counters), or the run
                    // proves nothing.
                    let did = run.topology().impaired().expect("counters");
                    assert_eq!(
                        (did.dropped > 0, did.duplicated > 0, did.held > 0),
                        (
                            impairment.loss_permille > 0,
                            impairment.duplicate_percent > 0,
                            impairment.delay_ms > 0
                        ),
                        "{impairment}: {did}"
                    );
                    figures.push(format!(
                        "netfilter {impairment}: {messages} in {elapsed:?} ({did})"
                    ));
                    run.topology_mut().impair(impair, None).expect("unimpaired");
                }
            }
        }
    }

    run.assert_exactly_once_in_order();
    eprintln!(
        "kernel_made_faults: {} messages, nothing lost, duplicated or reordered\n  {}",
        run.sent(),
        figures.join("\n  ")
    );
    run.stop().await;
}
