//! The `tether` command, as a library so that a test crate can build the same program as its
//! own binary (`tether_cli::main`), under its own feature set.
//!
//! - `tether inspect <actor|telemetry|bifaci|envelope> [FILE]`: decode captured wire bytes
//!   (stdin without FILE) into JSON lines; exit 1 on malformed input.
//! - `tether store check|repair <PATH>`: what a log store's file holds (commits that verify,
//!   damage, a torn tail) as one JSON object; `repair` keeps every commit that verifies and
//!   drops the damaged bytes. PATH is the log file or a node's data directory. `check` exits
//!   1 when the file is damaged.
//! - `tether cap match <candidate> <request>`: `{"dispatchable": true|false}`.
//! - `tether cap rank <request> <cap>...`: `{"ranked": [...]}`, the dispatchable caps best
//!   first, in canonical form.
//!
//! - `tether switch --master unix:PATH [--master unix:PATH]... call CAP [--input TEXT]`: attach
//!   bifaci version 6 masters (capdag's included) and make one request; the answer's text on
//!   stdout and exit 0, or the ERR's code and message and exit 1 (2: a master could not be
//!   attached, in a sentence).
//! - `tether host --listen unix:PATH [--echo CAP]... [--upper CAP]...`: serve two built-in
//!   handlers to every switch (capdag's included) that connects, until killed.
//!
//! A cap that does not parse prints `{"error": "<kind>", "offset": N}` (the byte offset in
//! that cap) and exits 1.

use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

mod bifaci;
mod demo;
mod demo_many;
mod node;
pub mod procs;
use tether::inspect::{inspect, WireFormat};

