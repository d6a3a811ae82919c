//! The brokers tether is measured beside: NATS JetStream (file store, `Nats-Msg-Id` dedupe, 256
//! publish acks outstanding) and mosquitto (MQTT QoS 2 both ways, persistent sessions, 100 in
//! flight). Each is started here on 127.0.0.1 with its data in a scratch directory when its
//! server is on `PATH`, and skipped with a sentence when it is not.
//!
//! The workload is tether's: `messages` bodies of `size` bytes (each carrying its index), one
//! producer and one consumer, every delivery checked for loss, duplicates and order. When
//! `strace` is on `PATH`, a second, shorter run of the same workload goes with the server under
//! it, counting the sync calls, and the row reports the server's fsyncs per message. (Tracing
//! slows a Go server's threads several times over even when filtered to those calls, so the
//! timed run is never traced.)

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use tokio::process::{Child, Command};
use tokio::sync::watch;

use crate::{
    body, check, cpu_per_message, cpu_seconds, index_of, percentiles, written_bytes,
    written_kb_per_message, Row, Seen,
};

/// How long a broker may take to accept connections after it starts.
const STARTUP: Duration = Duration::from_secs(10);

/// A broker's server process, stopped (and its fsyncs counted) by [`Server::stop`].
struct Server {
    child: Child,
    strace_log: Option<PathBuf>,
}

impl Server {
    /// Starts `program` with `args`, under `strace` (counting sync calls) when `strace` is
    /// given.
    fn start(
        program: &Path,
        args: &[String],
        dir: &Path,
        strace: Option<&Path>,
    ) -> std::io::Result<Self> {
        let strace_log = strace.map(|_| dir.join("strace.log"));
        let mut command = match (strace, &strace_log) {
            (Some(strace), Some(log)) => {
                let mut command = Command::new(strace);
                command
                    .args(["-f", "-c", "--seccomp-bpf", "-o"])
                    .arg(log)
                    .args(["-e", "trace=fsync,fdatasync,sync_file_range,msync"])
                    .arg(program);
                command
            }
            _ => Command::new(program),
        };
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        Ok(Self {
            child: command.spawn()?,
            strace_log,
        })
    }

    /// Stops the server with SIGTERM (under strace, the server itself: strace then writes its
    /// summary and exits) and returns the sync calls it made, when they were counted.
    async fn stop(mut self) -> Option<u64> {
        if let Some(pid) = self.child.id() {
            let pid = pid.to_string();
            let _ = match self.strace_log {
                Some(_) => std::process::Command::new("pkill")
                    .args(["-TERM", "-P", &pid])
                    .status(),
                None => std::process::Command::new("kill")
                    .args(["-TERM", &pid])
                    .status(),
            };
        }
        let waited = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
        if waited.is_err() {
            let _ = self.child.kill().await;
        }
        let log = std::fs::read_to_string(self.strace_log.as_ref()?).ok()?;
        Some(sync_calls(&log))
    }
}

/// Sums the `calls` column of an `strace -c` summary over the sync syscalls.
fn sync_calls(log: &str) -> u64 {
    log.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let name = *fields.last()?;
            if !matches!(name, "fsync" | "fdatasync" | "sync_file_range" | "msync") {
                return None;
            }
            // % time, seconds, usecs/call, calls, [errors], syscall
            fields.get(3)?.parse::<u64>().ok()
        })
        .sum()
}

/// The full path of `program` when it is on `PATH` (or in the sbin directories, where Debian
/// installs both servers).
pub(crate) fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// A free TCP port on 127.0.0.1 (bound and released; nothing else on this machine races it
/// within a benchmark run).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free port on 127.0.0.1")
}

