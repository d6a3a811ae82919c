//! `tether node --json` as a child process: spawned, written to, killed, and its event lines
//! forwarded on one channel tagged with the node's name and incarnation. `tether demo` drives
//! its nodes with this, and so do the end-to-end tests.

use std::path::Path;
use std::process::Stdio;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

/// One line a node printed. A line that is not JSON arrives as
/// `{"event": "not_json", "line": ...}`.
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
    /// The `event` field (empty when absent).
    pub fn kind(&self) -> &str {
        self.value["event"].as_str().unwrap_or_default()
    }

    /// A string field (empty when absent).
    pub fn text(&self, key: &str) -> String {
        self.value[key].as_str().unwrap_or_default().to_owned()
    }
}

/// A running `<tether> node <args> --json`.
pub struct NodeProc {
    child: Child,
    stdin: ChildStdin,
    /// Its incarnation.
    pub life: u64,
}

impl NodeProc {
    /// Starts `<tether> node <args> --json` (stderr inherited); its events go to `events`.
    pub fn spawn(
        tether: &Path,
        name: &'static str,
        life: u64,
        args: &[String],
        events: mpsc::UnboundedSender<Event>,
    ) -> std::io::Result<Self> {
        Self::spawn_wrapped(&[], tether, "node", name, life, args, events)
    }

    /// Starts `<wrapper...> <tether> <command> <args> --json` (no wrapper: `tether` itself;
    /// or for instance `ip netns exec NS`, which becomes the process it runs); its events go
    /// to `events`.
    pub fn spawn_wrapped(
        wrapper: &[&str],
        tether: &Path,
        command: &str,
        name: &'static str,
        life: u64,
        args: &[String],
        events: mpsc::UnboundedSender<Event>,
    ) -> std::io::Result<Self> {
        let mut line = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut line = Command::new(program);
                line.args(rest).arg(tether);
                line
            }
            None => Command::new(tether),
        };
        let mut child = line
            .arg(command)
            .args(args)
            .arg("--json")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(std::io::Error::other("the child's pipes are missing"));
        };
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let value = serde_json::from_str(&line)
                    .unwrap_or_else(|_| json!({ "event": "not_json", "line": line }));
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
        Ok(Self { child, stdin, life })
    }

    /// Its process id, while it runs.
    pub fn id(&self) -> Option<u32> {
        self.child.id()
    }

    /// Writes command lines to its stdin.
    pub async fn write(&mut self, commands: &str) -> std::io::Result<()> {
        self.stdin.write_all(commands.as_bytes()).await?;
        self.stdin.flush().await
    }

    /// SIGKILL, and waits until it is gone.
    pub async fn kill(&mut self) -> std::io::Result<()> {
        self.child.start_kill()?;
        self.child.wait().await.map(drop)
    }

    /// `quit`, and waits for it to exit.
    pub async fn quit(mut self) {
        let _ = self.write("quit\n").await;
        let _ = self.child.wait().await;
    }
}

/// A free UDP port on 127.0.0.1 (a node restarted on it is found where it was).
pub fn free_port() -> std::io::Result<u16> {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0")?;
    Ok(socket.local_addr()?.port())
}