#[derive(Parser)]
#[command(
    name = "tether",
    version,
    about = "Reliable, authenticated messaging over iroh"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where a node keeps its substrate state (`--store`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub(crate) enum StoreChoice {
    /// `store.sqlite3`: SQLite, WAL, `synchronous=FULL`.
    #[default]
    Sqlite,
    /// `store.log`: one append-only file, synced per commit.
    Log,
}

impl StoreChoice {
    /// Its spelling on the command line.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            StoreChoice::Sqlite => "sqlite",
            StoreChoice::Log => "log",
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Two real nodes on 127.0.0.1 with durable stores: A sends over queues and a session
    /// while B is killed with SIGKILL and restarted and the link is cut; prints a table and
    /// exits non-zero if anything was lost, duplicated or reordered.
    Demo {
        /// Messages (and requests) A sends.
        #[arg(long, default_value_t = 20_000)]
        messages: u64,
        /// Queues they are spread over (besides one session).
        #[arg(long, default_value_t = 4)]
        queues: u64,
        /// Requests on the session among the messages.
        #[arg(long, default_value_t = 200)]
        requests: u64,
        /// Requests routed through the request switch to B's host, besides.
        #[arg(long, default_value_t = 200)]
        routes: u64,
        /// Body size in bytes.
        #[arg(long, default_value_t = 64)]
        size: usize,
        /// How many times a node is killed (B with two nodes; any node with more).
        #[arg(long, default_value_t = 2)]
        kills: u64,
        /// Nodes: 2 (A sends to B), or more: each sends over a queue to each of its next
        /// three, any node may be killed, and the table has a row per pair.
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(2..=256))]
        nodes: u16,
        /// Run iroh's relay server (`tether relay`) on 127.0.0.1 and home every node on it.
        #[arg(long)]
        relay: bool,
        /// The nodes' store.
        #[arg(long, value_enum, default_value_t = StoreChoice::Sqlite)]
        store: StoreChoice,
        /// Keep the nodes' data here instead of a temporary directory.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Only the table.
        #[arg(long)]
        quiet: bool,
        /// The table as one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Run a long-running node: its key and store in --data, commands on stdin
    /// ('help' lists them), its ticket printed at start.
    Node {
        /// Data directory: the node's secret key (its id survives restarts) and its store.
        #[arg(long)]
        data: PathBuf,
        /// Socket to listen on (default: a free port on 127.0.0.1).
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// Ticket of a node to talk to: the iroh endpoint ticket it prints at start (or
        /// `<id>@<ip:port>`).
        #[arg(long)]
        connect: Vec<String>,
        /// Relay to home on: a relay URL (`tether relay` prints one), `default` (iroh's public
        /// relays) or `disabled` (direct addresses only).
        #[arg(long, default_value = "disabled", value_parser = node::parse_relay)]
        relay: node::RelayChoice,
        /// Serve the node's metrics in Prometheus text format on this socket (GET /metrics).
        #[arg(long)]
        metrics: Option<std::net::SocketAddr>,
        /// One JSON object per line on stdout, for scripts.
        #[arg(long)]
        json: bool,
        /// Where the substrate's state lives in --data.
        #[arg(long, value_enum, default_value_t = StoreChoice::Sqlite)]
        store: StoreChoice,
        /// With `--store log`: compact the log once it passes this many bytes (and four
        /// times its last compacted size); 64 MiB unless told. Tests set it low to compact
        /// often.
        #[arg(long)]
        log_compact_bytes: Option<u64>,
    },
    /// Run iroh's relay server (plain HTTP, for a network you trust, such as this machine's
    /// tests and demo) until interrupted; prints its URL for `tether node --relay`.
    Relay {
        /// Socket to serve on (default: a free port on 127.0.0.1).
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: std::net::SocketAddr,
        /// One JSON object per line on stdout, for scripts.
        #[arg(long)]
        json: bool,
    },
    /// Decode captured wire bytes into one JSON object per line.
    Inspect {
        /// The wire format of the bytes: actor, telemetry, bifaci or envelope.
        #[arg(value_parser = wire_format)]
        format: WireFormat,
        /// File to read; stdin when absent.
        file: Option<PathBuf>,
    },
    /// Debug routing: how cap URNs match and rank.
    Cap {
        #[command(subcommand)]
        command: CapCommand,
    },
    /// Check or repair a log store's file (a node's `store.log`), while no node has it open.
    Store {
        #[command(subcommand)]
        command: StoreCommand,
    },
    /// A request switch over Unix sockets: attach masters (capdag's or tether's), then act.
    Switch {
        /// A master listening on a Unix socket, as `unix:PATH`; repeat for more.
        #[arg(long = "master", required = true)]
        masters: Vec<String>,
        /// The network policy every master is told: offline, no_telemetry or full.
        #[arg(long, default_value = "full")]
        policy: tether::switch::NetworkPolicy,
        /// Seconds each attach, and the answer, may take.
        #[arg(long, default_value_t = 30)]
        timeout: u64,
        #[command(subcommand)]
        command: SwitchCommand,
    },
    /// A switch host on a Unix socket serving built-in handlers to every switch that connects.
    Host {
        /// Where to listen, as `unix:PATH`.
        #[arg(long)]
        listen: String,
        /// Answer this cap with its input unchanged; repeat for more.
        #[arg(long)]
        echo: Vec<String>,
        /// Answer this cap with its input uppercased; repeat for more.
        #[arg(long)]
        upper: Vec<String>,
    },
}

#[derive(Subcommand)]
enum SwitchCommand {
    /// Make one request and print its answer.
    Call {
        /// The cap asked for.
        cap: String,
        /// The request's input, as text (one chunk); none when absent.
        #[arg(long)]
        input: Option<String>,
    },
}

#[derive(Subcommand)]
enum StoreCommand {
    /// Report what the file holds, changing nothing: commits that verify, damaged byte
    /// ranges, a torn tail. Exits 1 when it is damaged (a node refuses to open it).
    Check {
        /// The log file, or a node's data directory (its `store.log`).
        path: PathBuf,
    },
    /// Keep every commit that verifies, before and after any damage, and drop the damaged
    /// bytes (what they held is lost: the report says how much).
    Repair {
        /// The log file, or a node's data directory (its `store.log`).
        path: PathBuf,
    },
}

