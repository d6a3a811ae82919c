//! Real `tether node` processes for end-to-end tests: the `tether-under-test` binary of this
//! crate (the `tether` program, built with the tests' own features; a test names it with
//! `env!("CARGO_BIN_EXE_tether-under-test")`), each process's `--json` events on one channel
//! tagged with the process's name and incarnation.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

/// A free UDP port on 127.0.0.1 (a node restarted on it is found where it was).
pub fn free_port() -> u16 {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("probe socket");
    socket.local_addr().expect("bound").port()
}

/// One line a node printed.
#[derive(Debug, Clone)]
pub struct Event {
    /// Which node.
    pub from: &'static str,
    /// Which incarnation of it (1 for the first process, +1 per restart).
    pub life: u64,
    /// The JSON object.
    pub value: Value,
}

impl Event {
    /// The `event` field.
    pub fn kind(&self) -> &str {
        self.value["event"].as_str().unwrap_or_default()
    }

    /// A string field (empty when absent).
    pub fn text(&self, key: &str) -> String {
        self.value[key].as_str().unwrap_or_default().to_owned()
    }
}

/// A running `tether node --json`.
pub struct NodeProc {
    child: Child,
    stdin: ChildStdin,
    /// Its incarnation.
    pub life: u64,
}

impl NodeProc {
    /// Starts `<tether> node <args> --json`; its events go to `events`.
    pub fn spawn(
        tether: &Path,
        name: &'static str,
        life: u64,
        args: &[String],
        events: mpsc::UnboundedSender<Event>,
    ) -> Self {
        let mut child = Command::new(tether)
            .arg("node")
            .args(args)
            .arg("--json")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("tether node starts");
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let value = serde_json::from_str(&line)
                    .unwrap_or_else(|_| panic!("{name} printed a line that is not JSON: {line}"));
                if events
                    .send(Event {
                        from: name,
                        life,
                        value,
                    })
                    .is_err()
                {
                    return;
                }
            }
        });
        Self { child, stdin, life }
    }

    /// Writes command lines to its stdin. A node that died meanwhile (a kill racing the
    /// write) loses them, as a crashed process would.
    pub async fn write(&mut self, commands: &str) {
        let _ = self.stdin.write_all(commands.as_bytes()).await;
        let _ = self.stdin.flush().await;
    }

    /// SIGKILL, and waits until it is gone.
    pub async fn kill(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    /// `quit`, and waits for it to exit.
    pub async fn quit(mut self) {
        self.write("quit\n").await;
        let _ = self.child.wait().await;
    }
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