/// Waits until something accepts TCP connections on `port`.
async fn wait_listening(port: u16) -> Result<(), String> {
    let deadline = Instant::now() + STARTUP;
    loop {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("nothing listens on 127.0.0.1:{port}"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn fresh_dir(dir: &Path) -> PathBuf {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("bench dir");
    dir.to_path_buf()
}

/// How a broker run went: its row, or why it was skipped.
pub(crate) enum Outcome {
    Ran(Row),
    Skipped(String),
}

/// How to start a broker and drive the workload against it.
struct Broker<'a> {
    name: &'a str,
    program: PathBuf,
    /// Writes what the server needs into the directory and returns its arguments.
    setup: &'a dyn Fn(&Path, u16) -> std::io::Result<Vec<String>>,
}

impl Broker<'_> {
    /// One run of `messages` against a fresh server: the row, and the server's sync calls
    /// when it ran under `strace`.
    async fn run<F, Fut>(
        &self,
        dir: &Path,
        messages: u64,
        strace: Option<&Path>,
        drive: &F,
    ) -> Result<(Row, Option<u64>), String>
    where
        F: Fn(u16, u64) -> Fut,
        Fut: std::future::Future<Output = Result<Row, String>>,
    {
        let dir = fresh_dir(dir);
        let port = free_port();
        let args = (self.setup)(&dir, port).map_err(|e| format!("{} setup: {e}", self.name))?;
        let server = Server::start(&self.program, &args, &dir, strace)
            .map_err(|e| format!("{} did not start: {e}", self.name))?;
        let client_before = cpu_seconds(None);
        let written_before = written_bytes(&dir);
        let row = drive(port, messages).await;
        // The client's share of this run, and all the server did (start-up included).
        let client = cpu_per_message(client_before, cpu_seconds(None), messages);
        let server_cpu = cpu_per_message(Some(0.0), cpu_seconds(server.child.id()), messages);
        // Before the server stops: what it wrote during the run, flushed from the page cache.
        let server_written = written_kb_per_message(written_before, written_bytes(&dir), messages);
        let syncs = server.stop().await;
        let mut row = row?;
        row.cpu_us_per_message = client.zip(server_cpu).map(|(a, b)| a + b);
        row.written_kb_per_message = server_written;
        Ok((row, syncs))
    }

    /// The timed run, then (with `strace` on `PATH`) a counted run of at most 2,000 messages.
    async fn measure<F, Fut>(&self, dir: &Path, messages: u64, drive: F) -> Outcome
    where
        F: Fn(u16, u64) -> Fut,
        Fut: std::future::Future<Output = Result<Row, String>>,
    {
        let mut row = match self.run(&dir.join("timed"), messages, None, &drive).await {
            Ok((row, _)) => row,
            Err(error) => return Outcome::Skipped(format!("{} failed: {error}", self.name)),
        };
        if let Some(strace) = which("strace") {
            let counted = messages.min(2_000);
            let counted_dir = dir.join("counted");
            let run = self.run(&counted_dir, counted, Some(&strace), &drive);
            if let Ok((counted_row, Some(syncs))) = run.await {
                if counted_row.verdict == "ok" {
                    row.fsyncs_per_message = Some(syncs as f64 / counted as f64);
                }
            }
        }
        Outcome::Ran(row)
    }
}

/// How the JetStream client is configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JetStreamShape {
    /// async-nats's defaults for the consumer (`Consumer::messages`: pulls of 200, with
    /// heartbeats), 256 publish acks outstanding.
    Defaults,
    /// As the outside harness set it: pulls of 256 messages at a time (`Consumer::batch`), 256
    /// publish acks outstanding.
    Tuned,
    /// One publish at a time, its ack awaited.
    Sync,
}

/// NATS JetStream: a file-store stream with a dedupe window, one durable pull consumer with
/// explicit acks; the producer publishes with a `Nats-Msg-Id` (see [`JetStreamShape`]).
pub(crate) async fn jetstream(
    dir: &Path,
    messages: u64,
    size: usize,
    shape: JetStreamShape,
) -> Outcome {
    let Some(program) = which("nats-server") else {
        return Outcome::Skipped("nats-server is not on PATH (Debian: nats-server)".into());
    };
    let setup = |dir: &Path, port: u16| {
        Ok(vec![
            "-js".to_owned(),
            "-a".to_owned(),
            "127.0.0.1".to_owned(),
            "-p".to_owned(),
            port.to_string(),
            "-sd".to_owned(),
            dir.join("store").display().to_string(),
        ])
    };
    let broker = Broker {
        name: "NATS JetStream",
        program,
        setup: &setup,
    };
    broker
        .measure(dir, messages, |port, messages| {
            jetstream_run(port, messages, size, shape)
        })
        .await
}