#[derive(Subcommand)]
enum CapCommand {
    /// Whether a request for `request` may be dispatched to a handler of `candidate`.
    Match {
        /// The cap a handler serves.
        candidate: String,
        /// The cap a request asks for.
        request: String,
    },
    /// The caps that may serve `request`, best first (as the switch ranks them).
    Rank {
        /// The cap a request asks for.
        request: String,
        /// Candidate caps, in registration order.
        caps: Vec<String>,
    },
}

/// Parses a wire format name for clap.
fn wire_format(name: &str) -> Result<WireFormat, String> {
    name.parse()
        .map_err(|error: tether::inspect::UnknownFormat| error.to_string())
}

/// Runs the `tether` command with the process's arguments.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // Diagnostics on stderr when RUST_LOG asks for them (stdout stays the command's output).
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    match cli.command {
        Command::Demo {
            messages,
            queues,
            requests,
            routes,
            size,
            kills,
            nodes,
            relay,
            store,
            dir,
            quiet,
            json,
        } => run_demo(demo::Options {
            relay,
            messages,
            queues,
            requests,
            routes,
            size,
            kills,
            store,
            dir,
            quiet,
            json,
            nodes: usize::from(nodes),
        }),
        Command::Node {
            data,
            listen,
            connect,
            json,
            store,
            relay,
            metrics,
            log_compact_bytes,
        } => run_node(node::Options {
            data,
            listen,
            connect,
            json,
            store,
            relay,
            metrics,
            log_compact_bytes,
        }),
        Command::Relay { listen, json } => run_async(
            "relay",
            node::run_relay(listen, json),
            |()| ExitCode::SUCCESS,
            ExitCode::FAILURE,
        ),
        Command::Inspect { format, file } => run_inspect(format, file),
        Command::Cap { command } => run_cap(command),
        Command::Store { command } => run_store(command),
        Command::Switch {
            masters,
            policy,
            timeout,
            command: SwitchCommand::Call { cap, input },
        } => run_switch_call(masters, policy, timeout, cap, input),
        Command::Host {
            listen,
            echo,
            upper,
        } => run_host(listen, echo, upper),
    }
}

fn run_switch_call(
    masters: Vec<String>,
    policy: tether::switch::NetworkPolicy,
    timeout: u64,
    cap: String,
    input: Option<String>,
) -> ExitCode {
    let deadline = std::time::Duration::from_secs(timeout);
    run_async(
        "switch",
        async move { bifaci::call(&masters, policy, &cap, input.as_deref(), deadline).await },
        |answer| match answer {
            bifaci::Answer::Body(body) => {
                let mut out = io::stdout().lock();
                let _ = out.write_all(&body).and_then(|()| out.write_all(b"\n"));
                ExitCode::SUCCESS
            }
            bifaci::Answer::Failed { code, message } => {
                eprintln!("tether switch: the request failed: {code}: {message}");
                ExitCode::FAILURE
            }
        },
        ExitCode::from(2),
    )
}

fn run_host(listen: String, echo: Vec<String>, upper: Vec<String>) -> ExitCode {
    if echo.is_empty() && upper.is_empty() {
        eprintln!("tether host: nothing to serve: give at least one --echo CAP or --upper CAP");
        return ExitCode::from(2);
    }
    let served = async move {
        let path = bifaci::unix_path(&listen)?;
        bifaci::host(&path, &echo, &upper, || {
            println!("listening on {listen}");
            let _ = io::stdout().flush();
        })
        .await
    };
    run_async("host", served, |()| ExitCode::SUCCESS, ExitCode::FAILURE)
}

