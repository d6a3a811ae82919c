//! tether-benches: criterion benchmarks, each reported beside a baseline measured in the same
//! run (`cargo bench -p tether-benches`).

use iroh::endpoint::{presets, Connection};
use iroh::{Endpoint, EndpointAddr, RelayMode, SecretKey};

/// A bare iroh endpoint on 127.0.0.1 (no relay, no discovery) accepting `alpn`: the raw
/// baseline the benchmarks put tether beside.
pub async fn loopback_endpoint(alpn: &[u8]) -> Endpoint {
    Endpoint::builder(presets::Minimal)
        .secret_key(SecretKey::generate())
        .relay_mode(RelayMode::Disabled)
        .alpns(vec![alpn.to_vec()])
        .bind_addr(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("a loopback address")
        .bind()
        .await
        .expect("bind")
}

/// Where `endpoint` can be dialed directly (its bound sockets, no relay).
pub fn direct_addr(endpoint: &Endpoint) -> EndpointAddr {
    endpoint
        .bound_sockets()
        .into_iter()
        .fold(EndpointAddr::new(endpoint.id()), EndpointAddr::with_ip_addr)
}

/// Two bare endpoints on 127.0.0.1 accepting `alpn` ([`loopback_endpoint`]) and one
/// connection between them: the dialer, the listener, the dialer's side and the listener's.
pub async fn loopback_connection(
    alpn: &'static [u8],
) -> (Endpoint, Endpoint, Connection, Connection) {
    let (dialer, listener) = (loopback_endpoint(alpn).await, loopback_endpoint(alpn).await);
    let accepting = {
        let listener = listener.clone();
        tokio::spawn(async move {
            listener
                .accept()
                .await
                .expect("incoming")
                .await
                .expect("connection")
        })
    };
    let dialed = dialer
        .connect(direct_addr(&listener), alpn)
        .await
        .expect("connect");
    let accepted = accepting.await.expect("the accepting task");
    (dialer, listener, dialed, accepted)
}

/// CPU time this process's threads have been on a CPU so far, in nanoseconds: the sum of the
/// first field of every `/proc/self/task/*/schedstat` (Linux; `None` elsewhere). Finer than
/// the `USER_HZ` ticks of `/proc/self/stat`, so short rounds can be told apart. A thread that
/// ended between two readings takes its time with it: read around work whose threads live on.
pub fn thread_cpu_ns() -> Option<u64> {
    let mut total = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        // A thread may end between the listing and the read.
        if let Some(ns) = schedstat_ns(&task.ok()?.path().join("schedstat")) {
            total += ns;
        }
    }
    Some(total)
}

/// CPU time the calling thread has been on a CPU so far, in nanoseconds
/// (`/proc/thread-self/schedstat`; `None` off Linux): with [`thread_cpu_ns`], what a
/// benchmark's own thread spent apart from the runtime's.
pub fn caller_cpu_ns() -> Option<u64> {
    schedstat_ns(std::path::Path::new("/proc/thread-self/schedstat"))
}

fn schedstat_ns(path: &std::path::Path) -> Option<u64> {
    let stat = std::fs::read_to_string(path).ok()?;
    stat.split_whitespace().next()?.parse().ok()
}

/// A process's resident memory now and at its peak, in MB (`VmRSS`, `VmHWM` of
/// `/proc/<pid>/status`; `pid` "self" for this process; zeros where unreadable).
pub fn memory(pid: &str) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// The value after flag `name` in `args` (underscores allowed: `1_000`), else `default`.
pub fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.windows(2)
        .find(|pair| pair[0] == name)
        .and_then(|pair| pair[1].replace('_', "").parse().ok())
        .unwrap_or(default)
}

/// Two in-memory substrate machines (core's harness, every persist acknowledged at once)
/// with `objects` queues `q0`, `q1`, ... opened by A, under `config`: what the core benches
/// and the instruction-count workload start from.
pub fn harness_with_queues(
    config: tether_core::substrate::Config,
    objects: usize,
    latency: std::time::Duration,
) -> tether_core::substrate::harness::Harness {
    use tether_core::substrate::harness::{Harness, Party};
    use tether_core::wire::envelope::ObjKind;
    let mut h = Harness::allowing_all(config, 1);
    h.latency = latency;
    h.connect();
    for object in 0..objects {
        let name = format!("q{object}");
        h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, &name, None))
            .expect("a fresh queue opens");
    }
    h.run();
    h
}