async fn jetstream_run(
    port: u16,
    messages: u64,
    size: usize,
    shape: JetStreamShape,
) -> Result<Row, String> {
    use async_nats::jetstream::{self, consumer, stream};
    let sync = shape == JetStreamShape::Sync;
    let error = |e: &dyn std::fmt::Display| e.to_string();
    wait_listening(port).await?;
    let client = async_nats::connect(format!("127.0.0.1:{port}"))
        .await
        .map_err(|e| error(&e))?;
    let js = jetstream::ContextBuilder::new()
        .max_ack_inflight(256)
        .backpressure_on_inflight(true)
        .build(client);
    let created = js
        .create_stream(stream::Config {
            name: "bench".into(),
            subjects: vec!["bench".into()],
            storage: stream::StorageType::File,
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .map_err(|e| error(&e))?;
    let consumer = created
        .create_consumer(consumer::pull::Config {
            durable_name: Some("consumer".into()),
            ack_policy: consumer::AckPolicy::Explicit,
            max_ack_pending: 10_000,
            ..Default::default()
        })
        .await
        .map_err(|e| error(&e))?;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (count_tx, mut count) = watch::channel(0u64);
    let consumer_seen = seen.clone();
    let deliver = move |message: async_nats::jetstream::Message| {
        consumer_seen
            .lock()
            .expect("lock")
            .record("bench", index_of(&message.payload));
        count_tx.send_modify(|n| *n += 1);
        message
    };
    let consumer_task = if shape == JetStreamShape::Tuned {
        // Pulls of 256, each waiting up to 100 ms to fill.
        tokio::spawn(async move {
            loop {
                let Ok(mut batch) = consumer
                    .batch()
                    .max_messages(256)
                    .expires(Duration::from_millis(100))
                    .messages()
                    .await
                else {
                    return;
                };
                while let Some(message) = batch.next().await {
                    let Ok(message) = message else { continue };
                    let _ = deliver(message).ack().await;
                }
            }
        })
    } else {
        let mut deliveries = consumer.messages().await.map_err(|e| error(&e))?;
        tokio::spawn(async move {
            while let Some(message) = deliveries.next().await {
                let Ok(message) = message else { continue };
                let _ = deliver(message).ack().await;
            }
        })
    };
    let started = Instant::now();
    let mut sent_at = Vec::with_capacity(messages as usize);
    let mut latencies = Vec::new();
    let mut failed = 0u64;
    let mut outstanding = VecDeque::new();
    for index in 0..messages {
        let publish = jetstream::message::PublishMessage::build()
            .payload(Bytes::from(body(index, size)))
            .message_id(format!("m{index}"));
        sent_at.push(Instant::now());
        match js.send_publish("bench", publish).await {
            Ok(ack) if sync => {
                failed += u64::from(ack.await.is_err());
                latencies.push(sent_at[index as usize].elapsed().as_secs_f64() * 1e3);
            }
            Ok(ack) => outstanding.push_back(ack),
            Err(_) => failed += 1,
        }
        while outstanding.len() >= 256 {
            let ack = outstanding.pop_front().expect("non-empty");
            failed += u64::from(ack.await.is_err());
        }
    }
    for ack in outstanding {
        failed += u64::from(ack.await.is_err());
    }
    let expected = messages - failed.min(messages);
    let waited =
        tokio::time::timeout(Duration::from_secs(120), count.wait_for(|n| *n >= expected)).await;
    let seconds = started.elapsed().as_secs_f64();
    consumer_task.abort();
    if waited.is_err() {
        failed += 1;
    }
    let seen = std::mem::take(&mut *seen.lock().expect("lock"));
    if !sync {
        latencies = seen.latencies_ms(&sent_at);
    }
    let (p50_ms, p99_ms) = percentiles(&mut latencies);
    Ok(Row {
        what: match shape {
            JetStreamShape::Sync => {
                "NATS JetStream, one publish awaited at a time (ack latency)".into()
            }
            JetStreamShape::Defaults => {
                "NATS JetStream, file store, Msg-Id dedupe, 256 acks outstanding, client defaults"
                    .into()
            }
            JetStreamShape::Tuned => {
                "NATS JetStream, file store, Msg-Id dedupe, 256 acks outstanding, pulls of 256"
                    .into()
            }
        },
        messages,
        seconds,
        p50_ms,
        p99_ms,
        verdict: check(&seen, &["bench".to_owned()], messages, failed),
        fsyncs_per_message: None,
        cpu_us_per_message: None,
        store_busy: None,
        written_kb_per_message: None,
    })
}

/// mosquitto: QoS 2 from the producer and to the consumer, both with persistent sessions,
/// 100 messages in flight each way, persistence on, no queue limit (so nothing is dropped).
pub(crate) async fn mosquitto(dir: &Path, messages: u64, size: usize) -> Outcome {
    let Some(program) = which("mosquitto") else {
        return Outcome::Skipped("mosquitto is not on PATH (Debian: mosquitto)".into());
    };
    let setup = |dir: &Path, port: u16| {
        let config = dir.join("mosquitto.conf");
        std::fs::write(
            &config,
            format!(
                "listener {port} 127.0.0.1\nallow_anonymous true\npersistence true\n\
                 persistence_location {}/\nmax_inflight_messages 100\nmax_queued_messages 0\n",
                dir.display()
            ),
        )?;
        Ok(vec!["-c".to_owned(), config.display().to_string()])
    };
    let broker = Broker {
        name: "mosquitto",
        program,
        setup: &setup,
    };
    broker
        .measure(dir, messages, |port, messages| {
            mosquitto_run(port, messages, size)
        })
        .await
}

async fn mosquitto_run(port: u16, messages: u64, size: usize) -> Result<Row, String> {
    use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
    wait_listening(port).await?;
    let options = |id: &str| {
        let mut options = MqttOptions::new(id, "127.0.0.1", port);
        options
            .set_clean_session(false)
            .set_inflight(100)
            .set_keep_alive(Duration::from_secs(30))
            .set_max_packet_size(size + 1024, size + 1024);
        options
    };
    // The consumer subscribes (and is acknowledged) before anything is published.
    let (consumer, mut consumer_loop) = AsyncClient::new(options("bench-consumer"), 1024);
    consumer
        .subscribe("bench", QoS::ExactlyOnce)
        .await
        .map_err(|e| e.to_string())?;
    loop {
        match consumer_loop.poll().await {
            Ok(Event::Incoming(Packet::SubAck(_))) => break,
            Ok(_) => {}
            Err(error) => return Err(format!("consumer: {error}")),
        }
    }
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (count_tx, mut count) = watch::channel(0u64);
    let consumer_seen = seen.clone();
    let consumer_task = tokio::spawn(async move {
        let _keep = consumer;
        loop {
            match consumer_loop.poll().await {
                Ok(Event::Incoming(Packet::Publish(publish))) => {
                    consumer_seen
                        .lock()
                        .expect("lock")
                        .record("bench", index_of(&publish.payload));
                    count_tx.send_modify(|n| *n += 1);
                }
                Ok(_) => {}
                Err(_) => return,
            }
        }
    });
    let (producer, mut producer_loop) = AsyncClient::new(options("bench-producer"), 1024);
    let (completed_tx, mut completed) = watch::channel(0u64);
    let producer_task = tokio::spawn(async move {
        loop {
            match producer_loop.poll().await {
                Ok(Event::Incoming(Packet::PubComp(_))) => completed_tx.send_modify(|n| *n += 1),
                Ok(_) => {}
                Err(_) => return,
            }
        }
    });
    let started = Instant::now();
    let mut sent_at = Vec::with_capacity(messages as usize);
    let mut failed = 0u64;
    for index in 0..messages {
        sent_at.push(Instant::now());
        failed += u64::from(
            producer
                .publish("bench", QoS::ExactlyOnce, false, body(index, size))
                .await
                .is_err(),
        );
    }
    let limit = Duration::from_secs(120);
    let expected = messages - failed.min(messages);
    let published = tokio::time::timeout(limit, completed.wait_for(|n| *n >= expected)).await;
    let delivered = tokio::time::timeout(limit, count.wait_for(|n| *n >= expected)).await;
    let seconds = started.elapsed().as_secs_f64();
    producer_task.abort();
    consumer_task.abort();
    failed += u64::from(published.is_err()) + u64::from(delivered.is_err());
    let seen = std::mem::take(&mut *seen.lock().expect("lock"));
    let mut latencies = seen.latencies_ms(&sent_at);
    let (p50_ms, p99_ms) = percentiles(&mut latencies);
    Ok(Row {
        what: "mosquitto, QoS 2 both ways, persistent sessions, 100 in flight".into(),
        messages,
        seconds,
        p50_ms,
        p99_ms,
        verdict: check(&seen, &["bench".to_owned()], messages, failed),
        fsyncs_per_message: None,
        cpu_us_per_message: None,
        store_busy: None,
        written_kb_per_message: None,
    })
}

#[cfg(test)]
mod tests {
    use super::sync_calls;

    #[test]
    fn sums_the_sync_calls_of_an_strace_summary() {
        let log = "% time     seconds  usecs/call     calls    errors syscall\n\
                   ------ ----------- ----------- --------- --------- ----------------\n\
                   100.00    0.000120          60         2           fsync\n\
                     0.00    0.000000           0         3         1 fdatasync\n\
                   ------ ----------- ----------- --------- --------- ----------------\n\
                   100.00    0.000120          24         5         1 total\n";
        assert_eq!(sync_calls(log), 5);
        assert_eq!(sync_calls(""), 0);
    }
}