fn run_store(command: StoreCommand) -> ExitCode {
    use tether::store::{LogCheck, LogStore};
    let (verb, path, result) = match command {
        StoreCommand::Check { path } => {
            let path = log_path(path);
            let result = LogStore::check(&path);
            ("check", path, result)
        }
        StoreCommand::Repair { path } => {
            let path = log_path(path);
            let result = LogStore::repair(&path);
            ("repair", path, result)
        }
    };
    match result {
        Ok(found) => {
            let LogCheck {
                version,
                commits,
                peers,
                end,
                damaged,
                torn_tail,
                prepared,
            } = &found;
            let damaged: Vec<[u64; 2]> = damaged.iter().map(|r| [r.start, r.end]).collect();
            println!(
                "{}",
                serde_json::json!({
                    "path": path.display().to_string(),
                    "sound": found.is_sound(),
                    "version": version,
                    "commits": commits,
                    "peers": peers,
                    "end": end,
                    "damaged": damaged,
                    "damaged_bytes": found.damaged_bytes(),
                    "torn_tail_bytes": torn_tail,
                    "prepared_bytes": prepared,
                    "repaired": verb == "repair" && !found.is_sound(),
                })
            );
            if verb == "check" && !found.is_sound() {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(error) => {
            eprintln!("tether store {verb}: {error}");
            ExitCode::from(2)
        }
    }
}

/// A log file, or a data directory's `store.log`.
fn log_path(path: PathBuf) -> PathBuf {
    if path.is_dir() {
        path.join("store.log")
    } else {
        path
    }
}

fn run_demo(options: demo::Options) -> ExitCode {
    run_async("demo", demo::run(options), |code| code, ExitCode::from(2))
}

fn run_node(options: node::Options) -> ExitCode {
    run_async(
        "node",
        node::run(options),
        |()| ExitCode::SUCCESS,
        ExitCode::FAILURE,
    )
}

/// Runs `command`'s future on a fresh runtime: its value becomes the exit code through `ok`;
/// an error is printed as `tether <command>: <error>` and exits with `failed`.
fn run_async<T, E: std::fmt::Display>(
    command: &str,
    future: impl std::future::Future<Output = Result<T, E>>,
    ok: impl FnOnce(T) -> ExitCode,
    failed: ExitCode,
) -> ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("tether {command}: cannot start the runtime: {error}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(future) {
        Ok(value) => ok(value),
        Err(error) => {
            eprintln!("tether {command}: {error}");
            failed
        }
    }
}

fn run_cap(command: CapCommand) -> ExitCode {
    use tether_core::cap::{self, CapUrn};
    let parse = |text: &str| {
        CapUrn::parse(text).map_err(|error| {
            serde_json::json!({
                "error": error.kind.as_str(),
                "offset": error.offset,
            })
        })
    };
    let result = match command {
        CapCommand::Match { candidate, request } => parse(&candidate).and_then(|candidate| {
            let request = parse(&request)?;
            let dispatchable = cap::is_dispatchable(&candidate, &request);
            Ok(serde_json::json!({ "dispatchable": dispatchable }))
        }),
        CapCommand::Rank { request, caps } => parse(&request).and_then(|request| {
            let caps = caps
                .iter()
                .map(|text| parse(text))
                .collect::<Result<Vec<_>, _>>()?;
            let ranked: Vec<String> = cap::rank(&request, &caps, None)
                .into_iter()
                .map(|index| caps[index].to_string())
                .collect();
            Ok(serde_json::json!({ "ranked": ranked }))
        }),
    };
    match result {
        Ok(answer) => {
            println!("{answer}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            println!("{error}");
            ExitCode::FAILURE
        }
    }
}

fn run_inspect(format: WireFormat, file: Option<PathBuf>) -> ExitCode {
    let input = match &file {
        Some(path) => std::fs::read(path),
        None => {
            let mut bytes = Vec::new();
            io::stdin().read_to_end(&mut bytes).map(|_| bytes)
        }
    };
    let input = match input {
        Ok(input) => input,
        Err(error) => {
            let source = file.map_or("stdin".into(), |p| p.display().to_string());
            eprintln!("tether inspect: cannot read {source}: {error}");
            return ExitCode::from(2);
        }
    };
    let stdout = io::stdout();
    let mut out = io::BufWriter::new(stdout.lock());
    let verdict = inspect(format, &input, &mut out);
    let flushed = out.flush();
    match (verdict, flushed) {
        (Ok(verdict), Ok(())) if verdict.error.is_none() => ExitCode::SUCCESS,
        (Ok(_), Ok(())) => ExitCode::FAILURE,
        (Err(error), _) | (_, Err(error)) => {
            eprintln!("tether inspect: cannot write output: {error}");
            ExitCode::from(2)
        }
    }
}
